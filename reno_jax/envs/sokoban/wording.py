"""Sokoban text: the system prompt, the ``move`` tool, the message templates and the values that fill them.

A room prints row by row from the top, one character per cell and a newline between rows::

    ######
    #_O__#
    #_X#_#
    #_P__#
    #____#
    ######

``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``*`` box on a target, ``P`` the player, ``S`` the player on a
target (the verl-agent / RAGEN text rendering, with ``*`` for their ``√``: every one of these characters is a
single token of the shipped tokenizer, ``√`` three). Every cell is its own `Slot`, so each is one token and a
cell's neighbours above and below sit a fixed W + 1 tokens away.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs.sokoban import rules
from reno_jax.protocol.chat import ChatSpec, Slot

TOOL_NAME = "move"
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = range(7)
CELL_CHARS = ("#", "_", "O", "X", "*", "P", "S")

# Tool templates: what the answer to a move says.
TOOL_MOVED, TOOL_BLOCKED, TOOL_SOLVED, TOOL_OUT_OF_MOVES, TOOL_INVALID = range(5)
TOOL_STUCK, TOOL_DEAD = 5, 6  # the early ends (`chat_spec(early_ends=True)`)
USER_ROOM = 0
# What a move would do (the moves line, `outcome_parts`).
MOVE_OUTCOMES = ("open", "push", "blocked")
OUTCOME_OPEN, OUTCOME_PUSH, OUTCOME_BLOCKED = range(3)


def tool_schema() -> dict:
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Move one cell; walking into a box pushes it.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string", "enum": list(rules.DIRECTIONS)}},
                "required": ["direction"],
            },
        },
    }


def board_parts(height: int, width: int) -> tuple:
    """The room's parts: a `Slot` per cell (value ``r * width + c``), rows separated by newlines."""
    parts = []
    for r in range(height):
        parts.extend(Slot(r * width + c, CELL_CHARS) for c in range(width))
        if r + 1 < height:
            parts.append("\n")
    return tuple(parts)


def coordinate_parts(height: int, width: int, num_boxes: int) -> tuple:
    """The positions line after the room (`chat_spec`'s ``coordinates``): the player's, each box's and each
    target's row and column, 0-based from the top left, boxes and targets in row-major order::

        You 4,2 box 3,2 target 3,4

    Values ``H * W`` on: player row, column, then each box's, then each target's (`cell_values`)."""
    n, numbers = height * width, tuple(str(i) for i in range(max(height, width)))
    parts = ["\nYou ", Slot(n, numbers), ",", Slot(n + 1, numbers)]
    for name, first in (("box", n + 2), ("target", n + 2 + 2 * num_boxes)):
        for k in range(num_boxes):
            parts += [f" {name} ", Slot(first + 2 * k, numbers), ",", Slot(first + 2 * k + 1, numbers)]
    return tuple(parts)


def outcome_parts(first: int) -> tuple:
    """The moves line after the room and its positions line (`chat_spec`'s ``move_outcomes``): what each move
    (tool order) would do from here, `MOVE_OUTCOMES`: ``open`` walks, ``push`` pushes a box, ``blocked`` leaves
    the room as it is (a wall, or a box that cannot move)::

        Moves: up open, down blocked, left push, right open

    Values ``first`` on, one per direction (`cell_values`)."""
    parts = ["\nMoves:"]
    for k, direction in enumerate(rules.DIRECTIONS):
        parts += [f"{',' if k else ''} {direction} ", Slot(first + k, MOVE_OUTCOMES)]
    return tuple(parts)


def num_values(height: int, width: int, coordinates: int = 0, move_outcomes: bool = False) -> int:
    """Values of a message: a cell's each, with `coordinates` boxes two per position (player, boxes, targets),
    with `move_outcomes` one per direction."""
    return (
        height * width + (2 + 4 * coordinates if coordinates else 0) + (len(rules.DIRECTIONS) if move_outcomes else 0)
    )


def chat_spec(
    height: int,
    width: int,
    max_steps: int,
    coordinates: int = 0,
    early_ends: bool = False,
    move_outcomes: bool = False,
) -> ChatSpec:
    """The chat; ``coordinates`` > 0 (the number of boxes): every room is followed by its positions line
    (`coordinate_parts`), so where the player, the boxes and the targets stand is spelt out as numbers beside
    the grid a model would otherwise have to count through. ``move_outcomes``: then the moves line
    (`outcome_parts`), which moves walk, push or are blocked. ``early_ends``: the tool's two answers that end an
    episode early (`SokobanEnv.end_on_blocked`, ``end_when_dead``) follow the others (`TOOL_STUCK`, `TOOL_DEAD`)."""
    board = board_parts(height, width)
    if coordinates:
        board = board + coordinate_parts(height, width, coordinates)
    if move_outcomes:
        board = board + outcome_parts(num_values(height, width, coordinates))
    system = (
        "Sokoban: push every box onto a target. # wall, _ floor, O target, X box, * box on a target, P you, "
        "S you on a target. Walking into a box pushes it if the cell beyond is free. Call move with up, down, "
        f"left or right; {max_steps} moves at most."
    )
    return ChatSpec(
        system=system,
        tools=(tool_schema(),),
        user=(("Room:\n", *board),),
        tool=(
            board,
            ("You did not move.\n", *board),
            (*board, "\nSolved!"),
            (*board, "\nOut of moves."),
            ("Invalid call.",),
        )
        + (
            (("You did not move.\n", *board, "\nStuck."), (*board, "\nThe box can no longer reach a target."))
            if early_ends
            else ()
        ),
        tool_continues=(True, True, False, False, False) + ((False, False) if early_ends else ()),
        num_values=num_values(height, width, coordinates, move_outcomes),
    )


def cell_values(
    walls: jax.Array,
    targets: jax.Array,
    boxes: jax.Array,
    player: jax.Array,
    coordinates: int = 0,
    move_outcomes: bool = False,
) -> jax.Array:
    """``int32 [H * W]``: each cell's character (`CELL_CHARS` index), row-major; traced. With `coordinates` (the
    number of boxes) the positions line's values follow (`coordinate_parts`), with `move_outcomes` the moves
    line's (`outcome_parts`): ``int32 [num_values]``."""
    height, width = walls.shape
    if coordinates or move_outcomes:
        parts = [cell_values(walls, targets, boxes, player)]
        if coordinates:
            box_cells = jnp.nonzero(boxes.reshape(-1), size=coordinates, fill_value=0)[0]
            target_cells = jnp.nonzero(targets.reshape(-1), size=coordinates, fill_value=0)[0]
            flat = jnp.concatenate([jnp.reshape(player, (1,)), box_cells, target_cells]).astype(jnp.int32)
            parts.append(jnp.stack([flat // width, flat % width], axis=1).reshape(-1))
        if move_outcomes:
            parts.append(jax.vmap(lambda d: _outcome(walls, boxes, player, d))(jnp.arange(len(rules.DIRECTIONS))))
        return jnp.concatenate([p.astype(jnp.int32) for p in parts])
    is_player = jnp.arange(height * width) == player
    walls, targets, boxes = walls.reshape(-1), targets.reshape(-1), boxes.reshape(-1)
    return jnp.select(
        [walls, is_player & targets, is_player, boxes & targets, boxes, targets],
        [WALL, PLAYER_ON_TARGET, PLAYER, BOX_ON_TARGET, BOX, TARGET],
        FLOOR,
    ).astype(jnp.int32)


def _outcome(walls: jax.Array, boxes: jax.Array, player: jax.Array, direction: jax.Array) -> jax.Array:
    """``int32 []``: what `direction` would do from here, a `MOVE_OUTCOMES` index (`rules.move`)."""
    _, _, moved, pushed = rules.move(walls, boxes, player, direction)
    return jnp.where(moved, jnp.where(pushed, OUTCOME_PUSH, OUTCOME_OPEN), OUTCOME_BLOCKED).astype(jnp.int32)


def np_cell_values(walls, targets, boxes, player) -> np.ndarray:
    """Host: ``int8 [H, W]`` each cell's character (`CELL_CHARS` index) of one room (NumPy or JAX arrays;
    `cell_values` in NumPy, shaped as the room)."""
    shape = np.shape(walls)
    walls, targets, boxes = (np.asarray(a, bool).reshape(-1) for a in (walls, targets, boxes))
    is_player = np.arange(walls.size) == int(player)
    values = np.select(
        [walls, is_player & targets, is_player, boxes & targets, boxes, targets],
        [WALL, PLAYER_ON_TARGET, PLAYER, BOX_ON_TARGET, BOX, TARGET],
        FLOOR,
    )
    return values.reshape(shape).astype(np.int8)


def room_of_values(values: np.ndarray):
    """Host: ``(walls, targets, boxes, players)`` of a room's cell values (`np_cell_values`' inverse): ``bool [H, W]``
    arrays and ``players`` the flat cells holding a player (one in a well-formed room)."""
    values = np.asarray(values)
    walls = values == WALL
    targets = np.isin(values, (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET))
    boxes = np.isin(values, (BOX, BOX_ON_TARGET))
    players = np.flatnonzero(np.isin(values, (PLAYER, PLAYER_ON_TARGET)).reshape(-1))
    return walls, targets, boxes, players


def room_text(walls, targets, boxes, player) -> str:
    """Host: the room as the messages print it (one room's arrays, NumPy or JAX)."""
    values = np_cell_values(walls, targets, boxes, player)
    return "\n".join("".join(CELL_CHARS[v] for v in row) for row in values)


def parse_room(text: str):
    """Host: ``(walls, targets, boxes, player)`` of a room's text (`room_text`'s inverse; NumPy)."""
    rows = text.strip("\n").split("\n")
    walls, targets, boxes, players = room_of_values([[CELL_CHARS.index(ch) for ch in row] for row in rows])
    if players.size != 1:
        raise ValueError(f"a room has one player (P or S), got {players.size}")
    return walls, targets, boxes, int(players[0])
