"""Supervised warm start pieces: a scripted teacher's calls as tokens (`CallTable`), whole teacher conversations
written by stepping an environment in jit (`env_transcripts`), soft targets and the NLL loss.

A model initialised at random cannot write a well-formed tool call at all. A short supervised phase on
conversations of a teacher that knows the format but no strategy (e.g. a uniformly random legal move) shows the
model the format; RL then has to find the strategy from rewards alone. `reno_jax.loop.warmstart` runs it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface
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
    """

    ids: jax.Array
    length: jax.Array
    tool: jax.Array
    args: jax.Array
    choice_offset: int = flax.struct.field(pytree_node=False, default=-1)


def build_call_table(tokenizer, calls, turn_end_id: int, pad_id: int, tool_names=None) -> CallTable:
    """`calls`: list of `(tool_name, {arg: value})` in row order (argument values: ints, or enum option indices
    for `tool_names`'s string arguments are not supported here: teachers write integer calls)."""
    texts, tools, args = [], [], []
    names = list(tool_names or [])
    for name, kwargs in calls:
        texts.append(f"<tool_call>{json.dumps({'name': name, 'arguments': kwargs})}</tool_call>")
        tools.append(names.index(name) if name in names else 0)
        args.append([int(v) for v in kwargs.values()])
    rows = [list(tokenizer.encode(t, add_special_tokens=False)) + [int(turn_end_id)] for t in texts]
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, np.int32)
    for k, r in enumerate(rows):
        ids[k, :len(r)] = r
    differs = np.flatnonzero((ids != ids[:1]).any(axis=0))
    offset = int(differs[0]) if len({len(r) for r in rows}) == 1 and len(differs) == 1 else -1
    n_args = max(1, max(len(a) for a in args))
    arg_arr = np.zeros((len(rows), n_args), np.int32)
    for k, a in enumerate(args):
        arg_arr[k, :len(a)] = a
    return CallTable(ids=jnp.asarray(ids), length=jnp.asarray([len(r) for r in rows], jnp.int32),
                     tool=jnp.asarray(tools, jnp.int32), args=jnp.asarray(arg_arr), choice_offset=offset)


@flax.struct.dataclass
class Transcripts:
    """A batch of teacher conversations (`env_transcripts`).

    Attributes:
      tokens: ``int32 [B, L]`` (pad after the end); valid: ``bool [B, L]`` real tokens; loss_mask: ``bool [B, L]``
        the calls, turn ends included.
      support: ``bool [B, L, R]`` the call rows the teacher could have chosen, at each call's choice token (all
        False unless the call table has a `choice_offset`).
      info: the environment's final info (after `env.finish`; truncated when out of turns or length).
    """

    tokens: jax.Array
    valid: jax.Array
    loss_mask: jax.Array
    support: jax.Array
    info: Any


@functools.partial(jax.jit, static_argnames=("teacher", "max_turns", "length"))
def env_transcripts(key: jax.Array, starts, env, teacher, calls: CallTable, *, max_turns: int,
                    length: int) -> Transcripts:
    """Whole conversations of a scripted teacher playing an environment, by stepping the environment itself.

    The prompt, every tool response and assistant header are rendered by the same compiled tables the rollout
    uses, so the token sequences are exactly those a rollout would produce for the same calls. Runs in jit.

    Args:
      key: PRNG key of the teacher (the environment's own randomness comes from `starts`).
      starts: the environment's start records, one per transcript (leading [B]).
      env: `rollout.CompiledEnv`.
      teacher: static `(state, key) -> (row int32 [], support bool [R])` per episode: the call-table row to play,
        and the rows the teacher could have chosen (for soft targets).
      calls: `CallTable`.
      max_turns: agent turns at most; length: L, the padded length.

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
    tokens = rollout_lib.scatter_rows(jnp.full((b, length), env.pad_id, jnp.int32), jnp.zeros((b,), jnp.int32),
                                      prompt, pos)
    loss_mask = jnp.zeros((b, length), jnp.bool_)
    support = jnp.zeros((b, length, r), jnp.bool_)
    done = jnp.zeros((b,), jnp.bool_)
    truncated = jnp.zeros((b,), jnp.bool_)
    info = None
    for turn in range(max_turns):
        live = ~done
        row, sup = jax.vmap(teacher)(state, jax.random.split(jax.random.fold_in(key, turn), b))
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
        pos = pos + n
        call = interface.ToolCall(kind=jnp.zeros((b,), jnp.int32), tool=calls.tool[row], args=calls.args[row])
        out = jax.vmap(tenv.step)(state, call)
        keep = lambda new, old: jax.tree.map(  # noqa: E731
            lambda a, o: jnp.where(jnp.reshape(live, (b,) + (1,) * (a.ndim - 1)), a, o), new, old)
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
    return Transcripts(tokens=jnp.where(valid, tokens, env.pad_id), valid=valid, loss_mask=loss_mask,
                       support=support, info=info)


def uniform_soft_targets(support: jax.Array, choice_ids) -> dict:
    """Soft targets of a teacher that picks uniformly among its support, from ``support bool [B, L, R]``
    (`env_transcripts`'s, at each call's choice token) and ``choice_ids int [R]`` (each call row's choice token).

    Returns the batch entries ``soft_target_ids int32 [B, R]`` and ``soft_target_weights float32 [B, L, R]``
    (1/#support on the supported rows at choice positions, 0 elsewhere); `rl.policy.make_logp_fn` then scores
    those positions by the expected log-likelihood under the target, so one transcript teaches every choice the
    teacher could have made (e.g. every legal square) instead of the one it sampled.
    """
    support = jnp.asarray(support, jnp.float32)
    weights = support / jnp.maximum(jnp.sum(support, axis=-1, keepdims=True), 1.0)
    ids = jnp.broadcast_to(jnp.asarray(choice_ids, jnp.int32), (support.shape[0], support.shape[-1]))
    return {"soft_target_ids": ids, "soft_target_weights": weights}


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
