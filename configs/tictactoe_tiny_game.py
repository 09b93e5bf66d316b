"""The embedded tiny model on the multi-turn `game` task against an epsilon-mixed opponent (epsilon 0.5).

The agent plays X in half of the groups and O in the other half; each tool call is answered by the opponent's
reply and the new board until the game ends (win +1, draw 0, loss -1, invalid call or occupied square -1).

  python -m experiments.train_tictactoe --config=configs/tictactoe_tiny_game.py --workdir=workdir/tiny_game
"""

from configs import tictactoe_tiny


def get_config():
  c = tictactoe_tiny.get_config()
  c.env.task = "game"
  c.env.agent_player = "alternate"
  c.env.opponent = "epsilon"
  c.env.opponent_epsilon = 0.5
  c.rollout.boards_per_step = 16   # games (groups) per step
  c.rollout.group_size = 8
  c.rollout.max_turns = 5          # X makes at most 5 moves
  c.rollout.max_new_tokens = 16
  c.num_steps = 100
  # The move task's forking-token bonus loosened the call format here (its warm start never saw game prompts):
  # plain GSPO at the previous move-task learning rate.
  c.rl.forking_entropy_coef = 0.0
  c.rl.entropy_top_k = 0
  c.rl.learning_rate = 1e-3
  c.rl.end_learning_rate = 2e-4
  return c
