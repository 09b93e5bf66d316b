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

The common part alone (`common_len == prefix_len`: an empty group part, `prefix_tokens [B, 0]`): rows that share
nothing but the common part, such as the turn samples of a bounded-history rollout (`rollout.history`), each the
system prompt and then its own window and observation. The common part runs once and its cache is repeated over
every row; the group size plays no part. Rows that are padding (no real token: a turn an episode did not reach) take
part as any row does (their loss mask is empty); `common_tokens` is the first real row's, repeated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reno_jax.models import ling3
from reno_jax.rl.batch import TOKEN_FIELDS, TrainBatch


def split_shared_prefix(batch: TrainBatch, prefix_len: int, common_len: int = 0) -> TrainBatch:
    """Row-wise batch -> shared-prefix batch (see module docstring); `prefix_len` and `common_len` are static.

    `common_len` > 0 (at most `prefix_len`): the first `common_len` tokens, the same in every real row, go to
    `common_tokens` (the first real row's, on every row) and the group part `prefix_tokens` starts after them;
    `common_len == prefix_len` leaves the group part empty (the common part alone, module docstring).
    """
    s, c0 = int(prefix_len), int(common_len)
    length = batch.tokens.shape[1]
    if not 0 < s < length:
        raise ValueError(f"prefix_len must be in 1..{length - 1}, got {s}")
    if not 0 <= c0 <= s:
        raise ValueError(f"common_len must be in 0..prefix_len = {s}, got {c0}")
    real = 0 if batch.valid is None else jnp.argmax(batch.valid[:, 0])  # padding rows hold pad ids there

    def common(x):  # [B, C0, ...]: the first real row's common part on every row
        return jnp.broadcast_to(x[real, :c0], (x.shape[0],) + x[real, :c0].shape) if c0 else None

    cut = {"prefix_tokens": batch.tokens[:, c0:s], "common_tokens": common(batch.tokens)}
    if batch.routing is not None:
        cut["prefix_routing"] = batch.routing[:, c0:s]
        cut["common_routing"] = common(batch.routing)
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
      prefix_tokens: `int [B, S]`; rows of a group are identical (only every G-th row is read). S may be 0 with
        `common_tokens` (the common part alone: every row continues from it).
      tokens: `int [B, C]` continuations; `valid [B, C]` a left-aligned prefix of real tokens per row.
      group_size: G (static); B must be a multiple of G (unused when S is 0).
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
    s = prefix_tokens.shape[1]
    s0 = 0 if common_tokens is None else common_tokens.shape[1]
    if s and b % g:
        raise ValueError(f"batch of {b} rows is not a whole number of groups of {g}")
    if not s and not s0:
        raise ValueError("a shared-prefix batch with an empty group part needs common_tokens")
    dtype = params["model"]["word_embeddings"]["embedding"].dtype
    kw = dict(remat=remat, return_routing=return_routing, apply_head=apply_head)
    # Each stage: (its outputs of one row per copy, rows each copy stands for); the last logits of a stage score
    # the first token after it. Stages: the common part (one copy), the group part (one per group), the rows.
    stages = []
    if s0:
        replay0 = None if common_replay is None else common_replay[:1]
        cache = ling3.init_cache(config, 1, s0 + s + c, dtype)
        stages.append((ling3.forward(params, config, common_tokens[:1], cache, replay_experts=replay0, **kw), b))
    if s:
        prefix = prefix_tokens[::g]  # [N, S]
        cache = (
            jax.tree.map(lambda x: jnp.repeat(x, b // g, axis=0), stages[-1][0][1])
            if s0
            else ling3.init_cache(config, b // g, s + c, dtype=dtype)
        )
        replay1 = None if prefix_replay is None else prefix_replay[::g]
        stages.append((ling3.forward(params, config, prefix, cache, replay_experts=replay1, **kw), g))
    last_out, copies = stages[-1]
    cache = jax.tree.map(lambda x: jnp.repeat(x, copies, axis=0), last_out[1])
    cont_out = ling3.forward(params, config, tokens, cache, valid=valid, replay_experts=replay, **kw)
    first = jnp.repeat(last_out[0][:, -1:], copies, axis=0)  # [B, 1, V] scores tokens[:, 0]
    logits = jnp.concatenate([first, cont_out[0][:, :-1]], axis=1)
    logits = logits.astype(jnp.float32) if apply_head else logits
    if not return_routing:
        return logits
    routing = cont_out[-1]
    for out, _ in reversed(stages):  # prepend each stage's routing, repeated over the rows it stands for
        routing = jax.tree.map(
            lambda p, q: jnp.concatenate([jnp.repeat(p, b // p.shape[0], axis=0), q], axis=1), out[-1], routing
        )
    return logits, routing
