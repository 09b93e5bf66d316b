"""The README's "bring your own environment" example: the embedded tiny model learns to guess a number in 1..16
(`reno_jax.envs.guess_number`) through `guess(number)` calls, five guesses at most.

  python -m experiments.train --config=configs/guess_number_tiny.py --workdir=workdir/guess
  python -m experiments.evaluate --workdir=workdir/guess

Warm start on a teacher that guesses uniformly among the numbers the answers so far allow (it finds the secret
in five guesses about 80% of the time; binary search always does), then GSPO.
"""

import ml_collections

from configs import tictactoe_tiny


def get_config():
  c = tictactoe_tiny.get_config()
  c.num_steps = 40
  c.rl.share_common_prefix = False  # the recorded curves were made without these two
  c.rl.max_logp_shift = 0.0
  c.env = ml_collections.ConfigDict()
  c.env.module = ""
  c.env.name = "guess_number"

  c.sft.num_steps = 120
  c.sft.batch_size = 32

  c.rollout.boards_per_step = 8    # secrets per step
  c.rollout.group_size = 8
  c.rollout.max_new_tokens = 20    # a call is 14-15 tokens with the turn end
  c.rollout.max_turns = 5
  c.rollout.max_length = 0
  c.rollout.temperature = 0.7      # sampled calls stay well-formed; the train forward scores the same policy

  c.rl.forking_entropy_coef = 0.0  # tic-tac-toe's one-token exploration bonus does not apply here
  c.rl.entropy_top_k = 0
  c.rl.learning_rate = 1e-3
  c.rl.end_learning_rate = 1e-4
  return c
