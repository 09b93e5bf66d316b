"""The all-environments sweep: targets checked per seed or on the mean, the JSON line read back from finished
sweeps (`--collect`), and its errors."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import environments_sweep as es  # noqa: E402


def _rows(values, key="greedy/positions/optimal_move_rate", **extra):
    return [
        {"seed": i, "train_wall_s": 400.0 + i, key: v, f"warm_start/{key}": v / 2, **extra}
        for i, v in enumerate(values)
    ]


def test_a_mean_target_can_hold_where_one_seed_falls_short():
    rows = _rows([0.95, 0.88, 0.91])
    mean = es.Target("greedy/positions/optimal_move_rate", ">=", 0.90, over="mean").check(rows)
    each = es.Target("greedy/positions/optimal_move_rate", ">=", 0.90).check(rows)
    assert mean["met"] and mean["measured"] == pytest.approx(0.9133333)
    assert not each["met"] and each["measured"] == [0.95, 0.88, 0.91]


def test_an_upper_bound_and_a_sum_of_figures():
    rows = [{"a": 0.004, "b": 0.005}, {"a": 0.0, "b": 0.011}]
    summed = es.Target("a+b", "<=", 0.01).check(rows)
    assert summed["measured"] == pytest.approx([0.009, 0.011]) and not summed["met"]
    assert es.Target("a", "<=", 0.01).check(rows)["met"]


def test_a_gain_target_reads_the_warm_start_beside_the_figure():
    rows = _rows([0.82, 0.60], key="greedy/heldout/solved_rate")  # warm starts: half of each
    gain = es.Target("greedy/heldout/solved_rate", ">=", 0.15, gain=True).check(rows)
    assert gain["measured"] == pytest.approx([0.41, 0.30]) and gain["met"] and gain["gain"]
    assert not es.Target("greedy/heldout/solved_rate", ">=", 0.35, gain=True).check(rows)["met"]
    with pytest.raises(KeyError, match="warm_start/a"):
        es.Target("a", ">=", 0.1, gain=True).check([{"a": 1.0}])


def test_bad_targets_and_missing_figures_are_named():
    with pytest.raises(ValueError, match="op"):
        es.Target("a", ">", 1.0)
    with pytest.raises(ValueError, match="over"):
        es.Target("a", ">=", 1.0, over="median")
    with pytest.raises(KeyError, match="greedy/secrets/found_rate"):
        es.Target("greedy/secrets/found_rate", ">=", 0.98).check([{"train_wall_s": 1.0}])


def test_every_environment_names_an_existing_config_and_its_headlines_are_targets_or_figures():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, env in es.ENVIRONMENTS.items():
        assert os.path.exists(os.path.join(repo, env.config)), name
        assert env.targets and all(h.startswith("greedy/") for h in env.headlines), name
        cmd = es.sweep_command(env, "0,1", "/tmp/r")
        assert f"--config={env.config}" in cmd and "--seeds=0,1" in cmd and "--root=/tmp/r" in cmd


def test_collect_reads_finished_sweeps_and_ends_with_one_json_line(tmp_path, capsys):
    env = es.ENVIRONMENTS["tictactoe"]
    (tmp_path / "tictactoe").mkdir()
    rows = _rows([0.94, 0.90, 0.92], **{"greedy/positions/illegal_rate": 0.001})
    rows[1]["train_wall_s"] = 9 * 60.0  # over the 8-minute target
    (tmp_path / "tictactoe" / es.SWEEP_FILE).write_text(json.dumps({"config": env.config, "per_seed": rows}))
    es.main([f"--root={tmp_path}", "--collect", "--only=tictactoe"])
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    ttt = line["environments"]["tictactoe"]
    assert [s["seed"] for s in ttt["per_seed"]] == [0, 1, 2]
    assert ttt["per_seed"][0]["warm_start"]["greedy/positions/optimal_move_rate"] == pytest.approx(0.47)
    assert ttt["per_seed"][0]["rl"]["greedy/positions/optimal_move_rate"] == pytest.approx(0.94)
    by_figure = {t["figure"]: t for t in ttt["targets"]}
    assert by_figure["greedy/positions/optimal_move_rate"]["met"]
    assert not by_figure["train_wall_s"]["met"] and not ttt["met"] and not line["all_met"]
    assert any("| tictactoe | train_wall_s <= 480 (each) |" in row for row in out)


def test_collect_without_a_finished_sweep_and_unknown_environments_fail_clearly(tmp_path):
    with pytest.raises(SystemExit, match="sweep.json does not exist"):
        es.main([f"--root={tmp_path}", "--collect", "--only=guess_number"])
    with pytest.raises(SystemExit):
        es.main([f"--root={tmp_path}", "--collect", "--only=chess"])
