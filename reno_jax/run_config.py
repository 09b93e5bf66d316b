"""The run config, typed: one frozen dataclass per section, each field with its default, its meaning and its check.

ml_collections files in `configs/` stay the way to write an experiment (and `--config.x.y=...` overrides); the
library reads them once through `load`, which rejects unknown fields and values of the wrong type and runs every
check below, each raising `ConfigError` naming the flag. Everything after that reads typed values
(`config.rl.max_logp_shift`); the defaults live here only (`configs/base.py` is `default_config_dict()`).

    config = run_config.load(ml_collections_config)       # RunConfig, or ConfigError("--config.rl.x must be ...")
    config.rollout.rollout_config()                        # the rollout's static RolloutConfig
    config.learner_config()                                # the learner's static LearnerConfig

The `env` section is the environment's own (a ConfigDict handed to its registry factories, checked by building
the environment: `reno_jax.loop.config.check_env`), and so is the warm start's `sft.env` (fields replacing
`env`'s). `curriculum` holds the stages' overrides (`reno_jax.loop.curriculum`).

A saved run's `config.json` from older code is read through `upgrade` first: fields it lacks get the value the
code of its time used for them (`LEGACY_DEFAULTS` where that differs from today's default).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import ml_collections

from reno_jax.errors import ConfigError
from reno_jax.models import lora as lora_lib
from reno_jax.parallel.mesh import MeshConfig
from reno_jax.rl import learner as learner_lib
from reno_jax.rl import losses
from reno_jax.rollout import rollout as rollout_lib

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}
QUANTIZE = ("", "int8")  # `model.quantize`: the frozen base of a LoRA run in float, or int8 weight-only
OPTIMIZER_STATE_DTYPES = ("float32", "bfloat16", "int8")
CACHE_DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("shipped", "env")  # `model.tokenizer` (a directory goes in `model.tokenizer_path`)

_ROLLOUT = rollout_lib.RolloutConfig()
_LEARNER = learner_lib.LearnerConfig(group_size=1)
_LORA = lora_lib.LoraConfig()


def _field(default: Any, doc: str, check: Callable[[Any], bool] | None = None, expected: str = ""):
    """A config field: its default, a one-line `doc`, and a single-field `check` (`expected` says what passes)."""
    metadata = {"doc": doc, "check": check, "expected": expected}
    if isinstance(default, (dict, ml_collections.ConfigDict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _at_least(low):
    return lambda v: v >= low


_INT_GE1 = (_at_least(1), "an integer >= 1")
_NUM_GE0 = (_at_least(0), "a number >= 0")


@dataclasses.dataclass(frozen=True)
class TinyArchitecture:
    """The embedded tiny Ling-3.0 (bailing_hybrid) architecture: every layer kind (KDA, gated MLA, dense SwiGLU MLP,
    MoE with a shared expert); `Ling3Config` fields (the vocabulary is the tokenizer's)."""

    hidden_size: int = _field(64, "model width")
    intermediate_size: int = _field(128, "dense SwiGLU MLP width")
    num_hidden_layers: int = _field(2, "layers: groups of KDA layers then one MLA layer (a short tail is MLA)")
    layer_group_size: int = _field(2, "layers per group (KDA layers then one MLA layer)")
    num_attention_heads: int = _field(4, "attention heads")
    head_dim: int = _field(16, "KDA head width")
    first_k_dense_replace: int = _field(1, "the first layers with a dense SwiGLU MLP, the rest MoE")
    num_experts: int = _field(4, "routed experts per MoE layer")
    num_experts_per_tok: int = _field(2, "experts each token is routed to")
    n_group: int = _field(1, "expert groups (group-limited routing)")
    topk_group: int = _field(1, "groups each token may route into")
    moe_intermediate_size: int = _field(64, "routed expert width")
    moe_shared_expert_intermediate_size: int = _field(64, "shared expert width")
    num_shared_experts: int = _field(1, "shared experts per MoE layer")
    q_lora_rank: int = _field(32, "MLA query low-rank width")
    kv_lora_rank: int = _field(32, "MLA key/value low-rank width")
    qk_nope_head_dim: int = _field(16, "MLA query/key head width without rotary")
    qk_rope_head_dim: int = _field(8, "MLA rotary head width")
    v_head_dim: int = _field(16, "MLA value head width")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    path: str = _field("", "a local HF directory to start from ('': draw the tiny model below)")
    dtype: str = _field("float32", "parameter dtype", lambda v: v in DTYPES, f"one of {sorted(DTYPES)}")
    tokenizer_path: str = _field("", "tokenizer directory ('': model.path's, else model.tokenizer's)")
    tokenizer: str = _field(
        "shipped",
        "without a path: 'shipped' (reno_jax/assets) or 'env' (a BPE of the environment's text, saved with the run)",
        lambda v: v in TOKENIZERS,
        f"one of {list(TOKENIZERS)}",
    )
    quantize: str = _field(
        "",
        "'int8': the frozen base of a LoRA run in int8 weight-only (reno_jax/models/quant.py)",
        lambda v: v in QUANTIZE,
        f"one of {list(QUANTIZE)} ('': a float base)",
    )
    tiny: TinyArchitecture = _field(TinyArchitecture(), "the embedded tiny architecture (without model.path)")


@dataclasses.dataclass(frozen=True)
class SftSettings:
    """The supervised warm start on the environment's scripted teacher (`reno_jax.loop.warmstart`)."""

    num_steps: int = _field(0, "warm-start steps (0: none)", _at_least(0), "an integer >= 0 (0: no warm start)")
    batch_size: int = _field(64, "transcripts per step", *_INT_GE1)
    learning_rate: float = _field(
        3e-3, "peak learning rate (warmup, then cosine to `final_lr_fraction` of it)", lambda v: v > 0, "a number > 0"
    )
    warmup_steps: int = _field(10, "linear warmup steps", _at_least(0), "an integer >= 0")
    final_lr_fraction: float = _field(
        0.1,
        "the cosine decay's end as a share of the peak (1: constant after the warmup)",
        lambda v: 0.0 <= v <= 1.0,
        "in [0, 1]",
    )
    decay_steps: int = _field(
        0,
        "0: the cosine runs over every step after the warmup; N: the peak held until the last N steps, then the cosine",
        _at_least(0),
        "an integer >= 0 (0: the cosine over the whole warm start)",
    )
    length_pool: int = _field(
        1,
        "> 1: draw that many batches at once and train them as batches of similar lengths",
        _at_least(1),
        "an integer >= 1 (1: every batch drawn alone)",
    )
    soft_targets: bool = _field(False, "learn from the teacher's whole choice (uniform over its support)")
    eval_every: int = _field(
        0,
        "> 0: the run's evaluation suites every that many warm-start steps",
        _at_least(0),
        "an integer >= 0 (0: never)",
    )
    max_length: int = _field(
        0,
        "transcript length (0: the prompt and every turn's longest call)",
        _at_least(0),
        "an integer >= 0 (0: what the teacher's calls need)",
    )
    compare_episodes: int = _field(
        256,
        "at the end: the student's greedy figures beside the teacher's on this many episodes of the first eval suite",
        _at_least(0),
        "an integer >= 0 (0: no comparison)",
    )
    teacher: str = _field("", "the environment's teacher to imitate ('': its default; the names are the environment's)")
    explore: float = _field(
        0.0, "teacher option: share of the teacher's moves played at random (environments that offer it)"
    )
    forced_weight: float = _field(
        1.0, "teacher option: loss weight of the forced decisions (environments that mark them)"
    )
    wrong_rooms: float = _field(
        0.0,
        "teacher option: share of the rooms on which the teacher plays and teaches only non-optimal moves "
        "(environments that offer it), so that RL has something to find",
        lambda v: 0.0 <= v < 1.0,
        "in [0, 1)",
    )
    env: ml_collections.ConfigDict = _field(ml_collections.ConfigDict(), "fields replacing `env`'s in the warm start")


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    boards_per_step: int = _field(16, "groups (episode starts) rolled out per step", *_INT_GE1)
    group_size: int = _field(8, "samples per start (a GSPO group)", *_INT_GE1)
    max_new_tokens: int = _field(_ROLLOUT.max_new_tokens, "policy tokens per turn", *_INT_GE1)
    max_turns: int = _field(
        0,
        "agent turns per episode (0: the environment's own max_turns(); more is refused)",
        _at_least(0),
        "an integer >= 0 (0: the environment's own bound)",
    )
    max_length: int = _field(
        _ROLLOUT.max_length,
        "conversation length (0: what every episode needs)",
        _at_least(0),
        "an integer >= 0 (0: the length every episode needs)",
    )
    temperature: float = _field(_ROLLOUT.temperature, "sampling temperature", lambda v: v > 0, "a number > 0")
    top_k: int = _field(
        _ROLLOUT.top_k, "sample among the k most likely tokens", _at_least(0), "an integer >= 0 (0: off)"
    )
    top_p: float = _field(_ROLLOUT.top_p, "nucleus sampling mass", lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
    prefill_chunk: int = _field(
        _ROLLOUT.prefill_chunk, "tokens per model call when feeding prompts and responses", *_INT_GE1
    )
    stop_at_tool_call: bool = _field(_ROLLOUT.stop_at_tool_call, "end a turn as soon as '</tool_call>' is complete")
    cache_dtype: str = _field(
        _ROLLOUT.cache_dtype,
        "MLA/conv cache dtype (bfloat16: behaviour log-probs drift)",
        lambda v: v in CACHE_DTYPES,
        "'float32' or 'bfloat16'",
    )
    parse_max_bytes: int = _field(
        0, "bytes of a turn the tool-call parser scans", _at_least(0), "an integer >= 0 (0: no cap)"
    )
    share_prompt_prefill: bool = _field(_ROLLOUT.share_prompt_prefill, "prefill each group's prompt once")
    # Host environments (`reno_jax.envs.host`, played by `reno_jax.rollout.host_rollout`) only:
    host_max_prompt_tokens: int = _field(256, "host env: cap on a first user message's own tokens", *_INT_GE1)
    host_max_response_tokens: int = _field(128, "host env: a tool response's own tokens beyond this are cut", *_INT_GE1)
    host_tool_timeout_s: float = _field(
        30.0, "host env: seconds one turn's tool calls may take", lambda v: v > 0, "a number > 0"
    )
    host_eval_episodes: int = _field(64, "host env: episodes of the held-out suite (`eval_tasks`)", *_INT_GE1)
    history: int = _field(
        -1,
        "-1: a turn sees the whole conversation; k >= 0: bounded history, each turn a sample of the system "
        "prompt, the last k exchanges and the current observation",
        _at_least(-1),
        "an integer >= -1 (-1: the whole conversation)",
    )
    turn_length: int = _field(
        0, "with history >= 0: a turn sample's length (0: what every turn needs)", _at_least(0), "an integer >= 0"
    )

    def rollout_config(
        self, *, greedy: bool = False, group_size: int | None = None, record_routing: bool = False
    ) -> rollout_lib.RolloutConfig:
        """The static `RolloutConfig`; `greedy` and `group_size` override the section (evaluation decodes greedily,
        one episode per start)."""
        return rollout_lib.RolloutConfig(
            max_new_tokens=self.max_new_tokens,
            max_turns=self.max_turns,
            max_length=self.max_length,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            greedy=bool(greedy),
            group_size=int(group_size or self.group_size),
            prefill_chunk=self.prefill_chunk,
            stop_at_tool_call=self.stop_at_tool_call,
            cache_dtype=self.cache_dtype,
            parse_max_bytes=self.parse_max_bytes or None,
            share_prompt_prefill=self.share_prompt_prefill,
            record_routing=bool(record_routing),
            history=None if self.history < 0 else self.history,
            turn_length=self.turn_length,
        )


@dataclasses.dataclass(frozen=True)
class RlSettings:
    loss: str = _field(
        "gspo", "policy loss (reno_jax.rl.losses)", lambda v: v in losses.LOSSES, f"one of {sorted(losses.LOSSES)}"
    )
    eps_low: float = _field(3e-4, "clip range below 1 (clipped losses)", *_NUM_GE0)
    eps_high: float = _field(4e-4, "clip range above 1 (clipped losses)", *_NUM_GE0)
    normalize_adv_std: bool = _field(_LEARNER.normalize_adv_std, "divide group-centred rewards by the group's std")
    turn_advantage_coef: float = _field(
        _LEARNER.turn_advantage_coef,
        "multi-turn credit: weight of each turn's own advantage (needs a token-level loss; 0: off)",
        _at_least(0.0),
        ">= 0 (0: off)",
    )
    turn_discount: float = _field(
        _LEARNER.turn_discount,
        "discount of later turns' rewards in a turn's advantage",
        lambda v: 0.0 < v <= 1.0,
        "in (0, 1]",
    )
    turn_scope: str = _field(
        _LEARNER.turn_scope,
        "turns compared within the 'group' or the whole 'batch'",
        lambda v: v in learner_lib.TURN_SCOPES,
        "'group' or 'batch'",
    )
    turn_weight: str = _field(
        _LEARNER.turn_weight,
        "turn samples: every 'turn' weighs the same, or every 'episode' (its turns share its weight)",
        lambda v: v in learner_lib.TURN_WEIGHTS,
        "'turn' or 'episode'",
    )
    kl_coef: float = _field(0.0, "KL penalty to the behaviour policy", *_NUM_GE0)
    entropy_coef: float = _field(0.0, "entropy bonus on every response token", *_NUM_GE0)
    forking_entropy_coef: float = _field(0.0, "entropy bonus on each response's highest-entropy token(s)", *_NUM_GE0)
    forking_kl_coef: float = _field(0.0, "instead: k3 KL to the warm start on the forking token(s)", *_NUM_GE0)
    forking_top_k: int = _field(1, "forking tokens per response (or turn)", *_INT_GE1)
    forking_per_turn: bool = _field(False, "multi-turn: the forking tokens of every turn, not of every response")
    entropy_top_k: int = _field(
        0,
        "entropies over the k most likely tokens only (renormalised)",
        _at_least(0),
        "an integer >= 0 (0: the full vocabulary)",
    )
    forking_entropy_hold: float = _field(
        _LEARNER.forking_entropy_hold,
        "full forking bonus / KL until this fraction of the run, then linearly to 0 at forking_entropy_end",
    )
    forking_entropy_end: float = _field(_LEARNER.forking_entropy_end, "run fraction where the forking terms reach 0")
    tis_cap: float = _field(0.0, "truncated importance sampling cap on pi_train / pi_rollout (0: off, else >= 1)")
    icepop_low: float = _field(0.0, "IcePop: drop tokens with pi_train / pi_rollout below this (0: no lower bound)")
    icepop_high: float = _field(0.0, "IcePop: ... or above this (0: no upper bound)")
    learning_rate: float = _field(3e-3, "peak learning rate", lambda v: v > 0, "a number > 0")
    end_learning_rate: float = _field(3e-4, "learning rate at the end of the cosine decay", *_NUM_GE0)
    warmup_steps: int = _field(10, "linear warmup updates", _at_least(0), "an integer >= 0")
    weight_decay: float = _field(0.01, "AdamW weight decay", *_NUM_GE0)
    b1: float = _field(0.9, "Adam beta1")
    b2: float = _field(0.999, "Adam beta2")
    clip_norm: float = _field(1.0, "global gradient-norm clip", _at_least(0), "a number >= 0 (0: no clipping)")
    max_logp_shift: float = _field(
        _LEARNER.max_logp_shift,
        "update guard: an update moving the probe groups' "
        "log-probs by more than this (mean |delta| per token) is halved",
        _at_least(0.0),
        ">= 0 (0: off)",
    )
    shift_probe_groups: int = _field(_LEARNER.shift_probe_groups, "groups the update guard scores again")
    num_minibatches: int = _field(_LEARNER.num_minibatches, "optimiser steps per rollout batch", *_INT_GE1)
    num_microbatches: int = _field(_LEARNER.num_microbatches, "gradient accumulation splits per minibatch", *_INT_GE1)
    remat: bool = _field(False, "recompute layers in the backward pass (memory for speed)")
    logits_chunk: int = _field(
        0,
        "> 0: the train step makes the logits this many positions at a time",
        _at_least(0),
        "an integer >= 0 (0: all positions at once)",
    )
    share_prompt_prefix: bool = _field(True, "encode each group's prompt once in the train step (exact)")
    share_common_prefix: bool = _field(
        True, "encode the part every prompt shares once per batch (alone: for turn samples, rollout.history)"
    )
    train_groups: int = _field(
        _LEARNER.train_groups,
        "train on the N groups with the largest reward spread",
        _at_least(0),
        "an integer >= 0 (0: every group)",
    )
    length_bucket: int = _field(
        _LEARNER.length_bucket,
        "> 0: train steps see the batch up to its last real token, rounded up to this x 1, 2, 3, 4, 6, 8, ...",
        _at_least(0),
        "an integer >= 0 (0: train at the full length)",
    )
    row_bucket: int = _field(
        _LEARNER.row_bucket,
        "> 0: train steps see only the rows with policy tokens (turn samples: the turns played), their count rounded "
        "up to a multiple of this",
        _at_least(0),
        "an integer >= 0 (0: every row)",
    )
    optimizer_state_dtype: str = _field(
        "float32",
        "Adam moments' dtype",
        lambda v: v in OPTIMIZER_STATE_DTYPES,
        f"one of {list(OPTIMIZER_STATE_DTYPES)}",
    )
    routing_replay: bool = _field(False, "R3: the train forward replays the rollout's MoE expert choices")
    routing_metrics: bool = _field(False, "record the rollout's routing for train/routing_agreement")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """rank 0: full fine-tuning; rank > 0: RL trains low-rank adapters over a frozen base (reno_jax/models/lora.py)."""

    rank: int = _field(
        _LORA.rank, "adapter rank (0: full fine-tuning)", _at_least(0), "an integer >= 0 (0: full fine-tuning)"
    )
    alpha: float = _field(
        _LORA.alpha, "the adapted weight is W + (alpha / rank) A @ B", lambda v: v > 0, "a number > 0"
    )
    targets: tuple = _field(
        _LORA.targets,
        "weight kinds adapted",
        lambda v: len(v) >= 1 and all(t in lora_lib.ALL_TARGETS for t in v),
        f"a non-empty tuple of {list(lora_lib.ALL_TARGETS)}",
    )
    expert_adapters: str = _field(
        _LORA.expert_adapters,
        "routed experts: 'per_expert' (own A, B) or 'shared'",
        lambda v: v in lora_lib.EXPERT_ADAPTERS,
        f"one of {list(lora_lib.EXPERT_ADAPTERS)}",
    )

    def lora_config(self) -> lora_lib.LoraConfig:
        """The run's `LoraConfig` (the plain default, no adapters, at rank 0)."""
        if not self.rank:
            return lora_lib.LoraConfig()
        return lora_lib.LoraConfig(
            rank=self.rank, alpha=self.alpha, targets=self.targets, expert_adapters=self.expert_adapters
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run: the sections above, the environment's own `env` section and the bookkeeping."""

    seed: int = _field(0, "the run's randomness (model draw, warm start, RL)")
    num_steps: int = _field(100, "GSPO steps (of the main stage)", *_INT_GE1)
    model: ModelSettings = _field(ModelSettings(), "the policy model")
    env: ml_collections.ConfigDict = _field(
        ml_collections.ConfigDict(dict(name="", module="")),
        "the environment's own: env.name, env.module (imported first) and its factories' fields",
    )
    sft: SftSettings = _field(SftSettings(), "the supervised warm start")
    rollout: RolloutSettings = _field(RolloutSettings(), "the rollout")
    rl: RlSettings = _field(RlSettings(), "the RL recipe: loss, regularisers, optimiser, learner")
    lora: LoraSettings = _field(LoraSettings(), "LoRA adapters")
    mesh: MeshConfig = _field(MeshConfig(), "device mesh sizes and sharding preset (all 1: one device)")
    checkpoint_every: int = _field(50, "GSPO steps between checkpoints", *_INT_GE1)
    keep_checkpoints: int = _field(0, "checkpoints kept", _at_least(0), "an integer >= 0 (0: keep every checkpoint)")
    plot_every: int = _field(
        25, "steps between redraws of learning_curves.png", _at_least(0), "an integer >= 0 (0: never)"
    )
    eval_every: int = _field(0, "steps between in-run evaluations", _at_least(0), "an integer >= 0 (0: never)")
    eval_suites: str = _field("", "in-run evaluations' suites, 'a,b' ('': the environment's defaults)")
    curriculum: dict = _field({}, "stages run before the main one: name -> num_steps and the fields they change")

    def to_dict(self) -> dict:
        """Plain nested dicts (the JSON of `config.json`, the input of `load`)."""
        return as_plain(self)

    def to_config_dict(self) -> ml_collections.ConfigDict:
        """The ConfigDict a `configs/` file starts from (`--config.x.y` overrides keep each field's type)."""
        return ml_collections.ConfigDict(self.to_dict())

    def records_routing(self) -> bool:
        """Whether the rollout records its MoE routing: for routing replay or only for the routing metric."""
        return self.rl.routing_replay or self.rl.routing_metrics

    def rollout_config(self, *, greedy: bool = False, group_size: int | None = None) -> rollout_lib.RolloutConfig:
        return self.rollout.rollout_config(greedy=greedy, group_size=group_size, record_routing=self.records_routing())

    def learner_config(self, step_offset: int = 0) -> learner_lib.LearnerConfig:
        """The `LearnerConfig` (the forking schedule is fed to the loss whenever a forking term is on).
        `step_offset`: the steps of the curriculum stages before this one."""
        r = self.rl
        return learner_lib.LearnerConfig(
            group_size=self.rollout.group_size,
            train_groups=r.train_groups,
            normalize_adv_std=r.normalize_adv_std,
            forking_schedule=bool(r.forking_entropy_coef or r.forking_kl_coef),
            num_steps=self.num_steps,
            forking_entropy_hold=r.forking_entropy_hold,
            forking_entropy_end=r.forking_entropy_end,
            share_prompt_prefix=r.share_prompt_prefix,
            share_common_prefix=r.share_common_prefix,
            num_minibatches=r.num_minibatches,
            num_microbatches=r.num_microbatches,
            max_logp_shift=r.max_logp_shift,
            shift_probe_groups=r.shift_probe_groups,
            step_offset=int(step_offset),
            turn_advantage_coef=r.turn_advantage_coef,
            turn_discount=r.turn_discount,
            turn_scope=r.turn_scope,
            turn_weight=r.turn_weight,
            length_bucket=r.length_bucket,
            row_bucket=r.row_bucket,
        )


def default_config_dict() -> ml_collections.ConfigDict:
    """Every field at its library default, as a ConfigDict (`configs/base.py`)."""
    return RunConfig().to_config_dict()


def as_plain(value):
    """`value` (a RunConfig, a section, a ConfigDict) as plain nested dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, ml_collections.ConfigDict):
        return as_plain(value.to_dict())
    if isinstance(value, Mapping):
        return {str(k): as_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_plain(v) for v in value]
    return value


# --- loading -------------------------------------------------------------------------------------------------------


def load(config) -> RunConfig:
    """The typed, checked `RunConfig` of a ConfigDict or dict (a `RunConfig` is returned as it is).

    Unknown fields, values of the wrong type and values a field's check rejects raise `ConfigError` naming the
    flag; so do the cross-field rules of `check`. Numbers are coerced to the field's type (an int where a float
    is expected), nothing else is.
    """
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, ml_collections.ConfigDict):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ConfigError(f"a run config must be a ConfigDict or a dict, got {type(config).__name__}")
    run = _build(RunConfig, config, "")
    check(run)
    return run


def _build(cls, values: Mapping, prefix: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        where = f"the {prefix[:-1]} section" if prefix else "the config"
        raise ConfigError(f"--config.{prefix}{unknown[0]}: {where} has no such field (it has: {', '.join(known)})")
    hints = typing.get_type_hints(cls)
    fields = {}
    for name, value in values.items():
        fields[name] = _coerce(hints[name], value, f"{prefix}{name}")
        spec = known[name].metadata
        if spec.get("check") is not None:
            try:
                good = bool(spec["check"](fields[name]))
            except TypeError:
                good = False
            if not good:
                raise ConfigError(f"--config.{prefix}{name} must be {spec['expected']}, got {fields[name]!r}")
    return cls(**fields)


def _coerce(kind, value, path: str):
    if dataclasses.is_dataclass(kind):
        if isinstance(value, kind):
            return value
        if not isinstance(value, (Mapping, ml_collections.ConfigDict)):
            raise ConfigError(f"--config.{path} must be a section, got {value!r}")
        return _build(kind, dict(value), path + ".")
    if kind is ml_collections.ConfigDict:
        if not isinstance(value, (Mapping, ml_collections.ConfigDict)):
            raise ConfigError(f"--config.{path} must be a section, got {value!r}")
        return ml_collections.ConfigDict(as_plain(value))
    if kind is dict:
        if not isinstance(value, (Mapping, ml_collections.ConfigDict)):
            raise ConfigError(f"--config.{path} must be a section, got {value!r}")
        return as_plain(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"--config.{path} must be True or False, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"--config.{path} must be an integer, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"--config.{path} must be a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"--config.{path} must be a string, got {value!r}")
        return value
    if kind is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"--config.{path} must be a tuple, got {value!r}")
        return tuple(value)
    raise TypeError(f"no coercion for {path}: {kind}")  # a field of a type this loader does not know


# --- cross-field checks --------------------------------------------------------------------------------------------


def check(config: RunConfig) -> None:
    """The rules that tie fields together (each single field is checked by `load`); raises `ConfigError`."""
    r, rollout = config.rl, config.rollout
    if config.model.tokenizer == "env" and (config.model.path or config.model.tokenizer_path):
        given = "--config.model.path" if config.model.path else "--config.model.tokenizer_path"
        raise ConfigError(
            f"--config.model.tokenizer=env builds a tokenizer for the drawn tiny model; {given} names one already "
            "(a pretrained model's vocabulary is its own): leave --config.model.tokenizer=shipped"
        )
    if config.model.quantize and not config.lora.rank:
        raise ConfigError(
            f"--config.model.quantize={config.model.quantize} needs --config.lora.rank > 0: an int8 "
            "base is frozen, so only LoRA adapters can be trained over it"
        )
    sft_steps = config.sft.num_steps - min(config.sft.warmup_steps, config.sft.num_steps)
    if config.sft.decay_steps > sft_steps:
        raise ConfigError(
            f"--config.sft.decay_steps={config.sft.decay_steps} is more than the {sft_steps} warm-start steps after "
            "the warmup (sft.num_steps - sft.warmup_steps)"
        )
    groups = rollout.boards_per_step
    trained = r.train_groups or groups
    if trained > groups:
        raise ConfigError(
            f"--config.rl.train_groups={trained} is more than the "
            f"--config.rollout.boards_per_step={groups} groups rolled out per step"
        )
    if rollout.history >= 0 and r.share_prompt_prefix:
        raise ConfigError(
            f"--config.rollout.history={rollout.history} trains on turn samples, whose group does not share a "
            "prompt: set --config.rl.share_prompt_prefix=False (--config.rl.share_common_prefix=True alone still "
            "encodes the system prompt they share once per train step)"
        )
    if r.max_logp_shift and r.shift_probe_groups < 1:
        raise ConfigError(f"--config.rl.shift_probe_groups must be >= 1, got {r.shift_probe_groups}")
    splits = r.num_minibatches * r.num_microbatches
    rows = trained * rollout.group_size
    if rows % splits:
        raise ConfigError(
            f"the {rows} trained rows per step (groups {trained} x --config.rollout.group_size="
            f"{rollout.group_size}) are not divisible by --config.rl.num_minibatches x "
            f"--config.rl.num_microbatches = {splits}"
        )
    if r.row_bucket and (r.row_bucket % splits or r.share_prompt_prefix):
        raise ConfigError(
            f"--config.rl.row_bucket={r.row_bucket} must be a multiple of --config.rl.num_minibatches x "
            f"--config.rl.num_microbatches = {splits}, without --config.rl.share_prompt_prefix (whose micro-batches "
            "hold whole groups)"
        )
    if config.sft.length_pool > 1 and not r.length_bucket:
        raise ConfigError(
            f"--config.sft.length_pool={config.sft.length_pool} needs --config.rl.length_bucket > 0 "
            "(without it every batch is padded to the whole conversation length, sorted by length or "
            "not)"
        )
    if r.turn_advantage_coef and r.loss == "gspo" and rollout.history < 0:  # turn samples: one per row
        raise ConfigError(
            "--config.rl.turn_advantage_coef gives every token its own advantage; --config.rl.loss=gspo "
            "takes one per sequence: use --config.rl.loss=gspo_token (the same loss for sequence "
            "advantages) or a token-level loss"
        )
    if r.forking_entropy_coef and r.forking_kl_coef:
        raise ConfigError(
            "--config.rl.forking_entropy_coef and --config.rl.forking_kl_coef are alternatives: set one of them to 0"
        )
    mismatch_corrections(r)


def mismatch_corrections(r: RlSettings) -> tuple[float, tuple[float, float] | None]:
    """``(tis_cap or 0.0, (icepop_low, icepop_high) or None)``, checked.

    `rl.tis_cap`: 0 = off, else >= 1 (``inf`` allowed). `rl.icepop_low` / `rl.icepop_high`: both 0 = off; a 0 bound
    is open on that side (low 0, high ``inf``); otherwise ``0 < low < 1 < high`` so that on-policy tokens are kept.
    """
    cap = r.tis_cap
    if cap != 0.0 and not cap >= 1.0:  # "not >=" also rejects NaN
        raise ConfigError(
            f"--config.rl.tis_cap must be 0 (off) or >= 1 (a cap below 1 down-weights on-policy tokens), got {cap}"
        )
    low, high = r.icepop_low, r.icepop_high
    if low == 0.0 and high == 0.0:
        return cap, None
    if not (0.0 <= low < 1.0):
        raise ConfigError(f"--config.rl.icepop_low must be 0 (no lower bound) or in (0, 1), got {low}")
    if high != 0.0 and not high > 1.0:
        raise ConfigError(f"--config.rl.icepop_high must be 0 (no upper bound) or > 1, got {high}")
    return cap, (low, high if high else math.inf)


# --- saved runs of older code --------------------------------------------------------------------------------------

# Fields a `config.json` of older code may lack, whose value then was not today's default: what that code's
# `config.get(field, default)` used. Every other missing field got the default it still has.
LEGACY_DEFAULTS = {
    "rl.share_prompt_prefix": False,
    "rl.share_common_prefix": False,
    "rollout.max_turns": 1,
}


def upgrade(saved: Mapping) -> RunConfig:
    """The `RunConfig` of a saved run's `config.json` (any age): the fields it lacks get `LEGACY_DEFAULTS` (else
    today's defaults), then it is loaded and checked as any config is."""
    values = as_plain(saved)
    for path, value in LEGACY_DEFAULTS.items():
        *sections, name = path.split(".")
        node = values
        for section in sections:
            node = node.setdefault(section, {})
        node.setdefault(name, value)
    return load(values)
