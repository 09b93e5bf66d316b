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
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.models.config import Ling3Config, ling3_tiny_real, tiny_test_config  # noqa: F401 (re-export)
from reno_jax.models.kda import kda_attention
from reno_jax.models.layers import embed, head_logits, moe, rms_norm, swiglu_mlp
from reno_jax.models.mla import mla_attention
from reno_jax.sharding import hints

__all__ = [
    "Ling3Config",
    "ling3_tiny_real",
    "tiny_test_config",
    "init_params",
    "init_cache",
    "forward",
    "token_logprobs",
    "Routing",
    "moe_layer_indices",
    "count_params",
    "param_shapes",
]


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
        return {
            ("gate_proj", "kernel"): ((d, i), "linear"),
            ("up_proj", "kernel"): ((d, i), "linear"),
            ("down_proj", "kernel"): ((i, d), "linear"),
        }
    e, im = config.num_experts, config.moe_intermediate_size
    out = {
        ("gate", "kernel"): ((d, e), "router"),
        ("gate", "expert_bias"): ((e,), "zeros32"),
        ("experts", "gate_proj"): ((e, d, im), "linear"),
        ("experts", "up_proj"): ((e, d, im), "linear"),
        ("experts", "down_proj"): ((e, im, d), "linear"),
    }
    if config.num_shared_experts > 0:
        s = config.shared_intermediate_size
        out.update(
            {
                ("shared_experts", "gate_proj", "kernel"): ((d, s), "linear"),
                ("shared_experts", "up_proj", "kernel"): ((d, s), "linear"),
                ("shared_experts", "down_proj", "kernel"): ((s, d), "linear"),
            }
        )
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


# Random init with `jax.random`. Leaf i of the path-sorted parameter list (`param_shapes`) draws from
# `jax.random.fold_in(key, i)` with `jax.random.normal` / `uniform` in float32 (then transformed per kind and cast
# to the leaf's dtype), so a value depends on the key, the leaf's index and the element's position only. Under JAX's
# partitionable threefry (`jax_threefry_partitionable`, the default) an element's random bits are a function of
# the key and the element's row-major index alone: they depend neither on how the leaf is cut into shards (a model
# drawn onto a mesh, each device computing only its own shard, is bit for bit the one drawn on one device) nor on
# the shape the leaf is drawn as (a flat draw of more elements, cut to the leaf's and reshaped, gives its values).
#
# Two routes run `_draw` (tests/test_model.py and tests/test_sharded_io.py compare them):
#   per leaf     (`_leaf_program`) a jitted program for one leaf, its output on the leaf's sharding, cached by
#                (shape, family, dtype, sharding): leaves of one shape share a compile, no program holds more than
#                one leaf. Sharded models, large unsharded ones, and any model under a trace (`jax.eval_shape`).
#   whole model  (`_draw_model`) unsharded models with a concrete key, up to `_MODEL_PROGRAM_MAX` padded elements:
#                the normal leaves, then the uniform ones, `_ROWS` at a time, vmapped over their keys and each drawn
#                flat at a power-of-two size (`_block_program`); the host cuts the blocks into leaves. XLA:CPU
#                spends ~0.3 s compiling each random draw: the per-leaf route would compile ~20 for a tiny model
#                (and the test suite builds dozens), this one three, shared by models of similar sizes.
# Both pass a leaf's index and distribution parameters as arguments, so they run the same operations on them.
_MODEL_PROGRAM_MAX = 1 << 22  # padded elements up to which an unsharded model takes the whole-model route
_ROWS = 32  # leaves per block of the whole-model route
_NORMAL_KINDS = ("linear", "embed", "router")
_RANDOM_KINDS = _NORMAL_KINDS + ("conv", "A_log", "dt_bias")
_PLAIN, _LOG, _INV_SOFTPLUS_EXP = 0, 1, 2  # what a uniform leaf does to its U(p0, p1) draw


def _init_args(kind: str, shape, config: Ling3Config) -> tuple[float, float, int]:
    """(p0, p1, mode) of a leaf: N(0, p0) for the normal kinds; U(p0, p1) for the uniform ones, then `mode`;
    the constant p0 else."""
    if kind in _NORMAL_KINDS:  # N(0, initializer_range)
        return float(config.initializer_range), 0.0, _PLAIN
    if kind == "conv":  # torch's default Conv1d init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = W
        bound = 1.0 / math.sqrt(shape[0])
        return -bound, bound, _PLAIN
    if kind == "A_log":  # A = exp(A_log) ~ U(1, 16)
        return 1.0, 16.0, _LOG
    if kind == "dt_bias":  # inverse softplus of dt ~ logU(1e-3, 1e-1), dt clamped at 1e-4
        return math.log(1e-3), math.log(1e-1), _INV_SOFTPLUS_EXP
    if kind in ("ones", "zeros32"):
        return (1.0 if kind == "ones" else 0.0), 0.0, _PLAIN
    raise AssertionError(kind)  # pragma: no cover - internal table


def _draw(normal: bool, key, shape, p0, p1, mode) -> jax.Array:
    """float32 values of a random leaf of `shape` from its key: p0 * N(0, 1) (`normal`), else U(p0, p1), its log
    (`_LOG`) or softplus^-1(max(exp(.), 1e-4)) (`_INV_SOFTPLUS_EXP`)."""
    if normal:
        return p0 * jax.random.normal(key, shape, jnp.float32)
    u = jax.random.uniform(key, shape, jnp.float32, p0, p1)
    dt = jnp.maximum(jnp.exp(u), 1e-4)
    return jnp.where(mode == _LOG, jnp.log(u), jnp.where(mode == _INV_SOFTPLUS_EXP, dt + jnp.log(-jnp.expm1(-dt)), u))


def _leaf_key(key_data, impl: str | None, index):
    """Leaf `index`'s key: `fold_in` of the run key rebuilt from its data (`impl` None: JAX's default)."""
    return jax.random.fold_in(jax.random.wrap_key_data(key_data, impl=impl), index)


@functools.lru_cache(maxsize=None)
def _leaf_program(shape: tuple[int, ...], normal: bool | None, dtype, sharding, impl: str | None):
    """The per-leaf route: `draw(key_data, index uint32, p0 float32, p1 float32, mode int32) -> leaf` on `sharding`
    (None: the default device). `normal` None: the constant p0."""

    def draw(key_data, index, p0, p1, mode):
        if normal is None:
            return jnp.full(shape, p0, jnp.float32).astype(dtype)
        return _draw(normal, _leaf_key(key_data, impl, index), shape, p0, p1, mode).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _keys_program(impl: str | None):
    """The whole-model route's keys: `keys(key_data, indices uint32 [_ROWS]) -> key data [_ROWS, ...]`."""
    return jax.jit(jax.vmap(lambda key_data, i: jax.random.key_data(_leaf_key(key_data, impl, i)), (None, 0)))


@functools.lru_cache(maxsize=None)
def _block_program(normal: bool, size: int, dtypes: tuple, impl: str | None):
    """The whole-model route's draw: `draw(keys [_ROWS, ...], p0, p1 float32 [_ROWS], mode int32 [_ROWS])
    -> {dtype name: block [_ROWS, size]}`, row r the first `size` values of the leaf keyed keys[r]."""

    def draw(keys, p0, p1, mode):
        flat = jax.vmap(lambda k, a, b, m: _draw(normal, jax.random.wrap_key_data(k, impl=impl), (size,), a, b, m))(
            keys, p0, p1, mode
        )
        return {d: flat.astype(d) for d in dtypes}

    return jax.jit(draw)


def _draw_model(specs, key_data: np.ndarray, impl, p0, p1, mode) -> list | None:
    """The whole-model route: every leaf of `specs` (shape, kind, dtype) as a device array, or None when the model
    is too large for it. The random leaves are drawn `_ROWS` at a time, normal and uniform ones apart, each block at
    the power of two at or above its largest leaf's size (so that models of similar sizes share the programs)."""
    values = [None] * len(specs)
    blocks = []
    for normal in (True, False):
        members = [
            j for j, (_, kind, _) in enumerate(specs) if kind in _RANDOM_KINDS and (kind in _NORMAL_KINDS) == normal
        ]
        for start in range(0, len(members), _ROWS):
            rows = members[start : start + _ROWS]
            size = 1 << max(max(math.prod(specs[j][0]) for j in rows) - 1, 0).bit_length()
            blocks.append((normal, size, rows))
    if sum(_ROWS * size for _, size, _ in blocks) > _MODEL_PROGRAM_MAX:
        return None
    for normal, size, rows in blocks:
        padded = np.asarray(rows + [rows[0]] * (_ROWS - len(rows)))  # unused rows repeat the first leaf
        keys = _keys_program(impl)(key_data, padded.astype(np.uint32))
        dtypes = tuple(sorted({specs[j][2].name for j in rows}))
        block = jax.device_get(_block_program(normal, size, dtypes, impl)(keys, p0[padded], p1[padded], mode[padded]))
        for r, j in enumerate(rows):
            shape, _, dtype = specs[j]
            values[j] = jnp.asarray(block[dtype.name][r, : math.prod(shape)].reshape(shape))
    for j, (shape, kind, dtype) in enumerate(specs):
        if values[j] is None:  # the constant leaves
            values[j] = jnp.asarray(np.full(shape, p0[j], dtype))
    return values


def _key_data(key) -> tuple[jax.Array, str | None]:
    """(key data, implementation name or None for the default) of a typed `jax.random.key` or a raw
    `jax.random.PRNGKey`."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise TypeError(f"init_params needs one key, got keys of shape {key.shape}")
        return jax.random.key_data(key), str(jax.random.key_impl(key))
    return key, None


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
        raise ValueError(
            f"shardings do not match the parameters: missing {['/'.join(p) for p in missing][:5]}, "
            f"unexpected {['/'.join(p) for p in extra][:5]}"
        )
    return flat


def init_params(config: Ling3Config, key: jax.Array, dtype=jnp.float32, shardings=None, leaf_transform=None) -> dict:
    """Random parameters (HF-style init: N(0, initializer_range) linears and embeddings, unit norms, zero
    expert_bias, A = exp(A_log) ~ U(1, 16), dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1), short-conv
    kernels U(-1/sqrt(W), 1/sqrt(W))), drawn with `jax.random`: leaf i of the path-sorted parameter list from
    `jax.random.fold_in(key, i)`. A value depends on the key, the leaf's index and its position in the leaf only:
    never on the mesh (see the comment above `_draw`); adding or removing leaves (layers, a tied head) moves the
    index, and so the values, of the leaves sorted after them.

    key: a `jax.random.key` or a raw `jax.random.PRNGKey`. shardings: None (the default device) or a params tree
    of `jax.sharding.Sharding` (`parallel.Layout.param_shardings`): every leaf is created on its sharding by a
    jitted program of its own, each device computing only its own shard, so no device and no host ever holds a
    whole real-size model; the values are those of the one-device init, bit for bit. Under `jax.jit` /
    `jax.eval_shape` (a traced key) every leaf takes the per-leaf route, so `jax.eval_shape` gives the shapes and
    dtypes without drawing anything. leaf_transform: `fn(path, value) -> leaf`, applied to each leaf right after
    it is drawn (the per-leaf route; e.g. int8-quantize the real model leaf by leaf, never holding it in bf16).
    Returns the nested dict described in the module docstring.
    """
    items = sorted(param_shapes(config).items())
    paths = [path for path, _ in items]
    specs = [(tuple(shape), kind, _leaf_dtype(kind, dtype)) for _, (shape, kind) in items]
    p0, p1, mode = (
        np.asarray(x, t)
        for x, t in zip(
            zip(*(_init_args(kind, shape, config) for _, (shape, kind) in items)), (np.float32, np.float32, np.int32)
        )
    )
    key_data, impl = _key_data(key)
    try:  # host data when the key is concrete: a multi-process program takes it as one value for every process
        key_data = np.asarray(key_data)
    except jax.errors.TracerArrayConversionError:
        key_data = jnp.asarray(key_data)
    values = None
    if shardings is None and leaf_transform is None and isinstance(key_data, np.ndarray):
        values = _draw_model(specs, key_data, impl, p0, p1, mode)
    if values is None:
        flat_shardings = {} if shardings is None else _flat_shardings(shardings, paths)
        values = []
        for i, (path, (shape, kind, leaf_dtype)) in enumerate(zip(paths, specs)):
            normal = None if kind not in _RANDOM_KINDS else kind in _NORMAL_KINDS
            program = _leaf_program(shape, normal, leaf_dtype, flat_shardings.get(path), impl)
            value = program(key_data, np.uint32(i), p0[i], p1[i], mode[i])
            values.append(value if leaf_transform is None else leaf_transform(path, value))
    return _unflatten(dict(zip(paths, values)))


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
            layers.append(
                {"q_conv": conv, "k_conv": conv, "v_conv": conv, "state": jnp.zeros((b, h, dk, dk), jnp.float32)}
            )
        else:
            layers.append(
                {
                    "latent": jnp.zeros((b, max_length, config.kv_lora_rank), dtype),
                    "k_rope": jnp.zeros((b, max_length, config.qk_rope_head_dim), dtype),
                }
            )
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


@flax.struct.dataclass
class Routing:
    """Expert choices of a forward, int32 [B, T, n_moe, K] (n_moe = len(moe_layer_indices), K = experts per
    token); -1 at positions where `valid` is False.

    experts: the experts each token was sent to (the replayed ids where replay applied, else the router's own).
    own: the router's own top-k, whatever was replayed (what normal routing would have picked given this
      forward's hidden states).
    """

    experts: jax.Array
    own: jax.Array


TIE_WEIGHTS_MIN_BYTES = 1 << 20  # a layer's weights from this size on pass through a barrier with its input


def _tree_bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _decoder_layer(
    p: dict,
    x: jax.Array,
    lc,
    valid,
    positions,
    length,
    replay=None,
    *,
    config: Ling3Config,
    index: int,
    return_routing: bool = False,
):
    """One pre-norm decoder layer: x -> (x + attention, + MLP), the layer's new cache, and for MoE layers with
    `return_routing` the (used, own) expert ids [B, T, K] (else None). replay: int [B, T, K] or None."""
    eps = config.rms_norm_eps
    # Tie this layer's weights to its input: whatever XLA derives from them (an int8 base's dequantized copy, a
    # transposed expert stack for the backward pass) then depends on this layer's activations, so it cannot be
    # hoisted out of an enclosing loop (decode steps, micro-batches) or scheduled early, where every layer's
    # derived copies would be live at once (a 24-layer int8 base: 14+ GB of bf16 expert stacks). Values unchanged.
    # Only for layers large enough for such copies to matter: on a small model the barrier only costs fusions.
    if _tree_bytes(p) >= TIE_WEIGHTS_MIN_BYTES:
        p = jax.lax.optimization_barrier((p, x))[0]
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


def _checked_replay(replay_experts, b: int, t: int, n_moe: int, k: int):
    """replay_experts as given, after checking it is [B, T, n_moe, K] (None passes)."""
    if replay_experts is not None and replay_experts.shape != (b, t, n_moe, k):
        raise ValueError(f"replay_experts must be [B={b}, T={t}, n_moe={n_moe}, K={k}], got {replay_experts.shape}")
    return replay_experts


def _token_positions(b: int, t: int, length: jax.Array | None) -> jax.Array:
    """int32 [B, T]: 0..T-1 without a cache, else row b's tokens start at its cache length `length[b]`."""
    positions = jnp.arange(t, dtype=jnp.int32)[None, :] + (0 if length is None else length[:, None])
    return jnp.broadcast_to(positions, (b, t))


def _activation_layout(t: int):
    """The sharding hint applied to activations between layers and to the logits, for a chunk of `t` tokens.

    On a mesh, chunks of more than one token (training, prefill) keep their rows split over the batch axes and
    every other dimension whole between layers and in the logits, so GSPMD gathers each layer's (fsdp-split)
    weights instead of splitting the matmuls along the hidden size and reducing activations as large as the
    [B, T, V] logits. A decode step (T = 1) is left to propagation: there the weights stay where they are and
    the few rows' partial products are reduced, far less traffic than gathering every weight at every step.
    Without a mesh: the identity.
    """
    return hints.constrain_rows if t > 1 else (lambda v: v)


def _run_decoder_layers(
    m: dict, config: Ling3Config, x, cache, valid, positions, length, rows, *, remat, replay_experts, return_routing
):
    """The decoder stack over embeddings x [B, T, D].

    Returns (x after the last layer, hidden: [embeddings, then each layer's output], the layers' new caches,
    used, own: per MoE layer the expert ids [B, T, K] when return_routing, else empty lists).
    """
    moe_layers = moe_layer_indices(config)
    hidden, new_layers, used, own = [x], [], [], []
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
    return x, hidden, new_layers, used, own


def _final_norm_and_head(params: dict, config: Ling3Config, x, rows, apply_head: bool):
    """The final norm of x [B, T, D], then with apply_head the logits [B, T, V] float32, else the normed x."""
    xn = rms_norm(x, params["model"]["norm"]["scale"], config.rms_norm_eps)
    if not apply_head:
        return xn
    head = lm_head(params, config)
    if _tree_bytes(head) >= TIE_WEIGHTS_MIN_BYTES:  # as in `_decoder_layer`
        head = jax.lax.optimization_barrier((head, xn))[0]
    return rows(head_logits(xn, head))


def _stack_routing(ids: list, valid, b: int, t: int, k: int) -> jax.Array:
    """n_moe x [B, T, K] -> [B, T, n_moe, K], -1 on invalid tokens."""
    if not ids:
        return jnp.zeros((b, t, 0, k), jnp.int32)
    return jnp.where(valid[:, :, None, None], jnp.stack(ids, axis=2), -1)


def forward(
    params: dict,
    config: Ling3Config,
    input_ids: jax.Array,
    cache: dict | None = None,
    *,
    valid: jax.Array | None = None,
    return_hidden: bool = False,
    remat: bool = False,
    replay_experts: jax.Array | None = None,
    return_routing: bool = False,
    apply_head: bool = True,
):
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

    apply_head=False: the first element is the final-normed hidden state [B, T, D] (compute dtype) instead of the
    logits; `head_logits(hidden, lm_head(params, config))` gives the logits (a caller scoring a long sequence
    can then compute them a chunk of positions at a time).
    """
    input_ids = jnp.asarray(input_ids)
    _check_inputs(params, config, input_ids, cache, valid)
    b, t = input_ids.shape
    k = config.num_experts_per_tok
    replay_experts = _checked_replay(replay_experts, b, t, len(moe_layer_indices(config)), k)
    valid = jnp.ones((b, t), jnp.bool_) if valid is None else jnp.asarray(valid, jnp.bool_)
    length = None if cache is None else cache["length"].astype(jnp.int32)
    positions = _token_positions(b, t, length)

    rows = _activation_layout(t)
    x = embed(params["model"]["word_embeddings"]["embedding"], input_ids)
    x = rows(hints.after_lookup(x, ("model", "word_embeddings", "embedding")))
    x, hidden, new_layers, used, own = _run_decoder_layers(
        params["model"],
        config,
        x,
        cache,
        valid,
        positions,
        length,
        rows,
        remat=remat,
        replay_experts=replay_experts,
        return_routing=return_routing,
    )
    logits = _final_norm_and_head(params, config, x, rows, apply_head)

    new_cache = None
    if cache is not None:
        new_cache = {"length": length + valid.sum(axis=1).astype(jnp.int32), "layers": tuple(new_layers)}
    out = (logits, new_cache)
    if return_hidden:
        out += (jnp.stack(hidden),)
    if return_routing:
        out += (Routing(experts=_stack_routing(used, valid, b, t, k), own=_stack_routing(own, valid, b, t, k)),)
    return out


def lm_head(params: dict, config: Ling3Config):
    """The output projection [D, V]: the lm_head kernel, or the transposed embedding table when tied (either may
    be a `lora.LoraKernel` or a `quant.QArray`; `layers.head_logits` takes all of them)."""
    if config.tie_word_embeddings:
        return params["model"]["word_embeddings"]["embedding"].T
    return params["lm_head"]["kernel"]


def token_logprobs(
    params: dict,
    config: Ling3Config,
    tokens: jax.Array,
    valid: jax.Array | None = None,
    replay_experts: jax.Array | None = None,
):
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
