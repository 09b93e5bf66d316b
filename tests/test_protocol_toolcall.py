"""Tests for reno_jax.protocol.toolcall (schemas -> host reference + jitted token automaton) and protocol.stop.

The jitted parser is compared with the host reference on a multi-tool schema, over near-miss calls drawn from a
grammar and over random re-tokenizations of the same text (so token boundaries fall everywhere).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reno_jax.envs.tictactoe import wording
from reno_jax.protocol import stop as stop_lib
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.protocol import tokens as tokens_lib
from reno_jax.protocol import toolcall as tc

OK, NO, BAD, OOR = tc.KIND_OK, tc.KIND_NO_CALL, tc.KIND_BAD_CALL, tc.KIND_OUT_OF_RANGE
B, T = 8, 96  # rows per hypothesis draw (one vmapped call) and tokens per row (the scan path)


def _fn(name, props=None):
    props = props or {}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "d",
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }


def _int(lo, hi):
    return {"type": "integer", "minimum": lo, "maximum": hi}


MULTI = [
    _fn("drop_piece", {"column": _int(1, 7)}),
    _fn("move", {"dx": _int(0, 2), "dy": _int(0, 2), "speed": {"type": "string", "enum": ["slow", "fast"]}}),
    _fn("pass"),
]
DROP, MOVE, PASS = 0, 1, 2


def call(body):
    return f"<tool_call>{body}</tool_call>"


REFERENCE_CASES = [
    (call('{"name": "drop_piece", "arguments": {"column": 4}}'), (OK, DROP, (4, 0, 0))),
    (call('{"arguments": {"column": 7}, "name": "drop_piece"}'), (OK, DROP, (7, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": 1, "dy": 2, "speed": "fast"}}'), (OK, MOVE, (1, 2, 1))),
    (call(' {"arguments":{"speed":"slow","dy":0,"dx":2},\n"name":"move"}\t'), (OK, MOVE, (2, 0, 0))),
    (call('{"name": "pass", "arguments": {}}'), (OK, PASS, (0, 0, 0))),
    (call('{"arguments": { }, "name": "pass"}'), (OK, PASS, (0, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": 3, "dy": 2, "speed": "fast"}}'), (OOR, MOVE, (0, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": -0, "dy": 2, "speed": "fast"}}'), (OOR, MOVE, (0, 0, 0))),
    (call('{"name": "drop_piece", "arguments": {"column": 0}}'), (OOR, DROP, (0, 0, 0))),
    (call('{"name": "drop_piece", "arguments": {"column": 99999999999999999999999}}'), (OOR, DROP, (0, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": 3, "dy": 2, "speed": "medium"}}'), (BAD, -1, (0, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": 1, "dy": 2}}'), (BAD, -1, (0, 0, 0))),  # missing argument
    (call('{"name": "move", "arguments": {"dx": 1, "dx": 1, "dy": 2, "speed": "slow"}}'), (BAD, -1, (0, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": 1, "dy": 2, "speed": "slow", "dz": 0}}'), (BAD, -1, (0, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": 01, "dy": 2, "speed": "slow"}}'), (BAD, -1, (0, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": 1, "dy": 2, "speed": "sl\\u006fw"}}'), (BAD, -1, (0, 0, 0))),
    (call('{"name": "move", "arguments": {"dx": 1, "dy": 2, "speed": 1}}'), (BAD, -1, (0, 0, 0))),
    (call('{"name": "pass", "arguments": {"column": 1}}'), (BAD, -1, (0, 0, 0))),
    (call('{"name": "drop_piece", "arguments": {}}'), (BAD, -1, (0, 0, 0))),
    (call('{"name": "jump", "arguments": {}}'), (BAD, -1, (0, 0, 0))),
    (call('{"arguments": {"column": 3}, "name": "move"}'), (BAD, -1, (0, 0, 0))),  # another tool's arguments
    (call('{"name": "pass", "arguments": {}'), (BAD, -1, (0, 0, 0))),
    ("<tool_call>" + '{"name": "pass", "arguments": {}}', (NO, -1, (0, 0, 0))),
    ("nothing here", (NO, -1, (0, 0, 0))),
    ("<think>" + call('{"name": "pass", "arguments": {}}') + "</think><|im_end|>", (OK, PASS, (0, 0, 0))),
]


@pytest.mark.parametrize("text, expected", REFERENCE_CASES)
def test_reference_parser(text, expected):
    assert tc.parse_text(MULTI, text) == expected


# ---------------------------------------------------------------------------------------------------------------
# Compiled tables
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return tokenizer_lib.load_tokenizer(None)


@pytest.fixture(scope="module")
def tables(tok):
    return tc.compile_tool_calls(MULTI, tok)


_PARSE = jax.jit(tc.parse_batch, static_argnames="max_bytes")


def _rows(id_lists, width=T):
    ids = np.zeros((len(id_lists), width), np.int32)
    lengths = np.zeros((len(id_lists),), np.int32)
    for r, row in enumerate(id_lists):
        row = list(row)[:width]
        ids[r, : len(row)] = row
        lengths[r] = len(row)
    return ids, lengths


def assert_agree(tok, tables, id_lists, width=T, max_bytes=None):
    """Jitted parser on padded rows == reference on the decoded text (cut at max_bytes) of each row."""
    id_lists = list(id_lists) + [[]] * (-len(id_lists) % B)
    pieces = tokens_lib.token_bytes(tok)
    for i in range(0, len(id_lists), B):
        ids, lengths = _rows(id_lists[i : i + B], width)
        kinds, tools, args = _PARSE(tables, jnp.asarray(ids), jnp.asarray(lengths), max_bytes=max_bytes)
        for r in range(B):
            data = b"".join(pieces[j] for j in ids[r, : lengths[r]])
            if max_bytes is not None:
                data = data[:max_bytes]
            text = data.decode("utf-8", errors="replace")
            want = tc.parse_text(tables, text)
            got = (int(kinds[r]), int(tools[r]), tuple(int(a) for a in args[r]))
            assert got == want, (text, want, got)


def _encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_tables_shape_and_sizes(tok, tables):
    single = tc.compile_tool_calls([wording.tool_schema()], tok)
    # The single-register schema compiles to the original tic-tac-toe tables: same states, packing and dtype.
    assert (single.num_states, single.reg_bits, single.class_next.dtype) == (137, 4, jnp.int16)
    assert single.class_pair_next is not None and single.store_val is None and single.result is not None
    print(
        f"\n[toolcall] choose_square: {single.num_states} states (raw {single.raw_states}), "
        f"{single.num_classes} classes, table {single.class_next.shape} {single.class_next.dtype}, pair "
        f"{single.class_pair_next.shape}"
    )
    pair = None if tables.class_pair_next is None else tables.class_pair_next.shape
    print(
        f"[toolcall] multi: {tables.num_states} states (raw {tables.raw_states}), {tables.num_classes} classes, "
        f"table {tables.class_next.shape} {tables.class_next.dtype}, reg_bits {tables.reg_bits}, "
        f"{tables.store_val.shape[0]} store codes x {tables.num_registers} registers, pair {pair}"
    )
    assert (tables.num_tools, tables.max_args, tables.num_registers) == (3, 3, 4)
    assert tables.token_class.shape == (tables.vocab_size + 1,)
    assert tables.num_classes < tables.vocab_size // 2


def test_fixed_cases_agree(tok, tables):
    texts = [t for t, _ in REFERENCE_CASES]
    assert_agree(tok, tables, [_encode(tok, t) for t in texts])
    # Short rows take the Python-unrolled loop instead of the scan.
    assert_agree(tok, tables, [_encode(tok, t)[: tc._UNROLL_MAX] for t in texts], width=tc._UNROLL_MAX)


def test_lifted_table_is_the_byte_automaton(tok, tables):
    """Every (state, token) entry == feeding the token's bytes one at a time through the byte table."""
    pieces = tokens_lib.token_bytes(tok)
    bits, low = tables.reg_bits, (1 << tables.reg_bits) - 1
    table = np.asarray(tables.class_next).astype(np.int64)[:, np.asarray(tables.token_class)]
    byte_next = np.asarray(tables.byte_next)
    sv = np.asarray(tables.store_val)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(pieces), 30).tolist()
    picks += [i for i, p in enumerate(pieces) if p and set(p) <= set(b'{}":, 0123456789-')][:30]
    for v in picks:
        for s in range(tables.num_states):
            state, regs = s, {}
            for byte in pieces[v]:
                e = int(byte_next[state, byte])
                regs.update({r: int(x) for r, x in enumerate(sv[e & low]) if x >= 0})
                state = e >> bits
            e = int(table[s, v])
            assert e >> bits == state
            assert {r: int(x) for r, x in enumerate(sv[e & low]) if x >= 0} == regs, (s, pieces[v])


def test_max_bytes_cut(tok, tables):
    text = call('{"name": "move", "arguments": {"dx": 1, "dy": 2, "speed": "fast"}}')
    rows = [_encode(tok, "x" * k + text) for k in range(B)]
    n = len(text.encode())
    assert_agree(tok, tables, rows, max_bytes=n + 3)  # the call ends exactly on the cap for k = 3
    kinds, _, _ = _PARSE(tables, *map(jnp.asarray, _rows(rows)), max_bytes=n + 3)
    assert kinds.tolist() == [OK] * 4 + [NO] * 4


def test_single_register_wide_range_without_result_table(tok):
    """One integer with a wide range: the packed carry is too large for a result table; codes are decoded."""
    schema = [_fn("pick", {"n": _int(0, 300)}), _fn("none")]
    tables = tc.compile_tool_calls(schema, tok)
    assert tables.result is None and tables.store_val is None and tables.class_next.dtype == jnp.int32
    texts = [call(f'{{"name": "pick", "arguments": {{"n": {v}}}}}') for v in (0, 7, 42, 300, 301, 3000, -3)]
    texts += [call('{"arguments": {}, "name": "none"}')]
    got = [tc.parse_text(schema, t) for t in texts]
    assert [g[0] for g in got] == [OK] * 4 + [OOR] * 3 + [OK] and [g[2] for g in got][:4] == [(0,), (7,), (42,), (300,)]
    assert_agree(tok, tables, [_encode(tok, t) for t in texts])


def test_enum_only_and_decode_args(tok):
    schema = [_fn("say", {"word": {"type": "string", "enum": ["a<b", "ab", "", "yes"]}})]
    tables = tc.compile_tool_calls(schema, tok)
    words = ["a<b", "ab", "", "yes", "a", "no", "abc"]
    texts = [call(f'{{"name": "say", "arguments": {{"word": "{w}"}}}}') for w in words]
    assert [tc.parse_text(schema, t)[0] for t in texts] == [OK] * 4 + [BAD] * 3
    assert tc.decode_args(schema, 0, tc.parse_text(schema, texts[0])[2]) == {"word": "a<b"}
    assert_agree(tok, tables, [_encode(tok, t) for t in texts])


# ---------------------------------------------------------------------------------------------------------------
# Hypothesis: near-miss calls and random tokenizations
# ---------------------------------------------------------------------------------------------------------------

WS = st.sampled_from(["", "", "", "", " ", " ", " ", "  ", "\n", "\t", "\r\n", " \n "] * 8 + ["\u00a0"])
OFTEN = st.sampled_from([True] * 14 + [False])
RARELY = st.sampled_from([False] * 14 + [True])
RANGES = {"column": (1, 7), "dx": (0, 2), "dy": (0, 2)}
INT_NEAR_MISSES = [
    "-0",
    "-1",
    "00",
    "01",
    "-05",
    "1.0",
    "2e0",
    '"1"',
    "true",
    "null",
    "[1]",
    "{}",
    "+1",
    "-",
    "",
    "9" * 25,
    "1 1",
    "NaN",
    "٣",
    "10",
]


def int_values(key):
    lo, hi = RANGES.get(key, (0, 9))
    # Mostly in range, so that calls with several arguments are often well formed as a whole.
    category = st.sampled_from(["in"] * 7 + ["out"] * 2 + ["miss"])
    return category.flatmap(
        lambda c: (
            st.integers(lo, hi).map(str)
            if c == "in"
            else st.sampled_from([str(lo - 1), str(hi + 1), str(hi + 10)])
            if c == "out"
            else st.sampled_from(INT_NEAR_MISSES)
        )
    )


ENUM_VALUES = st.sampled_from(
    ['"slow"', '"fast"'] * 10 + ['"slo"', '"Slow"', '""', '"fast "', "fast", "1", '"fa\\u0073t"', '"slowfast"', '"slow']
)
TOOL_NAMES = st.sampled_from(["drop_piece", "move", "pass"] * 6 + ["Move", "mov", "moves", "", "pass ", "dro"])
ARG_KEYS = {"drop_piece": ["column"], "move": ["dx", "dy", "speed"], "pass": []}
EXTRA_KEYS = st.sampled_from(["dz", "column", "dx", "speed", "name", "Dx"])
PREFIXES = st.sampled_from(
    [
        "",
        "",
        "<think>pass?</think>",
        "Sure. ",
        "</tool_call>",
        "<tool_",
        "<|im_end|>",
        "é中🙂 ",
        "<tool_call>",
        "<<tool_call",
    ]
)
SUFFIXES = st.sampled_from(
    ["", "<|im_end|>", "</tool_call>", " trailing", "<tool_call>", call('{"name": "pass", "arguments": {}}')]
)


@st.composite
def call_texts(draw):
    w = lambda: draw(WS)  # noqa: E731
    name = draw(TOOL_NAMES)
    keys_of = (
        draw(st.sampled_from([name] * 6 + list(ARG_KEYS)))
        if name in ARG_KEYS
        else draw(st.sampled_from(list(ARG_KEYS)))
    )
    keys = list(draw(st.permutations(ARG_KEYS[keys_of])))
    if keys and draw(RARELY):
        keys.pop(draw(st.integers(0, len(keys) - 1)))  # missing argument
    if draw(RARELY):
        keys.insert(draw(st.integers(0, len(keys))), draw(EXTRA_KEYS))  # extra or duplicate argument
    members = []
    for k in keys:
        value = draw(ENUM_VALUES) if k == "speed" else draw(int_values(k))
        members.append(f'"{k}"{w()}:{w()}{value}')
    args = "{" + w() + f"{w()},{w()}".join(members) + w() + "}"
    name_value = f'"{name}"' if draw(OFTEN) else draw(st.sampled_from([name, f'"{name}\\n"', "1", '"\\u006dove"']))
    outer = [f'"name"{w()}:{w()}{name_value}', f'"arguments"{w()}:{w()}{args}']
    if draw(st.booleans()):
        outer.reverse()
    if draw(RARELY):
        outer.insert(draw(st.integers(0, 2)), f'"{draw(EXTRA_KEYS)}"{w()}:{w()}1')
    body = w() + "{" + w() + f"{w()},{w()}".join(outer) + w() + "}" + w()
    if draw(RARELY):  # delete or duplicate one character (missing brace, etc.)
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + body[i + 1 :] if draw(st.booleans()) else body[:i] + body[i] + body[i:]
    text = draw(PREFIXES) + call(body) + draw(SUFFIXES)
    if draw(RARELY):  # truncation
        text = text[: draw(st.integers(0, len(text)))]
    return text


@st.composite
def tokenized(draw, texts):
    """Token ids of a text: its own encoding, or the concatenated encodings of random pieces of it."""
    text = draw(texts)
    if draw(st.integers(0, 3)) == 0:
        return text, None
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=12))))
    bounds = [0] + cuts + [len(text)]
    return text, [p for a, b in zip(bounds, bounds[1:]) if a < b for p in [text[a:b]]]


HYP = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@HYP
@given(items=st.lists(tokenized(call_texts()), min_size=B, max_size=B))
def test_near_miss_calls_agree(tok, tables, items):
    rows = []
    for text, pieces in items:
        rows.append(_encode(tok, text) if pieces is None else [i for p in pieces for i in _encode(tok, p)])
    assert_agree(tok, tables, rows)


@HYP
@given(
    items=st.lists(st.tuples(st.text(alphabet="xé<> ", max_size=30), tokenized(call_texts())), min_size=B, max_size=B),
    cap=st.sampled_from([50, 90]),
)
def test_near_miss_calls_agree_under_a_byte_cap(tok, tables, items, cap):
    """The cap is static (one compile each), the random prefix moves the cut over the call, inside tokens too."""
    rows = [
        _encode(tok, pre + text) if p is None else _encode(tok, pre) + [i for s in p for i in _encode(tok, s)]
        for pre, (text, p) in items
    ]
    assert_agree(tok, tables, rows, max_bytes=cap)


@HYP
@given(data=st.data())
def test_token_garbage_agrees(tok, tables, data):
    """Random token ids (partial UTF-8, special tokens) mixed with pieces of real calls."""
    pieces = [
        _encode(tok, s)
        for s in [
            "<tool_call>",
            "</tool_call>",
            '{"name": "move", "arguments": {',
            '"dx": 1, ',
            '"speed": "fast"',
            "}}",
            "7",
            '{"name": "pass"',
        ]
    ]
    rows = []
    for _ in range(B):
        parts = data.draw(
            st.lists(
                st.one_of(st.lists(st.integers(0, len(tok) - 1), max_size=5), st.sampled_from(pieces)), max_size=10
            )
        )
        rows.append([i for p in parts for i in p])
    assert_agree(tok, tables, rows)


# ---------------------------------------------------------------------------------------------------------------
# jit / vmap variants
# ---------------------------------------------------------------------------------------------------------------


class ParseVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_single_row_matches_batch_and_reference(self):
        tok = tokenizer_lib.load_tokenizer(None)
        tables = tc.compile_tool_calls(MULTI, tok)
        texts = [REFERENCE_CASES[i][0] for i in (0, 2, 6, 10, 22)]
        ids, lengths = _rows([_encode(tok, t) for t in texts], width=tc._UNROLL_MAX)
        single = self.variant(functools.partial(tc.parse, tables))
        batch = jax.vmap(functools.partial(tc.parse, tables))(jnp.asarray(ids), jnp.asarray(lengths))
        for r, text in enumerate(texts):
            kind, tool, args = single(jnp.asarray(ids[r]), jnp.asarray(lengths[r]))
            chex.assert_shape(args, (3,))
            chex.assert_trees_all_equal((kind, tool, args), jax.tree_util.tree_map(lambda x: x[r], batch))
            want = tc.parse_text(MULTI, tokenizer_lib.decode(tok, ids[r, : lengths[r]]))
            assert (int(kind), int(tool), tuple(np.asarray(args).tolist())) == want


# ---------------------------------------------------------------------------------------------------------------
# Schema errors
# ---------------------------------------------------------------------------------------------------------------

BAD_SCHEMAS = [
    ([], "at least one tool"),
    ([_fn("f", {"x": {"type": "integer", "minimum": 0}})], r"'f' argument 'x'.*maximum"),
    ([_fn("f", {"x": _int(3, 2)})], r"'f' argument 'x'.*minimum <= maximum"),
    ([_fn("f", {"x": _int(-1, 2)})], r"'f' argument 'x'"),
    ([_fn("f", {"x": _int(0, 5000)})], r"'f' argument 'x'.*4095"),
    ([_fn("f", {"x": _int(0, 2.5)})], r"'f' argument 'x'"),
    ([_fn("f", {"x": _int(0, True)})], r"'f' argument 'x'"),
    ([_fn("f", {"x": {"type": "number", "minimum": 0, "maximum": 1}})], r"'f' argument 'x'.*unsupported type"),
    ([_fn("f", {"x": {"type": "boolean"}})], r"'f' argument 'x'.*unsupported type"),
    ([_fn("f", {"s": {"type": "string"}})], r"'f' argument 's'.*enum"),
    ([_fn("f", {"s": {"type": "string", "enum": []}})], r"'f' argument 's'.*enum"),
    ([_fn("f", {"s": {"type": "string", "enum": ['a"b']}})], r"'f' argument 's'.*printable ASCII"),
    ([_fn("f", {"s": {"type": "string", "enum": ["a\\b"]}})], r"'f' argument 's'.*printable ASCII"),
    ([_fn("f", {"s": {"type": "string", "enum": ["é"]}})], r"'f' argument 's'.*printable ASCII"),
    ([_fn("f", {"s": {"type": "string", "enum": ["a", "a"]}})], r"'f' argument 's'.*duplicate"),
    ([_fn("f", {"x": {**_int(0, 3), "exclusiveMinimum": 0}})], r"'f' argument 'x'.*exclusiveMinimum"),
    (
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"x": _int(0, 1)}, "required": []},
                },
            }
        ],
        r"'f'.*required.*\['x'\]",
    ),
    (
        [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {}, "required": ["y"]}},
            }
        ],
        r"'f'.*unknown arguments \['y'\]",
    ),
    (
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {}, "additionalProperties": True},
                },
            }
        ],
        r"'f'.*additionalProperties",
    ),
    ([_fn('f"')], "printable ASCII"),
    ([_fn("f"), _fn("f")], "duplicate tool names"),
    ([_fn("f", {f"a{i}": _int(0, 1) for i in range(9)})], r"'f'.*at most 8"),
    ([_fn("f", {'a"': _int(0, 1)})], r"'f' argument name.*printable ASCII"),
]


@pytest.mark.parametrize("schema, match", BAD_SCHEMAS)
def test_unsupported_schemas_raise_clear_errors(schema, match):
    with pytest.raises(ValueError, match=match):
        tc.normalize_tools(schema)
    with pytest.raises(ValueError, match=match):
        tc.parse_text(schema, "")


# ---------------------------------------------------------------------------------------------------------------
# Stop matcher
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", [b"</tool_call>", b"abab", b"\n\n"])
def test_stop_tables_equal_a_byte_by_byte_kmp(tok, pattern):
    pieces = tokens_lib.token_bytes(tok) + [b"ab" * 5, b"\n\n\n", b"</tool_call></tool_"]
    tables = stop_lib.build_stop_tables(pieces, [0], pattern)
    auto = tokens_lib.kmp_table(pattern)
    m = len(pattern)
    nxt, hit = np.asarray(tables.match_next), np.asarray(tables.match_hit)
    assert nxt.shape == hit.shape == (m, len(pieces))
    for v, bs in enumerate(pieces):
        for s0 in range(m):
            s, h = s0, False
            for byte in bs:
                s = int(auto[s, byte])
                if s == m:  # row m is the failure row: one more step from the border state
                    h, s = True, stop_lib._restart_state(auto, pattern)
            assert (int(nxt[s0, v]), bool(hit[s0, v])) == (s, h), (pattern, bs, s0)


# ---------------------------------------------------------------------------------------------------------------
# Tokens that store several registers at once, and the two-token pair table with several registers
# ---------------------------------------------------------------------------------------------------------------

MULTI_STORE_PIECES = [
    b'1, "dy": 2',
    b'0,"dy":0,"speed":"slow"',
    b'"dx": 2, "dy": 1, "speed": "fast"}',
    b'{"name": "move", "arguments": {"dx": 1, "dy": 2, "speed": "fast"}}',
    b'"}',
    b"2}",
    b'"fast", "dx": 0',
    b': 1, "dx": 1',
    b"<tool_call>",
    b"</tool_call>",
    b'"}}</tool_call>',
]


@pytest.fixture(scope="module")
def byte_vocab():
    """Every single byte plus multi-store pieces: few classes, so the multi-register tables get a pair table."""
    pieces = [bytes([b]) for b in range(256)] + MULTI_STORE_PIECES
    return pieces, tc.compile_tool_calls(MULTI, pieces=pieces)


def _greedy_ids(pieces, data: bytes, take) -> list[int]:
    """Tokenize ``data`` with the byte vocab: at each position a multi-byte piece that matches, if ``take``
    says so, else one byte."""
    ids, i = [], 0
    while i < len(data):
        for k in range(256, len(pieces)):
            if data.startswith(pieces[k], i) and take():
                ids.append(k)
                i += len(pieces[k])
                break
        else:
            ids.append(data[i])
            i += 1
    return ids


@HYP
@given(texts=st.lists(call_texts(), min_size=B, max_size=B), seed=st.integers(0, 2**16))
def test_multi_store_tokens_and_pair_table_agree(byte_vocab, texts, seed):
    pieces, tables = byte_vocab
    assert tables.class_pair_next is not None and tables.store_val is not None
    rng = np.random.default_rng(seed)
    canon = call('{"name": "move", "arguments": {"dx": 1, "dy": 2, "speed": "fast"}}')
    texts = texts[:-2] + [canon, call('{"arguments": {"dx": 0,"dy":0,"speed":"slow"}, "name": "move"}')]
    rows = [_greedy_ids(pieces, t.encode(), lambda: rng.random() < 0.8) for t in texts]
    for width in (T, tc._UNROLL_MAX):  # scan path and the unrolled pair path
        ids, lengths = _rows(rows, width)
        kinds, tools, args = _PARSE(tables, jnp.asarray(ids), jnp.asarray(lengths))
        for r in range(B):
            text = b"".join(pieces[j] for j in ids[r, : lengths[r]]).decode("utf-8", errors="replace")
            got = (int(kinds[r]), int(tools[r]), tuple(int(a) for a in args[r]))
            assert got == tc.parse_text(MULTI, text), (text, got)
    assert tc.parse_text(MULTI, canon) == (OK, MOVE, (1, 2, 1))
