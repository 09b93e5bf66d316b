"""Init, load and save on shards, and checkpoints that move between meshes (8 / 4 CPU devices in fresh processes,
see tests/_sharded_io.py; this process has one):

- `init_params` straight onto a mesh: every leaf on the preset's sharding, bit for bit the one-device values, and
  at the real Ling-3.0-tiny shape each device's program outputs only its shard;
- `from_pretrained(shardings=)` of the golden checkpoint under fsdp and fsdp_ep: the preset's shardings, the
  one-device values, each shard reading only its block; `save_pretrained` from those shards gives the golden
  files back;
- an Orbax train state (int8 Adam moments) written on (data 2, fsdp 2, expert 2) restored onto one device, and
  one written on one device restored onto fsdp 4 (as `experiments.evaluate --mesh` and a resumed run do);
- a checkpoint restored into another model: one error naming the leaf and both shapes, nothing changed.
"""

import hashlib
import json
import os
import subprocess
import sys

import _sharded_io as sio
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from experiments import cli
from reno_jax import parallel
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.loop import build
from reno_jax.models import conversion, ling3

REPO = sio.REPO


def _script(devices: int, *args, timeout: int = 600) -> dict:
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=REPO)  # keeps conftest's optimisation level and cache
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "_sharded_io.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tensors(path) -> dict[str, np.ndarray]:
    with safe_open(os.path.join(path, conversion.WEIGHTS_NAME), framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _files(path) -> dict[str, str]:
    """{relative path: sha256} of every file under `path`."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("eight"))
    return out, _script(8, "eight", out)


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    """A training workdir as train.py leaves it (config.json, a checkpoint at step 7), written on one device."""
    workdir = str(tmp_path_factory.mktemp("run1"))
    config = sio.run_config()
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    _, state = sio.train_state(config)
    with ckpt_lib.Checkpointer(workdir, async_save=False) as ckpt:
        ckpt.save(state, config, force=True)
    return workdir, sio.host_tree(state)


def _assert_same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_init_on_8_devices_is_the_one_device_init_bit_for_bit(eight):
    out, found = eight
    assert found["init"]["placed"] and found["init"]["unsharded_equal"], found["init"]
    assert found["init"]["typed_key_equal"], found["init"]
    assert found["init"]["sharded_leaves"] >= 20 and found["init"]["expert_spec"] == "P('expert', 'fsdp', None)"
    assert jax.device_count() == 1 and jax.config.jax_threefry_partitionable
    _assert_same(
        dict(np.load(os.path.join(out, "init_fsdp_ep.npz"))),
        sio.host_tree(ling3.init_params(sio.MODEL, jax.random.PRNGKey(0))),
    )


def test_real_shape_init_traces_without_drawing_and_each_device_makes_only_its_shard(eight):
    real = eight[1]["real"]
    assert real["abstract_ok"]
    for program in real["programs"]:  # an expert stack over expert x fsdp, the embedding over fsdp
        assert program["shards"] > 1 and program["output_bytes"] * program["shards"] == program["leaf_bytes"], program
        # Temporaries split like the output: no device computes more than its shard.
        assert program["temp_bytes"] * program["shards"] <= program["whole_temp_bytes"] + 4096 * program["shards"], (
            program
        )
        assert program["whole_temp_bytes"] >= program["leaf_bytes"], program  # the bound is not vacuous


def test_golden_checkpoint_loads_onto_shards_and_saves_back_from_them(eight):
    out, found = eight
    config = conversion.as_config(conversion.read_config_dict(sio.GOLDEN))
    expert_tensors = sum(e.transform == conversion.EXPERT for e in conversion.param_table(config))
    for preset in ("fsdp", "fsdp_ep"):
        load = found["load"][preset]
        assert load["placed"] and load["equal"], (preset, load)
        assert load["full_reads"] == len(conversion.param_table(config))
    # fsdp 8: each of the 8 shards of a sharded leaf reads its own block; fsdp_ep: an expert tensor is read only
    # by the 2 fsdp halves of the expert shard that holds it, in [Im, D / 2] blocks.
    assert found["load"]["fsdp"]["reads"] > 4 * found["load"]["fsdp"]["full_reads"]
    assert found["load"]["fsdp_ep"]["experts_read"] == 2 * expert_tensors
    assert found["load"]["fsdp_ep"]["expert_blocks"] == [[config.moe_intermediate_size, config.hidden_size // 2]]
    saved, golden = _tensors(os.path.join(out, "hf_from_shards")), _tensors(sio.GOLDEN)
    assert sorted(saved) == sorted(golden)
    for name, x in golden.items():
        assert saved[name].dtype == x.dtype and saved[name].tobytes() == x.tobytes(), name


def test_checkpoint_written_on_8_devices_restores_onto_one(eight):
    out, found = eight
    assert found["checkpoint"]["placed"] and found["checkpoint"]["sharded_leaves"] > 50, found["checkpoint"]
    layout = parallel.Layout.create(sio.MODEL)  # one device
    abstract = layout.abstract_state(sio.abstract_state(conversion.abstract_params(sio.MODEL)))
    with ckpt_lib.Checkpointer(os.path.join(out, "run8"), async_save=False) as ckpt:
        state = ckpt.restore(abstract)
    assert int(state.step) == 7 and {x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(state)} == {
        True
    }
    assert state.opt_state[1].mu["model"]["layers_1"]["mlp"]["experts"]["gate_proj"].codes.dtype == jnp.int8
    _assert_same(sio.host_tree(state), dict(np.load(os.path.join(out, "state8.npz"))))


def test_checkpoint_written_on_one_device_restores_onto_four(one_device_run, tmp_path):
    run, want = one_device_run
    found = _script(4, "four", run, str(tmp_path))
    assert found["step"] == 7 and found["mesh"]["fsdp"] == 4, found
    assert found["params_placed"] and found["state_placed"] and found["sharded_leaves"] > 50, found
    _assert_same(dict(np.load(os.path.join(tmp_path, "state4.npz"))), want)


def test_restore_into_another_model_names_the_leaf_and_both_shapes(one_device_run):
    run, want = one_device_run
    before = _files(run)

    def target(**model):
        config = sio.run_config(**model)
        return sio.abstract_state(build.abstract_model(config, build.build_tokenizer(config))[1])

    with ckpt_lib.Checkpointer(run, async_save=False) as ckpt:
        with pytest.raises(ckpt_lib.RestoreError) as wider:
            ckpt.restore(target(hidden_size=32))
        with pytest.raises(ckpt_lib.RestoreError) as deeper:
            ckpt.restore(target(num_hidden_layers=3))
        state = ckpt.restore(target())
    message = str(wider.value)
    assert message.startswith(
        f"checkpoint 7 in {os.path.join(run, 'checkpoints')} does not fit this model: "
        "params/lm_head/kernel is [64, 512] in the checkpoint but [32, 512] here"
    )
    assert "more leaves have other shapes" in message and "nothing was restored" in message
    assert "this model has" in str(deeper.value) and "params/model/layers_2/" in str(deeper.value)
    assert _files(run) == before  # nothing written, nothing lost
    _assert_same(sio.host_tree(state), want)


def test_restore_item_into_another_model(tmp_path):
    """The same check for a plain Orbax item (train.py's cached warm start)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "warm", {"params": {"w": jnp.zeros((3, 4)), "b": jnp.ones(4)}})
    checkpointer.wait_until_finished()
    checkpointer.close()
    with pytest.raises(ckpt_lib.RestoreError, match=r"params/w is \[3, 4\] in the checkpoint but \[3, 5\] here"):
        ckpt_lib.restore_item(str(tmp_path / "warm"), {"params": {"w": jnp.zeros((3, 5)), "b": jnp.ones(4)}})
    with pytest.raises(ckpt_lib.RestoreError, match=r"this model has 1 leaves the checkpoint lacks \(e.g. params/c\)"):
        ckpt_lib.restore_item(
            str(tmp_path / "warm"), {"params": {"w": jnp.zeros((3, 4)), "b": jnp.ones(4), "c": jnp.ones(2)}}
        )
    restored = ckpt_lib.restore_item(str(tmp_path / "warm"), {"params": {"w": jnp.ones((3, 4)), "b": jnp.ones(4)}})
    assert float(restored["params"]["w"].sum()) == 0.0


def test_train_cli_on_another_models_checkpoint_ends_in_one_line_and_changes_nothing(one_device_run):
    run, _ = one_device_run
    before = _files(run)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--config=configs/tictactoe_tiny.py",
            f"--workdir={run}",
            "--config.model.tiny.num_hidden_layers=2",
            "--config.model.tiny.hidden_size=32",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.strip().splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(lines) == 1 and "train.py: error: checkpoint 7 in " in lines[0], out.stderr[-3000:]
    assert "params/lm_head/kernel is [64, 512] in the checkpoint but [32, 512] here" in lines[0]
    assert _files(run) == before  # config.json and the checkpoint as they were


def test_evaluate_mesh_flag():
    # `cli`, not `evaluate`: this process has imported `experiments.train`, whose absl flags clash with evaluate's
    evaluate = cli
    assert parallel.MeshConfig.from_string("fsdp=4, preset=fsdp") == parallel.MeshConfig(fsdp=4, preset="fsdp")
    assert parallel.MeshConfig.from_string("") == parallel.MeshConfig()
    assert evaluate.mesh_from_flags("", 8) is None
    assert evaluate.mesh_from_flags("data=1,preset=fsdp", 8) == parallel.MeshConfig(preset="fsdp")
    for text, message in (
        ("fsdp=4", r"--mesh=fsdp=4: mesh \(data=1, fsdp=4, .*\) has 4 devices but 1 are"),
        ("pipeline=2", r"--mesh=pipeline=2: expected comma-separated NAME=VALUE"),
        ("fsdp=two", "mesh axis fsdp must be an integer"),
        ("preset=zero3", "unknown sharding preset 'zero3'"),
    ):
        with pytest.raises(cli.UserError, match=message):
            evaluate.mesh_from_flags(text, 8)
