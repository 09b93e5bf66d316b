"""The one-class contract of a jitted environment: `registry.register_env` reads everything from the class (name,
options from its non-pytree fields, sample_starts / teacher / eval_suites), and the base class's `step` judges
invalid calls so that an environment writes only `apply`."""

import chex
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import pytest

from reno_jax.envs import interface, registry
from reno_jax.protocol import toolcall
from reno_jax.protocol.chat import ChatSpec, Slot

DIGITS = tuple(str(k) for k in range(10))
CHAT = ChatSpec(
    system="Count up.",
    tools=(
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add to the count.",
                "parameters": {
                    "type": "object",
                    "properties": {"amount": {"type": "integer", "minimum": 1, "maximum": 3}},
                    "required": ["amount"],
                },
            },
        },
    ),
    user=(("Count from ", Slot(0, DIGITS), "."),),
    tool=(("Now ", Slot(0, DIGITS), "."), ("Done.",), ("Invalid call.",)),
    tool_continues=(True, False, False),
    num_values=1,
)


@flax.struct.dataclass
class Counter(interface.TextEnv):
    name = "contract_counter"
    invalid_call_reward = -0.5
    target: int = flax.struct.field(pytree_node=False, default=6)
    label: str = flax.struct.field(pytree_node=False, default="plain")

    def chat(self):
        return CHAT

    def reset(self, start):
        return start, interface.Message(jnp.int32(0), start[None])

    def apply(self, state, call):
        count = state + call.args[0]
        done = count >= self.target
        message = interface.Message(jnp.where(done, 1, 0).astype(jnp.int32), jnp.minimum(count, 9)[None])
        info = {"count": count, "reached": done}
        return interface.Step(state=count, message=message, reward=done.astype(jnp.float32), done=done, info=info)

    def sample_starts(self, key, num_groups):
        return jax.random.randint(key, (num_groups,), 0, 3)


registry.register_env(Counter)


def _call(kind, amount):
    return interface.ToolCall(kind=jnp.int32(kind), tool=jnp.int32(0), args=jnp.array([amount], jnp.int32))


@pytest.mark.parametrize("jit", [False, True])
def test_the_base_step_applies_valid_calls_and_judges_invalid_ones(jit):
    env = Counter()
    step = jax.jit(env.step) if jit else env.step
    state, _ = env.reset(jnp.int32(4))
    ok = step(state, _call(toolcall.KIND_OK, 3))
    assert int(ok.state) == 7 and bool(ok.done) and float(ok.reward) == 1.0 and int(ok.message.template) == 1
    assert not bool(ok.info["invalid"]) and int(ok.info["count"]) == 7
    for kind in (toolcall.KIND_NO_CALL, toolcall.KIND_BAD_CALL, toolcall.KIND_OUT_OF_RANGE):
        bad = step(state, _call(kind, 0))
        assert int(bad.state) == 4, "an invalid call leaves the state as it was"
        assert bool(bad.done) and float(bad.reward) == -0.5 and bad.reward.dtype == jnp.float32
        assert int(bad.message.template) == 2 and int(bad.message.values[0]) == 0  # the last tool template
        assert bool(bad.info["invalid"]) and int(bad.info["count"]) == 0 and not bool(bad.info["reached"])


def test_the_base_step_vmaps_over_episodes():
    env = Counter()
    states = jnp.array([0, 4, 5], jnp.int32)
    calls = jax.vmap(_call)(jnp.array([0, 2, 0]), jnp.array([1, 0, 2]))
    out = jax.jit(jax.vmap(env.step))(states, calls)
    chex.assert_shape(out.reward, (3,))
    assert out.info["invalid"].tolist() == [False, True, False] and out.done.tolist() == [False, True, True]
    assert out.state.tolist() == [1, 4, 7] and out.reward.tolist() == [0.0, -0.5, 1.0]


def test_register_env_reads_the_class():
    entry = registry.get("contract_counter")
    assert entry.env_class is Counter and registry.entry_of(Counter) is entry
    assert entry.options == {"target": 6, "label": "plain"}
    env = entry.make_env(ml_collections.ConfigDict({"name": "contract_counter", "target": 8}))
    assert isinstance(env, Counter) and env.target == 8 and env.label == "plain"
    config = ml_collections.ConfigDict({"env": {"name": "contract_counter", "target": 8}})
    starts = entry.make_sampler(config)(jax.random.key(0), 5)
    chex.assert_shape(starts, (5,))
    assert entry.make_teacher is None and entry.eval_suites is None and entry.board_view is None
    with pytest.raises(ValueError, match="env.target must be int, got str"):
        entry.make_env(ml_collections.ConfigDict({"name": "contract_counter", "target": "eight"}))
    with pytest.raises(ValueError, match="unknown option of environment 'contract_counter'"):
        entry.make_env(ml_collections.ConfigDict({"name": "contract_counter", "speed": 2}))


def test_register_env_refuses_what_it_cannot_use():
    class NotAnEnv:
        name = "x"

    with pytest.raises(TypeError, match="takes a TextEnv subclass"):
        registry.register_env(NotAnEnv)

    @flax.struct.dataclass
    class Nameless(Counter):
        name = ""

    with pytest.raises(TypeError, match="needs a class attribute name"):
        registry.register_env(Nameless)

    @flax.struct.dataclass
    class Clashing(Counter):
        name = "contract_clash"
        module: str = flax.struct.field(pytree_node=False, default="")

    with pytest.raises(TypeError, match=r"the option names \['module'\]"):
        registry.register_env(Clashing)

    @flax.struct.dataclass
    class Unregistered(Counter):
        name = "contract_unregistered"

    with pytest.raises(ValueError, match="is not a registered environment"):
        registry.entry_of(Unregistered)


def test_invalid_info_keeps_what_the_environment_says():
    @flax.struct.dataclass
    class Counting(Counter):
        def invalid_info(self, state, info):
            return {"count": state, "reached": jnp.bool_(False)}

    state, _ = Counting().reset(jnp.int32(4))
    bad = jax.jit(Counting().step)(state, _call(toolcall.KIND_BAD_CALL, 0))
    assert int(bad.info["count"]) == 4 and bad.info["count"].dtype == jnp.int32 and bool(bad.info["invalid"])

    @flax.struct.dataclass
    class Missing(Counter):
        def invalid_info(self, state, info):
            return {"count": state}

    with pytest.raises(TypeError, match="invalid_info must return a dict with apply's info keys"):
        Missing().step(state, _call(toolcall.KIND_BAD_CALL, 0))


def test_apply_may_not_report_invalid_itself_and_an_env_needs_step_or_apply():
    @flax.struct.dataclass
    class Reports(Counter):
        def apply(self, state, call):
            step = super().apply(state, call)
            return step.replace(info={**step.info, "invalid": ~call.ok})

    state, _ = Reports().reset(jnp.int32(0))
    with pytest.raises(TypeError, match="without an 'invalid' key"):
        Reports().step(state, _call(0, 1))

    @flax.struct.dataclass
    class Empty(interface.TextEnv):
        def chat(self):
            return CHAT

        def reset(self, start):
            return start, interface.Message(jnp.int32(0), start[None])

    with pytest.raises(NotImplementedError, match="must define step"):
        Empty().step(jnp.int32(0), _call(0, 1))
    with pytest.raises(NotImplementedError, match="must define sample_starts"):
        Empty().sample_starts(jax.random.key(0), 2)
