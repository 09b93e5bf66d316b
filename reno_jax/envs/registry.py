"""Environments by name: what the training loop, the evaluation and the play page look up.

An entry says how to build the `TextEnv` from a config's `env` section and everything else the loop needs from
an environment (`reno_jax.envs.interface`):

    registry.register(
        "my_env",
        make_env=lambda env_config, **overrides: MyEnv(...),            # overrides: an evaluation suite's
        make_sampler=lambda config: lambda key, num_groups: starts,      # a step's start records (host)
        make_teacher=lambda config, env: interface.Teacher(...),         # optional: the supervised warm start
        eval_suites=lambda config: {"all": interface.EvalSuite(...)},    # optional: evaluation
        board_view=lambda config: interface.BoardView(...),              # optional: the play page's board
    )

An environment in a package of its own registers itself when its module is imported; a config names that module
(`env.module = "my_pkg.my_env"`) and `entry_for(config.env)` imports it before looking the name up. The built-in
environments are imported the same way, by module path, when first asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

from reno_jax.envs import interface


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered environment.

    make_env: ``(env_config, **overrides) -> TextEnv`` (raises ValueError naming the field on a bad setting).
    make_sampler: ``config -> (key, num_groups) -> starts``: a training step's start records, one per group (a
      host function called once per step outside jit; the returned starts are arrays with a leading group axis).
    make_teacher: optional ``(config, env) -> interface.Teacher``: the scripted policy of the warm start.
    eval_suites: optional ``config -> {name: interface.EvalSuite}``: the evaluations the environment offers.
    board_view: optional ``config -> interface.BoardView``: how the play page draws the board and lets a person
      play on it; without one the page shows episodes as transcripts.
    """

    name: str
    make_env: Callable[..., interface.TextEnv]
    make_sampler: Callable[[Any], Callable[[Any, int], Any]]
    make_teacher: Callable[[Any, interface.TextEnv], interface.Teacher] | None = None
    eval_suites: Callable[[Any], Mapping[str, interface.EvalSuite]] | None = None
    board_view: Callable[[Any], interface.BoardView] | None = None


_ENTRIES: dict[str, Entry] = {}
_BUILTIN = {
    "tictactoe": "reno_jax.envs.tictactoe.registration",
    "connect4": "reno_jax.envs.connect4.registration",
    "guess_number": "reno_jax.envs.guess_number",
    "sokoban": "reno_jax.envs.sokoban.registration",
}


def register(
    name: str,
    make_env: Callable[..., interface.TextEnv],
    make_sampler: Callable[[Any], Callable[[Any, int], Any]],
    make_teacher: Callable[[Any, interface.TextEnv], interface.Teacher] | None = None,
    *,
    eval_suites: Callable[[Any], Mapping[str, interface.EvalSuite]] | None = None,
    board_view: Callable[[Any], interface.BoardView] | None = None,
) -> Entry:
    """Registers (or replaces) an environment under `name`; returns its entry."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an environment name must be a non-empty string, got {name!r}")
    optional = (("board_view", board_view),) if board_view is not None else ()
    for what, fn in (("make_env", make_env), ("make_sampler", make_sampler), *optional):
        if not callable(fn):
            raise TypeError(f"register({name!r}): {what} must be callable, got {fn!r}")
    entry = Entry(
        name=name,
        make_env=make_env,
        make_sampler=make_sampler,
        make_teacher=make_teacher,
        eval_suites=eval_suites,
        board_view=board_view,
    )
    _ENTRIES[name] = entry
    return entry


def names() -> list[str]:
    return sorted(set(_ENTRIES) | set(_BUILTIN))


def import_module(path: str) -> None:
    """Imports the module that registers an environment (`env.module`); errors name the setting."""
    try:
        importlib.import_module(path)
    except ImportError as error:
        raise ValueError(f"env.module={path!r} cannot be imported ({error}); is its package on PYTHONPATH?") from None


def get(name: str) -> Entry:
    if name not in _ENTRIES and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])  # registers itself
    if name not in _ENTRIES:
        raise ValueError(
            f"unknown environment {name!r}; registered: {names()} (an environment of your own: set "
            "env.module to the module that registers it)"
        )
    return _ENTRIES[name]


def entry_for(env_config) -> Entry:
    """The entry a config's `env` section names (`env.name`), after importing `env.module` when set."""
    module = str(env_config.get("module", "") or "")
    if module:
        import_module(module)
    name = env_config.get("name", "")
    if not name:
        raise ValueError("env.name is not set; registered environments: " + ", ".join(names()))
    return get(str(name))


def make(env_config, **overrides) -> interface.TextEnv:
    """The `TextEnv` of a config's `env` section; `overrides` replace fields (an evaluation suite's)."""
    return entry_for(env_config).make_env(env_config, **overrides)
