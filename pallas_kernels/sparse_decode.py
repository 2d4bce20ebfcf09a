"""Sparse MQA decode over the paged KV cache (spec 3.4): kernel, reference, wrapper.

One query token per sequence; all H query heads share the single K = V row of every key. The
keys of query position t = seq_len - 1 are the union of

* the sliding-window rows, positions max(0, t - window + 1) .. t, read from the sliding pool
  through its block-table ring (position p: block `table[(p // units) % ring]`, row `p % units`);
* on HCA layers every visible compressed entry j < (t + 1) // ratio, on CSA layers the entries
  the indexer chose (`topk_indices`, -1 = skip; invisible picks are skipped too), read from the
  compressed pool through its block table (entry j: block `table[j // units]`, row `j % units`);

plus a per-head sink logit with no value. Softmax scale exactly head_dim ** -0.5.

Pools are tuples of planes with leading dims [layers, blocks, units] (or [blocks, units]):
fp8_ds_mla = (e4m3 nope [.., nope], bf16 rope [.., rope], uint8 UE8M0 scales [.., 8]) or
bf16 rows = (bf16 [.., head_dim],), see pallas_kernels/formats.py. Block-table entries < 0 mean
"no block": such keys are skipped.

Kernel (Pallas, Triton backend): grid (batch, head blocks, splits). Each program holds M =
block_h query heads and walks its share of the key chunks (block_k rows per step): it gathers
the rows of every 64-wide dim chunk, dequantises fp8 exactly to bf16 (e4m3 values times a
power-of-two scale are bf16 numbers), computes logits as bf16 x bf16 dots with fp32
accumulation (an fp32 dot would be TF32 on the GPU), runs an online softmax and accumulates
P @ V the same way. A merge step (plain JAX) combines the splits and the sink.

The reference (`sparse_decode_reference`) defines the numerics: q rounded to bf16 (the kernel's
dot operand), keys dequantised exactly, everything else fp32 at HIGHEST precision. The kernel
differs only by rounding the probabilities to bf16 for the P @ V dot (|error| <= 2**-9 *
max|k| per output element) and by fp32 summation order. Over float32 pools (the exact reference
cache, which the kernel refuses) the reference rounds nothing, q included.

The building blocks shared with sparse_prefill.py live in paged_attention.py.
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
def _sparse_decode_kernel(
    lens_ref,  # [B] int32: tokens per sequence including the query (query position = len - 1)
    offs_ref,  # [2] int32: first flat row of this layer in the window / compressed pool
    wbt_ref,  # [B, ring] int32: sliding-pool block table rows
    cbt_ref,  # [B, max_blocks] int32: compressed-pool block table rows ([B, 1] dummy if none)
    idx_ref,  # [B, topk] int32: CSA picks ([B, 1] dummy unless CSA)
    q_ref,  # [block_h, head_dim] bf16
    *refs,  # window planes, compressed planes, acc [block_h, head_dim], m [block_h], l [block_h]
    n_planes: int,
    mode: str,  # "window" | "hca" | "csa"
    window: int,
    ratio: int,
    block_k: int,
    num_splits: int,
    chunks: tuple[tuple[int, int, int], ...],
    w_units: int,
    c_units: int,
    c_entries: int,
    scale: float,
):
    wplanes = refs[:n_planes]
    cplanes = refs[n_planes : 2 * n_planes] if mode != "window" else ()
    acc_ref, m_ref, l_ref = refs[-3:]
    offsets = chunk_offsets(chunks)
    b = pl.program_id(0)
    split = pl.program_id(2)
    block_h = q_ref.shape[0]
    t = lens_ref[b] - 1
    q_chunks = [q_ref[:, pl.ds(o, w)] for o, (_, _, w) in zip(offsets, chunks)]
    iota = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    w_row0 = offs_ref[0]
    c_row0 = offs_ref[1]

    def attend(carry, planes, rows, valid):
        k_chunks = [key_chunk(planes, rows, valid, ch) for ch in chunks]
        mask = jnp.broadcast_to(valid[None, :], (block_h, block_k))
        return online_softmax_step(carry, q_chunks, k_chunks, mask, scale)

    def window_body(ci, carry):
        slot = ci * block_k + iota
        pos = t - window + 1 + slot
        rows, valid = window_rows(wbt_ref, b, pos, (pos >= 0) & (slot < window), w_units, w_row0)
        return attend(carry, wplanes, rows, valid)

    n_visible = jnp.clip((t + 1) // ratio, 0, c_entries) if mode != "window" else 0

    def compressed_body(ci, carry):
        if mode == "csa":
            j = idx_ref[b, pl.ds(ci * block_k, block_k)]
            ok = (j >= 0) & (j < n_visible)
        else:
            j = ci * block_k + iota
            ok = j < n_visible
        rows, valid = entry_rows(cbt_ref, b, j, ok, c_units, c_row0)
        return attend(carry, cplanes, rows, valid)

    # The key space: window chunks first, then compressed chunks; each split takes a contiguous
    # run of chunks (static counts except HCA's, which follow the sequence length).
    n_window_chunks = pl.cdiv(window, block_k)
    if mode == "csa":
        n_comp_chunks = idx_ref.shape[1] // block_k
    elif mode == "hca":
        n_comp_chunks = (n_visible + block_k - 1) // block_k
    else:
        n_comp_chunks = 0
    total = n_window_chunks + n_comp_chunks
    per_split = (total + num_splits - 1) // num_splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, total)

    carry = (
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        tuple(jnp.zeros((block_h, w), jnp.float32) for _, _, w in chunks),
    )
    carry = lax.fori_loop(jnp.minimum(lo, n_window_chunks), jnp.minimum(hi, n_window_chunks), window_body, carry)
    if mode != "window":
        carry = lax.fori_loop(
            jnp.maximum(lo, n_window_chunks) - n_window_chunks,
            jnp.maximum(hi, n_window_chunks) - n_window_chunks,
            compressed_body,
            carry,
        )
    m, l, acc = carry
    for o, (_, _, w), a in zip(offsets, chunks, acc):
        acc_ref[:, pl.ds(o, w)] = a
    m_ref[...] = m
    l_ref[...] = l


# ---- wrapper ----------------------------------------------------------------------------------
@functools.partial(
    jax.jit,
    static_argnames=("window", "ratio", "config", "num_splits", "device_kind", "interpret"),
)
def sparse_decode(
    q: jax.Array,  # [B, H, D] (RoPE applied); cast to bf16
    window_pool: tuple[jax.Array, ...],  # planes [L, blocks, units, ...] or [blocks, units, ...]
    window_block_table: jax.Array,  # [B, ring] int32
    seq_lens: jax.Array,  # [B] int32, tokens including the query; 0 = padding row (output 0)
    sinks: jax.Array,  # [H] float32
    compressed_pool: tuple[jax.Array, ...] | None = None,
    compressed_block_table: jax.Array | None = None,  # [B, max_blocks] int32
    topk_indices: jax.Array | None = None,  # [B, K] int32 (CSA), -1 = skip; None = HCA (all visible)
    layer: int | jax.Array = 0,  # layer of the window pool's leading axis
    compressed_layer: int | jax.Array = 0,  # layer of the compressed pool's leading axis
    *,
    window: int,
    ratio: int = 0,
    config: tuning.KernelConfig | None = None,
    num_splits: int | None = None,
    device_kind: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Sparse MQA decode attention. Returns [B, H, D] float32.

    Args:
      q: [B, H, D] queries, one token per sequence.
      window_pool / window_block_table: the sliding pool planes and each row's block ring.
      seq_lens: [B] sequence lengths including the query token.
      sinks: [H] per-head sink logits.
      compressed_pool / compressed_block_table: CSA or HCA entries (None: sliding-only layer).
      topk_indices: [B, K] indexer picks on CSA layers (-1 = none); None on HCA layers.
      window, ratio: sliding window and compress ratio of the layer.
      config / num_splits: launch parameters (default: tuning table for `device_kind`).
      interpret: run the kernel in the Pallas interpreter (CPU).
    """
    fmt = kernel_format(check_shapes(q, window_pool, compressed_pool, topk_indices, ratio), "sparse_decode")
    mode = attention_mode(compressed_pool, topk_indices)
    cfg = config or tuning.kernel_config("sparse_decode", device_kind, interpret=interpret)
    info = tuning.device_info(device_kind, interpret=interpret)
    heads = q.shape[1]
    q, sinks, block_h = pad_heads(q, sinks, cfg.block_h, head_axis=1)
    batch, run_heads, head_dim = q.shape
    block_k = cfg.block_k
    pools = pool_operands(
        window_pool, window_block_table, compressed_pool, compressed_block_table, layer, compressed_layer
    )
    idx = jnp.zeros((batch, 1), jnp.int32)
    if mode == "csa":
        idx = topk_indices.astype(jnp.int32)
        pad = -idx.shape[1] % block_k
        if pad:
            idx = jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1)

    n_window_chunks = -(-window // block_k)
    if mode == "csa":
        max_chunks = n_window_chunks + idx.shape[1] // block_k
    elif mode == "hca":
        max_chunks = n_window_chunks + -(-pools.c_entries // block_k)
    else:
        max_chunks = n_window_chunks
    head_blocks = run_heads // block_h
    splits = num_splits or tuning.num_splits(max_chunks, batch * head_blocks, cfg, info)

    kernel = functools.partial(
        _sparse_decode_kernel,
        mode=mode, window=window, ratio=max(ratio, 1), block_k=block_k, num_splits=splits,
        scale=head_dim**-0.5, **pools.kernel_params(),
    )
    meta = [seq_lens.astype(jnp.int32), *pools.tables(), idx]
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(batch, head_blocks, splits),
        in_specs=[
            *(full_block(x) for x in meta),
            pl.BlockSpec((None, block_h, head_dim), lambda b, h, s: (b, h, 0)),
            *pools.plane_specs(),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, s, h, 0)),
            pl.BlockSpec((None, None, block_h), lambda b, h, s: (b, s, h)),
            pl.BlockSpec((None, None, block_h), lambda b, h, s: (b, s, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, splits, run_heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, splits, run_heads), jnp.float32),
            jax.ShapeDtypeStruct((batch, splits, run_heads), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"sparse_decode_{fmt}_{mode}",
    )(*meta, q.astype(jnp.bfloat16), *pools.planes)
    return merge_splits(acc, m, l, sinks)[:, :heads]


def merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array, sinks: jax.Array) -> jax.Array:
    """Combine split-K partials (acc [B, S, H, D], running max m and sum l [B, S, H]) with the
    per-head sink (an extra logit with no value): elementwise fp32, no dot (no TF32)."""
    sink = sinks.astype(jnp.float32)[None, :]  # [1, H]
    m_all = jnp.maximum(jnp.max(m, axis=1), sink)  # [B, H]
    m_use = jnp.where(jnp.isneginf(m_all), 0.0, m_all)
    w = jnp.exp(m - m_use[:, None])  # [B, S, H]; empty splits (m = -inf) weigh 0
    num = jnp.sum(w[..., None] * acc, axis=1)
    den = jnp.sum(w * l, axis=1) + jnp.exp(sink - m_use)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


# ---- reference --------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("window", "ratio"))
def sparse_decode_reference(
    q, window_pool, window_block_table, seq_lens, sinks, compressed_pool=None, compressed_block_table=None,
    topk_indices=None, layer=0, compressed_layer=0, *, window: int, ratio: int = 0,
) -> jax.Array:
    """Pure-JAX definition of `sparse_decode` (same arguments, no launch parameters): [B, H, D] fp32.
    Also reads float32 pools, exactly: then q is not rounded to bf16 (paged_attention.reference_operand)."""
    check_shapes(q, window_pool, compressed_pool, topk_indices, ratio)
    positions = (seq_lens.astype(jnp.int32) - 1)[:, None]
    idx = None if topk_indices is None else topk_indices.astype(jnp.int32)[:, None]
    out = paged_attention_reference(
        q[:, None], positions, positions[:, :] >= 0, window_pool, window_block_table.astype(jnp.int32), sinks,
        compressed_pool, None if compressed_block_table is None else compressed_block_table.astype(jnp.int32),
        idx, layer, compressed_layer, window=window, ratio=max(ratio, 1),
    )
    return out[:, 0]
