r"""GSPO training of a Ling-3.0-architecture policy on any registered tool-calling environment.

  python -m experiments.train --config=configs/tictactoe_tiny.py --workdir=workdir/tiny
  python -m experiments.train --config=configs/connect4_tiny.py --workdir=workdir/c4
  python -m experiments.train --config=configs/tictactoe_tiny.py --workdir=/tmp/t \
      --config.num_steps=5 --config.rl.learning_rate=3e-4

The environment is `config.env.name` (`reno_jax.envs.registry`; configs without one are tic-tac-toe).
`experiments.train_tictactoe` is this command with the tic-tac-toe default config.

Writes into --workdir: `config.json`, `metrics.jsonl` (one JSON object per step, kept exact across restarts),
TensorBoard event files, `learning_curves.png` (refreshed during the run), Orbax checkpoints under
`checkpoints/`, and the cached supervised warm start under `warmstart/`. Running again with the same workdir
resumes from the latest checkpoint.

Several processes (`--coordinator_address --num_processes --process_id`, or a detected cluster; see
`experiments.distributed`): the workdir must be one directory every process sees. Process 0 writes the files
above and shows the progress bars; every process takes part in the Orbax saves and restores. By design every
process builds the same whole host batch (episode starts, warm-start transcripts) from the same key, since
these are tiny next to the rollout, and `Layout.place_batch` then materialises only its own devices' rows.
"""

from __future__ import annotations

import functools
import json
import os
import time

from absl import flags, logging
from ml_collections import config_flags

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import tqdm

from experiments import cli, distributed
from reno_jax import pipeline
from reno_jax.checkpoint import metrics as metrics_lib
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.envs import registry
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.rl import learner as learner_lib
from reno_jax.rl import sft, trainer
from reno_jax.rollout import rollout as rollout_lib

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tictactoe_tiny.py", "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and plots go.", required=True)

GENERIC_CURVE_KEYS = ("rollout/rewards_mean", "rollout/tool_call_valid_rate", "rollout/response_len_mean",
                      "rollout/informative_group_rate", "train/entropy", "train/grad_norm", "perf/step_seconds")
CURVE_KEYS = {  # panels of learning_curves.png, per tic-tac-toe task
    "move": ("rollout/rewards_mean", "rollout/tool_call_valid_rate", "rollout/optimal_move_rate",
             "rollout/win_taken_rate", "rollout/illegal_rate", "rollout/informative_group_rate",
             "train/entropy", "train/forking_entropy", "train/grad_norm", "perf/step_seconds"),
    "game": ("rollout/rewards_mean", "rollout/tool_call_valid_rate", "rollout/win_rate", "rollout/draw_rate",
             "rollout/loss_rate", "rollout/response_len_mean", "rollout/informative_group_rate",
             "train/entropy", "train/grad_norm", "perf/step_seconds"),
}


def say(message: str) -> None:
    """A console line from process 0 only (every process runs the same loop)."""
    if distributed.is_main_process():
        tqdm.tqdm.write(message)


def progress(*args, **kwargs):
    return tqdm.trange(*args, dynamic_ncols=True, disable=not distributed.is_main_process(), **kwargs)


def place_state(layout, state):
    return state if layout is None else layout.place_state(state)


def place_batch(layout, batch):
    return batch if layout is None else layout.place_batch(batch)


# ---------------------------------------------------------------------------------------------- warm start

def warm_start(config, workdir: str, model_config, params, tokenizer, env, key, layout=None) -> tuple[dict, dict]:
    """Supervised format warm start on random-legal-move transcripts; cached in `workdir/warmstart`.

    Move task: one call per dataset board. Game task: whole games (the agent's side and opponent as in RL).
    `layout`: where the train state and the batches go (default: as they are, one device).

    Returns `(params, summary)`; a cached warm start is restored instead of retrained.
    """
    path = os.path.abspath(os.path.join(workdir, "warmstart"))
    if os.path.isdir(path):
        restored = ckpt_lib.restore_item(path, {"params": params})
        say(f"Reusing the cached warm start in {path}")
        return restored["params"], {"cached": True}
    checkpointer = ocp.StandardCheckpointer()
    s = config.sft
    if pipeline.env_name(config) != "tictactoe":
        params, summary = env_warm_start(config, model_config, params, tokenizer, env, key, layout)
        checkpointer.save(path, {"params": params})
        checkpointer.wait_until_finished()
        checkpointer.close()
        say(f"Warm start done: {summary}")
        return params, summary
    train_boards, _ = pipeline.load_boards(config)
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    optimizer = trainer.make_optimizer(s.learning_rate, s.learning_rate * 0.1, min(s.warmup_steps, s.num_steps), s.num_steps,
                                       weight_decay=0.0, clip_norm=1.0)
    state = place_state(layout, trainer.create_train_state(params, optimizer, key))
    step_fn = trainer.make_train_step(pipeline.make_logp_fn(model_config, with_entropy=False), sft.sft_loss,
                                      optimizer)
    length = int(env.spec.prompt_len) + config.rollout.max_new_tokens
    turn_end = int(np.asarray(env.spec.stop_ids)[0])
    pad = int(env.spec.pad_id)
    game = config.env.task == "game"
    if game:  # whole games of random legal moves against the configured opponent, rendered as the rollout would
        rc = pipeline.rollout_config(config)
        length = rollout_lib.conversation_length(env, rc)
        call_ids, call_len, square_offset = sft.call_token_table(tokenizer, turn_end, pad)
        soft = bool(s.get("soft_targets", False)) and square_offset >= 0
        if s.get("soft_targets", False) and not soft:
            logging.warning("sft.soft_targets needs calls that differ in one token; training on sampled squares")
    t0 = time.time()
    nll = float("nan")
    prompt_cache = {}
    bar = progress(s.num_steps, desc="warm start")
    for _ in bar:
        if game:
            key, k_starts, k_play = jax.random.split(key, 3)
            starts = sample_starts(config, k_starts, train_boards, s.batch_size)
            batch = sft.random_game_transcripts(k_play, starts, env, call_ids, call_len, max_turns=rollout_lib.num_turns(env, rc),
                                                length=length, square_offset=square_offset if soft else -1)
            batch.pop("outcome")
            legal = batch.pop("legal_squares")
            if soft:  # expected log-likelihood under the random legal policy at every square token
                batch.update(sft.uniform_soft_targets(legal, call_ids[:, square_offset]))
        else:
            idx = rng.choice(len(train_boards), size=s.batch_size, replace=True)
            batch = sft.random_move_transcripts(tokenizer, train_boards[idx], rng, length, turn_end, pad,
                                                prompt_cache, config.env.get("board_style", "grid"))
            batch = {k: jnp.asarray(v) for k, v in batch.items() if k != "squares"}
        batch["old_logp"] = jnp.zeros(batch["tokens"].shape, jnp.float32)
        batch["advantages"] = jnp.zeros(batch["tokens"].shape[:1], jnp.float32)
        state, m = step_fn(state, place_batch(layout, batch))
        nll = float(m["nll"])
        bar.set_postfix(nll=f"{nll:.3f}")
    params = state.params
    checkpointer.save(path, {"params": params})
    checkpointer.wait_until_finished()
    checkpointer.close()
    summary = {"cached": False, "final_nll": nll, "seconds": time.time() - t0}
    say(f"Warm start done: {summary}")
    return params, summary


def env_warm_start(config, model_config, params, tokenizer, env, key, layout=None) -> tuple[dict, dict]:
    """Supervised warm start on transcripts of the environment's scripted teacher (`registry` `make_teacher`),
    written by stepping the environment itself (`sft.env_transcripts`) against the configured opponents."""
    s = config.sft
    entry = registry.get(pipeline.env_name(config))
    if entry.make_teacher is None:
        raise pipeline.ConfigError(f"env.name={pipeline.env_name(config)!r} has no warm-start teacher; set "
                                   "--config.sft.num_steps=0 or register one (registry.register(make_teacher=...))")
    overrides = dict(s.get("env", {}) or {})  # e.g. other opponents for the transcripts than for RL
    if overrides:
        config = ml_collections.ConfigDict(config.to_dict())
        config.env.update(overrides)
        env = pipeline.make_compiled_env(config, tokenizer, model_config)
    teacher, calls = entry.make_teacher(config, env.env)
    names = [t["function"]["name"] for t in env.env.chat().tools]
    table = sft.build_call_table(tokenizer, calls, int(env.chat.turn_end_id), env.pad_id, names)
    rc = pipeline.rollout_config(config)
    length = int(s.get("max_length", 0)) or rollout_lib.conversation_length(env, rc)
    sampler = entry.make_sampler(config)
    optimizer = trainer.make_optimizer(s.learning_rate, s.learning_rate * 0.1, min(s.warmup_steps, s.num_steps),
                                       s.num_steps, weight_decay=0.0, clip_norm=1.0)
    state = place_state(layout, trainer.create_train_state(params, optimizer, key))
    step_fn = trainer.make_train_step(pipeline.make_logp_fn(model_config, with_entropy=False), sft.sft_loss,
                                      optimizer)
    t0, nll, outcomes = time.time(), float("nan"), []
    bar = progress(s.num_steps, desc="warm start")
    for _ in bar:
        key, k_starts, k_play = jax.random.split(key, 3)
        out = sft.env_transcripts(k_play, sampler(k_starts, s.batch_size), env, teacher, table,
                                  max_turns=rollout_lib.num_turns(env, rc), length=length)
        batch = {k: out[k] for k in ("tokens", "valid", "loss_mask")}
        batch["old_logp"] = jnp.zeros(batch["tokens"].shape, jnp.float32)
        batch["advantages"] = jnp.zeros(batch["tokens"].shape[:1], jnp.float32)
        state, m = step_fn(state, place_batch(layout, batch))
        nll = float(m["nll"])
        outcomes.append(jax.device_get(out["info"]))
        bar.set_postfix(nll=f"{nll:.3f}")
    info = jax.tree.map(lambda *xs: np.concatenate(xs), *outcomes)
    teacher_metrics = {k.replace("rollout/", "teacher/"): v for k, v in env.env.metrics(info).items()}
    return state.params, {"cached": False, "final_nll": nll, "seconds": time.time() - t0, **teacher_metrics}


# ---------------------------------------------------------------------------------------------- episodes

def step_summary(config, env, traj) -> dict[str, float]:
    """Per-step rollout metrics: tic-tac-toe's AReno-named ones, or the common ones plus the environment's."""
    if pipeline.env_name(config) == "tictactoe":
        return pipeline.rollout_summary(traj, config.env.task)
    out = pipeline.rollout_summary(traj, "")
    out.update(env.env.metrics(jax.tree.map(np.asarray, traj.env_info)))
    return out


def sample_starts(config, key, train_boards: np.ndarray, num_groups: int) :
    """This step's episode starts (one per group) for the configured task."""
    if config.env.task == "move":
        idx = jax.random.choice(key, len(train_boards), (num_groups,), replace=len(train_boards) < num_groups)
        return ttt_env.move_starts(train_boards[np.asarray(idx)])
    agent = ttt_env.agent_players(config.env.agent_player, num_groups, float(config.env.get("o_share", 0.5)))
    return ttt_env.game_starts(key, num_groups, agent_player=agent, opponent=config.env.opponent,
                                   epsilon=config.env.opponent_epsilon)


# ---------------------------------------------------------------------------------------------- training

def train(config, workdir: str) -> list[dict]:
    """Runs (or resumes) the experiment; returns the metric rows written in this call.

    Raises `pipeline.ConfigError` (naming the flag) for a config that cannot run, before anything is written.
    """
    pipeline.validate_config(config)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise pipeline.ConfigError(f"--workdir={workdir} is a file; expected a directory (created if missing)")
    os.makedirs(workdir, exist_ok=True)
    main_process = distributed.is_main_process()

    key = jax.random.PRNGKey(config.seed)
    key_model, key_sft, key_rl = jax.random.split(key, 3)
    tokenizer = pipeline.build_tokenizer(config)
    model_config, abstract_params = pipeline.abstract_model(config, tokenizer)
    layout = pipeline.make_layout(config, model_config)
    with layout.activate():  # the programs' sharding constraints see the mesh (no-op on one device)
        return _train(config, workdir, layout, tokenizer, model_config, abstract_params, key_model, key_sft, key_rl,
                      main_process)


def _train(config, workdir, layout, tokenizer, model_config, abstract_params, key_model, key_sft, key_rl,
           main_process) -> list[dict]:
    stages = pipeline.curriculum_stages(config)  # one stage (the config) unless it has a curriculum
    total = stages[-1].last_step
    optimizer = pipeline.make_optimizer(config)

    # Restore (onto this run's mesh, whatever mesh wrote the checkpoint) before writing anything: a checkpoint of
    # another model raises RestoreError naming the leaf and both shapes, and the run's files stay as they were.
    ckpt = ckpt_lib.Checkpointer(workdir, save_interval_steps=config.checkpoint_every,
                                 max_to_keep=config.keep_checkpoints)
    abstract = layout.abstract_state(jax.eval_shape(lambda p: trainer.create_train_state(p, optimizer, key_rl),
                                                    abstract_params))
    anchored = any(bool(stage.config.rl.get("forking_kl_coef", 0.0)) for stage in stages)
    first = stages[0].config  # the warm start runs once, with the first stage's settings
    warm = not config.model.get("path", "") and first.sft.num_steps > 0
    warm_cache = os.path.join(os.path.abspath(workdir), "warmstart")
    try:
        state = ckpt.restore(abstract)
        if warm and (state is None or anchored) and os.path.isdir(warm_cache):  # the cache will be restored
            ckpt_lib.check_item(warm_cache, {"params": abstract.params})
    except ckpt_lib.RestoreError:
        ckpt.close()
        raise
    if main_process:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
    params = None
    if state is None or anchored:  # the forking KL's anchor is the warm start (or the initial model)
        # Drawn (or read) straight onto the mesh: each device makes only its own shards.
        _, params = pipeline.build_model(config, key_model, tokenizer, layout)
        if warm:
            env = pipeline.make_compiled_env(first, tokenizer, model_config)
            params, _ = warm_start(first, workdir, model_config, params, tokenizer, env, key_sft, layout)
    ref_params = jax.tree.map(jnp.copy, params) if anchored else None
    if state is None:
        state = layout.place_state(trainer.create_train_state(params, optimizer, key_rl))
        start = 0
    else:
        start = int(state.step)
        say(f"Resumed from step {start} onto {layout.mesh.size} device(s) (checkpoint in {ckpt.directory})")
    del abstract, params

    writer = metrics_lib.MetricsWriter(workdir, start_step=start) if main_process else None
    rows = []
    plotter = None
    if main_process and config.plot_every:  # drawn on a thread: the loop does not wait for matplotlib
        plotter = metrics_lib.CurvePlotter(writer.path, os.path.join(workdir, "learning_curves.png"))
    for index, stage in enumerate(stages):
        if stage.last_step <= start:
            continue
        stage_config = stage.config
        env, learner, starts_fn = stage_learner(stage, model_config, tokenizer, optimizer, layout, ref_params)
        desc = "GSPO" if len(stages) == 1 else f"GSPO {index + 1}/{len(stages)} {stage.name}"
        first_step = max(start, stage.first_step)
        bar = progress(first_step, stage.last_step, initial=first_step, total=total, desc=desc)
        for _ in bar:
            t0 = time.time()
            # The rollout is waited for only to time it apart from the train step (perf/rollout_seconds).
            state, traj, metrics, t_rollout = learner.run_step(state, starts_fn, time_rollout=True)
            # Host syncs for logging, once per step: the step counter, the rollout's summary and the metrics.
            step = int(state.step)
            row = {}
            host_traj = distributed.to_host(traj)
            row.update(step_summary(stage_config, env, host_traj))
            metrics = distributed.to_host(metrics)
            for k, v in metrics.items():  # `train/loss`: the total minimised; `train/policy_loss`: its policy term
                if k.startswith("train/"):
                    row[k] = float(v)
            if "train/ratio_mean" not in row and "train/seq_ratio_mean" in row:
                row["train/ratio_mean"] = row["train/seq_ratio_mean"]
            dt = time.time() - t0
            row["rollout/informative_group_rate"] = float(metrics["rollout/informative_group_rate"])
            row["perf/step_seconds"] = dt
            row["perf/rollout_seconds"] = t_rollout
            row["perf/rollout_tokens_per_s"] = float(np.asarray(host_traj.loss_mask).sum()) / max(t_rollout, 1e-9)
            if len(stages) > 1:
                row["stage"] = index
            rows.append(writer.write(step, row) if writer is not None else {"step": step, **row})
            bar.set_postfix(reward=f"{row['rollout/rewards_mean']:+.3f}",
                            valid=f"{row.get('rollout/tool_call_valid_rate', float('nan')):.2f}")
            ckpt.save(state, config, force=step == total or step == stage.last_step)
            if plotter is not None and step % config.plot_every == 0 and step < total:
                plotter.request(curve_keys(config, row))
        bar.close()
    if plotter is not None and rows:
        plotter.close(curve_keys(config, rows[-1]))  # the last drawing covers every step
    ckpt.close()
    if writer is not None:
        writer.close()
    return rows


def stage_learner(stage, model_config, tokenizer, optimizer, layout, ref_params=None):
    """`(env, learner, starts_fn)` of one stage of a run: its environment, rollout, loss and schedules (the
    optimiser is the run's, shared by every stage)."""
    config = stage.config
    r = config.rl
    env = pipeline.make_compiled_env(config, tokenizer, model_config)
    rc = pipeline.rollout_config(config)
    num_groups = int(config.rollout.boards_per_step)
    rollout_fn = rollout_lib.make_rollout_fn(model_config, rc)
    ref_logp_fn = None
    if r.get("forking_kl_coef", 0.0):  # the forking KL's reference: the warm start, scored on every train batch
        ref_logp_fn = pipeline.make_logp_fn(model_config, with_entropy=False, group_size=rc.group_size)
    # Every step also reports how far the train forward is from the rollout (train/rollout_*, and with a recorded
    # routing train/routing_agreement), from the first minibatch, which is scored before any update.
    learner = learner_lib.Learner(
        pipeline.learner_config(config, step_offset=stage.first_step),
        pipeline.make_logp_fn(model_config, group_size=rc.group_size, remat=bool(r.get("remat", False)),
                              entropy_top_k=int(r.get("entropy_top_k", 0)),
                              routing_replay=bool(r.get("routing_replay", False)),
                              temperature=rc.temperature),
        pipeline.make_loss_fn(config), optimizer, ref_logp_fn=ref_logp_fn,
        ref_params=ref_params if ref_logp_fn is not None else None,
        rollout_fn=functools.partial(rollout_fn, env=env), num_groups=num_groups, rollout_metrics=True)
    sampler = registry.get(pipeline.env_name(config)).make_sampler(config)
    starts_fn = lambda k: layout.place_batch(sampler(k, num_groups))  # noqa: E731
    return env, learner, starts_fn


def curve_keys(config, row: dict) -> tuple[str, ...]:
    """Panels of learning_curves.png: tic-tac-toe's per task (every stage's, in order), else the common ones and
    the environment's rates."""
    stages = pipeline.curriculum_stages(config)
    if all(pipeline.env_name(stage.config) == "tictactoe" for stage in stages):
        keys = []
        for stage in stages:
            keys.extend(k for k in CURVE_KEYS[stage.config.env.task] if k not in keys)
        return tuple(keys)
    rates = tuple(k for k in row if k.startswith("rollout/") and k.endswith("_rate")
                  and k not in GENERIC_CURVE_KEYS)
    return GENERIC_CURVE_KEYS[:2] + rates[:5] + GENERIC_CURVE_KEYS[2:]


def main(argv):
    distributed.initialize()  # first: JAX cannot join other processes once it has computed anything
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments: {argv[1:]}")
    cli.check_workdir_for_writing(_WORKDIR.value)
    # Orbax logs every checkpoint step at INFO; keep the console to the progress bars and our own lines.
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    rows = train(config, _WORKDIR.value)
    last = rows[-20:] if rows else []
    summary = {"steps": len(rows)}
    if last:
        for k in last[-1]:
            if k in ("rollout/rewards_mean", "rollout/tool_call_valid_rate", "rollout/optimal_move_rate") or (
                    k.startswith("rollout/") and k.endswith("_rate") and pipeline.env_name(config) != "tictactoe"
                    or k in ("rollout/win_rate", "rollout/loss_rate")):
                summary[f"last20/{k}"] = float(np.mean([row[k] for row in last if k in row]))
    if distributed.is_main_process():
        print(json.dumps(summary))


if __name__ == "__main__":
    cli.run(main)
