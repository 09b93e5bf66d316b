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

Runs run one after another (two at once would each take twice as long, and the times would mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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
    args, passthrough = p.parse_known_args(argv)
    unknown = [c for c in args.credits.split(",") if c not in CREDITS]
    if unknown:
        raise SystemExit(f"--credits: unknown {unknown}; choose from {sorted(CREDITS)}")
    return args, passthrough


def one_run(args, passthrough: list[str], credit: str, seed: int) -> dict:
    """Trains one (credit, seed), evaluates its warm start; returns its row: the curve and the figures."""
    workdir = os.path.join(args.root, f"{credit}_s{seed}")
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
    warm = cli_runs.last_json_line(warm_out).get(f"{args.suite}/solved_rate")
    return {
        "credit": credit,
        "seed": seed,
        "wall_s": wall,
        "warm_start": warm,
        "final": values[-1] if values else None,
        "best": max(values) if values else None,
        "steps": steps,
        "solved_rate": values,
    }


def plot(runs: list[dict], path: str, title: str) -> None:
    """Solved rate per step, one line per (credit, seed): colour by credit, line style by seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"trajectory": "tab:blue", "step": "tab:red"}
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    seeds = sorted({r["seed"] for r in runs})
    for r in runs:
        style = styles[seeds.index(r["seed"]) % len(styles)]
        label = f"{r['credit']} seed {r['seed']}"
        ax.plot(r["steps"], r["solved_rate"], style, color=colours[r["credit"]], label=label)
        if r["warm_start"] is not None:
            ax.plot([0], [r["warm_start"]], "o", color=colours[r["credit"]], alpha=0.5)
    ax.set_xlabel("train step")
    ax.set_ylabel("held-out solved rate (greedy)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args, passthrough = parse_args(argv)
    os.makedirs(args.root, exist_ok=True)
    runs = []
    for credit in args.credits.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            row = one_run(args, passthrough, credit, seed)
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
