"""TEMPORARY adapter (tic-tac-toe only) until protocol.chat / protocol.toolcall land: the rollout's rendering and
parsing entry points on top of the tic-tac-toe wording and parser."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reno_jax.envs import interface
from reno_jax.envs.tictactoe import tool_parser, wording

CLOSE_TAG = tool_parser.CLOSE_TAG


def compile(chat_spec, tokenizer, vocab_size=None, chat_template=None):
    del chat_spec
    spec = wording.build_text_spec(tokenizer, chat_template)
    pieces = tool_parser.token_bytes(tokenizer)
    if vocab_size is not None and vocab_size < len(pieces):
        raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer's {len(pieces)} ids")
    pieces = pieces + [b""] * ((vocab_size or 0) - len(pieces))
    parser = tool_parser.build_parser_tables(tokenizer, vocab_size=len(pieces))
    return spec, parser, pieces


def _source(values, add_turn_end):
    v = jnp.asarray(values, jnp.int32)
    return [jnp.int32(0), *(wording._in_range(v[i], 3) for i in range(9)), jnp.clip(v[9], 0, 1),
            jnp.clip(v[10], 0, 9), (jnp.asarray(add_turn_end) != 0).astype(jnp.int32)]


def render_user(spec, message: interface.Message):
    row = jnp.clip(message.template, 0, 1)
    values = _source(message.values, False)
    if spec.prompt_stencils is not None:
        return wording._render_stencil(spec.prompt_stencils, row, values)
    return wording._render(spec, spec.prompt_base[row], spec.prompt_src[row], jnp.stack(values), spec.prompt_len)


def render_tool(spec, message: interface.Message, add_turn_end):
    row = jnp.clip(message.template, 0, wording.NUM_STATUSES - 1)
    values = _source(message.values, add_turn_end)
    if spec.response_stencils is not None:
        return wording._render_stencil(spec.response_stencils, row, values)
    return wording._render(spec, spec.response_base[row], spec.response_src[row], jnp.stack(values),
                           spec.response_len)


def parse_batch(parser, ids, lengths, max_bytes=None) -> interface.ToolCall:
    kind, square = tool_parser.parse_tool_call_batch(parser, ids, lengths, max_bytes=max_bytes)
    kind = kind.astype(jnp.int32)
    return interface.ToolCall(kind=kind, tool=jnp.zeros_like(kind), args=square.astype(jnp.int32)[:, None])


def empty_calls(batch: int, parser) -> interface.ToolCall:
    del parser
    z = jnp.zeros((batch,), jnp.int32)
    return interface.ToolCall(kind=z, tool=z, args=jnp.zeros((batch, 1), jnp.int32))
