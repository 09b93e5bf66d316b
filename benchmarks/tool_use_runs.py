"""Tool-use runs: trains a host tool task under several seeds and its no-tool control, evaluates each on the
held-out suite, prints one JSON line of figures and draws accuracy and tool-call rate per GSPO step.

Each run is a separate `python -m experiments.train` process into a fresh workdir ROOT/<arm>/seed<N> (warm start
and GSPO, timed wall-clock), then `python -m experiments.evaluate --num_episodes=EPISODES` (greedy, the held-out
suite, scored by the environment: Reasoning Gym's own scorer for `arithmetic_calculator`). The control arm is the
same config with `--control` flags added (default: the calculator task's `--config.env.tool_enabled=False`).
A run whose workdir already holds its `tool_use_run.json` is read back, not run again, so the arms can be run one
invocation at a time (`--arms=task --seeds=0`, then `--arms=control`, ...) and a last invocation collects them all.

    python benchmarks/tool_use_runs.py --config=configs/arithmetic_calculator_tiny.py --root=workdir/tool_use \
        --seeds=0,1,2 --control_seeds=0 --plot=docs/images/arithmetic_tool_use.png
    python benchmarks/tool_use_runs.py --config=configs/two_hop_lookup_tiny.py --root=workdir/two_hop \
        --control=--config.env.random_tool=True --tool_figure=second_lookup

The JSON line: per run the held-out `accuracy` (`heldout/correct`), `tool_call_rate` (`heldout/<--tool_figure>`,
default `used_tool`, else `heldout/tool_calls`), the warm start's held-out figures the run logged, and `minutes`
(the training process, compiles included); `summary` has each arm's mean / min / max. `--config.*` flags go to
every training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np

from reno_jax.loop import cli_runs

ARMS = ("task", "control")
RESULT = "tool_use_run.json"  # a finished run's figures, in its workdir
ACCURACY, TOOL_RATE, TOOL_CALLS = "correct", "used_tool", "tool_calls"


def tool_rate(figures: dict, prefix: str, figure: str = TOOL_RATE) -> float | None:
    """The share of episodes that called the tool: `figure` where the environment reports it, else `tool_calls`."""
    for name in (figure, TOOL_CALLS):
        if f"{prefix}{name}" in figures:
            return float(figures[f"{prefix}{name}"])
    return None


def warm_start_figures(workdir: str, figure: str = TOOL_RATE) -> dict:
    """The warm start's last held-out figures (`eval/heldout/...` in `<workdir>/warmstart_log/metrics.jsonl`)."""
    path = os.path.join(workdir, "warmstart_log", "metrics.jsonl")
    rows = cli_runs.read_metrics(path) if os.path.exists(path) else []
    warm = [r for r in rows if f"eval/heldout/{ACCURACY}" in r]
    if not warm:
        return {}
    last = warm[-1]
    rate = tool_rate(last, "eval/heldout/", figure)
    return {"warm_accuracy": last[f"eval/heldout/{ACCURACY}"], "warm_tool_call_rate": rate}


def train_and_evaluate(args, arm: str, seed: int, overrides: list[str]) -> dict:
    """One run (or its saved figures): train, evaluate on `--episodes` held-out tasks, save `RESULT`."""
    workdir = os.path.join(args.root, arm, f"seed{seed}")
    saved = os.path.join(workdir, RESULT)
    if os.path.exists(saved):
        with open(saved) as f:
            return json.load(f)
    if os.path.exists(workdir):
        raise SystemExit(f"{workdir} exists without {RESULT} (an unfinished run): remove it, runs start fresh")
    print(f"{arm} seed {seed}: training into {workdir}", flush=True)
    logs = os.path.join(args.root, arm)
    os.makedirs(logs, exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.train", f"--config={args.config}", f"--workdir={workdir}"]
    _, wall = cli_runs.run([*cmd, f"--config.seed={seed}", *overrides], os.path.join(logs, f"seed{seed}.train.log"))
    out, _ = cli_runs.run(
        [sys.executable, "-m", "experiments.evaluate", f"--workdir={workdir}", f"--num_episodes={args.episodes}"]
        + ["--transcripts=8"],
        os.path.join(logs, f"seed{seed}.eval.log"),
    )
    figures = cli_runs.last_json_line(out)
    result = {
        "arm": arm,
        "seed": seed,
        "accuracy": float(figures[f"heldout/{ACCURACY}"]),
        "tool_call_rate": tool_rate(figures, "heldout/", args.tool_figure),
        "minutes": round(wall / 60, 2),
        **warm_start_figures(workdir, args.tool_figure),
        "episodes": args.episodes,
        "heldout": {k: v for k, v in figures.items() if k.startswith("heldout/")},
    }
    with open(saved, "w") as f:
        json.dump(result, f, indent=1)
    print("  " + json.dumps({k: v for k, v in result.items() if k != "heldout"}), flush=True)
    return result


def curve(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(GSPO steps, values) of `rollout/<name>` in a run's metrics."""
    points = [(r["step"], r[f"rollout/{name}"]) for r in rows if f"rollout/{name}" in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot(root: str, results: list[dict], path: str, title: str, tool_figure: str = TOOL_RATE) -> None:
    """Accuracy and tool-call rate per GSPO step (sampled rollouts, a 10-step mean), one line per run; control
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in results:
        rows = cli_runs.read_metrics(os.path.join(root, r["arm"], f"seed{r['seed']}", "metrics.jsonl"))
        color, style = f"C{r['seed']}", "--" if r["arm"] == "control" else "-"
        for ax, name in zip(axes, (ACCURACY, tool_figure)):
            steps, values = curve(rows, name)
            if not steps:
                continue
            window = max(1, min(10, len(values) // 5))
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            label = f"{r['arm']} seed {r['seed']} (held-out {r['accuracy']:.3f})" if name == ACCURACY else None
            ax.plot(steps[window - 1 :], smooth, style, color=color, label=label)
    for ax, name in zip(axes, ("accuracy (rollout/correct)", f"tool-call rate (rollout/{tool_figure})")):
        ax.set_xlabel("GSPO step")
        ax.set_ylabel(name)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(results: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        runs = [r for r in results if r["arm"] == arm]
        for name in ("accuracy", "tool_call_rate", "minutes"):
            values = np.array([r[name] for r in runs if r.get(name) is not None], np.float64)
            if values.size:
                out[f"{arm}/{name}"] = {"mean": values.mean(), "min": values.min(), "max": values.max()}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/arithmetic_calculator_tiny.py")
    parser.add_argument("--root", required=True, help="parent of the runs' workdirs (ROOT/<arm>/seed<N>)")
    parser.add_argument("--seeds", default="0,1,2", help="the task's seeds, comma-separated")
    parser.add_argument("--control_seeds", default="0", help="the control's seeds ('' for none)")
    parser.add_argument("--control", default="--config.env.tool_enabled=False", help="the control's flags")
    parser.add_argument("--arms", default="task,control", help="arms to run now (the others are only collected)")
    parser.add_argument("--episodes", type=int, default=512, help="held-out tasks each evaluation plays")
    parser.add_argument("--plot", default="", help="the PNG (default: ROOT/tool_use.png)")
    parser.add_argument(
        "--tool_figure", default=TOOL_RATE, help="the episode figure giving the tool-call rate (two-hop: second_lookup)"
    )
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unknown arguments {bad}: only --config.* overrides are passed through")
    seeds = {"task": args.seeds, "control": args.control_seeds}
    seeds = {arm: [int(s) for s in text.split(",") if s.strip()] for arm, text in seeds.items()}
    running = set(args.arms.split(","))
    results = []
    for arm in ARMS:
        flags = overrides + (args.control.split() if arm == "control" else [])
        for seed in seeds[arm]:
            done = os.path.exists(os.path.join(args.root, arm, f"seed{seed}", RESULT))
            if arm in running or done:
                results.append(train_and_evaluate(args, arm, seed, flags))
    plot_path = args.plot or os.path.join(args.root, "tool_use.png")
    title = f"{os.path.basename(args.config)}: task (solid) vs control (dashed)"
    plot(args.root, results, plot_path, title, args.tool_figure)
    print(f"curves: {plot_path}")
    figures = {
        "config": args.config,
        "overrides": overrides,
        "control": args.control,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "runs": [{k: v for k, v in r.items() if k != "heldout"} for r in results],
        "summary": summary(results),
    }
    print(json.dumps(figures, default=float))


if __name__ == "__main__":
    main()
