"""Which Connect Four decisions a run's policy gets right: the teacher's agreement split by what the position asks.

Plays the centre-first teacher's own games (`sft.env_transcripts`, against `--opponent`), scores them with the
policy in one forward pass and sorts every decision by its position: "win" (the side to move can make four at
once), "block" (it cannot, but the other side could: one column stops it), "other" (neither). For each kind it
counts the decisions, the share where the policy's most likely column is the teacher's, and the share where that
column is also what the teacher's centre order alone would have played (no win or block looked for): a policy
that agrees on "win" / "block" decisions only where the centre order happens to coincide has not learned to see
fours. It also counts the share where that column is full (the move a game would end on as illegal).

    python studies/connect4_decisions.py --workdir=W --warm_start
    python studies/connect4_decisions.py --workdir=W --step=20 --opponent=random
    python studies/connect4_decisions.py --workdir=W --warm_start --opening_plies=16   # off the teacher's path

Ends with one JSON line: per kind the decisions, the agreement, the centre-order agreement and the full-column
share.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from reno_jax.envs.connect4 import env as c4_env
from reno_jax.envs.connect4 import registration, rules
from reno_jax.loop import build, scored_runs, warmstart
from reno_jax.models import ling3
from reno_jax.rl import sft
from reno_jax.rollout import rollout as rollout_lib

KINDS = ("win", "block", "other")


def centre_order_column(board: np.ndarray) -> int:
    legal = rules.np_legal(board)
    return next(c for c in registration.CENTER_ORDER if legal[c])


def decision_kind(board: np.ndarray) -> str:
    me = rules.np_to_move(board)
    legal = np.flatnonzero(rules.np_legal(board))
    if any(rules.np_winner(rules.np_drop(board, c, me)) == me for c in legal):
        return "win"
    if any(rules.np_winner(rules.np_drop(board, c, 3 - me)) == 3 - me for c in legal):
        return "block"
    return "other"


def split(params, model_config, tokenizer, config, *, games: int, batch: int, seed: int) -> dict:
    entry = build.env_entry(config)
    if entry.name != "connect4":
        raise SystemExit(f"this study reads Connect Four runs; the run's env.name is {entry.name!r}")
    env = build.make_compiled_env(config, tokenizer, model_config)
    teacher = entry.make_teacher(config, env.env)
    tool_names = [t["function"]["name"] for t in env.env.chat().tools]
    calls = sft.build_call_table(tokenizer, teacher.calls, int(env.chat.turn_end_id), env.pad_id, tool_names)
    column_of = {int(calls.ids[k, calls.choice_offset]): k for k in range(rules.COLS)}  # choice token -> column
    rc = build.rollout_config(config)
    turns = rollout_lib.num_turns(env, rc)
    length = warmstart.transcript_length(env, calls, turns, rollout_lib.conversation_length(env, rc))
    sampler = entry.make_sampler(config)
    logits_fn = jax.jit(lambda p, tokens, valid: ling3.forward(p, model_config, tokens, valid=valid)[0])
    # decisions, agreed, agreed with the centre order, a full column chosen
    counts = {k: np.zeros(4, np.int64) for k in KINDS}
    key = jax.random.PRNGKey(seed)
    for first in range(0, games, batch):
        k_starts, k_play = jax.random.split(jax.random.fold_in(key, first))
        out = sft.env_transcripts(
            k_play, sampler(k_starts, batch), env, teacher.policy, calls, max_turns=turns, length=length
        )
        tokens = np.asarray(out.tokens)
        at = np.asarray(out.support).any(-1)
        predicted = np.asarray(logits_fn(params, out.tokens, out.valid)).argmax(-1)
        for b in range(min(batch, games - first)):
            for t in np.flatnonzero(at[b]):
                board = _board_before(tokenizer, tokens[b, :t])  # the board this decision answers
                kind = decision_kind(board)
                teacher_col = column_of[int(tokens[b, t])]
                guess = column_of.get(int(predicted[b, t - 1]), -1)
                full = guess >= 0 and not rules.np_legal(board)[guess]
                counts[kind] += (1, guess == teacher_col, guess == centre_order_column(board), full)
    return {
        k: {
            "decisions": int(n),
            "agreement": round(a / max(n, 1), 3),
            "centre_order": round(c / max(n, 1), 3),
            "full_column": round(f / max(n, 1), 4),
        }
        for k, (n, a, c, f) in counts.items()
    }


def _board_before(tokenizer, prefix: np.ndarray) -> np.ndarray:
    """The last board printed in a conversation prefix (six rows of ``.XO`` cells; ``*`` marks an empty cell)."""
    text = tokenizer.decode(prefix.tolist())
    rows = [line for line in text.split("\n") if len(line) == rules.COLS and set(line) <= set(".XO*")][-rules.ROWS :]
    if len(rows) != rules.ROWS:
        raise RuntimeError("no board text before a decision: is this the Connect Four wording?")
    return np.array([[".XO*".index(ch) % 3 for ch in row] for row in rows], np.int8)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scored_runs.add_run_flags(ap)
    ap.add_argument("--opponent", default="greedy", choices=("random", "greedy", "negamax", "mixed"))
    ap.add_argument(
        "--opening_plies",
        type=int,
        default=0,
        help="start the games after up to that many random plies (positions off the teacher's usual path)",
    )
    args = ap.parse_args(argv)
    scored_runs.check_run_flags(ap, args)
    if not 0 <= args.opening_plies <= c4_env.MAX_OPENING_PLIES:
        ap.error(f"--opening_plies must be in 0..{c4_env.MAX_OPENING_PLIES}, got {args.opening_plies}")
    config, tokenizer, model_config, params, step = scored_runs.load_scored_run(args)
    config.env.opponent = args.opponent
    config.env.opening_plies = args.opening_plies  # not the warm start's: the board the games start from is a flag
    config.sft.teacher, config.sft.soft_targets = "center_greedy", False
    for field, plain in (("explore", 0.0), ("forced_weight", 1.0)):  # the teacher's own path, unweighted
        if field in config.sft:
            config.sft[field] = plain
    figures = split(params, model_config, tokenizer, config, games=args.games, batch=args.batch, seed=args.seed)
    for kind in KINDS:
        f = figures[kind]
        print(
            f"{kind:>6}: {f['decisions']:4d} decisions, the teacher's column {f['agreement']:.3f}, "
            f"the centre order's column {f['centre_order']:.3f}, a full column {f['full_column']:.4f}"
        )
    figures.update(
        checkpoint="warm_start" if args.warm_start else step,
        opponent=args.opponent,
        games=args.games,
        opening_plies=args.opening_plies,
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
