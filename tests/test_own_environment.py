"""An environment of the user's own package trains, evaluates and warm-starts with no edit of reno_jax: through
the CLI (`--config.env.module`) and as library calls (`reno_jax.loop`)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A whole environment in a user's package: the prompt shows a number, the agent answers it with `answer(number)`.
ECHO_ENV = textwrap.dedent("""
    import flax.struct
    import jax
    import jax.numpy as jnp
    import numpy as np

    from reno_jax.envs import interface, registry
    from reno_jax.protocol.chat import ChatSpec, Slot

    NUMBERS = tuple(str(k) for k in range(10))
    CHAT = ChatSpec(
        system="Repeat the number with the answer tool.",
        tools=({"type": "function", "function": {
            "name": "answer", "description": "Say the number.",
            "parameters": {"type": "object", "properties": {
                "number": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["number"]}}},),
        user=(("The number is ", Slot(0, NUMBERS), "."),),
        tool=(("Right.",), ("Wrong.",), ("Invalid call.",)),
        tool_continues=(False, False, False),
        num_values=1)


    @flax.struct.dataclass
    class Start:
        number: jax.Array


    @registry.register_env
    @flax.struct.dataclass
    class EchoEnv(interface.TextEnv):
        name = "echo"
        numbers: int = flax.struct.field(pytree_node=False, default=10)  # an option: --config.env.numbers=5

        def chat(self):
            return CHAT

        def max_turns(self):
            return 1

        def reset(self, start):
            return start.number, interface.Message(jnp.int32(0), start.number[None].astype(jnp.int32))

        def apply(self, state, call):  # a valid call; an invalid one is the base class's (-1, the last template)
            right = call.args[0] == state
            return interface.Step(state=state, message=interface.Message(jnp.where(right, 0, 1), state[None]),
                                  reward=jnp.where(right, 1.0, 0.0), done=jnp.bool_(True), info={"right": right})

        def episode_metrics(self):
            return {"right_rate": interface.rate("right", plot=True), "invalid_rate": interface.rate("invalid")}

        def sample_starts(self, key, num_groups):
            return Start(number=jax.random.randint(key, (num_groups,), 0, self.numbers))

        def teacher(self):  # the right answer: row k is answer(number=k)
            policy = lambda state, key: (state.astype(jnp.int32), jnp.arange(10) == state)
            return interface.Teacher(policy, tuple(("answer", {"number": k}) for k in range(10)))

        def eval_suites(self):
            return {"all": interface.EvalSuite(num_episodes=10,
                                               starts=lambda key, ids: Start(number=jnp.asarray(ids % 10)))}
""")

SMALL = [
    "--config.num_steps=2",
    "--config.sft.num_steps=2",
    "--config.sft.batch_size=4",
    "--config.rollout.boards_per_step=4",
    "--config.rollout.group_size=2",
    "--config.rollout.max_new_tokens=16",
    "--config.rollout.max_turns=1",
    "--config.checkpoint_every=2",
    "--config.plot_every=0",
]


@pytest.fixture(scope="module")
def user_package(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_pkg")
    pkg = root / "my_envs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "echo.py").write_text(ECHO_ENV)
    return str(root)


def _run(args, pythonpath, returncode=0):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == returncode, out.stderr[-3000:]
    if returncode:
        return out.stderr.strip().splitlines()
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_an_environment_of_the_users_package_trains_and_evaluates_from_the_cli(user_package, tmp_path):
    workdir = str(tmp_path / "run")
    lines = _run(
        [
            "experiments.train",
            "--config=configs/guess_number_tiny.py",
            f"--workdir={workdir}",
            "--config.env.module=my_envs.echo",
            "--config.env.name=echo",
            "--config.env.numbers=5",  # the environment's own option, not in the config file
            "--config.model.tokenizer=env",  # a tokenizer built on the environment's text, saved with the run
            *SMALL,
        ],
        user_package,
    )
    assert lines[-1]["steps"] == 2 and "last20/rollout/right_rate" in lines[-1]
    assert json.load(open(os.path.join(workdir, "config.json")))["env"]["numbers"] == 5
    assert os.path.isfile(os.path.join(workdir, "tokenizer", "tokenizer.json"))  # what the evaluation reads
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [row["step"] for row in rows] == [1, 2] and all("rollout/right_rate" in row for row in rows)
    assert os.path.isdir(os.path.join(workdir, "warmstart"))
    figures = _run(["experiments.evaluate", f"--workdir={workdir}", "--transcripts=1"], user_package)[-1]
    assert figures["env"] == "echo" and figures["checkpoint_step"] == 2
    assert figures["all/num_episodes"] == 10 and 0.0 <= figures["all/right_rate"] <= 1.0
    assert "The number is" in open(os.path.join(workdir, "eval_transcripts.txt")).read()
    for flag, message in (
        (
            "--config.env.random_map=True",
            "--config.env.random_map: unknown option of environment 'echo' (options: numbers)",
        ),
        ("--config.env.numbers=many", "--config.env.numbers must be int, got str ('many')"),
    ):
        bad = str(tmp_path / "bad")
        args = [
            "experiments.train",
            "--config=configs/tictactoe_tiny.py",
            f"--workdir={bad}",
            "--config.env.module=my_envs.echo",
            "--config.env.name=echo",
            flag,
        ]
        assert _run(args, user_package, returncode=2)[-1] == f"train.py: error: {message}"
        assert not os.path.exists(bad)  # refused before anything is written


def test_an_unknown_module_is_one_line_naming_the_setting(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--config=configs/guess_number_tiny.py",
            f"--workdir={tmp_path}",
            "--config.env.module=no_such_pkg.env",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert "env.module='no_such_pkg.env' cannot be imported" in out.stderr.strip().splitlines()[-1]


def test_the_loop_is_a_library_call(user_package, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(user_package)
    from my_envs import echo

    from configs import guess_number_tiny
    from reno_jax import loop
    from reno_jax.loop import warmstart

    config = guess_number_tiny.get_config()
    config.num_steps, config.checkpoint_every, config.plot_every = 2, 2, 0
    config.sft.num_steps, config.sft.batch_size, config.sft.learning_rate = 30, 4, 1e-2
    config.rollout.boards_per_step, config.rollout.group_size = 4, 2
    config.rollout.max_new_tokens, config.rollout.max_turns = 16, 1
    rows = loop.train(config, str(tmp_path), env=echo.EchoEnv)  # the class the user's code registered
    assert [row["step"] for row in rows] == [1, 2] and "rollout/right_rate" in rows[0]
    # The warm start's end: the student's greedy figures beside the teacher's on the first suite's episodes.
    logged = json.loads(open(os.path.join(str(tmp_path), warmstart.LOG_SUBDIR, "metrics.jsonl")).readlines()[-1])
    assert logged["sft/teacher/all/right_rate"] == 1.0 and 0.0 <= logged["sft/student/all/right_rate"] <= 1.0
    # The warm start on the right answers taught the format and the answer: the model now echoes the number.
    config2, tokenizer, model_config, params, step = loop.load_run(str(tmp_path))
    assert step == 2 and config2.env.name == "echo"
    results = loop.evaluate(params, model_config, tokenizer, config2, key=jax.random.PRNGKey(0), show_progress=False)
    assert results["all"].figures["tool_call_valid_rate"] > 0.5
    assert loop.flat_figures(results)["all/right_rate"] == results["all"].figures["right_rate"]
    # Resuming is a no-op (the run is complete) and the cached warm start is reused.
    assert loop.train(config, str(tmp_path), env=echo.EchoEnv) == []
    assert os.path.isdir(os.path.join(str(tmp_path), warmstart.CACHE_SUBDIR))
