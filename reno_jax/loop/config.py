"""Checks a run's config before anything is built or written: `validate_config` returns the typed `RunConfig` or
raises `ConfigError` naming the flag.

Each field's own check and the rules that tie fields together live with the fields (`reno_jax.run_config`);
here are the checks that need more than the config: the paths it names exist, its environment builds (its `make_env`
/ `make_sampler` accept the `env` section), its warm-start teacher accepts the `sft` options, its evaluation suites
exist, its loss builds and its mesh fits the devices there are.
"""

from __future__ import annotations

import os

import jax

from reno_jax import parallel, run_config
from reno_jax.envs import host
from reno_jax.errors import ConfigError, as_config_error
from reno_jax.loop import build, curriculum, evaluation, host_envs, recipe, warmstart


def validate_config(config) -> run_config.RunConfig:
    """The typed config (`run_config.load`: fields, types, cross-field rules), then every check that needs the
    environment, the devices or the file system, of every curriculum stage; raises `ConfigError` naming the flag."""
    config = run_config.load(config)
    stages = curriculum.curriculum_stages(config)
    for stage in stages[:-1]:
        try:
            _check_runnable(stage.config)
        except ConfigError as error:
            raise ConfigError(f"curriculum stage {stage.name!r} (--config.curriculum.{stage.name}): {error}") from None
    _check_runnable(stages[-1].config)
    if warmstart.runs_warm_start(config):
        warmstart.check_warm_start(stages[0].config)  # once, with the first stage's settings, as it runs
    return config


def _check_runnable(config: run_config.RunConfig) -> None:
    for name, value in (("model.path", config.model.path), ("model.tokenizer_path", config.model.tokenizer_path)):
        if value and not os.path.exists(value):
            raise ConfigError(f"--config.{name}={value} does not exist")
    check_env(config)
    if config.eval_every or config.sft.eval_every:
        evaluation.resolve_suites(config, evaluation.in_run_suite_names(config))  # ConfigError naming the suites
    recipe.make_loss_fn(config)  # the loss's own rules, before anything is written
    _check_mesh(config)


def _check_mesh(config: run_config.RunConfig) -> None:
    try:
        parallel.preset_rules(config.mesh.preset)
        ways, described = parallel.describe_batch_ways(parallel.resolve_here(config.mesh))
    except (parallel.MeshError, parallel.ShardingError) as error:
        raise ConfigError(f"--config.mesh: {error}") from None
    groups = config.rollout.boards_per_step
    if groups % ways:
        raise ConfigError(
            f"--config.rollout.boards_per_step={groups} groups do not split over the mesh's batch axes ({described})"
        )
    sft_rows = config.sft.batch_size if config.sft.num_steps > 0 else 0
    if sft_rows % ways:
        raise ConfigError(
            f"--config.sft.batch_size={sft_rows} rows do not split over the mesh's batch axes ({described})"
        )


def check_env(config) -> None:
    """Builds the config's environment and its step sampler once (`env.module` imported first): an unknown
    environment or a setting its `make_env` / `make_sampler` rejects ends in a `ConfigError` naming the field."""
    config = run_config.load(config)
    if _check_host_env(config):
        return
    try:
        entry = build.env_entry(config)
    except ValueError as error:
        message = str(error) + (
            f"; host environments: {host.host_names()}" if "unknown environment" in str(error) else ""
        )
        raise ConfigError(
            f"--config.{message}" if message.startswith("env.") else f"--config.env.name: {message}"
        ) from None
    try:
        env = entry.make_env(config.env)
        entry.make_sampler(config)
    except (ValueError, KeyError, TypeError) as error:
        raise as_config_error(error) from None
    check_turns(config.rollout.max_turns, int(env.max_turns()), entry.name)


def _check_host_env(config: run_config.RunConfig) -> bool:
    """Whether the config names a host environment (`reno_jax.loop.host_envs`), checked: its options and a reset."""
    try:
        env_class = host_envs.host_env_class(config)
    except ValueError as error:  # env.module that cannot be imported (a ConfigError passes as it is)
        raise as_config_error(error) from None
    if env_class is not None:
        host_envs.check_host_env(env_class)
        sizes = config.mesh.sizes()
        if jax.process_count() > 1 or any(v != 1 for v in sizes.values()):
            raise ConfigError(
                f"--config.mesh: env.name={env_class.name!r} is a host environment, which runs on one device "
                f"(one process) for now; got {sizes} over {jax.process_count()} process(es)"
            )
    return env_class is not None


def check_turns(asked: int, allowed: int, name: str) -> None:
    """`rollout.max_turns` against the environment's own `max_turns()` (`allowed`; `evaluation.UNBOUNDED_TURNS`:
    it sets none): 0 takes the environment's, more than it allows is refused, and so is 0 without a bound."""
    if asked > allowed:
        raise ConfigError(
            f"--config.rollout.max_turns={asked} is more than env.name={name!r} allows ({allowed} turns, its "
            "max_turns()); leave it at 0 for the environment's own"
        )
    if not asked and allowed >= evaluation.UNBOUNDED_TURNS:
        raise ConfigError(
            f"--config.rollout.max_turns=0 takes the environment's own turn limit, but env.name={name!r} sets "
            "none (its max_turns()); set --config.rollout.max_turns or give the environment a max_turns()"
        )
