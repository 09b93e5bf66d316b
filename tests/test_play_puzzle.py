"""The play page's puzzle view (`interface.PuzzleView`) on Sokoban: its host rules against the environment's jitted
ones, the solver's counts and best moves, a given-room start (`SokobanStart.given`) against the room table's, the
declarations' checks; then, on one tiny trained Sokoban run (a short warm start + one GSPO step, bounded history),
the JSON API (a person's moves, the model's move with its heat map, the model playing to the end, every refusal,
the transcripts) and a real headless Chromium that plays a room with the keyboard and the buttons.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_play import _client, browser, error_of, live  # noqa: F401  (browser, live: fixtures)

from configs import sokoban_tiny
from reno_jax import loop, run_config
from reno_jax.envs import interface, registry
from reno_jax.envs.interface import ToolCall
from reno_jax.envs.sokoban import env as senv
from reno_jax.envs.sokoban import puzzle_view as spv
from reno_jax.envs.sokoban import registration as sreg
from reno_jax.envs.sokoban import rooms, rules, wording
from reno_jax.play import service as service_lib
from reno_jax.protocol.chat import resolve

SMALL = dict(num_train_rooms=40, num_heldout_rooms=12)  # tests/test_sokoban.py's rooms (`rooms.build` caches them)


def _rows(*rows: str) -> str:
    """A board string of its rows (top first)."""
    return "".join(rows)


# The box in a corner, off its target: unsolvable.
DEAD = _rows("######", "#X___#", "#__P_#", "#___O#", "#____#", "######")


def _config(**env):
    config = run_config.default_config_dict()
    config.env = ml_collections.ConfigDict({"name": "sokoban", **SMALL, **env})
    return config


@pytest.fixture(scope="module")
def view() -> interface.PuzzleView:
    return registry.get("sokoban").board_view(_config())


@pytest.fixture(scope="module")
def env():
    return sreg.make_env(_config().env)


def _call(direction: int) -> ToolCall:
    return ToolCall(kind=jnp.int32(0), tool=jnp.int32(0), args=jnp.asarray([direction], jnp.int32))


def _cells(state) -> np.ndarray:
    return wording.np_cell_values(state.walls, state.targets, state.boxes, state.player)


def _room_text(board: str) -> str:
    """The room as the messages print it, of a 6 x 6 board string."""
    return "\n".join(board[r : r + 6] for r in range(0, 36, 6))


# ---------------------------------------------------------------------------------------------- the view


def test_puzzle_view_geometry_and_puzzles(view):
    assert isinstance(view, interface.PuzzleView)
    assert (view.rows, view.cols, view.chars, view.num_actions, view.max_moves) == (6, 6, "#_OX*PS", 4, 15)
    assert [view.label(a) for a in range(4)] == ["up", "down", "left", "right"]
    assert view.action_keys == ("ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight")
    assert dict(view.puzzles) == {"heldout": 12, "train": 40} and list(view.puzzles)[0] == "heldout"
    train, heldout = sreg.splits(_config().env)
    for suite, split in (("heldout", heldout), ("train", train)):
        for i in (0, len(split) - 1):
            board = view.puzzle(suite, i)
            text = wording.room_text(split.walls[i], split.targets[i], split.boxes[i], split.player[i])
            assert view.format(board) == text.replace("\n", "")
            assert view.status(board, 0) == "ongoing" and not view.solved(board)
    board = view.puzzle("heldout", 0)
    text = view.format(board)
    np.testing.assert_array_equal(view.parse(text.lower()), board)  # one case of letters: either is read
    assert view.legal(board).all() and view.decision_overrides == {}
    assert view.status(board, 15) == "out_of_moves" and view.status(board, 14) == "ongoing"
    assert _config().env.get("max_steps") is None  # the view's budget is the settings' default
    assert registry.get("sokoban").board_view(_config(max_steps=12, max_solution_moves=10)).max_moves == 12


def test_moves_match_the_environments_rules(view, env):
    """Random walks (pushes, blocked moves, boxes pushed off and into corners) from train and held-out rooms: the
    view's host move equals the jitted `rules.move` and the environment's step from a given-room start, cell for
    cell, with the same blocked moves and the same solved rooms."""
    move, step = jax.jit(rules.move), jax.jit(env.step)
    rng = np.random.default_rng(0)
    blocked_seen = 0
    for suite, index in [("heldout", i) for i in range(6)] + [("train", i) for i in range(6)]:
        board = view.puzzle(suite, index)
        state, _ = env.reset(jax.tree.map(lambda a: a[0], view.start(board, 0)))
        walls, targets, boxes, player = (jnp.asarray(a) for a in spv.room_of(board))
        for direction in rng.integers(0, 4, size=14):
            after = view.apply(board, int(direction))
            boxes, player, moved, _ = move(walls, boxes, player, jnp.int32(direction))
            np.testing.assert_array_equal(after, wording.np_cell_values(walls, targets, boxes, player))
            out = step(state, _call(int(direction)))
            np.testing.assert_array_equal(_cells(out.state), after)
            blocked = bool(np.array_equal(after, board))
            assert blocked == (not bool(moved))
            assert (int(out.message.template) == wording.TOOL_BLOCKED) == (blocked and not bool(out.done))
            assert bool(out.info["solved"]) == view.solved(after)
            blocked_seen += blocked
            board, state = after, out.state
            if bool(out.done):
                break
    assert blocked_seen > 0  # the walks did run into walls


def test_solved_and_impossible_boards(view):
    assert view.solved(view.parse(_rows("######", "#_*__#", "#_P__#", "#____#", "#____#", "######")))
    assert not view.solved(view.parse(_rows("######", "#_OX_#", "#_P__#", "#____#", "#____#", "######")))
    solved = view.parse(_rows("######", "#_*__#", "#_P__#", "#____#", "#____#", "######"))
    assert view.status(solved, 15) == "solved"  # solved on the last move: solved, not out of moves
    refusals = {
        "#" * 35: "36 characters",
        _rows("######", "#_OX_#", "#_P__#", "#____#", "#___a#", "######"): "'A'",
        _rows("######", "#_OX_#", "#____#", "#____#", "#____#", "######"): "one player",
        _rows("######", "#_OX_#", "#_PP_#", "#____#", "#____#", "######"): "one player",
        _rows("######", "#_OX_#", "#_PX_#", "#____#", "#____#", "######"): "got 2 box",
        _rows("######", "#_OXO#", "#_P__#", "#____#", "#____#", "######"): "2 target",
        _rows("######", "#_O__#", "#_P__#", "#____#", "#____#", "######"): "got 0 box",
        _rows("_#####", "#_OX_#", "#_P__#", "#____#", "#____#", "######"): "outer ring",
        _rows("######", "#_OX_P", "#____#", "#____#", "#____#", "######"): "outer ring",
    }
    for text, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            view.parse(text)


def test_solver_counts_and_best_moves(view):
    """`moves_to_solve` is the rooms' optimal length; `best_actions` are the moves one closer (the solver's own
    first move among them), and playing them solves the room in exactly that many moves."""
    _, heldout = sreg.splits(_config().env)
    for i in range(len(heldout)):
        board = view.puzzle("heldout", i)
        left = view.moves_to_solve(board)
        assert left == int(heldout.optimal[i]) >= 1
        solution = rooms.solve(heldout.walls[i], heldout.targets[i], heldout.boxes[i], heldout.player[i])
        assert solution.moves[0] in view.best_actions(board)
        moves = 0
        while not view.solved(board):
            best = view.best_actions(board)
            for a in range(4):
                assert (view.moves_to_solve(view.apply(board, a)) == left - 1) == (a in best)
            board, left, moves = view.apply(board, best[-1]), left - 1, moves + 1
        assert moves == int(heldout.optimal[i]) and view.moves_to_solve(board) == 0
        assert view.best_actions(board) == []  # solved: no move to make
    dead = view.parse(DEAD)
    assert view.moves_to_solve(dead) is None and view.best_actions(dead) == []


def test_given_room_start_equals_the_table_start(view, env):
    """A start that gives a room resets to the same state and first message as the table start of that room (only
    its label differs); the moves it says were made count against the budget; table starts keep their two leaves."""
    n = 4
    table = senv.SokobanStart(split=jnp.full((n,), senv.HELDOUT, jnp.int32), room=jnp.arange(n, dtype=jnp.int32))
    assert len(jax.tree.leaves(table)) == 2
    given = jax.tree.map(lambda *a: jnp.concatenate(a), *[view.start(view.puzzle("heldout", i), 0) for i in range(n)])
    reset = jax.jit(jax.vmap(env.reset))
    (want, want_message), (got, got_message) = reset(table), reset(given)
    for field in ("walls", "targets", "boxes", "player", "optimal", "steps", "blocked", "outcome"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    np.testing.assert_array_equal(got_message.values, want_message.values)
    np.testing.assert_array_equal(got_message.template, want_message.template)
    np.testing.assert_array_equal(got.room, [senv.GIVEN_ROOM] * n)
    spec = env.chat()
    assert resolve(spec.user[0], np.asarray(got_message.values[0])) == "Room:\n" + wording.room_text(
        *spv.room_of(view.puzzle("heldout", 0))
    )
    # 14 moves made: the next one that does not solve the room is the last.
    board = view.puzzle("heldout", 0)
    state, _ = env.reset(jax.tree.map(lambda a: a[0], view.start(board, 14)))
    wrong = next(a for a in range(4) if a not in view.best_actions(board))
    out = env.step(state, _call(wrong))
    assert bool(out.done) and int(out.info["outcome"]) == senv.OUTCOME_OUT_OF_MOVES and int(out.info["steps"]) == 15
    assert int(out.message.template) == wording.TOOL_OUT_OF_MOVES
    # An unsolvable given room: its `optimal` is -1.
    assert int(view.start(view.parse(DEAD), 0).given.optimal[0]) == -1


def test_puzzle_view_declarations_are_checked(view):
    base = {f: getattr(view, f) for f in view.__dataclass_fields__}
    assert interface.PuzzleView(**base).num_actions == 4
    for change, message in (
        ({"action_labels": ()}, "action_labels"),
        ({"action_keys": ("ArrowUp",)}, "action_keys needs 4"),
        ({"action_symbols": ("a", "b")}, "action_symbols needs 4"),
        ({"fills": ("#000",)}, "fills needs 7"),
        ({"chars": "#_OX*P"}, "one entry per cell value"),
        ({"max_moves": 0}, "max_moves"),
        ({"puzzles": {}}, "puzzles"),
        ({"puzzles": {"heldout": 0}}, "puzzles"),
        ({"rows": 0}, "rows, cols"),
    ):
        with pytest.raises(ValueError, match=message):
            interface.PuzzleView(**{**base, **change})
    with pytest.raises(ValueError, match="PuzzleView.call_actions"):
        interface.PuzzleView(**{**base, "call_actions": (0, 1, 2, 4)}).actions_of_rows(4)


# ---------------------------------------------------------------------------------------------- a run: the API


def puzzle_config():
    """A tiny Sokoban run: 2 layers, a 30-step warm start on the solver's moves (well-formed calls), one GSPO
    step, few rooms; bounded history (`rollout.history=0`) as `configs/sokoban_tiny.py`."""
    c = sokoban_tiny.get_config()
    c.num_steps = 1
    c.model.tiny.num_hidden_layers = 2
    c.env.num_train_rooms = SMALL["num_train_rooms"]
    c.env.num_heldout_rooms = 8
    c.sft.num_steps = 30
    c.sft.batch_size = 4
    c.sft.compare_episodes = 0  # the student-teacher comparison: tests/test_own_environment.py
    c.sft.learning_rate = 1e-2
    c.rollout.boards_per_step = 2
    c.rollout.group_size = 2
    c.rl.num_microbatches = 1
    c.rl.max_logp_shift = 0.0
    c.checkpoint_every = 1
    c.plot_every = 0
    return c


@pytest.fixture(scope="module")
def puzzle_service(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("play_sokoban"))
    loop.train(puzzle_config(), workdir)
    return service_lib.PlayService(workdir)


@pytest.fixture(scope="module")
def client(puzzle_service):
    return _client(puzzle_service)


def test_api_puzzle_run_and_the_persons_moves(client):
    run = client.get("/api/run").json()
    assert run["env"] == "sokoban" and run["view"] == "puzzle" and run["board"] is None and run["steps"] == [0, 1]
    p = run["puzzle"]
    assert (p["rows"], p["cols"], p["chars"], p["num_actions"], p["max_moves"]) == (6, 6, "#_OX*PS", 4, 15)
    assert p["labels"] == ["up", "down", "left", "right"] and p["keys"][0] == "ArrowUp" and p["solver"] is True
    assert p["suites"] == [{"name": "heldout", "count": 8}, {"name": "train", "count": 40}]
    assert len(p["symbols"]) == len(p["colors"]) == len(p["fills"]) == 7
    out = client.get("/api/puzzle", params={"suite": "heldout", "index": 3}).json()
    assert out["suite"] == "heldout" and out["index"] == 3 and out["moves"] == 0 and out["status"] == "ongoing"
    assert client.get("/api/puzzle").json()["suite"] == "heldout"  # the first suite by default
    board, left = out["board"], out["moves_to_solve"]
    assert left >= 1 and out["best"]
    moves = 0
    while left:  # the person plays the solver's moves (best[0]) and solves the room
        step = client.post("/api/puzzle/move", json={"board": board, "action": out["best"][0], "moves": moves}).json()
        assert step["before"] == board and step["moves"] == moves + 1 and step["moves_to_solve"] == left - 1
        assert step["label"] == ["up", "down", "left", "right"][out["best"][0]] and step["blocked"] is False
        board, left, moves, out = step["board"], step["moves_to_solve"], step["moves"], step
    assert out["status"] == "solved" and out["best"] == []
    # A blocked move counts, and the room stays as it was.
    start = client.get("/api/puzzle", params={"suite": "train", "index": 0}).json()["board"]
    blocked = [
        client.post("/api/puzzle/move", json={"board": start, "action": a, "moves": 14}).json() for a in range(4)
    ]
    stay = [b for b in blocked if b["blocked"]]
    assert stay and all(b["board"] == start and b["moves"] == 15 and b["status"] == "out_of_moves" for b in stay)


def test_api_model_move_and_model_plays_to_the_end(client):
    board = client.get("/api/puzzle", params={"suite": "heldout", "index": 1}).json()["board"]
    out = client.post("/api/puzzle/model", json={"board": board, "moves": 2}).json()
    m = out["model"]
    assert m["board"] == board and m["step"] == 1 and m["side"] is None and m["legal"] == [True] * 4
    assert len(m["probs"]) == 4 and abs(sum(m["probs"]) - 1) < 1e-5 and 0 < m["mass"] <= 1
    assert m["verdict"] in ("legal", "invalid") and isinstance(m["text"], str) and m["best"]
    if m["verdict"] == "legal":
        assert out["moves"] == 3 and out["board"] == m["board_after"] and m["label"] in m["text"]
        assert _room_text(out["board"]) in m["tool_response"] and out["blocked"] == (out["board"] == board)
    else:
        assert out["moves"] == 2 and out["board"] == board and m["reward"] == senv.INVALID_REWARD
    # The same through /api/policy (the slider's panel): the heat map does not depend on the moves made.
    policy = client.get("/api/policy", params={"board": board, "step": 0}).json()
    assert policy["step"] == 0 and len(policy["probs"]) == 4 and policy["best"] == m["best"]
    assert client.get("/api/policy", params={"board": board}).json()["probs"] == m["probs"]

    solve = client.post("/api/puzzle/solve", json={"board": board, "moves": 2}).json()
    turns = solve["turns"]
    assert turns[0]["probs"] == m["probs"]  # the heat map of its first turn is the one of its single move
    assert solve["start_board"] == board and 1 <= len(turns) <= 13 and solve["step"] == 1
    assert solve["ended"] in ("solved", "out_of_moves", "invalid")
    assert [t["turn"] for t in turns] == list(range(len(turns)))
    before = board
    for t in turns:
        assert t["board"] == before and len(t["probs"]) == 4 and abs(sum(t["probs"]) - 1) < 1e-5
        if t["verdict"] == "legal":
            assert _room_text(t["board_after"]) in t["tool_response"] and t["label"] in t["text"]
            assert t["blocked"] == (t["board_after"] == before)
        before = t["board_after"]
    assert solve["board"] == turns[-1]["board_after"] and solve["moves"] == turns[-1]["moves"]
    assert solve["moves"] == 2 + sum(t["verdict"] == "legal" for t in turns)
    assert abs(sum(t["reward"] for t in turns) - solve["reward"]) < 1e-5
    if solve["ended"] == "out_of_moves":
        assert solve["moves"] == 15 and solve["status"] == "out_of_moves"  # the episode counted the 2 moves made
    assert solve["info"]["steps"] == solve["moves"]


def test_api_puzzle_refusals_are_clear(client):
    board = client.get("/api/puzzle", params={"suite": "heldout", "index": 0}).json()["board"]
    assert "no puzzle suite 'chess'" in error_of(client.get("/api/puzzle", params={"suite": "chess"}), 404)
    assert "index must be in 0..7" in error_of(client.get("/api/puzzle", params={"index": 8}), 400)
    assert "index must be in 0..39" in error_of(client.get("/api/puzzle", params={"suite": "train", "index": -1}), 400)
    move = lambda **body: client.post("/api/puzzle/move", json=body)  # noqa: E731
    assert "36 characters" in error_of(move(board="#_P", action=0), 400)
    assert "one player" in error_of(move(board=board.replace("P", "_"), action=0), 400)
    assert "action must be 0..3" in error_of(move(board=board, action=4), 400)
    assert "moves must be in 0..15" in error_of(move(board=board, action=0, moves=16), 400)
    assert "out of moves (15 / 15)" in error_of(move(board=board, action=0, moves=15), 409)
    solved = _rows("######", "#_*__#", "#_P__#", "#____#", "#____#", "######")
    assert "is solved" in error_of(move(board=solved, action=0), 409)
    assert "square" in error_of(client.post("/api/puzzle/move", json={"board": board, "square": 1}), 400)
    model = lambda path, **body: client.post(f"/api/puzzle/{path}", json=body)  # noqa: E731
    for path in ("model", "solve"):
        assert "is solved" in error_of(model(path, board=solved), 409)
        assert "out of moves" in error_of(model(path, board=board, moves=15), 409)
        assert "saved steps: [0, 1]" in error_of(model(path, board=board, step=7), 404)
        assert "seed" in error_of(model(path, board=board, seed=-1, sampled=True), 400)
    assert "is solved" in error_of(client.get("/api/policy", params={"board": solved}), 409)
    assert "one-player puzzle" in error_of(client.post("/api/play", json={"action": 1}), 404)
    assert "one-player puzzle" in error_of(client.post("/api/play", json={"board": board, "action": 1}), 404)
    assert client.get("/api/puzzle").status_code == 200  # still serving


def test_api_transcripts_of_a_bounded_history_run_show_every_turn(client):
    """Each turn of a bounded-history episode is its own turn sample: the transcript shows each one's own text."""
    out = client.get("/api/episode", params={"suite": "heldout", "episode": 2}).json()
    said = [m for m in out["messages"] if m["role"] == "assistant"]
    assert len(said) == out["num_turns"] >= 1
    if out["info"]["invalid"] == 0:  # every call was a move
        assert all(m["parse"] == "ok" and '"move"' in m["content"] for m in said)


# ---------------------------------------------------------------------------------------------- real browser


def test_browser_plays_a_puzzle(puzzle_service, browser, live, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    driver, wait = browser, WebDriverWait(browser, 90)
    driver.get(live(puzzle_service))
    wait.until(lambda d: d.find_element(By.ID, "puzzle-board").get_attribute("data-board"))
    assert not driver.find_element(By.ID, "puzzle-section").get_attribute("hidden")
    assert driver.find_element(By.ID, "play-section").get_attribute("hidden")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#puzzle-board .cell")) == 36
    assert len(driver.find_elements(By.CSS_SELECTOR, "#puzzle-moves button")) == 4
    # A room the suite does not have: the server's reason; then room 2 of the held-out suite.
    index = driver.find_element(By.ID, "puzzle-index")
    index.clear()
    index.send_keys("99")
    driver.find_element(By.ID, "puzzle-load").click()
    wait.until(lambda d: "index must be in 0..7" in d.find_element(By.ID, "puzzle-status").text)
    index.clear()
    index.send_keys("2")
    driver.find_element(By.ID, "puzzle-load").click()
    wait.until(lambda d: d.find_element(By.ID, "puzzle-board").get_attribute("data-puzzle") == "heldout/2")
    view = puzzle_service.view
    first = view.format(view.puzzle("heldout", 2))
    assert driver.find_element(By.ID, "puzzle-board").get_attribute("data-board") == first
    assert driver.find_element(By.ID, "puzzle-counter").text == "0 / 15"

    def moves_made():
        return int(driver.find_element(By.ID, "puzzle-board").get_attribute("data-moves"))

    # The person: the solver's first move with the keyboard, then a button.
    best = view.best_actions(view.puzzle("heldout", 2))[0]
    keys = {0: Keys.ARROW_UP, 1: Keys.ARROW_DOWN, 2: Keys.ARROW_LEFT, 3: Keys.ARROW_RIGHT}
    driver.find_element(By.TAG_NAME, "body").send_keys(keys[best])
    wait.until(lambda d: moves_made() == 1)
    board = view.apply(view.puzzle("heldout", 2), best)
    assert driver.find_element(By.ID, "puzzle-board").get_attribute("data-board") == view.format(board)
    log = [li.text for li in driver.find_elements(By.CSS_SELECTOR, "#puzzle-log li")]
    assert log == [f"You: move {view.label(best)}"]
    second = view.best_actions(board)[0]
    driver.find_element(By.CSS_SELECTOR, f'#puzzle-moves button[data-action="{second}"]').click()
    wait.until(lambda d: moves_made() == 2)
    assert "the solver" in driver.find_element(By.ID, "puzzle-solver").text
    # The model's move: its heat map over the four moves, its text and the environment's answer.
    wait.until(lambda d: d.find_element(By.ID, "puzzle-model-move").is_enabled())
    driver.find_element(By.ID, "puzzle-model-move").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#puzzle-log li")) == 3)
    assert driver.find_elements(By.CSS_SELECTOR, "#puzzle-log li")[2].text.startswith("Model (step 1): ")
    cells = driver.find_elements(By.CSS_SELECTOR, "#heatmap .heat-cell")
    assert len(cells) == 4 and abs(sum(float(c.get_attribute("data-prob")) for c in cells) - 1) < 1e-3
    assert driver.find_element(By.ID, "model-text").text not in ("", "-")
    assert driver.find_element(By.ID, "tool-response").text not in ("", "-")
    # The model plays on to the end.
    if driver.find_element(By.ID, "puzzle-status").get_attribute("data-game") == "ongoing":
        wait.until(lambda d: d.find_element(By.ID, "puzzle-model-solve").is_enabled())
        driver.find_element(By.ID, "puzzle-model-solve").click()
        wait.until(lambda d: d.find_element(By.ID, "puzzle-status").get_attribute("data-ended"))
        ended = driver.find_element(By.ID, "puzzle-status").get_attribute("data-ended")
        assert ended in ("solved", "out_of_moves", "invalid"), ended
        assert len(driver.find_elements(By.CSS_SELECTOR, "#puzzle-log li")) > 3
        if ended == "out_of_moves":
            assert driver.find_element(By.ID, "puzzle-counter").text == "15 / 15"
            # Out of moves: the page refuses another move itself.
            driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_UP)
            wait.until(lambda d: "over" in d.find_element(By.ID, "puzzle-status").text)
    # The slider's panel shows the heat map over the four moves on the puzzle.
    wait.until(lambda d: d.find_element(By.ID, "sharpen-heatmap").get_attribute("data-step") == "1")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#sharpen-heatmap .heat-cell")) == 4
    shot = os.environ.get("PLAY_SCREENSHOTS", str(tmp_path))
    driver.save_screenshot(os.path.join(shot, "play_puzzle.png"))
    assert os.path.getsize(os.path.join(shot, "play_puzzle.png")) > 10_000
