"""An invented world held on the host, its lookup tool, two-hop questions over it, a teacher that answers them,
and a random-lookup control.

The world (`generate_knowledge_base(seed)`): countries, cities, organisations and people with invented,
pronounceable names built from syllables (unique across the world, compared ignoring case; not checked against any
list of real names, but the syllables make real ones unlikely), and one fact per (entity, relation of its kind):

    person        born_in -> city, lives_in -> city, works_for -> organisation, married_to -> person
    city          located_in -> country
    country       capital -> city (one of its own cities)
    organisation  headquartered_in -> city, founded_in -> country, founded_by -> person

`married_to` is symmetric (people are married in pairs, so the number of people is even). The same seed and sizes
give the same world.

The lookup tool (`KnowledgeBase.lookup(query) -> str`): a query is `"<entity>: <relation>"`, e.g.
`"Alda Voren: born_in"`, answered with the fact as a sentence ("Alda Voren was born in Keltmar."). Matching
tolerates case, extra or missing spaces, surrounding quotes and a trailing "?" or ".", and a relation written with
spaces or hyphens ("born in"). An unknown entity is answered "no entry for '...'"; a relation its kind does not have
is answered with the relations it has; a query without ":" with the format. Exact names are what a policy copies
from the question or from an earlier response, so no fuzzy retrieval (e.g. BM25) is used.

Two-hop questions (`generate_two_hop_questions`): each composes two relations, e.g. "In which country was the
employer of Alda Voren founded?" = works_for then founded_in, so its answer needs two lookups, the second naming the
entity the first one answered ("Alda Voren: works_for" -> "Alda Voren works for Dravik Guild.", then
"Dravik Guild: founded_in"). Each carries its gold queries and its gold answer; `solve_two_hop` is the teacher: it
makes the two lookups, reading the bridge entity from the first response's text.

The control (`random_lookup(kb, query, rng, invent)`): the same query format and the same errors as the real tool, but
a valid query is answered with a fact of the right relation about the asked entity whose object is drawn uniformly
from every entity of the right kind (so it is right only by chance), or with `invent` is a name invented afresh.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping, Sequence

PERSON, CITY, COUNTRY, ORGANISATION = "person", "city", "country", "organisation"
KINDS = (PERSON, CITY, COUNTRY, ORGANISATION)


@dataclasses.dataclass(frozen=True)
class Relation:
    name: str  # as written in a query ("born_in")
    subject_kind: str
    object_kind: str
    template: str  # the fact as a sentence, with {subject} and {object}; ends with "{object}."


RELATIONS: Mapping[str, Relation] = {
    r.name: r
    for r in (
        Relation("born_in", PERSON, CITY, "{subject} was born in {object}."),
        Relation("lives_in", PERSON, CITY, "{subject} lives in {object}."),
        Relation("works_for", PERSON, ORGANISATION, "{subject} works for {object}."),
        Relation("married_to", PERSON, PERSON, "{subject} is married to {object}."),
        Relation("located_in", CITY, COUNTRY, "{subject} is located in {object}."),
        Relation("capital", COUNTRY, CITY, "The capital of {subject} is {object}."),
        Relation("headquartered_in", ORGANISATION, CITY, "{subject} is headquartered in {object}."),
        Relation("founded_in", ORGANISATION, COUNTRY, "{subject} was founded in {object}."),
        Relation("founded_by", ORGANISATION, PERSON, "{subject} was founded by {object}."),
    )
}

QUERY_FORMAT = "'<entity>: <relation>', e.g. 'Alda Voren: born_in'"

# Pronounceable, deliberately unusual syllables: onset + vowel (+ coda).
_ONSETS = ("b", "d", "dr", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "th", "v", "z", "br", "st")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "m")
_CITY_ENDINGS = ("", "mar", "holm", "dun", "vik", "esk", "ora")
_COUNTRY_ENDINGS = ("ia", "and", "esh", "ora", "istan", "ene")
_MAX_WORD_CHARS = 10  # of the invented first word of a name
_MAX_NAME_DRAWS = 10_000  # per name: a bound, far above what the default sizes need
_ORGANISATION_WORDS = ("Guild", "Works", "Foundry", "Institute", "Collective", "Trading Company", "Mills", "Press")


@dataclasses.dataclass(frozen=True)
class WorldSizes:
    countries: int = 5
    cities_per_country: int = 4
    organisations: int = 12
    people: int = 40  # even: people are married in pairs

    def validate(self) -> None:
        if min(self.countries, self.cities_per_country, self.organisations, self.people) < 2:
            raise ValueError(f"every size must be at least 2: {self}")
        if self.people % 2:
            raise ValueError(f"people are married in pairs: an even number of people is needed, not {self.people}")


@dataclasses.dataclass(frozen=True, eq=False)
class KnowledgeBase:
    """The world: `kinds` {entity name: kind}, `facts` {(subject, relation name): object}; treat both as
    read-only."""

    kinds: Mapping[str, str]
    facts: Mapping[tuple[str, str], str]

    def entities(self, kind: str) -> tuple[str, ...]:
        """Every entity of `kind`, in generation order."""
        return tuple(name for name, k in self.kinds.items() if k == kind)

    def relations_of(self, kind: str) -> tuple[str, ...]:
        """The relations an entity of `kind` has, one fact each."""
        return tuple(r.name for r in RELATIONS.values() if r.subject_kind == kind)

    def fact(self, subject: str, relation: str) -> str:
        """The fact (subject, relation) as its sentence."""
        return RELATIONS[relation].template.format(subject=subject, object=self.facts[subject, relation])

    def lookup(self, query: str) -> str:
        """The lookup tool: the response to one query `"<entity>: <relation>"` (see the module docstring)."""
        resolved = resolve_query(self, query)
        return resolved if isinstance(resolved, str) else self.fact(*resolved)


# ------------------------------------------------------------------------------------------------------ world


def generate_knowledge_base(seed: int, sizes: WorldSizes = WorldSizes()) -> KnowledgeBase:
    """A world drawn from `seed` (see the module docstring); the same seed and sizes give the same world."""
    sizes.validate()
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = [_unique_name(rng, taken, _country_name) for _ in range(sizes.countries)]
    cities = [_unique_name(rng, taken, _city_name) for _ in range(sizes.countries * sizes.cities_per_country)]
    organisations = [_unique_name(rng, taken, _organisation_name) for _ in range(sizes.organisations)]
    people = [_unique_name(rng, taken, _person_name) for _ in range(sizes.people)]

    facts: dict[tuple[str, str], str] = {}
    for i, city in enumerate(cities):  # cities_per_country consecutive cities per country; the first is its capital
        country = countries[i // sizes.cities_per_country]
        facts[city, "located_in"] = country
        if i % sizes.cities_per_country == 0:
            facts[country, "capital"] = city
    for organisation in organisations:
        facts[organisation, "headquartered_in"] = rng.choice(cities)
        facts[organisation, "founded_in"] = rng.choice(countries)
        facts[organisation, "founded_by"] = rng.choice(people)
    for person in people:
        facts[person, "born_in"] = rng.choice(cities)
        facts[person, "lives_in"] = rng.choice(cities)
        facts[person, "works_for"] = rng.choice(organisations)
    couples = rng.sample(people, len(people))
    for a, b in zip(couples[0::2], couples[1::2]):
        facts[a, "married_to"], facts[b, "married_to"] = b, a

    kinds = {
        name: kind
        for kind, names in ((COUNTRY, countries), (CITY, cities), (ORGANISATION, organisations), (PERSON, people))
        for name in names
    }
    return KnowledgeBase(kinds=kinds, facts=facts)


def _syllables(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(count))


def _person_name(rng: random.Random) -> str:
    return f"{_syllables(rng, 2).capitalize()} {_syllables(rng, 2).capitalize()}"


def _city_name(rng: random.Random) -> str:
    return (_syllables(rng, 2) + rng.choice(_CITY_ENDINGS)).capitalize()


def _country_name(rng: random.Random) -> str:
    return (_syllables(rng, 1) + rng.choice(_COUNTRY_ENDINGS)).capitalize()


def _organisation_name(rng: random.Random) -> str:
    return f"{_syllables(rng, 2).capitalize()} {rng.choice(_ORGANISATION_WORDS)}"


_NAME_DRAWS = {PERSON: _person_name, CITY: _city_name, COUNTRY: _country_name, ORGANISATION: _organisation_name}


def invent_name(kind: str, rng: random.Random) -> str:
    """A name of `kind` drawn as the world's names are (not checked against any world)."""
    return _unique_name(rng, set(), _NAME_DRAWS[kind])


def _unique_name(rng: random.Random, taken: set[str], draw) -> str:
    """A name from `draw(rng)` not yet in `taken` (compared as `normalize` writes them); adds it."""
    for _ in range(_MAX_NAME_DRAWS):
        name = draw(rng)
        if 4 <= len(name.split()[0]) <= _MAX_WORD_CHARS and normalize(name) not in taken:
            taken.add(normalize(name))
            return name
    raise ValueError(f"no new name in {_MAX_NAME_DRAWS} draws after {len(taken)} names: ask for a smaller world")


# ---------------------------------------------------------------------------------------------------- queries


def normalize(text: str) -> str:
    """How names and relations are compared: lower case, surrounding quotes and a trailing "?" / "." dropped,
    underscores / hyphens / runs of whitespace as one space."""
    text = text.strip().strip("\"'`").strip().rstrip("?.").strip().strip("\"'`")
    return " ".join(re.split(r"[\s_\-]+", text.lower())).strip()


def format_query(subject: str, relation: str) -> str:
    """The query a teacher writes for (subject, relation)."""
    return f"{subject}: {relation}"


def split_query(query: str) -> tuple[str, str] | None:
    """(entity as written, relation as `RELATIONS` names it if it is one) of a query with a ":", else None."""
    if not isinstance(query, str) or ":" not in query:
        return None
    entity_text, relation_text = query.rsplit(":", 1)
    return entity_text, normalize(relation_text).replace(" ", "_")


def resolve_query(kb: KnowledgeBase, query: str) -> tuple[str, str] | str:
    """(subject as the world spells it, relation name) of a well-formed query, else the tool's response saying what
    is wrong."""
    split = split_query(query)
    if split is None:
        return f"error: a query is {QUERY_FORMAT}"
    entity_text, relation = split
    relation_text = query.rsplit(":", 1)[1]
    subject = _names(kb).get(normalize(entity_text))
    if subject is None:
        return f"no entry for '{entity_text.strip()}'"
    kind = kb.kinds[subject]
    if (subject, relation) not in kb.facts:
        return (
            f"no entry for '{relation_text.strip()}' of {subject} (a {kind}); its relations: "
            f"{', '.join(kb.relations_of(kind))}"
        )
    return subject, relation


def _names(kb: KnowledgeBase) -> dict[str, str]:
    # Rebuilt per query: a few hundred names, far cheaper than the policy's turn that wrote the query.
    return {normalize(name): name for name in kb.kinds}


def parse_fact(response: str, relation: str) -> tuple[str, str] | None:
    """(subject, object) of a lookup response stating `relation`, or None if it is not such a fact."""
    pattern = re.escape(RELATIONS[relation].template)
    pattern = pattern.replace(re.escape("{subject}"), "(?P<subject>.+?)").replace(
        re.escape("{object}"), "(?P<object>.+)"
    )
    match = re.fullmatch(pattern, response.strip())
    return (match["subject"], match["object"]) if match else None


# -------------------------------------------------------------------------------------------------- two hops


@dataclasses.dataclass(frozen=True)
class TwoHopTemplate:
    first: str  # relation from the question's subject to the bridge entity
    second: str  # relation from the bridge entity to the answer
    question: str  # with {subject}


TWO_HOP_TEMPLATES = (
    TwoHopTemplate("works_for", "founded_in", "In which country was the employer of {subject} founded?"),
    TwoHopTemplate("works_for", "headquartered_in", "In which city is the employer of {subject} headquartered?"),
    TwoHopTemplate("works_for", "founded_by", "Who founded the organisation that {subject} works for?"),
    TwoHopTemplate("born_in", "located_in", "In which country was {subject} born?"),
    TwoHopTemplate("lives_in", "located_in", "In which country does {subject} live?"),
    TwoHopTemplate("married_to", "born_in", "In which city was the spouse of {subject} born?"),
    TwoHopTemplate("married_to", "works_for", "Which organisation does the spouse of {subject} work for?"),
    TwoHopTemplate("founded_by", "born_in", "In which city was the founder of {subject} born?"),
    TwoHopTemplate("founded_by", "lives_in", "In which city does the founder of {subject} live?"),
    TwoHopTemplate("headquartered_in", "located_in", "In which country is {subject} headquartered?"),
)


@dataclasses.dataclass(frozen=True)
class TwoHopQuestion:
    question: str
    subject: str
    relations: tuple[str, str]  # (first, second)
    bridge: str  # the first lookup's answer, named by the second query
    gold_queries: tuple[str, str]
    answer: str


def generate_two_hop_questions(kb: KnowledgeBase, num_questions: int, seed: int) -> list[TwoHopQuestion]:
    """`num_questions` distinct two-hop questions drawn from `seed` over every (template, subject) pair whose answer
    is not the subject itself (e.g. a founder who works for their own organisation)."""
    candidates = all_two_hop_questions(kb)
    if num_questions > len(candidates):
        raise ValueError(f"{num_questions} two-hop questions asked, this world has {len(candidates)}")
    return random.Random(seed).sample(candidates, num_questions)


def all_two_hop_questions(kb: KnowledgeBase) -> list[TwoHopQuestion]:
    """Every two-hop question of the world: each (template, subject) pair whose answer is not the subject itself,
    in template order, then the subjects' generation order."""
    return [
        question
        for template in TWO_HOP_TEMPLATES
        for subject in kb.entities(RELATIONS[template.first].subject_kind)
        if (question := _two_hop(kb, template, subject)).answer != subject
    ]


def _two_hop(kb: KnowledgeBase, template: TwoHopTemplate, subject: str) -> TwoHopQuestion:
    bridge = kb.facts[subject, template.first]
    return TwoHopQuestion(
        question=template.question.format(subject=subject),
        subject=subject,
        relations=(template.first, template.second),
        bridge=bridge,
        gold_queries=(format_query(subject, template.first), format_query(bridge, template.second)),
        answer=kb.facts[bridge, template.second],
    )


@dataclasses.dataclass(frozen=True)
class TeacherSolution:
    steps: tuple[tuple[str, str], ...]  # (query, response) per lookup
    answer: str | None  # None if a response was not the expected fact


def solve_two_hop(question: TwoHopQuestion, lookup) -> TeacherSolution:
    """The teacher: looks up (subject, first relation), reads the bridge entity from the response's text, looks up
    (bridge, second relation) and answers its object. `lookup(query) -> str` is the tool (e.g. `kb.lookup`)."""
    steps: list[tuple[str, str]] = []
    entity: str | None = question.subject
    for relation in question.relations:
        query = format_query(entity, relation)
        response = lookup(query)
        steps.append((query, response))
        parsed = parse_fact(response, relation)
        if parsed is None:
            return TeacherSolution(tuple(steps), None)
        entity = parsed[1]
    return TeacherSolution(tuple(steps), entity)


# --------------------------------------------------------------------------------------------------- control


def random_lookup(kb: KnowledgeBase, query: str, rng: random.Random, invent: bool = False) -> str:
    """The control tool: `kb.lookup`'s format and errors, but the object of a valid query is drawn uniformly from
    every entity of the relation's object kind (the asked entity excluded), from `rng`. With `invent` the object is
    a name of that kind invented afresh (`invent_name`), and a query about an entity the world does not know is
    answered the same way (so a chain of lookups goes on at random instead of ending at "no entry")."""
    if invent:
        split = split_query(query)
        if split is not None and split[1] in RELATIONS:
            subject = _names(kb).get(normalize(split[0]), split[0].strip())
            if subject in kb.kinds and (subject, split[1]) not in kb.facts:
                return resolve_query(kb, query)  # a relation the known entity's kind does not have
            relation = RELATIONS[split[1]]
            return relation.template.format(subject=subject, object=invent_name(relation.object_kind, rng))
    resolved = resolve_query(kb, query)
    if isinstance(resolved, str):
        return resolved
    subject, relation = resolved
    candidates: Sequence[str] = [e for e in kb.entities(RELATIONS[relation].object_kind) if e != subject]
    return RELATIONS[relation].template.format(subject=subject, object=rng.choice(candidates))
