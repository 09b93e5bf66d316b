"""What the loop does differently on the processes of a multi-process run: process 0 writes the files and shows
progress; every process takes part in gathering device values to the host."""

from __future__ import annotations

import jax
import tqdm
from jax.experimental import multihost_utils


def is_main_process() -> bool:
    """The process that writes the run's files (metrics, plots, config) and shows progress bars."""
    return jax.process_index() == 0


def to_host(tree):
    """Device arrays to numpy; in a multi-process run a global array is gathered from every process first (every
    process must call this, in the same order)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)  # the global value, not stacked per process
        return jax.device_get(x)

    return jax.tree.map(get, tree)


def say(message: str) -> None:
    """A console line from process 0 only (every process runs the same loop)."""
    if is_main_process():
        tqdm.tqdm.write(message)


def progress(*args, **kwargs):
    """A progress bar shown by process 0 only."""
    return tqdm.trange(*args, dynamic_ncols=True, disable=not is_main_process(), **kwargs)
