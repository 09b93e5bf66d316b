"""The RL post-training loop for any registered environment, as a library call:

    rows = reno_jax.loop.train(config, workdir)

validate the config -> build tokenizer, model (or restore the latest checkpoint) and device layout -> warm start
(once, cached in the workdir) -> for each curriculum stage: rollout -> learner step -> metrics row, checkpoint,
curves, and every `eval_every` steps the environment's default evaluation suites. The CLI
(`python -m experiments.train`) is a thin layer over it.

Writes into `workdir`: `config.json`, `metrics.jsonl` (one JSON object per step, kept exact across restarts),
TensorBoard event files, `learning_curves.png` (refreshed during the run), Orbax checkpoints under
`checkpoints/`, and the cached warm start under `warmstart/`. Calling it again with the same workdir resumes from
the latest checkpoint. With `lora.rank > 0` the state, and so each checkpoint, holds LoRA adapters and their
optimizer state only, over a frozen base rebuilt from the config and the warm start (`reno_jax.loop.adapters`).

Several processes (`jax.distributed` initialised by the caller): the workdir must be one directory every process
sees. Process 0 writes the files above and shows the progress bars; every process takes part in the Orbax saves
and restores. Every process builds the same whole host batch (episode starts, warm-start transcripts) from the
same key, since these are tiny next to the rollout, and `Layout.place_batch` materialises only its own rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from reno_jax import parallel, run_config
from reno_jax.checkpoint import metrics as metrics_lib
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.checkpoint.orbax import to_jsonable
from reno_jax.envs import registry
from reno_jax.errors import ConfigError
from reno_jax.loop import adapters, build, curriculum, evaluation, host_envs, hosts, recipe, tokenizers, warmstart
from reno_jax.loop.config import validate_config
from reno_jax.rl import learner as learner_lib
from reno_jax.rl import policy, trainer
from reno_jax.rollout import rollout as rollout_lib
from reno_jax.rollout import summary as summary_lib

# Panels of learning_curves.png around the environment's own (`Metric(plot=True)`).
LEADING_CURVES = ("rollout/rewards_mean", "rollout/tool_call_valid_rate")
TRAILING_CURVES = (
    "rollout/informative_group_rate",
    "train/entropy",
    "train/forking_entropy",
    "train/grad_norm",
    "perf/step_seconds",
)


@dataclasses.dataclass(frozen=True)
class StageRunner:
    """What one curriculum stage runs: its environment, learner and start sampler (the optimiser is the run's)."""

    stage: curriculum.Stage
    env: rollout_lib.CompiledEnv
    learner: learner_lib.Learner
    starts_fn: Callable[[jax.Array], Any]


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What every phase of a run shares: the typed config, where it writes, and the model it trains."""

    config: run_config.RunConfig
    workdir: str
    layout: parallel.Layout
    tokenizer: Any
    model_config: Any
    abstract_params: Any
    stages: list
    optimizer: Any


@dataclasses.dataclass
class StartPoint:
    """Where the GSPO loop starts: its state and step, and the fixed trees beside it (the forking KL's anchor, a
    LoRA run's frozen base)."""

    state: Any
    step: int
    ref_params: Any
    base: Any


def with_env(config, env: registry.Entry | type | None) -> run_config.RunConfig:
    """The config to run: as given, or with `env.name` set to `env`'s (an entry registered from the caller's code,
    or a `TextEnv` class `registry.register_env` registered)."""
    config = run_config.load(config)
    if env is None:
        return config
    env = registry.entry_of(env)
    if registry.get(env.name) is not env:
        raise ValueError(f"environment {env.name!r} is not the registered one; pass registry.register(...)'s entry")
    return dataclasses.replace(config, env=ml_collections.ConfigDict({**config.env.to_dict(), "name": env.name}))


def train(config, workdir: str, *, env: registry.Entry | type | None = None) -> list[dict]:
    """Runs (or resumes) the experiment; returns the metric rows written in this call.

    `config`: a `run_config.RunConfig`, or a ConfigDict / dict of one. `env`: an environment registered by the
    caller (`registry.register(...)`'s entry, or a class `registry.register_env` registered); default: the one
    `config.env.name` names (after importing `config.env.module`). Raises `ConfigError` (naming the flag) for a
    config that cannot run, before anything is written.
    """
    config = validate_config(with_env(config, env))
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir} is a file; expected a directory (created if missing)")
    os.makedirs(workdir, exist_ok=True)
    tokenizer = tokenizers.run_tokenizer(config, workdir)  # saved with config.json, once the restore has passed
    model_config, abstract_params = build.abstract_model(config, tokenizer)
    layout = build.make_layout(config, model_config)
    setup = RunSetup(
        config=config,
        workdir=workdir,
        layout=layout,
        tokenizer=tokenizer,
        model_config=model_config,
        abstract_params=abstract_params,
        stages=curriculum.curriculum_stages(config),
        optimizer=recipe.make_optimizer(config),
    )
    with layout.activate():  # the programs' sharding constraints see the mesh (no-op on one device)
        return _train(setup)


def _train(setup: RunSetup) -> list[dict]:
    key_model, key_sft, key_rl = build.run_keys(setup.config)
    # Restore before writing anything: a checkpoint of another model raises RestoreError, the files stay as they were.
    ckpt, state = _restore(setup, key_rl)
    if hosts.is_main_process():
        write_run_config(setup.config, setup.workdir)
        tokenizers.save_run_tokenizer(setup.tokenizer, setup.workdir)
    start = _start_point(setup, state, key_model, key_sft, key_rl)
    if start.step:
        hosts.say(
            f"Resumed from step {start.step} onto {setup.layout.mesh.size} device(s) (checkpoint in {ckpt.directory})"
        )
    try:
        return _run_stages(setup, start, ckpt)
    finally:
        ckpt.close()


def write_run_config(config: run_config.RunConfig, workdir: str) -> None:
    """`<workdir>/config.json`: every field of the run's config (what `runs.read_run_config` reads back)."""
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(to_jsonable(config.to_dict()), f, indent=2)


def _needs_initial_model(setup: RunSetup, state) -> bool:
    """Whether the run builds (and warm-starts) the model: a fresh run, or one that needs it beside the state (the
    forking KL's anchor, a LoRA run's base)."""
    return state is None or _anchored(setup) or adapters.trains_adapters(setup.config)


def _anchored(setup: RunSetup) -> bool:
    return any(bool(stage.config.rl.forking_kl_coef) for stage in setup.stages)


def _restore(setup: RunSetup, key_rl):
    """(checkpointer, the latest state or None), restored onto this run's mesh whatever mesh wrote it; the warm
    start's cache is checked against the model too when it will be read."""
    config = setup.config
    ckpt = ckpt_lib.Checkpointer(
        setup.workdir, save_interval_steps=config.checkpoint_every, max_to_keep=config.keep_checkpoints or None
    )
    # A LoRA run's state holds the adapters and their optimizer state; the frozen base is rebuilt from the config.
    abstract = setup.layout.abstract_state(
        jax.eval_shape(
            lambda p: trainer.create_train_state(adapters.init_trained(config, p), setup.optimizer, key_rl),
            setup.abstract_params,
        )
    )
    warm_cache = os.path.join(os.path.abspath(setup.workdir), warmstart.CACHE_SUBDIR)
    try:
        state = ckpt.restore(abstract)
        if warmstart.runs_warm_start(config) and _needs_initial_model(setup, state) and os.path.isdir(warm_cache):
            ckpt_lib.check_item(warm_cache, {"params": setup.abstract_params})
    except ckpt_lib.RestoreError:
        ckpt.close()
        raise
    return ckpt, state


def _start_point(setup: RunSetup, state, key_model, key_sft, key_rl) -> StartPoint:
    """The state to start from (restored, or fresh from the built and warm-started model) and the fixed trees."""
    config, layout = setup.config, setup.layout
    params = base = None
    anchored, lora_run = _anchored(setup), adapters.trains_adapters(config)
    # The forking KL's anchor is the warm start (or the initial model); a LoRA run's base is too, on resume as well.
    if _needs_initial_model(setup, state):
        # Drawn (or read) straight onto the mesh: each device makes only its own shards.
        _, params = build.build_model(config, key_model, setup.tokenizer, layout)
        if warmstart.runs_warm_start(config):  # the warm start runs once, with the first stage's settings
            params = warmstart.cached_warm_start(
                setup.workdir,
                setup.stages[0].config,
                setup.model_config,
                params,
                setup.tokenizer,
                key_sft,
                layout=layout,
            ).params
    if lora_run:  # never donated (it is no part of the state), so it is also the anchor as it is
        base = params = adapters.frozen_base(config, params)
        ref_params = base if anchored else None
    else:
        ref_params = jax.tree.map(jnp.copy, params) if anchored else None
    if state is None:
        state = layout.place_state(
            trainer.create_train_state(adapters.init_trained(config, params), setup.optimizer, key_rl)
        )
        start = 0
    else:
        start = int(state.step)
    if lora_run and hosts.is_main_process():
        counts = adapters.count_trained(config, setup.abstract_params)
        size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(setup.abstract_params))
        hosts.say(
            f"LoRA rank {config.lora.rank}: {counts['total']:,} adapter parameters trained over a "
            f"frozen {config.model.quantize or 'float'} base of {size:,}"
        )
    return StartPoint(state=state, step=start, ref_params=ref_params, base=base)


def _run_stages(setup: RunSetup, start: StartPoint, ckpt) -> list[dict]:
    """The GSPO loop over the stages left: a step, its metrics row, checkpoint and curves, every `eval_every` steps
    the in-run evaluation."""
    config, stages = setup.config, setup.stages
    total = stages[-1].last_step
    main_process = hosts.is_main_process()
    writer = metrics_lib.MetricsWriter(setup.workdir, start_step=start.step) if main_process else None
    plotter = None
    if main_process and config.plot_every:  # drawn on a thread: the loop does not wait for matplotlib
        plotter = metrics_lib.CurvePlotter(writer.path, os.path.join(setup.workdir, "learning_curves.png"))
    eval_key = jax.random.PRNGKey(config.seed + 1)
    state, rows, panels, seen = start.state, [], (), {}
    for index, stage in enumerate(stages):
        if stage.last_step <= start.step:
            continue
        runner = stage_runner(
            stage, setup.model_config, setup.tokenizer, setup.optimizer, setup.layout, start.ref_params, start.base
        )
        panels = tuple(dict.fromkeys(panels + curve_keys(runner.env.env)))  # every stage's panels, in order
        desc = "GSPO" if len(stages) == 1 else f"GSPO {index + 1}/{len(stages)} {stage.name}"
        first_step = max(start.step, stage.first_step)
        bar = hosts.progress(first_step, stage.last_step, initial=first_step, total=total, desc=desc)
        for _ in bar:
            t0 = time.time()
            # The rollout is waited for only to time it apart from the train step (perf/rollout_seconds).
            out = runner.learner.run_step(state, runner.starts_fn, time_rollout=True)
            state, traj, metrics, t_rollout = out.state, out.traj, out.metrics, out.rollout_seconds
            step = int(state.step)
            row = _step_row(traj, metrics, runner, t0, t_rollout, stage=index if len(stages) > 1 else None)
            if config.eval_every and (step % config.eval_every == 0 or step == total):
                row.update(_evaluate(setup, runner, stage, state, eval_key))
            rows.append(writer.write(step, row) if writer is not None else {"step": step, **row})
            seen.update(dict.fromkeys(row))
            bar.set_postfix(
                reward=f"{row['rollout/rewards_mean']:+.3f}", valid=f"{row['rollout/tool_call_valid_rate']:.2f}"
            )
            ckpt.save(state, config, force=step == total or step == stage.last_step)
            if plotter is not None and step % config.plot_every == 0 and step < total:
                plotter.request(present_panels(panels, seen))
        bar.close()
    if plotter is not None and rows:
        plotter.close(present_panels(panels, seen))  # the last drawing covers every step
    if writer is not None:
        writer.close()
    return rows


def _step_row(traj, metrics, runner: StageRunner, t0: float, t_rollout: float, stage: int | None) -> dict:
    """A step's metrics row: the rollout's summary, the learner's figures and the timings (one host sync)."""
    host_traj = hosts.to_host(traj)
    row = summary_lib.rollout_summary(host_traj, runner.env.env)
    row.update(host_envs.host_stats_summary(host_traj))
    row.update({k: float(v) for k, v in hosts.to_host(metrics).items()})
    if "train/ratio_mean" not in row and "train/seq_ratio_mean" in row:
        row["train/ratio_mean"] = row["train/seq_ratio_mean"]
    row["perf/step_seconds"] = time.time() - t0
    row["perf/rollout_seconds"] = t_rollout
    row["perf/rollout_tokens_per_s"] = float(np.asarray(host_traj.loss_mask).sum()) / max(t_rollout, 1e-9)
    if stage is not None:
        row["stage"] = stage
    return row


def _evaluate(setup: RunSetup, runner: StageRunner, stage: curriculum.Stage, state, eval_key) -> dict:
    """The in-run evaluation's figures (`eval/<suite>/<figure>`) and its time."""
    t_eval = time.time()
    results = evaluation.evaluate(
        runner.learner.policy_params(state.params),
        setup.model_config,
        setup.tokenizer,
        stage.config,
        evaluation.in_run_suite_names(stage.config),
        key=eval_key,
        show_progress=False,
    )
    return {**evaluation.flat_figures(results, prefix="eval/"), "perf/eval_seconds": time.time() - t_eval}


def stage_runner(
    stage: curriculum.Stage, model_config, tokenizer, optimizer, layout: parallel.Layout, ref_params=None, base=None
) -> StageRunner:
    """One stage's environment, rollout, loss and schedules, and the sampler of its episode starts. `base`: the
    frozen base of a LoRA run (the state then trains its adapters)."""
    config = stage.config
    r = config.rl
    rc = config.rollout_config()
    num_groups = config.rollout.boards_per_step
    env, rollout_fn, starts_fn = _stage_rollout(config, tokenizer, model_config, layout)
    ref_logp_fn = None
    if r.forking_kl_coef:  # the forking KL's reference: the warm start, scored on every train batch
        ref_logp_fn = policy.make_logp_fn(model_config, with_entropy=False, group_size=rc.group_size)
    # Every step also reports how far the train forward is from the rollout (train/rollout_*, and with a recorded
    # routing train/routing_agreement), from the first minibatch, which is scored before any update.
    learner = learner_lib.Learner(
        config.learner_config(step_offset=stage.first_step),
        policy.make_logp_fn(
            model_config,
            group_size=rc.group_size,
            remat=r.remat,
            entropy_top_k=r.entropy_top_k,
            routing_replay=r.routing_replay,
            temperature=rc.temperature,
            logits_chunk=r.logits_chunk,
        ),
        recipe.make_loss_fn(config),
        optimizer,
        ref_logp_fn=ref_logp_fn,
        ref_params=ref_params if ref_logp_fn is not None else None,
        rollout_fn=rollout_fn,
        num_groups=num_groups,
        rollout_metrics=True,
        combine=adapters.combine(config),
        frozen=base,
    )
    return StageRunner(stage=stage, env=env, learner=learner, starts_fn=starts_fn)


def _stage_rollout(config: run_config.RunConfig, tokenizer, model_config, layout: parallel.Layout):
    """(env, rollout_fn(params, key, starts), starts_fn(key)) of a stage: the jitted rollout of a registered
    environment, or the host rollout of a host one (`host_envs`); `env` is what the summaries read."""
    env_class = host_envs.host_env_class(config)
    if env_class is not None:
        parts = host_envs.host_rollout_parts(config, tokenizer, model_config, env_class)
        return parts.env, parts.rollout_fn, parts.starts_fn
    env = build.make_compiled_env(config, tokenizer, model_config)
    rollout_fn = rollout_lib.make_rollout_fn(model_config, config.rollout_config())
    sampler = build.env_entry(config).make_sampler(config)
    num_groups = config.rollout.boards_per_step
    return env, functools.partial(rollout_fn, env=env), lambda k: layout.place_batch(sampler(k, num_groups))


def curve_keys(env) -> tuple[str, ...]:
    """Panels of learning_curves.png: rewards and call validity, the environment's plotted figures, then the
    learner's."""
    return LEADING_CURVES + summary_lib.plotted_metrics(env) + TRAILING_CURVES


def present_panels(panels: tuple[str, ...], logged: dict) -> tuple[str, ...]:
    """The `panels` the run has logged, then the evaluated versions of the environment's plotted figures
    (`eval/<suite>/<figure>`, from evaluation during training), a few at most."""
    plotted = {p.split("/", 1)[1] for p in panels if p.startswith("rollout/")}
    evaluated = tuple(k for k in logged if k.startswith("eval/") and k.rsplit("/", 1)[-1] in plotted)
    return tuple(p for p in panels if p in logged) + evaluated[:4]
