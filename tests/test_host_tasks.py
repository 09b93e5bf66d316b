"""The tool-use tasks as host environments: two-hop lookup (reno_jax/envs/two_hop_lookup.py), arithmetic with a
calculator (reno_jax/envs/arithmetic_calculator.py) and any Reasoning Gym dataset (reno_jax/envs/reasoning_gym_env.py).

Each environment is played by its own teacher (no model): a teacher that always solves must be right by the task's
scorer every time, one that never does mostly wrong, the controls must behave as controls, malformed arguments end
the episode as invalid, and `episode_info` has the same keys every episode. The tests that need Reasoning Gym (the
optional `tasks` extra) are skipped without it (the SLOW table of tests/conftest.py puts them in the slow tier), as
is the play through `host_rollout` with a tiny random model (its compilation).
"""

import importlib.util
import json

import jax
import numpy as np
import pytest
from test_rollout import FAST_COMPILE, MC, _numpy_params

from reno_jax.envs import host
from reno_jax.envs import two_hop_lookup as two_hop
from reno_jax.protocol.tokenizer import load_tokenizer
from reno_jax.rollout import host_rollout as H
from reno_jax.rollout import rollout as R
from reno_jax.tools import knowledge_base as kb_lib

needs_reasoning_gym = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="needs the `tasks` extra (reasoning-gym)",
)


def _configured(env_class, **options):
    """`env_class` with some options set (what the loop's `host.configured` makes from the command line)."""
    assert set(options) <= set(env_class.options)
    return type(env_class.__name__, (env_class,), options)


def _play(env_class, tasks, seed=0):
    """Plays each task with the environment's teacher; returns (infos, total rewards, calls per episode)."""
    rng = np.random.default_rng(seed)
    infos, rewards, calls = [], [], []
    for task in tasks:
        env = env_class()
        env.reset(task)
        total, episode_calls = 0.0, []
        for _ in range(env.max_turns):
            call = env.teacher(rng)
            episode_calls.append(call)
            step = env.step(call)
            total += step.reward
            if step.done:
                break
        infos.append(env.episode_info(truncated=not step.done))
        rewards.append(total)
        calls.append(episode_calls)
    assert len({tuple(info) for info in infos}) == 1, "episode_info keys change between episodes"
    return infos, np.array(rewards), calls


def _mean(infos, key):
    return float(np.mean([info[key] for info in infos]))


def _train_tasks(env_class, num, seed=0):
    rng = np.random.default_rng(seed)
    return [env_class.sample_task(rng) for _ in range(num)]


# ------------------------------------------------------------------------------------------------- two hops


def test_two_hop_teacher_solves_at_rate_one_and_mostly_guesses_wrong_at_rate_zero():
    env_class = two_hop.TwoHopLookupEnv
    cost = env_class.lookup_cost
    tasks = _train_tasks(env_class, 200)
    infos, rewards, calls = _play(_configured(env_class, teacher_second_lookup_rate=1.0), tasks)
    np.testing.assert_allclose(rewards, 1.0 - 2 * cost)
    assert _mean(infos, "correct") == 1.0
    assert _mean(infos, "lookups") == 2.0 and _mean(infos, "second_lookup") == 1.0 and _mean(infos, "invalid") == 0
    assert [c.arguments["query"] for c in calls[0][:2]] == list(tasks[0].question.gold_queries)
    infos, rewards, _ = _play(_configured(env_class, teacher_second_lookup_rate=0.0), tasks)
    assert _mean(infos, "correct") < 0.5 and _mean(infos, "lookups") == 1.0 and _mean(infos, "second_lookup") == 0
    infos, _, _ = _play(env_class, tasks)  # the default: about half make the second lookup
    assert 0.35 < _mean(infos, "second_lookup") < 0.65
    fixed = _configured(env_class, fresh_worlds=False, teacher_second_lookup_rate=0.0)
    infos, _, _ = _play(fixed, _train_tasks(fixed, 200))
    assert _mean(infos, "correct") < 0.3


def test_two_hop_fresh_worlds_are_a_world_per_question_and_held_out_worlds_are_never_trained_on():
    env_class = two_hop.TwoHopLookupEnv
    tasks = _train_tasks(env_class, 300)
    assert len({t.question.subject for t in tasks}) > 290, "names repeat across fresh worlds"
    again = _train_tasks(env_class, 3)
    assert [t.question.question for t in again] == [t.question.question for t in tasks[:3]]
    suite = env_class.eval_tasks(50)
    assert [t.question for t in env_class.eval_tasks(50)] == [t.question for t in suite]
    assert {t.question.question for t in suite}.isdisjoint(t.question.question for t in tasks)
    for task in tasks[:20] + suite[:20]:  # each world holds its question, and its teacher solves it
        solution = kb_lib.solve_two_hop(task.question, task.world.lookup)
        assert solution.answer == task.question.answer
    other_stream = _configured(env_class, world_seed=1)
    assert {t.question.question for t in _train_tasks(other_stream, 20)}.isdisjoint(t.question.question for t in tasks)


def test_two_hop_random_tool_answers_facts_of_the_right_kind_that_are_mostly_wrong():
    for fresh_worlds in (True, False):
        env_class = _configured(
            two_hop.TwoHopLookupEnv, random_tool=True, teacher_second_lookup_rate=1.0, fresh_worlds=fresh_worlds
        )
        tasks = _train_tasks(env_class, 200)
        infos, rewards, _ = _play(env_class, tasks)
        assert _mean(infos, "correct") < (0.05 if fresh_worlds else 0.3) and _mean(infos, "lookups") == 2.0
        assert _mean(infos, "second_lookup") == 1.0  # the teacher followed each random first answer
        assert np.mean(rewards) < 0.3 - 2 * env_class.lookup_cost
        task = tasks[0]
        env = env_class()
        env.reset(task)
        step = env.step(host.ToolCall("lookup", {"query": task.question.gold_queries[0]}))
        assert kb_lib.parse_fact(step.text, task.question.relations[0]) is not None and not step.done
        assert step.reward == -env_class.lookup_cost
        unknown = env.step(host.ToolCall("lookup", {"query": "Nobody Atall: born_in"})).text
        if fresh_worlds:  # the chain goes on at random
            assert kb_lib.parse_fact(unknown, "born_in")[0] == "Nobody Atall"
        else:
            assert unknown.startswith("no entry")
        env = env_class()
        env.reset(task)
        assert env.step(host.ToolCall("lookup", {"query": "no colon"})).text.startswith("error")
        assert env.step(host.ToolCall("lookup", {"query": f"{task.question.subject}: capital"})).text.startswith(
            "no entry for 'capital'"
        )


def test_two_hop_invalid_arguments_end_the_episode():
    env_class = two_hop.TwoHopLookupEnv
    task = _train_tasks(env_class, 1)[0]
    for call in [
        host.ToolCall("lookup", {"query": 3}),
        host.ToolCall("lookup", {"query": "a: born_in", "extra": 1}),
        host.ToolCall("answer", {"value": ["x"]}),
        host.ToolCall("answer", {"text": task.question.answer}),
    ]:
        env = env_class()
        env.reset(task)
        assert env.step(call) == ("Invalid call.", env_class.invalid_call_reward, True), call
        assert env.episode_info(False)["invalid"]
    env = env_class()
    env.reset(task)
    assert env.invalid_call(host.InvalidCall(host.KIND_NO_CALL, "hm", "no call")).done
    env.reset(task)  # an answer written differently (case, spaces, a full stop) is still the answer
    answer = f" {task.question.answer.upper()}."
    assert env.step(host.ToolCall("answer", {"value": answer})) == ("Correct.", 1.0, True)
    assert host.host_entry("two_hop_lookup").env_class is env_class


def test_two_hop_fixed_world_held_out_questions_ask_about_other_subjects():
    env_class = _configured(two_hop.TwoHopLookupEnv, fresh_worlds=False)
    _, train, heldout = env_class.world()
    assert len(heldout) >= 80 and len(train) >= 4 * len(heldout) // 2
    assert not {q.subject for q in train} & {q.subject for q in heldout}
    suite = [t.question for t in env_class.eval_tasks(50)]
    assert suite == list(heldout[:50]) and [t.question for t in env_class.eval_tasks(50)] == suite
    assert not {t.question.question for t in _train_tasks(env_class, 300)} & {q.question for q in heldout}


# ------------------------------------------------------------------------------------------------- arithmetic


@needs_reasoning_gym
def test_arithmetic_teacher_and_the_no_tool_control():
    from reno_jax.envs import arithmetic_calculator as arithmetic

    env_class = arithmetic.ArithmeticCalculatorEnv
    tasks = _train_tasks(env_class, 200)
    assert [t["name"] if "name" in t else t["function"]["name"] for t in env_class.tools] == ["calculate", "answer"]
    infos, rewards, calls = _play(_configured(env_class, teacher_tool_rate=1.0), tasks)
    # Right by Reasoning Gym's own scorer every time, through the calculator.
    assert np.all(rewards == 1.0) and _mean(infos, "used_tool") == 1.0 and _mean(infos, "tool_calls") == 1.0
    assert _mean(infos, "copied_expression") == 1.0 and _mean(infos, "copied_result") == 1.0
    assert [c.name for c in calls[0]] == ["calculate", "answer"]
    assert calls[0][0].arguments["expression"] == env_class().reset(tasks[0])
    infos, rewards, _ = _play(_configured(env_class, teacher_tool_rate=0.0), tasks)
    assert _mean(infos, "correct") == 0.0 and _mean(infos, "used_tool") == 0.0
    infos, _, _ = _play(env_class, tasks)
    assert 0.35 < _mean(infos, "correct") < 0.65

    control = _configured(env_class, tool_enabled=False, teacher_tool_rate=1.0)
    assert [t["function"]["name"] for t in control.tools] == ["answer"] and control.max_turns == 1
    assert [t["function"]["name"] for t in env_class.tools] == ["calculate", "answer"]  # the parent is untouched
    infos, rewards, calls = _play(control, tasks)
    assert np.all(rewards == 1.0) and _mean(infos, "used_tool") == 0.0 and {len(c) for c in calls} == {1}
    # The control's parser does not know calculate: the turn is an unknown tool's call.
    call = host.parse_call(
        control.tools, '<tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}</tool_call>'
    )
    assert isinstance(call, host.InvalidCall) and call.kind == host.KIND_BAD_CALL


@needs_reasoning_gym
def test_arithmetic_questions_are_large_held_out_and_invalid_calls_end_the_episode():
    from reno_jax.envs import arithmetic_calculator as arithmetic

    env_class = arithmetic.ArithmeticCalculatorEnv
    suite = env_class.eval_tasks(512)
    assert len(suite) == 512 and env_class.eval_tasks(10) == suite[:10]
    train = _train_tasks(env_class, 1000)
    assert not {t["question"] for t in train} & {t["question"] for t in suite}
    assert np.median([len(t["answer"].lstrip("-")) for t in train]) >= 6
    env = env_class()
    question = env.reset(train[0])
    assert question == train[0]["metadata"]["expression"] and " " not in question
    assert env.step(host.ToolCall("calculate", {"expression": "2**"})).text.startswith("error: ")
    assert env.step(host.ToolCall("answer", {"value": int(train[0]["answer"])})) == ("Correct.", 1.0, True)
    for call in [host.ToolCall("calculate", {"expression": 12}), host.ToolCall("answer", {"value": None})]:
        env.reset(train[0])
        assert env.step(call) == ("Invalid call.", env_class.invalid_call_reward, True)
        assert env.episode_info(False) == {
            "correct": False,
            "score": 0.0,
            "tool_calls": 0,
            "invalid": True,
            "used_tool": False,
            "copied_expression": False,
            "copied_result": False,
        }
    assert host.host_entry("arithmetic_calculator").env_class is env_class


# ------------------------------------------------------------------------------------------------- any dataset


@needs_reasoning_gym
@pytest.mark.parametrize(
    "dataset, options", [("leg_counting", {"min_animals": 2, "max_animals": 3}), ("spell_backward", {})]
)
def test_any_reasoning_gym_dataset_trains_the_same_way(dataset, options):
    from reno_jax.envs import reasoning_gym_env as rge

    env_class = rge.reasoning_gym_env(dataset, eval_size=64, **options)
    assert [t["function"]["name"] for t in env_class.tools] == ["answer"] and env_class.max_turns == 1
    tasks = _train_tasks(env_class, 40)
    assert not {t["question"] for t in tasks} & {t["question"] for t in env_class.eval_tasks(64)}
    infos, rewards, _ = _play(_configured(env_class, teacher_rate=1.0), tasks)
    assert np.all(rewards == 1.0) and _mean(infos, "correct") == 1.0
    infos, rewards, _ = _play(_configured(env_class, teacher_rate=0.0), tasks)
    assert np.all(rewards < 1.0) and _mean(infos, "correct") == 0.0

    with_calculator = _configured(env_class, with_calculator=True)
    assert [t["function"]["name"] for t in with_calculator.tools] == ["calculate", "answer"]
    env = with_calculator()
    env.reset(tasks[0])
    assert env.step(host.ToolCall("calculate", {"expression": "6*7"})) == ("42", 0.0, False)
    assert env.step(host.ToolCall("answer", {"value": tasks[0]["answer"]})) == ("Correct.", 1.0, True)
    assert env.episode_info(False)["tool_calls"] == 1

    # The registered name with the dataset as an option, as the command line sets it.
    registered = host.host_entry("reasoning_gym").env_class
    assert registered is rge.ReasoningGymEnv
    same = _configured(registered, dataset=dataset, dataset_options=json.dumps(options), eval_size=64)
    assert same.sample_task(np.random.default_rng(0)) == env_class.sample_task(np.random.default_rng(0))


@needs_reasoning_gym
def test_reasoning_gym_env_says_what_is_missing():
    from reno_jax.envs import reasoning_gym_env as rge

    with pytest.raises(ValueError, match="--config.env.dataset=NAME"):
        rge.ReasoningGymEnv.sample_task(np.random.default_rng(0))
    with pytest.raises(ValueError, match="JSON object"):
        _configured(rge.ReasoningGymEnv, dataset="leg_counting", dataset_options="[1]").eval_tasks(1)
    with pytest.raises(ValueError, match="did you mean"):
        rge.reasoning_gym_env("leg_countin").eval_tasks(1)
    with pytest.raises(ValueError, match="env.dataset_options: .*min_legs"):
        rge.reasoning_gym_env("leg_counting", min_legs=3).eval_tasks(1)


# ------------------------------------------------------------------------------------------------- host_rollout

# One tiny random model and one `HostPrograms` (B = 4 rows, 3 turns of 64 tokens: the longest teacher call is 64)
# for every environment: the first group's turns are forced to the teacher's calls, the second group samples.
B, M, TURNS = 4, 64, 3
RC = R.RolloutConfig(group_size=2, max_new_tokens=M, max_turns=TURNS, max_length=448, prefill_chunk=64)
HC = H.HostConfig(max_prompt_tokens=64, max_response_tokens=48, tool_timeout_s=5.0)


@pytest.fixture(scope="module")
def model():
    return dict(
        tok=load_tokenizer(None),
        params=_numpy_params(MC),
        programs=H.make_host_programs(MC, RC, HC, compiler_options=FAST_COMPILE),
    )


def _teacher_forced(env_class, chat, task) -> np.ndarray:
    """int32 [TURNS, M]: the teacher's calls on `task` as the policy would write them (-1: sample)."""
    forced = np.full((TURNS, M), -1, np.int32)
    _, _, calls = _play(env_class, [task])
    for turn, call in enumerate(calls[0]):
        text = "<tool_call>" + json.dumps({"name": call.name, "arguments": call.arguments}) + "</tool_call>"
        ids = chat.encode(text)
        forced[turn, : len(ids)] = ids
    return forced


def _roll(model, env_class, tasks):
    """Plays tasks[0] (forced to the teacher's calls) and tasks[1] (sampled), two episodes each."""
    chat = H.compile_host_chat(env_class, model["tok"], MC.vocab_size)
    turns = min(TURNS, env_class.max_turns)
    forced = np.full((B, turns, M), -1, np.int32)
    forced[:2] = _teacher_forced(env_class, chat, tasks[0])[:turns]
    envs = [env_class() for _ in range(B)]
    traj = H.host_rollout(
        model["params"],
        jax.random.key(0),
        envs,
        [tasks[0], tasks[0], tasks[1], tasks[1]],
        chat=chat,
        programs=model["programs"],
        forced_tokens=forced,
    )
    traj = jax.device_get(traj)
    assert traj.stats.responses_cut.sum() == 0 and traj.stats.tool_errors.sum() == 0
    np.testing.assert_allclose(traj.env_info["correct"][:2], 1.0)  # the teacher's episodes are right
    assert not traj.info["truncated"][:2].any()
    return traj


def test_two_hop_plays_through_host_rollout(model):
    env_class = _configured(two_hop.TwoHopLookupEnv, teacher_second_lookup_rate=1.0)
    traj = _roll(model, env_class, _train_tasks(env_class, 2))
    np.testing.assert_array_equal(traj.env_info["lookups"][:2], [2, 2])
    np.testing.assert_array_equal(traj.info["num_turns"][:2], [3, 3])
    np.testing.assert_allclose(traj.reward[:2], 1.0 - 2 * env_class.lookup_cost, rtol=1e-6)
    assert set(traj.env_info) == {"correct", "lookups", "second_lookup", "invalid"}


@needs_reasoning_gym
def test_arithmetic_plays_through_host_rollout(model):
    from reno_jax.envs import arithmetic_calculator as arithmetic

    env_class = _configured(arithmetic.ArithmeticCalculatorEnv, teacher_tool_rate=1.0)
    traj = _roll(model, env_class, _train_tasks(env_class, 2))
    np.testing.assert_array_equal(traj.env_info["used_tool"][:2], [1, 1])
    np.testing.assert_array_equal(traj.info["num_turns"][:2], [2, 2])
