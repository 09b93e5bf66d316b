r"""Convert a Ling-3.0 (bailing_hybrid) checkpoint between HF safetensors and an orbax checkpoint.

  python -m experiments.convert_checkpoint --direction=hf_to_orbax --hf_dir=/ckpt/Ling-3.0-tiny \
      --orbax_dir=/ckpt/ling3_orbax --dtype=float32
  python -m experiments.convert_checkpoint --direction=orbax_to_hf --orbax_dir=/ckpt/ling3_orbax \
      --hf_dir=/ckpt/ling3_hf_out [--shard_size_mb=4096]

Orbax layout: `<orbax_dir>/state` is an `ocp.StandardCheckpointer` item holding `{'params': params}` (the Flax
layout of reno_jax.models.conversion) and `<orbax_dir>/config.json` is the HF config beside it.

orbax_to_hf also reads a training run's checkpoints (reno_jax.checkpoint.orbax: `<workdir>/checkpoints/<step>/`
with a `state` item, the TrainState whose `params` are exported, and a `config` item, the run configuration):
--orbax_dir is then a step directory, or the run's workdir (or its checkpoints/ folder) for the newest step.
The model config comes from the run configuration: the HF directory of `model.path`, or the embedded
`model.tiny` architecture with the vocabulary size of the trained embedding. A LoRA run's checkpoint (run config
`lora.rank > 0`) holds adapters only: the run's frozen base is rebuilt (`reno_jax.loop.adapters`: `model.path`, or
the workdir's cached warm start) and the export is the merged model, W + (alpha / r) A @ B (an int8 base
dequantized), which loads in transformers' native class like any other export.

  python -m experiments.convert_checkpoint --direction=orbax_to_hf --orbax_dir=workdir/tiny --hf_dir=/tmp/tiny_hf
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import flags, logging

from experiments import cli
from reno_jax import run_config as run_config_lib
from reno_jax.checkpoint.orbax import CHECKPOINT_SUBDIR
from reno_jax.loop import runs
from reno_jax.models import conversion
from reno_jax.models.config import Ling3Config

ORBAX_ITEM = "state"
RUN_CONFIG_ITEM = "config"  # a training checkpoint's run configuration (an orbax JSON item)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "keep": None}

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (config.json + safetensors).")
flags.DEFINE_string(
    "orbax_dir",
    None,
    "Orbax directory (state/ + config.json), or for orbax_to_hf a training "
    "checkpoint: <workdir>/checkpoints/<step>, or the workdir for its newest step.",
)
flags.DEFINE_enum("direction", "hf_to_orbax", ["hf_to_orbax", "orbax_to_hf"], "Conversion direction.")
flags.DEFINE_enum("dtype", "keep", list(_DTYPES), "Cast the weights to this dtype; 'keep' keeps the source's.")
flags.DEFINE_integer("shard_size_mb", None, "orbax_to_hf: shard the safetensors output at this many MiB.")
flags.DEFINE_bool("overwrite", False, "Replace an existing orbax checkpoint in --orbax_dir.")


def hf_to_orbax(hf_dir: str | Path, orbax_dir: str | Path, dtype: Any = None, overwrite: bool = False) -> Path:
    """HF directory -> `<orbax_dir>/state` ({'params': params}) + `<orbax_dir>/config.json`. Returns the item path."""
    config, params = conversion.from_pretrained(hf_dir, dtype=dtype)
    orbax_dir = Path(orbax_dir).absolute()
    orbax_dir.mkdir(parents=True, exist_ok=True)
    item = orbax_dir / ORBAX_ITEM
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(item, {"params": params}, force=overwrite)
    checkpointer.wait_until_finished()
    checkpointer.close()
    text = json.dumps(conversion.config_to_json_dict(config), indent=2, sort_keys=True) + "\n"
    (orbax_dir / conversion.CONFIG_NAME).write_text(text)
    return item


def _restore_params(item: Path) -> dict:
    """The `params` entry of the orbax item at `item` (hf_to_orbax's {'params'} or a training TrainState)."""
    if not item.is_dir():
        raise conversion.CheckpointError(f"no orbax checkpoint at {str(item)!r}")
    checkpointer = ocp.StandardCheckpointer()
    state = checkpointer.restore(item)
    checkpointer.close()
    if not isinstance(state, dict) or "params" not in state:
        raise conversion.CheckpointError(f"orbax checkpoint {str(item)!r} holds no 'params' entry")
    return state["params"]


def training_step_dir(path: Path) -> Path | None:
    """The training checkpoint step directory that `path` names: `path` itself when it holds the `state` and
    `config` items, else the newest `<step>` under `path` or `path/checkpoints`; None when there is none."""
    if (path / ORBAX_ITEM).is_dir() and (path / RUN_CONFIG_ITEM).is_dir():
        return path
    for folder in (path / CHECKPOINT_SUBDIR, path):
        # Orbax writes a step under a temporary name and renames it when complete: only plain numbers count.
        steps = (
            [p for p in folder.iterdir() if p.name.isdigit() and (p / ORBAX_ITEM).is_dir()] if folder.is_dir() else []
        )
        if steps:
            return max(steps, key=lambda p: int(p.name))
    return None


def run_model_config(run_config: Mapping, params: Mapping) -> Ling3Config:
    """The model config of a training run: `model.path`'s HF config, or `model.tiny` with the trained vocabulary."""
    model = run_config.get("model") or {}
    if model.get("path"):
        return conversion.as_config(conversion.read_config_dict(model["path"]))
    if not isinstance(model.get("tiny"), Mapping):
        raise conversion.CheckpointError("the run configuration has neither model.path nor model.tiny")
    try:
        vocab_size = int(params["model"]["word_embeddings"]["embedding"].shape[0])
    except (KeyError, TypeError, AttributeError) as exc:
        raise conversion.CheckpointError(f"the checkpoint's params have no word embedding: {exc!r}") from exc
    try:
        # As reno_jax.build.tiny_model_config built it: the vocabulary grown to the tokenizer's size.
        return Ling3Config(**dict(model["tiny"], vocab_size=vocab_size))
    except (TypeError, ValueError) as exc:
        raise conversion.CheckpointError(f"invalid model.tiny in the run configuration: {exc}") from exc


def orbax_to_hf(
    orbax_dir: str | Path, hf_dir: str | Path, dtype: Any = None, shard_size_bytes: int | None = None
) -> Path:
    """Orbax checkpoint -> HF directory (published names, shapes; param dtypes unless `dtype`).

    `orbax_dir` is hf_to_orbax's layout (`state` + config.json) or a training run's checkpoint (see the module
    docstring). Returns the orbax item that was exported.
    """
    orbax_dir = Path(orbax_dir).absolute()
    # A training run's workdir has a config.json too (the run configuration), but no state item beside it.
    if (orbax_dir / conversion.CONFIG_NAME).is_file() and (orbax_dir / ORBAX_ITEM).is_dir():
        config = conversion.as_config(conversion.read_config_dict(orbax_dir))
        item = orbax_dir / ORBAX_ITEM
        params = _restore_params(item)
    else:
        step_dir = training_step_dir(orbax_dir) if orbax_dir.is_dir() else None
        if step_dir is None:
            raise conversion.CheckpointError(
                f"{str(orbax_dir)!r} holds neither hf_to_orbax's layout ({ORBAX_ITEM}/ + {conversion.CONFIG_NAME}) "
                f"nor a training checkpoint (<workdir>/{CHECKPOINT_SUBDIR}/<step>/{{{ORBAX_ITEM},{RUN_CONFIG_ITEM}}})"
            )
        item = step_dir / ORBAX_ITEM
        if not (step_dir / RUN_CONFIG_ITEM).is_dir():
            raise conversion.CheckpointError(f"training checkpoint {str(step_dir)!r} has no {RUN_CONFIG_ITEM} item")
        reader = ocp.Checkpointer(ocp.JsonCheckpointHandler())
        run_config = reader.restore(step_dir / RUN_CONFIG_ITEM, args=ocp.args.JsonRestore())
        reader.close()
        if run_config_lib.upgrade(run_config).lora.rank:
            if step_dir.parent.name != CHECKPOINT_SUBDIR:
                raise conversion.CheckpointError(
                    f"{str(step_dir)!r} is a LoRA run's checkpoint (adapters only) "
                    f"outside a workdir's {CHECKPOINT_SUBDIR}/: its base cannot be rebuilt"
                )
            run = runs.load_checkpoint(str(step_dir.parent.parent), int(step_dir.name))
            params, config = run.merged_params(), run.model_config
        else:
            params = _restore_params(item)
            config = run_model_config(run_config, params)
    conversion.save_pretrained(params, config, hf_dir, shard_size_bytes=shard_size_bytes, dtype=dtype)
    return item


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.hf_dir or not FLAGS.orbax_dir:
        raise cli.UserError("--hf_dir and --orbax_dir are both required")
    dtype = _DTYPES[FLAGS.dtype]
    if FLAGS.direction == "hf_to_orbax":
        item = hf_to_orbax(FLAGS.hf_dir, FLAGS.orbax_dir, dtype=dtype, overwrite=FLAGS.overwrite)
        logging.info("wrote %s", item)
    else:
        shard = None if FLAGS.shard_size_mb is None else FLAGS.shard_size_mb * 2**20
        item = orbax_to_hf(FLAGS.orbax_dir, FLAGS.hf_dir, dtype=dtype, shard_size_bytes=shard)
        logging.info("wrote %s from %s", FLAGS.hf_dir, item)


if __name__ == "__main__":
    cli.run(main)
