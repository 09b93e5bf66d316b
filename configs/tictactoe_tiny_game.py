"""The embedded tiny model on the multi-turn `game` task against an epsilon-mixed opponent (epsilon 0.5).

Two stages (`config.curriculum`): first the one-move task on boards with either side to move, then whole games.
In a game the agent plays X in a quarter of the groups and O in the rest; each tool call is answered by the
opponent's reply and the new board until the game ends (win +1, draw 0, loss -1, invalid call or occupied square -1,
less the share of the agent's moves that gave up minimax value).

  python -m experiments.train_tictactoe --config=configs/tictactoe_tiny_game.py --workdir=workdir/tiny_game
  python -m experiments.evaluate --workdir=workdir/tiny_game --opponent=minimax,random --num_episodes=1024
"""

import ml_collections

from configs import tictactoe_tiny


def get_config():
    c = tictactoe_tiny.get_config()
    c.model.tiny.num_hidden_layers = 3  # measured with three layers (the move task's default has two)
    c.env.num_boards = 2048
    c.env.task = "game"
    c.env.agent_player = "alternate"
    c.env.o_share = 0.75  # O is the harder side: it has to answer X's first move with the right reply
    c.env.opponent = "epsilon"
    c.env.opponent_epsilon = 0.5
    # "1X | 2 | 3O": every cell names its square, so the square to call is on the board itself; in a conversation of
    # several boards the model reads off the latest one instead of counting cells.
    c.env.board_style = "labeled"
    # Against an opponent that is random half the time most mistakes go unpunished; the minimax table grades each move.
    c.env.suboptimal_penalty = 1.0
    # ... and grades a draw-keeping move by how many chances it leaves a fallible opponent to lose: the evaluation's
    # random opponent is beaten 0.956 of the time by such play, 0.873 by perfect play that is indifferent to it.
    c.env.win_seeking = True
    # A group shares its opening but not the opponent's later draws: once the policy settles on its moves, games with
    # shared draws would repeat one game eight times and leave no reward spread to learn from.
    c.env.independent_opponents = True
    c.rollout.boards_per_step = 16  # games (groups) per step
    c.rollout.group_size = 8
    c.rollout.max_turns = 5  # X makes at most 5 moves
    c.rollout.max_new_tokens = 9  # a call is 7 tokens + turn end
    c.num_steps = 200
    c.checkpoint_every = 50
    # Plain GSPO in games, as measured without a curriculum (docs/benchmarks.md): the move task's forking-token
    # entropy bonus, scored on every turn's square, spread mass onto occupied squares.
    c.rl.forking_entropy_coef = 0.0
    c.rl.entropy_top_k = 0
    c.rl.max_logp_shift = 0.0
    c.rl.learning_rate = 1.5e-3
    c.rl.end_learning_rate = 2e-4

    # Stage 1: where to put a stone. The warm start teaches the call format on random legal moves of single boards;
    # the move task then teaches good moves from both sides, 512 graded answers per step instead of 128 game turns.
    c.curriculum = ml_collections.ConfigDict()
    c.curriculum.move = ml_collections.ConfigDict(
        dict(
            num_steps=800,
            # Positions met in games of a near-minimax side against this opponent, repeats kept (boards.play_boards),
            # instead of uniform random positions that good play never reaches.
            env=dict(task="move", board_source="play", num_boards=4096),
            sft=dict(num_steps=110, batch_size=64, soft_targets=False),
            rollout=dict(boards_per_step=64, group_size=8, max_turns=1),
            rl=dict(
                forking_entropy_coef=0.1,
                entropy_top_k=9,
                learning_rate=3e-3,
                end_learning_rate=3e-4,
                max_logp_shift=0.2,
            ),
        )
    )
    return c
