"""Static forward options: compute dtype, KV rounding switch and test-only ablations."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Ablations:
    """Deliberate departures from the spec, used only by the parity tests to show that the
    comparison with the reference model catches each of them (mutation testing)."""

    no_sinks: bool = False
    neox_rope: bool = False
    untransposed_comb: bool = False
    no_inverse_rope: bool = False
    no_yarn: bool = False
    no_csa_overlap: bool = False
    bias_in_weights: bool = False
    minus_one_as_row_zero: bool = False


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    dtype: str = "float32"  # activations and dequantised weights: "float32" or "bfloat16"
    # Round window/compressed KV as the fp8_ds_mla cache stores them and indexer keys as the
    # fp8 indexer cache does (spec 3.8 / 8.2), so the model matches a model reading an fp8 cache.
    kv_cache_rounding: bool = False
    ablations: Ablations = Ablations()

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)
