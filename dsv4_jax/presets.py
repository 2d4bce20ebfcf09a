"""Named configs: the real DeepSeek-V4-Flash, the built-in demo model and small test models."""

from __future__ import annotations

from typing import Any, Callable

from dsv4_jax.config import DeepseekV4Config, QuantizationConfig, YarnScaling

_FP8 = QuantizationConfig(
    quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", activation_scheme="dynamic", weight_block_size=(128, 128)
)


def dsv4_flash() -> DeepseekV4Config:
    """DeepSeek-V4-Flash (April release), spec section 1.1. Only ever built abstractly in tests."""
    return DeepseekV4Config(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        sliding_window=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6, num_hash_layers=3,
        rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
        max_position_embeddings=1048576, index_n_heads=64, index_head_dim=128, index_topk=512,
        n_shared_experts=1, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
        routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        num_nextn_predict_layers=1, expert_dtype="fp4", quantization=_FP8,
    )


def _small(vocab_size: int) -> DeepseekV4Config:
    # Spec section 10: every feature active at CPU-test size. head_dim 96 = one 64-wide fp8 block
    # of NoPE dims + 32 RoPE dims; layer 0 sliding + hash routing, 1 and 3 CSA, 2 HCA, MTP sliding.
    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        head_dim=96, qk_rope_head_dim=32, q_lora_rank=128, o_groups=2, o_lora_rank=64,
        sliding_window=8, compress_ratios=(0, 4, 128, 4, 0),
        moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, num_hash_layers=1,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling=YarnScaling(factor=4, original_max_position_embeddings=64, beta_fast=32, beta_slow=1),
        max_position_embeddings=1024, index_n_heads=8, index_head_dim=64, index_topk=8,
        n_shared_experts=1, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
        hc_sinkhorn_iters=20, num_nextn_predict_layers=1,
    )


def dsv4_tiny() -> DeepseekV4Config:
    """The built-in demo model: the real 129280-token vocabulary so the real tokenizer works."""
    return _small(129280)


def dsv4_tiny_test() -> DeepseekV4Config:
    """The same model with a 512-token vocabulary, for fast tests."""
    return _small(512)


PRESETS: dict[str, Callable[[], DeepseekV4Config]] = {
    "dsv4-flash": dsv4_flash,
    "dsv4-tiny": dsv4_tiny,
    "dsv4-tiny-test": dsv4_tiny_test,
}


def get_config(spec: "DeepseekV4Config | str | dict[str, Any]") -> DeepseekV4Config:
    """A config object, a preset name, or a config.json dict -> DeepseekV4Config."""
    if isinstance(spec, DeepseekV4Config):
        return spec
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown model preset {spec!r}; known presets: {sorted(PRESETS)}")
        return PRESETS[spec]()
    if isinstance(spec, dict):
        return DeepseekV4Config.from_dict(spec)
    raise TypeError(f"expected a DeepseekV4Config, a preset name or a config dict, got {type(spec).__name__}")


def quantized(config: DeepseekV4Config, scales: str = "ue8m0", expert_dtype: str = "fp4") -> DeepseekV4Config:
    """The same model stored as DeepSeek ships it: fp8 linears + MXFP4 (or fp8) experts."""
    q = QuantizationConfig(scale_fmt=None if scales == "f32" else "ue8m0")
    return config.replace(quantization=q, expert_dtype=expert_dtype)
