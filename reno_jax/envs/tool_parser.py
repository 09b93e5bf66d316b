"""Tool-call parsing: a host reference parser and a jitted byte-level DFA that agrees with it exactly.

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
``build_parser_tables(tokenizer)`` turns the vocabulary into a byte table ``[V, max_bytes]`` (byte-level BPE
tokens are mapped back through the GPT-2 byte<->unicode table; added/special tokens contribute their literal
text; a token may be a partial UTF-8 sequence). ``parse_tool_call`` gathers the bytes of the generated tokens,
packs them, and runs one ``lax.scan`` over bytes with three automata: a KMP matcher for ``<tool_call>``, then,
inside the call, a KMP matcher for ``</tool_call>`` in parallel with a DFA for the body grammar above, plus an
integer register for the square (saturating at 10). The body can never contain ``<``, so the body DFA's state just
before the closing tag is the state saved at the most recent ``<``. Text decoding replaces invalid UTF-8 by U+FFFD
and every non-ASCII byte is "other" to all three automata, so bytes and decoded text always give the same result.
"""

from __future__ import annotations

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
    """Per-token bytes for ``parse_tool_call`` (pytree of arrays).

    Attributes:
      token_bytes: ``uint8 [V, max_bytes]`` bytes of each token id, right-padded with 0.
      token_len: ``int32 [V]`` byte count of each token id (0 for ids with no text).
    """

    token_bytes: jax.Array
    token_len: jax.Array

    @property
    def vocab_size(self) -> int:
        return int(self.token_len.shape[0])

    @property
    def max_bytes(self) -> int:
        return int(self.token_bytes.shape[1])


def build_parser_tables(tokenizer, vocab_size: int | None = None) -> ParserTables:
    """Byte table for ``tokenizer``; ``vocab_size`` (e.g. the model's padded vocab) adds empty rows."""
    pieces = token_bytes(tokenizer)
    v = max(len(pieces), int(vocab_size or 0))
    width = max(1, max(len(p) for p in pieces))
    table = np.zeros((v, width), np.uint8)
    lens = np.zeros((v,), np.int32)
    for i, p in enumerate(pieces):
        table[i, : len(p)] = np.frombuffer(p, np.uint8)
        lens[i] = len(p)
    return ParserTables(token_bytes=jnp.asarray(table), token_len=jnp.asarray(lens))


# ----------------------------------------------------------------------------------------------------------------
# Jitted parser
# ----------------------------------------------------------------------------------------------------------------


def _pack_bytes(tables: ParserTables, token_ids: jax.Array, length: jax.Array, max_bytes: int):
    """Left-pack the bytes of ``token_ids[:length]`` into ``uint8 [max_bytes]``; returns (bytes, n_bytes)."""
    t = token_ids.shape[0]
    ids = jnp.clip(token_ids.astype(jnp.int32), 0, tables.vocab_size - 1)
    lens = jnp.where(jnp.arange(t) < length, tables.token_len[ids], 0)  # [T]
    starts = jnp.cumsum(lens) - lens
    col = jnp.arange(tables.max_bytes)
    pos = starts[:, None] + col[None, :]  # [T, Bmax]
    keep = (col[None, :] < lens[:, None]) & (pos < max_bytes)
    pos = jnp.where(keep, pos, max_bytes)  # out-of-bounds scatter index: dropped
    buf = jnp.zeros((max_bytes,), jnp.uint8).at[pos.reshape(-1)].set(tables.token_bytes[ids].reshape(-1), mode="drop")
    return buf, jnp.minimum(jnp.sum(lens), max_bytes)


def parse_tool_call(
    tables: ParserTables, token_ids: jax.Array, length: Any = None, *, max_bytes: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Parse the first tool call in a generated token sequence (jit/vmap friendly; agrees with
    ``parse_tool_call_text(decode(token_ids[:length]))``).

    Args:
      tables: ``ParserTables`` of the tokenizer that produced the ids.
      token_ids: ``int [T]`` generated tokens (ids outside ``[0, V)`` are clipped).
      length: ``int []`` number of valid tokens (default T); the rest is ignored.
      max_bytes: static cap on the number of text bytes scanned (default ``T * tables.max_bytes``, always exact).
        A smaller cap makes the scan shorter; text past the cap is treated as not generated.

    Returns:
      ``(kind int32 [], square int32 [])``.
    """
    token_ids = jnp.asarray(token_ids)
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be [T] (vmap for batches), got shape {token_ids.shape}")
    t = token_ids.shape[0]
    length = jnp.asarray(t if length is None else length, jnp.int32)
    n = t * tables.max_bytes if max_bytes is None else int(max_bytes)
    buf, n_bytes = _pack_bytes(tables, token_ids, length, n)

    open_kmp = jnp.asarray(_OPEN_KMP)
    close_kmp = jnp.asarray(_CLOSE_KMP)
    body_next = jnp.asarray(_BODY_NEXT)
    body_act = jnp.asarray(_BODY_ACT)
    body_accept = jnp.asarray(_BODY_ACCEPT)
    n_open, n_close = len(OPEN_TAG), len(CLOSE_TAG)
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731

    def step(carry, x):
        phase, k_open, k_close, body, saved, val, kind, square = carry
        byte, valid = x
        b = byte.astype(jnp.int32)
        searching = valid & (phase == 0)
        inside = valid & (phase == 1)
        # Phase 0: look for the opening tag.
        k_open2 = open_kmp[k_open, b]
        opened = searching & (k_open2 == n_open)
        # Phase 1: closing-tag matcher, body DFA, square register, body state before the latest '<'.
        k_close2 = close_kmp[k_close, b]
        body2 = body_next[body, b]
        act = body_act[body, b]
        d = b - ord("0")
        val2 = jnp.select(
            [act == _ACT_SET0, act == _ACT_SETD, act == _ACT_ACC],
            [0, d, jnp.minimum(val * 10 + d, _VAL_SAT)],
            default=val,
        )
        saved2 = jnp.where(b == ord("<"), body, saved)
        closed = inside & (k_close2 == n_close)
        accepted = body_accept[saved2]
        in_range = (val2 >= MIN_SQUARE) & (val2 <= MAX_SQUARE)
        kind2 = jnp.where(accepted, jnp.where(in_range, KIND_OK, KIND_OUT_OF_RANGE), KIND_BAD_CALL)
        carry = (
            jnp.where(opened, 1, jnp.where(closed, 2, phase)),
            jnp.where(searching, k_open2, k_open),
            jnp.where(inside, k_close2, k_close),
            jnp.where(inside, body2, body),
            jnp.where(inside, saved2, saved),
            jnp.where(inside, val2, val),
            jnp.where(closed, kind2, kind),
            jnp.where(closed & accepted & in_range, val2, square),
        )
        return tuple(i32(c) for c in carry), None

    init = (i32(0), i32(0), i32(0), i32(_BODY_START), i32(_BODY_START), i32(0), i32(KIND_NO_CALL), i32(0))
    valid = jnp.arange(n) < n_bytes
    carry, _ = jax.lax.scan(step, init, (buf, valid), unroll=1)
    return carry[6], carry[7]


def parse_tool_call_batch(tables: ParserTables, token_ids: jax.Array, lengths: jax.Array, *, max_bytes=None):
    """``vmap`` of ``parse_tool_call`` over ``token_ids [B, T]`` and ``lengths [B]`` -> ``(kind [B], square [B])``."""
    fn = functools.partial(parse_tool_call, max_bytes=max_bytes)
    return jax.vmap(fn, in_axes=(None, 0, 0))(tables, token_ids, lengths)
