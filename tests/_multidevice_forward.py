"""Run in a fresh process with 8 CPU devices (tests/test_parallel.py sets XLA_FLAGS): the tiny model's forward
and decode on two meshes and presets vs one device, three GSPO train steps on a sharded state vs one device, and
the placement of int8 Adam moments. Prints one JSON line of results."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from reno_jax import errors, parallel
from reno_jax.loop import config as loop_config
from reno_jax.models import layers, ling3
from reno_jax.rl import losses, policy, trainer
from reno_jax.rl.batch import TrainBatch
from reno_jax.sharding.axes import MESH_AXES

MESHES = (  # (mesh sizes, preset): every mesh axis, the expert- and the tensor-parallel preset (fsdp is in both)
    (dict(data=2, fsdp=2, expert=2), "fsdp_ep"),
    (dict(fsdp=2, tensor=4), "fsdp_tp"),
)


def main():
    assert jax.device_count() == 8, jax.devices()
    config = ling3.tiny_test_config(num_hidden_layers=2)  # KDA + dense MLP, MLA + MoE: every layer kind
    params = ling3.init_params(config, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 12), 0, config.vocab_size)
    step_ids = jax.random.randint(jax.random.PRNGKey(2), (8, 1), 0, config.vocab_size)

    def forward_and_decode(p, t, s):
        logits, _ = ling3.forward(p, config, t)
        cache = ling3.init_cache(config, t.shape[0], 16)
        _, cache = ling3.forward(p, config, t, cache)
        step_logits, _ = ling3.forward(p, config, s, cache)
        return logits, step_logits

    fn = jax.jit(forward_and_decode)
    want = jax.device_get(fn(params, tokens, step_ids))
    results = []
    for sizes, preset in MESHES:
        mesh = parallel.make_mesh(parallel.MeshConfig(**sizes, preset=preset))
        shardings = parallel.param_shardings(config, mesh, preset)
        sharded = jax.device_put(params, shardings)
        batch = parallel.batch_sharding(mesh, 2)
        with jax.set_mesh(mesh):  # as the training loop traces (Layout.activate): constraints see the mesh
            got = jax.device_get(
                jax.jit(forward_and_decode)(sharded, jax.device_put(tokens, batch), jax.device_put(step_ids, batch))
            )
        placed = all(leaf.sharding == s for leaf, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(shardings)))
        split = sum(int(not s.is_fully_replicated) for s in jax.tree.leaves(shardings))
        results.append(
            dict(
                mesh=sizes,
                preset=preset,
                placed=placed,
                sharded_leaves=split,
                forward_max_abs=float(np.max(np.abs(got[0] - want[0]))),
                decode_max_abs=float(np.max(np.abs(got[1] - want[1]))),
            )
        )
    return results


def train_steps(num_steps=3):
    """Three SGD train steps (2 micro-batches) on (data 2, fsdp 2, expert 2) / fsdp_ep vs one device: the largest
    per-leaf relative L2 difference of the parameters (SGD shows the sharded gradients as they are; Adam would
    divide each element by its own second moment and turn float rounding of ~0 gradients into up to a learning
    rate of difference). Also where an AdamW state with int8 moments lands when it follows the parameters."""
    config = ling3.tiny_test_config(num_hidden_layers=2)  # KDA + dense MLP, MLA + MoE: every layer kind
    params = ling3.init_params(config, jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(3)
    b, length = 8, 10
    batch = TrainBatch(
        tokens=jax.random.randint(key, (b, length), 0, config.vocab_size),
        loss_mask=jnp.arange(length)[None, :].repeat(b, 0) >= 4,
        old_logp=jnp.full((b, length), -4.0, jnp.float32),
        advantages=jnp.linspace(-1.0, 1.0, b, dtype=jnp.float32),
    )
    optimizer = optax.sgd(0.1)
    step = trainer.make_train_step(
        policy.make_logp_fn(config, with_entropy=False), losses.gspo_loss, optimizer, num_microbatches=2, donate=False
    )

    def run(state, batch):
        for _ in range(num_steps):
            state, _ = step(state, batch)
        return state

    want = jax.device_get(run(trainer.create_train_state(params, optimizer, 0), batch).params)
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=2, expert=2, preset="fsdp_ep"))
    p_shard = parallel.param_shardings(config, mesh, "fsdp_ep")
    sharded_batch = jax.tree.map(lambda v: jax.device_put(v, parallel.batch_sharding(mesh, v.ndim)), batch)
    step = trainer.make_train_step(
        policy.make_logp_fn(config, with_entropy=False), losses.gspo_loss, optimizer, num_microbatches=2, donate=False
    )  # traced again, with the mesh active
    with jax.set_mesh(mesh):
        got = jax.device_get(
            run(trainer.create_train_state(jax.device_put(params, p_shard), optimizer, 0), sharded_batch).params
        )
    rel = max(
        float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )
    moved = max(
        float(np.linalg.norm(w - p) / np.linalg.norm(p)) for w, p in zip(jax.tree.leaves(want), jax.tree.leaves(params))
    )

    adam = trainer.make_optimizer(3e-3, 3e-4, 0, 10, state_dtype="int8", quant_block_size=64, quant_min_size=1024)
    state = trainer.create_train_state(jax.device_put(params, p_shard), adam, 0)
    state_shardings = parallel.follow_params(state, p_shard, mesh)
    state = jax.device_put(state, state_shardings)
    follow = all(leaf.sharding == s for leaf, s in zip(jax.tree.leaves(state), jax.tree.leaves(state_shardings)))
    by_path = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(state_shardings)[0]}
    quantized = [k for k, s in by_path.items() if k.endswith(".codes") and not s.is_fully_replicated]
    mu_experts = [
        s.spec for k, s in by_path.items() if "['mlp']['experts']['gate_proj']" in k and ".codes" in k and "mu" in k
    ]
    return dict(
        params_max_rel_diff=rel,
        params_moved=moved,
        moments_follow=follow,
        sharded_quantized_moments=len(quantized),
        expert_moment_specs=[list(map(str, s)) for s in mu_experts],
    )


def replay_under_expert_parallelism():
    """Routing replay (replayed expert ids, every third token routed normally) on (data 2, fsdp 2, expert 2) /
    fsdp_ep vs one device, and how much the replayed ids change the logits (so the check has teeth)."""
    config = ling3.tiny_test_config(num_hidden_layers=2)
    params = ling3.init_params(config, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 12), 0, config.vocab_size)
    shape = (8, 12, len(ling3.moe_layer_indices(config)), config.num_experts_per_tok)
    replay = jax.random.randint(jax.random.PRNGKey(2), shape, 0, config.num_experts).at[:, ::3].set(-1)
    fn = jax.jit(lambda p, t, r: ling3.forward(p, config, t, replay_experts=r)[0])
    want = np.asarray(fn(params, tokens, replay))
    plain = np.asarray(jax.jit(lambda p, t: ling3.forward(p, config, t)[0])(params, tokens))
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=2, expert=2, preset="fsdp_ep"))
    fn = jax.jit(lambda p, t, r: ling3.forward(p, config, t, replay_experts=r)[0])
    with jax.set_mesh(mesh):
        got = np.asarray(
            fn(
                jax.device_put(params, parallel.param_shardings(config, mesh, "fsdp_ep")),
                jax.device_put(tokens, parallel.batch_sharding(mesh, 2)),
                jax.device_put(replay, parallel.batch_sharding(mesh, 4)),
            )
        )
    return dict(max_abs_diff=float(np.abs(got - want).max()), replay_effect=float(np.abs(want - plain).max()))


def grouped_blocked_dispatch():
    """The blocked MoE dispatch run per device's rows (`layers._dispatch_groups`) on fsdp 2 / fsdp and expert 2 /
    fsdp_ep vs one device's global dispatch and the dense reference: outputs and gradients (w.r.t. the tokens and
    the expert weights)."""
    config = ling3.tiny_test_config(
        num_hidden_layers=2,
        num_experts=32,
        n_group=4,
        topk_group=2,
        hidden_size=16,
        moe_intermediate_size=8,
        moe_shared_expert_intermediate_size=8,
    )
    p = ling3.init_params(config, jax.random.PRNGKey(0))["model"]["layers_1"]["mlp"]
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 1024, 16), jnp.float32)

    def loss(p, x, dense):
        y = layers.moe(p, x, config, dense_reference=dense)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))), y

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
    (gp_ref, gx_ref), y_ref = jax.jit(lambda p, x: grad(p, x, True))(p, x)
    (gp_one, gx_one), y_one = jax.jit(lambda p, x: grad(p, x, False))(p, x)
    small = x[:, :4]  # a decode-sized call (8 rows): the ragged dispatch on one device
    small_one = jax.jit(lambda p, x: layers.moe(p, x, config))(p, small)
    diff = lambda a, b: max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))  # noqa: E731
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    out = []
    for shape, preset in (((1, 2, 1, 1), "fsdp"), ((1, 1, 2, 1), "fsdp_ep")):
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]).reshape(shape), MESH_AXES)
        shardings = parallel.param_shardings(config, mesh, preset)["model"]["layers_1"]["mlp"]
        with jax.set_mesh(mesh):
            groups = layers._dispatch_groups(2048, config.num_experts_per_tok, config.num_experts)
            (gp, gx), y = jax.jit(lambda p, x: grad(p, x, False))(
                jax.device_put(p, shardings), jax.device_put(x, parallel.batch_sharding(mesh, 3))
            )
            dense_decode = layers._expert_split_mesh()
            small_got = jax.jit(lambda p, x: layers.moe(p, x, config))(
                jax.device_put(p, shardings), jax.device_put(small, parallel.batch_sharding(mesh, 3))
            )
        out.append(
            dict(
                preset=preset,
                groups=groups,
                experts_split=str(shardings["experts"]["gate_proj"].spec),
                dense_decode=dense_decode,
                decode_vs_one_device=diff(small_got, small_one),
                vs_one_device=max(diff(y, y_one), diff(gx, gx_one), diff(gp, gp_one)),
                vs_dense=max(diff(y, y_ref), diff(gx, gx_ref), diff(gp, gp_ref)),
                one_device_vs_dense=max(diff(y_one, y_ref), diff(gp_one, gp_ref)),
            )
        )
    return out


def batch_split_errors():
    """The one-line errors for a batch that does not split over the batch axes of an 8-device mesh: the train
    config's episode groups and warm-start rows, and `experiments.evaluate --batch_size`."""
    from configs import tictactoe_tiny
    from experiments import cli

    messages = {}
    c = tictactoe_tiny.get_config()
    c.mesh.data, c.mesh.fsdp, c.mesh.expert = 2, 2, 2
    c.rl.train_groups = 0
    for name, boards, sft_rows in (("boards", 12, 64), ("sft", 16, 12)):
        c.rollout.boards_per_step, c.sft.batch_size = boards, sft_rows
        try:
            loop_config.validate_config(c)
        except errors.ConfigError as error:
            messages[name] = str(error)
    try:
        cli.mesh_from_flags("data=4,fsdp=2", batch_size=12)
    except cli.UserError as error:
        messages["evaluate"] = str(error)
    messages["evaluate_ok"] = cli.mesh_from_flags("data=4,fsdp=2", batch_size=16).sizes()
    return messages


if __name__ == "__main__":
    print(
        json.dumps(
            {
                "forward": main(),
                "train": train_steps(),
                "replay": replay_under_expert_parallelism(),
                "grouped_moe": grouped_blocked_dispatch(),
                "batch_split_errors": batch_split_errors(),
            }
        )
    )
