"""Build a tokenizer directory like the shipped one: a small byte-level BPE (HF ``tokenizers``) trained on a
corpus the caller supplies, with this project's chat template. Writes ``tokenizer.json``,
``tokenizer_config.json`` (with ``chat_template``, eos/pad) and ``chat_template.jinja`` so that
``AutoTokenizer.from_pretrained(DIR)`` works offline. The shipped tokenizer is trained on tic-tac-toe texts:
``python -m reno_jax.envs.tictactoe.tokenizer_corpus`` (its corpus, then `build`).

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
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from reno_jax.protocol.tokenizer import train_byte_level_bpe, wrap_tokenizer

VOCAB_SIZE = 512
MAX_TOKEN_CHARS = 24
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
PRETOKENIZE_PATTERN = r"\d|\n|\b[XO]\b"

ASSETS_DIR = os.path.dirname(os.path.abspath(__file__))
TEMPLATE_PATH = os.path.join(ASSETS_DIR, "chat_template.jinja")


def chat_template() -> str:
    """The project's chat template (``chat_template.jinja``)."""
    with open(TEMPLATE_PATH) as f:
        return f.read()


def template_renderer(template: str):
    """`render(messages, tools, add_generation_prompt) -> str`: the chat template rendered through
    ``transformers`` on a throwaway byte-level tokenizer (public API only), for building a corpus."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = wrap_tokenizer(raw, chat_template=template)

    def render(messages, tools, add_generation_prompt):
        return tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    return render


def build(out_dir: str, corpus: Iterable[str], vocab_size: int = VOCAB_SIZE) -> str:
    """Train the tokenizer on `corpus` and write the three files into ``out_dir``. Returns ``out_dir``."""
    template = chat_template()
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


def parse_args(argv=None, description: str = ""):
    """The build command's flags: --out (default: the package assets), --vocab_size, --seed (of the corpus)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=ASSETS_DIR, help="output directory (default: the package assets)")
    parser.add_argument("--vocab_size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus")
    return parser.parse_args(argv)
