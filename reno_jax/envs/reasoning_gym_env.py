"""Any Reasoning Gym dataset as a host environment, scored by that dataset's own `score_answer`.

    --config.env.name=reasoning_gym --config.env.module=reno_jax.envs.reasoning_gym_env
    --config.env.dataset=leg_counting --config.env.dataset_options='{"min_animals": 3}'

or in Python `reasoning_gym_env("leg_counting", with_calculator=True, min_animals=3)` (a configured subclass).

An episode is one dataset entry: the user message is the entry's question, the policy answers with
`answer(value)` (the episode's reward is the dataset's `score_answer(value, entry)`, in [0, 1]); with
`with_calculator` it may first call `calculate(expression)` (`reno_jax.tools.calculator`), hence `max_turns` 2.
Nothing here knows a particular dataset: the dataset's options go to it unchanged (`dataset_options`, a JSON
object, so that one command-line option carries any dataset's fields), the question and the answer are the entry's
"question" and "answer", and the teacher answers with the entry's gold answer on `teacher_rate` of the episodes and
with another training entry's answer (a wrong one of the right form) on the rest. A dataset never tried trains the
same way.

Training and held-out tasks: the training entries are drawn from dataset seed TRAIN_SEED (indices below
TRAIN_SIZE), the evaluation suite is the first `eval_size` entries of seed EVAL_SEED; the datasets draw entry i
from `Random(seed + i)`, and the two ranges of seeds are far apart, so the suites are independent draws; on top of
that a training draw whose question is in the evaluation suite is drawn again (a dataset with only a handful of
distinct questions cannot hold any out: `sample_task` then fails saying so).

Reasoning Gym is the optional `tasks` extra: this module imports without it; the first task drawn imports it
(`reno_jax.tasks.reasoning_gym`).

Options (`options`, settable as `--config.env.NAME`) are class attributes; `tools`, `system_prompt` and `max_turns`
are computed from them on the (configured) class, so a configured subclass offers the tools its options ask for. A
value the dataset rejects is a ValueError whose message starts with the option ("env.dataset_options: ..."), which
the loop's config check reports as a config error.
"""

from __future__ import annotations

import functools
import json
from typing import Any, ClassVar, Mapping

import numpy as np

from reno_jax.envs import host
from reno_jax.tasks import reasoning_gym as rg_tasks
from reno_jax.tools import calculator

TRAIN_SEED = 0
TRAIN_SIZE = 1_000_000  # training indices 0..TRAIN_SIZE-1 of TRAIN_SEED (seeds TRAIN_SEED + i)
EVAL_SEED = 1_000_000_007  # far above TRAIN_SEED + TRAIN_SIZE: no dataset seed is shared with training
MAX_TRAIN_DRAWS = 64  # draws of `sample_task` before it gives up on finding a question that is not held out
# The free-text arguments' bounds, as the tools show them to the policy (a jitted parser would enforce them; the host
# parser does not): answers of basic_arithmetic and two_hop_lookup are <= 19 tokens.
ANSWER_MAX_TOKENS = 24
EXPRESSION_MAX_TOKENS = 48  # basic_arithmetic expressions of up to 3 six-digit operands are <= 39 tokens


def tool_schema(name: str, argument: str, max_tokens: int) -> dict:
    """A tool of one free-text argument (``{"type": "string", "maxTokens": N}``), no description (short prompts)."""
    parameters = {
        "type": "object",
        "properties": {argument: {"type": "string", "maxTokens": max_tokens}},
        "required": [argument],
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


ANSWER_TOOL = tool_schema("answer", "value", ANSWER_MAX_TOKENS)
CALCULATE_TOOL = tool_schema("calculate", "expression", EXPRESSION_MAX_TOKENS)


class per_class:  # noqa: N801 (used like `property`)
    """A class attribute computed from the class it is read on (`fn(cls)`), so a configured subclass's options
    reach attributes the rollout reads on the class (`tools`, `system_prompt`)."""

    def __init__(self, fn):
        self.fn = fn

    def __get__(self, obj, owner):
        return self.fn(owner)


@functools.lru_cache(maxsize=32)
def _tasks(dataset: str, options_json: str, seed: int, size: int) -> rg_tasks.ReasoningGymTasks:
    """The dataset, built once per process per (name, options, seed, size); an option it does not have is a
    ValueError naming `env.dataset_options` (what the loop reports as a config error)."""
    try:
        return rg_tasks.create_tasks(dataset, size=size, seed=seed, **json.loads(options_json))
    except TypeError as error:
        raise ValueError(f"env.dataset_options: {error}") from None


@functools.lru_cache(maxsize=32)
def _question_set(dataset: str, options_json: str, seed: int, size: int) -> frozenset[str]:
    return frozenset(item.question for item in _tasks(dataset, options_json, seed, size))


@host.register
class ReasoningGymEnv(host.HostEnv):
    """One Reasoning Gym entry per episode: `answer(value)` scored by the dataset (see the module docstring).

    Subclasses adapt it without knowing more of Reasoning Gym: `dataset_kwargs` (the dataset's options),
    `question_text` (what the user sees), `calculator_offered`, `teacher` and `wrong_answer`.
    """

    name = "reasoning_gym"
    options: ClassVar[tuple[str, ...]] = ("dataset", "dataset_options", "with_calculator", "teacher_rate", "eval_size")
    dataset: ClassVar[str] = ""  # a Reasoning Gym dataset name (reno_jax.tasks.reasoning_gym.dataset_names())
    dataset_options: ClassVar[str] = "{}"  # the dataset's config fields, a JSON object
    with_calculator: ClassVar[bool] = False  # offer calculate(expression) before the answer
    teacher_rate: ClassVar[float] = 0.5  # share of the episodes the teacher answers with the gold answer
    eval_size: ClassVar[int] = 512  # entries in the held-out evaluation suite

    invalid_call_reward = -1.0
    truncation_reward = 0.0

    tools = per_class(lambda cls: (CALCULATE_TOOL, ANSWER_TOOL) if cls.calculator_offered() else (ANSWER_TOOL,))
    system_prompt = per_class(lambda cls: "Calculate, then answer." if cls.calculator_offered() else "Answer.")
    max_turns = per_class(lambda cls: 2 if cls.calculator_offered() else 1)

    # ------------------------------------------------------------------------------------------ the dataset

    @classmethod
    def calculator_offered(cls) -> bool:
        return bool(cls.with_calculator)

    @classmethod
    def dataset_kwargs(cls) -> dict:
        """The dataset's options (its config's fields)."""
        try:
            kwargs = json.loads(cls.dataset_options)
        except ValueError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise ValueError(f"env.dataset_options must be a JSON object, got {cls.dataset_options!r}")
        return kwargs

    @classmethod
    def tasks(cls, split: str) -> rg_tasks.ReasoningGymTasks:
        """The training ("train") or evaluation ("eval") entries (built once per process)."""
        if not cls.dataset:
            raise ValueError("env.dataset: name the Reasoning Gym dataset (--config.env.dataset=NAME)")
        seed, size = (TRAIN_SEED, TRAIN_SIZE) if split == "train" else (EVAL_SEED, int(cls.eval_size))
        return _tasks(cls.dataset, json.dumps(cls.dataset_kwargs(), sort_keys=True), seed, size)

    @classmethod
    def sample_task(cls, rng: np.random.Generator) -> Mapping[str, Any]:
        """A training entry (the dataset's dict) whose question is not in the evaluation suite."""
        train = cls.tasks("train")
        held_out = _question_set(
            cls.dataset, json.dumps(cls.dataset_kwargs(), sort_keys=True), EVAL_SEED, cls.eval_size
        )
        for _ in range(MAX_TRAIN_DRAWS):
            item = train[int(rng.integers(len(train)))]
            if item.question not in held_out:
                return item.entry
        raise ValueError(
            f"env.eval_size: {MAX_TRAIN_DRAWS} training entries of {cls.dataset!r} in a row were held-out questions: "
            f"the dataset has too few distinct questions to hold {cls.eval_size} out"
        )

    @classmethod
    def eval_tasks(cls, num: int) -> list:
        """The first `num` entries of the held-out suite (at most `eval_size`)."""
        if num > cls.eval_size:
            raise ValueError(f"{num} evaluation tasks asked, the suite has {cls.eval_size} (--config.env.eval_size)")
        suite = cls.tasks("eval")
        return [suite[i].entry for i in range(num)]

    @classmethod
    def score(cls, answer: str | None, entry: Mapping[str, Any]) -> float:
        """The dataset's own `score_answer` (the training dataset's; both suites share its config)."""
        return cls.tasks("train").score(answer, entry)

    @classmethod
    def question_text(cls, entry: Mapping[str, Any]) -> str:
        return str(entry["question"])

    # ------------------------------------------------------------------------------------------ the episode

    def reset(self, task: Mapping[str, Any]) -> str:
        self.entry = task
        self.answer_score, self.correct, self.tool_calls, self.invalid = 0.0, False, 0, False
        self.last_result: str | None = None  # the calculator's last response
        self.teacher_knows: bool | None = None  # the teacher's draw for this episode (made on its first call)
        return self.question_text(task)

    def step(self, call: host.ToolCall) -> host.HostStep:
        if call.name == "calculate" and self.calculator_offered():
            expression = call.arguments.get("expression")
            if set(call.arguments) != {"expression"} or not isinstance(expression, str):
                return self.invalid_call(host.InvalidCall(host.KIND_BAD_CALL, "", "calculate needs expression text"))
            self.tool_calls += 1
            self.last_result = calculator.evaluate(expression)
            return host.HostStep(self.last_result, 0.0, False)
        value = call.arguments.get("value")
        # A bare JSON number is taken as its text; anything else but text is not an answer.
        if call.name != "answer" or set(call.arguments) != {"value"} or not _is_text_or_int(value):
            return self.invalid_call(host.InvalidCall(host.KIND_BAD_CALL, "", "answer needs value text"))
        self.answer_score = self.score(str(value), self.entry)
        self.correct = self.answer_score == 1.0
        return host.HostStep("Correct." if self.correct else "Wrong.", self.answer_score, True)

    def invalid_call(self, call: host.InvalidCall) -> host.HostStep:
        del call
        self.invalid = True
        return host.HostStep("Invalid call.", self.invalid_call_reward, True)

    def episode_info(self, truncated: bool) -> dict:
        del truncated
        return {
            "correct": self.correct,
            "score": self.answer_score,
            "tool_calls": self.tool_calls,
            "invalid": self.invalid,
        }

    # ------------------------------------------------------------------------------------------ the teacher

    def teacher(self, rng: np.random.Generator) -> host.ToolCall:
        """The gold answer on `teacher_rate` of the episodes, else `wrong_answer` (drawn once per episode)."""
        if self.teacher_knows is None:
            self.teacher_knows = bool(rng.random() < self.teacher_rate)
        value = str(self.entry["answer"]) if self.teacher_knows else self.wrong_answer(rng)
        return host.ToolCall("answer", {"value": value})

    def wrong_answer(self, rng: np.random.Generator) -> str:
        """Another training entry's answer that this entry's scorer rejects (an answer of the right form)."""
        train = self.tasks("train")
        for _ in range(MAX_TRAIN_DRAWS):
            other = str(train[int(rng.integers(len(train)))].entry["answer"])
            if self.score(other, self.entry) < 1.0:
                return other
        return "?"


def _is_text_or_int(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def reasoning_gym_env(
    dataset_name: str, *, with_calculator: bool = False, teacher_rate: float = 0.5, eval_size: int = 512, **options
) -> type[ReasoningGymEnv]:
    """`ReasoningGymEnv` configured for the dataset `dataset_name` with its `options` (a subclass; not registered:
    the registered name is "reasoning_gym" with the dataset as an option)."""
    attributes = dict(
        dataset=dataset_name,
        dataset_options=json.dumps(options, sort_keys=True),
        with_calculator=bool(with_calculator),
        teacher_rate=float(teacher_rate),
        eval_size=int(eval_size),
    )
    return type(f"ReasoningGym_{dataset_name}", (ReasoningGymEnv,), attributes)
