"""Token sampling: temperature, top-k, top-p (nucleus) and greedy, as pure fp32 functions.

All knobs (`temperature`, `top_k`, `top_p`, `greedy`) are *static* Python values: they select the code path that
`jax.jit` traces, so changing them recompiles. Logits may be any float dtype; everything here is computed in fp32.

Order of the transforms (the usual one): divide by the temperature, keep the top-k logits, then keep the smallest
set of tokens whose probability (under the temperature/top-k distribution) reaches `top_p`. Tokens that are dropped
get logit `-inf`. The returned log-prob is that of the sampled token under exactly this final distribution:

* with `temperature=1, top_k=0, top_p=1` it is `log_softmax(logits)[token]`, i.e. exactly the model's own
  log-probability, which is what GSPO needs as `old_logp` / behaviour log-prob;
* with truncation or another temperature it is the log-prob under the *behaviour* distribution (for importance
  weights against that distribution), not under the model;
* with `greedy=True` the sampling distribution is a point mass (log-prob 0 carries no information), so the model's
  temperature-1 log-probability `log_softmax(logits)[argmax]` is returned instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def validate_sampling_args(temperature: float, top_k: int, top_p: float, greedy: bool) -> None:
    """Raises `ValueError` for knob values that have no meaning (called at trace time, values are static)."""
    if not greedy and not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 when sampling (use greedy=True for argmax), got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")


def apply_top_k(logits: jax.Array, top_k: int) -> jax.Array:
    """Keeps the `top_k` largest logits of each row and sets the rest to -inf.

    Args:
      logits: `[..., V]` float32.
      top_k: static; 0 or >= V disables the filter. Logits tied with the k-th largest are all kept.
    Returns:
      `[..., V]` float32.
    """
    vocab = logits.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return logits
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, _NEG_INF)


def apply_top_p(logits: jax.Array, top_p: float) -> jax.Array:
    """Nucleus filter: keeps the smallest prefix of tokens (by decreasing probability) whose mass reaches `top_p`.

    The most likely token is always kept. Tokens tied with the last kept logit are kept too (the cut is a logit
    threshold), so the kept mass is >= top_p.

    Args:
      logits: `[..., V]` float32 (may already contain -inf).
      top_p: static; 1.0 disables the filter.
    Returns:
      `[..., V]` float32.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumulative mass
    keep_sorted = mass_before < top_p  # index 0 always kept (mass_before = 0)
    num_kept = jnp.sum(keep_sorted, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)
    return jnp.where(logits >= threshold, logits, _NEG_INF)


def process_logits(logits: jax.Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Returns the logits of the sampling distribution: fp32, temperature-scaled, top-k and top-p filtered.

    Args:
      logits: `[..., V]` any float dtype.
    Returns:
      `[..., V]` float32; `log_softmax` of it is the sampling distribution.
    """
    logits = logits.astype(jnp.float32)
    if temperature != 1.0:
        logits = logits / jnp.float32(temperature)
    logits = apply_top_k(logits, top_k)
    logits = apply_top_p(logits, top_p)
    return logits


def argmax_first(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, -1)` for finite rows (first index of the maximum), as int32.

    Written as a max followed by a min over matching indices: two plain reductions that XLA:CPU vectorises, while
    a fused `gumbel + argmax` variadic reduction is ~3x slower there (it dominated the tiny model's decode step).
    A row whose maximum is NaN returns the last index.
    """
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    idx = jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(idx, v - 1).astype(jnp.int32)


def _is_batched_key(key: jax.Array, batch: int) -> bool:
    """True when `key` holds one PRNG key per row (typed `[B]` keys or raw `[B, 2]` uint32 keys)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        ndim = key.ndim
    else:
        ndim = key.ndim - 1
    if ndim == 0:
        return False
    if ndim == 1 and key.shape[0] == batch:
        return True
    raise ValueError(f"key must be a single PRNG key or one key per row (batch {batch}); got shape {key.shape}")


def sample(
    key: jax.Array,
    logits: jax.Array,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    forced: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row and returns its log-prob under the distribution sampled from.

    Args:
      key: a single PRNG key, or one key per row (`[B]` typed or `[B, 2]` raw). With per-row keys a row's sample
        depends only on its own key and logits (rows are independent of each other and of the batch size).
      logits: `[B, V]` any float dtype (computed in float32).
      temperature, top_k, top_p, greedy: static knobs, see the module docstring.
      forced: optional `[B] int32`; rows with `forced >= 0` take that token instead of a sample (teacher forcing),
        and get its log-prob under the same sampling distribution (`-inf` if the filters dropped it).
    Returns:
      `token [B] int32`, `logp [B] float32`.
    """
    validate_sampling_args(temperature, top_k, top_p, greedy)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    batch = logits.shape[0]
    if greedy:
        # Point-mass distribution: report the model's own (temperature-1, untruncated) log-prob instead of 0.
        dist_logits = logits.astype(jnp.float32)
        token = argmax_first(dist_logits)
    else:
        dist_logits = process_logits(logits, temperature, top_k, top_p)
        vocab = dist_logits.shape[-1]
        # Gumbel-max: argmax(logits + G), G ~ Gumbel(0, 1) i.i.d. is an exact sample of softmax(logits).
        if _is_batched_key(key, batch):
            noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(key)
        else:
            noise = jax.random.gumbel(key, dist_logits.shape, jnp.float32)
        token = argmax_first(dist_logits + noise)
    if forced is not None:
        token = jnp.where(forced >= 0, forced.astype(jnp.int32), token)
    logp_all = jax.nn.log_softmax(dist_logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, token[:, None], axis=-1)[:, 0]
    return token, logp
