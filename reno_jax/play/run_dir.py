"""A read-only view of a training workdir (as `reno_jax.loop.train` writes it).

Nothing here writes into the workdir: the run may still be training into it. Checkpoint steps are found by
listing `checkpoints/` (Orbax writes a step into a temporary directory and renames it to the bare step number
once complete, so only all-digit names are finished checkpoints); the supervised warm start in `warmstart/` is
step 0, the policy RL starts from. A step can disappear while we look (the run keeps only its newest few).
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from reno_jax.checkpoint import metrics as metrics_lib
from reno_jax.checkpoint import orbax as ckpt_lib
from reno_jax.loop import adapters, build, recipe, tokenizers
from reno_jax.loop.runs import read_run_config
from reno_jax.rl import trainer

WARM_START_STEP = 0
WARM_START_SUBDIR = "warmstart"
_COMMITTED = "_CHECKPOINT_METADATA"  # written by Orbax when a checkpoint directory is complete


class CheckpointMissing(FileNotFoundError):
    """A step that has no (longer a) checkpoint."""


class RunDir:
    """Config, checkpoint steps, parameters and metrics of one workdir."""

    def __init__(self, workdir: str):
        self.workdir = os.path.abspath(workdir)
        self.config = read_run_config(self.workdir)  # RunError for a workdir that holds no run
        self.tokenizer = tokenizers.run_tokenizer(self.config, self.workdir)  # the one the run saved
        self.model_config, self._abstract_params = build.abstract_model(self.config, self.tokenizer)
        optimizer = recipe.make_optimizer(self.config)
        # The restore target of a checkpoint's TrainState, from shapes only (nothing is initialised); a LoRA run's
        # holds its adapters, whose frozen base is rebuilt once, when a checkpoint is first read.
        self._abstract_state = jax.eval_shape(
            lambda p: trainer.create_train_state(
                adapters.init_trained(self.config, p), optimizer, jax.random.PRNGKey(0)
            ),
            self._abstract_params,
        )
        self._base = None

    # -- steps ----------------------------------------------------------------------------------------------
    def _step_dir(self, step: int) -> str:
        if step == WARM_START_STEP:
            return os.path.join(self.workdir, WARM_START_SUBDIR)
        return os.path.join(self.workdir, ckpt_lib.CHECKPOINT_SUBDIR, str(step))

    def steps(self) -> list[int]:
        """Complete checkpoint steps, ascending; 0 is the warm start when the run has one."""
        found = []
        if os.path.isfile(os.path.join(self._step_dir(WARM_START_STEP), _COMMITTED)):
            found.append(WARM_START_STEP)
        try:
            names = os.listdir(os.path.join(self.workdir, ckpt_lib.CHECKPOINT_SUBDIR))
        except FileNotFoundError:
            names = []
        for name in names:
            if name.isdigit() and int(name) > 0 and os.path.isfile(os.path.join(self._step_dir(int(name)), _COMMITTED)):
                found.append(int(name))
        return sorted(found)

    # -- parameters -----------------------------------------------------------------------------------------
    def restore_params(self, step: int):
        """The policy parameters saved at `step` (0: the warm start). Raises `CheckpointMissing`."""
        directory = self._step_dir(step)
        if step not in self.steps():
            raise CheckpointMissing(f"no checkpoint at step {step}")
        checkpointer = ocp.StandardCheckpointer()
        try:
            if step == WARM_START_STEP:
                return checkpointer.restore(directory, {"params": self._abstract_params})["params"]
            trained = checkpointer.restore(os.path.join(directory, "state"), self._abstract_state).params
        except Exception:
            if os.path.isdir(directory):
                raise
            # Deleted between the listing and the read (the run keeps only its newest `keep_checkpoints`);
            # Orbax reports that with various exception types, so the directory itself is the test.
            raise CheckpointMissing(f"checkpoint {step} was removed by the run while it was being read") from None
        finally:
            checkpointer.close()
        if adapters.trains_adapters(self.config) and self._base is None:
            self._base = adapters.restore_base(self.config, self.workdir, self.tokenizer)
        return adapters.model_params(self.config, trained, self._base)

    # -- metrics --------------------------------------------------------------------------------------------
    def metrics(self) -> list[dict]:
        """Rows of `metrics.jsonl` (a half-written last line of a live run is left for the next read)."""
        return metrics_lib.read_metrics(os.path.join(self.workdir, metrics_lib.METRICS_FILE))
