"""A saved run's policy as the studies that score it on its warm-start teacher's own games load it.

`studies/teacher_agreement.py` and `studies/connect4_decisions.py` take the same command-line flags (the run, which
of its parameter sets, how many games in which batches, the seed) and score the same parameters: the run's warm
start (step 0) or a checkpoint, with the env section its warm start played (the teacher's games are the warm
start's).
"""

from __future__ import annotations

import argparse

import ml_collections

from reno_jax.loop import runs, warmstart


def add_run_flags(ap: argparse.ArgumentParser) -> None:
    """The flags that name a run's parameters and the games to play."""
    ap.add_argument("--workdir", required=True)
    ap.add_argument(
        "--warm_start", action="store_true", help="score the run's warm start (default: its newest checkpoint)"
    )
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--games", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=100)


def check_run_flags(ap: argparse.ArgumentParser, args) -> None:
    if args.warm_start and args.step is not None:
        ap.error("--warm_start and --step name two different parameter sets; pass one")
    if args.games < 1 or args.batch < 1:
        ap.error("--games and --batch must be >= 1")


def load_scored_run(args):
    """(config, tokenizer, model_config, params, step) of the run's warm start (step 0) or checkpoint, its config
    with the warm start's env section."""
    if args.warm_start:
        run = runs.load_warm_start(args.workdir)
        config, tokenizer, model_config, params, step = run.config, run.tokenizer, run.model_config, run.params, 0
    else:
        config, tokenizer, model_config, params, step = runs.load_run(args.workdir, args.step)
    config = ml_collections.ConfigDict(warmstart.env_config_for_warm_start(config).to_dict())
    return config, tokenizer, model_config, params, step
