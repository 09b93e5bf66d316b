"""The package's import structure, read from the source with `ast` (nothing is imported, no JAX needed).

    layers (low to high; a module may import its own layer and lower ones):
        errors < tools and tasks < sharding < models < parallel < protocol (with assets) < envs < rollout < rl
        < checkpoint < the rest (pipeline, play, the package root)

Rules: no import cycles between reno_jax modules; no import inside a function except of an optional dependency;
no import of a higher layer; no game (`reno_jax.envs.<game>`) named outside reno_jax/envs/, neither imported nor
as a string (the games are reached through the environment registry); no function longer than
MAX_FUNCTION_LINES (a longer one is split into named phases).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "reno_jax"

LAYERS = (  # low to high; a reno_jax module not under any of these is in the top layer
    ("errors",),  # ConfigError, RunError: what every layer may raise
    ("tools", "tasks"),  # host-side tools and task sources: plain Python that environments use
    ("sharding",),
    ("models",),
    ("parallel",),
    ("protocol", "assets"),  # assets: the shipped tokenizer files and their generic builder
    ("envs",),
    ("rollout",),
    ("rl",),
    ("checkpoint",),
)
TOP_LAYER = len(LAYERS)

# Third-party modules a function may import where it needs them, so that the package imports without them.
OPTIONAL_DEPENDENCIES = frozenset(
    {
        "fastapi",
        "matplotlib",
        "reasoning_gym",
        "selenium",
        "starlette",
        "tensorboardX",
        "tokenizers",
        "torch",
        "transformers",
        "uvicorn",
    }
)

GAMES = ("tictactoe", "connect4", "guess_number", "sokoban")
GAME_FREE_ROOTS = ("reno_jax", "experiments")  # where no game is named (reno_jax/envs/ excepted)
DEFAULT_ALIAS = "experiments.train_tictactoe"  # the README's main command: the generic CLI with the default config
MAX_FUNCTION_LINES = 100  # def line to last line, docstring included (decorators not)


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # dotted module name ("reno_jax.models.ling3")
    imported: str  # dotted module name; for a name imported from a module, that module
    file: str  # relative to the repository
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_files(root: str, repo: Path = REPO) -> dict[str, Path]:
    """{dotted module name: file} of every module under the directory `root` of `repo` (a package: `pkg` for
    pkg/__init__.py)."""
    out = {}
    for path in sorted((repo / root).rglob("*.py")):
        parts = path.relative_to(repo).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of `from <node.module> import ...` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str], repo: Path = REPO) -> list[Import]:
    """Every import statement of one file, module level and in functions. `from pkg import sub` where `pkg.sub`
    is a module (in `known`) counts as importing `pkg.sub`; any other imported name as importing `pkg`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    file = str(path.relative_to(repo))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(module, alias.name, file, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, path, child)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append(Import(module, sub if sub in known else base, file, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def import_graph(*roots: str, repo: Path = REPO) -> tuple[dict[str, Path], list[Import]]:
    """({module: file}, [every import of those modules]) for the modules under the directories `roots`."""
    files: dict[str, Path] = {}
    for root in roots:
        files.update(module_files(root, repo))
    known = set(files)
    return files, [imp for module, path in files.items() for imp in imports_of(module, path, known, repo)]


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _edges(imports: list[Import], modules: set[str]) -> dict[str, dict[str, Import]]:
    """Module -> {module it makes Python import: the import statement}. Importing `a.b.c` also runs the
    `__init__` of `a.b` (and `a`), except the packages the importer itself is in (already being imported)."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in imports:
        own = set(_ancestors(imp.importer))
        for target in (imp.imported, *_ancestors(imp.imported)):
            if target in modules and target != imp.importer and target not in own:
                edges[imp.importer].setdefault(target, imp)
    return edges


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return components


def layer_of(module: str) -> int:
    parts = module.split(".")
    if parts[0] == PACKAGE and len(parts) > 1:
        for rank, names in enumerate(LAYERS):
            if parts[1] in names:
                return rank
    return TOP_LAYER


def _layer_name(rank: int) -> str:
    return "/".join(LAYERS[rank]) if rank < TOP_LAYER else "top"


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out.add(id(first.value))
    return out


def function_lengths(root: str, repo: Path = REPO) -> list[tuple[int, str]]:
    """`(lines, "file::qualified.name")` of every function and method under the directory `root`, longest first
    (a nested function is counted on its own and inside its parent)."""
    out = []

    def visit(node: ast.AST, prefix: str, file: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((child.end_lineno - child.lineno + 1, f"{file}::{name}"))
                visit(child, name + ".", file)
            else:
                visit(child, prefix, file)

    for path in sorted((repo / root).rglob("*.py")):
        visit(ast.parse(path.read_text(), filename=str(path)), "", str(path.relative_to(repo)))
    return sorted(out, key=lambda row: (-row[0], row[1]))


def _is_game_module(module: str) -> bool:
    return any(module == f"{PACKAGE}.envs.{g}" or module.startswith(f"{PACKAGE}.envs.{g}.") for g in GAMES)


# ------------------------------------------------------------------------------------------------------- rules


def test_no_import_cycles():
    files, imports = import_graph(PACKAGE)
    edges = _edges(imports, set(files))
    problems = []
    for component in _strongly_connected(edges):
        if len(component) > 1:
            members = set(component)
            lines = [
                f"  {a} -> {b} ({imp.where()})"
                for a in component
                for b, imp in sorted(edges[a].items())
                if b in members
            ]
            problems.append(f"cycle between {', '.join(component)}:\n" + "\n".join(lines))
    assert not problems, "\n".join(problems)


def test_imports_inside_functions_are_optional_dependencies_only():
    _, imports = import_graph(PACKAGE)
    problems = []
    for imp in imports:
        if not imp.in_function:
            continue
        top = imp.imported.split(".")[0]
        if top == PACKAGE:
            problems.append(f"{imp.where()}: {imp.imported} imported inside a function (import it at module level)")
        elif top not in OPTIONAL_DEPENDENCIES:
            problems.append(
                f"{imp.where()}: {imp.imported} imported inside a function but is not an optional "
                f"dependency ({', '.join(sorted(OPTIONAL_DEPENDENCIES))})"
            )
    assert not problems, "\n".join(problems)


def test_layers_only_import_down():
    _, imports = import_graph(PACKAGE)
    problems = []
    for imp in imports:
        if imp.imported.split(".")[0] != PACKAGE:
            continue
        have, want = layer_of(imp.importer), layer_of(imp.imported)
        if want > have:
            problems.append(
                f"{imp.where()}: {imp.importer} (layer {_layer_name(have)}) imports {imp.imported} "
                f"(higher layer {_layer_name(want)})"
            )
    assert not problems, "\n".join(problems)


def test_games_are_not_named_outside_envs():
    files, imports = import_graph(*GAME_FREE_ROOTS)
    outside = {
        m: p
        for m, p in files.items()
        if not (m == f"{PACKAGE}.envs" or m.startswith(f"{PACKAGE}.envs.") or m == DEFAULT_ALIAS)
    }
    problems = [
        f"{imp.where()}: imports {imp.imported}"
        for imp in imports
        if imp.importer in outside and _is_game_module(imp.imported)
    ]
    for path in sorted(outside.values()):
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                named = [g for g in GAMES if g in node.value]
                if named:
                    problems.append(
                        f"{path.relative_to(REPO)}:{node.lineno}: string {node.value[:60]!r} names {', '.join(named)}"
                    )
    assert not problems, "\n".join(problems)


def test_functions_are_short():
    lengths = function_lengths(PACKAGE)
    longest = "\n".join(f"  {n} lines: {name}" for n, name in lengths[:5])
    assert lengths[0][0] <= MAX_FUNCTION_LINES, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named phases); the longest:\n{longest}"
    )


# ----------------------------------------------------------------------------------- the graph helper itself


def test_graph_resolves_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import c as _c\nfrom pkg.sub.c import NAME\n")
    (pkg / "b.py").write_text("def f():\n    import json\n    from .a import NAME\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import pkg.b\nNAME = 1\n")
    files, imports = import_graph("pkg", repo=tmp_path)
    got = {(i.importer, i.imported, i.in_function) for i in imports}
    assert got == {
        ("pkg", "pkg.a", False),
        ("pkg.a", "pkg.b", False),
        ("pkg.a", "pkg.sub.c", False),
        ("pkg.b", "json", True),
        ("pkg.b", "pkg.a", True),
        ("pkg.sub.c", "pkg.b", False),
    }
    edges = _edges(imports, set(files))
    assert edges["pkg.a"].keys() == {"pkg.b", "pkg.sub", "pkg.sub.c"}  # importing pkg.sub.c runs pkg/sub/__init__
    assert edges["pkg.sub.c"].keys() == {"pkg.b"}  # its own packages (pkg.sub, pkg) are being imported already
    cycles = [c for c in _strongly_connected(edges) if len(c) > 1]
    assert cycles == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_function_lengths_name_methods_and_nested_functions(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "class A:\n    @staticmethod\n    def f():\n        def inner():\n            pass\n        return 1\n\n\n"
        "async def g():\n    pass\n"
    )
    assert function_lengths("pkg", repo=tmp_path) == [
        (4, "pkg/m.py::A.f"),
        (2, "pkg/m.py::A.f.inner"),
        (2, "pkg/m.py::g"),
    ]
