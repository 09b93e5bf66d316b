"""Rollout Routing Replay (R3): replayed MoE routing in the model, its recording in the rollout, the train-side
plumbing (shared prefix, micro-batches, remat) and the rollout/train mismatch metrics.

Run: python -m pytest -q tests/test_routing_replay.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from reno_jax import pipeline
from reno_jax.models import ling3
from reno_jax.models.layers import moe, moe_dense_reference, moe_experts_blocked, route, swiglu_mlp
from reno_jax.rl import losses, shared_prefix, trainer

FAST = {"xla_backend_optimization_level": 0}
CFG = ling3.tiny_test_config()  # 4 layers, MoE in layers 1..3 (n_moe = 3), 8 experts top-2, 2 groups / 1 kept
N_MOE = len(ling3.moe_layer_indices(CFG))
K = CFG.num_experts_per_tok


@functools.lru_cache(maxsize=None)
def params():
    return ling3.init_params(CFG, jax.random.PRNGKey(0))


def ids(b=3, t=10, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, CFG.vocab_size)


def _fwd_routing(p, tokens, valid, replay, remat=False):
    logits, _, routing = ling3.forward(p, CFG, tokens, valid=valid, replay_experts=replay, return_routing=True,
                                       remat=remat)
    return logits, routing


fwd_routing = jax.jit(_fwd_routing, compiler_options=FAST)


@functools.partial(jax.jit, compiler_options=FAST)
def fwd_plain(p, tokens, valid):
    return ling3.forward(p, CFG, tokens, valid=valid)[0]


def foreign_ids(shape, seed):
    """K distinct expert ids per (token, layer), outside the group limit on purpose."""
    rng = np.random.default_rng(seed)
    out = np.stack([rng.permutation(CFG.num_experts)[:K] for _ in range(int(np.prod(shape)))])
    return jnp.asarray(out.reshape(shape + (K,)), jnp.int16)


# ------------------------------------------------------------------------------------------------ model


def test_replaying_own_routing_is_bit_identical():
    p, tokens = params(), ids()
    valid = jnp.arange(10)[None] < jnp.array([10, 7, 4])[:, None]
    plain = fwd_plain(p, tokens, valid)
    logits, routing = fwd_routing(p, tokens, valid, None)
    assert routing.experts.shape == (3, 10, N_MOE, K) and routing.experts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(routing.experts), np.asarray(routing.own))
    r = np.asarray(routing.experts)
    assert np.all(r[~np.asarray(valid)] == -1) and np.all(r[np.asarray(valid)] >= 0)
    # Replay the model's own ids (stored as int16, as the rollout does): same logits, bit for bit.
    replayed, routing2 = fwd_routing(p, tokens, valid, routing.experts.astype(jnp.int16))
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(routing2.experts), r)
    lp = jax.jit(lambda p, r: ling3.token_logprobs(p, CFG, tokens, valid, replay_experts=r))
    np.testing.assert_array_equal(np.asarray(lp(p, routing.experts)), np.asarray(lp(p, None)))


def test_router_gradients_with_own_replay_equal_normal_and_nonzero():
    p, tokens = params(), ids()
    own = fwd_routing(p, tokens, None, None)[1].experts

    @jax.jit
    def grads(p, replay):
        def loss(p):
            return jnp.mean(ling3.token_logprobs(p, CFG, tokens, replay_experts=replay))
        return jax.grad(loss)(p)

    g_plain, g_replay = grads(p, None), grads(p, own)
    for i in ling3.moe_layer_indices(CFG):
        gk = np.asarray(g_replay["model"][f"layers_{i}"]["mlp"]["gate"]["kernel"])
        assert np.abs(gk).max() > 0, f"layer {i}: no gradient reaches the router under replay"
        np.testing.assert_allclose(gk, np.asarray(g_plain["model"][f"layers_{i}"]["mlp"]["gate"]["kernel"]),
                                   rtol=1e-6, atol=1e-9)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_replay)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-9)


def test_minus_one_falls_back_and_foreign_ids_change_only_their_row():
    p, tokens = params(), ids()
    plain, routing = fwd_routing(p, tokens, None, None)
    replay = np.full((3, 10, N_MOE, K), -1, np.int16)
    foreign = np.asarray(foreign_ids((10, N_MOE), 3))
    replay[1] = foreign  # row 1 replays foreign ids everywhere, rows 0 and 2 route normally
    replay[2, 4:] = np.asarray(routing.experts)[2, 4:]  # row 2: own ids from position 4 on, -1 before
    out, used = fwd_routing(p, tokens, None, jnp.asarray(replay))
    out, plain, used = np.asarray(out), np.asarray(plain), np.asarray(used.experts)
    np.testing.assert_array_equal(out[[0, 2]], plain[[0, 2]])
    assert np.abs(out[1] - plain[1]).max() > 1e-3
    np.testing.assert_array_equal(used[1], foreign)  # exactly the replayed experts were used
    np.testing.assert_array_equal(used[[0, 2]], np.asarray(routing.experts)[[0, 2]])


def _hand_weights(p_gate, x, experts):
    scores = 1.0 / (1.0 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(p_gate["kernel"], np.float64))))
    w = np.take_along_axis(scores, np.asarray(experts), axis=1)
    return w / w.sum(1, keepdims=True) * CFG.routed_scaling_factor


@pytest.mark.parametrize("num_experts", [8, 32])
def test_replayed_moe_uses_exactly_the_given_experts(num_experts):
    """moe() with foreign ids == the dense reference run with those ids and hand-computed gate weights, for the
    dense CPU dispatch (8 experts) and the ragged one (32 experts); the blocked dispatch takes the same weights."""
    cfg = CFG.replace(num_experts=num_experts, n_group=4 if num_experts == 32 else 2)
    p = ling3.init_params(cfg, jax.random.PRNGKey(2))["model"]["layers_1"]["mlp"]
    n = 24
    x = jax.random.normal(jax.random.PRNGKey(4), (1, n, cfg.hidden_size))
    rng = np.random.default_rng(5)
    replay = np.stack([rng.permutation(num_experts)[:K] for _ in range(n)]).astype(np.int32)
    replay[:3] = -1  # fallback rows

    @functools.partial(jax.jit, compiler_options=FAST)
    def run(p, x, replay):
        w, e, own = route(p["gate"], x[0], cfg, replay, return_own=True)
        out, used, own2 = moe(p, x, cfg, replay=replay[None], return_routing=True)
        ref = moe_dense_reference(p["experts"], x[0], w, e)
        blocked = moe_experts_blocked(p["experts"], x[0], w, e, block_rows=8)
        return w, e, own, out[0], used[0], own2[0], ref, blocked

    w, e, own, out, used, own2, ref, blocked = run(p, x, jnp.asarray(replay))
    expect = np.where(replay[:, :1] >= 0, replay, np.asarray(own))
    np.testing.assert_array_equal(np.asarray(e), expect)
    np.testing.assert_array_equal(np.asarray(used), expect)
    np.testing.assert_array_equal(np.asarray(own2), np.asarray(own))
    np.testing.assert_allclose(np.asarray(w), _hand_weights(p["gate"], x[0], expect), rtol=1e-5)
    shared = np.asarray(swiglu_mlp(p["shared_experts"], x[0]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref) + shared, atol=1e-5)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(ref), atol=1e-5)


def test_remat_with_replay_same_values_and_gradients():
    p, tokens = params(), ids()
    replay = foreign_ids((3, 10, N_MOE), 7)

    def compiled(remat):
        def loss(p):
            logits, routing = _fwd_routing(p, tokens, None, replay, remat=remat)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 3])
        return jax.jit(jax.value_and_grad(loss))

    (l0, g0), (l1, g1) = compiled(False)(p), compiled(True)(p)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    assert np.abs(np.asarray(g1["model"]["layers_1"]["mlp"]["gate"]["kernel"])).max() > 0
