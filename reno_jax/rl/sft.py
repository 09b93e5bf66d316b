"""Supervised warm start: teach the call *format* (not strategy) on transcripts of random legal moves.

The default experiment starts from a randomly initialised model, which cannot emit a well-formed tool call at
all. A short supervised phase on conversations whose assistant turn is a `choose_square` call on a UNIFORMLY
RANDOM legal square shows the model the format while carrying no information about which square is good; RL then
has to discover the strategy from rewards alone.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs.tictactoe import tasks, wording as text
from reno_jax.rollout import rollout as rollout_lib


def call_text(square: int) -> str:
    """The assistant's tool call for ``square`` (1..9), in the Hermes/Qwen/Ling format."""
    args = json.dumps({"name": text.TOOL_NAME, "arguments": {"square": int(square)}})
    return f"<tool_call>{args}</tool_call>"


def random_move_transcripts(tokenizer, boards: np.ndarray, rng: np.random.Generator, max_length: int,
                            turn_end_id: int, pad_id: int, prompt_cache: dict | None = None):
    """Host-side batch of ``prompt + random legal call + turn end`` token ids.

    Args:
      tokenizer: HF tokenizer with the chat template used by the rollout.
      boards: ``int8 [N, 9]`` positions with X to move.
      rng: NumPy generator that picks the random legal squares.
      max_length: L, the padded length.
      turn_end_id: the token that ends an assistant turn (the rollout's stop token).
      pad_id: padding id.
      prompt_cache: optional dict (board bytes -> prompt ids) reused across calls; rendering the chat template is
        the slow part of building a batch.

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
            prompt = text.prompt_ids(tokenizer, text.move_task_messages(board))
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
    calls = [list(tokenizer.encode(call_text(k), add_special_tokens=False)) + [int(turn_end_id)]
             for k in range(1, 10)]
    width = max(len(c) for c in calls)
    ids = np.full((9, width), pad_id, np.int32)
    for k, c in enumerate(calls):
        ids[k, :len(c)] = c
    differs = np.flatnonzero((ids != ids[:1]).any(axis=0))
    offset = int(differs[0]) if len({len(c) for c in calls}) == 1 and len(differs) == 1 else -1
    return ids, np.asarray([len(c) for c in calls], np.int32), offset


@functools.partial(jax.jit, static_argnames=("max_turns", "length", "square_offset"))
def random_game_transcripts(key: jax.Array, starts, env, call_ids: jax.Array, call_len: jax.Array, *,
                            max_turns: int, length: int, square_offset: int = -1) -> dict:
    """Whole game conversations in which the agent plays UNIFORMLY RANDOM legal moves (format only), in jit.

    The game-task twin of `random_move_transcripts`: the agent's calls are random legal squares, the opponent
    answers as configured in `starts` (random / minimax / epsilon-mixed), and the tool responses and assistant
    headers are rendered by the same `text` functions the rollout uses, so the token sequences are exactly those
    a rollout would produce for the same moves.

    Args:
      key: PRNG key (agent moves and opponent replies).
      starts: `rollout.EpisodeStarts` of the game task, one row per transcript (B rows).
      env: `rollout.RolloutEnv`.
      call_ids, call_len, square_offset: from `call_token_table`.
      max_turns: agent turns at most (the rollout's `max_turns`).
      length: L, the padded length (the rollout's `conversation_length`).

    Returns:
      dict of ``[B, L]`` arrays ``tokens`` int32, ``valid`` bool, ``loss_mask`` bool (the agent's call tokens,
      turn-end included), ``legal_squares bool [B, L, 9]`` (at each call's square token, when ``square_offset``
      >= 0: the squares that were legal there, i.e. the support of the random policy; False elsewhere), and
      ``outcome int32 [B]`` (``tasks.OUTCOME_*``; games cut by ``max_turns`` stay 0).
    """
    spec, table = env.spec, env.table
    b = starts.boards.shape[0]
    k_reset, k_play = jax.random.split(key)
    state = tasks.game_reset_batch(jax.random.split(k_reset, b), starts.agent_player, starts.opponent_kind,
                                   starts.epsilon, table)
    prompt, pos = jax.vmap(text.render_prompt, in_axes=(None, 0, 0, None))(spec, state.board, state.agent_player,
                                                                           True)
    if spec.prompt_len > length:
        raise ValueError(f"length {length} cannot hold the prompt ({spec.prompt_len} tokens)")
    tokens = jnp.full((b, length), spec.pad_id, jnp.int32)
    tokens = rollout_lib.scatter_rows(tokens, jnp.zeros((b,), jnp.int32), prompt, pos)
    loss_mask = jnp.zeros((b, length), jnp.bool_)
    legal_squares = jnp.zeros((b, length, 9), jnp.bool_)
    call_ids, call_len = jnp.asarray(call_ids, jnp.int32), jnp.asarray(call_len, jnp.int32)
    for turn in range(max_turns):
        k_move, k_opp = jax.random.split(jax.random.fold_in(k_play, turn))
        live = ~state.done
        legal = state.board == 0
        noise = jax.random.uniform(k_move, legal.shape)
        square = jnp.argmax(jnp.where(legal, noise, -1.0), axis=-1).astype(jnp.int32)  # uniform over legal
        call, n = call_ids[square], jnp.where(live, call_len[square], 0)
        tokens = rollout_lib.scatter_rows(tokens, pos, call, n)
        loss_mask = rollout_lib.scatter_rows(loss_mask, pos, jnp.ones(call.shape, jnp.bool_), n)
        if square_offset >= 0:
            at = jnp.where(live, pos + square_offset, length)  # out of bounds -> dropped
            legal_squares = legal_squares.at[jnp.arange(b), at].set(legal, mode="drop")
        pos = pos + n
        state, _, _, _ = tasks.game_step_batch(jax.random.split(k_opp, b), state,
                                               jnp.zeros((b,), jnp.int32), square + 1, table)
        if turn + 1 < max_turns:
            more = live & ~state.done
            resp, resp_n = jax.vmap(text.render_tool_response, in_axes=(None, 0, 0, 0))(
                spec, state.board, state.opponent_square, state.outcome)
            resp_n = jnp.where(more, resp_n, 0)
            tokens = rollout_lib.scatter_rows(tokens, pos, resp, resp_n)
            pos = pos + resp_n
    valid = jnp.arange(length)[None, :] < pos[:, None]
    return {"tokens": jnp.where(valid, tokens, spec.pad_id), "valid": valid, "loss_mask": loss_mask,
            "legal_squares": legal_squares, "outcome": state.outcome}


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
