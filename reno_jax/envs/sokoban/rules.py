"""Sokoban's rules, in JAX (traceable, branch-free, per room; `vmap` for batches) and on the host for the room
generator and the solver.

The rules are boxoban's / gym-sokoban's: the player steps up, down, left or right onto a free cell (floor or
target); stepping into a box pushes it one cell on when the cell beyond it is free (no pulling, no pushing two
boxes at once, no pushing into a wall); anything else leaves the room unchanged. The room is solved when every box
is on a target.

A room is ``walls bool [H, W]`` and ``targets bool [H, W]`` (fixed) plus ``boxes bool [H, W]`` and the player's
cell ``int32 []`` (row-major ``r * W + c``), which the moves change. Rooms are enclosed: their outer ring is wall
(gym-sokoban's 6 x 6 ``dim_room`` counts that ring), so the player and the boxes stay on the ``(H-2) x (W-2)``
interior; the moves still treat a step off the grid as a step into a wall.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

UP, DOWN, LEFT, RIGHT = range(4)  # the tool's enum order
DIRECTIONS = ("up", "down", "left", "right")
DELTAS = np.array([(-1, 0), (1, 0), (0, -1), (0, 1)], np.int32)  # (row, column) step of each direction


def move(walls: jax.Array, boxes: jax.Array, player: jax.Array, direction: jax.Array):
    """One move, traced.

    Args:
      walls: ``bool [H, W]``; boxes: ``bool [H, W]``; player: ``int32 []`` flat cell; direction: ``int32 []`` 0..3
        (`DIRECTIONS`; clipped).

    Returns:
      ``(boxes, player, moved, pushed)``: the boxes and the player after the move, ``bool []`` the player moved,
      ``bool []`` it pushed a box.
    """
    height, width = walls.shape
    delta = jnp.asarray(DELTAS)[jnp.clip(direction, 0, 3)]
    here = jnp.stack([player // width, player % width])
    one, two = here + delta, here + 2 * delta  # the cell stepped into, and the one a pushed box lands on

    def inside(rc):
        return (rc[0] >= 0) & (rc[0] < height) & (rc[1] >= 0) & (rc[1] < width)

    def flat(rc):  # clipped into the grid: only read where `inside` says so
        return jnp.clip(rc[0], 0, height - 1) * width + jnp.clip(rc[1], 0, width - 1)

    walls_flat, boxes_flat = walls.reshape(-1), boxes.reshape(-1)
    open_one = inside(one) & ~walls_flat[flat(one)]
    box_one = open_one & boxes_flat[flat(one)]
    free_two = inside(two) & ~walls_flat[flat(two)] & ~boxes_flat[flat(two)]
    pushed = box_one & free_two
    moved = (open_one & ~box_one) | pushed
    after = boxes_flat.at[flat(one)].set(boxes_flat[flat(one)] & ~pushed)
    after = after.at[flat(two)].set(after[flat(two)] | pushed)
    return after.reshape(boxes.shape), jnp.where(moved, flat(one), player).astype(jnp.int32), moved, pushed


def boxes_on_target(boxes: jax.Array, targets: jax.Array) -> jax.Array:
    """``int32 []`` boxes standing on targets."""
    return jnp.sum(boxes & targets).astype(jnp.int32)


def solved(boxes: jax.Array, targets: jax.Array) -> jax.Array:
    """``bool []`` every box is on a target."""
    return ~jnp.any(boxes & ~targets)


def live_cells(walls: jax.Array, targets: jax.Array) -> jax.Array:
    """``bool [H, W]`` the cells from which a box alone in the room could still be pushed onto a target, traced.

    A target is live; a floor cell is live when a push in some direction moves the box onto a live cell, that is
    the cell beyond it that way is live and the cell behind it (where the player stands to push) is not a wall.
    Player reachability and the other boxes are ignored, so the set holds every cell a box can still be solved
    from: a box on a cell outside it can never reach a target (Sokoban's "simple deadlock"), and a room with such a
    box is dead. Computed as the fixed point of that rule: a round adds at least one cell until none is added, so
    ``H * W`` rounds reach it.
    """
    height, width = walls.shape

    def shifted(a, dr, dc, fill):  # shifted(a)[r, c] = a[r + dr, c + dc]
        p = jnp.pad(a, 1, constant_values=fill)
        return jax.lax.dynamic_slice(p, (1 + dr, 1 + dc), (height, width))

    pushable = []  # per direction: the cell behind is open, so a box here can be pushed that way
    for dr, dc in DELTAS.tolist():
        pushable.append(~shifted(walls, -dr, -dc, True))

    def round_(_, live):
        grow = jnp.zeros_like(live)
        for (dr, dc), behind_open in zip(DELTAS.tolist(), pushable):
            grow = grow | (shifted(live, dr, dc, False) & behind_open)
        return live | (grow & ~walls)

    return jax.lax.fori_loop(0, height * width, round_, targets & ~walls)


def dead(walls: jax.Array, targets: jax.Array, boxes: jax.Array) -> jax.Array:
    """``bool []`` some box stands where it can never reach a target (`live_cells`): the room cannot be solved."""
    return jnp.any(boxes & ~live_cells(walls, targets))


# ---------------------------------------------------------------------------------------------- position keys
# A position (the player and the boxes; walls and targets are the room's) is numbered within its room:
# key = player * C(n, k) + rank(boxes), over the n interior cells (row-major, (r - 1) * (W - 2) + (c - 1)), with
# rank the combinatorial number system's index of the k-subset of interior cells holding boxes. Keys are dense in
# 0..n * C(n, k) - 1, so a room's solver table is an array over them.


def num_position_keys(height: int, width: int, num_boxes: int) -> int:
    n = (height - 2) * (width - 2)
    return n * math.comb(n, num_boxes)


def _binomials(n: int, k: int) -> np.ndarray:
    """``int32 [n + 1, k + 1]``: C(i, j)."""
    return np.array([[math.comb(i, j) for j in range(k + 1)] for i in range(n + 1)], np.int32)


def position_key(boxes: jax.Array, player: jax.Array, num_boxes: int) -> jax.Array:
    """``int32 []`` the key of a position (traced; ``num_boxes`` static: the room's box count)."""
    height, width = boxes.shape
    n = (height - 2) * (width - 2)
    interior = boxes[1:-1, 1:-1].reshape(-1)
    order = jnp.cumsum(interior.astype(jnp.int32)) - 1  # the box's place among the boxes, by cell
    binom = jnp.asarray(_binomials(n, num_boxes + 1))
    cells = jnp.arange(n)
    rank = jnp.sum(jnp.where(interior, binom[cells, jnp.clip(order + 1, 0, num_boxes)], 0))
    row, col = player // width, player % width
    inner = (row - 1) * (width - 2) + (col - 1)
    return (inner * math.comb(n, num_boxes) + rank).astype(jnp.int32)


def np_position_key(boxes: tuple, player: int, shape: tuple, num_boxes: int) -> int:
    """`position_key` on the host: ``boxes`` the sorted flat cells of the boxes."""
    height, width = shape
    n = (height - 2) * (width - 2)
    inner = [(b // width - 1) * (width - 2) + (b % width - 1) for b in boxes]
    rank = sum(math.comb(c, i + 1) for i, c in enumerate(sorted(inner)))
    p = (player // width - 1) * (width - 2) + (player % width - 1)
    return p * math.comb(n, num_boxes) + rank


# ---------------------------------------------------------------------------------------------- host rules


def np_move(walls: np.ndarray, boxes: tuple, player: int, direction: int) -> tuple[tuple, int, bool]:
    """`move` on the host over a position ``(boxes: sorted flat cells, player)``: ``(boxes, player, pushed)``."""
    height, width = walls.shape
    dr, dc = DELTAS[direction]
    r, c = divmod(player, width)
    r1, c1, r2, c2 = r + dr, c + dc, r + 2 * dr, c + 2 * dc
    if not (0 <= r1 < height and 0 <= c1 < width) or walls[r1, c1]:
        return boxes, player, False
    one = r1 * width + c1
    if one not in boxes:
        return boxes, one, False
    two = r2 * width + c2
    if not (0 <= r2 < height and 0 <= c2 < width) or walls[r2, c2] or two in boxes:
        return boxes, player, False
    return tuple(sorted([b for b in boxes if b != one] + [two])), one, True
