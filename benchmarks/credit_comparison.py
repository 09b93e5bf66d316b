"""Credit, measured (issue #57 item 3): trajectory-level credit (GRPO / GSPO: every turn sample gets its episode's
group advantage) against step-level credit (GiGPO, arXiv 2505.10978: plus the anchor-state step advantage,
`rl.turn_advantage_coef=1`, `rl.turn_discount=0.95`) on the same config and budget, for several seeds.

Each (credit, seed) is a separate `python -m experiments.train` run from a fresh workdir (ROOT/<credit>_s<seed>,
warm start included) with `--config.eval_every=N`, so its metrics hold the held-out solved rate along the run
(`eval/heldout/solved_rate`, greedy); then `python -m experiments.evaluate --warm_start` scores the run's warm start
on the same suite (what RL started from). Prints one Markdown row per run, draws the solved rate per step (one line
per seed and credit, the warm starts as dots at step 0) into ROOT/credit_comparison.png, and ends with one JSON
line of figures (also ROOT/credit_comparison.json). `--config.*` flags are passed to every training.

    python benchmarks/credit_comparison.py --seeds=0,1,2 --root=workdir/credit [--config=configs/sokoban_tiny.py]
        [--eval_every=25] [--config.num_steps=300]

Runs run one after another (two at once would each take twice as long, and the times would mean nothing), a seed's
credits in a row: the warm start reads no `rl.*` setting, so the seed's later credits start from a copy of its first
run's (`<workdir>/warmstart`, which a run reuses bit for bit; `--no_share_warm_start` trains each anew), and every
credit of a seed starts from the same weights. The plot's second panel is the sampled solved rate of the training
rollouts (a 10-step moving average): what each credit's updates see.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np

from reno_jax.loop import cli_runs

CREDITS = {"trajectory": 0.0, "step": 1.0}  # rl.turn_advantage_coef of each credit
FIGURE = "heldout/solved_rate"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/sokoban_tiny.py")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--root", required=True, help="directory of the runs' workdirs, logs, PNG and JSON")
    p.add_argument("--credits", default="trajectory,step", help=f"comma-separated, of {sorted(CREDITS)}")
    p.add_argument("--eval_every", type=int, default=25, help="held-out evaluation every N train steps")
    p.add_argument("--suite", default="heldout", help="the evaluation suite of the headline")
    p.add_argument(
        "--share_warm_start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a seed's later credits start from a copy of its first run's warm start",
    )
    args, passthrough = p.parse_known_args(argv)
    unknown = [c for c in args.credits.split(",") if c not in CREDITS]
    if unknown:
        raise SystemExit(f"--credits: unknown {unknown}; choose from {sorted(CREDITS)}")
    return args, passthrough


def one_run(args, passthrough: list[str], credit: str, seed: int, warm_from: str | None = None) -> dict:
    """Trains one (credit, seed), evaluates its warm start; returns its row: the curves and the figures.
    `warm_from`: a workdir whose warm start this run copies instead of training its own."""
    workdir = os.path.join(args.root, f"{credit}_s{seed}")
    if warm_from is not None and not os.path.isdir(os.path.join(workdir, "warmstart")):
        for sub in ("warmstart", "warmstart_log"):
            if os.path.isdir(os.path.join(warm_from, sub)):
                shutil.copytree(os.path.join(warm_from, sub), os.path.join(workdir, sub))
    flags = [f"--config={args.config}", f"--workdir={workdir}", f"--config.seed={seed}"]
    flags += [f"--config.eval_every={args.eval_every}", f"--config.rl.turn_advantage_coef={CREDITS[credit]}"]
    _, wall = cli_runs.run(
        [sys.executable, "-m", "experiments.train", *flags, *passthrough], os.path.join(workdir + ".train.log")
    )
    warm_out, _ = cli_runs.run(
        [
            sys.executable,
            "-m",
            "experiments.evaluate",
            f"--workdir={workdir}",
            "--warm_start",
            f"--suites={args.suite}",
        ],
        workdir + ".warm_start.log",
    )
    rows = cli_runs.read_metrics(os.path.join(workdir, "metrics.jsonl"))
    key = f"eval/{args.suite}/solved_rate"
    steps, values = [r["step"] for r in rows if key in r], [r[key] for r in rows if key in r]
    sampled = [r["rollout/solved_rate"] for r in rows if "rollout/solved_rate" in r]
    warm = cli_runs.last_json_line(warm_out).get(f"{args.suite}/solved_rate")
    return {
        "credit": credit,
        "seed": seed,
        "wall_s": wall,
        "warm_start_from": warm_from,
        "warm_start": warm,
        "final": values[-1] if values else None,
        "best": max(values) if values else None,
        "steps": steps,
        "solved_rate": values,
        "sampled_solved_rate": sampled,
    }


def plot(runs: list[dict], path: str, title: str) -> None:
    """Solved rate per step, one line per (credit, seed): colour by credit, line style by seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"trajectory": "tab:blue", "step": "tab:red"}
    styles = ["-", "--", ":", "-."]
    fig, (ax, ax_sampled) = plt.subplots(1, 2, figsize=(13, 4.5))
    seeds = sorted({r["seed"] for r in runs})
    for r in runs:
        style = styles[seeds.index(r["seed"]) % len(styles)]
        label = f"{r['credit']} seed {r['seed']}"
        ax.plot(r["steps"], r["solved_rate"], style, color=colours[r["credit"]], label=label)
        if r["warm_start"] is not None:
            ax.plot([0], [r["warm_start"]], "o", color=colours[r["credit"]], alpha=0.5)
        sampled = np.asarray(r["sampled_solved_rate"], float)
        if sampled.size:
            width = min(10, sampled.size)
            smooth = np.convolve(sampled, np.ones(width) / width, mode="valid")
            ax_sampled.plot(np.arange(width, sampled.size + 1), smooth, style, color=colours[r["credit"]], label=label)
    ax.set_xlabel("train step")
    ax.set_ylabel("held-out solved rate (greedy)")
    ax.set_title(title)
    ax_sampled.set_xlabel("train step")
    ax_sampled.set_ylabel("training rollouts' solved rate (sampled, 10-step mean)")
    for a in (ax, ax_sampled):
        a.set_ylim(0, 1)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args, passthrough = parse_args(argv)
    os.makedirs(args.root, exist_ok=True)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        first = None
        for credit in args.credits.split(","):
            warm_from = first if args.share_warm_start else None
            row = one_run(args, passthrough, credit, seed, warm_from)
            first = first or os.path.join(args.root, f"{credit}_s{seed}")
            runs.append(row)
            print(
                f"| {credit} | {seed} | {row['warm_start']} | {row['final']} | {row['best']} | {row['wall_s']:.0f} s |",
                flush=True,
            )
    png = os.path.join(args.root, "credit_comparison.png")
    plot(runs, png, f"{os.path.basename(args.config)}: trajectory vs step credit")
    out = {"benchmark": "credit_comparison", "config": args.config, "png": png, "runs": runs}
    with open(os.path.join(args.root, "credit_comparison.json"), "w") as f:
        json.dump(out, f)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
