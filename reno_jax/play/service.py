"""The page's operations on one run, independent of HTTP: every failure is a `PlayError(status, message)`.

Model calls are serialised by one lock (JAX on a CPU gains nothing from concurrent calls, and the restored
parameters' LRU is shared); a request that cannot get the lock within `lock_timeout` seconds is answered "busy"
instead of waiting forever. Metrics and run information never take the lock, so curves keep refreshing while
the model works.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time

import numpy as np

from reno_jax.rl import curriculum
from reno_jax.play import board_text
from reno_jax.play import policy as policy_lib
from reno_jax.play import run_dir as run_dir_lib

# Curves the page draws first, per task (those present in metrics.jsonl); every numeric key can be picked.
DEFAULT_CURVES = {
    "move": ("rollout/rewards_mean", "rollout/optimal_move_rate", "rollout/tool_call_valid_rate",
             "rollout/win_taken_rate", "rollout/illegal_rate", "train/entropy"),
    "game": ("rollout/rewards_mean", "rollout/win_rate", "rollout/draw_rate", "rollout/loss_rate",
             "rollout/tool_call_valid_rate", "train/entropy"),
}
_LIVE_SECONDS = 300  # metrics.jsonl written this recently and the run not at num_steps: shown as training


class PlayError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class PlayService:
    """Args: workdir: a training run (raises `run_dir.RunDirError` if it is not one); default_step: the step
    the page opens at (None: the latest); cache_size: restored checkpoints kept in memory."""

    def __init__(self, workdir: str, default_step: int | None = None, cache_size: int = 4,
                 lock_timeout: float = 300.0):
        self.run = run_dir_lib.RunDir(workdir)
        self._model = None  # the jitted functions, built on the first model call (a run may have no checkpoint yet)
        self.default_step = default_step
        self.task = str(self.run.config.env.task)
        self._cache_size = cache_size
        self._params = collections.OrderedDict()  # step -> params, least recently used first
        self._lock = threading.Lock()
        self._lock_timeout = lock_timeout

    @property
    def model(self) -> policy_lib.Policy:
        if self._model is None:
            self._model = policy_lib.Policy(self.run.config, self.run.tokenizer, self.run.model_config)
        return self._model

    # -- run information ------------------------------------------------------------------------------------
    def info(self) -> dict:
        steps = self.run.steps()
        try:
            rows = self.run.metrics()
        except ValueError:  # a corrupt metrics row: /api/metrics says so; the run information still answers
            rows = []
        last = int(rows[-1]["step"]) if rows else 0
        num_steps = curriculum.total_steps(self.run.config)  # a curriculum's stages included
        path = os.path.join(self.run.workdir, "metrics.jsonl")
        recent = os.path.exists(path) and time.time() - os.path.getmtime(path) < _LIVE_SECONDS
        default = self.default_step if self.default_step in steps else (steps[-1] if steps else None)
        return {
            "workdir": self.run.workdir,
            "task": self.task,
            "num_steps": num_steps,
            "last_metrics_step": last,
            "training": last < num_steps and (recent or not rows),
            "steps": steps,
            "default_step": default,
            "warm_start_step": run_dir_lib.WARM_START_STEP if run_dir_lib.WARM_START_STEP in steps else None,
            "greedy_by_default": True,
            "sampling_temperature": float(self.run.config.rollout.temperature),
        }

    def metrics(self, since: int = 0) -> dict:
        """Rows with `step > since` (numbers only; NaN/inf become None so the answer stays valid JSON)."""
        try:
            rows = self.run.metrics()
        except ValueError as e:  # a corrupt row in the middle of the file
            raise PlayError(500, f"metrics.jsonl cannot be read: {e}") from None
        keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "step"})
        new = [{k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in r.items()
                if isinstance(v, (int, float))} for r in rows if int(r.get("step", 0)) > since]
        return {"rows": new, "keys": keys, "default_keys": [k for k in DEFAULT_CURVES.get(self.task, ()) if k in keys],
                "last_step": int(rows[-1]["step"]) if rows else 0}

    # -- checkpoints ----------------------------------------------------------------------------------------
    def resolve_step(self, step: int | None) -> int:
        steps = self.run.steps()
        if not steps:
            raise PlayError(409, f"no checkpoint yet in {self.run.workdir}: the run is still starting "
                                 "(neither the warm start nor a GSPO checkpoint has been saved); try again later")
        if step is None:
            step = self.default_step if self.default_step in steps else steps[-1]
        if step not in steps:
            raise PlayError(404, f"no checkpoint at step {step}; saved steps: {steps}")
        return step

    def _params_at(self, step: int):
        if step in self._params:
            self._params.move_to_end(step)
            return self._params[step]
        try:
            params = self.run.restore_params(step)
        except run_dir_lib.CheckpointMissing as e:
            raise PlayError(404, f"{e}; saved steps: {self.run.steps()}") from None
        self._params[step] = params
        while len(self._params) > self._cache_size:
            self._params.popitem(last=False)
        return params

    # -- model ----------------------------------------------------------------------------------------------
    def _model_call(self, fn):
        if not self._lock.acquire(timeout=self._lock_timeout):
            raise PlayError(503, "the model is busy with other requests; try again in a moment")
        try:
            return fn()
        finally:
            self._lock.release()

    def policy(self, board: str, step: int | None = None, *, sampled: bool = False, seed: int = 0) -> dict:
        """Heat map, minimax-optimal squares and the model's reply on `board` (the model plays the side to move)."""
        cells = _parse(board)
        if not 0 <= seed < 2**31:
            raise PlayError(400, f"seed must be in 0..2**31-1, got {seed}")
        state = board_text.result(cells)
        if state != "ongoing":
            raise PlayError(409, f"board {board!r} is finished ({state.replace('_', ' ')}): there is no move to make")
        step = self.resolve_step(step)

        def run():
            params = self._params_at(step)
            return self.model.heat_map(params, cells), self.model.reply(params, cells, greedy=not sampled, seed=seed)

        heat, reply = self._model_call(run)
        side = board_text.side_to_move(cells)
        return {"board": board_text.format_board(cells), "step": step, "side": "xo"[side - 1], **heat,
                **policy_lib.minimax_squares(cells), **reply}

    def warm_up(self) -> None:
        """Builds the jitted functions and compiles them on the default checkpoint (if there is one yet), so the
        person's first click does not wait for XLA."""
        try:
            self.policy(board_text.EMPTY_BOARD)
        except PlayError:  # no checkpoint yet: the first request after one appears compiles instead
            pass

    def play(self, board: str, square: int | None, step: int | None = None, *, sampled: bool = False,
             seed: int = 0) -> dict:
        """The person's move `square` (1..9; None: the model moves first on `board`), then the model's reply.

        Returns the board after both moves, the game's `status` ("ongoing", "x_won", "o_won", "draw", or
        "model_illegal" / "model_invalid": the model's call was refused, which loses the game as in training)
        and the model's turn (`model`, the `policy` answer for the position it faced; None if it did not move).
        """
        cells = _parse(board)
        state = board_text.result(cells)
        if state != "ongoing":
            raise PlayError(409, f"the game is over ({state.replace('_', ' ')}); start a new one")
        if square is not None:
            if not 1 <= int(square) <= 9:
                raise PlayError(400, f"square must be 1..9, got {square}")
            if cells[square - 1] != 0:
                raise PlayError(409, f"square {square} is taken; choose an empty square")
            cells[square - 1] = board_text.side_to_move(cells)
        after_person = board_text.format_board(cells)
        status = board_text.result(cells)
        model = None
        if status == "ongoing":
            model = self.policy(after_person, step, sampled=sampled, seed=seed)
            if model["verdict"] == "legal":
                status = board_text.result(board_text.parse_board(model["board_after"]))
            else:
                status = f"model_{model['verdict']}"
        return {"board": model["board_after"] if model else after_person, "after_person": after_person,
                "person_square": square, "status": status, "model": model}


def _parse(board: str) -> np.ndarray:
    try:
        return board_text.parse_board(board)
    except board_text.BoardError as e:
        raise PlayError(400, str(e)) from None
