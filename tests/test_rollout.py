"""Tests for the jitted multi-turn rollout (reno_jax.rollout.rollout / generate).

One tiny 2-layer Ling-3.0 (KDA + MLA/MoE, vocabulary of the shipped tokenizer) and ONE compiled game-task rollout
(B = 2 groups x 2, 4 turns of at most 10 tokens) serve every game test: the scenario is built in a few passes of the
same compiled function, teacher-forcing valid tool calls (chosen on the host from the boards the previous pass
reached) so that a random model still plays several turns.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.envs.tictactoe import env as E
from reno_jax.envs.tictactoe import rules as ttt
from reno_jax.envs.tictactoe import tasks
from reno_jax.envs.tictactoe import wording as text
from reno_jax.models import ling3
from reno_jax.protocol.tokenizer import load_tokenizer
from reno_jax.rollout import generate as gen
from reno_jax.rollout import rollout as R

MC = ling3.tiny_test_config(vocab_size=512, num_hidden_layers=2)  # layers: KDA (dense MLP), MLA (MoE)
M = 10  # max_new_tokens; a forced call is 7 tokens with the shipped tokenizer
RC = R.RolloutConfig(group_size=2, max_new_tokens=M, max_turns=4, max_length=161, prefill_chunk=16)
B = 4
TRACES = []
# XLA's backend optimisations dominate compile time of these tiny programs on CPU; they do not change semantics.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _numpy_params(config, seed=0):
    """Random parameters built with NumPy (many tiny eager jax.random calls are slow on a busy CPU)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for path, (shape, kind) in ling3.param_shapes(config).items():
        if kind == "ones":
            x = np.ones(shape)
        elif kind == "zeros32":
            x = np.zeros(shape)
        elif kind == "conv":
            x = rng.uniform(-0.5, 0.5, shape)
        elif kind == "A_log":
            x = np.log(rng.uniform(1.0, 16.0, shape))
        elif kind == "dt_bias":
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
            x = dt + np.log(-np.expm1(-dt))
        else:
            x = rng.normal(0.0, 0.02, shape)
        flat[path] = jnp.asarray(x, jnp.float32)
    return ling3._unflatten(flat)


def _counted_rollout(params, keys, starts, env, forced):
    TRACES.append(1)  # Python side effect: runs once per trace
    return R.rollout(
        params, keys, starts, model_config=MC, rollout_config=RC, env=env, forced_tokens=forced, return_cache=True
    )


ROLLOUT = jax.jit(_counted_rollout, compiler_options=FAST_COMPILE)


def _call_text(square) -> str:
    return f'<tool_call>{{"name": "choose_square", "arguments": {{"square": {square}}}}}</tool_call>'


def _choose(board, me):
    """A legal square (1..9) that blocks an opponent threat if there is one and never completes our own line."""
    board = np.asarray(board)
    empty = [i for i in range(9) if board[i] == 0]

    def completes(i, who):
        b = board.copy()
        b[i] = who
        return any(all(b[j] == who for j in line) for line in ttt.LINES)

    for i in empty:
        if completes(i, 3 - me) and not completes(i, me):
            return i + 1
    for i in empty:
        if not completes(i, me):
            return i + 1
    return empty[0] + 1


def _host_winner(board):
    for line in ttt.LINES:
        v = board[line[0]]
        if v and all(board[j] == v for j in line):
            return int(v)
    return 0


@pytest.fixture(scope="module")
def world():
    tok = load_tokenizer(None)
    env = R.compile_env(E.TicTacToeEnv.create("game"), tok, vocab_size=MC.vocab_size)
    params = _numpy_params(MC)
    keys = jax.random.split(jax.random.key(11), B)
    # Group 0: agent X vs a uniformly random opponent; group 1: agent O vs minimax (the opponent opens).
    starts = E.game_starts(
        jax.random.key(5),
        2,
        agent_player=jnp.array([1, 2]),
        opponent=jnp.array([tasks.OPPONENT_RANDOM, tasks.OPPONENT_MINIMAX]),
    )
    call = lambda sq: tok.encode(_call_text(sq), add_special_tokens=False)  # noqa: E731
    assert len(call(5)) <= M

    forced = np.full((B, RC.max_turns, M), -1, np.int32)
    runs = []

    def run(f):
        traj, cache = ROLLOUT(params, keys, starts, env, jnp.asarray(f))
        runs.append(jax.device_get((traj, cache)))
        return runs[-1]

    # Pass 0: nothing forced; a random model's calls are invalid, so final_board = the start position.
    boards = [np.asarray(run(forced)[0].info["final_board"])]
    squares = {0: [], 2: []}
    # Passes 1-3: rows 0 and 1 play the same three valid moves; row 2 one valid move then samples; row 3 samples.
    for turn in range(3):
        sq = _choose(boards[-1][0], 1)
        squares[0].append(sq)
        forced[0, turn, : len(call(sq))] = call(sq)
        forced[1, turn, : len(call(sq))] = call(sq)
        if turn == 0:
            sq2 = _choose(boards[-1][2], 2)
            squares[2].append(sq2)
            forced[2, 0, : len(call(sq2))] = call(sq2)
        boards.append(np.asarray(run(forced)[0].info["final_board"]))
    return dict(
        tok=tok,
        env=env,
        params=params,
        keys=keys,
        starts=starts,
        forced=forced,
        runs=runs,
        boards=boards,
        squares=squares,
    )


def test_scenario_plays_several_turns(world):
    traj, _ = world["runs"][-1]
    info = traj.info
    assert list(info["num_turns"]) == [3, 3, 2, 1]
    np.testing.assert_array_equal(traj.group_id, [0, 0, 1, 1])
    # Rows 0/1: three legal moves; the game then either ended on the board or hit L (truncated before turn 4).
    final = info["final_board"][0]
    over = _host_winner(final) or np.all(final != 0)
    if over:
        assert info["outcome"][0] in (tasks.OUTCOME_WIN, tasks.OUTCOME_DRAW, tasks.OUTCOME_LOSS)
    else:
        assert info["truncated"][0] and info["outcome"][0] == E.OUTCOME_TRUNCATED and traj.reward[0] == -1.0
    assert info["valid_call"][0] and info["parse_kind"][0] == 0
    # Rows 2/3 end on an invalid sampled call.
    for r in (2, 3):
        assert info["invalid"][r] and traj.reward[r] == -1.0 and info["parse_kind"][r] != 0
    # Each turn's reward: the rows sum to the episode's (a truncated row's on its last turn), 0 after the last turn;
    # tic-tac-toe declares no state keys.
    np.testing.assert_allclose(traj.turn_reward.sum(1), traj.reward)
    for r in range(B):
        assert np.all(traj.turn_reward[r, info["num_turns"][r] :] == 0.0)
    assert np.all(traj.turn_key == -1)
    # The loss mask covers exactly the generated tokens; valid is a prefix; turn ids are 0.. per segment.
    np.testing.assert_array_equal(traj.loss_mask.sum(1), info["generated_tokens"])
    for r in range(B):
        n = traj.valid[r].sum()
        assert traj.valid[r, :n].all() and not traj.valid[r, n:].any()
        assert not (traj.loss_mask[r] & ~traj.valid[r]).any()
        tid = traj.turn_id[r]
        assert (tid[:n] >= 0).all() and (tid[n:] == -1).all() and (np.diff(tid[:n]) >= 0).all()
        assert tid[n - 1] == info["num_turns"][r] - 1
        assert (tid[: traj.prompt_length[r]] == 0).all() and not traj.loss_mask[r, : traj.prompt_length[r]].any()
        # Each turn's policy tokens are one contiguous run inside that turn's segment.
        for k in range(info["num_turns"][r]):
            gen_pos = np.flatnonzero(traj.loss_mask[r] & (tid == k))
            assert len(gen_pos) > 0 and np.all(np.diff(gen_pos) == 1)
    # The forced calls sit where they were forced, with a generated stop at "</tool_call>" (7 tokens).
    call = world["tok"].encode(_call_text(world["squares"][0][1]), add_special_tokens=False)
    pos1 = np.flatnonzero(traj.loss_mask[0] & (traj.turn_id[0] == 1))
    np.testing.assert_array_equal(traj.tokens[0, pos1], call)
    # Row 2's second turn was sampled (not forced) and ran to the budget or a stop.
    assert (traj.loss_mask[2] & (traj.turn_id[2] == 1)).sum() >= 1


def test_behaviour_logp_matches_token_logprobs(world):
    traj, _ = world["runs"][-1]
    logprobs = jax.jit(functools.partial(ling3.token_logprobs, config=MC), compiler_options=FAST_COMPILE)
    ref = logprobs(world["params"], tokens=traj.tokens, valid=traj.valid)
    mask = np.asarray(traj.loss_mask)
    diff = np.abs(np.asarray(ref) - np.asarray(traj.behaviour_logp))[mask]
    assert mask.sum() > 40 and diff.max() <= 1e-4, diff.max()
    assert np.all(np.asarray(traj.behaviour_logp)[~mask] == 0)
    # Several turns are covered, including sampled tokens after a previous turn (row 2, turn 1).
    assert set(np.asarray(traj.turn_id)[mask]) >= {0, 1, 2}
    assert (mask[2] & (np.asarray(traj.turn_id[2]) == 1)).any()


def test_conversation_text_matches_chat_template(world):
    traj, _ = world["runs"][-1]
    tok, boards, squares = world["tok"], world["boards"], world["squares"][0]
    # Boards after each agent move + opponent reply, and the opponent's squares (rows 0/1 play X).
    msgs = text.game_task_messages(boards[0][0], 1)
    for k in range(2):
        before, after = boards[k][0].copy(), boards[k + 1][0]
        before[squares[k] - 1] = 1
        opp = [i + 1 for i in range(9) if after[i] == 2 and before[i] == 0]
        assert len(opp) == 1
        msgs += [{"role": "assistant", "content": _call_text(squares[k])}, text.tool_message(after, opp[0], 0)]
    want = text.chat_text(tok, msgs, add_generation_prompt=True)
    start2 = np.flatnonzero(traj.loss_mask[0] & (traj.turn_id[0] == 2))[0]
    got = tok.decode(
        [int(i) for i in traj.tokens[0, :start2]], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    assert got == want


def test_group_structure(world):
    traj, _ = world["runs"][-1]
    for a, b in ((0, 1), (2, 3)):
        p = traj.prompt_length[a]
        assert traj.prompt_length[b] == p
        np.testing.assert_array_equal(traj.tokens[a, :p], traj.tokens[b, :p])
    # Group 1's agent plays O: the opponent's opening move is on the shared start board.
    start1 = world["boards"][0][2]
    assert (start1 == 1).sum() == 1 and (start1 == 2).sum() == 0
    np.testing.assert_array_equal(world["boards"][0][3], start1)
    # Rows 0 and 1 played the same moves against a RANDOM opponent with the group's shared RNG: identical replies,
    # so identical conversations (and log-probs) until the free third turn.
    start2 = np.flatnonzero(traj.loss_mask[0] & (traj.turn_id[0] == 2))[0]
    np.testing.assert_array_equal(traj.tokens[0, : start2 + 7], traj.tokens[1, : start2 + 7])
    np.testing.assert_array_equal(traj.behaviour_logp[0, :start2], traj.behaviour_logp[1, :start2])
    np.testing.assert_array_equal(traj.info["final_board"][0], traj.info["final_board"][1])


def test_rows_are_isolated(world):
    traj, cache = world["runs"][-1]
    forced = world["forced"].copy()
    forced[1:] = -1
    keys = world["keys"].at[1:].set(jax.random.split(jax.random.key(99), B - 1))
    s = world["starts"]
    starts = s.replace(
        agent_player=s.agent_player.at[1].set(1),
        opponent_kind=s.opponent_kind.at[1].set(0),
        opponent_key=s.opponent_key.at[1].set(jnp.array([7, 8], jnp.uint32)),
    )
    traj2, cache2 = jax.device_get(ROLLOUT(world["params"], keys, starts, world["env"], jnp.asarray(forced)))
    assert not np.array_equal(traj2.tokens[1:], traj.tokens[1:])  # the other rows did change
    for a, b in zip(jax.tree.leaves(traj), jax.tree.leaves(traj2)):
        np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(cache2)):
        np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])


def test_masked_rows_keep_their_caches(world):
    """Row 3 samples one invalid turn in every pass. In pass 0 the rollout stops after that turn; in the last pass
    the other rows go on for two more prefills + decodes in which row 3 is fed with valid=False. Its KDA state,
    conv history and MLA cache must be bit-identical."""
    (traj0, cache0), (traj3, cache3) = world["runs"][0], world["runs"][-1]
    np.testing.assert_array_equal(traj0.tokens[3], traj3.tokens[3])
    assert cache3["length"][3] == traj3.valid[3].sum()
    kinds = MC.layer_kinds
    for layer, kind, a, b in zip(range(len(kinds)), kinds, cache0["layers"], cache3["layers"]):
        for name in a:
            np.testing.assert_array_equal(a[name][3], b[name][3], err_msg=f"layer {layer} ({kind}) {name}")
    assert np.abs(cache3["layers"][0]["state"][3]).sum() > 0  # the state is not trivially zero


def test_compiles_once_without_host_callbacks(world):
    assert len(TRACES) == 1, f"rollout was traced {len(TRACES)} times for one shape"
    assert ROLLOUT._cache_size() == 1
    lowered = ROLLOUT.lower(world["params"], world["keys"], world["starts"], world["env"], jnp.asarray(world["forced"]))
    hlo = lowered.as_text()
    assert "callback" not in hlo.lower()
    assert "while" in hlo  # the loops are compiled control flow, not unrolled Python


# ---------------------------------------------------------------------------------------------- move task


def test_move_task_rewards():
    tok = load_tokenizer(None)
    env = R.compile_env(E.TicTacToeEnv.create("move"), tok, vocab_size=MC.vocab_size)
    mc = ling3.tiny_test_config(vocab_size=512, num_hidden_layers=1)  # one MLA layer: the KDA path is tested above
    params = _numpy_params(mc, seed=1)
    rc = R.RolloutConfig(group_size=2, max_new_tokens=8, prefill_chunk=32)
    boards = np.array(
        [
            [1, 1, 0, 2, 2, 0, 0, 0, 0],  # X wins at 3
            [0, 0, 0, 0, 0, 0, 0, 0, 0],  # empty board: every move keeps the draw
            [1, 0, 0, 0, 2, 0, 0, 0, 0],
        ],
        np.int8,
    )
    call = lambda s: tok.encode(_call_text(s), add_special_tokens=False)  # noqa: E731
    forced = np.full((6, 1, 8), -1, np.int32)
    for row, sq in ((0, 3), (2, 5), (3, 12), (4, 1), (5, 9)):
        ids = call(sq)
        forced[row, 0, : len(ids)] = ids
    fn = jax.jit(functools.partial(R.rollout, model_config=mc, rollout_config=rc), compiler_options=FAST_COMPILE)
    traj = jax.device_get(
        fn(params, jax.random.key(3), E.move_starts(boards), env=env, forced_tokens=jnp.asarray(forced))
    )
    info = traj.info
    assert traj.tokens.shape == (6, R.conversation_length(env, rc)) == (6, env.chat.prompt_len + 8)
    np.testing.assert_array_equal(info["num_turns"], 1)
    assert info["parse_kind"][1] != 0 and info["invalid"][1] and traj.reward[1] == -1.0  # sampled: invalid
    assert traj.reward[0] == 1.0 and info["win_taken"][0] and info["is_optimal"][0] and info["win"][0]
    assert traj.reward[2] == 0.8 and info["is_optimal"][2] and not info["win_taken"][2]
    assert info["parse_kind"][3] == 3 and traj.reward[3] == -1.0 and info["outcome"][3] == tasks.OUTCOME_INVALID
    assert info["illegal"][4] and traj.reward[4] == -1.0
    # Row 5: square 9 on X . . / . O . / . . . -- compare with the task's own reward function.
    r5, i5 = tasks.move_reward(jnp.asarray(boards[2]), 0, 9, env.env.table)
    assert traj.reward[5] == float(r5) and info["is_optimal"][5] == bool(i5["is_optimal"])
    # Groups share boards: the prompts of rows 2k and 2k+1 are identical.
    for k in range(3):
        np.testing.assert_array_equal(
            traj.tokens[2 * k, : traj.prompt_length[2 * k]], traj.tokens[2 * k + 1, : traj.prompt_length[2 * k]]
        )
    np.testing.assert_array_equal(traj.loss_mask.sum(1), info["generated_tokens"])
    assert info["generated_tokens"][0] == 7  # stopped on the completed "</tool_call>"


# ---------------------------------------------------------------------------------------------- host pieces


def test_stop_tables_match_close_tag_across_token_boundaries():
    pieces = [
        b"</tool",
        b"_call>",
        b"</tool_call>",
        b"x",
        b"<",
        b"/",
        b"tool_call",
        b">",
        b"</tool_call></",
        b"tool_call>",
        b"<</tool",
        b"END",
    ]
    st = gen.build_stop_tables(pieces, [11], b"</tool_call>")
    nxt, hit, is_stop = (np.asarray(a) for a in (st.match_next, st.match_hit, st.is_stop))

    def run(seq):
        s, out = 0, []
        for v in seq:
            out.append(bool(hit[s, v] or is_stop[v]))
            s = nxt[s, v]
        return out

    assert run([0, 1]) == [False, True]
    assert run([2]) == [True]
    assert run([4, 5, 6, 7]) == [False, False, False, True]
    assert run([4, 4, 5, 6, 7]) == [False] * 4 + [True]
    assert run([10, 1]) == [False, True]
    assert run([8, 9]) == [True, True]
    assert run([3, 11]) == [False, True]
    assert run([0, 3, 1]) == [False, False, False]


def test_config_validation():
    with pytest.raises(ValueError, match="task"):
        E.TicTacToeEnv.create("chess")
    with pytest.raises(ValueError):
        R.RolloutConfig(max_new_tokens=0)
    with pytest.raises(ValueError):
        R.RolloutConfig(temperature=0.0)
    with pytest.raises(ValueError):
        R.RolloutConfig(top_p=1.5)
    with pytest.raises(ValueError):
        R.RolloutConfig(max_length=-1)
    tok = load_tokenizer(None)
    move = R.compile_env(E.TicTacToeEnv.create("move"), tok)
    game = R.compile_env(E.TicTacToeEnv.create("game"), tok)
    assert R.num_turns(move, R.RolloutConfig(max_turns=5)) == 1  # the environment bounds the turns
    assert R.num_turns(game, R.RolloutConfig(max_turns=4)) == 4
    assert R.num_turns(game, R.RolloutConfig(max_turns=9)) == 5  # X makes at most five moves


def test_bad_inputs_raise(world):
    big = ling3.tiny_test_config(vocab_size=600, num_hidden_layers=2)
    with pytest.raises(ValueError, match="vocab_size"):
        R.rollout(
            world["params"], world["keys"], world["starts"], model_config=big, rollout_config=RC, env=world["env"]
        )
    with pytest.raises(ValueError, match="forced_tokens"):
        R.rollout(
            world["params"],
            world["keys"],
            world["starts"],
            model_config=MC,
            rollout_config=RC,
            env=world["env"],
            forced_tokens=jnp.zeros((B, 1, M), jnp.int32),
        )
    short = R.RolloutConfig(group_size=2, max_new_tokens=M, max_turns=2, max_length=40)
    with pytest.raises(ValueError, match="max_length"):
        R.rollout(
            world["params"], world["keys"], world["starts"], model_config=MC, rollout_config=short, env=world["env"]
        )


def test_independent_opponents_reach_the_rollout(world):
    """The rollout hands each group member its own state (`TextEnv.for_member`): with independent opponents the two
    episodes of group 0 play the same forced first move and get different replies; by default the same one."""
    forced = np.full((B, RC.max_turns, M), -1, np.int32)
    forced[:2, 0] = world["forced"][:2, 0]
    ind = R.compile_env(
        E.TicTacToeEnv.create("game", independent_opponents=True), world["tok"], vocab_size=MC.vocab_size
    )
    shared, _ = world["runs"][1]
    np.testing.assert_array_equal(shared.info["final_board"][0], shared.info["final_board"][1])
    traj, _ = jax.device_get(ROLLOUT(world["params"], world["keys"], world["starts"], ind, jnp.asarray(forced)))
    boards = traj.info["final_board"]
    np.testing.assert_array_equal(boards[0] == 1, boards[1] == 1)  # the same forced move (a sampled 2nd call is
    np.testing.assert_array_equal(boards[0] == 1, shared.info["final_board"][0] == 1)  # invalid: the game ends)
    assert not np.array_equal(boards[0], boards[1])  # another reply
