"""The run's tokenizer (`model.tokenizer`): the shipped one, or one built for the environment, saved with the run.

`model.tokenizer = "env"` trains a byte-level BPE of the shipped one's size (`assets.build_tokenizer.build`: the
same special tokens, pre-tokenizer and chat template) on the environment's own text: conversations rendered
through the chat template from its `ChatSpec` (system prompt, tool schemas, every user and tool template with
random slot options) and its teacher's calls (else calls drawn from the tool schemas), plus whatever texts its
registration declares (`registry.register(tokenizer_corpus=config -> iterable of str)`). A host environment
(`reno_jax.envs.host`) is played instead: episodes of training tasks, its teacher's calls (else calls drawn from
the tool schemas) stepped through it, its responses, rendered the same way, plus `HostEnv.tokenizer_corpus()`. So
the environment's
words, numbers and call skeleton become a few tokens each, where the tic-tac-toe-built shipped one spells them out.

Every run writes the tokenizer it trains with into `<workdir>/tokenizer/` (`run_tokenizer`), and every reader of
the run (resume, evaluation, the play page) loads that one: a run built on its environment's tokenizer is read
back with exactly it. A run of older code saved none and gets the one its config names.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from typing import Sequence

import numpy as np

from reno_jax import run_config
from reno_jax.assets import build_tokenizer as builder
from reno_jax.envs import host, registry
from reno_jax.loop import host_envs
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.protocol.chat import ChatSpec, Slot, SpanSlot

SUBDIR = "tokenizer"  # <workdir>/tokenizer: the run's own
CORPUS_CONVERSATIONS = 2000  # rendered conversations of the environment's chat: enough for a 512-token BPE


def _fill(template: tuple, rng: random.Random) -> str:
    """One rendering of a message template: every slot a random option, every token span a random number."""
    parts = []
    for piece in template:
        if isinstance(piece, Slot):
            parts.append(rng.choice(piece.options))
        elif isinstance(piece, SpanSlot):
            parts.append(str(rng.randrange(10 ** rng.randint(1, 4))))
        else:
            parts.append(str(piece))
    return "".join(parts)


def _schema_call(tools: Sequence[dict], rng: random.Random) -> tuple[str, dict]:
    """A call drawn from the tool schemas (an environment without a teacher): integers in range, enum options."""
    function = rng.choice(tools)["function"]
    args = {}
    for name, p in function.get("parameters", {}).get("properties", {}).items():
        if p.get("enum"):
            args[name] = rng.choice(p["enum"])
        elif p.get("type") == "integer":
            args[name] = rng.randint(int(p.get("minimum", 0)), int(p.get("maximum", 99)))
        else:
            args[name] = rng.choice(("yes", "no", "42", "done"))
    return function["name"], args


def chat_corpus(chat: ChatSpec, calls: Sequence[tuple[str, dict]], num: int, seed: int = 0) -> list[str]:
    """`num` conversations of `chat` rendered through the chat template: the system prompt and tools, a user
    message, then 1 to 3 turns of a call (one of `calls`, else drawn from the schemas) and a tool answer."""
    rng = random.Random(seed)
    render = builder.template_renderer(builder.chat_template())
    docs = []
    for _ in range(num):
        messages = [
            {"role": "system", "content": chat.system},
            {"role": "user", "content": _fill(rng.choice(chat.user), rng)},
        ]
        for _ in range(rng.randint(1, 3)):
            name, args = rng.choice(calls) if calls else _schema_call(chat.tools, rng)
            call = json.dumps({"name": name, "arguments": args})  # as the warm start writes a call
            messages.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
            messages.append({"role": "tool", "name": chat.tool_name, "content": _fill(rng.choice(chat.tool), rng)})
        docs.append(render(messages, list(chat.tools), rng.random() < 0.5))
    return docs


def _host_call(env: host.HostEnv, np_rng: np.random.Generator, rng: random.Random) -> host.ToolCall:
    """The teacher's next call, else (an environment without a teacher) one drawn from the tool schemas."""
    try:
        return env.teacher(np_rng)
    except NotImplementedError:
        return host.ToolCall(*_schema_call(env.tools, rng))


def host_corpus(env_class: type[host.HostEnv], num: int, seed: int = 0) -> list[str]:
    """`num` episodes of a host environment on training tasks rendered through the chat template: the system
    prompt and tools, the first user message, then up to 3 turns of a call (`_host_call`) and the environment's
    response; plus `env_class.tokenizer_corpus()`."""
    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    render = builder.template_renderer(builder.chat_template())
    tool_name = None if env_class.tools else env_class.name
    docs = []
    for _ in range(num):
        env = env_class()
        first = host.checked_reset(env, env_class.sample_task(np_rng))
        messages = [{"role": "system", "content": env_class.system_prompt}, {"role": "user", "content": first}]
        for _ in range(min(3, int(env_class.max_turns)) if env_class.tools else 0):
            call = _host_call(env, np_rng, rng)
            text = json.dumps({"name": call.name, "arguments": call.arguments})  # as the warm start writes a call
            messages.append({"role": "assistant", "content": f"<tool_call>{text}</tool_call>"})
            step = host.checked_step(env, "step", env.step(call))
            messages.append({"role": "tool", "name": tool_name, "content": step.text})
            if step.done:
                break
        docs.append(render(messages, list(env_class.tools), rng.random() < 0.5))
    return docs + [str(t) for t in env_class.tokenizer_corpus()]


def env_corpus(config) -> list[str]:
    """The texts the environment's tokenizer is trained on: its chat rendered (`chat_corpus`, with its teacher's
    calls when it has a teacher) and the corpus its registration declares; for a host environment `host_corpus`."""
    config = run_config.load(config)
    env_class = host_envs.host_env_class(config)
    if env_class is not None:
        return host_corpus(env_class, CORPUS_CONVERSATIONS, seed=config.seed)
    entry = registry.entry_for(config.env)
    env = entry.make_env(config.env)
    calls = list(entry.make_teacher(config, env).calls) if entry.make_teacher is not None else []
    declared = list(entry.tokenizer_corpus(config)) if entry.tokenizer_corpus is not None else []
    return chat_corpus(env.chat(), calls, CORPUS_CONVERSATIONS, seed=config.seed) + [str(t) for t in declared]


def env_tokenizer(config, out_dir: str | None = None):
    """A byte-level BPE of the shipped size trained on `env_corpus`, written to `out_dir` (default: a temporary
    directory) and loaded from there."""
    corpus = env_corpus(config)
    if out_dir is not None:
        return tokenizer_lib.load_tokenizer(builder.build(out_dir, corpus))
    with tempfile.TemporaryDirectory() as tmp:
        return tokenizer_lib.load_tokenizer(builder.build(tmp, corpus))


def config_tokenizer(config):
    """The tokenizer `config` names: `model.tokenizer_path`, else `model.path`'s, else (`model.tokenizer`) the
    shipped one or the environment's own (`env_tokenizer`)."""
    model = run_config.load(config).model
    if model.tokenizer == "env":
        return env_tokenizer(config)
    return tokenizer_lib.load_tokenizer(model.tokenizer_path or model.path or None)


def run_tokenizer(config, workdir: str):
    """The tokenizer of the run in `workdir`: the one it saved (`<workdir>/tokenizer`), else `config_tokenizer`
    (a new run, or one of older code)."""
    saved = os.path.join(workdir, SUBDIR)
    if os.path.isfile(os.path.join(saved, "tokenizer.json")):
        return tokenizer_lib.load_tokenizer(saved)
    return config_tokenizer(config)


def save_run_tokenizer(tokenizer, workdir: str) -> None:
    """Saves `tokenizer` as the run's (`<workdir>/tokenizer`) unless it is there already: written by the training
    process beside config.json, after the checks and the restore that could still refuse the run."""
    saved = os.path.join(workdir, SUBDIR)
    if not os.path.isfile(os.path.join(saved, "tokenizer.json")):
        tokenizer.save_pretrained(saved)
