r"""Exact game outcomes of reference players against the tic-tac-toe opponents: the scale for a trained policy.

Every game tree is enumerated (no sampling), so the rates are exact. Players and opponents:

  random     a uniformly random legal move
  minimax    a uniformly random minimax-optimal move (the environment's minimax opponent)
  maxwin     the move with the highest win probability against the opponent among those that never lose
             (the best any policy can do against that opponent without risking a loss)
  epsilon    random with probability epsilon, else minimax (opponent only; the game config trains against 0.5)

  python studies/game_reference.py [--epsilon 0.5]

Prints a table of win / draw / loss per player, opponent and side, and ends with one JSON line: for each player and
opponent the rates averaged over the two sides (`<player>/<opponent>/win` ...), which is how
`experiments.evaluate --side=both` averages a trained policy's games.
"""

from __future__ import annotations

import argparse
import functools
import json

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
PLAYERS = ("random", "minimax", "maxwin")
OPPONENTS = ("random", "minimax", "epsilon")


def winner(board: tuple) -> int:
    for a, b, c in LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return 0


def play(board: tuple, square: int, player: int) -> tuple:
    return board[:square] + (player,) + board[square + 1 :]


@functools.lru_cache(maxsize=None)
def value(board: tuple, to_move: int) -> int:
    """Game-theoretic value for the side to move: +1 win, 0 draw, -1 loss."""
    w = winner(board)
    if w:
        return 1 if w == to_move else -1
    if 0 not in board:
        return 0
    return max(-value(play(board, i, to_move), 3 - to_move) for i in range(9) if board[i] == 0)


def optimal(board: tuple, to_move: int) -> list[int]:
    moves = [i for i in range(9) if board[i] == 0]
    values = [-value(play(board, i, to_move), 3 - to_move) for i in moves]
    return [m for m, v in zip(moves, values) if v == max(values)]


def _mean(outcomes) -> tuple:
    outcomes = list(outcomes)
    return tuple(sum(o[j] for o in outcomes) / len(outcomes) for j in range(3))


def opponent_policy(kind: str, board: tuple, to_move: int, epsilon: float) -> list[tuple[float, int]]:
    """`[(probability, square)]` of an opponent's reply."""
    moves = [i for i in range(9) if board[i] == 0]
    best = optimal(board, to_move)
    if kind == "random":
        return [(1 / len(moves), m) for m in moves]
    if kind == "minimax":
        return [(1 / len(best), m) for m in best]
    probs = {m: epsilon / len(moves) for m in moves}
    for m in best:
        probs[m] += (1 - epsilon) / len(best)
    return [(p, m) for m, p in probs.items()]


@functools.lru_cache(maxsize=None)
def outcome(board: tuple, to_move: int, me: int, player: str, opponent: str, epsilon: float) -> tuple:
    """`(win, draw, loss)` probabilities for `me` from this position."""
    w = winner(board)
    if w:
        return (1.0, 0.0, 0.0) if w == me else (0.0, 0.0, 1.0)
    if 0 not in board:
        return (0.0, 1.0, 0.0)
    nxt = lambda square: outcome(play(board, square, to_move), 3 - to_move, me, player, opponent, epsilon)
    if to_move != me:
        return tuple(
            sum(p * o[j] for p, o in ((p, nxt(m)) for p, m in opponent_policy(opponent, board, to_move, epsilon)))
            for j in range(3)
        )
    moves = [i for i in range(9) if board[i] == 0]
    if player == "random":
        return _mean(nxt(m) for m in moves)
    if player == "minimax":
        return _mean(nxt(m) for m in optimal(board, to_move))
    safe = [nxt(m) for m in optimal(board, to_move)]  # never worse than the position's value
    return max(safe, key=lambda o: (o[0] - o[2], o[0]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=0.5, help="the epsilon opponent's random share")
    args = parser.parse_args()
    empty = (0,) * 9
    figures = {}
    print(f"{'player':8s} {'opponent':8s} {'side':4s} {'win':>6s} {'draw':>6s} {'loss':>6s}")
    for player in PLAYERS:
        for opponent in OPPONENTS:
            sides = {side: outcome(empty, 1, me, player, opponent, args.epsilon) for side, me in (("x", 1), ("o", 2))}
            for side, (win, draw, loss) in sides.items():
                print(f"{player:8s} {opponent:8s} {side:4s} {win:6.3f} {draw:6.3f} {loss:6.3f}")
            for j, name in enumerate(("win", "draw", "loss")):
                figures[f"{player}/{opponent}/{name}"] = round((sides["x"][j] + sides["o"][j]) / 2, 4)
    print(json.dumps({"epsilon": args.epsilon, **figures}))


if __name__ == "__main__":
    main()
