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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.models.config import Ling3Config, ling3_tiny_real, tiny_test_config  # noqa: F401 (re-export)
from reno_jax.models.kda import kda_attention
from reno_jax.models.layers import einsum_f32, moe, rms_norm, swiglu_mlp
from reno_jax.models.mla import mla_attention

__all__ = ["Ling3Config", "ling3_tiny_real", "tiny_test_config", "init_params", "init_cache", "forward",
           "token_logprobs", "Routing", "moe_layer_indices", "from_pretrained", "save_pretrained", "count_params", "param_shapes"]


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


def _init_leaf(rng: np.random.Generator, shape, kind, config: Ling3Config, dtype) -> np.ndarray:
    std = config.initializer_range
    if kind == "ones":
        x = np.ones(shape, np.float32)
    elif kind == "zeros32":
        x = np.zeros(shape, np.float32)
    elif kind in ("linear", "embed", "router"):
        x = std * rng.standard_normal(shape, dtype=np.float32)
    elif kind == "conv":  # torch's default Conv1d init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = W
        bound = 1.0 / math.sqrt(shape[0])
        x = rng.uniform(-bound, bound, shape).astype(np.float32)
    elif kind == "A_log":  # A ~ U(1, 16)
        x = np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    elif kind == "dt_bias":  # inverse softplus of dt ~ logU(1e-3, 1e-1)
        dt = np.maximum(np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape)), 1e-4)
        x = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    else:  # pragma: no cover - internal table
        raise AssertionError(kind)
    return x if kind in _FP32_KINDS else x.astype(dtype)


def _leaf_dtype(kind, dtype):
    return np.dtype(np.float32) if kind in _FP32_KINDS else np.dtype(dtype)


def _host_init(config: Ling3Config, key_data: np.ndarray, dtype) -> list:
    """numpy leaves in sorted-path order, from a Generator seeded with the key's bits."""
    rng = np.random.default_rng(np.random.SeedSequence([int(v) for v in np.asarray(key_data).ravel()]))
    return [_init_leaf(rng, shape, kind, config, dtype) for _, (shape, kind) in sorted(param_shapes(config).items())]


def _unflatten(flat: dict) -> dict:
    tree = {}
    for path, val in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = val
    return tree


def init_params(config: Ling3Config, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters (HF-style init: N(0, initializer_range) linears and embeddings, unit norms, zero
    expert_bias, A = exp(A_log) ~ U(1, 16), dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1)).

    The values come from a numpy Generator seeded with the key's bits, on the host: XLA:CPU needs tens of seconds
    to compile ~100 differently shaped jax.random calls, numpy needs milliseconds. Under jit the same host code
    runs through `jax.pure_callback` (same values); under `jax.eval_shape` nothing is generated.
    Returns the nested dict described in the module docstring.
    """
    items = sorted(param_shapes(config).items())
    key_data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    try:
        concrete = np.asarray(key_data)
    except jax.errors.TracerArrayConversionError:
        out_types = [jax.ShapeDtypeStruct(shape, _leaf_dtype(kind, dtype)) for _, (shape, kind) in items]
        leaves = jax.pure_callback(lambda kd: _host_init(config, kd, dtype), out_types, key_data)
    else:
        leaves = [jnp.asarray(x) for x in _host_init(config, concrete, dtype)]
    return _unflatten({path: leaf for (path, _), leaf in zip(items, leaves)})


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

    from reno_jax.parallel import constraints  # noqa: PLC0415 (parallel imports the models package)
    # On a mesh, chunks of more than one token (training, prefill) keep their rows split over the batch axes and
    # every other dimension whole between layers and in the logits, so GSPMD gathers each layer's (fsdp-split)
    # weights instead of splitting the matmuls along the hidden size and reducing activations as large as the
    # [B, T, V] logits. A decode step (T = 1) is left to propagation: there the weights stay where they are and
    # the few rows' partial products are reduced, far less traffic than gathering every weight at every step.
    # Without a mesh: the identity.
    rows = constraints.constrain_rows if t > 1 else (lambda v: v)
    m = params["model"]
    x = jnp.take(m["word_embeddings"]["embedding"], input_ids, axis=0)
    x = rows(constraints.after_lookup(x, ("model", "word_embeddings", "embedding")))
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


# ---------------------------------------------------------------------------------------------- checkpoints

def from_pretrained(*args, **kwargs):
    """(config, params) from a HF checkpoint directory; see reno_jax.models.conversion.from_pretrained."""
    from reno_jax.models.conversion import from_pretrained as impl
    return impl(*args, **kwargs)


def save_pretrained(*args, **kwargs):
    """Write a HF checkpoint directory; see reno_jax.models.conversion.save_pretrained."""
    from reno_jax.models.conversion import save_pretrained as impl
    return impl(*args, **kwargs)
