"""Whole episodes of a host environment (`reno_jax.envs.host`) for the play page's transcript view.

The episode is played by `host_rollout` (one row, the run's rollout settings), on an environment object that keeps
the texts it was given and answered with, so the page shows each turn as the environment saw it: the model's text,
the tool's response with that step's reward. The same message shapes as `policy.Episodes.play`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from reno_jax.envs import host
from reno_jax.loop import build, host_envs
from reno_jax.protocol import toolcall
from reno_jax.protocol.tokenizer import decode as decode_text
from reno_jax.rollout import host_rollout as H


def recording(env_class: type[host.HostEnv]) -> type[host.HostEnv]:
    """A subclass of `env_class` whose objects keep `first` (the first user message) and `answers` (each turn's
    `HostStep`, in order)."""

    class Recording(env_class):
        def reset(self, task):
            self.first, self.answers = env_class.reset(self, task), []
            return self.first

        def step(self, call):
            self.answers.append(env_class.step(self, call))
            return self.answers[-1]

        def invalid_call(self, call):
            self.answers.append(env_class.invalid_call(self, call))
            return self.answers[-1]

    Recording.__name__ = env_class.__name__
    return Recording


@dataclasses.dataclass
class HostEpisodes:
    """Episodes of a run's host environment for its model (`policy.Episodes` for a host environment)."""

    config: Any
    tokenizer: Any
    model_config: Any
    env_class: type

    def play(self, params, tasks, overrides: dict, greedy: bool = True, seed: int = 0) -> dict:
        """The episode of `tasks[0]` as chat messages: system, user, then per turn the model's text and the tool's
        response (with that step's reward), the episode's reward and its `episode_info`."""
        del overrides  # a host environment's suite has none
        env_class = recording(self.env_class)
        rc = build.rollout_config(self.config, greedy=greedy, group_size=1)
        chat = host_envs.cached_chat(self.env_class, self.tokenizer, self.model_config.vocab_size)
        programs = host_envs.cached_programs(self.model_config, rc, host_envs.host_config(self.config))
        env = env_class()
        traj = jax.device_get(
            H.host_rollout(params, jax.random.PRNGKey(seed), [env], [tasks[0]], chat=chat, programs=programs)
        )
        turns = int(traj.stats.num_turns[0])
        messages = [
            {"role": "system", "content": self.env_class.system_prompt, "turn": None},
            {"role": "user", "content": env.first, "turn": None},
        ]
        for t in range(turns):
            mine = np.asarray(traj.tokens[0])[(traj.turn_id[0] == t) & traj.loss_mask[0]]
            text = decode_text(self.tokenizer, mine.tolist())
            call = host.parse_call(self.env_class.tools, text)
            kind = host.KIND_OK if isinstance(call, host.ToolCall) else call.kind
            messages.append({"role": "assistant", "content": text, "turn": t, "parse": toolcall.KIND_NAMES[kind]})
            if t < len(env.answers):
                answer = env.answers[t]
                messages.append(
                    {"role": "tool", "content": answer.text, "turn": t, "reward": answer.reward, "done": answer.done}
                )
        info = {k: float(np.asarray(v)[0]) for k, v in traj.env_info.items()}
        return {
            "messages": messages,
            "num_turns": turns,
            "reward": float(traj.reward[0]),
            "info": info,
            "greedy": greedy,
        }
