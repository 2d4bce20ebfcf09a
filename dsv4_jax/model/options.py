"""Static forward options: compute dtype and the KV rounding switch."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    dtype: str = "float32"  # activations and dequantised weights: "float32" or "bfloat16"
    # Round window/compressed KV as the fp8_ds_mla cache stores them and indexer keys as the
    # fp8 indexer cache does (spec 3.8 / 8.2), so the model matches a model reading an fp8 cache.
    kv_cache_rounding: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"ForwardOptions.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)
