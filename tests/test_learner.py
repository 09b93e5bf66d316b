"""Tests for reno_jax.rl.learner: the forking schedule, group selection, the jitted batch preparation (against the
host loop it replaced), a step without implicit host transfers, and a few steps of the tiny Ling-3.0 policy."""

import contextlib
import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.rl import learner, losses, trainer
from reno_jax.rl.batch import TrainBatch

# ---------------------------------------------------------------------------------------------- references
# The host implementations the library replaced (experiments/train_tictactoe.py before the learner), verbatim.


def host_forking_entropy_scale(step: int, num_steps: int, hold: float, end: float) -> float:
    t = step / max(num_steps, 1)
    if t <= hold:
        return 1.0
    if t >= end:
        return 0.0
    return float((end - t) / (end - hold))


@functools.partial(jax.jit, static_argnames=("group_size", "num_groups"))
def _host_top_variance_rows(reward, group_size: int, num_groups: int):
    r = reward.reshape(-1, group_size)
    informative = jnp.max(r, axis=1) > jnp.min(r, axis=1)
    std = jnp.where(informative, r.std(axis=1), 0.0)
    order = jnp.argsort(-std, stable=True)[:num_groups]
    rows = (order[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)
    return rows, jnp.mean(informative)


def host_select_groups(batch: TrainBatch, reward, group_size: int, num_groups: int):
    n = reward.shape[0] // group_size
    rows, informative = _host_top_variance_rows(reward, group_size, min(num_groups or n, n))
    if num_groups and num_groups < n:
        batch = jax.tree.map(lambda x: x[rows], batch)
    return batch, float(informative)


def host_prepare(traj, step, cfg):
    """The old loop's batch assembly: eager advantages, host selection, a host scale broadcast per row."""
    advantages = losses.group_advantages(traj.reward, cfg.group_size, normalize_std=cfg.normalize_adv_std)
    batch = TrainBatch(
        tokens=traj.tokens,
        valid=traj.valid,
        loss_mask=traj.loss_mask,
        old_logp=traj.behaviour_logp,
        advantages=advantages,
    )
    batch, informative = host_select_groups(batch, traj.reward, cfg.group_size, cfg.train_groups)
    if cfg.forking_schedule:
        scale = host_forking_entropy_scale(step, cfg.num_steps, cfg.forking_entropy_hold, cfg.forking_entropy_end)
        batch = batch.replace(entropy_scale=jnp.full(batch.advantages.shape, scale, jnp.float32))
    return batch, informative


# ---------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize(
    "num_steps, hold, end",
    [
        (600, 0.5, 0.8),
        (6, 0.5, 0.8),
        (100, 0.5, 0.8),
        (7, 0.3, 0.9),
        (1000, 0.25, 0.75),
        (50, 0.0, 1.0),
        (997, 1 / 3, 0.9),
        (300, 0.5, 1.5),
        (20000, 0.5, 0.8),
        (10, 1.0, 1.0),
        (3, 0.1, 0.2),
        (1, 0.0, 0.0),
        (0, 0.5, 0.8),
        (10, 0.8, 0.5),
        (1234, 0.123456789, 0.987654321),
    ],
)
def test_schedule_follows_the_host_formula(num_steps, hold, end):
    """Every step of the run (and a few after) within float32 rounding of the float64 host formula; exactly 1 on
    the hold and exactly 0 from the end on."""
    sched = learner.forking_entropy_schedule(num_steps, hold, end)
    steps = np.arange(int(max(num_steps, 1) * max(end, 1.0)) + 3)
    want = np.array([host_forking_entropy_scale(int(s), num_steps, hold, end) for s in steps])
    got = np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(steps, jnp.int32)))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-7)
    np.testing.assert_array_equal(got[want == 1.0], 1.0)
    np.testing.assert_array_equal(got[want == 0.0], 0.0)
    one = jax.jit(sched)  # a scalar step, as the learner evaluates it
    for s in (0, num_steps // 2 + 1, int(0.7 * num_steps), num_steps):
        np.testing.assert_allclose(
            float(one(jnp.int32(s))), host_forking_entropy_scale(s, num_steps, hold, end), rtol=0, atol=2e-7
        )


def test_schedule_shape():
    sched = lambda s: float(learner.forking_entropy_schedule(100, hold=0.5, end=0.8)(s))
    assert [sched(s) for s in (0, 25, 50)] == [1.0, 1.0, 1.0]  # held, up to and including hold * num_steps
    assert 1 - 1 / 30 - 1e-6 < sched(51) < 1 - 1 / 30 + 1e-6  # the ramp starts at hold * num_steps
    np.testing.assert_allclose([sched(60), sched(65), sched(70)], [2 / 3, 0.5, 1 / 3], rtol=1e-6)
    assert sched(80) == 0.0 and sched(99) == 0.0 and sched(10**6) == 0.0
    # Boundaries between steps: hold 0.3 and end 0.9 of 7 steps are 2.1 and 6.3; the ramp is (6.3 - s) / 4.2.
    frac = lambda s: float(learner.forking_entropy_schedule(7, hold=0.3, end=0.9)(s))
    assert frac(2) == 1.0 and frac(7) == 0.0
    np.testing.assert_allclose([frac(3), frac(6)], [3.3 / 4.2, 0.3 / 4.2], rtol=0, atol=2e-7)
    # No ramp (end <= hold): 1 through hold * num_steps, 0 after; hold >= 1 holds the whole run.
    step_fn = lambda s: float(learner.forking_entropy_schedule(10, hold=0.8, end=0.5)(s))
    assert [step_fn(s) for s in (0, 8, 9)] == [1.0, 1.0, 0.0]
    whole = learner.forking_entropy_schedule(10, hold=1.0, end=1.0)
    assert [float(whole(s)) for s in range(11)] == [1.0] * 11 and float(whole(11)) == 0.0
    # A traced step under jit, as the learner evaluates it: float32.
    out = jax.jit(learner.forking_entropy_schedule(100, 0.5, 0.8))(jnp.int32(65))
    assert out.dtype == jnp.float32 and out.shape == ()


# ---------------------------------------------------------------------------------------------- selection


@pytest.mark.parametrize("train_groups", [0, 1, 3, 6, 9])
def test_select_groups_equals_host_reference(train_groups):
    g, n = 4, 6
    rng = np.random.default_rng(train_groups)
    # Rewards from a few values: constant groups and ties in spread, where the order must match exactly.
    reward = rng.choice(np.float32([-1.0, 0.0, 0.5, 1.0]), size=n * g).astype(np.float32)
    reward[:g] = 0.5
    reward[2 * g : 3 * g] = reward[4 * g : 5 * g]
    batch = TrainBatch(
        tokens=jnp.asarray(rng.integers(0, 50, (n * g, 5)), jnp.int32),
        loss_mask=jnp.asarray(rng.uniform(size=(n * g, 5)) < 0.5),
        old_logp=jnp.asarray(rng.normal(size=(n * g, 5)), jnp.float32),
        advantages=jnp.asarray(rng.normal(size=n * g), jnp.float32),
    )
    want, want_rate = host_select_groups(batch, jnp.asarray(reward), g, train_groups)
    got, rate = jax.jit(lambda b, r: learner.select_groups(b, r, g, train_groups))(batch, jnp.asarray(reward))
    assert isinstance(rate, jax.Array) and rate.dtype == jnp.float32
    assert float(rate) == want_rate
    assert isinstance(got, TrainBatch) and sorted(got.present()) == sorted(batch.present())  # None stays None
    for k, v in want.present().items():
        np.testing.assert_array_equal(np.asarray(getattr(got, k)), np.asarray(v))


# ---------------------------------------------------------------------------------------------- toy learner

V, L, G, N = 16, 10, 4, 4  # vocabulary, row length, group size, groups per step


@flax.struct.dataclass
class ToyTrajectory:
    """The Trajectory fields the learner reads; `stats` and `env_info`, which `prepare_batch` drops, stay None."""

    tokens: jax.Array
    valid: jax.Array
    loss_mask: jax.Array
    behaviour_logp: jax.Array
    reward: jax.Array
    prompt_length: jax.Array
    group_id: jax.Array
    stats: object = None
    env_info: object = None
    routing: object = None
    turn_id: object = None
    turn_reward: object = None
    turn_key: object = None


def toy_params(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w": 0.5 * jax.random.normal(k1, (V, V)), "b": 0.1 * jax.random.normal(k2, (V,))}


def toy_logp_fn(params, batch: TrainBatch) -> trainer.PolicyOutput:
    """Bigram policy; a shared-prefix batch is scored on prefix + continuation and cut back to the continuation."""
    tokens, cut = batch.tokens, 0
    if batch.shared_prefix:
        head = [batch.common_tokens] if batch.common_tokens is not None else []
        head.append(batch.prefix_tokens)
        cut = sum(h.shape[1] for h in head)
        tokens = jnp.concatenate(head + [tokens], axis=1)
    lsm = jax.nn.log_softmax(params["w"][tokens[:, :-1]] + params["b"], axis=-1)
    logp = jnp.take_along_axis(lsm, tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(lsm) * lsm, axis=-1)
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return trainer.PolicyOutput(jnp.concatenate([pad, logp], 1)[:, cut:], jnp.concatenate([pad, ent], 1)[:, cut:])


def toy_trajectory(params, seed):
    """Groups share their prompt (lengths 3..5); rewards: one constant group, the others spread."""
    rng = np.random.default_rng(seed)
    prompt_len = np.repeat(rng.integers(3, 6, N), G).astype(np.int32)
    tokens = rng.integers(0, V, (N * G, L)).astype(np.int32)
    tokens[:, :6] = np.repeat(rng.integers(0, V, (N, 6)), G, axis=0)  # prompts (and more) shared by a group
    tokens[:, :2] = rng.integers(0, V, 2)  # a "system prompt" every row shares
    ends = rng.integers(7, L + 1, N * G)
    pos = np.arange(L)[None, :]
    valid = pos < ends[:, None]
    loss_mask = valid & (pos >= prompt_len[:, None])
    reward = rng.choice(np.float32([-1.0, 0.0, 1.0]), N * G).astype(np.float32)
    reward[G : 2 * G] = 1.0
    logp = toy_logp_fn(
        params,
        TrainBatch(
            tokens=jnp.asarray(tokens),
            loss_mask=jnp.asarray(loss_mask),
            old_logp=jnp.zeros((N * G, L)),
            advantages=jnp.zeros((N * G,)),
        ),
    ).logp
    return ToyTrajectory(
        tokens=jnp.asarray(tokens),
        valid=jnp.asarray(valid),
        loss_mask=jnp.asarray(loss_mask),
        behaviour_logp=jnp.where(jnp.asarray(loss_mask), logp, 0.0),
        reward=jnp.asarray(reward),
        prompt_length=jnp.asarray(prompt_len),
        group_id=jnp.asarray(np.arange(N * G) // G),
    )


def toy_learner(share_prefix, anchored, train_groups, share_common=False, length_bucket=0, row_bucket=0):
    cfg = learner.LearnerConfig(
        group_size=G,
        train_groups=train_groups,
        forking_schedule=True,
        num_steps=4,
        forking_entropy_hold=0.25,
        forking_entropy_end=0.9,
        share_prompt_prefix=share_prefix,
        share_common_prefix=share_common,
        num_microbatches=2,
        length_bucket=length_bucket,
        row_bucket=row_bucket,
    )
    loss = functools.partial(losses.gspo_loss, eps_low=3e-4, eps_high=4e-4)
    if anchored:
        loss, ref = losses.with_forking_kl(loss, 0.1), dict(ref_logp_fn=toy_logp_fn, ref_params=toy_params(1))
    else:
        loss, ref = losses.with_forking_entropy_bonus(loss, 0.1), {}
    opt = trainer.make_optimizer(1e-2, weight_decay=0.0)
    return cfg, opt, learner.Learner(cfg, toy_logp_fn, loss, opt, num_groups=N, **ref)


@pytest.mark.parametrize("train_groups", [0, 2])
def test_prepare_batch_matches_the_host_loop(train_groups):
    """The one jitted program gives the host loop's batch (float fields to float32 rounding: XLA fuses the
    advantages' reductions differently from the eager ops), the same batch again when called again, and the same
    batch under an outer `jax.jit`."""
    cfg, _, lrn = toy_learner(share_prefix=False, anchored=False, train_groups=train_groups)
    params = toy_params()
    jitted = jax.jit(lrn.prepare_batch)
    for step in (0, 2, 3):  # full scale, on the ramp, off
        traj = toy_trajectory(params, seed=step)
        want, want_rate = host_prepare(traj, step, cfg)
        got, stats = lrn.prepare_batch(traj, jnp.int32(step))
        assert isinstance(got, TrainBatch) and sorted(got.present()) == sorted(want.present())
        for k, v in want.present().items():
            if k in ("advantages", "entropy_scale"):
                np.testing.assert_allclose(np.asarray(getattr(got, k)), np.asarray(v), rtol=1e-6, atol=1e-6, err_msg=k)
            else:
                np.testing.assert_array_equal(np.asarray(getattr(got, k)), np.asarray(v), err_msg=k)
        assert isinstance(stats, learner.BatchStats) and float(stats.informative_group_rate) == want_rate
        assert stats.shortest_prompt is None and stats.common_prefix is None  # no shared-prefix cut
        for again in (lrn.prepare_batch(traj, jnp.int32(step))[0], jitted(traj, jnp.int32(step))[0]):
            for k in want.present():
                np.testing.assert_array_equal(np.asarray(getattr(again, k)), np.asarray(getattr(got, k)), err_msg=k)


def test_prepare_batch_step_offset_starts_the_schedule_at_the_stage():
    """A curriculum stage's learner (step_offset = the steps before it) evaluates its forking schedule at its own
    step count: global step offset + k scores like step k of a run of the stage alone."""
    cfg, _, lrn = toy_learner(share_prefix=False, anchored=False, train_groups=0)
    shifted = learner.make_prepare_batch(dataclasses.replace(cfg, step_offset=100))
    params = toy_params()
    for step in (0, 2, 3):
        traj = toy_trajectory(params, seed=step)
        want, _ = lrn.prepare_batch(traj, jnp.int32(step))
        got, _ = shifted(traj, jnp.int32(100 + step))
        np.testing.assert_array_equal(np.asarray(got.entropy_scale), np.asarray(want.entropy_scale))
    with pytest.raises(ValueError, match="step_offset"):
        dataclasses.replace(cfg, step_offset=-1)


class ImplicitHostRead(Exception):
    pass


@contextlib.contextmanager
def host_reads_only_through_host_sync(monkeypatch):
    """Makes every read of a device array's value on the host raise, except through `learner.host_sync`, whose
    calls it records by name. The transfer guard alone cannot show this on CPU, where device arrays live in host
    memory and reading them is not a guarded transfer."""
    array_type = type(jnp.zeros(()))
    value = array_type._value  # the property behind float(), int(), bool(), np.asarray(), .item(), device_get
    allowed, names = [False], []

    def guarded(self):
        if not allowed[0]:
            raise ImplicitHostRead("a step read a device value on the host outside learner.host_sync")
        return value.fget(self)

    def named(name, x, sync=learner.host_sync):
        names.append(name)
        allowed[0] = True
        try:
            return sync(name, x)
        finally:
            allowed[0] = False

    with monkeypatch.context() as m:
        m.setattr(array_type, "_value", property(guarded))
        m.setattr(learner, "host_sync", named)
        yield names


@pytest.mark.parametrize(
    "share_prefix, anchored, train_groups, share_common, bucket",
    [
        (True, True, 2, False, 0),
        (False, False, 0, False, 0),
        (True, False, 0, True, 0),
        (False, False, 0, False, 3),
        (True, False, 2, True, 4),
    ],
)
def test_learner_step_makes_no_implicit_host_transfer(
    share_prefix, anchored, train_groups, share_common, bucket, monkeypatch
):
    _, opt, lrn = toy_learner(share_prefix, anchored, train_groups, share_common, bucket)
    params = toy_params()
    state = jax.device_put(trainer.create_train_state(params, opt, 0))
    trajs = [jax.device_put(toy_trajectory(params, seed)) for seed in range(3)]
    shortest = min(int(np.min(np.asarray(t.prompt_length))) for t in trajs)
    with host_reads_only_through_host_sync(monkeypatch) as syncs, jax.transfer_guard("disallow"):
        for traj in trajs:  # the first step compiles under the guards too
            state, metrics = lrn.learner_step(state, traj)
        # Both guards are on: an implicit upload and an implicit read are refused.
        with pytest.raises(Exception, match="Disallowed host-to-device"):
            jax.jit(lambda x: x)(np.ones(2, np.float32))
        with pytest.raises(ImplicitHostRead):
            float(metrics["train/loss"])
    assert syncs == ([learner.LENGTHS_SYNC] * 3 if share_prefix or bucket else [])
    metrics = jax.device_get(metrics)
    assert int(state.step) == 3
    for k in (
        "train/loss",
        "train/policy_loss",
        "train/grad_norm",
        "train/rollout_k3_kl",
        "rollout/informative_group_rate",
        "train/forking_kl_coef" if anchored else "train/forking_entropy_coef",
    ):
        assert np.isfinite(metrics[k]), k
    # Step 2 of 4 with hold 0.25, end 0.9: the ramp, (0.9 - 0.5) / 0.65.
    coef = metrics["train/forking_kl_coef" if anchored else "train/forking_entropy_coef"]
    np.testing.assert_allclose(coef, 0.1 * 0.4 / 0.65, rtol=1e-6)
    if share_prefix:
        assert lrn.prefix_len == shortest  # the shortest prompt over the three steps
        assert lrn.common_len == (2 if share_common else 0)


def test_learner_step_with_a_common_prefix_equals_the_step_without():
    """The batch-wide common part encoded once gives the same update as each group's whole prompt."""
    params = toy_params()
    traj = toy_trajectory(params, seed=0)
    out = []
    for share_common in (False, True):
        _, opt, lrn = toy_learner(True, False, 0, share_common)
        state, metrics = lrn.learner_step(trainer.create_train_state(toy_params(), opt, 0), traj)  # donated
        out.append((state.params, float(metrics["train/loss"])))
    np.testing.assert_allclose(out[1][1], out[0][1], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)


def ending_before(traj, last: int):
    """`traj` with every row cut to at most `last` real columns (the rest padding in every row)."""
    keep = np.arange(L)[None, :] < last
    return dataclasses.replace(
        traj,
        valid=traj.valid & keep,
        loss_mask=traj.loss_mask & keep,
        behaviour_logp=jnp.where(keep, traj.behaviour_logp, 0.0),
    )


@pytest.mark.parametrize("share_prefix", [False, True])
def test_trimmed_batch_gives_the_same_update(share_prefix):
    """length_bucket: the train step sees the columns up to the last real one (rounded up to the bucket) and makes
    the update of the whole-width batch; the width actually trained is the bucketed one."""
    params = toy_params()
    traj = ending_before(toy_trajectory(params, seed=3), 7)
    widths, out = [], []
    for bucket in (0, 2, 4):
        _, opt, lrn = toy_learner(share_prefix, False, 0, share_common=share_prefix, length_bucket=bucket)
        step = lrn.train_step
        lrn.train_step = lambda st, b, *a, step=step: (
            widths.append(
                b.tokens.shape[1] + (b.prefix_tokens.shape[1] + b.common_tokens.shape[1] if b.shared_prefix else 0)
            ),
            step(st, b, *a),
        )[1]
        state, metrics = lrn.learner_step(trainer.create_train_state(toy_params(), opt, 0), traj)
        out.append((state.params, float(metrics["train/loss"])))
    assert widths == [L, 8, 8]  # the last real column is 7: 7 rounds up to 8 with buckets of 2 and of 4
    for params_b, loss_b in out[1:]:
        np.testing.assert_allclose(loss_b, out[0][1], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(params_b)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    with pytest.raises(ValueError, match="length_bucket"):
        learner.LearnerConfig(group_size=G, length_bucket=-1)


@pytest.mark.parametrize("share_common", [False, True])
def test_rows_without_policy_tokens_left_out_give_the_same_update(share_common):
    """row_bucket: the train step sees only the rows with policy tokens (turn samples' unplayed turns have none),
    their count rounded up to the bucket, and makes the update of the whole batch."""
    params = toy_params()
    traj = toy_trajectory(params, seed=4)
    empty = np.isin(np.arange(N * G), [1, 5, 6, 13])  # four rows with no policy token, e.g. turns not played
    traj = dataclasses.replace(
        traj,
        loss_mask=traj.loss_mask & ~jnp.asarray(empty)[:, None],
        behaviour_logp=jnp.where(jnp.asarray(empty)[:, None], 0.0, traj.behaviour_logp),
    )
    rows, out = [], []
    for bucket in (0, 2, 6, 10):
        _, opt, lrn = toy_learner(False, False, 0, share_common=share_common, row_bucket=bucket)
        step = lrn.train_step
        lrn.train_step = lambda st, b, *a, step=step: (rows.append(b.tokens.shape[0]), step(st, b, *a))[1]
        state, metrics = lrn.learner_step(trainer.create_train_state(toy_params(), opt, 0), traj)
        out.append((state.params, float(metrics["train/loss"])))
    assert rows == [N * G, 12, 12, N * G]  # 12 rows hold policy tokens; 10 rounds 12 up past the batch's 16
    for params_b, loss_b in out[1:]:
        np.testing.assert_allclose(loss_b, out[0][1], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(params_b)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    kept = learner.compact_rows(
        TrainBatch(tokens=traj.tokens, loss_mask=traj.loss_mask, old_logp=traj.behaviour_logp, advantages=traj.reward),
        12,
    )
    np.testing.assert_array_equal(np.asarray(kept.tokens), np.asarray(traj.tokens)[~empty])  # in order
    with pytest.raises(ValueError, match="row_bucket"):
        learner.LearnerConfig(group_size=G, num_microbatches=2, row_bucket=3)
    with pytest.raises(ValueError, match="row_bucket"):
        learner.LearnerConfig(group_size=G, row_bucket=2, share_prompt_prefix=True)


def test_trim_length_and_bucketed_length():
    from reno_jax.rl import batch as batch_lib

    valid = jnp.asarray(np.arange(6)[None, :] < np.array([[2], [4], [0]]))
    assert int(batch_lib.used_length(valid)) == 4
    assert int(batch_lib.used_length(jnp.zeros((2, 5), bool))) == 0
    assert [batch_lib.bucketed_length(u, 10, 4) for u in (0, 1, 4, 5, 9, 10)] == [1, 4, 4, 8, 10, 10]
    with pytest.raises(ValueError, match="bucket"):
        batch_lib.bucketed_length(3, 10, 0)
    # a run compiles one train step per width: over every length a 600-token conversation may use, a handful
    widths = {batch_lib.bucketed_length(u, 600, 8) for u in range(601)}
    assert sorted(widths) == [1, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 600]
    assert all(batch_lib.bucketed_length(u, 10**6, 8) < 1.5 * u + 8 for u in range(1, 5000))  # padding bounded
    b = TrainBatch(
        tokens=jnp.zeros((3, 6), jnp.int32),
        loss_mask=valid,
        old_logp=jnp.zeros((3, 6)),
        advantages=jnp.ones((3, 6)),
        valid=valid,
        soft_target_weights=jnp.ones((3, 6, 2)),
        soft_target_ids=jnp.zeros((3, 2), jnp.int32),
    )
    t = batch_lib.trim_length(b, 4)
    assert t.tokens.shape == (3, 4) and t.advantages.shape == (3, 4) and t.soft_target_weights.shape == (3, 4, 2)
    assert t.soft_target_ids.shape == (3, 2)  # not per token
    assert batch_lib.trim_length(b, 6) is b
    with pytest.raises(ValueError, match="length must be in 1..6"):
        batch_lib.trim_length(b, 7)


def with_two_turns(traj, seed):
    """`traj` as two-turn episodes: each row's policy tokens split in two turns, the reward earned on the second,
    turn 0 from the group's start (one key), turn 1 from one of two states."""
    rng = np.random.default_rng(seed)
    mask, valid = np.asarray(traj.loss_mask), np.asarray(traj.valid)
    pos = np.arange(L)[None, :]
    first = np.argmax(mask, axis=1)
    split = first + (mask.sum(1) + 1) // 2
    turn_id = np.where(valid, (pos >= split[:, None]).astype(np.int32), -1)
    reward = np.asarray(traj.reward)
    turn_key = np.stack([np.zeros(N * G, np.int32), rng.integers(5, 7, N * G).astype(np.int32)], 1)
    return dataclasses.replace(
        traj,
        turn_id=jnp.asarray(turn_id),
        turn_key=jnp.asarray(turn_key),
        turn_reward=jnp.asarray(np.stack([np.zeros_like(reward), reward], 1)),
    )


def test_turn_advantages_reach_the_batch_and_the_shared_prefix_step():
    params = toy_params()
    traj = with_two_turns(toy_trajectory(params, seed=0), seed=0)
    cfg = learner.LearnerConfig(group_size=G, turn_advantage_coef=0.5, num_microbatches=2)
    batch, _ = learner.make_prepare_batch(cfg)(traj, jnp.int32(0))
    want = losses.token_advantages(
        losses.group_advantages(traj.reward, G),
        losses.turn_advantages(traj.turn_reward, traj.turn_key, G),
        traj.turn_id,
        traj.loss_mask,
        0.5,
    )
    assert batch.advantages.shape == (N * G, L)
    np.testing.assert_allclose(np.asarray(batch.advantages), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.any(
        np.asarray(batch.advantages)[np.asarray(traj.loss_mask)]
        != np.repeat(np.asarray(losses.group_advantages(traj.reward, G)), L).reshape(N * G, L)[
            np.asarray(traj.loss_mask)
        ]
    )
    # The per-token advantages are cut with the shared prefix: the same update with and without it.
    out = []
    for share in (False, True):
        c = dataclasses.replace(cfg, share_prompt_prefix=share)
        opt = trainer.make_optimizer(1e-2, weight_decay=0.0)
        lrn = learner.Learner(c, toy_logp_fn, losses.gspo_token_loss, opt, num_groups=N)
        state, metrics = lrn.learner_step(trainer.create_train_state(toy_params(), opt, 0), traj)
        out.append((state.params, float(metrics["train/loss"])))
    np.testing.assert_allclose(out[1][1], out[0][1], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    with pytest.raises(ValueError, match="turn_advantage_coef"):
        learner.LearnerConfig(group_size=G, turn_advantage_coef=-1.0)


def test_batch_turn_scope_compares_turns_across_groups():
    """turn_scope="batch": every turn of the batch from the same key is a peer, whatever its group."""
    params = toy_params()
    traj = with_two_turns(toy_trajectory(params, seed=0), seed=1)
    batches = {}
    for scope in learner.TURN_SCOPES:
        cfg = learner.LearnerConfig(group_size=G, turn_advantage_coef=0.5, turn_scope=scope)
        batches[scope], _ = learner.make_prepare_batch(cfg)(traj, jnp.int32(0))
    pooled = losses.turn_advantages(traj.turn_reward, traj.turn_key, N * G)
    want = losses.token_advantages(losses.group_advantages(traj.reward, G), pooled, traj.turn_id, traj.loss_mask, 0.5)
    np.testing.assert_allclose(np.asarray(batches["batch"].advantages), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(batches["batch"].advantages), np.asarray(batches["group"].advantages))
    # turn 1's keys (5 or 6) recur across groups: pooled, a turn's advantage is its return against every such turn
    ret, key = np.asarray(traj.turn_reward)[:, 1], np.asarray(traj.turn_key)[:, 1]
    for k in (5, 6):
        peers = ret[key == k]
        if np.ptp(peers) > 0:
            np.testing.assert_allclose(
                np.asarray(pooled)[key == k, 1], (peers - peers.mean()) / (peers.std() + 1e-8), rtol=1e-5
            )
    with pytest.raises(ValueError, match="turn_scope"):
        learner.LearnerConfig(group_size=G, turn_scope="episode")


def test_learner_rejects_groups_that_do_not_split():
    cfg = learner.LearnerConfig(group_size=4, train_groups=3, share_prompt_prefix=True, num_microbatches=2)
    with pytest.raises(ValueError, match="whole groups"):
        cfg.check_num_groups(8)
    with pytest.raises(ValueError, match="group_size"):
        learner.LearnerConfig(group_size=0)


# ---------------------------------------------------------------------------------------------- tiny Ling-3.0


def test_tiny_ling3_run_steps():
    """A few rollout + learner steps of the tiny Ling-3.0 policy on the move task, through `run_step`."""
    from configs import tictactoe_tiny
    from reno_jax.envs.tictactoe import boards as boards_lib
    from reno_jax.envs.tictactoe import env as ttt_env
    from reno_jax.loop import build, recipe
    from reno_jax.rl import policy
    from reno_jax.rollout import rollout as rollout_lib

    c = tictactoe_tiny.get_config()
    c.num_steps = 3
    c.model.tiny.num_hidden_layers = 2  # KDA + dense MLP, MLA + MoE: every layer kind, quicker to compile
    c.rollout.boards_per_step = 2
    c.rollout.group_size = 4
    c.rl.train_groups = 1
    c.rl.share_common_prefix = True  # the system prompt every row shares, encoded once per batch
    c.rl.max_logp_shift = 0.0  # the update guard has its own tests (tests/test_trainer.py); it adds compile time
    tokenizer = build.build_tokenizer(c)
    model_config, params = build.build_model(c, jax.random.PRNGKey(0), tokenizer)
    env = build.make_compiled_env(c, tokenizer, model_config)
    boards, _ = boards_lib.load_boards(c.env)
    rc = build.rollout_config(c)
    optimizer = recipe.make_optimizer(c)
    lrn = learner.Learner(
        recipe.learner_config(c),
        policy.make_logp_fn(model_config, group_size=rc.group_size, entropy_top_k=9),
        recipe.make_loss_fn(c),
        optimizer,
        num_groups=2,
        rollout_fn=functools.partial(rollout_lib.make_rollout_fn(model_config, rc), env=env),
    )
    starts_fn = lambda key: ttt_env.move_starts(boards[:2])
    state = trainer.create_train_state(params, optimizer, jax.random.PRNGKey(1))
    for step in range(c.num_steps):
        out = lrn.run_step(state, starts_fn, time_rollout=step == 0)
        state, traj, metrics, seconds = out.state, out.traj, out.metrics, out.rollout_seconds
        metrics = jax.device_get(metrics)
        assert traj.tokens.shape[0] == 8 and (seconds is None) == (step > 0)
        for k in (
            "train/loss",
            "train/policy_loss",
            "train/forking_entropy",
            "train/grad_norm",
            "train/rollout_logp_abs_diff_mean",
            "rollout/informative_group_rate",
        ):
            assert np.isfinite(metrics[k]), k
        assert metrics["train/skipped"] == 0
        assert metrics["train/rollout_logp_abs_diff_mean"] < 1e-4  # the train forward scores what was sampled
    assert int(state.step) == 3 and lrn.prefix_len == int(np.min(np.asarray(traj.prompt_length)))
    assert 38 <= lrn.common_len < lrn.prefix_len  # system prompt, tool schema and "You are X." at least
    # The last step trained at step 2 of 3 (hold 0.5, end 0.8): on the ramp.
    np.testing.assert_allclose(
        metrics["train/forking_entropy_coef"], 0.1 * host_forking_entropy_scale(2, 3, 0.5, 0.8), rtol=1e-6
    )
