"""Connect Four's board on the play page (`interface.BoardView`): 6 x 7, a person drops a piece in a column, X
red and O yellow, and the model asked for one move at the position (`env.position_starts`, ``single_move``).

Boards are ``int8 [6, 7]``, row 0 on top (as `rules` and the prompt print them); action c is column c + 1, the
teacher's call row c.
"""

from __future__ import annotations

import numpy as np

from reno_jax.envs import interface
from reno_jax.envs.connect4 import env as c4_env
from reno_jax.envs.connect4 import rules


def _has_four(board: np.ndarray, player: int) -> bool:
    return any(all(board[r, c] == player for r, c in line) for line in rules.np_lines())


def check(board: np.ndarray) -> None:
    """Raises ValueError unless a game where X opens reaches `board`: pieces rest on pieces, #X is #O or #O + 1,
    at most one side has four, and the side with four made the last move."""
    b = np.asarray(board)
    floating = (b[:-1] != rules.EMPTY) & (b[1:] == rules.EMPTY)
    if floating.any():
        column = int(np.argwhere(floating)[0][1]) + 1
        raise ValueError(f"impossible board: a piece floats above an empty cell in column {column}")
    n_x, n_o = int((b == rules.X).sum()), int((b == rules.O).sum())
    if n_x not in (n_o, n_o + 1):
        raise ValueError(f"impossible board: X opens, so #X must be #O or #O + 1 (got {n_x} X, {n_o} O)")
    x_four, o_four = _has_four(b, rules.X), _has_four(b, rules.O)
    if x_four and o_four:
        raise ValueError("impossible board: both X and O have four in a row")
    if (x_four and n_x != n_o + 1) or (o_four and n_x != n_o):
        raise ValueError("impossible board: the side with four in a row must have moved last")


def result(board: np.ndarray) -> int:
    winner = rules.np_winner(board)
    if winner != rules.EMPTY:
        return int(winner)
    return interface.DRAW if bool(np.all(np.asarray(board) != rules.EMPTY)) else interface.ONGOING


def apply(board: np.ndarray, action: int) -> np.ndarray:
    return rules.np_drop(board, int(action))


def forced_columns(board: np.ndarray) -> list[int]:
    """The columns that win at once for the side to move, else those that stop the opponent's immediate win
    (0-based); none when neither exists (the page stars only moves that are clearly best)."""
    me = rules.np_to_move(board)
    legal = np.flatnonzero(rules.np_legal(board))
    wins = [int(c) for c in legal if rules.np_winner(rules.np_drop(board, c, me)) == me]
    if wins:
        return wins
    return [int(c) for c in legal if rules.np_winner(rules.np_drop(board, c, 3 - me)) == 3 - me]


def board_view(config) -> interface.BoardView:
    side = config.env.get("agent_player", "alternate")
    return interface.BoardView(
        rows=rules.ROWS,
        cols=rules.COLS,
        input="column",
        chars=".xo",
        symbols=("", "\u25cf", "\u25cf"),
        colors=("", "#d62d20", "#e6a800"),
        sides=("X", "O"),
        to_move=rules.np_to_move,
        legal=rules.np_legal,
        apply=apply,
        result=result,
        decision_start=lambda board: c4_env.position_starts(np.asarray(board)[None]),
        decision_overrides={"single_move": True, "opponent": "random"},
        check=check,
        best_actions=forced_columns,
        trained_side=int(side) if str(side) in ("1", "2") else None,
    )
