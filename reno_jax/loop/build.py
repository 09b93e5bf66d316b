"""Builds an experiment's pieces from its config: tokenizer, model, device layout, environment, rollout settings.

Shared by training, evaluation and the play page, so a checkpoint is always used with exactly the model,
tokenizer and environment it was trained with.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from reno_jax import parallel
from reno_jax.envs import registry
from reno_jax.errors import ConfigError
from reno_jax.models import conversion, ling3, lora
from reno_jax.models.config import Ling3Config
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.rollout import rollout as rollout_lib

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}
QUANTIZE = ("", "int8")  # `model.quantize`: the frozen base of a LoRA run in float, or int8 weight-only


def dtype_of(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def run_keys(config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(key_model, key_sft, key_rl) of `config.seed`: the model's draw, the warm start's, the RL loop's."""
    key_model, key_sft, key_rl = jax.random.split(jax.random.PRNGKey(config.seed), 3)
    return key_model, key_sft, key_rl


def lora_config(config) -> lora.LoraConfig:
    """The run's `lora.LoraConfig` from `config.lora` (rank 0, full fine-tuning, for a config without one)."""
    section = config.get("lora", None)
    if not section or not int(section.get("rank", 0)):
        return lora.LoraConfig()
    default = lora.LoraConfig()
    return lora.LoraConfig(rank=int(section.rank), alpha=float(section.get("alpha", default.alpha)),
                           targets=tuple(section.get("targets", default.targets)),
                           expert_adapters=str(section.get("expert_adapters", default.expert_adapters)))


def quantization(config) -> str:
    """`model.quantize` ('' for a config without it)."""
    return str(config.model.get("quantize", "") or "")


def build_tokenizer(config):
    """The tokenizer of `config.model.tokenizer_path`, else of `config.model.path`, else the shipped one."""
    path = config.model.get("tokenizer_path", "") or config.model.get("path", "") or None
    return tokenizer_lib.load_tokenizer(path)


def tiny_model_config(config, vocab_size: int) -> Ling3Config:
    """The embedded tiny Ling-3.0 architecture described by `config.model.tiny`."""
    fields = dict(config.model.tiny)
    fields.setdefault("vocab_size", vocab_size)
    fields["vocab_size"] = max(int(fields["vocab_size"]), vocab_size)
    return Ling3Config(**fields)


def model_architecture(config, tokenizer) -> Ling3Config:
    """The run's `Ling3Config`: the HF directory's config.json (`config.model.path`; no weights are read), else
    the embedded tiny architecture `config.model.tiny` sized to the tokenizer."""
    if config.model.get("path", ""):
        return conversion.as_config(conversion.read_config_dict(config.model.path))
    return tiny_model_config(config, len(tokenizer))


def abstract_model(config, tokenizer) -> tuple[Ling3Config, Any]:
    """(model_config, params as `jax.ShapeDtypeStruct`s) of `build_model`, without reading or drawing weights.

    A restore target for checkpoints: `evaluate` and resumed runs need the tree's shapes and dtypes only.
    """
    model_config = model_architecture(config, tokenizer)
    return model_config, conversion.abstract_params(model_config, dtype_of(config.model.dtype))


def build_model(config, key: jax.Array, tokenizer, layout: parallel.Layout | None = None) -> tuple[Ling3Config, Any]:
    """(model_config, params): from the HF directory `config.model.path`, else a fresh tiny model (`key`).

    `layout`: the parameters are read or drawn straight onto its mesh, each device making only its own shards
    (`from_pretrained(shardings=)`, `init_params(shardings=)`); default, or a one-device layout: one device.
    With `model.quantize`, an HF checkpoint is read straight into int8, leaf by leaf (`from_pretrained(quantize=)`);
    a drawn tiny model stays float (it is warm-started before it is quantized).
    """
    dtype = dtype_of(config.model.dtype)
    shardings = None if layout is None or layout.single_device else layout.param_shardings
    if config.model.get("path", ""):
        return conversion.from_pretrained(config.model.path, dtype=dtype, shardings=shardings,
                                          quantize=quantization(config) or None)
    model_config = tiny_model_config(config, len(tokenizer))
    return model_config, ling3.init_params(model_config, key, dtype, shardings)


def make_layout(config, model_config: Ling3Config) -> parallel.Layout:
    """The run's device layout from `config.mesh` (absent: one device); errors name the flags and numbers."""
    mesh_config = parallel.MeshConfig.from_config(config.get("mesh"))
    try:
        layout = parallel.Layout.create(model_config, mesh_config)
        rows = int(config.rollout.boards_per_step)
        parallel.check_batch_divides(rows, layout.mesh, what="--config.rollout.boards_per_step")
    except (parallel.MeshError, parallel.ShardingError) as error:
        raise ConfigError(f"--config.mesh: {error}") from None
    return layout


def env_entry(config) -> registry.Entry:
    """The registry entry of the config's environment (`env.name`, after importing `env.module` when set)."""
    return registry.entry_for(config.env)


def make_env(config, **overrides):
    """The config's `TextEnv`; `overrides` replace `config.env` fields (an evaluation suite's)."""
    return env_entry(config).make_env(config.env, **overrides)


def make_compiled_env(config, tokenizer, model_config, env=None, **overrides) -> rollout_lib.CompiledEnv:
    """The config's environment (or `env`, a `TextEnv` already built) bound to the tokenizer and the model's
    vocabulary (host, once)."""
    env = make_env(config, **overrides) if env is None else env
    return rollout_lib.compile_env(env, tokenizer, vocab_size=model_config.vocab_size)


def rollout_config(config, *, greedy: bool = False, group_size: int | None = None) -> rollout_lib.RolloutConfig:
    """The static `RolloutConfig` of `config.rollout` (every field it sets; RolloutConfig's defaults otherwise).

    `greedy` and `group_size` override the config (evaluation decodes greedily, one episode per start).
    `rollout.parse_max_bytes` 0 means no cap.
    """
    r = config.rollout
    defaults = rollout_lib.RolloutConfig()
    parse_max_bytes = int(r.get("parse_max_bytes", 0) or 0)
    return rollout_lib.RolloutConfig(
        max_new_tokens=int(r.max_new_tokens),
        max_turns=int(r.max_turns),
        max_length=int(r.get("max_length", 0)),
        temperature=float(r.temperature),
        top_k=int(r.top_k),
        top_p=float(r.top_p),
        greedy=bool(greedy),
        group_size=int(group_size or r.group_size),
        prefill_chunk=int(r.get("prefill_chunk", defaults.prefill_chunk)),
        stop_at_tool_call=bool(r.get("stop_at_tool_call", defaults.stop_at_tool_call)),
        cache_dtype=str(r.get("cache_dtype", defaults.cache_dtype)),
        parse_max_bytes=parse_max_bytes or None,
        share_prompt_prefill=bool(r.get("share_prompt_prefill", defaults.share_prompt_prefill)),
        record_routing=records_routing(config),
    )


def records_routing(config) -> bool:
    """Whether the rollout records its MoE routing: for routing replay (`rl.routing_replay`) or only for the
    `train/routing_agreement` metric (`rl.routing_metrics`)."""
    return bool(config.rl.get("routing_replay", False) or config.rl.get("routing_metrics", False))
