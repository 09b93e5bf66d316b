"""int8 weight-only quantization of a frozen Ling-3.0 base, as pure functions over the params dict.

    qparams = quantize(params)                      # weights -> QArray(int8 values, float32 scales)
    logits, _ = ling3.forward(qparams, config, tokens)
    adapted = lora.apply(qparams, adapters, lora_config)   # LoRA on an int8 base (QLoRA-style)

Scheme: symmetric, absmax, per output channel (default) or per block of `block` rows of the contracted axis:
a weight W [..., in, out] is stored as q = round(W / s) in int8 [-127, 127] with s = max|W| / 127 over the
`in` axis (or over each block of `block` consecutive `in` rows) for every output column, s float32
[..., 1, out] (or [..., in / block, 1, out]). The embedding table [V, D], read by rows, has its scale per row
(per block of D). Elementwise |W - s q| <= s / 2 = max|W| / 254 of its channel/block.

Dequantization happens where a weight is used, inside the jitted forward, one weight at a time: the model calls
`kernel.astype(dtype)` right before each matmul (`layers.linear`, the MoE dispatches, MLA's kv_b, lm_head) and
`QArray.astype` is (q * s).astype(dtype) (computed in float32, one rounding to the compute dtype). XLA fuses the
convert-and-scale into the consumer where it can and otherwise materialises one dequantized weight at a time
(the largest: a MoE layer's expert stack, [128, 1536, 512], 0.2 GB in bf16), never the whole model. The
embedding lookup gathers rows of q and s (`take_rows`). Under autodiff with respect to adapters only, the
dequantized weights are constants; use `forward(remat=True)` so they are recomputed in the backward pass instead
of saved (tests/test_lora.py checks the saved residuals).

Not quantized: the router (routing decisions are discrete and sensitive; it is float32 in HF too), norms, the
KDA short-conv kernels, A_log, dt_bias, expert_bias: together < 0.1% of the parameters.

Measured on the golden tiny checkpoint (tests/data/ling3_tiny_a, float32, the golden inputs): see
tests/test_quant.py for the asserted tolerances and docs/design.md for the numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.models import lora

__all__ = ["QArray", "QUANT_TARGETS", "quantize", "quantize_array", "quantized_axis", "dequantize", "count_bytes"]

QUANT_TARGETS = lora.TARGETS + ("embedding", "lm_head")
QMAX = 127


def _blocked_shape(shape, axis, block):
    ax = axis % len(shape)
    return tuple(shape[:ax]) + (shape[ax] // block, block) + tuple(shape[ax + 1 :]), ax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized weight: values int8 [shape], scale float32 (the blocked shape of `values` with the block axis
    reduced to 1), `axis` the quantized (contracted) axis, `block` rows per scale along it, `orig_dtype` the
    float dtype it was quantized from (what `dequantize` returns)."""

    values: jax.Array
    scale: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    block: int = dataclasses.field(metadata=dict(static=True))
    orig_dtype: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.values.shape

    @property
    def ndim(self):
        return self.values.ndim

    @property
    def dtype(self):
        return jnp.dtype(self.orig_dtype)

    def astype(self, dtype):
        """The dequantized weight in `dtype` (q * s in float32, then cast)."""
        shape = self.values.shape
        blocked, _ = _blocked_shape(shape, self.axis, self.block)
        w = self.values.reshape(blocked).astype(jnp.float32) * self.scale
        return w.reshape(shape).astype(dtype)

    def dequantize(self):
        return self.astype(self.orig_dtype)

    def take_rows(self, ids, dtype=None):
        """Dequantized rows `ids` of a 2-D table quantized along its last axis (the embedding lookup):
        [*ids.shape, D] in `dtype` (default the original dtype), without dequantizing the table."""
        if self.values.ndim != 2 or self.axis % 2 != 1:
            raise ValueError("take_rows needs a [V, D] table quantized along D")
        v = jnp.take(self.values, ids, axis=0)  # [..., D]
        s = jnp.take(self.scale, ids, axis=0)  # [..., D / block, 1]
        d = v.shape[-1]
        w = v.reshape(v.shape[:-1] + (d // self.block, self.block)).astype(jnp.float32) * s
        return w.reshape(v.shape).astype(self.orig_dtype if dtype is None else dtype)

    @property
    def T(self):  # noqa: N802 - mirrors ndarray.T (a tied lm_head reads the embedding transposed)
        """The transpose of a 2-D QArray, still quantized (the scale moves with its axis)."""
        if self.values.ndim != 2:
            raise ValueError("QArray.T is for 2-D weights")
        ax = self.axis % 2
        # blocked scale: axis 1 -> [V, n, 1]; axis 0 -> [n, 1, V]
        scale = jnp.moveaxis(self.scale, 0, -1) if ax == 1 else jnp.moveaxis(self.scale, -1, 0)
        return QArray(self.values.T, scale, -2 if ax == 1 else -1, self.block, self.orig_dtype)


def quantize_array(w, axis: int = -2, block: int | None = None) -> QArray:
    """Symmetric absmax int8 quantization of `w` along `axis` (block None: one scale per channel, the whole axis;
    else per `block` consecutive entries of it; an axis shorter than `block` is one block)."""
    w = jnp.asarray(w)
    n = w.shape[axis]
    blk = n if block is None or block >= n else int(block)
    if n % blk:
        raise ValueError(f"axis {axis} of a {w.shape} weight ({n}) is not a multiple of block {blk}")
    blocked, ax = _blocked_shape(w.shape, axis, blk)
    wb = w.astype(jnp.float32).reshape(blocked)
    amax = jnp.max(jnp.abs(wb), axis=ax + 1, keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(wb / scale), -QMAX, QMAX).astype(jnp.int8).reshape(w.shape)
    return QArray(q, scale, axis - w.ndim if axis >= 0 else axis, blk, jnp.dtype(w.dtype).name)


def quantized_axis(kind: str) -> int:
    """The axis a weight of `lora.weight_kind` `kind` is quantized along: the embedding [V, D] along D (its rows are
    looked up), every kernel [..., in, out] along `in` (the contracted axis)."""
    return -1 if kind == "embedding" else -2


def quantize(params: dict, which=QUANT_TARGETS, block: int | None = None) -> dict:
    """A params tree with the weights of the kinds in `which` (`lora.weight_kind` names: 'kda', 'mla', 'mlp',
    'experts', 'shared_experts', 'embedding', 'lm_head'; default all) replaced by `QArray`s; every other leaf is
    shared with `params`. Kernels are quantized along their `in` axis (-2), the embedding along D (-1)."""
    unknown = [w for w in which if w not in QUANT_TARGETS]
    if unknown:
        raise ValueError(f"unknown quantization targets {unknown}; known: {QUANT_TARGETS}")
    out = params
    for path, kind in lora.projections(params).items():
        if kind in which:
            w = lora._get(params, path)
            out = lora._set(out, path, quantize_array(w, quantized_axis(kind), block))
    return out


def dequantize(qparams: dict) -> dict:
    """The float params of a quantized tree (every `QArray` dequantized to its original dtype)."""
    return jax.tree.map(
        lambda x: x.dequantize() if isinstance(x, QArray) else x, qparams, is_leaf=lambda x: isinstance(x, QArray)
    )


def count_bytes(params: Any) -> int:
    """Bytes of all leaves of a (possibly quantized) params tree (arrays or ShapeDtypeStructs)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
