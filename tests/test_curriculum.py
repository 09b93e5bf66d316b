"""reno_jax.loop.curriculum: stages of one run, each stage's learning-rate schedule (loop.recipe.make_optimizer), and
config errors named by stage (loop.config.validate_config)."""

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import tictactoe_tiny_game
from reno_jax import errors
from reno_jax.loop import config as loop_config
from reno_jax.loop import curriculum, recipe
from reno_jax.rl import trainer


def _curriculum_config(**stage):
    c = tictactoe_tiny_game.get_config()
    c.num_steps = 30
    c.curriculum = ml_collections.ConfigDict()
    c.curriculum.move = ml_collections.ConfigDict(
        dict(
            num_steps=20,
            env=dict(task="move", board_sides="both"),
            sft=dict(num_steps=7, soft_targets=False),
            rollout=dict(max_turns=1, boards_per_step=8),
            rl=dict(learning_rate=3e-3, end_learning_rate=3e-4, warmup_steps=2, forking_entropy_coef=0.1),
        )
    )
    c.curriculum.move.update(stage)
    return c


def test_curriculum_stages():
    c = _curriculum_config()
    stages = curriculum.curriculum_stages(c)
    assert [(s.name, s.first_step, s.num_steps, s.last_step) for s in stages] == [
        ("move", 0, 20, 20),
        ("main", 20, 30, 50),
    ]
    move, main = stages[0].config, stages[1].config
    assert (move.env.task, move.env.board_sides, move.rollout.max_turns, move.num_steps) == ("move", "both", 1, 20)
    assert (move.sft.num_steps, move.sft.soft_targets, move.rollout.group_size) == (7, False, 8)  # the rest kept
    assert (main.env.task, main.num_steps, main.rl.learning_rate) == ("game", 30, c.rl.learning_rate)
    assert not move.curriculum and not main.curriculum
    assert curriculum.total_steps(c) == 50 and curriculum.total_steps(stages[1].config) == 30
    assert curriculum.stage_at(stages, 1).name == "move" and curriculum.stage_at(stages, 20).name == "move"
    assert curriculum.stage_at(stages, 21).name == "main" and curriculum.stage_at(stages, 99).name == "main"
    loop_config.validate_config(c)


def test_curriculum_learning_rate_follows_each_stage():
    c = _curriculum_config()
    schedule = recipe.make_optimizer(c)  # its last part scales by the learning rate
    lr = lambda n: float(
        trainer.join_lr_schedules(  # noqa: E731
            [
                trainer.make_lr_schedule(3e-3, 3e-4, 2, 20),
                trainer.make_lr_schedule(c.rl.learning_rate, c.rl.end_learning_rate, c.rl.warmup_steps, 30),
            ],
            [20, 30],
        )(n)
    )
    assert lr(0) == float(trainer.make_lr_schedule(3e-3, 3e-4, 2, 20)(0))
    assert lr(19) == float(trainer.make_lr_schedule(3e-3, 3e-4, 2, 20)(19))
    assert lr(20) == float(
        trainer.make_lr_schedule(c.rl.learning_rate, c.rl.end_learning_rate, c.rl.warmup_steps, 30)(0)
    )
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
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.rl\.lerning_rate: the config has no field"):
        curriculum.curriculum_stages(_curriculum_config(rl={"lerning_rate": 1.0}))
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.rl\.b1: a curriculum stage cannot change"):
        curriculum.curriculum_stages(_curriculum_config(rl={"b1": 0.5}))
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.model\.tiny\.hidden_size: .*cannot change"):
        curriculum.curriculum_stages(_curriculum_config(model={"tiny": {"hidden_size": 32}}))
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\.num_steps must be an integer >= 1"):
        curriculum.curriculum_stages(_curriculum_config(num_steps=0))
    c = _curriculum_config()
    c.curriculum.move.rl = ml_collections.ConfigDict({"learning_rate": "fast"})
    with pytest.raises(errors.ConfigError, match=r"curriculum\.move\): --config\.rl\.learning_rate must be a number"):
        curriculum.curriculum_stages(c)
    c = _curriculum_config()
    c.curriculum.next = ml_collections.ConfigDict(dict(num_steps=3, sft=dict(num_steps=1)))
    with pytest.raises(errors.ConfigError, match=r"curriculum\.next: only the first stage can set sft"):
        curriculum.curriculum_stages(c)
    bad = _curriculum_config(env={"task": "chess"})
    with pytest.raises(errors.ConfigError, match=r"curriculum stage 'move' .*--config.env.task must be one of"):
        loop_config.validate_config(bad)
