"""Multi-process runs on JAX's own engine: the flags `experiments.train` and `experiments.evaluate` share, and
`initialize()`, which each entry point calls before anything else touches JAX.

  # two GPU hosts, the same command on both (process_id 0 on host0, 1 on host1):
  python -m experiments.train --workdir=/shared/run --config.mesh.data=16 \
      --coordinator_address=host0:1234 --num_processes=2 --process_id=0

Without `--num_processes`, a cluster JAX can bootstrap itself from (SLURM with more than one task, Open MPI
with more than one rank, a multi-host TPU slice) is joined by `jax.distributed.initialize()`'s own detection;
on a plain machine nothing is called, so a single-process run never waits on a coordinator.
`--distributed_autodetect` forces that detection on (a TPU slice whose environment variables are not set) or off.
"""

from __future__ import annotations

import os

import jax
from absl import flags

from experiments import cli

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordination service (multi-process runs)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Processes in the run (one per host, usually); absent: one, or the detected cluster's."
)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, --num_processes).")
_AUTODETECT = flags.DEFINE_bool(
    "distributed_autodetect",
    None,
    "Let jax.distributed.initialize() detect the cluster (default: only when "
    "SLURM / Open MPI / TPU-slice variables say there is more than one process).",
)
_TIMEOUT = flags.DEFINE_integer("distributed_timeout", 300, "Seconds to wait for every process to join.")


def _count(env, name: str) -> int:
    try:
        return int(env.get(name, "1") or 1)
    except ValueError:
        return 1


def detected_cluster(environ=None) -> str | None:
    """The name of a multi-process cluster the environment variables describe, or None (a plain machine).

    Only variables that the cluster's launcher sets are read: no network probe (the TPU metadata server, a
    Kubernetes API) that would stall a single-machine run.
    """
    env = os.environ if environ is None else environ
    count = lambda name: _count(env, name)  # noqa: E731
    if "SLURM_JOB_ID" in env and max(count("SLURM_NTASKS"), count("SLURM_NPROCS")) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and count("OMPI_COMM_WORLD_SIZE") > 1:
        return "openmpi"
    hosts = env.get("TPU_WORKER_HOSTNAMES", "") or env.get("TPU_PROCESS_ADDRESSES", "")
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return "tpu"
    return None


def check_flags(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Raises `cli.UserError` (one line naming the flag) for a set of distributed flags that cannot work."""
    if num_processes is None:
        if process_id is not None:
            raise cli.UserError(f"--process_id={process_id} needs --num_processes")
        if coordinator:
            raise cli.UserError(f"--coordinator_address={coordinator} needs --num_processes and --process_id")
        return
    if num_processes < 1:
        raise cli.UserError(f"--num_processes={num_processes} must be >= 1")
    if num_processes == 1:
        if process_id not in (None, 0):
            raise cli.UserError(f"--process_id={process_id} must be 0 with --num_processes=1")
        return
    if process_id is None:
        raise cli.UserError(f"--num_processes={num_processes} needs --process_id (0 .. {num_processes - 1})")
    if not 0 <= process_id < num_processes:
        raise cli.UserError(
            f"--process_id={process_id} must be in [0, {num_processes}) for --num_processes={num_processes}"
        )
    if not coordinator:
        raise cli.UserError(f"--num_processes={num_processes} needs --coordinator_address=HOST:PORT (process 0's)")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise cli.UserError(f"--coordinator_address={coordinator} must be HOST:PORT")


def initialize() -> int:
    """Joins the multi-process run the flags (or the cluster) describe; returns the process count.

    Call it first in `main`: JAX refuses to go distributed once a computation has run.
    """
    coordinator, num, pid = _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
    check_flags(coordinator, num, pid)
    if num is not None and num > 1:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num, process_id=pid, initialization_timeout=_TIMEOUT.value
        )
    elif num is None and (_AUTODETECT.value or (_AUTODETECT.value is None and detected_cluster())):
        jax.distributed.initialize(initialization_timeout=_TIMEOUT.value)
    return jax.process_count()
