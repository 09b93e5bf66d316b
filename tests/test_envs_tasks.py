"""Move/game tasks (reno_jax.envs.tictactoe.tasks) and board datasets (reno_jax.envs.tictactoe.boards)."""

from __future__ import annotations

import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# ------------------------------------------------------------------------------------------------
# Independent plain-Python reference of AReno's game.score_move (X to move, value-preserving = best)
# ------------------------------------------------------------------------------------------------
from ttt_reference import PY_LINES, py_winner  # noqa: E402,F401

from reno_jax.envs.tictactoe import boards as B
from reno_jax.envs.tictactoe import minimax
from reno_jax.envs.tictactoe import rules as ttt
from reno_jax.envs.tictactoe import tasks as T


@functools.lru_cache(maxsize=None)
def py_x_value(b):
    """Minimax value from X's point of view (AReno's _minimax), X to move when counts are equal."""
    w = py_winner(b)
    if w:
        return 1 if w == 1 else -1
    if 0 not in b:
        return 0
    p = 1 if b.count(1) == b.count(2) else 2
    vals = [py_x_value(b[:i] + (p,) + b[i + 1 :]) for i in range(9) if b[i] == 0]
    return max(vals) if p == 1 else min(vals)


def py_score_move(b, square):
    if square is None or not 1 <= square <= 9 or b[square - 1] != 0:
        return -1.0
    nxt = b[: square - 1] + (1,) + b[square:]
    if py_winner(nxt) == 1:
        return 1.0
    best = max(py_x_value(b[:i] + (1,) + b[i + 1 :]) for i in range(9) if b[i] == 0)
    return 0.8 if py_x_value(nxt) == best else 0.0


def KEY(seed):
    # "rbg" keys: XLA's RngBitGenerator compiles ~10x faster than threefry on CPU, which keeps this file quick.
    # The functions under test take any key type.
    return jax.random.key(seed, impl="rbg")


@pytest.fixture(scope="module")
def table():
    return minimax.load_table(use_disk_cache=False)


_move_reward = jax.jit(T.move_reward)
_move_reward_batch = jax.jit(T.move_reward_batch)


def board(s):
    return jnp.asarray(B.parse_board(s))


# ------------------------------------------------------------------------------------------------
# Move task
# ------------------------------------------------------------------------------------------------


def test_move_reward_table_hand_picked(table):
    # X X . / O . . / O . .  : square 3 wins; 1, 2, 4, 7 occupied.
    b = board("XX.O..O..")
    expect = {1: -1.0, 2: -1.0, 3: 1.0, 4: -1.0, 7: -1.0}
    for sq, want in expect.items():
        r, info = _move_reward(b, T.PARSE_OK, sq, table)
        assert float(r) == pytest.approx(want), sq
    r, info = _move_reward(b, T.PARSE_OK, 3, table)
    assert bool(info["is_win_taken"]) and bool(info["is_optimal"]) and bool(info["win_available"])
    r, info = _move_reward(b, T.PARSE_OK, 1, table)
    assert bool(info["is_illegal"]) and bool(info["is_valid_call"]) and not bool(info["is_legal"])

    # X . . / O O . / X . .  : O threatens square 6; blocking is the only non-losing move.
    b = board("X..OO.X..")
    for sq in (2, 3, 8, 9):
        r, info = _move_reward(b, T.PARSE_OK, sq, table)
        assert float(r) == 0.0 and bool(info["is_legal"]) and not bool(info["is_optimal"]), sq
        assert bool(info["block_needed"]) and not bool(info["is_block"])
    r, info = _move_reward(b, T.PARSE_OK, 6, table)
    assert float(r) == pytest.approx(0.8)
    assert bool(info["is_optimal"]) and not bool(info["is_win_taken"]) and bool(info["is_block"])
    assert int(info["position_value"]) == 0

    # Empty board: every square keeps the draw -> 0.8 everywhere.
    for sq in range(1, 10):
        assert float(_move_reward(board("........."), T.PARSE_OK, sq, table)[0]) == pytest.approx(0.8)


def test_move_reward_win_seeking(table):
    """`win_seeking`: the value-preserving moves that are not the table's seeking moves earn half the optimal
    reward; wins, mistakes and bad calls are graded as before, and `is_optimal` stays minimax."""
    seek_reward = jax.jit(functools.partial(T.move_reward, win_seeking=True))
    b = board(".........")  # every square draws; only the corners give a random opponent the most chances
    for sq in range(1, 10):
        corner = sq in (1, 3, 7, 9)
        r, info = seek_reward(b, T.PARSE_OK, sq, table)
        assert float(r) == pytest.approx(T.REWARD_OPTIMAL if corner else T.REWARD_KEEPS_VALUE), sq
        assert bool(info["is_optimal"]) and bool(info["is_seeking"]) == corner
    b = board("XX.O..O..")
    assert float(seek_reward(b, T.PARSE_OK, 3, table)[0]) == T.REWARD_WIN
    assert float(seek_reward(board("X..OO.X.."), T.PARSE_OK, 2, table)[0]) == T.REWARD_LEGAL  # 6 must block
    assert float(seek_reward(b, T.PARSE_OK, 1, table)[0]) == T.REWARD_INVALID
    assert float(seek_reward(b, T.PARSE_BAD_CALL, 0, table)[0]) == T.REWARD_INVALID


@pytest.mark.parametrize(
    "kind,square,flag",
    [
        (T.PARSE_NO_CALL, 0, "is_no_call"),
        (T.PARSE_BAD_CALL, 0, "is_bad_call"),
        (T.PARSE_OUT_OF_RANGE, 0, "is_out_of_range"),
        (T.PARSE_NO_CALL, 3, "is_no_call"),  # a stray square is ignored when the call failed
        (T.PARSE_OK, 0, "is_out_of_range"),
        (T.PARSE_OK, 10, "is_out_of_range"),
        (T.PARSE_OK, -3, "is_out_of_range"),
    ],
)
def test_move_reward_bad_calls(table, kind, square, flag):
    r, info = _move_reward(board("XX.O..O.."), kind, square, table)
    assert float(r) == -1.0
    assert bool(info[flag]) and not bool(info["is_valid_call"]) and not bool(info["is_legal"])
    assert not bool(info["is_illegal"])  # "illegal" is reserved for well-formed calls on occupied squares


def test_move_reward_matches_areno_reference_on_all_positions(table):
    """Every X-to-move position x every square (plus parse failures) against the Python reference."""
    positions = B.exhaustive_x_to_move()
    n = positions.shape[0]
    squares = np.arange(0, 11, dtype=np.int32)  # 0 and 10 are out of range
    bb = np.repeat(positions, squares.size, axis=0)
    sq = np.tile(squares, n)
    kinds = np.zeros_like(sq)
    rewards, info = _move_reward_batch(jnp.asarray(bb), jnp.asarray(kinds), jnp.asarray(sq), table)
    chex.assert_shape(rewards, (bb.shape[0],))
    rewards = np.asarray(rewards)
    for i in range(bb.shape[0]):
        want = py_score_move(tuple(int(v) for v in bb[i]), int(sq[i]))
        assert rewards[i] == pytest.approx(want), (bb[i], sq[i])
    # Info flags are consistent with the reward table.
    opt, win, legal = (np.asarray(info[k]) for k in ("is_optimal", "is_win_taken", "is_legal"))
    assert ((rewards == 1.0) == win).all()
    assert ((rewards >= 0.8) == opt).all()
    assert ((rewards >= 0.0) == legal).all()


# ------------------------------------------------------------------------------------------------
# Opponents
# ------------------------------------------------------------------------------------------------


_opponent_move_batch = jax.jit(T.opponent_move_batch)


def _sample_opponent(table, b, kind, eps, n=2048, seed=0):
    keys = jax.random.split(KEY(seed), n)
    bb = jnp.broadcast_to(b, (n, 9))
    kinds = jnp.full((n,), kind, jnp.int32)
    epss = jnp.full((n,), eps, jnp.float32)
    out = _opponent_move_batch(keys, bb, kinds, epss, table)
    chex.assert_shape(out, (n,))
    return np.asarray(out)


def test_opponents(table):
    b = board("X..OO.X..")  # X to move; O threatens 6, only 6 is optimal for X
    legal = {1, 2, 5, 7, 8}  # array indices of empty squares
    rnd = _sample_opponent(table, b, T.OPPONENT_RANDOM, 0.0)
    assert set(rnd.tolist()) == legal
    mm = _sample_opponent(table, b, T.OPPONENT_MINIMAX, 1.0)  # epsilon is ignored by minimax
    assert set(mm.tolist()) == {5}
    assert set(_sample_opponent(table, b, T.OPPONENT_EPSILON, 0.0).tolist()) == {5}
    eps = _sample_opponent(table, b, T.OPPONENT_EPSILON, 0.5)
    assert set(eps.tolist()) == legal
    # P(6) = 0.5 + 0.5/5 = 0.6; a very loose bound keeps this deterministic-seed test robust.
    assert 0.53 < (eps == 5).mean() < 0.67
    # Ties among optimal moves are broken uniformly: on the empty board all 9 squares are optimal.
    empty = _sample_opponent(table, jnp.zeros(9, jnp.int8), T.OPPONENT_MINIMAX, 0.0)
    counts = np.bincount(empty, minlength=9)
    assert counts.min() > 170 and counts.max() < 290  # expected 227.6 each (sd ~14)
    # No legal move: -1.
    full = board("XOXXOOOXX")
    assert set(_sample_opponent(table, full, T.OPPONENT_RANDOM, 0.0).tolist()) == {-1}
    assert T.opponent_kind_id("epsilon") == T.OPPONENT_EPSILON
    with pytest.raises(ValueError, match="unknown opponent"):
        T.opponent_kind_id("alphazero")


# ------------------------------------------------------------------------------------------------
# Game task
# ------------------------------------------------------------------------------------------------
_game_step = jax.jit(T.game_step)
_game_reset = jax.jit(T.game_reset)


def _state(b, agent=ttt.X, kind=T.OPPONENT_MINIMAX, eps=0.0):
    s = _game_reset(KEY(0), jnp.int8(ttt.X), kind, eps, minimax.load_table(use_disk_cache=False))
    return s.replace(board=board(b), agent_player=jnp.int8(agent))


def _flags(info):
    return {k: bool(info[k]) for k in ("win", "draw", "loss", "invalid", "illegal")}


def test_game_reset(table):
    key = KEY(3)
    s = _game_reset(key, ttt.X, T.OPPONENT_RANDOM, 0.0, table)
    assert not np.asarray(s.board).any() and int(s.opponent_square) == 0 and not bool(s.done)
    s = _game_reset(key, ttt.O, T.OPPONENT_RANDOM, 0.0, table)
    bd = np.asarray(s.board)
    assert (bd == ttt.X).sum() == 1 and (bd == ttt.O).sum() == 0
    assert bd[int(s.opponent_square) - 1] == ttt.X and int(s.agent_player) == ttt.O


def test_game_step_outcomes(table):
    key = KEY(0)
    # Win: agent X completes the top row.
    s, r, d, info = _game_step(key, _state("XX.OO...."), T.PARSE_OK, 3, table)
    assert (
        float(r) == 1.0
        and bool(d)
        and _flags(info) == dict(win=True, draw=False, loss=False, invalid=False, illegal=False)
    )
    assert int(info["opponent_square"]) == 0 and int(s.outcome) == T.OUTCOME_WIN and int(info["turns"]) == 1
    assert bool(info["agent_move_winning"]) and int(info["agent_square"]) == 3
    # Loss: agent X ignores O's threat on 6; the minimax opponent takes it.
    s, r, d, info = _game_step(key, _state("X..OO.X.."), T.PARSE_OK, 2, table)
    assert float(r) == -1.0 and bool(d) and _flags(info)["loss"] and int(info["opponent_square"]) == 6
    assert int(s.board[5]) == ttt.O and not bool(info["agent_move_optimal"])
    # Draw on the agent's own move (last empty square, no line).
    s, r, d, info = _game_step(key, _state("XOXXOOOX."), T.PARSE_OK, 9, table)
    assert float(r) == 0.0 and bool(d) and _flags(info)["draw"] and int(info["opponent_square"]) == 0
    # Draw after the opponent's forced reply (only possible when the agent is O): O takes 7, X fills 9.
    s, r, d, info = _game_step(key, _state("XOXXOO.X.", agent=ttt.O), T.PARSE_OK, 7, table)
    assert bool(d) and _flags(info)["draw"] and int(info["opponent_square"]) == 9 and float(r) == 0.0
    # Invalid call and occupied square both end the game with -1 and are counted separately.
    for kind, sq, flag in [(T.PARSE_BAD_CALL, 0, "invalid"), (T.PARSE_OK, 12, "invalid"), (T.PARSE_OK, 1, "illegal")]:
        s0 = _state("X...O....")
        s, r, d, info = _game_step(key, s0, kind, sq, table)
        assert float(r) == -1.0 and bool(d) and sum(_flags(info).values()) == 1 and _flags(info)[flag]
        np.testing.assert_array_equal(np.asarray(s.board), np.asarray(s0.board))
    # Ongoing: one agent move and one opponent reply.
    s, r, d, info = _game_step(key, _state("........."), T.PARSE_OK, 5, table)
    assert float(r) == 0.0 and not bool(d) and not any(_flags(info).values())
    assert (np.asarray(s.board) == ttt.O).sum() == 1 and int(info["opponent_square"]) in (1, 3, 7, 9)
    # A finished episode ignores further steps.
    done_state, *_ = _game_step(key, _state("XX.OO...."), T.PARSE_OK, 3, table)
    s, r, d, info = _game_step(key, done_state, T.PARSE_OK, 6, table)
    chex.assert_trees_all_equal(s, done_state)
    assert float(r) == 0.0 and bool(d) and not bool(info["active"]) and not any(_flags(info).values())


def test_batched_games_against_minimax(table):
    """vmap + scan full games: a random agent never beats minimax; a minimax agent always draws with it."""
    n = 256

    # Everything is traced (one compile); the table is an argument, not a closure constant, because XLA
    # constant-folding a 19683x9 table is slow.
    @jax.jit
    def run(key, table, agent_player, agent_kind):
        k_reset, k_play = jax.random.split(key)
        state = T.game_reset_batch(
            jax.random.split(k_reset, n),
            jnp.full((n,), agent_player, jnp.int8),
            jnp.full((n,), T.OPPONENT_MINIMAX, jnp.int32),
            jnp.zeros((n,), jnp.float32),
            table,
        )

        def body(state, key):
            ka, ko = jax.random.split(key)
            sq = T.opponent_move_batch(
                jax.random.split(ka, n), state.board, jnp.full((n,), agent_kind), jnp.zeros((n,)), table
            )
            state, reward, done, info = T.game_step_batch(
                jax.random.split(ko, n), state, jnp.zeros((n,), jnp.int32), sq + 1, table
            )
            return state, (reward, info)

        return jax.lax.scan(body, state, jax.random.split(k_play, 5))

    for agent_player in (ttt.X, ttt.O):
        for agent_kind in (T.OPPONENT_RANDOM, T.OPPONENT_MINIMAX):
            key = KEY(10 * agent_player + agent_kind)
            final, (rewards, info) = run(key, table, jnp.int8(agent_player), jnp.int32(agent_kind))
            chex.assert_shape(rewards, (5, n))
            assert bool(final.done.all())
            total = np.asarray(rewards).sum(0)
            win, draw, loss = (np.asarray(info[k]).sum(0) for k in ("win", "draw", "loss"))
            assert (win + draw + loss == 1).all()  # exactly one outcome per episode
            assert not np.asarray(info["invalid"]).any() and not np.asarray(info["illegal"]).any()
            np.testing.assert_array_equal(total, win - loss)
            assert win.sum() == 0
            if agent_kind == T.OPPONENT_MINIMAX:
                assert draw.sum() == n
            else:
                assert loss.sum() > n // 4
            assert int(np.asarray(final.turns).max()) <= (5 if agent_player == ttt.X else 4)


# ------------------------------------------------------------------------------------------------
# Board datasets
# ------------------------------------------------------------------------------------------------


def _check_dataset(bs, max_per_player=3):
    assert bs.dtype == np.int8 and bs.shape[1] == 9
    assert len({b.tobytes() for b in bs}) == len(bs)
    for b in bs:
        assert (b == 1).sum() == (b == 2).sum() <= max_per_player
        assert py_winner(tuple(int(v) for v in b)) == 0 and (b == 0).any()


def test_generate_boards_properties_and_seeds():
    a = B.generate_boards(n=300, seed=7)
    _check_dataset(a)
    np.testing.assert_array_equal(a, B.generate_boards(n=300, seed=7))
    assert not np.array_equal(a, B.generate_boards(n=300, seed=8))
    full = B.generate_boards()  # AReno's default size 2048 (out of 2201 distinct positions with <= 6 stones)
    assert full.shape == (2048, 9)
    _check_dataset(full)
    with pytest.raises(ValueError, match="distinct"):
        B.generate_boards(n=100, max_random_moves=1)  # only the empty board and 72 two-stone positions exist


def test_play_boards_follow_the_games(table):
    tables = minimax.tables_numpy()
    a = B.play_boards(600, seed=3, hero_epsilon=0.1, opponent_epsilon=0.5, o_share=0.75)
    assert a.shape == (600, 9) and a.dtype == np.int8
    np.testing.assert_array_equal(a, B.play_boards(600, seed=3, hero_epsilon=0.1, opponent_epsilon=0.5, o_share=0.75))
    assert not np.array_equal(a, B.play_boards(600, seed=4, hero_epsilon=0.1, opponent_epsilon=0.5, o_share=0.75))
    codes = B.board_code_np(a)
    n_x, n_o = (a == ttt.X).sum(1), (a == ttt.O).sum(1)
    assert np.all((n_x == n_o) | (n_x == n_o + 1))
    assert not any(B.np_is_terminal(b) for b in a)
    legal = a == 0
    assert np.all((legal & ~tables["optimal_mask"][codes]).any(1))  # every board has a wrong answer
    assert len(np.unique(codes)) < len(codes)  # repeats kept: frequent positions weigh more
    # Sides follow o_share; a hero that never explores against perfect play only meets drawn positions, and against
    # a random opponent never a lost one.
    for share, mover in ((0.0, ttt.X), (1.0, ttt.O)):
        b = B.play_boards(200, seed=0, o_share=share)
        assert all(B.np_to_move(x) == mover for x in b)
    perfect = B.play_boards(300, seed=1, hero_epsilon=0.0, opponent_epsilon=0.0)
    assert np.all(tables["value"][B.board_code_np(perfect)] == 0)
    lucky = B.play_boards(300, seed=1, hero_epsilon=0.0, opponent_epsilon=1.0)
    assert np.all(tables["value"][B.board_code_np(lucky)] >= 0)
    assert np.any(tables["value"][B.board_code_np(lucky)] == 1)
    for kwargs, match in (
        (dict(n=0), "positive"),
        (dict(n=5, hero_epsilon=1.5), "hero_epsilon"),
        (dict(n=5, o_share=-0.1), "o_share"),
    ):
        with pytest.raises(ValueError, match=match):
            B.play_boards(seed=0, **kwargs)


def test_load_boards_from_play():
    from configs import tictactoe_tiny_game
    from reno_jax import errors
    from reno_jax.loop import config as loop_config

    c = tictactoe_tiny_game.get_config()
    c.env.task, c.env.num_boards, c.env.board_source, c.env.play_epsilon = "move", 64, "play", 0.2
    train, heldout = B.load_boards(c.env)
    np.testing.assert_array_equal(
        train, B.play_boards(64, c.env.board_seed, 0.2, c.env.opponent_epsilon, c.env.o_share)
    )
    assert heldout.shape == (0, 9)
    c.env.board_source = "games"
    with pytest.raises(errors.ConfigError, match="board_source"):
        loop_config.validate_config(c)


def test_exhaustive_positions():
    ex = B.exhaustive_x_to_move()
    # Independent count by recursion over the game tree.
    seen = set()

    def walk(b):
        if b in seen:
            return
        seen.add(b)
        if py_winner(b) or 0 not in b:
            return
        p = 1 if b.count(1) == b.count(2) else 2
        for i in range(9):
            if b[i] == 0:
                walk(b[:i] + (p,) + b[i + 1 :])

    walk((0,) * 9)
    want = {b for b in seen if b.count(1) == b.count(2) and not py_winner(b) and 0 in b}
    assert {tuple(int(v) for v in b) for b in ex} == want
    assert ex.shape == (len(want), 9)
    _check_dataset(ex, max_per_player=4)
    gen = B.generate_boards(n=200, seed=1)
    assert {b.tobytes() for b in gen} <= {b.tobytes() for b in ex}
    # O to move (one X more than O) and both sides: the same walk's other positions.
    live = {b for b in seen if not py_winner(b) and 0 in b}
    o_want = {b for b in live if b.count(1) == b.count(2) + 1}
    assert {tuple(int(v) for v in b) for b in B.exhaustive_positions("o")} == o_want
    both = B.exhaustive_positions("both")
    assert {tuple(int(v) for v in b) for b in both} == want | o_want and len(both) == len(want) + len(o_want)
    assert np.array_equal(B.exhaustive_positions("x"), ex)
    gen = B.generate_boards(n=500, seed=2, max_random_moves=8, sides="both")
    assert {b.tobytes() for b in gen} <= {b.tobytes() for b in both}
    with pytest.raises(ValueError, match="side"):
        B.exhaustive_positions("z")
    with pytest.raises(ValueError, match="sides"):
        B.generate_boards(n=5, sides="o")


def test_train_heldout_split():
    bs = B.generate_boards(n=100, seed=3)
    train, held = B.train_heldout_split(bs, 0.2, seed=0)
    assert train.shape == (80, 9) and held.shape == (20, 9)
    assert {b.tobytes() for b in train} | {b.tobytes() for b in held} == {b.tobytes() for b in bs}
    assert not {b.tobytes() for b in train} & {b.tobytes() for b in held}
    t2, h2 = B.train_heldout_split(bs, 0.2, seed=0)
    np.testing.assert_array_equal(held, h2)
    _, h3 = B.train_heldout_split(bs, 0.2, seed=1)
    assert not np.array_equal(held, h3)
    lt, lh = B.train_heldout_split(list(range(10)), 0.3, seed=0)
    assert isinstance(lt, list) and len(lh) == 3 and sorted(lt + lh) == list(range(10))
    with pytest.raises(ValueError):
        B.train_heldout_split(bs, 1.5, seed=0)


def test_jsonl_roundtrip_and_tolerant_loader(tmp_path):
    bs = B.generate_boards(n=50, seed=5)
    for fmt in ("string", "rows"):
        p = tmp_path / f"{fmt}.jsonl"
        B.save_jsonl(p, bs, board_format=fmt)
        first = json.loads(p.read_text().splitlines()[0])
        assert first["id"] == "board-00000"
        assert isinstance(first["board"], str if fmt == "string" else list)
        loaded, ids = B.load_jsonl(p)
        np.testing.assert_array_equal(loaded, bs)
        assert ids[3] == "board-00003"

    # AReno's record form and other spellings of the same position X . O / . X . / O . .
    want = [1, 0, 2, 0, 1, 0, 2, 0, 0]
    spellings = [
        [["X", ".", "O"], [".", "X", "."], ["O", ".", "."]],
        ["X.O", ".X.", "O.."],
        "X.O.X.O..",
        "x-o-x-o--",
        "X 2 O\n4 X 6\nO 8 9",
        "X | 2 | O\n---+---+---\n4 | X | 6\n---+---+---\nO | 8 | 9",
        ["X", "", "O", "", "X", "", "O", "", ""],
        want,
        np.array(want),
    ]
    for sp in spellings:
        assert B.parse_board(sp).tolist() == want, sp
    p = tmp_path / "areno.jsonl"
    p.write_text(
        json.dumps({"id": "generated-00000", "board": spellings[0]}) + "\n\n" + json.dumps({"board": "X.O.X.O.."})
    )
    # Neither is X to move (2 X, 2 O is fine; this one is) -> loads; ids default to the line number.
    loaded, ids = B.load_jsonl(p)
    assert loaded.tolist() == [want, want] and ids == ["generated-00000", "line-3"]

    for bad, msg in [
        ("X.O.X.O.", "9 cells"),
        ("X.O.X.Z..", "bad cell"),
        ("X.O.X.O.7", "bad cell"),  # a digit must be that square's own label (9 here)
        ([0, 1, 3, 0, 0, 0, 0, 0, 0], "0 \\(empty\\), 1 \\(X\\) or 2 \\(O\\)"),
        (["X.O", ".X", "O.."], "3 cells"),
        (42, "cannot read"),
    ]:
        with pytest.raises(ValueError, match=msg):
            B.parse_board(bad)
    p.write_text(json.dumps({"id": "o-to-move", "board": "X........"}) + "\n")
    with pytest.raises(ValueError, match=r"areno.jsonl:1: .*not a non-terminal X-to-move"):
        B.load_jsonl(p)
    assert B.load_jsonl(p, require_x_to_move=False)[0].tolist() == [[1, 0, 0, 0, 0, 0, 0, 0, 0]]
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        B.load_jsonl(p)


def test_agent_players_spread_the_o_groups():
    from reno_jax.envs.tictactoe import env as ttt_env

    assert ttt_env.agent_players("alternate", 6).tolist() == [1, 2, 1, 2, 1, 2]  # X first, as always
    assert ttt_env.agent_players("alternate", 8, 0.75).tolist() == [1, 2, 2, 2, 1, 2, 2, 2]
    assert ttt_env.agent_players("alternate", 4, 0.0).tolist() == [1, 1, 1, 1]
    assert ttt_env.agent_players("alternate", 4, 1.0).tolist() == [2, 2, 2, 2]
    for share in (0.1, 0.3, 0.5, 0.75, 0.9):
        assert abs(int((ttt_env.agent_players("alternate", 64, share) == 2).sum()) - 64 * share) <= 1
    assert ttt_env.agent_players("o", 3) == 2 and ttt_env.agent_players("x", 3) == 1
    with pytest.raises(ValueError, match="o_share"):
        ttt_env.agent_players("alternate", 4, 1.5)


def test_game_sampler_uses_o_share():
    from configs import tictactoe_tiny_game
    from reno_jax.envs.tictactoe import registration

    c = tictactoe_tiny_game.get_config()
    c.env.agent_player, c.env.o_share = "alternate", 0.75
    starts = registration.make_sampler(c)(jax.random.PRNGKey(0), 8)
    assert np.asarray(starts.agent_player).tolist() == [1, 2, 2, 2, 1, 2, 2, 2]


def _tool_call(square, kind=0):
    from reno_jax.envs import interface

    return interface.ToolCall(kind=jnp.int32(kind), tool=jnp.int32(0), args=jnp.array([square], jnp.int32))


def _play_game(step, state, choose):
    """Play `choose(board, turn) -> square index` until the game ends; returns (total reward, moves, final state)."""
    total, moves = 0.0, 0
    while True:
        idx = choose(np.asarray(state.game.board), moves)
        moves += 1
        out = step(state, _tool_call(idx + 1))
        total += float(out.reward)
        state = out.state
        if bool(out.done):
            return total, moves, state


@pytest.mark.parametrize("penalty", [0.0, 0.6])
def test_game_suboptimal_penalty(table, penalty):
    """The last step's reward loses `penalty` times the share of the agent's moves that gave up minimax value; an
    invalid call counts as such a move; steps after the end add nothing."""
    from reno_jax.envs.tictactoe import env as ttt_env

    env = ttt_env.TicTacToeEnv.create(task="game", table=table, suboptimal_penalty=penalty)
    starts = ttt_env.game_starts(jax.random.PRNGKey(3), 1, agent_player=1, opponent="minimax")
    step = jax.jit(env.step)
    counts = dict(optimal=0, mistakes=0)

    def choose(board, turn):
        legal = np.flatnonzero(board == 0)
        best = np.asarray(minimax.optimal_moves(table, jnp.asarray(board)))
        bad = [i for i in legal if not best[i]]
        idx = bad[0] if bad and not counts["mistakes"] else int(np.flatnonzero(best & (board == 0))[0])  # one mistake
        counts["mistakes"] += int(bool(bad) and not counts["mistakes"])
        counts["optimal"] += int(best[idx])
        return idx

    state, _ = env.reset(jax.tree.map(lambda a: a[0], starts))
    total, moves, state = _play_game(step, state, choose)
    assert counts["optimal"] == moves - 1  # the mistake was a mistake
    outcome = {T.OUTCOME_WIN: 1.0, T.OUTCOME_DRAW: 0.0, T.OUTCOME_LOSS: -1.0}[int(state.game.outcome)]
    np.testing.assert_allclose(total, outcome - penalty / moves, rtol=1e-6)
    np.testing.assert_allclose(float(step(state, _tool_call(1)).reward), 0.0)  # a finished game adds nothing

    state, _ = env.reset(jax.tree.map(lambda a: a[0], starts))
    out = step(state, _tool_call(0, kind=T.PARSE_BAD_CALL))
    assert bool(out.done)
    np.testing.assert_allclose(float(out.reward), -1.0 - penalty)
    with pytest.raises(ValueError, match="suboptimal_penalty"):
        ttt_env.TicTacToeEnv.create(task="game", table=table, suboptimal_penalty=-0.1)


def test_game_penalty_with_win_seeking_counts_non_seeking_moves(table):
    """With `win_seeking` a value-preserving move that is not a seeking move costs its share of the penalty; the
    reward of the same game without `win_seeking` does not see it."""
    from reno_jax.envs.tictactoe import env as ttt_env

    starts = ttt_env.game_starts(jax.random.PRNGKey(3), 1, agent_player=1, opponent="minimax")
    start = jax.tree.map(lambda a: a[0], starts)
    non_seeking = [0]

    def choose(board, turn):
        seek = np.asarray(minimax.seeking_moves(table, jnp.asarray(board)))
        opt = np.asarray(minimax.optimal_moves(table, jnp.asarray(board)))
        # The first move is the centre (draws, not a seeking move), then seeking moves only.
        idx = 4 if turn == 0 else int(np.flatnonzero(seek)[0])
        assert opt[idx]
        non_seeking[0] += int(not seek[idx])
        return idx

    totals = {}
    for win_seeking in (False, True):
        env = ttt_env.TicTacToeEnv.create(task="game", table=table, suboptimal_penalty=1.0, win_seeking=win_seeking)
        state, _ = env.reset(start)
        non_seeking[0] = 0
        total, moves, state = _play_game(jax.jit(env.step), state, choose)
        assert non_seeking[0] == 1 and int(state.num_optimal) == moves
        assert int(state.num_seeking) == moves - 1
        totals[win_seeking] = (total, moves)
    assert totals[False][0] == pytest.approx(0.0)  # a draw against minimax, no value given up
    assert totals[True][0] == pytest.approx(-1.0 / totals[True][1], rel=1e-6)


def test_independent_opponents_split_the_later_replies(table):
    """`independent_opponents`: a group's episodes keep the opening (one prompt per group) but draw their own later
    replies; off, every member is the group's start."""
    from reno_jax.envs import interface
    from reno_jax.envs.tictactoe import env as ttt_env

    starts = ttt_env.game_starts(jax.random.PRNGKey(5), 1, agent_player=2, opponent="random")
    start = jax.tree.map(lambda a: a[0], starts)
    members = jnp.arange(16, dtype=jnp.int32)
    replies = {}
    for independent in (False, True):
        env = ttt_env.TicTacToeEnv.create(task="game", table=table, independent_opponents=independent)
        state, _ = env.reset(start)
        states = jax.vmap(env.for_member, in_axes=(None, 0))(state, members)
        np.testing.assert_array_equal(np.asarray(states.game.board), np.tile(np.asarray(state.game.board), (16, 1)))
        np.testing.assert_array_equal(np.asarray(states.opponent_key[0]), np.asarray(state.opponent_key))
        square = int(np.flatnonzero(np.asarray(state.game.board) == 0)[0]) + 1  # the same first move everywhere
        call = interface.ToolCall(kind=jnp.int32(0), tool=jnp.int32(0), args=jnp.array([square], jnp.int32))
        out = jax.vmap(env.step, in_axes=(0, None))(states, call)
        replies[independent] = np.asarray(out.state.game.opponent_square)
    assert len(set(replies[False].tolist())) == 1
    assert len(set(replies[True].tolist())) >= 3  # 7 empty squares, 16 uniform draws
