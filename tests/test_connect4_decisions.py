"""studies/connect4_decisions.py: decisions sorted by what the position asks (win / block / other), the board
read back from the conversation text (plain or with landing cells marked), and the agreement counted per kind
(checked with an oracle and an anti-oracle in place of the model)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "studies"))
import connect4_decisions as cd  # noqa: E402

from configs import connect4_tiny  # noqa: E402
from reno_jax.envs.connect4 import wording  # noqa: E402
from reno_jax.loop import build  # noqa: E402


def _board(rows):
    return np.array([[".XO".index(ch) for ch in row] for row in rows], np.int8)


def test_decision_kinds_and_the_centre_order():
    empty = _board(["......."] * 6)
    assert cd.decision_kind(empty) == "other" and cd.centre_order_column(empty) == 3
    x_to_win = _board(["......."] * 4 + ["......O", "XXX..OO"])  # X to move (3 X, 3 O): column 4 makes four
    assert cd.decision_kind(x_to_win) == "win"
    x_must_block = _board(["......."] * 3 + ["....O..", "X...O..", "XX..O.."])  # O has three up column 5
    assert cd.decision_kind(x_must_block) == "block"
    centre_full = _board(["...X...", "...O...", "...X...", "...O...", "...X...", "OX.OX.."])
    assert cd.centre_order_column(centre_full) == 2


@pytest.mark.parametrize("marked", [False, True])
def test_board_is_read_back_from_the_last_board_text(marked):
    tokenizer = build.build_tokenizer(connect4_tiny.get_config())
    first = _board(["......."] * 5 + ["...X..."])
    last = _board(["......."] * 4 + ["...O...", "..XX..."])
    text = (
        "You are O.\n"
        + wording.render_board(first, mark_playable=marked)
        + "\nOpponent played 3.\n"
        + wording.render_board(last, mark_playable=marked)
    )
    np.testing.assert_array_equal(cd._board_before(tokenizer, np.asarray(tokenizer.encode(text))), last)
    with pytest.raises(RuntimeError, match="no board"):
        cd._board_before(tokenizer, np.asarray(tokenizer.encode("no board here")))


@pytest.fixture(scope="module")
def connect4(tiny_connect4):
    return tiny_connect4("greedy")


@pytest.mark.parametrize("shift, expected", [(0, 1.0), (1, 0.0)])
def test_agreement_per_kind(connect4, monkeypatch, scripted_forward, shift, expected):
    config, tokenizer, model_config, params = connect4
    monkeypatch.setattr(cd.ling3, "forward", scripted_forward(shift))
    figures = cd.split(params, model_config, tokenizer, config, games=4, batch=2, seed=0)
    assert sum(figures[k]["decisions"] for k in cd.KINDS) >= 4 * 4
    for kind in cd.KINDS:
        if figures[kind]["decisions"]:
            assert figures[kind]["agreement"] == expected
    # the teacher plays the centre order on every "other" decision, so an oracle agrees with that order there
    assert figures["other"]["centre_order"] == expected
    if shift == 0:  # the teacher never drops into a full column, nor does its oracle
        assert all(figures[k]["full_column"] == 0.0 for k in cd.KINDS)


def test_cli_checks_its_flags(tmp_path):
    with pytest.raises(SystemExit):
        cd.main([f"--workdir={tmp_path}", "--warm_start", "--step=3"])
    with pytest.raises(SystemExit):
        cd.main([f"--workdir={tmp_path}", "--games=0"])
    with pytest.raises(SystemExit):
        cd.main([f"--workdir={tmp_path}", "--warm_start", "--opening_plies=31"])
