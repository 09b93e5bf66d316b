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


class RestoreError(ValueError):
    """A checkpoint that does not fit the state it is restored into (another model: other shapes or leaves).
    The message names the leaves and both shapes; nothing was restored and nothing on disk was changed."""


def check_fits(saved: Any, target: Any, what: str) -> None:
    """Raises `RestoreError` unless the saved tree (Orbax metadata: `ArrayMetadata` leaves) has exactly the
    leaves of `target` (arrays or `jax.ShapeDtypeStruct`s) with the same shapes. Dtypes may differ (Orbax
    casts), so a run may resume in another parameter dtype; shapes and structure may not.

    Orbax itself only says "Requested shape (4, 2) is not compatible with the stored shape (4, 3)" without the
    leaf, after starting every read; this names the parameter first (`params/...`) and reads nothing.
    """

    def flat(tree):
        return {"/".join(map(str, k)): v for k, v in ocp.tree.to_flat_dict(tree).items()}

    saved = flat(saved)
    wanted = flat(ocp.tree.serialize_tree(_abstract(target), keep_empty_nodes=True))
    params_first = lambda k: (not k.startswith("params/"), k)  # noqa: E731
    shapes = sorted(
        (k for k in wanted if k in saved and tuple(saved[k].shape) != tuple(wanted[k].shape)), key=params_first
    )
    only_saved = sorted(set(saved) - set(wanted), key=params_first)
    only_here = sorted(set(wanted) - set(saved), key=params_first)
    if not (shapes or only_saved or only_here):
        return
    problems = [f"{k} is {list(saved[k].shape)} in the checkpoint but {list(wanted[k].shape)} here" for k in shapes[:3]]
    if len(shapes) > 3:
        problems.append(f"{len(shapes) - 3} more leaves have other shapes")
    for names, where in (
        (only_saved, "the checkpoint has {n} leaves this model lacks"),
        (only_here, "this model has {n} leaves the checkpoint lacks"),
    ):
        if names:
            problems.append(where.format(n=len(names)) + f" (e.g. {', '.join(names[:2])})")
    raise RestoreError(
        f"{what} does not fit this model: "
        + "; ".join(problems)
        + " (was it written with another model config? nothing was restored)"
    )


class Checkpointer:
    """Saves / restores a ``TrainState`` and the run config under ``<workdir>/checkpoints``.

    Args:
      workdir: run directory (created if needed).
      max_to_keep: keep the newest K checkpoints (``None`` keeps all).
      save_interval_steps: ``save`` (without ``force``) only writes when ``step % N == 0``.
      async_save: write in a background thread (call ``wait``/``close`` before reading or exiting).
    """

    def __init__(
        self,
        workdir: str,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        subdir: str = CHECKPOINT_SUBDIR,
    ):
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        self.directory = os.path.abspath(os.path.join(workdir, subdir))
        self.save_interval_steps = int(save_interval_steps)
        # The interval is applied in ``save`` (orbax would also save the very first step it sees, whatever it is).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
        )
        # The item handlers are named up front so that `item_metadata` can read a checkpoint before any restore.
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler()},
        )

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
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(to_jsonable(config) or {})
        )
        return bool(self._manager.save(step, args=args, force=True))

    def restore(self, target_state: Any, step: int | None = None) -> Any | None:
        """Restores the checkpoint at ``step`` (default: the latest) with the structure, dtypes and shardings of
        ``target_state`` (concrete or ``jax.ShapeDtypeStruct`` leaves): onto the target's mesh, whatever mesh or
        number of processes wrote it. Returns ``None`` if there is none; raises `RestoreError` (naming the leaf
        and both shapes) if the checkpoint holds another model, before reading anything."""
        self.wait()
        step = self._manager.latest_step() if step is None else step
        if step is None:
            return None
        check_fits(
            self._manager.item_metadata(step)["state"].tree, target_state, f"checkpoint {step} in {self.directory}"
        )
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(target_state)))
        )
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


def check_item(path: str, target: Any) -> None:
    """`check_fits` for an ``ocp.StandardCheckpointer`` item (such as the training script's cached warm start)."""
    checkpointer = ocp.StandardCheckpointer()
    try:
        check_fits(checkpointer.metadata(path).item_metadata.tree, target, f"the checkpoint in {path}")
    finally:
        checkpointer.close()


def restore_item(path: str, target: Any) -> Any:
    """An ``ocp.StandardCheckpointer`` item restored with the structure, dtypes and shardings of ``target``;
    raises `RestoreError` if it holds another model."""
    check_item(path, target)
    checkpointer = ocp.StandardCheckpointer()
    try:
        return checkpointer.restore(path, _abstract(target))
    finally:
        checkpointer.close()


def load_config(workdir: str, step: int | None = None, *, subdir: str = CHECKPOINT_SUBDIR) -> dict | None:
    """The config JSON saved with the latest (or given) checkpoint under ``workdir``, or None."""
    if not os.path.isdir(os.path.join(workdir, subdir)):
        return None
    with Checkpointer(workdir, subdir=subdir, async_save=False) as ckpt:
        return ckpt.restore_config(step)
