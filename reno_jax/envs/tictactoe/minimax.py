"""Perfect-play (minimax) tables for tic-tac-toe over all 3**9 board codes.

The tables are indexed by ``tictactoe.board_code(board) = sum(board[i] * 3**i)``:

  * ``value [19683] int8``: game-theoretic value for the player to move (+1 win, 0 draw, -1 loss) under perfect
    play by both sides. Terminal positions: -1 if the opponent has a line, +1 if only the mover has one, else 0.
  * ``optimal_mask [19683, 9] bool``: legal moves whose resulting position keeps ``value`` (no preference for
    faster wins: AReno's ``best_moves`` counts every value-preserving move as best).
  * ``winning_mask [19683, 9] bool``: legal moves that complete a line for the mover at once.
  * ``seeking_mask [19683, 9] bool``: the value-preserving moves that also give a uniformly random opponent the
    most chances to go wrong: they maximise the expected outcome against random replies when the mover keeps
    choosing this way. Perfect play with these tie-breaks never loses and wins 0.995 (X) / 0.916 (O) of games
    against a random opponent; ties broken at random win 0.968 / 0.777.

The player to move is inferred from stone counts: X when #X <= #O, else O (so X moves when #X == #O in play).
Codes that cannot arise in play get values too (computed by the same recursion), they are simply never looked up.
Legal moves are the empty squares of NON-terminal positions; terminal positions have empty masks.

The tables are computed once in NumPy, level by level from full boards down to the empty board (each level only
needs the one with one more stone), which takes well under a second. The result is memoised in memory and, by
default, stored as an ``.npz`` in a user cache directory (``$RENO_JAX_CACHE_DIR``, else
``$XDG_CACHE_HOME/reno_jax``, else ``~/.cache/reno_jax``). A missing, stale or unreadable cache file is simply
recomputed; nothing here touches the network.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs.tictactoe import rules as ttt

_CACHE_VERSION = 2
_CACHE_NAME = f"tictactoe_minimax_v{_CACHE_VERSION}.npz"


@flax.struct.dataclass
class MinimaxTable:
    """Minimax table as a pytree of device arrays (pass it into jitted functions as an argument).

    Attributes:
      value: ``int8 [19683]`` value for the player to move.
      optimal_mask: ``bool [19683, 9]`` value-preserving legal moves.
      winning_mask: ``bool [19683, 9]`` legal moves that win immediately.
      seeking_mask: ``bool [19683, 9]`` value-preserving moves that are best against a random opponent.
    """

    value: jax.Array
    optimal_mask: jax.Array
    winning_mask: jax.Array
    seeking_mask: jax.Array


# ----------------------------------------------------------------------------------------------------------------
# NumPy computation
# ----------------------------------------------------------------------------------------------------------------


def all_boards_numpy() -> np.ndarray:
    """``int8 [19683, 9]``: the board for every code (row ``c`` decodes code ``c``)."""
    codes = np.arange(ttt.NUM_CODES, dtype=np.int32)
    return ((codes[:, None] // ttt._POW3[None, :]) % 3).astype(np.int8)


def _lines_numpy(boards: np.ndarray, player: int) -> np.ndarray:
    """``bool [N]``: each board has a complete line of ``player``."""
    bits = ((boards == player).astype(np.int32) * ttt._BIT_WEIGHTS).sum(-1)
    return ((bits[:, None] & ttt.LINE_BITS[None, :]) == ttt.LINE_BITS[None, :]).any(-1)


def compute_tables_numpy() -> dict[str, np.ndarray]:
    """Compute ``value``, ``optimal_mask``, ``winning_mask`` and ``seeking_mask`` (module docstring) with NumPy."""
    boards = all_boards_numpy()  # [N, 9]
    n_x = (boards == ttt.X).sum(-1)
    n_o = (boards == ttt.O).sum(-1)
    mover = np.where(n_x <= n_o, ttt.X, ttt.O).astype(np.int8)  # [N]
    x_line = _lines_numpy(boards, ttt.X)
    o_line = _lines_numpy(boards, ttt.O)
    mover_line = np.where(mover == ttt.X, x_line, o_line)
    opp_line = np.where(mover == ttt.X, o_line, x_line)
    empty = boards == ttt.EMPTY  # [N, 9]
    full = ~empty.any(-1)
    terminal = x_line | o_line | full
    legal = empty & ~terminal[:, None]  # [N, 9]

    codes = np.arange(ttt.NUM_CODES, dtype=np.int64)
    # child[c, i] = code after the mover plays square i (only meaningful where legal).
    child = codes[:, None] + mover.astype(np.int64)[:, None] * ttt._POW3[None, :].astype(np.int64)
    child = np.where(legal, child, 0)

    value = np.zeros(ttt.NUM_CODES, np.int8)
    value[terminal] = np.where(opp_line, -1, np.where(mover_line, 1, 0))[terminal]
    # child_value[c, i] = value of the child from the point of view of c's mover (children of consistent
    # positions are always the other player's turn; for impossible count patterns the mover can repeat).
    child_value = np.full((ttt.NUM_CODES, ttt.NUM_SQUARES), -2, np.int8)  # -2 = "not a legal move"
    pieces = n_x + n_o
    for level in range(ttt.NUM_SQUARES - 1, -1, -1):  # 9-stone boards are all terminal
        rows = np.nonzero((pieces == level) & ~terminal)[0]
        if rows.size == 0:
            continue
        kids = child[rows]  # [R, 9]
        same = mover[kids] == mover[rows][:, None]
        kid_value = np.where(same, value[kids], -value[kids]).astype(np.int8)
        kid_value = np.where(legal[rows], kid_value, np.int8(-2))
        child_value[rows] = kid_value
        value[rows] = kid_value.max(-1)

    optimal_mask = legal & (child_value == value[:, None])
    kid_mover_line = np.where(mover[:, None] == ttt.X, x_line[child], o_line[child])
    winning_mask = legal & kid_mover_line

    # Expected outcome for the player to move, against uniformly random replies: `seek` when that player chooses
    # among its value-preserving moves the one with the best expectation, `random` when it moves at random. Same
    # level order and sign convention as `value`.
    seek = value.astype(np.float64)
    random = value.astype(np.float64)
    seeking_mask = np.zeros_like(optimal_mask)
    for level in range(ttt.NUM_SQUARES - 1, -1, -1):
        rows = np.nonzero((pieces == level) & ~terminal)[0]
        if rows.size == 0:
            continue
        kids = child[rows]
        sign = np.where(mover[kids] == mover[rows][:, None], 1.0, -1.0)
        after_seek = sign * random[kids]  # the mover seeks, then the random side replies
        after_random = sign * seek[kids]
        best = np.where(optimal_mask[rows], after_seek, -np.inf).max(-1)
        seek[rows] = best
        random[rows] = np.where(legal[rows], after_random, 0.0).sum(-1) / legal[rows].sum(-1)
        # Mirror-image moves tie up to rounding; real differences are >= 1/192 in reachable positions.
        seeking_mask[rows] = optimal_mask[rows] & (after_seek >= best[:, None] - 1e-9)
    return {"value": value, "optimal_mask": optimal_mask, "winning_mask": winning_mask, "seeking_mask": seeking_mask}


def _default_cache_dir() -> Path:
    env = os.environ.get("RENO_JAX_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "reno_jax"


def _valid_arrays(arrays: dict[str, np.ndarray]) -> bool:
    try:
        return (
            arrays["value"].shape == (ttt.NUM_CODES,)
            and arrays["value"].dtype == np.int8
            and arrays["optimal_mask"].shape == (ttt.NUM_CODES, ttt.NUM_SQUARES)
            and arrays["optimal_mask"].dtype == np.bool_
            and arrays["winning_mask"].shape == (ttt.NUM_CODES, ttt.NUM_SQUARES)
            and arrays["winning_mask"].dtype == np.bool_
            and arrays["seeking_mask"].shape == (ttt.NUM_CODES, ttt.NUM_SQUARES)
            and arrays["seeking_mask"].dtype == np.bool_
            and not (arrays["seeking_mask"] & ~arrays["optimal_mask"]).any()
            # The empty board is a draw and every one of its 9 moves keeps the draw.
            and int(arrays["value"][0]) == 0
            and bool(arrays["optimal_mask"][0].all())
        )
    except (KeyError, AttributeError):
        return False


_TABLE_NAMES = ("value", "optimal_mask", "winning_mask", "seeking_mask")


def _load_cache(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: np.array(data[k]) for k in _TABLE_NAMES}
    except (OSError, KeyError, ValueError):
        return None
    return arrays if _valid_arrays(arrays) else None


def _save_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Atomic write (temp file + rename) so concurrent first uses never see a half-written file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)
    except OSError:
        # A read-only home or full disk only costs the (sub-second) recomputation next time.
        pass


@functools.lru_cache(maxsize=None)
def tables_numpy(use_disk_cache: bool = True) -> dict[str, np.ndarray]:
    """The tables as read-only NumPy arrays, computed (or read from the disk cache) once per process."""
    arrays = None
    path = _default_cache_dir() / _CACHE_NAME
    if use_disk_cache:
        arrays = _load_cache(path)
    if arrays is None:
        arrays = compute_tables_numpy()
        if use_disk_cache:
            _save_cache(path, arrays)
    for a in arrays.values():
        a.setflags(write=False)
    return arrays


@functools.lru_cache(maxsize=None)
def load_table(use_disk_cache: bool = True) -> MinimaxTable:
    """The table as a ``MinimaxTable`` of jnp arrays (cached).

    Pass it into jitted functions as an argument: closing over it makes it a compile-time constant, and XLA's
    constant folding of a 19683 x 9 table makes compilation slow.
    """
    arrays = tables_numpy(use_disk_cache)
    return MinimaxTable(
        value=jnp.asarray(arrays["value"]),
        optimal_mask=jnp.asarray(arrays["optimal_mask"]),
        winning_mask=jnp.asarray(arrays["winning_mask"]),
        seeking_mask=jnp.asarray(arrays["seeking_mask"]),
    )


# ----------------------------------------------------------------------------------------------------------------
# Lookups inside jit (one position; vmap for batches)
# ----------------------------------------------------------------------------------------------------------------


def position_value(table: MinimaxTable, board: chex.Array) -> jax.Array:
    """``int8 []`` value of ``board [9]`` for its player to move."""
    return table.value[ttt.board_code(board)]


def optimal_moves(table: MinimaxTable, board: chex.Array) -> jax.Array:
    """``bool [9]`` value-preserving legal moves of ``board [9]``."""
    return table.optimal_mask[ttt.board_code(board)]


def winning_moves(table: MinimaxTable, board: chex.Array) -> jax.Array:
    """``bool [9]`` legal moves of ``board [9]`` that win immediately."""
    return table.winning_mask[ttt.board_code(board)]


def seeking_moves(table: MinimaxTable, board: chex.Array) -> jax.Array:
    """``bool [9]`` value-preserving moves of ``board [9]`` that are best against a random opponent."""
    return table.seeking_mask[ttt.board_code(board)]
