"""The published AReno setting, for a GPU: Ling-3.0-tiny (bailing_hybrid) on the one-decision move task.

  python -m experiments.train_tictactoe --config=configs/areno_ling3_tiny.py \
      --config.model.path=/path/to/Ling-3.0-tiny --workdir=workdir/areno

Ling-3.0-tiny from a local HF directory in bf16, its own tokenizer and chat template, 4 boards x 4 samples per
step, up to 1471 new tokens, learning rate 1e-8 decaying to 1e-9, 400 GSPO steps, a checkpoint every 100 steps.
The published run kept 8-bit Adam states: `rl.optimizer_state_dtype = "int8"` (bf16 params 15.8 GB + int8 moments
~15.8 GB). Weights and moments are not the whole footprint: XLA's memory plan of this setting's train step is
92.4 GB on one device (remat on, as below; docs/benchmarks.md, benchmarks/real_shape_step.py --compile-only).
"""

from configs import tictactoe_tiny


def get_config():
    c = tictactoe_tiny.get_config()
    c.env.max_random_moves = 6  # AReno's boards
    c.env.num_boards = 2048  # AReno's dataset
    c.num_steps = 400
    c.rl.share_common_prefix = False  # the recorded curves were made without these two
    c.rl.max_logp_shift = 0.0
    c.model.path = ""  # required: --config.model.path=/path/to/Ling-3.0-tiny
    c.model.dtype = "bfloat16"
    c.sft.num_steps = 0  # a real checkpoint already knows the call format
    # With --config.lora.rank > 0: a pretrained model's adapters go on its projections, not on its token tables (the
    # tiny default adapts those because it is trained from scratch); an lm_head adapter would add a logits-sized term.
    c.lora.targets = ("kda", "mla", "mlp", "experts", "shared_experts")
    c.rollout.boards_per_step = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 1471
    c.rollout.max_turns = 1
    c.rollout.temperature = 1.0
    c.rl.loss = "gspo"
    c.rl.eps_low = 3e-4
    c.rl.eps_high = 4e-4
    c.rl.learning_rate = 1e-8
    c.rl.end_learning_rate = 1e-9
    c.rl.warmup_steps = 0
    c.rl.num_minibatches = 1
    c.rl.num_microbatches = 4  # one group (4 samples, one shared prompt) per micro-batch
    c.rl.remat = True  # without it the train step ran out of memory on a 141 GB H200 (docs/benchmarks.md)
    c.rl.logits_chunk = 128  # no [rows, tokens, 157184] float32 logits in the train step
    c.rl.entropy_coef = 0.0  # the published run used no entropy or KL terms
    c.rl.forking_entropy_coef = 0.0
    c.rl.entropy_top_k = 0
    c.rl.train_groups = 0
    c.rl.optimizer_state_dtype = "int8"
    c.checkpoint_every = 100
    c.keep_checkpoints = 4
    return c
