"""Lightning-indexer scores fused with a running top-k (spec 3.7): kernel, reference, wrapper.

For a query token t at absolute position q_start + s the score of compressed entry j is
`sum_h w[t, h] * ReLU(q[t, h] . K_j)`, K_j the indexer key (e4m3 times its power-of-two scale, or
bf16), for the visible entries j < (t + 1) // ratio; the result is the `topk` entries with the
highest scores, ties broken by the lowest index, sorted by (score descending, index ascending),
-1 where fewer than `topk` entries are visible (and for padding rows s >= q_len). Keys live in
a paged pool: entry j in block `block_table[j // units]`, row `j % units` (entries whose block
is < 0 are skipped).

Kernel (Pallas, Triton backend): grid (batch, query tokens, splits). A program scores its
token against chunks of `topk` entries (gathered block_k rows at a time; one [heads, d] x
[d, block_k] bf16 dot with fp32 accumulation per step, ReLU, head-weighted sum in fp32) and keeps
a running top-k in registers: the chunk is bitonic-sorted ascending, the elementwise better of
(running list descending, chunk ascending) holds the top-k of both (half-cleaner of a bitonic
sequence), and a bitonic merge sorts it again. Chunks whose best score cannot enter the list
are skipped. Scores are never written out: memory is O(topk) per token whatever the context
length, so prefill scores its chunk of tokens without an [S, entries] score matrix. Decode splits
the entries over programs (split-K); a merge step (a two-key sort of splits x topk candidates)
combines them.

The reference materialises all scores (it is the definition, not the fast path): q rounded to
bf16, keys dequantised exactly, fp32 at HIGHEST precision, `lax.top_k` (ties: lower index). It also reads float32
keys (the exact reference cache, which the kernel refuses): then q is not rounded either
(paged_attention.reference_operand). The kernel differs only in fp32 summation order, so
near-tied scores (relative gap ~1e-6) may swap at the k-th place; exact ties (for example
all-zero ReLU scores) are broken by index in both.
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
    FLOAT32,
    flatten_pool,
    full_block,
    kernel_format,
    layer_offset,
    reference_operand,
    refuse_wrapping_offsets,
)

_NO_INDEX = 2**31 - 1  # sentinel index of empty list slots: loses every tie
_HIGHEST = lax.Precision.HIGHEST


# ---- bitonic network (on register arrays; plain jnp so it also runs in interpret mode) ---------
def _beats(sa, ia, sb, ib):
    """(score, index) a ranks before b: higher score, then lower index."""
    return (sa > sb) | ((sa == sb) & (ia < ib))


def _compare_exchange(s, i, stride: int, size: int, descending: bool):
    """One stage of a bitonic network on s, i [n]: pairs (p, p + stride) with p & stride == 0;
    the pair sorts descending when (p & size) == 0 (flipped when not `descending`).
    Halves are picked with where + reductions over an axis of 2, not value slices (which the
    Triton lowering refuses)."""
    n = s.shape[0]
    groups = n // (2 * stride)
    s3 = s.reshape(groups, 2, stride)
    i3 = i.reshape(groups, 2, stride)
    first = lax.broadcasted_iota(jnp.int32, (groups, 2, stride), 1) == 0
    ls = jnp.max(jnp.where(first, s3, -jnp.inf), axis=1)
    rs = jnp.max(jnp.where(first, -jnp.inf, s3), axis=1)
    li = jnp.sum(jnp.where(first, i3, 0), axis=1)
    ri = jnp.sum(jnp.where(first, 0, i3), axis=1)
    g = lax.broadcasted_iota(jnp.int32, (groups, stride), 0)
    desc = ((g * (2 * stride)) & size) == 0
    if not descending:
        desc = jnp.logical_not(desc)
    swap = jnp.where(desc, _beats(rs, ri, ls, li), _beats(ls, li, rs, ri))
    new_ls, new_rs = jnp.where(swap, rs, ls), jnp.where(swap, ls, rs)
    new_li, new_ri = jnp.where(swap, ri, li), jnp.where(swap, li, ri)
    s = jnp.where(first, new_ls[:, None, :], new_rs[:, None, :]).reshape(n)
    i = jnp.where(first, new_li[:, None, :], new_ri[:, None, :]).reshape(n)
    return s, i


def _bitonic_sort(s, i, descending: bool):
    n = s.shape[0]
    size = 2
    while size <= n:
        stride = size // 2
        while stride >= 1:
            s, i = _compare_exchange(s, i, stride, size, descending)
            stride //= 2
        size *= 2
    return s, i


def _merge_top(s, i, cs, ci):
    """Top-n of a descending list (s, i) and a chunk (cs, ci), as a descending list."""
    cs, ci = _bitonic_sort(cs, ci, descending=False)
    take = _beats(cs, ci, s, i)
    s, i = jnp.where(take, cs, s), jnp.where(take, ci, i)  # bitonic, holds the top n
    n = s.shape[0]
    stride = n // 2
    while stride >= 1:
        s, i = _compare_exchange(s, i, stride, n, True)
        stride //= 2
    return s, i


# ---- kernel -----------------------------------------------------------------------------------
def _indexer_topk_kernel(
    start_ref,  # [B] int32: absolute position of query row 0
    qlen_ref,  # [B] int32
    off_ref,  # [1] int32: first flat row of this layer in the key pool
    bt_ref,  # [B, max_blocks] int32
    q_ref,  # [heads, d] bf16
    w_ref,  # [heads] float32
    *refs,  # key planes (e4m3 keys [rows, d] + fp32 scales [rows], or bf16 keys), out scores [n], out index [n]
    fp8: bool,
    n_top: int,  # list length: topk rounded up to a power of two
    block_k: int,
    ratio: int,
    num_splits: int,
    units: int,
    n_entries: int,
):
    keys_ref = refs[0]
    kscale_ref = refs[1] if fp8 else None
    os_ref, oi_ref = refs[-2:]
    b = pl.program_id(0)
    s = pl.program_id(1)
    split = pl.program_id(2)
    d = q_ref.shape[1]
    qpos = start_ref[b] + s
    n_visible = jnp.where(s < qlen_ref[b], jnp.clip((qpos + 1) // ratio, 0, n_entries), 0)
    n_chunks = (n_visible + n_top - 1) // n_top
    per_split = (n_chunks + num_splits - 1) // num_splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_chunks)
    row0 = off_ref[0]
    q = q_ref[...]
    w = w_ref[...]
    iota = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    n_sub = n_top // block_k
    sub_row = lax.broadcasted_iota(jnp.int32, (n_sub, block_k), 0)
    nb = bt_ref.shape[1]

    def score(j):
        """Scores [block_k] of entries j (-inf where the entry is not there)."""
        page = j // units
        ok = (j < n_visible) & (page < nb)
        blk = bt_ref[b, jnp.minimum(page, nb - 1)]
        ok = ok & (blk >= 0)
        rows = jnp.where(ok, row0 + blk * units + j % units, 0)
        k = keys_ref[rows, pl.ds(0, d)].astype(jnp.float32)
        k = jnp.where(ok[:, None], k, 0.0).astype(jnp.bfloat16)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if fp8:
            logits = logits * jnp.where(ok, kscale_ref[rows], 0.0)[None, :]
        sc = jnp.sum(jnp.maximum(logits, 0.0) * w[:, None], axis=0)
        return jnp.where(ok, sc, -jnp.inf)

    def body(ci, carry):
        top_s, top_i = carry
        tile = jnp.full((n_sub, block_k), -jnp.inf, jnp.float32)
        for sub in range(n_sub):
            sc = score(ci * n_top + sub * block_k + iota)
            tile = jnp.where(sub_row == sub, sc[None, :], tile)
        cs = tile.reshape(n_top)
        cidx = ci * n_top + lax.broadcasted_iota(jnp.int32, (n_top,), 0)
        # Chunk entries have higher indices than everything in the list, so only a strictly
        # higher score can enter it.
        return lax.cond(
            jnp.max(cs) > jnp.min(top_s),
            lambda: _merge_top(top_s, top_i, cs, cidx),
            lambda: (top_s, top_i),
        )

    carry = (jnp.full((n_top,), -jnp.inf, jnp.float32), jnp.full((n_top,), _NO_INDEX, jnp.int32))
    top_s, top_i = lax.fori_loop(lo, hi, body, carry)
    os_ref[...] = top_s
    oi_ref[...] = top_i


# ---- wrapper ----------------------------------------------------------------------------------
def _key_planes(key_pool) -> tuple[tuple[jax.Array, ...], str, int]:
    """(planes flattened to rows, format, units per block) of an indexer pool: "fp8" (e4m3 keys,
    fp32 scales), "bf16" (bf16 keys,) or "float32" (float32 keys,; references only), each
    [L, blocks, units, d] or [blocks, units, d]."""
    key_pool = tuple(key_pool)
    keys = key_pool[0]
    if len(key_pool) == 2:
        if keys.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"fp8 indexer keys must be float8_e4m3fn, got {keys.dtype}")
        fmt = "fp8"
    elif keys.dtype == jnp.float32:
        fmt = FLOAT32
    elif keys.dtype == jnp.bfloat16:
        fmt = "bf16"
    else:
        raise ValueError(f"single-plane indexer keys must be bfloat16 or float32, got {keys.dtype}")
    flat, _, units = flatten_pool(key_pool)
    return flat, fmt, units


def index_head_dim_fits(d: int) -> bool:
    """Whether the kernel can take indexer keys of `d` dims: one [block_k, d] tile per gather and
    a dot d deep, so a power of two (Triton tensor sizes) of at least 16 (dot depth)."""
    return d >= 16 and d & (d - 1) == 0


def _list_length(topk: int) -> int:
    return max(1 << (topk - 1).bit_length(), 1)


def _finish(scores: jax.Array, index: jax.Array, topk: int) -> jax.Array:
    """Merge candidate lists [..., n] into the final top-k: a two-key sort, -1 where empty."""
    if scores.shape[-1] > topk:
        neg, index = lax.sort((-scores, index), dimension=-1, num_keys=2)
        scores, index = -neg[..., :topk], index[..., :topk]
    return jnp.where(jnp.isneginf(scores), -1, index).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("topk", "ratio", "config", "num_splits", "device_kind", "interpret")
)
def indexer_topk(
    q: jax.Array,  # [B, S, heads, d] indexer queries (RoPE, Hadamard/QAT applied); cast to bf16
    weights: jax.Array,  # [B, S, heads] float32 head weights (softmax scale folded in)
    key_pool: tuple[jax.Array, ...],  # (e4m3 keys [L, blocks, units, d], fp32 scales [L, blocks, units]) | (bf16,)
    block_table: jax.Array,  # [B, max_blocks] int32 (compressed block table)
    q_start: jax.Array,  # [B] int32: absolute position of q[:, 0]
    q_lens: jax.Array,  # [B] int32
    layer: int | jax.Array = 0,
    *,
    topk: int,
    ratio: int,
    config: tuning.KernelConfig | None = None,
    num_splits: int | None = None,
    device_kind: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Top-k compressed entries per query token: [B, S, topk] int32, -1 = none.

    Args:
      q, weights: indexer queries and head weights of S tokens per sequence.
      key_pool / block_table / layer: the paged indexer keys.
      q_start, q_lens: positions of the tokens and how many rows are real.
      topk, ratio: index_topk and the CSA compress ratio.
      config / num_splits: launch parameters (default: tuning table for `device_kind`).
    """
    cfg = config or tuning.kernel_config("indexer_topk", device_kind, interpret=interpret)
    info = tuning.device_info(device_kind, interpret=interpret)
    refuse_wrapping_offsets(tuple(key_pool))
    flat, fmt, units = _key_planes(key_pool)
    fp8 = kernel_format(fmt, "indexer_topk") == "fp8"
    batch, seq, heads, d = q.shape
    if not index_head_dim_fits(d):
        raise ValueError(f"index_head_dim ({d}) must be a power of two >= 16")
    n_top = _list_length(topk)
    block_k = min(cfg.block_k, n_top)
    n_entries = block_table.shape[1] * units
    max_chunks = -(-n_entries // n_top)
    splits = num_splits or tuning.num_splits(max_chunks, batch * seq, cfg, info)
    off = layer_offset(layer, key_pool).reshape(1)
    kernel = functools.partial(
        _indexer_topk_kernel, fp8=fp8, n_top=n_top, block_k=block_k, ratio=ratio, num_splits=splits,
        units=units, n_entries=n_entries,
    )

    meta = [q_start.astype(jnp.int32), q_lens.astype(jnp.int32), off, block_table.astype(jnp.int32)]
    out_shape = (batch, seq, splits, n_top)
    scores, index = pl.pallas_call(
        kernel,
        grid=(batch, seq, splits),
        in_specs=[full_block(x) for x in meta]
        + [
            pl.BlockSpec((None, None, heads, d), lambda b, s, k: (b, s, 0, 0)),
            pl.BlockSpec((None, None, heads), lambda b, s, k: (b, s, 0)),
        ]
        + [full_block(p) for p in flat],
        out_specs=[pl.BlockSpec((None, None, None, n_top), lambda b, s, k: (b, s, k, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(out_shape, jnp.float32), jax.ShapeDtypeStruct(out_shape, jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"indexer_topk_{'fp8' if fp8 else 'bf16'}",
    )(*meta, q.astype(jnp.bfloat16), weights.astype(jnp.float32), *flat)
    scores = scores.reshape(batch, seq, splits * n_top)
    index = index.reshape(batch, seq, splits * n_top)
    return _finish(scores, index, topk)


# ---- reference --------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("ratio",))
def indexer_scores_reference(q, weights, key_pool, block_table, q_start, q_lens, layer=0, *, ratio: int) -> jax.Array:
    """All scores [B, S, entries] (fp32; -inf where an entry is not visible or not there). q is
    rounded to bf16 (the kernel's dot operand) unless the keys are float32 (`reference_operand`)."""
    flat, fmt, units = _key_planes(key_pool)
    seq = q.shape[1]
    nb = block_table.shape[1]
    j = jnp.arange(nb * units)
    blk = block_table.astype(jnp.int32)[:, j // units]  # [B, C]
    exists = blk >= 0
    rows = jnp.where(exists, layer_offset(layer, key_pool) + blk * units + j % units, 0)
    keys = flat[0][rows].astype(jnp.float32)
    if fmt == "fp8":
        keys = keys * flat[1][rows][..., None]
    keys = jnp.where(exists[..., None], keys, 0.0)
    qf = reference_operand(q, fmt)
    logits = jnp.einsum("bshd,bcd->bshc", qf, keys, precision=_HIGHEST)
    scores = jnp.einsum("bshc,bsh->bsc", jnp.maximum(logits, 0.0), weights.astype(jnp.float32), precision=_HIGHEST)
    s = jnp.arange(seq)[None, :]
    positions = q_start.astype(jnp.int32)[:, None] + s
    visible = (j[None, None, :] < ((positions + 1) // ratio)[..., None]) & exists[:, None, :]
    visible &= (s < q_lens.astype(jnp.int32)[:, None])[..., None]
    return jnp.where(visible, scores, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("topk", "ratio"))
def indexer_topk_reference(q, weights, key_pool, block_table, q_start, q_lens, layer=0, *, topk: int, ratio: int):
    """Pure-JAX definition of `indexer_topk`: all scores, then the `topk` best in (score desc,
    index asc) order. `lax.top_k` gives exactly that order (equal scores, -inf included, keep the
    lower index first) without sorting every entry: the full two-key sort of 192 entries to keep
    8 costs a decode step of dsv4-tiny 0.3 ms a CSA layer."""
    scores = indexer_scores_reference(q, weights, key_pool, block_table, q_start, q_lens, layer, ratio=ratio)
    n = scores.shape[-1]
    if n < topk:
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, topk - n)), constant_values=-jnp.inf)
    best, index = lax.top_k(scores, topk)
    return jnp.where(jnp.isneginf(best), -1, index).astype(jnp.int32)
