"""Does the warm-started student copy? Teacher-forced on the calculator teacher's held-out conversations (every
episode through the tool), the student's per-token figures on the two spans it must copy: the question's
expression into `calculate` and the calculator's result into `answer`, beside the call's fixed format tokens.

Greedy exact-match figures (`copied_expression` in an evaluation) stay at 0 until nearly every digit is right, and
a greedy student that answers directly shows nothing of its copying at all; these per-token figures move first.

    python studies/copy_probe.py --workdir=W [--episodes=128] [--step=N]   # default: W's warm start

When does a warm start learn to copy? `--train_steps=N` trains a fresh tiny model
(configs/arithmetic_calculator_tiny.py) on the teacher's batches, every episode through the tool, and prints the
per-token figures on `--episodes` held-out conversations every `--probe_every` steps (docs/benchmarks.md, "The
calculator task"); `--train_tool_rate=0.5` trains on the task's own mix instead (the probe stays all through the tool):

    python studies/copy_probe.py --train_steps=1000 --episodes=64                         # constant 3e-3
    python studies/copy_probe.py --train_steps=600 --episodes=64 --final_lr_fraction=0.1  # the cosine to a tenth
    python studies/copy_probe.py --train_steps=1000 --episodes=64 --optimizer=adamw       # optax.adamw, no clipping
    python studies/copy_probe.py --train_steps=1000 --episodes=64 --set model.tiny.num_hidden_layers=3

Prints one JSON line: per span the mean log-prob per token, the share of its tokens the student gives more than
half its mass (`p_over_half`: greedy decoding picks them), and the share of spans with every token so
(`all_over_half`: greedy decoding copies the whole span).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import arithmetic_calculator_tiny
from reno_jax import loop, run_config
from reno_jax.envs import host
from reno_jax.loop import build, host_envs, host_warmstart
from reno_jax.protocol.tokenizer import decode
from reno_jax.rl import policy, sft
from reno_jax.rollout import host_rollout as H

SPANS = ("expression", "result", "format")


def span_marks(chat: H.HostChat, episode: host_warmstart.TeacherEpisode, calls: list[host.ToolCall]) -> np.ndarray:
    """int [L]: 1 on the expression's tokens, 2 on the answer value's, 3 on the calls' other loss tokens. A token
    is an argument's when its text overlaps the argument's characters in the call, so a token the tokenizer
    merged across the call's skeleton and the argument (e.g. `expression": "-`) counts as the argument's."""
    marks = np.where(np.asarray(episode.loss), 3, 0)
    loss_starts = [i for i in range(len(episode.loss)) if episode.loss[i] and (i == 0 or not episode.loss[i - 1])]
    for start, call in zip(loss_starts, calls):
        argument = "expression" if call.name == "calculate" else "value"
        ids = host_warmstart.call_ids(chat, call)
        ends = [len(decode(chat.tokenizer, ids[: k + 1])) for k in range(len(ids))]
        text = decode(chat.tokenizer, ids)
        quoted = json.dumps(str(call.arguments[argument]))
        first = text.index(f'"{argument}": {quoted}') + len(f'"{argument}": ') + 1  # the value's characters
        last = first + len(quoted) - 2
        for k in range(len(ids)):
            if (ends[k - 1] if k else 0) < last and ends[k] > first:
                marks[start + k] = 1 if call.name == "calculate" else 2
    return marks


def marked_batch(play, env_class, tasks, rng):
    """The teacher's conversations of `tasks` as one batch, and their span marks `int [B, L]` (`span_marks`)."""
    episodes, marks = [], []
    for task in tasks:
        calls = []
        episode = host_warmstart.play_teacher(
            _Recording(env_class, calls),
            task,
            rng,
            play.chat,
            turns=play.turns,
            length=play.length,
            max_new_tokens=play.max_new_tokens,
            cut=play.cut,
        )
        episodes.append(episode)
        marks.append(span_marks(play.chat, episode, calls))
    batch = host_warmstart.teacher_batch(episodes, play.length, play.chat.pad_id)
    table = np.zeros(batch.tokens.shape, np.int32)
    for row, m in enumerate(marks):
        table[row, : len(m)] = m
    return batch, table


def span_figures(logp: np.ndarray, marks: np.ndarray) -> dict:
    """Per span: its tokens, mean log-prob per token, share over one half, share of spans wholly over one half."""
    figures = {}
    for code, name in enumerate(SPANS, start=1):
        picked = logp[marks == code]
        whole = [bool(np.all(row[m == code] > np.log(0.5))) for row, m in zip(logp, marks)]
        figures[f"{name}/tokens"] = int(picked.size)
        figures[f"{name}/logp_per_token"] = float(picked.mean())
        figures[f"{name}/p_over_half"] = float(np.mean(picked > np.log(0.5)))
        figures[f"{name}/all_over_half"] = float(np.mean(whole))
    return figures


def train_fresh(args, config) -> None:
    """`--train_steps`: a fresh model on the teacher's batches (every episode through the tool), probed every
    `--probe_every` steps on `--episodes` held-out conversations; one JSON line per probe and a last one."""
    tokenizer = build.build_tokenizer(config)
    model_config, params = build.build_model(config, jax.random.PRNGKey(args.seed), tokenizer)
    env_class = host.configured(host_envs.host_env_class(config), {"teacher_tool_rate": 1.0})
    train_class = host.configured(host_envs.host_env_class(config), {"teacher_tool_rate": args.train_tool_rate})
    run = run_config.load(config)
    play = host_warmstart._play(run, tokenizer, model_config.vocab_size, env_class)
    train_play = host_warmstart._play(run, tokenizer, model_config.vocab_size, train_class)
    rng = np.random.default_rng(args.seed + 1)
    probe_batch, probe_marks = marked_batch(play, env_class, env_class.eval_tasks(args.episodes), rng)
    logp_fn = jax.jit(policy.make_logp_fn(model_config, with_entropy=False))
    if args.optimizer == "adamw":
        state, step, params_of = _adamw_trainer(args.learning_rate, params, model_config)
    else:
        s = dataclasses.replace(
            run.sft,
            num_steps=args.train_steps,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            final_lr_fraction=args.final_lr_fraction,
        )
        state, step, _ = sft.supervised_trainer(s, params, model_config, jax.random.PRNGKey(args.seed))
        params_of = lambda state: state.params  # noqa: E731
    probes, t0 = [], time.time()
    for index in range(args.train_steps + 1):
        if index % args.probe_every == 0 or index == args.train_steps:
            logp = np.asarray(logp_fn(params_of(state), probe_batch).logp)
            row = {"step": index, "seconds": round(time.time() - t0, 1)}
            row.update({k: v for k, v in span_figures(logp, probe_marks).items() if k.endswith("logp_per_token")})
            probes.append(row)
            print(json.dumps(row), flush=True)
        if index == args.train_steps:
            break
        tasks = [train_class.sample_task(rng) for _ in range(args.batch_size)]
        episodes = train_play.episodes(tasks, rng)
        state, _ = step(
            state, host_warmstart.teacher_batch(episodes, play.length, play.chat.pad_id, run.rl.length_bucket)
        )
    print(json.dumps({**vars(args), "probes": probes}))


def _adamw_trainer(learning_rate, params, model_config):
    """Plain `optax.adamw` (its default weight decay, no clipping, constant rate) on the warm start's loss."""
    logp_fn = policy.make_logp_fn(model_config, with_entropy=False)
    optimizer = optax.adamw(learning_rate)

    def loss(p, batch):
        mask = batch.loss_mask.astype(jnp.float32)
        return -jnp.sum(logp_fn(p, batch).logp * mask) / jnp.sum(mask)

    @jax.jit
    def step(state, batch):
        p, opt_state = state
        nll, grads = jax.value_and_grad(loss)(p, batch)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), {"nll": nll}

    return (params, optimizer.init(params)), step, lambda state: state[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="", help="probe this run (else --train_steps)")
    parser.add_argument("--step", type=int, default=None, help="a GSPO checkpoint (default: the warm start)")
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--train_steps", type=int, default=0, help="> 0: train a fresh model that many steps")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--final_lr_fraction", type=float, default=1.0, help="the warm start's cosine end")
    parser.add_argument("--optimizer", choices=("warm_start", "adamw"), default="warm_start")
    parser.add_argument("--train_tool_rate", type=float, default=1.0, help="--train_steps: the teacher's tool share")
    parser.add_argument("--probe_every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="--train_steps: config override, a.b=value")
    args = parser.parse_args(argv)
    if not args.workdir:
        if args.train_steps <= 0:
            parser.error("give --workdir=W (probe a run) or --train_steps=N (train a fresh model)")
        config = arithmetic_calculator_tiny.get_config()
        config.update_from_flattened_dict({k: ast.literal_eval(v) for k, v in (p.split("=", 1) for p in args.set)})
        return train_fresh(args, config)
    run = loop.load_warm_start(args.workdir) if args.step is None else loop.load_checkpoint(args.workdir, args.step)
    config, tokenizer, model_config, params = run.config, run.tokenizer, run.model_config, run.trained
    env_class = host.configured(host_envs.host_env_class(config), {"teacher_tool_rate": 1.0})
    play = host_warmstart._play(run_config.load(config), tokenizer, model_config.vocab_size, env_class)
    batch, marks = marked_batch(play, env_class, env_class.eval_tasks(args.episodes), np.random.default_rng(0))
    logp = np.asarray(policy.make_logp_fn(model_config, with_entropy=False)(params, batch).logp)
    figures = span_figures(logp, marks)
    print(json.dumps({"workdir": args.workdir, "step": args.step or 0, "episodes": args.episodes, **figures}))


class _Recording:
    """The environment class, constructed by `play_teacher`, whose teacher's calls are appended to `calls`."""

    def __init__(self, env_class, calls):
        self.env_class, self.calls = env_class, calls

    def __call__(self):
        env, calls = self.env_class(), self.calls
        teacher = env.teacher

        def recorded(rng):
            call = teacher(rng)
            calls.append(call)
            return call

        env.teacher = recorded
        return env


if __name__ == "__main__":
    main()
