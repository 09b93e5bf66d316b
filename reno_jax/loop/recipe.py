"""The RL recipe of a config: its optimiser, its loss (with corrections and regularisers) and the learner's
static settings. `config`: a `run_config.RunConfig` (a ConfigDict or dict is loaded into one first)."""

from __future__ import annotations

import functools

from reno_jax import run_config
from reno_jax.loop import curriculum
from reno_jax.rl import learner as learner_lib
from reno_jax.rl import losses, trainer


def make_optimizer(config):
    """The RL optimiser of a config (AdamW, warmup + cosine, global-norm clipping). With a curriculum, one optimiser
    for the whole run whose learning rate follows each stage's own schedule over that stage's updates."""
    config = run_config.load(config)
    r = config.rl
    stages = curriculum.curriculum_stages(config) if config.curriculum else None
    schedule = None
    if stages is not None and len(stages) > 1:
        pieces, lengths = [], []
        for stage in stages:
            sr = stage.config.rl
            updates = stage.num_steps * sr.num_minibatches
            pieces.append(
                trainer.make_lr_schedule(sr.learning_rate, sr.end_learning_rate, min(sr.warmup_steps, updates), updates)
            )
            lengths.append(updates)
        schedule = trainer.join_lr_schedules(pieces, lengths)
    total = config.num_steps * r.num_minibatches
    return trainer.make_optimizer(
        r.learning_rate,
        r.end_learning_rate,
        min(r.warmup_steps, total),
        total,
        b1=r.b1,
        b2=r.b2,
        weight_decay=r.weight_decay,
        clip_norm=r.clip_norm,
        state_dtype=None if r.optimizer_state_dtype == "float32" else r.optimizer_state_dtype,
        schedule=schedule,
    )


def learner_config(config, step_offset: int = 0) -> learner_lib.LearnerConfig:
    """The run's `LearnerConfig` (`RunConfig.learner_config`); `step_offset`: the steps of the curriculum stages
    before this one (`Stage.first_step`)."""
    return run_config.load(config).learner_config(step_offset)


def mismatch_corrections(config) -> tuple[float, tuple[float, float] | None]:
    """``(tis_cap or 0.0, (icepop_low, icepop_high) or None)`` of `config.rl` (`run_config.mismatch_corrections`)."""
    return run_config.mismatch_corrections(run_config.load(config).rl)


def make_loss_fn(config):
    """The run's loss: the policy loss of `rl.loss`, its mismatch corrections, then the forking regulariser.
    (Their rules, e.g. a token-level loss for turn advantages, are checked by `run_config.check`.)"""
    r = run_config.load(config).rl
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
    tis_cap, icepop_window = run_config.mismatch_corrections(r)
    if icepop_window is not None:
        loss_fn = losses.with_icepop(loss_fn, *icepop_window)
    if tis_cap:
        loss_fn = losses.with_tis(loss_fn, tis_cap)
    if r.forking_entropy_coef:
        loss_fn = losses.with_forking_entropy_bonus(
            loss_fn, r.forking_entropy_coef, r.forking_top_k, per_turn=r.forking_per_turn
        )
    elif r.forking_kl_coef:
        loss_fn = losses.with_forking_kl(loss_fn, r.forking_kl_coef, r.forking_top_k, per_turn=r.forking_per_turn)
    return loss_fn
