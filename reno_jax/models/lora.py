"""Low-rank adapters (LoRA) for the Ling-3.0 params dict, as pure functions over pytrees.

API
---
    config = LoraConfig(rank=8, alpha=32.0)                 # rank 0: no adapters
    adapters = init_adapters(params, config, key)           # a small separate pytree
    logits, _ = ling3.forward(apply(params, adapters, config), model_config, tokens)
    grads = jax.grad(lambda ad: loss(ling3.forward(apply(params, ad, config), ...)))(adapters)
    merged = merge(params, adapters, config)                # plain params: W + (alpha / rank) A @ B

Adapter tree: the params dict's layout, cut down to the targeted weights, each weight W [..., in, out] replaced by
{'a': A [..., in, r], 'b': B [..., r, out]} (A ~ U(-1/sqrt(in), 1/sqrt(in)) as torch/PEFT's kaiming init, B = 0,
so a fresh adapter changes nothing); the adapted weight is W + (alpha / r) A @ B. A and B are float32 by default
(`LoraConfig.dtype`), whatever the base's dtype; they are cast to the activations' dtype where they are used.
`targets` names projection kinds (`weight_kind`): 'kda' (q/k/v/b/f/g/o projections of the KDA layers, not the
short convolutions), 'mla' (q_a/q_b or q, kv_a_proj_with_mqa, kv_b, g, dense of the MLA layers), 'mlp' (the dense
layers' gate/up/down), 'experts' (the routed experts' gate/up/down stacks), 'shared_experts' (the default: all
five); opt-in 'embedding' (A [V, r], its rows gathered with the tokens) and 'lm_head'. The router, norms and the
KDA gate parameters are never adapted.

MoE experts (`expert_adapters`): the routed experts are stacks W [E, in, out].
  'per_expert' (default): A [E, in, r], B [E, r, out], one independent adapter per expert. That is what "LoRA on
     the MoE experts" means in "LoRA Without Regret" (Schulman et al., Thinking Machines 2025), which found LoRA
     on all layers, MLP/MoE included, needed to match full fine-tuning, and attention-only LoRA clearly worse. It
     costs E times the parameters: for Ling-3.0-tiny at rank 8, 145M adapter parameters on the experts (0.58 GB
     in float32; docs/design.md has the arithmetic), still small next to the 7.9B base.
  'shared': one A [in, r], B [r, out] per projection and layer, added to every expert (W_e + s A B for all e):
     128x cheaper, but the update is the same for every expert, so it cannot specialise experts differently (it
     acts like a dense low-rank MLP branch fed through the router's weights). A fallback when memory is tight.

Adapted forward: `apply` vs `merge` (memory)
--------------------------------------------
`apply(params, adapters, config)` does no arithmetic: it returns the params with every targeted weight replaced by
a `LoraKernel(base, a, b, scale)` leaf (a registered pytree). The model's matmuls (`layers.linear`, the three MoE
dispatches) see it and compute x @ W + ((x @ A) @ B) * scale in the layer; any other consumer of the weight
(MLA's kv_b in the absorbed attention, a tied lm_head) calls `.astype(dtype)` and gets the merged weight
W + scale A @ B, computed right there (kv_b is small: [kv_lora_rank, H * (dn + dv)]). Plain params take exactly the
old code path (bit-identical outputs). Why not merge inside the jitted loss instead: for the real model a merged
weight is as large as the base weight (a MoE layer's three expert stacks: 3 x 128 x 1536 x 512 = 302M values,
0.6 GB in bf16 per layer, 14 GB for the 23 MoE layers), and it is a function of the adapters, so autodiff keeps
it, or recomputes it, for the backward pass, where its gradient dL/dW = x^T dy is also base-sized (a full
[E, in, out] gradient per projection per layer) before it is contracted to dA = dW B^T, dB = A^T dW. Merged
outside the layers it is one whole bf16 copy of the model saved as residuals (15.8 GB: over the 24 GB budget with
the base). In the layer, the only extra tensors are [tokens, r] activations and the adapters' own gradients, and
the base enters only as a constant (gradients are taken over the adapter tree alone, so nothing base-sized is
ever differentiated). With `forward(remat=True)` each layer's dequantized / cast base weights are recomputed in the
backward pass rather than saved (tests/test_lora.py checks the saved residuals).

`merge` is for export and for rollouts (a merged bf16 copy decodes at the base model's speed); on a quantized
base the adapted weights come out dequantized and merged (float), the rest stays int8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LoraConfig",
    "LoraKernel",
    "TARGETS",
    "TABLE_TARGETS",
    "ALL_TARGETS",
    "weight_kind",
    "projections",
    "init_adapters",
    "apply",
    "merge",
    "adapter_shapes",
    "count_adapter_params",
]

TARGETS = ("kda", "mla", "mlp", "experts", "shared_experts")
# Opt-in: the token tables. A pretrained model's embeddings rarely need adapting, but a small model trained from
# little data keeps much of what it learns there (docs/design.md, "LoRA and an int8 base").
TABLE_TARGETS = ("embedding", "lm_head")
ALL_TARGETS = TARGETS + TABLE_TARGETS
EXPERT_ADAPTERS = ("per_expert", "shared")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank: r (0: no adapters); alpha: the update is (alpha / r) A @ B; targets: projection kinds to adapt (see
    module docstring; default all); expert_adapters: 'per_expert' or 'shared' (routed experts); dtype: the
    adapters' dtype."""

    rank: int = 0
    alpha: float = 32.0
    targets: tuple = TARGETS
    expert_adapters: str = "per_expert"
    dtype: Any = jnp.float32

    def __post_init__(self):
        if not isinstance(self.rank, (int, np.integer)) or self.rank < 0:
            raise ValueError(f"LoraConfig.rank must be an int >= 0, got {self.rank!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = [t for t in self.targets if t not in ALL_TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; known: {ALL_TARGETS}")
        if self.expert_adapters not in EXPERT_ADAPTERS:
            raise ValueError(f"expert_adapters must be one of {EXPERT_ADAPTERS}, got {self.expert_adapters!r}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank if self.rank else 0.0


# ---------------------------------------------------------------------------------------------- adapted weight


def _delta(a, b, dtype):
    """A @ B in `dtype` (per-expert [E, in, r] @ [E, r, out] or one [in, r] @ [r, out])."""
    return jnp.matmul(a.astype(dtype), b.astype(dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraKernel:
    """An adapted weight inside a params tree: base W [..., in, out] (array or `quant.QArray`), A, B and the
    static scale alpha / r. The model's matmuls compute x @ W + ((x @ A) @ B) * scale (`matmul`, and the MoE
    dispatches in `layers`); `astype(dtype)` is the merged weight W + scale A @ B (float32 sum, cast once)."""

    base: Any
    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def ndim(self):
        return len(self.base.shape)

    @property
    def per_expert(self) -> bool:
        """Whether the adapter has its own A, B per leading (expert) index of the base."""
        return self.a.ndim == len(self.base.shape)

    def astype(self, dtype):
        merged = self.base.astype(jnp.float32) + jnp.float32(self.scale) * _delta(self.a, self.b, jnp.float32)
        return merged.astype(dtype)

    def matmul(self, x):
        """x [..., in] @ the adapted weight [in, out] in x's dtype, without forming it."""
        base = jnp.matmul(x, self.base.astype(x.dtype))
        low = jnp.matmul(jnp.matmul(x, self.a.astype(x.dtype)), self.b.astype(x.dtype))
        return base + low * jnp.asarray(self.scale, x.dtype)

    def take_rows(self, ids, dtype=None):
        """Rows `ids` of an adapted [V, D] table (the embedding lookup): W[ids] + scale * A[ids] @ B, in `dtype`
        (default the base's), without forming the adapted table."""
        dtype = self.base.dtype if dtype is None else dtype
        if hasattr(self.base, "take_rows"):
            rows = self.base.take_rows(ids, dtype)
        else:
            rows = jnp.take(self.base, ids, axis=0).astype(dtype)
        low = jnp.matmul(jnp.take(self.a, ids, axis=0).astype(dtype), self.b.astype(dtype))
        return rows + low * jnp.asarray(self.scale, dtype)

    @property
    def T(self):  # noqa: N802 - mirrors ndarray.T (a tied lm_head reads the embedding transposed)
        """The transposed adapted weight (W + s A B)^T = W^T + s B^T A^T, still low rank."""
        return LoraKernel(self.base.T, self.b.T, self.a.T, self.scale)

    def grouped(self, x, first, then=None):
        """An expert projection: `first(x, stack)` multiplies x by an expert stack [E, in, out] in the dispatch's
        layout, `then(y, stack)` (default `first`) multiplies a result of `first` by another stack. Per-expert
        adapters go through the same dispatch ([E, in, r] then [E, r, out]); a shared one is a plain x @ A @ B on
        the rows (broadcast over the experts where the layout has an expert axis)."""
        then = first if then is None else then
        dtype = x.dtype
        base = first(x, self.base.astype(dtype))
        a, b = self.a.astype(dtype), self.b.astype(dtype)
        low = then(first(x, a), b) if self.per_expert else jnp.matmul(jnp.matmul(x, a), b)
        return base + low * jnp.asarray(self.scale, dtype)


# ---------------------------------------------------------------------------------------------- walking params


def _walk(tree, prefix=()):
    """(path, leaf) of a nested dict, in sorted key order; non-dict values are leaves."""
    for k in sorted(tree):
        v = tree[k]
        if isinstance(v, dict):
            yield from _walk(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def weight_kind(path: tuple, is_kda: bool | None = None) -> str | None:
    """The kind of the parameter at `path`: one of TARGETS, 'embedding', 'lm_head', or None (router, norms,
    short-conv kernels, KDA gate parameters, expert_bias). is_kda: whether the path's attention block is a KDA
    one (`projections` reads it off the block's 'A_log'); needed for attention paths only."""
    if path == ("model", "word_embeddings", "embedding"):
        return "embedding"
    if path == ("lm_head", "kernel"):
        return "lm_head"
    if len(path) < 4 or path[0] != "model" or not path[1].startswith("layers_"):
        return None
    block, rest = path[2], path[3:]
    if block == "attention":
        if (
            len(rest) == 2
            and rest[1] == "kernel"
            and rest[0].endswith("_proj")
            or rest in (("dense", "kernel"), ("kv_a_proj_with_mqa", "kernel"))
        ):
            if is_kda is None:
                raise ValueError(f"attention path {path} needs is_kda")
            return "kda" if is_kda else "mla"
        return None
    if block == "mlp":
        names = ("gate_proj", "up_proj", "down_proj")
        if len(rest) == 2 and rest[0] in names and rest[1] == "kernel":
            return "mlp"
        if len(rest) == 2 and rest[0] == "experts" and rest[1] in names:
            return "experts"
        if len(rest) == 3 and rest[0] == "shared_experts" and rest[1] in names and rest[2] == "kernel":
            return "shared_experts"
    return None


def projections(params: dict) -> dict:
    """{path: kind} of every parameter of `params` that `weight_kind` names (leaves may be arrays,
    ShapeDtypeStructs or quantized leaves)."""
    out = {}
    for path, _ in _walk(params):
        is_kda = None
        if len(path) > 3 and path[2] == "attention":
            is_kda = "A_log" in params["model"][path[1]]["attention"]
        kind = weight_kind(path, is_kda)
        if kind is not None:
            out[path] = kind
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    """A copy of nested dict `tree` with `path` set (the dicts along the path are copied, nothing else)."""
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _set(tree.get(path[0], {}), path[1:], value)
    return out


# ---------------------------------------------------------------------------------------------- adapters


def adapter_shapes(params: dict, config: LoraConfig) -> dict:
    """{path: (A shape, B shape)} of the adapters `init_adapters` makes for `params` (shapes only)."""
    out = {}
    if config.rank == 0:
        return out
    r = config.rank
    for path, kind in projections(params).items():
        if kind not in config.targets:
            continue
        shape = tuple(_get(params, path).shape)
        lead, (din, dout) = shape[:-2], shape[-2:]
        if kind == "experts" and config.expert_adapters == "shared":
            lead = ()
        out[path] = (lead + (din, r), lead + (r, dout))
    return out


def init_adapters(params: dict, config: LoraConfig, key: jax.Array) -> dict:
    """Adapters for `params` (module docstring): {'a': A, 'b': B} at the path of each targeted weight; {} when
    rank is 0. A_i ~ U(-1/sqrt(in), 1/sqrt(in)) from `jax.random.fold_in(key, i)` (i: index of the weight in the
    sorted path list), B = 0. Works under `jax.eval_shape` (params may be ShapeDtypeStructs)."""
    tree: dict = {}
    for i, (path, (sa, sb)) in enumerate(sorted(adapter_shapes(params, config).items())):
        bound = 1.0 / math.sqrt(sa[-2])
        a = jax.random.uniform(jax.random.fold_in(key, i), sa, jnp.float32, -bound, bound).astype(config.dtype)
        tree = _set(tree, path, {"a": a, "b": jnp.zeros(sb, config.dtype)})
    return tree


def _pairs(params, adapters):
    for path, _ in _walk(adapters):
        if path[-1] == "a":
            yield path[:-1], _get(adapters, path[:-1])


def _check(params, adapters, config):
    expected = adapter_shapes(params, config)
    got = {path: (tuple(ad["a"].shape), tuple(ad["b"].shape)) for path, ad in _pairs(params, adapters)}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(p for p in set(got) & set(expected) if got[p] != expected[p])
        raise ValueError(
            f"adapters do not match the params and LoraConfig: missing {missing[:3]}, unexpected "
            f"{extra[:3]}, wrong shapes {[(p, got[p], expected[p]) for p in wrong[:3]]}"
        )


def apply(params: dict, adapters: dict, config: LoraConfig) -> dict:
    """The params with each adapted weight replaced by a `LoraKernel` (no arithmetic: the model's matmuls apply
    the adapter in the layer, see module docstring). Rank 0 returns `params` itself."""
    if config.rank == 0:
        return params
    _check(params, adapters, config)
    out = params
    for path, ad in _pairs(params, adapters):
        out = _set(out, path, LoraKernel(_get(params, path), ad["a"], ad["b"], config.scale))
    return out


def merge(params: dict, adapters: dict, config: LoraConfig, dtype=None) -> dict:
    """Plain params with W <- W + (alpha / r) A @ B (summed in float32, cast to `dtype`, default the base's
    dtype). An adapted `quant.QArray` weight is dequantized and merged into a float one; weights without an
    adapter (quantized or not) are shared with `params` as they are."""
    if config.rank == 0:
        return params
    applied = apply(params, adapters, config)
    out = params
    for path, _ in _pairs(params, adapters):
        leaf = _get(applied, path)
        out = _set(out, path, leaf.astype(leaf.dtype if dtype is None else dtype))
    return out


def count_adapter_params(params: dict, config: LoraConfig) -> dict:
    """{kind: adapter parameter count} and 'total', from shapes only (params may be ShapeDtypeStructs)."""
    kinds = projections(params)
    out = {t: 0 for t in config.targets}
    for path, (sa, sb) in adapter_shapes(params, config).items():
        out[kinds[path]] += math.prod(sa) + math.prod(sb)
    out["total"] = sum(out.values())
    return out
