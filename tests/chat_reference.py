"""Identity reference for the tic-tac-toe wording: inputs from a fixed seed and what the wording renders for them
(jitted ids on both render paths, and the host texts). ``python tests/chat_reference.py`` rewrites
``tests/data/tictactoe_render_reference.npz``; it was first written by the wording before it moved onto
``reno_jax.protocol.chat``, so comparing against it checks the move changed no token and no character."""

import os

import jax
import numpy as np

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "tictactoe_render_reference.npz")


def cases(seed=0):
    rng = np.random.default_rng(seed)
    boards = []
    for i in range(24):  # random play prefixes of every length, including full and won boards
        b = np.zeros(9, np.int8)
        for k, sq in enumerate(rng.permutation(9)[: i % 10]):
            b[sq] = 1 + k % 2
        boards.append(b)
    boards = np.stack(boards)
    sides = (1 + np.arange(len(boards)) % 2).astype(np.int32)
    # Tool responses: a full status x opponent x turn-end grid on one board, then random rows.
    grid = [(5, o, s, t) for s in range(6) for o in range(10) for t in (0, 1)]
    rand = [
        (int(rng.integers(24)), int(rng.integers(10)), int(rng.integers(6)), int(rng.integers(2))) for _ in range(40)
    ]
    rb, ro, rs, rt = (np.array(x) for x in zip(*(grid + rand)))
    return dict(
        boards=boards,
        sides=sides,
        resp_board=rb.astype(np.int32),
        resp_opp=ro.astype(np.int32),
        resp_status=rs.astype(np.int32),
        resp_turn_end=rt.astype(bool),
    )


def render_all(text, tok):
    """Everything the wording renders for ``cases()`` (``text``: the wording module)."""
    c = cases()
    out = {}
    for tag, spec in (("fast", text.build_text_spec(tok)), ("general", text.build_text_spec(tok, max_stencil_rows=0))):
        prompt = jax.jit(jax.vmap(text.render_prompt, in_axes=(None, 0, 0, None)), static_argnums=3)
        response = jax.jit(jax.vmap(text.render_tool_response, in_axes=(None, 0, 0, 0, 0)))
        for game in (0, 1):
            ids, n = prompt(spec, c["boards"], c["sides"], bool(game))
            out[f"{tag}_prompt{game}_ids"], out[f"{tag}_prompt{game}_len"] = np.asarray(ids), np.asarray(n)
        ids, n = response(spec, c["boards"][c["resp_board"]], c["resp_opp"], c["resp_status"], c["resp_turn_end"])
        out[f"{tag}_response_ids"], out[f"{tag}_response_len"] = np.asarray(ids), np.asarray(n)
        out[f"{tag}_static"] = np.array(
            [spec.prompt_len, spec.response_len, spec.pad_id, spec.turn_end_id, spec.eos_id, *np.asarray(spec.stop_ids)]
        )
    texts = []
    for b, side in zip(c["boards"], c["sides"]):
        texts += [
            text.render_board(b),
            text.chat_text(tok, text.move_task_messages(b)),
            text.chat_text(tok, text.game_task_messages(b, int(side))),
        ]
    host_ids = [
        np.asarray(text.prompt_ids(tok, text.move_task_messages(b, int(s)))) for b, s in zip(c["boards"], c["sides"])
    ]
    out["host_prompt_ids"] = np.stack([np.pad(x, (0, 80 - len(x)), constant_values=-1) for x in host_ids])
    for bi, o, s, t in zip(c["resp_board"], c["resp_opp"], c["resp_status"], c["resp_turn_end"]):
        b = c["boards"][bi]
        texts += [
            text.tool_response_content(b, int(o), int(s)),
            text.tool_response_text(tok, b, int(o), int(s), add_turn_end=bool(t)),
            repr(text.tool_message(b, int(o), int(s))),
        ]
    out["texts"] = np.array(texts)
    return out


if __name__ == "__main__":
    from reno_jax.envs.tictactoe import wording
    from reno_jax.protocol.tokenizer import load_tokenizer

    out = render_all(wording, load_tokenizer(None))
    for k in [k for k in out if k.startswith("general_")]:  # the two paths agree: store one
        assert np.array_equal(out.pop(k), out["fast_" + k[len("general_") :]]), k
    # Texts as one NUL-joined UTF-8 byte string (a NumPy unicode array takes 4 bytes a character).
    out["texts"] = np.frombuffer("\0".join(out["texts"].tolist()).encode(), np.uint8)
    compact = {k: (v.astype(np.int16) if v.dtype.kind in "i" else v) for k, v in out.items()}
    np.savez_compressed(REFERENCE, **compact)
    print({k: v.shape for k, v in out.items()}, os.path.getsize(REFERENCE))
