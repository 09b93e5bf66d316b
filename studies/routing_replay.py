"""Rollout Routing Replay (R3) on CPU: how much a bf16 MoE's train forward drifts from its rollout, with and
without replaying the rollout's expert choices.

Model and task: `configs/moe_drift_tiny.py` (the default tiny Ling-3.0 architecture with 16 experts top-4,
bfloat16 parameters and bfloat16 rollout caches, move task, 8 boards x 8 samples per step), after its own
supervised warm start (cached under --workdir).

1. Scoring: --score_batches rollouts (recording the routing of every fed token), each scored by the train-side
   log-prob function twice, without and with replay. Per setting: routing agreement (share of (token, MoE layer)
   pairs whose train-forward top-4 set equals the rollout's; with replay this is the router's OWN top-4 given
   the replayed upstream layers, the experts actually used agree by construction), |train logp - behaviour logp|
   mean / max over the policy tokens, the k3 estimate of KL(behaviour || train) and the largest token ratio.
   Also split: policy tokens whose scoring position is itself routed differently (directly affected) vs the
   rest. The same batches are then scored inside a jitted GSPO train step (`train_step_*` rows: the program the
   training loop's `train/rollout_*` metrics come from), which XLA compiles, and rounds, differently. A float32
   copy of the same model and caches is scored too, as the no-drift reference.
2. Training: two GSPO runs of --steps steps from the same warm start and seed, `rl.routing_replay` off and on;
   per-step reward, mismatch and agreement from their metrics.jsonl.

The last output line is one JSON object.

    python studies/routing_replay.py [--steps 25] [--score_batches 4] [--workdir /tmp/routing_replay]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import moe_drift_tiny
from reno_jax import loop
from reno_jax.loop import build, warmstart
from reno_jax.models import ling3
from reno_jax.rl import losses, policy, trainer
from reno_jax.rl.batch import TrainBatch
from reno_jax.rollout import rollout as rollout_lib


def score(model_config, params, traj, replay: bool) -> dict:
    """Mismatch figures of one rollout batch under the train-side logp function (host floats).

    Besides the batch figures: |dlogp| over the policy tokens t whose scoring position t - 1 (the hidden state
    that gives p(token t)) is routed differently by the train forward without replay than by the rollout in at
    least one MoE layer (`flipped_*`), and over the other policy tokens (`clean_*`, which still see flips at
    earlier positions through attention).
    """
    batch = TrainBatch(
        tokens=traj.tokens,
        valid=traj.valid,
        loss_mask=traj.loss_mask,
        old_logp=traj.behaviour_logp,
        advantages=jnp.ones(traj.reward.shape),
        routing=traj.routing,
    )
    scored = _logp_fn(model_config, replay)(params, batch)
    logp, stats = scored.logp, scored.routing
    sums = trainer.mismatch_sums(logp, traj.behaviour_logp, traj.loss_mask)
    out = {k: float(v) for k, v in trainer.mismatch_metrics(sums, stats).items()}
    out["tokens"] = float(sums["count"])
    own = _own_routing(model_config, params, traj.tokens, traj.valid)
    rec = np.asarray(traj.routing)
    differs = ~np.all(np.sort(own, -1) == np.sort(rec, -1), -1) & (rec[..., 0] >= 0)  # [B, L, n_moe]
    flipped = np.pad(differs.any(axis=2)[:, :-1], ((0, 0), (1, 0)))  # [B, L]: position t - 1 flipped
    mask = np.asarray(traj.loss_mask)
    d = np.abs(np.asarray(logp) - np.asarray(traj.behaviour_logp))
    for name, where in (("flipped", flipped), ("clean", ~flipped)):
        m = mask & where
        out[f"{name}_tokens"] = float(m.sum())
        out[f"{name}_abs_diff_sum"] = float(d[m].sum())
        out[f"{name}_abs_diff_max"] = float(d[m].max()) if m.any() else 0.0
    return out


def score_in_train_step(model_config, params, traj, replay: bool) -> dict:
    """The same figures as the training loop reports them: from a jitted GSPO train step (micro-batch scan,
    value_and_grad), whose compiled forward rounds differently from the standalone one in `score`."""
    opt = optax.sgd(0.0)
    step = _train_step(model_config, replay)
    batch = TrainBatch(
        tokens=traj.tokens,
        valid=traj.valid,
        loss_mask=traj.loss_mask,
        old_logp=traj.behaviour_logp,
        advantages=jnp.ones(traj.reward.shape),
        routing=traj.routing,
    )
    _, m = step(trainer.create_train_state(params, opt, 0), batch)
    out = {
        k: float(m[k])
        for k in (
            "rollout_logp_abs_diff_mean",
            "rollout_logp_abs_diff_max",
            "rollout_k3_kl",
            "rollout_ratio_max",
            "routing_agreement",
        )
    }
    out["tokens"] = float(np.asarray(traj.loss_mask).sum())
    return out


@functools.lru_cache(maxsize=None)
def _logp_fn(model_config, replay: bool):  # one compile per setting, reused for every batch
    return jax.jit(policy.make_logp_fn(model_config, with_entropy=False, routing_replay=replay))


@functools.lru_cache(maxsize=None)
def _train_step(model_config, replay: bool):
    return trainer.make_train_step(
        policy.make_logp_fn(model_config, routing_replay=replay),
        functools.partial(losses.gspo_loss, eps_low=3e-4, eps_high=4e-4),
        optax.sgd(0.0),
        donate=False,
        rollout_metrics=True,
    )


@functools.lru_cache(maxsize=None)
def _own_fn(model_config):
    return jax.jit(lambda p, t, v: ling3.forward(p, model_config, t, valid=v, return_routing=True)[2].own)


def _own_routing(model_config, params, tokens, valid):
    return np.asarray(_own_fn(model_config)(params, tokens, valid))


def scoring(config, workdir: str, num_batches: int) -> dict:
    """Part 1: the same rollout batches scored without / with replay, bf16 and the float32 reference."""
    key = jax.random.PRNGKey(config.seed)
    key_model, key_sft, _ = jax.random.split(key, 3)  # as reno_jax.loop.train splits it
    tokenizer = build.build_tokenizer(config)
    model_config, params = build.build_model(config, key_model, tokenizer)
    env = build.make_compiled_env(config, tokenizer, model_config)
    params = warmstart.cached_warm_start(workdir, config, model_config, params, tokenizer, key_sft).params
    sampler = build.env_entry(config).make_sampler(config)  # the training steps' starts (dataset boards)
    rc = build.rollout_config(config)
    assert rc.record_routing and rc.cache_dtype == "bfloat16"
    variants = {
        "bf16": (params, rc),
        "float32": (
            jax.tree.map(lambda x: x.astype(jnp.float32), params),
            dataclasses.replace(rc, cache_dtype="float32"),
        ),
    }
    results = {}
    for name, (p, r) in variants.items():
        rollout_fn = rollout_lib.make_rollout_fn(model_config, r)
        rows = {"no_replay": [], "replay": [], "train_step_no_replay": [], "train_step_replay": []}
        for i in range(num_batches):
            k_starts, k_roll = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(100), i))
            starts = sampler(k_starts, config.rollout.boards_per_step)
            traj = rollout_fn(p, k_roll, starts, env=env)
            for setting in rows:
                fn = score_in_train_step if setting.startswith("train_step") else score
                rows[setting].append(fn(model_config, p, traj, replay=setting in ("replay", "train_step_replay")))
        results[name] = {}
        for setting, per_batch in rows.items():
            tokens = np.array([b["tokens"] for b in per_batch])
            agg = {
                k: float(np.average([b[k] for b in per_batch], weights=tokens))
                for k in ("rollout_logp_abs_diff_mean", "rollout_k3_kl", "routing_agreement")
            }
            agg["rollout_logp_abs_diff_max"] = max(b["rollout_logp_abs_diff_max"] for b in per_batch)
            agg["rollout_ratio_max"] = max(b["rollout_ratio_max"] for b in per_batch)
            agg["policy_tokens"] = int(tokens.sum())
            if setting.startswith("train_step"):
                results[name][setting] = agg
                continue
            agg["flipped_tokens"] = int(sum(b["flipped_tokens"] for b in per_batch))
            for part in ("flipped", "clean"):
                n = sum(b[f"{part}_tokens"] for b in per_batch)
                agg[f"{part}_abs_diff_mean"] = sum(b[f"{part}_abs_diff_sum"] for b in per_batch) / max(n, 1.0)
                agg[f"{part}_abs_diff_max"] = max(b[f"{part}_abs_diff_max"] for b in per_batch)
            results[name][setting] = agg
    return results


def training(config, workdir: str, steps: int) -> dict:
    """Part 2: GSPO runs without / with replay from the same cached warm start; per-step figures."""
    out = {}
    for replay in (False, True):
        c = config.copy_and_resolve_references()
        c.num_steps = steps
        c.checkpoint_every = steps
        c.rl.routing_replay = replay
        run_dir = os.path.join(workdir, "replay" if replay else "no_replay")
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        shutil.copytree(os.path.join(workdir, warmstart.CACHE_SUBDIR), os.path.join(run_dir, warmstart.CACHE_SUBDIR))
        t0 = time.time()
        rows = loop.train(c, run_dir)
        keys = (
            "rollout/rewards_mean",
            "rollout/tool_call_valid_rate",
            "train/routing_agreement",
            "train/rollout_logp_abs_diff_mean",
            "train/rollout_logp_abs_diff_max",
            "train/rollout_k3_kl",
            "train/rollout_ratio_max",
            "train/grad_norm",
            "perf/step_seconds",
        )
        out["replay" if replay else "no_replay"] = {
            "seconds": time.time() - t0,
            "curves": {k.split("/", 1)[1]: [float(r[k]) for r in rows] for k in keys},
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--score_batches", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/routing_replay")
    ap.add_argument("--skip_training", action="store_true")
    args = ap.parse_args()
    config = moe_drift_tiny.get_config()
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.time()
    scores = scoring(config, args.workdir, args.score_batches)
    print(
        f"scoring ({args.score_batches} rollout batches of {config.rollout.boards_per_step}x"
        f"{config.rollout.group_size}, {time.time() - t0:.0f} s):"
    )
    print(
        f"{'params/caches':>13} {'setting':>9} {'agreement':>9} {'|dlogp| mean':>12} {'|dlogp| max':>11} "
        f"{'k3 KL':>9} {'ratio max':>9} {'flipped tok':>11} {'flipped mean':>12} {'flipped max':>11} "
        f"{'clean mean':>10} {'clean max':>9}"
    )
    for name, per in scores.items():
        for setting, s in per.items():
            if setting.startswith("train_step"):
                print(
                    f"{name:>13} {setting:>9} {s['routing_agreement']:9.4f} "
                    f"{s['rollout_logp_abs_diff_mean']:12.2e} {s['rollout_logp_abs_diff_max']:11.2e} "
                    f"{s['rollout_k3_kl']:9.2e} {s['rollout_ratio_max']:9.4f}"
                )
                continue
            print(
                f"{name:>13} {setting:>9} {s['routing_agreement']:9.4f} {s['rollout_logp_abs_diff_mean']:12.2e} "
                f"{s['rollout_logp_abs_diff_max']:11.2e} {s['rollout_k3_kl']:9.2e} {s['rollout_ratio_max']:9.4f} "
                f"{s['flipped_tokens']:>11d} {s['flipped_abs_diff_mean']:12.2e} "
                f"{s['flipped_abs_diff_max']:11.2e} {s['clean_abs_diff_mean']:10.2e} {s['clean_abs_diff_max']:9.2e}"
            )
    result = {"scoring": scores}
    if not args.skip_training:
        runs = training(config, args.workdir, args.steps)
        result["training"] = runs
        for name, run in runs.items():
            cur = run["curves"]
            print(f"\ntraining, {name} ({args.steps} steps, {run['seconds']:.0f} s):")
            print(
                f"{'step':>4} {'reward':>7} {'valid':>6} {'agree':>7} {'|dlogp| mean':>12} {'|dlogp| max':>11} "
                f"{'k3 KL':>9} {'ratio max':>9}"
            )
            for i in range(len(cur["rewards_mean"])):
                print(
                    f"{i + 1:4d} {cur['rewards_mean'][i]:+7.3f} {cur['tool_call_valid_rate'][i]:6.3f} "
                    f"{cur['routing_agreement'][i]:7.4f} {cur['rollout_logp_abs_diff_mean'][i]:12.2e} "
                    f"{cur['rollout_logp_abs_diff_max'][i]:11.2e} {cur['rollout_k3_kl'][i]:9.2e} "
                    f"{cur['rollout_ratio_max'][i]:9.4f}"
                )
            run["summary"] = {k: float(np.mean(v)) for k, v in cur.items()}
            run["summary"]["rewards_mean_last5"] = float(np.mean(cur["rewards_mean"][-5:]))
            run["summary"]["rewards_mean_first5"] = float(np.mean(cur["rewards_mean"][:5]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
