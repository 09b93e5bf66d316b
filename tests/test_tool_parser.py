"""Tests for reno_jax.envs.tictactoe.tool_parser: the host reference grammar and the jitted byte-DFA parser's
agreement."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reno_jax.envs.tictactoe import tool_parser as tp
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.protocol import toolcall
from reno_jax.protocol.tokens import token_bytes

T = 64  # fixed token length: one compiled parser serves every example
B = 8  # examples per hypothesis draw (one vmapped call)
OK, NO, BAD, OOR = toolcall.KIND_OK, toolcall.KIND_NO_CALL, toolcall.KIND_BAD_CALL, toolcall.KIND_OUT_OF_RANGE


def call(body):
    return f"<tool_call>{body}</tool_call>"


CANON = '{"name": "choose_square", "arguments": {"square": 5}}'

REFERENCE_CASES = [
    (call(CANON), (OK, 5)),
    ("<think>center</think>\n" + call(CANON) + "<|im_end|>", (OK, 5)),
    (call(' \n{"arguments":{"square":7},"name":"choose_square"}\t\r\n'), (OK, 7)),
    (call('{ "name" : "choose_square" , "arguments" : { "square" : 9 } }'), (OK, 9)),
    (call(CANON.replace("5", "0")), (OOR, 0)),
    (call(CANON.replace("5", "-0")), (OOR, 0)),
    (call(CANON.replace("5", "-1")), (OOR, 0)),
    (call(CANON.replace("5", "10")), (OOR, 0)),
    (call(CANON.replace("5", "9" * 40)), (OOR, 0)),
    (call(CANON.replace("5", "05")), (BAD, 0)),
    (call(CANON.replace("5", "-05")), (BAD, 0)),
    (call(CANON.replace("5", "+5")), (BAD, 0)),
    (call(CANON.replace("5", "5.0")), (BAD, 0)),
    (call(CANON.replace("5", "5e0")), (BAD, 0)),
    (call(CANON.replace("5", '"5"')), (BAD, 0)),
    (call(CANON.replace("5", "true")), (BAD, 0)),
    (call(CANON.replace("5", "null")), (BAD, 0)),
    (call(CANON.replace("5", "[5]")), (BAD, 0)),
    (call(CANON.replace("5", "NaN")), (BAD, 0)),
    (call(CANON.replace("choose_square", "choose")), (BAD, 0)),
    (call(CANON.replace("choose_square", "\\u0063hoose_square")), (BAD, 0)),  # escapes are rejected
    (call(CANON.replace('"square": 5', '"square": 5, "x": 1')), (BAD, 0)),  # extra key
    (call(CANON[:-1] + ', "id": 1}'), (BAD, 0)),  # extra key
    (call('{"name": "choose_square", "name": "choose_square", "arguments": {"square": 5}}'), (BAD, 0)),
    (call(CANON[:-1]), (BAD, 0)),  # missing brace
    (call(CANON + "}"), (BAD, 0)),
    (call("[" + CANON + "]"), (BAD, 0)),
    (call(""), (BAD, 0)),
    (call(CANON + "\u00a0"), (BAD, 0)),  # non-JSON whitespace
    ("<tool_call>" + CANON, (NO, 0)),  # truncated
    ("<tool_call>" + CANON + "</tool_cal", (NO, 0)),
    ("no call at all " + CANON, (NO, 0)),
    ("</tool_call>" + call(CANON), (OK, 5)),
    (call(CANON.replace("5", "3")) + call(CANON), (OK, 3)),  # the first call counts
    (call(CANON.replace("5", "0")) + call(CANON), (OOR, 0)),
    ("<tool_call>" + call(CANON), (BAD, 0)),  # the body starts with a second opening tag
    (call(CANON + "<"), (BAD, 0)),
]


@pytest.mark.parametrize("text, expected", REFERENCE_CASES)
def test_reference_parser_grammar(text, expected):
    assert tp.parse_tool_call_text(text) == expected


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers and the compiled parser
# ---------------------------------------------------------------------------------------------------------------


def _other_tokenizer():
    """A GPT-2-regex byte-level BPE with a different vocabulary; <tool_call> is NOT one token here."""
    rng = random.Random(0)
    words = [
        "tool",
        "call",
        "name",
        "square",
        "arguments",
        "choose",
        "<",
        ">",
        "{",
        "}",
        '"',
        ":",
        ",",
        "é",
        "中",
        "🙂",
        "\n",
        "  ",
    ]
    corpus = ["".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(20)) for _ in range(400)]
    corpus += [call(CANON)] * 50
    raw = tokenizer_lib.train_byte_level_bpe(corpus, 300, special_tokens=("<|endoftext|>", "<|im_end|>"))
    return tokenizer_lib.wrap_tokenizer(raw, eos_token="<|im_end|>")


def _pad_width(tables, width):
    """Same-shaped tables for every tokenizer (built with a common vocab_size), so one compiled function serves
    all of them."""
    tb = np.zeros((tables.vocab_size, width), np.uint8)
    tb[:, : tables.max_bytes] = np.asarray(tables.token_bytes)
    return tables.replace(token_bytes=jnp.asarray(tb))


@pytest.fixture(scope="module")
def setups():
    toks = {"shipped": tokenizer_lib.load_tokenizer(None), "other": _other_tokenizer()}
    vocab = max(len(token_bytes(t)) for t in toks.values())
    raw = {k: tp.build_parser_tables(t, vocab_size=vocab) for k, t in toks.items()}
    width = max(r.max_bytes for r in raw.values())
    return {k: (toks[k], _pad_width(raw[k], width)) for k in toks}


_PARSE = jax.jit(tp.parse_tool_call_batch)


def assert_parsers_agree(tok, tables, id_lists):
    """Jitted parser on B padded rows == reference on the decoded text of each row."""
    ids = np.zeros((B, T), np.int32)
    lengths = np.zeros((B,), np.int32)
    for r, row in enumerate(id_lists[:B]):
        row = list(row)[:T]
        ids[r, : len(row)] = row
        lengths[r] = len(row)
    kinds, squares = _PARSE(tables, jnp.asarray(ids), jnp.asarray(lengths))
    for r in range(B):
        text = tokenizer_lib.decode(tok, ids[r, : lengths[r]])
        want = tp.parse_tool_call_text(text)
        assert (int(kinds[r]), int(squares[r])) == want, (text, want, int(kinds[r]), int(squares[r]))


def _encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("which", ["shipped", "other"])
def test_fixed_cases_agree(setups, which):
    tok, tables = setups[which]
    texts = [t for t, _ in REFERENCE_CASES]
    for i in range(0, len(texts), B):
        chunk = [_encode(tok, t) for t in texts[i : i + B]]
        chunk += [[]] * (B - len(chunk))
        assert_parsers_agree(tok, tables, chunk)


def test_short_rows_take_the_unrolled_path(setups):
    """Rows of at most toolcall._UNROLL_MAX tokens are parsed by a Python-unrolled loop (T = 64 elsewhere: a scan)."""
    short = 24
    assert short <= toolcall._UNROLL_MAX < T
    parse = jax.jit(tp.parse_tool_call_batch)
    for tok, tables in setups.values():
        rows = [_encode(tok, t)[:short] for t, _ in REFERENCE_CASES]
        for i in range(0, len(rows), B):
            chunk = rows[i : i + B] + [[]] * (B - len(rows[i : i + B]))
            ids = np.zeros((B, short), np.int32)
            lengths = np.array([len(r) for r in chunk], np.int32)
            for r, row in enumerate(chunk):
                ids[r, : len(row)] = row
            kinds, squares = parse(tables, jnp.asarray(ids), jnp.asarray(lengths))
            for r, row in enumerate(chunk):
                want = tp.parse_tool_call_text(tokenizer_lib.decode(tok, row))
                assert (int(kinds[r]), int(squares[r])) == want, (tokenizer_lib.decode(tok, row), want)


def test_byte_table_matches_decode(setups):
    rng = np.random.default_rng(0)
    for tok, tables in setups.values():
        raw = token_bytes(tok)
        for _ in range(50):
            ids = rng.integers(0, len(raw), size=rng.integers(1, 20)).tolist()
            want = tokenizer_lib.decode(tok, ids)
            assert b"".join(raw[i] for i in ids).decode("utf-8", errors="replace") == want
        n = len(raw)
        assert np.array_equal(np.asarray(tables.token_len)[:n], [len(p) for p in raw])


def test_byte_level_mapping_and_added_tokens(setups):
    tok, _ = setups["shipped"]
    raw = token_bytes(tok)
    assert raw[tok.convert_tokens_to_ids("<|im_end|>")] == b"<|im_end|>"
    assert raw[tok.convert_tokens_to_ids("<tool_call>")] == b"<tool_call>"
    assert raw[tok.convert_tokens_to_ids("Ġ")] == b" "  # byte-level space
    assert raw[tok.convert_tokens_to_ids("Ċ")] == b"\n"
    assert sorted(len(raw[tok.convert_tokens_to_ids(c)]) for c in "123456789") == [1] * 9
    # Lone bytes of multi-byte characters are partial UTF-8 tokens.
    assert raw[tok.convert_tokens_to_ids("Ã")] == b"\xc3"


def _batch(rows):
    ids = np.zeros((B, T), np.int32)
    lengths = np.zeros((B,), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        lengths[i] = len(r)
    return ids, lengths


def test_vmap_matches_single_and_length_is_respected(setups):
    tok, tables = setups["shipped"]
    texts = [call(CANON), call(CANON.replace("5", "12")), "hello", call(CANON.replace("5", "x"))]
    ids, lengths = _batch([_encode(tok, t) for t in texts])
    # Row 4: row 0 cut one token before its end (</tool_call> missing) -> no_call. Row 5: row 0 followed by
    # garbage past its length, which must be ignored.
    ids[4], lengths[4] = ids[0], lengths[0] - 1
    ids[5], lengths[5] = ids[0], lengths[0]
    ids[5, lengths[0] :] = tok.convert_tokens_to_ids("<tool_call>")
    kinds, squares = _PARSE(tables, jnp.asarray(ids), jnp.asarray(lengths))
    assert kinds.tolist()[:6] == [OK, OOR, NO, BAD, NO, OK] and squares.tolist()[:6] == [5, 0, 0, 0, 0, 5]
    single = jax.jit(tp.parse_tool_call)
    for i in (0, 1, 4):
        k, s = single(tables, ids[i], lengths[i])
        assert (int(k), int(s)) == (int(kinds[i]), int(squares[i]))


def test_max_bytes_cap_truncates(setups):
    tok, tables = setups["shipped"]
    cap = 100
    rows = []
    for extra in (0, 1):  # the call's last byte lands exactly on the cap, then one byte past it
        prefix = "x" * (cap - len(call(CANON).encode()) + extra)
        rows.append(_encode(tok, prefix) + _encode(tok, call(CANON)))
    ids, lengths = _batch(rows)
    capped = jax.jit(tp.parse_tool_call_batch, static_argnames="max_bytes")
    kinds, squares = capped(tables, jnp.asarray(ids), jnp.asarray(lengths), max_bytes=cap)
    assert kinds.tolist()[:2] == [OK, NO] and squares.tolist()[:2] == [5, 0]
    full_kinds, _ = _PARSE(tables, jnp.asarray(ids), jnp.asarray(lengths))
    assert full_kinds.tolist()[:2] == [OK, OK]


# ---------------------------------------------------------------------------------------------------------------
# Hypothesis: agreement on structured near-misses and on garbage
# ---------------------------------------------------------------------------------------------------------------

# JSON whitespace, with a rare non-JSON space (U+00A0, vertical tab) so that most bodies stay well-formed.
WS = st.sampled_from(["", "", "", "", " ", " ", " ", "  ", "\n", "\t", "\r\n", " \n "] * 3 + ["\u00a0"])
VALUES = st.one_of(
    st.integers(1, 9).map(str),
    st.integers(-12, 15).map(str),
    st.sampled_from(
        [
            "05",
            "-0",
            "00",
            "-05",
            "5.0",
            "5e0",
            "1E1",
            "5.",
            '"5"',
            "true",
            "false",
            "null",
            "[5]",
            "{}",
            "+5",
            "-",
            "",
            "9" * 25,
            "5 5",
            "NaN",
            "-Infinity",
            "0x5",
            "٥",
            "5}",
        ]
    ),
)
NAMES = st.sampled_from(
    ['"choose_square"'] * 8
    + [
        '"choose_squares"',
        '"Choose_square"',
        '""',
        "choose_square",
        '"\\u0063hoose_square"',
        '"choose_square',
        "5",
        '"choose\\_square"',
    ]
)
KEYS = st.sampled_from(["name", "arguments", "square", "nam", "Name", "id"])
PREFIXES = st.sampled_from(
    [
        "",
        "",
        "<think>I take 5.</think>",
        "Sure. ",
        "<think>\n",
        "</tool_call>",
        "<tool_",
        "<|im_end|>",
        "é中🙂 ",
        "<tool_call>",
        "<<tool_call",
    ]
)
SUFFIXES = st.sampled_from(["", "<|im_end|>", call(CANON), "</tool_call>", " trailing", "<tool_call>"])


# Hypothesis does not draw uniformly (it favours the first/simplest choice), so the odds are spelled out here.
OFTEN = st.sampled_from([True] * 11 + [False])
RARELY = st.sampled_from([False] * 11 + [True])


@st.composite
def call_texts(draw):
    w = lambda: draw(WS)  # noqa: E731
    value = draw(VALUES)
    square_key = '"square"' if draw(OFTEN) else f'"{draw(KEYS)}"'
    arg_members = [f"{square_key}{w()}:{w()}{value}"]
    if draw(RARELY):
        arg_members.append(f'"{draw(KEYS)}"{w()}:{w()}{draw(VALUES)}')
    args = "{" + w() + f"{w()},{w()}".join(arg_members) + w() + "}"
    name_key = '"name"' if draw(OFTEN) else f'"{draw(KEYS)}"'
    args_key = '"arguments"' if draw(OFTEN) else f'"{draw(KEYS)}"'
    members = [f"{name_key}{w()}:{w()}{draw(NAMES)}", f"{args_key}{w()}:{w()}{args}"]
    if draw(st.booleans()):
        members.reverse()
    if draw(RARELY):
        members.insert(draw(st.integers(0, len(members))), f'"{draw(KEYS)}"{w()}:{w()}{draw(VALUES)}')
    body = w() + "{" + w() + f"{w()},{w()}".join(members) + w() + "}" + w()
    if draw(RARELY) and body:  # delete or duplicate one character (missing brace, etc.)
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + body[i + 1 :] if draw(st.booleans()) else body[:i] + body[i] + body[i:]
    text = draw(PREFIXES) + "<tool_call>" + body + "</tool_call>" + draw(SUFFIXES)
    if draw(RARELY):  # truncation
        text = text[: draw(st.integers(0, len(text)))]
    return text


@st.composite
def wellformed_calls(draw):
    """Only legal JSON variations: whitespace, key order, any integer (ok or out_of_range), text around."""
    ws = st.sampled_from(["", " ", "  ", "\n", "\t", "\r\n", " \n\t "])
    w = lambda: draw(ws)  # noqa: E731
    value = str(draw(st.one_of(st.integers(1, 9), st.integers(-(10**30), 10**30))))
    args = "{" + w() + '"square"' + w() + ":" + w() + value + w() + "}"
    members = ['"name"' + w() + ":" + w() + '"choose_square"', '"arguments"' + w() + ":" + w() + args]
    if draw(st.booleans()):
        members.reverse()
    body = w() + "{" + w() + (w() + "," + w()).join(members) + w() + "}" + w()
    return draw(PREFIXES) + call(body) + draw(SUFFIXES)


HYP = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.mark.parametrize("which", ["shipped", "other"])
@HYP
@given(texts=st.lists(call_texts(), min_size=B, max_size=B))
def test_structured_calls_agree(setups, which, texts):
    tok, tables = setups[which]
    assert_parsers_agree(tok, tables, [_encode(tok, t) for t in texts])


@pytest.mark.parametrize("which", ["shipped", "other"])
@HYP
@given(texts=st.lists(wellformed_calls(), min_size=B, max_size=B))
def test_wellformed_calls_agree(setups, which, texts):
    tok, tables = setups[which]
    kinds = {tp.parse_tool_call_text(t)[0] for t in texts}
    assert kinds <= {OK, OOR, BAD}  # BAD only when the prefix opened an earlier call
    assert_parsers_agree(tok, tables, [_encode(tok, t) for t in texts])


@pytest.mark.parametrize("which", ["shipped", "other"])
@HYP
@given(data=st.data())
def test_token_garbage_agrees(setups, which, data):
    """Random token ids (partial UTF-8, special tokens) mixed with pieces of real calls."""
    tok, tables = setups[which]
    pieces = [_encode(tok, s) for s in ["<tool_call>", "</tool_call>", call(CANON), '{"square": ', "}}", "7"]]
    rows = []
    for _ in range(B):
        parts = data.draw(
            st.lists(st.one_of(st.lists(st.integers(0, len(tok) - 1), max_size=6), st.sampled_from(pieces)), max_size=8)
        )
        rows.append([i for p in parts for i in p])
    assert_parsers_agree(tok, tables, rows)


@pytest.mark.parametrize("which", ["shipped", "other"])
@HYP
@given(blobs=st.lists(st.binary(max_size=60), min_size=B, max_size=B), splice=st.integers(0, 60))
def test_byte_garbage_agrees(setups, which, blobs, splice):
    """Random bytes (decoded with replacement) with a call spliced in at a random point."""
    tok, tables = setups[which]
    texts = []
    for i, blob in enumerate(blobs):
        s = blob.decode("utf-8", errors="replace")
        if i % 2:
            s = s[:splice] + call(CANON) + s[splice:]
        texts.append(s)
    assert_parsers_agree(tok, tables, [_encode(tok, t) for t in texts])


# ---------------------------------------------------------------------------------------------------------------
# Token-level automaton
# ---------------------------------------------------------------------------------------------------------------


def _feed_bytes(grammar, state, data):
    """Byte-by-byte run of the minimized grammar automaton: (state, last register store or -1)."""
    reg = -1
    for b in data:
        op = int(grammar.op[state, b])
        state = int(grammar.next[state, b])
        reg = op if op >= 0 else reg
    return state, reg


def test_token_table_is_the_byte_automaton_lifted(setups):
    g = tp._grammar()
    # The grammar is a fixed shape: a small automaton, independent of the tokenizer.
    print(
        f"\n[parser] automaton states: {g.num_states} (product before minimization: {g.raw_states}); "
        f"token table at a 157k vocab: {g.num_states * 157_000 * 2 / 2**20:.0f} MiB (int16)"
    )
    assert g.num_states <= 160 and g.next.shape == g.op.shape == (g.num_states, 256)
    assert g.accept_state != g.bad_state
    for s in (g.accept_state, g.bad_state):  # closed calls are absorbing and never touch the register
        assert (g.next[s] == s).all() and (g.op[s] == -1).all()
    rng = np.random.default_rng(1)
    for tok, tables in setups.values():
        raw = token_bytes(tok)
        assert tables.class_next.dtype == jnp.int16 and tables.class_next.shape[0] == g.num_states
        assert tables.token_class.shape == (tables.vocab_size + 1,)
        print(f"[parser] {tables.vocab_size} token ids in {tables.num_classes} classes")
        assert tables.num_classes < tables.vocab_size // 2  # most tokens behave alike
        table = np.asarray(tables.class_next).astype(np.int32)[:, np.asarray(tables.token_class)]  # [S, V + 1]
        # Column V (no token) and ids past the tokenizer's vocab (no text) are the identity.
        ident = (np.arange(g.num_states) << 4)[:, None]
        assert (table[:, len(raw) :] == ident).all()
        grammar_bytes = set(b'<>/{}":,-\\ \t\n0123456789tool_call choose_square name arguments')
        # Random ids plus every token made only of bytes the grammar cares about (tags, keys, digits, ...).
        picks = rng.integers(0, len(raw), size=40).tolist()
        picks += [i for i, p in enumerate(raw) if p and set(p) <= grammar_bytes][:80]
        for v in picks:
            for s in range(g.num_states):
                state, reg = _feed_bytes(g, s, raw[v])
                assert table[s, v] == (state << 4 | (reg + 1)), (s, raw[v])


@pytest.mark.parametrize("which", ["shipped", "other"])
@HYP
@given(texts=st.lists(st.tuples(st.text(alphabet="xé<> ", max_size=24), call_texts()), min_size=B, max_size=B))
def test_cap_cuts_inside_tokens(setups, which, texts):
    """max_bytes that lands anywhere (inside multi-byte tokens too) == the reference on the cut text."""
    tok, tables = setups[which]
    cap = 90  # the cut lands inside the call (often inside a multi-byte tag token) or past its end
    raw = token_bytes(tok)
    rows = [_encode(tok, prefix + t) for prefix, t in texts]
    ids, lengths = _batch([r[:T] for r in rows])
    kinds, squares = _CAPPED(tables, jnp.asarray(ids), jnp.asarray(lengths), max_bytes=cap)
    for r in range(B):
        data = b"".join(raw[i] for i in ids[r, : lengths[r]])[:cap]
        want = tp.parse_tool_call_text(data.decode("utf-8", errors="replace"))
        assert (int(kinds[r]), int(squares[r])) == want, (data, want)


_CAPPED = jax.jit(tp.parse_tool_call_batch, static_argnames="max_bytes")
