"""Per-token stop detection: stop tokens, and a byte-level matcher for a closing pattern (e.g. ``</tool_call>``)
that works whatever the tokenisation of the pattern.

The matcher is the pattern's KMP byte automaton (``protocol.tokens.kmp_table``) with one output per edge, "the
pattern was completed here"; after a completion it restarts from the pattern's longest proper border, so
back-to-back and overlapping occurrences are all seen. ``protocol.tokens.lift_to_tokens`` lifts it to tokens
(hits along a token OR together), giving one ``[S, V]`` lookup per generated token.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.protocol import tokens as tokens_lib


@flax.struct.dataclass
class StopTables:
    """Arrays that decide when a generated token ends the assistant's turn.

    Attributes:
      is_stop: `bool [V]` tokens that end a turn by themselves (turn-end / eos).
      match_next: `int32 [S, V]` state of the byte matcher for the closing pattern after feeding token v in state s
        (KMP automaton over the pattern's bytes, applied to all bytes of the token).
      match_hit: `bool [S, V]` the pattern was completed somewhere inside token v's bytes when starting in state s.
    """

    is_stop: jax.Array
    match_next: jax.Array
    match_hit: jax.Array


def _restart_state(auto: np.ndarray, pattern: bytes) -> int:
    """State after a full match: the longest proper border of the pattern (KMP failure of state m)."""
    m = len(pattern)
    s = 0
    for byte in pattern[1:]:
        s = auto[s, byte]
    return int(s) if s < m else 0


def matcher_automaton(pattern: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``(next int32 [m, 256], hit int64 [m, 256])``: the KMP matcher whose "found" state is folded back into the
    restart state, with the completion as the edge's output (1)."""
    auto = tokens_lib.kmp_table(pattern)
    m = len(pattern)
    restart = _restart_state(auto, pattern)
    nxt = auto[:m]
    hit = (nxt == m).astype(np.int64)
    return np.where(nxt == m, restart, nxt).astype(np.int32), hit


def build_stop_tables(token_bytes: Sequence[bytes], stop_ids: Sequence[int], pattern: bytes | None) -> StopTables:
    """Host-side construction of `StopTables`.

    Args:
      token_bytes: the bytes each token id decodes to (length V; special tokens: their literal text, or b"" for
        tokens that can never be part of the pattern).
      stop_ids: ids that end a turn on their own (e.g. the turn-end token and eos).
      pattern: bytes whose completion ends a turn (e.g. b"</tool_call>"), or None.
    """
    vocab = len(token_bytes)
    is_stop = np.zeros((vocab,), bool)
    for i in stop_ids:
        if not 0 <= int(i) < vocab:
            raise ValueError(f"stop id {i} outside the vocabulary of size {vocab}")
        is_stop[int(i)] = True
    if not pattern:
        return StopTables(
            is_stop=jnp.asarray(is_stop),
            match_next=jnp.zeros((1, vocab), jnp.int32),
            match_hit=jnp.zeros((1, vocab), bool),
        )
    nxt, hit = matcher_automaton(pattern)
    table, lens = tokens_lib.byte_matrix(list(token_bytes))
    state, code = tokens_lib.lift_to_tokens(nxt, hit, table, lens, merge=np.maximum)
    return StopTables(
        is_stop=jnp.asarray(is_stop), match_next=jnp.asarray(state.astype(np.int32)), match_hit=jnp.asarray(code != 0)
    )


def stop_update(tables: StopTables, match_state: jax.Array, token: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Advances the matcher by one token per row.

    Args:
      match_state: `int32 [B]`; token: `int32 [B]`.
    Returns:
      `(new_state [B] int32, stop [B] bool)`: stop is True when the token is a stop token or completes the pattern.
    """
    new_state = tables.match_next[match_state, token]
    stop = tables.is_stop[token] | tables.match_hit[match_state, token]
    return new_state, stop
