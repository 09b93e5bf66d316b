"""Load the shipped tokenizer (``reno_jax/assets``) or any Hugging Face tokenizer, offline.

``load_tokenizer(None)`` gives the project's small byte-level BPE with its ChatML chat template (built by
``python -m reno_jax.envs.tictactoe.tokenizer_corpus``); ``load_tokenizer(path)`` loads a local HF tokenizer directory
(e.g. a Ling-3.0 checkpoint) with ``AutoTokenizer`` and never touches the network.
"""

from __future__ import annotations

import json
import os

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def shipped_tokenizer_dir() -> str:
    return ASSETS_DIR


def load_tokenizer(path: str | None = None):
    """HF fast tokenizer from ``path`` (a local directory), or the shipped one when ``path`` is None."""
    from transformers import AutoTokenizer

    directory = ASSETS_DIR if path is None else os.path.expanduser(path)
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")) and not os.path.isfile(
        os.path.join(directory, "tokenizer_config.json")
    ):
        if path is None:
            raise FileNotFoundError(
                f"shipped tokenizer missing in {directory}; rebuild it (see reno_jax/assets/build_tokenizer.py)"
            )
        raise FileNotFoundError(f"no tokenizer.json / tokenizer_config.json in {directory!r}")
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if tok.chat_template is None:
        raise ValueError(f"tokenizer in {directory!r} has no chat template (tokenizer_config.json / .jinja)")
    return tok


def special_ids(tokenizer) -> dict[str, int | None]:
    """``{"eos": id, "pad": id, "bos": id}`` (None where the tokenizer has none)."""
    return {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id}


def decode(tokenizer, ids) -> str:
    """Lossless decode: special tokens kept, no space clean-up (what the parsers and tests compare against)."""
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def train_byte_level_bpe(
    corpus,
    vocab_size: int,
    *,
    special_tokens=(),
    added_tokens=(),
    pretokenize_pattern: str | None = None,
    max_token_length: int | None = None,
    min_frequency: int = 2,
):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on an iterable of strings.

    Args:
      corpus: iterable of training strings.
      vocab_size: total vocabulary size (bytes + special/added tokens + merges).
      special_tokens: special tokens (first ids; dropped by ``decode(skip_special_tokens=True)``).
      added_tokens: added non-special tokens (next ids; always one token, kept on decode).
      pretokenize_pattern: None -> GPT-2 style pre-tokenization (``ByteLevel`` with its regex); else a regex whose
        matches are isolated by a ``Split`` before a regex-free ``ByteLevel`` (merges may then cross spaces).
      max_token_length: cap on the characters of a merged token (None: no cap).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if pretokenize_pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pretokenize_pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Registered before training so the trainer never sees their text split into bytes.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*special_tokens, *added_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # The trainer registers everything in special_tokens as special; make the added tokens non-special again.
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        if entry["content"] in added_tokens:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(spec))


def wrap_tokenizer(raw, *, chat_template: str | None = None, eos_token=None, pad_token=None):
    """``tokenizers.Tokenizer`` -> ``transformers`` fast tokenizer with a chat template (in memory)."""
    from transformers import PreTrainedTokenizerFast

    kwargs = {}
    if eos_token is not None:
        kwargs["eos_token"] = eos_token
    if pad_token is not None:
        kwargs["pad_token"] = pad_token
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False, **kwargs)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
