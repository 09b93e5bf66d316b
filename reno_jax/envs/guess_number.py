"""Guess the number: the README's "bring your own environment" example, a complete `TextEnv` in one page.

The environment picks a secret in 1..16; the agent calls `guess(number)`, at most five times; the tool answers
"too high" or "too low" and states the numbers the answers so far leave ("8 is too high. It is 1 to 7."), until
the guess is right or the guesses run out.

Reward (one per episode, on its last step): finding the secret on guess k earns 1 - 0.125 (k - 1) (1.0 on the
first guess, 0.5 on the fifth), running out of guesses earns 0, a malformed call or a number outside 1..16 earns
-1 and ends the episode. Any reward that falls with k and puts a late find above a miss has binary search as its
optimum (its search tree has the fewest guesses at every depth): 3.375 guesses on average, every secret found,
0.703 expected reward. The warm-start teacher guesses uniformly among the numbers the answers allow: it finds
the secret in 77% of its episodes, in 3.81 guesses on average counting a miss as five (0.535 expected reward).

Why the answer states the numbers left: with "8 is too high." alone, the tiny model's greedy play read the last
answer only (after "11 is too high" and "1 is too low" it guessed 14, then 11 again): keeping the interval is a
deduction over every earlier turn. With the interval written out, the next guess depends on the last answer
alone (docs/benchmarks.md has what each variant measured).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface, registry
from reno_jax.protocol.chat import ChatSpec, Slot

MAX_NUMBER = 16
MAX_GUESSES = 5
NUMBERS = tuple(str(k) for k in range(MAX_NUMBER + 1))  # option k is the text of k (0 unused)

TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the secret number.",
        "parameters": {
            "type": "object",
            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": MAX_NUMBER}},
            "required": ["number"],
        },
    },
}

# Message values: [the last guess, the lowest and the highest number the answers so far allow]. Tool templates: what
# the answer says. User template 1 is the current state for bounded history (`observation`; value 0 then holds the
# guesses left): no longer than template 0, so the prompt length of the whole conversation does not change.
TOO_HIGH, TOO_LOW, FOUND, OUT, INVALID = range(5)
CHAT = ChatSpec(
    system=f"Find the secret number from 1 to {MAX_NUMBER} with the guess tool. Each answer says higher or lower.",
    tools=(TOOL,),
    user=(
        (f"I picked a number. You have {MAX_GUESSES} guesses.",),
        ("It is ", Slot(1, NUMBERS), " to ", Slot(2, NUMBERS), ". Guesses left: ", Slot(0, NUMBERS), "."),
    ),
    tool=(
        (Slot(0, NUMBERS), " is too high. It is ", Slot(1, NUMBERS), " to ", Slot(2, NUMBERS), "."),
        (Slot(0, NUMBERS), " is too low. It is ", Slot(1, NUMBERS), " to ", Slot(2, NUMBERS), "."),
        (Slot(0, NUMBERS), " is right!"),
        ("Out of guesses.",),
        ("Invalid call.",),
    ),
    tool_continues=(True, True, False, False, False),
    num_values=3,
)

# Reward: finding the secret on guess k (1..MAX_GUESSES) earns FOUND_REWARD - GUESS_COST * (k - 1) (1.0 on the
# first guess down to 0.5 on the fifth); running out of guesses earns 0; a malformed call (or a number out of
# range) earns -1 and ends the episode.
FOUND_REWARD = 1.0
GUESS_COST = 0.125
INVALID_REWARD = -1.0


@flax.struct.dataclass
class Start:
    secret: jax.Array  # int32 [N] in 1..MAX_NUMBER


@flax.struct.dataclass
class State:
    secret: jax.Array
    guesses: jax.Array  # int32 [] made so far
    found: jax.Array  # bool []
    low: jax.Array  # int32 []: the secret is in [low, high] given the answers so far
    high: jax.Array
    wasted: jax.Array  # int32 []: guesses the answers before them had already ruled out


@registry.register_env
@flax.struct.dataclass
class GuessNumberEnv(interface.TextEnv):
    """The whole environment in one class: the episode (`reset`, `apply`) and what the loop needs beside it
    (`sample_starts`, `teacher`, `eval_suites`); an invalid call is the base class's (-1, the last tool template)."""

    name = "guess_number"
    truncation_reward = 0.0
    invalid_call_reward = INVALID_REWARD

    def chat(self):
        return CHAT

    def max_turns(self) -> int:
        return MAX_GUESSES

    def reset(self, start: Start):
        state = State(
            secret=start.secret.astype(jnp.int32),
            guesses=jnp.int32(0),
            found=jnp.bool_(False),
            low=jnp.int32(1),
            high=jnp.int32(MAX_NUMBER),
            wasted=jnp.int32(0),
        )
        return state, interface.Message(jnp.int32(0), jnp.zeros((3,), jnp.int32))

    def apply(self, state: State, call: interface.ToolCall) -> interface.Step:
        guess = call.args[0]
        guesses = state.guesses + 1
        found = guess == state.secret
        out = ~found & (guesses >= MAX_GUESSES)
        template = jnp.select([found, out, guess > state.secret], [FOUND, OUT, TOO_HIGH], TOO_LOW)
        reward = jnp.where(found, FOUND_REWARD - GUESS_COST * (guesses - 1), 0.0)
        low = jnp.where(guess < state.secret, jnp.maximum(state.low, guess + 1), state.low)
        high = jnp.where(guess > state.secret, jnp.minimum(state.high, guess - 1), state.high)
        wasted = state.wasted + ((guess < state.low) | (guess > state.high)).astype(jnp.int32)
        new = State(secret=state.secret, guesses=guesses, found=found, low=low, high=high, wasted=wasted)
        info = dict(found=found, guesses=guesses, wasted=wasted)
        message = interface.Message(template.astype(jnp.int32), jnp.stack([guess, low, high]))
        return interface.Step(state=new, message=message, reward=reward, done=found | out, info=info)

    def invalid_info(self, state: State, info: dict) -> dict:
        """An invalid call counts as a guess (as the host version, `guess_number_host`, counts it)."""
        del info
        return dict(found=jnp.bool_(False), guesses=state.guesses + 1, wasted=state.wasted)

    def observation(self, state: State) -> interface.Message:
        """Before the first guess ``reset``'s message; then the interval the answers leave and the guesses left."""
        values = jnp.stack([MAX_GUESSES - state.guesses, state.low, state.high]).astype(jnp.int32)
        started = state.guesses > 0
        return interface.Message(started.astype(jnp.int32), jnp.where(started, values, 0))

    def state_key(self, state: State):
        """The interval the answers leave and the guesses made: what the next guess can depend on."""
        return (state.guesses * (MAX_NUMBER + 1) + state.low) * (MAX_NUMBER + 1) + state.high

    def episode_metrics(self):
        return {
            "found_rate": interface.rate("found", plot=True),
            "invalid_rate": interface.rate("invalid"),
            "guesses_mean": interface.mean_of("guesses", plot=True),
            "wasted_mean": interface.mean_of("wasted"),
        }

    def sample_starts(self, key: jax.Array, num_groups: int) -> Start:
        return Start(secret=jax.random.randint(key, (num_groups,), 1, MAX_NUMBER + 1, jnp.int32))

    def teacher(self) -> interface.Teacher:
        """Warm start: `consistent_guess` transcripts; call-table row k is `guess(number=k + 1)`."""
        return interface.Teacher(consistent_guess, tuple(("guess", {"number": k}) for k in range(1, MAX_NUMBER + 1)))

    def eval_suites(self) -> dict[str, interface.EvalSuite]:
        """Every secret once."""
        starts = lambda key, ids: Start(secret=jnp.asarray(np.asarray(ids) % MAX_NUMBER + 1, jnp.int32))  # noqa: E731
        return {"secrets": interface.EvalSuite(num_episodes=MAX_NUMBER, starts=starts)}


def consistent_guess(state: State, key: jax.Array):
    """Warm-start teacher: a uniformly random number the answers so far allow (call-table row k = number k+1),
    and that support."""
    numbers = jnp.arange(1, MAX_NUMBER + 1)
    support = (numbers >= state.low) & (numbers <= state.high)
    noise = jax.random.uniform(key, support.shape)
    return jnp.argmax(jnp.where(support, noise, -1.0)).astype(jnp.int32), support
