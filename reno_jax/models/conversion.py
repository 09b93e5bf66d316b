"""Ling-3.0 (`bailing_hybrid`) checkpoint conversion: HF safetensors <-> Flax params, both ways.

One table (`param_table`) lists every tensor of the published checkpoint layout together with its Flax path,
both shapes and the transform between them. Loading and saving walk the same table, so the two directions
cannot drift apart.

Flax layout (nested dicts; every linear kernel is the HF weight transposed to [in, out]):

    {'model': {'word_embeddings': {'embedding': [V, D]},
               'layers_{i}': {'input_layernorm': {'scale'}, 'post_attention_layernorm': {'scale'},
                              'attention': {...KDA or MLA...}, 'mlp': {...dense or MoE...}},
               'norm': {'scale': [D]}},
     'lm_head': {'kernel': [D, V]}}          # absent when tie_word_embeddings

HF experts are one module per expert (`mlp.experts.{e}.gate_proj.weight` [Im, D]); in Flax they are stacked
along a leading expert axis (`experts.gate_proj` [E, D, Im], `experts.down_proj` [E, Im, D]).
Short-conv kernels are HF [P, 1, W] and Flax [W, P].

Files are read with `safetensors.safe_open(..., framework="numpy")` one leaf at a time (each tensor is
converted, moved to a jax array and its host copy dropped); given shardings, each device's block of a leaf is
read on its own (`get_slice`) and placed straight onto that device. They are written by a small streaming
safetensors writer: the files are sized from their headers and memory-mapped, and every leaf is written shard
by shard from the devices into place. So neither direction ever holds a second full copy of the model (at most
one leaf, or one shard of it, is on the host at a time). No pickle, no remote code.

Dtypes: bf16 files are read through safetensors' numpy backend (ml_dtypes.bfloat16; a raw-bytes reader covers
releases without it). `from_pretrained(dtype=None)` keeps every stored dtype (bit-exact round trips);
a narrower `dtype` such as bf16 leaves the small float32-sensitive leaves (`Entry.float32`) in float32.
`save_pretrained` writes each tensor in its param dtype unless given `dtype`.

Errors: every bad config, checkpoint or params tree raises one `CheckpointError` (a ValueError) whose message
names all the offending tensors / keys / files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
from absl import logging

from reno_jax.models import lora, quant
from reno_jax.models.config import Ling3Config

MODEL_TYPE = "bailing_hybrid"
ARCHITECTURES = ("BailingMoeV3ForCausalLM",)
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

# Config keys a checkpoint's config.json must hold: they fix tensor shapes or the layer schedule, and the
# HF and Ling3Config defaults for them differ, so a missing one is an error rather than a guess.
REQUIRED_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "layer_group_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "short_conv_kernel_size",
)

# safetensors dtype string <-> numpy dtype, floating types only (weights must be floating point).
_ST_TO_NP = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}

# Transforms between an HF tensor and its Flax leaf.
IDENTITY = "identity"  # same array
TRANSPOSE = "transpose"  # HF [out, in] <-> Flax [in, out]
CONV = "conv"  # HF [P, 1, W] <-> Flax [W, P]
EXPERT = "expert"  # HF [out, in] <-> slot `expert` of the stacked Flax leaf [E, in, out]


# Logical axes of the parameter dimensions (see `Entry.axes`; mapped to mesh axes by `reno_jax.parallel`):
LOGICAL_AXES = (
    "vocab",  # V: embedding rows, lm_head outputs
    "embed",  # D: the residual stream
    "heads",  # head-major attention dims (H, or H * a head width): q/k/v/o, gates, conv channels, A_log
    "head_dim",  # one head's width (KDA's o_norm)
    "lora",  # low-rank bottlenecks shared by all heads (q_lora_rank, kv_lora_rank + rope, KDA f/g rank)
    "mlp",  # dense / expert / shared-expert intermediate width
    "expert",  # E: routed experts
    "router",  # the router's E outputs (kept whole: routing needs every score)
    "conv",  # short-conv window W
    "norm",  # RMSNorm scales
)


class CheckpointError(ValueError):
    """A checkpoint, config or params tree that cannot be converted; the message names the problem."""


# --------------------------------------------------------------------------------------------------------------
# The name / shape table
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One HF tensor and where it lives in the Flax params.

    For `EXPERT` entries several HF tensors (one per expert) share one Flax leaf: `flax_shape` is the full
    stacked shape [E, in, out] and `expert` is this tensor's index along axis 0. `float32` marks the small
    precision-sensitive leaves (A_log, dt_bias, short-conv kernels, router kernel and expert_bias) that the
    model keeps in float32 (as `ling3.init_params` does): loading with a narrower `dtype` leaves them float32.
    `axes` names each dimension of the Flax leaf with a logical axis (`LOGICAL_AXES`); `reno_jax.parallel` maps
    those names onto mesh axes, so this table is also the one place that says how every parameter is sharded.
    """

    hf_name: str
    flax_path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    flax_shape: tuple[int, ...]
    transform: str
    expert: int | None = None
    float32: bool = False
    axes: tuple[str, ...] = ()

    def __post_init__(self):
        if len(self.axes) != len(self.flax_shape):
            raise AssertionError(
                f"{self.hf_name}: axes {self.axes} do not name the {len(self.flax_shape)} "
                f"dimensions of {self.flax_shape}"
            )
        unknown = [a for a in self.axes if a not in LOGICAL_AXES]
        if unknown:
            raise AssertionError(f"{self.hf_name}: unknown logical axes {unknown}")

    def hf_to_flax(self, x: np.ndarray) -> np.ndarray:
        """HF tensor -> Flax leaf (for EXPERT: the [in, out] slice that goes into slot `expert`). Also maps any
        block of the HF tensor to the matching block of the leaf (see `_hf_index`)."""
        if self.transform == IDENTITY:
            return x
        if self.transform in (TRANSPOSE, EXPERT):
            return x.T
        if self.transform == CONV:
            return x[:, 0, :].T
        raise AssertionError(self.transform)

    def flax_to_hf(self, x: np.ndarray) -> np.ndarray:
        """The inverse of `hf_to_flax` (for EXPERT: slot `expert`'s [in, out] slice -> the HF tensor), on whole
        tensors or on matching blocks; a view where it can be (the writer casts and copies on assignment)."""
        if self.transform == IDENTITY:
            return x
        if self.transform in (TRANSPOSE, EXPERT):
            return x.T
        if self.transform == CONV:
            return x.T[:, None, :]
        raise AssertionError(self.transform)

    def describe(self) -> str:
        flax = "/".join(self.flax_path) + ("" if self.expert is None else f"[{self.expert}]")
        return (
            f"{self.hf_name} {list(self.hf_shape)} <-{self.transform}-> {flax} {list(self.flax_shape)} "
            f"({', '.join(self.axes)})"
        )


def check_config_dict(raw: Mapping[str, Any]) -> None:
    """Raises CheckpointError when a config.json dict is not a loadable bailing_hybrid config."""
    if "model_type" not in raw:
        raise CheckpointError("config is missing required keys: model_type")
    if raw["model_type"] != MODEL_TYPE:
        raise CheckpointError(f"unsupported model_type {raw['model_type']!r}: expected {MODEL_TYPE!r}")
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in raw]
    if missing:
        raise CheckpointError(f"config is missing required keys: {', '.join(missing)}")


def as_config(config: Any) -> Any:
    """A Ling3Config as is, or a config.json dict turned into one (errors become CheckpointError)."""
    if isinstance(config, Ling3Config):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a Ling3Config or a config.json dict, got {type(config).__name__}")
    raw = dict(config)
    raw.setdefault("model_type", MODEL_TYPE)
    check_config_dict(raw)
    try:
        return Ling3Config.from_dict(raw)
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"invalid bailing_hybrid config: {exc}") from exc


def _identity_entry(
    hf: str, path: tuple[str, ...], shape: tuple[int, ...], axes: tuple[str, ...], float32: bool = False
) -> Entry:
    """A tensor stored the same way on both sides."""
    return Entry(hf, path, shape, shape, IDENTITY, float32=float32, axes=axes)


def _linear_entry(
    hf: str, path: tuple[str, ...], out_dim: int, in_dim: int, axes: tuple[str, str], float32: bool = False
) -> Entry:
    """A linear layer's weight: HF `hf`.weight [out, in] <-> Flax `path`/kernel [in, out].

    `axes` = (input axis, output axis) of the Flax kernel [in, out].
    """
    return Entry(
        hf + ".weight",
        path + ("kernel",),
        (out_dim, in_dim),
        (in_dim, out_dim),
        TRANSPOSE,
        float32=float32,
        axes=axes,
    )


def _norm_entry(hf: str, path: tuple[str, ...], dim: int) -> Entry:
    """An RMSNorm's weight [dim]: HF `hf`.weight <-> Flax `path`/scale."""
    return _identity_entry(hf + ".weight", path + ("scale",), (dim,), ("norm",))


def _kda_attention_entries(c: Any, ha: str, fa: tuple[str, ...]) -> list[Entry]:
    """A KDA (linear attention) block's tensors; `ha` / `fa` are its HF name prefix and Flax path."""
    H, Dk, W = c.num_attention_heads, c.head_dim, c.short_conv_kernel_size
    D, P = c.hidden_size, H * Dk
    table = [_linear_entry(ha + f"{name}_proj", fa + (f"{name}_proj",), P, D, ("embed", "heads")) for name in "qkv"]
    for name in "qkv":
        table.append(
            Entry(
                ha + f"{name}_conv1d.weight",
                fa + (f"{name}_conv1d", "kernel"),
                (P, 1, W),
                (W, P),
                CONV,
                float32=True,
                axes=("conv", "heads"),
            )
        )
    table.append(_identity_entry(ha + "A_log", fa + ("A_log",), (H,), ("heads",), float32=True))
    table.append(_identity_entry(ha + "dt_bias", fa + ("dt_bias",), (P,), ("heads",), float32=True))
    table.append(_linear_entry(ha + "b_proj", fa + ("b_proj",), H, D, ("embed", "heads")))
    for name in ("f", "g"):
        if c.no_kda_lora:
            table.append(_linear_entry(ha + f"{name}_proj", fa + (f"{name}_proj",), P, D, ("embed", "heads")))
        else:
            table.append(_linear_entry(ha + f"{name}_a_proj", fa + (f"{name}_a_proj",), Dk, D, ("embed", "lora")))
            table.append(_linear_entry(ha + f"{name}_b_proj", fa + (f"{name}_b_proj",), P, Dk, ("lora", "heads")))
    table.append(_norm_entry(ha + "o_norm", fa + ("o_norm",), Dk))
    table.append(_linear_entry(ha + "o_proj", fa + ("o_proj",), D, P, ("heads", "embed")))
    return table


def _mla_attention_entries(c: Any, ha: str, fa: tuple[str, ...]) -> list[Entry]:
    """An MLA (latent softmax attention) block's tensors; `ha` / `fa` are its HF name prefix and Flax path."""
    D, H = c.hidden_size, c.num_attention_heads
    dn, dr, dv, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    if c.q_lora_rank is None:
        table = [_linear_entry(ha + "q_proj", fa + ("q_proj",), H * (dn + dr), D, ("embed", "heads"))]
    else:
        table = [
            _linear_entry(ha + "q_a_proj", fa + ("q_a_proj",), c.q_lora_rank, D, ("embed", "lora")),
            _norm_entry(ha + "q_a_layernorm", fa + ("q_a_layernorm",), c.q_lora_rank),
            _linear_entry(ha + "q_b_proj", fa + ("q_b_proj",), H * (dn + dr), c.q_lora_rank, ("lora", "heads")),
        ]
    element_wise = c.gated_attention_proj_granularity_type == "element_wise"
    return table + [
        # The latent and the rope key are shared by every head: kept whole on the head side.
        _linear_entry(ha + "kv_a_proj_with_mqa", fa + ("kv_a_proj_with_mqa",), r + dr, D, ("embed", "lora")),
        _norm_entry(ha + "kv_a_layernorm", fa + ("kv_a_layernorm",), r),
        _linear_entry(ha + "kv_b_proj", fa + ("kv_b_proj",), H * (dn + dv), r, ("lora", "heads")),
        _linear_entry(ha + "g_proj", fa + ("g_proj",), H * dv if element_wise else H, D, ("embed", "heads")),
        _linear_entry(ha + "dense", fa + ("dense",), D, H * dv, ("heads", "embed")),
    ]


def _gated_mlp_entries(hm: str, fm: tuple[str, ...], D: int, I: int) -> list[Entry]:
    """A dense SwiGLU MLP's gate / up / down projections (hidden size D, intermediate size I)."""
    return [
        _linear_entry(hm + "gate_proj", fm + ("gate_proj",), I, D, ("embed", "mlp")),
        _linear_entry(hm + "up_proj", fm + ("up_proj",), I, D, ("embed", "mlp")),
        _linear_entry(hm + "down_proj", fm + ("down_proj",), D, I, ("mlp", "embed")),
    ]


def _moe_entries(c: Any, hm: str, fm: tuple[str, ...]) -> list[Entry]:
    """A MoE block's tensors: router, every expert's projections (one HF tensor each, stacked in Flax) and the
    shared expert when there is one."""
    D, E, Im = c.hidden_size, c.num_experts, c.moe_intermediate_size
    table = [
        _linear_entry(hm + "gate", fm + ("gate",), E, D, ("embed", "router"), float32=True),
        _identity_entry(hm + "gate.expert_bias", fm + ("gate", "expert_bias"), (E,), ("router",), float32=True),
    ]
    for e in range(E):
        for name, out_dim, in_dim, axes in (
            ("gate_proj", Im, D, ("expert", "embed", "mlp")),
            ("up_proj", Im, D, ("expert", "embed", "mlp")),
            ("down_proj", D, Im, ("expert", "mlp", "embed")),
        ):
            table.append(
                Entry(
                    hm + f"experts.{e}.{name}.weight",
                    fm + ("experts", name),
                    (out_dim, in_dim),
                    (E, in_dim, out_dim),
                    EXPERT,
                    expert=e,
                    axes=axes,
                )
            )
    if c.shared_intermediate_size:
        table += _gated_mlp_entries(hm + "shared_experts.", fm + ("shared_experts",), D, c.shared_intermediate_size)
    return table


def _decoder_layer_entries(c: Any, i: int, kind: str) -> list[Entry]:
    """Decoder layer `i`'s tensors: its two norms, its attention (`kind` "kda" or "mla") and its MLP."""
    hp, fp = f"model.layers.{i}.", ("model", f"layers_{i}")
    table = [
        _norm_entry(hp + "input_layernorm", fp + ("input_layernorm",), c.hidden_size),
        _norm_entry(hp + "post_attention_layernorm", fp + ("post_attention_layernorm",), c.hidden_size),
    ]
    if kind == "kda":
        table += _kda_attention_entries(c, hp + "attention.", fp + ("attention",))
    elif kind == "mla":
        table += _mla_attention_entries(c, hp + "attention.", fp + ("attention",))
    else:
        raise CheckpointError(f"layer {i} has unknown attention kind {kind!r}")
    if c.is_moe_layer(i):
        table += _moe_entries(c, hp + "mlp.", fp + ("mlp",))
    else:
        table += _gated_mlp_entries(hp + "mlp.", fp + ("mlp",), c.hidden_size, c.intermediate_size)
    return table


def param_table(config: Any) -> list[Entry]:
    """Every tensor of the checkpoint, in file order: HF name, Flax path, both shapes, transform.

    `config` is a Ling3Config (its `layer_kinds` / `is_moe_layer` decide the schedule) or a config.json dict.
    Shapes: D = hidden_size, H = num_attention_heads, Dk = head_dim, P = H * Dk, W = short_conv_kernel_size,
    E = num_experts, Im = moe_intermediate_size, Is = shared expert size.
    """
    c = as_config(config)
    D = c.hidden_size
    table = [
        _identity_entry(
            "model.word_embeddings.weight",
            ("model", "word_embeddings", "embedding"),
            (c.vocab_size, D),
            ("vocab", "embed"),
        )
    ]
    for i, kind in enumerate(c.layer_kinds):
        table += _decoder_layer_entries(c, i, kind)
    table.append(_norm_entry("model.norm", ("model", "norm"), D))
    if not c.tie_word_embeddings:
        table.append(_linear_entry("lm_head", ("lm_head",), c.vocab_size, D, ("embed", "vocab")))
    return table


def format_table(table: Sequence[Entry]) -> str:
    """The table as text, one tensor per line (for logs and debugging)."""
    return "\n".join(e.describe() for e in table)


def abstract_params(config: Any, dtype: Any = jnp.float32) -> dict:
    """The Flax params tree of `jax.ShapeDtypeStruct`s implied by the table, with `from_pretrained`'s dtypes."""
    tree: dict = {}
    for entry in param_table(config):
        leaf_dtype = jnp.float32 if entry.float32 and jnp.dtype(dtype).itemsize < 4 else dtype
        _set_leaf(tree, entry.flax_path, jax.ShapeDtypeStruct(entry.flax_shape, jnp.dtype(leaf_dtype)))
    return tree


# --------------------------------------------------------------------------------------------------------------
# Small tree helpers
# --------------------------------------------------------------------------------------------------------------


def _set_leaf(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _leaf_paths(tree: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaf_paths(value, prefix + (str(key),))
    else:
        yield prefix, tree


def _get_leaf(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _list_names(names: Sequence[str], limit: int = 200) -> str:
    names = sorted(names)
    text = ", ".join(names[:limit])
    return text + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------


def read_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """Reads and checks `path/config.json` (raises CheckpointError naming the problem)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise CheckpointError(f"missing {CONFIG_NAME} in {str(path)!r}")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{str(config_file)!r} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(config_file)!r} must hold a JSON object, got {type(raw).__name__}")
    check_config_dict(raw)
    return raw


def config_to_json_dict(config: Any) -> dict[str, Any]:
    """The config.json content for `config`: its fields plus model_type, architectures and the explicit schedule.

    `layer_types` and `mlp_layer_types` are always written (the schedule this library builds): transformers'
    native `BailingHybridForCausalLM` derives missing lists without the Ling tail rule, so without them a model
    whose layer count is not a multiple of layer_group_size would load there with a different last layer.
    """
    resolved = as_config(config)
    raw = dict(config) if isinstance(config, Mapping) else resolved.to_dict()
    raw["model_type"] = MODEL_TYPE
    raw.setdefault("architectures", list(ARCHITECTURES))
    raw["layer_types"] = list(resolved.resolved_layer_types)
    raw["mlp_layer_types"] = list(resolved.resolved_mlp_layer_types)
    return raw


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


def _weight_files(path: Path) -> dict[str, Path] | None:
    """Index json -> {tensor name: shard file}; None for a single-file checkpoint."""
    index_file = path / INDEX_NAME
    if not index_file.is_file():
        if not (path / WEIGHTS_NAME).is_file():
            raise CheckpointError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {str(path)!r}")
        return None
    try:
        index = json.loads(index_file.read_text())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"corrupt index {str(index_file)!r}: {exc!r}") from exc
    files = {name: path / shard for name, shard in weight_map.items()}
    missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
    if missing:
        raise CheckpointError(
            f"index {INDEX_NAME} in {str(path)!r} points to missing shard files: {', '.join(missing)}"
        )
    return files


def _open(stack: ExitStack, file: Path) -> Any:
    try:
        return stack.enter_context(safetensors.safe_open(str(file), framework="numpy"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"missing safetensors file {str(file)!r}") from exc
    except Exception as exc:  # SafetensorError (truncated / corrupt header) and OS errors
        raise CheckpointError(f"cannot read safetensors file {str(file)!r} (corrupt or truncated?): {exc}") from exc


def _read_raw(file: Path, name: str) -> np.ndarray:
    """One tensor mapped straight from the file bytes (used when safetensors' numpy backend lacks the dtype):
    a read-only memory map, so indexing it reads only the pages of that block."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(header_len))[name]
    begin, end = info["data_offsets"]
    dtype = _ST_TO_NP[info["dtype"]]
    if os.path.getsize(file) < 8 + header_len + end:
        raise CheckpointError(f"tensor {name} in {str(file)!r} is truncated")
    # safetensors data is little-endian, as are the hosts jax runs on.
    return np.memmap(file, dtype=dtype, mode="r", offset=8 + header_len + begin, shape=tuple(info["shape"]))


def _read_block(file: Path, handle: Any, name: str, st_dtype: str, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` (one slice per dimension) of a stored tensor; only that block is read."""
    try:
        return handle.get_slice(name)[index]
    except Exception as exc:
        if st_dtype == "BF16":  # older safetensors releases have no bf16 in their numpy backend
            return np.array(_read_raw(file, name)[index])
        raise CheckpointError(f"cannot read tensor {name} from {str(file)!r}: {exc}") from exc


def _mtp_skip(name: str, num_layers: int, num_mtp: int) -> bool:
    m = _LAYER_RE.match(name)
    return m is not None and num_layers <= int(m.group(1)) < num_layers + num_mtp


def leaf_groups(table: Sequence[Entry]) -> list[list[Entry]]:
    """The table's entries by Flax leaf, in table order of each leaf's first entry (an expert leaf: its E
    entries, by expert index; every other leaf: its one entry)."""
    groups: dict[tuple[str, ...], list[Entry]] = {}
    for entry in table:
        groups.setdefault(entry.flax_path, []).append(entry)
    return list(groups.values())


def _hf_index(entry: Entry, index: tuple[slice, ...]) -> tuple[slice, ...]:
    """The block of the HF tensor that holds the block `index` of its Flax leaf (for EXPERT: of one expert's
    [in, out] slice)."""
    if entry.transform == IDENTITY:
        return index
    if entry.transform in (TRANSPOSE, EXPERT):  # Flax [in, out] <- HF [out, in]
        return index[1], index[0]
    if entry.transform == CONV:  # Flax [W, P] <- HF [P, 1, W]
        return index[1], slice(None), index[0]
    raise AssertionError(entry.transform)


def _normalise(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def _shardings_for(shardings: Any, config: Any) -> Any:
    """`from_pretrained`'s `shardings` argument as a params tree of shardings (or None)."""
    if shardings is None or isinstance(shardings, Mapping):
        return shardings
    if callable(shardings):
        return shardings(config)
    raise TypeError(
        "shardings must be None, a params tree of shardings or a function config -> such a tree, "
        f"got {type(shardings).__name__}"
    )


def _quantized_kind(config: Any, flax_path: tuple[str, ...]) -> str | None:
    """The `quant.QUANT_TARGETS` kind of a leaf (None: a leaf kept in float)."""
    is_kda = None
    if len(flax_path) > 3 and flax_path[2] == "attention":
        is_kda = config.layer_kinds[int(flax_path[1].split("_")[1])] == "kda"
    kind = lora.weight_kind(flax_path, is_kda)
    return kind if kind in quant.QUANT_TARGETS else None


_quantize_leaf = jax.jit(quant.quantize_array, static_argnames=("axis", "block"))


def from_pretrained(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    shardings: Any = None,
    quantize: str | None = None,
    quant_block: int | None = None,
) -> tuple[Any, dict]:
    """Loads a Ling-3.0 HF checkpoint directory into (Ling3Config, Flax params).

    Reads `config.json` and `model.safetensors` or `model.safetensors.index.json` + shards. Tensors are read one
    at a time, converted (transposed / reshaped / stacked), cast to `dtype` (None: keep the stored dtype) and
    turned into jax arrays. MTP layers (`model.layers.{L..L+n-1}` with n = num_nextn_predict_layers) are skipped.

    shardings: where the leaves go. None: the default device (the whole leaf is read, converted and moved).
    Otherwise a params tree of `jax.sharding.Sharding` or a function `config -> such a tree` (the config is only
    known once config.json is read; for a preset's layout on a mesh:
    `functools.partial(reno_jax.parallel.param_shardings, mesh=mesh, preset=preset)`): each leaf
    is built with `jax.make_array_from_callback`, every addressable shard reading only its own block of the
    stored tensor (and of only the experts it holds), so no host and no device ever holds more than its shards
    plus one block; a block that several devices hold (replication) is read once. Several processes: each reads
    the blocks of its own devices.

    quantize: "int8": the weights `quant.quantize` would quantize (projections, experts, embedding, lm_head) come
    out as `quant.QArray`s (per-channel scales, or per `quant_block` rows), each quantized on the device right after
    it is read, from `dtype`, so the float model never exists whole anywhere: at most one float leaf besides the
    int8 ones read so far. The result equals `quant.quantize(from_pretrained(path, dtype), block=quant_block)`.
    Raises CheckpointError naming the problem on any bad input.
    """
    path = Path(path)
    raw = read_config_dict(path)
    config = as_config(raw)
    table = param_table(config)
    target = None if dtype is None else np.dtype(dtype)
    if target is not None and target not in _NP_TO_ST:
        raise CheckpointError(f"unsupported target dtype {target}: use float32, bfloat16, float16 or float64")
    shardings = _shardings_for(shardings, config)
    if quantize not in (None, "", "int8"):
        raise CheckpointError(f"unknown quantization {quantize!r}: use 'int8' (or None)")

    with ExitStack() as stack:
        sources = _open_sources(stack, path)
        stored_dtype = _check_tensors(path, config, table, sources)
        params: dict = {}
        for entries in leaf_groups(table):
            first = entries[0]
            read = _leaf_reader(entries, sources, stored_dtype, _leaf_dtype(first, target, stored_dtype))
            leaf = _load_leaf(first, read, shardings)
            kind = _quantized_kind(config, first.flax_path) if quantize else None
            if kind is not None:
                leaf = _quantize_leaf(leaf, axis=quant.quantized_axis(kind), block=quant_block)
            _set_leaf(params, first.flax_path, leaf)
    return config, params


def _open_sources(stack: ExitStack, path: Path) -> dict[str, tuple[Path, Any]]:
    """name -> (file, open handle) of every stored tensor. Every file is opened once (on `stack`); opening
    validates its header."""
    index = _weight_files(path)
    if index is None:
        file = path / WEIGHTS_NAME
        handle = _open(stack, file)
        return {name: (file, handle) for name in handle.keys()}
    handles = {file: _open(stack, file) for file in sorted(set(index.values()))}
    keys = {file: set(handle.keys()) for file, handle in handles.items()}
    absent = [n for n, f in index.items() if n not in keys[f]]
    if absent:
        raise CheckpointError(f"index lists tensors that are not in their shard: {_list_names(absent)}")
    return {name: (file, handles[file]) for name, file in index.items()}


def _check_tensors(path: Path, config: Ling3Config, table: list[Entry], sources: dict) -> dict[str, str]:
    """Raises CheckpointError listing every missing, unexpected, misshapen or non-float tensor (MTP layers are
    skipped); returns the stored safetensors dtype of each expected tensor."""
    num_layers, num_mtp = config.num_hidden_layers, config.num_nextn_predict_layers
    mtp = sorted(n for n in sources if _mtp_skip(n, num_layers, num_mtp))
    if mtp:
        logging.info(
            "Skipping %d multi-token-prediction tensors (layers %d..%d), e.g. %s",
            len(mtp),
            num_layers,
            num_layers + num_mtp - 1,
            mtp[0],
        )
    expected = {e.hf_name: e for e in table}
    present = set(sources) - set(mtp)
    problems = []
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_list_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_list_names(unexpected)}")
    stored_dtype: dict[str, str] = {}
    for name in sorted(present & set(expected)):
        meta = sources[name][1].get_slice(name)
        shape, st_dtype = tuple(meta.get_shape()), meta.get_dtype()
        stored_dtype[name] = st_dtype
        if shape != expected[name].hf_shape:
            problems.append(f"wrong shape for {name}: expected {list(expected[name].hf_shape)}, got {list(shape)}")
        if st_dtype not in _ST_TO_NP:
            problems.append(f"wrong dtype for {name}: {st_dtype} (expected a floating dtype: F32, BF16, F16, F64)")
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match the config: " + "; ".join(problems))
    return stored_dtype


def _leaf_dtype(first: Entry, target: np.dtype | None, stored_dtype: dict[str, str]) -> np.dtype:
    """The dtype a Flax leaf is built in: the stored one (`target` None), float32 for the entries that stay
    float32 under a narrower target, else `target`."""
    if target is None:
        return _ST_TO_NP[stored_dtype[first.hf_name]]
    if first.float32 and target.itemsize < 4:
        return np.dtype(np.float32)  # see Entry.float32
    return target


def _leaf_reader(entries: list[Entry], sources: dict, stored_dtype: dict[str, str], out_dtype: np.dtype) -> Callable:
    """`read(block) -> np.ndarray`: the Flax leaf of `entries` (one entry, or one per expert), restricted to
    `block` (one slice per Flax dimension), read and converted to `out_dtype`."""

    def read(block: tuple[slice, ...]) -> np.ndarray:
        head = entries[0]
        if head.transform != EXPERT:
            file, handle = sources[head.hf_name]
            x = _read_block(file, handle, head.hf_name, stored_dtype[head.hf_name], _hf_index(head, block))
            return np.asarray(head.hf_to_flax(x), dtype=out_dtype)
        experts = range(*block[0].indices(len(entries)))
        out = np.empty((len(experts),) + tuple(s.stop - s.start for s in block[1:]), out_dtype)
        for k, e in enumerate(experts):  # only the experts this block holds
            file, handle = sources[entries[e].hf_name]
            x = _read_block(
                file, handle, entries[e].hf_name, stored_dtype[entries[e].hf_name], _hf_index(entries[e], block[1:])
            )
            out[k] = entries[e].hf_to_flax(x)  # cast on assignment
        return out

    return read


def _load_leaf(first: Entry, read: Callable, shardings: Any) -> jax.Array:
    """The leaf on the default device (`shardings` None, read whole), or built shard by shard on its sharding,
    each distinct block read once (replicas share it)."""
    shape = first.flax_shape
    if shardings is None:
        return jnp.asarray(read(_normalise((slice(None),) * len(shape), shape)))
    try:
        sharding = _get_leaf(shardings, first.flax_path)
    except (KeyError, TypeError):
        raise CheckpointError(f"shardings have no entry for {'/'.join(first.flax_path)}") from None
    blocks: dict[tuple, np.ndarray] = {}

    def shard(block):
        block = _normalise(block, shape)
        key = tuple((s.start, s.stop) for s in block)
        if key not in blocks:
            blocks[key] = read(block)
        return blocks[key]

    leaf = jax.make_array_from_callback(shape, sharding, shard)
    blocks.clear()  # the host copies: the devices hold their shards now
    return leaf


# --------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------


def check_params(params: Mapping, config: Any) -> None:
    """Raises CheckpointError when `params` does not have exactly the table's leaves, shapes and float dtypes."""
    expected: dict[tuple[str, ...], tuple[int, ...]] = {}
    for entry in param_table(config):
        expected[entry.flax_path] = entry.flax_shape
    got = dict(_leaf_paths(params))
    problems = []
    missing = ["/".join(p) for p in expected if p not in got]
    unexpected = ["/".join(p) for p in got if p not in expected]
    if missing:
        problems.append(f"missing params ({len(missing)}): {_list_names(missing)}")
    if unexpected:
        problems.append(f"unexpected params ({len(unexpected)}): {_list_names(unexpected)}")
    for p, shape in expected.items():
        if p not in got:
            continue
        leaf = got[p]
        leaf_shape = tuple(getattr(leaf, "shape", ()))
        if leaf_shape != shape:
            problems.append(f"wrong shape for {'/'.join(p)}: expected {list(shape)}, got {list(leaf_shape)}")
        leaf_dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        if leaf_dtype not in _NP_TO_ST:
            problems.append(f"wrong dtype for {'/'.join(p)}: {leaf_dtype} (expected a floating dtype)")
    if problems:
        raise CheckpointError("params do not match the config: " + "; ".join(problems))


def _host_blocks(leaf: Any) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
    """(block index, host array) pairs covering a leaf, one at a time: each distinct addressable shard of a
    jax.Array (a replicated block once), copied to the host only when its turn comes; a host array whole."""
    shape = tuple(np.shape(leaf))
    if not isinstance(leaf, jax.Array):
        yield _normalise((slice(None),) * len(shape), shape), np.asarray(leaf)
        return
    seen = set()
    for shard in leaf.addressable_shards:
        block = _normalise(shard.index, shape)
        key = tuple((s.start, s.stop) for s in block)
        if key not in seen:
            seen.add(key)
            yield block, np.asarray(shard.data)


def _write_block(
    entries: Sequence[Entry], views: Mapping[str, np.ndarray], block: tuple[slice, ...], data: np.ndarray
) -> None:
    """Writes the Flax leaf's `block` (`data`) into the HF tensors of its entries (cast on assignment)."""
    head = entries[0]
    if head.transform != EXPERT:
        views[head.hf_name][_hf_index(head, block)] = head.flax_to_hf(data)
        return
    for k, e in enumerate(range(*block[0].indices(len(entries)))):  # the experts this block holds
        views[entries[e].hf_name][_hf_index(entries[e], block[1:])] = entries[e].flax_to_hf(data[k])


def _write_safetensors(
    files: Sequence[tuple[Path, Sequence[tuple[str, str, tuple[int, ...]]]]],
    fill: Callable[[Mapping[str, np.ndarray]], None],
) -> None:
    """Writes safetensors files without holding their tensors: each file's header comes first, the file is
    sized and memory-mapped, `fill(views)` writes every tensor through `views` ({name: the C-contiguous
    ndarray of that tensor inside its file}), and the files replace their final names only once complete.

    `files` are (path, [(name, safetensors dtype, shape)] in file order).
    """
    tmps, maps, views = [], [], {}
    for file, items in files:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, st_dtype, shape in items:
            nbytes = int(np.prod(shape, dtype=np.int64)) * _ST_TO_NP[st_dtype].itemsize
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
        tmp = file.with_name(file.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(len(header_bytes).to_bytes(8, "little"))
            f.write(header_bytes)
            f.truncate(8 + len(header_bytes) + offset)
        data = np.memmap(tmp, dtype=np.uint8, mode="r+", offset=8 + len(header_bytes), shape=(offset,))
        for name, st_dtype, shape in items:
            begin, end = header[name]["data_offsets"]
            views[name] = data[begin:end].view(_ST_TO_NP[st_dtype]).reshape(shape)
        tmps.append((tmp, file))
        maps.append(data)
    try:
        fill(views)
        for data in maps:
            data.flush()
    except BaseException:
        for tmp, _ in tmps:  # no half-written file is left behind
            tmp.unlink(missing_ok=True)
        raise
    finally:
        views.clear()
        maps.clear()
    for tmp, file in tmps:
        os.replace(tmp, file)


def save_pretrained(
    params: Mapping,
    config: Any,
    path: str | os.PathLike,
    shard_size_bytes: int | None = None,
    dtype: Any = None,
) -> None:
    """Writes `config.json` and the weights in the published Ling-3.0 names and shapes.

    Each tensor keeps its param dtype unless `dtype` is given. With `shard_size_bytes`, tensors are packed in
    table order into `model-0000k-of-0000n.safetensors` files of at most that size (a bigger tensor gets a shard
    of its own) plus `model.safetensors.index.json`; a single shard is written as `model.safetensors`.
    Previous weight files in `path` are replaced.

    Sharded params are written from their shards: each distinct addressable shard of a leaf is copied to the host
    on its own and written into place (memory-mapped files), so the host holds one shard at a time. Every shard
    must be in this process (a multi-process array raises CheckpointError).
    """
    check_params(params, config)
    elsewhere = [
        "/".join(p) for p, leaf in _leaf_paths(params) if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
    ]
    if elsewhere:  # checked before anything in `path` is touched
        raise CheckpointError(
            f"save_pretrained needs every shard in this process; {_list_names(elsewhere, 3)} "
            "span other processes' devices (restore the checkpoint in one process to export it)"
        )
    table = param_table(config)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{str(path)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    out_dtype = None if dtype is None else np.dtype(dtype)
    if out_dtype is not None and out_dtype not in _NP_TO_ST:
        raise CheckpointError(f"unsupported output dtype {out_dtype}")

    items = []
    for entry in table:
        leaf = _get_leaf(params, entry.flax_path)
        st_dtype = _NP_TO_ST[out_dtype if out_dtype is not None else np.dtype(leaf.dtype)]
        items.append((entry.hf_name, st_dtype, entry.hf_shape))

    shards: list[list] = [[]]
    size = 0
    for item in items:
        nbytes = int(np.prod(item[2], dtype=np.int64)) * _ST_TO_NP[item[1]].itemsize
        if shard_size_bytes is not None and shards[-1] and size + nbytes > shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes

    def fill(views: Mapping[str, np.ndarray]) -> None:
        # Leaf by leaf, block by block: one shard on the host at a time, written where its HF tensors live.
        for entries in leaf_groups(table):
            for block, data in _host_blocks(_get_leaf(params, entries[0].flax_path)):
                _write_block(entries, views, block, data)
                del data

    for old in path.iterdir():  # stale weights would make the directory ambiguous
        if old.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(old.name):
            old.unlink()
    (path / CONFIG_NAME).write_text(json.dumps(config_to_json_dict(config), indent=2, sort_keys=True) + "\n")
    if len(shards) == 1:
        _write_safetensors([(path / WEIGHTS_NAME, shards[0])], fill)
        return
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    _write_safetensors([(path / name, shard) for name, shard in zip(names, shards)], fill)
    weight_map = {item[0]: name for name, shard in zip(names, shards) for item in shard}
    total = sum(int(np.prod(shape, dtype=np.int64)) * _ST_TO_NP[st_dtype].itemsize for _, st_dtype, shape in items)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
