"""`TextEnv`: the interface every tool-calling environment speaks (pure and `vmap`-able, as in pgx / gymnax).

The rollout knows nothing about any game. Per episode it only

    state, message = env.reset(start)                 # the first user message
    loop:  generate a turn -> parse its tool call -> env.step(state, call) -> render message -> prefill

An environment talks in *messages as data*: a `Message` picks one of the environment's text templates and gives
the integer values of its slots (`reno_jax.protocol.chat`); the protocol layer turns it into tokens in jit with
the tokenizer's own chat template. A tool call reaches the environment already parsed (`ToolCall`), by the
token automaton compiled from the environment's tool schemas (`reno_jax.protocol.toolcall`). So an environment is
a few pure functions over its own state pytree, and the same environment drives the rollout, the supervised
warm-start transcripts (`reno_jax.rl.sft`) and evaluation.

Writing one (see `reno_jax.envs.tictactoe.env` and `reno_jax.envs.connect4.env`, and the README):

  * subclass `TextEnv` as a `flax.struct.dataclass`: array fields (lookup tables, datasets) are pytree leaves,
    everything else is `flax.struct.field(pytree_node=False)`;
  * `chat()` declares the system prompt, the tool schemas and the message templates (host, once);
  * `reset(start)` and `step(state, call)` are per episode (the rollout vmaps them), branch-free (`jnp.where`,
    `lax.select`), and take their randomness from keys inside `start` / `state` (no hidden RNG);
  * `info` is the environment's own pytree of per-episode figures (`[]` leaves, the same structure every step);
    `finish` may fix it up at the end (e.g. mark truncation), `metrics` turns a batch of it into log scalars.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp

from reno_jax.protocol.messages import Message, ToolCall  # noqa: F401  (the interface speaks them)

PyTree = Any


@flax.struct.dataclass
class Step:
    """What `TextEnv.step` returns for one episode.

    Attributes:
      state: the next environment state.
      message: the tool response to show (only rendered when the episode goes on).
      reward: ``float32 []`` reward of this step (the episode's reward is the sum over its steps).
      done: ``bool []`` the episode ends here.
      info: the environment's per-episode figures after this step (same pytree structure every step).
    """

    state: PyTree
    message: Message
    reward: jax.Array
    done: jax.Array
    info: PyTree


class TextEnv(abc.ABC):
    """A tool-calling environment; subclasses are `flax.struct.dataclass`es (so an env is a pytree argument of the
    jitted rollout). All methods except `chat` and `metrics` must be traceable, per episode, without batch axes."""

    #: reward given to an episode that runs out of conversation length or turns before it is done
    truncation_reward: float = -1.0

    @abc.abstractmethod
    def chat(self):
        """Host: the `reno_jax.protocol.chat.ChatSpec` (system prompt, tool schemas, message templates)."""

    @abc.abstractmethod
    def reset(self, start: PyTree) -> tuple[PyTree, Message]:
        """``start`` (one episode's slice of the environment's start record) -> ``(state, first user message)``."""

    @abc.abstractmethod
    def step(self, state: PyTree, call: ToolCall) -> Step:
        """Applies the agent's parsed call (any kind: invalid calls are the environment's to judge)."""

    def for_member(self, state: PyTree, member: jax.Array) -> PyTree:
        """The state after ``reset`` of a group's ``member``-th episode (``int32 []``, 0..G-1): where the
        environment's own randomness (an opponent's) should differ between the episodes of a group. The first user
        message stays the group's (the rollout prefills it once per group). Default: the same state."""
        del member
        return state

    def finish(self, state: PyTree, info: PyTree, truncated: jax.Array) -> PyTree:
        """The episode's final info; ``truncated`` (``bool []``) says the rollout cut it short. Default: ``info``."""
        del state, truncated
        return info

    def metrics(self, info: Mapping[str, Any]) -> dict[str, float]:
        """Host: log scalars from a batch of final infos (``[B]`` NumPy arrays). Default: the mean of each leaf."""
        out = {}
        for k, v in info.items():
            out[f"rollout/{k}_mean"] = float(jnp.mean(jnp.asarray(v, jnp.float32)))
        return out

    def max_turns(self) -> int:
        """Upper bound on agent turns per episode (the rollout runs ``min(this, rollout max_turns)``)."""
        return 1 << 30
