"""benchmarks/credit_comparison.py at a tiny size (slow tier): both credits, one seed, two steps each (the second
from the first's warm start), the curves, the PNG and the JSON."""

import json
import os

from benchmarks import credit_comparison


def test_credit_comparison_tiny(tmp_path, capsys):
    root = str(tmp_path / "credit")
    out = credit_comparison.main(
        [f"--root={root}", "--seeds=0", "--eval_every=1", "--config.num_steps=2", "--config.sft.num_steps=2"]
        + ["--config.sft.compare_episodes=0", "--config.env.num_heldout_rooms=8", "--config.rollout.max_turns=4"]
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads(json.dumps(out))
    assert [r["credit"] for r in out["runs"]] == ["trajectory", "step"]
    for run in out["runs"]:
        assert run["steps"] == [1, 2] and all(0.0 <= v <= 1.0 for v in run["solved_rate"])
        assert 0.0 <= run["warm_start"] <= 1.0
    # The step run starts from a copy of the trajectory run's warm start: the same weights, so the same figure.
    first, second = out["runs"]
    assert first["warm_start_from"] is None and second["warm_start_from"] == os.path.join(root, "trajectory_s0")
    assert first["warm_start"] == second["warm_start"]
    assert len(first["sampled_solved_rate"]) == 2
    assert os.path.getsize(out["png"]) > 0
