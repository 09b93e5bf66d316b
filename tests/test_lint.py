"""The repository passes its linter and formatter (ruff, configured in pyproject.toml), as .ci/run checks."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "command",
    [["check", "--output-format=concise", "."], ["format", "--check", "."]],
    ids=["check", "format"],
)
def test_ruff_passes(command):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("the ruff executable is not installed (it is in the test extra)")
    out = subprocess.run([ruff, *command, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    report = (out.stdout + out.stderr)[-4000:]  # the format check prints whole diffs: its end names the count
    assert out.returncode == 0, f"`ruff {' '.join(command)}` failed (`ruff format .` / `ruff check --fix .`):\n{report}"
