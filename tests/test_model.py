"""Ling-3.0 JAX model: golden parity, cache / padding semantics, other configs, bf16, shapes.

Run: cd /work/main && python -m pytest -q tests/test_model.py
"""

import functools
import json
import os
import unittest.mock
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reno_jax.models import conversion, kda, ling3
from reno_jax.models.config import Ling3Config, ling3_tiny_real, tiny_test_config
from reno_jax.models.layers import blocked_dispatch_pays, moe_dense_reference, moe_experts, moe_experts_blocked, route

DATA = os.path.join(os.path.dirname(__file__), "data", "ling3_tiny_a")
TOL = 1e-4

# Compiling is most of this file's run time on CPU (XLA:CPU spends seconds per program even for tiny models), so
# every test reuses a few jitted programs (same shapes, `valid` always passed the same way), compiled with LLVM
# optimisation off: that halves compile time and cannot change what is computed beyond float rounding.
FAST = {"xla_backend_optimization_level": 0}
fwd = jax.jit(ling3.forward, static_argnames=("config", "return_hidden"), compiler_options=FAST)


@functools.lru_cache(maxsize=None)
def golden():
    from reno_jax.models.conversion import from_pretrained

    config, params = from_pretrained(DATA)
    data = dict(np.load(os.path.join(DATA, "golden.npz")))
    return config, params, data


def randomize(params, seed):
    """Golden-README-like random values for every leaf (numpy, no compiles), so every parameter path matters."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in leaves:
        names = [p.key for p in path]
        n = rng.standard_normal(leaf.shape).astype(np.float32)
        if names[-1] == "scale":
            x = 1.0 + 0.1 * n
        elif names[-1] == "A_log":
            x = 0.5 * n
        elif names[-1] == "dt_bias":
            x = -2.5 + n
        elif names[-1] == "expert_bias":
            x = 0.25 * n
        elif names[-2].endswith("conv1d"):
            x = 0.5 * n
        elif names[-1] == "embedding":
            x = n
        else:  # kernels [.., in, out] and stacked experts [E, in, out]
            x = n / np.sqrt(leaf.shape[-2])
        out.append(jnp.asarray(x, leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


# Every optional branch at once: a tail MLA layer (3 layers, group 2 -> KDA, MLA, MLA), q_lora_rank None,
# element-wise output gate, low-rank KDA f/g, the softplus gate, 2 dense layers, 2 shared experts, tied head.
OTHER = tiny_test_config(
    num_hidden_layers=3,
    layer_group_size=2,
    q_lora_rank=None,
    gated_attention_proj_granularity_type="element_wise",
    no_kda_lora=False,
    kda_safe_gate=False,
    first_k_dense_replace=2,
    num_shared_experts=2,
    tie_word_embeddings=True,
    vocab_size=96,
)
CHUNK = 4  # every cached multi-token call in the OTHER tests is padded to this many tokens (one compile)


@functools.lru_cache(maxsize=None)
def other_params():
    return randomize(ling3.init_params(OTHER, jax.random.PRNGKey(0)), 1)


def other_seqs(seed, b=3, t=12):
    return np.random.default_rng(seed).integers(0, OTHER.vocab_size, (b, t)).astype(np.int32)


def other_full(params, ids, valid=None):
    """Uncached forward, always with an explicit `valid` (one compiled program)."""
    valid = np.ones(ids.shape, bool) if valid is None else valid
    return fwd(params, OTHER, jnp.asarray(ids), valid=jnp.asarray(valid))[0]


def other_chunk(params, cache, chunk, valid):
    return fwd(params, OTHER, jnp.asarray(chunk), cache, valid=jnp.asarray(valid))


# ------------------------------------------------------------------------------------------------ config


def test_config_roundtrip_schedule_and_errors():
    with open(os.path.join(DATA, "config.json")) as fh:
        raw = json.load(fh)
    cfg = Ling3Config.from_dict(raw)
    assert cfg.to_dict() == raw
    assert cfg.layer_kinds == ("kda", "mla", "kda", "mla")
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert hash(cfg) == hash(Ling3Config.from_dict(raw)) and cfg == Ling3Config.from_dict(raw)
    assert OTHER.layer_kinds == ("kda", "mla", "mla")
    assert tiny_test_config(num_hidden_layers=5).layer_kinds == ("kda", "mla", "kda", "mla", "mla")
    assert ling3_tiny_real().layer_kinds == ("kda", "kda", "kda", "mla") * 6
    assert tiny_test_config(num_hidden_layers=7, layer_group_size=3).layer_kinds == (
        "kda",
        "kda",
        "mla",
        "kda",
        "kda",
        "mla",
        "mla",
    )
    # round trip of a directly built config
    assert Ling3Config.from_dict(OTHER.to_dict()) == OTHER
    bad = dict(raw)
    del bad["hidden_size"], bad["kv_lora_rank"]
    with pytest.raises(ValueError, match="hidden_size, kv_lora_rank"):
        Ling3Config.from_dict(bad)
    with pytest.raises(ValueError, match="unsupported model_type"):
        Ling3Config.from_dict({**raw, "model_type": "llama"})
    with pytest.raises(ValueError, match="n_group"):
        tiny_test_config(n_group=3)
    with pytest.raises(ValueError, match="granularity"):
        tiny_test_config(gated_attention_proj_granularity_type="per_token")
    # An explicit schedule that departs from the Ling rule is used (as transformers' native class does), with a
    # warning that the original remote code, which ignores it, would build another model.
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        all_kda = Ling3Config.from_dict({**raw, "layer_types": ["linear_attention"] * 4})
    assert any("layer_types" in str(x.message) for x in w)
    assert all_kda.layer_kinds == ("kda",) * 4 and all_kda != cfg


def test_real_shape_parameter_counts():
    counts = ling3.count_params(ling3_tiny_real())
    # Published: 7.9B total, 1.3B activated per token.
    assert 7.7e9 < counts["total"] < 8.1e9, counts
    assert 1.2e9 < counts["active"] < 1.45e9, counts


# ------------------------------------------------------------------------------------------------ golden


def test_params_layout_matches_golden_checkpoint():
    config, params, _ = golden()
    init = ling3.init_params(config, jax.random.PRNGKey(0))
    shapes = lambda t: jax.tree.map(lambda x: x.shape, t)  # noqa: E731
    assert shapes(init) == shapes(params)
    chex.assert_trees_all_equal_shapes(init, params)
    assert init["model"]["layers_1"]["mlp"]["gate"]["expert_bias"].dtype == jnp.float32
    bf16 = ling3.init_params(config, jax.random.PRNGKey(0), jnp.bfloat16)
    assert bf16["model"]["layers_0"]["attention"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    assert bf16["model"]["layers_0"]["attention"]["A_log"].dtype == jnp.float32
    # Under jax.eval_shape nothing is drawn and the tree is what from_pretrained's restore targets expect.
    abstract = jax.eval_shape(lambda k: ling3.init_params(config, k, jnp.bfloat16), jax.random.PRNGKey(0))
    assert abstract == conversion.abstract_params(config, jnp.bfloat16)
    assert set(init["model"]["layers_0"]["attention"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "q_conv1d",
        "k_conv1d",
        "v_conv1d",
        "A_log",
        "dt_bias",
        "b_proj",
        "f_proj",
        "g_proj",
        "o_norm",
        "o_proj",
    }


def test_init_distributions_and_what_the_values_depend_on():
    """HF-style init drawn with jax.random: the kinds' distributions; leaf i of the sorted paths is drawn from
    fold_in(key, i); the whole-model route equals the per-leaf one (bf16 too, typed and raw keys); other keys give
    other values, the same key the same values."""
    config = tiny_test_config(num_hidden_layers=2)
    p = ling3.init_params(config, jax.random.PRNGKey(0))
    att, mlp = p["model"]["layers_0"]["attention"], p["model"]["layers_1"]["mlp"]
    emb = np.asarray(p["model"]["word_embeddings"]["embedding"])
    experts = np.asarray(mlp["experts"]["gate_proj"])
    std = config.initializer_range
    for big in (emb, experts):  # N(0, initializer_range), thousands of draws: ~1% statistical error
        assert big.size >= 8192 and abs(big.std() / std - 1) < 0.05 and abs(big.mean()) < 0.05 * std
        assert np.abs(big).max() < 6 * std
    a = np.exp(np.asarray(att["A_log"]))
    dt = np.log1p(np.exp(np.asarray(att["dt_bias"])))  # softplus undoes the inverse softplus
    bound = 1 / np.sqrt(config.short_conv_kernel_size)
    conv = np.asarray(att["q_conv1d"]["kernel"])
    assert a.min() >= 1 and a.max() <= 16 and dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    assert np.abs(conv).max() <= bound and conv.std() > 0.4 * bound
    assert np.all(np.asarray(mlp["gate"]["expert_bias"]) == 0) and np.all(np.asarray(p["model"]["norm"]["scale"]) == 1)
    assert not np.array_equal(np.asarray(att["q_proj"]["kernel"]), np.asarray(att["k_proj"]["kernel"]))

    # Leaf i of the sorted paths: jax.random from fold_in(key, i) (to float32 rounding: XLA fuses the scaling).
    paths = sorted(ling3.param_shapes(config))
    leaf_key = lambda path: jax.random.fold_in(jax.random.PRNGKey(0), paths.index(path))  # noqa: E731
    uniform = jax.random.uniform(
        leaf_key(("model", "layers_0", "attention", "q_conv1d", "kernel")), conv.shape, minval=-bound, maxval=bound
    )
    np.testing.assert_allclose(np.asarray(uniform), conv, rtol=1e-6)
    normal = jax.random.normal(leaf_key(("model", "word_embeddings", "embedding")), emb.shape)
    np.testing.assert_allclose(config.initializer_range * np.asarray(normal), emb, rtol=1e-6, atol=1e-9)

    # Both routes, both key kinds, both dtypes: the same bits.
    for dtype in (jnp.float32, jnp.bfloat16):
        for key in (jax.random.PRNGKey(0), jax.random.key(0)):
            whole = ling3.init_params(config, key, dtype)
            with unittest.mock.patch.object(ling3, "_MODEL_PROGRAM_MAX", 0):
                per_leaf = ling3.init_params(config, key, dtype)
            chex.assert_trees_all_equal(whole, per_leaf)
            chex.assert_trees_all_equal_dtypes(whole, per_leaf)
    chex.assert_trees_all_equal(ling3.init_params(config, jax.random.PRNGKey(0)), p)  # run to run
    other = ling3.init_params(config, jax.random.key(1))
    assert not np.array_equal(np.asarray(other["model"]["word_embeddings"]["embedding"]), emb)


def test_golden_forward_logits_and_hidden():
    config, params, g = golden()
    logits, cache, hidden = fwd(params, config, jnp.asarray(g["input_ids"]), return_hidden=True)
    assert cache is None
    chex.assert_shape(logits, (2, 12, config.vocab_size))
    chex.assert_type(logits, jnp.float32)
    chex.assert_shape(hidden, (config.num_hidden_layers + 1, 2, 12, config.hidden_size))
    err_logits = float(np.abs(np.asarray(logits) - g["logits"]).max())
    err_hidden = float(np.abs(np.asarray(hidden) - g["hidden_after_layer"]).max())
    print(f"golden max|logits diff| {err_logits:.2e}, max|hidden diff| {err_hidden:.2e}")
    assert err_logits <= TOL and err_hidden <= TOL


def test_golden_prefill_then_decode():
    config, params, g = golden()
    ids = jnp.asarray(g["input_ids"])
    p = int(g["decode_prompt_len"])
    cache = ling3.init_cache(config, 2, 16)
    logits, cache = fwd(params, config, ids[:, :p], cache)
    err_prefill = float(np.abs(np.asarray(logits) - g["logits"][:, :p]).max())
    steps = []
    for t in range(p, ids.shape[1]):
        step, cache = fwd(params, config, ids[:, t : t + 1], cache)
        steps.append(step[:, 0])
    err_decode = float(np.abs(np.stack(steps, 1) - g["decode_logits"]).max())
    print(f"golden max|prefill diff| {err_prefill:.2e}, max|decode diff| {err_decode:.2e}")
    assert err_prefill <= TOL and err_decode <= TOL
    np.testing.assert_array_equal(cache["length"], [12, 12])


def test_moe_ragged_dispatch_equals_dense_reference():
    config, params, _ = golden()
    p = params["model"]["layers_1"]["mlp"]
    x = jax.random.normal(jax.random.PRNGKey(3), (40, config.hidden_size))

    @functools.partial(jax.jit, compiler_options=FAST)
    def run(p, x):
        w, e = route(p["gate"], x, config)
        return w, e, moe_experts(p["experts"], x, w, e), moe_dense_reference(p["experts"], x, w, e)

    w, e, ragged, dense = run(p, x)
    chex.assert_shape([w, e], (40, config.num_experts_per_tok))
    # group-limited: all chosen experts of a token are in one group (topk_group 1 of 2)
    assert np.all(np.asarray(e).max(1) // 4 == np.asarray(e).min(1) // 4)
    assert np.all(np.asarray(e)[:, 0] != np.asarray(e)[:, 1])
    np.testing.assert_allclose(np.asarray(w).sum(1), config.routed_scaling_factor, rtol=1e-5)
    np.testing.assert_allclose(ragged, dense, atol=1e-5)


@pytest.mark.parametrize("n,block_rows", [(40, 4), (3, 8), (64, 64)])
def test_moe_blocked_dispatch_equals_dense_reference_with_gradients(n, block_rows):
    """Blocked dispatch (rows padded per expert to whole blocks): same outputs and the same gradients for x and
    every expert weight as the dense reference, whether blocks are partly filled, mostly padding (3 tokens) or
    a whole expert fits one block."""
    config, params, _ = golden()
    p = params["model"]["layers_1"]["mlp"]
    x = jax.random.normal(jax.random.PRNGKey(n), (n, config.hidden_size))
    probe = jax.random.normal(jax.random.PRNGKey(7), (n, config.hidden_size))

    @functools.partial(jax.jit, compiler_options=FAST)
    def run(experts_p, x):
        w, e = route(p["gate"], x, config)

        def loss(fn, experts_p, x):
            return jnp.sum(fn(experts_p, x, w, e) * probe)

        blocked = lambda *a: moe_experts_blocked(*a, block_rows=block_rows)  # noqa: E731
        out = (blocked(experts_p, x, w, e), moe_dense_reference(experts_p, x, w, e))
        grads = (
            jax.grad(functools.partial(loss, blocked), argnums=(0, 1))(experts_p, x),
            jax.grad(functools.partial(loss, moe_dense_reference), argnums=(0, 1))(experts_p, x),
        )
        return out, grads

    (blocked, dense), (g_blocked, g_dense) = run(p["experts"], x)
    chex.assert_shape(blocked, (n, config.hidden_size))
    np.testing.assert_allclose(blocked, dense, atol=1e-5)
    for gb, gd in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_dense)):
        np.testing.assert_allclose(gb, gd, atol=2e-5)


def test_moe_dispatch_choice():
    # decode-sized calls (few rows per expert) keep the ragged dispatch; prefill / training batches go blocked
    assert not blocked_dispatch_pays(16 * 8, 128)
    assert blocked_dispatch_pays(4 * 1471 * 8, 128)
    assert blocked_dispatch_pays(8064, 128, 64) and not blocked_dispatch_pays(8063, 128, 64)


def test_kda_chunked_form_equals_recurrence():
    rng = np.random.default_rng(9)
    b, t, h, d = 3, 21, 2, 8
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q = kda.l2_normalize(normal(b, t, h, d)) * d**-0.5
    k = kda.l2_normalize(normal(b, t, h, d))
    v = normal(b, t, h, d)
    beta = jax.nn.sigmoid(normal(b, t, h))
    valid = jnp.arange(t)[None] < jnp.array([[21], [13], [0]])
    s0 = normal(b, h, d, d)

    @functools.partial(jax.jit, compiler_options=FAST)
    def both(g):
        return kda.kda_recurrent(q, k, v, g, beta, valid, s0), kda.kda_chunked(q, k, v, g, beta, valid, s0, 16)

    for g in (-5.0 * jax.nn.sigmoid(3 * normal(b, t, h, d)), jnp.full((b, t, h, d), -4.99)):  # incl. max decay
        (o_ref, s_ref), (o, s) = both(g)
        np.testing.assert_allclose(
            np.where(valid[..., None, None], o, 0), np.where(valid[..., None, None], o_ref, 0), atol=2e-4
        )
        np.testing.assert_allclose(s, s_ref, atol=2e-4)
        np.testing.assert_array_equal(s[2], s0[2])  # a row without valid steps keeps its state exactly
    assert kda.chunk_size_for(tiny_test_config()) == 16
    assert kda.chunk_size_for(tiny_test_config(kda_lower_bound=-10.0)) == 8
    assert kda.chunk_size_for(OTHER) is None  # unbounded softplus gate: step-by-step scan


# ------------------------------------------------------------------------------------------------ other configs


def test_other_config_chunked_and_incremental_decode_equal_full_forward():
    params = other_params()
    ids = other_seqs(4)
    full = np.asarray(other_full(params, ids))
    assert full.std() > 0.5  # the random model is far from trivial
    cache = ling3.init_cache(OTHER, 3, 16)
    outs, start = [], 0
    # Chunks padded to CHUNK (one compiled program; T = 1 decode steps are covered by the golden decode test).
    for size in (4, 3, 1, 2, 1, 1):
        chunk = np.zeros((3, CHUNK), np.int32)
        chunk[:, :size] = ids[:, start : start + size]
        out, cache = other_chunk(params, cache, chunk, np.arange(CHUNK)[None, :].repeat(3, 0) < size)
        outs.append(np.asarray(out[:, :size]))
        start += size
    err = float(np.abs(np.concatenate(outs, 1) - full).max())
    print(f"other config: max|chunked/incremental - full| {err:.2e}")
    assert err <= TOL
    np.testing.assert_array_equal(cache["length"], [12, 12, 12])


def _run_ragged(params, seqs, plan, junk_seed):
    """Feed each row's real tokens in chunks of `plan[c][b]` valid tokens, right-padded with junk tokens."""
    b = seqs.shape[0]
    cache = ling3.init_cache(OTHER, b, 16)
    done = np.zeros(b, int)
    per_row = [[] for _ in range(b)]
    for counts in plan:
        chunk = other_seqs(junk_seed, b, CHUNK)
        junk_seed += 1
        valid = np.zeros((b, CHUNK), bool)
        for r, n in enumerate(counts):
            chunk[r, :n] = seqs[r, done[r] : done[r] + n]
            valid[r, :n] = True
        out, cache = other_chunk(params, cache, chunk, valid)
        for r, n in enumerate(counts):
            per_row[r].append(np.asarray(out[r, :n]))
        done += np.asarray(counts)
    return [np.concatenate(x, 0) for x in per_row], cache


def test_other_config_right_padding_never_changes_state():
    params = other_params()
    seqs = other_seqs(5)
    full = np.asarray(other_full(params, seqs))
    plan = [(4, 2, 0), (4, 4, 4), (0, 3, 4), (4, 3, 4)]  # rows advance at different rates; empty chunks too
    rows_a, cache_a = _run_ragged(params, seqs, plan, 100)
    rows_b, cache_b = _run_ragged(params, seqs, plan, 200)
    for r in range(3):
        chex.assert_shape(rows_a[r], (12, OTHER.vocab_size))
        assert np.abs(rows_a[r] - full[r]).max() <= TOL
        np.testing.assert_allclose(rows_a[r], rows_b[r], atol=1e-6)
    np.testing.assert_array_equal(cache_a["length"], [12, 12, 12])
    # The whole cache, incl. MLA slots past the visible length, is independent of the padded tokens.
    chex.assert_trees_all_close(cache_a, cache_b, atol=1e-6)

    # A chunk that is entirely padding for a row leaves that row's cache bit-identical.
    valid = np.array([[True] * 4, [False] * 4, [True, False, False, False]])
    _, cache_c = other_chunk(params, cache_a, other_seqs(300, 3, CHUNK), valid)
    np.testing.assert_array_equal(cache_c["length"], [16, 12, 13])
    for layer_a, layer_c in zip(cache_a["layers"], cache_c["layers"]):
        for name in layer_a:
            np.testing.assert_array_equal(layer_a[name][1], layer_c[name][1])

    # Without a cache, right padding leaves the valid positions' logits unchanged.
    valid = np.arange(12)[None, :] < np.array([[12], [7], [3]])
    out = np.asarray(other_full(params, np.where(valid, seqs, seqs[:, ::-1]), valid))
    for r, n in enumerate((12, 7, 3)):
        assert np.abs(out[r, :n] - full[r, :n]).max() <= TOL


def test_token_logprobs_matches_log_softmax():
    params = other_params()
    ids = other_seqs(6)
    valid = np.arange(12)[None, :] < np.array([[12], [9], [1]])
    logp = jax.jit(ling3.token_logprobs, static_argnames="config", compiler_options=FAST)(
        params, OTHER, jnp.asarray(ids), jnp.asarray(valid)
    )
    chex.assert_shape(logp, (3, 12))
    chex.assert_type(logp, jnp.float32)
    ref = jax.nn.log_softmax(other_full(params, ids, valid), -1)
    ref = np.take_along_axis(np.asarray(ref[:, :-1]), ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(logp[0, 1:], ref[0], atol=TOL)
    np.testing.assert_allclose(logp[1, 1:9], ref[1, :8], atol=TOL)
    assert np.all(np.asarray(logp[:, 0]) == 0) and np.all(np.asarray(logp[1, 9:]) == 0)
    assert np.all(np.asarray(logp[2]) == 0) and np.all(np.asarray(logp[:2, 1:9]) < 0)


def test_other_config_cache_shapes():
    config = OTHER
    cache = ling3.init_cache(config, 2, 8)
    p = config.num_attention_heads * config.head_dim
    chex.assert_shape(cache["length"], (2,))
    for kind, layer in zip(config.layer_kinds, cache["layers"]):
        if kind == "kda":
            chex.assert_shape(
                [layer["q_conv"], layer["k_conv"], layer["v_conv"]], (2, config.short_conv_kernel_size - 1, p)
            )
            chex.assert_shape(layer["state"], (2, config.num_attention_heads, config.head_dim, config.head_dim))
            chex.assert_type(layer["state"], jnp.float32)
        else:
            chex.assert_shape(layer["latent"], (2, 8, config.kv_lora_rank))
            chex.assert_shape(layer["k_rope"], (2, 8, config.qk_rope_head_dim))
    params = other_params()
    assert "lm_head" not in params
    attn = params["model"]["layers_0"]["attention"]
    chex.assert_shape(attn["f_a_proj"]["kernel"], (config.hidden_size, config.head_dim))
    chex.assert_shape(attn["g_b_proj"]["kernel"], (config.head_dim, p))
    chex.assert_shape(
        params["model"]["layers_1"]["attention"]["g_proj"]["kernel"],
        (config.hidden_size, config.num_attention_heads * config.v_head_dim),
    )
    assert set(params["model"]["layers_1"]["mlp"]) == {"gate_proj", "up_proj", "down_proj"}
    chex.assert_shape(
        params["model"]["layers_2"]["mlp"]["shared_experts"]["up_proj"]["kernel"],
        (config.hidden_size, 2 * config.moe_shared_expert_intermediate_size),
    )
    with pytest.raises(ValueError, match="input_ids must be"):
        ling3.forward(params, config, jnp.zeros((3,), jnp.int32))


# ------------------------------------------------------------------------------------------------ bf16


def test_bf16_params_close_to_fp32():
    config, params, g = golden()
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ids = jnp.asarray(g["input_ids"])
    # Token-by-token from an empty bf16 cache: exercises bf16 weights, bf16 KDA conv / MLA caches, fp32 state.
    cache = ling3.init_cache(config, 2, 16, jnp.bfloat16)
    steps = []
    for t in range(ids.shape[1]):
        step, cache = fwd(bf16, config, ids[:, t : t + 1], cache)
        steps.append(np.asarray(step[:, 0]))
    logits = np.stack(steps, 1)
    assert cache["layers"][1]["latent"].dtype == jnp.bfloat16 and cache["layers"][0]["state"].dtype == jnp.float32
    assert np.all(np.isfinite(logits))
    diff = np.abs(logits - g["logits"])
    print(f"bf16 vs fp32 logits: mean {diff.mean():.3f}, max {diff.max():.3f} (logits std {g['logits'].std():.2f})")
    assert diff.mean() < 0.1 and diff.max() < 1.0


def test_remat_forward_and_gradients_unchanged():
    """`remat=True` (jax.checkpoint per layer) changes memory, not values: logits and gradients agree."""
    config = tiny_test_config()
    params = ling3.init_params(config, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, config.vocab_size)

    def loss(p, remat):
        logits, _ = ling3.forward(p, config, ids, remat=remat)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

    def compiled(remat):
        return jax.jit(jax.value_and_grad(functools.partial(loss, remat=remat))).lower(params).compile()

    plain, checkpointed = compiled(False), compiled(True)
    l0, g0 = plain(params)
    l1, g1 = checkpointed(params)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    # The checkpointed program keeps less: XLA's temp allocation of the backward pass shrinks.
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(checkpointed) <= temp(plain)


def test_long_sequences_attend_block_by_block_with_the_same_values(monkeypatch):
    """An uncached sequence longer than 2 * QUERY_BLOCK runs MLA's causal attention in query blocks, each against
    the keys before its end (padding at the end of some rows included): logits and gradients equal the one-block
    computation."""
    from reno_jax.models import mla

    config = tiny_test_config()
    params = ling3.init_params(config, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 45), 0, config.vocab_size)
    valid = jnp.arange(45)[None, :] < jnp.array([[45], [31]])

    def loss(p):
        logits, _ = ling3.forward(p, config, ids, valid=valid)
        return jnp.mean(jnp.where(valid[..., None], jax.nn.log_softmax(logits), 0.0)[..., 3]), logits

    out = {}
    for block in (10**6, 8, 16):  # one block, then blocks of 8 (the last one short) and of 16
        monkeypatch.setattr(mla, "QUERY_BLOCK", block)
        (l, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        out[block] = (float(l), np.asarray(logits), grads)
    for block in (8, 16):
        np.testing.assert_allclose(out[block][0], out[10**6][0], rtol=1e-6)
        np.testing.assert_allclose(out[block][1][valid], out[10**6][1][valid], atol=2e-5)
        for a, b in zip(jax.tree.leaves(out[10**6][2]), jax.tree.leaves(out[block][2])):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
