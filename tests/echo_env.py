"""A tiny jitted test environment with a free-text tool: ``echo(text)`` replies with the text (the call's token
ids spliced into the tool message) and the text's token count (``chat.number_span`` digits)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from reno_jax.envs import interface
from reno_jax.protocol import chat as chat_lib
from reno_jax.protocol.chat import ChatSpec, SpanSlot

MAX_TOKENS = 8  # the echo argument's bound, in tokens
COUNT_DIGITS = 2
TOOL = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Repeat a text.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxTokens": MAX_TOKENS}},
            "required": ["text"],
        },
    },
}
ECHOED, INVALID = range(2)
TEXT_SPAN, COUNT_SPAN = range(2)
CHAT = ChatSpec(
    system="Use the echo tool.",
    tools=(TOOL,),
    user=(("Say something with the echo tool.",),),
    tool=(
        ("You said: ", SpanSlot(TEXT_SPAN, MAX_TOKENS), " (", SpanSlot(COUNT_SPAN, COUNT_DIGITS), " tokens)"),
        ("Invalid call.",),
    ),
    tool_continues=(True, False),
    num_values=0,
)


@flax.struct.dataclass
class State:
    turns: jax.Array  # int32 []


@flax.struct.dataclass
class EchoEnv(interface.TextEnv):
    """``chat_tables``: the compiled chat of ``CHAT`` for the tokenizer (``number_span`` needs its digit ids)."""

    chat_tables: chat_lib.ChatTables | None = None
    turns: int = flax.struct.field(pytree_node=False, default=2)
    truncation_reward = 0.0

    def chat(self):
        return CHAT

    def max_turns(self) -> int:
        return self.turns

    def reset(self, start):
        return State(turns=jnp.int32(0)), interface.Message(jnp.int32(0), jnp.zeros((0,), jnp.int32))

    def step(self, state: State, call: interface.ToolCall) -> interface.Step:
        turns = state.turns + 1
        count, count_len = chat_lib.number_span(self.chat_tables, call.text_len[0], COUNT_DIGITS)
        span_ids = jnp.stack([call.text_ids[0], jnp.pad(count, (0, MAX_TOKENS - COUNT_DIGITS))])
        span_len = jnp.stack([call.text_len[0], count_len])
        template = jnp.where(call.ok, ECHOED, INVALID).astype(jnp.int32)
        message = interface.Message(template, jnp.zeros((0,), jnp.int32), span_ids=span_ids, span_len=span_len)
        done = ~call.ok | (turns >= self.turns)
        return interface.Step(
            state=State(turns=turns),
            message=message,
            reward=call.ok.astype(jnp.float32),
            done=done,
            info=dict(echoed=call.ok, text_len=call.text_len[0]),
        )
