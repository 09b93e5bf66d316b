"""The page's operations on one run, independent of HTTP: every failure is a `PlayError(status, message)`.

The run's environment decides the view: one that declares a board view (`interface.BoardView`, in its registry
entry) gets the board (a person plays the model, the heat map, the model's turns); one that declares a puzzle view
(`interface.PuzzleView`) gets the puzzle (a person moves in one of its puzzles, asks the model for a move with its
heat map, or lets the model play on to the end); any other gets transcripts (one episode of its sampler or of an
evaluation suite, played by the chosen checkpoint).

Model calls are serialised by one lock (JAX on a CPU gains nothing from concurrent calls, and the restored
parameters' LRU is shared); a request that cannot get the lock within `lock_timeout` seconds is answered "busy"
instead of waiting forever. Metrics and run information never take the lock, so curves keep refreshing while
the model works.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time

import jax
import numpy as np

from reno_jax.envs import interface
from reno_jax.loop import build, curriculum, host_envs
from reno_jax.play import host_episodes
from reno_jax.play import policy as policy_lib
from reno_jax.play import run_dir as run_dir_lib
from reno_jax.rollout import summary as summary_lib

# Curves the page draws first (those present in metrics.jsonl), before the environment's plotted figures.
LEADING_CURVES = ("rollout/rewards_mean", "rollout/tool_call_valid_rate")
SAMPLER = "sampler"  # the episode source that is the run's own training sampler
_LIVE_SECONDS = 300  # metrics.jsonl written this recently and the run not at num_steps: shown as training


class PlayError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class PlayService:
    """Args: workdir: a training run (raises `RunError` if it is not one); default_step: the step
    the page opens at (None: the latest); cache_size: restored checkpoints kept in memory."""

    def __init__(self, workdir: str, default_step: int | None = None, cache_size: int = 4, lock_timeout: float = 300.0):
        self.run = run_dir_lib.RunDir(workdir)
        config = self.run.config
        self.host_class = host_envs.host_env_class(config)  # None: a jitted environment
        self.entry = build.env_entry(config) if self.host_class is None else host_envs.play_entry(self.host_class)
        self.view = self.entry.board_view(config) if self.entry.board_view is not None else None
        self.default_curves = LEADING_CURVES + summary_lib.plotted_metrics(self.entry.make_env(config.env))
        self._decisions = None  # the jitted functions, built on the first model call (a run may have no checkpoint)
        self._episodes = None
        self._suites = None
        self.default_step = default_step
        self._cache_size = cache_size
        self._params = collections.OrderedDict()  # step -> params, least recently used first
        self._lock = threading.Lock()
        self._lock_timeout = lock_timeout

    @property
    def is_puzzle(self) -> bool:
        return isinstance(self.view, interface.PuzzleView)

    def _no_view(self) -> PlayError:
        return PlayError(
            404,
            f"environment {self.entry.name!r} declares no board view; its episodes are shown as transcripts "
            "(/api/episode)",
        )

    @property
    def decisions(self) -> policy_lib.Decisions:
        if self.view is None:
            raise self._no_view()
        if self._decisions is None:
            self._decisions = policy_lib.Decisions(
                self.run.config, self.run.tokenizer, self.run.model_config, self.entry, self.view
            )
        return self._decisions

    @property
    def episodes(self) -> policy_lib.Episodes:
        if self._episodes is None and self.host_class is not None:
            self._episodes = host_episodes.HostEpisodes(
                self.run.config, self.run.tokenizer, self.run.model_config, self.host_class
            )
        if self._episodes is None:
            self._episodes = policy_lib.Episodes(self.run.config, self.run.tokenizer, self.run.model_config)
        return self._episodes

    # -- run information ------------------------------------------------------------------------------------
    def board_info(self) -> dict | None:
        """The board view as the page draws it (None: a puzzle or the transcript view)."""
        v = self.view
        if v is None or self.is_puzzle:
            return None
        empty = np.zeros((v.rows, v.cols), np.int8)
        first = int(v.to_move(empty))
        # The model plays the side the run trained it on; a run that trained every side lets the person open.
        model_side = v.trained_side or next(k for k in range(1, len(v.sides) + 1) if k != first)
        return {
            "rows": v.rows,
            "cols": v.cols,
            "input": v.input,
            "chars": v.chars,
            "symbols": list(v.symbols),
            "colors": list(v.colors),
            "sides": list(v.sides),
            "num_actions": v.num_actions,
            "labels": [v.label(a) for a in range(v.num_actions)],
            "empty": v.format(empty),
            "first_side": first,
            "trained_side": v.trained_side,
            "model_side": model_side,
        }

    def puzzle_info(self) -> dict | None:
        """The puzzle view as the page draws it (None: a board or the transcript view)."""
        v = self.view
        if not self.is_puzzle:
            return None
        return {
            "rows": v.rows,
            "cols": v.cols,
            "chars": v.chars,
            "symbols": list(v.symbols),
            "colors": list(v.colors),
            "fills": None if v.fills is None else list(v.fills),
            "num_actions": v.num_actions,
            "labels": [v.label(a) for a in range(v.num_actions)],
            "action_symbols": None if v.action_symbols is None else list(v.action_symbols),
            "keys": None if v.action_keys is None else list(v.action_keys),
            "max_moves": int(v.max_moves),
            "suites": [{"name": name, "count": int(n)} for name, n in v.puzzles.items()],
            "solver": v.moves_to_solve is not None,
        }

    @property
    def eval_suites(self) -> dict:
        """The environment's evaluation suites (built once: some enumerate every position)."""
        if self._suites is None:
            entry = self.entry
            self._suites = dict(entry.eval_suites(self.run.config)) if entry.eval_suites is not None else {}
        return self._suites

    def suites(self) -> list[dict]:
        return [{"name": SAMPLER, "num_episodes": None}] + [
            {"name": name, "num_episodes": int(s.num_episodes)} for name, s in self.eval_suites.items()
        ]

    def info(self) -> dict:
        steps = self.run.steps()
        try:
            rows = self.run.metrics()
        except ValueError:  # a corrupt metrics row: /api/metrics says so; the run information still answers
            rows = []
        last = int(rows[-1]["step"]) if rows else 0
        num_steps = curriculum.total_steps(self.run.config)  # a curriculum's stages included
        path = os.path.join(self.run.workdir, "metrics.jsonl")
        recent = os.path.exists(path) and time.time() - os.path.getmtime(path) < _LIVE_SECONDS
        default = self.default_step if self.default_step in steps else (steps[-1] if steps else None)
        return {
            "workdir": self.run.workdir,
            "env": self.entry.name,
            "task": str(self.run.config.env.get("task", "")),
            "view": "transcript" if self.view is None else ("puzzle" if self.is_puzzle else "board"),
            "board": self.board_info(),
            "puzzle": self.puzzle_info(),
            "suites": self.suites(),
            "num_steps": num_steps,
            "last_metrics_step": last,
            "training": last < num_steps and (recent or not rows),
            "steps": steps,
            "default_step": default,
            "warm_start_step": run_dir_lib.WARM_START_STEP if run_dir_lib.WARM_START_STEP in steps else None,
            "greedy_by_default": True,
            "sampling_temperature": float(self.run.config.rollout.temperature),
        }

    def metrics(self, since: int = 0) -> dict:
        """Rows with `step > since` (numbers only; NaN/inf become None so the answer stays valid JSON)."""
        try:
            rows = self.run.metrics()
        except ValueError as e:  # a corrupt row in the middle of the file
            raise PlayError(500, f"metrics.jsonl cannot be read: {e}") from None
        keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "step"})
        new = [
            {
                k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in r.items()
                if isinstance(v, (int, float))
            }
            for r in rows
            if int(r.get("step", 0)) > since
        ]
        return {
            "rows": new,
            "keys": keys,
            "default_keys": [k for k in self.default_curves if k in keys],
            "last_step": int(rows[-1]["step"]) if rows else 0,
        }

    # -- checkpoints ----------------------------------------------------------------------------------------
    def resolve_step(self, step: int | None) -> int:
        steps = self.run.steps()
        if not steps:
            raise PlayError(
                409,
                f"no checkpoint yet in {self.run.workdir}: the run is still starting "
                "(neither the warm start nor a GSPO checkpoint has been saved); try again later",
            )
        if step is None:
            step = self.default_step if self.default_step in steps else steps[-1]
        if step not in steps:
            raise PlayError(404, f"no checkpoint at step {step}; saved steps: {steps}")
        return step

    def _params_at(self, step: int):
        if step in self._params:
            self._params.move_to_end(step)
            return self._params[step]
        try:
            params = self.run.restore_params(step)
        except run_dir_lib.CheckpointMissing as e:
            raise PlayError(404, f"{e}; saved steps: {self.run.steps()}") from None
        self._params[step] = params
        while len(self._params) > self._cache_size:
            self._params.popitem(last=False)
        return params

    # -- model ----------------------------------------------------------------------------------------------
    def _model_call(self, fn):
        if not self._lock.acquire(timeout=self._lock_timeout):
            raise PlayError(503, "the model is busy with other requests; try again in a moment")
        try:
            return fn()
        finally:
            self._lock.release()

    def _board_view(self) -> interface.BoardView:
        view = self.decisions.view
        if self.is_puzzle:
            raise PlayError(
                404,
                f"environment {self.entry.name!r} is a one-player puzzle, not a two-sided game: play it through "
                "/api/puzzle, /api/puzzle/move, /api/puzzle/model and /api/puzzle/solve",
            )
        return view

    def _puzzle_view(self) -> interface.PuzzleView:
        if self.view is None:
            raise self._no_view()
        if not self.is_puzzle:
            raise PlayError(404, f"environment {self.entry.name!r} declares a board, not a puzzle: use /api/play")
        return self.view

    def empty_board(self) -> str:
        view = self._board_view()
        return view.format(np.zeros((view.rows, view.cols), np.int8))

    def _board(self, text: str) -> np.ndarray:
        view = self.view
        if view is None:
            raise self._no_view()
        try:
            return view.parse(text)
        except ValueError as e:
            raise PlayError(400, str(e)) from None

    def policy(
        self, board: str, step: int | None = None, *, sampled: bool = False, seed: int = 0, moves: int = 0
    ) -> dict:
        """Heat map over the actions, the best actions and the model's reply on `board` (it plays the side to
        move; on a puzzle, the next move, with `moves` of the budget already made)."""
        decisions = self.decisions
        view = decisions.view
        cells = self._board(board)
        _check_seed(seed)
        if self.is_puzzle:
            self._check_moves(cells, moves)
        else:
            status = view.status(cells)
            if status != "ongoing":
                raise PlayError(
                    409, f"board {board!r} is finished ({status.replace('_', ' ')}): there is no move to make"
                )
        step = self.resolve_step(step)
        start = view.start(cells, int(moves)) if self.is_puzzle else None

        def run():
            params = self._params_at(step)
            heat = decisions.heat_map(params, cells)
            return heat, decisions.reply(params, cells, greedy=not sampled, seed=seed, start=start)

        heat, reply = self._model_call(run)
        side = None if self.is_puzzle else int(view.to_move(cells))
        return {
            "board": view.format(cells),
            "step": step,
            "side": None if side is None else view.sides[side - 1],
            "side_index": side,
            "legal": [bool(x) for x in view.legal(cells)],
            "best": self._best(cells),
            **heat,
            **reply,
        }

    def _best(self, cells: np.ndarray) -> list[int]:
        view = self.view
        return [int(a) for a in view.best_actions(cells)] if view.best_actions is not None else []

    def warm_up(self) -> None:
        """Builds the jitted functions and compiles them on the default checkpoint (if there is one yet), so the
        person's first click does not wait for XLA."""
        try:
            if self.is_puzzle:
                suite = next(iter(self.view.puzzles))
                self.policy(self.view.format(self.view.puzzle(suite, 0)))
            elif self.view is not None:
                self.policy(self.empty_board())
            else:
                self.episode()
        except PlayError:  # no checkpoint yet: the first request after one appears compiles instead
            pass

    def play(
        self, board: str, action: int | None, step: int | None = None, *, sampled: bool = False, seed: int = 0
    ) -> dict:
        """The person's `action` (0-based; None: the model moves first on `board`), then the model's reply.

        Returns the board after both moves, the game's `status` ("ongoing", "draw", "<side>_won", or
        "model_illegal" / "model_invalid": the model's call was refused, which loses the game as in training)
        and the model's turn (`model`, the `policy` answer for the position it faced; None if it did not move).
        """
        view = self._board_view()
        cells = self._board(board)
        status = view.status(cells)
        if status != "ongoing":
            raise PlayError(409, f"the game is over ({status.replace('_', ' ')}); start a new one")
        if action is not None:
            if not 0 <= int(action) < view.num_actions:
                raise PlayError(400, f"action must be 0..{view.num_actions - 1}, got {action}")
            if not bool(view.legal(cells)[action]):
                raise PlayError(409, f"{view.input} {view.label(action)} is not a legal move here; choose another")
            cells = view.apply(cells, int(action))
        after_person = view.format(cells)
        status = view.status(cells)
        model = None
        if status == "ongoing":
            model = self.policy(after_person, step, sampled=sampled, seed=seed)
            if model["verdict"] == "legal":
                status = view.status(view.parse(model["board_after"]))
            else:
                status = f"model_{model['verdict']}"
        return {
            "board": model["board_after"] if model else after_person,
            "after_person": after_person,
            "person_action": action,
            "person_label": None if action is None else view.label(action),
            "status": status,
            "model": model,
        }

    # -- puzzles --------------------------------------------------------------------------------------------
    def _check_moves(self, cells: np.ndarray, moves: int) -> None:
        """Refuses a puzzle that is over: solved, or `moves` at the budget (409), or a move count outside it (400)."""
        view = self._puzzle_view()
        if not 0 <= int(moves) <= int(view.max_moves):
            raise PlayError(400, f"moves must be in 0..{view.max_moves} (the move budget), got {moves}")
        status = view.status(cells, moves)
        if status == interface.SOLVED:
            raise PlayError(409, f"board {view.format(cells)!r} is solved: there is no move to make; load a puzzle")
        if status == interface.OUT_OF_MOVES:
            raise PlayError(409, f"out of moves ({moves} / {view.max_moves}): load the puzzle again")

    def _position(self, cells: np.ndarray, moves: int) -> dict:
        """What the page shows of a puzzle position: the board, the moves made, the status, the solver's count."""
        view = self._puzzle_view()
        left = view.moves_to_solve(cells) if view.moves_to_solve is not None else None
        return {
            "board": view.format(cells),
            "moves": int(moves),
            "max_moves": int(view.max_moves),
            "status": view.status(cells, moves),
            "moves_to_solve": None if left is None else int(left),
            "best": self._best(cells),
        }

    def puzzle(self, suite: str | None = None, index: int = 0) -> dict:
        """The `index`-th puzzle of `suite` (None: the view's first suite), no move made."""
        view = self._puzzle_view()
        suite = next(iter(view.puzzles)) if suite is None else suite
        if suite not in view.puzzles:
            raise PlayError(404, f"no puzzle suite {suite!r}; choose one of {list(view.puzzles)}")
        count = int(view.puzzles[suite])
        if not 0 <= index < count:
            raise PlayError(400, f"index must be in 0..{count - 1} for suite {suite!r}, got {index}")
        return {"suite": suite, "index": index, **self._position(view.puzzle(suite, index), 0)}

    def puzzle_move(self, board: str, action: int, moves: int = 0) -> dict:
        """The person's move `action` on `board` with `moves` made: the position after it (`blocked`: the move left
        the board as it was, and counts)."""
        view = self._puzzle_view()
        cells = self._board(board)
        self._check_moves(cells, moves)
        if not 0 <= int(action) < view.num_actions:
            raise PlayError(400, f"action must be 0..{view.num_actions - 1}, got {action}")
        after = view.apply(cells, int(action))
        return {
            **self._position(after, moves + 1),
            "before": view.format(cells),
            "action": int(action),
            "label": view.label(action),
            "blocked": bool(np.array_equal(after, cells)),
        }

    def puzzle_model(
        self, board: str, moves: int = 0, step: int | None = None, *, sampled: bool = False, seed: int = 0
    ) -> dict:
        """The model's move on `board` with `moves` made (the `policy` answer: heat map, text, verdict, the
        environment's answer) and the position after it; a call the puzzle does not know moves nothing."""
        model = self.policy(board, step, sampled=sampled, seed=seed, moves=moves)
        view = self.view
        cells = view.parse(model["board"])
        moved = model["verdict"] == "legal"
        after = view.parse(model["board_after"]) if moved else cells
        return {
            **self._position(after, moves + int(moved)),
            "blocked": moved and bool(np.array_equal(after, cells)),
            "model": model,
        }

    def puzzle_solve(
        self, board: str, moves: int = 0, step: int | None = None, *, sampled: bool = False, seed: int = 0
    ) -> dict:
        """The model plays from `board` to the end: the environment's episode from there with `moves` of its budget
        already made (`PuzzleView.start`), through the real rollout. Per turn: the model's text, the move it names,
        the board after it (its calls replayed through the view's rules), the environment's reward and tool
        response, and the heat map (with the best moves) on the board it faced. `ended` says why the model's play
        stopped: "solved", "out_of_moves", "invalid" (a call the puzzle does not know: the episode ends there, as
        in training) or "turn_limit" (the run's rollout.max_turns ran out first)."""
        view = self._puzzle_view()
        decisions = self.decisions
        cells = self._board(board)
        _check_seed(seed)
        self._check_moves(cells, moves)
        step = self.resolve_step(step)
        start, first = view.start(cells, int(moves)), cells

        def run():
            params = self._params_at(step)
            out = self.episodes.play(
                params, start, dict(view.decision_overrides), greedy=not sampled, seed=seed, with_calls=True
            )
            actions = [decisions.action_of_call(*call) for call in out["calls"]]
            afters = []  # the board after each turn (an invalid call moves nothing)
            for action in actions:
                before = afters[-1] if afters else first
                afters.append(before if action is None else view.apply(before, action))
            boards = [first, *afters[:-1]]  # the board each turn faced
            return out, actions, boards, afters, [decisions.heat_map(params, b) for b in boards]

        out, actions, boards, afters, heats = self._model_call(run)
        texts = [m for m in out["messages"] if m["role"] == "assistant"]
        answers = [m for m in out["messages"] if m["role"] == "tool"]
        turns, ended = [], "turn_limit"
        for t, (action, before, heat) in enumerate(zip(actions, boards, heats)):
            cells, moves = afters[t], moves + int(action is not None)
            turns.append(
                {
                    "turn": t,
                    "board": view.format(before),
                    "best": self._best(before),
                    **heat,
                    "text": texts[t]["content"],
                    "parse": texts[t]["parse"],
                    "action": action,
                    "label": None if action is None else view.label(action),
                    "verdict": "invalid" if action is None else "legal",
                    "blocked": action is not None and bool(np.array_equal(cells, before)),
                    "board_after": view.format(cells),
                    "moves": int(moves),
                    "reward": answers[t]["reward"],
                    "tool_response": answers[t]["content"],
                }
            )
            status = view.status(cells, moves)
            if action is None or status != "ongoing":
                ended = "invalid" if action is None else status
                break
        return {
            "step": step,
            "greedy": out["greedy"],
            "start_board": view.format(first),
            "turns": turns,
            "ended": ended,
            "reward": out["reward"],
            "info": out["info"],
            **self._position(cells, moves),
        }

    def episode(
        self, step: int | None = None, suite: str = SAMPLER, episode: int = 0, *, sampled: bool = False, seed: int = 0
    ) -> dict:
        """One episode played by the checkpoint at `step`: the `episode`-th of an evaluation `suite`, or one drawn
        by the run's training sampler (`suite="sampler"`, `seed` picks it); the conversation's messages."""
        _check_seed(seed)
        config = self.run.config
        if suite == SAMPLER:
            start, overrides = self.entry.make_sampler(config)(jax.random.PRNGKey(seed), 1), {}
        else:
            suites = self.eval_suites
            if suite not in suites:
                raise PlayError(404, f"no suite {suite!r}; choose {SAMPLER!r} or one of {sorted(suites)}")
            chosen = suites[suite]
            if not 0 <= episode < int(chosen.num_episodes):
                raise PlayError(
                    400, f"episode must be in 0..{int(chosen.num_episodes) - 1} for suite {suite!r}, got {episode}"
                )
            try:
                start = chosen.starts(jax.random.PRNGKey(seed), np.array([episode]))
            except ValueError as e:  # a suite that cannot start a single episode says why
                raise PlayError(400, f"suite {suite!r}: {e}") from None
            overrides = dict(chosen.env_overrides)
        step = self.resolve_step(step)
        out = self._model_call(
            lambda: self.episodes.play(self._params_at(step), start, overrides, greedy=not sampled, seed=seed)
        )
        return {"step": step, "suite": suite, "episode": episode if suite != SAMPLER else None, **out}


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 2**31:
        raise PlayError(400, f"seed must be in 0..2**31-1, got {seed}")
