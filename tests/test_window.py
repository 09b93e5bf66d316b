"""Tests for bounded history (`RolloutConfig.history`, reno_jax.rollout.rollout): each turn is a row of the system
prompt, the last k exchanges and the environment's current observation, plus the sampled turn.

The fast tests share ONE compiled guess_number rollout (k = 1, B = 2 x 2 episodes, five turns, every call forced)
of the tiny Ling-3.0 of tests/test_rollout.py; the expected rows are rendered on the host by the tokenizer's chat
template from a replay of the same calls through the environment. The slow ones run tic-tac-toe with k = 0 and 2
and train a step on turn samples.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rollout import FAST_COMPILE, _numpy_params

from reno_jax.envs import guess_number as gn
from reno_jax.models import ling3
from reno_jax.protocol import chat
from reno_jax.protocol.tokenizer import load_tokenizer
from reno_jax.rollout import rollout as R

MC = ling3.tiny_test_config(vocab_size=512, num_hidden_layers=2)
M = 16  # a forced guess is 14 tokens with the shipped tokenizer
GN_RC = R.RolloutConfig(group_size=2, max_new_tokens=M, max_turns=5, prefill_chunk=16, history=1)
# Secrets 11 and 3; episode 0 finds 11 on its fourth guess, 1 runs out of guesses, 2 finds 3, 3 guesses wrong once.
GN_SECRETS = [11, 3]
GN_GUESSES = [[8, 12, 10, 11], [16, 1, 5, 9, 13], [8, 4, 2, 3], [3]]


def _decode(tok, ids) -> str:
    return tok.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _forced(tok, calls_per_episode, turns: int):
    forced = np.full((len(calls_per_episode), turns, M), -1, np.int32)
    for b, calls in enumerate(calls_per_episode):
        for t, text in enumerate(calls):
            ids = tok.encode(text, add_special_tokens=False)
            assert len(ids) <= M
            forced[b, t, : len(ids)] = ids
    return jnp.asarray(forced)


def expected_rows(tok, env: R.CompiledEnv, starts, group_size: int, calls_per_episode, k: int):
    """Host replay of every episode through the environment: the chat template's text of each played turn
    sample (system, the last k (assistant call, tool) exchanges, the observation as a user turn, the call)."""
    tenv, spec = env.env, env.env.chat()
    out = []
    for b, calls in enumerate(calls_per_episode):
        state, _ = tenv.reset(jax.tree.map(lambda a: a[b // group_size], starts))
        state = tenv.for_member(state, jnp.int32(b % group_size))
        exchanges, texts = [], []
        for text in calls:
            window = exchanges[len(exchanges) - 2 * k :] if k else []
            user = chat.user_messages(spec, tenv.observation(state))
            texts.append(chat.chat_text(tok, spec, [*user[:1], *window, *user[1:]], True) + text)
            ids = tok.encode(text, add_special_tokens=False)
            call = jax.tree.map(lambda a: a[0], env.parse_batch(jnp.asarray([ids]), jnp.asarray([len(ids)])))
            step = tenv.step(state, call)
            exchanges += [{"role": "assistant", "content": text}, chat.tool_message(spec, step.message)]
            state = step.state
            if bool(step.done):
                break
        out.append(texts)
    return out


def _guess(n: int) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {n}}}}}</tool_call>'


@pytest.fixture(scope="module")
def guess_world():
    tok = load_tokenizer(None)
    env = R.compile_env(gn.GuessNumberEnv(), tok, vocab_size=MC.vocab_size)
    params = _numpy_params(MC)
    starts = gn.Start(secret=jnp.asarray(GN_SECRETS, jnp.int32))
    calls = [[_guess(n) for n in guesses] for guesses in GN_GUESSES]
    forced = _forced(tok, calls, 5)
    fn = jax.jit(functools.partial(R.rollout, model_config=MC, rollout_config=GN_RC), compiler_options=FAST_COMPILE)
    traj = jax.device_get(fn(params, jax.random.key(3), starts, env=env, forced_tokens=forced))
    return dict(tok=tok, env=env, params=params, starts=starts, calls=calls, traj=traj)


def test_turn_samples_hold_system_window_observation_and_the_turn(guess_world):
    tok, traj, env = guess_world["tok"], guess_world["traj"], guess_world["env"]
    want = expected_rows(tok, env, guess_world["starts"], GN_RC.group_size, guess_world["calls"], GN_RC.history)
    turns = 5
    assert traj.tokens.shape == (4 * turns, R.turn_length(env, GN_RC))
    np.testing.assert_array_equal(traj.episode_id, np.repeat(np.arange(4), turns))
    np.testing.assert_array_equal(traj.turn_index, np.tile(np.arange(turns), 4))
    np.testing.assert_array_equal(traj.group_id, np.repeat([0, 0, 1, 1], turns))
    for b, texts in enumerate(want):
        assert int(traj.stats.num_turns[b]) == len(texts)
        for t in range(turns):
            r = b * turns + t
            n = int(traj.valid[r].sum())
            if t >= len(texts):  # the episode ended: a padding row
                assert n == 0 and not traj.loss_mask[r].any() and traj.prompt_length[r] == 0
                assert (traj.turn_id[r] == -1).all()
                continue
            assert traj.valid[r, :n].all() and _decode(tok, traj.tokens[r, :n]) == texts[t], (b, t)
            # the loss covers exactly the sampled (here forced) call, after the turn prompt
            p = int(traj.prompt_length[r])
            np.testing.assert_array_equal(np.flatnonzero(traj.loss_mask[r]), np.arange(p, n))
            assert _decode(tok, traj.tokens[r, p:n]) == guess_world["calls"][b][t]
            assert (traj.turn_id[r, :n] == t).all() and (traj.turn_id[r, n:] == -1).all()
    # The first turn sample is the whole conversation's first turn: the observation of the reset state is its
    # first user message.
    assert "I picked a number" in _decode(tok, traj.tokens[0]) and "It is 9 to 16" in want[0][1]


def test_turn_samples_carry_the_episode_rewards_and_keys(guess_world):
    traj = guess_world["traj"]
    # 11 on the fourth guess: 1 - 3 * 0.125; out of guesses: 0; 3 on the fourth: 0.625; 3 on the first: 1.
    episode_reward = np.array([0.625, 0.0, 0.625, 1.0], np.float32)
    np.testing.assert_allclose(traj.reward, np.repeat(episode_reward, 5))
    np.testing.assert_allclose(traj.turn_reward.sum(1), episode_reward)
    assert traj.turn_reward.shape == traj.turn_key.shape == (4, 5)
    assert (traj.turn_key[0, :4] >= 0).all() and traj.turn_key[0, 4] == -1
    assert traj.turn_key[0, 0] == traj.turn_key[2, 0]  # the same opening state in both groups
    np.testing.assert_array_equal(traj.info["found"], [True, False, True, True])


def test_turn_sample_logp_equals_the_train_forward(guess_world):
    traj = guess_world["traj"]
    logprobs = jax.jit(functools.partial(ling3.token_logprobs, config=MC), compiler_options=FAST_COMPILE)
    ref = np.asarray(logprobs(guess_world["params"], tokens=traj.tokens, valid=traj.valid))
    mask = np.asarray(traj.loss_mask)
    assert mask.sum() > 100
    assert np.abs(ref - np.asarray(traj.behaviour_logp))[mask].max() <= 1e-4
    assert np.all(np.asarray(traj.behaviour_logp)[~mask] == 0)


def turn_samples(episode_reward, turn_reward, turn_key, loss_mask=None) -> R.Trajectory:
    """A turn-sample trajectory of ``[B, T]`` turn rewards and keys with only the fields the advantages read (row
    ``b * T + t`` is episode b's turn t; every row carries its episode's reward)."""
    b, t = np.shape(turn_reward)
    return R.Trajectory(
        tokens=None,
        valid=None,
        loss_mask=loss_mask,
        behaviour_logp=None,
        turn_id=None,
        prompt_length=None,
        reward=jnp.repeat(jnp.asarray(episode_reward, jnp.float32), t),
        group_id=None,
        stats=None,
        env_info=None,
        turn_reward=jnp.asarray(turn_reward, jnp.float32),
        turn_key=jnp.asarray(turn_key, jnp.int32),
        episode_id=jnp.repeat(jnp.arange(b), t),
        turn_index=jnp.tile(jnp.arange(t), b),
    )


def test_turn_sample_advantages_are_the_episodes():
    from reno_jax.rl import learner

    b, t, g = 4, 3, 2
    reward = np.array([1.0, 0.0, 0.5, 0.5], np.float32)
    traj = turn_samples(reward, jnp.zeros((b, t)).at[:, -1].set(reward), jnp.full((b, t), -1, jnp.int32))
    adv = learner.turn_sample_advantages(learner.LearnerConfig(group_size=g), traj)
    np.testing.assert_allclose(adv, np.repeat([1.0, -1.0, 0.0, 0.0], t), atol=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
def test_step_credit_on_turn_samples_is_gigpo_by_hand(normalize):
    """GiGPO (arXiv 2505.10978) on turn samples: A = A_episode + w * A_step, A_step over the group's turns taken
    from the same state key, on the gamma-discounted return from that turn; w = 1, gamma = 0.95, by hand."""
    from reno_jax.rl import learner

    # One group of two episodes, three turns. Episode 0 solves on its third move; episode 1 runs out of moves.
    # Keys: both start in state 5; episode 0's second state (7) is episode 1's third; 8 and 9 are met once.
    turn_reward = np.array([[-0.01, -0.01, 1.0], [-0.01, -0.01, -0.01]], np.float32)
    turn_key = np.array([[5, 7, 9], [5, 8, 7]], np.int32)
    b, t = turn_reward.shape
    traj = turn_samples(turn_reward.sum(1), turn_reward, turn_key)
    # Returns: episode 0: R2 = 1, R1 = -0.01 + 0.95 * 1 = 0.94, R0 = -0.01 + 0.95 * 0.94 = 0.883;
    # episode 1: R2 = -0.01, R1 = -0.0195, R0 = -0.028525. Anchor state 5: 0.883 vs -0.028525 (each
    # +-0.4557625 from the mean); state 7: 0.94 (episode 0, turn 1) vs -0.01 (episode 1, turn 2): +-0.475.
    if normalize:  # every anchor group of two: +-1 after the std; the episodes' rewards 0.98 / -0.03: +-1
        want = [[1 + 1, 1 + 1, 1 + 0], [-1 - 1, -1 + 0, -1 - 1]]
    else:  # Dr. GRPO's centring only: the episodes +-0.505
        want = [[0.505 + 0.4557625, 0.505 + 0.475, 0.505], [-0.505 - 0.4557625, -0.505, -0.505 - 0.475]]
    config = learner.LearnerConfig(
        group_size=b, normalize_adv_std=normalize, turn_advantage_coef=1.0, turn_discount=0.95
    )
    np.testing.assert_allclose(learner.turn_sample_advantages(config, traj), np.ravel(want), atol=1e-5)
    trajectory_only = learner.LearnerConfig(group_size=b, normalize_adv_std=normalize)  # w = 0: GRPO / GSPO's credit
    np.testing.assert_allclose(
        learner.turn_sample_advantages(trajectory_only, traj), np.repeat([want[0][2], want[1][1]], t), atol=1e-5
    )


def _row_batch(traj):
    from reno_jax.rl.batch import TrainBatch

    return TrainBatch(
        tokens=traj.tokens,
        valid=traj.valid,
        loss_mask=traj.loss_mask,
        old_logp=traj.behaviour_logp,
        advantages=jnp.zeros(traj.tokens.shape[:1], jnp.float32),
    )


def test_turn_samples_score_the_same_with_the_system_prompt_encoded_once(guess_world):
    """The common part alone (`shared_prefix`, `share_common_prefix` without `share_prompt_prefix`): every turn
    sample, padding rows among them, continues from one encoding of the system prompt, with the row-wise log-probs."""
    from reno_jax.rl import learner, policy, shared_prefix

    traj = jax.tree.map(jnp.asarray, guess_world["traj"])
    system = int(guess_world["env"].history.system_ids.shape[0])
    common = int(learner.common_prefix_length(traj.tokens, traj.valid))
    assert not np.asarray(traj.valid[:, 0]).all()  # padding rows (turns not reached) hold pad ids
    assert common >= system and int(learner.common_prefix_length(traj.tokens)) == 0
    cut = min(common, int(np.min(np.asarray(traj.prompt_length)[np.asarray(traj.prompt_length) > 0])))
    # soft targets (the warm start's) on the policy tokens: cut with the tokens, scored the same
    weights = jax.random.uniform(jax.random.key(0), traj.tokens.shape + (3,)) * traj.loss_mask[..., None]
    batch = _row_batch(traj).replace(soft_target_ids=jnp.tile(jnp.arange(3, 6), (traj.tokens.shape[0], 1)))
    batch = batch.replace(soft_target_weights=weights)
    split = shared_prefix.split_shared_prefix(batch, cut, cut)
    assert split.prefix_tokens.shape == (batch.num_rows, 0) and split.common_tokens.shape == (batch.num_rows, cut)
    logp_fn = jax.jit(policy.make_logp_fn(MC, with_entropy=False), compiler_options=FAST_COMPILE)
    params = guess_world["params"]
    row_wise, shared = np.asarray(logp_fn(params, batch).logp), np.asarray(logp_fn(params, split).logp)
    mask = np.asarray(traj.loss_mask)[:, cut:]
    assert mask.sum() > 100
    np.testing.assert_allclose(shared[mask], row_wise[:, cut:][mask], atol=1e-4)


def test_history_config_checks():
    with pytest.raises(ValueError, match="history"):
        R.RolloutConfig(history=-1)
    with pytest.raises(ValueError, match="turn_length"):
        R.RolloutConfig(history=1, turn_length=-1)


def test_host_rollout_with_bounded_history_refuses_resend_history():
    from reno_jax.rollout import host_rollout  # its bounded history: tests/test_host_rollout.py

    with pytest.raises(ValueError, match="resend_history"):
        host_rollout.make_host_programs(MC, R.RolloutConfig(history=1), host_rollout.HostConfig(resend_history=True))


def test_an_environment_without_observation_says_so():
    from reno_jax.envs import interface

    class NoObservation(interface.TextEnv):
        def chat(self):
            return gn.CHAT

        def reset(self, start):
            return start, None

        def step(self, state, call):
            return None

    with pytest.raises(NotImplementedError, match="bounded history"):
        NoObservation().observation(None)


# ---------------------------------------------------------------------------------------------- slow: tic-tac-toe


@pytest.mark.parametrize("k", [0, 2])
def test_tictactoe_turn_samples_match_the_chat_template(k):
    from reno_jax.envs.tictactoe import env as E
    from reno_jax.envs.tictactoe import rules as ttt

    tok = load_tokenizer(None)
    env = R.compile_env(E.TicTacToeEnv.create("game"), tok, vocab_size=MC.vocab_size)
    rc = R.RolloutConfig(group_size=1, max_new_tokens=10, max_turns=4, prefill_chunk=16, history=k)
    starts = E.game_starts(jax.random.key(5), 2, agent_player=jnp.array([1, 2]), opponent="minimax")
    # Each episode plays the first empty square its replay reaches (legal all game long).
    calls = []
    for b in range(2):
        state, _ = env.env.reset(jax.tree.map(lambda a: a[b], starts))
        texts = []
        for _ in range(4):
            square = int(np.flatnonzero(np.asarray(state.game.board) == 0)[0]) + 1
            texts.append(f'<tool_call>{{"name": "choose_square", "arguments": {{"square": {square}}}}}</tool_call>')
            ids = tok.encode(texts[-1], add_special_tokens=False)
            call = jax.tree.map(lambda a: a[0], env.parse_batch(jnp.asarray([ids]), jnp.asarray([len(ids)])))
            step = env.env.step(state, call)
            state = step.state
            if bool(step.done):
                break
        calls.append(texts)
    assert ttt.NUM_SQUARES == 9 and max(len(c) for c in calls) >= 3
    forced = np.full((2, 4, 10), -1, np.int32)
    for b, texts in enumerate(calls):
        for t, text in enumerate(texts):
            ids = tok.encode(text, add_special_tokens=False)
            forced[b, t, : len(ids)] = ids
    fn = jax.jit(functools.partial(R.rollout, model_config=MC, rollout_config=rc), compiler_options=FAST_COMPILE)
    traj = jax.device_get(fn(_numpy_params(MC), jax.random.key(1), starts, env=env, forced_tokens=jnp.asarray(forced)))
    want = expected_rows(tok, env, starts, 1, calls, k)
    for b, texts in enumerate(want):
        for t, text in enumerate(texts):
            r = b * 4 + t
            assert _decode(tok, traj.tokens[r, : int(traj.valid[r].sum())]) == text, (k, b, t)
    if k == 0:  # the observation alone: every turn sample is short
        assert traj.tokens.shape[1] == env.prompt_len + 10


def test_a_train_step_runs_on_turn_samples(guess_world):
    import optax

    from reno_jax.rl import learner, losses, policy, trainer

    traj = guess_world["traj"]
    optimizer = optax.adam(1e-3)
    lrn = learner.Learner(
        learner.LearnerConfig(group_size=GN_RC.group_size),
        policy.make_logp_fn(MC),
        losses.get_loss("gspo"),
        optimizer,
        num_groups=2,
        donate=False,  # the module's params stay usable by the other tests
    )
    state = trainer.create_train_state(guess_world["params"], optimizer, jax.random.key(0))
    state, metrics = lrn.learner_step(state, jax.tree.map(jnp.asarray, traj))
    metrics = jax.device_get(metrics)
    assert np.isfinite(metrics["train/loss"]) and metrics["train/rollout_logp_abs_diff_mean"] < 1e-4
    assert int(state.step) == 1


def test_turn_samples_record_their_own_routing(guess_world):
    rc = R.RolloutConfig(group_size=2, max_new_tokens=M, max_turns=5, prefill_chunk=16, history=2, record_routing=True)
    fn = jax.jit(functools.partial(R.rollout, model_config=MC, rollout_config=rc), compiler_options=FAST_COMPILE)
    forced = _forced(guess_world["tok"], guess_world["calls"], 5)
    traj = jax.device_get(
        fn(
            guess_world["params"],
            jax.random.key(3),
            guess_world["starts"],
            env=guess_world["env"],
            forced_tokens=forced,
        )
    )
    routing, valid = np.asarray(traj.routing), np.asarray(traj.valid)
    assert routing.shape[:2] == traj.tokens.shape
    assert (routing[valid] >= 0).all() and (routing[~valid] == -1).all()  # every fed token, nothing else


def test_a_train_step_on_turn_samples_sharing_the_system_prompt_equals_the_row_wise_one(guess_world):
    """`Learner` with `share_common_prefix` alone on turn samples: the same loss and the same update (SGD, so the
    update is the gradient) as scoring every row whole."""
    import optax

    from reno_jax.rl import learner, losses, policy, trainer

    traj = jax.tree.map(jnp.asarray, guess_world["traj"])
    traj = traj.replace(reward=traj.reward + 0.25 * (traj.episode_id % 2))  # rewards that differ in each group
    optimizer = optax.sgd(1.0)
    results = []
    for share in (False, True):
        lrn = learner.Learner(
            learner.LearnerConfig(group_size=GN_RC.group_size, share_common_prefix=share),
            policy.make_logp_fn(MC, group_size=GN_RC.group_size),
            losses.get_loss("gspo"),
            optimizer,
            num_groups=2,
            donate=False,
        )
        state = trainer.create_train_state(guess_world["params"], optimizer, jax.random.key(0))
        new, metrics = lrn.learner_step(state, traj)
        results.append(
            (jax.device_get(metrics), jax.tree.map(lambda a, b: np.asarray(a - b), new.params, state.params))
        )
        if share:
            assert lrn.common_len >= int(guess_world["env"].history.system_ids.shape[0])
    (m_row, d_row), (m_shared, d_shared) = results
    np.testing.assert_allclose(m_shared["train/loss"], m_row["train/loss"], rtol=1e-4, atol=1e-6)
    assert np.abs(m_row["train/loss"]) > 0
    for a, b in zip(jax.tree.leaves(d_shared), jax.tree.leaves(d_row)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-6)


def _guess_teacher_transcripts(guess_world, soft_targets=False):
    """guess_number's warm-start teacher on the fixture's starts (four episodes), written as turn samples."""
    from reno_jax.rl import sft

    tok, env = guess_world["tok"], guess_world["env"]
    teacher = env.env.teacher()
    schemas = env.env.chat().tools
    calls = sft.build_call_table(
        tok, teacher.calls, int(env.chat.turn_end_id), env.pad_id, [t["function"]["name"] for t in schemas], schemas
    )
    starts = jax.tree.map(lambda a: jnp.repeat(a, GN_RC.group_size, axis=0), guess_world["starts"])
    out = sft.window_transcripts(
        jax.random.key(4), starts, env, teacher.policy, calls, rollout_config=GN_RC, soft_targets=soft_targets
    )
    return jax.device_get(out)


def _played_calls(tok, out, turns: int):
    """Each episode's calls (texts), read from the transcripts' loss-masked tokens."""
    calls = []
    for b in range(out.tokens.shape[0] // turns):
        rows = [b * turns + t for t in range(turns) if out.loss_mask[b * turns + t].any()]
        calls.append([_decode(tok, out.tokens[r][out.loss_mask[r]]) for r in rows])
    return calls


def test_the_warm_start_writes_the_teachers_turn_samples_as_the_rollout_does(guess_world):
    """`sft.window_transcripts`: the teacher's episodes cut into turn samples, each the chat template's system +
    last k exchanges + observation + the teacher's call (loss on the call only), as the bounded rollout builds
    them (the fast tests above check the rollout against the same rendering)."""
    tok, env = guess_world["tok"], guess_world["env"]
    turns = 5
    out = _guess_teacher_transcripts(guess_world)
    assert out.tokens.shape == (4 * turns, R.turn_length(env, GN_RC))
    calls = _played_calls(tok, out, turns)
    assert max(len(c) for c in calls) >= 3 and all(c for c in calls)
    want = expected_rows(tok, env, guess_world["starts"], GN_RC.group_size, calls, GN_RC.history)
    for b, texts in enumerate(want):
        assert len(texts) == len(calls[b])
        for t in range(turns):
            r = b * turns + t
            n = int(out.valid[r].sum())
            if t >= len(texts):
                assert n == 0 and not out.loss_mask[r].any()
                continue
            assert _decode(tok, out.tokens[r, :n]) == texts[t], (b, t)
            masked = np.flatnonzero(out.loss_mask[r])
            np.testing.assert_array_equal(masked, np.arange(n - len(masked), n))  # the call ends the row
            assert _decode(tok, out.tokens[r, masked]) == calls[b][t]
    np.testing.assert_array_equal(np.asarray(out.info["found"]).shape, (4,))


def test_the_teachers_turn_samples_equal_the_forced_bounded_rollout_id_for_id(guess_world):
    """The same calls forced through the bounded rollout give the same rows, token for token and loss mask."""
    tok, env = guess_world["tok"], guess_world["env"]
    turns = 5
    out = _guess_teacher_transcripts(guess_world, soft_targets=True)
    calls = _played_calls(tok, out, turns)
    starts = guess_world["starts"]
    fn = jax.jit(functools.partial(R.rollout, model_config=MC, rollout_config=GN_RC), compiler_options=FAST_COMPILE)
    traj = jax.device_get(
        fn(guess_world["params"], jax.random.key(3), starts, env=env, forced_tokens=_forced(tok, calls, turns))
    )
    np.testing.assert_array_equal(out.tokens, traj.tokens)
    np.testing.assert_array_equal(out.valid, traj.valid)
    np.testing.assert_array_equal(out.loss_mask, traj.loss_mask)
    # soft targets sit on the calls' tokens only
    assert np.all(np.asarray(out.target_weights).sum(-1)[~np.asarray(out.loss_mask)] == 0)


def test_episode_turn_weight_makes_every_episode_weigh_the_same():
    """`turn_weight="episode"`: a turn sample's advantage times the batch's mean turns per episode over its
    episode's turns, so a group's advantages sum to zero over its real turn samples again (with "turn" the long
    failed episode outweighs the short solved one)."""
    from reno_jax.rl import learner

    # One group of two episodes, up to four turns: episode 0 solves in 1 move, episode 1 fails after 4.
    b, t, width = 2, 4, 3
    turns = np.array([1, 4])
    loss_mask = np.zeros((b, t, width), bool)
    for i, n in enumerate(turns):
        loss_mask[i, :n, 1] = True
    reward = np.array([1.0, -0.04], np.float32)
    traj = turn_samples(
        reward,
        jnp.zeros((b, t)),
        jnp.full((b, t), -1, jnp.int32),
        loss_mask=jnp.asarray(loss_mask.reshape(b * t, width)),
    )
    real = loss_mask.any(-1).reshape(-1)
    per_turn = np.asarray(learner.turn_sample_advantages(learner.LearnerConfig(group_size=b), traj))
    np.testing.assert_allclose(per_turn, np.repeat([1.0, -1.0], t), atol=1e-6)
    assert per_turn[real].sum() == pytest.approx(-3.0)  # the failed episode's four turns outweigh the solved one
    config = learner.LearnerConfig(group_size=b, turn_weight="episode")
    per_episode = np.asarray(learner.turn_sample_advantages(config, traj))
    np.testing.assert_allclose(per_episode, np.repeat([2.5 / 1, -2.5 / 4], t), atol=1e-6)  # mean turns 2.5
    assert per_episode[real].sum() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="turn_weight must be one of"):
        learner.LearnerConfig(group_size=b, turn_weight="token")
    whole_rows = traj.replace(episode_id=None, turn_index=None)  # whole conversations: one row per episode already
    with pytest.raises(ValueError, match="applies to turn samples only"):
        learner.make_prepare_batch(config)(whole_rows, 0)
