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
* backend caveat: XLA does not always have a grouped GEMM for `ragged_dot`. XLA:CPU, and XLA:GPU as shipped
  with jax 0.10 (seen in the optimised HLO of a deviceless H200 compile, benchmarks/real_shape_step.py
  --compile-only), rewrite it to a dense product over all E experts with the rows masked per group: E times the
  useful FLOPs and an [E, N*K, D] temporary (17 GiB per projection for one micro-batch of the real model's
  training step, 4 x 1471 tokens). Hence the *blocked* dispatch below for large row counts.

Blocked dispatch (`moe_experts_blocked`): each expert's rows, still sorted by expert, are padded to a multiple of
`BLOCK_ROWS`, so every block of rows belongs to one expert; the blocks run as one batched matmul against their
experts' weights (selected per block by a one-hot matmul). Exact like the ragged dispatch (no token is dropped),
plain dense ops on every backend, at most min(E, N*K) * (BLOCK_ROWS - 1) padded rows. `moe` uses it when that
bound is at most N*K (at most 2x the rows; in practice ~E * BLOCK_ROWS / 2 extra), i.e. for prefill and training
batches, and the ragged dispatch for decode-sized calls, where the padding would dominate.

`moe_dense_reference` computes the same function by running every expert on every token. It is the independent
check in the tests, and also the dispatch used on CPU for models with few experts (`DENSE_DISPATCH_MAX_EXPERTS`):
there the ragged_dot fallback is dense anyway and costs E * N * K expert rows, while running every expert once on
every token costs E * N, i.e. K times less (the embedded tiny model trains 2x faster with it). GPU/TPU and large
expert counts use the blocked or the ragged dispatch.

On a device mesh (`reno_jax.parallel`, only when one is active, so one-device programs are unchanged): large calls
run the blocked dispatch on each device's rows on its own, with the expert weights gathered whole for the call
(`_grouped_blocked`), and on a mesh that splits the experts (fsdp_ep) decode-sized calls run every local expert on
every token (`moe_dense_reference`); docs/design.md, "Expert parallelism", has the collectives of each.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from reno_jax.models.config import Ling3Config
from reno_jax.models.lora import LoraKernel
from reno_jax.sharding import hints

# On CPU, models with at most this many routed experts run every expert on every token (see module docstring).
DENSE_DISPATCH_MAX_EXPERTS = 16
# Rows per block of the blocked dispatch (a multiple of the GPU's matmul tiles; see module docstring).
BLOCK_ROWS = 64
# On a mesh, run the blocked MoE dispatch per device's rows (`_dispatch_groups`) and decode-sized calls of an
# expert-split mesh densely (`_expert_split_mesh`); False: the one-device choices on every mesh (for comparison).
GROUPED_DISPATCH = True
# The platform the programs are traced for (None: `jax.default_backend()`); see `trace_for_platform`.
_PLATFORM_OVERRIDE: str | None = None


def platform() -> str:
    """The platform whose code paths the model traces ("cpu", "gpu", "tpu"): the default backend, unless a
    `trace_for_platform` block says otherwise."""
    return _PLATFORM_OVERRIDE or jax.default_backend()


@contextlib.contextmanager
def trace_for_platform(name: str):
    """Trace the model's platform-dependent paths (the CPU-only float32 upcast in `einsum_f32`, the CPU dense
    MoE dispatch) as on `name`: for ahead-of-time compiles for a device the process does not have (a compile-only
    GPU while the default backend is the CPU). Programs traced outside such a block are unchanged."""
    global _PLATFORM_OVERRIDE
    before, _PLATFORM_OVERRIDE = _PLATFORM_OVERRIDE, name
    try:
        yield
    finally:
        _PLATFORM_OVERRIDE = before


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
    if platform() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def linear(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., in] @ kernel [in, out] in x's dtype. kernel may also be a `lora.LoraKernel` (x @ W + the low-rank
    term, never the merged weight) or a `quant.QArray` (dequantized here, by its `astype`)."""
    if isinstance(kernel, LoraKernel):
        return kernel.matmul(x)
    return jnp.matmul(x, kernel.astype(x.dtype))


def head_logits(x: jax.Array, head) -> jax.Array:
    """float32 logits x [B, T, D] @ head [D, V]; an adapted head (`LoraKernel`) adds its low-rank term instead of
    forming the adapted [D, V] matrix."""
    if isinstance(head, LoraKernel):
        low = einsum_f32("btr,rv->btv", jnp.matmul(x, head.a.astype(x.dtype)), head.b.astype(x.dtype))
        return einsum_f32("btd,dv->btv", x, head.base.astype(x.dtype)) + low * jnp.float32(head.scale)
    return einsum_f32("btd,dv->btv", x, head.astype(x.dtype))


def embed(table, ids: jax.Array) -> jax.Array:
    """Rows `ids` of the embedding table [V, D] (`jnp.take`; a `quant.QArray` table gathers its int8 rows and
    scales and dequantizes only those; an adapted `LoraKernel` table adds the rows' low-rank term)."""
    if hasattr(table, "take_rows"):
        return table.take_rows(ids)
    return jnp.take(table, ids, axis=0)


def swiglu_mlp(p: dict, x: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)); p has gate_proj/up_proj/down_proj {'kernel': [in, out]}."""
    h = jax.nn.silu(linear(x, p["gate_proj"]["kernel"])) * linear(x, p["up_proj"]["kernel"])
    return linear(h, p["down_proj"]["kernel"])


def route(p_gate: dict, x: jax.Array, config: Ling3Config, replay: jax.Array | None = None, return_own: bool = False):
    """noaux_tc router, all in float32.

    x: [N, D]. Returns (weights [N, K] float32, experts [N, K] int32).
    scores = sigmoid(x @ W); selection uses scores + expert_bias with group-limited top-k (a group's score is the
    sum of its two best biased scores); the combine weights are the unbiased scores of the chosen experts,
    renormalised when norm_topk_prob, times routed_scaling_factor.

    Routing replay (R3): `replay` int [N, K] gives the experts to use for each token instead of the router's own
    top-k; a row with any entry < 0 (-1: nothing recorded) is routed normally. The weights of a replayed row are
    computed from the current router's unbiased scores gathered at the replayed ids, renormalised and scaled
    exactly as above, so the router kernel still gets gradients; group limits are not re-applied (the replayed
    choice already satisfied them when it was made). Replaying a token's own ids, in their order, gives the same
    bits as normal routing. With `return_own=True` a third output is the router's own top-k [N, K] int32 (what it
    would have chosen), for the routing-agreement metric.
    """
    n, e = x.shape[0], config.num_experts
    g, kg, k = config.n_group, config.topk_group, config.num_experts_per_tok
    logits = jnp.matmul(
        x.astype(jnp.float32), p_gate["kernel"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
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
    _, own = jax.lax.top_k(biased, k)
    own = own.astype(jnp.int32)
    experts = own
    if replay is not None:
        if replay.shape != (n, k):
            raise ValueError(f"replay ids must be [N={n}, K={k}], got {replay.shape}")
        replay = replay.astype(jnp.int32)
        use = jnp.all(replay >= 0, axis=-1, keepdims=True)  # [N, 1]
        experts = jnp.where(use, replay, own)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * config.routed_scaling_factor
    if return_own:
        return weights, experts, own
    return weights, experts


def _expert_weights(p_experts: dict, dtype):
    """The three expert stacks cast to `dtype` (a `quant.QArray` is dequantized here, one layer at a time); a
    `lora.LoraKernel` stays one, its base applied by `_proj` (the merged stack is never formed)."""
    return tuple(
        w if isinstance(w, LoraKernel) else w.astype(dtype)
        for w in (p_experts["gate_proj"], p_experts["up_proj"], p_experts["down_proj"])
    )


def _proj(x: jax.Array, w, first, then=None) -> jax.Array:
    """`first(x, w)`: x times an expert stack in a dispatch's layout; for a `LoraKernel` w, that of its base plus
    the low-rank term through the same dispatch (`LoraKernel.grouped`)."""
    if isinstance(w, LoraKernel):
        return w.grouped(x, first, then)
    return first(x, w)


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

    def rd(v, w):
        return jax.lax.ragged_dot(v, w, group_sizes)

    h = jax.nn.silu(_proj(xs, wg, rd)) * _proj(xs, wu, rd)
    ys = _proj(h, wd, rd)  # [N*K, D], sorted order
    inverse = jnp.argsort(order)  # position of each (token, slot) in sorted order
    y = jnp.take(ys, inverse, axis=0).reshape(n, k, d).astype(jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, weights).astype(x.dtype)


def blocked_dispatch_pays(num_assignments: int, num_experts: int, block_rows: int = BLOCK_ROWS) -> bool:
    """Whether the blocked dispatch's padding bound, min(E, A) * (block_rows - 1) rows, is at most the A rows."""
    return min(num_experts, num_assignments) * (block_rows - 1) <= num_assignments


def moe_experts_blocked(
    p_experts: dict, x: jax.Array, weights: jax.Array, experts: jax.Array, block_rows: int = BLOCK_ROWS
) -> jax.Array:
    """Exact dispatch as one batched matmul over fixed-size blocks of rows, each block owned by one expert.

    p_experts: gate_proj/up_proj [E, D, Im], down_proj [E, Im, D]; x: [N, D]; weights/experts: [N, K].
    Returns [N, D] in x.dtype (combine accumulated in float32), the same function as `moe_experts`.
    """
    n, d = x.shape
    k = experts.shape[1]
    wg, wu, wd = _expert_weights(p_experts, x.dtype)
    num_experts = wg.shape[0]
    a, b = n * k, int(block_rows)
    num_blocks = (a + min(num_experts, a) * (b - 1)) // b  # static bound on sum_e ceil(size_e / b)
    flat = experts.reshape(-1)  # [A]
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    padded = (sizes + b - 1) // b * b
    padded_end = jnp.cumsum(padded)
    sorted_expert = flat[order]
    # Row of each sorted assignment in the padded layout: its expert's padded start + its rank within the expert.
    rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[sorted_expert]
    dest = (padded_end - padded)[sorted_expert] + rank  # [A], increasing
    # Inverse map: padded row -> sorted assignment (A marks a padding row, which reads a zero row of x).
    source = (
        jnp.full((num_blocks * b,), a, jnp.int32)
        .at[dest]
        .set(jnp.arange(a, dtype=jnp.int32), indices_are_sorted=True, unique_indices=True)
    )
    token = jnp.concatenate([order // k, jnp.full((1,), n, order.dtype)])
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
    xs = jnp.take(x_pad, token[source], axis=0).reshape(num_blocks, b, d)  # [nb, b, D]
    # Expert of each block; trailing blocks past the last expert's rows are all padding (any expert will do).
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_end, jnp.arange(num_blocks, dtype=jnp.int32) * b, side="right"), num_experts - 1
    )

    # Weights per block as a one-hot matmul rather than a gather: the gradient is then a matmul too, where the
    # gather's would be a scatter-add, which XLA:GPU compiles into a huge kernel (a 64 MB PTX module per
    # projection, tens of minutes in ptxas, for the real model). Both are bound by writing the [nb, ...] copy.
    onehot = jax.nn.one_hot(block_expert, num_experts, dtype=x.dtype)  # [nb, E]

    def per_block(w):  # [E, A, B] -> [nb, A, B], exact (one non-zero term per output)
        return jnp.einsum("ne,eab->nab", onehot, w, precision=jax.lax.Precision.HIGHEST)

    def mm(v, w):  # [nb, b, A] x the blocks' experts' [A, B] -> [nb, b, B]
        return jnp.einsum("nba,nac->nbc", v, per_block(w))

    h = jax.nn.silu(_proj(xs, wg, mm)) * _proj(xs, wu, mm)
    ys = _proj(h, wd, mm).reshape(num_blocks * b, d)  # padded sorted order
    row_of = jnp.zeros((a,), jnp.int32).at[order].set(dest, unique_indices=True)  # padded row of each (token, slot)
    y = jnp.take(ys, row_of, axis=0).reshape(n, k, d).astype(jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, weights).astype(x.dtype)


def moe_dense_reference(p_experts: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Same result as `moe_experts`, running every expert on every token (tests only)."""
    wg, wu, wd = _expert_weights(p_experts, x.dtype)

    def first(v, w):  # [N, D] x [E, D, I] -> [E, N, I]
        return jnp.einsum("nd,edi->eni", v, w)

    def then(v, w):  # [E, N, A] x [E, A, B] -> [E, N, B]
        return jnp.einsum("ena,eab->enb", v, w)

    h = jax.nn.silu(_proj(x, wg, first, then)) * _proj(x, wu, first, then)
    y = _proj(h, wd, then).astype(jnp.float32)  # [E, N, D]
    combine = jnp.zeros((x.shape[0], wg.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    return jnp.einsum("end,ne->nd", y, combine).astype(x.dtype)


def _dispatch_groups(n: int, k: int, num_experts: int) -> int:
    """How many independent blocked dispatches the N rows of a call split into under the active mesh (1: one
    dispatch over all rows, always without a mesh).

    On a mesh without a tensor axis (the dp, fsdp and fsdp_ep presets), each device's rows are dispatched on their
    own: G = the batch ways (data x fsdp x expert), when they divide N and a group's N/G rows still make the
    blocked dispatch pay; the expert weights are gathered whole for the call (`_grouped_blocked`). One global
    dispatch would sort all N*K assignments together, which GSPMD can only do with every row on every device (an
    all-gather of the tokens, then every device runs every block, its blocks' weights selected from expert weights
    split along `embed` or `expert`: all-gathers or all-reduces of [blocks, D, Im] products, larger than the
    weights; docs/design.md, expert parallelism). With a tensor axis (fsdp_tp) the global dispatch is kept.
    `GROUPED_DISPATCH = False` keeps it everywhere (benchmarks/sharded_plan.py --global-dispatch)."""
    mesh = hints.active_mesh()
    if mesh is None or not GROUPED_DISPATCH or mesh.shape.get("tensor", 1) > 1:
        return 1
    names = hints.batch_axes(n, mesh)
    if not names:
        return 1
    groups = 1
    for name in names:
        groups *= mesh.shape[name]
    return groups if blocked_dispatch_pays(n // groups * k, num_experts) else 1


def _expert_split_mesh() -> bool:
    """Whether the active mesh splits the routed experts (an `expert` axis > 1, the fsdp_ep preset).

    There a decode-sized call (the ragged dispatch's regime) runs every local expert on every token instead
    (`moe_dense_reference`, the same function): its expert matmuls split over the `expert` axis as they are and
    the combine reduces an [N, D] partial sum across it, where `ragged_dot`, which GSPMD cannot split along its
    groups, would all-gather every expert's weights at every decode step. A decode step reads every expert's
    weights anyway (at 16 rows x top-8 almost all 128 are hit); the extra FLOPs (E / K times the useful ones)
    are small next to that read."""
    if not GROUPED_DISPATCH:
        return False
    mesh = hints.active_mesh()
    return mesh is not None and mesh.shape.get("expert", 1) > 1


def _grouped_blocked(p_experts: dict, x: jax.Array, weights: jax.Array, experts: jax.Array, groups: int):
    """`moe_experts_blocked` run on each of `groups` contiguous row groups (one per device's rows), vmapped: the
    same function of every token (each token's experts, weights and combine do not depend on the other rows),
    with the groups split over the batch axes and the expert weights whole on every device (all-gathered once
    per use; their gradient is reduce-scattered back to the parameter's split)."""
    n, d = x.shape
    k = experts.shape[1]
    whole = {name: jax.tree.map(lambda v: hints.constrain(v, PartitionSpec()), w) for name, w in p_experts.items()}
    xg = hints.constrain_rows(x.reshape(groups, n // groups, d))
    wg = hints.constrain_rows(weights.reshape(groups, n // groups, k))
    eg = hints.constrain_rows(experts.reshape(groups, n // groups, k))
    out = jax.vmap(lambda xs, ws, es: moe_experts_blocked(whole, xs, ws, es))(xg, wg, eg)
    return hints.constrain_rows(out).reshape(n, d)


def moe(
    p: dict,
    x: jax.Array,
    config: Ling3Config,
    *,
    dense_reference: bool = False,
    replay: jax.Array | None = None,
    return_routing: bool = False,
):
    """MoE block. p: {'gate', 'experts', 'shared_experts'}; x: [B, T, D] -> [B, T, D].

    replay: optional int [B, T, K] experts to use per token (-1 rows: route normally; see `route`).
    return_routing: also return (experts used [B, T, K] int32, the router's own top-k [B, T, K] int32).
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    k = config.num_experts_per_tok
    flat_replay = None if replay is None else replay.reshape(-1, k)
    weights, experts, own = route(p["gate"], flat, config, flat_replay, return_own=True)
    cpu_small = platform() == "cpu" and config.num_experts <= DENSE_DISPATCH_MAX_EXPERTS
    blocked = blocked_dispatch_pays(flat.shape[0] * k, config.num_experts)
    if dense_reference or cpu_small or (not blocked and _expert_split_mesh()):
        fn = moe_dense_reference
    elif blocked:
        fn = moe_experts_blocked
    else:
        fn = moe_experts
    groups = _dispatch_groups(flat.shape[0], k, config.num_experts) if fn is moe_experts_blocked else 1
    if groups > 1:
        out = _grouped_blocked(p["experts"], flat, weights, experts, groups)
    else:
        out = fn(p["experts"], flat, weights, experts)
    if config.num_shared_experts > 0:
        out = out + swiglu_mlp(p["shared_experts"], flat)
    out = out.reshape(shape)
    if return_routing:
        return out, experts.reshape(shape[:-1] + (k,)), own.reshape(shape[:-1] + (k,))
    return out
