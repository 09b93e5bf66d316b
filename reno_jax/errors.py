"""The two errors a user's settings can raise, shared by every layer that reads a config or a workdir."""


class ConfigError(ValueError):
    """A config value a user set on the command line (or in a config file) that cannot work.

    The message names the field as its command-line flag (``--config.num_steps``) and what is expected, so the
    entry points can end with that one line instead of a traceback from deep inside the library.
    """


class RunError(ValueError):
    """A training workdir that does not hold what was asked of it (no run, no checkpoint yet, no such step)."""


def as_config_error(error: Exception) -> ConfigError:
    """An environment factory's ValueError / KeyError / TypeError as a `ConfigError` naming the flag: a message that
    starts with a field's path (`env.x ...`, `sft.x ...`) names it, any other is put on `--config.env`."""
    if isinstance(error, ConfigError):
        return error
    message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    named = message.startswith(("env.", "sft."))
    return ConfigError(f"--config.{message}" if named else f"--config.env: {message}")
