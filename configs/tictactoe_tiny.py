"""Default experiment: a tiny Ling-3.0-architecture model learns tic-tac-toe from scratch on a CPU.

Pipeline: random init -> short supervised warm start on random-legal-move transcripts (format only) ->
GSPO on AReno's one-decision `move` task.

  python -m experiments.train_tictactoe --config=configs/tictactoe_tiny.py --workdir=workdir/tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_steps = 850

  # --- policy model -------------------------------------------------------------------------------
  c.model = ml_collections.ConfigDict()
  c.model.path = ""  # empty: build the embedded tiny model below; else a local HF directory.
  c.model.dtype = "float32"
  c.model.tokenizer_path = ""  # empty: the tokenizer shipped in reno_jax/assets (or model.path's).
  # "int8": the frozen base of a LoRA run (lora.rank > 0) in int8 weight-only (per-channel scales, dequantized inside
  # the matmuls; reno_jax/models/quant.py); read straight into int8 from model.path, else quantized after the warm start.
  c.model.quantize = ""
  # Embedded tiny Ling-3.0 (bailing_hybrid) architecture: every layer kind is present
  # (KDA, gated MLA, dense SwiGLU MLP, MoE with shared expert).
  c.model.tiny = ml_collections.ConfigDict(dict(
      hidden_size=64,
      intermediate_size=128,
      # Two layers, KDA then MLA: every layer kind is still present, a step costs ~0.7 of three layers' and the move
      # task is learned as fast per step (docs/benchmarks.md). The other tiny configs keep three.
      num_hidden_layers=2,
      layer_group_size=2,           # a group is KDA layers then one MLA layer (a tail that does not fill one is MLA)
      num_attention_heads=4,
      head_dim=16,
      first_k_dense_replace=1,      # layer 0 dense SwiGLU, the rest MoE
      num_experts=4,
      num_experts_per_tok=2,
      n_group=1,
      topk_group=1,
      moe_intermediate_size=64,
      moe_shared_expert_intermediate_size=64,
      num_shared_experts=1,
      q_lora_rank=32,
      kv_lora_rank=32,
      qk_nope_head_dim=16,
      qk_rope_head_dim=8,
      v_head_dim=16,
  ))

  # --- task -------------------------------------------------------------------------------------
  c.env = ml_collections.ConfigDict()
  c.env.name = "tictactoe"
  c.env.module = ""             # a module to import first that registers env.name (an environment of your own)
  c.env.task = "move"            # "move" (AReno's one-decision task) or "game"
  # Every non-terminal X-to-move position there is (2423; AReno's dataset: 2048 of them): the task is the whole game,
  # and the evaluation scores all of them.
  c.env.num_boards = 2423
  c.env.board_seed = 1234
  # Boards: up to this many random moves from the empty board. AReno's 6 never shows a board with one empty square
  # (222 of the 2423 positions the evaluation scores, where the model then picks an occupied square ~17% of the time).
  c.env.max_random_moves = 8
  c.env.board_sides = "x"        # "x": X-to-move boards (AReno); "both": either side to move
  c.env.board_style = "grid"     # "grid": "X | 2 | O" (AReno's look); "labeled": "1X | 2 | 3O" (wording.py)
  c.env.boards_path = ""         # optional AReno-style JSONL of boards
  # "random": positions of random moves (above); "play": positions met in games of a side that plays minimax with
  # probability 1 - play_epsilon against the game task's opponent (boards.play_boards), repeats kept.
  c.env.board_source = "random"
  c.env.play_epsilon = 0.1
  c.env.heldout_fraction = 0.0
  c.env.agent_player = "x"       # game task: "x", "o" or "alternate" (by group)
  c.env.o_share = 0.5            # game task, "alternate": share of the groups in which the agent plays O
  c.env.opponent = "epsilon"     # game task: "random", "minimax" or "epsilon"
  c.env.opponent_epsilon = 0.5
  c.env.suboptimal_penalty = 0.0  # game task: the last reward loses this times the share of value-losing moves
  c.env.independent_opponents = False  # game task: a group's episodes share the opening only, not later replies
  c.env.win_seeking = False  # good moves must also be the best against a random opponent (minimax.seeking_mask)

  # --- supervised warm start (format only: random legal moves) -----------------------------------
  c.sft = ml_collections.ConfigDict()
  c.sft.num_steps = 110
  c.sft.batch_size = 64
  c.sft.learning_rate = 3e-3
  c.sft.warmup_steps = 10
  # > 1: draw that many batches of transcripts at once and train on them as batches of similar lengths (each padded
  # to its own longest conversation; rl.sft.length_sorted_batches): cheaper steps where lengths differ a lot
  c.sft.length_pool = 1
  c.sft.soft_targets = False     # game task: learn from the random legal policy's whole distribution (see sft.py)
  c.sft.eval_every = 0           # > 0: the run's evaluation suites every that many warm-start steps (warmstart_log/)

  # --- rollout ----------------------------------------------------------------------------------
  c.rollout = ml_collections.ConfigDict()
  # 64 boards x 8 samples: the same 512 rows as 32 x 16, twice the boards per step (what the model's learning speed
  # depends on, docs/benchmarks.md). 128 x 4 with rl.share_common_prefix costs the same and learned more in two of
  # three seeds, but one seed lost the call format for good (docs/benchmarks.md), so it is not the default.
  c.rollout.boards_per_step = 64
  c.rollout.group_size = 8       # samples per board (GSPO group)
  # Per turn. A call is 7 tokens and the turn ends when it is complete (stop_at_tool_call); the train step scores
  # every row at this width, so 2 tokens of slack instead of 5 make it a fifth cheaper (docs/benchmarks.md).
  c.rollout.max_new_tokens = 9
  c.rollout.max_turns = 1
  c.rollout.max_length = 0       # 0: prompt length + max_turns * (max_new_tokens + tool response)
  c.rollout.temperature = 1.0
  c.rollout.top_k = 0
  c.rollout.top_p = 1.0
  c.rollout.prefill_chunk = 64        # tokens per model call when feeding prompts and tool responses
  c.rollout.stop_at_tool_call = True  # end a turn as soon as "</tool_call>" is complete
  c.rollout.cache_dtype = "float32"   # "bfloat16" halves the MLA/conv caches (behaviour log-probs then drift)
  c.rollout.parse_max_bytes = 0       # 0: the parser scans the whole turn
  c.rollout.share_prompt_prefill = True  # prefill each group's prompt once and copy its caches

  # --- RL ---------------------------------------------------------------------------------------
  c.rl = ml_collections.ConfigDict()
  c.rl.loss = "gspo"
  c.rl.eps_low = 3e-4
  c.rl.eps_high = 4e-4
  c.rl.normalize_adv_std = True
  # Multi-turn credit: a token's advantage is its episode's plus this times its turn's, among the group's turns
  # taken from the same state (the environment's `state_key`); needs a token-level loss (gspo_token). 0: off.
  c.rl.turn_advantage_coef = 0.0
  c.rl.turn_discount = 1.0
  c.rl.turn_scope = "group"        # "batch": compare with every turn of the batch from the same key (TextEnv.state_key)
  c.rl.kl_coef = 0.0
  c.rl.entropy_coef = 0.0        # entropy bonus on every response token (format tokens included)
  c.rl.forking_entropy_coef = 0.1   # entropy bonus on each response's highest-entropy token (the square)
  c.rl.forking_kl_coef = 0.0       # instead: k3 KL to the warm start on the forking token(s) (mass-covering)
  c.rl.forking_top_k = 1
  c.rl.forking_per_turn = False    # multi-turn: the top-k tokens of every turn instead of every response
  c.rl.entropy_top_k = 9           # entropies over the 9 most likely tokens only (renormalised): the bonus evens
                                   # out the plausible squares instead of pushing mass onto the vocabulary's tail
  c.rl.forking_entropy_hold = 0.5  # full bonus / KL until this fraction of the run, then linearly to 0 at `end`
  c.rl.forking_entropy_end = 0.8
  # Rollout / train mismatch corrections (the train forward's log-prob of a sampled token differs from the
  # rollout's); k = pi_train / pi_rollout per token. 0 = off (the default run is unchanged).
  c.rl.tis_cap = 0.0               # truncated importance sampling: token importance weight min(k, cap), cap >= 1
  c.rl.icepop_low = 0.0            # IcePop: drop tokens with k < icepop_low (0: no lower bound), must be < 1
  c.rl.icepop_high = 0.0           # ... or k > icepop_high (0: no upper bound), must be > 1
  c.rl.learning_rate = 3e-3
  c.rl.end_learning_rate = 3e-4
  c.rl.warmup_steps = 10
  c.rl.weight_decay = 0.01
  c.rl.b1 = 0.9
  c.rl.b2 = 0.999
  c.rl.clip_norm = 1.0
  # Update guard: after each update the first `shift_probe_groups` groups are scored again; an update that moves
  # their sampled tokens' log-probs by more than this (mean |delta logp| per token) is halved until it does not,
  # because a normal-sized step can flip a format token the policy was sure of (docs/benchmarks.md). 0: off.
  c.rl.max_logp_shift = 0.2
  c.rl.shift_probe_groups = 8
  c.rl.num_minibatches = 1       # optimiser steps per rollout batch
  c.rl.num_microbatches = 1
  c.rl.remat = False               # recompute layers in the backward pass (memory for speed; big models)
  c.rl.logits_chunk = 0            # > 0: the train step makes the logits this many positions at a time (big vocab)
  c.rl.share_prompt_prefix = True  # encode each group's prompt once in the backward pass (exact, much cheaper)
  # ... and the part every prompt shares (system prompt, tool schema) once per batch: exact to float32 rounding,
  # 15% of this step.
  c.rl.share_common_prefix = True
  c.rl.train_groups = 0          # 0: train on every group; N: only the N groups with the largest reward spread
  # > 0: every train step (warm start and RL) sees the batch's columns up to its last real token, rounded up to a
  # multiple of this, not the whole conversation length (exact; one compile per width). For episodes of varying length.
  c.rl.length_bucket = 0
  c.rl.optimizer_state_dtype = "float32"  # "float32", "bfloat16" or "int8"
  c.rl.routing_replay = False    # R3: the train forward replays the rollout's MoE expert choices (arXiv:2510.11370)
  c.rl.routing_metrics = False   # record the rollout's routing for train/routing_agreement even without replay

  # --- LoRA (reno_jax/models/lora.py) -----------------------------------------------------------
  # rank 0: full fine-tuning. rank > 0: RL trains low-rank adapters only, over a frozen base (the warm start, or
  # model.path); checkpoints hold the adapters and their optimizer state, the export is the merged model.
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0
  c.lora.alpha = 32.0            # the adapted weight is W + (alpha / rank) A @ B
  # Weights adapted: every projection kind and, for this model trained from scratch, the token tables too: without
  # them rank-8 adapters learned nothing in 336 steps at lr 3e-3 (and collapsed at 1e-2 and 3e-2), since much of
  # what RL changes in a model this small sits in its embedding and lm_head (docs/benchmarks.md).
  c.lora.targets = ("kda", "mla", "mlp", "experts", "shared_experts", "embedding", "lm_head")
  c.lora.expert_adapters = "per_expert"  # routed experts: "per_expert" (own A, B each) or "shared" (one per layer)

  # --- device mesh (reno_jax.parallel; all 1: one device) -----------------------------------------
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1                # batch split, parameters replicated
  c.mesh.fsdp = 1                # batch split, parameters and optimizer state sharded
  c.mesh.expert = 1              # routed experts split
  c.mesh.tensor = 1              # heads / MLP width split
  c.mesh.preset = "dp"           # sharding rules: dp, fsdp, fsdp_ep, fsdp_tp (reno_jax/parallel/rules.py)

  # --- bookkeeping ------------------------------------------------------------------------------
  c.checkpoint_every = 50
  c.keep_checkpoints = 0         # 0: every checkpoint (2.4 MB each for the tiny model), all on the play page's slider
  c.plot_every = 25
  c.eval_every = 0
  c.eval_suites = ""             # in-run evaluations' suites, "a,b" (empty: the environment's defaults)
  return c
