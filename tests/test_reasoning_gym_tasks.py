"""Reasoning Gym tasks (reno_jax/tasks/reasoning_gym.py): any dataset by name, scored by its own `score_answer`; the
calculator tool solves the arithmetic ones from their entries' expressions. The tests that need the optional
`tasks` extra are skipped without it (tests/conftest.py's SLOW table puts them in the slow tier, which installs it)."""

import importlib.util
import os
import subprocess
import sys

import pytest

from reno_jax.tasks import reasoning_gym as rg_tasks
from reno_jax.tools import calculator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_reasoning_gym = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="needs the `tasks` extra (reasoning-gym)",
)

# Large enough operands (4-6 digits, 2-6 terms) that a tiny model cannot compute the answers unaided.
LARGE_ARITHMETIC = dict(min_digits=4, max_digits=6, min_terms=2, max_terms=6)


@needs_reasoning_gym
def test_basic_arithmetic_scores_the_exact_answer_one_and_a_wrong_one_less():
    tasks = rg_tasks.create_tasks("basic_arithmetic", size=20, seed=0, **LARGE_ARITHMETIC)
    assert len(tasks) == 20
    items = list(tasks)
    assert [item.question for item in items] == [
        item.question for item in rg_tasks.create_tasks("basic_arithmetic", size=20, seed=0, **LARGE_ARITHMETIC)
    ]
    for item in items:
        assert item.question == item.entry["question"]
        answer = item.entry["answer"]
        assert tasks.score(answer, item.entry) == 1.0
        assert tasks.score(str(int(answer) + 1), item.entry) < 1.0
        assert tasks.score(None, item.entry) == 0.0
    assert max(len(item.entry["answer"].lstrip("-")) for item in items) >= 6


@needs_reasoning_gym
def test_the_calculator_solves_basic_arithmetic_from_the_entries_expressions():
    tasks = rg_tasks.create_tasks("basic_arithmetic", size=200, seed=0, **LARGE_ARITHMETIC)
    scores = [tasks.score(calculator.evaluate(item.entry["metadata"]["expression"]), item.entry) for item in tasks]
    # Not 100%: when a division does not divide exactly, the dataset's answer can be a floored quotient (its
    # generator makes only the dividend it computed with `//` exact), which the calculator rightly does not give.
    assert sum(score == 1.0 for score in scores) >= 0.99 * len(scores)


@needs_reasoning_gym
def test_a_second_dataset_works_the_same_way():
    tasks = rg_tasks.create_tasks("chain_sum", size=200, seed=1, min_digits=5, max_digits=8, min_terms=3, max_terms=6)
    assert len(tasks) == 200
    for item in tasks:
        assert item.question == item.entry["question"] and item.entry["metadata"]["source_dataset"] == "chain_sum"
        assert tasks.score(calculator.evaluate(item.entry["metadata"]["expression"]), item.entry) == 1.0
        assert tasks.score(str(int(item.entry["answer"]) - 7), item.entry) < 1.0


@needs_reasoning_gym
def test_unknown_names_and_options_say_what_is_wrong():
    assert "chain_sum" in rg_tasks.dataset_names()
    with pytest.raises(ValueError, match="no Reasoning Gym dataset named 'chain_summ'; did you mean chain_sum"):
        rg_tasks.create_tasks("chain_summ", size=3, seed=0)
    with pytest.raises(TypeError, match="'chain_sum': .*digits"):
        rg_tasks.create_tasks("chain_sum", size=3, seed=0, digits=3)


def test_without_the_extra_the_error_names_it():
    code = (
        "import sys\nsys.modules['reasoning_gym'] = None\n"
        "from reno_jax.tasks import reasoning_gym as t\n"
        "try:\n    t.create_tasks('chain_sum', size=3, seed=0)\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (
        'Reasoning Gym tasks need the reasoning-gym package; install it with: pip install -e ".[tasks]"'
    )
