"""What the absl entry points share: user errors end in one line naming the flag or path, never a traceback."""

from __future__ import annotations

import os
import sys
from typing import Callable

import jax
from absl import app

from reno_jax import parallel
from reno_jax.errors import ConfigError, RunError
from reno_jax.checkpoint.orbax import RestoreError
from reno_jax.models.conversion import CheckpointError


class UserError(app.UsageError):
    """A flag or path the user gave that cannot work; the message names it and says what is expected."""


def run(main: Callable) -> None:
    """`absl.app.run(main)`, with `UserError`, `ConfigError`, `RunError` (a workdir without
    the run or checkpoint asked for), `CheckpointError` (a bad model directory) and `RestoreError` (a checkpoint
    of another model: its leaf and both shapes) printed as one line, exit status 2."""

    def guarded(argv):
        try:
            return main(argv)
        except (UserError, ConfigError, RunError, CheckpointError, RestoreError) as error:
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
