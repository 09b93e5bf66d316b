r"""The README's main command: `experiments.train` (any registered environment) with the tic-tac-toe default.

  python -m experiments.train_tictactoe --workdir=workdir/tiny        # configs/tictactoe_tiny.py
  python -m experiments.train_tictactoe --config=configs/tictactoe_tiny_game.py --workdir=workdir/tiny_game
"""

from experiments import cli
from experiments.train import sample_starts, train, warm_start  # noqa: F401  (library use, tests)
from experiments.train import main

if __name__ == "__main__":
    cli.run(main)
