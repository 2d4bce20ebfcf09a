"""KV compressors (spec 3.6).

A compressor pools every `ratio` tokens into one entry with a per-channel softmax gate. On
CSA layers the windows overlap: each token projects to 2x the width, the first half feeding
the next window's entry and the second half its own, so entry j pools 2 * ratio rows.

One mechanism serves the whole-sequence forward and the cached steps: `pool_windows` advances a
compressor over a chunk of tokens from the rows it kept (spec 3.6's kv_state / score_state).
The whole sequence is the chunk at position 0 with nothing kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.model.layers import Linear, RMSNorm
from dsv4_jax.model.rope import apply_rope, rope_angles
from dsv4_jax.kv_cache.pytrees import pytree_dataclass
from dsv4_jax.model.axes import COMPRESS, EMBED


@pytree_dataclass
class CompressorRows:
    """What a compressor keeps between chunks, per sequence, in timeline order: the token rows of
    its last K windows, `[batch, K * ratio, c * head_dim]` fp32, the current window last. K >= c,
    where c = 2 with overlap (a CSA entry pools the previous window too) and 1 without; the cache
    keeps K = c windows, or one more when it serves speculative decoding (a rejected draft may
    take a sequence back into the window before). Row (K - 1) * r + t % r holds token t of the
    current window (as the official kv_state). Rows the current window has not filled yet hold kv
    0 and score -inf after a chunk, or whatever the cache held there after a decode step or a
    rejected draft: either way nothing pools them before the window's own token overwrites them.
    Windows before a sequence's window 0 count as empty whatever they hold
    (`without_windows_before_0`, in both paths)."""

    kv: jax.Array
    score: jax.Array

    @classmethod
    def empty(cls, batch: int, ratio: int, head_dim: int, overlap: bool, windows: int | None = None
              ) -> "CompressorRows":
        c = 2 if overlap else 1
        shape = (batch, (windows or c) * ratio, c * head_dim)
        return cls(jnp.zeros(shape, jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32))

    def without_windows_before_0(self, start: jax.Array, ratio: int) -> "CompressorRows":
        """These rows (the window of `start` [batch] last) with the windows before the sequence's
        window 0 empty, whatever its slot held there (a decode step writes its own row only)."""
        windows = self.kv.shape[1] // ratio
        first = (start // ratio)[:, None] - (windows - 1)  # the window of row 0
        empty = (first + jnp.arange(self.kv.shape[1])[None, :] // ratio < 0)[..., None]
        return CompressorRows(jnp.where(empty, 0.0, self.kv), jnp.where(empty, -jnp.inf, self.score))


@pytree_dataclass
class PooledWindows:
    """The windows a chunk completes: pooled rows (before norm and RoPE) and their entry ids."""

    pooled: jax.Array  # [batch, E, head_dim] float32, zeros where not valid
    entry_ids: jax.Array  # [batch, E] int32: entry j pools positions [j * ratio, (j + 1) * ratio)
    valid: jax.Array  # [batch, E] bool: the window completed inside this chunk


def overlapping_windows(
    kv: jax.Array,  # [batch, windows, ratio, 2 * head_dim] each token's 2x-wide projection
    score: jax.Array,  # [batch, windows, ratio, 2 * head_dim] gate logits (ape added)
    head_dim: int,
) -> tuple[jax.Array, jax.Array]:  # each [batch, windows - 1, 2 * ratio, head_dim]
    """The rows a CSA entry pools, for windows 1.. of a timeline: window w - 1 through the
    first half of the projection, then window w through the second half."""
    kv = jnp.concatenate([kv[:, :-1, :, :head_dim], kv[:, 1:, :, head_dim:]], axis=2)
    score = jnp.concatenate([score[:, :-1, :, :head_dim], score[:, 1:, :, head_dim:]], axis=2)
    return kv, score


def gated_pool(kv: jax.Array, score: jax.Array, *, axis: int) -> jax.Array:
    """One entry from the rows along `axis`: kv weighted by a per-channel softmax of the scores
    over those rows (fp32), the one pooling rule of every compressor path."""
    return jnp.sum(kv * jax.nn.softmax(score, axis=axis), axis=axis)


def pool_windows(
    kv_rows: jax.Array,  # [batch, S, c * head_dim] fp32 projections of the chunk's tokens
    score_rows: jax.Array,  # [batch, S, c * head_dim] fp32 gate logits, ape added
    kept: CompressorRows,  # the rows kept before the chunk
    start: jax.Array,  # [batch] int32: position of the chunk's first token
    lens: jax.Array,  # [batch] int32: real tokens of the chunk (0: a padding row)
    *,
    ratio: int,
    overlap: bool,
) -> tuple[PooledWindows, CompressorRows]:
    """Advance a compressor over a chunk: the entries of every window the chunk completes, and
    the rows to keep for the next chunk (as many windows as `kept` holds).

    The kept rows and the chunk are laid on one timeline of whole windows that starts at the
    first kept window, so an entry is computed exactly as on the full sequence however the
    sequence was cut into chunks (window 0 of a sequence sees empty predecessor rows). A chunk of
    S tokens completes at most E = ceil(S / ratio) windows; candidate e is entry start // r + e.
    """
    r = ratio
    batch, seq, width = kv_rows.shape
    kept_windows = kept.kv.shape[1] // r
    n_out = -(-seq // r)
    length = (kept_windows + n_out) * r  # the kept windows, then room for the chunk at any offset
    real = (jnp.arange(seq)[None, :] < lens[:, None])[..., None]
    kv_rows = jnp.where(real, kv_rows, 0.0)
    score_rows = jnp.where(real, score_rows, -jnp.inf)
    at = (kept_windows - 1) * r + start % r  # timeline row i is position (start // r - K + 1) * r + i

    def lay(kept_rows, rows, fill, offset):
        line = jnp.concatenate([kept_rows, jnp.full((length - kept_windows * r, width), fill, jnp.float32)])
        return jax.lax.dynamic_update_slice(line, rows, (offset, 0))

    kv_line = jax.vmap(lambda k, x, o: lay(k, x, 0.0, o))(kept.kv, kv_rows, at)
    score_line = jax.vmap(lambda k, x, o: lay(k, x, -jnp.inf, o))(kept.score, score_rows, at)
    kv_win = kv_line.reshape(batch, kept_windows + n_out, r, width)
    score_win = score_line.reshape(batch, kept_windows + n_out, r, width)
    first = kept_windows - 1  # the timeline window of the chunk's first token: the first candidate
    if overlap:  # pair j pools windows j and j + 1: candidate window w is pair w - 1
        kv_win, score_win = overlapping_windows(kv_win, score_win, width // 2)
        first -= 1
    # Candidates are timeline windows K - 1 ..; the last one can never complete in the chunk.
    kv_win, score_win = kv_win[:, first : first + n_out], score_win[:, first : first + n_out]
    pooled = gated_pool(kv_win, score_win, axis=2)
    entry_ids = (start // r)[:, None] + jnp.arange(n_out, dtype=jnp.int32)[None, :]
    valid = (entry_ids + 1) * r <= (start + lens)[:, None]
    windows = PooledWindows(jnp.where(valid[..., None], pooled, 0.0), entry_ids.astype(jnp.int32), valid)
    done = ((start + lens) // r - start // r) * r  # rows of the windows completed: drop them
    keep = jax.vmap(lambda line, offset: jax.lax.dynamic_slice(line, (offset, 0), (kept_windows * r, width)))
    return windows, CompressorRows(keep(kv_line, done), keep(score_line, done))


def pool_current_window(
    kv_rows: jax.Array,  # [batch, K * ratio, c * head_dim] fp32: each sequence's rows, its window last
    score_rows: jax.Array,  # [batch, K * ratio, c * head_dim] fp32 gate logits (ape added)
    position: jax.Array,  # [batch] int32: the decode token just written into its row
    real: jax.Array,  # [batch] bool: a real row (not padding)
    *,
    ratio: int,
    overlap: bool = False,
) -> PooledWindows:  # E = 1
    """A decode step of a compressor: the window its token completes, if any.

    The rows are in timeline order (`CompressorRows`) with the token's own row written. A decode
    step writes only its own row, so rows the window has not reached yet hold an earlier window's
    tokens (or whatever a fresh slot held); the window is pooled only once all its rows are its
    own, when position % ratio == ratio - 1, which `pool_windows` would compute from the same
    rows. With overlap the previous window's rows come before it; window 0 has none, whatever its
    slot's rows hold."""
    c = 2 if overlap else 1
    kv_rows, score_rows = kv_rows[:, -c * ratio :], score_rows[:, -c * ratio :]
    if overlap:
        rows = CompressorRows(kv_rows, score_rows).without_windows_before_0(position, ratio)
        batch, _, width = kv_rows.shape
        kv, score = (a.reshape(batch, 2, ratio, width) for a in (rows.kv, rows.score))  # previous, current
        kv_rows, score_rows = (w[:, 0] for w in overlapping_windows(kv, score, width // 2))
    pooled = gated_pool(kv_rows, score_rows, axis=1)[:, None]
    valid = (((position + 1) % ratio == 0) & real)[:, None]
    entry_ids = (position // ratio)[:, None].astype(jnp.int32)
    return PooledWindows(jnp.where(valid[..., None], pooled, 0.0), entry_ids, valid)


class Compressor(nnx.Module):
    def __init__(self, config: DeepseekV4Config, ratio: int, head_dim: int, overlap: bool):
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = Linear(config.hidden_size, width, config, quantized=False, axes=(COMPRESS, EMBED))
        self.wgate = Linear(config.hidden_size, width, config, quantized=False, axes=(COMPRESS, EMBED))
        self.ape = nnx.Param(jnp.zeros((ratio, width), jnp.float32), axes=(COMPRESS, COMPRESS))
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)

    def project(
        self,
        x: jax.Array,  # [batch, S, hidden]
        positions: jax.Array,  # [batch or 1, S] int32 absolute positions
    ) -> tuple[jax.Array, jax.Array]:  # kv, score rows, each [batch, S, c * head_dim] fp32
        # The official compressor runs in fp32; `float32` reads bf16 weights as stored.
        kv = self.wkv.float32(x)
        score = self.wgate.float32(x) + self.ape[...].astype(jnp.float32)[positions % self.ratio]
        return kv, score

    def finish(
        self,
        pooled: jax.Array,  # [batch, E, head_dim] fp32
        cos: jax.Array,  # [..., E, rope/2] angles of the entries' positions (entry j: j * ratio)
        sin: jax.Array,
        dtype: jnp.dtype,
    ) -> jax.Array:  # [batch, E, head_dim] entries, normalised and rotated, in `dtype`
        return apply_rope(self.norm(pooled.astype(dtype)), cos, sin)

    def __call__(
        self,
        x: jax.Array,  # [batch, seq, hidden]
        cos: jax.Array,  # [seq, rope/2] angles of token positions (entry j uses position j * ratio)
        sin: jax.Array,
    ) -> jax.Array:  # [batch, seq // ratio, head_dim]
        """Entries of all complete windows of a whole sequence, in x.dtype."""
        batch, seq, _ = x.shape
        r, n = self.ratio, seq // self.ratio
        if n == 0:
            return jnp.zeros((batch, 0, self.head_dim), x.dtype)
        kv, score = self.project(x, jnp.arange(seq)[None, :])
        nothing = CompressorRows.empty(batch, r, self.head_dim, self.overlap)
        start, lens = jnp.zeros((batch,), jnp.int32), jnp.full((batch,), seq, jnp.int32)
        windows, _ = pool_windows(kv, score, nothing, start, lens, ratio=r, overlap=self.overlap)
        return self.finish(windows.pooled[:, :n], cos[: n * r : r], sin[: n * r : r], x.dtype)

    def step(
        self,
        x: jax.Array,  # [batch, S, hidden] a chunk of each sequence
        positions: jax.Array,  # [batch, S] int32
        lens: jax.Array,  # [batch] int32 real tokens per row
        inv_freq: jax.Array,  # [rope/2] this layer's RoPE frequencies
        kept: CompressorRows,
    ) -> tuple[jax.Array, PooledWindows, CompressorRows]:  # entries [batch, E, head_dim] in x.dtype
        """The entries the chunk completes, rotated at their own positions j * ratio (which may
        lie in an earlier chunk), and the rows to keep."""
        kv, score = self.project(x, positions)
        windows, kept = pool_windows(kv, score, kept, positions[:, 0], lens, ratio=self.ratio, overlap=self.overlap)
        return self.entries(windows, inv_freq, x.dtype), windows, kept

    def entries(self, windows: PooledWindows, inv_freq: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """The pooled windows as cache entries [batch, E, head_dim] in `dtype`, rotated at their
        own positions j * ratio (which may lie in an earlier chunk)."""
        cos, sin = rope_angles(windows.entry_ids * self.ratio, inv_freq)
        return self.finish(windows.pooled, cos, sin, dtype)
