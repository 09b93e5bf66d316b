"""Host environments in the training loop (`reno_jax.loop.host_envs`, `reno_jax.loop.host_warmstart`): config
checks that name the flag, the step's tasks as a function of its key, a short run with its evaluation, warm start
and play-page transcripts, and an exact resume after kill -9 (the CLI in subprocesses; slow tier)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from configs import guess_number_host_tiny
from reno_jax import loop
from reno_jax.envs import guess_number_host as gh
from reno_jax.envs import host
from reno_jax.errors import ConfigError
from reno_jax.loop import host_envs
from reno_jax.loop.config import validate_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@host.register
class NoTeacherEnv(gh.GuessNumberHostEnv):
    """Guess the number without a warm-start teacher, and with an option."""

    name = "no_teacher_host"
    options = (*gh.GuessNumberHostEnv.options, "secret_offset")
    secret_offset = 0

    def teacher(self, rng):
        return host.HostEnv.teacher(self, rng)


@host.register
class IntResetEnv(gh.GuessNumberHostEnv):
    name = "int_reset_host"

    def reset(self, task):
        return 7


def tiny_config(num_steps: int = 2):
    """guess_number_host_tiny cut to seconds of work per step: 2 secrets x 2 samples, two warm-start steps."""
    c = guess_number_host_tiny.get_config()
    c.num_steps = num_steps
    c.model.tiny.num_hidden_layers = 2
    c.sft.num_steps = 2
    c.sft.batch_size = 4
    c.rollout.boards_per_step = 2
    c.rollout.group_size = 2
    c.rollout.host_eval_episodes = 4
    c.checkpoint_every = 1
    c.plot_every = 0
    return c


def test_host_env_config_errors_name_the_flag():
    c = tiny_config()
    c.env.colour = "red"
    with pytest.raises(ConfigError, match=r"^--config.env.colour: unknown option of environment 'guess_number_host'"):
        validate_config(c)
    c = tiny_config()
    c.env = ml_collections.ConfigDict(dict(name="guess_number_host", module="", teacher_strategy=3))
    with pytest.raises(ConfigError, match=r"^--config.env.teacher_strategy must be str, got int"):
        validate_config(c)
    c = tiny_config()
    c.env.teacher_strategy = "psychic"  # the environment's own ValueError, raised by its teacher at the warm start
    with pytest.raises(ConfigError, match=r"^--config.env.teacher_strategy='psychic': expected 'binary'"):
        validate_config(c)
    c = tiny_config()
    c.env.name = "no_teacher_host"
    with pytest.raises(ConfigError, match=r"^--config.sft.num_steps=2: NoTeacherEnv .* has no teacher"):
        validate_config(c)
    c.sft.num_steps = 0
    c.env.secret_offset = 1
    assert host_envs.host_env_class(validate_config(c)).secret_offset == 1
    c.mesh.data = 2
    with pytest.raises(ConfigError, match=r"^--config.mesh: env.name='no_teacher_host' is a host environment"):
        validate_config(c)
    c.env = ml_collections.ConfigDict(dict(name="int_reset_host", module=""))
    with pytest.raises(host.HostEnvError, match=r"^IntResetEnv \(name 'int_reset_host'\)\.reset must return"):
        validate_config(c)  # a wrong type fails at once, before anything is written (the CLIs: one line)
    c = tiny_config()
    c.env.name = "guess_number_hots"
    with pytest.raises(
        ConfigError, match=r"^--config.env.name: unknown environment .*host environments: \[.*'guess_number_host'"
    ):
        validate_config(c)
    c.env.module = "no_such_pkg.envs"
    with pytest.raises(ConfigError, match=r"^--config.env.module='no_such_pkg.envs' cannot be imported"):
        validate_config(c)


def test_step_tasks_are_a_function_of_the_step_key():
    """`numpy_rng` of the same key draws the same tasks in a fresh process's terms (no Python state)."""
    key = jax.random.fold_in(jax.random.PRNGKey(0), 7)
    draws = [host.sample_episodes(gh.GuessNumberHostEnv, host_envs.numpy_rng(key), 4, 2)[1] for _ in range(2)]
    assert draws[0] == draws[1] and len(draws[0]) == 8
    other = host.sample_episodes(gh.GuessNumberHostEnv, host_envs.numpy_rng(jax.random.fold_in(key, 1)), 4, 2)[1]
    assert other != draws[0]
    typed = host_envs.numpy_rng(jax.random.wrap_key_data(key)).integers(1 << 30)
    assert typed == host_envs.numpy_rng(key).integers(1 << 30)


def test_play_page_opens_a_host_env_run_as_transcripts(tmp_path):
    """A host-env run dir (its config only: no model call) opens on the transcript view with its held-out suite."""
    from reno_jax.loop import training
    from reno_jax.play import service as service_lib

    training.write_run_config(validate_config(tiny_config()), str(tmp_path))
    service = service_lib.PlayService(str(tmp_path))
    info = service.info()
    assert info["env"] == "guess_number_host" and info["view"] == "transcript" and info["board"] is None
    assert info["suites"] == [{"name": "sampler", "num_episodes": None}, {"name": "heldout", "num_episodes": 4}]
    assert service.eval_suites["heldout"].starts(None, np.array([2, 0])) == [3, 1]  # every secret, in order
    with pytest.raises(service_lib.PlayError, match="no checkpoint yet"):
        service.episode(suite="heldout")


# ---------------------------------------------------------------------------------------------- slow tier


def strip_perf(row):
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


def read_rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_short_host_run_evaluates_warm_starts_and_shows_transcripts(tmp_path):
    """Two GSPO steps of the host guess-number with an in-run evaluation: the rows carry the usual figures, the
    `episode_info` means and the host stats; the warm start reports the student beside the teacher; the run dir
    serves transcripts to the play page."""
    c = tiny_config(2)
    c.eval_every = 2
    workdir = str(tmp_path / "run")
    rows = loop.train(c, workdir)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("rollout/rewards_mean", "rollout/tool_call_valid_rate", "rollout/response_len_mean", "train/loss"):
        assert all(np.isfinite(r[key]) for r in rows), key
    for key in ("found", "guesses", "wasted", "invalid", "tool_errors", "tool_timeouts", "responses_cut"):
        assert f"rollout/{key}" in rows[0], key
    assert rows[1]["eval/heldout/num_episodes"] == 4 and "eval/heldout/found" in rows[1]
    warm = read_rows(os.path.join(workdir, "warmstart_log"))
    assert "eval/heldout/mean_reward" in warm[-1] and "teacher/heldout/mean_reward" in warm[-1]
    assert os.path.isdir(os.path.join(workdir, "warmstart"))

    from reno_jax.play import service as service_lib

    service = service_lib.PlayService(workdir)
    assert service.board_info() is None
    episode = service.episode(step=2, suite="heldout", episode=3)
    roles = [m["role"] for m in episode["messages"]]
    assert roles[:3] == ["system", "user", "assistant"] and episode["messages"][1]["content"].startswith("I picked")
    assert episode["num_turns"] >= 1 and set(episode["info"]) >= {"found", "guesses"}
    assert service.episode(step=0, suite="sampler", seed=1)["step"] == 0  # the warm start, on a training task
    out = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", f"--workdir={workdir}", "--num_episodes=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["checkpoint_step"] == 2 and last["heldout/num_episodes"] == 3 and "heldout/found" in last
    assert "I picked a number" in open(os.path.join(workdir, "eval_transcripts.txt")).read()


def _train_cli(workdir, num_steps, **popen):
    args = [
        sys.executable,
        "-m",
        "experiments.train",
        "--config=configs/guess_number_host_tiny.py",
        f"--workdir={workdir}",
        f"--config.num_steps={num_steps}",
        "--config.model.tiny.num_hidden_layers=2",
        "--config.sft.num_steps=2",
        "--config.sft.batch_size=4",
        "--config.rollout.boards_per_step=2",
        "--config.rollout.group_size=2",
        "--config.rollout.host_eval_episodes=4",
        "--config.checkpoint_every=1",
        "--config.plot_every=0",
        "--config.rollout.temperature=0.05",  # near greedy: the two warm-start steps' valid calls, on each task
    ]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)


def test_host_run_trains_on_turn_samples_with_bounded_history(tmp_path):
    """`rollout.history=1`: the host rollout's turn samples go through the learner (one row per turn of each
    episode) and the held-out evaluation plays the same window."""
    c = tiny_config(1)
    c.rollout.history = 1
    c.rl.share_prompt_prefix = c.rl.share_common_prefix = False  # turn samples share no group prompt
    c.eval_every = 1
    rows = loop.train(c, str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1] and np.isfinite(rows[0]["train/loss"])
    assert rows[0]["eval/heldout/num_episodes"] == 4 and "eval/heldout/found" in rows[0]


def test_host_run_resumes_exactly_after_kill_9(tmp_path):
    """A run killed with SIGKILL once it has checkpointed step 2, then started again, writes the same metric rows
    as an uninterrupted run (the tasks come from the checkpointed RNG, not from Python state)."""
    steps = 4
    whole = _train_cli(tmp_path / "whole", steps)
    assert whole.wait(timeout=900) == 0, whole.stderr.read()[-3000:]
    killed_dir = tmp_path / "killed"
    killed = _train_cli(killed_dir, steps)
    deadline = time.time() + 900
    while not (killed_dir / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists():
        assert killed.poll() is None and time.time() < deadline, "the run ended before checkpointing step 2"
        time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = _train_cli(killed_dir, steps)
    assert resumed.wait(timeout=900) == 0, resumed.stderr.read()[-3000:]
    expected = [strip_perf(r) for r in read_rows(tmp_path / "whole")]
    assert [r["step"] for r in expected] == list(range(1, steps + 1))
    assert [strip_perf(r) for r in read_rows(killed_dir)] == expected


class MagicWord:
    """A SkyRL-gym-style text environment: say "please" (reward 1, done), else told to ask nicely (twice at most)."""

    def init(self, prompt):
        self.asked = 0
        return prompt, {}

    def step(self, action: str):
        self.asked += 1
        if "please" in action:
            return {"observations": [{"role": "user", "content": "Granted."}], "reward": 1.0, "done": True}
        return [{"role": "user", "content": "Ask nicely."}], 0, self.asked >= 2, {}


def test_text_gym_adapter_hands_the_raw_turn_text_to_step():
    from reno_jax.envs import text_gym
    from reno_jax.protocol import toolcall

    env_class = text_gym.host_env(MagicWord, name="magic_word", prompts=["Open the door.", "Pass the salt."])
    assert env_class.eval_tasks(3) == ["Open the door.", "Pass the salt.", "Open the door."]
    env = env_class()
    assert host.checked_reset(env, env_class.sample_task(np.random.default_rng(0))) in env_class.eval_tasks(2)
    turn = "Give it to me." + toolcall.OPEN_TAG  # no tool call: the raw text still reaches step
    call = host.parse_call(env_class.tools, turn)
    assert host.checked_step(env, "invalid_call", env.invalid_call(call)) == ("Ask nicely.", 0.0, False)
    assert host.checked_step(env, "invalid_call", env.invalid_call(host.parse_call((), "please?"))) == (
        "Granted.",
        1.0,
        True,
    )
    assert env.episode_info(False) == {"steps": 2, "truncated": False}
    tooled = text_gym.host_env(MagicWord, name="tooled", prompts=["x"], tools=gh.GuessNumberHostEnv.tools)
    env = tooled()
    env.reset("x")
    text = 'please <tool_call>{"name": "guess", "arguments": {"number": 3}}</tool_call>'
    assert env.step(host.parse_call(tooled.tools, text)).reward == 1.0  # a parsed call carries its turn's text
