"""What a host environment costs: one multi-turn task rolled out the jitted way and the host way, and trained on.

Task: guess-the-number, written both ways: `reno_jax.envs.guess_number` (a jitted `TextEnv`) and
`reno_jax.envs.guess_number_host` (a Python `HostEnv`, the same texts and rewards, id for id). Model: the
architecture of `configs/guess_number_tiny.py` (three layers; --layers: fewer for a quick check), random weights.
Batch: --groups secrets x --group_size episodes, the config's rollout settings (--max_turns turns of at most
`max_new_tokens`; L is the jitted environment's conversation length, given to all three so their trajectories have
one shape).

Episodes: a random model makes no valid call, so every call is teacher-forced (`forced_tokens`): each row plays
the config's warm-start teacher (a number the answers so far allow, uniformly, drawn per row from --seed), so
episodes last 1 to --max_turns turns and the rows of a group differ. The forced ids are whole calls and the turn
stops when "</tool_call>" is complete, so all three columns play the SAME episodes token for token (asserted);
the behaviour log-probs are each path's own.

Columns, all on the same params, keys and forced calls:
  jitted  `rollout.make_rollout_fn` (the whole multi-turn rollout one XLA program; with the config's
          `share_prompt_prefill` a group's prompt is prefilled once).
  host    `host_rollout.host_rollout` (Python turn loop; jitted prefill / decode per turn on caches donated and
          kept on the device; only new ids cross to the host).
  resend  the same with `HostConfig(resend_history=True)`: the peers' way, every turn after the first prefills
          each live row's whole conversation so far into fresh empty caches.
and for each the whole training step: the rollout, then the same `Learner.learner_step` (the config's GSPO
recipe, one compiled train step for all three) on its trajectory, from the same fresh train state.

Timing: warm-up calls first (every program compiled), then --repeats rounds, each timing every column once
(interleaved, so background load hits them alike); median, min and max per column. Rollout time includes the
trajectory on the device (the host path's `Trajectory` built); step time ends when the new state is ready.
The last output line is one JSON object.

    python benchmarks/host_rollout_cost.py [--groups 4] [--group_size 16] [--max_turns 5] [--repeats 5] [--seed 0]
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

from configs import guess_number_tiny
from reno_jax.envs import guess_number as gn
from reno_jax.envs import guess_number_host as gh
from reno_jax.loop import build, recipe
from reno_jax.models import ling3
from reno_jax.rl import learner as learner_lib
from reno_jax.rl import policy, trainer
from reno_jax.rollout import host_rollout as H
from reno_jax.rollout import rollout as R

COLUMNS = ("jitted", "host", "resend")
ROLLOUT_LIMIT = 2.0  # issue #56: the host rollout at most 2x the jitted one's time
STEP_LIMIT = 1.3  # ... and its whole training step at most 1.3x


def call_text(number: int) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {number}}}}}</tool_call>'


def teacher_guesses(secret: int, max_turns: int, rng: np.random.Generator) -> list[int]:
    """The warm-start teacher's game (`guess_number.consistent_guess`): a uniform number the answers allow, until
    found or out of turns."""
    low, high, guesses = 1, gn.MAX_NUMBER, []
    while len(guesses) < max_turns:
        guess = int(rng.integers(low, high + 1))
        guesses.append(guess)
        if guess == secret:
            break
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return guesses


def forced_calls(tokenizer, secrets_per_row: np.ndarray, turns: int, max_new_tokens: int, seed: int) -> np.ndarray:
    """int32 [B, turns, max_new_tokens]: each row's teacher calls, -1 after (unused turns are never reached)."""
    rng = np.random.default_rng(seed)
    forced = np.full((len(secrets_per_row), turns, max_new_tokens), -1, np.int32)
    for b, secret in enumerate(secrets_per_row):
        for k, guess in enumerate(teacher_guesses(int(secret), turns, rng)):
            ids = tokenizer.encode(call_text(guess), add_special_tokens=False)
            if len(ids) > max_new_tokens:
                raise ValueError(f"a call is {len(ids)} tokens; max_new_tokens is {max_new_tokens}")
            forced[b, k, : len(ids)] = ids
    return forced


def make_learner(config, model_config, rollout_config, optimizer, num_groups: int) -> learner_lib.Learner:
    """The training loop's learner for the config (`loop.training.stage_runner`, without a reference or LoRA)."""
    r = config.rl
    return learner_lib.Learner(
        recipe.learner_config(config),
        policy.make_logp_fn(
            model_config,
            group_size=rollout_config.group_size,
            remat=bool(r.get("remat", False)),
            entropy_top_k=int(r.get("entropy_top_k", 0)),
            temperature=rollout_config.temperature,
            logits_chunk=int(r.get("logits_chunk", 0)),
        ),
        recipe.make_loss_fn(config),
        optimizer,
        num_groups=num_groups,
        rollout_metrics=True,
    )


def spread(times: list[float]) -> dict:
    return {"median": float(np.median(times)), "min": float(np.min(times)), "max": float(np.max(times))}


def rounded(x):
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return x


def main(argv=None) -> dict:
    config = guess_number_tiny.get_config()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=int(config.rollout.boards_per_step), help="secrets per batch")
    ap.add_argument("--group_size", type=int, default=int(config.rollout.group_size))
    ap.add_argument("--max_turns", type=int, default=int(config.rollout.max_turns))
    ap.add_argument("--repeats", "--steps", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=int(config.model.tiny.num_hidden_layers), help="model layers")
    args = ap.parse_args(argv)
    config.rollout.group_size = args.group_size
    config.rollout.boards_per_step = args.groups
    config.rollout.max_turns = args.max_turns
    config.model.tiny.num_hidden_layers = args.layers
    config.rl.shift_probe_groups = min(int(config.rl.shift_probe_groups), args.groups)
    batch = args.groups * args.group_size

    tokenizer = build.build_tokenizer(config)
    mc = build.tiny_model_config(config, len(tokenizer))
    params = ling3.init_params(mc, jax.random.key(args.seed))
    env = R.compile_env(gn.GuessNumberEnv(), tokenizer, vocab_size=mc.vocab_size)
    rc = build.rollout_config(config)
    rc = dataclasses.replace(rc, max_length=R.conversation_length(env, rc))  # one L for all three columns
    turns = rc.max_turns

    secrets = np.random.default_rng(args.seed).integers(1, gn.MAX_NUMBER + 1, args.groups).astype(np.int32)
    rows_secret = np.repeat(secrets, args.group_size)
    forced = forced_calls(tokenizer, rows_secret, turns, rc.max_new_tokens, args.seed)
    keys = jax.random.split(jax.random.key(args.seed + 1), batch)

    jitted_fn = R.make_rollout_fn(mc, rc)
    starts = gn.Start(secret=jnp.asarray(secrets))
    forced_device = jnp.asarray(forced)
    chat = H.compile_host_chat(gh.GuessNumberHostEnv, tokenizer, mc.vocab_size)
    host_programs = H.make_host_programs(mc, rc, H.HostConfig())
    # The peers' way runs the very same compiled prefill and decode; only the turn loop differs.
    programs = {
        "host": host_programs,
        "resend": dataclasses.replace(host_programs, host_config=H.HostConfig(resend_history=True)),
    }

    def host_runner(name):
        def run(p):
            envs = [gh.GuessNumberHostEnv() for _ in range(batch)]
            return H.host_rollout(
                p, keys, envs, rows_secret.tolist(), chat=chat, programs=programs[name], forced_tokens=forced
            )

        return run

    rollouts = {
        "jitted": lambda p: jitted_fn(p, keys, starts, env=env, forced_tokens=forced_device),
        "host": host_runner("host"),
        "resend": host_runner("resend"),
    }
    optimizer = recipe.make_optimizer(config)
    learner = make_learner(config, mc, rc, optimizer, args.groups)
    state0 = trainer.create_train_state(params, optimizer, jax.random.key(args.seed + 2))
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; model "
        f"{ling3.count_params(mc)['total']} params; B = {args.groups} x {args.group_size}, {turns} turns of "
        f"<= {rc.max_new_tokens} tokens, L = {rc.max_length}",
        flush=True,
    )

    def one_step(name: str) -> tuple[float, float, R.Trajectory]:
        """Rollout then learner step from a fresh copy of the initial state; (rollout s, step s, trajectory)."""
        state = jax.tree.map(jnp.copy, state0)  # learner_step donates its state
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        traj = jax.block_until_ready(rollouts[name](state.params))
        t1 = time.perf_counter()
        state, metrics = learner.learner_step(state, traj)
        jax.block_until_ready((state, metrics))
        return t1 - t0, time.perf_counter() - t0, traj

    trajs = {}
    t_compile = time.perf_counter()
    for name in COLUMNS:  # warm-up: every program compiled
        trajs[name] = jax.device_get(one_step(name)[2])
    t_compile = time.perf_counter() - t_compile
    rollout_s = {name: [] for name in COLUMNS}
    step_s = {name: [] for name in COLUMNS}
    for _ in range(args.repeats):
        for name in COLUMNS:
            t_roll, t_step, _ = one_step(name)
            rollout_s[name].append(t_roll)
            step_s[name].append(t_step)

    ref = trajs["jitted"]
    same = {}
    for name in ("host", "resend"):
        t = trajs[name]
        same[name] = all(
            np.array_equal(getattr(t, f), getattr(ref, f))
            for f in ("tokens", "valid", "loss_mask", "turn_id", "prompt_length", "reward", "turn_reward")
        )
        assert same[name], f"the {name} trajectory differs from the jitted one"
    generated = int(np.asarray(ref.loss_mask).sum())
    num_turns = np.asarray(ref.info["num_turns"])
    out = {
        "batch": batch,
        "groups": args.groups,
        "group_size": args.group_size,
        "max_turns": turns,
        "max_new_tokens": rc.max_new_tokens,
        "layers": args.layers,
        "length": rc.max_length,
        "repeats": args.repeats,
        "episodes": "teacher-forced calls (warm-start teacher), random weights",
        "turns_played": int(num_turns.sum()),
        "turns_mean": float(num_turns.mean()),
        "found_rate": float(np.asarray(ref.info["found"]).mean()),
        "generated_tokens": generated,
        "same_tokens": bool(same["host"] and same["resend"]),
        "logp_max_abs_diff": {
            n: float(np.abs(np.asarray(trajs[n].behaviour_logp) - np.asarray(ref.behaviour_logp)).max())
            for n in ("host", "resend")
        },
        "warmup_s": t_compile,
    }
    for name in COLUMNS:
        out[f"{name}_rollout_s"] = spread(rollout_s[name])
        out[f"{name}_step_s"] = spread(step_s[name])
        out[f"{name}_tokens_per_s"] = generated / out[f"{name}_rollout_s"]["median"]
    for name in ("host", "resend"):
        out[f"{name}_rollout_ratio"] = out[f"{name}_rollout_s"]["median"] / out["jitted_rollout_s"]["median"]
        out[f"{name}_step_ratio"] = out[f"{name}_step_s"]["median"] / out["jitted_step_s"]["median"]
    out["host_rollout_within_2x"] = out["host_rollout_ratio"] <= ROLLOUT_LIMIT
    out["host_step_within_1.3x"] = out["host_step_ratio"] <= STEP_LIMIT
    print(json.dumps(rounded(out)), flush=True)
    return out


if __name__ == "__main__":
    main()
