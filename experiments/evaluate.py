r"""Evaluates the latest checkpoint of a training workdir with that run's own config.

  python -m experiments.evaluate --workdir=workdir/tiny                       # move task, exhaustive boards
  python -m experiments.evaluate --workdir=workdir/tiny --task=game --opponent=minimax --side=both \
      --num_episodes=200 --sampled
  python -m experiments.evaluate --workdir=workdir/tiny_game --opponent=minimax,random --num_episodes=1024

Move task: every board of the chosen set (default: all 2423 non-terminal X-to-move positions) is answered once;
prints mean reward, invalid-call rate, illegal-move rate, optimal-move rate and immediate-win-taken rate.
Game task: N games against the chosen opponent as X, as O or both; prints win/draw/loss/invalid rates and mean
turns. Both report mean generated tokens, can write a few rendered transcripts (--transcripts), and end with
one JSON line of figures.

Any mesh (`--mesh`, the fields of a training config's `mesh` section): the checkpoint, whatever mesh and
number of processes wrote it, is restored straight onto this mesh with the preset's parameter shardings, and
each batch of episodes is split over its batch axes:

  python -m experiments.evaluate --workdir=workdir/tiny --mesh=fsdp=4,preset=fsdp

Several processes (the `experiments.distributed` flags, as for training): the mesh spans every process's devices
(default: data-parallel over all of them), every process builds the same starts from the same key, and process
0 prints and writes the transcripts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from absl import flags, logging

import jax
import numpy as np
import tqdm

from experiments import cli, distributed
from reno_jax import parallel, pipeline
from reno_jax.envs import registry
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.rollout import rollout as rollout_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (its config.json and checkpoints).",
                               required=True)
_TASK = flags.DEFINE_enum("task", None, ["move", "game"], "Task; default: the run's task.")
_BOARDS = flags.DEFINE_string("boards", "exhaustive", "Move task board set: exhaustive (X to move), "
                              "exhaustive_o (O to move), exhaustive_both, train, heldout or a JSONL path.")
_OPPONENT = flags.DEFINE_string("opponent", None, "Opponent, or a comma-separated list of them. Tic-tac-toe game "
                                "task: random, minimax or epsilon (default: the run's). Other environments: the "
                                "environment's opponents (Connect Four default: random,greedy,negamax).")
_EPSILON = flags.DEFINE_float("epsilon", None, "Epsilon of the epsilon opponent; default: the run's.")
_SIDE = flags.DEFINE_enum("side", "both", ["x", "o", "both"], "Game task: the agent's side.")
_NUM_EPISODES = flags.DEFINE_integer("num_episodes", 0, "Episodes (0: every board for the move task, 256 games).")
_SAMPLED = flags.DEFINE_bool("sampled", False, "Sample with the run's temperature instead of greedy decoding.")
_BATCH = flags.DEFINE_integer("batch_size", 256, "Episodes per jitted rollout call.")
_SEED = flags.DEFINE_integer("seed", 0, "RNG seed (sampling, opponent).")
_TRANSCRIPTS = flags.DEFINE_integer("transcripts", 3, "Rendered transcripts to write to workdir/eval_transcripts.txt.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_MESH = flags.DEFINE_string("mesh", "", "Mesh to restore the checkpoint onto and evaluate on: comma-separated "
                            "fields of a training config's mesh section, e.g. 'fsdp=4,preset=fsdp' or "
                            "'data=2,fsdp=2,expert=2,preset=fsdp_ep' (one axis may be -1: the devices left). "
                            "Default: one device; several processes: data=-1.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", -1, "Conversation length L; -1: the run's, 0: whatever the "
                                   "longest episode needs, with every turn the environment allows (no "
                                   "truncation).")

ENV_OPPONENTS = {"connect4": ("random", "greedy", "negamax")}


load_run = pipeline.load_run  # kept here too: the evaluation CLI's own entry point for scripts


def _batches(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(size, total - start)


@functools.lru_cache(maxsize=8)
def _rollout_fn(model_config, rc):
    return rollout_lib.make_rollout_fn(model_config, rc)  # one compiled program for every opponent and side


def run_episodes(params, model_config, env, rc, starts_fn, total: int, batch: int, key):
    """Runs `total` episodes in fixed-size jitted batches (the last one padded); returns host trajectories."""
    fn = _rollout_fn(model_config, rc)
    place = lambda tree: tree  # noqa: E731
    sharding = jax.tree.leaves(params)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
        # the starts split over the batch axes of the mesh the params were restored onto
        place = parallel.Layout(sharding.mesh, "dp", None).place_batch
    outs = []
    for start, n in tqdm.tqdm(list(_batches(total, batch)), desc="evaluate", dynamic_ncols=True,
                              disable=not distributed.is_main_process()):
        starts = place(starts_fn(start, batch))
        traj = distributed.to_host(fn(params, jax.random.fold_in(key, start), starts, env=env))
        outs.append(jax.tree.map(lambda x: np.asarray(x)[:n], traj))
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *outs)


def evaluate_move(params, model_config, env, config, boards: np.ndarray, greedy: bool, batch: int, key):
    rc = pipeline.rollout_config(config, greedy=greedy, group_size=1)

    def starts_fn(start, size):
        idx = np.arange(start, start + size) % len(boards)
        return ttt_env.move_starts(boards[idx])

    traj = run_episodes(params, model_config, env, rc, starts_fn, len(boards), batch, key)
    info = traj.info
    summary = {
        "task": "move",
        "mean_reward": float(np.mean(traj.reward)),
        "invalid_rate": float(np.mean(~info["valid_call"])),
        "illegal_rate": float(np.mean(info["illegal"])),
        "optimal_move_rate": float(np.mean(info["is_optimal"])),
        "seeking_move_rate": float(np.mean(info["is_seeking"])),
        "win_taken_rate": float(np.sum(info["win_taken"]) / max(np.sum(_win_available(boards)), 1)),
        "mean_generated_tokens": float(np.mean(info["generated_tokens"])),
        "num_episodes": int(len(boards)),
        "greedy": bool(greedy),
    }
    return summary, traj


def _win_available(boards: np.ndarray) -> np.ndarray:
    """Boards on which the side to move has an immediate win."""
    from reno_jax.envs.tictactoe import minimax
    tables = minimax.tables_numpy()
    codes = (boards.astype(np.int64) * (3 ** np.arange(9))).sum(axis=1)
    return tables["winning_mask"][codes].any(axis=1)


def evaluate_game(params, model_config, env, config, opponent: str, epsilon: float, side: str, total: int,
                  greedy: bool, batch: int, key):
    rc = pipeline.rollout_config(config, greedy=greedy, group_size=1)
    k_open, k_policy = jax.random.split(key)

    def agent_of(ids):  # 1 (X) or 2 (O) for episode ids; with "both", even episodes play X
        return {"x": np.ones_like(ids), "o": np.full_like(ids, 2), "both": 1 + ids % 2}[side].astype(np.int8)

    def starts_fn(start, size):
        return ttt_env.game_starts(jax.random.fold_in(k_open, start), size,
                                   agent_player=agent_of(np.arange(start, start + size)), opponent=opponent,
                                   epsilon=epsilon)

    traj = run_episodes(params, model_config, env, rc, starts_fn, total, batch, k_policy)
    info = traj.info
    summary = {"task": "game", "opponent": opponent, "side": side}
    if opponent == "epsilon":
        summary["epsilon"] = epsilon
    for k in ("win", "draw", "loss", "invalid", "illegal", "truncated"):
        summary[f"{k}_rate"] = float(np.mean(info[k]))
    summary["invalid_rate"] = float(np.mean(info["invalid"] | info["illegal"] | info["truncated"]))
    if side == "both":  # the per-side split the targets average over
        x_games = agent_of(np.arange(total)) == 1
        for name, games in (("x", x_games), ("o", ~x_games)):
            for k in ("win", "draw", "loss"):
                summary[f"{name}/{k}_rate"] = float(np.mean(info[k][games])) if games.any() else float("nan")
    summary["mean_turns"] = float(np.mean(info["num_turns"]))
    summary["mean_generated_tokens"] = float(np.mean(info["generated_tokens"]))
    summary["num_episodes"] = int(total)
    summary["greedy"] = bool(greedy)
    return summary, traj


def evaluate_env(params, model_config, tokenizer, config, opponent: str, total: int, greedy: bool, batch: int,
                 key, max_length: int):
    """Any registered environment: `total` episodes against `opponent` (half with the agent first, half second,
    where the environment has sides), summarised by the environment's own metrics."""
    env = pipeline.make_compiled_env(config, tokenizer, model_config, opponent=opponent)
    rc = pipeline.rollout_config(config, greedy=greedy, group_size=1)
    if max_length >= 0:  # 0: no truncation at all, so every turn the environment allows too
        rc = dataclasses.replace(rc, max_length=max_length,
                                 **({"max_turns": int(env.env.max_turns())} if max_length == 0 else {}))
    k_start, k_policy = jax.random.split(key)
    sampler = registry.get(pipeline.env_name(config)).make_sampler(config)

    def starts_fn(start, size):
        return sampler(jax.random.fold_in(k_start, start), size)

    traj = run_episodes(params, model_config, env, rc, starts_fn, total, batch, k_policy)
    summary = {"env": pipeline.env_name(config), "opponent": opponent, "greedy": bool(greedy),
               "num_episodes": int(total), "max_length": rollout_lib.conversation_length(env, rc),
               "mean_reward": float(np.mean(traj.reward)),
               **pipeline.bad_call_rates(traj.stats.valid_call, traj.env_info.get("illegal", False), traj.stats.num_turns),
               "mean_generated_tokens": float(np.mean(traj.stats.generated_tokens))}
    summary.update({k.replace("rollout/", ""): v for k, v in env.env.metrics(traj.env_info).items()})
    return summary, traj


def write_transcripts(path: str, tokenizer, traj, count: int) -> None:
    with open(path, "w") as f:
        for i in range(min(count, len(traj.reward))):
            ids = np.asarray(traj.tokens[i])[np.asarray(traj.valid[i])]
            f.write(f"===== episode {i}  reward {float(traj.reward[i]):+.2f}\n")
            f.write(tokenizer_lib.decode(tokenizer, ids.tolist()))
            f.write("\n\n")


mesh_from_flags = cli.mesh_from_flags  # the `--mesh` flag's parser, in `cli` so tests import it with no flags


def main(argv):
    distributed.initialize()  # first: JAX cannot join other processes once it has computed anything
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments: {argv[1:]}")
    workdir = _WORKDIR.value
    mesh_config = mesh_from_flags(_MESH.value, _BATCH.value)
    config, tokenizer, model_config, params, step = load_run(workdir, _STEP.value, mesh_config)
    logging.info("Evaluating %s at step %s", workdir, step)
    key = jax.random.PRNGKey(_SEED.value)
    greedy = not _SAMPLED.value
    name = pipeline.env_name(config)
    if name != "tictactoe":
        opponents = (_OPPONENT.value.split(",") if _OPPONENT.value
                     else ENV_OPPONENTS.get(name, (config.env.get("opponent", ""),)))
        results, traj = {}, None
        for opponent in opponents:
            summary, t = evaluate_env(params, model_config, tokenizer, config, opponent,
                                      _NUM_EPISODES.value or 256, greedy, _BATCH.value, key, _MAX_LENGTH.value)
            results[opponent or "all"] = summary
            traj = t if traj is None else traj
            if distributed.is_main_process():
                tqdm.tqdm.write(json.dumps(summary))
        if not distributed.is_main_process():
            return
        if _TRANSCRIPTS.value:
            write_transcripts(os.path.join(workdir, "eval_transcripts.txt"), tokenizer, traj, _TRANSCRIPTS.value)
        print(json.dumps({"checkpoint_step": step, "env": name, **{
            f"{opp}/{k}": v for opp, summ in results.items() for k, v in summ.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}}))
        return
    task = _TASK.value or config.env.task
    # A game is scored by its outcome alone and a move by minimax: the training's shaping (env.suboptimal_penalty,
    # env.win_seeking) stays out of the transcripts' rewards.
    env = pipeline.make_compiled_env(config, tokenizer, model_config, task=task, suboptimal_penalty=0.0,
                                     win_seeking=False)
    if task == "move":
        try:
            boards = pipeline.eval_boards(_BOARDS.value, config)
        except ValueError as error:
            raise cli.UserError(f"--boards={_BOARDS.value}: {error}") from None
        if _NUM_EPISODES.value:
            boards = boards[:_NUM_EPISODES.value]
        summary, traj = evaluate_move(params, model_config, env, config, boards, greedy, _BATCH.value, key)
        summary["boards"] = _BOARDS.value
    else:
        opponents = (_OPPONENT.value or config.env.opponent).split(",")
        bad = [o for o in opponents if o not in ("random", "minimax", "epsilon")]
        if bad:
            raise cli.UserError(f"--opponent={_OPPONENT.value}: tic-tac-toe opponents are random, minimax or "
                                "epsilon (comma-separated for several)")
        epsilon = config.env.opponent_epsilon if _EPSILON.value is None else _EPSILON.value
        results, traj = {}, None
        for opponent in opponents:
            summary, t = evaluate_game(params, model_config, env, config, opponent, epsilon, _SIDE.value,
                                       _NUM_EPISODES.value or 256, greedy, _BATCH.value, key)
            results[opponent], traj = summary, t if traj is None else traj
            if len(opponents) > 1 and distributed.is_main_process():
                tqdm.tqdm.write(json.dumps(summary))
        if len(opponents) > 1:  # one line of figures, named by opponent
            summary = {"task": "game", "side": _SIDE.value, "greedy": greedy, **{
                f"{opp}/{k}": v for opp, summ in results.items() for k, v in summ.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}}
    summary["checkpoint_step"] = step
    if not distributed.is_main_process():
        return
    if _TRANSCRIPTS.value:
        write_transcripts(os.path.join(workdir, "eval_transcripts.txt"), tokenizer, traj, _TRANSCRIPTS.value)
    print(json.dumps(summary))


if __name__ == "__main__":
    cli.run(main)
