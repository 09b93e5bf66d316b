"""A small wrapper around ``orbax.checkpoint.CheckpointManager`` for training runs.

Layout: ``<workdir>/checkpoints/<step>/{state,config}``: ``state`` is the whole ``TrainState`` pytree (params,
optimizer state, step, skipped-update counter, rng key), ``config`` the run configuration as JSON.

Saves are atomic (orbax writes into a temporary directory and renames it once complete, so a crash mid-save
leaves the previous checkpoint as the latest one) and asynchronous (``save`` returns while the files are
written; ``wait``/``close`` block until they are). The last ``max_to_keep`` checkpoints are kept.

Usage::

    ckpt = Checkpointer(workdir, max_to_keep=3, save_interval_steps=100)
    state = ckpt.restore(state) or state           # resume if a checkpoint exists (or use restore_latest)
    for ...:
        state, metrics = train_step(state, batch)
        ckpt.save(state, config)                   # only every save_interval_steps
    ckpt.save(state, config, force=True)           # and at the end
    ckpt.close()
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINT_SUBDIR = "checkpoints"


def to_jsonable(config: Any) -> Any:
    """Converts a config (dict, ``ml_collections.ConfigDict``, dataclass, numpy scalars, tuples) to plain JSON.

    Values JSON cannot hold (callables, arbitrary objects) become their ``repr`` so a save never fails on them.
    """
    if config is None:
        return None
    if hasattr(config, "to_dict") and callable(config.to_dict):  # ml_collections ConfigDict / FrozenConfigDict
        config = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if isinstance(config, dict):
        return {str(k): to_jsonable(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_jsonable(v) for v in config]
    if isinstance(config, (np.generic, np.ndarray, jax.Array)) and np.ndim(config) == 0:
        return np.asarray(config).item()
    if isinstance(config, (np.ndarray, jax.Array)):
        return np.asarray(config).tolist()
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    return repr(config)


def _abstract(target_state: Any) -> Any:
    """Shape/dtype(/sharding) skeleton of a state: restoring into it never needs the target's buffers."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)


class Checkpointer:
    """Saves / restores a ``TrainState`` and the run config under ``<workdir>/checkpoints``.

    Args:
      workdir: run directory (created if needed).
      max_to_keep: keep the newest K checkpoints (``None`` keeps all).
      save_interval_steps: ``save`` (without ``force``) only writes when ``step % N == 0``.
      async_save: write in a background thread (call ``wait``/``close`` before reading or exiting).
    """

    def __init__(self, workdir: str, *, max_to_keep: int | None = 3, save_interval_steps: int = 1,
                 async_save: bool = True, subdir: str = CHECKPOINT_SUBDIR):
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        self.directory = os.path.abspath(os.path.join(workdir, subdir))
        self.save_interval_steps = int(save_interval_steps)
        # The interval is applied in ``save`` (orbax would also save the very first step it sees, whatever it is).
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # -- queries ---------------------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    # -- save / restore --------------------------------------------------------------------------------------
    def save(self, state: Any, config: Any = None, *, step: int | None = None, force: bool = False) -> bool:
        """Saves ``state`` (and ``config`` as JSON) at ``step`` (default ``int(state.step)``).

        Without ``force`` this is a no-op unless ``step`` is a multiple of ``save_interval_steps``; with
        ``force`` (end of training) it always saves, unless a checkpoint for ``step`` already exists.
        Returns whether a save was started.
        """
        step = int(state.step) if step is None else int(step)
        if (not force and step % self.save_interval_steps) or step in self._manager.all_steps():
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  config=ocp.args.JsonSave(to_jsonable(config) or {}))
        return bool(self._manager.save(step, args=args, force=True))

    def restore(self, target_state: Any, step: int | None = None) -> Any | None:
        """Restores the checkpoint at ``step`` (default: the latest) with the structure, dtypes and shardings of
        ``target_state`` (concrete or ``jax.ShapeDtypeStruct`` leaves). Returns ``None`` if there is none."""
        self.wait()
        step = self._manager.latest_step() if step is None else step
        if step is None:
            return None
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(target_state))))
        return restored.state

    def restore_config(self, step: int | None = None) -> dict | None:
        """The JSON config saved with ``step`` (default: the latest), or ``None`` without checkpoints."""
        self.wait()
        step = self._manager.latest_step() if step is None else step
        if step is None:
            return None
        return self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config

    # -- lifecycle -------------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def restore_latest(workdir: str, target_state: Any, *, subdir: str = CHECKPOINT_SUBDIR) -> Any | None:
    """The latest ``TrainState`` saved under ``<workdir>/checkpoints`` (shaped like ``target_state``), or None."""
    if not os.path.isdir(os.path.join(workdir, subdir)):
        return None
    with Checkpointer(workdir, subdir=subdir, async_save=False) as ckpt:
        return ckpt.restore(target_state)


def load_config(workdir: str, step: int | None = None, *, subdir: str = CHECKPOINT_SUBDIR) -> dict | None:
    """The config JSON saved with the latest (or given) checkpoint under ``workdir``, or None."""
    if not os.path.isdir(os.path.join(workdir, subdir)):
        return None
    with Checkpointer(workdir, subdir=subdir, async_save=False) as ckpt:
        return ckpt.restore_config(step)
