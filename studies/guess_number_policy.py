"""What a guess_number run's policy does, state by state: sampled episodes, tabulated by the range the answers left.

For a checkpoint (or the run's warm start) it plays `--episodes` sampled episodes (the run's temperature, every
secret equally often), reads each guess and the range stated before it from the transcripts, and prints per range
(most visited first) how often each number was guessed, the share of guesses inside the range and the midpoint
binary search would pick. Ends with one JSON line: the evaluation figures, the share of guesses in range, the
first-guess distribution and the share of first guesses at a midpoint (8 or 9).

    python studies/guess_number_policy.py --workdir=W                  # the newest checkpoint
    python studies/guess_number_policy.py --workdir=W --warm_start      # what GSPO started from
"""

from __future__ import annotations

import argparse
import collections
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax import loop
from reno_jax.envs import guess_number, interface
from reno_jax.loop import evaluation
from reno_jax.protocol import tokenizer as tokenizer_lib

GUESS = re.compile(r'"number": (\d+)')
RANGE = re.compile(r"It is (\d+) to (\d+)\.")


def tabulate(texts: list[str]) -> tuple[dict, int, int]:
    """{(low, high): Counter of guesses}, guesses made, guesses inside the stated range."""
    table = collections.defaultdict(collections.Counter)
    made = inside = 0
    for text in texts:
        guesses = [int(g) for g in GUESS.findall(text)]
        ranges = [(int(a), int(b)) for a, b in RANGE.findall(text)]
        low, high = 1, guess_number.MAX_NUMBER
        for k, g in enumerate(guesses):
            table[(low, high)][g] += 1
            made += 1
            inside += low <= g <= high
            if k < len(ranges):
                low, high = ranges[k]
    return table, made, inside


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--warm_start", action="store_true", help="the run's warm start instead of a checkpoint")
    parser.add_argument("--episodes", type=int, default=512)
    parser.add_argument("--rows", type=int, default=14, help="ranges to print")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be >= 1")
    run = loop.load_warm_start(args.workdir) if args.warm_start else loop.load_checkpoint(args.workdir, args.step)
    if str(run.config.env.name) != "guess_number":
        parser.error(f"{args.workdir} is a run of {run.config.env.name!r}, not guess_number")
    suite = interface.EvalSuite(
        num_episodes=args.episodes,
        starts=lambda key, ids: guess_number.Start(
            secret=jnp.asarray(np.asarray(ids) % guess_number.MAX_NUMBER + 1, jnp.int32)
        ),
    )
    result = evaluation.run_suite(
        run.params,
        run.model_config,
        run.tokenizer,
        run.config,
        "sampled",
        suite,
        key=jax.random.PRNGKey(args.seed),
        greedy=False,
    )
    traj = jax.device_get(result.trajectory)
    texts = [
        tokenizer_lib.decode(run.tokenizer, np.asarray(traj.tokens[i])[np.asarray(traj.valid[i])].tolist())
        for i in range(len(traj.reward))
    ]
    table, made, inside = tabulate(texts)
    print(f"step {run.step}{' (warm start)' if args.warm_start else ''}: {len(texts)} sampled episodes")
    for (low, high), counts in sorted(table.items(), key=lambda kv: -sum(kv[1].values()))[: args.rows]:
        total = sum(counts.values())
        share = sum(v for g, v in counts.items() if low <= g <= high) / total
        top = ", ".join(f"{g}: {v / total:.2f}" for g, v in counts.most_common(5))
        print(f"{low:2d} to {high:2d}  n={total:4d}  midpoint {(low + high) / 2:4.1f}  in range {share:.2f}  {top}")
    first = table[(1, guess_number.MAX_NUMBER)]
    total = max(sum(first.values()), 1)
    print(
        json.dumps(
            {
                "step": run.step,
                "warm_start": args.warm_start,
                **result.figures,
                "in_range_rate": inside / max(made, 1),
                "first_guess": {str(g): v / total for g, v in sorted(first.items())},
                "first_guess_midpoint_rate": (first[8] + first[9]) / total,
            }
        )
    )


if __name__ == "__main__":
    main()
