"""`Connect4Env`: Connect Four against a scripted opponent through the ``drop_piece`` tool, as a `TextEnv`.

One episode is one game. The agent plays X (moves first) or O (the opponent opens in ``reset``); each tool call
drops the agent's piece and, unless that ends the game, the opponent replies inside the same ``step``:

  not an ok call to drop_piece with a column 1..7  -> reward -1, done (outcome invalid)
  ok call on a full column                         -> reward -1, done (outcome illegal)
  the agent's piece makes four                     -> reward +1, done (win)
  the board is full                                -> reward  0, done (draw)
  the opponent's reply makes four                  -> reward -1, done (loss)
  the board is full after the reply                -> reward  0, done (draw)
  otherwise                                        -> reward  0, the tool response shows the reply and the board

Two static settings shape those rewards for RL (both off by default, so the table above is the default):
``illegal_reward`` replaces the -1 of an invalid or illegal call (below -1, a dropped move is worse than any loss,
so a policy that is losing anyway still gains by keeping its calls legal), and ``move_cost`` c makes a win on the
agent's m-th move worth 1 - c*m and a loss after its m-th move -1 + c*m: a quicker win and a later loss are better,
so a group whose games all end the same way (every game won against the random opponent, every game lost against a
stronger one) still has a reward spread, led by taking a four at once and stopping the opponent's.

The play page asks for one move at a given position instead: a start record with a ``board``
(`position_starts`) and ``single_move=True`` (no reply; the episode ends after the agent's move).

The opponent's randomness comes from the start record's key only: ``fold_in(key, 0)`` for the opening when the
agent is O, ``fold_in(key, k)`` for the reply to the agent's k-th move. So a group of samples sharing a start meets
the same opponent (the same reply to the same position), and replays are exact.

``opening_plies`` > 0 starts games from random positions instead of the empty board: ``reset`` plays an even
(agent X) or odd (agent O) number of uniform legal plies, at most ``opening_plies``, none of which makes four, drawn
from ``fold_in(key, OPENING_STREAM)``. Late-game positions hold far more fours to make or stop than the opening
moves do, so a warm start on such games sees the decisions that lose games to a greedy opponent more often, in
shorter transcripts.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface
from reno_jax.envs.connect4 import opponents, rules, wording
from reno_jax.envs.interface import Message, Step, TextEnv, ToolCall

OUTCOME_ONGOING = 0
OUTCOME_WIN = 1
OUTCOME_DRAW = 2
OUTCOME_LOSS = 3
OUTCOME_INVALID = 4  # no call, malformed call, another tool, or a column outside 1..7
OUTCOME_ILLEGAL = 5  # a well-formed call on a full column
OUTCOME_TRUNCATED = 6  # the rollout ran out of turns or length (set by `finish`)
OUTCOME_NAMES = ("ongoing", "win", "draw", "loss", "invalid", "illegal", "truncated")

OPPONENT_SETTINGS = ("random", "greedy", "negamax", "mixed")
OPENING_STREAM = 0x7FFFFFFF  # fold_in data of the random opening's key (the replies use 0, 1, 2, ...)
MAX_OPENING_PLIES = 30
AGENT_PLAYER_SETTINGS = ("alternate", 1, 2)


@flax.struct.dataclass
class Connect4Start:
    """Start record; every field has a leading ``[N]`` (episodes or groups).

    Attributes:
      agent_player: ``int32`` 1 (the agent is X and moves first) or 2 (the agent is O; the opponent opens).
      opponent: ``int32`` opponent id (``opponents.RANDOM`` 0, ``GREEDY`` 1, ``NEGAMAX`` 2).
      key: ``uint32 [N, 2]`` raw key data of the opponent's randomness.
      board: ``int8 [N, 6, 7]`` a position to start from (`position_starts`): the agent is its side to move and the
        opponent does not open; None (training, the suites): the empty board.
    """

    agent_player: jax.Array
    opponent: jax.Array
    key: jax.Array
    board: jax.Array | None = None


@flax.struct.dataclass
class Connect4State:
    """One episode.

    Attributes:
      game: the position (``game.to_move`` is the agent while the episode is live).
      agent_player: ``int8 []`` 1 (X) or 2 (O).
      opponent: ``int32 []`` opponent id.
      key: ``uint32 [2]`` the start record's key.
      agent_moves: ``int32 []`` the agent's pieces on the board.
      outcome: ``int32 []`` ``OUTCOME_*`` (ongoing until the episode ends).
      opponent_column: ``int32 []`` the opponent's latest reply 1..7, 0 when it has not replied.
    """

    game: rules.GameState
    agent_player: jax.Array
    opponent: jax.Array
    key: jax.Array
    agent_moves: jax.Array
    outcome: jax.Array
    opponent_column: jax.Array

    @property
    def done(self) -> jax.Array:
        return self.outcome != OUTCOME_ONGOING


def _key_data(key: jax.Array) -> jax.Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key.astype(jnp.uint32)


def sample_starts(
    key: jax.Array, num_groups: int, opponent: str = "random", agent_player: Any = "alternate"
) -> Connect4Start:
    """``[num_groups]`` start records (traceable; ``num_groups`` and the settings are static).

    Args:
      key: a PRNG key (raw ``uint32 [2]`` or typed); each group gets its own split.
      num_groups: number of starts.
      opponent: ``"random" | "greedy" | "negamax"`` for every group, or ``"mixed"``: the three in turn by group.
      agent_player: 1 (X) or 2 (O) for every group, or ``"alternate"``: X for even groups, O for odd ones.
        With ``"mixed"`` the two cycles (3 and 2) cover every (opponent, side) pair every six groups.
    """
    if opponent not in OPPONENT_SETTINGS:
        raise ValueError(f"opponent must be one of {list(OPPONENT_SETTINGS)}, got {opponent!r}")
    if agent_player not in AGENT_PLAYER_SETTINGS:
        raise ValueError(f"agent_player must be one of {list(AGENT_PLAYER_SETTINGS)}, got {agent_player!r}")
    groups = jnp.arange(num_groups, dtype=jnp.int32)
    if opponent == "mixed":
        opp = groups % len(opponents.KIND_NAMES)
    else:
        opp = jnp.full((num_groups,), opponents.kind_id(opponent), jnp.int32)
    if agent_player == "alternate":
        side = 1 + groups % 2
    else:
        side = jnp.full((num_groups,), int(agent_player), jnp.int32)
    keys = jax.random.split(jnp.asarray(_key_data(key)), num_groups)
    return Connect4Start(agent_player=side.astype(jnp.int32), opponent=opp, key=_key_data(keys))


def position_starts(boards) -> Connect4Start:
    """``[N]`` start records at ``int [N, 6, 7]`` positions (gravity holds, not finished), the agent playing each
    one's side to move; the opponent is random and its key zero (it only matters when the game goes on)."""
    boards = np.asarray(boards, np.int8)
    if boards.ndim != 3 or boards.shape[1:] != (rules.ROWS, rules.COLS):
        raise ValueError(f"boards must be [N, {rules.ROWS}, {rules.COLS}], got shape {boards.shape}")
    n = boards.shape[0]
    sides = np.array([rules.np_to_move(b) for b in boards], np.int32)
    return Connect4Start(
        agent_player=jnp.asarray(sides),
        opponent=jnp.zeros((n,), jnp.int32),
        key=jnp.zeros((n, 2), jnp.uint32),
        board=jnp.asarray(boards),
    )


@flax.struct.dataclass
class Connect4Env(TextEnv):
    """Connect Four against ``opponent`` (static; a pytree with no leaves).

    Attributes:
      opponent: which policies are compiled into ``reset`` / ``step``: one of ``"random"``, ``"greedy"``,
        ``"negamax"`` (every episode meets it, whatever its start record's id), or ``"mixed"`` (all three; each
        episode meets the one its start record names). A single kind avoids the negamax tree's cost when it is
        not wanted: under ``vmap`` every compiled policy runs for every episode.
      negamax_depth: plies the negamax opponent searches (2..4 are sensible; measured on a shared 2-core CPU with
        XLA's default optimisation, a batch of 64 replies takes ~4 ms at depth 2, ~20-30 ms at 3, ~260 ms at 4).
      max_agent_turns: agent turns per episode (21 = every agent move of a full game).
      single_move: the episode is the agent's one move: the opponent does not reply and the episode ends after it
        (reward +1 for a win, 0 for any other legal move): the play page asks the model for a move this way.
      mark_playable: the board text prints the cell each column's next piece lands on as ``*`` (`wording`).
      opening_plies: games start after a random number (0..opening_plies, of the parity that leaves the agent to
        move) of uniform legal plies that make no four; 0: from the empty board. Start records with a ``board``
        ignore it.
      echo_board: every board prints its rows twice, so each cell's every neighbour is in view somewhere before
        the second copy's cells (`wording`).
      illegal_reward: the reward of an invalid or illegal call (<= 0; default -1, a loss's).
      move_cost: c in a win's 1 - c*m and a loss's -1 + c*m after the agent's m-th move (0 <= c*max_agent_turns
        < 1, so every win stays above 0 and every loss below).
    """

    opponent: str = flax.struct.field(pytree_node=False, default="random")
    negamax_depth: int = flax.struct.field(pytree_node=False, default=3)
    max_agent_turns: int = flax.struct.field(pytree_node=False, default=21)
    single_move: bool = flax.struct.field(pytree_node=False, default=False)
    mark_playable: bool = flax.struct.field(pytree_node=False, default=False)
    opening_plies: int = flax.struct.field(pytree_node=False, default=0)
    echo_board: bool = flax.struct.field(pytree_node=False, default=False)
    illegal_reward: float = flax.struct.field(pytree_node=False, default=-1.0)
    move_cost: float = flax.struct.field(pytree_node=False, default=0.0)

    def __post_init__(self):
        if self.opponent not in OPPONENT_SETTINGS:
            raise ValueError(f"opponent must be one of {list(OPPONENT_SETTINGS)}, got {self.opponent!r}")
        if int(self.negamax_depth) < 1:
            raise ValueError(f"negamax_depth must be >= 1, got {self.negamax_depth}")
        if int(self.max_agent_turns) < 1:
            raise ValueError(f"max_agent_turns must be >= 1, got {self.max_agent_turns}")
        if not 0 <= int(self.opening_plies) <= MAX_OPENING_PLIES:
            raise ValueError(f"opening_plies must be in 0..{MAX_OPENING_PLIES}, got {self.opening_plies}")
        if not float(self.illegal_reward) <= 0.0:
            raise ValueError(f"illegal_reward must be <= 0 (a dropped move is never a gain), got {self.illegal_reward}")
        if not (float(self.move_cost) >= 0.0 and float(self.move_cost) * int(self.max_agent_turns) < 1.0):
            raise ValueError(
                f"move_cost must be >= 0 with move_cost * max_agent_turns < 1 (every win above 0, "
                f"every loss below), got {self.move_cost} with max_agent_turns={self.max_agent_turns}"
            )

    # ------------------------------------------------------------------------------------------------ host

    def chat(self):
        return wording.chat_spec(bool(self.echo_board))

    def max_turns(self) -> int:
        return 1 if self.single_move else int(self.max_agent_turns)

    def sample_starts(self, key: jax.Array, num_groups: int, agent_player: Any = "alternate") -> Connect4Start:
        """`sample_starts` with this env's opponent setting."""
        return sample_starts(key, num_groups, self.opponent, agent_player)

    def episode_metrics(self):
        out = {
            f"{name}_rate": interface.rate("outcome", equals=code, plot=name in ("win", "loss", "truncated"))
            for code, name in enumerate(OUTCOME_NAMES)
            if code != OUTCOME_ONGOING
        }
        out["agent_moves_mean"] = interface.mean_of("num_agent_moves")
        if self.opponent == "mixed":
            for kind, name in enumerate(opponents.KIND_NAMES):
                out[f"win_rate_vs_{name}"] = interface.rate(
                    "outcome", equals=OUTCOME_WIN, where=lambda info, kind=kind: np.asarray(info["opponent"]) == kind
                )
        return out

    # ------------------------------------------------------------------------------------------------ traced

    def _kinds(self) -> tuple[int, ...]:
        if self.opponent == "mixed":
            return tuple(range(len(opponents.KIND_NAMES)))
        return (opponents.kind_id(self.opponent),)

    def _opponent_column(self, key, game: rules.GameState, opponent) -> jax.Array:
        return opponents.opponent_column(key, game, opponent, depth=int(self.negamax_depth), kinds=self._kinds())

    def _info(self, state: Connect4State) -> dict[str, jax.Array]:
        o = state.outcome
        return dict(
            outcome=o,
            win=o == OUTCOME_WIN,
            draw=o == OUTCOME_DRAW,
            loss=o == OUTCOME_LOSS,
            invalid=o == OUTCOME_INVALID,
            illegal=o == OUTCOME_ILLEGAL,
            truncated=o == OUTCOME_TRUNCATED,
            num_agent_moves=state.agent_moves,
            opponent=state.opponent,
        )

    def _random_opening(self, key: jax.Array, agent_is_o: jax.Array) -> tuple[rules.GameState, jax.Array]:
        """The position after a random opening (see the module docstring) and its last column, 1-based (0: none)."""
        key = jax.random.fold_in(key, OPENING_STREAM)
        k_len, k_plies = jax.random.split(key)
        is_o = agent_is_o.astype(jnp.int32)
        pairs = jax.random.randint(k_len, (), 0, (int(self.opening_plies) - is_o) // 2 + 1)
        plies = 2 * pairs + is_o  # even for agent X, odd for agent O: the agent is to move after them

        def ply(i, carry):
            game, last = carry
            legal = rules.legal_columns(game)
            quiet = legal & ~opponents.winning_columns(game)
            col = opponents.uniform_choice(jax.random.fold_in(k_plies, i), jnp.where(quiet.any(), quiet, legal))
            col = jnp.where(i < plies, col, -1)
            return rules.drop(game, col), jnp.where(col >= 0, col + 1, last)

        return jax.lax.fori_loop(0, int(self.opening_plies), ply, (rules.reset(), jnp.int32(0)))

    def reset(self, start: Connect4Start) -> tuple[Connect4State, Message]:
        agent = jnp.asarray(start.agent_player, jnp.int32)
        opponent = jnp.asarray(start.opponent, jnp.int32)
        key = _key_data(start.key)
        if start.board is not None:  # a given position: the agent is its side to move (static branch)
            game = rules.state_from_board(start.board)
            agent_is_o = game.to_move == rules.O
            opening = jnp.int32(0)
        elif int(self.opening_plies):
            agent_is_o = agent == rules.O
            game, opening = self._random_opening(key, agent_is_o)
        else:
            agent_is_o = agent == rules.O
            empty = rules.reset()
            first = self._opponent_column(jax.random.fold_in(key, 0), empty, opponent)
            # A drop into column -1 is a no-op, so the agent-is-X case needs no select over the state.
            game = rules.drop(empty, jnp.where(agent_is_o, first, -1))
            opening = jnp.where(agent_is_o, first + 1, 0).astype(jnp.int32)
        state = Connect4State(
            game=game,
            agent_player=jnp.where(agent_is_o, rules.O, rules.X).astype(jnp.int8),
            opponent=opponent,
            key=key,
            agent_moves=jnp.int32(0),
            outcome=jnp.int32(OUTCOME_ONGOING),
            opponent_column=opening,
        )
        values = wording.message_values(game.board, state.agent_player, opening, mark_playable=bool(self.mark_playable))
        return state, Message(template=jnp.int32(wording.USER_GAME), values=values)

    def observation(self, state: Connect4State) -> Message:
        """The game's user message at the current board, naming the opponent's latest column (``reset``'s message
        at the start)."""
        values = wording.message_values(
            state.game.board, state.agent_player, state.opponent_column, mark_playable=bool(self.mark_playable)
        )
        return Message(template=jnp.int32(wording.USER_GAME), values=values)

    def step(self, state: Connect4State, call: ToolCall) -> Step:
        live = ~state.done
        agent = state.agent_player
        column = jnp.asarray(call.args, jnp.int32).reshape(-1)[0]
        valid = call.ok & (call.tool == 0) & (column >= 1) & (column <= rules.COLS)
        legal = valid & rules.is_legal(state.game, column - 1)
        invalid = live & ~valid
        illegal = live & valid & ~legal
        played = live & legal

        game1 = rules.drop(state.game, jnp.where(played, column - 1, -1))
        won = played & (game1.winner == agent)
        draw1 = played & ~won & game1.done
        reply = played & ~game1.done & (not self.single_move)

        reply_key = jax.random.fold_in(state.key, state.agent_moves + 1)
        reply_column = self._opponent_column(reply_key, game1, state.opponent)
        game2 = rules.drop(game1, jnp.where(reply, reply_column, -1))
        lost = reply & (game2.winner == (3 - agent))
        draw2 = reply & ~lost & game2.done

        outcome = jnp.select(
            [won, draw1 | draw2, lost, invalid, illegal],
            [OUTCOME_WIN, OUTCOME_DRAW, OUTCOME_LOSS, OUTCOME_INVALID, OUTCOME_ILLEGAL],
            default=state.outcome,
        ).astype(jnp.int32)
        moves = state.agent_moves + played.astype(jnp.int32)
        lasted = float(self.move_cost) * moves.astype(jnp.float32)
        reward = jnp.select(
            [won, lost, invalid | illegal], [1.0 - lasted, -1.0 + lasted, jnp.float32(self.illegal_reward)], 0.0
        )
        reward = reward.astype(jnp.float32)
        opponent_column = jnp.where(reply, reply_column + 1, 0).astype(jnp.int32)
        new_state = state.replace(
            game=game2,
            agent_moves=moves,
            outcome=outcome,
            opponent_column=jnp.where(live, opponent_column, state.opponent_column),
        )
        template = jnp.clip(outcome, 0, wording.NUM_TOOL_TEMPLATES - 1)  # TOOL_* == OUTCOME_* for 0..5
        values = wording.message_values(
            game2.board, agent, new_state.opponent_column, column, mark_playable=bool(self.mark_playable)
        )
        return Step(
            state=new_state,
            message=Message(template=template.astype(jnp.int32), values=values),
            reward=reward,
            done=new_state.done | (live & self.single_move),
            info=self._info(new_state),
        )

    def finish(self, state: Connect4State, info, truncated: jax.Array):
        cut = jnp.asarray(truncated) & (state.outcome == OUTCOME_ONGOING)
        return self._info(state.replace(outcome=jnp.where(cut, OUTCOME_TRUNCATED, state.outcome)))

    def initial_info(self, state: Connect4State):
        """The info pytree before any step (the rollout's carry needs its structure from the start)."""
        return self._info(state)

    # ------------------------------------------------------------------------------------------------ teacher

    def teacher_column(self, state: Connect4State, key: jax.Array, policy: str = "greedy") -> jax.Array:
        """``int32 []`` a 1-based column for the agent (the side to move) from a scripted ``policy``
        (``"random" | "greedy" | "negamax"``, static), for supervised warm-start transcripts written by stepping
        this env; 0 once the game is over."""
        kind = opponents.kind_id(policy)
        col = opponents.opponent_column(_key_data(key), state.game, kind, depth=int(self.negamax_depth), kinds=(kind,))
        return jnp.where(state.done, 0, col + 1).astype(jnp.int32)

    def teacher_call(self, state: Connect4State, key: jax.Array, policy: str = "greedy") -> ToolCall:
        """`teacher_column` as an ok ``drop_piece`` call."""
        column = self.teacher_column(state, key, policy)
        return ToolCall(kind=jnp.int32(0), tool=jnp.int32(0), args=column[None])
