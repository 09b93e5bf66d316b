"""The TextEnv interface end to end on environments other than tic-tac-toe: the generic rollout (Connect Four,
guess-the-number), SFT transcripts written by stepping the environment, the registry, the generic trainer and
evaluation, and the typed rollout outputs."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from reno_jax import errors, run_config
from reno_jax.envs import guess_number, interface, registry
from reno_jax.envs.connect4 import env as c4env
from reno_jax.envs.connect4 import registration as c4reg
from reno_jax.envs.connect4 import rules as c4rules
from reno_jax.loop import config as loop_config
from reno_jax.models import ling3
from reno_jax.protocol import chat
from reno_jax.protocol.tokenizer import load_tokenizer
from reno_jax.rl import losses, policy, sft
from reno_jax.rl.batch import TrainBatch, bucketed_length
from reno_jax.rollout import rollout as R

FAST = {"xla_backend_optimization_level": 0}
MC = ling3.tiny_test_config(vocab_size=512, num_hidden_layers=1)  # one MLA (MoE) layer: cheap to compile


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def params():
    return ling3.init_params(MC, jax.random.PRNGKey(0))


def _call_ids(tok, name, arg, value, turn_end):
    text = f"<tool_call>{json.dumps({'name': name, 'arguments': {arg: value}})}</tool_call>"
    return list(tok.encode(text, add_special_tokens=False)) + [turn_end]


def _decode(tok, ids):
    return tok.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_connect4_rollout_plays_forced_columns_and_renders_the_environments_text(tok, params):
    env = R.compile_env(c4env.Connect4Env(opponent="greedy"), tok, vocab_size=MC.vocab_size)
    turns, m = 3, 24
    rc = R.RolloutConfig(group_size=1, max_new_tokens=m, max_turns=turns, prefill_chunk=64)
    starts = c4env.sample_starts(jax.random.PRNGKey(2), 2, "greedy", 1)  # agent X in both
    forced = np.full((2, turns, m), -1, np.int32)
    cols = [[4, 4, 4], [1, 9, 2]]  # row 1's second call is out of range: the episode ends there, invalid
    for b in range(2):
        for t in range(turns):
            ids = _call_ids(tok, "drop_piece", "column", cols[b][t], env.chat.turn_end_id)
            forced[b, t, : len(ids)] = ids
    fn = jax.jit(functools.partial(R.rollout, model_config=MC, rollout_config=rc), compiler_options=FAST)
    traj = jax.device_get(fn(params, jax.random.PRNGKey(0), starts, env=env, forced_tokens=jnp.asarray(forced)))
    assert isinstance(traj.stats, R.RolloutStats)
    np.testing.assert_array_equal(traj.stats.num_turns, [3, 2])
    np.testing.assert_array_equal(traj.stats.parse_kind, [0, 3])
    assert traj.env_info["invalid"][1] and traj.reward[1] == -1.0
    # Stepping the environment by hand with the same calls gives the same episode.
    state, _ = c4env.Connect4Env(opponent="greedy").reset(jax.tree.map(lambda a: a[0], starts))
    e = c4env.Connect4Env(opponent="greedy")
    texts = []
    for t in range(turns):
        out = e.step(state, interface.ToolCall(kind=jnp.int32(0), tool=jnp.int32(0), args=jnp.array([4])))
        state = out.state
        texts.append(chat.tool_text(tok, e.chat(), out.message, add_turn_end=True))  # stopped at </tool_call>
        if bool(out.done):
            break
    assert int(state.agent_moves) == 3 and int(traj.env_info["num_agent_moves"][0]) == 3
    # The tokens between the policy turns are exactly the environment's tool responses, as the template writes them.
    row = traj.tokens[0][traj.valid[0]]
    mask = traj.loss_mask[0][traj.valid[0]]
    edges = np.flatnonzero(np.diff(mask.astype(np.int8)))
    between = [_decode(tok, row[edges[2 * k + 1] + 1 : edges[2 * k + 2] + 1]) for k in range(2)]
    assert between == texts[:2]


def test_rollout_records_each_turns_reward_and_state_key(tok, params):
    # Group of 2 with secret 5: row 0 guesses 8, 4, 5 (found on the third guess); row 1 guesses 8, 2, 99 (invalid).
    env = R.compile_env(guess_number.GuessNumberEnv(), tok, vocab_size=MC.vocab_size)
    turns, m = 4, 20
    rc = R.RolloutConfig(group_size=2, max_new_tokens=m, max_turns=turns, prefill_chunk=64)
    starts = guess_number.Start(secret=jnp.array([5], jnp.int32))
    forced = np.full((2, turns, m), -1, np.int32)
    for b, calls in enumerate([[8, 4, 5], [8, 2, 99]]):
        for t, number in enumerate(calls):
            ids = _call_ids(tok, "guess", "number", number, env.chat.turn_end_id)
            forced[b, t, : len(ids)] = ids
    fn = jax.jit(functools.partial(R.rollout, model_config=MC, rollout_config=rc), compiler_options=FAST)
    traj = jax.device_get(fn(params, jax.random.PRNGKey(0), starts, env=env, forced_tokens=jnp.asarray(forced)))
    np.testing.assert_array_equal(traj.stats.num_turns, [3, 3])
    np.testing.assert_allclose(traj.turn_reward, [[0, 0, 1 - 2 * guess_number.GUESS_COST, 0], [0, 0, -1, 0]])
    np.testing.assert_allclose(traj.turn_reward.sum(1), traj.reward)
    key = lambda guesses, low, high: env.env.state_key(
        guess_number.State(  # noqa: E731
            secret=5, guesses=guesses, found=False, low=low, high=high, wasted=0
        )
    )
    # Turn 0 from the start (1..16), turn 1 after "8 is too high" (1..7) in both rows; then the rows part.
    np.testing.assert_array_equal(
        traj.turn_key,
        [[key(0, 1, 16), key(1, 1, 7), key(2, 5, 7), -1], [key(0, 1, 16), key(1, 1, 7), key(2, 3, 7), -1]],
    )
    turn_adv = np.asarray(losses.turn_advantages(traj.turn_reward, traj.turn_key, 2))
    assert turn_adv[0, 1] > 0 > turn_adv[1, 1] and turn_adv[0, 0] > 0 > turn_adv[1, 0]  # shared states compared
    assert turn_adv[0, 2] == turn_adv[1, 2] == 0.0  # states only one row reached


def test_guess_number_transcripts_step_the_environment(tok):
    env = R.compile_env(guess_number.GuessNumberEnv(), tok)
    teacher = env.env.teacher()
    assert isinstance(teacher, interface.Teacher)
    table = sft.build_call_table(tok, teacher.calls, env.chat.turn_end_id, env.pad_id, ["guess"])
    assert table.ids.shape[0] == guess_number.MAX_NUMBER
    starts = guess_number.GuessNumberEnv().sample_starts(jax.random.PRNGKey(0), 16)
    length = R.conversation_length(env, R.RolloutConfig(max_new_tokens=16, max_turns=5))
    out = jax.device_get(
        sft.env_transcripts(jax.random.PRNGKey(1), starts, env, teacher.policy, table, max_turns=5, length=length)
    )
    info = out.info
    assert info["found"].mean() > 0.5 and not info["invalid"].any()
    for b in range(4):
        text = _decode(tok, out.tokens[b][out.valid[b]])
        secret = int(starts.secret[b])
        assert text.startswith(chat.chat_text(tok, env.env.chat(), chat.user_messages(env.env.chat(), (0, [0, 0]))))
        guesses = [int(g) for g in __import__("re").findall(r'"number": (\d+)', text)]
        assert len(guesses) == int(info["guesses"][b])
        for g in guesses[:-1]:  # every answer is consistent with the secret
            assert ("is too high" if g > secret else "is too low") in text
        assert (guesses[-1] == secret) == bool(info["found"][b])
        # The loss mask covers exactly the calls (turn end included).
        assert out.loss_mask[b].sum() == sum(int(table.length[g - 1]) for g in guesses)


def test_registry_and_config_validation():
    assert {"tictactoe", "connect4", "guess_number"} <= set(registry.names())
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        registry.get("chess")
    with pytest.raises(ValueError, match="env.name is not set"):
        registry.entry_for(ml_collections.ConfigDict({"task": "move"}))
    from configs import connect4_tiny

    c = connect4_tiny.get_config()
    loop_config.validate_config(c)
    c.env.name = "chess"
    with pytest.raises(errors.ConfigError, match=r"--config\.env\.name: unknown environment 'chess'"):
        loop_config.validate_config(c)
    c = connect4_tiny.get_config()
    c.env.opponent = "minimax"  # tic-tac-toe's, not Connect Four's
    with pytest.raises(errors.ConfigError, match="opponent"):
        loop_config.validate_config(c)
    c = connect4_tiny.get_config()
    c.eval_suites = "random,chess"
    loop_config.validate_config(c)  # no in-run evaluation: the suites are not played
    c.sft.eval_every = 50
    with pytest.raises(errors.ConfigError, match=r"unknown evaluation suite\(s\) \['chess'\]"):
        loop_config.validate_config(c)
    c.sft.eval_every = -1
    with pytest.raises(errors.ConfigError, match=r"--config\.sft\.eval_every must be an integer >= 0"):
        loop_config.validate_config(c)


def _guess_config(tmp_steps=1):
    from configs import guess_number_tiny

    c = guess_number_tiny.get_config()
    c.num_steps = tmp_steps
    c.model.tiny.num_hidden_layers = 2  # every layer kind still (KDA + dense MLP, MLA + MoE); compiles faster
    c.sft.num_steps = 2
    c.sft.batch_size = 4
    c.sft.compare_episodes = 0  # the student-teacher comparison (~11 CPU-s a run): tests/test_own_environment.py
    c.rollout.boards_per_step = 2
    c.rollout.group_size = 2
    c.rollout.max_turns = 2
    c.plot_every = 0
    c.checkpoint_every = 1
    return c


def test_warm_start_names_a_turn_too_short_for_the_teachers_calls(tmp_path):
    from reno_jax import loop

    c = _guess_config()
    c.rollout.max_new_tokens = 6  # a guess call is 14-15 tokens: the teacher's calls would never fit a turn
    with pytest.raises(
        errors.ConfigError,
        match=r"--config\.rollout\.max_new_tokens=6 is shorter than .*"
        r"longest teacher call \(1\d tokens with the turn end\); set it to >= 1\d",
    ):
        loop.train(c, str(tmp_path))


def test_generic_trainer_and_evaluation_on_guess_number(tmp_path):
    from reno_jax import loop

    c = _guess_config(2)
    c.eval_every = 2  # the default suite (every secret, greedy) at step 2, logged as eval/<suite>/<figure>;
    # the same program as the evaluate CLI's below (16 episodes in one batch): compiled once per session
    c.sft.eval_every = 2  # and at the warm start's last step, into warmstart_log/ with every step's NLL
    c.plot_every = 2
    rows = loop.train(c, str(tmp_path))
    warm_rows = [json.loads(line) for line in open(tmp_path / "warmstart_log" / "metrics.jsonl")]
    assert [r["step"] for r in warm_rows] == [1, 2] and all(np.isfinite(r["sft/nll"]) for r in warm_rows)
    assert "eval/secrets/found_rate" not in warm_rows[0] and warm_rows[1]["perf/eval_seconds"] > 0
    assert (tmp_path / "warmstart_log" / "learning_curves.png").stat().st_size > 0
    assert [r["step"] for r in rows] == [1, 2]
    assert not any(k.startswith("eval/") for k in rows[0])
    assert rows[1]["eval/secrets/num_episodes"] == guess_number.MAX_NUMBER
    assert 0.0 <= rows[1]["eval/secrets/found_rate"] <= 1.0 and rows[1]["perf/eval_seconds"] > 0
    for key in ("rollout/found_rate", "rollout/guesses_mean", "rollout/rewards_mean", "train/loss"):
        assert all(np.isfinite(r[key]) for r in rows), key
    out = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", f"--workdir={tmp_path}", "--batch_size=16", "--transcripts=1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["env"] == "guess_number" and summary["checkpoint_step"] == 2
    assert 0.0 <= summary["secrets/found_rate"] <= 1.0 and summary["secrets/num_episodes"] == guess_number.MAX_NUMBER
    assert summary["secrets/mean_turns"] >= 1  # every episode makes at least one call
    for figure in ("found_rate", "mean_reward", "mean_turns"):  # greedy on every secret: as evaluated in training
        assert summary[f"secrets/{figure}"] == rows[1][f"eval/secrets/{figure}"], figure
    assert 0.0 <= summary["secrets/invalid_rate"] <= 1.0
    assert 0.0 <= summary["secrets/tool_call_valid_rate"] <= 1.0
    # The warm start (what GSPO started from) as a step-0 run: its own parameters, not a checkpoint's, evaluated by
    # the same program (`experiments.evaluate --warm_start`).
    warm, final = loop.load_warm_start(str(tmp_path)), loop.load_checkpoint(str(tmp_path))
    assert warm.step == 0 and jax.tree.structure(warm.params) == jax.tree.structure(final.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(warm.params), jax.tree.leaves(final.params)))
    figures = loop.flat_figures(
        loop.evaluate(
            warm.params, warm.model_config, warm.tokenizer, warm.config, key=jax.random.PRNGKey(0), show_progress=False
        )
    )
    assert figures["secrets/num_episodes"] == guess_number.MAX_NUMBER and 0.0 <= figures["secrets/found_rate"] <= 1
    for figure in ("found_rate", "guesses_mean", "mean_reward"):  # the warm start's own in-run evaluation agrees
        assert figures[f"secrets/{figure}"] == warm_rows[1][f"eval/secrets/{figure}"], figure


def test_summarize_reduces_infos_by_the_declared_metrics():
    info = {
        "found": np.array([True, False, True, True]),
        "guesses": np.array([2, 7, 3, 1]),
        "invalid": np.array([False, True, False, False]),
        "wasted": np.array([0, 2, 0, 0]),
    }
    env = guess_number.GuessNumberEnv()
    assert interface.summarize(env, info) == {
        "found_rate": 0.75,
        "invalid_rate": 0.25,
        "guesses_mean": 3.25,
        "wasted_mean": 0.5,
    }
    from reno_jax.rollout import summary

    assert summary.plotted_metrics(env) == ("rollout/found_rate", "rollout/guesses_mean")

    class Declared(guess_number.GuessNumberEnv):
        def episode_metrics(self):
            return {
                "calls": interface.Metric(lambda i: i["guesses"], reduce="sum"),
                "most": interface.Metric(lambda i: i["guesses"], reduce="max"),
                "found_when_fast": interface.rate("found", where=lambda i: i["guesses"] <= 3),
                "found_when_slow": interface.rate("found", where=lambda i: i["guesses"] > 10),  # none: NaN
                "two_guesses": interface.rate("guesses", equals=2),
            }

    out = interface.summarize(Declared(), info)
    assert (out["calls"], out["most"], out["found_when_fast"], out["two_guesses"]) == (13.0, 7.0, 1.0, 0.25)
    assert np.isnan(out["found_when_slow"])

    class Undeclared(guess_number.GuessNumberEnv):  # no declared metrics: the mean of every info leaf
        def episode_metrics(self):
            return {}

    assert interface.summarize(Undeclared(), info) == {"found": 0.75, "guesses": 3.25, "invalid": 0.25, "wasted": 0.5}
    with pytest.raises(ValueError, match="reduce"):
        interface.Metric(lambda i: i["found"], reduce="median")


def test_learning_curve_panels_follow_the_environments_plotted_metrics():
    from reno_jax.loop import training

    keys = training.curve_keys(guess_number.GuessNumberEnv())
    assert keys[:2] == training.LEADING_CURVES and keys[-len(training.TRAILING_CURVES) :] == training.TRAILING_CURVES
    assert keys[2:4] == ("rollout/found_rate", "rollout/guesses_mean")  # Metric(plot=True) only
    logged = dict.fromkeys(
        [
            "rollout/rewards_mean",
            "rollout/found_rate",
            "train/grad_norm",
            "eval/secrets/found_rate",
            "eval/secrets/invalid_rate",
        ]
    )
    assert training.present_panels(keys, logged) == (
        "rollout/rewards_mean",
        "rollout/found_rate",
        "train/grad_norm",
        "eval/secrets/found_rate",
    )


def test_center_greedy_teacher_wins_blocks_and_prefers_the_centre():
    e = c4env.Connect4Env()
    start = jax.tree.map(lambda a: a[0], c4env.sample_starts(jax.random.PRNGKey(0), 1, "random", 1))
    state, _ = e.reset(start)
    assert int(c4reg.center_greedy_column(state)) == 3  # empty board: the centre
    board = np.zeros((6, 7), np.int8)
    board[5, 0:3] = c4rules.X  # X to win at column 3 (0-based) ... and O threatens column 6 too
    board[5, 4:6] = c4rules.O
    board[4, 6] = c4rules.O
    game = c4rules.state_from_board(jnp.asarray(board))
    state = state.replace(game=game)
    assert int(c4reg.center_greedy_column(state)) == 3  # the win comes first


def test_exploring_center_greedy_teacher_plays_off_path_but_targets_its_own_column():
    e = c4env.Connect4Env()
    start = jax.tree.map(lambda a: a[0], c4env.sample_starts(jax.random.PRNGKey(0), 1, "random", 1))
    state, _ = e.reset(start)  # empty board: the teacher's column is the centre (3, 0-based)
    config = run_config.load(dict(sft=dict(teacher="center_greedy", explore=0.5, soft_targets=True)))
    teacher = c4reg.make_teacher(config, e)
    cols, targets = jax.vmap(lambda k: teacher.policy(state, k))(jax.random.split(jax.random.PRNGKey(1), 400))
    cols, targets = np.asarray(cols), np.asarray(targets)
    assert (targets == (np.arange(7) == 3)).all()  # the target is the teacher's column whatever is played
    off = np.mean(cols != 3)  # a uniform legal column half the time, the centre in 1/7 of those
    assert 0.5 * 6 / 7 - 0.08 < off < 0.5 * 6 / 7 + 0.08
    assert set(np.unique(cols)) == set(range(7))
    plain = c4reg.make_teacher(run_config.load(dict(sft=dict(teacher="center_greedy"))), e)
    assert int(plain.policy(state, jax.random.PRNGKey(2))[0]) == 3
    for bad in (
        dict(explore=0.5),
        dict(explore=0.5, soft_targets=True, teacher="greedy"),
        dict(explore=1.0, soft_targets=True),
    ):
        with pytest.raises(errors.ConfigError, match="sft.explore"):
            c4reg.make_teacher(run_config.load(dict(sft=dict(dict(teacher="center_greedy"), **bad))), e)


def test_center_greedy_teacher_weighs_the_positions_with_a_four_to_make_or_stop():
    """`sft.forced_weight`: the teacher's decision weight is that where a legal column wins or blocks, else 1."""
    e = c4env.Connect4Env()
    empty = np.zeros((6, 7), np.int8)
    win = empty.copy()
    win[5, :3], win[4, :3] = 1, 2  # X to move (3 each) with a four to make at column 4 (1-based) of the bottom row
    block = empty.copy()
    block[5, :2], block[4, 0], block[5, 4:] = 1, 1, 2  # X to move; O's three on the bottom row ends at column 4
    states = jax.vmap(e.reset)(c4env.position_starts(np.stack([empty, win, block])))[0]
    config = run_config.load(dict(sft=dict(teacher="center_greedy", soft_targets=True, forced_weight=6.0)))
    teacher = c4reg.make_teacher(config, e)
    cols, _, weights = jax.vmap(teacher.policy)(states, jax.random.split(jax.random.PRNGKey(0), 3))
    np.testing.assert_array_equal(np.asarray(cols), [3, 3, 3])  # centre; X's four at 0-based 3; O's four stopped
    np.testing.assert_allclose(np.asarray(weights), [1.0, 6.0, 6.0])
    np.testing.assert_array_equal(np.asarray(jax.vmap(c4reg.forced_position)(states)), [False, True, True])
    plain = c4reg.make_teacher(run_config.load(dict(sft=dict(teacher="center_greedy"))), e)
    assert len(plain.policy(jax.tree.map(lambda a: a[0], states), jax.random.PRNGKey(0))) == 2
    for bad in (dict(forced_weight=6.0), dict(forced_weight=0.0, soft_targets=True)):
        with pytest.raises(errors.ConfigError, match="sft.forced_weight"):
            c4reg.make_teacher(run_config.load(dict(sft=dict(dict(teacher="center_greedy"), **bad))), e)


def test_logp_fn_scores_the_tempered_policy(params):
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, MC.vocab_size)
    logits, _ = ling3.forward(params, MC, tokens)
    want = jnp.take_along_axis(
        jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / 0.7, axis=-1), tokens[:, 1:, None], axis=-1
    )[..., 0]
    batch = TrainBatch(
        tokens=tokens,
        loss_mask=jnp.ones(tokens.shape, bool),
        old_logp=jnp.zeros(tokens.shape),
        advantages=jnp.zeros(tokens.shape[:1]),
    )
    got = policy.make_logp_fn(MC, temperature=0.7)(params, batch).logp
    np.testing.assert_allclose(np.asarray(got[:, 1:]), np.asarray(want), rtol=1e-5, atol=1e-5)
    plain = policy.make_logp_fn(MC)(params, batch).logp
    np.testing.assert_array_equal(
        np.asarray(plain), np.asarray(policy.make_logp_fn(MC, temperature=1.0)(params, batch).logp)
    )


def test_warm_start_trimmed_to_the_longest_transcript_trains_the_same(monkeypatch):
    """rl.length_bucket in the warm start: each batch cut after its longest transcript (rounded up to the bucket),
    the same nll and weights as at the full transcript length."""
    from reno_jax.loop import build as loop_build
    from reno_jax.loop import warmstart

    widths, trim = [], warmstart.trim_length

    def spy(batch, width):
        widths.append((width, batch.tokens.shape[1]))
        return trim(batch, width)

    monkeypatch.setattr(warmstart, "trim_length", spy)
    out = {}
    for bucket in (0, 5):  # the transcripts use 319 of 333 columns: 5 x 64 = 320 is a width of the ladder
        c = _guess_config()
        c.rollout.max_turns = 5
        c.sft.batch_size = 2
        c.rl.length_bucket = bucket
        tokenizer = loop_build.build_tokenizer(c)
        model_config, params = loop_build.build_model(c, jax.random.PRNGKey(0), tokenizer)
        out[bucket] = warmstart.warm_start(c, model_config, params, tokenizer, jax.random.PRNGKey(1))
    assert len(widths) == 2  # one cut per step, with the bucket only
    assert all(w % 5 == 0 and w <= full for w, full in widths) and any(w < full for w, full in widths)
    np.testing.assert_allclose(out[5].final_nll, out[0].final_nll, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0].params), jax.tree.leaves(out[5].params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_warm_start_from_a_length_sorted_pool(monkeypatch):
    """sft.length_pool: one draw of that many batches, trained as batches of neighbours in length (each cut after
    its own longest transcript), drawn again when the pool is used up; 0 is refused."""
    from reno_jax.loop import build as loop_build
    from reno_jax.loop import warmstart

    pools, widths = [], []
    split, trim = sft.length_sorted_batches, warmstart.trim_length

    def spy_split(transcripts, batch_size, key):
        pools.append(np.asarray(transcripts.valid).sum(axis=1))
        return split(transcripts, batch_size, key)

    def spy_trim(batch, width):
        longest = int(np.asarray(batch.valid).sum(axis=1).max())
        widths.append((width, bucketed_length(longest, batch.tokens.shape[1], 1), longest))  # on the ladder
        return trim(batch, width)

    monkeypatch.setattr(sft, "length_sorted_batches", spy_split)
    monkeypatch.setattr(warmstart, "trim_length", spy_trim)
    c = _guess_config()
    c.rollout.max_turns = 5
    c.sft.batch_size = 2
    c.sft.num_steps = 3
    c.sft.length_pool = 2
    c.rl.length_bucket = 1
    tokenizer = loop_build.build_tokenizer(c)
    model_config, params = loop_build.build_model(c, jax.random.PRNGKey(0), tokenizer)
    result = warmstart.warm_start(c, model_config, params, tokenizer, jax.random.PRNGKey(1))
    assert [len(p) for p in pools] == [4, 4]  # a pool of two batches, drawn again at the third step
    assert all(w == rung for w, rung, _ in widths) and len(widths) == 3
    first = sorted(pools[0])  # the first two steps' batches: the pool's two shorter and two longer transcripts
    assert sorted([widths[0][2], widths[1][2]]) == [first[1], first[3]]
    assert np.isfinite(result.final_nll) and result.teacher
    c.sft.length_pool = 0
    with pytest.raises(errors.ConfigError, match=r"--config\.sft\.length_pool must be an integer >= 1"):
        loop_config.validate_config(c)
    c.sft.length_pool, c.rl.length_bucket = 2, 0
    with pytest.raises(errors.ConfigError, match=r"length_pool=2 needs --config\.rl\.length_bucket > 0"):
        loop_config.validate_config(c)
