"""The training and evaluation CLIs run as subprocesses, as the benchmark scripts that sweep seeds run them: one run
with its log kept, its metrics log read back, the JSON line of figures a CLI ends with."""

from __future__ import annotations

import json
import shlex
import subprocess
import time


def read_metrics(path: str) -> list[dict]:
    """The rows of a run's metrics.jsonl (exits naming the file if it holds none)."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    if not rows:
        raise SystemExit(f"{path}: no training steps were logged")
    return rows


def last_json_line(text: str) -> dict:
    """The last line of `text` that is a JSON object (the figures a CLI or benchmark ends with)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def run(cmd: list[str], log_path: str) -> tuple[str, float]:
    """Runs `cmd`, tees its output into `log_path`, returns (stdout+stderr, wall seconds); exits on failure."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log.write(proc.stdout)
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise SystemExit(f"{shlex.join(cmd)} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    return proc.stdout, wall
