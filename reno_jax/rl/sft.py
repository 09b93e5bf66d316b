"""Supervised warm start: teach the call *format* (not strategy) on transcripts of random legal moves.

The default experiment starts from a randomly initialised model, which cannot emit a well-formed tool call at
all. A short supervised phase on conversations whose assistant turn is a `choose_square` call on a UNIFORMLY
RANDOM legal square shows the model the format while carrying no information about which square is good; RL then
has to discover the strategy from rewards alone.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import text


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
