"""Tests for reno_jax.rl.trainer with a toy bigram softmax policy."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from reno_jax.rl import losses, trainer
from reno_jax.rl.batch import TrainBatch

V, L, B = 64, 6, 8  # V*V = 4096 elements: large enough to be 8-bit quantised by default


def toy_params(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w": 0.3 * jax.random.normal(k1, (V, V)), "b": 0.1 * jax.random.normal(k2, (V,))}


def toy_logp_fn(params, batch: TrainBatch) -> trainer.PolicyOutput:
    """Bigram policy: p(tok_t | tok_{t-1}) = softmax(w[tok_{t-1}] + b). Returns logp [b, L] and entropy [b, L]."""
    tokens = batch.tokens
    logits = params["w"][tokens[:, :-1]] + params["b"]  # [b, L-1, V]
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(lsm, tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(lsm) * lsm, axis=-1)
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return trainer.PolicyOutput(jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, ent], 1))


def make_batch(params, seed=0, ragged=True):
    """Random tokens; reward = number of generated tokens < 8 (so it is learnable); uneven masks."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, L)).astype(np.int32)
    mask = np.zeros((B, L), bool)
    starts = rng.integers(1, 3, B) if ragged else np.full(B, 2)
    ends = rng.integers(3, L + 1, B) if ragged else np.full(B, L)
    for i in range(B):
        mask[i, starts[i] : ends[i]] = True
    if ragged:
        mask[B - 1] = False  # an all-prompt row
    reward = ((tokens < 8) & mask).sum(1).astype(np.float32)
    adv = losses.group_advantages(reward, 4)
    batch = TrainBatch(
        tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), old_logp=jnp.zeros((B, L)), advantages=adv
    )
    logp = toy_logp_fn(params, batch).logp
    return batch.replace(old_logp=jnp.where(batch.loss_mask, logp, 0.0))


def weighted_logp(params, batch):
    """Sum_i A_i * mean_{t in mask_i} logp_{i,t}: what policy-gradient steps should increase."""
    logp = toy_logp_fn(params, batch).logp
    m = batch.loss_mask
    per_seq = jnp.sum(jnp.where(m, logp, 0), 1) / jnp.maximum(m.sum(1), 1)
    return float(jnp.sum(batch.advantages * per_seq))


def fresh_state(opt, seed=0):
    return trainer.create_train_state(toy_params(seed), opt, 0)


_OPTS = {
    "sgd": lambda: optax.sgd(0.5),
    "adamw": lambda: trainer.make_optimizer(3e-2, weight_decay=0.0),
    "adamw_bf16": lambda: trainer.make_optimizer(3e-2, weight_decay=0.0, state_dtype="bfloat16"),
    "adamw_int8": lambda: trainer.make_optimizer(3e-2, weight_decay=0.0, state_dtype="int8"),
}


@functools.lru_cache(maxsize=None)
def get_step(loss_name, opt_name, M=1, K=1, shuffle=False):
    """(optimizer, jitted step), cached so tests share compilations (CPU compiles dominate the runtime)."""
    opt = _OPTS[opt_name]()
    return opt, trainer.make_train_step(
        toy_logp_fn, losses.LOSSES[loss_name], opt, num_minibatches=M, num_microbatches=K, shuffle=shuffle
    )


# ---------------------------------------------------------------------------------------------------------------
def test_schedule_warmup_then_cosine():
    s = trainer.make_lr_schedule(1e-3, 1e-4, warmup_steps=4, total_steps=14)
    # Warmup: linear from learning_rate / warmup_steps (not 0: the first update counts) to the peak at update 4.
    np.testing.assert_allclose([float(s(n)) for n in range(5)], [2.5e-4, 4.375e-4, 6.25e-4, 8.125e-4, 1e-3], rtol=1e-6)
    np.testing.assert_allclose(float(s(9)), 1e-4 + 0.5 * 9e-4, rtol=1e-5)  # half-way through the cosine
    assert float(s(5)) < 1e-3 and float(s(13)) > 1e-4  # decaying, not there yet
    np.testing.assert_allclose(float(s(14)), 1e-4, rtol=1e-5)
    np.testing.assert_allclose(float(s(100)), 1e-4, rtol=1e-5)
    out = jax.jit(s)(jnp.int32(9))
    assert out.dtype == jnp.float32 and out.shape == ()
    # No warmup: the cosine from update 0; total_steps None: constant after warmup.
    cos = trainer.make_lr_schedule(2e-3, 1e-4, warmup_steps=0, total_steps=4)
    np.testing.assert_allclose([float(cos(n)) for n in (0, 2, 4, 9)], [2e-3, 1.05e-3, 1e-4, 1e-4], rtol=1e-5)
    const = trainer.make_lr_schedule(2e-3, warmup_steps=0)
    assert float(const(0)) == pytest.approx(2e-3) and float(const(10**6)) == pytest.approx(2e-3)
    warm_const = trainer.make_lr_schedule(2e-3, warmup_steps=4)
    np.testing.assert_allclose([float(warm_const(n)) for n in (0, 2, 4, 10**6)], [5e-4, 1.25e-3, 2e-3, 2e-3], rtol=1e-6)
    # total_steps == warmup_steps: the peak at the end of warmup, end_learning_rate from the next update.
    short = trainer.make_lr_schedule(1e-3, 1e-4, warmup_steps=2, total_steps=2)
    np.testing.assert_allclose([float(short(n)) for n in range(5)], [5e-4, 7.5e-4, 1e-3, 1e-4, 1e-4], rtol=1e-5)
    for bad in (dict(warmup_steps=10, total_steps=5), dict(warmup_steps=-1), dict(end_learning_rate=-1.0)):
        with pytest.raises(ValueError):
            trainer.make_lr_schedule(1e-3, **bad)


def test_join_lr_schedules():
    a = trainer.make_lr_schedule(1e-3, 1e-4, warmup_steps=2, total_steps=10)
    b = trainer.make_lr_schedule(5e-4, 5e-5, warmup_steps=0, total_steps=6)
    c = trainer.make_lr_schedule(2e-4)
    joined = trainer.join_lr_schedules([a, b, c], [10, 6, 1])
    want = [float(a(n)) for n in range(10)] + [float(b(n)) for n in range(6)] + [float(c(n)) for n in range(5)]
    assert [float(joined(n)) for n in range(21)] == want  # each piece counted from its own start
    assert trainer.join_lr_schedules([a], [10]) is a
    for bad in (([a, b], [10]), ([], []), ([a, b], [10, 0])):
        with pytest.raises(ValueError):
            trainer.join_lr_schedules(*bad)


def test_optimizer_matches_optax_adamw():
    """state_dtype=None with full decay mask is exactly clip + optax.adamw under the same schedule."""
    params = toy_params()
    sched = trainer.make_lr_schedule(1e-2, 1e-3, 2, 10)
    ours = trainer.make_optimizer(1e-2, 1e-3, 2, 10, weight_decay=0.1, clip_norm=0.5, weight_decay_mask=None)
    ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(sched, weight_decay=0.1))

    @jax.jit
    def run(p1, p2):
        s1, s2 = ours.init(p1), ref.init(p2)
        for i in range(4):
            g = jax.tree.map(lambda x: jnp.sin(x * (i + 1)), p1)
            u1, s1 = ours.update(g, s1, p1)
            u2, s2 = ref.update(g, s2, p2)
            p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        return p1, p2

    p1, p2 = run(params, params)
    chex.assert_trees_all_close(p1, p2, rtol=1e-6, atol=1e-7)
    assert not np.allclose(p1["w"], params["w"])


def test_weight_decay_mask_matrices_only():
    params = toy_params()
    opt = trainer.make_optimizer(1.0, weight_decay=0.5, clip_norm=None)
    zero = jax.tree.map(jnp.zeros_like, params)
    u, _ = opt.update(zero, opt.init(params), params)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.5 * np.asarray(params["w"]), rtol=1e-6)
    assert np.all(np.asarray(u["b"]) == 0)


def test_quantized_moment_roundtrip():
    x = jax.random.normal(jax.random.PRNGKey(1), (1000, 7)) * jnp.logspace(-4, 0, 7)
    q = jax.jit(trainer._quantize_signed, static_argnums=1)(x, 256)
    assert q.codes.dtype == jnp.int8 and q.codes.shape == (28, 256) and q.scale.shape == (28,)
    back = np.asarray(jax.jit(trainer._dequantize_signed, static_argnums=1)(q, x.shape))
    xn = np.asarray(x)
    bmax = np.repeat(np.asarray(q.scale), 256)[: x.size].reshape(x.shape)
    assert np.all(np.abs(back - xn) <= bmax * (1 - (126.5 / 127) ** 3) + 1e-12)  # half a code at the top
    assert np.all(np.sign(back[back != 0]) == np.sign(xn[back != 0]))
    mid = np.abs(xn) > 1e-3 * bmax  # small entries keep their relative precision (linear codes would zero them)
    rel = np.abs(back[mid] - xn[mid]) / np.abs(xn[mid])
    assert rel.max() < 0.15 and np.median(rel) < 0.02
    v = x * x
    qv = jax.jit(trainer._quantize_nonneg, static_argnums=1)(v, 256)
    assert qv.codes.dtype == jnp.uint8
    back = np.asarray(jax.jit(trainer._dequantize_nonneg, static_argnums=1)(qv, v.shape))
    assert np.all((back > 0) == (np.asarray(v) > 0)), "non-zero second moments must stay non-zero"
    big = np.asarray(v) > 1e-6 * bmax**2  # well inside the companded range
    rel = np.abs(back[big] - np.asarray(v)[big]) / np.asarray(v)[big]
    assert rel.max() < 0.25 and np.median(rel) < 0.05


def test_compressed_adam_tracks_fp32():
    """Low-memory moments follow the fp32 Adam trajectory on the toy policy-gradient problem."""
    batch = make_batch(toy_params(), seed=3)
    finals = {}
    for opt_name in ("adamw", "adamw_bf16", "adamw_int8"):
        opt, step = get_step("gspo", opt_name, 2, 2)
        state = fresh_state(opt)
        if opt_name == "adamw_int8":
            assert state.opt_state[1].mu["w"].codes.dtype == jnp.int8
            assert state.opt_state[1].nu["w"].codes.dtype == jnp.uint8
            assert state.opt_state[1].mu["b"].dtype == jnp.float32  # small leaf kept in fp32
        if opt_name == "adamw_bf16":
            assert state.opt_state[1].mu["w"].dtype == jnp.bfloat16
        for _ in range(6):  # 12 updates: on-policy GSPO iterations
            logp = toy_logp_fn(state.params, batch).logp
            batch = batch.replace(old_logp=jnp.where(batch.loss_mask, logp, 0.0))
            state, m = step(state, batch)
            assert float(m["skipped"]) == 0
        finals[opt_name] = jax.device_get(state.params)
    p0 = toy_params()
    d_ref = finals["adamw"]["w"] - p0["w"]
    for opt_name, tol in (("adamw_bf16", 0.01), ("adamw_int8", 0.04)):
        rel = np.linalg.norm(finals[opt_name]["w"] - p0["w"] - d_ref) / np.linalg.norm(d_ref)
        assert rel < tol, (opt_name, rel)


def test_policy_improves_gspo_on_policy():
    """GSPO on-policy iterations increase the advantage-weighted log-likelihood every step."""
    opt, step = get_step("gspo", "adamw", 2, 1)
    state = fresh_state(opt)
    batch = make_batch(state.params, seed=1)
    values = [weighted_logp(state.params, batch)]
    for _ in range(5):
        logp = toy_logp_fn(state.params, batch).logp
        batch = batch.replace(old_logp=jnp.where(batch.loss_mask, logp, 0.0))
        state, m = step(state, batch)
        values.append(weighted_logp(state.params, batch))
    assert all(b > a for a, b in zip(values, values[1:])), values
    assert int(state.step) == 5 and int(state.skipped_updates) == 0


def test_loss_decreases_grpo_fixed_old_logp():
    opt, step = get_step("grpo", "adamw")
    state = fresh_state(opt)
    batch = make_batch(state.params, seed=2)
    losses_seen = []
    for _ in range(4):
        state, m = step(state, batch)
        losses_seen.append(float(m["loss"]))
    assert all(b < a for a, b in zip(losses_seen, losses_seen[1:])), losses_seen
    assert float(m["ratio_max"]) > 1.0 and float(m["approx_kl"]) > 0.0
    assert np.isfinite(float(m["grad_norm"])) and float(m["grad_norm"]) > 0
    assert float(m["entropy"]) > 0  # the entropy returned by logp_fn reaches the loss metrics


def _offpolicy_batch(seed):
    batch = make_batch(toy_params(), seed=seed)
    # Off-policy old_logp so clipping and ratios are exercised.
    noise = jnp.asarray(np.random.default_rng(seed).normal(size=(B, L)), jnp.float32)
    return batch.replace(old_logp=batch.old_logp + 0.3 * noise * batch.loss_mask)


def _assert_same_update(a, b):
    (pa, ma), (pb, mb) = a, b
    chex.assert_trees_all_close(pa, pb, rtol=1e-5, atol=1e-6)
    for k in ("loss", "grad_norm", "ratio_max", "ratio_min", "normalizer"):
        np.testing.assert_allclose(float(ma[k]), float(mb[k]), rtol=1e-5, atol=1e-7, err_msg=k)


# Sequence-count and token-count normalisers; Dr. GRPO's constant B*L normaliser is the trivial equal-weight case.
@pytest.mark.parametrize("loss_name", ["gspo", "dapo"])
def test_microbatching_equals_full_batch(loss_name):
    """Gradient accumulation over K micro-batches reproduces the full-batch update (ragged masks, empty row)."""
    batch = _offpolicy_batch(4)
    out = {}
    for K in (1, 4):
        opt, step = get_step(loss_name, "sgd", 1, K)
        state, m = step(fresh_state(opt), batch)
        out[K] = (jax.device_get(state.params), m)
    _assert_same_update(out[1], out[4])


def test_microbatching_equals_full_minibatch_adamw_two_minibatches():
    batch = _offpolicy_batch(5)
    out = {}
    for K in (1, 2):
        opt, step = get_step("gspo", "adamw", 2, K)
        state, m = step(fresh_state(opt), batch)
        out[K] = (jax.device_get(state.params), m)
    _assert_same_update(out[1], out[2])
    # Two sequential minibatch updates really differ from a single full-batch update (the split is not a no-op).
    opt, step = get_step("gspo", "adamw")
    state, _ = step(fresh_state(opt), batch)
    assert not np.allclose(jax.device_get(state.params)["w"], out[1][0]["w"], atol=1e-6)


def test_full_batch_gradient_matches_direct_grad():
    """One SGD step == params - lr * jax.grad(loss) computed directly on the whole batch."""
    batch = make_batch(toy_params(), seed=5)
    opt, step = get_step("dapo", "sgd", 1, 4)
    lr = 0.5
    state, m = step(fresh_state(opt), batch)

    def direct(p):
        out = toy_logp_fn(p, batch)
        logp, ent = out.logp, out.entropy
        return losses.dapo_loss(logp, batch.old_logp, batch.advantages, batch.loss_mask, entropy=ent)[0]

    p0 = toy_params()
    g = jax.jit(jax.grad(direct))(p0)
    want = jax.tree.map(lambda p, gg: p - lr * gg, p0, g)
    chex.assert_trees_all_close(jax.device_get(state.params), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["grad_norm"]), float(optax.tree.norm(g)), rtol=1e-5)


@pytest.mark.parametrize("loss_name,num_minibatches", [("grpo", 1), ("gspo", 2)])
def test_nan_skips_update_and_counts(loss_name, num_minibatches):
    opt, step = get_step(loss_name, "adamw", num_minibatches)
    state = fresh_state(opt)
    batch = make_batch(state.params, seed=6)
    state, _ = step(state, batch)  # one clean step so the optimizer state is non-trivial
    before = jax.device_get((state.params, state.opt_state))
    poisoned = batch.replace(old_logp=batch.old_logp.at[B - 2].set(jnp.nan))  # a row of the last minibatch
    state, m = step(state, poisoned)
    after = jax.device_get((state.params, state.opt_state))
    assert int(state.step) == 2 and int(state.skipped_updates) == 1
    assert float(m["skipped"]) == 1 and float(m["skipped_updates"]) == 1
    if num_minibatches == 1:
        # Bit-identical params and optimizer state.
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), before, after)
    else:
        # The first (clean) minibatch update went through, the poisoned one was skipped.
        assert not np.array_equal(before[0]["w"], after[0]["w"])
        assert np.all(np.isfinite(after[0]["w"]))
    # Infinite gradients are caught too, and a clean step afterwards updates again.
    inf_batch = batch.replace(advantages=batch.advantages.at[0].set(jnp.inf))
    state, m = step(state, inf_batch)
    assert int(state.skipped_updates) == 2
    state, m = step(state, batch)
    assert int(state.skipped_updates) == 2 and float(m["skipped"]) == 0
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(state.params)))


def test_donation_and_metric_shapes():
    opt, step = get_step("gspo", "adamw_int8", 2, 2)
    state = fresh_state(opt)
    batch = make_batch(state.params, seed=7)
    old_w = state.params["w"]
    new_state, m = step(state, batch)
    assert old_w.is_deleted(), "state buffers should have been donated"
    jax.tree.map(lambda x: x.block_until_ready(), new_state)
    for k, v in m.items():
        chex.assert_shape(v, ())
        chex.assert_type(v, jnp.float32)
    assert {
        "loss",
        "grad_norm",
        "grad_norm_max",
        "skipped",
        "skipped_updates",
        "clip_frac",
        "ratio_mean",
        "approx_kl",
        "entropy",
        "policy_loss",
        "normalizer",
    } <= set(m)
    new_state, _ = step(new_state, batch)  # donated buffers reused without error
    assert int(new_state.step) == 2


def test_shuffle_uses_and_advances_rng():
    batch = make_batch(toy_params(), seed=8)
    opt, step = get_step("grpo", "sgd", 2, 1, shuffle=True)
    s1, _ = step(fresh_state(opt), batch)
    s2, _ = step(fresh_state(opt), batch)
    chex.assert_trees_all_equal(jax.device_get(s1.params), jax.device_get(s2.params))  # deterministic
    assert not np.array_equal(np.asarray(s1.rng), np.asarray(jax.random.PRNGKey(0)))
    s3, key = trainer.split_rng(s1)
    assert key.shape == (2,) and not np.array_equal(np.asarray(s3.rng), np.asarray(s1.rng))


def test_bad_batches_raise():
    opt = optax.sgd(0.1)
    step = trainer.make_train_step(toy_logp_fn, losses.gspo_loss, opt, num_minibatches=3)
    batch = make_batch(toy_params(), seed=9)
    with pytest.raises(ValueError, match="divisible"):
        step(fresh_state(opt), batch)  # raised while tracing: nothing is compiled
    opt, step = get_step("gspo", "sgd")
    with pytest.raises(TypeError, match="TrainBatch"):  # the old dict of arrays
        step(fresh_state(opt), {f: getattr(batch, f) for f in ("tokens", "loss_mask", "old_logp", "advantages")})
    with pytest.raises(ValueError, match="leading dimension"):
        step(fresh_state(opt), batch.replace(advantages=batch.advantages[:4]))
    with pytest.raises(ValueError, match="leading dimension"):  # an optional field is checked once set
        step(fresh_state(opt), batch.replace(valid=jnp.ones((4, L), bool)))
    # A loss input the batch does not set.
    keyed = trainer.make_train_step(
        toy_logp_fn, losses.with_forking_entropy_bonus(losses.gspo_loss, 0.1), opt, loss_batch_keys=("entropy_scale",)
    )
    with pytest.raises(ValueError, match="entropy_scale"):
        keyed(fresh_state(opt), batch)
    _, m = keyed(fresh_state(opt), batch.replace(entropy_scale=jnp.full((B,), 0.5)))  # set: reaches the loss
    np.testing.assert_allclose(float(m["forking_entropy_coef"]), 0.05, rtol=1e-6)
    # A logp_fn of the old signature (a tuple).
    tupled = trainer.make_train_step(
        lambda p, b: (toy_logp_fn(p, b).logp, toy_logp_fn(p, b).entropy), losses.gspo_loss, opt
    )
    with pytest.raises(TypeError, match="PolicyOutput"):
        tupled(fresh_state(opt), batch)


def test_typed_batch_through_jit_and_minibatch_split():
    """A TrainBatch with its optional fields None is a pytree of its four set arrays: it crosses `jax.jit` and the
    trainer's minibatch / micro-batch split as itself, the None fields staying None; an optional field, once set,
    is split with the rest (the toy policy ignores `valid`, so an all-True one changes nothing)."""
    batch = make_batch(toy_params(), seed=10)
    assert sorted(batch.present()) == ["advantages", "loss_mask", "old_logp", "tokens"]
    assert len(jax.tree.leaves(batch)) == 4 and not batch.shared_prefix and batch.num_rows == B

    @jax.jit
    def split(b):  # as `make_train_step` splits: [M, K, B / (M K), ...]
        return jax.tree.map(lambda x: x.reshape((2, 2, B // 4) + x.shape[1:]), b)

    mbs = split(batch)
    assert isinstance(mbs, TrainBatch) and sorted(mbs.present()) == sorted(batch.present())
    assert mbs.tokens.shape == (2, 2, B // 4, L) and mbs.advantages.shape == (2, 2, B // 4)
    assert mbs.valid is None and mbs.routing is None and mbs.prefix_tokens is None and mbs.soft_target_ids is None
    np.testing.assert_array_equal(np.asarray(mbs.old_logp[1, 0]), np.asarray(batch.old_logp[4:6]))
    out = jax.jit(toy_logp_fn)(toy_params(), jax.tree.map(lambda x: x[0, 1], mbs))
    assert isinstance(out, trainer.PolicyOutput) and out.routing is None and out.logp.shape == (B // 4, L)
    opt, step = get_step("gspo", "sgd", 2, 2, shuffle=True)
    s_none, m_none = step(fresh_state(opt), batch)
    s_valid, m_valid = step(fresh_state(opt), batch.replace(valid=jnp.ones((B, L), bool)))
    chex.assert_trees_all_close(jax.device_get(s_none.params), jax.device_get(s_valid.params), rtol=1e-6, atol=1e-7)
    assert float(m_none["skipped"]) == 0 and float(m_none["loss"]) == pytest.approx(float(m_valid["loss"]), rel=1e-6)


def test_compressed_adam_init_is_quantized_zeros():
    """The directly built zero state equals quantising zeros (same structure, dtypes, shapes and values)."""
    params = {"w": jnp.ones((80, 70)), "b": jnp.ones((5,))}
    for state_dtype in ("int8", "bfloat16"):
        tx = trainer.scale_by_adam_compressed(state_dtype=state_dtype)
        got = tx.init(params)
        if state_dtype == "int8":
            want_mu = {"w": trainer._quantize_signed(jnp.zeros((80, 70)), 256), "b": jnp.zeros((5,))}
            want_nu = {"w": trainer._quantize_nonneg(jnp.zeros((80, 70)), 256), "b": jnp.zeros((5,))}
        else:
            want_mu = want_nu = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.bfloat16), params)
        for got_tree, want_tree in ((got.mu, want_mu), (got.nu, want_nu)):
            assert jax.tree.structure(got_tree) == jax.tree.structure(want_tree)
            for a, b in zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree)):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------- update guard


def _probe_shift(params, batch, rows):
    probe = jax.tree.map(lambda v: v[:rows], batch)
    logp = toy_logp_fn(params, probe).logp
    m = probe.loss_mask
    return float(jnp.sum(jnp.where(m, jnp.abs(logp - probe.old_logp), 0.0)) / max(int(m.sum()), 1))


@pytest.mark.parametrize("lr", [1e-4, 1e-2, 3.0])
def test_update_guard_halves_large_updates(lr):
    """A step whose update moves the probe rows' log-probs by more than `max_logp_shift` is halved until it does
    not (or dropped after `shift_backtracks` halvings); a small one is applied unchanged, bit for bit."""
    limit, rows, backtracks = 0.05, 4, 3
    opt = optax.sgd(lr)
    plain = trainer.make_train_step(toy_logp_fn, losses.gspo_loss, opt, donate=False)
    guarded = trainer.make_train_step(
        toy_logp_fn,
        losses.gspo_loss,
        opt,
        donate=False,
        max_logp_shift=limit,
        shift_probe_rows=rows,
        shift_backtracks=backtracks,
    )
    state = trainer.create_train_state(toy_params(), opt, 0)
    batch = make_batch(state.params, ragged=False)
    s_plain, _ = plain(state, batch)
    s_guard, m = guarded(state, batch)
    full_shift = _probe_shift(s_plain.params, batch, rows)
    np.testing.assert_allclose(float(m["logp_shift"]), full_shift, rtol=1e-5, atol=1e-7)
    scale = float(m["update_scale"])
    if full_shift <= limit:
        assert scale == 1.0
        chex.assert_trees_all_equal(s_guard.params, s_plain.params)
        return
    assert scale in [0.5**k for k in range(1, backtracks + 1)] + [0.0]
    # SGD: the update is linear in the gradient, so the applied params are exactly the scaled update.
    expected = jax.tree.map(lambda p, q: p + scale * (q - p), state.params, s_plain.params)
    chex.assert_trees_all_close(s_guard.params, expected, atol=1e-6)
    if scale > 0:
        assert _probe_shift(s_guard.params, batch, rows) <= limit * (1 + 1e-5)
        # ... and the step before the last halving was over the limit (it halves only as far as it must).
        over = jax.tree.map(lambda p, q: p + 2 * scale * (q - p), state.params, s_plain.params)
        assert scale == 0.5**backtracks or _probe_shift(over, batch, rows) > limit or scale == 0.5
    else:
        last = jax.tree.map(lambda p, q: p + 0.5**backtracks * (q - p), state.params, s_plain.params)
        assert _probe_shift(last, batch, rows) > limit


def test_update_guard_flags():
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="max_logp_shift must be >= 0"):
        trainer.make_train_step(toy_logp_fn, losses.gspo_loss, opt, max_logp_shift=-1.0)
    with pytest.raises(ValueError, match="shift_probe_rows >= 1"):
        trainer.make_train_step(toy_logp_fn, losses.gspo_loss, opt, max_logp_shift=0.1)
    step = trainer.make_train_step(
        toy_logp_fn, losses.gspo_loss, opt, max_logp_shift=0.1, shift_probe_rows=B + 1, donate=False
    )
    state = trainer.create_train_state(toy_params(), opt, 0)
    with pytest.raises(ValueError, match="exceeds the micro-batch"):
        step(state, make_batch(state.params))


def _low_rank_combine(trained, frozen):
    """A toy adapter: the bigram table plus a rank-2 update, the bias frozen as it is."""
    return {"w": frozen["w"] + trained["a"] @ trained["b"], "b": frozen["b"]}


def test_frozen_tree_is_read_not_trained():
    """`combine`: the state trains a small tree over a frozen one. The gradient, the optimizer state and the update
    guard cover the trained tree alone; the frozen tree is an argument (not donated, unchanged); one SGD step is
    the gradient of the loss with respect to the trained tree."""
    base = toy_params()
    trained = {"a": 0.1 * jax.random.normal(jax.random.PRNGKey(4), (V, 2)), "b": jnp.zeros((2, V))}
    batch = make_batch(base, seed=9, ragged=False)
    opt, lr = optax.sgd(0.5), 0.5
    step = trainer.make_train_step(
        toy_logp_fn, losses.gspo_loss, opt, combine=_low_rank_combine, max_logp_shift=10.0, shift_probe_rows=4
    )
    state = trainer.create_train_state(trained, trainer.make_optimizer(1e-2), 0)
    chex.assert_trees_all_equal_structs(state.opt_state[1].mu, trained)  # Adam's moments: the trained tree only
    state = trainer.create_train_state(jax.tree.map(jnp.copy, trained), opt, 0)  # donated
    new, m = step(state, batch, base)
    assert not base["w"].is_deleted()
    chex.assert_trees_all_equal(base, toy_params())

    def direct(t):
        out = toy_logp_fn(_low_rank_combine(t, base), batch)
        logp, ent = out.logp, out.entropy
        return losses.gspo_loss(logp, batch.old_logp, batch.advantages, batch.loss_mask, entropy=ent)[0]

    g = jax.grad(direct)(trained)
    assert float(jnp.abs(g["b"]).max()) > 0
    assert float(m["update_scale"]) == 1.0
    chex.assert_trees_all_close(new.params, jax.tree.map(lambda p, gg: p - lr * gg, trained, g), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="frozen tree exactly when"):
        step(new, batch)
    with pytest.raises(ValueError, match="frozen tree exactly when"):
        get_step("gspo", "sgd")[1](fresh_state(get_step("gspo", "sgd")[0]), batch, base)
