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
  c.rollout.max_new_tokens = 12  # a call is 7 tokens + turn end
  c.num_steps = 150
  c.rl.share_common_prefix = False  # the recorded curves were made without these two
  c.rl.max_logp_shift = 0.0
  # Warm start on whole games of random legal moves (format only), scored against the random legal policy's
  # whole distribution at each square token (`sft.soft_targets`): reading the latest board out of a multi-turn
  # conversation is what this small model finds hard, and soft targets teach it from every legal square at once.
  c.sft.num_steps = 500         # ~9 min on 2 cores; after 200 steps a fifth of sampled games still ended on an
                                # occupied square, which hid the loss rate (games ended before they could be lost)
  c.sft.batch_size = 32
  c.sft.soft_targets = True
  # Plain GSPO: the move task's top-9 forking-token entropy bonus (even per turn, `rl.forking_per_turn`) pushed
  # mass onto occupied squares here (illegal-move rate 0.56 -> 0.71 in 15 steps); top-3 at 0.05 stalled learning.
  c.rl.forking_entropy_coef = 0.0
  c.rl.entropy_top_k = 0
  c.rl.learning_rate = 1.5e-3
  c.rl.end_learning_rate = 2e-4
  return c
