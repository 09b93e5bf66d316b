"""The names of the device mesh's axes (outermost first; `reno_jax.parallel.mesh` sizes and builds the mesh).

data    pure data parallelism: parameters replicated, batch split
fsdp    data parallelism with parameters (and optimizer state) sharded, gathered layer by layer
expert  routed experts split across devices (the batch is split over it too)
tensor  attention heads / MLP width split across devices (the batch is not)
"""

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# Mesh axes a batch dimension is split over (tensor-parallel shards see the whole batch).
BATCH_AXES = ("data", "fsdp", "expert")
