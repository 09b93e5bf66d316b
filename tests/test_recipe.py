"""reno_jax.loop.recipe: a config's loss, with the mismatch corrections (TIS, IcePop) and their config errors."""

import functools

import numpy as np
import pytest

from configs import tictactoe_tiny
from reno_jax.loop import recipe
from reno_jax.rl import losses


def test_make_loss_fn_mismatch_corrections():
    rng = np.random.default_rng(0)
    logp = (-rng.uniform(0.1, 2.0, (4, 6))).astype(np.float32)
    old = (logp + rng.normal(0, 0.6, (4, 6))).astype(np.float32)
    adv = rng.normal(size=4).astype(np.float32)
    mask = rng.uniform(size=(4, 6)) < 0.8
    ent = rng.uniform(0, 2, (4, 6)).astype(np.float32)
    config = tictactoe_tiny.get_config()
    config.rl.loss, config.rl.forking_entropy_coef = "dapo", 0.0
    _, default_metrics = recipe.make_loss_fn(config)(logp, old, adv, mask)
    assert not any(k.startswith(("tis_", "icepop_")) for k in default_metrics)  # off by default
    config.rl.tis_cap, config.rl.icepop_low, config.rl.icepop_high = 1.5, 0.6, 0.0  # high 0: no upper bound
    loss, metrics = recipe.make_loss_fn(config)(logp, old, adv, mask)
    base = functools.partial(losses.dapo_loss, eps_low=config.rl.eps_low, eps_high=config.rl.eps_high)
    want, _ = losses.with_tis(losses.with_icepop(base, 0.6, np.inf), 1.5)(logp, old, adv, mask)
    assert float(loss) == float(want)
    assert {"tis_weight_mean", "tis_clipped_frac", "icepop_masked_frac", "icepop_masked_count"} <= set(metrics)
    config.rl.forking_entropy_coef = 0.1  # the forking bonus wraps the corrected loss
    _, forking_metrics = recipe.make_loss_fn(config)(logp, old, adv, mask, entropy=ent)
    assert {"forking_entropy", "tis_weight_mean", "icepop_masked_count"} <= set(forking_metrics)
    for field, value, match in (
        ("tis_cap", 0.5, "tis_cap"),
        ("tis_cap", -2.0, "tis_cap"),
        ("icepop_low", 1.0, "icepop_low"),
        ("icepop_low", -0.1, "icepop_low"),
        ("icepop_high", 0.9, "icepop_high"),
        ("icepop_high", -1.0, "icepop_high"),
    ):
        bad = tictactoe_tiny.get_config()
        bad.rl[field] = value
        with pytest.raises(ValueError, match=match):
            recipe.make_loss_fn(bad)
