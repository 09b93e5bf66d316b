"""Throughput of the jitted agent rollout on CPU, against Hugging Face transformers and a host-driven decode loop.

Model: the tiny Ling-3.0 (``bailing_hybrid``) architecture of ``configs/tictactoe_tiny.py`` (3 layers: KDA, MLA, MLA
-- the last one an incomplete group of 2 -- dense MLP then MoE), random weights, vocabulary of the shipped
tokenizer. Task: the ``move`` task (prompt of the chat template, one tool call of at most --new_tokens tokens,
parse, reward), B = --groups x 8 episodes.

Variants, all with the same batch, the same prompts (one length) and the same number of new tokens, sampling at
temperature 1 without top-k/top-p:
  rollout          ``reno_jax.rollout.rollout.rollout`` jitted whole: in-jit prompt rendering, chunked prefill,
                   ``lax.while_loop`` decode with per-row stop detection, parse, move reward. Counts the tokens the
                   episodes really generated (a row stops early on a sampled turn-end token). The 8 episodes of a
                   group share their prompt, which is prefilled once per group (``share_prompt_prefill``).
  rollout_unshared the same with ``share_prompt_prefill=False`` (every episode prefills its own prompt, like the
                   baselines below).
  jax_generate     ``reno_jax.rollout.generate.generate``: jitted prefill + a fixed number of decode steps, no env.
  host_loop        a Python loop calling a jitted single decode step per token (cache donated) after one jitted
                   prefill call: what a rollout without in-jit control flow costs.
  transformers     ``transformers.BailingHybridForCausalLM`` (PyTorch, CPU) loading the same weights written by
                   ``conversion.save_pretrained``, ``generate(do_sample=True, min_new_tokens = max_new_tokens = N)``.
                   Needs ``pip install torch==2.13.0`` (benchmark only); skipped when torch is missing.

Timings are the best of --repeats runs after a warm-up (compile) run; the variants' timed runs are interleaved
round by round, so background load affects them alike. tokens/s = generated tokens / wall second;
episodes/s = B / wall second. The last output line is one JSON object (figures for the first batch size at the top
level, every batch size under "batches").

    python benchmarks/rollout_throughput.py [--batches 64,256] [--new_tokens 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import tictactoe_tiny
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.envs.tictactoe import wording as text
from reno_jax.models import conversion, ling3
from reno_jax.protocol.tokenizer import load_tokenizer
from reno_jax.rollout import generate as gen
from reno_jax.rollout import rollout as R

GROUP = 8


def time_interleaved(runners: dict, repeats: int) -> dict:
    """Warm-up call (compile) of every runner, then `repeats` rounds timing each runner once per round (so
    background load hits all variants alike); returns the best wall time per runner. Runners must block."""
    for fn in runners.values():
        fn()
    best = {name: float("inf") for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def model_config(vocab_size: int) -> ling3.Ling3Config:
    tiny = dict(tictactoe_tiny.get_config().model.tiny)
    return ling3.Ling3Config(vocab_size=vocab_size, **tiny)


def rollout_runner(params, mc, env, boards, new_tokens, share_prompt_prefill=True):
    """The jitted move-task rollout; the runner stores the last Trajectory in `out`."""
    rc = R.RolloutConfig(
        group_size=GROUP, max_new_tokens=new_tokens, prefill_chunk=64, share_prompt_prefill=share_prompt_prefill
    )
    fn = R.make_rollout_fn(mc, rc)
    starts = ttt_env.move_starts(boards)
    out = {}

    def run():
        out["traj"] = jax.block_until_ready(fn(params, jax.random.key(1), starts, env=env))

    return run, out


def jax_generate_runner(params, mc, prompts, new_tokens):
    b, p = prompts.shape
    lengths = jnp.full((b,), p, jnp.int32)
    ids = jnp.asarray(prompts)

    def run():
        jax.block_until_ready(
            gen.generate(params, jax.random.key(2), ids, lengths, model_config=mc, max_new_tokens=new_tokens, chunk=64)
        )

    return run


def host_loop_runner(params, mc, prompts, new_tokens):
    b, p = prompts.shape
    sconf = gen.SamplingConfig()
    active = jnp.ones((b,), bool)
    keys = jax.random.split(jax.random.key(3), b)
    ids = jnp.asarray(prompts)

    @jax.jit
    def prefill(params, ids):
        cache = ling3.init_cache(mc, b, p + new_tokens)
        logits, cache = ling3.forward(params, mc, ids, cache)
        return cache, logits[:, -1]

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(params, cache, last):
        tok, _, cache, logits = gen.decode_step(params, mc, sconf, cache, last, keys, active)
        return tok, cache, logits

    def run():
        cache, last = prefill(params, ids)
        toks = []
        for _ in range(new_tokens):
            tok, cache, last = step(params, cache, last)
            toks.append(tok)
        jax.block_until_ready(toks)

    return run


def load_transformers(params, mc, workdir):
    """(torch, model) for the same weights, or (None, reason) when torch/transformers cannot run it."""
    try:
        import torch
        from transformers import BailingHybridForCausalLM
    except Exception as e:  # torch missing, or a transformers without the model
        return None, f"{type(e).__name__}: {e}"
    conversion.save_pretrained(params, mc, workdir)
    torch.set_num_threads(os.cpu_count() or 1)
    model = BailingHybridForCausalLM.from_pretrained(workdir, dtype=torch.float32)
    model.eval()
    return torch, model


def check_same_model(torch, model, params, mc, prompts):
    """Max |logit difference| of the last prompt position between transformers and ling3.forward."""
    with torch.no_grad():
        hf = model(torch.as_tensor(prompts[:4], dtype=torch.long)).logits[:, -1].float().numpy()
    ours = np.asarray(jax.jit(lambda p, x: ling3.forward(p, mc, x)[0][:, -1])(params, jnp.asarray(prompts[:4])))
    return float(np.abs(hf - ours).max())


def transformers_runner(torch, model, prompts, new_tokens, pad_id):
    ids = torch.as_tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad_id,
                use_cache=True,
            )
        assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens), out.shape

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256", help="comma-separated batch sizes (multiples of 8)")
    ap.add_argument("--new_tokens", type=int, default=24, help="new tokens per episode (max_new_tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip_transformers", action="store_true")
    ap.add_argument("--skip_host_loop", action="store_true")
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    if any(b % GROUP for b in batches):
        raise SystemExit(f"batch sizes must be multiples of the group size {GROUP}")

    tok = load_tokenizer(None)
    mc = model_config(len(tok))
    params = ling3.init_params(mc, jax.random.key(0))
    env = R.compile_env(ttt_env.TicTacToeEnv.create("move"), tok, vocab_size=mc.vocab_size)
    pool = np.asarray(boards_lib.generate_boards(max(batches) // GROUP, seed=0), np.int8)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; model "
        f"{ling3.count_params(mc)['total']} params; new tokens {args.new_tokens}",
        flush=True,
    )

    torch = model = None
    hf_note = "skipped (--skip_transformers)"
    if not args.skip_transformers:
        with tempfile.TemporaryDirectory() as d:
            torch, model = load_transformers(params, mc, d)
        if torch is None:
            hf_note, model = f"skipped ({model})", None
        else:
            hf_note = "ok"

    results = {}
    for b in batches:
        boards = pool[: b // GROUP]
        # The prompts the rollout renders (all move prompts have the same length), repeated per group.
        prompts = np.stack([text.prompt_ids(tok, text.move_task_messages(x)) for x in boards]).astype(np.int32)
        prompts = np.repeat(prompts, GROUP, axis=0)
        r = {"batch": b, "prompt_length": int(prompts.shape[1])}
        run_rollout, out = rollout_runner(params, mc, env, boards, args.new_tokens)
        run_unshared, out_unshared = rollout_runner(params, mc, env, boards, args.new_tokens, False)
        runners = {
            "rollout": run_rollout,
            "rollout_unshared": run_unshared,
            "jax_generate": jax_generate_runner(params, mc, prompts, args.new_tokens),
        }
        if not args.skip_host_loop:
            runners["host_loop"] = host_loop_runner(params, mc, prompts, args.new_tokens)
        if model is not None:
            if b == batches[0]:
                r["logit_max_abs_diff_vs_transformers"] = check_same_model(torch, model, params, mc, prompts)
            runners["transformers"] = transformers_runner(torch, model, prompts, args.new_tokens, env.chat.pad_id)
        sec = time_interleaved(runners, args.repeats)
        traj = out["traj"]
        assert int(np.asarray(traj.prompt_length)[0]) == prompts.shape[1]
        generated = int(np.asarray(traj.info["generated_tokens"]).sum())
        r.update(
            tokens_per_s=generated / sec["rollout"],
            episodes_per_s=b / sec["rollout"],
            rollout_generated_tokens=generated,
        )
        unshared = int(np.asarray(out_unshared["traj"].info["generated_tokens"]).sum())
        r["rollout_unshared_tokens_per_s"] = unshared / sec["rollout_unshared"]
        for name in runners:
            if not name.startswith("rollout"):
                r[f"{name}_tokens_per_s"] = b * args.new_tokens / sec[name]
        if "host_loop" in runners:
            r["ratio_vs_host_loop"] = r["tokens_per_s"] / r["host_loop_tokens_per_s"]
        if "transformers" in runners:
            r["ratio_vs_transformers"] = r["tokens_per_s"] / r["transformers_tokens_per_s"]
        results[b] = r
        print(json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()}), flush=True)

    first = results[batches[0]]
    summary = {
        k: first.get(k)
        for k in (
            "batch",
            "tokens_per_s",
            "episodes_per_s",
            "transformers_tokens_per_s",
            "ratio_vs_transformers",
            "host_loop_tokens_per_s",
            "ratio_vs_host_loop",
            "rollout_unshared_tokens_per_s",
            "jax_generate_tokens_per_s",
            "logit_max_abs_diff_vs_transformers",
        )
    }
    summary["new_tokens"] = args.new_tokens
    summary["transformers"] = hf_note
    summary["batches"] = {str(b): results[b] for b in batches}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
