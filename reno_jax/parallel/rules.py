"""Sharding rules: logical parameter axes -> mesh axes, in a few named presets.

Every parameter dimension has a logical name in the one conversion table (`conversion.param_table`,
`Entry.axes`: vocab, embed, heads, lora, mlp, expert, ...). A preset maps those names to mesh axes
(`reno_jax.sharding.axes.MESH_AXES`); a name a preset does not list is replicated. So one table says what a
parameter is, and one small dict per preset says how the model is laid out:

    dp       everything replicated; only the batch is split (over data x fsdp x expert)
    fsdp     + every matrix sharded along its model (`embed`) side over `fsdp` (ZeRO-3 / FSDP)
    fsdp_ep  + routed experts split over `expert` (expert parallelism)
    fsdp_tp  + attention heads, MLP width and vocabulary split over `tensor` (Megatron-style tensor parallelism)

A dimension whose size the mapped mesh axes do not divide is replicated on that mesh instead (a tiny test model
on 8 devices); `param_partition_specs` gives the rules' specs before that mesh-dependent step, which is what the
golden files under tests/data/ record.

The optimizer state follows its parameter: a moment with the parameter's shape gets the parameter's spec; the
int8 moments (`trainer.QuantizedMoment`: codes [n_blocks, block] of the flattened parameter, scales [n_blocks])
are split along their block axis over the same mesh axes as the parameter, which keeps each device's blocks on
the device that holds those elements whenever the parameter is sharded along its leading dimension.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from reno_jax.models import conversion
from reno_jax.sharding.axes import BATCH_AXES

# Logical axis -> mesh axes (a tuple: a dimension may be split over several mesh axes).
PRESETS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "dp": {},
    "fsdp": {"embed": ("fsdp",)},
    "fsdp_ep": {"embed": ("fsdp",), "expert": ("expert",)},
    "fsdp_tp": {"embed": ("fsdp",), "heads": ("tensor",), "mlp": ("tensor",), "vocab": ("tensor",)},
}


class ShardingError(ValueError):
    """An unknown preset, or a state that does not match the parameters it should follow."""


def preset_rules(preset: str) -> Mapping[str, tuple[str, ...]]:
    try:
        return PRESETS[preset]
    except KeyError:
        raise ShardingError(f"unknown sharding preset {preset!r}; choose one of {sorted(PRESETS)}") from None


def logical_to_spec(axes: tuple[str, ...], rules: Mapping[str, tuple[str, ...]]) -> PartitionSpec:
    """PartitionSpec of one leaf from its logical axes; a mesh axis is used at most once per leaf."""
    used: set[str] = set()
    parts = []
    for name in axes:
        mesh_axes = tuple(a for a in rules.get(name, ()) if a not in used)
        used.update(mesh_axes)
        parts.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*parts)


def _tree_from_table(config, leaf_fn) -> dict:
    tree: dict = {}
    for entry in conversion.param_table(config):
        if entry.expert not in (None, 0):  # stacked experts: one leaf for all E tensors
            continue
        node = tree
        for key in entry.flax_path[:-1]:
            node = node.setdefault(key, {})
        node[entry.flax_path[-1]] = leaf_fn(entry)
    return tree


def param_logical_axes(config) -> dict:
    """The params tree with each leaf's logical axes (a tuple of names), from the conversion table."""
    return _tree_from_table(config, lambda e: e.axes)


def param_partition_specs(config, preset: str) -> dict:
    """The params tree of `PartitionSpec`s a preset's rules give (independent of any mesh's sizes)."""
    rules = preset_rules(preset)
    return _tree_from_table(config, lambda e: logical_to_spec(e.axes, rules))


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> PartitionSpec:
    """`spec` with every dimension that its mesh axes do not divide replicated (and size-1 axes dropped)."""
    parts = []
    for dim, part in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
        names = tuple(n for n in names if mesh.shape[n] > 1)
        ways = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        parts.append(None if not names or dim % ways else names[0] if len(names) == 1 else names)
    return PartitionSpec(*parts)


def param_shardings(config, mesh: jax.sharding.Mesh, preset: str) -> dict:
    """The params tree of `NamedSharding`s on `mesh` (`param_partition_specs` fitted to the mesh's sizes)."""
    rules = preset_rules(preset)
    return _tree_from_table(
        config, lambda e: NamedSharding(mesh, fit_spec(logical_to_spec(e.axes, rules), e.flax_shape, mesh))
    )


def _shard_count(spec: PartitionSpec, mesh: jax.sharding.Mesh) -> tuple[tuple[str, ...], int]:
    names = []
    for part in spec:
        if part is not None:
            names.extend((part,) if isinstance(part, str) else part)
    return tuple(names), int(np.prod([mesh.shape[n] for n in names])) if names else 1


def _path_keys(path) -> tuple[str, ...]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def follow_params(tree: Any, params_shardings: dict, mesh: jax.sharding.Mesh) -> Any:
    """Shardings for any pytree of (abstract) arrays whose leaves belong to parameters (a train state,
    optimizer moments): a leaf under a parameter's path gets that parameter's sharding when it has its shape,
    the block-axis split described in the module docstring when it is a quantised moment, and is replicated
    otherwise (step counters, RNG keys, scalars).
    """
    flat_params = {_path_keys(p): s for p, s in jax.tree_util.tree_flatten_with_path(params_shardings)[0]}
    replicated = NamedSharding(mesh, PartitionSpec())

    def owner(keys):
        for start in range(len(keys)):
            for end in range(len(keys), start, -1):
                hit = flat_params.get(keys[start:end])
                if hit is not None:
                    return hit, keys[end:]
        return None, ()

    def leaf(path, x):
        sharding, rest = owner(_path_keys(path))
        if sharding is None or not np.ndim(x):
            return replicated
        spec = sharding.spec
        if not rest:  # a moment stored like the parameter
            return NamedSharding(mesh, fit_spec(spec, tuple(x.shape), mesh))
        names, ways = _shard_count(spec, mesh)
        if rest[-1] in ("codes", "scale") and names and x.shape[0] % ways == 0:
            first = names[0] if len(names) == 1 else names
            return NamedSharding(mesh, PartitionSpec(first, *([None] * (np.ndim(x) - 1))))
        return replicated

    return jax.tree_util.tree_map_with_path(leaf, tree)


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int) -> NamedSharding:
    """Rows split over the mesh's batch axes, every other dimension whole."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def specs_to_json(specs: dict) -> dict:
    """`{"/"-joined param path: [mesh axes or null per dim]}` for golden files and diffs."""
    out = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]:
        out["/".join(_path_keys(path))] = [p if p is None or isinstance(p, str) else list(p) for p in spec]
    return dict(sorted(out.items()))
