"""Checks a run's config before anything is built or written: `validate_config` raises `ConfigError` naming the
flag. An environment's own `env` section is checked by its `make_env` (its ValueError becomes a ConfigError)."""

from __future__ import annotations

import os

from reno_jax import parallel
from reno_jax.errors import ConfigError
from reno_jax.loop import build, evaluation
from reno_jax.loop.build import QUANTIZE
from reno_jax.models import lora
from reno_jax.rl import curriculum, learner, losses, recipe


def _field(config, path: str):
    node = config
    for part in path.split("."):
        if part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()

# (field, test, what is expected). Fields a config does not have are skipped (older run configs lack some).
_CHECKS = (
    ("num_steps", lambda v: v >= 1, "an integer >= 1"),
    ("checkpoint_every", lambda v: v >= 1, "an integer >= 1"),
    ("keep_checkpoints", lambda v: v >= 0, "an integer >= 0 (0: keep every checkpoint)"),
    ("plot_every", lambda v: v >= 0, "an integer >= 0 (0: never)"),
    ("eval_every", lambda v: v >= 0, "an integer >= 0 (0: never)"),
    ("sft.eval_every", lambda v: v >= 0, "an integer >= 0 (0: never)"),
    ("model.dtype", lambda v: v in build.DTYPES, f"one of {sorted(build.DTYPES)}"),
    ("sft.num_steps", lambda v: v >= 0, "an integer >= 0 (0: no warm start)"),
    ("sft.batch_size", lambda v: v >= 1, "an integer >= 1"),
    ("sft.length_pool", lambda v: v >= 1, "an integer >= 1 (1: every batch drawn alone)"),
    ("sft.learning_rate", lambda v: v > 0, "a number > 0"),
    ("sft.warmup_steps", lambda v: v >= 0, "an integer >= 0"),
    ("rollout.boards_per_step", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.group_size", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.max_new_tokens", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.max_turns", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.max_length", lambda v: v >= 0, "an integer >= 0 (0: the length every episode needs)"),
    ("rollout.temperature", lambda v: v > 0, "a number > 0"),
    ("rollout.top_k", lambda v: v >= 0, "an integer >= 0 (0: off)"),
    ("rollout.top_p", lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    ("rollout.prefill_chunk", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.cache_dtype", lambda v: v in ("float32", "bfloat16"), "'float32' or 'bfloat16'"),
    ("rollout.parse_max_bytes", lambda v: v >= 0, "an integer >= 0 (0: no cap)"),
    ("rl.loss", lambda v: v in losses.LOSSES, f"one of {sorted(losses.LOSSES)}"),
    ("rl.eps_low", lambda v: v >= 0, "a number >= 0"),
    ("rl.eps_high", lambda v: v >= 0, "a number >= 0"),
    ("rl.learning_rate", lambda v: v > 0, "a number > 0"),
    ("rl.end_learning_rate", lambda v: v >= 0, "a number >= 0"),
    ("rl.warmup_steps", lambda v: v >= 0, "an integer >= 0"),
    ("rl.weight_decay", lambda v: v >= 0, "a number >= 0"),
    ("rl.clip_norm", lambda v: v >= 0, "a number >= 0 (0: no clipping)"),
    ("rl.num_minibatches", lambda v: v >= 1, "an integer >= 1"),
    ("rl.num_microbatches", lambda v: v >= 1, "an integer >= 1"),
    ("rl.logits_chunk", lambda v: v >= 0, "an integer >= 0 (0: all positions at once)"),
    ("rl.train_groups", lambda v: v >= 0, "an integer >= 0 (0: every group)"),
    ("rl.length_bucket", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: train at the full length)"),
    ("rl.optimizer_state_dtype", lambda v: v in ("float32", "bfloat16", "int8"),
     "one of ['float32', 'bfloat16', 'int8']"),
    ("rl.forking_top_k", lambda v: v >= 1, "an integer >= 1"),
    ("rl.entropy_top_k", lambda v: v >= 0, "an integer >= 0 (0: the full vocabulary)"),
    ("model.quantize", lambda v: v in QUANTIZE, f"one of {list(QUANTIZE)} ('': a float base)"),
    ("lora.rank", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: full fine-tuning)"),
    ("lora.alpha", lambda v: v > 0, "a number > 0"),
    ("lora.targets", lambda v: len(v) >= 1 and all(t in lora.ALL_TARGETS for t in v),
     f"a non-empty tuple of {list(lora.ALL_TARGETS)}"),
    ("lora.expert_adapters", lambda v: v in lora.EXPERT_ADAPTERS, f"one of {list(lora.EXPERT_ADAPTERS)}"),
)


def validate_config(config) -> None:
    """Checks the fields a user sets against what the loop can run; raises `ConfigError` naming the flag.

    Cross-field rules too: `rl.train_groups` at most `rollout.boards_per_step`, trained rows divisible by
    `num_minibatches * num_microbatches`, a `model.path` that exists; the `env` section by building the
    environment and its sampler (`check_env`).
    """
    if config.get("curriculum", None):
        stages = curriculum.curriculum_stages(config)
        for stage in stages[:-1]:
            try:
                validate_config(stage.config)
            except ConfigError as error:
                raise ConfigError(f"curriculum stage {stage.name!r} (--config.curriculum.{stage.name}): "
                                  f"{error}") from None
        config = stages[-1].config
    for name, ok, expected in _CHECKS:
        value = _field(config, name)
        if value is _MISSING:
            continue
        try:
            good = bool(ok(value))
        except TypeError:
            good = False
        if not good:
            raise ConfigError(f"--config.{name} must be {expected}, got {value!r}")
    for name in ("model.path", "model.tokenizer_path"):
        value = _field(config, name)
        if value is not _MISSING and value and not os.path.exists(value):
            raise ConfigError(f"--config.{name}={value} does not exist")
    quantize = _field(config, "model.quantize")
    if quantize not in (_MISSING, "") and not build.lora_config(config).rank:
        raise ConfigError(f"--config.model.quantize={quantize} needs --config.lora.rank > 0: an int8 base is "
                          "frozen, so only LoRA adapters can be trained over it")
    groups = int(config.rollout.boards_per_step)
    trained = int(config.rl.get("train_groups", 0)) or groups
    if trained > groups:
        raise ConfigError(f"--config.rl.train_groups={trained} is more than the "
                          f"--config.rollout.boards_per_step={groups} groups rolled out per step")
    if config.rl.get("share_common_prefix", False) and not config.rl.get("share_prompt_prefix", False):
        raise ConfigError("--config.rl.share_common_prefix=True needs --config.rl.share_prompt_prefix=True")
    shift = float(config.rl.get("max_logp_shift", 0.0))
    if not shift >= 0.0:
        raise ConfigError(f"--config.rl.max_logp_shift must be >= 0 (0: off), got {shift}")
    coef, discount = float(config.rl.get("turn_advantage_coef", 0.0)), float(config.rl.get("turn_discount", 1.0))
    if not coef >= 0.0:
        raise ConfigError(f"--config.rl.turn_advantage_coef must be >= 0 (0: off), got {coef}")
    if not 0.0 < discount <= 1.0:
        raise ConfigError(f"--config.rl.turn_discount must be in (0, 1], got {discount}")
    scope = str(config.rl.get("turn_scope", "group"))
    if scope not in learner.TURN_SCOPES:
        raise ConfigError(f"--config.rl.turn_scope must be 'group' or 'batch', got {scope!r}")
    probe = int(config.rl.get("shift_probe_groups", 8))
    if shift and probe < 1:
        raise ConfigError(f"--config.rl.shift_probe_groups must be >= 1, got {probe}")
    splits = int(config.rl.num_minibatches) * int(config.rl.num_microbatches)
    rows = trained * int(config.rollout.group_size)
    if rows % splits:
        raise ConfigError(f"the {rows} trained rows per step (groups {trained} x --config.rollout.group_size="
                          f"{config.rollout.group_size}) are not divisible by --config.rl.num_minibatches x "
                          f"--config.rl.num_microbatches = {splits}")
    pool = int(config.sft.get("length_pool", 1)) if "sft" in config else 1
    if pool > 1 and not int(config.rl.get("length_bucket", 0)):
        raise ConfigError(f"--config.sft.length_pool={pool} needs --config.rl.length_bucket > 0 (without it every "
                          "batch is padded to the whole conversation length, sorted by length or not)")
    check_env(config)
    if int(config.get("eval_every", 0) or 0) or ("sft" in config and int(config.sft.get("eval_every", 0) or 0)):
        evaluation.resolve_suites(config, evaluation.in_run_suite_names(config))  # ConfigError naming the suites
    recipe.make_loss_fn(config)  # the loss's own cross-field rules (corrections, regularisers), before anything is written
    if "mesh" in config:
        mesh_config = parallel.MeshConfig.from_config(config.mesh)
        try:
            parallel.preset_rules(mesh_config.preset)
            ways, described = parallel.describe_batch_ways(parallel.resolve_here(mesh_config))
        except (parallel.MeshError, parallel.ShardingError) as error:
            raise ConfigError(f"--config.mesh: {error}") from None
        if groups % ways:
            raise ConfigError(f"--config.rollout.boards_per_step={groups} groups do not split over the mesh's batch "
                              f"axes ({described})")
        sft_rows = int(config.sft.batch_size) if "sft" in config and int(config.sft.num_steps) > 0 else 0
        if sft_rows % ways:
            raise ConfigError(f"--config.sft.batch_size={sft_rows} rows do not split over the mesh's batch axes "
                              f"({described})")


def check_env(config) -> None:
    """Builds the config's environment and its step sampler once (`env.module` imported first): an unknown
    environment or a setting its `make_env` / `make_sampler` rejects ends in a `ConfigError` naming the field."""
    try:
        entry = build.env_entry(config)
    except ValueError as error:
        message = str(error)
        raise ConfigError(f"--config.{message}" if message.startswith("env.") else f"--config.env.name: {message}") \
            from None
    try:
        entry.make_env(config.env)
        entry.make_sampler(config)
    except (ValueError, KeyError, TypeError) as error:
        message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
        raise ConfigError(f"--config.{message}" if message.startswith("env.") else f"--config.env: {message}") \
            from None
