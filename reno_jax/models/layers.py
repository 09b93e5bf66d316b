"""Shared building blocks: RMSNorm, linear, SwiGLU MLP and the DeepSeek-V3 style (noaux_tc) MoE.

MoE dispatch
------------
Tokens are routed exactly (nothing is dropped): the N*K (token, expert) assignments are sorted by expert id,
the token rows are gathered into that order, and the three expert projections run as grouped matmuls with
`jax.lax.ragged_dot` (group sizes = tokens per expert); the outputs are un-permuted and combined with the router
weights. Cost per MoE layer, with N tokens, K = num_experts_per_tok, E experts, D = hidden, Im = expert size:

* useful FLOPs: 6 * N * K * D * Im (the same as running only the chosen experts), plus an O(N*K*log(N*K)) sort and
  two [N*K, D] gathers;
* memory traffic: every expert's weights are read once per call (3*E*D*Im values), which dominates decode at
  small N — the same as any exact MoE kernel, since at batch 64 / top-8 almost all 128 experts are hit;
* backend caveat: on GPU / TPU `ragged_dot` lowers to a grouped GEMM (XLA's ragged-dot instruction). The XLA:CPU
  fallback lowering of `ragged_dot` masks the lhs per group and runs a dense batched matmul, i.e. E times the
  useful FLOPs; that only matters for CPU runs of a real-size model, never for the tiny test models.

`moe_dense_reference` computes the same function by running every expert on every token. It is the independent
check in the tests, and also the dispatch used on CPU for models with few experts (`DENSE_DISPATCH_MAX_EXPERTS`):
there the ragged_dot fallback is dense anyway and costs E * N * K expert rows, while running every expert once on
every token costs E * N, i.e. K times less (the embedded tiny model trains 2x faster with it). GPU/TPU and large
expert counts always use the sorted ragged_dot dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reno_jax.models.config import Ling3Config

# On CPU, models with at most this many routed experts run every expert on every token (see module docstring).
DENSE_DISPATCH_MAX_EXPERTS = 16


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis: normalise in float32 (eps inside the rsqrt), cast back, then scale.

    x: [..., D] (any float dtype); scale: [D]. Returns x.dtype.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed.astype(x.dtype) * scale.astype(x.dtype)).astype(x.dtype)


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with float32 accumulation and output, whatever the operand dtypes.

    GPU/TPU accumulate low-precision operands in float32 via preferred_element_type; XLA:CPU has no
    bf16 x bf16 -> f32 dot, so there the operands are upcast first (same result, CPU is only for tests).
    """
    if jax.default_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def linear(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., in] @ kernel [in, out] in x's dtype."""
    return jnp.matmul(x, kernel.astype(x.dtype))


def swiglu_mlp(p: dict, x: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)); p has gate_proj/up_proj/down_proj {'kernel': [in, out]}."""
    h = jax.nn.silu(linear(x, p["gate_proj"]["kernel"])) * linear(x, p["up_proj"]["kernel"])
    return linear(h, p["down_proj"]["kernel"])


def route(p_gate: dict, x: jax.Array, config: Ling3Config):
    """noaux_tc router, all in float32.

    x: [N, D]. Returns (weights [N, K] float32, experts [N, K] int32).
    scores = sigmoid(x @ W); selection uses scores + expert_bias with group-limited top-k (a group's score is the
    sum of its two best biased scores); the combine weights are the unbiased scores of the chosen experts,
    renormalised when norm_topk_prob, times routed_scaling_factor.
    """
    n, e = x.shape[0], config.num_experts
    g, kg, k = config.n_group, config.topk_group, config.num_experts_per_tok
    logits = jnp.matmul(x.astype(jnp.float32), p_gate["kernel"].astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    biased = scores + p_gate["expert_bias"].astype(jnp.float32)
    if g > 1:
        per_group = biased.reshape(n, g, e // g)
        best = jax.lax.top_k(per_group, min(2, e // g))[0]
        group_scores = best.sum(-1)  # [N, G]
        _, top_groups = jax.lax.top_k(group_scores, kg)
        group_mask = jax.nn.one_hot(top_groups, g, dtype=jnp.bool_).any(axis=1)  # [N, G]
        expert_mask = jnp.repeat(group_mask, e // g, axis=1)  # [N, E]
        biased = jnp.where(expert_mask, biased, -jnp.inf)
    _, experts = jax.lax.top_k(biased, k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * config.routed_scaling_factor
    return weights, experts.astype(jnp.int32)


def _expert_weights(p_experts: dict, dtype):
    return (p_experts["gate_proj"].astype(dtype), p_experts["up_proj"].astype(dtype),
            p_experts["down_proj"].astype(dtype))


def moe_experts(p_experts: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Exact sort-by-expert dispatch with ragged_dot.

    p_experts: gate_proj/up_proj [E, D, Im], down_proj [E, Im, D]; x: [N, D]; weights/experts: [N, K].
    Returns [N, D] in x.dtype (combine accumulated in float32).
    """
    n, d = x.shape
    k = experts.shape[1]
    wg, wu, wd = _expert_weights(p_experts, x.dtype)
    num_experts = wg.shape[0]
    flat = experts.reshape(-1)  # [N*K]
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k
    xs = jnp.take(x, token, axis=0)  # [N*K, D]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, wg, group_sizes)) * jax.lax.ragged_dot(xs, wu, group_sizes)
    ys = jax.lax.ragged_dot(h, wd, group_sizes)  # [N*K, D], sorted order
    inverse = jnp.argsort(order)  # position of each (token, slot) in sorted order
    y = jnp.take(ys, inverse, axis=0).reshape(n, k, d).astype(jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, weights).astype(x.dtype)


def moe_dense_reference(p_experts: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Same result as `moe_experts`, running every expert on every token (tests only)."""
    wg, wu, wd = _expert_weights(p_experts, x.dtype)
    h = jax.nn.silu(jnp.einsum("nd,edi->eni", x, wg)) * jnp.einsum("nd,edi->eni", x, wu)
    y = jnp.einsum("eni,eid->end", h, wd).astype(jnp.float32)  # [E, N, D]
    combine = jnp.zeros((x.shape[0], wg.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    return jnp.einsum("end,ne->nd", y, combine).astype(x.dtype)


def moe(p: dict, x: jax.Array, config: Ling3Config, *, dense_reference: bool = False) -> jax.Array:
    """MoE block. p: {'gate', 'experts', 'shared_experts'}; x: [B, T, D] -> [B, T, D]."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, experts = route(p["gate"], flat, config)
    cpu_small = jax.default_backend() == "cpu" and config.num_experts <= DENSE_DISPATCH_MAX_EXPERTS
    fn = moe_dense_reference if (dense_reference or cpu_small) else moe_experts
    out = fn(p["experts"], flat, weights, experts)
    if config.num_shared_experts > 0:
        out = out + swiglu_mlp(p["shared_experts"], flat)
    return out.reshape(shape)
