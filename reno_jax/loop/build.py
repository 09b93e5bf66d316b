"""Builds an experiment's pieces from its config: tokenizer, model, device layout, environment, rollout settings.

Shared by training, evaluation and the play page, so a checkpoint is always used with exactly the model,
tokenizer and environment it was trained with. `config`: a `run_config.RunConfig` (a ConfigDict or dict is loaded
into one first).
"""

from __future__ import annotations

from typing import Any

import jax

from reno_jax import parallel, run_config
from reno_jax.envs import registry
from reno_jax.errors import ConfigError
from reno_jax.loop import tokenizers
from reno_jax.models import conversion, ling3, lora
from reno_jax.models.config import Ling3Config
from reno_jax.rollout import rollout as rollout_lib

DTYPES = run_config.DTYPES
QUANTIZE = run_config.QUANTIZE


def dtype_of(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def run_keys(config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(key_model, key_sft, key_rl) of `config.seed`: the model's draw, the warm start's, the RL loop's."""
    key_model, key_sft, key_rl = jax.random.split(jax.random.PRNGKey(run_config.load(config).seed), 3)
    return key_model, key_sft, key_rl


def lora_config(config) -> lora.LoraConfig:
    """The run's `lora.LoraConfig` (`LoraSettings.lora_config`; rank 0: full fine-tuning)."""
    return run_config.load(config).lora.lora_config()


def quantization(config) -> str:
    """`model.quantize` ('': a float base)."""
    return run_config.load(config).model.quantize


def build_tokenizer(config):
    """The tokenizer of `config.model.tokenizer_path`, else of `config.model.path`, else the shipped one or the
    environment's own (`model.tokenizer`; `loop.tokenizers`). A saved run's: `tokenizers.run_tokenizer`."""
    return tokenizers.config_tokenizer(config)


def tiny_model_config(config, vocab_size: int) -> Ling3Config:
    """The embedded tiny Ling-3.0 architecture described by `config.model.tiny`."""
    return Ling3Config(**run_config.as_plain(run_config.load(config).model.tiny), vocab_size=vocab_size)


def model_architecture(config, tokenizer) -> Ling3Config:
    """The run's `Ling3Config`: the HF directory's config.json (`config.model.path`; no weights are read), else
    the embedded tiny architecture `config.model.tiny` sized to the tokenizer."""
    config = run_config.load(config)
    if config.model.path:
        return conversion.as_config(conversion.read_config_dict(config.model.path))
    return tiny_model_config(config, len(tokenizer))


def abstract_model(config, tokenizer) -> tuple[Ling3Config, Any]:
    """(model_config, params as `jax.ShapeDtypeStruct`s) of `build_model`, without reading or drawing weights.

    A restore target for checkpoints: `evaluate` and resumed runs need the tree's shapes and dtypes only.
    """
    config = run_config.load(config)
    model_config = model_architecture(config, tokenizer)
    return model_config, conversion.abstract_params(model_config, dtype_of(config.model.dtype))


def build_model(config, key: jax.Array, tokenizer, layout: parallel.Layout | None = None) -> tuple[Ling3Config, Any]:
    """(model_config, params): from the HF directory `config.model.path`, else a fresh tiny model (`key`).

    `layout`: the parameters are read or drawn straight onto its mesh, each device making only its own shards
    (`from_pretrained(shardings=)`, `init_params(shardings=)`); default, or a one-device layout: one device.
    With `model.quantize`, an HF checkpoint is read straight into int8, leaf by leaf (`from_pretrained(quantize=)`);
    a drawn tiny model stays float (it is warm-started before it is quantized).
    """
    config = run_config.load(config)
    dtype = dtype_of(config.model.dtype)
    shardings = None if layout is None or layout.single_device else layout.param_shardings
    if config.model.path:
        return conversion.from_pretrained(
            config.model.path, dtype=dtype, shardings=shardings, quantize=config.model.quantize or None
        )
    model_config = tiny_model_config(config, len(tokenizer))
    return model_config, ling3.init_params(model_config, key, dtype, shardings)


def make_layout(config, model_config: Ling3Config) -> parallel.Layout:
    """The run's device layout from `config.mesh` (absent: one device); errors name the flags and numbers."""
    config = run_config.load(config)
    try:
        layout = parallel.Layout.create(model_config, config.mesh)
        rows = config.rollout.boards_per_step
        parallel.check_batch_divides(rows, layout.mesh, what="--config.rollout.boards_per_step")
    except (parallel.MeshError, parallel.ShardingError) as error:
        raise ConfigError(f"--config.mesh: {error}") from None
    return layout


def env_entry(config) -> registry.Entry:
    """The registry entry of the config's environment (`env.name`, after importing `env.module` when set)."""
    return registry.entry_for(run_config.load(config).env)


def make_env(config, **overrides):
    """The config's `TextEnv`; `overrides` replace `config.env` fields (an evaluation suite's)."""
    return env_entry(config).make_env(run_config.load(config).env, **overrides)


def make_compiled_env(config, tokenizer, model_config, env=None, **overrides) -> rollout_lib.CompiledEnv:
    """The config's environment (or `env`, a `TextEnv` already built) bound to the tokenizer and the model's
    vocabulary (host, once)."""
    env = make_env(config, **overrides) if env is None else env
    return rollout_lib.compile_env(env, tokenizer, vocab_size=model_config.vocab_size)


def rollout_config(config, *, greedy: bool = False, group_size: int | None = None) -> rollout_lib.RolloutConfig:
    """The static `RolloutConfig` of the run (`RunConfig.rollout_config`): `greedy` and `group_size` override the
    config (evaluation decodes greedily, one episode per start)."""
    return run_config.load(config).rollout_config(greedy=greedy, group_size=group_size)
