"""Saved training runs: a workdir's config and a checkpoint's parameters, on any mesh."""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from reno_jax import parallel
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.errors import RunError
from reno_jax.loop import build
from reno_jax.rl import recipe, trainer


def load_run(workdir: str, step: int | None = None, mesh_config: parallel.MeshConfig | None = None):
    """(config, tokenizer, model_config, params, step) of a checkpoint of the training run in `workdir`.

    The restore target is built from shapes alone (`abstract_model`): no weights are drawn or read before the
    checkpoint's. The params land on `mesh_config`'s mesh (default: one device), whatever mesh or number of
    processes wrote the checkpoint. Raises `RunError` for a workdir without a run, a run without a checkpoint yet, or a `step`
    that has none (the message lists the saved steps).
    """
    if not os.path.isdir(workdir):
        raise RunError(f"--workdir={workdir} does not exist; expected the workdir of a training run")
    config_path = os.path.join(workdir, "config.json")
    if not os.path.isfile(config_path):
        raise RunError(f"--workdir={workdir} holds no training run (no config.json); train one with "
                       f"python -m experiments.train --config=... --workdir={workdir}")
    with open(config_path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    tokenizer = build.build_tokenizer(config)
    model_config, abstract_params = build.abstract_model(config, tokenizer)
    optimizer = recipe.make_optimizer(config)
    layout = parallel.Layout.create(model_config, mesh_config)
    abstract = layout.abstract_state(
        jax.eval_shape(lambda p: trainer.create_train_state(p, optimizer, 0), abstract_params))
    with ckpt_lib.Checkpointer(workdir, async_save=False) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise RunError(f"--workdir={workdir} has no checkpoint yet under {ckpt_lib.CHECKPOINT_SUBDIR}/ "
                           f"(a run saves one every checkpoint_every steps)")
        if step is not None and step not in steps:
            raise RunError(f"--step={step} has no checkpoint in {workdir}; saved steps: {steps}")
        step = steps[-1] if step is None else step
        state = ckpt.restore(abstract, step=step)
    return config, tokenizer, model_config, state.params, step
