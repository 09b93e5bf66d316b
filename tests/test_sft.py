"""reno_jax.rl.sft: teacher call tables and whole teacher conversations written by stepping an environment
(`env_transcripts`), with tic-tac-toe's warm-start teacher (`registration.random_legal_square`: a uniformly random
legal square, the call format and no strategy); soft targets over the teacher's support."""

import dataclasses
import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reno_jax import run_config
from reno_jax.envs.tictactoe import env as E
from reno_jax.envs.tictactoe import registration, tasks, tool_parser
from reno_jax.envs.tictactoe import wording as text
from reno_jax.errors import ConfigError
from reno_jax.models import ling3
from reno_jax.protocol import toolcall
from reno_jax.protocol.tokenizer import load_tokenizer
from reno_jax.rl import policy, sft
from reno_jax.rl.batch import TrainBatch
from reno_jax.rollout import rollout as R

TURNS = 5


def call_text(square) -> str:
    """The teacher's call as an assistant message's content (what `build_call_table` tokenizes)."""
    return f"<tool_call>{json.dumps({'name': text.TOOL_NAME, 'arguments': {'square': int(square)}})}</tool_call>"


def _call_table(tok, env, teacher):
    tool_names = [t["function"]["name"] for t in env.env.chat().tools]
    return sft.build_call_table(tok, teacher.calls, int(env.chat.turn_end_id), env.pad_id, tool_names)


@pytest.fixture(scope="module")
def game_world():
    tok = load_tokenizer(None)
    env = R.compile_env(E.TicTacToeEnv.create("game"), tok)
    teacher = registration.make_teacher(None, env.env)
    calls = _call_table(tok, env, teacher)
    rc = R.RolloutConfig(max_new_tokens=12, max_turns=TURNS)
    length = R.conversation_length(env, rc)
    n = 24
    agent = np.where(np.arange(n) % 2 == 0, 1, 2).astype(np.int8)
    kinds = np.array([tasks.OPPONENT_RANDOM, tasks.OPPONENT_MINIMAX, tasks.OPPONENT_EPSILON] * (n // 3), np.int32)
    starts = E.game_starts(jax.random.PRNGKey(3), n, agent_player=agent, opponent=kinds, epsilon=0.5)
    out = sft.env_transcripts(jax.random.PRNGKey(4), starts, env, teacher.policy, calls, max_turns=TURNS, length=length)
    return dict(
        tok=tok,
        env=env,
        calls=calls,
        ids=np.asarray(calls.ids),
        lens=np.asarray(calls.length),
        offset=calls.choice_offset,
        agent=agent,
        kinds=kinds,
        starts=starts,
        out=jax.device_get(out),
        length=length,
    )


def test_call_table_rows_parse_as_the_teachers_calls(game_world):
    tok, ids, lens, offset = game_world["tok"], game_world["ids"], game_world["lens"], game_world["offset"]
    env, calls = game_world["env"], game_world["calls"]
    assert ids.shape[0] == 9 and offset >= 0
    assert len(set(lens.tolist())) == 1  # one length: the rows differ in the square's token only
    for k in range(9):
        assert ids[k, lens[k] - 1] == int(env.chat.turn_end_id)
        got = tok.decode(ids[k, : lens[k] - 1].tolist(), skip_special_tokens=False)
        assert got == call_text(k + 1)
        assert tool_parser.parse_tool_call_text(got) == (toolcall.KIND_OK, k + 1)
    assert len(set(ids[:, offset].tolist())) == 9  # the square's own token
    np.testing.assert_array_equal(np.asarray(calls.args)[:, 0], np.arange(1, 10))
    np.testing.assert_array_equal(np.asarray(calls.tool), 0)  # choose_square, the one tool


def test_random_legal_square_plays_uniformly_among_legal_squares():
    boards = np.array(
        [
            [1, 2, 0, 0, 1, 2, 0, 0, 0],  # X to move, 5 empty
            [1, 2, 1, 2, 1, 2, 0, 0, 2],  # 2 empty
            [0] * 9,
        ],
        np.int8,
    )
    env = E.TicTacToeEnv.create("move")
    state, _ = jax.vmap(env.reset)(E.move_starts(boards))
    draw = jax.jit(jax.vmap(jax.vmap(registration.random_legal_square, in_axes=(None, 0)), in_axes=(0, None)))
    rows, support = jax.device_get(draw(state, jax.random.split(jax.random.PRNGKey(0), 400)))
    for b, board in enumerate(boards):
        np.testing.assert_array_equal(support[b], np.broadcast_to(board == 0, (400, 9)))
        played = set(rows[b].tolist())
        assert played == set(np.flatnonzero(board == 0).tolist()), "every legal square, and only those"
        counts = np.bincount(rows[b], minlength=9)[board == 0]
        assert counts.min() > 400 / (board == 0).sum() / 2  # roughly uniform
    game_env = E.TicTacToeEnv.create("game")  # a game state: the board inside the game
    starts = E.game_starts(jax.random.PRNGKey(1), 4, agent_player=np.int8(2), opponent="random")
    gstate, _ = jax.vmap(game_env.reset)(starts)
    row, legal = jax.device_get(
        jax.vmap(registration.random_legal_square)(gstate, jax.random.split(jax.random.PRNGKey(2), 4))
    )
    np.testing.assert_array_equal(legal, np.asarray(gstate.game.board) == 0)
    assert legal.sum(1).tolist() == [8] * 4 and legal[np.arange(4), row].all()


def test_move_transcript_is_one_legal_call_after_the_prompt():
    tok = load_tokenizer(None)
    env = R.compile_env(E.TicTacToeEnv.create("move"), tok)
    teacher = registration.make_teacher(None, env.env)
    calls = _call_table(tok, env, teacher)
    boards = np.array([[1, 2, 0, 0, 1, 2, 0, 0, 0], [0] * 9], np.int8)
    length = env.prompt_len + int(np.max(np.asarray(calls.length)))
    out = jax.device_get(
        sft.env_transcripts(
            jax.random.PRNGKey(0), E.move_starts(boards), env, teacher.policy, calls, max_turns=1, length=length
        )
    )
    for b, board in enumerate(boards):
        mask = out.loss_mask[b]
        s, e = int(np.argmax(mask)), int(mask.sum()) + int(np.argmax(mask))
        assert mask[s:e].all() and e == int(out.valid[b].sum())
        prompt = tok.decode(out.tokens[b, :s].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert prompt == text.chat_text(tok, text.move_task_messages(board), add_generation_prompt=True)
        kind, square = tool_parser.parse_tool_call_text(
            tok.decode(out.tokens[b, s : e - 1].tolist(), skip_special_tokens=False)
        )
        assert kind == toolcall.KIND_OK and board[square - 1] == 0
        np.testing.assert_array_equal(out.support[b, s + calls.choice_offset], board == 0)
        assert int(out.info["outcome"][b]) != tasks.OUTCOME_ILLEGAL


def test_game_transcripts_are_random_legal_games_as_the_rollout_renders_them(game_world):
    w = game_world
    tok, out, offset = w["tok"], w["out"], w["offset"]
    square_tokens = w["ids"][:, offset]
    outcomes = set()
    for b in range(len(w["agent"])):
        valid = out.valid[b]
        n = int(valid.sum())
        assert valid[:n].all() and not valid[n:].any()
        mask = out.loss_mask[b]
        assert not (mask & ~valid).any()
        runs = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
        spans = list(zip(runs[::2], runs[1::2]))
        assert 1 <= len(spans) <= TURNS
        # Rebuild the conversation on the host and compare with the chat template's text.
        board = np.zeros(9, np.int8)
        prompt_text = tok.decode(out.tokens[b, : spans[0][0]].tolist(), skip_special_tokens=False)
        agent = int(w["agent"][b])
        if agent == 2:  # the opponent (X) opened: find its square from the prompt's board
            opened = [k for k in range(9) if text.render_board(np.eye(9, dtype=np.int8)[k]) in prompt_text]
            assert len(opened) == 1
            board[opened[0]] = 1
        msgs = text.game_task_messages(board, agent)
        for t, (s, e) in enumerate(spans):
            call = tok.decode(out.tokens[b, s : e - 1].tolist(), skip_special_tokens=False)
            kind, square = tool_parser.parse_tool_call_text(call)
            assert kind == toolcall.KIND_OK
            assert board[square - 1] == 0, "the random policy only plays legal squares"
            legal = out.support[b, s + offset]
            np.testing.assert_array_equal(legal, board == 0)
            assert out.tokens[b, s + offset] == square_tokens[square - 1]
            assert not out.support[b, s + offset + 1 : e].any()
            board[square - 1] = agent
            if t + 1 < len(spans):  # the opponent replied: read its square from the next board in the text
                nxt = out.tokens[b, e : spans[t + 1][0]].tolist()
                resp = tok.decode(nxt, skip_special_tokens=False)
                opp = [k for k in range(9) if f"Opponent played {k + 1}." in resp]
                assert len(opp) == 1 and board[opp[0]] == 0
                board[opp[0]] = 3 - agent
                msgs += [{"role": "assistant", "content": call_text(square)}, text.tool_message(board, opp[0] + 1, 0)]
        want = text.chat_text(tok, msgs, add_generation_prompt=True)
        got = tok.decode(
            out.tokens[b, : spans[-1][0]].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        assert got == want
        outcomes.add(int(out.info["outcome"][b]))
        assert int(out.info["outcome"][b]) in (
            tasks.OUTCOME_ONGOING,
            tasks.OUTCOME_WIN,
            tasks.OUTCOME_DRAW,
            tasks.OUTCOME_LOSS,
        )
    assert outcomes & {tasks.OUTCOME_WIN, tasks.OUTCOME_LOSS}, "24 random games should include decided ones"


def test_soft_targets_are_the_expected_log_likelihood(game_world):
    """One choice token (the square): the target at it is uniform over the legal squares, and the soft log-prob is
    the mean log-prob of the legal squares' tokens; every other position keeps its hard target."""
    w = game_world
    cfg = ling3.tiny_test_config(vocab_size=len(w["tok"]), num_hidden_layers=2)
    params = ling3.init_params(cfg, jax.random.PRNGKey(0))
    rows = slice(0, 2)
    out = jax.device_get(
        sft.env_transcripts(
            jax.random.PRNGKey(4),
            w["starts"],
            w["env"],
            registration.make_teacher(None, w["env"].env).policy,
            w["calls"],
            max_turns=TURNS,
            length=w["out"].tokens.shape[1],
            soft_targets=True,
        )
    )
    np.testing.assert_array_equal(out.tokens, w["out"].tokens)  # the same transcripts, with targets added
    square_ids = w["ids"][:, w["offset"]]
    choice = np.asarray(w["calls"].choice_tokens)
    np.testing.assert_array_equal(choice, np.sort(square_ids))
    legal = np.asarray(out.support[rows])
    weights = np.asarray(out.target_weights[rows])
    np.testing.assert_allclose(weights.sum(-1), legal.any(-1).astype(np.float32), rtol=1e-6)
    tokens = jnp.asarray(out.tokens[rows])
    batch = TrainBatch(
        tokens=tokens,
        valid=jnp.asarray(out.valid[rows]),
        loss_mask=jnp.asarray(out.loss_mask[rows]),
        old_logp=jnp.zeros(tokens.shape, jnp.float32),
        advantages=jnp.zeros(tokens.shape[:1]),
    )
    logp_fn = jax.jit(policy.make_logp_fn(cfg, with_entropy=False))
    hard = logp_fn(params, batch).logp
    got = logp_fn(
        params,
        batch.replace(
            soft_target_ids=jnp.broadcast_to(jnp.asarray(choice), (2, choice.size)),
            soft_target_weights=jnp.asarray(weights),
        ),
    ).logp
    logits, _ = jax.jit(lambda p, t, v: ling3.forward(p, cfg, t, valid=v))(params, batch.tokens, batch.valid)
    logprobs = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    where = np.argwhere(legal.any(-1))
    assert len(where) >= 2
    for b, t in where:
        lg = legal[b, t]
        np.testing.assert_allclose(weights[b, t][np.searchsorted(choice, square_ids[lg])], 1.0 / lg.sum(), rtol=1e-6)
        want = logprobs[b, t - 1, square_ids[lg]].mean()
        np.testing.assert_allclose(float(got[b, t]), want, rtol=1e-5, atol=1e-6)
    other = ~legal.any(-1)
    np.testing.assert_array_equal(np.asarray(got)[other], np.asarray(hard)[other])


def test_soft_targets_of_a_choice_spelt_over_several_tokens():
    """guess_number's numbers are written digit by digit: the first digit's target is the share of the allowed
    numbers that start with it, the next token's the share of those that also share the first digit."""
    from reno_jax.envs import guess_number as gn

    tok = load_tokenizer(None)
    env = R.compile_env(gn.GuessNumberEnv(), tok)
    teacher = env.env.teacher()
    calls = _call_table(tok, env, teacher)
    assert calls.choice_offset == -1  # "1" and "12" differ in more than one token
    choice = list(calls.choice_tokens)
    digit = {d: tok.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    n = 16
    starts = gn.Start(secret=jnp.arange(1, n + 1, dtype=jnp.int32))
    length = R.conversation_length(env, R.RolloutConfig(max_new_tokens=20, max_turns=gn.MAX_GUESSES))
    out = jax.device_get(
        sft.env_transcripts(
            jax.random.PRNGKey(0),
            starts,
            env,
            teacher.policy,
            calls,
            max_turns=gn.MAX_GUESSES,
            length=length,
            soft_targets=True,
        )
    )
    text = [tok.decode(out.tokens[b][out.valid[b]].tolist(), skip_special_tokens=False) for b in range(n)]
    checked = 0
    for b in range(n):
        low, high = 1, gn.MAX_NUMBER
        mask = out.loss_mask[b]
        starts_at = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        ranges = [(int(x), int(y)) for x, y in re.findall(r"It is (\d+) to (\d+)\.", text[b])]
        for k, at in enumerate(starts_at):
            call = out.tokens[b, at : at + int(mask[at:].argmin() or mask[at:].size)]
            first = next(i for i, t in enumerate(call) if t in digit.values())  # the number's first digit
            allowed = [str(v) for v in range(low, high + 1)]
            w = out.target_weights[b, at + first]
            for d in range(1, 10):
                share = sum(a[0] == str(d) for a in allowed) / len(allowed)
                np.testing.assert_allclose(w[choice.index(digit[d])], share, atol=1e-6)
            written = tok.decode(call[first : first + 1].tolist())
            ids = np.asarray(calls.ids)
            going_on = [ids[int(a) - 1, first + 1] for a in allowed if a[0] == written]  # what follows the digit
            w2 = out.target_weights[b, at + first + 1]
            if len(set(going_on)) > 1:  # "1" closes or goes on as 10..16: each continuation its share
                for t in set(going_on):
                    np.testing.assert_allclose(w2[choice.index(t)], going_on.count(t) / len(going_on), atol=1e-6)
                checked += 1
            else:  # one way on: the written token is the target (weight 1 on it, or none)
                assert w2.sum() in (0.0, 1.0)
            if k < len(ranges):
                low, high = ranges[k]
    assert checked >= 1


def test_a_teachers_decision_weight_scales_its_soft_targets(game_world):
    """A teacher returning `(row, support, weight)`: each call's soft targets sum to that decision's weight (here
    3 where the teacher plays the centre square, else 1); the transcripts are those of the unweighted teacher."""
    w = game_world
    plain = registration.make_teacher(None, w["env"].env).policy

    def weighted(state, key):
        row, support = plain(state, key)
        return row, support, jnp.where(row == 4, 3.0, 1.0)

    kw = dict(max_turns=TURNS, length=w["length"], soft_targets=True)
    base = jax.device_get(sft.env_transcripts(jax.random.PRNGKey(4), w["starts"], w["env"], plain, w["calls"], **kw))
    out = jax.device_get(sft.env_transcripts(jax.random.PRNGKey(4), w["starts"], w["env"], weighted, w["calls"], **kw))
    np.testing.assert_array_equal(out.tokens, base.tokens)
    at = np.asarray(out.support).any(-1)  # the square's position of every call
    centre = at & (out.tokens == w["ids"][4, w["offset"]])
    assert centre.any() and (at & ~centre).any()
    total = np.asarray(out.target_weights).sum(-1)
    np.testing.assert_allclose(total[centre], 3.0, rtol=1e-6)
    np.testing.assert_allclose(total[at & ~centre], 1.0, rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(out.target_weights)[centre] / 3.0, np.asarray(base.target_weights)[centre], rtol=1e-6
    )


def _pool(lengths, width=12):
    rows = len(lengths)
    valid = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    tokens = np.where(valid, np.arange(1, rows + 1)[:, None], 0).astype(np.int32)
    return sft.Transcripts(
        tokens=jnp.asarray(tokens),
        valid=jnp.asarray(valid),
        loss_mask=jnp.asarray(valid),
        support=jnp.zeros((rows, width, 2), jnp.bool_),
        info={"row": jnp.arange(rows)},
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_length_sorted_batches_split_a_pool_into_batches_of_neighbours_in_length(batch, batches, data):
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=batch * batches, max_size=batch * batches))
    out = sft.length_sorted_batches(_pool(lengths), batch, jax.random.PRNGKey(data.draw(st.integers(0, 99))))
    assert len(out) == batches
    seen = []
    for part in out:
        chex.assert_shape(part.tokens, (batch, 12))
        rows = np.asarray(part.info["row"])
        # every field of a row moved together, and each batch holds whole rows of the pool
        np.testing.assert_array_equal(np.asarray(part.tokens).max(axis=1), rows + 1)
        np.testing.assert_array_equal(np.asarray(part.valid).sum(axis=1), np.asarray(lengths)[rows])
        seen.append(sorted(np.asarray(lengths)[rows]))
    assert sorted(int(r) for part in out for r in np.asarray(part.info["row"])) == list(range(batch * batches))
    # the batches are consecutive runs of the sorted lengths: no batch spans another's range
    seen.sort()
    assert [x for part in seen for x in part] == sorted(lengths)


def test_length_sorted_batches_refuse_a_pool_that_does_not_split():
    with pytest.raises(ValueError, match="does not split into batches of 2"):
        sft.length_sorted_batches(_pool([3, 4, 5]), 2, jax.random.PRNGKey(0))


@pytest.mark.parametrize("fraction", [0.1, 1.0])
def test_warm_start_schedule_ends_at_its_final_fraction_of_the_peak(fraction):
    s = run_config.load(run_config.default_config_dict()).sft
    s = dataclasses.replace(s, num_steps=100, warmup_steps=10, learning_rate=3e-3, final_lr_fraction=fraction)
    schedule = sft.learning_rate_schedule(s)
    assert float(schedule(10)) == pytest.approx(3e-3)
    assert float(schedule(100)) == pytest.approx(3e-3 * fraction)
    middle = float(schedule(55))
    assert middle == pytest.approx(3e-3) if fraction == 1.0 else 3e-4 < middle < 3e-3


def test_warm_start_final_fraction_outside_zero_one_is_one_config_error():
    config = run_config.default_config_dict()
    config.sft.final_lr_fraction = 1.5
    with pytest.raises(ConfigError, match=r"sft\.final_lr_fraction.*\[0, 1\]"):
        run_config.load(config)


def test_warm_start_schedule_holds_the_peak_until_its_decay_steps():
    s = run_config.load(run_config.default_config_dict()).sft
    s = dataclasses.replace(s, num_steps=100, warmup_steps=10, learning_rate=3e-3, final_lr_fraction=0.1)
    schedule = sft.learning_rate_schedule(dataclasses.replace(s, decay_steps=20))
    whole = sft.learning_rate_schedule(s)  # decay_steps=0: the cosine over all 90 steps after the warmup
    assert float(schedule(5)) == pytest.approx(float(whole(5)))  # the same warmup
    assert float(schedule(10)) == pytest.approx(3e-3)
    assert float(schedule(80)) == pytest.approx(3e-3)  # held until the last 20 steps
    assert 3e-4 < float(schedule(90)) < 3e-3
    assert float(schedule(100)) == pytest.approx(3e-4)
    assert float(whole(80)) < 3e-3 * 0.5


def test_warm_start_decay_longer_than_the_warm_start_is_one_config_error():
    config = run_config.default_config_dict()
    config.sft.num_steps, config.sft.warmup_steps, config.sft.decay_steps = 100, 10, 95
    with pytest.raises(ConfigError, match=r"sft\.decay_steps=95 is more than the 90 warm-start steps"):
        run_config.load(config)
