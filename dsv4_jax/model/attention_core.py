"""The attention every V4 layer type shares (spec 3.4), as the dense reference that defines its
numerics.

Every query head attends to the same keys (MQA: one K=V vector per token): the raw
sliding-window rows, plus compressed rows (all visible ones on HCA layers, the indexer's
top-k on CSA layers), plus a per-head sink logit that has no value. `dense_attention` is what
the whole-sequence forward (`DeepseekV4.__call__`, the model's own reference: parity goldens and
mutation tests) always runs. The serving path (`DeepseekV4.step`) computes the same function over
the paged KV cache through `pallas_kernels.backend.AttentionBackend` (the `xla` references and
the Pallas kernels), whose references are checked against this one
(tests/test_kernels_interpret.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_attention(
    q: jax.Array,  # [batch, seq, heads, head_dim], RoPE applied
    window_kv: jax.Array,  # [batch, seq, head_dim], K = V of every token
    compressed_kv: jax.Array | None,  # [batch, entries, head_dim]
    compressed_idx: jax.Array | None,  # [batch, seq, topk] int32, -1 = skip (CSA); None: HCA
    sinks: jax.Array,  # [heads] float32
    *,
    window: int,
    ratio: int,
) -> jax.Array:  # [batch, seq, heads, head_dim] float32
    """Reference attention for a full sequence at positions 0..seq-1.

    Window keys: u in [t - window + 1, t]. Compressed keys: entry j is visible from token t
    when j < (t + 1) // ratio; with `compressed_idx` (CSA) only the listed visible entries are
    used, and -1 never reads a row. Softmax scale is exactly head_dim^-0.5 (no YaRN mscale).
    """
    batch, seq, heads, dim = q.shape
    scale = dim**-0.5
    qf = q.astype(jnp.float32)
    kv = window_kv.astype(jnp.float32)
    t = jnp.arange(seq)[:, None]
    u = jnp.arange(seq)[None, :]
    window_mask = (u <= t) & (u > t - window)  # [seq, seq]
    logits = jnp.einsum("bshd,bud->bhsu", qf, kv) * scale
    logits = jnp.where(window_mask[None, None], logits, -jnp.inf)
    if compressed_kv is None or compressed_kv.shape[1] == 0:
        return _softmax_with_sink(logits, kv, None, None, sinks)
    ckv = compressed_kv.astype(jnp.float32)
    entries = ckv.shape[1]
    visible = jnp.arange(entries)[None, :] < (jnp.arange(seq)[:, None] + 1) // ratio  # [seq, entries]
    if compressed_idx is None:  # HCA: every visible entry
        c_logits = jnp.einsum("bshd,bjd->bhsj", qf, ckv) * scale
        c_logits = jnp.where(visible[None, None], c_logits, -jnp.inf)
        return _softmax_with_sink(logits, kv, c_logits, ckv, sinks)
    # CSA: each query's own rows; -1 and invisible picks are masked, never read as row 0.
    valid = compressed_idx >= 0
    safe = jnp.where(valid, compressed_idx, 0)
    picked = jnp.take_along_axis(ckv[:, None], safe[..., None], axis=2)  # [batch, seq, topk, dim]
    valid &= jnp.take_along_axis(jnp.broadcast_to(visible[None], (batch, seq, entries)), safe, axis=2)
    c_logits = jnp.einsum("bshd,bskd->bhsk", qf, picked) * scale
    c_logits = jnp.where(valid[:, None], c_logits, -jnp.inf)
    return _softmax_with_sink(logits, kv, c_logits, picked, sinks)


def _softmax_with_sink(
    window_logits: jax.Array,  # [batch, heads, seq, seq]
    window_kv: jax.Array,  # [batch, seq, dim]
    extra_logits: jax.Array | None,  # [batch, heads, seq, n]
    extra_kv: jax.Array | None,  # [batch, n, dim] shared by all queries, or [batch, seq, n, dim] per query
    sinks: jax.Array,  # [heads]
) -> jax.Array:
    """softmax over [window keys, extra keys, sink] (the sink has no value), then P @ V."""
    seq = window_logits.shape[-1]
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    parts = [window_logits] if extra_logits is None else [window_logits, extra_logits]
    all_logits = jnp.concatenate(parts, axis=-1)
    m = jnp.maximum(jnp.max(all_logits, axis=-1, keepdims=True), sink)
    probs = jnp.exp(all_logits - m)
    probs = probs / (jnp.sum(probs, axis=-1, keepdims=True) + jnp.exp(sink - m))
    out = jnp.einsum("bhsu,bud->bshd", probs[..., :seq], window_kv)
    if extra_kv is not None:
        per_query = "bhsk,bskd->bshd" if extra_kv.ndim == 4 else "bhsk,bkd->bshd"
        out = out + jnp.einsum(per_query, probs[..., seq:], extra_kv)
    return out
