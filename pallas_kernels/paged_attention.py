"""Building blocks shared by the paged attention kernels (`sparse_decode`, `sparse_prefill`):
pool-plane helpers, the in-kernel row gather, fp8 dequantisation and online-softmax step, the
wrappers' common setup (`pad_heads`: silent heads for small models; `pool_operands`: the pools
as kernel operands with their BlockSpecs), and `paged_attention_reference`, the pure-JAX
attention over the paged cache whose numerics both kernels' references are defined by.

Pools are tuples of planes with leading dims [layers, blocks, units] (or [blocks, units]):
fp8_ds_mla = (e4m3 nope, bf16 rope, uint8 UE8M0 scales) or bf16 rows, see formats.py; the
references also read float32 rows, the exact format no kernel reads (`reference_operand` is
the references' one rounding rule).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import formats

DIM_CHUNK = formats.FP8_DS_MLA_QUANT_BLOCK  # 64: one UE8M0 scale per chunk of NoPE dims
FLOAT32 = "float32"  # the pool format of exact float32 rows (KV or indexer keys): references only
_HIGHEST = lax.Precision.HIGHEST


CHUNK_WIDTHS = (DIM_CHUNK, 32, 16)  # widest first; the narrowest is the smallest width a plane may have a multiple of


def chunk_width(width: int) -> int:
    """Width of the column chunks of a plane: 64, or 32 / 16 for planes that are not a multiple
    of 64 wide (small test models); Triton blocks must be powers of two and dots >= 16 deep."""
    for w in CHUNK_WIDTHS:
        if width % w == 0:
            return w
    raise ValueError(f"plane width {width} is not a multiple of {CHUNK_WIDTHS[-1]}")


def dim_chunks(planes) -> tuple[tuple[int, int, int], ...]:
    """(plane, first column, width) of every dim chunk in head_dim order: the NoPE dims in 64-wide
    chunks (each has one UE8M0 scale byte, column // 64) then the RoPE dims, for fp8_ds_mla; the
    bf16 rows otherwise."""
    planes = tuple(planes)
    if len(planes) == 3:
        nope, rope = planes[0].shape[-1], planes[1].shape[-1]
        if nope % DIM_CHUNK:
            raise ValueError(f"fp8_ds_mla kernels need the NoPE dims ({nope}) in multiples of {DIM_CHUNK}")
        wr = chunk_width(rope)
        nope_chunks = tuple((0, c, DIM_CHUNK) for c in range(0, nope, DIM_CHUNK))
        return nope_chunks + tuple((1, c, wr) for c in range(0, rope, wr))
    width = planes[0].shape[-1]
    w = chunk_width(width)
    return tuple((0, c, w) for c in range(0, width, w))


def chunk_offsets(chunks) -> list[int]:
    """Column of each chunk within head_dim."""
    out, col = [], 0
    for _, _, w in chunks:
        out.append(col)
        col += w
    return out


# ---- pools ------------------------------------------------------------------------------------
def pool_format(planes) -> str:
    """"fp8_ds_mla" (three planes), "bf16" (one plane of bf16 rows) or "float32" (one plane of
    float32 rows, read only by the references)."""
    planes = tuple(planes)
    if len(planes) == 3 and planes[0].dtype == jnp.float8_e4m3fn:
        return "fp8_ds_mla"
    if len(planes) == 1 and planes[0].dtype == jnp.bfloat16:
        return "bf16"
    if len(planes) == 1 and planes[0].dtype == jnp.float32:
        return FLOAT32
    raise ValueError(
        "a KV pool is (e4m3 nope, bf16 rope, uint8 scales) planes, (bf16 rows,) or (float32 rows,), got "
        f"{[(p.shape, str(p.dtype)) for p in planes]}"
    )


def kernel_format(fmt: str, kernel: str) -> str:
    """`fmt`, the format of the pool a Pallas kernel was given; ValueError for float32 pools,
    which only the references (the xla attention backend) read."""
    if fmt == FLOAT32:
        raise ValueError(
            f"the {kernel} Pallas kernel reads fp8 or bf16 pools, not float32 ones (the exact reference "
            "format): use --attention-backend xla for a float32 KV cache, or --kv-cache-dtype fp8_ds_mla or "
            "bfloat16 for the Pallas kernels"
        )
    return fmt


def reference_operand(x: jax.Array, fmt: str) -> jax.Array:
    """The references' one rounding rule, for the values the kernels feed their bf16 dots as they
    are given (q, the chunk's own window rows, indexer queries): as float32, rounded to bf16 first
    unless the pool being read (format `fmt`) is float32, the exact format where nothing is
    rounded. Pool rows need no rule: each format dequantises exactly.

    The rounding is `reduce_precision` to bf16's 8 exponent and 7 mantissa bits (round to nearest
    even, as a cast): XLA may drop a float32 -> bf16 -> float32 cast pair inside a fusion (its
    default `xla_allow_excess_precision`), and then the bf16 references would silently not round."""
    x = x.astype(jnp.float32)
    if fmt == FLOAT32:
        return x
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def flatten_pool(planes) -> tuple[tuple[jax.Array, ...], int, int]:
    """Planes [L, blocks, units, ...] (or [blocks, units, ...]: L = 1) -> (planes [L*blocks*units,
    ...], blocks, units). The first plane decides: it has a trailing data dim, so 4 dims = layered."""
    planes = tuple(planes)
    layered = planes[0].ndim == 4
    out = []
    for p in planes:
        if not layered:
            p = p[None]
        out.append(p.reshape(p.shape[0] * p.shape[1] * p.shape[2], *p.shape[3:]))
    return tuple(out), planes[0].shape[-3], planes[0].shape[-2]


def refuse_wrapping_offsets(planes) -> None:
    """A ValueError, never an illegal memory access, for a pool a kernel would index with int32
    offsets that wrap (`formats.wraps_int32_offsets`); the pure-JAX references read any pool."""
    for p in planes:
        if formats.wraps_int32_offsets(p.size, p.dtype.itemsize):
            raise ValueError(
                f"a KV pool plane {p.dtype}{list(p.shape)} holds {p.size:,} elements in "
                f"{p.size * p.dtype.itemsize / 2**30:.2f} GiB: a Pallas kernel would index it with int32 offsets "
                f"that wrap past {formats.INT32_OFFSET_LIMIT:,} elements (an illegal memory access on the GPU). "
                "Give such a plane idle layers that take it past 4 GiB (formats.idle_layers, as "
                "dsv4_jax.kv_cache.paged lays out the engine's pools), or use --attention-backend xla"
            )


def pool_dims(planes) -> tuple[int, int, int]:
    """(blocks, units, head_dim) of a KV pool."""
    planes = tuple(planes)
    blocks, units = planes[0].shape[-3], planes[0].shape[-2]
    head_dim = sum(p.shape[-1] for p in planes[:2]) if len(planes) == 3 else planes[0].shape[-1]
    return blocks, units, head_dim


def layer_offset(layer, planes) -> jax.Array:
    """First flat row of pool layer `layer` (int or scalar array), as int32."""
    blocks, units, _ = pool_dims(planes)
    return jnp.asarray(layer, jnp.int32) * (blocks * units)


# ---- in-kernel helpers --------------------------------------------------------------------------
def _ue8m0_scale(byte: jax.Array) -> jax.Array:
    """uint8 UE8M0 bytes -> fp32 scales, as formats.ue8m0_decode (0 -> 2**-127, 0xFF -> NaN)."""
    b = byte.astype(jnp.int32)
    s = lax.bitcast_convert_type(b << 23, jnp.float32)
    s = jnp.where(b == 0, jnp.float32(2.0**-127), s)
    return jnp.where(b == formats.UE8M0_NAN, jnp.float32(jnp.nan), s)


def key_chunk(planes, rows: jax.Array, valid: jax.Array, chunk: tuple[int, int, int]) -> jax.Array:
    """One dim chunk (plane, column, width) of the key rows `rows` [bk] as bf16 [bk, width]; zeros
    where not valid (so NaN in unused pool rows never reaches a dot). fp8 values times their
    power-of-two scale are exact in bf16."""
    plane, col, width = chunk
    if len(planes) == 3 and plane == 0:
        nope_ref, _, scale_ref = planes
        e = nope_ref[rows, pl.ds(col, width)].astype(jnp.float32)
        k = e * _ue8m0_scale(scale_ref[rows, col // DIM_CHUNK])[:, None]
        return jnp.where(valid[:, None], k, 0.0).astype(jnp.bfloat16)
    k = planes[plane][rows, pl.ds(col, width)]
    return jnp.where(valid[:, None], k, jnp.zeros((), jnp.bfloat16))


def online_softmax_step(carry, q_chunks, k_chunks, mask: jax.Array, scale: float):
    """One block of keys: logits = q @ k^T * scale over all dim chunks (bf16 operands, fp32
    accumulation), masked to -inf, then the flash-attention update of (m, l, acc).

    carry = (m [M], l [M], acc: one [M, width] fp32 array per dim chunk); mask [M, bk]."""
    m, l, acc = carry
    logits = None
    for qc, kc in zip(q_chunks, k_chunks):
        d = lax.dot_general(qc, kc, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = d if logits is None else logits + d
    logits = jnp.where(mask, logits * scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet: exp(-inf) = 0, no NaN
    p = jnp.exp(logits - m_use[:, None])
    alpha = jnp.exp(m - m_use)
    l = l * alpha + jnp.sum(p, axis=1)
    pb = p.astype(jnp.bfloat16)
    acc = tuple(
        a * alpha[:, None] + jnp.dot(pb, kc, preferred_element_type=jnp.float32) for a, kc in zip(acc, k_chunks)
    )
    return m_new, l, acc


def window_rows(bt_ref, b, pos, valid, units: int, row0):
    """Flat pool rows of token positions `pos` [bk] through the sliding ring; (rows, valid)."""
    ring = bt_ref.shape[1]
    safe = jnp.maximum(pos, 0)
    blk = bt_ref[b, (safe // units) % ring]
    valid = valid & (blk >= 0)
    return jnp.where(valid, row0 + blk * units + safe % units, 0), valid


def entry_rows(bt_ref, b, j, valid, units: int, row0):
    """Flat pool rows of compressed entries `j` [bk]; (rows, valid)."""
    nb = bt_ref.shape[1]
    safe = jnp.maximum(j, 0)
    page = safe // units
    valid = valid & (page < nb)
    blk = bt_ref[b, jnp.minimum(page, nb - 1)]
    valid = valid & (blk >= 0)
    return jnp.where(valid, row0 + blk * units + safe % units, 0), valid


# ---- wrapper helpers --------------------------------------------------------------------------
def check_shapes(q, window_pool, compressed_pool, topk_indices, ratio):
    """The pools' format, after checking that q and the pools agree. Any width passes: the
    references (the xla backend) read every shape the model has; the kernels' tiling limits are
    checked by their wrappers (`dim_chunks`, `pad_heads`) and, ahead of time, by `limits`."""
    fmt = pool_format(window_pool)
    head_dim = q.shape[-1]
    _, _, pool_dim = pool_dims(window_pool)
    if pool_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != window pool head_dim {pool_dim}")
    if compressed_pool is not None:
        if pool_format(compressed_pool) != fmt:
            raise ValueError("window and compressed pools must share one format")
        if pool_dims(compressed_pool)[2] != head_dim:
            raise ValueError("compressed pool head_dim differs from q")
        if ratio < 1:
            raise ValueError(f"a compressed pool needs a compress ratio >= 1, got {ratio}")
    elif topk_indices is not None:
        raise ValueError("topk_indices need a compressed pool")
    return fmt


def attention_mode(compressed_pool, topk_indices) -> str:
    if compressed_pool is None:
        return "window"
    return "hca" if topk_indices is None else "csa"


MIN_DOT_ROWS = 16  # Triton's tensor-core dots need at least 16 rows


def padded_heads(heads: int, block_h: int) -> int:
    """Head count the kernels run with: models with fewer heads than a head block (small test
    models) are padded with silent heads to a power of two of at least MIN_DOT_ROWS rows."""
    if heads >= block_h:
        return heads
    return max(MIN_DOT_ROWS, 1 << (heads - 1).bit_length())


def head_block_fits(heads: int, block_h: int) -> bool:
    """Whether `heads` query heads split into whole head blocks of `block_h` (a power of two):
    fewer heads than a block are padded with silent heads (`padded_heads`, a power of two that
    `block_h` divides or that is itself the block); more must be a multiple of the block."""
    return heads < block_h or heads % block_h == 0


def pad_heads(
    q: jax.Array,  # [..., H, D] with the heads on `head_axis`
    sinks: jax.Array,  # [H]
    block_h: int,  # the launch config's head block
    head_axis: int,
) -> tuple[jax.Array, jax.Array, int]:
    """(q, sinks, block_h) to launch with: q and sinks padded to `padded_heads` heads (zero queries
    and sinks: silent heads whose outputs the wrapper drops) and the head block for that count.
    ValueError when the heads do not split into whole head blocks."""
    heads = q.shape[head_axis]
    extra = padded_heads(heads, block_h) - heads
    if extra:
        widths = [(0, 0)] * q.ndim
        widths[head_axis] = (0, extra)
        q, sinks = jnp.pad(q, widths), jnp.pad(sinks, (0, extra))
    if not head_block_fits(heads, block_h):
        raise ValueError(f"heads ({heads}) must be a multiple of block_h ({block_h})")
    block_h = min(block_h, heads + extra)
    return q, sinks, block_h


def full_block(x) -> pl.BlockSpec:
    """BlockSpec handing the whole of `x` to every program (pool planes, tables, metadata)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


@dataclasses.dataclass(frozen=True)
class PoolOperands:
    """The window and compressed pools of one attention call as kernel operands."""

    planes: tuple[jax.Array, ...]  # window planes then compressed planes, each flat [rows, ...]
    layer_offsets: jax.Array  # [2] int32: first flat row of the layer in the window / compressed pool
    window_block_table: jax.Array  # [B, ring] int32
    compressed_block_table: jax.Array  # [B, max_blocks] int32 ([B, 1] dummy without compressed pool)
    n_planes: int  # planes per pool
    chunks: tuple[tuple[int, int, int], ...]  # dim_chunks of the pools
    w_units: int  # rows per window-pool block
    c_units: int  # entries per compressed-pool block (1 without compressed pool)
    c_entries: int  # compressed entries a block-table row can address (1 without compressed pool)

    def tables(self) -> list[jax.Array]:
        """The kernels' (offsets, window table, compressed table) operands, in that order."""
        return [self.layer_offsets, self.window_block_table, self.compressed_block_table]

    def plane_specs(self) -> list[pl.BlockSpec]:
        return [full_block(p) for p in self.planes]

    def kernel_params(self) -> dict:
        """The static keyword arguments both kernels take from the pools."""
        return dict(
            n_planes=self.n_planes, chunks=self.chunks, w_units=self.w_units, c_units=self.c_units,
            c_entries=self.c_entries,
        )


def pool_operands(
    window_pool: tuple[jax.Array, ...],  # planes [L, blocks, units, ...] or [blocks, units, ...]
    window_block_table: jax.Array,  # [B, ring]
    compressed_pool: tuple[jax.Array, ...] | None,
    compressed_block_table: jax.Array | None,  # [B, max_blocks]
    layer: int | jax.Array,
    compressed_layer: int | jax.Array,
) -> PoolOperands:
    """Flatten the pools' planes to rows, locate the layers in them and cast the block tables."""
    refuse_wrapping_offsets((*window_pool, *(compressed_pool or ())))
    wplanes, _, w_units = flatten_pool(window_pool)
    offsets = [layer_offset(layer, window_pool)]
    batch = window_block_table.shape[0]
    cplanes: tuple[jax.Array, ...] = ()
    c_units = c_entries = 1
    cbt = jnp.zeros((batch, 1), jnp.int32)
    if compressed_pool is not None:
        cplanes, _, c_units = flatten_pool(compressed_pool)
        offsets.append(layer_offset(compressed_layer, compressed_pool))
        cbt = compressed_block_table.astype(jnp.int32)
        c_entries = cbt.shape[1] * c_units
    else:
        offsets.append(jnp.int32(0))
    return PoolOperands(
        planes=(*wplanes, *cplanes),
        layer_offsets=jnp.stack(offsets).astype(jnp.int32),
        window_block_table=window_block_table.astype(jnp.int32),
        compressed_block_table=cbt,
        n_planes=len(window_pool),
        chunks=dim_chunks(window_pool),
        w_units=w_units,
        c_units=c_units,
        c_entries=c_entries,
    )


def _gather_rows_reference(planes, block_table, keys, *, ring: bool, layer=0):
    """Dequantised fp32 rows [B, ..., D] for token positions (ring=True, sliding pool) or
    compressed entries (ring=False) `keys` [B, ...]; also whether each row exists
    (block-table entry >= 0, inside the table)."""
    blocks, units, _ = pool_dims(planes)
    flat, _, _ = flatten_pool(planes)
    batch, nb = block_table.shape
    safe = jnp.maximum(keys, 0)
    page = safe // units
    if ring:
        page = page % nb
        inside = jnp.ones(keys.shape, bool)
    else:
        inside = page < nb
        page = jnp.minimum(page, nb - 1)
    blk = jnp.take_along_axis(block_table, page.reshape(batch, -1), axis=1).reshape(keys.shape)
    exists = inside & (blk >= 0)
    rows = jnp.where(exists, jnp.asarray(layer, jnp.int32) * (blocks * units) + blk * units + safe % units, 0)
    fmt = pool_format(planes)
    if fmt == "fp8_ds_mla":
        out = formats.fp8_ds_mla_dequantize(flat[0][rows], flat[1][rows], flat[2][rows], jnp.float32)
    elif fmt == FLOAT32:
        out = formats.float32_rows_dequantize(flat[0][rows], jnp.float32)
    else:
        out = formats.bf16_rows_dequantize(flat[0][rows], jnp.float32)
    return out, exists


# Queries per tile of the reference's window band (below) at most: the band of a tile of T
# consecutive queries is W + T - 1 positions, so a query gathers (W + T - 1) / T key rows instead
# of W and computes W + T - 1 logits instead of W (T <= W keeps that under twice the work).
BAND_TILE = 64


def band_tile(seq: int, window: int) -> int:
    """Queries per band tile for rows of `seq` queries: the largest divisor of seq that is at most
    BAND_TILE and the window."""
    return max(t for t in range(1, min(seq, window, BAND_TILE) + 1) if seq % t == 0)


def paged_attention_reference(
    q, positions, q_valid, window_pool, window_block_table, sinks, compressed_pool, compressed_block_table,
    topk_indices, layer, compressed_layer, *, window, ratio, chunk_kv=None, chunk_start=None,
):
    """Attention of queries q [B, S, H, D] at absolute `positions` [B, S] (consecutive in a row:
    positions[:, s] = positions[:, 0] + s; rows with q_valid False give 0) over the paged cache:
    fp32, HIGHEST precision. With `chunk_kv` [B, S, D], window keys at positions >= `chunk_start`
    [B] come from it. q and `chunk_kv` are rounded to bf16, as the kernels' dot operands, unless
    the pools are float32: then nothing is rounded (`reference_operand`).

    Consecutive queries share most of their window, so keys are gathered once per tile of queries
    (its band: the W + T - 1 positions ending at its last query) and once per row for HCA (every
    visible entry); each query masks the band to its own keys. A key row that no query of the
    tile (row) reads is zeroed before any product, so unread rows (stale, unwritten, another
    sequence's) never reach an output, whatever they hold."""
    batch, seq, heads, head_dim = q.shape
    scale = head_dim**-0.5
    fmt = pool_format(window_pool)
    qf = reference_operand(q, fmt)
    tile = band_tile(seq, window)
    tiles, span = seq // tile, window + tile - 1
    band = positions[:, ::tile, None] - window + 1 + jnp.arange(span)  # [B, tiles, span]
    kw, exists = _gather_rows_reference(window_pool, window_block_table, band, ring=True, layer=layer)
    if chunk_kv is not None:
        rel = band - chunk_start.astype(jnp.int32)[:, None, None]  # [B, tiles, span]
        own = rel >= 0
        chunk = reference_operand(chunk_kv, fmt)
        rows = chunk[jnp.arange(batch)[:, None, None], jnp.clip(rel, 0, chunk_kv.shape[1] - 1)]  # [B, tiles, span, D]
        kw = jnp.where(own[..., None], rows, kw)
        exists = exists | own
    # Query t of a tile reads band entries t .. t + W - 1.
    offset = jnp.arange(span)[None, :] - jnp.arange(tile)[:, None]  # [tile, span]
    in_window = (offset >= 0) & (offset < window)
    wvalid = (in_window[None, None] & (exists & (band >= 0))[:, :, None, :]
              & q_valid.reshape(batch, tiles, tile)[..., None])  # [B, tiles, tile, span]
    kw = jnp.where(wvalid.any(axis=2)[..., None], kw, 0.0)
    qt = qf.reshape(batch, tiles, tile, heads, head_dim)
    w_logits = jnp.einsum("bnthd,bnkd->bnthk", qt, kw, precision=_HIGHEST) * scale
    logits = [jnp.where(wvalid[:, :, :, None], w_logits, -jnp.inf).reshape(batch, seq, heads, span)]
    values = [(kw, lambda p, v: jnp.einsum("bnthk,bnkd->bnthd", p.reshape(batch, tiles, tile, heads, -1), v,
                                           precision=_HIGHEST).reshape(batch, seq, heads, head_dim))]
    if compressed_pool is not None:
        _, c_units, _ = pool_dims(compressed_pool)
        n_visible = (positions + 1) // ratio  # [B, S]
        if topk_indices is None:  # HCA: every visible entry, gathered once per row
            entries = compressed_block_table.shape[1] * c_units
            j = jnp.broadcast_to(jnp.arange(entries), (batch, entries))
            kc, exists = _gather_rows_reference(
                compressed_pool, compressed_block_table, j, ring=False, layer=compressed_layer
            )  # [B, E, D]
            cvalid = (j[:, None, :] < n_visible[..., None]) & exists[:, None, :] & q_valid[..., None]  # [B, S, E]
            kc = jnp.where(cvalid.any(axis=1)[..., None], kc, 0.0)
            c_logits = jnp.einsum("bshd,bkd->bshk", qf, kc, precision=_HIGHEST)
            values.append((kc, lambda p, v: jnp.einsum("bshk,bkd->bshd", p, v, precision=_HIGHEST)))
        else:  # CSA: each query's own picks
            j = topk_indices
            kc, exists = _gather_rows_reference(
                compressed_pool, compressed_block_table, j, ring=False, layer=compressed_layer
            )  # [B, S, K, D]
            cvalid = (j >= 0) & (j < n_visible[..., None]) & exists & q_valid[..., None]
            kc = jnp.where(cvalid[..., None], kc, 0.0)
            c_logits = jnp.einsum("bshd,bskd->bshk", qf, kc, precision=_HIGHEST)
            values.append((kc, lambda p, v: jnp.einsum("bshk,bskd->bshd", p, v, precision=_HIGHEST)))
        logits.append(jnp.where(cvalid[:, :, None], c_logits * scale, -jnp.inf))
    sink = sinks.astype(jnp.float32)[None, None, :, None]
    all_logits = jnp.concatenate(logits, axis=-1)
    m = jnp.maximum(jnp.max(all_logits, axis=-1, keepdims=True), sink)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(all_logits - m)
    den = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m)
    p = p / jnp.where(den > 0, den, 1.0)
    out = jnp.zeros((batch, seq, heads, head_dim), jnp.float32)
    start = 0
    for part, (v, weighted_sum) in zip(logits, values):
        n = part.shape[-1]
        out = out + weighted_sum(p[..., start : start + n], v)
        start += n
    return jnp.where(q_valid[:, :, None, None], out, 0.0)
