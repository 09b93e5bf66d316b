"""Arithmetic with a calculator: Reasoning Gym's `basic_arithmetic` on numbers too large for a tiny model to
compute unaided, `calculate(expression)` then `answer(value)`, scored by the dataset's own `score_answer`.

    --config.env.name=arithmetic_calculator --config.env.module=reno_jax.envs.arithmetic_calculator

The questions: `min_terms`..`max_terms` operands of `min_digits`..`max_digits` digits joined by + - * (no division,
so every result is an exact integer the calculator prints as the dataset does), with the dataset's parentheses and
negations, written without spaces to keep them short. The user message is the bare expression (not the dataset's
instruction text): e.g. "-(762338-360999)+-762589".

The teacher (warm start): on `teacher_tool_rate` of the episodes it calls calculate with the exact expression and
answers the calculator's result; on the rest it answers by itself a plausible wrong number (the right answer with
its trailing digits redrawn), so the warm start teaches the format and the tool without solving the task, and RL
has the tool's worth to discover. `tool_enabled=False` is the no-tool control: only `answer` is offered, and the
teacher answers the right number itself on the same share of episodes (the warm start holds the same correct
answers in both arms), so the control differs from the task only in the missing tool.

Held-out questions: `eval_tasks` are entries of another dataset seed (`reno_jax.envs.reasoning_gym_env`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import numpy as np

from reno_jax.envs import host
from reno_jax.envs import reasoning_gym_env as rge


@host.register
class ArithmeticCalculatorEnv(rge.ReasoningGymEnv):
    """basic_arithmetic with the calculator tool (see the module docstring)."""

    name = "arithmetic_calculator"
    options: ClassVar[tuple[str, ...]] = (
        "min_digits",
        "max_digits",
        "min_terms",
        "max_terms",
        "teacher_tool_rate",
        "teacher_guess_kept",
        "tool_enabled",
        "eval_size",
    )
    dataset = "basic_arithmetic"
    min_digits: ClassVar[int] = 4  # digits per operand
    max_digits: ClassVar[int] = 6
    min_terms: ClassVar[int] = 2  # operands per question
    max_terms: ClassVar[int] = 3
    teacher_tool_rate: ClassVar[float] = 0.5  # share of teacher episodes that use the calculator
    teacher_guess_kept: ClassVar[float] = 0.5  # share of the right answer's leading digits a teacher's guess keeps
    tool_enabled: ClassVar[bool] = True  # False: the no-tool control (answer only)

    @classmethod
    def calculator_offered(cls) -> bool:
        return bool(cls.tool_enabled)

    @classmethod
    def dataset_kwargs(cls) -> dict:
        return dict(
            min_digits=int(cls.min_digits),
            max_digits=int(cls.max_digits),
            min_terms=int(cls.min_terms),
            max_terms=int(cls.max_terms),
            operators=["+", "-", "*"],
            whitespace="no_space",
        )

    @classmethod
    def question_text(cls, entry: Mapping[str, Any]) -> str:
        return str(entry["metadata"]["expression"])

    def reset(self, task: Mapping[str, Any]) -> str:
        self.copied_expression, self.copied_result = False, False
        return super().reset(task)

    def step(self, call: host.ToolCall) -> host.HostStep:
        """The base class's step, noting whether the call copied what it should: the first calculate the question's
        expression exactly, the answer the calculator's last result (what the warm start must teach)."""
        if call.name == "calculate" and self.tool_calls == 0:
            self.copied_expression = call.arguments.get("expression") == self.entry["metadata"]["expression"]
        if call.name == "answer" and self.last_result is not None:
            self.copied_result = str(call.arguments.get("value")) == self.last_result
        return super().step(call)

    def episode_info(self, truncated: bool) -> dict:
        """The base figures, `used_tool`, and the two copies (False on episodes without the tool)."""
        return {
            **super().episode_info(truncated),
            "used_tool": self.tool_calls > 0,
            "copied_expression": self.copied_expression,
            "copied_result": self.copied_result,
        }

    def teacher(self, rng: np.random.Generator) -> host.ToolCall:
        """Calculator then its result on `teacher_tool_rate` of the episodes, else a plausible wrong number."""
        if self.teacher_knows is None:
            self.teacher_knows = bool(rng.random() < self.teacher_tool_rate)
        if not self.teacher_knows:
            return host.ToolCall("answer", {"value": self.wrong_answer(rng)})
        if not self.calculator_offered():
            return host.ToolCall("answer", {"value": str(self.entry["answer"])})
        if self.last_result is None:
            return host.ToolCall("calculate", {"expression": str(self.entry["metadata"]["expression"])})
        return host.ToolCall("answer", {"value": self.last_result})

    def wrong_answer(self, rng: np.random.Generator) -> str:
        """The right answer with its digits after the leading `teacher_guess_kept` share redrawn (at least one,
        never the right answer)."""
        if not 0.0 <= self.teacher_guess_kept < 1.0:
            raise host.ConfigError(f"--config.env.teacher_guess_kept={self.teacher_guess_kept}: must be in [0, 1)")
        right = str(self.entry["answer"])
        sign, digits = ("-", right[1:]) if right.startswith("-") else ("", right)
        keep = min(int(len(digits) * self.teacher_guess_kept), len(digits) - 1)
        while True:
            tail = "".join(str(d) for d in rng.integers(0, 10, len(digits) - keep))
            guess = (digits[:keep] + tail).lstrip("0")
            guess = sign + guess if guess else "0"
            if guess != right:
                return guess
