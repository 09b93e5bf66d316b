"""Tests for reno_jax.models.lora: adapters on the Ling-3.0 params dict, applied in the layer or merged."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # what autodiff keeps for the backward pass

from reno_jax.models import layers, ling3, lora, quant

CONFIG = ling3.tiny_test_config()
R = 3  # no weight dimension of the tiny model is 3, so adapter shapes never coincide with weight shapes


@pytest.fixture(scope="module")
def model():
    params = ling3.init_params(CONFIG, jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, CONFIG.vocab_size)
    return params, ids


def _perturb(adapters, key=7, eps=0.05):
    """Adapters with B != 0 (and A moved too), so that the adapted model differs from the base."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(key), len(leaves))
    return jax.tree.unflatten(tree, [v + eps * jax.random.normal(k, v.shape) for v, k in zip(leaves, keys)])


def _forward(config: lora.LoraConfig, ids, remat=False):
    return jax.jit(
        lambda params, adapters: ling3.forward(lora.apply(params, adapters, config), CONFIG, ids, remat=remat)[0]
    )


def test_config_checks():
    assert lora.LoraConfig(rank=8, alpha=16.0).scale == 2.0
    assert lora.LoraConfig().rank == 0 and lora.LoraConfig().targets == lora.TARGETS
    with pytest.raises(ValueError, match="rank"):
        lora.LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        lora.LoraConfig(rank=2, targets=("router",))
    with pytest.raises(ValueError, match="expert_adapters"):
        lora.LoraConfig(rank=2, expert_adapters="per_group")


def test_adapter_shapes_per_expert_and_shared(model):
    params, _ = model
    e, d, im = CONFIG.num_experts, CONFIG.hidden_size, CONFIG.moe_intermediate_size
    per = lora.init_adapters(params, lora.LoraConfig(rank=R), jax.random.key(2))
    shared = lora.init_adapters(params, lora.LoraConfig(rank=R, expert_adapters="shared"), jax.random.key(2))
    ex, sx = per["model"]["layers_1"]["mlp"]["experts"], shared["model"]["layers_1"]["mlp"]["experts"]
    chex.assert_shape(
        [ex["gate_proj"]["a"], ex["gate_proj"]["b"], ex["down_proj"]["a"], ex["down_proj"]["b"]],
        [(e, d, R), (e, R, im), (e, im, R), (e, R, d)],
    )
    chex.assert_shape(
        [sx["up_proj"]["a"], sx["up_proj"]["b"], sx["down_proj"]["a"], sx["down_proj"]["b"]],
        [(d, R), (R, im), (im, R), (R, d)],
    )
    q = per["model"]["layers_1"]["attention"]["q_a_proj"]["kernel"]  # layer 1 is MLA
    chex.assert_shape([q["a"], q["b"]], [(d, R), (R, CONFIG.q_lora_rank)])
    # B = 0, A random within U(-1/sqrt(in), 1/sqrt(in)), float32
    for path, leaf in lora._walk(per):
        assert leaf.dtype == jnp.float32
        if path[-1] == "b":
            np.testing.assert_array_equal(leaf, 0)
        else:
            assert 0 < np.abs(leaf).max() <= 1 / np.sqrt(leaf.shape[-2])
    # what is adapted: every projection kind, never the router, convs, norms, embeddings or lm_head
    kinds = {lora.projections(params)[p[:-1]] for p, _ in lora._walk(per)}
    assert kinds == set(lora.TARGETS)
    counts = lora.count_adapter_params(params, lora.LoraConfig(rank=R))
    counts_shared = lora.count_adapter_params(params, lora.LoraConfig(rank=R, expert_adapters="shared"))
    assert counts["total"] == sum(x.size for x in jax.tree.leaves(per))
    assert counts["experts"] == e * counts_shared["experts"]
    assert counts["kda"] == counts_shared["kda"] > 0
    only = lora.init_adapters(params, lora.LoraConfig(rank=R, targets=("mla",)), jax.random.key(2))
    assert sorted(only["model"]) == ["layers_1", "layers_3"] and list(only["model"]["layers_1"]) == ["attention"]
    # shapes only: works on ShapeDtypeStructs
    abstract = jax.eval_shape(
        lambda: lora.init_adapters(jax.eval_shape(lambda: params), lora.LoraConfig(rank=R), jax.random.key(2))
    )
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, per)
    # rank 0: off
    assert lora.init_adapters(params, lora.LoraConfig(), jax.random.key(2)) == {}
    assert lora.apply(params, {}, lora.LoraConfig()) is params
    with pytest.raises(ValueError, match="do not match"):
        lora.apply(params, only, lora.LoraConfig(rank=R))


@pytest.mark.parametrize("expert_adapters", ["per_expert", "shared"])
def test_forward_zero_b_is_base_and_merge_matches(model, expert_adapters):
    params, ids = model
    config = lora.LoraConfig(rank=R, alpha=6.0, expert_adapters=expert_adapters)
    adapters = lora.init_adapters(params, config, jax.random.key(3))
    fwd = _forward(config, ids)
    base = jax.jit(lambda p: ling3.forward(p, CONFIG, ids)[0])(params)
    np.testing.assert_array_equal(fwd(params, adapters), base)  # B = 0: exactly the base model
    moved = _perturb(adapters)
    adapted = fwd(params, moved)
    assert np.abs(adapted - base).max() > 1e-2  # the adapters do something
    merged = lora.merge(params, moved, config)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    chex.assert_trees_all_equal_shapes_and_dtypes(merged, params)
    np.testing.assert_allclose(jax.jit(lambda p: ling3.forward(p, CONFIG, ids)[0])(merged), adapted, atol=1e-5, rtol=0)


@pytest.mark.parametrize("expert_adapters", ["per_expert", "shared"])
def test_every_moe_dispatch_applies_expert_adapters(expert_adapters):
    """ragged, blocked and dense-reference dispatches (the model on CPU only runs the last) give the merged
    experts' result with a LoraKernel, jitted."""
    params = ling3.init_params(CONFIG, jax.random.key(0))
    config = lora.LoraConfig(rank=R, targets=("experts",), expert_adapters=expert_adapters)
    moved = _perturb(lora.init_adapters(params, config, jax.random.key(4)))
    p_lora = lora.apply(params, moved, config)["model"]["layers_1"]["mlp"]["experts"]
    p_merged = lora.merge(params, moved, config)["model"]["layers_1"]["mlp"]["experts"]
    p_base = params["model"]["layers_1"]["mlp"]["experts"]
    assert isinstance(p_lora["gate_proj"], lora.LoraKernel)
    n, k = 40, CONFIG.num_experts_per_tok
    x = jax.random.normal(jax.random.key(5), (n, CONFIG.hidden_size))
    weights = jax.nn.softmax(jax.random.normal(jax.random.key(6), (n, k)))
    experts = jax.random.randint(jax.random.key(8), (n, k), 0, CONFIG.num_experts)
    for fn in (layers.moe_experts, lambda *a: layers.moe_experts_blocked(*a, block_rows=8), layers.moe_dense_reference):
        run = jax.jit(fn)
        want = run(p_merged, x, weights, experts)
        np.testing.assert_allclose(run(p_lora, x, weights, experts), want, atol=1e-5, rtol=0)
        assert np.abs(want - run(p_base, x, weights, experts)).max() > 1e-2


def test_gradients_reach_adapters_only(model):
    params, ids = model
    config = lora.LoraConfig(rank=R)
    adapters = lora.init_adapters(params, config, jax.random.key(3))

    def loss(ad, p):
        return ling3.token_logprobs(lora.apply(p, ad, config), CONFIG, ids).mean()

    grad = jax.jit(jax.grad(loss))
    g0 = grad(adapters, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(g0, adapters)  # a gradient for the adapter tree, nothing else
    for path, leaf in lora._walk(g0):
        if path[-1] == "b":
            assert np.abs(leaf).max() > 0, path  # every B learns from the first step
        else:
            np.testing.assert_array_equal(leaf, 0)  # dL/dA = x^T dy B^T = 0 while B = 0
    g1 = grad(_perturb(adapters), params)
    for path, leaf in lora._walk(g1):
        assert np.abs(leaf).max() > 0, path
    # vmap over a population of adapters sharing one base: each member's gradient is its own
    pop = jax.tree.map(lambda a, b: jnp.stack([a, b]), adapters, _perturb(adapters))
    g_pop = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(pop, params)
    # (vmap batches the einsums differently: float32 sums in another order, ~1e-6 apart on entries near 1e-3)
    chex.assert_trees_all_close(jax.tree.map(lambda v: v[1], g_pop), g1, atol=1e-5, rtol=1e-4)


def test_int8_base_backward_keeps_no_dequantized_weight_with_remat(model):
    """QLoRA: adapters on an int8 base. Under remat the backward pass recomputes each layer's dequantized weights
    (only the lm_head, outside the layers, is kept); without it every dequantized weight is saved, a float copy
    of the model (the reason the docs say to train with remat)."""
    params, ids = model
    config = lora.LoraConfig(rank=R)
    adapters = _perturb(lora.init_adapters(params, config, jax.random.key(3)))
    q = quant.quantize(params)
    np.testing.assert_allclose(
        _forward(config, ids)(q, adapters), _forward(config, ids)(quant.dequantize(q), adapters), atol=1e-5, rtol=0
    )
    shapes = {tuple(v.shape) for _, v in lora._walk(q) if isinstance(v, quant.QArray)}

    def float_copies(remat):
        res = saved_residuals(
            lambda ad: ling3.forward(lora.apply(q, ad, config), CONFIG, ids, remat=remat)[0].sum(), adapters
        )
        return [
            aval.shape for aval, _ in res if tuple(aval.shape) in shapes and jnp.issubdtype(aval.dtype, jnp.floating)
        ]

    assert len(float_copies(False)) >= len(shapes)
    assert float_copies(True) == [(CONFIG.hidden_size, CONFIG.vocab_size)]  # lm_head only
    # merge onto the int8 base: float weights where adapted, the rest stays quantized
    merged = lora.merge(q, adapters, config)
    exp = lora._get(merged, ("model", "layers_1", "mlp", "experts", "up_proj"))
    assert exp.dtype == jnp.float32 and not isinstance(exp, quant.QArray)
    assert isinstance(merged["lm_head"]["kernel"], quant.QArray)


def test_token_table_adapters(model):
    """Opt-in adapters on the embedding (rows gathered with the tokens) and lm_head (a low-rank term on the
    logits): B = 0 is the base bit for bit, the adapted model equals the merged one and the gradient reaches them
    (on an int8 base: the LoRA run of tests/test_experiments.py, whose export is the merged model)."""
    params, ids = model
    config = lora.LoraConfig(rank=R, targets=lora.TABLE_TARGETS)
    adapters = lora.init_adapters(params, config, jax.random.key(3))
    assert sorted(p for p, _ in lora._pairs(params, adapters)) == [
        ("lm_head", "kernel"),
        ("model", "word_embeddings", "embedding"),
    ]
    forward = _forward(config, ids)
    base = jax.jit(lambda p: ling3.forward(p, CONFIG, ids)[0])
    np.testing.assert_array_equal(forward(params, adapters), base(params))
    moved = _perturb(adapters, eps=0.3)
    want = base(lora.merge(params, moved, config))
    assert np.abs(want - base(params)).max() > 1e-2
    np.testing.assert_allclose(forward(params, moved), want, atol=1e-5, rtol=1e-6)  # logits up to ~40
    grads = jax.jit(jax.grad(lambda ad: ling3.token_logprobs(lora.apply(params, ad, config), CONFIG, ids).mean()))(
        adapters
    )
    assert all(
        np.abs(g["b"]).max() > 0 for g in (grads["lm_head"]["kernel"], grads["model"]["word_embeddings"]["embedding"])
    )
    # a tied head reads the adapted table transposed
    table = lora.apply(params, adapters, config)["model"]["word_embeddings"]["embedding"]
    table = lora.LoraKernel(
        table.base,
        moved["model"]["word_embeddings"]["embedding"]["a"],
        moved["model"]["word_embeddings"]["embedding"]["b"],
        table.scale,
    )
    x = jax.random.normal(jax.random.key(5), (3, CONFIG.hidden_size))
    np.testing.assert_allclose(table.T.matmul(x), x @ table.astype(jnp.float32).T, atol=1e-5, rtol=0)
