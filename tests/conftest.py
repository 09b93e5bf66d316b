"""Test-session settings: CPU only, XLA's cheapest compilation, and a compilation cache.

Almost all of the suite's time is XLA compilation of small programs. `jax_disable_most_optimizations` (LLVM
optimisation level 0 and no expensive LLVM passes) roughly halves it and only changes float rounding (every
numeric tolerance in the suite is far above that). Many tests build the same programs again (a second run of the
same config, a resumed run, the CLIs in subprocesses, the other pytest-xdist worker), so compiled executables go to
a persistent cache that is new for each test session (nothing carries over between sessions). Set before JAX is
imported, so the xdist workers and the subprocesses started by the CLI tests inherit it too.
"""

import os
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# A cache directory given by the caller is used as is (.ci/run shares one between its two tiers).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="reno_jax_test_xla_cache_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# `configs` and `experiments` are imported from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The slow tier (`-m slow`): tests that need a browser, several processes, or long runs of the CLIs in fresh
# processes. Marked here by node name (parameters aside) so that the test files carry no tier marks; the fast tier
# is `python -m pytest -q -n 2 -m "not slow" tests`. tests/test_packaging.py checks that every name here is a test.
SLOW = {
    "tests/test_play.py::test_browser_plays_tictactoe_and_moves_the_slider":
        "drives a headless Chromium through chromedriver",
    "tests/test_play.py::test_browser_plays_connect4_with_column_buttons":
        "drives a headless Chromium through chromedriver",
    "tests/test_play.py::test_cli_serves_a_run_and_prints_its_url":
        "starts the play server (uvicorn) in a second process and talks to it over HTTP",
    "tests/test_multihost.py::test_two_processes_train_one_run_and_one_process_resumes_it":
        "two training processes joined by gloo collectives, then a third process that resumes the run",
    "tests/test_multihost.py::test_two_processes_draw_and_load_the_model_straight_onto_their_shards":
        "two processes on one distributed mesh",
    "tests/test_own_environment.py::test_an_environment_of_the_users_package_trains_and_evaluates_from_the_cli":
        "a training run and an evaluation through the CLIs, each in a fresh process",
    "tests/test_experiments.py::test_game_config_curriculum_run_resume_and_evaluation":
        "three training runs, then games against two opponents through the evaluation CLI (~160 s on 2 busy cores)",
    "tests/test_gpu_check.py::test_runs_every_phase_on_the_tiny_model":
        "benchmarks/gpu_check.py's three phases: three XLA compilations (~50 CPU-s; the fast tier runs its rollout)",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[", 1)[0] in SLOW:
            item.add_marker(pytest.mark.slow)
