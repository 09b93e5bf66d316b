"""Where a run's arrays live: the mesh, the parameters' shardings, and how states and batches follow them.

The programs themselves (rollout, train step) are written for one device and jitted as they are: given inputs
placed here, GSPMD partitions them and inserts the collectives (parameter all-gathers, gradient reduce-scatters).
On a one-device mesh every method returns its input unchanged, so the default run is bit-for-bit what it was.

Several processes (`jax.distributed`): the mesh spans every process's devices and each array is global. Host
values (the parameters a process initialised, a batch built on the host) are taken to be the same in every
process (they are computed from the same key) and placed with `jax.make_array_from_callback`, so a process
materialises only the shards on its own devices; an array that is already global is resharded on the devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import numpy as np

from reno_jax.parallel import mesh as mesh_lib
from reno_jax.parallel import rules
from reno_jax.sharding import hints


def put(x, sharding):
    """`jax.device_put(x, sharding)`, also where `sharding` spans devices of other processes: there a host or
    process-local value (identical in every process) becomes a global array of which this process builds only
    its own shards."""
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh, the preset's parameter shardings on it, and the placement of states and batches."""

    mesh: jax.sharding.Mesh
    preset: str
    param_shardings: Any

    @classmethod
    def create(cls, model_config, mesh_config: mesh_lib.MeshConfig | None = None, devices=None) -> "Layout":
        mesh_config = mesh_config or mesh_lib.MeshConfig()
        mesh = mesh_lib.make_mesh(mesh_config, devices)
        return cls(mesh, mesh_config.preset, rules.param_shardings(model_config, mesh, mesh_config.preset))

    @property
    def single_device(self) -> bool:
        return self.mesh.size == 1

    @property
    def batch_ways(self) -> int:
        return mesh_lib.batch_axes_size(self.mesh)

    @contextlib.contextmanager
    def activate(self):
        """A context in which traced programs see this mesh (`jax.set_mesh`) and the parameters' shardings, so
        their sharding constraints (`reno_jax.sharding.hints`) apply; on one device it does nothing."""
        if self.single_device:
            yield
            return
        with jax.set_mesh(self.mesh), hints.params_sharded_as(self.param_shardings):
            yield

    def place_params(self, params):
        return params if self.single_device else self._put_tree(params, self.param_shardings)

    def state_shardings(self, state):
        """Shardings of a train state (or its abstract skeleton): every leaf follows its parameter."""
        return rules.follow_params(state, self.param_shardings, self.mesh)

    def place_state(self, state):
        return state if self.single_device else self._put_tree(state, self.state_shardings(state))

    @staticmethod
    def _put_tree(tree, shardings):
        if jax.process_count() == 1:
            return jax.device_put(tree, shardings)
        return jax.tree.map(put, tree, shardings)

    def abstract_state(self, abstract):
        """`jax.ShapeDtypeStruct` leaves with this layout's shardings: a checkpoint restored into it lands on
        this mesh, whatever mesh or process count wrote it (also on one device: Orbax needs a target sharding
        to restore a checkpoint that another topology wrote)."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, self.state_shardings(abstract)
        )

    def place_batch(self, tree):
        """Every array's leading (row) dimension split over the batch axes; raises `MeshError` if it does not
        divide."""
        if self.single_device:
            return tree

        def place(x):
            if not jax.numpy.ndim(x):  # replicated; left to jit on one process, global across several
                if jax.process_count() == 1:
                    return x
                return put(x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
            mesh_lib.check_batch_divides(x.shape[0], self.mesh)
            return put(x, rules.batch_sharding(self.mesh, jax.numpy.ndim(x)))

        return jax.tree.map(place, tree)
