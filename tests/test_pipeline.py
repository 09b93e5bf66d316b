"""reno_jax.pipeline: the policy log-prob function's entropy options."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax import errors
from reno_jax.loop import config as loop_config
from reno_jax.rl import curriculum
from reno_jax.rl import policy
from reno_jax.rl import recipe
from reno_jax.models import ling3


def test_entropy_top_k():
    cfg = ling3.tiny_test_config(num_hidden_layers=2)
    params = ling3.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, cfg.vocab_size)
    batch = {"tokens": tokens}
    logp_full, ent_full = jax.jit(policy.make_logp_fn(cfg))(params, batch)
    logp_all, ent_all = jax.jit(policy.make_logp_fn(cfg, entropy_top_k=cfg.vocab_size))(params, batch)
    np.testing.assert_allclose(np.asarray(ent_all), np.asarray(ent_full), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(logp_all), np.asarray(logp_full))  # log-probs never change
    _, ent3 = jax.jit(policy.make_logp_fn(cfg, entropy_top_k=3))(params, batch)
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
    for field, value, match in (("tis_cap", 0.5, "tis_cap"), ("tis_cap", -2.0, "tis_cap"),
                                ("icepop_low", 1.0, "icepop_low"), ("icepop_low", -0.1, "icepop_low"),
                                ("icepop_high", 0.9, "icepop_high"), ("icepop_high", -1.0, "icepop_high")):
        bad = tictactoe_tiny.get_config()
        bad.rl[field] = value
        with pytest.raises(ValueError, match=match):
            recipe.make_loss_fn(bad)


def test_load_boards_max_random_moves():
    from configs import tictactoe_tiny
    c = tictactoe_tiny.get_config()
    c.env.num_boards = 300
    stones = lambda b: (np.asarray(b) != 0).sum(1)
    c.env.max_random_moves = 6  # AReno's generator
    assert stones(boards_lib.load_boards(c.env)[0]).max() == 6
    c.env.max_random_moves = 8
    boards, _ = boards_lib.load_boards(c.env)
    assert boards.shape == (300, 9) and (stones(boards) == 8).any()


def test_load_boards_both_sides():
    from configs import tictactoe_tiny
    from reno_jax.envs.tictactoe import boards as boards_lib
    c = tictactoe_tiny.get_config()
    c.env.num_boards = 600
    c.env.board_sides = "both"
    boards, _ = boards_lib.load_boards(c.env)
    stones = (boards != 0).sum(1)
    assert boards.shape == (600, 9) and set(stones % 2) == {0, 1}  # X and O to move
    assert not any(boards_lib.np_is_terminal(b) for b in boards)
    assert len({b.tobytes() for b in boards}) == 600
    c.env.board_sides = "x"
    assert set((boards_lib.load_boards(c.env)[0] != 0).sum(1) % 2) == {0}
    o_boards = pipeline.eval_boards("exhaustive_o", c)
    assert len(o_boards) == 2097 and np.all((o_boards == 1).sum(1) == (o_boards == 2).sum(1) + 1)
    assert len(pipeline.eval_boards("exhaustive_both", c)) == 2423 + 2097


def _curriculum_config(**stage):
    import ml_collections
    from configs import tictactoe_tiny_game
    c = tictactoe_tiny_game.get_config()
    c.num_steps = 30
    c.curriculum = ml_collections.ConfigDict()
    c.curriculum.move = ml_collections.ConfigDict(dict(
        num_steps=20, env=dict(task="move", board_sides="both"), sft=dict(num_steps=7, soft_targets=False),
        rollout=dict(max_turns=1, boards_per_step=8), rl=dict(learning_rate=3e-3, end_learning_rate=3e-4,
                                                              warmup_steps=2, forking_entropy_coef=0.1)))
    c.curriculum.move.update(stage)
    return c


def test_curriculum_stages():
    c = _curriculum_config()
    stages = curriculum.curriculum_stages(c)
    assert [(s.name, s.first_step, s.num_steps, s.last_step) for s in stages] == [("move", 0, 20, 20),
                                                                                  ("main", 20, 30, 50)]
    move, main = stages[0].config, stages[1].config
    assert (move.env.task, move.env.board_sides, move.rollout.max_turns, move.num_steps) == ("move", "both", 1, 20)
    assert (move.sft.num_steps, move.sft.soft_targets, move.rollout.group_size) == (7, False, 8)  # the rest kept
    assert (main.env.task, main.num_steps, main.rl.learning_rate) == ("game", 30, c.rl.learning_rate)
    assert "curriculum" not in move and "curriculum" not in main
    assert curriculum.total_steps(c) == 50 and curriculum.total_steps(stages[1].config) == 30
    assert curriculum.stage_at(stages, 1).name == "move" and curriculum.stage_at(stages, 20).name == "move"
    assert curriculum.stage_at(stages, 21).name == "main" and curriculum.stage_at(stages, 99).name == "main"
    loop_config.validate_config(c)


def test_curriculum_learning_rate_follows_each_stage():
    from reno_jax.rl import trainer
    c = _curriculum_config()
    schedule = recipe.make_optimizer(c)  # its last part scales by the learning rate
    lr = lambda n: float(trainer.join_lr_schedules(  # noqa: E731
        [trainer.make_lr_schedule(3e-3, 3e-4, 2, 20), trainer.make_lr_schedule(c.rl.learning_rate,
                                                                                 c.rl.end_learning_rate,
                                                                                 c.rl.warmup_steps, 30)],
        [20, 30])(n))
    assert lr(0) == float(trainer.make_lr_schedule(3e-3, 3e-4, 2, 20)(0))
    assert lr(19) == float(trainer.make_lr_schedule(3e-3, 3e-4, 2, 20)(19))
    assert lr(20) == float(trainer.make_lr_schedule(c.rl.learning_rate, c.rl.end_learning_rate,
                                                    c.rl.warmup_steps, 30)(0))
    # The optimiser applies that schedule: one SGD-like probe of the update size at a few counts.
    params = {"w": jnp.ones((2, 2))}
    state = schedule.init(params)
    grads = {"w": jnp.full((2, 2), 1e-3)}
    sizes = []
    for _ in range(22):
        updates, state = schedule.update(grads, state, params)
        sizes.append(float(jnp.abs(updates["w"][0, 0])))
    # Adam's first update has magnitude 1 per element (times the learning rate), plus the weight decay of 0.01.
    np.testing.assert_allclose(sizes[0], lr(0) * (1 + 0.01), rtol=1e-3)
    assert sizes[20] > sizes[19] * 1.5 or sizes[20] < sizes[19] / 1.5  # a new stage, a new schedule


def test_curriculum_config_errors():
    import pytest
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.rl\.lerning_rate: the config has no field"):
        curriculum.curriculum_stages(_curriculum_config(rl={"lerning_rate": 1.0}))
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.rl\.b1: a curriculum stage cannot change"):
        curriculum.curriculum_stages(_curriculum_config(rl={"b1": 0.5}))
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.model\.tiny\.hidden_size: .*cannot change"):
        curriculum.curriculum_stages(_curriculum_config(model={"tiny": {"hidden_size": 32}}))
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.num_steps must be an integer >= 1"):
        curriculum.curriculum_stages(_curriculum_config(num_steps=0))
    import ml_collections
    c = _curriculum_config()
    c.curriculum.move.rl = ml_collections.ConfigDict({"learning_rate": "fast"})
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.rl\.learning_rate: .*cannot be casted"):
        curriculum.curriculum_stages(c)
    c = _curriculum_config()
    c.curriculum.next = ml_collections.ConfigDict(dict(num_steps=3, sft=dict(num_steps=1)))
    with pytest.raises(errors.ConfigError, match=r"curriculum\.next: only the first stage can set sft"):
        curriculum.curriculum_stages(c)
    bad = _curriculum_config(env={"task": "chess"})
    with pytest.raises(errors.ConfigError, match=r"curriculum stage 'move' .*--config.env.task must be one of"):
        loop_config.validate_config(bad)
