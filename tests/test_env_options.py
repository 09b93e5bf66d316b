"""An environment's own options (`registry.register(options=...)`): set from the command line like any field
(`--config.env.NAME=VALUE`), checked against their defaults' types in one line naming the flag, seen by every
factory with the defaults filled in."""

import ml_collections
import pytest

from experiments import cli
from reno_jax import run_config
from reno_jax.envs import registry
from reno_jax.errors import ConfigError, as_config_error


def _entry(seen):
    return registry.with_options(
        registry.Entry(
            name="frozen_lake",
            make_env=lambda env_config, **overrides: seen.append(("env", env_config.size, env_config.slippery)),
            make_sampler=lambda config: seen.append(("sampler", config.env.size)),
        ),
        {"size": 4, "slippery": False, "reward": 1.0},
    )


def test_factories_see_the_options_with_their_defaults():
    seen = []
    entry = _entry(seen)
    entry.make_env(ml_collections.ConfigDict({"name": "frozen_lake", "size": 8}))
    entry.make_env(None)  # the docs' "try it without a model": every default
    config = run_config.load({"env": {"name": "frozen_lake", "slippery": True, "reward": 2}})
    entry.make_sampler(config)
    assert seen == [("env", 8, False), ("env", 4, False), ("sampler", 4)]
    values = registry.option_values(config.env, entry.options, "frozen_lake")
    assert values.reward == 2.0 and isinstance(values.reward, float) and values.slippery is True


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"random_map": True},
            "--config.env.random_map: unknown option of environment 'frozen_lake' (options: size, slippery, reward)",
        ),
        ({"size": "8"}, "--config.env.size must be int, got str ('8')"),
        ({"slippery": 1}, "--config.env.slippery must be bool, got int (1)"),
    ],
)
def test_a_bad_option_is_one_line_naming_the_flag(env, message):
    with pytest.raises(ValueError) as info:
        _entry([]).make_env(ml_collections.ConfigDict({"name": "frozen_lake", **env}))
    assert str(as_config_error(info.value)) == message
    assert isinstance(as_config_error(info.value), ConfigError)


def test_command_line_options_reach_the_env_section():
    argv = [
        "train",
        "--config=c.py",
        "--config.env.random_map=True",
        "--config.env.size=8",
        "--config.env.map=SFFF",
        "--config.num_steps=3",
    ]
    rest, options = cli.split_env_options(argv)
    assert rest == ["train", "--config=c.py", "--config.num_steps=3"]
    assert options == {"random_map": "True", "size": "8", "map": "SFFF"}
    config = ml_collections.ConfigDict({"env": {"name": "frozen_lake", "module": "", "size": 4, "label": "a"}})
    config.lock()
    config = cli.with_env_options(config, dict(options, label="7"))
    assert config.env.to_dict() == {
        "name": "frozen_lake",
        "module": "",
        "size": 8,
        "label": "7",
        "random_map": True,
        "map": "SFFF",
    }
    with pytest.raises(cli.UserError, match=r"^--config.env.size must be int, got 'big'$"):
        cli.with_env_options(config, {"size": "big"})
    # another environment than the file's: the file's settings were its own
    config = cli.with_env_options(config, {"name": "echo", "module": "my_pkg.echo", "numbers": "5"})
    assert config.env.to_dict() == {"name": "echo", "module": "my_pkg.echo", "numbers": 5}
