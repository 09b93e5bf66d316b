"""Jit-friendly building blocks of batched generation with the Ling-3.0 hybrid cache.

Everything here is a pure function of arrays; loops are `lax.while_loop`s so one compiled program serves any
prompt length up to the buffer size. Conventions (see docs/design.md for the model's cache semantics):

* a row's conversation so far lives in the cache; `cache['length'][b]` is its number of tokens, which is also the
  position of the next token and the write offset into the `[B, L]` trajectory buffers;
* `last_logits [B, V] float32` are the logits produced by each row's last cached token, i.e. the distribution of
  its next token; prefill and decode both keep them up to date for the rows they advance;
* rows that must not advance are fed with `valid=False`, which by the model contract leaves their KDA state, conv
  history and MLA cache untouched.

Public pieces:
* `prefill_chunked`: feed a right-padded block of text `[B, P]` (row b has `n[b]` tokens) in chunks of C tokens;
* `decode_step`: one token for every row (sample from `last_logits`, feed it back);
* `generate`: prompt prefill + a fixed number of sampled tokens (used by benchmarks and as a plain sampler);
* `StopTables` / `build_stop_tables` / `stop_update`: per-token stop detection, re-exported from
  `reno_jax.protocol.stop` (stop tokens and a byte-level `</tool_call>` matcher that works whatever the
  tokenisation of the closing tag).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from reno_jax.models import ling3

# Re-exported: the stop matcher lives in the protocol layer, the rollout reaches it through this module.
from reno_jax.protocol.stop import StopTables, build_stop_tables, stop_update  # noqa: F401
from reno_jax.rollout import sampling

# ---------------------------------------------------------------------------------------------- prefill / decode


def row_keys(key: jax.Array, batch: int) -> jax.Array:
    """One PRNG key per row: a single key is split into `batch` keys, a `[batch]` batch of keys is kept."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.random.split(key, batch)
    if key.shape != (batch,):
        raise ValueError(f"key must be one PRNG key or {batch} keys, got shape {key.shape}")
    return key


def step_keys(keys: jax.Array, position: jax.Array) -> jax.Array:
    """Per-row key for the token at `position [B]`: depends only on the row's key and its own position."""
    return jax.vmap(jax.random.fold_in)(keys, position)


def write_routing(buf: jax.Array, start: jax.Array, routing: jax.Array, valid: jax.Array) -> jax.Array:
    """buf[b, start[b] + t] = routing[b, t] where valid[b, t] (others dropped).

    buf: `[B, L, n_moe, K]` (int16 in the rollout); start: `int32 [B]`; routing: `[B, T, n_moe, K]`; valid: `[B, T]`.
    """
    b, t = valid.shape
    idx = jnp.where(valid, start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :], buf.shape[1])
    return buf.at[jnp.arange(b)[:, None], idx].set(routing.astype(buf.dtype), mode="drop")


def prefill_chunked(
    params,
    model_config: ling3.Ling3Config,
    cache: dict,
    ids: jax.Array,
    n: jax.Array,
    last_logits: jax.Array,
    chunk: int,
    routing: jax.Array | None = None,
):
    """Feeds each row's `n[b]` tokens of `ids` into the cache, `chunk` tokens per model call.

    Args:
      params: model parameters.
      cache: the model cache (`cache['length'] [B]`).
      ids: `int32 [B, P]` right-padded text; P must be a multiple of `chunk`.
      n: `int32 [B]` tokens to feed per row (0 leaves the row's state and `last_logits` untouched).
      last_logits: `float32 [B, V]`; for rows with n > 0 replaced by the logits of their last fed token.
      chunk: static chunk size C.
      routing: optional `[B, L, n_moe, K]` buffer (routing replay): the experts chosen for each fed token are
        written at the token's position (`cache['length']` + offset); other entries are kept.
    Returns:
      `(cache, last_logits)`, plus the updated `routing` buffer when one is given.
    """
    b, p = ids.shape
    if p % chunk:
        raise ValueError(f"prefill block length {p} is not a multiple of the chunk size {chunk}")
    num_chunks = (jnp.max(n) + chunk - 1) // chunk  # only as many model calls as the longest row needs
    offs = jnp.arange(chunk, dtype=jnp.int32)
    record = routing is not None

    def body(carry):
        c, cache, last, buf = carry
        start = c * chunk
        seg = jax.lax.dynamic_slice_in_dim(ids, start, chunk, axis=1)
        valid = (start + offs)[None, :] < n[:, None]
        if record:
            logits, new_cache, used = ling3.forward(params, model_config, seg, cache, valid=valid, return_routing=True)
            buf = write_routing(buf, cache["length"], used.experts, valid)
        else:
            logits, new_cache = ling3.forward(params, model_config, seg, cache, valid=valid)
        idx = n - 1 - start  # index of the row's last token inside this chunk, if it is there
        here = (idx >= 0) & (idx < chunk)
        picked = jnp.take_along_axis(logits, jnp.clip(idx, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        last = jnp.where(here[:, None], picked.astype(jnp.float32), last)
        return c + 1, new_cache, last, buf

    _, cache, last_logits, routing = jax.lax.while_loop(
        lambda c: c[0] < num_chunks, body, (jnp.int32(0), cache, last_logits, routing)
    )
    if record:
        return cache, last_logits, routing
    return cache, last_logits


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling knobs (see `sampling.sample`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False


def decode_step(
    params,
    model_config: ling3.Ling3Config,
    sconf: SamplingConfig,
    cache: dict,
    last_logits: jax.Array,
    keys: jax.Array,
    active: jax.Array,
    forced: jax.Array | None = None,
    return_routing: bool = False,
):
    """Samples one token per row from `last_logits` and feeds it to the model.

    Args:
      cache: model cache; `last_logits [B, V] float32`; keys: `[B]` per-row keys (folded with the row's position);
      active: `bool [B]` rows that advance (others are fed with valid=False: their state does not change);
      forced: optional `int32 [B]` teacher-forced tokens (< 0: sample).
      return_routing: static; also return the experts that routed the fed token.
    Returns:
      `(token [B] int32, logp [B] float32, cache, logits [B, V] float32)`; `logits` are the new next-token logits
      (garbage for inactive rows). With `return_routing`, a fifth element `int32 [B, n_moe, K]`: the experts of
      the fed token (the token at position `cache['length']` of the input cache) per MoE layer, -1 for inactive
      rows.
    """
    token, logp = sampling.sample(
        step_keys(keys, cache["length"]),
        last_logits,
        sconf.temperature,
        sconf.top_k,
        sconf.top_p,
        sconf.greedy,
        forced=forced,
    )
    if return_routing:
        logits, cache, routing = ling3.forward(
            params, model_config, token[:, None], cache, valid=active[:, None], return_routing=True
        )
        return token, logp, cache, logits[:, 0], routing.experts[:, 0]
    logits, cache = ling3.forward(params, model_config, token[:, None], cache, valid=active[:, None])
    return token, logp, cache, logits[:, 0]


def pad_to_multiple(ids: jax.Array, chunk: int, pad_id: int = 0) -> jax.Array:
    """Right-pads `[B, P]` along axis 1 to a multiple of `chunk` (static shapes)."""
    p = ids.shape[1]
    extra = (-p) % chunk
    if extra == 0:
        return ids
    return jnp.pad(ids, ((0, 0), (0, extra)), constant_values=pad_id)


@functools.partial(jax.jit, static_argnames=("model_config", "max_new_tokens", "sconf", "chunk", "cache_dtype"))
def generate(
    params,
    key: jax.Array,
    prompt_ids: jax.Array,
    prompt_length: jax.Array,
    *,
    model_config: ling3.Ling3Config,
    max_new_tokens: int,
    sconf: SamplingConfig = SamplingConfig(),
    chunk: int = 32,
    cache_dtype=jnp.float32,
):
    """Prompt prefill + exactly `max_new_tokens` sampled tokens per row (no stopping), one jitted program.

    Args:
      key: one PRNG key or `[B]` per-row keys.
      prompt_ids: `int32 [B, P]` right-padded prompts; prompt_length: `int32 [B]` (>= 1).
    Returns:
      `(tokens [B, max_new_tokens] int32, logp [B, max_new_tokens] float32)`.
    """
    b, p = prompt_ids.shape
    keys = row_keys(key, b)
    cache = ling3.init_cache(model_config, b, p + max_new_tokens, cache_dtype)
    last = jnp.zeros((b, model_config.vocab_size), jnp.float32)
    cache, last = prefill_chunked(
        params, model_config, cache, pad_to_multiple(prompt_ids, chunk), prompt_length.astype(jnp.int32), last, chunk
    )
    active = jnp.ones((b,), bool)

    def body(i, carry):
        cache, last, toks, logps = carry
        tok, logp, cache, last = decode_step(params, model_config, sconf, cache, last, keys, active)
        toks = jax.lax.dynamic_update_slice_in_dim(toks, tok[:, None], i, axis=1)
        logps = jax.lax.dynamic_update_slice_in_dim(logps, logp[:, None], i, axis=1)
        return cache, last, toks, logps

    toks = jnp.zeros((b, max_new_tokens), jnp.int32)
    logps = jnp.zeros((b, max_new_tokens), jnp.float32)
    _, _, toks, logps = jax.lax.fori_loop(0, max_new_tokens, body, (cache, last, toks, logps))
    return toks, logps
