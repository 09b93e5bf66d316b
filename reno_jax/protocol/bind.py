"""An environment's protocol bound to a tokenizer: the three compiled pieces the rollout uses, and its entry
points (render a user / tool message, parse a turn), independent of any environment.

    chat, parser, pieces = compile(chat_spec, tokenizer, vocab_size)   # host, once
    render_user(chat, message) / render_tool(chat, message, add_turn_end)   # in jit
    parse_batch(parser, ids [B, T], lengths [B]) -> ToolCall [B]            # in jit
"""

from __future__ import annotations

import jax.numpy as jnp

from reno_jax.protocol import chat, tokens, toolcall
from reno_jax.protocol.messages import Message, ToolCall

CLOSE_TAG = toolcall.CLOSE_TAG


def compile(chat_spec: chat.ChatSpec, tokenizer, vocab_size: int | None = None, chat_template: str | None = None):
    """`(chat tables, tool-call tables, token bytes per id)` for `chat_spec` (its tools included).

    `vocab_size` (the model's, when its embedding is padded past the tokenizer) adds ids without text.
    """
    pieces = tokens.token_bytes(tokenizer)
    if vocab_size is not None and vocab_size < len(pieces):
        raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer's {len(pieces)} ids")
    pieces = pieces + [b""] * ((vocab_size or 0) - len(pieces))
    tables = chat.compile_chat(tokenizer, chat_spec, chat_template)
    parser = toolcall.compile_tool_calls(list(chat_spec.tools), pieces=pieces)
    return tables, parser, pieces


def render_user(tables, message: Message):
    return chat.render_user(tables, message)


def render_tool(tables, message: Message, add_turn_end):
    return chat.render_tool(tables, message, add_turn_end)


def parse_batch(parser, ids, lengths, max_bytes=None) -> ToolCall:
    """Parses `[B, T]` turns; `tool` and `args` are 0 unless the call is ok (the interface's convention), and so
    are the free-text spans (`text_ids [B, M, L]`, `text_len [B, M]`; None when the schema has no free text)."""
    kind, tool, args, text_ids, text_len = toolcall.parse_full_batch(parser, ids, lengths, max_bytes=max_bytes)
    kind = kind.astype(jnp.int32)
    ok = kind == toolcall.KIND_OK
    return ToolCall(
        kind=kind,
        tool=jnp.where(ok, tool, 0).astype(jnp.int32),
        args=jnp.where(ok[:, None], args, 0).astype(jnp.int32),
        text_ids=text_ids,
        text_len=text_len,
    )


def empty_calls(batch: int, parser) -> ToolCall:
    """A `[B]` batch of "no call" results shaped like `parse_batch`'s (for tracing an environment's step)."""
    z = jnp.zeros((batch,), jnp.int32)
    text_ids = text_len = None
    if parser.has_text:
        m = toolcall.max_text_args(parser.spec)
        text_ids = jnp.zeros((batch, m, parser.text_tokens), jnp.int32)
        text_len = jnp.zeros((batch, m), jnp.int32)
    return ToolCall(
        kind=z + toolcall.KIND_NO_CALL,
        tool=z,
        args=jnp.zeros((batch, toolcall.max_args(parser.spec)), jnp.int32),
        text_ids=text_ids,
        text_len=text_len,
    )
