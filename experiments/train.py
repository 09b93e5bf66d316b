r"""GSPO training of a Ling-3.0-architecture policy on any registered tool-calling environment.

  python -m experiments.train --config=configs/tictactoe_tiny.py --workdir=workdir/tiny
  python -m experiments.train --config=configs/connect4_tiny.py --workdir=workdir/c4
  python -m experiments.train --config=configs/tictactoe_tiny.py --workdir=/tmp/t \
      --config.num_steps=5 --config.rl.learning_rate=3e-4
  python -m experiments.train --config=configs/tictactoe_tiny.py --workdir=/tmp/g \
      --config.env.module=my_pkg.my_env --config.env.name=my_env       # an environment of your own package
      [--config.env.size=8]                                            # ... and one of its declared options
  python -m experiments.train --config=configs/guess_number_host_tiny.py --workdir=/tmp/h \
      --config.env.teacher_strategy=binary                             # a host environment and one of its options

A thin layer over `reno_jax.loop.train` (see there for what the workdir holds): flags, the multi-process set-up
(`--coordinator_address --num_processes --process_id`, or a detected cluster; `experiments.distributed`), one-line
errors, and a last JSON line of figures (the means of the last 20 steps' rollout rates and rewards).
"""

from __future__ import annotations

import json

import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from experiments import cli, distributed
from reno_jax import loop
from reno_jax.loop import hosts

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and plots go.", required=True)


def last_figures(rows: list[dict], window: int = 20) -> dict:
    """Means of the last `window` steps' rollout rewards and rates (the last JSON line)."""
    last = rows[-window:]
    summary = {"steps": len(rows)}
    if last:
        for k in last[-1]:
            if k == "rollout/rewards_mean" or (k.startswith("rollout/") and k.endswith("_rate")):
                summary[f"last{window}/{k}"] = float(np.mean([row[k] for row in last if k in row]))
            elif k.startswith("eval/") and last[-1][k] is not None:  # None: a figure over no episode (none solved)
                summary[k] = float(last[-1][k])
    return summary


def main(argv, env_options: dict | None = None):
    distributed.initialize()  # first: JAX cannot join other processes once it has computed anything
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments: {argv[1:]}")
    cli.check_workdir_for_writing(_WORKDIR.value)
    if _CONFIG.value is None:
        raise cli.UserError("--config is required: a config file such as configs/<name>.py")
    # Orbax logs every checkpoint step at INFO; keep the console to the progress bars and our own lines.
    logging.set_verbosity(logging.WARNING)
    rows = loop.train(cli.with_env_options(_CONFIG.value, env_options or {}), _WORKDIR.value)
    if hosts.is_main_process():
        print(json.dumps(last_figures(rows)))


if __name__ == "__main__":
    cli.run(main, env_options=True)
