"""guess_number's reward and answers, by stepping the environment directly (no model, no tokenizer: seconds).

Finding the secret on guess k earns FOUND_REWARD - GUESS_COST * (k - 1) (fewer guesses, more reward), running out
of guesses earns 0, a malformed or out-of-range call earns -1 and ends the episode; each answer states the numbers
the answers so far allow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.envs import guess_number as gn
from reno_jax.envs import interface

OK, NO_CALL, BAD_CALL, OUT_OF_RANGE = range(4)  # reno_jax.protocol.toolcall's kinds

ENV = gn.GuessNumberEnv()
STEP = jax.jit(ENV.step)


def _call(number: int, kind: int = OK) -> interface.ToolCall:
    return interface.ToolCall(kind=jnp.int32(kind), tool=jnp.int32(0), args=jnp.asarray([number], jnp.int32))


def _play(secret: int, guesses, kinds=None):
    """Steps `guesses` (stopping when done); returns the list of Steps."""
    state, _ = ENV.reset(gn.Start(secret=jnp.int32(secret)))
    out = []
    for i, g in enumerate(guesses):
        step = STEP(state, _call(g, OK if kinds is None else kinds[i]))
        out.append(jax.device_get(step))
        state = step.state
        if bool(step.done):
            break
    return out


def _binary_search(secret: int) -> list[int]:
    low, high, guesses = 1, gn.MAX_NUMBER, []
    while True:
        g = (low + high) // 2
        guesses.append(g)
        if g == secret:
            return guesses
        low, high = (g + 1, high) if g < secret else (low, g - 1)


def test_fewer_guesses_more_reward():
    rewards = []
    for k in range(1, gn.MAX_GUESSES + 1):
        secret = 9
        wrong = [1, 2, 3, 4][: k - 1]  # too low each time, then the secret
        steps = _play(secret, wrong + [secret])
        assert len(steps) == k and bool(steps[-1].done) and bool(steps[-1].info["found"])
        assert [float(s.reward) for s in steps[:-1]] == [0.0] * (k - 1)  # nothing before the find
        assert int(steps[-1].info["guesses"]) == k and int(steps[-1].message.template) == gn.FOUND
        rewards.append(sum(float(s.reward) for s in steps))
    np.testing.assert_allclose(rewards, [gn.FOUND_REWARD - gn.GUESS_COST * (k - 1) for k in range(1, 6)])
    assert all(a > b for a, b in zip(rewards, rewards[1:])) and rewards[-1] > 0.0  # found late > not found


def test_running_out_of_guesses_earns_nothing():
    steps = _play(16, [1, 2, 3, 4, 5])
    assert len(steps) == gn.MAX_GUESSES and bool(steps[-1].done) and not bool(steps[-1].info["found"])
    assert sum(float(s.reward) for s in steps) == 0.0
    assert int(steps[-1].message.template) == gn.OUT and int(steps[-1].info["guesses"]) == gn.MAX_GUESSES
    assert not any(bool(s.done) for s in steps[:-1])


@pytest.mark.parametrize("kind", [NO_CALL, BAD_CALL, OUT_OF_RANGE])
def test_invalid_call_ends_the_episode_with_minus_one(kind):
    steps = _play(5, [3, 0], kinds=[OK, kind])
    assert len(steps) == 2 and bool(steps[1].done) and bool(steps[1].info["invalid"])
    assert float(steps[1].reward) == gn.INVALID_REWARD == -1.0
    assert int(steps[1].message.template) == gn.INVALID and not bool(steps[1].info["found"])


def test_answers_state_the_numbers_left():
    steps = _play(6, [8, 3, 12, 5])  # 12 is already ruled out: the interval does not grow back
    answers = [(int(s.message.template), *map(int, s.message.values)) for s in steps]
    assert answers == [(gn.TOO_HIGH, 8, 1, 7), (gn.TOO_LOW, 3, 4, 7), (gn.TOO_HIGH, 12, 4, 7), (gn.TOO_LOW, 5, 6, 7)]
    assert [int(s.info["wasted"]) for s in steps] == [0, 0, 1, 1]  # 12 was a wasted guess
    assert len(gn.CHAT.tool) == 5 and gn.CHAT.num_values == 3


def test_state_key_names_the_decision_point():
    # Equal exactly for equal (guesses made, interval left): two paths to the same point share it.
    a = _play(6, [8, 3])[-1].state  # 2 guesses, 4..7
    b = _play(6, [9, 3, 8])[-2].state  # 2 guesses, 4..8
    c = _play(6, [3, 8])[-1].state  # 2 guesses, 4..7 by the other order
    keys = [int(ENV.state_key(s)) for s in (a, b, c)]
    assert keys[0] == keys[2] != keys[1] and min(keys) >= 0
    start, _ = ENV.reset(gn.Start(secret=jnp.int32(6)))
    assert int(ENV.state_key(start)) not in keys


def test_binary_search_is_the_best_the_reward_allows():
    """Binary search finds every secret, in 3.375 guesses on average (the reward's optimum: a complete search tree
    has the fewest guesses at every depth); the uniform teacher finds it less often, with more guesses."""
    rewards, guesses = [], []
    for secret in range(1, gn.MAX_NUMBER + 1):
        steps = _play(secret, _binary_search(secret))
        assert bool(steps[-1].info["found"])
        rewards.append(sum(float(s.reward) for s in steps))
        guesses.append(int(steps[-1].info["guesses"]))
    assert max(guesses) <= gn.MAX_GUESSES and np.mean(guesses) == 3.375
    np.testing.assert_allclose(np.mean(rewards), gn.FOUND_REWARD - gn.GUESS_COST * (3.375 - 1))


def test_teacher_guesses_only_numbers_the_answers_allow():
    state, _ = ENV.reset(gn.Start(secret=jnp.int32(6)))
    state = STEP(state, _call(8)).state  # 1..7 left
    rows = [int(gn.consistent_guess(state, jax.random.PRNGKey(k))[0]) + 1 for k in range(40)]
    _, support = gn.consistent_guess(state, jax.random.PRNGKey(0))
    assert set(rows) <= set(range(1, 8)) and list(np.flatnonzero(np.asarray(support)) + 1) == list(range(1, 8))
