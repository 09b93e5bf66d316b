"""Sokoban's puzzle board on the play page (`interface.PuzzleView`): the environment's rooms (held-out and train),
moved in with the arrow keys or buttons against the environment's move budget, the breadth-first solver's moves to
solve and shortest-solution moves, and the model asked through the environment's own episode from the room as it
is (`SokobanStart.given`, with the moves already made counted against the budget).

A board is ``int8 [H, W]`` of `wording` cell values (``#_OX*PS``: wall, floor, target, box, box on a target, player,
player on a target), the room's text without its newlines; action k is ``rules.DIRECTIONS[k]``, the teacher's call
row k.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface
from reno_jax.envs.sokoban import env as sokoban_env
from reno_jax.envs.sokoban import rooms, rules, wording

# Per cell value (`wording.CELL_CHARS` order: wall, floor, target, box, box on a target, player, player on a target).
SYMBOLS = ("", "", "\u25cb", "\u25a0", "\u25a0", "\u25cf", "\u25cf")  # ○ target, ■ box, ● player
COLORS = ("", "", "#1e8e4e", "#b9770e", "#1e8e4e", "#2f6fde", "#2f6fde")
FILLS = ("#4a5060", "#fbfcfe", "#e3f4e8", "#fbfcfe", "#e3f4e8", "#fbfcfe", "#e3f4e8")  # targets tinted green
ARROWS = ("\u2191", "\u2193", "\u2190", "\u2192")
KEYS = ("ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight")


def board_of(walls, targets, boxes, player) -> np.ndarray:
    """``int8 [H, W]`` of one room's arrays (``player`` its flat cell)."""
    return wording.np_cell_values(walls, targets, boxes, player)


def room_of(board: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(walls, targets, boxes bool [H, W], player)`` of a board with one player (`check`)."""
    walls, targets, boxes, players = wording.room_of_values(board)
    return walls, targets, boxes, int(players[0])


def check(board: np.ndarray, num_boxes: int) -> None:
    """Raises ValueError (one line) unless `board` is a room of this run's kind: a wall ring, one player, and
    ``num_boxes`` boxes with as many targets."""
    board = np.asarray(board)
    shown = "".join(wording.CELL_CHARS[int(v)] for v in board.reshape(-1))
    ring = np.concatenate([board[0], board[-1], board[1:-1, 0], board[1:-1, -1]])
    if np.any(ring != wording.WALL):
        raise ValueError(f"impossible room {shown!r}: its outer ring (first and last row and column) must be wall (#)")
    _, targets, boxes, players = wording.room_of_values(board)
    if players.size != 1:
        raise ValueError(f"impossible room {shown!r}: it needs one player (P or S), got {players.size}")
    n_boxes, n_targets = int(boxes.sum()), int(targets.sum())
    if n_boxes != num_boxes or n_targets != num_boxes:
        raise ValueError(
            f"impossible room {shown!r}: this run's rooms have {num_boxes} box(es) and as many targets, "
            f"got {n_boxes} box(es) and {n_targets} target(s)"
        )


def apply(board: np.ndarray, action: int) -> np.ndarray:
    """The board after moving ``rules.DIRECTIONS[action]`` (`rules.np_move`, the host twin of the environment's
    `rules.move`); a blocked move gives the same cells."""
    walls, targets, boxes, player = room_of(board)
    cells, player, _ = rules.np_move(walls, tuple(np.flatnonzero(boxes).tolist()), player, int(action))
    after = np.zeros(boxes.size, bool)
    after[list(cells)] = True
    return board_of(walls, targets, after.reshape(boxes.shape), player)


def solved(board: np.ndarray) -> bool:
    """Every box is on a target."""
    _, targets, boxes, _ = wording.room_of_values(board)
    return not bool(np.any(boxes & ~targets))


@functools.lru_cache(maxsize=512)
def _solution(cells: bytes, shape: tuple[int, int]) -> rooms.Solution:
    """`rooms.solve` from the board (its bytes, for the cache: the page asks about one board several times)."""
    return rooms.solve(*room_of(np.frombuffer(cells, np.int8).reshape(shape)))


def _solve(board: np.ndarray) -> tuple[rooms.Solution, tuple]:
    board = np.asarray(board, np.int8)
    _, _, boxes, player = room_of(board)
    return _solution(board.tobytes(), board.shape), (tuple(np.flatnonzero(boxes).tolist()), player)


def moves_to_solve(board: np.ndarray) -> int | None:
    """The fewest moves that solve the room from ``board`` (0: solved), by the breadth-first solver; None when no
    sequence of moves solves it any more (a box pushed into a corner or against a wall away from its target)."""
    solution, position = _solve(board)
    return solution.distance.get(position)


def best_actions(board: np.ndarray) -> list[int]:
    """The moves that bring the room one move closer to solved (every first move of a shortest solution); none on
    a solved board or one that cannot be solved any more."""
    solution, (boxes, player) = _solve(board)
    left = solution.distance.get((boxes, player))
    if not left:
        return []
    walls = room_of(board)[0]
    after = [rules.np_move(walls, boxes, player, d)[:2] for d in range(len(rules.DIRECTIONS))]
    return [d for d, position in enumerate(after) if solution.distance.get(position) == left - 1]


def start(board: np.ndarray, moves: int) -> sokoban_env.SokobanStart:
    """The episode at ``board`` with ``moves`` of the budget made (leading axis 1): a given room
    (`SokobanStart.given`, labelled `GIVEN_ROOM`), its ``optimal`` the solver's moves to solve (-1: none)."""
    walls, targets, boxes, player = room_of(board)
    left = moves_to_solve(board)
    given = sokoban_env.Rooms(
        walls=jnp.asarray(walls)[None],
        targets=jnp.asarray(targets)[None],
        boxes=jnp.asarray(boxes)[None],
        player=jnp.asarray([player], jnp.int32),
        optimal=jnp.asarray([-1 if left is None else left], jnp.int32),
    )
    return sokoban_env.SokobanStart(
        split=jnp.asarray([sokoban_env.TRAIN], jnp.int32),
        room=jnp.asarray([sokoban_env.GIVEN_ROOM], jnp.int32),
        given=given,
        steps=jnp.asarray([moves], jnp.int32),
    )


def puzzle_view(train: rooms.Split, heldout: rooms.Split, num_boxes: int, max_steps: int) -> interface.PuzzleView:
    """The page's view of a run's rooms (``heldout`` first: the page's default suite)."""
    splits = {"heldout": heldout, "train": train}

    def puzzle(suite: str, index: int) -> np.ndarray:
        split = splits[suite]
        return board_of(split.walls[index], split.targets[index], split.boxes[index], split.player[index])

    height, width = heldout.walls.shape[1:]
    return interface.PuzzleView(
        rows=int(height),
        cols=int(width),
        chars="".join(wording.CELL_CHARS),
        symbols=SYMBOLS,
        colors=COLORS,
        fills=FILLS,
        action_labels=rules.DIRECTIONS,
        action_symbols=ARROWS,
        action_keys=KEYS,
        max_moves=int(max_steps),
        apply=apply,
        solved=solved,
        puzzles={name: len(split) for name, split in splits.items()},
        puzzle=puzzle,
        start=start,
        check=functools.partial(check, num_boxes=int(num_boxes)),
        moves_to_solve=moves_to_solve,
        best_actions=best_actions,
    )
