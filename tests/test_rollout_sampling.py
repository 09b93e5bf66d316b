"""Tests for reno_jax.rollout.sampling (pure fp32 sampling functions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.rollout import sampling

# Jitted entry point (eager dispatch of many small ops is slower than one compile on a busy CPU); XLA's backend
# optimisations only cost compile time at these sizes and do not change semantics.
_FAST = {"xla_backend_optimization_level": 0}
_sample = jax.jit(sampling.sample, static_argnames=("temperature", "top_k", "top_p", "greedy"), compiler_options=_FAST)


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _np_reference_dist(logits, temperature, top_k, top_p):
    """Independent numpy reference of the sampling distribution (probabilities, float64)."""
    x = np.asarray(logits, np.float64) / temperature
    out = []
    for row in x:
        keep = np.ones_like(row, bool)
        if 0 < top_k < row.size:
            kth = np.sort(row)[::-1][top_k - 1]
            keep &= row >= kth
        p = np.where(keep, np.exp(row - row[keep].max()), 0.0)
        p /= p.sum()
        if top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = 0.0
            kept = np.zeros_like(keep)
            for i in order:
                if cum >= top_p:
                    break
                kept[i] = True
                cum += p[i]
            p = np.where(kept, p, 0.0)
            p /= p.sum()
        out.append(p)
    return np.stack(out)


def _logits(key, b=4, v=12, scale=2.0):
    return jax.random.normal(key, (b, v), jnp.float32) * scale


def test_temperature_one_logp_is_model_log_softmax():
    logits = _logits(jax.random.key(0), b=8, v=50).astype(jnp.bfloat16)
    tok, logp = _sample(jax.random.key(1), logits)
    assert tok.dtype == jnp.int32 and logp.dtype == jnp.float32 and tok.shape == (8,)
    ref = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[jnp.arange(8), tok]
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(ref))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.6), (0.8, 5, 0.8)])
def test_distribution_matches_reference(temperature, top_k, top_p):
    logits = _logits(jax.random.key(2), b=3, v=10)
    ref = _np_reference_dist(np.asarray(logits), temperature, top_k, top_p)
    got = np.exp(np.asarray(sampling.process_logits(logits, temperature, top_k, top_p), np.float64))
    got /= got.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, ref, atol=1e-6)

    # Empirical frequencies of many samples follow the reference, and logp is the log of the sampled prob.
    n = 4000
    keys = jax.random.split(jax.random.key(3), n)
    draw = jax.jit(jax.vmap(lambda k: sampling.sample(k, logits, temperature, top_k, top_p)), compiler_options=_FAST)
    toks, logps = draw(keys)
    toks, logps = np.asarray(toks), np.asarray(logps)
    for b in range(3):
        freq = np.bincount(toks[:, b], minlength=10) / n
        assert np.all(freq[ref[b] == 0] == 0), "sampled a token the filters removed"
        np.testing.assert_allclose(freq, ref[b], atol=0.04)
        np.testing.assert_allclose(logps[:, b], np.log(ref[b][toks[:, b]]), atol=1e-5)


def test_greedy_is_argmax_with_model_logp():
    logits = _logits(jax.random.key(4), b=5, v=33)
    tok, logp = _sample(jax.random.key(0), logits, greedy=True, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
    np.testing.assert_allclose(
        np.asarray(logp), _np_log_softmax(np.asarray(logits))[np.arange(5), np.asarray(tok)], atol=1e-6
    )


def test_per_row_keys_make_rows_independent():
    logits = _logits(jax.random.key(5), b=6, v=40)
    keys = jax.random.split(jax.random.key(6), 6)
    tok, logp = _sample(keys, logits, temperature=0.9, top_k=7, top_p=0.9)
    # Change every other row's logits and key: row 0 must not move.
    logits2 = logits.at[1:].set(-logits[1:])
    keys2 = keys.at[1:].set(jax.random.split(jax.random.key(7), 5))
    tok2, logp2 = _sample(keys2, logits2, temperature=0.9, top_k=7, top_p=0.9)
    assert int(tok[0]) == int(tok2[0]) and float(logp[0]) == float(logp2[0])
    # A single row alone gives the same draw (independent of the batch size).
    tok1, logp1 = _sample(keys[:1], logits[:1], temperature=0.9, top_k=7, top_p=0.9)
    assert int(tok1[0]) == int(tok[0]) and float(logp1[0]) == float(logp[0])
    # Raw uint32 keys are accepted too.
    raw = jax.random.key_data(keys)
    tok3, _ = _sample(raw, logits, temperature=0.9, top_k=7, top_p=0.9)
    assert tok3.shape == (6,)


def test_forced_tokens_get_their_logp():
    logits = _logits(jax.random.key(8), b=4, v=20)
    forced = jnp.array([3, -1, 19, -1], jnp.int32)
    tok, logp = _sample(jax.random.key(9), logits, forced=forced)
    assert int(tok[0]) == 3 and int(tok[2]) == 19
    ref = _np_log_softmax(np.asarray(logits))[np.arange(4), np.asarray(tok)]
    np.testing.assert_allclose(np.asarray(logp), ref, atol=1e-6)
    # Forced token outside the top-k gets -inf under the truncated distribution.
    low = int(np.argmin(np.asarray(logits)[0]))
    _, logp_k = _sample(jax.random.key(9), logits, top_k=2, forced=jnp.array([low, -1, -1, -1]))
    assert np.isneginf(float(logp_k[0]))


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=0.0), dict(temperature=-1.0), dict(top_k=-1), dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.2)],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        sampling.sample(jax.random.key(0), jnp.zeros((2, 5)), **kwargs)


def test_bad_shapes_raise():
    with pytest.raises(ValueError):
        sampling.sample(jax.random.key(0), jnp.zeros((5,)))
    with pytest.raises(ValueError):
        sampling.sample(jax.random.split(jax.random.key(0), 3), jnp.zeros((2, 5)))


def test_argmax_first_matches_argmax_with_ties():
    x = jnp.array([[1.0, 3.0, 3.0, -jnp.inf], [-jnp.inf, -jnp.inf, 0.5, 0.5], [2.0, 1.0, 0.0, 2.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(sampling.argmax_first(x)), np.argmax(np.asarray(x), -1))
    y = jax.random.normal(jax.random.key(0), (16, 300))
    np.testing.assert_array_equal(np.asarray(sampling.argmax_first(y)), np.argmax(np.asarray(y), -1))
