"""Tool-call parsing: a host reference parser and a jitted token-level DFA that agrees with it exactly.

Result (design contract): ``kind`` int32 in {0 ok, 1 no_call, 2 bad_call, 3 out_of_range} and ``square`` int32,
1..9 when ``kind == 0`` else 0.

Grammar
-------
1. Span. The FIRST occurrence of ``<tool_call>`` opens the call; the first ``</tool_call>`` after it closes it.
   Text before the call (reasoning, ``<think>...</think>``, anything) is ignored and is NOT special: a call
   inside ``<think>`` counts. Everything after the closing tag (more calls, ``<|im_end|>``) is ignored. No opening
   tag, or no closing tag after it (e.g. a truncated call) -> ``no_call``.
2. Body: the text between the tags must be exactly one JSON object (RFC 8259, as ``json.loads`` reads it) of this
   shape, else ``bad_call``::

       {"name": "choose_square", "arguments": {"square": <integer>}}

   * Members: exactly the two keys ``name`` and ``arguments``, in either order; no extra keys and no duplicates.
     ``arguments`` holds exactly the one key ``square``.
   * Whitespace: any JSON whitespace (space, tab, LF, CR) before/after the object and around every ``{ } : ,``
     (nothing else counts as whitespace).
   * Strings are compared literally: any backslash escape anywhere in the body -> ``bad_call`` (so
     ``"\\u0063hoose_square"`` is rejected even though JSON would decode it to the right name).
   * ``square`` must be a JSON integer: ``-?(0|[1-9][0-9]*)``. Fractions/exponents (``5.0``, ``5e0``), strings
     (``"5"``), ``true``/``false``/``null``, arrays, objects -> ``bad_call``; leading zeros (``05``, ``-05``) are
     not JSON -> ``bad_call``; a ``+`` sign is not JSON -> ``bad_call``.
3. Range: an integer outside 1..9 (``0``, ``-0``, ``-1``, ``10``, any number of digits) -> ``out_of_range``.

Jitted parser
-------------
Three byte automata define the grammar: a KMP matcher for ``<tool_call>``, then, inside the call, a KMP matcher for
``</tool_call>`` in parallel with a DFA for the body grammar above, plus an integer register for the square
(saturating at 10). The body can never contain ``<``, so the body DFA's state just before the closing tag is the
state saved at the most recent ``<``. Text decoding replaces invalid UTF-8 by U+FFFD and every non-ASCII byte is
"other" to all the automata, so bytes and decoded text always give the same result.

On the host (``_grammar``, once per process) the three are merged into ONE product automaton (1377 reachable
states) and Moore-minimized to 137 states, with the register kept outside the state: every edge keeps it or
stores a constant. ``build_parser_tables(tokenizer)`` maps every token id to its bytes (byte-level BPE tokens
through the GPT-2 byte<->unicode table; added/special tokens give their literal text; a token may be a partial
UTF-8 sequence) and lifts the automaton to tokens: the state and register store after feeding all of a token's
bytes, for every (state, token). Token ids with equal columns share a class, so the table is ``[137, C]`` int16
plus a ``[V + 1]`` class map (C = 89 for the shipped 512-token vocabulary; the unshared table would be
137 x V x 2 bytes, 41 MiB at V = 157k). ``parse_tool_call`` is then one class lookup and one dependent table
lookup per token (T steps, whatever the tokens' byte lengths); only a ``max_bytes`` cap that cuts a token in the
middle adds a byte-level loop over that one token.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

KIND_OK = 0
KIND_NO_CALL = 1
KIND_BAD_CALL = 2
KIND_OUT_OF_RANGE = 3
KIND_NAMES = ("ok", "no_call", "bad_call", "out_of_range")

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
TOOL_NAME = "choose_square"
ARGUMENT = "square"
MIN_SQUARE, MAX_SQUARE = 1, 9

# ----------------------------------------------------------------------------------------------------------------
# Host reference
# ----------------------------------------------------------------------------------------------------------------


class _Reject(Exception):
    pass


def _reject(_):
    raise _Reject()


def _pairs_to_dict(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Reject()  # duplicate keys
    return dict(pairs)


def _parse_int(s: str) -> int:
    # Very long integers are out of range whatever their value; avoid int() on huge digit strings.
    return int(s) if len(s) <= 20 else 10**21


def parse_tool_call_text(text: str) -> tuple[int, int]:
    """Reference parser (plain Python). Returns ``(kind, square)``; see the module docstring for the grammar."""
    start = text.find(OPEN_TAG)
    if start < 0:
        return KIND_NO_CALL, 0
    end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
    if end < 0:
        return KIND_NO_CALL, 0
    body = text[start + len(OPEN_TAG) : end]
    if "\\" in body:
        return KIND_BAD_CALL, 0
    try:
        obj = json.loads(
            body,
            object_pairs_hook=_pairs_to_dict,
            parse_float=_reject,
            parse_constant=_reject,
            parse_int=_parse_int,
        )
    except (ValueError, _Reject):
        return KIND_BAD_CALL, 0
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} or obj["name"] != TOOL_NAME:
        return KIND_BAD_CALL, 0
    args = obj["arguments"]
    if not isinstance(args, dict) or set(args) != {ARGUMENT}:
        return KIND_BAD_CALL, 0
    value = args[ARGUMENT]
    if type(value) is not int:  # bool is an int subclass: true/false are rejected here
        return KIND_BAD_CALL, 0
    if not MIN_SQUARE <= value <= MAX_SQUARE:
        return KIND_OUT_OF_RANGE, 0
    return KIND_OK, value


# ----------------------------------------------------------------------------------------------------------------
# Automata (built once at import, plain numpy)
# ----------------------------------------------------------------------------------------------------------------

_WS = b" \t\n\r"
_DIGITS = b"0123456789"
# Register actions on the square value (int32, saturating at 10 = "two or more digits").
_ACT_KEEP, _ACT_SET0, _ACT_SETD, _ACT_ACC = 0, 1, 2, 3
_VAL_SAT = 10


def _kmp_table(pattern: bytes) -> np.ndarray:
    """``int32 [len+1, 256]``: state = number of pattern bytes matched; state ``len`` = found."""
    m = len(pattern)
    table = np.zeros((m + 1, 256), np.int32)
    table[0, pattern[0]] = 1
    fail = 0
    for s in range(1, m + 1):
        table[s] = table[fail]
        if s < m:
            table[s, pattern[s]] = s + 1
            fail = table[fail, pattern[s]]
    return table


class _BodyDFA:
    """DFA of the call body. State 0 is the absorbing dead state."""

    def __init__(self):
        self.next: list[np.ndarray] = []
        self.act: list[np.ndarray] = []
        self.dead = self.state()

    def state(self) -> int:
        self.next.append(np.zeros(256, np.int32))
        self.act.append(np.zeros(256, np.int32))
        return len(self.next) - 1

    def edge(self, s: int, chars: bytes, t: int, act: int = _ACT_KEEP) -> None:
        for c in chars:
            self.next[s][c] = t
            self.act[s][c] = act

    def ws(self, s: int) -> int:
        self.edge(s, _WS, s)
        return s

    def lit(self, s: int, text: bytes) -> int:
        for c in text:
            t = self.state()
            self.edge(s, bytes([c]), t)
            s = t
        return s

    def colon(self, s: int) -> int:
        """After a key's closing quote: ws ':' ws."""
        self.ws(s)
        c = self.state()
        self.edge(s, b":", c)
        return self.ws(c)

    def name_value(self, s: int) -> int:
        return self.ws(self.lit(s, b'"' + TOOL_NAME.encode() + b'"'))

    def args_value(self, s: int) -> int:
        """``{ "square" : INT }`` starting at a value position; returns the state after its ``}`` (+ ws)."""
        o = self.state()
        self.edge(s, b"{", o)
        self.ws(o)
        start = self.colon(self.lit(o, b'"' + ARGUMENT.encode() + b'"'))
        neg, zero, digits, neg_digits, after, closed = (self.state() for _ in range(6))
        self.edge(start, b"-", neg, _ACT_SET0)
        self.edge(start, b"0", zero, _ACT_SET0)
        self.edge(start, b"123456789", digits, _ACT_SETD)
        self.edge(neg, b"0", zero)
        self.edge(neg, b"123456789", neg_digits)
        self.edge(digits, _DIGITS, digits, _ACT_ACC)
        self.edge(neg_digits, _DIGITS, neg_digits)
        for s_ in (zero, digits, neg_digits):
            self.edge(s_, _WS, after)
            self.edge(s_, b"}", closed)
        self.ws(after)
        self.edge(after, b"}", closed)
        return self.ws(closed)

    def member(self, s: int, key: bytes) -> int:
        """From the position after the opening quote of a key: rest of the key, colon -> value position."""
        return self.colon(self.lit(s, key + b'"'))


def _build_body_dfa():
    d = _BodyDFA()
    start = d.ws(d.state())
    outer = d.state()
    d.edge(start, b"{", outer)
    d.ws(outer)
    quote = d.state()
    d.edge(outer, b'"', quote)
    end = d.ws(d.state())  # accepting: the outer object is closed

    # name first: "name": "choose_square" , "arguments": {...} }
    after_name = d.name_value(d.member(quote, b"name"))
    comma = d.ws(d.state())
    d.edge(after_name, b",", comma)
    after_args = d.args_value(d.member(d.lit(comma, b'"'), b"arguments"))
    d.edge(after_args, b"}", end)

    # arguments first: "arguments": {...} , "name": "choose_square" }
    after_args2 = d.args_value(d.member(quote, b"arguments"))
    comma2 = d.ws(d.state())
    d.edge(after_args2, b",", comma2)
    after_name2 = d.name_value(d.member(d.lit(comma2, b'"'), b"name"))
    d.edge(after_name2, b"}", end)

    accept = np.zeros(len(d.next), bool)
    accept[end] = True
    return np.stack(d.next), np.stack(d.act), accept, start


_OPEN_KMP = _kmp_table(OPEN_TAG.encode())  # [12, 256]
_CLOSE_KMP = _kmp_table(CLOSE_TAG.encode())  # [13, 256]
_BODY_NEXT, _BODY_ACT, _BODY_ACCEPT, _BODY_START = _build_body_dfa()


# Register encoding on the product automaton's edges: -1 keeps the square register, 0..10 sets it (10 = "two or
# more digits", always out of range). Packed token-table entries are ``(next_state << _REG_BITS) | (op + 1)``.
_REG_KEEP = -1
_REG_BITS = 4


@dataclasses.dataclass(frozen=True)
class _Grammar:
    """The whole grammar as ONE minimized byte-level DFA with a square register.

    Attributes:
      next: ``int32 [S, 256]`` next state; state 0 is the start (before ``<tool_call>``).
      op: ``int8 [S, 256]`` register op of the edge: ``_REG_KEEP`` or a value 0..10 to store.
      accept_state: the absorbing state "call closed, body accepted" (result: the register's range decides ok /
        out_of_range). bad_state: absorbing "call closed, body rejected". Every other state means no call (yet).
      raw_states: reachable states of the unminimized product (for the docs/tests).
    """

    next: np.ndarray
    op: np.ndarray
    accept_state: int
    bad_state: int
    raw_states: int

    @property
    def num_states(self) -> int:
        return int(self.next.shape[0])

    def packed(self) -> np.ndarray:
        """``int32 [S, 256]`` edges packed like the token table."""
        return (self.next.astype(np.int32) << _REG_BITS) | (self.op.astype(np.int32) + 1)


@functools.lru_cache(maxsize=1)
def _grammar() -> _Grammar:
    """Product of the three byte automata (open-tag KMP, close-tag KMP + body DFA + saved state), minimized.

    Product state: phase 0 ``k_open``; phase 1 ``(k_close, body, saved)`` where ``saved`` is the body state just
    before the latest ``<`` (the body can never contain ``<``, so that is the body state before the closing tag);
    phase 2 ``accepted`` (absorbing). The square register stays OUTSIDE the state: every edge either keeps it or
    stores a constant, which makes a token's effect on it a single "keep or store c" too. The body DFA's
    accumulate action (``val * 10 + d``, saturating at 10) is only taken with ``val >= 1`` (checked below on the
    body DFA's edges), where it always stores 10.
    """
    n_open, n_close = len(OPEN_TAG), len(CLOSE_TAG)
    nb = _BODY_NEXT.shape[0]
    off1 = n_open  # phase-1 keys: off1 + (k_close * nb + body) * nb + saved
    off2 = off1 + n_close * nb * nb  # phase-2 keys: off2 + accepted
    all_bytes = np.arange(256)
    lt = all_bytes == ord("<")
    digit = all_bytes - ord("0")

    keys: dict[int, int] = {0: 0}
    order = [0]
    nexts, ops = [], []
    i = 0
    while i < len(order):
        key = order[i]
        i += 1
        op = np.full(256, _REG_KEEP, np.int64)
        if key < off1:  # phase 0: looking for the opening tag
            k2 = _OPEN_KMP[key].astype(np.int64)
            nkey = np.where(k2 == n_open, off1 + (0 * nb + _BODY_START) * nb + _BODY_START, k2)
        elif key < off2:  # phase 1: inside the call
            kc, rest = divmod(key - off1, nb * nb)
            body, saved = divmod(rest, nb)
            kc2 = _CLOSE_KMP[kc].astype(np.int64)
            body2 = _BODY_NEXT[body].astype(np.int64)
            act = _BODY_ACT[body]
            saved2 = np.where(lt, body, saved)
            op = np.select([act == _ACT_SET0, act == _ACT_SETD, act == _ACT_ACC], [0, digit, _VAL_SAT], _REG_KEEP)
            nkey = np.where(kc2 == n_close, off2 + _BODY_ACCEPT[saved2], off1 + (kc2 * nb + body2) * nb + saved2)
        else:  # phase 2: closed, absorbing
            nkey = np.full(256, key, np.int64)
        uniq, inv = np.unique(nkey, return_inverse=True)
        for k in uniq.tolist():
            if k not in keys:
                keys[k] = len(order)
                order.append(k)
        nexts.append(np.array([keys[k] for k in uniq.tolist()], np.int64)[inv.ravel()])
        ops.append(op)
    nxt, op = np.stack(nexts), np.stack(ops)
    raw = len(order)

    # The accumulate action must only ever see a register >= 1 (then it always stores 10). Body states with an
    # accumulate edge are entered only by storing a digit 1..9 or by accumulating, and are not the start state.
    acc_states = np.nonzero((_BODY_ACT == _ACT_ACC).any(axis=1))[0]
    into = np.isin(_BODY_NEXT, acc_states)
    entering = _BODY_ACT[into]
    if _BODY_START in acc_states or not np.all((entering == _ACT_ACC) | (entering == _ACT_SETD)):
        raise AssertionError("tool-call grammar: an accumulate edge can see register value 0")
    if np.any(into & (_BODY_ACT == _ACT_SETD) & ~np.isin(np.arange(256), list(b"123456789"))[None, :]):
        raise AssertionError("tool-call grammar: a digit store outside 1..9 enters an accumulating state")

    # Moore minimization: same output (pending / accepted / rejected), same register ops, equivalent successors.
    label = np.zeros(raw, np.int64)
    for key, s in keys.items():
        if key >= off2:
            label[s] = 1 + (key == off2)  # 1: accepted (off2 + 1), 2: rejected (off2 + 0)
    cls = np.unique(label, return_inverse=True)[1].ravel()
    n = int(cls.max()) + 1
    while True:
        sig = np.concatenate([cls[:, None], cls[nxt], op], axis=1)
        ids: dict[bytes, int] = {}
        cls = np.array([ids.setdefault(row.tobytes(), len(ids)) for row in sig], np.int64)
        if len(ids) == n:
            break
        n = len(ids)
    # Renumber classes by first appearance in BFS order (so the start state is 0).
    first = np.full(n, -1, np.int64)
    for s in range(raw - 1, -1, -1):
        first[cls[s]] = s
    rank = np.argsort(np.argsort(first))
    cls = rank[cls]
    rep = np.sort(first)  # representative raw state of each minimized state
    return _Grammar(
        next=cls[nxt[rep]].astype(np.int32),
        op=op[rep].astype(np.int8),
        accept_state=int(cls[keys[off2 + 1]]) if off2 + 1 in keys else -1,
        bad_state=int(cls[keys[off2]]),
        raw_states=raw,
    )


def _lift_to_tokens(grammar: _Grammar, token_bytes: np.ndarray, token_len: np.ndarray) -> np.ndarray:
    """Token-level transition table: ``[S, V + 1]`` packed ``(state << 4) | (op + 1)`` after feeding all bytes of
    token v in state s (op: the last register store along the way, or keep). Column V is "no token" (identity).

    Cost: one vectorised pass per byte column, ``S x (total bytes of the vocabulary)`` table lookups.
    """
    s_count, v = grammar.num_states, token_len.shape[0]
    cur = np.repeat(np.arange(s_count, dtype=np.int32)[:, None], v, axis=1)  # [S, V]
    reg = np.full((s_count, v), _REG_KEEP, np.int8)
    for j in range(token_bytes.shape[1]):
        active = np.nonzero(token_len > j)[0]
        if active.size == 0:
            break
        b = token_bytes[active, j].astype(np.int64)[None, :]
        c = cur[:, active]
        o = grammar.op[c, b]
        cur[:, active] = grammar.next[c, b]
        reg[:, active] = np.where(o != _REG_KEEP, o, reg[:, active])
    table = np.empty((s_count, v + 1), np.int32)
    table[:, :v] = (cur << _REG_BITS) | (reg.astype(np.int32) + 1)
    table[:, v] = (np.arange(s_count, dtype=np.int32) << _REG_BITS) | (_REG_KEEP + 1)
    dtype = np.int16 if (s_count << _REG_BITS) <= np.iinfo(np.int16).max else np.int32
    return table.astype(dtype)


# ----------------------------------------------------------------------------------------------------------------
# Token -> bytes tables
# ----------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (byte-level BPE maps each byte to a printable character)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kinds(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError("build_parser_tables needs a fast (Rust-backed) Hugging Face tokenizer")
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")}
    for sub in decoder.get("decoders", []) or []:
        kinds.add(sub.get("type"))
    return kinds


def token_bytes(tokenizer) -> list[bytes]:
    """The exact bytes each token id contributes to decoded text (index = token id).

    Byte-level BPE (GPT-2/Qwen/Ling style): token strings are mapped back through the byte<->unicode table.
    SentencePiece-style vocabularies: ``<0xNN>`` byte-fallback tokens give one byte and ``▁`` gives a space (the
    decoder's removal of one leading space is ignored; it cannot change a parse). Added/special tokens give their
    literal text.
    """
    kinds = _decoder_kinds(tokenizer)
    byte_level = "ByteLevel" in kinds
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)  # str -> id
    added = {int(i): str(getattr(t, "content", t)) for i, t in tokenizer.added_tokens_decoder.items()}
    size = max(max(vocab.values()) + 1, max(added, default=-1) + 1)
    out = [b""] * size
    u2b = _unicode_to_byte()
    for piece, idx in vocab.items():
        if idx in added:
            out[idx] = added[idx].encode("utf-8")
        elif byte_level:
            try:
                out[idx] = bytes(u2b[ch] for ch in piece)
            except KeyError:  # a non-byte-level entry in a byte-level vocab: use its text
                out[idx] = piece.encode("utf-8")
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[idx] = bytes([int(piece[3:5], 16)])
        else:
            out[idx] = piece.replace("\u2581", " ").encode("utf-8")
    for idx, content in added.items():
        out[idx] = content.encode("utf-8")
    return out


@flax.struct.dataclass
class ParserTables:
    """Token tables for ``parse_tool_call`` (pytree of arrays).

    The grammar automaton (S states, a property of the grammar: 137) is lifted from bytes to tokens on the host:
    the entry for state s and token v packs ``(state after all bytes of v) << 4 | (register op + 1)``, op = -1
    (keep) or the last square value 0..10 stored along the way. Tokens whose columns are equal (almost all plain
    text behaves alike) share one *class*, so the table is ``[S, C]`` with C much smaller than the vocabulary.

    Attributes:
      token_class: ``int32 [V + 1]`` class of each token id; entry V is "no token" (the identity class).
      class_next: ``int16 [S, C]`` (int32 if ``S >= 2048``) packed transitions per class.
      token_bytes: ``uint8 [V, max_bytes]`` bytes of each token id, right-padded with 0 (used only to cut a token
        in the middle when ``max_bytes`` truncates the text).
      token_len: ``int32 [V]`` byte count of each token id (0 for ids with no text).
      class_pair_next: ``[S, C * C]`` (dtype of ``class_next``) transitions for two tokens at once (class pair
        ``c1 * C + c2``), halving the chain of dependent lookups per call; None when ``S * C * C`` exceeds
        ``_MAX_PAIR_ENTRIES`` (tokenizers with many classes then take one token per lookup).
    """

    token_class: jax.Array
    class_next: jax.Array
    token_bytes: jax.Array
    token_len: jax.Array
    class_pair_next: jax.Array | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.token_len.shape[0])

    @property
    def max_bytes(self) -> int:
        return int(self.token_bytes.shape[1])

    @property
    def num_states(self) -> int:
        return int(self.class_next.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.class_next.shape[1])


def _token_classes(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[S, V + 1]`` token table -> (class of each column ``int32 [V + 1]``, ``[S, C]`` distinct columns)."""
    cols = np.ascontiguousarray(table.T)
    keys = cols.view(np.dtype((np.void, cols.dtype.itemsize * cols.shape[1]))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return inverse.astype(np.int32).ravel(), np.ascontiguousarray(cols[first].T)


def build_parser_tables(tokenizer, vocab_size: int | None = None) -> ParserTables:
    """Tables for ``tokenizer``; ``vocab_size`` (e.g. the model's padded vocab) adds rows for ids without text.

    Host cost: one vectorised pass over the vocabulary's bytes per automaton state (seconds at 157k tokens).
    """
    pieces = token_bytes(tokenizer)
    v = max(len(pieces), int(vocab_size or 0))
    width = max(1, max(len(p) for p in pieces))
    table = np.zeros((v, width), np.uint8)
    lens = np.zeros((v,), np.int32)
    for i, p in enumerate(pieces):
        table[i, : len(p)] = np.frombuffer(p, np.uint8)
        lens[i] = len(p)
    token_class, class_next = _token_classes(_lift_to_tokens(_grammar(), table, lens))
    return ParserTables(
        token_class=jnp.asarray(token_class),
        class_next=jnp.asarray(class_next),
        token_bytes=jnp.asarray(table),
        token_len=jnp.asarray(lens),
        class_pair_next=_pair_table(class_next),
    )


_MAX_PAIR_ENTRIES = 1 << 21  # 4 MiB of int16: past that, cache misses cost more than the saved lookups


def _pair_table(class_next: np.ndarray) -> jax.Array | None:
    """``[S, C]`` packed single-token transitions -> ``[S, C * C]`` two-token transitions (or None if too big).

    Entry ``(s, c1 * C + c2)`` is the state after c1 then c2, with the register op of the later one that stores
    (op 0 = keep), exactly what two steps of ``_run`` compute.
    """
    s, c = class_next.shape
    if s * c * c > _MAX_PAIR_ENTRIES:
        return None
    t = class_next.astype(np.int64)
    low = (1 << _REG_BITS) - 1
    first_state, first_op = t >> _REG_BITS, t & low  # [S, C]
    second = t[first_state]  # [S, C, C]: the second token's entry from the state after the first
    op = np.where((second & low) != 0, second & low, first_op[:, :, None])
    pair = ((second >> _REG_BITS) << _REG_BITS) | op
    return jnp.asarray(pair.reshape(s, c * c).astype(class_next.dtype))


# ----------------------------------------------------------------------------------------------------------------
# Jitted parser
# ----------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _result_table() -> np.ndarray:
    """``int32 [S << 4]``: packed carry -> ``kind << 4 | square`` (one lookup; cheap for XLA to duplicate into the
    consumers it fuses the result into, unlike the compare/select chain it replaces)."""
    g = _grammar()
    carry = np.arange(g.num_states << _REG_BITS)
    state = carry >> _REG_BITS
    reg = np.maximum((carry & ((1 << _REG_BITS) - 1)) - 1, 0)  # regcode 0: never stored, register still 0
    in_range = (reg >= MIN_SQUARE) & (reg <= MAX_SQUARE)
    kind = np.where(
        state == g.accept_state,
        np.where(in_range, KIND_OK, KIND_OUT_OF_RANGE),
        np.where(state == g.bad_state, KIND_BAD_CALL, KIND_NO_CALL),
    )
    square = np.where(kind == KIND_OK, reg, 0)
    return ((kind << 4) | square).astype(np.int32)


def _result(carry: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Final packed carry (automaton state, square register) -> ``(kind, square)``."""
    packed = jnp.asarray(_result_table())[carry]
    return packed >> 4, packed & 15


@functools.lru_cache(maxsize=1)
def _byte_table() -> np.ndarray:
    """``int32 [S, 257]`` packed byte-level edges; column 256 is "no byte" (identity)."""
    g = _grammar()
    table = np.zeros((g.num_states, 257), np.int32)
    table[:, :256] = g.packed()
    table[:, 256] = (np.arange(g.num_states) << _REG_BITS) | (_REG_KEEP + 1)
    return table


_UNROLL_MAX = 32  # sequences up to this many symbols are unrolled in Python (no scan, no transposes)


def _run(table: jax.Array, symbols: jax.Array, carry: Any = 0, symbol_class: jax.Array | None = None,
         pair_table: jax.Array | None = None) -> jax.Array:
    """Feed ``symbols [N]`` (columns of the packed ``table [S, C]``, or ids mapped to columns by
    ``symbol_class``) to the automaton.

    ``carry`` packs ``state << 4 | (last register store + 1)`` (0: nothing stored yet), the same layout as the
    table entries, so a step is one lookup and one select and the whole result lives in one int32.
    """
    flat = table.reshape(-1)
    width = table.shape[1]
    low = (1 << _REG_BITS) - 1

    def lookup(index):  # unsigned, in-bounds index: no negative-index fix-up in every step
        return flat.at[index.astype(jnp.uint32)].get(mode="promise_in_bounds").astype(jnp.int32)

    def column(sym):  # the class lookup does not depend on the carry: it stays off the dependency chain
        if symbol_class is None:
            return sym
        return symbol_class.at[sym.astype(jnp.uint32)].get(mode="promise_in_bounds")

    def step(carry, sym):
        code = lookup((carry >> _REG_BITS) * width + column(sym))
        return jnp.where((code & low) == 0, code | (carry & low), code)

    n = symbols.shape[0]
    if n > _UNROLL_MAX:
        return jax.lax.scan(lambda c, x: (step(c, x), None), jnp.asarray(carry, jnp.int32), symbols, unroll=8)[0]
    if pair_table is not None and n >= 2:
        pairs = pair_table.reshape(-1)
        pair_width = pair_table.shape[1]

        def pair_column(i):  # independent of the carry, like column()
            return column(symbols[i]) * width + column(symbols[i + 1])

        def pair_step(carry, i):
            code = pairs.at[((carry >> _REG_BITS) * pair_width + pair_column(i)).astype(jnp.uint32)].get(
                mode="promise_in_bounds").astype(jnp.int32)
            return jnp.where((code & low) == 0, code | (carry & low), code)

        start = 0
        if isinstance(carry, int) and carry == 0:  # from the start state: row 0, no register yet
            carry = pairs.at[pair_column(0).astype(jnp.uint32)].get(mode="promise_in_bounds").astype(jnp.int32)
            start = 2
        for i in range(start, n - 1, 2):
            carry = pair_step(carry, i)
        if (n - start) % 2:
            carry = step(carry, symbols[n - 1])
        return jnp.asarray(carry, jnp.int32)
    if isinstance(carry, int) and carry == 0 and n:  # from the start state: row 0, no register yet
        carry, symbols = lookup(column(symbols[0])), symbols[1:]
    for i in range(symbols.shape[0]):
        carry = step(carry, symbols[i])
    return jnp.asarray(carry, jnp.int32)


def parse_tool_call(
    tables: ParserTables, token_ids: jax.Array, length: Any = None, *, max_bytes: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Parse the first tool call in a generated token sequence (jit/vmap friendly; agrees with
    ``parse_tool_call_text(decode(token_ids[:length]))``).

    Two lookups per token: its class (``tables.token_class``, independent of the others), then the automaton
    step (``tables.class_next``; the grammar automaton was lifted from bytes to tokens on the host), so the cost
    is T dependent gathers in a small table, whatever the tokens' byte lengths.

    Args:
      tables: ``ParserTables`` of the tokenizer that produced the ids.
      token_ids: ``int [T]`` generated tokens (ids outside ``[0, V)`` are clipped).
      length: ``int []`` number of valid tokens (default T); the rest is ignored.
      max_bytes: static cap on the number of text bytes parsed (default: no cap). Text past the cap is treated
        as not generated; a token straddling the cap is cut in the middle (this costs one extra byte-level loop
        over that token, ``tables.max_bytes`` steps, so only pass a cap that can bind).

    Returns:
      ``(kind int32 [], square int32 [])``.
    """
    token_ids = jnp.asarray(token_ids)
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be [T] (vmap for batches), got shape {token_ids.shape}")
    t = token_ids.shape[0]
    v = tables.vocab_size
    if tables.token_class.shape[0] != v + 1:
        raise ValueError(
            f"ParserTables.token_class has {tables.token_class.shape[0]} entries, expected vocab + 1 = {v + 1}; "
            "build the tables with build_parser_tables"
        )
    length = jnp.asarray(t if length is None else length, jnp.int32)
    ids = jnp.clip(token_ids.astype(jnp.int32), 0, v - 1)
    valid = jnp.arange(t) < length
    cap = None if max_bytes is None or int(max_bytes) >= t * tables.max_bytes else max(0, int(max_bytes))
    if cap is not None:
        lens = jnp.where(valid, tables.token_len[ids], 0)
        ends = jnp.cumsum(lens)
        starts = ends - lens
        cut = valid & (starts < cap) & (ends > cap)  # the (at most one) token straddling the cap
        cut_id = jnp.sum(jnp.where(cut, ids, 0))
        cut_bytes = jnp.sum(jnp.where(cut, cap - starts, 0))
        valid = valid & (ends <= cap)
    carry = _run(tables.class_next, jnp.where(valid, ids, v), symbol_class=tables.token_class,
                 pair_table=tables.class_pair_next)
    if cap is not None:  # the first cut_bytes bytes of the straddling token, one byte at a time
        col = jnp.arange(tables.max_bytes)
        symbols = jnp.where(col < cut_bytes, tables.token_bytes[cut_id].astype(jnp.int32), 256)
        carry = _run(jnp.asarray(_byte_table()), symbols, carry)
    return _result(carry)


def parse_tool_call_batch(tables: ParserTables, token_ids: jax.Array, lengths: jax.Array, *, max_bytes=None):
    """``vmap`` of ``parse_tool_call`` over ``token_ids [B, T]`` and ``lengths [B]`` -> ``(kind [B], square [B])``."""
    fn = functools.partial(parse_tool_call, max_bytes=max_bytes)
    return jax.vmap(fn, in_axes=(None, 0, 0))(tables, token_ids, lengths)
