"""Tests for the chat-template compiler (reno_jax.protocol.chat): tic-tac-toe identity with the reference the
wording wrote before it moved onto the compiler, and a second, unrelated ChatSpec."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chat_reference
from reno_jax.envs.tictactoe import wording
from reno_jax.protocol import chat
from reno_jax.protocol import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def shipped():
    return tokenizer_lib.load_tokenizer(None)


def test_tictactoe_renders_equal_the_reference(shipped):
    ref = np.load(chat_reference.REFERENCE)
    got = chat_reference.render_all(wording, shipped)
    for k in ref.files:
        if k == "texts":
            continue
        want = ref[k].astype(np.int64)
        assert np.array_equal(got[k], want), k
        general = "general_" + k[len("fast_"):]
        if k.startswith("fast_"):
            assert np.array_equal(got[general], want), general
    want_texts = bytes(ref["texts"]).decode().split("\0")
    assert got["texts"].tolist() == want_texts
