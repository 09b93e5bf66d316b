"""What the absl entry points share: user errors end in one line naming the flag or path, never a traceback."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from typing import Callable

import jax
from absl import app, flags

from reno_jax import parallel
from reno_jax.checkpoint.orbax import RestoreError
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


def run(main: Callable) -> None:
    """`absl.app.run(main)` with `--compilation_cache` on, and with `UserError`, `ConfigError`, `RunError` (a
    workdir without the run or checkpoint asked for), `CheckpointError` (a bad model directory), `RestoreError`
    (a checkpoint of another model: its leaf and both shapes) and `HostEnvError` (a host environment's method
    returned a wrong type) printed as one line, exit status 2."""

    def guarded(argv):
        try:
            use_compilation_cache(_CACHE.value)
            return main(argv)
        except (UserError, ConfigError, RunError, CheckpointError, RestoreError, HostEnvError) as error:
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
            sys.exit(2)

    app.run(guarded)


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
