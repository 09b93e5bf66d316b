"""What bounded history saves: rollout and train-step time and memory against episode length, the whole
conversation against a window of k exchanges (`RolloutConfig.history`, issue #57 item 1).

Task: Sokoban (`reno_jax.envs.sokoban`, 6 x 6 rooms with one box, `configs/sokoban_tiny.py`) with a move budget of
exactly T moves (`max_steps = T`), for each T of --turns. Every call is teacher-forced (`forced_tokens`): a move into
a wall next to the player, so nothing moves, no room is solved and every episode lasts exactly T turns (asserted);
the tool answers "blocked" and shows the room each turn, as in play. Model: the architecture of
`configs/sokoban_tiny.py` (--layers: fewer for a quick check), random weights. Batch: --groups rooms x --group_size
episodes.

Columns, per T: `full` (history=None: one row per episode of the whole conversation, L = `required_length`) and
`k0`, `k2`, ... (history=k: T turn samples per episode of Lt = `required_turn_length` tokens, fixed in T). For each:
the rollout (`rollout.make_rollout_fn`) and one GSPO train step on its trajectory (`Learner.learner_step`:
`Learner.train_batch`, then the train step), from the same fresh train state, with each column's natural shared
prefix: the whole conversation's group prompt and the system prompt all rows share (`share_prompt_prefix` and
`share_common_prefix`), the window's system prompt alone (`share_common_prefix`: every turn sample starts with it);
--no_shared_prefix scores every row from its first token instead. Time: a warm-up call compiles, then the median of
--repeats calls (each waits for its result). Memory: the compiled programs' own figures
(`compiled.memory_analysis()`: arguments + outputs + temporaries, bytes) of the rollout and of the train step, so
every column is measured alone whatever ran before it. Also the tokens each episode puts through the model
(`tokens_per_episode`: the conversation's, or the sum of its turn samples').

What to expect: the whole conversation's cache and row grow with T and every decode step reads the whole cache, so
its time and memory grow faster than T; a turn sample is the same size at every T, so the window's grow with T.
`growth` in the JSON is the ratio of each column's figure at the largest T to that at the smallest.

The last output line is one JSON object.

    python benchmarks/history_cost.py [--turns 2,4,8,16] [--histories full,0,2] [--groups 2] [--group_size 4]
        [--layers 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import sokoban_tiny
from reno_jax.envs.sokoban import registration as sokoban_reg
from reno_jax.envs.sokoban import rules as sokoban_rules
from reno_jax.envs.sokoban.env import TRAIN, SokobanStart
from reno_jax.loop import build
from reno_jax.rl import learner as learner_lib
from reno_jax.rl import losses, policy, trainer
from reno_jax.rollout import rollout as R


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", default="2,4,8,16", help="episode lengths T (comma-separated)")
    p.add_argument("--histories", default="full,0,2", help="'full' and/or window sizes k (comma-separated)")
    p.add_argument("--groups", type=int, default=2, help="rooms per batch")
    p.add_argument("--group_size", type=int, default=4, help="episodes per room")
    p.add_argument("--layers", type=int, default=0, help="model layers (0: the config's)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per column")
    p.add_argument("--rooms", type=int, default=32, help="train rooms generated to pick the batch's rooms from")
    p.add_argument("--no_shared_prefix", action="store_true", help="the train step scores every row whole")
    return p.parse_args(argv)


def wall_moves(env) -> list[tuple[int, int]]:
    """`(room, direction)` of the train rooms whose player stands next to a wall, with that wall's direction."""
    walls, player = np.asarray(env.train.walls), np.asarray(env.train.player)
    height, width = walls.shape[1:]
    out = []
    for room in range(walls.shape[0]):
        r, c = divmod(int(player[room]), width)
        for direction, (dr, dc) in enumerate(sokoban_rules.DELTAS):
            if walls[room, r + dr, c + dc]:
                out.append((room, direction))
                break
    return out


def build_world(args):
    """`(config, tokenizer, model_config, params, base env, rooms [N], directions [N])`."""
    c = sokoban_tiny.get_config()
    if args.layers:
        c.model.tiny.num_hidden_layers = args.layers
    max_turns = max(int(t) for t in args.turns.split(","))
    c.env.max_steps = max(max_turns, int(c.env.max_solution_moves))
    c.env.num_train_rooms = args.rooms
    c.env.num_heldout_rooms = 1
    tokenizer = build.build_tokenizer(c)
    model_config, params = build.build_model(c, jax.random.PRNGKey(0), tokenizer)
    env = sokoban_reg.make_env(c.env)
    picked = wall_moves(env)
    if len(picked) < args.groups:
        raise SystemExit(f"only {len(picked)} of {args.rooms} rooms have a wall next to the player; raise --rooms")
    rooms, directions = (np.array(x, np.int32) for x in zip(*picked[: args.groups]))
    return c, tokenizer, model_config, params, env, rooms, directions


def forced_calls(tokenizer, directions, group_size: int, turns: int, max_new_tokens: int) -> jax.Array:
    """`int32 [B, T, m]`: every turn of every episode of room g moves in `directions[g]` (into its wall)."""
    forced = np.full((len(directions) * group_size, turns, max_new_tokens), -1, np.int32)
    for g, direction in enumerate(directions):
        name = sokoban_rules.DIRECTIONS[int(direction)]
        text = f'<tool_call>{{"name": "move", "arguments": {{"direction": "{name}"}}}}</tool_call>'
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > max_new_tokens:
            raise SystemExit(f"a forced call is {len(ids)} tokens, more than max_new_tokens {max_new_tokens}")
        forced[g * group_size : (g + 1) * group_size, :, : len(ids)] = ids
    return jnp.asarray(forced)


def memory_bytes(compiled) -> int | None:
    """Arguments + outputs + temporaries of a compiled program (None where the backend does not say)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn` (each waited for)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure(args, world, turns: int, history: int | None) -> dict:
    """One column at one T: the rollout's and the train step's time and memory, the episode's tokens."""
    c, tokenizer, mc, params, base_env, rooms, directions = world
    env = R.compile_env(base_env.replace(max_steps=turns), tokenizer, vocab_size=mc.vocab_size)
    m = int(c.rollout.max_new_tokens)
    rc = R.RolloutConfig(
        group_size=args.group_size, max_new_tokens=m, max_turns=turns, prefill_chunk=64, history=history
    )
    starts = SokobanStart(split=jnp.full((len(rooms),), TRAIN, jnp.int32), room=jnp.asarray(rooms))
    forced = forced_calls(tokenizer, directions, args.group_size, turns, m)
    key = jax.random.PRNGKey(1)
    # Compiled once, ahead of time: the executables are both measured and called.
    rollout_fn = R.make_rollout_fn(mc, rc).lower(params, key, starts, env=env, forced_tokens=forced).compile()
    traj = jax.block_until_ready(rollout_fn(params, key, starts, env=env, forced_tokens=forced))
    played = np.asarray(traj.stats.num_turns)
    if not np.all(played == turns):
        raise AssertionError(f"episodes played {played.tolist()} turns, not {turns}")
    rollout_s = timed(lambda: rollout_fn(params, key, starts, env=env, forced_tokens=forced).reward, args.repeats)
    optimizer = optax.adam(1e-4)
    shared = not args.no_shared_prefix
    lrn = learner_lib.Learner(
        learner_lib.LearnerConfig(
            group_size=args.group_size, share_prompt_prefix=shared and history is None, share_common_prefix=shared
        ),
        policy.make_logp_fn(mc, group_size=args.group_size),
        losses.get_loss("gspo"),
        optimizer,
        num_groups=len(rooms),
        donate=False,
    )
    state = trainer.create_train_state(params, optimizer, jax.random.PRNGKey(2))
    batch, _ = lrn.train_batch(traj, state.step)
    train_step = lrn.train_step.lower(state, batch).compile()
    # `Learner.learner_step`: the batch's preparation (and shared-prefix cut), then the train step.
    step_s = timed(lambda: train_step(state, lrn.train_batch(traj, state.step)[0])[1]["loss"], args.repeats)
    return {
        "rows": int(traj.tokens.shape[0]),
        "row_length": int(traj.tokens.shape[1]),
        "shared_prefix_tokens": int(lrn.prefix_len or lrn.common_len or 0),
        "tokens_per_episode": float(np.asarray(traj.valid).sum() / (len(rooms) * args.group_size)),
        "rollout_s": rollout_s,
        "train_step_s": step_s,
        "rollout_bytes": memory_bytes(rollout_fn),
        "train_step_bytes": memory_bytes(train_step),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    world = build_world(args)
    turns = [int(t) for t in args.turns.split(",")]
    columns = {h: (None if h == "full" else int(h)) for h in args.histories.split(",")}
    results: dict = {}
    for name, history in columns.items():
        label = name if name == "full" else f"k{history}"
        results[label] = {}
        for t in turns:
            row = measure(args, world, t, history)
            results[label][t] = row
            print(
                f"{label:>5} T={t:>3}: rows {row['rows']:>4} x {row['row_length']:>5}  tokens/episode "
                f"{row['tokens_per_episode']:>7.0f}  rollout {row['rollout_s']:.3f} s  train step "
                f"{row['train_step_s']:.3f} s  memory rollout {row['rollout_bytes']} B, train step "
                f"{row['train_step_bytes']} B",
                flush=True,
            )
    first, last = turns[0], turns[-1]
    growth = {
        label: {
            key: (rows[last][key] / rows[first][key] if rows[first][key] else None)
            for key in ("rollout_s", "train_step_s", "rollout_bytes", "train_step_bytes", "tokens_per_episode")
            if rows[first][key] is not None and rows[last][key] is not None
        }
        for label, rows in results.items()
    }
    out = {
        "benchmark": "history_cost",
        "device": jax.devices()[0].device_kind,
        "turns": turns,
        "turns_ratio": last / first,
        "batch": [args.groups, args.group_size],
        "shared_prefix": not args.no_shared_prefix,
        "results": {label: {str(t): row for t, row in rows.items()} for label, rows in results.items()},
        "growth": growth,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
