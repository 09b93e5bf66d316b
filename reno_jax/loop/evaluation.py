"""Evaluation of a policy on an environment's declared suites (`interface.EvalSuite`), for any environment.

    results = evaluate(params, model_config, tokenizer, config, suites=["positions"], key=key)
    results["positions"].figures   # {"optimal_move_rate": ..., "mean_reward": ..., ...}

Episodes are played with the run's rollout settings, one per start (greedy unless `greedy=False`), in fixed-size
jitted batches (the last one filled up with further episode ids and cut), so one compiled program serves every
suite of an environment with the same settings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np

from reno_jax import parallel, run_config
from reno_jax.envs import interface
from reno_jax.errors import ConfigError
from reno_jax.loop import build, host_envs, hosts
from reno_jax.rollout import rollout as rollout_lib
from reno_jax.rollout import summary as summary_lib

UNBOUNDED_TURNS = 1 << 30  # `TextEnv.max_turns`' default: the environment sets no bound


@dataclasses.dataclass(frozen=True)
class SuiteResult:
    """One suite's figures (host floats, the environment's names) and its episodes (a host `Trajectory`)."""

    name: str
    figures: dict
    trajectory: Any


def suites_of(config) -> dict[str, interface.EvalSuite]:
    """The evaluation suites the config's environment declares (none: an empty dict)."""
    config = run_config.load(config)
    env_class = host_envs.host_env_class(config)
    if env_class is not None:
        return host_envs.heldout_suite(config, env_class)
    entry = build.env_entry(config)
    return dict(entry.eval_suites(config)) if entry.eval_suites is not None else {}


def default_suite_names(config) -> list[str]:
    return [name for name, suite in suites_of(config).items() if suite.default]


def in_run_suite_names(config) -> list[str] | None:
    """The suites an evaluation inside a run plays (`eval_every`, `sft.eval_every`): `config.eval_suites`
    ("a,b"), or None (empty: the environment's defaults)."""
    names = [n.strip() for n in run_config.load(config).eval_suites.split(",") if n.strip()]
    return names or None


def resolve_suites(config, names: Sequence[str] | None) -> dict[str, interface.EvalSuite]:
    """`names` (None or empty: the defaults) as suites; ConfigError naming the unknown ones and the choices."""
    available = suites_of(config)
    if not available:
        raise ConfigError(
            f"env.name={build.env_entry(config).name!r} declares no evaluation suites "
            "(registry.register(eval_suites=...))"
        )
    names = list(names or [name for name, suite in available.items() if suite.default])
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ConfigError(
            f"unknown evaluation suite(s) {unknown}; {run_config.load(config).env.name} offers {sorted(available)}"
        )
    return {name: available[name] for name in names}


@functools.lru_cache(maxsize=8)
def _rollout_fn(model_config, rollout_config):
    return rollout_lib.make_rollout_fn(model_config, rollout_config)


def _mesh_layout(params) -> parallel.Layout | None:
    """A layout over the mesh the params live on, to split the starts over its batch axes (None: one device)."""
    sharding = jax.tree.leaves(params)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
        return parallel.Layout(sharding.mesh, "dp", None)
    return None


def run_suite(
    params,
    model_config,
    tokenizer,
    config,
    name: str,
    suite: interface.EvalSuite,
    *,
    key: jax.Array,
    greedy: bool = True,
    batch_size: int = 256,
    num_episodes: int | None = None,
    max_length: int = -1,
    show_progress: bool = True,
) -> SuiteResult:
    """Plays `suite` and summarises it.

    num_episodes: None: the suite's; a scalable suite (random games) plays this many, a fixed set (every position)
      is cut to at most this many. max_length: the conversation length; -1: the run's, 0: whatever the longest
      episode needs (no truncation). Episodes get every turn the suite's environment allows. A host environment's
      one suite (`host_envs.run_heldout`) plays its `eval_tasks`.
    """
    env_class = host_envs.host_env_class(config)
    if env_class is not None:
        figures, traj = host_envs.run_heldout(
            params,
            model_config,
            tokenizer,
            config,
            env_class,
            key=key,
            greedy=greedy,
            batch_size=batch_size,
            num_episodes=num_episodes,
            max_length=max_length,
        )
        return SuiteResult(name=name, figures=figures, trajectory=traj)
    env = build.make_compiled_env(config, tokenizer, model_config, **dict(suite.env_overrides))
    rc = build.rollout_config(config, greedy=greedy, group_size=1)
    if env.env.max_turns() < UNBOUNDED_TURNS:  # every turn the suite's environment allows (a game on a move run)
        rc = dataclasses.replace(rc, max_turns=int(env.env.max_turns()))
    if max_length >= 0:
        rc = dataclasses.replace(rc, max_length=max_length)
    total = int(suite.num_episodes)
    if num_episodes:
        total = int(num_episodes) if suite.scalable else min(int(num_episodes), total)
    layout = _mesh_layout(params)
    place = (lambda tree: tree) if layout is None else layout.place_batch
    size = min(batch_size, total + total % 2) if layout is None else batch_size  # a mesh's batch splits evenly
    fn = _rollout_fn(model_config, rc)
    k_starts, k_policy = jax.random.split(key)
    outs = []
    batches = range(0, total, size)
    for start in hosts.progress(len(batches), desc=f"evaluate {name}") if show_progress else range(len(batches)):
        first = batches[start]
        ids = np.arange(first, first + size)
        traj = hosts.to_host(
            fn(params, jax.random.fold_in(k_policy, first), place(suite.starts(k_starts, ids)), env=env)
        )
        keep = min(size, total - first)
        outs.append(jax.tree.map(lambda x: np.asarray(x)[:keep], traj))
    traj = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *outs)
    ids = np.arange(total)
    figures = {**summary_lib.suite_figures(traj, total), "max_length": rollout_lib.conversation_length(env, rc)}
    info = {k: np.asarray(v) for k, v in traj.env_info.items()}
    figures.update(interface.summarize(env.env, info))
    if suite.extra is not None:
        figures.update(suite.extra(info, ids))
    return SuiteResult(name=name, figures=figures, trajectory=traj)


def evaluate(
    params, model_config, tokenizer, config, suites: Sequence[str] | None = None, *, key: jax.Array, **kwargs
) -> dict[str, SuiteResult]:
    """`run_suite` for each named suite (None: the environment's defaults), in order."""
    config = run_config.load(config)
    return {
        name: run_suite(params, model_config, tokenizer, config, name, suite, key=key, **kwargs)
        for name, suite in resolve_suites(config, suites).items()
    }


def flat_figures(results: dict[str, SuiteResult], prefix: str = "") -> dict[str, float]:
    """`{prefix + suite/figure: value}` of every numeric figure (the one-line JSON and the logged metrics)."""
    return {
        f"{prefix}{name}/{k}": v
        for name, result in results.items()
        for k, v in result.figures.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
