"""Helpers of tests/test_sharded_io.py, and the script it runs in fresh processes with other device counts.

  python tests/_sharded_io.py eight OUT      # 8 CPU devices: sharded init, load and save, a checkpoint written
                                             # on (data 2, fsdp 2, expert 2) / fsdp_ep; host values under OUT
  python tests/_sharded_io.py four RUN OUT   # 4 CPU devices: RUN's one-device checkpoint restored onto fsdp 4
  python tests/_sharded_io.py process ADDRESS ID   # one of 2 processes (2 CPU devices each): init and load onto
                                                   # an fsdp mesh over both (tests/test_multihost.py)

Each prints one JSON line of findings; the arrays it wrote go to OUT as .npz files (bf16 as its uint16 bits).
"""

from __future__ import annotations

import functools
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from reno_jax import parallel
from reno_jax.checkpoint import orbax as ckpt_lib  # noqa: E402
from reno_jax.loop import build, recipe, runs
from reno_jax.models import conversion, ling3  # noqa: E402
from reno_jax.rl import trainer  # noqa: E402

GOLDEN = os.path.join(REPO, "tests", "data", "ling3_tiny_a")
MODEL = ling3.tiny_test_config(num_hidden_layers=2)  # KDA + dense MLP, MLA + MoE: every layer kind
EP_MESH = dict(data=2, fsdp=2, expert=2)


def host_tree(tree) -> dict[str, np.ndarray]:
    """{path: host array} of a pytree (bf16 as its uint16 bits, so .npz files and comparisons are bit-exact)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = np.asarray(jax.device_get(leaf))
        out[jax.tree_util.keystr(path)] = x.view(np.uint16) if x.dtype == jnp.bfloat16 else x
    return out


def patterned(state: trainer.TrainState) -> trainer.TrainState:
    """The state with every non-parameter leaf (moments, int8 codes, scales, counters, key) set to a fixed
    non-zero pattern on its own sharding, so that a restore has something to get wrong; no training needed."""

    def fill(x):
        values = (np.arange(x.size) * 7 % 23 - 11).reshape(x.shape)
        values = np.abs(values) if np.issubdtype(x.dtype, np.unsignedinteger) else values
        host = values.astype(x.dtype)
        return jax.make_array_from_callback(x.shape, x.sharding, lambda index: host[index])

    step = jax.device_put(jnp.int32(7), state.step.sharding)
    return state.replace(opt_state=jax.tree.map(fill, state.opt_state), step=step, rng=fill(state.rng))


def run_config(**model):
    """The default run config with a small model, int8 Adam moments (so quantised moments are saved too)."""
    from configs import tictactoe_tiny

    c = tictactoe_tiny.get_config()
    c.model.tiny.num_hidden_layers = 2
    c.model.tiny.update(model)
    c.sft.num_steps = 0
    c.rl.optimizer_state_dtype = "int8"
    return c


def optimizer():
    """The run config's optimiser: AdamW with int8 moments (quantised moments are saved and sharded too)."""
    return recipe.make_optimizer(run_config())


def abstract_state(params):
    """The train state's `jax.ShapeDtypeStruct` skeleton for (abstract) `params` with `optimizer()`."""
    return jax.eval_shape(lambda p: trainer.create_train_state(p, optimizer(), 0), params)


def train_state(config, layout: parallel.Layout | None = None):
    """(model_config, a patterned train state of `config`'s model, placed on `layout`), as train.py builds it."""
    tokenizer = build.build_tokenizer(config)
    model_config, params = build.build_model(config, jax.random.PRNGKey(0), tokenizer, layout)
    state = trainer.create_train_state(params, recipe.make_optimizer(config), jax.random.PRNGKey(1))
    return model_config, patterned(state if layout is None else layout.place_state(state))


def _placed(tree, shardings) -> bool:
    return all(leaf.sharding == s for leaf, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def eight(out: str) -> dict:
    assert jax.device_count() == 8, jax.devices()
    found: dict = {}
    ep_mesh = parallel.make_mesh(parallel.MeshConfig(**EP_MESH, preset="fsdp_ep"))
    fsdp_mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=8, preset="fsdp"))

    # Init straight onto the mesh: the preset's shardings and the values the one-device init gives (the parent
    # compares the file with its own init; here, the unsharded init of this process, drawn by the whole-model route).
    ep = parallel.param_shardings(MODEL, ep_mesh, "fsdp_ep")
    params = ling3.init_params(MODEL, jax.random.PRNGKey(0), shardings=ep)
    typed = ling3.init_params(MODEL, jax.random.key(0), shardings=ep)
    np.savez(os.path.join(out, "init_fsdp_ep.npz"), **host_tree(params))
    unsharded = host_tree(ling3.init_params(MODEL, jax.random.PRNGKey(0)))
    found["init"] = dict(
        placed=_placed(params, ep) and _placed(typed, ep),
        sharded_leaves=sum(not s.is_fully_replicated for s in jax.tree.leaves(ep)),
        expert_spec=str(params["model"]["layers_1"]["mlp"]["experts"]["gate_proj"].sharding.spec),
        unsharded_equal=all(np.array_equal(a, unsharded[k]) for k, a in host_tree(params).items()),
        typed_key_equal=all(np.array_equal(a, unsharded[k]) for k, a in host_tree(typed).items()),
    )

    # The real Ling-3.0-tiny shape: traced without drawing (abstract values carry no shardings, so without them:
    # tracing is then quicker), and the programs of its largest leaves compiled for the fsdp_ep mesh and for one
    # device: each device's output is its shard, and its temporaries (on CPU, JAX's threefry is a rolled loop whose
    # state is a few leaf-size buffers) are the one-device program's divided by the shard count.
    real = ling3.ling3_tiny_real()
    real_shardings = parallel.param_shardings(real, ep_mesh, "fsdp_ep")
    abstract = jax.eval_shape(lambda k: ling3.init_params(real, k, jnp.bfloat16), jax.random.PRNGKey(0))
    programs = []
    for path in (("model", "layers_1", "mlp", "experts", "gate_proj"), ("model", "word_embeddings", "embedding")):
        leaf, sharding = conversion._get_leaf(abstract, path), conversion._get_leaf(real_shardings, path)
        memory = {}
        for name, s in (("sharded", sharding), ("whole", None)):
            lowered = ling3._leaf_program(leaf.shape, True, leaf.dtype, s, None).lower(
                np.zeros(2, np.uint32), np.uint32(0), np.float32(0.02), np.float32(0.0), np.int32(0)
            )
            memory[name] = lowered.compile().memory_analysis()
        programs.append(
            dict(
                path="/".join(path),
                leaf_bytes=int(np.prod(leaf.shape)) * leaf.dtype.itemsize,
                shards=int(np.prod([ep_mesh.shape[a] for a in sharding.spec if a])),
                output_bytes=int(memory["sharded"].output_size_in_bytes),
                temp_bytes=int(memory["sharded"].temp_size_in_bytes),
                whole_temp_bytes=int(memory["whole"].temp_size_in_bytes),
            )
        )
    found["real"] = dict(abstract_ok=abstract == conversion.abstract_params(real, jnp.bfloat16), programs=programs)

    # The golden checkpoint loaded onto shards under both presets: every shard reads only its block, once.
    reads = []  # (tensor name, block shape) of every read
    read_block = conversion._read_block

    def logged(file, handle, name, st_dtype, index):
        shape = handle.get_slice(name).get_shape()
        reads.append((name, tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))))
        return read_block(file, handle, name, st_dtype, index)

    conversion._read_block = logged
    try:
        config, want = conversion.from_pretrained(GOLDEN)  # one device
        full_reads = len(reads)
        loads = {}
        for name, mesh, preset in (("fsdp", fsdp_mesh, "fsdp"), ("fsdp_ep", ep_mesh, "fsdp_ep")):
            del reads[:]
            _, got = conversion.from_pretrained(
                GOLDEN, shardings=functools.partial(parallel.param_shardings, mesh=mesh, preset=preset)
            )
            shardings = parallel.param_shardings(config, mesh, preset)
            equal = all(np.array_equal(a, b) for a, b in zip(host_tree(got).values(), host_tree(want).values()))
            loads[name] = dict(
                placed=_placed(got, shardings),
                equal=equal,
                reads=len(reads),
                full_reads=full_reads,
                experts_read=sum(".experts." in n for n, _ in reads),
            )
            if name == "fsdp_ep":  # the expert stack [E, D, Im] of layer 1 over expert 2 x fsdp 2: quarter blocks
                loads[name]["expert_blocks"] = sorted(
                    {b for n, b in reads if n == "model.layers.1.mlp.experts.0.gate_proj.weight"}
                )
                sharded = got
    finally:
        conversion._read_block = read_block
    found["load"] = loads

    # Saved from the shards (one shard on the host at a time); the parent compares the files with the golden.
    conversion.save_pretrained(sharded, config, os.path.join(out, "hf_from_shards"))

    # A checkpoint written on 8 devices (the parent restores it onto one): the model above with int8 Adam moments.
    layout = parallel.Layout(ep_mesh, "fsdp_ep", ep)
    state = patterned(layout.place_state(trainer.create_train_state(params, optimizer(), jax.random.PRNGKey(1))))
    with ckpt_lib.Checkpointer(os.path.join(out, "run8"), async_save=False) as ckpt:
        ckpt.save(state, {"model": "tests/_sharded_io.MODEL"}, force=True)
    np.savez(os.path.join(out, "state8.npz"), **host_tree(state))
    found["checkpoint"] = dict(
        step=int(state.step),
        sharded_leaves=sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state)),
        placed=_placed(state, layout.state_shardings(state)),
    )
    return found


def four(run: str, out: str) -> dict:
    """RUN's one-device checkpoint restored onto fsdp 4 the way `experiments.evaluate --mesh` does it, and as a
    whole train state the way a resumed run on that mesh does."""
    from experiments import cli

    assert jax.device_count() == 4, jax.devices()
    mesh_config = cli.mesh_from_flags("fsdp=4,preset=fsdp", 8)
    _, _, model_config, params, step = runs.load_run(run, mesh_config=mesh_config)
    layout = parallel.Layout.create(model_config, mesh_config)
    config = run_config()
    abstract = abstract_state(build.abstract_model(config, build.build_tokenizer(config))[1])
    with ckpt_lib.Checkpointer(run, async_save=False) as ckpt:
        state = ckpt.restore(layout.abstract_state(abstract))
    np.savez(os.path.join(out, "state4.npz"), **host_tree(state))
    return dict(
        step=step,
        mesh=dict(layout.mesh.shape),
        params_placed=_placed(params, layout.param_shardings),
        state_placed=_placed(state, layout.state_shardings(state)),
        sharded_leaves=sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state)),
    )


def process(address: str, process_id: str) -> dict:
    """Process `process_id` of 2: the model drawn and the golden checkpoint read straight onto fsdp 4 over both
    processes' devices; this process's shards against its own one-device init and load."""
    jax.distributed.initialize(coordinator_address=address, num_processes=2, process_id=int(process_id))
    mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, preset="fsdp"))

    def same_shards(sharded, whole) -> bool:
        return all(
            np.array_equal(np.asarray(shard.data), np.asarray(w)[shard.index])
            for x, w in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole))
            for shard in x.addressable_shards
        )

    shardings = parallel.param_shardings(MODEL, mesh, "fsdp")
    params = ling3.init_params(MODEL, jax.random.PRNGKey(0), shardings=shardings)
    _, loaded = conversion.from_pretrained(  # the golden checkpoint's own config, not MODEL
        GOLDEN, shardings=functools.partial(parallel.param_shardings, mesh=mesh, preset="fsdp")
    )
    return dict(
        process=jax.process_index(),
        devices=jax.device_count(),
        placed=_placed(params, shardings),
        sharded_leaves=sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params)),
        init_equal=same_shards(params, ling3.init_params(MODEL, jax.random.PRNGKey(0))),
        load_equal=same_shards(loaded, conversion.from_pretrained(GOLDEN)[1]),
    )


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    print(json.dumps({"eight": eight, "four": four, "process": process}[mode](*args)))
