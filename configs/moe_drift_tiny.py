"""A bf16 tiny MoE whose rollout and train forward route differently: the routing-replay demonstration.

  python studies/routing_replay.py                          # scoring + two short GSPO runs (see docs/benchmarks.md)
  python -m experiments.train_tictactoe --config=configs/moe_drift_tiny.py --workdir=workdir/drift \
      --config.rl.routing_replay=True

The default tiny architecture with 32 experts, top-4, in every layer, in bfloat16 parameters and bfloat16
rollout caches: the rollout's decode steps (ragged expert dispatch, bf16 caches) and the train step's
full-sequence forward (blocked dispatch) round differently, the router's scores move by a few bf16 ulps and
some (token, layer) pairs pick a different top-4 set. A short GSPO run on a smaller batch
than the default (8 boards x 8 samples, lr 1e-3, rows scored whole) that records the routing every step
(`rl.routing_metrics`).
"""

from configs import tictactoe_tiny


def get_config():
    c = tictactoe_tiny.get_config()
    c.model.tiny.num_hidden_layers = 3  # measured with three layers (the move task's default has two)
    c.env.max_random_moves = 6  # AReno's boards
    c.env.num_boards = 2048  # AReno's dataset
    c.num_steps = 25
    c.rl.share_common_prefix = False  # the recorded curves were made without these three
    c.rl.max_logp_shift = 0.0
    c.rollout.max_new_tokens = 12
    c.model.dtype = "bfloat16"
    c.model.tiny.num_experts = 32  # > layers.DENSE_DISPATCH_MAX_EXPERTS: the ragged (decode) and blocked
    c.model.tiny.num_experts_per_tok = 4  # (training) dispatches run on CPU too, as on a GPU
    c.model.tiny.first_k_dense_replace = 0  # every layer MoE (3 MoE layers)
    c.sft.num_steps = 80
    c.sft.batch_size = 32
    c.rollout.boards_per_step = 8
    c.rollout.group_size = 8
    c.rollout.cache_dtype = "bfloat16"
    c.rl.routing_metrics = True  # train/routing_agreement with and without replay
    # Score whole rows in one full-sequence forward: the shared-prefix path (prompt cached in bf16, then the
    # continuation) follows the rollout's program so closely that its routing hardly ever differs (docs/benchmarks.md).
    c.rl.share_prompt_prefix = False
    c.rl.learning_rate = 1e-3  # 3e-3 (the default's) collapsed the call format of this bf16 model by step ~19
    c.rl.end_learning_rate = 1e-4
    c.rl.routing_replay = False
    c.checkpoint_every = 25
    c.plot_every = 0
    return c
