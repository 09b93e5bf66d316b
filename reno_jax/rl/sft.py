"""Supervised warm start: teach the call *format* (not strategy) on transcripts of random legal moves.

The default experiment starts from a randomly initialised model, which cannot emit a well-formed tool call at
all. A short supervised phase on conversations whose assistant turn is a `choose_square` call on a UNIFORMLY
RANDOM legal square shows the model the format while carrying no information about which square is good; RL then
has to discover the strategy from rewards alone.
"""

from __future__ import annotations

import functools
import json

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface
from reno_jax.rollout import rollout as rollout_lib
from reno_jax.envs.tictactoe import wording as text


def call_text(square: int) -> str:
    """The assistant's tool call for ``square`` (1..9), in the Hermes/Qwen/Ling format."""
    args = json.dumps({"name": text.TOOL_NAME, "arguments": {"square": int(square)}})
    return f"<tool_call>{args}</tool_call>"


def random_move_transcripts(tokenizer, boards: np.ndarray, rng: np.random.Generator, max_length: int,
                            turn_end_id: int, pad_id: int, prompt_cache: dict | None = None,
                            board_style: str = "grid"):
    """Host-side batch of ``prompt + random legal call + turn end`` token ids.

    Args:
      tokenizer: HF tokenizer with the chat template used by the rollout.
      boards: ``int8 [N, 9]`` positions (the prompt names the side to move).
      rng: NumPy generator that picks the random legal squares.
      max_length: L, the padded length.
      turn_end_id: the token that ends an assistant turn (the rollout's stop token).
      pad_id: padding id.
      prompt_cache: optional dict (board bytes -> prompt ids) reused across calls; rendering the chat template is
        the slow part of building a batch (one cache per board style).
      board_style: the prompts' board style (`wording.BOARD_STYLES`).

    Returns:
      dict of NumPy arrays: ``tokens [N, L] int32``, ``valid [N, L] bool``, ``loss_mask [N, L] bool`` (1 on the
      response tokens, which is what the policy would have to generate), ``squares [N]``.
    """
    n = len(boards)
    tokens = np.full((n, max_length), pad_id, np.int32)
    valid = np.zeros((n, max_length), bool)
    loss_mask = np.zeros((n, max_length), bool)
    squares = np.zeros((n,), np.int32)
    for i, board in enumerate(np.asarray(boards)):
        legal = np.flatnonzero(board == 0)
        if len(legal) == 0:
            raise ValueError(f"board {i} has no legal move: {board.tolist()}")
        square = int(rng.choice(legal)) + 1
        cache_key = board.tobytes()
        if prompt_cache is not None and cache_key in prompt_cache:
            prompt = prompt_cache[cache_key]
        else:
            prompt = text.prompt_ids(tokenizer, text.move_task_messages(board, style=board_style))
            if prompt_cache is not None:
                prompt_cache[cache_key] = prompt
        response = list(tokenizer.encode(call_text(square), add_special_tokens=False)) + [int(turn_end_id)]
        ids = prompt + response
        if len(ids) > max_length:
            raise ValueError(f"transcript of {len(ids)} tokens does not fit max_length={max_length}")
        tokens[i, :len(ids)] = ids
        valid[i, :len(ids)] = True
        loss_mask[i, len(prompt):len(ids)] = True
        squares[i] = square
    return {"tokens": tokens, "valid": valid, "loss_mask": loss_mask, "squares": squares}


def call_token_table(tokenizer, turn_end_id: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(ids int32 [9, W], lengths int32 [9], square_offset)``: the call for square k+1 followed by the turn-end
    token; ``square_offset`` is the one position where the nine calls differ (the square's token) when they all
    have the same length and differ in exactly one token, else -1."""
    table = build_call_table(tokenizer, [(text.TOOL_NAME, {"square": k}) for k in range(1, 10)], turn_end_id,
                             pad_id, [text.TOOL_NAME])
    return np.asarray(table.ids), np.asarray(table.length), table.choice_offset


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


@functools.partial(jax.jit, static_argnames=("teacher", "max_turns", "length"))
def env_transcripts(key: jax.Array, starts, env, teacher, calls: CallTable, *, max_turns: int, length: int) -> dict:
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
      dict of `[B, L]` arrays `tokens` int32, `valid` bool, `loss_mask` bool (the calls, turn end included),
      `support bool [B, L, R]` (at each call's choice token when `calls.choice_offset >= 0`, else all False), and
      the environment's final `info` (after `env.finish`, truncated when out of turns or length).
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
    return {"tokens": jnp.where(valid, tokens, env.pad_id), "valid": valid, "loss_mask": loss_mask,
            "support": support, "info": info}


def _random_legal_square(state, key):
    """Tic-tac-toe game teacher: a uniformly random legal square (format only, no strategy)."""
    legal = state.game.board == 0
    noise = jax.random.uniform(key, legal.shape)
    return jnp.argmax(jnp.where(legal, noise, -1.0)).astype(jnp.int32), legal


def random_game_transcripts(key: jax.Array, starts, env, call_ids: jax.Array, call_len: jax.Array, *,
                            max_turns: int, length: int, square_offset: int = -1) -> dict:
    """Whole tic-tac-toe games in which the agent plays UNIFORMLY RANDOM legal moves (format only), in jit.

    `env_transcripts` with the random-legal teacher on the game `TicTacToeEnv`; the opponent answers as set in
    `starts` (its keys too). Returns `tokens`, `valid`, `loss_mask`, `legal_squares bool [B, L, 9]` (at each
    call's square token when `square_offset >= 0`) and `outcome int32 [B]` (truncated games: 6).
    """
    calls = CallTable(ids=jnp.asarray(call_ids, jnp.int32), length=jnp.asarray(call_len, jnp.int32),
                      tool=jnp.zeros((9,), jnp.int32), args=jnp.arange(1, 10, dtype=jnp.int32)[:, None],
                      choice_offset=int(square_offset))
    out = env_transcripts(key, starts, env, _random_legal_square, calls, max_turns=max_turns, length=length)
    return {"tokens": out["tokens"], "valid": out["valid"], "loss_mask": out["loss_mask"],
            "legal_squares": out["support"], "outcome": out["info"]["outcome"]}


def uniform_soft_targets(legal_squares: jax.Array, square_ids) -> dict:
    """Soft targets of the uniformly random legal policy from ``legal_squares bool [B, L, 9]``.

    Returns the batch entries ``soft_target_ids int32 [B, 9]`` (each row: the nine square tokens) and
    ``soft_target_weights float32 [B, L, 9]`` (1/#legal on the legal squares at square positions, 0 elsewhere);
    `pipeline.make_logp_fn` then scores those positions by the expected log-likelihood under the target, so the
    warm start learns *which squares are legal* from every example at once instead of from one sampled square.
    The target is still the random legal policy: no strategy information.
    """
    legal = jnp.asarray(legal_squares, jnp.float32)
    weights = legal / jnp.maximum(jnp.sum(legal, axis=-1, keepdims=True), 1.0)
    ids = jnp.broadcast_to(jnp.asarray(square_ids, jnp.int32), (legal.shape[0], legal.shape[-1]))
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
