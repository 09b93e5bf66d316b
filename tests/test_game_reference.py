"""The exact reference outcomes behind the game task's targets: known figures and the repo's own minimax table."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "studies"))
import game_reference as ref  # noqa: E402

EMPTY = (0,) * 9


def test_random_against_random_is_the_textbook_split():
    # 255,168 games, weighted by their probability: X wins 58.5%, O 28.8%, draws 12.7%.
    win, draw, loss = ref.outcome(EMPTY, 1, 1, "random", "random", 0.5)
    assert (win, draw, loss) == pytest.approx((0.5849, 0.1270, 0.2881), abs=1e-4)
    assert sum(ref.outcome(EMPTY, 1, 2, "random", "random", 0.5)) == pytest.approx(1.0)


@pytest.mark.parametrize("opponent", ref.OPPONENTS)
@pytest.mark.parametrize("side", [1, 2])
def test_optimal_players_never_lose(opponent, side):
    for player in ("minimax", "maxwin"):
        assert ref.outcome(EMPTY, 1, side, player, opponent, 0.5)[2] == pytest.approx(0.0, abs=1e-12)
    maxwin = ref.outcome(EMPTY, 1, side, "maxwin", opponent, 0.5)[0]
    assert maxwin >= ref.outcome(EMPTY, 1, side, "minimax", opponent, 0.5)[0] - 1e-12


def test_optimal_moves_match_the_minimax_table():
    from reno_jax.envs.tictactoe import boards as boards_lib
    from reno_jax.envs.tictactoe import minimax

    table = minimax.load_table()
    positions = boards_lib.exhaustive_positions("both")
    rng = np.random.default_rng(0)
    for board in positions[rng.choice(len(positions), 300, replace=False)]:
        to_move = 1 if (board == 1).sum() == (board == 2).sum() else 2
        mine = ref.optimal(tuple(int(v) for v in board), to_move)
        theirs = np.flatnonzero(np.asarray(minimax.optimal_moves(table, board)))
        assert mine == list(theirs), board
