"""Tests for reno_jax.models.conversion (HF safetensors <-> Flax params) and experiments/convert_checkpoint.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from reno_jax.models import conversion as conv
from reno_jax.models import ling3
from reno_jax.models.conversion import CheckpointError

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "data" / "ling3_tiny_a"


# ------------------------------------------------------------------------------------------------- helpers


def read_dir(path: Path) -> dict[str, np.ndarray]:
    """All tensors of an HF directory (single file or index + shards), read with plain safetensors."""
    index = path / conv.INDEX_NAME
    files = (
        sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.exists()
        else [path / conv.WEIGHTS_NAME]
    )
    out = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                assert name not in out, f"{name} stored twice"
                out[name] = f.get_tensor(name)
    return out


def assert_bit_exact(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def write_ckpt(path: Path, tensors: dict[str, np.ndarray], config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / conv.WEIGHTS_NAME), metadata={"format": "pt"})
    (path / conv.CONFIG_NAME).write_text(json.dumps(config))
    return path


def flat(params) -> dict[tuple[str, ...], np.ndarray]:
    return {tuple(k.key for k in p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.fixture(scope="module")
def golden_tensors() -> dict[str, np.ndarray]:
    return read_dir(GOLDEN)


@pytest.fixture(scope="module")
def golden_config() -> dict:
    return json.loads((GOLDEN / conv.CONFIG_NAME).read_text())


@pytest.fixture(scope="module")
def golden_loaded():
    return conv.from_pretrained(GOLDEN)


def load_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        conv.from_pretrained(path)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_shardings_must_be_a_tree_or_a_function_of_the_config():
    # the model layer knows no mesh presets: a preset's shardings come from reno_jax.parallel
    with pytest.raises(TypeError, match="shardings must be None, a params tree"):
        conv.from_pretrained(GOLDEN, shardings=(None, "fsdp"))


# ------------------------------------------------------------------------------------------------- table


def test_table_names_and_shapes_match_golden_file(golden_tensors, golden_config):
    table = conv.param_table(golden_config)
    assert len(table) == 143 == len(golden_tensors)
    assert {e.hf_name: e.hf_shape for e in table} == {k: v.shape for k, v in golden_tensors.items()}
    text = conv.format_table(table)
    lines = text.splitlines()
    assert (
        "model.layers.1.mlp.experts.7.down_proj.weight [64, 32] <-expert-> "
        "model/layers_1/mlp/experts/down_proj[7] [8, 32, 64] (expert, mlp, embed)"
    ) in lines
    assert (
        "model.layers.0.attention.q_conv1d.weight [64, 1, 4] <-conv-> "
        "model/layers_0/attention/q_conv1d/kernel [4, 64] (conv, heads)"
    ) in lines


VARIANT = dict(
    q_lora_rank=None,
    gated_attention_proj_granularity_type="element_wise",
    no_kda_lora=False,
    num_hidden_layers=5,  # layer_group_size 2: [kda, mla, kda, mla, mla] (incomplete tail group -> MLA)
)
VARIANT_TIED = dict(tie_word_embeddings=True, num_shared_experts=0, first_k_dense_replace=0, num_hidden_layers=3)


def variant(golden_config, **overrides) -> dict:
    d = dict(golden_config, **overrides)
    d.pop("layer_types", None)  # derived from layer_group_size by the config class
    return d


@pytest.mark.parametrize("overrides", [{}, VARIANT, VARIANT_TIED], ids=["golden", "variant", "tied"])
def test_table_flax_side_matches_model_param_shapes(golden_config, overrides):
    """The converter's Flax paths/shapes are exactly the model's own parameter tree."""
    config = conv.as_config(variant(golden_config, **overrides))
    table = conv.param_table(config)
    ours = {e.flax_path: e.flax_shape for e in table}
    model = {path: shape for path, (shape, _) in ling3.param_shapes(config).items()}
    assert ours == model
    assert len({e.hf_name for e in table}) == len(table)
    # Every (leaf, expert slot) is written by exactly one HF tensor.
    slots = [(e.flax_path, e.expert) for e in table]
    assert len(set(slots)) == len(slots)


# ------------------------------------------------------------------------------------------------- loading


def test_load_golden_layout_and_values(golden_loaded, golden_tensors, golden_config):
    config, params = golden_loaded
    assert config.layer_kinds == ("kda", "mla", "kda", "mla")
    leaves = flat(params)
    assert {p: v.shape for p, v in leaves.items()} == {e.flax_path: e.flax_shape for e in conv.param_table(config)}
    assert all(v.dtype == np.float32 for v in leaves.values())
    g = golden_tensors
    L0, L1 = ("model", "layers_0"), ("model", "layers_1")
    np.testing.assert_array_equal(
        leaves[L0 + ("attention", "q_proj", "kernel")], g["model.layers.0.attention.q_proj.weight"].T
    )
    np.testing.assert_array_equal(
        leaves[L0 + ("attention", "k_conv1d", "kernel")], g["model.layers.0.attention.k_conv1d.weight"][:, 0, :].T
    )
    np.testing.assert_array_equal(leaves[L0 + ("attention", "A_log")], g["model.layers.0.attention.A_log"])
    for e in (0, 5):
        np.testing.assert_array_equal(
            leaves[L1 + ("mlp", "experts", "gate_proj")][e], g[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].T
        )
        np.testing.assert_array_equal(
            leaves[L1 + ("mlp", "experts", "down_proj")][e], g[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].T
        )
    np.testing.assert_array_equal(leaves[L1 + ("mlp", "gate", "kernel")], g["model.layers.1.mlp.gate.weight"].T)
    np.testing.assert_array_equal(leaves[L1 + ("mlp", "gate", "expert_bias")], g["model.layers.1.mlp.gate.expert_bias"])
    np.testing.assert_array_equal(leaves[("lm_head", "kernel")], g["lm_head.weight"].T)
    np.testing.assert_array_equal(leaves[("model", "word_embeddings", "embedding")], g["model.word_embeddings.weight"])


def test_round_trip_single_file_bit_exact(golden_loaded, golden_tensors, golden_config, tmp_path):
    config, params = golden_loaded
    conv.save_pretrained(params, config, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert_bit_exact(read_dir(tmp_path / "out"), golden_tensors)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    # model_type, architectures and every original field, plus the schedule's MLP list written out.
    assert saved == dict(golden_config, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}


def test_round_trip_sharded_bit_exact(golden_loaded, golden_tensors, tmp_path):
    config, params = golden_loaded
    limit = 40_000
    conv.save_pretrained(params, config, tmp_path / "sharded", shard_size_bytes=limit)
    index = json.loads((tmp_path / "sharded" / conv.INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "sharded" / conv.WEIGHTS_NAME).exists()
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in golden_tensors.values())
    for shard in shards:
        names = [n for n, s in index["weight_map"].items() if s == shard]
        assert len(names) == 1 or sum(golden_tensors[n].nbytes for n in names) <= limit
    assert_bit_exact(read_dir(tmp_path / "sharded"), golden_tensors)
    # Sharded -> Flax -> single file: same tensors again, and the stale shards are replaced.
    config2, params2 = conv.from_pretrained(tmp_path / "sharded")
    assert config2 == config
    conv.save_pretrained(params2, config2, tmp_path / "sharded")
    assert sorted(os.listdir(tmp_path / "sharded")) == ["config.json", "model.safetensors"]
    assert_bit_exact(read_dir(tmp_path / "sharded"), golden_tensors)


def test_bf16_checkpoint_loads_and_round_trips(golden_tensors, golden_config, tmp_path):
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in golden_tensors.items()}
    src = write_ckpt(tmp_path / "bf16", bf16, golden_config)
    # dtype=None keeps the stored dtype, so bf16 -> Flax -> bf16 is bit-exact.
    config, params = conv.from_pretrained(src, dtype=None)
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(params))
    conv.save_pretrained(params, config, tmp_path / "bf16_out")
    assert_bit_exact(read_dir(tmp_path / "bf16_out"), bf16)
    # The fallback reader (for safetensors releases without numpy bf16) gives the same array.
    name = "model.layers.2.attention.q_proj.weight"
    raw = conv._read_raw(src / conv.WEIGHTS_NAME, name)
    assert raw.dtype == ml_dtypes.bfloat16 and raw.tobytes() == bf16[name].tobytes()
    # bf16 file loaded as float32: exact upcast.
    _, params32 = conv.from_pretrained(src, dtype=jnp.float32)
    np.testing.assert_array_equal(params32["lm_head"]["kernel"], bf16["lm_head.weight"].astype(np.float32).T)


def test_float32_checkpoint_loaded_as_bf16(golden_loaded, golden_tensors):
    config, params = conv.from_pretrained(GOLDEN, dtype=jnp.bfloat16)
    leaves = flat(params)
    for entry in conv.param_table(config):
        leaf = leaves[entry.flax_path]
        # A_log, dt_bias, conv kernels, router kernel and expert_bias stay float32, everything else is bf16.
        assert leaf.dtype == (np.float32 if entry.float32 else ml_dtypes.bfloat16), entry.hf_name
        want = entry.hf_to_flax(golden_tensors[entry.hf_name]).astype(leaf.dtype)
        got = leaf if entry.expert is None else leaf[entry.expert]
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), entry.hf_name
    kept = {e.hf_name for e in conv.param_table(config) if e.float32}
    suffixes = ("attention.A_log", "attention.dt_bias", "conv1d.weight", "mlp.gate.weight", "mlp.gate.expert_bias")
    assert kept == {n for n in golden_tensors if n.endswith(suffixes)} and len(kept) == 2 * 5 + 3 * 2


@pytest.mark.parametrize("overrides", [VARIANT, VARIANT_TIED], ids=["variant", "tied"])
def test_generated_config_round_trip(golden_config, tmp_path, overrides):
    raw = variant(golden_config, **overrides)
    config = conv.as_config(raw)
    if overrides is VARIANT:
        assert config.layer_kinds == ("kda", "mla", "kda", "mla", "mla")
    table = conv.param_table(config)
    names = {e.hf_name: e.hf_shape for e in table}
    H, dv = config.num_attention_heads, config.v_head_dim
    if overrides is VARIANT:
        assert names["model.layers.4.attention.q_proj.weight"] == (H * 24, 64)
        assert names["model.layers.4.attention.g_proj.weight"] == (H * dv, 64)
        assert names["model.layers.2.attention.f_a_proj.weight"] == (16, 64)
        assert names["model.layers.2.attention.g_b_proj.weight"] == (64, 16)
        assert "model.layers.1.attention.q_a_proj.weight" not in names
    else:
        assert "lm_head.weight" not in names
        assert not any("shared_experts" in n for n in names)
    # Random params from the table shapes, mixing float32 and bf16 leaves.
    rng = np.random.default_rng(0)
    params: dict = {}
    for i, entry in enumerate({e.flax_path: e for e in table}.values()):
        dtype = jnp.bfloat16 if i % 3 == 0 else jnp.float32
        conv._set_leaf(params, entry.flax_path, jnp.asarray(rng.standard_normal(entry.flax_shape), dtype))
    conv.save_pretrained(params, config, tmp_path / "a")
    first = read_dir(tmp_path / "a")
    assert {k: v.shape for k, v in first.items()} == names
    config2, params2 = conv.from_pretrained(tmp_path / "a", dtype=None)
    assert config2 == config
    a, b = flat(params), flat(params2)
    assert sorted(a) == sorted(b)
    for path in a:
        assert a[path].dtype == b[path].dtype and a[path].tobytes() == b[path].tobytes(), path
    conv.save_pretrained(params2, config2, tmp_path / "b", shard_size_bytes=30_000)
    assert_bit_exact(read_dir(tmp_path / "b"), first)


# ------------------------------------------------------------------------------------------------- MTP


def test_mtp_layers_are_skipped_with_a_note(golden_tensors, golden_config, golden_loaded, tmp_path, caplog):
    tensors = dict(golden_tensors)
    rng = np.random.default_rng(1)
    for name, shape in [
        ("enorm.weight", (64,)),
        ("hnorm.weight", (64,)),
        ("eh_proj.weight", (64, 128)),
        ("final_layernorm.weight", (64,)),
        ("attention.q_proj.weight", (64, 64)),
    ]:
        tensors[f"model.layers.4.{name}"] = rng.standard_normal(shape).astype(np.float32)
    path = write_ckpt(tmp_path / "mtp", tensors, dict(golden_config, num_nextn_predict_layers=1))
    with caplog.at_level(logging.INFO):
        config, params = conv.from_pretrained(path)
    assert "Skipping 5 multi-token-prediction tensors" in caplog.text
    a, b = flat(params), flat(golden_loaded[1])
    assert sorted(a) == sorted(b) and all(np.array_equal(a[p], b[p]) for p in a)
    # Without num_nextn_predict_layers the same extra layer is an error.
    bad = write_ckpt(tmp_path / "no_mtp", tensors, golden_config)
    assert "unexpected tensors (5): model.layers.4.attention.q_proj.weight" in load_error(bad)


# ------------------------------------------------------------------------------------------------- bad inputs


def test_missing_and_unexpected_tensors_are_all_named(golden_tensors, golden_config, tmp_path):
    tensors = dict(golden_tensors)
    del tensors["model.layers.3.mlp.experts.6.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.0.attention.q_norm.weight"] = np.ones(16, np.float32)
    msg = load_error(write_ckpt(tmp_path / "c", tensors, golden_config))
    assert "missing tensors (2): model.layers.3.mlp.experts.6.up_proj.weight, model.norm.weight" in msg
    assert "unexpected tensors (1): model.layers.0.attention.q_norm.weight" in msg


def test_wrong_shape(golden_tensors, golden_config, tmp_path):
    tensors = dict(golden_tensors, **{"model.layers.1.attention.kv_b_proj.weight": np.zeros((128, 31), np.float32)})
    msg = load_error(write_ckpt(tmp_path / "c", tensors, golden_config))
    assert "wrong shape for model.layers.1.attention.kv_b_proj.weight: expected [128, 32], got [128, 31]" in msg


def test_wrong_dtype(golden_tensors, golden_config, tmp_path):
    tensors = dict(golden_tensors, **{"model.layers.0.attention.A_log": np.zeros(4, np.int32)})
    msg = load_error(write_ckpt(tmp_path / "c", tensors, golden_config))
    assert "wrong dtype for model.layers.0.attention.A_log: I32" in msg


def test_unsupported_model_type(golden_tensors, golden_config, tmp_path):
    msg = load_error(write_ckpt(tmp_path / "c", golden_tensors, dict(golden_config, model_type="bailing_moe")))
    assert "unsupported model_type 'bailing_moe'" in msg


def test_missing_config_keys(golden_tensors, golden_config, tmp_path):
    cfg = {k: v for k, v in golden_config.items() if k not in ("hidden_size", "v_head_dim")}
    msg = load_error(write_ckpt(tmp_path / "c", golden_tensors, cfg))
    assert "config is missing required keys: hidden_size, v_head_dim" in msg
    (tmp_path / "c" / "config.json").unlink()
    assert "missing config.json" in load_error(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text("{not json")
    assert "is not valid JSON" in load_error(tmp_path / "c")
    assert "does not exist" in load_error(tmp_path / "nowhere")


def test_missing_corrupt_and_truncated_safetensors(golden_config, tmp_path):
    data = (GOLDEN / conv.WEIGHTS_NAME).read_bytes()
    path = tmp_path / "c"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(golden_config))
    assert "no model.safetensors or model.safetensors.index.json" in load_error(path)
    (path / conv.WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    msg = load_error(path)
    assert "cannot read safetensors file" in msg and "model.safetensors" in msg and "truncated" in msg
    (path / conv.WEIGHTS_NAME).write_bytes(b"this is not a safetensors file at all")
    assert "cannot read safetensors file" in load_error(path)


def test_sharded_index_errors(golden_loaded, golden_config, tmp_path):
    config, params = golden_loaded
    path = tmp_path / "s"
    conv.save_pretrained(params, config, path, shard_size_bytes=200_000)
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) >= 2
    (path / shards[1]).unlink()
    msg = load_error(path)
    assert f"points to missing shard files: {shards[1]}" in msg
    # A shard that exists but lacks a tensor the index assigns to it.
    conv.save_pretrained(params, config, path, shard_size_bytes=200_000)
    index = json.loads((path / conv.INDEX_NAME).read_text())
    index["weight_map"]["model.norm.weight"] = shards[0]
    (path / conv.INDEX_NAME).write_text(json.dumps(index))
    assert "index lists tensors that are not in their shard: model.norm.weight" in load_error(path)
    (path / conv.INDEX_NAME).write_text("[]")
    assert "corrupt index" in load_error(path)


def test_save_rejects_bad_params(golden_loaded, tmp_path):
    config, params = golden_loaded
    bad = jax.tree.map(lambda x: x, params)
    del bad["model"]["layers_2"]["attention"]["dt_bias"]
    bad["model"]["layers_2"]["attention"]["bogus"] = jnp.zeros(3)
    bad["model"]["norm"]["scale"] = jnp.zeros(65)
    bad["lm_head"]["kernel"] = jnp.zeros((64, 128), jnp.int32)
    with pytest.raises(CheckpointError) as info:
        conv.save_pretrained(bad, config, tmp_path / "x")
    msg = str(info.value)
    assert "missing params (1): model/layers_2/attention/dt_bias" in msg
    assert "unexpected params (1): model/layers_2/attention/bogus" in msg
    assert "wrong shape for model/norm/scale: expected [64], got [65]" in msg
    assert "wrong dtype for lm_head/kernel: int32" in msg
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------- orbax


def test_hf_to_orbax_to_hf_bit_exact(golden_tensors, golden_config, tmp_path):
    from experiments import convert_checkpoint as cc

    item = cc.hf_to_orbax(GOLDEN, tmp_path / "orbax")
    assert item.is_dir() and (tmp_path / "orbax" / "config.json").is_file()
    cc.orbax_to_hf(tmp_path / "orbax", tmp_path / "hf")
    assert_bit_exact(read_dir(tmp_path / "hf"), golden_tensors)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved == dict(golden_config, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])


def test_convert_checkpoint_cli(golden_tensors, tmp_path):
    script = [sys.executable, "-m", "experiments.convert_checkpoint"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for args in (
        ["--direction=hf_to_orbax", f"--hf_dir={GOLDEN}", "--dtype=bfloat16"],
        ["--direction=orbax_to_hf", f"--hf_dir={tmp_path / 'hf'}", "--dtype=float32"],
    ):
        run = subprocess.run(
            script + args + [f"--orbax_dir={tmp_path / 'orbax'}"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    out = read_dir(tmp_path / "hf")
    # float32 -> bf16 (except the float32-kept leaves) -> float32: equals the bf16 rounding of the golden.
    table = {e.hf_name: e for e in conv.param_table(json.loads((GOLDEN / "config.json").read_text()))}
    for name, x in golden_tensors.items():
        want = x if table[name].float32 else x.astype(ml_dtypes.bfloat16).astype(np.float32)
        assert out[name].dtype == np.float32 and out[name].tobytes() == want.tobytes(), name


# ------------------------------------------------------------------------------------------------- schedule lists
# transformers' native BailingHybridForCausalLM builds its layers from config.json's `layer_types` and
# `mlp_layer_types` and, when they are missing, derives them without the Ling tail rule; these tests pin that
# every export spells both out so that the native class builds the model we built.

NATIVE_KIND = {"kda": "linear_attention", "mla": "full_attention"}


def zero_params(config) -> dict:
    params: dict = {}
    for entry in conv.param_table(config):
        conv._set_leaf(params, entry.flax_path, jnp.zeros(entry.flax_shape, jnp.float32))
    return params


def native_config_class():
    """transformers' BailingHybridConfig (a configuration class: importing it needs no torch)."""
    from transformers import BailingHybridConfig

    return BailingHybridConfig


@pytest.mark.parametrize(
    "layers, group, dense",
    [(3, 2, 1), (4, 2, 1), (5, 2, 1), (5, 3, 2), (7, 4, 0), (4, 4, 1)],
    ids=["default-tiny", "4x2", "5x2", "5x3", "7x4", "4x4"],
)
def test_saved_schedule_is_the_one_transformers_builds(tmp_path, layers, group, dense):
    native = native_config_class()
    config = ling3.tiny_test_config(num_hidden_layers=layers, layer_group_size=group, first_k_dense_replace=dense)
    conv.save_pretrained(zero_params(config), config, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / conv.CONFIG_NAME).read_text())
    want_layers = [NATIVE_KIND[k] for k in config.layer_kinds]
    want_mlp = ["sparse" if config.is_moe_layer(i) else "dense" for i in range(layers)]
    assert saved["layer_types"] == want_layers and saved["mlp_layer_types"] == want_mlp
    theirs = native.from_pretrained(str(tmp_path / "out"))
    assert list(theirs.layer_types) == want_layers and list(theirs.mlp_layer_types) == want_mlp
    # Back here: the same (hashable, jit-static) config, and the same schedule.
    loaded, _ = conv.from_pretrained(tmp_path / "out")
    assert loaded == config and hash(loaded) == hash(config)
    assert loaded.layer_kinds == config.layer_kinds
    assert ling3.Ling3Config.from_dict(loaded.to_dict()) == loaded
    if (layers, group) == (3, 2):
        # The default run's model: its last layer fills no group and is MLA by the Ling tail rule, which
        # transformers' own derivation (used when the lists are missing) does not know.
        assert want_layers == ["linear_attention", "full_attention", "full_attention"]
        del saved["layer_types"], saved["mlp_layer_types"]
        (tmp_path / "out" / conv.CONFIG_NAME).write_text(json.dumps(saved))
        assert list(native.from_pretrained(str(tmp_path / "out")).layer_types)[-1] == "linear_attention"
        assert conv.from_pretrained(tmp_path / "out")[0].layer_kinds == ("kda", "mla", "mla")


def test_explicit_schedule_lists_are_honoured(golden_config, tmp_path):
    # 3 layers in groups of 2, spelled out the way transformers derives it (no tail rule), and a second dense layer.
    raw = dict(
        variant(golden_config, num_hidden_layers=3),
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "dense", "sparse"],
    )
    with pytest.warns(UserWarning) as warned:
        config = conv.as_config(raw)
    messages = sorted(str(w.message) for w in warned)
    assert len(messages) == 2
    assert messages[0].startswith(
        "config layer_types ['linear_attention', 'full_attention', 'linear_attention'] "
        "differ from the Ling remote code's schedule"
    )
    assert messages[1].startswith("config mlp_layer_types ['dense', 'dense', 'sparse'] differ")
    assert config.layer_kinds == ("kda", "mla", "kda")
    assert [config.is_moe_layer(i) for i in range(3)] == [False, False, True]
    assert config != conv.as_config(variant(golden_config, num_hidden_layers=3))  # a different model
    with pytest.warns(UserWarning):
        assert ling3.Ling3Config.from_dict(config.to_dict()) == config
    assert config.to_dict()["layer_types"] == raw["layer_types"]
    hash(config)
    table = {e.hf_name: e.hf_shape for e in conv.param_table(config)}
    assert table["model.layers.2.attention.q_proj.weight"] == (64, 64)
    assert table["model.layers.1.mlp.gate_proj.weight"] == (96, 64)
    assert {p: s for p, (s, _) in ling3.param_shapes(config).items()} == {
        e.flax_path: e.flax_shape for e in conv.param_table(config)
    }
    rng = np.random.default_rng(2)
    params: dict = {}
    for entry in {e.flax_path: e for e in conv.param_table(config)}.values():
        conv._set_leaf(params, entry.flax_path, jnp.asarray(rng.standard_normal(entry.flax_shape), jnp.float32))
    conv.save_pretrained(params, config, tmp_path / "a")
    saved = json.loads((tmp_path / "a" / conv.CONFIG_NAME).read_text())
    assert saved["layer_types"] == raw["layer_types"] and saved["mlp_layer_types"] == raw["mlp_layer_types"]
    with pytest.warns(UserWarning):
        config2, params2 = conv.from_pretrained(tmp_path / "a")
    assert config2 == config
    a, b = flat(params), flat(params2)
    assert sorted(a) == sorted(b) and all(a[p].tobytes() == b[p].tobytes() for p in a)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(layer_types=["linear_attention", "full_attention"] * 2 + ["full_attention"]),
            "layer_types has 5 entries but num_hidden_layers is 4",
        ),
        (
            dict(layer_types=["linear_attention", "mla", "linear_attention", "full_attention"]),
            "layer_types entries must be one of ('linear_attention', 'full_attention'), got layer_types[1] = 'mla'",
        ),
        (
            dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]),
            "mlp_layer_types entries must be one of ('dense', 'sparse'), got mlp_layer_types[1] = 'moe'",
        ),
        (dict(mlp_layer_types=["dense", "sparse", "sparse"]), "mlp_layer_types has 3 entries"),
        (dict(layer_types="full_attention"), "layer_types must be a list of strings, got 'full_attention'"),
    ],
    ids=["long", "unknown-attention", "unknown-mlp", "short-mlp", "string"],
)
def test_bad_schedule_lists_are_rejected(golden_tensors, golden_config, tmp_path, overrides, message):
    msg = load_error(write_ckpt(tmp_path / "c", golden_tensors, dict(golden_config, **overrides)))
    assert message in msg
    with pytest.raises(ValueError, match=re.escape(message)):
        ling3.Ling3Config.from_dict(dict(golden_config, **overrides))


def _torch_or_skip():
    """torch is in the `bench` extra, not the test extra; .ci/run installs it before the slow tier."""
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs torch for transformers' native class (.ci/run installs torch==2.13.0)")
        pytest.skip("torch not installed (pip install torch==2.13.0, or the bench extra)")


@pytest.mark.parametrize("num_hidden_layers", [None, 3], ids=["default-run", "incomplete-last-group"])
def test_export_logits_equal_transformers_native_class(tmp_path, num_hidden_layers):
    """A random model in the default run's architecture, and the same with 3 layers (its last group incomplete:
    KDA, MLA, then a tail MLA layer), exported and run by transformers' PyTorch BailingHybridForCausalLM: the
    schedule transformers derives is ours and the logits are the same."""
    _torch_or_skip()
    from configs import tictactoe_tiny
    from reno_jax.models import hf_native

    architecture = dict(tictactoe_tiny.get_config().model.tiny)
    if num_hidden_layers is not None:
        architecture.update(num_hidden_layers=num_hidden_layers, layer_group_size=2)
    config = ling3.Ling3Config(vocab_size=96, **architecture)
    if num_hidden_layers == 3:
        assert config.layer_kinds == ("kda", "mla", "mla")
    params = ling3.init_params(config, jax.random.key(3))
    # Larger-than-init weights so that the logits are O(1) and a wrong layer would show.
    params = jax.tree.map(lambda x: x * 4 if x.ndim >= 2 else x, params)
    conv.save_pretrained(params, config, tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 20), dtype=np.int32)
    figures = hf_native.compare_logits(tmp_path / "hf", tokens)
    assert figures["schedule_matches"], figures
    assert figures["num_hidden_layers"] == len(figures["layer_types"]) == config.num_hidden_layers
    assert figures["max_abs_logit"] > 0.5
    assert figures["max_abs_logit_diff"] <= 1e-4, figures


def test_orbax_to_hf_exports_a_training_checkpoint(tmp_path):
    """A training run's checkpoints (TrainState + run config, as the trainer writes them) export directly."""
    from configs import tictactoe_tiny
    from experiments import convert_checkpoint as cc
    from reno_jax.checkpoint.orbax import Checkpointer
    from reno_jax.rl import trainer

    run_config = tictactoe_tiny.get_config()
    model_config = ling3.Ling3Config(vocab_size=80, **dict(run_config.model.tiny))
    params = ling3.init_params(model_config, jax.random.key(5))
    state = trainer.create_train_state(params, trainer.make_optimizer(1e-3), 0)
    with Checkpointer(str(tmp_path / "run"), async_save=False) as ckpt:
        ckpt.save(state, run_config, step=10, force=True)
        ckpt.save(state.replace(params=jax.tree.map(lambda x: x + 1, params)), run_config, step=20, force=True)
    (tmp_path / "run" / "config.json").write_text(run_config.to_json_best_effort())  # as the trainer writes
    # The workdir means its newest step; a step directory means that step.
    for source, want, step in (
        (tmp_path / "run", jax.tree.map(lambda x: x + 1, params), "20"),
        (tmp_path / "run" / "checkpoints" / "10", params, "10"),
    ):
        out = tmp_path / f"hf_{step}"
        item = cc.orbax_to_hf(source, out)
        assert item == tmp_path / "run" / "checkpoints" / step / "state"
        config, loaded = conv.from_pretrained(out)
        assert config == model_config and config.layer_kinds == ("kda", "mla")  # the default's two layers
        a, b = flat(want), flat(loaded)
        assert sorted(a) == sorted(b) and all(a[p].tobytes() == b[p].tobytes() for p in a)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds neither"):
        cc.orbax_to_hf(tmp_path / "empty", tmp_path / "x")
