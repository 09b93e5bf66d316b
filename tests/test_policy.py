"""reno_jax.rl.policy: the policy log-prob function's entropy options."""

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.models import ling3
from reno_jax.rl import policy, trainer
from reno_jax.rl.batch import TrainBatch


def test_entropy_top_k():
    cfg = ling3.tiny_test_config(num_hidden_layers=2)
    params = ling3.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, cfg.vocab_size)
    batch = TrainBatch(tokens=tokens, loss_mask=jnp.ones(tokens.shape, bool), old_logp=jnp.zeros(tokens.shape),
                       advantages=jnp.zeros(tokens.shape[:1]))
    out = jax.jit(policy.make_logp_fn(cfg))(params, batch)
    assert isinstance(out, trainer.PolicyOutput) and out.routing is None  # no recorded routing in the batch
    logp_full, ent_full = out.logp, out.entropy
    logp_all, ent_all, _ = jax.jit(policy.make_logp_fn(cfg, entropy_top_k=cfg.vocab_size))(params, batch)
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
