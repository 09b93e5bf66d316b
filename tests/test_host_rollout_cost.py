"""benchmarks/host_rollout_cost.py at a tiny size: its JSON figures, and the three columns play the same episodes."""

import json

from benchmarks import host_rollout_cost


def test_host_rollout_cost_tiny(capsys):
    out = host_rollout_cost.main(
        ["--groups", "1", "--group_size", "2", "--max_turns", "3", "--repeats", "1", "--layers", "2"]
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the script's last line: one JSON object
    assert line.keys() == out.keys()
    assert out["same_tokens"]  # jitted, host and resend trajectories equal in tokens, masks and rewards
    assert out["batch"] == 2 and out["max_turns"] == 3 and out["generated_tokens"] > 0
    assert 2 <= out["turns_played"] <= 2 * 3
    for name in host_rollout_cost.COLUMNS:
        for kind in ("rollout", "step"):
            t = out[f"{name}_{kind}_s"]
            assert 0 < t["min"] <= t["median"] <= t["max"]
        assert out[f"{name}_step_s"]["median"] > out[f"{name}_rollout_s"]["median"] * 0.5
        assert out[f"{name}_tokens_per_s"] > 0
    for name in ("host", "resend"):
        assert out[f"{name}_rollout_ratio"] > 0 and out[f"{name}_step_ratio"] > 0
        assert out["logp_max_abs_diff"][name] < 1e-4
    assert isinstance(out["host_rollout_within_2x"], bool) and isinstance(out["host_step_within_1.3x"], bool)
