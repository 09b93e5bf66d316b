"""Free text end to end: the echo test environment (tests/echo_env.py) parses a free-text argument into token
spans and splices them, and the digits of a computed count, into its tool message, in jit."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.models import ling3
from reno_jax.protocol import chat as chat_lib
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.protocol.messages import Message
from reno_jax.rollout import rollout as R

sys.path.insert(0, str(Path(__file__).parent))
import echo_env as ee  # noqa: E402
from test_rollout import _numpy_params  # noqa: E402

FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def tok():
    return tokenizer_lib.load_tokenizer(None)


@pytest.fixture(scope="module")
def chat_tables(tok):
    return chat_lib.compile_chat(tok, ee.CHAT)


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _call_ids(tok, text):
    """A call whose quotes sit at token boundaries: the text is encoded on its own."""
    return (
        _enc(tok, '<tool_call>{"name": "echo", "arguments": {"text": "')
        + _enc(tok, text)
        + _enc(tok, '"}}</tool_call>')
    )


@pytest.mark.parametrize("text, count", [("", 0), ("hi there!", 7), ("a < b", 123), ("é 中", 99)])
def test_render_splices_spans_like_the_host(tok, chat_tables, text, count):
    ids = _enc(tok, text)[: ee.MAX_TOKENS]
    span_ids = np.zeros((2, ee.MAX_TOKENS), np.int32)
    span_ids[0, : len(ids)] = ids
    digits, n_digits = chat_lib.number_span(chat_tables, count, ee.COUNT_DIGITS)
    span_ids[1, : ee.COUNT_DIGITS] = np.asarray(digits)
    for template in (ee.ECHOED, ee.INVALID):
        message = Message(
            jnp.int32(template),
            jnp.zeros((0,), jnp.int32),
            jnp.asarray(span_ids),
            jnp.asarray([len(ids), int(n_digits)], jnp.int32),
        )
        for add_turn_end in (False, True):
            out, n = jax.jit(chat_lib.render_tool)(chat_tables, message, add_turn_end)
            got = tok.decode(np.asarray(out)[: int(n)].tolist(), skip_special_tokens=False)
            assert got == chat_lib.tool_text(tok, ee.CHAT, message, add_turn_end=add_turn_end)
            assert not np.any(np.asarray(out)[int(n) :] != chat_tables.pad_id)
    shown = str(min(count, 10**ee.COUNT_DIGITS - 1))
    assert f"You said: {tok.decode(ids)} ({shown} tokens)" in chat_lib.tool_text(
        tok,
        ee.CHAT,
        Message(
            jnp.int32(ee.ECHOED),
            jnp.zeros((0,), jnp.int32),
            jnp.asarray(span_ids),
            jnp.asarray([len(ids), int(n_digits)], jnp.int32),
        ),
    )


def test_number_span_digits(tok, chat_tables):
    for value in (0, 7, 10, 99, 100, -5):
        ids, n = chat_lib.number_span(chat_tables, value, 3)
        want = str(min(max(value, 0), 999))
        assert tok.decode(np.asarray(ids)[: int(n)].tolist()) == want and int(n) == len(want)
        assert not np.asarray(ids)[int(n) :].any()


def test_span_slot_validation():
    with pytest.raises(ValueError, match="tool templates only"):
        chat_lib.ChatSpec(
            system="",
            tools=(ee.TOOL,),
            user=((chat_lib.SpanSlot(0, 2),),),
            tool=(("x",),),
            tool_continues=(False,),
            num_values=0,
        )
    with pytest.raises(ValueError, match="different max_tokens"):
        chat_lib.ChatSpec(
            system="",
            tools=(ee.TOOL,),
            user=(("u",),),
            tool=((chat_lib.SpanSlot(0, 2),), (chat_lib.SpanSlot(0, 3),)),
            tool_continues=(False, False),
            num_values=0,
        )
    with pytest.raises(ValueError, match="max_tokens"):
        chat_lib.SpanSlot(0, 0)


def test_rollout_echoes_the_argument(tok, chat_tables):
    """Forced echo calls (a random tiny model would not make them): the tool turn holds the argument's very ids
    and their count; a malformed call ends the episode. (An episode's last tool message is not rendered.)"""
    mc = ling3.tiny_test_config(vocab_size=512, num_hidden_layers=1)
    env = R.compile_env(ee.EchoEnv(chat_tables=chat_tables), tok, vocab_size=mc.vocab_size)
    texts = ["hello world", "1 < 2"]  # 7 and 5 tokens (the bound is 8)
    calls = [_call_ids(tok, t) for t in texts]
    bad = _enc(tok, '<tool_call>{"name": "echo", "arguments": {"text": 5}}</tool_call>')
    m = max(len(c) for c in calls + [bad])
    rc = R.RolloutConfig(group_size=1, max_new_tokens=m, max_turns=2, prefill_chunk=32)
    forced = np.full((3, 2, m), -1, np.int32)
    forced[0, 0, : len(calls[0])] = calls[0]
    forced[0, 1, : len(calls[1])] = calls[1]
    forced[1, 0, : len(calls[1])] = calls[1]
    forced[2, 0, : len(bad)] = bad
    params = _numpy_params(mc)
    fn = jax.jit(functools.partial(R.rollout, model_config=mc, rollout_config=rc), compiler_options=FAST_COMPILE)
    traj = jax.device_get(
        fn(params, jax.random.key(0), jnp.zeros((3,), jnp.int32), env=env, forced_tokens=jnp.asarray(forced))
    )
    rows = [tok.decode(traj.tokens[r].tolist(), skip_special_tokens=False) for r in range(3)]
    for r, said in ((0, texts[0]), (1, texts[1])):
        n = len(_enc(tok, said))
        assert f"You said: {said} ({n} tokens)" in rows[r]
        want = _enc(tok, "You said: ") + _enc(tok, said) + _enc(tok, f" ({n} tokens)")
        assert _contains(traj.tokens[r].tolist(), want)
    info = traj.info
    assert info["num_turns"][0] == 2 and info["echoed"][0] and info["text_len"][0] == len(_enc(tok, texts[1]))
    assert info["num_turns"][2] == 1 and info["parse_kind"][2] == 2 and not info["echoed"][2]
    assert "You said" not in rows[2] and traj.reward[2] == 0


def _contains(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))
