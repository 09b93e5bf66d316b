"""What `model.tokenizer=env` costs and saves: the tokenizer built for an environment against the shipped one.

For a config (default `configs/guess_number_tiny.py`): the time to build the environment's tokenizer (its corpus
rendered from the environment's chat and teacher calls, then the BPE trained and loaded; median of --repeats),
its vocabulary, and with each tokenizer the prompt's length, the teacher's longest call, the conversation length
the rollout pads to (L) and the mean real tokens of --episodes teacher episodes (the warm start's own transcripts,
`rl.sft.env_transcripts`). The last output line is one JSON object.

  python benchmarks/env_tokenizer_cost.py [--config configs/guess_number_tiny.py] [--episodes 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import jax
import numpy as np

from reno_jax import run_config
from reno_jax.loop import build, tokenizers, warmstart
from reno_jax.rl import sft
from reno_jax.rollout import rollout as rollout_lib


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def episode_figures(config, tokenizer, episodes: int) -> dict:
    """Prompt, longest call, L and mean real tokens of `episodes` teacher episodes with `tokenizer`."""
    taught = warmstart.teacher_calls(config, tokenizer, len(tokenizer))
    rc = run_config.load(config).rollout_config()
    turns = rollout_lib.num_turns(taught.env, rc)
    full = rollout_lib.conversation_length(taught.env, rc)
    length = warmstart.transcript_length(taught.env, taught.calls, turns, full)
    starts = build.env_entry(config).make_sampler(run_config.load(config))(jax.random.PRNGKey(1), episodes)
    out = sft.env_transcripts(
        jax.random.PRNGKey(0), starts, taught.env, taught.teacher.policy, taught.calls, max_turns=turns, length=length
    )
    return {
        "vocab": len(tokenizer),
        "prompt_tokens": int(taught.env.prompt_len),
        "longest_call_tokens": int(np.asarray(taught.calls.length).max()),
        "conversation_length": int(full),
        "tokens_per_episode": float(np.asarray(out.valid).sum(axis=1).mean()),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/guess_number_tiny.py")
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    config = load_config(args.config)
    shipped = build.build_tokenizer(config)
    config.model.tokenizer = "env"
    seconds = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        own = tokenizers.config_tokenizer(config)
        seconds.append(time.perf_counter() - t0)
    result = {
        "config": args.config,
        "build_seconds_median": statistics.median(seconds),
        "shipped": episode_figures(config, shipped, args.episodes),
        "env": episode_figures(config, own, args.episodes),
    }
    result["episode_tokens_ratio"] = result["shipped"]["tokens_per_episode"] / result["env"]["tokens_per_episode"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
