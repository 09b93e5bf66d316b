r"""`experiments.train` with the tic-tac-toe default config (`configs/tictactoe_tiny.py`), kept as an alias.

python -m experiments.train_tictactoe --workdir=workdir/tiny
"""

from absl import flags

from experiments import cli
from experiments.train import main

DEFAULT_CONFIG = "configs/tictactoe_tiny.py"

if __name__ == "__main__":
    flags.FLAGS.set_default("config", DEFAULT_CONFIG)
    cli.run(main)
