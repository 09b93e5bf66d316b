"""Ling-3.0 JAX model: forward / decode throughput (tiny config, CPU) and real-size footprint (abstract shapes).

Tiny test config (`tiny_test_config()`: 4 layers [KDA, MLA, KDA, MLA], hidden 64, 8 experts top-2), float32:
  forward      `ling3.forward` on a [batch, seq] prompt without cache; tokens/s = batch * seq / time.
  decode step  one token per row through a KV/state cache of --max-length positions (`decode_step` below);
               tokens/s = batch / time per step.
Timings are the best of --repeats runs after a warm-up (compile) run.

Real Ling-3.0-tiny shape (`ling3_tiny_real()`), nothing materialised: parameter count and active parameters per
token from the shapes, the bf16 parameter / cache sizes, and `jax.jit(decode_step).lower(...).compile()
.memory_analysis()` for one decode step at --real-batch rows and --real-max-length positions with bf16 params and
cache, and the same for float32 (--no-f32 skips it).

Reading the real-size figures on the CPU backend (the only one here): they describe what XLA:CPU compiles, which is
far from what a GPU build needs.
  * temp_size: grows linearly with the number of MoE layers (measured: two identical real-size MoE layers have
    exactly twice the temp of one, about 0.8 GB each in float32, the size of two stacked expert weights, while a
    plain chain of matmuls reuses its temp). The likely cause is XLA:CPU's per-layer copies of the stacked expert
    weights for its batched dots (plus bf16 -> float32 conversions: it has no bf16 matmul kernels), which depend
    only on parameters and so are not ordered after the previous layer.
  * flops: XLA:CPU lowers `ragged_dot` densely (every expert on every routed row, see reno_jax/models/layers.py), so
    the count is about E / K times the useful expert FLOPs; `useful_decode_flops_estimate` = 2 * batch * active
    parameters is what an exact grouped GEMM does.
  XLA:GPU as shipped with jax 0.10 rewrites `ragged_dot` densely too (see benchmarks/real_shape_step.py
  --compile-only); a decode step's few rows keep the ragged dispatch, larger calls use the blocked dispatch of
  layers.py. argument/output/alias sizes (weights and cache, the cache donated and aliased) are exact.

    python benchmarks/model_forward.py [--batch 64] [--seq 64] [--max-length 128] [--repeats 5]

The last output line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

from reno_jax.models import ling3


def decode_step(params, config, tokens, cache):
    """tokens [B] int32 -> (logits [B, V] float32, cache advanced by one position)."""
    logits, cache = ling3.forward(params, config, tokens[:, None], cache)
    return logits[:, 0], cache


def _best_time(fn, repeats):
    jax.block_until_ready(fn())  # compile + warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def tiny_throughput(batch, seq, max_length, repeats):
    config = ling3.tiny_test_config()
    params = ling3.init_params(config, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, config.vocab_size)
    fwd = jax.jit(lambda p, x: ling3.forward(p, config, x)[0])
    t_fwd = _best_time(lambda: fwd(params, ids), repeats)

    step = jax.jit(decode_step, static_argnums=1, donate_argnums=3)
    cache = ling3.init_cache(config, batch, max_length)
    # Prefill half the cache so each timed step attends over a realistic number of positions.
    _, cache = jax.jit(lambda p, x, c: ling3.forward(p, config, x, c))(params, ids[:, : max_length // 2], cache)
    tok = ids[:, 0]
    state = {"cache": cache}

    def one_step():
        logits, state["cache"] = step(params, config, tok, state["cache"])
        return logits

    t_step = _best_time(one_step, repeats)
    return {
        "config": "tiny_test_config",
        "batch": batch,
        "seq": seq,
        "decode_cache_max_length": max_length,
        "forward_s": t_fwd,
        "forward_tokens_per_s": batch * seq / t_fwd,
        "decode_step_s": t_step,
        "decode_tokens_per_s": batch / t_step,
    }


def _nbytes(tree):
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _decode_step_analysis(config, batch, max_length, dtype):
    params = jax.eval_shape(lambda k: ling3.init_params(config, k, dtype), jax.random.PRNGKey(0))
    cache = jax.eval_shape(lambda: ling3.init_cache(config, batch, max_length, dtype))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(decode_step, static_argnums=1, donate_argnums=3).lower(params, config, tokens, cache).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    out = {f: int(getattr(mem, f)) for f in fields if mem is not None and hasattr(mem, f)}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out["flops"] = float(cost.get("flops", float("nan"))) if cost else float("nan")
    out["compile_s"] = compile_s
    return params, cache, out


def real_footprint(batch, max_length, with_f32):
    config = ling3.ling3_tiny_real()
    counts = ling3.count_params(config)
    params, cache, mem_bf16 = _decode_step_analysis(config, batch, max_length, jnp.bfloat16)
    extra = {}
    if with_f32:
        extra["decode_step_f32"] = _decode_step_analysis(config, batch, max_length, jnp.float32)[2]
    return {
        "config": "ling3_tiny_real",
        "params_total": counts["total"],
        "params_active_per_token": counts["active"],
        "params_embedding": counts["embedding"],
        "param_bytes_bf16": _nbytes(params),
        "decode_batch": batch,
        "decode_max_length": max_length,
        "cache_bytes_bf16": _nbytes(cache),
        "decode_step_bf16": mem_bf16,
        **extra,
        "useful_decode_flops_estimate": 2 * batch * counts["active"],
        "backend": jax.default_backend(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real-batch", type=int, default=64)
    ap.add_argument("--real-max-length", type=int, default=2048)
    ap.add_argument("--skip-real", action="store_true", help="skip the real-size compiles (about a minute on CPU)")
    ap.add_argument("--no-f32", action="store_true", help="skip the float32 real-size decode-step compile")
    args = ap.parse_args()

    out = {"tiny": tiny_throughput(args.batch, args.seq, args.max_length, args.repeats)}
    t = out["tiny"]
    print(
        f"tiny: forward {t['forward_tokens_per_s']:.0f} tok/s ({args.batch}x{args.seq}), "
        f"decode {t['decode_tokens_per_s']:.0f} tok/s (batch {args.batch})",
        flush=True,
    )
    if not args.skip_real:
        out["real"] = r = real_footprint(args.real_batch, args.real_max_length, not args.no_f32)
        gib = 2.0**30
        print(
            f"real: {r['params_total'] / 1e9:.2f}B params, {r['params_active_per_token'] / 1e9:.2f}B active/token, "
            f"bf16 params {r['param_bytes_bf16'] / gib:.1f} GiB, cache {r['cache_bytes_bf16'] / gib:.2f} GiB, "
            f"bf16 decode-step temp {r['decode_step_bf16'].get('temp_size_in_bytes', 0) / gib:.2f} GiB",
            flush=True,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
