"""DeepSeek-V4 configuration: one frozen, hashable dataclass (spec section 1).

Parsed from DeepSeek's own `config.json` (`compress_ratios`, `num_hash_layers`, `rope_scaling`)
or from the transformers 5.23 layout (`layer_types`, `mlp_layer_types`, `compress_rates`,
`rope_parameters` with `main`/`compress`). Validation rejects inconsistent configs with a
`ValueError` naming the field; it does not reject small valid test configs (any compress ratio
>= 2, any `hc_mult`, any head width) — block-size rules apply only to quantized formats.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

SLIDING, CSA, HCA = "sliding", "csa", "hca"

_HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_HF_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters of the compressed layers' RoPE (DeepSeek variant, no mscale)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 0  # 0 turns YaRN off (official default)
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.original_max_position_embeddings > 0 and self.factor != 1.0


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """The checkpoint's storage format of the linears (spec 7.2)."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str | None = "ue8m0"  # None: float32 scales (Base checkpoints)
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per main layer (+ optional trailing MTP entries)
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    num_hash_layers: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int = 1
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling = YarnScaling()
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0  # 0 = no clamp (official default); Flash uses 10
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    # DeepSeek's code makes ratio 4 the CSA ratio (overlap + indexer); transformers lets
    # `compress_rates` choose it, so small test models may use another one.
    csa_compress_ratio: int = 4
    hidden_act: str = "silu"
    expert_dtype: str | None = None  # "fp4" (MXFP4 experts), "fp8", or None (unquantized)
    quantization: QuantizationConfig | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def compress_ratio(self, layer: int) -> int:
        """Ratio of main layer `layer` (0 = sliding only). The MTP layer is always sliding."""
        return self.compress_ratios[layer] if layer < self.num_hidden_layers else 0

    def layer_type(self, layer: int) -> str:
        """SLIDING, CSA (overlapping windows + indexer) or HCA (all compressed entries)."""
        ratio = self.compress_ratio(layer)
        if ratio == 0:
            return SLIDING
        return CSA if ratio == self.csa_compress_ratio else HCA

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(self.layer_type(i) for i in range(self.num_hidden_layers))

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def quantized(self) -> bool:
        return self.quantization is not None

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    # ---- parsing ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DeepseekV4Config":
        return cls(**_normalise(dict(raw)))

    @classmethod
    def from_json(cls, path: str | Path) -> "DeepseekV4Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        """DeepSeek's own config.json layout (what `write_random_checkpoint` writes)."""
        out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "rope_scaling":
                if value.enabled:
                    out["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(value)}
            elif field.name == "quantization":
                if value is not None:
                    qc = dataclasses.asdict(value)
                    qc["weight_block_size"] = list(qc["weight_block_size"])
                    out["quantization_config"] = qc
            elif field.name == "csa_compress_ratio" and value == 4:
                continue
            elif isinstance(value, tuple):
                out[field.name] = list(value)
            else:
                out[field.name] = value
        return out

    def replace(self, **changes: Any) -> "DeepseekV4Config":
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name for f in dataclasses.fields(DeepseekV4Config)}

def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    """Map DeepSeek or transformers config keys onto our field names."""
    out: dict[str, Any] = {}
    n = raw.get("num_hidden_layers")
    if n is None:
        raise ValueError("config is missing `num_hidden_layers`")

    # Per-layer attention types.
    if "compress_ratios" in raw:
        out["compress_ratios"] = tuple(int(r) for r in raw["compress_ratios"])
    elif "layer_types" in raw and raw["layer_types"] is not None:
        rates = {**_HF_DEFAULT_RATES, **(raw.get("compress_rates") or {})}
        out["csa_compress_ratio"] = int(rates["compressed_sparse_attention"])
        ratios = []
        for kind in raw["layer_types"]:
            if kind not in _HF_LAYER_TYPES:
                raise ValueError(f"layer_types: unknown layer type {kind!r}")
            ratios.append(0 if kind == "sliding_attention" else int(rates[kind]))
        out["compress_ratios"] = tuple(ratios)
    else:
        raise ValueError("config needs `compress_ratios` (DeepSeek) or `layer_types` (transformers)")

    if "num_hash_layers" in raw:
        out["num_hash_layers"] = int(raw["num_hash_layers"])
    elif raw.get("mlp_layer_types") is not None:
        kinds = list(raw["mlp_layer_types"])
        n_hash = sum(1 for k in kinds if k == "hash_moe")
        if kinds[:n_hash] != ["hash_moe"] * n_hash:
            raise ValueError(f"mlp_layer_types: hash_moe layers must come first, got {kinds}")
        out["num_hash_layers"] = n_hash
    else:
        out["num_hash_layers"] = 0

    # RoPE: DeepSeek's flat keys or transformers' rope_parameters {main, compress}.
    rope_params = raw.get("rope_parameters")
    if isinstance(rope_params, dict) and isinstance(rope_params.get("main"), dict):
        out["rope_theta"] = float(rope_params["main"].get("rope_theta", raw.get("rope_theta", 10000.0)))
        compress = rope_params.get("compress", {})
        out["compress_rope_theta"] = float(compress.get("rope_theta", raw.get("compress_rope_theta", 160000.0)))
        yarn = compress if compress.get("rope_type", compress.get("type")) == "yarn" else None
    else:
        if "rope_theta" in raw:
            out["rope_theta"] = float(raw["rope_theta"])
        if "compress_rope_theta" in raw:
            out["compress_rope_theta"] = float(raw["compress_rope_theta"])
        scaling = raw.get("rope_scaling") or (rope_params if isinstance(rope_params, dict) else None)
        yarn = scaling if scaling and scaling.get("type", scaling.get("rope_type")) == "yarn" else None
    if yarn is not None:
        out["rope_scaling"] = YarnScaling(
            factor=float(yarn.get("factor", 1.0)),
            original_max_position_embeddings=int(yarn.get("original_max_position_embeddings", 0)),
            beta_fast=float(yarn.get("beta_fast", 32.0)),
            beta_slow=float(yarn.get("beta_slow", 1.0)),
        )

    if "qk_rope_head_dim" in raw:
        out["qk_rope_head_dim"] = int(raw["qk_rope_head_dim"])
    elif raw.get("partial_rotary_factor") is not None and "head_dim" in raw:
        out["qk_rope_head_dim"] = round(raw["head_dim"] * raw["partial_rotary_factor"])

    qc = raw.get("quantization_config")
    if qc:
        block = qc.get("weight_block_size") or (128, 128)
        out["quantization"] = QuantizationConfig(
            quant_method=qc.get("quant_method", "fp8"),
            fmt=qc.get("fmt", "e4m3"),
            scale_fmt=qc.get("scale_fmt"),
            activation_scheme=qc.get("activation_scheme", "dynamic"),
            weight_block_size=(int(block[0]), int(block[1])),
        )
        if raw.get("expert_dtype") is None and qc.get("expert_dtype") is not None:
            out["expert_dtype"] = qc["expert_dtype"]

    if isinstance(raw.get("eos_token_id"), list):
        out["eos_token_id"] = int(raw["eos_token_id"][0])

    handled = {
        "compress_ratios", "layer_types", "compress_rates", "num_hash_layers", "mlp_layer_types",
        "rope_parameters", "rope_scaling", "rope_theta", "compress_rope_theta", "qk_rope_head_dim",
        "quantization_config",
    }
    for key, value in raw.items():
        # Unknown keys (dspark_*, vision_*, HF bookkeeping) are tolerated: configs grow fields.
        if key not in handled and key not in out and key in _FIELDS:
            out[key] = value
    if "quantization" not in out:
        out["expert_dtype"] = None  # an unquantized checkpoint stores experts like the rest
    return out


def _fail(field: str, message: str) -> None:
    raise ValueError(f"invalid DeepSeek-V4 config: `{field}` {message}")


def _validate(c: DeepseekV4Config) -> None:
    positive = [
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "moe_intermediate_size",
        "n_routed_experts", "num_experts_per_tok", "hc_mult",
    ]
    for name in positive:
        if getattr(c, name) <= 0:
            _fail(name, f"must be positive, got {getattr(c, name)}")
    if c.hc_sinkhorn_iters < 0:
        _fail("hc_sinkhorn_iters", f"must be >= 0, got {c.hc_sinkhorn_iters}")
    if c.n_shared_experts < 0:
        _fail("n_shared_experts", f"must be >= 0, got {c.n_shared_experts}")
    if c.num_key_value_heads != 1:
        _fail("num_key_value_heads", f"must be 1 (DeepSeek-V4 attention is MQA), got {c.num_key_value_heads}")
    if not 0 < c.qk_rope_head_dim <= c.head_dim or c.qk_rope_head_dim % 2:
        _fail("qk_rope_head_dim", f"must be even and in (0, head_dim={c.head_dim}], got {c.qk_rope_head_dim}")
    if len(c.compress_ratios) < c.num_hidden_layers:
        _fail(
            "compress_ratios",
            f"has {len(c.compress_ratios)} entries, fewer than num_hidden_layers={c.num_hidden_layers}",
        )
    bad = [r for r in c.compress_ratios if r != 0 and r < 2]
    if bad:
        _fail("compress_ratios", f"entries must be 0 (sliding only) or >= 2, got {bad}")
    if c.num_attention_heads % c.o_groups:
        _fail("o_groups", f"must divide num_attention_heads={c.num_attention_heads}, got {c.o_groups}")
    if c.num_experts_per_tok > c.n_routed_experts:
        _fail(
            "num_experts_per_tok",
            f"={c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}",
        )
    if not 0 <= c.num_hash_layers <= c.num_hidden_layers:
        _fail("num_hash_layers", f"must be in [0, num_hidden_layers={c.num_hidden_layers}], got {c.num_hash_layers}")
    if c.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        _fail("scoring_func", f"must be sqrtsoftplus, softmax or sigmoid, got {c.scoring_func!r}")
    if c.hidden_act != "silu":
        _fail("hidden_act", f"must be 'silu', got {c.hidden_act!r}")
    if c.tie_word_embeddings:
        _fail("tie_word_embeddings", "must be false: DeepSeek-V4 has a separate head")
    if c.csa_compress_ratio < 2:
        _fail("csa_compress_ratio", f"must be >= 2, got {c.csa_compress_ratio}")
    if CSA in c.layer_types:
        if c.index_head_dim < c.qk_rope_head_dim:
            _fail(
                "index_head_dim",
                f"={c.index_head_dim} is smaller than qk_rope_head_dim={c.qk_rope_head_dim}",
            )
        if c.index_n_heads <= 0 or c.index_topk <= 0:
            _fail("index_topk", f"and index_n_heads must be positive, got {c.index_topk}, {c.index_n_heads}")
    if c.rope_scaling.enabled and c.rope_scaling.beta_fast <= c.rope_scaling.beta_slow:
        _fail("rope_scaling", f"beta_fast={c.rope_scaling.beta_fast} must exceed beta_slow={c.rope_scaling.beta_slow}")
    if c.quantization is not None:
        _validate_quantized(c)


def _validate_quantized(c: DeepseekV4Config) -> None:
    q = c.quantization
    assert q is not None
    if q.quant_method != "fp8" or q.fmt != "e4m3":
        _fail("quantization_config", f"only fp8/e4m3 is supported, got {q.quant_method}/{q.fmt}")
    if q.scale_fmt not in ("ue8m0", None):
        _fail("quantization_config.scale_fmt", f"must be 'ue8m0' or absent, got {q.scale_fmt!r}")
    if c.expert_dtype not in ("fp4", "fp8"):
        _fail("expert_dtype", f"must be 'fp4' or 'fp8' in a quantized checkpoint, got {c.expert_dtype!r}")
    if c.expert_dtype == "fp4":
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(c, name) % 32:
                _fail(name, f"={getattr(c, name)} must be a multiple of 32 for MXFP4 experts")


def num_blocks(size: int, block: int) -> int:
    """Scale-grid length with ceil division (spec 7.2)."""
    return math.ceil(size / block)
