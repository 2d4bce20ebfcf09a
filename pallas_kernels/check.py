"""AOT lowering check of the Pallas kernels to Triton IR, without a GPU.

    python -m pallas_kernels.check [--device-kind KIND ...] [--kernel NAME ...]

For each (kernel, device kind) this lowers exactly the wrappers the engine calls, with the
launch parameters of pallas_kernels/tuning.py for that kind, at DeepSeek-V4-Flash shapes (64
heads, head_dim 512 = 448 NoPE + 64 RoPE, top-k 512, window 128, block 256, indexer 64 x 128),
to Triton IR for that device's compute capability, inside an abstract mesh of that device kind
(`jax.export` for platform "cuda"). It prints one line per (kernel, device kind), OK or the
first error, and exits non-zero if any failed.

Lowering is not compiling: this proves that every primitive the kernels use has a Triton
lowering for that compute capability (fp8 casts need >= 8.9, value slices are refused, ...).
Registers, shared memory per block (about 99 KB on SM120 against 227 KB on H100/H200/B200),
spills and speed are only checked by the GPU compiler and by running on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import indexer_topk, kv_write, sparse_decode, sparse_prefill

DEFAULT_DEVICE_KINDS = ("NVIDIA H100", "NVIDIA H200", "NVIDIA B200", "NVIDIA RTX PRO 6000")
CHECK_KERNELS = ("kv_write", "sparse_decode", "sparse_prefill", "indexer_topk")
DISCLAIMER = (
    "Lowering to Triton IR only: NOT compiled, NOT run on a GPU (register and shared-memory "
    "limits, correctness and speed on the device are not checked here)."
)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shapes the check lowers at: DeepSeek-V4-Flash, one data-parallel rank."""

    heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    topk: int = 512
    window: int = 128
    block_size: int = 256
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    csa_layers: int = 21
    hca_layers: int = 20
    sliding_layers: int = 43
    max_model_len: int = 1 << 20
    num_seq_slots: int = 64
    decode_batch: int = 64
    prefill_batch: int = 2
    prefill_tokens: int = 2048
    write_tokens: int = 4096

    @property
    def ring(self) -> int:
        return -(-self.window // self.block_size) + 1

    @property
    def max_blocks(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def compressed_blocks(self) -> int:
        return self.num_seq_slots * (self.max_blocks + 1)


FLASH = Shapes()
_S = jax.ShapeDtypeStruct


def _kv_pool(fmt: str, layers: int, blocks: int, units: int, sh: Shapes) -> tuple:
    lead = (layers, blocks, units)
    if fmt == "fp8_ds_mla":
        nope = sh.head_dim - sh.rope_dim
        return (
            _S((*lead, nope), jnp.float8_e4m3fn),
            _S((*lead, sh.rope_dim), jnp.bfloat16),
            _S((*lead, 8), jnp.uint8),
        )
    return (_S((*lead, sh.head_dim), jnp.bfloat16),)


def _indexer_pool(fmt: str, sh: Shapes) -> tuple:
    lead = (sh.csa_layers, sh.compressed_blocks, sh.block_size // sh.csa_ratio)
    if fmt == "fp8":
        return (_S((*lead, sh.index_head_dim), jnp.float8_e4m3fn), _S(lead, jnp.float32))
    return (_S((*lead, sh.index_head_dim), jnp.bfloat16),)


def cases(kernel: str, device_kind: str, sh: Shapes = FLASH) -> list[tuple[str, Callable[..., Any], tuple]]:
    """(variant, function, abstract arguments) for every variant of `kernel` the engine launches."""
    i32, f32, bf16 = jnp.int32, jnp.float32, jnp.bfloat16
    sliding_blocks = sh.num_seq_slots * sh.ring
    out = []
    if kernel == "kv_write":
        write = functools.partial(kv_write.write_kv, device_kind=device_kind)
        write_idx = functools.partial(kv_write.write_indexer_keys, device_kind=device_kind)
        t = sh.write_tokens
        for fmt in ("fp8_ds_mla", "bf16"):
            pool = _kv_pool(fmt, sh.sliding_layers, sliding_blocks, sh.block_size, sh)
            out.append((f"{fmt}/window", write, (pool, _S((t, sh.head_dim), bf16), _S((t,), i32), _S((), i32))))
            cpool = _kv_pool(fmt, sh.csa_layers, sh.compressed_blocks, sh.block_size // sh.csa_ratio, sh)
            out.append((f"{fmt}/csa", write, (cpool, _S((t // 4, sh.head_dim), f32), _S((t // 4,), i32), _S((), i32))))
        for fmt in ("fp8", "bf16"):
            pool = _indexer_pool(fmt, sh)
            keys = _S((t // 4, sh.index_head_dim), f32)
            out.append((f"indexer_{fmt}", write_idx, (pool, keys, _S((t // 4,), i32), _S((), i32))))
        return out
    if kernel in ("sparse_decode", "sparse_prefill"):
        for fmt in ("fp8_ds_mla", "bf16"):
            wpool = _kv_pool(fmt, sh.sliding_layers, sliding_blocks, sh.block_size, sh)
            for mode, ratio in (("window", 0), ("csa", sh.csa_ratio), ("hca", sh.hca_ratio)):
                if kernel == "sparse_decode":
                    b = sh.decode_batch
                    head = (_S((b, sh.heads, sh.head_dim), bf16), wpool, _S((b, sh.ring), i32), _S((b,), i32))
                    fn = sparse_decode.sparse_decode
                    idx_shape = (b, sh.topk)
                else:
                    b, s = sh.prefill_batch, sh.prefill_tokens
                    q = _S((b, s, sh.heads, sh.head_dim), bf16)
                    head = (q, wpool, _S((b, sh.ring), i32), _S((b,), i32), _S((b,), i32))
                    fn = sparse_prefill.sparse_prefill
                    idx_shape = (b, s, sh.topk)
                args = (*head, _S((sh.heads,), f32))
                if mode == "window":  # (compressed pool, table, picks, layer, compressed layer)
                    args = (*args, None, None, None, _S((), i32), _S((), i32))
                else:
                    layers = sh.csa_layers if mode == "csa" else sh.hca_layers
                    cpool = _kv_pool(fmt, layers, sh.compressed_blocks, sh.block_size // ratio, sh)
                    idx = _S(idx_shape, i32) if mode == "csa" else None
                    args = (*args, cpool, _S((b, sh.max_blocks), i32), idx, _S((), i32), _S((), i32))
                f = functools.partial(fn, window=sh.window, ratio=ratio, device_kind=device_kind)
                out.append((f"{fmt}/{mode}", f, args))
                if kernel == "sparse_prefill":  # with the chunk's own window rows (paged_core.py, every layer)
                    out.append((f"{fmt}/{mode}+window_kv", f, (*args, _S((b, s, sh.head_dim), bf16))))
        return out
    if kernel == "indexer_topk":
        f = functools.partial(indexer_topk.indexer_topk, topk=sh.topk, ratio=sh.csa_ratio, device_kind=device_kind)
        decode, prefill = (sh.decode_batch, 1), (sh.prefill_batch, sh.prefill_tokens)
        for fmt, (b, s) in (("fp8", decode), ("fp8", prefill), ("bf16", decode)):
            args = (
                _S((b, s, sh.index_heads, sh.index_head_dim), bf16), _S((b, s, sh.index_heads), f32),
                _indexer_pool(fmt, sh), _S((b, sh.max_blocks), i32), _S((b,), i32), _S((b,), i32), _S((), i32),
            )
            out.append((f"{fmt}/{'decode' if s == 1 else 'prefill'}", f, args))
        return out
    raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(CHECK_KERNELS)}")


def lower(fn: Callable[..., Any], args: Sequence[Any], device_kind: str) -> jax.export.Exported:
    """Lower `fn(*args)` for CUDA inside an abstract mesh of `device_kind` (no GPU needed)."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",),
        abstract_device=jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda"),
    )
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "Pallas Triton is deprecated"
        return jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    kernel: str
    device_kind: str
    ok: bool
    variants: int
    seconds: float
    error: str = ""

    def line(self) -> str:
        status = "OK  " if self.ok else "FAIL"
        detail = f"{self.variants} variants lowered" if self.ok else self.error
        return f"{status} {self.kernel:<15} {self.device_kind:<20} {self.seconds:5.1f}s  {detail}"


def check_one(kernel: str, device_kind: str, shapes: Shapes = FLASH) -> CheckResult:
    start = time.perf_counter()
    try:
        variants = cases(kernel, device_kind, shapes)
    except Exception as exc:  # noqa: BLE001  (report, don't crash the table)
        return CheckResult(kernel, device_kind, False, 0, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    for name, fn, args in variants:
        try:
            lower(fn, args, device_kind)
        except Exception as exc:  # noqa: BLE001
            msg = " ".join(str(exc).split())[:300]
            return CheckResult(
                kernel, device_kind, False, len(variants), time.perf_counter() - start,
                f"{name}: {type(exc).__name__}: {msg}",
            )
    return CheckResult(kernel, device_kind, True, len(variants), time.perf_counter() - start)


def run_check(
    device_kinds: Sequence[str] = DEFAULT_DEVICE_KINDS,
    kernels: Sequence[str] = CHECK_KERNELS,
    shapes: Shapes = FLASH,
    echo: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Lower every kernel for every device kind; one result per (kernel, device kind)."""
    results = []
    for kind in device_kinds:
        for kernel in kernels:
            result = check_one(kernel, kind, shapes)
            results.append(result)
            if echo is not None:
                echo(result.line())
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pallas_kernels.check",
        description="Lower the Pallas kernels to Triton IR for GPU kinds, without a GPU. " + DISCLAIMER,
    )
    parser.add_argument(
        "--device-kind", action="append", dest="device_kinds", metavar="KIND",
        help=f"device kind to lower for (repeatable; default: {', '.join(DEFAULT_DEVICE_KINDS)})",
    )
    parser.add_argument(
        "--kernel", action="append", dest="kernels", choices=CHECK_KERNELS,
        help="kernel to lower (repeatable; default: all)",
    )
    args = parser.parse_args(argv)
    kinds = args.device_kinds or list(DEFAULT_DEVICE_KINDS)
    kernels = args.kernels or list(CHECK_KERNELS)
    sh = FLASH
    print(DISCLAIMER)
    print(
        f"Shapes: DeepSeek-V4-Flash, {sh.heads} heads, head_dim {sh.head_dim} ({sh.head_dim - sh.rope_dim} NoPE + "
        f"{sh.rope_dim} RoPE), top-k {sh.topk}, window {sh.window}, block {sh.block_size}, indexer "
        f"{sh.index_heads} x {sh.index_head_dim}; launch parameters from pallas_kernels/tuning.py."
    )
    results = run_check(kinds, kernels, sh, echo=lambda line: print(line, flush=True))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} (kernel, device kind) pairs lowered; {len(failed)} failed.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
