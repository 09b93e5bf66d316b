"""reno_jax.envs.tictactoe.registration: the registry entry (env from the config's `env` section, the step's starts,
the warm-start teacher) and the evaluation suites (sizes, defaults per task, shaping off, per-side game figures)."""

import jax
import numpy as np
import pytest

from configs import tictactoe_tiny, tictactoe_tiny_game
from reno_jax.envs import interface, registry
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs.tictactoe import registration, tasks, wording


def test_entry_is_registered_under_its_name():
    assert registry.get("tictactoe") is registration.ENTRY
    assert registry.entry_for(tictactoe_tiny.get_config().env) is registration.ENTRY


def test_make_env_reads_the_env_section_and_overrides():
    c = tictactoe_tiny.get_config()
    c.env.suboptimal_penalty, c.env.board_style = 0.5, "labeled"
    env = registration.make_env(c.env)
    assert (env.task, env.board_style, env.suboptimal_penalty) == ("move", "labeled", 0.5)
    game = registration.make_env(c.env, task="game", suboptimal_penalty=0.0)
    assert (game.task, game.suboptimal_penalty, game.board_style) == ("game", 0.0, "labeled")
    c.env.heldout_fraction = 1.0
    with pytest.raises(ValueError, match=r"env\.heldout_fraction must be a fraction in \[0, 1\), got 1\.0"):
        registration.make_env(c.env)
    c = tictactoe_tiny.get_config()
    c.env.boards_path = "/no/such/boards.jsonl"
    with pytest.raises(ValueError, match="env.boards_path=/no/such/boards.jsonl does not exist"):
        registration.make_env(c.env)


def test_move_sampler_draws_training_boards():
    c = tictactoe_tiny.get_config()
    c.env.num_boards = 40
    train, _ = boards_lib.load_boards(c.env)
    starts = registration.make_sampler(c)(jax.random.PRNGKey(0), 8)
    rows = {b.tobytes() for b in np.asarray(train, np.int8)}
    assert np.asarray(starts.boards).shape == (8, 9)
    assert all(np.asarray(b, np.int8).tobytes() in rows for b in np.asarray(starts.boards))


def test_teacher_calls_are_the_nine_squares():
    teacher = registration.make_teacher(None, None)
    assert isinstance(teacher, interface.Teacher)
    assert teacher.calls == tuple((wording.TOOL_NAME, {"square": k}) for k in range(1, 10))
    assert teacher.policy is registration.random_legal_square


def test_eval_suites_sizes_and_defaults():
    move = registration.eval_suites(tictactoe_tiny.get_config())
    assert {name: s.num_episodes for name, s in move.items() if name.startswith("positions")} == {
        "positions": 2423,
        "positions_o": 2097,
        "positions_both": 2423 + 2097,
    }
    assert [name for name, s in move.items() if s.default] == ["positions"]
    assert "heldout" not in move  # heldout_fraction 0
    for suite in move.values():  # evaluation measures outcomes, not the training-only shaping
        assert suite.env_overrides["suboptimal_penalty"] == 0.0 and suite.env_overrides["win_seeking"] is False
    assert not move["positions"].scalable and move["minimax"].scalable
    game = registration.eval_suites(tictactoe_tiny_game.get_config())
    assert sorted(name for name, s in game.items() if s.default) == ["minimax", "random"]
    c = tictactoe_tiny.get_config()
    c.env.num_boards, c.env.heldout_fraction = 200, 0.25
    held = registration.eval_suites(c)
    _, heldout = boards_lib.load_boards(c.env)
    assert held["heldout"].num_episodes == len(heldout) > 0 and held["heldout"].default


def test_positions_suite_starts_and_win_taken_among_boards_with_a_win():
    suite = registration.eval_suites(tictactoe_tiny.get_config())["positions"]
    ids = np.arange(10)
    a, b = suite.starts(jax.random.PRNGKey(0), ids), suite.starts(jax.random.PRNGKey(1), ids)
    np.testing.assert_array_equal(np.asarray(a.boards), np.asarray(b.boards))  # a fixed set: the key is unused
    np.testing.assert_array_equal(np.asarray(a.boards), boards_lib.exhaustive_positions("x")[:10])
    ids = np.arange(suite.num_episodes)
    available = registration._win_available(boards_lib.exhaustive_positions("x"))
    info = {"win_taken": available.copy()}  # every available win taken
    assert suite.extra(info, ids)["win_taken_rate"] == 1.0
    info["win_taken"][np.flatnonzero(available)[: int(available.sum()) // 2]] = False
    assert suite.extra(info, ids)["win_taken_rate"] == pytest.approx(0.5, abs=1 / available.sum())


def test_game_suite_alternates_sides_and_reports_each():
    suite = registration.eval_suites(tictactoe_tiny_game.get_config())["epsilon"]
    ids = np.arange(6)
    starts = suite.starts(jax.random.PRNGKey(0), ids)
    assert np.asarray(starts.agent_player).tolist() == [1, 2, 1, 2, 1, 2]
    assert set(np.asarray(starts.opponent_kind).tolist()) == {tasks.OPPONENT_EPSILON}
    again = suite.starts(jax.random.PRNGKey(0), ids)
    np.testing.assert_array_equal(np.asarray(starts.opponent_key), np.asarray(again.opponent_key))
    info = {
        "win": np.array([1, 0, 1, 0, 0, 0], bool),
        "draw": np.array([0, 1, 0, 0, 1, 0], bool),
        "loss": np.array([0, 0, 0, 1, 0, 1], bool),
    }
    out = suite.extra(info, ids)
    assert out["x/win_rate"] == pytest.approx(2 / 3) and out["o/win_rate"] == 0.0
    assert out["o/loss_rate"] == pytest.approx(2 / 3) and out["x/draw_rate"] == pytest.approx(1 / 3)
    assert out["epsilon"] == tictactoe_tiny_game.get_config().env.opponent_epsilon
