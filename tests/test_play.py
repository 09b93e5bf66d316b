"""The play page (`experiments/play.py`, `reno_jax/play`): boards, the heat map, the JSON API with every bad input,
and a real headless Chromium that plays a game on a tiny trained run.

One tiny run is trained per module (a short warm start + 2 GSPO steps, a checkpoint every step), so the page has
three checkpoints: 0 (the warm start), 1 and 2.
"""

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
import numpy as np
import pytest

from configs import tictactoe_tiny
from reno_jax import loop
from reno_jax.envs.tictactoe import registration
from reno_jax.envs.tictactoe import wording as text, tool_parser
from reno_jax.models import ling3
from reno_jax.play import board_text, policy as policy_lib, run_dir as run_dir_lib, service as service_lib
from reno_jax.rl import sft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOARD = "xx.o.o..."  # X to move: 3 wins at once, 5 keeps the win too (minimax-optimal: 3 and 5)


def tiny_config():
    """tests/test_experiments.py's short config with a longer warm start (enough for mostly well-formed calls).

    Its rollout and GSPO train step are those of that file's run, whose compiled programs the session's
    compilation cache then already holds (the page does not depend on how the checkpoints were trained).
    """
    c = tictactoe_tiny.get_config()
    c.num_steps = 2
    c.model.tiny.num_hidden_layers = 2
    c.sft.num_steps = 20
    c.sft.batch_size = 8
    c.sft.learning_rate = 1e-2
    c.rollout.boards_per_step = 4
    c.rollout.group_size = 4
    c.rl.train_groups = 2
    c.checkpoint_every = 1
    c.keep_checkpoints = 5
    c.plot_every = 0
    return c


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
    from fastapi.testclient import TestClient
    from reno_jax.play import app as app_lib
    return TestClient(app_lib.create_app(service), raise_server_exceptions=False)


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]
    return body["error"]


# ---------------------------------------------------------------------------------------------- boards

def test_board_text_round_trip_and_refusals():
    board = board_text.parse_board("X.o......")
    np.testing.assert_array_equal(board, [1, 0, 2, 0, 0, 0, 0, 0, 0])
    assert board_text.format_board(board) == "x.o......"
    assert board_text.result(board_text.parse_board("xxxoo....")) == "x_won"
    assert board_text.result(board_text.parse_board("ooo.xx.x.")) == "o_won"
    assert board_text.result(board_text.parse_board("xoxxoxoxo")) == "draw"
    refusals = {
        "xx": "9 characters", "xx.o.o..z": "'z'", 12: "9 characters",
        "xxx......": "#X must be", "ooo......": "#X must be",
        "xxxooo...": "both X and O", "xxxoo.o..": "X has a line", "ooox.xx.x": "O has a line",
    }
    for text, message in refusals.items():
        with pytest.raises(board_text.BoardError, match=message):
            board_text.parse_board(text)


def test_verdict_of_refused_and_winning_calls():
    board = board_text.parse_board(BOARD)
    illegal = policy_lib.verdict(board, tool_parser.KIND_OK, 1, illegal=True, invalid=False)
    assert illegal["verdict"] == "illegal" and illegal["square"] == 1 and illegal["board_after"] == BOARD
    assert "taken" in illegal["tool_response"]
    invalid = policy_lib.verdict(board, tool_parser.KIND_NO_CALL, 0, illegal=False, invalid=True)
    assert invalid["verdict"] == "invalid" and invalid["square"] is None and invalid["parse"] == "no_call"
    assert "Invalid call" in invalid["tool_response"]
    win = policy_lib.verdict(board, tool_parser.KIND_OK, 3, illegal=False, invalid=False)
    assert win["board_after"] == "xxxo.o..." and "You won" in win["tool_response"]


# ---------------------------------------------------------------------------------------------- the model

def test_run_dir_lists_warm_start_and_checkpoints(run_path, service):
    assert service.run.steps() == [0, 1, 2]
    p0, p2 = service.run.restore_params(0), service.run.restore_params(2)
    assert jax.tree.structure(p0) == jax.tree.structure(p2)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p2)))
    with pytest.raises(run_dir_lib.CheckpointMissing):
        service.run.restore_params(5)


def test_heat_map_is_the_models_square_distribution(service):
    """mass * probs[k] == p(square k | prompt, canonical call prefix), scored independently: the host chat
    template's prompt + the full call for each square, through `ling3.token_logprobs` (the training scorer)."""
    policy = service.model
    params = service.run.restore_params(2)
    board = board_text.parse_board(BOARD)
    heat = policy.heat_map(params, board)
    assert len(heat["probs"]) == 9 and abs(sum(heat["probs"]) - 1) < 1e-5 and 0 < heat["mass"] <= 1
    prompt = text.prompt_ids(policy.tokenizer, text.move_task_messages(board))
    table = sft.build_call_table(policy.tokenizer, registration.make_teacher(None, policy.env.env).calls,
                                 int(policy.env.chat.turn_end_id), policy.env.pad_id, [text.TOOL_NAME])
    calls, offset = np.asarray(table.ids), table.choice_offset
    tokens = jnp.asarray([prompt + list(call) for call in calls], jnp.int32)
    logp = jax.jit(lambda p, t: ling3.token_logprobs(p, policy.model_config, t))(params, tokens)
    square_p = np.exp(np.asarray(logp)[:, len(prompt) + offset])
    np.testing.assert_allclose(square_p, heat["mass"] * np.asarray(heat["probs"]), rtol=2e-3, atol=1e-7)
    assert int(np.argmax(heat["probs"])) == int(np.argmax(square_p))


def test_zero_model_answers_with_an_invalid_call(service):
    """A model with all-zero weights emits no tool call: the parser's verdict is shown, not a crash."""
    params = jax.tree.map(jnp.zeros_like, service.run.restore_params(0))
    reply = service.model.reply(params, board_text.parse_board(BOARD))
    assert reply["verdict"] == "invalid" and reply["square"] is None and reply["parse"] != "ok"
    assert reply["reward"] == -1.0 and "Invalid call" in reply["tool_response"]


# ---------------------------------------------------------------------------------------------- API

def test_api_policy_happy_path(client, service):
    for step in service.run.steps():
        out = client.get(f"/api/policy?board={BOARD}&step={step}").json()
        assert out["step"] == step and out["board"] == BOARD and out["side"] == "x"
        assert len(out["probs"]) == 9 and abs(sum(out["probs"]) - 1) < 1e-5 and 0 < out["mass"] <= 1
        assert out["optimal"] == [3, 5] and out["winning"] == [3] and out["value"] == 1
        assert isinstance(out["text"], str) and out["verdict"] in ("legal", "illegal", "invalid")
        if out["verdict"] != "invalid":
            assert re.search(r'"square"\s*:\s*%d' % out["square"], out["text"]), out["text"]
        if out["verdict"] == "legal":
            assert out["board_after"][out["square"] - 1] == "x"
    latest = client.get(f"/api/policy?board={BOARD}").json()
    assert latest["step"] == 2 and latest["greedy"] is True
    sampled = [client.get(f"/api/policy?board={BOARD}&sampled=true&seed=7").json() for _ in range(2)]
    assert sampled[0]["greedy"] is False and sampled[0]["text"] == sampled[1]["text"]  # a seed fixes the sample
    assert sampled[0]["probs"] == latest["probs"]  # the heat map does not depend on decoding


def test_api_run_metrics_and_page(client):
    run = client.get("/api/run").json()
    assert run["steps"] == [0, 1, 2] and run["default_step"] == 2 and run["task"] == "move"
    assert run["training"] is False and run["last_metrics_step"] == 2 == run["num_steps"]
    metrics = client.get("/api/metrics").json()
    assert [r["step"] for r in metrics["rows"]] == [1, 2]
    assert "rollout/rewards_mean" in metrics["keys"] and "rollout/rewards_mean" in metrics["default_keys"]
    assert [r["step"] for r in client.get("/api/metrics?since=1").json()["rows"]] == [2]
    page = client.get("/")
    assert page.status_code == 200 and 'id="heatmap"' in page.text and "http" not in page.text.split("<body>")[1]
    for name in ("play.js", "play.css"):
        assert client.get(f"/static/{name}").status_code == 200


def test_api_play_a_move_and_model_first(client):
    out = client.post("/api/play", json={"board": ".........", "square": 5, "step": 1}).json()
    assert out["after_person"] == "....x...." and out["model"]["side"] == "o" and out["model"]["step"] == 1
    assert out["status"] in ("ongoing", "model_illegal", "model_invalid")
    if out["status"] == "ongoing":
        assert out["board"].count("o") == 1 and out["board"][out["model"]["square"] - 1] == "o"
    first = client.post("/api/play", json={"board": ".........", "square": None}).json()
    assert first["after_person"] == "........." and first["model"]["side"] == "x"
    # The person's winning move ends the game before the model is asked.
    won = client.post("/api/play", json={"board": "xx.oo....", "square": 3}).json()
    assert won == {"board": "xxxoo....", "after_person": "xxxoo....", "person_square": 3, "status": "x_won",
                   "model": None}


def test_api_refusals_are_clear_and_the_server_survives(client):
    assert "9 characters" in error_of(client.get("/api/policy?board=xx"), 400)
    assert "'z'" in error_of(client.get("/api/policy?board=xx.o.o..z"), 400)
    assert "impossible" in error_of(client.get("/api/policy?board=xxx......"), 400)
    assert "finished" in error_of(client.get("/api/policy?board=xxxoo...."), 409)
    assert "saved steps: [0, 1, 2]" in error_of(client.get(f"/api/policy?board={BOARD}&step=7"), 404)
    assert "step" in error_of(client.get(f"/api/policy?board={BOARD}&step=abc"), 400)
    assert "board" in error_of(client.get("/api/policy"), 400)
    assert "seed" in error_of(client.get(f"/api/policy?board={BOARD}&sampled=true&seed=-3"), 400)
    assert "square 1 is taken" in error_of(client.post("/api/play", json={"board": "x...o....", "square": 1}), 409)
    assert "1..9" in error_of(client.post("/api/play", json={"board": ".........", "square": 10}), 400)
    assert "game is over" in error_of(client.post("/api/play", json={"board": "xxxoo....", "square": 6}), 409)
    assert "impossible" in error_of(client.post("/api/play", json={"board": "oo.......", "square": 3}), 400)
    assert error_of(client.post("/api/play", content=b"{not json", headers={"content-type": "application/json"}),
                    400)
    assert client.get(f"/api/policy?board={BOARD}&step=1").status_code == 200  # still serving


def test_api_shows_a_refused_model_move(client, service, monkeypatch):
    board = board_text.parse_board("x...o....")
    refused = {"text": '<tool_call>{"name": "choose_square", "arguments": {"square": 5}}</tool_call>',
               **policy_lib.verdict(board, tool_parser.KIND_OK, 5, illegal=True, invalid=False),
               "reward": -1.0, "is_optimal": False, "greedy": True}
    monkeypatch.setattr(service.model, "reply", lambda *a, **k: dict(refused))
    out = client.post("/api/play", json={"board": "x........", "square": 5}).json()
    assert out["status"] == "model_illegal" and out["board"] == "x...o...."
    assert out["model"]["verdict"] == "illegal" and "taken" in out["model"]["tool_response"]


def test_a_run_still_training(run_path, tmp_path):
    """config.json only (warming up), then a half-written checkpoint and metrics line: clear answers, no crash."""
    from fastapi.testclient import TestClient
    from reno_jax.play import app as app_lib
    workdir = tmp_path / "live"
    workdir.mkdir()
    shutil.copy(os.path.join(run_path, "config.json"), workdir)
    client = TestClient(app_lib.create_app(service_lib.PlayService(str(workdir))), raise_server_exceptions=False)
    run = client.get("/api/run").json()
    assert run["steps"] == [] and run["training"] is True and run["default_step"] is None
    assert "no checkpoint yet" in error_of(client.get(f"/api/policy?board={BOARD}"), 409)
    assert "no checkpoint yet" in error_of(client.post("/api/play", json={"square": 5}), 409)
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
    out = subprocess.run([sys.executable, "-m", "experiments.play", f"--workdir={tmp_path / 'missing'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "does not exist" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(run_dir_lib.RunDirError, match="no config.json"):  # the CLI's check, in process
        run_dir_lib.load_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(run_dir_lib.RunDirError, match="not readable JSON"):
        run_dir_lib.load_config(str(tmp_path))


def test_cli_serves_a_run_and_prints_its_url(run_path, tmp_path):
    """The command itself, on a run that has only started (no checkpoint: nothing to compile)."""
    import httpx
    shutil.copy(os.path.join(run_path, "config.json"), tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "experiments.play", f"--workdir={tmp_path}", "--port=0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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


@pytest.fixture
def live_url(service):
    """The app served by uvicorn on a free port in a thread (sharing the module's compiled model)."""
    import uvicorn
    from reno_jax.play import app as app_lib
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app_lib.create_app(service), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    server.should_exit = True
    thread.join(timeout=10)


def test_browser_plays_a_game_and_moves_the_slider(live_url, tmp_path):
    paths = _chromium()
    if paths is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("chromium / chromedriver not installed")
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1300"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=paths[1]), options=options)
    wait = WebDriverWait(driver, 60)
    try:
        driver.get(live_url)
        wait.until(lambda d: d.find_element(By.ID, "step-select").get_attribute("value") == "2")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#curves .curve svg path")) >= 1)
        replies = 0
        for _ in range(5):  # the person (X) plays the first empty square until the game ends
            board = "".join(c.text.lower() or "." for c in driver.find_elements(By.CSS_SELECTOR, "#board .cell"))
            square = board.index(".") + 1
            before = len(driver.find_elements(By.CSS_SELECTOR, "#move-log li"))
            driver.find_element(By.CSS_SELECTOR, f'#board .cell[data-square="{square}"]').click()
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#move-log li")) > before
                       and "thinking" not in d.find_element(By.ID, "status").text)
            log = [li.text for li in driver.find_elements(By.CSS_SELECTOR, "#move-log li")]
            assert log[before] == f"You: {square}", log
            if len(log) > before + 1:
                replies += 1
                assert log[-1].startswith("Model (step 2): "), log
                cells = driver.find_elements(By.CSS_SELECTOR, "#heatmap .heat-cell")
                assert len(cells) == 9
                assert abs(sum(float(c.get_attribute("data-prob")) for c in cells) - 1) < 1e-3
                assert driver.find_element(By.ID, "model-text").text not in ("", "-")
                assert driver.find_element(By.ID, "tool-response").text not in ("", "-")
            if driver.find_element(By.ID, "status").get_attribute("data-game") != "ongoing":
                break
            if before == 0:  # a click on an occupied square is refused with the server's reason
                driver.find_element(By.CSS_SELECTOR, f'#board .cell[data-square="{square}"]').click()
                wait.until(lambda d: "is taken" in d.find_element(By.ID, "status").text)
        game = driver.find_element(By.ID, "status").get_attribute("data-game")
        assert game in ("x_won", "o_won", "draw", "model_illegal", "model_invalid"), game
        assert replies >= 1
        # A click after the end is refused on the page, and the server still answers.
        driver.find_element(By.CSS_SELECTOR, '#board .cell[data-square="9"]').click()
        assert "over" in driver.find_element(By.ID, "status").text
        # The checkpoint slider: the heat map follows it from the latest step back to the warm start.
        wait.until(lambda d: d.find_element(By.ID, "sharpen-heatmap").get_attribute("data-step") == "2")
        slider = driver.find_element(By.ID, "ckpt-slider")
        driver.execute_script("arguments[0].value = 0; arguments[0].dispatchEvent(new Event('input'));", slider)
        wait.until(lambda d: d.find_element(By.ID, "sharpen-heatmap").get_attribute("data-step") == "0")
        cells = driver.find_elements(By.CSS_SELECTOR, "#sharpen-heatmap .heat-cell")
        assert len(cells) == 9 and abs(sum(float(c.get_attribute("data-prob")) for c in cells) - 1) < 1e-3
        assert "warm start" in driver.find_element(By.ID, "slider-step").text
        shot = tmp_path / "play_page.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        driver.quit()
