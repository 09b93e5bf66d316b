"""The RL step as library code: a rollout's `Trajectory` -> train batch -> optimizer update.

One step of agentic RL post-training is

  rollout (jitted, the caller's)  ->  prepare_batch (jitted)  ->  [shared-prefix cut]  ->  train_step (jitted)

* ``prepare_batch(traj, step) -> (batch, stats)``: group-relative advantages (``losses.group_advantages``),
  DAPO-style dynamic sampling (``select_groups``: train on the groups whose rewards vary most) and the
  forking-regulariser coefficient of this step (``forking_entropy_schedule`` evaluated on the device step
  counter), compiled as one program. ``stats`` (`BatchStats`) holds device scalars:
  ``informative_group_rate`` and, for shared-prefix training and trimming, the lengths below.
* ``Learner.learner_step(state, traj) -> (state, metrics)``: the composition, with ``metrics`` device arrays
  named like the experiments log them (``train/<loss metric>``, ``rollout/informative_group_rate``).
* ``Learner.run_step(state, starts_fn) -> StepOutput``: draws the step's keys from ``state.rng``, rolls out and
  learns.

Host syncs inside a step (everything else stays on the device; ``tests/test_learner.py`` runs steps under
``jax.transfer_guard("disallow")`` with every other host read of a device value trapped), each read through
``host_sync(name, x)``:

* ``LENGTHS_SYNC`` (only with ``share_prompt_prefix``, ``share_common_prefix``, ``length_bucket`` or
  ``row_bucket``): int32 scalars read in one transfer: the batch's shortest prompt (with a shared prefix), how many
  leading tokens every row shares (with ``share_common_prefix``), one past its last real column (with
  ``length_bucket``) and how many rows hold policy tokens (with ``row_bucket``: the rows trained on are a shape). The
  shared-prefix cut and the trimmed width are array *shapes* (``prefix_tokens [B, S]``), so they must be Python
  ints. S is the running minimum over the run, so the train step recompiles only when a shorter prompt than any
  before shows up; the width is rounded up to ``length_bucket`` x (1, 2, 3, 4, 6, 8, ...)
  (``batch.bucketed_length``), so it takes a few values.
* ``ROLLOUT_WAIT`` (only ``run_step(time_rollout=True)``; a ``jax.block_until_ready``, not a read): waits for the
  rollout to finish so that its wall time can be reported apart from the train step's.

Reading the metrics (``jax.device_get``) is the caller's, once per step, when it logs.

The policy is abstracted as in ``trainer.make_train_step``: ``logp_fn(params, batch)`` and ``loss_fn``; the
trajectory is read through its fields ``tokens``, ``valid``, ``loss_mask``, ``behaviour_logp``, ``reward``,
``prompt_length`` and ``routing`` only (with turn advantages also ``turn_id``, ``turn_reward`` and ``turn_key``),
so any environment's rollout that fills them can be trained on.

Turn samples (a bounded-history rollout, `reno_jax.rollout.rollout`: ``Trajectory.episode_id`` is set): the rows
are the T turns of each episode, episode-major, and ``reward`` is the episode's on each of them. Advantages are the
episodes' (``group_advantages`` over the G episodes of a group), broadcast to every turn sample of the episode,
plus with ``turn_advantage_coef`` its turn's advantage (``turn_advantages`` over ``turn_reward``/``turn_key``
``[B, T]``): one scalar per row, so any loss takes them. Groups are the G * T rows of G episodes
(``select_groups``). GSPO's sequence ratio is then per turn sample, and the loss is the mean over turn samples
that have policy tokens (a padding row, a turn after the episode ended, has none): an episode weighs by the turns
it played, as its tokens do in the whole conversation. ``share_prompt_prefix`` does not apply (the turn samples
of a group do not share a prompt); ``share_common_prefix`` alone does: every turn sample starts with the system
prompt, which the train step then encodes once for the batch (``shared_prefix``, the common part alone).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from reno_jax.rl import losses, shared_prefix, trainer
from reno_jax.rl.batch import TrainBatch, bucketed_length, trim_length, used_length

Array = jax.Array

LENGTHS_SYNC = "batch_lengths"
ROLLOUT_WAIT = "rollout_wait"
TURN_SCOPES = ("group", "batch")
TURN_WEIGHTS = ("turn", "episode")  # `LearnerConfig.turn_weight`


# ---------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Static settings of the learner (hashable: they shape the compiled programs).

    group_size: G, consecutive trajectory rows that share a start (a GSPO / GRPO group).
    train_groups: train on this many groups, those with the largest reward spread (0: all of them).
    normalize_adv_std: divide group-centred rewards by the group's std (``losses.group_advantages``).
    forking_schedule: feed ``entropy_scale`` (the schedule below) to the loss: the forking-entropy bonus and the
      forking KL read it as a multiplier of their coefficient.
    num_steps, forking_entropy_hold, forking_entropy_end: the schedule, see ``forking_entropy_schedule``.
    share_prompt_prefix: score each group with its prompt encoded once (``reno_jax.rl.shared_prefix``).
    share_common_prefix: encode the part every row of the batch shares (the system prompt and tool schema) once
      for the whole batch: before each group's prompt with ``share_prompt_prefix``; alone, every row continues
      from it (turn samples: `shared_prefix`'s common part alone).
    num_minibatches, num_microbatches: passed to ``trainer.make_train_step``.
    max_logp_shift, shift_probe_groups: the update guard of ``trainer.make_train_step`` (0: off), probing the
      first ``shift_probe_groups`` groups of each minibatch (at most the groups of a micro-batch when the
      ``Learner`` is told ``num_groups``).
    step_offset: train steps done before this learner's stage of a curriculum; the forking schedule is evaluated
      at ``TrainState.step - step_offset`` (its ``num_steps`` are the stage's).
    turn_advantage_coef, turn_discount: multi-turn credit: each policy token's advantage is its episode's plus
      ``turn_advantage_coef`` times its turn's advantage among the group's turns taken from the same state
      (``losses.turn_advantages`` with ``turn_discount``; GiGPO's step credit, `turn_sample_advantages`; on whole
      conversations it needs a loss that takes ``[B, L]`` advantages, on turn samples it is one per row). 0: off.
    turn_scope: "group": a turn is compared with its group's turns from the same state key; "batch": with every
      turn of the batch from that key (for keys that name what the agent knows, so that groups whose starts differ
      meet at the same decision; see ``TextEnv.state_key``).
    turn_weight: turn samples only: "turn": every turn sample weighs the same in the loss (an episode of 15 turns
      15 times one of 5); "episode": each turn sample's advantage is scaled by the batch's mean turns per episode
      over its episode's turns, so every episode weighs the same (as one whole-conversation row does) and a
      group's advantages sum to zero again: with "turn" the long episodes (often the failed ones) outweigh the
      short solved ones and push down every move they made, the good early ones too.
    length_bucket: > 0: train on the batch's columns up to its last real token, rounded up to this times 1, 2, 3,
      4, 6, 8, ... (`batch.bucketed_length`, `batch.trim_length`; exact), instead of the whole conversation
      length: for multi-turn episodes whose length varies (a game won in 6 moves or drawn in 21). Each width
      compiles the train step once. 0: off.
    row_bucket: > 0: train on the rows that hold policy tokens only, their count rounded up to a multiple of
      this (`compact_rows`; exact: a row without policy tokens adds nothing to the loss, its gradient or the
      sequence-mean normaliser): for turn samples, whose ``[B * T]`` rows include every turn an episode did not
      play (a room solved in 6 moves of a 15-move budget leaves 9 padding rows). A multiple of
      ``num_minibatches * num_microbatches``; each row count compiles the train step once (at most ``B /
      row_bucket`` programs). Not with ``share_prompt_prefix`` (its micro-batches must hold whole groups). 0: off.
    """

    group_size: int
    train_groups: int = 0
    normalize_adv_std: bool = True
    forking_schedule: bool = False
    num_steps: int = 1
    forking_entropy_hold: float = 1.0
    forking_entropy_end: float = 1.0
    share_prompt_prefix: bool = False
    share_common_prefix: bool = False
    num_minibatches: int = 1
    num_microbatches: int = 1
    max_logp_shift: float = 0.0
    shift_probe_groups: int = 8
    step_offset: int = 0
    turn_advantage_coef: float = 0.0
    turn_discount: float = 1.0
    turn_scope: str = "group"
    turn_weight: str = "turn"
    length_bucket: int = 0
    row_bucket: int = 0

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.train_groups < 0:
            raise ValueError(f"train_groups must be >= 0 (0: every group), got {self.train_groups}")
        if self.num_minibatches < 1 or self.num_microbatches < 1:
            raise ValueError("num_minibatches and num_microbatches must be >= 1")
        if self.step_offset < 0:
            raise ValueError(f"step_offset must be >= 0, got {self.step_offset}")
        if not self.turn_advantage_coef >= 0.0 or not 0.0 < self.turn_discount <= 1.0:
            raise ValueError(
                f"turn_advantage_coef must be >= 0 and turn_discount in (0, 1], got "
                f"{self.turn_advantage_coef}, {self.turn_discount}"
            )
        if self.turn_scope not in TURN_SCOPES:
            raise ValueError(f"turn_scope must be one of {TURN_SCOPES}, got {self.turn_scope!r}")
        if self.turn_weight not in TURN_WEIGHTS:
            raise ValueError(f"turn_weight must be one of {TURN_WEIGHTS}, got {self.turn_weight!r}")
        if self.length_bucket < 0:
            raise ValueError(f"length_bucket must be >= 0 (0: off), got {self.length_bucket}")
        splits = self.num_minibatches * self.num_microbatches
        if self.row_bucket < 0 or self.row_bucket % splits:
            raise ValueError(
                f"row_bucket must be >= 0 (0: off) and a multiple of num_minibatches * num_microbatches = {splits}, "
                f"got {self.row_bucket}"
            )
        if self.row_bucket and self.share_prompt_prefix:
            raise ValueError("row_bucket does not go with share_prompt_prefix (micro-batches of whole groups)")
        if self.shift_probe_groups < 1:  # max_logp_shift itself: `trainer.make_train_step`'s check
            raise ValueError(f"shift_probe_groups must be >= 1, got {self.shift_probe_groups}")

    def trained_groups(self, num_groups: int) -> int:
        """Groups trained on per step when `num_groups` are rolled out."""
        return min(self.train_groups or num_groups, num_groups)

    def check_num_groups(self, num_groups: int) -> None:
        """Raises ValueError when a step of `num_groups` groups cannot be split as configured."""
        trained = self.trained_groups(num_groups)
        splits = self.num_minibatches * self.num_microbatches
        if self.share_prompt_prefix and trained % splits:
            # The shared-prefix scorer encodes each group's prompt once per piece, so a piece must hold whole groups.
            raise ValueError(
                "share_prompt_prefix needs whole groups in every minibatch / micro-batch: "
                f"{trained} trained groups per step are not divisible by "
                f"num_minibatches * num_microbatches = {splits}"
            )
        if (trained * self.group_size) % splits:
            raise ValueError(
                f"{trained * self.group_size} trained rows per step are not divisible by "
                f"num_minibatches * num_microbatches = {splits}"
            )


# ---------------------------------------------------------------------------------------------- schedule


def forking_entropy_schedule(num_steps: int, hold: float, end: float) -> optax.Schedule:
    """Scale of the forking regulariser at train step `count`: 1 until `hold * num_steps`, then linear to 0 at
    `end * num_steps`, 0 after.

    Exploration is kept up while the policy still learns which squares are good, then released so the sampled
    policy can sharpen onto them before the end of the run.

    An optax schedule (jittable, float32) of the step counter: ``optax.join_schedules`` of a constant 1, an
    ``optax.linear_schedule`` from 1 to 0 over the ramp and a constant 0. The boundaries `hold * num_steps` and
    `end * num_steps` need not be whole steps (the ramp is evaluated at the step's distance from its start).
    `num_steps` below 1 counts as 1. With `end <= hold` there is no ramp: 1 up to and including step
    `hold * num_steps`, 0 after (so `hold >= 1` keeps the scale at 1 for the whole run).
    """
    n = max(int(num_steps), 1)
    start, stop = float(hold) * n, float(end) * n
    if stop > start:
        pieces = [
            optax.constant_schedule(1.0),
            optax.linear_schedule(1.0, 0.0, stop - start),
            optax.constant_schedule(0.0),
        ]
        joined = optax.join_schedules(pieces, [start, stop])
    else:  # no ramp: 1 while step <= hold * n
        joined = optax.join_schedules(
            [optax.constant_schedule(1.0), optax.constant_schedule(0.0)], [math.floor(start) + 1]
        )

    def schedule(count):
        return jnp.asarray(joined(jnp.asarray(count, jnp.int32)), jnp.float32)

    return schedule


# ---------------------------------------------------------------------------------------------- group selection


@functools.partial(jax.jit, static_argnames=("group_size", "train_groups"))
def select_groups(batch: TrainBatch, reward: Array, group_size: int, train_groups: int) -> tuple[TrainBatch, Array]:
    """Keeps the `train_groups` groups whose rewards vary most (every group when 0 or >= the number of groups).

    A group whose G rewards are all equal has zero advantage everywhere and contributes nothing to the policy
    gradient (DAPO's "dynamic sampling" drops such groups); rolling out more groups than we train on and keeping
    the most informative ones spends the expensive backward pass where the gradient is. Ties keep the earlier
    group. Returns the (possibly smaller) batch, rows of a group kept together and in order, and the share of
    groups with non-zero reward spread as a float32 device scalar.
    """
    r = reward.reshape(-1, group_size)
    n = r.shape[0]
    informative = jnp.max(r, axis=1) > jnp.min(r, axis=1)  # exact: no float rounding from a mean
    rate = jnp.mean(informative)
    if not train_groups or train_groups >= n:
        return batch, rate
    std = jnp.where(informative, r.std(axis=1), 0.0)
    order = jnp.argsort(-std, stable=True)[:train_groups]
    rows = (order[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)
    return jax.tree.map(lambda x: x[rows], batch), rate


# ---------------------------------------------------------------------------------------------- batch


@flax.struct.dataclass
class BatchStats:
    """What `prepare_batch` reports beside the batch (device scalars): the share of groups whose rewards differ,
    for the shared-prefix cut the shortest prompt and the length every row shares, for `length_bucket` one past
    the batch's last real column, and for `row_bucket` how many rows hold policy tokens (None unless needed)."""

    informative_group_rate: Array
    shortest_prompt: Array | None = None
    common_prefix: Array | None = None
    used_length: Array | None = None
    used_rows: Array | None = None


def common_prefix_length(tokens: Array, valid: Array | None = None) -> Array:
    """int32 []: how many leading columns of `tokens [B, L]` are the same in every row; with `valid [B, L]`, in
    every row that has a real token (a padding row, a turn an episode did not reach, holds pad ids)."""
    real = jnp.ones(tokens.shape[:1], bool) if valid is None else valid[:, 0]
    first = tokens[jnp.argmax(real)]
    same = jnp.all((tokens == first[None, :]) | ~real[:, None], axis=0).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(same))


def compact_rows(batch: TrainBatch, num_rows: int) -> TrainBatch:
    """The first ``num_rows`` rows of `batch` after a stable sort that puts the rows holding policy tokens first
    (a row-wise batch: every field has the leading dimension B). Exact when at most ``num_rows`` rows hold policy
    tokens: the rows left out have none, so they add nothing to the loss or its gradient, and the sequence-mean
    losses count only rows that have some."""
    if batch.shared_prefix:
        raise ValueError("compact_rows takes a row-wise batch: compact before the shared-prefix cut")
    if not 0 < num_rows <= batch.num_rows:
        raise ValueError(f"num_rows must be in 1..{batch.num_rows}, got {num_rows}")
    if num_rows == batch.num_rows:
        return batch
    order = jnp.argsort(~jnp.any(batch.loss_mask, axis=1), stable=True)[:num_rows]
    return jax.tree.map(lambda x: x[order], batch)


def make_prepare_batch(config: LearnerConfig) -> Callable[[Any, Array], tuple[TrainBatch, BatchStats]]:
    """`prepare_batch(traj, step) -> (batch, stats)`: one compiled program, no host sync.

    `batch` is the row-wise `TrainBatch` of `trainer.make_train_step` (with `routing` when the rollout recorded it
    and `entropy_scale [B]` with `forking_schedule`);
    `step` is the train step counter (`TrainState.step`, int32 on the device) the schedule is evaluated at.
    """
    schedule = (
        forking_entropy_schedule(config.num_steps, config.forking_entropy_hold, config.forking_entropy_end)
        if config.forking_schedule
        else None
    )

    @jax.jit
    def assemble(traj, step):
        rows_per_group = config.group_size
        if getattr(traj, "episode_id", None) is not None:  # turn samples: a group is G episodes x T turns
            rows_per_group = config.group_size * traj.turn_reward.shape[1]
            advantages = turn_sample_advantages(config, traj)
        else:
            advantages = _episode_advantages(config, traj)
        # routing: the rollout's [B, L, n_moe, K] experts (None unless recorded), replayed and/or compared
        batch = TrainBatch(
            tokens=traj.tokens,
            valid=traj.valid,
            loss_mask=traj.loss_mask,
            old_logp=traj.behaviour_logp,
            advantages=advantages,
            routing=traj.routing,
        )
        batch, informative = select_groups(batch, traj.reward, rows_per_group, config.train_groups)
        if schedule is not None:  # per row because the trainer splits loss inputs like the batch
            scale = schedule(step - config.step_offset)
            batch = batch.replace(entropy_scale=jnp.full(batch.advantages.shape[:1], scale, jnp.float32))
        # over every rolled-out row, selected or not, as the cut always was
        shared = config.share_prompt_prefix or config.share_common_prefix
        real_prompt = jnp.where(traj.prompt_length > 0, traj.prompt_length, traj.tokens.shape[1])  # 0: padding
        shortest = jnp.min(real_prompt) if shared else None
        common = common_prefix_length(traj.tokens, traj.valid) if config.share_common_prefix else None
        used = used_length(batch.valid) if config.length_bucket else None
        rows = jnp.sum(jnp.any(batch.loss_mask, axis=1)).astype(jnp.int32) if config.row_bucket else None
        return batch, BatchStats(
            informative_group_rate=informative,
            shortest_prompt=shortest,
            common_prefix=common,
            used_length=used,
            used_rows=rows,
        )

    def prepare_batch(traj, step):
        if getattr(traj, "episode_id", None) is not None and config.share_prompt_prefix:
            raise ValueError("share_prompt_prefix does not apply to turn samples (rollout.history): turn it off")
        if getattr(traj, "episode_id", None) is None and config.turn_weight != "turn":
            raise ValueError(
                f"turn_weight={config.turn_weight!r} applies to turn samples only (rollout.history >= 0); a whole "
                "conversation is one row already"
            )
        # The figures of the trajectory stay out of the program: it reads the token fields and rewards only.
        return assemble(traj.replace(stats=None, env_info=None), step)

    return prepare_batch


def _episode_advantages(config: LearnerConfig, traj) -> Array:
    """``[B]`` group advantages of whole-conversation rows, or ``[B, L]`` with turn credit."""
    advantages = losses.group_advantages(traj.reward, config.group_size, normalize_std=config.normalize_adv_std)
    if config.turn_advantage_coef:  # [B, L]: each turn's tokens also get their turn's credit
        peers = traj.turn_reward.shape[0] if config.turn_scope == "batch" else config.group_size
        turn_adv = losses.turn_advantages(
            traj.turn_reward, traj.turn_key, peers, config.turn_discount, normalize_std=config.normalize_adv_std
        )
        advantages = losses.token_advantages(
            advantages, turn_adv, traj.turn_id, traj.loss_mask, config.turn_advantage_coef
        )
    return advantages


def turn_sample_advantages(config: LearnerConfig, traj) -> Array:
    """``[B * T]`` advantages of turn samples (module docstring): the episode's group advantage on each of its T
    rows, plus ``turn_advantage_coef`` times the turn's advantage among the turns from the same state key.

    That is GiGPO's (arXiv 2505.10978) A = A_episode + w * A_step with w = ``turn_advantage_coef``: the anchor-state
    groups are the turns of the group's G episodes (of the batch with ``turn_scope="batch"``) whose state key is
    equal, a turn's step return is the ``turn_discount``-discounted sum of its episode's turn rewards from that turn
    on, and A_step is that return minus its anchor group's mean, divided by the group's std with
    ``normalize_adv_std`` (the paper's default normalisation; without it, centred only, as the episode part).
    With ``turn_weight="episode"`` each row's advantage is then scaled by the mean turns per episode over its
    episode's turns (every episode weighs the same)."""
    t = traj.turn_reward.shape[1]
    episode_reward = traj.reward.reshape(-1, t)[:, 0]
    advantages = losses.group_advantages(episode_reward, config.group_size, normalize_std=config.normalize_adv_std)
    advantages = jnp.repeat(advantages, t)  # row b * T + t is episode b's turn t
    if config.turn_advantage_coef:
        peers = traj.turn_reward.shape[0] if config.turn_scope == "batch" else config.group_size
        turn_adv = losses.turn_advantages(
            traj.turn_reward, traj.turn_key, peers, config.turn_discount, normalize_std=config.normalize_adv_std
        )
        advantages = advantages + jnp.float32(config.turn_advantage_coef) * turn_adv.reshape(-1)
    if config.turn_weight == "episode":
        turns = jnp.sum(jnp.any(traj.loss_mask.reshape(-1, t, traj.loss_mask.shape[-1]), axis=-1), axis=-1)  # [B]
        mean_turns = jnp.sum(turns) / jnp.maximum(jnp.sum(turns > 0), 1)
        advantages = advantages * jnp.repeat(mean_turns / jnp.maximum(turns, 1), t)
    return advantages.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------- learner


@flax.struct.dataclass
class StepOutput:
    """One `Learner.run_step`: the new state, the step's trajectory and metrics (device arrays); the rollout's
    wall time in seconds when it was timed (else None)."""

    state: trainer.TrainState
    traj: Any
    metrics: dict
    rollout_seconds: float | None


def host_sync(name: str, x):
    """The one way a step reads device values to the host: `jax.device_get(x)`, under a name of the module
    docstring's list (tests count the calls by name)."""
    del name
    return jax.device_get(x)


class Learner:
    """The jitted pieces of an RL step and their composition; see the module docstring.

    Args:
      config: `LearnerConfig`.
      logp_fn, loss_fn, optimizer: as in `trainer.make_train_step` (e.g. `policy.make_logp_fn(model_config,
        group_size=G)` and `recipe.make_loss_fn(config)`).
      ref_logp_fn, ref_params: a reference policy (`ref_logp_fn(params, batch).logp` [B, L]) scored on every
        train batch as `ref_logp`, for losses anchored to it (forking KL); both or neither.
      rollout_fn: `rollout_fn(params, key, starts) -> Trajectory`, for `run_step`.
      num_groups: groups rolled out per step, if known: the split into minibatches is checked up front.
      rollout_metrics, donate: `trainer.make_train_step`'s.
      combine, frozen: a run that trains part of the model (LoRA adapters, `policy.Adapted`) over a frozen tree
        (the base): `trainer.make_train_step(combine=)`'s, and the frozen tree every train step and rollout reads;
        the rollout runs `combine(state.params, frozen)`, the weights the train step scores. Both or neither.
    """

    def __init__(
        self,
        config: LearnerConfig,
        logp_fn: Callable,
        loss_fn: Callable,
        optimizer: optax.GradientTransformation,
        *,
        ref_logp_fn: Callable | None = None,
        ref_params: Any = None,
        rollout_fn: Callable | None = None,
        num_groups: int | None = None,
        rollout_metrics: bool = True,
        donate: bool = True,
        combine: Callable | None = None,
        frozen: Any = None,
    ):
        if (ref_logp_fn is None) != (ref_params is None):
            raise ValueError("ref_logp_fn and ref_params go together")
        if (combine is None) != (frozen is None):
            raise ValueError("combine and frozen go together")
        if num_groups is not None:
            config.check_num_groups(num_groups)
        self.config = config
        self.rollout_fn = rollout_fn
        self.ref_params = ref_params
        self.combine = combine
        self.frozen = frozen
        self.prepare_batch = make_prepare_batch(config)
        probe_groups = config.shift_probe_groups
        if num_groups is not None:  # the probe is the first groups of a micro-batch: at most the groups one holds
            splits = config.num_minibatches * config.num_microbatches
            probe_groups = max(1, min(probe_groups, config.trained_groups(num_groups) // splits))
        self.train_step = trainer.make_train_step(
            logp_fn,
            loss_fn,
            optimizer,
            num_minibatches=config.num_minibatches,
            num_microbatches=config.num_microbatches,
            loss_batch_keys=("entropy_scale",) if config.forking_schedule else (),
            rollout_metrics=rollout_metrics,
            donate=donate,
            max_logp_shift=config.max_logp_shift,
            shift_probe_rows=probe_groups * config.group_size,
            combine=combine,
        )
        self._ref_logp = None if ref_logp_fn is None else jax.jit(lambda p, b: ref_logp_fn(p, b).logp)
        self._split = jax.jit(shared_prefix.split_shared_prefix, static_argnums=(1, 2))
        self._trim = jax.jit(trim_length, static_argnums=1)
        self.prefix_len: int | None = None  # shared-prefix cut: the shortest prompt seen so far
        self.common_len: int | None = None  # batch-wide common part: the shortest seen so far
        self._compact = jax.jit(compact_rows, static_argnums=1)

    def policy_params(self, trained):
        """The model's params of the trained tree `trained` (`TrainState.params`): itself, or combined with the
        frozen base."""
        return trained if self.combine is None else self.combine(trained, self.frozen)

    def batch_lengths(self, stats: BatchStats) -> tuple[int, int, int | None, int | None]:
        """LENGTHS_SYNC: reads this batch's lengths to the host (one transfer); returns `(prefix_len, common_len,
        used, rows)`: the running minima of the shortest prompt and of the prefix every row shares (`common_len <
        prefix_len`; 0 without ``share_common_prefix``; with it alone both are the common part, at most the
        shortest prompt; both 0 without either) and one past the batch's last real column (None without
        ``length_bucket``) and how many rows hold policy tokens (None without ``row_bucket``)."""
        wanted = {
            "shortest": stats.shortest_prompt,
            "common": stats.common_prefix,
            "used": stats.used_length,
            "rows": stats.used_rows,
        }
        read = host_sync(LENGTHS_SYNC, {k: v for k, v in wanted.items() if v is not None})
        used = int(read["used"]) if "used" in read else None
        rows = int(read["rows"]) if "rows" in read else None
        if not (self.config.share_prompt_prefix or self.config.share_common_prefix):
            return 0, 0, used, rows
        shortest, common = int(read["shortest"]), int(read.get("common", 0))
        if not self.config.share_prompt_prefix:  # the common part alone: it may reach the first policy token
            common = min(common, shortest)
            self.common_len = common if self.common_len is None else min(self.common_len, common)
            return self.common_len, self.common_len, used, rows
        self.prefix_len = shortest if self.prefix_len is None else min(self.prefix_len, shortest)
        common = min(common, self.prefix_len - 1)
        self.common_len = common if self.common_len is None else min(self.common_len, common)
        return self.prefix_len, self.common_len, used, rows

    def train_batch(self, traj, step: Array) -> tuple[TrainBatch, BatchStats]:
        """`prepare_batch`, then its rows without policy tokens left out (``row_bucket``), trimmed
        (``length_bucket``) and cut at the shared prefix as configured: the batch the train step takes
        (LENGTHS_SYNC when any applies)."""
        batch, stats = self.prepare_batch(traj, step)
        config = self.config
        if config.share_prompt_prefix or config.share_common_prefix or config.length_bucket or config.row_bucket:
            prefix_len, common_len, used, rows = self.batch_lengths(stats)
            if rows is not None:
                bucket = config.row_bucket
                batch = self._compact(batch, min(batch.num_rows, max(bucket, -(-rows // bucket) * bucket)))
            if used is not None:
                width = bucketed_length(max(used, prefix_len + 1), batch.tokens.shape[1], config.length_bucket)
                batch = self._trim(batch, width)
            if prefix_len:
                batch = self._split(batch, prefix_len, common_len)
        return batch, stats

    def learner_step(self, state: trainer.TrainState, traj) -> tuple[trainer.TrainState, dict]:
        """Trains on one trajectory; returns the new state and the step's metrics (device float32 scalars).

        `state` is donated to the train step. Metrics: `train/<k>` for every train-step metric `k` and
        `rollout/informative_group_rate`. The only host sync is LENGTHS_SYNC (shared prefix or trimming only).
        """
        batch, stats = self.train_batch(traj, state.step)
        if self._ref_logp is not None:
            batch = batch.replace(ref_logp=self._ref_logp(self.ref_params, batch))
        frozen = () if self.combine is None else (self.frozen,)
        state, train_metrics = self.train_step(state, batch, *frozen)
        metrics = {f"train/{k}": v for k, v in train_metrics.items()}
        metrics["rollout/informative_group_rate"] = stats.informative_group_rate
        return state, metrics

    def run_step(
        self, state: trainer.TrainState, starts_fn: Callable[[Array], Any], *, time_rollout: bool = False
    ) -> StepOutput:
        """Rollout + `learner_step`. The step's key is split from `state.rng` into `(k_starts, k_rollout)`;
        `starts_fn(k_starts)` gives the episode starts (placed as the rollout needs them). With `time_rollout`,
        waits for the rollout (ROLLOUT_WAIT) to report its wall time from the start of this call."""
        if self.rollout_fn is None:
            raise ValueError("run_step needs Learner(rollout_fn=...)")
        t0 = time.time()
        state, step_key = trainer.split_rng(state)
        k_starts, k_rollout = jax.random.split(step_key)
        traj = self.rollout_fn(self.policy_params(state.params), k_rollout, starts_fn(k_starts))
        rollout_seconds = None
        if time_rollout:
            jax.block_until_ready(traj.reward)  # ROLLOUT_WAIT
            rollout_seconds = time.time() - t0
        state, metrics = self.learner_step(state, traj)
        return StepOutput(state=state, traj=traj, metrics=metrics, rollout_seconds=rollout_seconds)
