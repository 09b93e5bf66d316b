"""Batched tic-tac-toe environment throughput: ours vs pgx, and ours with tool-call parse + response render.

Every variant runs the same loop, jitted, over a batch of games (default 4096):

    for each of --steps steps (one ``lax.scan``):
        action = uniform random legal square (``sample_hash``: hashed counter words, one masked max; or
                 ``--sampler jax`` for jax.random bits)
        state  = vmap(step)(state, action)
        auto-reset: finished games are replaced by a fresh start state (``jnp.where`` against a start batch)

Variants:
  ours                  ``reno_jax.envs.tictactoe.rules.step`` (int8 board, bitboard line checks, branch-free).
  ours+parse+render     the chosen square goes through text first, as in a rollout: the pre-tokenized tool call
                        ``<tool_call>{"name": "choose_square", "arguments": {"square": k}}</tool_call>`` for the
                        chosen square is parsed by the jitted token-level DFA parser
                        (``tool_parser.parse_tool_call``), the parsed square is played, and the tool response tokens
                        for the new position are rendered (``text.render_tool_response``).
  pgx                   ``pgx.make("tic_tac_toe")`` (benchmark-only extra: ``pip install pgx``), vmapped ``step``,
                        same action sampler and same auto-reset (one ``init`` batch made up front and reused, so
                        neither env pays for a reset function inside the loop).

steps/s counts environment transitions (batch x steps) per wall-clock second, best of --repeats timed runs after a
warm-up (compile) run; the variants' timed runs are interleaved round by round, so background load affects them
alike. The last output line is one JSON object.

    python benchmarks/env_throughput.py [--batch 4096] [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from reno_jax.envs.tictactoe import rules as ttt

NUM_ACTIONS = 9


def _where_tree(mask, new, old):
    """Per-row select on every leaf: rows with ``mask`` take ``new``."""

    def sel(n, o):
        m = mask.reshape(mask.shape + (1,) * (o.ndim - 1))
        return jnp.where(m, n, o)

    return jax.tree_util.tree_map(sel, new, old)


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser: a cheap, well-mixed bijection on uint32."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _pick(words, legal):
    """Uniform random legal action per row from random ``uint32 [B, 9]`` words.

    Each square's word (top 27 bits) is packed with the square index into one int32 score, so a single ``max``
    gives both the winner and its index (cheaper on CPU than a variadic ``argmax``). Rows with no legal square
    return 15 (never used: finished games are reset before the next draw).
    """
    squares = jnp.arange(NUM_ACTIONS, dtype=jnp.int32)
    scores = jnp.where(legal, (words >> 5).astype(jnp.int32) * 16 + squares, -1)
    return jnp.max(scores, axis=-1) & 15


def sample_hash(rng, legal):
    """Counter-based sampler: ``rng`` is a ``uint32 []`` step counter; words = fmix32(counter stream).

    Far cheaper on CPU than ``jax.random`` (which costs several times the env step itself at this batch size and
    would hide the difference between environments); statistically fine for random play.
    """
    batch = legal.shape[0]
    idx = jnp.arange(batch * NUM_ACTIONS, dtype=jnp.uint32).reshape(batch, NUM_ACTIONS)
    words = _fmix32((rng * jnp.uint32(batch * NUM_ACTIONS) + idx) * jnp.uint32(0x9E3779B9))
    return rng + jnp.uint32(1), _pick(words, legal)


def sample_jax(rng, legal):
    """``jax.random`` sampler: ``rng`` is a PRNG key, split once per step."""
    rng, sub = jax.random.split(rng)
    return rng, _pick(jax.random.bits(sub, legal.shape, jnp.uint32), legal)


SAMPLERS = {"hash": sample_hash, "jax": sample_jax}


def make_runner(legal_fn, step_fn, done_fn, batch: int, steps: int, sampler=sample_hash):
    """Jitted ``run(state, start, rng) -> (state, rng, episodes_finished)`` with the common loop."""

    def run(state, start, rng):
        def body(carry, _):
            state, rng, finished = carry
            rng, action = sampler(rng, legal_fn(state))
            state = step_fn(state, action)
            done = done_fn(state)
            state = _where_tree(done, start, state)
            return (state, rng, finished + jnp.sum(done, dtype=jnp.int32)), None

        (state, rng, finished), _ = jax.lax.scan(body, (state, rng, jnp.int32(0)), None, length=steps)
        return state, rng, finished

    return jax.jit(run)


class Timer:
    """Compiles a runner, then times one run per ``round()``; rounds of all variants are interleaved so that
    load from other processes hits every variant alike."""

    def __init__(self, name, run, start, rng, batch, steps):
        self.name, self.run, self.start, self.batch, self.steps = name, run, start, batch, steps
        t0 = time.perf_counter()
        self.out = jax.block_until_ready(run(start, start, rng))  # compile + warm-up
        self.compile_s = time.perf_counter() - t0
        self.best = float("inf")

    def round(self):
        state, rng, _ = self.out
        t0 = time.perf_counter()
        self.out = jax.block_until_ready(self.run(state, self.start, rng))
        self.best = min(self.best, time.perf_counter() - t0)

    @property
    def steps_per_s(self):
        return self.batch * self.steps / self.best

    @property
    def episodes(self):
        return int(self.out[2])


# ------------------------------------------------------------------------------------------------------------
# Variants
# ------------------------------------------------------------------------------------------------------------


def ours(batch, steps, sampler):
    start = jax.vmap(lambda _: ttt.reset())(jnp.arange(batch))
    run = make_runner(
        legal_fn=lambda s: (s.board == ttt.EMPTY) & ~s.done[:, None],
        step_fn=jax.vmap(ttt.step),
        done_fn=lambda s: s.done,
        batch=batch,
        steps=steps,
        sampler=sampler,
    )
    return run, start


def ours_with_parse_render(batch, steps, sampler, parse=True, render=True):
    """Returns (run, start); raises ImportError/FileNotFoundError if the text side is unavailable.

    ``parse``/``render`` switch the two text stages (both on for the reported variant; ``--breakdown`` times each
    alone).
    """
    from reno_jax.envs.tictactoe import tool_parser
    from reno_jax.envs.tictactoe import wording as text
    from reno_jax.protocol import toolcall
    from reno_jax.protocol.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    tables = tool_parser.build_parser_tables(tok)
    spec = text.build_text_spec(tok)
    # One pre-tokenized call per square: [9, T] ids (right-padded) and lengths [9].
    calls = [
        tok.encode(
            f'<tool_call>{{"name": "choose_square", "arguments": {{"square": {k}}}}}</tool_call>',
            add_special_tokens=False,
        )
        for k in range(1, NUM_ACTIONS + 1)
    ]
    for k, ids in enumerate(calls, start=1):  # the host parser must read each call back as square k
        kind, sq = tool_parser.parse_tool_call_text(tok.decode(ids, skip_special_tokens=False))
        assert (kind, sq) == (toolcall.KIND_OK, k), (k, kind, sq)
    width = max(len(c) for c in calls)
    call_ids = jnp.asarray([c + [spec.pad_id] * (width - len(c)) for c in calls], jnp.int32)
    call_len = jnp.asarray([len(c) for c in calls], jnp.int32)
    # No max_bytes: the parser walks a token-level automaton (one lookup per token); a byte cap would only add
    # the cut-token byte loop, and no call here is long enough to be cut.

    def parse_step_render(state, action):
        if parse:
            ids = call_ids[action]  # [T] tokens the policy "generated"
            kind, square = tool_parser.parse_tool_call(tables, ids, call_len[action])
            # A failed parse is an invalid move (index -1), as the rollout would treat it.
            action = jnp.where(kind == toolcall.KIND_OK, square - 1, -1)
        new = ttt.step(state, action)
        if not render:
            return new, jnp.zeros((1,), jnp.int32), jnp.int32(0)
        status = jnp.where(
            new.invalid,
            text.STATUS_INVALID,
            jnp.where(
                new.done, jnp.where(new.winner != ttt.EMPTY, text.STATUS_WIN, text.STATUS_DRAW), text.STATUS_ONGOING
            ),
        )
        resp_ids, resp_len = text.render_tool_response(spec, new.board, new.last_move + 1, status)
        return new, resp_ids, resp_len

    vstep = jax.vmap(parse_step_render)

    def step_fn(state, action):
        new, resp_ids, resp_len = vstep(state, action)
        # Keep the rendered tokens alive (a rollout would write them into its buffer): fold them into a value the
        # loop carries (adds 0), so XLA cannot drop the render as dead code.
        return new.replace(turn=new.turn + (jnp.sum(resp_ids, axis=-1) + resp_len) % 1)

    start = jax.vmap(lambda _: ttt.reset())(jnp.arange(batch))
    run = make_runner(
        legal_fn=lambda s: (s.board == ttt.EMPTY) & ~s.done[:, None],
        step_fn=step_fn,
        done_fn=lambda s: s.done,
        batch=batch,
        steps=steps,
        sampler=sampler,
    )
    return run, start


def pgx_variant(batch, steps, sampler, key):
    import pgx  # benchmark-only extra

    env = pgx.make("tic_tac_toe")
    start = jax.vmap(env.init)(jax.random.split(key, batch))
    run = make_runner(
        legal_fn=lambda s: s.legal_action_mask,
        step_fn=jax.vmap(env.step),
        done_fn=lambda s: s.terminated,
        batch=batch,
        steps=steps,
        sampler=sampler,
    )
    return run, start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200, help="env steps per timed run (one lax.scan)")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs; the best is reported")
    parser.add_argument(
        "--sampler",
        default="hash",
        choices=sorted(SAMPLERS),
        help="action sampler, the same for every variant: 'hash' (counter-based, cheap) or 'jax' "
        "(jax.random with --prng keys)",
    )
    parser.add_argument("--prng", default="rbg", help="PRNG impl for the 'jax' sampler and pgx's init keys")
    parser.add_argument("--breakdown", action="store_true", help="also time parse-only and render-only variants")
    args = parser.parse_args(argv)

    key = jax.random.key(0, impl=args.prng)
    sampler = SAMPLERS[args.sampler]
    rng = jnp.uint32(0) if args.sampler == "hash" else key
    result = {
        "batch": args.batch,
        "steps": args.steps,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "sampler": args.sampler,
    }

    timers = {}
    run, start = ours(args.batch, args.steps, sampler)
    timers["ours"] = Timer("ours", run, start, rng, args.batch, args.steps)
    try:
        run, start = ours_with_parse_render(args.batch, args.steps, sampler)
    except (ImportError, FileNotFoundError) as e:  # text side not available
        print(f"ours+parse+render: skipped ({e})")
    else:
        timers["ours_with_parse_render"] = Timer("ours+parse+render", run, start, rng, args.batch, args.steps)
        if args.breakdown:
            for name, kw in (("ours_parse_only", dict(render=False)), ("ours_render_only", dict(parse=False))):
                run, start = ours_with_parse_render(args.batch, args.steps, sampler, **kw)
                timers[name] = Timer(name, run, start, rng, args.batch, args.steps)
    try:
        run, start = pgx_variant(args.batch, args.steps, sampler, key)
    except ImportError as e:
        print(f"pgx: skipped (pgx is a benchmark-only extra, `pip install pgx`: {e})")
    else:
        timers["pgx"] = Timer("pgx", run, start, rng, args.batch, args.steps)

    for _ in range(args.repeats):
        for t in timers.values():
            t.round()
    for name in ("ours", "ours_with_parse_render", "pgx", "ours_parse_only", "ours_render_only"):
        t = timers.get(name)
        if t is None and name.endswith("_only"):
            continue
        result[f"{name}_steps_per_s"] = None if t is None else t.steps_per_s
        if t is not None:
            print(
                f"{t.name}: {t.steps_per_s:.3e} steps/s (best {t.best:.3f}s per run, compile {t.compile_s:.1f}s, "
                f"{t.episodes} episodes in the last run)"
            )

    # Same key, same sampler, same start positions: every variant must play the very same games.
    result["same_games"] = len({t.episodes for t in timers.values()}) == 1
    pgx_sps = result["pgx_steps_per_s"]
    for name, key_ in (
        ("ratio_vs_pgx", "ours_steps_per_s"),
        ("ratio_with_parse_render_vs_pgx", "ours_with_parse_render_steps_per_s"),
    ):
        ours_sps = result[key_]
        result[name] = None if (pgx_sps is None or ours_sps is None) else ours_sps / pgx_sps
    print(json.dumps(result))


if __name__ == "__main__":
    main()
