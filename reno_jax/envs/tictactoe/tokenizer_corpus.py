"""The tic-tac-toe texts the shipped tokenizer is trained on, and the command that builds it:
``python -m reno_jax.envs.tictactoe.tokenizer_corpus [--out DIR] [--vocab_size N] [--seed S]``.

The corpus: rendered move/game prompts for random positions, whole random games (prompt, assistant calls, tool
responses), assistant outputs with and without ``<think>`` text, near-miss calls, and a little plain text. The
tokenizer itself (special tokens, pre-tokenizer, files written) is the generic `reno_jax.assets.build_tokenizer`.
"""

from __future__ import annotations

import json
import random

import numpy as np

from reno_jax.assets import build_tokenizer
from reno_jax.envs.tictactoe import wording as text_lib
from reno_jax.protocol import tokenizer as tokenizer_lib

_LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
_THOUGHTS = (
    "I take the center.",
    "I can win on square {s}.",
    "I must block square {s}.",
    "Square {s} is free.",
    "A corner is strong, so {s}.",
    "The opponent threatens a line; I block at {s}.",
    "Any empty square works; {s}.",
)
_PLAIN = (
    "Tic-tac-toe is a game for two players, X and O, who take turns marking the squares of a 3x3 grid.",
    "The player who succeeds in placing three marks in a row, column or diagonal wins the game.",
    "If both players play perfectly, every game ends in a draw.",
    "The first player usually takes the center or a corner.",
    "Think step by step, then call the tool with your move.",
    "The board has nine squares numbered from one to nine.",
)


def _winner(board) -> int:
    for a, b, c in _LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return 0


def _random_position(rng: random.Random) -> list:
    """A position reached by random play that is not over (the mover may still be X or O)."""
    while True:
        board = [0] * 9
        n = rng.randint(0, 8)
        for k in range(n):
            empty = [i for i in range(9) if board[i] == 0]
            board[rng.choice(empty)] = 1 if k % 2 == 0 else 2
            if _winner(board):
                break
        if not _winner(board) and 0 in board:
            return board


def _call_text(square, rng: random.Random, canonical: bool = True) -> str:
    """The assistant's tool call; sometimes a whitespace/order/value variant or a near miss."""
    if canonical:
        return f'<tool_call>{{"name": "choose_square", "arguments": {{"square": {square}}}}}</tool_call>'
    ws = rng.choice(["", " ", "\n", "  "])
    value = rng.choice([str(square), f'"{square}"', f"{square}.0", "0", "10", "-1"])
    name = rng.choice(["choose_square", "choose_square", "choose", "place_mark"])
    args = f'{{{ws}"square":{ws}{value}{ws}}}'
    body = (
        f'{{{ws}"name":{ws}"{name}",{ws}"arguments":{ws}{args}{ws}}}'
        if rng.random() < 0.7
        else f'{{{ws}"arguments":{ws}{args},{ws}"name":{ws}"{name}"{ws}}}'
    )
    return f"<tool_call>{ws}{body}{ws}</tool_call>"


def _assistant_text(square, rng: random.Random) -> str:
    text = ""
    if rng.random() < 0.25:
        text = "<think>" + rng.choice(_THOUGHTS).format(s=square) + "</think>\n"
    return text + _call_text(square, rng, canonical=rng.random() < 0.9)


def generate_corpus(render, num_games: int = 1500, num_positions: int = 2500, seed: int = 0) -> list[str]:
    """Training text for the BPE (deterministic for a seed). `render(messages, tools, add_generation_prompt)`: the
    chat template as text (`build_tokenizer.template_renderer`)."""
    rng = random.Random(seed)
    tools = [text_lib.tool_schema()]
    docs: list[str] = []

    for _ in range(num_positions):  # move-task prompts, some with an answer
        board = _random_position(rng)
        messages = text_lib.move_task_messages(np.array(board, np.int8))
        if rng.random() < 0.5:
            empty = [i + 1 for i in range(9) if board[i] == 0]
            messages.append({"role": "assistant", "content": _assistant_text(rng.choice(empty), rng)})
            docs.append(render(messages, tools, False))
        else:
            docs.append(render(messages, tools, True))

    for _ in range(num_games):  # whole games against a random opponent
        agent = rng.choice([1, 2])
        board = [0] * 9
        if agent == 2:
            board[rng.randrange(9)] = 1
        messages = text_lib.game_task_messages(np.array(board, np.int8), agent)
        while True:
            empty = [i for i in range(9) if board[i] == 0]
            if rng.random() < 0.03:  # an occupied or invalid move ends the game
                occupied = [i for i in range(9) if board[i]]
                square = rng.choice(occupied) + 1 if occupied else 10
                messages.append({"role": "assistant", "content": _assistant_text(square, rng)})
                status = text_lib.STATUS_ILLEGAL if occupied else text_lib.STATUS_INVALID
                messages.append(text_lib.tool_message(np.array(board, np.int8), 0, status))
                break
            move = rng.choice(empty)
            messages.append({"role": "assistant", "content": _assistant_text(move + 1, rng)})
            board[move] = agent
            opp_square, status = 0, text_lib.STATUS_ONGOING
            if _winner(board):
                status = text_lib.STATUS_WIN
            elif 0 not in board:
                status = text_lib.STATUS_DRAW
            else:
                reply = rng.choice([i for i in range(9) if board[i] == 0])
                board[reply] = 3 - agent
                opp_square = reply + 1
                if _winner(board):
                    status = text_lib.STATUS_LOSS
                elif 0 not in board:
                    status = text_lib.STATUS_DRAW
            messages.append(text_lib.tool_message(np.array(board, np.int8), opp_square, status))
            if status != text_lib.STATUS_ONGOING:
                break
        docs.append(render(messages, tools, False))

    for _ in range(200):
        docs.append(rng.choice(_PLAIN))
    rng.shuffle(docs)
    return docs


def main(argv=None) -> None:
    """Builds the tokenizer (default: the shipped one, in `reno_jax/assets`) and prints a few token counts."""
    args = build_tokenizer.parse_args(argv, __doc__.split("\n")[0])
    render = build_tokenizer.template_renderer(build_tokenizer.chat_template())
    out = build_tokenizer.build(args.out, generate_corpus(render, seed=args.seed), args.vocab_size)

    tok = tokenizer_lib.load_tokenizer(out)
    board = np.array([1, 0, 2, 0, 1, 0, 0, 0, 0], np.int8)
    ids = text_lib.prompt_ids(tok, text_lib.move_task_messages(board))
    call = tok.encode(_call_text(5, random.Random(0)), add_special_tokens=False)
    print(json.dumps({"out": out, "vocab": len(tok), "move_prompt_tokens": len(ids), "tool_call_tokens": len(call)}))


if __name__ == "__main__":
    main()
