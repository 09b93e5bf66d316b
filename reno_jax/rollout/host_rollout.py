"""Multi-turn rollout for a `HostEnv` (`reno_jax.envs.host`): environments in Python, caches on the device.

`host_rollout(params, key, envs, tasks, *, model_config, rollout_config, chat, ...)` plays B episodes of host
environments (one Python object per episode) and returns the same `Trajectory` as the jitted
`reno_jax.rollout.rollout` (every field with the same layout and meaning), so the trainer cannot tell them apart.

Structure (turn-synchronous, like the jitted rollout; the model pieces are jitted once per shape, the turn loop is
Python):

    envs[b].reset(tasks[b]) -> first user message text (all episodes together, in a thread pool)
    render: the chat template's fixed prompt prefix/suffix ids + the message's own tokens (tokenised once)
    PREFILL (jitted; caches donated): the prompts; with `share_prompt_prefill` each distinct prompt once (B / G
        rows when a group's episodes share their task) and SHARE (jitted) copies the caches to its rows, as the
        jitted rollout does per group
    for turn in 0..T-1 while any episode is live:
        DECODE (jitted; caches donated): sample every live row until it stops (turn end / eos / completed
            "</tool_call>" / max_new_tokens); only the new ids, their behaviour log-probs, counts and
            "stopped on the turn end" cross to the host
        host: decode each row's new ids to text, parse its call (`host.parse_call`), step every live episode
            together in a thread pool with `tool_timeout_s` (a raising or late tool: an error response and the
            environment's `tool_error_reward`, the episode ends; the other rows go on)
        host: render each response as the template's fixed tool-turn prefix + its own tokens (cut to
            `max_response_tokens`, counted) + the fixed suffix and next assistant header; an episode whose response
            plus a full next turn would overflow L ends truncated
        PREFILL (jitted; caches donated): each response at its row's position (rows with nothing to feed untouched)

Token-in / token-out: the trajectory holds exactly the ids that were fed to the model (prompt, sampled, fixed
pieces, response contents tokenised on their own); the history is never decoded and re-tokenised, so the trainer
scores the very ids the policy sampled even when the conversation's text would tokenise differently as a whole.

The fixed pieces come from `reno_jax.protocol.chat.compile_chat` (the tables the jitted path renders with), on a
spec whose single user and tool templates are one empty slot: the template's text around the slot is the fixed
rendering, the slot is where a message's own tokens go.

Jitted pieces (`HostPrograms`): `prefill(params, cache, last, ids [B, W], n [B])`, `decode(params, cache, last,
keys, live [B], forced [B, m], env)` and `share(cache, last, source [B])`. A block that needs more than one chunk
is W = L rounded up to `prefill_chunk` wide (one compiled prefill for every long prompt or history); a shorter one
(a turn's responses) the power of two from 8 that holds it, so it costs what it feeds, not a whole chunk. Shared
prompts are prefilled in caches of B / G rows. B and L are fixed per call, so each piece compiles once per width
(a few) and the cache buffers are donated to prefill and decode (updated in place, never copied or rebuilt).
Sampling reuses the jitted rollout's `_decode_turn` (per-row keys folded with the position: a row's tokens do not
depend on other rows, and match the jitted path's for the same ids).

Trajectory: as in `reno_jax.rollout.rollout`; `turn_key` is -1 (host environments declare no state keys);
`routing` is None (routing replay is not supported here: `record_routing` raises); `stats` is a
`HostRolloutStats`, the `RolloutStats` fields plus `responses_cut`, `tool_errors` and `tool_timeouts` (`[B]`
int32); `env_info` is the environments' `episode_info` stacked to `[B]` arrays.

Bounded history (`RolloutConfig.history = k`, as in the jitted rollout; see `reno_jax.rollout.rollout`): every
turn of an episode is its own turn sample, a row of Lt = `turn_length(chat, programs)` tokens:

    system turn (system prompt + tools)                                          `HostChat.system_ids`, fed once
                                                                                 per call, its cache copied
    the episode's last min(k, t) exchanges, oldest first; an exchange is the     `HostChat.exchange_ids`
        assistant header + the very ids sampled in that turn + the rest of the
        turn and the tool turn of its response, as fed (no trailing header)
    the observation as a user turn + assistant header: turn 0 `reset`'s first   `HostChat.observation_ids`
        message, then `env.observation()` (default: `reset`'s message again,
        the task restated after the window)
    then the sampled assistant turn (m = max_new_tokens at most)

Only ids are assembled (the exchanges are the ids sampled and fed, never re-tokenised), so the row is what the chat
template renders for [system, (assistant call, tool response) x min(k, t), user observation] when every piece
tokenises on its own as in the whole. The layout is the jitted path's: `tokens, valid, loss_mask, behaviour_logp,
turn_id [B * T, Lt]` (row b * T + t: episode b's turn t; a turn the episode did not reach is a padding row),
`prompt_length, reward, group_id, episode_id, turn_index [B * T]` (the episode's reward on each of its rows) and
`turn_reward, turn_key, stats, env_info` per episode. An environment whose state matters beyond the last k
exchanges (a board, the steps done) says it in `observation()`; k = 0 with the default observation shows the task
alone every turn. The whole conversation's `max_length` is unused; `resend_history` does not apply.

How the training loop calls it (`reno_jax.loop.host_envs`): build `chat = compile_host_chat(env_class, tokenizer,
vocab_size)` and `programs = make_host_programs(model_config, rollout_config, host_config)` once; per step draw
`envs, tasks = host.sample_episodes(env_class, rng, num_groups, group_size)` and call
`host_rollout(params, key, envs, tasks, chat=chat, programs=programs)` in place of the jitted rollout function
(outside jit: it is a host function). The learner consumes the `Trajectory` unchanged.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import time
import types
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import host
from reno_jax.models import ling3
from reno_jax.protocol import chat as chat_lib
from reno_jax.protocol import tokens as tokens_lib
from reno_jax.protocol import toolcall
from reno_jax.protocol.tokenizer import decode as decode_text
from reno_jax.rollout import generate as gen
from reno_jax.rollout import rollout as R

# ---------------------------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class HostConfig:
    """Host-side settings of `host_rollout`.

    Attributes:
      max_prompt_tokens: cap on a first user message's own tokens (sizes L when `max_length` is 0).
      max_response_tokens: a tool response's own tokens beyond this are cut (and counted in `responses_cut`).
      tool_timeout_s: seconds the live episodes' `step` calls of one turn may take (from the turn's start); a call
        still running then gives its episode an error response.
      max_workers: threads stepping the episodes (0: one per episode; with fewer, queued calls count against the
        same deadline).
      resend_history: the peers' way, for comparison (benchmarks/host_rollout_cost.py): before every turn after the
        first, fresh empty caches are built and each live row's whole conversation so far is prefilled again,
        instead of only its new response into the kept caches. The ids fed are the same, so the trajectory's
        tokens are too; only the cost (and float rounding of the log-probs) differs.
    """

    max_prompt_tokens: int = 256
    max_response_tokens: int = 128
    tool_timeout_s: float = 30.0
    max_workers: int = 0
    resend_history: bool = False


# ---------------------------------------------------------------------------------------------- fixed pieces

_CONTENT = 1  # source index of the message's own content (value 0) in a compiled program
_TURN_END = 2  # source index of the add-turn-end slot (num_values + 1)


@flax.struct.dataclass
class _DecodeChat:
    """What the jitted decode reads of the chat tables (`rollout._decode_token`): two static ids, so every
    environment on one tokenizer shares the compiled decode."""

    pad_id: int = flax.struct.field(pytree_node=False)
    turn_end_id: int = flax.struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True, eq=False)
class HostChat:
    """A host environment's chat template pieces (host ids) and the device tables the decode needs.

    Attributes:
      tokenizer: the HF tokenizer (tokenises each message's own content, decodes each turn's new ids).
      tools: the environment's tool schemas (the parser's list of names).
      env: `rollout.CompiledEnv` with the stop tables and the pad / turn-end ids only (what the jitted decode
        reads).
      prompt_prefix, prompt_suffix: ids before / after the first user message's content (system turn with the
        tools, user header; user turn end, assistant header).
      tool_prefix: ids before a tool response's content, after the assistant's turn-end marker.
      tool_suffix: ids after a tool response's content (tool turn end, next assistant header).
      turn_end: the assistant's turn-end marker ids (added when the policy did not generate it).
      system_ids: the system turn every prompt starts with, None when the template's prompt does not split into
        system turn, user turn and assistant header (then bounded history is unavailable).
      header_ids: the assistant header every prompt and tool turn ends with (None as `system_ids`).
    """

    tokenizer: Any
    tools: tuple
    env: R.CompiledEnv
    prompt_prefix: tuple
    prompt_suffix: tuple
    tool_prefix: tuple
    tool_suffix: tuple
    turn_end: tuple
    system_ids: tuple | None = None
    header_ids: tuple | None = None

    @property
    def pad_id(self) -> int:
        return self.env.pad_id

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)] if text else []

    def prompt_ids(self, text: str) -> list[int]:
        return [*self.prompt_prefix, *self.encode(text), *self.prompt_suffix]

    def response_ids(self, content: Sequence[int], add_turn_end: bool) -> list[int]:
        """The rest of the assistant turn, the tool turn of `content` (ids) and the next assistant header."""
        return [*(self.turn_end if add_turn_end else ()), *self.tool_prefix, *content, *self.tool_suffix]

    def observation_ids(self, text: str) -> list[int]:
        """Bounded history: `text` as the user turn (and assistant header) that ends a turn prompt."""
        return self.prompt_ids(text)[len(self.system_ids) :]

    def exchange_ids(self, sampled: Sequence[int], response: Sequence[int]) -> list[int]:
        """Bounded history: one exchange of the window, the assistant header, the `sampled` ids and `response`
        (`response_ids`) without the next assistant header it ends with."""
        return [*self.header_ids, *sampled, *response[: len(response) - len(self.header_ids)]]


def _split_program(tables: chat_lib.ChatTables, base, src, add_turn_end: bool) -> tuple[tuple, tuple]:
    """Ids of a compiled program before and after its content slot."""
    piece_ids, piece_len = np.asarray(tables.piece_ids), np.asarray(tables.piece_len)
    before, after, seen = [], [], False
    for b, s in zip(np.asarray(base).tolist(), np.asarray(src).tolist()):
        if s == _CONTENT:
            seen = True
            continue
        idx = b + (int(add_turn_end) if s == _TURN_END else 0)
        (after if seen else before).extend(int(i) for i in piece_ids[idx, : piece_len[idx]])
    if not seen:
        raise ValueError("the chat template dropped the message content")
    return tuple(before), tuple(after)


def compile_host_chat(
    env_class: type[host.HostEnv], tokenizer, vocab_size: int | None = None, chat_template: str | None = None
) -> HostChat:
    """Binds a host environment's system prompt and tools to `tokenizer` (host, once)."""
    content = (chat_lib.Slot(0, ("",)),)
    spec = chat_lib.ChatSpec(
        system=env_class.system_prompt,
        tools=tuple(env_class.tools),
        user=(content,),
        tool=(content,),
        tool_continues=(True,),
        num_values=1,
        tool_name=None if env_class.tools else env_class.name,
    )
    tables = chat_lib.compile_chat(tokenizer, spec, chat_template)
    pieces = tokens_lib.token_bytes(tokenizer)
    if vocab_size is not None and vocab_size < len(pieces):
        raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer's {len(pieces)} ids")
    pieces = pieces + [b""] * ((vocab_size or 0) - len(pieces))
    stop = gen.build_stop_tables(pieces, [int(i) for i in np.asarray(tables.stop_ids)], toolcall.CLOSE_TAG.encode())
    prompt_prefix, prompt_suffix = _split_program(tables, tables.prompt_base[0], tables.prompt_src[0], False)
    tool_prefix, tool_suffix = _split_program(tables, tables.response_base[0], tables.response_src[0], False)
    with_end, _ = _split_program(tables, tables.response_base[0], tables.response_src[0], True)
    turn_end = with_end[: len(with_end) - len(tool_prefix)]
    if with_end[len(turn_end) :] != tool_prefix:
        raise AssertionError("the turn-end marker is not a prefix of the tool turn")
    system_ids, header_ids = _history_pieces(spec, tables, tokenizer, chat_template, prompt_prefix, tool_suffix)
    return HostChat(
        tokenizer=tokenizer,
        tools=tuple(env_class.tools),
        env=R.CompiledEnv(env=None, chat=_DecodeChat(tables.pad_id, tables.turn_end_id), parser=None, stop=stop),
        prompt_prefix=prompt_prefix,
        prompt_suffix=prompt_suffix,
        tool_prefix=tool_prefix,
        tool_suffix=tool_suffix,
        turn_end=turn_end,
        system_ids=system_ids,
        header_ids=header_ids,
    )


def _history_pieces(spec, tables, tokenizer, chat_template, prompt_prefix, tool_suffix):
    """`(system_ids, header_ids)` of the jitted path's `rollout.history_tables`, or `(None, None)` when the template
    does not split a prompt into system turn, user turn and header, or a tool turn does not end with the header."""
    history = R.history_tables(spec, tables, tokenizer, chat_template)
    if history is None:
        return None, None
    system_ids = tuple(int(i) for i in np.asarray(history.system_ids))
    header_ids = tuple(int(i) for i in np.asarray(history.header_ids))
    if (
        prompt_prefix[: len(system_ids)] != system_ids
        or tool_suffix[len(tool_suffix) - len(header_ids) :] != header_ids
    ):
        return None, None
    return system_ids, header_ids


# ---------------------------------------------------------------------------------------------- jitted pieces


@dataclasses.dataclass(frozen=True, eq=False)
class HostPrograms:
    """The jitted model pieces of `host_rollout` for one model and rollout config (build once, reuse).

    `traces` counts how often each piece's Python body ran (one per compilation).
    """

    model_config: ling3.Ling3Config
    rollout_config: R.RolloutConfig
    host_config: HostConfig
    prefill: Any
    decode: Any
    share: Any
    traces: dict


def _setup(params, model_config, rollout_config, env, keys, forced) -> R._Setup:
    """The jitted rollout's `_Setup` for one turn's decode: one turn, the forced tokens of that turn (the decode
    reads neither the turn count nor L)."""
    b = keys.shape[0]
    return R._Setup(
        params=params,
        model_config=model_config,
        rollout_config=rollout_config,
        env=env,
        keys=keys,
        forced_tokens=forced[:, None, :],
        batch=b,
        turns=1,
        length=0,
    )


def make_host_programs(
    model_config: ling3.Ling3Config,
    rollout_config: R.RolloutConfig,
    host_config: HostConfig = HostConfig(),
    compiler_options: dict | None = None,
) -> HostPrograms:
    """`HostPrograms` with the configs bound; the caches (`cache`, `last`) are donated to prefill and decode."""
    if rollout_config.record_routing:
        raise ValueError("host_rollout does not record routing (record_routing=True)")
    if rollout_config.history is not None and host_config.resend_history:
        raise ValueError("resend_history applies to the whole conversation, not bounded history (history)")
    traces = {"prefill": 0, "decode": 0, "share": 0}
    chunk = rollout_config.prefill_chunk

    def prefill(params, cache, last, ids, n):
        """ids int32 [B, W] (W a multiple of the chunk, or one block narrower than it), n int32 [B] -> (cache,
        last [B, V])."""
        traces["prefill"] += 1
        return gen.prefill_chunked(params, model_config, cache, ids, n, last, min(chunk, ids.shape[1]))

    def decode(params, cache, last, keys, live, forced, env):
        """One turn of every live row -> (cache, last, ids int32 [B, m], logp float32 [B, m], n int32 [B],
        turn_end bool [B])."""
        traces["decode"] += 1
        setup = _setup(params, model_config, rollout_config, env, keys, forced)
        carry = types.SimpleNamespace(turn=jnp.int32(0), cache=cache, last=last, live=live, routing=None)
        d = R._decode_turn(setup, carry)
        return d.cache, d.last, d.gen_tok, d.gen_logp, d.n_gen, d.turn_end

    def share(cache, last, source):
        """Caches of N rows -> of B rows, row b a copy of row source[b] (int32 [B]) -> (cache, last)."""
        traces["share"] += 1
        return jax.tree.map(lambda a: a[source], (cache, last))

    jit = functools.partial(jax.jit, donate_argnames=("cache", "last"), compiler_options=compiler_options)
    return HostPrograms(
        model_config=model_config,
        rollout_config=rollout_config,
        host_config=host_config,
        prefill=jit(prefill),
        decode=jit(decode),
        share=jax.jit(share, compiler_options=compiler_options),  # B / G rows in, B out: nothing to donate
        traces=traces,
    )


# ---------------------------------------------------------------------------------------------- output


@flax.struct.dataclass
class HostRolloutStats(R.RolloutStats):
    """`RolloutStats` plus the host rollout's faults (`[B]` int32): responses cut to `max_response_tokens`, tool
    calls that raised, tool calls that ran past `tool_timeout_s`."""

    responses_cut: jax.Array
    tool_errors: jax.Array
    tool_timeouts: jax.Array


def num_turns(envs: Sequence[host.HostEnv], rollout_config: R.RolloutConfig) -> int:
    bound = min(int(e.max_turns) for e in envs)
    return max(1, min(int(rollout_config.max_turns) or bound, bound))  # max_turns 0: the environments' own


def _history_chat(chat: HostChat) -> HostChat:
    if chat.system_ids is None:
        raise ValueError(
            "bounded history (rollout.history) needs a chat template whose prompts are system + user turn + "
            "assistant header and whose tool turns end with that header; this one does not (use rollout.history=-1)"
        )
    return chat


def turn_length(chat: HostChat, programs: HostPrograms) -> int:
    """Lt of bounded history: `turn_length`, or (when 0) the system turn, k exchanges (header, a full turn, the
    longest response) and the longest observation's user turn, plus a full turn."""
    rc, hc, m = programs.rollout_config, programs.host_config, programs.rollout_config.max_new_tokens
    system = len(_history_chat(chat).system_ids)
    response = len(chat.turn_end) + len(chat.tool_prefix) + hc.max_response_tokens + len(chat.tool_suffix)
    observation = len(chat.prompt_prefix) - system + hc.max_prompt_tokens + len(chat.prompt_suffix)
    need = system + int(rc.history) * (m + response) + observation + m
    if rc.turn_length and rc.turn_length < need:
        raise ValueError(f"turn_length {rc.turn_length} cannot hold a turn sample; use at least {need} (or 0)")
    return rc.turn_length or need


def conversation_length(chat: HostChat, programs: HostPrograms, turns: int) -> int:
    """L: `max_length`, or (when 0) the longest prompt, all turns at full length and the longest responses; with
    bounded history the turn sample's length Lt (`turn_length`)."""
    rc, hc = programs.rollout_config, programs.host_config
    if rc.history is not None:
        return turn_length(chat, programs)
    if rc.max_length:
        return rc.max_length
    prompt = len(chat.prompt_prefix) + hc.max_prompt_tokens + len(chat.prompt_suffix)
    response = len(chat.turn_end) + len(chat.tool_prefix) + hc.max_response_tokens + len(chat.tool_suffix)
    return prompt + turns * rc.max_new_tokens + (turns - 1) * response


# ---------------------------------------------------------------------------------------------- the rollout


def run_call(env: host.HostEnv, call) -> tuple[str, Any]:
    """Worker: `(method name, what it returned)` of the environment's answer to `call`."""
    if isinstance(call, host.InvalidCall):
        return "invalid_call", env.invalid_call(call)
    return "step", env.step(call)


def _step_all(pool, envs, calls: dict, timeout_s: float) -> dict:
    """Steps the episodes of `calls` ({row: call}) together; {row: (HostStep, fault)} with fault None, "error" or
    "timeout". A wrong return type raises at once (a bug of the environment, not a tool fault)."""
    deadline = time.monotonic() + timeout_s
    futures = {b: pool.submit(run_call, envs[b], call) for b, call in calls.items()}
    out = {}
    for b, fut in futures.items():
        env = envs[b]
        try:
            method, result = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            out[b] = (host.HostStep(f"Tool timed out after {timeout_s:g} s.", env.tool_error_reward, True), "timeout")
            continue
        except Exception as e:  # noqa: BLE001 - any tool failure becomes that episode's error response
            out[b] = (host.HostStep(f"Tool error: {type(e).__name__}: {e}", env.tool_error_reward, True), "error")
            continue
        out[b] = (host.checked_step(env, method, result), None)
    return out


@dataclasses.dataclass(eq=False)
class _Rows:
    """Host-side buffers, numpy, filled in place by the turn loop (shapes as in `Trajectory`). Token rows: N = B
    (one per episode, W = L) or, with bounded history, N = B * T (one per turn sample, row b * T + t, W = Lt)."""

    tokens: np.ndarray  # int32 [N, W]
    logp: np.ndarray  # float32 [N, W]
    loss_mask: np.ndarray  # bool [N, W]
    turn_id: np.ndarray  # int32 [N, W]
    length: np.ndarray  # int32 [N] tokens written (= the row's cache length)
    prompt_length: np.ndarray  # int32 [N]
    live: np.ndarray  # bool [B]
    reward: np.ndarray  # float32 [B]
    turn_reward: np.ndarray  # float32 [B, T]
    stats: dict  # HostRolloutStats field -> [B] array
    turn_samples: bool  # bounded history: a token row per turn of each episode

    @classmethod
    def empty(cls, batch: int, length: int, turns: int, pad_id: int, turn_samples: bool = False) -> "_Rows":
        stats = {f.name: np.zeros((batch,), np.int32) for f in dataclasses.fields(HostRolloutStats)}
        stats["valid_call"], stats["truncated"] = np.zeros((batch,), bool), np.zeros((batch,), bool)
        n = batch * turns if turn_samples else batch
        return cls(
            tokens=np.full((n, length), pad_id, np.int32),
            logp=np.zeros((n, length), np.float32),
            loss_mask=np.zeros((n, length), bool),
            turn_id=np.full((n, length), -1, np.int32),
            length=np.zeros((n,), np.int32),
            prompt_length=np.zeros((n,), np.int32),
            live=np.ones((batch,), bool),
            reward=np.zeros((batch,), np.float32),
            turn_reward=np.zeros((batch, turns), np.float32),
            stats=stats,
            turn_samples=turn_samples,
        )

    def row(self, b: int, turn: int) -> int:
        """The token row of episode b's turn `turn`."""
        return b * self.turn_reward.shape[1] + turn if self.turn_samples else b

    def write(self, b: int, ids, turn: int, logp=None) -> None:
        """Appends `ids` to episode b's row of turn `turn`: sampled ids (in the loss) when their `logp` is given,
        prefilled text otherwise."""
        r = self.row(b, turn)
        start, end = self.length[r], self.length[r] + len(ids)
        self.tokens[r, start:end] = ids
        self.turn_id[r, start:end] = turn
        if logp is not None:
            self.logp[r, start:end] = logp
            self.loss_mask[r, start:end] = True
        self.length[r] = end


@dataclasses.dataclass(frozen=True, eq=False)
class _Run:
    """What every phase of one `host_rollout` call reads."""

    params: Any
    chat: HostChat
    programs: HostPrograms
    envs: Sequence[host.HostEnv]
    pool: concurrent.futures.ThreadPoolExecutor
    keys: jax.Array  # [B] per-row PRNG keys
    groups: int  # B / G
    forced: np.ndarray  # int32 [B, T, m]
    turns: int  # T
    length: int  # L

    @property
    def width(self) -> int:
        """W: the prefill block, L rounded up to the chunk (one compiled prefill for prompts and responses)."""
        chunk = self.programs.rollout_config.prefill_chunk
        return -(-self.length // chunk) * chunk


def _block_width(longest: int, chunk: int, full: int) -> int:
    """Width of a prefill block whose longest row is `longest` tokens: the full W when it needs more than one chunk
    (one compiled prefill whatever the length), else the power of two from 8 that holds it, at most the chunk
    (padding costs as much compute as real tokens; a few widths, each compiled once)."""
    if longest > chunk:
        return full
    width = 8
    while width < longest:
        width *= 2
    return min(width, chunk)


def _feed(run: _Run, cache, last, rows: dict):
    """Prefills {row: ids} at each row's position (the other rows untouched); returns `(cache, last)`."""
    batch = last.shape[0]
    longest = max((len(row_ids) for row_ids in rows.values()), default=0)
    width = _block_width(longest, run.programs.rollout_config.prefill_chunk, run.width)
    ids = np.full((batch, width), run.chat.pad_id, np.int32)
    n = np.zeros((batch,), np.int32)
    for b, row_ids in rows.items():
        ids[b, : len(row_ids)] = row_ids
        n[b] = len(row_ids)
    return run.programs.prefill(run.params, cache, last, jnp.asarray(ids), jnp.asarray(n))


def _start(run: _Run, rows: _Rows, tasks: Sequence[Any]):
    """Resets every episode (in the pool), writes and prefills the prompts; returns the caches `(cache, last)`.

    With `share_prompt_prefill` (as in the jitted rollout), when the prompts are at most B / G different id
    sequences (a group's episodes share a task), each is prefilled once, in caches of B / G rows, and copied to the
    rows that have it."""
    rc, hc = run.programs.rollout_config, run.programs.host_config
    prompts = {}
    for b, text in enumerate(run.pool.map(host.checked_reset, run.envs, tasks)):
        content, ids = run.chat.encode(text), run.chat.prompt_ids(text)
        if len(content) > hc.max_prompt_tokens or len(ids) + rc.max_new_tokens > run.length:
            raise ValueError(
                f"{type(run.envs[b]).__name__}.reset gave a first message of {len(content)} tokens; "
                f"max_prompt_tokens is {hc.max_prompt_tokens} and L = {run.length} must also hold one turn of "
                f"{rc.max_new_tokens} tokens"
            )
        prompts[b] = ids
        rows.write(b, ids, 0)
    rows.prompt_length[:] = rows.length
    batch = len(run.envs)
    distinct = {}  # prompt ids -> its row in the shared caches
    source = np.array([distinct.setdefault(tuple(ids), len(distinct)) for ids in prompts.values()], np.int32)
    if not rc.share_prompt_prefill or run.groups == batch or len(distinct) > run.groups:
        return _feed(run, *_empty_caches(run, batch), prompts)
    cache, last = _feed(run, *_empty_caches(run, run.groups), {row: list(ids) for ids, row in distinct.items()})
    return run.programs.share(cache, last, jnp.asarray(source))


def _empty_caches(run: _Run, rows: int):
    """Fresh `(cache, last)` for `rows` rows at length L, nothing fed."""
    mc, rc = run.programs.model_config, run.programs.rollout_config
    cache_dtype = jnp.bfloat16 if rc.cache_dtype == "bfloat16" else jnp.float32
    # Copies: init_cache shares one zero buffer between leaves, and a buffer can be donated only once.
    cache = jax.tree.map(jnp.copy, ling3.init_cache(mc, rows, run.length, cache_dtype))
    last = jnp.zeros((rows, mc.vocab_size), jnp.float32)
    return cache, last


def _resend(run: _Run, rows: _Rows):
    """`HostConfig.resend_history`: every live row's conversation so far prefilled into fresh empty caches."""
    history = {b: rows.tokens[b, : rows.length[b]] for b in np.flatnonzero(rows.live)}
    return _feed(run, *_empty_caches(run, len(run.envs)), history)


def _sample(run: _Run, rows: _Rows, cache, last, turn: int):
    """Decodes turn `turn` of the live rows and writes its ids; returns `(cache, last, {row: parsed call},
    turn_end bool [B], {row: sampled ids})`."""
    m, stats = run.programs.rollout_config.max_new_tokens, rows.stats
    cache, last, *new = run.programs.decode(
        run.params, cache, last, run.keys, jnp.asarray(rows.live), jnp.asarray(run.forced[:, turn]), run.chat.env
    )
    new_ids, new_logp, n_new, turn_end = jax.device_get(new)  # the only device -> host transfer of a turn
    calls, sampled = {}, {}
    for b in np.flatnonzero(rows.live):
        n = int(n_new[b])
        sampled[b] = new_ids[b, :n].tolist()
        rows.write(b, sampled[b], turn, logp=new_logp[b, :n])
        stats["generated_tokens"][b] += n
        stats["budget_stops"][b] += n >= m
        stats["num_turns"][b] += 1
        calls[b] = host.parse_call(run.chat.tools, decode_text(run.chat.tokenizer, new_ids[b, :n]))
        stats["parse_kind"][b] = host.KIND_OK if isinstance(calls[b], host.ToolCall) else calls[b].kind
        stats["valid_call"][b] = stats["parse_kind"][b] == host.KIND_OK
    return cache, last, calls, turn_end, sampled


def _answer(run: _Run, rows: _Rows, calls: dict, turn_end: np.ndarray, turn: int) -> dict:
    """Steps the episodes of `calls` together and records their rewards; returns {row: response ids} of those that
    go on (`HostChat.response_ids`, the content cut to the budget)."""
    hc, stats = run.programs.host_config, rows.stats
    responses = {}
    for b, (step, fault) in _step_all(run.pool, run.envs, calls, hc.tool_timeout_s).items():
        rows.reward[b] += step.reward
        rows.turn_reward[b, turn] = step.reward
        stats["tool_errors"][b] += fault == "error"
        stats["tool_timeouts"][b] += fault == "timeout"
        if step.done:
            rows.live[b] = False
            continue
        if turn + 1 == run.turns:  # out of turns: stays live, truncated at the end
            continue
        content = run.chat.encode(step.text)
        if len(content) > hc.max_response_tokens:
            content = content[: hc.max_response_tokens]
            stats["responses_cut"][b] += 1
        responses[b] = run.chat.response_ids(content, add_turn_end=not turn_end[b])
    return responses


def _write_responses(run: _Run, rows: _Rows, responses: dict, turn: int) -> dict:
    """Whole conversation: writes each response as the start of turn `turn + 1`; an episode whose response and a
    full next turn would overflow L ends truncated instead. Returns {row: response ids} to prefill."""
    m, fed = run.programs.rollout_config.max_new_tokens, {}
    for b, ids in responses.items():
        if rows.length[b] + len(ids) + m > run.length:
            rows.live[b], rows.stats["truncated"][b] = False, True
            continue
        rows.write(b, ids, turn + 1)
        fed[b] = ids
    return fed


def _trajectory(run: _Run, rows: _Rows, group_size: int) -> R.Trajectory:
    """The `Trajectory` of the finished episodes: those still live after the last turn are truncated too (the
    environment's `truncation_reward`, on their last turn), as in the jitted rollout."""
    batch, stats = len(run.envs), rows.stats
    truncated = stats["truncated"] | rows.live
    stats["truncated"] = truncated
    trunc_reward = np.array([e.truncation_reward for e in run.envs], np.float32)
    reward = np.where(truncated, trunc_reward, rows.reward).astype(np.float32)
    last_turn = np.arange(run.turns)[None, :] == np.maximum(stats["num_turns"] - 1, 0)[:, None]
    turn_reward = np.where(truncated[:, None], np.where(last_turn, reward[:, None], 0.0), rows.turn_reward)
    infos = [host.checked_info(e, bool(t)) for e, t in zip(run.envs, truncated)]
    env_info = {k: np.array([info[k] for info in infos]) for k in (infos[0] if infos else {})}
    episode_id = turn_index = None
    if rows.turn_samples:  # row b * T + t: episode b's turn t, with the episode's reward
        episode_id = np.repeat(np.arange(batch, dtype=np.int32), run.turns)
        turn_index = np.tile(np.arange(run.turns, dtype=np.int32), batch)
    episode = np.arange(batch, dtype=np.int32) if episode_id is None else episode_id
    traj = R.Trajectory(
        tokens=rows.tokens,
        valid=np.arange(run.length)[None, :] < rows.length[:, None],
        loss_mask=rows.loss_mask,
        behaviour_logp=rows.logp,
        turn_id=rows.turn_id,
        prompt_length=rows.prompt_length,
        reward=reward[episode],
        group_id=episode // group_size,
        stats=HostRolloutStats(**stats),
        env_info=env_info,
        routing=None,
        turn_reward=turn_reward.astype(np.float32),
        turn_key=np.full((batch, run.turns), -1, np.int32),
        episode_id=episode_id,
        turn_index=turn_index,
    )
    return jax.tree.map(jnp.asarray, traj)


def _play_conversation(run: _Run, rows: _Rows, tasks: Sequence[Any]) -> None:
    """The whole conversation (module docstring): the caches are kept, each turn feeds only the new responses (or,
    with `resend_history`, the whole history again)."""
    resend = run.programs.host_config.resend_history
    cache, last = _start(run, rows, tasks)
    for turn in range(run.turns):
        if not rows.live.any():
            break
        if resend and turn:
            del cache, last  # the peers' way: the kept caches are dropped, the history is fed again
            cache, last = _resend(run, rows)
        cache, last, calls, turn_end, _ = _sample(run, rows, cache, last, turn)
        responses = _write_responses(run, rows, _answer(run, rows, calls, turn_end, turn), turn)
        if responses and not resend:
            cache, last = _feed(run, cache, last, responses)


def _observation_ids(run: _Run, env: host.HostEnv, text: str) -> list[int]:
    """Bounded history: the observation's user turn and assistant header (its content at most
    `max_prompt_tokens`)."""
    content = run.chat.encode(text)
    if len(content) > run.programs.host_config.max_prompt_tokens:
        raise ValueError(
            f"{type(env).__name__} gave an observation of {len(content)} tokens; max_prompt_tokens is "
            f"{run.programs.host_config.max_prompt_tokens}"
        )
    return run.chat.observation_ids(text)


def _play_window(run: _Run, rows: _Rows, tasks: Sequence[Any]) -> None:
    """Bounded history (module docstring): each turn, every live episode's turn prompt (system turn, its last k
    exchanges, its observation) is fed after a copy of the system turn's cache (fed once), then decoded, parsed and
    stepped as in the whole conversation."""
    chat, k = _history_chat(run.chat), int(run.programs.rollout_config.history)
    first = list(run.pool.map(host.checked_reset, run.envs, tasks))
    windows = [collections.deque(maxlen=k) for _ in run.envs]  # ids of each episode's last k exchanges
    system = _feed(run, *_empty_caches(run, 1), {0: list(chat.system_ids)})
    to_every_row = jnp.zeros((len(run.envs),), jnp.int32)
    for turn in range(run.turns):
        if not rows.live.any():
            break
        prompts = {}
        for b in np.flatnonzero(rows.live):
            text = first[b] if turn == 0 else host.checked_observation(run.envs[b], first[b])
            ids = [*chat.system_ids, *(i for ex in windows[b] for i in ex), *_observation_ids(run, run.envs[b], text)]
            rows.write(b, ids, turn)
            rows.prompt_length[rows.row(b, turn)] = len(ids)
            prompts[b] = ids[len(chat.system_ids) :]
        cache, last = _feed(run, *run.programs.share(*system, to_every_row), prompts)
        _, _, calls, turn_end, sampled = _sample(run, rows, cache, last, turn)
        for b, response in _answer(run, rows, calls, turn_end, turn).items():
            windows[b].append(chat.exchange_ids(sampled[b], response))


def host_rollout(
    params,
    key: jax.Array,
    envs: Sequence[host.HostEnv],
    tasks: Sequence[Any],
    *,
    chat: HostChat,
    programs: HostPrograms,
    group_size: int | None = None,
    forced_tokens: np.ndarray | None = None,
) -> R.Trajectory:
    """Plays B = len(envs) episodes to the end (a host function; the model pieces are jitted).

    Args:
      params: Ling-3.0 parameters.
      key: policy PRNG key, or `[B]` per-episode keys.
      envs: B fresh `HostEnv` objects (one per episode); tasks: their B tasks (`host.sample_episodes` makes both,
        the G episodes of a group on one task).
      chat: `compile_host_chat(...)`; programs: `make_host_programs(...)` (reuse across calls: compiled once).
      group_size: G for `group_id` (default `programs.rollout_config.group_size`).
      forced_tokens: optional `int32 [B, turns, max_new_tokens]` teacher forcing (>= 0 taken instead of a sample,
        its behaviour log-prob still recorded), as in the jitted rollout.
    Returns:
      `Trajectory` (see the module docstring).
    """
    rc, batch = programs.rollout_config, len(envs)
    g = group_size or rc.group_size
    if len(tasks) != batch or batch % g:
        raise ValueError(f"got {batch} environments and {len(tasks)} tasks; need as many, in whole groups of {g}")
    for env in envs:
        if not isinstance(env, host.HostEnv):
            raise TypeError(f"envs must be HostEnv objects, got {type(env).__name__}")
    turns = num_turns(envs, rc)
    shape = (batch, turns, rc.max_new_tokens)
    if forced_tokens is not None and np.shape(forced_tokens) != shape:
        raise ValueError(f"forced_tokens must be [B, turns, max_new_tokens] = {shape}, got {np.shape(forced_tokens)}")
    forced = np.full(shape, -1, np.int32) if forced_tokens is None else np.asarray(forced_tokens, np.int32)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=programs.host_config.max_workers or batch)
    run = _Run(
        params=params,
        chat=chat,
        programs=programs,
        envs=envs,
        pool=pool,
        keys=gen.row_keys(key, batch),
        groups=batch // g,
        forced=forced,
        turns=turns,
        length=conversation_length(chat, programs, turns),
    )
    bounded = rc.history is not None
    rows = _Rows.empty(batch, run.length, turns, chat.pad_id, turn_samples=bounded)
    try:
        (_play_window if bounded else _play_conversation)(run, rows, tasks)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a timed-out tool's thread is left to finish alone
    return _trajectory(run, rows, g)
