"""Which model shapes the Pallas kernels can tile: the one check the KV resolver makes at start-up.

The `xla` backend (the pure-JAX references) runs every shape the model accepts. The Pallas
Triton kernels have tiling limits, and their wrappers refuse a shape they cannot tile when they
are first traced, deep inside the engine's warm-up. `shape_problems` says ahead of time, from the
model's dimensions alone, what the kernels of one backend would refuse on one device kind, each
problem naming the config field and the constraint, so that the resolver
(dsv4_jax/kv_cache/resolver.py) can fall back to `xla` (`auto`) or refuse an explicit Pallas
backend before anything is loaded. The rules are the wrappers' own predicates, not copies:

* dim chunks (`paged_attention.chunk_width`): a KV row is read in 64-, 32- or 16-wide column
  chunks (Triton blocks are powers of two, dots at least 16 deep), so bf16 rows need head_dim a
  multiple of 16; fp8_ds_mla needs the NoPE dims in whole 64-wide UE8M0 blocks and the RoPE
  dims a multiple of 16;
* head blocks (`paged_attention.head_block_fits`, `tuning.kernel_config`): the attention kernels
  take block_h query heads per program (per device kind: 32 or 16 on GPUs, 8 or 16 in interpret
  mode); fewer heads than a block are padded with silent heads, more must be a multiple of it;
* the indexer (`indexer_topk.index_head_dim_fits`): keys of a power of two >= 16 dims; on a GPU
  also a power-of-two number of indexer heads (its [heads, d] query tile: JAX's Triton lowering
  refuses tensors whose size is not a power of two; the interpreter on a CPU does not).

tests/test_any_config.py checks that these rules say exactly what the wrappers refuse (traced for
the interpreter) and what lowering to Triton refuses (H100, RTX PRO 6000). Not covered: tensor
parallelism divides the heads over ranks, so the head rule applies to the heads per rank (the
resolver sees the whole model).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import tuning
from pallas_kernels.formats import FP8_DS_MLA_QUANT_BLOCK
from pallas_kernels.indexer_topk import index_head_dim_fits
from pallas_kernels.paged_attention import CHUNK_WIDTHS, head_block_fits

KV_FORMATS = ("fp8_ds_mla", "bf16")  # the KV pool formats the Pallas kernels read
_MIN_CHUNK = CHUNK_WIDTHS[-1]  # 16


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """The model dimensions the kernels tile, named as the config fields are."""

    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    index_n_heads: int | None = None  # None: no CSA layer, so no indexer kernel runs
    index_head_dim: int | None = None

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim


def shape_problems(shapes: ModelShapes, kv_format: str, device_kind: str) -> tuple[str, ...]:
    """Why the Pallas kernels reading `kv_format` pools ("fp8_ds_mla" or "bf16") cannot run a
    model of these shapes on `device_kind` ("cpu": interpret mode); () when they can. Each
    problem is one clause naming the config field, its value and the constraint."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"the Pallas kernels read {' or '.join(KV_FORMATS)} KV pools, got {kv_format!r}")
    gpu = _is_gpu(device_kind)
    return (
        *_width_problems(shapes, kv_format),
        *_head_problems(shapes, device_kind),
        *_indexer_problems(shapes, gpu),
    )


def _is_gpu(device_kind: str) -> bool:
    """Whether the kernels are lowered to Triton on this kind (a CPU runs them interpreted)."""
    return tuning.device_info(device_kind).capability is not None


def _width_problems(shapes: ModelShapes, kv_format: str) -> tuple[str, ...]:
    """The KV rows' column chunks (`paged_attention.dim_chunks`)."""
    out = []
    if kv_format == "bf16":
        if shapes.head_dim % _MIN_CHUNK:
            out.append(
                f"`head_dim` = {shapes.head_dim} must be a multiple of {_MIN_CHUNK} for the pallas_bf16 kernels "
                f"(they read a bf16 KV row in {_widths()} column chunks)"
            )
        return tuple(out)
    if shapes.nope_head_dim % FP8_DS_MLA_QUANT_BLOCK:
        out.append(
            f"`head_dim` - `qk_rope_head_dim` = {shapes.head_dim} - {shapes.qk_rope_head_dim} = "
            f"{shapes.nope_head_dim} NoPE dims must be a multiple of {FP8_DS_MLA_QUANT_BLOCK} for the "
            f"pallas_fp8_ds_mla kernels (one UE8M0 scale per {FP8_DS_MLA_QUANT_BLOCK} NoPE dims)"
        )
    if shapes.qk_rope_head_dim % _MIN_CHUNK:
        out.append(
            f"`qk_rope_head_dim` = {shapes.qk_rope_head_dim} must be a multiple of {_MIN_CHUNK} for the "
            f"pallas_fp8_ds_mla kernels (they read the bf16 RoPE dims in column chunks of at least {_MIN_CHUNK})"
        )
    return tuple(out)


def _widths() -> str:
    """"64-, 32- or 16-wide": the chunk widths as a phrase."""
    *wide, narrowest = [f"{w}-" for w in CHUNK_WIDTHS]
    return f"{', '.join(wide)} or {narrowest}wide"


def _head_problems(shapes: ModelShapes, device_kind: str) -> tuple[str, ...]:
    """The attention kernels' head blocks on this device kind (`paged_attention.pad_heads`)."""
    kernels = ["sparse_decode", "sparse_prefill"] + (["sparse_prefill_csa"] if shapes.index_n_heads else [])
    heads = shapes.num_attention_heads
    refused: dict[int, list[str]] = {}  # head block -> the kernels with that block
    for kernel in kernels:
        block_h = tuning.kernel_config(kernel, device_kind).block_h
        if not head_block_fits(heads, block_h):
            refused.setdefault(block_h, []).append(kernel)
    kind = tuning.canonical_device_kind(device_kind)
    return tuple(
        f"`num_attention_heads` = {heads} must be a multiple of {block_h}, or fewer than {block_h}: the query "
        f"heads per program of {', '.join(names)} on {kind}"
        for block_h, names in sorted(refused.items())
    )


def _indexer_problems(shapes: ModelShapes, gpu: bool) -> tuple[str, ...]:
    """The lightning indexer's kernel (CSA layers only)."""
    if shapes.index_head_dim is None or shapes.index_n_heads is None:
        return ()
    out = []
    if not index_head_dim_fits(shapes.index_head_dim):
        out.append(
            f"`index_head_dim` = {shapes.index_head_dim} must be a power of two >= 16 for the indexer_topk kernel"
        )
    heads = shapes.index_n_heads
    if gpu and heads & (heads - 1):
        out.append(
            f"`index_n_heads` = {heads} must be a power of two for the indexer_topk kernel on a GPU "
            "(Triton tensors hold a power-of-two number of elements)"
        )
    return tuple(out)


__all__ = ["KV_FORMATS", "ModelShapes", "shape_problems"]
