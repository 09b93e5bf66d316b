"""The seed-sweep script's bookkeeping: curve figures, evaluation output parsing, refusing reused workdirs."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import seed_sweep  # noqa: E402


def test_curve_figures_first_and_last_windows():
    rows = [{"step": i + 1, seed_sweep.REWARD: float(i), seed_sweep.VALID: 0.5 if i < 30 else 1.0}
            for i in range(40)]
    figures = seed_sweep.curve_figures(rows)
    assert figures == {"steps": 40, "first5_reward": 2.0, "last20_reward": 29.5, "last20_valid": 0.75}


def test_last_json_line_skips_logs_and_progress_bars():
    text = "I1201 log line\n{not json\nwarm start: 100%|###|\n" + json.dumps({"optimal_move_rate": 0.9}) + "\n\n"
    assert seed_sweep.last_json_line(text) == {"optimal_move_rate": 0.9}
    with pytest.raises(ValueError):
        seed_sweep.last_json_line("no figures here\n")


def test_parse_evals():
    assert seed_sweep.parse_evals(["greedy:", "games:--suites=minimax,random --num_episodes=8"]) == [
        ("greedy", []), ("games", ["--suites=minimax,random", "--num_episodes=8"])]
    with pytest.raises(SystemExit, match="NAME:FLAGS"):
        seed_sweep.parse_evals(["--suites=minimax"])


def test_eval_figures_keep_each_suites_numbers():
    # experiments.evaluate's last line: the checkpoint, the environment, the decoding, then <suite>/<figure>.
    line = {"checkpoint_step": 200, "env": "tictactoe", "greedy": True, "positions/optimal_move_rate": 0.9,
            "positions/num_episodes": 2423, "minimax/x/win_rate": 0.0}
    assert seed_sweep.eval_figures("greedy", line) == {"greedy/positions/optimal_move_rate": 0.9,
                                                       "greedy/positions/num_episodes": 2423,
                                                       "greedy/minimax/x/win_rate": 0.0}


def test_refuses_a_root_that_already_holds_a_seed(tmp_path, capsys):
    os.makedirs(tmp_path / "seed1")
    with pytest.raises(SystemExit):
        seed_sweep.main([f"--root={tmp_path}", "--seeds=0,1"])
    assert "already holds seed1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        seed_sweep.main([f"--root={tmp_path}", "--seeds=0", "--num_steps=3"])
    assert "only --config.* overrides" in capsys.readouterr().err
