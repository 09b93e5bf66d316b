"""Every shipped environment's RL result over seeds: warm start vs after RL, against the targets of each.

For each environment in the table below, runs `benchmarks/seed_sweep.py` (fresh workdirs, one training process
per seed, the environment's greedy evaluation on the run and on its warm start) into ROOT/<environment>, then
checks the figures against the environment's targets and prints one table. The last output line is one JSON
object: per environment, per seed the warm-start and post-RL headline figures and the training time, and each
target with the figure it was checked on and whether it holds.

    python benchmarks/environments_sweep.py --root=R                        # all four, seeds 0, 1, 2 (~4.5 h)
    python benchmarks/environments_sweep.py --root=R --only=guess_number --seeds=0
    python benchmarks/environments_sweep.py --root=R --collect              # re-read finished sweeps, no training

`--collect` reads ROOT/<environment>/sweep.json, the figures each seed sweep writes when it ends, so sweeps run
at different times (or on different machines) are checked and tabulated together.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SWEEP_FILE = "sweep.json"  # what seed_sweep.py writes into its root


@dataclasses.dataclass(frozen=True)
class Target:
    """`figure op value` for every seed (`over="each"`) or for the mean over seeds (`over="mean"`). `figure` names
    a seed_sweep row entry; several names joined by "+" are summed (e.g. invalid + illegal moves). `gain`: the
    figure after RL minus the same figure of the run's warm start (what RL added)."""

    figure: str
    op: str
    value: float
    over: str = "each"
    gain: bool = False

    def __post_init__(self):
        if self.op not in (">=", "<="):
            raise ValueError(f"Target.op must be '>=' or '<=', got {self.op!r}")
        if self.over not in ("each", "mean"):
            raise ValueError(f"Target.over must be 'each' or 'mean', got {self.over!r}")

    def measure(self, row: dict) -> float:
        names = self.figure.split("+")
        missing = [k for k in names + [f"warm_start/{k}" for k in names if self.gain] if k not in row]
        if missing:
            raise KeyError(f"target {self.figure!r}: the sweep has no {missing} (figures: {sorted(row)})")
        value = float(sum(row[k] for k in names))
        return value - float(sum(row[f"warm_start/{k}"] for k in names)) if self.gain else value

    def holds(self, value: float) -> bool:
        return value >= self.value if self.op == ">=" else value <= self.value

    def check(self, rows: list[dict]) -> dict:
        values = [self.measure(r) for r in rows]
        if self.over == "mean":
            measured, met = float(np.mean(values)), self.holds(float(np.mean(values)))
        else:
            measured, met = values, all(self.holds(v) for v in values)
        return {
            "figure": self.figure,
            "op": self.op,
            "value": self.value,
            "over": self.over,
            "gain": self.gain,
            "measured": measured,
            "met": bool(met),
        }


@dataclasses.dataclass(frozen=True)
class Environment:
    config: str
    evals: tuple[str, ...]  # seed_sweep --eval specs
    headlines: tuple[str, ...]  # the figures compared between warm start and after RL
    targets: tuple[Target, ...]
    overrides: tuple[str, ...] = ()  # --config.* flags for every training


MIN = 60.0
# The targets of issue #36 (docs/benchmarks.md records what each sweep measured).
ENVIRONMENTS = {
    "tictactoe": Environment(
        config="configs/tictactoe_tiny.py",
        evals=("greedy:--suites=positions",),
        headlines=("greedy/positions/optimal_move_rate", "greedy/positions/illegal_rate"),
        targets=(
            Target("greedy/positions/optimal_move_rate", ">=", 0.90, over="mean"),
            Target("train_wall_s", "<=", 8 * MIN),
        ),
    ),
    "guess_number": Environment(
        config="configs/guess_number_tiny.py",
        evals=("greedy:--suites=secrets",),
        headlines=("greedy/secrets/found_rate", "greedy/secrets/guesses_mean"),
        targets=(
            Target("greedy/secrets/found_rate", ">=", 0.98),
            Target("greedy/secrets/guesses_mean", "<=", 3.6),
            Target("train_wall_s", "<=", 20 * MIN),
        ),
        overrides=("--config.eval_every=20",),
    ),
    "connect4": Environment(
        config="configs/connect4_tiny.py",
        evals=("greedy:--suites=random,greedy",),
        headlines=("greedy/random/win_rate", "greedy/greedy/win_rate"),
        targets=(
            Target("greedy/random/win_rate", ">=", 0.95),
            Target("greedy/greedy/win_rate", ">=", 0.30),
            Target("greedy/random/invalid_rate+greedy/random/illegal_rate", "<=", 0.01),
            Target("greedy/greedy/invalid_rate+greedy/greedy/illegal_rate", "<=", 0.01),
            Target("greedy/random/cut_off_rate", "<=", 0.01),
            Target("greedy/greedy/cut_off_rate", "<=", 0.01),
            Target("train_wall_s", "<=", 30 * MIN),
        ),
    ),
    "sokoban": Environment(  # issue #57
        config="configs/sokoban_tiny_solve.py",
        evals=("greedy:--suites=heldout",),
        headlines=("greedy/heldout/solved_rate", "greedy/heldout/dead_rate", "greedy/heldout/stuck_rate"),
        targets=(
            Target("greedy/heldout/solved_rate", ">=", 0.81),
            Target("greedy/heldout/solved_rate", ">=", 0.15, gain=True),
            Target("train_wall_s", "<=", 30 * MIN),
        ),
    ),
}


def sweep_command(env: Environment, seeds: str, root: str) -> list[str]:
    cmd = [
        sys.executable,
        os.path.join(HERE, "seed_sweep.py"),
        f"--config={env.config}",
        f"--seeds={seeds}",
        f"--root={root}",
        f"--headline={','.join(env.headlines)}",
    ]
    return cmd + [f"--eval={spec}" for spec in env.evals] + list(env.overrides)


def summarize(env: Environment, sweep: dict) -> dict:
    """One environment's entry of the JSON line from its seed sweep's figures."""
    rows = sweep["per_seed"]
    per_seed = [
        {
            "seed": r["seed"],
            "train_wall_s": r["train_wall_s"],
            "warm_start": {h: r.get(f"warm_start/{h}") for h in env.headlines},
            "rl": {h: r.get(h) for h in env.headlines},
        }
        for r in rows
    ]
    targets = [t.check(rows) for t in env.targets]
    return {
        "config": sweep.get("config", env.config),
        "overrides": sweep.get("overrides", []),
        "per_seed": per_seed,
        "targets": targets,
        "met": all(t["met"] for t in targets),
    }


def table(results: dict) -> str:
    lines = ["| environment | seed | warm start -> after RL | training |", "| --- | --- | --- | --- |"]
    for name, res in results.items():
        for s in res["per_seed"]:
            pairs = "; ".join(f"{h.split('/', 1)[1]} {_fmt(s['warm_start'][h])} -> {_fmt(s['rl'][h])}" for h in s["rl"])
            lines.append(f"| {name} | {s['seed']} | {pairs} | {s['train_wall_s'] / MIN:.1f} min |")
    lines += ["", "| environment | target | measured | holds |", "| --- | --- | --- | --- |"]
    for name, res in results.items():
        for t in res["targets"]:
            measured = t["measured"]
            shown = " / ".join(_fmt(v) for v in measured) if isinstance(measured, list) else _fmt(measured)
            lines.append(
                f"| {name} | {t['figure']}{' gain' if t['gain'] else ''} {t['op']} {t['value']:g} ({t['over']}) | "
                f"{shown} | "
                f"{'yes' if t['met'] else 'no'} |"
            )
    return "\n".join(lines)


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def run_sweep(name: str, cmd: list[str], log_path: str) -> None:
    """Runs one seed sweep, its progress lines shown as they come and kept in `log_path`."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    lines = []
    with (
        open(log_path, "w") as log,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        for line in proc.stdout:
            log.write(line)
            lines.append(line.rstrip())
            if not line.startswith("{"):  # the sweep's own JSON line stays in the log
                print("   " + line.rstrip(), flush=True)
    if proc.returncode:
        raise SystemExit(
            f"the {name} sweep failed (exit {proc.returncode}); log {log_path}:\n" + "\n".join(lines[-10:])
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="parent of the per-environment sweep roots")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {sorted(ENVIRONMENTS)}")
    parser.add_argument(
        "--collect", action="store_true", help="do not train: read ROOT/<environment>/sweep.json of finished sweeps"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(ENVIRONMENTS)
    unknown = [n for n in names if n not in ENVIRONMENTS]
    if unknown:
        parser.error(f"unknown environment(s) {unknown}; choose from {sorted(ENVIRONMENTS)}")
    results = {}
    for name in names:
        env, root = ENVIRONMENTS[name], os.path.join(args.root, name)
        path = os.path.join(root, SWEEP_FILE)
        if not args.collect:
            run_sweep(name, sweep_command(env, args.seeds, root), os.path.join(args.root, f"{name}.log"))
        if not os.path.exists(path):
            raise SystemExit(f"{path} does not exist: run the {name} sweep first (without --collect)")
        with open(path) as f:
            results[name] = summarize(env, json.load(f))
        print(
            f"   {name}: targets {'met' if results[name]['met'] else 'not met'} (curves: "
            f"{os.path.join(root, 'seed_sweep.png')})",
            flush=True,
        )
    print("\n" + table(results))
    print(json.dumps({"environments": results, "all_met": all(r["met"] for r in results.values())}))


if __name__ == "__main__":
    main()
