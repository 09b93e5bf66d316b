"""Logits of an exported checkpoint here and in transformers' native ``BailingHybridForCausalLM`` (PyTorch, CPU).

Without --hf_dir: the default run's tiny architecture (``configs/tictactoe_tiny.py``: 3 layers, layer_group_size 2,
so the last layer is an incomplete group) with random weights, written by ``save_pretrained`` into a temporary
directory. With --hf_dir: a directory written by ``save_pretrained`` or
``python -m experiments.convert_checkpoint --direction=orbax_to_hf``.

Both engines load the directory (we in float32) and run the same tokens without a cache: the move-task prompts of
--batch boards (the text the default run trains on), or --random_tokens ids. The last output line is one JSON
object: max |logit difference|, the largest |logit|, the schedule transformers built, and whether it equals ours.
Needs ``pip install torch==2.13.0`` (the ``bench`` extra).

    python benchmarks/hf_parity.py [--hf_dir DIR] [--batch 4] [--random_tokens 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax
import numpy as np

from configs import tictactoe_tiny
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs.tictactoe import wording as text
from reno_jax.models import conversion, ling3
from reno_jax.models.hf_native import compare_logits
from reno_jax.protocol.tokenizer import load_tokenizer


def default_tiny_config(vocab_size: int) -> ling3.Ling3Config:
    return ling3.Ling3Config(vocab_size=vocab_size, **dict(tictactoe_tiny.get_config().model.tiny))


def prompt_tokens(tok, batch: int, seed: int) -> np.ndarray:
    """The move-task prompts of `batch` boards (all move prompts have one length), [batch, T] int32."""
    boards = np.asarray(boards_lib.generate_boards(batch, seed=seed), np.int8)
    return np.stack([text.prompt_ids(tok, text.move_task_messages(b)) for b in boards]).astype(np.int32)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf_dir", default="", help="exported checkpoint; empty: a random default-tiny model")
    ap.add_argument("--batch", type=int, default=4, help="rows of tokens")
    ap.add_argument("--random_tokens", type=int, default=0, help="N > 0: N random ids per row instead of prompts")
    ap.add_argument("--seed", type=int, default=0, help="weights (random model), boards and random ids")
    args = ap.parse_args(argv)

    tok = load_tokenizer(None)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.hf_dir
        if not hf_dir:
            config = default_tiny_config(len(tok))
            params = ling3.init_params(config, jax.random.key(args.seed))
            hf_dir = os.path.join(tmp, "tiny")
            conversion.save_pretrained(params, config, hf_dir)
        vocab_size = conversion.read_config_dict(hf_dir)["vocab_size"]
        if args.random_tokens > 0:
            rng = np.random.default_rng(args.seed)
            tokens = rng.integers(0, vocab_size, (args.batch, args.random_tokens), dtype=np.int32)
        else:
            tokens = prompt_tokens(tok, args.batch, args.seed)
            if tokens.max() >= vocab_size:
                raise SystemExit(f"the shipped tokenizer's ids exceed vocab_size {vocab_size}: use --random_tokens")
        figures = compare_logits(hf_dir, tokens)
    figures["checkpoint"] = args.hf_dir or "random default tiny (configs/tictactoe_tiny.py)"
    figures["tokens"] = "random ids" if args.random_tokens > 0 else "move-task prompts"
    print(
        f"max |logit diff| {figures['max_abs_logit_diff']:.3g} (largest |logit| {figures['max_abs_logit']:.3g}); "
        f"transformers' schedule {figures['layer_types']} {figures['mlp_layer_types']}",
        flush=True,
    )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
