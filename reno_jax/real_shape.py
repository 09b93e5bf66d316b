"""The published GSPO step at Ling-3.0-tiny's real shape on random weights, and how a measurement reads it.

The pieces `benchmarks/real_shape_step.py` (one step: rollout time, train-step time, peak memory),
`benchmarks/gpu_check.py` (the first run on a new GPU) and `benchmarks/sharded_plan.py` (XLA's per-device plans
on a mesh) build their programs from, so the three measure the same programs: random bf16 (or int8 with LoRA)
parameters, the GSPO train step with the published clip range and int8 Adam moments, a synthetic batch of the
rollout's shape, the move task's rollout; and the figures they read off them (bytes of a tree, XLA's memory plan
of a compiled program, the allocator's and the process's peak memory, a timed call).

`args` is the step's settings as the scripts' command lines name them (an `argparse.Namespace`, or any object
with these fields): boards, group_size, max_new_tokens (the rollout's shape), microbatches, state_dtype ("int8",
"bfloat16" or "float32": the Adam moments), remat, entropy, logits_chunk (the train step's logp function),
share_prefix (each group's prompt encoded once), quantize ("" or "int8": the frozen base of a LoRA step). `lc` is
the LoRA of the step (`lora_config`; None: the full fine-tune). The scripts name the setting's config and task
(configs/areno_ling3_tiny.py, the move task's start boards): the library names neither a config nor a game.
"""

from __future__ import annotations

import argparse
import functools
import math
import resource
import time

import jax
import jax.numpy as jnp

from reno_jax.envs import interface
from reno_jax.loop import build
from reno_jax.models import ling3, lora, quant
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.rl import losses, policy, shared_prefix, trainer
from reno_jax.rl.batch import TrainBatch
from reno_jax.rollout import rollout as rollout_lib


def tree_bytes(tree) -> int:
    """Bytes of every leaf of `tree` (arrays or `jax.ShapeDtypeStruct`s)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def peak_bytes() -> int | None:
    """The allocator's peak bytes in use on the first local device; None where it keeps no statistics (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux `ru_maxrss`, KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def lora_config(rank: int, run_config) -> lora.LoraConfig | None:
    """The LoRA block of `run_config` (the published setting's: configs/areno_ling3_tiny.py) at rank `rank`; None
    (rank 0): the full fine-tune."""
    if not rank:
        return None
    run_config = run_config.copy_and_resolve_references()
    run_config.lora.rank = rank
    return build.lora_config(run_config)


def base_params(args, config, key, abstract: bool = False):
    """Random bf16 parameters, int8 with --quantize (quantized leaf by leaf as they are drawn); `abstract`: their
    shapes only (`jax.ShapeDtypeStruct`s, nothing drawn)."""

    def init(k):
        return ling3.init_params(config, k, jnp.bfloat16)

    shapes = jax.eval_shape(init, key)
    if abstract:
        return jax.eval_shape(quant.quantize, shapes) if args.quantize else shapes
    if not args.quantize:
        return init(key)
    kinds = lora.projections(shapes)  # the weights quant.quantize quantizes, by path
    qleaf = jax.jit(quant.quantize_array, static_argnames=("axis",))

    def transform(path, x):
        kind = kinds.get(path)
        return x if kind is None else qleaf(x, axis=quant.quantized_axis(kind))

    return ling3.init_params(config, key, jnp.bfloat16, leaf_transform=transform)


def trained_and_frozen(lc: lora.LoraConfig | None, params, abstract: bool = False):
    """(the tree the train step trains, the frozen tree or None): the params themselves (full fine-tune), or
    fresh adapters over the frozen base `params` (LoRA)."""
    if lc is None:
        return params, None
    init = functools.partial(lora.init_adapters, config=lc)
    key = jax.random.PRNGKey(4)
    return (jax.eval_shape(init, params, key=key) if abstract else init(params, key=key)), params


def model_params(lc: lora.LoraConfig | None, trained, frozen):
    """The params the model runs: `trained`, or the frozen base with the adapters applied in the layers."""
    return trained if lc is None else policy.Adapted(lc)(trained, frozen)


def memory_figures(compiled) -> dict:
    """XLA's memory plan of a compiled program. The estimated peak is arguments + temporaries + outputs not
    aliased to a donated argument (all three are live at the end of the step) + the generated code."""
    m = compiled.memory_analysis()
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "generated_code_bytes": int(m.generated_code_size_in_bytes),
    }
    out["estimated_peak_bytes"] = (
        out["argument_bytes"]
        + out["temp_bytes"]
        + out["output_bytes"]
        - out["alias_bytes"]
        + out["generated_code_bytes"]
    )
    return out


PROMPT_LEN = 63  # the move task's prompt with the shipped tokenizer is about this long


def synthetic_batch(args, config, key):
    """Random tokens of the rollout's shape (prompt + max-new-tokens), every response token trained."""
    rows, length = args.boards * args.group_size, PROMPT_LEN + args.max_new_tokens
    tokens = jax.random.randint(key, (rows, length), 0, config.vocab_size, jnp.int32)
    loss_mask = jnp.broadcast_to(jnp.arange(length) >= PROMPT_LEN, (rows, length))
    old_logp = jnp.where(loss_mask, -math.log(config.vocab_size), 0.0).astype(jnp.float32)
    return argparse.Namespace(
        tokens=tokens,
        valid=jnp.ones((rows, length), bool),
        loss_mask=loss_mask,
        behaviour_logp=old_logp,
        reward=jnp.zeros((rows,), jnp.float32),
        prompt_length=jnp.full((rows,), PROMPT_LEN, jnp.int32),
    )


def make_step(args, config, lc: lora.LoraConfig | None):
    """(optimizer, jitted train step): GSPO, the published clip range, Adam moments in --state-dtype; with LoRA
    the step is `train_step(state, batch, frozen)` over the adapters."""
    optimizer = trainer.make_optimizer(
        1e-8, 1e-9, 0, 400, state_dtype=None if args.state_dtype == "float32" else args.state_dtype
    )
    loss_fn = functools.partial(losses.get_loss("gspo"), eps_low=3e-4, eps_high=4e-4)
    step_fn = trainer.make_train_step(
        policy.make_logp_fn(
            config,
            with_entropy=args.entropy,
            group_size=args.group_size,
            remat=args.remat,
            logits_chunk=args.logits_chunk,
        ),
        loss_fn,
        optimizer,
        num_microbatches=args.microbatches,
        combine=None if lc is None else policy.Adapted(lc),
    )
    return optimizer, step_fn


def train_batch(args, traj, adv, prompt_len: int) -> TrainBatch:
    """The train step's batch of a rollout (or `synthetic_batch`) `traj` with advantages `adv` [rows]; with
    --share-prefix each group's first `prompt_len` tokens split off as its shared prompt."""
    batch = TrainBatch(
        tokens=traj.tokens, valid=traj.valid, loss_mask=traj.loss_mask, old_logp=traj.behaviour_logp, advantages=adv
    )
    if args.share_prefix:
        batch = shared_prefix.split_shared_prefix(batch, prompt_len)
    return batch


def timed(fn, *args):
    """(fn(*args), seconds until its outputs are ready)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def rollout_setup(args, config, task: interface.TextEnv, starts):
    """(jitted rollout fn, key, starts, env) of the one-turn `task` (the published setting's: tic-tac-toe's move
    task) from `starts` (one per board, `args.boards` of them) at the benchmark's shape."""
    tokenizer = tokenizer_lib.load_tokenizer(None)
    env = rollout_lib.compile_env(task, tokenizer, vocab_size=config.vocab_size)
    rc = rollout_lib.RolloutConfig(
        max_new_tokens=args.max_new_tokens, max_turns=1, temperature=1.0, group_size=args.group_size
    )
    return rollout_lib.make_rollout_fn(config, rc), jax.random.PRNGKey(1), starts, env
