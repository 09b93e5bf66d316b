"""The embedded tiny model plays Connect Four (reno_jax.envs.connect4) through `drop_piece` tool calls.

Warm start on transcripts of a scripted centre-first player (wins, blocks, else the most central column),
written by stepping the environment against the random, greedy and negamax opponents, then GSPO against the
three in turn. Everything not set here
is `tictactoe_tiny`'s (model, RL loss, optimiser, mesh, bookkeeping).

Token budget with the shipped 512-token tokenizer (slot by slot, as the compiler renders):
  prompt        ~226 tokens: system turn with the tool line 155, user turn 63 + ChatML markers, assistant header
  agent call     23 tokens:  <tool_call>{"name": "drop_piece", "arguments": {"column": k}}</tool_call><|im_end|>
                 (the tiny tokenizer spells "drop_piece" and "column" in 14 tokens; a think block would add more)
  tool response  68 tokens:  "\n<|im_start|>tool\n" 4 + "Opponent played k.\n" 4 + header 8 + board 47
                 + "<|im_end|>\n<|im_start|>assistant\n" 5 (final-step templates are not rendered by the rollout)
  per turn      ~96 tokens with max_new_tokens = 24, so a whole game fits 2,170 tokens (21 agent turns); the
                 scripted teacher's games end after ~6 agent moves against the random opponent (~800 tokens), ~12
                 against the greedy one (~1.4k). Train steps see each batch up to its longest game
                 (rl.length_bucket), and attention over a whole game runs in query blocks (models/mla.py).

  python -m experiments.train --config=configs/connect4_tiny.py --workdir=workdir/c4
  python -m experiments.evaluate --workdir=workdir/c4
"""

import ml_collections

from configs import tictactoe_tiny


def get_config():
    c = tictactoe_tiny.get_config()
    c.model.tiny.num_hidden_layers = 3  # measured with three layers (the move task's default has two)
    c.num_steps = 20
    # A 226-token prompt before up to ~1.9k tokens of game: encoding it once per group saves little, and the
    # continuation would then attend through a cache (every query against every position) instead of block by block.
    c.rl.share_prompt_prefix = False
    c.rl.share_common_prefix = False
    c.rl.max_logp_shift = 0.0
    c.rl.length_bucket = 256

    # --- environment (reno_jax.envs.connect4.env.Connect4Env / sample_starts) --------------------------------
    c.env = ml_collections.ConfigDict()
    c.env.module = ""  # none of tic-tac-toe's board-dataset fields apply
    c.env.name = "connect4"
    # RL opponents: "random", "greedy", "negamax" or "mixed" (the three in turn by group). Against the random one
    # alone nearly every group wins all its games (no reward spread, nothing to learn from).
    c.env.opponent = "mixed"
    c.env.agent_player = "alternate"  # 1 (X, moves first), 2 (O) or "alternate" (X in even groups)
    c.env.negamax_depth = 3  # plies; only compiled in when the opponent is "negamax" or "mixed"
    c.env.max_agent_turns = 21  # every agent move of a full game
    c.env.mark_playable = False  # print each column's landing cell as "*" (reno_jax.envs.connect4.wording)
    c.env.opening_plies = 0  # > 0: games start after up to that many random plies (Connect4Env)
    c.env.echo_board = False  # print every board's rows twice (48 tokens more per board; wording)
    c.env.illegal_reward = -1.0  # an invalid or illegal call's reward (< -1: worse than any loss)
    c.env.move_cost = 0.0  # > 0: a win on move m is worth 1 - cost*m, a loss after move m -1 + cost*m

    # --- supervised warm start: transcripts of the env's greedy teacher (Connect4Env.teacher_call) ---------------
    c.sft.num_steps = 100
    c.sft.batch_size = 16  # whole games of ~1k tokens each
    c.sft.teacher = "center_greedy"  # win, else block, else the most central column (see connect4/env.py)
    c.sft.learning_rate = 3e-3
    # Transcripts against all three opponents (by group): the random opponent alone rarely lets a column fill up,
    # so a model warm-started on those games never sees the centre column full and keeps playing it (illegal).
    # opening_plies (> 0): the warm start's games begin mid-game, where fours to make or stop are common
    c.sft.env = ml_collections.ConfigDict(dict(opponent="mixed", opening_plies=0))
    # > 0 (with sft.soft_targets): that share of the teacher's moves is a random legal column, still labelled with the
    # teacher's column, so the transcripts also hold positions off the teacher's own path
    c.sft.explore = 0.0
    # != 1 (with sft.soft_targets): the loss weight of the teacher's decisions where it wins or blocks (the few moves
    # that decide a game) relative to the others
    c.sft.forced_weight = 1.0
    c.eval_suites = "random,greedy"  # in-run evaluations (eval_every, sft.eval_every): the targets' two opponents

    # --- rollout ------------------------------------------------------------------------------------------------
    c.rollout.boards_per_step = 4  # groups (start records) per step
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 24  # a call is 23 tokens with the turn end
    c.rollout.max_turns = 21  # every agent move of a game
    c.rollout.max_length = 0  # 0: room for every turn (2,170 tokens), so no game is cut off
    c.rollout.stop_at_tool_call = True

    # --- RL: the forking-token bonus was tuned for the one-token square of tic-tac-toe; off until measured here ---
    c.rl.forking_entropy_coef = 0.0
    c.rl.entropy_top_k = 0
    c.rl.forking_per_turn = True
    c.rollout.temperature = 0.7  # the 23-token call must come out whole in every turn; the train forward scores
    # the same tempered policy
    c.rl.learning_rate = 3e-4
    c.rl.end_learning_rate = 5e-5
    return c
