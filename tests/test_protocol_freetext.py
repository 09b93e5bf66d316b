"""Free-text tool arguments (``{"type": "string", "maxTokens": N}``): the jitted automaton captures the token ids
between the quotes as a bounded span; over-long, unterminated or quote-mixing texts are bad calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reno_jax.protocol import bind
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.protocol import toolcall as tc


def _fn(name, props):
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": props, "required": list(props)}},
    }


BOUND = 12
ECHO = [_fn("echo", {"text": {"type": "string", "maxTokens": BOUND}})]
# Two tools share the key "text" (alive together when the arguments come first), one with an integer beside it,
# one with two texts: every span register and the value registers side by side.
MIXED = [
    _fn("echo", {"text": {"type": "string", "maxTokens": 4}}),
    _fn("say", {"times": {"type": "integer", "minimum": 0, "maximum": 3}, "text": {"type": "string", "maxTokens": 6}}),
    _fn("pair", {"a": {"type": "string", "maxTokens": 3}, "b": {"type": "string", "maxTokens": 5}}),
]
PRE = '<tool_call>{"name": "echo", "arguments": {"text": "'
POST = '"}}</tool_call>'

_PARSE = jax.jit(tc.parse_full)


@pytest.fixture(scope="module")
def tok():
    return tokenizer_lib.load_tokenizer(None)


@pytest.fixture(scope="module")
def echo_tables(tok):
    return tc.compile_tool_calls(ECHO, tok)


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _parse(tables, ids):
    kind, tool, args, text_ids, text_len = _PARSE(tables, jnp.asarray(ids, jnp.int32))
    return int(kind), int(tool), np.asarray(args).tolist(), np.asarray(text_ids), np.asarray(text_len)


# ---------------------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------------------


def test_schema_accepts_max_tokens():
    (tool,) = tc.normalize_tools(ECHO)
    assert tool.args == (tc.ArgSpec("text", "text", max_tokens=BOUND),)
    spec = tc.normalize_tools(MIXED)
    assert (tc.max_text_args(spec), tc.max_text_tokens(spec), tc.max_args(spec)) == (2, 6, 2)
    assert tc.max_text_args(tc.normalize_tools([_fn("f", {"x": {"type": "integer", "minimum": 0, "maximum": 1}})])) == 0


@pytest.mark.parametrize(
    "prop, match",
    [
        ({"type": "string", "maxTokens": 0}, "maxTokens"),
        ({"type": "string", "maxTokens": tc.MAX_TEXT_TOKENS + 1}, "maxTokens"),
        ({"type": "string", "maxTokens": 2.0}, "maxTokens"),
        ({"type": "string", "maxTokens": 4, "enum": ["a"]}, "not both"),
        ({"type": "integer", "minimum": 0, "maximum": 1, "maxTokens": 4}, "strings only"),
        ({"type": "string", "maxLength": 4}, "maxLength"),
    ],
)
def test_schema_errors(prop, match):
    with pytest.raises(ValueError, match=match):
        tc.normalize_tools([_fn("f", {"s": prop})])


def test_schemas_without_text_have_no_span_fields(tok):
    tables = tc.compile_tool_calls([_fn("f", {"x": {"type": "integer", "minimum": 0, "maximum": 3}})], tok)
    assert not tables.has_text and tables.code_appends is None and tables.text_tokens == 0
    assert tc.grammar(tables.spec).next.shape[1] == 256
    call = bind.parse_batch(tables, jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32))
    assert call.text_ids is None and call.text_len is None
    assert len(jax.tree_util.tree_leaves(call)) == 3


# ---------------------------------------------------------------------------------------------------------------
# Capture with the shipped tokenizer
# ---------------------------------------------------------------------------------------------------------------

# JSON-string text without escapes: printable ASCII minus quote and backslash, plus some non-ASCII.
TEXT = st.text(
    alphabet=st.sampled_from([chr(c) for c in range(0x20, 0x7F) if chr(c) not in '"\\'] + list("éü中😀")), max_size=40
)
HYP = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@HYP
@given(text=TEXT)
def test_captures_exactly_the_ids_between_the_quotes(tok, echo_tables, text):
    assume(not any(tag in text for tag in TAGS))  # the tags are tokens of their own (next test)
    content = _enc(tok, text)
    ids = _enc(tok, PRE) + content + _enc(tok, POST)
    kind, tool, args, text_ids, text_len = _parse(echo_tables, ids)
    if len(content) <= BOUND:
        assert (kind, tool, args) == (tc.KIND_OK, 0, [0])
        assert text_len.tolist() == [len(content)]
        assert text_ids[0, : len(content)].tolist() == content
        assert not text_ids[0, len(content) :].any()
        assert tc.parse_text(ECHO, tok.decode(ids)) == (tc.KIND_OK, 0, (0,))  # the JSON itself is fine
    else:  # over its bound: malformed
        assert (kind, tool, args, text_len.tolist()) == (tc.KIND_BAD_CALL, -1, [0], [0])
        assert not text_ids.any()


TAGS = ("<tool_call>", "</tool_call>")


def test_a_tool_call_tag_inside_the_text_ends_the_call(tok, echo_tables):
    ids = _enc(tok, PRE) + _enc(tok, "see </tool_call> here") + _enc(tok, POST)
    assert _parse(echo_tables, ids)[0] == tc.KIND_BAD_CALL


@HYP
@given(text=TEXT)
def test_unterminated_text_is_a_bad_call(tok, echo_tables, text):
    content = _enc(tok, text)
    closed = _enc(tok, PRE) + content + _enc(tok, "}}</tool_call>")  # no closing quote: the tag ends the call
    assert _parse(echo_tables, closed)[0] == tc.KIND_BAD_CALL
    truncated = _enc(tok, PRE) + content  # no closing tag at all
    assert _parse(echo_tables, truncated)[0] == tc.KIND_NO_CALL


def test_boundary_cases(tok, echo_tables):
    def call(text):
        return _parse(echo_tables, _enc(tok, PRE) + _enc(tok, text) + _enc(tok, POST))

    assert call("")[0] == tc.KIND_OK and call("")[4].tolist() == [0]
    ids = _enc(tok, "a b " * 20)[:BOUND]
    assert len(ids) == BOUND
    kind, _, _, text_ids, text_len = _parse(echo_tables, _enc(tok, PRE) + ids + _enc(tok, POST))
    assert (kind, text_len.tolist(), text_ids[0].tolist()) == (tc.KIND_OK, [BOUND], ids)
    ids = _enc(tok, "a b " * 20)[: BOUND + 1]
    assert _parse(echo_tables, _enc(tok, PRE) + ids + _enc(tok, POST))[0] == tc.KIND_BAD_CALL
    # The closing tag inside the text closes the call early: a bad call, as on the decoded text.
    assert call("a </tool_call> b")[0] == tc.KIND_BAD_CALL
    # The shipped tokenizer's own encoding of a whole call splits the quotes from the text.
    whole = _enc(tok, '<tool_call>{"arguments": {"text": "hello there"}, "name": "echo"}</tool_call>')
    kind, _, _, text_ids, text_len = _parse(echo_tables, whole)
    assert kind == tc.KIND_OK and tok.decode(text_ids[0, : text_len[0]].tolist()) == "hello there"


# ---------------------------------------------------------------------------------------------------------------
# Token merges across the quotes (a byte vocabulary with chosen merges)
# ---------------------------------------------------------------------------------------------------------------

MERGES = [b'"hi', b'hi"', b"hi", b'"}}', b'": "', b'""', b"<tool_call>", b"</tool_call>", b"\\n", b' "', b'"}']


@pytest.fixture(scope="module")
def byte_vocab():
    pieces = [bytes([c]) for c in range(256)] + MERGES
    return pieces, {p: i for i, p in enumerate(pieces)}


def _ids(index, *parts):
    """Token ids of ``parts``: a bytes part that is a merge is one token, any other bytes part one token a byte."""
    out = []
    for p in parts:
        out += [index[p]] if p in index and len(p) > 1 else [index[bytes([c])] for c in p]
    return out


@pytest.mark.parametrize(
    "parts, kind, want",
    [
        ((b"<tool_call>", b'{"name": "echo", "arguments": {"text', b'": "', b"hi", b'"}}', b"</tool_call>"), 0, ["hi"]),
        (
            (
                b"<tool_call>",
                b'{"name": "echo", "arguments": {"text":',
                b' "',
                b"hi",
                b"!",
                b'"}',
                b"}",
                b"</tool_call>",
            ),
            0,
            ["hi", "!"],
        ),
        ((b"<tool_call>", b'{"name": "echo", "arguments": {"text": ', b'""', b"}}", b"</tool_call>"), 0, []),
        ((b"<tool_call>", b'{"name": "echo", "arguments": {"text": ', b'"hi', b'"}}', b"</tool_call>"), 2, None),
        ((b"<tool_call>", b'{"name": "echo", "arguments": {"text": "', b'hi"', b"}}", b"</tool_call>"), 2, None),
        ((b"<tool_call>", b'{"name": "echo", "arguments": {"text": "', b"\\n", b'"}}', b"</tool_call>"), 2, None),
        ((b"<tool_call>", b'{"name": "echo", "arguments": {"text": "', b"\t", b'"}}', b"</tool_call>"), 2, None),
    ],
)
def test_quote_merges(byte_vocab, parts, kind, want):
    pieces, index = byte_vocab
    tables = tc.compile_tool_calls(ECHO, pieces=pieces)
    got = _parse(tables, _ids(index, *parts))
    assert got[0] == kind
    if want is not None:
        assert [pieces[i].decode() for i in got[3][0, : got[4][0]]] == want


def test_mixed_schema_spans(byte_vocab):
    pieces, index = byte_vocab
    tables = tc.compile_tool_calls(MIXED, pieces=pieces)
    assert tables.text_tokens == 6 and tables.tool_text_regs.shape == (3, 2)

    def run(body):
        ids = _ids(index, b"<tool_call>", *body, b"</tool_call>")
        kind, tool, args, text_ids, text_len = _parse(tables, ids)
        texts = [b"".join(pieces[i] for i in text_ids[m, : text_len[m]]).decode() for m in range(2)]
        return kind, tool, args, texts

    # Arguments first: "echo" and "say" are both candidates while the text is read.
    assert run([b'{"arguments": {"text": "', b"hi", b"!", b'"}, "name": "say"}']) == (2, -1, [0, 0], ["", ""])
    assert run([b'{"arguments": {"text": "', b"hi", b"!", b'"}, "name": "echo"}']) == (0, 0, [0, 0], ["hi!", ""])
    assert run([b'{"arguments": {"times": 2, "text": "', b"hi", b'"}, "name": "say"}']) == (0, 1, [2, 0], ["hi", ""])
    assert run([b'{"name": "say", "arguments": {"text": "', b"hi", b'", "times": 3}}']) == (0, 1, [3, 0], ["hi", ""])
    assert run([b'{"name": "say", "arguments": {"text": "', b"hi", b'", "times": 4}}'])[:2] == (3, 1)
    # Out of range and over-long: malformed wins.
    assert run([b'{"name": "say", "arguments": {"text": "', *[b"hi"] * 7, b'", "times": 4}}'])[:2] == (2, -1)
    assert run([b'{"name": "pair", "arguments": {"b": "', b"hi", b"x", b'", "a": "', b"!", b'"}}']) == (
        0,
        2,
        [0, 0],
        ["!", "hix"],
    )
    assert run([b'{"name": "pair", "arguments": {"b": "', b"hi", b'", "a": "', b"!", b"!", b"!", b"!", b'"}}'])[0] == 2


# ---------------------------------------------------------------------------------------------------------------
# Against the text reference: the token rules only ever turn a well-formed call into a bad one
# ---------------------------------------------------------------------------------------------------------------

# Call bodies of the MIXED schema with holes for free text (T0, T1) and an integer (N); a bytes part that is a
# merge of the byte vocabulary is one token, any other one token a byte.
BODIES = [
    [b'{"name": "echo", "arguments": {"text": "', "T0", b'"}}'],
    [b'{"arguments": {"text": "', "T0", b'"}, "name": "echo"}'],
    [b'{"name": "say", "arguments": {"text": "', "T0", b'", "times": ', "N", b"}}"],
    [b'{"arguments": {"times": ', "N", b', "text": "', "T0", b'"}, "name": "say"}'],
    [b'{"name": "pair", "arguments": {"a": "', "T0", b'", "b": "', "T1", b'"}}'],
]
TEXT_PARTS = [
    b"hi",
    b"!",
    b" ",
    b"hi there",
    b"<",
    b"\xc3\xa9",
    b"\xc3",
    b'"hi',
    b'hi"',
    b"\\n",
    b"\t",
    b"</tool_call>",
]
_PARSE_BATCH = jax.jit(tc.parse_full_batch, static_argnames="max_bytes")


def _texts_of(spec, text):
    """The called tool's free-text values per the JSON of the call (``parse_text`` said ok)."""
    import json

    start = text.find(tc.OPEN_TAG) + len(tc.OPEN_TAG)
    obj = json.loads(text[start : text.find(tc.CLOSE_TAG, start)])
    tool = next(t for t in spec if t.name == obj["name"])
    return [obj["arguments"][a.name] for a in tool.args if a.kind == "text"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_token_rules_only_reject_more_than_the_text_reference(byte_vocab, data):
    pieces, index = byte_vocab
    tables = tc.compile_tool_calls(MIXED, pieces=pieces)
    spec = tables.spec
    rows = []
    for _ in range(8):
        parts = [b"<tool_call>"]
        for p in data.draw(st.sampled_from(BODIES)):
            if p == "N":
                parts.append(data.draw(st.sampled_from([b"1", b"3", b"7"])))
            elif isinstance(p, str):  # mostly plain text, sometimes a token the rules reject
                plain = st.sampled_from(TEXT_PARTS[:5])
                parts += data.draw(st.lists(st.one_of(plain, plain, plain, st.sampled_from(TEXT_PARTS)), max_size=8))
            else:
                parts.append(p)
        parts.append(b"</tool_call>")
        if data.draw(st.booleans()):  # a near miss: one part dropped
            del parts[data.draw(st.integers(0, len(parts) - 1))]
        rows.append(_ids(index, *parts))
    cap = data.draw(st.sampled_from([None, 40, 90]))
    width = max(1, max(len(r) for r in rows))
    ids = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
    lengths = np.array([len(r) for r in rows], np.int32)
    kind, tool, args, text_ids, text_len = jax.device_get(
        _PARSE_BATCH(tables, jnp.asarray(ids), jnp.asarray(lengths), max_bytes=cap)
    )
    for r, row in enumerate(rows):
        data_bytes = b"".join(pieces[i] for i in row)[:cap]
        text = data_bytes.decode("utf-8", errors="replace")
        want = tc.parse_text(spec, text)
        got = (int(kind[r]), int(tool[r]), tuple(int(a) for a in args[r]))
        if got[0] == tc.KIND_BAD_CALL and want[0] in (tc.KIND_OK, tc.KIND_OUT_OF_RANGE):
            continue  # a token rule (quote merged with text, over the bound) rejected a well-formed call
        assert got == want, (text, want, got)
        if got[0] == tc.KIND_OK:
            texts = [
                b"".join(pieces[i] for i in text_ids[r, m, : text_len[r, m]]).decode("utf-8", "replace")
                for m in range(len(_texts_of(spec, text)))
            ]
            assert texts == _texts_of(spec, text)
            assert not text_len[r, len(texts) :].any()
