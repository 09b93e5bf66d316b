"""The supervised warm start, one loop for every environment: next-token training on whole conversations of the
environment's scripted teacher (`registry` entry's `make_teacher`), written by stepping the environment itself
(`rl.sft.env_transcripts`), so the token sequences are exactly those a rollout of the same calls would hold.

`sft.length_pool` > 1 draws that many batches of conversations at once and trains them as batches of similar
lengths (`sft.length_sorted_batches`), each cut after its own longest (`rl.length_bucket`): where lengths differ a
lot (whole games), a batch no longer pads its short conversations to a long one's length.

`sft.eval_every` > 0 plays the run's evaluation suites (`config.eval_suites`, else the environment's defaults) on
the warm-starting parameters every that many steps and at the end, so one long warm start shows how far more of
it goes; every step's NLL and those figures go to `<workdir>/warmstart_log/` (metrics.jsonl, TensorBoard and
learning_curves.png).

A warm start that should teach the call format and nothing more uses a teacher with no strategy (tic-tac-toe:
a uniformly random legal square); `sft.soft_targets` then scores every call against the teacher's whole choice
(uniform over its support) instead of the one sampled.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from reno_jax import run_config
from reno_jax.checkpoint import metrics as metrics_lib
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.envs import interface
from reno_jax.errors import ConfigError, as_config_error
from reno_jax.loop import build, curriculum, evaluation, host_envs, host_warmstart, hosts
from reno_jax.rl import sft, shared_prefix
from reno_jax.rl.batch import TrainBatch, bucketed_length, trim_length, used_length
from reno_jax.rollout import rollout as rollout_lib
from reno_jax.rollout import summary as summary_lib

CACHE_SUBDIR = "warmstart"
LOG_SUBDIR = "warmstart_log"  # beside the cache, not in it: the cache directory is Orbax's


@dataclasses.dataclass(frozen=True)
class WarmStartResult:
    """The warm-started parameters and what the warm start did (`cached`: restored from the workdir)."""

    params: Any
    cached: bool
    final_nll: float = float("nan")
    seconds: float = 0.0
    teacher: dict = dataclasses.field(default_factory=dict)  # the teacher's own figures on its transcripts
    # the last in-run evaluation (`sft.eval_every`) and the time all of them took (not in `seconds`)
    evaluated: dict = dataclasses.field(default_factory=dict)
    # the student's greedy figures beside the teacher's on one evaluation suite (`against_teacher`)
    compared: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "cached": self.cached,
            "final_nll": self.final_nll,
            "seconds": self.seconds,
            **{f"teacher/{k}": v for k, v in self.teacher.items()},
            **self.evaluated,
            **self.compared,
        }


def runs_warm_start(config) -> bool:
    """Whether a run of `config` starts with the supervised warm start: a drawn model (no `model.path`) and
    `sft.num_steps > 0` in its first curriculum stage (the warm start runs once, with that stage's settings)."""
    config = run_config.load(config)
    first = curriculum.curriculum_stages(config)[0].config
    return not config.model.path and first.sft.num_steps > 0


def transcript_length(env: rollout_lib.CompiledEnv, calls: sft.CallTable, turns: int, rollout_length: int) -> int:
    """The padded length of the teacher's conversations: the prompt, `turns` calls at their longest and the tool
    responses between them, at most the rollout's conversation length."""
    width = int(np.max(np.asarray(calls.length)))
    return min(rollout_length, env.prompt_len + turns * width + (turns - 1) * env.response_len)


def env_config_for_warm_start(config) -> run_config.RunConfig:
    """The config the warm start plays: `sft.env` fields (e.g. other opponents) replace `env`'s."""
    config = run_config.load(config)
    overrides = config.sft.env.to_dict()
    if not overrides:
        return config
    return dataclasses.replace(config, env=ml_collections.ConfigDict({**config.env.to_dict(), **overrides}))


@dataclasses.dataclass(frozen=True)
class TeacherCalls:
    """The warm start's environment (compiled), its teacher and the teacher's calls as token rows."""

    env: rollout_lib.CompiledEnv
    teacher: interface.Teacher
    calls: sft.CallTable


def teacher_calls(config, tokenizer, vocab_size: int) -> TeacherCalls:
    """The teacher of `config`'s warm start (`sft.env` applied) and its calls, checked: the environment has a
    teacher, the teacher takes the `sft` options set, its longest call fits a turn (`rollout.max_new_tokens`).
    Raises `ConfigError` naming the flag."""
    config = env_config_for_warm_start(config)
    entry = build.env_entry(config)
    if entry.make_teacher is None:
        raise ConfigError(
            f"--config.sft.num_steps={config.sft.num_steps}: env.name={entry.name!r} has no warm-start "
            "teacher; set --config.sft.num_steps=0 or register one (registry.register(make_teacher=...))"
        )
    try:
        env = rollout_lib.compile_env(build.make_env(config), tokenizer, vocab_size=vocab_size)
        teacher = entry.make_teacher(config, env.env)
    except (ValueError, KeyError, TypeError) as error:
        raise as_config_error(error) from None
    schemas = env.env.chat().tools
    tool_names = [t["function"]["name"] for t in schemas]
    try:
        calls = sft.build_call_table(
            tokenizer, teacher.calls, int(env.chat.turn_end_id), env.pad_id, tool_names, schemas
        )
    except ValueError as error:  # a call its tool schema cannot take: one line, not a traceback
        raise ConfigError(f"--config.env.name={entry.name}: {error}") from None
    max_new_tokens = config.rollout.max_new_tokens
    longest = int(np.max(np.asarray(calls.length)))
    if longest > max_new_tokens:  # such a call never fits a turn: the warm start would train on nothing
        raise ConfigError(
            f"--config.rollout.max_new_tokens={max_new_tokens} is shorter than env.name="
            f"{entry.name!r}'s longest teacher call ({longest} tokens with the turn end); "
            f"set it to >= {longest}"
        )
    if config.sft.soft_targets and not calls.choice_tokens:
        raise ConfigError(
            "--config.sft.soft_targets=True needs teacher calls that differ "
            f"(env.name={entry.name!r}'s teacher has one call)"
        )
    return TeacherCalls(env=env, teacher=teacher, calls=calls)


def teacher_batches(
    key: jax.Array, sampler, transcribe: Callable, *, batch_size: int, pool: int, rows: int
) -> Iterator[sft.Transcripts]:
    """Each warm-start step's batch of teacher transcripts (`rows` of them: `batch_size` episodes, each one row or
    its turn samples), `transcribe(k_play, starts)` played from the sampler's starts: drawn one batch at a time, or
    (`pool` > 1) `pool` batches at once, handed out as batches of similar lengths (`sft.length_sorted_batches`)."""
    pending: list[sft.Transcripts] = []
    while True:
        if pool == 1:
            key, k_starts, k_play = jax.random.split(key, 3)
            yield transcribe(k_play, sampler(k_starts, batch_size))
            continue
        if not pending:
            key, k_starts, k_play, k_order = jax.random.split(key, 4)
            drawn = transcribe(k_play, sampler(k_starts, pool * batch_size))
            pending = sft.length_sorted_batches(drawn, rows, k_order)
        yield pending.pop()


def teacher_transcribe(taught: TeacherCalls, rc: rollout_lib.RolloutConfig, turns: int, length: int, soft: bool):
    """`(transcribe(key, starts) -> Transcripts, rows per episode)`: whole conversations, or with bounded history
    (`rc.history`) each episode's turn samples as the rollout builds them (`sft.window_transcripts`)."""
    common = dict(env=taught.env, teacher=taught.teacher.policy, calls=taught.calls, soft_targets=soft)
    if rc.history is None:
        return functools.partial(sft.env_transcripts, max_turns=turns, length=length, **common), 1
    return functools.partial(sft.window_transcripts, rollout_config=rc, **common), turns


def sft_batch(out: sft.Transcripts, soft_ids, bucket: int, length: int, system: int) -> TrainBatch:
    """A warm-start step's `TrainBatch` of the transcripts `out`: with soft targets when `soft_ids` is given,
    trimmed to its last real column rounded up to `bucket` (a host read; 0: not trimmed), and, for turn samples
    (`system` > 0, the system prompt's tokens), cut after the system prompt every row starts with, which the step
    then encodes once (`rl.shared_prefix`, the common part alone)."""
    tokens = out.tokens
    batch = TrainBatch(
        tokens=tokens,
        valid=out.valid,
        loss_mask=out.loss_mask,
        old_logp=jnp.zeros(tokens.shape, jnp.float32),
        advantages=jnp.zeros(tokens.shape[:1], jnp.float32),
    )
    if soft_ids is not None:
        batch = batch.replace(soft_target_ids=soft_ids, soft_target_weights=out.target_weights)
    if bucket:
        width = bucketed_length(max(int(used_length(out.valid)), system + 1), length, bucket)
        batch = trim_length(batch, width)
    if system:
        batch = _split_after(batch, system)
    return batch


_split_after = jax.jit(lambda batch, cut: shared_prefix.split_shared_prefix(batch, cut, cut), static_argnums=1)


def check_warm_start(config) -> None:
    """`teacher_calls`' checks, with the run's tokenizer, before anything is built or written."""
    tokenizer = build.build_tokenizer(config)
    env_class = host_envs.host_env_class(env_config_for_warm_start(config))
    if env_class is not None:
        host_warmstart.check_teacher(env_config_for_warm_start(config), tokenizer, env_class)
        return
    teacher_calls(config, tokenizer, len(tokenizer))


def warm_start(
    config,
    model_config,
    params,
    tokenizer,
    key: jax.Array,
    *,
    layout=None,
    log: Callable[[int, dict], Any] | None = None,
) -> WarmStartResult:
    """`config.sft.num_steps` supervised steps on teacher transcripts; returns the trained parameters.

    `layout` (`parallel.Layout`): where the train state and the batches live (default: as given, one device).
    `log(step, row)`: called after every step with ``{"sft/nll": ...}`` and, every `sft.eval_every` steps and at the
    last, the evaluation's figures (``eval/<suite>/<figure>``), played in the run's environment (`config.env`,
    not the warm start's `sft.env`).
    """
    run = run_config.load(config)
    if (host_result := _host_warm_start(run, model_config, params, tokenizer, key, layout, log)) is not None:
        return host_result
    s = run.sft
    suite_names = evaluation.in_run_suite_names(run)
    eval_key = jax.random.PRNGKey(run.seed + 1)  # the RL loop's eval key: comparable figures
    evaluated, eval_seconds = {}, 0.0
    config = env_config_for_warm_start(run)
    taught = teacher_calls(config, tokenizer, model_config.vocab_size)
    env, calls = taught.env, taught.calls
    rc = config.rollout_config()
    turns = rollout_lib.num_turns(env, rc)
    if rc.history is None:
        length = s.max_length or transcript_length(env, calls, turns, rollout_lib.conversation_length(env, rc))
    else:  # turn samples of the rollout's width
        length = rollout_lib.turn_length(env, rc)
    soft = s.soft_targets
    transcribe, rows_per_episode = teacher_transcribe(taught, rc, turns, length, soft)
    rows = int(s.batch_size) * rows_per_episode
    system = 0 if rc.history is None else int(env.history.system_ids.shape[0])  # turn samples: shared, once
    # the same choice tokens for every row of every batch: placed once
    soft_ids = (
        jnp.broadcast_to(jnp.asarray(calls.choice_tokens, jnp.int32), (rows, len(calls.choice_tokens)))
        if soft
        else None
    )
    sampler = build.env_entry(config).make_sampler(config)
    state, step_fn, place = sft.supervised_trainer(s, params, model_config, key, layout)
    bucket = config.rl.length_bucket
    pool = s.length_pool
    batches = teacher_batches(key, sampler, transcribe, batch_size=s.batch_size, pool=pool, rows=rows)
    t0, nll, infos = time.time(), float("nan"), []
    bar = hosts.progress(int(s.num_steps), desc="warm start")
    for index in bar:
        out = next(batches)
        state, metrics = step_fn(state, place(sft_batch(out, soft_ids, bucket, length, system)))
        nll = float(metrics["nll"])
        infos.append(jax.device_get(out.info))
        step = index + 1
        row = {"sft/nll": nll}
        if s.eval_every and (step % s.eval_every == 0 or step == s.num_steps):
            t_eval = time.time()
            results = evaluation.evaluate(
                state.params, model_config, tokenizer, run, suite_names, key=eval_key, show_progress=False
            )
            evaluated = evaluation.flat_figures(results, prefix="eval/")
            row.update(evaluated, **{"perf/eval_seconds": time.time() - t_eval})
            eval_seconds += row["perf/eval_seconds"]
        if log is not None:
            log(step, row)
        bar.set_postfix(nll=f"{nll:.3f}")
    teacher_figures = {}
    if infos:
        info = jax.tree.map(lambda *xs: np.concatenate(xs), *infos)
        teacher_figures = interface.summarize(env.env, info)
    return WarmStartResult(
        params=state.params,
        cached=False,
        final_nll=nll,
        seconds=time.time() - t0 - eval_seconds,
        teacher=teacher_figures,
        evaluated=dict(evaluated, **({"eval_seconds": eval_seconds} if s.eval_every else {})),
    )


def _host_warm_start(run, model_config, params, tokenizer, key, layout, log) -> WarmStartResult | None:
    """`warm_start` for a host environment (`host_warmstart`), or None for a jitted one."""
    host_class = host_envs.host_env_class(env_config_for_warm_start(run))
    if host_class is None:
        return None
    figures = host_warmstart.warm_start(run, model_config, params, tokenizer, key, host_class, layout=layout, log=log)
    return WarmStartResult(cached=False, **figures)


def cached_warm_start(
    workdir: str, config, model_config, params, tokenizer, key: jax.Array, *, layout=None
) -> WarmStartResult:
    """`warm_start`, saved in `workdir/warmstart` and restored from there when a run is resumed or repeated."""
    path = os.path.abspath(os.path.join(workdir, CACHE_SUBDIR))
    if os.path.isdir(path):
        restored = ckpt_lib.restore_item(path, {"params": params})
        hosts.say(f"Reusing the cached warm start in {path}")
        return WarmStartResult(params=restored["params"], cached=True)
    writer = None
    if hosts.is_main_process():
        writer = metrics_lib.MetricsWriter(os.path.join(os.path.abspath(workdir), LOG_SUBDIR))
    held = None if writer is None else HeldLastRow(writer)
    try:
        result = warm_start(config, model_config, params, tokenizer, key, layout=layout, log=held and held.write)
        result = compare_with_teacher(result, config, model_config, tokenizer, held)
    finally:
        if held is not None:
            held.flush()
        if writer is not None:
            writer.close()
    if writer is not None and run_config.load(config).plot_every:
        plot_warm_start(
            writer.path, host_envs.HostStageEnv(None) if host_envs.is_host(config) else build.make_env(config)
        )
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": result.params})
    checkpointer.wait_until_finished()
    checkpointer.close()
    hosts.say(f"Warm start done: {result.summary()}")
    return result


class HeldLastRow:
    """A metrics writer that holds each row back until the next one (or `flush`), so that the figures computed
    after the last step join that step's row: `flush(extra)` writes it with `extra` added."""

    def __init__(self, writer):
        self.writer, self.row = writer, None

    def write(self, step: int, row: dict) -> None:
        self.flush()
        self.row = (step, dict(row))

    def flush(self, extra: dict | None = None) -> None:
        if self.row is not None:
            step, row = self.row
            self.writer.write(step, {**row, **(extra or {})})
        self.row = None


def compare_with_teacher(result: WarmStartResult, config, model_config, tokenizer, held=None) -> WarmStartResult:
    """`result` with the student's figures beside the teacher's (`against_teacher`), printed (`report_against_teacher`)
    and added to the warm start's last logged row (`held`, a `HeldLastRow`) as ``sft/<student|teacher>/<suite>/...``."""
    if host_envs.is_host(config):  # `host_warmstart` plays the student beside the teacher itself (no registry entry)
        return result
    compared = against_teacher(config, model_config, result.params, tokenizer, result.evaluated)
    report_against_teacher(compared, build.make_env(config))
    if held is not None:
        held.flush({f"sft/{k}": v for k, v in compared.items()})
    return dataclasses.replace(result, compared=compared)


def teacher_on_suite(
    config, tokenizer, vocab_size: int, suite: interface.EvalSuite, key: jax.Array, num_episodes: int
) -> dict:
    """The teacher's figures on the first `num_episodes` of `suite` (the run's environment with the suite's
    overrides), as an evaluation reports the student's: the environment's metrics and the suite's extras."""
    run = run_config.load(config)
    run = dataclasses.replace(run, sft=dataclasses.replace(run.sft, env=ml_collections.ConfigDict()))  # the run's env
    taught = teacher_calls(run, tokenizer, vocab_size)
    env = rollout_lib.compile_env(build.make_env(run, **dict(suite.env_overrides)), tokenizer, vocab_size=vocab_size)
    rc = run.rollout_config()
    if env.env.max_turns() < evaluation.UNBOUNDED_TURNS:  # every turn the suite allows, as the evaluation plays
        rc = dataclasses.replace(rc, max_turns=int(env.env.max_turns()))
    turns = rollout_lib.num_turns(env, rc)
    length = transcript_length(env, taught.calls, turns, rollout_lib.conversation_length(env, rc))
    k_starts, k_play = jax.random.split(key)
    ids = np.arange(int(num_episodes))
    out = sft.env_transcripts(
        k_play, suite.starts(k_starts, ids), env, taught.teacher.policy, taught.calls, max_turns=turns, length=length
    )
    info = {k: np.asarray(v) for k, v in jax.device_get(out.info).items()}
    figures = interface.summarize(env.env, info)
    if suite.extra is not None:
        figures.update(suite.extra(info, ids))
    return figures


def against_teacher(config, model_config, params, tokenizer, evaluated: dict | None = None) -> dict:
    """The warm-started student's greedy figures on the first `sft.compare_episodes` episodes of the run's first
    evaluation suite (`eval_suites`, else the environment's first default) beside the teacher's on the same ones:
    ``{"student/<suite>/<figure>": ..., "teacher/<suite>/<figure>": ...}``, the figures both have; {} without a
    suite or a teacher. `evaluated`: the warm start's own last evaluation (``eval/<suite>/<figure>``), reused when
    it played the same episodes."""
    run = run_config.load(config)
    cap = run.sft.compare_episodes
    suites = evaluation.resolve_suites(run, evaluation.in_run_suite_names(run)) if cap else {}
    if not suites or build.env_entry(run).make_teacher is None:
        return {}
    name, suite = next(iter(suites.items()))
    total = cap if suite.scalable else min(cap, int(suite.num_episodes))  # as `run_suite` counts them
    key = jax.random.PRNGKey(run.seed + 1)  # the in-run evaluations' key
    whole = not suite.scalable and total == int(suite.num_episodes)  # the warm start's own evaluation played these
    student = {k.split("/", 2)[2]: v for k, v in (evaluated or {}).items() if whole and k.startswith(f"eval/{name}/")}
    if not student:
        student = evaluation.run_suite(
            params, model_config, tokenizer, run, name, suite, key=key, num_episodes=total, show_progress=False
        ).figures
    teacher = teacher_on_suite(run, tokenizer, model_config.vocab_size, suite, key, total)
    shared = [k for k in teacher if isinstance(student.get(k), (int, float))]
    return {
        **{f"student/{name}/{k}": float(student[k]) for k in shared},
        **{f"teacher/{name}/{k}": float(teacher[k]) for k in shared},
    }


def report_against_teacher(compared: dict, env) -> str | None:
    """Prints the student's line and the teacher's (`against_teacher`), and one warning line when the student
    scores under half the teacher's on the environment's first plotted figure; returns that warning."""
    if not compared:
        return None
    suite = next(iter(compared)).split("/")[1]
    for who in ("student", "teacher"):
        figures = ", ".join(f"{k.split('/', 2)[2]} {v:.3f}" for k, v in compared.items() if k.startswith(who + "/"))
        hosts.say(f"Warm start on {suite!r}, {who}: {figures}")
    plotted = [name.split("/", 1)[1] for name in summary_lib.plotted_metrics(env)]
    score = next((n for n in plotted if f"teacher/{suite}/{n}" in compared), None)
    if score is None:  # no figure the environment calls its score: nothing to warn on
        return None
    student, teacher = compared[f"student/{suite}/{score}"], compared[f"teacher/{suite}/{score}"]
    if not (teacher > 0 and student < 0.5 * teacher):
        return None
    warning = (
        f"Warning: the warm-started student's {score} on {suite!r} ({student:.3f}) is under half the teacher's "
        f"({teacher:.3f}); RL starts from a model that has not learned the teacher (more --config.sft.num_steps?)"
    )
    hosts.say(warning)
    return warning


def plot_warm_start(jsonl_path: str, env) -> str:
    """learning_curves.png beside the warm start's metrics.jsonl: its NLL and the environment's plotted figures of
    each evaluated suite (`eval/<suite>/<figure>`)."""
    rows = metrics_lib.read_metrics(jsonl_path)
    plotted = {name.split("/", 1)[1] for name in summary_lib.plotted_metrics(env)}
    seen = dict.fromkeys(k for row in rows for k in row)
    keys = ["sft/nll"] + [k for k in seen if k.startswith("eval/") and k.rsplit("/", 1)[-1] in plotted]
    return metrics_lib.plot_learning_curves(
        jsonl_path, os.path.join(os.path.dirname(jsonl_path), "learning_curves.png"), keys, title="warm start"
    )
