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
from typing import Any, Mapping, NoReturn

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
        """Parse `path` (a model directory or its config.json); every problem is one error naming the file."""
        file = _config_file(Path(path))
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{file}: must hold a JSON object of config fields, got {_json_kind(raw)}")
        try:
            return cls.from_dict(raw)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

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
_REQUIRED = [f.name for f in dataclasses.fields(DeepseekV4Config) if f.default is dataclasses.MISSING]
SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
# Keys `_normalise` maps itself; every other key naming a field is passed through as it is.
_HANDLED = {
    "compress_ratios", "layer_types", "compress_rates", "num_hash_layers", "mlp_layer_types",
    "rope_parameters", "rope_scaling", "rope_theta", "compress_rope_theta", "qk_rope_head_dim",
    "quantization_config", "quantization",
}
# The JSON kinds a field may hold, as `_expect` names them.
_ALLOWED = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
    "list": "a list", "object": "an object",
}
_ANNOTATION_KINDS = {"int": "int", "float": "float", "str": "str", "bool": "bool", "str | None": "str"}


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for types, name in (((int, float), "a number"), (str, "a string"), ((list, tuple), "a list"), (dict, "an object")):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _shown(value: Any) -> str:
    """A value as the user wrote it in config.json (clipped: a wrong list can be long)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return (text if len(text) <= 80 else text[:77] + "...") + f" ({_json_kind(value)})"


def _expect(field: str, value: Any, kind: str) -> Any:
    """`value` of config field `field` if it is of JSON kind `kind` (a float for "float"; a bool
    is not an int), else a ValueError naming the field, the value and what is allowed."""
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "list": isinstance(value, (list, tuple)),
        "object": isinstance(value, dict),
    }[kind]
    if not ok:
        _fail(field, f"must be {_ALLOWED[kind]}, got {_shown(value)}")
    return float(value) if kind == "float" else value


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    """Map DeepSeek or transformers config keys onto our field names (`_validate` checks the rest)."""
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        _fail("model_type", f"must be {' or '.join(map(repr, SUPPORTED_MODEL_TYPES))} (this package runs "
                            f"DeepSeek-V4 only), got {_shown(model_type)}")
    out: dict[str, Any] = {**_layer_kinds(raw), **_rope(raw), **_quantization(raw)}
    out["num_hash_layers"] = _num_hash_layers(raw)
    rope_head_dim = _qk_rope_head_dim(raw)
    if rope_head_dim is not None:
        out["qk_rope_head_dim"] = rope_head_dim
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):  # transformers allows several; the first one ends generation here
        if not eos:
            _fail("eos_token_id", "must be an integer or a non-empty list of integers, got []")
        out["eos_token_id"] = eos[0]
    for key, value in raw.items():
        # Unknown keys (dspark_*, vision_*, HF bookkeeping) are tolerated: configs grow fields.
        if key not in _HANDLED and key not in out and key in _FIELDS:
            out[key] = value
    if "quantization" not in out:
        out["expert_dtype"] = None  # an unquantized checkpoint stores experts like the rest
    missing = [name for name in _REQUIRED if name not in out]
    if missing:
        raise ValueError(
            f"invalid DeepSeek-V4 config: missing required field(s) {', '.join(f'`{m}`' for m in missing)} "
            "(each a positive integer)"
        )
    return out


def _layer_kinds(raw: dict[str, Any]) -> dict[str, Any]:
    """`compress_ratios` (and the CSA ratio) from DeepSeek's `compress_ratios` or transformers'
    `layer_types` + `compress_rates`."""
    if "compress_ratios" in raw:
        ratios = _expect("compress_ratios", raw["compress_ratios"], "list")
        return {"compress_ratios": tuple(_expect(f"compress_ratios[{i}]", r, "int") for i, r in enumerate(ratios))}
    if raw.get("layer_types") is None:
        raise ValueError(
            "invalid DeepSeek-V4 config: needs `compress_ratios` (DeepSeek) or `layer_types` (transformers)"
        )
    rates = {**_HF_DEFAULT_RATES, **_expect("compress_rates", raw.get("compress_rates") or {}, "object")}
    ratios = []
    for i, kind in enumerate(_expect("layer_types", raw["layer_types"], "list")):
        if not isinstance(kind, str) or kind not in _HF_LAYER_TYPES:
            _fail(f"layer_types[{i}]", f"must be one of {', '.join(_HF_LAYER_TYPES)}, got {_shown(kind)}")
        ratios.append(0 if kind == "sliding_attention" else _expect(f"compress_rates.{kind}", rates[kind], "int"))
    csa = "compressed_sparse_attention"
    return {"compress_ratios": tuple(ratios), "csa_compress_ratio": _expect(f"compress_rates.{csa}", rates[csa], "int")}


def _num_hash_layers(raw: dict[str, Any]) -> int:
    """DeepSeek's `num_hash_layers`, or the leading `hash_moe` entries of transformers' `mlp_layer_types`."""
    if "num_hash_layers" in raw:
        return _expect("num_hash_layers", raw["num_hash_layers"], "int")
    if raw.get("mlp_layer_types") is None:
        return 0
    kinds = list(_expect("mlp_layer_types", raw["mlp_layer_types"], "list"))
    n_hash = sum(1 for k in kinds if k == "hash_moe")
    if kinds[:n_hash] != ["hash_moe"] * n_hash:
        _fail("mlp_layer_types", f"must list the hash_moe layers first, got {_shown(kinds)}")
    return n_hash


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE fields from DeepSeek's flat keys or transformers' `rope_parameters` {main, compress}."""
    out: dict[str, Any] = {}
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict):
        compress = _expect("rope_parameters.compress", params.get("compress", {}), "object")
        main_theta = params["main"].get("rope_theta", raw.get("rope_theta", 10000.0))
        out["rope_theta"] = _expect("rope_parameters.main.rope_theta", main_theta, "float")
        compress_theta = compress.get("rope_theta", raw.get("compress_rope_theta", 160000.0))
        out["compress_rope_theta"] = _expect("rope_parameters.compress.rope_theta", compress_theta, "float")
        where, scaling = "rope_parameters.compress", compress
    else:
        for key in ("rope_theta", "compress_rope_theta"):
            if key in raw:
                out[key] = _expect(key, raw[key], "float")
        where = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        scaling = raw.get("rope_scaling") or (params if isinstance(params, dict) else None)
        if scaling is not None:
            _expect(where, scaling, "object")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        out["rope_scaling"] = YarnScaling(
            factor=_expect(f"{where}.factor", scaling.get("factor", 1.0), "float"),
            original_max_position_embeddings=_expect(
                f"{where}.original_max_position_embeddings", scaling.get("original_max_position_embeddings", 0), "int"
            ),
            beta_fast=_expect(f"{where}.beta_fast", scaling.get("beta_fast", 32.0), "float"),
            beta_slow=_expect(f"{where}.beta_slow", scaling.get("beta_slow", 1.0), "float"),
        )
    return out


def _qk_rope_head_dim(raw: dict[str, Any]) -> int | None:
    """DeepSeek's `qk_rope_head_dim`, or transformers' `head_dim x partial_rotary_factor`."""
    if "qk_rope_head_dim" in raw:
        return _expect("qk_rope_head_dim", raw["qk_rope_head_dim"], "int")
    if raw.get("partial_rotary_factor") is not None and "head_dim" in raw:
        head_dim = _expect("head_dim", raw["head_dim"], "int")
        return round(head_dim * _expect("partial_rotary_factor", raw["partial_rotary_factor"], "float"))
    return None


def _quantization(raw: dict[str, Any]) -> dict[str, Any]:
    """`quantization` (and `expert_dtype` where only the quantization_config names it)."""
    qc = raw.get("quantization_config")
    if not qc:
        return {}
    qc = _expect("quantization_config", qc, "object")
    where = "quantization_config.weight_block_size"
    block = _expect(where, qc.get("weight_block_size") or [128, 128], "list")
    if len(block) != 2:
        _fail(where, f"must be [rows, cols], got {_shown(block)}")
    scale_fmt = qc.get("scale_fmt")
    out: dict[str, Any] = {"quantization": QuantizationConfig(
        quant_method=_expect("quantization_config.quant_method", qc.get("quant_method", "fp8"), "str"),
        fmt=_expect("quantization_config.fmt", qc.get("fmt", "e4m3"), "str"),
        scale_fmt=None if scale_fmt is None else _expect("quantization_config.scale_fmt", scale_fmt, "str"),
        activation_scheme=_expect(
            "quantization_config.activation_scheme", qc.get("activation_scheme", "dynamic"), "str"
        ),
        weight_block_size=tuple(_expect(f"{where}[{i}]", b, "int") for i, b in enumerate(block)),
    )}
    if raw.get("expert_dtype") is None and qc.get("expert_dtype") is not None:
        out["expert_dtype"] = qc["expert_dtype"]
    return out


def _check_types(c: DeepseekV4Config) -> None:
    """Every scalar field holds its annotated kind, so range checks compare numbers with numbers."""
    for field in dataclasses.fields(c):
        value = getattr(c, field.name)
        if field.type in _ANNOTATION_KINDS and not (value is None and field.type.endswith("None")):
            _expect(field.name, value, _ANNOTATION_KINDS[field.type])
        elif field.type == "tuple[int, ...]":
            for i, entry in enumerate(_expect(field.name, value, "list")):
                _expect(f"{field.name}[{i}]", entry, "int")


def _config_file(path: Path) -> Path:
    """`path/config.json` for a directory, `path` for a file; FileNotFoundError saying which is missing."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json (a model directory holds config.json and the *.safetensors files)"
            )
        return path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"model directory or config file {path} does not exist")
    return path


def _fail(field: str, message: str) -> NoReturn:
    raise ValueError(f"invalid DeepSeek-V4 config: `{field}` {message}")


def _validate(c: DeepseekV4Config) -> None:
    _check_types(c)
    positive = [
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "moe_intermediate_size",
        "n_routed_experts", "num_experts_per_tok", "hc_mult", "max_position_embeddings",
    ]
    for name in positive:
        if getattr(c, name) <= 0:
            _fail(name, f"must be positive, got {getattr(c, name)}")
    for name in ("hc_sinkhorn_iters", "n_shared_experts", "num_nextn_predict_layers"):
        if getattr(c, name) < 0:
            _fail(name, f"must be >= 0, got {getattr(c, name)}")
    for name in ("bos_token_id", "eos_token_id"):
        if not 0 <= getattr(c, name) < c.vocab_size:
            _fail(name, f"must be a token id in [0, vocab_size={c.vocab_size}), got {getattr(c, name)}")
    _validate_attention(c)
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
    if c.quantization is not None:
        _validate_quantized(c)


def _validate_attention(c: DeepseekV4Config) -> None:
    """Heads, RoPE and the per-layer attention kinds (compress ratios, indexer)."""
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


def _validate_quantized(c: DeepseekV4Config) -> None:
    q = c.quantization
    assert q is not None
    if q.quant_method != "fp8" or q.fmt != "e4m3":
        _fail("quantization_config", f"only fp8/e4m3 is supported, got {q.quant_method}/{q.fmt}")
    if min(q.weight_block_size) <= 0:
        _fail("quantization_config.weight_block_size", f"must be positive, got {list(q.weight_block_size)}")
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
