"""The play page (`experiments/play.py`, `reno_jax/play`), generic over environments: the board views' host rules
(tic-tac-toe, Connect Four), the heat map, the JSON API for both games and for a board-less environment
(guess-the-number: transcripts), an environment of the user's own package, every bad input, and a real headless
Chromium that plays a tic-tac-toe game and a Connect Four game.

One tiny run is trained per environment and module (a short warm start + GSPO steps, a checkpoint every step): the
tic-tac-toe run has checkpoints 0 (the warm start), 1 and 2; the Connect Four and guess-the-number runs 0 and 1.
"""

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import connect4_tiny, guess_number_tiny, tictactoe_tiny
from reno_jax import loop
from reno_jax.envs import interface, registry
from reno_jax.envs.connect4 import env as c4_env
from reno_jax.envs.tictactoe import board_view as ttt_view
from reno_jax.errors import RunError
from reno_jax.loop import runs
from reno_jax.models import ling3
from reno_jax.play import run_dir as run_dir_lib
from reno_jax.play import service as service_lib
from reno_jax.protocol import chat, toolcall

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOARD = "xx.o.o..."  # X to move: square 3 wins at once, 5 keeps the win too (minimax-optimal: 3 and 5)
C4_EMPTY = "." * 42
C4_BOARD = "." * 35 + "..xo..."  # X to move


def _c4(rows_from_bottom: list[str]) -> str:
    """A Connect Four board string from its bottom rows (7 characters each), the rest empty."""
    rows = ["......."] * (6 - len(rows_from_bottom)) + list(reversed(rows_from_bottom))
    return "".join(rows)


def tiny_config():
    """The tic-tac-toe run: tests/test_experiments.py's short config with a longer warm start (enough for mostly
    well-formed calls)."""
    c = tictactoe_tiny.get_config()
    c.num_steps = 2
    c.model.tiny.num_hidden_layers = 2
    c.sft.num_steps = 20
    c.sft.batch_size = 8
    c.sft.compare_episodes = 0  # the student-teacher comparison (~11 CPU-s a run): tests/test_own_environment.py
    c.sft.learning_rate = 1e-2
    c.rollout.boards_per_step = 4
    c.rollout.group_size = 4
    c.rl.train_groups = 2
    c.checkpoint_every = 1
    c.keep_checkpoints = 5
    c.plot_every = 0
    c.rl.max_logp_shift = 0.0  # the update guard (tests/test_trainer.py) is compile time the page does not need
    return c


def c4_config():
    """A Connect Four run that trains the model as O (the page then lets the person open)."""
    c = connect4_tiny.get_config()
    c.num_steps = 1
    c.model.tiny.num_hidden_layers = 2
    c.env = ml_collections.ConfigDict({**c.env.to_dict(), "agent_player": 2})  # the field is typed str
    c.sft.num_steps = 30  # enough for well-formed calls, so the browser's game goes on for a few moves
    c.sft.batch_size = 4
    c.sft.compare_episodes = 0  # the student-teacher comparison (~11 CPU-s a run): tests/test_own_environment.py
    c.sft.learning_rate = 1e-2
    c.rollout.boards_per_step = 2
    c.rollout.group_size = 2
    c.rollout.max_turns = 2
    c.rollout.max_length = 0
    c.checkpoint_every = 1
    c.plot_every = 0
    return c


def guess_config():
    c = guess_number_tiny.get_config()
    c.num_steps = 1
    c.model.tiny.num_hidden_layers = 2
    c.sft.num_steps = 4
    c.sft.batch_size = 4
    c.sft.compare_episodes = 0  # the student-teacher comparison (~11 CPU-s a run): tests/test_own_environment.py
    c.rollout.boards_per_step = 2
    c.rollout.group_size = 2
    c.rollout.max_turns = 2
    c.checkpoint_every = 1
    c.plot_every = 0
    return c


def _client(service):
    from fastapi.testclient import TestClient

    from reno_jax.play import app as app_lib

    return TestClient(app_lib.create_app(service), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def run_path(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("play_run"))
    loop.train(tiny_config(), workdir)
    return workdir


@pytest.fixture(scope="module")
def service(run_path):
    return service_lib.PlayService(run_path)


@pytest.fixture(scope="module")
def client(service):
    return _client(service)


@pytest.fixture(scope="module")
def c4_service(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("play_c4"))
    loop.train(c4_config(), workdir)
    return service_lib.PlayService(workdir)


@pytest.fixture(scope="module")
def c4_client(c4_service):
    return _client(c4_service)


@pytest.fixture(scope="module")
def guess_client(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("play_guess"))
    loop.train(guess_config(), workdir)
    return _client(service_lib.PlayService(workdir))


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]
    return body["error"]


# ---------------------------------------------------------------------------------------------- board views


def _view(name, **env):
    return registry.get(name).board_view(ml_collections.ConfigDict({"env": env}))


def test_tictactoe_board_view_rules():
    view = _view("tictactoe", task="move", board_sides="x")
    assert (view.rows, view.cols, view.input, view.num_actions, view.sides) == (3, 3, "cell", 9, ("X", "O"))
    board = view.parse("X.o......")
    np.testing.assert_array_equal(board, [[1, 0, 2], [0, 0, 0], [0, 0, 0]])
    assert view.format(board) == "x.o......" and view.to_move(board) == 1
    assert view.status(view.parse("xxxoo....")) == "x_won" and view.status(view.parse("ooo.xx.x.")) == "o_won"
    assert view.status(view.parse("xoxxoxoxo")) == "draw" and view.result(board) == interface.ONGOING
    b = view.parse(BOARD)
    np.testing.assert_array_equal(view.legal(b), [0, 0, 1, 0, 1, 0, 1, 1, 1])
    assert view.format(view.apply(b, 2)) == "xxxo.o..." and view.format(b) == BOARD  # apply copies
    assert view.best_actions(b) == [2, 4] and view.label(2) == "3"
    assert not view.legal(view.parse("xxxoo....")).any()  # a finished game has no legal move
    refusals = {
        "xx": "9 characters",
        "xx.o.o..z": "'z'",
        12: "9 characters",
        "xxx......": "#X must be",
        "ooo......": "#X must be",
        "xxxooo...": "both X and O",
        "xxxoo.o..": "X has a line",
        "ooox.xx.x": "O has a line",
    }
    for text, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            view.parse(text)
    # The side the run trained on: the move task plays its boards' side to move, the game task its agent_player.
    assert view.trained_side == 1
    assert _view("tictactoe", task="move", board_sides="both").trained_side is None
    assert _view("tictactoe", task="game", agent_player="o").trained_side == 2
    assert _view("tictactoe", task="game", agent_player="alternate").trained_side is None


def test_connect4_board_view_rules():
    view = _view("connect4", agent_player="alternate")
    assert (view.rows, view.cols, view.input, view.num_actions, view.trained_side) == (6, 7, "column", 7, None)
    assert _view("connect4", agent_player=2).trained_side == 2
    board = view.parse(C4_BOARD)
    assert view.format(board) == C4_BOARD and view.to_move(board) == 1 and view.status(board) == "ongoing"
    after = view.apply(board, 2)
    assert view.format(after) == "." * 28 + "..x...." + "..xo..." and view.to_move(after) == 2
    full = view.parse(_c4(["xoxxxoo", "oxoooxo", "oxxxoox", "xxooxxo", "xoxooox", "ooxoxxx"]))
    assert view.status(full) == "draw" and not view.legal(full).any()
    column_full = view.parse(_c4(["xo.....", "ox.....", "xo.....", "ox.....", "xo.....", "ox....."]))
    np.testing.assert_array_equal(view.legal(column_full), [0, 0, 1, 1, 1, 1, 1])
    x_wins = view.parse(_c4(["xxxxooo"]))
    assert view.status(x_wins) == "x_won" and view.result(x_wins) == 1 and not view.legal(x_wins).any()
    assert view.status(view.parse(_c4(["xxx.ooo", "x...o.."]))) == "ongoing"
    # Best moves: an immediate win, else the block of the opponent's.
    assert view.best_actions(view.parse(_c4(["xxx.oo."]))) == [3]
    assert view.best_actions(view.parse(_c4(["ooo.xxx", "x......"]))) == [3]  # O to move wins at 4
    assert view.best_actions(view.parse(_c4(["xxx.oo.", "o......"]))) == [3]  # X to move wins at 4
    assert view.best_actions(board) == []
    refusals = {
        "x" * 41: "42 characters",
        "." * 41 + "z": "'z'",
        "x" + "." * 41: "floats",
        _c4(["xx....."]): "#X must be",
        _c4(["xxxx...", "oooo..."]): "both X and O",
        _c4(["xxxxooo", "o......"]): "moved last",
    }
    for text, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            view.parse(text)


def test_board_view_declarations_are_checked():
    base = dict(
        rows=3,
        cols=3,
        input="cell",
        chars=".xo",
        symbols=("", "X", "O"),
        colors=("", "a", "b"),
        sides=("X", "O"),
        to_move=ttt_view.to_move,
        legal=ttt_view.legal,
        apply=ttt_view.apply,
        result=ttt_view.result,
        decision_start=ttt_view.decision_start,
    )
    assert interface.BoardView(**base).num_actions == 9
    for change, message in (
        ({"input": "drag"}, "input"),
        ({"chars": ".x"}, "one entry per cell value"),
        ({"sides": ("X",)}, "sides"),
        ({"trained_side": 3}, "trained_side"),
        ({"action_labels": ("a",)}, "labels"),
    ):
        with pytest.raises(ValueError, match=message):
            interface.BoardView(**{**base, **change})
    with pytest.raises(ValueError, match="call_actions"):
        interface.BoardView(**base, call_actions=(0, 9)).actions_of_rows(2)
    with pytest.raises(TypeError, match="board_view must be callable"):
        registry.register("not_a_view", lambda c, **o: None, lambda c: None, board_view="grid")


def test_connect4_starts_at_a_position_for_one_move():
    """`position_starts` + `single_move`: the agent is the position's side to move, the opponent neither opens nor
    replies, and the episode ends after the move (training starts keep the empty board: `board` is None)."""
    assert c4_env.sample_starts(jax.random.PRNGKey(0), 2).board is None
    env = c4_env.Connect4Env(single_move=True)
    assert env.max_turns() == 1
    view = _view("connect4")
    boards = np.stack(
        [
            view.parse(_c4(rows))
            for rows in (
                ["...x..."],  # O to move
                ["xxx.oo.", "o......"],  # X to move, wins in column 4
                ["xo.....", "ox.....", "xo.....", "ox.....", "xo.....", "ox....."],
            )
        ]
    )  # X to move, column 1 full
    starts = c4_env.position_starts(boards)
    np.testing.assert_array_equal(starts.agent_player, [2, 1, 1])
    state, message = jax.vmap(env.reset)(starts)
    np.testing.assert_array_equal(state.game.board, boards)
    np.testing.assert_array_equal(state.agent_player, [2, 1, 1])
    text = chat.user_messages(env.chat(), jax.tree.map(lambda a: a[0], message))[1]["content"]
    assert text.startswith("You are O.\n") and "Opponent" not in text
    calls = interface.ToolCall(
        kind=jnp.zeros((3,), jnp.int32), tool=jnp.zeros((3,), jnp.int32), args=jnp.asarray([[4], [4], [1]], jnp.int32)
    )
    out = jax.vmap(env.step)(state, calls)
    np.testing.assert_array_equal(out.done, [True, True, True])
    np.testing.assert_array_equal(out.reward, [0.0, 1.0, -1.0])  # a quiet move, a win, a full column
    np.testing.assert_array_equal(
        out.info["outcome"], [c4_env.OUTCOME_ONGOING, c4_env.OUTCOME_WIN, c4_env.OUTCOME_ILLEGAL]
    )
    after = np.asarray(out.state.game.board[0])
    assert int((after != 0).sum()) == 2 and after[4, 3] == 2  # the agent's piece only: no reply
    reply = chat.tool_message(env.chat(), jax.tree.map(lambda a: a[0], out.message))["content"]
    assert "Opponent" not in reply and "...O" in reply


def test_tictactoe_move_task_answer_says_what_the_move_did():
    """The move task's last message (never rendered in training) is the game's answer to the move."""
    env = registry.get("tictactoe").make_env(ml_collections.ConfigDict({"task": "move"}))
    board = jnp.asarray([1, 1, 0, 2, 0, 2, 0, 0, 0], jnp.int8)
    state, _ = env.reset(jax.tree.map(lambda a: a[0], ttt_view.decision_start(np.asarray(board).reshape(3, 3))))
    for square, expected in ((3, "You won."), (1, "taken"), (0, "Invalid call"), (7, "X | X |")):
        kind = toolcall.KIND_OK if square else toolcall.KIND_NO_CALL
        step = env.step(
            state, interface.ToolCall(kind=jnp.int32(kind), tool=jnp.int32(0), args=jnp.asarray([square], jnp.int32))
        )
        assert expected in chat.tool_message(env.chat(), step.message)["content"], (square, expected)


# ---------------------------------------------------------------------------------------------- the model


def test_run_dir_lists_warm_start_and_checkpoints(run_path, service):
    assert service.run.steps() == [0, 1, 2]
    p0, p2 = service.run.restore_params(0), service.run.restore_params(2)
    assert jax.tree.structure(p0) == jax.tree.structure(p2)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p2)))
    with pytest.raises(run_dir_lib.CheckpointMissing):
        service.run.restore_params(5)


def _check_heat_map(svc, step, text):
    """mass * probs[a] == p(choice of action a | prompt, call prefix), scored independently: the rollout's prompt
    of the one-decision episode (its tokens as `render_user` writes them: Connect Four's board is tokenised cell by
    cell, not as the chat template's text would be) + each teacher call in full, unpadded, through
    `ling3.token_logprobs` (the training scorer)."""
    decisions = svc.decisions
    params = svc.run.restore_params(step)
    board = decisions.view.parse(text)
    heat = decisions.heat_map(params, board)
    assert len(heat["probs"]) == decisions.view.num_actions
    assert abs(sum(heat["probs"]) - 1) < 1e-5 and 0 < heat["mass"] <= 1
    env = decisions.env
    _, message = env.env.reset(jax.tree.map(lambda a: a[0], decisions.view.decision_start(board)))
    ids, n = env.render_user(message)
    prompt = [int(i) for i in np.asarray(ids)[: int(n)]]
    table = decisions.table
    calls = [list(row[:n]) for row, n in zip(np.asarray(table.ids), np.asarray(table.length))]
    tokens = jnp.asarray([prompt + call for call in calls], jnp.int32)
    logp = jax.jit(lambda p, t: ling3.token_logprobs(p, decisions.model_config, t))(params, tokens)
    choice_p = np.exp(np.asarray(logp)[:, len(prompt) + table.choice_offset])
    by_action = np.zeros(decisions.view.num_actions)
    np.add.at(by_action, decisions.row_actions, choice_p)
    np.testing.assert_allclose(by_action, heat["mass"] * np.asarray(heat["probs"]), rtol=2e-3, atol=1e-7)


def test_heat_map_is_the_models_distribution_over_the_teachers_calls(service):
    _check_heat_map(service, 2, BOARD)


def test_connect4_heat_map_is_the_models_distribution_over_the_teachers_calls(c4_service):
    _check_heat_map(c4_service, 1, C4_BOARD)


def test_zero_model_answers_with_an_invalid_call(service):
    """A model with all-zero weights emits no tool call: the parser's verdict is shown, not a crash."""
    params = jax.tree.map(jnp.zeros_like, service.run.restore_params(0))
    reply = service.decisions.reply(params, service.view.parse(BOARD))
    assert reply["verdict"] == "invalid" and reply["action"] is None and reply["parse"] != "ok"
    assert reply["reward"] == -1.0 and "Invalid call" in reply["tool_response"]


# ---------------------------------------------------------------------------------------------- API: tic-tac-toe


def test_api_policy_happy_path(client, service):
    for step in service.run.steps():
        out = client.get(f"/api/policy?board={BOARD}&step={step}").json()
        assert out["step"] == step and out["board"] == BOARD and out["side"] == "X"
        assert len(out["probs"]) == 9 and abs(sum(out["probs"]) - 1) < 1e-5 and 0 < out["mass"] <= 1
        assert out["best"] == [2, 4] and out["legal"] == [False, False, True, False, True, False, True, True, True]
        assert isinstance(out["text"], str) and out["verdict"] in ("legal", "illegal", "invalid")
        if out["verdict"] != "invalid":
            assert re.search(r'"square"\s*:\s*%d' % (out["action"] + 1), out["text"]), out["text"]
            assert out["label"] == str(out["action"] + 1)
        if out["verdict"] == "legal":
            assert out["board_after"][out["action"]] == "x"
    latest = client.get(f"/api/policy?board={BOARD}").json()
    assert latest["step"] == 2 and latest["greedy"] is True
    sampled = [client.get(f"/api/policy?board={BOARD}&sampled=true&seed=7").json() for _ in range(2)]
    assert sampled[0]["greedy"] is False and sampled[0]["text"] == sampled[1]["text"]  # a seed fixes the sample
    assert sampled[0]["probs"] == latest["probs"]  # the heat map does not depend on decoding


def test_api_run_metrics_and_page(client):
    run = client.get("/api/run").json()
    assert run["steps"] == [0, 1, 2] and run["default_step"] == 2 and run["env"] == "tictactoe"
    assert run["view"] == "board" and run["task"] == "move"
    board = run["board"]
    assert (board["rows"], board["cols"], board["input"], board["empty"]) == (3, 3, "cell", ".........")
    assert board["labels"] == [str(k) for k in range(1, 10)] and board["sides"] == ["X", "O"]
    # The default run trained on X-to-move boards: the model plays X (it opens), the person O.
    assert board["trained_side"] == 1 and board["model_side"] == 1 and board["first_side"] == 1
    assert run["training"] is False and run["last_metrics_step"] == 2 == run["num_steps"]
    metrics = client.get("/api/metrics").json()
    assert [r["step"] for r in metrics["rows"]] == [1, 2]
    assert metrics["default_keys"][:2] == ["rollout/rewards_mean", "rollout/tool_call_valid_rate"]
    assert {"rollout/optimal_move_rate", "rollout/illegal_rate"} <= set(metrics["default_keys"])  # plot=True
    assert "rollout/seeking_move_rate" in metrics["keys"] and "rollout/seeking_move_rate" not in metrics["default_keys"]
    assert [r["step"] for r in client.get("/api/metrics?since=1").json()["rows"]] == [2]
    page = client.get("/")
    assert page.status_code == 200 and 'id="heatmap"' in page.text and "http" not in page.text.split("<body>")[1]
    for name in ("play.js", "play.css"):
        assert client.get(f"/static/{name}").status_code == 200


def test_api_play_a_move_and_model_first(client):
    out = client.post("/api/play", json={"board": ".........", "action": 4, "step": 1}).json()
    assert out["after_person"] == "....x...." and out["model"]["side"] == "O" and out["model"]["step"] == 1
    assert out["person_label"] == "5" and out["status"] in ("ongoing", "model_illegal", "model_invalid")
    if out["status"] == "ongoing":
        assert out["board"].count("o") == 1 and out["board"][out["model"]["action"]] == "o"
    first = client.post("/api/play", json={"action": None}).json()  # no board: the empty one
    assert first["after_person"] == "........." and first["model"]["side"] == "X"
    # The person's winning move ends the game before the model is asked.
    won = client.post("/api/play", json={"board": "xx.oo....", "action": 2}).json()
    assert won == {
        "board": "xxxoo....",
        "after_person": "xxxoo....",
        "person_action": 2,
        "person_label": "3",
        "status": "x_won",
        "model": None,
    }


def test_api_refusals_are_clear_and_the_server_survives(client):
    assert "9 characters" in error_of(client.get("/api/policy?board=xx"), 400)
    assert "'z'" in error_of(client.get("/api/policy?board=xx.o.o..z"), 400)
    assert "impossible" in error_of(client.get("/api/policy?board=xxx......"), 400)
    assert "finished" in error_of(client.get("/api/policy?board=xxxoo...."), 409)
    assert "saved steps: [0, 1, 2]" in error_of(client.get(f"/api/policy?board={BOARD}&step=7"), 404)
    assert "step" in error_of(client.get(f"/api/policy?board={BOARD}&step=abc"), 400)
    assert "board" in error_of(client.get("/api/policy"), 400)
    assert "seed" in error_of(client.get(f"/api/policy?board={BOARD}&sampled=true&seed=-3"), 400)
    assert "cell 1 is not a legal move" in error_of(
        client.post("/api/play", json={"board": "x...o....", "action": 0}), 409
    )
    assert "0..8" in error_of(client.post("/api/play", json={"board": ".........", "action": 9}), 400)
    assert "game is over" in error_of(client.post("/api/play", json={"board": "xxxoo....", "action": 5}), 409)
    assert "impossible" in error_of(client.post("/api/play", json={"board": "oo.......", "action": 2}), 400)
    assert error_of(client.post("/api/play", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "no suite 'chess'" in error_of(client.get("/api/episode?suite=chess"), 404)
    assert "square" in error_of(client.post("/api/play", json={"board": ".........", "square": 5}), 400)
    assert client.get(f"/api/policy?board={BOARD}&step=1").status_code == 200  # still serving


def test_api_shows_a_refused_model_move(client, service, monkeypatch):
    refused = {
        "text": '<tool_call>{"name": "choose_square", "arguments": {"square": 5}}</tool_call>',
        "parse": "ok",
        "call": None,
        "action": 4,
        "label": "5",
        "verdict": "illegal",
        "board_after": "x...o....",
        "reward": -1.0,
        "tool_response": "That square is taken. You lost.",
        "greedy": True,
    }
    monkeypatch.setattr(service.decisions, "reply", lambda *a, **k: dict(refused))
    out = client.post("/api/play", json={"board": "x........", "action": 4}).json()
    assert out["status"] == "model_illegal" and out["board"] == "x...o...."
    assert out["model"]["verdict"] == "illegal" and "taken" in out["model"]["tool_response"]


# ---------------------------------------------------------------------------------------------- API: Connect Four


def test_api_connect4_board(c4_client):
    run = c4_client.get("/api/run").json()
    assert run["env"] == "connect4" and run["view"] == "board" and run["steps"] == [0, 1]
    board = run["board"]
    assert (board["rows"], board["cols"], board["input"], board["num_actions"]) == (6, 7, "column", 7)
    # This run trained the model as O: the person opens as X.
    assert board["trained_side"] == 2 and board["model_side"] == 2 and board["first_side"] == 1
    out = c4_client.get(f"/api/policy?board={C4_BOARD}").json()
    assert out["side"] == "X" and len(out["probs"]) == 7 and abs(sum(out["probs"]) - 1) < 1e-5
    assert out["verdict"] in ("legal", "illegal", "invalid")
    if out["verdict"] == "legal":  # the model's piece lands on the lowest empty cell of its column
        changed = [i for i, (a, b) in enumerate(zip(C4_BOARD, out["board_after"])) if a != b]
        assert len(changed) == 1 and changed[0] % 7 == out["action"] and out["board_after"][changed[0]] == "x"
        assert changed[0] + 7 >= 42 or C4_BOARD[changed[0] + 7] != "."
    played = c4_client.post("/api/play", json={"board": C4_EMPTY, "action": 3}).json()
    assert played["after_person"] == "." * 38 + "x..." and played["person_label"] == "4"
    assert played["model"]["side"] == "O" and played["status"] in ("ongoing", "model_illegal", "model_invalid")
    column_full = _c4(["xo.....", "ox.....", "xo.....", "ox.....", "xo.....", "ox....."])
    assert "column 1 is not a legal move" in error_of(
        c4_client.post("/api/play", json={"board": column_full, "action": 0}), 409
    )
    assert "floats" in error_of(c4_client.get("/api/policy?board=x" + "." * 41), 400)
    assert "42 characters" in error_of(c4_client.get("/api/policy?board=" + "." * 9), 400)
    assert "0..6" in error_of(c4_client.post("/api/play", json={"action": 7}), 400)
    metrics = c4_client.get("/api/metrics").json()
    assert metrics["default_keys"][:2] == ["rollout/rewards_mean", "rollout/tool_call_valid_rate"]
    assert {"rollout/win_rate", "rollout/loss_rate"} <= set(metrics["default_keys"])


# ---------------------------------------------------------------------------------------------- API: transcripts


def test_api_board_less_environment_shows_transcripts(guess_client):
    run = guess_client.get("/api/run").json()
    assert run["env"] == "guess_number" and run["view"] == "transcript" and run["board"] is None
    assert [s["name"] for s in run["suites"]] == ["sampler", "secrets"] and run["suites"][1]["num_episodes"] == 16
    out = guess_client.get("/api/episode?seed=3").json()
    roles = [m["role"] for m in out["messages"]]
    assert roles[:2] == ["system", "user"] and "I picked a number" in out["messages"][1]["content"]
    assert 1 <= out["num_turns"] <= 2 and roles[2:] == ["assistant", "tool"] * out["num_turns"]
    tools = [m for m in out["messages"] if m["role"] == "tool"]
    assert abs(sum(m["reward"] for m in tools) - out["reward"]) < 1e-6 or not tools[-1]["done"]
    assert {"found", "invalid", "num_turns"} <= set(out["info"]) and out["suite"] == "sampler"
    assert guess_client.get("/api/episode?seed=3").json()["messages"] == out["messages"]  # a seed fixes it
    suite = guess_client.get("/api/episode?suite=secrets&episode=6&step=0").json()
    assert suite["step"] == 0 and suite["episode"] == 6 and suite["suite"] == "secrets"
    assert "episode must be in 0..15" in error_of(guess_client.get("/api/episode?suite=secrets&episode=16"), 400)
    assert "declares no board view" in error_of(guess_client.get(f"/api/policy?board={BOARD}"), 404)
    assert "declares no board view" in error_of(guess_client.post("/api/play", json={"action": 1}), 404)
    metrics = guess_client.get("/api/metrics").json()
    assert metrics["default_keys"] == [
        k
        for k in ("rollout/rewards_mean", "rollout/tool_call_valid_rate", "rollout/found_rate", "rollout/guesses_mean")
        if k in metrics["keys"]
    ]


# ---------------------------------------------------------------------------------------------- the user's own


def test_an_environment_of_the_users_package_gets_its_board_with_no_edit(run_path, tmp_path, monkeypatch):
    """A module of the user's (env.module) registers an environment with its own board view: the page draws its
    geometry, symbols and labels and plays through it (here tic-tac-toe's env, named and drawn differently)."""
    package = tmp_path / "my_games"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "letters.py").write_text("""
import dataclasses
from reno_jax.envs import registry
from reno_jax.envs.tictactoe import board_view, registration

def view(config):
    return dataclasses.replace(board_view.board_view(config), chars=".ab", symbols=("", "A", "B"),
                               sides=("A", "B"), action_labels=tuple("abcdefghi"), trained_side=None)

registry.register("letters", registration.make_env, registration.make_sampler, registration.make_teacher,
                  board_view=view)
""")
    monkeypatch.syspath_prepend(str(tmp_path))
    workdir = tmp_path / "run"
    workdir.mkdir()
    config = json.load(open(os.path.join(run_path, "config.json")))
    config["env"].update(name="letters", module="my_games.letters")
    (workdir / "config.json").write_text(json.dumps(config))
    shutil.copytree(os.path.join(run_path, "warmstart"), workdir / "warmstart")
    client = _client(service_lib.PlayService(str(workdir)))
    board = client.get("/api/run").json()["board"]
    assert board["sides"] == ["A", "B"] and board["labels"][:3] == ["a", "b", "c"] and board["model_side"] == 2
    out = client.post("/api/play", json={"board": ".........", "action": 4}).json()
    assert out["after_person"] == "....a...." and out["person_label"] == "e" and out["model"]["side"] == "B"
    assert len(out["model"]["probs"]) == 9 and set(out["board"]) <= set(".ab")


def test_the_page_imports_no_game():
    """`reno_jax/play` and `experiments/play.py` name no environment: everything game-specific is declared by
    the environment (`BoardView`, `PuzzleView`)."""
    files = glob.glob(os.path.join(REPO, "reno_jax", "play", "**", "*.*"), recursive=True)
    files.append(os.path.join(REPO, "experiments", "play.py"))
    pattern = re.compile(
        r"tictactoe|tic-tac-toe|connect ?4|connect four|guess_number|guess the number|"
        r"choose_square|drop_piece|minimax|sokoban",
        re.IGNORECASE,
    )
    for path in files:
        if os.path.isfile(path) and not path.endswith(".pyc"):
            found = pattern.search(open(path, encoding="utf-8").read())
            assert found is None, f"{path} names a game: {found.group(0)!r}"


# ---------------------------------------------------------------------------------------------- runs, CLI


def test_a_run_still_training(run_path, tmp_path):
    """config.json only (warming up), then a half-written checkpoint and metrics line: clear answers, no crash."""
    workdir = tmp_path / "live"
    workdir.mkdir()
    shutil.copy(os.path.join(run_path, "config.json"), workdir)
    client = _client(service_lib.PlayService(str(workdir)))
    run = client.get("/api/run").json()
    assert run["steps"] == [] and run["training"] is True and run["default_step"] is None
    assert "no checkpoint yet" in error_of(client.get(f"/api/policy?board={BOARD}"), 409)
    assert "no checkpoint yet" in error_of(client.post("/api/play", json={"action": 4}), 409)
    assert client.get("/api/metrics").json()["rows"] == []
    # Training has begun: one finished step, a checkpoint being written, a metrics row being written.
    shutil.copytree(os.path.join(run_path, "warmstart"), workdir / "warmstart")
    (workdir / "checkpoints" / "1.orbax-checkpoint-tmp-123").mkdir(parents=True)
    with open(os.path.join(run_path, "metrics.jsonl")) as f:
        first = f.readline()
    (workdir / "metrics.jsonl").write_text(first + first[:20])
    run = client.get("/api/run").json()
    assert run["steps"] == [0] and run["training"] is True and run["last_metrics_step"] == 1
    assert [r["step"] for r in client.get("/api/metrics").json()["rows"]] == [1]
    assert "no checkpoint at step 1" in error_of(client.get(f"/api/policy?board={BOARD}&step=1"), 404)
    (workdir / "metrics.jsonl").write_text("{corrupt\n" + first)
    assert "metrics.jsonl cannot be read" in error_of(client.get("/api/metrics"), 500)
    assert client.get("/api/run").json()["steps"] == [0]


def test_cli_refuses_a_bad_workdir_in_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "experiments.play", f"--workdir={tmp_path / 'missing'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "does not exist" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(RunError, match="no config.json"):  # the CLI's check, in process
        runs.read_run_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RunError, match="not readable JSON"):
        runs.read_run_config(str(tmp_path))


def test_cli_serves_a_run_and_prints_its_url(run_path, tmp_path):
    """The command itself, on a run that has only started (no checkpoint: nothing to compile)."""
    import httpx

    shutil.copy(os.path.join(run_path, "config.json"), tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.play", f"--workdir={tmp_path}", "--port=0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+/)$", line.strip())
        assert url, line
        run = httpx.get(url.group(1) + "api/run", timeout=30).json()
        assert run["steps"] == [] and run["workdir"] == str(tmp_path)
        assert "no checkpoint yet" in httpx.get(url.group(1) + f"api/policy?board={BOARD}", timeout=30).json()["error"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------------- real browser


def _chromium():
    """(browser, driver) paths of the system Chromium (Debian: chromium + chromium-driver), or None."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _serve(svc):
    """The app served by uvicorn on a free port in a thread (sharing the module's compiled model)."""
    import uvicorn

    from reno_jax.play import app as app_lib

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app_lib.create_app(svc), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/", server, thread


@pytest.fixture
def browser():
    paths = _chromium()
    if paths is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("chromium / chromedriver not installed")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1400",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=paths[1]), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def live(request):
    """`live(service)` -> the URL of the page over that service (stopped after the test)."""
    servers = []

    def start(svc):
        url, server, thread = _serve(svc)
        servers.append((server, thread))
        return url

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def _board_text(driver, by):
    return "".join(c.get_attribute("data-value") for c in driver.find_elements(by.CSS_SELECTOR, "#board .cell"))


def _play_until_over(driver, wait, by, pick, max_moves):
    """The person plays `pick(values)` (an action) until the game ends; returns the number of model replies."""
    replies = 0
    for move in range(max_moves):
        action, target = pick(_board_text(driver, by))
        before = len(driver.find_elements(by.CSS_SELECTOR, "#move-log li"))
        driver.find_element(by.CSS_SELECTOR, target).click()
        wait.until(
            lambda d: (
                len(d.find_elements(by.CSS_SELECTOR, "#move-log li")) > before
                and "thinking" not in d.find_element(by.ID, "status").text
            )
        )
        log = [li.text for li in driver.find_elements(by.CSS_SELECTOR, "#move-log li")]
        assert log[before] == f"You: {action + 1}", log
        if len(log) > before + 1:
            replies += 1
            assert re.match(r"Model \(step \d+\): ", log[-1]), log
            cells = driver.find_elements(by.CSS_SELECTOR, "#heatmap .heat-cell")
            assert abs(sum(float(c.get_attribute("data-prob")) for c in cells) - 1) < 1e-3
            assert driver.find_element(by.ID, "model-text").text not in ("", "-")
            assert driver.find_element(by.ID, "tool-response").text not in ("", "-")
        if driver.find_element(by.ID, "status").get_attribute("data-game") != "ongoing":
            break
    return replies


def test_browser_plays_tictactoe_and_moves_the_slider(service, browser, live, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, wait = browser, WebDriverWait(browser, 90)
    driver.get(live(service))
    wait.until(lambda d: d.find_element(By.ID, "step-select").get_attribute("value") == "2")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#curves .curve svg path")) >= 1)
    # The default run trained X: the model plays X and opens, the person plays O.
    assert driver.find_element(By.ID, "side-select").get_attribute("value") == "2"
    wait.until(
        lambda d: (
            len(d.find_elements(By.CSS_SELECTOR, "#move-log li")) >= 1
            and "opens" not in d.find_element(By.ID, "status").text
        )
    )
    assert driver.find_element(By.CSS_SELECTOR, "#move-log li").text.startswith("Model (step 2): ")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#heatmap .heat-cell")) == 9
    if driver.find_element(By.ID, "status").get_attribute("data-game") == "ongoing":
        # A click on an occupied cell is refused with the server's reason.
        taken = _board_text(driver, By).find("1")
        if taken >= 0:
            driver.find_element(By.CSS_SELECTOR, f'#board .cell[data-action="{taken}"]').click()
            wait.until(lambda d: "not a legal move" in d.find_element(By.ID, "status").text)

        def first_empty(values):
            action = values.index("0")
            return action, f'#board .cell[data-action="{action}"]'

        _play_until_over(driver, wait, By, first_empty, 5)
    game = driver.find_element(By.ID, "status").get_attribute("data-game")
    assert game in ("x_won", "o_won", "draw", "model_illegal", "model_invalid"), game
    # A click after the end is refused on the page, and the server still answers.
    driver.find_element(By.CSS_SELECTOR, '#board .cell[data-action="8"]').click()
    assert "over" in driver.find_element(By.ID, "status").text
    # The checkpoint slider: the heat map follows it from the latest step back to the warm start.
    wait.until(lambda d: d.find_element(By.ID, "sharpen-heatmap").get_attribute("data-step") == "2")
    slider = driver.find_element(By.ID, "ckpt-slider")
    driver.execute_script("arguments[0].value = 0; arguments[0].dispatchEvent(new Event('input'));", slider)
    wait.until(lambda d: d.find_element(By.ID, "sharpen-heatmap").get_attribute("data-step") == "0")
    cells = driver.find_elements(By.CSS_SELECTOR, "#sharpen-heatmap .heat-cell")
    assert len(cells) == 9 and abs(sum(float(c.get_attribute("data-prob")) for c in cells) - 1) < 1e-3
    assert "warm start" in driver.find_element(By.ID, "slider-step").text
    shot = os.environ.get("PLAY_SCREENSHOTS", str(tmp_path))
    driver.save_screenshot(os.path.join(shot, "play_tictactoe.png"))
    assert os.path.getsize(os.path.join(shot, "play_tictactoe.png")) > 10_000


def test_browser_plays_connect4_with_column_buttons(c4_service, browser, live, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, wait = browser, WebDriverWait(browser, 90)
    driver.get(live(c4_service))
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#drop-row .drop")) == 7)
    assert len(driver.find_elements(By.CSS_SELECTOR, "#board .cell")) == 42
    # The run trained O: the person plays X and opens.
    assert driver.find_element(By.ID, "side-select").get_attribute("value") == "1"
    assert "drop a piece" in driver.find_element(By.ID, "status").text

    def emptiest_column(values):
        grid = np.array([int(v) for v in values]).reshape(6, 7)
        action = int(np.argmin((grid != 0).sum(axis=0)))
        return action, f'#drop-row .drop[data-action="{action}"]'

    replies = _play_until_over(driver, wait, By, emptiest_column, 21)
    assert replies >= 1
    assert len(driver.find_elements(By.CSS_SELECTOR, "#heatmap .heat-cell")) == 7
    assert _board_text(driver, By)[35:].count("1") >= 1  # the person's first piece lies on the bottom row
    wait.until(lambda d: d.find_element(By.ID, "sharpen-heatmap").get_attribute("data-step") == "1")
    shot = os.environ.get("PLAY_SCREENSHOTS", str(tmp_path))
    driver.save_screenshot(os.path.join(shot, "play_connect4.png"))
    assert os.path.getsize(os.path.join(shot, "play_connect4.png")) > 10_000
