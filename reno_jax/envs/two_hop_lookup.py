"""Two-hop lookup over a generated knowledge base (`reno_jax.tools.knowledge_base`) as a host environment.

    --config.env.name=two_hop_lookup --config.env.module=reno_jax.envs.two_hop_lookup

A fixed invented world (`world_seed`; people, cities, countries, organisations) and its two-hop questions, e.g.
"In which country was the employer of Alda Voren founded?": the policy calls `lookup(query)` with queries
"<entity>: <relation>" ("Alda Voren: works_for" -> "Alda Voren works for Dravik Guild.", then
"Dravik Guild: founded_in"), then `answer(value)`; reward 1 for the right entity (compared as the knowledge base
compares names: case, spacing and trailing punctuation aside), else 0. At most 3 turns: two lookups and the answer.

The teacher (warm start) makes the first lookup always; on `teacher_second_lookup_rate` of the episodes it makes the
second lookup, naming the entity the first response gave, and answers what it says; on the rest it guesses a random
entity of the answer's kind. `random_tool` is the control: lookups keep their format and errors but answer with a
random entity of the right kind (`random_lookup`), so looking up is worth nothing and its rate should fall under RL.

Held-out questions: the question subjects are split once (`heldout_fraction` of each kind, by a seeded shuffle);
`eval_tasks` asks only about held-out subjects, `sample_task` never does, so no evaluation question is trained on
(the held-out entities still appear in the world, e.g. as someone's spouse, and in training questions' lookups).
"""

from __future__ import annotations

import functools
import random
import zlib
from typing import ClassVar

import numpy as np

from reno_jax.envs import host
from reno_jax.envs.reasoning_gym_env import ANSWER_TOOL, tool_schema
from reno_jax.tools import knowledge_base as kb_lib

QUERY_MAX_TOKENS = 32  # "Bralvik Trading Company: headquartered_in" is ~30 tokens of the shipped tokenizer
WORLD_SIZES = kb_lib.WorldSizes(countries=5, cities_per_country=4, organisations=16, people=64)
SPLIT_SEED = 7  # the held-out subjects' shuffle
EVAL_ORDER_SEED = 11  # the evaluation suite's order


@functools.lru_cache(maxsize=8)
def world(world_seed: int, heldout_fraction: float) -> tuple[kb_lib.KnowledgeBase, tuple, tuple]:
    """(knowledge base, training questions, held-out questions in the suite's order), built once per process."""
    kb = kb_lib.generate_knowledge_base(world_seed, WORLD_SIZES)
    rng = random.Random(SPLIT_SEED)
    held_out: set[str] = set()
    for kind in kb_lib.KINDS:
        names = list(kb.entities(kind))
        rng.shuffle(names)
        held_out.update(names[: round(heldout_fraction * len(names))])
    questions = kb_lib.all_two_hop_questions(kb)
    train = tuple(q for q in questions if q.subject not in held_out)
    heldout = [q for q in questions if q.subject in held_out]
    random.Random(EVAL_ORDER_SEED).shuffle(heldout)
    return kb, train, tuple(heldout)


@host.register
class TwoHopLookupEnv(host.HostEnv):
    """Two-hop questions over the knowledge base with `lookup` and `answer` (see the module docstring)."""

    name = "two_hop_lookup"
    system_prompt = "Look up, then answer."
    tools = (tool_schema("lookup", "query", QUERY_MAX_TOKENS), ANSWER_TOOL)
    max_turns = 3
    invalid_call_reward = -1.0
    truncation_reward = 0.0

    options: ClassVar[tuple[str, ...]] = ("world_seed", "heldout_fraction", "teacher_second_lookup_rate", "random_tool")
    world_seed: ClassVar[int] = 0
    heldout_fraction: ClassVar[float] = 0.2  # of each kind's entities, whose questions are held out
    teacher_second_lookup_rate: ClassVar[float] = 0.5  # share of teacher episodes that make the second lookup
    random_tool: ClassVar[bool] = False  # the control: lookups answer a random entity of the right kind

    @classmethod
    def world(cls) -> tuple[kb_lib.KnowledgeBase, tuple, tuple]:
        return world(int(cls.world_seed), float(cls.heldout_fraction))

    @classmethod
    def sample_task(cls, rng: np.random.Generator) -> kb_lib.TwoHopQuestion:
        train = cls.world()[1]
        return train[int(rng.integers(len(train)))]

    @classmethod
    def eval_tasks(cls, num: int) -> list:
        """The first `num` held-out questions (all of them if fewer: ~100 with the default world)."""
        return list(cls.world()[2][:num])

    def reset(self, task: kb_lib.TwoHopQuestion) -> str:
        self.kb = self.world()[0]
        self.task = task
        self.lookups, self.second_lookup, self.correct, self.invalid = 0, False, False, False
        self.responses: list[str] = []
        self.teacher_looks: bool | None = None  # the teacher's draw for this episode (made on its first call)
        # The control's draws: a function of the question, so a group's episodes see the same random world.
        self.tool_rng = random.Random(zlib.crc32(task.question.encode()))
        return task.question

    def step(self, call: host.ToolCall) -> host.HostStep:
        if call.name == "lookup":
            query = call.arguments.get("query")
            if set(call.arguments) != {"query"} or not isinstance(query, str):
                return self.invalid_call(host.InvalidCall(host.KIND_BAD_CALL, "", "lookup needs query text"))
            self.lookups += 1
            self.second_lookup |= kb_lib.resolve_query(self.kb, query) == (self.task.bridge, self.task.relations[1])
            if self.random_tool:
                response = kb_lib.random_lookup(self.kb, query, self.tool_rng)
            else:
                response = self.kb.lookup(query)
            self.responses.append(response)
            return host.HostStep(response, 0.0, False)
        value = call.arguments.get("value")
        if call.name != "answer" or set(call.arguments) != {"value"} or not isinstance(value, str):
            return self.invalid_call(host.InvalidCall(host.KIND_BAD_CALL, "", "answer needs value text"))
        self.correct = kb_lib.normalize(value) == kb_lib.normalize(self.task.answer)
        return host.HostStep("Correct." if self.correct else "Wrong.", float(self.correct), True)

    def invalid_call(self, call: host.InvalidCall) -> host.HostStep:
        del call
        self.invalid = True
        return host.HostStep("Invalid call.", self.invalid_call_reward, True)

    def episode_info(self, truncated: bool) -> dict:
        del truncated
        return {
            "correct": self.correct,
            "lookups": self.lookups,
            "second_lookup": self.second_lookup,
            "invalid": self.invalid,
        }

    def teacher(self, rng: np.random.Generator) -> host.ToolCall:
        """First lookup; then the second lookup of the entity it answered and its answer (on
        `teacher_second_lookup_rate` of the episodes), or a guess of the answer's kind."""
        if self.teacher_looks is None:
            self.teacher_looks = bool(rng.random() < self.teacher_second_lookup_rate)
        first, second = self.task.relations
        if not self.responses:
            return host.ToolCall("lookup", {"query": kb_lib.format_query(self.task.subject, first)})
        relation = first if len(self.responses) == 1 else second
        fact = kb_lib.parse_fact(self.responses[-1], relation)
        if fact is None or not self.teacher_looks:
            guesses = self.kb.entities(kb_lib.RELATIONS[second].object_kind)
            return host.ToolCall("answer", {"value": guesses[int(rng.integers(len(guesses)))]})
        if len(self.responses) == 1:
            return host.ToolCall("lookup", {"query": kb_lib.format_query(fact[1], second)})
        return host.ToolCall("answer", {"value": fact[1]})
