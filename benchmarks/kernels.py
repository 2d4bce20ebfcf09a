"""GPU benchmark of the Pallas kernels against the XLA path (the pure-JAX references).

    python benchmarks/kernels.py [--points decode,prefill,indexer,write] [--markdown FILE] [--budget-s 300]

Plain script (jax + numpy + this repository; no pytest). For each grid point it builds random
pools at DeepSeek-V4-Flash shapes on the device, compiles the kernel and the reference once,
checks GPU parity (max |kernel - reference| against the format-derived bound 2**-8 * max|K|
for attention, equality of the selected sets up to near-ties for the indexer, bit equality for
kv_write), then times both and reports the speed-up over the XLA path, achieved TFLOP/s and
HBM GB/s. At most 16 points: sparse_decode (CSA, fp8_ds_mla) at batch {1, 64, 128} x context
{4K, 32K, 128K}, sparse_prefill (CSA) and indexer_topk prefill at a 32K context, plus
indexer_topk decode and kv_write; and ("far") sparse_decode, indexer_topk and kv_write on rows at
the far end of pools whose planes hold more than 4 GiB (FAR_POOLS: where JAX's lowering indexes
with int64 offsets; 2-4 GiB planes are refused by the kernels).
The most telling points run first, so a run cut short by --budget-s keeps them.

Timing is HOST WALL-CLOCK, not device time: per call, the median over 7 batches of the mean of
n back-to-back calls of the compiled executable (n doubled until a batch takes >= 50 ms), each
batch ended by `jax.block_until_ready`. Dispatch is asynchronous, so for kernels longer than
their launch overhead this approaches the device time, but it includes launch gaps and the
host sync and is an upper bound on it. TFLOP/s and GB/s are derived from that time.

Robust to partial failure: a failing point is reported as ERROR and the next one runs; no point
starts after --budget-s seconds (it is reported as skipped). With --markdown, the table header
is written to the file at the start and each row is appended (and flushed to disk) as soon as
its point is measured, so a run killed by a timeout keeps every row measured so far.

FLOPs count useful work: attention 4 * heads * head_dim per (query, key) pair (QK and PV),
indexer 2 * heads * d per (query, entry). Bytes count the KV rows read once (584 B per
fp8_ds_mla row, 132 B per indexer entry) plus queries and outputs; gathered rows that hit in L2
are counted once, so GB/s is an effective, not a measured, bandwidth.

Targets (issue 5): sparse_decode at batch 64, 32K context >= 250 TFLOP/s on an H200 and >= 3x
the XLA path.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference  # noqa: E402
from pallas_kernels.kv_write import write_kv, write_kv_reference  # noqa: E402
from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference  # noqa: E402
from pallas_kernels.sparse_prefill import sparse_prefill, sparse_prefill_reference  # noqa: E402

HEADS, HEAD_DIM, ROPE, NOPE = 64, 512, 64, 448
TOPK, WINDOW, BLOCK, CSA = 512, 128, 256, 4
INDEX_HEADS, INDEX_DIM = 64, 128
ROW_BYTES = NOPE + 2 * ROPE + 8  # 584
INDEX_BYTES = INDEX_DIM + 4  # 132
RING = -(-WINDOW // BLOCK) + 1
MAX_CONTEXT = 131072


# ---- random device inputs ------------------------------------------------------------------------
def _e4m3(key, shape):
    """Random finite e4m3 bytes (0x7F / 0xFF are NaN)."""
    b = jax.random.randint(key, shape, 0, 254, jnp.int32)
    b = jnp.where(b >= 0x7F, b + 1, b).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _fp8_pool(key, blocks, units):
    k1, k2, k3 = jax.random.split(key, 3)
    nope = _e4m3(k1, (blocks, units, NOPE))
    rope = jax.random.normal(k2, (blocks, units, ROPE), jnp.bfloat16)
    scales = jax.random.randint(k3, (blocks, units, 8), 118, 124, jnp.int32).astype(jnp.uint8)
    return nope, rope, scales.at[..., 7].set(0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _indexer_pool(key, blocks, units):
    k1, k2 = jax.random.split(key)
    keys = _e4m3(k1, (blocks, units, INDEX_DIM))
    scale = jnp.exp2(jax.random.randint(k2, (blocks, units), -8, -4).astype(jnp.float32))
    return keys, scale


def _kmax(pool):
    nope, rope, scales = pool
    return float(448.0 * 2.0 ** (int(jnp.max(scales[..., :7])) - 127) + jnp.max(jnp.abs(rope.astype(jnp.float32))))


def _tables(batch, context):
    pages = -(-MAX_CONTEXT // BLOCK)
    cbt = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    cbt[:, -(-context // BLOCK):] = -1
    wbt = np.arange(batch * RING, dtype=np.int32).reshape(batch, RING)
    return jnp.asarray(wbt), jnp.asarray(cbt), batch * pages


# Pools whose planes pass 4 GiB, with the rows in use at their far end (a real V4-Flash pool on an
# H200 holds tens of GB per plane). JAX's Triton lowering computes element offsets in int32 unless
# an operand passes 2**32 bytes, so a 1-byte plane of 2-4 GiB wraps (an illegal memory access on
# an H200, docs/performance.md: the kernels refuse such pools and the planner never sizes one); past
# 4 GiB the offsets are int64, which these points check. (window blocks, compressed blocks,
# indexer blocks): every e4m3 plane past 2**32 elements.
FAR_POOLS = {"> 4 GiB": (40_000, 160_000, 540_000)}


def _far_tables(batch, context, window_blocks, compressed_blocks):
    """Block tables like `_tables`'s whose blocks are the pools' last ones."""
    pages, used = -(-MAX_CONTEXT // BLOCK), -(-context // BLOCK)
    cbt = np.full((batch, pages), -1, np.int32)
    cbt[:, :used] = compressed_blocks - batch * used + np.arange(batch * used, dtype=np.int32).reshape(batch, used)
    wbt = window_blocks - batch * RING + np.arange(batch * RING, dtype=np.int32).reshape(batch, RING)
    return jnp.asarray(wbt), jnp.asarray(cbt)


# ---- timing ----------------------------------------------------------------------------------------
TIMING = "host wall-clock per call: median of 7 batches of back-to-back calls, each ended by block_until_ready"


def _median_seconds(fn, args, reps=7, min_time=0.05):
    """Host wall-clock seconds per call (not device time): the median over `reps` batches of the
    mean time of n back-to-back calls, each batch ended by `jax.block_until_ready`."""
    jax.block_until_ready(fn(*args))
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        if time.perf_counter() - t0 >= min_time or n >= 256:
            break
        n *= 2
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times))


def _compile(fn, args):
    return jax.jit(fn).lower(*args).compile()


# ---- grid points -----------------------------------------------------------------------------------
def point_decode(batch, context, seed=0, far=None):
    key = jax.random.PRNGKey(seed)
    wbt, cbt, cblocks = _tables(batch, context)
    wblocks = batch * RING
    if far:
        wblocks, cblocks, _ = FAR_POOLS[far]
        wbt, cbt = _far_tables(batch, context, wblocks, cblocks)
    wpool = _fp8_pool(key, wblocks, BLOCK)
    cpool = _fp8_pool(jax.random.fold_in(key, 1), cblocks, BLOCK // CSA)
    q = jax.random.normal(jax.random.fold_in(key, 2), (batch, HEADS, HEAD_DIM), jnp.bfloat16)
    sinks = jax.random.normal(jax.random.fold_in(key, 3), (HEADS,), jnp.float32)
    lens = jnp.full((batch,), context, jnp.int32)
    idx = jax.random.randint(jax.random.fold_in(key, 4), (batch, TOPK), 0, context // CSA, jnp.int32)
    args = (q, wpool, wbt, lens, sinks, cpool, cbt, idx)
    kern = functools.partial(sparse_decode, window=WINDOW, ratio=CSA)
    ref = functools.partial(sparse_decode_reference, window=WINDOW, ratio=CSA)
    keys = WINDOW + TOPK
    flops = 4.0 * batch * HEADS * HEAD_DIM * keys
    nbytes = batch * (keys * ROW_BYTES + HEADS * HEAD_DIM * (2 + 4))
    tol = 2.0**-8 * max(_kmax(wpool), _kmax(cpool))
    return kern, ref, args, flops, nbytes, ("attention", tol)


def point_prefill(context, tokens=2048, seed=1):
    key = jax.random.PRNGKey(seed)
    wbt, cbt, cblocks = _tables(1, MAX_CONTEXT)
    wpool = _fp8_pool(key, RING + MAX_CONTEXT // BLOCK, BLOCK)  # window rows of the chunk in the pool
    wbt = jnp.arange(MAX_CONTEXT // BLOCK, dtype=jnp.int32)[None]  # a full table (no ring) for the chunk
    cpool = _fp8_pool(jax.random.fold_in(key, 1), cblocks, BLOCK // CSA)
    q = jax.random.normal(jax.random.fold_in(key, 2), (1, tokens, HEADS, HEAD_DIM), jnp.bfloat16)
    sinks = jax.random.normal(jax.random.fold_in(key, 3), (HEADS,), jnp.float32)
    start = jnp.array([context - tokens], jnp.int32)
    lens = jnp.array([tokens], jnp.int32)
    idx = jax.random.randint(jax.random.fold_in(key, 4), (1, tokens, TOPK), 0, (context - tokens) // CSA, jnp.int32)
    args = (q, wpool, wbt, start, lens, sinks, cpool, cbt, idx)
    kern = functools.partial(sparse_prefill, window=WINDOW, ratio=CSA)
    ref = functools.partial(sparse_prefill_reference, window=WINDOW, ratio=CSA)
    keys = WINDOW + TOPK
    flops = 4.0 * tokens * HEADS * HEAD_DIM * keys
    nbytes = tokens * (keys * ROW_BYTES + HEADS * HEAD_DIM * (2 + 4))
    tol = 2.0**-8 * max(_kmax(wpool), _kmax(cpool))
    return kern, ref, args, flops, nbytes, ("attention", tol)


def point_indexer(batch, tokens, context, seed=2, far=None):
    key = jax.random.PRNGKey(seed)
    _, cbt, cblocks = _tables(batch, context)
    if far:
        cblocks = FAR_POOLS[far][2]
        _, cbt = _far_tables(batch, context, RING, cblocks)
    pool = _indexer_pool(key, cblocks, BLOCK // CSA)
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, tokens, INDEX_HEADS, INDEX_DIM), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 2), (batch, tokens, INDEX_HEADS), jnp.float32) * 0.01
    start = jnp.full((batch,), context - tokens, jnp.int32)
    lens = jnp.full((batch,), tokens, jnp.int32)
    args = (q, w, pool, cbt, start, lens)
    kern = functools.partial(indexer_topk, topk=TOPK, ratio=CSA)
    ref = functools.partial(indexer_topk_reference, topk=TOPK, ratio=CSA)
    entries = batch * tokens * (context // CSA)  # upper bound (earlier tokens see fewer)
    flops = 2.0 * INDEX_HEADS * INDEX_DIM * entries
    nbytes = batch * (context // CSA) * INDEX_BYTES + batch * tokens * (INDEX_HEADS * INDEX_DIM * 2 + TOPK * 4)
    return kern, ref, args, flops, nbytes, ("indexer", None)


def point_write(tokens, seed=3, far=None):
    key = jax.random.PRNGKey(seed)
    blocks = FAR_POOLS[far][0] if far else 4 * tokens // BLOCK + 8
    pool = tuple(jnp.zeros_like(p) for p in _fp8_pool(key, blocks, BLOCK))
    kv = jax.random.normal(jax.random.fold_in(key, 1), (tokens, HEAD_DIM), jnp.bfloat16)
    room = (4 * tokens // BLOCK + 8) * BLOCK  # the slots written: random ones among the last `room`
    picks = jax.random.permutation(jax.random.fold_in(key, 2), room)[:tokens]
    slots = (blocks * BLOCK - room + picks).astype(jnp.int32)
    args = (pool, kv, slots)
    flops = 0.0
    nbytes = tokens * (HEAD_DIM * 2 + ROW_BYTES)
    return write_kv, write_kv_reference, args, flops, nbytes, ("exact", None)


def grid(which):
    """The points, most telling first (a run cut short by its budget keeps those): the issue's
    target, the pools past 2**31 bytes, one point of each other kernel, then the rest."""
    points = []
    decode = [(64, 32768), (1, 4096), (128, 131072)]
    decode += [(b, c) for b in (1, 64, 128) for c in (4096, 32768, 131072) if (b, c) not in decode]
    if "decode" in which:
        points.append(("sparse_decode csa fp8 B=64 ctx=32K", functools.partial(point_decode, 64, 32768)))
    if "far" in which:
        for far in FAR_POOLS:
            at = f"far end of {far} planes"
            points.append((f"sparse_decode csa fp8 B=4 ctx=32K, {at}",
                           functools.partial(point_decode, 4, 32768, far=far)))
            points.append((f"indexer_topk decode B=4 ctx=32K, {at}",
                           functools.partial(point_indexer, 4, 1, 32768, far=far)))
            points.append((f"kv_write fp8 T=8192, {at}", functools.partial(point_write, 8192, far=far)))
    if "decode" in which:
        for batch, context in decode[1:3]:
            name = f"sparse_decode csa fp8 B={batch} ctx={context // 1024}K"
            points.append((name, functools.partial(point_decode, batch, context)))
    if "prefill" in which:
        points.append(("sparse_prefill csa fp8 S=2048 ctx=32K", functools.partial(point_prefill, 32768)))
        points.append(("indexer_topk prefill S=2048 ctx=32K", functools.partial(point_indexer, 1, 2048, 32768)))
    if "indexer" in which:
        points.append(("indexer_topk decode B=64 ctx=32K", functools.partial(point_indexer, 64, 1, 32768)))
    if "write" in which:
        points.append(("kv_write fp8 T=8192", functools.partial(point_write, 8192)))
    if "decode" in which:
        for batch, context in decode[3:]:
            name = f"sparse_decode csa fp8 B={batch} ctx={context // 1024}K"
            points.append((name, functools.partial(point_decode, batch, context)))
    return points[:16]


# ---- parity -------------------------------------------------------------------------------------
def _parity(kind, tol, got, want, args):
    if kind == "attention":
        err = float(jnp.max(jnp.abs(got - want)))
        return err <= tol and bool(jnp.all(jnp.isfinite(got))), f"max err {err:.2e} (bound {tol:.2e})"
    if kind == "exact":
        def raw(x):  # fp8 compared as bytes (NaN != NaN otherwise)
            return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize == 1 else x

        same = all(bool(jnp.array_equal(raw(a), raw(b))) for a, b in zip(got, want))
        return same, "bit-exact" if same else "bytes differ"
    # indexer: same sets except near-ties at the k-th place
    g, w = np.asarray(got), np.asarray(want)
    rows = g.reshape(-1, g.shape[-1])
    diff = sum(set(a[a >= 0].tolist()) != set(b[b >= 0].tolist()) for a, b in zip(rows, w.reshape(-1, w.shape[-1])))
    return diff <= max(1, rows.shape[0] // 100), f"{diff}/{rows.shape[0]} rows differ (near-ties allowed)"


# ---- main ---------------------------------------------------------------------------------------
HEADER = ("point", "status", "parity", "pallas ms (host)", "xla ms (host)", "speed-up", "TFLOP/s", "GB/s")


class MarkdownTable:
    """The results table, written to `path` (if any) one row at a time: the header when created,
    then each row as soon as it is measured, flushed and fsync'ed, so a kill keeps what was done."""

    def __init__(self, path, title):
        self.path = path
        self.lines = [title, "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        if path:
            with open(path, "w") as f:
                f.write("\n".join(self.lines) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def add(self, line):
        self.lines.append(line)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())

    def text(self):
        return "\n".join(self.lines)


def run(which, budget_s, markdown=None):
    device = jax.devices()[0]
    today = datetime.date.today().isoformat()
    print(f"# kernels benchmark {today} on {device.device_kind} (jax {jax.__version__}); timing: {TIMING}")
    table = MarkdownTable(markdown, (
        f"Kernel benchmark, {today}, {device.device_kind}, jax {jax.__version__}. Times are {TIMING} "
        "(an upper bound on device time, not device-timed); TFLOP/s and GB/s of the Pallas kernel from that time."
    ))
    statuses = []
    start = time.perf_counter()
    for name, make in grid(which):
        if time.perf_counter() - start > budget_s:
            row = (name, "skipped", f"time budget ({budget_s:.0f} s) spent", "", "", "", "", "")
        else:
            try:
                kern, ref, args, flops, nbytes, (kind, tol) = make()
                ck = _compile(kern, args)
                cr = _compile(ref, args)
                ok, detail = _parity(kind, tol, ck(*args), cr(*args), args)
                tk = _median_seconds(ck, args)
                tr = _median_seconds(cr, args)
                row = (
                    name, "ok" if ok else "PARITY FAIL", detail, f"{tk * 1e3:.3f}", f"{tr * 1e3:.3f}",
                    f"{tr / tk:.2f}x", f"{flops / tk / 1e12:.1f}" if flops else "-", f"{nbytes / tk / 1e9:.0f}",
                )
            except Exception as exc:  # keep going: every point gets a row whatever fails
                traceback.print_exc(limit=3)
                row = (name, "ERROR", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}", "", "", "", "", "")
        statuses.append(row[1])
        table.add("| " + " | ".join(r.replace("|", "/") for r in row) + " |")
        print(" | ".join(row), flush=True)
    counts = {st: statuses.count(st) for st in dict.fromkeys(statuses)}
    table.add("")
    table.add(f"Finished all {len(statuses)} points in {time.perf_counter() - start:.0f} s: "
              + ", ".join(f"{n} {st}" for st, n in counts.items()) + ".")
    return table.text(), all(st in ("ok", "skipped") for st in statuses)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="decode,far,prefill,indexer,write")
    parser.add_argument("--markdown", help="also write the table to this file, one row as soon as it is measured")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no point after this many seconds")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"no GPU: JAX's default backend is {jax.default_backend()!r}; nothing measured")
        return 2
    table, ok = run(set(args.points.split(",")), args.budget_s, args.markdown)
    print()
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
