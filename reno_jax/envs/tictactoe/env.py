"""Tic-tac-toe as `TextEnv`s: the move task (one `choose_square` call on a dataset position) and the game task
(whole games against an opponent, one call per agent move).

Both speak only `reno_jax.envs.interface`; the rules, rewards and opponents are `rules`, `tasks` and `minimax`,
the wording is `wording`. Messages carry the values ``[cell 0..8 (0 empty, 1 X, 2 O), side (0 X, 1 O), opponent
square (0 none, 1..9)]``; user templates are 0 move task, 1 game task; tool templates are the game statuses
(``wording.STATUS_*`` == ``tasks.OUTCOME_*``).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface
from reno_jax.envs.tictactoe import minimax, tasks, wording
from reno_jax.envs.tictactoe import rules as ttt

TASKS = ("move", "game")
OUTCOME_TRUNCATED = 6  # the rollout cut the episode short (conversation length or turns)
OUTCOME_NAMES = tasks.OUTCOME_NAMES + ("truncated",)


@flax.struct.dataclass
class Starts:
    """Per-group start records (N groups; the rollout repeats each one `group_size` times).

    Attributes:
      boards: `int8 [N, 9]` move task: the position to play (the agent is the side to move). Game task: unused.
      agent_player: `int8 [N]` 1 agent is X (opens), 2 agent is O.
      opponent_kind: `int32 [N]` game task: `tasks.OPPONENT_*`.
      epsilon: `float32 [N]` game task: exploration rate of the epsilon opponent.
      opponent_key: `uint32 [N, 2]` raw PRNG key data of the opponent, shared by the group's episodes (the opening
        move uses fold_in(key, 0), the reply after agent turn k fold_in(key, k + 1)).
    """

    boards: jax.Array
    agent_player: jax.Array
    opponent_kind: jax.Array
    epsilon: jax.Array
    opponent_key: jax.Array

    @property
    def num_groups(self) -> int:
        return self.boards.shape[0]


def move_starts(boards) -> Starts:
    """Starts for the move task from `int [N, 9]` boards (the agent plays the side to move)."""
    boards = jnp.asarray(boards, jnp.int8)
    if boards.ndim != 2 or boards.shape[1] != ttt.NUM_SQUARES:
        raise ValueError(f"boards must be [N, 9], got shape {boards.shape}")
    n = boards.shape[0]
    agent = jax.vmap(ttt.to_move_from_counts)(boards).astype(jnp.int8)
    return Starts(
        boards=boards,
        agent_player=agent,
        opponent_kind=jnp.full((n,), tasks.OPPONENT_MINIMAX, jnp.int32),
        epsilon=jnp.zeros((n,), jnp.float32),
        opponent_key=jnp.zeros((n, 2), jnp.uint32),
    )


def game_starts(key: jax.Array, num_groups: int, agent_player=1, opponent="minimax", epsilon=0.0) -> Starts:
    """Starts for the game task. `agent_player`, `opponent` (name or `[N]` ids) and `epsilon` may be scalars or
    `[N]` arrays; the opponent keys are split from `key`."""
    n = num_groups
    kind = tasks.opponent_kind_id(opponent) if isinstance(opponent, str) else opponent
    agent = jnp.broadcast_to(jnp.asarray(agent_player, jnp.int8), (n,))
    if not bool(jnp.all((agent == 1) | (agent == 2))):
        raise ValueError("agent_player must be 1 (X) or 2 (O)")
    return Starts(
        boards=jnp.zeros((n, ttt.NUM_SQUARES), jnp.int8),
        agent_player=agent,
        opponent_kind=jnp.broadcast_to(jnp.asarray(kind, jnp.int32), (n,)),
        epsilon=jnp.broadcast_to(jnp.asarray(epsilon, jnp.float32), (n,)),
        opponent_key=jax.random.key_data(jax.random.split(key, n)),
    )


def _values(board, side_index, opponent_square) -> jax.Array:
    return jnp.concatenate(
        [
            board.astype(jnp.int32),
            jnp.stack([jnp.asarray(side_index, jnp.int32), jnp.asarray(opponent_square, jnp.int32)]),
        ]
    )


@flax.struct.dataclass
class MoveState:
    board: jax.Array  # int8 [9]


@flax.struct.dataclass
class GameState:
    game: tasks.GameTaskState
    opponent_key: jax.Array  # uint32 [2]
    num_optimal: jax.Array  # int32 []: agent moves that were optimal (minimax)
    num_seeking: jax.Array  # int32 []: agent moves that were seeking moves (`minimax.seeking_mask`)
    win_taken: jax.Array  # bool []: the agent won by taking an immediate win


@flax.struct.dataclass
class TicTacToeEnv(interface.TextEnv):
    """`task="move"`: AReno's move reward on one position; `task="game"`: a whole game, +1 / 0 / -1.

    `suboptimal_penalty` (game task): the last step's reward also loses `suboptimal_penalty * (1 - good / turns)`,
    the share of the agent's moves that gave up minimax value (with `win_seeking`: that were not seeking moves; an
    invalid or illegal call counts as one). The outcome alone grades a move only when the opponent punishes it;
    against a partly random opponent most mistakes go unpunished, and a group whose games end alike teaches nothing
    about them.

    `win_seeking`: a move must also be one of the table's `seeking_mask` moves (the value-preserving moves that
    are best against a random opponent) to count as good, in the game task's penalty and the move task's reward
    (`tasks.move_reward`). Minimax value alone does not separate a draw-keeping move that sets a trap from one that
    lets a fallible opponent off: perfect play wins 0.968 (X) / 0.777 (O) of games against a random opponent with
    ties broken at random, 0.995 / 0.916 with the seeking tie-breaks. Evaluation metrics (`is_optimal`) stay
    minimax.

    `independent_opponents` (game task): the episodes of a group share the opening but not the opponent's later
    draws (`for_member`). With shared draws a policy that has settled on its moves plays the same game eight times
    and the group has no reward spread left; with independent draws the group's mean is still a baseline that does
    not depend on the episode's moves, so the gradient stays unbiased while the spread stays.

    Info (per episode): outcome (`OUTCOME_*` plus 6 truncated), win / draw / loss / invalid / illegal /
    truncated, is_optimal (move task: the move; game task: every agent move), is_seeking (the same with the
    table's seeking moves), win_taken, num_optimal_moves,
    final_board `int8 [9]`.
    """

    table: minimax.MinimaxTable
    task: str = flax.struct.field(pytree_node=False, default="move")
    board_style: str = flax.struct.field(pytree_node=False, default="grid")  # wording.BOARD_STYLES
    suboptimal_penalty: float = flax.struct.field(pytree_node=False, default=0.0)
    independent_opponents: bool = flax.struct.field(pytree_node=False, default=False)
    win_seeking: bool = flax.struct.field(pytree_node=False, default=False)

    truncation_reward = tasks.REWARD_INVALID

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        wording.check_board_style(self.board_style)
        if not self.suboptimal_penalty >= 0.0:  # "not >=" also rejects NaN
            raise ValueError(f"suboptimal_penalty must be >= 0, got {self.suboptimal_penalty}")

    @classmethod
    def create(
        cls,
        task: str = "move",
        table: minimax.MinimaxTable | None = None,
        board_style: str = "grid",
        suboptimal_penalty: float = 0.0,
        independent_opponents: bool = False,
        win_seeking: bool = False,
    ) -> "TicTacToeEnv":
        return cls(
            table=minimax.load_table() if table is None else table,
            task=task,
            board_style=board_style,
            suboptimal_penalty=float(suboptimal_penalty),
            independent_opponents=bool(independent_opponents),
            win_seeking=bool(win_seeking),
        )

    def chat(self):
        return wording.chat_spec(self.board_style)

    def max_turns(self) -> int:
        return 1 if self.task == "move" else 5

    def reset(self, start: Starts):
        agent = start.agent_player.astype(jnp.int8)
        side = jnp.clip(agent.astype(jnp.int32) - 1, 0, 1)
        if self.task == "move":
            board = start.boards.astype(jnp.int8)
            return MoveState(board=board), interface.Message(jnp.int32(0), _values(board, side, 0))
        key = jax.random.wrap_key_data(start.opponent_key.astype(jnp.uint32))
        game = tasks.game_reset(jax.random.fold_in(key, 0), agent, start.opponent_kind, start.epsilon, self.table)
        state = GameState(
            game=game,
            opponent_key=start.opponent_key.astype(jnp.uint32),
            num_optimal=jnp.int32(0),
            num_seeking=jnp.int32(0),
            win_taken=jnp.bool_(False),
        )
        return state, interface.Message(jnp.int32(1), _values(game.board, side, 0))

    def observation(self, state):
        """The task's user message at the current board (``reset``'s message at the start)."""
        if self.task == "move":
            side = jnp.clip(ttt.to_move_from_counts(state.board).astype(jnp.int32) - 1, 0, 1)
            return interface.Message(jnp.int32(0), _values(state.board, side, 0))
        side = jnp.clip(state.game.agent_player.astype(jnp.int32) - 1, 0, 1)
        return interface.Message(jnp.int32(1), _values(state.game.board, side, 0))

    def for_member(self, state, member):
        if self.task == "move" or not self.independent_opponents:
            return state
        key = jax.random.fold_in(jax.random.wrap_key_data(state.opponent_key), 1 << 16)  # the turns use 0..5
        key = jax.random.key_data(jax.random.fold_in(key, member)).astype(jnp.uint32)
        return state.replace(opponent_key=jnp.where(member == 0, state.opponent_key, key))

    def _info(self, outcome, is_optimal, is_seeking, win_taken, num_optimal, board):
        return dict(
            outcome=outcome.astype(jnp.int32),
            is_optimal=is_optimal,
            is_seeking=is_seeking,
            win_taken=win_taken,
            num_optimal_moves=num_optimal.astype(jnp.int32),
            final_board=board.astype(jnp.int8),
        )

    def step(self, state, call: interface.ToolCall) -> interface.Step:
        kind = call.kind.astype(jnp.int32)
        square = jnp.where(call.ok, call.args[0], 0).astype(jnp.int32)
        if self.task == "move":
            r, info = tasks.move_reward(state.board, kind, square, self.table, win_seeking=self.win_seeking)
            outcome = jnp.select(
                [info["is_win_taken"], info["is_illegal"], ~info["is_valid_call"]],
                [tasks.OUTCOME_WIN, tasks.OUTCOME_ILLEGAL, tasks.OUTCOME_INVALID],
                tasks.OUTCOME_ONGOING,
            )
            # The episode ends here, so no rollout renders this message; it says what the move did (the board
            # after it and the game's status, as the game task would) for whoever asks the env (the play page).
            after = jnp.where(
                info["is_legal"] & (jnp.arange(ttt.NUM_SQUARES) == square - 1),
                ttt.to_move_from_counts(state.board),
                state.board,
            ).astype(jnp.int8)
            status = jnp.where(
                info["is_legal"] & ~info["is_win_taken"] & ttt.is_full(after), tasks.OUTCOME_DRAW, outcome
            )
            message = interface.Message(status.astype(jnp.int32), _values(after, 0, 0))
            return interface.Step(
                state=state,
                message=message,
                reward=r,
                done=jnp.bool_(True),
                info=self._info(
                    outcome, info["is_optimal"], info["is_seeking"], info["is_win_taken"], jnp.int32(0), state.board
                ),
            )
        key = jax.random.wrap_key_data(state.opponent_key)
        game, r, done, info = tasks.game_step(
            jax.random.fold_in(key, state.game.turns + 1), state.game, kind, square, self.table
        )
        num_optimal = state.num_optimal + info["agent_move_optimal"].astype(jnp.int32)
        num_seeking = state.num_seeking + info["agent_move_seeking"].astype(jnp.int32)
        win_taken = state.win_taken | info["agent_move_winning"]
        if self.suboptimal_penalty:
            good = num_seeking if self.win_seeking else num_optimal
            share = good.astype(jnp.float32) / jnp.maximum(game.turns, 1).astype(jnp.float32)
            r = r - jnp.where(done & ~state.game.done, self.suboptimal_penalty * (1.0 - share), 0.0)
        new = GameState(
            game=game,
            opponent_key=state.opponent_key,
            num_optimal=num_optimal,
            num_seeking=num_seeking,
            win_taken=win_taken,
        )
        status = jnp.clip(game.outcome, 0, wording.NUM_STATUSES - 1)
        message = interface.Message(status, _values(game.board, 0, game.opponent_square))
        return interface.Step(
            state=new,
            message=message,
            reward=r,
            done=done,
            info=self._info(game.outcome, jnp.bool_(False), jnp.bool_(False), win_taken, num_optimal, game.board),
        )

    def finish(self, state, info, truncated):
        info = dict(info)
        outcome = jnp.where(truncated, OUTCOME_TRUNCATED, info["outcome"]).astype(jnp.int32)
        if self.task == "game":
            turns = state.game.turns
            info["is_optimal"] = (state.num_optimal == turns) & (turns > 0) & ~truncated
            info["is_seeking"] = (state.num_seeking == turns) & (turns > 0) & ~truncated
        info["outcome"] = outcome
        for code, name in enumerate(OUTCOME_NAMES):
            if name != "ongoing":
                info[name] = outcome == code
        return info

    def episode_metrics(self):
        if self.task == "move":
            return {
                "optimal_move_rate": interface.rate("is_optimal", plot=True),
                "seeking_move_rate": interface.rate("is_seeking"),
                "illegal_rate": interface.rate("illegal", plot=True),
                "win_taken_rate": interface.rate("win_taken", plot=True),
            }
        out = {
            f"{name}_rate": interface.rate(name, plot=name in ("win", "draw", "loss"))
            for name in OUTCOME_NAMES
            if name != "ongoing"
        }
        out["optimal_move_rate"] = interface.rate("is_optimal")
        out["seeking_move_rate"] = interface.rate("is_seeking")
        out["win_taken_rate"] = interface.rate("win_taken")
        return out


def agent_players(side: str, num_groups: int, o_share: float = 0.5):
    """`int8 [N]` (or a scalar) agent sides for `side` in "x", "o", "alternate" (by group).

    "alternate": the agent plays O in a share `o_share` of the groups, spread evenly over the indices: group k is O
    when floor((k + 1) * o_share) > floor(k * o_share), so 0.5 alternates X, O, X, O, ... and 0.75 gives X, O, O, O.
    """
    if side == "alternate":
        if not 0.0 <= o_share <= 1.0:
            raise ValueError(f"o_share must be in [0, 1], got {o_share}")
        k = np.arange(num_groups, dtype=np.float64)
        o = np.floor((k + 1) * o_share) > np.floor(k * o_share)
        return np.where(o, 2, 1).astype(np.int8)
    return {"x": 1, "o": 2}[side]
