"""Tests for the chat-template compiler (reno_jax.protocol.chat): tic-tac-toe identity with the reference the
wording wrote before it moved onto the compiler, and a second, unrelated ChatSpec."""

import chat_reference
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.envs.tictactoe import wording
from reno_jax.protocol import chat
from reno_jax.protocol import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def shipped():
    return tokenizer_lib.load_tokenizer(None)


def test_tictactoe_renders_equal_the_reference(shipped):
    ref = np.load(chat_reference.REFERENCE)
    got = chat_reference.render_all(wording, shipped)
    for k in ref.files:
        if k == "texts":
            continue
        want = ref[k].astype(np.int64)
        assert np.array_equal(got[k], want), k
        general = "general_" + k[len("fast_") :]
        if k.startswith("fast_"):
            assert np.array_equal(got[general], want), general
    want_texts = bytes(ref["texts"]).decode().split("\0")
    assert got["texts"].tolist() == want_texts


# ---------------------------------------------------------------------------------------------------------------
# A second, unrelated spec: a shop with two tools
# ---------------------------------------------------------------------------------------------------------------

MOOD, COUNT, ITEM, TENS, ONES, UNUSED = range(6)
ITEMS = ("apple", "banana bread", "kiwi", "dragon fruit salad")  # different token lengths: a key slot
DIGITS = tuple(str(d) for d in range(10))


def _shop_spec(**overrides):
    mood = chat.Slot(MOOD, ("Hi!", "Good evening, dear customer."))
    count, item = chat.Slot(COUNT, DIGITS), chat.Slot(ITEM, ITEMS)
    tools = (
        {
            "type": "function",
            "function": {
                "name": "buy",
                "description": "Buy an item.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "item": {"type": "string", "enum": list(ITEMS)},
                        "count": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["item", "count"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "ask",
                "description": "Ask the shopkeeper.",
                "parameters": {
                    "type": "object",
                    "properties": {"question": {"type": "string"}},
                    "required": ["question"],
                },
            },
        },
    )
    # Slot boundaries sit at digits and newlines, where the shipped pre-tokenizer splits: so even the ids agree
    # with tokenizing the whole text.
    kw = dict(
        system="You run errands in a shop. Use the tools.",
        tools=tools,
        user=(
            (mood, "\nI want ", count, " of:\n", item, "\nPlease."),
            ("Inventory check.\n", item, "\n", count, " left."),
        ),
        tool=(
            ("Bought ", count, ":\n", item, "\nAnything else?"),
            ("Sold out.",),
            (mood, "\nTotal: ", chat.Slot(TENS, DIGITS), chat.Slot(ONES, DIGITS)),
            (item, "\nis not on the menu."),
        ),
        tool_continues=(True, False, True, False),
        num_values=6,
    )
    kw.update(overrides)
    return chat.ChatSpec(**kw)


N_OPTS = np.array([2, 10, 4, 10, 10, 1])


@pytest.fixture(scope="module")
def shop():
    return _shop_spec()


@pytest.fixture(scope="module")
def shop_tables(shipped, shop):
    return chat.compile_chat(shipped, shop), chat.compile_chat(shipped, shop, max_stencil_rows=0)


def _decode(tok, ids, n):
    return tokenizer_lib.decode(tok, np.asarray(ids)[: int(n)])


def _sample(rng, n):
    values = rng.integers(0, N_OPTS, size=(n, len(N_OPTS))).astype(np.int32)
    values[:, UNUSED] = rng.integers(-5, 5, size=n)  # no slot reads it: any value renders the same
    return values


def test_spec_defaults_and_host_messages(shop):
    assert shop.tool_name == "buy"  # the first tool's function name
    assert shop.value_options() == tuple(N_OPTS)
    values = [1, 3, 3, 4, 2, 0]
    assert chat.user_messages(shop, (0, values))[1]["content"] == (
        "Good evening, dear customer.\nI want 3 of:\ndragon fruit salad\nPlease."
    )
    assert chat.tool_message(shop, (2, values)) == {
        "role": "tool",
        "name": "buy",
        "content": "Good evening, dear customer.\nTotal: 42",
    }
    assert chat.resolve(shop.tool[3], values) == "dragon fruit salad\nis not on the menu."
    with pytest.raises(ValueError, match="out of range"):
        chat.resolve(shop.tool[3], [0, 0, 4, 0, 0, 0])
    with pytest.raises(ValueError, match="template 7 out of range"):
        chat.tool_message(shop, (7, values))


def test_jit_render_equals_the_chat_template(shipped, shop, shop_tables):
    fast, _ = shop_tables
    assert fast.prompt_stencils is not None and fast.response_stencils is not None
    assert [int(i) for i in fast.stop_ids] == [fast.turn_end_id]
    rng = np.random.default_rng(0)
    user = jax.jit(jax.vmap(chat.render_user, in_axes=(None, (0, 0))))
    tool = jax.jit(jax.vmap(chat.render_tool, in_axes=(None, (0, 0), 0)))
    n = 24
    values, template = _sample(rng, n), rng.integers(0, 2, n).astype(np.int32)
    ids, lens = user(fast, (template, values))
    for t, v, row, k in zip(template, values, np.asarray(ids), np.asarray(lens)):
        messages = chat.user_messages(shop, (t, v))
        assert _decode(shipped, row, k) == chat.chat_text(shipped, shop, messages)
        assert row[:k].tolist() == chat.prompt_ids(shipped, shop, messages)
        assert (row[k:] == fast.pad_id).all()
    template, turn_end = rng.integers(0, 4, n).astype(np.int32), rng.integers(0, 2, n).astype(bool)
    ids, lens = tool(fast, (template, values), turn_end)
    for t, v, te, row, k in zip(template, values, turn_end, np.asarray(ids), np.asarray(lens)):
        want = chat.tool_text(shipped, shop, (t, v), add_turn_end=bool(te))
        assert _decode(shipped, row, k) == want
        assert want.endswith("<|im_start|>assistant\n") == shop.tool_continues[t]


def test_whole_conversation_equals_the_template(shipped, shop, shop_tables):
    """user render + policy turn + tool render + policy turn + final tool render == the template's whole chat."""
    fast, _ = shop_tables
    policy = [
        "<tool_call>" + '{"name": "ask", "arguments": {"question": "total?"}}' + "</tool_call><|im_end|>",
        "Thanks.",
    ]  # the second turn stops without its turn end: the render adds it
    v1, v2 = np.array([0, 2, 1, 0, 0, 0], np.int32), np.array([0, 2, 1, 0, 7, 0], np.int32)
    ids, n = chat.render_user(fast, (0, v1))
    tokens = list(np.asarray(ids)[: int(n)]) + shipped.encode(policy[0], add_special_tokens=False)
    r, n = chat.render_tool(fast, (2, v2), False)
    tokens += list(np.asarray(r)[: int(n)]) + shipped.encode(policy[1], add_special_tokens=False)
    r, n = chat.render_tool(fast, (1, v2), True)
    tokens += list(np.asarray(r)[: int(n)])
    messages = chat.user_messages(shop, (0, v1)) + [
        {"role": "assistant", "content": policy[0][: -len("<|im_end|>")]},
        chat.tool_message(shop, (2, v2)),
        {"role": "assistant", "content": policy[1]},
        chat.tool_message(shop, (1, v2)),
    ]
    assert _decode(shipped, tokens, len(tokens)) == chat.chat_text(shipped, shop, messages, add_generation_prompt=False)


def test_stencil_path_equals_general_path(shop_tables):
    fast, general = shop_tables
    assert general.prompt_stencils is None and general.response_stencils is None
    # Rows: per user template its key combinations (mood x item, item), per tool template x turn end.
    assert fast.prompt_stencils.base.shape[0] == 2 * 4 + 4
    assert fast.response_stencils.base.shape[0] == 2 * (4 + 1 + 2 + 4)
    rng = np.random.default_rng(1)
    values = _sample(rng, 256)
    values[:8] = -3  # out of range both ways: clipped alike on both paths
    values[8:16] = 99
    for fn, nt in ((chat.render_user, 2), (chat.render_tool, 4)):
        template = rng.integers(-1, nt + 1, len(values)).astype(np.int32)
        extra = (rng.integers(0, 2, len(values)).astype(bool),) if fn is chat.render_tool else ()
        axes = (None, (0, 0)) + (0,) * len(extra)
        run = jax.jit(jax.vmap(fn, in_axes=axes))
        ids_f, n_f = run(fast, (template, values), *extra)
        ids_g, n_g = run(general, (template, values), *extra)
        np.testing.assert_array_equal(np.asarray(n_f), np.asarray(n_g))
        np.testing.assert_array_equal(np.asarray(ids_f), np.asarray(ids_g))


class RenderVariantsTest(chex.TestCase):
    """Same ids with and without jit, per message and vmapped, and with a ``Message`` pytree."""

    @classmethod
    def setUpClass(cls):
        cls.tables = chat.compile_chat(tokenizer_lib.load_tokenizer(None), _shop_spec())

    @chex.variants(with_jit=True, without_jit=True)
    def test_render_variants(self):
        from reno_jax.envs.interface import Message

        values = jnp.asarray(_sample(np.random.default_rng(2), 6))
        template = jnp.arange(6, dtype=jnp.int32) % 4
        turn_end = jnp.arange(6) % 2 == 0

        @self.variant
        def batched(tables, message, turn_end):
            return jax.vmap(chat.render_tool, in_axes=(None, 0, 0))(tables, message, turn_end)

        ids, n = batched(self.tables, Message(template=template, values=values), turn_end)
        chex.assert_shape(ids, (6, self.tables.response_len))
        chex.assert_type([ids, n], jnp.int32)
        for i in range(6):
            one, k = chat.render_tool(self.tables, (template[i], values[i]), turn_end[i])
            chex.assert_trees_all_equal((one, k), (ids[i], n[i]))
        user = self.variant(chat.render_user)
        ids, n = user(self.tables, Message(template=jnp.int32(1), values=values[0]))
        chex.assert_shape(ids, (self.tables.prompt_len,))


def test_bad_specs_are_rejected_clearly(shipped):
    with pytest.raises(ValueError, match="slot value index 6 out of range"):
        _shop_spec(user=(("x", chat.Slot(6, ("a",))),))
    with pytest.raises(ValueError, match="no options"):
        chat.Slot(0, ())
    with pytest.raises(ValueError, match="4 tool templates but 2 tool_continues"):
        _shop_spec(tool_continues=(True, False))
    with pytest.raises(ValueError, match="different numbers of options"):
        _shop_spec(tool=(("n", chat.Slot(COUNT, ("a", "b"))),), tool_continues=(True,))
    with pytest.raises(ValueError, match="at least one user template"):
        _shop_spec(user=())
    with pytest.raises(ValueError, match="str or Slot"):
        _shop_spec(user=(("a", 3),))
    with pytest.raises(ValueError, match="explicit tool_name"):
        _shop_spec(tools=())
    with pytest.raises(ValueError, match="shape \\[6\\]"):
        chat.render_user(chat.compile_chat(shipped, _shop_spec()), (0, jnp.zeros(5, jnp.int32)))
    # A template that drops content is caught while splitting, one that rewrites it by the self-check.
    short = "{%- for m in messages -%}<|im_start|>{{ m['content'][:10] }}<|im_end|>{%- endfor -%}"
    with pytest.raises(ValueError, match="dropped"):
        chat.compile_chat(shipped, _shop_spec(), chat_template=short)
    rewrite = (
        "{%- for m in messages -%}<|im_start|>{{ m['content'] | replace('Hi!', 'Hi.') }}<|im_end|>\n{%- endfor -%}"
    )
    with pytest.raises(ValueError, match="user-template 0 pieces do not reproduce"):
        chat.compile_chat(shipped, _shop_spec(), chat_template=rewrite)


def test_tictactoe_message_values_drive_the_generic_renderer(shipped):
    from reno_jax.envs.interface import Message

    spec = wording.build_text_spec(shipped)
    board = np.array([1, 0, 2, 0, 1, 0, 0, 0, 2], np.int8)
    values = wording.message_values(board, 2, 7)
    chex.assert_trees_all_equal(values, jnp.asarray([1, 0, 2, 0, 1, 0, 0, 0, 2, 1, 7], jnp.int32))
    chex.assert_trees_all_equal(
        chat.render_tool(spec, Message(jnp.int32(wording.STATUS_LOSS), values), True),
        wording.render_tool_response(spec, board, 7, wording.STATUS_LOSS, True),
    )
    chex.assert_trees_all_equal(
        chat.render_user(spec, Message(jnp.int32(wording.USER_GAME), values)),
        wording.render_prompt(spec, board, 2, True),
    )
    assert chat.user_messages(wording.chat_spec(), (wording.USER_MOVE, values)) == wording.move_task_messages(board, 2)
