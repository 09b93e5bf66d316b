"""Connect Four (reno_jax.envs.connect4): rules against the NumPy reference, the opponents, the env's reset / step
under jit and vmap with hand-made tool calls, and the ChatSpec's texts and token budget."""

from __future__ import annotations

import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.envs import interface
from reno_jax.envs.connect4 import env as c4env
from reno_jax.envs.connect4 import opponents, rules, wording
from reno_jax.envs.interface import ToolCall
from reno_jax.protocol.chat import Slot, resolve

ENV_KINDS = dict(random=0, greedy=1, negamax=2)


def board_of(rows: list[str]) -> np.ndarray:
    """Board from six strings top to bottom ('.', 'X', 'O')."""
    assert len(rows) == rules.ROWS and all(len(r) == rules.COLS for r in rows)
    return np.array([[".XO".index(ch) for ch in row] for row in rows], np.int8)


def random_positions(n: int, seed: int, max_moves: int = 30) -> list[np.ndarray]:
    """Non-terminal positions from uniformly random games."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        board = rules.np_random_game(rng, max_moves=int(rng.integers(0, max_moves)))[-1]
        if rules.np_legal(board).any():
            out.append(board)
    return out


def np_wins(board) -> np.ndarray:
    """Reference: columns where the side to move wins at once."""
    p = rules.np_to_move(board)
    legal = rules.np_legal(board)
    return np.array([legal[c] and rules.np_winner(rules.np_drop(board, c, p)) == p for c in range(rules.COLS)])


def np_blocks(board) -> np.ndarray:
    """Reference: columns where the other side would win at once."""
    q = 3 - rules.np_to_move(board)
    legal = rules.np_legal(board)
    return np.array([legal[c] and rules.np_winner(rules.np_drop(board, c, q)) == q for c in range(rules.COLS)])


# ------------------------------------------------------------------------------------------------ rules


_drop = jax.jit(rules.drop)
_from_board = jax.jit(rules.state_from_board)


def test_rules_match_numpy_reference_over_random_games():
    rng = np.random.default_rng(0)
    for _ in range(12):
        boards = rules.np_random_game(rng)
        state = rules.reset()
        for before, after in zip(boards[:-1], boards[1:]):
            column = int(np.flatnonzero((before != after).any(axis=0))[0])
            np.testing.assert_array_equal(np.asarray(rules.legal_columns(state)), rules.np_legal(before))
            state = _drop(state, column)
            np.testing.assert_array_equal(np.asarray(state.board), after)
            assert int(state.winner) == rules.np_winner(after)
            assert bool(state.done) == (rules.np_winner(after) != 0 or not rules.np_legal(after).any())
            assert int(state.turn) == int((after != 0).sum())
            assert int(state.last_column) == column
        assert bool(state.done)
        assert not np.asarray(rules.legal_columns(state)).any()
        assert int(_drop(state, 3).turn) == int(state.turn)  # a drop after the end is a no-op


@pytest.mark.parametrize(
    "rows,who",
    [
        (["......."] * 5 + [".XXXX.."], 1),  # horizontal
        (["......."] * 2 + ["......O"] * 4, 2),  # vertical
        (["......."] * 2 + ["...X...", "..X....", ".X.....", "X......"], 1),  # rising to the right
        (["......."] * 2 + ["..O....", "...O...", "....O..", ".....O."], 2),  # falling to the right
        (["......."] * 5 + ["XXX.XXX"], 0),  # a gap is not a line
    ],
)
def test_winner_every_direction(rows, who):
    board = board_of(rows)
    assert rules.np_winner(board) == who
    assert int(rules.winner(jnp.asarray(board))) == who


def test_full_column_and_out_of_range_drops_are_no_ops():
    board = board_of(["X......", "O......", "X......", "O......", "X......", "O......"])
    state = _from_board(board)
    assert not bool(rules.is_legal(state, 0)) and not bool(rules.is_legal(state, 7))
    assert not bool(rules.is_legal(state, -1)) and bool(rules.is_legal(state, 1))
    for column in (0, -1, 7):
        np.testing.assert_array_equal(np.asarray(_drop(state, column).board), board)


# ------------------------------------------------------------------------------------------------ opponents


@functools.lru_cache(maxsize=None)
def _batched(policy, **kw):
    return jax.jit(jax.vmap(lambda k, b: policy(k, rules.state_from_board(b), **kw)))


def _batch_column(policy, positions, seed=0, **kw):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(positions))
    return np.asarray(_batched(policy, **kw)(keys, jnp.asarray(np.stack(positions))))


@pytest.fixture(scope="module")
def tactical_positions():
    """Random positions where the mover has a win in one or must block one (and a few quiet ones)."""
    positions = random_positions(120, seed=1, max_moves=34)
    tactical = [b for b in positions if np_wins(b).any() or np_blocks(b).any()]
    assert len(tactical) >= 32
    return tactical[:48]


def test_random_and_greedy_pick_legal_columns_and_greedy_takes_wins_then_blocks(tactical_positions):
    quiet = random_positions(16, seed=2)
    positions = tactical_positions + quiet
    legal = np.stack([rules.np_legal(b) for b in positions])
    rand = _batch_column(opponents.random_column, positions)
    greedy = _batch_column(opponents.greedy_column, positions)
    rows = np.arange(len(positions))
    assert legal[rows, rand].all() and legal[rows, greedy].all()
    for b, col in zip(positions, greedy):
        wins, blocks = np_wins(b), np_blocks(b)
        if wins.any():
            assert wins[col]
        elif blocks.any():
            assert blocks[col]
    # Same key, same column; the tie-break follows the key.
    np.testing.assert_array_equal(rand, _batch_column(opponents.random_column, positions))
    assert (rand != _batch_column(opponents.random_column, positions, seed=1)).any()


def test_negamax_depth2_never_misses_a_win_or_a_block(tactical_positions):
    cols = _batch_column(opponents.negamax_column, tactical_positions, depth=2)
    for b, col in zip(tactical_positions, cols):
        wins, blocks = np_wins(b), np_blocks(b)
        assert rules.np_legal(b)[col]
        if wins.any():
            assert wins[col]
        elif blocks.any():
            assert blocks[col]


@functools.lru_cache(maxsize=None)
def _scores_fn(depth):
    return jax.jit(jax.vmap(lambda b: opponents.negamax_scores(rules.state_from_board(b), depth)))


def _scores_of(depth, positions):
    return np.asarray(_scores_fn(depth)(jnp.asarray(np.stack(positions))))


@pytest.mark.parametrize("depth,count", [(1, 4), (2, 3), (3, 1)])
def test_negamax_scores_match_numpy_reference(depth, count):
    positions = random_positions(count, seed=10 + depth)
    got = _scores_of(depth, positions)
    for b, g in zip(positions, got):
        np.testing.assert_array_equal(g, opponents.np_negamax_scores(b, depth))


def test_negamax_depth3_sees_a_double_threat():
    # X to move: column 2 or 5 (1-based) makes an open three on the bottom row that O cannot stop at both ends;
    # only a 3-ply search sees the win behind it.
    board = board_of(["......."] * 4 + ["..OO...", "..XX..."])
    assert rules.np_to_move(board) == rules.X
    (scores,) = _scores_of(3, [board])
    assert set(np.flatnonzero(scores == opponents.WIN + 1)) == {1, 4}
    assert scores.max() == opponents.WIN + 1


def test_opponent_column_dispatches_on_the_id():
    board = board_of(["......."] * 5 + ["XXX.OO."])
    state = rules.state_from_board(board)  # O to move: greedy and negamax must block at column 3 (0-based)
    f = jax.jit(lambda k, i: opponents.opponent_column(k, state, i, depth=2))
    for i in (opponents.GREEDY, opponents.NEGAMAX):
        assert int(f(jax.random.PRNGKey(0), i)) == 3
    only_greedy = jax.jit(lambda k, i: opponents.opponent_column(k, state, i, kinds=(opponents.GREEDY,)))
    assert int(only_greedy(jax.random.PRNGKey(0), opponents.RANDOM)) == 3  # ids outside kinds play kinds[0]


# ------------------------------------------------------------------------------------------------ env


def call(column, kind=0, tool=0) -> ToolCall:
    return ToolCall(kind=jnp.int32(kind), tool=jnp.int32(tool), args=jnp.array([column], jnp.int32))


def env_state(board, agent_player: int, opponent: int = opponents.GREEDY, seed: int = 0) -> c4env.Connect4State:
    board = np.asarray(board, np.int8)
    assert rules.np_to_move(board) == agent_player
    assert not ((board[:-1] != 0) & (board[1:] == 0)).any(), "a piece floats above an empty cell"
    return c4env.Connect4State(
        game=rules.state_from_board(board),
        agent_player=jnp.int8(agent_player),
        opponent=jnp.int32(opponent),
        key=jax.random.PRNGKey(seed),
        agent_moves=jnp.int32(int((board == agent_player).sum())),
        outcome=jnp.int32(0),
        opponent_column=jnp.int32(0),
    )


def no_win_full_board() -> np.ndarray:
    board = board_of(["XOXOXOX", "XOXOXOX", "XOXOXOX", "OXOXOXO", "OXOXOXO", "OXOXOXO"])
    assert rules.np_winner(board) == 0 and (board == 1).sum() == 21
    return board


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


# Every env test shares one env and its compiled programs (compilation is most of their time); hand-made states
# meet the greedy opponent (env_state's default), sampled starts all three.
ENV = MIXED = c4env.Connect4Env(opponent="mixed", negamax_depth=1)
_step = jax.jit(ENV.step)
_mixed_reset = jax.jit(jax.vmap(MIXED.reset))
_mixed_step = jax.jit(jax.vmap(MIXED.step))
NUM_CASES = 12  # batch of the step cases and of the teacher games: one vmapped step program for both


def test_step_cases_under_jit_and_vmap():
    full = no_win_full_board()
    draw_board = full.copy()
    draw_board[0, 1] = 0  # an O cell: O (the agent) fills the last square
    draw2_board = full.copy()
    draw2_board[0, 1] = 0  # O
    draw2_board[0, 0] = 0  # X: X (the agent) to move, then the opponent fills the last square
    cases = {
        # name: (state, call, reward, outcome == tool template)
        "no_call": (env_state(np.zeros((6, 7)), 1), call(0, kind=1), -1.0, 4),
        "bad_call": (env_state(np.zeros((6, 7)), 1), call(0, kind=2), -1.0, 4),
        "out_of_range_kind": (env_state(np.zeros((6, 7)), 1), call(0, kind=3), -1.0, 4),
        "ok_but_column_8": (env_state(np.zeros((6, 7)), 1), call(8), -1.0, 4),
        "ok_but_column_0": (env_state(np.zeros((6, 7)), 1), call(0), -1.0, 4),
        "other_tool": (env_state(np.zeros((6, 7)), 1), call(4, tool=1), -1.0, 4),
        "full_column": (
            env_state(board_of(["X......", "O......", "X......", "O......", "X......", "O......"]), 1),
            call(1),
            -1.0,
            5,
        ),
        "win_in_one": (env_state(board_of(["......."] * 4 + ["OO....."] + ["XXX...O"]), 1), call(4), 1.0, 1),
        "opponent_wins": (env_state(board_of(["......."] * 4 + ["X.X..O."] + ["OOO.XX."]), 1), call(7), -1.0, 3),
        "draw_after_agent": (env_state(draw_board, 2), call(2), 0.0, 2),
        "draw_after_reply": (env_state(draw2_board, 1), call(1), 0.0, 2),
        "ongoing": (env_state(np.zeros((6, 7)), 1), call(4), 0.0, 0),
    }
    names = list(cases)
    states = _stack([cases[n][0] for n in names])
    calls = _stack([cases[n][1] for n in names])
    assert len(names) == NUM_CASES
    out = _mixed_step(states, calls)
    n = len(names)
    chex.assert_shape([out.reward, out.done, out.message.template, out.info["outcome"]], (n,))
    chex.assert_shape(out.message.values, (n, wording.NUM_VALUES))
    chex.assert_type(out.message.values, jnp.int32)
    for i, name in enumerate(names):
        _, _, reward, outcome = cases[name]
        assert float(out.reward[i]) == reward, name
        assert int(out.info["outcome"][i]) == outcome, name
        assert int(out.message.template[i]) == outcome, name
        assert bool(out.done[i]) == (outcome != 0), name
        for flag, code in (("win", 1), ("draw", 2), ("loss", 3), ("invalid", 4), ("illegal", 5)):
            assert bool(out.info[flag][i]) == (outcome == code), (name, flag)
        # One episode alone (jit, no vmap) agrees with its row of the batch.
        single = _step(cases[name][0], cases[name][1])
        chex.assert_trees_all_equal(single, jax.tree.map(lambda x: x[i], out))
    i = names.index("opponent_wins")
    assert int(out.state.opponent_column[i]) == 4 and int(out.message.values[i, wording.V_OPPONENT]) == 4
    i = names.index("ongoing")
    assert int(out.state.agent_moves[i]) == 1 and int(out.state.game.turn[i]) == 2
    assert 1 <= int(out.state.opponent_column[i]) <= 7
    i = names.index("full_column")
    assert int(out.message.values[i, wording.V_COLUMN]) == 1
    assert wording.tool_text(np.asarray(out.message.values[i]), 5) == "Column 1 is full. You lost."


def test_shaped_rewards_follow_the_moves_played_and_price_a_dropped_move():
    """illegal_reward and move_cost change the reward only: a win on the agent's m-th move is 1 - c*m, a loss
    after its m-th move -1 + c*m, every invalid or illegal call illegal_reward; outcomes stay the same."""
    shaped = c4env.Connect4Env(opponent="greedy", negamax_depth=1, illegal_reward=-2.0, move_cost=0.03)
    cases = [  # (state, call, reward): the agent's moves before this one are its pieces on the board
        (env_state(np.zeros((6, 7)), 1), call(0, kind=1), -2.0),
        (env_state(board_of(["X......", "O......", "X......", "O......", "X......", "O......"]), 1), call(1), -2.0),
        (env_state(board_of(["......."] * 4 + ["OO....."] + ["XXX...O"]), 1), call(4), 1.0 - 0.03 * 4),
        (env_state(board_of(["......."] * 4 + ["X.X..O."] + ["OOO.XX."]), 1), call(7), -1.0 + 0.03 * 5),
        (env_state(np.zeros((6, 7)), 1), call(4), 0.0),
    ]
    states, calls = _stack([c[0] for c in cases]), _stack([c[1] for c in cases])
    out = jax.jit(jax.vmap(shaped.step))(states, calls)
    plain = jax.jit(jax.vmap(c4env.Connect4Env(opponent="greedy", negamax_depth=1).step))(states, calls)
    np.testing.assert_allclose(np.asarray(out.reward), [c[2] for c in cases], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.info["outcome"]), np.asarray(plain.info["outcome"]))
    np.testing.assert_array_equal(np.asarray(plain.reward), [-1.0, -1.0, 1.0, -1.0, 0.0])
    with pytest.raises(ValueError, match="illegal_reward"):
        c4env.Connect4Env(illegal_reward=0.5)
    with pytest.raises(ValueError, match="move_cost"):
        c4env.Connect4Env(move_cost=0.05)  # 21 moves would make a win worth less than 0
    with pytest.raises(ValueError, match="move_cost"):
        c4env.Connect4Env(move_cost=-0.01)


def test_step_after_done_changes_nothing():
    state = env_state(board_of(["......."] * 4 + ["OO....."] + ["XXX...O"]), 1)
    first = _step(state, call(4))
    again = _step(first.state, call(5))
    assert bool(again.done) and float(again.reward) == 0.0
    chex.assert_trees_all_equal(again.state, first.state)
    chex.assert_trees_all_equal(again.info, first.info)


def test_reset_agent_second_sees_the_opening():
    starts = MIXED.sample_starts(jax.random.PRNGKey(3), 4)
    chex.assert_shape([starts.agent_player, starts.opponent], (4,))
    chex.assert_shape(starts.key, (4, 2))
    np.testing.assert_array_equal(np.asarray(starts.agent_player), [1, 2, 1, 2])
    state, message = _mixed_reset(starts)
    chex.assert_shape(message.values, (4, wording.NUM_VALUES))
    turns = np.asarray(state.game.turn)
    np.testing.assert_array_equal(turns, [0, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(state.game.to_move), np.asarray(state.agent_player))
    values = np.asarray(message.values)
    for i in range(4):
        opening = int(state.opponent_column[i])
        assert (opening == 0) == (i % 2 == 0)
        assert values[i, wording.V_OPPONENT] == opening
        text = wording.user_text(values[i])
        assert text.startswith("You are X.\n.......\n" if i % 2 == 0 else f"You are O.\nOpponent played {opening}.\n")
        assert text.endswith("\n1234567")
        if opening:
            assert np.asarray(state.game.board[i])[5, opening - 1] == rules.X
    # The opening is a function of the key only.
    again, _ = _mixed_reset(starts)
    chex.assert_trees_all_equal(again, state)


@pytest.mark.parametrize("plies", [1, 6, 15])
def test_random_opening_leaves_the_agent_to_move_in_a_live_game(plies):
    env = c4env.Connect4Env(opponent="mixed", opening_plies=plies)
    starts = env.sample_starts(jax.random.PRNGKey(7), 96)
    state, message = jax.jit(jax.vmap(env.reset))(starts)
    boards = np.asarray(state.game.board)
    counts = (boards != rules.EMPTY).sum(axis=(1, 2))
    agent = np.asarray(state.agent_player)
    np.testing.assert_array_equal(np.asarray(state.game.to_move), agent)
    assert (counts <= plies).all() and ((counts % 2) == (agent == rules.O)).all()
    assert len(set(counts.tolist())) == plies + 1  # every length of either parity is drawn
    assert not np.asarray(state.done).any() and not np.asarray(state.game.done).any()
    for board, n, last, values in zip(boards, counts, np.asarray(state.opponent_column), np.asarray(message.values)):
        assert rules.np_winner(board) == 0 and rules.np_to_move(board) != 0
        assert (last == 0) == (n == 0) and values[wording.V_OPPONENT] == last
        if last:  # the last opening ply is the opponent's piece on top of its column
            top = int(np.argmax(board[:, last - 1] != rules.EMPTY))
            assert board[top, last - 1] == 3 - rules.np_to_move(board)
    again, _ = jax.jit(jax.vmap(env.reset))(starts)  # a function of the start's key
    chex.assert_trees_all_equal(again, state)
    with pytest.raises(ValueError, match="opening_plies"):
        c4env.Connect4Env(opening_plies=c4env.MAX_OPENING_PLIES + 1)


def test_sample_starts_mixed_covers_every_opponent_and_side():
    starts = c4env.sample_starts(jax.random.PRNGKey(0), 6, "mixed", "alternate")
    pairs = set(zip(np.asarray(starts.opponent).tolist(), np.asarray(starts.agent_player).tolist()))
    assert pairs == {(o, s) for o in range(3) for s in (1, 2)}
    assert c4env.sample_starts(jax.random.key(0), 3, "negamax", 2).opponent.tolist() == [2, 2, 2]
    with pytest.raises(ValueError):
        c4env.sample_starts(jax.random.PRNGKey(0), 2, "minimax")


def test_finish_marks_truncation_only_for_live_episodes():
    live = env_state(np.zeros((6, 7)), 1)
    info = ENV.initial_info(live)
    cut = ENV.finish(live, info, jnp.bool_(True))
    assert int(cut["outcome"]) == c4env.OUTCOME_TRUNCATED and bool(cut["truncated"])
    assert int(ENV.finish(live, info, jnp.bool_(False))["outcome"]) == 0
    won = _step(env_state(board_of(["......."] * 4 + ["OO....."] + ["XXX...O"]), 1), call(4))
    kept = ENV.finish(won.state, won.info, jnp.bool_(True))
    assert int(kept["outcome"]) == c4env.OUTCOME_WIN and not bool(kept["truncated"])
    chex.assert_trees_all_equal_structs(kept, won.info)


def test_teacher_games_against_every_opponent_end_within_max_turns():
    env = MIXED
    starts = env.sample_starts(jax.random.PRNGKey(5), NUM_CASES)
    state, _ = _mixed_reset(starts)
    step = _mixed_step
    teach = jax.jit(jax.vmap(lambda s, k: env.teacher_call(s, k, "greedy")))
    total = np.zeros(NUM_CASES, np.float32)
    for t in range(env.max_turns()):
        out = step(state, teach(state, jax.random.split(jax.random.PRNGKey(100 + t), NUM_CASES)))
        total += np.asarray(out.reward)
        state = out.state
    assert bool(out.done.all())
    info = jax.device_get(env.finish(out.state, out.info, jnp.zeros(NUM_CASES, bool)))
    outcome = np.asarray(info["outcome"])
    assert set(outcome.tolist()) <= {1, 2, 3}  # the teacher never makes an invalid or illegal call
    np.testing.assert_array_equal(total, np.select([outcome == 1, outcome == 3], [1.0, -1.0], 0.0))
    metrics = interface.summarize(env, info)
    assert abs(metrics["win_rate"] + metrics["draw_rate"] + metrics["loss_rate"] - 1) < 1e-6
    assert 4 <= metrics["agent_moves_mean"] <= 21
    assert {"win_rate_vs_random", "win_rate_vs_greedy", "win_rate_vs_negamax"} <= set(metrics)  # mixed opponents


def test_teacher_takes_a_win_and_is_zero_when_done():
    state = env_state(board_of(["......."] * 4 + ["OO....."] + ["XXX...O"]), 1)
    teacher = jax.jit(ENV.teacher_column)
    assert int(teacher(state, jax.random.PRNGKey(0))) == 4
    done = _step(state, call(4)).state
    assert int(teacher(done, jax.random.PRNGKey(0))) == 0


# ------------------------------------------------------------------------------------------------ chat spec


def _slots(parts):
    return [p for p in parts if isinstance(p, Slot)]


def test_chat_spec_slots_and_texts():
    spec = ENV.chat()
    assert len(spec.tool) == len(spec.tool_continues) == wording.NUM_TOOL_TEMPLATES
    assert spec.tool_continues == (True, False, False, False, False, False)
    assert spec.tool_name == "drop_piece" and len(spec.user) == 1
    json.dumps(spec.tools)  # plain JSON, as the HF `tools=` argument expects
    params = spec.tools[0]["function"]["parameters"]
    assert params["properties"]["column"] == {"type": "integer", "minimum": 1, "maximum": 7}
    for parts in (*spec.user, *spec.tool):
        for slot in _slots(parts):
            assert 0 <= slot.value < spec.num_values and len(slot.options) >= 2
    board = board_of(["......."] * 4 + ["..O...."] + ["..XX..."])
    values = wording.host_values(board, agent_player=2, opponent_column=4)
    assert resolve(spec.user[0], values) == (
        "You are O.\nOpponent played 4.\n.......\n.......\n.......\n.......\n..O....\n..XX...\n1234567"
    )
    full = board_of(["..X...."] + ["..O...."] * 4 + ["..XX..."])
    assert wording.render_board(full).endswith("\n..XX...\n12-4567")
    np.testing.assert_array_equal(
        np.asarray(wording.message_values(jnp.asarray(full), 1))[wording.V_OPEN0 :], [1, 1, 0, 1, 1, 1, 1]
    )
    texts = [resolve(p, values) for p in spec.tool]
    assert texts[0] == "Opponent played 4.\n" + wording.render_board(board)
    assert texts[1].endswith("\n..XX...\n1234567\nYou won.") and texts[3].endswith("You lost.")
    assert texts[2].endswith("\nDraw.") and texts[4] == "Invalid call. You lost."
    # The jit values vector equals the host one.
    got = np.asarray(wording.message_values(jnp.asarray(board), 2, 4, 0))
    np.testing.assert_array_equal(got, values)


def _piece_tokens(tok, parts, values) -> int:
    """Tokens of a message when every literal piece and slot option is tokenized alone (as the compiler does)."""
    return sum(len(tok.encode(s)) for s in (resolve((p,), values) for p in parts) if s)


def test_token_budget_with_the_shipped_tokenizer():
    from reno_jax.protocol.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    spec = ENV.chat()
    board = board_of(["......."] * 3 + ["...O..."] + ["..XXO.."] + [".OXXOX."])
    values = wording.host_values(board, agent_player=1, opponent_column=5)
    # Every cell is one token on its own.
    for option in wording.CELL_OPTIONS + wording.SIDE_OPTIONS:
        assert len(tok.encode(option)) == 1
    # The chat template's text around a tool message: after the policy's turn-end marker up to the next
    # assistant header. Its literal pieces are tokenized alone too.
    msgs = [*wording.messages(values), wording.assistant_call(4), wording.tool_message(values, 0)]
    text = tok.apply_chat_template(msgs, tools=list(spec.tools), add_generation_prompt=True, tokenize=False)
    content = resolve(spec.tool[0], values)
    before, after = text.rsplit(content, 1)
    wrapper = before.rsplit("<|im_end|>", 1)[1]  # "\n<|im_start|>tool\n"
    response = len(tok.encode(wrapper)) + _piece_tokens(tok, spec.tool[0], values) + len(tok.encode(after))
    assert response <= 70, response
    user = _piece_tokens(tok, spec.user[0], values)
    assert user <= 64, user
    system = len(tok.encode(text.split("<|im_start|>user")[0]))
    assert system <= 160, system


def test_marked_board_prints_each_columns_landing_cell():
    board = board_of(["..X...."] + ["..O...."] + ["..X...."] + ["..OO..."] + ["..XX..."] + [".OXX.O."])
    assert wording.render_board(board, mark_playable=True) == (
        "..X....\n..O....\n..X*...\n..OO...\n.*XX.*.\n*OXX*O*\n12-4567"
    )
    assert wording.render_board(board) == "..X....\n..O....\n..X....\n..OO...\n..XX...\n.OXX.O.\n12-4567"
    for marked in (False, True):  # the jit values vector equals the host one
        np.testing.assert_array_equal(
            np.asarray(wording.message_values(jnp.asarray(board), 2, 4, 0, mark_playable=marked)),
            wording.host_values(board, agent_player=2, opponent_column=4, mark_playable=marked),
        )
    # one "*" per open column, on its lowest empty cell, through a whole random game
    env = c4env.Connect4Env(opponent="random", mark_playable=True)
    state, message = env.reset(jax.tree.map(lambda a: a[0], c4env.sample_starts(jax.random.PRNGKey(3), 1, "random", 1)))
    for k in range(21):
        cells = np.asarray(message.values)[:42].reshape(6, 7)
        b = np.asarray(state.game.board)
        assert ((cells == wording.PLAYABLE).sum(0) == (b[0] == 0)).all()
        heights = (b != 0).sum(0)
        for c in np.flatnonzero(b[0] == 0):
            assert cells[5 - heights[c], c] == wording.PLAYABLE
        legal = np.flatnonzero(b[0] == 0)
        out = env.step(
            state,
            interface.ToolCall(kind=jnp.int32(0), tool=jnp.int32(0), args=jnp.asarray([legal[k % len(legal)] + 1])),
        )
        state, message = out.state, out.message
        if bool(out.done):
            break


def test_echoed_board_prints_its_rows_twice_in_every_board_message():
    from reno_jax.protocol.tokenizer import load_tokenizer

    board = board_of(["......."] * 4 + ["...O..."] + ["..XX..."])
    values = wording.host_values(board, agent_player=1, opponent_column=4, mark_playable=True)
    rows = "".join(row + "\n" for row in wording.render_board(board, mark_playable=True).split("\n")[:-1])
    plain, echoed = c4env.Connect4Env().chat(), c4env.Connect4Env(echo_board=True).chat()
    assert resolve(echoed.tool[0], values) == "Opponent played 4.\n" + rows + rows + "1234567"
    assert resolve(echoed.user[0], values) == "You are X.\nOpponent played 4.\n" + rows + rows + "1234567"
    for template in range(wording.NUM_TOOL_TEMPLATES):  # the board's texts change, nothing else does
        assert resolve(echoed.tool[template], values).replace(rows, "", 1) == resolve(plain.tool[template], values)
        assert wording.tool_text(values, template, echo=True) == resolve(echoed.tool[template], values)
    assert wording.messages(values, echo=True)[1]["content"] == resolve(echoed.user[0], values)
    tok = load_tokenizer(None)
    extra = _piece_tokens(tok, echoed.tool[0], values) - _piece_tokens(tok, plain.tool[0], values)
    assert extra == rules.ROWS * (rules.COLS + 1)  # one token per cell and per line break
