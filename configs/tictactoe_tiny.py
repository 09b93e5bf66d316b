"""Default experiment: a tiny Ling-3.0-architecture model learns tic-tac-toe from scratch on a CPU.

Pipeline: random init -> short supervised warm start on random-legal-move transcripts (format only) ->
GSPO on AReno's one-decision `move` task. Every field not set here is the library default (`configs/base.py`,
`reno_jax/run_config.py`, where each field is documented).

  python -m experiments.train_tictactoe --config=configs/tictactoe_tiny.py --workdir=workdir/tiny
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
    c = base.get_config()
    c.num_steps = 850

    # --- policy model: the embedded tiny Ling-3.0 architecture (base), two layers, KDA then MLA: every layer kind is
    # still present, a step costs ~0.7 of three layers' and the move task is learned as fast per step
    # (docs/benchmarks.md). The other tiny configs keep three.
    c.model.tiny.num_hidden_layers = 2

    # --- task -------------------------------------------------------------------------------------
    c.env = ml_collections.ConfigDict()
    c.env.name = "tictactoe"
    c.env.module = ""  # a module to import first that registers env.name (an environment of your own)
    c.env.task = "move"  # "move" (AReno's one-decision task) or "game"
    # Every non-terminal X-to-move position there is (2423; AReno's dataset: 2048 of them): the task is the whole game,
    # and the evaluation scores all of them.
    c.env.num_boards = 2423
    c.env.board_seed = 1234
    # Boards: up to this many random moves from the empty board. AReno's 6 never shows a board with one empty square
    # (222 of the 2423 positions the evaluation scores, where the model then picks an occupied square ~17% of the time).
    c.env.max_random_moves = 8
    c.env.board_sides = "x"  # "x": X-to-move boards (AReno); "both": either side to move
    c.env.board_style = "grid"  # "grid": "X | 2 | O" (AReno's look); "labeled": "1X | 2 | 3O" (wording.py)
    c.env.boards_path = ""  # optional AReno-style JSONL of boards
    # "random": positions of random moves (above); "play": positions met in games of a side that plays minimax with
    # probability 1 - play_epsilon against the game task's opponent (boards.play_boards), repeats kept.
    c.env.board_source = "random"
    c.env.play_epsilon = 0.1
    c.env.heldout_fraction = 0.0
    c.env.agent_player = "x"  # game task: "x", "o" or "alternate" (by group)
    c.env.o_share = 0.5  # game task, "alternate": share of the groups in which the agent plays O
    c.env.opponent = "epsilon"  # game task: "random", "minimax" or "epsilon"
    c.env.opponent_epsilon = 0.5
    c.env.suboptimal_penalty = 0.0  # game task: the last reward loses this times the share of value-losing moves
    c.env.independent_opponents = False  # game task: a group's episodes share the opening only, not later replies
    c.env.win_seeking = False  # good moves must also be the best against a random opponent (minimax.seeking_mask)

    # --- supervised warm start (format only: random legal moves) -----------------------------------
    c.sft.num_steps = 110

    # --- rollout ----------------------------------------------------------------------------------
    # 64 boards x 8 samples: the same 512 rows as 32 x 16, twice the boards per step (what the model's learning speed
    # depends on, docs/benchmarks.md). 128 x 4 with rl.share_common_prefix costs the same and learned more in two of
    # three seeds, but one seed lost the call format for good (docs/benchmarks.md), so it is not the default.
    c.rollout.boards_per_step = 64
    c.rollout.group_size = 8  # samples per board (GSPO group)
    # Per turn. A call is 7 tokens and the turn ends when it is complete (stop_at_tool_call); the train step scores
    # every row at this width, so 2 tokens of slack instead of 5 make it a fifth cheaper (docs/benchmarks.md).
    c.rollout.max_new_tokens = 9

    # --- RL ---------------------------------------------------------------------------------------
    c.rl.forking_entropy_coef = 0.1  # entropy bonus on each response's highest-entropy token (the square)
    c.rl.entropy_top_k = 9  # entropies over the 9 most likely tokens only (renormalised): the bonus evens
    # out the plausible squares instead of pushing mass onto the vocabulary's tail
    c.rl.forking_entropy_hold = 0.5  # full bonus until this fraction of the run, then linearly to 0 at `end`
    c.rl.forking_entropy_end = 0.8
    # Update guard: after each update the first `shift_probe_groups` groups are scored again; an update that moves
    # their sampled tokens' log-probs by more than this (mean |delta logp| per token) is halved until it does not,
    # because a normal-sized step can flip a format token the policy was sure of (docs/benchmarks.md). 0: off.
    c.rl.max_logp_shift = 0.2
    c.rl.shift_probe_groups = 8

    # --- LoRA (reno_jax/models/lora.py; rank 0 here: full fine-tuning) ----------------------------
    # Weights adapted: every projection kind and, for this model trained from scratch, the token tables too: without
    # them rank-8 adapters learned nothing in 336 steps at lr 3e-3 (and collapsed at 1e-2 and 3e-2), since much of
    # what RL changes in a model this small sits in its embedding and lm_head (docs/benchmarks.md).
    c.lora.targets = ("kda", "mla", "mlp", "experts", "shared_experts", "embedding", "lm_head")
    return c
