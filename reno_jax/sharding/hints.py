"""Sharding constraints inside the programs, as hints to GSPMD: no-ops unless a multi-device mesh is set.

The programs are written for one device and partitioned by GSPMD from their inputs' shardings
(`reno_jax.parallel.layout`).
Where propagation alone picks a bad layout (a micro-batch scan over a sharded axis, a gather whose table and
indices are sharded on different dimensions), a constraint here names the intended one. They read the mesh from
JAX's context (`with jax.set_mesh(mesh):` around tracing: `Layout.activate()`); without one, or on a one-device
mesh, every function returns its input unchanged, so the traced single-device program is the same program, bit
for bit.

Constraints never change values: only where the partitioned program keeps each intermediate (and so which
collectives it runs; the order of a cross-device reduction may change the last bits, as any resharding does).
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import PartitionSpec

from reno_jax.sharding.axes import BATCH_AXES


def active_mesh():
    """The abstract mesh set by `jax.set_mesh` when it has more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    return mesh


def batch_axes(rows: int, mesh=None) -> tuple[str, ...] | None:
    """The mesh's batch axes (`BATCH_AXES` of size > 1) that `rows` splits over: all of them when their product
    divides `rows`, else the longest leading run that does (None: none)."""
    mesh = mesh or active_mesh()
    if mesh is None:
        return None
    names = [n for n in BATCH_AXES if n in mesh.shape and mesh.shape[n] > 1]
    while names:
        ways = 1
        for n in names:
            ways *= mesh.shape[n]
        if rows % ways == 0:
            return tuple(names)
        names = names[:-1]
    return None


def constrain(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """`jax.lax.with_sharding_constraint(x, spec)` on the active mesh; `x` itself without one."""
    if active_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def constrain_rows(x: jax.Array, axis: int = 0) -> jax.Array:
    """`x` with dimension `axis` (its rows) split over the batch axes and every other dimension whole; unchanged
    without a mesh or when the rows do not split."""
    if active_mesh() is None or not jax.numpy.ndim(x):
        return x
    names = batch_axes(x.shape[axis])
    if names is None:
        return x
    parts = [None] * x.ndim
    parts[axis] = names if len(names) > 1 else names[0]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*parts))


def constrain_rows_tree(tree, axis: int = 0):
    return jax.tree.map(lambda x: constrain_rows(x, axis), tree)


_PARAM_SHARDINGS: list = []  # the parameters' shardings of the active layout (`params_sharded_as`), innermost last


@contextlib.contextmanager
def params_sharded_as(shardings):
    """Within this block `like_params` constrains parameter-shaped trees to `shardings` (a params tree of
    `NamedSharding`s; `Layout.activate` sets it with the mesh)."""
    _PARAM_SHARDINGS.append(shardings)
    try:
        yield
    finally:
        _PARAM_SHARDINGS.pop()


def like_params(tree):
    """A tree with the parameters' structure (gradients, their float32 accumulator) constrained to the
    parameters' shardings, so GSPMD keeps it split like the parameters and the optimizer reads it in place;
    unchanged without a mesh, without registered shardings or when the structure differs."""
    if active_mesh() is None or not _PARAM_SHARDINGS:
        return tree
    shardings = _PARAM_SHARDINGS[-1]
    if jax.tree.structure(tree) != jax.tree.structure(shardings):
        return tree
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, s), tree, shardings)


def after_lookup(x: jax.Array, table_path: tuple[str, ...]) -> jax.Array:
    """The rows `x [B, ..., D]` just gathered from a table parameter (the embedding), constrained to the layout
    the gather produces without moving data: D split like the table's last dimension, the rows over the batch
    axes that split does not use. GSPMD can reach that from the table and the token ids directly, and go on
    from it to rows over every batch axis (`constrain_rows`) with one all-to-all; asked for that final layout
    straight from the gather (or, in the backward pass, for the scatter-add of the table's gradient from it),
    it replicates the activation instead ("involuntary full rematerialization"). Unchanged without a mesh or
    registered parameter shardings, or when the table's last dimension is whole."""
    mesh = active_mesh()
    if mesh is None or not _PARAM_SHARDINGS or not jax.numpy.ndim(x):
        return x
    node = _PARAM_SHARDINGS[-1]
    try:
        for key in table_path:
            node = node[key]
    except (KeyError, TypeError):
        return x
    spec = tuple(node.spec)
    last = spec[-1] if len(spec) == 2 else None
    if last is None:
        return x
    used = (last,) if isinstance(last, str) else tuple(last)
    names = [n for n in BATCH_AXES if n in mesh.shape and mesh.shape[n] > 1 and n not in used]
    while names:
        ways = 1
        for n in names:
            ways *= mesh.shape[n]
        if x.shape[0] % ways == 0:
            break
        names = names[:-1]
    rows = None if not names else names[0] if len(names) == 1 else tuple(names)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(rows, *([None] * (x.ndim - 2)), last))
