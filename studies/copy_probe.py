"""Does the warm-started student copy? Teacher-forced on the calculator teacher's held-out conversations (every
episode through the tool), the student's per-token figures on the two spans it must copy: the question's
expression into `calculate` and the calculator's result into `answer`, beside the call's fixed format tokens.

Greedy exact-match figures (`copied_expression` in an evaluation) stay at 0 until nearly every digit is right, and
a greedy student that answers directly shows nothing of its copying at all; these per-token figures move first.

    python studies/copy_probe.py --workdir=W [--episodes=128] [--step=N]   # default: W's warm start

Prints one JSON line: per span the mean log-prob per token, the share of its tokens the student gives more than
half its mass (`p_over_half`: greedy decoding picks them), and the share of spans with every token so
(`all_over_half`: greedy decoding copies the whole span).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from reno_jax import loop, run_config
from reno_jax.envs import host
from reno_jax.loop import host_envs, host_warmstart
from reno_jax.rl import policy
from reno_jax.rollout import host_rollout as H

SPANS = ("expression", "result", "format")


def span_marks(chat: H.HostChat, episode: host_warmstart.TeacherEpisode, calls: list[host.ToolCall]) -> np.ndarray:
    """int [L]: 1 on the expression's tokens, 2 on the answer value's, 3 on the calls' other loss tokens."""
    marks = np.where(np.asarray(episode.loss), 3, 0)
    loss_starts = [i for i in range(len(episode.loss)) if episode.loss[i] and (i == 0 or not episode.loss[i - 1])]
    for start, call in zip(loss_starts, calls):
        argument = "expression" if call.name == "calculate" else "value"
        text = str(call.arguments[argument])
        ids = host_warmstart.call_ids(chat, call)
        inner = chat.encode(text)
        for offset in range(len(ids) - len(inner) + 1):  # the argument's tokens inside the call's
            if ids[offset : offset + len(inner)] == inner:
                marks[start + offset : start + offset + len(inner)] = 1 if call.name == "calculate" else 2
                break
    return marks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None, help="a GSPO checkpoint (default: the warm start)")
    parser.add_argument("--episodes", type=int, default=128)
    args = parser.parse_args(argv)
    run = loop.load_warm_start(args.workdir) if args.step is None else loop.load_checkpoint(args.workdir, args.step)
    config, tokenizer, model_config, params = run.config, run.tokenizer, run.model_config, run.trained
    env_class = host.configured(host_envs.host_env_class(config), {"teacher_tool_rate": 1.0})
    play = host_warmstart._play(run_config.load(config), tokenizer, model_config.vocab_size, env_class)
    rng = np.random.default_rng(0)
    episodes, marks = [], []
    for task in env_class.eval_tasks(args.episodes):
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
    logp = np.asarray(policy.make_logp_fn(model_config, with_entropy=False)(params, batch).logp)
    figures = {}
    for code, name in enumerate(SPANS, start=1):
        values, exact = [], []
        for row, m in zip(logp, marks):
            picked = row[: len(m)][m == code]
            values.append(picked)
            exact.append(bool(np.all(picked > np.log(0.5))) if picked.size else True)
        flat = np.concatenate(values)
        figures[f"{name}/tokens"] = int(flat.size)
        figures[f"{name}/logp_per_token"] = float(flat.mean())
        figures[f"{name}/p_over_half"] = float(np.mean(flat > np.log(0.5)))
        figures[f"{name}/all_over_half"] = float(np.mean(exact))
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
