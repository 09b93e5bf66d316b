"""Guess the number as a `HostEnv`: the rules, rewards and texts of `reno_jax.envs.guess_number`, in Python.

The same game as the jitted environment, said in the same words (its `CHAT` templates resolved to text), so a
policy cannot tell the two apart; it exists to test `reno_jax.rollout.host_rollout` and as the smallest example
of a host environment.
"""

from __future__ import annotations

import numpy as np

from reno_jax.envs import guess_number as gn
from reno_jax.envs import host


@host.register
class GuessNumberHostEnv(host.HostEnv):
    """Secret in 1..MAX_NUMBER, at most MAX_GUESSES calls of `guess(number)`; see `reno_jax.envs.guess_number`."""

    name = "guess_number_host"
    system_prompt = gn.CHAT.system
    tools = gn.CHAT.tools
    max_turns = gn.MAX_GUESSES
    invalid_call_reward = gn.INVALID_REWARD
    truncation_reward = 0.0

    @staticmethod
    def sample_task(rng: np.random.Generator) -> int:
        return int(rng.integers(1, gn.MAX_NUMBER + 1))

    def reset(self, task: int) -> str:
        self.secret, self.guesses, self.low, self.high = int(task), 0, 1, gn.MAX_NUMBER
        self.found, self.invalid, self.wasted = False, False, 0
        return gn.CHAT.user[0][0]

    def step(self, call: host.ToolCall) -> host.HostStep:
        guess = call.arguments.get("number")
        in_range = isinstance(guess, int) and not isinstance(guess, bool) and 1 <= guess <= gn.MAX_NUMBER
        if set(call.arguments) != {"number"} or not in_range:  # what the jitted parser rejects
            return self.invalid_call(host.InvalidCall(host.KIND_BAD_CALL, "", "guess needs number 1..16"))
        self.guesses += 1
        self.wasted += int(guess < self.low or guess > self.high)
        if guess == self.secret:
            self.found = True
            return host.HostStep(f"{guess} is right!", gn.FOUND_REWARD - gn.GUESS_COST * (self.guesses - 1), True)
        if self.guesses >= gn.MAX_GUESSES:
            return host.HostStep("Out of guesses.", 0.0, True)
        if guess > self.secret:
            self.high = min(self.high, guess - 1)
            return host.HostStep(f"{guess} is too high. It is {self.low} to {self.high}.", 0.0, False)
        self.low = max(self.low, guess + 1)
        return host.HostStep(f"{guess} is too low. It is {self.low} to {self.high}.", 0.0, False)

    def invalid_call(self, call: host.InvalidCall) -> host.HostStep:
        self.guesses += 1
        self.invalid = True
        return host.HostStep("Invalid call.", self.invalid_call_reward, True)

    def episode_info(self, truncated: bool) -> dict:
        del truncated
        return {"found": self.found, "invalid": self.invalid, "guesses": self.guesses, "wasted": self.wasted}
