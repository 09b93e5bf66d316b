"""Every fenced code block of README.md and docs/*.md runs or is checked, so a snippet that stops working fails.

A block is treated by its language and by an optional marker, an HTML comment on the line just above its fence:

  ```python                 run: executed; one document's blocks share a namespace, in order
  <!-- snippet: file P -->  written to path P under a scratch directory (on sys.path, and the working directory of
                            the shell checks; empty __init__.py files are added to its folders), imported if it is a
                            .py file, then visible to the document's later blocks and commands
  <!-- snippet: check-only -->
  ```python                 compiled; its imports run and every dotted name read from an imported name resolves
  ```bash                   run: the block runs in bash in the scratch directory (only for cheap commands)
  <!-- snippet: check-only -->
  ```bash                   every command is checked, not run: `python -m MODULE` / `python SCRIPT.py` with its
                            flags parsed by the program's own parser (absl flags and the ml_collections config with
                            its `--config.*` overrides, validated with `reno_jax.loop.config` where the run needs
                            nothing this machine lacks; argparse scripts), `pip install` extras exist in setup.py,
                            `hf download` names the checkpoint repository of reno_jax/models/config.py, `sbatch`
                            scripts are file snippets, `pytest` paths exist; other programs must be in EXTERNAL
  ```text                   not code (diagrams, trees, printed output): not run

Everything runs in ONE subprocess (this file run as a script), so JAX and the package are imported once: the whole
check takes a few seconds of CPU. Also here: relative links in the documents resolve, and README stays a guide.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LANGUAGES = {"python", "bash", "text"}
MARKER = re.compile(r"^<!--\s*snippet:\s*(check-only|file\s+\S+)\s*-->$")
# Programs a check-only command may name that are not checked further (system packages, cluster launchers).
EXTERNAL = {"apt-get", "sudo", "gcloud", "nvidia-smi", "git", "mkdir", "cd", "ls", "cat"}
LAUNCHERS = {"nice", "srun", "time", "/usr/bin/time", "env", "timeout", "taskset"}


# ------------------------------------------------------------------------------------------------ collecting


def snippets() -> list[dict]:
    """Every fenced block of the documents: doc, line (of the opening fence), language, mode, path, code."""
    out = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            lines = f.read().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
            if not m:
                i += 1
                continue
            indent, lang, start = m.group(1), m.group(2), i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j])
            above = lines[start - 1].strip() if start else ""
            marker = MARKER.match(above)
            mode, path = "run", None
            if marker and marker.group(1) == "check-only":
                mode = "check-only"
            elif marker:
                mode, path = "file", marker.group(1).split(None, 1)[1]
            out.append({"id": f"{doc}:{start + 1}", "doc": doc, "lang": lang, "mode": mode, "path": path, "code": code})
            i = j + 1
    return out


# ------------------------------------------------------------------------------------------------ the tests

SNIPPETS = snippets()


def test_every_block_names_a_known_language_and_a_valid_marker():
    for s in SNIPPETS:
        assert s["lang"] in LANGUAGES, f"{s['id']}: a code block needs one of {sorted(LANGUAGES)}, got {s['lang']!r}"
        if s["mode"] == "file":
            assert s["lang"] != "text" and (s["lang"] == "python") == s["path"].endswith(".py"), s["id"]
        if s["mode"] != "run":
            assert s["lang"] != "text", f"{s['id']}: a text block is never run; drop its marker"


def test_relative_links_resolve():
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target.split("#")[0]))
            assert os.path.exists(path), f"{doc}: the link {target!r} points at nothing"


def test_readme_is_a_guide():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 170, f"README.md has {len(lines)} lines; it is a guide (<= 170), details go to docs/"


_RESULTS: dict | None = None


def _results(tmp_dir: str) -> dict:
    global _RESULTS
    if _RESULTS is None:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu"
        )
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), tmp_dir],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        last = [line for line in out.stdout.splitlines() if line.startswith("{")]
        assert out.returncode == 0 and last, f"the snippet checker failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        _RESULTS = json.loads(last[-1])
    return _RESULTS


def pytest_generate_tests(metafunc):
    if "snippet" in metafunc.fixturenames:
        code = [s for s in SNIPPETS if s["lang"] != "text"]
        metafunc.parametrize("snippet", code, ids=[s["id"] for s in code])


def test_snippet(snippet, tmp_path_factory):
    results = _results(str(tmp_path_factory.getbasetemp() / "doc_snippets"))
    result = results.get(snippet["id"])
    assert result is not None, f"{snippet['id']} was not checked"
    assert result["ok"], f"{snippet['id']} ({snippet['lang']}, {snippet['mode']}):\n{result['detail']}"


# Snippets the checker must reject (run after the documents' own, in the same process).
SELF_TESTS = {
    "self:unknown config field": (
        "bash",
        "python -m experiments.train --config=configs/tictactoe_tiny.py --workdir=w --config.rl.no_such_field=1",
    ),
    "self:config the loop rejects": (
        "bash",
        "python -m experiments.train --config=configs/tictactoe_tiny.py --workdir=w --config.rl.train_groups=999",
    ),
    "self:unknown absl flag": ("bash", "python -m experiments.evaluate --workdir=w --no_such_flag=1"),
    "self:unknown script argument": ("bash", "python benchmarks/real_shape_step.py --no-such-argument"),
    "self:no such extra": ("bash", 'pip install -e ".[no_such_extra]"'),
    "self:no such marker": ("bash", 'python -m pytest -q -m "not no_such_marker" tests'),
    "self:no such module": ("bash", "python -m experiments.no_such_module --workdir=w"),
    "self:no such name": ("python", "from reno_jax.rl import losses\nlosses.no_such_loss(1)"),
}


def test_the_checks_reject_broken_snippets(tmp_path_factory):
    results = _results(str(tmp_path_factory.getbasetemp() / "doc_snippets"))
    for name in SELF_TESTS:
        assert not results[name]["ok"], f"{name}: the doc checks accepted a broken snippet"


# ------------------------------------------------------------------------------------------------ the checker
# Runs in a subprocess: `python tests/test_docs.py SCRATCH_DIR`; prints one JSON line {snippet id: {ok, detail}}.


class _Parsed(Exception):
    """Raised in place of running a program once its command line parsed."""


def _scratch(root: str) -> None:
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(ROOT):  # repository paths (configs/..., benchmarks/...) resolve from the scratch dir
        if not name.startswith(".") and not os.path.exists(os.path.join(root, name)):
            os.symlink(os.path.join(ROOT, name), os.path.join(root, name))


def _write_file(root: str, path: str, code: str) -> None:
    target = os.path.join(root, path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w") as f:
        f.write(code + "\n")
    folder = os.path.dirname(path)
    while folder and path.endswith(".py"):
        init = os.path.join(root, folder, "__init__.py")
        if not os.path.exists(init):
            open(init, "w").close()
        folder = os.path.dirname(folder)
    if path.endswith(".py"):
        module = path[:-3].replace("/", ".")
        __import__(module)


def _check_python(code: str) -> None:
    """Compile; run the imports; every dotted name read from an imported name must exist."""
    tree = ast.parse(code)
    namespace: dict = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module(body=[node], type_ignores=[]), "<snippet>", "exec"), namespace)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in namespace:
                obj = namespace[base.id]
                for attr in reversed(chain):
                    if not hasattr(obj, attr):
                        raise AttributeError(f"{base.id}.{'.'.join(reversed(chain))}: {obj!r} has no {attr!r}")
                    obj = getattr(obj, attr)


def _commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuations joined, comments dropped, split at && ; and newlines."""
    text = re.sub(r"\\\n", " ", code)
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in words + ["&&"]:
            if word in ("&&", ";", "||"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def _strip_launchers(words: list[str]) -> tuple[list[str], dict]:
    env = {}
    while words:
        if re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            key, _, value = words[0].partition("=")
            env[key] = value
            words = words[1:]
        elif words[0] in LAUNCHERS:
            words = words[1:]
            while words and (words[0].startswith("-") or words[0].isdigit()):  # the launcher's own options
                words = words[1:]
        else:
            break
    return words, env


def _setup_kwargs() -> dict:
    """The keyword arguments setup.py passes to `setuptools.setup`."""
    captured = {}
    from unittest import mock

    import setuptools

    with mock.patch.object(setuptools, "setup", lambda **kwargs: captured.update(kwargs)), contextlib.chdir(ROOT):
        runpy.run_path(os.path.join(ROOT, "setup.py"))
    return captured


def _setup_extras() -> set:
    return set(_setup_kwargs()["extras_require"])


def _check_pip(args: list[str]) -> None:
    assert args[:1] == ["install"], f"pip {' '.join(args)}: only `pip install` is expected in the docs"
    extras = _setup_extras()
    for arg in args[1:]:
        m = re.fullmatch(r"\.\[([\w,]+)\]", arg)  # .[play] / -e ".[test]": this package's extras
        if m:
            names = set(m.group(1).split(","))
            assert names <= extras, f"pip install {arg}: setup.py has no extra {sorted(names - extras)}"


def _check_hf(args: list[str]) -> None:
    assert args[:1] == ["download"], f"hf {' '.join(args)}: only `hf download` is expected"
    with open(os.path.join(ROOT, "reno_jax", "models", "config.py")) as f:
        source = f.read()
    repo = args[1]
    assert repo in source, f"hf download {repo}: reno_jax/models/config.py names another checkpoint repository"


def _dry_parse_absl(module: str, argv: list[str], validate: bool) -> str:
    from absl import app, flags

    from reno_jax.loop import config as config_checks

    FLAGS = flags.FLAGS
    before = set(FLAGS)
    modules = set(sys.modules)

    def fake_run(main, argv=None, **kwargs):  # absl.app.run: parse the flags, do not run main
        FLAGS(sys.argv)
        raise _Parsed()

    saved_run, saved_argv = app.run, sys.argv
    app.run, sys.argv = fake_run, [module] + argv
    note = ""
    try:
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            raise AssertionError(f"python -m {module} did not reach absl.app.run")
        except _Parsed:
            pass
        if validate and "config" in FLAGS and FLAGS["config"].value is not None:
            config_checks.validate_config(FLAGS["config"].value)
            note = "flags parsed, config validated"
        else:
            note = "flags parsed"
    finally:
        app.run, sys.argv = saved_run, saved_argv
        FLAGS.unparse_flags()
        for name in set(FLAGS) - before:
            try:
                delattr(FLAGS, name)
            except AttributeError:
                pass
        # The next program imports its modules afresh (and defines its flags again): every module of the
        # entry points' packages goes, the packages too (they hold their submodules as attributes).
        for name in list(sys.modules):
            if name.split(".")[0] in ("experiments", "configs") or (
                name not in modules and name != "__main__" and name.startswith("benchmarks")
            ):
                sys.modules.pop(name, None)
    return note


def _dry_parse_script(path: str, argv: list[str]) -> str:
    import argparse

    depth = [0]
    orig_args, orig_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def parse_args(self, *a, **k):
        depth[0] += 1
        try:
            orig_args(self, *a, **k)
        finally:
            depth[0] -= 1
        raise _Parsed()

    def parse_known_args(self, *a, **k):
        result = orig_known(self, *a, **k)
        if depth[0] == 0:
            raise _Parsed()
        return result

    saved_argv = sys.argv
    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = parse_args, parse_known_args
    sys.argv = [path] + argv
    try:
        runpy.run_path(path, run_name="__main__")
        raise AssertionError(f"python {path} did not parse its arguments with argparse")
    except _Parsed:
        return "arguments parsed"
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = orig_args, orig_known
        sys.argv = saved_argv


def _check_python_command(args: list[str], env: dict) -> str:
    if args[:1] == ["-c"]:
        compile(args[1], "<-c>", "exec")
        return "compiled"
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "pytest":
            i = 0
            while i < len(rest):
                if rest[i] in ("-m", "-n", "-k", "-p", "--durations"):  # an option and its value
                    if rest[i] == "-m":
                        with open(os.path.join(ROOT, "pytest.ini")) as f:
                            markers = set(re.findall(r"^\s+(\w+):", f.read(), re.M))
                        words = set(re.findall(r"\w+", rest[i + 1])) - {"not", "and", "or"}
                        assert words <= markers, f"pytest -m {rest[i + 1]!r}: pytest.ini declares {sorted(markers)}"
                    if rest[i] == "-n":  # pytest-xdist must come with the test extra
                        assert any(r.startswith("pytest-xdist") for r in _setup_kwargs()["extras_require"]["test"])
                    i += 2
                    continue
                if not rest[i].startswith("-"):
                    assert os.path.exists(rest[i].split("::")[0]), f"pytest path {rest[i]} does not exist"
                i += 1
            return "markers, plugins and paths exist"
        import importlib.util

        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
        # A run that needs what this machine lacks (a checkpoint, several devices or processes) is only parsed.
        needs_more = (
            any(re.match(r"--(config\.model\.path|config\.mesh\.|num_processes|coordinator|mesh=)", a) for a in rest)
            or "XLA_FLAGS" in env
        )
        needs_more = needs_more or any("areno_ling3" in a for a in rest)
        return _dry_parse_absl(module, rest, validate=not needs_more)
    script = args[0]
    assert os.path.isfile(script), f"python {script}: no such file"
    return _dry_parse_script(script, args[1:])


def _check_command(words: list[str], files: set) -> str:
    words, env = _strip_launchers(words)
    if not words:
        return "environment"
    program, args = words[0], words[1:]
    if program in ("python", "python3") or program.endswith("/python"):
        return _check_python_command(args, env)
    if program == "pip":
        _check_pip(args)
        return "extras exist"
    if program == "hf":
        _check_hf(args)
        return "repository named"
    if program == "sbatch":
        assert args and args[-1] in files, f"sbatch {args}: the script is not a file snippet of this document"
        return "script is a snippet"
    if program == "export":
        return "environment"
    assert program in EXTERNAL, f"{program}: not a program the doc checks know (add it to EXTERNAL if external)"
    return "external"


def _check_shell(code: str, files: set) -> str:
    notes = []
    for words in _commands(code):
        notes.append(f"{' '.join(words[:3])}: {_check_command(words, files)}")
    return "; ".join(notes)


def _run_shell(code: str, root: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out.stdout[-500:]


def _main(root: str) -> None:
    _scratch(root)
    sys.path[:0] = [root, ROOT]
    os.chdir(root)
    results = {}
    for doc in DOCS:
        namespace = {"__name__": "__doc_snippet__"}
        files: set = set()
        for s in [s for s in SNIPPETS if s["doc"] == doc and s["lang"] != "text"]:
            stdout, started = io.StringIO(), time.time()
            try:
                with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()) as stderr:
                    try:
                        if s["mode"] == "file":
                            _write_file(root, s["path"], s["code"])
                            files.add(s["path"])
                            detail = f"written to {s['path']}"
                            if s["lang"] == "bash":  # a script: its commands are checked like check-only ones
                                detail += "; " + _check_shell(s["code"], files)
                        elif s["lang"] == "python" and s["mode"] == "run":
                            exec(compile(s["code"], s["id"], "exec"), namespace)
                            detail = "ran"
                        elif s["lang"] == "python":
                            _check_python(s["code"])
                            detail = "imports and names resolve"
                        elif s["mode"] == "run":
                            detail = _run_shell(s["code"], root)
                        else:
                            detail = _check_shell(s["code"], files)
                    except SystemExit as error:
                        raise AssertionError(f"exit {error.code}: {stderr.getvalue()[-2000:]}") from None
                results[s["id"]] = {"ok": True, "detail": detail, "seconds": round(time.time() - started, 2)}
            except BaseException:  # noqa: BLE001  (every failure is a result; the next snippet still runs)
                results[s["id"]] = {"ok": False, "detail": traceback.format_exc()[-3000:] + stdout.getvalue()[-1000:]}
    for name, (kind, code) in SELF_TESTS.items():  # the checks must have teeth: each of these must fail
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    _check_python(code) if kind == "python" else _check_shell(code, set())
                except SystemExit as error:
                    raise AssertionError(f"exit {error.code}") from None
            results[name] = {"ok": True, "detail": "passed"}
        except BaseException as error:  # noqa: BLE001
            results[name] = {"ok": False, "detail": f"{type(error).__name__}: {error}"[:500]}
    print(json.dumps(results))


if __name__ == "__main__":
    _main(sys.argv[1])
