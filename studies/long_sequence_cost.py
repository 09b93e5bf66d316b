"""What a train step on whole multi-turn conversations costs, with MLA's attention block by block and in one block.

A forward and backward pass (`jax.value_and_grad` of a log-softmax loss) of the embedded tiny model over `B` rows of
`T` tokens, no cache: what the warm start and the RL train step run on Connect Four games (whole games are ~2.2k
tokens). For each query block size (`models/mla.py`'s QUERY_BLOCK; a size of at least T runs one block, the
[T, T] square), the compile time and the median step time, and the ratio against the first size measured in the
same process.

  JAX_PLATFORMS=cpu python studies/long_sequence_cost.py [--rows 16] [--length 2176] [--blocks 1000000,256,128]

The last output line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import connect4_tiny
from reno_jax.loop import build
from reno_jax.models import ling3, mla


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="B (the Connect Four warm start's batch)")
    ap.add_argument("--length", type=int, default=2176, help="T (a whole Connect Four game is <= 2,170 tokens)")
    ap.add_argument("--blocks", default="1000000,256,128", help="query block sizes; the first is the reference")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",") if b]
    if not blocks or min(blocks) < 1 or args.rows < 1 or args.length < 2:
        raise SystemExit("--blocks must name sizes >= 1; --rows >= 1 and --length >= 2")
    c = connect4_tiny.get_config()
    tokenizer = build.build_tokenizer(c)
    model_config, params = build.build_model(c, jax.random.PRNGKey(0), tokenizer)
    ids = jax.random.randint(jax.random.PRNGKey(1), (args.rows, args.length), 0, model_config.vocab_size)

    def loss(p):
        logits, _ = ling3.forward(p, model_config, ids)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

    res = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "rows": args.rows,
        "length": args.length,
        "blocks": {},
    }
    first_value = None
    for block in blocks:
        mla.QUERY_BLOCK = block  # read when the step is traced
        step = jax.jit(jax.value_and_grad(loss))
        t0 = time.perf_counter()
        value = float(jax.block_until_ready(step(params))[0])
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params))
            times.append(time.perf_counter() - t0)
        first_value = value if first_value is None else first_value
        name = "one_block" if block >= args.length else str(block)
        res["blocks"][name] = {
            "query_block": block,
            "compile_and_first_s": round(compile_s, 2),
            "step_s": round(float(np.median(times)), 3),
            "loss_diff": abs(value - first_value),
        }
        print(
            f"query block {name:>9}: {res['blocks'][name]['step_s']:.2f} s per step (median of {args.reps}), "
            f"compile + first {compile_s:.1f} s",
            flush=True,
        )
    base = next(iter(res["blocks"].values()))["step_s"]
    for r in res["blocks"].values():
        r["ratio_to_first"] = round(r["step_s"] / base, 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
