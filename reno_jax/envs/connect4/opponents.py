"""Connect Four opponents: pure, per-position, jit/vmap-friendly; randomness only from the key passed in.

Every policy returns a 0-based column (``int32 []``), or -1 when the game is over (no legal column):

  * ``random_column``: uniform among the legal columns.
  * ``greedy_column``: a column that wins at once if there is one, else one that blocks the other side's immediate
    win, else a uniform legal column (ties broken uniformly).
  * ``negamax_column``: full-width depth-limited negamax (``depth`` plies, static) with a window-count heuristic at
    the leaves; uniform among the best-scoring columns, blocking columns first among those.

Why full width and no alpha-beta: pruning is control flow, and under ``vmap`` (a batch of games, and the columns of
every node) a branch-free search computes every child anyway. The tree is instead built as nested ``vmap``s over
the 7 columns, so one search is one XLA program over ``[7] * depth`` positions (343 at depth 3). Measured for a
vmapped batch of 64 on a shared 2-core CPU (XLA's
default optimisation level): depth 2 ~4 ms (~18k replies/s), depth 3 ~20-30 ms (~2-3k/s), depth 4 ~260 ms
(~250/s); the leaf heuristic and the four-in-a-row tests cost about the same.

Scores are for the side to move, ``int32``: a win on this ply is ``WIN + d`` (``d`` plies left, so faster wins
score higher and faster losses lower), a full board 0, an illegal column ``ILLEGAL``; the heuristic stays far below
``WIN`` in magnitude, so a forced win or loss inside the horizon always beats it.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs.connect4 import rules

RANDOM = 0
GREEDY = 1
NEGAMAX = 2
KINDS = {"random": RANDOM, "greedy": GREEDY, "negamax": NEGAMAX}
KIND_NAMES = ("random", "greedy", "negamax")

WIN = 10_000
ILLEGAL = -(1 << 20)
# Leaf heuristic weights, for the side to move: a window of four cells holding only my pieces and empties scores
# THREE / TWO for three / two of mine; the same for the other side counts against me; each of my pieces in the
# centre column (in the most windows) scores CENTER.
THREE = 5
TWO = 2
CENTER = 3

_ROWS = np.arange(rules.ROWS, dtype=np.int32)[None, :, None]  # [1, 6, 1]
_COLS = np.arange(rules.COLS, dtype=np.int32)[:, None, None]  # [7, 1, 1] (leading axis = the dropped column)
_CELL_COLS = np.arange(rules.COLS, dtype=np.int32)[None, None, :]  # [1, 1, 7]
_EYE = np.eye(rules.COLS, dtype=np.int32)


def kind_id(name: str) -> int:
    """Host: ``"random" | "greedy" | "negamax"`` -> id."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown opponent {name!r}; expected one of {list(KINDS)}") from None


def uniform_choice(key: jax.Array, mask: jax.Array) -> jax.Array:
    """Uniform column among ``mask`` (``bool [7]``), -1 when it is empty: argmax of i.i.d. uniforms restricted to
    the mask is a uniform choice, and needs one PRNG call and no control flow."""
    u = jax.random.uniform(key, (rules.COLS,))
    return jnp.where(mask.any(), jnp.argmax(jnp.where(mask, u, -1.0)), -1).astype(jnp.int32)


def _children(mine: jax.Array, heights: jax.Array):
    """All seven drops of the side to move at once.

    Returns ``(legal bool [7], new_mine bool [7, 6, 7], new_heights int32 [7, 7], won bool [7], full bool [7])``.
    """
    legal = heights < rules.ROWS
    cells = (_ROWS == rules.ROWS - 1 - heights[:, None, None]) & (_CELL_COLS == _COLS)  # [7, 6, 7]
    new_mine = mine[None] | (cells & legal[:, None, None])
    new_heights = heights[None, :] + _EYE * legal[:, None]
    won = legal & rules.has_four(new_mine)
    full = jnp.all(new_heights == rules.ROWS, axis=-1)
    return legal, new_mine, new_heights, won, full


def _side(state: rules.GameState):
    mine = state.board == state.to_move
    theirs = (state.board != rules.EMPTY) & ~mine
    return mine, theirs


def winning_columns(state: rules.GameState) -> jax.Array:
    """``bool [7]``: legal columns where the side to move wins at once."""
    mine, _ = _side(state)
    legal, _, _, won, _ = _children(mine, state.heights)
    return won & legal & ~state.done


def blocking_columns(state: rules.GameState) -> jax.Array:
    """``bool [7]``: legal columns where the OTHER side would win at once (so the side to move must block there)."""
    _, theirs = _side(state)
    legal, _, _, won, _ = _children(theirs, state.heights)
    return won & legal & ~state.done


def random_column(key: jax.Array, state: rules.GameState) -> jax.Array:
    return uniform_choice(key, rules.legal_columns(state))


def greedy_column(key: jax.Array, state: rules.GameState) -> jax.Array:
    legal = rules.legal_columns(state)
    wins = winning_columns(state)
    blocks = blocking_columns(state)
    mask = jnp.where(wins.any(), wins, jnp.where(blocks.any(), blocks, legal))
    return uniform_choice(key, mask)


def heuristic(mine: jax.Array, theirs: jax.Array) -> jax.Array:
    """``int32 []`` static score of a position for the side whose pieces are ``mine`` (``bool [6, 7]`` each)."""
    m = mine.astype(jnp.int32)
    t = theirs.astype(jnp.int32)

    def windows(a):  # piece counts of all 69 windows of four, per direction
        return (
            a[:, 0:4] + a[:, 1:5] + a[:, 2:6] + a[:, 3:7],
            a[0:3, :] + a[1:4, :] + a[2:5, :] + a[3:6, :],
            a[0:3, 0:4] + a[1:4, 1:5] + a[2:5, 2:6] + a[3:6, 3:7],
            a[0:3, 3:7] + a[1:4, 2:6] + a[2:5, 1:5] + a[3:6, 0:4],
        )

    score = CENTER * (jnp.sum(m[:, 3]) - jnp.sum(t[:, 3]))
    for wm, wt in zip(windows(m), windows(t)):
        score += jnp.sum(jnp.where(wt == 0, THREE * (wm == 3) + TWO * (wm == 2), 0))
        score -= jnp.sum(jnp.where(wm == 0, THREE * (wt == 3) + TWO * (wt == 2), 0))
    return score.astype(jnp.int32)


def _scores(mine, theirs, heights, depth: int) -> jax.Array:
    """``int32 [7]`` negamax score of each column for the side to move, ``depth`` >= 1 plies."""
    legal, new_mine, new_heights, won, full = _children(mine, heights)
    if depth == 1:
        rest = jax.vmap(lambda nm: -heuristic(theirs, nm))(new_mine)
    else:
        rest = jax.vmap(lambda nm, nh: -_value(theirs, nm, nh, depth - 1))(new_mine, new_heights)
    # The children of won / full nodes are searched too (branch-free) but their values are discarded here.
    score = jnp.where(won, WIN + depth, jnp.where(full, 0, rest))
    return jnp.where(legal, score, ILLEGAL).astype(jnp.int32)


def _value(mine, theirs, heights, depth: int) -> jax.Array:
    return jnp.max(_scores(mine, theirs, heights, depth))


def negamax_scores(state: rules.GameState, depth: int) -> jax.Array:
    """``int32 [7]`` score of each column for ``state.to_move`` after a ``depth``-ply search (static ``depth``
    >= 1); ``ILLEGAL`` for full columns (every column once the game is over)."""
    if depth < 1:
        raise ValueError(f"negamax depth must be >= 1, got {depth}")
    mine, theirs = _side(state)
    scores = _scores(mine, theirs, state.heights, int(depth))
    return jnp.where(state.done, ILLEGAL, scores)


def negamax_column(key: jax.Array, state: rules.GameState, depth: int) -> jax.Array:
    scores = negamax_scores(state, depth)
    best = (scores == scores.max()) & rules.legal_columns(state)
    # In a lost position every column ties at the same loss, and a plain tie-break would often not even block
    # the immediate threat; blocking anyway keeps the opponent from looking blind to an agent that then misses
    # its own win. (Wins always score above everything, so they need no preference.)
    forced = best & blocking_columns(state)
    return uniform_choice(key, jnp.where(forced.any(), forced, best))


def opponent_column(
    key: jax.Array,
    state: rules.GameState,
    opponent: jax.Array,
    *,
    depth: int = 3,
    kinds: Sequence[int] = (RANDOM, GREEDY, NEGAMAX),
) -> jax.Array:
    """The column (0-based, -1 if none) of opponent ``opponent`` (``int32 []`` id, traced) for ``state.to_move``.

    Only the policies in the static ``kinds`` are computed (under ``vmap`` a switch would run them all anyway, and
    the negamax tree dominates the cost); an id outside ``kinds`` plays ``kinds[0]``.
    """
    kinds = tuple(int(k) for k in kinds)
    if not kinds or any(k not in KINDS.values() for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {list(KINDS.values())}, got {kinds}")
    policies = {
        RANDOM: lambda: random_column(key, state),
        GREEDY: lambda: greedy_column(key, state),
        NEGAMAX: lambda: negamax_column(key, state, depth),
    }
    opponent = jnp.asarray(opponent, jnp.int32)
    column = policies[kinds[0]]()
    for k in kinds[1:]:
        column = jnp.where(opponent == k, policies[k](), column)
    return column


# ----------------------------------------------------------------------------------------------------------------
# NumPy reference (plain recursion over boards with rules.np_*; for the tests)
# ----------------------------------------------------------------------------------------------------------------


def np_heuristic(board, player: int) -> int:
    b = np.asarray(board)
    other = 3 - player
    score = CENTER * (int((b[:, 3] == player).sum()) - int((b[:, 3] == other).sum()))
    for line in rules.np_lines():
        vals = [int(b[r, c]) for r, c in line]
        nm, nt = vals.count(player), vals.count(other)
        if nt == 0:
            score += THREE * (nm == 3) + TWO * (nm == 2)
        if nm == 0:
            score -= THREE * (nt == 3) + TWO * (nt == 2)
    return score


def np_negamax_scores(board, depth: int) -> np.ndarray:
    """Reference for ``negamax_scores`` on a non-terminal board (mover from piece counts)."""
    b = np.asarray(board, np.int8)
    player = rules.np_to_move(b)
    out = np.full(rules.COLS, ILLEGAL, np.int64)
    for c in range(rules.COLS):
        if b[0, c] != rules.EMPTY:
            continue
        child = rules.np_drop(b, c, player)
        if rules.np_winner(child) == player:
            out[c] = WIN + depth
        elif (child != rules.EMPTY).all():
            out[c] = 0
        elif depth == 1:
            out[c] = -np_heuristic(child, 3 - player)
        else:
            out[c] = -np_negamax_scores(child, depth - 1).max()
    return out
