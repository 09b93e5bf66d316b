"""Shared-prefix scoring equals row-wise scoring: log-probs, entropies, gradients and a whole train step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from reno_jax.models import ling3
from reno_jax.rl import losses, policy, shared_prefix, trainer
from reno_jax.rl.batch import TrainBatch

N, G, S, C = 3, 4, 10, 7
S0 = 4  # leading tokens every row shares (a system prompt), for the batch-wide level


@pytest.fixture(scope="module")
def setup():
    cfg = ling3.tiny_test_config(num_hidden_layers=2)  # KDA + dense MLP, MLA + MoE: every layer kind and cache
    params = ling3.init_params(cfg, jax.random.PRNGKey(0))
    prefix = jax.random.randint(jax.random.PRNGKey(1), (N, S), 0, cfg.vocab_size)
    prefix = prefix.at[:, :S0].set(prefix[0, :S0])
    cont = jax.random.randint(jax.random.PRNGKey(2), (N * G, C), 0, cfg.vocab_size)
    tokens = jnp.concatenate([jnp.repeat(prefix, G, 0), cont], 1)
    lengths = jnp.array([C, C - 2, 3, 1] * N)  # ragged continuations (left-aligned valid tokens)
    valid = jnp.arange(S + C)[None] < (S + lengths)[:, None]
    loss_mask = valid & (jnp.arange(S + C)[None] >= S)
    batch = TrainBatch(
        tokens=tokens,
        valid=valid,
        loss_mask=loss_mask,
        old_logp=jnp.full((N * G, S + C), -4.0),
        advantages=jax.random.normal(jax.random.PRNGKey(3), (N * G,)),
    )
    return cfg, params, batch


def test_split_layout(setup):
    _, _, batch = setup
    sb = shared_prefix.split_shared_prefix(batch, S)
    assert isinstance(sb, TrainBatch) and sb.shared_prefix and not batch.shared_prefix
    assert sb.prefix_tokens.shape == (N * G, S)
    for k in ("tokens", "valid", "loss_mask", "old_logp"):
        assert getattr(sb, k).shape == (N * G, C)
    assert sb.advantages.shape == (N * G,)
    # No common part, no routing: those fields stay None (unset fields are not invented by the cut).
    assert sb.common_tokens is None and sb.prefix_routing is None and sb.routing is None and sb.ref_logp is None
    with pytest.raises(ValueError, match="prefix_len"):
        shared_prefix.split_shared_prefix(batch, S + C)
    sb = shared_prefix.split_shared_prefix(batch, S, S0)
    assert sb.common_tokens.shape == (N * G, S0) and sb.prefix_tokens.shape == (N * G, S - S0)
    np.testing.assert_array_equal(np.concatenate([sb.common_tokens, sb.prefix_tokens, sb.tokens], 1), batch.tokens)
    with pytest.raises(ValueError, match=f"common_len must be in 0..prefix_len = {S}, got {S + 1}"):
        shared_prefix.split_shared_prefix(batch, S, S + 1)
    sb = shared_prefix.split_shared_prefix(batch, S, S)  # the common part alone: an empty group part
    assert sb.prefix_tokens.shape == (N * G, 0) and sb.common_tokens.shape == (N * G, S)
    soft = batch.replace(
        soft_target_ids=jnp.zeros((N * G, 2), jnp.int32), soft_target_weights=jnp.zeros((N * G, S + C, 2))
    )
    cut = shared_prefix.split_shared_prefix(soft, S)  # soft targets are per token: cut as the tokens are
    assert cut.soft_target_weights.shape == (N * G, C, 2) and cut.soft_target_ids.shape == (N * G, 2)


def test_common_prefix_length_counts_leading_columns_shared_by_every_row(setup):
    from reno_jax.rl import learner

    _, _, batch = setup
    assert int(learner.common_prefix_length(batch.tokens)) == S0
    assert int(learner.common_prefix_length(batch.tokens[:G])) == S  # one group: its whole prompt
    assert int(learner.common_prefix_length(jnp.zeros((3, 5), jnp.int32))) == 5


@pytest.mark.parametrize("common", [0, S0])
def test_logp_entropy_and_grads_match_rowwise(setup, common):
    cfg, params, batch = setup
    fn = policy.make_logp_fn(cfg, group_size=G)
    sb = shared_prefix.split_shared_prefix(batch, S, common)
    w = jax.random.normal(jax.random.PRNGKey(4), (N * G, C))
    mask = batch.valid[:, S:]

    def weighted(p, b, start):  # (sum of w * logp over the continuation, (logp, entropy)): one program per path
        out = fn(p, b)
        lp, ent = out.logp, out.entropy
        assert out.routing is None  # no recorded routing in the batch
        return jnp.sum(jnp.where(mask, lp[:, start:] * w, 0.0)), (lp, ent)

    g_full, (lp_full, ent_full) = jax.jit(jax.grad(lambda p: weighted(p, batch, S), has_aux=True))(params)
    g_sh, (lp_sh, ent_sh) = jax.jit(jax.grad(lambda p: weighted(p, sb, 0), has_aux=True))(params)
    m = np.asarray(batch.valid[:, S:])
    np.testing.assert_allclose(np.asarray(lp_sh)[m], np.asarray(lp_full[:, S:])[m], atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent_sh)[m], np.asarray(ent_full[:, S:])[m], atol=2e-5)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_sh)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5 * (float(jnp.max(jnp.abs(a))) + 1e-6))


@pytest.mark.parametrize("common", [0, S0])
def test_train_step_matches_rowwise(setup, common):
    """One GSPO step with 3 micro-batches (whole groups each): same loss, metrics and new params."""
    cfg, params, batch = setup
    opt = optax.sgd(0.1)  # Adam's m / sqrt(v) would amplify rounding differences of near-zero gradients
    loss_fn = functools.partial(losses.gspo_loss, entropy_coef=0.01)
    step = trainer.make_train_step(
        policy.make_logp_fn(cfg, group_size=G), loss_fn, opt, num_microbatches=N, donate=False
    )
    state = trainer.create_train_state(params, opt, 0)
    s_full, m_full = step(state, batch)
    s_sh, m_sh = step(state, shared_prefix.split_shared_prefix(batch, S, common))
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(m_sh[k]), float(m_full[k]), rtol=1e-4)
    for a, b in zip(jax.tree.leaves(s_full.params), jax.tree.leaves(s_sh.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_needs_group_size(setup):
    cfg, params, batch = setup
    with pytest.raises(ValueError, match="group_size"):
        policy.make_logp_fn(cfg)(params, shared_prefix.split_shared_prefix(batch, S))
    with pytest.raises(ValueError, match="whole number of groups"):
        policy.make_logp_fn(cfg, group_size=5)(params, shared_prefix.split_shared_prefix(batch, S))
