"""Per-device memory plans and communication of the real-shape programs on N GPUs, without a GPU.

The published setting of benchmarks/real_shape_step.py (4 boards x 4 samples, 63 + 1471 tokens, remat, shared
prompt prefix, int8 Adam moments) lowered on abstract shapes placed on a mesh of N compile-only GPUs (XLA's GPU
compiler, deviceless: a `GpuTargetConfig` and the plugin's "1x1xN" topology) with the parameters, optimizer state
and batch sharded by a preset (`reno_jax.parallel`, exactly as the training loop places them), then compiled. For
each program it reports XLA's per-device memory plan (`compiled.memory_analysis()`: arguments, temporaries,
outputs, donated aliases) and the collectives in the optimised per-device HLO (`reno_jax.parallel.hlo_stats`:
bytes per kind per call, loops counted per iteration).

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu python benchmarks/sharded_plan.py \\
      --mesh fsdp=2:fsdp --mesh expert=2:fsdp_ep --mesh fsdp=8:fsdp --mesh fsdp=4,expert=2:fsdp_ep \\
      --layers 4 --layers 8          # reduced-layer variants of the real shape, extrapolated to 24 layers

  ... --cpu-devices                   # no CUDA plugin: the same lowering on N CPU devices
                                      #   (XLA_FLAGS=--xla_force_host_platform_device_count=N), XLA:CPU's plan

--layers L compiles the real shape with L layers (L a multiple of 4: the first layer dense, then groups of three
KDA + one MLA layer, all MoE, like the real model's 24). With two or more L the figures are fitted linearly in L
(every further group of four layers adds the same parameters and activations) and extrapolated to 24 layers
(printed as "fit"). Needs the benchmark-only extra `pip install "jax[cuda12]==0.10.2"` (no driver needed).

A mesh whose batch ways do not divide a program's rows: the train step runs --microbatches-for-8 micro-batches
(4 rows per micro-batch cannot split over 8 devices; 2 micro-batches of 8 rows keep every device at one row), and
the rollout's 4 start boards are replicated (its 16 rows then split only if GSPMD propagates that).
The last output line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from reno_jax import parallel
from reno_jax import real_shape as rs
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.models import layers, ling3
from reno_jax.parallel import hlo_stats
from reno_jax.rl import trainer

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9


def parse_mesh(text: str) -> parallel.MeshConfig:
    """ "fsdp=4,expert=2:fsdp_ep" -> MeshConfig(fsdp=4, expert=2, preset="fsdp_ep")."""
    axes, _, preset = text.partition(":")
    sizes = {k: int(v) for k, v in (p.split("=") for p in axes.split(",") if p)}
    return parallel.MeshConfig(preset=preset or "fsdp", **sizes)


def mesh_label(mc: parallel.MeshConfig) -> str:
    sizes = " x ".join(f"{k} {v}" for k, v in mc.sizes().items() if v > 1)
    return f"{sizes} / {mc.preset}"


def devices_for(n: int, args):
    if args.cpu_devices:
        devs = jax.devices("cpu")
        if len(devs) < n:
            raise SystemExit(
                f"--cpu-devices needs XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                f"(have {len(devs)} CPU devices)"
            )
        return devs[:n]
    from jax.experimental import topologies

    with open(args.target) as f:
        target = f.read()
    topo = topologies.get_topology_desc("compile-only", "cuda", target_config=target, topology=f"1x1x{n}")
    return list(topo.devices)


def abstract_with(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def batch_shardings(tree, mesh):
    """The training loop's `Layout.place_batch`: rows over the batch axes (scalars replicated)."""

    def one(x):
        if not x.ndim:
            return NamedSharding(mesh, PartitionSpec())
        parallel.check_batch_divides(x.shape[0], mesh)
        return parallel.batch_sharding(mesh, x.ndim)

    return jax.tree.map(one, tree)


def hlo_path(dump_dir: str, key: str) -> str:
    return os.path.join(dump_dir, key.replace("/", "_").replace(" ", "") + ".hlo.txt")


def collective_figures(figs: dict, text: str) -> None:
    figs["collectives"] = hlo_stats.collective_bytes(text)
    loops = figs["collectives"]["per_unknown_loop_iteration"]
    if loops:  # the rollout: its innermost loop of unknown trip count is the decode loop (one token per row)
        inner = max(loops.values(), key=lambda v: v["nesting"])
        figs["decode_step_traffic_bytes"] = {k: inner[k]["traffic_bytes"] for k in hlo_stats.KINDS + ("total",)}


def move_task(args):
    """The published setting's rollout task and starts: tic-tac-toe's move task on the first --boards boards of
    seed 1234."""
    boards = np.asarray(boards_lib.generate_boards(args.boards, seed=1234), np.int8)
    return ttt_env.TicTacToeEnv.create("move"), ttt_env.move_starts(boards)


def compile_program(label, fn_lower, res, key):
    t0 = time.perf_counter()
    lowered = fn_lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    figs = rs.memory_figures(compiled)
    figs.update(lower_s=round(t1 - t0, 1), compile_s=round(t2 - t1, 1))
    text = compiled.as_text()
    collective_figures(figs, text)
    if res.get("dump_dir"):
        with open(hlo_path(res["dump_dir"], key), "w") as f:
            f.write(text)
    del text, compiled, lowered
    res["programs"][key] = figs
    c = figs["collectives"]["total"]
    print(
        f"[{key}] args {figs['argument_bytes'] / GB:.2f} GB, temp {figs['temp_bytes'] / GB:.2f} GB, "
        f"peak {figs['estimated_peak_bytes'] / GB:.2f} GB, collectives {c['count']} ops / "
        f"{c['traffic_bytes'] / GB:.2f} GB sent per device; compile {figs['compile_s']} s",
        flush=True,
    )
    return figs


def plan(args, mc: parallel.MeshConfig, layers_n: int, res):
    real = ling3.ling3_tiny_real()
    config = real if layers_n == real.num_hidden_layers else dataclasses.replace(real, num_hidden_layers=layers_n)
    n = int(np.prod([v for v in mc.sizes().values()]))
    devices = devices_for(n, args)
    layout = parallel.Layout.create(config, mc, devices=devices)
    mesh = layout.mesh
    ways = parallel.batch_axes_size(mesh)
    rows = args.boards * args.group_size
    micro = args.microbatches
    if (rows // micro) % ways:
        micro = args.microbatches_for_8
    ns = argparse.Namespace(**vars(args))
    ns.microbatches, ns.remat, ns.share_prefix, ns.entropy, ns.synthetic_batch = micro, True, True, False, True
    ns.logits_chunk = 0  # the whole train step at once: what the plan measures
    base = f"{mesh_label(mc)} / {layers_n} layers"

    params = jax.eval_shape(lambda k: ling3.init_params(config, k, jnp.bfloat16), jax.random.PRNGKey(0))
    params_s = abstract_with(params, layout.param_shardings)
    if "train" in args.programs:
        optimizer, step_fn = rs.make_step(ns, config, None)
        state = jax.eval_shape(lambda p: trainer.create_train_state(p, optimizer, jax.random.PRNGKey(2)), params)
        state_s = layout.abstract_state(state)

        def make_batch(key):
            traj = rs.synthetic_batch(ns, config, key)
            return rs.train_batch(ns, traj, jax.random.normal(key, traj.reward.shape, jnp.float32), rs.PROMPT_LEN)

        batch = jax.eval_shape(make_batch, jax.random.PRNGKey(1))
        batch_s = abstract_with(batch, batch_shardings(batch, mesh))
        with layout.activate():  # the programs' sharding constraints see the mesh, as in the training loop
            figs = compile_program("train", lambda: step_fn.lower(state_s, batch_s), res, f"train / {base}")
        figs.update(mesh=mc.sizes(), preset=mc.preset, layers=layers_n, program="train", microbatches=micro, devices=n)
    if "rollout" in args.programs:
        rollout_fn, key, starts, env = rs.rollout_setup(ns, config, *move_task(ns))
        rep = NamedSharding(mesh, PartitionSpec())
        starts_split = all(np.ndim(x) == 0 or np.shape(x)[0] % ways == 0 for x in jax.tree.leaves(starts))
        starts_sh = batch_shardings(starts, mesh) if starts_split else jax.tree.map(lambda _: rep, starts)
        as_abstract = lambda t, s: jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), t, s)
        key_s = as_abstract(key, rep)
        starts_a = as_abstract(starts, starts_sh)
        env_a = as_abstract(env, jax.tree.map(lambda _: rep, env))
        with layout.activate():
            figs = compile_program(
                "rollout", lambda: rollout_fn.lower(params_s, key_s, starts_a, env=env_a), res, f"rollout / {base}"
            )
        figs.update(
            mesh=mc.sizes(), preset=mc.preset, layers=layers_n, program="rollout", devices=n, starts_split=starts_split
        )


def plan_moe_layer(args, mc: parallel.MeshConfig, res):
    """One MoE layer of the real shape alone (`layers.moe`, the train step's micro-batch: rows x (1471 + 1) tokens
    of the continuation), forward and backward (`jax.value_and_grad` w.r.t. its parameters and input), on the
    mesh: the collectives the dispatch itself runs."""
    config = ling3.ling3_tiny_real()
    n = int(np.prod(list(mc.sizes().values())))
    layout = parallel.Layout.create(config, mc, devices=devices_for(n, args))
    mesh = layout.mesh
    ways = parallel.batch_axes_size(mesh)
    rows = args.boards * args.group_size // args.microbatches
    if rows % ways:
        rows = args.boards * args.group_size // args.microbatches_for_8
    params = jax.eval_shape(lambda k: ling3.init_params(config, k, jnp.bfloat16), jax.random.PRNGKey(0))
    p = abstract_with(params["model"]["layers_1"]["mlp"], layout.param_shardings["model"]["layers_1"]["mlp"])
    x = jax.ShapeDtypeStruct(
        (rows, args.max_new_tokens, config.hidden_size), jnp.bfloat16, sharding=parallel.batch_sharding(mesh, 3)
    )

    def loss(p, x):
        return jnp.sum(layers.moe(p, x, config).astype(jnp.float32))

    # Gradients returned split like the parameters and the input, as the train step's accumulator keeps them.
    p_sh = layout.param_shardings["model"]["layers_1"]["mlp"]
    scalar = NamedSharding(mesh, PartitionSpec())
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), out_shardings=(scalar, (p_sh, x.sharding)))
    key = f"moe layer / {mesh_label(mc)} / {rows} x {args.max_new_tokens} tokens"
    with layout.activate():
        figs = compile_program("moe", lambda: fn.lower(p, x), res, key)
    figs.update(
        mesh=mc.sizes(), preset=mc.preset, program="moe layer", devices=n, rows=rows, tokens=rows * args.max_new_tokens
    )


FIELDS = ("argument_bytes", "temp_bytes", "output_bytes", "alias_bytes", "estimated_peak_bytes")


def fit(res, target_layers: int = 24):
    """Linear fit in the layer count of every figure, per (program, mesh/preset), extrapolated to target_layers."""
    groups: dict = {}
    for key, f in res["programs"].items():
        if "layers" in f:
            groups.setdefault((f["program"], json.dumps(f["mesh"]), f["preset"]), []).append(f)
    out = {}
    for (program, mesh, preset), fs in groups.items():
        fs = sorted(fs, key=lambda f: f["layers"])
        if len({f["layers"] for f in fs}) < 2:
            continue
        x = np.array([f["layers"] for f in fs], float)
        row = {
            "program": program,
            "mesh": json.loads(mesh),
            "preset": preset,
            "from_layers": x.tolist(),
            "devices": fs[0]["devices"],
        }
        series = {k: [f[k] for f in fs] for k in FIELDS}
        for kind in hlo_stats.KINDS + ("total",):
            series[f"{kind}_traffic_bytes"] = [f["collectives"][kind]["traffic_bytes"] for f in fs]
            series[f"{kind}_count"] = [f["collectives"][kind]["count"] for f in fs]
            if all("decode_step_traffic_bytes" in f for f in fs):
                series[f"decode_step_{kind}_traffic_bytes"] = [f["decode_step_traffic_bytes"][kind] for f in fs]
        for k, ys in series.items():
            slope, icpt = np.polyfit(x, np.array(ys, float), 1)
            row[k] = int(round(icpt + slope * target_layers))
            row[k + "_per_layer"] = int(round(slope))
        out[f"{program} / {mesh_label(parallel.MeshConfig(preset=preset, **row['mesh']))} / fit {target_layers}"] = row
    return out


def decode_table(rows, steps: int) -> str:
    """Rollouts: collectives per decode step (the decode loop's body, sent per device) and for `steps` steps."""
    lines = [
        "| rollout | mesh / preset | layers | per decode step: all-gather / reduce-scatter / all-reduce / "
        "all-to-all / permute | per step, total | x " + str(steps) + " steps | outside the decode loop |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, f in rows.items():
        if not key.startswith("rollout"):
            continue
        if "decode_step_traffic_bytes" in f:
            step = f["decode_step_traffic_bytes"]
        elif "decode_step_total_traffic_bytes" in f:
            step = {k: f[f"decode_step_{k}_traffic_bytes"] for k in hlo_stats.KINDS + ("total",)}
        else:
            continue
        total = f["collectives"]["total"]["traffic_bytes"] if "collectives" in f else f["total_traffic_bytes"]
        parts = key.split(" / ")
        lines.append(
            f"| rollout | {' / '.join(parts[1:-1])} | {parts[-1]} | "
            + " / ".join(f"{step[k] / 1e6:.2f}" for k in hlo_stats.KINDS)
            + f" MB | {step['total'] / 1e6:.2f} MB | {step['total'] * steps / GB:.2f} GB | "
            f"{(total - step['total']) / GB:.2f} GB |"
        )
    return "\n".join(lines)


def table(rows) -> str:
    lines = [
        "| program | mesh / preset | layers | arguments | temporaries | outputs - aliased | estimated peak |"
        " collectives sent per device: all-gather / reduce-scatter / all-reduce / all-to-all / permute |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, f in rows.items():
        coll = (
            f["collectives"]
            if "collectives" in f
            else {k: {"traffic_bytes": f[f"{k}_traffic_bytes"]} for k in hlo_stats.KINDS}
        )
        c = " / ".join(f"{coll[k]['traffic_bytes'] / GB:.2f}" for k in hlo_stats.KINDS)
        prog, label = key.split(" / ", 1)[0], " / ".join(key.split(" / ")[1:-1])
        lines.append(
            f"| {prog} | {label} | {key.split(' / ')[-1]} | {f['argument_bytes'] / GB:.2f} GB | "
            f"{f['temp_bytes'] / GB:.2f} GB | {(f['output_bytes'] - f['alias_bytes']) / GB:.2f} GB | "
            f"**{f['estimated_peak_bytes'] / GB:.2f} GB** | {c} GB |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", action="append", default=[], help="AXIS=N[,AXIS=N]:PRESET (repeatable)")
    ap.add_argument(
        "--layers",
        action="append",
        type=int,
        default=[],
        help="real shape with this many layers (repeatable; default 24, the real model)",
    )
    ap.add_argument("--programs", default="train,rollout")
    ap.add_argument("--target", default=os.path.join(HERE, "gpu_targets", "h100_80g.txtpb"))
    ap.add_argument("--cpu-devices", action="store_true", help="compile for CPU devices instead (no CUDA plugin)")
    ap.add_argument("--boards", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1471)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument(
        "--microbatches-for-8",
        type=int,
        default=2,
        help="micro-batches where a --microbatches one does not split over the batch axes",
    )
    ap.add_argument("--state-dtype", default="int8", choices=["int8", "bfloat16", "float32"])
    ap.add_argument(
        "--moe-layer",
        action="store_true",
        help="only one MoE layer's forward + backward at a micro-batch's shape (the dispatch's collectives)",
    )
    ap.add_argument(
        "--global-dispatch",
        action="store_true",
        help="one MoE dispatch over all rows, partitioned by GSPMD (layers.GROUPED_DISPATCH = False)",
    )
    ap.add_argument("--dump-dir", default="", help="also write each optimised HLO module here")
    ap.add_argument("--out", default="", help="write the JSON figures here after each program")
    ap.add_argument(
        "--reread",
        default="",
        metavar="JSON",
        help="compile nothing: re-read the collectives of a previous run's programs from the HLO it "
        "wrote to --dump-dir (after a change to reno_jax.parallel.hlo_stats) and print the tables",
    )
    args = ap.parse_args()
    args.programs = tuple(p for p in args.programs.split(",") if p)
    if args.reread:
        with open(args.reread) as f:
            res = json.load(f)
        for key, figs in res["programs"].items():
            with open(hlo_path(args.dump_dir or res["dump_dir"], key)) as f:
                collective_figures(figs, f.read())
        return report(args, res)
    meshes = [parse_mesh(m) for m in (args.mesh or ["fsdp=2:fsdp"])]
    layers.GROUPED_DISPATCH = not args.global_dispatch
    res = {
        "jax": jax.__version__,
        "backend": "cpu" if args.cpu_devices else "compile-only gpu",
        "target_config": None if args.cpu_devices else args.target,
        "boards": args.boards,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "remat": True,
        "share_prefix": True,
        "optimizer_state_dtype": args.state_dtype,
        "programs": {},
        "moe_dispatch": "global (GSPMD)" if args.global_dispatch else "per device's rows on a mesh",
        "dump_dir": args.dump_dir,
    }
    if args.dump_dir:
        os.makedirs(args.dump_dir, exist_ok=True)
    with layers.trace_for_platform("cpu" if args.cpu_devices else "gpu"):
        if args.moe_layer:
            for mc in meshes:
                plan_moe_layer(args, mc, res)
            meshes = []
        for mc in meshes:
            for n_layers in args.layers or [24]:
                plan(args, mc, n_layers, res)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(res, f, indent=1)
    report(args, res)


def report(args, res):
    res["fit"] = fit(res)
    print(table(res["programs"]))
    if res["fit"]:
        print(table(res["fit"]))
    if any(k.startswith("rollout") for k in res["programs"]):
        print(decode_table({**res["programs"], **res["fit"]}, res["max_new_tokens"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
