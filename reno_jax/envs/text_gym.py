"""Gym-style text environments (SkyRL-gym's `BaseTextEnv` shape) as `HostEnv`s.

A user's class with

    def init(self, prompt: list[dict]) -> tuple[list[dict], dict]      # the chat prompt (and metadata)
    def step(self, action: str) -> {"observations": [...], "reward": r, "done": d, "metadata": {...}}

(or ``step`` returning the tuple ``(observations, reward, done[, metadata])``; observations a list of chat messages
or a string) becomes a host environment with

    MyHostEnv = text_gym.host_env(MyTextEnv, name="my_env", prompts=[...], system_prompt="...", max_turns=4)
    host.register(MyHostEnv)

Each turn's raw text (the model's whole turn, tool call or not) reaches the user's `step`: a gym-style environment
parses actions itself, so a turn that is not a well-formed tool call is not an invalid call here. Tasks are the
prompts (a string: one user message; or a list of chat messages), drawn uniformly from `prompts`; the held-out
suite is `eval_prompts` (default: the prompts, in order).
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import numpy as np

from reno_jax.envs import host


def _as_messages(prompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


def _observation_text(observations) -> str:
    """The tool response's text: the observations' contents joined (a string is taken as it is)."""
    if isinstance(observations, str):
        return observations
    return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in observations or ())


def _step_output(where: str, out) -> host.HostStep:
    """A `BaseTextEnvStepOutput` (mapping) or a tuple as a `HostStep` (type-checked by `host.checked_step` after)."""
    if isinstance(out, dict):
        missing = [k for k in ("observations", "reward", "done") if k not in out]
        if missing:
            raise host.HostEnvError(f"{where} returned a dict without {missing}")
        return host.HostStep(_observation_text(out["observations"]), out["reward"], out["done"])
    if isinstance(out, tuple) and len(out) in (3, 4):
        return host.HostStep(_observation_text(out[0]), out[1], out[2])
    raise host.HostEnvError(
        f"{where} must return {{'observations', 'reward', 'done'}} or (observations, reward, done), "
        f"got {type(out).__name__}"
    )


def host_env(
    text_env_class,
    *,
    name: str,
    prompts: Sequence[Any],
    eval_prompts: Sequence[Any] | None = None,
    system_prompt: str = "",
    tools: tuple = (),
    max_turns: int = 1,
    truncation_reward: float = 0.0,
) -> type[host.HostEnv]:
    """A `HostEnv` subclass playing `text_env_class` (one object per episode, made with no arguments)."""
    prompts, held_out = tuple(prompts), tuple(eval_prompts if eval_prompts is not None else prompts)
    if not prompts:
        raise ValueError(f"text_gym.host_env({name!r}) needs at least one prompt")

    class TextGymEnv(host.HostEnv):
        def reset(self, task) -> str:
            self.gym, self.steps = text_env_class(), 0
            messages, _ = self.gym.init(_as_messages(task))
            users = [m["content"] for m in messages if m.get("role") == "user"]
            if not users:
                raise host.HostEnvError(f"{text_env_class.__name__}.init returned no user message")
            return str(users[-1])

        def step(self, call: host.ToolCall) -> host.HostStep:
            return self._act(call.text)

        def invalid_call(self, call: host.InvalidCall) -> host.HostStep:
            return self._act(call.text)  # not a tool call: the gym environment judges the raw text itself

        def _act(self, text: str) -> host.HostStep:
            self.steps += 1
            out = _step_output(f"{text_env_class.__name__}.step", self.gym.step(text))
            if isinstance(out.reward, numbers.Real) and not isinstance(out.reward, bool):
                out = out._replace(reward=float(out.reward))
            return out

        @classmethod
        def sample_task(cls, rng: np.random.Generator):
            return prompts[int(rng.integers(len(prompts)))]

        @classmethod
        def eval_tasks(cls, num: int) -> list:
            return [held_out[k % len(held_out)] for k in range(num)]

        def episode_info(self, truncated: bool) -> dict:
            return {"steps": self.steps, "truncated": bool(truncated)}

    attrs = dict(
        name=name,
        system_prompt=system_prompt,
        tools=tuple(tools),
        max_turns=int(max_turns),
        truncation_reward=float(truncation_reward),
        __module__=getattr(text_env_class, "__module__", __name__),
    )
    return type(text_env_class.__name__ + "Host", (TextGymEnv,), attrs)
