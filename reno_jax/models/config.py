"""Static configuration of the Ling-3.0 (HF ``model_type: "bailing_hybrid"``) architecture.

`Ling3Config` is a frozen, hashable dataclass, so it can be passed as a static argument to `jax.jit`.
Field names are exactly the HF ``config.json`` keys. Keys of a config.json that the model does not use
(``architectures``, ``rope_parameters``, ``transformers_version``, ...) are kept verbatim in `extra` so that
``Ling3Config.from_dict(d).to_dict() == d``; `extra` does not take part in equality / hashing, so two configs
that only differ in bookkeeping keys share compiled functions.

Layer schedule. When the config spells out ``layer_types`` ("linear_attention" = Kimi Delta Attention (KDA),
"full_attention" = gated MLA) and ``mlp_layer_types`` ("dense" = SwiGLU MLP, "sparse" = DeepSeek-V3 style MoE),
one entry per layer, those lists decide, as they do for transformers' native ``BailingHybridForCausalLM``.
Without them the original Ling remote code's rule applies (see tests/data golden README): layer ``i`` uses MLA
when ``(i + 1) % layer_group_size == 0`` or when it falls in a trailing group that is not complete
(``i >= (L // layer_group_size) * layer_group_size``), KDA otherwise; layers ``i < first_k_dense_replace`` are
dense, the others MoE. transformers derives missing lists without that tail rule, so the two engines disagree on
a model whose layer count is not a multiple of ``layer_group_size`` unless the lists are written out:
`to_dict` of a directly built config, and ``save_pretrained`` for any config, write both.

An explicit list equal to the rule above is stored as ``None``, so a config read from a file that spells the
schedule out equals (and hashes like) the same config built without it; `to_dict` writes it back.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any, Mapping, Optional

MODEL_TYPE = "bailing_hybrid"
GATE_KINDS = ("head_wise", "element_wise")
# HF `layer_types` value of each attention kind, and the `mlp_layer_types` values (dense MLP, MoE).
LAYER_TYPE_OF_KIND = {"kda": "linear_attention", "mla": "full_attention"}
KIND_OF_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_OF_KIND.items()}
MLP_LAYER_TYPES = ("dense", "sparse")

# Keys that must be present in a config.json: everything that fixes a tensor shape, or the layer schedule.
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "layer_group_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


@dataclasses.dataclass(frozen=True)
class Ling3Config:
    """Ling-3.0 hyper-parameters (HF names). Shapes: D = hidden_size, H = num_attention_heads,
    Dk = head_dim (KDA head size), P = H * Dk, E = num_experts, W = short_conv_kernel_size."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    layer_group_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    model_type: str = MODEL_TYPE
    num_key_value_heads: Optional[int] = None
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    moe_shared_expert_intermediate_size: Optional[int] = None
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    q_lora_rank: Optional[int] = None
    gated_attention_proj_granularity_type: str = "head_wise"
    short_conv_kernel_size: int = 4
    no_kda_lora: bool = True
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    rope_theta: float = 6_000_000.0
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None  # int, or a tuple of ints
    # Explicit per-layer schedule (HF names, see the module docstring); None: derived from the fields above.
    layer_types: Optional[tuple] = None
    mlp_layer_types: Optional[tuple] = None
    # Unused config.json keys, as sorted (key, json text) pairs: only for the to_dict round trip.
    extra: tuple = dataclasses.field(default=(), compare=False, hash=False, repr=False)
    # Field names present in the dict given to from_dict (None: built directly, to_dict writes every field).
    source_keys: Optional[tuple] = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"unsupported model_type {self.model_type!r}; Ling3Config is for {MODEL_TYPE!r}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        errors = []
        self._check_schedule_lists(errors)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "layer_group_size",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "short_conv_kernel_size",
            "n_group",
            "topk_group",
        ):
            if int(getattr(self, name)) <= 0:
                errors.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            errors.append(f"qk_rope_head_dim must be a positive even number, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            errors.append(f"q_lora_rank must be None or > 0, got {self.q_lora_rank}")
        if self.num_experts % self.n_group:
            errors.append(f"num_experts ({self.num_experts}) must be divisible by n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            errors.append(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if self.num_experts_per_tok > (self.num_experts // self.n_group) * self.topk_group:
            errors.append("num_experts_per_tok exceeds the experts left after group-limited routing")
        if self.gated_attention_proj_granularity_type not in GATE_KINDS:
            errors.append(
                f"gated_attention_proj_granularity_type must be one of {GATE_KINDS}, "
                f"got {self.gated_attention_proj_granularity_type!r}"
            )
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            errors.append("num_key_value_heads must equal num_attention_heads (MLA has no grouped KV heads)")
        if self.hidden_act != "silu":
            errors.append(f"only hidden_act='silu' is supported, got {self.hidden_act!r}")
        if self.use_qkv_bias:
            errors.append("use_qkv_bias=True is not supported (Ling-3.0 has no projection biases)")
        if errors:
            raise ValueError("invalid Ling3Config: " + "; ".join(errors))

    def _check_schedule_lists(self, errors: list) -> None:
        """Validates `layer_types` / `mlp_layer_types` (as tuples) and stores None for a list equal to the rule."""
        if not (self.layer_group_size > 0 and self.num_hidden_layers > 0):
            return  # no rule to compare with; the field checks report these
        allowed = {"layer_types": tuple(KIND_OF_LAYER_TYPE), "mlp_layer_types": MLP_LAYER_TYPES}
        derived = {"layer_types": self.rule_layer_types(), "mlp_layer_types": self.rule_mlp_layer_types()}
        for name, values in allowed.items():
            given = getattr(self, name)
            if given is None:
                continue
            if isinstance(given, (str, bytes)) or not isinstance(given, (list, tuple)):
                errors.append(f"{name} must be a list of strings, got {given!r}")
                continue
            given = tuple(given)
            bad = [f"{name}[{i}] = {v!r}" for i, v in enumerate(given) if v not in values]
            if bad:
                errors.append(f"{name} entries must be one of {values}, got " + ", ".join(bad))
            elif len(given) != self.num_hidden_layers:
                errors.append(f"{name} has {len(given)} entries but num_hidden_layers is {self.num_hidden_layers}")
            else:
                object.__setattr__(self, name, None if given == derived[name] else given)

    def rule_layer_types(self) -> tuple:
        """HF `layer_types` by the Ling remote code's rule: the last layer of each group, and every layer of an
        incomplete trailing group, is full attention (MLA); the others are linear attention (KDA)."""
        g, n = self.layer_group_size, self.num_hidden_layers
        full = (n // g) * g
        return tuple(LAYER_TYPE_OF_KIND["mla" if ((i + 1) % g == 0 or i >= full) else "kda"] for i in range(n))

    def rule_mlp_layer_types(self) -> tuple:
        """HF `mlp_layer_types` by the Ling remote code's rule: dense below first_k_dense_replace, then MoE."""
        return tuple("dense" if i < self.first_k_dense_replace else "sparse" for i in range(self.num_hidden_layers))

    @property
    def resolved_layer_types(self) -> tuple:
        """HF `layer_types` of this model: the explicit list, or the rule's."""
        return self.layer_types if self.layer_types is not None else self.rule_layer_types()

    @property
    def resolved_mlp_layer_types(self) -> tuple:
        """HF `mlp_layer_types` of this model: the explicit list, or the rule's."""
        return self.mlp_layer_types if self.mlp_layer_types is not None else self.rule_mlp_layer_types()

    # ------------------------------------------------------------------ derived sizes
    @property
    def kda_dim(self) -> int:
        """P = H * Dk, the width of the KDA q/k/v projections."""
        return self.num_attention_heads * self.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """Is = moe_shared_expert_intermediate_size * num_shared_experts (0 when there is no shared expert)."""
        base = self.moe_shared_expert_intermediate_size
        if base is None:
            base = self.moe_intermediate_size
        return base * self.num_shared_experts

    @property
    def layer_kinds(self) -> tuple:
        """("kda" | "mla") per decoder layer: `layer_types` when given, else the rule with its tail (module doc)."""
        return tuple(KIND_OF_LAYER_TYPE[t] for t in self.resolved_layer_types)

    def is_moe_layer(self, i: int) -> bool:
        if not 0 <= i < self.num_hidden_layers:
            raise IndexError(f"layer {i} out of range [0, {self.num_hidden_layers})")
        return self.resolved_mlp_layer_types[i] == "sparse"

    def replace(self, **kw) -> "Ling3Config":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ dict round trip
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Ling3Config":
        """Build from a HF config.json dict. Raises ValueError on a missing key or unsupported model_type."""
        if not isinstance(d, Mapping):
            raise TypeError(f"expected a mapping, got {type(d).__name__}")
        model_type = d.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"unsupported model_type {model_type!r}; expected {MODEL_TYPE!r}")
        d = dict(d)
        # Older configs only carry rope_theta inside rope_parameters.
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), Mapping):
            if "rope_theta" in d["rope_parameters"]:
                d["rope_theta"] = d["rope_parameters"]["rope_theta"]
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"config is missing required keys: {', '.join(missing)}")
        for key in ("rope_parameters", "rope_scaling"):
            rp = d.get(key)
            if isinstance(rp, Mapping) and rp.get("rope_type", rp.get("type", "default")) not in (None, "default"):
                raise ValueError(f"{key} with rope_type {rp.get('rope_type', rp.get('type'))!r} is not supported")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "source_keys"}
        known = {k: v for k, v in d.items() if k in names}
        if isinstance(known.get("eos_token_id"), list):
            known["eos_token_id"] = tuple(known["eos_token_id"])
        for name in ("layer_types", "mlp_layer_types"):
            if isinstance(known.get(name), list):
                known[name] = tuple(known[name])
        extra = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in d.items() if k not in names))
        cfg = cls(**known, extra=extra, source_keys=tuple(sorted(known)))
        # The original Ling remote code ignores both lists, so a file whose lists depart from its rule loads
        # differently there (we and transformers' native class follow the lists).
        for name in ("layer_types", "mlp_layer_types"):
            if getattr(cfg, name) is not None:
                rule = cfg.rule_layer_types() if name == "layer_types" else cfg.rule_mlp_layer_types()
                warnings.warn(
                    f"config {name} {list(getattr(cfg, name))} differ from the Ling remote code's "
                    f"schedule {list(rule)}; the config's {name} are used"
                )
        return cfg

    def to_dict(self) -> dict:
        """HF config.json dict; round-trips `from_dict` (unknown keys come back from `extra`)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "source_keys"):
                continue
            v = getattr(self, f.name)
            if f.name in ("layer_types", "mlp_layer_types"):
                # Written out (resolved) unless the source dict left it out: other engines derive a missing
                # list by their own rule, which for layer_types has no tail rule.
                if self.source_keys is None or f.name in self.source_keys:
                    out[f.name] = list(getattr(self, "resolved_" + f.name))
                continue
            # A default that the source dict did not spell out stays out, so from_dict(d).to_dict() == d.
            if self.source_keys is not None and f.name not in self.source_keys and v == f.default:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        for k, text in self.extra:
            out[k] = json.loads(text)
        return out

    @classmethod
    def from_json_file(cls, path) -> "Ling3Config":
        with open(path) as fh:
            return cls.from_dict(json.load(fh))


def ling3_tiny_real() -> Ling3Config:
    """The shape of inclusionAI/Ling-3.0-tiny (7.9B total, ~1.3B active parameters per token).

    Values from the public Ling-3.0-tiny config.json as quoted in third-party ports (hidden 1536, 24 layers,
    3:1 KDA:MLA groups of 4, 16 heads of 128, q_lora_rank 256, kv_lora_rank 512, 128 experts top-8 of size 512,
    8 expert groups / 4 kept, one shared expert of 512, first layer dense with 4608). The parameter count this
    gives (see benchmarks/model_forward.py) matches the published 7.9B total.
    """
    return Ling3Config(
        vocab_size=157184,
        hidden_size=1536,
        intermediate_size=4608,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        layer_group_size=4,
        first_k_dense_replace=1,
        num_experts=128,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=512,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        gated_attention_proj_granularity_type="head_wise",
        short_conv_kernel_size=4,
        no_kda_lora=True,
        kda_safe_gate=True,
        kda_lower_bound=-5.0,
        rope_theta=6_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        pad_token_id=156892,
        eos_token_id=156895,
    )


def tiny_test_config(**overrides) -> Ling3Config:
    """A few-kB model for tests and CPU experiments: 4 layers [KDA, MLA, KDA, MLA], 8 experts top-2."""
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=16,
        layer_group_size=2,
        first_k_dense_replace=1,
        num_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    )
    base.update(overrides)
    return Ling3Config(**base)
