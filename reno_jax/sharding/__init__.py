"""Mesh-axis names and in-program sharding hints: the bottom layer, below the model.

`axes`: the named mesh axes and the ones a batch dimension is split over. `hints`: sharding constraints that the
model and the train step place inside their programs (no-ops without a multi-device mesh). Neither knows the
model; `reno_jax.parallel` (mesh construction, sharding rules over the model's parameter table, layout) builds on
both and on `reno_jax.models`.
"""
