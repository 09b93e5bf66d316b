"""Chat-template compiler: an environment's messages (templates with integer slots) and tool schemas -> token
stencils rendered inside jit with the tokenizer's own chat template.

CONTRACT (public API; the compiler below implements it):

    Slot(value=i, options=("a", "bb", ...))     text ``options[values[i]]`` (values clipped into range)
    SpanSlot(span=j, max_tokens=L)              tool templates only: the token ids ``message.span_ids[j, :span_len[j]]``
                                                as they are (an echoed free-text argument, ``number_span`` digits)
    Parts = tuple of str | Slot | SpanSlot      one message's content
    ChatSpec(system, tools, user, tool, tool_continues, num_values)
    compile_chat(tokenizer, spec, chat_template=None, max_stencil_rows=4096) -> ChatTables      (host, once)
    render_user(tables, message) -> (ids int32 [tables.prompt_len], n int32 [])   system + user + assistant header
    render_tool(tables, message, add_turn_end) -> (ids int32 [tables.response_len], n int32 [])
        rest of the assistant turn after its turn-end marker (the marker itself when ``add_turn_end``), the tool
        turn, and the next assistant header when ``spec.tool_continues[template]``
    resolve(parts, values) -> str; user_messages(spec, message) / tool_message(spec, message) -> chat dicts   (host)
    prompt_ids(tokenizer, spec, messages, ...) -> list[int]                                                   (host)
    chat_text(tokenizer, spec, messages, ...) -> str; tool_text(tokenizer, spec, message, add_turn_end) -> str (host)

How: `compile_chat` renders the tokenizer's OWN chat template once per template with placeholder strings in the
slots, splits the result into literal pieces and slots, and tokenizes every literal piece and every slot option
on its own. Rendering in jit then concatenates pre-tokenized pieces (no scan, no host call), so the decoded ids
are exactly the template's text. The concatenation is precomputed on the host into `Stencils` (whole
pre-rendered rows plus small per-slot delta rows), so rendering is a handful of contiguous row reads and adds;
the general per-token concatenation remains as a fallback and reference (same ids). Token ids may differ from
tokenizing the whole text at once with a general tokenizer; with the shipped tokenizer they are identical,
because its pre-tokenizer splits at the slot boundaries the shipped environments use (digits, lone letters,
newlines).

A `SpanSlot` is compiled as an empty piece; `render_tool` renders the rest as usual and then splices each span's
ids in at its segment's offset (one ``[J, Lout]`` comparison, no scan). The host twins take the spans as text.

Every slot reading value ``i`` offers the same options count, so a value is clipped once per render (one
unsigned ``min``: negative values become the last option). Tool turns are compiled after the conversation
``system, user template 0 (all values 0), assistant`` and keep only what follows the assistant's content: the
template must not let that depend on the earlier turns.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------------------------------------------
# Spec: parts, slots, templates
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    """A variable piece of a message: ``options[values[value]]``."""

    value: int
    options: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "options", tuple(self.options))
        if not isinstance(self.value, (int, np.integer)) or isinstance(self.value, bool) or self.value < 0:
            raise ValueError(f"Slot.value must be a value index >= 0, got {self.value!r}")
        if not self.options:
            raise ValueError(f"Slot reading value {self.value} has no options")
        if not all(isinstance(o, str) for o in self.options):
            raise ValueError(f"Slot options must be strings, got {self.options!r}")


@dataclasses.dataclass(frozen=True)
class SpanSlot:
    """A token span of a tool message: ``message.span_ids[span, :span_len[span]]`` (at most ``max_tokens`` ids;
    longer spans are cut). Only tool templates may hold one; each span index at most once per template."""

    span: int
    max_tokens: int

    def __post_init__(self):
        for name in ("span", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < (name == "max_tokens"):
                raise ValueError(f"SpanSlot.{name} must be an int >= {int(name == 'max_tokens')}, got {v!r}")


Parts = tuple  # tuple[str | Slot | SpanSlot, ...]


@dataclasses.dataclass(frozen=True)
class ChatSpec:
    """What an environment says: the system prompt, its tool schemas (HF ``tools=`` dicts) and its templates.

    ``user[k]`` / ``tool[k]`` are the contents of user / tool messages; ``tool_continues[k]`` says the episode goes
    on after tool template ``k`` (its render ends with the next assistant header). ``num_values`` is the length of
    a message's value vector; every slot reading value ``i`` must offer the same number of options (one clip per
    value). ``tool_name`` is the ``name`` field of tool messages (default: the first tool's function name).
    """

    system: str
    tools: tuple
    user: tuple
    tool: tuple
    tool_continues: tuple
    num_values: int
    tool_name: str | None = None

    def __post_init__(self):
        for name in ("tools", "user", "tool", "tool_continues"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "user", tuple(tuple(p) for p in self.user))
        object.__setattr__(self, "tool", tuple(tuple(p) for p in self.tool))
        object.__setattr__(self, "tool_continues", tuple(bool(c) for c in self.tool_continues))
        if not isinstance(self.system, str):
            raise ValueError("ChatSpec.system must be a string")
        if not isinstance(self.num_values, int) or self.num_values < 0:
            raise ValueError(f"ChatSpec.num_values must be an int >= 0, got {self.num_values!r}")
        if not self.user:
            raise ValueError("ChatSpec needs at least one user template")
        if not self.tool:
            raise ValueError("ChatSpec needs at least one tool template")
        if len(self.tool) != len(self.tool_continues):
            raise ValueError(
                f"ChatSpec has {len(self.tool)} tool templates but {len(self.tool_continues)} "
                "tool_continues flags (one per tool template)"
            )
        for t in self.tools:
            if not (isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")):
                raise ValueError(f"tool schema without function.name: {t!r}")
        if self.tool_name is None:
            if not self.tools:
                raise ValueError("ChatSpec without tools needs an explicit tool_name")
            object.__setattr__(self, "tool_name", self.tools[0]["function"]["name"])
        options: dict[int, int] = {}
        spans: dict[int, int] = {}
        for role, templates in (("user", self.user), ("tool", self.tool)):
            for k, parts in enumerate(templates):
                for p in parts:
                    if isinstance(p, str):
                        if _PLACEHOLDER_RE.search(p) or _ASSISTANT_MARK in p:
                            raise ValueError(f"{role} template {k} contains the reserved marker text {p!r}")
                        continue
                    if isinstance(p, SpanSlot):
                        if role != "tool":
                            raise ValueError(f"user template {k}: SpanSlot is for tool templates only")
                        if spans.setdefault(p.span, p.max_tokens) != p.max_tokens:
                            raise ValueError(f"span {p.span} has different max_tokens in different templates")
                        if sum(isinstance(q, SpanSlot) and q.span == p.span for q in parts) > 1:
                            raise ValueError(f"tool template {k} reads span {p.span} twice")
                        continue
                    if not isinstance(p, Slot):
                        raise ValueError(
                            f"{role} template {k}: parts must be str or Slot (or SpanSlot in tool templates), got {p!r}"
                        )
                    if p.value >= self.num_values:
                        raise ValueError(
                            f"{role} template {k}: slot value index {p.value} out of range "
                            f"(num_values={self.num_values})"
                        )
                    if options.setdefault(p.value, len(p.options)) != len(p.options):
                        raise ValueError(
                            f"slots reading value {p.value} offer different numbers of options "
                            f"({options[p.value]} and {len(p.options)})"
                        )

    def span_tokens(self) -> tuple[int, ...]:
        """``max_tokens`` per span index (0 where no template reads it): the ``span_ids`` width per row."""
        n: dict[int, int] = {}
        for parts in self.tool:
            for p in parts:
                if isinstance(p, SpanSlot):
                    n[p.span] = p.max_tokens
        return tuple(n.get(j, 0) for j in range(max(n, default=-1) + 1))

    def value_options(self) -> tuple[int, ...]:
        """Options per value (1 where no slot reads it)."""
        n = [1] * self.num_values
        for parts in self.user + self.tool:
            for p in parts:
                if isinstance(p, Slot):
                    n[p.value] = len(p.options)
        return tuple(n)


def resolve(parts: Parts, values: Sequence[int], spans: Sequence[str] = ()) -> str:
    """Host: the text of ``parts`` with every slot at its value (out-of-range values are an error here) and every
    span slot at ``spans[span]`` (text; "" past the given spans)."""
    out = []
    for p in parts:
        if isinstance(p, SpanSlot):
            out.append(spans[p.span] if p.span < len(spans) else "")
        elif isinstance(p, Slot):
            v = int(values[p.value])
            if not 0 <= v < len(p.options):
                raise ValueError(f"slot value {v} out of range for options {p.options}")
            out.append(p.options[v])
        else:
            out.append(p)
    return "".join(out)


def _unpack(message) -> tuple[Any, Any]:
    if hasattr(message, "template") and hasattr(message, "values"):
        return message.template, message.values
    template, values = message
    return template, values


def _host_message(templates, message, role: str, spans: Sequence[str] = ()) -> str:
    template, values = _unpack(message)
    template = int(np.asarray(template))
    if not 0 <= template < len(templates):
        raise ValueError(f"{role} template {template} out of range (0..{len(templates) - 1})")
    return resolve(templates[template], [int(v) for v in np.asarray(values).reshape(-1)], spans)


def span_texts(tokenizer, message) -> list[str]:
    """Host: the decoded text of each span of ``message`` (none when it has no ``span_ids``)."""
    ids = getattr(message, "span_ids", None)
    if ids is None:
        return []
    ids, lens = np.asarray(ids), np.asarray(message.span_len)
    return [
        tokenizer.decode(
            ids[j, : max(0, int(lens[j]))].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        for j in range(ids.shape[0])
    ]


def user_messages(spec: ChatSpec, message) -> list[dict]:
    """Host: the system and user chat messages of ``message`` (a ``Message`` or ``(template, values)``)."""
    return [
        {"role": "system", "content": spec.system},
        {"role": "user", "content": _host_message(spec.user, message, "user")},
    ]


def tool_message(spec: ChatSpec, message, spans: Sequence[str] = ()) -> dict:
    """Host: the tool chat message of ``message`` (a ``Message`` or ``(template, values)``), span slots filled
    with ``spans`` (text)."""
    return {"role": "tool", "name": spec.tool_name, "content": _host_message(spec.tool, message, "tool", spans)}


def _apply(tokenizer, spec, messages, add_generation_prompt, chat_template=None, tokenize=False):
    kw = dict(tokenize=True, return_dict=False) if tokenize else dict(tokenize=False)
    if chat_template is not None:
        kw["chat_template"] = chat_template
    return tokenizer.apply_chat_template(
        messages, tools=list(spec.tools) or None, add_generation_prompt=add_generation_prompt, **kw
    )


def chat_text(
    tokenizer,
    spec: ChatSpec,
    messages: list[dict],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> str:
    """Host: the chat template's text for ``messages`` with the spec's tools."""
    return _apply(tokenizer, spec, messages, add_generation_prompt, chat_template)


def prompt_ids(
    tokenizer,
    spec: ChatSpec,
    messages: list[dict],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> list[int]:
    """Host: ``apply_chat_template(..., tools=spec.tools, tokenize=True)`` as a list of ints."""
    out = _apply(tokenizer, spec, messages, add_generation_prompt, chat_template, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def _context(spec: ChatSpec) -> list[dict]:
    """The conversation a tool turn is rendered after (user template 0, every value 0): what follows an assistant
    message's content must not depend on it, and the compiler and the host reference must use the same one."""
    return [*user_messages(spec, (0, [0] * spec.num_values)), {"role": "assistant", "content": _ASSISTANT_MARK}]


def _after_assistant(text: str) -> str:
    if text.count(_ASSISTANT_MARK) != 1:
        raise ValueError("the chat template must render assistant content verbatim exactly once")
    return text.split(_ASSISTANT_MARK, 1)[1]


def tool_text(
    tokenizer,
    spec: ChatSpec,
    message,
    add_turn_end: bool = False,
    chat_template: str | None = None,
    spans: Sequence[str] | None = None,
) -> str:
    """Host reference of `render_tool`: the template text after an assistant message's content, without the
    turn-end marker unless ``add_turn_end``; span slots hold ``spans`` (default: the message's decoded spans)."""
    template, _ = _unpack(message)
    cont = spec.tool_continues[int(np.asarray(template))]
    if spans is None:
        spans = span_texts(tokenizer, message)
    text = _apply(tokenizer, spec, [*_context(spec), tool_message(spec, message, spans)], cont, chat_template)
    after = _after_assistant(text)
    turn_end, _ = _find_turn_end(tokenizer, after)
    return after if add_turn_end else after[len(turn_end) :]


# ----------------------------------------------------------------------------------------------------------------
# Stencils: the fast path
# ----------------------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class Stencils:
    """Pre-rendered output rows of a set of programs: in-jit rendering is a few row lookups and adds.

    Slots fall in two kinds. *Key* slots have options of different token lengths (the turn-end marker: none or
    one token; an optional sentence): they move everything after them, so each combination of their values (per
    program) gets its own pre-rendered row ``base[key]``, with every other slot at option 0. *Delta* slots have
    options of one token length (a digit or a letter): they only change token values in place. Delta sources are
    grouped into *chunks* of a few (product of option counts at most ``_CHUNK_COMBOS``);
    ``chunk_tables[c][placement * combos + code]`` is a whole ``[Lout]`` row holding, at the positions where the
    chunk's slots sit in rows of that *placement* class, the token differences from option 0 for the chunk's
    values (``code``, mixed radix), and 0 elsewhere. So::

        ids = base[key] + sum_c chunk_tables[c][placement[key] * combos_c + code_c]

    Every term is a contiguous row read (no per-token index), which is what makes this fast on CPU; the tables
    are small (rows x Lout ints).

    Attributes:
      key_table: ``int32 [NP * prod(key option counts)]`` key of each (program, key-source values), mixed radix.
      base: ``int32 [NK, Lout]`` pre-rendered rows (``pad_id`` past ``total``).
      total: ``int32 [NK]`` tokens of each row.
      placement: ``int32 [NK]`` placement class of each row (rows that hold the delta slots at the same positions
        with the same token differences share one).
      chunk_tables: tuple of ``int32 [NPL * combos_c, Lout]``.
      key_sources: static ``((source, options), ...)`` in mixed-radix order (after the program index).
      chunk_sources: static, per chunk ``((source, options), ...)``.
    """

    key_table: jax.Array
    base: jax.Array
    total: jax.Array
    placement: jax.Array
    chunk_tables: tuple
    key_sources: tuple = flax.struct.field(pytree_node=False, default=())
    chunk_sources: tuple = flax.struct.field(pytree_node=False, default=())


_CHUNK_COMBOS = 27
_MAX_KEY_TABLE = 1 << 16


def _compile_stencils(programs, pieces: Sequence[Sequence[int]], out_len: int, pad_id: int, max_rows: int):
    """Stencil tables of ``programs`` (``(base, src, max_tokens, options)`` lists), or None when they would
    exceed ``max_rows`` rows (then the general concatenation is used)."""
    plen = [len(p) for p in pieces]
    n_opts: dict[int, int] = {}  # options per source (the same in every program)
    plans = []
    for base, src, _, options in programs:
        keys = []
        for k, (b, s, n) in enumerate(zip(base, src, options)):
            if n > 1:
                if n_opts.setdefault(s, n) != n:
                    return None
                if len({plen[b + v] for v in range(n)}) > 1:
                    keys.append(k)
        plans.append((keys, int(np.prod([options[k] for k in keys], dtype=np.int64))))
    n_rows = sum(c for _, c in plans)
    key_srcs = sorted({programs[p][1][k] for p, (keys, _) in enumerate(plans) for k in keys})
    key_size = len(programs) * int(np.prod([n_opts[s] for s in key_srcs], dtype=np.int64))
    if n_rows > max_rows or key_size > _MAX_KEY_TABLE:
        return None

    base_rows = np.full((max(n_rows, 1), out_len), pad_id, np.int32)
    total = np.zeros(max(n_rows, 1), np.int32)
    key_table = np.zeros(key_size, np.int32)
    placements: dict[tuple, int] = {}
    placement = np.zeros(max(n_rows, 1), np.int32)
    row = 0
    for p, ((base, src, _, options), (keys, count)) in enumerate(zip(programs, plans)):
        strides = np.cumprod([1] + [options[k] for k in keys])[:-1].astype(np.int64)
        combo_row = {}
        for combo in range(count):
            choice = {k: int(combo // st % options[k]) for k, st in zip(keys, strides)}
            toks, deltas = [], []
            for k, (b, s, n) in enumerate(zip(base, src, options)):
                if k in choice:
                    toks += pieces[b + choice[k]]
                    continue
                if n > 1:  # delta slot: option 0 in the row, differences to the other options in the chunk tables
                    for c in range(plen[b]):
                        diffs = tuple(int(pieces[b + v][c]) - int(pieces[b][c]) for v in range(n))
                        deltas.append((len(toks) + c, s, diffs))
                toks += pieces[b]
            if len(toks) > out_len:
                raise AssertionError(f"stencil row longer than the program's maximum ({len(toks)} > {out_len})")
            base_rows[row, : len(toks)] = toks
            total[row] = len(toks)
            placement[row] = placements.setdefault(tuple(deltas), len(placements))
            combo_row[tuple(choice.get(k, 0) for k in keys)] = row
            row += 1
        # Dense key table: every combination of ALL key sources maps to this program's row (ignoring the sources
        # the program has no key slot for).
        for values in np.ndindex(*[n_opts[s] for s in key_srcs]):
            idx = p
            for s, v in zip(key_srcs, values):
                idx = idx * n_opts[s] + v
            key_table[idx] = combo_row[tuple(values[key_srcs.index(programs[p][1][k])] for k in keys)]

    # Chunks of delta sources, in order of first appearance.
    delta_srcs: list[int] = []
    for deltas in placements:
        for _, s, _ in deltas:
            if s not in delta_srcs:
                delta_srcs.append(s)
    chunks: list[list[int]] = []
    for s in delta_srcs:
        if chunks and np.prod([n_opts[x] for x in chunks[-1]]) * n_opts[s] <= _CHUNK_COMBOS:
            chunks[-1].append(s)
        else:
            chunks.append([s])
    tables = []
    for chunk in chunks:
        radix = [n_opts[s] for s in chunk]
        combos = int(np.prod(radix))
        table = np.zeros((len(placements), combos, out_len), np.int32)
        for deltas, pl in placements.items():
            for code, values in enumerate(np.ndindex(*radix)):
                # np.ndindex runs the LAST source fastest: code = mixed radix with the first source most significant
                value_of = dict(zip(chunk, values))
                for pos, s, diffs in deltas:
                    if s in value_of:
                        table[pl, code, pos] += diffs[value_of[s]]
        tables.append(jnp.asarray(table.reshape(len(placements) * combos, out_len)))
    return Stencils(
        key_table=jnp.asarray(key_table),
        base=jnp.asarray(base_rows),
        total=jnp.asarray(total),
        placement=jnp.asarray(placement),
        chunk_tables=tuple(tables),
        key_sources=tuple((int(s), int(n_opts[s])) for s in key_srcs),
        chunk_sources=tuple(tuple((int(s), int(n_opts[s])) for s in chunk) for chunk in chunks),
    )


def _render_stencil(stencils: Stencils, program: jax.Array, values: Sequence[jax.Array]):
    """Fast path: program index ``[]`` and the source values (``values[j]``: int32 ``[]``, already in range) ->
    ``(ids [Lout], length [])``."""
    idx = program
    for s, n in stencils.key_sources:
        idx = idx * n + values[s]
    key = stencils.key_table[idx]
    out = stencils.base[key]
    place = stencils.placement[key]
    for table, sources in zip(stencils.chunk_tables, stencils.chunk_sources):
        code = place
        for s, n in sources:
            code = code * n + values[s]
        out = out + table[code]
    return out, stencils.total[key]


_PLACEHOLDER = "@@RENO{}@@"
_PLACEHOLDER_RE = re.compile(r"@@RENO(\d+)@@")
_ASSISTANT_MARK = "@@RENOASSISTANT@@"


def _with_placeholders(parts: Parts, slots: list) -> str:
    """Content string with ``@@RENO<k>@@`` for each slot (appended to ``slots``)."""
    out = []
    for p in parts:
        if isinstance(p, (Slot, SpanSlot)):
            out.append(_PLACEHOLDER.format(len(slots)))
            slots.append(p)
        else:
            out.append(p)
    return "".join(out)


def _split_rendered(text: str, slots: list) -> Parts:
    """Template output with placeholders -> literal/slot parts (checks every slot appears exactly once)."""
    parts: Parts = []
    seen = []
    pos = 0
    for m in _PLACEHOLDER_RE.finditer(text):
        if m.start() > pos:
            parts.append(text[pos : m.start()])
        k = int(m.group(1))
        seen.append(k)
        parts.append(slots[k])
        pos = m.end()
    if pos < len(text):
        parts.append(text[pos:])
    if sorted(seen) != list(range(len(slots))):
        raise ValueError(
            "the chat template dropped, duplicated or reordered message content; cannot split it into pieces "
            f"(slots seen {seen}, expected {list(range(len(slots)))})"
        )
    return parts


class _PieceTable:
    """Tokenizes each distinct piece once; literal pieces are shared, each slot gets a contiguous block of rows."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}
        self.literal_row: dict[str, int] = {"": 0}
        self.ids: list[list[int]] = [[]]  # row 0: the empty piece (padding segments, span slots)
        self.spans: list[tuple[int, int]] = []  # (segment, span) of the last program's span slots

    def encode(self, text: str) -> list[int]:
        if text not in self.cache:
            ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)] if text else []
            back = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if back != text:
                raise ValueError(
                    f"tokenizer does not round-trip the chat piece {text!r} (decodes to {back!r}); in-jit "
                    "rendering needs a tokenizer whose encode/decode is lossless on isolated pieces"
                )
            self.cache[text] = ids
        return self.cache[text]

    def literal(self, text: str) -> int:
        if text not in self.literal_row:
            self.literal_row[text] = len(self.ids)
            self.ids.append(self.encode(text))
        return self.literal_row[text]

    def block(self, options: Sequence[str]) -> int:
        first = len(self.ids)
        self.ids.extend(self.encode(o) for o in options)
        return first

    def program(self, parts: Parts) -> tuple[list[int], list[int], int, list[int]]:
        """Parts -> (base [K], src [K], max tokens, options [K]); adjacent literals are merged first."""
        merged: Parts = []
        for p in parts:
            if isinstance(p, str) and merged and isinstance(merged[-1], str):
                merged[-1] += p
            elif p != "":
                merged.append(p)
        base, src, max_tokens, options = [], [], 0, []
        self.spans = []
        for p in merged:
            if isinstance(p, SpanSlot):  # an empty piece here; render_tool splices the span in at its offset
                self.spans.append((len(base), p.span))
                base.append(0)
                src.append(0)
                max_tokens += p.max_tokens
                options.append(1)
            elif isinstance(p, Slot):
                base.append(self.block(p.options))
                src.append(p.value)
                max_tokens += max(len(self.encode(o)) for o in p.options)
                options.append(len(p.options))
            else:
                base.append(self.literal(p))
                src.append(0)
                max_tokens += len(self.encode(p))
                options.append(1)
        return base, src, max_tokens, options


def _find_turn_end(tokenizer, after_assistant: str) -> tuple[str, int]:
    """The special token that closes an assistant turn: the added token the post-assistant text starts with."""
    best = None
    for tok_id, added in tokenizer.added_tokens_decoder.items():
        content = str(added.content) if hasattr(added, "content") else str(added)
        if content and after_assistant.startswith(content) and (best is None or len(content) > len(best[0])):
            best = (content, int(tok_id))
    if best is None:
        raise ValueError(
            "cannot find the assistant turn-end token: the chat template's text after an assistant message "
            f"({after_assistant[:40]!r}...) does not start with any added/special token"
        )
    return best


def _stencil_np(stencils: Stencils, program: int, source: Sequence[int]):
    """NumPy twin of ``_render_stencil`` (host self-check)."""
    idx = program
    for s, n in stencils.key_sources:
        idx = idx * n + int(source[s])
    key = int(np.asarray(stencils.key_table)[idx])
    out = np.asarray(stencils.base)[key].copy()
    place = int(np.asarray(stencils.placement)[key])
    for table, sources in zip(stencils.chunk_tables, stencils.chunk_sources):
        code = place
        for s, n in sources:
            code = code * n + int(source[s])
        out += np.asarray(table)[code]
    return out, int(np.asarray(stencils.total)[key])


def _render_np(spec: "ChatTables", base, src, source, out_len):
    """NumPy twin of ``_render`` (host self-check)."""
    idx = np.asarray(base) + np.asarray(source)[np.asarray(src)]
    piece_ids, piece_len = np.asarray(spec.piece_ids), np.asarray(spec.piece_len)
    ids = np.concatenate([piece_ids[i, : piece_len[i]] for i in idx])
    out = np.full((out_len,), spec.pad_id, np.int32)
    out[: len(ids)] = ids
    return out, len(ids)


def _render(spec: "ChatTables", base: jax.Array, src: jax.Array, source: jax.Array, out_len: int):
    """General path: concatenate the pieces of one program. base/src ``[K]``, source ``[_NUM_SOURCES]`` ->
    ``([out_len], [])``. Used when a spec has no stencils (``compile_chat(..., max_stencil_rows=0)``)."""
    idx = base + source[src]  # [K] piece per segment
    lens = spec.piece_len[idx]  # [K]
    ends = jnp.cumsum(lens)
    starts = ends - lens
    t = jnp.arange(out_len, dtype=jnp.int32)
    # First segment whose end is past t (empty segments are skipped because their end equals their start).
    seg = jnp.minimum(jnp.sum(ends[None, :] <= t[:, None], axis=1), idx.shape[0] - 1)
    col = jnp.clip(t - starts[seg], 0, spec.piece_ids.shape[1] - 1)
    ids = spec.piece_ids[idx[seg], col]
    total = ends[-1].astype(jnp.int32)
    return jnp.where(t < total, ids, spec.pad_id).astype(jnp.int32), total


def _splice(xp, ids, n, seg_len, segments, span_ids, span_len, widths, pad_id: int):
    """Insert token spans into a render made with them empty (numpy or jax; jit/vmap friendly).

    ids ``[Lout]`` / n ``[]``: the render without the spans; seg_len ``[K]``: its segments' token counts;
    segments ``[J]``: the segment of each span slot (-1: the template has none); span_ids ``[J, W]`` /
    span_len ``[J]``: the spans, each cut to ``widths[j]`` (its slot's ``max_tokens``). Returns
    ``(ids [Lout], length [])``.
    """
    out_len = ids.shape[0]
    present = segments >= 0
    lens = xp.where(present, xp.clip(span_len, 0, xp.minimum(widths, span_ids.shape[1])), 0)
    seg_start = xp.cumsum(seg_len) - seg_len
    off = seg_start[xp.maximum(segments, 0)]
    before = present[None, :] & (segments[None, :] < segments[:, None])  # [J, J]: span i sits before span j
    start = off + xp.sum(xp.where(before, lens[None, :], 0), axis=1)  # [J] in the output
    t = xp.arange(out_len)
    inside = present[:, None] & (t[None, :] >= start[:, None]) & (t[None, :] < (start + lens)[:, None])
    col = xp.clip(t[None, :] - start[:, None], 0, span_ids.shape[1] - 1)
    span_val = xp.sum(xp.where(inside, xp.take_along_axis(span_ids, col, axis=1), 0), axis=0)
    shift = xp.sum(xp.where(t[None, :] >= (start + lens)[:, None], lens[:, None], 0), axis=0)
    base = ids[xp.clip(t - shift, 0, out_len - 1)]
    total = n + xp.sum(lens)
    out = xp.where(xp.any(inside, axis=0), span_val, base)
    return xp.where(t < total, out, pad_id).astype(np.int32), total.astype(np.int32)


def _in_range(x, n: int) -> jax.Array:
    """``int32 []`` value of ``x`` forced into ``[0, n)`` with one unsigned ``min`` (values >= n and negative
    values, which wrap to large unsigned ones, become ``n - 1``); cheaper than a two-sided clip on CPU."""
    return jnp.minimum(jnp.asarray(x).astype(jnp.uint32), jnp.uint32(n - 1)).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# Compiled tables and in-jit rendering
# ----------------------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class ChatTables:
    """Pre-tokenized chat pieces of a `ChatSpec` (a pytree of int32 arrays; the ``int`` / tuple fields are static).

    A *program* is a list of K segments; segment k emits piece ``base[k] + source[src[k]]``, where the source
    vector is ``[0 (literal), *message.values, add_turn_end]``. Programs are padded to a common K with the empty
    piece 0.

    Attributes:
      piece_ids: ``int32 [P, Lpiece]`` token ids of every piece (literal text or slot option), right-padded.
      piece_len: ``int32 [P]`` number of tokens of each piece (0 for the empty piece).
      prompt_base, prompt_src: ``int32 [len(spec.user), Kp]`` programs of the user templates (system + user +
        assistant header).
      response_base, response_src: ``int32 [len(spec.tool), Kr]`` programs of the tool templates (rest of the
        assistant turn, tool turn, next assistant header iff the template continues).
      turn_end_ids: ``int32 [1]`` the assistant turn-end marker (``<|im_end|>`` for the shipped tokenizer).
      stop_ids: ``int32 [n]`` tokens that end a generation turn (turn end, then eos if different).
      prompt_stencils, response_stencils: `Stencils` of the two program sets (the fast path), or None (then the
        general concatenation of pieces is used; same ids).
      response_spans: ``int32 [len(spec.tool), J]`` segment of each span slot in each tool program (-1: none);
        None when no template has a `SpanSlot`.
      prompt_len, response_len: static maximum lengths of a rendered user / tool program.
      pad_id, turn_end_id, eos_id: static ints.
      value_options: static options per message value (what each value is clipped into).
    """

    piece_ids: jax.Array
    piece_len: jax.Array
    prompt_base: jax.Array
    prompt_src: jax.Array
    response_base: jax.Array
    response_src: jax.Array
    turn_end_ids: jax.Array
    stop_ids: jax.Array
    prompt_stencils: Stencils | None = None
    response_stencils: Stencils | None = None
    response_spans: jax.Array | None = None
    prompt_len: int = flax.struct.field(pytree_node=False, default=0)
    response_len: int = flax.struct.field(pytree_node=False, default=0)
    pad_id: int = flax.struct.field(pytree_node=False, default=0)
    turn_end_id: int = flax.struct.field(pytree_node=False, default=0)
    eos_id: int = flax.struct.field(pytree_node=False, default=0)
    value_options: tuple = flax.struct.field(pytree_node=False, default=())
    span_tokens: tuple = flax.struct.field(pytree_node=False, default=())
    digit_ids: tuple = flax.struct.field(pytree_node=False, default=())


def _internal(parts: Parts) -> Parts:
    """Slots re-pointed at the source vector, whose entry 0 is the literal zero (so value i sits at i + 1)."""
    return tuple(Slot(p.value + 1, p.options) if isinstance(p, Slot) else p for p in parts)


def compile_chat(
    tokenizer, spec: ChatSpec, chat_template: str | None = None, max_stencil_rows: int = 4096
) -> ChatTables:
    """Compile ``spec`` for ``tokenizer`` and its chat template (or ``chat_template`` if given); host, once.

    Every template is rendered with placeholder strings in its slots; the text around them becomes literal
    pieces, and every literal piece and slot option is tokenized on its own. The chat template must pass message
    contents through unchanged (wrapping them is fine); a self-check compares the compiled renders with the
    template's own text.

    ``max_stencil_rows`` caps the pre-rendered rows of each fast-path table (see `Stencils`); past it, or with
    0, rendering falls back to the general concatenation of pieces (same ids, slower).
    """
    if not isinstance(spec, ChatSpec):
        raise TypeError(f"compile_chat needs a ChatSpec, got {type(spec).__name__}")
    table = _PieceTable(tokenizer)
    # Prompts first, then responses: the programs' rows of `table.ids` are numbered in that order.
    prompt_programs = _prompt_programs(tokenizer, spec, table, chat_template)
    response_programs, response_span_segments, turn_end_id = _response_programs(tokenizer, spec, table, chat_template)
    prompt_base, prompt_src, prompt_len = _stack_programs(prompt_programs)
    response_base, response_src, response_len = _stack_programs(response_programs)
    pad_id, eos_id, stop = _special_ids(tokenizer, turn_end_id)
    piece_ids, piece_len = _piece_matrix(table.ids, pad_id)
    span_tokens = spec.span_tokens()
    response_spans = _response_span_table(spec, span_tokens, response_span_segments)
    digit_ids = _digit_ids(table)

    tables = ChatTables(
        piece_ids=jnp.asarray(piece_ids),
        piece_len=jnp.asarray(piece_len),
        prompt_base=jnp.asarray(prompt_base),
        prompt_src=jnp.asarray(prompt_src),
        response_base=jnp.asarray(response_base),
        response_src=jnp.asarray(response_src),
        turn_end_ids=jnp.asarray([turn_end_id], jnp.int32),
        stop_ids=jnp.asarray(stop, jnp.int32),
        prompt_stencils=_compile_stencils(prompt_programs, table.ids, prompt_len, pad_id, max_stencil_rows),
        response_stencils=_compile_stencils(response_programs, table.ids, response_len, pad_id, max_stencil_rows),
        response_spans=response_spans,
        prompt_len=int(prompt_len),
        response_len=int(response_len),
        pad_id=int(pad_id),
        turn_end_id=int(turn_end_id),
        eos_id=int(eos_id),
        value_options=spec.value_options(),
        span_tokens=span_tokens,
        digit_ids=digit_ids,
    )
    _self_check(tables, tokenizer, spec, chat_template)
    return tables


def _prompt_programs(tokenizer, spec: ChatSpec, table: _PieceTable, chat_template) -> list:
    """One program (`_PieceTable.program`) per user template: the system message and that user turn, rendered
    with the generation prompt."""
    system = {"role": "system", "content": spec.system}
    programs = []
    for parts in spec.user:
        slots: list = []
        content = _with_placeholders(_internal(parts), slots)
        text = _apply(tokenizer, spec, [system, {"role": "user", "content": content}], True, chat_template)
        programs.append(table.program(_split_rendered(text, slots)))
    return programs


def _response_programs(tokenizer, spec: ChatSpec, table: _PieceTable, chat_template):
    """``(programs, span segments, turn_end_id)``: one program per tool template, and for each the
    ``(segment, span)`` pairs of its span slots; ``turn_end_id`` is the assistant's turn-end token.

    Tool turns: render a whole exchange and keep what follows the assistant's content. That text starts with
    the assistant's turn end (found on the first template), which each program renders as its first slot.
    """
    context = _context(spec)
    turn_end_text = None
    programs = []
    span_segments: list[list[tuple[int, int]]] = []
    for parts, continues in zip(spec.tool, spec.tool_continues):
        slots = []
        content = _with_placeholders(_internal(parts), slots)
        tool = {"role": "tool", "name": spec.tool_name, "content": content}
        after = _after_assistant(_apply(tokenizer, spec, [*context, tool], continues, chat_template))
        if turn_end_text is None:
            turn_end_text, turn_end_id = _find_turn_end(tokenizer, after)
        if not after.startswith(turn_end_text):
            raise ValueError(f"tool-turn text {after[:40]!r} does not start with turn end {turn_end_text!r}")
        turn_end_slot = Slot(spec.num_values + 1, ("", turn_end_text))
        programs.append(table.program([turn_end_slot, *_split_rendered(after[len(turn_end_text) :], slots)]))
        span_segments.append(list(table.spans))
    return programs, span_segments, turn_end_id


def _stack_programs(programs) -> tuple[np.ndarray, np.ndarray, int]:
    """``(base int32 [P, K], src int32 [P, K], max tokens of any program)`` with K the most segments of any."""
    k = max(len(p[0]) for p in programs)
    base = np.zeros((len(programs), k), np.int32)  # padding segments read the empty piece 0
    src = np.zeros((len(programs), k), np.int32)
    for r, (b, s, _, _) in enumerate(programs):
        base[r, : len(b)] = b
        src[r, : len(s)] = s
    return base, src, max(p[2] for p in programs)


def _special_ids(tokenizer, turn_end_id: int) -> tuple[int, int, list[int]]:
    """``(pad_id, eos_id, stop ids)``: the tokenizer's pad and eos, the turn end standing in for either one
    missing; a rollout stops at the turn end or at eos."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else turn_end_id
    pad_id = turn_end_id if pad_id is None else int(pad_id)
    stop = [turn_end_id] + ([int(eos_id)] if int(eos_id) != turn_end_id else [])
    return pad_id, eos_id, stop


def _piece_matrix(pieces: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(piece_ids int32 [N, Lpiece] padded with pad_id, piece_len int32 [N])`` of the N pieces' ids."""
    lpiece = max(1, max(len(ids) for ids in pieces))
    piece_ids = np.full((len(pieces), lpiece), pad_id, np.int32)
    for i, ids in enumerate(pieces):
        piece_ids[i, : len(ids)] = ids
    return piece_ids, np.array([len(ids) for ids in pieces], np.int32)


def _response_span_table(spec: ChatSpec, span_tokens, span_segments) -> jax.Array | None:
    """``int32 [n_tool, n_spans]``: the segment of each tool template that holds each span (-1: none); None
    when the spec has no span slots."""
    if not span_tokens:
        return None
    segs = np.full((len(spec.tool), len(span_tokens)), -1, np.int32)
    for r, pairs in enumerate(span_segments):
        for k, j in pairs:
            segs[r, j] = k
    return jnp.asarray(segs)


def _digit_ids(table: _PieceTable) -> tuple[int, ...]:
    """The ids of the digits 0-9, or () unless the tokenizer spells numbers digit by digit (number_span
    writes one token per digit)."""
    digits = [table.encode(str(d)) for d in range(10)]
    if all(len(d) == 1 for d in digits) and (table.encode("9876543210") == [d[0] for d in digits[::-1]]):
        return tuple(d[0] for d in digits)
    return ()


_CHECK_VECTORS = 3  # host template renders per program in the self-check
_CHECK_STENCIL_ROWS = 48  # stencil-vs-general comparisons per program


def _self_check(tables: ChatTables, tokenizer, spec: ChatSpec, chat_template) -> None:
    """Host check: every program reproduces the template's own text on a few value vectors (all first options,
    all last options, random), and the stencils give the general path's very ids on every key-slot combination
    (or a sample of them when there are many)."""
    rng = np.random.default_rng(0)
    n_opts = np.array(tables.value_options, np.int64)

    def vectors():
        yield np.zeros(spec.num_values, np.int64)
        yield n_opts - 1
        for _ in range(_CHECK_VECTORS - 2):
            yield rng.integers(0, n_opts)

    def decoded(base, src, values, add_turn_end, out_len, spans=None):
        source = np.concatenate([[0], values, [int(add_turn_end)]])
        ids, n = _render_np(tables, base, src, source, out_len)
        if spans is not None:
            segments, span_ids = spans
            width = max([1] + [len(x) for x in span_ids])
            padded = np.array([x + [0] * (width - len(x)) for x in span_ids], np.int64).reshape(len(span_ids), width)
            seg_len = np.asarray(tables.piece_len)[np.asarray(base) + source[np.asarray(src)]]
            ids, n = _splice(
                np,
                ids,
                n,
                seg_len,
                segments,
                padded,
                np.array([len(x) for x in span_ids]),
                np.array(tables.span_tokens),
                tables.pad_id,
            )
        return tokenizer.decode(ids[:n].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for k in range(len(spec.user)):
        for values in vectors():
            want = chat_text(tokenizer, spec, user_messages(spec, (k, values)), True, chat_template)
            got = decoded(tables.prompt_base[k], tables.prompt_src[k], values, False, tables.prompt_len)
            if got != want:
                raise ValueError(
                    f"in-jit user-template {k} pieces do not reproduce the chat template:\n{got!r}\n!=\n{want!r}"
                )
    sample = [int(i) for i in tokenizer.encode(" echo: 42!", add_special_tokens=False)]
    for k in range(len(spec.tool)):
        for i, values in enumerate(vectors()):
            # Spans empty, then the sample's first tokens (cut to each slot's max_tokens).
            span_ids = [sample[:w] if i else [] for w in tables.span_tokens]
            texts = [
                tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) for ids in span_ids
            ]
            want = tool_text(
                tokenizer, spec, (k, values), add_turn_end=bool(i % 2), chat_template=chat_template, spans=texts
            )
            got = decoded(
                tables.response_base[k],
                tables.response_src[k],
                values,
                i % 2,
                tables.response_len,
                None if tables.response_spans is None else (np.asarray(tables.response_spans[k]), span_ids),
            )
            if got != want:
                raise ValueError(
                    f"in-jit tool-template {k} pieces do not reproduce the chat template:\n{got!r}\n!=\n{want!r}"
                )

    source_opts = np.concatenate([[1], n_opts, [2]])
    for stencils, base, src, out_len in (
        (tables.prompt_stencils, tables.prompt_base, tables.prompt_src, tables.prompt_len),
        (tables.response_stencils, tables.response_base, tables.response_src, tables.response_len),
    ):
        if stencils is None:
            continue
        key_srcs = [s for s, _ in stencils.key_sources]
        radix = [n for _, n in stencils.key_sources]
        combos = int(np.prod(radix, dtype=np.int64))
        if combos <= _CHECK_STENCIL_ROWS:
            keys = [np.array(v) for v in np.ndindex(*radix)] * max(1, _CHECK_STENCIL_ROWS // combos)
        else:
            keys = [rng.integers(0, radix) for _ in range(_CHECK_STENCIL_ROWS)]
        for program in range(base.shape[0]):
            for key in keys:
                source = rng.integers(0, source_opts)
                source[key_srcs] = key
                want = _render_np(tables, base[program], src[program], source, out_len)
                got = _stencil_np(stencils, program, source)
                if not (np.array_equal(got[0], want[0]) and got[1] == want[1]):
                    raise AssertionError(f"stencil tables disagree with the piece programs (program {program})")


def _source(tables: ChatTables, values, add_turn_end) -> list:
    """The source vector as int32 scalars, each value forced into its options with one unsigned ``min`` (values
    no slot reads stay 0, so they cost nothing)."""
    if isinstance(values, (list, tuple)):  # scalars as they are: no stacking for the renderer to slice apart
        shape = (len(values),)
    else:
        values = jnp.asarray(values)
        shape = values.shape
    if shape != (len(tables.value_options),):
        raise ValueError(f"message values must have shape [{len(tables.value_options)}], got {shape}")
    return [
        jnp.int32(0),
        *(_in_range(values[i], n) if n > 1 else jnp.int32(0) for i, n in enumerate(tables.value_options)),
        (jnp.asarray(add_turn_end) != 0).astype(jnp.int32),
    ]


def render_user(tables: ChatTables, message):
    """System + user turn + assistant header of ``message`` (a ``Message`` or ``(template, values)``, values an
    ``int [S]`` array or a list of S int scalars; jit/vmap friendly). Returns ``(ids int32 [tables.prompt_len],
    length int32 [])``; ids past ``length`` are ``pad_id``.
    The template index is clipped into range, every value into its slot's options."""
    template, values = _unpack(message)
    row = jnp.clip(jnp.asarray(template, jnp.int32), 0, tables.prompt_base.shape[0] - 1)
    source = _source(tables, values, False)
    if tables.prompt_stencils is not None:
        return _render_stencil(tables.prompt_stencils, row, source)
    return _render(tables, tables.prompt_base[row], tables.prompt_src[row], jnp.stack(source), tables.prompt_len)


def render_tool(tables: ChatTables, message, add_turn_end: Any = False):
    """Tokens appended after the policy's turn (jit/vmap friendly): the rest of the assistant turn after its
    turn-end marker (the marker itself first when ``add_turn_end``, e.g. when the policy stopped on its token
    budget), the tool turn of ``message``, and the next assistant header when the template continues.
    Returns ``(ids int32 [tables.response_len], length int32 [])``."""
    template, values = _unpack(message)
    row = jnp.clip(jnp.asarray(template, jnp.int32), 0, tables.response_base.shape[0] - 1)
    source = _source(tables, values, add_turn_end)
    if tables.response_stencils is not None:
        ids, n = _render_stencil(tables.response_stencils, row, source)
    else:
        ids, n = _render(
            tables, tables.response_base[row], tables.response_src[row], jnp.stack(source), tables.response_len
        )
    if tables.response_spans is None:
        return ids, n
    span_ids, span_len = getattr(message, "span_ids", None), getattr(message, "span_len", None)
    n_spans = len(tables.span_tokens)
    if span_ids is None or span_ids.shape[0] < n_spans:
        raise ValueError(
            f"the tool templates read {n_spans} token spans: the Message needs span_ids [{n_spans}, W] and span_len"
        )
    seg_len = tables.piece_len[tables.response_base[row] + jnp.stack(source)[tables.response_src[row]]]
    return _splice(
        jnp,
        ids,
        n,
        seg_len,
        tables.response_spans[row],
        jnp.asarray(span_ids, jnp.int32)[:n_spans],
        jnp.asarray(span_len, jnp.int32)[:n_spans],
        jnp.asarray(tables.span_tokens, jnp.int32),
        tables.pad_id,
    )


def number_span(tables: ChatTables, value, width: int):
    """Token ids of the decimal digits of ``value`` (``int []``, clipped to ``0 .. 10**width - 1``), for a
    `SpanSlot`: ``(ids int32 [width], length int32 [])``, jit/vmap friendly. Needs a tokenizer that spells
    numbers one token per digit (``tables.digit_ids``), as the shipped one does."""
    if len(tables.digit_ids) != 10:
        raise ValueError("number_span needs a tokenizer that encodes every number one token per digit")
    value = jnp.clip(jnp.asarray(value, jnp.int32), 0, 10**width - 1)
    powers = jnp.asarray([10 ** (width - 1 - i) for i in range(width)], jnp.int32)  # most significant first
    digits = (value // powers) % 10
    length = jnp.maximum(1, jnp.sum(value >= powers)).astype(jnp.int32)
    # Drop the leading zeros: digit i of the output is digit (width - length + i) of the zero-padded number.
    idx = jnp.clip(jnp.arange(width) + width - length, 0, width - 1)
    ids = jnp.asarray(tables.digit_ids, jnp.int32)[digits[idx]]
    return jnp.where(jnp.arange(width) < length, ids, 0), length
