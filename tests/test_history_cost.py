"""benchmarks/history_cost.py at a tiny size: its JSON figures, and a turn sample's size does not grow with T."""

import json

from benchmarks import history_cost


def test_history_cost_tiny(capsys):
    out = history_cost.main(
        ["--turns", "2,4", "--histories", "full,0", "--groups", "1", "--group_size", "2"]
        + ["--layers", "2", "--repeats", "1", "--rooms", "8"]
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the script's last line: one JSON object
    assert line.keys() == out.keys() and out["turns"] == [2, 4]
    full, window = out["results"]["full"], out["results"]["k0"]
    assert full["2"]["rows"] == full["4"]["rows"] == 2 and full["4"]["row_length"] > full["2"]["row_length"]
    assert window["2"]["rows"] == 4 and window["4"]["rows"] == 8  # B * T turn samples
    assert window["2"]["row_length"] == window["4"]["row_length"]  # the same turn sample at every T
    assert out["growth"]["k0"]["tokens_per_episode"] == 2.0  # T turn samples of the same prompt and call
    assert out["shared_prefix"] and window["2"]["shared_prefix_tokens"] > 0  # the system prompt, encoded once
    for rows in out["results"].values():
        for row in rows.values():
            assert row["rollout_s"] > 0 and row["train_step_s"] > 0 and row["rollout_bytes"] > 0
