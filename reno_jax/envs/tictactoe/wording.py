"""Prompt wording for the tic-tac-toe tool-calling tasks, host rendering, and in-jit token rendering.

The text side has one source of truth: the *parts* below (``_move_user_parts`` etc.), lists of literal strings
and ``_Slot``s. A slot is a variable piece with a finite set of options (a cell shows ``"7"``, ``"X"`` or ``"O"``;
the side line shows ``"X"`` or ``"O"``; the opponent line is empty or ``"Opponent played k.\\n"``), picked by an
integer from a small *source vector* (board cells, agent side, opponent square, ...).

* Host: ``render_board``, ``move_task_messages``, ``game_task_messages``, ``tool_message`` resolve the slots with
  real values and give plain chat messages; ``prompt_ids`` / ``chat_text`` apply the tokenizer's chat template.
* Jit: ``build_text_spec(tokenizer)`` renders the tokenizer's OWN chat template once with placeholder strings in
  the slots, splits the result into literal pieces and slots, and tokenizes every literal piece and every slot
  option separately. ``render_prompt`` / ``render_tool_response`` then concatenate pre-tokenized pieces in jit
  (no scan, no host call), so the decoded ids are exactly the template's text. The concatenation is
  precomputed on the host into ``Stencils`` (whole pre-rendered rows plus small per-cell delta rows), so
  rendering is a handful of contiguous row reads and adds; the general per-token concatenation remains as a
  fallback and reference (same ids). Token ids may differ from
  tokenizing the whole text at once with a general tokenizer; with the shipped tokenizer they are identical,
  because its pre-tokenizer always splits at the slot boundaries (digits, lone X/O letters, newlines).

Wording (our own, in the spirit of AReno): a system message that explains the game and the ``choose_square``
tool, a user message with the side and the board as three rows, e.g. ``"X | 2 | O\\n4 | X | 6\\n7 | 8 | 9"``
(empty squares show their number), and tool responses that report the opponent's reply and the new board, or the
end of the game.

Conversation layout for the game task (what the rollout builds token by token)::

    render_prompt(...)            system + user turns + assistant header
    <policy tokens>               e.g. <think>...</think><tool_call>{...}</tool_call><|im_end|>
    render_tool_response(...)     [turn end if the policy did not emit it] + tool turn + next assistant header
    <policy tokens> ...

Status codes equal ``tasks.OUTCOME_*`` so a ``GameTaskState.outcome`` can be passed straight in.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

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

# Source vector layout (int32 [_NUM_SOURCES]); every slot reads one entry.
_SRC_ZERO = 0  # always 0: literal pieces
_SRC_CELL0 = 1  # 1..9: board cells (0 empty, 1 X, 2 O)
_SRC_SIDE = 10  # agent_player - 1 (0 X, 1 O)
_SRC_OPP_SQUARE = 11  # opponent's reply square 0..9 (0: no reply)
_SRC_ADD_TURN_END = 12  # 1: prepend the assistant turn-end marker
_NUM_SOURCES = 13

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


# ----------------------------------------------------------------------------------------------------------------
# Parts: literal strings and slots
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Slot:
    """A variable piece of text: ``options[source[src]]``."""

    src: int
    options: tuple[str, ...]


Parts = list  # list[str | _Slot]


def _board_parts() -> Parts:
    parts: Parts = []
    for i in range(NUM_SQUARES):
        parts.append(_Slot(_SRC_CELL0 + i, (str(i + 1),) + _CELL_MARKS))
        if i % 3 < 2:
            parts.append(" | ")
        elif i < NUM_SQUARES - 1:
            parts.append("\n")
    return parts


def _side_slot() -> _Slot:
    return _Slot(_SRC_SIDE, _SIDE_NAMES)


def _user_parts(game: bool) -> Parts:
    return [_GAME_INTRO if game else _MOVE_INTRO, _side_slot(), ".\n", *_board_parts()]


def _tool_parts(status: int) -> Parts:
    if status in (STATUS_INVALID, STATUS_ILLEGAL):
        return [_INVALID_TEXT if status == STATUS_INVALID else _ILLEGAL_TEXT]
    opponent = _Slot(_SRC_OPP_SQUARE, ("",) + tuple(_OPPONENT_LINE.format(k) for k in range(1, 10)))
    return [opponent, *_board_parts(), _STATUS_TAILS[status]]


def _resolve(parts: Parts, source: Sequence[int]) -> str:
    out = []
    for p in parts:
        if isinstance(p, _Slot):
            value = int(source[p.src])
            if not 0 <= value < len(p.options):
                raise ValueError(f"slot value {value} out of range for options {p.options}")
            out.append(p.options[value])
        else:
            out.append(p)
    return "".join(out)


def _host_source(board=None, agent_player: int = 1, opponent_square: int = 0, add_turn_end: bool = False) -> list:
    src = [0] * _NUM_SOURCES
    if board is not None:
        b = _check_board_host(board)
        src[_SRC_CELL0 : _SRC_CELL0 + NUM_SQUARES] = [int(v) for v in b]
    if agent_player not in (1, 2):
        raise ValueError(f"agent_player must be 1 (X) or 2 (O), got {agent_player}")
    src[_SRC_SIDE] = int(agent_player) - 1
    if not 0 <= int(opponent_square) <= 9:
        raise ValueError(f"opponent_square must be 0 (none) or 1..9, got {opponent_square}")
    src[_SRC_OPP_SQUARE] = int(opponent_square)
    src[_SRC_ADD_TURN_END] = int(bool(add_turn_end))
    return src


def _check_board_host(board) -> np.ndarray:
    b = np.asarray(board)
    if b.shape != (NUM_SQUARES,) or not np.isin(b, (0, 1, 2)).all():
        raise ValueError(f"board must be int [9] with values 0 (empty), 1 (X), 2 (O); got {b!r}")
    return b


# ----------------------------------------------------------------------------------------------------------------
# Host API
# ----------------------------------------------------------------------------------------------------------------


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


def side_to_move(board) -> int:
    """1 (X) or 2 (O) from stone counts: X when #X <= #O (same rule as ``tictactoe.to_move_from_counts``)."""
    b = _check_board_host(board)
    return 1 if int((b == 1).sum()) <= int((b == 2).sum()) else 2


def render_board(board) -> str:
    """``"X | 2 | O\\n4 | X | 6\\n7 | 8 | 9"`` for an ``int [9]`` board (0 empty, 1 X, 2 O)."""
    return _resolve(_board_parts(), _host_source(board))


def move_task_messages(board, agent_player: int | None = None) -> list[dict]:
    """System + user messages of the move task; ``agent_player`` defaults to the side to move."""
    side = side_to_move(board) if agent_player is None else int(agent_player)
    user = _resolve(_user_parts(game=False), _host_source(board, side))
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def game_task_messages(board, agent_player: int) -> list[dict]:
    """System + user messages that open a game (the agent plays ``agent_player``; ``board`` has the opening)."""
    user = _resolve(_user_parts(game=True), _host_source(board, agent_player))
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def tool_response_content(board, opponent_square: int, status: int) -> str:
    """Text of the tool turn after the agent's call (``board`` is the position after the opponent's reply)."""
    if status not in range(NUM_STATUSES):
        raise ValueError(f"status must be in 0..{NUM_STATUSES - 1} ({STATUS_NAMES}), got {status}")
    return _resolve(_tool_parts(status), _host_source(board, 1, opponent_square))


def tool_message(board, opponent_square: int, status: int) -> dict:
    return {"role": "tool", "name": TOOL_NAME, "content": tool_response_content(board, opponent_square, status)}


def _as_id_list(out) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template's text for ``messages`` with the ``choose_square`` tool."""
    return tokenizer.apply_chat_template(
        messages, tools=[tool_schema()], add_generation_prompt=add_generation_prompt, tokenize=False
    )


def prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Host prompt token ids via ``apply_chat_template(..., tools=[tool_schema()], tokenize=True)``."""
    out = tokenizer.apply_chat_template(
        messages,
        tools=[tool_schema()],
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    return _as_id_list(out)


# ----------------------------------------------------------------------------------------------------------------
# TextSpec: pre-tokenized pieces for in-jit rendering
# ----------------------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class Stencils:
    """Pre-rendered output rows of a set of programs: in-jit rendering is a few row lookups and adds.

    Slots fall in two kinds. *Key* slots have options of different token lengths (turn-end marker: none or one
    token; opponent line: empty or a sentence): they move everything after them, so each combination of their
    values (per program) gets its own pre-rendered row ``base[key]``, with every other slot at option 0. *Delta*
    slots have options of one token length (a cell: ``"7"``, ``"X"`` or ``"O"``; the side): they only change
    token values in place. Delta sources are grouped into *chunks* of a few (product of option counts at most
    ``_CHUNK_COMBOS``); ``chunk_tables[c][placement * combos + code]`` is a whole ``[Lout]`` row holding, at the
    positions where the chunk's slots sit in rows of that *placement* class, the token differences from option 0
    for the chunk's values (``code``, mixed radix), and 0 elsewhere. So::

        ids = base[key] + sum_c chunk_tables[c][placement[key] * combos_c + code_c]

    Every term is a contiguous row read (no per-token index), which is what makes this fast on CPU; the tables
    are small (rows x Lout ints).

    Attributes:
      key_table: ``int32 [NP * prod(key option counts)]`` key of each (program, key-source values), mixed radix.
      base: ``int32 [NK, Lout]`` pre-rendered rows (``pad_id`` past ``total``).
      total: ``int32 [NK]`` tokens of each row.
      placement: ``int32 [NK]`` placement class of each row (rows that hold the delta slots at the same positions
        with the same token differences share one).
      chunk_tables: tuple of ``int32 [NPL * combos_c, Lout]``.
      key_sources: static ``((source, options), ...)`` in mixed-radix order (after the program index).
      chunk_sources: static, per chunk ``((source, options), ...)``.
    """

    key_table: jax.Array
    base: jax.Array
    total: jax.Array
    placement: jax.Array
    chunk_tables: tuple
    key_sources: tuple = flax.struct.field(pytree_node=False, default=())
    chunk_sources: tuple = flax.struct.field(pytree_node=False, default=())


_CHUNK_COMBOS = 27
_MAX_KEY_TABLE = 1 << 16


def _compile_stencils(programs, pieces: Sequence[Sequence[int]], out_len: int, pad_id: int, max_rows: int):
    """Stencil tables of ``programs`` (``(base, src, max_tokens, options)`` lists), or None when they would
    exceed ``max_rows`` rows (then the general concatenation is used)."""
    plen = [len(p) for p in pieces]
    n_opts: dict[int, int] = {}  # options per source (the same in every program)
    plans = []
    for base, src, _, options in programs:
        keys = []
        for k, (b, s, n) in enumerate(zip(base, src, options)):
            if n > 1:
                if n_opts.setdefault(s, n) != n:
                    return None
                if len({plen[b + v] for v in range(n)}) > 1:
                    keys.append(k)
        plans.append((keys, int(np.prod([options[k] for k in keys], dtype=np.int64))))
    n_rows = sum(c for _, c in plans)
    key_srcs = sorted({programs[p][1][k] for p, (keys, _) in enumerate(plans) for k in keys})
    key_size = len(programs) * int(np.prod([n_opts[s] for s in key_srcs], dtype=np.int64))
    if n_rows > max_rows or key_size > _MAX_KEY_TABLE:
        return None

    base_rows = np.full((max(n_rows, 1), out_len), pad_id, np.int32)
    total = np.zeros(max(n_rows, 1), np.int32)
    key_table = np.zeros(key_size, np.int32)
    placements: dict[tuple, int] = {}
    placement = np.zeros(max(n_rows, 1), np.int32)
    row = 0
    for p, ((base, src, _, options), (keys, count)) in enumerate(zip(programs, plans)):
        strides = np.cumprod([1] + [options[k] for k in keys])[:-1].astype(np.int64)
        combo_row = {}
        for combo in range(count):
            choice = {k: int(combo // st % options[k]) for k, st in zip(keys, strides)}
            toks, deltas = [], []
            for k, (b, s, n) in enumerate(zip(base, src, options)):
                if k in choice:
                    toks += pieces[b + choice[k]]
                    continue
                if n > 1:  # delta slot: option 0 in the row, differences to the other options in the chunk tables
                    for c in range(plen[b]):
                        diffs = tuple(int(pieces[b + v][c]) - int(pieces[b][c]) for v in range(n))
                        deltas.append((len(toks) + c, s, diffs))
                toks += pieces[b]
            if len(toks) > out_len:
                raise AssertionError(f"stencil row longer than the program's maximum ({len(toks)} > {out_len})")
            base_rows[row, : len(toks)] = toks
            total[row] = len(toks)
            placement[row] = placements.setdefault(tuple(deltas), len(placements))
            combo_row[tuple(choice.get(k, 0) for k in keys)] = row
            row += 1
        # Dense key table: every combination of ALL key sources maps to this program's row (ignoring the sources
        # the program has no key slot for).
        for values in np.ndindex(*[n_opts[s] for s in key_srcs]):
            idx = p
            for s, v in zip(key_srcs, values):
                idx = idx * n_opts[s] + v
            key_table[idx] = combo_row[tuple(values[key_srcs.index(programs[p][1][k])] for k in keys)]

    # Chunks of delta sources, in order of first appearance.
    delta_srcs: list[int] = []
    for deltas in placements:
        for _, s, _ in deltas:
            if s not in delta_srcs:
                delta_srcs.append(s)
    chunks: list[list[int]] = []
    for s in delta_srcs:
        if chunks and np.prod([n_opts[x] for x in chunks[-1]]) * n_opts[s] <= _CHUNK_COMBOS:
            chunks[-1].append(s)
        else:
            chunks.append([s])
    tables = []
    for chunk in chunks:
        radix = [n_opts[s] for s in chunk]
        combos = int(np.prod(radix))
        table = np.zeros((len(placements), combos, out_len), np.int32)
        for deltas, pl in placements.items():
            for code, values in enumerate(np.ndindex(*radix)):
                # np.ndindex runs the LAST source fastest: code = mixed radix with the first source most significant
                value_of = dict(zip(chunk, values))
                for pos, s, diffs in deltas:
                    if s in value_of:
                        table[pl, code, pos] += diffs[value_of[s]]
        tables.append(jnp.asarray(table.reshape(len(placements) * combos, out_len)))
    return Stencils(
        key_table=jnp.asarray(key_table),
        base=jnp.asarray(base_rows),
        total=jnp.asarray(total),
        placement=jnp.asarray(placement),
        chunk_tables=tuple(tables),
        key_sources=tuple((int(s), int(n_opts[s])) for s in key_srcs),
        chunk_sources=tuple(tuple((int(s), int(n_opts[s])) for s in chunk) for chunk in chunks),
    )


def _render_stencil(stencils: Stencils, program: jax.Array, values: Sequence[jax.Array]):
    """Fast path: program index ``[]`` and the source values (``values[j]``: int32 ``[]``, already in range) ->
    ``(ids [Lout], length [])``."""
    idx = program
    for s, n in stencils.key_sources:
        idx = idx * n + values[s]
    key = stencils.key_table[idx]
    out = stencils.base[key]
    place = stencils.placement[key]
    for table, sources in zip(stencils.chunk_tables, stencils.chunk_sources):
        code = place
        for s, n in sources:
            code = code * n + values[s]
        out = out + table[code]
    return out, stencils.total[key]


@flax.struct.dataclass
class TextSpec:
    """Pre-tokenized chat pieces (a pytree of int32 arrays; the ``int`` fields are static).

    A *program* is a list of K segments; segment k emits piece ``base[k] + source[src[k]]``. Programs are padded to
    a common K with an empty piece.

    Attributes:
      piece_ids: ``int32 [P, Lpiece]`` token ids of every piece (literal text or slot option), right-padded.
      piece_len: ``int32 [P]`` number of tokens of each piece (0 for the empty piece).
      prompt_base, prompt_src: ``int32 [2, Kp]`` programs of the initial prompt, row 0 move task, row 1 game task.
      response_base, response_src: ``int32 [NUM_STATUSES, Kr]`` programs of the tool response, per status.
      turn_end_ids: ``int32 [1]`` the assistant turn-end marker (``<|im_end|>`` for the shipped tokenizer).
      stop_ids: ``int32 [n]`` tokens that end a generation turn (turn end, then eos if different).
      prompt_stencils, response_stencils: ``Stencils`` of the two program sets (the fast path), or None (then the
        general concatenation of pieces is used).
      prompt_len: static max prompt length ``Lp_max``; response_len: static ``Lr_max``.
      pad_id, turn_end_id, eos_id: static ints.
    """

    piece_ids: jax.Array
    piece_len: jax.Array
    prompt_base: jax.Array
    prompt_src: jax.Array
    response_base: jax.Array
    response_src: jax.Array
    turn_end_ids: jax.Array
    stop_ids: jax.Array
    prompt_stencils: "Stencils | None" = None
    response_stencils: "Stencils | None" = None
    prompt_len: int = flax.struct.field(pytree_node=False, default=0)
    response_len: int = flax.struct.field(pytree_node=False, default=0)
    pad_id: int = flax.struct.field(pytree_node=False, default=0)
    turn_end_id: int = flax.struct.field(pytree_node=False, default=0)
    eos_id: int = flax.struct.field(pytree_node=False, default=0)


_PLACEHOLDER = "@@RENO{}@@"
_PLACEHOLDER_RE = re.compile(r"@@RENO(\d+)@@")
_ASSISTANT_MARK = "@@RENOASSISTANT@@"


def _with_placeholders(parts: Parts, slots: list) -> str:
    """Content string with ``@@RENO<k>@@`` for each slot (appended to ``slots``)."""
    out = []
    for p in parts:
        if isinstance(p, _Slot):
            out.append(_PLACEHOLDER.format(len(slots)))
            slots.append(p)
        else:
            out.append(p)
    return "".join(out)


def _split_rendered(text: str, slots: list) -> Parts:
    """Template output with placeholders -> literal/slot parts (checks every slot appears exactly once)."""
    parts: Parts = []
    seen = []
    pos = 0
    for m in _PLACEHOLDER_RE.finditer(text):
        if m.start() > pos:
            parts.append(text[pos : m.start()])
        k = int(m.group(1))
        seen.append(k)
        parts.append(slots[k])
        pos = m.end()
    if pos < len(text):
        parts.append(text[pos:])
    if sorted(seen) != list(range(len(slots))):
        raise ValueError(
            "the chat template dropped, duplicated or reordered message content; cannot split it into pieces "
            f"(slots seen {seen}, expected {list(range(len(slots)))})"
        )
    return parts


class _PieceTable:
    """Tokenizes each distinct piece once; literal pieces are shared, each slot gets a contiguous block of rows."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}
        self.literal_row: dict[str, int] = {"": 0}
        self.ids: list[list[int]] = [[]]  # row 0: the empty piece (padding segments)

    def encode(self, text: str) -> list[int]:
        if text not in self.cache:
            ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)] if text else []
            back = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if back != text:
                raise ValueError(
                    f"tokenizer does not round-trip the chat piece {text!r} (decodes to {back!r}); in-jit "
                    "rendering needs a tokenizer whose encode/decode is lossless on isolated pieces"
                )
            self.cache[text] = ids
        return self.cache[text]

    def literal(self, text: str) -> int:
        if text not in self.literal_row:
            self.literal_row[text] = len(self.ids)
            self.ids.append(self.encode(text))
        return self.literal_row[text]

    def block(self, options: Sequence[str]) -> int:
        first = len(self.ids)
        self.ids.extend(self.encode(o) for o in options)
        return first

    def program(self, parts: Parts) -> tuple[list[int], list[int], int, list[int]]:
        """Parts -> (base [K], src [K], max tokens, options [K]); adjacent literals are merged first."""
        merged: Parts = []
        for p in parts:
            if isinstance(p, str) and merged and isinstance(merged[-1], str):
                merged[-1] += p
            elif p != "":
                merged.append(p)
        base, src, max_tokens, options = [], [], 0, []
        for p in merged:
            if isinstance(p, _Slot):
                base.append(self.block(p.options))
                src.append(p.src)
                max_tokens += max(len(self.encode(o)) for o in p.options)
                options.append(len(p.options))
            else:
                base.append(self.literal(p))
                src.append(_SRC_ZERO)
                max_tokens += len(self.encode(p))
                options.append(1)
        return base, src, max_tokens, options


def _render_template(tokenizer, messages, add_generation_prompt: bool, chat_template: str | None) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tools=[tool_schema()],
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        chat_template=chat_template,
    )


def _find_turn_end(tokenizer, after_assistant: str) -> tuple[str, int]:
    """The special token that closes an assistant turn: the added token the post-assistant text starts with."""
    best = None
    for tok_id, added in tokenizer.added_tokens_decoder.items():
        content = str(added.content) if hasattr(added, "content") else str(added)
        if content and after_assistant.startswith(content) and (best is None or len(content) > len(best[0])):
            best = (content, int(tok_id))
    if best is None:
        raise ValueError(
            "cannot find the assistant turn-end token: the chat template's text after an assistant message "
            f"({after_assistant[:40]!r}...) does not start with any added/special token"
        )
    return best


def build_text_spec(tokenizer, chat_template: str | None = None, max_stencil_rows: int = 4096) -> TextSpec:
    """Build the ``TextSpec`` for ``tokenizer`` and its chat template (or ``chat_template`` if given).

    The template is rendered with placeholder strings in the variable slots; the text around them becomes
    literal pieces. The template must pass message contents through unchanged (wrapping them is fine).

    ``max_stencil_rows`` caps the pre-rendered rows of each fast-path table (see ``Stencils``; the shipped
    tokenizer needs 84 for tool responses, 2 for prompts); past it, or with 0, rendering falls back to the general
    concatenation of pieces (same ids, slower).
    """
    table = _PieceTable(tokenizer)
    sys_msg = {"role": "system", "content": SYSTEM_PROMPT}

    prompt_programs = []
    for game in (False, True):
        slots: list = []
        user = _with_placeholders(_user_parts(game), slots)
        text = _render_template(tokenizer, [sys_msg, {"role": "user", "content": user}], True, chat_template)
        prompt_programs.append(table.program(_split_rendered(text, slots)))

    # Tool responses: render a whole exchange and keep what follows the assistant's content.
    user0 = _resolve(_user_parts(False), _host_source(np.zeros(9, np.int8)))
    turn_end_text = None
    response_programs = []
    for status in range(NUM_STATUSES):
        slots = []
        content = _with_placeholders(_tool_parts(status), slots)
        messages = [
            sys_msg,
            {"role": "user", "content": user0},
            {"role": "assistant", "content": _ASSISTANT_MARK},
            {"role": "tool", "name": TOOL_NAME, "content": content},
        ]
        text = _render_template(tokenizer, messages, status == STATUS_ONGOING, chat_template)
        if text.count(_ASSISTANT_MARK) != 1:
            raise ValueError("the chat template must render assistant content verbatim exactly once")
        after = text.split(_ASSISTANT_MARK, 1)[1]
        if turn_end_text is None:
            turn_end_text, turn_end_id = _find_turn_end(tokenizer, after)
        if not after.startswith(turn_end_text):
            raise ValueError(f"tool-response text {after[:40]!r} does not start with turn end {turn_end_text!r}")
        rest = after[len(turn_end_text) :]
        turn_end_slot = _Slot(_SRC_ADD_TURN_END, ("", turn_end_text))
        response_programs.append(table.program([turn_end_slot, *_split_rendered(rest, slots)]))

    def stack(programs):
        k = max(len(p[0]) for p in programs)
        base = np.zeros((len(programs), k), np.int32)  # padding segments read the empty piece 0
        src = np.zeros((len(programs), k), np.int32)
        for r, (b, s, _, _) in enumerate(programs):
            base[r, : len(b)] = b
            src[r, : len(s)] = s
        return base, src, max(p[2] for p in programs)

    prompt_base, prompt_src, prompt_len = stack(prompt_programs)
    response_base, response_src, response_len = stack(response_programs)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else turn_end_id
    pad_id = turn_end_id if pad_id is None else int(pad_id)
    lpiece = max(1, max(len(ids) for ids in table.ids))
    piece_ids = np.full((len(table.ids), lpiece), pad_id, np.int32)
    for i, ids in enumerate(table.ids):
        piece_ids[i, : len(ids)] = ids
    piece_len = np.array([len(ids) for ids in table.ids], np.int32)
    stop = [turn_end_id] + ([int(eos_id)] if int(eos_id) != turn_end_id else [])
    prompt_stencils = _compile_stencils(prompt_programs, table.ids, prompt_len, pad_id, max_stencil_rows)
    response_stencils = _compile_stencils(response_programs, table.ids, response_len, pad_id, max_stencil_rows)

    spec = TextSpec(
        piece_ids=jnp.asarray(piece_ids),
        piece_len=jnp.asarray(piece_len),
        prompt_base=jnp.asarray(prompt_base),
        prompt_src=jnp.asarray(prompt_src),
        response_base=jnp.asarray(response_base),
        response_src=jnp.asarray(response_src),
        turn_end_ids=jnp.asarray([turn_end_id], jnp.int32),
        stop_ids=jnp.asarray(stop, jnp.int32),
        prompt_stencils=prompt_stencils,
        response_stencils=response_stencils,
        prompt_len=int(prompt_len),
        response_len=int(response_len),
        pad_id=int(pad_id),
        turn_end_id=int(turn_end_id),
        eos_id=int(eos_id),
    )
    _self_check(spec, tokenizer, chat_template)
    return spec


def _self_check(spec: TextSpec, tokenizer, chat_template) -> None:
    """Host check of every program on one board: decoded pieces == the template's own text."""
    board = np.array([1, 0, 2, 0, 1, 0, 0, 0, 2], np.int8)

    def rendered(base, src, source, out_len):
        ids, n = _render_np(spec, base, src, source, out_len)
        return tokenizer.decode(ids[:n].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for game in (0, 1):
        messages = game_task_messages(board, 2) if game else move_task_messages(board, 2)
        want = _render_template(tokenizer, messages, True, chat_template)
        got = rendered(spec.prompt_base[game], spec.prompt_src[game], _host_source(board, 2), spec.prompt_len)
        if got != want:
            raise ValueError(f"in-jit prompt pieces do not reproduce the chat template:\n{got!r}\n!=\n{want!r}")
    for status in range(NUM_STATUSES):
        opp = 4 if status in (STATUS_ONGOING, STATUS_LOSS) else 0
        want = tool_response_text(tokenizer, board, opp, status, chat_template=chat_template)
        source = _host_source(board, 1, opp)
        got = rendered(spec.response_base[status], spec.response_src[status], source, spec.response_len)
        if got != want:
            raise ValueError(f"in-jit tool-response pieces do not reproduce the template:\n{got!r}\n!=\n{want!r}")
    # The fast-path tables must give the very same ids as the piece programs, for every key combination.
    rng = np.random.default_rng(0)
    for stencils, base, src, out_len in (
        (spec.prompt_stencils, spec.prompt_base, spec.prompt_src, spec.prompt_len),
        (spec.response_stencils, spec.response_base, spec.response_src, spec.response_len),
    ):
        if stencils is None:
            continue
        for program in range(base.shape[0]):
            for side, opp, turn_end in np.ndindex(2, 10, 2):
                source = _host_source(rng.integers(0, 3, NUM_SQUARES), 1 + side, opp, bool(turn_end))
                want = _render_np(spec, base[program], src[program], source, out_len)
                got = _stencil_np(stencils, program, source)
                if not (np.array_equal(got[0], want[0]) and got[1] == want[1]):
                    raise AssertionError(f"stencil tables disagree with the piece programs (program {program})")


def tool_response_text(
    tokenizer, board, opponent_square: int, status: int, add_turn_end: bool = False, chat_template=None
) -> str:
    """Host reference for ``render_tool_response``: the template text after an assistant message's content,
    minus the turn-end marker unless ``add_turn_end``."""
    messages = [
        *move_task_messages(np.zeros(9, np.int8), 1),
        {"role": "assistant", "content": _ASSISTANT_MARK},
        tool_message(board, opponent_square, status),
    ]
    text = _render_template(tokenizer, messages, status == STATUS_ONGOING, chat_template)
    after = text.split(_ASSISTANT_MARK, 1)[1]
    turn_end, _ = _find_turn_end(tokenizer, after)
    return after if add_turn_end else after[len(turn_end) :]


def _stencil_np(stencils: Stencils, program: int, source: Sequence[int]):
    """NumPy twin of ``_render_stencil`` (host self-check)."""
    idx = program
    for s, n in stencils.key_sources:
        idx = idx * n + int(source[s])
    key = int(np.asarray(stencils.key_table)[idx])
    out = np.asarray(stencils.base)[key].copy()
    place = int(np.asarray(stencils.placement)[key])
    for table, sources in zip(stencils.chunk_tables, stencils.chunk_sources):
        code = place
        for s, n in sources:
            code = code * n + int(source[s])
        out += np.asarray(table)[code]
    return out, int(np.asarray(stencils.total)[key])


def _render_np(spec: TextSpec, base, src, source, out_len):
    """NumPy twin of ``_render`` (host self-check)."""
    idx = np.asarray(base) + np.asarray(source)[np.asarray(src)]
    piece_ids, piece_len = np.asarray(spec.piece_ids), np.asarray(spec.piece_len)
    ids = np.concatenate([piece_ids[i, : piece_len[i]] for i in idx])
    out = np.full((out_len,), spec.pad_id, np.int32)
    out[: len(ids)] = ids
    return out, len(ids)


def _render(spec: TextSpec, base: jax.Array, src: jax.Array, source: jax.Array, out_len: int):
    """General path: concatenate the pieces of one program. base/src ``[K]``, source ``[_NUM_SOURCES]`` ->
    ``([out_len], [])``. Used when a spec has no stencils (``build_text_spec(..., max_stencil_rows=0)``)."""
    idx = base + source[src]  # [K] piece per segment
    lens = spec.piece_len[idx]  # [K]
    ends = jnp.cumsum(lens)
    starts = ends - lens
    t = jnp.arange(out_len, dtype=jnp.int32)
    # First segment whose end is past t (empty segments are skipped because their end equals their start).
    seg = jnp.minimum(jnp.sum(ends[None, :] <= t[:, None], axis=1), idx.shape[0] - 1)
    col = jnp.clip(t - starts[seg], 0, spec.piece_ids.shape[1] - 1)
    ids = spec.piece_ids[idx[seg], col]
    total = ends[-1].astype(jnp.int32)
    return jnp.where(t < total, ids, spec.pad_id).astype(jnp.int32), total


def _in_range(x, n: int) -> jax.Array:
    """``int32 []`` value of ``x`` forced into ``[0, n)`` with one unsigned ``min`` (values >= n and negative
    values, which wrap to large unsigned ones, become ``n - 1``); cheaper than a two-sided clip on CPU."""
    return jnp.minimum(jnp.asarray(x).astype(jnp.uint32), jnp.uint32(n - 1)).astype(jnp.int32)


def _values(board, agent_player=1, opponent_square=0, add_turn_end=False) -> list:
    """Source values as a list of int32 scalars (index = ``_SRC_*``), clipped to each slot's options (cells with
    ``_in_range``, the cheap one-sided form: there are nine per row, and boards never hold negative values)."""
    board = jnp.asarray(board)
    if board.shape != (NUM_SQUARES,):
        raise ValueError(f"board must have shape [9], got {board.shape}")
    return [
        jnp.int32(0),
        *(_in_range(board[i], 3) for i in range(NUM_SQUARES)),
        jnp.clip(jnp.asarray(agent_player, jnp.int32) - 1, 0, 1),
        jnp.clip(jnp.asarray(opponent_square, jnp.int32), 0, 9),
        (jnp.asarray(add_turn_end) != 0).astype(jnp.int32),
    ]


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
    row = (jnp.asarray(game) != 0).astype(jnp.int32)
    values = _values(board, agent_player)
    if spec.prompt_stencils is not None:
        return _render_stencil(spec.prompt_stencils, row, values)
    return _render(spec, spec.prompt_base[row], spec.prompt_src[row], jnp.stack(values), spec.prompt_len)


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
      status: ``int32 []`` ``STATUS_*`` (== ``tasks.OUTCOME_*``).
      add_turn_end: ``bool []``: prepend the turn-end marker (use when the policy stopped without emitting it,
        e.g. on the token budget or on a different stop token).

    Returns:
      ``(ids int32 [spec.response_len], length int32 [])``.
    """
    row = jnp.clip(jnp.asarray(status, jnp.int32), 0, NUM_STATUSES - 1)
    values = _values(board, 1, opponent_square, add_turn_end)
    if spec.response_stencils is not None:
        return _render_stencil(spec.response_stencils, row, values)
    return _render(spec, spec.response_base[row], spec.response_src[row], jnp.stack(values), spec.response_len)


def chat_spec():  # replaced by the protocol.chat ChatSpec of this wording
    return None
