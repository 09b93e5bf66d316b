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
    `finish` may fix it up at the end (e.g. mark truncation); `episode_metrics` declares the figures a batch of it
    reduces to, each with its reduction (`Metric`).

What the training loop, the evaluation and the warm start need beyond the episode itself (how a step's start
records are drawn, an optional scripted teacher, the evaluation suites) an environment declares in its registry
entry (`reno_jax.envs.registry.register`), with the `EvalSuite` and `Teacher` types below.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

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

    def episode_metrics(self) -> Mapping[str, "Metric"]:
        """Host: the figures a batch of final infos reduces to, by name (logged as ``rollout/<name>`` in training,
        ``<suite>/<name>`` in evaluation). Default: none declared, and `summarize` takes the mean of every info
        leaf."""
        return {}

    def max_turns(self) -> int:
        """Upper bound on agent turns per episode (the rollout runs ``min(this, rollout max_turns)``)."""
        return 1 << 30


# ---------------------------------------------------------------------------------------------- figures

REDUCTIONS = {"mean": np.mean, "sum": np.sum, "min": np.min, "max": np.max}


@dataclasses.dataclass(frozen=True)
class Metric:
    """One figure of a batch of episodes, declared by the environment that defines it.

    Attributes:
      value: host ``info -> [B]`` per-episode values from a batch of final infos (NumPy arrays).
      reduce: how the batch reduces them: ``"mean"``, ``"sum"``, ``"min"`` or ``"max"``.
      where: optional host ``info -> bool [B]``: only those episodes count (NaN when there are none).
      plot: the figure gets a panel in the run's learning curves.
    """

    value: Callable[[Mapping[str, np.ndarray]], Any]
    reduce: str = "mean"
    where: Callable[[Mapping[str, np.ndarray]], Any] | None = None
    plot: bool = False

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {sorted(REDUCTIONS)}, got {self.reduce!r}")

    def __call__(self, info: Mapping[str, np.ndarray]) -> float:
        values = np.asarray(self.value(info), np.float64)
        if self.where is not None:
            values = values[np.asarray(self.where(info), bool)]
            if values.size == 0:
                return float("nan")
        return float(REDUCTIONS[self.reduce](values))


def rate(key: str, equals: Any = None, where: Callable | None = None, plot: bool = False) -> Metric:
    """The share of episodes whose ``info[key]`` is true (or equals ``equals``)."""
    if equals is None:
        return Metric(lambda info: np.asarray(info[key], bool), where=where, plot=plot)
    return Metric(lambda info: np.asarray(info[key]) == equals, where=where, plot=plot)


def mean_of(key: str, plot: bool = False) -> Metric:
    """The mean of ``info[key]`` over episodes."""
    return Metric(lambda info: info[key], plot=plot)


def summarize(env: TextEnv, info: Mapping[str, Any]) -> dict[str, float]:
    """The environment's figures of a batch of final infos (host), by their declared names; an environment that
    declares none gets the mean of every info leaf."""
    info = {k: np.asarray(v) for k, v in info.items()}
    declared = env.episode_metrics()
    if not declared:
        return {k: float(np.mean(v.astype(np.float64))) for k, v in info.items()}
    return {name: metric(info) for name, metric in declared.items()}


# ---------------------------------------------------------------------------------------------- companions


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A scripted policy for the supervised warm start (``reno_jax.rl.sft.env_transcripts``).

    Attributes:
      policy: traceable per episode ``(state, key) -> (row int32 [], support bool [R])``: the row of `calls` to
        play and the rows it could have played (the soft targets of ``sft.soft_targets``).
      calls: the R calls as ``(tool_name, {argument: value})``, written out as the policy would write them.
    """

    policy: Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]
    calls: tuple

    def __post_init__(self):
        if not self.calls:
            raise ValueError("a Teacher needs at least one call")


@dataclasses.dataclass(frozen=True)
class EvalSuite:
    """A fixed evaluation an environment declares (``registry.register(eval_suites=...)``).

    ``num_episodes`` episodes, numbered 0..N-1, are played greedily, one per start, in the environment built with
    ``env_overrides`` (e.g. another opponent, or training-only shaping turned off). ``starts(key, ids)`` gives the
    start records of episodes ``ids`` (``int [n]``): the same key and ids give the same starts. The figures are the
    environment's `episode_metrics` plus ``extra(info, ids)`` (host, ``[N]`` arrays) where given.

    ``default``: run when no suite is named (``experiments.evaluate``) and by evaluation during training.
    ``scalable``: ``num_episodes`` may be changed (games drawn at random); a fixed set (every position, every
    secret) is only cut short.
    """

    num_episodes: int
    starts: Callable[[jax.Array, np.ndarray], Any]
    env_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra: Callable[[Mapping[str, np.ndarray], np.ndarray], Mapping[str, float]] | None = None
    default: bool = True
    scalable: bool = False

    def __post_init__(self):
        if int(self.num_episodes) < 1:
            raise ValueError(f"an EvalSuite needs at least one episode, got {self.num_episodes}")
