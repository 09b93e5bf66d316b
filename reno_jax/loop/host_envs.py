"""Host environments (`reno_jax.envs.host`) in the training loop, the evaluation and the play page.

A config names a host environment exactly as a jitted one: `env.name` (after importing `env.module`, which may
register it); every other field of the `env` section is one of the class's `options` (`host.configured`). Where the
loop plays a jitted environment with `rollout.make_rollout_fn`, it plays a host one with
`host_rollout.host_rollout`, built once per run (`host_rollout_parts`): per RL step the episode starts are
`host.sample_episodes` drawn with a numpy Generator seeded from the step's start key, itself split from the
checkpointed `TrainState.rng`, so the tasks are a function of (seed, step) and a resumed run draws the same ones.
The learner consumes the returned `Trajectory` unchanged.

Evaluation: one suite, "heldout": the first `rollout.host_eval_episodes` of `env_class.eval_tasks`, greedy, one
episode per task, reporting the mean reward, the rollout's rates, the means of `episode_info` and the host stats.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from reno_jax import run_config
from reno_jax.envs import host, interface, registry
from reno_jax.errors import ConfigError
from reno_jax.rollout import host_rollout as H
from reno_jax.rollout import rollout as rollout_lib
from reno_jax.rollout import summary as summary_lib

RESERVED_FIELDS = ("name", "module")  # the `env` fields that are not options of the environment
HELDOUT = "heldout"
HOST_STATS = ("tool_errors", "tool_timeouts", "responses_cut")


def host_env_class(config) -> type[host.HostEnv] | None:
    """The host environment class `config.env.name` names, with the `env` section's other fields set as its options
    (`host.configured`; ConfigError naming `--config.env.NAME`), or None for a jitted environment. `env.module` is
    imported first (ValueError naming it when it cannot be)."""
    env_config = run_config.load(config).env
    module = str(env_config.get("module", "") or "")
    if module:
        registry.import_module(module)
    name = str(env_config.get("name", "") or "")
    if not name or not host.is_host_env(name):
        return None
    options = {k: v for k, v in run_config.as_plain(env_config).items() if k not in RESERVED_FIELDS}
    return host.configured(host.host_entry(name).env_class, options)


def is_host(config) -> bool:
    return host_env_class(config) is not None


def check_host_env(env_class: type[host.HostEnv]) -> None:
    """Draws one training and one held-out task and resets an episode on each: an option the environment rejects
    (ValueError) fails here, before anything is written, as a ConfigError on `--config.env`."""
    try:
        for task in (env_class.sample_task(np.random.default_rng(0)), *env_class.eval_tasks(1)):
            host.checked_reset(env_class(), task)
    except ValueError as error:
        message = str(error)
        raise ConfigError(f"--config.{message}" if message.startswith("env.") else f"--config.env: {message}") from None


def host_config(config) -> H.HostConfig:
    """The `host_rollout.HostConfig` of the config's `rollout.host_*` fields."""
    r = run_config.load(config).rollout
    return H.HostConfig(
        max_prompt_tokens=r.host_max_prompt_tokens,
        max_response_tokens=r.host_max_response_tokens,
        tool_timeout_s=r.host_tool_timeout_s,
    )


@functools.lru_cache(maxsize=8)
def cached_programs(model_config, rollout_config, host_settings: H.HostConfig) -> H.HostPrograms:
    """`make_host_programs`, one per settings: the in-run evaluation reuses its compiled pieces."""
    return H.make_host_programs(model_config, rollout_config, host_settings)


@functools.lru_cache(maxsize=8)
def cached_chat(env_class: type[host.HostEnv], tokenizer, vocab_size: int) -> H.HostChat:
    return H.compile_host_chat(env_class, tokenizer, vocab_size)


@dataclasses.dataclass(frozen=True)
class HostStageEnv:
    """What the loop reads of a host environment where it reads a jitted one's `CompiledEnv`: `env` for the
    summaries (`summary.rollout_summary`), which then report the mean of every `episode_info` figure."""

    env_class: type

    @property
    def env(self) -> "HostStageEnv":
        return self

    def episode_metrics(self) -> dict:
        return {}


def numpy_rng(key: jax.Array) -> np.random.Generator:
    """A numpy Generator seeded from a JAX key (raw or typed): the same key, the same draws."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(jax.device_get(key), np.uint32).ravel().tolist())


@dataclasses.dataclass(frozen=True)
class HostRolloutParts:
    """A stage's host rollout: `rollout_fn(params, key, starts) -> Trajectory` and `starts_fn(key) -> (envs,
    tasks)` for `Learner.run_step`, and `env` for the summaries."""

    env: HostStageEnv
    rollout_fn: Callable[[Any, jax.Array, Any], rollout_lib.Trajectory]
    starts_fn: Callable[[jax.Array], Any]


def host_rollout_parts(config, tokenizer, model_config, env_class: type[host.HostEnv]) -> HostRolloutParts:
    """The host rollout of a stage's config (programs and chat built once, then reused by every step)."""
    config = run_config.load(config)
    rc = config.rollout_config()
    chat = cached_chat(env_class, tokenizer, model_config.vocab_size)
    programs = cached_programs(model_config, rc, host_config(config))
    num_groups, group_size = config.rollout.boards_per_step, rc.group_size

    def rollout_fn(params, key, starts):
        envs, tasks = starts
        return H.host_rollout(params, key, envs, tasks, chat=chat, programs=programs)

    def starts_fn(key):
        return host.sample_episodes(env_class, numpy_rng(key), num_groups, group_size)

    return HostRolloutParts(env=HostStageEnv(env_class), rollout_fn=rollout_fn, starts_fn=starts_fn)


def host_stats_summary(traj, prefix: str = "rollout/") -> dict:
    """Means of a host trajectory's faults (`tool_errors`, `tool_timeouts`, `responses_cut`); {} for a jitted one."""
    if not isinstance(traj.stats, H.HostRolloutStats):
        return {}
    return {f"{prefix}{name}": float(np.mean(np.asarray(getattr(traj.stats, name)))) for name in HOST_STATS}


# ---------------------------------------------------------------------------------------------- evaluation


def heldout_suite(config, env_class: type[host.HostEnv]) -> dict[str, interface.EvalSuite]:
    """A host environment's one suite, "heldout": its `eval_tasks` (the suite's `starts(key, ids)` are those tasks)."""
    count = run_config.load(config).rollout.host_eval_episodes

    def starts(key, ids):
        del key
        tasks = env_class.eval_tasks(int(np.max(ids)) + 1)
        return [tasks[int(i)] for i in ids]

    return {HELDOUT: interface.EvalSuite(num_episodes=count, starts=starts, scalable=True)}


def play_entry(env_class: type[host.HostEnv]) -> registry.Entry:
    """A `registry.Entry` standing for a host environment where the play page reads one: its name, its suite and
    a sampler of training tasks (a list of tasks where a jitted entry gives start records); no board view."""
    return registry.Entry(
        name=env_class.name,
        make_env=lambda env_config, **overrides: HostStageEnv(env_class),
        make_sampler=lambda config: lambda key, num: [env_class.sample_task(numpy_rng(key)) for _ in range(num)],
        eval_suites=lambda config: heldout_suite(config, env_class),
    )


def play_tasks(params, key, tasks, env_class, *, chat, programs, batch_size: int) -> rollout_lib.Trajectory:
    """One episode per task in batches of `batch_size` rows (the last filled with repeats and cut); a host
    `Trajectory` of len(tasks) rows."""
    outs = []
    for first in range(0, len(tasks), batch_size):
        chunk = list(tasks[first : first + batch_size])
        keep = len(chunk)
        chunk += [chunk[k % keep] for k in range(batch_size - keep)]
        traj = H.host_rollout(
            params,
            jax.random.fold_in(key, first),
            [env_class() for _ in chunk],
            chunk,
            chat=chat,
            programs=programs,
            group_size=1,
        )
        outs.append(first_episodes(jax.device_get(traj), keep))
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *outs)


def first_episodes(traj: rollout_lib.Trajectory, keep: int) -> rollout_lib.Trajectory:
    """The first `keep` episodes of a host `Trajectory` (numpy): with turn samples (bounded history) their
    `keep * T` rows and `keep` entries of the per-episode fields."""

    def cut(tree, n: int):
        return jax.tree.map(lambda a: np.asarray(a)[:n], tree)  # None fields stay None

    if traj.episode_id is None:
        return cut(traj, keep)
    rows = keep * traj.turn_reward.shape[1]
    per_episode = ("stats", "env_info", "turn_reward", "turn_key")
    fields = {f.name: getattr(traj, f.name) for f in dataclasses.fields(traj)}
    return traj.replace(**{name: cut(v, keep if name in per_episode else rows) for name, v in fields.items()})


def run_heldout(
    params,
    model_config,
    tokenizer,
    config,
    env_class: type[host.HostEnv],
    *,
    key: jax.Array,
    greedy: bool = True,
    batch_size: int = 256,
    num_episodes: int | None = None,
    max_length: int = -1,
) -> tuple[dict, Any]:
    """(figures, host Trajectory) of the held-out suite: every turn the environment allows, one episode per task.
    `max_length`: -1 the run's, 0 what the longest episode needs."""
    config = run_config.load(config)
    total = int(num_episodes or config.rollout.host_eval_episodes)
    rc = config.rollout_config(greedy=greedy, group_size=1)
    rc = dataclasses.replace(rc, max_turns=int(env_class.max_turns))
    if max_length >= 0:
        rc = dataclasses.replace(rc, max_length=max_length)
    chat = cached_chat(env_class, tokenizer, model_config.vocab_size)
    programs = cached_programs(model_config, rc, host_config(config))
    size = min(batch_size, total)
    traj = play_tasks(
        params, key, env_class.eval_tasks(total), env_class, chat=chat, programs=programs, batch_size=size
    )
    figures = {
        **summary_lib.suite_figures(traj, total),
        "max_length": H.conversation_length(chat, programs, H.num_turns([env_class()], rc)),
        **interface.summarize(HostStageEnv(env_class), traj.env_info),
        **host_stats_summary(traj, prefix=""),
    }
    return figures, traj
