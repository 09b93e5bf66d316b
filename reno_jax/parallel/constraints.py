"""Sharding constraints inside the programs, as hints to GSPMD: no-ops unless a multi-device mesh is set.

The programs are written for one device and partitioned by GSPMD from their inputs' shardings (`layout.py`).
Where propagation alone picks a bad layout (a micro-batch scan over a sharded axis, a gather whose table and
indices are sharded on different dimensions), a constraint here names the intended one. They read the mesh from
JAX's context (`with jax.set_mesh(mesh):` around tracing: `Layout.activate()`); without one, or on a one-device
mesh, every function returns its input unchanged, so the traced single-device program is the same program, bit
for bit.

Constraints never change values: only where the partitioned program keeps each intermediate (and so which
collectives it runs; the order of a cross-device reduction may change the last bits, as any resharding does).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from reno_jax.parallel.mesh import BATCH_AXES


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
