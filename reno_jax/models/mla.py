"""Gated multi-head latent attention (MLA) of Ling-3.0.

q = q_b(q_a_layernorm(q_a(x))) (or q_proj(x)) split per head into [nope | rope];
kv_a_proj_with_mqa(x) = [latent c (kv_lora_rank) | k_rope (one head shared by all heads)];
c = kv_a_layernorm(c); kv_b(c) = per head [k_nope | v]. Rope (theta^(-2j/dr)) rotates the rope parts as
interleaved pairs (x0, x1), (x2, x3), ... (kept in that interleaved layout: q and k use the same one, so the dot
products are the reference's). Scale (nope + rope)^-0.5, causal softmax in float32, then the head outputs are
multiplied by sigmoid(g_proj(x)) (per head or per channel) before `dense`.

With a cache the attention runs in the "absorbed" form: kv_b's key half is folded into the query
(q_lat = q_nope W_uk, scores = q_lat . c + q_rope . k_rope) and its value half is applied after the softmax
(out = (p c) W_uv). So the cache holds only the normed latent c [B, S, kv_lora_rank] and the rotated k_rope
[B, S, dr] per position, and a decode step costs O(S * H * (kv_lora_rank + dr)) instead of re-expanding every
cached latent through kv_b. Without a cache (a train step's whole sequences) the latents are expanded through kv_b
once and the [T, T] products run over (dn + dr) and dv channels per head, fewer than the absorbed form's
(kv_lora_rank + dr) and kv_lora_rank (Ling-3.0: 192 + 128 against 576 + 512).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reno_jax.models.config import Ling3Config
from reno_jax.models.layers import einsum_f32, linear, rms_norm

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use 1e-6 whatever rms_norm_eps says
_MASKED = -1e30  # finite, so a row with no visible key gives garbage, never NaN
QUERY_BLOCK = 128  # uncached sequences longer than twice this attend block by block (see mla_attention)


def rope_interleaved(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate interleaved pairs of the last axis.

    x: [B, T, ..., dr]; positions: [B, T] int. Pair j = (x[2j], x[2j+1]) is rotated by positions * theta^(-2j/dr).
    Returns x.dtype, same interleaved layout.
    """
    dr = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, dr, 2, dtype=jnp.float32) / dr)  # [dr/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, dr/2]
    ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def mla_attention(
    p: dict, x: jax.Array, config: Ling3Config, valid: jax.Array, positions: jax.Array, layer_cache=None, length=None
):
    """MLA layer. x: [B, T, D] (normed layer input); valid: [B, T]; positions: [B, T] int32 (length + t).

    layer_cache: None (keys = this chunk, causal among its tokens) or {'latent': [B, S, r], 'k_rope': [B, S, dr]}
    with `length [B]` tokens already stored; the chunk's valid tokens are written at positions length + t
    (invalid ones are dropped) and attend to every stored position <= their own.
    Returns (out [B, T, D] in x.dtype, new layer cache or None).
    """
    b, t, _ = x.shape
    h = config.num_attention_heads
    dn, dr, dv, r = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
    dtype = x.dtype

    if config.q_lora_rank is None:
        q = linear(x, p["q_proj"]["kernel"])
    else:
        q = linear(
            rms_norm(linear(x, p["q_a_proj"]["kernel"]), p["q_a_layernorm"]["scale"], LATENT_NORM_EPS),
            p["q_b_proj"]["kernel"],
        )
    q = q.reshape(b, t, h, dn + dr)
    q_nope, q_rope = q[..., :dn], rope_interleaved(q[..., dn:], positions, config.rope_theta)

    kv = linear(x, p["kv_a_proj_with_mqa"]["kernel"])  # [B, T, r + dr]
    latent = rms_norm(kv[..., :r], p["kv_a_layernorm"]["scale"], LATENT_NORM_EPS)  # [B, T, r]
    k_rope = rope_interleaved(kv[..., r:], positions, config.rope_theta)  # [B, T, dr]

    if layer_cache is None:
        keys_c, keys_r = latent, k_rope
        s_idx = jnp.arange(t)
        mask = (s_idx[None, None, :] <= jnp.arange(t)[None, :, None]) & valid[:, None, :]  # [B, T, S]
        new_cache = None
    else:
        size = layer_cache["latent"].shape[1]
        # Invalid tokens get index `size` (out of bounds) and are dropped, so padding never touches the cache.
        write = jnp.where(valid, positions, size)
        rows = jnp.arange(b)[:, None]
        keys_c = layer_cache["latent"].at[rows, write].set(latent.astype(layer_cache["latent"].dtype), mode="drop")
        keys_r = layer_cache["k_rope"].at[rows, write].set(k_rope.astype(layer_cache["k_rope"].dtype), mode="drop")
        new_cache = {"latent": keys_c, "k_rope": keys_r}
        s_idx = jnp.arange(size)
        visible_end = (length + valid.sum(axis=1)).astype(jnp.int32)  # [B]
        mask = (s_idx[None, None, :] <= positions[:, :, None]) & (s_idx[None, None, :] < visible_end[:, None, None])

    kv_b = p["kv_b_proj"]["kernel"].astype(dtype).reshape(r, h, dn + dv)
    w_uk, w_uv = kv_b[..., :dn], kv_b[..., dn:]  # [r, H, dn], [r, H, dv]
    keys_c, keys_r = keys_c.astype(dtype), keys_r.astype(dtype)
    if layer_cache is None:
        # Expanded form: every key is scored once per query, so expanding the T latents through kv_b first makes
        # the [T, S] products run over dn + dr and dv channels instead of (kv_lora_rank + dr) and kv_lora_rank.
        k_nope = jnp.einsum("bsr,rhn->bshn", keys_c, w_uk)  # [B, S, H, dn]
        values = jnp.einsum("bsr,rhv->bshv", keys_c, w_uv)  # [B, S, H, dv]
        q_main, k_main, v_main = q_nope, k_nope, values
        score_spec, out_spec = "bthn,bshn->bhts", "bhts,bshv->bthv"
    else:
        # Absorbed form: a decode step scores the whole cache, so the cache keeps latents and kv_b's key half is
        # folded into the query (and its value half applied after the softmax).
        q_main = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk)
        k_main = v_main = keys_c
        score_spec, out_spec = "bthr,bsr->bhts", "bhts,bsr->bthr"
    # A long sequence without a cache (training on whole conversations) in query blocks, each against the keys
    # before its end only: about half the scores of the [T, T] square, one block's at a time. With a cache the
    # keys a query sees depend on the traced `length`, so every query scores every cached position.
    block = QUERY_BLOCK if layer_cache is None and t > 2 * QUERY_BLOCK else t
    outs = []
    for start in range(0, t, block):
        end = min(t, start + block)
        seen = end if layer_cache is None else k_main.shape[1]
        scores = einsum_f32(score_spec, q_main[:, start:end], k_main[:, :seen]) + einsum_f32(
            "bthd,bsd->bhts", q_rope[:, start:end], keys_r[:, :seen]
        )
        scores = scores * ((dn + dr) ** -0.5)
        scores = jnp.where(mask[:, None, start:end, :seen], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1)
        outs.append(einsum_f32(out_spec, probs.astype(dtype), v_main[:, :seen]))
    out_heads = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    if layer_cache is None:
        o = out_heads  # [B, T, H, dv] f32
    else:
        o = einsum_f32("bthr,rhv->bthv", out_heads.astype(dtype), w_uv)  # [B, T, H, dv] f32

    gate = jax.nn.sigmoid(linear(x, p["g_proj"]["kernel"]).astype(jnp.float32))
    if config.gated_attention_proj_granularity_type == "head_wise":
        o = o * gate[..., None]
    else:
        o = o * gate.reshape(b, t, h, dv)
    out = linear(o.reshape(b, t, h * dv).astype(dtype), p["dense"]["kernel"])
    return out, new_cache
