"""How fast can a model configuration learn tic-tac-toe moves at all? Supervised on correct labels, from scratch.

The RL default learns the move task from its rewards; this probe removes RL from the question: the same model
(any `config.model.tiny` and `config.sft` optimiser settings) is trained with the warm start's loss on
transcripts whose call names a correct square (an immediate win if there is one, else a minimax-optimal move,
drawn uniformly among them each time), on the config's board dataset. Every `--eval_every` steps it reads the
greedy square on all 2423 non-terminal X-to-move positions from one forward pass per board (the logits of the
square token after the fixed call prefix, over the nine square tokens) and prints the optimal-move rate.

    python studies/supervised_probe.py --steps 400 --batch 32
    python studies/supervised_probe.py --set model.tiny.hidden_size=96 --set sft.learning_rate=2e-3

Ends with one JSON line: the rate at every evaluation, the wall time and the parameter count.
"""

from __future__ import annotations

import argparse
import ast
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import tictactoe_tiny
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.envs.tictactoe import minimax, registration, wording
from reno_jax.loop import build
from reno_jax.models import ling3
from reno_jax.rl import policy, sft, trainer
from reno_jax.rl.batch import TrainBatch


def apply_overrides(config, pairs):
    for pair in pairs:
        path, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected dotted.path=value")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        node = config
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[k]
        # `model.tiny` takes any `Ling3Config` field (rope_theta, initializer_range, ...), not only the listed ones.
        if keys[-1] not in node and keys[:-1] != ["model", "tiny"]:
            raise SystemExit(f"--set {pair!r}: config has no field {path}")
        node[keys[-1]] = value
    return config


def correct_squares(table: dict, boards: np.ndarray) -> np.ndarray:
    """bool [N, 9]: immediate wins where any, else the minimax-optimal moves."""
    codes = boards_lib.board_code_np(boards)
    win = table["winning_mask"][codes]
    opt = table["optimal_mask"][codes]
    return np.where(win.any(-1, keepdims=True), win, opt)


def correct_square_teacher(table: dict):
    """A tic-tac-toe teacher (`interface.Teacher.policy`, the call rows of `registration.make_teacher`) that plays
    uniformly among `correct_squares` instead of among the legal ones."""
    win = jnp.asarray(table["winning_mask"])
    opt = jnp.asarray(table["optimal_mask"])
    powers = jnp.asarray(3 ** np.arange(9), jnp.int32)

    def teacher(state, key):
        code = jnp.sum(state.board.astype(jnp.int32) * powers)
        correct = jnp.where(win[code].any(), win[code], opt[code])
        noise = jax.random.uniform(key, correct.shape)
        return jnp.argmax(jnp.where(correct, noise, -1.0)).astype(jnp.int32), correct

    return teacher


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="config override, e.g. model.tiny.num_hidden_layers=4 (repeatable)",
    )
    args = parser.parse_args(argv)
    config = apply_overrides(tictactoe_tiny.get_config(), args.set)

    tokenizer = build.build_tokenizer(config)
    key = jax.random.PRNGKey(args.seed)
    model_config, params = build.build_model(config, key, tokenizer)
    n_params = ling3.count_params(model_config)["total"]
    env = build.make_compiled_env(config, tokenizer, model_config)
    pad = env.pad_id
    train_boards, _ = boards_lib.load_boards(config.env)
    table = minimax.tables_numpy()
    tool_names = [t["function"]["name"] for t in env.env.chat().tools]
    calls = sft.build_call_table(
        tokenizer, registration.make_teacher(config, env.env).calls, int(env.chat.turn_end_id), pad, tool_names
    )
    if calls.choice_offset < 0:
        raise SystemExit("the tokenizer does not spell each square as one token")
    teacher = correct_square_teacher(table)

    # The call up to (not including) the square's token, and the nine square tokens.
    cut = calls.choice_offset
    call_prefix = np.asarray(calls.ids)[0, :cut].tolist()
    digit_ids = np.asarray(calls.ids)[:, cut]

    eval_boards = boards_lib.exhaustive_positions("x")
    eval_correct = table["optimal_mask"][boards_lib.board_code_np(eval_boards)]
    style = config.env.get("board_style", "grid")
    prompts = [
        wording.prompt_ids(tokenizer, wording.move_task_messages(b, style=style)) + call_prefix for b in eval_boards
    ]
    width = max(len(p) for p in prompts)
    eval_tokens = np.full((len(prompts), width), pad, np.int32)
    eval_valid = np.zeros((len(prompts), width), bool)
    last = np.zeros((len(prompts),), np.int32)
    for i, p in enumerate(prompts):  # right-padded; the square's logits sit at each row's last real position
        eval_tokens[i, : len(p)] = p
        eval_valid[i, : len(p)] = True
        last[i] = len(p) - 1

    @jax.jit
    def square_choice(params, tokens, valid, last):
        logits = ling3.forward(params, model_config, tokens, valid=valid)[0]
        at = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        return jnp.argmax(at[:, digit_ids], axis=-1)

    def evaluate(params):
        picks = []
        for s in range(0, len(eval_tokens), 512):
            picks.append(
                np.asarray(square_choice(params, eval_tokens[s : s + 512], eval_valid[s : s + 512], last[s : s + 512]))
            )
        picks = np.concatenate(picks)
        return float(eval_correct[np.arange(len(picks)), picks].mean())

    s = config.sft
    optimizer = trainer.make_optimizer(
        s.learning_rate,
        s.learning_rate * 0.1,
        min(s.warmup_steps, args.steps),
        args.steps,
        weight_decay=0.0,
        clip_norm=1.0,
    )
    state = trainer.create_train_state(params, optimizer, key)
    step_fn = trainer.make_train_step(policy.make_logp_fn(model_config, with_entropy=False), sft.sft_loss, optimizer)
    length = env.prompt_len + int(np.max(np.asarray(calls.length)))
    rng = np.random.default_rng(args.seed)
    key_play = jax.random.PRNGKey(args.seed + 1)
    curve = {}
    t0 = time.time()
    for step in range(1, args.steps + 1):
        idx = rng.choice(len(train_boards), size=args.batch, replace=True)
        # One turn of the move task, written by stepping the environment: the prompt and a correct square's call.
        out = sft.env_transcripts(
            jax.random.fold_in(key_play, step),
            ttt_env.move_starts(train_boards[idx]),
            env,
            teacher,
            calls,
            max_turns=1,
            length=length,
        )
        if step == 1:  # the teacher's choices are the host's correct squares
            at = np.argmax(np.asarray(out.loss_mask), axis=1) + cut
            support = np.asarray(out.support)[np.arange(len(idx)), at]
            assert (support == correct_squares(table, train_boards[idx])).all()
        feed = TrainBatch(
            tokens=out.tokens,
            valid=out.valid,
            loss_mask=out.loss_mask,
            old_logp=jnp.zeros(out.tokens.shape, jnp.float32),
            advantages=jnp.zeros((len(idx),), jnp.float32),
        )
        state, m = step_fn(state, feed)
        if step % args.eval_every == 0 or step == args.steps:
            rate = evaluate(state.params)
            curve[step] = rate
            print(f"step {step}: nll {float(m['nll']):.3f}  optimal {rate:.3f}  ({time.time() - t0:.0f} s)", flush=True)
    print(
        json.dumps(
            {
                "overrides": args.set,
                "steps": args.steps,
                "batch": args.batch,
                "params": int(n_params),
                "optimal_by_step": curve,
                "seconds": round(time.time() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
