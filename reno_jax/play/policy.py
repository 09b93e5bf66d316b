"""The model work behind the page: what the policy thinks of a board, and what it plays there.

Two jitted pure functions, each compiled once per model (every board renders to the same padded prompt length,
`spec.prompt_len`, so one program serves all boards and all checkpoints of a run):

* `decision_distribution`: the **heat map**. The canonical call `<tool_call>{"name": "choose_square",
  "arguments": {"square": k}}</tool_call>` tokenises to the same ids for every k except one, the square's token
  (`sft.CallTable.choice_offset`): the decision token. We feed the move-task prompt plus the call's
  tokens before that position and read the next-token distribution there:

      mass  = sum_k p(square token k | prompt, call prefix)        (k = 1..9, the raw mass on the nine squares)
      probs = p(square token k | ...) / mass                       (renormalised over the nine squares, sums to 1)

  `mass` near 1 means the model puts essentially all of its probability on a square token at that point; the rest
  goes to other tokens (a malformed call). With the rollout's temperature 1 and no top-k/top-p, `mass * probs[k]`
  is exactly the probability a sampled rollout that wrote the canonical prefix gives square k.

* `model_reply`: the model's own answer through the real rollout path (`rollout.rollout` on the move task with
  one episode: its own prompt, its own generated text, the jitted tool-call parser and the environment's verdict).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.loop import build
from reno_jax.envs.tictactoe import minimax, wording as text, tool_parser
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.envs.tictactoe import rules as ttt
from reno_jax.protocol import tokenizer as tokenizer_lib
from reno_jax.models import ling3
from reno_jax.play import board_text
from reno_jax.rl import sft
from reno_jax.rollout import rollout as rollout_lib


def decision_tokens(tokenizer, turn_end_id: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """`(prefix int32 [P], square_ids int32 [9])`: the canonical call's tokens before the decision token, and the
    decision token of each square 1..9. Raises `ValueError` when the tokenizer's nine calls do not differ in
    exactly one token (the heat map is then not one next-token distribution)."""
    table = sft.build_call_table(tokenizer, [(text.TOOL_NAME, {"square": k}) for k in range(1, 10)], turn_end_id,
                                 pad_id, [text.TOOL_NAME])
    ids, offset = np.asarray(table.ids), table.choice_offset
    if offset < 0:
        raise ValueError("this tokenizer's nine choose_square calls do not differ in exactly one token; "
                         "the decision-token heat map is undefined")
    return ids[0, :offset].astype(np.int32), ids[:, offset].astype(np.int32)


def decision_distribution(params, spec: text.TextSpec, board: jax.Array, prefix: jax.Array, square_ids: jax.Array,
                          *, model_config: ling3.Ling3Config):
    """`(probs float32 [9], mass float32 [])` at the decision token of the move-task prompt of `board` (see the
    module docstring). The prompt is the rollout's (`text.render_prompt`, side to move from stone counts)."""
    agent = ttt.to_move_from_counts(board)
    prompt, n = text.render_prompt(spec, board, agent, False)
    p = prefix.shape[0]
    tokens = jnp.concatenate([prompt, jnp.full((p,), spec.pad_id, jnp.int32)])
    tokens = jax.lax.dynamic_update_slice(tokens, prefix.astype(jnp.int32), (n,))
    total = n + p
    valid = jnp.arange(tokens.shape[0]) < total  # the pad tail is masked (and after the read position anyway)
    logits, _ = ling3.forward(params, model_config, tokens[None], valid=valid[None])
    logp = jax.nn.log_softmax(logits[0, total - 1].astype(jnp.float32))
    square_p = jnp.exp(logp[square_ids])
    mass = jnp.sum(square_p)
    return square_p / jnp.maximum(mass, 1e-30), mass


def model_reply(params, key: jax.Array, board: jax.Array, env: rollout_lib.CompiledEnv, *,
                model_config: ling3.Ling3Config, rollout_config: rollout_lib.RolloutConfig) -> dict:
    """One move-task episode on `board [9]`: the generated tokens, the parser's verdict and the rollout's info."""
    traj = rollout_lib.rollout(params, key, ttt_env.move_starts(board[None]), model_config=model_config,
                               rollout_config=rollout_config, env=env)
    m = rollout_config.max_new_tokens
    n = traj.info["generated_tokens"][0]
    generated = jax.lax.dynamic_slice(traj.tokens[0], (traj.prompt_length[0],), (m,))
    call = env.parse_batch(generated[None], n[None])
    kind, square = call.kind[0], jnp.where(call.ok[0], call.args[0, 0], 0)
    info = {k: traj.info[k][0] for k in ("outcome", "illegal", "invalid", "is_optimal", "win_taken")}
    return dict(tokens=generated, num_tokens=n, parse_kind=kind.astype(jnp.int32), square=square.astype(jnp.int32),
                reward=traj.reward[0], **info)


def minimax_squares(board: np.ndarray) -> dict:
    """Perfect play on `board`: `optimal` (value-preserving squares, 1..9), `winning` (immediate wins) and the
    position's `value` for the side to move (+1 win, 0 draw, -1 loss)."""
    tables = minimax.tables_numpy()
    code = int((np.asarray(board, np.int64) * 3 ** np.arange(ttt.NUM_SQUARES)).sum())
    return {"optimal": [int(i) + 1 for i in np.flatnonzero(tables["optimal_mask"][code])],
            "winning": [int(i) + 1 for i in np.flatnonzero(tables["winning_mask"][code])],
            "value": int(tables["value"][code])}


def verdict(board: np.ndarray, parse_kind: int, square: int, illegal: bool, invalid: bool,
            board_style: str = "grid") -> dict:
    """What the environment makes of the model's call on `board`, from the rollout's `invalid` / `illegal` flags:
    `verdict` ("legal", "illegal": an occupied square, "invalid": no call, a malformed call or a square outside
    1..9), the chosen `square` (None without a parsed one), `board_after` and the `tool_response` text the game
    environment answers (a refused call loses the game, as in training)."""
    square = int(square) if parse_kind == tool_parser.KIND_OK else None
    if invalid:
        name, status, after = "invalid", text.STATUS_INVALID, board
    elif illegal:
        name, status, after = "illegal", text.STATUS_ILLEGAL, board
    else:
        name = "legal"
        after = board.copy()
        after[square - 1] = board_text.side_to_move(board)
        status = {"x_won": text.STATUS_WIN, "o_won": text.STATUS_WIN, "draw": text.STATUS_DRAW,
                  "ongoing": text.STATUS_ONGOING}[board_text.result(after)]
    return {"verdict": name, "square": square, "parse": tool_parser.KIND_NAMES[parse_kind],
            "board_after": board_text.format_board(after),
            "tool_response": text.tool_response_content(after, 0, status, board_style)}


@dataclasses.dataclass
class Policy:
    """The jitted functions of one run's model, bound to its tokenizer, environment and rollout settings."""

    config: object
    tokenizer: object
    model_config: ling3.Ling3Config

    def __post_init__(self):
        self.env = build.make_compiled_env(self.config, self.tokenizer, self.model_config, task="move")
        prefix, square_ids = decision_tokens(self.tokenizer, self.env.spec.turn_end_id, self.env.spec.pad_id)
        self._prefix, self._square_ids = jnp.asarray(prefix), jnp.asarray(square_ids)
        self._heat = jax.jit(functools.partial(decision_distribution, model_config=self.model_config))
        self._replies = {}  # greedy -> jitted model_reply (the sampled one is only compiled when asked for)

    def _reply_fn(self, greedy: bool):
        if greedy not in self._replies:
            rc = build.rollout_config(self.config, greedy=greedy, group_size=1)
            self._replies[greedy] = jax.jit(functools.partial(model_reply, model_config=self.model_config,
                                                              rollout_config=rc))
        return self._replies[greedy]

    def heat_map(self, params, board: np.ndarray) -> dict:
        probs, mass = self._heat(params, self.env.spec, jnp.asarray(board, jnp.int8), self._prefix, self._square_ids)
        return {"probs": [float(p) for p in np.asarray(probs)], "mass": float(mass)}

    def reply(self, params, board: np.ndarray, *, greedy: bool = True, seed: int = 0) -> dict:
        """The model's move on `board` (its side is the side to move) as host values, with the tool response the
        environment gives for it."""
        out = jax.device_get(self._reply_fn(greedy)(params, jax.random.PRNGKey(seed), jnp.asarray(board, jnp.int8),
                                                    self.env))
        ids = np.asarray(out["tokens"])[: int(out["num_tokens"])]
        return {
            "text": tokenizer_lib.decode(self.tokenizer, ids.tolist()),
            **verdict(board, int(out["parse_kind"]), int(out["square"]), bool(out["illegal"]), bool(out["invalid"]),
                      self.env.env.board_style),
            "reward": float(out["reward"]),
            "is_optimal": bool(out["is_optimal"]),
            "greedy": greedy,
        }
