"""Host-side tools (reno_jax/tools): the calculator agrees with Python's arithmetic, never raises and answers fast
on adversarial input; the knowledge base is deterministic by seed and consistent, its two-hop questions are solved
by exactly their two gold lookups, and the random lookup control is wrong most of the time."""

import math
import random
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reno_jax.tools import calculator, knowledge_base

# ------------------------------------------------------------------------------------------------- calculator


def _expressions(leaf, operators, max_leaves=8):
    """Fully parenthesised expressions over `leaf` strings with the binary `operators` and unary minus."""
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(operators), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            inner.map(lambda e: f"-{e}"),
        ),
        max_leaves=max_leaves,
    )


_SMALL_INTS = st.integers(0, 10**6).map(str)
_POWERS = st.tuples(st.integers(0, 99), st.integers(0, 3)).map(lambda t: f"({t[0]} ** {t[1]})")
_DECIMALS = st.decimals(0, 999, places=3, allow_nan=False, allow_infinity=False).map(str)


def _python(expression):
    """Python's own value of a generated expression (only the test's generated strings ever reach eval)."""
    try:
        return eval(expression, {"__builtins__": {}})  # noqa: S307
    except ZeroDivisionError:
        return None


@settings(max_examples=300, deadline=None)
@given(_expressions(st.one_of(_SMALL_INTS, _POWERS), ["+", "-", "*", "//", "%"]))
def test_integer_arithmetic_is_pythons_exactly(expression):
    expected = _python(expression)
    got = calculator.evaluate(expression)
    if expected is None:
        assert got == "error: division by zero"
    elif abs(expected) > calculator.MAX_MAGNITUDE:
        assert got == "error: result too large"
    else:
        assert got == str(expected)


@settings(max_examples=300, deadline=None)
@given(_expressions(st.one_of(st.integers(0, 999).map(str), _DECIMALS), ["+", "-", "*", "/", "//", "%"], 5))
def test_arithmetic_with_division_and_decimals_agrees_with_python(expression):
    # Operands below 1e3 and at most five of them keep every intermediate integer below 2**53, where an exact
    # integer quotient (the calculator's) and Python's float quotient are the same number.
    expected = _python(expression)
    got = calculator.evaluate(expression)
    if expected is None:
        assert got == "error: division by zero"
    else:
        assert math.isclose(float(got), expected, rel_tol=1e-10, abs_tol=1e-9), (expression, got, expected)


def test_output_rules():
    assert calculator.evaluate("10**20 / 4") == "25000000000000000000"  # exact integer quotient
    assert calculator.evaluate("7 / 2") == "3.5"
    assert calculator.evaluate("0.1 + 0.2") == "0.3"  # 12 significant digits
    assert calculator.evaluate("1 / 3") == "0.333333333333"
    assert calculator.evaluate("6 / 3") == "2" and calculator.evaluate("2.0") == "2"
    assert calculator.evaluate("-0.0") == "0"
    assert calculator.evaluate(" -2 ** 2 ") == "-4"  # Python's precedence
    assert calculator.evaluate("-7 // 2") == "-4" and calculator.evaluate("-7 % 3") == "2"


@pytest.mark.parametrize(
    "expression, error",
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9**9**9**9", "result too large"),
        ("10 ** 101", "result too large"),
        ("1e300 * 1e300", "result too large"),
        ("(-8) ** 0.5", "the result is not a real number"),
        ("2 ^ 3", "^ is not a power here: write ** (2 ** 10)"),
        ("", "empty expression"),
        ("x + 1", "only numbers, + - * / // % **, and parentheses are allowed"),
        ("__import__('os').system('true')", "only numbers, + - * / // % **, and parentheses are allowed"),
        ("100!", "invalid expression (only numbers, + - * / // % **, and parentheses are allowed)"),
    ],
)
def test_invalid_input_is_a_clear_error(expression, error):
    assert calculator.evaluate(expression) == "error: " + error


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=400), st.text(alphabet="0123456789+-*/%().e ", max_size=400)))
def test_never_raises(text):
    assert isinstance(calculator.evaluate(text), str)


@pytest.mark.parametrize(
    "expression",
    [
        "9**9**9**9",
        "2 ** 10 ** 100",
        "(10 ** 99) ** (10 ** 99)",
        "0.5 ** -(10 ** 99)",
        "(-1) ** (10 ** 99) + 2 ** -(10 ** 99)",
        "9" * 100 + "*" + "9" * 100,
        "*".join(["99999999999"] * 27),  # products stop at MAX_MAGNITUDE
        "(" * 150 + "1" + ")" * 150,
        "-" * 299 + "1",
        "1+" * 10_000 + "1",
        "1" * 10**6,
        "math.factorial(10 ** 6)",
        "(10 ** 6)!",
    ],
)
def test_adversarial_input_answers_fast(expression):
    start = time.perf_counter()
    response = calculator.evaluate(expression)
    assert time.perf_counter() - start < 0.1, expression[:40]
    assert isinstance(response, str)


# --------------------------------------------------------------------------------------------- knowledge base


@pytest.fixture(scope="module")
def kb():
    return knowledge_base.generate_knowledge_base(seed=3)


def test_the_world_is_deterministic_by_seed(kb):
    again = knowledge_base.generate_knowledge_base(seed=3)
    assert again.kinds == kb.kinds and again.facts == kb.facts
    other = knowledge_base.generate_knowledge_base(seed=4)
    assert other.kinds != kb.kinds
    questions = knowledge_base.generate_two_hop_questions(kb, 50, seed=1)
    assert questions == knowledge_base.generate_two_hop_questions(again, 50, seed=1)
    assert questions != knowledge_base.generate_two_hop_questions(kb, 50, seed=2)


@pytest.mark.parametrize("seed", range(5))
def test_the_world_is_consistent(seed):
    sizes = knowledge_base.WorldSizes()
    kb = knowledge_base.generate_knowledge_base(seed, sizes)
    normalized = [knowledge_base.normalize(name) for name in kb.kinds]
    assert len(set(normalized)) == len(normalized)  # names unique, ignoring case and spacing
    assert all(re.fullmatch(r"[A-Z][a-z]+( [A-Z][a-z]+)*", name) for name in kb.kinds)
    counts = {kind: len(kb.entities(kind)) for kind in knowledge_base.KINDS}
    assert counts == {
        "person": sizes.people,
        "city": sizes.countries * sizes.cities_per_country,
        "country": sizes.countries,
        "organisation": sizes.organisations,
    }
    # Exactly one fact per (entity, relation of its kind), its object of the relation's kind.
    expected = {(name, r) for name, kind in kb.kinds.items() for r in kb.relations_of(kind)}
    assert set(kb.facts) == expected
    for (subject, relation), obj in kb.facts.items():
        assert kb.kinds[obj] == knowledge_base.RELATIONS[relation].object_kind
    for person in kb.entities("person"):
        spouse = kb.facts[person, "married_to"]
        assert spouse != person and kb.facts[spouse, "married_to"] == person
    for country in kb.entities("country"):
        assert kb.facts[kb.facts[country, "capital"], "located_in"] == country


def test_lookup_answers_every_fact_and_tolerates_case_and_spaces(kb):
    for (subject, relation), obj in kb.facts.items():
        response = kb.lookup(f"{subject}: {relation}")
        assert knowledge_base.parse_fact(response, relation) == (subject, obj)
    person = kb.entities("person")[0]
    fact = kb.lookup(f"{person}: born_in")
    for query in (
        f"  {person.upper()}:born in ",
        f"'{person.lower()}' :  Born-In?",
        f"{person.replace(' ', '  ')}: born_in.",
    ):
        assert kb.lookup(query) == fact


def test_lookup_says_what_is_wrong(kb):
    city = kb.entities("city")[0]
    assert kb.lookup("Nobody Here: born_in") == "no entry for 'Nobody Here'"
    assert kb.lookup(f"{city}: born_in") == f"no entry for 'born_in' of {city} (a city); its relations: located_in"
    assert kb.lookup("where was everyone born") == (
        "error: a query is '<entity>: <relation>', e.g. 'Alda Voren: born_in'"
    )


def test_every_two_hop_question_is_solved_by_exactly_its_two_gold_lookups(kb):
    questions = knowledge_base.generate_two_hop_questions(kb, 200, seed=0)
    assert len({q.question for q in questions}) == 200
    assert {q.relations for q in questions} == {(t.first, t.second) for t in knowledge_base.TWO_HOP_TEMPLATES}
    for q in questions:
        solution = knowledge_base.solve_two_hop(q, kb.lookup)
        assert [query for query, _ in solution.steps] == list(q.gold_queries)
        assert solution.answer == q.answer != q.subject
        first, second = (response for _, response in solution.steps)
        assert q.bridge in first and q.gold_queries[1].startswith(q.bridge)  # the second query names hop one's answer
        assert q.answer in second and q.answer not in first
        assert q.subject in q.question and q.answer not in q.question and q.bridge not in q.question


def test_the_random_lookup_is_wrong_most_of_the_time(kb):
    rng = random.Random(0)
    wrong = 0
    for (subject, relation), obj in kb.facts.items():
        response = knowledge_base.random_lookup(kb, f"{subject}: {relation}", rng)
        parsed = knowledge_base.parse_fact(response, relation)
        assert parsed is not None and parsed[0] == subject  # the real tool's format
        assert kb.kinds[parsed[1]] == knowledge_base.RELATIONS[relation].object_kind
        wrong += parsed[1] != obj
    assert wrong / len(kb.facts) > 0.8
    assert knowledge_base.random_lookup(kb, "Nobody Here: born_in", rng) == kb.lookup("Nobody Here: born_in")
    questions = knowledge_base.generate_two_hop_questions(kb, 200, seed=0)
    solved = sum(
        knowledge_base.solve_two_hop(q, lambda query: knowledge_base.random_lookup(kb, query, rng)).answer == q.answer
        for q in questions
    )
    assert solved / len(questions) < 0.3


def test_world_sizes_are_checked():
    with pytest.raises(ValueError, match="even number of people"):
        knowledge_base.generate_knowledge_base(0, knowledge_base.WorldSizes(people=7))
    with pytest.raises(ValueError, match="at least 2"):
        knowledge_base.generate_knowledge_base(0, knowledge_base.WorldSizes(countries=1))
    small = knowledge_base.generate_knowledge_base(0, knowledge_base.WorldSizes(2, 2, 2, 4))
    assert len(small.kinds) == 2 + 4 + 2 + 4
