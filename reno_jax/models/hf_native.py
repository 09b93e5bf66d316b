"""How transformers' native `BailingHybridForCausalLM` reads a checkpoint written by `save_pretrained`.

Used by tests/test_conversion.py and benchmarks/hf_parity.py to check that an export loads in other engines as it
does here: `native_schedule` needs only transformers' configuration class (no PyTorch); `compare_logits` runs
the native PyTorch model, so it needs torch (the `bench` extra, not a runtime dependency).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.models import conversion, ling3


def native_schedule(hf_dir: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(layer_types, mlp_layer_types) as transformers' `BailingHybridConfig` builds them from `hf_dir`."""
    from transformers import BailingHybridConfig

    native = BailingHybridConfig.from_pretrained(str(hf_dir))
    return list(native.layer_types), list(native.mlp_layer_types)


def native_logits(hf_dir: str | os.PathLike, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of `BailingHybridForCausalLM` loaded from `hf_dir` (PyTorch, CPU).

    Loading fails (transformers' size-mismatch error) when the native class derives another layer schedule or
    other tensor shapes from the config than the file holds.
    """
    import torch
    from transformers import BailingHybridForCausalLM

    model = BailingHybridForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long), use_cache=False)
    return out.logits.float().numpy()


def our_logits(params: Any, config: Any, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of `ling3.forward` (no cache)."""
    logits, _ = jax.jit(lambda p, x: ling3.forward(p, config, x))(params, jnp.asarray(tokens))
    return np.asarray(logits, np.float32)


def compare_logits(hf_dir: str | os.PathLike, tokens: np.ndarray) -> dict:
    """Loads `hf_dir` here (float32) and natively, runs both on `tokens`; returns the figures of the comparison."""
    config, params = conversion.from_pretrained(hf_dir, dtype=jnp.float32)
    ours = our_logits(params, config, tokens)
    theirs = native_logits(hf_dir, tokens)
    if ours.shape != theirs.shape:
        raise AssertionError(f"logit shapes differ: ours {ours.shape}, transformers {theirs.shape}")
    layer_types, mlp_layer_types = native_schedule(hf_dir)
    return {
        "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
        "max_abs_logit": float(np.abs(ours).max()),
        "tokens_shape": list(np.shape(tokens)),
        "num_hidden_layers": config.num_hidden_layers,
        "layer_group_size": config.layer_group_size,
        "layer_types": layer_types,
        "mlp_layer_types": mlp_layer_types,
        "schedule_matches": (
            layer_types == list(config.resolved_layer_types)
            and mlp_layer_types == list(config.resolved_mlp_layer_types)
        ),
    }
