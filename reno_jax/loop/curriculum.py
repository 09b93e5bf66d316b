"""Curriculum stages: one run, one model and optimiser state, several stages with settings of their own.

A stage is a config section `curriculum.<name>` with `num_steps` and the fields it changes; every other field is
the main config's. Stages run in the sorted order of their names, then the main config for `num_steps`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Mapping

import ml_collections

from reno_jax import run_config
from reno_jax.errors import ConfigError

# What a curriculum stage may not change: the model and where it lives, the warm start (it runs once, before the
# first stage, with that stage's settings), the bookkeeping, and the optimiser's structure (one optimiser state
# carries across the stages; each stage has its own learning-rate schedule).
_STAGE_FIXED = (
    "seed",
    "model",
    "mesh",
    "checkpoint_every",
    "keep_checkpoints",
    "plot_every",
    "eval_every",
    "curriculum",
    "rl.b1",
    "rl.b2",
    "rl.weight_decay",
    "rl.clip_norm",
    "rl.optimizer_state_dtype",
)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a run: `config` is the whole experiment config of the stage (a `RunConfig`, no `curriculum` in
    it); its steps are the run's global steps `first_step + 1 .. first_step + num_steps`."""

    name: str
    config: run_config.RunConfig
    first_step: int
    num_steps: int

    @property
    def last_step(self) -> int:
        return self.first_step + self.num_steps


def _apply_overrides(target: dict, overrides: Mapping, stage: str, path: str = "") -> None:
    """`overrides` written into `target` (plain dicts), field by field; a field the config lacks is an error."""
    for key, value in overrides.items():
        name = f"{path}{key}"
        if key not in target:
            raise ConfigError(f"--config.curriculum.{stage}.{name}: the config has no field {name!r}")
        if isinstance(target[key], dict):
            if not isinstance(value, (Mapping, ml_collections.ConfigDict)):
                raise ConfigError(f"--config.curriculum.{stage}.{name} must be a section like the config's {name}")
            _apply_overrides(target[key], value, stage, name + ".")
        else:
            target[key] = value


def _stage_config(base: dict, overrides: Mapping, stage: str) -> run_config.RunConfig:
    """The run config with a stage's overrides (types and checks as any config's, errors named by the stage)."""
    values = copy.deepcopy(base)
    _apply_overrides(values, {k: v for k, v in overrides.items() if k != "num_steps"}, stage)
    values["num_steps"] = overrides["num_steps"]
    try:
        return run_config.load(values)
    except ConfigError as error:
        raise ConfigError(f"curriculum stage {stage!r} (--config.curriculum.{stage}): {error}") from None


def curriculum_stages(config) -> list[Stage]:
    """The run's stages in order: the `config.curriculum` stages (each the config with that stage's overrides),
    then the main stage (the config itself, `num_steps` steps). Without a curriculum: one stage, the config.

    A curriculum stage is a section `curriculum.<name>` with `num_steps` and any config fields to change, e.g.
    `curriculum.move.env.task = "move"`, `curriculum.move.rl.learning_rate = 3e-3`. Stages run in the sorted order
    of their names (a `ConfigDict` keeps no other order): name several `a_move`, `b_...`. Raises `ConfigError`
    (naming the flag) for unknown fields or fields a stage may not change.
    """
    config = run_config.load(config)
    curriculum = config.curriculum
    base = dataclasses.replace(config, curriculum={})
    base_values = base.to_dict()
    stages, first = [], 0
    for name, overrides in sorted(curriculum.items()):
        if not isinstance(overrides, (dict, ml_collections.ConfigDict)) or "num_steps" not in overrides:
            raise ConfigError(
                f"--config.curriculum.{name} must be a section with num_steps and the fields the stage changes"
            )
        steps = overrides["num_steps"]
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"--config.curriculum.{name}.num_steps must be an integer >= 1, got {steps!r}")
        flat = _flatten(overrides)
        for fixed in _STAGE_FIXED:
            clash = [k for k in flat if k == fixed or k.startswith(fixed + ".")]
            if clash:
                raise ConfigError(
                    f"--config.curriculum.{name}.{clash[0]}: a curriculum stage cannot change "
                    f"{fixed} (one model, optimiser state and set of files for the whole run)"
                )
        if any(k == "sft" or k.startswith("sft.") for k in flat) and stages:
            raise ConfigError(
                f"--config.curriculum.{name}: only the first stage can set sft (the warm start runs once, before it)"
            )
        stages.append(Stage(str(name), _stage_config(base_values, overrides, str(name)), first, int(steps)))
        first += int(steps)
    stages.append(Stage("main", base, first, config.num_steps))
    return stages


def _flatten(section, prefix: str = "") -> dict:
    out = {}
    for key, value in section.items():
        name = f"{prefix}{key}"
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def total_steps(config) -> int:
    """GSPO steps of the whole run: the curriculum stages' and the main stage's."""
    return curriculum_stages(config)[-1].last_step


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage that runs global step `step` (1-based; 0 and steps past the end: the first / last stage)."""
    for stage in stages:
        if step <= stage.last_step:
            return stage
    return stages[-1]
