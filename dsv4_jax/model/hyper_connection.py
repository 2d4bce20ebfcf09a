"""Manifold-constrained hyper-connections (mHC, spec 4): `hc_mult` residual streams per token.

Parameters are fp32 and live on the owning block (`hc_attn_*`, `hc_ffn_*`) or the model
(`hc_head_*`) under DeepSeek's names; these functions hold the math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.model.layers import rms_normalize


def _mix_logits(streams: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """rho * (fn @ flatten(streams)) in fp32. streams [b, s, n, d] -> [b, s, fn_rows]"""
    flat = streams.reshape(*streams.shape[:-2], -1)
    return jnp.einsum("bsk,mk->bsm", rms_normalize(flat, eps), fn.astype(jnp.float32))


def hc_pre(
    streams: jax.Array,  # [batch, seq, n, hidden]
    fn: jax.Array,  # [(2 + n) * n, n * hidden]
    base: jax.Array,  # [(2 + n) * n]
    scale: jax.Array,  # [3]
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (sub-layer input [b, s, hidden], post [b, s, n], comb [b, s, n, n])."""
    n = streams.shape[-2]
    m = _mix_logits(streams, fn, norm_eps)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = m[..., 2 * n :].reshape(*m.shape[:-1], n, n) * scale[2] + base[2 * n :].reshape(n, n)
    comb = jax.nn.softmax(comb_logits, axis=-1) + hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)  # columns first

    def row_then_column(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    comb = jax.lax.fori_loop(0, sinkhorn_iters - 1, row_then_column, comb)
    collapsed = jnp.einsum("bsn,bsnd->bsd", pre, streams.astype(jnp.float32)).astype(streams.dtype)
    return collapsed, post, comb


def hc_post(
    output: jax.Array,  # [batch, seq, hidden] sub-layer output
    streams: jax.Array,  # [batch, seq, n, hidden] the sub-layer's input streams
    post: jax.Array,  # [batch, seq, n]
    comb: jax.Array,  # [batch, seq, n, n]
) -> jax.Array:
    """X'_k = post_k * F + sum_j comb[j, k] * X_j (note the transpose). -> [b, s, n, hidden]"""
    mixed = jnp.einsum("bsjk,bsjd->bskd", comb.astype(jnp.float32), streams.astype(jnp.float32))  # mHC math in fp32
    out = post.astype(jnp.float32)[..., None] * output.astype(jnp.float32)[..., None, :] + mixed
    return out.astype(streams.dtype)


def hc_head(
    streams: jax.Array,  # [batch, seq, n, hidden]
    fn: jax.Array,  # [n, n * hidden]
    base: jax.Array,  # [n]
    scale: jax.Array,  # [1]
    *,
    norm_eps: float,
    hc_eps: float,
) -> jax.Array:
    """Collapse the streams with sigmoid weights (no Sinkhorn, no post). -> [b, s, hidden]"""
    m = _mix_logits(streams, fn, norm_eps)
    pre = jax.nn.sigmoid(m * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + hc_eps
    return jnp.einsum("bsn,bsnd->bsd", pre, streams.astype(jnp.float32)).astype(streams.dtype)
