"""The README's "bring your own environment" example: the embedded tiny model learns to guess a number in 1..16
(`reno_jax.envs.guess_number`) through `guess(number)` calls, five guesses at most, and learns binary search.

  python -m experiments.train --config=configs/guess_number_tiny.py --workdir=workdir/guess
  python -m experiments.evaluate --workdir=workdir/guess

Warm start on a teacher that guesses uniformly among the numbers the answers so far allow (it finds the secret
in five guesses 77% of the time, in 3.82 guesses on average counting a miss as five; binary search always finds
it, in 3.375), then GSPO. Reward (the environment's): finding the secret on guess k earns 1 - 0.125 (k - 1),
running out of guesses 0, an invalid call -1; binary search is its optimum. Each answer states the numbers left
("8 is too high. It is 1 to 7."): the tiny model does not keep the interval over turns by itself.
With --config.eval_every=20 the run plays every secret greedily every 20 steps (eval/secrets/found_rate,
guesses_mean in metrics.jsonl: docs/benchmarks.md's curves).

What makes binary search learnable here (docs/benchmarks.md has each attempt's figures):
- A warm start that reads the stated range precisely. RL cannot teach reading: a warm start that guesses outside
  the range 8% of the time left 0.1-0.4 wasted guesses per episode through 300 GSPO steps, and greedy play kept
  missing one or two secrets. Soft targets (the teacher's whole uniform choice, digit by digit) put 97% of the
  sampled guesses inside the range after 240 steps (hard targets: 92%); 360 here.
- Credit per guess: each guess is also compared with every guess of the batch made from the same range after as
  many guesses (`state_key`, `rl.turn_scope=batch`; the secret is hidden from the policy, so a range is one
  decision point whatever the secret), with a token-level loss.
"""

import ml_collections

from configs import tictactoe_tiny


def get_config():
    c = tictactoe_tiny.get_config()
    c.model.tiny.num_hidden_layers = 3  # measured with three layers (the move task's default has two)
    c.num_steps = 300
    c.eval_every = 0  # --config.eval_every=20: every secret played greedily (eval/secrets/...)
    c.env = ml_collections.ConfigDict()
    c.env.module = ""
    c.env.name = "guess_number"

    c.sft.num_steps = 360
    c.sft.batch_size = 32
    c.sft.soft_targets = True

    c.rollout.boards_per_step = 4  # secrets per step
    c.rollout.group_size = 16
    c.rollout.max_new_tokens = 20  # a call is 14-15 tokens with the turn end
    c.rollout.max_turns = 5
    c.rollout.max_length = 0
    c.rollout.temperature = 0.7  # sampled calls stay well-formed; the train forward scores the same policy

    c.rl.loss = "gspo_token"  # per-token advantages: the turn credit below
    c.rl.turn_advantage_coef = 1.0
    c.rl.turn_scope = "batch"
    c.rl.forking_entropy_coef = 0.0  # tic-tac-toe's one-token exploration bonus does not apply here
    c.rl.entropy_top_k = 0
    # 1e-3 undid the warm start (sampled found rate 0.67 -> 0.55 and more invalid calls once the warmup was over);
    # 3e-4 with the update guard (rl.max_logp_shift, on from tictactoe_tiny) learns.
    c.rl.learning_rate = 3e-4
    c.rl.end_learning_rate = 3e-5
    return c
