"""Tests for reno_jax.rl.losses: NumPy re-derivations, GSPO gradient, edge cases, jit/shape checks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reno_jax.rl import losses as L

B, T = 6, 7


def _inputs(seed=0, spread=0.3, seq_shift=0.0):
    """Random loss inputs; ``seq_shift`` adds a per-sequence log-ratio offset (to straddle GSPO's tiny clip)."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    shift = rng.uniform(-seq_shift, seq_shift, (B, 1))
    old = (logp + shift + rng.normal(0, spread, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, (B,)).astype(np.float32)
    mask = rng.uniform(size=(B, T)) < 0.7
    mask[0, :] = False  # a prompt-only (empty) row
    mask[1, :] = False
    mask[1, 3] = True  # a length-1 sequence
    # Garbage at masked positions must not matter.
    logp = np.where(mask, logp, -1e4).astype(np.float32)
    ref = (logp + rng.normal(0, 0.2, (B, T))).astype(np.float32)
    ent = rng.uniform(0, 2, (B, T)).astype(np.float32)
    return logp, old, adv, mask, ref, ent


# ---------------------------------------------------------------------------------------------------------------
# NumPy references (written from the papers' formulas, loop style, independent of the implementation)
# ---------------------------------------------------------------------------------------------------------------
def _np_ppo(ratio, a, lo, hi):
    return -min(ratio * a, np.clip(ratio, 1 - lo, 1 + hi) * a)


def _np_k3(lp, rf):
    return np.exp(rf - lp) - (rf - lp) - 1


def np_gspo(logp, old, adv, mask, lo=3e-4, hi=4e-4, ref=None, kl=0.0, ent=None, ec=0.0):
    terms = []
    for i in range(B):
        idx = np.nonzero(mask[i])[0]
        if len(idx) == 0:
            continue
        s = np.exp(np.mean(logp[i, idx].astype(np.float64) - old[i, idx]))
        t = _np_ppo(s, adv[i], lo, hi)
        if ref is not None:
            t += kl * np.mean(_np_k3(logp[i, idx].astype(np.float64), ref[i, idx]))
        if ent is not None:
            t -= ec * np.mean(ent[i, idx])
        terms.append(t)
    return np.mean(terms) if terms else 0.0


def np_token_ppo(logp, old, adv, mask, lo, hi, agg, max_length=None, ref=None, kl=0.0, ent=None, ec=0.0):
    per_seq_sums, per_seq_means, n_tok = [], [], 0
    for i in range(B):
        idx = np.nonzero(mask[i])[0]
        vals = []
        for t in idx:
            r = np.exp(np.float64(logp[i, t]) - old[i, t])
            v = _np_ppo(r, adv[i], lo, hi)
            if ref is not None:
                v += kl * _np_k3(np.float64(logp[i, t]), ref[i, t])
            if ent is not None:
                v -= ec * ent[i, t]
            vals.append(v)
        n_tok += len(vals)
        per_seq_sums.append(sum(vals))
        if vals:
            per_seq_means.append(np.mean(vals))
    if agg == "seq":
        return np.mean(per_seq_means) if per_seq_means else 0.0
    if agg == "tok":
        return sum(per_seq_sums) / max(n_tok, 1)
    if agg == "const":
        return sum(per_seq_sums) / (B * (T if max_length is None else max_length))
    raise ValueError(agg)


# ---------------------------------------------------------------------------------------------------------------
def test_group_advantages_matches_numpy():
    r = np.array([1.0, 0.0, 0.5, 0.5, -1.0, 2.0, 3.0, 3.0], np.float32)
    got = np.asarray(L.group_advantages(r, 4))
    g = r.reshape(2, 4).astype(np.float64)
    want = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-8)).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    got_nostd = np.asarray(L.group_advantages(r, 2, normalize_std=False))
    g2 = r.reshape(4, 2)
    np.testing.assert_allclose(got_nostd, (g2 - g2.mean(1, keepdims=True)).reshape(-1), atol=1e-6)


def test_group_advantages_equal_rewards_zero_no_nan():
    adv = np.asarray(L.group_advantages(jnp.full((8,), 0.8), 4))
    assert np.all(np.isfinite(adv)) and np.all(adv == 0.0)


def test_group_advantages_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        L.group_advantages(jnp.zeros((6,)), 4)


def np_turn_advantages(r, k, g, discount=1.0, normalize_std=True):
    """The definition, loop by loop: returns-to-go, then each turn against the group's turns with its key."""
    b, t = r.shape
    ret = np.array([[sum(discount ** (j - i) * r[row, j] for j in range(i, t)) for i in range(t)] for row in range(b)])
    out = np.zeros((b, t))
    for row in range(b):
        for i in range(t):
            if k[row, i] < 0:
                continue
            group = range(row // g * g, row // g * g + g)
            peers = np.array([ret[o, j] for o in group for j in range(t) if k[o, j] == k[row, i]])
            if len(peers) < 2 or peers.max() == peers.min():
                continue
            out[row, i] = ret[row, i] - peers.mean()
            if normalize_std:
                out[row, i] /= peers.std() + 1e-8
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
    st.sampled_from([1.0, 0.5]),
    st.booleans(),
)
def test_turn_advantages_match_the_definition(num_groups, g, t, seed, discount, normalize_std):
    rng = np.random.default_rng(seed)
    r = rng.choice([0.0, 0.5, 1.0, -1.0], size=(num_groups * g, t)).astype(np.float32)
    k = rng.integers(-1, 3, size=(num_groups * g, t)).astype(np.int32)  # few keys: many shared states
    got = np.asarray(L.turn_advantages(r, k, g, discount, normalize_std))
    np.testing.assert_allclose(got, np_turn_advantages(r, k, g, discount, normalize_std), rtol=1e-4, atol=1e-5)
    assert np.all(got[k < 0] == 0.0)


def test_turn_advantages_of_one_shared_state_are_the_group_advantages():
    # One turn per episode, all from the group's start state: the turn advantage is the episode's.
    r = np.array([1.0, 0.0, 0.5, 0.5, -1.0, 2.0, 3.0, 3.0], np.float32)
    got = np.asarray(L.turn_advantages(r[:, None], np.zeros((8, 1), np.int32), 4))[:, 0]
    np.testing.assert_allclose(got, np.asarray(L.group_advantages(r, 4)), atol=1e-6)
    # A state only one turn reached, or an all-equal group: exactly 0.
    same_state_per_turn = np.tile(np.array([[0, 1]], np.int32), (4, 1))
    assert np.all(np.asarray(L.turn_advantages(np.full((4, 2), 0.8), same_state_per_turn, 4)) == 0.0)
    assert np.all(np.asarray(L.turn_advantages(r.reshape(4, 2), np.arange(8).reshape(4, 2), 2)) == 0.0)
    with pytest.raises(ValueError, match="group_size"):
        L.turn_advantages(np.zeros((6, 2)), np.zeros((6, 2), np.int32), 4)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        L.turn_advantages(np.zeros((4, 2)), np.zeros((4, 3), np.int32), 2)


def test_token_advantages_add_each_turns_credit_on_policy_tokens_only():
    adv = jnp.array([1.0, -1.0])
    turn_adv = jnp.array([[0.5, -0.5], [2.0, 0.0]])
    turn_id = jnp.array([[0, 0, 1, 1, -1], [0, 0, 0, 1, -1]])
    mask = jnp.array([[False, True, False, True, False], [False, True, False, True, False]])
    got = np.asarray(L.token_advantages(adv, turn_adv, turn_id, mask, 2.0))
    np.testing.assert_allclose(got, [[0, 2.0, 0, 0.0, 0], [0, 3.0, 0, -1.0, 0]])


@pytest.mark.parametrize("name", ["gspo_token", "grpo", "dr_grpo", "dapo"])
def test_token_level_losses_take_per_token_advantages(name):
    logp, old, adv, mask, _, _ = _inputs(3, spread=1e-4, seq_shift=1.5e-3)
    fn = L.get_loss(name)
    kw = {"max_length": logp.shape[1]} if name == "dr_grpo" else {}
    loss_seq, _ = fn(logp, old, adv, mask, **kw)
    loss_tok, _ = fn(logp, old, jnp.broadcast_to(jnp.asarray(adv)[:, None], logp.shape), mask, **kw)
    np.testing.assert_allclose(float(loss_tok), float(loss_seq), rtol=1e-6)
    with pytest.raises(ValueError, match="advantages must have shape"):
        L.gspo_loss(logp, old, jnp.broadcast_to(jnp.asarray(adv)[:, None], logp.shape), mask)


@pytest.mark.parametrize("with_extras", [False, True])
def test_gspo_matches_numpy(with_extras):
    logp, old, adv, mask, ref, ent = _inputs(
        1, spread=1e-4, seq_shift=1.5e-3
    )  # small spread: a mix of clipped / unclipped
    kw = dict(ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01) if with_extras else {}
    loss, m = L.gspo_loss(logp, old, adv, mask, **kw)
    want = np_gspo(
        logp,
        old,
        adv,
        mask,
        ref=kw.get("ref_logp"),
        kl=kw.get("kl_coef", 0.0),
        ent=kw.get("entropy"),
        ec=kw.get("entropy_coef", 0.0),
    )
    np.testing.assert_allclose(float(loss), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(m["policy_loss"]), np_gspo(logp, old, adv, mask), rtol=1e-4, atol=1e-6)
    # Ratio statistics over the valid sequences.
    s = np.array([np.exp(np.mean(logp[i, mask[i]] - old[i, mask[i]])) for i in range(B) if mask[i].any()])
    np.testing.assert_allclose(float(m["ratio_mean"]), s.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_min"]), s.min(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_max"]), s.max(), rtol=1e-5)
    a = adv[mask.any(1)]
    clipped = ((a > 0) & (s > 1 + 4e-4)) | ((a < 0) & (s < 1 - 3e-4))
    np.testing.assert_allclose(float(m["clip_frac"]), clipped.mean(), atol=1e-6)
    assert 0 < clipped.mean() < 1, "inputs should exercise both branches"
    assert float(m["normalizer"]) == mask.any(1).sum()
    d = np.where(mask, logp - old, 0)
    np.testing.assert_allclose(float(m["approx_kl"]), (0.5 * d**2).sum() / mask.sum(), rtol=1e-4)
    if with_extras:
        np.testing.assert_allclose(float(m["entropy"]), ent[mask].mean(), rtol=1e-5)
        np.testing.assert_allclose(float(m["kl"]), _np_k3(logp[mask], ref[mask]).mean(), rtol=1e-4)


@pytest.mark.parametrize(
    "name,lo,hi,agg", [("grpo", 0.2, 0.2, "seq"), ("dapo", 0.2, 0.28, "tok"), ("dr_grpo", 0.2, 0.2, "const")]
)
@pytest.mark.parametrize("with_extras", [False, True])
def test_token_losses_match_numpy(name, lo, hi, agg, with_extras):
    logp, old, adv, mask, ref, ent = _inputs(2, spread=0.4)
    kw = dict(ref_logp=ref, kl_coef=0.05, entropy=ent, entropy_coef=0.02) if with_extras else {}
    loss, m = L.LOSSES[name](logp, old, adv, mask, **kw)
    want = np_token_ppo(
        logp,
        old,
        adv,
        mask,
        lo,
        hi,
        agg,
        ref=kw.get("ref_logp"),
        kl=kw.get("kl_coef", 0.0),
        ent=kw.get("entropy"),
        ec=kw.get("entropy_coef", 0.0),
    )
    np.testing.assert_allclose(float(loss), want, rtol=1e-4, atol=1e-6)
    r = np.exp(logp[mask] - old[mask])
    a = np.broadcast_to(adv[:, None], mask.shape)[mask]
    clipped = ((a > 0) & (r > 1 + hi)) | ((a < 0) & (r < 1 - lo))
    np.testing.assert_allclose(float(m["clip_frac"]), clipped.mean(), atol=1e-6)
    assert 0 < clipped.mean() < 1
    np.testing.assert_allclose(float(m["ratio_min"]), r.min(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_max"]), r.max(), rtol=1e-5)


def test_dr_grpo_max_length_constant():
    logp, old, adv, mask, _, _ = _inputs(3, spread=0.4)
    loss, m = L.dr_grpo_loss(logp, old, adv, mask, max_length=32)
    np.testing.assert_allclose(
        float(loss), np_token_ppo(logp, old, adv, mask, 0.2, 0.2, "const", max_length=32), rtol=1e-4, atol=1e-7
    )
    assert float(m["normalizer"]) == B * 32


def test_gspo_token_matches_gspo_for_sequence_advantages():
    logp, old, adv, mask, _, _ = _inputs(4, spread=1e-4, seq_shift=1.5e-3)
    f1 = lambda lp: L.gspo_loss(lp, old, adv, mask)[0]
    f2 = lambda lp: L.gspo_token_loss(lp, old, adv, mask)[0]
    np.testing.assert_allclose(float(f1(logp)), float(f2(logp)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(jax.grad(f1)(logp)), np.asarray(jax.grad(f2)(logp)), rtol=1e-5, atol=1e-7)


def test_gspo_token_with_token_advantages_numpy():
    logp, old, _, mask, _, _ = _inputs(5, spread=1e-4, seq_shift=1.5e-3)
    adv_tok = np.random.default_rng(0).normal(size=(B, T)).astype(np.float32)
    loss, _ = L.gspo_token_loss(logp, old, adv_tok, mask)
    terms = []
    for i in range(B):
        idx = np.nonzero(mask[i])[0]
        if len(idx):
            s = np.exp(np.mean(np.float64(logp[i, idx]) - old[i, idx]))
            terms.append(np.mean([_np_ppo(s, adv_tok[i, t], 3e-4, 4e-4) for t in idx]))
    np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-4, atol=1e-7)
    # Token-level gradient: d/dlogp_t = -sg(s_i) * A_t / |y_i| / n_valid on unclipped tokens.
    g = np.asarray(jax.grad(lambda lp: L.gspo_token_loss(lp, old, adv_tok, mask)[0])(logp))
    n_valid = mask.any(1).sum()
    for i in range(B):
        idx = np.nonzero(mask[i])[0]
        if len(idx) == 0:
            assert np.all(g[i] == 0)
            continue
        s = np.exp(np.mean(np.float64(logp[i, idx]) - old[i, idx]))
        for t in idx:
            a = adv_tok[i, t]
            clipped = (a > 0 and s > 1 + 4e-4) or (a < 0 and s < 1 - 3e-4)
            want = 0.0 if clipped else -s * a / len(idx) / n_valid
            np.testing.assert_allclose(g[i, t], want, rtol=1e-4, atol=1e-7)


def test_gspo_gradient_matches_textbook():
    """jax.grad of gspo_loss == jax.grad of the paper's sequence formula written directly == analytic."""
    logp, old, adv, mask, _, _ = _inputs(6, spread=1e-4, seq_shift=1.5e-3)
    lo, hi = 3e-4, 4e-4
    maskf = mask.astype(np.float32)

    def textbook(lp):
        # J = 1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = (prod_t pi/pi_old)^(1/|y_i|); loss = -J.
        lengths = maskf.sum(1)
        valid = lengths > 0
        seq_logratio = jnp.sum(jnp.where(mask, lp - old, 0.0), axis=1)
        s = jnp.power(jnp.exp(seq_logratio), 1.0 / np.maximum(lengths, 1))
        obj = jnp.minimum(s * adv, jnp.clip(s, 1 - lo, 1 + hi) * adv)
        return -jnp.sum(jnp.where(valid, obj, 0.0)) / valid.sum()

    g_impl = np.asarray(jax.grad(lambda lp: L.gspo_loss(lp, old, adv, mask)[0])(logp))
    g_text = np.asarray(jax.grad(textbook)(jnp.asarray(logp)))
    np.testing.assert_allclose(g_impl, g_text, rtol=1e-4, atol=1e-7)
    # Paper's gradient: token weight s_i * A_i / |y_i| (unclipped), 0 when clipped, same for all tokens of i.
    lengths = mask.sum(1)
    n_valid = (lengths > 0).sum()
    n_unclipped = 0
    for i in range(B):
        if lengths[i] == 0:
            assert np.all(g_impl[i] == 0)
            continue
        s = np.exp(np.mean(np.float64(logp[i, mask[i]]) - old[i, mask[i]]))
        clipped = (adv[i] > 0 and s > 1 + hi) or (adv[i] < 0 and s < 1 - lo)
        n_unclipped += not clipped
        want = np.where(mask[i], 0.0 if clipped else -s * adv[i] / lengths[i] / n_valid, 0.0)
        np.testing.assert_allclose(g_impl[i], want, rtol=1e-4, atol=1e-7)
    assert 0 < n_unclipped < n_valid, "inputs should exercise clipped and unclipped sequences"


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_empty_masks_no_nan(name):
    logp, old, adv, mask, ref, ent = _inputs(7)
    empty = np.zeros_like(mask)
    f = lambda lp: L.LOSSES[name](lp, old, adv, empty, ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.1)
    (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    assert float(loss) == 0.0
    assert all(np.isfinite(float(v)) for v in m.values()), m
    assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_empty_rows_contribute_nothing(name):
    """Rows 0 (empty mask) get zero gradient and changing them changes nothing (masked garbage included)."""
    logp, old, adv, mask, _, _ = _inputs(8)
    f = lambda lp, a, o: L.LOSSES[name](lp, o, a, mask)[0]
    g = np.asarray(jax.grad(f)(logp, adv, old))
    assert np.all(np.isfinite(g)) and np.all(g[0] == 0) and np.all(g[~mask] == 0)
    adv2, old2 = adv.copy(), old.copy()
    adv2[0] = 100.0
    old2[0] = 50.0
    old2[~mask] = 1e6  # huge garbage where the mask is 0 must not overflow anything
    np.testing.assert_allclose(float(f(logp, adv2, old2)), float(f(logp, adv, old)), rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(jax.grad(f)(logp, adv2, old2))))


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_zero_advantage_group(name):
    """All-equal rewards -> zero advantages -> zero policy loss and zero gradient, no NaN."""
    logp, old, _, mask, _, _ = _inputs(9, spread=0.5)
    adv = L.group_advantages(jnp.ones((B,)), 3)
    (loss, m), g = jax.value_and_grad(lambda lp: L.LOSSES[name](lp, old, adv, mask), has_aux=True)(logp)
    assert float(loss) == 0.0 and float(m["clip_frac"]) == 0.0
    assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_length_one_sequences(name):
    logp = jnp.array([[-1.0], [-2.0], [-0.5]])
    old = jnp.array([[-1.0], [-2.1], [-0.5]])
    adv = jnp.array([1.0, -1.0, 0.5])
    mask = jnp.array([[True], [True], [False]])
    (loss, m), g = jax.value_and_grad(lambda lp: L.LOSSES[name](lp, old, adv, mask), has_aux=True)(logp)
    assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in m.values())
    assert float(g[2, 0]) == 0.0 and float(g[0, 0]) != 0.0


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_on_policy_ratio_is_one(name):
    logp, _, adv, mask, _, _ = _inputs(10)
    loss, m = jax.jit(L.LOSSES[name])(logp, logp, adv, mask)
    assert float(m["ratio_min"]) == pytest.approx(1.0) and float(m["ratio_max"]) == pytest.approx(1.0)
    assert float(m["clip_frac"]) == 0.0 and float(m["approx_kl"]) == 0.0


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_jit_and_shapes(name):
    logp, old, adv, mask, ref, ent = _inputs(11)
    fn = jax.jit(lambda *a: L.LOSSES[name](*a[:4], ref_logp=a[4], kl_coef=0.1, entropy=a[5], entropy_coef=0.01))
    loss, m = fn(logp, old, adv, mask, ref, ent)
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    expected = {
        "policy_loss",
        "clip_frac",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "approx_kl",
        "kl",
        "entropy",
        "normalizer",
    }
    assert set(m) == expected
    for v in m.values():
        chex.assert_shape(v, ())
        chex.assert_type(v, jnp.float32)
    eager, _ = L.LOSSES[name](logp, old, adv, mask, ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01)
    np.testing.assert_allclose(float(loss), float(eager), rtol=1e-6)


def test_bad_shapes_and_args_raise():
    logp, old, adv, mask, _, _ = _inputs(12)
    with pytest.raises(ValueError, match="old_logp"):
        L.gspo_loss(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        L.grpo_loss(logp, old, adv[:3], mask)
    with pytest.raises(ValueError, match="advantages"):
        L.gspo_loss(logp, old, np.zeros((B, T)), mask)  # token advantages only for gspo_token
    with pytest.raises(ValueError, match="ref_logp"):
        L.dapo_loss(logp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown loss"):
        L.get_loss("ppo2")
    assert L.NORMALIZE_STD["dr_grpo"] is False and set(L.NORMALIZE_STD) == set(L.LOSSES)


@pytest.mark.parametrize("value", [0.8, 0.1, 1.0 / 3.0, -0.7])
@pytest.mark.parametrize("group_size", [3, 8, 16])
def test_constant_groups_get_exactly_zero_advantage_despite_rounding(value, group_size):
    # 16 x 0.8 has a float32 mean one ulp off 0.8; without an exact constant-group check, (r - mean) / (std + eps)
    # turns that residue into advantages of about -0.92 for every member of the group.
    rewards = jnp.concatenate(
        [jnp.full((group_size,), value, jnp.float32), jnp.linspace(-1.0, 1.0, group_size, dtype=jnp.float32)]
    )
    adv = np.asarray(L.group_advantages(rewards, group_size))
    np.testing.assert_array_equal(adv[:group_size], 0.0)
    np.testing.assert_allclose(adv[group_size:].mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(adv[group_size:].std(), 1.0, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Entropy bonus on forking tokens
# ---------------------------------------------------------------------------------------------------------------
def test_forking_token_mask_picks_top_entropy_policy_tokens():
    _, _, _, mask, _, ent = _inputs(3)
    ent = ent.copy()
    ent[2, 0] = 99.0  # highest entropy but not a policy token: never selected
    mask[2, 0] = False
    for k in (1, 2):
        sel = np.asarray(L.forking_token_mask(ent, mask, k))
        assert not np.any(sel & ~mask)
        for b in range(B):
            vals = ent[b][mask[b]]
            want = np.sort(vals)[::-1][:k] if vals.size else np.array([])
            np.testing.assert_allclose(np.sort(ent[b][sel[b]])[::-1], want)
    with pytest.raises(ValueError, match="top_k"):
        L.forking_token_mask(ent, mask, 0)


def test_forking_entropy_bonus_value_and_gradient():
    logp, old, adv, mask, _, ent = _inputs(4)
    base = lambda *a, **k: L.gspo_loss(*a, **k)
    wrapped = L.with_forking_entropy_bonus(base, coef=0.5, top_k=1)
    loss, metrics = wrapped(logp, old, adv, mask, entropy=ent)
    plain, _ = base(logp, old, adv, mask, entropy=ent)
    per_seq = [ent[b][mask[b]].max() for b in range(B) if mask[b].any()]
    np.testing.assert_allclose(float(metrics["forking_entropy"]), np.mean(per_seq), rtol=1e-6)
    np.testing.assert_allclose(float(loss), float(plain) - 0.5 * np.mean(per_seq), rtol=1e-5, atol=1e-6)
    # d loss / d entropy: -coef / n_seq on each sequence's forking token, 0 elsewhere.
    g = np.asarray(jax.grad(lambda e: wrapped(logp, old, adv, mask, entropy=e)[0])(jnp.asarray(ent)))
    sel = np.asarray(L.forking_token_mask(ent, mask, 1))
    np.testing.assert_allclose(g[sel], -0.5 / len(per_seq), rtol=1e-5)
    assert np.all(g[~sel] == 0)
    with pytest.raises(ValueError, match="entropy"):
        wrapped(logp, old, adv, mask)


def test_forking_kl_value_and_expected_gradient():
    logp, old, adv, mask, ref, ent = _inputs(5)
    wrapped = L.with_forking_kl(L.gspo_loss, coef=0.3, top_k=1)
    loss, metrics = wrapped(logp, old, adv, mask, entropy=ent, ref_logp=ref)
    plain, _ = L.gspo_loss(logp, old, adv, mask, entropy=ent, ref_logp=ref)
    sel = np.asarray(L.forking_token_mask(ent, mask, 1))
    per_seq = [_np_k3(logp[b][sel[b]], ref[b][sel[b]]).mean() for b in range(B) if mask[b].any()]
    np.testing.assert_allclose(float(metrics["forking_kl"]), np.mean(per_seq), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(plain) + 0.3 * np.mean(per_seq), rtol=1e-5, atol=1e-6)
    half, _ = wrapped(logp, old, adv, mask, entropy=ent, ref_logp=ref, entropy_scale=np.full((B,), 0.5))
    np.testing.assert_allclose(float(half), float(plain) + 0.15 * np.mean(per_seq), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        wrapped(logp, old, adv, mask, entropy=ent)
    # One categorical decision: the k3 gradient, averaged over samples a ~ pi, is that of KL(pi_ref || pi).
    z = jnp.asarray([1.5, 0.2, -0.7, 0.0])
    ref_p = jnp.asarray([0.4, 0.3, 0.2, 0.1])
    pi = jax.nn.softmax(z)

    def k3_of_z(zz, a):
        lp = jax.nn.log_softmax(zz)[a]
        return L._k3(lp[None], jnp.log(ref_p[a])[None], jnp.ones((1,), bool))[0]

    def expected_k3_grad(z):
        return sum(pi[a] * jax.grad(k3_of_z)(z, a) for a in range(4))

    want = jax.grad(lambda zz: jnp.sum(ref_p * (jnp.log(ref_p) - jax.nn.log_softmax(zz))))(z)
    np.testing.assert_allclose(np.asarray(expected_k3_grad(z)), np.asarray(want), atol=1e-6)


def test_forking_token_mask_per_turn():
    """per_turn: the top-k tokens of every contiguous run of the mask (one decision per turn of a game)."""
    mask = jnp.array([[0, 1, 1, 1, 0, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]], bool)
    ent = jnp.array([[9, 1, 3, 2, 9, 9, 5, 4, 9, 0.5], [2, 2, 0, 0, 0, 0, 0, 0, 0, 0]], jnp.float32)
    top1 = np.asarray(L.forking_token_mask(ent, mask, 1, per_turn=True)).astype(int)
    np.testing.assert_array_equal(top1, [[0, 0, 1, 0, 0, 0, 1, 0, 0, 1], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])  # tie: both
    top2 = np.asarray(L.forking_token_mask(ent, mask, 2, per_turn=True)).astype(int)
    np.testing.assert_array_equal(top2, [[0, 0, 1, 1, 0, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    # One turn per row: the same as the per-sequence selection.
    one = jnp.array([[0, 1, 1, 1, 1, 0]], bool)
    e1 = jnp.array([[5, 0.1, 0.7, 0.3, 0.2, 9]], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(L.forking_token_mask(e1, one, 1, per_turn=True)), np.asarray(L.forking_token_mask(e1, one, 1))
    )
    jitted = jax.jit(L.forking_token_mask, static_argnums=(2, 3))
    np.testing.assert_array_equal(np.asarray(jitted(ent, mask, 1, True)), top1.astype(bool))
    # The forking KL anchors every turn's decision with per_turn, the episode's single top token without.
    logp = jnp.log(jnp.linspace(0.3, 0.95, mask.size, dtype=jnp.float32).reshape(mask.shape))
    ref = jnp.log(jnp.full(mask.shape, 0.2, jnp.float32))
    adv, old = jnp.zeros((2,), jnp.float32), logp
    kls = []
    for per_turn, sel in ((True, top1), (False, np.asarray(L.forking_token_mask(ent, mask, 1)))):
        _, m = L.with_forking_kl(L.gspo_loss, 0.3, 1, per_turn=per_turn)(
            logp, old, adv, mask, entropy=ent, ref_logp=ref
        )
        per_seq = [_np_k3(np.asarray(logp)[b][sel[b] > 0], np.asarray(ref)[b][sel[b] > 0]).mean() for b in range(2)]
        np.testing.assert_allclose(float(m["forking_kl"]), np.mean(per_seq), rtol=1e-5)
        kls.append(float(m["forking_kl"]))
    assert abs(kls[0] - kls[1]) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Rollout / train mismatch corrections: TIS and IcePop
# ---------------------------------------------------------------------------------------------------------------
# name -> (eps_low, eps_high, aggregation of the NumPy reference; "gspo" = sequence-level ratio)
_CLIP = {
    "gspo": (3e-4, 4e-4, "gspo"),
    "gspo_token": (3e-4, 4e-4, "gspo"),
    "grpo": (0.2, 0.2, "seq"),
    "dr_grpo": (0.2, 0.2, "const"),
    "dapo": (0.2, 0.28, "tok"),
}


def np_corrected(name, logp, old, adv, mask, cap=np.inf, window=(0.0, np.inf)):
    """Loss value and d loss / d logp of a base loss under TIS (``cap``) and IcePop (``window``), from the papers.

    k_t = pi_train / pi_rollout = exp(logp - old) (at the current params the loss's ratio r_t equals k_t).
    IcePop keeps the policy tokens with k_t in the window; the loss is the base loss on the kept tokens.
    TIS truncates the importance weight to min(k_t, C), held constant: token-level losses weight token t's
    surrogate by min(k_t, C) / k_t (gradient -min(k_t, C) A / N when unclipped); GSPO's sequence weight becomes the
    geometric mean of the truncated ratios, exp(mean_t log min(k_t, C)) (gradient -that * A / (|y| N) per token).
    """
    lo, hi, agg = _CLIP[name]
    k = np.exp(logp.astype(np.float64) - old)
    kept = mask & (k >= window[0]) & (k <= window[1])
    rows = [i for i in range(B) if kept[i].any()]
    grad = np.zeros((B, T))
    terms = {}
    for i in range(B):
        idx = np.nonzero(kept[i])[0]
        if agg == "gspo":
            if len(idx) == 0:
                continue
            s = np.exp(np.mean(np.log(k[i, idx])))
            s_trunc = np.exp(np.mean(np.log(np.minimum(k[i, idx], cap))))
            terms[i] = [s_trunc / s * _np_ppo(s, adv[i], lo, hi)]
            clipped = (adv[i] > 0 and s > 1 + hi) or (adv[i] < 0 and s < 1 - lo)
            grad[i, idx] = 0.0 if clipped else -s_trunc * adv[i] / len(idx) / len(rows)
            continue
        terms[i] = []
        for t in idx:
            r = k[i, t]
            terms[i].append(min(1.0, cap / r) * _np_ppo(r, adv[i], lo, hi))
            clipped = (adv[i] > 0 and r > 1 + hi) or (adv[i] < 0 and r < 1 - lo)
            norm = {"seq": len(idx) * len(rows), "tok": kept.sum(), "const": B * T}[agg]
            grad[i, t] = 0.0 if clipped else -min(r, cap) * adv[i] / norm
    if agg in ("gspo", "seq"):
        value = np.mean([np.mean(terms[i]) for i in rows]) if rows else 0.0
    else:
        value = sum(sum(v) for v in terms.values()) / {"tok": max(kept.sum(), 1), "const": B * T}[agg]
    return value, grad, kept


_CAP, _WINDOW = 1.2, (0.7, 1.5)


def _variants(name):
    """Every correction of one base loss (and the neutral settings) as {variant: loss_fn}."""
    base = L.LOSSES[name]
    return {
        "base": base,
        "tis": L.with_tis(base, _CAP),
        "icepop": L.with_icepop(base, *_WINDOW),
        "both": L.with_tis(L.with_icepop(base, *_WINDOW), _CAP),
        "tis_inf": L.with_tis(base, np.inf),
        "icepop_all": L.with_icepop(base, 0.0, np.inf),
        "both_inf": L.with_tis(L.with_icepop(base, 0.0, np.inf), np.inf),
    }


_COMPILED = {}


def _evaluate_variants(name, logp, old, adv, mask):
    """{variant: (loss, metrics, d loss / d logp)} from one jitted program per base loss (one compile each)."""
    if name not in _COMPILED:

        def all_variants(lp, o, a, m):
            return {
                key: jax.value_and_grad(lambda x, fn=fn: fn(x, o, a, m), has_aux=True)(lp)
                for key, fn in _variants(name).items()
            }

        _COMPILED[name] = jax.jit(all_variants)
    out = jax.device_get(_COMPILED[name](logp, old, adv, mask))
    return {key: (float(loss), metrics, np.asarray(grad)) for key, ((loss, metrics), grad) in out.items()}


@pytest.mark.parametrize("correction", ["tis", "icepop", "both"])
@pytest.mark.parametrize("name", sorted(_CLIP))
def test_corrections_match_numpy(name, correction):
    logp, old, adv, mask, _, _ = _inputs(13, spread=0.4)
    cap, window = _CAP, _WINDOW
    loss, m, grad = _evaluate_variants(name, logp, old, adv, mask)[correction]
    want_value, want_grad, kept = np_corrected(
        name,
        logp,
        old,
        adv,
        mask,
        cap=np.inf if correction == "icepop" else cap,
        window=(0.0, np.inf) if correction == "tis" else window,
    )
    np.testing.assert_allclose(loss, want_value, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert np.all(grad[~kept] == 0.0)
    k = np.exp(logp.astype(np.float64) - old)
    if correction != "icepop":
        seen = mask  # with "both", TIS is outside IcePop: it sees every policy token
        np.testing.assert_allclose(m["tis_weight_mean"], np.minimum(k[seen], cap).mean(), rtol=1e-5)
        np.testing.assert_allclose(m["tis_clipped_frac"], (k[seen] > cap).mean(), atol=1e-6)
        assert 0 < m["tis_clipped_frac"] < 1
        # Tokens where truncation bites on the unclipped branch: a gradient through the weight C / k_t would cancel
        # their gradient (d/dlogp of -(C / k) * k * A is 0), so the NumPy check above tells the two apart.
        bites = kept & (k > cap) & (adv[:, None] < 0)
        assert bites.any()
    if correction != "tis":
        dropped = mask & ~kept
        assert m["icepop_masked_count"] == dropped.sum() > 0
        np.testing.assert_allclose(m["icepop_masked_frac"], dropped.sum() / mask.sum(), rtol=1e-6)


def test_tis_gradient_has_no_term_through_the_weight():
    """GRPO + TIS == GRPO with the factor min(k, C) / k computed from a frozen copy of logp and held constant.

    Through the factor, a truncated token on the unclipped branch would get no gradient at all (d/dlogp of
    -(C / k) * k * A is 0); held constant it keeps -C * A / N."""
    logp, old, adv, mask, _, _ = _inputs(14, spread=0.4)
    cap = 1.2
    frozen_k = np.exp(np.where(mask, logp - old, 0.0))
    factor = np.where(frozen_k > cap, cap / frozen_k, 1.0).astype(np.float32)
    g_wrapped, g_held = map(
        np.asarray,
        jax.jit(
            lambda lp: (
                jax.grad(lambda x: L.with_tis(L.grpo_loss, cap)(x, old, adv, mask)[0])(lp),
                jax.grad(lambda x: L.grpo_loss(x, old, adv, mask, token_weight=factor)[0])(lp),
            )
        )(logp),
    )
    np.testing.assert_allclose(g_wrapped, g_held, rtol=1e-6, atol=1e-8)
    bites = mask & (frozen_k > cap) & (adv[:, None] < 0)  # truncated and unclipped (negative advantage)
    assert bites.any() and np.all(g_wrapped[bites] != 0.0)
    lengths, n_valid = mask.sum(1), mask.any(1).sum()
    rows, cols = np.nonzero(bites)
    np.testing.assert_allclose(g_wrapped[bites], -cap * adv[rows] / lengths[rows] / n_valid, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(_CLIP))
def test_neutral_corrections_equal_the_unwrapped_loss(name):
    """cap = inf, window [0, inf], or ratio exactly 1: loss, gradient and metrics bit-identical to the base loss."""
    logp, old, adv, mask, _, _ = _inputs(15, spread=0.4)
    out = _evaluate_variants(name, logp, old, adv, mask)
    want_loss, want_m, want_g = out["base"]
    for key in ("tis_inf", "icepop_all", "both_inf"):
        loss, m, g = out[key]
        assert loss == want_loss, key
        np.testing.assert_array_equal(g, want_g)
        for k_, v in want_m.items():
            assert m[k_] == v, (key, k_)
    assert out["both_inf"][1]["tis_clipped_frac"] == 0 and out["both_inf"][1]["icepop_masked_count"] == 0
    on_policy = _evaluate_variants(name, logp, logp, adv, mask)  # ratio exactly 1: any cap / window is neutral
    loss, m, g = on_policy["both"]
    assert loss == on_policy["base"][0] and m["tis_clipped_frac"] == 0 and m["icepop_masked_count"] == 0
    assert m["tis_weight_mean"] == 1.0
    np.testing.assert_array_equal(g, on_policy["base"][2])


def test_corrections_compose_in_either_order_and_with_forking_wrappers():
    logp, old, adv, mask, ref, ent = _inputs(16, spread=0.4)
    extras = dict(entropy=ent, ref_logp=ref)

    @jax.jit
    def run(lp):
        vg = lambda fn: jax.value_and_grad(lambda x: fn(x, old, adv, mask, **extras)[0])(lp)
        tis = L.with_tis(L.gspo_loss, _CAP)
        return dict(
            tis_outside=vg(L.with_tis(L.with_icepop(L.dapo_loss, *_WINDOW), _CAP)),
            icepop_outside=vg(L.with_icepop(L.with_tis(L.dapo_loss, _CAP), *_WINDOW)),
            plain=tis(lp, old, adv, mask, entropy=ent),
            bonus_out=L.with_forking_entropy_bonus(tis, 0.5)(lp, old, adv, mask, entropy=ent),
            bonus_in=L.with_tis(L.with_forking_entropy_bonus(L.gspo_loss, 0.5), _CAP)(lp, old, adv, mask, entropy=ent),
            kl=L.with_forking_kl(L.with_icepop(L.grpo_loss, *_WINDOW), 0.3)(lp, old, adv, mask, **extras),
        )

    out = jax.device_get(run(logp))
    (v1, g1), (v2, g2) = out["tis_outside"], out["icepop_outside"]
    np.testing.assert_allclose(v1, v2, rtol=1e-6)  # TIS factors of dropped tokens never reach the loss
    np.testing.assert_allclose(g1, g2, rtol=1e-6, atol=1e-9)
    # The forking bonus is added outside, whichever way round: the corrected policy term is unchanged.
    (plain, _), (bonus_out, m_out), (bonus_in, m_in) = out["plain"], out["bonus_out"], out["bonus_in"]
    want = plain - 0.5 * m_out["forking_entropy"]
    np.testing.assert_allclose([bonus_out, bonus_in], [want, want], rtol=1e-6)
    assert {"tis_weight_mean", "tis_clipped_frac", "forking_entropy"} <= set(m_out) & set(m_in)
    kl_loss, m_kl = out["kl"]
    assert np.isfinite(kl_loss) and {"icepop_masked_frac", "forking_kl"} <= set(m_kl)


def test_corrections_jit_shapes_empty_mask_and_garbage():
    logp, old, adv, mask, ref, ent = _inputs(17, spread=0.4)
    wrapped = _variants("gspo")["both"]

    @jax.jit
    def run(lp, o, m):
        return jax.value_and_grad(
            lambda x: wrapped(x, o, adv, m, ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01), has_aux=True
        )(lp)

    (loss, m), _ = run(logp, old, mask)
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    assert {
        "tis_weight_mean",
        "tis_clipped_frac",
        "icepop_masked_frac",
        "icepop_masked_count",
        "kl",
        "entropy",
        "normalizer",
    } <= set(m)
    for v in m.values():
        chex.assert_shape(v, ())
        chex.assert_type(v, jnp.float32)
    (empty_loss, empty_m), g = jax.device_get(run(logp, old, np.zeros_like(mask)))
    assert empty_loss == 0.0 and np.all(g == 0.0) and empty_m["icepop_masked_frac"] == 0.0
    assert all(np.isfinite(v) for v in empty_m.values())
    old2 = np.where(mask, old, 1e6).astype(np.float32)  # huge garbage off the mask reaches no exp
    (loss2, _), g2 = jax.device_get(run(logp, old2, mask))
    np.testing.assert_allclose(loss2, float(loss), rtol=1e-6)
    assert np.all(np.isfinite(g2))


def test_corrections_bad_arguments_raise():
    for cap in (0.5, 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="cap"):
            L.with_tis(L.gspo_loss, cap)
    for low, high in ((0.5, 0.5), (2.0, 0.5), (-0.1, 2.0), (0.5, 1.0), (1.0, 2.0)):
        with pytest.raises(ValueError, match="low"):
            L.with_icepop(L.gspo_loss, low, high)
    logp, old, adv, mask, _, _ = _inputs(19)
    with pytest.raises(ValueError, match="token_weight"):
        L.dapo_loss(logp, old, adv, mask, token_weight=np.ones((B, T + 1), np.float32))


_INVARIANT_FNS = {}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), spread=st.floats(0.0, 3.0), cap=st.sampled_from([1.0, 1.3, 5.0]))
def test_correction_metric_invariants(seed, spread, cap):
    """Weights in (0, C], fractions in [0, 1], the masked count is NumPy's, the loss is finite."""
    logp, old, adv, mask, _, _ = _inputs(seed % 1000, spread=spread)
    if cap not in _INVARIANT_FNS:
        _INVARIANT_FNS[cap] = jax.jit(L.with_tis(L.with_icepop(L.grpo_loss, 0.5, 2.0), cap))
    loss, m = jax.device_get(_INVARIANT_FNS[cap](logp, old, adv, mask))
    assert np.isfinite(loss)
    assert 0.0 < m["tis_weight_mean"] <= cap * (1 + 1e-6)
    assert 0.0 <= m["tis_clipped_frac"] <= 1.0 and 0.0 <= m["icepop_masked_frac"] <= 1.0
    k = np.exp(logp.astype(np.float64) - old)
    assert m["icepop_masked_count"] == (mask & ((k < 0.5) | (k > 2.0))).sum()


def test_correction_metrics_reduce_through_the_train_step():
    """2 minibatches x 2 micro-batches at learning rate 0 (params fixed): the masked count is the batch total,
    fractions stay fractions, and the metric names are what the training loop logs as train/<name>."""
    from reno_jax.rl import trainer
    from reno_jax.rl.batch import TrainBatch

    rows, length = 8, 5
    rng = np.random.default_rng(20)
    table = (-rng.uniform(0.1, 2.0, (rows, length))).astype(np.float32)
    old = (table + rng.normal(0, 0.6, (rows, length))).astype(np.float32)
    mask = rng.uniform(size=(rows, length)) < 0.8
    # A lookup "policy": one table row per sample, its index in the sample's tokens.
    logp_fn = lambda params, mb: trainer.PolicyOutput(params["table"][mb.tokens[:, 0]])
    loss_fn = L.with_tis(L.with_icepop(L.dapo_loss, 0.7, 1.5), 1.2)
    step = trainer.make_train_step(
        logp_fn, loss_fn, trainer.make_optimizer(0.0), num_minibatches=2, num_microbatches=2, donate=False
    )
    state = trainer.create_train_state({"table": jnp.asarray(table)}, trainer.make_optimizer(0.0), 0)
    batch = TrainBatch(
        tokens=jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, length)),
        loss_mask=jnp.asarray(mask),
        old_logp=jnp.asarray(old),
        advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
    )
    _, metrics = step(state, batch)
    k = np.exp(table.astype(np.float64) - old)
    dropped = mask & ((k < 0.7) | (k > 1.5))
    assert float(metrics["icepop_masked_count"]) == dropped.sum() > 0
    # Fractions: weighted by the loss's normaliser over micro-batches (DAPO under IcePop: the kept tokens), then
    # averaged over the two minibatches.
    micro = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    kept_n = [(mask[m] & ~dropped[m]).sum() for m in micro]
    frac = [dropped[m].sum() / mask[m].sum() for m in micro]
    want = np.mean([np.dot(kept_n[j : j + 2], frac[j : j + 2]) / sum(kept_n[j : j + 2]) for j in (0, 2)])
    np.testing.assert_allclose(float(metrics["icepop_masked_frac"]), want, rtol=1e-5)
    assert 0.0 <= float(metrics["tis_clipped_frac"]) <= 1.0 and "tis_weight_mean" in metrics
    assert L.METRIC_REDUCTIONS["icepop_masked_count"] == "count"  # summed, not averaged, over micro-batches
