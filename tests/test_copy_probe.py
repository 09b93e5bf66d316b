"""The copy probe study's span marks: the expression and the result inside the teacher's calls, nothing else."""

import importlib.util
import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None, reason="needs the `tasks` extra (reasoning-gym)"
)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "studies"))
import copy_probe  # noqa: E402

from configs import arithmetic_calculator_tiny  # noqa: E402
from reno_jax import run_config  # noqa: E402
from reno_jax.envs import host  # noqa: E402
from reno_jax.loop import build, host_envs, host_warmstart  # noqa: E402
from reno_jax.protocol.tokenizer import decode  # noqa: E402


def test_marks_cover_the_expression_and_the_result_and_the_figures_read_them():
    config = arithmetic_calculator_tiny.get_config()
    tokenizer = build.build_tokenizer(config)
    env_class = host.configured(host_envs.host_env_class(config), {"teacher_tool_rate": 1.0})
    play = host_warmstart._play(run_config.load(config), tokenizer, len(tokenizer), env_class)
    tasks = env_class.eval_tasks(3)
    batch, marks = copy_probe.marked_batch(play, env_class, tasks, np.random.default_rng(0))
    tokens, loss = np.asarray(batch.tokens), np.asarray(batch.loss_mask)
    for row, task in enumerate(tasks):
        for code, argument in ((1, task["metadata"]["expression"]), (2, task["answer"])):
            # The tokens overlapping the argument: all of it, and nothing to spare at either end (the run's own
            # tokenizer may merge its first or last character into the call's skeleton, as in 'expression": "(').
            marked = tokens[row][marks[row] == code].tolist()
            assert argument in decode(tokenizer, marked)
            assert argument not in decode(tokenizer, marked[1:]) and argument not in decode(tokenizer, marked[:-1])
        assert np.all(loss[row][marks[row] > 0])  # every marked token is a call token
        assert np.all(marks[row][loss[row]] > 0)  # and every call token is marked
    logp = np.where(marks == 1, -2.0, np.where(marks == 2, -0.1, 0.0)).astype(np.float32)
    figures = copy_probe.span_figures(logp, marks)
    assert figures["expression/logp_per_token"] == pytest.approx(-2.0)
    assert figures["result/logp_per_token"] == pytest.approx(-0.1)
    assert figures["result/all_over_half"] == 1.0 and figures["expression/p_over_half"] == 0.0
