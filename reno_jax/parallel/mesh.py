"""The device mesh: the four named axes of `reno_jax.sharding.axes` (outermost first, so that `data` replicas are
furthest apart and `tensor` shards are neighbours), sized from a config, checked against the devices there are.

`MeshConfig` sizes them (`-1`: every device left over, at most one axis); the default, all ones, is the single
device every program ran on before, so nothing changes for a user with one device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np

from reno_jax.sharding.axes import BATCH_AXES, MESH_AXES


class MeshError(ValueError):
    """A mesh that cannot be built on the devices at hand; the message names the sizes."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the named mesh axes (`-1`: all remaining devices) and the sharding-rule preset."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    preset: str = "dp"

    @classmethod
    def from_config(cls, mesh: Any | None) -> "MeshConfig":
        """From a `config.mesh` ConfigDict / dict (absent fields: defaults; `None`: the single-device mesh)."""
        if mesh is None:
            return cls()
        get = mesh.get if hasattr(mesh, "get") else lambda k, d: getattr(mesh, k, d)
        fields = {f.name: get(f.name, f.default) for f in dataclasses.fields(cls)}
        return cls(**fields)

    @classmethod
    def from_string(cls, text: str) -> "MeshConfig":
        """From `"axis=size,...,preset=name"` (e.g. `"fsdp=4,preset=fsdp"`; absent fields: defaults, "" the
        single-device mesh): the command-line form of a `config.mesh` section. Raises `MeshError`."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in fields:
                raise MeshError(f"expected comma-separated NAME=VALUE with NAME one of {sorted(fields)}, got {part!r}")
            try:
                values[name] = value.strip() if name == "preset" else int(value)
            except ValueError:
                raise MeshError(f"mesh axis {name} must be an integer, got {value!r}") from None
        return cls(**values)

    def sizes(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in MESH_AXES}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with `-1` filled in; raises `MeshError` unless they multiply to `num_devices`."""
        sizes = self.sizes()
        bad = {k: v for k, v in sizes.items() if v == 0 or v < -1}
        if bad:
            raise MeshError(f"mesh axis sizes must be >= 1 or -1 (all remaining devices), got {bad}")
        free = [k for k, v in sizes.items() if v == -1]
        if len(free) > 1:
            raise MeshError(f"at most one mesh axis may be -1, got {free}")
        fixed = math.prod(v for v in sizes.values() if v != -1)
        if free:
            if num_devices % fixed:
                raise MeshError(
                    f"mesh {self._describe(sizes)} needs the {num_devices} devices to be a multiple of "
                    f"{fixed}, the product of the fixed axes"
                )
            sizes[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise MeshError(
                f"mesh {self._describe(sizes)} has {fixed} devices but {num_devices} are available; "
                f"make the axis sizes multiply to {num_devices} (or set one axis to -1)"
            )
        return sizes

    @staticmethod
    def _describe(sizes: dict[str, int]) -> str:
        return "(" + ", ".join(f"{k}={v}" for k, v in sizes.items()) + ")"


def make_mesh(mesh_config: MeshConfig | None = None, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """The `jax.sharding.Mesh` of `mesh_config` over `devices` (default: all devices of all processes; the
    all-ones default mesh takes the first device only, any other mesh must use every device).

    Devices are laid out by `jax.make_mesh` (topology-aware on TPU/GPU), so neighbouring `tensor` / `expert`
    shards land on the best-connected devices. The axes are `Auto` (GSPMD): the programs are written for one
    device and the compiler propagates the parameters' and the batch's shardings through them, inserting the
    collectives, rather than every op naming its output sharding.
    """
    mesh_config = mesh_config or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    if all(v == 1 for v in mesh_config.sizes().values()):
        devices = devices[:1]  # the default: one device, as every program ran before meshes existed
    sizes = mesh_config.resolve(len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    try:
        return jax.make_mesh(
            shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices
        )
    except (ValueError, NotImplementedError):  # device kinds make_mesh has no topology model for
        return jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES)


def resolve_here(mesh_config: MeshConfig) -> dict[str, int]:
    """The axis sizes `mesh_config` takes on this run's devices, as `make_mesh` lays it out (the all-ones default on
    one device, any other mesh over every device); `MeshError` when it cannot be built here, including a
    multi-process run whose mesh leaves some process's devices out."""
    ones = all(v == 1 for v in mesh_config.sizes().values())
    sizes = mesh_config.resolve(1 if ones else jax.device_count())
    if jax.process_count() > 1 and math.prod(sizes.values()) != jax.device_count():
        raise MeshError(
            f"a run of {jax.process_count()} processes needs a mesh over all {jax.device_count()} "
            "devices (an axis of -1 takes all remaining ones)"
        )
    return sizes


def describe_batch_ways(sizes: dict[str, int]) -> tuple[int, str]:
    """(ways, "data 2 x fsdp 2 x expert 1 = 4"): how many ways resolved axis `sizes` split a batch dimension."""
    ways = math.prod(sizes[name] for name in BATCH_AXES)
    return ways, " x ".join(f"{name} {sizes[name]}" for name in BATCH_AXES) + f" = {ways}"


def batch_axes_size(mesh: jax.sharding.Mesh) -> int:
    """How many ways a batch dimension is split on `mesh` (the product of the `BATCH_AXES` sizes)."""
    return describe_batch_ways(dict(mesh.shape))[0]


def check_batch_divides(batch_size: int, mesh: jax.sharding.Mesh, what: str = "batch") -> None:
    """Raises `MeshError` unless `batch_size` rows split evenly over the mesh's batch axes."""
    n, described = describe_batch_ways(dict(mesh.shape))
    if batch_size % n:
        raise MeshError(f"{what} of {batch_size} rows does not divide over the mesh's batch axes ({described})")
