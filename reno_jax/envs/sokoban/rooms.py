"""Sokoban rooms on the host: a seeded generator of rooms that are always solvable, a breadth-first solver, and
the room dataset (a train split and a held-out split, disjoint).

Generator (gym-sokoban's scheme, sized for small rooms): a walled ``H x W`` room whose interior is floor with a
few random inner walls (the floor stays connected); ``num_boxes`` targets on random floor cells, a box on each and
the player next to one (the solved state); then reverse play: ``reverse_steps`` random player moves, each one
pulling the box behind the player along with probability `PULL_PROBABILITY` (the inverse of a push, so every
position the walk reaches can be pushed back to the solved state). The room is the hardest position the walk
passed through (the most moves to solve, as gym-sokoban keeps its walk's best-scored position) whose optimal
solution has at most ``max_moves`` moves and at least ``min_pushes`` pushes; a walk with none is drawn again, and
so is a copy of a room already drawn (walls, targets, boxes and player alike).

Solvers: `layout_distances`, breadth-first backwards from the solved positions over every placement of the player
and the boxes of a layout: the optimal number of moves from each (the generator's measure, and the warm-start
teacher's table, `Split.distance`); `solve`, breadth-first forwards from one room's start (an independent check
that a room is solvable, and its optimal move sequence).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools

import numpy as np

from reno_jax.envs.sokoban import rules

UNSOLVABLE = 255  # `Split.distance` of a position from which the room cannot be solved (a box stuck)
PULL_PROBABILITY = 0.5  # reverse play: the chance a move with a box behind the player pulls it


@dataclasses.dataclass(frozen=True)
class Solution:
    """The solver's answer for one room.

    Attributes:
      moves: the optimal move sequence (directions 0..3) from the start, None when the room has no solution.
      pushes: pushes in ``moves`` (0 when unsolvable).
      distance: ``{(boxes, player): moves to the nearest solved position}`` for every position reachable from the
        start from which a solved position can be reached (``boxes`` the sorted flat cells).
    """

    moves: tuple | None
    pushes: int
    distance: dict


def _moves_to_goal(goals, parents) -> dict:
    """Breadth-first over the reversed move graph (`parents[position]`: the positions one move before it): every
    position that reaches a goal, with its fewest moves to one."""
    distance = {p: 0 for p in goals}
    frontier = collections.deque(goals)
    while frontier:
        position = frontier.popleft()
        for before in parents[position]:
            if before not in distance:
                distance[before] = distance[position] + 1
                frontier.append(before)
    return distance


def solve(walls: np.ndarray, targets: np.ndarray, boxes: np.ndarray, player: int) -> Solution:
    """Breadth-first solver. ``walls``, ``targets``, ``boxes``: ``bool [H, W]``; ``player``: flat cell."""
    walls = np.asarray(walls, bool)
    target_cells = frozenset(np.flatnonzero(np.asarray(targets, bool)).tolist())
    start = (tuple(np.flatnonzero(np.asarray(boxes, bool)).tolist()), int(player))
    seen, frontier, parents = {start}, collections.deque([start]), collections.defaultdict(list)
    while frontier:  # every reachable position, with the reverse edges (position -> the positions leading to it)
        position = frontier.popleft()
        for direction in range(4):
            after_boxes, after_player, _ = rules.np_move(walls, position[0], position[1], direction)
            after = (after_boxes, after_player)
            parents[after].append(position)
            if after not in seen:
                seen.add(after)
                frontier.append(after)
    goals = [p for p in seen if set(p[0]) <= target_cells]
    distance = _moves_to_goal(goals, parents)
    if start not in distance:
        return Solution(moves=None, pushes=0, distance=distance)
    moves, pushes, position = [], 0, start
    while distance[position]:
        for direction in range(4):  # the first direction (in tool order) that gets one move closer
            after_boxes, after_player, pushed = rules.np_move(walls, position[0], position[1], direction)
            if distance.get((after_boxes, after_player), -1) == distance[position] - 1:
                moves.append(direction)
                pushes += int(pushed)
                position = (after_boxes, after_player)
                break
    return Solution(moves=tuple(moves), pushes=pushes, distance=distance)


def _connected(floor: np.ndarray) -> bool:
    cells = list(zip(*np.nonzero(floor)))
    if not cells:
        return False
    seen, stack = {cells[0]}, [cells[0]]
    while stack:
        r, c = stack.pop()
        for dr, dc in rules.DELTAS:
            nxt = (r + dr, c + dc)
            if floor[nxt] and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return len(seen) == len(cells)


class _Mover:
    """`rules.np_move` over one layout, with each cell's neighbours looked up once (the solver's inner loop)."""

    def __init__(self, walls: np.ndarray):
        height, width = walls.shape
        free = ~np.asarray(walls, bool)

        def step(cell, direction):
            r, c = divmod(cell, width)
            r, c = r + int(rules.DELTAS[direction][0]), c + int(rules.DELTAS[direction][1])
            return r * width + c if 0 <= r < height and 0 <= c < width and free[r, c] else None

        self.floor = np.flatnonzero(free.reshape(-1)).tolist()
        self.next = {(cell, d): step(cell, d) for cell in self.floor for d in range(4)}

    def __call__(self, boxes: tuple, player: int, direction: int) -> tuple[tuple, int, bool]:
        one = self.next[(player, direction)]
        if one is None:
            return boxes, player, False
        if one not in boxes:
            return boxes, one, False
        two = self.next[(one, direction)]
        if two is None or two in boxes:
            return boxes, player, False
        return tuple(sorted([b for b in boxes if b != one] + [two])), one, True


def layout_distances(walls: np.ndarray, targets: np.ndarray, num_boxes: int) -> dict:
    """``{(boxes, player): optimal moves to solved}`` for every position of a layout (walls and targets) from which
    it can be solved: breadth-first over every placement of the player and the boxes on the floor, backwards
    from the solved ones."""
    mover = _Mover(walls)
    target_cells = set(np.flatnonzero(np.asarray(targets, bool)).tolist())
    parents = collections.defaultdict(list)
    goals = []
    for boxes in itertools.combinations(mover.floor, num_boxes):
        for player in mover.floor:
            if player in boxes:
                continue
            position = (boxes, player)
            if set(boxes) <= target_cells:
                goals.append(position)
            for direction in range(4):
                after_boxes, after_player, _ = mover(boxes, player, direction)
                if after_player != player:
                    parents[(after_boxes, after_player)].append(position)
    distance = _moves_to_goal(goals, parents)
    return distance


def _pushes(walls: np.ndarray, distance: dict, position: tuple) -> int:
    """Pushes along the optimal path from ``position`` (the first direction, in tool order, that gets closer)."""
    pushes = 0
    while distance[position]:
        for direction in range(4):
            after_boxes, after_player, pushed = rules.np_move(walls, position[0], position[1], direction)
            if distance.get((after_boxes, after_player), -1) == distance[position] - 1:
                pushes += int(pushed)
                position = (after_boxes, after_player)
                break
    return pushes


def _reverse_play(rng: np.random.Generator, walls: np.ndarray, boxes: list, player: int, steps: int) -> list:
    """The positions ``(sorted boxes, player)`` a walk of random pulls from the solved state passes through."""
    width = walls.shape[1]
    walk = []
    for _ in range(steps):
        dr, dc = rules.DELTAS[rng.integers(4)]
        r, c = divmod(player, width)
        ahead, behind = (r + dr) * width + (c + dc), (r - dr) * width + (c - dc)
        if walls[r + dr, c + dc] or ahead in boxes:
            continue
        if behind in boxes and rng.random() < PULL_PROBABILITY:  # pull the box behind the player along
            boxes[boxes.index(behind)] = player
        player = ahead
        walk.append((tuple(sorted(boxes)), player))
    return walk


def generate_room(
    rng: np.random.Generator,
    height: int,
    width: int,
    num_boxes: int,
    *,
    min_pushes: int,
    max_moves: int,
    reverse_steps: int,
    max_inner_walls: int,
):
    """One room (see the module docstring) as ``(walls, targets, boxes, player, distance)`` with ``distance`` the
    layout's `layout_distances`, or None when this draw is rejected (the caller draws again)."""
    walls = np.ones((height, width), bool)
    walls[1:-1, 1:-1] = False
    interior = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
    for k in rng.choice(len(interior), size=rng.integers(0, max_inner_walls + 1), replace=False):
        walls[interior[k]] = True
    floor = np.flatnonzero(~walls.reshape(-1))
    if len(floor) < num_boxes + 2 or not _connected(~walls):
        return None
    target_cells = [int(c) for c in rng.choice(floor, size=num_boxes, replace=False)]
    # the player starts next to a box, so the walk's first moves can pull it
    beside = sorted(
        {int(b + dr * width + dc) for b in target_cells for dr, dc in rules.DELTAS}
        & set(floor.tolist()) - set(target_cells)
    )
    if not beside:
        return None
    targets = np.zeros((height, width), bool)
    targets.reshape(-1)[target_cells] = True
    walk = _reverse_play(rng, walls, list(target_cells), beside[rng.integers(len(beside))], reverse_steps)
    if len({p[0] for p in walk}) < min_pushes + 1:  # fewer pulls than min_pushes: no position of it qualifies
        return None
    distance = layout_distances(walls, targets, num_boxes)
    # the hardest position the walk reached that is within the move budget and needs min_pushes pushes
    candidates = sorted({p for p in walk if 0 < distance[p] <= max_moves}, key=lambda p: (-distance[p], p))
    position = next((p for p in candidates if _pushes(walls, distance, p) >= min_pushes), None)
    if position is None:
        return None
    boxes = np.zeros((height, width), bool)
    boxes.reshape(-1)[list(position[0])] = True
    return walls, targets, boxes, position[1], distance


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of the dataset (host NumPy; N rooms).

    Attributes:
      walls, targets, boxes: ``bool [N, H, W]``; player: ``int32 [N]`` flat cell.
      optimal: ``int32 [N]`` moves of the optimal solution; pushes: ``int32 [N]`` pushes in it.
      distance: ``uint8 [N, K]`` optimal moves to solved from each position key (`rules.position_key`) of the
        room's layout (`layout_distances`), `UNSOLVABLE` where it cannot be solved.
    """

    walls: np.ndarray
    targets: np.ndarray
    boxes: np.ndarray
    player: np.ndarray
    optimal: np.ndarray
    pushes: np.ndarray
    distance: np.ndarray

    def __len__(self) -> int:
        return int(self.player.shape[0])


def _split(rooms: list, num_boxes: int) -> Split:
    height, width = rooms[0][0].shape
    table = np.full((len(rooms), rules.num_position_keys(height, width, num_boxes)), UNSOLVABLE, np.uint8)
    optimal, pushes = [], []
    for i, (walls, _, boxes, player, distance) in enumerate(rooms):
        for (cells, at), moves in distance.items():
            table[i, rules.np_position_key(cells, at, (height, width), num_boxes)] = min(moves, UNSOLVABLE - 1)
        start = (tuple(np.flatnonzero(boxes.reshape(-1)).tolist()), int(player))
        optimal.append(distance[start])
        pushes.append(_pushes(walls, distance, start))
    return Split(
        walls=np.stack([r[0] for r in rooms]),
        targets=np.stack([r[1] for r in rooms]),
        boxes=np.stack([r[2] for r in rooms]),
        player=np.array([r[3] for r in rooms], np.int32),
        optimal=np.array(optimal, np.int32),
        pushes=np.array(pushes, np.int32),
        distance=table,
    )


@functools.lru_cache(maxsize=8)
def build(
    seed: int,
    num_train: int,
    num_heldout: int,
    height: int = 6,
    width: int = 6,
    num_boxes: int = 1,
    min_pushes: int = 2,
    max_moves: int = 10,
    reverse_steps: int | None = None,
    max_inner_walls: int | None = None,
) -> tuple[Split, Split]:
    """``(train, heldout)``: distinct rooms, the held-out ones drawn first (so they do not change with
    ``num_train``), deterministic in the arguments. Cached: every caller of one configuration shares the rooms.

    ``reverse_steps`` default: ``3.4 * (H + W)``, twice gym-sokoban's walk (with its length, most walks in a 6 x 6
    room pull the box fewer than twice and are drawn again); ``max_inner_walls`` default: a fifth of the
    interior."""
    if height < 4 or width < 4:
        raise ValueError(f"a room needs at least 4 x 4 cells with its wall ring, got {height} x {width}")
    if num_train < 1 or num_heldout < 1:
        raise ValueError(f"both splits need rooms, got num_train={num_train}, num_heldout={num_heldout}")
    interior = (height - 2) * (width - 2)
    if not 1 <= num_boxes <= min(4, interior // 3):
        raise ValueError(
            f"num_boxes must be in 1..{min(4, interior // 3)} for a {height} x {width} room, got {num_boxes}"
        )
    steps = int(3.4 * (height + width)) if reverse_steps is None else int(reverse_steps)
    inner_walls = interior // 5 if max_inner_walls is None else int(max_inner_walls)
    rng = np.random.default_rng(seed)
    rooms, seen, draws = [], set(), 0
    wanted = num_heldout + num_train
    while len(rooms) < wanted:
        draws += 1
        if draws > 200 * wanted + 1000:
            raise ValueError(
                f"only {len(rooms)} distinct rooms of {wanted} after {draws} draws: lower the room "
                "counts or min_pushes, or raise max_moves"
            )
        room = generate_room(
            rng,
            height,
            width,
            num_boxes,
            min_pushes=min_pushes,
            max_moves=max_moves,
            reverse_steps=steps,
            max_inner_walls=inner_walls,
        )
        if room is None:
            continue
        key = b"".join(np.asarray(a).tobytes() for a in room[:3]) + int(room[3]).to_bytes(2, "little")
        if key in seen:
            continue
        seen.add(key)
        rooms.append(room)
    return _split(rooms[num_heldout:], num_boxes), _split(rooms[:num_heldout], num_boxes)
