"""Seed sweep: trains one config from fresh workdirs under several seeds, evaluates each run, and tabulates.

Each seed is a separate `python -m experiments.train` process (a fresh workdir, warm start included), timed
wall-clock, then one `python -m experiments.evaluate` per evaluation spec. The run's own `metrics.jsonl` gives the
curve figures; each evaluation's last output line (its JSON figures, `<suite>/<figure>`) gives the rest, as
`<eval name>/<suite>/<figure>` (e.g. `greedy/positions/optimal_move_rate`). Prints one Markdown row per
seed and the mean / min / max over seeds, writes every seed's reward curve into one PNG, and ends with one JSON
line of figures (also written to ROOT/sweep.json).

Each evaluation also runs on the run's warm start (`experiments.evaluate --warm_start`, what GSPO started from):
`warm_start/<eval name>/<suite>/<figure>` beside the post-RL figure, and the PNG's second panel puts the two side
by side per seed for the `--headline` figures (with `--config.eval_every=N` also the curve of the first headline
figure, evaluated during training). `--no-warm-start` skips it.

    python benchmarks/seed_sweep.py --config=configs/tictactoe_tiny.py --seeds=0,1,2 --root=workdir/sweep
    python benchmarks/seed_sweep.py --config=configs/tictactoe_tiny_game.py --seeds=0,1,2 --root=workdir/sweep_game \
        --eval="greedy:--suites=minimax,random --num_episodes=1024" --eval="sampled:--suites=minimax --sampled"

Runs run one after another: on a small machine two trainings at once would each take twice as long and the times
would mean nothing. The CLIs' compilation cache (`--compilation_cache`) lets later seeds load the programs the first
one compiled, so their times leave out most of the ~40 s of compiles. `--config.*` flags (e.g.
`--config.num_steps=100`) are passed to every training.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import numpy as np

from reno_jax.loop.cli_runs import last_json_line, read_metrics, run

REWARD = "rollout/rewards_mean"
WARM = "warm_start"
VALID = "rollout/tool_call_valid_rate"


def curve_figures(rows: list[dict], first: int = 5, last: int = 20) -> dict:
    rewards = np.array([r[REWARD] for r in rows if REWARD in r], np.float64)
    valid = np.array([r[VALID] for r in rows if VALID in r], np.float64)
    out = {
        "steps": len(rows),
        "first5_reward": float(rewards[:first].mean()),
        "last20_reward": float(rewards[-last:].mean()),
    }
    if valid.size:
        out["last20_valid"] = float(valid[-last:].mean())
    return out


def eval_figures(name: str, figures: dict) -> dict:
    """An evaluation's last JSON line (`{"checkpoint_step", "env", "greedy", "<suite>/<figure>": ...}`) as the
    row's `<name>/<suite>/<figure>` numbers (the step, the environment and the decoding flag are left out)."""
    return {
        f"{name}/{k}": v
        for k, v in figures.items()
        if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def parse_evals(specs: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for spec in specs:
        name, sep, args = spec.partition(":")
        if not sep or not name:
            raise SystemExit(f"--eval={spec!r}: expected NAME:FLAGS, e.g. 'games:--suites=minimax,random'")
        out.append((name, shlex.split(args)))
    return out


def default_headlines(row: dict) -> list[str]:
    """The post-RL rate figures of a row (`<eval>/<suite>/<...>_rate`), at most four: what the bars show."""
    return [k for k in row if not k.startswith(WARM + "/") and k.endswith("_rate") and k.count("/") >= 2][:4]


def eval_curve(rows: list[dict], headline: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a headline figure evaluated during training (`eval/<suite>/<figure>` in the run's
    metrics, the headline without its evaluation name)."""
    key = "eval/" + headline.split("/", 1)[1]
    points = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot(
    curves: dict[int, list[dict]],
    path: str,
    title: str,
    rows: list[dict] | None = None,
    headlines: list[str] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, headlines = rows or [], headlines or []
    compared = [h for h in headlines if rows and all(h in r and f"{WARM}/{h}" in r for r in rows)]
    if compared:
        fig, (ax, bars) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    for seed, metrics in curves.items():
        steps = [r["step"] for r in metrics if REWARD in r]
        rewards = np.array([r[REWARD] for r in metrics if REWARD in r])
        window = max(1, min(20, len(rewards) // 5))  # a short run still shows its smoothed line
        smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
        (line,) = ax.plot(steps, rewards, alpha=0.25)
        ax.plot(steps[window - 1 :], smooth, color=line.get_color(), label=f"seed {seed} ({window}-step mean)")
    ax.set_xlabel("GSPO step")
    ax.set_ylabel(REWARD)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if compared:
        width = 0.8 / (2 * len(rows))
        for j, r in enumerate(rows):
            x = np.arange(len(compared))
            bars.bar(
                x + (2 * j) * width,
                [r[f"{WARM}/{h}"] for h in compared],
                width,
                color=f"C{j}",
                alpha=0.35,
                label=f"seed {r['seed']}: warm start",
            )
            bars.bar(
                x + (2 * j + 1) * width,
                [r[h] for h in compared],
                width,
                color=f"C{j}",
                label=f"seed {r['seed']}: after GSPO",
            )
        bars.set_xticks(np.arange(len(compared)) + 0.4 - width / 2)
        bars.set_xticklabels([h.split("/", 1)[1].replace("/", "\n") for h in compared], fontsize=8)
        bars.set_title("warm start (light) vs after GSPO (dark), greedy evaluation")
        bars.grid(alpha=0.3, axis="y")
        bars.legend(fontsize=7, ncol=2)
        steps, values = eval_curve(next(iter(curves.values())), compared[0])
        if steps:  # evaluated during training: that figure's curve per seed, from the warm start on the right axis
            twin = ax.twinx()
            for j, (seed, metrics) in enumerate(curves.items()):
                steps, values = eval_curve(metrics, compared[0])
                warm = rows[j].get(f"{WARM}/{compared[0]}")
                if warm is not None:
                    steps, values = [0] + steps, [warm] + values
                twin.plot(steps, values, "o--", color=f"C{j}", markersize=3, linewidth=1)
            twin.set_ylabel(f"{compared[0]} (dashed: evaluated during training)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tictactoe_tiny.py")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated config.seed values")
    parser.add_argument("--root", required=True, help="parent of the per-seed workdirs (must not hold them yet)")
    parser.add_argument(
        "--eval",
        action="append",
        default=[],
        metavar="NAME:FLAGS",
        help="an evaluation: a name and the experiments.evaluate flags (repeatable; default: "
        "'greedy:' = the environment's default suites, greedy)",
    )
    parser.add_argument("--trainer", default="experiments.train")
    parser.add_argument("--plot", default="", help="PNG of every seed's curve (default: ROOT/seed_sweep.png)")
    parser.add_argument(
        "--headline",
        default="",
        help="comma-separated <eval>/<suite>/<figure> names the PNG "
        "compares between warm start and after GSPO (default: the first evaluation's rates)",
    )
    parser.add_argument(
        "--no-warm-start", dest="warm_start", action="store_false", help="do not evaluate the warm starts"
    )
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unknown arguments {bad}: only --config.* overrides are passed through")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds={args.seeds!r}: expected comma-separated integers")
    if not seeds:
        parser.error("--seeds is empty")
    evals = parse_evals(args.eval or ["greedy:"])
    os.makedirs(args.root, exist_ok=True)
    taken = [s for s in seeds if os.path.exists(os.path.join(args.root, f"seed{s}"))]
    if taken:
        parser.error(f"{args.root} already holds seed{taken[0]}: the sweep measures fresh workdirs; use a new --root")

    rows, curves = [], {}
    for i, seed in enumerate(seeds):
        workdir = os.path.join(args.root, f"seed{seed}")
        print(f"[{i + 1}/{len(seeds)}] seed {seed}: training into {workdir}", flush=True)
        cmd = [
            sys.executable,
            "-m",
            args.trainer,
            f"--config={args.config}",
            f"--workdir={workdir}",
            f"--config.seed={seed}",
            *overrides,
        ]
        _, train_wall = run(cmd, os.path.join(args.root, f"seed{seed}.train.log"))
        metrics = read_metrics(os.path.join(workdir, "metrics.jsonl"))
        curves[seed] = metrics
        row = {"seed": seed, "train_wall_s": round(train_wall, 1), **curve_figures(metrics)}
        for name, flags in evals:
            print(f"      evaluating {name} {shlex.join(flags)}", flush=True)
            out, wall = run(
                [sys.executable, "-m", "experiments.evaluate", f"--workdir={workdir}", *flags],
                os.path.join(args.root, f"seed{seed}.eval_{name}.log"),
            )
            row[f"{name}/eval_wall_s"] = round(wall, 1)
            row.update(eval_figures(name, last_json_line(out)))
            if args.warm_start and os.path.isdir(os.path.join(workdir, "warmstart")):
                out, _ = run(
                    [sys.executable, "-m", "experiments.evaluate", f"--workdir={workdir}", "--warm_start", *flags],
                    os.path.join(args.root, f"seed{seed}.eval_{name}.warm_start.log"),
                )
                row.update({f"{WARM}/{k}": v for k, v in eval_figures(name, last_json_line(out)).items()})
        rows.append(row)
        print("      " + json.dumps(row), flush=True)

    keys = [k for k in rows[0] if k != "seed" and all(k in r for r in rows)]
    print("\n| seed | " + " | ".join(keys) + " |")
    print("| --- " * (len(keys) + 1) + "|")
    for r in rows:
        print(f"| {r['seed']} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |")
    summary = {}
    for k in keys:
        values = np.array([r[k] for r in rows], np.float64)
        summary[k] = {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max())}
    for stat in ("mean", "min", "max"):
        print(f"| {stat} | " + " | ".join(f"{summary[k][stat]:.4g}" for k in keys) + " |")
    plot_path = args.plot or os.path.join(args.root, "seed_sweep.png")
    headlines = [h for h in args.headline.split(",") if h] or default_headlines(rows[0])
    plot(curves, plot_path, f"{os.path.basename(args.config)}: {len(seeds)} seeds", rows, headlines)
    print(f"curves: {plot_path}")
    figures = {"config": args.config, "seeds": seeds, "overrides": overrides, "per_seed": rows, "summary": summary}
    with open(os.path.join(args.root, "sweep.json"), "w") as f:  # benchmarks/environments_sweep.py --collect
        json.dump(figures, f, indent=1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
