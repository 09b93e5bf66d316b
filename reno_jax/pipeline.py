"""Builds the pieces of an experiment from an `ml_collections` config: tokenizer, model, boards, environment,
rollout settings, the policy log-prob function and the per-step rollout metrics.

Shared by `experiments/train_tictactoe.py` and `experiments/evaluate.py`, so a checkpoint is always evaluated
with exactly the model, tokenizer and environment it was trained with.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import boards as boards_lib
from reno_jax.envs import tasks
from reno_jax.envs import tokenizer as tokenizer_lib
from reno_jax.models import ling3
from reno_jax.models.config import Ling3Config
from reno_jax.rl import losses, shared_prefix, trainer
from reno_jax.rollout import rollout as rollout_lib

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def dtype_of(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


# ---------------------------------------------------------------------------------------------- tokenizer, model

def build_tokenizer(config):
    """The tokenizer of `config.model.tokenizer_path`, else of `config.model.path`, else the shipped one."""
    path = config.model.get("tokenizer_path", "") or config.model.get("path", "") or None
    return tokenizer_lib.load_tokenizer(path)


def tiny_model_config(config, vocab_size: int) -> Ling3Config:
    """The embedded tiny Ling-3.0 architecture described by `config.model.tiny`."""
    fields = dict(config.model.tiny)
    fields.setdefault("vocab_size", vocab_size)
    fields["vocab_size"] = max(int(fields["vocab_size"]), vocab_size)
    return Ling3Config(**fields)


def build_model(config, key: jax.Array, tokenizer) -> tuple[Ling3Config, Any]:
    """(model_config, params): from the HF directory `config.model.path`, else a fresh tiny model."""
    dtype = dtype_of(config.model.dtype)
    if config.model.get("path", ""):
        return ling3.from_pretrained(config.model.path, dtype=dtype)
    model_config = tiny_model_config(config, len(tokenizer))
    return model_config, ling3.init_params(model_config, key, dtype)


def routing_stats(own: jax.Array, recorded: jax.Array) -> trainer.RoutingStats:
    """Agreement of a train forward's own top-k with the rollout's recorded routing.

    own: `int [B, T, n_moe, K]` (`ling3.Routing.own`, -1 on invalid tokens); recorded: the rollout's ids, same
    shape (-1: nothing recorded). Counts the (token, MoE layer) pairs where both exist and whether the two
    top-k SETS are equal (order within the top-k does not matter for the MoE output).
    """
    recorded = recorded.astype(jnp.int32)
    present = (own[..., 0] >= 0) & (recorded[..., 0] >= 0)
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(recorded, axis=-1), axis=-1)
    return trainer.RoutingStats(agree=jnp.sum(same & present).astype(jnp.float32),
                                total=jnp.sum(present).astype(jnp.float32))


def make_logp_fn(model_config: Ling3Config, with_entropy: bool = True, group_size: int | None = None,
                 remat: bool = False, entropy_top_k: int = 0, routing_replay: bool = False):
    """`logp_fn(params, batch) -> (logp [B, L], entropy [B, L] or None)` for `trainer.make_train_step`.

    `logp[:, t]` is `log p(tokens[t] | tokens[:t])` in float32; the entropy is that of the full next-token
    distribution at the same positions (a metric, and the entropy bonus when configured). With `group_size`, a
    batch carrying `prefix_tokens` (see `reno_jax.rl.shared_prefix`) is scored with each group's prompt encoded
    once; `tokens` are then the continuations and `logp[:, t]` conditions on the prefix too. `remat`: recompute
    each decoder layer in the backward pass instead of storing its activations (`ling3.forward(remat=True)`).
    `entropy_top_k` > 0: the entropy is that of the distribution renormalised over the k most likely tokens
    (an entropy bonus then evens out the plausible choices without pushing mass onto the vocabulary's tail).

    Soft targets (supervised warm start): a batch may carry ``soft_target_ids int32 [B, K]`` and
    ``soft_target_weights float32 [B, L, K]``; where a position's weights sum to more than 0, ``logp[:, t]`` is
    ``sum_k w[t, k] * log p(ids[k] | tokens[:t])`` (the expected log-likelihood under that target) instead of the
    log-prob of ``tokens[t]``.

    Routing replay: a batch carrying the rollout's ``routing int [B, L, n_moe, K]`` (``Trajectory.routing``; with a
    shared prefix also ``prefix_routing``) makes ``logp_fn`` return a third element, ``trainer.RoutingStats`` (how
    many (token, MoE layer) pairs the train forward's own top-k agrees with the rollout on); with
    ``routing_replay=True`` the forward also uses those ids instead of its own top-k (``ling3.forward``'s
    ``replay_experts``; -1 entries route normally).
    """

    def logp_fn(params, batch):
        tokens = batch["tokens"]
        valid = batch.get("valid")
        recorded = "routing" in batch
        routing = None
        if "prefix_tokens" in batch:
            if "soft_target_weights" in batch:
                raise ValueError("soft targets are not supported with a shared-prefix batch")
            if group_size is None:
                raise ValueError("a shared-prefix batch needs make_logp_fn(..., group_size=G)")
            replay = dict(prefix_replay=batch["prefix_routing"], replay=batch["routing"]) if (
                recorded and routing_replay) else {}
            out = shared_prefix.shared_prefix_logits(params, model_config, batch["prefix_tokens"], tokens,
                                                     valid, group_size, remat=remat, return_routing=recorded,
                                                     **replay)
            logits, routing = out if recorded else (out, None)
            if recorded:
                full_recorded = jnp.concatenate([batch["prefix_routing"], batch["routing"]], axis=1)
            targets, pad = tokens, 0
        else:
            out = ling3.forward(params, model_config, tokens, valid=valid, remat=remat, return_routing=recorded,
                                replay_experts=batch["routing"] if recorded and routing_replay else None)
            logits = out[0][:, :-1].astype(jnp.float32)
            if recorded:
                routing, full_recorded = out[-1], batch["routing"]
            targets, pad = tokens[:, 1:], 1
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        logp = picked - logz
        if "soft_target_weights" in batch:
            weights = batch["soft_target_weights"][:, pad:].astype(jnp.float32)  # [B, T, K], aligned with logits
            ids = batch["soft_target_ids"]  # [B, K]
            soft_logits = jnp.take_along_axis(logits, jnp.broadcast_to(ids[:, None, :], weights.shape), axis=-1)
            total = jnp.sum(weights, axis=-1)
            soft = jnp.sum(weights * soft_logits, axis=-1) - total * logz
            logp = jnp.where(total > 0, soft, logp)
        logp = jnp.pad(logp, ((0, 0), (pad, 0)))
        entropy = None
        if with_entropy:
            ent_logits = jax.lax.top_k(logits, entropy_top_k)[0] if entropy_top_k else logits
            ent_logz = jax.nn.logsumexp(ent_logits, axis=-1) if entropy_top_k else logz
            probs = jax.nn.softmax(ent_logits, axis=-1)
            ent = ent_logz - jnp.sum(probs * ent_logits, axis=-1)
            entropy = jnp.pad(ent, ((0, 0), (pad, 0)))
        if recorded:
            return logp, entropy, routing_stats(jax.lax.stop_gradient(routing.own), full_recorded)
        return logp, entropy

    return logp_fn


# ---------------------------------------------------------------------------------------------- boards

def load_boards(config) -> tuple[np.ndarray, np.ndarray]:
    """(train_boards, heldout_boards) as `int8 [N, 9]` from `config.env` (AReno-style generator or a JSONL)."""
    env = config.env
    if env.get("boards_path", ""):
        boards, _ = boards_lib.load_jsonl(env.boards_path)
    else:
        boards = boards_lib.generate_boards(env.num_boards, seed=env.board_seed)
    boards = np.asarray(boards, np.int8)
    if env.get("heldout_fraction", 0.0):
        return boards_lib.train_heldout_split(boards, env.heldout_fraction, env.board_seed)
    return boards, boards[:0]


def eval_boards(name: str, config) -> np.ndarray:
    """Board set by name: `exhaustive` (every non-terminal X-to-move position), `train`, `heldout`, or a path."""
    if name == "exhaustive":
        return np.asarray(boards_lib.exhaustive_x_to_move(), np.int8)
    if name in ("train", "heldout"):
        train, heldout = load_boards(config)
        return train if name == "train" else heldout
    if os.path.exists(name):
        return np.asarray(boards_lib.load_jsonl(name)[0], np.int8)
    raise ValueError(f"unknown board set {name!r}: use exhaustive, train, heldout or a JSONL path")


# ---------------------------------------------------------------------------------------------- rollout

def rollout_config(config, *, greedy: bool = False, task: str | None = None,
                   group_size: int | None = None) -> rollout_lib.RolloutConfig:
    r = config.rollout
    return rollout_lib.RolloutConfig(
        task=task or config.env.task,
        max_new_tokens=int(r.max_new_tokens),
        max_turns=int(r.max_turns),
        max_length=int(r.get("max_length", 0)),
        temperature=float(r.temperature),
        top_k=int(r.top_k),
        top_p=float(r.top_p),
        greedy=bool(greedy),
        group_size=int(group_size or r.group_size),
        cache_dtype=str(r.get("cache_dtype", "float32")),
        record_routing=records_routing(config),
    )


def records_routing(config) -> bool:
    """Whether the rollout records its MoE routing: for routing replay (`rl.routing_replay`) or only for the
    `train/routing_agreement` metric (`rl.routing_metrics`)."""
    return bool(config.rl.get("routing_replay", False) or config.rl.get("routing_metrics", False))


def rollout_summary(traj, task: str) -> dict[str, float]:
    """Per-step rollout metrics (host floats), named like the published AReno run where one exists."""
    info = jax.tree.map(np.asarray, traj.info)
    reward = np.asarray(traj.reward, np.float64)
    gen = np.asarray(traj.loss_mask).sum(axis=1)
    out = {
        "rollout/rewards_mean": float(reward.mean()),
        "rollout/rewards_std": float(reward.std()),
        "rollout/rewards_min": float(reward.min()),
        "rollout/rewards_max": float(reward.max()),
        "rollout/accuracy": float((reward > 0).mean()),
        "rollout/response_len_mean": float(gen.mean()),
        "rollout/prompt_len_mean": float(np.asarray(traj.prompt_length).mean()),
    }
    if "valid_call" in info:
        out["rollout/tool_call_valid_rate"] = float(np.mean(info["valid_call"]))
    if task == "move":
        for key, name in (("is_optimal", "optimal_move_rate"), ("illegal", "illegal_rate"),
                          ("win_taken", "win_taken_rate")):
            if key in info:
                out[f"rollout/{name}"] = float(np.mean(info[key]))
    else:
        for key in ("win", "draw", "loss", "invalid", "illegal", "truncated"):
            if key in info:
                out[f"rollout/{key}_rate"] = float(np.mean(info[key]))
        if "num_turns" in info:
            out["rollout/turns_mean"] = float(np.mean(info["num_turns"]))
    return out


# ---------------------------------------------------------------------------------------------- optimisation

def make_optimizer(config):
    """The RL optimiser of a config (AdamW, warmup + cosine, global-norm clipping)."""
    r = config.rl
    total = config.num_steps * r.num_minibatches
    return trainer.make_optimizer(
        r.learning_rate, r.end_learning_rate, min(r.warmup_steps, total), total,
        b1=r.b1, b2=r.b2, weight_decay=r.weight_decay, clip_norm=r.clip_norm,
        state_dtype=None if r.optimizer_state_dtype == "float32" else r.optimizer_state_dtype)


def make_loss_fn(config):
    r = config.rl
    kwargs = {}
    if r.loss in ("gspo", "gspo_token", "grpo", "dr_grpo", "dapo"):
        kwargs.update(eps_low=r.eps_low, eps_high=r.eps_high)
    if r.kl_coef:
        kwargs["kl_coef"] = r.kl_coef
    if r.entropy_coef:
        kwargs["entropy_coef"] = r.entropy_coef
    loss_fn = functools.partial(losses.get_loss(r.loss), **kwargs)
    if r.get("forking_entropy_coef", 0.0) and r.get("forking_kl_coef", 0.0):
        raise ValueError("rl.forking_entropy_coef and rl.forking_kl_coef are alternatives: set one of them to 0")
    if r.get("forking_entropy_coef", 0.0):
        loss_fn = losses.with_forking_entropy_bonus(loss_fn, r.forking_entropy_coef, r.get("forking_top_k", 1),
                                                    per_turn=bool(r.get("forking_per_turn", False)))
    elif r.get("forking_kl_coef", 0.0):
        loss_fn = losses.with_forking_kl(loss_fn, r.forking_kl_coef, r.get("forking_top_k", 1))
    return loss_fn
