"""The model work behind the page, for any registered environment (the page knows no game).

Jitted pure functions, each compiled once per model and environment (every start renders to the same padded
prompt length, so one program serves all boards and all checkpoints of a run):

* `decision_distribution`: the **heat map**. The environment's teacher calls (`interface.Teacher.calls`, one per
  action the board view names) tokenise to rows that differ in one token, the choice token
  (`sft.CallTable.choice_offset`). We feed the one-decision episode's prompt (the environment's own `reset`,
  rendered as the rollout renders it) plus the calls' common tokens before that position and read the next-token
  distribution there:

      mass  = sum_r p(choice token of row r | prompt, call prefix)    (the raw mass on the teacher's choices)
      probs = p(choice token of row r | ...) / mass                    (renormalised: sums to 1)

  With the rollout's temperature 1 and no top-k/top-p, ``mass * probs[r]`` is exactly the probability a sampled
  rollout that wrote the common prefix gives row r.

* `model_reply`: the model's own answer on a board through the real rollout path (`rollout.rollout` on the
  one-decision episode, one turn: its prompt, its generated text, the jitted tool-call parser) and the
  environment's own step on the parsed call (its reward and tool response).

* `model_episode`: a whole episode of any environment (the transcript view, and a puzzle played to the end): the
  rollout, then the environment replayed over the calls it parsed, for the tool responses the rollout does not
  render after the last turn.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface
from reno_jax.loop import build
from reno_jax.models import ling3
from reno_jax.protocol import chat as chat_lib
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.protocol import toolcall
from reno_jax.rl import sft
from reno_jax.rollout import rollout as rollout_lib


def _first(tree):
    return jax.tree.map(lambda a: a[0], tree)


def tool_names(env: rollout_lib.CompiledEnv) -> list[str]:
    return [t["function"]["name"] for t in env.env.chat().tools]


def choice_table(tokenizer, env: rollout_lib.CompiledEnv, teacher: interface.Teacher) -> sft.CallTable:
    """The teacher's calls tokenised as the warm start writes them; raises ValueError when they do not differ in
    exactly one token (the heat map is then not one next-token distribution)."""
    table = sft.build_call_table(
        tokenizer, teacher.calls, int(env.chat.turn_end_id), env.pad_id, tool_names(env), env.env.chat().tools
    )
    if table.choice_offset < 0:
        raise ValueError(
            "this tokenizer's teacher calls do not differ in exactly one token; the decision-token "
            "heat map is undefined"
        )
    return table


def decision_distribution(
    params,
    start,
    env: rollout_lib.CompiledEnv,
    prefix: jax.Array,
    choice_ids: jax.Array,
    *,
    model_config: ling3.Ling3Config,
):
    """``(probs float32 [R], mass float32 [])`` at the choice token of the episode ``start`` (leading axis 1)
    opens with (see the module docstring)."""
    _, message = env.env.reset(_first(start))
    prompt, n = env.render_user(message)
    p = prefix.shape[0]
    tokens = jnp.concatenate([prompt, jnp.full((p,), env.pad_id, jnp.int32)])
    tokens = jax.lax.dynamic_update_slice(tokens, prefix.astype(jnp.int32), (n,))
    total = n + p
    valid = jnp.arange(tokens.shape[0]) < total  # the pad tail is masked (and after the read position anyway)
    logits, _ = ling3.forward(params, model_config, tokens[None], valid=valid[None])
    logp = jax.nn.log_softmax(logits[0, total - 1].astype(jnp.float32))
    choice_p = jnp.exp(logp[choice_ids])
    mass = jnp.sum(choice_p)
    return choice_p / jnp.maximum(mass, 1e-30), mass


def model_reply(
    params,
    key: jax.Array,
    start,
    env: rollout_lib.CompiledEnv,
    *,
    model_config: ling3.Ling3Config,
    rollout_config: rollout_lib.RolloutConfig,
) -> dict:
    """One one-decision episode at ``start`` (``rollout_config.max_turns`` 1): the generated tokens, the parsed call,
    the environment's step on it (its reward, the episode's for a one-turn episode, and its tool response as a
    message)."""
    traj = rollout_lib.rollout(params, key, start, model_config=model_config, rollout_config=rollout_config, env=env)
    m = rollout_config.max_new_tokens
    n = traj.info["generated_tokens"][0]
    generated = jax.lax.dynamic_slice(traj.tokens[0], (traj.prompt_length[0],), (m,))
    call = _first(env.parse_batch(generated[None], n[None], rollout_config.parse_max_bytes))
    state, _ = env.env.reset(_first(start))
    step = env.env.step(env.env.for_member(state, jnp.int32(0)), call)
    return dict(
        tokens=generated,
        num_tokens=n,
        kind=call.kind,
        tool=call.tool,
        args=call.args,
        reward=step.reward,  # the move's own (the rollout's episode reward is cut short after one turn)
        template=step.message.template,
        values=step.message.values,
    )


def model_episode(
    params,
    key: jax.Array,
    start,
    env: rollout_lib.CompiledEnv,
    *,
    model_config: ling3.Ling3Config,
    rollout_config: rollout_lib.RolloutConfig,
) -> dict:
    """One whole episode at ``start`` (leading axis 1): the conversation's tokens, which of them the model wrote
    and in which turn (``[rows, width]``: one row, or with bounded history one turn sample per turn), the reward and
    the environment's final info."""
    traj = rollout_lib.rollout(params, key, start, model_config=model_config, rollout_config=rollout_config, env=env)
    rows = traj.tokens.shape[0] // traj.stats.num_turns.shape[0]  # the episode's rows come first (T with history)
    return dict(
        tokens=traj.tokens[:rows],
        loss_mask=traj.loss_mask[:rows],
        turn_id=traj.turn_id[:rows],
        num_turns=traj.info["num_turns"][0],
        reward=traj.reward[0],
        info=_first(traj.info),
    )


def replay(start, calls: interface.ToolCall, env: rollout_lib.CompiledEnv) -> dict:
    """The environment's messages, rewards and done flags over ``calls`` (``[T]`` parsed calls, in turn order)
    from ``start``, as the rollout stepped it (the first episode of the group)."""
    state, first = env.env.reset(_first(start))
    state = env.env.for_member(state, jnp.int32(0))

    def body(state, call):
        step = env.env.step(state, call)
        return step.state, (step.message, step.reward, step.done)

    _, (messages, rewards, dones) = jax.lax.scan(body, state, calls)
    return dict(first=first, messages=messages, rewards=rewards, dones=dones)


def _text(tokenizer, ids) -> str:
    return tokenizer_lib.decode(tokenizer, [int(i) for i in ids])


@dataclasses.dataclass
class Decisions:
    """A board or puzzle environment's one-decision episodes for one run's model: the heat map and the model's
    reply (one turn of the episode the view starts, whatever the environment's own turn budget)."""

    config: object
    tokenizer: object
    model_config: ling3.Ling3Config
    entry: object
    view: interface.BoardView | interface.PuzzleView

    def __post_init__(self):
        self.env = build.make_compiled_env(
            self.config, self.tokenizer, self.model_config, **dict(self.view.decision_overrides)
        )
        self.table, self.row_actions, self.heat_error = None, None, None
        if self.entry.make_teacher is None:
            self.heat_error = "this environment declares no teacher calls, so there is no heat map"
        else:
            try:
                self.table = choice_table(self.tokenizer, self.env, self.entry.make_teacher(self.config, self.env.env))
                self.row_actions = self.view.actions_of_rows(int(self.table.ids.shape[0]))
            except ValueError as e:
                self.table, self.heat_error = None, str(e)
        self._heat = jax.jit(functools.partial(decision_distribution, model_config=self.model_config))
        self._replies = {}  # greedy -> jitted model_reply (the sampled one is only compiled when asked for)

    def heat_map(self, params, board: np.ndarray) -> dict:
        """``probs`` over the view's actions (sums to 1), the raw ``mass`` on the teacher's choice tokens."""
        if self.table is None:
            return {"probs": None, "mass": None, "heat_error": self.heat_error}
        offset = self.table.choice_offset
        ids = np.asarray(self.table.ids)
        prefix, choice_ids = jnp.asarray(ids[0, :offset], jnp.int32), jnp.asarray(ids[:, offset], jnp.int32)
        probs, mass = self._heat(params, self.view.decision_start(board), self.env, prefix, choice_ids)
        by_action = np.zeros((self.view.num_actions,), np.float64)
        np.add.at(by_action, self.row_actions, np.asarray(probs, np.float64))
        return {"probs": [float(p) for p in by_action], "mass": float(mass), "heat_error": None}

    def _reply_fn(self, greedy: bool):
        if greedy not in self._replies:
            rc = dataclasses.replace(build.rollout_config(self.config, greedy=greedy, group_size=1), max_turns=1)
            self._replies[greedy] = jax.jit(
                functools.partial(model_reply, model_config=self.model_config, rollout_config=rc)
            )
        return self._replies[greedy]

    def action_of_call(self, kind: int, tool: int, args: np.ndarray) -> int | None:
        """The view's action of a parsed call: the teacher row with the same tool and arguments; None if none."""
        if kind != toolcall.KIND_OK or self.table is None:
            return None
        rows_args = np.asarray(self.table.args)
        width = rows_args.shape[1]
        same = (np.asarray(self.table.tool) == tool) & np.all(rows_args == np.asarray(args)[:width], axis=1)
        rows = np.flatnonzero(same)
        return int(self.row_actions[rows[0]]) if rows.size else None

    def reply(self, params, board: np.ndarray, greedy: bool = True, seed: int = 0, start=None) -> dict:
        """The model's turn on ``board`` (the side to move): its text, the parsed call, the action it names, the
        page's verdict ("legal", "illegal": the board refuses that action, "invalid": no call the board knows),
        the board after it, the environment's reward and tool response. ``start``: the episode's start record
        (default: the view's `decision_start` of ``board``; a puzzle's counts the moves already made)."""
        start = self.view.decision_start(board) if start is None else start
        out = self._reply_fn(greedy)(params, jax.random.PRNGKey(seed), start, self.env)
        out = jax.tree.map(np.asarray, out)
        kind = int(out["kind"])
        action = self.action_of_call(kind, int(out["tool"]), out["args"])
        if action is None:
            name, after = "invalid", board
        elif not bool(self.view.legal(board)[action]):
            name, after = "illegal", board
        else:
            name, after = "legal", self.view.apply(board, action)
        tools = self.env.env.chat().tools
        call = toolcall.decode_args(tools, int(out["tool"]), out["args"]) if kind == toolcall.KIND_OK else None
        return {
            "text": _text(self.tokenizer, out["tokens"][: int(out["num_tokens"])]),
            "parse": toolcall.KIND_NAMES[kind],
            "call": None if call is None else {"name": tool_names(self.env)[int(out["tool"])], "arguments": call},
            "action": action,
            "label": None if action is None else self.view.label(action),
            "verdict": name,
            "board_after": self.view.format(after),
            "reward": float(out["reward"]),
            "tool_response": chat_lib.tool_message(self.env.env.chat(), (out["template"], out["values"]))["content"],
            "greedy": greedy,
        }


@dataclasses.dataclass
class Episodes:
    """Whole episodes of any environment for one run's model (the transcript view), per environment setting."""

    config: object
    tokenizer: object
    model_config: ling3.Ling3Config

    def __post_init__(self):
        self._envs = {}  # (override items) -> CompiledEnv
        self._fns = {}  # greedy -> (jitted model_episode, jitted replay, jitted parser)

    def _env(self, overrides: dict) -> rollout_lib.CompiledEnv:
        key = tuple(sorted(overrides.items()))
        if key not in self._envs:
            self._envs[key] = build.make_compiled_env(self.config, self.tokenizer, self.model_config, **overrides)
        return self._envs[key]

    def _fn(self, greedy: bool):
        if greedy not in self._fns:
            rc = build.rollout_config(self.config, greedy=greedy, group_size=1)
            self._fns[greedy] = (
                jax.jit(functools.partial(model_episode, model_config=self.model_config, rollout_config=rc)),
                jax.jit(replay),
                jax.jit(lambda env, ids, n: env.parse_batch(ids, n, rc.parse_max_bytes)),
                rc,
            )
        return self._fns[greedy]

    def play(
        self, params, start, overrides: dict, greedy: bool = True, seed: int = 0, with_calls: bool = False
    ) -> dict:
        """The episode at ``start`` as chat messages: system, user, then per turn the model's text and the tool's
        response (with that step's reward), the episode's reward and the environment's info figures; with
        ``with_calls`` also ``calls``, each turn's parsed call as ``(kind, tool, args)`` (for a view to replay)."""
        env = self._env(dict(overrides))
        episode_fn, replay_fn, parse_fn, rc = self._fn(greedy)
        out = jax.tree.map(np.asarray, episode_fn(params, jax.random.PRNGKey(seed), start, env))
        turns = int(out["num_turns"])
        ids = np.full((max(turns, 1), rc.max_new_tokens), env.pad_id, np.int32)
        lengths = np.zeros((max(turns, 1),), np.int32)
        texts = []
        for t in range(turns):
            mine = np.asarray(out["tokens"])[(out["turn_id"] == t) & out["loss_mask"]]
            ids[t, : len(mine)], lengths[t] = mine, len(mine)
            texts.append(_text(self.tokenizer, mine))
        calls = parse_fn(env, jnp.asarray(ids), jnp.asarray(lengths))
        steps = jax.tree.map(np.asarray, replay_fn(start, calls, env))
        spec = env.env.chat()
        messages = [dict(m, turn=None) for m in chat_lib.user_messages(spec, steps["first"])]
        for t in range(turns):
            messages.append(
                {
                    "role": "assistant",
                    "content": texts[t],
                    "turn": t,
                    "parse": toolcall.KIND_NAMES[int(np.asarray(calls.kind)[t])],
                }
            )
            message = (steps["messages"].template[t], steps["messages"].values[t])
            messages.append(
                {
                    **chat_lib.tool_message(spec, message),
                    "turn": t,
                    "reward": float(steps["rewards"][t]),
                    "done": bool(steps["dones"][t]),
                }
            )
        info = {k: float(v) for k, v in out["info"].items() if np.ndim(v) == 0}
        answer = {
            "messages": messages,
            "num_turns": turns,
            "reward": float(out["reward"]),
            "info": info,
            "greedy": greedy,
        }
        if with_calls:
            parsed = jax.tree.map(np.asarray, calls)
            answer["calls"] = [(int(parsed.kind[t]), int(parsed.tool[t]), parsed.args[t]) for t in range(turns)]
        return answer
