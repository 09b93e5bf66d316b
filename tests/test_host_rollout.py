"""Tests for host environments (reno_jax.envs.host) and their rollout (reno_jax.rollout.host_rollout).

One tiny 2-layer Ling-3.0 (vocabulary of the shipped tokenizer) and ONE `HostPrograms` (B = 4 rows, 3 turns of at
most 16 tokens, L fixed by `max_length`) serve every rollout here, so the jitted pieces compile once for the file.
"""

import dataclasses
import functools
import time

import jax
import numpy as np
import pytest
from test_rollout import FAST_COMPILE, MC, _numpy_params

from reno_jax.envs import guess_number as gn
from reno_jax.envs import guess_number_host as gh
from reno_jax.envs import host
from reno_jax.errors import ConfigError
from reno_jax.models import ling3
from reno_jax.protocol import chat as chat_lib
from reno_jax.protocol.tokenizer import decode as decode_text
from reno_jax.protocol.tokenizer import load_tokenizer
from reno_jax.rollout import host_rollout as H
from reno_jax.rollout import rollout as R

B, M, TURNS = 4, 16, 3
RC = R.RolloutConfig(group_size=2, max_new_tokens=M, max_turns=TURNS, max_length=240, prefill_chunk=16)
HC = H.HostConfig(max_prompt_tokens=32, max_response_tokens=24, tool_timeout_s=0.5)


def _call_text(number) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {number}}}}}</tool_call>'


class EchoEnv(host.HostEnv):
    """Answers every turn, call or not, with the turn's own text; never done (episodes end truncated)."""

    name = "echo"
    system_prompt = "Say anything."
    tools = gn.CHAT.tools
    max_turns = TURNS
    truncation_reward = 0.25

    def reset(self, task) -> str:
        return f"Task {task}."

    def step(self, call):
        return host.HostStep(f"You called {call.name}.", 0.5, False)

    def invalid_call(self, call):
        return host.HostStep(f"You said: {call.text}", 0.5, False)


class FaultEnv(EchoEnv):
    """Task "ok" echoes; "raise" raises; "slow" sleeps past the timeout; "long" answers with 200 words."""

    name = "fault"
    tool_error_reward = -2.0

    def reset(self, task) -> str:
        self.task = task
        return "Go."

    def invalid_call(self, call):
        if self.task == "raise":
            raise RuntimeError("the sandbox fell over")
        if self.task == "slow":
            time.sleep(2.0)
        if self.task == "long":
            return host.HostStep(" ".join(["word"] * 200), 0.5, False)
        return super().invalid_call(call)


class WrongTypeEnv(EchoEnv):
    name = "wrong_type"

    def invalid_call(self, call):
        return ["not", "a", "step"]


@pytest.fixture(scope="module")
def world():
    tok = load_tokenizer(None)
    params = _numpy_params(MC)
    programs = H.make_host_programs(MC, RC, HC, compiler_options=FAST_COMPILE)
    keys = jax.random.split(jax.random.key(3), B)
    return dict(
        tok=tok,
        params=params,
        programs=programs,
        keys=keys,
        echo=H.compile_host_chat(EchoEnv, tok, MC.vocab_size),
        guess=H.compile_host_chat(gh.GuessNumberHostEnv, tok, MC.vocab_size),
    )


def _run(world, env_class, tasks, chat="echo", forced=None):
    envs = [env_class() for _ in tasks]
    traj = H.host_rollout(
        world["params"],
        world["keys"],
        envs,
        list(tasks),
        chat=world[chat],
        programs=world["programs"],
        forced_tokens=forced,
    )
    return jax.device_get(traj), envs


def _non_canonical(tok) -> tuple[str, list[int]]:
    """A word and ids that decode to it but are not how the tokenizer encodes it (first char, then the rest)."""
    encode = functools.partial(tok.encode, add_special_tokens=False)
    for word in ("Square", "number", "guess", "secret", "format"):
        split = encode(word[0]) + encode(word[1:])
        if split != encode(word):
            return word, split
    raise AssertionError("no word splits non-canonically")


@pytest.fixture(scope="module")
def echo_run(world):
    """Echo episodes whose first turn is forced to a non-canonical tokenisation, the rest sampled."""
    word, ids = _non_canonical(world["tok"])
    forced = np.full((B, TURNS, M), -1, np.int32)
    forced[:, 0, : len(ids)] = ids
    traj, envs = _run(world, EchoEnv, ["a", "a", "b", "b"], forced=forced)
    return dict(traj=traj, word=word, ids=ids)


# ---------------------------------------------------------------------------------------------- host env


def test_parse_call():
    tools = gn.CHAT.tools
    ok = host.parse_call(tools, "think " + _call_text(3) + "<|im_end|>")
    assert ok == host.ToolCall("guess", {"number": 3})
    assert host.parse_call(
        tools, '<tool_call>{"name": "guess", "arguments": {"number": "x"}}</tool_call>'
    ) == host.ToolCall("guess", {"number": "x"})  # free strings reach the environment
    for text, kind in [
        ("no call", host.KIND_NO_CALL),
        ("<tool_call>{", host.KIND_NO_CALL),
        ("<tool_call>{]</tool_call>", host.KIND_BAD_CALL),
        ('<tool_call>{"name": "fly", "arguments": {}}</tool_call>', host.KIND_BAD_CALL),
        ('<tool_call>{"name": "guess", "arguments": {}}</tool_call>', host.KIND_BAD_CALL),
        ('<tool_call>{"name": "guess"}</tool_call>', host.KIND_BAD_CALL),
    ]:
        call = host.parse_call(tools, text)
        assert isinstance(call, host.InvalidCall) and call.kind == kind, text


def test_type_checks_name_the_env():
    env = WrongTypeEnv()
    with pytest.raises(TypeError, match=r"WrongTypeEnv \(name 'wrong_type'\)\.invalid_call.*got list"):
        host.checked_step(env, "invalid_call", env.invalid_call(None))
    with pytest.raises(TypeError, match=r"EchoEnv.*step returned a reward of type str"):
        host.checked_step(EchoEnv(), "step", ("text", "1.0", False))
    with pytest.raises(TypeError, match=r"EchoEnv.*step returned done of type int"):
        host.checked_step(EchoEnv(), "step", ("text", 1.0, 1))

    class IntReset(EchoEnv):
        def reset(self, task):
            return 7

    with pytest.raises(TypeError, match=r"IntReset.*reset must return .* str, got int"):
        host.checked_reset(IntReset(), None)


def test_guess_number_host_speaks_like_the_jitted_env():
    env = gh.GuessNumberHostEnv()
    assert env.reset(11) == chat_lib.resolve(gn.CHAT.user[0], [0, 0, 0])
    expected = [
        (8, "8 is too low. It is 9 to 16.", 0.0, False),
        (12, "12 is too high. It is 9 to 11.", 0.0, False),
        (11, "11 is right!", gn.FOUND_REWARD - 2 * gn.GUESS_COST, True),
    ]
    for guess, text, reward, done in expected:
        assert env.step(host.ToolCall("guess", {"number": guess})) == (text, reward, done)
    assert env.episode_info(False) == {"found": True, "invalid": False, "guesses": 3, "wasted": 0}
    env.reset(3)
    assert env.step(host.ToolCall("guess", {"number": 17})) == ("Invalid call.", gn.INVALID_REWARD, True)
    assert host.host_entry("guess_number_host").env_class is gh.GuessNumberHostEnv
    envs, tasks = host.sample_episodes(gh.GuessNumberHostEnv, 0, num_groups=3, group_size=2)
    assert len(envs) == 6 and tasks[0] == tasks[1] and all(1 <= t <= gn.MAX_NUMBER for t in tasks)
    assert host.sample_episodes(gh.GuessNumberHostEnv, 0, 3, 2)[1] == tasks


class OptionEnv(EchoEnv):
    """Two options: the number of digits and a word."""

    name = "option_env"
    options = ("digits", "word", "scale")
    digits = 5
    word = "hi"
    scale = 1.0

    @classmethod
    def sample_task(cls, rng):
        return int(rng.integers(10**cls.digits))


def test_options_configure_a_subclass_and_errors_name_the_flag():
    seven = host.configured(OptionEnv, {"digits": 7, "scale": 2})
    assert issubclass(seven, OptionEnv) and seven.digits == 7 and seven.scale == 2.0 and OptionEnv.digits == 5
    assert seven().digits == 7 and seven.name == "option_env" and host.configured(OptionEnv, {}) is OptionEnv
    assert seven.eval_tasks(3) == seven.eval_tasks(3) and len(seven.eval_tasks(3)) == 3  # fixed suite (EVAL_SEED)
    with pytest.raises(ConfigError, match=r"^--config.env.colour: unknown option of environment 'option_env' "):
        host.configured(OptionEnv, {"colour": 1})
    with pytest.raises(ConfigError, match=r"^--config.env.digits must be int, got str"):
        host.configured(OptionEnv, {"digits": "7"})
    with pytest.raises(ConfigError, match=r"^--config.env.digits must be int, got bool"):
        host.configured(OptionEnv, {"digits": True})
    with pytest.raises(NotImplementedError, match=r"OptionEnv \(name 'option_env'\) has no teacher"):
        OptionEnv().teacher(np.random.default_rng(0))


def test_guess_number_host_teachers():
    """ "binary" finds every secret by binary search (3.375 guesses on average); "uniform" stays in the range."""
    rng, guesses = np.random.default_rng(0), []
    for env_class in (gh.GuessNumberHostEnv, host.configured(gh.GuessNumberHostEnv, {"teacher_strategy": "uniform"})):
        for secret in gh.GuessNumberHostEnv.eval_tasks(gn.MAX_NUMBER):
            env = env_class()
            env.reset(secret)
            done = False
            while not done:
                call = env.teacher(rng)
                assert env.low <= call.arguments["number"] <= env.high
                _, reward, done = env.step(call)
            assert env.found or env_class.teacher_strategy == "uniform"
            guesses.append(env.guesses)
    assert np.mean(guesses[: gn.MAX_NUMBER]) == 3.375
    assert gh.GuessNumberHostEnv.eval_tasks(17) == [*range(1, 17), 1]


# ---------------------------------------------------------------------------------------------- rollout


def test_token_in_token_out(world, echo_run):
    """The trajectory holds exactly the fed ids: prompt pieces, the sampled (here forced, non-canonical) ids and the
    fixed-rendered responses; decoding the conversation and encoding it again gives other ids.

    The shipped tokenizer isolates newlines and special tokens, so an environment's text next to the template's
    fixed pieces tokenises as it would in the whole conversation; what re-tokenises differently is the policy's
    turn (a word sampled as two tokens), which the echo environment then also says back as text."""
    traj, chat, tok = echo_run["traj"], world["echo"], world["tok"]
    for b in range(B):
        n = int(traj.valid[b].sum())
        ids = traj.tokens[b, :n].tolist()
        turns = traj.turn_id[b, :n]
        gen = traj.loss_mask[b, :n]
        want = chat.prompt_ids(f"Task {'aabb'[b]}.")
        assert ids[: len(want)] == want and traj.prompt_length[b] == len(want)
        for k in range(int(traj.stats.num_turns[b])):
            sampled = [i for i, t, g in zip(ids, turns, gen) if t == k and g]
            if k == 0:
                assert sampled[: len(echo_run["ids"])] == echo_run["ids"]
            want += sampled
            if k + 1 < int(traj.stats.num_turns[b]):
                response = chat.encode("You said: " + decode_text(tok, sampled))[: HC.max_response_tokens]
                want += chat.response_ids(response, add_turn_end=sampled[-1] != chat.env.chat.turn_end_id)
        assert ids == want
        assert tok.encode(decode_text(tok, ids), add_special_tokens=False) != ids


def test_behaviour_logp_equals_the_train_forward(world, echo_run):
    traj = echo_run["traj"]
    logprobs = jax.jit(functools.partial(ling3.token_logprobs, config=MC), compiler_options=FAST_COMPILE)
    ref = np.asarray(logprobs(world["params"], tokens=traj.tokens, valid=traj.valid))
    mask = np.asarray(traj.loss_mask)
    np.testing.assert_allclose(ref[mask], traj.behaviour_logp[mask], atol=1e-5)
    assert np.all(traj.behaviour_logp[~mask] == 0) and mask.sum() > 3 * B


def test_masks_turns_and_rewards(echo_run):
    traj = echo_run["traj"]
    info = traj.info
    np.testing.assert_array_equal(traj.loss_mask.sum(1), info["generated_tokens"])
    np.testing.assert_array_equal(traj.group_id, [0, 0, 1, 1])
    np.testing.assert_allclose(traj.turn_reward.sum(1), traj.reward)
    assert np.all(traj.turn_key == -1) and traj.routing is None
    for b in range(B):
        n = int(traj.valid[b].sum())
        assert traj.valid[b, :n].all() and not traj.valid[b, n:].any()
        tid = traj.turn_id[b]
        assert (tid[:n] >= 0).all() and (tid[n:] == -1).all() and (np.diff(tid[:n]) >= 0).all()
        assert not traj.loss_mask[b, : traj.prompt_length[b]].any()
        for k in range(info["num_turns"][b]):  # each turn's sampled ids: one run at the end of its segment
            pos = np.flatnonzero(traj.loss_mask[b] & (tid == k))
            assert len(pos) > 0 and np.all(np.diff(pos) == 1)
            assert pos[-1] == np.flatnonzero(tid == k)[-1]
    # Echo never ends: every episode is truncated (out of turns or out of L) with the env's truncation reward.
    assert info["truncated"].all() and np.all(traj.reward == EchoEnv.truncation_reward)


def test_faults_hit_only_their_episode(world):
    traj, _ = _run(world, FaultEnv, ["ok", "raise", "slow", "long"])
    reference, _ = _run(world, FaultEnv, ["ok", "ok", "ok", "ok"])
    info = traj.info
    np.testing.assert_array_equal(info["tool_errors"], [0, 1, 0, 0])
    np.testing.assert_array_equal(info["tool_timeouts"], [0, 0, 1, 0])
    assert traj.reward[1] == traj.reward[2] == FaultEnv.tool_error_reward
    assert info["num_turns"][1] == info["num_turns"][2] == 1 and not info["truncated"][1:3].any()
    assert info["responses_cut"][3] >= 1 and info["responses_cut"][1] == info["responses_cut"][2] == 0
    # The long response was fed cut to its budget: the turn-1 segment before its sampled ids.
    resp = (traj.turn_id[3] == 1) & ~traj.loss_mask[3]
    chat = world["echo"]
    fixed = len(chat.tool_prefix) + len(chat.tool_suffix)
    assert resp.sum() - fixed in (HC.max_response_tokens, HC.max_response_tokens + 1)  # + the turn end if added
    # The healthy row is the one it is when every row is healthy (rows are independent).
    np.testing.assert_array_equal(traj.tokens[0], reference.tokens[0])
    np.testing.assert_array_equal(traj.behaviour_logp[0], reference.behaviour_logp[0])


def test_wrong_type_fails_at_once(world):
    with pytest.raises(TypeError, match=r"WrongTypeEnv \(name 'wrong_type'\)\.invalid_call"):
        _run(world, WrongTypeEnv, ["a"] * B)


def test_guess_number_calls_and_invalid_calls(world):
    tok = world["tok"]
    forced = np.full((B, TURNS, M), -1, np.int32)
    plays = {0: [8, 12, 10], 1: [8, 4], 2: ["'x'"], 3: []}  # secret 10 / 10 / anything / sampled
    for b, guesses in plays.items():
        for k, g in enumerate(guesses):
            ids = tok.encode(_call_text(g), add_special_tokens=False)
            assert len(ids) <= M
            forced[b, k, : len(ids)] = ids
    traj, envs = _run(world, gh.GuessNumberHostEnv, [10, 10, 3, 3], chat="guess", forced=forced)
    info = traj.info
    assert info["found"][0] and traj.reward[0] == gn.FOUND_REWARD - 2 * gn.GUESS_COST
    assert info["valid_call"][0] and info["parse_kind"][0] == host.KIND_OK
    # Row 1 runs out of turns (3 < 5 guesses) after a sampled third turn unless that turn was invalid.
    assert info["truncated"][1] or traj.reward[1] == gn.INVALID_REWARD
    assert traj.reward[2] == gn.INVALID_REWARD and info["invalid"][2] and info["num_turns"][2] == 1
    assert traj.reward[3] == gn.INVALID_REWARD and info["parse_kind"][3] != host.KIND_OK  # a random model's turn
    text = decode_text(tok, traj.tokens[0][traj.valid[0]])
    assert "8 is too low. It is 9 to 16." in text and "12 is too high. It is 9 to 11." in text
    assert text.endswith(_call_text(10))


def test_caches_donated_and_compiled_once(world, echo_run):
    programs = world["programs"]
    traces = dict(programs.traces)
    _run(world, EchoEnv, ["c"] * B)
    # Several turns and calls, one trace each: prefill for the B / G shared prompts and for the B rows' responses.
    assert programs.traces == traces == {"prefill": 2, "decode": 1, "share": 1}
    cache = jax.tree.map(lambda a: a.copy(), ling3.init_cache(MC, B, RC.max_length))
    last = jax.numpy.zeros((B, MC.vocab_size))
    width = -(-RC.max_length // RC.prefill_chunk) * RC.prefill_chunk
    ids, n = jax.numpy.zeros((B, width), jax.numpy.int32), jax.numpy.full((B,), 3, jax.numpy.int32)
    new_cache, new_last = programs.prefill(world["params"], cache, last, ids, n)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves((cache, last)))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((new_cache, new_last)))
    live = jax.numpy.ones((B,), bool)
    forced = jax.numpy.full((B, M), -1, jax.numpy.int32)
    out = programs.decode(world["params"], new_cache, new_last, world["keys"], live, forced, world["echo"].env)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves((new_cache, new_last)))
    assert np.all(np.asarray(out[0]["length"]) - 3 == np.asarray(out[4]))  # new tokens counted


def test_guess_number_host_equals_the_jitted_env(world):
    """Same keys, same forced calls: the host environment's trajectory is the jitted environment's, id for id
    (the texts render to the same ids, and rows sample with the same per-row keys)."""
    tok, forced = world["tok"], np.full((B, TURNS, M), -1, np.int32)
    for b, guesses in {0: [8, 12, 10], 1: [8], 2: [3, 5], 3: []}.items():
        for k, g in enumerate(guesses):
            ids = tok.encode(_call_text(g), add_special_tokens=False)
            forced[b, k, : len(ids)] = ids
    host_traj, _ = _run(world, gh.GuessNumberHostEnv, [10, 10, 6, 6], chat="guess", forced=forced)
    env = R.compile_env(gn.GuessNumberEnv(), tok, vocab_size=MC.vocab_size)
    rc = dataclasses.replace(RC, share_prompt_prefill=False)  # the host path feeds every row's prompt
    rollout = jax.jit(functools.partial(R.rollout, model_config=MC, rollout_config=rc), compiler_options=FAST_COMPILE)
    starts = gn.Start(secret=np.asarray([10, 6], np.int32))
    jit_traj = jax.device_get(rollout(world["params"], world["keys"], starts, env=env, forced_tokens=forced))
    for name in ("tokens", "valid", "loss_mask", "turn_id", "prompt_length", "reward", "turn_reward", "group_id"):
        np.testing.assert_array_equal(getattr(host_traj, name), getattr(jit_traj, name), err_msg=name)
    np.testing.assert_allclose(host_traj.behaviour_logp, jit_traj.behaviour_logp, atol=1e-6)
    for name in ("found", "invalid", "guesses", "wasted", "num_turns", "generated_tokens", "truncated"):
        np.testing.assert_array_equal(host_traj.info[name], jit_traj.info[name], err_msg=name)
    assert host_traj.info["found"][0] and host_traj.info["num_turns"].sum() >= 2 * B


def test_resend_history_plays_the_same_episodes(world, echo_run):
    """`resend_history` (the peers' way: every turn's history prefilled into fresh caches) feeds the same ids through
    the same compiled programs: the same trajectory, the log-probs to float rounding."""
    programs = world["programs"]
    traces = dict(programs.traces)
    resend = dict(
        world, programs=dataclasses.replace(programs, host_config=dataclasses.replace(HC, resend_history=True))
    )
    forced = np.full((B, TURNS, M), -1, np.int32)
    forced[:, 0, : len(echo_run["ids"])] = echo_run["ids"]
    traj, _ = _run(resend, EchoEnv, ["a", "a", "b", "b"], forced=forced)
    ref = echo_run["traj"]
    for name in ("tokens", "valid", "loss_mask", "turn_id", "prompt_length", "reward", "turn_reward"):
        np.testing.assert_array_equal(getattr(traj, name), getattr(ref, name), err_msg=name)
    np.testing.assert_allclose(traj.behaviour_logp, ref.behaviour_logp, atol=1e-5)
    assert ref.info["num_turns"].min() >= 2 and programs.traces == traces  # several turns resent, nothing recompiled


def test_warm_start_transcripts_are_the_host_rollouts_ids(world):
    """The host warm start's teacher conversations (`host_warmstart.play_teacher`) hold exactly the ids a host
    rollout forced to the same calls holds; their loss covers the calls (and each call's turn end, which the
    rollout writes itself when the turn stops at the completed "</tool_call>")."""
    from reno_jax.loop import host_warmstart

    chat, rng = world["guess"], np.random.default_rng(0)
    tasks = [10, 10, 3, 16]
    episodes = [
        host_warmstart.play_teacher(
            gh.GuessNumberHostEnv, t, rng, chat, turns=TURNS, length=240, max_new_tokens=M, cut=HC.max_response_tokens
        )
        for t in tasks
    ]
    forced = np.full((B, TURNS, M), -1, np.int32)
    end = len(chat.turn_end)
    for b, ep in enumerate(episodes):
        ids, loss = np.asarray(ep.ids), np.asarray(ep.loss)
        starts = np.flatnonzero(loss & ~np.r_[False, loss[:-1]])  # each call's first id
        for turn, s in enumerate(starts):
            n = int(np.argmax(~loss[s:])) if not loss[s:].all() else len(loss) - s
            forced[b, turn, : n - end] = ids[s : s + n - end]
    traj, envs = _run(world, gh.GuessNumberHostEnv, tasks, chat="guess", forced=forced)
    turn_end_ids = np.isin(traj.tokens, chat.turn_end)
    for b, ep in enumerate(episodes):
        n = int(traj.valid[b].sum())
        ids, loss = np.asarray(ep.ids), np.asarray(ep.loss)
        np.testing.assert_array_equal(traj.tokens[b, :n], ids[:n])
        assert list(ids[n:]) in ([], list(chat.turn_end))  # the last call's turn end, never sampled by the rollout
        np.testing.assert_array_equal(traj.loss_mask[b, :n], loss[:n] & ~turn_end_ids[b, :n])
        assert float(traj.reward[b]) == ep.reward and envs[b].episode_info(False) == ep.info
    assert episodes[0].info["found"] and episodes[0].info["guesses"] == 3  # 8, 12, 10: cut by TURNS = 3 otherwise
    with pytest.raises(TypeError, match=r"NoCallTeacher \(name 'guess_number_host'\)\.teacher must return"):

        class NoCallTeacher(gh.GuessNumberHostEnv):
            def teacher(self, rng):
                return 8

        host_warmstart.play_teacher(NoCallTeacher, 3, rng, chat, turns=1, length=240, max_new_tokens=M, cut=8)


# ---------------------------------------------------------------------------------------------- bounded history

# Bounded history with k = 1 on the compiled pieces of `world` (the turn sample's length is their L = 240, so no
# shape changes: only the one-row system prefill and its copy compile anew). Secrets 11, 11, 3, 3: episode 0 finds
# 11 on its fourth guess, 1 runs out of guesses, 2 finds 3 on its fourth, 3 on its first.
HISTORY_TURNS = 5
HISTORY_RC = dataclasses.replace(RC, max_turns=HISTORY_TURNS, history=1, turn_length=RC.max_length)
HISTORY_GUESSES = [[8, 12, 10, 11], [16, 1, 5, 9, 13], [8, 4, 2, 3], [3]]


@pytest.fixture(scope="module")
def history_run(world):
    programs = dataclasses.replace(world["programs"], rollout_config=HISTORY_RC)
    forced = np.full((B, HISTORY_TURNS, M), -1, np.int32)
    for b, guesses in enumerate(HISTORY_GUESSES):
        for t, g in enumerate(guesses):
            ids = world["tok"].encode(_call_text(g), add_special_tokens=False)
            forced[b, t, : len(ids)] = ids
    envs = [gh.GuessNumberHostEnv() for _ in range(B)]
    traj = H.host_rollout(
        world["params"],
        world["keys"],
        envs,
        [11, 11, 3, 3],
        chat=world["guess"],
        programs=programs,
        forced_tokens=forced,
    )
    return dict(traj=jax.device_get(traj), envs=envs)


def _history_texts(tok, secret: int, guesses, k: int) -> list[str]:
    """The chat template's text of each turn sample of one episode: system, the last k (assistant call, tool
    response) exchanges and the observation as a user turn, then the call (a replay through the environment)."""
    env, exchanges, texts = gh.GuessNumberHostEnv(), [], []
    first = env.reset(secret)
    for t, guess in enumerate(guesses):
        observation = first if t == 0 else env.observation()
        window = exchanges[len(exchanges) - 2 * k :] if k else []
        messages = [{"role": "system", "content": gn.CHAT.system}, *window, {"role": "user", "content": observation}]
        texts.append(chat_lib.chat_text(tok, gn.CHAT, messages, True) + _call_text(guess))
        step = env.step(host.ToolCall("guess", {"number": guess}))
        exchanges += [{"role": "assistant", "content": _call_text(guess)}, {"role": "tool", "content": step.text}]
        if step.done:
            break
    return texts


def test_history_turn_samples_are_the_chat_templates_rendering(world, history_run):
    traj, tok, turns = history_run["traj"], world["tok"], HISTORY_TURNS
    assert traj.tokens.shape == (B * turns, RC.max_length)
    np.testing.assert_array_equal(traj.episode_id, np.repeat(np.arange(B), turns))
    np.testing.assert_array_equal(traj.turn_index, np.tile(np.arange(turns), B))
    np.testing.assert_array_equal(traj.group_id, np.repeat([0, 0, 1, 1], turns))
    for b, guesses in enumerate(HISTORY_GUESSES):
        texts = _history_texts(tok, [11, 11, 3, 3][b], guesses, HISTORY_RC.history)
        assert int(traj.stats.num_turns[b]) == len(texts)
        for t in range(turns):
            r = b * turns + t
            n = int(traj.valid[r].sum())
            if t >= len(texts):  # the episode ended before: a padding row
                assert n == 0 and traj.prompt_length[r] == 0 and (traj.turn_id[r] == -1).all()
                continue
            assert traj.valid[r, :n].all() and decode_text(tok, traj.tokens[r, :n]) == texts[t], (b, t)
            p = int(traj.prompt_length[r])
            np.testing.assert_array_equal(np.flatnonzero(traj.loss_mask[r]), np.arange(p, n))
            assert (traj.turn_id[r, :n] == t).all()
    # rewards: the episode's on each of its rows; per turn in turn_reward [B, T]
    episode_reward = np.array([0.625, 0.0, 0.625, 1.0], np.float32)
    np.testing.assert_allclose(traj.reward, np.repeat(episode_reward, turns))
    np.testing.assert_allclose(traj.turn_reward.sum(1), episode_reward)
    np.testing.assert_array_equal(traj.info["found"], [True, False, True, True])


def test_history_turn_samples_hold_the_fed_ids(world, history_run):
    """Each window exchange is the ids of its turn sample's sampled turn and the response as fed, not a
    re-tokenisation; turn 0 is the whole conversation's first prompt."""
    traj, chat, turns = history_run["traj"], world["guess"], HISTORY_TURNS
    assert traj.tokens[0, : traj.prompt_length[0]].tolist() == chat.prompt_ids(gn.CHAT.user[0][0])
    for b in range(B):
        for t in range(1, int(traj.stats.num_turns[b])):
            prev, r = b * turns + t - 1, b * turns + t
            sampled = traj.tokens[prev, traj.prompt_length[prev] : traj.valid[prev].sum()].tolist()
            row = traj.tokens[r, : traj.prompt_length[r]].tolist()
            start = len(chat.system_ids) + len(chat.header_ids)
            assert row[: len(chat.system_ids)] == list(chat.system_ids)
            assert row[start : start + len(sampled)] == sampled


def test_history_logp_equals_the_train_forward(world, history_run):
    traj = history_run["traj"]
    logprobs = jax.jit(functools.partial(ling3.token_logprobs, config=MC), compiler_options=FAST_COMPILE)
    ref = np.asarray(logprobs(world["params"], tokens=traj.tokens, valid=traj.valid))
    mask = np.asarray(traj.loss_mask)
    assert mask.sum() > 100
    np.testing.assert_allclose(ref[mask], traj.behaviour_logp[mask], atol=1e-4)
    assert np.all(traj.behaviour_logp[~mask] == 0)


def test_history_first_episodes_cut_rows_and_episodes(history_run):
    from reno_jax.loop import host_envs

    traj = host_envs.first_episodes(history_run["traj"], 2)
    assert traj.tokens.shape[0] == traj.reward.shape[0] == traj.episode_id.shape[0] == 2 * HISTORY_TURNS
    assert traj.stats.num_turns.shape == (2,) and traj.turn_reward.shape == (2, HISTORY_TURNS)
    np.testing.assert_array_equal(traj.info["found"], [True, False])
