"""One GSPO step of Ling-3.0-tiny at its real shape with random weights: rollout time, train-step time, peak memory.

The published AReno setting (configs/areno_ling3_tiny.py): 4 boards x 4 samples, up to 1471 new tokens, bf16
parameters, GSPO, 8-bit Adam moments, micro-batched backward. Random weights never emit a tool call, so every
row generates the full --max-new-tokens: the rollout time is the worst case of a step (the published run started
near that length and ended near 850 tokens).
The programs and the figures read off them are `reno_jax/real_shape.py`'s, shared with benchmarks/gpu_check.py
and benchmarks/sharded_plan.py.

  python benchmarks/real_shape_step.py --remat --share-prefix    # real shape on a GPU: XLA plans 92.4 GB for the
                                                  # train step, 16.9 GB for the rollout (neither flag: 341 GB)
  python benchmarks/real_shape_step.py --synthetic-batch --remat --share-prefix    # train step only
  python benchmarks/real_shape_step.py --model tiny --max-new-tokens 32 --steps 2    # CPU smoke run
  python benchmarks/real_shape_step.py --remat --share-prefix \
      --compile-only benchmarks/gpu_targets/h200.txtpb        # no GPU: XLA's memory plan for an H200
  python benchmarks/real_shape_step.py --remat --share-prefix --lora-rank 8 --quantize int8 \
      --compile-only benchmarks/gpu_targets/rtx4090_24g.txtpb # LoRA over a frozen int8 base, a 24 GB card

--lora-rank R: the published setting's LoRA (configs/areno_ling3_tiny.py's `lora` block at rank R: alpha 32,
per-expert adapters on every projection, none on the token tables) over a frozen base, which is an argument of
the programs and never differentiated (`trainer.make_train_step(combine=policy.Adapted(...))`); the optimizer
state covers the adapters only, and the rollout runs the adapted weights (`lora.LoraKernel` leaves). --quantize
int8: that base in int8 weight-only (`quant.quantize`, per-channel scales; drawn leaf by leaf, so the bf16 model is
never whole in memory). Peak host memory (`ru_maxrss`) is reported on every backend. A CPU run at the real shape
(`--boards 1 --group-size 1 --max-new-tokens 8 --microbatches 1 --cpu-dense-moe`, docs/gpu.md) shows the
programs run and what they hold in host memory.

--compile-only needs no accelerator: the train step is lowered on abstract shapes and compiled by XLA's GPU
compiler for a device described by a GpuTargetConfig text proto (deviceless ahead-of-time compilation; needs the
benchmark-only extra `pip install "jax[cuda12]"` and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 on a machine without a
driver). It reports the compiled program's memory analysis (arguments, outputs, donated aliases, temporaries)
instead of timings: the memory XLA will ask for on that device, without running anything.

Phases, each printed as it finishes (compile time reported separately from the timed runs):
  init     random bf16 parameters, `ling3.init_params` (HF-style kinds; at the real shape one jitted
           program per leaf shape, drawn on the device).
  rollout  `rollout.make_rollout_fn` on the move task (prefill, decode with caches, parse, reward);
           first call = compile + run, then --steps timed calls.
  train    `trainer.make_train_step` with the GSPO loss on that rollout's batch (random advantages, so the
           gradient is not zero), int8 Adam moments; first call = compile + run, then --steps timed calls.
Peak device memory is the allocator's `peak_bytes_in_use` (GPU/TPU; absent on CPU).
The last output line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import areno_ling3_tiny
from reno_jax import real_shape as rs
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.models import layers, ling3
from reno_jax.rl import policy, trainer


def lora_of(args):
    """The published setting's LoRA (configs/areno_ling3_tiny.py's block) at rank --lora-rank; None: the full
    fine-tune."""
    return rs.lora_config(args.lora_rank, areno_ling3_tiny.get_config())


def move_task(args):
    """The published setting's rollout task and starts: tic-tac-toe's move task on the first --boards boards of
    seed 1234."""
    boards = np.asarray(boards_lib.generate_boards(args.boards, seed=1234), np.int8)
    return ttt_env.TicTacToeEnv.create("move"), ttt_env.move_starts(boards)


def compile_only_device(target_path: str):
    """A compile-only GPU device described by a GpuTargetConfig text proto (no driver or GPU needed)."""
    from jax.experimental import topologies

    with open(target_path) as f:
        target = f.read()
    try:
        topo = topologies.get_topology_desc("compile-only", "cuda", target_config=target, topology="1x1x1")
    except NotImplementedError as e:
        raise SystemExit(
            f"--compile-only needs JAX's CUDA plugin (benchmark-only extra: pip install "
            f"'jax[cuda12]=={jax.__version__}'; without a driver also set "
            f"JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1): {e}"
        ) from e
    return topo.devices[0]


def on_device(tree, device):
    """Abstract shapes of ``tree`` placed on ``device`` (what ``jit(...).lower`` needs for a compile-only device)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_only(args, config, res):
    """Lower + compile the train step for a compile-only device and report XLA's memory plan (nothing runs)."""
    device = compile_only_device(args.compile_only)
    res.update(backend="compile-only", device=str(device.device_kind), target_config=args.compile_only)
    params = rs.base_params(args, config, jax.random.PRNGKey(0), abstract=True)
    res["param_bytes"] = rs.tree_bytes(params)
    trained, frozen = rs.trained_and_frozen(lora_of(args), params, abstract=True)
    res["trained_param_bytes"] = rs.tree_bytes(trained)
    optimizer, step_fn = rs.make_step(args, config, lora_of(args))
    state = jax.eval_shape(lambda p: trainer.create_train_state(p, optimizer, jax.random.PRNGKey(2)), trained)
    res["optimizer_state_bytes"] = rs.tree_bytes(state.opt_state)

    def make_batch(key):
        traj = rs.synthetic_batch(args, config, key)
        return rs.train_batch(args, traj, jax.random.normal(key, traj.reward.shape, jnp.float32), rs.PROMPT_LEN)

    batch = jax.eval_shape(make_batch, jax.random.PRNGKey(1))
    res["rollout_rows"], res["rollout_length"] = args.boards * args.group_size, rs.PROMPT_LEN + args.max_new_tokens
    if not args.synthetic_batch:  # the rollout program too (its tables and start boards as abstract arguments)
        rollout_fn, key, starts, env = rs.rollout_setup(args, config, *move_task(args))
        t0 = time.perf_counter()
        compiled = rollout_fn.lower(
            on_device(rs.model_params(lora_of(args), trained, frozen), device),
            on_device(key, device),
            on_device(starts, device),
            env=on_device(env, device),
        ).compile()
        res["rollout_compile_s"] = time.perf_counter() - t0
        res.update({f"rollout_{k}": v for k, v in rs.memory_figures(compiled).items()})
        print("[rollout] " + json.dumps(res), flush=True)
    t0 = time.perf_counter()
    extra = () if frozen is None else (on_device(frozen, device),)
    lowered = step_fn.lower(on_device(state, device), on_device(batch, device), *extra)
    res["train_lower_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    res["train_compile_s"] = time.perf_counter() - t0
    res.update({f"train_{k}": v for k, v in rs.memory_figures(compiled).items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res))


def run_rollout(args, config, params, res):
    """The rollout phase on `params` (the model's params, adapted or not)."""
    rollout_fn, key, starts, env = rs.rollout_setup(args, config, *move_task(args))
    rollout_fn = functools.partial(rollout_fn, env=env)
    traj, first = rs.timed(rollout_fn, params, key, starts)
    res["rollout_first_call_s"] = first
    times = []
    for i in range(args.steps):
        traj, dt = rs.timed(rollout_fn, params, jax.random.fold_in(key, i + 1), starts)
        times.append(dt)
    gen = int(np.asarray(traj.loss_mask).sum())
    res["rollout_rows"] = int(traj.tokens.shape[0])
    res["rollout_length"] = int(traj.tokens.shape[1])
    res["rollout_generated_tokens"] = gen
    if times:
        res["rollout_s"] = float(np.median(times))
        res["rollout_generated_tokens_per_s"] = gen / res["rollout_s"]
    return traj


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["real", "tiny"], default="real")
    ap.add_argument("--boards", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1471)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--state-dtype", default="int8", choices=["int8", "bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=2, help="timed calls of each phase after the compiling one")
    ap.add_argument(
        "--synthetic-batch",
        action="store_true",
        help="skip the rollout; train on random tokens of the rollout's shape (prompt + max-new-tokens)",
    )
    ap.add_argument("--remat", action="store_true", help="recompute each layer in the backward pass")
    ap.add_argument("--share-prefix", action="store_true", help="encode each group's prompt once (rl.shared_prefix)")
    ap.add_argument(
        "--entropy",
        action="store_true",
        help="also compute the per-token entropy in the train step, as the training loop does (a logged metric)",
    )
    ap.add_argument(
        "--compile-only",
        default="",
        metavar="TARGET",
        help="no device: compile the train step for the GPU described by this GpuTargetConfig text "
        "proto and report XLA's memory plan (the rollout's too, unless --synthetic-batch)",
    )
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank over a frozen base (configs/areno_ling3_tiny.py's lora "
        "block); 0: the full fine-tune",
    )
    ap.add_argument(
        "--quantize", default="", choices=["", "int8"], help="the frozen base in int8 weight-only (needs --lora-rank)"
    )
    ap.add_argument(
        "--cpu-dense-moe",
        action="store_true",
        help="on CPU, run every routed expert on every token (`layers.moe_dense_reference`, the "
        "model's CPU choice for <= 16 experts): E*N expert rows instead of the E*N*K of XLA:CPU's "
        "dense ragged_dot fallback (decode and short sequences; for a CPU run at the real shape); "
        "also sets XLA:CPU's memory-minimising scheduler and turns its CSE pass off (see main)",
    )
    ap.add_argument(
        "--logits-chunk",
        type=int,
        default=0,
        help="make the train step's logits this many positions at a time (`policy.make_logp_fn("
        "logits_chunk=)`): no [rows, tokens, vocab] array; 0: all at once",
    )
    ap.add_argument(
        "--recompute-old-logp",
        action="store_true",
        help="score the rollout with the train forward and use that as old_logp (GSPO's ratio then "
        "starts at 1); default: the rollout's own log-probs, whose gap to the train forward can put "
        "the ratio outside the published clip range (3e-4 / 4e-4), where the gradient is zero",
    )
    ap.add_argument(
        "--num-layers",
        type=int,
        default=0,
        help="keep only the first N decoder layers of the model (same widths; for memory studies: "
        "XLA compiles a few layers in minutes, and a plan's per-layer part scales with N)",
    )
    ap.add_argument("--out", default="", help="also write the JSON figures to this file after each phase")
    args = ap.parse_args(argv)
    if args.cpu_dense_moe:
        # A CPU run at the real shape. XLA:CPU's default scheduler favours concurrency: in a decode loop it
        # dequantizes (and widens to float32) every layer's weights at the top of the loop body, all live at once
        # (31.2 GB); the memory-minimising scheduler dequantizes each weight where it is used. And XLA's common-
        # subexpression pass merges the backward pass's recomputed dequantization with the forward's, keeping
        # every layer's float32 experts live from one to the other (1.3 GB per MoE layer, 31.5 GB in all).
        # Read when the CPU backend starts (nothing has started it yet).
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
            + " --xla_disable_hlo_passes=cse"
        ).strip()
    if args.quantize and not args.lora_rank:
        ap.error("--quantize int8 needs --lora-rank > 0 (an int8 base is frozen)")

    res = {
        "backend": jax.default_backend(),
        "device": str(jax.local_devices()[0].device_kind),
        "jax": jax.__version__,
        "model": args.model,
        "boards": args.boards,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "microbatches": args.microbatches,
        "optimizer_state_dtype": args.state_dtype,
        "remat": args.remat,
        "share_prefix": args.share_prefix,
        "entropy": args.entropy,
        "num_layers": args.num_layers or None,
        "logits_chunk": args.logits_chunk,
        "recompute_old_logp": args.recompute_old_logp,
        "lora_rank": args.lora_rank,
        "quantize": args.quantize or None,
    }

    def report(phase):
        res["peak_bytes_in_use"] = rs.peak_bytes()
        res["peak_rss_bytes"] = rs.peak_rss_bytes()
        print(f"[{phase}] " + json.dumps(res), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    config = ling3.ling3_tiny_real() if args.model == "real" else ling3.tiny_test_config(vocab_size=512)
    if args.num_layers:
        config = dataclasses.replace(config, num_hidden_layers=args.num_layers)
    if args.cpu_dense_moe:
        layers.DENSE_DISPATCH_MAX_EXPERTS = config.num_experts
    res["cpu_dense_moe"] = args.cpu_dense_moe
    counts = ling3.count_params(config)
    res.update(params_total=counts["total"], params_active=counts["active"])
    if args.compile_only:  # traced as for the GPU (the default backend here is the CPU; see layers.platform)
        with layers.trace_for_platform("gpu"):
            return compile_only(args, config, res)
    # The RngBitGenerator key: drawing 7.9B random values with the default threefry takes ~20 min on 2 CPU cores.
    params, res["init_s"] = rs.timed(rs.base_params, args, config, jax.random.key(0, impl="rbg"))
    res["param_bytes"] = rs.tree_bytes(params)
    trained, frozen = rs.trained_and_frozen(lora_of(args), params)
    del params
    res["trained_param_bytes"] = rs.tree_bytes(trained)
    report("init")

    if args.synthetic_batch:
        traj = rs.synthetic_batch(args, config, jax.random.PRNGKey(1))
        res["rollout_rows"], res["rollout_length"] = traj.tokens.shape
    else:
        traj = run_rollout(args, config, rs.model_params(lora_of(args), trained, frozen), res)
    report("rollout")

    optimizer, step_fn = rs.make_step(args, config, lora_of(args))
    state = trainer.create_train_state(trained, optimizer, jax.random.PRNGKey(2))
    del trained
    extra = () if frozen is None else (frozen,)
    opt_bytes = rs.tree_bytes(state.opt_state)
    res["optimizer_state_bytes"] = opt_bytes
    adv = jax.random.normal(jax.random.PRNGKey(3), traj.reward.shape, jnp.float32)
    batch = rs.train_batch(args, traj, adv, int(jnp.min(traj.prompt_length)))
    del traj
    if args.recompute_old_logp:  # the ratio starts at exactly 1: inside any clip range, so the gradient is not zero
        logp_fn = jax.jit(
            policy.make_logp_fn(config, with_entropy=False, group_size=args.group_size, logits_chunk=args.logits_chunk)
        )
        batch = batch.replace(old_logp=logp_fn(rs.model_params(lora_of(args), state.params, frozen), batch).logp)
    (state, metrics), res["train_first_call_s"] = rs.timed(step_fn, state, batch, *extra)
    report("train first call")
    times = []
    for _ in range(args.steps):
        (state, metrics), dt = rs.timed(step_fn, state, batch, *extra)
        times.append(dt)
    res["train_step_s"] = float(np.median(times)) if times else None
    res["train_tokens"] = int(np.asarray(batch.valid).sum())
    res["train_loss"] = float(metrics["loss"])
    res["train_grad_norm"] = float(metrics["grad_norm"])
    res["train_skipped_updates"] = int(state.skipped_updates)
    if res.get("rollout_s") and res["train_step_s"]:
        res["gspo_step_s"] = res["rollout_s"] + res["train_step_s"]
    report("train")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
