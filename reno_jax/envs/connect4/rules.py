"""Connect Four rules as pure, jit/vmap-friendly JAX functions, and a NumPy reference for the tests.

Board encoding: ``board`` is ``int8 [6, 7]``, 0 = empty, 1 = X (moves first), 2 = O. Row 0 is the TOP row, as the
board is printed; a piece dropped into column ``c`` lands on the lowest empty row. Columns are 0-based here; the
tool and the text use 1..7.

Every function works on ONE position (batch with ``jax.vmap``) and is branch-free (``jnp.where``), so that under
``vmap`` nothing is computed twice and the opponents' search trees (``opponents.py``) can be vmapped over columns.

Why bool masks rather than 64-bit bitboards: JAX runs in 32-bit by default and the 6 x 7 board with a sentinel row
needs 49 bits. Four-in-a-row on a ``bool [6, 7]`` mask is a handful of shifted ANDs (``has_four``) that XLA fuses,
which is fast enough for the negamax trees (a few thousand positions per game) and keeps the code obvious.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

ROWS = 6
COLS = 7
NUM_CELLS = ROWS * COLS
EMPTY = 0
X = 1
O = 2

_ROW_IDS = np.arange(ROWS, dtype=np.int32)[:, None]  # [6, 1]
_COL_IDS = np.arange(COLS, dtype=np.int32)[None, :]  # [1, 7]


@flax.struct.dataclass
class GameState:
    """One game (``jax.vmap`` adds a leading ``[B]`` to every field).

    Attributes:
      board: ``int8 [6, 7]`` pieces, row 0 on top.
      heights: ``int32 [7]`` pieces per column (kept with the board so a drop needs no reduction).
      to_move: ``int8 []`` 1 (X) or 2 (O).
      done: ``bool []`` someone has four in a row or the board is full.
      winner: ``int8 []`` 0 none / draw, else the player with four in a row.
      turn: ``int32 []`` pieces on the board.
      last_column: ``int32 []`` 0-based column of the last drop, -1 before the first.
    """

    board: jax.Array
    heights: jax.Array
    to_move: jax.Array
    done: jax.Array
    winner: jax.Array
    turn: jax.Array
    last_column: jax.Array


def reset() -> GameState:
    """Empty board, X to move."""
    return GameState(
        board=jnp.zeros((ROWS, COLS), jnp.int8),
        heights=jnp.zeros((COLS,), jnp.int32),
        to_move=jnp.int8(X),
        done=jnp.bool_(False),
        winner=jnp.int8(EMPTY),
        turn=jnp.int32(0),
        last_column=jnp.int32(-1),
    )


def has_four(mask: jax.Array) -> jax.Array:
    """``bool []``: the ``bool [6, 7]`` mask holds four in a row horizontally, vertically or diagonally.

    Works on any leading batch shape ``[..., 6, 7]`` (the negamax trees call it on whole levels at once).
    """
    m = mask
    horizontal = m[..., :, 0:4] & m[..., :, 1:5] & m[..., :, 2:6] & m[..., :, 3:7]
    vertical = m[..., 0:3, :] & m[..., 1:4, :] & m[..., 2:5, :] & m[..., 3:6, :]
    # "down-right" from (r, c): (r+i, c+i); "down-left": (r+i, c+3-i).
    diagonal = m[..., 0:3, 0:4] & m[..., 1:4, 1:5] & m[..., 2:5, 2:6] & m[..., 3:6, 3:7]
    anti = m[..., 0:3, 3:7] & m[..., 1:4, 2:6] & m[..., 2:5, 1:5] & m[..., 3:6, 0:4]
    return (
        horizontal.any(axis=(-2, -1))
        | vertical.any(axis=(-2, -1))
        | diagonal.any(axis=(-2, -1))
        | anti.any(axis=(-2, -1))
    )


def drop_cell(heights: jax.Array, column: jax.Array) -> jax.Array:
    """``bool [6, 7]`` one-hot of the cell a piece dropped into ``column`` (0-based) lands on; all False when the
    column is full or out of range."""
    column = jnp.asarray(column, jnp.int32)
    h = heights[jnp.clip(column, 0, COLS - 1)]
    return (_ROW_IDS == ROWS - 1 - h) & (_COL_IDS == column)


def legal_columns(state: GameState) -> jax.Array:
    """``bool [7]``: columns that are not full, all False once the game is over."""
    return (state.heights < ROWS) & ~state.done


def is_legal(state: GameState, column: jax.Array) -> jax.Array:
    """``bool []``: ``column`` (0-based, any int) is in range, not full, and the game is not over."""
    column = jnp.asarray(column, jnp.int32)
    in_range = (column >= 0) & (column < COLS)
    return in_range & legal_columns(state)[jnp.clip(column, 0, COLS - 1)]


def drop(state: GameState, column: jax.Array) -> GameState:
    """``state.to_move`` drops a piece into ``column`` (0-based), then the result is updated.

    An illegal drop (out of range, full column, game over) returns the state unchanged: callers that must punish
    it check ``is_legal`` first (the env does), and the search trees rely on it being a no-op they mask out.
    """
    column = jnp.asarray(column, jnp.int32)
    play = is_legal(state, column)
    cell = drop_cell(state.heights, column) & play
    board = jnp.where(cell, state.to_move, state.board).astype(jnp.int8)
    heights = state.heights + (play & (jnp.arange(COLS) == column)).astype(jnp.int32)
    # Only the mover can have completed a line with this piece.
    won = play & has_four(board == state.to_move)
    full = jnp.all(heights == ROWS)
    return GameState(
        board=board,
        heights=heights,
        to_move=jnp.where(play, jnp.int8(3) - state.to_move, state.to_move).astype(jnp.int8),
        done=state.done | won | (play & full),
        winner=jnp.where(won, state.to_move, state.winner).astype(jnp.int8),
        turn=state.turn + play.astype(jnp.int32),
        last_column=jnp.where(play, column, state.last_column).astype(jnp.int32),
    )


def winner(board: jax.Array) -> jax.Array:
    """``int8 []`` 1 / 2 if that player has four in a row (X if both, which play never makes), else 0."""
    x = has_four(board == X)
    o = has_four(board == O)
    return jnp.where(x, jnp.int8(X), jnp.where(o, jnp.int8(O), jnp.int8(EMPTY)))


def state_from_board(board) -> GameState:
    """A ``GameState`` for an arbitrary position (mover from piece counts: X when #X <= #O, result from lines).

    Assumes gravity holds (no empty cell below a piece); heights are counted per column.
    """
    board = jnp.asarray(board, jnp.int8)
    w = winner(board)
    heights = jnp.sum(board != EMPTY, axis=0, dtype=jnp.int32)
    n_x = jnp.sum(board == X, dtype=jnp.int32)
    n_o = jnp.sum(board == O, dtype=jnp.int32)
    return GameState(
        board=board,
        heights=heights,
        to_move=jnp.where(n_x <= n_o, jnp.int8(X), jnp.int8(O)),
        done=(w != EMPTY) | jnp.all(heights == ROWS),
        winner=w,
        turn=n_x + n_o,
        last_column=jnp.int32(-1),
    )


# ----------------------------------------------------------------------------------------------------------------
# NumPy reference (loops over explicit lines; independent of the shifted-AND code above)
# ----------------------------------------------------------------------------------------------------------------


def np_lines() -> list[list[tuple[int, int]]]:
    """All 69 winning lines as lists of four (row, col) cells."""
    lines = []
    for r in range(ROWS):
        for c in range(COLS):
            for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
                cells = [(r + i * dr, c + i * dc) for i in range(4)]
                if all(0 <= rr < ROWS and 0 <= cc < COLS for rr, cc in cells):
                    lines.append(cells)
    return lines


_NP_LINES = np_lines()


def np_winner(board) -> int:
    b = np.asarray(board)
    for p in (X, O):
        if any(all(b[r, c] == p for r, c in line) for line in _NP_LINES):
            return p
    return EMPTY


def np_legal(board) -> np.ndarray:
    """``bool [7]``: top cell empty and no winner yet, and the board not full."""
    b = np.asarray(board)
    if np_winner(b) != EMPTY:
        return np.zeros(COLS, bool)
    return b[0] == EMPTY


def np_to_move(board) -> int:
    b = np.asarray(board)
    return X if (b == X).sum() <= (b == O).sum() else O


def np_drop(board, column: int, player: int | None = None) -> np.ndarray:
    """A new board with ``player``'s (default: the side to move) piece in ``column``; raises on a full column."""
    b = np.array(board, dtype=np.int8)
    p = np_to_move(b) if player is None else player
    for r in range(ROWS - 1, -1, -1):
        if b[r, column] == EMPTY:
            b[r, column] = p
            return b
    raise ValueError(f"column {column} is full")


def np_random_game(rng: np.random.Generator, max_moves: int | None = None) -> list[np.ndarray]:
    """Boards of one uniformly random game (the empty board first), stopping at the end or after ``max_moves``."""
    b = np.zeros((ROWS, COLS), np.int8)
    boards = [b]
    while np_legal(b).any() and (max_moves is None or len(boards) <= max_moves):
        b = np_drop(b, int(rng.choice(np.flatnonzero(np_legal(b)))))
        boards.append(b)
    return boards
