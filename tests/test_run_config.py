"""The typed run config (`reno_jax.run_config`): loading a ConfigDict (unknown fields, types, checks named by the
flag), the game-free base config, every check before anything is written, and saved configs of older code."""

import dataclasses
import json
import os

import ml_collections
import pytest

from configs import base, connect4_tiny, tictactoe_tiny
from reno_jax import loop, run_config
from reno_jax.errors import ConfigError, RunError
from reno_jax.loop import runs
from reno_jax.models import lora
from reno_jax.rollout import rollout as rollout_lib

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_base_config_is_the_library_defaults_and_has_no_game():
    c = base.get_config()
    assert c.to_dict() == run_config.RunConfig().to_dict()
    assert c.env.to_dict() == {"name": "", "module": ""}
    assert run_config.load(c) == run_config.RunConfig()


def test_every_field_is_documented():
    for cls in (
        run_config.RunConfig,
        run_config.ModelSettings,
        run_config.SftSettings,
        run_config.RolloutSettings,
        run_config.RlSettings,
        run_config.LoraSettings,
        run_config.TinyArchitecture,
    ):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"


def test_load_gives_typed_sections():
    c = run_config.load(tictactoe_tiny.get_config())
    assert c.rl.max_logp_shift == 0.2 and c.rollout.max_new_tokens == 9 and c.env.name == "tictactoe"
    assert c.rollout_config() == rollout_lib.RolloutConfig(max_new_tokens=9, group_size=8, max_turns=0)
    assert c.learner_config().forking_schedule and c.learner_config().forking_entropy_hold == 0.5
    assert c.lora.lora_config() == lora.LoraConfig()  # rank 0: no adapters
    assert run_config.load(c) is c


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rl.max_logp_shift", -1.0, "--config.rl.max_logp_shift must be >= 0 (0: off), got -1.0"),
        ("rollout.top_p", 1.5, "--config.rollout.top_p must be a number in (0, 1]"),
        ("num_steps", 0, "--config.num_steps must be an integer >= 1"),
        ("rl.turn_scope", "world", "--config.rl.turn_scope must be 'group' or 'batch'"),
        ("lora.targets", ("kda", "nope"), "--config.lora.targets must be a non-empty tuple"),
    ],
)
def test_bad_values_name_the_flag(field, value, message):
    values = tictactoe_tiny.get_config().to_dict()
    section, _, name = field.rpartition(".")
    (values[section] if section else values)[name] = value
    with pytest.raises(ConfigError) as info:
        run_config.load(values)
    assert str(info.value).startswith(message)


def test_unknown_fields_and_wrong_types_name_the_flag():
    values = tictactoe_tiny.get_config().to_dict()
    values["rl"]["max_logp_shfit"] = 0.1
    with pytest.raises(ConfigError, match=r"--config\.rl\.max_logp_shfit: the rl section has no such field"):
        run_config.load(values)
    values = tictactoe_tiny.get_config().to_dict()
    values["rollout"]["group_size"] = 8.5
    with pytest.raises(ConfigError, match=r"--config\.rollout\.group_size must be an integer, got 8.5"):
        run_config.load(values)
    values["rollout"]["group_size"] = 8
    values["rl"]["kl_coef"] = 1  # an int where a float is expected is taken as that float
    assert run_config.load(values).rl.kl_coef == 1.0 and isinstance(run_config.load(values).rl.kl_coef, float)


def test_the_common_prefix_alone_is_a_setting():
    c = tictactoe_tiny.get_config()
    c.rl.share_prompt_prefix = False  # share_common_prefix stays: the system prompt once per batch
    assert run_config.load(c).learner_config().share_common_prefix


def test_rollout_history_reaches_the_rollout_config_and_needs_rows_of_their_own():
    c = tictactoe_tiny.get_config()
    assert run_config.load(c).rollout_config().history is None  # -1: the whole conversation
    c.rollout.history = 2
    with pytest.raises(ConfigError, match="--config.rollout.history=2 trains on turn samples"):
        run_config.load(c)
    c.rl.share_prompt_prefix = False  # the common prefix alone applies to turn samples
    assert run_config.load(c).rollout_config().history == 2
    c.rl.row_bucket = 3  # rows per step split in num_microbatches pieces
    c.rl.num_microbatches = 2
    with pytest.raises(ConfigError, match=r"--config\.rl\.row_bucket=3 must be a multiple"):
        run_config.load(c)
    c.rl.row_bucket = 64
    assert run_config.load(c).learner_config().row_bucket == 64


def _connect4(**sft):
    c = connect4_tiny.get_config()
    c.num_steps, c.sft.num_steps, c.sft.batch_size = 1, 1, 4
    for name, value in sft.items():
        c.sft[name] = value
    return c


@pytest.mark.parametrize(
    "sft, flag", [(dict(teacher="oracle"), "--config.sft.teacher"), (dict(explore=0.5), "--config.sft.explore")]
)
def test_teacher_options_are_checked_before_anything_is_written(tmp_path, sft, flag):
    workdir = str(tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        loop.train(_connect4(**sft), workdir)
    assert str(info.value).startswith(flag)
    assert not os.path.exists(os.path.join(workdir, "config.json"))


def _expected_old_run():
    """What the code that wrote tests/data/old_run_config_tictactoe.json (the default run, 30 steps after a
    20-step warm start, a checkpoint every 10) ran with."""
    c = tictactoe_tiny.get_config()
    c.num_steps, c.sft.num_steps, c.checkpoint_every = 30, 20, 10
    c.rollout.max_turns = 1  # written out then; today 0, the environment's own (1 for tic-tac-toe moves)
    return run_config.load(c)


def test_saved_config_of_the_old_code_loads_as_it_ran():
    with open(os.path.join(DATA, "old_run_config_tictactoe.json")) as f:
        saved = json.load(f)
    assert run_config.upgrade(saved) == _expected_old_run()


def test_older_saved_config_gets_the_old_defaults():
    """A config.json of the code before rl.share_common_prefix (74efe6a^): the fields added since get what that
    code's `config.rl.get(...)` used, not today's defaults."""
    with open(os.path.join(DATA, "old_run_config_tictactoe_74efe6a.json")) as f:
        saved = json.load(f)
    assert "share_common_prefix" not in saved["rl"] and "lora" not in saved
    upgraded = run_config.upgrade(saved)
    expected = _expected_old_run()
    expected = dataclasses.replace(
        expected,
        eval_suites="",
        model=dataclasses.replace(expected.model, quantize=""),
        sft=dataclasses.replace(expected.sft, length_pool=1, eval_every=0),
        rl=dataclasses.replace(
            expected.rl,
            share_common_prefix=False,
            max_logp_shift=0.0,
            shift_probe_groups=8,
            turn_advantage_coef=0.0,
            turn_discount=1.0,
            turn_scope="group",
            logits_chunk=0,
            length_bucket=0,
        ),
        lora=run_config.LoraSettings(),
    )
    assert upgraded == expected
    assert upgraded.learner_config().share_common_prefix is False
    assert upgraded.lora.lora_config() == lora.LoraConfig()


def test_one_reader_of_saved_runs(tmp_path):
    with pytest.raises(RunError, match="does not exist"):
        runs.read_run_config(str(tmp_path / "none"))
    with pytest.raises(RunError, match="no config.json"):
        runs.read_run_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RunError, match="not readable JSON"):
        runs.read_run_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"rl": {"no_such_field": 1}}))
    with pytest.raises(RunError, match="rl.no_such_field"):
        runs.read_run_config(str(tmp_path))


def test_curriculum_stage_errors_name_the_stage():
    c = tictactoe_tiny.get_config()
    c.curriculum = ml_collections.ConfigDict(dict(a=dict(num_steps=2, rl=dict(max_logp_shift=-1.0))))
    with pytest.raises(ConfigError, match=r"curriculum stage 'a' \(--config.curriculum.a\): --config.rl.max_logp"):
        from reno_jax.loop import config as loop_config

        loop_config.validate_config(c)


def test_turn_limit_comes_from_the_environment():
    """rollout.max_turns 0 (the default) plays the environment's own max_turns(); more than it allows, or 0 where
    it sets none, is one ConfigError naming the flag."""
    from reno_jax.loop import config as loop_config
    from reno_jax.loop import evaluation

    class Env:
        def __init__(self, bound):
            self.env = self
            self.max_turns = lambda: bound

    assert rollout_lib.num_turns(Env(8), rollout_lib.RolloutConfig(max_turns=0)) == 8
    assert rollout_lib.num_turns(Env(8), rollout_lib.RolloutConfig(max_turns=3)) == 3
    loop_config.check_turns(0, 8, "frozen_lake")
    with pytest.raises(ConfigError, match=r"^--config.rollout.max_turns=9 is more than env.name='frozen_lake' allows"):
        loop_config.check_turns(9, 8, "frozen_lake")
    with pytest.raises(ConfigError, match=r"^--config.rollout.max_turns=0 takes the environment's own"):
        loop_config.check_turns(0, evaluation.UNBOUNDED_TURNS, "frozen_lake")


SHIPPED_CONFIGS = sorted(
    name[:-3]
    for name in os.listdir(os.path.join(os.path.dirname(__file__), "..", "configs"))
    if name.endswith(".py") and name not in ("__init__.py", "base.py")  # base: no environment (its own test)
)


NEEDS_REASONING_GYM = ("arithmetic_calculator_tiny", "reasoning_gym_tiny")  # their tasks are Reasoning Gym datasets


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_every_shipped_config_passes_the_checks(name):
    """Each file in configs/ loads as typed sections and passes every check a run makes before it writes."""
    import importlib
    import importlib.util

    from reno_jax.loop import config as loop_config

    c = importlib.import_module(f"configs.{name}").get_config()
    assert isinstance(run_config.load(c), run_config.RunConfig)
    if name in NEEDS_REASONING_GYM and importlib.util.find_spec("reasoning_gym") is None:
        # the optional `tasks` extra (the fast tier runs without it): the run stops with how to install it
        with pytest.raises(ImportError, match=r'pip install -e "\.\[tasks\]"'):
            loop_config.validate_config(c)
        return
    loop_config.validate_config(c)


def test_sokoban_solve_names_every_setting_it_changes():
    """`sokoban_tiny_solve` is `sokoban_tiny` with a few settings changed; its docstring says why for each of them,
    so a setting changed without a word fails here."""
    from configs import sokoban_tiny, sokoban_tiny_solve
    from reno_jax.loop.curriculum import _flatten  # the dotted names the curriculum's overrides use

    base_values, solve_values = _flatten(sokoban_tiny.get_config()), _flatten(sokoban_tiny_solve.get_config())
    assert base_values.keys() == solve_values.keys()
    changed = {k for k in base_values if base_values[k] != solve_values[k]}
    assert "env.coordinates" in changed and "rl.num_minibatches" in changed
    doc = sokoban_tiny_solve.__doc__
    unnamed = [k for k in changed if k not in ("num_steps", "eval_every") and k.split(".")[-1] not in doc]
    assert not unnamed, f"changed without a word in the docstring: {unnamed}"
