"""Host environments: `reset` and `step` run in Python on the host and speak text in and out.

A `TextEnv` (`reno_jax.envs.interface`) is pure JAX and runs inside the jitted rollout; a `HostEnv` is for what
cannot: a sandbox, a search engine, a database, anything with Python state or slow I/O. The rollout for it is
`reno_jax.rollout.host_rollout`: generation stays jitted with the caches on the device, only the new tokens and
the tool responses cross between host and device.

    class MyEnv(HostEnv):
        name = "my_env"
        system_prompt = "Answer with the calculator tool."
        tools = ({"type": "function", "function": {"name": "calc", "parameters": {...}}},)
        max_turns = 4

        @classmethod
        def sample_task(cls, rng: np.random.Generator): return {"a": int(rng.integers(100))}
        def reset(self, task) -> str: ...                      # the first user message
        def step(self, call: ToolCall) -> HostStep: ...        # (response text, reward, done)

Optional: `eval_tasks(num)` (the held-out evaluation tasks; default: `sample_task` from `EVAL_SEED`), `teacher(rng)`
(the scripted next call of the warm start, in the episode's current state), `episode_info(truncated)` (figures the
loop logs as means), `observation()` (the current state as a user message, for bounded history), `tokenizer_corpus()`
(texts for `model.tokenizer=env`) and `options`: names of class attributes a user may set from the command line
(`--config.env.digits=7` with ``options = ("digits",)`` and ``digits: ClassVar[int] = 5``); the loop plays the
subclass `configured(env_class, {"digits": 7})`, so every method just reads `self.digits` / `cls.digits`.

Why one Python object per episode (gym / SkyRL style) rather than a stateless class with explicit state: a host
environment exists to hold what JAX cannot (open handles, processes, Python objects), and that state has no
natural pytree form; one object per episode keeps it where the user expects it (`self`), episodes never share
mutable state, so stepping all live episodes in a thread pool is safe without locks, and a faulty or timed-out
episode is simply abandoned with its object. The class attributes play the role of pgx's / Tunix's environment
metadata (prompt, tools, limits, rewards); `reset` and `step` are all a new environment must write.

Calls: the rollout parses each turn's text (the first ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
the format the chat template renders tool calls in) into a `ToolCall` (name + arguments dict, arguments as JSON
gives them: free strings allowed) and calls `step`; a turn without a well-formed call of a known tool becomes an
`InvalidCall` and goes to `invalid_call` (default: "Invalid call." with `invalid_call_reward`, episode over).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import numbers
from typing import Any, Callable, ClassVar, Mapping, NamedTuple

import numpy as np

from reno_jax.errors import ConfigError
from reno_jax.protocol import toolcall

# Parse kinds (the same codes as the jitted parser's `reno_jax.protocol.toolcall.KIND_*`).
KIND_OK = toolcall.KIND_OK
KIND_NO_CALL = toolcall.KIND_NO_CALL
KIND_BAD_CALL = toolcall.KIND_BAD_CALL

# Seed of the default held-out tasks (`HostEnv.eval_tasks`): fixed, so every evaluation plays the same suite.
EVAL_SEED = 20_240_917


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call of one of the environment's tools: ``name`` and ``arguments`` as JSON gave them; ``text``:
    the whole turn it was parsed from (empty for a call made in code, e.g. a teacher's; not compared)."""

    name: str
    arguments: dict
    text: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class InvalidCall:
    """A turn without a usable call: ``kind`` is `KIND_NO_CALL` (no complete ``<tool_call>...</tool_call>``) or
    `KIND_BAD_CALL` (not a JSON object of a known tool's name and arguments); ``text`` is the whole turn."""

    kind: int
    text: str
    reason: str


class HostEnvError(TypeError):
    """A host environment's method returned a wrong type (a bug of the environment, found at its first call): the
    message names the class, the method and the type (the CLIs print it as one line)."""


class HostStep(NamedTuple):
    """What `HostEnv.step` returns: the tool response's text, the turn's reward, whether the episode is over."""

    text: str
    reward: float
    done: bool


class HostEnv:
    """Base class of host environments (one instance per episode; see the module docstring).

    Class attributes (override as needed):
      name: the environment's name (registry key, error messages).
      system_prompt: the system message.
      tools: the tool schemas in the HF ``tools=`` format (``{"type": "function", "function": {"name", ...}}``);
        the chat template renders them in the system turn. Arguments are not restricted to the jitted parser's
        integers and enums: `step` receives them as JSON parsed them.
      max_turns: agent turns per episode (the rollout's `max_turns` is capped by it).
      invalid_call_reward: reward of a turn without a usable call (`invalid_call`'s default).
      tool_error_reward: reward of a turn whose `step` raised or ran past the rollout's `tool_timeout_s` (the
        episode ends there with an error response).
      truncation_reward: reward of an episode that ran out of turns or conversation length before it was done.
      options: names of the class attributes a user may set (`--config.env.NAME=value`, see `configured`); each
        has its default as a plain class attribute, whose type the value must have.
    """

    name: ClassVar[str] = "host_env"
    system_prompt: ClassVar[str] = ""
    tools: ClassVar[tuple] = ()
    max_turns: ClassVar[int] = 1
    invalid_call_reward: ClassVar[float] = -1.0
    tool_error_reward: ClassVar[float] = -1.0
    truncation_reward: ClassVar[float] = 0.0
    options: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def sample_task(cls, rng: np.random.Generator) -> Any:
        """One training task (anything `reset` accepts), drawn with `rng`."""
        raise NotImplementedError

    @classmethod
    def eval_tasks(cls, num: int) -> list:
        """The first `num` tasks of the fixed held-out suite (default: `sample_task` from `EVAL_SEED`; override to
        keep them apart from the training tasks)."""
        rng = np.random.default_rng(EVAL_SEED)
        return [cls.sample_task(rng) for _ in range(num)]

    def teacher(self, rng: np.random.Generator) -> ToolCall:
        """The scripted policy of the warm start: the next call in the episode's current state (called after `reset`
        and after each `step` that did not end the episode)."""
        del rng
        raise NotImplementedError(f"{type(self).__name__} (name {self.name!r}) has no teacher")

    def reset(self, task: Any) -> str:
        """Starts the episode on `task`; returns the first user message's text."""
        raise NotImplementedError

    def step(self, call: ToolCall) -> HostStep:
        """Runs a well-formed call; returns `(response text, reward, done)`."""
        raise NotImplementedError

    def invalid_call(self, call: InvalidCall) -> HostStep:
        """Answers a turn without a usable call (default: the episode ends with `invalid_call_reward`)."""
        del call
        return HostStep("Invalid call.", self.invalid_call_reward, True)

    def observation(self) -> str | None:
        """The user message that ends each bounded-history turn prompt after the first (``rollout.history=k``: the
        system prompt, the last k exchanges, this message; `reno_jax.rollout.host_rollout`), so it must hold what
        the next call may depend on beyond those exchanges (the task, a board, the progress). Turn 0's is always
        `reset`'s message. Default None: `reset`'s message again, i.e. the task restated after the window."""
        return None

    @classmethod
    def tokenizer_corpus(cls) -> tuple[str, ...]:
        """Extra texts a per-environment tokenizer (``model.tokenizer=env``) is trained on besides the rendered
        chats of sampled and teacher episodes (e.g. words the teacher never says). Default: none."""
        return ()

    def episode_info(self, truncated: bool) -> dict:
        """Per-episode figures for `Trajectory.env_info` (numbers; the same keys for every episode)."""
        del truncated
        return {}


# ---------------------------------------------------------------------------------------------- calls


def tool_names(tools) -> tuple[str, ...]:
    return tuple((t["function"] if "function" in t else t)["name"] for t in tools)


def parse_call(tools, text: str) -> ToolCall | InvalidCall:
    """The first ``<tool_call>...</tool_call>`` of `text` as a `ToolCall`, or an `InvalidCall` saying why not.

    The body must be one JSON object with exactly the members ``name`` (one of `tools`' names) and ``arguments``
    (an object holding the tool's required parameters); argument values are not checked against the schema.
    """
    start = text.find(toolcall.OPEN_TAG)
    end = text.find(toolcall.CLOSE_TAG, start + len(toolcall.OPEN_TAG)) if start >= 0 else -1
    if end < 0:
        return InvalidCall(KIND_NO_CALL, text, "no complete <tool_call>...</tool_call>")
    body = text[start + len(toolcall.OPEN_TAG) : end]
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return InvalidCall(KIND_BAD_CALL, text, "the call is not JSON")
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return InvalidCall(KIND_BAD_CALL, text, 'the call must be {"name": ..., "arguments": {...}}')
    names = tool_names(tools)
    if obj["name"] not in names:
        return InvalidCall(KIND_BAD_CALL, text, f"unknown tool {obj['name']!r}")
    if not isinstance(obj["arguments"], dict):
        return InvalidCall(KIND_BAD_CALL, text, "arguments must be an object")
    schema = tools[names.index(obj["name"])]
    required = (schema["function"] if "function" in schema else schema).get("parameters", {}).get("required", ())
    missing = [k for k in required if k not in obj["arguments"]]
    if missing:
        return InvalidCall(KIND_BAD_CALL, text, f"missing arguments {missing}")
    return ToolCall(obj["name"], obj["arguments"], text)


# ---------------------------------------------------------------------------------------------- type checks


def _where(env: HostEnv, method: str) -> str:
    return f"{type(env).__name__} (name {env.name!r}).{method}"


def checked_reset(env: HostEnv, task: Any) -> str:
    """`env.reset(task)`, failing with one TypeError naming the environment if it does not return a string."""
    text = env.reset(task)
    if not isinstance(text, str):
        raise HostEnvError(
            f"{_where(env, 'reset')} must return the first user message as str, got {type(text).__name__}"
        )
    return text


def checked_observation(env: HostEnv, first_message: str) -> str:
    """`env.observation()`, or `first_message` (reset's) when it is None; one TypeError naming the environment if
    it is neither None nor a string."""
    text = env.observation()
    if text is None:
        return first_message
    if not isinstance(text, str):
        raise HostEnvError(f"{_where(env, 'observation')} must return a str or None, got {type(text).__name__}")
    return text


def checked_step(env: HostEnv, method: str, out: Any) -> HostStep:
    """`out` (what `env.<method>` returned) as a `HostStep`, or one TypeError naming the environment, the method and
    the wrong type."""
    if not isinstance(out, tuple) or len(out) != 3:
        raise HostEnvError(
            f"{_where(env, method)} must return (text: str, reward: float, done: bool), "
            f"got {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, tuple) else "")
        )
    text, reward, done = out
    if not isinstance(text, str):
        raise HostEnvError(
            f"{_where(env, method)} returned a response text of type {type(text).__name__}, expected str"
        )
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
        raise HostEnvError(f"{_where(env, method)} returned a reward of type {type(reward).__name__}, expected float")
    if not isinstance(done, (bool, np.bool_)):
        raise HostEnvError(f"{_where(env, method)} returned done of type {type(done).__name__}, expected bool")
    return HostStep(text, float(reward), bool(done))


def checked_info(env: HostEnv, truncated: bool) -> dict:
    info = env.episode_info(truncated)
    if not isinstance(info, dict) or not all(isinstance(v, (numbers.Number, np.bool_)) for v in info.values()):
        raise HostEnvError(f"{_where(env, 'episode_info')} must return a dict of numbers, got {info!r:.80}")
    return info


# ---------------------------------------------------------------------------------------------- options


def _option_value(env_class: type[HostEnv], name: str, value: Any) -> Any:
    """`value` checked against the type of option `name`'s default (an int is a float too; a list a tuple)."""
    default = getattr(env_class, name)
    if isinstance(default, bool):
        ok = isinstance(value, (bool, np.bool_))
    elif isinstance(default, numbers.Integral):
        ok = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    elif isinstance(default, float):
        ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        value = float(value) if ok else value
    elif isinstance(default, tuple):
        ok = isinstance(value, (tuple, list))
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"--config.env.{name} must be {type(default).__name__}, got {type(value).__name__}")
    return value


def configured(env_class: type[HostEnv], values: Mapping[str, Any]) -> type[HostEnv]:
    """`env_class`, or (with `values`) a subclass of the same name with those options' class attributes set.

    Raises one `ConfigError` naming `--config.env.NAME` for a name not in `env_class.options` or a value whose type
    is not the default's."""
    for name in env_class.options:
        if not hasattr(env_class, name):
            raise HostEnvError(f"{env_class.__name__}.options names {name!r}, which has no default class attribute")
    unknown = [name for name in values if name not in env_class.options]
    if unknown:
        raise ConfigError(
            f"--config.env.{unknown[0]}: unknown option of environment {env_class.name!r} "
            f"(options: {', '.join(env_class.options) or 'none'})"
        )
    if not values:
        return env_class
    attrs = {name: _option_value(env_class, name, value) for name, value in values.items()}
    return type(env_class.__name__, (env_class,), {**attrs, "__module__": env_class.__module__})


# ---------------------------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class HostEntry:
    """A registered host environment: its class (instantiated once per episode with no arguments)."""

    name: str
    env_class: Callable[[], HostEnv]


_HOST_ENTRIES: dict[str, HostEntry] = {}  # the registry, as `reno_jax.envs.registry` keeps the jitted ones
# Built-in host environments, imported (and so registered) when first asked for by name.
_BUILTIN = {
    "guess_number_host": "reno_jax.envs.guess_number_host",
    "arithmetic_calculator": "reno_jax.envs.arithmetic_calculator",
    "two_hop_lookup": "reno_jax.envs.two_hop_lookup",
    "reasoning_gym": "reno_jax.envs.reasoning_gym_env",
}


def register(env_class: type[HostEnv]) -> type[HostEnv]:
    """Registers `env_class` under its `name` (usable as a class decorator)."""
    _HOST_ENTRIES[env_class.name] = HostEntry(env_class.name, env_class)
    return env_class


def is_host_env(name: str) -> bool:
    """Whether `name` is a registered (or built-in) host environment."""
    return name in _HOST_ENTRIES or name in _BUILTIN


def host_names() -> list[str]:
    return sorted(set(_HOST_ENTRIES) | set(_BUILTIN))


def host_entry(name: str) -> HostEntry:
    if name not in _HOST_ENTRIES and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])  # registers itself
    if name not in _HOST_ENTRIES:
        raise KeyError(f"no host environment {name!r}; registered: {sorted(_HOST_ENTRIES)}")
    return _HOST_ENTRIES[name]


def sample_episodes(
    env_class: type[HostEnv], rng: np.random.Generator | int, num_groups: int, group_size: int
) -> tuple[list[HostEnv], list[Any]]:
    """`(envs, tasks)` of B = num_groups * group_size episodes: one fresh object each, the G episodes of a group
    on the same task (drawn with `rng`, a Generator or a seed)."""
    rng = np.random.default_rng(rng)
    tasks = [env_class.sample_task(rng) for _ in range(num_groups)]
    return [env_class() for _ in range(num_groups * group_size)], [t for t in tasks for _ in range(group_size)]
