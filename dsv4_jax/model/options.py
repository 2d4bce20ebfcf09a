"""Static forward options: compute dtype, the KV rounding switch and the device mesh."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    dtype: str = "float32"  # activations and dequantised weights: "float32" or "bfloat16"
    # Whole-sequence forward only: round window/compressed KV as the fp8_ds_mla cache stores them
    # and indexer keys as the fp8 indexer cache does (spec 3.8 / 8.2, the official QAT forward), so
    # the reference matches what an fp8 cache serves (tests/test_runner.py: 0.8% of max|logits|
    # with it, 3% without). `step` ignores it: its cache's own format does the rounding.
    kv_cache_rounding: bool = False
    # The (data, tensor) mesh the weights are sharded over (`dsv4_jax.parallel.sharding`), or None on one
    # device: the routed experts and the attention kernels run under `jax.shard_map` on it.
    mesh: Mesh | None = None
    expert_parallel: bool = False  # routed experts split over data x tensor (else over their ffn dim)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"ForwardOptions.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)
