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

from reno_jax.envs.tictactoe import env as E
from reno_jax.models import ling3
from reno_jax.models.layers import moe, moe_dense_reference, moe_experts_blocked, route, swiglu_mlp
from reno_jax.rl import losses, policy, shared_prefix, trainer
from reno_jax.rl.batch import TrainBatch

FAST = {"xla_backend_optimization_level": 0}
# 3 layers [KDA + dense MLP, MLA + MoE, MLA + MoE]: every layer kind and two MoE layers (n_moe = 2), 8 experts
# top-2, 2 groups / 1 kept; one KDA layer only, since a KDA layer is most of a program's compile time.
CFG = ling3.tiny_test_config(num_hidden_layers=3)
N_MOE = len(ling3.moe_layer_indices(CFG))
K = CFG.num_experts_per_tok


@functools.lru_cache(maxsize=None)
def params():
    return ling3.init_params(CFG, jax.random.PRNGKey(0))


def ids(b=3, t=10, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, CFG.vocab_size)


def _fwd_routing(p, tokens, valid, replay, remat=False):
    logits, _, routing = ling3.forward(
        p, CFG, tokens, valid=valid, replay_experts=replay, return_routing=True, remat=remat
    )
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
        np.testing.assert_allclose(
            gk, np.asarray(g_plain["model"][f"layers_{i}"]["mlp"]["gate"]["kernel"]), rtol=1e-6, atol=1e-9
        )
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


# ------------------------------------------------------------------------------------------------ rollout


def test_rollout_records_the_routing_of_every_fed_token():
    """Game task, 2 turns (prompt prefill, forced first call, tool-response prefill, sampled second turn): the
    recorded ids have the documented layout and equal the own top-k of a float32 train forward of the same
    conversation; -1 exactly on padding."""
    from reno_jax.protocol.tokenizer import load_tokenizer
    from reno_jax.rollout import rollout as R

    mc = ling3.tiny_test_config(vocab_size=512, num_hidden_layers=3)  # KDA (dense), MLA (MoE), MLA (MoE)
    rc = R.RolloutConfig(group_size=2, max_new_tokens=10, max_turns=2, prefill_chunk=16, record_routing=True)
    tok = load_tokenizer(None)
    env = R.compile_env(E.TicTacToeEnv.create("game"), tok, vocab_size=mc.vocab_size)
    p = ling3.init_params(mc, jax.random.PRNGKey(3))
    starts = E.game_starts(jax.random.key(5), 1, agent_player=1, opponent="minimax")
    call = tok.encode(
        '<tool_call>{"name": "choose_square", "arguments": {"square": 5}}</tool_call>', add_special_tokens=False
    )
    forced = np.full((2, 2, 10), -1, np.int32)
    forced[:, 0, : len(call)] = call
    run = jax.jit(functools.partial(R.rollout, model_config=mc, rollout_config=rc), compiler_options=FAST)
    traj = jax.device_get(run(p, jax.random.key(1), starts, env=env, forced_tokens=jnp.asarray(forced)))
    n_moe = len(ling3.moe_layer_indices(mc))
    assert n_moe == 2
    routing, valid = np.asarray(traj.routing), np.asarray(traj.valid)
    assert routing.shape == traj.tokens.shape + (n_moe, mc.num_experts_per_tok) and routing.dtype == np.int16
    assert np.all(routing[~valid] == -1) and np.all(routing[valid] >= 0)
    assert np.asarray(traj.info["num_turns"]).min() == 2  # the tool response was prefilled and recorded too
    own = jax.jit(lambda p, t, v: ling3.forward(p, mc, t, valid=v, return_routing=True)[2].own)(
        p, jnp.asarray(traj.tokens), jnp.asarray(valid)
    )
    np.testing.assert_array_equal(np.sort(routing, -1), np.sort(np.asarray(own), -1))


# ------------------------------------------------------------------------------------------------ train side

N, G, S, C = 2, 2, 8, 6
S0 = 3  # leading tokens every row shares (the batch-wide common part of a shared-prefix batch)


@functools.lru_cache(maxsize=None)
def group_batch():
    """N groups of G rows sharing an S-token prefix, ragged continuations, and a FOREIGN recorded routing (the
    prefix part identical within a group, as a rollout with a shared prompt prefill records it)."""
    prefix = jax.random.randint(jax.random.PRNGKey(1), (N, S), 0, CFG.vocab_size)
    prefix = prefix.at[:, :S0].set(prefix[0, :S0])
    cont = jax.random.randint(jax.random.PRNGKey(2), (N * G, C), 0, CFG.vocab_size)
    tokens = jnp.concatenate([jnp.repeat(prefix, G, 0), cont], 1)
    lengths = jnp.array([C, 3] * N)
    valid = jnp.arange(S + C)[None] < (S + lengths)[:, None]
    routing = np.array(foreign_ids((N * G, S + C, N_MOE), 11))
    routing[:, :S] = np.repeat(routing[::G, :S], G, axis=0)
    routing[:, :S0] = routing[0, :S0]
    routing[~np.asarray(valid)] = -1
    routing[0, S + 1] = -1  # one unrecorded position: normal routing there
    return TrainBatch(
        tokens=tokens,
        valid=valid,
        loss_mask=valid & (jnp.arange(S + C)[None] >= S),
        old_logp=jnp.full((N * G, S + C), -4.0),
        advantages=jax.random.normal(jax.random.PRNGKey(3), (N * G,)),
        routing=jnp.asarray(routing),
    )


@pytest.mark.parametrize("common", [0, S0])
def test_shared_prefix_with_replay_equals_rowwise_with_replay(common):
    p, batch = params(), group_batch()
    sb = shared_prefix.split_shared_prefix(batch, S, common)
    assert sb.prefix_routing.shape == (N * G, S - common, N_MOE, K)
    assert sb.routing.shape == (N * G, C, N_MOE, K)
    assert (sb.common_routing is None) == (common == 0)
    if common:
        assert sb.common_routing.shape == (N * G, common, N_MOE, K)
    replay_fn = jax.jit(policy.make_logp_fn(CFG, group_size=G, routing_replay=True))
    plain_fn = jax.jit(policy.make_logp_fn(CFG, group_size=G))
    (lp_row, st_row), (lp_sh, st_sh), (lp_plain, st_plain) = (
        (out.logp, out.routing) for out in (replay_fn(p, batch), replay_fn(p, sb), plain_fn(p, batch))
    )
    m = np.asarray(batch.valid[:, S:])
    np.testing.assert_allclose(np.asarray(lp_sh)[m], np.asarray(lp_row[:, S:])[m], atol=2e-5)
    assert np.abs(np.asarray(lp_row - lp_plain)[np.asarray(batch.valid)]).max() > 1e-3  # replay is used
    # Same agreement counts both ways; foreign ids agree with the model's own top-k only by chance.
    assert float(st_row.total) == float(st_sh.total) == float(np.asarray(batch.valid).sum() * N_MOE - N_MOE)
    assert float(st_row.agree) == float(st_sh.agree) < 0.5 * float(st_row.total)
    assert float(st_plain.total) == float(st_row.total)


def test_train_step_with_replay_microbatches_and_remat_match():
    """A GSPO step replaying a foreign routing: row-wise in one micro-batch == shared prefix in N micro-batches
    with remat (same loss, metrics and new params)."""
    p, batch = params(), group_batch()
    opt = optax.sgd(0.1)
    loss_fn = functools.partial(losses.gspo_loss, eps_low=0.2, eps_high=0.2)

    def step(micro, remat):
        return trainer.make_train_step(
            policy.make_logp_fn(CFG, group_size=G, remat=remat, routing_replay=True),
            loss_fn,
            opt,
            num_microbatches=micro,
            donate=False,
            rollout_metrics=True,
        )

    state = trainer.create_train_state(p, opt, 0)
    s_row, m_row = step(1, False)(state, batch)
    s_sh, m_sh = step(N, True)(state, shared_prefix.split_shared_prefix(batch, S))
    for k in (
        "loss",
        "grad_norm",
        "rollout_logp_abs_diff_mean",
        "rollout_logp_abs_diff_max",
        "rollout_k3_kl",
        "rollout_ratio_max",
        "routing_agreement",
    ):
        np.testing.assert_allclose(float(m_sh[k]), float(m_row[k]), rtol=1e-4, err_msg=k)
    for a, b in zip(jax.tree.leaves(s_row.params), jax.tree.leaves(s_sh.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    gate = lambda s: np.asarray(s.params["model"]["layers_1"]["mlp"]["gate"]["kernel"])  # noqa: E731
    assert np.abs(gate(s_row) - gate(state)).max() > 0  # the router trains under replay


# ------------------------------------------------------------------------------------------------ metrics


def test_routing_stats_compare_sets():
    own = jnp.array([[[[0, 1], [2, 3]], [[4, 5], [-1, -1]]]], jnp.int32)  # [B=1, T=2, n_moe=2, K=2]
    rec = jnp.array([[[[1, 0], [2, 4]], [[4, 5], [4, 5]]]], jnp.int16)  # same set reordered / differs / -1 own
    st = policy.routing_stats(own, rec)
    assert float(st.agree) == 2.0 and float(st.total) == 3.0
    st = policy.routing_stats(own, jnp.where(jnp.asarray([True, False])[None, :, None, None], rec, -1))
    assert float(st.agree) == 1.0 and float(st.total) == 2.0


def test_mismatch_metrics_first_minibatch_only():
    """Toy policy whose logp is old_logp + delta[row]: the metrics are the token-level figures of minibatch 0
    (rows 0-3, two micro-batches) and ignore minibatch 1; identical log-probs give 0 / 0 / ratio 1.

    The toy's per-row inputs ride in TrainBatch fields it is free to read: delta in `advantages` (the toy loss
    ignores them), each row's routing agreement (0 or 1 of 1) in `tokens[:, 0]`."""
    L = 3

    def logp_fn(params, batch):
        logp = batch.old_logp + batch.advantages[:, None] + 0.0 * params["w"]
        agree = batch.tokens[:, 0].astype(jnp.float32)
        return trainer.PolicyOutput(
            logp, None, trainer.RoutingStats(agree=jnp.sum(agree), total=jnp.float32(agree.size))
        )

    def loss_fn(logp, old_logp, adv, mask):
        return jnp.mean(logp * mask), {}

    def make(delta, agree):
        return TrainBatch(
            tokens=jnp.zeros((8, L), jnp.int32).at[:, 0].set(jnp.asarray(agree, jnp.int32)),
            loss_mask=mask,
            old_logp=jnp.full((8, L), -1.0),
            advantages=delta,
        )

    opt = optax.sgd(0.1)
    step = trainer.make_train_step(
        logp_fn, loss_fn, opt, num_minibatches=2, num_microbatches=2, donate=False, rollout_metrics=True
    )
    state = trainer.create_train_state({"w": jnp.zeros(())}, opt, 0)
    delta = jnp.array([0.1, -0.3, 0.2, 0.0, 5.0, 5.0, 5.0, 5.0])
    mask = jnp.ones((8, L), bool).at[3, 1:].set(False)
    batch = make(delta, [1, 1, 0, 1, 0, 0, 0, 0])
    _, m = jax.jit(step)(state, batch)
    d = np.repeat(np.asarray(delta[:4], np.float64), L)[np.asarray(mask[:4]).ravel()]
    np.testing.assert_allclose(float(m["rollout_logp_abs_diff_mean"]), np.abs(d).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["rollout_logp_abs_diff_max"]), 0.3, rtol=1e-5)
    np.testing.assert_allclose(float(m["rollout_k3_kl"]), np.mean(np.expm1(d) - d), rtol=1e-4)
    np.testing.assert_allclose(float(m["rollout_ratio_max"]), np.exp(0.2), rtol=1e-5)
    np.testing.assert_allclose(float(m["routing_agreement"]), 0.75, rtol=1e-6)
    _, m0 = jax.jit(step)(state, make(jnp.zeros((8,)), [1] * 8))
    assert float(m0["rollout_logp_abs_diff_mean"]) == 0.0 and float(m0["rollout_logp_abs_diff_max"]) == 0.0
    assert float(m0["rollout_k3_kl"]) == 0.0 and float(m0["rollout_ratio_max"]) == 1.0
    assert float(m0["routing_agreement"]) == 1.0
