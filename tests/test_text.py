"""Tests for the shipped tokenizer, prompt wording and in-jit chat rendering (reno_jax.envs.tictactoe.wording /
tokenizer)."""

import json
import os
import random

import jax
import numpy as np
import pytest

from reno_jax.envs.tictactoe import wording as text
from reno_jax.protocol import tokenizer as tokenizer_lib

CALL = '<tool_call>{"name": "choose_square", "arguments": {"square": 5}}</tool_call>'

# A second chat format (role markers as in Ling/bailing, tools as JSON lines, tool turns wrapped in
# <tool_response>) to check that TextSpec is built from the template itself, not from assumptions about ChatML.
ROLE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{- '<role>SYSTEM</role>' + m['content'] -}}"
    "{%- if tools -%}{{- '\\n# Tools' -}}{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}{%- endif -%}"
    "{{- '<|role_end|>' -}}"
    "{%- elif m['role'] == 'user' -%}{{- '<role>HUMAN</role>' + m['content'] + '<|role_end|>' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- '<role>ASSISTANT</role>' + m['content'] + '<|role_end|>' -}}"
    "{%- else -%}{{- '<role>OBSERVATION</role><tool_response>\\n' + m['content'] -}}"
    "{{- '\\n</tool_response><|role_end|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<role>ASSISTANT</role>' -}}{%- endif -%}"
)


def _decode(tok, ids, n=None):
    ids = np.asarray(ids)
    return tokenizer_lib.decode(tok, ids[: len(ids) if n is None else int(n)])


def _random_boards(n, seed):
    """Positions from random play (any stage, including finished and full boards) plus the empty board."""
    rng = random.Random(seed)
    boards = [np.zeros(9, np.int8)]
    while len(boards) < n:
        b = np.zeros(9, np.int8)
        order = rng.sample(range(9), rng.randint(1, 9))
        for k, i in enumerate(order):
            b[i] = 1 + k % 2
        boards.append(b)
    return np.stack(boards)


@pytest.fixture(scope="module")
def shipped():
    return tokenizer_lib.load_tokenizer(None)


@pytest.fixture(scope="module")
def shipped_spec(shipped):
    return text.build_text_spec(shipped)


@pytest.fixture(scope="module")
def other():
    rng = random.Random(1)
    words = ["board", "square", "game", "play", "win", "the", "you", "é", "naïve", "中文", "🙂", "{", '"', ":"]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) + f" {rng.randint(0, 999)}" for _ in range(300)]
    raw = tokenizer_lib.train_byte_level_bpe(
        corpus, 320, special_tokens=("<|endoftext|>", "<role>", "</role>", "<|role_end|>")
    )
    return tokenizer_lib.wrap_tokenizer(raw, chat_template=ROLE_TEMPLATE, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def varied():
    """Added tokens make some slot options shorter than others: "Opponent played 3.\n" and "... 7.\n" take
    fewer tokens than the other opponent lines, so tool responses have several layouts per status."""
    rng = random.Random(2)
    words = ["board", "square", "Opponent", "played", "You", "won", "the", "|", "\n"]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)]
    raw = tokenizer_lib.train_byte_level_bpe(
        corpus,
        300,
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=("played 3.", "ed 7"),
    )
    return tokenizer_lib.wrap_tokenizer(
        raw, chat_template=tokenizer_lib.load_tokenizer(None).chat_template, eos_token="<|im_end|>"
    )


@pytest.fixture(scope="module")
def render_fns():
    prompt = jax.jit(jax.vmap(text.render_prompt, in_axes=(None, 0, 0, None)), static_argnums=3)
    response = jax.jit(jax.vmap(text.render_tool_response, in_axes=(None, 0, 0, 0, 0)))
    return prompt, response


# ---------------------------------------------------------------------------------------------------------------
# Shipped tokenizer files
# ---------------------------------------------------------------------------------------------------------------


def test_shipped_tokenizer_loads_offline_with_autotokenizer(monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory = tokenizer_lib.shipped_tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert 384 <= len(tok) <= 512
    with open(os.path.join(directory, "chat_template.jinja")) as f:
        jinja = f.read()
    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert tok.chat_template == jinja == config["chat_template"]
    # Chat markers and tags are single tokens; the tags survive skip_special_tokens, the markers do not.
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    ids = tok.encode("<|im_start|>" + CALL + "<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == CALL


def test_digits_are_single_tokens_and_the_call_is_short(shipped):
    digit_ids = set()
    for d in "123456789":
        ids = shipped.encode(CALL.replace("5", d), add_special_tokens=False)
        pieces = [shipped.decode([i]) for i in ids]
        assert d in pieces, pieces  # the digit is its own token inside the call
        digit_ids.add(shipped.convert_tokens_to_ids(d))
    assert len(digit_ids) == 9
    n_call = len(shipped.encode(CALL, add_special_tokens=False))
    skeleton = len(shipped.encode('{"name": "choose_square", "arguments": {"square": ', add_special_tokens=False))
    print(f"\n[tokens] tool call: {n_call} tokens; call skeleton: {skeleton} tokens")
    assert n_call <= 8 and skeleton <= 4


def test_build_tokenizer_script_makes_a_working_tokenizer(tmp_path):
    from reno_jax.assets import build_tokenizer
    from reno_jax.envs.tictactoe import tokenizer_corpus

    render = build_tokenizer.template_renderer(build_tokenizer.chat_template())
    corpus = tokenizer_corpus.generate_corpus(render, num_games=40, num_positions=80, seed=3)
    out = build_tokenizer.build(str(tmp_path), corpus, vocab_size=400)
    tok = tokenizer_lib.load_tokenizer(out)
    assert len(tok) == 400 and tok.eos_token == "<|im_end|>"
    board = np.array([1, 0, 2, 0, 0, 0, 0, 0, 0], np.int8)
    messages = text.move_task_messages(board)
    assert _decode(tok, text.prompt_ids(tok, messages)) == text.chat_text(tok, messages)
    assert [tok.decode([i]) for i in tok.encode("12 9", add_special_tokens=False)] == ["1", "2", " ", "9"]


# ---------------------------------------------------------------------------------------------------------------
# Wording
# ---------------------------------------------------------------------------------------------------------------


def test_render_board_and_messages():
    board = np.array([1, 0, 2, 0, 1, 0, 0, 0, 0], np.int8)
    assert text.render_board(board) == "X | 2 | O\n4 | X | 6\n7 | 8 | 9"
    assert text.render_board(np.zeros(9, np.int8)) == "1 | 2 | 3\n4 | 5 | 6\n7 | 8 | 9"
    move = text.move_task_messages(board)
    assert [m["role"] for m in move] == ["system", "user"]
    assert "choose_square" in move[0]["content"]
    assert move[1]["content"] == "You are O.\nX | 2 | O\n4 | X | 6\n7 | 8 | 9"  # O to move: 2 X vs 1 O
    game = text.game_task_messages(np.zeros(9, np.int8), 1)
    assert "opponent" in game[1]["content"].lower() and "You are X." in game[1]["content"]
    assert text.tool_response_content(board, 7, text.STATUS_ONGOING).startswith("Opponent played 7.\nX | 2 | O")
    assert text.tool_response_content(board, 0, text.STATUS_WIN).endswith("You won.")
    schema = text.tool_schema()["function"]
    assert schema["name"] == "choose_square"
    assert schema["parameters"]["properties"]["square"] == {"type": "integer", "minimum": 1, "maximum": 9}
    with pytest.raises(ValueError, match="board"):
        text.render_board(np.array([3] * 9))
    with pytest.raises(ValueError, match="status"):
        text.tool_response_content(board, 0, 9)


def test_labeled_board_style():
    board = np.array([1, 0, 2, 0, 1, 0, 0, 0, 0], np.int8)
    assert text.BOARD_STYLES == ("grid", "labeled")
    assert text.render_board(board, "labeled") == "1X | 2 | 3O\n4 | 5X | 6\n7 | 8 | 9"
    assert text.render_board(np.zeros(9, np.int8), "labeled") == text.render_board(np.zeros(9, np.int8))
    assert (
        text.move_task_messages(board, style="labeled")[1]["content"]
        == "You are O.\n1X | 2 | 3O\n4 | 5X | 6\n7 | 8 | 9"
    )
    assert "You are X.\n1 | 2 | 3" in text.game_task_messages(np.zeros(9, np.int8), 1, "labeled")[1]["content"]
    assert text.tool_response_content(board, 7, text.STATUS_ONGOING, "labeled").startswith(
        "Opponent played 7.\n1X | 2 | 3O"
    )
    with pytest.raises(ValueError, match="board style"):
        text.render_board(board, "fancy")
    from reno_jax.envs.tictactoe import env as ttt_env

    with pytest.raises(ValueError, match="board style"):
        ttt_env.TicTacToeEnv.create(board_style="fancy")


@pytest.mark.parametrize("game", [False, True])
def test_labeled_render_matches_chat_template(shipped, render_fns, game):
    """The in-jit renderer of the labeled style gives the host template's ids, prompts and tool responses."""
    spec = text.build_text_spec(shipped, style="labeled")
    boards = _random_boards(12, seed=7 + int(game))
    sides = np.array([1 + i % 2 for i in range(len(boards))], np.int32)
    ids, lengths = render_fns[0](spec, boards, sides, game)
    for b, side, row, n in zip(boards, sides, np.asarray(ids), np.asarray(lengths)):
        messages = text.game_task_messages(b, side, "labeled") if game else text.move_task_messages(b, side, "labeled")
        assert row[:n].tolist() == text.prompt_ids(shipped, messages)
    opp = np.array([i % 10 for i in range(len(boards))], np.int32)
    status = np.array([i % text.NUM_STATUSES for i in range(len(boards))], np.int32)
    ids, lengths = render_fns[1](spec, boards, opp, status, np.zeros(len(boards), bool))
    for b, o, st, row, n in zip(boards, opp, status, np.asarray(ids), np.asarray(lengths)):
        assert _decode(shipped, row, n) == text.tool_response_text(shipped, b, int(o), int(st), style="labeled")


def test_statuses_match_game_outcomes():
    from reno_jax.envs.tictactoe import tasks

    assert text.STATUS_NAMES == tasks.OUTCOME_NAMES
    assert (text.STATUS_ONGOING, text.STATUS_WIN, text.STATUS_DRAW, text.STATUS_LOSS) == (
        tasks.OUTCOME_ONGOING,
        tasks.OUTCOME_WIN,
        tasks.OUTCOME_DRAW,
        tasks.OUTCOME_LOSS,
    )
    assert (text.STATUS_INVALID, text.STATUS_ILLEGAL) == (tasks.OUTCOME_INVALID, tasks.OUTCOME_ILLEGAL)


def test_system_turn_lists_the_tool_compactly(shipped):
    prompt = text.chat_text(shipped, text.move_task_messages(np.zeros(9, np.int8)))
    assert "\nchoose_square(square: integer 1-9): Mark an empty square.\n" in prompt
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    # Assistant tool_calls given as structured data render as the canonical call text.
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "choose_square", "arguments": {"square": 5}}}],
        },
    ]
    rendered = shipped.apply_chat_template(msgs, tokenize=False)
    assert rendered == f"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n{CALL}<|im_end|>\n"


# ---------------------------------------------------------------------------------------------------------------
# In-jit rendering
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("game", [False, True])
def test_render_prompt_matches_chat_template(shipped, shipped_spec, render_fns, game):
    boards = _random_boards(24, seed=int(game))
    sides = np.array([1 + i % 2 for i in range(len(boards))], np.int32)
    ids, lengths = render_fns[0](shipped_spec, boards, sides, game)
    assert ids.shape == (len(boards), shipped_spec.prompt_len)
    for b, side, row, n in zip(boards, sides, np.asarray(ids), np.asarray(lengths)):
        messages = text.game_task_messages(b, side) if game else text.move_task_messages(b, side)
        assert _decode(shipped, row, n) == text.chat_text(shipped, messages)
        # The shipped pre-tokenizer splits at every slot boundary, so even the ids agree with the host path.
        assert row[:n].tolist() == text.prompt_ids(shipped, messages)
        assert (row[n:] == shipped_spec.pad_id).all()


def test_prompt_length_report(shipped, shipped_spec):
    board = np.array([1, 0, 2, 0, 1, 0, 0, 0, 0], np.int8)
    move = len(text.prompt_ids(shipped, text.move_task_messages(board)))
    game = len(text.prompt_ids(shipped, text.game_task_messages(np.zeros(9, np.int8), 1)))
    print(
        f"\n[tokens] move-task prompt: {move}; game-task prompt: {game}; "
        f"Lp_max={shipped_spec.prompt_len}, Lr_max={shipped_spec.response_len}"
    )
    assert move < 80 and game < 80
    assert shipped_spec.prompt_len == max(move, game)  # every cell is one token: the length does not vary


def test_render_tool_response_matches_template(shipped, shipped_spec, render_fns):
    boards = _random_boards(6, seed=5)
    rows = [
        (b, opp, st, te) for b in boards for st in range(text.NUM_STATUSES) for opp in (0, 4, 9) for te in (False, True)
    ]
    b, opp, st, te = (np.array(x) for x in zip(*rows))
    ids, lengths = render_fns[1](shipped_spec, b, opp.astype(np.int32), st.astype(np.int32), te)
    assert ids.shape[1] == shipped_spec.response_len
    for (board, o, s, t), row, n in zip(rows, np.asarray(ids), np.asarray(lengths)):
        want = text.tool_response_text(shipped, board, o, s, add_turn_end=t)
        assert _decode(shipped, row, n) == want
        assert want.startswith("<|im_end|>\n<|im_start|>tool\n" if t else "\n<|im_start|>tool\n")
        assert want.endswith("<|im_start|>assistant\n") == (s == text.STATUS_ONGOING)


def test_multi_turn_conversation_equals_template(shipped, shipped_spec, render_fns):
    """prompt + policy call + tool response + policy call + final response == the template on the whole chat."""
    board0 = np.array([1, 0, 0, 0, 0, 0, 0, 0, 0], np.int8)
    board1 = np.array([1, 0, 0, 0, 2, 0, 0, 1, 0], np.int8)  # agent O took 5, opponent X took 8
    board2 = np.array([1, 2, 0, 0, 2, 0, 1, 1, 0], np.int8)  # agent O took 2, opponent X took 7
    calls = [CALL.replace("5", "5"), CALL.replace("5", "2")]
    policy = [shipped.encode(c + "<|im_end|>", add_special_tokens=False) for c in calls]
    prompt_fn, response_fn = render_fns
    ids, n = prompt_fn(shipped_spec, board0[None], np.array([2], np.int32), True)
    tokens = list(np.asarray(ids)[0, : int(n[0])]) + policy[0]
    boards, opp = np.stack([board1, board2]), np.array([8, 7], np.int32)
    status = np.array([text.STATUS_ONGOING, text.STATUS_LOSS], np.int32)
    r, n = response_fn(shipped_spec, boards, opp, status, np.zeros(2, bool))
    r, n = np.asarray(r), np.asarray(n)
    tokens += list(r[0, : n[0]]) + policy[1] + list(r[1, : n[1]])
    messages = text.game_task_messages(board0, 2) + [
        {"role": "assistant", "content": calls[0]},
        text.tool_message(board1, 8, text.STATUS_ONGOING),
        {"role": "assistant", "content": calls[1]},
        text.tool_message(board2, 7, text.STATUS_LOSS),
    ]
    assert _decode(shipped, tokens) == text.chat_text(shipped, messages, add_generation_prompt=False)
    assert int(shipped_spec.turn_end_ids[0]) == shipped.convert_tokens_to_ids("<|im_end|>")
    assert shipped_spec.eos_id == shipped_spec.turn_end_id  # the shipped eos is <|im_end|>


def test_other_tokenizer_and_template(other, render_fns):
    spec = text.build_text_spec(other)
    assert other.convert_ids_to_tokens(spec.turn_end_id) == "<|role_end|>"
    assert [int(i) for i in spec.stop_ids] == [spec.turn_end_id, other.convert_tokens_to_ids("<|endoftext|>")]
    boards = _random_boards(8, seed=9)
    sides = np.array([1, 2] * 4, np.int32)
    for game in (False, True):
        ids, lengths = render_fns[0](spec, boards, sides, game)
        for b, side, row, n in zip(boards, sides, np.asarray(ids), np.asarray(lengths)):
            messages = text.game_task_messages(b, side) if game else text.move_task_messages(b, side)
            assert _decode(other, row, n) == text.chat_text(other, messages)
    statuses = np.arange(text.NUM_STATUSES, dtype=np.int32)
    b = np.repeat(boards[3:4], len(statuses), 0)
    ids, lengths = render_fns[1](spec, b, np.full_like(statuses, 6), statuses, np.ones(len(statuses), bool))
    for status, row, n in zip(statuses, np.asarray(ids), np.asarray(lengths)):
        want = text.tool_response_text(other, boards[3], 6, status, add_turn_end=True)
        assert _decode(other, row, n) == want
        assert want.startswith("<|role_end|><role>OBSERVATION</role><tool_response>\n")


def test_template_that_rewrites_content_is_rejected(shipped):
    # Rewriting a slot's value (X -> x) is caught by the host self-check against the template's own text ...
    bad = "{%- for m in messages -%}<|im_start|>{{ m['content'] | replace('X', 'x') }}<|im_end|>{%- endfor -%}"
    with pytest.raises(ValueError, match="reproduce"):
        text.build_text_spec(shipped, chat_template=bad)
    # ... and dropping content while splitting.
    short = "{%- for m in messages -%}<|im_start|>{{ m['content'][:12] }}<|im_end|>{%- endfor -%}"
    with pytest.raises(ValueError, match="dropped"):
        text.build_text_spec(shipped, chat_template=short)


@pytest.mark.parametrize("which", ["shipped", "other", "varied"])
def test_stencil_render_is_bit_identical_to_general_render(request, render_fns, which):
    """The fast stencil tables and the general concatenation give the very same ids and lengths on every status,
    opponent square, turn-end flag and many boards (and the prompts)."""
    tok = request.getfixturevalue(which)
    fast = text.build_text_spec(tok)
    general = text.build_text_spec(tok, max_stencil_rows=0)
    assert fast.response_stencils is not None and general.response_stencils is None
    assert fast.prompt_stencils is not None and general.prompt_stencils is None
    # Rows: turn end (2) x opponent square (10) on the four board statuses, turn end alone on the other two.
    assert fast.response_stencils.base.shape[0] == 4 * 20 + 2 * 2
    if which == "varied":  # opponent lines of 3 token lengths: the board sits at 2 x 3 offsets (+ no board)
        assert int(np.max(np.asarray(fast.response_stencils.placement))) + 1 == 2 * 3 + 1
    boards = _random_boards(12, seed=7)
    grid = [
        (b, opp, st, te)
        for b in range(len(boards))
        for opp in range(10)
        for st in range(text.NUM_STATUSES)
        for te in (0, 1)
    ]
    b, opp, st, te = (np.array(x) for x in zip(*grid))
    args = (boards[b], opp.astype(np.int32), st.astype(np.int32), te.astype(bool))
    ids_f, n_f = render_fns[1](fast, *args)
    ids_g, n_g = render_fns[1](general, *args)
    assert np.array_equal(np.asarray(n_f), np.asarray(n_g))
    assert np.array_equal(np.asarray(ids_f), np.asarray(ids_g))
    sides = np.array([1 + i % 2 for i in range(len(boards))], np.int32)
    for game in (False, True):
        pf, pn = render_fns[0](fast, boards, sides, game)
        gf, gn = render_fns[0](general, boards, sides, game)
        assert np.array_equal(np.asarray(pf), np.asarray(gf)) and np.array_equal(np.asarray(pn), np.asarray(gn))
    if which == "varied":  # and the ids decode to the template's text
        for i in np.nonzero((opp == 3) | (opp == 7) | (opp == 5))[0][:40]:
            want = text.tool_response_text(tok, boards[b[i]], opp[i], st[i], add_turn_end=bool(te[i]))
            assert _decode(tok, np.asarray(ids_f)[i], np.asarray(n_f)[i]) == want
