"""Build the shipped tokenizer: ``python -m reno_jax.assets.build_tokenizer [--out DIR] [--vocab_size N]``.

A small byte-level BPE (HF ``tokenizers``) trained on text this project generates: rendered move/game prompts for
random positions, whole random games (prompt, assistant calls, tool responses), assistant outputs with and
without ``<think>`` text, near-miss calls, and a little plain text. Writes ``tokenizer.json``,
``tokenizer_config.json`` (with ``chat_template``, eos/pad) and ``chat_template.jinja`` so that
``AutoTokenizer.from_pretrained(DIR)`` works offline.

Choices:
* Chat format: ChatML (``<|im_start|>ROLE\\n ... <|im_end|>\\n``), the format of Qwen and of the Hermes tool-call
  convention; roles system/user/assistant/tool. ``<|im_end|>`` closes every turn and is the ``eos_token`` (the
  generation stop); ``<|endoftext|>`` is the ``pad_token`` (also a stop). These three are *special* tokens.
  ``<tool_call>``, ``</tool_call>``, ``<think>``, ``</think>`` are *added, non-special* tokens (one id each, kept
  by ``decode(skip_special_tokens=True)``), as in Qwen.
* Pre-tokenizer: a ``Split`` that isolates every digit, every newline and every lone ``X``/``O`` letter, then
  ``ByteLevel`` without the GPT-2 regex. So digits 1-9 are always single tokens, board cells and the side letter
  are token boundaries (in-jit rendering from pieces then gives the same ids as tokenizing the whole prompt),
  and BPE may merge across spaces and punctuation: the fixed system text and the call skeleton
  ``{"name": "choose_square", "arguments": {"square": `` collapse to a few tokens.
* ``max_token_length`` bounds merged tokens (``MAX_TOKEN_CHARS``), which bounds the byte table of the jitted
  tool-call parser.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np

VOCAB_SIZE = 512
MAX_TOKEN_CHARS = 24
SEED = 0
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
PRETOKENIZE_PATTERN = r"\d|\n|\b[XO]\b"

ASSETS_DIR = os.path.dirname(os.path.abspath(__file__))
TEMPLATE_PATH = os.path.join(ASSETS_DIR, "chat_template.jinja")

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


def generate_corpus(num_games: int = 1500, num_positions: int = 2500, seed: int = SEED) -> list[str]:
    """Training text for the BPE (deterministic for a seed)."""
    from reno_jax.envs.tictactoe import wording as text_lib

    rng = random.Random(seed)
    template = open(TEMPLATE_PATH).read()
    render = _template_renderer(template)
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


def _template_renderer(template: str):
    """Render the chat template through ``transformers`` on a throwaway byte-level tokenizer (public API only)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from reno_jax.protocol.tokenizer import wrap_tokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = wrap_tokenizer(raw, chat_template=template)

    def render(messages, tools, add_generation_prompt):
        return tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    return render


def build(out_dir: str = ASSETS_DIR, vocab_size: int = VOCAB_SIZE, seed: int = SEED, corpus=None) -> str:
    """Train the tokenizer and write the three files into ``out_dir``. Returns ``out_dir``."""
    from reno_jax.protocol.tokenizer import train_byte_level_bpe

    template = open(TEMPLATE_PATH).read()
    corpus = generate_corpus(seed=seed) if corpus is None else corpus
    tok = train_byte_level_bpe(
        corpus,
        vocab_size,
        special_tokens=SPECIAL_TOKENS,
        added_tokens=ADDED_TOKENS,
        pretokenize_pattern=PRETOKENIZE_PATTERN,
        max_token_length=MAX_TOKEN_CHARS,
    )

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    added_decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in (*SPECIAL_TOKENS, *ADDED_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": [],
        "chat_template": template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    if os.path.abspath(out_dir) != os.path.abspath(ASSETS_DIR):
        with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
            f.write(template)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=ASSETS_DIR, help="output directory (default: the package assets)")
    parser.add_argument("--vocab_size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    out = build(args.out, args.vocab_size, args.seed)

    from reno_jax.envs.tictactoe import wording as text_lib
    from reno_jax.protocol import tokenizer as tokenizer_lib

    tok = tokenizer_lib.load_tokenizer(out)
    board = np.array([1, 0, 2, 0, 1, 0, 0, 0, 0], np.int8)
    ids = text_lib.prompt_ids(tok, text_lib.move_task_messages(board))
    call = tok.encode(_call_text(5, random.Random(0)), add_special_tokens=False)
    print(json.dumps({"out": out, "vocab": len(tok), "move_prompt_tokens": len(ids), "tool_call_tokens": len(call)}))


if __name__ == "__main__":
    main()
