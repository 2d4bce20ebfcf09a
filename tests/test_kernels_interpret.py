"""Interpret-mode parity of every Pallas kernel with its pure-JAX reference, of the attention
references with the model's dense attention (dsv4_jax/model/attention_core.py) on the same K/V,
and of the indexer reference with the model's `Indexer` (dsv4_jax/model/indexer.py) on the
same keys.

Fixed small shapes (so each kernel compiles once): 16 heads, head_dim 192 = two 64-wide NoPE
chunks + 64 RoPE dims, window 40 (not a multiple of the 16-row key chunks), 16 token positions
per block (a sliding ring of 4 blocks), CSA ratio 4 and an HCA ratio of 8 (so HCA entries exist
at <= 200 tokens), top-k 24 (padded to 32 in the indexer), 2 pool layers (layer 1 used). Values,
sequence lengths, block tables (with unassigned -1 entries) and -1 / invisible top-k picks are
random inside those shapes; unused pool rows hold NaN so that any row read without its mask
poisons the result.

Tolerances (derived from the formats, stated once here):

* kv_write: bit-exact (the kernel reproduces formats.py; NaN blocks compared as NaN).
* attention kernel vs reference: the kernel rounds the softmax probabilities to bf16 before the
  P @ V dot (relative error <= 2**-9 each) and sums in another order, everything else is exact
  (fp8 dequantises exactly into bf16; bf16 x bf16 products are exact in fp32). With p summing
  to <= 1, |out - ref| <= 2**-9 * max|K|; we allow 2**-8 * max|K| + 1e-6.
* attention reference vs dense_attention: same fp32 math on the same values, only summation
  order differs: 1e-5 * max|K|.
* indexer top-k: scores differ only by fp32 summation order, at most
  (d + heads) * 2**-24 * sum_h |w_h| sum_d |q_hd k_d| (doubled); selections must agree except
  for swaps between entries whose reference scores lie within that bound of the k-th score.
  Exact ties (all-zero scores) must be broken by the lowest index in both. The same bound holds
  between the reference and the model's indexer (both fp32, only the summation order differs),
  once the model's fp8 keys take the QAT round trip, which equals the stored keys exactly.
* references over float32 pools vs a float64 numpy computation: nothing is rounded (q off the
  bf16 grid), only fp32 summation differs: attention 1e-6 * max|K|; indexer scores
  (d + heads) * 2**-24 * sum_h |w_h| sum_d |q_hd k_d|.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4_jax import presets
from dsv4_jax.model import kv_rounding
from dsv4_jax.model.attention_core import dense_attention
from dsv4_jax.model.indexer import Indexer
from pallas_kernels import backend, formats, paged_attention, tuning
from pallas_kernels.indexer_topk import indexer_scores_reference, indexer_topk, indexer_topk_reference
from pallas_kernels.kv_write import _ue8m0_byte_and_inverse, write_indexer_keys, write_kv, write_kv_reference
from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference
from pallas_kernels.sparse_prefill import sparse_prefill, sparse_prefill_reference

HEADS, HEAD_DIM, ROPE = 16, 192, 64
WINDOW, UNITS = 40, 16
RING = -(-WINDOW // UNITS) + 1
CSA, HCA = 4, 8
TOPK = 24
MAX_LEN = 200
PAGES = -(-MAX_LEN // UNITS)
LAYERS, LAYER = 2, 1
INDEX_HEADS, INDEX_DIM = 16, 64
BATCH = 4  # the last row is a padding row (length 0) in decode

DECODE_CFG = tuning.KernelConfig(block_h=16, block_k=16, max_splits=4)
PREFILL_CFG = tuning.KernelConfig(block_q=2, block_h=8, block_k=16)
PREFILL_CSA_CFG = tuning.KernelConfig(block_h=16, block_k=16)
INDEXER_CFG = tuning.KernelConfig(block_k=16, max_splits=2)
WRITE_CFG = tuning.KernelConfig(block_k=16)


def attention_tol(kmax: float) -> float:
    return 2.0**-8 * kmax + 1e-6


def dense_tol(kmax: float) -> float:
    return 1e-5 * kmax


# ---- a random paged cache and the same K/V laid out contiguously --------------------------------
def _nan_planes(fmt: str, blocks: int, units: int) -> list[np.ndarray]:
    lead = (LAYERS, blocks, units)
    if fmt == "fp8_ds_mla":
        nope = np.full((*lead, HEAD_DIM - ROPE), 0x7F, np.uint8).view(jnp.float8_e4m3fn)  # e4m3 NaN
        return [nope, np.full((*lead, ROPE), np.nan, jnp.bfloat16), np.full((*lead, 8), 0xFF, np.uint8)]
    return [np.full((*lead, HEAD_DIM), np.nan, np.float32 if fmt == "float32" else jnp.bfloat16)]


@functools.partial(jax.jit, static_argnums=0)
def _quantize(fmt: str, x):
    if fmt == "fp8_ds_mla":
        planes = formats.fp8_ds_mla_quantize(x, ROPE)
        return planes, formats.fp8_ds_mla_dequantize(*planes)
    rows = x.astype(jnp.float32 if fmt == "float32" else jnp.bfloat16)
    return (rows,), rows.astype(jnp.float32)


_indexer_quantize = jax.jit(formats.indexer_fp8_quantize)


def _encode(fmt: str, x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """(stored planes, dequantised values) of x [..., D], in one jitted call per shape."""
    planes, values = _quantize(fmt, jnp.asarray(x))
    return [np.asarray(p) for p in planes], np.asarray(values)


def _store(planes: list[np.ndarray], flat_rows: np.ndarray, stored: list[np.ndarray]) -> None:
    """Put already quantised rows at flat rows of layer LAYER (numpy, independent of kv_write)."""
    units = planes[0].shape[2]
    blk, off = flat_rows // units, flat_rows % units
    for p, v in zip(planes, stored):
        p[LAYER, blk, off] = v


@functools.lru_cache(maxsize=None)
def make_cache(fmt: str, seed: int, lens: tuple[int, ...], pool_len: tuple[int, ...] | None = None):
    """Pools holding sequences of the given lengths (the sliding ring holds the tail of each; with
    `pool_len` the ring holds positions < pool_len only, as before a prefill chunk is written)."""
    rng = np.random.default_rng(seed)
    batch = len(lens)
    kv = rng.standard_normal((batch, MAX_LEN, HEAD_DIM)).astype(np.float32) * 2.0
    kv[:, :, :16] *= 8.0  # uneven block maxima: scales differ per 64-dim chunk
    csa = rng.standard_normal((batch, MAX_LEN // CSA, HEAD_DIM)).astype(np.float32)
    hca = rng.standard_normal((batch, MAX_LEN // HCA, HEAD_DIM)).astype(np.float32)
    ikeys = rng.standard_normal((batch, MAX_LEN // CSA, INDEX_DIM)).astype(np.float32)

    kv_planes, kv_values = _encode(fmt, kv)
    csa_planes, csa_values = _encode(fmt, csa)
    hca_planes, hca_values = _encode(fmt, hca)
    ik_q, ik_s = (np.asarray(a) for a in _indexer_quantize(jnp.asarray(ikeys)))

    w_blocks = batch * RING + 3
    wbt = rng.permutation(w_blocks)[: batch * RING].reshape(batch, RING).astype(np.int32)
    c_blocks = batch * PAGES + 5
    cbt = rng.permutation(c_blocks)[: batch * PAGES].reshape(batch, PAGES).astype(np.int32)
    wpool = _nan_planes(fmt, w_blocks, UNITS)
    cpool = _nan_planes(fmt, c_blocks, UNITS // CSA)
    hpool = _nan_planes(fmt, c_blocks, UNITS // HCA)
    ipool = [
        np.full((LAYERS, c_blocks, UNITS // CSA, INDEX_DIM), 0x7F, np.uint8).view(jnp.float8_e4m3fn),
        np.full((LAYERS, c_blocks, UNITS // CSA), np.nan, np.float32),
    ]
    ipool_bf16 = [np.full((LAYERS, c_blocks, UNITS // CSA, INDEX_DIM), np.nan, jnp.bfloat16)]
    ipool_f32 = [np.full((LAYERS, c_blocks, UNITS // CSA, INDEX_DIM), np.nan, np.float32)]
    for b, n in enumerate(lens):
        end = n if pool_len is None else pool_len[b]
        if end > 0:  # the ring holds the last RING pages of positions < end
            pos = np.arange(max(0, ((end - 1) // UNITS - RING + 1) * UNITS), end)
            _store(wpool, wbt[b, (pos // UNITS) % RING] * UNITS + pos % UNITS, [p[b, pos] for p in kv_planes])
        pages = -(-n // UNITS)
        cbt[b, pages:] = -1  # blocks past the sequence are unassigned
        for planes, stored, ratio in ((cpool, csa_planes, CSA), (hpool, hca_planes, HCA)):
            j = np.arange(n // ratio)
            u = UNITS // ratio
            _store(planes, cbt[b, j // u] * u + j % u, [p[b, j] for p in stored])
        j = np.arange(n // CSA)
        u = UNITS // CSA
        _store(ipool, cbt[b, j // u] * u + j % u, [ik_q[b, j], ik_s[b, j]])
        _store(ipool_bf16, cbt[b, j // u] * u + j % u, [ikeys[b, j].astype(jnp.bfloat16)])
        _store(ipool_f32, cbt[b, j // u] * u + j % u, [ikeys[b, j]])
    return dict(
        wpool=tuple(jnp.asarray(p) for p in wpool), wbt=jnp.asarray(wbt),
        cpool=tuple(jnp.asarray(p) for p in cpool), hpool=tuple(jnp.asarray(p) for p in hpool),
        cbt=jnp.asarray(cbt), ipool=tuple(jnp.asarray(p) for p in ipool),
        ipool_bf16=tuple(jnp.asarray(p) for p in ipool_bf16), ipool_f32=tuple(jnp.asarray(p) for p in ipool_f32),
        # the same values, contiguous, as the cache stores them (for dense_attention); indexer
        # keys as the float32 pool stores them
        kv=kv_values, csa=csa_values, hca=hca_values, kmax=float(np.abs(kv_values).max()), ikeys=ikeys,
    )


def _random_picks(rng, lens_or_pos: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Top-k picks: random entries, some -1, some not visible yet (both must be skipped)."""
    picks = rng.integers(0, MAX_LEN // CSA, shape).astype(np.int32)
    picks[rng.random(shape) < 0.2] = -1
    return picks


def _dense(c, q_full, sinks, mode, idx_full):
    seq = q_full.shape[1]
    ratio = {"window": 1, "csa": CSA, "hca": HCA}[mode]
    comp = None if mode == "window" else jnp.asarray(c["csa" if mode == "csa" else "hca"])
    idx = jnp.asarray(idx_full) if mode == "csa" else None
    kv = jnp.asarray(c["kv"][:, :seq])
    return np.asarray(_dense_attention(q_full, kv, comp, idx, sinks, window=WINDOW, ratio=ratio))


_dense_attention = jax.jit(dense_attention, static_argnames=("window", "ratio"))


def _compressed_args(c, mode, picks):
    if mode == "window":
        return (None, None, None, LAYER, LAYER)
    pool = c["cpool"] if mode == "csa" else c["hpool"]
    return (pool, c["cbt"], None if mode == "hca" else jnp.asarray(picks), LAYER, LAYER)


# ---- kv_write -----------------------------------------------------------------------------------
def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    fa = a.astype(np.float32) if a.dtype != np.uint8 else a
    fb = b.astype(np.float32) if b.dtype != np.uint8 else b
    if a.dtype == np.uint8:
        return np.array_equal(a, b)
    nan_a, nan_b = np.isnan(fa), np.isnan(fb)
    view = np.uint8 if a.itemsize == 1 else (np.uint16 if a.itemsize == 2 else np.uint32)
    return np.array_equal(nan_a, nan_b) and np.array_equal(
        np.where(nan_a, 0, a.view(view)), np.where(nan_b, 0, b.view(view))
    )


def test_ue8m0_exponent_matches_formats():
    """The kernel's bit formula for the scale byte equals formats.ue8m0_encode, including at
    every power of two times 448 and its float32 neighbours (where rounding could differ)."""
    edges = np.float32(448.0) * np.float32(2.0) ** np.arange(-40, 100, dtype=np.float32)
    rng = np.random.default_rng(0)
    samples = np.abs(rng.standard_normal(20000)).astype(np.float32) * np.float32(10.0) ** rng.integers(-8, 30, 20000)
    a = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf)), samples,
                        np.array([0.0, 1e-4, 1e-6, 3.4e38], np.float32)]).astype(np.float32)
    a = a[np.isfinite(a)]
    byte, inv = jax.jit(_ue8m0_byte_and_inverse)(jnp.asarray(a), jnp.zeros(a.shape, bool))
    want = np.asarray(formats.ue8m0_encode(jnp.asarray(a)))
    np.testing.assert_array_equal(np.asarray(byte), want.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(inv), 1.0 / np.asarray(formats.ue8m0_decode(jnp.asarray(want))))


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16", "indexer_fp8"])
def test_kv_write_matches_reference(fmt):
    rng = np.random.default_rng({"fp8_ds_mla": 1, "bf16": 2, "indexer_fp8": 3}[fmt])
    blocks, units, t = 7, 16, 45  # t not a multiple of the 16-row program block
    dim = INDEX_DIM if fmt == "indexer_fp8" else HEAD_DIM
    if fmt == "fp8_ds_mla":
        pool = tuple(jnp.asarray(p) for p in _nan_planes(fmt, blocks, units))
    elif fmt == "bf16":
        pool = (jnp.zeros((LAYERS, blocks, units, HEAD_DIM), jnp.bfloat16),)
    else:
        pool = (
            jnp.zeros((LAYERS, blocks, units, dim), jnp.float8_e4m3fn),
            jnp.zeros((LAYERS, blocks, units), jnp.float32),
        )
    x = rng.standard_normal((t, dim)).astype(np.float32) * np.exp(rng.uniform(-12, 12, (t, 1))).astype(np.float32)
    x[3, 5] = np.inf  # a non-finite 64-dim block -> scale byte 0xFF, NaN values
    x[4, dim - 1] = np.nan  # (second 64-dim block of a KV row)
    x[6, :64] = 0.0  # all-zero block -> floor scale
    x[7, :64] = -0.0
    slots = rng.permutation(blocks * units)[:t].astype(np.int32)
    slots[[0, 9, 30]] = -1  # skipped
    slots[12] = blocks * units + 5  # past the pool: skipped
    write = write_indexer_keys if fmt == "indexer_fp8" else write_kv
    got = write(pool, jnp.asarray(x), jnp.asarray(slots), LAYER, config=WRITE_CFG, interpret=True)
    want = write_kv_reference(pool, jnp.asarray(x), jnp.asarray(slots), LAYER)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert _bits_equal(g, w), fmt
    # nothing to write: the pool is unchanged
    none = write(pool, jnp.asarray(x), jnp.full((t,), -1, jnp.int32), LAYER, config=WRITE_CFG, interpret=True)
    for g, p in zip(none, pool):
        assert _bits_equal(g, p)


def test_writers_reject_rows_that_do_not_fit_the_pool():
    # numpy operands: the errors come while tracing, so nothing is compiled
    kv_pool = tuple(_nan_planes("fp8_ds_mla", 1, UNITS))
    key_pool = (np.zeros((1, 1, UNITS, INDEX_DIM), jnp.float8_e4m3fn), np.zeros((1, 1, UNITS), np.float32))
    slots = np.zeros((2,), np.int32)
    with pytest.raises(ValueError, match="rows of 64 dims do not fit this fp8_ds_mla pool, whose rows have 192"):
        write_kv_reference(kv_pool, np.zeros((2, 64), np.float32), slots)
    with pytest.raises(ValueError, match="rows of 192 dims do not fit this indexer_fp8 pool, whose rows have 64"):
        write_kv_reference(key_pool, np.zeros((2, HEAD_DIM), np.float32), slots)
    with pytest.raises(ValueError, match="write_kv got an indexer key pool"):
        write_kv(key_pool, np.zeros((2, INDEX_DIM), np.float32), slots, config=WRITE_CFG, interpret=True)
    with pytest.raises(ValueError, match="write_indexer_keys got an fp8_ds_mla KV pool"):
        write_indexer_keys(kv_pool, np.zeros((2, HEAD_DIM), np.float32), slots, config=WRITE_CFG, interpret=True)


# ---- sparse decode ------------------------------------------------------------------------------
DECODE_CASES = [  # (format, mode, splits, seed)
    ("fp8_ds_mla", "csa", 3, 11),
    ("fp8_ds_mla", "hca", 2, 12),
    ("fp8_ds_mla", "window", 1, 13),
    ("bf16", "csa", 2, 14),
]


def _decode_inputs(fmt, mode, seed):
    rng = np.random.default_rng(seed)
    lens = tuple(int(n) for n in rng.integers(1, MAX_LEN + 1, BATCH - 1)) + (0,)
    c = make_cache(fmt, seed, lens)
    q = jnp.asarray((rng.standard_normal((BATCH, HEADS, HEAD_DIM)) * 1.5).astype(jnp.bfloat16))
    sinks = jnp.asarray(rng.standard_normal(HEADS).astype(np.float32))
    picks = _random_picks(rng, np.array(lens), (BATCH, TOPK))
    return c, np.array(lens), q, sinks, picks


@pytest.mark.parametrize("fmt,mode,splits,seed", DECODE_CASES)
def test_sparse_decode_matches_reference_and_dense(fmt, mode, splits, seed):
    c, lens, q, sinks, picks = _decode_inputs(fmt, mode, seed)
    ratio = {"window": 0, "csa": CSA, "hca": HCA}[mode]
    args = (q, c["wpool"], c["wbt"], jnp.asarray(lens), sinks, *_compressed_args(c, mode, picks))
    got = np.asarray(sparse_decode(
        *args, window=WINDOW, ratio=ratio, config=DECODE_CFG, num_splits=splits, interpret=True
    ))
    ref = np.asarray(sparse_decode_reference(*args, window=WINDOW, ratio=ratio))
    assert np.isfinite(got).all() and np.isfinite(ref).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=attention_tol(c["kmax"]))
    assert not got[-1].any() and not ref[-1].any()  # padding row (length 0)

    # reference == the model's dense attention on the same K/V laid out contiguously
    live = lens > 0
    q_full = np.zeros((BATCH, MAX_LEN, HEADS, HEAD_DIM), jnp.bfloat16)
    idx_full = np.full((BATCH, MAX_LEN, TOPK), -1, np.int32)
    for b in np.flatnonzero(live):
        q_full[b, lens[b] - 1] = np.asarray(q[b])
        idx_full[b, lens[b] - 1] = picks[b]
    dense = _dense(c, jnp.asarray(q_full), sinks, mode, idx_full)
    want = np.stack([dense[b, lens[b] - 1] for b in np.flatnonzero(live)])
    np.testing.assert_allclose(ref[live], want, rtol=1e-5, atol=dense_tol(c["kmax"]))


# ---- sparse prefill -----------------------------------------------------------------------------
PREFILL_CASES = [  # (format, mode, seq, use chunk rows (window_kv), seed)
    ("fp8_ds_mla", "hca", 12, False, 21),
    ("fp8_ds_mla", "csa", 12, False, 22),
    ("bf16", "window", 48, True, 23),
    # window_kv on every mode: Attention.step prefills a chunk on each layer this way
    ("fp8_ds_mla", "window", 20, True, 24),
    ("fp8_ds_mla", "hca", 12, True, 25),
    ("fp8_ds_mla", "csa", 6, True, 26),
]


@pytest.mark.parametrize("fmt,mode,seq,chunk,seed", PREFILL_CASES)
def test_sparse_prefill_matches_reference_and_dense(fmt, mode, seq, chunk, seed):
    rng = np.random.default_rng(seed)
    batch = 3
    q_lens = rng.integers(1, seq + 1, batch).astype(np.int32)
    q_lens[0] = seq
    q_start = rng.integers(0, MAX_LEN - seq + 1, batch).astype(np.int32)
    lens = tuple(int(n) for n in q_start + q_lens)
    # with chunk rows the ring holds only positions before the chunk (a chunk longer than it can)
    c = make_cache(fmt, seed, lens, tuple(int(s) for s in q_start) if chunk else None)
    q = jnp.asarray((rng.standard_normal((batch, seq, HEADS, HEAD_DIM)) * 1.5).astype(jnp.bfloat16))
    sinks = jnp.asarray(rng.standard_normal(HEADS).astype(np.float32))
    picks = _random_picks(rng, q_start, (batch, seq, TOPK))
    ratio = {"window": 0, "csa": CSA, "hca": HCA}[mode]
    window_kv = None
    if chunk:
        window_kv = jnp.asarray(np.stack([c["kv"][b, q_start[b] : q_start[b] + seq] for b in range(batch)]))
    args = (q, c["wpool"], c["wbt"], jnp.asarray(q_start), jnp.asarray(q_lens), sinks,
            *_compressed_args(c, mode, picks), window_kv)
    cfg = PREFILL_CSA_CFG if mode == "csa" else PREFILL_CFG
    got = np.asarray(sparse_prefill(*args, window=WINDOW, ratio=ratio, config=cfg, interpret=True))
    ref = np.asarray(sparse_prefill_reference(*args, window=WINDOW, ratio=ratio))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=attention_tol(c["kmax"]))
    for b in range(batch):
        assert not got[b, q_lens[b]:].any()  # padding rows

    q_full = np.zeros((batch, MAX_LEN, HEADS, HEAD_DIM), jnp.bfloat16)
    idx_full = np.full((batch, MAX_LEN, TOPK), -1, np.int32)
    q_np = np.asarray(q)
    for b in range(batch):
        q_full[b, q_start[b] : q_start[b] + q_lens[b]] = q_np[b, : q_lens[b]]
        idx_full[b, q_start[b] : q_start[b] + q_lens[b]] = picks[b, : q_lens[b]]
    dense = _dense(c, jnp.asarray(q_full), sinks, mode, idx_full)
    # The reference gathers window keys once per tile of consecutive queries (paged_attention.
    # band_tile): one tile at these lengths; traced again with small tiles, so that several tiles
    # share a row (bands overlapping the previous tile's, stale ring rows inside a band).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_attention, "BAND_TILE", 4)
        assert paged_attention.band_tile(seq, WINDOW) < seq
        tiled = np.asarray(jax.jit(functools.partial(sparse_prefill_reference.__wrapped__, window=WINDOW,
                                                     ratio=ratio))(*args))
    for b in range(batch):
        for out in (ref, tiled):
            np.testing.assert_allclose(out[b, : q_lens[b]], dense[b, q_start[b] : q_start[b] + q_lens[b]],
                                       rtol=1e-5, atol=dense_tol(c["kmax"]))
        assert not tiled[b, q_lens[b]:].any()


# ---- indexer top-k ------------------------------------------------------------------------------
def _assert_same_selection(got, want, scores, bound):
    """Same picks, except swaps across the k-th place between scores within `bound` of it."""
    for pos in np.ndindex(got.shape[:-1]):
        g, w, s = got[pos], want[pos], scores[pos]
        assert (g < 0).sum() == (w < 0).sum(), pos
        gs, ws = set(g[g >= 0].tolist()), set(w[w >= 0].tolist())
        assert len(gs) == (g >= 0).sum(), f"duplicate picks at {pos}"
        if gs != ws:
            kth = min(s[j] for j in ws)
            for j in gs ^ ws:
                assert abs(s[j] - kth) <= bound[pos], (pos, j, s[j], kth)


def _near_tie_bound(q, w, pool, tail_args):
    """Per query row: 2 (d + heads) 2**-24 max_j sum_h |w_h| sum_d |q_hd k_jd|, twice the bound on
    the fp32 summation-order error of a score (the docstring's indexer tolerance). |q|, |w|, |k|
    go through the reference scorer, so the magnitudes are those of the stored keys."""
    keys = np.abs(np.asarray(pool[0]).astype(np.float32)).astype(pool[0].dtype)
    abs_pool = (jnp.asarray(keys), *pool[1:])
    mag = np.asarray(indexer_scores_reference(
        jnp.asarray(np.abs(np.asarray(q))), jnp.asarray(np.abs(np.asarray(w))), abs_pool, *tail_args, ratio=CSA
    ))
    return 2 * (INDEX_DIM + INDEX_HEADS) * 2.0**-24 * np.max(np.where(np.isfinite(mag), mag, 0), axis=-1)


INDEXER_CASES = [  # (kind, seq, splits, key format, seed)
    ("prefill", 8, 1, "fp8", 31),
    ("decode", 1, 2, "fp8", 32),
    ("prefill", 4, 2, "bf16", 33),
]


@pytest.mark.parametrize("kind,seq,splits,key_fmt,seed", INDEXER_CASES)
def test_indexer_topk_matches_reference(kind, seq, splits, key_fmt, seed):
    rng = np.random.default_rng(seed)
    batch = 3
    q_lens = np.full(batch, seq, np.int32)
    q_lens[-1] = max(seq // 2, 1) if kind == "prefill" else 0  # padding rows -> all -1
    q_start = rng.integers(0, MAX_LEN - seq + 1, batch).astype(np.int32)
    c = make_cache("fp8_ds_mla", seed, tuple(int(n) for n in q_start + seq))
    pool = c["ipool"] if key_fmt == "fp8" else c["ipool_bf16"]
    q = jnp.asarray(rng.standard_normal((batch, seq, INDEX_HEADS, INDEX_DIM)).astype(jnp.bfloat16))
    w = jnp.asarray(rng.standard_normal((batch, seq, INDEX_HEADS)).astype(np.float32))
    args = (q, w, pool, c["cbt"], jnp.asarray(q_start), jnp.asarray(q_lens), LAYER)
    got = np.asarray(indexer_topk(*args, topk=TOPK, ratio=CSA, config=INDEXER_CFG, num_splits=splits, interpret=True))
    want = np.asarray(indexer_topk_reference(*args, topk=TOPK, ratio=CSA))
    scores = np.asarray(indexer_scores_reference(*args, ratio=CSA))
    bound = _near_tie_bound(q, w, pool, args[3:])
    assert got.shape == (batch, seq, TOPK)
    _assert_same_selection(got, want, scores, bound)
    visible = np.isfinite(scores).sum(-1)
    np.testing.assert_array_equal((got >= 0).sum(-1), np.minimum(visible, TOPK))
    if kind == "decode":
        assert (got[-1] == -1).all()

    # exact ties: q = 0 gives every visible entry score 0 -> the lowest indices, in order
    zeros = jnp.asarray(np.zeros(q.shape, jnp.bfloat16))
    tied = np.asarray(
        indexer_topk(zeros, *args[1:], topk=TOPK, ratio=CSA, config=INDEXER_CFG, num_splits=splits, interpret=True)
    )
    tied_ref = np.asarray(indexer_topk_reference(zeros, *args[1:], topk=TOPK, ratio=CSA))
    np.testing.assert_array_equal(tied, tied_ref)
    first = np.where(np.isfinite(scores[0, 0]))[0][:TOPK]
    np.testing.assert_array_equal(tied[0, 0, : len(first)], first)


class _Fixed(nnx.Module):
    """Stands in for a submodule of the model's Indexer: returns a fixed array whatever its input."""

    def __init__(self, value):
        self.value = value

    def __call__(self, *args, **kwargs):
        return self.value

    def float32(self, *args, **kwargs):  # as `Linear.float32` (the indexer's head weights)
        return self.value


@pytest.mark.parametrize("key_fmt", ["bf16", "fp8"])
def test_indexer_reference_matches_model_indexer(key_fmt):
    """`indexer_topk_reference` over a paged key pool selects what the model's `Indexer.__call__`
    selects on the same keys (full sequence from position 0). The model's own `__call__` runs,
    with its projections and compressor replaced by fixed outputs (queries, raw head weights,
    keys) and identity RoPE (cos 1, sin 0), so the score formula, the head-weight scaling
    index_head_dim**-0.5 * index_n_heads**-0.5 and `select_visible_topk` are the model's.
    bf16 keys: the pool stores them exactly. fp8 keys: the model takes its QAT round trip
    (`round_keys=True`, kv_rounding.indexer_key_round_trip) and the pool is written by the cache's writer
    (kv_write's reference, formats.indexer_fp8_quantize); the dequantised pool must equal the
    round trip bit for bit. Selections must then agree except for swaps across the k-th place
    between entries whose reference scores lie within the fp32 summation bound."""
    rng = np.random.default_rng({"bf16": 41, "fp8": 42}[key_fmt])
    batch, seq = 2, 128  # 32 entries > top-k 24; the first 95 positions see fewer than 24
    n = seq // CSA
    config = dataclasses.replace(
        presets.dsv4_tiny_test(), index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=TOPK,
    )
    q = (rng.standard_normal((batch, seq, INDEX_HEADS, INDEX_DIM)) * 0.5).astype(jnp.bfloat16)
    raw_w = rng.standard_normal((batch, seq, INDEX_HEADS)).astype(np.float32)  # weights_proj(x), any sign
    keys = rng.standard_normal((batch, n, INDEX_DIM)).astype(np.float32)
    keys *= np.exp(rng.uniform(-3, 3, (batch, n, 1))).astype(np.float32)  # a different scale per key
    keys = keys.astype(jnp.bfloat16) if key_fmt == "bf16" else keys

    indexer = Indexer(config, CSA)
    indexer.wq_b = _Fixed(jnp.asarray(q.reshape(batch, seq, INDEX_HEADS * INDEX_DIM)))
    indexer.weights_proj = _Fixed(jnp.asarray(raw_w))
    indexer.compressor = _Fixed(jnp.asarray(keys))
    cos = jnp.ones((seq, config.qk_rope_head_dim // 2), jnp.float32)
    x = jnp.zeros((batch, seq, config.hidden_size), jnp.bfloat16)
    latent = jnp.zeros((batch, seq, config.q_lora_rank), jnp.bfloat16)
    model = np.asarray(indexer(x, latent, cos, jnp.zeros_like(cos), round_keys=key_fmt == "fp8"))
    assert model.shape == (batch, seq, TOPK)

    # the same keys written into a paged pool (random blocks, -1 past the sequence, NaN elsewhere)
    units = UNITS // CSA
    blocks = batch * PAGES + 3
    table = rng.permutation(blocks)[: batch * PAGES].reshape(batch, PAGES).astype(np.int32)
    table[:, -(-n // units):] = -1
    if key_fmt == "fp8":
        pool = (
            jnp.asarray(np.full((LAYERS, blocks, units, INDEX_DIM), 0x7F, np.uint8).view(jnp.float8_e4m3fn)),
            jnp.full((LAYERS, blocks, units), jnp.nan, jnp.float32),
        )
    else:
        pool = (jnp.full((LAYERS, blocks, units, INDEX_DIM), jnp.nan, jnp.bfloat16),)
    j = np.arange(n)
    slots = np.concatenate([table[b, j // units] * units + j % units for b in range(batch)]).astype(np.int32)
    flat_keys = jnp.asarray(keys.reshape(batch * n, INDEX_DIM))
    pool = write_kv_reference(pool, flat_keys, jnp.asarray(slots), LAYER)
    if key_fmt == "fp8":  # the cache stores exactly the model's round trip
        flat = [p[LAYER].reshape(blocks * units, *p.shape[3:]) for p in pool]
        stored = np.asarray(formats.indexer_fp8_dequantize(flat[0][slots], flat[1][slots]))
        trip = np.asarray(kv_rounding.indexer_key_round_trip(jnp.asarray(keys))).reshape(batch * n, INDEX_DIM)
        np.testing.assert_array_equal(stored, trip)

    head_w = jnp.asarray(raw_w) * (INDEX_DIM**-0.5 * INDEX_HEADS**-0.5)  # as Indexer.__call__ scales it
    args = (jnp.asarray(q), head_w, pool, jnp.asarray(table), jnp.zeros(batch, jnp.int32),
            jnp.full(batch, seq, jnp.int32), LAYER)
    want = np.asarray(indexer_topk_reference(*args, topk=TOPK, ratio=CSA))
    scores = np.asarray(indexer_scores_reference(*args, ratio=CSA))
    _assert_same_selection(model, want, scores, _near_tie_bound(q, head_w, pool, args[3:]))
    visible = np.minimum((np.arange(seq) + 1) // CSA, TOPK)
    np.testing.assert_array_equal((model >= 0).sum(-1), np.broadcast_to(visible, (batch, seq)))
    # near-ties are rare: almost every row is the same list, in the same order
    same_rows = np.all(model == want, axis=-1)
    assert same_rows.mean() >= 0.95, same_rows.mean()


# ---- float32 pools: the references round nothing ----------------------------------------------
def _attention_f64(c, b: int, pos: int, q: np.ndarray, sinks: np.ndarray, mode: str, picks: np.ndarray):
    """float64 attention of the queries q [H, D] of sequence b at position `pos`: its window rows,
    all visible HCA entries or its visible CSA picks, and the per-head sink, from the contiguous
    values the float32 pools hold exactly (spec 3.4, written independently of the references)."""
    keys = [c["kv"][b, max(0, pos - WINDOW + 1) : pos + 1]]
    if mode == "hca":
        keys.append(c["hca"][b, : (pos + 1) // HCA])
    elif mode == "csa":
        keys.append(c["csa"][b, picks[(picks >= 0) & (picks < (pos + 1) // CSA)]])
    k = np.concatenate(keys).astype(np.float64)
    logits = q.astype(np.float64) @ k.T * HEAD_DIM**-0.5  # [H, keys]
    sink = sinks.astype(np.float64)
    m = np.maximum(logits.max(-1), sink)
    p = np.exp(logits - m[:, None])
    return (p @ k) / (p.sum(-1) + np.exp(sink - m))[:, None]


F32_TOL = 1e-6  # x max|K|: fp32 at HIGHEST precision against float64 (rounding q to bf16 moves it ~1e-3)


@pytest.mark.parametrize("kind,mode,seed", [("decode", "csa", 51), ("prefill", "hca", 52)])
def test_float32_pools_attention_references_round_nothing(kind, mode, seed):
    """Over float32 pools (the exact reference cache) the attention references equal a float64
    computation: q, the pool rows and the chunk's own rows (`window_kv`) are all used unrounded.
    q is float32 off the bf16 grid, so rounding it (or the chunk rows) would show."""
    rng = np.random.default_rng(seed)
    sinks = rng.standard_normal(HEADS).astype(np.float32)
    ratio = {"csa": CSA, "hca": HCA}[mode]
    if kind == "decode":
        lens = np.array([int(n) for n in rng.integers(1, MAX_LEN + 1, BATCH - 1)] + [0])
        c = make_cache("float32", seed, tuple(int(n) for n in lens))
        q = (rng.standard_normal((BATCH, HEADS, HEAD_DIM)) * 0.25).astype(np.float32)
        picks = _random_picks(rng, lens, (BATCH, TOPK))
        got = np.asarray(sparse_decode_reference(
            jnp.asarray(q), c["wpool"], c["wbt"], jnp.asarray(lens), jnp.asarray(sinks),
            *_compressed_args(c, mode, picks), window=WINDOW, ratio=ratio,
        ))
        want = np.zeros_like(got, np.float64)
        for b in np.flatnonzero(lens):
            want[b] = _attention_f64(c, b, lens[b] - 1, q[b], sinks, mode, picks[b])
    else:  # a chunk of 12 tokens whose own rows come from window_kv; the ring holds earlier ones
        seq, batch = 12, 3
        q_lens = np.array([seq, 7, 3], np.int32)
        q_start = rng.integers(0, MAX_LEN - seq + 1, batch).astype(np.int32)
        c = make_cache("float32", seed, tuple(int(n) for n in q_start + q_lens), tuple(int(s) for s in q_start))
        q = (rng.standard_normal((batch, seq, HEADS, HEAD_DIM)) * 0.25).astype(np.float32)
        window_kv = np.stack([c["kv"][b, q_start[b] : q_start[b] + seq] for b in range(batch)])
        got = np.asarray(sparse_prefill_reference(
            jnp.asarray(q), c["wpool"], c["wbt"], jnp.asarray(q_start), jnp.asarray(q_lens), jnp.asarray(sinks),
            *_compressed_args(c, mode, None), jnp.asarray(window_kv), window=WINDOW, ratio=ratio,
        ))
        want = np.zeros_like(got, np.float64)
        for b in range(batch):
            for s_ in range(q_lens[b]):
                want[b, s_] = _attention_f64(c, b, q_start[b] + s_, q[b, s_], sinks, mode, np.zeros(0, int))
    np.testing.assert_allclose(got, want, rtol=0, atol=F32_TOL * c["kmax"])


def test_float32_indexer_reference_rounds_nothing():
    """Over float32 keys the indexer reference's scores equal float64 scores within fp32
    summation (q float32 off the bf16 grid, unrounded), and its top-k is the float64 top-k."""
    rng = np.random.default_rng(53)
    batch, seq = 3, 6
    q_start = rng.integers(0, MAX_LEN - seq + 1, batch).astype(np.int32)
    q_lens = np.array([seq, seq, 2], np.int32)
    c = make_cache("float32", 53, tuple(int(n) for n in q_start + seq))
    q = rng.standard_normal((batch, seq, INDEX_HEADS, INDEX_DIM)).astype(np.float32)
    w = rng.standard_normal((batch, seq, INDEX_HEADS)).astype(np.float32)
    args = (jnp.asarray(q), jnp.asarray(w), c["ipool_f32"], c["cbt"], jnp.asarray(q_start), jnp.asarray(q_lens), LAYER)
    scores = np.asarray(indexer_scores_reference(*args, ratio=CSA))
    got = np.asarray(indexer_topk_reference(*args, topk=TOPK, ratio=CSA))

    entries = scores.shape[-1]
    want = np.full(scores.shape, -np.inf)
    mag = np.zeros(scores.shape)  # sum_h |w_h| sum_d |q_hd k_d|: the scale of a score's fp32 error
    for b in range(batch):
        for s_ in range(q_lens[b]):
            n = min((q_start[b] + s_ + 1) // CSA, entries)
            k = c["ikeys"][b, :n].astype(np.float64)
            qk = q[b, s_].astype(np.float64) @ k.T  # [heads, n]
            want[b, s_, :n] = np.maximum(qk, 0).T @ w[b, s_].astype(np.float64)
            mag[b, s_, :n] = np.abs(w[b, s_]).astype(np.float64) @ (np.abs(q[b, s_]).astype(np.float64) @ np.abs(k).T)
    visible = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(scores), visible)
    # fp32 summation over d products then h heads: |error| <= (d + heads) 2**-24 mag (~5e-6 mag);
    # q rounded to bf16 would move a score by ~1e-4 mag.
    err = np.abs(scores[visible] - want[visible])
    assert (err <= (INDEX_DIM + INDEX_HEADS) * 2.0**-24 * mag[visible]).all(), (err / mag[visible]).max()
    order = np.argsort(-want, axis=-1, kind="stable")[..., :TOPK]  # score desc, index asc
    want_top = np.where(np.take_along_axis(visible, order, -1), order, -1)
    _assert_same_selection(got, want_top, want, (INDEX_DIM + INDEX_HEADS) * 2.0**-23 * mag.max(-1))


def test_pallas_backends_refuse_float32_pools():
    # numpy operands: every error comes before or while tracing, so nothing is compiled
    f32_kv = (np.zeros((1, 2, UNITS, HEAD_DIM), np.float32),)
    f32_keys = (np.zeros((1, 2, UNITS // CSA, INDEX_DIM), np.float32),)
    table, lens = np.zeros((1, 2), np.int32), np.ones((1,), np.int32)
    q, sinks = np.zeros((1, HEADS, HEAD_DIM), np.float32), np.zeros((HEADS,), np.float32)
    rows, slots = np.zeros((2, HEAD_DIM), np.float32), np.zeros((2,), np.int32)
    for name in ("pallas_fp8_ds_mla", "pallas_bf16"):
        be = backend.get_backend(name, interpret=True)
        calls = [
            lambda: be.decode(q, f32_kv, table, lens, sinks, window=WINDOW),
            lambda: be.prefill(q[:, None], f32_kv, table, lens - 1, lens, sinks, window=WINDOW),
            lambda: be.write_kv(f32_kv, rows, slots),
            lambda: be.write_indexer_keys(f32_keys, rows[:, :INDEX_DIM], slots),
            lambda: be.indexer_topk(q[:, None, :, :INDEX_DIM], sinks[None, None], f32_keys, table, lens - 1, lens,
                                    topk=TOPK, ratio=CSA),
        ]
        for call in calls:
            with pytest.raises(ValueError, match=f"attention backend {name} cannot read float32 pools.*"
                                                 "--attention-backend xla"):
                call()
    # the kernels themselves refuse them too (at trace time: nothing is compiled)
    with pytest.raises(ValueError, match="sparse_decode Pallas kernel reads fp8 or bf16 pools"):
        sparse_decode(q, f32_kv, table, lens, sinks, window=WINDOW, config=DECODE_CFG, interpret=True)
    with pytest.raises(ValueError, match="indexer_topk Pallas kernel reads fp8 or bf16 pools"):
        indexer_topk(q[:, None, :, :INDEX_DIM], sinks[None, None], f32_keys, table, lens - 1, lens, topk=TOPK,
                     ratio=CSA, config=INDEXER_CFG, interpret=True)
    with pytest.raises(ValueError, match="kv_write Pallas kernel reads fp8 or bf16 pools"):
        write_kv(f32_kv, rows, slots, config=WRITE_CFG, interpret=True)


# ---- backend registry and tuning table ----------------------------------------------------------
def test_backend_registry():
    assert backend.BACKEND_NAMES == ("xla", "pallas_fp8_ds_mla", "pallas_bf16")
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend.get_backend("flashmla")
    xla = backend.get_backend("xla")
    assert xla.decode is not None and xla.kv_format is None
    c, lens, q, sinks, picks = _decode_inputs("bf16", "csa", 14)
    args = (q, c["wpool"], c["wbt"], jnp.asarray(lens), sinks, c["cpool"], c["cbt"], jnp.asarray(picks), LAYER, LAYER)
    np.testing.assert_array_equal(
        np.asarray(xla.decode(*args, window=WINDOW, ratio=CSA)),
        np.asarray(sparse_decode_reference(*args, window=WINDOW, ratio=CSA)),
    )
    with pytest.raises(ValueError, match="reads fp8_ds_mla"):
        backend.get_backend("pallas_fp8_ds_mla", interpret=True).decode(*args, window=WINDOW, ratio=CSA)

    # planes dataclasses (like dsv4_jax.kv_cache.paged.Bf16Rows) are accepted and returned as such
    @dataclasses.dataclass(frozen=True)
    class Bf16Rows:
        rows: jax.Array

    pool = Bf16Rows(rows=jnp.zeros((1, 2, UNITS, HEAD_DIM), jnp.bfloat16))
    for be in (xla, backend.get_backend("pallas_bf16", interpret=True)):
        out = be.write_kv(pool, jnp.ones((2, HEAD_DIM)), jnp.array([3, -1], jnp.int32))
        assert isinstance(out, Bf16Rows) and float(out.rows[0, 0, 3, 0]) == 1.0
        assert float(jnp.abs(out.rows.astype(jnp.float32)).sum()) == HEAD_DIM


def test_tuning_table():
    assert tuning.canonical_device_kind("NVIDIA H100 80GB HBM3") == "NVIDIA H100"
    assert tuning.canonical_device_kind("NVIDIA RTX PRO 6000 Blackwell Workstation Edition") == "NVIDIA RTX PRO 6000"
    assert tuning.canonical_device_kind("cpu") == "cpu"
    assert tuning.canonical_device_kind("NVIDIA Mystery GPU") == tuning.FALLBACK_KIND
    for kind, table in tuning.TUNING.items():
        assert set(table) == set(tuning.KERNELS), kind
        if kind != "cpu":  # Triton dots need M, N >= 16
            for name in ("sparse_decode", "sparse_prefill", "sparse_prefill_csa"):
                cfg = table[name]
                assert cfg.block_q * cfg.block_h >= 16 and cfg.block_k >= 16, (kind, name)
    # SM120 keeps the fp32 accumulator (M x 512 x 4 bytes) within its ~99 KB of shared memory
    sm120 = tuning.TUNING["NVIDIA RTX PRO 6000"]
    for name in ("sparse_decode", "sparse_prefill", "sparse_prefill_csa"):
        assert sm120[name].block_q * sm120[name].block_h * 512 * 4 <= 64 * 1024
    with pytest.raises(ValueError):
        tuning.KernelConfig(block_k=24)
