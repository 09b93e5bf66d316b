"""Wall time of `ling3.init_params` and of HF checkpoint loading / saving, unsharded and on a mesh.

  python benchmarks/init_load.py                                  # this checkout, one device
  PYTHONPATH=/path/to/other python benchmarks/init_load.py        # another checkout's init (e.g. before a change)
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/init_load.py --mesh=fsdp=8,preset=fsdp

Init: the tiny default model (configs/tictactoe_tiny.py's `model.tiny`, vocabulary of the shipped tokenizer)
and `tiny_test_config()`, each called twice in this fresh process: the first call includes every compile (as
the first model a test or a run builds), the second is what any further model of those shapes costs. With
--mesh, also both straight onto that mesh (this checkout only). Then `jax.eval_shape` of the real Ling-3.0-tiny
shape (7.9B parameters: traced, nothing drawn).

A mid-size model (--load_hidden; 60M parameters at 512: too large for `ling3`'s whole-model route, so drawn
leaf by leaf) is initialised too; then (this checkout only) written with `save_pretrained` and read back with
`from_pretrained`, unsharded and, with --mesh, onto the mesh's shards (then saved from them).
The last line is one JSON object with every figure (seconds).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fn, *args, **kwargs):
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, round(time.perf_counter() - t0, 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="", help="also on this mesh (MeshConfig.from_string form)")
    parser.add_argument("--load_hidden", type=int, default=512, help="hidden size of the load/save model")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    import reno_jax
    from configs import tictactoe_tiny
    from reno_jax.loop import build
    from reno_jax.models import ling3

    # The checkout whose reno_jax Python imports (the installed one, or another one on PYTHONPATH).
    repo = os.path.dirname(os.path.dirname(os.path.abspath(reno_jax.__file__)))
    res = {
        "repo": repo,
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    c = tictactoe_tiny.get_config()
    models = {
        "default_tiny": build.tiny_model_config(c, len(build.build_tokenizer(c))),
        "tiny_test_config": ling3.tiny_test_config(),
    }
    for name, config in models.items():
        res[f"{name}_params"] = ling3.count_params(config)["total"]
        for call in (1, 2):
            _, res[f"init_{name}_call{call}_s"] = timed(ling3.init_params, config, jax.random.PRNGKey(call))
    # The load / save model: hidden H, 4 layers (KDA, MLA, KDA, MLA), 16 experts, 32k vocabulary.
    h = args.load_hidden
    mid = ling3.tiny_test_config(
        hidden_size=h,
        intermediate_size=2 * h,
        num_attention_heads=h // 64,
        head_dim=64,
        moe_intermediate_size=h // 2,
        moe_shared_expert_intermediate_size=h // 2,
        num_experts=16,
        vocab_size=32768,
        q_lora_rank=h // 2,
        kv_lora_rank=h // 2,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
    )
    res["mid_params"] = ling3.count_params(mid)["total"]
    params, res["init_mid_s"] = timed(ling3.init_params, mid, jax.random.PRNGKey(0))
    if repo != ROOT:  # another checkout: its init only
        print(json.dumps(res))
        return

    from reno_jax import parallel
    from reno_jax.models import conversion

    layout = None
    if args.mesh:
        mesh_config = parallel.MeshConfig.from_string(args.mesh)
        for name, config in models.items():
            layout = parallel.Layout.create(config, mesh_config)
            for call in (1, 2):
                _, res[f"init_{name}_mesh_call{call}_s"] = timed(
                    ling3.init_params, config, jax.random.PRNGKey(call), shardings=layout.param_shardings
                )
        layout = parallel.Layout.create(mid, mesh_config)
        _, res["init_mid_mesh_s"] = timed(
            ling3.init_params, mid, jax.random.PRNGKey(0), shardings=layout.param_shardings
        )
    real = ling3.ling3_tiny_real()
    _, res["eval_shape_real_s"] = timed(
        jax.eval_shape, lambda k: ling3.init_params(real, k, jnp.bfloat16), jax.random.PRNGKey(0)
    )

    config = mid
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hf")
        _, res["save_s"] = timed(conversion.save_pretrained, params, config, path)
        _, res["load_s"] = timed(conversion.from_pretrained, path)
        if args.mesh:
            mesh_config = parallel.MeshConfig.from_string(args.mesh)
            mesh = parallel.make_mesh(mesh_config)
            shardings = functools.partial(parallel.param_shardings, mesh=mesh, preset=mesh_config.preset)
            (_, sharded), res["load_mesh_s"] = timed(conversion.from_pretrained, path, shardings=shardings)
            _, res["save_from_mesh_s"] = timed(conversion.save_pretrained, sharded, config, os.path.join(tmp, "out"))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
