"""The seed-sweep script's bookkeeping: curve figures, evaluation output parsing, refusing reused workdirs."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import seed_sweep  # noqa: E402


def test_curve_figures_first_and_last_windows():
    rows = [{"step": i + 1, seed_sweep.REWARD: float(i), seed_sweep.VALID: 0.5 if i < 30 else 1.0} for i in range(40)]
    figures = seed_sweep.curve_figures(rows)
    assert figures == {"steps": 40, "first5_reward": 2.0, "last20_reward": 29.5, "last20_valid": 0.75}


def test_last_json_line_skips_logs_and_progress_bars():
    text = "I1201 log line\n{not json\nwarm start: 100%|###|\n" + json.dumps({"optimal_move_rate": 0.9}) + "\n\n"
    assert seed_sweep.last_json_line(text) == {"optimal_move_rate": 0.9}
    with pytest.raises(ValueError):
        seed_sweep.last_json_line("no figures here\n")


def test_parse_evals():
    assert seed_sweep.parse_evals(["greedy:", "games:--suites=minimax,random --num_episodes=8"]) == [
        ("greedy", []),
        ("games", ["--suites=minimax,random", "--num_episodes=8"]),
    ]
    with pytest.raises(SystemExit, match="NAME:FLAGS"):
        seed_sweep.parse_evals(["--suites=minimax"])


def test_eval_figures_keep_each_suites_numbers():
    # experiments.evaluate's last line: the checkpoint, the environment, the decoding, then <suite>/<figure>.
    line = {
        "checkpoint_step": 200,
        "env": "tictactoe",
        "greedy": True,
        "positions/optimal_move_rate": 0.9,
        "positions/num_episodes": 2423,
        "minimax/x/win_rate": 0.0,
    }
    assert seed_sweep.eval_figures("greedy", line) == {
        "greedy/positions/optimal_move_rate": 0.9,
        "greedy/positions/num_episodes": 2423,
        "greedy/minimax/x/win_rate": 0.0,
    }


def test_refuses_a_root_that_already_holds_a_seed(tmp_path, capsys):
    os.makedirs(tmp_path / "seed1")
    with pytest.raises(SystemExit):
        seed_sweep.main([f"--root={tmp_path}", "--seeds=0,1"])
    assert "already holds seed1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        seed_sweep.main([f"--root={tmp_path}", "--seeds=0", "--num_steps=3"])
    assert "only --config.* overrides" in capsys.readouterr().err


def test_warm_start_comparison_headlines_curve_and_plot(tmp_path):
    rows = [
        {
            "seed": s,
            "greedy/secrets/found_rate": 0.9 + s / 100,
            "greedy/secrets/guesses_mean": 3.5,
            "greedy/eval_wall_s": 3.0,
            "warm_start/greedy/secrets/found_rate": 0.2,
            "warm_start/greedy/secrets/guesses_mean": 4.5,
        }
        for s in (0, 1)
    ]
    assert seed_sweep.default_headlines(rows[0]) == ["greedy/secrets/found_rate"]
    metrics = [{"step": i, seed_sweep.REWARD: i / 10} for i in range(1, 31)]
    for m in metrics[9::10]:
        m["eval/secrets/found_rate"] = m["step"] / 30
    assert seed_sweep.eval_curve(metrics, "greedy/secrets/found_rate") == ([10, 20, 30], [1 / 3, 2 / 3, 1.0])
    assert seed_sweep.eval_curve(metrics, "greedy/secrets/guesses_mean") == ([], [])
    path = tmp_path / "sweep.png"
    seed_sweep.plot(
        {0: metrics, 1: metrics},
        str(path),
        "two seeds",
        rows,
        ["greedy/secrets/found_rate", "greedy/secrets/guesses_mean", "greedy/absent/x_rate"],
    )
    assert path.stat().st_size > 10_000
    seed_sweep.plot({0: metrics}, str(tmp_path / "plain.png"), "no evaluations")  # the reward panel alone
