"""Plain-Python tic-tac-toe reference shared by the env tests (tuples, explicit lines; independent of reno_jax)."""

PY_LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def py_winner(b):
    for a, c, d in PY_LINES:
        if b[a] != 0 and b[a] == b[c] == b[d]:
            return b[a]
    return 0
