"""What `sft.length_pool` saves a warm start whose conversations differ in length (Connect Four's whole games).

Draws the teacher's conversations exactly as the warm start does (`sft.env_transcripts` on the config's warm-start
environment), then for each pool size P cuts them into steps as the warm start would: P batches drawn together,
sorted by length (`sft.length_sorted_batches`), each batch cut after its longest conversation rounded up to
`rl.length_bucket`. P = 1 is the warm start without pooling (each batch padded to its own longest game, which is
often a long game among short ones). For every width that occurs it times the compiled warm-start train step
(median of --reps), so each pool size's figure is the mean step time over the same games' steps, measured in one
process on one machine:

  padded_tokens   tokens per step the train step runs over (rows x width)
  real_tokens     tokens of the conversations themselves
  step_s          the mean train-step time over the steps (from the per-width medians)
  speedup         the first pool size's step_s over this one's
  widths          distinct widths (each is one compilation)

  python studies/warmstart_length_pool.py --config=configs/connect4_tiny.py --steps=64 --pools=1,4,8

The last output line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.loop import build, warmstart
from reno_jax.rl import policy, sft, trainer
from reno_jax.rl.batch import TrainBatch, bucketed_length, trim_length
from reno_jax.rollout import rollout as rollout_lib


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def step_widths(lengths: np.ndarray, batch: int, pool: int, length: int, bucket: int, seed: int = 0) -> list[int]:
    """The widths of the warm start's steps over conversations of these lengths (in drawing order): pools of
    `pool` batches sorted by length (pool 1: each batch as drawn), each batch cut at its longest rounded up."""
    rows = pool * batch
    if len(lengths) % rows:
        raise ValueError(f"{len(lengths)} conversations do not split into pools of {rows}")
    widths = []
    for first in range(0, len(lengths), rows):
        part = np.sort(lengths[first : first + rows]) if pool > 1 else lengths[first : first + rows]
        for b in range(pool):
            longest = int(np.max(part[b * batch : (b + 1) * batch]))
            widths.append(bucketed_length(longest, length, bucket) if bucket else length)
    return widths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/connect4_tiny.py")
    ap.add_argument("--steps", type=int, default=64, help="warm-start steps of conversations to cut (per pool size)")
    ap.add_argument("--pools", default="1,4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pools = [int(p) for p in args.pools.split(",")]
    if args.steps < 1 or args.reps < 1 or not pools or min(pools) < 1 or any(args.steps % p for p in pools):
        ap.error("--steps and --reps must be >= 1 and --pools sizes >= 1 that divide --steps")
    config = load_config(args.config)
    s = config.sft
    tokenizer = build.build_tokenizer(config)
    model_config, params = build.build_model(config, jax.random.PRNGKey(args.seed), tokenizer)
    play = warmstart.env_config_for_warm_start(config)
    entry = build.env_entry(play)
    env = build.make_compiled_env(play, tokenizer, model_config)
    teacher = entry.make_teacher(play, env.env)
    tool_names = [t["function"]["name"] for t in env.env.chat().tools]
    calls = sft.build_call_table(tokenizer, teacher.calls, int(env.chat.turn_end_id), env.pad_id, tool_names)
    rc = build.rollout_config(play)
    turns = rollout_lib.num_turns(env, rc)
    length = warmstart.transcript_length(env, calls, turns, rollout_lib.conversation_length(env, rc))
    bucket = int(config.rl.get("length_bucket", 0))
    batch = int(s.batch_size)
    sampler = entry.make_sampler(play)
    soft = bool(s.get("soft_targets", False))

    key = jax.random.PRNGKey(args.seed)
    drawn, lengths = None, []
    for _ in range(args.steps):
        key, k_starts, k_play = jax.random.split(key, 3)
        out = sft.env_transcripts(
            k_play,
            sampler(k_starts, batch),
            env,
            teacher.policy,
            calls,
            max_turns=turns,
            length=length,
            soft_targets=soft,
        )
        drawn = out if drawn is None else drawn
        lengths.append(np.asarray(jnp.sum(out.valid, axis=1)))
    lengths = np.concatenate(lengths)
    per_pool = {p: step_widths(lengths, batch, p, length, bucket) for p in pools}

    optimizer = trainer.make_optimizer(s.learning_rate, s.learning_rate * 0.1, 1, 10, weight_decay=0.0, clip_norm=1.0)
    state = trainer.create_train_state(params, optimizer, jax.random.PRNGKey(1))
    step_fn = trainer.make_train_step(policy.make_logp_fn(model_config, with_entropy=False), sft.sft_loss, optimizer)
    full = TrainBatch(
        tokens=drawn.tokens,
        valid=drawn.valid,
        loss_mask=drawn.loss_mask,  # a step's cost: its width
        old_logp=jnp.zeros(drawn.tokens.shape, jnp.float32),
        advantages=jnp.zeros((batch,), jnp.float32),
    )
    if soft:  # the soft-target loss, as the warm start runs it
        ids = jnp.broadcast_to(jnp.asarray(calls.choice_tokens, jnp.int32), (batch, len(calls.choice_tokens)))
        full = full.replace(soft_target_ids=ids, soft_target_weights=drawn.target_weights)
    seconds = {}
    for width in sorted({w for ws in per_pool.values() for w in ws}):
        cut = trim_length(full, width)
        state, metrics = step_fn(state, cut)  # compile (the step donates its state: carried on, as in the loop)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            state, metrics = step_fn(state, cut)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        seconds[width] = float(np.median(times))
        print(f"width {width:5d}: {seconds[width]:.3f} s per step", flush=True)

    res = {
        "config": args.config,
        "steps": args.steps,
        "batch": batch,
        "bucket": bucket,
        "mean_length": round(float(lengths.mean()), 1),
        "step_s_by_width": seconds,
        "pools": {},
    }
    base = None
    for p in pools:
        ws = per_pool[p]
        step_s = float(np.mean([seconds[w] for w in ws]))
        base = step_s if base is None else base
        res["pools"][str(p)] = {
            "padded_tokens": round(batch * float(np.mean(ws)), 1),
            "real_tokens": round(batch * float(lengths.mean()), 1),
            "step_s": round(step_s, 3),
            "speedup": round(base / step_s, 3),
            "widths": len(set(ws)),
        }
        print(
            f"pool {p}: {batch * np.mean(ws):.0f} padded tokens per step for {batch * lengths.mean():.0f} real, "
            f"{step_s:.2f} s per step ({base / step_s:.2f}x pool {pools[0]}), {len(set(ws))} widths",
            flush=True,
        )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
