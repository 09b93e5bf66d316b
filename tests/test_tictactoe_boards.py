"""reno_jax.envs.tictactoe.boards: the training boards a config's `env` section asks for, and the exhaustive
evaluation positions."""

import numpy as np

from configs import tictactoe_tiny
from reno_jax.envs.tictactoe import boards as boards_lib


def test_load_boards_max_random_moves():
    c = tictactoe_tiny.get_config()
    c.env.num_boards = 300
    stones = lambda b: (np.asarray(b) != 0).sum(1)
    c.env.max_random_moves = 6  # AReno's generator
    assert stones(boards_lib.load_boards(c.env)[0]).max() == 6
    c.env.max_random_moves = 8
    boards, _ = boards_lib.load_boards(c.env)
    assert boards.shape == (300, 9) and (stones(boards) == 8).any()


def test_load_boards_both_sides():
    c = tictactoe_tiny.get_config()
    c.env.num_boards = 600
    c.env.board_sides = "both"
    boards, _ = boards_lib.load_boards(c.env)
    stones = (boards != 0).sum(1)
    assert boards.shape == (600, 9) and set(stones % 2) == {0, 1}  # X and O to move
    assert not any(boards_lib.np_is_terminal(b) for b in boards)
    assert len({b.tobytes() for b in boards}) == 600
    c.env.board_sides = "x"
    assert set((boards_lib.load_boards(c.env)[0] != 0).sum(1) % 2) == {0}
    o_boards = boards_lib.exhaustive_positions("o")
    assert len(o_boards) == 2097 and np.all((o_boards == 1).sum(1) == (o_boards == 2).sum(1) + 1)
    assert len(boards_lib.exhaustive_positions("both")) == 2423 + 2097
    assert len(boards_lib.exhaustive_positions("x")) == 2423
