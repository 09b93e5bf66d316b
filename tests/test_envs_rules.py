"""Rules (reno_jax.envs.tictactoe.rules) and the minimax table (reno_jax.envs.tictactoe.minimax)."""

from __future__ import annotations

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# ------------------------------------------------------------------------------------------------
# Plain-Python reference (independent of the code under test: tuples, explicit lines, recursion)
# ------------------------------------------------------------------------------------------------
from ttt_reference import PY_LINES, py_winner  # noqa: E402,F401

from reno_jax.envs.tictactoe import minimax
from reno_jax.envs.tictactoe import rules as ttt


def py_mover(b):
    return 1 if b.count(1) == b.count(2) else 2


def py_terminal(b):
    return py_winner(b) != 0 or 0 not in b


def py_child(b, i, p):
    return b[:i] + (p,) + b[i + 1 :]


@functools.lru_cache(maxsize=None)
def py_value(b):
    """Value for the player to move, by plain recursion over the game tree."""
    mover = py_mover(b)
    w = py_winner(b)
    if w:
        return 1 if w == mover else -1
    if 0 not in b:
        return 0
    return max(-py_value(py_child(b, i, mover)) for i in range(9) if b[i] == 0)


@functools.lru_cache(maxsize=None)
def py_reachable():
    seen, stack = set(), [(0,) * 9]
    while stack:
        b = stack.pop()
        if b in seen:
            continue
        seen.add(b)
        if not py_terminal(b):
            stack.extend(py_child(b, i, py_mover(b)) for i in range(9) if b[i] == 0)
    return sorted(seen)


def code_of(b):
    return sum(v * 3**i for i, v in enumerate(b))


# ------------------------------------------------------------------------------------------------
# Rules
# ------------------------------------------------------------------------------------------------
_jit_step = jax.jit(ttt.step)
_jit_winner = jax.jit(ttt.winner)
_jit_terminal = jax.jit(ttt.is_terminal)


def play(moves):
    state = ttt.reset()
    for m in moves:
        state = _jit_step(state, jnp.int32(m))
    return state


def test_reset_and_legal_moves():
    s = ttt.reset()
    chex.assert_shape(s.board, (9,))
    assert s.board.dtype == jnp.int8 and int(s.to_move) == ttt.X and not bool(s.done)
    assert bool(ttt.legal_moves(s).all())
    s = play([4, 0])
    np.testing.assert_array_equal(np.asarray(ttt.legal_moves(s)), [0, 1, 1, 1, 0, 1, 1, 1, 1])
    assert int(s.to_move) == ttt.X and int(s.turn) == 2 and int(s.last_move) == 0


@pytest.mark.parametrize("line", PY_LINES)
@pytest.mark.parametrize("player", [ttt.X, ttt.O])
def test_every_winning_line_detected_and_ends_game(line, player):
    # Static check: the line alone, and the line with opponent stones on two other squares.
    board = np.zeros(9, np.int8)
    board[list(line)] = player
    assert int(_jit_winner(jnp.asarray(board))) == player
    assert bool(_jit_terminal(jnp.asarray(board)))
    # Dynamic check: play the line for `player` while the other player fills off-line squares that contain no
    # line of their own (X needs 3 filler stones when O is the one completing the line, since X moves first).
    others = [i for i in range(9) if i not in line]
    n_fill = 3 if player == ttt.O else 2
    filler = next(
        list(c) for c in itertools.combinations(others, n_fill) if not any(set(ln) <= set(c) for ln in PY_LINES)
    )
    moves = []
    if player == ttt.O:
        moves.append(filler.pop(0))  # X moves first
    for k in range(3):
        moves.append(line[k])
        if k < 2:
            moves.append(filler.pop(0))
    s = play(moves)
    assert bool(s.done) and int(s.winner) == player and not bool(s.invalid)
    assert not bool(ttt.legal_moves(s).any())
    # No further moves change the finished game.
    s2 = _jit_step(s, jnp.int32(others[-1]))
    chex.assert_trees_all_equal(s, s2)


def test_win_table_matches_lines_for_every_mask():
    want = [any(all(m >> i & 1 for i in line) for line in PY_LINES) for m in range(512)]
    assert ttt.WIN_BY_BITS.tolist() == want
    got = jax.jit(jax.vmap(ttt.has_line))(jnp.arange(512, dtype=jnp.int32))
    assert np.asarray(got).tolist() == want


def test_board_from_bits_inverts_player_bits_on_every_board():
    # All 3**9 cell assignments (legal or not): the board step() rebuilds from the stone masks is the board.
    codes = np.arange(ttt.NUM_CODES)
    boards = jnp.asarray((codes[:, None] // 3 ** np.arange(9)) % 3, jnp.int8)

    def roundtrip(board):
        return ttt.board_from_bits(ttt.player_bits(board, ttt.X), ttt.player_bits(board, ttt.O))

    got = jax.jit(jax.vmap(roundtrip))(boards)
    chex.assert_trees_all_equal(got, boards)
    assert got.dtype == jnp.int8


def test_no_false_wins_on_non_lines():
    # Three stones that are not a line.
    for triple in [(0, 1, 3), (0, 4, 5), (2, 4, 7), (1, 3, 8)]:
        board = np.zeros(9, np.int8)
        board[list(triple)] = ttt.X
        assert int(_jit_winner(jnp.asarray(board))) == 0


def test_draw():
    # X O X / X O O / O X X is a full board with no line.
    board = jnp.asarray([1, 2, 1, 1, 2, 2, 2, 1, 1], jnp.int8)
    assert int(_jit_winner(board)) == 0 and bool(_jit_terminal(board))
    s = play([0, 1, 2, 4, 3, 5, 7, 6, 8])
    np.testing.assert_array_equal(np.asarray(s.board), np.asarray(board))
    assert bool(s.done) and int(s.winner) == 0 and not bool(s.invalid) and int(s.turn) == 9


@pytest.mark.parametrize("action", [4, -1, 9, 100])
def test_illegal_and_out_of_range_actions(action):
    s = play([4])  # X in the centre; O to move
    s2 = _jit_step(s, jnp.int32(action))
    assert bool(s2.done) and bool(s2.invalid) and int(s2.winner) == 0
    assert int(s2.to_move) == ttt.O  # the offender
    np.testing.assert_array_equal(np.asarray(s2.board), np.asarray(s.board))
    assert int(s2.turn) == 1
    # A finished game ignores further actions, legal or not.
    chex.assert_trees_all_equal(_jit_step(s2, jnp.int32(0)), s2)


def test_board_code_and_to_move():
    rng = np.random.default_rng(0)
    boards = rng.integers(0, 3, size=(64, 9)).astype(np.int8)
    codes = jax.jit(jax.vmap(ttt.board_code))(jnp.asarray(boards))
    assert codes.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(codes), [code_of(tuple(b)) for b in boards.tolist()])
    assert int(ttt.board_code(jnp.full((9,), 2, jnp.int8))) == 3**9 - 1
    movers = jax.vmap(ttt.to_move_from_counts)(jnp.asarray(boards))
    expect = [1 if (b == 1).sum() <= (b == 2).sum() else 2 for b in boards]
    np.testing.assert_array_equal(np.asarray(movers), expect)


def test_shape_asserts_reject_bad_boards():
    with pytest.raises(AssertionError):
        ttt.winner(jnp.zeros((3, 3), jnp.int8))
    with pytest.raises(AssertionError):
        ttt.step(ttt.reset(), jnp.zeros((2,), jnp.int32))


def test_vmap_jit_random_games_match_python_reference():
    """Batched random play (with occasional illegal actions) agrees with a plain-Python game loop."""
    batch, steps = 64, 10
    rng = np.random.default_rng(1)
    actions = rng.integers(-1, 10, size=(steps, batch)).astype(np.int32)
    # Mostly legal play: replace actions with a random empty square 85% of the time, decided below on host.
    use_legal = rng.random((steps, batch)) < 0.85
    picks = rng.random((steps, batch, 9))

    @jax.jit
    def run(actions, use_legal, picks):
        def body(state, xs):
            a, legal_flag, u = xs
            legal = jax.vmap(ttt.legal_moves)(state)  # [B, 9]
            chosen = jnp.argmax(jnp.where(legal, u, -1.0), axis=-1).astype(jnp.int32)
            a = jnp.where(legal_flag & legal.any(-1), chosen, a)
            new = jax.vmap(ttt.step)(state, a)
            return new, (a, new)

        init = jax.vmap(lambda _: ttt.reset())(jnp.arange(batch))
        return jax.lax.scan(body, init, (actions, use_legal, picks))

    final, (taken, states) = run(jnp.asarray(actions), jnp.asarray(use_legal), jnp.asarray(picks))
    chex.assert_shape(final.board, (batch, 9))
    chex.assert_shape(states.done, (steps, batch))
    taken = np.asarray(taken)
    states = jax.tree_util.tree_map(np.asarray, states)  # host copies: cheap indexing in the loop below
    for b in range(batch):
        board, mover, done, win, invalid, turn = [0] * 9, 1, False, 0, False, 0
        for t in range(steps):
            a = int(taken[t, b])
            if not done:
                if 0 <= a < 9 and board[a] == 0:
                    board[a] = mover
                    turn += 1
                    win = py_winner(tuple(board))
                    done = win != 0 or 0 not in board
                    mover = 3 - mover
                else:
                    done, invalid = True, True
            assert list(np.asarray(states.board[t, b])) == board
            assert bool(states.done[t, b]) == done and int(states.winner[t, b]) == win
            assert bool(states.invalid[t, b]) == invalid and int(states.turn[t, b]) == turn
            assert int(states.to_move[t, b]) == mover
            # The bitboards stay in sync with the int8 board.
            assert int(states.x_bits[t, b]) == sum(1 << i for i, v in enumerate(board) if v == 1)
            assert int(states.o_bits[t, b]) == sum(1 << i for i, v in enumerate(board) if v == 2)


def test_state_from_board():
    s = ttt.state_from_board(jnp.asarray([1, 1, 1, 2, 2, 0, 0, 0, 0], jnp.int8))
    assert bool(s.done) and int(s.winner) == ttt.X and int(s.to_move) == ttt.O and int(s.turn) == 5


# ------------------------------------------------------------------------------------------------
# Minimax table
# ------------------------------------------------------------------------------------------------


def test_minimax_table_matches_recursive_minimax_on_every_reachable_position():
    tables = minimax.tables_numpy(use_disk_cache=False)
    positions = py_reachable()
    assert len(positions) == 5478  # the well-known count of legal tic-tac-toe positions
    for b in positions:
        c = code_of(b)
        assert int(tables["value"][c]) == py_value(b), b
        mover = py_mover(b)
        if py_terminal(b):
            want_opt = want_win = [False] * 9
        else:
            kids = [py_child(b, i, mover) if b[i] == 0 else None for i in range(9)]
            want_opt = [k is not None and -py_value(k) == py_value(b) for k in kids]
            want_win = [k is not None and py_winner(k) == mover for k in kids]
        assert tables["optimal_mask"][c].tolist() == want_opt, b
        assert tables["winning_mask"][c].tolist() == want_win, b


@functools.lru_cache(maxsize=None)
def py_seek(b, seeking):
    """Expected outcome for the player to move against uniformly random replies: `seeking` picks the best
    value-preserving move, otherwise the mover is the random side."""
    mover = py_mover(b)
    if py_terminal(b):
        return float(py_value(b))
    kids = {i: py_child(b, i, mover) for i in range(9) if b[i] == 0}
    if not seeking:
        return sum(-py_seek(k, True) for k in kids.values()) / len(kids)
    return max(-py_seek(k, False) for k in kids.values() if -py_value(k) == py_value(b))


def test_seeking_mask_matches_recursive_expectation_on_every_reachable_position():
    tables = minimax.tables_numpy(use_disk_cache=False)
    assert not (tables["seeking_mask"] & ~tables["optimal_mask"]).any()
    narrower = 0
    for b in py_reachable():
        c = code_of(b)
        if py_terminal(b):
            assert not tables["seeking_mask"][c].any(), b
            continue
        mover = py_mover(b)
        after = {i: -py_seek(py_child(b, i, mover), False) for i in range(9) if tables["optimal_mask"][c][i]}
        best = max(after.values())
        want = [i in after and after[i] > best - 1e-9 for i in range(9)]
        assert tables["seeking_mask"][c].tolist() == want, b
        narrower += sum(want) < len(after)
    assert narrower > 500  # the tie-break matters in many positions, not in a handful


def _outcome_against_random(tables, agent, policy):
    """Exact (win, draw, loss) of `policy` (a [9] bool mask per board code, uniform among its moves) as `agent`
    against a uniformly random opponent, by enumerating the game tree."""

    @functools.lru_cache(maxsize=None)
    def go(b):
        w = py_winner(b)
        if py_terminal(b):
            return np.array([w == agent, w == 0, w not in (0, agent)], float)
        mover = py_mover(b)
        moves = [i for i in range(9) if b[i] == 0 and (mover != agent or policy[code_of(b)][i])]
        return sum(go(py_child(b, i, mover)) for i in moves) / len(moves)

    return go((0,) * 9)


def test_seeking_play_beats_random_opponents_more_often_and_never_loses():
    tables = minimax.tables_numpy(use_disk_cache=False)
    for agent, ties, seeking in ((1, 0.968, 0.995), (2, 0.777, 0.916)):
        by_ties = _outcome_against_random(tables, agent, tables["optimal_mask"])
        by_seeking = _outcome_against_random(tables, agent, tables["seeking_mask"])
        assert by_ties[0] == pytest.approx(ties, abs=5e-4) and by_ties[2] == 0.0
        assert by_seeking[0] == pytest.approx(seeking, abs=5e-4) and by_seeking[2] == 0.0


def test_minimax_known_facts_and_jit_lookup():
    table = minimax.load_table()
    chex.assert_shape(table.value, (3**9,))
    chex.assert_shape([table.optimal_mask, table.winning_mask], (3**9, 9))
    boards = jnp.asarray(
        [
            [0] * 9,  # empty: draw, every move keeps it
            [0, 0, 0, 0, 1, 0, 0, 0, 0],  # X centre: O must take a corner
            [1, 0, 0, 0, 0, 0, 0, 0, 0],  # X corner: O must take the centre
            [1, 1, 0, 2, 2, 0, 0, 0, 0],  # X to move wins at 3
        ],
        jnp.int8,
    )
    value, opt, win = jax.jit(
        jax.vmap(
            lambda b, t: (minimax.position_value(t, b), minimax.optimal_moves(t, b), minimax.winning_moves(t, b)),
            in_axes=(0, None),
        )
    )(boards, table)
    np.testing.assert_array_equal(np.asarray(value), [0, 0, 0, 1])
    assert np.asarray(opt[0]).all()
    np.testing.assert_array_equal(np.asarray(opt[1]), [1, 0, 1, 0, 0, 0, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(opt[2]), [0, 0, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(win[3]), [0, 0, 1, 0, 0, 0, 0, 0, 0])
    assert not np.asarray(win[:3]).any()
    seek = jax.jit(jax.vmap(minimax.seeking_moves, in_axes=(None, 0)))(table, boards)
    np.testing.assert_array_equal(np.asarray(seek[0]), [1, 0, 1, 0, 0, 0, 1, 0, 1])  # X opens in a corner
    np.testing.assert_array_equal(np.asarray(seek[1]), np.asarray(opt[1]))
    np.testing.assert_array_equal(np.asarray(seek[3]), np.asarray(win[3]))


def test_minimax_disk_cache_roundtrip_and_corruption(tmp_path):
    arrays = minimax.compute_tables_numpy()
    path = tmp_path / "t.npz"
    minimax._save_cache(path, arrays)
    loaded = minimax._load_cache(path)
    assert loaded is not None
    for k in arrays:
        np.testing.assert_array_equal(loaded[k], arrays[k])
    path.write_bytes(b"not an npz")
    assert minimax._load_cache(path) is None
    np.savez(path, value=np.zeros(5, np.int8))  # wrong keys / shapes
    assert minimax._load_cache(path) is None
