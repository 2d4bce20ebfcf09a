"""KV-cache capacity planner: bytes per sequence per pool, and how many sequences fit.

Pools (spec 8.1), per attention layer kind; every pool counts `block_size` token positions per
block (a multiple of 128, so a block holds whole CSA (r=4) and HCA (r=128) entries):

* ``sliding``: the window KV of every attention layer (main layers, plus MTP layers when
  speculative decoding runs them). A live sequence holds at most ceil(window / block) + 1 blocks.
* ``csa`` / ``hca``: one compressed KV entry per `ratio` tokens, `block / ratio` entries per block.
* ``indexer``: one indexer key per CSA entry (same block table as ``csa``).
* ``csa_state`` / ``hca_state``: fp32 compressor state (main + indexer compressor on CSA layers),
  one fixed slot per sequence (not paged by tokens).

Bytes per unit come from the resolved spec (`KVCacheSpec.pool_bytes`): per KV token/entry 584
(fp8_ds_mla), 2 x head_dim (bfloat16) or 4 x head_dim (float32, the exact reference cache); per
indexer key index_head_dim + 4 (fp8), 2 x or 4 x index_head_dim.

Mesh: DeepSeek-V4 has one KV head, so tensor-parallel attention replicates the whole KV cache on
every rank of a TP group, while data-parallel attention gives each rank its own sequences. The
number of concurrent sequences is therefore `data_parallel * sequences per rank`, whatever the TP
size (TP only shrinks the weights each rank holds).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from dsv4_jax.config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4_jax.kv_cache.planes import indexer_planes, kv_planes
from dsv4_jax.kv_cache.resolver import KVCacheSpec
from pallas_kernels import devices, formats

logger = logging.getLogger(__name__)

GiB = 1024**3
MiB = 1024**2
DEFAULT_BLOCK_SIZE = 256
BLOCK_SIZE_MULTIPLE = 128


def nominal_device_memory(device_kind: str) -> int | None:
    """Nominal total bytes of a device kind (pallas_kernels/devices.py: what nvidia-smi reports), or
    None. Used only when no live device can be asked (the planning CLI); at run time the engine
    passes JAX's `memory_stats()["bytes_limit"]`. Override with `--device-memory-gib`."""
    kind = devices.lookup(device_kind)
    return None if kind is None or kind.memory_mib is None else kind.memory_mib * MiB


def live_device_memory(device: Any) -> int | None:
    """JAX's usable memory of a live device (`bytes_limit`); None on CPU, where JAX reports none."""
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    if not stats:
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Parallel sizes: tensor-parallel attention (KV replicated), data-parallel attention, experts."""

    tensor_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int | None = None  # None: all devices

    def __post_init__(self) -> None:
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel),
            ("--data-parallel-size", self.data_parallel),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        ep = self.expert_parallel
        if ep is not None:
            if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or self.num_devices % ep:
                raise ValueError(
                    f"expert-parallel size must be a positive divisor of the {self.num_devices} devices "
                    f"(tensor-parallel x data-parallel), got {ep!r}"
                )

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel * self.data_parallel

    @property
    def expert_parallel_size(self) -> int:
        return self.expert_parallel or self.num_devices

    @property
    def attention(self) -> str:
        if self.tensor_parallel > 1 and self.data_parallel == 1:
            return "tensor-parallel (KV replicated)"
        if self.data_parallel > 1 and self.tensor_parallel == 1:
            return "data-parallel"
        if self.num_devices == 1:
            return "single device"
        return f"tensor-parallel {self.tensor_parallel} x data-parallel {self.data_parallel}"


@dataclasses.dataclass(frozen=True)
class PoolUsage:
    """One pool's share of a sequence at `max_model_len`."""

    name: str
    layers: int
    unit: str  # "token", "entry" or "sequence"
    bytes_per_unit: int  # per layer
    units_per_block: int  # per block and layer (1 for the per-sequence state)
    blocks_per_seq: int  # blocks a sequence holds at max_model_len (state: 0, it is a slot)
    units_per_seq: int  # units a sequence holds at max_model_len, per layer, before rounding
    bytes_per_seq_exact: int  # all layers, no block rounding
    bytes_per_seq: int  # all layers, whole blocks

    @property
    def bytes_per_block(self) -> int:
        """All layers of the pool, one block."""
        return self.layers * self.units_per_block * self.bytes_per_unit


def _check_block_size(config: DeepseekV4Config, block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"--block-size must be a positive integer, got {block_size!r}")
    ratios = sorted({config.compress_ratio(i) for i in range(config.num_hidden_layers)} - {0})
    bad = [r for r in ratios if block_size % r]
    if block_size % BLOCK_SIZE_MULTIPLE or bad:
        raise ValueError(
            f"--block-size {block_size} must be a multiple of {BLOCK_SIZE_MULTIPLE} and of every compress ratio "
            f"{ratios} so that a block holds whole compressed entries; try --block-size {DEFAULT_BLOCK_SIZE}"
        )
    return block_size


def layer_groups(config: DeepseekV4Config, num_mtp_layers: int = 0) -> dict[str, tuple[int, ...]]:
    """Layer indices per pool: sliding (all attention layers incl. served MTP layers), csa, hca."""
    if isinstance(num_mtp_layers, bool) or not isinstance(num_mtp_layers, int) or num_mtp_layers < 0:
        raise ValueError(f"num_mtp_layers must be a non-negative integer, got {num_mtp_layers!r}")
    if num_mtp_layers > config.num_nextn_predict_layers:
        raise ValueError(
            f"num_mtp_layers={num_mtp_layers} exceeds the model's num_nextn_predict_layers="
            f"{config.num_nextn_predict_layers}"
        )
    n = config.num_hidden_layers
    layers = range(n + num_mtp_layers)
    return {
        SLIDING: tuple(layers),
        CSA: tuple(i for i in layers if config.layer_type(i) == CSA),
        HCA: tuple(i for i in layers if config.layer_type(i) == HCA),
    }


def hca_ratio(config: DeepseekV4Config) -> int:
    """The one compress ratio of the HCA layers (the paged cache needs a single one)."""
    ratios = sorted({config.compress_ratio(i) for i in range(config.num_hidden_layers) if config.layer_type(i) == HCA})
    if len(ratios) > 1:
        raise ValueError(f"the paged KV cache needs one HCA compress ratio, got {ratios}")
    return ratios[0] if ratios else 128


def pool_usage(
    config: DeepseekV4Config,
    spec: KVCacheSpec,
    max_model_len: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_mtp_layers: int = 0,
    spare_compressor_windows: int = 0,
) -> tuple[PoolUsage, ...]:
    """Bytes per sequence of every pool at `max_model_len` tokens (`spare_compressor_windows`:
    the compressor windows each slot keeps beyond those read, `PagedCacheLayout`)."""
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
        raise ValueError(f"--max-model-len must be a positive integer, got {max_model_len!r}")
    b = _check_block_size(config, block_size)
    groups = layer_groups(config, num_mtp_layers)
    p = spec.pool_bytes
    seq_len = max_model_len
    window = config.sliding_window
    csa_r, hca_r = config.csa_compress_ratio, hca_ratio(config)
    blocks = math.ceil(seq_len / b)

    def paged(name: str, layers: int, unit: str, per_unit: int, per_block: int, units: int, nblocks: int):
        return PoolUsage(
            name=name, layers=layers, unit=unit, bytes_per_unit=per_unit, units_per_block=per_block,
            blocks_per_seq=nblocks, units_per_seq=units,
            bytes_per_seq_exact=layers * units * per_unit,
            bytes_per_seq=layers * nblocks * per_block * per_unit,
        )

    n_sl, n_csa, n_hca = len(groups[SLIDING]), len(groups[CSA]), len(groups[HCA])
    sliding_blocks = min(sliding_blocks_per_seq(window, b), blocks)

    def slot(name: str, layers: int, per_layer: int) -> PoolUsage:
        return PoolUsage(
            name=name, layers=layers, unit="sequence", bytes_per_unit=per_layer, units_per_block=1,
            blocks_per_seq=0, units_per_seq=1, bytes_per_seq_exact=layers * per_layer, bytes_per_seq=layers * per_layer,
        )

    return (
        paged("sliding", n_sl, "token", p.sliding_per_token, b, min(seq_len, window), sliding_blocks),
        paged("csa", n_csa, "entry", p.csa_per_entry, b // csa_r, seq_len // csa_r, blocks),
        paged("indexer", n_csa, "entry", p.indexer_per_entry, b // csa_r, seq_len // csa_r, blocks),
        paged("hca", n_hca, "entry", p.hca_per_entry, b // hca_r, seq_len // hca_r, blocks),
        slot("csa_state", n_csa,
             (p.csa_state_per_seq + p.csa_indexer_state_per_seq) * (2 + spare_compressor_windows) // 2),
        slot("hca_state", n_hca, p.hca_state_per_seq * (1 + spare_compressor_windows)),
    )


def sliding_blocks_per_seq(window: int, block_size: int) -> int:
    """Blocks a live sequence holds in the sliding pool: ceil(window / block) + 1 (a ring)."""
    return math.ceil(window / block_size) + 1


# ---- weights -----------------------------------------------------------------------------------
def _linear_bytes(out: int, inp: int, quantized: bool) -> int:
    """fp8 block-quantised linear (1 B + one UE8M0 byte per 128x128 block) or bf16."""
    if quantized:
        return out * inp + math.ceil(out / 128) * math.ceil(inp / 128)
    return 2 * out * inp


def _expert_linear_bytes(out: int, inp: int, expert_dtype: str | None) -> int:
    if expert_dtype == "fp4":  # MXFP4: half a byte per weight + one E8M0 scale per 32 inputs
        return out * inp // 2 + out * math.ceil(inp / 32)
    if expert_dtype == "fp8":
        return _linear_bytes(out, inp, True)
    return 2 * out * inp


def weight_bytes_breakdown(config: DeepseekV4Config, num_mtp_layers: int = 0) -> dict[str, int]:
    """Checkpoint bytes by how they are placed (spec 7.1 shapes): an estimate for planning.

    Keys: `vocab` (embedding + head, sharded by vocabulary under TP), `tp_sharded` (query, output,
    indexer-query projections and shared experts: sharded over heads under TP), `replicated`
    (KV projection, compressors, norms, mHC, router: every rank holds them), `experts`
    (routed experts, sharded over the expert-parallel ranks)."""
    c = config
    q = c.quantization is not None
    h, n, d, qr = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank
    mix = (2 + c.hc_mult) * c.hc_mult
    out = {"vocab": 2 * 2 * c.vocab_size * h, "tp_sharded": 0, "replicated": 0, "experts": 0}
    out["replicated"] += 2 * h + 4 * (c.hc_mult * c.hc_dim + c.hc_mult + 1)  # final norm, hc_head
    for layer in range(c.num_hidden_layers + num_mtp_layers):
        kind = c.layer_type(layer)
        shard = (
            _linear_bytes(n * d, qr, q)  # wq_b
            + _linear_bytes(c.o_groups * c.o_lora_rank, n * d // c.o_groups, q)  # wo_a
            + _linear_bytes(h, c.o_groups * c.o_lora_rank, q)  # wo_b
            + 4 * n  # attn_sink
            + c.n_shared_experts * 3 * _linear_bytes(c.moe_intermediate_size, h, q)
        )
        rep = (
            2 * 2 * h  # attn_norm, ffn_norm
            + 2 * 4 * (mix * c.hc_dim + mix + 3)  # hc_attn_*, hc_ffn_*
            + _linear_bytes(qr, h, q) + 2 * qr  # wq_a, q_norm
            + _linear_bytes(d, h, q) + 2 * d  # wkv, kv_norm
            + 2 * c.n_routed_experts * h  # router
            + (4 * c.vocab_size * c.num_experts_per_tok if c.is_hash_layer(layer) and layer < c.num_hidden_layers
               else 4 * c.n_routed_experts)  # tid2eid (int32 on device) or bias
        )
        if kind != SLIDING:
            ratio = c.compress_ratio(layer)
            width = (2 if kind == CSA else 1) * d
            rep += 2 * 2 * width * h + 4 * ratio * width + 2 * d  # compressor wkv, wgate, ape, norm
        if kind == CSA:
            ih, idim = c.index_n_heads, c.index_head_dim
            shard += _linear_bytes(ih * idim, qr, q)  # indexer wq_b
            rep += 2 * ih * h + 2 * 2 * 2 * idim * h + 4 * c.csa_compress_ratio * 2 * idim + 2 * idim
        if layer >= c.num_hidden_layers:  # MTP: e_proj, h_proj, enorm, hnorm, norm, hc_head
            rep += 2 * _linear_bytes(h, h, q) + 3 * 2 * h + 4 * (c.hc_mult * c.hc_dim + c.hc_mult + 1)
        out["tp_sharded"] += shard
        out["replicated"] += rep
        out["experts"] += c.n_routed_experts * (
            2 * _expert_linear_bytes(c.moe_intermediate_size, h, c.expert_dtype)
            + _expert_linear_bytes(h, c.moe_intermediate_size, c.expert_dtype)
        )
    return out


def estimate_weight_bytes_per_device(config: DeepseekV4Config, mesh: MeshShape, num_mtp_layers: int = 0) -> int:
    """Weights one device holds: vocab and head-sharded parts / TP, experts / EP, the rest replicated."""
    w = weight_bytes_breakdown(config, num_mtp_layers)
    tp = mesh.tensor_parallel
    return (
        math.ceil(w["vocab"] / tp) + math.ceil(w["tp_sharded"] / tp) + w["replicated"]
        + math.ceil(w["experts"] / mesh.expert_parallel_size)
    )


# ---- capacity ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    spec: KVCacheSpec
    mesh: MeshShape
    max_model_len: int
    block_size: int
    num_mtp_layers: int
    pools: tuple[PoolUsage, ...]
    sized_from: str  # "memory" or "max_num_seqs"
    device_memory_bytes: int | None
    gpu_memory_utilization: float
    weight_bytes: int  # per device, as placed
    reserved_bytes: int  # per device, activations / workspace
    kv_budget_bytes: int  # per device (rank); in max_num_seqs mode, the pools' own size
    num_seq_slots: int  # per rank: compressor-state slots and sliding-window rings
    num_blocks: dict[str, int]  # per rank: "sliding", "compressed" (csa, indexer and hca share it)
    max_seqs_per_rank: int  # sequences of max_model_len tokens that run at once on one rank
    snapshot_bytes: int = 0  # per device: the prefix cache's snapshots (kv_cache/snapshots.py)
    spare_compressor_windows: int = 0  # 1 for speculative decoding (PagedCacheLayout)

    @property
    def bytes_per_seq(self) -> int:
        """Whole blocks, all pools, at max_model_len."""
        return sum(p.bytes_per_seq for p in self.pools)

    @property
    def bytes_per_seq_exact(self) -> int:
        return sum(p.bytes_per_seq_exact for p in self.pools)

    @property
    def max_concurrent_seqs(self) -> int:
        """Over the whole mesh: data-parallel ranks x sequences per rank (TP ranks share theirs)."""
        return self.mesh.data_parallel * self.max_seqs_per_rank

    def pool(self, name: str) -> PoolUsage:
        return next(p for p in self.pools if p.name == name)


def _compressed_bytes_per_block(pools: tuple[PoolUsage, ...]) -> int:
    return sum(p.bytes_per_block for p in pools if p.name in ("csa", "indexer", "hca"))


def _fixed_bytes_per_slot(pools: tuple[PoolUsage, ...]) -> int:
    return sum(p.bytes_per_seq for p in pools if p.name in ("sliding", "csa_state", "hca_state"))


def max_model_len_that_fits(
    config: DeepseekV4Config, spec: KVCacheSpec, budget_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE,
    num_mtp_layers: int = 0, spare_compressor_windows: int = 0,
) -> int:
    """Largest max_model_len (a multiple of block_size) whose one sequence fits in `budget_bytes`."""
    def need(n_blocks: int) -> int:
        pools = pool_usage(config, spec, n_blocks * block_size, block_size, num_mtp_layers, spare_compressor_windows)
        return sum(p.bytes_per_seq for p in pools)

    lo, hi = 0, 1
    while need(hi) <= budget_bytes and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= budget_bytes else (lo, mid)
    return lo * block_size


def _check_plan_flags(
    config: DeepseekV4Config, max_model_len: int, gpu_memory_utilization: Any, max_num_seqs: Any
) -> None:
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if max_num_seqs is not None and (isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int)
                                     or max_num_seqs < 1):
        raise ValueError(f"--max-num-seqs must be a positive integer, got {max_num_seqs!r}")
    if max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}; pass --max-model-len {config.max_position_embeddings} or less"
        )


def _does_not_fit(
    config: DeepseekV4Config, spec: KVCacheSpec, pools: tuple[PoolUsage, ...], budget: int, *,
    max_model_len: int, device_memory_bytes: int, gpu_memory_utilization: float, weight_bytes: int,
    reserved_bytes: int, block_size: int, num_mtp_layers: int, snapshot_bytes: int = 0,
    spare_compressor_windows: int = 0,
) -> ValueError:
    """The error for a budget below one full-length sequence, with the longest one that fits."""
    per_seq = sum(p.bytes_per_seq for p in pools)
    fits = (max_model_len_that_fits(config, spec, budget, block_size, num_mtp_layers, spare_compressor_windows)
            if budget > 0 else 0)
    return ValueError(
        f"--max-model-len {max_model_len} does not fit: one sequence needs {per_seq / GiB:.2f} GiB of "
        f"{spec.kv_cache_dtype} KV cache ("
        + ", ".join(f"{p.name} {p.bytes_per_seq / GiB:.3f}" for p in pools)
        + f" GiB), but each device has {budget / GiB:.2f} GiB left ({device_memory_bytes / GiB:.2f} GiB x "
        f"{gpu_memory_utilization} - {weight_bytes / GiB:.2f} GiB weights - {reserved_bytes / GiB:.2f} GiB "
        f"reserved for activations"
        + (f" - {snapshot_bytes / GiB:.2f} GiB of prefix-cache snapshots (--num-prefix-snapshots)" if snapshot_bytes
           else "")
        + f"). Pass --max-model-len {fits} or less"
        + (", " if fits else " (nothing fits), ")
        + "raise --gpu-memory-utilization, "
        + ("lower --max-num-batched-tokens (a step's activations grow with its tokens), " if reserved_bytes else "")
        + "or spread the weights over more devices"
        + ("" if spec.kv_cache_dtype == "fp8_ds_mla" else ", or use --kv-cache-dtype fp8 where the GPU has fp8")
    )


# ---- idle layers -----------------------------------------------------------------------------
def _pool_planes(pool: PoolUsage, spec: KVCacheSpec, blocks: int) -> list[Any]:
    """The planes of one rank's `pool` with `blocks` blocks, shapes only, as the cache lays them
    out (`planes.kv_planes` / `indexer_planes`, idle layers included); [] for state pools."""
    import jax

    if pool.unit == "sequence" or not pool.layers or not blocks:
        return []
    lead = (pool.layers, blocks, pool.units_per_block)
    if pool.name == "indexer":
        planes = indexer_planes(spec.indexer_dtype, lead, spec.index_head_dim, jax.ShapeDtypeStruct)
    else:
        planes = kv_planes(spec.kv_cache_dtype, lead, spec.head_dim, spec.rope_dim, jax.ShapeDtypeStruct)
    return jax.tree.leaves(planes)


def idle_layer_bytes(pools: tuple[PoolUsage, ...], spec: KVCacheSpec, sliding_blocks: int, compressed_blocks: int
                     ) -> int:
    """Bytes of one rank's idle pool layers (`formats.idle_layers`): a plane of 1-byte elements of
    2 to 4 GiB gets layers that take it just past 4 GiB, because the Pallas kernels would index it
    with wrapping int32 offsets (an illegal memory access on an H200). 0 for most pools; per such
    plane at most 2 GiB and one layer (4 GiB for a one-layer plane)."""
    total = 0
    for pool in pools:
        blocks = sliding_blocks if pool.name == "sliding" else compressed_blocks
        for x in _pool_planes(pool, spec, blocks):
            total += (x.shape[0] - pool.layers) * math.prod(x.shape[1:]) * x.dtype.itemsize
    return total


def _band_edges(pools: tuple[PoolUsage, ...], spec: KVCacheSpec) -> list[int]:
    """Compressed block counts at which a compressed plane of 1-byte elements holds the most
    elements below the 2-4 GiB band (so needs no idle layers)."""
    edges = []
    for pool in pools:
        if pool.name in ("csa", "indexer", "hca"):
            edges += [formats.INT32_OFFSET_LIMIT // math.prod(x.shape[:1] + x.shape[2:])
                      for x in _pool_planes(pool, spec, 1) if x.dtype.itemsize == 1]
    return edges


def _with_idle_layers(pools: tuple[PoolUsage, ...], spec: KVCacheSpec, budget: int, slots: int, compressed: int
                      ) -> tuple[int, int]:
    """(the most compressed blocks, at most `compressed`, that fit `budget` beside `slots` sequence
    slots and the idle layers both need, those idle layers' bytes); fewer blocks only where some
    plane falls in the 2-4 GiB band.
    Idle layers come and go as a plane crosses its band, so more blocks can fit just below a band
    edge than just above it: the count is looked for below `compressed` and below every edge."""
    per_slot, per_block = _fixed_bytes_per_slot(pools), _compressed_bytes_per_block(pools)
    sliding = slots * pools[0].blocks_per_seq
    if not per_block:
        return compressed, idle_layer_bytes(pools, spec, sliding, compressed)

    def largest_fitting(count: int) -> int:
        while count > 0:
            over = slots * per_slot + count * per_block + idle_layer_bytes(pools, spec, sliding, count) - budget
            if over <= 0:
                break
            count -= -(-over // per_block)
        return max(count, 0)

    best = max(largest_fitting(c) for c in [compressed, *(e for e in _band_edges(pools, spec) if e < compressed)])
    idle = idle_layer_bytes(pools, spec, sliding, best)
    if idle:
        logger.info("KV cache: %.2f GiB of idle pool layers (%d compressed blocks instead of %d), so that no "
                    "plane of 1-byte elements holds 2 to 4 GiB, which the Pallas kernels would index with wrapping "
                    "int32 offsets", idle / GiB, best, compressed)
    return best, idle


def _slots_and_compressed_blocks(
    pools: tuple[PoolUsage, ...], budget: int, max_num_seqs: int | None, max_model_len: int
) -> tuple[int, int]:
    """(sequence slots, compressed blocks) of one rank's `budget` bytes, which hold one sequence.

    Each slot costs its sliding-window ring and compressor state; the rest is compressed blocks.
    Without `max_num_seqs` every full-length sequence that fits gets a slot."""
    per_block = _compressed_bytes_per_block(pools)
    per_slot = _fixed_bytes_per_slot(pools)
    seq_blocks = pools[1].blocks_per_seq  # compressed blocks of one full-length sequence
    if max_num_seqs is None:
        slots = budget // sum(p.bytes_per_seq for p in pools)
    else:
        slots = max_num_seqs
        if slots * per_slot > budget - seq_blocks * per_block:
            most = (budget - seq_blocks * per_block) // per_slot
            raise ValueError(
                f"--max-num-seqs {max_num_seqs} does not fit: each sequence slot holds {per_slot / MiB:.1f} MiB of "
                f"sliding-window KV and compressor state, and one {max_model_len}-token sequence needs "
                f"{seq_blocks * per_block / GiB:.2f} GiB of compressed KV, in {budget / GiB:.2f} GiB; pass "
                f"--max-num-seqs {most} or less, or a smaller --max-model-len"
            )
    return slots, (budget - slots * per_slot) // per_block if per_block else 0


def _plan_without_device_memory(common: dict[str, Any], max_num_seqs: int | None) -> CapacityPlan:
    """Pools sized from `max_num_seqs x max_model_len` positions plus one block per sequence."""
    if max_num_seqs is None:
        raise ValueError(
            "no device memory is known (JAX reports none on CPU): pass --max-num-seqs so the KV pools are "
            "sized from max_num_seqs x max_model_len"
        )
    pools, slots = common["pools"], max_num_seqs
    compressed = math.ceil(slots * common["max_model_len"] / common["block_size"]) + slots
    return CapacityPlan(
        **common, sized_from="max_num_seqs", device_memory_bytes=None,
        kv_budget_bytes=slots * _fixed_bytes_per_slot(pools) + compressed * _compressed_bytes_per_block(pools),
        num_seq_slots=slots, num_blocks={"sliding": slots * pools[0].blocks_per_seq, "compressed": compressed},
        max_seqs_per_rank=slots,
    )


def plan_capacity(
    config: DeepseekV4Config,
    spec: KVCacheSpec,
    *,
    max_model_len: int,
    device_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    weight_bytes: int = 0,
    mesh: MeshShape | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_seqs: int | None = None,
    num_mtp_layers: int = 0,
    reserved_bytes: int = 0,
    snapshot_bytes: int = 0,
    spare_compressor_windows: int = 0,
) -> CapacityPlan:
    """Size the pools of one rank and count the sequences that fit.

    With `device_memory_bytes` (per device; JAX's `bytes_limit` at run time): the KV budget is
    `device_memory * gpu_memory_utilization - weight_bytes - reserved_bytes - snapshot_bytes` (the
    prefix cache's snapshots, per device). Each sequence slot
    costs its sliding-window ring and compressor state; the rest goes to compressed blocks. With
    `max_num_seqs` the slots are fixed and the remaining memory is all compressed blocks; without
    it, as many full-length sequences as fit get a slot each.

    Without device memory (CPU, where JAX reports none): `max_num_seqs` is required and the
    compressed pool holds `max_num_seqs * max_model_len` positions plus one block per sequence.

    Raises ValueError (naming the numbers and flags) when not even one sequence fits."""
    _check_plan_flags(config, max_model_len, gpu_memory_utilization, max_num_seqs)
    pools = pool_usage(config, spec, max_model_len, block_size, num_mtp_layers, spare_compressor_windows)
    common = dict(
        spec=spec, mesh=mesh or MeshShape(), max_model_len=max_model_len, block_size=block_size,
        num_mtp_layers=num_mtp_layers, pools=pools, gpu_memory_utilization=float(gpu_memory_utilization),
        weight_bytes=int(weight_bytes), reserved_bytes=int(reserved_bytes), snapshot_bytes=int(snapshot_bytes),
        spare_compressor_windows=spare_compressor_windows,
    )
    if device_memory_bytes is None:
        return _plan_without_device_memory(common, max_num_seqs)
    budget = (int(device_memory_bytes * gpu_memory_utilization) - int(weight_bytes) - int(reserved_bytes)
              - int(snapshot_bytes))
    if budget < sum(p.bytes_per_seq for p in pools):
        raise _does_not_fit(
            config, spec, pools, budget, max_model_len=max_model_len, device_memory_bytes=device_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization, weight_bytes=weight_bytes, reserved_bytes=reserved_bytes,
            block_size=block_size, num_mtp_layers=num_mtp_layers, snapshot_bytes=snapshot_bytes,
            spare_compressor_windows=spare_compressor_windows,
        )
    slots, compressed = _slots_and_compressed_blocks(pools, budget, max_num_seqs, max_model_len)
    compressed, idle = _with_idle_layers(pools, spec, budget, slots, compressed)
    seq_blocks = pools[1].blocks_per_seq  # compressed blocks of one full-length sequence
    per_block = _compressed_bytes_per_block(pools)
    needed = slots * _fixed_bytes_per_slot(pools) + compressed * per_block + idle
    if (per_block and compressed < seq_blocks) or needed > budget:
        raise ValueError(
            f"{slots} sequence slots leave no room for one {max_model_len}-token sequence beside the "
            f"{idle / GiB:.2f} GiB of idle pool layers that keep every plane of 1-byte elements out of 2 to 4 GiB "
            f"(the Pallas kernels would index those with wrapping int32 offsets), in {budget / GiB:.2f} GiB: pass a "
            f"smaller --max-num-seqs or --max-model-len, or a larger --gpu-memory-utilization"
        )
    full = compressed // seq_blocks if seq_blocks and per_block else slots
    return CapacityPlan(
        **common, sized_from="memory", device_memory_bytes=int(device_memory_bytes), kv_budget_bytes=budget,
        num_seq_slots=slots, num_blocks={"sliding": slots * pools[0].blocks_per_seq, "compressed": compressed},
        max_seqs_per_rank=min(slots, full),
    )
