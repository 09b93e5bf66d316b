"""TEMPORARY adapter (tic-tac-toe only) until protocol.chat / protocol.toolcall land: the rollout's rendering and
parsing entry points on top of the tic-tac-toe wording and parser."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reno_jax.envs import interface
from reno_jax.envs.tictactoe import tool_parser
from reno_jax.protocol import chat

CLOSE_TAG = tool_parser.CLOSE_TAG


def compile(chat_spec, tokenizer, vocab_size=None, chat_template=None):
    spec = chat.compile_chat(tokenizer, chat_spec, chat_template)
    pieces = tool_parser.token_bytes(tokenizer)
    if vocab_size is not None and vocab_size < len(pieces):
        raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer's {len(pieces)} ids")
    pieces = pieces + [b""] * ((vocab_size or 0) - len(pieces))
    parser = tool_parser.build_parser_tables(tokenizer, vocab_size=len(pieces))
    return spec, parser, pieces


def render_user(spec, message: interface.Message):
    return chat.render_user(spec, message)


def render_tool(spec, message: interface.Message, add_turn_end):
    return chat.render_tool(spec, message, add_turn_end)


def parse_batch(parser, ids, lengths, max_bytes=None) -> interface.ToolCall:
    kind, square = tool_parser.parse_tool_call_batch(parser, ids, lengths, max_bytes=max_bytes)
    kind = kind.astype(jnp.int32)
    return interface.ToolCall(kind=kind, tool=jnp.zeros_like(kind), args=square.astype(jnp.int32)[:, None])


def empty_calls(batch: int, parser) -> interface.ToolCall:
    del parser
    z = jnp.zeros((batch,), jnp.int32)
    return interface.ToolCall(kind=z, tool=z, args=jnp.zeros((batch, 1), jnp.int32))
