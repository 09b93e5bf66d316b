"""Generic jitted RL train step, optimizer and train state.

* ``make_optimizer``: global-norm clipping + AdamW, linear warmup then cosine decay, optional low-memory Adam
  moments (``state_dtype="bfloat16"`` or ``"int8"``: 8-bit block-wise quantised moments).
* ``TrainState``: params, opt_state, step, skipped_updates, rng (a pytree; checkpointed as a whole).
* ``make_train_step``: PPO-style minibatches (sequential optimizer updates) with micro-batch gradient
  accumulation; non-finite loss or gradient skips the update and counts it. With ``combine`` the trained tree is
  only part of the model (LoRA adapters): ``train_step(state, batch, frozen)`` scores ``combine(state.params,
  frozen)`` and differentiates ``state.params`` alone; ``frozen`` (the base) is an argument of the program, never
  donated, differentiated or held by the optimizer.

The policy is abstracted by ``logp_fn(params, batch) -> (logp [B, L], entropy [B, L] or None)`` so the same step
trains the Ling-3.0 model and the toy policies of the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import optax

from reno_jax.rl import losses
from reno_jax.rl.batch import TrainBatch
from reno_jax.sharding import hints

Array = jax.Array
PyTree = Any


# ----------------------------------------------------------------------------------------------------------------
# Learning-rate schedule
# ----------------------------------------------------------------------------------------------------------------
def make_lr_schedule(
    learning_rate: float, end_learning_rate: float = 0.0, warmup_steps: int = 0, total_steps: int | None = None
) -> Callable[[Array], Array]:
    """Linear warmup then cosine decay, as a function of the optimizer update count (0-based); optax's
    ``warmup_cosine_decay_schedule``.

    * warmup: linear from ``learning_rate / warmup_steps`` at update 0 (so the first update is not wasted on a
      zero learning rate) to ``learning_rate`` at update ``warmup_steps``;
    * then cosine from ``learning_rate`` to ``end_learning_rate`` over updates ``[warmup_steps, total_steps]``,
      constant ``end_learning_rate`` afterwards (``total_steps == warmup_steps`` decays over one update);
    * ``total_steps=None``: constant ``learning_rate`` after warmup (``end_learning_rate`` unused);
    * ``warmup_steps=0``: no warmup, the cosine (or the constant) from update 0.
    * ``learning_rate=0``: 0 throughout (optax decays to ``end_learning_rate / learning_rate`` of the peak).

    Counts are optimizer updates: a train step with ``num_minibatches = M`` makes M updates. Returns float32.
    """
    if learning_rate < 0 or end_learning_rate < 0:
        raise ValueError("learning rates must be >= 0")
    warmup_steps = int(warmup_steps)
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps is not None and total_steps < warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")

    init_value = learning_rate / max(warmup_steps, 1)
    if total_steps is None:
        joined = optax.join_schedules(
            [optax.linear_schedule(init_value, learning_rate, warmup_steps), optax.constant_schedule(learning_rate)],
            [warmup_steps],
        )
    else:
        joined = optax.warmup_cosine_decay_schedule(
            init_value,
            learning_rate,
            warmup_steps,
            decay_steps=max(int(total_steps), warmup_steps + 1),
            end_value=end_learning_rate,
        )

    def schedule(count):
        return jnp.asarray(joined(count), jnp.float32)

    return schedule


def join_lr_schedules(
    schedules: Sequence[Callable[[Array], Array]], lengths: Sequence[int]
) -> Callable[[Array], Array]:
    """One schedule made of ``schedules[i]`` for ``lengths[i]`` updates each, in order, every piece counted from
    its own start (0-based); the last piece also runs past its length."""
    if len(schedules) != len(lengths) or not schedules:
        raise ValueError("join_lr_schedules needs one length per schedule, and at least one")
    if any(int(n) < 1 for n in lengths):
        raise ValueError(f"every piece needs at least one update, got lengths {list(lengths)}")
    if len(schedules) == 1:
        return schedules[0]
    return optax.join_schedules(list(schedules), boundaries=list(itertools.accumulate(int(n) for n in lengths[:-1])))


# ----------------------------------------------------------------------------------------------------------------
# Low-memory Adam moments
# ----------------------------------------------------------------------------------------------------------------
@flax.struct.dataclass
class QuantizedMoment:
    """A block-wise 8-bit quantised tensor: ``codes [n_blocks, block]`` (int8 or uint8), ``scale [n_blocks]`` f32.

    The original shape is not stored: it is always the shape of the matching gradient / parameter.
    """

    codes: Array
    scale: Array


@flax.struct.dataclass
class ScaleByAdamCompressedState:
    count: Array  # int32 [] number of updates so far
    mu: PyTree  # per leaf: array in state dtype, or QuantizedMoment
    nu: PyTree


@flax.struct.dataclass
class _LeafOut:
    """Per-leaf result of the compressed Adam update (a distinct type so tree_map can find it)."""

    update: Array
    mu: Any
    nu: Any


def _blocks(x, block_size):
    flat = x.reshape(-1).astype(jnp.float32)
    pad = (-flat.size) % block_size
    return jnp.pad(flat, (0, pad)).reshape(-1, block_size)


def _unblocks(b, shape):
    size = math.prod(shape)
    return b.reshape(-1)[:size].reshape(shape)


def _quantize_signed(x, block_size):
    """Companded signed 8-bit for the first moment: ``x = sign * absmax * (|code| / 127) ** 3``.

    Cube-root companding gives ~2% relative resolution for the large entries of a block and still represents
    entries down to absmax * 5e-7, where linear codes would round everything below absmax / 254 to 0. Adam
    normalises every element by its own second moment, so the relative error of *small* first moments matters
    as much as that of large ones: on a toy bigram-policy GRPO problem (12 Adam steps on a fixed batch),
    linear codes drifted ~13% (relative L2 of the parameter change) from the fp32 trajectory, cube-root ~3%.
    """
    b = _blocks(x, block_size)
    scale = jnp.max(jnp.abs(b), axis=1)
    u = jnp.cbrt(jnp.abs(b) / jnp.where(scale > 0, scale, 1.0)[:, None])
    q = jnp.sign(b) * jnp.round(127.0 * u)
    return QuantizedMoment(jnp.clip(q, -127, 127).astype(jnp.int8), scale)


def _dequantize_signed(q, shape):
    u = q.codes.astype(jnp.float32) / 127.0
    return _unblocks(u * u * u * q.scale[:, None], shape)


def _quantize_nonneg(x, block_size):
    """Companded unsigned 8-bit for the second moment: ``v = absmax * (code / 255) ** 4``.

    The fourth-root companding spreads the 256 levels over ~10 decades (smallest non-zero level is
    absmax * 2.4e-10), since second moments inside one block span many orders of magnitude. A non-zero value is
    never rounded to 0 (at least code 1): a zero second moment under a non-zero first moment would divide by
    ``eps`` alone and blow the update up, whereas over-estimating a tiny ``nu`` only shrinks that update.
    """
    b = jnp.maximum(_blocks(x, block_size), 0.0)
    scale = jnp.max(b, axis=1)
    u = jnp.sqrt(jnp.sqrt(b / jnp.where(scale > 0, scale, 1.0)[:, None]))
    q = jnp.round(255.0 * u)
    q = jnp.where(b > 0, jnp.maximum(q, 1.0), 0.0)
    return QuantizedMoment(jnp.clip(q, 0, 255).astype(jnp.uint8), scale)


def _dequantize_nonneg(q, shape):
    u = q.codes.astype(jnp.float32) / 255.0
    return _unblocks((u * u) * (u * u) * q.scale[:, None], shape)


def scale_by_adam_compressed(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    state_dtype: str = "bfloat16",
    block_size: int = 256,
    min_quantized_size: int = 4096,
) -> optax.GradientTransformation:
    """Adam's ``m / (sqrt(v) + eps)`` scaling with moments stored compactly; all arithmetic in float32.

    Args:
      state_dtype: ``"bfloat16"`` (2 bytes per moment; round-to-nearest storage), or ``"int8"`` (about 1 byte
        per moment + 4 bytes per block): block-wise 8-bit quantisation (in the spirit of Dettmers et al.,
        "8-bit Optimizers via Block-wise Quantization", whose dynamic code is replaced by a power law):
        codes are scaled by the block's absmax and companded (non-linear) so that small entries keep their
        relative precision: cube-root signed codes for the first moment (``_quantize_signed``), fourth-root
        unsigned codes for the second (``_quantize_nonneg``).
        Quantisation uses round-to-nearest; the update of a step is computed from the fp32 moments *before*
        they are re-quantised.
      block_size: elements per quantisation block (int8 only).
      min_quantized_size: leaves with fewer elements (norm scales, biases) keep float32 moments (int8 only);
        their memory is negligible and they are the most sensitive.
    """
    if state_dtype not in ("bfloat16", "int8"):
        raise ValueError(f"state_dtype must be 'bfloat16' or 'int8', got {state_dtype!r}")

    def is_quant(x):
        return state_dtype == "int8" and x.size >= min_quantized_size

    def store(x, kind):
        if state_dtype == "bfloat16":
            return x.astype(jnp.bfloat16)
        if not is_quant(x):
            return x.astype(jnp.float32)
        return _quantize_signed(x, block_size) if kind == "mu" else _quantize_nonneg(x, block_size)

    def load(stored, like, kind):
        if isinstance(stored, QuantizedMoment):
            return (_dequantize_signed if kind == "mu" else _dequantize_nonneg)(stored, like.shape)
        return stored.astype(jnp.float32)

    def zero_moment(p, kind):
        # Built directly: quantising a zeros constant makes XLA constant-fold the whole quantiser (minutes for a
        # multi-billion-parameter model).
        if state_dtype == "bfloat16":
            return jnp.zeros(p.shape, jnp.bfloat16)
        if not is_quant(p):
            return jnp.zeros(p.shape, jnp.float32)
        n_blocks = -(-p.size // block_size)
        codes_dtype = jnp.int8 if kind == "mu" else jnp.uint8
        return QuantizedMoment(jnp.zeros((n_blocks, block_size), codes_dtype), jnp.zeros((n_blocks,), jnp.float32))

    def init_fn(params):
        return ScaleByAdamCompressedState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: zero_moment(p, "mu"), params),
            nu=jax.tree.map(lambda p: zero_moment(p, "nu"), params),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        c1 = 1.0 - b1 ** count.astype(jnp.float32)
        c2 = 1.0 - b2 ** count.astype(jnp.float32)

        def leaf(g, mu_s, nu_s):
            g32 = g.astype(jnp.float32)
            mu = b1 * load(mu_s, g, "mu") + (1.0 - b1) * g32
            nu = b2 * load(nu_s, g, "nu") + (1.0 - b2) * g32 * g32
            u = (mu / c1) / (jnp.sqrt(nu / c2) + eps)
            return _LeafOut(u.astype(g.dtype), store(mu, "mu"), store(nu, "nu"))

        # mu / nu have the structure of ``updates`` with QuantizedMoment subtrees at the leaves: map over
        # ``updates`` so those subtrees arrive whole.
        out = jax.tree.map(leaf, updates, state.mu, state.nu)
        pick = lambda field: jax.tree.map(lambda t: getattr(t, field), out, is_leaf=lambda x: isinstance(x, _LeafOut))
        return pick("update"), ScaleByAdamCompressedState(count=count, mu=pick("mu"), nu=pick("nu"))

    return optax.GradientTransformation(init_fn, update_fn)


def _matrices_only(params):
    """Default weight-decay mask: decay matrices / embeddings (ndim >= 2), not norm scales or biases."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(
    learning_rate: float,
    end_learning_rate: float = 0.0,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    weight_decay: float = 0.01,
    clip_norm: float | None = 1.0,
    state_dtype: str | None = None,
    *,
    eps: float = 1e-8,
    weight_decay_mask: Any = "matrices",
    quant_block_size: int = 256,
    quant_min_size: int = 4096,
    schedule: Callable[[Array], Array] | None = None,
) -> optax.GradientTransformation:
    """Global-norm clipping + AdamW with linear warmup and cosine decay (``make_lr_schedule``).

    Args:
      learning_rate / end_learning_rate / warmup_steps / total_steps: the schedule (``total_steps=None``:
        constant after warmup). Steps count optimizer updates.
      b1, b2, eps: Adam.
      weight_decay: decoupled (AdamW) decay, applied to ``weight_decay_mask``: ``"matrices"`` (default: leaves
        with ndim >= 2), ``None`` (all leaves) or an optax mask (tree of bools / callable).
      clip_norm: clip the global gradient norm to this value before Adam; ``None`` or 0 disables.
      state_dtype: ``None`` (moments in the parameters' dtype, plain ``optax.scale_by_adam``), ``"bfloat16"``,
        or ``"int8"`` (block-wise 8-bit, see ``scale_by_adam_compressed``).
      schedule: a learning-rate schedule of the update count to use instead of the one the first four arguments
        describe (e.g. ``join_lr_schedules`` of a curriculum's stages).
    """
    if schedule is None:
        schedule = make_lr_schedule(learning_rate, end_learning_rate, warmup_steps, total_steps)
    parts = []
    if clip_norm:
        parts.append(optax.clip_by_global_norm(clip_norm))
    if state_dtype is None:
        parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    else:
        state_dtype = {"bf16": "bfloat16", "8bit": "int8"}.get(state_dtype, state_dtype)
        parts.append(scale_by_adam_compressed(b1, b2, eps, state_dtype, quant_block_size, quant_min_size))
    if weight_decay:
        mask = _matrices_only if weight_decay_mask == "matrices" else weight_decay_mask
        parts.append(optax.add_decayed_weights(weight_decay, mask=mask))
    parts.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*parts)


# ----------------------------------------------------------------------------------------------------------------
# Train state and step
# ----------------------------------------------------------------------------------------------------------------
@flax.struct.dataclass
class TrainState:
    """Everything a training run needs to resume bit-exactly (a pytree of arrays).

    params: the trained parameters (the model's, or with a frozen base the adapters trained over it).
    opt_state: optimizer state (of ``params`` only).  step: int32 [] train steps done (``train_step``
    calls).  skipped_updates: int32 [] optimizer updates skipped because of a non-finite loss / gradient.
    rng: uint32 [2] PRNG key owned by the training loop (rollout sampling etc.; ``split_rng``).
    """

    params: PyTree
    opt_state: PyTree
    step: Array
    skipped_updates: Array
    rng: Array


def create_train_state(params: PyTree, optimizer: optax.GradientTransformation, rng: Array | int) -> TrainState:
    """Fresh state: ``optimizer.init(params)``, counters at 0. ``rng``: a uint32 [2] key or an int seed."""
    if isinstance(rng, int):
        rng = jax.random.PRNGKey(rng)
    # One compiled program instead of op-by-op dispatch (much faster for big or quantised states).
    opt_state = jax.jit(optimizer.init)(params)
    return TrainState(
        params=params,
        opt_state=opt_state,
        step=jnp.zeros([], jnp.int32),
        skipped_updates=jnp.zeros([], jnp.int32),
        rng=jnp.asarray(rng),
    )


def split_rng(state: TrainState) -> tuple[TrainState, Array]:
    """Returns ``(state with advanced rng, fresh key)``: the functional way to draw randomness from the state."""
    new, key = jax.random.split(state.rng)
    return state.replace(rng=new), key


METRIC_REDUCTION_KINDS = ("mean", "min", "max", "sum", "count")
MISMATCH_MAXIMA = ("abs_max", "ratio_max")  # `mismatch_sums` entries that combine by max (the others are sums)


@flax.struct.dataclass
class RoutingStats:
    """Routing agreement counts of one (micro-)batch, float32 scalars, over the (token, MoE layer) pairs with a
    recorded rollout routing: ``agree`` those whose train-forward top-k set equals the rollout's, ``total`` all."""

    agree: Array
    total: Array


@flax.struct.dataclass
class PolicyOutput:
    """What a policy's ``logp_fn(params, batch: TrainBatch)`` returns (`rl.policy.make_logp_fn`).

    logp: ``float32 [B, L]``, ``logp[:, t] = log p(tokens[t] | tokens[:t])`` (0 at t = 0 and off the tokens the
      loss reads); entropy: ``float32 [B, L]`` of the next-token distribution at the same positions, or None;
      routing: the train forward's agreement with the rollout's recorded experts, or None.
    """

    logp: Array
    entropy: Array | None = None
    routing: RoutingStats | None = None


def mismatch_sums(logp: Array, behaviour_logp: Array, mask: Array) -> dict:
    """Sums behind the rollout/train mismatch metrics over the policy tokens (``mask``) of a (micro-)batch.

    d = logp - behaviour_logp (train forward minus the log-prob the token was sampled with); the k3 estimator
    exp(d) - 1 - d estimates KL(behaviour || train) from the behaviour's own samples (unbiased, >= 0).
    Returns float32 scalars: count, abs_sum, abs_max, k3_sum, ratio_max (max exp(d); 0 when nothing is masked).
    """
    m = mask.astype(jnp.bool_)
    d = jnp.where(m, logp.astype(jnp.float32) - behaviour_logp.astype(jnp.float32), 0.0)
    return dict(
        count=jnp.sum(m).astype(jnp.float32),
        abs_sum=jnp.sum(jnp.abs(d)),
        abs_max=jnp.max(jnp.where(m, jnp.abs(d), 0.0)),
        k3_sum=jnp.sum(jnp.expm1(d) - d),
        ratio_max=jnp.max(jnp.where(m, jnp.exp(d), 0.0)),
    )


def mismatch_metrics(sums: dict, routing: RoutingStats | None) -> dict:
    """``rollout_*`` metrics (and ``routing_agreement`` when the routing was recorded) from summed
    ``mismatch_sums`` / ``RoutingStats``."""
    count = jnp.maximum(sums["count"], 1.0)
    out = {
        "rollout_logp_abs_diff_mean": sums["abs_sum"] / count,
        "rollout_logp_abs_diff_max": sums["abs_max"],
        "rollout_k3_kl": sums["k3_sum"] / count,
        "rollout_ratio_max": sums["ratio_max"],
    }
    if routing is not None:
        out["routing_agreement"] = routing.agree / jnp.maximum(routing.total, 1.0)
    return out


def make_train_step(
    logp_fn: Callable,
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    num_minibatches: int = 1,
    num_microbatches: int = 1,
    *,
    shuffle: bool = False,
    donate: bool = True,
    loss_batch_keys: Sequence[str] = (),
    rollout_metrics: bool = False,
    max_logp_shift: float = 0.0,
    shift_probe_rows: int = 0,
    shift_backtracks: int = 4,
    metric_reductions: Mapping[str, str] | None = None,
    combine: Callable | None = None,
) -> Callable[..., tuple[TrainState, dict]]:
    """Builds ``train_step(state, batch, frozen=None) -> (state, metrics)``, jitted with ``state`` donated.

    Args:
      logp_fn: ``logp_fn(params, batch: TrainBatch) -> PolicyOutput`` on a (micro-)batch.
      combine: ``combine(trained, frozen) -> params`` for ``logp_fn`` when only part of the model is trained
        (e.g. ``policy.Adapted``: LoRA adapters over a frozen base); ``train_step`` then takes the frozen part as
        its third argument. Gradients, optimizer state and the update guard cover ``state.params`` alone; the
        frozen tree is read as a constant (no gradient of it is formed, and it is not donated). None: the
        trained tree is the model's params and ``frozen`` must be None.
      loss_fn: ``loss_fn(logp, old_logp, advantages, mask, **kw) -> (loss, metrics)`` with hparams bound (e.g.
        ``functools.partial(losses.gspo_loss, eps_high=4e-4)``). Called with ``entropy=`` when ``logp_fn``
        returns one and ``ref_logp=`` when the batch has ``ref_logp``; ``PolicyOutput.routing``, when set,
        reaches the ``rollout_metrics``. If its metrics contain
        ``"normalizer"`` (all losses of ``reno_jax.rl.losses`` do), micro-batch gradients are combined with
        those weights, which reproduces the full-minibatch gradient exactly for every aggregation (sequence
        mean, token mean, constant); otherwise micro-batches are weighted equally.
      optimizer: an optax transformation (``make_optimizer``).
      num_minibatches: M; the batch is split into M contiguous minibatches (after an optional shuffle), each
        making one optimizer update in sequence (PPO-style; later ones see updated params, and the loss's
        importance ratio against ``old_logp`` accounts for it).
      num_microbatches: K; each minibatch is split into K micro-batches whose gradients are accumulated
        (``lax.scan``) before the update: peak activation memory of a K-times-smaller batch.
      shuffle: permute the batch rows before splitting, with a key split from ``state.rng`` (which advances).
      donate: donate ``state`` to the jitted function (its buffers are reused; do not touch the old state).
      loss_batch_keys: `TrainBatch` fields passed on to ``loss_fn`` as keyword arguments of the same name (per-row
        arrays, split like the rest of the batch), e.g. ``entropy_scale``.
      rollout_metrics: also report how far the train forward is from the rollout that sampled the batch, with
        ``old_logp`` taken as the behaviour log-probs: ``rollout_logp_abs_diff_mean`` / ``_max`` (|logp -
        old_logp| over policy tokens), ``rollout_k3_kl`` (k3 estimate of KL(behaviour || train)),
        ``rollout_ratio_max`` (max token ratio) and, when ``logp_fn`` returns ``RoutingStats``,
        ``routing_agreement``. From the FIRST minibatch only (`_reduce_minibatch_metrics`); no extra forward.
      max_logp_shift: > 0: a backtracking guard on each update (`_guarded_params` says why and how): an update
        moving the probe's policy tokens by more than this (mean |new logp - ``old_logp``|) is halved, up to
        ``shift_backtracks`` times, then not applied. Metrics ``logp_shift`` and ``update_scale``.
      shift_probe_rows: the probe: the minibatch's first rows, rescored after each update (`_guarded_params`).
      metric_reductions: how each of ``loss_fn``'s metrics combines over micro-batches and minibatches
        ("mean", "min", "max", "sum", "count"; see ``losses.METRIC_REDUCTIONS``, the default, which declares the
        metrics of ``reno_jax.rl.losses``); a metric not listed is a (normalizer-weighted) mean.

    ``batch``: a `TrainBatch` (every field with leading dimension B, divisible by M*K).

    A minibatch whose loss or gradient (global norm) is not finite leaves params and optimizer state untouched
    and increments ``state.skipped_updates``. ``state.step`` increments by one per call.

    Metrics (float32 scalars): the loss's metrics, each reduced as ``metric_reductions`` declares, ``loss``,
    ``grad_norm`` (global norm before clipping, mean over minibatches), ``grad_norm_max``, ``skipped`` (updates
    skipped in this call) and ``skipped_updates`` (running total).
    """
    num_minibatches, num_microbatches = int(num_minibatches), int(num_microbatches)
    reductions = dict(losses.METRIC_REDUCTIONS if metric_reductions is None else metric_reductions)
    _check_step_options(
        reductions, num_minibatches, num_microbatches, max_logp_shift, shift_probe_rows, shift_backtracks
    )
    spec = _StepSpec(
        logp_fn=logp_fn,
        loss_fn=loss_fn,
        optimizer=optimizer,
        num_minibatches=num_minibatches,
        num_microbatches=num_microbatches,
        shuffle=bool(shuffle),
        loss_batch_keys=tuple(loss_batch_keys),
        rollout_metrics=bool(rollout_metrics),
        max_logp_shift=float(max_logp_shift),
        shift_probe_rows=int(shift_probe_rows),
        shift_backtracks=int(shift_backtracks),
        reductions=reductions,
        combine=combine,
    )
    return jax.jit(functools.partial(_train_step, spec), donate_argnums=(0,) if donate else ())


def _check_step_options(
    reductions: Mapping[str, str],
    num_minibatches: int,
    num_microbatches: int,
    max_logp_shift,
    shift_probe_rows,
    shift_backtracks,
) -> None:
    """Raises ValueError on options of `make_train_step` that no train step can honour."""
    bad = {k: v for k, v in reductions.items() if v not in METRIC_REDUCTION_KINDS}
    if bad:
        raise ValueError(f"metric_reductions must be among {METRIC_REDUCTION_KINDS}, got {bad}")
    if num_minibatches < 1 or num_microbatches < 1:
        raise ValueError("num_minibatches and num_microbatches must be >= 1")
    max_logp_shift = float(max_logp_shift)
    if not max_logp_shift >= 0.0:
        raise ValueError(f"max_logp_shift must be >= 0 (0: off), got {max_logp_shift}")
    if max_logp_shift and (int(shift_probe_rows) < 1 or int(shift_backtracks) < 0):
        raise ValueError(
            f"max_logp_shift needs shift_probe_rows >= 1 and shift_backtracks >= 0, got "
            f"{shift_probe_rows}, {shift_backtracks}"
        )


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: it holds a dict
class _StepSpec:
    """The validated options of `make_train_step`, read by every phase of the train step (static)."""

    logp_fn: Callable
    loss_fn: Callable
    optimizer: optax.GradientTransformation
    num_minibatches: int
    num_microbatches: int
    shuffle: bool
    loss_batch_keys: tuple[str, ...]
    rollout_metrics: bool
    max_logp_shift: float  # 0: no guard
    shift_probe_rows: int
    shift_backtracks: int
    reductions: Mapping[str, str]
    combine: Callable | None

    def reduction(self, name: str) -> str:
        return self.reductions.get(name, "mean")


def _policy_output(spec: _StepSpec, params, frozen, batch: TrainBatch) -> PolicyOutput:
    return spec.logp_fn(params if spec.combine is None else spec.combine(params, frozen), batch)


# ---- loss and gradient of one minibatch


def _loss_and_metrics(params, spec: _StepSpec, frozen, mb: TrainBatch):
    """``(loss, (loss metrics, mismatch sums))`` of one micro-batch; differentiated in ``params``."""
    out = _policy_output(spec, params, frozen, mb)
    if not isinstance(out, PolicyOutput):
        raise TypeError(f"logp_fn must return a trainer.PolicyOutput, got {type(out).__name__}")
    kw = {}
    if out.entropy is not None:
        kw["entropy"] = out.entropy
    if mb.ref_logp is not None:
        kw["ref_logp"] = mb.ref_logp
    for k in spec.loss_batch_keys:
        kw[k] = getattr(mb, k)
    loss, metrics = spec.loss_fn(out.logp, mb.old_logp, mb.advantages, mb.loss_mask, **kw)
    extra = {}
    if spec.rollout_metrics:
        extra = dict(mismatch_sums(jax.lax.stop_gradient(out.logp), mb.old_logp, mb.loss_mask))
        if out.routing is not None:
            extra["routing"] = out.routing
    return loss, (dict(metrics), extra)


def _accumulate_grads(spec: _StepSpec, params, frozen, micro: TrainBatch):
    """``(loss, grads, loss metrics, mismatch sums)`` of a minibatch: the normalizer-weighted accumulation over
    the leading (micro-batch) axis of ``micro`` (``[K, rows, ...]``)."""
    grad_fn = jax.value_and_grad(_loss_and_metrics, has_aux=True)

    def body(acc, mb):
        mb = jax.tree.map(lambda x: hints.constrain_rows(x) if jnp.ndim(x) else x, mb)
        (loss, (metrics, extra)), grads = grad_fn(params, spec, frozen, mb)
        w = jax.lax.stop_gradient(metrics.get("normalizer", jnp.float32(1.0))).astype(jnp.float32)
        g_acc, l_acc, w_acc = acc
        g_acc = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), g_acc, grads)
        g_acc = hints.like_params(g_acc)  # on a mesh: split like the parameters (else unchanged)
        return (g_acc, l_acc + w * loss, w_acc + w), (metrics, w, extra)

    zeros = hints.like_params(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    (g_sum, l_sum, w_sum), (mets, ws, extras) = jax.lax.scan(body, (zeros, jnp.float32(0.0), jnp.float32(0.0)), micro)
    # Mismatch sums over the micro-batches (plain sums / maxima: token-level, not loss-weighted).
    extra = {
        k: (jnp.max(v) if k in MISMATCH_MAXIMA else jnp.sum(v)) if k != "routing" else jax.tree.map(jnp.sum, v)
        for k, v in extras.items()
    }
    denom = jnp.maximum(w_sum, 1e-30)  # w_sum == 0 only when every loss sum is 0 too
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)
    return l_sum / denom, grads, _reduce_microbatch_metrics(spec, mets, ws, w_sum, denom), extra


def _reduce_microbatch_metrics(spec: _StepSpec, mets: dict, ws: Array, w_sum: Array, denom: Array) -> dict:
    """One value per loss metric from its ``[K]`` micro-batch values, weighted by the normalizers ``ws [K]``
    (micro-batches of zero weight only count when every one has zero weight)."""
    has_w = ws > 0
    out = {}
    for k, v in mets.items():
        kind = spec.reduction(k)
        if kind in ("sum", "count"):
            out[k] = jnp.sum(v)
        elif kind == "min":
            out[k] = jnp.where(jnp.any(has_w), jnp.min(jnp.where(has_w, v, jnp.inf)), jnp.min(v))
        elif kind == "max":
            out[k] = jnp.where(jnp.any(has_w), jnp.max(jnp.where(has_w, v, -jnp.inf)), jnp.max(v))
        else:
            out[k] = jnp.where(w_sum > 0, jnp.sum(v * ws) / denom, jnp.mean(v))
    return out


# ---- the logp-shift guard


def _logp_shift(spec: _StepSpec, params, frozen, probe: TrainBatch) -> Array:
    """Mean |logp - old_logp| over the probe's policy tokens (float32 [])."""
    logp = jax.lax.stop_gradient(_policy_output(spec, params, frozen, probe).logp)
    mask = probe.loss_mask.astype(jnp.float32)
    return jnp.sum(jnp.abs(logp - probe.old_logp) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _guarded_params(spec: _StepSpec, params, frozen, updates, micro: TrainBatch):
    """(new params, applied scale, shift of the whole update): the update halved until the shift of the probe
    (the first ``shift_probe_rows`` rows of the minibatch's first micro-batch) is within bounds.

    Why: a normal-sized Adam step can flip a token the policy was sure of (a format token at p = 0.9999 ->
    0.0001 in one step, measured) and no gradient opposes it before the damage is sampled. After the update the
    probe rows are scored with the new params; while the mean over their policy tokens of |new logp -
    ``old_logp``| exceeds ``spec.max_logp_shift``, the update is halved (up to ``spec.shift_backtracks`` times,
    then not applied; the optimizer moments keep the gradient either way). Costs one probe forward per update
    (plus one per halving). The shift returned (metric ``logp_shift``) is that of the whole, unhalved update;
    the scale (``update_scale``) is the one applied.

    ``shift_probe_rows``: a whole number of groups for a shared-prefix batch (its first rows are then whole
    groups); at most a micro-batch's rows (a ValueError at trace time otherwise).
    """
    rows = spec.shift_probe_rows
    if rows > micro.tokens.shape[1]:
        raise ValueError(f"shift_probe_rows={rows} exceeds the micro-batch ({micro.tokens.shape[1]} rows)")
    probe = jax.tree.map(lambda x: x[0, :rows] if jnp.ndim(x) > 1 else x, micro)
    probe = jax.tree.map(lambda x: hints.constrain_rows(x) if jnp.ndim(x) else x, probe)
    apply = lambda scale: optax.apply_updates(params, jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates))

    def cond(c):
        scale, shift, tries = c
        return (shift > spec.max_logp_shift) & (tries < spec.shift_backtracks)

    def body(c):
        scale, _, tries = c
        scale = scale * 0.5
        return scale, _logp_shift(spec, apply(scale), frozen, probe), tries + 1

    first = _logp_shift(spec, apply(jnp.float32(1.0)), frozen, probe)
    scale, shift, _ = jax.lax.while_loop(cond, body, (jnp.float32(1.0), first, jnp.int32(0)))
    scale = jnp.where(shift > spec.max_logp_shift, jnp.float32(0.0), scale)
    return apply(scale), scale, first


# ---- the train step: checks, minibatch split, the update loop, metric reduction


def _check_batch(spec: _StepSpec, batch: TrainBatch, frozen) -> int:
    """Raises on a batch (or frozen tree) the step cannot take; returns the batch size B."""
    if (frozen is None) != (spec.combine is None):
        raise ValueError("train_step takes a frozen tree exactly when make_train_step was given combine=")
    if not isinstance(batch, TrainBatch):
        raise TypeError(f"train_step takes a rl.batch.TrainBatch, got {type(batch).__name__}")
    missing = [k for k in spec.loss_batch_keys if getattr(batch, k) is None]
    if missing:
        raise ValueError(f"train_step: the loss reads {missing}, which the batch does not set")
    sizes = {k: jnp.shape(v)[0] if jnp.ndim(v) else None for k, v in batch.present().items()}
    B = sizes["tokens"]
    bad = {k: s for k, s in sizes.items() if s != B}
    if bad:
        raise ValueError(f"train_step: every batch field needs leading dimension B={B}; got {bad}")
    M, K = spec.num_minibatches, spec.num_microbatches
    if B % (M * K):
        raise ValueError(f"train_step: batch size {B} is not divisible by num_minibatches*num_microbatches = {M}*{K}")
    return B


def _split_minibatches(spec: _StepSpec, batch: TrainBatch, B: int, rng: Array) -> tuple[TrainBatch, Array]:
    """``(batch as [M, K, B / (M K), ...], advanced rng)``, the rows shuffled first when ``spec.shuffle``."""
    if spec.shuffle:
        rng, key = jax.random.split(rng)
        perm = jax.random.permutation(key, B)
        batch = jax.tree.map(lambda x: x[perm], batch)
    M, K = spec.num_minibatches, spec.num_microbatches
    mbs = jax.tree.map(lambda x: x.reshape((M, K, B // (M * K)) + x.shape[1:]), batch)
    # On a mesh: every micro-batch's rows split over the batch axes (the placed batch splits the leading
    # dimension, which the reshape would turn into a split of the scanned micro-batch axis: each device would
    # then run whole micro-batches, all of them, on all-gathered rows). A no-op without a mesh.
    mbs = jax.tree.map(lambda x: hints.constrain_rows(x, axis=2) if jnp.ndim(x) > 2 else x, mbs)
    return mbs, rng


def _minibatch_update(spec: _StepSpec, frozen, carry, micro: TrainBatch):
    """One optimizer update on one minibatch (``micro``: ``[K, rows, ...]``); a ``lax.scan`` body over the
    minibatches with carry ``(params, opt_state, skipped)``."""
    params, opt_state, skipped = carry
    loss, grads, metrics, extra = _accumulate_grads(spec, params, frozen, micro)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = spec.optimizer.update(grads, opt_state, params)
    guard = {}
    if spec.max_logp_shift:
        new_params, scale, shift = _guarded_params(spec, params, frozen, updates, micro)
        guard = {"update_scale": scale, "logp_shift": shift}
    else:
        new_params = optax.apply_updates(params, updates)
    # Select, not branch: a skipped update returns the old buffers bit-for-bit.
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    carry = (keep(new_params, params), keep(new_opt_state, opt_state), skipped + (~ok).astype(jnp.int32))
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, **guard)
    return carry, (metrics, extra)


def _reduce_minibatch_metrics(spec: _StepSpec, mets: dict, extras: dict) -> dict:
    """The step's metrics from the ``[M]`` per-minibatch metrics and mismatch sums."""
    metrics = {}
    for k, v in mets.items():
        reduce = {"min": jnp.min, "max": jnp.max, "count": jnp.sum}.get(spec.reduction(k), jnp.mean)
        metrics[k] = reduce(v)
    metrics["grad_norm_max"] = jnp.max(mets["grad_norm"])
    # Rollout metrics of minibatch 0 alone: its micro-batches all run before any update, so it is scored with
    # the params that generated the rollout (later minibatches mix in the policy's own change). They reuse the
    # logp the loss saw: no extra forward.
    if spec.rollout_metrics:
        first = jax.tree.map(lambda v: v[0], extras)
        metrics.update(mismatch_metrics(first, first.pop("routing", None)))
    return metrics


def _train_step(spec: _StepSpec, state: TrainState, batch: TrainBatch, frozen: PyTree = None):
    B = _check_batch(spec, batch, frozen)
    mbs, rng = _split_minibatches(spec, batch, B, state.rng)
    (params, opt_state, skipped), (mets, extras) = jax.lax.scan(
        functools.partial(_minibatch_update, spec, frozen),
        (state.params, state.opt_state, jnp.zeros([], jnp.int32)),
        mbs,
    )
    metrics = _reduce_minibatch_metrics(spec, mets, extras)
    new_state = state.replace(
        params=params,
        opt_state=opt_state,
        step=state.step + 1,
        skipped_updates=state.skipped_updates + skipped,
        rng=rng,
    )
    metrics["skipped"] = skipped
    metrics["skipped_updates"] = new_state.skipped_updates
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return new_state, metrics
