"""End to end: a shortened default run (warm start + GSPO) as a library call (`reno_jax.loop.train`) and through
the CLIs, resume, determinism, evaluation suites, and config errors that name the flag."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tictactoe_tiny
from reno_jax import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REQUIRED_METRICS = (
    "step",
    "rollout/rewards_mean",
    "rollout/rewards_std",
    "rollout/rewards_min",
    "rollout/rewards_max",
    "rollout/accuracy",
    "rollout/response_len_mean",
    "rollout/prompt_len_mean",
    "rollout/tool_call_valid_rate",
    "rollout/optimal_move_rate",
    "train/loss",
    "train/policy_loss",
    "train/ratio_mean",
    "train/clip_frac",
    "train/grad_norm",
    "train/entropy",
    "perf/step_seconds",
    "perf/rollout_tokens_per_s",
    "train/rollout_logp_abs_diff_mean",
    "train/rollout_logp_abs_diff_max",
    "train/rollout_k3_kl",
    "train/rollout_ratio_max",
)


def short_config(num_steps: int):
    """The default config, shortened: a few warm-start and GSPO steps on a handful of boards, with two layers
    (KDA + dense MLP, MLA + MoE: every layer kind) since compiling the programs is most of a test's time.

    tests/test_multihost.py resumes its run with these settings, so that its one-device resume finds the programs
    of `test_resume_continues_from_latest_checkpoint` in the session's compilation cache."""
    c = tictactoe_tiny.get_config()
    c.num_steps = num_steps
    c.model.tiny.num_hidden_layers = 2
    c.sft.num_steps = 3
    c.sft.batch_size = 8
    c.sft.compare_episodes = 0  # the student-teacher comparison (~11 CPU-s a run): tests/test_own_environment.py
    c.rollout.boards_per_step = 4
    c.rollout.group_size = 4
    c.rl.train_groups = 2
    c.rollout.max_new_tokens = 12
    c.checkpoint_every = 1
    c.plot_every = 1
    return c


def read_rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def strip_perf(row):
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run"))
    rows = loop.train(short_config(2), workdir)
    assert [r["step"] for r in rows] == [1, 2]
    return workdir


def test_short_default_run_writes_everything(run_dir):
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in REQUIRED_METRICS if k not in row]
        assert not missing, f"metrics.jsonl lacks {missing}"
        assert -1.0 <= row["rollout/rewards_mean"] <= 1.0
        assert 0.0 <= row["rollout/tool_call_valid_rate"] <= 1.0
        assert row["rollout/prompt_len_mean"] > 10
        # The total minimised (policy term - forking-entropy bonus) and the policy term are logged apart.
        np.testing.assert_allclose(
            row["train/loss"],
            row["train/policy_loss"] - row["train/forking_entropy_coef"] * row["train/forking_entropy"],
            rtol=1e-5,
            atol=1e-6,
        )
        assert row["train/loss"] != row["train/policy_loss"]
    assert os.path.getsize(os.path.join(run_dir, "learning_curves.png")) > 1000
    assert os.listdir(os.path.join(run_dir, "tensorboard"))
    assert os.path.isdir(os.path.join(run_dir, "warmstart"))
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["1", "2"]
    assert os.path.isfile(os.path.join(run_dir, "tokenizer", "tokenizer.json"))  # the run's own, beside config.json


def test_same_seed_same_metrics(run_dir, tmp_path):
    rows = loop.train(short_config(2), str(tmp_path))
    assert [strip_perf(r) for r in rows] == [strip_perf(r) for r in read_rows(run_dir)]


def test_resume_continues_from_latest_checkpoint(run_dir, tmp_path):
    # A copy of the 2-step run extended to 3 steps must resume at step 2, reuse the cached warm start and append
    # exactly one row.
    import shutil

    workdir = str(tmp_path / "resumed")
    shutil.copytree(run_dir, workdir)
    rows = loop.train(short_config(3), workdir)
    assert [r["step"] for r in rows] == [3]
    assert [r["step"] for r in read_rows(workdir)] == [1, 2, 3]


def test_evaluate_cli_prints_json_summary(run_dir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.evaluate",
            f"--workdir={run_dir}",
            "--num_episodes=16",
            "--batch_size=16",
            "--transcripts=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["checkpoint_step"], summary["env"], summary["greedy"]) == (2, "tictactoe", True)
    # The move task's default suite (every X-to-move position), cut to 16 episodes.
    for key in (
        "mean_reward",
        "tool_call_valid_rate",
        "cut_off_rate",
        "illegal_rate",
        "optimal_move_rate",
        "seeking_move_rate",
        "win_taken_rate",
        "num_episodes",
    ):
        assert f"positions/{key}" in summary, key
    assert not any(k.startswith(("positions_o/", "minimax/")) for k in summary)  # not default suites
    assert summary["positions/num_episodes"] == 16
    assert 0.0 <= summary["positions/tool_call_valid_rate"] <= 1.0
    suite_lines = [json.loads(line) for line in out.stdout.strip().splitlines()[:-1] if line.startswith("{")]
    assert [line["suite"] for line in suite_lines] == ["positions"]
    with open(os.path.join(run_dir, "eval_transcripts.txt")) as f:
        assert "<|im_start|>user" in f.read()


def test_evaluate_cli_lists_suites_and_names_unknown_ones(run_dir):
    out = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", f"--workdir={run_dir}", "--list_suites"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    listed = {line.split(":")[0]: line for line in out.stdout.strip().splitlines()}
    assert {"positions", "positions_o", "positions_both", "minimax", "random", "epsilon"} <= set(listed)
    assert "heldout" not in listed  # the run holds no boards out
    assert listed["positions"].endswith("2423 episodes (default)") and "(default)" not in listed["minimax"]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", f"--workdir={run_dir}", "--suites=positions,chess"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "unknown evaluation suite(s) ['chess']" in out.stderr and "'positions_o'" in out.stderr


def test_train_cli_rejects_unknown_config_field(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--config=configs/tictactoe_tiny.py",
            f"--workdir={tmp_path}",
            "--config.rl.no_such_field=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "no_such_field" in out.stderr


def test_forking_regulariser_schedule():
    from reno_jax.rl import learner

    sched = lambda step: float(learner.forking_entropy_schedule(100, hold=0.5, end=0.8)(step))
    assert [sched(s) for s in (0, 25, 50)] == [1.0, 1.0, 1.0]
    np.testing.assert_allclose([sched(60), sched(65), sched(70)], [2 / 3, 0.5, 1 / 3], rtol=1e-6)
    assert sched(80) == 0.0 and sched(99) == 0.0
    assert float(learner.forking_entropy_schedule(10, hold=1.0, end=1.0)(7)) == 1.0


def test_short_run_with_forking_kl_anchor(tmp_path):
    """The KL-anchored variant runs end to end and logs its regulariser."""
    c = short_config(2)
    c.rl.max_logp_shift = 0.0  # the update guard (tests/test_trainer.py) adds compile time and nothing to this test
    c.rl.entropy_coef = 0.0
    c.rl.forking_entropy_coef = 0.0
    c.rl.forking_kl_coef = 0.1
    c.rl.forking_entropy_hold = 0.0
    c.rl.forking_entropy_end = 1.0
    rows = loop.train(c, str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["train/forking_kl"]) for r in rows)
    assert rows[0]["train/forking_kl_coef"] == pytest.approx(0.1) and rows[1]["train/forking_kl_coef"] < 0.1
    c.rl.forking_entropy_coef = 0.1
    with pytest.raises(ValueError, match="alternatives"):
        loop.train(c, str(tmp_path / "both"))


def _short_game_config():
    from configs import tictactoe_tiny_game

    c = tictactoe_tiny_game.get_config()
    c.num_steps = 1
    c.model.tiny.num_hidden_layers = 2
    c.sft.num_steps = 2
    c.sft.batch_size = 4
    c.rollout.boards_per_step = 2
    c.rollout.group_size = 2
    c.rollout.max_turns = 2
    c.checkpoint_every = 1
    c.plot_every = 1
    return c


def test_short_game_run_with_game_warm_start(tmp_path):
    """Games from the first step: a warm start on whole games with soft targets, then multi-turn GSPO."""
    c = _short_game_config()
    del c["curriculum"]
    c.sft.soft_targets = True
    rows = loop.train(c, str(tmp_path))
    assert [r["step"] for r in rows] == [1] and "stage" not in rows[0]
    for key in ("rollout/win_rate", "rollout/loss_rate", "rollout/draw_rate", "rollout/illegal_rate"):
        assert 0.0 <= rows[0][key] <= 1.0
    assert os.path.isdir(tmp_path / "warmstart") and os.path.isfile(tmp_path / "learning_curves.png")


def test_game_config_curriculum_run_resume_and_evaluation(tmp_path):
    """The game config end to end: move-task stage (both sides), then games; extended, it resumes in the game
    stage; then the greedy evaluation against two opponents in one command."""
    c = _short_game_config()
    assert list(c.curriculum) == ["move"] and c.curriculum.move.env.task == "move"
    c.curriculum.move.num_steps = 1
    c.curriculum.move.sft.num_steps = 2
    c.curriculum.move.sft.batch_size = 4
    c.curriculum.move.rollout.boards_per_step = 2
    c.curriculum.move.rollout.group_size = 2
    workdir = str(tmp_path / "run")
    rows = loop.train(c, workdir)
    assert [(r["step"], r["stage"]) for r in rows] == [(1, 0), (2, 1)]
    assert "rollout/optimal_move_rate" in rows[0] and "rollout/win_rate" not in rows[0]
    assert 0.0 <= rows[1]["rollout/loss_rate"] <= 1.0
    c.num_steps = 2  # one more game step: resumes after step 2, in the game stage
    rows = loop.train(c, workdir)
    assert [(r["step"], r["stage"]) for r in rows] == [(3, 1)]
    assert [r["step"] for r in read_rows(workdir)] == [1, 2, 3]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.evaluate",
            f"--workdir={workdir}",
            "--suites=minimax,random",
            "--num_episodes=4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["checkpoint_step"] == 3
    assert figures["env"] == "tictactoe" and not any(k.startswith("epsilon/") for k in figures)
    for opp in ("minimax", "random"):
        assert figures[f"{opp}/num_episodes"] == 4
        for key in ("win_rate", "draw_rate", "loss_rate"):
            assert 0.0 <= figures[f"{opp}/{key}"] <= 1.0
    assert figures["minimax/win_rate"] == 0.0  # perfect play never loses
    assert "minimax/epsilon" not in figures  # only the epsilon opponent has one
    for opp in ("minimax", "random"):  # 2 games per side: the overall rate is the mean of the sides'
        for key in ("win_rate", "loss_rate"):
            assert figures[f"{opp}/{key}"] == (figures[f"{opp}/x/{key}"] + figures[f"{opp}/o/{key}"]) / 2


# ---------------------------------------------------------------------------------------------- user errors


def _cli(args, tmp_path):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _last_stderr_line(out):
    return out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""


def test_train_cli_names_the_bad_flag(tmp_path):
    out = _cli(["experiments.train_tictactoe", f"--workdir={tmp_path / 'w'}", "--config.num_steps=-3"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert _last_stderr_line(out).endswith("error: --config.num_steps must be an integer >= 1, got -3")
    assert not os.path.exists(tmp_path / "w"), "nothing is written for a config that cannot run"


def test_train_cli_rejects_a_workdir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("keep me")
    out = _cli(["experiments.train", "--config=configs/tictactoe_tiny.py", f"--workdir={path}"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert _last_stderr_line(out).endswith(
        f"error: --workdir={path} is a file; expected a directory (created if missing)"
    )
    assert path.read_text() == "keep me"


def test_evaluate_cli_on_a_directory_without_a_run(tmp_path):
    out = _cli(["experiments.evaluate", f"--workdir={tmp_path}"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"error: --workdir={tmp_path} holds no training run (no config.json)" in _last_stderr_line(out)
    missing = tmp_path / "missing"
    out = _cli(["experiments.evaluate", f"--workdir={missing}"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert _last_stderr_line(out).endswith(
        f"error: --workdir={missing} does not exist; expected the workdir of a training run"
    )
    assert not missing.exists()


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("rollout.group_size", 0, "--config.rollout.group_size must be an integer >= 1, got 0"),
        ("rl.loss", "ppo", "--config.rl.loss must be one of"),
        ("rollout.top_p", 1.5, "--config.rollout.top_p must be a number in (0, 1]"),
        ("env.opponent", "perfect", "--config.env.opponent must be one of"),
        ("env.max_random_moves", 10, "--config.env.max_random_moves must be an integer in [0, 9], got 10"),
        ("env.board_sides", "o", "--config.env.board_sides must be one of ['x', 'both'], got 'o'"),
        ("env.board_style", "fancy", "--config.env.board_style must be one of ['grid', 'labeled'], got 'fancy'"),
        ("rl.train_groups", 99, "--config.rl.train_groups=99 is more than"),
        (
            "rl.length_bucket",
            -1,
            "--config.rl.length_bucket must be an integer >= 0 (0: train at the full length), got -1",
        ),
        ("rl.num_microbatches", 3, "not divisible by --config.rl.num_minibatches x --config.rl.num_microbatches = 3"),
        ("model.path", "/no/such/model", "--config.model.path=/no/such/model does not exist"),
        ("model.quantize", "int8", "--config.model.quantize=int8 needs --config.lora.rank > 0"),
        ("model.quantize", "int4", "--config.model.quantize must be one of ['', 'int8']"),
        ("lora.targets", ("kda", "router"), "--config.lora.targets must be a non-empty tuple of ['kda', 'mla'"),
    ],
)
def test_config_errors_name_the_flag(field, value, needle, tmp_path):
    from reno_jax import errors

    c = short_config(2)
    section, name = field.split(".")
    c[section][name] = value
    with pytest.raises(errors.ConfigError) as info:
        loop.train(c, str(tmp_path / "w"))
    assert needle in str(info.value)
    assert not os.path.exists(tmp_path / "w")


def test_keep_checkpoints_zero_keeps_every_checkpoint(tmp_path):
    from reno_jax import errors
    from reno_jax.loop import config as loop_config

    c = short_config(2)
    c.keep_checkpoints = 0  # the play page's slider offers every saved step
    loop_config.validate_config(c)
    c.keep_checkpoints = -1
    with pytest.raises(errors.ConfigError, match=r"--config\.keep_checkpoints must be an integer >= 0"):
        loop_config.validate_config(c)


@pytest.mark.parametrize(
    "name,value,needle",
    [
        ("max_logp_shift", -0.1, "--config.rl.max_logp_shift must be >= 0"),
        ("shift_probe_groups", 0, "--config.rl.shift_probe_groups must be >= 1"),
        ("turn_advantage_coef", -1.0, "--config.rl.turn_advantage_coef must be >= 0"),
        ("turn_discount", 0.0, "--config.rl.turn_discount must be in (0, 1]"),
        ("turn_scope", "episode", "--config.rl.turn_scope must be 'group' or 'batch'"),
        (
            "turn_advantage_coef",
            1.0,
            "--config.rl.turn_advantage_coef gives every token its own advantage; "
            "--config.rl.loss=gspo takes one per sequence",
        ),
    ],
)
def test_update_guard_and_turn_credit_flags_are_checked(tmp_path, name, value, needle):
    import re

    from reno_jax import errors

    c = short_config(2)
    c.rl[name] = value
    with pytest.raises(errors.ConfigError, match=re.escape(needle)):
        loop.train(c, str(tmp_path / "w"))
    assert not os.path.exists(tmp_path / "w")


def test_load_run_errors_and_abstract_restore_target(run_dir, tmp_path):
    import shutil

    from reno_jax import errors
    from reno_jax.loop import runs

    empty = tmp_path / "no_checkpoint"
    empty.mkdir()
    shutil.copy(os.path.join(run_dir, "config.json"), empty / "config.json")
    with pytest.raises(errors.RunError, match="no checkpoint yet"):
        runs.load_run(str(empty))
    with pytest.raises(errors.RunError, match=r"--step=7 has no checkpoint .* saved steps: \[1, 2\]"):
        runs.load_run(run_dir, step=7)
    _, _, _, params, step = runs.load_run(run_dir, step=1)
    assert step == 1 and all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    with pytest.raises(errors.RunError, match="warm-start cache .* is missing"):  # config.json, no warmstart/
        runs.load_warm_start(str(empty))
    cold = tmp_path / "cold"
    cold.mkdir()
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    config["sft"]["num_steps"] = 0
    (cold / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.RunError, match="no warm start"):
        runs.load_warm_start(str(cold))


def test_rollout_config_keeps_every_rollout_field():
    from reno_jax.loop import build

    c = short_config(1)
    c.rollout.cache_dtype = "bfloat16"
    c.rollout.prefill_chunk = 16
    c.rollout.stop_at_tool_call = False
    c.rollout.share_prompt_prefill = False
    c.rollout.parse_max_bytes = 96
    rc = build.rollout_config(c)
    assert (rc.cache_dtype, rc.prefill_chunk, rc.stop_at_tool_call, rc.share_prompt_prefill, rc.parse_max_bytes) == (
        "bfloat16",
        16,
        False,
        False,
        96,
    )
    c.rollout.parse_max_bytes = 0
    assert build.rollout_config(c).parse_max_bytes is None


def test_short_run_with_routing_replay(tmp_path):
    """rl.routing_replay end to end (rollout records, shared-prefix train step replays, 2 micro-batches): the
    mismatch metrics are written; in float32 the train forward routes like the rollout and scores its tokens."""
    c = short_config(1)
    c.rl.max_logp_shift = 0.0  # as above: the guard is not what this test is about
    c.rl.routing_replay = True
    c.rl.num_microbatches = 2
    rows = loop.train(c, str(tmp_path))
    assert [r["step"] for r in rows] == [1]
    row = rows[0]
    assert row["train/routing_agreement"] > 0.99
    assert 0.0 <= row["train/rollout_logp_abs_diff_mean"] <= row["train/rollout_logp_abs_diff_max"] < 1e-3
    assert 0.0 <= row["train/rollout_k3_kl"] < 1e-6 and abs(row["train/rollout_ratio_max"] - 1.0) < 1e-3


def test_lora_int8_run_trains_adapters_resumes_exactly_and_exports_merged(tmp_path):
    """`lora.rank > 0` over an int8 base through `loop.train`: the rollout and the train step run the same adapted
    int8 weights (the same log-probs, the same experts, replayed); checkpoints hold the adapters and their optimizer
    state only, and a run resumed from one continues bit for bit (its base rebuilt from the config and the cached
    warm start); the play page and evaluation read it; the export is the merged float model, with the adapted
    model's logits."""
    import shutil

    from experiments import convert_checkpoint as cc
    from reno_jax.checkpoint import orbax as ckpt_lib
    from reno_jax.models import conversion, ling3, quant
    from reno_jax.play import run_dir

    def config():
        c = short_config(3)
        c.lora.rank, c.model.quantize, c.keep_checkpoints = 4, "int8", 3
        c.rl.max_logp_shift = 0.0  # the guard over a frozen tree: tests/test_trainer.py (a smaller program here)
        c.rl.routing_replay = True  # the rollout's experts replayed by the adapted int8 train forward
        return c

    workdir = str(tmp_path / "lora")
    rows = loop.train(config(), workdir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["train/rollout_logp_abs_diff_max"] for r in rows) <= 1e-4  # B != 0 from step 2 on
    assert min(r["train/routing_agreement"] for r in rows) == 1.0
    run = loop.load_checkpoint(workdir)
    assert run.step == 3 and any(
        isinstance(x, quant.QArray) for x in jax.tree.leaves(run.base, is_leaf=lambda x: isinstance(x, quant.QArray))
    )
    trained = {"/".join(map(str, k)): v for k, v in jax.tree_util.tree_flatten_with_path(run.trained)[0]}
    assert trained and all(k.endswith(("['a']", "['b']")) for k in trained)
    assert any(np.abs(np.asarray(v)).max() > 0 for k, v in trained.items() if k.endswith("['b']"))
    with ckpt_lib.Checkpointer(workdir, async_save=False) as ckpt:
        saved = ckpt._manager.item_metadata(3)["state"].tree
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    assert size(saved["params"]) == size(run.trained) < size(run.base) / 2
    assert size(saved["opt_state"]) <= 2 * size(run.trained) + 8  # Adam's moments of the adapters, counters

    resumed = tmp_path / "resumed"
    shutil.copytree(workdir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "3")
    again = loop.train(config(), str(resumed))
    assert [strip_perf(r) for r in again] == [strip_perf(rows[-1])]
    for a, b in zip(jax.tree.leaves(loop.load_checkpoint(str(resumed)).trained), jax.tree.leaves(run.trained)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()

    played = run_dir.RunDir(workdir).restore_params(3)
    ids = jax.random.randint(jax.random.key(0), (2, 16), 0, run.model_config.vocab_size)
    forward = jax.jit(lambda p: ling3.forward(p, run.model_config, ids)[0])
    adapted = np.asarray(forward(run.params))
    np.testing.assert_array_equal(np.asarray(forward(played)), adapted)

    cc.orbax_to_hf(workdir, tmp_path / "hf")
    hf_config, exported = conversion.from_pretrained(tmp_path / "hf")
    assert hf_config == run.model_config
    assert not any(
        isinstance(x, quant.QArray) for x in jax.tree.leaves(exported, is_leaf=lambda x: isinstance(x, quant.QArray))
    )
    np.testing.assert_allclose(np.asarray(forward(exported)), adapted, atol=1e-4, rtol=0)
    if importlib.util.find_spec("torch"):  # the bench extra; .ci/run installs it before the slow tier
        from reno_jax.models import hf_native

        figures = hf_native.compare_logits(tmp_path / "hf", np.asarray(ids))  # transformers' own class
        assert figures["schedule_matches"] and figures["max_abs_logit_diff"] <= 1e-4, figures


def test_compilation_cache_flag(tmp_path, monkeypatch):
    from experiments import cli

    before = jax.config.jax_compilation_cache_dir
    assert cli.use_compilation_cache("") is None
    assert cli.use_compilation_cache(str(tmp_path)) is None  # the test session names its own cache: that one wins
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    try:
        directory = cli.use_compilation_cache(str(tmp_path / "cache"))
        assert directory == str(tmp_path / "cache" / cli.host_fingerprint()) and os.path.isdir(directory)
        assert jax.config.jax_compilation_cache_dir == directory
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert len(cli.host_fingerprint()) == 12 and cli.host_fingerprint() == cli.host_fingerprint()
    (tmp_path / "file").write_text("")
    with pytest.raises(cli.UserError, match="--compilation_cache=.*--compilation_cache= to compile without"):
        cli.use_compilation_cache(str(tmp_path / "file"))
