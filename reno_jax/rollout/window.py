"""Bounded history (`RolloutConfig.history = k`): every turn of an episode is its own short row, a "turn sample".

With the whole conversation (`history=None`, `reno_jax.rollout.rollout`) turn t is generated after every earlier
turn, so an episode of T turns costs O(T^2) attention and its cache and row grow with T. With a window of k, turn
t's prompt is built afresh from token-id pieces

    system prefix (system prompt + tools, as every rendered prompt starts)      `HistoryTables.system_ids`, [S]
    the episode's last min(k, t) exchanges, oldest first; an exchange is
        assistant header + the policy's call + the rest of its turn and the tool turn (without the trailing
        assistant header the tool template continues with)                        ring of [k, E] ids per episode
    the environment's CURRENT observation as a user turn + assistant header    `env.observation(state)` rendered
                                                                                 by `render_user`, system cut off
    then the sampled assistant turn (m = max_new_tokens at most)

and prefilled into a fresh cache of Lt = `turn_length` positions (the same one every turn), decoded, parsed and
played exactly as in the full rollout (`rollout._decode_turn`; the environment steps the same way). k = 0 is the
observation alone (a Markov policy). The cost of a turn is O(Lt) tokens with Lt = S + k E + O + m independent
of t, so an episode costs O(T Lt) and the memory is one Lt cache plus the T rows per episode.

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

from reno_jax.models import ling3
from reno_jax.rollout import generate as gen
from reno_jax.rollout import rollout as R


def _tables(env: R.CompiledEnv) -> R.HistoryTables:
    if env.history is None:
        raise ValueError(
            "bounded history (rollout.history) needs a chat template whose prompts are system + user turn + "
            "assistant header; this environment's template does not split so (use rollout.history=None)"
        )
    return env.history


def exchange_width(env: R.CompiledEnv, rc: R.RolloutConfig) -> int:
    """E: the most tokens one exchange (header, call, rest of the turn and tool turn) of the window takes."""
    return int(_tables(env).header_ids.shape[0]) + rc.max_new_tokens + env.response_len


def prompt_width(env: R.CompiledEnv, rc: R.RolloutConfig) -> int:
    """The most tokens a turn prompt takes: the system prefix, k exchanges and the observation's user turn."""
    return env.prompt_len + int(rc.history) * exchange_width(env, rc)


def required_turn_length(env: R.CompiledEnv, rc: R.RolloutConfig) -> int:
    """Smallest Lt that fits every turn sample: the longest turn prompt plus a full turn."""
    return prompt_width(env, rc) + rc.max_new_tokens


def turn_length(env: R.CompiledEnv, rc: R.RolloutConfig) -> int:
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


def rollout(
    params,
    key: jax.Array,
    starts,
    *,
    model_config: ling3.Ling3Config,
    rollout_config: R.RolloutConfig,
    env: R.CompiledEnv,
    forced_tokens: jax.Array | None = None,
    return_cache: bool = False,
):
    """`rollout.rollout` with `rollout_config.history = k` (module docstring): a `Trajectory` of B * T turn
    samples (and the last turn's cache when `return_cache`)."""
    lt = turn_length(env, rollout_config)
    checked = dataclasses.replace(rollout_config, max_length=0)  # the whole-conversation length is not used
    setup = R._make_setup(params, key, starts, model_config, checked, env, forced_tokens)
    setup = dataclasses.replace(setup, length=lt)
    env_state, _, _ = R._reset(setup, starts)
    carry = _initial(setup, env_state)
    cache0 = _fresh_cache(setup)
    carry, cache = jax.lax.while_loop(
        lambda c: (c[0].turn < setup.turns) & jnp.any(c[0].live), functools.partial(_play_turn, setup), (carry, cache0)
    )
    traj = _finalise(setup, carry)
    if return_cache:
        return traj, cache
    return traj


def _fresh_cache(setup: R._Setup) -> dict:
    dtype = jnp.bfloat16 if setup.rollout_config.cache_dtype == "bfloat16" else jnp.float32
    return ling3.init_cache(setup.model_config, setup.batch, setup.length, dtype)


def _routing_buffer(setup: R._Setup, *lead: int):
    mc = setup.model_config
    return jnp.full((*lead, setup.length, len(ling3.moe_layer_indices(mc)), mc.num_experts_per_tok), -1, jnp.int16)


def _initial(setup: R._Setup, env_state) -> _Window:
    """The loop state before turn 0: every episode live, an empty window, no rows yet."""
    b, t_max, lt, k = setup.batch, setup.turns, setup.length, int(setup.rollout_config.history)
    tenv, e = setup.env.env, exchange_width(setup.env, setup.rollout_config)
    info_shape = jax.eval_shape(
        lambda s, c: jax.vmap(tenv.step)(s, c).info, env_state, R.bind.empty_calls(b, setup.env.parser)
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


def turn_prompt(setup: R._Setup, carry: _Window):
    """`(ids int32 [B, prompt_width], n int32 [B])`: each episode's turn prompt, system prefix + window +
    current observation (user turn and assistant header)."""
    env, k = setup.env, int(setup.rollout_config.history)
    system = _tables(env).system_ids
    s = system.shape[0]
    obs_ids, obs_n = jax.vmap(env.render_user)(jax.vmap(env.env.observation)(carry.env_state))
    ids = jnp.full((setup.batch, prompt_width(env, setup.rollout_config)), env.pad_id, jnp.int32)
    ids = ids.at[:, :s].set(system[None, :])
    pos = jnp.full((setup.batch,), s, jnp.int32)
    for j in range(k):
        ids = R.scatter_rows(ids, pos, carry.ex_ids[:, j], carry.ex_len[:, j])
        pos = pos + carry.ex_len[:, j]
    ids = R.scatter_rows(ids, pos, obs_ids[:, s:], obs_n - s)
    return ids, (pos + obs_n - s).astype(jnp.int32)


def _sample_turn(setup: R._Setup, carry: _Window, cache):
    """Prefills every live episode's turn prompt into a fresh cache (the previous turn's, zeroed: nothing of it is
    read) and decodes its turn: `(prompt ids [B, prompt_width], fed prompt lengths [B] (0 for ended episodes),
    decode state `rollout._Decode`)`."""
    rc, env = setup.rollout_config, setup.env
    ids, n = turn_prompt(setup, carry)
    chunk = R._chunk_for(ids.shape[1], rc.prefill_chunk)
    n_feed = jnp.where(carry.live, n, 0)
    cache = jax.tree.map(jnp.zeros_like, cache)
    last = jnp.zeros((setup.batch, setup.model_config.vocab_size), jnp.float32)
    routing = _routing_buffer(setup, setup.batch) if setup.record else None
    fed = gen.pad_to_multiple(ids, chunk, env.pad_id)
    cache, last, routing = R._prefill(setup, cache, fed, n_feed, last, chunk, routing)
    view = types.SimpleNamespace(turn=carry.turn, cache=cache, last=last, live=carry.live, routing=routing)
    d = R._decode_turn(setup, view)
    return ids, n_feed, d


def _new_exchange(setup: R._Setup, d, message):
    """`(ids int32 [B, E], n int32 [B])`: assistant header + the turn's tokens + its tool response, without the
    assistant header the response continues with."""
    env, tables = setup.env, _tables(setup.env)
    header = tables.header_ids
    h = header.shape[0]
    resp, resp_n = jax.vmap(env.render_tool)(message, ~d.turn_end)
    template = jnp.clip(message.template.astype(jnp.int32), 0, tables.tool_continues.shape[0] - 1)
    keep = resp_n - jnp.where(tables.tool_continues[template], h, 0)
    ids = jnp.full((setup.batch, exchange_width(env, setup.rollout_config)), env.pad_id, jnp.int32)
    ids = ids.at[:, :h].set(header[None, :])
    ids = R.scatter_rows(ids, jnp.full((setup.batch,), h, jnp.int32), d.gen_tok, d.n_gen)
    ids = R.scatter_rows(ids, h + d.n_gen, resp, keep)
    return ids, (h + d.n_gen + keep).astype(jnp.int32)


def _record_row(setup: R._Setup, carry: _Window, ids, n, d):
    """The rows of this turn written into the `[B, T, Lt]` buffers: `(row_tokens, row_logp, row_prompt,
    row_gen, row_routing)`."""
    b, lt, pad_id, turn = setup.batch, setup.length, setup.env.pad_id, carry.turn
    zero = jnp.zeros((b,), jnp.int32)
    row = R.scatter_rows(jnp.full((b, lt), pad_id, jnp.int32), zero, ids, n)
    row = R.scatter_rows(row, n, d.gen_tok, d.n_gen)
    logp = R.scatter_rows(jnp.zeros((b, lt), jnp.float32), n, d.gen_logp, d.n_gen)
    put = functools.partial(jax.lax.dynamic_update_index_in_dim, index=turn, axis=1)
    routing = None if carry.row_routing is None else put(carry.row_routing, d.routing)
    return (
        put(carry.row_tokens, row),
        put(carry.row_logp, logp),
        put(carry.row_prompt, n),
        put(carry.row_gen, d.n_gen),
        routing,
    )


def _play_turn(setup: R._Setup, state):
    """One turn of every live episode (a `lax.while_loop` body): build the turn prompt, prefill, decode, record
    the row, parse, step the environment and push the exchange into the window."""
    carry, cache = state
    turn, live, tenv, k = carry.turn, carry.live, setup.env.env, int(setup.rollout_config.history)
    ids, n, d = _sample_turn(setup, carry, cache)
    row_tokens, row_logp, row_prompt, row_gen, row_routing = _record_row(setup, carry, ids, n, d)
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
        env_state=R._keep_where(live, out.state, carry.env_state),
        env_info=R._keep_where(live, out.info, carry.env_info),
        parse_kind=jnp.where(live, kind, carry.parse_kind),
        valid_call=jnp.where(live, kind == 0, carry.valid_call),
        num_turns=carry.num_turns + live.astype(jnp.int32),
        gen_tokens=carry.gen_tokens + d.n_gen,
        budget_stops=carry.budget_stops + (live & (d.n_gen >= setup.max_new_tokens)).astype(jnp.int32),
        truncated=carry.truncated,
    )
    return new, d.cache


def _finalise(setup: R._Setup, carry: _Window) -> R.Trajectory:
    """The `Trajectory` of B * T turn samples (module docstring)."""
    b, t_max, lt, g = setup.batch, setup.turns, setup.length, setup.rollout_config.group_size
    reward, turn_reward, env_info, stats = R._episode_results(setup, carry)
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
    return R.Trajectory(
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
