"""reno_jax.rl.policy: the policy log-prob function's entropy options."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.models import ling3
from reno_jax.rl import policy, trainer
from reno_jax.rl.batch import TrainBatch


def test_entropy_top_k():
    cfg = ling3.tiny_test_config(num_hidden_layers=2)
    params = ling3.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, cfg.vocab_size)
    batch = TrainBatch(
        tokens=tokens,
        loss_mask=jnp.ones(tokens.shape, bool),
        old_logp=jnp.zeros(tokens.shape),
        advantages=jnp.zeros(tokens.shape[:1]),
    )
    out = jax.jit(policy.make_logp_fn(cfg))(params, batch)
    assert isinstance(out, trainer.PolicyOutput) and out.routing is None  # no recorded routing in the batch
    logp_full, ent_full = out.logp, out.entropy
    out_all = jax.jit(policy.make_logp_fn(cfg, entropy_top_k=cfg.vocab_size))(params, batch)
    logp_all, ent_all = out_all.logp, out_all.entropy
    np.testing.assert_allclose(np.asarray(ent_all), np.asarray(ent_full), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(logp_all), np.asarray(logp_full))  # log-probs never change
    ent3 = jax.jit(policy.make_logp_fn(cfg, entropy_top_k=3))(params, batch).entropy
    assert jax.jit(policy.make_logp_fn(cfg, with_entropy=False))(params, batch).entropy is None
    logits, _ = jax.jit(lambda p, t: ling3.forward(p, cfg, t))(params, tokens)
    top = np.sort(np.asarray(logits[:, :-1], np.float64), axis=-1)[..., -3:]
    p = np.exp(top - top.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(np.asarray(ent3)[:, 1:], want, rtol=1e-4)
    assert np.all(np.asarray(ent3)[:, 1:] <= np.log(3) + 1e-5)


def _eqn_shapes(jaxpr):
    """Every output shape of every equation of a closed jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqn_shapes(sub)


@pytest.mark.parametrize("shared", [False, True])
def test_chunked_logits_match_and_never_hold_the_full_logits(shared):
    from reno_jax.rl import shared_prefix

    cfg = ling3.tiny_test_config(num_hidden_layers=2)
    params = ling3.init_params(cfg, jax.random.PRNGKey(0))
    b, t, s = 4, 11, 5  # t - 1 = 10 positions: chunks of 4 leave a partial last chunk
    tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t), 0, cfg.vocab_size)
    if shared:
        tokens = tokens.at[:, :s].set(tokens[0, :s])
    valid = jnp.arange(t)[None] < jnp.array([t, t - 2, t, 7])[:, None]
    batch = TrainBatch(
        tokens=tokens, valid=valid, loss_mask=valid, old_logp=jnp.zeros(tokens.shape), advantages=jnp.zeros((b,))
    )
    if shared:
        batch = shared_prefix.split_shared_prefix(batch, s)
    w = jax.random.normal(jax.random.PRNGKey(2), batch.tokens.shape)

    def run(chunk, top_k):
        fn = policy.make_logp_fn(cfg, group_size=b if shared else None, entropy_top_k=top_k, logits_chunk=chunk)

        def objective(p):
            out = fn(p, batch)
            return jnp.sum(jnp.where(batch.valid, out.logp * w + 0.1 * out.entropy, 0.0)), out

        return jax.jit(jax.grad(objective, has_aux=True))(params), jax.make_jaxpr(objective)(params)

    for top_k in (0, 3):
        (g0, out0), _ = run(0, top_k)
        (g4, out4), jaxpr = run(4, top_k)
        m = np.asarray(batch.valid)
        np.testing.assert_allclose(np.asarray(out4.logp)[m], np.asarray(out0.logp)[m], atol=1e-5)
        np.testing.assert_allclose(np.asarray(out4.entropy)[m], np.asarray(out0.entropy)[m], atol=1e-5)
        for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g4)):
            np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=1e-5 * (float(jnp.max(jnp.abs(a))) + 1))
        vocab_arrays = [sh for sh in _eqn_shapes(jaxpr.jaxpr) if sh and sh[-1] == cfg.vocab_size]
        assert vocab_arrays and all(len(sh) == 3 and sh[1] == 4 for sh in vocab_arrays if len(sh) == 3), (
            vocab_arrays
        )  # every [., ., V] array is one chunk of 4 positions


def test_chunked_logits_soft_targets():
    cfg = ling3.tiny_test_config(num_hidden_layers=2)
    params = ling3.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, cfg.vocab_size)
    weights = jax.random.uniform(jax.random.PRNGKey(3), (2, 9, 3)) * (jnp.arange(9) % 2 == 0)[None, :, None]
    batch = TrainBatch(
        tokens=tokens,
        loss_mask=jnp.ones(tokens.shape, bool),
        old_logp=jnp.zeros(tokens.shape),
        advantages=jnp.zeros((2,)),
        soft_target_ids=jnp.array([[1, 2, 3], [4, 5, 6]]),
        soft_target_weights=weights,
    )
    full = jax.jit(policy.make_logp_fn(cfg, with_entropy=False))(params, batch)
    chunked = jax.jit(policy.make_logp_fn(cfg, with_entropy=False, logits_chunk=3))(params, batch)
    assert chunked.entropy is None
    np.testing.assert_allclose(np.asarray(chunked.logp), np.asarray(full.logp), atol=1e-5)
    with pytest.raises(ValueError, match="logits_chunk"):
        policy.make_logp_fn(cfg, logits_chunk=-1)
