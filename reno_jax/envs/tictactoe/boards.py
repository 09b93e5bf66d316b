"""Board datasets for the move task (host side, NumPy).

* ``generate_boards``: AReno's generator (``examples/agentic/tictactoe/dataset_generator.py``) re-done with a NumPy
  ``Generator``: play 0..6 uniformly random legal moves from the empty board (stop early at a terminal position),
  add one random O move if O is to move, keep the position only if it is non-terminal with X to move and not seen
  before. Positions therefore have 0, 2, 4 or 6 stones.
* ``exhaustive_x_to_move``: every non-terminal position with X to move reachable in play (2423 of them).
* ``train_heldout_split``: seeded split of a board list.
* JSONL I/O. We write ``{"id": "board-00000", "board": "X.O......"}``: the board is a 9-character string, squares
  1..9 row-major, ``X``/``O`` for stones and ``.`` for empty. The loader is tolerant: it also reads AReno's records
  (``"board": [["X", ".", "."], [".", "O", "."], [".", ".", "."]]``), lists of 9 cells (strings or 0/1/2 ints),
  lists of 3 row strings, and rendered text such as ``"X 2 O\\n4 5 6\\n7 8 9"`` where a digit labels an empty
  square.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from reno_jax.envs.tictactoe import minimax
from reno_jax.envs.tictactoe import rules as ttt

ARENO_DEFAULT_SEED = 2026  # the seed in AReno's README command
DEFAULT_COUNT = 2048
MAX_RANDOM_MOVES = 6
SIDES = ("x", "both")  # generate_boards: X to move only (AReno), or either side
SOURCES = ("random", "play")  # config env.board_source: generate_boards or play_boards

_EMPTY_CHARS = frozenset(".-_ ")  # "" (an empty list cell) is handled separately
_SEPARATORS = " \t\r\n|,;"


# ----------------------------------------------------------------------------------------------------------------
# Host-side rules on NumPy boards (int8 [9])
# ----------------------------------------------------------------------------------------------------------------


def _np_winner(board: np.ndarray) -> int:
    for player in (ttt.X, ttt.O):
        bits = int(((board == player).astype(np.int32) * ttt._BIT_WEIGHTS).sum())
        if any((bits & int(m)) == int(m) for m in ttt.LINE_BITS):
            return player
    return ttt.EMPTY


def np_is_terminal(board: np.ndarray) -> bool:
    """Host check: a line exists or the board is full."""
    return _np_winner(board) != ttt.EMPTY or not (board == ttt.EMPTY).any()


def np_to_move(board: np.ndarray) -> int:
    """Host check: 1 (X) when #X <= #O else 2 (O), as in ``tictactoe.to_move_from_counts``."""
    return ttt.X if int((board == ttt.X).sum()) <= int((board == ttt.O).sum()) else ttt.O


def is_x_to_move_playable(board: np.ndarray) -> bool:
    """Non-terminal, #X == #O (X to move in play)."""
    board = np.asarray(board)
    return int((board == ttt.X).sum()) == int((board == ttt.O).sum()) and not np_is_terminal(board)


def board_code_np(boards: np.ndarray) -> np.ndarray:
    """Base-3 codes, ``int32 [...]`` for boards ``[..., 9]``."""
    return (np.asarray(boards).astype(np.int32) * ttt._POW3).sum(-1).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _terminal_by_code() -> list[bool]:
    """``terminal[code]`` for all 3**9 codes, as a Python list (fast scalar indexing in the generator loop)."""
    all_boards = minimax.all_boards_numpy()
    full = ~(all_boards == ttt.EMPTY).any(-1)
    lines = minimax._lines_numpy(all_boards, ttt.X) | minimax._lines_numpy(all_boards, ttt.O)
    return (full | lines).tolist()


def _random_position(rng: np.random.Generator, max_random_moves: int, x_to_move: bool = True) -> np.ndarray:
    terminal = _terminal_by_code()
    board = [ttt.EMPTY] * ttt.NUM_SQUARES
    code = 0
    player = ttt.X
    for _ in range(int(rng.integers(0, max_random_moves + 1))):
        if terminal[code]:
            break
        empty = [i for i, v in enumerate(board) if v == ttt.EMPTY]
        i = empty[int(rng.integers(len(empty)))]
        board[i] = player
        code += player * 3**i
        player = ttt.O if player == ttt.X else ttt.X
    empty = [i for i, v in enumerate(board) if v == ttt.EMPTY]
    # An odd number of moves leaves O to move: add one O stone so the record is an X-to-move position.
    # (Done even after a terminal stop, as AReno does; such positions stay terminal and are discarded later.)
    if x_to_move and player == ttt.O and empty:
        board[empty[int(rng.integers(len(empty)))]] = ttt.O
    return np.array(board, np.int8)


def generate_boards(
    n: int = DEFAULT_COUNT,
    seed: int = ARENO_DEFAULT_SEED,
    max_random_moves: int = MAX_RANDOM_MOVES,
    sides: str = "x",
) -> np.ndarray:
    """``int8 [n, 9]`` unique non-terminal X-to-move positions, reproducible for ``seed``.

    ``sides="both"``: positions with either side to move: an odd number of random moves leaves O to move instead of
    getting AReno's extra O stone, so 0..``max_random_moves`` stones of both parities come out (for a policy that
    also plays O). ``"x"`` (default) is AReno's generator.

    With the default ``max_random_moves=6`` only 2201 distinct positions can come out (1 empty board, 72 with two
    stones, 756 with four, 1372 with six), so AReno's ``n=2048`` covers 93% of them and is mostly a reordering
    between seeds; later positions take more attempts to find (about 13k attempts for 2048, under a second).

    Raises:
      ValueError: bad ``n``/``max_random_moves``, or too few distinct positions exist for ``n`` (after ``100 n``
        attempts, as in AReno).
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0 <= max_random_moves <= ttt.NUM_SQUARES:
        raise ValueError(f"max_random_moves must be in [0, 9], got {max_random_moves}")
    if sides not in SIDES:
        raise ValueError(f"sides must be one of {SIDES}, got {sides!r}")
    x_only = sides == "x"
    rng = np.random.default_rng(seed)
    seen: set[bytes] = set()
    out: list[np.ndarray] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(
                f"could only find {len(out)} distinct {'X-to-move ' if x_only else ''}positions for n={n} with "
                f"max_random_moves={max_random_moves} after {attempts - 1} attempts; ask for fewer boards"
            )
        board = _random_position(rng, max_random_moves, x_only)
        key = board.tobytes()
        if key in seen or (not is_x_to_move_playable(board) if x_only else np_is_terminal(board)):
            continue
        seen.add(key)
        out.append(board)
    return np.stack(out).astype(np.int8)


def play_boards(
    n: int, seed: int, hero_epsilon: float = 0.1, opponent_epsilon: float = 0.5, o_share: float = 0.5
) -> np.ndarray:
    """``int8 [n, 9]`` positions met in play, repeats kept: the positions' frequencies are how often games pass.

    Each game has a hero (O with probability ``o_share``, else X) against an opponent; a move is uniform among the
    legal squares with probability ``epsilon`` (the hero's or the opponent's), else uniform among the
    minimax-optimal ones, as ``tasks.opponent_move`` plays. Every position with the hero to move goes in, except
    those where every legal move is optimal (a group on one of them gets the same reward for every answer).
    Uniform random positions (``generate_boards``) spread a policy's learning over thousands of boards that good
    play never reaches; these follow the games the game task plays, with the hero near the policy it should become.

    Raises:
      ValueError: ``n`` < 1, or an ``epsilon`` / ``o_share`` outside [0, 1].
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    for name, v in (("hero_epsilon", hero_epsilon), ("opponent_epsilon", opponent_epsilon), ("o_share", o_share)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
    tables = minimax.tables_numpy()
    optimal, terminal = tables["optimal_mask"], _terminal_by_code()
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    while len(out) < n:
        hero = ttt.O if rng.random() < o_share else ttt.X
        board = np.zeros(ttt.NUM_SQUARES, np.int8)
        player, code = ttt.X, 0
        while not terminal[code]:
            legal = board == ttt.EMPTY
            best = optimal[code] & legal
            if player == hero and not (best == legal).all():
                out.append(board.copy())
            eps = hero_epsilon if player == hero else opponent_epsilon
            choices = np.flatnonzero(legal if rng.random() < eps else best)
            i = int(choices[rng.integers(len(choices))])
            board[i] = player
            code += int(player) * 3**i
            player = ttt.O if player == ttt.X else ttt.X
    return np.stack(out[:n]).astype(np.int8)


def exhaustive_x_to_move() -> np.ndarray:
    """``int8 [2423, 9]``: every non-terminal position with X to move reachable from the empty board.

    Found by breadth-first play from the empty board (never expanding terminal positions), sorted by board code.
    """
    return exhaustive_positions("x")


@functools.lru_cache(maxsize=3)
def _exhaustive(side: str) -> np.ndarray:
    frontier = {np.zeros(ttt.NUM_SQUARES, np.int8).tobytes()}
    found: set[bytes] = set()
    wanted = {"x": (ttt.X,), "o": (ttt.O,), "both": (ttt.X, ttt.O)}[side]
    while frontier:
        nxt: set[bytes] = set()
        for key in frontier:
            board = np.frombuffer(key, np.int8)
            if np_is_terminal(board):
                continue
            mover = np_to_move(board)
            if mover in wanted:
                found.add(key)
            for i in np.flatnonzero(board == ttt.EMPTY):
                child = board.copy()
                child[i] = mover
                nxt.add(child.tobytes())
        frontier = nxt
    boards = np.stack([np.frombuffer(k, np.int8) for k in found])
    return boards[np.argsort(board_code_np(boards), kind="stable")]


def exhaustive_positions(side: str = "x") -> np.ndarray:
    """Every non-terminal position reachable from the empty board with ``side`` to move (``"x"``: 2423, ``"o"``:
    2097, ``"both"``: 4520), by breadth-first play, sorted by board code (a fresh copy)."""
    if side not in ("x", "o", "both"):
        raise ValueError(f"side must be 'x', 'o' or 'both', got {side!r}")
    return _exhaustive(side).copy()


def train_heldout_split(boards: Sequence[Any] | np.ndarray, heldout_fraction: float, seed: int):
    """Split ``boards`` (array ``[N, ...]`` or list) into ``(train, heldout)`` with a seeded permutation.

    ``round(heldout_fraction * N)`` items go to ``heldout``. Both parts keep the input order, and the result has the
    input's type (array in, arrays out; list in, lists out).
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    n = len(boards)
    n_heldout = int(round(heldout_fraction * n))
    perm = np.random.default_rng(seed).permutation(n)
    held = np.zeros(n, bool)
    held[perm[:n_heldout]] = True
    if isinstance(boards, np.ndarray):
        return boards[~held], boards[held]
    items = list(boards)
    return [b for b, h in zip(items, held) if not h], [b for b, h in zip(items, held) if h]


# ----------------------------------------------------------------------------------------------------------------
# Text forms and JSONL
# ----------------------------------------------------------------------------------------------------------------


def board_to_string(board: Iterable[int]) -> str:
    """``"X.O......"``: 9 characters, squares 1..9 row-major."""
    board = np.asarray(board)
    if board.shape != (ttt.NUM_SQUARES,):
        raise ValueError(f"board must have shape (9,), got {board.shape}")
    chars = {ttt.EMPTY: ".", ttt.X: "X", ttt.O: "O"}
    try:
        return "".join(chars[int(v)] for v in board)
    except KeyError as e:
        raise ValueError(f"board cells must be 0, 1 or 2, got {board.tolist()}") from e


def board_to_rows(board: Iterable[int]) -> list[list[str]]:
    """AReno's record form: 3 rows of 3 cells, ``"X"``/``"O"``/``"."``."""
    s = board_to_string(board)
    return [list(s[r * 3 : r * 3 + 3]) for r in range(3)]


def _cell_from_str(cell: str, index: int) -> int:
    c = cell.strip().upper()
    if c == "X":
        return ttt.X
    if c == "O":
        return ttt.O
    if c == "" or c in _EMPTY_CHARS:
        return ttt.EMPTY
    if c.isdigit() and int(c) == index + 1:  # a square label marks an empty square
        return ttt.EMPTY
    raise ValueError(
        f"bad cell {cell!r} at square {index + 1}: expected X, O, '.', '-', '_' or the square label {index + 1}"
    )


def _cells_from_text(text: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # Drop drawn separator rows such as "---+---+---".
    lines = [ln for ln in lines if not set(ln.strip()) <= set("-+=")] if len(lines) > 1 else lines
    joined = "".join(lines)
    if len(joined) == ttt.NUM_SQUARES:  # a plain 9-char string; "." may not be separated
        return list(joined)
    stripped = "".join(ch for ch in joined if ch not in _SEPARATORS)
    return list(stripped)


def parse_board(obj: Any) -> np.ndarray:
    """Tolerantly turn one board description into ``int8 [9]``.

    Accepts a 9-character string (``X``/``O`` stones; ``.``, ``-``, ``_`` or the square's own digit for empty;
    case-insensitive), multi-line text of 3 rows (spaces and ``|`` ignored), a list of 9 cells (strings as above, or
    ints 0/1/2), a list of 3 rows (each a 3-character string or a list of 3 cells), or an ``int [9]`` array.

    Raises:
      ValueError: with the offending value, when the input is none of these.
    """
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "iu":
        cells: list[Any] = obj.reshape(-1).tolist()
    elif isinstance(obj, str):
        cells = _cells_from_text(obj)
    elif isinstance(obj, (list, tuple)):
        if len(obj) == 3 and all(isinstance(r, (str, list, tuple)) for r in obj):
            cells = []
            for r in obj:
                row = _cells_from_text(r) if isinstance(r, str) else list(r)
                if len(row) != 3:
                    raise ValueError(f"each board row must have 3 cells, got {r!r} in {obj!r}")
                cells.extend(row)
        else:
            cells = list(obj)
    else:
        raise ValueError(f"cannot read a board from {type(obj).__name__}: {obj!r}")
    if len(cells) != ttt.NUM_SQUARES:
        raise ValueError(f"a board needs 9 cells, got {len(cells)} from {obj!r}")
    out = np.zeros(ttt.NUM_SQUARES, np.int8)
    for i, cell in enumerate(cells):
        if isinstance(cell, (bool, np.bool_)):
            raise ValueError(f"bad cell {cell!r} at square {i + 1} in {obj!r}")
        if isinstance(cell, (int, np.integer)):
            if int(cell) not in (ttt.EMPTY, ttt.X, ttt.O):
                raise ValueError(f"integer cells must be 0 (empty), 1 (X) or 2 (O); got {cell} at square {i + 1}")
            out[i] = int(cell)
        elif isinstance(cell, str):
            out[i] = _cell_from_str(cell, i)
        else:
            raise ValueError(f"bad cell {cell!r} at square {i + 1} in {obj!r}")
    return out


def make_records(boards: np.ndarray, id_prefix: str = "board", board_format: str = "string") -> list[dict]:
    """JSON-ready records ``{"id": f"{id_prefix}-{i:05d}", "board": ...}``.

    ``board_format``: ``"string"`` (``"X.O......"``, ours) or ``"rows"`` (AReno's 3x3 list of cells).
    """
    if board_format not in ("string", "rows"):
        raise ValueError(f"board_format must be 'string' or 'rows', got {board_format!r}")
    render = board_to_string if board_format == "string" else board_to_rows
    return [{"id": f"{id_prefix}-{i:05d}", "board": render(b)} for i, b in enumerate(np.asarray(boards))]


def save_jsonl(path: str | Path, boards: np.ndarray, id_prefix: str = "board", board_format: str = "string") -> None:
    """Write one record per board (see ``make_records``)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for rec in make_records(boards, id_prefix, board_format):
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def load_jsonl(path: str | Path, require_x_to_move: bool = True) -> tuple[np.ndarray, list[str]]:
    """Read a board JSONL (ours or AReno's) into ``(boards int8 [N, 9], ids)``.

    Lines that are blank are skipped. A record without ``"id"`` gets ``"line-<n>"``. With ``require_x_to_move``
    each board must be non-terminal with #X == #O (what the move task's prompt promises).

    Raises:
      ValueError: naming the file and line for bad JSON, a missing ``"board"``, an unreadable board, or (with
        ``require_x_to_move``) a position that is not X to move.
    """
    path = Path(path).expanduser()
    boards: list[np.ndarray] = []
    ids: list[str] = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from e
            if not isinstance(rec, dict) or "board" not in rec:
                raise ValueError(f"{where}: expected an object with a 'board' field")
            try:
                board = parse_board(rec["board"])
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from e
            if require_x_to_move and not is_x_to_move_playable(board):
                raise ValueError(f"{where}: board {board_to_string(board)!r} is not a non-terminal X-to-move position")
            boards.append(board)
            ids.append(str(rec.get("id", f"line-{lineno}")))
    if not boards:
        return np.zeros((0, ttt.NUM_SQUARES), np.int8), ids
    return np.stack(boards), ids


def load_boards(env_config) -> tuple[np.ndarray, np.ndarray]:
    """``(train, heldout)`` boards as ``int8 [N, 9]`` from a config's ``env`` section: a JSONL (``boards_path``),
    positions met in play (``board_source="play"``) or AReno's generator (``num_boards``, ``board_seed``,
    ``max_random_moves``, ``board_sides``); ``heldout_fraction`` of them held out."""
    env = env_config
    if env.get("boards_path", ""):
        boards, _ = load_jsonl(env.boards_path)
    elif env.get("board_source", "random") == "play":
        boards = play_boards(
            env.num_boards,
            seed=env.board_seed,
            hero_epsilon=env.get("play_epsilon", 0.1),
            opponent_epsilon=env.get("opponent_epsilon", 0.5),
            o_share=env.get("o_share", 0.5),
        )
    else:
        boards = generate_boards(
            env.num_boards,
            seed=env.board_seed,
            max_random_moves=env.get("max_random_moves", MAX_RANDOM_MOVES),
            sides=env.get("board_sides", "x"),
        )
    boards = np.asarray(boards, np.int8)
    if env.get("heldout_fraction", 0.0):
        return train_heldout_split(boards, env.heldout_fraction, env.board_seed)
    return boards, boards[:0]
