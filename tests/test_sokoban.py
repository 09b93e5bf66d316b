"""Sokoban (`reno_jax.envs.sokoban`): the rules against two independent implementations, the room generator and
its solver, the environment under jit and vmap, the teacher, and an evaluation suite on a tiny model."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from reno_jax import run_config
from reno_jax.envs import interface, registry
from reno_jax.envs.interface import ToolCall
from reno_jax.envs.sokoban import env as senv
from reno_jax.envs.sokoban import registration as sreg
from reno_jax.envs.sokoban import rooms, rules, wording
from reno_jax.protocol.chat import resolve

SMALL = dict(num_train_rooms=40, num_heldout_rooms=12)  # rooms.build caches it: the whole file builds it once


def _config(**env):
    config = run_config.default_config_dict()
    config.env = ml_collections.ConfigDict({"name": "sokoban", **SMALL, **env})
    return config


def _typed(config):
    return run_config.load(config)


@pytest.fixture(scope="module")
def env():
    return sreg.make_env(_config().env)


def _room(text):
    walls, targets, boxes, player = wording.parse_room(text)
    return jnp.asarray(walls), jnp.asarray(targets), jnp.asarray(boxes), jnp.int32(player)


_move = jax.jit(rules.move)


def _moves(text, directions):
    walls, targets, boxes, player = _room(text)
    for d in directions:
        boxes, player, _, _ = _move(walls, boxes, player, jnp.int32(rules.DIRECTIONS.index(d)))
    return wording.room_text(walls, targets, boxes, player)


ROOM = "######\n#_O__#\n#_X__#\n#_P__#\n#____#\n######"


# ---------------------------------------------------------------------------------------------- rules


def test_push_walk_wall_and_blocked_pushes():
    assert _moves(ROOM, ["up"]) == "######\n#_*__#\n#_P__#\n#____#\n#____#\n######"  # pushed onto the target
    assert _moves(ROOM, ["up", "up"]) == _moves(ROOM, ["up"])  # the box against the wall: no push, no move
    assert _moves(ROOM, ["left", "left"]) == "######\n#_O__#\n#_X__#\n#P___#\n#____#\n######"  # into the wall
    two = "######\n#____#\n#_X__#\n#_X__#\n#_P_O#\n######"  # two boxes in a row: not pushed
    assert _moves(two, ["up"]) == two
    walls, _, boxes, player = _room(two)
    _, _, moved, pushed = rules.move(walls, boxes, player, jnp.int32(rules.UP))
    assert not bool(moved) and not bool(pushed)
    _, after, moved, pushed = rules.move(walls, boxes, player, jnp.int32(rules.RIGHT))
    assert bool(moved) and not bool(pushed) and int(after) == int(player) + 1


def test_no_pulling():
    room = "######\n#____#\n#_XP_#\n#___O#\n#____#\n######"
    assert _moves(room, ["right"]) == "######\n#____#\n#_X_P#\n#___O#\n#____#\n######"


def test_solved_and_boxes_on_target():
    walls, targets, boxes, player = _room("######\n#_*__#\n#_P__#\n#_X__#\n#_O__#\n######")
    assert int(rules.boxes_on_target(boxes, targets)) == 1 and not bool(rules.solved(boxes, targets))
    boxes, player, _, pushed = rules.move(walls, boxes, player, jnp.int32(rules.DOWN))
    assert bool(pushed) and bool(rules.solved(boxes, targets)) and int(rules.boxes_on_target(boxes, targets)) == 2


class NumpyReference:
    """A second, plain implementation of the rules on a character grid (no code shared with `rules`)."""

    STEP = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

    def __init__(self, text):
        self.grid = [list(row) for row in text.split("\n")]
        self.targets = {(r, c) for r, row in enumerate(self.grid) for c, ch in enumerate(row) if ch in "O*S"}
        self.boxes = {(r, c) for r, row in enumerate(self.grid) for c, ch in enumerate(row) if ch in "X*"}
        self.player = next((r, c) for r, row in enumerate(self.grid) for c, ch in enumerate(row) if ch in "PS")
        self.walls = {(r, c) for r, row in enumerate(self.grid) for c, ch in enumerate(row) if ch == "#"}

    def move(self, direction):
        dr, dc = self.STEP[direction]
        one = (self.player[0] + dr, self.player[1] + dc)
        two = (one[0] + dr, one[1] + dc)
        if one in self.walls:
            return
        if one in self.boxes:
            if two in self.walls or two in self.boxes:
                return
            self.boxes = (self.boxes - {one}) | {two}
        self.player = one

    def text(self):
        rows = []
        for r, row in enumerate(self.grid):
            out = ""
            for c in range(len(row)):
                at = (r, c)
                if at in self.walls:
                    out += "#"
                elif at == self.player:
                    out += "S" if at in self.targets else "P"
                elif at in self.boxes:
                    out += "*" if at in self.targets else "X"
                else:
                    out += "O" if at in self.targets else "_"
            rows.append(out)
        return "\n".join(rows)


def _random_rooms(count, num_boxes, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        grid = np.full((6, 6), "#")
        grid[1:-1, 1:-1] = "_"
        inner = [(r, c) for r in range(1, 5) for c in range(1, 5)]
        picks = rng.permutation(len(inner))
        walls = rng.integers(0, 4)
        for k in picks[:walls]:
            grid[inner[k]] = "#"
        free = [inner[k] for k in picks[walls:]]
        for k in range(num_boxes):
            grid[free[k]] = "X"
            grid[free[num_boxes + k]] = "O" if rng.random() < 0.7 else "*"
        grid[free[2 * num_boxes]] = "P" if rng.random() < 0.8 else "S"
        out.append("\n".join("".join(row) for row in grid))
    return out


@functools.lru_cache(maxsize=None)
def _batched_moves():
    def play(walls, boxes, player, directions):
        def body(carry, d):
            boxes, player = carry
            boxes, player, _, _ = rules.move(walls, boxes, player, d)
            return (boxes, player), (boxes, player)

        return jax.lax.scan(body, (boxes, player), directions)[1]

    return jax.jit(jax.vmap(play))


def _trajectories(texts, directions):
    parsed = [wording.parse_room(t) for t in texts]
    walls = jnp.asarray(np.stack([p[0] for p in parsed]))
    targets = np.stack([p[1] for p in parsed])
    boxes = jnp.asarray(np.stack([p[2] for p in parsed]))
    player = jnp.asarray([p[3] for p in parsed], jnp.int32)
    all_boxes, all_players = _batched_moves()(walls, boxes, player, jnp.asarray(directions, jnp.int32))
    return parsed, targets, np.asarray(all_boxes), np.asarray(all_players)


@pytest.mark.parametrize("num_boxes", [1, 2])
def test_rules_match_a_numpy_reference_over_random_rooms_and_moves(num_boxes):
    texts = _random_rooms(48, num_boxes, seed=num_boxes)
    directions = np.random.default_rng(7).integers(0, 4, (len(texts), 30))
    parsed, targets, all_boxes, all_players = _trajectories(texts, directions)
    for i, text in enumerate(texts):
        ref = NumpyReference(text)
        for t in range(directions.shape[1]):
            ref.move(rules.DIRECTIONS[directions[i, t]])
            assert wording.room_text(parsed[i][0], targets[i], all_boxes[i, t], all_players[i, t]) == ref.text()
            assert bool(rules.solved(jnp.asarray(all_boxes[i, t]), jnp.asarray(targets[i]))) == (
                ref.boxes <= ref.targets
            )


def test_rules_match_jumanji_over_random_rooms_and_moves():
    sokoban = pytest.importorskip("jumanji.environments.routing.sokoban")
    from jumanji.environments.routing.sokoban import constants as jc
    from jumanji.environments.routing.sokoban.generator import ToyGenerator

    jenv = sokoban.Sokoban(generator=ToyGenerator(), time_limit=10_000)
    to_jumanji = np.array([0, 2, 3, 1])  # ours: up, down, left, right; jumanji's MOVES: up, right, down, left
    texts = _random_rooms(16, 1, seed=3) + _random_rooms(16, 2, seed=4)
    directions = np.random.default_rng(11).integers(0, 4, (len(texts), 25))
    parsed, targets, all_boxes, all_players = _trajectories(texts, directions)
    step = jax.jit(jenv.step)
    for i in range(len(texts)):
        walls, target, boxes, player = parsed[i]
        fixed = np.full((jc.GRID_SIZE, jc.GRID_SIZE), jc.WALL, np.uint8)  # the room in the 10 x 10 grid's corner
        fixed[:6, :6] = np.where(walls, jc.WALL, np.where(target, jc.TARGET, jc.EMPTY))
        variable = np.zeros((jc.GRID_SIZE, jc.GRID_SIZE), np.uint8)
        variable[:6, :6][boxes] = jc.BOX
        variable[player // 6, player % 6] = jc.AGENT
        state = sokoban.State(
            key=jax.random.PRNGKey(0),
            fixed_grid=jnp.asarray(fixed),
            variable_grid=jnp.asarray(variable),
            agent_location=jnp.asarray([player // 6, player % 6], jnp.int32),
            step_count=jnp.int32(0),
        )
        for t in range(directions.shape[1]):
            state, _ = step(state, jnp.int32(to_jumanji[directions[i, t]]))
            grid = np.asarray(state.variable_grid)
            np.testing.assert_array_equal(grid[:6, :6] == jc.BOX, all_boxes[i, t])
            assert int(np.flatnonzero((grid[:6, :6] == jc.AGENT).reshape(-1))[0]) == int(all_players[i, t])
            assert not np.any(grid[6:]) and not np.any(grid[:, 6:])


def test_position_keys_are_dense_and_distinct():
    shape, k = (6, 6), 2
    cells = [r * 6 + c for r in range(1, 5) for c in range(1, 5)]
    keys = set()
    for a in range(len(cells)):
        for b in range(a + 1, len(cells)):
            for p in cells:
                boxes = np.zeros(shape, bool)
                boxes.reshape(-1)[[cells[a], cells[b]]] = True
                key = rules.np_position_key((cells[a], cells[b]), p, shape, k)
                if p in (cells[a], cells[b]):
                    continue
                assert int(rules.position_key(jnp.asarray(boxes), jnp.int32(p), k)) == key
                keys.add(key)
    assert max(keys) < rules.num_position_keys(6, 6, k) and len(keys) == 16 * 120 - 2 * 120


# ---------------------------------------------------------------------------------------------- rooms


def test_generated_rooms_are_solvable_disjoint_and_deterministic():
    train, heldout = sreg.splits(_config().env)
    again_train, again_heldout = rooms.build.__wrapped__(
        0, SMALL["num_train_rooms"], SMALL["num_heldout_rooms"], max_moves=10
    )  # uncached: drawn again
    np.testing.assert_array_equal(train.boxes, again_train.boxes)
    np.testing.assert_array_equal(heldout.player, again_heldout.player)
    np.testing.assert_array_equal(heldout.distance, again_heldout.distance)
    other, _ = rooms.build.__wrapped__(1, SMALL["num_train_rooms"], 1, max_moves=10)
    assert not np.array_equal(other.walls, train.walls)

    def key(split, i):
        return (split.walls[i].tobytes(), split.targets[i].tobytes(), split.boxes[i].tobytes(), int(split.player[i]))

    train_keys = {key(train, i) for i in range(len(train))}
    assert len(train_keys) == len(train)
    assert not train_keys & {key(heldout, i) for i in range(len(heldout))}
    for split in (train, heldout):
        assert split.walls[:, 0].all() and split.walls[:, -1].all() and split.walls[:, :, 0].all()
        assert (split.boxes.sum((1, 2)) == 1).all() and (split.targets.sum((1, 2)) == 1).all()
        for i in range(len(split)):
            solution = rooms.solve(split.walls[i], split.targets[i], split.boxes[i], split.player[i])
            assert solution.moves is not None and len(solution.moves) == split.optimal[i]
            assert 1 <= split.optimal[i] <= 10 and solution.pushes >= 2
            walls, targets, boxes, player = (
                jnp.asarray(split.walls[i]),
                split.targets[i],
                jnp.asarray(split.boxes[i]),
                jnp.int32(split.player[i]),
            )
            for d in solution.moves:  # the solver's moves solve the room under the jitted rules
                boxes, player, _, _ = _move(walls, boxes, player, jnp.int32(d))
            assert bool(rules.solved(boxes, jnp.asarray(targets)))


def test_two_box_rooms():
    train, heldout = rooms.build(0, 6, 3, num_boxes=2, max_moves=20)
    assert (train.boxes.sum((1, 2)) == 2).all()
    for i in range(len(heldout)):
        solution = rooms.solve(heldout.walls[i], heldout.targets[i], heldout.boxes[i], heldout.player[i])
        assert solution.moves is not None and len(solution.moves) == heldout.optimal[i]


# ---------------------------------------------------------------------------------------------- environment


def _calls(directions, kind=None):
    directions = jnp.asarray(directions, jnp.int32)
    kinds = jnp.zeros_like(directions) if kind is None else jnp.asarray(kind, jnp.int32)
    return ToolCall(kind=kinds, tool=jnp.zeros_like(directions), args=directions[:, None])


def _play(env, starts, moves, kinds=None):
    """Steps every episode through ``moves`` ``int [B, T]`` under jit and vmap: the Step of each turn."""
    state, message = jax.jit(jax.vmap(env.reset))(starts)
    step = jax.jit(jax.vmap(env.step))
    outs = []
    for t in range(moves.shape[1]):
        out = step(state, _calls(moves[:, t], None if kinds is None else kinds[:, t]))
        outs.append(out)
        state = out.state
    return message, outs


def test_reset_renders_the_room_and_step_under_jit_and_vmap(env):
    heldout = sreg.splits(_config().env)[1]
    n = 4
    starts = senv.SokobanStart(split=jnp.full((n,), senv.HELDOUT, jnp.int32), room=jnp.arange(n, dtype=jnp.int32))
    state, message = jax.jit(jax.vmap(env.reset))(starts)
    chex.assert_shape(message.values, (n, 36))
    chex.assert_shape([state.walls, state.boxes], (n, 6, 6))
    chex.assert_type([message.template, state.player, state.steps], jnp.int32)
    for i in range(n):
        text = wording.room_text(heldout.walls[i], heldout.targets[i], heldout.boxes[i], heldout.player[i])
        spec = env.chat()
        assert resolve(spec.user[0], np.asarray(message.values[i])) == "Room:\n" + text
        walls, targets, boxes, player = wording.parse_room(text)  # the text round trip
        np.testing.assert_array_equal(walls, heldout.walls[i])
        np.testing.assert_array_equal(boxes, heldout.boxes[i])
        assert player == heldout.player[i]
    # Optimal play solves each room with the reward of its moves and the +1, then nothing changes.
    plans = [
        rooms.solve(heldout.walls[i], heldout.targets[i], heldout.boxes[i], heldout.player[i]).moves for i in range(n)
    ]
    width = max(len(p) for p in plans) + 1
    moves = np.array([list(p) + [0] * (width - len(p)) for p in plans])
    _, outs = _play(env, starts, moves)
    for i, plan in enumerate(plans):
        last = outs[len(plan) - 1]
        assert bool(last.done[i]) and bool(last.info["solved"][i]) and int(last.info["steps"][i]) == len(plan)
        rewards = [float(outs[t].reward[i]) for t in range(width)]
        # one box: pushed onto its target once at the end (it starts off target)
        assert rewards[: len(plan)] == pytest.approx(
            [senv.STEP_REWARD] * (len(plan) - 1) + [senv.STEP_REWARD + senv.BOX_REWARD + senv.SOLVE_REWARD]
        )
        assert rewards[len(plan) :] == [0.0] * (width - len(plan))
        assert int(last.message.template[i]) == wording.TOOL_SOLVED
        assert int(outs[-1].info["steps"][i]) == len(plan)


def _positions(walls, targets, boxes, player):
    """The positions line of a room, by hand from its arrays."""
    width = np.shape(walls)[1]
    cells = lambda mask: [divmod(int(i), width) for i in np.flatnonzero(np.asarray(mask).reshape(-1))]  # noqa: E731
    row, col = divmod(int(player), width)
    return (
        f"\nYou {row},{col}"
        + "".join(f" box {r},{c}" for r, c in cells(boxes))
        + "".join(f" target {r},{c}" for r, c in cells(targets))
    )


def test_coordinates_spell_out_the_positions_after_every_room():
    xy = sreg.make_env(_config(coordinates=True).env)
    heldout = sreg.splits(_config().env)[1]
    n = 4
    starts = senv.SokobanStart(split=jnp.full((n,), senv.HELDOUT, jnp.int32), room=jnp.arange(n, dtype=jnp.int32))
    state, message = jax.jit(jax.vmap(xy.reset))(starts)
    chex.assert_shape(message.values, (n, 36 + 6))
    spec = xy.chat()
    assert spec.num_values == 42 and sreg.make_env(_config().env).chat().num_values == 36
    for i in range(n):
        room = (heldout.walls[i], heldout.targets[i], heldout.boxes[i], heldout.player[i])
        assert resolve(spec.user[0], np.asarray(message.values[i])) == (
            "Room:\n" + wording.room_text(*room) + _positions(*room)
        )
    # After a move the tool's room carries the new positions (the solver's first move, a blocked one too).
    first = [
        rooms.solve(*(a[i] for a in (heldout.walls, heldout.targets, heldout.boxes, heldout.player))).moves[0]
        for i in range(n)
    ]
    out = jax.jit(jax.vmap(xy.step))(state, _calls(first))
    for i in range(n):
        s = jax.tree.map(lambda a: np.asarray(a[i]), out.state)
        text = resolve(spec.tool[int(out.message.template[i])], np.asarray(out.message.values[i]))
        assert text.endswith(
            wording.room_text(s.walls, s.targets, s.boxes, s.player) + _positions(s.walls, s.targets, s.boxes, s.player)
        )
    # Two boxes: each box, then each target, in row-major order.
    two = "######\n#_O__#\n#_XX_#\n#_P_O#\n#____#\n######"
    walls, targets, boxes, player = _room(two)
    values = wording.cell_values(walls, targets, boxes, player, 2)
    assert resolve(wording.chat_spec(6, 6, 15, 2).user[0], np.asarray(values)) == (
        "Room:\n" + two + "\nYou 3,2 box 2,2 box 2,3 target 1,2 target 3,4"
    )
    with pytest.raises(ValueError, match="env.coordinates is a switch"):
        sreg.settings(_config(coordinates=2).env)


def _outcomes_by_hand(text):
    """The moves line of a room's text, read off its characters: what each direction's first and second cell hold."""
    rows = text.split("\n")
    (r, c), words = next((i, j) for i, row in enumerate(rows) for j, ch in enumerate(row) if ch in "PS"), []

    def cell(i, j):  # outside the room reads as a wall
        return rows[i][j] if 0 <= i < len(rows) and 0 <= j < len(rows[i]) else "#"

    for name, (dr, dc) in zip(("up", "down", "left", "right"), ((-1, 0), (1, 0), (0, -1), (0, 1))):
        one, two = cell(r + dr, c + dc), cell(r + 2 * dr, c + 2 * dc)
        if one == "#" or (one in "X*" and two in "#X*"):
            words.append(f"{name} blocked")
        else:
            words.append(f"{name} {'push' if one in 'X*' else 'open'}")
    return "\nMoves: " + ", ".join(words)


def test_move_outcomes_say_what_each_move_would_do_after_every_room():
    plain, both = sreg.make_env(_config().env), sreg.make_env(_config(move_outcomes=True, coordinates=True).env)
    only = sreg.make_env(_config(move_outcomes=True).env)
    assert (only.chat().num_values, both.chat().num_values, plain.chat().num_values) == (40, 46, 36)
    # Rooms where a box is pushed, blocked by a wall and by another box, and walls on two sides.
    texts = (
        "######\n#_O__#\n#_XX_#\n#_P_O#\n#____#\n######",
        "######\n#P___#\n#X___#\n#X_O_#\n#__O_#\n######",
        "######\n#__O_#\n#__X_#\n#__PX#\n#____#\n######",
        "######\n#____#\n#_O__#\n#_*__#\n#_S__#\n######",
    )
    for text in texts:
        walls, targets, boxes, player = _room(text)
        values = wording.cell_values(walls, targets, boxes, player, 2, move_outcomes=True)
        num_boxes = int(np.asarray(boxes).sum())
        line = resolve(wording.chat_spec(6, 6, 15, 2, move_outcomes=True).user[0], np.asarray(values))
        assert line.startswith("Room:\n" + text + "\nYou ") and line.endswith(_outcomes_by_hand(text)), line
        alone = wording.cell_values(walls, targets, boxes, player, num_boxes, move_outcomes=True)
        assert resolve(wording.chat_spec(6, 6, 15, num_boxes, move_outcomes=True).user[0], np.asarray(alone)).endswith(
            _outcomes_by_hand(text)
        )
    # Along random play (jit and vmap), every message's line matches the room it shows.
    n, turns = 6, 8
    starts = senv.SokobanStart(split=jnp.full((n,), senv.HELDOUT, jnp.int32), room=jnp.arange(n, dtype=jnp.int32))
    moves = jax.random.randint(jax.random.PRNGKey(3), (n, turns), 0, 4, jnp.int32)
    state, message = jax.jit(jax.vmap(only.reset))(starts)
    chex.assert_shape(message.values, (n, 40))
    spec = only.chat()
    for t in range(turns):
        out = jax.jit(jax.vmap(only.step))(state, _calls(moves[:, t]))
        for i in range(n):
            s = jax.tree.map(lambda a: np.asarray(a[i]), out.state)
            room = wording.room_text(s.walls, s.targets, s.boxes, s.player)
            text = resolve(spec.tool[int(out.message.template[i])], np.asarray(out.message.values[i]))
            if int(out.message.template[i]) != wording.TOOL_INVALID:
                assert room + _outcomes_by_hand(room) in text
        state = out.state
    with pytest.raises(ValueError, match="env.move_outcomes is a switch"):
        sreg.settings(_config(move_outcomes=3).env)


def test_invalid_call_blocked_move_and_step_budget():
    env = sreg.make_env(_config(max_steps=3, max_solution_moves=3).env)
    starts = senv.SokobanStart(split=jnp.zeros((2,), jnp.int32), room=jnp.zeros((2,), jnp.int32))
    state, _ = env.reset(jax.tree.map(lambda a: a[0], starts))
    # a direction that leaves the room unchanged (a wall or a blocked box), if any, else any
    blocked = [d for d in range(4) if not bool(rules.move(state.walls, state.boxes, state.player, jnp.int32(d))[2])]
    stay = blocked[0] if blocked else 0
    moves = np.array([[stay, stay, stay], [stay, 0, 0]])
    kinds = np.array([[0, 0, 0], [0, 2, 0]])  # episode 1's second call is malformed
    _, outs = _play(env, starts, moves, kinds)
    assert [bool(o.done[0]) for o in outs] == [False, False, True]
    if blocked:
        assert int(outs[0].message.template[0]) == wording.TOOL_BLOCKED and int(outs[0].info["blocked"][0]) == 1
    assert int(outs[2].info["outcome"][0]) == senv.OUTCOME_OUT_OF_MOVES
    assert int(outs[2].message.template[0]) == wording.TOOL_OUT_OF_MOVES
    assert [float(o.reward[0]) for o in outs] == pytest.approx([senv.STEP_REWARD] * 3)
    assert bool(outs[1].done[1]) and bool(outs[1].info["invalid"][1])
    assert float(outs[1].reward[1]) == senv.INVALID_REWARD and int(outs[1].message.template[1]) == wording.TOOL_INVALID
    assert float(outs[2].reward[1]) == 0.0 and int(outs[2].info["steps"][1]) == 1  # nothing after the end
    assert env.max_turns() == 3
    cut = env.finish(jax.tree.map(lambda a: a[0], outs[0].state), None, jnp.bool_(True))
    assert int(cut["outcome"]) == senv.OUTCOME_TRUNCATED
    figures = interface.summarize(env, jax.tree.map(np.asarray, outs[2].info))
    assert figures["solved_rate"] == 0.0 and figures["invalid_rate"] == 0.5 and figures["out_of_moves_rate"] == 0.5


def test_live_cells_hold_every_cell_a_box_can_still_be_solved_from():
    """`rules.live_cells` against the solver's table of every position of the layout (`rooms.layout_distances`):
    a cell from which some placement of the player solves the room is live (so `rules.dead` never ends a
    solvable room), and the rooms have dead cells the rule finds."""
    train = sreg.splits(_config().env)[0]
    live_of = jax.jit(rules.live_cells)
    dead_found = 0
    for i in range(12):
        walls, targets = train.walls[i], train.targets[i]
        live = np.asarray(live_of(jnp.asarray(walls), jnp.asarray(targets))).reshape(-1)
        solvable = {boxes[0] for boxes, _ in rooms.layout_distances(walls, targets, 1)}
        floor = np.flatnonzero(~walls.reshape(-1))
        assert all(live[c] for c in solvable), i
        assert not live[walls.reshape(-1)].any()
        dead_found += int(np.sum(~live[floor]))
    assert dead_found > 0
    # By hand: a push needs the cell behind the box open, so the box reaches the target at (2, 3) from (2, 2)
    # (player on (2, 1)) or (3, 3) (player on (4, 3)), and those from (3, 2); no push off the ring's neighbours.
    open_room = "######\n#P___#\n#__O_#\n#____#\n#____#\n######"
    walls, targets, boxes, _ = _room(open_room)
    live = np.asarray(rules.live_cells(walls, targets))
    assert {tuple(map(int, rc)) for rc in np.argwhere(live)} == {(2, 3), (2, 2), (3, 3), (3, 2)}
    at = lambda r, c: jnp.zeros((6, 6), bool).at[r, c].set(True)  # noqa: E731
    assert bool(rules.dead(walls, targets, at(1, 3))) and not bool(rules.dead(walls, targets, at(3, 2)))


def test_early_ends_stop_an_episode_at_the_move_that_failed_it():
    """env.end_on_blocked: a blocked move ends the episode (stuck); env.end_when_dead: a push onto a dead cell ends
    it (dead); rewards stay the step's, and without the switches the episode goes on."""
    # P below a box that two pushes up would wedge against the wall; the target is off to the right.
    text = "######\n#____#\n#_X_O#\n#_P__#\n#____#\n######"
    walls, targets, boxes, player = wording.parse_room(text)
    table = senv.Rooms(
        walls=jnp.asarray(walls)[None],
        targets=jnp.asarray(targets)[None],
        boxes=jnp.asarray(boxes)[None],
        player=jnp.asarray([player], jnp.int32),
        optimal=jnp.asarray([4], jnp.int32),
    )
    starts = senv.SokobanStart(split=jnp.zeros((3,), jnp.int32), room=jnp.zeros((3,), jnp.int32))
    up, left = rules.DIRECTIONS.index("up"), rules.DIRECTIONS.index("left")
    # episode 0: up (box to row 1: dead, against the top wall with no target on it); 1: left, left (into the wall);
    # 2: left then up (a plain walk)
    moves = np.array([[up, up], [left, left], [left, up]])
    outcomes = {}
    for on in (False, True):
        env = senv.SokobanEnv(train=table, heldout=table, max_steps=15, end_on_blocked=on, end_when_dead=on)
        _, outs = _play(env, starts, moves)
        outcomes[on] = ([bool(o.done[i]) for o in outs for i in range(3)], outs)
    done_off, _ = outcomes[False]
    assert not any(done_off)
    _, outs = outcomes[True]
    assert bool(outs[0].done[0]) and int(outs[0].info["outcome"][0]) == senv.OUTCOME_DEAD
    assert int(outs[0].message.template[0]) == wording.TOOL_DEAD
    assert not bool(outs[0].done[1]) and bool(outs[1].done[1])
    assert (
        int(outs[1].info["outcome"][1]) == senv.OUTCOME_STUCK and int(outs[1].message.template[1]) == wording.TOOL_STUCK
    )
    assert not bool(outs[1].done[2])
    assert float(outs[0].reward[0]) == pytest.approx(senv.STEP_REWARD)
    spec = senv.SokobanEnv(train=table, heldout=table, end_when_dead=True).chat()
    assert len(spec.tool) == 7 and spec.tool_continues[-2:] == (False, False)
    assert resolve(spec.tool[wording.TOOL_DEAD], np.asarray(outs[0].message.values[0])).endswith(
        "The box can no longer reach a target."
    )
    figures = interface.summarize(env, jax.tree.map(np.asarray, outs[1].info))
    assert figures["dead_rate"] == pytest.approx(1 / 3) and figures["stuck_rate"] == pytest.approx(1 / 3)
    assert "dead_rate" not in interface.summarize(sreg.make_env(_config().env), jax.tree.map(np.asarray, outs[1].info))
    assert sreg.make_env(_config(end_on_blocked=True, end_when_dead=True).env).end_when_dead
    with pytest.raises(ValueError, match="env.end_when_dead is a switch"):
        sreg.settings(_config(end_when_dead=2).env)


def test_box_pushed_off_a_target_costs_its_reward():
    text = "######\n#_*__#\n#_P__#\n#_X__#\n#_O__#\n######"  # P between a box on a target and another box
    walls, targets, boxes, player = wording.parse_room(text)
    rooms_ = senv.Rooms(
        walls=jnp.asarray(walls)[None],
        targets=jnp.asarray(targets)[None],
        boxes=jnp.asarray(boxes)[None],
        player=jnp.asarray([player], jnp.int32),
        optimal=jnp.asarray([1], jnp.int32),
    )
    env = senv.SokobanEnv(train=rooms_, heldout=rooms_, num_boxes=2)
    state, _ = env.reset(senv.SokobanStart(split=jnp.int32(0), room=jnp.int32(0)))
    out = env.step(state, ToolCall(kind=jnp.int32(0), tool=jnp.int32(0), args=jnp.array([rules.DOWN])))
    assert float(out.reward) == pytest.approx(senv.STEP_REWARD + senv.BOX_REWARD + senv.SOLVE_REWARD)
    state, _ = env.reset(senv.SokobanStart(split=jnp.int32(0), room=jnp.int32(0)))
    state = state.replace(
        boxes=jnp.asarray(wording.parse_room("######\n#____#\n#_*__#\n#_P__#\n#_X__#\n######")[2]),
        player=jnp.int32(3 * 6 + 2),
    )
    state = state.replace(targets=jnp.asarray(wording.parse_room("######\n#____#\n#_O__#\n#_P__#\n#_O__#\n######")[1]))
    off = env.step(state, ToolCall(kind=jnp.int32(0), tool=jnp.int32(0), args=jnp.array([rules.UP])))
    assert (
        wording.room_text(off.state.walls, off.state.targets, off.state.boxes, off.state.player)
        == "######\n#_X__#\n#_S__#\n#____#\n#_*__#\n######"
    )
    assert float(off.reward) == pytest.approx(senv.STEP_REWARD - senv.BOX_REWARD)
    key = env.state_key(off.state)
    assert key.dtype == jnp.int32 and int(key) == rules.np_position_key((1 * 6 + 2, 4 * 6 + 2), 2 * 6 + 2, (6, 6), 2)


# ---------------------------------------------------------------------------------------------- companions


def test_registry_and_settings():
    entry = registry.get("sokoban")
    assert entry.make_env is sreg.make_env
    with pytest.raises(ValueError, match="env.max_solution_moves"):
        sreg.make_env(_config(max_steps=5, max_solution_moves=10).env)
    with pytest.raises(ValueError, match="env.num_boxes"):
        sreg.settings(_config(num_boxes=0).env)
    starts = sreg.make_sampler(_typed(_config()))(jax.random.PRNGKey(0), 64)
    assert (np.asarray(starts.split) == senv.TRAIN).all()
    assert 0 <= int(starts.room.min()) and int(starts.room.max()) < SMALL["num_train_rooms"]
    suites = sreg.eval_suites(_typed(_config()))
    assert suites["heldout"].num_episodes == SMALL["num_heldout_rooms"] and suites["heldout"].default
    assert not suites["train"].default
    config = _config()
    config.sft.explore = 0.3
    with pytest.raises(ValueError, match="soft_targets"):
        sreg.make_teacher(_typed(config), sreg.make_env(config.env))


def _teacher_episodes(env, teacher, starts, key):
    """The teacher's episodes (host loop of jitted steps): the final info."""
    state, _ = jax.vmap(env.reset)(starts)
    policy, step = jax.jit(jax.vmap(teacher.policy)), jax.jit(jax.vmap(env.step))
    info = None
    for t in range(env.max_turns()):
        row, support = policy(state, jax.random.split(jax.random.fold_in(key, t), starts.room.shape[0]))
        assert bool(jnp.all(support[jnp.arange(row.shape[0]), row] | (state.outcome != 0)))
        out = step(state, _calls(row))
        info = (
            out.info
            if info is None
            else jax.tree.map(lambda new, old: jnp.where(state.outcome == 0, new, old), out.info, info)
        )
        state = out.state
    return jax.tree.map(np.asarray, info)


def test_teacher_solves_every_room_optimally_and_random_play_rarely(env):
    n = SMALL["num_heldout_rooms"]
    starts = senv.SokobanStart(split=jnp.full((n,), senv.HELDOUT, jnp.int32), room=jnp.arange(n, dtype=jnp.int32))
    teacher = sreg.make_teacher(_typed(_config()), env)
    assert teacher.calls == tuple(("move", {"direction": d}) for d in ("up", "down", "left", "right"))
    info = _teacher_episodes(env, teacher, starts, jax.random.PRNGKey(0))
    assert info["solved"].all()
    np.testing.assert_array_equal(info["steps"], np.asarray(env.heldout.optimal))
    config = _config()
    config.sft.teacher = "random"
    random_info = _teacher_episodes(env, sreg.make_teacher(_typed(config), env), starts, jax.random.PRNGKey(0))
    assert random_info["solved"].mean() < 1.0
    # sft.wrong_rooms: on a fixed share of the rooms the solver plays only non-optimal moves and never solves them
    config = _config()
    config.sft.wrong_rooms = 0.5
    wrong_info = _teacher_episodes(env, sreg.make_teacher(_typed(config), env), starts, jax.random.PRNGKey(0))
    state, _ = jax.vmap(env.reset)(starts)
    wrong = np.asarray(jax.vmap(lambda s: sreg.wrong_room(s, 0.5))(state))
    assert 0 < wrong.sum() < n
    np.testing.assert_array_equal(wrong_info["solved"], ~wrong)
    config.sft.teacher = "random"
    with pytest.raises(ValueError, match="wrong_rooms"):
        sreg.make_teacher(_typed(config), env)


def test_teacher_calls_tokenize_with_their_enum_index():
    from reno_jax.protocol.tokenizer import load_tokenizer
    from reno_jax.rl import sft

    tok = load_tokenizer(None)
    env = sreg.make_env(_config().env)
    teacher = sreg.make_teacher(_typed(_config()), env)
    schemas = env.chat().tools
    table = sft.build_call_table(tok, teacher.calls, tok.eos_token_id or 0, 0, ["move"], schemas)
    np.testing.assert_array_equal(np.asarray(table.args)[:, 0], [0, 1, 2, 3])
    assert table.choice_tokens
    with pytest.raises(ValueError, match=r"teacher call move\(direction='up'\): direction takes an integer"):
        sft.build_call_table(tok, teacher.calls, 0, 0, ["move"])  # without the schemas: no enum to number it by
    bad = "teacher call move\\(direction='north'\\): direction takes one of 'up', 'down', 'left', 'right'$"
    with pytest.raises(ValueError, match=bad):
        sft.build_call_table(tok, [("move", {"direction": "north"})], 0, 0, ["move"], schemas)
    with pytest.raises(ValueError, match=r"move\(direction=2\): direction takes one of"):
        sft.build_call_table(tok, [("move", {"direction": 2})], 0, 0, ["move"], schemas)


def test_heldout_suite_on_a_tiny_model():
    from configs import sokoban_tiny
    from reno_jax.loop import evaluation
    from reno_jax.models import ling3
    from reno_jax.protocol.tokenizer import load_tokenizer

    config = sokoban_tiny.get_config()
    config.env.update(
        dict(num_train_rooms=SMALL["num_train_rooms"], num_heldout_rooms=4, max_steps=2, max_solution_moves=2)
    )
    model_config = ling3.tiny_test_config(vocab_size=512, num_hidden_layers=1)
    params = ling3.init_params(model_config, jax.random.PRNGKey(0))
    config = run_config.load(config)
    suite = sreg.eval_suites(config)["heldout"]
    result = evaluation.run_suite(
        params,
        model_config,
        load_tokenizer(None),
        config,
        "heldout",
        suite,
        key=jax.random.PRNGKey(0),
        show_progress=False,
    )
    figures = result.figures
    assert figures["num_episodes"] == 4
    for name in ("solved_rate", "invalid_rate", "steps_mean", "tool_call_valid_rate", "mean_reward"):
        assert np.isfinite(figures[name])
    assert 0.0 <= figures["solved_rate"] <= 1.0
