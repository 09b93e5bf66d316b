r"""A local web page for a training run: play against a checkpoint, see what the policy thinks, watch it learn.

  python -m experiments.play --workdir=workdir/tiny                  # then open the printed URL
  python -m experiments.play --workdir=workdir/tiny --port=8080 --step=550

The page (no network needed: plain HTML/JS/CSS shipped in `reno_jax/play/static`) works for any environment.
One that declares a board view (`reno_jax.envs.interface.BoardView`) gets its board: you play the model by
clicking a cell or dropping in a column (the model plays the side the run trained it on), with the policy's
probability for each move at its decision token before each of its moves (best moves starred, where the game
declares them) and the model's raw turn and the environment's answer. One that declares a puzzle view
(`interface.PuzzleView`, a one-player puzzle) gets its puzzles: you move with the arrow keys against the move
budget, ask the model for a move (with the same heat map) or let it play on to the end. Any other environment gets
transcripts: an episode of its sampler or of an evaluation suite, played by the chosen checkpoint. All show the
run's curves refreshed live from `metrics.jsonl` and pick among the saved checkpoints (0 = the supervised warm
start). The workdir may still be training. The JSON API the page uses is described in `reno_jax/play/app.py` and
docs/play.md.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Training workdir (its config.json, checkpoints, metrics.jsonl).", required=True
)
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to listen on (127.0.0.1: this machine only).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step the page opens at (default: the latest; 0: warm start).")


def _require_play_extra() -> None:
    """The web server stack is the `play` extra, not the core install: without it, one line saying how to get it."""
    missing = [name for name in ("fastapi", "uvicorn", "pydantic") if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"{os.path.basename(sys.argv[0])}: error: the play page needs {', '.join(missing)}; "
            f'install them with: pip install -e ".[play]"',
            file=sys.stderr,
        )
        sys.exit(2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    _require_play_extra()
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every restore at INFO; keep the console to the URL
        logging.set_verbosity(logging.WARNING)
    # Imported here so that --help answers without loading JAX.
    from reno_jax.errors import RunError
    from reno_jax.loop import runs

    try:
        runs.read_run_config(_WORKDIR.value)
    except RunError as e:
        raise app.UsageError(str(e)) from None
    import socket
    import threading

    import uvicorn

    from reno_jax.play import app as app_lib
    from reno_jax.play import service as service_lib

    # Bound here, before the run is loaded, so a taken port is reported at once (and --port=0 gets a free one).
    sock = socket.socket(socket.AF_INET6 if ":" in _HOST.value else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((_HOST.value, _PORT.value))
        sock.listen(128)  # connections made as soon as the URL is printed wait in the backlog for uvicorn
    except OSError as e:
        raise app.UsageError(f"cannot listen on {_HOST.value}:{_PORT.value}: {e}") from None
    service = service_lib.PlayService(_WORKDIR.value, default_step=_STEP.value)
    steps = service.run.steps()
    if _STEP.value is not None and _STEP.value not in steps:
        logging.warning("--step=%d has no checkpoint (saved: %s); the page opens at the latest", _STEP.value, steps)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"Serving {service.run.workdir} (checkpoints: {steps or 'none yet'}) at http://{shown}:{port}/", flush=True)
    # Compile the model's functions while the page loads (its first answer would otherwise wait for XLA).
    threading.Thread(target=service.warm_up, name="warm-up", daemon=True).start()
    server = uvicorn.Server(uvicorn.Config(app_lib.create_app(service), log_level="warning"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    app.run(main)
