"""Connect Four text: the system prompt, the ``drop_piece`` tool, the message templates as parts (literal strings
and ``Slot``s), the values vector that fills them, and host renderers for debugging.

Board text: the six rows top to bottom, one character per cell with no separator, then a line of column numbers::

    ..X....
    ..O....
    ..X....
    ..OO...
    ..XX...
    .OXX.O.
    12-4567

With ``mark_playable`` (`Connect4Env.mark_playable`) the empty cell each column's next piece lands on is printed
``*``; the board above then reads::

    ..X....
    ..O....
    ..X*...
    ..OO...
    .*XX.*.
    *OXX*O*
    12-4567

Where a drop lands is written on the board instead of being worked out from the column's stack, so "this drop
makes four" is a pattern around a ``*`` (``OOO*`` in a row, ``*`` over ``OOO`` eight tokens apart, ...). It is what a
person sees on a physical board, not advice: no threat is named.

The number line names the columns that can still be played; a full column's number is replaced by ``-``. The
policy answers with a column number, and this line, the last thing before its turn, holds exactly the legal
numbers, in line with their columns. With a plain ``1234567`` header above the rows, knowing whether a column was
full meant attending to its top cell or to a header ~50 tokens back, and the tiny model dropped into full columns
in 10-13% of its games against a random opponent (docs/benchmarks.md).

Every cell is its own ``Slot`` with options ``(".", "X", "O")``, so the compiler tokenizes each cell as one token
(the shipped 512-token BPE has single tokens for ".", "X", "O"), and the number line's digits are single tokens too, so
a column's number and its cells line up by position. Separating the cells with spaces would read closer to
the usual ``". X O . . . ."`` but costs a token per separator (84 instead of 48 board tokens): the tool response
would be ~100 tokens instead of ~68, every turn, for 21 turns.

With ``echo`` (`Connect4Env.echo_board`) every board prints its six rows twice before the number line. A causal
model reads a cell with only the cells above and to its left in view, so at a landing cell the pieces below it
and to its right (half of the lines a four runs along) are not yet there; in the second copy every neighbour of a
cell is in the first copy, at a fixed distance back. It costs 48 tokens per board.

Caveat for host-side tokenization: tokenizing a whole board text at once merges runs of dots (``".."`` is a token
of the shipped tokenizer), so ``apply_chat_template(..., tokenize=True)`` gives FEWER ids than the in-jit renderer,
which tokenizes slot by slot; the decoded text is identical. Transcripts and rollouts both go through the renderer,
so the policy always sees the per-cell form.

Wording reuses phrases the shipped tokenizer already has single tokens for (``"Opponent played "``, ``"You won."``,
``"You lost."``, ``"You are "``), which keeps the per-turn response short.

Tool templates are indexed by the step's outcome (``TOOL_*`` == ``env.OUTCOME_*``): only ``TOOL_ONGOING`` continues
the conversation; the others end it (they matter for transcripts and evaluation display).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs.connect4 import rules
from reno_jax.protocol.chat import ChatSpec, Parts, Slot, resolve

TOOL_NAME = "drop_piece"

# Tool templates (== env.OUTCOME_* for the ones that exist as outcomes).
TOOL_ONGOING = 0
TOOL_WIN = 1
TOOL_DRAW = 2
TOOL_LOSS = 3
TOOL_INVALID = 4
TOOL_ILLEGAL = 5
NUM_TOOL_TEMPLATES = 6
TOOL_NAMES = ("ongoing", "win", "draw", "loss", "invalid", "illegal")
USER_GAME = 0  # the only user template

# Values vector layout (int32 [NUM_VALUES]).
V_CELL0 = 0  # 0..41: cells row-major from the top left (0 empty, 1 X, 2 O, 3 empty and playable when marked)
V_SIDE = rules.NUM_CELLS  # 42: the agent's side (0 X, 1 O)
V_OPPONENT = V_SIDE + 1  # 43: the opponent's latest column 1..7, 0 when it did not move
V_COLUMN = V_SIDE + 2  # 44: the agent's column 1..7 (the illegal-move message names it)
V_OPEN0 = V_SIDE + 3  # 45..51: 1 where the column still has an empty square (the number line shows it)
NUM_VALUES = V_OPEN0 + rules.COLS

SYSTEM_PROMPT = (
    "You play Connect Four. Columns are numbered 1-7 from the left; a piece falls to the lowest empty square. "
    "Four in a row, column or diagonal wins. Use drop_piece on a column that is not full."
)
CELL_OPTIONS = (".", "X", "O", "*")  # "*": an empty cell a piece would land on (`mark_playable`)
PLAYABLE = 3  # the value of a marked cell
SIDE_OPTIONS = ("X", "O")
FULL_COLUMN_MARK = "-"
OPPONENT_OPTIONS = ("",) + tuple(f"Opponent played {c + 1}.\n" for c in range(rules.COLS))
COLUMN_OPTIONS = tuple(str(c) for c in range(rules.COLS + 1))  # 0 is never shown (only illegal names a column)
WIN_TEXT = "\nYou won."
DRAW_TEXT = "\nDraw."
LOSS_TEXT = "\nYou lost."
INVALID_TEXT = "Invalid call. You lost."
FULL_TEXT = " is full. You lost."


def tool_schema() -> dict:
    """The ``drop_piece`` tool in the OpenAI/HF ``tools=`` format."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Drop a piece.",
            "parameters": {
                "type": "object",
                "properties": {"column": {"type": "integer", "minimum": 1, "maximum": rules.COLS}},
                "required": ["column"],
            },
        },
    }


def board_parts(echo: bool = False) -> Parts:
    """The rows top to bottom, then the number line; ``echo``: the rows twice (see the module docstring)."""
    parts: list = []
    for r in list(range(rules.ROWS)) * (2 if echo else 1):
        for c in range(rules.COLS):
            parts.append(Slot(V_CELL0 + r * rules.COLS + c, CELL_OPTIONS))
        parts.append("\n")
    parts += [Slot(V_OPEN0 + c, (FULL_COLUMN_MARK, str(c + 1))) for c in range(rules.COLS)]
    return tuple(parts)


def user_parts(echo: bool = False) -> Parts:
    return ("You are ", Slot(V_SIDE, SIDE_OPTIONS), ".\n", Slot(V_OPPONENT, OPPONENT_OPTIONS), *board_parts(echo))


def tool_parts(template: int, echo: bool = False) -> Parts:
    opponent = Slot(V_OPPONENT, OPPONENT_OPTIONS)
    if template == TOOL_ONGOING:
        return (opponent, *board_parts(echo))
    if template == TOOL_WIN:
        return (*board_parts(echo), WIN_TEXT)
    if template == TOOL_DRAW:  # after the agent's move (no opponent line) or after the opponent's reply
        return (opponent, *board_parts(echo), DRAW_TEXT)
    if template == TOOL_LOSS:
        return (opponent, *board_parts(echo), LOSS_TEXT)
    if template == TOOL_INVALID:
        return (INVALID_TEXT,)
    if template == TOOL_ILLEGAL:
        return ("Column ", Slot(V_COLUMN, COLUMN_OPTIONS), FULL_TEXT)
    raise ValueError(f"tool template must be in 0..{NUM_TOOL_TEMPLATES - 1} ({TOOL_NAMES}), got {template}")


def chat_spec(echo: bool = False) -> ChatSpec:
    """The game's texts; ``echo`` (`Connect4Env.echo_board`): every board prints its rows twice."""
    return ChatSpec(
        system=SYSTEM_PROMPT,
        tools=(tool_schema(),),
        user=(user_parts(echo),),
        tool=tuple(tool_parts(t, echo) for t in range(NUM_TOOL_TEMPLATES)),
        tool_continues=tuple(t == TOOL_ONGOING for t in range(NUM_TOOL_TEMPLATES)),
        num_values=NUM_VALUES,
        tool_name=TOOL_NAME,
    )


def playable_cells(board):
    """``bool [6, 7]``: the empty cells a piece dropped in their column lands on (the bottom row, or above a piece);
    works on numpy and jax arrays alike."""
    xp = jnp if isinstance(board, jax.Array) else np
    empty = board == rules.EMPTY
    below = xp.concatenate([board[1:] != rules.EMPTY, xp.ones((1, rules.COLS), bool)], axis=0)
    return empty & below


def message_values(board, agent_player=1, opponent_column=0, agent_column=0, mark_playable=False) -> jax.Array:
    """``int32 [NUM_VALUES]`` (traceable, per episode).

    Args:
      board: ``int8 [6, 7]`` (0 empty, 1 X, 2 O).
      agent_player: ``[]`` 1 (X) or 2 (O).
      opponent_column: ``[]`` the opponent's latest column 1..7, 0 for none.
      agent_column: ``[]`` the agent's column 1..7 (shown by the illegal-move message), 0 for none.
      mark_playable: static; print the cell each column's next piece lands on as ``*`` instead of ``.``.
    """
    board = jnp.asarray(board)
    if board.shape != (rules.ROWS, rules.COLS):
        raise ValueError(f"board must have shape [6, 7], got {board.shape}")
    tail = jnp.stack(
        [
            jnp.clip(jnp.asarray(agent_player, jnp.int32) - 1, 0, 1),
            jnp.clip(jnp.asarray(opponent_column, jnp.int32), 0, rules.COLS),
            jnp.clip(jnp.asarray(agent_column, jnp.int32), 0, rules.COLS),
        ]
    )
    open_columns = (board[0] == 0).astype(jnp.int32)
    cells = board.astype(jnp.int32)
    if mark_playable:
        cells = jnp.where(playable_cells(board), PLAYABLE, cells)
    return jnp.concatenate([cells.reshape(-1), tail, open_columns])


# ----------------------------------------------------------------------------------------------------------------
# Host helpers (debugging, tests, transcripts shown to people)
# ----------------------------------------------------------------------------------------------------------------


def host_values(
    board=None, agent_player: int = 1, opponent_column: int = 0, agent_column: int = 0, mark_playable: bool = False
) -> list[int]:
    b = np.zeros((rules.ROWS, rules.COLS), np.int64) if board is None else np.asarray(board)
    if b.shape != (rules.ROWS, rules.COLS) or not np.isin(b, (0, 1, 2)).all():
        raise ValueError(f"board must be int [6, 7] with values 0 (empty), 1 (X), 2 (O); got {b!r}")
    if agent_player not in (1, 2):
        raise ValueError(f"agent_player must be 1 (X) or 2 (O), got {agent_player}")
    for name, col in (("opponent_column", opponent_column), ("agent_column", agent_column)):
        if not 0 <= int(col) <= rules.COLS:
            raise ValueError(f"{name} must be 0 (none) or 1..7, got {col}")
    cells = np.where(playable_cells(b), PLAYABLE, b) if mark_playable else b
    return (
        [int(v) for v in cells.reshape(-1)]
        + [int(agent_player) - 1, int(opponent_column), int(agent_column)]
        + [int(v == 0) for v in b[0]]
    )


def render_board(board, mark_playable: bool = False) -> str:
    """The board text (six rows and the number line) of an ``int [6, 7]`` board."""
    return resolve(board_parts(), host_values(board, mark_playable=mark_playable))


def user_text(values: Sequence[int], template: int = USER_GAME, echo: bool = False) -> str:
    return resolve(chat_spec(echo).user[template], values)


def tool_text(values: Sequence[int], template: int, echo: bool = False) -> str:
    return resolve(chat_spec(echo).tool[template], values)


def messages(values: Sequence[int], echo: bool = False) -> list[dict]:
    """System + first user message as chat dicts (``values`` from ``reset``'s message)."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_text(values, echo=echo)}]


def tool_message(values: Sequence[int], template: int, echo: bool = False) -> dict:
    return {"role": "tool", "name": TOOL_NAME, "content": tool_text(values, template, echo)}


def assistant_call(column: int, content: str = "") -> dict:
    """An assistant chat dict that calls ``drop_piece(column)`` (1-based), for host transcripts."""
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"column": int(column)}}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}
