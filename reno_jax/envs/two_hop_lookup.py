"""Two-hop lookup over a generated knowledge base (`reno_jax.tools.knowledge_base`) as a host environment.

    --config.env.name=two_hop_lookup --config.env.module=reno_jax.envs.two_hop_lookup

Invented worlds (people, cities, countries, organisations) and their two-hop questions, e.g. "In which country was
the employer of Alda Voren founded?": the policy calls `lookup(query)` with queries "<entity>: <relation>"
("Alda Voren: works_for" -> "Alda Voren works for Dravik Guild.", then "Dravik Guild: founded_in"), then
`answer(value)`; reward 1 for the right entity (compared as the knowledge base compares names: case, spacing and
trailing punctuation aside), else 0, less `lookup_cost` per lookup. At most 3 turns: two lookups and the answer.

Worlds: by default (`fresh_worlds`) every question is asked in a small world of its own, drawn from a seed (training
questions from the run's draws, the held-out suite from seeds no training question uses), so no name can be
memorised: the policy has to copy the subject from the question, the bridge entity from the first response and the
answer from the second. `fresh_worlds=False` asks every question in one fixed world (`world_seed`), with the
held-out suite asking about subjects no training question asks about (`heldout_fraction` of each kind, by a seeded
shuffle); a tiny model learns that world's names by heart there and writes memorised names on held-out subjects.

The teacher (warm start) makes the first lookup always; on `teacher_second_lookup_rate` of the episodes it makes the
second lookup, naming the entity the first response gave, and answers what it says; on the rest it guesses a random
entity of the answer's kind. `random_tool` is the control: lookups keep their format and errors but answer with a
random entity of the right kind (`random_lookup`: in fresh worlds a name invented afresh), so looking up is worth
nothing but its cost, and its rate should fall under RL.
"""

from __future__ import annotations

import dataclasses
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
# A fresh world per question only has to hold its question: small, so drawing one costs well under a millisecond.
QUESTION_WORLD_SIZES = kb_lib.WorldSizes(countries=3, cities_per_country=2, organisations=3, people=4)
SPLIT_SEED = 7  # the held-out subjects' shuffle
EVAL_ORDER_SEED = 11  # the evaluation suite's order
_TRAIN_SEEDS = 2**40  # training worlds' seeds are drawn below this (even seeds), the held-out suite's are odd


@dataclasses.dataclass(frozen=True, eq=False)
class TwoHopTask:
    """A question and the world it is asked in."""

    world: kb_lib.KnowledgeBase
    question: kb_lib.TwoHopQuestion


def question_world(seed: int) -> TwoHopTask:
    """The fresh world of `seed` and one of its questions (the same seed gives the same task)."""
    kb = kb_lib.generate_knowledge_base(seed, QUESTION_WORLD_SIZES)
    return TwoHopTask(kb, kb_lib.generate_two_hop_questions(kb, 1, seed)[0])


def _fresh_seed(world_seed: int, index: int, heldout: bool) -> int:
    return 2 * (world_seed * _TRAIN_SEEDS + index) + int(heldout)


@functools.lru_cache(maxsize=8)
def world(world_seed: int, heldout_fraction: float) -> tuple[kb_lib.KnowledgeBase, tuple, tuple]:
    """The fixed world (`fresh_worlds=False`): (knowledge base, training questions, held-out questions in the
    suite's order), built once per process."""
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

    options: ClassVar[tuple[str, ...]] = (
        "fresh_worlds",
        "world_seed",
        "heldout_fraction",
        "lookup_cost",
        "teacher_second_lookup_rate",
        "random_tool",
    )
    fresh_worlds: ClassVar[bool] = True  # a world per question; False: one fixed world
    world_seed: ClassVar[int] = 0  # the fixed world, or the stream of fresh worlds
    heldout_fraction: ClassVar[float] = 0.2  # fixed world: share of each kind's entities whose questions are held out
    lookup_cost: ClassVar[float] = 0.05  # reward per lookup (subtracted)
    teacher_second_lookup_rate: ClassVar[float] = 0.5  # share of teacher episodes that make the second lookup
    random_tool: ClassVar[bool] = False  # the control: lookups answer a random entity of the right kind

    @classmethod
    def world(cls) -> tuple[kb_lib.KnowledgeBase, tuple, tuple]:
        """The fixed world's knowledge base, training and held-out questions (`fresh_worlds=False`)."""
        return world(int(cls.world_seed), float(cls.heldout_fraction))

    @classmethod
    def sample_task(cls, rng: np.random.Generator) -> TwoHopTask:
        if cls.fresh_worlds:
            return question_world(_fresh_seed(int(cls.world_seed), int(rng.integers(_TRAIN_SEEDS)), heldout=False))
        kb, train, _ = cls.world()
        return TwoHopTask(kb, train[int(rng.integers(len(train)))])

    @classmethod
    def eval_tasks(cls, num: int) -> list:
        """The first `num` held-out questions (fixed world: all of them if fewer, ~100 with the default world)."""
        if cls.fresh_worlds:
            return [question_world(_fresh_seed(int(cls.world_seed), i, heldout=True)) for i in range(num)]
        kb, _, heldout = cls.world()
        return [TwoHopTask(kb, q) for q in heldout[:num]]

    def reset(self, task: TwoHopTask) -> str:
        self.kb, self.task = task.world, task.question
        self.lookups, self.second_lookup, self.correct, self.invalid = 0, False, False, False
        self.responses: list[str] = []
        self.teacher_looks: bool | None = None  # the teacher's draw for this episode (made on its first call)
        # The control's draws: a function of the question, so a group's episodes see the same random world.
        self.tool_rng = random.Random(zlib.crc32(self.task.question.encode()))
        return self.task.question

    def step(self, call: host.ToolCall) -> host.HostStep:
        if call.name == "lookup":
            query = call.arguments.get("query")
            if set(call.arguments) != {"query"} or not isinstance(query, str):
                return self.invalid_call(host.InvalidCall(host.KIND_BAD_CALL, "", "lookup needs query text"))
            self.lookups += 1
            self.second_lookup |= self._follows_first_answer(query)
            if self.random_tool:
                response = kb_lib.random_lookup(self.kb, query, self.tool_rng, invent=self.fresh_worlds)
            else:
                response = self.kb.lookup(query)
            self.responses.append(response)
            return host.HostStep(response, -float(self.lookup_cost), False)
        value = call.arguments.get("value")
        if call.name != "answer" or set(call.arguments) != {"value"} or not isinstance(value, str):
            return self.invalid_call(host.InvalidCall(host.KIND_BAD_CALL, "", "answer needs value text"))
        self.correct = kb_lib.normalize(value) == kb_lib.normalize(self.task.answer)
        return host.HostStep("Correct." if self.correct else "Wrong.", float(self.correct), True)

    def _follows_first_answer(self, query: str) -> bool:
        """Whether `query` asks the question's second relation of the entity the last response named as the first
        relation's answer (the second hop as the policy saw it: with the control's random answers too)."""
        first, second = self.task.relations
        fact = kb_lib.parse_fact(self.responses[-1], first) if self.responses else None
        split = kb_lib.split_query(query)
        if fact is None or split is None:
            return False
        return split[1] == second and kb_lib.normalize(split[0]) == kb_lib.normalize(fact[1])

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
            kind = kb_lib.RELATIONS[second].object_kind
            if self.fresh_worlds:  # a name the student could write too: none of this world's is in the conversation
                return host.ToolCall(
                    "answer", {"value": kb_lib.invent_name(kind, random.Random(int(rng.integers(2**63))))}
                )
            guesses = self.kb.entities(kind)
            return host.ToolCall("answer", {"value": guesses[int(rng.integers(len(guesses)))]})
        if len(self.responses) == 1:
            return host.ToolCall("lookup", {"query": kb_lib.format_query(fact[1], second)})
        return host.ToolCall("answer", {"value": fact[1]})
