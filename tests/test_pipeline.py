"""reno_jax.pipeline: the policy log-prob function's entropy options."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax import pipeline
from reno_jax.models import ling3


def test_entropy_top_k():
    cfg = ling3.tiny_test_config(num_hidden_layers=2)
    params = ling3.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, cfg.vocab_size)
    batch = {"tokens": tokens}
    logp_full, ent_full = jax.jit(pipeline.make_logp_fn(cfg))(params, batch)
    logp_all, ent_all = jax.jit(pipeline.make_logp_fn(cfg, entropy_top_k=cfg.vocab_size))(params, batch)
    np.testing.assert_allclose(np.asarray(ent_all), np.asarray(ent_full), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(logp_all), np.asarray(logp_full))  # log-probs never change
    _, ent3 = jax.jit(pipeline.make_logp_fn(cfg, entropy_top_k=3))(params, batch)
    logits, _ = jax.jit(lambda p, t: ling3.forward(p, cfg, t))(params, tokens)
    top = np.sort(np.asarray(logits[:, :-1], np.float64), axis=-1)[..., -3:]
    p = np.exp(top - top.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(np.asarray(ent3)[:, 1:], want, rtol=1e-4)
    assert np.all(np.asarray(ent3)[:, 1:] <= np.log(3) + 1e-5)


def test_make_loss_fn_mismatch_corrections():
    import pytest
    from configs import tictactoe_tiny
    from reno_jax.rl import losses

    rng = np.random.default_rng(0)
    logp = (-rng.uniform(0.1, 2.0, (4, 6))).astype(np.float32)
    old = (logp + rng.normal(0, 0.6, (4, 6))).astype(np.float32)
    adv = rng.normal(size=4).astype(np.float32)
    mask = rng.uniform(size=(4, 6)) < 0.8
    ent = rng.uniform(0, 2, (4, 6)).astype(np.float32)
    config = tictactoe_tiny.get_config()
    config.rl.loss, config.rl.forking_entropy_coef = "dapo", 0.0
    _, default_metrics = pipeline.make_loss_fn(config)(logp, old, adv, mask)
    assert not any(k.startswith(("tis_", "icepop_")) for k in default_metrics)  # off by default
    config.rl.tis_cap, config.rl.icepop_low, config.rl.icepop_high = 1.5, 0.6, 0.0  # high 0: no upper bound
    loss, metrics = pipeline.make_loss_fn(config)(logp, old, adv, mask)
    base = functools.partial(losses.dapo_loss, eps_low=config.rl.eps_low, eps_high=config.rl.eps_high)
    want, _ = losses.with_tis(losses.with_icepop(base, 0.6, np.inf), 1.5)(logp, old, adv, mask)
    assert float(loss) == float(want)
    assert {"tis_weight_mean", "tis_clipped_frac", "icepop_masked_frac", "icepop_masked_count"} <= set(metrics)
    config.rl.forking_entropy_coef = 0.1  # the forking bonus wraps the corrected loss
    _, forking_metrics = pipeline.make_loss_fn(config)(logp, old, adv, mask, entropy=ent)
    assert {"forking_entropy", "tis_weight_mean", "icepop_masked_count"} <= set(forking_metrics)
    for field, value, match in (("tis_cap", 0.5, "tis_cap"), ("tis_cap", -2.0, "tis_cap"),
                                ("icepop_low", 1.0, "icepop_low"), ("icepop_low", -0.1, "icepop_low"),
                                ("icepop_high", 0.9, "icepop_high"), ("icepop_high", -1.0, "icepop_high")):
        bad = tictactoe_tiny.get_config()
        bad.rl[field] = value
        with pytest.raises(ValueError, match=match):
            pipeline.make_loss_fn(bad)


def test_load_boards_max_random_moves():
    from configs import tictactoe_tiny
    c = tictactoe_tiny.get_config()
    c.env.num_boards = 300
    stones = lambda b: (np.asarray(b) != 0).sum(1)
    c.env.max_random_moves = 6  # AReno's generator
    assert stones(pipeline.load_boards(c)[0]).max() == 6
    c.env.max_random_moves = 8
    boards, _ = pipeline.load_boards(c)
    assert boards.shape == (300, 9) and (stones(boards) == 8).any()
