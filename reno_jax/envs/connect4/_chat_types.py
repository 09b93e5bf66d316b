"""Stand-ins for ``reno_jax.protocol.chat``'s ``Slot`` / ``ChatSpec`` / ``resolve`` while that module only holds
its contract (the compiler is being written alongside this environment).

TODO: delete this module and import ``Slot``, ``ChatSpec``, ``Parts`` and ``resolve`` from
``reno_jax.protocol.chat`` once they exist there; the fields below are exactly the contract's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Union


@dataclasses.dataclass(frozen=True)
class Slot:
    """A variable piece of a message: the text ``options[values[value]]`` (the value clipped into range)."""

    value: int
    options: tuple[str, ...]


Parts = tuple  # tuple[str | Slot, ...]: one message's content
Part = Union[str, Slot]


@dataclasses.dataclass(frozen=True)
class ChatSpec:
    """An environment's text: system prompt, tool schemas (OpenAI/HF ``tools=`` dicts), the user templates (picked
    by ``Message.template`` in ``reset``), the tool templates (in ``step``), whether the assistant goes on after each
    tool template, the length of ``Message.values``, and the ``name`` of tool messages."""

    system: str
    tools: tuple[dict, ...]
    user: tuple[Parts, ...]
    tool: tuple[Parts, ...]
    tool_continues: tuple[bool, ...]
    num_values: int
    tool_name: str | None = None


def resolve(parts: Sequence[Part], values: Sequence[Any]) -> str:
    """Host: the text of ``parts`` with every slot's option picked by ``values`` (clipped, as in jit)."""
    out = []
    for p in parts:
        if isinstance(p, Slot):
            out.append(p.options[min(max(int(values[p.value]), 0), len(p.options) - 1)])
        else:
            out.append(p)
    return "".join(out)
