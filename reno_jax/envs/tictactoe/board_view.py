"""Tic-tac-toe's board on the play page (`interface.BoardView`): a 3 x 3 grid a person clicks, X and O, the
minimax-optimal squares starred, and the model asked through the move task (one `choose_square` call).

Boards are ``int8 [3, 3]`` (the env's ``[9]`` row by row); action k is square k + 1, the teacher's call row k.
"""

from __future__ import annotations

import numpy as np

from reno_jax.envs import interface
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.envs.tictactoe import minimax
from reno_jax.envs.tictactoe import rules as ttt

_SIDE_OF_SETTING = {"x": ttt.X, "o": ttt.O}


def has_line(board: np.ndarray, player: int) -> bool:
    return bool(np.any(np.all(np.asarray(board).reshape(-1)[ttt.LINES] == player, axis=1)))


def check(board: np.ndarray) -> None:
    """Raises ValueError unless a game where X opens reaches `board`: #X is #O or #O + 1, at most one side has a
    line, and the side with a line made the last move."""
    cells = np.asarray(board).reshape(-1)
    n_x, n_o = int((cells == ttt.X).sum()), int((cells == ttt.O).sum())
    shown = "".join(".xo"[int(v)] for v in cells)
    if n_x not in (n_o, n_o + 1):
        raise ValueError(f"impossible board {shown!r}: X opens, so #X must be #O or #O + 1 (got {n_x} X, {n_o} O)")
    x_line, o_line = has_line(cells, ttt.X), has_line(cells, ttt.O)
    if x_line and o_line:
        raise ValueError(f"impossible board {shown!r}: both X and O have a line")
    if x_line and n_x != n_o + 1:
        raise ValueError(f"impossible board {shown!r}: X has a line, so X moved last (#X = #O + 1)")
    if o_line and n_x != n_o:
        raise ValueError(f"impossible board {shown!r}: O has a line, so O moved last (#X = #O)")


def to_move(board: np.ndarray) -> int:
    """1 (X) or 2 (O), from stone counts (the rollout's rule)."""
    cells = np.asarray(board)
    return ttt.X if int((cells == ttt.X).sum()) <= int((cells == ttt.O).sum()) else ttt.O


def legal(board: np.ndarray) -> np.ndarray:
    cells = np.asarray(board).reshape(-1)
    return (cells == ttt.EMPTY) & (result(board) == interface.ONGOING)


def apply(board: np.ndarray, action: int) -> np.ndarray:
    out = np.array(board, np.int8)
    out.reshape(-1)[int(action)] = to_move(board)
    return out


def result(board: np.ndarray) -> int:
    for side in (ttt.X, ttt.O):
        if has_line(board, side):
            return side
    return interface.DRAW if bool(np.all(np.asarray(board) != ttt.EMPTY)) else interface.ONGOING


def decision_start(board: np.ndarray) -> ttt_env.Starts:
    """The move task on `board` (the model plays the side to move)."""
    return ttt_env.move_starts(np.asarray(board, np.int8).reshape(1, ttt.NUM_SQUARES))


def optimal_squares(board: np.ndarray) -> list[int]:
    """The value-preserving actions (0-based squares) of perfect play on `board`."""
    code = int((np.asarray(board, np.int64).reshape(-1) * 3 ** np.arange(ttt.NUM_SQUARES)).sum())
    return [int(i) for i in np.flatnonzero(minimax.tables_numpy()["optimal_mask"][code])]


def trained_side(env_config) -> int | None:
    """The side the run's model learned to play: the move task plays the side to move of its boards (X for
    `board_sides="x"`), the game task its `agent_player`; None when it played both."""
    if str(env_config.get("task", "move")) == "move":
        return ttt.X if str(env_config.get("board_sides", "x")) == "x" else None
    return _SIDE_OF_SETTING.get(str(env_config.get("agent_player", "x")))


def board_view(config) -> interface.BoardView:
    return interface.BoardView(
        rows=3,
        cols=3,
        input="cell",
        chars=".xo",
        symbols=("", "X", "O"),
        colors=("", "#2f6fde", "#d35400"),
        sides=("X", "O"),
        to_move=to_move,
        legal=legal,
        apply=apply,
        result=result,
        decision_start=decision_start,
        decision_overrides={"task": "move"},
        check=check,
        best_actions=optimal_squares,
        trained_side=trained_side(config.env),
    )
