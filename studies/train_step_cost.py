"""What a GSPO train step of the embedded default costs, and which part of it: step time against variants.

The default config's train step (`trainer.make_train_step` with the shared-prompt-prefix scorer, the top-k
entropy, the forking-entropy bonus and AdamW, exactly as `reno_jax.loop.train` builds it) on a synthetic
batch of the default's shape: N boards x G samples, prompts of S tokens shared within a group, continuations of C
tokens. Each variant changes one thing and reports its median step time and its ratio to the default measured in
the same process, the variants' steps interleaved round by round:

  boards x samples   the same 512 rows as 32 x 16 / 64 x 8 / 128 x 4 (how much a prompt costs)
  prefix S           a shorter shared prompt (what encoding the prompt costs)
  no_topk_entropy    the entropy over the full vocabulary instead of the top 9 tokens
  all_mla            every layer MLA (no KDA layer)
  dense              every layer a dense SwiGLU MLP (no MoE)
  common             the batch-wide common part of the prompts (38 of the move task's 60 tokens: system prompt,
                     tool schema, "You are X.") encoded once per batch (`rl.share_common_prefix`)
  64x4, *_common     fewer samples per board, with and without the common part shared
  common_guard       `common` with the update guard (`rl.max_logp_shift=0.2` on 8 groups): the committed default's
                     step. The batch's old log-probs are the model's own, so an update moves them by a normal amount
  common_guard_worst the same, but every update fails the guard (old log-probs -2): 4 halvings, then dropped
  common_guard_c9/c8 the committed step with 9 / 8 response tokens instead of 12 (`rollout.max_new_tokens`; a
                     call is 7 tokens)

Every timed step starts from the same (copied) train state, so the guard variants see one update's shift.

  JAX_PLATFORMS=cpu python studies/train_step_cost.py [--reps 7] [--variants default,all_mla,...]

The last output line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import tictactoe_tiny
from reno_jax.loop import build as loop_build
from reno_jax.loop import recipe
from reno_jax.rl import policy, shared_prefix, trainer
from reno_jax.rl.batch import TrainBatch

COMMON = 38  # leading tokens every move-task prompt shares


@dataclasses.dataclass(frozen=True)
class Variant:
    boards: int = 64
    samples: int = 8
    prefix: int = 60  # prompt tokens (shared within a group)
    overrides: tuple = ()  # model.tiny (name, value) pairs
    top_k: int | None = None  # entropy top-k; None: the config's
    common: int = 0  # leading tokens shared by the whole batch, encoded once
    guard: tuple | None = None  # (max_logp_shift, probe groups, old log-probs "own" or "far")
    continuation: int | None = None  # response tokens; None: --continuation


GUARD = (0.2, 8, "own")
VARIANTS = {
    "default": Variant(),
    "32x16": Variant(boards=32, samples=16),
    "128x4": Variant(boards=128, samples=4),
    "prefix_20": Variant(prefix=20),
    "no_topk_entropy": Variant(top_k=0),
    "all_mla": Variant(overrides=(("layer_group_size", 1),)),
    "dense": Variant(overrides=(("first_k_dense_replace", 3),)),
    "common": Variant(common=COMMON),
    "64x4": Variant(samples=4),
    "64x4_common": Variant(samples=4, common=COMMON),
    "128x4_common": Variant(boards=128, samples=4, common=COMMON),
    "common_guard": Variant(common=COMMON, guard=GUARD),
    "common_guard_worst": Variant(common=COMMON, guard=(0.2, 8, "far")),
    "common_guard_c9": Variant(common=COMMON, guard=GUARD, continuation=9),
    "common_guard_c8": Variant(common=COMMON, guard=GUARD, continuation=8),
}


def build(name: str, continuation: int):
    """(step, state, batch, figures) for one variant, compiled and run once."""
    v = VARIANTS[name]
    boards, group, prefix, top_k, common = v.boards, v.samples, v.prefix, v.top_k, v.common
    continuation = v.continuation or continuation
    max_shift, probe_groups, old = v.guard or (0.0, 0, None)
    c = tictactoe_tiny.get_config()
    for key, value in v.overrides:
        c.model.tiny[key] = value
    top_k = int(c.rl.entropy_top_k) if top_k is None else top_k
    tokenizer = loop_build.build_tokenizer(c)
    model_config, params = loop_build.build_model(c, jax.random.PRNGKey(0), tokenizer)
    optimizer = recipe.make_optimizer(c)
    state = trainer.create_train_state(params, optimizer, jax.random.PRNGKey(1))
    logp_fn = policy.make_logp_fn(model_config, group_size=group, entropy_top_k=top_k)
    step = trainer.make_train_step(
        logp_fn,
        recipe.make_loss_fn(c),
        optimizer,
        loss_batch_keys=("entropy_scale",),
        donate=True,
        max_logp_shift=max_shift,
        shift_probe_rows=probe_groups * group,
    )
    rows, length = boards * group, prefix + continuation
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model_config.vocab_size, (rows, length)).astype(np.int32)
    tokens[:, :prefix] = np.repeat(tokens[::group, :prefix], group, axis=0)
    tokens[:, :common] = tokens[0, :common]
    batch = TrainBatch(
        tokens=tokens,
        valid=np.ones((rows, length), bool),
        loss_mask=np.arange(length)[None, :].repeat(rows, 0) >= prefix,
        old_logp=np.full((rows, length), -2.0, np.float32),
        advantages=rng.normal(size=(rows,)).astype(np.float32),
        entropy_scale=np.ones((rows,), np.float32),
    )
    batch = shared_prefix.split_shared_prefix(jax.tree.map(jnp.asarray, batch), prefix, common)
    if old == "own":
        batch = batch.replace(old_logp=jax.jit(lambda p, b: logp_fn(p, b).logp)(params, batch))
    initial = jax.tree.map(jnp.copy, state)
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    figures = {
        "boards": boards,
        "samples": group,
        "prefix": prefix,
        "common": common,
        "continuation": continuation,
        "compile_and_first_s": round(time.perf_counter() - t0, 2),
    }
    if max_shift:
        figures.update(
            max_logp_shift=max_shift,
            probe_rows=probe_groups * group,
            logp_shift=round(float(metrics["logp_shift"]), 4),
            update_scale=float(metrics["update_scale"]),
        )
    return step, initial, batch, figures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--continuation", type=int, default=12, help="C: the default's 60 + 12-token rows")
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    if "default" not in names:
        names.insert(0, "default")
    res = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(), "variants": {}}
    built = {}
    for name in names:
        built[name] = list(build(name, args.continuation))
        print(f"{name:>16}: compiled (compile + first step {built[name][3]['compile_and_first_s']:.1f} s)", flush=True)
    # Round-robin: every variant runs once per round, so a slower or faster stretch of the machine (seen here
    # between runs of the same program: 1.4 s against 2.3 s) falls on all of them alike.
    times = {name: [] for name in names}
    for _ in range(args.reps):
        for name in names:
            step, initial, batch, _ = built[name]
            state = jax.block_until_ready(jax.tree.map(jnp.copy, initial))  # the step donates what it gets
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - t0)
    for name in names:
        r = dict(
            built[name][3],
            step_s=round(float(np.median(times[name])), 3),
            step_s_min=round(float(np.min(times[name])), 3),
        )
        res["variants"][name] = r
        print(
            f"{name:>16}: {r['step_s']:.3f} s per step (median of {args.reps}, fastest {r['step_s_min']:.3f})",
            flush=True,
        )
    base = res["variants"]["default"]["step_s"]
    for r in res["variants"].values():
        r["ratio_to_default"] = round(r["step_s"] / base, 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
