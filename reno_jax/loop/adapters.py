"""What a run trains: the whole model (`config.lora.rank` 0), or LoRA adapters over a frozen base.

A LoRA run (`lora.rank > 0`):

* The base is `model.path`'s checkpoint (read straight into int8 with `model.quantize="int8"`), else the
  embedded tiny model drawn from `seed` and supervised-warm-started (a full fine-tune, cached in
  `<workdir>/warmstart`), then quantized with `model.quantize`. It is never trained and never checkpointed: the
  run's config (saved with every checkpoint) and the warm-start cache rebuild it bit for bit, for a resume, an
  evaluation, the play page or an export (`restore_base`).
* `TrainState.params` is the adapter tree (`lora.init_adapters`: B = 0, so RL starts exactly at the base); the
  optimizer state covers the adapters only, and checkpoints hold that state, nothing base-sized.
* The rollout, the train step and evaluation all run `policy.Adapted(...)(adapters, base)`: the base with
  `lora.LoraKernel` leaves that the model's matmuls apply in the layer (the same weights in all three).
* An export is the merged model (`merged_params`): W + (alpha / r) A @ B, an int8 base dequantized.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from reno_jax import run_config
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.errors import RunError
from reno_jax.loop import build, warmstart
from reno_jax.models import lora, quant
from reno_jax.rl import policy

# Folded into the seed's key for the adapters' A: a stream of its own, so a LoRA run draws the same base as the
# full fine-tune of the same seed.
ADAPTER_KEY_TAG = 0x4C6F5241


# One program for the whole tree (op by op, each weight shape would compile its own handful of small programs).
_quantize = jax.jit(quant.quantize)


def trains_adapters(config) -> bool:
    return build.lora_config(config).rank > 0


def adapter_key(config) -> jax.Array:
    return jax.random.fold_in(jax.random.PRNGKey(run_config.load(config).seed), ADAPTER_KEY_TAG)


def combine(config) -> policy.Adapted | None:
    """`combine(adapters, base) -> params` of the learner and train step (None: the run trains the model)."""
    lc = build.lora_config(config)
    return policy.Adapted(lc) if lc.rank else None


def frozen_base(config, params):
    """The base a LoRA run trains over: `params` (the model built and warm-started), int8 with `model.quantize`
    (a checkpoint read with `build_model` is int8 already)."""
    if not build.quantization(config):
        return params
    already = any(
        isinstance(x, quant.QArray) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.QArray))
    )
    return params if already else _quantize(params)


def init_trained(config, params) -> Any:
    """The tree a fresh run trains: `params` itself, or fresh adapters for them (`params` may be the base, float
    or int8, or `jax.ShapeDtypeStruct`s: the adapters depend on the shapes and the seed only)."""
    lc = build.lora_config(config)
    return lora.init_adapters(params, lc, adapter_key(config)) if lc.rank else params


def model_params(config, trained, base):
    """The params the model runs: `trained` itself, or the base with the adapters applied in the layers."""
    adapted = combine(config)
    return trained if adapted is None else adapted(trained, base)


def merged_params(config, trained, base):
    """Plain float params of the trained model (what an HF export writes): the adapters merged into the base,
    every int8 weight dequantized."""
    lc = build.lora_config(config)
    merged = lora.merge(base, trained, lc) if lc.rank else trained
    return quant.dequantize(merged)


def restore_base(config, workdir: str, tokenizer, layout=None):
    """The frozen base of the LoRA run in `workdir`, rebuilt as the run built it: `model.path`'s weights, or the
    warm start cached in `<workdir>/warmstart` (bit for bit), or the model drawn from `seed` when the run has no
    warm start; then int8 with `model.quantize`. Raises `RunError` when the warm-start cache is missing."""
    config = run_config.load(config)
    if config.model.path or not warmstart.runs_warm_start(config):
        _, params = build.build_model(config, build.run_keys(config)[0], tokenizer, layout)
        return frozen_base(config, params)
    path = os.path.abspath(os.path.join(workdir, warmstart.CACHE_SUBDIR))
    if not os.path.isdir(path):
        raise RunError(
            f"--workdir={workdir} is a LoRA run (lora.rank={build.lora_config(config).rank}) whose "
            f"checkpoints hold the adapters only; their base, the warm start cached in {path}, is missing"
        )
    _, abstract = build.abstract_model(config, tokenizer)
    if layout is not None:
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, layout.param_shardings
        )
    return frozen_base(config, ckpt_lib.restore_item(path, {"params": abstract})["params"])


def count_trained(config, abstract_params) -> dict:
    """{kind: adapter parameters} and 'total' of a LoRA run, from the params' shapes; {} for a full fine-tune."""
    lc = build.lora_config(config)
    return lora.count_adapter_params(abstract_params, lc) if lc.rank else {}
