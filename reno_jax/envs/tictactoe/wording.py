"""Prompt wording for the tic-tac-toe tool-calling tasks, on top of `reno_jax.protocol.chat`.

The text has one source of truth: the templates of `chat_spec()` (literal strings and `chat.Slot`s over the
message values ``[cell 0..8 (0 empty, 1 X, 2 O), side (0 X, 1 O), opponent square (0 none, 1..9)]``, see
`message_values`). The host functions resolve them into plain chat messages; `build_text_spec` compiles them
with the tokenizer's chat template and `render_prompt` / `render_tool_response` render them in jit.

Wording (our own, in the spirit of AReno): a system message that explains the game and the ``choose_square``
tool, a user message with the side and the board as three rows, and tool responses that report the opponent's
reply and the new board, or the end of the game. Two board styles (``BOARD_STYLES``):

* ``"grid"``: ``"X | 2 | O\\n4 | X | 6\\n7 | 8 | 9"``: a stone replaces its square's number (AReno's look);
* ``"labeled"``: ``"1X | 2 | 3O\\n4 | 5X | 6\\n7 | 8 | 9"``: every square keeps its number and a stone follows it.
  A stone's square is then spelled next to it, within reach of the KDA layers' short convolution, instead of
  having to be counted out from the separators before it; and since a square, once taken, stays taken, the
  latest board of a game is what every board of the conversation says about each square (docs/benchmarks.md).

Conversation layout for the game task (what the rollout builds token by token)::

    render_prompt(...)            system + user turns + assistant header
    <policy tokens>               e.g. <think>...</think><tool_call>{...}</tool_call><|im_end|>
    render_tool_response(...)     [turn end if the policy did not emit it] + tool turn + next assistant header
    <policy tokens> ...

Status codes equal ``tasks.OUTCOME_*`` so a ``GameTaskState.outcome`` can be passed straight in; they are also
the tool template indices.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.protocol import chat

NUM_SQUARES = 9
TOOL_NAME = "choose_square"

# Tool-response statuses (== reno_jax.envs.tictactoe.tasks.OUTCOME_*).
STATUS_ONGOING = 0  # the opponent replied; the game goes on (next assistant header follows)
STATUS_WIN = 1  # the agent's move won
STATUS_DRAW = 2  # board full (after the agent's move or the opponent's reply)
STATUS_LOSS = 3  # the opponent's reply won
STATUS_INVALID = 4  # no call / malformed call / square out of 1..9
STATUS_ILLEGAL = 5  # well-formed call on an occupied square
NUM_STATUSES = 6
STATUS_NAMES = ("ongoing", "win", "draw", "loss", "invalid", "illegal")

# Message values (int32 [NUM_VALUES]).
VALUE_CELL0 = 0  # 0..8: board cells (0 empty, 1 X, 2 O)
VALUE_SIDE = 9  # agent_player - 1 (0 X, 1 O)
VALUE_OPPONENT = 10  # opponent's reply square 0..9 (0: no reply)
NUM_VALUES = 11

# User templates.
USER_MOVE = 0
USER_GAME = 1

SYSTEM_PROMPT = (
    "You play tic-tac-toe. Squares are numbered 1-9 row by row from the top left. "
    "Use choose_square to mark an empty square."
)
_MOVE_INTRO = "You are "
_GAME_INTRO = "New game. The opponent replies through the tool. You are "
_SIDE_NAMES = ("X", "O")
_CELL_MARKS = ("X", "O")
_OPPONENT_LINE = "Opponent played {}.\n"
_STATUS_TAILS = {
    STATUS_ONGOING: "",
    STATUS_WIN: "\nYou won.",
    STATUS_DRAW: "\nDraw.",
    STATUS_LOSS: "\nYou lost.",
}
_INVALID_TEXT = "Invalid call. You lost."
_ILLEGAL_TEXT = "That square is taken. You lost."

TextSpec = chat.ChatTables  # what `build_text_spec` returns (the name callers annotate with)


BOARD_STYLES = ("grid", "labeled")


def check_board_style(style: str) -> str:
    if style not in BOARD_STYLES:
        raise ValueError(f"board style must be one of {BOARD_STYLES}, got {style!r}")
    return style


def _board_parts(style: str = "grid") -> tuple:
    check_board_style(style)
    parts = []
    for i in range(NUM_SQUARES):
        marks = _CELL_MARKS if style == "grid" else tuple(f"{i + 1}{m}" for m in _CELL_MARKS)
        parts.append(chat.Slot(VALUE_CELL0 + i, (str(i + 1),) + marks))
        if i % 3 < 2:
            parts.append(" | ")
        elif i < NUM_SQUARES - 1:
            parts.append("\n")
    return tuple(parts)


def _user_parts(game: bool, style: str = "grid") -> tuple:
    return (_GAME_INTRO if game else _MOVE_INTRO, chat.Slot(VALUE_SIDE, _SIDE_NAMES), ".\n", *_board_parts(style))


def _tool_parts(status: int, style: str = "grid") -> tuple:
    if status in (STATUS_INVALID, STATUS_ILLEGAL):
        return (_INVALID_TEXT if status == STATUS_INVALID else _ILLEGAL_TEXT,)
    opponent = chat.Slot(VALUE_OPPONENT, ("",) + tuple(_OPPONENT_LINE.format(k) for k in range(1, 10)))
    return (opponent, *_board_parts(style), _STATUS_TAILS[status])


def tool_schema() -> dict:
    """The ``choose_square`` tool in the OpenAI/HF ``tools=`` format."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Mark an empty square.",
            "parameters": {
                "type": "object",
                "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["square"],
            },
        },
    }


@functools.cache
def chat_spec(style: str = "grid") -> chat.ChatSpec:
    """The tic-tac-toe `ChatSpec` in board style `style`: user templates ``[USER_MOVE, USER_GAME]``, tool templates
    per ``STATUS_*``."""
    return chat.ChatSpec(
        system=SYSTEM_PROMPT,
        tools=(tool_schema(),),
        user=(_user_parts(False, style), _user_parts(True, style)),
        tool=tuple(_tool_parts(s, style) for s in range(NUM_STATUSES)),
        tool_continues=tuple(s == STATUS_ONGOING for s in range(NUM_STATUSES)),
        num_values=NUM_VALUES,
        tool_name=TOOL_NAME,
    )


# ----------------------------------------------------------------------------------------------------------------
# Host API
# ----------------------------------------------------------------------------------------------------------------


def _check_board_host(board) -> np.ndarray:
    b = np.asarray(board)
    if b.shape != (NUM_SQUARES,) or not np.isin(b, (0, 1, 2)).all():
        raise ValueError(f"board must be int [9] with values 0 (empty), 1 (X), 2 (O); got {b!r}")
    return b


def _host_values(board, agent_player: int = 1, opponent_square: int = 0) -> list[int]:
    if agent_player not in (1, 2):
        raise ValueError(f"agent_player must be 1 (X) or 2 (O), got {agent_player}")
    if not 0 <= int(opponent_square) <= 9:
        raise ValueError(f"opponent_square must be 0 (none) or 1..9, got {opponent_square}")
    return [int(v) for v in _check_board_host(board)] + [int(agent_player) - 1, int(opponent_square)]


def side_to_move(board) -> int:
    """1 (X) or 2 (O) from stone counts: X when #X <= #O (same rule as ``tictactoe.to_move_from_counts``)."""
    b = _check_board_host(board)
    return 1 if int((b == 1).sum()) <= int((b == 2).sum()) else 2


def render_board(board, style: str = "grid") -> str:
    """``"X | 2 | O\\n4 | X | 6\\n7 | 8 | 9"`` (``"1X | 2 | 3O\\n4 | 5X | 6\\n7 | 8 | 9"`` labeled) for an
    ``int [9]`` board (0 empty, 1 X, 2 O)."""
    return chat.resolve(_board_parts(style), _host_values(board))


def move_task_messages(board, agent_player: int | None = None, style: str = "grid") -> list[dict]:
    """System + user messages of the move task; ``agent_player`` defaults to the side to move."""
    side = side_to_move(board) if agent_player is None else int(agent_player)
    return chat.user_messages(chat_spec(style), (USER_MOVE, _host_values(board, side)))


def game_task_messages(board, agent_player: int, style: str = "grid") -> list[dict]:
    """System + user messages that open a game (the agent plays ``agent_player``; ``board`` has the opening)."""
    return chat.user_messages(chat_spec(style), (USER_GAME, _host_values(board, agent_player)))


def _tool(board, opponent_square: int, status: int) -> tuple[int, list[int]]:
    if status not in range(NUM_STATUSES):
        raise ValueError(f"status must be in 0..{NUM_STATUSES - 1} ({STATUS_NAMES}), got {status}")
    return int(status), _host_values(board, 1, opponent_square)


def tool_response_content(board, opponent_square: int, status: int, style: str = "grid") -> str:
    """Text of the tool turn after the agent's call (``board`` is the position after the opponent's reply)."""
    return tool_message(board, opponent_square, status, style)["content"]


def tool_message(board, opponent_square: int, status: int, style: str = "grid") -> dict:
    return chat.tool_message(chat_spec(style), _tool(board, opponent_square, status))


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template's text for ``messages`` with the ``choose_square`` tool (the messages carry their board
    style in their text; the system prompt and tools are the same for every style)."""
    return chat.chat_text(tokenizer, chat_spec(), messages, add_generation_prompt)


def prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Host prompt token ids via ``apply_chat_template(..., tools=[tool_schema()], tokenize=True)``."""
    return chat.prompt_ids(tokenizer, chat_spec(), messages, add_generation_prompt)


def tool_response_text(
    tokenizer,
    board,
    opponent_square: int,
    status: int,
    add_turn_end: bool = False,
    chat_template=None,
    style: str = "grid",
) -> str:
    """Host reference for ``render_tool_response``: the template text after an assistant message's content,
    minus the turn-end marker unless ``add_turn_end``."""
    message = _tool(board, opponent_square, status)
    return chat.tool_text(tokenizer, chat_spec(style), message, add_turn_end=add_turn_end, chat_template=chat_template)


# ----------------------------------------------------------------------------------------------------------------
# In-jit rendering
# ----------------------------------------------------------------------------------------------------------------


def build_text_spec(
    tokenizer, chat_template: str | None = None, max_stencil_rows: int = 4096, style: str = "grid"
) -> TextSpec:
    """`chat.compile_chat` of `chat_spec(style)` (the shipped tokenizer needs 84 stencil rows for grid tool
    responses, 2 for prompts; ``max_stencil_rows=0`` forces the general path)."""
    return chat.compile_chat(tokenizer, chat_spec(style), chat_template, max_stencil_rows)


def _value_list(board, agent_player: Any = 1, opponent_square: Any = 0) -> list:
    """The message values as scalars; the cells stay as they are (the renderer clips them), the side and the
    opponent square are clipped here, two-sided (a side below 1 reads as X, a negative square as none)."""
    board = jnp.asarray(board)
    if board.shape != (NUM_SQUARES,):
        raise ValueError(f"board must have shape [9], got {board.shape}")
    side = jnp.clip(jnp.asarray(agent_player, jnp.int32) - 1, 0, 1)
    opponent = jnp.clip(jnp.asarray(opponent_square, jnp.int32), 0, 9)
    return [*(board[i] for i in range(NUM_SQUARES)), side, opponent]


def message_values(board, agent_player: Any = 1, opponent_square: Any = 0) -> jax.Array:
    """``int32 [NUM_VALUES]`` message values (jit/vmap friendly): the cells, the side ``agent_player - 1`` and the
    opponent square (the last two clipped into range here, the cells by the renderer)."""
    return jnp.stack([v.astype(jnp.int32) for v in _value_list(board, agent_player, opponent_square)])


def render_prompt(spec: TextSpec, board: jax.Array, agent_player: jax.Array, game: Any = False):
    """Initial prompt ids (jit/vmap friendly).

    Args:
      spec: ``TextSpec``.
      board: ``int8 [9]``.
      agent_player: ``[]`` 1 (X) or 2 (O): the side the agent plays.
      game: ``bool []`` (Python or traced): game-task wording (opponent replies through the tool) instead of the
        move task.

    Returns:
      ``(ids int32 [spec.prompt_len], length int32 [])``; ids past ``length`` are ``spec.pad_id``.
    """
    template = (jnp.asarray(game) != 0).astype(jnp.int32)
    return chat.render_user(spec, (template, _value_list(board, agent_player)))


def render_tool_response(
    spec: TextSpec, board: jax.Array, opponent_square: jax.Array, status: jax.Array, add_turn_end: Any = False
):
    """Tokens appended after the policy's tool call (jit/vmap friendly).

    The text is the rest of the assistant turn after its turn-end marker (``"\\n"`` for the shipped template),
    the tool turn (opponent's reply line when ``opponent_square > 0``, the board, and the result for finished
    games), then the next assistant header when ``status == STATUS_ONGOING``.

    Args:
      spec: ``TextSpec``.
      board: ``int8 [9]`` position after the opponent's reply.
      opponent_square: ``int32 []`` 1..9, or 0 when the opponent did not move.
      status: ``int32 []`` ``STATUS_*`` (== ``tasks.OUTCOME_*``), clipped into range.
      add_turn_end: ``bool []``: prepend the turn-end marker (use when the policy stopped without emitting it,
        e.g. on the token budget or on a different stop token).

    Returns:
      ``(ids int32 [spec.response_len], length int32 [])``.
    """
    return chat.render_tool(spec, (status, _value_list(board, 1, opponent_square)), add_turn_end)
