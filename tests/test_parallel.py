"""Mesh and sharding rules: the presets' layout of the real Ling-3.0-tiny (golden file), bad meshes, and
sharded forward / decode / train steps on 8 CPU devices against one device (in a fresh process)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from reno_jax import parallel
from reno_jax.models import config as config_lib
from reno_jax.models import conversion, ling3
from reno_jax.sharding.axes import MESH_AXES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "tests", "data", "partition_specs_ling3_tiny_real.json")


def test_real_shape_layout_matches_the_golden_file():
    """A layout change of any preset is a visible diff of tests/data/partition_specs_ling3_tiny_real.json."""
    with open(GOLDEN) as f:
        golden = json.load(f)
    real = config_lib.ling3_tiny_real()
    assert sorted(golden) == sorted(parallel.PRESETS)
    for preset in parallel.PRESETS:
        assert parallel.specs_to_json(parallel.param_partition_specs(real, preset)) == golden[preset], preset
    fsdp_ep = golden["fsdp_ep"]
    assert fsdp_ep["model/layers_1/mlp/experts/gate_proj"] == ["expert", "fsdp", None]
    assert fsdp_ep["model/layers_1/mlp/gate/kernel"] == ["fsdp", None]  # the router sees every expert's score
    assert golden["fsdp_tp"]["model/layers_3/attention/dense/kernel"] == ["tensor", "fsdp"]
    assert all(all(p is None for p in spec) for spec in golden["dp"].values())


@pytest.mark.parametrize(
    "config",
    [
        config_lib.ling3_tiny_real(),
        ling3.tiny_test_config(),
        ling3.tiny_test_config(num_hidden_layers=3, tie_word_embeddings=True),
    ],
)
def test_every_parameter_has_logical_axes_of_its_rank(config):
    axes = parallel.param_logical_axes(config)
    abstract = conversion.abstract_params(config)
    assert jax.tree.structure(abstract) == jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple))
    for a, leaf in zip(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(abstract)):
        assert len(a) == leaf.ndim and set(a) <= set(conversion.LOGICAL_AXES)
    for preset in parallel.PRESETS:
        for spec in jax.tree.leaves(
            parallel.param_partition_specs(config, preset), is_leaf=lambda x: isinstance(x, PartitionSpec)
        ):
            used = [n for p in spec if p is not None for n in ((p,) if isinstance(p, str) else p)]
            assert len(used) == len(set(used)) and set(used) <= set(MESH_AXES)


def test_mesh_sizes_resolve_and_bad_meshes_name_the_numbers():
    assert parallel.MeshConfig(data=2, fsdp=-1).resolve(8) == dict(data=2, fsdp=4, expert=1, tensor=1)
    assert parallel.MeshConfig().resolve(1) == dict(data=1, fsdp=1, expert=1, tensor=1)
    with pytest.raises(parallel.MeshError, match=r"has 6 devices but 8 are available"):
        parallel.MeshConfig(data=3, fsdp=2).resolve(8)
    with pytest.raises(parallel.MeshError, match=r"multiple of 3"):
        parallel.MeshConfig(data=3, fsdp=-1).resolve(8)
    with pytest.raises(parallel.MeshError, match=r"at most one mesh axis may be -1"):
        parallel.MeshConfig(data=-1, fsdp=-1).resolve(8)
    with pytest.raises(parallel.MeshError, match=r">= 1 or -1"):
        parallel.MeshConfig(expert=0).resolve(8)
    with pytest.raises(parallel.ShardingError, match=r"unknown sharding preset 'zero3'.*fsdp_ep"):
        parallel.param_partition_specs(ling3.tiny_test_config(), "zero3")
    mesh = parallel.make_mesh()  # the default: one device, every axis 1
    assert dict(mesh.shape) == dict(data=1, fsdp=1, expert=1, tensor=1)
    parallel.check_batch_divides(5, mesh)
    assert parallel.MeshConfig.from_config({"data": 2, "preset": "fsdp"}) == parallel.MeshConfig(data=2, preset="fsdp")


def test_fit_spec_replicates_what_the_mesh_does_not_divide():
    devices = np.array(jax.devices() * 1)
    mesh = jax.sharding.Mesh(devices.reshape(1, 1, 1, 1), MESH_AXES)
    assert parallel.fit_spec(PartitionSpec("fsdp", None), (6, 4), mesh) == PartitionSpec(None, None)
    assert parallel.logical_to_spec(("embed", "embed"), {"embed": ("fsdp",)}) == PartitionSpec("fsdp", None)
    abstract_mesh = jax.sharding.AbstractMesh((2, 4, 1, 1), MESH_AXES)
    assert parallel.fit_spec(PartitionSpec("fsdp", ("data", "fsdp")), (8, 6), abstract_mesh) == PartitionSpec(
        "fsdp", None
    )
    assert parallel.fit_spec(PartitionSpec(("data", "fsdp"), None), (16, 3), abstract_mesh) == PartitionSpec(
        ("data", "fsdp"), None
    )


@pytest.fixture(scope="module")
def eight_devices():
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=REPO)  # keeps conftest's optimisation level
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "_multidevice_forward.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sharded_forward_and_decode_equal_one_device(eight_devices):
    assert len(eight_devices["forward"]) == 2
    for row in eight_devices["forward"]:
        assert row["placed"], row
        assert row["forward_max_abs"] <= 1e-5 and row["decode_max_abs"] <= 1e-5, row
        assert row["sharded_leaves"] > 0, row


def test_sharded_train_steps_equal_one_device(eight_devices):
    train = eight_devices["train"]
    assert train["params_moved"] > 1e-2  # the steps did move the parameters
    assert train["params_max_rel_diff"] <= 1e-5, train
    assert train["moments_follow"], train
    assert train["sharded_quantized_moments"] > 0  # int8 codes split along their blocks like their parameter
    assert train["expert_moment_specs"] and all("expert" in spec[0] for spec in train["expert_moment_specs"])


def test_routing_replay_under_expert_parallelism(eight_devices):
    replay = eight_devices["replay"]
    assert replay["replay_effect"] > 1e-3  # the replayed ids do change the forward
    assert replay["max_abs_diff"] <= 1e-5, replay


def test_blocked_moe_dispatch_per_device_rows_is_exact(eight_devices):
    """On fsdp / fsdp_ep meshes the blocked dispatch sorts each device's rows on their own (no all-gather of the
    tokens): still the exact, dropless function of the one-device dispatch and of the dense reference, gradients
    too."""
    rows = eight_devices["grouped_moe"]
    assert [r["preset"] for r in rows] == ["fsdp", "fsdp_ep"]
    for grouped, axis in zip(rows, ("fsdp", "expert")):
        assert grouped["groups"] == 2, grouped
        assert axis in grouped["experts_split"], grouped  # the expert weights are split, and gathered per use
        assert grouped["vs_one_device"] <= 1e-5 and grouped["vs_dense"] <= 1e-5, grouped
        # decode-sized calls: ragged on fsdp, every local expert on every token on the expert-split mesh
        assert grouped["dense_decode"] == (axis == "expert") and grouped["decode_vs_one_device"] <= 1e-5, grouped


def test_a_batch_that_does_not_split_over_the_mesh_names_the_numbers(eight_devices):
    errors = eight_devices["batch_split_errors"]
    assert errors["boards"] == (
        "--config.rollout.boards_per_step=12 groups do not split over the mesh's batch axes "
        "(data 2 x fsdp 2 x expert 2 = 8)"
    ), errors
    assert errors["sft"] == (
        "--config.sft.batch_size=12 rows do not split over the mesh's batch axes (data 2 x fsdp 2 x expert 2 = 8)"
    ), errors
    assert errors["evaluate"] == (
        "--batch_size=12 does not split over the mesh's batch axes (data 4 x fsdp 2 x expert 1 = 8)"
    ), errors
    assert errors["evaluate_ok"] == {"data": 4, "fsdp": 2, "expert": 1, "tensor": 1}, errors


def test_a_mesh_the_devices_cannot_hold_is_a_config_error(tmp_path):
    from configs import tictactoe_tiny
    from reno_jax import errors, loop
    from reno_jax.loop import build

    c = tictactoe_tiny.get_config()
    c.mesh.data = 2 * jax.device_count()
    with pytest.raises(errors.ConfigError, match=r"--config.mesh: mesh \(data=\d+, .*\) has \d+ devices but \d+ are"):
        loop.train(c, str(tmp_path / "w"))
    c.mesh.data, c.mesh.preset = 1, "zero3"
    with pytest.raises(errors.ConfigError, match="unknown sharding preset 'zero3'"):
        loop.train(c, str(tmp_path / "w"))
    assert not os.path.exists(tmp_path / "w"), "a config that cannot run writes nothing"
    layout = build.make_layout(tictactoe_tiny.get_config(), ling3.tiny_test_config())
    assert layout.single_device and layout.batch_ways == 1
    params = {"x": np.ones(3)}
    assert layout.place_params(params) is params and layout.place_batch(params) is params
