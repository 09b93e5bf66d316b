"""The tool-call compiler: tool schemas (data) -> a host reference parser and a jitted token-level automaton that
agrees with it exactly.

Result (design contract): ``kind`` int32 in {0 ok, 1 no_call, 2 bad_call, 3 out_of_range}, ``tool`` int32 (the
named tool's index in the schema list when kind is ok or out_of_range, else -1) and ``args`` int32 ``[A]`` (A =
the largest argument count over the tools): the called tool's argument values in its schema order, zero padded,
an enum given as its option's index, a free-text argument as 0; all zeros unless kind is ok. ``parse_full`` also
returns the free-text arguments as token spans (``text_ids [M, L]``, ``text_len [M]``, see "Free text").

Schemas
-------
A list of tools in the OpenAI/HF ``tools=`` format (``{"type": "function", "function": {"name", "parameters"}}``,
or the bare ``function`` object). Every property must be ``required``; supported properties are
``{"type": "integer", "minimum": lo, "maximum": hi}`` with ``0 <= lo <= hi <= MAX_INT`` and
``{"type": "string", "enum": [...]}`` with printable-ASCII options without ``"`` or ``\\``, and free text
``{"type": "string", "maxTokens": N}`` with ``1 <= N <= MAX_TEXT_TOKENS``: a reno_jax key, the bound in TOKENS
(JSON-schema ``maxLength`` counts characters, so it is not accepted). Tool names and argument keys follow the
enum rule. Anything else raises ``ValueError`` naming the tool/argument.

Grammar
-------
1. Span. The FIRST occurrence of ``<tool_call>`` opens the call; the first ``</tool_call>`` after it closes it.
   Text before the call (reasoning, ``<think>...</think>``, anything) is ignored and is NOT special: a call
   inside ``<think>`` counts. Everything after the closing tag (more calls, ``<|im_end|>``) is ignored. No opening
   tag, or no closing tag after it (e.g. a truncated call) -> ``no_call``.
2. Body: the text between the tags must be exactly one JSON object (RFC 8259, as ``json.loads`` reads it) of this
   shape, else ``bad_call``::

       {"name": "<tool name>", "arguments": {"<arg>": <value>, ...}}

   * Members: exactly the two keys ``name`` and ``arguments``, in either order; no extra keys and no duplicates.
     ``name`` is one of the tools' names; ``arguments`` holds exactly that tool's argument keys, in any order,
     each once (``{}`` for a tool without arguments).
   * Whitespace: any JSON whitespace (space, tab, LF, CR) before/after the object and around every ``{ } : ,``
     (nothing else counts as whitespace).
   * Strings are compared literally: any backslash escape anywhere in the body -> ``bad_call`` (so
     ``"\\u0063hoose_square"`` is rejected even though JSON would decode it to the right name).
   * An integer argument must be a JSON integer: ``-?(0|[1-9][0-9]*)``. Fractions/exponents (``5.0``, ``5e0``),
     strings (``"5"``), ``true``/``false``/``null``, arrays, objects -> ``bad_call``; leading zeros (``05``,
     ``-05``) are not JSON -> ``bad_call``; a ``+`` sign is not JSON -> ``bad_call``.
   * An enum argument must be a JSON string equal to one of the options, else ``bad_call``.
   * A free-text argument must be a JSON string (no escapes, by the rule above; no control characters; any
     other byte, non-ASCII included). Its token-level rules are in "Free text".
3. Range: an integer outside ``[minimum, maximum]`` (any negative number, ``-0`` included, and any number of
   digits) -> ``out_of_range``, provided everything else is well formed.

Free text
---------
A free-text argument is captured as the ids of the tokens strictly between its quotes, so the quotes must sit at
token boundaries: the opening quote is the LAST byte of a token (``": "`` merges are fine), every token inside is
text only, and the closing quote is the FIRST byte of a token (``"}}`` merges are fine, as for any argument).
A token that holds both text and a quote (``"hello``, ``hello"``) or a backslash is a bad call, and so is a text
of more than ``maxTokens`` tokens (token counts are not a text property: ``parse_text`` checks only the JSON).
The shipped tokenizer's pre-tokenizer splits quotes from letters, so its own encoding of a call passes.

The byte automaton gets one more symbol, ``BOUNDARY`` (the end of every token, identity everywhere but inside
free text): inside a string, ``opened`` -BOUNDARY-> ``between`` -text-> ``inside`` -BOUNDARY-> ``between``, the
last edge storing "append to span p" (span registers numbered per (tool, text argument) after the value
registers). Lifted to tokens, a token's entry is its bytes then a boundary, so its store code says which spans
it appends to (``code_appends``); the runtime keeps ``[P + 1, L]`` ids and ``[P + 1]`` counts beside the
registers, one token per step (no pair table), and the bound is checked once at the end. Schemas without free
text have no boundary column: their automata are exactly as before.

Jitted parser
-------------
The body grammar is built from the schema as an NFA (``_BodyBuilder``: literals, whitespace loops, a trie of
keys per "set of arguments seen so far" so arguments come in any order without duplicates, the name-first and
the arguments-first member orders as alternatives) and determinised by subset construction; the alternatives run
side by side until the bytes tell them apart. An in-progress integer's value lives in the automaton state
(saturating at ``maximum + 1``, which is out of range whatever follows) and every digit edge stores the value so
far in the argument's register, so the register holds the whole number when it ends; ``-`` stores
``maximum + 1``. An enum's closing quote stores the option index. Registers are numbered per (tool, argument
position), so alternatives that are alive together (arguments before the name: every tool is a candidate) never
write the same register.

Then, as for any literal tag, a KMP matcher for ``<tool_call>``, then inside the call a KMP matcher for
``</tool_call>`` in parallel with the body DFA and the body's accept label saved at the most recent ``<`` (the
closing tag's only ``<`` is its first byte, so that is the body's verdict just before the tag). Text decoding
replaces invalid UTF-8 by U+FFFD and every non-ASCII byte is "other" to all the automata, so bytes and decoded text
give the same result. The product of the three is Moore-minimized (outputs: pending / rejected / accepted tool t,
and the register stores of every edge); for the single ``choose_square`` schema that is 137 states (the
hand-built automaton it replaces, state for state in count), for the three-tool schema of the tests
(``drop_piece``, ``move`` with two integers and an enum, ``pass``) 492. An integer's value states collapse once
every further digit saturates, so even ``0..4095`` stays under a thousand states (built in about ten seconds).

``compile_tool_calls`` lifts the automaton to tokens (``protocol.tokens``): a token's entry is the state after all
of its bytes and a *store code*, the id of the set of register stores along the way (later stores override
earlier ones), packed as ``state << reg_bits | code`` (int16 when it fits). Token ids with equal columns share a
class. ``parse`` is one class lookup and one dependent table lookup per token, or per PAIR of tokens with the pair
table; with one register in the schema the last store code IS the register, so the carry is a single int32 (as in
the original tic-tac-toe parser); with more, a token whose code is non-zero also overwrites registers from a tiny
``[codes, R]`` table, off the dependency chain of the state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.protocol import tokens as tokens_lib

KIND_OK = 0
KIND_NO_CALL = 1
KIND_BAD_CALL = 2
KIND_OUT_OF_RANGE = 3
KIND_NAMES = ("ok", "no_call", "bad_call", "out_of_range")

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

MAX_INT = 4095  # largest supported integer maximum: the value lives in the automaton state (one state per value)
MAX_TOOLS = 4096  # the packed one-register result keeps tool + 1 in 14 bits
MAX_ARGS = 8  # per tool: the body DFA tracks the set of arguments seen (2**n sets)
MAX_TEXT_TOKENS = 1024  # a free-text argument's bound (its span register is [maxTokens] token ids)
MAX_PRODUCT_STATES = 1 << 18  # host-side guard; the runtime table is states x token classes

# ----------------------------------------------------------------------------------------------------------------
# Schemas
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One argument: ``kind`` "integer" (``lo..hi``), "enum" (``options``) or "text" (free text of at most
    ``max_tokens`` tokens)."""

    name: str
    kind: str
    lo: int = 0
    hi: int = 0
    options: tuple[str, ...] = ()
    max_tokens: int = 0

    @property
    def max_value(self) -> int:
        """Largest value its register can hold (an integer saturates at ``hi + 1``; a text argument's register
        is never written)."""
        if self.kind == "text":
            return 0
        return self.hi + 1 if self.kind == "integer" else len(self.options) - 1


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    args: tuple[ArgSpec, ...]


def _check_literal(what: str, s: Any, allow_empty: bool = False) -> str:
    if not isinstance(s, str):
        raise ValueError(f"{what} must be a string, got {s!r}")
    if not s and not allow_empty:
        raise ValueError(f"{what} must not be empty")
    if any(not 0x20 <= ord(c) <= 0x7E or c in '"\\' for c in s):
        raise ValueError(f"{what} {s!r}: only printable ASCII without quotes or backslashes is supported")
    return s


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _arg_spec(tool: str, key: str, prop: Any) -> ArgSpec:
    where = f"tool {tool!r} argument {key!r}"
    if not isinstance(prop, dict):
        raise ValueError(f"{where}: schema must be an object, got {prop!r}")
    extra = set(prop) - {"type", "minimum", "maximum", "enum", "maxTokens", "description", "title"}
    if extra:
        raise ValueError(f"{where}: unsupported schema keywords {sorted(extra)}")
    kind = prop.get("type")
    if kind != "string" and "maxTokens" in prop:
        raise ValueError(f"{where}: maxTokens applies to strings only")
    if kind == "integer":
        if "enum" in prop:
            raise ValueError(f"{where}: integer enums are not supported (use minimum/maximum)")
        lo, hi = prop.get("minimum"), prop.get("maximum")
        if not (_is_int(lo) and _is_int(hi) and 0 <= lo <= hi <= MAX_INT):
            raise ValueError(
                f"{where}: integers need integer 'minimum' and 'maximum' with 0 <= minimum <= maximum "
                f"<= {MAX_INT}, got minimum={lo!r}, maximum={hi!r}"
            )
        return ArgSpec(key, "integer", lo=lo, hi=hi)
    if kind == "string":
        if "minimum" in prop or "maximum" in prop:
            raise ValueError(f"{where}: minimum/maximum apply to integers only")
        if "maxTokens" in prop:
            bound = prop["maxTokens"]
            if "enum" in prop:
                raise ValueError(f"{where}: give either an 'enum' list or a 'maxTokens' bound, not both")
            if not (_is_int(bound) and 1 <= bound <= MAX_TEXT_TOKENS):
                raise ValueError(
                    f"{where}: free text needs an integer 'maxTokens' in 1..{MAX_TEXT_TOKENS}, got {bound!r}"
                )
            return ArgSpec(key, "text", max_tokens=bound)
        options = prop.get("enum")
        if not isinstance(options, (list, tuple)) or not options:
            raise ValueError(f"{where}: strings need a non-empty 'enum' list, or a 'maxTokens' bound for free text")
        for o in options:
            _check_literal(f"{where}: enum option", o, allow_empty=True)
        if len(set(options)) != len(options):
            raise ValueError(f"{where}: duplicate enum options")
        return ArgSpec(key, "enum", options=tuple(options))
    raise ValueError(f"{where}: unsupported type {kind!r} (integer with minimum/maximum, or string enum)")


def normalize_tools(tools: Sequence[dict]) -> tuple[ToolSpec, ...]:
    """Validate OpenAI/HF ``tools=`` schemas and reduce them to ``ToolSpec``s (hashable: a static jit argument)."""
    if isinstance(tools, dict):
        tools = [tools]
    tools = list(tools)
    if not tools:
        raise ValueError("at least one tool schema is needed")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tool #{i}: schema must be a dict, got {type(tool).__name__}")
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise ValueError(f"tool #{i}: only type 'function' is supported, got {tool.get('type')!r}")
            fn = tool["function"]
        else:
            fn = tool
        if not isinstance(fn, dict):
            raise ValueError(f"tool #{i}: 'function' must be an object")
        name = _check_literal(f"tool #{i} name", fn.get("name"))
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"tool {name!r}: parameters must be a JSON-schema object")
        if params.get("additionalProperties", False) is not False:
            raise ValueError(f"tool {name!r}: additionalProperties is not supported (extra keys are rejected)")
        props = params.get("properties") or {}
        if not isinstance(props, dict):
            raise ValueError(f"tool {name!r}: properties must be an object")
        required = params.get("required", [])
        if not isinstance(required, (list, tuple)) or len(set(required)) != len(required):
            raise ValueError(f"tool {name!r}: required must be a list without duplicates")
        missing = [k for k in props if k not in required]
        if missing:
            raise ValueError(f"tool {name!r}: every argument must be required; not required: {missing}")
        unknown = [k for k in required if k not in props]
        if unknown:
            raise ValueError(f"tool {name!r}: required names unknown arguments {unknown}")
        if len(props) > MAX_ARGS:
            raise ValueError(f"tool {name!r}: {len(props)} arguments, at most {MAX_ARGS} are supported")
        args = tuple(_arg_spec(name, _check_literal(f"tool {name!r} argument name", k), p) for k, p in props.items())
        out.append(ToolSpec(name, args))
    names = [t.name for t in out]
    if len(names) > MAX_TOOLS:
        raise ValueError(f"{len(names)} tools, at most {MAX_TOOLS} are supported")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tool names in {names}")
    return tuple(out)


def _as_spec(tools) -> tuple[ToolSpec, ...]:
    if isinstance(tools, ToolCallTables):
        return tools.spec
    if isinstance(tools, tuple) and tools and all(isinstance(t, ToolSpec) for t in tools):
        return tools
    return normalize_tools(tools)


def max_args(spec: Sequence[ToolSpec]) -> int:
    return max(len(t.args) for t in spec)


def max_text_args(spec: Sequence[ToolSpec]) -> int:
    """Largest number of free-text arguments of one tool (the rows of ``ToolCall.text_ids``)."""
    return max(sum(a.kind == "text" for a in t.args) for t in spec)


def max_text_tokens(spec: Sequence[ToolSpec]) -> int:
    """Largest ``maxTokens`` bound over the free-text arguments (the columns of ``ToolCall.text_ids``)."""
    return max([a.max_tokens for t in spec for a in t.args if a.kind == "text"] or [0])


def _text_registers(spec: Sequence[ToolSpec]) -> list[list[int]]:
    """Span register of each tool's free-text arguments, in schema order, numbered per (tool, text position) like
    the value registers (alternatives alive together never append to the same span)."""
    out, n = [], 0
    for t in spec:
        k = sum(a.kind == "text" for a in t.args)
        out.append(list(range(n, n + k)))
        n += k
    return out


def decode_args(tools, tool: int, args) -> dict[str, Any]:
    """``{argument: value}`` of a parsed call (enum indices mapped back to their strings; a free-text argument's
    value is 0: its tokens are in ``text_ids``)."""
    t = _as_spec(tools)[int(tool)]
    return {a.name: (a.options[int(v)] if a.kind == "enum" else int(v)) for a, v in zip(t.args, list(args))}


# ----------------------------------------------------------------------------------------------------------------
# Host reference
# ----------------------------------------------------------------------------------------------------------------


class _Reject(Exception):
    pass


def _reject(_):
    raise _Reject()


def _pairs_to_dict(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Reject()  # duplicate keys
    return dict(pairs)


def _parse_int(s: str) -> int:
    # Every range is within 0..MAX_INT: a minus sign (-0 too) is out of range, and so is any long digit string
    # (no int() on huge inputs).
    if s.startswith("-"):
        return -1
    return int(s) if len(s) <= 20 else 10**21


def parse_text(tools, text: str) -> tuple[int, int, tuple[int, ...]]:
    """Reference parser (plain Python, ``json.loads``). ``tools``: schemas, ``normalize_tools`` output or
    ``ToolCallTables``. Returns ``(kind, tool, args)`` as the jitted ``parse`` does (see the module docstring)."""
    spec = _as_spec(tools)
    a_max = max_args(spec)
    zeros = (0,) * a_max
    start = text.find(OPEN_TAG)
    if start < 0:
        return KIND_NO_CALL, -1, zeros
    end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
    if end < 0:
        return KIND_NO_CALL, -1, zeros
    body = text[start + len(OPEN_TAG) : end]
    bad = (KIND_BAD_CALL, -1, zeros)
    if "\\" in body:
        return bad
    try:
        obj = json.loads(
            body, object_pairs_hook=_pairs_to_dict, parse_float=_reject, parse_constant=_reject, parse_int=_parse_int
        )
    except (ValueError, RecursionError, _Reject):
        return bad
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} or not isinstance(obj["name"], str):
        return bad
    index = next((i for i, t in enumerate(spec) if t.name == obj["name"]), None)
    if index is None:
        return bad
    tool, args = spec[index], obj["arguments"]
    if not isinstance(args, dict) or set(args) != {a.name for a in tool.args}:
        return bad
    values, in_range = [], True
    for a in tool.args:
        v = args[a.name]
        if a.kind == "integer":
            if not _is_int(v):  # bool is an int subclass: true/false are rejected here
                return bad
            in_range &= a.lo <= v <= a.hi
            values.append(v)
        elif a.kind == "text":
            if not isinstance(v, str):
                return bad
            values.append(0)
        else:
            if not isinstance(v, str) or v not in a.options:
                return bad
            values.append(a.options.index(v))
    if not in_range:
        return KIND_OUT_OF_RANGE, index, zeros
    return KIND_OK, index, tuple(values) + (0,) * (a_max - len(values))


# ----------------------------------------------------------------------------------------------------------------
# Body automaton: NFA from the schema, subset construction
# ----------------------------------------------------------------------------------------------------------------

_WS = b" \t\n\r"
_DIGITS = b"0123456789"
# Free text: the symbol between two tokens (never a byte; only schemas with free text have this column), and the
# bytes a JSON string may hold unescaped (no quote, no backslash, no control character; non-ASCII bytes count as
# text, and so does U+FFFD, what decoding makes of invalid UTF-8, so bytes and decoded text agree).
BOUNDARY = 256
_TEXT_BYTES = tuple(c for c in range(0x20, 256) if c not in b'"\\')


class _BodyBuilder:
    """NFA of the call body. Byte edges may carry one register store ``(register, value)``; epsilon edges carry
    none. ``accept[s] = t`` marks "object closed, tool t". Symbols are bytes and ``BOUNDARY`` (the end of a
    token); a state without a ``BOUNDARY`` edge keeps its place at a boundary."""

    def __init__(self):
        self.edges: list[list[tuple[tuple[int, ...], int, tuple[int, int] | None]]] = []
        self.eps: list[list[int]] = []
        self.accept: dict[int, int] = {}

    def state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def edge(self, s: int, chars, t: int, store: tuple[int, int] | None = None) -> None:
        self.edges[s].append((tuple(chars), t, store))

    def ws(self, s: int) -> int:
        self.edge(s, _WS, s)
        return s

    def lit(self, s: int, text: bytes) -> int:
        for c in text:
            t = self.state()
            self.edge(s, bytes([c]), t)
            s = t
        return s

    def key(self, s: int, key: str) -> int:
        """From a position expecting a key: ``"key"`` ws ``:`` ws -> the value position."""
        colon = self.ws(self.lit(s, b'"' + key.encode() + b'"'))
        v = self.state()
        self.edge(colon, b":", v)
        return self.ws(v)

    def integer(self, s: int, after: int, reg: int, lo: int, hi: int) -> None:
        """``-?(0|[1-9][0-9]*)`` from value position s, then (epsilon) to ``after``."""
        cap = hi + 1
        neg, neg_zero, neg_digits, zero = (self.state() for _ in range(4))
        self.edge(s, b"-", neg, (reg, cap))
        self.edge(neg, b"0", neg_zero)
        self.edge(neg, b"123456789", neg_digits)
        self.edge(neg_digits, _DIGITS, neg_digits)
        self.edge(s, b"0", zero, (reg, 0))
        for e in (neg_zero, neg_digits, zero):
            self.eps[e].append(after)
        value: dict[int, int] = {}

        def digits(v: int) -> int:
            if v not in value:
                value[v] = self.state()
                self.eps[value[v]].append(after)
                pending.append(v)
            return value[v]

        pending: list[int] = []
        for d in range(1, 10):
            self.edge(s, bytes([ord("0") + d]), digits(min(d, cap)), (reg, min(d, cap)))
        while pending:
            v = pending.pop()
            for d in range(10):
                w = min(v * 10 + d, cap)
                self.edge(value[v], bytes([ord("0") + d]), digits(w), (reg, w))

    def enum(self, s: int, after: int, reg: int, options: tuple[str, ...]) -> None:
        q = self.state()
        self.edge(s, b'"', q)
        for i, o in enumerate(options):
            self.edge(self.lit(q, o.encode()), b'"', after, (reg, i))

    def text(self, s: int, after: int, span: int) -> None:
        """A free-text JSON string whose quotes sit at token boundaries: the opening quote ends a token, every
        token in between is text only, the closing quote starts a token. Each text token appends to the span
        register ``span`` (the store on its closing boundary); a token that mixes text with a quote is rejected,
        so the span holds exactly the ids between the quotes. ``""`` in one token is the empty string."""
        opened, between, inside = self.state(), self.state(), self.state()
        self.edge(s, b'"', opened)
        self.edge(opened, b'"', after)
        self.edge(opened, (BOUNDARY,), between)
        self.edge(between, (BOUNDARY,), between)
        self.edge(between, b'"', after)
        self.edge(between, _TEXT_BYTES, inside)
        self.edge(inside, _TEXT_BYTES, inside)
        self.edge(inside, (BOUNDARY,), between, (span, 0))

    def arguments(self, s: int, tool: ToolSpec, reg0: int, span0: int = 0) -> int:
        """``{ members }`` from value position s: the tool's keys in any order, each once. Returns the state after
        the closing brace (+ ws)."""
        o = self.ws(self.state())
        self.edge(s, b"{", o)
        done = self.ws(self.state())
        n = len(tool.args)
        if n == 0:
            self.edge(o, b"}", done)
            return done
        full = (1 << n) - 1
        expect = {0: o}  # seen-set -> state expecting a key's opening quote
        text_index = {i: span0 + k for k, i in enumerate(i for i, a in enumerate(tool.args) if a.kind == "text")}

        def expecting(seen: int) -> int:
            if seen not in expect:
                expect[seen] = self.ws(self.state())
                todo.append(seen)
            return expect[seen]

        todo = [0]
        while todo:
            seen = todo.pop()
            for i, a in enumerate(tool.args):
                if seen >> i & 1:
                    continue
                v = self.key(expect[seen], a.name)
                after = self.ws(self.state())
                if a.kind == "integer":
                    self.integer(v, after, reg0 + i, a.lo, a.hi)
                elif a.kind == "text":
                    self.text(v, after, text_index[i])
                else:
                    self.enum(v, after, reg0 + i, a.options)
                now = seen | 1 << i
                if now == full:
                    self.edge(after, b"}", done)
                else:
                    comma = self.state()
                    self.edge(after, b",", comma)
                    self.eps[comma].append(expecting(now))
        return done


def _build_body_nfa(spec: Sequence[ToolSpec]) -> tuple[_BodyBuilder, int, list[int]]:
    b = _BodyBuilder()
    start = b.ws(b.state())
    outer = b.ws(b.state())
    b.edge(start, b"{", outer)
    offsets = list(np.cumsum([0] + [len(t.args) for t in spec])[:-1])
    n_regs = sum(len(t.args) for t in spec)
    spans = [n_regs + r[0] if r else 0 for r in _text_registers(spec)]  # span stores follow the value registers
    for t, tool in enumerate(spec):
        end = b.ws(b.state())
        b.accept[end] = t
        # name first
        name_v = b.key(outer, "name")
        after_name = b.ws(b.lit(name_v, b'"' + tool.name.encode() + b'"'))
        comma = b.ws(b.state())
        b.edge(after_name, b",", comma)
        b.edge(b.arguments(b.key(comma, "arguments"), tool, int(offsets[t]), spans[t]), b"}", end)
        # arguments first
        after_args = b.arguments(b.key(outer, "arguments"), tool, int(offsets[t]), spans[t])
        comma2 = b.ws(b.state())
        b.edge(after_args, b",", comma2)
        after_name2 = b.ws(b.lit(b.key(comma2, "name"), b'"' + tool.name.encode() + b'"'))
        b.edge(after_name2, b"}", end)
    return b, start, [int(o) for o in offsets]


class _Stores:
    """Registry of register-store sets (``((register, value), ...)`` sorted by register); id 0 = no store."""

    def __init__(self, num_registers: int, single_max: int | None):
        self.sets: list[tuple[tuple[int, int], ...]] = [()]
        self.ids: dict[tuple, int] = {(): 0}
        self.num_registers = num_registers
        if single_max is not None:  # one register: code = value + 1, the carry's low bits ARE the register
            for v in range(single_max + 1):
                self.id(((0, v),))

    def id(self, stores) -> int:
        key = tuple(sorted(stores))
        if key not in self.ids:
            self.ids[key] = len(self.sets)
            self.sets.append(key)
        return self.ids[key]

    def merge_one(self, a: int, b: int) -> int:
        d = dict(self.sets[a])
        d.update(self.sets[b])
        return self.id(d.items())

    def merge(self, prev: np.ndarray, edge: np.ndarray) -> np.ndarray:
        """Vectorised ``merge_one`` (later stores override earlier ones)."""
        out = np.where(edge != 0, edge, prev)
        both = (edge != 0) & (prev != 0) & (edge != prev)
        if self.num_registers > 1 and both.any():
            pairs = np.stack([prev[both], edge[both]], axis=1)
            uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
            merged = np.array([self.merge_one(int(a), int(b)) for a, b in uniq], np.int64)
            out[both] = merged[inv.ravel()]
        return out


def _determinize(nfa: _BodyBuilder, start: int, stores: _Stores, num_symbols: int = 256):
    """Subset construction over byte classes. Returns ``(next [N, X], code [N, X], label [N])`` (X =
    ``num_symbols``: 256 bytes, plus ``BOUNDARY`` with free text) with label ``t + 1`` for "accepted, tool t", 0
    otherwise; state 0 is the start, state 1 the empty set (dead)."""
    n = len(nfa.edges)
    if num_symbols > BOUNDARY:  # a state without a boundary edge stays put at a token boundary (edits the NFA)
        for s in range(n):
            if not any(BOUNDARY in chars for chars, _, _ in nfa.edges[s]):
                nfa.edge(s, (BOUNDARY,), s)
    labels = sorted({chars for s in range(n) for chars, _, _ in nfa.edges[s]})  # few distinct byte sets
    sig = np.zeros((num_symbols, max(1, len(labels))), bool)
    for j, chars in enumerate(labels):
        sig[list(chars), j] = True
    byte_class = _row_ids(sig)
    n_cls = int(byte_class.max()) + 1

    def closure(states) -> frozenset:
        seen, stack = set(states), list(states)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    by_byte: list[dict[int, list]] = []  # per NFA state: class -> [(target, store)]
    for s in range(n):
        d: dict[int, list] = {}
        for chars, t, st in nfa.edges[s]:
            for c in {int(byte_class[ch]) for ch in chars}:
                d.setdefault(c, []).append((t, st))
        by_byte.append(d)

    init = closure([start])
    index = {init: 0, frozenset(): 1}
    order = [init, frozenset()]
    rows_next, rows_code = [], []
    i = 0
    while i < len(order):
        cur = order[i]
        i += 1
        nxt = np.zeros(n_cls, np.int64)
        code = np.zeros(n_cls, np.int64)
        for c in range(n_cls):
            targets, st = set(), {}
            for s in cur:
                for t, store in by_byte[s].get(c, ()):
                    targets.add(t)
                    if store is not None:
                        r, v = store
                        if st.get(r, v) != v:
                            raise AssertionError(f"tool-call grammar: conflicting stores to register {r}")
                        st[r] = v
            key = closure(targets)
            if key not in index:
                index[key] = len(order)
                order.append(key)
                if len(order) > MAX_PRODUCT_STATES:
                    raise ValueError(
                        "tool schemas too large: the body automaton exceeds "
                        f"{MAX_PRODUCT_STATES} states (narrow the integer ranges)"
                    )
            nxt[c] = index[key]
            code[c] = stores.id(st.items()) if st else 0
        rows_next.append(nxt[byte_class])
        rows_code.append(code[byte_class])
    label = np.zeros(len(order), np.int64)
    for k, sub in enumerate(order):
        tools = {nfa.accept[s] for s in sub if s in nfa.accept}
        if len(tools) > 1:
            raise AssertionError("tool-call grammar: one body accepted as two tools")
        if tools:
            label[k] = tools.pop() + 1
    return np.stack(rows_next), np.stack(rows_code), label


# ----------------------------------------------------------------------------------------------------------------
# The whole grammar: product with the tag matchers, minimized
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Grammar:
    """The whole grammar as ONE minimized byte-level automaton with register stores on its edges.

    Attributes:
      next: ``int32 [S, X]`` next state per byte (X = 256), plus the ``BOUNDARY`` column between tokens (X = 257)
        when the schema has free text; state 0 is the start (before ``<tool_call>``).
      code: ``int64 [S, X]`` store code of the edge (0: none; see ``stores``).
      label: ``int64 [S]`` 0 pending (no call yet), 1 closed and rejected, ``2 + t`` closed and accepted as tool t;
        the closed states are absorbing and store nothing.
      raw_states: reachable states of the unminimized product (for the docs/tests).
      stores: the store-code registry (codes added later by lifting extend it).
    """

    next: np.ndarray
    code: np.ndarray
    label: np.ndarray
    raw_states: int
    stores: _Stores
    body_states: int

    @property
    def num_states(self) -> int:
        return int(self.next.shape[0])


def _row_ids(rows: np.ndarray) -> np.ndarray:
    """Id of each row of a 2-D array, equal rows equal ids (rows compared as raw bytes: much faster than
    ``np.unique(axis=0)``)."""
    rows = np.ascontiguousarray(rows)
    keys = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
    return np.unique(keys, return_inverse=True)[1].ravel().astype(np.int64)


def _minimize(nxt: np.ndarray, code: np.ndarray, label: np.ndarray):
    """Moore minimization: same label, same edge codes, equivalent successors. Returns (class of each state,
    representative of each class), classes numbered by first appearance (state 0 stays 0)."""
    cls = np.unique(label, return_inverse=True)[1].ravel()
    n = int(cls.max()) + 1
    while True:
        cls = _row_ids(np.concatenate([cls[:, None], cls[nxt], code], axis=1))
        if int(cls.max()) + 1 == n:
            break
        n = int(cls.max()) + 1
    first = np.full(n, -1, np.int64)
    for s in range(len(cls) - 1, -1, -1):
        first[cls[s]] = s
    rank = np.argsort(np.argsort(first))
    return rank[cls], np.sort(first)


def build_grammar(spec: Sequence[ToolSpec]) -> Grammar:
    """Product of the three byte automata (open-tag KMP, close-tag KMP + body DFA + saved label), minimized.

    Product state: phase 0 ``k_open``; phase 1 ``(k_close, body, saved)`` where ``saved`` is the body's accept
    label just before the latest ``<``; phase 2 the call's verdict (absorbing).
    """
    spec = tuple(spec)
    n_regs = sum(len(t.args) for t in spec)
    n_spans = sum(len(r) for r in _text_registers(spec))
    single = [a.max_value for t in spec for a in t.args][0] if n_regs == 1 and not n_spans else None
    stores = _Stores(n_regs + n_spans, single)
    n_sym = 257 if n_spans else 256  # free text adds the token-boundary column (identity for the tag matchers)
    nfa, start, _ = _build_body_nfa(spec)
    bnext, bcode, blabel = _determinize(nfa, start, stores, n_sym)
    close_bytes = np.frombuffer(CLOSE_TAG.encode(), np.uint8)
    if np.any(bcode[:, close_bytes] != 0):  # the closing tag's bytes must leave the registers as at its '<'
        raise AssertionError("tool-call grammar: a byte of the closing tag stores a register")
    open_kmp, close_kmp = tokens_lib.kmp_table(OPEN_TAG.encode()), tokens_lib.kmp_table(CLOSE_TAG.encode())
    n_open, n_close = len(OPEN_TAG), len(CLOSE_TAG)
    if n_sym > 256:
        open_kmp = np.concatenate([open_kmp, np.arange(open_kmp.shape[0])[:, None]], axis=1).astype(open_kmp.dtype)
        close_kmp = np.concatenate([close_kmp, np.arange(close_kmp.shape[0])[:, None]], axis=1).astype(close_kmp.dtype)
    nb, nl = bnext.shape[0], len(spec) + 1
    off1 = n_open  # phase-1 keys: off1 + (k_close * nb + body) * nl + saved
    off2 = off1 + n_close * nb * nl  # phase-2 keys: off2 + saved label
    lt = np.arange(n_sym) == ord("<")
    start_key = off1 + (0 * nb + 0) * nl + int(blabel[0])

    keys: dict[int, int] = {0: 0}
    order = [0]
    nexts, codes = [], []
    i = 0
    while i < len(order):
        key = order[i]
        i += 1
        code = np.zeros(n_sym, np.int64)
        if key < off1:
            k2 = open_kmp[key].astype(np.int64)
            nkey = np.where(k2 == n_open, start_key, k2)
        elif key < off2:
            kc, rest = divmod(key - off1, nb * nl)
            body, saved = divmod(rest, nl)
            kc2 = close_kmp[kc].astype(np.int64)
            saved2 = np.where(lt, blabel[body], saved)
            code = bcode[body]
            nkey = np.where(kc2 == n_close, off2 + saved2, off1 + (kc2 * nb + bnext[body]) * nl + saved2)
        else:
            nkey = np.full(n_sym, key, np.int64)
        uniq, inv = np.unique(nkey, return_inverse=True)
        for k in uniq.tolist():
            if k not in keys:
                keys[k] = len(order)
                order.append(k)
        if len(order) > MAX_PRODUCT_STATES:
            raise ValueError(
                f"tool schemas too large: the grammar automaton exceeds {MAX_PRODUCT_STATES} states "
                "(narrow the integer ranges)"
            )
        nexts.append(np.array([keys[k] for k in uniq.tolist()], np.int64)[inv.ravel()])
        codes.append(code)
    nxt, code = np.stack(nexts), np.stack(codes)
    raw = len(order)
    label = np.zeros(raw, np.int64)
    for key, s in keys.items():
        if key >= off2:
            label[s] = 1 + (key - off2)  # 1: rejected (saved label 0), 2 + t: accepted as tool t
    cls, rep = _minimize(nxt, code, label)
    return Grammar(
        next=cls[nxt[rep]].astype(np.int32),
        code=code[rep],
        label=label[rep],
        raw_states=raw,
        stores=stores,
        body_states=nb,
    )


# ----------------------------------------------------------------------------------------------------------------
# Token tables
# ----------------------------------------------------------------------------------------------------------------

_MAX_PAIR_ENTRIES = 1 << 21  # 4 MiB of int16: past that, cache misses cost more than the saved lookups
_MAX_RESULT_ENTRIES = 1 << 16  # the one-register result table is indexed by the whole packed carry


@flax.struct.dataclass
class ToolCallTables:
    """Token tables for ``parse`` (pytree of arrays; the schema and the packing are static).

    Attributes:
      token_class: ``int32 [V + 1]`` class of each token id; entry V is "no token" (the identity class).
      class_next: ``[S, C]`` int16 (int32 when ``S << reg_bits`` does not fit) packed ``state << reg_bits | code``.
      token_bytes: ``uint8 [V, max_bytes]`` bytes of each token id, right-padded with 0 (used only to cut a token
        in the middle when ``max_bytes`` truncates the text).
      token_len: ``int32 [V]`` byte count of each token id (0 for ids with no text).
      byte_next: ``int32 [S, 257]`` packed byte-level edges; column 256 is "no byte" (for the ``max_bytes`` cut).
      state_label: ``int32 [S]`` 0 pending, 1 rejected, ``2 + t`` accepted as tool t.
      tool_regs: ``int32 [N, A]`` register of each tool's argument (R = a register that is never written: padding).
      arg_lo, arg_hi: ``int32 [N, A]`` accepted range per argument (enums: every option index; padding: 0..0).
      class_pair_next: ``[S, C * C]`` two-token transitions (class pair ``c1 * C + c2``), halving the chain of
        dependent lookups; None when ``S * C * C`` exceeds ``_MAX_PAIR_ENTRIES``, and with free text (a pair of
        tokens could append two ids).
      store_val: ``int32 [codes, R + 1]`` value each store code writes to each register (-1: keeps it); None with
        at most one register (the carry's code IS the register).
      code_value: ``int32 [2 ** reg_bits]`` the one register's value per code (0 for code 0); None otherwise.
      code_appends: ``bool [2 ** reg_bits, P]`` (P = free-text span registers over all tools) whether a token with
        this code appends its id to each span; None without free text (then the fields below are None too).
      tool_text_regs: ``int32 [N, M]`` span register of each tool's free-text arguments in schema order (M =
        ``max_text_args``; P = padding, a span that is always empty).
      text_bound: ``int32 [N, M]`` each free-text argument's ``maxTokens`` (padding: 0).
      result: ``int32 [S << reg_bits]`` packed carry -> ``kind | (tool + 1) << 2 | arg << 16`` (one register, small
        tables); None otherwise.
      spec: the normalized schema; reg_bits, num_registers (value registers), raw_states: static packing facts;
        text_tokens: the span width L (``max_text_tokens``).
    """

    token_class: jax.Array
    class_next: jax.Array
    token_bytes: jax.Array
    token_len: jax.Array
    byte_next: jax.Array
    state_label: jax.Array
    tool_regs: jax.Array
    arg_lo: jax.Array
    arg_hi: jax.Array
    class_pair_next: jax.Array | None = None
    store_val: jax.Array | None = None
    code_value: jax.Array | None = None
    result: jax.Array | None = None
    code_appends: jax.Array | None = None
    tool_text_regs: jax.Array | None = None
    text_bound: jax.Array | None = None
    spec: tuple = flax.struct.field(pytree_node=False, default=())
    reg_bits: int = flax.struct.field(pytree_node=False, default=4)
    num_registers: int = flax.struct.field(pytree_node=False, default=1)
    raw_states: int = flax.struct.field(pytree_node=False, default=0)
    text_tokens: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def has_text(self) -> bool:
        return self.code_appends is not None

    @property
    def vocab_size(self) -> int:
        return int(self.token_len.shape[0])

    @property
    def max_bytes(self) -> int:
        return int(self.token_bytes.shape[1])

    @property
    def num_states(self) -> int:
        return int(self.class_next.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.class_next.shape[1])

    @property
    def num_tools(self) -> int:
        return len(self.spec)

    @property
    def max_args(self) -> int:
        return int(self.tool_regs.shape[1])


@functools.lru_cache(maxsize=16)
def _cached_grammar(spec: tuple[ToolSpec, ...]) -> Grammar:
    return build_grammar(spec)


def grammar(tools) -> Grammar:
    """The minimized byte automaton of a schema (cached per schema; its store registry is shared, so lifting to
    several tokenizers only ever adds codes)."""
    return _cached_grammar(_as_spec(tools))


def compile_tool_calls(
    tools, tokenizer=None, vocab_size: int | None = None, *, pieces: Sequence[bytes] | None = None
) -> ToolCallTables:
    """Tables of ``tools`` for ``tokenizer`` (or the token ``pieces``, bytes per id); ``vocab_size`` (e.g. the
    model's padded vocab) adds ids without text.

    Host cost: the schema's automaton (milliseconds for small ranges) and one vectorised pass over the
    vocabulary's bytes per automaton state (seconds at 157k tokens).
    """
    spec = _as_spec(tools)
    g = grammar(spec)
    if pieces is None:
        pieces = tokens_lib.token_bytes(tokenizer)
    tb, lens = tokens_lib.byte_matrix(list(pieces), vocab_size)
    stores = g.stores
    text_regs = _text_registers(spec)
    n_spans = sum(len(r) for r in text_regs)
    n_regs = stores.num_registers - n_spans  # value registers (span stores are numbered after them)
    merge = stores.merge if stores.num_registers > 1 else tokens_lib.last_store
    s_count = g.num_states
    st, cd = tokens_lib.lift_to_tokens(g.next[:, :256], g.code[:, :256], tb, lens, merge=merge)
    if n_spans:  # every token ends at a boundary (where a text token appends to its span)
        cd = merge(cd, g.code[st, BOUNDARY])
        st = g.next[st, BOUNDARY].astype(np.int64)
    state = np.concatenate([st, np.arange(s_count)[:, None]], axis=1)  # column V: no token
    code = np.concatenate([cd, np.zeros((s_count, 1), np.int64)], axis=1)
    token_class, cls_pack = tokens_lib.token_classes(state * (1 << 24) + code)
    cls_state, cls_code = cls_pack >> 24, cls_pack & ((1 << 24) - 1)
    c = cls_state.shape[1]
    pair = None
    if s_count * c * c <= _MAX_PAIR_ENTRIES and not n_spans:  # a pair could append two ids: one token a step
        first_state = cls_state  # [S, C]
        second_state = cls_state[first_state]  # [S, C, C]
        second_code = cls_code[first_state]
        pair_code = merge(np.broadcast_to(cls_code[:, :, None], second_code.shape).copy(), second_code)
        pair = (second_state.reshape(s_count, c * c), pair_code.reshape(s_count, c * c))
    n_codes = len(stores.sets)
    bits = max(1, (n_codes - 1).bit_length())
    dtype = np.int16 if ((s_count - 1) << bits | ((1 << bits) - 1)) <= np.iinfo(np.int16).max else np.int32

    def pack(s, k):
        return ((s.astype(np.int64) << bits) | k).astype(dtype)

    byte_next = np.zeros((s_count, 257), np.int64)
    byte_next[:, :256] = (g.next[:, :256].astype(np.int64) << bits) | g.code[:, :256]
    byte_next[:, 256] = np.arange(s_count) << bits

    tool_regs, lo, hi = _argument_tables(spec, n_regs)
    if n_regs > 1 or n_spans:
        store_val, code_appends, tool_text_regs, text_bound = _register_tables(spec, stores, n_regs, text_regs, bits)
        code_value = result = None
    else:
        code_value, result = _single_register_tables(g, stores, bits, tool_regs, lo, hi, max_args(spec))
        store_val = code_appends = tool_text_regs = text_bound = None
    return ToolCallTables(
        token_class=jnp.asarray(token_class),
        class_next=jnp.asarray(pack(cls_state, cls_code)),
        token_bytes=jnp.asarray(tb),
        token_len=jnp.asarray(lens),
        byte_next=jnp.asarray(byte_next.astype(np.int32)),
        state_label=jnp.asarray(g.label.astype(np.int32)),
        tool_regs=jnp.asarray(tool_regs),
        arg_lo=jnp.asarray(lo),
        arg_hi=jnp.asarray(hi),
        class_pair_next=None if pair is None else jnp.asarray(pack(*pair)),
        store_val=store_val,
        code_value=code_value,
        result=result,
        code_appends=code_appends,
        tool_text_regs=tool_text_regs,
        text_bound=text_bound,
        spec=spec,
        reg_bits=bits,
        num_registers=n_regs,
        raw_states=g.raw_states,
        text_tokens=max_text_tokens(spec),
    )


def _argument_tables(spec, n_regs: int):
    """Per tool and argument: its value register (``n_regs`` where the tool has fewer arguments) and its range."""
    a_max = max_args(spec)
    offsets = np.cumsum([0] + [len(t.args) for t in spec])
    tool_regs = np.full((len(spec), a_max), n_regs, np.int32)
    lo = np.zeros((len(spec), a_max), np.int32)
    hi = np.zeros((len(spec), a_max), np.int32)
    for t, tool in enumerate(spec):
        for i, a in enumerate(tool.args):
            tool_regs[t, i] = offsets[t] + i
            if a.kind != "text":  # a text argument's register is never written: 0..0
                lo[t, i], hi[t, i] = (a.lo, a.hi) if a.kind == "integer" else (0, len(a.options) - 1)
    return tool_regs, lo, hi


def _register_tables(spec, stores, n_regs: int, text_regs, bits: int):
    """Several registers or text spans: what each store code writes (``store_val``), which spans it appends to, and
    per tool its text arguments' span registers and token bounds (None without text arguments)."""
    n_spans = sum(len(r) for r in text_regs)
    sv = np.full((len(stores.sets), n_regs + 1), -1, np.int32)
    appends = np.zeros((1 << bits, n_spans), bool)
    for k, sets in enumerate(stores.sets):
        for r, val in sets:
            if r < n_regs:
                sv[k, r] = val
            else:
                appends[k, r - n_regs] = True
    if not n_spans:
        return jnp.asarray(sv), None, None, None
    m = max_text_args(spec)
    regs_np = np.full((len(spec), m), n_spans, np.int32)
    bound = np.zeros((len(spec), m), np.int32)
    for t, tool in enumerate(spec):
        texts = [a for a in tool.args if a.kind == "text"]
        regs_np[t, : len(texts)] = text_regs[t]
        bound[t, : len(texts)] = [a.max_tokens for a in texts]
    return (jnp.asarray(sv), *(jnp.asarray(x) for x in (appends, regs_np, bound)))


def _single_register_tables(g, stores, bits: int, tool_regs, lo, hi, a_max: int):
    """One register: the value each store code writes, and (when small enough) the verdict of every final carry."""
    s_count = g.num_states
    cv = np.zeros(1 << bits, np.int32)
    for k, sets in enumerate(stores.sets):
        if sets:
            cv[k] = sets[0][1]
    result = None
    if s_count << bits <= _MAX_RESULT_ENTRIES:
        carry = np.arange(s_count << bits)
        regs = np.stack([cv[carry & ((1 << bits) - 1)], np.zeros_like(carry)], axis=1)  # [.., R + 1]
        kind, tool, args = _decide(np, g.label[carry >> bits], regs, tool_regs, lo, hi)
        arg0 = args[:, 0] if a_max else 0
        result = jnp.asarray((kind | (tool + 1) << 2 | arg0 << 16).astype(np.int32))
    return jnp.asarray(cv), result


def _decide(xp, label, regs, tool_regs, lo, hi):
    """Verdict from the final state's label ``[...]`` and registers ``[..., R + 1]`` (numpy or jax)."""
    accepted = label >= 2
    t = xp.maximum(label - 2, 0)
    if tool_regs.shape[1]:
        vals = xp.take_along_axis(regs, tool_regs[t], axis=-1) if regs.ndim > 1 else regs[tool_regs[t]]
        in_range = xp.all((vals >= lo[t]) & (vals <= hi[t]), axis=-1)
    else:
        vals = xp.zeros(label.shape + (0,), np.int32)
        in_range = xp.ones(label.shape, bool)
    kind = xp.where(
        accepted, xp.where(in_range, KIND_OK, KIND_OUT_OF_RANGE), xp.where(label == 1, KIND_BAD_CALL, KIND_NO_CALL)
    )
    tool = xp.where(accepted, t, -1)
    args = xp.where((kind == KIND_OK)[..., None], vals, 0)
    return kind.astype(np.int32), tool.astype(np.int32), args.astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Jitted parser
# ----------------------------------------------------------------------------------------------------------------

_UNROLL_MAX = 32  # sequences up to this many symbols are unrolled in Python (no scan, no transposes)


def _run(
    table: jax.Array,
    symbols: jax.Array,
    bits: int,
    carry: Any = 0,
    regs: jax.Array | None = None,
    store_val: jax.Array | None = None,
    symbol_class: jax.Array | None = None,
    pair_table: jax.Array | None = None,
):
    """Feed ``symbols [N]`` (columns of the packed ``table [S, C]``, or ids mapped to columns by
    ``symbol_class``) to the automaton. Returns ``(carry, regs)``.

    ``carry`` packs ``state << bits | code`` like the table entries. With one register (``store_val`` None) the
    carry keeps the last non-zero code, so a step is one lookup and one select and the whole result lives in one
    int32; otherwise a non-zero code also overwrites ``regs [R + 1]`` from its ``store_val`` row.
    """
    flat = table.reshape(-1)
    width = table.shape[1]
    low = (1 << bits) - 1

    def lookup(index, tab=flat):  # unsigned, in-bounds index: no negative-index fix-up in every step
        return tab.at[index.astype(jnp.uint32)].get(mode="promise_in_bounds").astype(jnp.int32)

    def column(sym):  # the class lookup does not depend on the carry: it stays off the dependency chain
        if symbol_class is None:
            return sym
        return symbol_class.at[sym.astype(jnp.uint32)].get(mode="promise_in_bounds")

    def apply(carry, regs, code):
        if store_val is None:
            return jnp.where((code & low) == 0, code | (carry & low), code), regs
        row = store_val.at[(code & low).astype(jnp.uint32)].get(mode="promise_in_bounds")
        return code, jnp.where(row >= 0, row, regs)

    def step(c, sym):
        carry, regs = c
        return apply(carry, regs, lookup((carry >> bits) * width + column(sym)))

    n = symbols.shape[0]
    if n > _UNROLL_MAX:
        c = (jnp.asarray(carry, jnp.int32), regs)
        return jax.lax.scan(lambda c, x: (step(c, x), None), c, symbols, unroll=8)[0]
    fresh = isinstance(carry, int) and carry == 0  # from the start state: row 0, no register yet
    if pair_table is not None and n >= 2:
        pairs = pair_table.reshape(-1)
        pair_width = pair_table.shape[1]

        def pair_column(i):  # independent of the carry, like column()
            return column(symbols[i]) * width + column(symbols[i + 1])

        i = 0
        if fresh:
            carry, regs = apply(jnp.int32(0), regs, lookup(pair_column(0), pairs))
            i = 2
        while i + 1 < n:
            carry, regs = apply(carry, regs, lookup((carry >> bits) * pair_width + pair_column(i), pairs))
            i += 2
        if i < n:
            carry, regs = step((carry, regs), symbols[i])
        return jnp.asarray(carry, jnp.int32), regs
    if fresh and n:
        carry, regs = apply(jnp.int32(0), regs, lookup(column(symbols[0])))
        symbols = symbols[1:]
    for i in range(symbols.shape[0]):
        carry, regs = step((carry, regs), symbols[i])
    return jnp.asarray(carry, jnp.int32), regs


def _result(tables: ToolCallTables, carry: jax.Array, regs: jax.Array | None):
    if tables.result is not None:
        packed = tables.result[carry]
        args = (packed >> 16)[None] if tables.max_args else jnp.zeros((0,), jnp.int32)
        return packed & 3, ((packed >> 2) & 0x3FFF) - 1, args
    if regs is None:  # one register, large table: decode the code
        regs = jnp.stack([tables.code_value[carry & ((1 << tables.reg_bits) - 1)], jnp.int32(0)])
    label = tables.state_label[carry >> tables.reg_bits]
    return _decide(jnp, label, regs, tables.tool_regs, tables.arg_lo, tables.arg_hi)


def _run_text(tables: ToolCallTables, ids: jax.Array, regs: jax.Array):
    """Feed token ``ids [T]`` (V: no token) one token a step, appending each text token's id to the spans its
    code names. Returns ``(carry, regs, span_ids int32 [P + 1, L], span_len int32 [P + 1])``; row P is the
    padding span (never appended to); a span's length counts past L (the ids past L are dropped)."""
    flat = tables.class_next.reshape(-1)
    width = tables.class_next.shape[1]
    bits, low = tables.reg_bits, (1 << tables.reg_bits) - 1
    n_spans, span_w = tables.code_appends.shape[1], tables.text_tokens
    positions = jnp.arange(span_w, dtype=jnp.int32)

    def step(c, token):
        carry, regs, span_ids, span_len = c
        cls = tables.token_class.at[token.astype(jnp.uint32)].get(mode="promise_in_bounds")
        carry = flat.at[((carry >> bits) * width + cls).astype(jnp.uint32)].get(mode="promise_in_bounds")
        carry = carry.astype(jnp.int32)
        code = carry & low
        row = tables.store_val.at[code.astype(jnp.uint32)].get(mode="promise_in_bounds")
        regs = jnp.where(row >= 0, row, regs)
        append = jnp.concatenate([tables.code_appends[code], jnp.zeros((1,), bool)])  # [P + 1]
        write = append[:, None] & (positions[None, :] == span_len[:, None])
        return (carry, regs, jnp.where(write, token, span_ids), span_len + append.astype(jnp.int32)), None

    init = (jnp.int32(0), regs, jnp.zeros((n_spans + 1, span_w), jnp.int32), jnp.zeros((n_spans + 1,), jnp.int32))
    return jax.lax.scan(step, init, ids)[0]


def _text_result(tables: ToolCallTables, kind, tool, span_ids, span_len):
    """The called tool's spans ``(text_ids [M, L], text_len [M])`` (zero unless ok) and the verdict with an
    over-long text made a bad call (it is malformed, whatever the other arguments' ranges)."""
    t = jnp.maximum(tool, 0)
    regs = tables.tool_text_regs[t]  # [M]
    text_len = span_len[regs]
    too_long = jnp.any(text_len > tables.text_bound[t])
    kind = jnp.where(
        (kind == KIND_OK) | (kind == KIND_OUT_OF_RANGE), jnp.where(too_long, KIND_BAD_CALL, kind), kind
    ).astype(jnp.int32)
    ok = kind == KIND_OK
    text_len = jnp.where(ok, text_len, 0)
    keep = jnp.arange(tables.text_tokens)[None, :] < text_len[:, None]
    return kind, jnp.where(keep, span_ids[regs], 0), text_len


def parse(tables: ToolCallTables, token_ids: jax.Array, length: Any = None, *, max_bytes: int | None = None):
    """Parse the first tool call in a generated token sequence (jit/vmap friendly; agrees with
    ``parse_text(tables, decode(token_ids[:length]))`` for schemas without free text).

    Args:
      tables: ``ToolCallTables`` of the schema and of the tokenizer that produced the ids.
      token_ids: ``int [T]`` generated tokens (ids outside ``[0, V)`` are clipped).
      length: ``int []`` number of valid tokens (default T); the rest is ignored.
      max_bytes: static cap on the number of text bytes parsed (default: no cap). Text past the cap is treated
        as not generated; a token straddling the cap is cut in the middle (this costs one extra byte-level loop
        over that token, ``tables.max_bytes`` steps, so only pass a cap that can bind).

    Returns:
      ``(kind int32 [], tool int32 [], args int32 [A])``; see ``parse_full`` for free-text arguments.
    """
    return parse_full(tables, token_ids, length, max_bytes=max_bytes)[:3]


def parse_full(tables: ToolCallTables, token_ids: jax.Array, length: Any = None, *, max_bytes: int | None = None):
    """``parse`` with the free-text arguments: ``(kind, tool, args, text_ids, text_len)`` where ``text_ids``
    ``int32 [M, L]`` holds the called tool's free-text arguments in schema order (M = ``max_text_args``, L =
    ``max_text_tokens``; the ids strictly between the quotes, zero padded) and ``text_len`` ``int32 [M]`` their
    token counts; both zero unless kind is ok. Without free text in the schema both are ``None``.

    A free-text argument's quotes must sit at token boundaries (the opening quote ends a token, the closing
    quote starts one; a token that mixes text and a quote is a bad call), and a text of more than ``maxTokens``
    tokens is a bad call. ``parse_text`` cannot see tokens: on the decoded text it checks only the JSON.
    """
    token_ids = jnp.asarray(token_ids)
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be [T] (vmap for batches), got shape {token_ids.shape}")
    t = token_ids.shape[0]
    v = tables.vocab_size
    if tables.token_class.shape[0] != v + 1:
        raise ValueError(
            f"ToolCallTables.token_class has {tables.token_class.shape[0]} entries, expected vocab + 1 = {v + 1}; "
            "build the tables with compile_tool_calls"
        )
    length = jnp.asarray(t if length is None else length, jnp.int32)
    ids = jnp.clip(token_ids.astype(jnp.int32), 0, v - 1)
    valid = jnp.arange(t) < length
    cap = None if max_bytes is None or int(max_bytes) >= t * tables.max_bytes else max(0, int(max_bytes))
    if cap is not None:
        lens = jnp.where(valid, tables.token_len[ids], 0)
        ends = jnp.cumsum(lens)
        starts = ends - lens
        cut = valid & (starts < cap) & (ends > cap)  # the (at most one) token straddling the cap
        cut_id = jnp.sum(jnp.where(cut, ids, 0))
        cut_bytes = jnp.sum(jnp.where(cut, cap - starts, 0))
        valid = valid & (ends <= cap)
    regs = None if tables.store_val is None else jnp.zeros((tables.num_registers + 1,), jnp.int32)
    if tables.has_text:
        carry, regs, span_ids, span_len = _run_text(tables, jnp.where(valid, ids, v), regs)
    else:
        carry, regs = _run(
            tables.class_next,
            jnp.where(valid, ids, v),
            tables.reg_bits,
            regs=regs,
            store_val=tables.store_val,
            symbol_class=tables.token_class,
            pair_table=tables.class_pair_next,
        )
    if cap is not None:  # the first cut_bytes bytes of the straddling token, one byte at a time
        col = jnp.arange(tables.max_bytes)
        symbols = jnp.where(col < cut_bytes, tables.token_bytes[cut_id].astype(jnp.int32), 256)
        carry, regs = _run(tables.byte_next, symbols, tables.reg_bits, carry, regs, store_val=tables.store_val)
    kind, tool, args = _result(tables, carry, regs)
    if not tables.has_text:
        return kind, tool, args, None, None
    kind, text_ids, text_len = _text_result(tables, kind, tool, span_ids, span_len)
    named = (kind == KIND_OK) | (kind == KIND_OUT_OF_RANGE)
    return kind, jnp.where(named, tool, -1), jnp.where(kind == KIND_OK, args, 0), text_ids, text_len


def parse_batch(tables: ToolCallTables, token_ids: jax.Array, lengths: jax.Array, *, max_bytes=None):
    """``vmap`` of ``parse`` over ``token_ids [B, T]`` and ``lengths [B]`` -> ``(kind [B], tool [B], args [B, A])``."""
    fn = functools.partial(parse, max_bytes=max_bytes)
    return jax.vmap(fn, in_axes=(None, 0, 0))(tables, token_ids, lengths)


def parse_full_batch(tables: ToolCallTables, token_ids: jax.Array, lengths: jax.Array, *, max_bytes=None):
    """``vmap`` of ``parse_full``: ``(kind [B], tool [B], args [B, A], text_ids [B, M, L] | None,
    text_len [B, M] | None)``."""
    fn = functools.partial(parse_full, max_bytes=max_bytes)
    return jax.vmap(fn, in_axes=(None, 0, 0))(tables, token_ids, lengths)
