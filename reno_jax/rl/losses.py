"""Pure policy-gradient losses for RL post-training: GSPO and its relatives.

Everything here is a pure function of arrays (jit-able, no globals, no host callbacks) and only depends on
``jax``. All policy losses share one calling convention::

    loss, metrics = loss_fn(logp, old_logp, advantages, mask, *, ref_logp=None, kl_coef=0.0,
                            entropy=None, entropy_coef=0.0, token_weight=None, **clip_hparams)

with

* ``logp      [B, L] float``  per-token log-probs of the *current* policy (the only differentiated input),
* ``old_logp  [B, L] float``  per-token log-probs of the behaviour policy that sampled the tokens,
* ``advantages [B] float``    one advantage per sequence, broadcast over its tokens (every loss but ``gspo_loss``,
                              whose objective is per sequence, also accepts per-token ``[B, L]``, e.g.
                              ``token_advantages``),
* ``mask      [B, L]``        1/True exactly on policy-generated tokens (prompt, tool output and padding are 0).
* ``ref_logp  [B, L]``        optional reference-policy log-probs for a KL penalty (``kl_coef``), estimated per
                              token with the non-negative, unbiased "k3" estimator
                              ``exp(ref - logp) - (ref - logp) - 1`` (Schulman, "Approximating KL divergence").
* ``entropy   [B, L]``        optional per-token policy entropy; ``entropy_coef`` > 0 *rewards* entropy
                              (the term ``- entropy_coef * H`` is added to the loss).
* ``token_weight [B, L]``     optional non-negative per-token weight of the *policy* term, never differentiated
                              (``None``: the unweighted loss, computed exactly as without the argument). The
                              token-level losses multiply token t's surrogate by ``w_t``; GSPO and GSPO-token,
                              whose importance ratio is a geometric mean over the sequence, multiply sequence i's
                              surrogate by the geometric mean ``exp(mean_{t in y_i} log w_t)`` (see ``gspo_loss``).
                              KL / entropy terms and the metrics are not weighted. ``with_tis`` builds it.

Values at positions where ``mask`` is 0 are ignored completely: they never reach an ``exp`` (so garbage there
cannot produce inf/NaN, in the value or the gradient).

The returned ``loss`` is a float32 scalar to *minimise*. KL and entropy terms are aggregated over tokens exactly
like the loss's own policy term (sequence-mean then batch-mean for GSPO/GRPO, batch token-mean for DAPO, constant
normaliser for Dr. GRPO), so that the three terms are on the same scale.

``metrics`` (float32 scalars):

* ``policy_loss``  the policy term alone (the loss without KL / entropy terms),
* ``clip_frac``    fraction of units where clipping is *active*, i.e. the clipped surrogate was strictly chosen
                   and its gradient is zero. Units are valid sequences for GSPO, policy tokens for the
                   token-level losses (including GSPO-token),
* ``ratio_mean``, ``ratio_min``, ``ratio_max``  importance ratio statistics over the same units
                   (1.0 when there is no valid unit),
* ``approx_kl``    KL(old || current) estimate: token mean over all policy tokens of ``0.5 * (logp - old)^2``
                   (the "k2" estimator; second-order accurate and always >= 0),
* ``kl``           (only when ``ref_logp`` is given) token mean of the k3 estimate of KL(current || ref),
* ``entropy``      (only when ``entropy`` is given) token mean of the entropy over policy tokens,
* ``normalizer``   the gradient-free count the loss sums were divided by (valid sequences, policy tokens or
                   the constant ``B * max_length``). ``reno_jax.rl.trainer`` uses it to combine micro-batches
                   into exactly the full-batch gradient.

The statistics (``approx_kl``, ``kl``, ``entropy``) are token means regardless of the loss's aggregation so they
can be compared between losses. How each metric combines over micro-batches and minibatches is declared in
``METRIC_REDUCTIONS`` next to them.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

Array = jax.Array

# Log importance ratios are clamped to +-_MAX_LOG_RATIO before ``exp``. A ratio of e^20 ~ 5e8 is already far
# outside every clip range (so the value of the loss is unaffected in all practical cases), and the clamp keeps
# exp finite; otherwise a clipped branch, even when not selected, backpropagates 0 * inf = NaN.
_MAX_LOG_RATIO = 20.0

# How a loss metric combines over the micro-batches and minibatches of a train step (`trainer.make_train_step`):
# "mean" (micro-batches weighted by `normalizer`, minibatches averaged; every metric not listed), "min" / "max"
# (over both), "sum" (summed over micro-batches, averaged over minibatches: a minibatch total) and "count"
# (summed over both: the step's total).
METRIC_REDUCTIONS: Mapping[str, str] = {
    "ratio_min": "min",
    "ratio_max": "max",
    "normalizer": "sum",
    "icepop_masked_count": "count",
}


# ----------------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------------
def group_advantages(rewards: Array, group_size: int, normalize_std: bool = True, eps: float = 1e-8) -> Array:
    """Group-relative advantages (GRPO / GSPO).

    Args:
      rewards: ``[B]`` rewards; rows ``[g*G, (g+1)*G)`` form group ``g`` (contiguous groups, same prompt).
      group_size: G (static), must divide B.
      normalize_std: divide by the group's population standard deviation (ddof=0). Dr. GRPO uses ``False``.
      eps: added to the std so an all-equal group gives exactly 0 (never 0/0).

    Returns:
      ``[B] float32`` advantages ``(r - mean_g) / (std_g + eps)``, or ``r - mean_g`` without std scaling.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"group_advantages: rewards must be [B], got shape {rewards.shape}")
    group_size = int(group_size)
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"group_advantages: batch size {rewards.shape[0]} is not a positive multiple of group_size {group_size}"
        )
    r = rewards.reshape(-1, group_size)
    # A constant group must get exactly 0: its float32 mean can be off by one ulp (16 x 0.8 sums to 12.8000002), and
    # dividing that rounding residue by an equally tiny std would turn it into advantages of order 1 that push the
    # whole group (e.g. 16 optimal moves) in one direction.
    constant = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
    centred = jnp.where(constant, 0.0, r - jnp.mean(r, axis=1, keepdims=True))
    if normalize_std:
        std = jnp.sqrt(jnp.mean(centred * centred, axis=1, keepdims=True))
        centred = centred / (std + eps)
    return centred.reshape(-1)


def turn_advantages(
    turn_reward: Array,
    turn_key: Array,
    group_size: int,
    discount: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-8,
) -> Array:
    """Turn-level advantages of multi-turn episodes, by states the group's episodes share (GiGPO's step groups,
    Feng et al., 2025).

    An episode-level advantage credits every turn of an episode alike; here turn t of an episode is compared with
    the other turns of its group taken from the same environment state (same ``turn_key``): the same decision
    point, so their returns differ only by the choices made there and after. The return of turn t is
    ``sum_{t' >= t} discount^(t' - t) turn_reward[t']``.

    Args:
      turn_reward: ``[B, T]`` the environment's reward of each turn (0 after an episode's last turn).
      turn_key: ``[B, T] int`` the environment's key of the state each turn acted in (``TextEnv.state_key``);
        negative: no turn, or no key (such turns get 0).
      group_size: G (static); rows ``[g*G, (g+1)*G)`` are group g. Keys are compared within a group only.
      discount: per-turn discount of later rewards.
      normalize_std: divide by the standard deviation of the returns that share the state.
      eps: as in ``group_advantages``.

    Returns:
      ``[B, T] float32``: ``(R - mean) / (std + eps)`` over the turns that share the state, 0 for a turn whose
      state no other turn of the group reached, whose peers all returned the same, or that has no key.
    """
    turn_reward = jnp.asarray(turn_reward, jnp.float32)
    if turn_reward.ndim != 2 or jnp.shape(turn_key) != turn_reward.shape:
        raise ValueError(
            f"turn_advantages: turn_reward and turn_key must both be [B, T], got {turn_reward.shape} "
            f"and {jnp.shape(turn_key)}"
        )
    b, t = turn_reward.shape
    group_size = int(group_size)
    if group_size < 1 or b % group_size:
        raise ValueError(f"turn_advantages: batch size {b} is not a positive multiple of group_size {group_size}")
    later = jnp.arange(t)[None, :] >= jnp.arange(t)[:, None]  # [t, t']: t' >= t
    weights = jnp.where(later, jnp.float32(discount) ** (jnp.arange(t)[None, :] - jnp.arange(t)[:, None]), 0.0)
    returns = turn_reward @ weights.T  # [B, T]
    key = jnp.asarray(turn_key).reshape(-1, group_size * t)
    ret = returns.reshape(-1, group_size * t)
    has = key >= 0
    same = (key[:, :, None] == key[:, None, :]) & has[:, :, None] & has[:, None, :]  # [N, GT, GT]
    count = jnp.sum(same, axis=-1)
    # Exactly 0 where the peers' returns are all equal (as in `group_advantages`: no float residue).
    constant = jnp.max(jnp.where(same, ret[:, None, :], -jnp.inf), axis=-1) == jnp.min(
        jnp.where(same, ret[:, None, :], jnp.inf), axis=-1
    )
    mean = jnp.sum(jnp.where(same, ret[:, None, :], 0.0), axis=-1) / jnp.maximum(count, 1)
    centred = jnp.where(constant | (count < 2) | ~has, 0.0, ret - mean)
    if normalize_std:
        dev = jnp.where(same, ret[:, None, :] - mean[:, :, None], 0.0)
        std = jnp.sqrt(jnp.sum(dev * dev, axis=-1) / jnp.maximum(count, 1))
        centred = centred / (std + eps)
    return centred.reshape(b, t)


def token_advantages(advantages: Array, turn_adv: Array, turn_id: Array, mask: Array, coef: float) -> Array:
    """``[B, L]`` per-token advantages: the episode's ``advantages [B]`` plus ``coef`` times its turn's
    ``turn_adv [B, T]`` on the policy tokens (``turn_id [B, L]`` names each token's turn; 0 off ``mask``)."""
    t = turn_adv.shape[1]
    per_token = jnp.take_along_axis(turn_adv, jnp.clip(turn_id, 0, t - 1), axis=1)
    return jnp.where(mask, advantages[:, None] + jnp.float32(coef) * per_token, 0.0).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------------
def _check_inputs(name, logp, old_logp, advantages, mask, ref_logp, entropy, token_advantages=False):
    """Validates shapes (static, so errors surface at trace time) and casts to float32 / bool."""
    logp = jnp.asarray(logp)
    if logp.ndim != 2:
        raise ValueError(f"{name}: logp must be [B, L], got shape {logp.shape}")
    shape = logp.shape
    for arg_name, x in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("entropy", entropy)):
        if x is not None and jnp.shape(x) != shape:
            raise ValueError(f"{name}: {arg_name} must have the shape of logp {shape}, got {jnp.shape(x)}")
    adv_shape = jnp.shape(advantages)
    allowed = [(shape[0],)] + ([shape] if token_advantages else [])
    if adv_shape not in allowed:
        raise ValueError(f"{name}: advantages must have shape {' or '.join(map(str, allowed))}, got {adv_shape}")
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    return (f32(logp), f32(old_logp), f32(advantages), jnp.asarray(mask).astype(bool), f32(ref_logp), f32(entropy))


def _masked_log_ratio(logp, old_logp, mask):
    """``logp - old_logp`` with masked positions forced to 0 *before* any exp (no inf/NaN from padding)."""
    return jnp.where(mask, logp - old_logp, 0.0)


def _ppo_surrogate(ratio, adv, eps_low, eps_high):
    """PPO clipped surrogate as a loss: ``-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)``.

    Returns ``(loss, clipped)``; ``clipped`` marks where the clipped branch is strictly smaller, i.e. where the
    gradient is cut. Selecting with ``where`` (rather than ``minimum``) sends the full gradient to the unclipped
    branch on ties (inside the range both branches are equal and the clipped one is the identity anyway).
    """
    unclipped = ratio * adv
    clipped_obj = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    clipped = clipped_obj < unclipped
    return -jnp.where(clipped, clipped_obj, unclipped), clipped


def _as_token_weight(name, token_weight, mask):
    """``token_weight`` as float32 ``[B, L]``, gradient-free, 1 where ``mask`` is 0 (masked garbage is ignored)."""
    if jnp.shape(token_weight) != mask.shape:
        raise ValueError(
            f"{name}: token_weight must have the shape of logp {mask.shape}, got {jnp.shape(token_weight)}"
        )
    return jnp.where(mask, jax.lax.stop_gradient(jnp.asarray(token_weight, jnp.float32)), 1.0)


def _geometric_mean_per_sequence(weight, mask):
    """``exp(mean_{t in mask_i} log w_t)`` per row (1 for an empty row; 0 when any policy token has weight 0)."""
    lengths = jnp.sum(mask, axis=1)
    log_w = jnp.sum(jnp.where(mask, jnp.log(weight), 0.0), axis=1) / jnp.maximum(lengths, 1)
    return jnp.exp(log_w)


def _k3(logp, ref_logp, mask):
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (0 where masked)."""
    d = jnp.clip(jnp.where(mask, ref_logp - logp, 0.0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.where(mask, jnp.exp(d) - d - 1.0, 0.0)


def _token_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _masked_stats(values, valid):
    """mean/min/max of ``values`` over ``valid`` (any shape); 1.0 for all three when nothing is valid."""
    n = jnp.sum(valid)
    any_valid = n > 0
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(n, 1)
    vmin = jnp.min(jnp.where(valid, values, jnp.inf))
    vmax = jnp.max(jnp.where(valid, values, -jnp.inf))
    one = jnp.float32(1.0)
    return (jnp.where(any_valid, mean, one), jnp.where(any_valid, vmin, one), jnp.where(any_valid, vmax, one))


# Aggregators: turn a per-token quantity ``x [B, L]`` into a scalar, and report the normaliser.
def _agg_sequence_mean(x, mask):
    """Mean over each sequence's policy tokens, then mean over sequences with at least one policy token."""
    lengths = jnp.sum(mask, axis=1)
    per_seq = jnp.sum(jnp.where(mask, x, 0.0), axis=1) / jnp.maximum(lengths, 1)
    n_valid = jnp.sum(lengths > 0)
    return jnp.sum(per_seq) / jnp.maximum(n_valid, 1), n_valid.astype(jnp.float32)


def _agg_token_mean(x, mask):
    """Mean over all policy tokens of the batch (DAPO's token-level aggregation)."""
    n_tok = jnp.sum(mask)
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(n_tok, 1), n_tok.astype(jnp.float32)


def _make_agg_constant(max_length):
    def agg(x, mask):
        """Sum over tokens divided by the constant ``B * max_length`` (Dr. GRPO)."""
        denom = float(mask.shape[0] * (mask.shape[1] if max_length is None else max_length))
        return jnp.sum(jnp.where(mask, x, 0.0)) / denom, jnp.float32(denom)

    return agg


def _finish(
    policy_loss, agg, logp, old_logp, mask, ref_logp, kl_coef, entropy, entropy_coef, normalizer, ratio_stats, clip_frac
):
    """Adds KL / entropy terms (same aggregation as the policy term) and assembles the metrics."""
    loss = policy_loss
    d = _masked_log_ratio(logp, old_logp, mask)
    r_mean, r_min, r_max = ratio_stats
    metrics = {
        "policy_loss": policy_loss,
        "clip_frac": clip_frac,
        "ratio_mean": r_mean,
        "ratio_min": r_min,
        "ratio_max": r_max,
        "approx_kl": jax.lax.stop_gradient(_token_mean(0.5 * d * d, mask)),
        "normalizer": jax.lax.stop_gradient(normalizer),
    }
    if ref_logp is not None:
        k3 = _k3(logp, ref_logp, mask)
        loss = loss + kl_coef * agg(k3, mask)[0]
        metrics["kl"] = jax.lax.stop_gradient(_token_mean(k3, mask))
    elif kl_coef:
        raise ValueError("kl_coef is non-zero but ref_logp was not given")
    if entropy is not None:
        loss = loss - entropy_coef * agg(entropy, mask)[0]
        metrics["entropy"] = jax.lax.stop_gradient(_token_mean(entropy, mask))
    elif entropy_coef:
        raise ValueError("entropy_coef is non-zero but entropy was not given")
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    metrics["policy_loss"] = jax.lax.stop_gradient(metrics["policy_loss"])
    return loss.astype(jnp.float32), metrics


# ----------------------------------------------------------------------------------------------------------------
# GSPO (sequence level)
# ----------------------------------------------------------------------------------------------------------------
def gspo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    ref_logp=None,
    kl_coef: float = 0.0,
    entropy=None,
    entropy_coef: float = 0.0,
    token_weight=None,
):
    """GSPO: Group Sequence Policy Optimization (Zheng et al., 2025), sequence-level clipping.

    ``s_i = (pi(y_i) / pi_old(y_i)) ** (1/|y_i|) = exp(mean_{t in mask_i}(logp - old_logp))``,
    ``loss = mean_{i: |y_i| > 0} -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``.

    Written as ``s_i = sg(s_i) * exp(l_i - sg(l_i))`` with ``l_i`` the length-normalised sequence log-ratio:
    numerically ``s_i``, and its gradient is ``sg(s_i) * grad l_i = s_i * mean_t grad logp_{i,t}``, the paper's
    gradient (every token of a sequence gets the same weight ``s_i A_i / |y_i|``; clipping, when active,
    zeroes the whole sequence). ``s_i`` itself is computed from the mean log-ratio, never as a product of
    per-token ratios, so long sequences cannot overflow. Sequences with an empty mask are excluded from the mean
    and contribute exactly 0 (value and gradient). Defaults ``eps_low=3e-4, eps_high=4e-4`` are the paper's.

    ``token_weight`` (``w [B, L]``, gradient-free): sequence i's surrogate is multiplied by the geometric mean
    ``w_i = exp(mean_t log w_{i,t})``. GSPO's importance weight is itself a geometric mean of token ratios
    (``s_i = exp(mean_t log k_{i,t})``), so with TIS's factors ``w_t = min(k_t, C) / k_t`` the sequence's gradient
    weight becomes ``w_i s_i = exp(mean_t log min(k_t, C))``: the GSPO ratio of the *truncated* token ratios.
    Clipping is still decided on ``s_i``.
    """
    logp, old_logp, advantages, mask, ref_logp, entropy = _check_inputs(
        "gspo_loss", logp, old_logp, advantages, mask, ref_logp, entropy
    )
    lengths = jnp.sum(mask, axis=1)
    valid = lengths > 0
    log_s = jnp.sum(_masked_log_ratio(logp, old_logp, mask), axis=1) / jnp.maximum(lengths, 1)
    log_s = jnp.clip(log_s, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    s_value = jax.lax.stop_gradient(jnp.exp(log_s))
    s = s_value * jnp.exp(log_s - jax.lax.stop_gradient(log_s))  # stop-gradient form, see docstring
    per_seq, clipped = _ppo_surrogate(s, advantages, eps_low, eps_high)
    if token_weight is not None:
        per_seq = per_seq * _geometric_mean_per_sequence(_as_token_weight("gspo_loss", token_weight, mask), mask)
    n_valid = jnp.sum(valid)
    policy_loss = jnp.sum(jnp.where(valid, per_seq, 0.0)) / jnp.maximum(n_valid, 1)
    clip_frac = jnp.sum(clipped & valid) / jnp.maximum(n_valid, 1)
    return _finish(
        policy_loss,
        _agg_sequence_mean,
        logp,
        old_logp,
        mask,
        ref_logp,
        kl_coef,
        entropy,
        entropy_coef,
        n_valid.astype(jnp.float32),
        _masked_stats(s_value, valid),
        clip_frac,
    )


def gspo_token_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    ref_logp=None,
    kl_coef: float = 0.0,
    entropy=None,
    entropy_coef: float = 0.0,
    token_weight=None,
):
    """GSPO-token: ``s_{i,t} = sg(s_i) * exp(logp_{i,t} - sg(logp_{i,t}))``, token-level advantages allowed.

    ``advantages`` may be ``[B]`` (then this equals ``gspo_loss`` in value and gradient) or ``[B, L]``.
    Per token: ``-min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})``; aggregated as a mean over each sequence's policy
    tokens, then a mean over sequences with at least one policy token (the GSPO objective's ``1/G sum_i 1/|y_i|
    sum_t``). Numerically ``s_{i,t} = s_i``, so clipping is still decided per sequence (for a shared advantage);
    ratio metrics and ``clip_frac`` are over policy tokens. ``token_weight`` acts as in ``gspo_loss`` (every
    token of sequence i is multiplied by the sequence's geometric-mean weight), so that the two losses still agree
    for sequence advantages.
    """
    logp, old_logp, advantages, mask, ref_logp, entropy = _check_inputs(
        "gspo_token_loss", logp, old_logp, advantages, mask, ref_logp, entropy, token_advantages=True
    )
    adv = advantages if advantages.ndim == 2 else jnp.broadcast_to(advantages[:, None], logp.shape)
    lengths = jnp.sum(mask, axis=1)
    log_s = jnp.sum(_masked_log_ratio(logp, old_logp, mask), axis=1) / jnp.maximum(lengths, 1)
    log_s = jnp.clip(log_s, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    s_seq = jax.lax.stop_gradient(jnp.exp(log_s))
    safe_logp = jnp.where(mask, logp, 0.0)
    s_tok = s_seq[:, None] * jnp.exp(safe_logp - jax.lax.stop_gradient(safe_logp))
    per_tok, clipped = _ppo_surrogate(s_tok, adv, eps_low, eps_high)
    if token_weight is not None:
        seq_weight = _geometric_mean_per_sequence(_as_token_weight("gspo_token_loss", token_weight, mask), mask)
        per_tok = per_tok * seq_weight[:, None]
    policy_loss, normalizer = _agg_sequence_mean(per_tok, mask)
    clip_frac = _token_mean(clipped.astype(jnp.float32), mask)
    return _finish(
        policy_loss,
        _agg_sequence_mean,
        logp,
        old_logp,
        mask,
        ref_logp,
        kl_coef,
        entropy,
        entropy_coef,
        normalizer,
        _masked_stats(jax.lax.stop_gradient(s_tok), mask),
        clip_frac,
    )


# ----------------------------------------------------------------------------------------------------------------
# Token-level PPO-clip family: GRPO, Dr. GRPO, DAPO
# ----------------------------------------------------------------------------------------------------------------
def _token_ppo(
    name,
    agg,
    logp,
    old_logp,
    advantages,
    mask,
    eps_low,
    eps_high,
    ref_logp,
    kl_coef,
    entropy,
    entropy_coef,
    token_weight,
):
    logp, old_logp, advantages, mask, ref_logp, entropy = _check_inputs(
        name, logp, old_logp, advantages, mask, ref_logp, entropy, token_advantages=True
    )
    log_r = jnp.clip(_masked_log_ratio(logp, old_logp, mask), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_r)
    per_tok, clipped = _ppo_surrogate(
        ratio, advantages if advantages.ndim == 2 else advantages[:, None], eps_low, eps_high
    )
    if token_weight is not None:
        per_tok = per_tok * _as_token_weight(name, token_weight, mask)
    policy_loss, normalizer = agg(per_tok, mask)
    clip_frac = _token_mean(clipped.astype(jnp.float32), mask)
    return _finish(
        policy_loss,
        agg,
        logp,
        old_logp,
        mask,
        ref_logp,
        kl_coef,
        entropy,
        entropy_coef,
        normalizer,
        _masked_stats(jax.lax.stop_gradient(ratio), mask),
        clip_frac,
    )


def grpo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    ref_logp=None,
    kl_coef: float = 0.0,
    entropy=None,
    entropy_coef: float = 0.0,
    token_weight=None,
):
    """GRPO (Shao et al., 2024): token-level PPO clip ``r_t = exp(logp_t - old_t)``, symmetric eps 0.2.

    Aggregation as in GRPO: mean over each sequence's policy tokens, then mean over sequences with at least one
    policy token. Use with ``group_advantages(..., normalize_std=True)``.
    """
    return _token_ppo(
        "grpo_loss",
        _agg_sequence_mean,
        logp,
        old_logp,
        advantages,
        mask,
        eps_low,
        eps_high,
        ref_logp,
        kl_coef,
        entropy,
        entropy_coef,
        token_weight,
    )


def dr_grpo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    max_length: int | None = None,
    ref_logp=None,
    kl_coef: float = 0.0,
    entropy=None,
    entropy_coef: float = 0.0,
    token_weight=None,
):
    """Dr. GRPO ("GRPO done right", Liu et al., 2025): token-level PPO clip without the length and std biases.

    * Advantages must be computed WITHOUT std normalisation: ``group_advantages(r, G, normalize_std=False)``
      (see ``NORMALIZE_STD["dr_grpo"]``); this function takes the advantages as given.
    * Aggregation: the sum of per-token losses over all policy tokens divided by the constant
      ``B * max_length`` (no per-sequence ``1/|y_i|``). ``max_length`` should be the fixed generation budget;
      ``None`` uses the padded length L (fine when the padding length is fixed across steps).
    """
    return _token_ppo(
        "dr_grpo_loss",
        _make_agg_constant(max_length),
        logp,
        old_logp,
        advantages,
        mask,
        eps_low,
        eps_high,
        ref_logp,
        kl_coef,
        entropy,
        entropy_coef,
        token_weight,
    )


def dapo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ref_logp=None,
    kl_coef: float = 0.0,
    entropy=None,
    entropy_coef: float = 0.0,
    token_weight=None,
):
    """DAPO (Yu et al., 2025): token-level PPO with decoupled clip (eps_low 0.2, "clip-higher" eps_high 0.28)
    and token-level aggregation: the mean over ALL policy tokens of the batch (long sequences weigh more)."""
    return _token_ppo(
        "dapo_loss",
        _agg_token_mean,
        logp,
        old_logp,
        advantages,
        mask,
        eps_low,
        eps_high,
        ref_logp,
        kl_coef,
        entropy,
        entropy_coef,
        token_weight,
    )


def forking_token_mask(entropy, mask, top_k: int = 1, per_turn: bool = False):
    """``bool [B, L]``: in each sequence, its ``top_k`` policy tokens of highest entropy (ties may add more).

    The selection is not differentiated. In a tool call almost every token is fixed by the format; the few
    high-entropy "forking" tokens (here the chosen square) carry the decision (Wang et al. 2025, "Beyond the 80/20
    Rule: High-Entropy Minority Tokens Drive Effective RL for LLM Reasoning").

    ``per_turn``: instead, the ``top_k`` highest-entropy tokens of every *turn*, a turn being a contiguous run of
    ``mask`` (multi-turn episodes make one decision per turn).
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    mask = jnp.asarray(mask).astype(bool)
    e = jnp.where(mask, jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32)), -jnp.inf)
    if not per_turn:
        k = min(int(top_k), e.shape[1])
        kth = jnp.sort(e, axis=1)[:, -k][:, None]
        return mask & (e >= kth)
    b, length = mask.shape
    starts = mask & ~jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))
    turn = jnp.cumsum(starts, axis=1)  # 1.. on each turn's tokens
    seg = (jnp.arange(b)[:, None] * (length + 1) + jnp.where(mask, turn, 0)).reshape(-1)
    chosen = jnp.zeros((b * length,), bool)
    remaining = e.reshape(-1)
    for _ in range(int(top_k)):  # peel off each turn's current maximum k times
        best = jax.ops.segment_max(remaining, seg, num_segments=b * (length + 1))
        hit = (remaining == best[seg]) & (remaining > -jnp.inf)
        chosen = chosen | hit
        remaining = jnp.where(hit, -jnp.inf, remaining)
    return chosen.reshape(b, length) & mask


def with_forking_entropy_bonus(loss_fn: Callable, coef: float, top_k: int = 1, per_turn: bool = False) -> Callable:
    """Wraps a loss: adds ``- coef * H`` with H the entropy on each sequence's ``top_k`` forking tokens
    (``forking_token_mask``), averaged per sequence, then over sequences.

    Unlike ``entropy_coef`` (all policy tokens), this keeps the *decision* from collapsing without loosening the
    format tokens, whose entropy is ~0 and whose spread would only produce malformed calls. The wrapped loss
    reports ``forking_entropy``; it needs the ``entropy`` argument. An optional ``entropy_scale`` argument (a
    scalar or per-row array, all rows equal) multiplies ``coef``: a schedule fed through the batch
    (``trainer.make_train_step(loss_batch_keys=("entropy_scale",))``).
    """

    def fn(logp, old_logp, advantages, mask, *, entropy=None, entropy_scale=None, **kwargs):
        if entropy is None:
            raise ValueError("with_forking_entropy_bonus needs the per-token entropy")
        loss, metrics = loss_fn(logp, old_logp, advantages, mask, entropy=entropy, **kwargs)
        bonus, _ = _agg_sequence_mean(
            jnp.asarray(entropy, jnp.float32), forking_token_mask(entropy, mask, top_k, per_turn)
        )
        scale = 1.0 if entropy_scale is None else jnp.mean(jnp.asarray(entropy_scale, jnp.float32))
        metrics = dict(
            metrics,
            forking_entropy=jax.lax.stop_gradient(bonus),
            forking_entropy_coef=jnp.asarray(coef * scale, jnp.float32),
        )
        return loss - coef * scale * bonus, metrics

    return fn


def with_forking_kl(loss_fn: Callable, coef: float, top_k: int = 1, per_turn: bool = False) -> Callable:
    """Wraps a loss: adds ``+ coef * k3(logp, ref_logp)`` on each sequence's ``top_k`` forking tokens
    (``forking_token_mask`` by entropy), averaged per sequence, then over sequences.

    An anchor to a reference policy at the decision only. With the reference = the format warm start (uniform
    over legal squares), the k3 estimator's expected gradient, ``sum_a (pi(a) - pi_ref(a)) grad log pi(a)``, is
    that of the mass-covering KL(pi_ref || pi): it keeps every legal square in play, so a group keeps reward
    spread (and a gradient), without spreading mass onto malformed continuations the way an entropy bonus over the
    vocabulary does. Needs ``entropy`` and ``ref_logp``; ``entropy_scale`` (optional, as in
    ``with_forking_entropy_bonus``) multiplies ``coef``. ``per_turn``: every turn's ``top_k`` tokens
    (``forking_token_mask``). Reports ``forking_kl``.
    """

    def fn(logp, old_logp, advantages, mask, *, entropy=None, ref_logp=None, entropy_scale=None, **kwargs):
        if entropy is None or ref_logp is None:
            raise ValueError("with_forking_kl needs the per-token entropy and ref_logp")
        loss, metrics = loss_fn(logp, old_logp, advantages, mask, entropy=entropy, ref_logp=ref_logp, **kwargs)
        sel = forking_token_mask(entropy, mask, top_k, per_turn)
        kl, _ = _agg_sequence_mean(_k3(jnp.asarray(logp, jnp.float32), jnp.asarray(ref_logp, jnp.float32), sel), sel)
        scale = 1.0 if entropy_scale is None else jnp.mean(jnp.asarray(entropy_scale, jnp.float32))
        metrics = dict(
            metrics, forking_kl=jax.lax.stop_gradient(kl), forking_kl_coef=jnp.asarray(coef * scale, jnp.float32)
        )
        return loss + coef * scale * kl, metrics

    return fn


# ----------------------------------------------------------------------------------------------------------------
# Rollout / train mismatch corrections
# ----------------------------------------------------------------------------------------------------------------
# The rollout (decode step, bf16 cache, its own MoE dispatch) and the train forward (chunked prefill) are different
# programs, so the train forward's log-prob of a sampled token is not the one it was sampled with. Here ``old_logp``
# IS the rollout's behaviour log-prob, so the losses' ratio ``r_t = exp(logp_t - old_t)`` already carries the
# mismatch ``k_t = pi_train(y_t) / pi_rollout(y_t) = exp(sg(logp_t) - old_t)`` as an *untruncated* importance
# weight (at the first update of a step, r_t == k_t). The wrappers below bound or drop that weight per token.
# At later minibatches of a step (``num_minibatches`` > 1), ``k_t`` also holds the policy's own change since the
# rollout: they then bound the whole importance weight the loss applies. Clipping keeps acting on ``r_t`` (a
# separately recomputed train-forward ``old_logp`` would be needed to clip the update alone).
def _mismatch_log_ratio(logp, old_logp, mask):
    """``log k_t = sg(logp_t) - old_t`` on policy tokens, 0 elsewhere (float32, never differentiated)."""
    logp = jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
    return _masked_log_ratio(logp, jnp.asarray(old_logp, jnp.float32), mask)


def with_tis(loss_fn: Callable, cap: float) -> Callable:
    """Wraps a loss with token-level truncated importance sampling (TIS): each token's importance weight
    ``k_t = pi_train / pi_rollout`` is truncated to ``min(k_t, cap)``, with no gradient through the weight.

    Because the wrapped loss's ratio already multiplies token t's policy gradient by ``k_t`` (see above), the
    wrapper passes the gradient-free factor ``token_weight_t = min(k_t, cap) / k_t`` (1 when ``k_t <= cap``) into
    the loss; multiplying by ``min(k_t, cap)`` itself would count the ratio twice (``k_t * min(k_t, cap)``).
    Per loss, on the unclipped branch (``N`` the loss's normaliser):

    * GRPO / Dr. GRPO / DAPO: ``d loss / d logp_t = -min(k_t, cap) * A_i / N``, the TIS policy gradient;
    * GSPO / GSPO-token: the sequence ratio ``s_i = exp(mean_t log k_t)`` becomes
      ``exp(mean_t log min(k_t, cap))``, GSPO's length-normalised ratio of the truncated token ratios, so every
      token of sequence i gets ``-exp(mean_t log min(k_t, cap)) * A_i / (|y_i| N)`` (see ``gspo_loss``). A geometric
      rather than an arithmetic mean of the factors keeps GSPO's own definition of a sequence's weight and its
      damping of single outliers; clipping stays decided on the untruncated ratio.

    ``cap`` must be >= 1 (a cap below 1 would down-weight tokens the two programs agree on); ``inf`` is the
    identity. The KL / entropy terms are not weighted. An incoming ``token_weight`` is multiplied in, so TIS
    composes with ``with_icepop`` (either order) and with the forking-token wrappers. Metrics, over the policy
    tokens it sees: ``tis_weight_mean`` (mean of ``min(k_t, cap)``) and ``tis_clipped_frac`` (share with
    ``k_t > cap``).
    """
    cap = float(cap)
    if not cap >= 1.0:  # also rejects NaN
        raise ValueError(f"with_tis: cap must be >= 1 (inf = no truncation), got {cap}")

    def fn(logp, old_logp, advantages, mask, *, token_weight=None, **kwargs):
        policy = jnp.asarray(mask).astype(bool)
        log_k = jnp.clip(_mismatch_log_ratio(logp, old_logp, policy), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k = jnp.exp(log_k)
        truncated = policy & (k > cap)
        # Exactly 1.0 wherever nothing is truncated (cap = inf included), so a neutral TIS is bit-identical.
        factor = jnp.where(truncated, cap / k, 1.0)
        weight = factor if token_weight is None else jnp.asarray(token_weight, jnp.float32) * factor
        loss, metrics = loss_fn(logp, old_logp, advantages, mask, token_weight=weight, **kwargs)
        metrics = dict(
            metrics,
            tis_weight_mean=jax.lax.stop_gradient(_token_mean(jnp.minimum(k, cap), policy)),
            tis_clipped_frac=_token_mean(truncated.astype(jnp.float32), policy),
        )
        return loss, metrics

    return fn


def with_icepop(loss_fn: Callable, low: float = 0.5, high: float = 2.0) -> Callable:
    """Wraps a loss with IcePop's masking: policy tokens whose mismatch ratio ``k_t = exp(sg(logp_t) - old_t)``
    lies outside ``[low, high]`` are removed from the loss's mask.

    A removed token is treated exactly like a non-policy token by the wrapped loss: it leaves the policy term, the
    ratio (GSPO: the sequence's geometric mean is over the kept tokens), the KL / entropy terms, the statistics and
    the normaliser (so micro-batches still combine exactly); a sequence with no kept token drops out. The IcePop
    objective (Ling team, 2025) weights kept tokens by ``k_t``: the wrapped loss's ratio already does, so masking
    alone gives its gradient on the unclipped branch (its clip acts on the train-vs-train ratio, here on ``r_t``),
    and ``with_tis`` on top also bounds the kept weights. Unlike the paper's ``1 / |y_i|``, per-sequence means are
    over the kept tokens (a zero weight has no place in GSPO's geometric mean).

    ``0 <= low < 1 < high`` (``high`` may be ``inf``); ``[0, inf]`` is the identity. Metrics, over the policy
    tokens it sees: ``icepop_masked_frac`` and ``icepop_masked_count`` (a count: summed over micro-batches and
    minibatches by ``reno_jax.rl.trainer``).
    """
    low, high = float(low), float(high)
    if not (0.0 <= low < 1.0 < high):
        raise ValueError(
            f"with_icepop: need 0 <= low < 1 < high so that on-policy tokens are kept, got low={low}, high={high}"
        )
    # Compared in log space: no exp of an unbounded log-ratio, and low = 0 / high = inf are exact.
    log_low = -jnp.inf if low == 0.0 else math.log(low)
    log_high = math.log(high)

    def fn(logp, old_logp, advantages, mask, **kwargs):
        policy = jnp.asarray(mask).astype(bool)
        log_k = _mismatch_log_ratio(logp, old_logp, policy)
        kept = policy & (log_k >= log_low) & (log_k <= log_high)
        dropped = policy & ~kept
        loss, metrics = loss_fn(logp, old_logp, advantages, kept, **kwargs)
        n_dropped = jnp.sum(dropped).astype(jnp.float32)
        metrics = dict(
            metrics,
            icepop_masked_count=n_dropped,
            icepop_masked_frac=n_dropped / jnp.maximum(jnp.sum(policy), 1).astype(jnp.float32),
        )
        return loss, metrics

    return fn


LOSSES: Mapping[str, Callable] = {
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "grpo": grpo_loss,
    "dr_grpo": dr_grpo_loss,
    "dapo": dapo_loss,
}

# Whether each loss's paper scales group advantages by the group std (the ``normalize_std`` argument of
# ``group_advantages``): Dr. GRPO removes it, the others keep it.
NORMALIZE_STD: Mapping[str, bool] = {
    "gspo": True,
    "gspo_token": True,
    "grpo": True,
    "dr_grpo": False,
    "dapo": True,
}


def get_loss(name: str) -> Callable:
    """Looks a loss up in ``LOSSES`` with a clear error for unknown names."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; available: {sorted(LOSSES)}") from None
