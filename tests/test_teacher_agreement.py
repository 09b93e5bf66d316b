"""studies/teacher_agreement.py counts a decision as agreed exactly when the policy's most likely token at the
teacher's choice token is that token (checked with an oracle and an anti-oracle in place of the model)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "studies"))
import teacher_agreement as ta  # noqa: E402


@pytest.fixture(scope="module")
def connect4(tiny_connect4):
    return tiny_connect4("random")


@pytest.mark.parametrize("shift, expected", [(0, 1.0), (1, 0.0)])
def test_agreement_reads_the_prediction_of_each_choice_token(connect4, monkeypatch, scripted_forward, shift, expected):
    config, tokenizer, model_config, params = connect4
    monkeypatch.setattr(ta.ling3, "forward", scripted_forward(shift))
    figures = ta.agreement(params, model_config, tokenizer, config, games=3, batch=2, seed=0)
    assert figures["games"] == 3 and figures["decisions"] >= 3 * 4  # a Connect Four game has at least 4 moves
    assert figures["agreement"] == expected and figures["games_all_agreed"] == expected


def test_an_untrained_model_agrees_sometimes_and_the_cli_checks_its_flags(connect4, tmp_path):
    config, tokenizer, model_config, params = connect4
    figures = ta.agreement(params, model_config, tokenizer, config, games=2, batch=2, seed=0)
    assert 0.0 <= figures["agreement"] <= 1.0 and figures["env"] == "connect4" and figures["opponent"] == "random"
    with pytest.raises(SystemExit):
        ta.main([f"--workdir={tmp_path}", "--warm_start", "--step=3"])
    with pytest.raises(SystemExit):
        ta.main([f"--workdir={tmp_path}", "--env", "opponent"])
