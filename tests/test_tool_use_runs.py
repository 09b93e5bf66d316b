"""The tool-use runs script's bookkeeping: finished runs read back, unfinished workdirs refused, figures and plot."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import tool_use_runs  # noqa: E402


def _finished(root, arm: str, seed: int, accuracy: float, rate: float) -> None:
    workdir = root / arm / f"seed{seed}"
    os.makedirs(workdir)
    rows = [{"step": s, "rollout/correct": accuracy * s / 4, "rollout/used_tool": rate} for s in range(1, 5)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = {"arm": arm, "seed": seed, "accuracy": accuracy, "tool_call_rate": rate, "minutes": 1.5}
    (workdir / tool_use_runs.RESULT).write_text(json.dumps(result))


def test_collects_finished_runs_into_one_json_line_and_a_plot(tmp_path, capsys):
    _finished(tmp_path, "task", 0, 0.9, 1.0)
    _finished(tmp_path, "control", 0, 0.1, 0.0)
    tool_use_runs.main([f"--root={tmp_path}", "--seeds=0", "--arms="])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["arm"], r["accuracy"]) for r in figures["runs"]] == [("task", 0.9), ("control", 0.1)]
    assert figures["summary"]["task/tool_call_rate"]["mean"] == 1.0
    assert os.path.getsize(tmp_path / "tool_use.png") > 0


def test_refuses_an_unfinished_workdir_and_other_flags(tmp_path, capsys):
    os.makedirs(tmp_path / "task" / "seed0")
    with pytest.raises(SystemExit, match="unfinished run"):
        tool_use_runs.main([f"--root={tmp_path}", "--seeds=0", "--control_seeds="])
    with pytest.raises(SystemExit):
        tool_use_runs.main([f"--root={tmp_path}", "--num_steps=3"])
    assert "only --config.* overrides" in capsys.readouterr().err


def test_tool_rate_prefers_used_tool():
    assert tool_use_runs.tool_rate({"heldout/used_tool": 0.5, "heldout/tool_calls": 2.0}, "heldout/") == 0.5
    assert tool_use_runs.tool_rate({"heldout/tool_calls": 0.25}, "heldout/") == 0.25
    assert tool_use_runs.tool_rate({}, "heldout/") is None
    two_hop = {"heldout/second_lookup": 0.75, "heldout/lookups": 1.75}
    assert tool_use_runs.tool_rate(two_hop, "heldout/", "second_lookup") == 0.75
