"""Supervised warm start pieces: a scripted teacher's calls as tokens (`CallTable`), whole teacher conversations
written by stepping an environment in jit (`env_transcripts`; cut into bounded-history turn samples:
`window_transcripts`), soft targets and the NLL loss.

A model initialised at random cannot write a well-formed tool call at all. A short supervised phase on
conversations of a teacher that knows the format but no strategy (e.g. a uniformly random legal move) shows the
model the format; RL then has to find the strategy from rewards alone. `reno_jax.loop.warmstart` runs it.
"""

from __future__ import annotations

import functools
import json
import types
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from reno_jax.envs import interface
from reno_jax.rl import policy, trainer
from reno_jax.rollout import rollout as rollout_lib


@flax.struct.dataclass
class CallTable:
    """Pre-tokenized tool calls a teacher policy can make: row a is the call `(tool[a], args[a])` as the policy
    would write it, followed by the turn-end token.

    Attributes:
      ids: `int32 [R, W]` token ids (pad after `length`); length: `int32 [R]`.
      tool: `int32 [R]` tool index in the environment's schemas; args: `int32 [R, A]` its arguments.
      choice_offset: static; the one token position where the rows differ when they all have one length and
        differ in one token (e.g. the square of `choose_square`), else -1.
      choice_tokens: static; every token id found in a column where the rows differ (a choice spelt over several
        tokens, e.g. a number written digit by digit, puts each digit and what may follow it here), sorted.
    """

    ids: jax.Array
    length: jax.Array
    tool: jax.Array
    args: jax.Array
    choice_offset: int = flax.struct.field(pytree_node=False, default=-1)
    choice_tokens: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())


def _argument_schema(tool: str, argument: str, schemas) -> dict:
    """The JSON schema of `tool`'s `argument` in the environment's tool schemas ({} where there is none)."""
    for schema in schemas or ():
        function = schema.get("function", schema)
        if function.get("name") == tool:
            return function.get("parameters", {}).get("properties", {}).get(argument, {})
    return {}


def _call_argument(value, tool: str, argument: str, schemas) -> int:
    """A teacher call's argument as the parser reports it: an integer as itself, an enum string as its option's
    index in the tool's schema (`schemas`: the environment's tool schemas). A value that is neither raises one
    line naming the tool, the argument and what it takes."""
    schema = _argument_schema(tool, argument, schemas)
    options = list(schema.get("enum") or [])
    if isinstance(value, str) and value in options:
        return options.index(value)
    low, high = schema.get("minimum", -(2**31)), schema.get("maximum", 2**31 - 1)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and not options and low <= value <= high:
        return int(value)
    takes = f"one of {', '.join(map(repr, options))}" if options else f"an integer in {low}..{high}"
    raise ValueError(f"teacher call {tool}({argument}={value!r}): {argument} takes {takes}")


def build_call_table(tokenizer, calls, turn_end_id: int, pad_id: int, tool_names=None, schemas=None) -> CallTable:
    """`calls`: list of `(tool_name, {arg: value})` in row order; argument values are ints, or strings of an enum
    argument, numbered by their option index in `schemas` (the environment's tool schemas, as its `chat().tools`)."""
    texts, tools, args = [], [], []
    names = list(tool_names or [])
    for name, kwargs in calls:
        texts.append(f"<tool_call>{json.dumps({'name': name, 'arguments': kwargs})}</tool_call>")
        tools.append(names.index(name) if name in names else 0)
        args.append([_call_argument(v, name, k, schemas) for k, v in kwargs.items()])
    rows = [list(tokenizer.encode(t, add_special_tokens=False)) + [int(turn_end_id)] for t in texts]
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, np.int32)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = r
    differs = np.flatnonzero((ids != ids[:1]).any(axis=0))
    offset = int(differs[0]) if len({len(r) for r in rows}) == 1 and len(differs) == 1 else -1
    lengths = np.asarray([len(r) for r in rows])
    choice = set()
    for j in range(width):
        column = set(ids[lengths > j, j].tolist())
        if len(column) > 1:
            choice |= column
    n_args = max(1, max(len(a) for a in args))
    arg_arr = np.zeros((len(rows), n_args), np.int32)
    for k, a in enumerate(args):
        arg_arr[k, : len(a)] = a
    return CallTable(
        ids=jnp.asarray(ids),
        length=jnp.asarray([len(r) for r in rows], jnp.int32),
        tool=jnp.asarray(tools, jnp.int32),
        args=jnp.asarray(arg_arr),
        choice_offset=offset,
        choice_tokens=tuple(sorted(int(t) for t in choice)),
    )


@flax.struct.dataclass
class Transcripts:
    """A batch of teacher conversations (`env_transcripts`).

    Attributes:
      tokens: ``int32 [B, L]`` (pad after the end); valid: ``bool [B, L]`` real tokens; loss_mask: ``bool [B, L]``
        the calls, turn ends included.
      support: ``bool [B, L, R]`` the call rows the teacher could have chosen, at each call's choice token (all
        False unless the call table has a `choice_offset`).
      info: the environment's final info (after `env.finish`; truncated when out of turns or length).
      target_weights: with ``soft_targets``, ``float32 [B, L, C]`` over the table's ``choice_tokens``: at each call
        token, the share of the teacher's choices (uniform over its support) that agree with the call written so
        far and continue with each choice token (`call_token_targets`); else None.
    """

    tokens: jax.Array
    valid: jax.Array
    loss_mask: jax.Array
    support: jax.Array
    info: Any
    target_weights: jax.Array | None = None


def call_token_targets(calls: CallTable, row: jax.Array, support: jax.Array) -> jax.Array:
    """A teacher choosing uniformly among its ``support bool [B, R]`` rows, spelt token by token: ``float32
    [B, W, C]``, at offset j of the written call ``row int [B]``, the share of supported rows that agree with it
    before j and write ``calls.choice_tokens[c]`` at j (the chain rule of the uniform choice: the first digit of a
    number gets the mass of every number that starts with it, the second that of those that also share the first).
    All 0 where no supported row agrees or the token at j is not a choice token (the written token is then the
    target)."""
    ids, width = calls.ids, calls.ids.shape[1]
    inside = jnp.arange(width)[None, :] < calls.length[:, None]  # [R, W]
    same = (ids[:, None, :] == ids[None, :, :]) & inside[:, None, :] & inside[None, :, :]  # [R, R, W]
    agree = jnp.cumprod(jnp.pad(same[..., :-1], ((0, 0), (0, 0), (1, 0)), constant_values=True), axis=-1)
    spells = ids[:, :, None] == jnp.asarray(calls.choice_tokens, jnp.int32)[None, None, :]  # [R, W, C]
    spells = spells & inside[:, :, None]
    peers = agree[row].astype(bool) & support[:, :, None] & inside[None]  # [B, R, W]: supported, same prefix
    mass = jnp.einsum("brw,rwc->bwc", peers.astype(jnp.float32), spells.astype(jnp.float32))
    return mass / jnp.maximum(jnp.sum(mass, axis=-1, keepdims=True), 1.0)


@functools.partial(jax.jit, static_argnames=("teacher", "max_turns", "length", "soft_targets"))
def env_transcripts(
    key: jax.Array, starts, env, teacher, calls: CallTable, *, max_turns: int, length: int, soft_targets: bool = False
) -> Transcripts:
    """Whole conversations of a scripted teacher playing an environment, by stepping the environment itself.

    The prompt, every tool response and assistant header are rendered by the same compiled tables the rollout
    uses, so the token sequences are exactly those a rollout would produce for the same calls. Runs in jit.

    Args:
      key: PRNG key of the teacher (the environment's own randomness comes from `starts`).
      starts: the environment's start records, one per transcript (leading [B]).
      env: `rollout.CompiledEnv`.
      teacher: static `(state, key) -> (row int32 [], support bool [R])` per episode: the call-table row to play,
        and the rows the teacher could have chosen (for soft targets); or `(row, support, weight float32 [])`:
        with soft targets, this decision's soft targets are scaled by `weight` (how much it counts in the loss).
      calls: `CallTable`.
      max_turns: agent turns at most; length: L, the padded length.
      soft_targets: also fill ``Transcripts.target_weights`` (needs ``calls.choice_tokens``).

    Returns:
      `Transcripts`.
    """

    tenv = env.env
    b = jax.tree.leaves(starts)[0].shape[0]
    r = calls.ids.shape[0]
    if env.prompt_len > length:
        raise ValueError(f"length {length} cannot hold the prompt ({env.prompt_len} tokens)")
    state, message = jax.vmap(tenv.reset)(starts)
    prompt, pos = jax.vmap(env.render_user)(message)
    tokens = rollout_lib.scatter_rows(
        jnp.full((b, length), env.pad_id, jnp.int32), jnp.zeros((b,), jnp.int32), prompt, pos
    )
    loss_mask = jnp.zeros((b, length), jnp.bool_)
    support = jnp.zeros((b, length, r), jnp.bool_)
    if soft_targets and not calls.choice_tokens:
        raise ValueError("soft targets need call rows that differ (the call table has no choice tokens)")
    weights = jnp.zeros((b, length, len(calls.choice_tokens)), jnp.float32) if soft_targets else None
    done = jnp.zeros((b,), jnp.bool_)
    truncated = jnp.zeros((b,), jnp.bool_)
    info = None
    for turn in range(max_turns):
        live = ~done
        out_t = jax.vmap(teacher)(state, jax.random.split(jax.random.fold_in(key, turn), b))
        row, sup = out_t[0], out_t[1]
        weight = out_t[2] if len(out_t) > 2 else None
        ids, n = calls.ids[row], jnp.where(live, calls.length[row], 0)
        fits = pos + n <= length
        n = jnp.where(fits, n, 0)
        truncated = truncated | (live & ~fits)
        live = live & fits
        tokens = rollout_lib.scatter_rows(tokens, pos, ids, n)
        loss_mask = rollout_lib.scatter_rows(loss_mask, pos, jnp.ones(ids.shape, jnp.bool_), n)
        if calls.choice_offset >= 0:
            at = jnp.where(live, pos + calls.choice_offset, length)  # out of bounds -> dropped
            support = support.at[jnp.arange(b), at].set(sup, mode="drop")
        if soft_targets:
            targets = call_token_targets(calls, row, sup)
            if weight is not None:
                targets = targets * weight.astype(jnp.float32)[:, None, None]
            weights = rollout_lib.scatter_rows(weights, pos, targets, n)
        pos = pos + n
        call = interface.ToolCall(kind=jnp.zeros((b,), jnp.int32), tool=calls.tool[row], args=calls.args[row])
        out = jax.vmap(tenv.step)(state, call)
        keep = lambda new, old: jax.tree.map(  # noqa: E731
            lambda a, o: jnp.where(jnp.reshape(live, (b,) + (1,) * (a.ndim - 1)), a, o), new, old
        )
        state = keep(out.state, state)
        info = out.info if info is None else keep(out.info, info)
        done = done | (live & out.done) | ~live
        if turn + 1 < max_turns:
            more = ~done
            resp, resp_n = jax.vmap(env.render_tool)(out.message, jnp.zeros((b,), jnp.bool_))
            resp_n = jnp.where(more, resp_n, 0)
            tokens = rollout_lib.scatter_rows(tokens, pos, resp, resp_n)
            pos = pos + resp_n
    truncated = truncated | ~done
    info = jax.vmap(tenv.finish)(state, info, truncated)
    valid = jnp.arange(length)[None, :] < pos[:, None]
    return Transcripts(
        tokens=jnp.where(valid, tokens, env.pad_id),
        valid=valid,
        loss_mask=loss_mask,
        support=support,
        info=info,
        target_weights=weights,
    )


@functools.partial(jax.jit, static_argnames=("teacher", "rollout_config", "soft_targets"))
def window_transcripts(
    key: jax.Array, starts, env, teacher, calls: CallTable, *, rollout_config, soft_targets: bool = False
) -> Transcripts:
    """A scripted teacher's episodes cut into turn samples, as a bounded-history rollout builds them.

    With ``rollout_config.history = k`` (`reno_jax.rollout.rollout`, bounded history) the policy sees, at every
    turn, the system prompt, the episode's last k exchanges and the current observation; this writes the teacher's
    episodes in that format, so the warm start trains on the prompts the student will see: row ``b * T + t`` is
    episode b's turn t, the turn prompt (`rollout.turn_prompt`, the same pieces and tables) followed by the
    teacher's call (the loss mask; without its turn-end token when the rollout stops at "</tool_call>", as the
    policy's turn then does), ``Lt = rollout.turn_length`` wide; a turn the episode did not reach is a
    padding row (nothing valid). Episodes play at most `rollout.num_turns` turns. Runs in jit.

    Args: as `env_transcripts`; `rollout_config` (static) the bounded-history rollout's (`history` set).

    Returns:
      `Transcripts` of ``B * T`` rows (``info`` per episode, ``[B]``).
    """
    if rollout_config.history is None:
        raise ValueError("window_transcripts needs a bounded-history rollout config (history=k)")
    tenv, b = env.env, jax.tree.leaves(starts)[0].shape[0]
    turns, lt = rollout_lib.num_turns(env, rollout_config), rollout_lib.turn_length(env, rollout_config)
    if soft_targets and not calls.choice_tokens:
        raise ValueError("soft targets need call rows that differ (the call table has no choice tokens)")
    setup = types.SimpleNamespace(env=env, rollout_config=rollout_config, batch=b)
    state, _ = jax.vmap(tenv.reset)(starts)
    k, e = int(rollout_config.history), rollout_lib.exchange_width(env, rollout_config)
    window = types.SimpleNamespace(
        env_state=state, ex_ids=jnp.full((b, k, e), env.pad_id, jnp.int32), ex_len=jnp.zeros((b, k), jnp.int32)
    )
    done = jnp.zeros((b,), jnp.bool_)
    rows, info = [], None
    for turn in range(turns):
        live = ~done
        out_t = jax.vmap(teacher)(window.env_state, jax.random.split(jax.random.fold_in(key, turn), b))
        rows.append(_window_row(setup, window, calls, out_t, live, lt, soft_targets))
        row = out_t[0]
        call = interface.ToolCall(kind=jnp.zeros((b,), jnp.int32), tool=calls.tool[row], args=calls.args[row])
        out = jax.vmap(tenv.step)(window.env_state, call)
        cont = live & ~out.done
        if k and turns > 1:  # the call and its tool response join the window, as in the rollout
            turn_end = jnp.full((b,), not rollout_config.stop_at_tool_call)
            n_gen = calls.length[row] - int(rollout_config.stop_at_tool_call)
            decoded = types.SimpleNamespace(turn_end=turn_end, gen_tok=calls.ids[row], n_gen=n_gen)
            new_ids, new_len = rollout_lib._new_exchange(setup, decoded, out.message)
            window.ex_ids = jnp.where(
                cont[:, None, None], jnp.concatenate([window.ex_ids[:, 1:], new_ids[:, None]], 1), window.ex_ids
            )
            window.ex_len = jnp.where(
                cont[:, None], jnp.concatenate([window.ex_len[:, 1:], new_len[:, None]], 1), window.ex_len
            )
        window.env_state = rollout_lib._keep_where(live, out.state, window.env_state)
        info = out.info if info is None else rollout_lib._keep_where(live, out.info, info)
        done = done | (live & out.done)
    info = jax.vmap(tenv.finish)(window.env_state, info, ~done)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1).reshape((b * turns,) + xs[0].shape[1:]), *rows)
    return stacked.replace(info=info)


def _window_row(setup, window, calls: CallTable, out_t, live, lt: int, soft_targets: bool) -> Transcripts:
    """One turn of every episode as a `Transcripts` row (``[B, Lt]``; no info): the turn prompt, then the teacher's
    call under the loss mask; nothing valid for an episode that has ended."""
    b, r, pad_id = setup.batch, calls.ids.shape[0], setup.env.pad_id
    row, sup = out_t[0], out_t[1]
    ids, n = rollout_lib.turn_prompt(setup, window)
    n = jnp.where(live, n, 0)
    # A call row ends with the turn-end token; a rollout that stops at "</tool_call>" leaves it to the tool turn.
    n_call = jnp.where(live, calls.length[row] - int(setup.rollout_config.stop_at_tool_call), 0)
    zero = jnp.zeros((b,), jnp.int32)
    tokens = rollout_lib.scatter_rows(jnp.full((b, lt), pad_id, jnp.int32), zero, ids, n)
    tokens = rollout_lib.scatter_rows(tokens, n, calls.ids[row], n_call)
    pos = jnp.arange(lt)[None, :]
    valid = pos < (n + n_call)[:, None]
    loss_mask = valid & (pos >= n[:, None])
    support = jnp.zeros((b, lt, r), jnp.bool_)
    if calls.choice_offset >= 0:
        at = jnp.where(live, n + calls.choice_offset, lt)  # out of bounds -> dropped
        support = support.at[jnp.arange(b), at].set(sup, mode="drop")
    weights = None
    if soft_targets:
        targets = call_token_targets(calls, row, sup)
        if len(out_t) > 2:
            targets = targets * out_t[2].astype(jnp.float32)[:, None, None]
        empty = jnp.zeros((b, lt, len(calls.choice_tokens)), jnp.float32)
        weights = rollout_lib.scatter_rows(empty, n, targets, n_call)
    return Transcripts(
        tokens=jnp.where(valid, tokens, pad_id),
        valid=valid,
        loss_mask=loss_mask,
        support=support,
        info=None,
        target_weights=weights,
    )


def length_sorted_batches(transcripts: Transcripts, batch_size: int, key: jax.Array) -> list[Transcripts]:
    """A pool of ``P * batch_size`` transcripts as P batches of neighbours in length, in a random order.

    Whole conversations differ a lot in length (a game won in four moves against one of twenty), and a batch is
    padded to its longest row: batches of similar lengths pad far less, so each step costs only as much as its own
    conversations. Every transcript is in exactly one batch; within the pool the rows keep their lengths' order
    (the shortest in one batch, the longest in another), so the pool, not each batch, is the sample. The host
    reads the lengths once per pool.
    """
    rows = int(transcripts.tokens.shape[0])
    if batch_size < 1 or rows % batch_size:
        raise ValueError(f"a pool of {rows} transcripts does not split into batches of {batch_size}")
    lengths = np.asarray(jax.device_get(jnp.sum(transcripts.valid, axis=1)))
    order = np.argsort(lengths, kind="stable").reshape(-1, batch_size)
    order = order[np.asarray(jax.device_get(jax.random.permutation(key, order.shape[0])))]
    return [jax.tree.map(lambda a, idx=jnp.asarray(idx): a[idx], transcripts) for idx in order]


def sft_loss(logp, old_logp, advantages, mask, **unused):
    """Token-mean negative log-likelihood over ``mask`` (same signature as the policy losses).

    ``old_logp`` and ``advantages`` are ignored; the signature matches ``reno_jax.rl.losses`` so the generic
    ``trainer.make_train_step`` trains both phases.
    """
    del old_logp, advantages, unused
    mask = mask.astype(jnp.float32)
    total = jnp.sum(mask)
    nll = -jnp.sum(logp * mask) / jnp.maximum(total, 1.0)
    return nll, {"nll": nll, "normalizer": total}


def learning_rate_schedule(sft_config):
    """The warm start's learning rate per update: linear warmup to `learning_rate`, then cosine to
    `final_lr_fraction` of it at `num_steps` (1: constant after the warmup); with `decay_steps` > 0 the peak is
    held until the last `decay_steps` and the cosine runs over those only (warmup-stable-decay: a decay from the
    start delays what a constant rate learns at once, e.g. copying, and a short one at the end still anneals)."""
    s = sft_config
    warmup = min(s.warmup_steps, s.num_steps)
    end = s.learning_rate * s.final_lr_fraction
    if not s.decay_steps:
        return trainer.make_lr_schedule(s.learning_rate, end, warmup, s.num_steps)
    stable_end = s.num_steps - s.decay_steps
    decay = trainer.make_lr_schedule(s.learning_rate, end, 0, s.decay_steps)
    return optax.join_schedules([trainer.make_lr_schedule(s.learning_rate, 0.0, warmup), decay], [stable_end])


def supervised_trainer(sft_config, params, model_config, key, layout=None):
    """`(state, step_fn, place)` of a warm start (`sft_config`: the run config's `sft` section): AdamW on
    `learning_rate_schedule`, clipped at norm 1, `sft_loss` on the policy's log-probs; `place` puts a batch on
    `layout`'s mesh (the identity on one device)."""
    s = sft_config
    optimizer = trainer.make_optimizer(
        s.learning_rate,
        weight_decay=0.0,
        schedule=learning_rate_schedule(s),
        clip_norm=1.0,
    )
    state = trainer.create_train_state(params, optimizer, key)
    state = state if layout is None else layout.place_state(state)
    step_fn = trainer.make_train_step(policy.make_logp_fn(model_config, with_entropy=False), sft_loss, optimizer)
    place = (lambda batch: batch) if layout is None else layout.place_batch
    return state, step_fn, place
