"""Ling-3.0 (HF ``bailing_hybrid`` / ``BailingMoeV3ForCausalLM``) in JAX: public model API.

See docs/design.md for the contract. Parameters are a plain nested dict that mirrors the HF names
(every kernel is the HF weight transposed, [in, out]):

    {'model': {'word_embeddings': {'embedding': [V, D]},
               'layers_{i}': {'input_layernorm': {'scale'}, 'post_attention_layernorm': {'scale'},
                              'attention': KDA or MLA params, 'mlp': dense or MoE params},
               'norm': {'scale': [D]}},
     'lm_head': {'kernel': [D, V]}}        # absent when tie_word_embeddings

Dtypes: `init_params` puts every weight in `dtype` except the ones HF keeps in float32 (router kernel and
expert_bias, A_log, dt_bias, the short-conv kernels). Whatever the parameter dtype, norms, router, KDA gates and
state, attention softmax and logits are computed in float32.

Cache (`init_cache`): {'length': [B] int32, 'layers': tuple with one dict per layer}; KDA layers hold
'q_conv'/'k_conv'/'v_conv' [B, W-1, P] (pre-activation conv inputs) and 'state' [B, H, Dk, Dv] float32; MLA layers
hold 'latent' [B, S, kv_lora_rank] and 'k_rope' [B, S, qk_rope_head_dim] (S = max_length). Writes past max_length
are dropped, so the caller must size the cache for the whole sequence.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reno_jax.models.config import Ling3Config, ling3_tiny_real, tiny_test_config  # noqa: F401 (re-export)
from reno_jax.models.kda import kda_attention
from reno_jax.models.layers import einsum_f32, moe, rms_norm, swiglu_mlp
from reno_jax.models.mla import mla_attention
from reno_jax.sharding import hints

__all__ = ["Ling3Config", "ling3_tiny_real", "tiny_test_config", "init_params", "init_cache", "forward",
           "token_logprobs", "Routing", "moe_layer_indices", "count_params", "param_shapes"]


# ---------------------------------------------------------------------------------------------- parameters

def _attention_shapes(config: Ling3Config, kind: str) -> dict:
    """{path tuple: (shape, init kind)} for one attention block."""
    d, h = config.hidden_size, config.num_attention_heads
    out = {}
    if kind == "kda":
        dk, w = config.head_dim, config.short_conv_kernel_size
        pdim = h * dk
        for n in ("q", "k", "v"):
            out[(f"{n}_proj", "kernel")] = ((d, pdim), "linear")
            out[(f"{n}_conv1d", "kernel")] = ((w, pdim), "conv")
        out[("A_log",)] = ((h,), "A_log")
        out[("dt_bias",)] = ((pdim,), "dt_bias")
        out[("b_proj", "kernel")] = ((d, h), "linear")
        for n in ("f", "g"):
            if config.no_kda_lora:
                out[(f"{n}_proj", "kernel")] = ((d, pdim), "linear")
            else:
                out[(f"{n}_a_proj", "kernel")] = ((d, dk), "linear")
                out[(f"{n}_b_proj", "kernel")] = ((dk, pdim), "linear")
        out[("o_norm", "scale")] = ((dk,), "ones")
        out[("o_proj", "kernel")] = ((pdim, d), "linear")
    else:
        dn, dr, dv, r = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
        if config.q_lora_rank is None:
            out[("q_proj", "kernel")] = ((d, h * (dn + dr)), "linear")
        else:
            out[("q_a_proj", "kernel")] = ((d, config.q_lora_rank), "linear")
            out[("q_a_layernorm", "scale")] = ((config.q_lora_rank,), "ones")
            out[("q_b_proj", "kernel")] = ((config.q_lora_rank, h * (dn + dr)), "linear")
        out[("kv_a_proj_with_mqa", "kernel")] = ((d, r + dr), "linear")
        out[("kv_a_layernorm", "scale")] = ((r,), "ones")
        out[("kv_b_proj", "kernel")] = ((r, h * (dn + dv)), "linear")
        gate_out = h if config.gated_attention_proj_granularity_type == "head_wise" else h * dv
        out[("g_proj", "kernel")] = ((d, gate_out), "linear")
        out[("dense", "kernel")] = ((h * dv, d), "linear")
    return out


def _mlp_shapes(config: Ling3Config, moe_layer: bool) -> dict:
    d = config.hidden_size
    if not moe_layer:
        i = config.intermediate_size
        return {("gate_proj", "kernel"): ((d, i), "linear"), ("up_proj", "kernel"): ((d, i), "linear"),
                ("down_proj", "kernel"): ((i, d), "linear")}
    e, im = config.num_experts, config.moe_intermediate_size
    out = {("gate", "kernel"): ((d, e), "router"), ("gate", "expert_bias"): ((e,), "zeros32"),
           ("experts", "gate_proj"): ((e, d, im), "linear"), ("experts", "up_proj"): ((e, d, im), "linear"),
           ("experts", "down_proj"): ((e, im, d), "linear")}
    if config.num_shared_experts > 0:
        s = config.shared_intermediate_size
        out.update({("shared_experts", "gate_proj", "kernel"): ((d, s), "linear"),
                    ("shared_experts", "up_proj", "kernel"): ((d, s), "linear"),
                    ("shared_experts", "down_proj", "kernel"): ((s, d), "linear")})
    return out


def param_shapes(config: Ling3Config) -> dict:
    """Flat {path tuple: (shape, init kind)} of the whole parameter tree."""
    d, v = config.hidden_size, config.vocab_size
    out = {("model", "word_embeddings", "embedding"): ((v, d), "embed")}
    for i, kind in enumerate(config.layer_kinds):
        pre = ("model", f"layers_{i}")
        out[pre + ("input_layernorm", "scale")] = ((d,), "ones")
        out[pre + ("post_attention_layernorm", "scale")] = ((d,), "ones")
        for k, val in _attention_shapes(config, kind).items():
            out[pre + ("attention",) + k] = val
        for k, val in _mlp_shapes(config, config.is_moe_layer(i)).items():
            out[pre + ("mlp",) + k] = val
    out[("model", "norm", "scale")] = ((d,), "ones")
    if not config.tie_word_embeddings:
        out[("lm_head", "kernel")] = ((d, v), "linear")
    return out


_FP32_KINDS = ("A_log", "dt_bias", "conv", "router", "zeros32")


def _leaf_dtype(kind, dtype):
    return np.dtype(np.float32) if kind in _FP32_KINDS else np.dtype(dtype)


def _unflatten(flat: dict) -> dict:
    tree = {}
    for path, val in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = val
    return tree


# Random init in JAX. Every element's value is a function of (key, leaf path, the element's row-major index in
# its leaf) only: the leaf's key is threefry2x32 of two words hashed from the path under the run key, the
# element's bits are threefry2x32(leaf key, index) (exactly `jax.random.bits(leaf_key, shape)` under the
# partitionable threefry, JAX's default; here whatever that flag says), and an elementwise transform turns bits
# into the kind's distribution (`_values`, the float steps of `jax.random.uniform` / `normal`). Nothing depends on
# how a leaf is cut into shards, so a model drawn on 8 devices is bit for bit the one drawn on one, and a leaf's
# values do not change when other leaves come or go (another layer count, a tied head).
#
# Two routes run `_values`:
#   on the devices  one jitted program per (leaf shape, dtype, family, sharding), cached, with `out_shardings` =
#                   the leaf's sharding: each device computes only its own shard (iota and threefry partition
#                   without communication); no host ever holds the leaf. The leaf's scalars are broadcast.
#   on the host     unsharded leaves of small models (at most `HOST_DRAW_MAX` elements): the leaves of a family
#                   laid end to end, `_CHUNK` elements per call of one fixed-shape program (compiled once per
#                   process and family), each element carrying its leaf's key and parameters; the host cuts the
#                   flat values into leaves. XLA:CPU spends ~0.1-0.3 s compiling each per-shape program and a tiny
#                   model has ~20 leaf shapes, which the test suite, building dozens of tiny models, would pay
#                   again and again.
# XLA promises the same float bits only for the same computation: written differently (the families merged into
# one select, or sqrt(2) as a multiply of its own) the two routes did round a last bit apart on CPU.
# tests/test_model.py and tests/test_sharded_io.py compare them.
_NORMAL, _UNIFORM, _CONST = "normal", "uniform", "const"  # transform families
_PLAIN, _LOG, _INV_SOFTPLUS_EXP = 0, 1, 2  # what the uniform family does to its U(p0, p1) draw
_CHUNK = 1 << 16  # elements per call of the host route
HOST_DRAW_MAX = 1 << 22  # models up to this many elements take the host route for their unsharded leaves


def _recipe(kind: str, shape, config: Ling3Config) -> tuple[str, int, float, float]:
    """(family, mode, p0, p1) of an init kind; see `_values`."""
    if kind in ("linear", "embed", "router"):  # N(0, std) = std * sqrt(2) * erf_inv(U(-1, 1))
        return _NORMAL, 0, config.initializer_range * math.sqrt(2.0), 0.0
    if kind == "conv":  # torch's default Conv1d init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = W
        bound = 1.0 / math.sqrt(shape[0])
        return _UNIFORM, _PLAIN, -bound, bound
    if kind == "A_log":  # A ~ U(1, 16)
        return _UNIFORM, _LOG, 1.0, 16.0
    if kind == "dt_bias":  # inverse softplus of dt ~ logU(1e-3, 1e-1)
        return _UNIFORM, _INV_SOFTPLUS_EXP, math.log(1e-3), math.log(1e-1)
    if kind in ("ones", "zeros32"):
        return _CONST, 0, 1.0 if kind == "ones" else 0.0, 0.0
    raise AssertionError(kind)  # pragma: no cover - internal table


def _threefry2x32(k1, k2, x1, x2):
    """Threefry-2x32 (20 rounds; Salmon et al., SC'11), the hash under `jax.random`'s default key, written with
    plain uint32 operators so that one code runs on numpy arrays (no compile) and on traced jax values (equal
    to `jax.extend.random.threefry2x32_p`, which tests/test_model.py checks)."""
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (k1, k2, k1 ^ k2 ^ 0x1BD11BDA)
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x1 = x1 + x2
            x2 = (x2 << r) | (x2 >> (32 - r))
            x2 = x2 ^ x1
        x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + (i + 1)
    return x1, x2


def _leaf_keys(key_data, paths) -> np.ndarray | jax.Array:
    """uint32 [len(paths), 2] threefry keys of leaves: threefry2x32 of two words hashed from each path under the
    run key (64 bits: no two leaves of a model share a key). numpy for a concrete key (no compile), jax for a
    traced one (one vectorised hash for all leaves, so tracing a real-size model stays quick)."""
    words = np.stack([np.frombuffer(hashlib.blake2s("/".join(path).encode(), digest_size=8).digest(), dtype="<u4")
                      for path in paths]).astype(np.uint32)
    xp = np if isinstance(key_data, np.ndarray) else jnp
    key_data = xp.asarray(key_data, np.uint32)
    # [1]-shaped keys: numpy warns on overflowing uint32 scalars (but not arrays), and the hash wraps by design
    k1, k2 = _threefry2x32(key_data[0:1], key_data[1:2], xp.asarray(words[:, 0]), xp.asarray(words[:, 1]))
    return xp.stack([k1, k2], axis=1)


def _flat_index(shape) -> jax.Array:
    """uint32 row-major element index of an array of `shape` (a sum of iotas, so the SPMD partitioner gives
    each device the indices of its own shard without materialising the others)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride)
        stride *= shape[dim]
    return index


def _uniform(bits, lo, hi):
    """U(lo, hi) float32 from 32 random bits, as `jax.random.uniform` makes it (23 mantissa bits in [1, 2))."""
    mantissa = lax.shift_right_logical(bits, jnp.uint32(32 - 23)) | jnp.uint32(0x3F800000)
    u01 = lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0)
    return lax.max(lo, u01 * (hi - lo) + lo)


def _values(k1, k2, index, mode, p0, p1, *, family: str, dtype):
    """`dtype` values of the elements `index` (uint32, any shape) of leaves keyed (k1, k2) (uint32), drawn by
    `family` with `mode` (int32) and p0, p1 (float32); every argument broadcasts against `index` (the device route
    passes one leaf's scalars, the host route an entry per element).

    _NORMAL: p0 * erf_inv(U(-1, 1)) (`jax.random.normal`'s transform, its sqrt(2) folded into p0 on the host:
    one multiply after erf_inv); _UNIFORM: U(p0, p1), its log (`_LOG`) or softplus^-1(max(exp(.), 1e-4))
    (`_INV_SOFTPLUS_EXP`).
    """
    # bits: threefry2x32 of the 64-bit counter (0, index), the two words xored (= jax.random.bits, partitionable)
    b1, b2 = _threefry2x32(k1, k2, jnp.zeros_like(index), index)
    bits = b1 ^ b2
    if family == _NORMAL:
        lo = jnp.float32(np.nextafter(np.float32(-1.0), np.float32(0.0)))
        return (p0 * lax.erf_inv(_uniform(bits, lo, jnp.float32(1.0)))).astype(dtype)
    u = _uniform(bits, p0, p1)
    dt = lax.max(jnp.exp(u), jnp.float32(1e-4))
    out = jnp.where(mode == _LOG, jnp.log(u), u)
    return jnp.where(mode == _INV_SOFTPLUS_EXP, dt + jnp.log(-jnp.expm1(-dt)), out).astype(dtype)


@functools.lru_cache(maxsize=None)
def _leaf_program(shape: tuple[int, ...], dtype, family: str, sharding):
    """The device route: one leaf of `shape` and `dtype` straight onto `sharding` (None: the default device).
    Arguments: the leaf's key uint32 [2], mode int32 [], p0 / p1 float32 []."""

    def draw(leaf_key, mode, p0, p1):
        if family == _CONST:
            return jnp.full(shape, p0, dtype)
        return _values(leaf_key[0], leaf_key[1], _flat_index(shape), mode, p0, p1, family=family, dtype=dtype)

    return jax.jit(draw, out_shardings=sharding)


_chunk_program = jax.jit(_values, static_argnames=("family", "dtype"))  # the host route: [_CHUNK] per argument


def _host_draw(leaves: list) -> list:
    """The host route: numpy values of `leaves` [(leaf key, shape, dtype, (family, mode, p0, p1))]. The leaves of
    each (family, dtype) are laid end to end and drawn `_CHUNK` elements per call, each element carrying its
    leaf's key, mode and parameters and its index in the leaf (the last call's tail is drawn and dropped)."""
    out = [None] * len(leaves)
    groups: dict = {}
    for i, (_, shape, dtype, (family, _, p0, _)) in enumerate(leaves):
        if family == _CONST:
            out[i] = np.full(shape, p0, dtype)
        else:
            groups.setdefault((family, np.dtype(dtype)), []).append(i)
    for (family, dtype), members in groups.items():
        keys = np.stack([leaves[i][0] for i in members]).astype(np.uint32)  # [n, 2]
        mode = np.asarray([leaves[i][3][1] for i in members], np.int32)
        p0, p1 = (np.asarray([leaves[i][3][j] for i in members], np.float32) for j in (2, 3))
        starts = np.cumsum([0] + [math.prod(leaves[i][1]) for i in members])  # leaf j: flat[starts[j]:starts[j+1]]
        flat = np.empty(int(starts[-1]), dtype)
        for begin in range(0, len(flat), _CHUNK):
            pos = begin + np.arange(_CHUNK)
            owner = np.minimum(np.searchsorted(starts, pos, side="right") - 1, len(members) - 1)
            index = (pos - starts[owner]).astype(np.uint32)
            values = _chunk_program(keys[owner, 0], keys[owner, 1], index, mode[owner], p0[owner], p1[owner],
                                    family=family, dtype=dtype)
            flat[begin:begin + _CHUNK] = np.asarray(values)[:len(flat) - begin]
        for j, i in enumerate(members):
            out[i] = flat[starts[j]:starts[j + 1]].reshape(leaves[i][1])
    return out


def _threefry_key_data(key):
    """uint32 [2] data of a threefry key (a typed `jax.random.key` or a raw `jax.random.PRNGKey`)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(key))
        if "threefry2x32" not in impl:
            raise TypeError(f"init_params needs a threefry2x32 key, got a {impl} key")
        key = jax.random.key_data(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise TypeError(f"init_params needs one threefry2x32 key (uint32 [2]), got {key.dtype} {key.shape}")
    return key


def _put(x: np.ndarray, sharding) -> jax.Array:
    """A host array placed on `sharding` (each device, of every process, gets its own slice)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _flat_shardings(shardings, paths) -> dict:
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, prefix + (k,))
        else:
            flat[prefix] = node

    walk(shardings, ())
    if set(flat) != set(paths):
        missing, extra = sorted(set(paths) - set(flat)), sorted(set(flat) - set(paths))
        raise ValueError(f"shardings do not match the parameters: missing {['/'.join(p) for p in missing][:5]}, "
                         f"unexpected {['/'.join(p) for p in extra][:5]}")
    return flat


def init_params(config: Ling3Config, key: jax.Array, dtype=jnp.float32, shardings=None, *,
                host_draw_max: int = HOST_DRAW_MAX) -> dict:
    """Random parameters (HF-style init: N(0, initializer_range) linears and embeddings, unit norms, zero
    expert_bias, A = exp(A_log) ~ U(1, 16), dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1), short-conv
    kernels U(-1/sqrt(W), 1/sqrt(W))), drawn with JAX's threefry; see the comment above `_NORMAL` for what each
    value depends on (the key, the leaf's path, the element's index: never the mesh).

    key: a threefry key (`jax.random.PRNGKey` / `jax.random.key`). shardings: None (the default device) or a
    params tree of `jax.sharding.Sharding` (`parallel.Layout.param_shardings`): every leaf is created on its
    sharding, each device computing only its own shard (a jitted program per leaf shape and sharding), so no
    device and no host ever holds a whole real-size model. Unsharded leaves of models of at most
    `host_draw_max` elements are drawn by one fixed-shape program on the default device and cut into leaves on
    the host, which needs one compile per process instead of one per leaf shape (0: every leaf on its devices;
    same values either way). Under `jax.jit` / `jax.eval_shape` (a traced key) every leaf takes the device
    route, so `jax.eval_shape` gives the shapes and dtypes without drawing anything.
    Returns the nested dict described in the module docstring.
    """
    items = sorted(param_shapes(config).items())
    flat_shardings = {} if shardings is None else _flat_shardings(shardings, [p for p, _ in items])
    key_data = _threefry_key_data(key)
    try:
        concrete = np.asarray(key_data)
    except jax.errors.TracerArrayConversionError:
        concrete = None
    small = concrete is not None and sum(math.prod(shape) for _, (shape, _) in items) <= host_draw_max
    leaves, on_host = {}, []
    # host data when the key is concrete: a multi-process program takes it as one value for every process
    keys = _leaf_keys(key_data if concrete is None else concrete, [path for path, _ in items])
    for (path, (shape, kind)), leaf_key in zip(items, keys):
        if math.prod(shape) >= 2**32:  # pragma: no cover - far beyond any Ling-3.0 leaf
            raise ValueError(f"{'/'.join(path)} has {math.prod(shape)} elements; the init counts them in 32 bits")
        leaf_dtype, sharding = _leaf_dtype(kind, dtype), flat_shardings.get(path)
        family, mode, p0, p1 = recipe = _recipe(kind, shape, config)
        if small and (sharding is None or sharding.is_fully_replicated):
            on_host.append((path, sharding, (leaf_key, shape, leaf_dtype, recipe)))
        else:
            program = _leaf_program(tuple(shape), leaf_dtype, family, sharding)
            leaves[path] = program(leaf_key, np.int32(mode), np.float32(p0), np.float32(p1))
    for (path, sharding, _), x in zip(on_host, _host_draw([leaf for *_, leaf in on_host])):
        leaves[path] = jnp.asarray(x) if sharding is None else _put(x, sharding)
    return _unflatten({path: leaves[path] for path, _ in items})


def count_params(config: Ling3Config) -> dict:
    """{'total': all parameters, 'active': parameters used per token (top-k routed + shared experts),
    'embedding': embedding + lm_head}, from shapes only."""
    total = active = 0
    k, e = config.num_experts_per_tok, config.num_experts
    for path, (shape, _) in param_shapes(config).items():
        n = math.prod(shape)
        total += n
        active += n * k // e if "experts" in path and "shared_experts" not in path else n
    emb = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return {"total": total, "active": active, "embedding": emb}


# ---------------------------------------------------------------------------------------------- cache

def init_cache(config: Ling3Config, batch_size: int, max_length: int, dtype=jnp.float32) -> dict:
    """Empty decode cache for `batch_size` rows of up to `max_length` tokens (see module docstring)."""
    b, h, dk = batch_size, config.num_attention_heads, config.head_dim
    w = config.short_conv_kernel_size
    layers = []
    for kind in config.layer_kinds:
        if kind == "kda":
            conv = jnp.zeros((b, w - 1, h * dk), dtype)
            layers.append({"q_conv": conv, "k_conv": conv, "v_conv": conv,
                           "state": jnp.zeros((b, h, dk, dk), jnp.float32)})
        else:
            layers.append({"latent": jnp.zeros((b, max_length, config.kv_lora_rank), dtype),
                           "k_rope": jnp.zeros((b, max_length, config.qk_rope_head_dim), dtype)})
    return {"length": jnp.zeros((b,), jnp.int32), "layers": tuple(layers)}


# ---------------------------------------------------------------------------------------------- forward

def _check_inputs(params, config, input_ids, cache, valid):
    if not isinstance(config, Ling3Config):
        raise TypeError(f"config must be a Ling3Config, got {type(config).__name__}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
    if valid is not None and valid.shape != input_ids.shape:
        raise ValueError(f"valid must have the shape of input_ids {input_ids.shape}, got {valid.shape}")
    if cache is not None:
        if len(cache["layers"]) != config.num_hidden_layers:
            raise ValueError(f"cache has {len(cache['layers'])} layers, config {config.num_hidden_layers}")
        if cache["length"].shape != (input_ids.shape[0],):
            raise ValueError(f"cache['length'] must be [B={input_ids.shape[0]}], got {cache['length'].shape}")
    missing = [f"layers_{i}" for i in range(config.num_hidden_layers) if f"layers_{i}" not in params["model"]]
    if missing:
        raise ValueError(f"params lack decoder layers {missing}")


def moe_layer_indices(config: Ling3Config) -> tuple:
    """Decoder-layer indices of the MoE layers, in order; axis 2 of routing arrays follows this order."""
    return tuple(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))


class Routing(NamedTuple):
    """Expert choices of a forward, int32 [B, T, n_moe, K] (n_moe = len(moe_layer_indices), K = experts per
    token); -1 at positions where `valid` is False.

    experts: the experts each token was sent to (the replayed ids where replay applied, else the router's own).
    own: the router's own top-k, whatever was replayed (what normal routing would have picked given this
      forward's hidden states).
    """

    experts: jax.Array
    own: jax.Array


def _decoder_layer(p: dict, x: jax.Array, lc, valid, positions, length, replay=None, *, config: Ling3Config,
                   index: int, return_routing: bool = False):
    """One pre-norm decoder layer: x -> (x + attention, + MLP), the layer's new cache, and for MoE layers with
    `return_routing` the (used, own) expert ids [B, T, K] (else None). replay: int [B, T, K] or None."""
    eps = config.rms_norm_eps
    hn = rms_norm(x, p["input_layernorm"]["scale"], eps)
    if config.layer_kinds[index] == "kda":
        a, lc = kda_attention(p["attention"], hn, config, valid, lc)
    else:
        a, lc = mla_attention(p["attention"], hn, config, valid, positions, lc, length)
    x = x + a
    hn = rms_norm(x, p["post_attention_layernorm"]["scale"], eps)
    routing = None
    if not config.is_moe_layer(index):
        y = swiglu_mlp(p["mlp"], hn)
    elif return_routing:
        y, used, own = moe(p["mlp"], hn, config, replay=replay, return_routing=True)
        routing = (used, own)
    else:
        y = moe(p["mlp"], hn, config, replay=replay)
    return x + y, lc, routing


def forward(params: dict, config: Ling3Config, input_ids: jax.Array, cache: dict | None = None, *,
            valid: jax.Array | None = None, return_hidden: bool = False, remat: bool = False,
            replay_experts: jax.Array | None = None, return_routing: bool = False):
    """Causal LM forward.

    input_ids: [B, T] int; valid: [B, T] bool, a left-aligned prefix of real tokens per row (default all True).
    Without cache, positions are 0..T-1. With cache, token t of row b sits at position cache['length'][b] + t and
    the returned cache has length + valid.sum(1); invalid tokens never change any state (their logits are garbage).
    Returns (logits [B, T, V] float32, new cache or None); with return_hidden=True a third element
    hidden [L+1, B, T, D]: index 0 the embeddings, index i+1 the residual stream after layer i (before the final norm).
    remat=True wraps each decoder layer in `jax.checkpoint`: under autodiff only the layers' inputs are kept and
    the rest is recomputed in the backward pass (activation memory of one layer instead of all; same values).

    Routing replay: replay_experts int [B, T, n_moe, K] (any int dtype) makes token t of MoE layer j use the
    experts replay_experts[:, t, j] instead of its own top-k, with gate weights recomputed from the current
    router (see `layers.route`); a (token, layer) with a negative entry (-1) is routed normally.
    return_routing=True appends a `Routing` (used and own expert ids per token and MoE layer) as the last
    element of the returned tuple. Without replay the computation is exactly the plain forward.
    """
    input_ids = jnp.asarray(input_ids)
    _check_inputs(params, config, input_ids, cache, valid)
    b, t = input_ids.shape
    moe_layers = moe_layer_indices(config)
    k = config.num_experts_per_tok
    if replay_experts is not None and replay_experts.shape != (b, t, len(moe_layers), k):
        raise ValueError(f"replay_experts must be [B={b}, T={t}, n_moe={len(moe_layers)}, K={k}], "
                         f"got {replay_experts.shape}")
    valid = jnp.ones((b, t), jnp.bool_) if valid is None else jnp.asarray(valid, jnp.bool_)
    length = None if cache is None else cache["length"].astype(jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)[None, :] + (0 if length is None else length[:, None])
    positions = jnp.broadcast_to(positions, (b, t))

    # On a mesh, chunks of more than one token (training, prefill) keep their rows split over the batch axes and
    # every other dimension whole between layers and in the logits, so GSPMD gathers each layer's (fsdp-split)
    # weights instead of splitting the matmuls along the hidden size and reducing activations as large as the
    # [B, T, V] logits. A decode step (T = 1) is left to propagation: there the weights stay where they are and
    # the few rows' partial products are reduced, far less traffic than gathering every weight at every step.
    # Without a mesh: the identity.
    rows = hints.constrain_rows if t > 1 else (lambda v: v)
    m = params["model"]
    x = jnp.take(m["word_embeddings"]["embedding"], input_ids, axis=0)
    x = rows(hints.after_lookup(x, ("model", "word_embeddings", "embedding")))
    eps = config.rms_norm_eps
    hidden = [x]
    new_layers = []
    used, own = [], []
    for i in range(config.num_hidden_layers):
        layer = functools.partial(_decoder_layer, config=config, index=i, return_routing=return_routing)
        if remat:  # keep only each layer's input for the backward pass; recompute the rest
            layer = jax.checkpoint(layer)
        lc = None if cache is None else cache["layers"][i]
        replay = None
        if replay_experts is not None and config.is_moe_layer(i):
            replay = replay_experts[:, :, moe_layers.index(i)]
        x, lc, routing = layer(m[f"layers_{i}"], x, lc, valid, positions, length, replay)
        x = rows(x)
        if routing is not None:
            used.append(routing[0])
            own.append(routing[1])
        new_layers.append(lc)
        hidden.append(x)

    xn = rms_norm(x, m["norm"]["scale"], eps)
    if config.tie_word_embeddings:
        head = m["word_embeddings"]["embedding"].T
    else:
        head = params["lm_head"]["kernel"]
    logits = rows(einsum_f32("btd,dv->btv", xn, head.astype(xn.dtype)))

    new_cache = None
    if cache is not None:
        new_cache = {"length": length + valid.sum(axis=1).astype(jnp.int32), "layers": tuple(new_layers)}
    out = (logits, new_cache)
    if return_hidden:
        out += (jnp.stack(hidden),)
    if return_routing:
        def stack(ids):  # n_moe x [B, T, K] -> [B, T, n_moe, K], -1 on invalid tokens
            if not ids:
                return jnp.zeros((b, t, 0, k), jnp.int32)
            return jnp.where(valid[:, :, None, None], jnp.stack(ids, axis=2), -1)
        out += (Routing(experts=stack(used), own=stack(own)),)
    return out


def token_logprobs(params: dict, config: Ling3Config, tokens: jax.Array, valid: jax.Array | None = None,
                   replay_experts: jax.Array | None = None):
    """logp [B, L] float32 with logp[:, t] = log p(tokens[:, t] | tokens[:, :t]); logp[:, 0] = 0 and 0 wherever
    `valid` is False. replay_experts: optional int [B, L, n_moe, K] routing to replay (see `forward`)."""
    logits, _ = forward(params, config, tokens, valid=valid, replay_experts=replay_experts)
    logits = logits[:, :-1].astype(jnp.float32)
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp], axis=1)
    if valid is not None:
        logp = jnp.where(valid, logp, 0.0)
    return logp
