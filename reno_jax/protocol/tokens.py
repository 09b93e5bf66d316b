"""Token bytes and token lifting: the shared host-side machinery of every token-level automaton.

* ``token_bytes(tokenizer)``: the exact bytes each token id contributes to decoded text.
* ``kmp_table(pattern)``: the KMP byte automaton of a literal (the tag matchers of the tool-call parser and the
  stop matcher).
* ``lift_to_tokens``: a byte automaton with an output code on every edge -> the automaton over tokens (state and
  merged output after feeding ALL bytes of a token), vectorised over the vocabulary.
* ``token_classes``: token ids whose lifted columns are equal share one class, so a ``[S, V]`` table becomes a
  ``[V]`` class map plus a ``[S, C]`` table (C is a few dozen for grammars over a handful of bytes, whatever V is).

Text decoding replaces invalid UTF-8 by U+FFFD and never swallows an ASCII byte, so an automaton that treats every
non-ASCII byte alike reads token bytes and decoded text the same way; that is why lifting works on raw bytes.
"""

from __future__ import annotations

import functools
import json
from typing import Callable

import numpy as np


def kmp_table(pattern: bytes) -> np.ndarray:
    """``int32 [len+1, 256]``: state = number of pattern bytes matched; state ``len`` = found.

    Row ``len`` is the failure row, so stepping on from "found" continues the search (overlapping matches).
    """
    if not pattern:
        raise ValueError("kmp_table needs a non-empty pattern")
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
        raise TypeError("token_bytes needs a fast (Rust-backed) Hugging Face tokenizer")
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


def byte_matrix(pieces: list[bytes], vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(uint8 [V, W] right-padded bytes, int32 [V] lengths)``; ``vocab_size`` adds empty rows (ids without text)."""
    v = max(len(pieces), int(vocab_size or 0))
    width = max([1] + [len(p) for p in pieces])
    table = np.zeros((v, width), np.uint8)
    lens = np.zeros((v,), np.int32)
    for i, p in enumerate(pieces):
        table[i, : len(p)] = np.frombuffer(p, np.uint8)
        lens[i] = len(p)
    return table, lens


def last_store(prev: np.ndarray, edge: np.ndarray) -> np.ndarray:
    """Default output merge: the edge's code unless it is 0 ("no output"), then the earlier one."""
    return np.where(edge != 0, edge, prev)


def lift_to_tokens(
    next_state: np.ndarray,
    out: np.ndarray,
    token_bytes: np.ndarray,
    token_len: np.ndarray,
    merge: Callable[[np.ndarray, np.ndarray], np.ndarray] = last_store,
) -> tuple[np.ndarray, np.ndarray]:
    """Byte automaton ``next_state [S, 256]`` with edge outputs ``out [S, 256]`` (0 = none) -> token automaton.

    Returns ``(state [S, V], code [S, V])``: the state after all bytes of token v from state s, and the outputs of
    the edges taken folded left to right with ``merge(acc, edge)`` (elementwise on arrays, starting from 0).
    Tokens without bytes are the identity with code 0.

    Cost: one vectorised pass per byte column, ``S x (total bytes of the vocabulary)`` lookups.
    """
    s_count, v = next_state.shape[0], token_len.shape[0]
    cur = np.repeat(np.arange(s_count, dtype=np.int64)[:, None], v, axis=1)
    code = np.zeros((s_count, v), np.int64)
    for j in range(token_bytes.shape[1]):
        active = np.nonzero(token_len > j)[0]
        if active.size == 0:
            break
        b = token_bytes[active, j].astype(np.int64)[None, :]
        c = cur[:, active]
        code[:, active] = merge(code[:, active], out[c, b].astype(np.int64))
        cur[:, active] = next_state[c, b]
    return cur, code


def token_classes(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[S, V]`` token table -> (class of each column ``int32 [V]``, ``[S, C]`` distinct columns)."""
    cols = np.ascontiguousarray(table.T)
    keys = cols.view(np.dtype((np.void, cols.dtype.itemsize * cols.shape[1]))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return inverse.astype(np.int32).ravel(), np.ascontiguousarray(cols[first].T)
