"""Environments by name, for the generic training command (`python -m experiments.train --config=...`).

An entry says how to build the `TextEnv` from a config's `env` section and how to draw a step's start records:

    registry.register("my_env", make_env=lambda env_config, **overrides: MyEnv(...),
                      make_sampler=lambda config: lambda key, num_groups: my_starts(key, num_groups))

Built-in entries import their package only when used.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Entry:
    """`make_env(env_config, **overrides) -> TextEnv`; `make_sampler(config) -> (key, num_groups) -> starts`
    (host function; called once per step outside jit); optional `make_teacher(config, env) -> (teacher, calls)`
    for the supervised warm start (`rl.sft.env_transcripts`: `teacher(state, key) -> (row, support)` per episode,
    `calls` the call-table rows as `(tool_name, {argument: value})`)."""

    make_env: Callable[..., Any]
    make_sampler: Callable[[Any], Callable[[Any, int], Any]]
    make_teacher: Callable[..., Any] | None = None


_ENTRIES: dict[str, Entry] = {}
_BUILTIN = {"tictactoe": "reno_jax.envs.tictactoe.env", "connect4": "reno_jax.envs.connect4.env",
            "guess_number": "reno_jax.envs.guess_number"}


def register(name: str, make_env: Callable[..., Any], make_sampler: Callable[[Any], Callable[[Any, int], Any]],
             make_teacher: Callable[..., Any] | None = None):
    """Registers (or replaces) an environment under `name`."""
    _ENTRIES[name] = Entry(make_env=make_env, make_sampler=make_sampler, make_teacher=make_teacher)


def names() -> list[str]:
    return sorted(set(_ENTRIES) | set(_BUILTIN))


def get(name: str) -> Entry:
    if name not in _ENTRIES and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])  # registers itself
    if name not in _ENTRIES:
        raise KeyError(f"unknown environment {name!r}; registered: {names()}")
    return _ENTRIES[name]


def make(name: str, env_config, **overrides):
    return get(name).make_env(env_config, **overrides)
