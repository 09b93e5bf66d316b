r"""`experiments.train` with the tic-tac-toe default config (`configs/tictactoe_tiny.py`), kept as an alias.

  python -m experiments.train_tictactoe --workdir=workdir/tiny
"""

from experiments import cli
from experiments.train import main

if __name__ == "__main__":
    cli.run(main)
