"""Connect Four's registry entry: the env from a config's `env` section, the step's start records, the warm-start
teacher, the evaluation suites and the play page's board (`board_view`).

Teachers (`sft.teacher`): "center_greedy" (default: win, else block, else the most central legal column), or one
of the opponents' policies ("greedy", "negamax", "random"). `sft.explore` (with `sft.soft_targets`): the share
of the center-greedy teacher's moves played as a uniform legal column instead, while the target of that call stays
the teacher's column, so the warm start also sees, and learns to answer, positions off the teacher's own path
(those a model that imitates it imperfectly reaches). `sft.forced_weight` (with `sft.soft_targets`): the loss
weight of the decisions where a legal column wins or blocks (`forced_position`; ~15% of the teacher's decisions
against greedy) relative to the rest. Suites: whole games against each opponent ("random",
"greedy", "negamax", all three by default), the agent moving first in even episodes and second in odd ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface, registry
from reno_jax.envs.connect4 import board_view, opponents, rules
from reno_jax.envs.connect4 import env as c4_env
from reno_jax.errors import ConfigError

TEACHERS = ("center_greedy", "greedy", "negamax", "random")
GAMES_PER_SUITE = 256
CENTER_ORDER = (3, 2, 4, 1, 5, 0, 6)  # 0-based columns, the centre first


def make_env(env_config, **overrides) -> c4_env.Connect4Env:
    get = lambda name, default: overrides.get(name, env_config.get(name, default))  # noqa: E731
    return c4_env.Connect4Env(
        opponent=str(get("opponent", "random")),
        negamax_depth=int(get("negamax_depth", 3)),
        max_agent_turns=int(get("max_agent_turns", 21)),
        single_move=bool(get("single_move", False)),
        mark_playable=bool(get("mark_playable", False)),
        opening_plies=int(get("opening_plies", 0)),
        echo_board=bool(get("echo_board", False)),
        illegal_reward=float(get("illegal_reward", -1.0)),
        move_cost=float(get("move_cost", 0.0)),
    )


def make_sampler(config):
    env = make_env(config.env)
    side = config.env.get("agent_player", "alternate")
    if side not in c4_env.AGENT_PLAYER_SETTINGS:
        raise ValueError(f"env.agent_player must be one of {list(c4_env.AGENT_PLAYER_SETTINGS)}, got {side!r}")
    return lambda key, num_groups: env.sample_starts(key, num_groups, side)


def center_greedy_column(state: c4_env.Connect4State) -> jax.Array:
    """A scripted player for warm-start transcripts: win if it can, else block, else the most central legal
    column (`CENTER_ORDER`); 0-based. Deterministic, so a small model can imitate it; against the random opponent
    the centre order alone wins ~90% of games (docs/benchmarks.md)."""
    game = state.game
    legal = rules.legal_columns(game)
    rank = jnp.zeros((rules.COLS,), jnp.int32).at[jnp.asarray(CENTER_ORDER)].set(jnp.arange(7, 0, -1))
    score = (
        100 * opponents.winning_columns(game).astype(jnp.int32)
        + 10 * opponents.blocking_columns(game).astype(jnp.int32)
        + rank
    )
    return jnp.argmax(jnp.where(legal, score, -1)).astype(jnp.int32)


def forced_position(state: c4_env.Connect4State) -> jax.Array:
    """``bool []``: the side to move has a four to make or one to stop (a legal column that wins or blocks)."""
    game = state.game
    legal = rules.legal_columns(game)
    return jnp.any(legal & (opponents.winning_columns(game) | opponents.blocking_columns(game)))


def make_teacher(config, env: c4_env.Connect4Env) -> interface.Teacher:
    """`config.sft.teacher` ('': "center_greedy"); call row k is `drop_piece(column=k + 1)`. The support
    (the soft target) is the teacher's own column for "center_greedy" (it is deterministic), the legal columns for
    the opponents' policies (they choose among ties at random)."""
    policy = config.sft.teacher or "center_greedy"
    if policy not in TEACHERS:
        raise ValueError(f"sft.teacher must be one of {list(TEACHERS)}, got {policy!r}")
    explore = config.sft.explore
    if not 0.0 <= explore < 1.0:
        raise ConfigError(f"--config.sft.explore must be in [0, 1), got {explore}")
    if explore and (policy != "center_greedy" or not config.sft.soft_targets):
        raise ConfigError(
            f"--config.sft.explore={explore} needs --config.sft.teacher=center_greedy and "
            "--config.sft.soft_targets=True (the explored move is played, the teacher's is the target)"
        )

    forced_weight = config.sft.forced_weight
    if forced_weight <= 0.0:
        raise ConfigError(f"--config.sft.forced_weight must be > 0, got {forced_weight}")
    if forced_weight != 1.0 and not config.sft.soft_targets:
        raise ConfigError(
            f"--config.sft.forced_weight={forced_weight} needs --config.sft.soft_targets=True "
            "(the weight scales a decision's soft targets)"
        )

    def teacher(state, key):
        legal = rules.legal_columns(state.game)
        if policy != "center_greedy":
            col, target = jnp.maximum(env.teacher_column(state, key, policy) - 1, 0), legal
        else:
            col = center_greedy_column(state)
            target = jnp.arange(rules.COLS) == col
            if explore:
                k_coin, k_col = jax.random.split(key)
                wander = jax.random.uniform(k_coin) < explore
                col = jnp.where(wander & legal.any(), opponents.random_column(k_col, state.game), col)
        if forced_weight == 1.0:
            return col, target
        return col, target, jnp.where(forced_position(state), forced_weight, 1.0).astype(jnp.float32)

    return interface.Teacher(teacher, tuple(("drop_piece", {"column": k}) for k in range(1, rules.COLS + 1)))


def _game_suite(opponent: str) -> interface.EvalSuite:
    def starts(key, ids):
        ids = np.asarray(ids)
        if len(ids) % 2 or ids[0] % 2:
            raise ValueError(
                "Connect Four suites alternate sides by episode: batches must start on an even "
                "episode and hold an even number of them"
            )
        return c4_env.sample_starts(jax.random.fold_in(key, int(ids[0])), len(ids), opponent, "alternate")

    return interface.EvalSuite(
        num_episodes=GAMES_PER_SUITE, starts=starts, scalable=True, env_overrides={"opponent": opponent}
    )


def eval_suites(config) -> dict[str, interface.EvalSuite]:
    del config
    return {name: _game_suite(name) for name in opponents.KIND_NAMES}


ENTRY = registry.register(
    "connect4", make_env, make_sampler, make_teacher, eval_suites=eval_suites, board_view=board_view.board_view
)
