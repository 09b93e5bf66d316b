"""`model.tokenizer="env"`: a BPE of the shipped size built on the environment's own text, saved with the run
and read back from there (`reno_jax.loop.tokenizers`)."""

import os

import pytest

from configs import guess_number_tiny
from reno_jax import run_config
from reno_jax.errors import ConfigError
from reno_jax.loop import tokenizers
from reno_jax.protocol.tokenizer import load_tokenizer

CALL = '<tool_call>{"name": "guess", "arguments": {"number": 12}}</tool_call>'


def _config():
    c = guess_number_tiny.get_config()
    c.model.tokenizer = "env"
    return c


def test_the_environments_tokenizer_is_saved_with_the_run_and_read_back(tmp_path):
    workdir = str(tmp_path)
    built = tokenizers.run_tokenizer(_config(), workdir)
    tokenizers.save_run_tokenizer(built, workdir)
    shipped = load_tokenizer(None)
    assert len(built) <= len(shipped)  # the shipped size at most (a small corpus may run out of merges)
    assert len(built.encode(CALL)) < len(shipped.encode(CALL))  # the environment's call skeleton: fewer tokens
    assert built.chat_template == shipped.chat_template and built.eos_token == shipped.eos_token
    assert os.path.isfile(os.path.join(workdir, tokenizers.SUBDIR, "tokenizer.json"))
    config = run_config.load(guess_number_tiny.get_config())  # whatever the config says: the saved one is read
    again = tokenizers.run_tokenizer(config, workdir)
    assert again.encode(CALL) == built.encode(CALL) and len(again) == len(built)


def test_an_env_tokenizer_for_a_pretrained_model_is_refused():
    c = _config()
    c.model.tokenizer_path = "/some/tokenizer"
    with pytest.raises(ConfigError, match=r"^--config.model.tokenizer=env builds a tokenizer for the drawn tiny"):
        run_config.load(c)
    c.model.tokenizer_path, c.model.tokenizer = "", "bpe"
    with pytest.raises(ConfigError, match=r"^--config.model.tokenizer must be one of \['shipped', 'env'\]"):
        run_config.load(c)


def test_a_host_environments_tokenizer_is_built_from_its_episodes():
    from configs import two_hop_lookup_tiny
    from reno_jax.envs import two_hop_lookup

    class WithCorpus(two_hop_lookup.TwoHopLookupEnv):
        @classmethod
        def tokenizer_corpus(cls):
            return ("a declared text",)

    docs = tokenizers.host_corpus(WithCorpus, 3)
    assert len(docs) == 4 and docs[-1] == "a declared text"
    assert WithCorpus.system_prompt in docs[0] and '<tool_call>{"name": "' in docs[0]
    c = two_hop_lookup_tiny.get_config()
    c.model.tokenizer = "env"
    built, shipped = tokenizers.config_tokenizer(c), load_tokenizer(None)
    call = docs[0][docs[0].rindex("<tool_call>") : docs[0].rindex("</tool_call>") + len("</tool_call>")]
    assert "arguments" in call and len(built.encode(call)) < len(shipped.encode(call))  # the teacher's last call
