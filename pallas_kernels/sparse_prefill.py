"""Sparse MQA prefill over the paged KV cache (spec 3.4): kernel, reference, wrapper.

Chunks of query tokens of each sequence, at absolute positions q_start + s for s < q_len (chunked
prefill: earlier context is already in the pools; the chunk's own K = V rows have been written
by kv_write before attention, as in the official code, which runs the compressor first). Keys
as in sparse_decode.py: the sliding-window rows through the sliding ring, plus all visible HCA
entries or each query's own CSA top-k picks, plus the per-head sink.

Kernel (Pallas, Triton backend): grid (batch, query blocks, head blocks). A program holds
M = block_q tokens x block_h heads as the rows of every dot (all heads share the keys, so the
tokens and heads of a block share every gathered key row):

* window: the block's tokens see positions [first - window + 1, last]; the program walks them
  in chunks of block_k with a dense causal band mask (window + block_q - 1 keys for block_q
  tokens);
* HCA: entries [0, (last + 1) // ratio) in chunks with a dense causal mask
  j < (position + 1) // ratio (at most one entry per 128 tokens);
* CSA: each token reads its own top-k rows (a gather, never a mask over all compressed entries,
  which would be quadratic in the context), so CSA layers use block_q = 1
  (`sparse_prefill_csa` in the tuning table) and M = block_h heads.

The sink starts the online softmax (m = sink, l = 1), and the program writes normalised fp32
output, zero for padding rows (s >= q_len). Numerics as sparse_decode: bf16 x bf16 dots with fp32
accumulation, fp8 dequantised exactly to bf16, probabilities rounded to bf16 for P @ V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import tuning
from pallas_kernels.paged_attention import (
    attention_mode,
    check_shapes,
    chunk_offsets,
    entry_rows,
    full_block,
    kernel_format,
    key_chunk,
    online_softmax_step,
    pad_heads,
    paged_attention_reference,
    pool_operands,
    window_rows,
)


# ---- kernel -----------------------------------------------------------------------------------
def _sparse_prefill_kernel(
    start_ref,  # [B] int32: absolute position of query row 0
    qlen_ref,  # [B] int32: valid query rows
    offs_ref,  # [2] int32: first flat row of this layer in the window / compressed pool
    wbt_ref,  # [B, ring] int32
    cbt_ref,  # [B, max_blocks] int32 ([B, 1] dummy if no compressed pool)
    idx_ref,  # [topk] int32: this token's CSA picks ([1] dummy unless CSA)
    sinks_ref,  # [block_h] float32
    q_ref,  # [block_q, block_h, head_dim] bf16
    kvc_ref,  # [S + block_k, head_dim] bf16: the chunk's own K = V rows ([1, 16] dummy if unused)
    *refs,  # window planes, compressed planes, out [block_q, block_h, head_dim] f32
    has_chunk_kv: bool,
    n_planes: int,
    mode: str,
    window: int,
    ratio: int,
    block_k: int,
    chunks: tuple[tuple[int, int, int], ...],
    w_units: int,
    c_units: int,
    c_entries: int,
    scale: float,
):
    wplanes = refs[:n_planes]
    cplanes = refs[n_planes : 2 * n_planes] if mode != "window" else ()
    o_ref = refs[-1]
    b = pl.program_id(0)
    qb = pl.program_id(1)
    block_q, block_h, _ = q_ref.shape
    rows_m = block_q * block_h
    start = start_ref[b]
    q_len = qlen_ref[b]
    r = lax.broadcasted_iota(jnp.int32, (rows_m,), 0)
    s = qb * block_q + r // block_h
    qpos = start + s  # [M] absolute position of each row's token
    row_ok = s < q_len
    first = start + qb * block_q
    last = start + jnp.minimum((qb + 1) * block_q, q_len) - 1  # last valid position of the block
    any_row = qb * block_q < q_len
    # Loop trip counts are `live * n`, not `jnp.where(any_row, n, 0)`: Triton's lowering gives a
    # select of two literals the predicate's type (i1), and the loop with an i1 bound then fails
    # MLIR's verification when the GPU compiles it (seen on an H200).
    live = any_row.astype(jnp.int32)
    iota = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    w_row0 = offs_ref[0]
    c_row0 = offs_ref[1]

    offsets = chunk_offsets(chunks)
    q_chunks = [q_ref[:, :, pl.ds(o, w)].reshape(rows_m, w) for o, (_, _, w) in zip(offsets, chunks)]
    sink = sinks_ref[r % block_h]
    carry = (
        sink,  # the sink is the first "key": m = sink, l = exp(sink - m) = 1
        jnp.where(jnp.isneginf(sink), 0.0, 1.0).astype(jnp.float32),
        tuple(jnp.zeros((rows_m, w), jnp.float32) for _, _, w in chunks),
    )

    def attend(carry, planes, rows, valid, mask):
        k_chunks = [key_chunk(planes, rows, valid, ch) for ch in chunks]
        return online_softmax_step(carry, q_chunks, k_chunks, mask & valid[None, :], scale)

    key0 = first - window + 1  # the block's tokens see key positions [key0, last]

    def window_body(ci, carry):
        kpos = key0 + ci * block_k + iota
        pool_end = start - 1 if has_chunk_kv else last  # with chunk rows, the pool serves < start
        rows, valid = window_rows(wbt_ref, b, kpos, (kpos >= 0) & (kpos <= pool_end), w_units, w_row0)
        band = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
        return attend(carry, wplanes, rows, valid, band & row_ok[:, None])

    if has_chunk_kv:
        n_pool = jnp.maximum(jnp.minimum(last, start - 1) - key0 + 1, 0)
    else:
        n_pool = window + block_q - 1
    n_window_chunks = live * ((n_pool + block_k - 1) // block_k)
    carry = lax.fori_loop(0, n_window_chunks, window_body, carry)

    if has_chunk_kv:  # key positions [max(key0, start), last] from the chunk's own rows
        s_first = jnp.maximum(key0 - start, 0)

        def chunk_body(ci, carry):
            s_key = s_first + ci * block_k
            kpos = start + s_key + iota
            valid = kpos <= last
            k_chunks = [
                jnp.where(valid[:, None], kvc_ref[pl.ds(s_key, block_k), pl.ds(o, w)], 0).astype(jnp.bfloat16)
                for o, (_, _, w) in zip(offsets, chunks)
            ]
            band = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
            mask = band & row_ok[:, None] & valid[None, :]
            return online_softmax_step(carry, q_chunks, k_chunks, mask, scale)

        n_chunk = jnp.maximum(last - start - s_first + 1, 0)
        carry = lax.fori_loop(0, live * ((n_chunk + block_k - 1) // block_k), chunk_body, carry)

    if mode == "hca":
        n_block = jnp.clip((last + 1) // ratio, 0, c_entries)
        row_visible = (qpos + 1) // ratio  # [M]

        def hca_body(ci, carry):
            j = ci * block_k + iota
            rows, valid = entry_rows(cbt_ref, b, j, j < n_block, c_units, c_row0)
            causal = j[None, :] < row_visible[:, None]
            return attend(carry, cplanes, rows, valid, causal & row_ok[:, None])

        carry = lax.fori_loop(0, live * ((n_block + block_k - 1) // block_k), hca_body, carry)
    elif mode == "csa":  # block_q == 1: one token, its own picks
        n_visible = jnp.clip((first + 1) // ratio, 0, c_entries)

        def csa_body(ci, carry):
            j = idx_ref[pl.ds(ci * block_k, block_k)]
            rows, valid = entry_rows(cbt_ref, b, j, (j >= 0) & (j < n_visible), c_units, c_row0)
            return attend(carry, cplanes, rows, valid, jnp.broadcast_to(row_ok[:, None], (rows_m, block_k)))

        carry = lax.fori_loop(0, live * (idx_ref.shape[0] // block_k), csa_body, carry)

    _, l, acc = carry
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    for o, (_, _, w), a in zip(offsets, chunks, acc):
        o_ref[:, :, pl.ds(o, w)] = (a * inv[:, None]).reshape(block_q, block_h, w)


# ---- wrapper ----------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("window", "ratio", "config", "device_kind", "interpret"))
def sparse_prefill(
    q: jax.Array,  # [B, S, H, D] (RoPE applied); cast to bf16
    window_pool: tuple[jax.Array, ...],
    window_block_table: jax.Array,  # [B, ring] int32
    q_start: jax.Array,  # [B] int32: absolute position of q[:, 0]
    q_lens: jax.Array,  # [B] int32: valid query rows (rows >= q_len give 0)
    sinks: jax.Array,  # [H] float32
    compressed_pool: tuple[jax.Array, ...] | None = None,
    compressed_block_table: jax.Array | None = None,  # [B, max_blocks] int32
    topk_indices: jax.Array | None = None,  # [B, S, K] int32 (CSA), -1 = skip; None = HCA
    layer: int | jax.Array = 0,
    compressed_layer: int | jax.Array = 0,
    window_kv: jax.Array | None = None,  # [B, S, D]: the chunk's own K = V rows, as the cache stores them
    *,
    window: int,
    ratio: int = 0,
    config: tuning.KernelConfig | None = None,
    device_kind: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Sparse MQA prefill attention of a chunk of query tokens. Returns [B, S, H, D] float32.

    Args as `sparse_decode`, with queries [B, S, H, D] at positions q_start + s (s < q_lens) and,
    on CSA layers, per-token picks [B, S, K]. With `window_kv`, window keys at positions >=
    q_start come from it (rounded to bf16) and the sliding pool is read only before q_start, so
    a chunk longer than the sliding ring can hold still sees its own rows; pass the rows as the
    cache stores them (fp8_ds_mla round trip or bf16) to match a read from the pool exactly.
    """
    fmt = kernel_format(check_shapes(q, window_pool, compressed_pool, topk_indices, ratio), "sparse_prefill")
    mode = attention_mode(compressed_pool, topk_indices)
    name = "sparse_prefill_csa" if mode == "csa" else "sparse_prefill"
    cfg = config or tuning.kernel_config(name, device_kind, interpret=interpret)
    heads = q.shape[2]
    q, sinks, block_h = pad_heads(q, sinks, cfg.block_h, head_axis=2)
    batch, seq, run_heads, head_dim = q.shape
    block_q = 1 if mode == "csa" else cfg.block_q
    block_k = cfg.block_k
    pools = pool_operands(
        window_pool, window_block_table, compressed_pool, compressed_block_table, layer, compressed_layer
    )

    pad_s = -seq % block_q
    q = q.astype(jnp.bfloat16)
    if pad_s:
        q = jnp.pad(q, ((0, 0), (0, pad_s), (0, 0), (0, 0)))
    seq_p = seq + pad_s
    idx = jnp.zeros((batch, 1, 1), jnp.int32)
    if mode == "csa":
        idx = topk_indices.astype(jnp.int32)
        pad_k = -idx.shape[2] % block_k
        idx = jnp.pad(idx, ((0, 0), (0, pad_s), (0, pad_k)), constant_values=-1)

    if window_kv is not None:
        kvc = jnp.pad(window_kv.astype(jnp.bfloat16), ((0, 0), (0, pad_s + block_k), (0, 0)))
        kvc_spec = pl.BlockSpec((None, kvc.shape[1], head_dim), lambda b, i, h: (b, 0, 0))
    else:
        kvc = jnp.zeros((1, 1, 16), jnp.bfloat16)
        kvc_spec = pl.BlockSpec((None, 1, 16), lambda b, i, h: (0, 0, 0))

    kernel = functools.partial(
        _sparse_prefill_kernel,
        has_chunk_kv=window_kv is not None, mode=mode, window=window, ratio=max(ratio, 1), block_k=block_k,
        scale=head_dim**-0.5, **pools.kernel_params(),
    )
    meta = [q_start.astype(jnp.int32), q_lens.astype(jnp.int32), *pools.tables()]
    if mode == "csa":  # each query row its own picks
        idx_spec = pl.BlockSpec((None, None, idx.shape[2]), lambda b, i, h: (b, i, 0))
    else:
        idx_spec = pl.BlockSpec((None, None, idx.shape[2]), lambda b, i, h: (b, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(batch, seq_p // block_q, run_heads // block_h),
        in_specs=[
            *(full_block(x) for x in meta),
            idx_spec,
            pl.BlockSpec((block_h,), lambda b, i, h: (h,)),
            pl.BlockSpec((None, block_q, block_h, head_dim), lambda b, i, h: (b, i, h, 0)),
            kvc_spec,
            *pools.plane_specs(),
        ],
        out_specs=pl.BlockSpec((None, block_q, block_h, head_dim), lambda b, i, h: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, seq_p, run_heads, head_dim), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"sparse_prefill_{fmt}_{mode}",
    )(*meta, idx, sinks.astype(jnp.float32), q, kvc, *pools.planes)
    return out[:, :seq, :heads]


# ---- reference --------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("window", "ratio"))
def sparse_prefill_reference(
    q, window_pool, window_block_table, q_start, q_lens, sinks, compressed_pool=None, compressed_block_table=None,
    topk_indices=None, layer=0, compressed_layer=0, window_kv=None, *, window: int, ratio: int = 0,
) -> jax.Array:
    """Pure-JAX definition of `sparse_prefill` (same arguments, no launch parameters): [B, S, H, D] fp32.
    q and `window_kv` are rounded to bf16 as the kernel's dot operands, except over float32 pools
    (the exact reference cache): there nothing is rounded (paged_attention.reference_operand)."""
    check_shapes(q, window_pool, compressed_pool, topk_indices, ratio)
    seq = q.shape[1]
    s = jnp.arange(seq)[None, :]
    positions = q_start.astype(jnp.int32)[:, None] + s
    q_valid = s < q_lens.astype(jnp.int32)[:, None]
    return paged_attention_reference(
        q, positions, q_valid, window_pool, window_block_table.astype(jnp.int32), sinks, compressed_pool,
        None if compressed_block_table is None else compressed_block_table.astype(jnp.int32),
        None if topk_indices is None else topk_indices.astype(jnp.int32), layer, compressed_layer,
        window=window, ratio=max(ratio, 1), chunk_kv=window_kv, chunk_start=q_start,
    )
