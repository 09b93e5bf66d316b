"""Packaging: the core install (setup.py's install_requires) has no web server stack, and the core path (the loop,
the losses, the train / evaluate CLIs) imports without it; the play page says in one line how to get it. Neither
is a task library (reasoning-gym, the `tasks` extra) needed to import the package, its tools or tasks. Also:
every test named in tests/conftest.py's SLOW table exists (a renamed test would silently join the fast tier), and
the scripts in benchmarks/ and studies/ import the installed package, not each other, each with its row in
docs/benchmarks.md."""

import ast
import os
import re
import runpy
import subprocess
import sys
from unittest import mock

import pytest
import setuptools

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEB = ("fastapi", "uvicorn", "starlette", "pydantic", "httpx", "selenium")
# Makes the web packages unimportable in the subprocess, as in an install without the `play` / `test` extras.
SHIM = "import sys\nfor name in ('fastapi', 'uvicorn', 'starlette', 'selenium'):\n    sys.modules[name] = None\n"


def _setup_kwargs(monkeypatch) -> dict:
    """The keyword arguments setup.py passes to `setuptools.setup` (setup.py run with `setup` captured)."""
    captured = {}
    monkeypatch.chdir(REPO)  # find_packages() looks under the working directory
    with mock.patch.object(setuptools, "setup", lambda **kwargs: captured.update(kwargs)):
        runpy.run_path(os.path.join(REPO, "setup.py"))
    return captured


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SHIM + code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_core_install_requires_no_web_package_and_the_extras_have_them(monkeypatch):
    kwargs = _setup_kwargs(monkeypatch)
    core = {_name(r) for r in kwargs["install_requires"]}
    assert {"jax", "flax", "optax", "orbax-checkpoint", "transformers"} <= core
    assert not core & set(WEB), f"the core install lists web packages: {sorted(core & set(WEB))}"
    extras = {extra: {_name(r) for r in reqs} for extra, reqs in kwargs["extras_require"].items()}
    assert {"fastapi", "uvicorn", "pydantic"} <= extras["play"]
    assert extras["play"] | {"pytest", "hypothesis", "httpx", "selenium"} <= extras["test"]
    assert kwargs["license"] == "Apache-2.0" and os.path.isfile(os.path.join(REPO, "LICENSE"))
    minimum = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", kwargs["python_requires"]).groups())
    assert sys.version_info[:2] >= minimum


@pytest.mark.parametrize(
    "modules",
    [
        ("reno_jax.rl.losses", "reno_jax.loop", "experiments.train"),
        ("experiments.evaluate",),  # a process of its own: train and evaluate define the same absl flags
    ],
)
def test_the_core_path_imports_without_the_web_packages(modules):
    """Any import of fastapi / uvicorn / starlette / selenium on the way would raise ImportError."""
    out = _python("".join(f"import {m}\n" for m in modules))
    assert out.returncode == 0, out.stderr[-3000:]


def test_play_without_the_extra_is_one_line_naming_it(tmp_path):
    out = _python(
        f"import runpy\nsys.argv = ['play.py', '--workdir={tmp_path}']\n"
        "runpy.run_module('experiments.play', run_name='__main__')\n"
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        'play.py: error: the play page needs fastapi, uvicorn; install them with: pip install -e ".[play]"'
    ]


def _conftest_table(name: str):
    """A table of tests/conftest.py (SLOW, LONGEST_FIRST), read from its source (conftest is not importable as a
    module by name)."""
    with open(os.path.join(REPO, "tests", "conftest.py")) as f:
        for node in ast.parse(f.read()).body:
            if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]:
                return ast.literal_eval(node.value)
    raise AssertionError(f"tests/conftest.py has no {name} table")


def _slow_table() -> dict:
    return _conftest_table("SLOW")


def test_the_longest_first_order_names_test_files():
    order = _conftest_table("LONGEST_FIRST")
    assert len(set(order)) == len(order)
    for path in order:
        assert os.path.isfile(os.path.join(REPO, path)), f"tests/conftest.py's LONGEST_FIRST names {path}: no file"


def test_every_slow_test_exists():
    for nodeid, reason in _slow_table().items():
        path, name = nodeid.split("::")
        with open(os.path.join(REPO, path)) as f:
            names = {node.name for node in ast.parse(f.read()).body if isinstance(node, ast.FunctionDef)}
        assert name in names, f"tests/conftest.py's SLOW names {nodeid}, which is not a test"
        assert reason.strip(), nodeid


SCRIPT_FOLDERS = ("benchmarks", "studies")


def _scripts() -> dict[str, ast.Module]:
    """{"benchmarks/x.py" or "studies/x.py": its syntax tree} of every script."""
    trees = {}
    for folder in SCRIPT_FOLDERS:
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            if name.endswith(".py"):
                with open(os.path.join(REPO, folder, name)) as f:
                    trees[f"{folder}/{name}"] = ast.parse(f.read())
    return trees


def test_no_script_edits_sys_path_or_imports_another_script():
    # A script imports reno_jax, experiments and configs as the installed package; what two scripts share is
    # library code (e.g. reno_jax/real_shape.py), so each runs as `python benchmarks/x.py` from anywhere.
    trees = _scripts()
    assert trees, "no scripts found in benchmarks/ or studies/"
    script_modules = {os.path.basename(path)[:-3] for path in trees}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                assert False, f"{path}:{node.lineno} reads or edits sys.path"
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in script_modules and top not in SCRIPT_FOLDERS, (
                    f"{path}:{node.lineno} imports the script {name}: move what it shares into reno_jax"
                )


def test_every_script_has_a_row_in_docs_benchmarks():
    with open(os.path.join(REPO, "docs", "benchmarks.md")) as f:
        text = f.read()
    for path in _scripts():
        assert path in text, f"{path} is cited nowhere in docs/benchmarks.md"


TASK_LIBRARIES = ("reasoning_gym",)


def test_the_task_libraries_are_an_optional_extra_and_the_package_imports_without_them(monkeypatch):
    kwargs = _setup_kwargs(monkeypatch)
    core = {_name(r) for r in kwargs["install_requires"]}
    tasks = {_name(r) for r in kwargs["extras_require"]["tasks"]}
    assert "reasoning-gym" in tasks and not core & tasks
    # Importing the package, its tools and the task adapters loads no task library (they import it when used).
    out = _python(
        "import reno_jax, reno_jax.tools, reno_jax.tools.calculator, reno_jax.tools.knowledge_base\n"
        "import reno_jax.tasks, reno_jax.tasks.reasoning_gym\n"
        "import reno_jax.envs.reasoning_gym_env, reno_jax.envs.arithmetic_calculator, reno_jax.envs.two_hop_lookup\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {TASK_LIBRARIES!r}))\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
