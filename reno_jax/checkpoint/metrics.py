"""Training metrics: one JSON object per step in ``metrics.jsonl``, TensorBoard scalars, learning-curve PNGs.

``MetricsWriter(workdir, start_step)`` keeps the jsonl consistent across restarts: rows with ``step >
start_step`` (written after the checkpoint that the run resumed from) are dropped on open, so the file holds
exactly one row per step however often the run was interrupted. TensorBoard events are purged the same way
(``purge_step``).
"""

from __future__ import annotations

import json
import math
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_SUBDIR = "tensorboard"


def _to_scalar(name: str, value: Any) -> float | int | bool:
    """Python scalar from a number / numpy / jax scalar (size-1 arrays allowed); TypeError otherwise."""
    if isinstance(value, (bool, int, float)):
        return value
    arr = np.asarray(value)  # also pulls jax arrays to the host
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        raise TypeError(
            f"metric {name!r} must be a numeric scalar, got {type(value).__name__} of shape "
            f"{arr.shape} and dtype {arr.dtype}"
        )
    return arr.reshape(()).item()


def read_metrics(jsonl_path: str) -> list[dict]:
    """Rows of a metrics.jsonl file (a truncated last line, e.g. from a crash mid-write, is ignored)."""
    rows = []
    if not os.path.exists(jsonl_path):
        return rows
    with open(jsonl_path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{jsonl_path}:{i + 1}: corrupt metrics row") from None
    return rows


class MetricsWriter:
    """Appends ``{"step": s, **metrics}`` rows to ``<workdir>/metrics.jsonl`` and TensorBoard scalars.

    Args:
      workdir: run directory (created if needed).
      start_step: the step training (re)starts from, i.e. the restored checkpoint's step (0 for a fresh run).
        Existing rows with ``step > start_step`` are dropped (rewritten atomically); a fresh run (0) starts an
        empty file.
      tensorboard: also write TensorBoard event files under ``<workdir>/tensorboard`` (tensorboardX).
    """

    def __init__(self, workdir: str, start_step: int = 0, *, tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, METRICS_FILE)
        start_step = int(start_step)
        kept = {}
        for row in read_metrics(self.path):
            if int(row["step"]) <= start_step:
                kept[int(row["step"])] = row  # the last row wins if an older file has duplicates
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for step in sorted(kept):
                f.write(json.dumps(kept[step]) + "\n")
        os.replace(tmp, self.path)
        self._last_step = max(kept) if kept else start_step
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: only needed when enabled

            # purge_step drops events of the steps that will be re-run after a restart.
            self._tb = SummaryWriter(
                os.path.join(workdir, TENSORBOARD_SUBDIR), purge_step=start_step + 1 if start_step > 0 else None
            )

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Writes one row. ``metrics``: name -> numeric scalar (python, numpy or jax). Non-finite values are
        stored as JSON ``null`` (strict JSON has no NaN). Steps must increase. Returns the row."""
        step = int(step)
        if step <= self._last_step:
            raise ValueError(f"metrics step {step} is not after the last written step {self._last_step}")
        row: dict[str, Any] = {"step": step}
        for name, value in metrics.items():
            if name == "step":
                continue
            v = _to_scalar(name, value)
            if self._tb is not None:
                self._tb.add_scalar(name, float(v), global_step=step)
            row[name] = v if not isinstance(v, float) or math.isfinite(v) else None
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._last_step = step
        return row

    def flush(self) -> None:
        self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ema(values: np.ndarray, smoothing: float) -> np.ndarray:
    """Exponential moving average that skips NaNs (TensorBoard-style smoothing, debiased)."""
    out = np.full_like(values, np.nan)
    acc, weight = 0.0, 0.0
    for i, v in enumerate(values):
        if np.isfinite(v):
            acc = smoothing * acc + (1 - smoothing) * v
            weight = smoothing * weight + (1 - smoothing)
            out[i] = acc / weight
    return out


def plot_learning_curves(
    jsonl_path: str,
    png_path: str,
    keys: Sequence[str] | None = None,
    *,
    ncols: int = 3,
    smoothing: float = 0.0,
    title: str | None = None,
) -> str:
    """Plots a grid of small panels, one per metric, against ``step``; returns ``png_path``.

    Args:
      keys: metrics to plot, in panel order (default: every numeric key, in first-seen order). A key with no
        data gets an empty panel saying so.
      ncols: panels per row.
      smoothing: in [0, 1); > 0 draws the raw curve faintly and an EMA-smoothed one on top.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg without touching the global backend
    from matplotlib.figure import Figure

    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    rows = read_metrics(jsonl_path)
    if keys is None:
        keys = []
        for row in rows:
            keys.extend(
                k
                for k, v in row.items()
                if k != "step" and k not in keys and (v is None or isinstance(v, (int, float)))
            )
    keys = list(keys)
    if not keys:
        raise ValueError(f"nothing to plot: no metric keys in {jsonl_path}")
    steps = np.array([row["step"] for row in rows], dtype=np.float64)
    # A curriculum's rows carry their stage: a dashed line where a new stage starts.
    stage_ids = [row.get("stage") for row in rows]
    boundaries = [
        steps[i] - 0.5 for i in range(1, len(rows)) if stage_ids[i] is not None and stage_ids[i] != stage_ids[i - 1]
    ]
    ncols = max(1, min(ncols, len(keys)))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(3.4 * ncols, 2.5 * nrows), dpi=110)
    FigureCanvasAgg(fig)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        vals = np.array([np.nan if row.get(key) is None else float(row[key]) for row in rows], dtype=np.float64)
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        for x in boundaries:
            ax.axvline(x, color="gray", linestyle="--", linewidth=0.8)
        finite = np.isfinite(vals)
        if not finite.any():
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, fontsize=8, color="gray")
            continue
        marker = "." if finite.sum() <= 50 else None
        if smoothing > 0:
            ax.plot(steps[finite], vals[finite], color="C0", alpha=0.3, linewidth=0.8)
            sm = _ema(vals, smoothing)
            ax.plot(steps[finite], sm[finite], color="C0", linewidth=1.4)
        else:
            ax.plot(steps[finite], vals[finite], color="C0", linewidth=1.2, marker=marker, markersize=3)
        if i >= len(keys) - ncols:
            ax.set_xlabel("step", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    # Written next to the target and renamed over it: a reader (the play page, an image viewer) never sees half a
    # PNG while a run refreshes its curves.
    tmp = f"{png_path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, png_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return png_path


class CurvePlotter:
    """Refreshes a learning-curve PNG from a metrics.jsonl on a background thread.

    Drawing the panels costs about 1.5 s of Python on a small CPU; done inline every few steps that was a tenth of
    a training run. ``request()`` starts a redraw unless one is still drawing (then that one is current enough);
    ``close()`` waits for it and draws once more, so the file ends with every row. An error while drawing is
    raised by the next ``request()`` or by ``close()``, not lost.
    """

    def __init__(self, jsonl_path: str, png_path: str, keys: Sequence[str] | None = None, **plot_kwargs):
        self.jsonl_path, self.png_path = jsonl_path, png_path
        self.keys = None if keys is None else tuple(keys)
        self._kwargs = plot_kwargs
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _draw(self) -> None:
        try:
            plot_learning_curves(self.jsonl_path, self.png_path, self.keys, **self._kwargs)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
            self._error = e

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def request(self, keys: Sequence[str] | None = None) -> bool:
        """Starts a redraw in the background; returns False (and does nothing) while one is running."""
        self._raise_pending()
        if keys is not None:
            self.keys = tuple(keys)
        if self.busy():
            return False
        self._thread = threading.Thread(target=self._draw, name="curve-plotter", daemon=True)
        self._thread.start()
        return True

    def close(self, keys: Sequence[str] | None = None, *, final: bool = True) -> None:
        """Waits for a running redraw, then (``final``) draws the last one in this thread."""
        if keys is not None:
            self.keys = tuple(keys)
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()
        if final:
            plot_learning_curves(self.jsonl_path, self.png_path, self.keys, **self._kwargs)
