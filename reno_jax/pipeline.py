"""Builds the pieces of an experiment from an `ml_collections` config: tokenizer, model, boards, environment,
rollout settings, the policy log-prob function and the per-step rollout metrics.

Shared by `experiments/train_tictactoe.py` and `experiments/evaluate.py`, so a checkpoint is always evaluated
with exactly the model, tokenizer and environment it was trained with.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from reno_jax import parallel
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs import registry
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.envs.tictactoe import tasks, wording
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.models import ling3
from reno_jax.models.config import Ling3Config
from reno_jax.rl import learner as learner_lib
from reno_jax.rl import losses, shared_prefix, trainer
from reno_jax.rollout import rollout as rollout_lib

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


class ConfigError(ValueError):
    """A config value a user set on the command line (or in a config file) that cannot work.

    The message names the field as its command-line flag (``--config.num_steps``) and what is expected, so the
    experiments can end with that one line instead of a traceback from deep inside the library.
    """


def dtype_of(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


class RunError(ValueError):
    """A training workdir that does not hold what was asked of it (no run, no checkpoint yet, no such step)."""


# ---------------------------------------------------------------------------------------------- validation

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
    ("keep_checkpoints", lambda v: v >= 1, "an integer >= 1"),
    ("plot_every", lambda v: v >= 0, "an integer >= 0 (0: never)"),
    ("model.dtype", lambda v: v in DTYPES, f"one of {sorted(DTYPES)}"),
    ("env.name", lambda v: v in registry.names(), f"one of {registry.names()}"),
    ("env.task", lambda v: v in ttt_env.TASKS, f"one of {list(ttt_env.TASKS)}"),
    ("env.num_boards", lambda v: v >= 1, "an integer >= 1"),
    ("env.max_random_moves", lambda v: 0 <= v <= 9, "an integer in [0, 9]"),
    ("env.board_sides", lambda v: v in boards_lib.SIDES, f"one of {list(boards_lib.SIDES)}"),
    ("env.board_source", lambda v: v in boards_lib.SOURCES, f"one of {list(boards_lib.SOURCES)}"),
    ("env.play_epsilon", lambda v: 0.0 <= v <= 1.0, "a probability in [0, 1]"),
    ("env.board_style", lambda v: v in wording.BOARD_STYLES, f"one of {list(wording.BOARD_STYLES)}"),
    ("env.heldout_fraction", lambda v: 0.0 <= v < 1.0, "a fraction in [0, 1)"),
    ("env.agent_player", lambda v: v in ("x", "o", "alternate"), "one of ['x', 'o', 'alternate']"),
    ("env.o_share", lambda v: 0.0 <= v <= 1.0, "a share in [0, 1]"),
    ("env.opponent", lambda v: v in tuple(tasks.OPPONENT_KINDS), f"one of {list(tasks.OPPONENT_KINDS)}"),
    ("env.opponent_epsilon", lambda v: 0.0 <= v <= 1.0, "a probability in [0, 1]"),
    ("env.suboptimal_penalty", lambda v: v >= 0.0, "a number >= 0 (0: the outcome alone)"),
    ("sft.num_steps", lambda v: v >= 0, "an integer >= 0 (0: no warm start)"),
    ("sft.batch_size", lambda v: v >= 1, "an integer >= 1"),
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
    ("rl.train_groups", lambda v: v >= 0, "an integer >= 0 (0: every group)"),
    ("rl.optimizer_state_dtype", lambda v: v in ("float32", "bfloat16", "int8"),
     "one of ['float32', 'bfloat16', 'int8']"),
    ("rl.forking_top_k", lambda v: v >= 1, "an integer >= 1"),
    ("rl.entropy_top_k", lambda v: v >= 0, "an integer >= 0 (0: the full vocabulary)"),
)


def validate_config(config) -> None:
    """Checks the fields a user sets against what the pipeline can run; raises `ConfigError` naming the flag.

    Cross-field rules too: `rl.train_groups` at most `rollout.boards_per_step`, trained rows divisible by
    `num_minibatches * num_microbatches`, a `model.path` / `env.boards_path` that exists.
    """
    if config.get("curriculum", None):
        stages = curriculum_stages(config)
        for stage in stages[:-1]:
            try:
                validate_config(stage.config)
            except ConfigError as error:
                raise ConfigError(f"curriculum stage {stage.name!r} (--config.curriculum.{stage.name}): "
                                  f"{error}") from None
        config = stages[-1].config
    tictactoe = env_name(config) == "tictactoe"
    for name, ok, expected in _CHECKS:
        value = _field(config, name)
        if value is _MISSING or (name.startswith("env.") and name != "env.name" and not tictactoe):
            continue  # another environment's `env` section is its own (its make_env validates it)
        try:
            good = bool(ok(value))
        except TypeError:
            good = False
        if not good:
            raise ConfigError(f"--config.{name} must be {expected}, got {value!r}")
    for name in ("model.path", "model.tokenizer_path", "env.boards_path"):
        value = _field(config, name)
        if value is not _MISSING and value and not os.path.exists(value):
            raise ConfigError(f"--config.{name}={value} does not exist")
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
    probe = int(config.rl.get("shift_probe_groups", 8))
    if shift and probe < 1:
        raise ConfigError(f"--config.rl.shift_probe_groups must be >= 1, got {probe}")
    splits = int(config.rl.num_minibatches) * int(config.rl.num_microbatches)
    rows = trained * int(config.rollout.group_size)
    if rows % splits:
        raise ConfigError(f"the {rows} trained rows per step (groups {trained} x --config.rollout.group_size="
                          f"{config.rollout.group_size}) are not divisible by --config.rl.num_minibatches x "
                          f"--config.rl.num_microbatches = {splits}")
    if not tictactoe:
        try:
            make_text_env(config)
        except (ValueError, KeyError) as error:
            raise ConfigError(f"--config.env: {error}") from None
    make_loss_fn(config)  # the loss's own cross-field rules (corrections, regularisers), before anything is written
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


# ---------------------------------------------------------------------------------------------- curriculum

# What a curriculum stage may not change: the model and where it lives, the warm start (it runs once, before the
# first stage, with that stage's settings), the bookkeeping, and the optimiser's structure (one optimiser state
# carries across the stages; each stage has its own learning-rate schedule).
_STAGE_FIXED = ("seed", "model", "mesh", "checkpoint_every", "keep_checkpoints", "plot_every", "eval_every",
                "curriculum", "rl.b1", "rl.b2", "rl.weight_decay", "rl.clip_norm", "rl.optimizer_state_dtype")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a run: `config` is the whole experiment config of the stage (no `curriculum` in it); its
    steps are the run's global steps `first_step + 1 .. first_step + num_steps`."""
    name: str
    config: Any
    first_step: int
    num_steps: int

    @property
    def last_step(self) -> int:
        return self.first_step + self.num_steps


def _apply_overrides(target, overrides, stage: str, path: str = "") -> None:
    for key, value in overrides.items():
        name = f"{path}{key}"
        if key not in target:
            raise ConfigError(f"--config.curriculum.{stage}.{name}: the config has no field {name!r}")
        if isinstance(target[key], ml_collections.ConfigDict):
            if not isinstance(value, (dict, ml_collections.ConfigDict)):
                raise ConfigError(f"--config.curriculum.{stage}.{name} must be a section like the config's {name}")
            _apply_overrides(target[key], value, stage, name + ".")
        else:
            try:
                target[key] = value
            except TypeError as error:  # ml_collections keeps a field's type
                raise ConfigError(f"--config.curriculum.{stage}.{name}: {error}") from None


def curriculum_stages(config) -> list[Stage]:
    """The run's stages in order: the `config.curriculum` stages (each the config with that stage's overrides),
    then the main stage (the config itself, `num_steps` steps). Without a curriculum: one stage, the config.

    A curriculum stage is a section `curriculum.<name>` with `num_steps` and any config fields to change, e.g.
    `curriculum.move.env.task = "move"`, `curriculum.move.rl.learning_rate = 3e-3`. Stages run in the sorted order
    of their names (a `ConfigDict` keeps no other order): name several `a_move`, `b_...`. Raises `ConfigError`
    (naming the flag) for unknown fields or fields a stage may not change.
    """
    curriculum = config.get("curriculum", None) or {}
    base = ml_collections.ConfigDict(config.to_dict())
    if "curriculum" in base:
        del base["curriculum"]
    stages, first = [], 0
    for name, overrides in sorted(curriculum.items()):
        if not isinstance(overrides, (dict, ml_collections.ConfigDict)) or "num_steps" not in overrides:
            raise ConfigError(f"--config.curriculum.{name} must be a section with num_steps and the fields the "
                              "stage changes")
        steps = overrides["num_steps"]
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"--config.curriculum.{name}.num_steps must be an integer >= 1, got {steps!r}")
        flat = _flatten(overrides)
        for fixed in _STAGE_FIXED:
            clash = [k for k in flat if k == fixed or k.startswith(fixed + ".")]
            if clash:
                raise ConfigError(f"--config.curriculum.{name}.{clash[0]}: a curriculum stage cannot change "
                                  f"{fixed} (one model, optimiser state and set of files for the whole run)")
        if any(k == "sft" or k.startswith("sft.") for k in flat) and stages:
            raise ConfigError(f"--config.curriculum.{name}: only the first stage can set sft (the warm start "
                              "runs once, before it)")
        stage_config = ml_collections.ConfigDict(base.to_dict())
        _apply_overrides(stage_config, overrides, str(name))
        stages.append(Stage(str(name), stage_config, first, int(steps)))
        first += int(steps)
    stages.append(Stage("main", base, first, int(config.num_steps)))
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


# ---------------------------------------------------------------------------------------------- tokenizer, model

def build_tokenizer(config):
    """The tokenizer of `config.model.tokenizer_path`, else of `config.model.path`, else the shipped one."""
    path = config.model.get("tokenizer_path", "") or config.model.get("path", "") or None
    return tokenizer_lib.load_tokenizer(path)


def tiny_model_config(config, vocab_size: int) -> Ling3Config:
    """The embedded tiny Ling-3.0 architecture described by `config.model.tiny`."""
    fields = dict(config.model.tiny)
    fields.setdefault("vocab_size", vocab_size)
    fields["vocab_size"] = max(int(fields["vocab_size"]), vocab_size)
    return Ling3Config(**fields)


def model_architecture(config, tokenizer) -> Ling3Config:
    """The run's `Ling3Config`: the HF directory's config.json (`config.model.path`; no weights are read), else
    the embedded tiny architecture `config.model.tiny` sized to the tokenizer."""
    if config.model.get("path", ""):
        from reno_jax.models import conversion
        return conversion.as_config(conversion.read_config_dict(config.model.path))
    return tiny_model_config(config, len(tokenizer))


def abstract_model(config, tokenizer) -> tuple[Ling3Config, Any]:
    """(model_config, params as `jax.ShapeDtypeStruct`s) of `build_model`, without reading or drawing weights.

    A restore target for checkpoints: `evaluate` and resumed runs need the tree's shapes and dtypes only.
    """
    from reno_jax.models import conversion
    model_config = model_architecture(config, tokenizer)
    return model_config, conversion.abstract_params(model_config, dtype_of(config.model.dtype))


def build_model(config, key: jax.Array, tokenizer, layout: parallel.Layout | None = None) -> tuple[Ling3Config, Any]:
    """(model_config, params): from the HF directory `config.model.path`, else a fresh tiny model (`key`).

    `layout`: the parameters are read or drawn straight onto its mesh, each device making only its own shards
    (`from_pretrained(shardings=)`, `init_params(shardings=)`); default, or a one-device layout: one device.
    """
    dtype = dtype_of(config.model.dtype)
    shardings = None if layout is None or layout.single_device else layout.param_shardings
    if config.model.get("path", ""):
        return ling3.from_pretrained(config.model.path, dtype=dtype, shardings=shardings)
    model_config = tiny_model_config(config, len(tokenizer))
    return model_config, ling3.init_params(model_config, key, dtype, shardings)


def make_layout(config, model_config: Ling3Config) -> parallel.Layout:
    """The run's device layout from `config.mesh` (absent: one device); errors name the flags and numbers."""
    mesh_config = parallel.MeshConfig.from_config(config.get("mesh"))
    try:
        layout = parallel.Layout.create(model_config, mesh_config)
        rows = int(config.rollout.boards_per_step)
        parallel.check_batch_divides(rows, layout.mesh, what="--config.rollout.boards_per_step")
    except (parallel.MeshError, parallel.ShardingError) as error:
        raise ConfigError(f"--config.mesh: {error}") from None
    return layout


def routing_stats(own: jax.Array, recorded: jax.Array) -> trainer.RoutingStats:
    """Agreement of a train forward's own top-k with the rollout's recorded routing.

    own: `int [B, T, n_moe, K]` (`ling3.Routing.own`, -1 on invalid tokens); recorded: the rollout's ids, same
    shape (-1: nothing recorded). Counts the (token, MoE layer) pairs where both exist and whether the two
    top-k SETS are equal (order within the top-k does not matter for the MoE output).
    """
    recorded = recorded.astype(jnp.int32)
    present = (own[..., 0] >= 0) & (recorded[..., 0] >= 0)
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(recorded, axis=-1), axis=-1)
    return trainer.RoutingStats(agree=jnp.sum(same & present).astype(jnp.float32),
                                total=jnp.sum(present).astype(jnp.float32))


def make_logp_fn(model_config: Ling3Config, with_entropy: bool = True, group_size: int | None = None,
                 remat: bool = False, entropy_top_k: int = 0, routing_replay: bool = False,
                 temperature: float = 1.0):
    """`logp_fn(params, batch) -> (logp [B, L], entropy [B, L] or None)` for `trainer.make_train_step`.

    `temperature`: score the tempered policy `softmax(logits / temperature)`, the distribution a rollout with that
    temperature samples from (so the policy-gradient ratio compares like with like); 1 leaves the logits untouched.

    `logp[:, t]` is `log p(tokens[t] | tokens[:t])` in float32; the entropy is that of the full next-token
    distribution at the same positions (a metric, and the entropy bonus when configured). With `group_size`, a
    batch carrying `prefix_tokens` (see `reno_jax.rl.shared_prefix`) is scored with each group's prompt encoded
    once; `tokens` are then the continuations and `logp[:, t]` conditions on the prefix too. `remat`: recompute
    each decoder layer in the backward pass instead of storing its activations (`ling3.forward(remat=True)`).
    `entropy_top_k` > 0: the entropy is that of the distribution renormalised over the k most likely tokens
    (an entropy bonus then evens out the plausible choices without pushing mass onto the vocabulary's tail).

    Soft targets (supervised warm start): a batch may carry ``soft_target_ids int32 [B, K]`` and
    ``soft_target_weights float32 [B, L, K]``; where a position's weights sum to more than 0, ``logp[:, t]`` is
    ``sum_k w[t, k] * log p(ids[k] | tokens[:t])`` (the expected log-likelihood under that target) instead of the
    log-prob of ``tokens[t]``.

    Routing replay: a batch carrying the rollout's ``routing int [B, L, n_moe, K]`` (``Trajectory.routing``; with a
    shared prefix also ``prefix_routing``) makes ``logp_fn`` return a third element, ``trainer.RoutingStats`` (how
    many (token, MoE layer) pairs the train forward's own top-k agrees with the rollout on); with
    ``routing_replay=True`` the forward also uses those ids instead of its own top-k (``ling3.forward``'s
    ``replay_experts``; -1 entries route normally).
    """

    def logp_fn(params, batch):
        tokens = batch["tokens"]
        valid = batch.get("valid")
        recorded = "routing" in batch
        routing = None
        if "prefix_tokens" in batch:
            if "soft_target_weights" in batch:
                raise ValueError("soft targets are not supported with a shared-prefix batch")
            if group_size is None:
                raise ValueError("a shared-prefix batch needs make_logp_fn(..., group_size=G)")
            parts = dict(prefix_replay=batch["prefix_routing"], replay=batch["routing"]) if (
                recorded and routing_replay) else {}
            if "common_tokens" in batch:
                parts["common_tokens"] = batch["common_tokens"]
                if recorded and routing_replay:
                    parts["common_replay"] = batch["common_routing"]
            out = shared_prefix.shared_prefix_logits(params, model_config, batch["prefix_tokens"], tokens,
                                                     valid, group_size, remat=remat, return_routing=recorded,
                                                     **parts)
            logits, routing = out if recorded else (out, None)
            if recorded:
                full_recorded = jnp.concatenate(
                    ([batch["common_routing"]] if "common_tokens" in batch else [])
                    + [batch["prefix_routing"], batch["routing"]], axis=1)
            targets, pad = tokens, 0
        else:
            out = ling3.forward(params, model_config, tokens, valid=valid, remat=remat, return_routing=recorded,
                                replay_experts=batch["routing"] if recorded and routing_replay else None)
            logits = out[0][:, :-1].astype(jnp.float32)
            if recorded:
                routing, full_recorded = out[-1], batch["routing"]
            targets, pad = tokens[:, 1:], 1
        if temperature != 1.0:
            logits = logits / jnp.float32(temperature)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        logp = picked - logz
        if "soft_target_weights" in batch:
            weights = batch["soft_target_weights"][:, pad:].astype(jnp.float32)  # [B, T, K], aligned with logits
            ids = batch["soft_target_ids"]  # [B, K]
            soft_logits = jnp.take_along_axis(logits, jnp.broadcast_to(ids[:, None, :], weights.shape), axis=-1)
            total = jnp.sum(weights, axis=-1)
            soft = jnp.sum(weights * soft_logits, axis=-1) - total * logz
            logp = jnp.where(total > 0, soft, logp)
        logp = jnp.pad(logp, ((0, 0), (pad, 0)))
        entropy = None
        if with_entropy:
            ent_logits = jax.lax.top_k(logits, entropy_top_k)[0] if entropy_top_k else logits
            ent_logz = jax.nn.logsumexp(ent_logits, axis=-1) if entropy_top_k else logz
            probs = jax.nn.softmax(ent_logits, axis=-1)
            ent = ent_logz - jnp.sum(probs * ent_logits, axis=-1)
            entropy = jnp.pad(ent, ((0, 0), (pad, 0)))
        if recorded:
            return logp, entropy, routing_stats(jax.lax.stop_gradient(routing.own), full_recorded)
        return logp, entropy

    return logp_fn


# ---------------------------------------------------------------------------------------------- boards

def load_boards(config) -> tuple[np.ndarray, np.ndarray]:
    """(train_boards, heldout_boards) as `int8 [N, 9]` from `config.env` (AReno-style generator or a JSONL)."""
    env = config.env
    if env.get("boards_path", ""):
        boards, _ = boards_lib.load_jsonl(env.boards_path)
    elif env.get("board_source", "random") == "play":
        boards = boards_lib.play_boards(env.num_boards, seed=env.board_seed, hero_epsilon=env.get("play_epsilon", 0.1),
                                        opponent_epsilon=env.get("opponent_epsilon", 0.5),
                                        o_share=env.get("o_share", 0.5))
    else:
        boards = boards_lib.generate_boards(env.num_boards, seed=env.board_seed,
                                            max_random_moves=env.get("max_random_moves", boards_lib.MAX_RANDOM_MOVES),
                                            sides=env.get("board_sides", "x"))
    boards = np.asarray(boards, np.int8)
    if env.get("heldout_fraction", 0.0):
        return boards_lib.train_heldout_split(boards, env.heldout_fraction, env.board_seed)
    return boards, boards[:0]


def eval_boards(name: str, config) -> np.ndarray:
    """Board set by name: `exhaustive` (every non-terminal X-to-move position), `exhaustive_o` (O to move),
    `exhaustive_both`, `train`, `heldout`, or a path."""
    sides = {"exhaustive": "x", "exhaustive_o": "o", "exhaustive_both": "both"}
    if name in sides:
        return np.asarray(boards_lib.exhaustive_positions(sides[name]), np.int8)
    if name in ("train", "heldout"):
        train, heldout = load_boards(config)
        return train if name == "train" else heldout
    if os.path.exists(name):
        return np.asarray(boards_lib.load_jsonl(name)[0], np.int8)
    raise ValueError(f"unknown board set {name!r}: use exhaustive, exhaustive_o, exhaustive_both, train, heldout or "
                     "a JSONL path")


# ---------------------------------------------------------------------------------------------- rollout

def env_name(config) -> str:
    """The registered environment of a config (`env.name`; configs without one are tic-tac-toe)."""
    return str(config.env.get("name", "tictactoe"))


def make_text_env(config, **overrides):
    """The config's `TextEnv` (`reno_jax.envs.registry`); `overrides` replace `config.env` fields (e.g. an
    evaluation's task or opponent)."""
    return registry.make(env_name(config), config.env, **overrides)


def make_compiled_env(config, tokenizer, model_config, **overrides):
    """`make_text_env` bound to the tokenizer and the model's vocabulary (host, once)."""
    return rollout_lib.compile_env(make_text_env(config, **overrides), tokenizer, vocab_size=model_config.vocab_size)


def rollout_config(config, *, greedy: bool = False, group_size: int | None = None) -> rollout_lib.RolloutConfig:
    """The static `RolloutConfig` of `config.rollout` (every field it sets; RolloutConfig's defaults otherwise).

    `greedy` and `group_size` override the config (evaluation decodes greedily, one episode per start).
    `rollout.parse_max_bytes` 0 means no cap.
    """
    r = config.rollout
    defaults = rollout_lib.RolloutConfig()
    parse_max_bytes = int(r.get("parse_max_bytes", 0) or 0)
    return rollout_lib.RolloutConfig(
        max_new_tokens=int(r.max_new_tokens),
        max_turns=int(r.max_turns),
        max_length=int(r.get("max_length", 0)),
        temperature=float(r.temperature),
        top_k=int(r.top_k),
        top_p=float(r.top_p),
        greedy=bool(greedy),
        group_size=int(group_size or r.group_size),
        prefill_chunk=int(r.get("prefill_chunk", defaults.prefill_chunk)),
        stop_at_tool_call=bool(r.get("stop_at_tool_call", defaults.stop_at_tool_call)),
        cache_dtype=str(r.get("cache_dtype", defaults.cache_dtype)),
        parse_max_bytes=parse_max_bytes or None,
        share_prompt_prefill=bool(r.get("share_prompt_prefill", defaults.share_prompt_prefill)),
        record_routing=records_routing(config),
    )


def records_routing(config) -> bool:
    """Whether the rollout records its MoE routing: for routing replay (`rl.routing_replay`) or only for the
    `train/routing_agreement` metric (`rl.routing_metrics`)."""
    return bool(config.rl.get("routing_replay", False) or config.rl.get("routing_metrics", False))


def rollout_summary(traj, task: str) -> dict[str, float]:
    """Per-step rollout metrics (host floats), named like the published AReno run where one exists."""
    info = jax.tree.map(np.asarray, traj.info)
    reward = np.asarray(traj.reward, np.float64)
    gen = np.asarray(traj.loss_mask).sum(axis=1)
    out = {
        "rollout/rewards_mean": float(reward.mean()),
        "rollout/rewards_std": float(reward.std()),
        "rollout/rewards_min": float(reward.min()),
        "rollout/rewards_max": float(reward.max()),
        "rollout/accuracy": float((reward > 0).mean()),
        "rollout/response_len_mean": float(gen.mean()),
        "rollout/prompt_len_mean": float(np.asarray(traj.prompt_length).mean()),
    }
    if "valid_call" in info:
        out["rollout/tool_call_valid_rate"] = float(np.mean(info["valid_call"]))
    if task == "move":
        for key, name in (("is_optimal", "optimal_move_rate"), ("is_seeking", "seeking_move_rate"),
                          ("illegal", "illegal_rate"), ("win_taken", "win_taken_rate")):
            if key in info:
                out[f"rollout/{name}"] = float(np.mean(info[key]))
    else:
        for key in ("win", "draw", "loss", "invalid", "illegal", "truncated"):
            if key in info:
                out[f"rollout/{key}_rate"] = float(np.mean(info[key]))
        if "num_turns" in info:
            out["rollout/turns_mean"] = float(np.mean(info["num_turns"]))
    return out


def bad_call_rates(valid_call, illegal, num_turns) -> dict:
    """Invalid or illegal calls per episode and per call, from `[B]` arrays of the rollout and the environment.

    Every registered environment ends an episode at its first invalid or illegal call, so such an episode holds
    exactly one and `num_turns` (the agent's turns, that call included) counts every call made:
    `invalid_or_illegal_rate` is the share of episodes that end on a bad call, `invalid_or_illegal_per_call` the
    share of all calls that were bad.
    """
    bad = ~np.asarray(valid_call, bool) | np.asarray(illegal, bool)
    calls = int(np.sum(np.asarray(num_turns)))
    return {"invalid_or_illegal_rate": float(np.mean(bad)), "agent_calls": calls,
            "invalid_or_illegal_per_call": float(np.sum(bad) / max(calls, 1))}


# ---------------------------------------------------------------------------------------------- optimisation

def make_optimizer(config):
    """The RL optimiser of a config (AdamW, warmup + cosine, global-norm clipping). With a curriculum, one optimiser
    for the whole run whose learning rate follows each stage's own schedule over that stage's updates."""
    r = config.rl
    stages = curriculum_stages(config) if config.get("curriculum", None) else None
    schedule = None
    if stages is not None and len(stages) > 1:
        pieces, lengths = [], []
        for stage in stages:
            sr = stage.config.rl
            updates = stage.num_steps * int(sr.num_minibatches)
            pieces.append(trainer.make_lr_schedule(sr.learning_rate, sr.end_learning_rate,
                                                   min(sr.warmup_steps, updates), updates))
            lengths.append(updates)
        schedule = trainer.join_lr_schedules(pieces, lengths)
    total = config.num_steps * r.num_minibatches
    return trainer.make_optimizer(
        r.learning_rate, r.end_learning_rate, min(r.warmup_steps, total), total,
        b1=r.b1, b2=r.b2, weight_decay=r.weight_decay, clip_norm=r.clip_norm,
        state_dtype=None if r.optimizer_state_dtype == "float32" else r.optimizer_state_dtype, schedule=schedule)


def learner_config(config, step_offset: int = 0) -> learner_lib.LearnerConfig:
    """The `LearnerConfig` of `config.rl` / `config.rollout` (the forking schedule is fed to the loss whenever a
    forking regulariser, entropy bonus or KL anchor, is on). `step_offset`: the steps of the curriculum stages
    before this one (`Stage.first_step`)."""
    r = config.rl
    forking = bool(r.get("forking_entropy_coef", 0.0)) or bool(r.get("forking_kl_coef", 0.0))
    return learner_lib.LearnerConfig(
        group_size=int(config.rollout.group_size), train_groups=int(r.get("train_groups", 0)),
        normalize_adv_std=bool(r.normalize_adv_std), forking_schedule=forking, num_steps=int(config.num_steps),
        forking_entropy_hold=float(r.get("forking_entropy_hold", 1.0)),
        forking_entropy_end=float(r.get("forking_entropy_end", 1.0)),
        share_prompt_prefix=bool(r.get("share_prompt_prefix", False)),
        share_common_prefix=bool(r.get("share_common_prefix", False)), num_minibatches=int(r.num_minibatches),
        num_microbatches=int(r.num_microbatches), max_logp_shift=float(r.get("max_logp_shift", 0.0)),
        shift_probe_groups=int(r.get("shift_probe_groups", 8)), step_offset=int(step_offset))


def mismatch_corrections(config) -> tuple[float, tuple[float, float] | None]:
    """``(tis_cap or 0.0, (icepop_low, icepop_high) or None)`` from `config.rl`, validated.

    `rl.tis_cap`: 0 = off, else >= 1 (``inf`` allowed). `rl.icepop_low` / `rl.icepop_high`: both 0 = off; a 0 bound
    is open on that side (low 0, high ``inf``); otherwise ``0 < low < 1 < high`` so that on-policy tokens are kept.
    """
    r = config.rl
    cap = float(r.get("tis_cap", 0.0))
    if cap != 0.0 and not cap >= 1.0:  # "not >=" also rejects NaN
        raise ConfigError(f"--config.rl.tis_cap must be 0 (off) or >= 1 (a cap below 1 down-weights on-policy tokens), "
                         f"got {cap}")
    low, high = float(r.get("icepop_low", 0.0)), float(r.get("icepop_high", 0.0))
    if low == 0.0 and high == 0.0:
        return cap, None
    if not (0.0 <= low < 1.0):
        raise ConfigError(f"--config.rl.icepop_low must be 0 (no lower bound) or in (0, 1), got {low}")
    if high != 0.0 and not high > 1.0:
        raise ConfigError(f"--config.rl.icepop_high must be 0 (no upper bound) or > 1, got {high}")
    return cap, (low, high if high else math.inf)


def make_loss_fn(config):
    r = config.rl
    kwargs = {}
    if r.loss in ("gspo", "gspo_token", "grpo", "dr_grpo", "dapo"):
        kwargs.update(eps_low=r.eps_low, eps_high=r.eps_high)
    if r.kl_coef:
        kwargs["kl_coef"] = r.kl_coef
    if r.entropy_coef:
        kwargs["entropy_coef"] = r.entropy_coef
    loss_fn = functools.partial(losses.get_loss(r.loss), **kwargs)
    # Mismatch corrections wrap the policy loss only (the forking regularisers go outside). TIS goes outside IcePop,
    # so its metrics cover every policy token.
    tis_cap, icepop_window = mismatch_corrections(config)
    if icepop_window is not None:
        loss_fn = losses.with_icepop(loss_fn, *icepop_window)
    if tis_cap:
        loss_fn = losses.with_tis(loss_fn, tis_cap)
    if r.get("forking_entropy_coef", 0.0) and r.get("forking_kl_coef", 0.0):
        raise ConfigError("--config.rl.forking_entropy_coef and --config.rl.forking_kl_coef are alternatives: "
                          "set one of them to 0")
    if r.get("forking_entropy_coef", 0.0):
        loss_fn = losses.with_forking_entropy_bonus(loss_fn, r.forking_entropy_coef, r.get("forking_top_k", 1),
                                                    per_turn=bool(r.get("forking_per_turn", False)))
    elif r.get("forking_kl_coef", 0.0):
        loss_fn = losses.with_forking_kl(loss_fn, r.forking_kl_coef, r.get("forking_top_k", 1),
                                         per_turn=bool(r.get("forking_per_turn", False)))
    return loss_fn


# ---------------------------------------------------------------------------------------------- saved runs

def load_run(workdir: str, step: int | None = None, mesh_config: parallel.MeshConfig | None = None):
    """(config, tokenizer, model_config, params, step) of a checkpoint of the training run in `workdir`.

    The restore target is built from shapes alone (`abstract_model`): no weights are drawn or read before the
    checkpoint's. The params land on `mesh_config`'s mesh (default: one device), whatever mesh or number of
    processes wrote the checkpoint. Raises `RunError` for a workdir without a run, a run without a checkpoint yet, or a `step`
    that has none (the message lists the saved steps).
    """
    if not os.path.isdir(workdir):
        raise RunError(f"--workdir={workdir} does not exist; expected the workdir of a training run")
    config_path = os.path.join(workdir, "config.json")
    if not os.path.isfile(config_path):
        raise RunError(f"--workdir={workdir} holds no training run (no config.json); train one with "
                       f"python -m experiments.train_tictactoe --workdir={workdir}")
    with open(config_path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    tokenizer = build_tokenizer(config)
    model_config, abstract_params = abstract_model(config, tokenizer)
    optimizer = make_optimizer(config)
    layout = parallel.Layout.create(model_config, mesh_config)
    abstract = layout.abstract_state(
        jax.eval_shape(lambda p: trainer.create_train_state(p, optimizer, 0), abstract_params))
    with ckpt_lib.Checkpointer(workdir, async_save=False) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise RunError(f"--workdir={workdir} has no checkpoint yet under {ckpt_lib.CHECKPOINT_SUBDIR}/ "
                           f"(a run saves one every checkpoint_every steps)")
        if step is not None and step not in steps:
            raise RunError(f"--step={step} has no checkpoint in {workdir}; saved steps: {steps}")
        step = steps[-1] if step is None else step
        state = ckpt.restore(abstract, step=step)
    return config, tokenizer, model_config, state.params, step
