"""Multi-turn agent rollout for ANY `TextEnv`, as ONE jittable pure function.

`rollout(params, key, starts, *, model_config, rollout_config, env)` renders the environment's first user
messages, generates with the Ling-3.0 hybrid cache (KDA recurrent/conv state + MLA latent cache), parses every
turn's tool call with the token automaton compiled from the environment's tool schemas, steps the environment,
renders its tool response and continues, all inside `jax.jit` (no host callbacks). The rollout knows no game:
everything game-specific is behind `reno_jax.envs.interface.TextEnv` (`reset`, `step`, `finish`).

Structure (turn-synchronous; every loop is `lax` control flow, compiled once):

    env.reset(start) -> first user message; render and prefill it in chunks (once per group, caches copied)
    for turn in 0..turns-1 while any episode is live:
        decode token by token (sampling from each row's last logits) until every live row has stopped:
            turn-end/eos token, completed "</tool_call>" (token-level matcher), or max_new_tokens
        parse the turn's tokens (jitted automaton) -> ToolCall
        env.step(state, call) -> state, tool message, reward, done, info
        for episodes that go on: render the tool message + next assistant header, end (truncated) an episode
        whose response plus a full next turn would overflow L, prefill the response in chunks

Rows advance independently: a row that is not live in a model call is fed with `valid=False`, so its caches do not
change, and each row samples with its own key folded with its own position, so a row's tokens never depend on
other rows. Episodes come in groups: the G = `group_size` episodes of a group share their start record (so
differences within a group come from the policy only, when the environment keeps its randomness in the start).

Trajectory layout (`Trajectory`, B = num_groups * group_size episodes, L = `conversation_length(env, config)`):
  tokens [B, L] int32             prompt, policy tokens, tool responses, ...; pad id after the end
  valid [B, L] bool               real tokens (a prefix of each row)
  loss_mask [B, L] bool           exactly the policy-generated tokens (including the stop token it generated)
  behaviour_logp [B, L] float32   log-prob of the token under the distribution it was sampled from, aligned with
                                  `tokens` (0 where loss_mask is 0); with temperature 1 and no top-k/top-p this is
                                  the model's log-softmax, i.e. `ling3.token_logprobs` of the same conversation
  turn_id [B, L] int32            k for turn k's prefilled text (prompt for k = 0, tool response before turn k
                                  otherwise) and turn k's policy tokens; -1 on padding
  routing [B, L, n_moe, K] int16  only with `record_routing` (else None): the experts each MoE layer (in
                                  `ling3.moe_layer_indices` order) sent token t to when token t was the model's
                                  INPUT during the rollout (prefill for prompt / tool-response tokens, the decode
                                  step that sampled it for a policy token). The train forward replays row t to
                                  compute the hidden state at t, which scores token t + 1. -1 where nothing was
                                  routed, i.e. on padding (every real token is fed once, so it has ids).
  prompt_length [B] int32, reward [B] float32, group_id [B] int32 (episode b is in group b // G)
  turn_reward [B, T] float32      the environment's reward of turn k (0 after the last turn; a truncated episode's
                                  whole `truncation_reward` on its last turn): each row sums to `reward`
  turn_key [B, T] int32           `env.state_key` of the state turn k acted in; -1 after the last turn, or when
                                  the environment declares no keys
  stats: `RolloutStats` of [B] arrays (the rollout's own per-episode figures)
  env_info: the environment's final info pytree ([B] leaves, after `env.finish`)
  info: dict merging both (`stats` fields by name, then the environment's info keys)

Bounded history (`RolloutConfig.history = k`): every turn of an episode is its own short row, a "turn sample".

With the whole conversation (`history=None`, above) turn t is generated after every earlier
turn, so an episode of T turns costs O(T^2) attention and its cache and row grow with T. With a window of k, turn
t's prompt is built afresh from token-id pieces

    system prefix (system prompt + tools, as every rendered prompt starts)      `HistoryTables.system_ids`, [S]
    the episode's last min(k, t) exchanges, oldest first; an exchange is
        assistant header + the policy's call + the rest of its turn and the tool turn (without the trailing
        assistant header the tool template continues with)                        ring of [k, E] ids per episode
    the environment's CURRENT observation as a user turn + assistant header    `env.observation(state)` rendered
                                                                                 by `render_user`, system cut off
    then the sampled assistant turn (m = max_new_tokens at most)

and prefilled into a cache of Lt = `turn_length` positions that starts as a copy of the system prefix's (fed
once per rollout, one row), decoded, parsed and played exactly as in the full rollout (`_decode_turn`; the
environment steps the same way). k = 0 is the observation alone (a Markov policy). A turn costs O(Lt) tokens with
Lt = S + k E + O + m independent of t, so an episode costs O(T Lt) and the memory is one Lt cache plus the T rows
per episode. The whole conversation is cheaper while the repeated system prompt and observation outweigh what a
growing conversation adds (short episodes, long system prompts): `benchmarks/history_cost.py` measures both.

Trajectory layout (R = B * T rows, row r = episode r // T, turn r % T; Lt = `turn_length(env, config)`):
  tokens, valid, loss_mask, behaviour_logp, turn_id [R, Lt]   as in the full rollout, per turn sample: the loss
                                  mask covers the sampled turn only and `turn_id` is the row's turn on every valid
                                  token; a turn the episode did not reach (it ended before) is a padding row:
                                  valid and loss_mask all False, prompt_length 0
  routing [R, Lt, n_moe, K]       with `record_routing`, each turn sample's own routing
  prompt_length [R]               the turn prompt's tokens (system + window + observation)
  reward [R]                      the EPISODE's reward on every row of the episode (trajectory credit: GRPO/GSPO
                                  over episode groups gives every turn sample its episode's advantage)
  group_id, episode_id, turn_index [R]   the episode's group, the episode (0..B-1), the turn (0..T-1)
  turn_reward, turn_key [B, T]    per episode as in the full rollout; row r's are `.reshape(-1)[r]`
  stats, env_info [B]             per episode, as in the full rollout
Rows of a group (G episodes x T turns) are contiguous, so `rl.learner` selects and normalises groups of G T rows
(`learner.make_prepare_batch` with `Trajectory.episode_id` set). Episodes end only by the environment or the turn
limit here: the window always fits Lt.

Episode starts, groups, per-row keys and forced tokens behave as in the full rollout (a turn's tokens depend on its
row only), so `forced_tokens [B, T, m]` force turn t of episode b whatever the history.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface
from reno_jax.models import ling3
from reno_jax.protocol import bind
from reno_jax.protocol import chat as chat_lib
from reno_jax.rollout import generate as gen
from reno_jax.rollout import sampling

# ---------------------------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static rollout settings (hashable; pass as a static argument).

    Attributes:
      group_size: G episodes per start (GRPO/GSPO groups).
      max_new_tokens: policy tokens per turn (a turn that reaches it ends there; its call is parsed as is).
      max_turns: agent turns per episode (capped by the environment's `max_turns()`); 0: the environment's own.
      max_length: L, the conversation length (trajectory width and cache size); 0 means `required_length(env,
        config)`, the smallest L that never truncates. An episode whose next tool response plus a full turn would
        not fit ends as truncated.
      temperature, top_k, top_p, greedy: sampling (see `reno_jax.rollout.sampling`).
      prefill_chunk: C, tokens per model call when feeding prompts / tool responses.
      stop_at_tool_call: end the turn as soon as "</tool_call>" is complete (the turn-end marker is then part of
        the tool response text, not a policy token).
      cache_dtype: dtype name of the MLA/conv caches ("float32" or "bfloat16"); KDA state is always float32. With
        bfloat16 the behaviour log-probs drift from a float32 training forward (use float32 for exact old_logp).
      parse_max_bytes: cap on the bytes of a turn the tool-call parser scans (None: all of them, always exact).
      share_prompt_prefill: feed each group's prompt once (N rows instead of N * G) and copy the caches to the
        group's episodes. Rows are computed independently, so this only saves work.
      record_routing: record the top-k expert ids of every fed token in every MoE layer (`Trajectory.routing`,
        for routing replay and the routing-agreement metric). Off: the rollout program is the plain one.
      history: None: each episode is one growing conversation (one row). k >= 0: bounded history, each turn is
        its own row (turn sample) whose prompt is the system prompt, the episode's last k exchanges and the
        environment's current observation (below); `max_length` is then unused.
      turn_length: with `history`, the width of a turn sample; 0 means `required_turn_length`, the
        smallest that always fits (a smaller one is an error).
    """

    group_size: int = 1
    max_new_tokens: int = 32
    max_turns: int = 1
    max_length: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    prefill_chunk: int = 64
    stop_at_tool_call: bool = True
    cache_dtype: str = "float32"
    parse_max_bytes: int | None = None
    share_prompt_prefill: bool = True
    record_routing: bool = False
    history: int | None = None
    turn_length: int = 0

    def __post_init__(self):
        for name in ("group_size", "max_new_tokens", "prefill_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_turns < 0:
            raise ValueError(f"max_turns must be >= 0 (0: the environment's own), got {self.max_turns}")
        if self.max_length < 0:
            raise ValueError(f"max_length must be >= 0 (0: required_length), got {self.max_length}")
        if self.history is not None and (isinstance(self.history, bool) or int(self.history) < 0):
            raise ValueError(f"history must be None (whole conversation) or an int k >= 0, got {self.history!r}")
        if self.turn_length < 0:
            raise ValueError(f"turn_length must be >= 0 (0: the required one), got {self.turn_length}")
        if self.cache_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"cache_dtype must be 'float32' or 'bfloat16', got {self.cache_dtype!r}")
        sampling.validate_sampling_args(self.temperature, self.top_k, self.top_p, self.greedy)

    @property
    def sampling_config(self) -> gen.SamplingConfig:
        return gen.SamplingConfig(self.temperature, self.top_k, self.top_p, self.greedy)


def num_turns(env: "CompiledEnv", rollout_config: RolloutConfig) -> int:
    """Agent turns the rollout runs: `max_turns`, capped by the environment's own bound (0: that bound)."""
    bound = int(env.env.max_turns())
    return max(1, min(int(rollout_config.max_turns) or bound, bound))


def required_length(env: "CompiledEnv", rollout_config: RolloutConfig) -> int:
    """Smallest L that fits the longest prompt, all turns at full length and the tool responses between them."""
    t = num_turns(env, rollout_config)
    return env.prompt_len + t * rollout_config.max_new_tokens + (t - 1) * env.response_len


def conversation_length(env: "CompiledEnv", rollout_config: RolloutConfig) -> int:
    """L used by the rollout: `max_length`, or `required_length` when it is 0."""
    return rollout_config.max_length or required_length(env, rollout_config)


# ---------------------------------------------------------------------------------------------- compiled env


@flax.struct.dataclass
class CompiledEnv:
    """A `TextEnv` bound to a tokenizer: the environment plus the token tables the rollout needs (a pytree of
    arrays built once on the host; pass it into the jitted rollout).

    Attributes:
      env: the `TextEnv` (its arrays are leaves).
      chat: compiled chat tables (`reno_jax.protocol.chat.compile_chat`): in-jit rendering of its messages.
      parser: compiled tool-call tables (`reno_jax.protocol.toolcall.compile_tool_calls`) of its tool schemas.
      stop: `generate.StopTables` (turn-end/eos tokens and the "</tool_call>" matcher).
      history: `HistoryTables` for bounded history (`RolloutConfig.history`), None when the template's prompt
        does not split into system prefix, user turn and assistant header.
    """

    env: Any
    chat: Any
    parser: Any
    stop: Any
    history: Any = None  # `HistoryTables`, or None when the chat template does not split (no bounded history)

    @property
    def prompt_len(self) -> int:
        return int(self.chat.prompt_len)

    @property
    def response_len(self) -> int:
        return int(self.chat.response_len)

    @property
    def pad_id(self) -> int:
        return int(self.chat.pad_id)

    @property
    def vocab_size(self) -> int:
        return int(self.stop.is_stop.shape[0])

    def render_user(self, message: interface.Message):
        """`(ids int32 [prompt_len], n int32 [])`: system + first user message + assistant header."""
        return bind.render_user(self.chat, message)

    def render_tool(self, message: interface.Message, add_turn_end):
        """`(ids int32 [response_len], n int32 [])`: the rest of the assistant turn, the tool turn and, when the
        template continues the conversation, the next assistant header."""
        return bind.render_tool(self.chat, message, add_turn_end)

    def parse_batch(self, ids: jax.Array, lengths: jax.Array, max_bytes: int | None = None) -> interface.ToolCall:
        """Parses `[B, T]` turns (first `lengths[b]` tokens) -> a `[B]` batch of `ToolCall`s."""
        return bind.parse_batch(self.parser, ids, lengths, max_bytes)


def compile_env(
    env: interface.TextEnv, tokenizer, vocab_size: int | None = None, chat_template: str | None = None
) -> CompiledEnv:
    """Binds `env` to `tokenizer` (host, once): compiles its chat templates and tool schemas to token tables.

    Args:
      env: a `TextEnv`.
      tokenizer: HF tokenizer (e.g. `reno_jax.protocol.tokenizer.load_tokenizer(None)`).
      vocab_size: the model's vocabulary size when it is larger than the tokenizer's (padded embedding); extra ids
        decode to nothing. Must not be smaller than the tokenizer's vocabulary.
      chat_template: override of the tokenizer's chat template.
    """
    spec = env.chat()
    chat, parser, pieces = bind.compile(spec, tokenizer, vocab_size, chat_template)
    stop_ids = [int(i) for i in np.asarray(chat.stop_ids)]
    stop = gen.build_stop_tables(pieces, stop_ids, bind.CLOSE_TAG.encode())
    history = history_tables(spec, chat, tokenizer, chat_template)
    return CompiledEnv(env=env, chat=chat, parser=parser, stop=stop, history=history)


@flax.struct.dataclass
class HistoryTables:
    """The token pieces a bounded-history turn prompt is assembled from (below).

    Attributes:
      system_ids: ``int32 [S]`` the system message (with the tools) as every rendered prompt starts with it.
      header_ids: ``int32 [H]`` the assistant header every rendered prompt ends with (the generation prompt).
      tool_continues: ``bool [len(spec.tool)]`` tool template k's render ends with that header.
    """

    system_ids: jax.Array
    header_ids: jax.Array
    tool_continues: jax.Array


def history_tables(spec, chat_tables, tokenizer, chat_template: str | None = None) -> HistoryTables | None:
    """Host, once: the system prefix and the assistant header of `spec`'s prompts as token ids, checked against
    every user template's rendered prompt; None when a rendered prompt is not system + user turn + header (then
    bounded history is unavailable)."""
    system = [{"role": "system", "content": spec.system}]
    user = system + [{"role": "user", "content": "x"}]
    with_header = chat_lib.chat_text(tokenizer, spec, user, True, chat_template)
    without = chat_lib.chat_text(tokenizer, spec, user, False, chat_template)
    system_text = chat_lib.chat_text(tokenizer, spec, system, False, chat_template)
    if not with_header.startswith(without) or not without.startswith(system_text):
        return None
    system_ids = tokenizer.encode(system_text, add_special_tokens=False)
    header_ids = tokenizer.encode(with_header[len(without) :], add_special_tokens=False)
    for template in range(len(spec.user)):
        ids, n = chat_lib.render_user(chat_tables, (template, [0] * spec.num_values))
        ids = [int(i) for i in np.asarray(ids)[: int(n)]]
        s, h = len(system_ids), len(header_ids)
        if len(ids) < s + h or ids[:s] != system_ids or ids[len(ids) - h :] != header_ids:
            return None
    return HistoryTables(
        system_ids=jnp.asarray(system_ids, jnp.int32),
        header_ids=jnp.asarray(header_ids, jnp.int32),
        tool_continues=jnp.asarray(spec.tool_continues, jnp.bool_),
    )


# ---------------------------------------------------------------------------------------------- output


@flax.struct.dataclass
class RolloutStats:
    """The rollout's own per-episode figures (`[B]` arrays), whatever the environment.

    Attributes:
      parse_kind: `int32` parser kind of the last call (0 ok, 1 no_call, 2 bad_call, 3 out_of_range).
      valid_call: `bool` the last call parsed (kind ok).
      num_turns: `int32` agent turns played; generated_tokens: `int32` policy tokens over all turns.
      budget_stops: `int32` turns that hit max_new_tokens.
      truncated: `bool` the episode hit the conversation length L or the turn limit before it was done.
    """

    parse_kind: jax.Array
    valid_call: jax.Array
    num_turns: jax.Array
    generated_tokens: jax.Array
    budget_stops: jax.Array
    truncated: jax.Array


@flax.struct.dataclass
class Trajectory:
    """Rollout output; shapes in the module docstring."""

    tokens: jax.Array
    valid: jax.Array
    loss_mask: jax.Array
    behaviour_logp: jax.Array
    turn_id: jax.Array
    prompt_length: jax.Array
    reward: jax.Array
    group_id: jax.Array
    stats: RolloutStats
    env_info: Any
    routing: Any = None
    turn_reward: Any = None
    turn_key: Any = None
    episode_id: Any = None  # bounded history only: int32 [B * T] the episode of each turn sample (else None)
    turn_index: Any = None  # bounded history only: int32 [B * T] the turn of each turn sample (else None)

    @property
    def info(self) -> dict:
        """`stats` and the environment's info in one flat dict of `[B]` arrays (env keys win on a clash)."""
        out = {f.name: getattr(self.stats, f.name) for f in dataclasses.fields(self.stats)}
        env_info = self.env_info
        if isinstance(env_info, dict):
            out.update(env_info)
        return out


# ---------------------------------------------------------------------------------------------- the rollout


def _expand(x: jax.Array, g: int) -> jax.Array:
    return jnp.repeat(x, g, axis=0)


def _chunk_for(text_len: int, chunk: int) -> int:
    """Prefill chunk for a block of at most `text_len` tokens: `chunk`, or less when one smaller call covers it
    (padding positions cost as much compute as real ones)."""
    return max(1, min(chunk, -(-text_len // 8) * 8))


def scatter_rows(buf: jax.Array, start: jax.Array, values: jax.Array, count: jax.Array) -> jax.Array:
    """buf[b, start[b] + j] = values[b, j] for j < count[b] (others dropped). buf [B, L, ...], values [B, W, ...]."""
    b, w = values.shape[:2]
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    idx = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])  # out of bounds -> dropped
    return buf.at[jnp.arange(b)[:, None], idx].set(values.astype(buf.dtype), mode="drop")


def _keep_where(live: jax.Array, new, old):
    """`new` for live rows, `old` elsewhere, leaf by leaf (leaves have a leading [B])."""
    return jax.tree.map(lambda a, o: jnp.where(jnp.reshape(live, live.shape + (1,) * (a.ndim - 1)), a, o), new, old)


@flax.struct.dataclass
class _Decode:
    """Loop state of one turn's token-by-token decode."""

    step: jax.Array  # int32 []
    cache: dict
    last: jax.Array  # float32 [B, V] next-token logits of every row
    gen_tok: jax.Array  # int32 [B, m]
    gen_logp: jax.Array  # float32 [B, m]
    n_gen: jax.Array  # int32 [B]
    match: jax.Array  # int32 [B] stop-matcher state
    stopped: jax.Array  # bool [B]
    turn_end: jax.Array  # bool [B] the row's last token was the turn-end marker
    routing: Any


@flax.struct.dataclass
class _Episodes:
    """Loop state of the turn loop (one entry per episode unless noted)."""

    turn: jax.Array  # int32 []
    cache: dict
    last: jax.Array  # float32 [B, V]
    tokens: jax.Array  # int32 [B, L]
    logp: jax.Array  # float32 [B, L]
    gen_start: jax.Array  # int32 [B, T] start of turn k's policy tokens (L if no turn k)
    gen_end: jax.Array  # int32 [B, T]
    live: jax.Array  # bool [B]
    reward: jax.Array  # float32 [B] sum of the environment's step rewards
    turn_reward: jax.Array  # float32 [B, T]
    turn_key: jax.Array  # int32 [B, T]
    env_state: Any
    env_info: Any
    parse_kind: jax.Array
    valid_call: jax.Array
    num_turns: jax.Array
    gen_tokens: jax.Array
    budget_stops: jax.Array
    truncated: jax.Array
    routing: Any


def rollout(
    params,
    key: jax.Array,
    starts,
    *,
    model_config: ling3.Ling3Config,
    rollout_config: RolloutConfig,
    env: CompiledEnv,
    forced_tokens: jax.Array | None = None,
    return_cache: bool = False,
):
    """Runs B = N * group_size episodes to the end; a pure function, jit it with the configs static.

    Args:
      params: Ling-3.0 parameters.
      key: policy PRNG key, or `[B]` per-episode keys (a row's samples then depend on its key only).
      starts: the environment's start records, a pytree with leading axis N (one per group).
      model_config, rollout_config: static.
      env: `CompiledEnv` from `compile_env`.
      forced_tokens: optional `int32 [B, turns, max_new_tokens]` teacher forcing: where >= 0 the token is taken
        instead of a sample (its behaviour log-prob is still recorded under the sampling distribution); < 0 samples.
        For tests and scripted openings; stop detection applies to forced tokens too.
      return_cache: static; also return the final model cache (tests).

    Returns:
      `Trajectory` (and the final cache when `return_cache`). Truncated episodes (L or the turn limit reached
      before the environment said done) get the environment's `truncation_reward` and `env.finish(...,
      truncated=True)`.
    """
    if rollout_config.history is not None:  # bounded history: turn samples (module docstring)
        return _bounded_rollout(
            params,
            key,
            starts,
            model_config=model_config,
            rollout_config=rollout_config,
            env=env,
            forced_tokens=forced_tokens,
            return_cache=return_cache,
        )
    setup = _make_setup(params, key, starts, model_config, rollout_config, env, forced_tokens)
    env_state, prompt_ids, prompt_len = _reset(setup, starts)
    cache, last, routing = _prefill_prompts(setup, prompt_ids, prompt_len)
    carry = _initial_episodes(setup, env_state, prompt_ids, prompt_len, cache, last, routing)
    carry = jax.lax.while_loop(
        lambda c: (c.turn < setup.turns) & jnp.any(c.live), functools.partial(_play_turn, setup), carry
    )
    traj = _finalise(setup, carry, prompt_len)
    if return_cache:
        return traj, carry.cache
    return traj


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: it holds traced arrays
class _Setup:
    """What every phase of one rollout reads: the static sizes and configs, and the traced inputs (built once per
    trace, inside the jitted function)."""

    params: Any
    model_config: ling3.Ling3Config
    rollout_config: RolloutConfig
    env: CompiledEnv
    keys: jax.Array  # [B] per-row PRNG keys
    forced_tokens: jax.Array | None  # int32 [B, T, m] or None
    batch: int  # B = N * G
    turns: int  # T
    length: int  # L

    @property
    def max_new_tokens(self) -> int:  # m
        return self.rollout_config.max_new_tokens

    @property
    def record(self) -> bool:
        return self.rollout_config.record_routing


def _make_setup(
    params, key, starts, mc: ling3.Ling3Config, rc: RolloutConfig, env: CompiledEnv, forced_tokens
) -> _Setup:
    """Checks the arguments of `rollout` against each other and gathers them in a `_Setup`."""
    t_max, m, big_l = num_turns(env, rc), rc.max_new_tokens, conversation_length(env, rc)
    leaves = jax.tree.leaves(starts)
    if not leaves:
        raise ValueError("starts has no arrays; it must be the environment's start records with a leading [N]")
    b = leaves[0].shape[0] * rc.group_size
    if env.prompt_len + m > big_l:
        raise ValueError(
            f"max_length {big_l} cannot hold the prompt ({env.prompt_len} tokens) plus one turn of "
            f"{m} tokens; use at least required_length(env, config) = {required_length(env, rc)}"
        )
    if env.parser.vocab_size < mc.vocab_size or env.vocab_size < mc.vocab_size:
        raise ValueError(
            f"env tables cover {env.parser.vocab_size} token ids but the model has {mc.vocab_size}; "
            "build the env with compile_env(env, tokenizer, vocab_size=model_config.vocab_size)"
        )
    if forced_tokens is not None and forced_tokens.shape != (b, t_max, m):
        raise ValueError(f"forced_tokens must be [B={b}, turns={t_max}, max_new_tokens={m}], got {forced_tokens.shape}")
    if forced_tokens is not None:
        forced_tokens = jnp.asarray(forced_tokens, jnp.int32)
    if rc.record_routing and mc.num_experts > np.iinfo(np.int16).max:
        raise ValueError(f"record_routing stores expert ids as int16; {mc.num_experts} experts do not fit")
    return _Setup(
        params=params,
        model_config=mc,
        rollout_config=rc,
        env=env,
        keys=gen.row_keys(key, b),
        forced_tokens=forced_tokens,
        batch=b,
        turns=t_max,
        length=big_l,
    )


def _prefill(setup: _Setup, cache, ids, n, last, chunk: int, routing):
    """`gen.prefill_chunked` as `(cache, last, routing)`, recording the routing when `routing` is a buffer."""
    if routing is None:
        cache, last = gen.prefill_chunked(setup.params, setup.model_config, cache, ids, n, last, chunk)
        return cache, last, None
    return gen.prefill_chunked(setup.params, setup.model_config, cache, ids, n, last, chunk, routing)


# ---- reset and the first prompt


def _reset(setup: _Setup, starts):
    """Starts repeated per group, reset, each member's own state: `(env_state, prompt ids int32 [B, P], prompt
    lengths int32 [B])` of every episode's first user message."""
    tenv, g = setup.env.env, setup.rollout_config.group_size
    rows = jnp.arange(setup.batch, dtype=jnp.int32)
    env_state, message = jax.vmap(tenv.reset)(jax.tree.map(lambda a: _expand(a, g), starts))
    env_state = jax.vmap(tenv.for_member)(env_state, rows % g)
    prompt_ids, prompt_len = jax.vmap(setup.env.render_user)(message)
    return env_state, prompt_ids, prompt_len


def _prefill_prompts(setup: _Setup, prompt_ids, prompt_len):
    """`(cache, last logits [B, V], routing buffer or None)` after the prompts. Episodes of a group share their
    prompt: it is fed once per group and the caches copied."""
    mc, rc, env, g = setup.model_config, setup.rollout_config, setup.env, setup.rollout_config.group_size
    pchunk = _chunk_for(env.prompt_len, rc.prefill_chunk)
    padded_prompt = gen.pad_to_multiple(prompt_ids, pchunk, env.pad_id)
    share = rc.share_prompt_prefill and g > 1
    fed_ids, fed_len = (padded_prompt[::g], prompt_len[::g]) if share else (padded_prompt, prompt_len)
    rows_fed = fed_ids.shape[0]
    cache_dtype = jnp.bfloat16 if rc.cache_dtype == "bfloat16" else jnp.float32
    cache = ling3.init_cache(mc, rows_fed, setup.length, cache_dtype)
    last = jnp.zeros((rows_fed, mc.vocab_size), jnp.float32)
    routing = None
    if setup.record:  # int16 holds any expert id (< 32768) at half the bytes of int32; -1 = nothing routed
        routing = jnp.full(
            (rows_fed, setup.length, len(ling3.moe_layer_indices(mc)), mc.num_experts_per_tok), -1, jnp.int16
        )
    cache, last, routing = _prefill(setup, cache, fed_ids, fed_len.astype(jnp.int32), last, pchunk, routing)
    if share:
        cache, last, routing = jax.tree.map(lambda a: _expand(a, g), (cache, last, routing))
    return cache, last, routing


def _initial_episodes(setup: _Setup, env_state, prompt_ids, prompt_len, cache, last, routing) -> _Episodes:
    """The turn loop's state before turn 0: the prompts written, every episode live."""
    b, t_max, big_l, tenv = setup.batch, setup.turns, setup.length, setup.env.env
    # The info pytree's structure comes from a step (reset does not produce one): start from zeros of that shape.
    info_shape = jax.eval_shape(
        lambda s, c: jax.vmap(tenv.step)(s, c).info, env_state, bind.empty_calls(b, setup.env.parser)
    )
    i32 = functools.partial(jnp.zeros, (b,), jnp.int32)
    bool_ = functools.partial(jnp.zeros, (b,), jnp.bool_)
    return _Episodes(
        turn=jnp.int32(0),
        cache=cache,
        last=last,
        tokens=scatter_rows(
            jnp.full((b, big_l), setup.env.pad_id, jnp.int32), jnp.zeros((b,), jnp.int32), prompt_ids, prompt_len
        ),
        logp=jnp.zeros((b, big_l), jnp.float32),
        gen_start=jnp.full((b, t_max), big_l, jnp.int32),
        gen_end=jnp.full((b, t_max), big_l, jnp.int32),
        live=jnp.ones((b,), jnp.bool_),
        reward=jnp.zeros((b,), jnp.float32),
        turn_reward=jnp.zeros((b, t_max), jnp.float32),
        turn_key=jnp.full((b, t_max), -1, jnp.int32),
        env_state=env_state,
        env_info=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), info_shape),
        parse_kind=i32(),
        valid_call=bool_(),
        num_turns=i32(),
        gen_tokens=i32(),
        budget_stops=i32(),
        truncated=bool_(),
        routing=routing,
    )


# ---- one turn: generate, parse, step, render


def _decode_token(setup: _Setup, forced_turn, c: _Decode) -> _Decode:
    """Samples (or takes the forced) next token of every row that has not stopped and feeds it to the model."""
    m, env, active = setup.max_new_tokens, setup.env, ~c.stopped
    forced = None if forced_turn is None else jax.lax.dynamic_index_in_dim(forced_turn, c.step, 1, False)
    step_args = (
        setup.params,
        setup.model_config,
        setup.rollout_config.sampling_config,
        c.cache,
        c.last,
        setup.keys,
        active,
        forced,
    )
    routing = c.routing
    if setup.record:
        tok, lp, cache, logits, fed = gen.decode_step(*step_args, return_routing=True)
        routing = gen.write_routing(routing, c.cache["length"], fed[:, None], active[:, None])
    else:
        tok, lp, cache, logits = gen.decode_step(*step_args)
    match, hit = gen.stop_update(env.stop, c.match, tok)
    if not setup.rollout_config.stop_at_tool_call:
        hit = env.stop.is_stop[tok]
    stop_now = active & (hit | (c.step + 1 >= m))
    return _Decode(
        step=c.step + 1,
        cache=cache,
        # Rows that did not advance keep their logits (they are overwritten by the next prefill anyway).
        last=jnp.where(active[:, None], logits, c.last),
        gen_tok=jax.lax.dynamic_update_index_in_dim(c.gen_tok, jnp.where(active, tok, env.pad_id), c.step, 1),
        gen_logp=jax.lax.dynamic_update_index_in_dim(c.gen_logp, jnp.where(active, lp, 0.0), c.step, 1),
        n_gen=c.n_gen + active.astype(jnp.int32),
        match=jnp.where(active, match, c.match),
        stopped=c.stopped | stop_now,
        turn_end=jnp.where(active, tok == int(env.chat.turn_end_id), c.turn_end),
        routing=routing,
    )


def _decode_turn(setup: _Setup, carry: _Episodes) -> _Decode:
    """Decodes one turn for the live rows (while_loop until every live row has stopped)."""
    b, m, pad_id = setup.batch, setup.max_new_tokens, setup.env.pad_id
    forced_turn = (
        None if setup.forced_tokens is None else jax.lax.dynamic_index_in_dim(setup.forced_tokens, carry.turn, 1, False)
    )
    c0 = _Decode(
        step=jnp.int32(0),
        cache=carry.cache,
        last=carry.last,
        gen_tok=jnp.full((b, m), pad_id, jnp.int32),
        gen_logp=jnp.zeros((b, m), jnp.float32),
        n_gen=jnp.zeros((b,), jnp.int32),
        match=jnp.zeros((b,), jnp.int32),
        stopped=~carry.live,
        turn_end=jnp.zeros((b,), jnp.bool_),
        routing=carry.routing,
    )
    return jax.lax.while_loop(
        lambda c: (c.step < m) & jnp.any(~c.stopped), functools.partial(_decode_token, setup, forced_turn), c0
    )


def _play_turn(setup: _Setup, carry: _Episodes) -> _Episodes:
    """One turn of every live episode: decode, record the policy tokens, parse the call, step the environment,
    feed the tool response (a `lax.while_loop` body over turns)."""
    turn, live, big_l, tenv = carry.turn, carry.live, setup.length, setup.env.env
    start = carry.cache["length"]
    # 1. Decode the turn and write its tokens.
    d = _decode_turn(setup, carry)
    n_gen = d.n_gen
    tokens = scatter_rows(carry.tokens, start, d.gen_tok, n_gen)
    logp = scatter_rows(carry.logp, start, d.gen_logp, n_gen)
    gen_start = jax.lax.dynamic_update_index_in_dim(carry.gen_start, jnp.where(live, start, big_l), turn, 1)
    gen_end = jax.lax.dynamic_update_index_in_dim(carry.gen_end, jnp.where(live, start + n_gen, big_l), turn, 1)
    # 2. Parse the call and step the environment; rows that are not live keep their state.
    call = setup.env.parse_batch(d.gen_tok, n_gen, setup.rollout_config.parse_max_bytes)
    state_key = jax.vmap(tenv.state_key)(carry.env_state)
    if state_key is not None:
        turn_key = jax.lax.dynamic_update_index_in_dim(
            carry.turn_key, jnp.where(live, state_key.astype(jnp.int32), -1), turn, 1
        )
    else:
        turn_key = carry.turn_key
    out = jax.vmap(tenv.step)(carry.env_state, call)
    step_reward = jnp.where(live, out.reward.astype(jnp.float32), 0.0)
    # 3. The tool response, for the episodes that go on.
    cont = live & ~out.done
    cache, last, routing, tokens, cont, truncated = _feed_tool_response(
        setup, turn, d, out.message, tokens, cont, carry.truncated
    )
    kind = call.kind.astype(jnp.int32)
    return _Episodes(
        turn=turn + 1,
        cache=cache,
        last=last,
        tokens=tokens,
        logp=logp,
        gen_start=gen_start,
        gen_end=gen_end,
        live=cont,
        reward=carry.reward + step_reward,
        turn_reward=jax.lax.dynamic_update_index_in_dim(carry.turn_reward, step_reward, turn, 1),
        turn_key=turn_key,
        env_state=_keep_where(live, out.state, carry.env_state),
        env_info=_keep_where(live, out.info, carry.env_info),
        parse_kind=jnp.where(live, kind, carry.parse_kind),
        valid_call=jnp.where(live, kind == 0, carry.valid_call),
        num_turns=carry.num_turns + live.astype(jnp.int32),
        gen_tokens=carry.gen_tokens + n_gen,
        budget_stops=carry.budget_stops + (live & (n_gen >= setup.max_new_tokens)).astype(jnp.int32),
        truncated=truncated,
        routing=routing,
    )


def _feed_tool_response(setup: _Setup, turn, d: _Decode, message, tokens, cont, truncated):
    """Renders the tool message and the next assistant header, writes them to `tokens` and prefills them, for the
    episodes that go on (`cont`) and have a turn left. One that would overflow L with a full next turn ends here
    (truncated); one out of turns stays live and is marked truncated after the loop. Returns `(cache, last,
    routing, tokens, cont, truncated)`."""
    if setup.turns == 1:
        return d.cache, d.last, d.routing, tokens, cont, truncated
    env, m, pad_id = setup.env, setup.max_new_tokens, setup.env.pad_id
    resp, resp_n = jax.vmap(env.render_tool)(message, ~d.turn_end)
    pos = d.cache["length"]
    more = cont & (turn + 1 < setup.turns)
    fits = pos + resp_n + m <= setup.length
    truncated = truncated | (more & ~fits)
    cont = cont & ~(more & ~fits)
    n_feed = jnp.where(more & fits, resp_n, 0).astype(jnp.int32)
    rchunk = _chunk_for(env.response_len, setup.rollout_config.prefill_chunk)
    resp = gen.pad_to_multiple(resp, rchunk, pad_id)
    tokens = scatter_rows(tokens, pos, resp, n_feed)
    cache, last, routing = _prefill(setup, d.cache, resp, n_feed, d.last, rchunk, d.routing)
    return cache, last, routing, tokens, cont, truncated


# ---- finalisation


def _episode_results(setup: _Setup, carry):
    """`(reward [B], turn_reward [B, T], env_info, stats)` of a finished turn loop (`_Episodes` or the bounded
    history's loop state): episodes still running after the last turn are truncated too (the environment's
    `truncation_reward`, on their last turn)."""
    tenv = setup.env.env
    truncated = carry.truncated | carry.live
    reward = jnp.where(truncated, jnp.float32(tenv.truncation_reward), carry.reward).astype(jnp.float32)
    last_turn = jnp.arange(setup.turns)[None, :] == jnp.maximum(carry.num_turns - 1, 0)[:, None]
    turn_reward = jnp.where(truncated[:, None], jnp.where(last_turn, reward[:, None], 0.0), carry.turn_reward)
    env_info = jax.vmap(tenv.finish)(carry.env_state, carry.env_info, truncated)
    stats = RolloutStats(
        parse_kind=carry.parse_kind,
        valid_call=carry.valid_call,
        num_turns=carry.num_turns,
        generated_tokens=carry.gen_tokens,
        budget_stops=carry.budget_stops,
        truncated=truncated,
    )
    return reward, turn_reward, env_info, stats


def _finalise(setup: _Setup, carry: _Episodes, prompt_len) -> Trajectory:
    """The `Trajectory` of the finished turn loop (`_episode_results`), masks and turn ids from the turn
    bounds."""
    t_max, big_l = setup.turns, setup.length
    reward, turn_reward, env_info, stats = _episode_results(setup, carry)
    length = carry.cache["length"]
    pos = jnp.arange(big_l, dtype=jnp.int32)[None, :]
    valid = pos < length[:, None]
    gs, ge = carry.gen_start[:, :, None], carry.gen_end[:, :, None]  # [B, T, 1]
    loss_mask = jnp.any((pos[:, None, :] >= gs) & (pos[:, None, :] < ge), axis=1)
    # Turn k's segment starts right after turn k-1's policy tokens (turn 0 starts at 0).
    turn_id = jnp.sum(pos[:, None, :] >= ge[:, :-1], axis=1).astype(jnp.int32) if t_max > 1 else jnp.zeros_like(pos)
    turn_id = jnp.where(valid, turn_id, -1)
    logp = jnp.where(loss_mask, carry.logp, 0.0)
    group_id = jnp.arange(setup.batch, dtype=jnp.int32) // setup.rollout_config.group_size
    return Trajectory(
        tokens=jnp.where(valid, carry.tokens, setup.env.pad_id),
        valid=valid,
        loss_mask=loss_mask,
        behaviour_logp=logp,
        turn_id=turn_id,
        prompt_length=prompt_len.astype(jnp.int32),
        reward=reward,
        group_id=group_id,
        stats=stats,
        env_info=env_info,
        routing=carry.routing,
        turn_reward=turn_reward,
        turn_key=carry.turn_key,
    )


# ---------------------------------------------------------------------------------------------- bounded history


def _history_of(env: CompiledEnv) -> HistoryTables:
    if env.history is None:
        raise ValueError(
            "bounded history (rollout.history) needs a chat template whose prompts are system + user turn + "
            "assistant header; this environment's template does not split so (use rollout.history=None)"
        )
    return env.history


def exchange_width(env: CompiledEnv, rc: RolloutConfig) -> int:
    """E: the most tokens one exchange (header, call, rest of the turn and tool turn) of the window takes."""
    return int(_history_of(env).header_ids.shape[0]) + rc.max_new_tokens + env.response_len


def prompt_width(env: CompiledEnv, rc: RolloutConfig) -> int:
    """The most tokens a turn prompt takes: the system prefix, k exchanges and the observation's user turn."""
    return env.prompt_len + int(rc.history) * exchange_width(env, rc)


def required_turn_length(env: CompiledEnv, rc: RolloutConfig) -> int:
    """Smallest Lt that fits every turn sample: the longest turn prompt plus a full turn."""
    return prompt_width(env, rc) + rc.max_new_tokens


def turn_length(env: CompiledEnv, rc: RolloutConfig) -> int:
    """Lt used by the rollout: `turn_length`, or `required_turn_length` when it is 0."""
    need = required_turn_length(env, rc)
    if rc.turn_length and rc.turn_length < need:
        raise ValueError(f"turn_length {rc.turn_length} cannot hold a turn sample; use at least {need} (or 0)")
    return rc.turn_length or need


@flax.struct.dataclass
class _Window:
    """Loop state of the bounded-history turn loop (one entry per episode unless noted)."""

    turn: jax.Array  # int32 []
    live: jax.Array  # bool [B]
    ex_ids: jax.Array  # int32 [B, k, E] the last k exchanges, oldest first (empty ones have length 0)
    ex_len: jax.Array  # int32 [B, k]
    row_tokens: jax.Array  # int32 [B, T, Lt]
    row_logp: jax.Array  # float32 [B, T, Lt]
    row_prompt: jax.Array  # int32 [B, T] turn t's prompt length (0: no turn t)
    row_gen: jax.Array  # int32 [B, T] turn t's policy tokens
    row_routing: Any  # int16 [B, T, Lt, n_moe, K] or None
    reward: jax.Array  # float32 [B]
    turn_reward: jax.Array  # float32 [B, T]
    turn_key: jax.Array  # int32 [B, T]
    env_state: Any
    env_info: Any
    parse_kind: jax.Array
    valid_call: jax.Array
    num_turns: jax.Array
    gen_tokens: jax.Array
    budget_stops: jax.Array
    truncated: jax.Array


def _bounded_rollout(
    params,
    key: jax.Array,
    starts,
    *,
    model_config: ling3.Ling3Config,
    rollout_config: RolloutConfig,
    env: CompiledEnv,
    forced_tokens: jax.Array | None = None,
    return_cache: bool = False,
):
    """`rollout.rollout` with `rollout_config.history = k` (module docstring): a `Trajectory` of B * T turn
    samples (and the last turn's cache when `return_cache`)."""
    lt = turn_length(env, rollout_config)
    checked = dataclasses.replace(rollout_config, max_length=0)  # the whole-conversation length is not used
    setup = _make_setup(params, key, starts, model_config, checked, env, forced_tokens)
    setup = dataclasses.replace(setup, length=lt)
    env_state, _, _ = _reset(setup, starts)
    carry = _initial_window(setup, env_state)
    system = _system_prefix(setup)
    carry, cache = jax.lax.while_loop(
        lambda c: (c[0].turn < setup.turns) & jnp.any(c[0].live),
        functools.partial(_play_window_turn, setup, system),
        (carry, jax.tree.map(lambda a: _expand(a, setup.batch), system[0])),
    )
    traj = _finalise_window(setup, carry)
    if return_cache:
        return traj, cache
    return traj


def _routing_buffer(setup: _Setup, *lead: int):
    mc = setup.model_config
    return jnp.full((*lead, setup.length, len(ling3.moe_layer_indices(mc)), mc.num_experts_per_tok), -1, jnp.int16)


def _initial_window(setup: _Setup, env_state) -> _Window:
    """The loop state before turn 0: every episode live, an empty window, no rows yet."""
    b, t_max, lt, k = setup.batch, setup.turns, setup.length, int(setup.rollout_config.history)
    tenv, e = setup.env.env, exchange_width(setup.env, setup.rollout_config)
    info_shape = jax.eval_shape(
        lambda s, c: jax.vmap(tenv.step)(s, c).info, env_state, bind.empty_calls(b, setup.env.parser)
    )
    i32 = functools.partial(jnp.zeros, (b,), jnp.int32)
    bool_ = functools.partial(jnp.zeros, (b,), jnp.bool_)
    return _Window(
        turn=jnp.int32(0),
        live=jnp.ones((b,), jnp.bool_),
        ex_ids=jnp.full((b, k, e), setup.env.pad_id, jnp.int32),
        ex_len=jnp.zeros((b, k), jnp.int32),
        row_tokens=jnp.full((b, t_max, lt), setup.env.pad_id, jnp.int32),
        row_logp=jnp.zeros((b, t_max, lt), jnp.float32),
        row_prompt=jnp.zeros((b, t_max), jnp.int32),
        row_gen=jnp.zeros((b, t_max), jnp.int32),
        row_routing=_routing_buffer(setup, b, t_max) if setup.record else None,
        reward=jnp.zeros((b,), jnp.float32),
        turn_reward=jnp.zeros((b, t_max), jnp.float32),
        turn_key=jnp.full((b, t_max), -1, jnp.int32),
        env_state=env_state,
        env_info=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), info_shape),
        parse_kind=i32(),
        valid_call=bool_(),
        num_turns=i32(),
        gen_tokens=i32(),
        budget_stops=i32(),
        truncated=bool_(),
    )


def turn_prompt(setup: _Setup, carry: _Window):
    """`(ids int32 [B, prompt_width], n int32 [B])`: each episode's turn prompt, system prefix + window +
    current observation (user turn and assistant header)."""
    env, k = setup.env, int(setup.rollout_config.history)
    system = _history_of(env).system_ids
    s = system.shape[0]
    obs_ids, obs_n = jax.vmap(env.render_user)(jax.vmap(env.env.observation)(carry.env_state))
    ids = jnp.full((setup.batch, prompt_width(env, setup.rollout_config)), env.pad_id, jnp.int32)
    ids = ids.at[:, :s].set(system[None, :])
    pos = jnp.full((setup.batch,), s, jnp.int32)
    for j in range(k):
        ids = scatter_rows(ids, pos, carry.ex_ids[:, j], carry.ex_len[:, j])
        pos = pos + carry.ex_len[:, j]
    ids = scatter_rows(ids, pos, obs_ids[:, s:], obs_n - s)
    return ids, (pos + obs_n - s).astype(jnp.int32)


def _system_prefix(setup: _Setup):
    """`(cache, routing or None)` of one row after the system prefix: every turn sample starts with it, so it is
    fed once per rollout and each turn's cache starts as a copy of it."""
    mc, rc, system = setup.model_config, setup.rollout_config, _history_of(setup.env).system_ids
    chunk = _chunk_for(system.shape[0], rc.prefill_chunk)
    ids = gen.pad_to_multiple(system[None, :], chunk, setup.env.pad_id)
    dtype = jnp.bfloat16 if rc.cache_dtype == "bfloat16" else jnp.float32
    cache = ling3.init_cache(mc, 1, setup.length, dtype)
    last = jnp.zeros((1, mc.vocab_size), jnp.float32)
    routing = _routing_buffer(setup, 1) if setup.record else None
    n = jnp.full((1,), system.shape[0], jnp.int32)
    cache, _, routing = _prefill(setup, cache, ids, n, last, chunk, routing)
    return cache, routing


def _sample_turn(setup: _Setup, system, carry: _Window):
    """Prefills every live episode's turn prompt after the system prefix (`_system_prefix`, copied) and decodes
    its turn: `(prompt ids [B, prompt_width], prompt lengths [B] (0 for ended episodes), decode state
    `_Decode`)`."""
    rc, env, b = setup.rollout_config, setup.env, setup.batch
    s = _history_of(env).system_ids.shape[0]
    ids, n = turn_prompt(setup, carry)
    rest = ids[:, s:]  # what follows the system prefix
    chunk = _chunk_for(rest.shape[1], rc.prefill_chunk)
    n_rest = jnp.where(carry.live, n - s, 0)
    cache, routing = jax.tree.map(lambda a: _expand(a, b), system)
    last = jnp.zeros((b, setup.model_config.vocab_size), jnp.float32)
    fed = gen.pad_to_multiple(rest, chunk, env.pad_id)
    cache, last, routing = _prefill(setup, cache, fed, n_rest, last, chunk, routing)
    view = types.SimpleNamespace(turn=carry.turn, cache=cache, last=last, live=carry.live, routing=routing)
    d = _decode_turn(setup, view)
    return ids, jnp.where(carry.live, n, 0), d


def _new_exchange(setup: _Setup, d, message):
    """`(ids int32 [B, E], n int32 [B])`: assistant header + the turn's tokens + its tool response, without the
    assistant header the response continues with."""
    env, tables = setup.env, _history_of(setup.env)
    header = tables.header_ids
    h = header.shape[0]
    resp, resp_n = jax.vmap(env.render_tool)(message, ~d.turn_end)
    template = jnp.clip(message.template.astype(jnp.int32), 0, tables.tool_continues.shape[0] - 1)
    keep = resp_n - jnp.where(tables.tool_continues[template], h, 0)
    ids = jnp.full((setup.batch, exchange_width(env, setup.rollout_config)), env.pad_id, jnp.int32)
    ids = ids.at[:, :h].set(header[None, :])
    ids = scatter_rows(ids, jnp.full((setup.batch,), h, jnp.int32), d.gen_tok, d.n_gen)
    ids = scatter_rows(ids, h + d.n_gen, resp, keep)
    return ids, (h + d.n_gen + keep).astype(jnp.int32)


def _record_turn_sample(setup: _Setup, carry: _Window, ids, n, d):
    """The rows of this turn written into the `[B, T, Lt]` buffers: `(row_tokens, row_logp, row_prompt,
    row_gen, row_routing)`."""
    b, lt, pad_id, turn = setup.batch, setup.length, setup.env.pad_id, carry.turn
    zero = jnp.zeros((b,), jnp.int32)
    row = scatter_rows(jnp.full((b, lt), pad_id, jnp.int32), zero, ids, n)
    row = scatter_rows(row, n, d.gen_tok, d.n_gen)
    logp = scatter_rows(jnp.zeros((b, lt), jnp.float32), n, d.gen_logp, d.n_gen)
    put = functools.partial(jax.lax.dynamic_update_index_in_dim, index=turn, axis=1)
    routing = None
    if carry.row_routing is not None:  # an ended episode's row holds the copied system prefix's: none of it is its
        live = carry.live.reshape((b,) + (1,) * (d.routing.ndim - 1))
        routing = put(carry.row_routing, jnp.where(live, d.routing, jnp.int16(-1)))
    return (
        put(carry.row_tokens, row),
        put(carry.row_logp, logp),
        put(carry.row_prompt, n),
        put(carry.row_gen, d.n_gen),
        routing,
    )


def _play_window_turn(setup: _Setup, system, state):
    """One turn of every live episode (a `lax.while_loop` body): build the turn prompt, prefill, decode, record
    the row, parse, step the environment and push the exchange into the window."""
    carry, _ = state  # the previous turn's cache: only returned (`return_cache`), never read
    turn, live, tenv, k = carry.turn, carry.live, setup.env.env, int(setup.rollout_config.history)
    ids, n, d = _sample_turn(setup, system, carry)
    row_tokens, row_logp, row_prompt, row_gen, row_routing = _record_turn_sample(setup, carry, ids, n, d)
    call = setup.env.parse_batch(d.gen_tok, d.n_gen, setup.rollout_config.parse_max_bytes)
    state_key = jax.vmap(tenv.state_key)(carry.env_state)
    turn_key = carry.turn_key
    if state_key is not None:
        turn_key = jax.lax.dynamic_update_index_in_dim(
            turn_key, jnp.where(live, state_key.astype(jnp.int32), -1), turn, 1
        )
    out = jax.vmap(tenv.step)(carry.env_state, call)
    step_reward = jnp.where(live, out.reward.astype(jnp.float32), 0.0)
    cont = live & ~out.done
    ex_ids, ex_len = carry.ex_ids, carry.ex_len
    if k and setup.turns > 1:
        new_ids, new_len = _new_exchange(setup, d, out.message)
        ex_ids = jnp.where(cont[:, None, None], jnp.concatenate([ex_ids[:, 1:], new_ids[:, None]], 1), ex_ids)
        ex_len = jnp.where(cont[:, None], jnp.concatenate([ex_len[:, 1:], new_len[:, None]], 1), ex_len)
    kind = call.kind.astype(jnp.int32)
    new = _Window(
        turn=turn + 1,
        live=cont,
        ex_ids=ex_ids,
        ex_len=ex_len,
        row_tokens=row_tokens,
        row_logp=row_logp,
        row_prompt=row_prompt,
        row_gen=row_gen,
        row_routing=row_routing,
        reward=carry.reward + step_reward,
        turn_reward=jax.lax.dynamic_update_index_in_dim(carry.turn_reward, step_reward, turn, 1),
        turn_key=turn_key,
        env_state=_keep_where(live, out.state, carry.env_state),
        env_info=_keep_where(live, out.info, carry.env_info),
        parse_kind=jnp.where(live, kind, carry.parse_kind),
        valid_call=jnp.where(live, kind == 0, carry.valid_call),
        num_turns=carry.num_turns + live.astype(jnp.int32),
        gen_tokens=carry.gen_tokens + d.n_gen,
        budget_stops=carry.budget_stops + (live & (d.n_gen >= setup.max_new_tokens)).astype(jnp.int32),
        truncated=carry.truncated,
    )
    return new, d.cache


def _finalise_window(setup: _Setup, carry: _Window) -> Trajectory:
    """The `Trajectory` of B * T turn samples (module docstring)."""
    b, t_max, lt, g = setup.batch, setup.turns, setup.length, setup.rollout_config.group_size
    reward, turn_reward, env_info, stats = _episode_results(setup, carry)
    rows = b * t_max
    prompt = carry.row_prompt.reshape(rows)
    end = prompt + carry.row_gen.reshape(rows)
    pos = jnp.arange(lt, dtype=jnp.int32)[None, :]
    valid = pos < end[:, None]
    loss_mask = (pos >= prompt[:, None]) & valid
    turn_index = jnp.tile(jnp.arange(t_max, dtype=jnp.int32), b)
    episode_id = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t_max)
    routing = carry.row_routing
    if routing is not None:
        routing = routing.reshape(rows, *routing.shape[2:])
    return Trajectory(
        tokens=jnp.where(valid, carry.row_tokens.reshape(rows, lt), setup.env.pad_id),
        valid=valid,
        loss_mask=loss_mask,
        behaviour_logp=jnp.where(loss_mask, carry.row_logp.reshape(rows, lt), 0.0),
        turn_id=jnp.where(valid, turn_index[:, None], -1),
        prompt_length=prompt,
        reward=jnp.repeat(reward, t_max),
        group_id=episode_id // g,
        stats=stats,
        env_info=env_info,
        routing=routing,
        turn_reward=turn_reward,
        turn_key=carry.turn_key,
        episode_id=episode_id,
        turn_index=turn_index,
    )


def make_rollout_fn(model_config: ling3.Ling3Config, rollout_config: RolloutConfig, return_cache: bool = False):
    """`jax.jit`-ed `fn(params, key, starts, env, forced_tokens=None) -> Trajectory` with the configs bound."""
    return jax.jit(
        functools.partial(rollout, model_config=model_config, rollout_config=rollout_config, return_cache=return_cache)
    )
