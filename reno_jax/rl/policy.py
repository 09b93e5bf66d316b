"""The policy as the trainer sees it: `logp_fn(params, batch: TrainBatch) -> trainer.PolicyOutput`, and, for a
run that trains LoRA adapters over a frozen base, how the two make the model's params (`Adapted`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from reno_jax.models import layers, ling3, lora
from reno_jax.models.config import Ling3Config
from reno_jax.rl import shared_prefix, trainer
from reno_jax.rl.batch import TrainBatch


@dataclasses.dataclass(frozen=True)
class Adapted:
    """`combine(adapters, base) -> params` of `trainer.make_train_step` / `learner.Learner` for LoRA: the base's
    targeted weights become `lora.LoraKernel` leaves that the model's matmuls apply in the layer, so the train
    step, the rollout and evaluation all run the same adapted weights (no merged copy). Hashable: a static part
    of the compiled programs."""

    config: lora.LoraConfig

    def __call__(self, adapters, base):
        return lora.apply(base, adapters, self.config)


def routing_stats(own: jax.Array, recorded: jax.Array) -> trainer.RoutingStats:
    """Agreement of a train forward's own top-k with the rollout's recorded routing.

    own: `int [B, T, n_moe, K]` (`ling3.Routing.own`, -1 on invalid tokens); recorded: the rollout's ids, same
    shape (-1: nothing recorded). Counts the (token, MoE layer) pairs where both exist and whether the two
    top-k SETS are equal (order within the top-k does not matter for the MoE output).
    """
    recorded = recorded.astype(jnp.int32)
    present = (own[..., 0] >= 0) & (recorded[..., 0] >= 0)
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(recorded, axis=-1), axis=-1)
    return trainer.RoutingStats(
        agree=jnp.sum(same & present).astype(jnp.float32), total=jnp.sum(present).astype(jnp.float32)
    )


def position_terms(
    logits: jax.Array,
    targets: jax.Array,
    *,
    with_entropy: bool,
    entropy_top_k: int = 0,
    temperature: float = 1.0,
    soft_ids: jax.Array | None = None,
    soft_weights: jax.Array | None = None,
):
    """Per-position log-prob of `targets` and entropy under `logits`, each position on its own.

    logits: float32 [B, T, V]; targets: int [B, T]; soft_ids int [B, K] and soft_weights float32 [B, T, K]: the
    soft targets of `make_logp_fn`. Returns (logp [B, T] float32, entropy [B, T] float32 or None)."""
    if temperature != 1.0:
        logits = logits / jnp.float32(temperature)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logp = picked - logz
    if soft_weights is not None:
        soft_logits = jnp.take_along_axis(logits, jnp.broadcast_to(soft_ids[:, None, :], soft_weights.shape), axis=-1)
        total = jnp.sum(soft_weights, axis=-1)
        soft = jnp.sum(soft_weights * soft_logits, axis=-1) - total * logz
        logp = jnp.where(total > 0, soft, logp)
    entropy = None
    if with_entropy:
        ent_logits = jax.lax.top_k(logits, entropy_top_k)[0] if entropy_top_k else logits
        ent_logz = jax.nn.logsumexp(ent_logits, axis=-1) if entropy_top_k else logz
        probs = jax.nn.softmax(ent_logits, axis=-1)
        entropy = ent_logz - jnp.sum(probs * ent_logits, axis=-1)
    return logp, entropy


def chunked_position_terms(hidden: jax.Array, head, targets: jax.Array, chunk: int, **kw):
    """`position_terms(head_logits(hidden, head), targets, **kw)` a chunk of `chunk` positions at a time.

    hidden: [B, T, D] final-normed hidden states (`ling3.forward(apply_head=False)`); head: `ling3.lm_head`.
    Each chunk's [B, chunk, V] float32 logits are made, reduced to per-position figures and dropped; the
    backward pass recomputes them chunk by chunk (`jax.checkpoint`), so no [B, T, V] array exists in either
    direction (at Ling-3.0's vocabulary of 157,184, one row of 1,471 positions is 0.9 GB of float32 logits and
    its softmax and gradient as much again). Same values as the unchunked path (each position is independent).
    """
    b, t, _ = hidden.shape
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), 1, 0)

    soft_weights = kw.pop("soft_weights", None)
    soft_ids = kw.pop("soft_ids", None)

    @jax.checkpoint
    def one(xs):
        h, tgt, w = xs
        return position_terms(layers.head_logits(h, head), tgt, soft_ids=soft_ids, soft_weights=w, **kw)

    logp, entropy = jax.lax.map(
        one, (split(hidden), split(targets), None if soft_weights is None else split(soft_weights))
    )

    def join(x):  # [n, B, chunk] -> [B, T]
        return None if x is None else jnp.moveaxis(x, 0, 1).reshape(b, n * chunk)[:, :t]

    return join(logp), join(entropy)


def _shared_prefix_forward(
    params,
    model_config: Ling3Config,
    batch: TrainBatch,
    group_size: int | None,
    remat: bool,
    replay: bool,
    apply_head: bool,
):
    """The forward of a shared-prefix batch (see `reno_jax.rl.shared_prefix`), each group's prompt encoded once.

    Returns `(logits, routing, full_recorded, targets, pad)`: `logits [B, T, V]` (the final hidden states
    `[B, T, D]` when not `apply_head`) already aligned with `targets = tokens [B, T]` (the continuations), so
    `pad` = 0; `routing` (the forward's own, when the batch records the rollout's) and `full_recorded`, the
    rollout's routing over common tokens, prefix and continuation, are None when the batch records none.
    """
    if group_size is None and batch.prefix_tokens.shape[1]:  # the common part alone needs no groups
        raise ValueError("a shared-prefix batch needs make_logp_fn(..., group_size=G)")
    recorded = batch.routing is not None
    parts = dict(prefix_replay=batch.prefix_routing, replay=batch.routing) if replay else {}
    if batch.common_tokens is not None:
        parts["common_tokens"] = batch.common_tokens
        if replay:
            parts["common_replay"] = batch.common_routing
    out = shared_prefix.shared_prefix_logits(
        params,
        model_config,
        batch.prefix_tokens,
        batch.tokens,
        batch.valid,
        group_size or 1,
        remat=remat,
        return_routing=recorded,
        apply_head=apply_head,
        **parts,
    )
    logits, routing = out if recorded else (out, None)
    full_recorded = None
    if recorded:
        full_recorded = jnp.concatenate(
            ([batch.common_routing] if batch.common_tokens is not None else []) + [batch.prefix_routing, batch.routing],
            axis=1,
        )
    return logits, routing, full_recorded, batch.tokens, 0


def _full_sequence_forward(
    params, model_config: Ling3Config, batch: TrainBatch, remat: bool, replay: bool, apply_head: bool
):
    """The forward of an ordinary batch: `tokens [B, L]` scored as one sequence per row.

    Returns `(logits, routing, full_recorded, targets, pad)` as `_shared_prefix_forward` does, with `logits
    [B, L-1, V]` predicting `targets = tokens[:, 1:]`, hence `pad` = 1 (the first token has no log-prob).
    """
    recorded = batch.routing is not None
    out = ling3.forward(
        params,
        model_config,
        batch.tokens,
        valid=batch.valid,
        remat=remat,
        return_routing=recorded,
        replay_experts=batch.routing if replay else None,
        apply_head=apply_head,
    )
    logits = out[0][:, :-1]
    routing, full_recorded = (out[-1], batch.routing) if recorded else (None, None)
    return logits, routing, full_recorded, batch.tokens[:, 1:], 1


def make_logp_fn(
    model_config: Ling3Config,
    with_entropy: bool = True,
    group_size: int | None = None,
    remat: bool = False,
    entropy_top_k: int = 0,
    routing_replay: bool = False,
    temperature: float = 1.0,
    logits_chunk: int = 0,
):
    """`logp_fn(params, batch: TrainBatch) -> trainer.PolicyOutput` for `trainer.make_train_step`.

    `temperature`: score the tempered policy `softmax(logits / temperature)`, the distribution a rollout with that
    temperature samples from (so the policy-gradient ratio compares like with like); 1 leaves the logits untouched.

    `logp[:, t]` is `log p(tokens[t] | tokens[:t])` in float32; the entropy is that of the full next-token
    distribution at the same positions (a metric, and the entropy bonus when configured). With `group_size`, a
    batch carrying `prefix_tokens` (see `reno_jax.rl.shared_prefix`) is scored with each group's prompt encoded
    once; `tokens` are then the continuations and `logp[:, t]` conditions on the prefix too. `remat`: recompute
    each decoder layer in the backward pass instead of storing its activations (`ling3.forward(remat=True)`).
    `entropy_top_k` > 0: the entropy is that of the distribution renormalised over the k most likely tokens
    (an entropy bonus then evens out the plausible choices without pushing mass onto the vocabulary's tail).

    Soft targets (supervised warm start): a batch may set ``soft_target_ids int32 [B, K]`` and
    ``soft_target_weights float32 [B, L, K]``; where a position's weights sum to more than 0, ``logp[:, t]`` is
    ``sum_k w[t, k] * log p(ids[k] | tokens[:t])`` (the expected log-likelihood under that target) instead of the
    log-prob of ``tokens[t]``.

    Routing replay: a batch setting the rollout's ``routing int [B, L, n_moe, K]`` (``Trajectory.routing``; with a
    shared prefix also ``prefix_routing``) makes ``logp_fn`` fill ``PolicyOutput.routing``, a ``trainer.RoutingStats``
    (how many (token, MoE layer) pairs the train forward's own top-k agrees with the rollout on); with
    ``routing_replay=True`` the forward also uses those ids instead of its own top-k (``ling3.forward``'s
    ``replay_experts``; -1 entries route normally).

    ``logits_chunk`` > 0: the logits are made and reduced that many positions at a time
    (`chunked_position_terms`): the train step never holds a [B, T, V] array. Same values; for long responses
    over a large vocabulary, where the logits, their softmax and their gradient dominate the step's memory.
    """
    if logits_chunk < 0:
        raise ValueError(f"logits_chunk must be >= 0, got {logits_chunk}")

    def logp_fn(params, batch: TrainBatch) -> trainer.PolicyOutput:
        recorded = batch.routing is not None
        replay = recorded and routing_replay
        if batch.shared_prefix:
            forward = _shared_prefix_forward(
                params, model_config, batch, group_size, remat, replay, apply_head=not logits_chunk
            )
        else:
            forward = _full_sequence_forward(params, model_config, batch, remat, replay, apply_head=not logits_chunk)
        logits, routing, full_recorded, targets, pad = forward
        kw = dict(with_entropy=with_entropy, entropy_top_k=entropy_top_k, temperature=temperature)
        if batch.soft_target_weights is not None:
            kw.update(
                soft_ids=batch.soft_target_ids,  # [B, K]; weights [B, T, K], aligned with the logits
                soft_weights=batch.soft_target_weights[:, pad:].astype(jnp.float32),
            )
        if logits_chunk:  # `logits` holds the final hidden states [B, T, D] here
            logp, entropy = chunked_position_terms(
                logits, ling3.lm_head(params, model_config), targets, logits_chunk, **kw
            )
        else:
            logp, entropy = position_terms(logits.astype(jnp.float32), targets, **kw)
        logp = jnp.pad(logp, ((0, 0), (pad, 0)))
        if entropy is not None:
            entropy = jnp.pad(entropy, ((0, 0), (pad, 0)))
        stats = routing_stats(jax.lax.stop_gradient(routing.own), full_recorded) if recorded else None
        return trainer.PolicyOutput(logp, entropy, stats)

    return logp_fn
