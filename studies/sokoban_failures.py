"""Where a Sokoban run's greedy policy fails on the held-out rooms: stuck repeating a blocked move, or lost.

Plays the first `--episodes` held-out rooms greedily with a checkpoint (the play page's episode path: the real
rollout, then the environment replayed over the parsed calls) and sorts every unsolved room by how it ended:

  stuck      the policy made a move that left the room unchanged ("You did not move.") and, the room being the
             whole prompt under bounded history with k = 0, the same greedy move again until the budget ran out
  wandering  it kept moving without solving the room

and by whether the room was still solvable there (the breadth-first solver, `rooms.solve`, from the position where
it got stuck, or the last one): a policy stuck in solvable rooms lacks a move it could still make, one in dead
rooms pushed a box where no move brings it back. A stuck move is split into a walk into a wall and a push that a
wall or a box stops.

    python studies/sokoban_failures.py --workdir=W --step=0      # the warm start
    python studies/sokoban_failures.py --workdir=W --episodes=512

Ends with one JSON line: the counts of each kind, the shares, and the blocked moves' split.
"""

from __future__ import annotations

import argparse
import collections
import json

from reno_jax.envs.sokoban import rooms, rules, wording
from reno_jax.play import service as service_lib

ROOM_CHARS = set("".join(wording.CELL_CHARS))


def room_of(text: str) -> str:
    """The room printed in a message (its lines of cell characters)."""
    return "\n".join(line for line in text.split("\n") if line and set(line) <= ROOM_CHARS)


def blocked_kind(room: str, direction: int) -> str:
    """``"wall"``: the player walked into a wall; ``"push"``: it walked into a box a wall or a box stops."""
    walls, _, boxes, player = wording.parse_room(room)
    width = walls.shape[1]
    row, col = divmod(player, width)
    dr, dc = rules.DELTAS[direction]
    return "push" if boxes[row + dr, col + dc] else "wall"


def classify(messages: list[dict]) -> tuple[str, str | None]:
    """``(kind, blocked)`` of an unsolved episode's messages: kind ``stuck_solvable`` / ``stuck_dead`` /
    ``wandering_solvable`` / ``wandering_dead``; blocked the first stuck move's `blocked_kind` (None if none)."""
    seq = [room_of(next(m["content"] for m in messages if m["role"] == "user"))]
    calls = []
    for m in messages:
        if m["role"] == "assistant":
            text = m["content"]
            calls.append(next((d for d, name in enumerate(rules.DIRECTIONS) if f'"{name}"' in text), None))
        elif m["role"] == "tool":
            seq.append(room_of(m["content"]) or seq[-1])
    stuck = next((i for i in range(1, len(seq)) if seq[i] == seq[i - 1]), None)
    where = seq[stuck] if stuck is not None else seq[-1]
    solvable = rooms.solve(*wording.parse_room(where)).moves is not None
    kind = ("stuck" if stuck is not None else "wandering") + ("_solvable" if solvable else "_dead")
    blocked = None
    if stuck is not None and calls[stuck - 1] is not None:
        blocked = blocked_kind(where, calls[stuck - 1])
    return kind, blocked


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (0: the warm start; default latest)")
    parser.add_argument("--episodes", type=int, default=128, help="the first N held-out rooms")
    parser.add_argument("--show", type=int, default=2, help="print this many rooms of each kind")
    args = parser.parse_args()
    svc = service_lib.PlayService(args.workdir)
    counts, blocked = collections.Counter(), collections.Counter()
    step = None
    for k in range(args.episodes):
        out = svc.episode(args.step, "heldout", k)
        step = out["step"]
        if out["info"].get("solved", 0.0) > 0.5:
            counts["solved"] += 1
            continue
        kind, how = classify(out["messages"])
        counts[kind] += 1
        if how is not None:
            blocked[how] += 1
        if counts[kind] <= args.show:
            last = room_of([m for m in out["messages"] if m["role"] == "tool"][-1]["content"])
            print(f"room {k}: {kind} ({how or '-'}), last room:\n{last}\n")
    n = args.episodes
    failed = n - counts["solved"]
    row = {
        "step": step,
        "episodes": n,
        **{
            kind: counts[kind]
            for kind in ("solved", "stuck_solvable", "stuck_dead", "wandering_solvable", "wandering_dead")
        },
        "solved_rate": counts["solved"] / n,
        "stuck_solvable_share_of_failures": counts["stuck_solvable"] / failed if failed else float("nan"),
        "stuck_into_wall": blocked["wall"],
        "stuck_pushing": blocked["push"],
    }
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))


if __name__ == "__main__":
    main()
