"""Scale-out on JAX's own engine: the named device mesh (`mesh`), the sharding rules over the model's parameters
(`rules`) and where a run's arrays live (`layout`). The axis names and the in-program sharding hints, which the
model uses too, live below the model in `reno_jax.sharding`."""

from reno_jax.parallel.layout import Layout  # noqa: F401
from reno_jax.parallel.mesh import (
    MeshConfig,
    MeshError,
    batch_axes_size,
    check_batch_divides,  # noqa: F401
    describe_batch_ways,
    make_mesh,
    resolve_here,
)
from reno_jax.parallel.rules import (
    PRESETS,
    ShardingError,
    batch_sharding,
    fit_spec,
    follow_params,  # noqa: F401
    logical_to_spec,
    param_logical_axes,
    param_partition_specs,
    param_shardings,
    preset_rules,
    specs_to_json,
)
