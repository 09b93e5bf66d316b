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
                                                                         #   (a one-player puzzle: PuzzleView)
        options={"size": 4, "random_map": False},                        # optional: the env section's settings
    )

`options` names the settings of the `env` section with their defaults: `--config.env.size=8` sets one from the
command line, an unknown one or a value of another type is one error naming the flag, and every factory sees the
section with the defaults filled in (`env_config.size`, `config.env.size`). Without `options` the section is
handed over as written and the factories check it themselves.

An environment in a package of its own registers itself when its module is imported; a config names that module
(`env.module = "my_pkg.my_env"`) and `entry_for(config.env)` imports it before looking the name up. The built-in
environments are imported the same way, by module path, when first asked for.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from typing import Any, Callable, Iterable, Mapping

import ml_collections

from reno_jax.envs import interface


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered environment.

    make_env: ``(env_config, **overrides) -> TextEnv`` (raises ValueError naming the field on a bad setting).
    make_sampler: ``config -> (key, num_groups) -> starts``: a training step's start records, one per group (a
      host function called once per step outside jit; the returned starts are arrays with a leading group axis).
    make_teacher: optional ``(config, env) -> interface.Teacher``: the scripted policy of the warm start.
    eval_suites: optional ``config -> {name: interface.EvalSuite}``: the evaluations the environment offers.
    board_view: optional ``config -> interface.BoardView`` (a two-sided game) or ``interface.PuzzleView`` (a
      one-player puzzle): how the play page draws the board and lets a person play on it; without one the page
      shows episodes as transcripts.
    options: the `env` section's settings and their defaults (None: not declared, the section goes as written).
    tokenizer_corpus: optional ``config -> iterable of str``: texts of the environment's own for the tokenizer
      `model.tokenizer="env"` builds (`reno_jax.loop.tokenizers`), beside its rendered chat.
    env_class: the `TextEnv` class the entry was made from (`register_env`), else None.
    """

    name: str
    make_env: Callable[..., interface.TextEnv]
    make_sampler: Callable[[Any], Callable[[Any, int], Any]]
    make_teacher: Callable[[Any, interface.TextEnv], interface.Teacher] | None = None
    eval_suites: Callable[[Any], Mapping[str, interface.EvalSuite]] | None = None
    board_view: Callable[[Any], interface.BoardView | interface.PuzzleView] | None = None
    options: Mapping[str, Any] | None = None
    tokenizer_corpus: Callable[[Any], Iterable[str]] | None = None
    env_class: type | None = None


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
    board_view: Callable[[Any], interface.BoardView | interface.PuzzleView] | None = None,
    options: Mapping[str, Any] | None = None,
    tokenizer_corpus: Callable[[Any], Iterable[str]] | None = None,
) -> Entry:
    """Registers (or replaces) an environment under `name`; returns its entry. With `options` every factory
    sees the `env` section checked against them and their defaults filled in (`with_options`)."""
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
        tokenizer_corpus=tokenizer_corpus,
    )
    if options is not None:
        entry = with_options(entry, dict(options))
    _ENTRIES[name] = entry
    return entry


def register_env(env_class: type[interface.TextEnv]) -> type[interface.TextEnv]:
    """Registers a `TextEnv` class that declares everything the loop needs itself (usable as a class decorator):
    its ``name`` (a class attribute), its options (`TextEnv.option_defaults`: the non-pytree fields with defaults,
    settable as ``--config.env.NAME=value``), and the methods `sample_starts`, `teacher`, `eval_suites`,
    `board_view`, `tokenizer_corpus` of the environment built from the config (`TextEnv.from_options`)."""
    name = getattr(env_class, "name", None)
    if not (isinstance(env_class, type) and issubclass(env_class, interface.TextEnv)):
        raise TypeError(f"register_env takes a TextEnv subclass, got {env_class!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{env_class.__name__} needs a class attribute name (a non-empty string) to be registered")
    if not dataclasses.is_dataclass(env_class):
        raise TypeError(f"{env_class.__name__} must be a flax.struct.dataclass (a pytree argument of the rollout)")
    options = env_class.option_defaults()
    clash = sorted(set(options) & set(RESERVED))
    if clash:
        raise TypeError(f"{env_class.__name__}: the option names {clash} are the env section's own; rename them")

    def make_env(env_config, **overrides):
        values = {k: env_config[k] for k in options}
        return env_class.from_options(**{**values, **overrides})

    def own(method: str) -> bool:
        return getattr(env_class, method) is not getattr(interface.TextEnv, method)

    def built(config) -> interface.TextEnv:  # from a whole config (None: every option at its default)
        return make_env(option_values(None if config is None else config.env, options, name))

    def of_env(method: str):
        return (lambda config: getattr(built(config), method)()) if own(method) else None

    entry = register(
        name,
        make_env,
        lambda config: built(config).sample_starts,
        (lambda config, env: env.teacher()) if own("teacher") else None,
        eval_suites=of_env("eval_suites"),
        board_view=of_env("board_view"),
        options=options,
        tokenizer_corpus=of_env("tokenizer_corpus"),
    )
    _ENTRIES[name] = dataclasses.replace(entry, env_class=env_class)
    return env_class


def entry_of(env: Entry | type) -> Entry:
    """The registered entry of `env`: an `Entry` (`register`'s) or a class `register_env` registered."""
    if isinstance(env, Entry):
        return env
    entry = _ENTRIES.get(getattr(env, "name", None)) if isinstance(env, type) else None
    if entry is None or entry.env_class is not env:
        raise ValueError(
            f"{env!r} is not a registered environment: pass registry.register(...)'s entry, or a class "
            "registry.register_env registered"
        )
    return entry


RESERVED = ("name", "module")  # the env section's own fields, not the environment's options


def option_values(env_config, options: Mapping[str, Any], name: str) -> ml_collections.ConfigDict:
    """The `env` section with `options`' defaults filled in, checked: an unknown setting or a value of another
    type than its default's raises one ValueError naming the field (`env.NAME ...`, a flag once prefixed)."""
    given = {} if env_config is None else dict(ml_collections.ConfigDict(env_config).to_dict())
    for field, value in given.items():
        if field in RESERVED:
            continue
        if field not in options:
            raise ValueError(
                f"env.{field}: unknown option of environment {name!r} (options: {', '.join(options) or 'none'})"
            )
        default = options[field]
        kind = type(default)
        fits = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, fits = float(value), True
        if not fits:
            raise ValueError(f"env.{field} must be {kind.__name__}, got {type(value).__name__} ({value!r})")
        given[field] = value
    return ml_collections.ConfigDict({**dict(options), **given})


def with_options(entry: Entry, options: dict) -> Entry:
    """`entry` whose factories see the `env` section through `option_values` (the `env_config` of `make_env`, the
    `config.env` of the others)."""

    def filled(config):
        if config is None or not hasattr(config, "env"):
            return config
        values = option_values(config.env, options, entry.name)
        if dataclasses.is_dataclass(config):
            return dataclasses.replace(config, env=values)
        config = copy.deepcopy(config)  # the caller's stays as written
        with config.unlocked():
            config.env = values
        return config

    def on_config(factory):
        return None if factory is None else functools.wraps(factory)(lambda config, *a: factory(filled(config), *a))

    return dataclasses.replace(
        entry,
        make_env=lambda env_config, **overrides: entry.make_env(
            option_values(env_config, options, entry.name), **overrides
        ),
        make_sampler=on_config(entry.make_sampler),
        make_teacher=on_config(entry.make_teacher),
        eval_suites=on_config(entry.eval_suites),
        board_view=on_config(entry.board_view),
        tokenizer_corpus=on_config(entry.tokenizer_corpus),
        options=options,
    )


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
