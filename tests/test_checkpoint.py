"""Checkpoint / resume tests: 6 straight steps == 3 steps + crash + restart in a fresh process + 3 steps.

The training run is this file's ``run_training`` (toy bigram policy, the real jitted train step with 8-bit Adam
moments, 2 shuffled minibatches, batches drawn from the state's rng). It is executed as a subprocess
(``python tests/test_checkpoint.py WORKDIR TOTAL``) for the restart after the (simulated) crash.
"""

import functools
import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # the subprocess runs this file directly
    sys.path.insert(0, REPO)

from reno_jax.checkpoint import metrics as M  # noqa: E402
from reno_jax.checkpoint import orbax as ckpt_lib  # noqa: E402
from reno_jax.rl import losses, trainer  # noqa: E402
from reno_jax.rl.batch import TrainBatch  # noqa: E402

V, L, B = 64, 6, 8
CONFIG = {"loss": "gspo", "lr": 3e-2, "vocab": V, "shape": (B, L), "nested": {"group_size": 4}}
SAVE_EVERY = 3


def toy_logp_fn(params, batch):
    """Bigram softmax policy: logp [b, L] and entropy [b, L]; position 0 has logp 0."""
    tokens = batch.tokens
    lsm = jax.nn.log_softmax(params["w"][tokens[:, :-1]] + params["b"], axis=-1)
    logp = jnp.take_along_axis(lsm, tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(lsm) * lsm, axis=-1)
    pad = jnp.zeros((tokens.shape[0], 1))
    return trainer.PolicyOutput(jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, ent], 1))


@functools.lru_cache(maxsize=None)
def _make_fns():
    opt = trainer.make_optimizer(3e-2, warmup_steps=2, total_steps=12, state_dtype="int8")
    step = trainer.make_train_step(toy_logp_fn, losses.gspo_loss, opt, num_minibatches=2, shuffle=True)
    return opt, step


def make_run():
    """(optimizer, jitted step, fresh initial state). The jitted functions are shared within a process."""
    opt, step = _make_fns()
    rng = np.random.default_rng(42)
    params = {
        "w": jnp.asarray(0.3 * rng.normal(size=(V, V)), jnp.float32),
        "b": jnp.asarray(0.1 * rng.normal(size=(V,)), jnp.float32),
    }
    return opt, step, trainer.create_train_state(params, opt, 7)


@jax.jit
def sample_batch(key):
    """Random tokens (drawn with the state's rng, so a resumed run must restore it exactly); reward = number of
    generated tokens < 8; old_logp (zeros here) is filled in by the caller from the current policy. Returns
    (batch, reward)."""
    tokens = jax.random.randint(key, (B, L), 0, V).astype(jnp.int32)
    mask = jnp.broadcast_to(jnp.arange(L)[None, :] >= 2, (B, L))
    reward = jnp.sum((tokens < 8) & mask, 1).astype(jnp.float32)
    return TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        old_logp=jnp.zeros((B, L), jnp.float32),
        advantages=losses.group_advantages(reward, 4),
    ), reward


@jax.jit
def behaviour_logp(params, batch):
    return jnp.where(batch.loss_mask, toy_logp_fn(params, batch).logp, 0.0)


class SimulatedCrash(Exception):
    pass


def run_training(workdir, total_steps, crash_after=None):
    """Resumes from ``workdir`` if possible, trains to ``total_steps``; ``crash_after``: stop abruptly after
    that step (after its metrics row, with no final checkpoint), as a crash would, raising SimulatedCrash."""
    opt, step_fn, state = make_run()
    restored = ckpt_lib.restore_latest(workdir, state)
    state = state if restored is None else restored
    start = int(state.step)
    ckpt = ckpt_lib.Checkpointer(workdir, max_to_keep=2, save_interval_steps=SAVE_EVERY)
    writer = M.MetricsWriter(workdir, start_step=start)
    for s in range(start, total_steps):
        state, key = trainer.split_rng(state)
        batch, reward = sample_batch(key)
        batch = batch.replace(old_logp=behaviour_logp(state.params, batch))
        state, metrics = step_fn(state, batch)
        writer.write(s + 1, dict(metrics, reward=jnp.mean(reward)))
        ckpt.save(state, CONFIG)
        if crash_after is not None and s + 1 == crash_after:
            ckpt.close()  # let the periodic checkpoint land; everything after it is lost
            writer.close()
            raise SimulatedCrash(f"crashed after step {s + 1}")
    ckpt.save(state, CONFIG, force=True)
    ckpt.close()
    writer.close()
    return state


def _subprocess(args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, os.path.abspath(__file__), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def _assert_no_warnings(proc):
    bad = [ln for ln in proc.stderr.splitlines() if "warn" in ln.lower() or "error" in ln.lower()]
    assert not bad, proc.stderr


def test_resume_is_bit_identical(tmp_path, capfd):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    # The reference: 6 straight steps in this process.
    final = run_training(straight, 6)
    assert int(final.step) == 6
    # Interrupted run: 4 steps, periodic checkpoint at 3, "crash" after step 4's metrics row.
    with pytest.raises(SimulatedCrash):
        run_training(resumed, 6, crash_after=4)
    assert [r["step"] for r in M.read_metrics(os.path.join(resumed, "metrics.jsonl"))] == [1, 2, 3, 4]
    out, err = capfd.readouterr()
    assert not [ln for ln in (out + err).splitlines() if "warn" in ln.lower()], out + err
    # Restart in a fresh Python process: restores step 3, drops metrics row 4, runs steps 4..6.
    proc = _subprocess([resumed, 6])
    assert proc.returncode == 0, proc.stderr
    _assert_no_warnings(proc)

    _, _, target = make_run()
    a = ckpt_lib.restore_latest(straight, target)
    b = ckpt_lib.restore_latest(resumed, target)
    assert int(a.step) == int(b.step) == 6
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)  # params, 8-bit moments, counters, rng: all bit-identical
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(final), jax.device_get(a))
    assert a.opt_state[1].mu["w"].codes.dtype == jnp.int8  # quantised moments survived the round trip
    assert not np.allclose(np.asarray(a.params["w"]), np.asarray(target.params["w"]))  # training did move

    rows_r = M.read_metrics(os.path.join(resumed, "metrics.jsonl"))
    rows_s = M.read_metrics(os.path.join(straight, "metrics.jsonl"))
    assert [r["step"] for r in rows_r] == [1, 2, 3, 4, 5, 6]
    assert rows_r == rows_s  # same values too (the rerun step 4 replaced the crashed run's row)
    # max_to_keep=2: checkpoints 3 and 6 remain (the periodic save at 6 and the forced final one coincide).
    assert sorted(int(d) for d in os.listdir(os.path.join(resumed, "checkpoints")) if d.isdigit()) == [3, 6]
    assert ckpt_lib.load_config(resumed) == json.loads(json.dumps(ckpt_lib.to_jsonable(CONFIG)))
    assert ckpt_lib.load_config(resumed)["shape"] == [B, L]


def test_restore_latest_empty_dir(tmp_path):
    _, _, state = make_run()
    assert ckpt_lib.restore_latest(str(tmp_path), state) is None
    assert ckpt_lib.load_config(str(tmp_path)) is None


def test_save_interval_and_force(tmp_path):
    _, _, state = make_run()
    with ckpt_lib.Checkpointer(str(tmp_path), max_to_keep=5, save_interval_steps=2) as ck:
        assert ck.save(state.replace(step=jnp.int32(1)), CONFIG) is False  # not on the interval
        assert ck.save(state.replace(step=jnp.int32(2)), CONFIG) is True
        assert ck.save(state.replace(step=jnp.int32(3)), CONFIG, force=True) is True
        assert ck.save(state.replace(step=jnp.int32(3)), CONFIG, force=True) is False  # already saved
        ck.wait()
        assert ck.all_steps() == [2, 3] and ck.latest_step() == 3
        older = ck.restore(state, step=2)
        assert int(older.step) == 2


def test_restore_into_abstract_target_and_configdict(tmp_path):
    """The training script's pattern: an eval_shape skeleton as target, an ml_collections config."""
    import ml_collections

    opt, _, state = make_run()
    cfg = ml_collections.ConfigDict({"seed": 1, "rl": {"loss": "gspo", "eps": (3e-4, 4e-4)}})
    with ckpt_lib.Checkpointer(str(tmp_path), save_interval_steps=100) as ck:
        ck.save(state.replace(step=jnp.int32(5)), cfg, force=True)
    abstract = jax.eval_shape(lambda p: trainer.create_train_state(p, opt, jax.random.PRNGKey(0)), state.params)
    assert isinstance(abstract.params["w"], jax.ShapeDtypeStruct)
    with ckpt_lib.Checkpointer(str(tmp_path)) as ck:
        restored = ck.restore(abstract)
        assert ck.restore_config() == {"seed": 1, "rl": {"loss": "gspo", "eps": [3e-4, 4e-4]}}
    assert int(restored.step) == 5
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(restored.replace(step=state.step)), jax.device_get(state)
    )


def test_metrics_writer_resume_and_values(tmp_path):
    wd = str(tmp_path)
    with M.MetricsWriter(wd, tensorboard=False) as w:
        for s in range(1, 6):
            w.write(s, {"loss": jnp.float32(s / 10), "nan": float("nan"), "n": np.int32(s), "ok": True})
        with pytest.raises(ValueError, match="not after"):
            w.write(5, {"loss": 0.0})
        with pytest.raises(TypeError, match="numeric scalar"):
            w.write(6, {"vec": np.ones(3)})
    rows = M.read_metrics(os.path.join(wd, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2] == {"step": 3, "loss": pytest.approx(0.3), "nan": None, "n": 3, "ok": True}
    with open(os.path.join(wd, "metrics.jsonl"), "a") as f:
        f.write('{"step": 6, "lo')  # a torn last line from a crash
    with M.MetricsWriter(wd, start_step=3, tensorboard=False) as w:
        w.write(4, {"loss": 1.0})
    assert [r["step"] for r in M.read_metrics(os.path.join(wd, "metrics.jsonl"))] == [1, 2, 3, 4]
    with M.MetricsWriter(wd, tensorboard=False):  # a fresh run starts an empty file
        pass
    assert M.read_metrics(os.path.join(wd, "metrics.jsonl")) == []


def test_tensorboard_and_plot(tmp_path):
    wd = str(tmp_path)
    with M.MetricsWriter(wd) as w:
        for s in range(1, 21):
            w.write(s, {"loss": 1.0 / s, "reward": np.float32(s % 5), "grad_norm": 0.5})
    tb_dir = os.path.join(wd, "tensorboard")
    events = [f for f in os.listdir(tb_dir) if f.startswith("events.out.tfevents")]
    assert events and os.path.getsize(os.path.join(tb_dir, events[0])) > 100
    from tensorboardX.event_file_writer import EventFileWriter  # noqa: F401  (tensorboardX is importable)

    png = M.plot_learning_curves(
        os.path.join(wd, "metrics.jsonl"),
        os.path.join(wd, "plots", "curves.png"),
        keys=["loss", "reward", "grad_norm", "missing"],
        smoothing=0.6,
    )
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[0] > 400 and img.shape[1] > 700  # a 2x3 grid of readable panels
    assert img[..., :3].std() > 0.05  # not blank
    with pytest.raises(ValueError, match="nothing to plot"):
        M.plot_learning_curves(os.path.join(wd, "nope.jsonl"), os.path.join(wd, "x.png"))


def test_curve_plotter_draws_in_the_background_and_ends_with_every_row(tmp_path, monkeypatch):
    wd = str(tmp_path)
    jsonl, png = os.path.join(wd, "metrics.jsonl"), os.path.join(wd, "curves.png")
    release = threading.Event()
    draw = M.plot_learning_curves

    def held_draw(*args, **kwargs):  # the first drawing stays in flight until the test lets it go
        release.wait(timeout=60)
        return draw(*args, **kwargs)

    monkeypatch.setattr(M, "plot_learning_curves", held_draw)
    plotter = M.CurvePlotter(jsonl, png, keys=["loss"])
    with M.MetricsWriter(wd, tensorboard=False) as w:
        for s in range(1, 6):
            w.write(s, {"loss": 1.0 / s, "reward": float(s)})
        assert plotter.request()
        assert plotter.busy() and not plotter.request()  # at most one drawing in flight
        release.set()
        for s in range(6, 400):
            w.write(s, {"loss": 1.0 / s, "reward": float(s)})
        plotter.close(keys=["loss", "reward"])
    assert not plotter.busy()
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[1] > 500 and img[..., :3].std() > 0.05  # two panels: the keys given to close()
    assert [f for f in os.listdir(wd) if f.endswith(".tmp")] == []  # written by rename, nothing left over


def test_curve_plotter_hands_a_drawing_error_to_the_caller(tmp_path):
    plotter = M.CurvePlotter(os.path.join(str(tmp_path), "none.jsonl"), os.path.join(str(tmp_path), "c.png"))
    plotter.request()  # the thread fails: no metric keys in a missing file
    with pytest.raises(ValueError, match="nothing to plot"):
        plotter.close(final=False)
    assert not os.path.exists(os.path.join(str(tmp_path), "c.png"))


if __name__ == "__main__":  # subprocess entry point: WORKDIR TOTAL_STEPS
    run_training(sys.argv[1], int(sys.argv[2]))
