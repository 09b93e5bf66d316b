"""Multi-process training on JAX's own engine: two real processes on 127.0.0.1 (two CPU devices each, gloo
collectives) train one run over a 4-device mesh, each writing its own part of the checkpoint; this (one-device)
process restores it, and a single process on one device then resumes it.

What this cannot show: real GPUs or TPUs, a network between hosts, a shared file system other than /tmp.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import cli, distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The programs of the one-device resume (rollout, train step) are those of tests/test_experiments.py's short
# config resumed to 3 steps, which the session's compilation cache already holds when that file ran first.
SMALL = [
    "--config.sft.num_steps=2",
    "--config.sft.batch_size=8",
    "--config.sft.compare_episodes=0",
    "--config.rollout.boards_per_step=4",
    "--config.rollout.group_size=4",
    "--config.rl.train_groups=2",
    "--config.model.tiny.num_hidden_layers=2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, cache: bool = True) -> dict:
    flags = os.environ.get("XLA_FLAGS", "")  # keeps conftest's optimisation level
    if devices > 1:
        flags += f" --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    if not cache:  # two processes compiling the same programs at once: nothing to share, so no cache races
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def _train(args, env):
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--config=configs/tictactoe_tiny.py", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_all(procs, timeout):
    """Waits for every process (killing the rest if one wait fails), asserts each exited 0; returns their
    (stdout, stderr)."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{err[-3000:]}"
    return outs


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_two_processes_train_one_run_and_one_process_resumes_it(tmp_path):
    workdir = str(tmp_path / "run")
    port = _free_port()
    common = [
        f"--workdir={workdir}",
        "--config.num_steps=2",
        "--config.mesh.data=4",
        *SMALL,
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
    ]
    outs = _wait_all([_train(common + [f"--process_id={i}"], _env(2, cache=False)) for i in range(2)], timeout=400)
    # Process 0 alone writes the run's files and prints the summary.
    assert '"steps": 2' in outs[0][0] and '"steps"' not in outs[1][0]
    rows = _rows(workdir)
    assert [r["step"] for r in rows] == [1, 2], rows
    assert all(r["rollout/rewards_mean"] is not None and r["train/grad_norm"] is not None for r in rows)
    for name in ("config.json", "learning_curves.png", "tensorboard", "warmstart"):
        assert os.path.exists(os.path.join(workdir, name)), name
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
    # Each process wrote its own shards of the checkpoint (the data of Orbax's OCDBT store, one per process).
    state_dir = os.path.join(workdir, "checkpoints", "2", "state")
    assert sorted(d for d in os.listdir(state_dir) if d.startswith("ocdbt.process_")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]

    # This test process (one device) restores what the two processes wrote: the trained parameters, not the
    # warm start they started from.
    from reno_jax.checkpoint import orbax as ckpt_lib
    from reno_jax.loop import runs

    _, _, _, params, step = runs.load_run(workdir)
    assert step == 2 and {x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(params)} == {True}
    warm = ckpt_lib.restore_item(os.path.join(workdir, "warmstart"), {"params": params})["params"]
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(warm))]
    assert sum(moved) > len(moved) // 2 and all(np.isfinite(x).all() for x in jax.tree.leaves(params))

    # One process, one device, no distributed flags: restores the 4-device checkpoint and continues the curve.
    p = _train([f"--workdir={workdir}", "--config.num_steps=3", *SMALL], _env(1))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert "Resumed from step 2 onto 1 device(s)" in out + err
    resumed = _rows(workdir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == rows
    assert "3" in os.listdir(os.path.join(workdir, "checkpoints"))


def test_two_processes_draw_and_load_the_model_straight_onto_their_shards():
    """init_params(shardings=) and from_pretrained(shardings=) over a mesh of both processes' devices: each
    process makes only its own shards, equal to the one-device values (tests/_sharded_io.py process)."""
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "_sharded_io.py"), "process", address, str(i)],
            cwd=REPO,
            env=_env(2, cache=False),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for i, (out, _) in enumerate(_wait_all(procs, timeout=300)):
        found = json.loads(out.strip().splitlines()[-1])
        assert found["process"] == i and found["devices"] == 4, found
        assert found["placed"] and found["sharded_leaves"] >= 20 and found["init_equal"] and found["load_equal"], found


def test_a_process_id_out_of_range_is_one_line_naming_the_flag(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--config=configs/tictactoe_tiny.py",
            f"--workdir={tmp_path / 'w'}",
            "--coordinator_address=127.0.0.1:1",
            "--num_processes=2",
            "--process_id=2",
        ],
        cwd=REPO,
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.strip().splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(lines) == 1 and lines[0].endswith("error: --process_id=2 must be in [0, 2) for --num_processes=2"), (
        out.stderr
    )
    assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize(
    "flags, message",
    [
        (("127.0.0.1:1", 2, None), "--num_processes=2 needs --process_id"),
        ((None, 2, 0), "needs --coordinator_address"),
        (("127.0.0.1:1", None, 0), "--process_id=0 needs --num_processes"),
        (("127.0.0.1:1", None, None), "--coordinator_address=127.0.0.1:1 needs --num_processes"),
        (("127.0.0.1:1", 0, 0), "--num_processes=0 must be >= 1"),
        (("127.0.0.1:1", 2, -1), r"--process_id=-1 must be in \[0, 2\)"),
        (("host0", 2, 1), "--coordinator_address=host0 must be HOST:PORT"),
    ],
)
def test_inconsistent_distributed_flags_name_the_flag(flags, message):
    with pytest.raises(cli.UserError, match=message):
        distributed.check_flags(*flags)


def test_cluster_detection_reads_only_launcher_variables():
    assert distributed.detected_cluster({}) is None
    assert distributed.detected_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None  # one task: no peers
    assert distributed.detected_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == "slurm"
    assert distributed.detected_cluster({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}) == "openmpi"
    assert distributed.detected_cluster({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert distributed.detected_cluster({"TPU_WORKER_HOSTNAMES": "t-0,t-1"}) == "tpu"
    distributed.check_flags(None, None, None)  # the plain single-process run
    distributed.check_flags(None, 1, 0)
