"""Tic-tac-toe's tool-call parser: the ``choose_square`` schema (``wording.tool_schema()``) compiled by
``reno_jax.protocol.toolcall``, which documents the grammar and the automaton.

Result (design contract): ``kind`` int32 in {0 ok, 1 no_call, 2 bad_call, 3 out_of_range} and ``square`` int32,
1..9 when ``kind == 0`` else 0. With its single register the compiled automaton is the original hand-built one:
137 states, int16 entries ``state << 4 | (square store + 1)``, a pair table; one class lookup and one table
lookup per token (or per pair of tokens).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from reno_jax.envs.tictactoe import wording
from reno_jax.protocol import toolcall

TOOL_NAME = wording.TOOL_NAME
ARGUMENT = "square"
MIN_SQUARE, MAX_SQUARE = 1, 9


@functools.lru_cache(maxsize=1)
def _spec() -> tuple[toolcall.ToolSpec, ...]:
    spec = toolcall.normalize_tools([wording.tool_schema()])
    (arg,) = spec[0].args
    if (spec[0].name, arg.name, arg.kind, arg.lo, arg.hi) != (TOOL_NAME, ARGUMENT, "integer", MIN_SQUARE, MAX_SQUARE):
        raise AssertionError(f"wording.tool_schema() no longer describes choose_square(square: 1..9): {spec}")
    return spec


def parse_tool_call_text(text: str) -> tuple[int, int]:
    """Reference parser (plain Python). Returns ``(kind, square)``; see ``protocol.toolcall`` for the grammar."""
    kind, _, args = toolcall.parse_text(_spec(), text)
    return kind, args[0]


@dataclasses.dataclass(frozen=True)
class _Grammar:
    """The minimized byte automaton in the one-register view: ``op`` is -1 (keep) or the square value stored."""

    next: np.ndarray
    op: np.ndarray
    accept_state: int
    bad_state: int
    raw_states: int

    @property
    def num_states(self) -> int:
        return int(self.next.shape[0])


@functools.lru_cache(maxsize=1)
def _grammar() -> _Grammar:
    g = toolcall.grammar(_spec())
    # One register: store code = value + 1 (0 = none), see toolcall._Stores.
    return _Grammar(
        next=g.next,
        op=(g.code - 1).astype(np.int8),
        accept_state=int(np.nonzero(g.label == 2)[0][0]),
        bad_state=int(np.nonzero(g.label == 1)[0][0]),
        raw_states=g.raw_states,
    )


def build_parser_tables(tokenizer, vocab_size: int | None = None) -> toolcall.ToolCallTables:
    """Tables for ``tokenizer``; ``vocab_size`` (e.g. the model's padded vocab) adds rows for ids without text."""
    return toolcall.compile_tool_calls(_spec(), tokenizer, vocab_size)


def parse_tool_call(
    tables: toolcall.ToolCallTables, token_ids: jax.Array, length=None, *, max_bytes: int | None = None
):
    """``(kind int32 [], square int32 [])`` of the first tool call in ``token_ids[:length]`` (jit/vmap friendly;
    agrees with ``parse_tool_call_text`` on the decoded text). See ``toolcall.parse`` for ``max_bytes``."""
    kind, _, args = toolcall.parse(tables, token_ids, length, max_bytes=max_bytes)
    return kind, args[0]


def parse_tool_call_batch(tables: toolcall.ToolCallTables, token_ids: jax.Array, lengths: jax.Array, *, max_bytes=None):
    """``vmap`` of ``parse_tool_call`` over ``token_ids [B, T]`` and ``lengths [B]`` -> ``(kind [B], square [B])``."""
    fn = functools.partial(parse_tool_call, max_bytes=max_bytes)
    return jax.vmap(fn, in_axes=(None, 0, 0))(tables, token_ids, lengths)
