"""Scale-out on JAX's own engine: the named device mesh (`mesh`) and the sharding rules (`rules`)."""

from reno_jax.parallel.mesh import (BATCH_AXES, MESH_AXES, MeshConfig, MeshError, batch_axes_size,  # noqa: F401
                                    check_batch_divides, describe_batch_ways, make_mesh, resolve_here)
from reno_jax.parallel.rules import (PRESETS, ShardingError, batch_sharding, fit_spec, follow_params,  # noqa: F401
                                     logical_to_spec, param_logical_axes, param_partition_specs, param_shardings,
                                     preset_rules, specs_to_json)
from reno_jax.parallel.layout import Layout  # noqa: F401
