"""Multi-turn agent rollout for the tic-tac-toe tool-calling tasks, as ONE jittable pure function.

`rollout(params, key, starts, *, model_config, rollout_config, env)` renders the prompts, generates with the
Ling-3.0 hybrid cache (KDA recurrent/conv state + MLA latent cache), parses every turn's tool call, steps the
environment, renders the tool response and continues, all inside `jax.jit` (no host callbacks).

Structure (turn-synchronous; every loop is `lax` control flow, compiled once):

    render the prompts; prefill them in chunks (once per group, caches copied to its G episodes)
    for turn in 0..max_turns-1 while any episode is live:
        decode token by token (sampling from each row's last logits) until every live row has stopped:
            turn-end/eos token, completed "</tool_call>" (byte matcher), or max_new_tokens
        parse the turn's tokens (jitted DFA parser)  -> (kind, square)
        move task: reward = move_reward(board, kind, square); the episode ends
        game task: game_step (agent move, then opponent reply) -> reward on the final step; for games that go on:
            render the tool response + next assistant header, end (truncated) an episode whose response plus a
            full next turn would overflow L, prefill the response in chunks

Rows advance independently: a row that is not live in a model call is fed with `valid=False`, so its caches do not
change, and each row samples with its own key folded with its own position, so a row's tokens never depend on
other rows. Episodes come in groups: the G = `group_size` episodes of a group share the start board, the agent's
side, the opponent and the opponent's RNG (so differences within a group come from the policy only).

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
  info: dict of [B] arrays, see `rollout`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs.tictactoe import minimax, tasks, wording as text, tool_parser
from reno_jax.envs.tictactoe import rules as ttt
from reno_jax.models import ling3
from reno_jax.rollout import generate as gen
from reno_jax.rollout import sampling

TASKS = ("move", "game")
TOOL_CALL_CLOSE = "</tool_call>"

# Rollout-level outcome codes: tasks.OUTCOME_* (0 ongoing/legal, 1 win, 2 draw, 3 loss, 4 invalid, 5 illegal) plus:
OUTCOME_TRUNCATED = 6  # the episode hit the conversation length L or max_turns before it finished
OUTCOME_NAMES = tasks.OUTCOME_NAMES + ("truncated",)


# ---------------------------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static rollout settings (hashable; pass as a static argument).

    Attributes:
      task: "move" (one tool call on a dataset board, AReno's move reward) or "game" (a whole game against an
        opponent, one tool call per agent move).
      group_size: G episodes per start (GRPO/GSPO groups).
      max_new_tokens: policy tokens per turn (a turn that reaches it ends there; its call is parsed as is).
      max_turns: agent turns per episode (the move task uses 1 whatever is set here).
      max_length: L, the conversation length (trajectory width and cache size); 0 means `required_length(env,
        config)`, the smallest L that never truncates. An episode whose next tool response plus a full turn would
        not fit ends as `truncated`.
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
    """

    task: str = "move"
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

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        for name in ("group_size", "max_new_tokens", "max_turns", "prefill_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length < 0:
            raise ValueError(f"max_length must be >= 0 (0: required_length), got {self.max_length}")
        if self.cache_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"cache_dtype must be 'float32' or 'bfloat16', got {self.cache_dtype!r}")
        sampling.validate_sampling_args(self.temperature, self.top_k, self.top_p, self.greedy)

    @property
    def turns(self) -> int:
        """Agent turns actually run: 1 for the move task."""
        return 1 if self.task == "move" else self.max_turns

    @property
    def sampling_config(self) -> gen.SamplingConfig:
        return gen.SamplingConfig(self.temperature, self.top_k, self.top_p, self.greedy)


def required_length(env: "RolloutEnv", rollout_config: RolloutConfig) -> int:
    """Smallest L that fits the longest prompt, `turns` full turns and the tool responses between them."""
    t = rollout_config.turns
    return env.spec.prompt_len + t * rollout_config.max_new_tokens + (t - 1) * env.spec.response_len


def conversation_length(env: "RolloutEnv", rollout_config: RolloutConfig) -> int:
    """L used by the rollout: `max_length`, or `required_length` when it is 0."""
    return rollout_config.max_length or required_length(env, rollout_config)


# ---------------------------------------------------------------------------------------------- environment


@flax.struct.dataclass
class RolloutEnv:
    """Everything the rollout needs besides the model, as a pytree of arrays built once on the host.

    Attributes:
      spec: `text.TextSpec` (pre-tokenized prompt / tool-response pieces).
      parser: the jitted tool-call parser's tables (`tool_parser.build_parser_tables`).
      table: `minimax.MinimaxTable`.
      stop: `generate.StopTables` (turn-end/eos tokens and the "</tool_call>" byte matcher).
    """

    spec: Any
    parser: Any
    table: Any
    stop: Any


def make_env(tokenizer, vocab_size: int | None = None, chat_template: str | None = None,
             table: minimax.MinimaxTable | None = None) -> RolloutEnv:
    """Builds the `RolloutEnv` on the host (call once; pass the result into the jitted rollout).

    Args:
      tokenizer: HF tokenizer (e.g. `reno_jax.protocol.tokenizer.load_tokenizer(None)`).
      vocab_size: the model's vocabulary size when it is larger than the tokenizer's (padded embedding); extra ids
        decode to nothing. Must not be smaller than the tokenizer's vocabulary.
      chat_template: override of the tokenizer's chat template.
      table: minimax table (default `minimax.load_table()`).
    """
    spec = text.build_text_spec(tokenizer, chat_template)
    pieces = tool_parser.token_bytes(tokenizer)
    if vocab_size is not None and vocab_size < len(pieces):
        raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer's {len(pieces)} ids")
    pieces = pieces + [b""] * ((vocab_size or 0) - len(pieces))
    parser = tool_parser.build_parser_tables(tokenizer, vocab_size=len(pieces))
    stop_ids = [int(i) for i in np.asarray(spec.stop_ids)]
    stop = gen.build_stop_tables(pieces, stop_ids, TOOL_CALL_CLOSE.encode())
    return RolloutEnv(spec=spec, parser=parser, table=minimax.load_table() if table is None else table, stop=stop)


# ---------------------------------------------------------------------------------------------- starts


@chex.dataclass(frozen=True)
class EpisodeStarts:
    """Per-GROUP start settings (N groups; the rollout repeats each one `group_size` times).

    Attributes:
      boards: `int8 [N, 9]` move task: the position to play (the agent is the side to move). Game task: unused.
      agent_player: `int8 [N]` game task: 1 agent is X (opens), 2 agent is O (the opponent opens).
      opponent_kind: `int32 [N]` game task: `tasks.OPPONENT_*`.
      epsilon: `float32 [N]` game task: exploration rate of the epsilon opponent.
      opponent_key: `uint32 [N, 2]` raw PRNG key data of the opponent, shared by the group's episodes (the opening
        move uses fold_in(key, 0), the reply after agent turn k fold_in(key, k + 1)).
    """

    boards: chex.Array
    agent_player: chex.Array
    opponent_kind: chex.Array
    epsilon: chex.Array
    opponent_key: chex.Array

    @property
    def num_groups(self) -> int:
        return self.boards.shape[0]


def move_starts(boards) -> EpisodeStarts:
    """Starts for the move task from `int [N, 9]` boards (the agent plays the side to move)."""
    boards = jnp.asarray(boards, jnp.int8)
    if boards.ndim != 2 or boards.shape[1] != ttt.NUM_SQUARES:
        raise ValueError(f"boards must be [N, 9], got shape {boards.shape}")
    n = boards.shape[0]
    agent = jax.vmap(ttt.to_move_from_counts)(boards).astype(jnp.int8)
    return EpisodeStarts(boards=boards, agent_player=agent, opponent_kind=jnp.full((n,), tasks.OPPONENT_MINIMAX,
                         jnp.int32), epsilon=jnp.zeros((n,), jnp.float32),
                         opponent_key=jnp.zeros((n, 2), jnp.uint32))


def game_starts(key: jax.Array, num_groups: int, agent_player=1, opponent: str | Any = "minimax",
                epsilon=0.0) -> EpisodeStarts:
    """Starts for the game task. `agent_player`, `opponent` (name or `[N]` ids) and `epsilon` may be scalars or
    `[N]` arrays; the opponent keys are split from `key`."""
    n = num_groups
    kind = tasks.opponent_kind_id(opponent) if isinstance(opponent, str) else opponent
    agent = jnp.broadcast_to(jnp.asarray(agent_player, jnp.int8), (n,))
    if not bool(jnp.all((agent == 1) | (agent == 2))):
        raise ValueError("agent_player must be 1 (X) or 2 (O)")
    return EpisodeStarts(
        boards=jnp.zeros((n, ttt.NUM_SQUARES), jnp.int8),
        agent_player=agent,
        opponent_kind=jnp.broadcast_to(jnp.asarray(kind, jnp.int32), (n,)),
        epsilon=jnp.broadcast_to(jnp.asarray(epsilon, jnp.float32), (n,)),
        opponent_key=jax.random.key_data(jax.random.split(key, n)),
    )


# ---------------------------------------------------------------------------------------------- output


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
    info: dict
    routing: Any = None


# ---------------------------------------------------------------------------------------------- the rollout


def _expand(x: jax.Array, g: int) -> jax.Array:
    return jnp.repeat(x, g, axis=0)


def _chunk_for(text_len: int, chunk: int) -> int:
    """Prefill chunk for a block of at most `text_len` tokens: `chunk`, or less when one smaller call covers it
    (padding positions cost as much compute as real ones)."""
    return max(1, min(chunk, -(-text_len // 8) * 8))


def scatter_rows(buf: jax.Array, start: jax.Array, values: jax.Array, count: jax.Array) -> jax.Array:
    """buf[b, start[b] + j] = values[b, j] for j < count[b] (others dropped). buf [B, L], values [B, W]."""
    b, w = values.shape
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    idx = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])  # out of bounds -> dropped
    return buf.at[jnp.arange(b)[:, None], idx].set(values.astype(buf.dtype), mode="drop")


def rollout(params, key: jax.Array, starts: EpisodeStarts, *, model_config: ling3.Ling3Config,
            rollout_config: RolloutConfig, env: RolloutEnv, forced_tokens: jax.Array | None = None,
            return_cache: bool = False):
    """Runs B = N * group_size episodes to the end; a pure function, jit it with the configs static.

    Args:
      params: Ling-3.0 parameters.
      key: policy PRNG key, or `[B]` per-episode keys (a row's samples then depend on its key only).
      starts: `EpisodeStarts` with N groups.
      model_config, rollout_config: static.
      env: `RolloutEnv` from `make_env`.
      forced_tokens: optional `int32 [B, turns, max_new_tokens]` teacher forcing: where >= 0 the token is taken
        instead of a sample (its behaviour log-prob is still recorded under the sampling distribution); < 0 samples.
        For tests and scripted openings; stop detection applies to forced tokens too.
      return_cache: static; also return the final model cache (tests).

    Returns:
      `Trajectory` (and the final cache when `return_cache`). `info` holds `[B]` arrays:
        outcome int32 (`OUTCOME_*`; the move task uses 1 win taken, 0 other legal move, 4 invalid, 5 illegal),
        parse_kind int32 (parser kind of the last call: 0 ok, 1 no_call, 2 bad_call, 3 out_of_range),
        valid_call bool (the last call parsed with a square in 1..9),
        num_turns int32 (agent turns played), generated_tokens int32, budget_stops int32 (turns that hit
        max_new_tokens), win / draw / loss / invalid / illegal / truncated bool,
        is_optimal / win_taken bool (move task: the move; game task: every agent move was optimal / the agent won
        by taking an immediate win), num_optimal_moves int32 (game task), final_board int8 [B, 9].
      Truncated episodes (L or max_turns reached before the episode ended) get `outcome = OUTCOME_TRUNCATED` and
      reward -1, like an invalid call.
    """
    rc, mc, spec = rollout_config, model_config, env.spec
    g, t_max, m, chunk = rc.group_size, rc.turns, rc.max_new_tokens, rc.prefill_chunk
    big_l = conversation_length(env, rc)
    game = rc.task == "game"
    n = starts.boards.shape[0]
    b = n * g
    if spec.prompt_len + m > big_l:
        raise ValueError(f"max_length {big_l} cannot hold the prompt ({spec.prompt_len} tokens) plus one turn of "
                         f"{m} tokens; use at least required_length(env, config) = {required_length(env, rc)}")
    if env.parser.vocab_size < mc.vocab_size or env.stop.is_stop.shape[0] < mc.vocab_size:
        raise ValueError(f"env tables cover {env.parser.vocab_size} token ids but the model has {mc.vocab_size}; "
                         "build the env with make_env(tokenizer, vocab_size=model_config.vocab_size)")
    if forced_tokens is not None and forced_tokens.shape != (b, t_max, m):
        raise ValueError(f"forced_tokens must be [B={b}, turns={t_max}, max_new_tokens={m}], "
                         f"got {forced_tokens.shape}")
    if forced_tokens is not None:
        forced_tokens = jnp.asarray(forced_tokens, jnp.int32)
    if rc.record_routing and mc.num_experts > np.iinfo(np.int16).max:
        raise ValueError(f"record_routing stores expert ids as int16; {mc.num_experts} experts do not fit")
    cache_dtype = jnp.bfloat16 if rc.cache_dtype == "bfloat16" else jnp.float32
    table = env.table
    rows = jnp.arange(b, dtype=jnp.int32)
    keys = gen.row_keys(key, b)

    # ---- starts, repeated per group
    group_id = rows // g
    agent = _expand(starts.agent_player.astype(jnp.int8), g)
    opp_keys = jax.random.wrap_key_data(_expand(starts.opponent_key.astype(jnp.uint32), g))
    if game:
        gstate = jax.vmap(tasks.game_reset, in_axes=(0, 0, 0, 0, None))(
            jax.vmap(jax.random.fold_in, in_axes=(0, None))(opp_keys, 0), agent, _expand(starts.opponent_kind, g),
            _expand(starts.epsilon, g), table)
        board0 = gstate.board
    else:
        board0 = _expand(starts.boards.astype(jnp.int8), g)
        gstate = None
    prompt_ids, prompt_len = jax.vmap(text.render_prompt, in_axes=(None, 0, 0, None))(spec, board0, agent, game)

    # ---- prompt prefill. Episodes of a group share their prompt: feed it once per group and copy the caches.
    pchunk = _chunk_for(spec.prompt_len, chunk)
    padded_prompt = gen.pad_to_multiple(prompt_ids, pchunk, spec.pad_id)
    share = rc.share_prompt_prefill and g > 1
    fed_ids, fed_len = (padded_prompt[::g], prompt_len[::g]) if share else (padded_prompt, prompt_len)
    rows_fed = fed_ids.shape[0]
    cache = ling3.init_cache(mc, rows_fed, big_l, cache_dtype)
    last = jnp.zeros((rows_fed, mc.vocab_size), jnp.float32)
    record = rc.record_routing
    routing = None
    if record:  # int16 holds any expert id (< 32768) at half the bytes of int32; -1 = nothing routed
        routing = jnp.full((rows_fed, big_l, len(ling3.moe_layer_indices(mc)), mc.num_experts_per_tok), -1,
                           jnp.int16)
        cache, last, routing = gen.prefill_chunked(params, mc, cache, fed_ids, fed_len.astype(jnp.int32), last,
                                                   pchunk, routing)
    else:
        cache, last = gen.prefill_chunked(params, mc, cache, fed_ids, fed_len.astype(jnp.int32), last, pchunk)
    if share:
        cache, last, routing = jax.tree.map(lambda a: _expand(a, g), (cache, last, routing))

    rchunk = _chunk_for(spec.response_len, chunk)
    i32 = functools.partial(jnp.zeros, (b,), jnp.int32)
    bool_ = functools.partial(jnp.zeros, (b,), jnp.bool_)
    carry = dict(
        turn=jnp.int32(0),
        cache=cache,
        last=last,
        tokens=scatter_rows(jnp.full((b, big_l), spec.pad_id, jnp.int32), jnp.zeros((b,), jnp.int32), prompt_ids,
                            prompt_len),
        logp=jnp.zeros((b, big_l), jnp.float32),
        gen_start=jnp.full((b, t_max), big_l, jnp.int32),  # start of turn k's policy tokens (L if no turn k)
        gen_end=jnp.full((b, t_max), big_l, jnp.int32),
        live=jnp.ones((b,), jnp.bool_),
        reward=jnp.zeros((b,), jnp.float32),
        outcome=i32(), parse_kind=i32(), num_turns=i32(), gen_tokens=i32(), budget_stops=i32(),
        truncated=bool_(), valid_call=bool_(), is_optimal=bool_(), win_taken=bool_(), num_optimal=i32(),
        board=board0,
        gstate=gstate,
        routing=routing,
    )
    sconf = rc.sampling_config

    def decode_turn(carry, live):
        """Decodes one turn for the live rows (while_loop until every live row has stopped)."""
        turn = carry["turn"]
        forced_turn = None if forced_tokens is None else jax.lax.dynamic_index_in_dim(forced_tokens, turn, 1, False)

        def cond(c):
            return (c["step"] < m) & jnp.any(~c["stopped"])

        def body(c):
            active = ~c["stopped"]
            forced = None if forced_turn is None else jax.lax.dynamic_index_in_dim(forced_turn, c["step"], 1, False)
            routing = c["routing"]
            if record:
                tok, lp, cache, logits, fed = gen.decode_step(params, mc, sconf, c["cache"], c["last"], keys, active,
                                                              forced, return_routing=True)
                routing = gen.write_routing(routing, c["cache"]["length"], fed[:, None], active[:, None])
            else:
                tok, lp, cache, logits = gen.decode_step(params, mc, sconf, c["cache"], c["last"], keys, active,
                                                         forced)
            match, hit = gen.stop_update(env.stop, c["match"], tok)
            if not rc.stop_at_tool_call:
                hit = env.stop.is_stop[tok]
            stop_now = active & (hit | (c["step"] + 1 >= m))
            return dict(
                step=c["step"] + 1,
                cache=cache,
                # Rows that did not advance keep their logits (they are overwritten by the next prefill anyway).
                last=jnp.where(active[:, None], logits, c["last"]),
                gen_tok=jax.lax.dynamic_update_index_in_dim(c["gen_tok"], jnp.where(active, tok, spec.pad_id),
                                                            c["step"], 1),
                gen_logp=jax.lax.dynamic_update_index_in_dim(c["gen_logp"], jnp.where(active, lp, 0.0), c["step"], 1),
                n_gen=c["n_gen"] + active.astype(jnp.int32),
                match=jnp.where(active, match, c["match"]),
                stopped=c["stopped"] | stop_now,
                turn_end=jnp.where(active, tok == spec.turn_end_id, c["turn_end"]),
                routing=routing,
            )

        c0 = dict(step=jnp.int32(0), cache=carry["cache"], last=carry["last"],
                  gen_tok=jnp.full((b, m), spec.pad_id, jnp.int32), gen_logp=jnp.zeros((b, m), jnp.float32),
                  n_gen=i32(), match=i32(), stopped=~live, turn_end=bool_(), routing=carry["routing"])
        return jax.lax.while_loop(cond, body, c0)

    def turn_body(carry):
        turn, live = carry["turn"], carry["live"]
        start = carry["cache"]["length"]
        # 1. Decode the turn.
        d = decode_turn(carry, live)
        cache, last, n_gen, routing = d["cache"], d["last"], d["n_gen"], d["routing"]
        tokens = scatter_rows(carry["tokens"], start, d["gen_tok"], n_gen)
        logp = scatter_rows(carry["logp"], start, d["gen_logp"], n_gen)
        gen_start = jax.lax.dynamic_update_index_in_dim(carry["gen_start"], jnp.where(live, start, big_l), turn, 1)
        gen_end = jax.lax.dynamic_update_index_in_dim(carry["gen_end"], jnp.where(live, start + n_gen, big_l), turn, 1)
        # 2. Parse the call and step the environment.
        kind, square = tool_parser.parse_tool_call_batch(env.parser, d["gen_tok"], n_gen, max_bytes=rc.parse_max_bytes)
        kind, square = kind.astype(jnp.int32), square.astype(jnp.int32)
        out = dict(carry)
        truncated = carry["truncated"]
        if game:
            okeys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(opp_keys, turn + 1)
            new_state, r, done, info = jax.vmap(tasks.game_step, in_axes=(0, 0, 0, 0, None))(
                okeys, carry["gstate"], kind, square, table)
            # Rows that are not live keep their state (finished or truncated games are not stepped).
            new_state = jax.tree.map(lambda a, o: jnp.where(jnp.reshape(live, (b,) + (1,) * (a.ndim - 1)), a, o),
                                     new_state, carry["gstate"])
            reward = jnp.where(live, r, carry["reward"])
            cont = live & ~done
            out["gstate"] = new_state
            out["board"] = new_state.board
            out["outcome"] = jnp.where(live, new_state.outcome, carry["outcome"])
            out["num_optimal"] = carry["num_optimal"] + (live & info["agent_move_optimal"]).astype(jnp.int32)
            out["win_taken"] = carry["win_taken"] | (live & info["agent_move_winning"])
            if t_max > 1:
                # 3. Tool response (opponent's reply + board) and the next assistant header, for games that go on
                # and have a turn left. One that would overflow L with a full next turn ends here (truncated);
                # one out of turns stays live and is marked truncated after the loop.
                resp, resp_n = jax.vmap(text.render_tool_response, in_axes=(None, 0, 0, 0, 0))(
                    spec, new_state.board, new_state.opponent_square, new_state.outcome, ~d["turn_end"])
                pos = cache["length"]
                more = cont & (turn + 1 < t_max)
                fits = pos + resp_n + m <= big_l
                truncated = truncated | (more & ~fits)
                cont = cont & ~(more & ~fits)
                n_feed = jnp.where(more & fits, resp_n, 0).astype(jnp.int32)
                resp = gen.pad_to_multiple(resp, rchunk, spec.pad_id)
                tokens = scatter_rows(tokens, pos, resp, n_feed)
                if record:
                    cache, last, routing = gen.prefill_chunked(params, mc, cache, resp, n_feed, last, rchunk,
                                                               routing)
                else:
                    cache, last = gen.prefill_chunked(params, mc, cache, resp, n_feed, last, rchunk)
        else:
            r, info = jax.vmap(tasks.move_reward, in_axes=(0, 0, 0, None))(carry["board"], kind, square, table)
            reward = jnp.where(live, r, carry["reward"])
            cont = jnp.zeros_like(live)
            outcome = jnp.select([info["is_win_taken"], info["is_illegal"], ~info["is_valid_call"]],
                                 [tasks.OUTCOME_WIN, tasks.OUTCOME_ILLEGAL, tasks.OUTCOME_INVALID],
                                 tasks.OUTCOME_ONGOING)
            out["outcome"] = jnp.where(live, outcome, carry["outcome"])
            out["is_optimal"] = jnp.where(live, info["is_optimal"], carry["is_optimal"])
            out["win_taken"] = jnp.where(live, info["is_win_taken"], carry["win_taken"])
        out.update(
            turn=turn + 1, cache=cache, last=last, tokens=tokens, logp=logp, gen_start=gen_start, routing=routing,
            gen_end=gen_end, live=cont, reward=reward, truncated=truncated,
            parse_kind=jnp.where(live, kind, carry["parse_kind"]),
            valid_call=jnp.where(live, kind == tool_parser.KIND_OK, carry["valid_call"]),
            num_turns=carry["num_turns"] + live.astype(jnp.int32),
            gen_tokens=carry["gen_tokens"] + n_gen,
            budget_stops=carry["budget_stops"] + (live & (n_gen >= m)).astype(jnp.int32),
        )
        return out

    carry = jax.lax.while_loop(lambda c: (c["turn"] < t_max) & jnp.any(c["live"]), turn_body, carry)

    # ---- episodes still running after max_turns are truncated too
    truncated = carry["truncated"] | carry["live"]
    reward = jnp.where(truncated, tasks.REWARD_INVALID, carry["reward"]).astype(jnp.float32)
    outcome = jnp.where(truncated, OUTCOME_TRUNCATED, carry["outcome"])
    length = carry["cache"]["length"]
    pos = jnp.arange(big_l, dtype=jnp.int32)[None, :]
    valid = pos < length[:, None]
    gs, ge = carry["gen_start"][:, :, None], carry["gen_end"][:, :, None]  # [B, T, 1]
    loss_mask = jnp.any((pos[:, None, :] >= gs) & (pos[:, None, :] < ge), axis=1)
    # Turn k's segment starts right after turn k-1's policy tokens (turn 0 starts at 0).
    turn_id = jnp.sum(pos[:, None, :] >= ge[:, :-1], axis=1).astype(jnp.int32) if t_max > 1 else jnp.zeros_like(pos)
    turn_id = jnp.where(valid, turn_id, -1)
    logp = jnp.where(loss_mask, carry["logp"], 0.0)
    if game:
        is_optimal = (carry["num_optimal"] == carry["num_turns"]) & (carry["num_turns"] > 0) & ~truncated
    else:
        is_optimal = carry["is_optimal"]
    info = dict(
        outcome=outcome.astype(jnp.int32),
        parse_kind=carry["parse_kind"],
        valid_call=carry["valid_call"],
        num_turns=carry["num_turns"],
        generated_tokens=carry["gen_tokens"],
        budget_stops=carry["budget_stops"],
        win=(outcome == tasks.OUTCOME_WIN),
        draw=(outcome == tasks.OUTCOME_DRAW),
        loss=(outcome == tasks.OUTCOME_LOSS),
        invalid=(outcome == tasks.OUTCOME_INVALID),
        illegal=(outcome == tasks.OUTCOME_ILLEGAL),
        truncated=truncated,
        is_optimal=is_optimal,
        win_taken=carry["win_taken"],
        num_optimal_moves=carry["num_optimal"],
        final_board=carry["board"],
    )
    traj = Trajectory(tokens=jnp.where(valid, carry["tokens"], spec.pad_id), valid=valid, loss_mask=loss_mask,
                      behaviour_logp=logp, turn_id=turn_id, prompt_length=prompt_len.astype(jnp.int32),
                      reward=reward, group_id=group_id, info=info, routing=carry["routing"])
    if return_cache:
        return traj, carry["cache"]
    return traj


def make_rollout_fn(model_config: ling3.Ling3Config, rollout_config: RolloutConfig, return_cache: bool = False):
    """`jax.jit`-ed `fn(params, key, starts, env, forced_tokens=None) -> Trajectory` with the configs bound."""
    return jax.jit(functools.partial(rollout, model_config=model_config, rollout_config=rollout_config,
                                     return_cache=return_cache))
