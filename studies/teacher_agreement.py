"""How closely a run's policy imitates its environment's warm-start teacher, one decision at a time.

Plays the teacher's own conversations (`sft.env_transcripts`: the teacher's calls, the environment's answers, the
config's warm-start opponent unless `--env` overrides a field), scores them with the policy in one forward pass,
and counts the decisions where the policy's most likely choice token (the token that tells the teacher's calls
apart, e.g. the column digit) is the teacher's. Those are on the teacher's own path; a game the policy plays
itself leaves that path after its first different choice, so `games_all_agreed` (every decision of a game agreed)
says how many of the teacher's games the policy would have played to the end the same way.

    python studies/teacher_agreement.py --workdir=W --warm_start              # what GSPO starts from
    python studies/teacher_agreement.py --workdir=W --env opponent=greedy     # a checkpoint, vs one opponent

Ends with one JSON line: decisions, agreement, games, games_all_agreed.
"""

from __future__ import annotations

import argparse
import ast
import json

import jax
import numpy as np

from reno_jax.loop import build, scored_runs, warmstart
from reno_jax.models import ling3
from reno_jax.rl import sft
from reno_jax.rollout import rollout as rollout_lib


def agreement(params, model_config, tokenizer, config, *, games: int, batch: int, seed: int) -> dict:
    """Plays `games` teacher conversations of `config`'s environment (its `env` section as is) and counts the
    decisions where `params`' most likely choice token is the teacher's."""
    entry = build.env_entry(config)
    if entry.make_teacher is None:
        raise SystemExit(f"env.name={entry.name!r} registers no warm-start teacher")
    env = build.make_compiled_env(config, tokenizer, model_config)
    teacher = entry.make_teacher(config, env.env)
    tool_names = [t["function"]["name"] for t in env.env.chat().tools]
    calls = sft.build_call_table(tokenizer, teacher.calls, int(env.chat.turn_end_id), env.pad_id, tool_names)
    if calls.choice_offset < 0:
        raise SystemExit(f"env.name={entry.name!r}: the teacher's calls have no single token that tells them apart")
    rc = build.rollout_config(config)
    turns = rollout_lib.num_turns(env, rc)
    length = warmstart.transcript_length(env, calls, turns, rollout_lib.conversation_length(env, rc))
    sampler = entry.make_sampler(config)
    logits_fn = jax.jit(lambda p, tokens, valid: ling3.forward(p, model_config, tokens, valid=valid)[0])
    key = jax.random.PRNGKey(seed)
    agreed, decisions, whole = 0, 0, []
    for first in range(0, games, batch):
        k_starts, k_play = jax.random.split(jax.random.fold_in(key, first))
        out = sft.env_transcripts(
            k_play, sampler(k_starts, batch), env, teacher.policy, calls, max_turns=turns, length=length
        )
        tokens = np.asarray(out.tokens)
        at = np.asarray(out.support).any(-1)  # [B, L]: the choice token of each teacher call
        predicted = np.asarray(logits_fn(params, out.tokens, out.valid)).argmax(-1)  # position t predicts t + 1
        hit = np.zeros_like(at)
        hit[:, 1:] = predicted[:, :-1] == tokens[:, 1:]
        keep = min(batch, games - first)
        at, hit = at[:keep], hit[:keep]
        decisions += int(at.sum())
        agreed += int((at & hit).sum())
        whole += [bool(np.all(hit[b][at[b]])) for b in range(keep)]
    return {
        "env": entry.name,
        "opponent": str(config.env.get("opponent", "")),
        "games": len(whole),
        "decisions": decisions,
        "agreement": agreed / max(decisions, 1),
        "games_all_agreed": float(np.mean(whole)),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scored_runs.add_run_flags(ap)
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of the env section the warm start plays, e.g. opponent=greedy (repeatable)",
    )
    args = ap.parse_args(argv)
    scored_runs.check_run_flags(ap, args)
    overrides = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            ap.error(f"--env={item!r}: expected FIELD=VALUE")
        try:
            overrides[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[name] = value  # a bare word: a string
    config, tokenizer, model_config, params, step = scored_runs.load_scored_run(args)
    config.env.update(overrides)
    figures = agreement(params, model_config, tokenizer, config, games=args.games, batch=args.batch, seed=args.seed)
    figures["checkpoint"] = "warm_start" if args.warm_start else step
    print(
        f"{figures['env']} vs {figures['opponent'] or 'its opponent'}: the policy's choice is the teacher's in "
        f"{figures['agreement']:.3f} of {figures['decisions']} decisions; every decision of a game in "
        f"{figures['games_all_agreed']:.3f} of {figures['games']} games"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
