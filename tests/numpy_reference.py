"""An independent float64 numpy reference for the DeepSeek-V4 MTP block.

Written from the text of shared/docs/dsv4_architecture.md (sections 2-6 and 11), not from the
JAX model: a sliding-window-only decoder block (compress ratio 0, RoPE base `rope_theta`, no
YaRN) with mHC, top-k MoE, and the MTP wrapper of section 6. It reads DeepSeek's own tensor
names (`embed.weight`, `head.weight`, `mtp.0.attn.wq_a.weight`, `mtp.0.ffn.experts.3.w1.weight`,
...) from unquantized safetensors files and the config.json dict.

Only what the MTP parity test needs is implemented; no KV cache, no compressor, no indexer,
no hash routing, no quantization.

`mutations` (a set of strings) switches on deliberate departures from the spec, so the test can
show that the comparison catches them:
  "untransposed_comb": hc_post uses X'_k = sum_j C[k, j] X_j instead of C[j, k]
  "no_enorm":          e = embed(next_ids) without enorm
  "no_sinks":          softmax without the sink logit
  "neox_rope":         rotate-half RoPE instead of interleaved pairs
  "bias_in_weights":   the router bias also enters the expert weights
  "no_inverse_rope":   the attention output is not rotated back
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (lets safetensors' numpy reader return bfloat16 arrays)
import numpy as np

F64 = np.float64


# ------------------------------------------------------------------------------------------
# Checkpoint reading (own reader: safetensors' numpy API over every shard)
# ------------------------------------------------------------------------------------------
def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def read_tensors(path: str | Path, wanted) -> dict[str, np.ndarray]:
    """{name: float64 array} for every tensor whose name satisfies `wanted(name)`."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    for file in files:
        with safe_open(str(file), "numpy") as f:
            for name in f.keys():
                if wanted(name):
                    value = f.get_tensor(name)
                    if value.dtype.kind in "iu":
                        out[name] = value.astype(np.int64)
                    else:  # bf16 / f32 -> f64 is exact
                        out[name] = value.astype(np.float32).astype(F64)
    return out


def read_mtp_weights(path: str | Path, depth: int = 0) -> dict[str, np.ndarray]:
    prefix = f"mtp.{depth}."
    return read_tensors(path, lambda n: n.startswith(prefix) or n in ("embed.weight", "head.weight"))


# ------------------------------------------------------------------------------------------
# Small pieces (spec 2, 3.3, 4)
# ------------------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """y = w * x / sqrt(mean(x^2) + eps) over the last axis (no weight: w = 1)."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def rope(x: np.ndarray, positions: np.ndarray, rope_dim: int, base: float, *, inverse: bool = False,
         neox: bool = False) -> np.ndarray:
    """Rotate the trailing `rope_dim` dims of x (..., S, [heads,] dim) at `positions` [S].

    Spec 3.3: pairs (x[2i], x[2i+1]) of the slice form complex numbers multiplied by
    exp(i * pos * f_i), f_i = base^(-2i/rope_dim); `inverse` uses the conjugate. The `neox`
    variant (a mutation) pairs x[i] with x[i + rope_dim/2] instead.
    """
    half = rope_dim // 2
    freqs = base ** (-(2.0 * np.arange(half, dtype=F64)) / rope_dim)  # [half]
    angle = positions.astype(F64)[:, None] * freqs[None, :]  # [S, half]
    rot = np.exp((-1j if inverse else 1j) * angle)  # [S, half]
    rest, tail = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim :]
    if x.ndim == 4:  # [B, S, H, d]: the same angle for every head
        rot = rot[:, None, :]
    if neox:
        z = tail[..., :half] + 1j * tail[..., half:]
        z = z * rot
        tail = np.concatenate([z.real, z.imag], axis=-1)
    else:
        z = tail[..., 0::2] + 1j * tail[..., 1::2]
        z = z * rot
        tail = np.stack([z.real, z.imag], axis=-1).reshape(tail.shape)
    return np.concatenate([rest, tail], axis=-1)


def hc_mixing(X: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, n: int,
              norm_eps: float, hc_eps: float, iters: int):
    """Spec 4.2 steps 1-3: (pre [B,S,n], post [B,S,n], comb [B,S,n,n]) for streams X [B,S,n,D]."""
    B, S = X.shape[:2]
    flat = X.reshape(B, S, -1)
    rho = 1.0 / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    m = rho * (flat @ fn.T)  # [B, S, (2+n)n]
    pre = sigmoid(scale[0] * m[..., :n] + base[:n]) + hc_eps
    post = 2.0 * sigmoid(scale[1] * m[..., n : 2 * n] + base[n : 2 * n])
    M = (scale[2] * m[..., 2 * n :] + base[2 * n :]).reshape(B, S, n, n)  # M[j, k] row-major
    M = M - M.max(axis=-1, keepdims=True)
    C = np.exp(M)
    C = C / C.sum(axis=-1, keepdims=True) + hc_eps  # softmax over k, + eps
    C = C / (C.sum(axis=-2, keepdims=True) + hc_eps)  # column normalisation first
    for _ in range(iters - 1):
        C = C / (C.sum(axis=-1, keepdims=True) + hc_eps)  # rows
        C = C / (C.sum(axis=-2, keepdims=True) + hc_eps)  # columns
    return pre, post, C


def hc_post(F: np.ndarray, X: np.ndarray, post: np.ndarray, C: np.ndarray, untransposed: bool = False):
    """Spec 4.3: X'_k = post_k F + sum_j C[j, k] X_j."""
    if untransposed:
        mixed = np.einsum("bskj,bsjd->bskd", C, X)
    else:
        mixed = np.einsum("bsjk,bsjd->bskd", C, X)
    return post[..., None] * F[:, :, None, :] + mixed


def hc_head(X: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, norm_eps: float, hc_eps: float):
    """Spec 4.4: h = sum_i (sigmoid(scale * m_i + base_i) + hc_eps) X_i."""
    B, S = X.shape[:2]
    flat = X.reshape(B, S, -1)
    rho = 1.0 / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    m = rho * (flat @ fn.T)
    pre = sigmoid(scale[0] * m + base) + hc_eps
    return np.einsum("bsi,bsid->bsd", pre, X)


# ------------------------------------------------------------------------------------------
# Attention (spec 3.1-3.5, sliding window only)
# ------------------------------------------------------------------------------------------
def attention(x: np.ndarray, w: dict, p: str, cfg: dict, mutations: frozenset) -> np.ndarray:
    B, S, _ = x.shape
    H, d, rd = cfg["num_attention_heads"], cfg["head_dim"], cfg["qk_rope_head_dim"]
    eps, W = cfg["rms_norm_eps"], cfg["sliding_window"]
    base = float(cfg["rope_theta"])
    neox = "neox_rope" in mutations
    pos = np.arange(S)

    c = rms_norm(x @ w[p + "attn.wq_a.weight"].T, w[p + "attn.q_norm.weight"], eps)
    q = (c @ w[p + "attn.wq_b.weight"].T).reshape(B, S, H, d)
    q = rms_norm(q, None, eps)  # weightless per-head RMSNorm
    q = rope(q, pos, rd, base, neox=neox)

    kv = rms_norm(x @ w[p + "attn.wkv.weight"].T, w[p + "attn.kv_norm.weight"], eps)  # [B, S, d]
    kv = rope(kv, pos, rd, base, neox=neox)

    logits = np.einsum("bthd,bud->bhtu", q, kv) * d**-0.5  # [B, H, S(query), S(key)]
    t, u = pos[:, None], pos[None, :]
    visible = (u <= t) & (u >= t - (W - 1))  # window of W tokens including itself
    logits = np.where(visible[None, None], logits, -np.inf)
    sink = w[p + "attn.attn_sink"]  # [H]
    if "no_sinks" in mutations:
        top = logits.max(axis=-1, keepdims=True)
        e = np.exp(logits - top)
        denom = e.sum(axis=-1, keepdims=True)
    else:
        top = np.maximum(logits.max(axis=-1, keepdims=True), sink[None, :, None, None])
        e = np.exp(logits - top)
        denom = e.sum(axis=-1, keepdims=True) + np.exp(sink[None, :, None, None] - top)
    probs = e / denom
    o = np.einsum("bhtu,bud->bthd", probs, kv)  # value = key vector
    if "no_inverse_rope" not in mutations:
        o = rope(o, pos, rd, base, inverse=True, neox=neox)

    G = cfg["o_groups"]
    R = cfg["o_lora_rank"]
    per = H // G
    Og = o.reshape(B, S, G, per * d)  # groups of consecutive heads
    woa = w[p + "attn.wo_a.weight"].reshape(G, R, per * d)
    z = np.einsum("bsgk,grk->bsgr", Og, woa).reshape(B, S, G * R)
    return z @ w[p + "attn.wo_b.weight"].T


# ------------------------------------------------------------------------------------------
# MoE (spec 5, top-k routed with bias)
# ------------------------------------------------------------------------------------------
def swiglu(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, limit: float,
           weight: np.ndarray | float = 1.0) -> np.ndarray:
    g = x @ w1.T
    u = x @ w3.T
    if limit > 0:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    h = silu(g) * u
    h = h * weight
    return h @ w2.T


def moe(x: np.ndarray, w: dict, p: str, cfg: dict, mutations: frozenset, stats: dict | None = None) -> np.ndarray:
    """x [B, S, D] (ffn_norm output) -> [B, S, D]."""
    B, S, D = x.shape
    k, E = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    limit = float(cfg.get("swiglu_limit") or 0.0)
    flat = x.reshape(-1, D)
    scores = np.sqrt(softplus(flat @ w[p + "ffn.gate.weight"].T))  # [T, E]
    bias = w[p + "ffn.gate.bias"]
    biased = scores + bias
    order = np.argsort(-biased, axis=-1)
    chosen = order[:, :k]  # [T, k]
    if stats is not None:  # how close the selection is to flipping
        sorted_b = np.take_along_axis(biased, order, axis=-1)
        margin = float(np.min(sorted_b[:, k - 1] - sorted_b[:, k])) if k < E else np.inf
        stats["min_selection_margin"] = min(margin, stats.get("min_selection_margin", np.inf))
    source = biased if "bias_in_weights" in mutations else scores
    sel = np.take_along_axis(source, chosen, axis=-1)
    weights = sel / sel.sum(axis=-1, keepdims=True) * cfg["routed_scaling_factor"]  # [T, k]

    out = np.zeros_like(flat)
    for e in range(E):
        rows, slot = np.nonzero(chosen == e)
        if rows.size == 0:
            continue
        ep = f"{p}ffn.experts.{e}."
        out[rows] += swiglu(flat[rows], w[ep + "w1.weight"], w[ep + "w2.weight"], w[ep + "w3.weight"], limit,
                            weights[rows, slot][:, None])
    if cfg.get("n_shared_experts", 0) > 0:
        sp = f"{p}ffn.shared_experts."
        out += swiglu(flat, w[sp + "w1.weight"], w[sp + "w2.weight"], w[sp + "w3.weight"], limit)
    return out.reshape(B, S, D)


# ------------------------------------------------------------------------------------------
# Block and MTP (spec 4.3 "Block", spec 6)
# ------------------------------------------------------------------------------------------
def block(X: np.ndarray, w: dict, p: str, cfg: dict, mutations: frozenset = frozenset(),
          stats: dict | None = None) -> np.ndarray:
    n, eps, hc_eps, iters = cfg["hc_mult"], cfg["rms_norm_eps"], cfg["hc_eps"], cfg["hc_sinkhorn_iters"]
    untransposed = "untransposed_comb" in mutations

    pre, post, C = hc_mixing(X, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"],
                             n, eps, hc_eps, iters)
    y = np.einsum("bsi,bsid->bsd", pre, X)
    F = attention(rms_norm(y, w[p + "attn_norm.weight"], eps), w, p, cfg, mutations)
    X = hc_post(F, X, post, C, untransposed)

    pre, post, C = hc_mixing(X, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"],
                             n, eps, hc_eps, iters)
    y = np.einsum("bsi,bsid->bsd", pre, X)
    F = moe(rms_norm(y, w[p + "ffn_norm.weight"], eps), w, p, cfg, mutations, stats)
    return hc_post(F, X, post, C, untransposed)


def mtp_logits(streams: np.ndarray, next_ids: np.ndarray, w: dict, cfg: dict, depth: int = 0,
               mutations=frozenset(), stats: dict | None = None) -> np.ndarray:
    """streams [B, S, n, D] (main model, pre-hc_head), next_ids [B, S] -> logits [B, S, vocab]."""
    mutations = frozenset(mutations)
    p = f"mtp.{depth}."
    eps = cfg["rms_norm_eps"]
    X = np.asarray(streams, dtype=F64)
    e = w["embed.weight"][np.asarray(next_ids)]  # [B, S, D]
    if "no_enorm" not in mutations:
        e = rms_norm(e, w[p + "enorm.weight"], eps)
    X = rms_norm(X, w[p + "hnorm.weight"], eps)  # per stream
    X = X @ w[p + "h_proj.weight"].T + (e @ w[p + "e_proj.weight"].T)[:, :, None, :]
    X = block(X, w, p, cfg, mutations, stats)
    h = hc_head(X, w[p + "hc_head_fn"], w[p + "hc_head_base"], w[p + "hc_head_scale"], eps, cfg["hc_eps"])
    h = rms_norm(h, w[p + "norm.weight"], eps)
    return h @ w["head.weight"].T
