"""`TextEnv`: the interface every tool-calling environment speaks (pure and `vmap`-able, as in pgx / gymnax).

The rollout knows nothing about any game. Per episode it only

    state, message = env.reset(start)                 # the first user message
    loop:  generate a turn -> parse its tool call -> env.step(state, call) -> render message -> prefill

An environment talks in *messages as data*: a `Message` picks one of the environment's text templates and gives
the integer values of its slots (`reno_jax.protocol.chat`); the protocol layer turns it into tokens in jit with
the tokenizer's own chat template. A tool call reaches the environment already parsed (`ToolCall`), by the
token automaton compiled from the environment's tool schemas (`reno_jax.protocol.toolcall`). So an environment is
a few pure functions over its own state pytree, and the same environment drives the rollout, the supervised
warm-start transcripts (`reno_jax.rl.sft`) and evaluation.

Writing one (see `reno_jax.envs.guess_number`, a whole environment in one class, and docs/environments.md):

  * subclass `TextEnv` as a `flax.struct.dataclass`: array fields (lookup tables, datasets) are pytree leaves,
    everything else is `flax.struct.field(pytree_node=False)` (with a default, such a field is an option the
    command line sets: ``--config.env.NAME=value``);
  * `chat()` declares the system prompt, the tool schemas and the message templates (host, once);
  * `reset(start)` and `apply(state, call)` (the step of a well-formed call; the base class's `step` ends the
    episode on any other) are per episode (the rollout vmaps them), branch-free (`jnp.where`, `lax.select`), and
    take their randomness from keys inside `start` / `state` (no hidden RNG);
  * `info` is the environment's own dict of per-episode figures (`[]` leaves, the same structure every step);
    `finish` may fix it up at the end (e.g. mark truncation); `episode_metrics` declares the figures a batch of it
    reduces to, each with its reduction (`Metric`);
  * `sample_starts(key, num_groups)` draws a training step's start records; `teacher()`, `eval_suites()`,
    `board_view()` and `tokenizer_corpus()` optionally give the warm start's scripted policy (`Teacher`), the
    evaluations (`EvalSuite`), the play page's board (`BoardView`, or `PuzzleView` for a one-player puzzle) and
    tokenizer texts;
  * a class attribute `name` and `@registry.register_env` make it what ``--config.env.name`` looks up.

The built-in board games judge invalid calls in their own `step` (their outcome codes fold them in) and register
through the lower-level `registry.register`, whose factories take the config.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Iterable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from reno_jax.protocol.messages import Message, ToolCall  # noqa: F401  (the interface speaks them)

PyTree = Any


@flax.struct.dataclass
class Step:
    """What `TextEnv.step` returns for one episode.

    Attributes:
      state: the next environment state.
      message: the tool response to show (only rendered when the episode goes on).
      reward: ``float32 []`` reward of this step (the episode's reward is the sum over its steps).
      done: ``bool []`` the episode ends here.
      info: the environment's per-episode figures after this step (same pytree structure every step).
    """

    state: PyTree
    message: Message
    reward: jax.Array
    done: jax.Array
    info: PyTree


class TextEnv(abc.ABC):
    """A tool-calling environment; subclasses are `flax.struct.dataclass`es (so an env is a pytree argument of the
    jitted rollout). All methods except `chat` and `metrics` must be traceable, per episode, without batch axes."""

    #: reward given to an episode that runs out of conversation length or turns before it is done
    truncation_reward: float = -1.0
    #: the default `step`'s reward for a call `call_valid` rejects, and the tool template it answers with (an index
    #: into ``chat().tool``; negative from the end)
    invalid_call_reward: float = -1.0
    invalid_message: int = -1

    @abc.abstractmethod
    def chat(self):
        """Host: the `reno_jax.protocol.chat.ChatSpec` (system prompt, tool schemas, message templates)."""

    @abc.abstractmethod
    def reset(self, start: PyTree) -> tuple[PyTree, Message]:
        """``start`` (one episode's slice of the environment's start record) -> ``(state, first user message)``."""

    def step(self, state: PyTree, call: ToolCall) -> Step:
        """Applies the agent's parsed call (any kind). Default: `apply` for the calls `call_valid` accepts; any
        other call ends the episode with `invalid_call_reward`, the state unchanged, the tool template
        `invalid_message` and the figures `invalid_info` gives, with ``invalid`` True (so `apply`'s info must be a
        dict without an ``invalid`` key). An environment that judges invalid calls itself overrides `step`."""
        applied = self.apply(state, call)
        if not isinstance(applied.info, dict) or "invalid" in applied.info:
            raise TypeError(
                f"{type(self).__name__}.apply must return a Step whose info is a dict without an 'invalid' key (the "
                "default step adds it); override step to judge invalid calls yourself"
            )
        bad = ~self.call_valid(state, call)
        where = lambda new, old: jnp.where(bad, old, new)  # noqa: E731
        template = self.invalid_message % len(self.chat().tool)
        message = applied.message.replace(
            template=where(applied.message.template, jnp.int32(template)),
            values=where(applied.message.values, jnp.zeros_like(applied.message.values)),
        )
        figures = self.invalid_info(state, applied.info)
        if not isinstance(figures, dict) or set(figures) != set(applied.info):
            raise TypeError(f"{type(self).__name__}.invalid_info must return a dict with apply's info keys")
        info = {k: where(v, jnp.asarray(figures[k], v.dtype)) for k, v in applied.info.items()}
        return Step(
            state=jax.tree.map(where, applied.state, state),
            message=message,
            reward=where(applied.reward, jnp.float32(self.invalid_call_reward)).astype(jnp.float32),
            done=applied.done | bad,
            info={**info, "invalid": bad},
        )

    def apply(self, state: PyTree, call: ToolCall) -> Step:
        """The step of a call `call_valid` accepts (what the default `step` calls; it is traced for every call, and
        its result is replaced for invalid ones, whose arguments are 0)."""
        raise NotImplementedError(f"{type(self).__name__} must define step(state, call) or apply(state, call)")

    def invalid_info(self, state: PyTree, info: dict) -> dict:
        """The figures of an episode that ends on an invalid call at `state` (`info`: what `apply` computed, for
        its keys and dtypes). Default: every figure 0; override to keep counts the episode made before it."""
        del state
        return {k: jnp.zeros_like(v) for k, v in info.items()}

    def call_valid(self, state: PyTree, call: ToolCall) -> jax.Array:
        """``bool []``: the call is one `apply` takes. Default: the tool-call automaton accepted it (a known tool,
        arguments of the schema's types and ranges)."""
        del state
        return call.ok

    # ---- what the loop needs beyond the episode: one object answers all of it (`registry.register_env`) ----

    @classmethod
    def from_options(cls, **options) -> "TextEnv":
        """The environment with its options (`option_defaults` names them) set; override to build tables from them.
        Default: ``cls(**options)``."""
        return cls(**options)

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The settings ``--config.env.NAME=value`` may change: the dataclass fields that are not pytree leaves
        and have a default, with those defaults (a value must have its default's type)."""
        return {
            f.name: f.default
            for f in dataclasses.fields(cls)
            if not f.metadata.get("pytree_node", True) and f.default is not dataclasses.MISSING
        }

    def sample_starts(self, key: jax.Array, num_groups: int) -> PyTree:
        """Host, once per training step: the step's start records, one per group (arrays with a leading group
        axis; `reset` gets one group's slice)."""
        raise NotImplementedError(f"{type(self).__name__} must define sample_starts(key, num_groups)")

    def teacher(self) -> "Teacher | None":
        """The scripted policy of the supervised warm start, or None (no warm start)."""
        return None

    def eval_suites(self) -> Mapping[str, "EvalSuite"]:
        """The evaluations the environment offers, by name. Default: none."""
        return {}

    def board_view(self) -> "BoardView | PuzzleView | None":
        """How the play page draws the board and lets a person play on it (a two-sided game's `BoardView`, a
        one-player puzzle's `PuzzleView`), or None (transcripts only)."""
        return None

    def tokenizer_corpus(self) -> Iterable[str]:
        """Texts of the environment's own for a per-run tokenizer (``model.tokenizer="env"``), beside its
        rendered chat. Default: none."""
        return ()

    def for_member(self, state: PyTree, member: jax.Array) -> PyTree:
        """The state after ``reset`` of a group's ``member``-th episode (``int32 []``, 0..G-1): where the
        environment's own randomness (an opponent's) should differ between the episodes of a group. The first user
        message stays the group's (the rollout prefills it once per group). Default: the same state."""
        del member
        return state

    def finish(self, state: PyTree, info: PyTree, truncated: jax.Array) -> PyTree:
        """The episode's final info; ``truncated`` (``bool []``) says the rollout cut it short. Default: ``info``."""
        del state, truncated
        return info

    def state_key(self, state: PyTree) -> jax.Array | None:
        """``int32 [] >= 0`` naming the decision point ``state`` puts the agent at, equal exactly when two episodes
        of a group face the same choice (e.g. guess_number's interval and guesses made). The rollout records it
        for every turn, and `rl.turn_advantage_coef` compares turns of a group taken from the same key
        (`reno_jax.rl.losses.turn_advantages`). Keys are compared within a group only, so they need not cover what
        the group's start fixes; with `rl.turn_scope="batch"` they are compared across the batch, for keys that
        name what the agent knows (its observations so far), not the start's hidden parts. Default: None (no
        keys; turn advantages are then 0)."""
        del state
        return None

    def observation(self, state: PyTree) -> Message:
        """The user message that shows the agent ``state`` as it is now (a user template), for bounded history
        (``rollout.history``): each turn's prompt is the system prompt, the last k exchanges and this message, so
        it must hold everything the next call may depend on beyond those exchanges (a board, the interval left).
        At the state ``reset`` returns it should be ``reset``'s own message. Default: the environment does not
        support bounded history."""
        del state
        raise NotImplementedError(
            f"{type(self).__name__} has no observation(state) (the current state as a user message), so it cannot "
            "run with bounded history (rollout.history); use rollout.history=None (the whole conversation)"
        )

    def episode_metrics(self) -> Mapping[str, "Metric"]:
        """Host: the figures a batch of final infos reduces to, by name (logged as ``rollout/<name>`` in training,
        ``<suite>/<name>`` in evaluation). Default: none declared, and `summarize` takes the mean of every info
        leaf."""
        return {}

    def max_turns(self) -> int:
        """Upper bound on agent turns per episode (the rollout runs ``min(this, rollout max_turns)``)."""
        return 1 << 30


# ---------------------------------------------------------------------------------------------- figures

REDUCTIONS = {"mean": np.mean, "sum": np.sum, "min": np.min, "max": np.max}


@dataclasses.dataclass(frozen=True)
class Metric:
    """One figure of a batch of episodes, declared by the environment that defines it.

    Attributes:
      value: host ``info -> [B]`` per-episode values from a batch of final infos (NumPy arrays).
      reduce: how the batch reduces them: ``"mean"``, ``"sum"``, ``"min"`` or ``"max"``.
      where: optional host ``info -> bool [B]``: only those episodes count (NaN when there are none).
      plot: the figure gets a panel in the run's learning curves.
    """

    value: Callable[[Mapping[str, np.ndarray]], Any]
    reduce: str = "mean"
    where: Callable[[Mapping[str, np.ndarray]], Any] | None = None
    plot: bool = False

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {sorted(REDUCTIONS)}, got {self.reduce!r}")

    def __call__(self, info: Mapping[str, np.ndarray]) -> float:
        values = np.asarray(self.value(info), np.float64)
        if self.where is not None:
            values = values[np.asarray(self.where(info), bool)]
            if values.size == 0:
                return float("nan")
        return float(REDUCTIONS[self.reduce](values))


def rate(key: str, equals: Any = None, where: Callable | None = None, plot: bool = False) -> Metric:
    """The share of episodes whose ``info[key]`` is true (or equals ``equals``)."""
    if equals is None:
        return Metric(lambda info: np.asarray(info[key], bool), where=where, plot=plot)
    return Metric(lambda info: np.asarray(info[key]) == equals, where=where, plot=plot)


def mean_of(key: str, plot: bool = False) -> Metric:
    """The mean of ``info[key]`` over episodes."""
    return Metric(lambda info: info[key], plot=plot)


def summarize(env: TextEnv, info: Mapping[str, Any]) -> dict[str, float]:
    """The environment's figures of a batch of final infos (host), by their declared names; an environment that
    declares none gets the mean of every info leaf."""
    info = {k: np.asarray(v) for k, v in info.items()}
    declared = env.episode_metrics()
    if not declared:
        return {k: float(np.mean(v.astype(np.float64))) for k, v in info.items()}
    return {name: metric(info) for name, metric in declared.items()}


# ---------------------------------------------------------------------------------------------- companions


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A scripted policy for the supervised warm start (``reno_jax.rl.sft.env_transcripts``).

    Attributes:
      policy: traceable per episode ``(state, key) -> (row int32 [], support bool [R])``: the row of `calls` to
        play and the rows it could have played (the soft targets of ``sft.soft_targets``); it may also return a
        third value, ``weight float32 []``: how much this decision counts in the soft-target loss (1: as any
        other; e.g. more for the rare positions that decide a game).
      calls: the R calls as ``(tool_name, {argument: value})``, written out as the policy would write them.
    """

    policy: Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]
    calls: tuple

    def __post_init__(self):
        if not self.calls:
            raise ValueError("a Teacher needs at least one call")


@dataclasses.dataclass(frozen=True)
class EvalSuite:
    """A fixed evaluation an environment declares (``registry.register(eval_suites=...)``).

    ``num_episodes`` episodes, numbered 0..N-1, are played greedily, one per start, in the environment built with
    ``env_overrides`` (e.g. another opponent, or training-only shaping turned off). ``starts(key, ids)`` gives the
    start records of episodes ``ids`` (``int [n]``): the same key and ids give the same starts. The figures are the
    environment's `episode_metrics` plus ``extra(info, ids)`` (host, ``[N]`` arrays) where given.

    ``default``: run when no suite is named (``experiments.evaluate``) and by evaluation during training.
    ``scalable``: ``num_episodes`` may be changed (games drawn at random); a fixed set (every position, every
    secret) is only cut short.
    """

    num_episodes: int
    starts: Callable[[jax.Array, np.ndarray], Any]
    env_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra: Callable[[Mapping[str, np.ndarray], np.ndarray], Mapping[str, float]] | None = None
    default: bool = True
    scalable: bool = False

    def __post_init__(self):
        if int(self.num_episodes) < 1:
            raise ValueError(f"an EvalSuite needs at least one episode, got {self.num_episodes}")


# ---------------------------------------------------------------------------------------------- play-page views

ONGOING = 0  # `BoardView.result`: the game goes on
DRAW = -1  # `BoardView.result`: nobody won; k >= 1: side k won
INPUTS = ("cell", "column")
SOLVED, OUT_OF_MOVES = "solved", "out_of_moves"  # `PuzzleView.status`, beside "ongoing"


class _Grid:
    """What the play page's two views share: a board is a NumPy ``int8 [rows, cols]`` array of cell values, in the
    API the string of its `chars` row by row from the top left; an action is an int 0..num_actions-1 with a label.
    Uses the view's fields ``rows``, ``cols``, ``chars``, ``symbols``, ``colors``, ``call_actions``, ``check``,
    ``action_labels`` and its ``num_actions``."""

    def _check_grid(self) -> None:
        """Raises ValueError for a geometry, a cell alphabet or labels that do not fit together."""
        name = type(self).__name__
        if int(self.rows) < 1 or int(self.cols) < 1:
            raise ValueError(f"{name} needs rows, cols >= 1, got {self.rows} x {self.cols}")
        values = len(self.chars)
        if len(set(self.chars)) != values or len(self.symbols) != values or len(self.colors) != values:
            raise ValueError(f"{name}.chars (distinct), symbols and colors need one entry per cell value")

    def label(self, action: int) -> str:
        return str(self.action_labels[action]) if self.action_labels is not None else str(int(action) + 1)

    def actions_of_rows(self, num_rows: int) -> np.ndarray:
        """``int32 [num_rows]``: the action of each teacher call row; raises ValueError when they do not fit."""
        actions = np.arange(num_rows) if self.call_actions is None else np.asarray(self.call_actions)
        if actions.shape != (num_rows,) or np.any(actions < 0) or np.any(actions >= self.num_actions):
            raise ValueError(
                f"{type(self).__name__}.call_actions must give one action in 0..{self.num_actions - 1} per "
                f"teacher call row ({num_rows} rows)"
            )
        return actions.astype(np.int32)

    def format(self, board) -> str:
        return "".join(self.chars[int(v)] for v in np.asarray(board).reshape(-1))

    def parse(self, text: str) -> np.ndarray:
        """``int8 [rows, cols]`` of a board string; raises ValueError (one line) for a malformed or impossible one.
        Letters of either case are read when the characters are all of one case (X and x alike)."""
        n = self.rows * self.cols
        if not isinstance(text, str) or len(text) != n:
            raise ValueError(f"a board is {n} characters of {self.chars!r}, row by row from the top left; got {text!r}")
        if self.chars == self.chars.lower():
            text = text.lower()
        elif self.chars == self.chars.upper():
            text = text.upper()
        bad = sorted({c for c in text if c not in self.chars})
        if bad:
            raise ValueError(f"a board is {n} characters of {self.chars!r}; {text!r} has {''.join(bad)!r}")
        board = np.array([self.chars.index(c) for c in text], np.int8).reshape(self.rows, self.cols)
        if self.check is not None:
            self.check(board)
        return board


@dataclasses.dataclass(frozen=True)
class BoardView(_Grid):
    """How a person plays an environment's board on the play page (`reno_jax.play`), declared by the environment
    (``registry.register(board_view=lambda config: BoardView(...))``) so that the page itself knows no game. For a
    two-sided placement game; a one-player puzzle declares a `PuzzleView` instead.

    A board is a NumPy ``int8 [rows, cols]`` array of cell values (0 empty, k a piece of side k); in the API it is
    the string of its `chars`, row by row from the top left. An action is an int: the cell ``r * cols + c``
    (``input="cell"``: the person clicks a cell) or the column ``c`` (``input="column"``: the person drops a piece
    in a column), 0-based.

    The model is asked through the environment itself: `decision_start` is the start record of a one-decision
    episode at a board (built with `decision_overrides`), so its prompt, its generated call, the jitted parser and
    the environment's verdict are those of a rollout. The heat map is the model's distribution over the rows of
    the environment's `Teacher.calls` at their choice token (``sft.CallTable.choice_offset``); `call_actions`
    says which action each row is.

    Attributes:
      rows, cols: the board's geometry.
      input: ``"cell"`` or ``"column"``.
      chars: one character per cell value in board strings (e.g. ``".xo"``).
      symbols: what a cell of each value shows (e.g. ``("", "X", "O")``).
      colors: a CSS colour per cell value (its symbol's, or the disc's).
      sides: side k's name is ``sides[k - 1]`` (its pieces have cell value k).
      to_move: ``board -> side`` to move.
      legal: ``board -> bool [num_actions]``.
      apply: ``(board, legal action) -> board`` with the side to move's piece placed (a new array).
      result: ``board -> int``: `ONGOING`, `DRAW` or the side that won.
      decision_start: ``board -> start record`` (leading axis 1) of a one-decision episode at an ongoing ``board``,
        the model playing its side to move.
      decision_overrides: ``make_env`` overrides of that episode's environment.
      call_actions: the action of each `Teacher.calls` row; None: row k is action k.
      check: optional ``board -> None`` raising ValueError (one line) for a position no game reaches.
      best_actions: optional ``board -> [actions]``: the best ones (starred on the page).
      trained_side: the side the run's model was trained to play (the page's default for the model); None: all.
      action_labels: how the page and the log name each action; None: ``str(action + 1)``.
    """

    rows: int
    cols: int
    input: str
    chars: str
    symbols: tuple
    colors: tuple
    sides: tuple
    to_move: Callable[[np.ndarray], int]
    legal: Callable[[np.ndarray], np.ndarray]
    apply: Callable[[np.ndarray, int], np.ndarray]
    result: Callable[[np.ndarray], int]
    decision_start: Callable[[np.ndarray], Any]
    decision_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    call_actions: tuple | None = None
    check: Callable[[np.ndarray], None] | None = None
    best_actions: Callable[[np.ndarray], Any] | None = None
    trained_side: int | None = None
    action_labels: tuple | None = None

    def __post_init__(self):
        if self.input not in INPUTS:
            raise ValueError(f"BoardView.input must be one of {list(INPUTS)}, got {self.input!r}")
        self._check_grid()
        if len(self.sides) != len(self.chars) - 1:
            raise ValueError(f"BoardView.sides names sides 1..{len(self.chars) - 1} (cell values after empty)")
        if self.trained_side is not None and not 1 <= int(self.trained_side) <= len(self.sides):
            raise ValueError(f"BoardView.trained_side must be in 1..{len(self.sides)} or None")
        if self.action_labels is not None and len(self.action_labels) != self.num_actions:
            raise ValueError(f"BoardView.action_labels needs {self.num_actions} labels")

    @property
    def num_actions(self) -> int:
        return int(self.rows * self.cols if self.input == "cell" else self.cols)

    def status(self, board) -> str:
        """``"ongoing"``, ``"draw"`` or ``"<side>_won"`` (the side's name in lower case)."""
        code = int(self.result(board))
        if code == ONGOING:
            return "ongoing"
        if code == DRAW:
            return "draw"
        return f"{self.sides[code - 1].lower()}_won"


@dataclasses.dataclass(frozen=True)
class PuzzleView(_Grid):
    """How a person plays a one-player puzzle on the play page: a board from the environment's own puzzles, moves
    made one at a time against a move budget, until it is solved or the budget is spent. Declared like a
    `BoardView` (``registry.register(board_view=lambda config: PuzzleView(...))``: the page tells the two apart).

    Boards and actions are written as in `BoardView`; an action is a move (``action_labels[a]``). Every move may be
    made on every board that is not solved (`legal` is all true): a blocked one leaves the board as it is and still
    counts, as in the environment's episode.

    The model is asked through the environment itself: `start` is the start record of the environment's episode
    at a board with some moves of the budget already made. Its first turn is the model's move (the heat map and the
    reply, as for a board); the whole episode is the model playing from there to the end, within the moves left.

    Attributes:
      rows, cols: the board's geometry.
      chars: one character per cell value in board strings.
      symbols: what a cell of each value shows; colors: a CSS colour per value (its symbol's).
      fills: optional CSS background per cell value (None: the page's).
      action_labels: each move's name (e.g. ``("up", "down", "left", "right")``); their number is `num_actions`.
      action_symbols: optional, what the page's move buttons show beside the label (e.g. arrows).
      action_keys: optional, the keyboard key of each move (``KeyboardEvent.key`` names, e.g. ``"ArrowUp"``).
      max_moves: the move budget (the environment's).
      apply: ``(board, action) -> board`` after the move (a new array; the same cells when the move is blocked).
      solved: ``board -> bool``.
      puzzles: the environment's puzzles, ``{suite name: count}`` (the first is the page's default).
      puzzle: ``(suite, index) -> board``, 0 <= index < ``puzzles[suite]``.
      start: ``(board, moves) -> start record`` (leading axis 1) of the episode at ``board`` with ``moves`` of the
        budget made.
      decision_overrides: ``make_env`` overrides of that episode's environment.
      call_actions: the action of each `Teacher.calls` row; None: row k is action k.
      check: optional ``board -> None`` raising ValueError (one line) for a board no puzzle has.
      moves_to_solve: optional ``board -> int | None``: the fewest moves that solve it (None: it cannot be solved
        any more).
      best_actions: optional ``board -> [actions]``: the moves on a shortest solution (starred on the page).
    """

    rows: int
    cols: int
    chars: str
    symbols: tuple
    colors: tuple
    action_labels: tuple
    max_moves: int
    apply: Callable[[np.ndarray, int], np.ndarray]
    solved: Callable[[np.ndarray], bool]
    puzzles: Mapping[str, int]
    puzzle: Callable[[str, int], np.ndarray]
    start: Callable[[np.ndarray, int], Any]
    fills: tuple | None = None
    action_symbols: tuple | None = None
    action_keys: tuple | None = None
    decision_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    call_actions: tuple | None = None
    check: Callable[[np.ndarray], None] | None = None
    moves_to_solve: Callable[[np.ndarray], int | None] | None = None
    best_actions: Callable[[np.ndarray], Any] | None = None

    def __post_init__(self):
        self._check_grid()
        if not self.action_labels:
            raise ValueError("PuzzleView.action_labels needs one label per move (at least one)")
        for what in ("fills", "action_symbols", "action_keys"):
            given, want = getattr(self, what), len(self.chars) if what == "fills" else self.num_actions
            if given is not None and len(given) != want:
                raise ValueError(f"PuzzleView.{what} needs {want} entries, got {len(given)}")
        if int(self.max_moves) < 1:
            raise ValueError(f"PuzzleView.max_moves must be >= 1, got {self.max_moves}")
        if not self.puzzles or any(int(n) < 1 for n in self.puzzles.values()):
            raise ValueError(f"PuzzleView.puzzles needs suites with at least one puzzle each, got {dict(self.puzzles)}")

    @property
    def num_actions(self) -> int:
        return len(self.action_labels)

    def legal(self, board) -> np.ndarray:
        """``bool [num_actions]``: every move (a blocked one leaves the board as it is)."""
        del board
        return np.ones((self.num_actions,), bool)

    def decision_start(self, board) -> Any:
        """The episode at ``board`` with no move made (the heat map's prompt: the move count is not shown)."""
        return self.start(board, 0)

    def status(self, board, moves: int) -> str:
        """``"solved"``, ``"out_of_moves"`` (``moves`` reached the budget unsolved) or ``"ongoing"``."""
        if bool(self.solved(board)):
            return SOLVED
        return OUT_OF_MOVES if int(moves) >= int(self.max_moves) else "ongoing"
