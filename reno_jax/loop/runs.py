"""Saved training runs: a workdir's config and a checkpoint's parameters, on any mesh."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

from reno_jax import parallel, run_config
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.errors import ConfigError, RunError
from reno_jax.loop import adapters, build, recipe, tokenizers, warmstart
from reno_jax.rl import trainer


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """One checkpoint of a training run: `trained` is what the run trains (`TrainState.params`: the model's
    params, or a LoRA run's adapters) and `base` a LoRA run's frozen base (None otherwise)."""

    config: run_config.RunConfig
    tokenizer: Any
    model_config: Any
    trained: Any
    base: Any
    step: int

    @property
    def params(self):
        """The params the model runs (a LoRA run's adapters applied in the layers, as in training)."""
        return adapters.model_params(self.config, self.trained, self.base)

    def merged_params(self):
        """Plain float params (a LoRA run's adapters merged into its base, int8 dequantized): an export's."""
        return adapters.merged_params(self.config, self.trained, self.base)


def load_run(workdir: str, step: int | None = None, mesh_config: parallel.MeshConfig | None = None):
    """(config, tokenizer, model_config, params, step) of a checkpoint of the training run in `workdir`
    (`load_checkpoint`'s, with the params the model runs)."""
    run = load_checkpoint(workdir, step, mesh_config)
    return run.config, run.tokenizer, run.model_config, run.params, run.step


def read_run_config(workdir: str) -> run_config.RunConfig:
    """The typed config of the training run in `workdir` (its `config.json`, written by this code or older code:
    `run_config.upgrade`). Raises `RunError` for a workdir without a run or a `config.json` that cannot be read."""
    if not os.path.isdir(workdir):
        raise RunError(f"--workdir={workdir} does not exist; expected the workdir of a training run")
    config_path = os.path.join(workdir, "config.json")
    if not os.path.isfile(config_path):
        raise RunError(
            f"--workdir={workdir} holds no training run (no config.json); train one with "
            f"python -m experiments.train --config=... --workdir={workdir}"
        )
    try:
        with open(config_path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise RunError(f"{config_path} is not readable JSON: {error}") from None
    try:
        return run_config.upgrade(saved)
    except ConfigError as error:
        raise RunError(f"{config_path} is not a config this code can run: {error}") from None


def load_warm_start(workdir: str, mesh_config: parallel.MeshConfig | None = None) -> SavedRun:
    """The warm start of the training run in `workdir` (its cache, `<workdir>/warmstart`) as a step-0 run: what
    GSPO started from, to evaluate beside the run's checkpoints. Raises `RunError` for a run without a warm
    start (none configured, or its cache is gone)."""
    config = read_run_config(workdir)
    if not warmstart.runs_warm_start(config):
        raise RunError(f"--workdir={workdir}: this run has no warm start (sft.num_steps=0 or a model.path)")
    path = os.path.abspath(os.path.join(workdir, warmstart.CACHE_SUBDIR))
    if not os.path.isdir(path):
        raise RunError(
            f"--workdir={workdir}: the warm-start cache {path} is missing (a run writes it before its first GSPO step)"
        )
    tokenizer = tokenizers.run_tokenizer(config, workdir)  # the one the run saved
    model_config, abstract = build.abstract_model(config, tokenizer)
    layout = parallel.Layout.create(model_config, mesh_config)
    if adapters.trains_adapters(config):  # the run's base (int8 where it trains over int8), with fresh adapters:
        base = adapters.restore_base(config, workdir, tokenizer, layout)  # B is zero: the model is the base itself
        return SavedRun(config, tokenizer, model_config, adapters.init_trained(config, base), base, 0)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, layout.param_shardings
    )
    params = ckpt_lib.restore_item(path, {"params": abstract})["params"]
    return SavedRun(config, tokenizer, model_config, params, None, 0)


def load_checkpoint(workdir: str, step: int | None = None, mesh_config: parallel.MeshConfig | None = None) -> SavedRun:
    """A checkpoint of the training run in `workdir` (default: the newest).

    The restore target is built from shapes alone (`abstract_model`): no weights are drawn or read before the
    checkpoint's. The params land on `mesh_config`'s mesh (default: one device), whatever mesh or number of
    processes wrote the checkpoint. A LoRA run's checkpoint holds its adapters; its base is rebuilt
    (`adapters.restore_base`). Raises `RunError` for a workdir without a run, a run without a checkpoint yet, or a
    `step` that has none (the message lists the saved steps).
    """
    config = read_run_config(workdir)
    tokenizer = tokenizers.run_tokenizer(config, workdir)  # the one the run saved
    model_config, abstract_params = build.abstract_model(config, tokenizer)
    optimizer = recipe.make_optimizer(config)
    layout = parallel.Layout.create(model_config, mesh_config)
    abstract = layout.abstract_state(
        jax.eval_shape(
            lambda p: trainer.create_train_state(adapters.init_trained(config, p), optimizer, 0), abstract_params
        )
    )
    with ckpt_lib.Checkpointer(workdir, async_save=False) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise RunError(
                f"--workdir={workdir} has no checkpoint yet under {ckpt_lib.CHECKPOINT_SUBDIR}/ "
                f"(a run saves one every checkpoint_every steps)"
            )
        if step is not None and step not in steps:
            raise RunError(f"--step={step} has no checkpoint in {workdir}; saved steps: {steps}")
        step = steps[-1] if step is None else step
        state = ckpt.restore(abstract, step=step)
    base = adapters.restore_base(config, workdir, tokenizer, layout) if adapters.trains_adapters(config) else None
    return SavedRun(config, tokenizer, model_config, state.params, base, step)
