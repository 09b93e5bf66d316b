"""Shared-prefix training: the G samples of a group are scored with their common prompt encoded once.

A GSPO/GRPO batch holds G responses per prompt. Scoring each row from scratch runs the prompt through the model
G times (forward and backward); here the prompt prefix runs once per group, its cache (KDA recurrent state and
short-conv tails, MLA latents) is repeated G times, and only the continuations run per row. Gradients flow back
through the repeated cache into the single prefix pass, so log-probs and gradients equal those of the row-wise
computation (tested to float32 rounding). For the tic-tac-toe move task (60-token prompt, <= 16-token
response, G = 16) this scores a group with ~330 instead of ~1220 token positions.

Layout: `split_shared_prefix(batch, prefix_len)` cuts a row-wise batch (`tokens [B, L]`, ...) at column S =
`prefix_len`: `prefix_tokens [B, S]` and every other `[B, L]` entry becomes its continuation `[B, L - S]`.
Rows `g*G .. g*G + G-1` must be one group and agree on their first S tokens, all of them real (S <= every
row's prompt length). `B` stays the leading dimension of every entry, so the trainer's minibatch / micro-batch
split applies unchanged as long as each piece holds whole groups. A recorded rollout routing (`routing [B, L,
n_moe, K]`, routing replay) is cut the same way: `prefix_routing [B, S, n_moe, K]` and `routing [B, L - S, ...]`.

A second level: the part every row of the batch shares (a system prompt and tool schema, the same for every
episode of an environment) can be encoded once for the whole batch. `split_shared_prefix(batch, prefix_len,
common_len=C)` then also cuts `common_tokens [B, C]` (only row 0 is read) and `prefix_tokens` becomes the
group part `[B, S - C]`; routing likewise (`common_routing`). The common part runs once, its cache is repeated
over the groups, each group's part runs once and its cache is repeated over the group's rows. For the move task
(a 60-token prompt of which 38 are the same for every board) this encodes 22 prompt tokens per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reno_jax.models import ling3
from reno_jax.rl.batch import TOKEN_FIELDS, TrainBatch


def split_shared_prefix(batch: TrainBatch, prefix_len: int, common_len: int = 0) -> TrainBatch:
    """Row-wise batch -> shared-prefix batch (see module docstring); `prefix_len` and `common_len` are static.

    `common_len` > 0 (it must be < `prefix_len`): the first `common_len` tokens, the same in every row, go to
    `common_tokens` and the group part `prefix_tokens` starts after them.
    """
    s, c0 = int(prefix_len), int(common_len)
    length = batch.tokens.shape[1]
    if not 0 < s < length:
        raise ValueError(f"prefix_len must be in 1..{length - 1}, got {s}")
    if not 0 <= c0 < s:
        raise ValueError(f"common_len must be in 0..prefix_len - 1 = {s - 1}, got {c0}")
    if batch.soft_target_weights is not None:
        raise ValueError("soft targets are not supported with a shared-prefix batch")
    cut = {"prefix_tokens": batch.tokens[:, c0:s], "common_tokens": batch.tokens[:, :c0] if c0 else None}
    if batch.routing is not None:
        cut["prefix_routing"] = batch.routing[:, c0:s]
        cut["common_routing"] = batch.routing[:, :c0] if c0 else None
    for name in TOKEN_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            cut[name] = value[:, s:]
    if batch.advantages.ndim == 2:  # per-token advantages: the policy tokens all lie after the prompt
        cut["advantages"] = batch.advantages[:, s:]
    return batch.replace(**cut)


def shared_prefix_logits(
    params,
    config: ling3.Ling3Config,
    prefix_tokens: jax.Array,
    tokens: jax.Array,
    valid: jax.Array | None,
    group_size: int,
    remat: bool = False,
    prefix_replay: jax.Array | None = None,
    replay: jax.Array | None = None,
    return_routing: bool = False,
    common_tokens: jax.Array | None = None,
    common_replay: jax.Array | None = None,
    apply_head: bool = True,
):
    """Next-token logits for a shared-prefix batch.

    Args:
      prefix_tokens: `int [B, S]`; rows of a group are identical (only every G-th row is read).
      tokens: `int [B, C]` continuations; `valid [B, C]` a left-aligned prefix of real tokens per row.
      group_size: G (static); B must be a multiple of G.
      remat: recompute each decoder layer in the backward pass (`ling3.forward(remat=True)`).
      prefix_replay / replay: optional routing to replay (`ling3.forward(replay_experts=...)`), `int [B, S, n_moe,
        K]` (every G-th row is read, like the prefix) and `int [B, C, n_moe, K]`.
      return_routing: also return the `ling3.Routing` of the whole rows, `[B, S0 + S + C, n_moe, K]` (the
        prefix's routing repeated over its group, the common part's over the batch).
      common_tokens: optional `int [B, S0]`, the part every row shares, placed before `prefix_tokens` (only row 0
        is read; `split_shared_prefix(..., common_len=S0)`); `common_replay` its routing to replay.

      apply_head: False returns the final-normed hidden states `[B, C, D]` instead of the logits (see
        `ling3.forward(apply_head=False)`).

    Returns:
      `float32 [B, C, V]`: `logits[:, t]` scores `tokens[:, t]` given the prefix and `tokens[:, :t]`.
    """
    b, c = tokens.shape
    g = int(group_size)
    if b % g:
        raise ValueError(f"batch of {b} rows is not a whole number of groups of {g}")
    prefix = prefix_tokens[::g]  # [N, S]
    n, s = prefix.shape
    s0 = 0 if common_tokens is None else common_tokens.shape[1]
    dtype = params["model"]["word_embeddings"]["embedding"].dtype
    kw = dict(remat=remat, return_routing=return_routing, apply_head=apply_head)
    if s0:
        common_out = ling3.forward(
            params,
            config,
            common_tokens[:1],
            ling3.init_cache(config, 1, s0 + s + c, dtype),
            replay_experts=None if common_replay is None else common_replay[:1],
            **kw,
        )
        cache = jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), common_out[1])
    else:
        cache = ling3.init_cache(config, n, s + c, dtype=dtype)
    prefix_out = ling3.forward(
        params, config, prefix, cache, replay_experts=None if prefix_replay is None else prefix_replay[::g], **kw
    )
    prefix_logits, cache = prefix_out[:2]
    cache = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0), cache)
    cont_out = ling3.forward(params, config, tokens, cache, valid=valid, replay_experts=replay, **kw)
    first = jnp.repeat(prefix_logits[:, -1:], g, axis=0)  # [B, 1, V] scores tokens[:, 0]
    logits = jnp.concatenate([first, cont_out[0][:, :-1]], axis=1)
    logits = logits.astype(jnp.float32) if apply_head else logits
    if not return_routing:
        return logits
    routing = jax.tree.map(
        lambda p, q: jnp.concatenate([jnp.repeat(p, g, axis=0), q], axis=1), prefix_out[-1], cont_out[-1]
    )
    if s0:
        routing = jax.tree.map(
            lambda p, q: jnp.concatenate([jnp.repeat(p, b, axis=0), q], axis=1), common_out[-1], routing
        )
    return logits, routing
