"""Move and game tasks: rewards and opponents as pure jit/vmap functions.

Inputs from the tool-call parser (see ``tool_parser.py``): ``parse_kind int32 []`` (0 ok, 1 no_call, 2 bad_call,
3 out_of_range) and ``square int32 []`` (1..9 when ok). Boards are ``int8 [9]`` (0 empty, 1 X, 2 O). Every function
handles ONE example; the ``*_batch`` variants are ``jax.vmap``-ed over a leading ``[B]`` axis (the table is shared).

Move task (AReno's ``score_move``): one X move on a dataset board.
  invalid call (parse_kind != 0, or a square outside 1..9) or an occupied square -> -1.0
  a move that wins at once -> 1.0; another minimax-optimal move -> 0.8; any other legal move -> 0.0.

Game task (our multi-turn extension): the agent plays a whole game against an opponent through repeated tool calls.
  Per-step reward is 0 until the episode ends; the final step gets win +1, draw 0, loss -1, invalid/illegal -1.
  An invalid call (unparseable / no call / out of range) or an occupied square ends the episode at once.
"""

from __future__ import annotations

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs.tictactoe import minimax
from reno_jax.envs.tictactoe import rules as ttt

# Parser result kinds (design contract).
PARSE_OK = 0
PARSE_NO_CALL = 1
PARSE_BAD_CALL = 2
PARSE_OUT_OF_RANGE = 3

# Move-task rewards (AReno's game.score_move).
REWARD_INVALID = -1.0
REWARD_WIN = 1.0
REWARD_OPTIMAL = 0.8
REWARD_LEGAL = 0.0
REWARD_KEEPS_VALUE = 0.5 * (REWARD_OPTIMAL + REWARD_LEGAL)  # value-preserving but not seeking (win_seeking)

# Opponents, as ints so they can be traced and vmapped. Any other id behaves like minimax.
OPPONENT_RANDOM = 0
OPPONENT_MINIMAX = 1
OPPONENT_EPSILON = 2
OPPONENT_KINDS = {"random": OPPONENT_RANDOM, "minimax": OPPONENT_MINIMAX, "epsilon": OPPONENT_EPSILON}

# Game outcomes (GameTaskState.outcome).
OUTCOME_ONGOING = 0
OUTCOME_WIN = 1
OUTCOME_DRAW = 2
OUTCOME_LOSS = 3
OUTCOME_INVALID = 4  # no call / bad call / out of range
OUTCOME_ILLEGAL = 5  # well-formed call on an occupied square
OUTCOME_NAMES = ("ongoing", "win", "draw", "loss", "invalid", "illegal")

_SQUARES = np.arange(ttt.NUM_SQUARES, dtype=np.int32)


def opponent_kind_id(name: str) -> int:
    """Host helper: ``"random" | "minimax" | "epsilon"`` -> int id."""
    try:
        return OPPONENT_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown opponent kind {name!r}; expected one of {sorted(OPPONENT_KINDS)}") from None


def _check_call(parse_kind: chex.Array, square: chex.Array) -> tuple[jax.Array, jax.Array]:
    parse_kind = jnp.asarray(parse_kind, jnp.int32)
    square = jnp.asarray(square, jnp.int32)
    chex.assert_shape([parse_kind, square], ())
    return parse_kind, square


def _threat_squares(board: chex.Array, player: chex.Array) -> jax.Array:
    """``bool [9]``: empty squares where ``player`` would complete a line (ignores whose turn it is)."""
    bits = ttt.player_bits(board, player)
    with_stone = bits | (1 << _SQUARES)  # [9]
    completes = ((with_stone[:, None] & ttt.LINE_BITS[None, :]) == ttt.LINE_BITS[None, :]).any(-1)
    return completes & (board == ttt.EMPTY)


# ----------------------------------------------------------------------------------------------------------------
# Move task
# ----------------------------------------------------------------------------------------------------------------


def move_reward(
    board: chex.Array,
    parse_kind: chex.Array,
    square: chex.Array,
    table: minimax.MinimaxTable,
    win_seeking: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Reward of one tool call on one move-task board.

    Args:
      board: ``int8 [9]`` position; the mover is inferred from stone counts (X on dataset boards).
      parse_kind: ``int32 []`` parser result kind.
      square: ``int32 []`` chosen square 1..9 (ignored unless ``parse_kind == 0``).
      table: minimax table.
      win_seeking: (static) only the table's seeking moves earn ``REWARD_OPTIMAL``; the other value-preserving
        moves earn ``REWARD_KEEPS_VALUE``, halfway to a merely legal move.

    Returns:
      ``(reward float32 [], info)``; info values are ``[]`` arrays:
        ``parse_kind``; ``is_valid_call`` (parsed and square in 1..9); ``is_no_call``, ``is_bad_call``,
        ``is_out_of_range`` (kind 3, or kind 0 with a square outside 1..9); ``is_illegal`` (valid call, occupied
        square or finished game); ``is_legal``; ``is_optimal`` (legal and minimax-optimal, immediate wins included);
        ``is_seeking`` (legal and in the table's ``seeking_mask``); ``is_win_taken``; ``win_available`` (an
        immediate win existed); ``block_needed`` (the opponent threatens to win next move and no immediate win
        exists); ``is_block`` (the move occupies such a threat square);
        ``position_value`` (int8, for the mover).
    """
    chex.assert_shape(board, (ttt.NUM_SQUARES,))
    parse_kind, square = _check_call(parse_kind, square)
    in_range = (square >= 1) & (square <= ttt.NUM_SQUARES)
    valid_call = (parse_kind == PARSE_OK) & in_range
    idx = jnp.clip(square - 1, 0, ttt.NUM_SQUARES - 1)
    code = ttt.board_code(board)
    legal_row = (board == ttt.EMPTY) & ~ttt.is_terminal(board)
    optimal_row = table.optimal_mask[code]
    winning_row = table.winning_mask[code]

    legal = valid_call & legal_row[idx]
    wins = legal & winning_row[idx]
    optimal = legal & optimal_row[idx]
    seeking = legal & table.seeking_mask[code][idx]
    graded = jnp.where(seeking, REWARD_OPTIMAL, REWARD_KEEPS_VALUE) if win_seeking else REWARD_OPTIMAL
    reward = jnp.where(
        legal, jnp.where(wins, REWARD_WIN, jnp.where(optimal, graded, REWARD_LEGAL)), REWARD_INVALID
    ).astype(jnp.float32)

    mover = ttt.to_move_from_counts(board)
    threats = _threat_squares(board, 3 - mover) & legal_row
    win_available = jnp.any(winning_row)
    block_needed = jnp.any(threats) & ~win_available
    info = dict(
        parse_kind=parse_kind,
        is_valid_call=valid_call,
        is_no_call=parse_kind == PARSE_NO_CALL,
        is_bad_call=parse_kind == PARSE_BAD_CALL,
        is_out_of_range=(parse_kind == PARSE_OUT_OF_RANGE) | ((parse_kind == PARSE_OK) & ~in_range),
        is_illegal=valid_call & ~legal,
        is_legal=legal,
        is_optimal=optimal,
        is_seeking=seeking,
        is_win_taken=wins,
        win_available=win_available,
        block_needed=block_needed,
        is_block=legal & threats[idx],
        position_value=table.value[code],
    )
    return reward, info


# ----------------------------------------------------------------------------------------------------------------
# Opponents
# ----------------------------------------------------------------------------------------------------------------


def opponent_move(
    key: chex.PRNGKey,
    board: chex.Array,
    kind_id: chex.Array,
    epsilon: chex.Array,
    table: minimax.MinimaxTable,
) -> jax.Array:
    """Opponent's reply for the player to move on ``board`` (mover from stone counts).

    Args:
      key: PRNG key.
      board: ``int8 [9]``.
      kind_id: ``int32 []``: ``OPPONENT_RANDOM`` (uniform legal move), ``OPPONENT_MINIMAX`` (uniform among
        minimax-optimal moves), ``OPPONENT_EPSILON`` (random with probability ``epsilon``, else minimax).
      epsilon: ``float32 []`` used by the epsilon opponent only.
      table: minimax table.

    Returns:
      ``int32 []`` array index 0..8, or -1 when the position is terminal (no legal move).
    """
    chex.assert_shape(board, (ttt.NUM_SQUARES,))
    kind_id = jnp.asarray(kind_id, jnp.int32)
    epsilon = jnp.asarray(epsilon, jnp.float32)
    chex.assert_shape([kind_id, epsilon], ())
    legal = (board == ttt.EMPTY) & ~ttt.is_terminal(board)
    optimal = table.optimal_mask[ttt.board_code(board)]
    # One draw of 10 uniforms (coin + 9 picks): a single PRNG call keeps both run time and XLA compile time down.
    u = jax.random.uniform(key, (ttt.NUM_SQUARES + 1,))
    explore = u[0] < epsilon
    use_random = (kind_id == OPPONENT_RANDOM) | ((kind_id == OPPONENT_EPSILON) & explore)
    mask = jnp.where(use_random, legal, optimal)
    # argmax of i.i.d. uniforms restricted to the mask = a uniform choice among the masked squares.
    scores = jnp.where(mask, u[1:], -1.0)
    return jnp.where(jnp.any(mask), jnp.argmax(scores).astype(jnp.int32), jnp.int32(-1))


# ----------------------------------------------------------------------------------------------------------------
# Game task
# ----------------------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class GameTaskState:
    """One game of the agent against an opponent (vmap for batches: every field gains a leading ``[B]``).

    Attributes:
      board: ``int8 [9]`` current position; the agent is to move while ``done`` is False.
      agent_player: ``int8 []`` 1 (agent is X, moves first) or 2 (agent is O, opponent opens).
      opponent_kind: ``int32 []`` opponent id (``OPPONENT_*``).
      epsilon: ``float32 []`` exploration rate of the epsilon opponent.
      done: ``bool []`` episode over.
      outcome: ``int32 []`` ``OUTCOME_*`` (0 while ongoing).
      turns: ``int32 []`` agent turns taken (tool calls answered, including a final invalid one).
      opponent_square: ``int32 []`` the opponent's latest reply as a square 1..9, 0 if it has not replied (yet or
        in the last step); the rollout renders it into the tool response.
    """

    board: jax.Array
    agent_player: jax.Array
    opponent_kind: jax.Array
    epsilon: jax.Array
    done: jax.Array
    outcome: jax.Array
    turns: jax.Array
    opponent_square: jax.Array


def game_reset(
    key: chex.PRNGKey,
    agent_player: chex.Array,
    opponent_kind: chex.Array,
    epsilon: chex.Array,
    table: minimax.MinimaxTable,
) -> GameTaskState:
    """Start a game. ``agent_player`` 1 = X (agent opens) or 2 = O (the opponent's first move is already made)."""
    agent_player = jnp.asarray(agent_player, jnp.int8)
    opponent_kind = jnp.asarray(opponent_kind, jnp.int32)
    epsilon = jnp.asarray(epsilon, jnp.float32)
    chex.assert_shape([agent_player, opponent_kind, epsilon], ())
    empty = jnp.zeros((ttt.NUM_SQUARES,), jnp.int8)
    agent_is_o = agent_player == ttt.O
    first = opponent_move(key, empty, opponent_kind, epsilon, table)
    board = jnp.where(agent_is_o & (_SQUARES == first), jnp.int8(ttt.X), empty).astype(jnp.int8)
    return GameTaskState(
        board=board,
        agent_player=jnp.where(agent_is_o, jnp.int8(ttt.O), jnp.int8(ttt.X)),
        opponent_kind=opponent_kind,
        epsilon=epsilon,
        done=jnp.bool_(False),
        outcome=jnp.int32(OUTCOME_ONGOING),
        turns=jnp.int32(0),
        opponent_square=jnp.where(agent_is_o, first + 1, 0).astype(jnp.int32),
    )


def game_step(
    key: chex.PRNGKey,
    state: GameTaskState,
    parse_kind: chex.Array,
    square: chex.Array,
    table: minimax.MinimaxTable,
) -> tuple[GameTaskState, jax.Array, jax.Array, dict[str, jax.Array]]:
    """Apply the agent's tool call, then the opponent's reply.

    Order: check the call (invalid/occupied -> episode ends, reward -1); place the agent's stone; agent line ->
    win (+1); full board -> draw (0); else the opponent replies; opponent line -> loss (-1); full board -> draw.
    A step on a finished episode changes nothing and returns reward 0, ``done`` True and all-False outcome flags.

    Args:
      key: PRNG key for the opponent.
      state: current ``GameTaskState``.
      parse_kind: ``int32 []`` parser kind; square: ``int32 []`` 1..9.
      table: minimax table.

    Returns:
      ``(new_state, reward float32 [], done bool [], info)``; info values are ``[]`` arrays: ``win``, ``draw``,
      ``loss``, ``invalid`` (no/bad/out-of-range call), ``illegal`` (occupied square) — at most one is True —
      ``active`` (the episode was live before this step), ``agent_square`` (1..9 if the move was played, else 0),
      ``agent_move_optimal`` / ``agent_move_winning`` / ``agent_move_seeking`` (per the minimax table),
      ``opponent_square`` (1..9 if the opponent replied this step, else 0), ``turns`` (agent turns so far), ``outcome``.
    """
    chex.assert_shape(state.board, (ttt.NUM_SQUARES,))
    parse_kind, square = _check_call(parse_kind, square)
    live = ~state.done
    agent = state.agent_player
    opp = (jnp.int8(3) - agent).astype(jnp.int8)
    board0 = state.board

    in_range = (square >= 1) & (square <= ttt.NUM_SQUARES)
    valid_call = (parse_kind == PARSE_OK) & in_range
    idx = jnp.clip(square - 1, 0, ttt.NUM_SQUARES - 1)
    legal = valid_call & (board0[idx] == ttt.EMPTY)
    invalid = live & ~valid_call
    illegal = live & valid_call & ~legal
    played = live & legal

    code0 = ttt.board_code(board0)
    move_optimal = played & table.optimal_mask[code0][idx]
    move_winning = played & table.winning_mask[code0][idx]
    move_seeking = played & table.seeking_mask[code0][idx]

    board1 = jnp.where(played & (_SQUARES == idx), agent, board0).astype(jnp.int8)
    agent_won = played & ttt.has_line(ttt.player_bits(board1, agent))
    full1 = jnp.all(board1 != ttt.EMPTY)
    draw1 = played & ~agent_won & full1
    reply = played & ~agent_won & ~full1

    opp_idx = opponent_move(key, board1, state.opponent_kind, state.epsilon, table)
    board2 = jnp.where(reply & (_SQUARES == opp_idx), opp, board1).astype(jnp.int8)
    opp_won = reply & ttt.has_line(ttt.player_bits(board2, opp))
    draw2 = reply & ~opp_won & jnp.all(board2 != ttt.EMPTY)

    win = agent_won
    draw = draw1 | draw2
    loss = opp_won
    ended = invalid | illegal | win | draw | loss
    outcome = jnp.select(
        [win, draw, loss, invalid, illegal],
        [OUTCOME_WIN, OUTCOME_DRAW, OUTCOME_LOSS, OUTCOME_INVALID, OUTCOME_ILLEGAL],
        default=state.outcome,
    ).astype(jnp.int32)
    reward = jnp.where(win, 1.0, jnp.where(loss | invalid | illegal, -1.0, 0.0)).astype(jnp.float32)
    opponent_square = jnp.where(reply, opp_idx + 1, 0).astype(jnp.int32)
    turns = state.turns + live.astype(jnp.int32)

    new_state = GameTaskState(
        board=board2,
        agent_player=state.agent_player,
        opponent_kind=state.opponent_kind,
        epsilon=state.epsilon,
        done=state.done | ended,
        outcome=outcome,
        turns=turns,
        opponent_square=jnp.where(live, opponent_square, state.opponent_square),
    )
    info = dict(
        win=win,
        draw=draw,
        loss=loss,
        invalid=invalid,
        illegal=illegal,
        active=live,
        agent_square=jnp.where(played, square, 0).astype(jnp.int32),
        agent_move_optimal=move_optimal,
        agent_move_winning=move_winning,
        agent_move_seeking=move_seeking,
        opponent_square=opponent_square,
        turns=turns,
        outcome=outcome,
    )
    return new_state, reward, new_state.done, info


# ----------------------------------------------------------------------------------------------------------------
# Batched variants (leading [B] axis on every argument except the table)
# ----------------------------------------------------------------------------------------------------------------

move_reward_batch = jax.vmap(move_reward, in_axes=(0, 0, 0, None))
opponent_move_batch = jax.vmap(opponent_move, in_axes=(0, 0, 0, 0, None))
game_reset_batch = jax.vmap(game_reset, in_axes=(0, 0, 0, 0, None))
game_step_batch = jax.vmap(game_step, in_axes=(0, 0, 0, 0, None))
