"""Tic-tac-toe rules as pure, jit/vmap-friendly JAX functions.

Board encoding (shared by every module in ``reno_jax.envs``):
  ``board``: ``int8 [9]``, 0 = empty, 1 = X, 2 = O. Index ``i`` is square ``i + 1`` in text, row-major:

      1 2 3        0 1 2
      4 5 6   ->   3 4 5   (array indices)
      7 8 9        6 7 8

Every function here works on ONE position (unbatched); batch with ``jax.vmap``. All functions are branch-free
(``jnp.where`` instead of ``lax.cond``) so that under ``vmap`` nothing is computed twice.

Speed notes: the state also carries each player's stones as a 9-bit integer (``x_bits``, ``o_bits``; bit i =
square index i). ``step`` then needs no reduction over the board: legality is one AND, a win is a lookup in a
512-entry table (``WIN_BY_BITS[bits]``), a full board is ``x_bits | o_bits == 511``, and the int8 board is rebuilt
from the two masks (``board_from_bits``: a shift and a mask per square; a select of the one changed square made XLA
redo the per-game legality and result logic inside the [B, 9] loop, for every square). Functions that take a bare
board (``winner``, ``is_terminal``) build the bit masks as a masked sum of powers of two.
"""

from __future__ import annotations

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

EMPTY = 0
X = 1
O = 2
NUM_SQUARES = 9
NUM_CODES = 3**9  # 19683 base-3 board codes

# The 8 winning lines as index triples [8, 3] (rows, columns, diagonals).
LINES = np.array(
    [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 3, 6], [1, 4, 7], [2, 5, 8], [0, 4, 8], [2, 4, 6]], dtype=np.int32
)
# The same lines as 9-bit masks (bit i = square index i) [8].
LINE_BITS = np.array([sum(1 << int(i) for i in line) for line in LINES], dtype=np.int32)
_BIT_WEIGHTS = np.array([1 << i for i in range(NUM_SQUARES)], dtype=np.int32)  # [9]
FULL_BITS = (1 << NUM_SQUARES) - 1  # 511
# WIN_BY_BITS[m]: the 9-bit stone mask m contains a complete line [512].
WIN_BY_BITS = np.array([any((m & int(line)) == int(line) for line in LINE_BITS) for m in range(1 << NUM_SQUARES)])
_POW3 = np.array([3**i for i in range(NUM_SQUARES)], dtype=np.int32)  # [9]


@flax.struct.dataclass
class GameState:
    """State of one game (batch with ``jax.vmap``; every field then gains a leading ``[B]``).

    Attributes:
      board: ``int8 [9]`` stones (0 empty, 1 X, 2 O).
      to_move: ``int8 []`` player whose turn it is (1 X, 2 O). After an invalid action it stays the offender.
      done: ``bool []`` game over (win, draw or invalid action).
      winner: ``int8 []`` 0 none/draw, 1 X, 2 O. An invalid action does NOT set a winner; see ``invalid``.
      turn: ``int32 []`` number of stones placed so far.
      invalid: ``bool []`` the game ended because ``to_move`` played an out-of-range or occupied square.
      last_move: ``int32 []`` index 0..8 of the last stone placed, -1 before the first move.
      x_bits, o_bits: ``int32 []`` 9-bit masks of X's and O's stones (bit i = index i), kept in sync with
        ``board`` so that ``step`` is reduction-free.
    """

    board: jax.Array
    to_move: jax.Array
    done: jax.Array
    winner: jax.Array
    turn: jax.Array
    invalid: jax.Array
    last_move: jax.Array
    x_bits: jax.Array
    o_bits: jax.Array


def reset() -> GameState:
    """Empty board, X to move."""
    return GameState(
        board=jnp.zeros((NUM_SQUARES,), jnp.int8),
        to_move=jnp.int8(X),
        done=jnp.bool_(False),
        winner=jnp.int8(EMPTY),
        turn=jnp.int32(0),
        invalid=jnp.bool_(False),
        last_move=jnp.int32(-1),
        x_bits=jnp.int32(0),
        o_bits=jnp.int32(0),
    )


def _check_board(board: chex.Array) -> None:
    chex.assert_shape(board, (NUM_SQUARES,))


def player_bits(board: chex.Array, player) -> jax.Array:
    """9-bit mask (``int32 []``) of the squares that hold ``player``'s stones."""
    _check_board(board)
    return jnp.sum(jnp.where(board == player, _BIT_WEIGHTS, 0), dtype=jnp.int32)


def has_line(bits: chex.Array) -> jax.Array:
    """``bool []``: the 9-bit stone mask ``bits`` (``int32 []``, 0..511) contains a complete line."""
    return jnp.asarray(WIN_BY_BITS)[bits]


def winner(board: chex.Array) -> jax.Array:
    """``int8 []``: 1 if X has a line, 2 if O has a line, else 0 (X is reported if both do, which play never makes)."""
    x_line = has_line(player_bits(board, X))
    o_line = has_line(player_bits(board, O))
    return jnp.where(x_line, jnp.int8(X), jnp.where(o_line, jnp.int8(O), jnp.int8(EMPTY)))


def is_full(board: chex.Array) -> jax.Array:
    """``bool []``: no empty square left."""
    _check_board(board)
    return jnp.all(board != EMPTY)


def is_terminal(board: chex.Array) -> jax.Array:
    """``bool []``: someone has a line or the board is full."""
    return (winner(board) != EMPTY) | is_full(board)


def to_move_from_counts(board: chex.Array) -> jax.Array:
    """``int8 []``: player to move inferred from stone counts (X when #X == #O, i.e. X moves first).

    For counts that cannot occur in play, X is to move whenever #X <= #O (AReno's rule), else O.
    """
    _check_board(board)
    n_x = jnp.sum(board == X, dtype=jnp.int32)
    n_o = jnp.sum(board == O, dtype=jnp.int32)
    return jnp.where(n_x <= n_o, jnp.int8(X), jnp.int8(O))


def board_code(board: chex.Array) -> jax.Array:
    """``int32 []`` base-3 code ``sum(board[i] * 3**i)`` in [0, 19683); indexes the minimax table."""
    _check_board(board)
    return jnp.sum(board.astype(jnp.int32) * _POW3, dtype=jnp.int32)


def board_from_bits(x_bits: chex.Array, o_bits: chex.Array) -> jax.Array:
    """``int8 [9]`` board of the two stone masks (``int32 []`` each; disjoint)."""
    shifts = jnp.arange(NUM_SQUARES, dtype=jnp.int32)
    return (((x_bits >> shifts) & 1) | (((o_bits >> shifts) & 1) << 1)).astype(jnp.int8)


def legal_moves(state: GameState) -> jax.Array:
    """``bool [9]``: empty squares, all False once the game is over."""
    _check_board(state.board)
    return (state.board == EMPTY) & ~state.done


def _play(state: GameState, square: jax.Array, play: jax.Array, bad: jax.Array) -> GameState:
    """Shared update: ``play`` places the mover's stone on ``square``; ``bad`` ends the game as invalid."""
    bit = jnp.left_shift(jnp.int32(1), square)
    is_x = state.to_move == X
    x_bits = jnp.where(play & is_x, state.x_bits | bit, state.x_bits)
    o_bits = jnp.where(play & ~is_x, state.o_bits | bit, state.o_bits)
    # Only the mover can have completed a line with this stone.
    won = play & has_line(jnp.where(is_x, x_bits, o_bits))
    full = (x_bits | o_bits) == FULL_BITS
    return GameState(
        board=board_from_bits(x_bits, o_bits),
        to_move=jnp.where(play, jnp.int8(3) - state.to_move, state.to_move).astype(jnp.int8),
        done=state.done | bad | won | (play & full),
        winner=jnp.where(won, state.to_move, state.winner).astype(jnp.int8),
        turn=state.turn + play.astype(jnp.int32),
        invalid=state.invalid | bad,
        last_move=jnp.where(play, square, state.last_move).astype(jnp.int32),
        x_bits=x_bits,
        o_bits=o_bits,
    )


def apply_move(state: GameState, square: chex.Array) -> GameState:
    """Place ``state.to_move``'s stone on array index ``square`` (``int32 []``, 0..8) and update the result.

    Precondition: the move is legal (game not over, square in range and empty); ``step`` checks this. For an
    illegal move the result is unspecified.
    """
    _check_board(state.board)
    square = jnp.asarray(square, jnp.int32)
    chex.assert_shape(square, ())
    return _play(state, jnp.clip(square, 0, NUM_SQUARES - 1), jnp.bool_(True), jnp.bool_(False))


def step(state: GameState, action: chex.Array) -> GameState:
    """One environment step with rule checks (branch-free; no reductions over the board).

    Args:
      state: current ``GameState``.
      action: ``int32 []`` array index 0..8.

    Returns:
      The next state. If the game is already over the state is returned unchanged. An out-of-range or occupied
      ``action`` ends the game with ``invalid=True`` (board unchanged, ``to_move`` = the offender, winner 0).
    """
    _check_board(state.board)
    action = jnp.asarray(action, jnp.int32)
    chex.assert_shape(action, ())
    in_range = (action >= 0) & (action < NUM_SQUARES)
    square = jnp.clip(action, 0, NUM_SQUARES - 1)
    occupied = ((state.x_bits | state.o_bits) >> square) & 1
    legal = in_range & (occupied == 0)
    return _play(state, square, legal & ~state.done, ~legal & ~state.done)


def state_from_board(board: chex.Array) -> GameState:
    """Build a ``GameState`` for an arbitrary position (mover from counts, result from lines)."""
    board = jnp.asarray(board, jnp.int8)
    _check_board(board)
    w = winner(board)
    return GameState(
        board=board,
        to_move=to_move_from_counts(board),
        done=(w != EMPTY) | is_full(board),
        winner=w,
        turn=jnp.sum(board != EMPTY, dtype=jnp.int32),
        invalid=jnp.bool_(False),
        last_move=jnp.int32(-1),
        x_bits=player_bits(board, X),
        o_bits=player_bits(board, O),
    )
