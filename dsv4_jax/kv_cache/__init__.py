"""DeepSeek-V4 KV cache: storage formats, dtype/backend resolver, capacity planner, paged state.

See docs/kv_cache.md for the resolution policy and the pool layout.
"""

from pallas_kernels.formats import (
    FP8_DS_MLA_QUANT_BLOCK,
    bf16_bytes_per_token,
    bf16_rows_dequantize,
    bf16_rows_quantize,
    fp8_ds_mla_bytes_per_token,
    fp8_ds_mla_dequantize,
    fp8_ds_mla_quantize,
    fp8_ds_mla_scale_bytes,
    indexer_bf16_bytes_per_entry,
    indexer_fp8_bytes_per_entry,
    indexer_fp8_dequantize,
    indexer_fp8_quantize,
)
from dsv4_jax.kv_cache.resolver import (
    ACCEPTED_REQUESTS,
    ATTENTION_BACKENDS,
    DEFAULT_COMPUTE_CAPABILITY,
    FP8_DS_MLA_LOG,
    KV_CACHE_DTYPES,
    KVCacheSpec,
    PoolBytes,
    classify_device,
    lookup_compute_capability,
    parse_compute_capability,
    resolve_for_device,
    resolve_kv_cache,
)
from dsv4_jax.kv_cache.planner import (
    CapacityPlan,
    MeshShape,
    PoolUsage,
    estimate_weight_bytes_per_device,
    live_device_memory,
    max_model_len_that_fits,
    nominal_device_memory,
    plan_capacity,
    pool_usage,
    weight_bytes_breakdown,
)
from dsv4_jax.kv_cache.paged import (
    NO_BLOCK,
    Bf16Rows,
    CompressedPools,
    CompressorState,
    Fp8DsMlaPlanes,
    IndexerBf16Rows,
    IndexerFp8Planes,
    PagedCacheLayout,
    PagedKVCache,
    SlidingPool,
    abstract_paged_cache,
    cache_nbytes,
    compressed_slots,
    init_paged_cache,
    paged_cache_shardings,
    partition_specs,
    read_indexer,
    read_kv,
    reset_slots,
    reset_slots_donated,
    sliding_slots,
    write_indexer,
    write_kv,
)

__all__ = [name for name in dir() if not name.startswith("_")]
