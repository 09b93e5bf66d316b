"""The typed data between the rollout and the train step: `TrainBatch`, what `trainer.make_train_step` trains on.

B rows (one per episode kept for training), L tokens per row. Every field has the leading dimension B, so
minibatches, micro-batches, shuffles and group selection slice every field alike; optional fields are None when a
run does not use them (a None field is an empty pytree node: jit, `jax.tree.map` and donation skip it).

Shared-prefix batches (`rl.shared_prefix.split_shared_prefix`) cut every per-token field at column S: the
`prefix_*` fields hold columns ``[C, S)`` (each group's prompt, the same in the group's rows), the `common_*` fields
columns ``[0, C)`` (the part every row shares), and the per-token fields the continuation ``[S, L)``.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class TrainBatch:
    """Attributes:
    tokens: ``int32 [B, L]`` the conversations (prompt, policy turns, tool responses; pad after the end).
    loss_mask: ``bool [B, L]`` the policy-generated tokens, the ones the loss is over.
    old_logp: ``float32 [B, L]`` the log-probs the importance ratios are taken against (the rollout's
      behaviour log-probs; zeros for supervised batches).
    advantages: ``float32 [B]`` one per row (sequence-level; zeros for supervised batches), or ``[B, L]`` one
      per token (turn advantages, `learner.LearnerConfig.turn_advantage_coef`).
    valid: ``bool [B, L]`` real tokens (None: every token is real).
    routing: ``int16 [B, L, n_moe, K]`` the rollout's MoE experts per token (routing replay / agreement).
    entropy_scale: ``float32 [B]`` the forking regulariser's scheduled scale, a loss input.
    ref_logp: ``float32 [B, L]`` a reference policy's log-probs (the forking KL's anchor), a loss input.
    soft_target_ids: ``int32 [B, K]`` and soft_target_weights: ``float32 [B, L, K]``: supervised soft targets
      (`rl.sft.call_token_targets`, over the call table's `choice_tokens`): where a position's weights sum to
      > 0 its log-prob is the expected log-likelihood of those K tokens.
    prefix_tokens: ``int32 [B, S - C]``, prefix_routing, common_tokens: ``int32 [B, C]``, common_routing: the
      shared-prefix cut (module docstring).
    """

    tokens: jax.Array
    loss_mask: jax.Array
    old_logp: jax.Array
    advantages: jax.Array
    valid: jax.Array | None = None
    routing: jax.Array | None = None
    entropy_scale: jax.Array | None = None
    ref_logp: jax.Array | None = None
    soft_target_ids: jax.Array | None = None
    soft_target_weights: jax.Array | None = None
    prefix_tokens: jax.Array | None = None
    prefix_routing: jax.Array | None = None
    common_tokens: jax.Array | None = None
    common_routing: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def shared_prefix(self) -> bool:
        return self.prefix_tokens is not None

    def present(self) -> dict:
        """The fields that are set, by name (for checks and messages)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


# Per-token fields: the shared-prefix cut splits these along L.
TOKEN_FIELDS = ("tokens", "valid", "loss_mask", "old_logp", "ref_logp", "routing", "soft_target_weights")


def used_length(valid: jax.Array) -> jax.Array:
    """``int32 []``: one past the last column of ``valid [B, L]`` that is real in any row (0 when none is)."""
    columns = jnp.arange(1, valid.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(valid, columns[None, :], 0))


def bucketed_length(used: int, full: int, bucket: int) -> int:
    """``used`` rounded up to the next width of the ladder ``bucket`` x (1, 2, 3, 4, 6, 8, 12, 16, ...) (powers of
    two and their one-and-a-half), at most ``full`` (host ints): the width a batch is trimmed to. The train step
    compiles once per width, so the ladder keeps a run to about ``2 log2(full / bucket)`` compiled programs
    whatever its lengths, for at most half again the padding of the batch's own length."""
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    units = -(-int(used) // bucket)  # buckets the batch needs
    rung = 1
    while rung < units:  # 1, 2, 3, 4, 6, 8, ...: a power of two p >= 2 is followed by 3p/2, which by 2p
        is_power_of_two = rung & (rung - 1) == 0
        rung = rung * 3 // 2 if is_power_of_two and rung >= 2 else rung * 4 // 3 if rung > 2 else 2
    return max(1, min(full, rung * bucket if units else 0))


def trim_length(batch: TrainBatch, length: int) -> TrainBatch:
    """Keeps the first ``length`` columns of every per-token field (and of ``[B, L]`` advantages), a row-wise batch
    only. Exact when the columns cut are padding in every row: every layer is causal and the experts are routed
    per token, so the kept positions' log-probs do not depend on what follows them."""
    if batch.shared_prefix:
        raise ValueError("trim_length takes a row-wise batch: trim before the shared-prefix cut")
    full = batch.tokens.shape[1]
    if not 0 < length <= full:
        raise ValueError(f"length must be in 1..{full}, got {length}")
    if length == full:
        return batch
    cut = {name: getattr(batch, name)[:, :length] for name in TOKEN_FIELDS if getattr(batch, name) is not None}
    if batch.advantages.ndim == 2:
        cut["advantages"] = batch.advantages[:, :length]
    return batch.replace(**cut)
