"""Tic-tac-toe's registry entry: the env from a config's `env` section, the step's start records, the warm-start
teacher (a uniformly random legal square: the call format, no strategy), the evaluation suites and the play
page's board (`board_view`).

Suites (greedy, one episode per start; training-only shaping, `suboptimal_penalty` and `win_seeking`, off):

  positions, positions_o, positions_both   the move task on every non-terminal position with X / O / either side
                                           to move (2423 / 2097 / 4520); `positions` is the move task's default
  heldout                                  the move task on the held-out boards (`env.heldout_fraction` > 0)
  minimax, random, epsilon                 whole games against that opponent, the agent X in even episodes and O
                                           in odd ones, with per-side figures (`x/win_rate`, `o/loss_rate`, ...);
                                           minimax and random are the game task's defaults
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface, registry
from reno_jax.envs.tictactoe import board_view, minimax, tasks, wording
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs.tictactoe import env as ttt_env

AGENT_PLAYERS = ("x", "o", "alternate")
GAMES_PER_SUITE = 256
_EVAL_OVERRIDES = {"suboptimal_penalty": 0.0, "win_seeking": False}  # outcomes and minimax grade, not shaping

# (field, test, what is expected): the `env` section's settings.
_CHECKS = (
    ("task", lambda v: v in ttt_env.TASKS, f"one of {list(ttt_env.TASKS)}"),
    ("num_boards", lambda v: v >= 1, "an integer >= 1"),
    ("max_random_moves", lambda v: 0 <= v <= 9, "an integer in [0, 9]"),
    ("board_sides", lambda v: v in boards_lib.SIDES, f"one of {list(boards_lib.SIDES)}"),
    ("board_source", lambda v: v in boards_lib.SOURCES, f"one of {list(boards_lib.SOURCES)}"),
    ("play_epsilon", lambda v: 0.0 <= v <= 1.0, "a probability in [0, 1]"),
    ("board_style", lambda v: v in wording.BOARD_STYLES, f"one of {list(wording.BOARD_STYLES)}"),
    ("heldout_fraction", lambda v: 0.0 <= v < 1.0, "a fraction in [0, 1)"),
    ("agent_player", lambda v: v in AGENT_PLAYERS, f"one of {list(AGENT_PLAYERS)}"),
    ("o_share", lambda v: 0.0 <= v <= 1.0, "a share in [0, 1]"),
    ("opponent", lambda v: v in tuple(tasks.OPPONENT_KINDS), f"one of {list(tasks.OPPONENT_KINDS)}"),
    ("opponent_epsilon", lambda v: 0.0 <= v <= 1.0, "a probability in [0, 1]"),
    ("suboptimal_penalty", lambda v: v >= 0.0, "a number >= 0 (0: the outcome alone)"),
)


def check_env_config(env_config) -> None:
    """Raises ValueError naming the first `env` field that cannot work."""
    for name, ok, expected in _CHECKS:
        if name not in env_config:
            continue
        value = env_config[name]
        try:
            good = bool(ok(value))
        except TypeError:
            good = False
        if not good:
            raise ValueError(f"env.{name} must be {expected}, got {value!r}")
    path = env_config.get("boards_path", "")
    if path and not os.path.exists(path):
        raise ValueError(f"env.boards_path={path} does not exist")


def make_env(env_config, **overrides) -> ttt_env.TicTacToeEnv:
    check_env_config(env_config)
    field = lambda name, default: overrides.get(name, env_config.get(name, default))  # noqa: E731
    return ttt_env.TicTacToeEnv.create(
        task=str(field("task", "move")),
        board_style=str(field("board_style", "grid")),
        suboptimal_penalty=float(field("suboptimal_penalty", 0.0)),
        independent_opponents=bool(field("independent_opponents", False)),
        win_seeking=bool(field("win_seeking", False)),
    )


def make_sampler(config):
    """A step's starts (one per group): dataset boards (move task) or opening games against the configured
    opponent (game task)."""
    env_config = config.env
    if str(env_config.get("task", "move")) == "move":
        train_boards, _ = boards_lib.load_boards(env_config)

        def sample_boards(key, num_groups):
            idx = jax.random.choice(key, len(train_boards), (num_groups,), replace=len(train_boards) < num_groups)
            return ttt_env.move_starts(train_boards[np.asarray(idx)])

        return sample_boards

    def sample_games(key, num_groups):
        agent = ttt_env.agent_players(env_config.agent_player, num_groups, float(env_config.get("o_share", 0.5)))
        return ttt_env.game_starts(
            key, num_groups, agent_player=agent, opponent=env_config.opponent, epsilon=env_config.opponent_epsilon
        )

    return sample_games


def _board(state) -> jax.Array:
    return state.board if isinstance(state, ttt_env.MoveState) else state.game.board


def random_legal_square(state, key):
    """The warm-start teacher: a uniformly random legal square (call row k = square k + 1), and the legal ones."""
    legal = _board(state) == 0
    noise = jax.random.uniform(key, legal.shape)
    return jnp.argmax(jnp.where(legal, noise, -1.0)).astype(jnp.int32), legal


def make_teacher(config, env) -> interface.Teacher:
    del config, env
    return interface.Teacher(random_legal_square, tuple((wording.TOOL_NAME, {"square": k}) for k in range(1, 10)))


# ---------------------------------------------------------------------------------------------- suites


def _win_available(boards: np.ndarray) -> np.ndarray:
    """Boards on which the side to move has an immediate win."""
    tables = minimax.tables_numpy()
    codes = (boards.astype(np.int64) * (3 ** np.arange(9))).sum(axis=1)
    return tables["winning_mask"][codes].any(axis=1)


def _positions_suite(boards: np.ndarray, default: bool) -> interface.EvalSuite:
    boards = np.asarray(boards, np.int8)

    def starts(key, ids):
        del key
        return ttt_env.move_starts(boards[np.asarray(ids) % len(boards)])

    def extra(info, ids):  # immediate wins taken among the boards that have one (not among all boards)
        available = _win_available(boards[np.asarray(ids) % len(boards)])
        return {"win_taken_rate": float(np.sum(np.asarray(info["win_taken"])) / max(int(available.sum()), 1))}

    return interface.EvalSuite(
        num_episodes=len(boards),
        starts=starts,
        extra=extra,
        default=default,
        env_overrides={"task": "move", **_EVAL_OVERRIDES},
    )


def _agent_of(ids: np.ndarray) -> np.ndarray:
    return (1 + np.asarray(ids) % 2).astype(np.int8)  # even episodes X, odd ones O


def _game_suite(opponent: str, epsilon: float, default: bool) -> interface.EvalSuite:
    def starts(key, ids):
        ids = np.asarray(ids)
        return ttt_env.game_starts(
            jax.random.fold_in(key, int(ids[0])),
            len(ids),
            agent_player=_agent_of(ids),
            opponent=opponent,
            epsilon=epsilon,
        )

    def extra(info, ids):
        x_games = _agent_of(ids) == 1
        out = {}
        for side, games in (("x", x_games), ("o", ~x_games)):
            for k in ("win", "draw", "loss"):
                values = np.asarray(info[k])[games]
                out[f"{side}/{k}_rate"] = float(np.mean(values)) if values.size else float("nan")
        if opponent == "epsilon":
            out["epsilon"] = float(epsilon)
        return out

    return interface.EvalSuite(
        num_episodes=GAMES_PER_SUITE,
        starts=starts,
        extra=extra,
        default=default,
        scalable=True,
        env_overrides={"task": "game", **_EVAL_OVERRIDES},
    )


def eval_suites(config) -> dict[str, interface.EvalSuite]:
    env_config = config.env
    move = str(env_config.get("task", "move")) == "move"
    suites = {
        "positions": _positions_suite(boards_lib.exhaustive_positions("x"), default=move),
        "positions_o": _positions_suite(boards_lib.exhaustive_positions("o"), default=False),
        "positions_both": _positions_suite(boards_lib.exhaustive_positions("both"), default=False),
    }
    _, heldout = boards_lib.load_boards(env_config) if env_config.get("heldout_fraction", 0.0) else (None, None)
    if heldout is not None and len(heldout):
        suites["heldout"] = _positions_suite(heldout, default=move)
    epsilon = float(env_config.get("opponent_epsilon", 0.5))
    for opponent in tasks.OPPONENT_KINDS:
        suites[opponent] = _game_suite(opponent, epsilon, default=not move and opponent != "epsilon")
    return suites


ENTRY = registry.register(
    "tictactoe", make_env, make_sampler, make_teacher, eval_suites=eval_suites, board_view=board_view.board_view
)
