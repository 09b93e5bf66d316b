"""Sokoban's rooms and scripted baselines: the rooms' optimal solution lengths (breadth-first solver) and the solved
rate of the warm-start teachers on the held-out rooms (no model: the environment stepped in jit).

    python benchmarks/sokoban_rooms.py                         # configs/sokoban_tiny.py's rooms, 3 passes
    python benchmarks/sokoban_rooms.py --env num_boxes=2 max_solution_moves=15

Policies: "random" (a uniform direction each move), "solver" (the first optimal move), "solver+explore=p" (the
solver with a share p of its moves uniform, as `sft.explore` plays them). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import ast
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import sokoban_tiny
from reno_jax.envs import interface
from reno_jax.envs.sokoban import env as sokoban_env
from reno_jax.envs.sokoban import registration


def play(env, teacher, num_rooms: int, passes: int, seed: int) -> dict:
    """Every held-out room ``passes`` times with ``teacher``: the environment's figures and the mean return."""
    n = num_rooms * passes
    starts = sokoban_env.SokobanStart(
        split=jnp.full((n,), sokoban_env.HELDOUT, jnp.int32),
        room=jnp.tile(jnp.arange(num_rooms, dtype=jnp.int32), passes),
    )
    state, _ = jax.vmap(env.reset)(starts)
    policy, step = jax.jit(jax.vmap(teacher.policy)), jax.jit(jax.vmap(env.step))
    info, total = None, jnp.zeros((n,))
    for turn in range(env.max_turns()):
        row = policy(state, jax.random.split(jax.random.PRNGKey(seed * 1000 + turn), n))[0]
        out = step(
            state,
            interface.ToolCall(kind=jnp.zeros((n,), jnp.int32), tool=jnp.zeros((n,), jnp.int32), args=row[:, None]),
        )
        live = state.outcome == sokoban_env.OUTCOME_ONGOING
        total = total + jnp.where(live, out.reward, 0.0)
        info = out.info if info is None else jax.tree.map(lambda new, old: jnp.where(live, new, old), out.info, info)
        state = out.state
    figures = interface.summarize(env, jax.tree.map(np.asarray, info))
    figures["mean_return"] = float(jnp.mean(total))
    return {k: round(v, 4) for k, v in figures.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", nargs="*", default=[], help="env settings as name=value")
    parser.add_argument("--passes", type=int, default=3, help="episodes per held-out room")
    parser.add_argument("--explore", type=float, nargs="*", default=[0.2, 0.5])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = sokoban_tiny.get_config()
    for item in args.env:
        name, value = item.split("=", 1)
        config.env[name] = ast.literal_eval(value)
    start = time.time()
    env = registration.make_env(config.env)
    train, heldout = registration.splits(config.env)
    out = {
        "build_seconds": round(time.time() - start, 1),
        "train_rooms": len(train),
        "heldout_rooms": len(heldout),
        "heldout_optimal_moves": {int(k): int(v) for k, v in zip(*np.unique(heldout.optimal, return_counts=True))},
        "heldout_optimal_mean": round(float(heldout.optimal.mean()), 3),
        "heldout_pushes": {int(k): int(v) for k, v in zip(*np.unique(heldout.pushes, return_counts=True))},
        "train_optimal_moves": {int(k): int(v) for k, v in zip(*np.unique(train.optimal, return_counts=True))},
    }
    print(json.dumps({k: out[k] for k in list(out)[:4]}))
    runs = [("random", 0.0), ("solver", 0.0)] + [("solver", p) for p in args.explore]
    for teacher_name, explore in runs:
        config.sft.teacher, config.sft.explore, config.sft.soft_targets = teacher_name, explore, True
        name = teacher_name + (f"+explore={explore}" if explore else "")
        out[name] = play(env, registration.make_teacher(config, env), len(heldout), args.passes, args.seed)
        print(name, json.dumps(out[name]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
