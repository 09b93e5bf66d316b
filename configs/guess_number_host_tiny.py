"""Guess the number as a host environment (`reno_jax.envs.guess_number_host`: Python `reset` / `step`, played by
`reno_jax.rollout.host_rollout`) trained end to end: warm start on the host teacher's conversations, then GSPO.

  python -m experiments.train --config=configs/guess_number_host_tiny.py --workdir=workdir/guess_host
  python -m experiments.evaluate --workdir=workdir/guess_host          # the held-out suite: every secret, greedy

The same game, texts and rewards as `configs/guess_number_tiny.py` (jitted), sized for a short CPU run: the teacher
guesses uniformly among the numbers the answers allow (`env.teacher_strategy="uniform"`, the jitted environment's
teacher; "binary" is binary search), so GSPO has guesses left to save. Plain sequence-level GSPO: a host
environment declares no state keys for per-guess credit.
"""

import ml_collections

from configs import tictactoe_tiny


def get_config():
    c = tictactoe_tiny.get_config()
    c.num_steps = 30
    c.eval_every = 0  # --config.eval_every=10: the held-out suite played greedily (eval/heldout/...)
    c.env = ml_collections.ConfigDict()
    c.env.module = ""
    c.env.name = "guess_number_host"
    c.env.teacher_strategy = "uniform"  # an option of the environment (its class attribute)

    c.sft.num_steps = 120
    c.sft.batch_size = 16

    c.rollout.boards_per_step = 4  # secrets per step
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 20  # a call is 14-15 tokens with the turn end
    c.rollout.max_turns = 5
    c.rollout.max_length = 0  # what five turns need with the limits below
    c.rollout.temperature = 0.7
    c.rollout.host_max_prompt_tokens = 32  # "I picked a number. You have 5 guesses." is 26 tokens
    c.rollout.host_max_response_tokens = 32  # "12 is too high. It is 9 to 11." is 21
    c.rollout.host_eval_episodes = 16  # every secret once

    c.rl.forking_entropy_coef = 0.0  # tic-tac-toe's one-token exploration bonus does not apply here
    c.rl.entropy_top_k = 0
    c.rl.learning_rate = 3e-4
    c.rl.end_learning_rate = 3e-5
    return c
