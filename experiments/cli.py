"""What the absl entry points share: user errors end in one line naming the flag or path, never a traceback."""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import platform
import re
import sys
from typing import Any, Callable

import jax
from absl import app, flags

from reno_jax import parallel
from reno_jax.checkpoint.orbax import RestoreError
from reno_jax.envs import registry
from reno_jax.envs.host import HostEnvError
from reno_jax.errors import ConfigError, RunError
from reno_jax.models.conversion import CheckpointError


class UserError(app.UsageError):
    """A flag or path the user gave that cannot work; the message names it and says what is expected."""


_CACHE = flags.DEFINE_string(
    "compilation_cache",
    os.path.join("~", ".cache", "reno_jax", "xla"),
    "JAX's persistent compilation cache: a later run with the same shapes (another seed, a resumed run, the "
    "evaluation of a run) loads its compiled programs instead of compiling them again (tens of seconds of a CPU "
    "run's start). Kept per machine type under this directory; empty: off. JAX_COMPILATION_CACHE_DIR, when set, is "
    "used instead.",
)


def host_fingerprint() -> str:
    """A short name for this machine's kind (OS, architecture and, on Linux, the CPU's model and feature flags):
    programs compiled for a CPU with other instructions must not be loaded here from a shared home directory."""
    parts = [platform.system(), platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            parts += sorted({line.strip() for line in f if line.startswith(("model name", "flags"))})
    except OSError:
        pass
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def use_compilation_cache(path: str) -> str | None:
    """Turns JAX's persistent compilation cache on in `path`/<host fingerprint> (returned); None where `path` is
    empty or JAX_COMPILATION_CACHE_DIR names a cache already (JAX reads that itself). `UserError` if the directory
    cannot be made."""
    if not path or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    directory = os.path.join(os.path.expanduser(path), host_fingerprint())
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise UserError(
            f"--compilation_cache={path}: cannot create {directory} ({error.strerror}); pass another "
            "directory, or --compilation_cache= to compile without a cache"
        ) from None
    jax.config.update("jax_compilation_cache_dir", directory)
    return directory


def run(main: Callable, *, env_options: bool = False) -> None:
    """`absl.app.run(main)` with `--compilation_cache` on, and with `UserError`, `ConfigError`, `RunError` (a
    workdir without the run or checkpoint asked for), `CheckpointError` (a bad model directory), `RestoreError`
    (a checkpoint of another model: its leaf and both shapes) and `HostEnvError` (a host environment's method
    returned a wrong type) printed as one line, exit status 2.

    `env_options`: the `env` section's `--config.env.NAME=VALUE` flags are taken off the command line before absl
    reads it (a config file does not name an environment's options, and absl refuses a field it lacks) and handed
    to `main` as `main(argv, env_options={NAME: text})`; `with_env_options` puts them into the config."""
    if env_options:
        sys.argv[:], options = split_env_options(sys.argv)
        main = functools.partial(main, env_options=options)

    def guarded(argv):
        try:
            use_compilation_cache(_CACHE.value)
            return main(argv)
        except (UserError, ConfigError, RunError, CheckpointError, RestoreError, HostEnvError) as error:
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
            sys.exit(2)

    app.run(guarded)


ENV_OPTION = re.compile(r"--config\.env\.([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)


def split_env_options(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """`argv` without its `--config.env.NAME=VALUE` flags, and those flags as ``{NAME: VALUE text}``."""
    rest, options = [], {}
    for arg in argv:
        match = ENV_OPTION.fullmatch(arg)
        if match:
            options[match.group(1)] = match.group(2)
        else:
            rest.append(arg)
    return rest, options


def option_value(name: str, text: str, current: Any = None) -> Any:
    """The value of `--config.env.NAME=text`: of `current`'s type where the config file sets the field, else a Python
    literal (`7`, `0.5`, `True`, `(1, 2)`) or, failing that, the text itself; `UserError` if it is not of that type."""
    if current is None:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    kind = type(current)
    try:
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"
        return text if kind is str else kind(ast.literal_eval(text)) if kind in (tuple, list) else kind(text)
    except (ValueError, SyntaxError, TypeError):
        raise UserError(f"--config.env.{name} must be {kind.__name__}, got {text!r}") from None


def with_env_options(config, options: dict[str, str]):
    """`config` (a ConfigDict) with `--config.env.NAME=VALUE` flags set in its `env` section (`split_env_options`);
    the environment's registration checks them (`registry.option_values`). Another `env.name` than the file's
    starts from an empty section: the file's settings were its own environment's."""
    if not options:
        return config
    env = config.env.to_dict()
    if "name" in options and options["name"] != env.get("name"):
        env = {name: "" for name in registry.RESERVED}
    for name, text in options.items():
        env[name] = option_value(name, text, env.get(name))
    with config.unlocked():
        config.env = type(config.env)(env)
    return config


def check_workdir_for_writing(workdir: str) -> None:
    """A training workdir must be a directory or not exist yet (it is created)."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UserError(f"--workdir={workdir} is a file; expected a directory (created if missing)")


def mesh_from_flags(text: str, batch_size: int) -> parallel.MeshConfig | None:
    """The evaluation mesh of `--mesh` (None: one device; several processes: data-parallel over all devices);
    `UserError` naming the flag if it cannot be built here or `--batch_size` does not split over it."""
    if not text and jax.process_count() == 1:
        return None
    try:
        mesh_config = parallel.MeshConfig.from_string(text) if text else parallel.MeshConfig(data=-1)
        parallel.preset_rules(mesh_config.preset)
        ways, described = parallel.describe_batch_ways(parallel.resolve_here(mesh_config))
    except (parallel.MeshError, parallel.ShardingError) as error:
        raise UserError(f"--mesh={text}: {error}") from None
    if batch_size % ways:
        raise UserError(f"--batch_size={batch_size} does not split over the mesh's batch axes ({described})")
    return mesh_config
