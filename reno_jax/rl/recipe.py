"""The RL recipe of a config: its optimiser, its loss (with corrections and regularisers) and the learner's
static settings."""

from __future__ import annotations

import functools
import math

from reno_jax.errors import ConfigError
from reno_jax.rl import curriculum, learner as learner_lib, losses, trainer


def make_optimizer(config):
    """The RL optimiser of a config (AdamW, warmup + cosine, global-norm clipping). With a curriculum, one optimiser
    for the whole run whose learning rate follows each stage's own schedule over that stage's updates."""
    r = config.rl
    stages = curriculum.curriculum_stages(config) if config.get("curriculum", None) else None
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
        shift_probe_groups=int(r.get("shift_probe_groups", 8)), step_offset=int(step_offset),
        turn_advantage_coef=float(r.get("turn_advantage_coef", 0.0)), turn_discount=float(r.get("turn_discount", 1.0)),
        turn_scope=str(r.get("turn_scope", "group")), length_bucket=int(r.get("length_bucket", 0)))


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
    if r.get("turn_advantage_coef", 0.0) and r.loss == "gspo":
        raise ConfigError("--config.rl.turn_advantage_coef gives every token its own advantage; --config.rl.loss=gspo "
                          "takes one per sequence: use --config.rl.loss=gspo_token (the same loss for sequence "
                          "advantages) or a token-level loss")
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
