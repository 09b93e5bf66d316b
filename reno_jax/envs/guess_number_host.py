"""Guess the number as a `HostEnv`: the rules, rewards and texts of `reno_jax.envs.guess_number`, in Python.

The same game as the jitted environment, said in the same words (its `CHAT` templates resolved to text), so a
policy cannot tell the two apart; it exists to test `reno_jax.rollout.host_rollout` and as the smallest example
of a host environment.

Its warm-start teacher (`teacher`, option `teacher_strategy`): "binary" guesses the middle of the numbers the answers
allow (binary search: always found, in 3.375 guesses on average), "uniform" a uniformly random one of them (the
jitted environment's teacher, `guess_number.consistent_guess`). The held-out suite is every secret, in order.
"""

from __future__ import annotations

from typing import ClassVar

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
    options = ("teacher_strategy",)
    teacher_strategy: ClassVar[str] = "binary"  # the warm start's teacher: "binary" or "uniform" (module docstring)

    @classmethod
    def sample_task(cls, rng: np.random.Generator) -> int:
        return int(rng.integers(1, gn.MAX_NUMBER + 1))

    @classmethod
    def eval_tasks(cls, num: int) -> list:
        """Every secret in turn (the jitted environment's `secrets` suite), repeated past MAX_NUMBER."""
        return [k % gn.MAX_NUMBER + 1 for k in range(num)]

    def teacher(self, rng: np.random.Generator) -> host.ToolCall:
        if self.teacher_strategy == "binary":
            number = (self.low + self.high) // 2
        elif self.teacher_strategy == "uniform":
            number = int(rng.integers(self.low, self.high + 1))
        else:
            raise ValueError(f"env.teacher_strategy={self.teacher_strategy!r}: expected 'binary' or 'uniform'")
        return host.ToolCall("guess", {"number": number})

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

    def observation(self) -> str:
        """The jitted environment's: before the first guess `reset`'s message, then the interval and guesses left."""
        if not self.guesses:
            return gn.CHAT.user[0][0]
        return f"It is {self.low} to {self.high}. Guesses left: {gn.MAX_GUESSES - self.guesses}."

    def invalid_call(self, call: host.InvalidCall) -> host.HostStep:
        self.guesses += 1
        self.invalid = True
        return host.HostStep("Invalid call.", self.invalid_call_reward, True)

    def episode_info(self, truncated: bool) -> dict:
        del truncated
        return {"found": self.found, "invalid": self.invalid, "guesses": self.guesses, "wasted": self.wasted}
