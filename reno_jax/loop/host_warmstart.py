"""The supervised warm start for a host environment: next-token training on its teacher's conversations.

Each episode is played on the host with `env.teacher(rng)` (a `host.ToolCall` per turn), and written token by
token as `host_rollout` would write the same calls: the prompt (`HostChat.prompt_ids`), each call rendered as the
chat template renders an assistant tool call (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the text
`sft.build_call_table` writes for a jitted teacher, then the turn-end marker), each tool response as the fixed
tool-turn pieces around its own tokens (cut to `rollout.host_max_response_tokens`), with the same truncation rule.
So a supervised batch holds exactly the ids a host rollout of those calls holds (tests/test_host_loop.py checks it
against `host_rollout` forced to the teacher's ids); the loss is on the calls and their turn ends only.

At the end the student (greedy) and the teacher are both played on the held-out suite (`eval_tasks`), and their
figures are reported side by side.
"""

from __future__ import annotations

import dataclasses
import json
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax import run_config
from reno_jax.envs import host, interface
from reno_jax.errors import ConfigError, as_config_error
from reno_jax.loop import evaluation, host_envs, hosts
from reno_jax.protocol import toolcall
from reno_jax.protocol.tokenizer import decode as decode_text
from reno_jax.rl import sft
from reno_jax.rl.batch import TrainBatch, bucketed_length
from reno_jax.rollout import host_rollout as H


def call_ids(chat: H.HostChat, call: host.ToolCall) -> list[int]:
    """The ids of an assistant turn making `call`: its text as the chat template writes a tool call, then the
    turn-end marker (what the policy generates before the tool turn)."""
    text = f"{toolcall.OPEN_TAG}{json.dumps({'name': call.name, 'arguments': call.arguments})}{toolcall.CLOSE_TAG}"
    return [*chat.encode(text), *chat.turn_end]


@dataclasses.dataclass(frozen=True)
class TeacherEpisode:
    """One teacher conversation: its ids and which are the calls (`loss`), its reward and `episode_info`."""

    ids: list
    loss: list
    reward: float
    info: dict


def _teacher_call(env: host.HostEnv, rng: np.random.Generator) -> host.ToolCall:
    call = env.teacher(rng)
    if not isinstance(call, host.ToolCall):
        raise host.HostEnvError(
            f"{type(env).__name__} (name {env.name!r}).teacher must return a host.ToolCall, got {type(call).__name__}"
        )
    return call


def play_teacher(env_class, task, rng, chat: H.HostChat, *, turns: int, length: int, max_new_tokens: int, cut: int):
    """Plays one episode of `task` with the environment's teacher; a `TeacherEpisode` written as `host_rollout`
    writes the same calls (`cut`: a response's token budget; an episode whose response and a full next turn would
    overflow `length`, or that runs out of `turns`, ends truncated with the environment's `truncation_reward`)."""
    env = env_class()
    ids = chat.prompt_ids(host.checked_reset(env, task))
    loss, reward, truncated = [False] * len(ids), 0.0, True
    for turn in range(turns):
        call = call_ids(chat, _teacher_call(env, rng))
        if len(call) > max_new_tokens:
            raise ConfigError(
                f"--config.rollout.max_new_tokens={max_new_tokens} is shorter than env.name={env.name!r}'s teacher "
                f"call ({len(call)} tokens with the turn end); set it to >= {len(call)}"
            )
        ids, loss = ids + call, loss + [True] * len(call)
        # stepped with the call as the rollout would parse it from these ids
        step = host.checked_step(env, *H.run_call(env, host.parse_call(chat.tools, decode_text(chat.tokenizer, call))))
        reward += step.reward
        if step.done:
            truncated = False
            break
        if turn + 1 == turns:
            break
        response = chat.response_ids(chat.encode(step.text)[:cut], add_turn_end=False)
        if len(ids) + len(response) + max_new_tokens > length:
            break
        ids, loss = ids + response, loss + [False] * len(response)
    info = host.checked_info(env, truncated)
    return TeacherEpisode(ids, loss, env.truncation_reward if truncated else reward, info)


def teacher_batch(episodes: list[TeacherEpisode], length: int, pad_id: int, length_bucket: int = 0) -> TrainBatch:
    """The episodes as one supervised batch `[B, length]` (loss on the calls only); with `length_bucket` `[B, W]`,
    W the longest episode rounded up the `bucketed_length` ladder (what trimming the full batch would give, built
    at that width on the host)."""
    if length_bucket:
        length = bucketed_length(max(len(ep.ids) for ep in episodes), length, length_bucket)
    tokens = np.full((len(episodes), length), pad_id, np.int32)
    valid, mask = np.zeros(tokens.shape, bool), np.zeros(tokens.shape, bool)
    for b, ep in enumerate(episodes):
        tokens[b, : len(ep.ids)], valid[b, : len(ep.ids)], mask[b, : len(ep.ids)] = ep.ids, True, ep.loss
    return TrainBatch(
        tokens=jnp.asarray(tokens),
        valid=jnp.asarray(valid),
        loss_mask=jnp.asarray(mask),
        old_logp=jnp.zeros(tokens.shape, jnp.float32),
        advantages=jnp.zeros(tokens.shape[:1], jnp.float32),
    )


def teacher_figures(episodes: list[TeacherEpisode]) -> dict:
    """The teacher's mean reward and the means of its `episode_info`."""
    info = {k: np.array([ep.info[k] for ep in episodes]) for k in (episodes[0].info if episodes else {})}
    return {
        "mean_reward": float(np.mean([ep.reward for ep in episodes])),
        **interface.summarize(host_envs.HostStageEnv(None), info),
    }


@dataclasses.dataclass(frozen=True)
class _Play:
    """How a run's config plays the teacher: the chat pieces and the rollout's limits."""

    env_class: type
    chat: H.HostChat
    turns: int
    length: int
    max_new_tokens: int
    cut: int

    def episodes(self, tasks, rng) -> list[TeacherEpisode]:
        kwargs = dict(turns=self.turns, length=self.length, max_new_tokens=self.max_new_tokens, cut=self.cut)
        return [play_teacher(self.env_class, task, rng, self.chat, **kwargs) for task in tasks]


def _play(config, tokenizer, vocab_size: int, env_class) -> _Play:
    config = run_config.load(config)
    rc = config.rollout_config()
    chat = host_envs.cached_chat(env_class, tokenizer, vocab_size)
    settings = types.SimpleNamespace(rollout_config=rc, host_config=host_envs.host_config(config))
    turns = H.num_turns([env_class()], rc)
    length = config.sft.max_length or H.conversation_length(chat, settings, turns)
    return _Play(env_class, chat, turns, length, rc.max_new_tokens, config.rollout.host_max_response_tokens)


def check_teacher(config, tokenizer, env_class) -> None:
    """One teacher episode before anything is written: an environment without a teacher, or whose calls do not fit
    a turn, is a ConfigError naming the flag."""
    config = run_config.load(config)
    if config.sft.soft_targets:
        raise ConfigError("--config.sft.soft_targets=True: host environments train on the teacher's calls only")
    play = _play(config, tokenizer, len(tokenizer), env_class)
    try:
        play.episodes(env_class.eval_tasks(1), np.random.default_rng(0))
    except NotImplementedError as error:
        raise ConfigError(
            f"--config.sft.num_steps={config.sft.num_steps}: {error}; set --config.sft.num_steps=0 or define "
            "teacher(self, rng) on the environment"
        ) from None
    except ValueError as error:  # an option the teacher rejects (ConfigError passes as it is)
        raise as_config_error(error) from None


def warm_start(config, model_config, params, tokenizer, key: jax.Array, env_class, *, layout=None, log=None):
    """`sft.num_steps` supervised steps on the host teacher's conversations (`warmstart.warm_start` for a host
    environment); returns the fields of its `warmstart.WarmStartResult`, the student's and the teacher's held-out
    figures among them."""
    run = run_config.load(config)
    s = run.sft
    play = _play(run, tokenizer, model_config.vocab_size, env_class)
    state, step_fn, place = sft.supervised_trainer(s, params, model_config, key, layout)
    t0, nll, seen, eval_seconds = time.time(), float("nan"), [], 0.0
    rng = host_envs.numpy_rng(key)
    for index in (bar := hosts.progress(int(s.num_steps), desc="warm start")):
        episodes = play.episodes([env_class.sample_task(rng) for _ in range(s.batch_size)], rng)
        seen += episodes
        batch = teacher_batch(episodes, play.length, play.chat.pad_id, run.rl.length_bucket)
        state, metrics = step_fn(state, place(batch))
        nll = float(metrics["nll"])
        row = {"sft/nll": nll}
        if s.eval_every and (index + 1) % s.eval_every == 0 and index + 1 < s.num_steps:
            t_eval = time.time()
            row.update(_student(run, model_config, tokenizer, state.params))
            eval_seconds += time.time() - t_eval
        if log is not None and index + 1 < s.num_steps:
            log(index + 1, row)
        bar.set_postfix(nll=f"{nll:.3f}")
    t_eval = time.time()
    student = _student(run, model_config, tokenizer, state.params)
    eval_seconds += time.time() - t_eval
    teacher = teacher_figures(play.episodes(env_class.eval_tasks(run.rollout.host_eval_episodes), rng))
    if log is not None and s.num_steps:
        log(int(s.num_steps), {"sft/nll": nll, **student, **{f"teacher/heldout/{k}": v for k, v in teacher.items()}})
    _say_side_by_side(student, teacher)
    return dict(
        params=state.params,
        final_nll=nll,
        seconds=time.time() - t0 - eval_seconds,
        teacher={**{f"heldout/{k}": v for k, v in teacher.items()}, **_prefixed(teacher_figures(seen), "train/")},
        evaluated=dict(student, eval_seconds=eval_seconds),
    )


def _prefixed(figures: dict, prefix: str) -> dict:
    return {f"{prefix}{k}": v for k, v in figures.items()}


def _student(run, model_config, tokenizer, params) -> dict:
    """The student's greedy figures on the held-out suite (`eval/heldout/...`)."""
    results = evaluation.evaluate(
        params,
        model_config,
        tokenizer,
        run,
        [host_envs.HELDOUT],
        key=jax.random.PRNGKey(run.seed + 1),
        show_progress=False,
    )
    return evaluation.flat_figures(results, prefix="eval/")


def _say_side_by_side(student: dict, teacher: dict) -> None:
    """One line each: the student's and the teacher's held-out figures, and a warning when the student is far
    below the teacher."""
    names = [k for k in teacher if f"eval/{host_envs.HELDOUT}/{k}" in student]
    hosts.say("Warm start, held-out suite (student greedy | teacher):")
    for name in names:
        hosts.say(f"  {name}: {student[f'eval/{host_envs.HELDOUT}/{name}']:.3f} | {teacher[name]:.3f}")
    ours, theirs = student.get(f"eval/{host_envs.HELDOUT}/mean_reward", 0.0), teacher["mean_reward"]
    if theirs > 0 and ours < 0.5 * theirs:
        hosts.say(f"Warning: the student's mean reward {ours:.3f} is under half the teacher's {theirs:.3f}")
