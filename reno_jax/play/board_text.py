"""Boards as the page and the API write them: 9 characters, row by row from the top left, `x`, `o` or `.`.

Square numbers in the API are the tool's (1..9); board index i is square i + 1, as in `reno_jax.envs`.
"""

from __future__ import annotations

import numpy as np

from reno_jax.envs.tictactoe import rules as ttt

_CHAR_TO_CELL = {".": ttt.EMPTY, "x": ttt.X, "o": ttt.O}
_CELL_TO_CHAR = {v: k for k, v in _CHAR_TO_CELL.items()}
EMPTY_BOARD = "." * ttt.NUM_SQUARES


class BoardError(ValueError):
    """A board string that is malformed or cannot arise in a game (its message says which)."""


def parse_board(text: str) -> np.ndarray:
    """`int8 [9]` board of a 9-character string; raises `BoardError` for a malformed or impossible board.

    Possible means: reachable in a game where X opens, i.e. #X is #O or #O + 1, at most one side has a line,
    and the side with a line made the last move (X's line needs #X = #O + 1, O's line #X = #O).
    """
    if not isinstance(text, str) or len(text) != ttt.NUM_SQUARES:
        raise BoardError(f"a board is 9 characters of x, o or '.', got {text!r}")
    lowered = text.lower()
    bad = sorted({c for c in lowered if c not in _CHAR_TO_CELL})
    if bad:
        raise BoardError(f"a board is 9 characters of x, o or '.'; {text!r} has {''.join(bad)!r}")
    board = np.array([_CHAR_TO_CELL[c] for c in lowered], np.int8)
    n_x, n_o = int((board == ttt.X).sum()), int((board == ttt.O).sum())
    if n_x not in (n_o, n_o + 1):
        raise BoardError(f"impossible board {text!r}: X opens, so #X must be #O or #O + 1 (got {n_x} X, {n_o} O)")
    x_line, o_line = has_line(board, ttt.X), has_line(board, ttt.O)
    if x_line and o_line:
        raise BoardError(f"impossible board {text!r}: both X and O have a line")
    if x_line and n_x != n_o + 1:
        raise BoardError(f"impossible board {text!r}: X has a line, so X moved last (#X = #O + 1)")
    if o_line and n_x != n_o:
        raise BoardError(f"impossible board {text!r}: O has a line, so O moved last (#X = #O)")
    return board


def format_board(board) -> str:
    return "".join(_CELL_TO_CHAR[int(v)] for v in np.asarray(board).reshape(-1))


def has_line(board: np.ndarray, player: int) -> bool:
    return bool(np.any(np.all(np.asarray(board)[ttt.LINES] == player, axis=1)))


def side_to_move(board: np.ndarray) -> int:
    """1 (X) or 2 (O), from stone counts (the rollout's rule)."""
    return ttt.X if int((board == ttt.X).sum()) <= int((board == ttt.O).sum()) else ttt.O


def result(board: np.ndarray) -> str:
    """"x_won", "o_won", "draw" or "ongoing" for a possible board."""
    if has_line(board, ttt.X):
        return "x_won"
    if has_line(board, ttt.O):
        return "o_won"
    return "draw" if bool(np.all(board != ttt.EMPTY)) else "ongoing"
