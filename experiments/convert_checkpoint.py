r"""Convert a Ling-3.0 (bailing_hybrid) checkpoint between HF safetensors and an orbax checkpoint.

  python -m experiments.convert_checkpoint --direction=hf_to_orbax --hf_dir=/ckpt/Ling-3.0-tiny \
      --orbax_dir=/ckpt/ling3_orbax --dtype=float32
  python -m experiments.convert_checkpoint --direction=orbax_to_hf --orbax_dir=/ckpt/ling3_orbax \
      --hf_dir=/ckpt/ling3_hf_out [--shard_size_mb=4096]

Orbax layout: `<orbax_dir>/state` is an `ocp.StandardCheckpointer` item holding `{'params': params}` (the Flax
layout of reno_jax.models.conversion) and `<orbax_dir>/config.json` is the HF config beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import flags, logging

from experiments import cli
from reno_jax.models import conversion

ORBAX_ITEM = "state"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "keep": None}

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (config.json + safetensors).")
flags.DEFINE_string("orbax_dir", None, "Orbax directory (state/ + config.json).")
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


def orbax_to_hf(
    orbax_dir: str | Path, hf_dir: str | Path, dtype: Any = None, shard_size_bytes: int | None = None
) -> None:
    """`<orbax_dir>/state` + config.json -> HF directory (published names, shapes; param dtypes unless `dtype`)."""
    orbax_dir = Path(orbax_dir).absolute()
    raw = conversion.read_config_dict(orbax_dir)
    config = conversion.as_config(raw)
    item = orbax_dir / ORBAX_ITEM
    if not item.is_dir():
        raise conversion.CheckpointError(f"no orbax checkpoint at {str(item)!r}")
    checkpointer = ocp.StandardCheckpointer()
    state = checkpointer.restore(item)
    checkpointer.close()
    if not isinstance(state, dict) or "params" not in state:
        raise conversion.CheckpointError(f"orbax checkpoint {str(item)!r} holds no 'params' entry")
    conversion.save_pretrained(state["params"], config, hf_dir, shard_size_bytes=shard_size_bytes, dtype=dtype)


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
        orbax_to_hf(FLAGS.orbax_dir, FLAGS.hf_dir, dtype=dtype, shard_size_bytes=shard)
        logging.info("wrote %s", FLAGS.hf_dir)


if __name__ == "__main__":
    cli.run(main)
