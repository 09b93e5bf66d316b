"""Kimi Delta Attention (KDA), the linear-attention layer of Ling-3.0.

Per head (Dk = Dv = head_dim) with a float32 state S [Dk, Dv], for each token t:

    S <- diag(exp(g_t)) S                      (per-key-channel forget gate, g_t in (lower_bound, 0))
    S <- S + k_t (beta_t (v_t - S^T k_t))^T    (delta rule)
    o_t = S^T q_t                              (read after the update)

q, k, v = SiLU(causal depthwise conv(proj(x))) (tap W-1 multiplies the current token); q and k are L2-normalised
over head_dim in float32 (x / sqrt(sum x^2 + 1e-6)), q is then scaled by head_dim^-0.5; beta = sigmoid(b_proj(x));
g = lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias)) (kda_safe_gate) or -exp(A_log) * softplus(f + dt_bias).
Output: RMSNorm(o) * o_norm.scale * sigmoid(g_proj(x)) per head in float32, then o_proj.

Three forms of the same recurrence:
* `kda_step`: one token (decode, T == 1);
* `kda_recurrent`: a `lax.scan` of `kda_step` over time (exact for any gate; used for the unbounded softplus gate);
* `kda_chunked`: the chunked WY form used for T > 1 with the bounded (safe) gate: chunks of C = 16 tokens, the
  intra-chunk part as [C, C] matmuls and a triangular inverse computed for all chunks in parallel, and a scan of
  T / C matmul steps carrying the state. Memory for the backward pass is O(T/C) states instead of O(T).

Padding: `valid [B, T]` marks a left-aligned prefix of real tokens per row. An invalid step leaves the state
untouched (selected away with `where`, so even non-finite garbage at padded positions cannot leak in), and the
conv history kept in the cache is the last W-1 inputs ending at each row's own last valid token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reno_jax.models.config import Ling3Config
from reno_jax.models.layers import linear

L2_EPS = 1e-6


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis, float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def causal_conv(x: jax.Array, history: jax.Array, kernel: jax.Array, n_valid: jax.Array):
    """Depthwise causal conv over time with a carried history, in float32.

    x: [B, T, C] pre-activation inputs of this chunk; history: [B, W-1, C] the previous W-1 inputs (zeros at the
    start); kernel: [W, C] (tap W-1 multiplies the current token); n_valid: [B] valid tokens per row.
    Returns (y [B, T, C] float32 before the SiLU, new_history [B, W-1, C] in history.dtype): the W-1 inputs that
    end at each row's last valid token (unchanged history when n_valid == 0).
    """
    w = kernel.shape[0]
    t = x.shape[1]
    seq = jnp.concatenate([history.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    seq32 = seq.astype(jnp.float32)
    k32 = kernel.astype(jnp.float32)
    y = sum(seq32[:, j : j + t, :] * k32[j] for j in range(w))
    idx = n_valid[:, None] + jnp.arange(w - 1)[None, :]  # [B, W-1]
    new_history = jnp.take_along_axis(seq, idx[:, :, None], axis=1).astype(history.dtype)
    return y, new_history


def kda_step(state, q, k, v, g, beta, valid):
    """One recurrent KDA step for all heads.

    state: [B, H, Dk, Dv] f32; q, k: [B, H, Dk] f32 (normalised, q scaled); v: [B, H, Dv] f32;
    g: [B, H, Dk] f32 log-decay; beta: [B, H] f32; valid: [B] bool.
    Returns (new_state, o [B, H, Dv] f32).
    """
    s = state * jnp.exp(g)[..., None]
    ks = jnp.einsum("bhk,bhkv->bhv", k, s)
    u = beta[..., None] * (v - ks)
    s = s + k[..., :, None] * u[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q, s)
    new_state = jnp.where(valid[:, None, None, None], s, state)
    return new_state, o


def kda_recurrent(q, k, v, g, beta, valid, state):
    """Sequence form, step by step: scan `kda_step` over time (exact for any gate; used for the unbounded
    softplus gate and as the reference for `kda_chunked`).

    q, k, g: [B, T, H, Dk]; v: [B, T, H, Dv]; beta: [B, T, H]; valid: [B, T]; state: [B, H, Dk, Dv] f32.
    Returns (o [B, T, H, Dv] f32, final state).
    """
    if q.shape[1] == 1:  # decode: a single step, no scan
        state, o = kda_step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], valid[:, 0])
        return o[:, None], state

    def body(s, xs):
        return kda_step(s, *xs)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, valid))
    state, o = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 1), state


# exp(+-cumulative log decay) inside a chunk must stay finite in float32 (max ~e^88): chunk * |lower_bound| <= 80.
_MAX_LOG_DECAY = 80.0


def chunk_size_for(config: Ling3Config, preferred: int = 16) -> int | None:
    """Chunk length for `kda_chunked`, or None when the gate is unbounded (softplus) and only the scan is exact."""
    if not config.kda_safe_gate:
        return None
    bound = abs(config.kda_lower_bound)
    return preferred if bound == 0 else max(1, min(preferred, int(_MAX_LOG_DECAY // bound)))


def unit_lower_inverse(m: jax.Array) -> jax.Array:
    """(I + M)^-1 for strictly lower-triangular M [..., C, C], by repeated squaring of the nilpotent M.

    M^C = 0, so (I - M)(I + M^2)(I + M^4)...(I + M^(2^j)) = I - M^(2^(j+1)) = I once 2^(j+1) >= C. That is
    2*ceil(log2 C) - 1 batched [C, C] matmuls, which (unlike a batched triangular solve) are fast on every backend
    and in the backward pass. Exact in exact arithmetic; float32 error is that of the products.
    """
    c = m.shape[-1]
    eye = jnp.eye(c, dtype=m.dtype)
    hi = jax.lax.Precision.HIGHEST
    inv = eye - m
    power = m
    span = 2
    while span < c:
        power = jnp.matmul(power, power, precision=hi)
        inv = jnp.matmul(inv, eye + power, precision=hi)
        span *= 2
    return inv


def kda_chunked(q, k, v, g, beta, valid, state, chunk: int):
    """Chunked (WY) form of the same recurrence: exact up to float rounding, O(T/C) sequential steps of matmuls.

    Shapes as in `kda_recurrent`. Requires |sum of g over `chunk` steps| <= 80 (see `chunk_size_for`).
    Per chunk of C steps, with G_t = sum_{i<=t} g_i (per key channel, from the chunk start) and S0 the incoming state:
      u_t = beta_t (v_t - S0^T (e^{G_t} k_t) - sum_{i<t} A_ti u_i),  A_ti = sum_d k_td k_id e^{G_td - G_id}
      => U = (I + diag(beta) A)^{-1} diag(beta) (V - Kd S0) = Uv - W S0            (Kd_t = e^{G_t} k_t)
      o_t = S0^T (e^{G_t} q_t) + sum_{i<=t} (sum_d q_td k_id e^{G_td - G_id}) u_i
      S_C = e^{G_C} S0 + sum_i (e^{G_C - G_i} k_i) u_i^T
    Everything that does not depend on S0 (A, its inverse, W, Uv) is computed for all chunks at once; the scan over
    chunks only does matmuls with the [Dk, Dv] state. Padded steps have k = v = q = g = beta = 0, i.e. identity.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    m = valid[:, :, None, None]
    q, k, v, g = (jnp.where(m, a, 0.0) for a in (q, k, v, g))
    beta = jnp.where(valid[:, :, None], beta, 0.0)
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        widths = lambda a: [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)  # noqa: E731
        q, k, v, g, beta = (jnp.pad(a, widths(a)) for a in (q, k, v, g, beta))

    def chunks(a):  # [B, N*C, H, ...] -> [N, B, H, C, ...]
        a = a.reshape((b, n, chunk, h) + a.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))  # beta: [N, B, H, C]
    cum = jnp.cumsum(g, axis=-2)  # [N, B, H, C, Dk]
    e_pos, e_neg = jnp.exp(cum), jnp.exp(-cum)
    qd, kd, kn = q * e_pos, k * e_pos, k * e_neg
    idx = jnp.arange(chunk)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    hi = jax.lax.Precision.HIGHEST
    a = jnp.where(strict, jnp.einsum("...tk,...ik->...ti", kd, kn, precision=hi), 0.0)
    qk = jnp.where(incl, jnp.einsum("...tk,...ik->...ti", qd, kn, precision=hi), 0.0)
    inv = unit_lower_inverse(beta[..., :, None] * a)
    w = jnp.einsum("...ti,...ik->...tk", inv, beta[..., None] * kd, precision=hi)  # [N, B, H, C, Dk]
    uv = jnp.einsum("...ti,...iv->...tv", inv, beta[..., None] * v, precision=hi)  # [N, B, H, C, Dv]
    k_end = k * jnp.exp(cum[..., -1:, :] - cum)  # e^{G_C - G_i} k_i
    decay_end = jnp.exp(cum[..., -1, :])  # [N, B, H, Dk]

    def body(s, xs):
        qd_c, qk_c, w_c, uv_c, k_end_c, decay_c = xs
        u = uv_c - jnp.einsum("bhtk,bhkv->bhtv", w_c, s, precision=hi)
        o = jnp.einsum("bhtk,bhkv->bhtv", qd_c, s, precision=hi) + jnp.einsum("bhti,bhiv->bhtv", qk_c, u, precision=hi)
        s = decay_c[..., None] * s + jnp.einsum("bhik,bhiv->bhkv", k_end_c, u, precision=hi)
        return s, o

    state, o = jax.lax.scan(body, state, (qd, qk, w, uv, k_end, decay_end))  # o: [N, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, Dv]
    o = jnp.swapaxes(o, 2, 3).reshape(b, n * chunk, h, dv)[:, :t]
    return o, state


def forget_gate(p: dict, x: jax.Array, config: Ling3Config) -> jax.Array:
    """Log-space forget gate g [B, T, H, Dk] float32."""
    h, dk = config.num_attention_heads, config.head_dim
    if config.no_kda_lora:
        f = linear(x, p["f_proj"]["kernel"])
    else:
        f = linear(linear(x, p["f_a_proj"]["kernel"]), p["f_b_proj"]["kernel"])
    f = f.astype(jnp.float32).reshape(*x.shape[:2], h, dk) + p["dt_bias"].astype(jnp.float32).reshape(h, dk)
    rate = jnp.exp(p["A_log"].astype(jnp.float32))[:, None]  # [H, 1]
    if config.kda_safe_gate:
        return config.kda_lower_bound * jax.nn.sigmoid(rate * f)
    return -rate * jax.nn.softplus(f)


def kda_attention(p: dict, x: jax.Array, config: Ling3Config, valid: jax.Array, layer_cache=None):
    """KDA layer. x: [B, T, D] (normed layer input); valid: [B, T] bool.

    layer_cache: None (fresh sequence) or {'q_conv', 'k_conv', 'v_conv': [B, W-1, P], 'state': [B, H, Dk, Dv] f32}.
    Returns (out [B, T, D] in x.dtype, new layer cache or None).
    """
    b, t, _ = x.shape
    h, dk, w = config.num_attention_heads, config.head_dim, config.short_conv_kernel_size
    pdim = h * dk
    n_valid = valid.sum(axis=1).astype(jnp.int32)
    new_cache = {}
    acts = []
    for name in ("q", "k", "v"):
        pre = linear(x, p[f"{name}_proj"]["kernel"])  # [B, T, P]
        if layer_cache is None:
            hist = jnp.zeros((b, w - 1, pdim), x.dtype)
        else:
            hist = layer_cache[f"{name}_conv"]
        y, new_hist = causal_conv(pre, hist, p[f"{name}_conv1d"]["kernel"], n_valid)
        new_cache[f"{name}_conv"] = new_hist
        acts.append(jax.nn.silu(y).reshape(b, t, h, dk))
    q, k, v = acts
    q = l2_normalize(q) * (dk**-0.5)
    k = l2_normalize(k)
    beta = jax.nn.sigmoid(linear(x, p["b_proj"]["kernel"]).astype(jnp.float32))  # [B, T, H]
    g = forget_gate(p, x, config)
    state = jnp.zeros((b, h, dk, dk), jnp.float32) if layer_cache is None else layer_cache["state"].astype(jnp.float32)
    chunk = chunk_size_for(config)
    if t == 1 or chunk is None:
        o, state = kda_recurrent(q, k, v, g, beta, valid, state)  # o: [B, T, H, Dv] f32
    else:
        o, state = kda_chunked(q, k, v, g, beta, valid, state, chunk)
    new_cache["state"] = state

    # Gated per-head RMSNorm in float32.
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + config.rms_norm_eps)
    o = o * p["o_norm"]["scale"].astype(jnp.float32)
    if config.no_kda_lora:
        gate = linear(x, p["g_proj"]["kernel"])
    else:
        gate = linear(linear(x, p["g_a_proj"]["kernel"]), p["g_b_proj"]["kernel"])
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).reshape(b, t, h, dk)
    out = linear(o.reshape(b, t, pdim).astype(x.dtype), p["o_proj"]["kernel"])
    return out, (new_cache if layer_cache is not None else None)
