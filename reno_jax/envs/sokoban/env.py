"""`SokobanEnv`: Sokoban rooms through the ``move(direction)`` tool, as a `TextEnv`.

One episode is one room. The first user message shows it; every ``move`` call moves the player one cell (pushing
a box when it walks into one, `rules.move`) and the tool answers with the room after the move:

  not an ok call (no call, malformed, direction outside the enum)  -> INVALID_REWARD (-1), done (invalid)
  a move that solves the room                                      -> step + box rewards + SOLVE_REWARD, done
  the ``max_steps``-th move without solving it                     -> step + box rewards, done (out of moves)
  any other move (a blocked one too: the room stays, as in gym-sokoban) -> step + box rewards, the room goes on

and, as options that end an episode once its outcome is settled (both off by default):

  ``end_on_blocked``: a move that leaves the room unchanged          -> step + box rewards, done (stuck)
  ``end_when_dead``: a push that leaves a box where it can never reach a target (`rules.dead`) -> step + box
                                                                        rewards, done (dead)

A dead room can never be solved, so ending it changes no solved rate. A blocked move with the bounded history of
no past turns (``rollout.history=0``: the room is the whole prompt) leaves the prompt as it was, so greedy play
repeats it until the budget ends, and ending it there changes no greedy solved rate either. What changes is
training: a failed episode stops at the move that failed it, rather than spreading its credit over the turns it
wandered after, and costs no more turns.

Rewards are gym-sokoban's / verl-agent's divided by 10: -0.01 per move (blocked ones included), +0.1 for each box
pushed onto a target, -0.1 for each pushed off one, +1 when every box is on a target. Divided so that an episode's
return is on the other environments' scale (a win 1, an invalid call -1): with gym-sokoban's +10 a solved room
would be worth ten invalid calls and the invalid penalty would barely register against a group's spread.

The rooms are a dataset held by the environment (arrays, pytree leaves): a train split (the sampler's) and a
held-out split (the ``heldout`` evaluation suite's); a start record names a split and a room, or gives a room of its
own (`SokobanStart.given`: the play page's position, which a person may have moved in).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.envs import interface
from reno_jax.envs.interface import Message, Step, TextEnv, ToolCall
from reno_jax.envs.sokoban import rooms, rules, wording

OUTCOME_ONGOING, OUTCOME_SOLVED, OUTCOME_OUT_OF_MOVES, OUTCOME_INVALID, OUTCOME_TRUNCATED = range(5)
OUTCOME_STUCK, OUTCOME_DEAD = 5, 6  # the early ends (`SokobanEnv.end_on_blocked`, ``end_when_dead``)
OUTCOME_NAMES = ("ongoing", "solved", "out_of_moves", "invalid", "truncated", "stuck", "dead")
TRAIN, HELDOUT = 0, 1  # `SokobanStart.split`
GIVEN_ROOM = -1  # `SokobanStart.room` of a start that gives its room (`SokobanStart.given`): no table row

STEP_REWARD = -0.01
BOX_REWARD = 0.1  # per box pushed onto a target (minus per box pushed off one)
SOLVE_REWARD = 1.0
INVALID_REWARD = -1.0


@flax.struct.dataclass
class Rooms:
    """A split of rooms on the device (N rooms; `rooms.Split` on the host).

    Attributes:
      walls, targets, boxes: ``bool [N, H, W]``; player: ``int32 [N]`` flat cell; optimal: ``int32 [N]`` moves of
        the optimal solution.
    """

    walls: jax.Array
    targets: jax.Array
    boxes: jax.Array
    player: jax.Array
    optimal: jax.Array

    @classmethod
    def of(cls, split: rooms.Split) -> "Rooms":
        return cls(
            walls=jnp.asarray(split.walls),
            targets=jnp.asarray(split.targets),
            boxes=jnp.asarray(split.boxes),
            player=jnp.asarray(split.player, jnp.int32),
            optimal=jnp.asarray(split.optimal, jnp.int32),
        )


@flax.struct.dataclass
class SokobanStart:
    """Start record; every field has a leading ``[N]``.

    Attributes:
      split: ``int32`` `TRAIN` or `HELDOUT`; room: ``int32`` the room's index in that split.
      given: optional `Rooms`, one per start: the episode plays this room instead (``optimal``: its moves to solve,
        -1 if it cannot be solved), and ``split`` / ``room`` only label it (`GIVEN_ROOM` when it is no table room).
        The solver teacher looks its table up by ``split`` / ``room``, so it does not apply to given rooms (the warm
        start and the sampler never give one).
      steps: optional ``int32``: moves of the budget already made (None: 0), e.g. by a person on the play page.

    Without ``given`` and ``steps`` (None: no leaves) the record is the sampler's and the suites' two arrays: their
    pytree, and so the compiled rollout, stay as they were.
    """

    split: jax.Array
    room: jax.Array
    given: Rooms | None = None
    steps: jax.Array | None = None


@flax.struct.dataclass
class SokobanState:
    """One episode.

    Attributes:
      walls, targets, boxes: ``bool [H, W]``; player: ``int32 []`` flat cell.
      split, room: ``int32 []`` which room (the teacher's table is looked up by them).
      optimal: ``int32 []`` moves of the room's optimal solution.
      steps: ``int32 []`` moves made; blocked: ``int32 []`` of them that left the room unchanged.
      outcome: ``int32 []`` ``OUTCOME_*``.
    """

    walls: jax.Array
    targets: jax.Array
    boxes: jax.Array
    player: jax.Array
    split: jax.Array
    room: jax.Array
    optimal: jax.Array
    steps: jax.Array
    blocked: jax.Array
    outcome: jax.Array


@flax.struct.dataclass
class SokobanEnv(TextEnv):
    """Sokoban on a dataset of rooms.

    Attributes:
      train, heldout: the room splits (`Rooms`).
      max_steps: moves per episode (the step budget; the episode ends out of moves after it).
      num_boxes: boxes per room (static: the position keys' layout).
      coordinates: every room message also spells out the player's, the boxes' and the targets' row and column
        (`wording.coordinate_parts`): the tiny model learns the warm start's moves faster from them
        (docs/benchmarks.md, "Sokoban against #57's targets").
      move_outcomes: every room message also says what each move would do from there (open, push or
        blocked; `wording.outcome_parts`): the walls next to the player, as a line to read instead of cells to find.
      end_on_blocked, end_when_dead: the early ends of the module docstring.
    """

    train: Rooms
    heldout: Rooms
    max_steps: int = flax.struct.field(pytree_node=False, default=15)
    num_boxes: int = flax.struct.field(pytree_node=False, default=1)
    coordinates: bool = flax.struct.field(pytree_node=False, default=False)
    move_outcomes: bool = flax.struct.field(pytree_node=False, default=False)
    end_on_blocked: bool = flax.struct.field(pytree_node=False, default=False)
    end_when_dead: bool = flax.struct.field(pytree_node=False, default=False)

    truncation_reward = 0.0  # cut short by the conversation length: as running out of moves (the step costs paid)

    def __post_init__(self):
        if int(self.max_steps) < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")

    # ------------------------------------------------------------------------------------------------ host

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.train.walls.shape[1:])

    @property
    def _coordinates(self) -> int:  # `wording`'s switch: the number of boxes on the positions line, 0 for none
        return int(self.num_boxes) if self.coordinates else 0

    def chat(self):
        early = bool(self.end_on_blocked or self.end_when_dead)
        return wording.chat_spec(
            *self.shape,
            int(self.max_steps),
            self._coordinates,
            early_ends=early,
            move_outcomes=bool(self.move_outcomes),
        )

    def max_turns(self) -> int:
        return int(self.max_steps)

    def episode_metrics(self):
        out = {
            f"{name}_rate": interface.rate("outcome", equals=code, plot=name == "solved")
            for code, name in enumerate(OUTCOME_NAMES)
            if code != OUTCOME_ONGOING
            and (code != OUTCOME_STUCK or self.end_on_blocked)
            and (code != OUTCOME_DEAD or self.end_when_dead)
        }
        out["steps_mean"] = interface.mean_of("steps", plot=True)
        out["boxes_on_target_mean"] = interface.mean_of("boxes_on_target")
        out["blocked_mean"] = interface.mean_of("blocked")
        out["excess_moves_mean"] = interface.Metric(  # moves beyond the optimal solution, over solved rooms
            lambda info: np.asarray(info["steps"]) - np.asarray(info["optimal"]),
            where=lambda info: np.asarray(info["solved"], bool),
        )
        return out

    # ------------------------------------------------------------------------------------------------ traced

    def _info(self, state: SokobanState) -> dict[str, jax.Array]:
        return dict(
            outcome=state.outcome,
            solved=state.outcome == OUTCOME_SOLVED,
            invalid=state.outcome == OUTCOME_INVALID,
            steps=state.steps,
            boxes_on_target=rules.boxes_on_target(state.boxes, state.targets),
            blocked=state.blocked,
            optimal=state.optimal,
        )

    def _message(self, template, state: SokobanState) -> Message:
        return Message(
            template=jnp.asarray(template, jnp.int32),
            values=wording.cell_values(
                state.walls,
                state.targets,
                state.boxes,
                state.player,
                self._coordinates,
                move_outcomes=bool(self.move_outcomes),
            ),
        )

    def reset(self, start: SokobanStart) -> tuple[SokobanState, Message]:
        split = jnp.asarray(start.split, jnp.int32)
        if start.given is not None:  # a Python branch on the record's structure: table starts trace as before
            room = jax.tree.map(lambda a, like: jnp.asarray(a, like.dtype), start.given, self.train)
        else:
            pick = lambda train, heldout: jnp.where(  # noqa: E731
                split == HELDOUT,
                heldout[jnp.clip(start.room, 0, heldout.shape[0] - 1)],
                train[jnp.clip(start.room, 0, train.shape[0] - 1)],
            )
            room = jax.tree.map(pick, self.train, self.heldout)
        steps = jnp.int32(0) if start.steps is None else jnp.asarray(start.steps, jnp.int32)
        state = SokobanState(
            walls=room.walls,
            targets=room.targets,
            boxes=room.boxes,
            player=room.player,
            split=split,
            room=jnp.asarray(start.room, jnp.int32),
            optimal=room.optimal,
            steps=steps,
            blocked=jnp.int32(0),
            outcome=jnp.int32(OUTCOME_ONGOING),
        )
        return state, self._message(wording.USER_ROOM, state)

    def observation(self, state: SokobanState) -> Message:
        """The room as it is now (``reset``'s message at the start)."""
        return self._message(wording.USER_ROOM, state)

    def step(self, state: SokobanState, call: ToolCall) -> Step:
        live = state.outcome == OUTCOME_ONGOING
        direction = jnp.asarray(call.args, jnp.int32).reshape(-1)[0]
        valid = call.ok & (call.tool == 0) & (direction >= 0) & (direction < len(rules.DIRECTIONS))
        invalid = live & ~valid
        play = live & valid
        boxes, player, moved, _ = rules.move(state.walls, state.boxes, state.player, direction)
        boxes = jnp.where(play, boxes, state.boxes)
        player = jnp.where(play, player, state.player)
        steps = state.steps + play.astype(jnp.int32)
        solved = play & rules.solved(boxes, state.targets)
        out = play & ~solved & (steps >= int(self.max_steps))
        stuck = play & ~solved & ~moved if self.end_on_blocked else jnp.bool_(False)
        dead = (
            play & ~solved & rules.dead(state.walls, state.targets, boxes) if self.end_when_dead else jnp.bool_(False)
        )
        outcome = jnp.select(
            [invalid, solved, dead, stuck, out],
            [OUTCOME_INVALID, OUTCOME_SOLVED, OUTCOME_DEAD, OUTCOME_STUCK, OUTCOME_OUT_OF_MOVES],
            state.outcome,
        ).astype(jnp.int32)
        gained = rules.boxes_on_target(boxes, state.targets) - rules.boxes_on_target(state.boxes, state.targets)
        reward = jnp.where(
            play,
            STEP_REWARD + BOX_REWARD * gained + jnp.where(solved, SOLVE_REWARD, 0.0),
            jnp.where(invalid, INVALID_REWARD, 0.0),
        ).astype(jnp.float32)
        new = state.replace(
            boxes=boxes,
            player=player,
            steps=steps,
            blocked=state.blocked + (play & ~moved).astype(jnp.int32),
            outcome=outcome,
        )
        template = jnp.select(
            [invalid, solved, dead, stuck, out, play & ~moved],
            [
                wording.TOOL_INVALID,
                wording.TOOL_SOLVED,
                wording.TOOL_DEAD,
                wording.TOOL_STUCK,
                wording.TOOL_OUT_OF_MOVES,
                wording.TOOL_BLOCKED,
            ],
            wording.TOOL_MOVED,
        )
        return Step(
            state=new,
            message=self._message(template, new),
            reward=reward,
            done=outcome != OUTCOME_ONGOING,
            info=self._info(new),
        )

    def finish(self, state: SokobanState, info, truncated: jax.Array):
        cut = jnp.asarray(truncated) & (state.outcome == OUTCOME_ONGOING)
        return self._info(state.replace(outcome=jnp.where(cut, OUTCOME_TRUNCATED, state.outcome)))

    def state_key(self, state: SokobanState) -> jax.Array:
        """The position: the player's cell and the boxes' (`rules.position_key`). A group shares its room, so
        within a group equal keys are the same decision; across rooms (``rl.turn_scope=batch``) they are not."""
        return rules.position_key(state.boxes, state.player, int(self.num_boxes))
