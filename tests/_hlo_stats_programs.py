"""Tiny sharded programs on 8 CPU devices whose collective bytes are known by hand (tests/test_hlo_stats.py runs
this in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=8); prints one JSON line."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reno_jax.parallel import hlo_stats  # noqa: E402


def main():
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    sh = lambda *spec: NamedSharding(mesh, P(*spec))
    a = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=sh("x", None))
    b = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=sh(None, "x"))
    w = jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=sh("x", None))
    programs = {
        # rows split 8 ways -> every device holds all 64 rows: one all-gather
        "all_gather": (lambda x: jax.lax.with_sharding_constraint(x * 2.0, sh(None, None)), (a,)),
        # a column sum over the split rows: one all-reduce of f32[128]
        "all_reduce": (lambda x: jnp.sum(x * 2.0, axis=0), (a,)),
        # the same inside a 3-step loop whose sum depends on the step (not hoisted): 3 executions
        "all_reduce_loop": (
            lambda x: jax.lax.fori_loop(
                0, 3, lambda i, c: c + jnp.sum(x * i.astype(jnp.float32), axis=0), jnp.zeros((128,))
            ),
            (a,),
        ),
        # contracting dimension split, output split by rows: partial products reduce-scattered
        "reduce_scatter": (lambda x, y: jax.lax.with_sharding_constraint(x @ y, sh("x", None)), (b, w)),
        # rows split -> columns split: one all-to-all
        "all_to_all": (lambda x: jax.lax.with_sharding_constraint(x * 2.0, sh(None, "x")), (a,)),
    }
    out = {}
    for name, (fn, args) in programs.items():
        text = jax.jit(fn).lower(*args).compile().as_text()
        out[name] = hlo_stats.collective_bytes(text)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
