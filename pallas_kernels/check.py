"""AOT lowering check of the Pallas kernels to Triton IR, without a GPU.

    python -m pallas_kernels.check [--device-kind KIND ...] [--kernel NAME ...] [--debug]

For each (kernel, device kind) this lowers exactly the wrappers the engine calls, with the
launch parameters of pallas_kernels/tuning.py for that kind, at DeepSeek-V4-Flash shapes (64
heads, head_dim 512 = 448 NoPE + 64 RoPE, top-k 512, window 128, block 256, indexer 64 x 128),
to Triton IR for that device's compute capability, inside an abstract mesh (`jax.export` for
platform "cuda"). It prints one line per (kernel, device kind), OK or the first error, and exits
1 if any failed. A device kind must be one of pallas_kernels/devices.py (an unknown one is one
line on stderr and status 2). Kernels the device cannot run are reported as not applicable, not
lowered: the fp8 variants (fp8_ds_mla KV planes, fp8 indexer keys) below compute capability 8.9,
where the KV cache is bf16 (`pallas_bf16`), and every variant below 8.0.

Lowering is not compiling: this proves that every primitive the kernels use has a Triton
lowering for that compute capability (fp8 casts need >= 8.9, value slices are refused, ...).
Registers, shared memory per block (about 99 KB on SM120 against 227 KB on H100/H200/B200),
spills and speed are only checked by the GPU compiler and by running on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import devices, formats, indexer_topk, kv_write, sparse_decode, sparse_prefill
from pallas_kernels.cli import OneLineParser, add_debug_flag, run_main
from pallas_kernels.devices import DeviceKind

PROG = "python -m pallas_kernels.check"
DEFAULT_DEVICE_KINDS = ("NVIDIA H100", "NVIDIA H200", "NVIDIA B200", "NVIDIA RTX PRO 6000")
CHECK_KERNELS = ("kv_write", "sparse_decode", "sparse_prefill", "indexer_topk")
DISCLAIMER = (
    "Lowering to Triton IR, each module checked by MLIR's verifier, only: NOT compiled, NOT run on a "
    "GPU (register and shared-memory limits, correctness and speed on the device are not checked here)."
)
# Every variant is named "<storage format>/<what>"; these formats hold e4m3 values.
FP8_FORMATS = ("fp8_ds_mla", "fp8")
# JAX's Pallas lowering reads the compute capability from the abstract device's kind, with a list of
# its own (jax/_src/pallas/triton/gpu_info.py) that lacks H20, H800, L40S, GeForce RTX 5090 and more:
# each kind is lowered as the kind JAX knows with its compute capability (the launch parameters stay
# the kind's own, from pallas_kernels/tuning.py).
JAX_KIND_BY_CAPABILITY = {
    "8.0": "NVIDIA A100", "8.6": "NVIDIA A10", "8.9": "NVIDIA L4", "9.0": "NVIDIA H100", "10.0": "NVIDIA B200",
    "10.3": "NVIDIA B300", "12.0": "NVIDIA RTX PRO 6000", "12.1": "NVIDIA GB10",
}


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


def _plane(lead: tuple[int, int, int], width: int, dtype) -> jax.ShapeDtypeStruct:
    """A pool plane [layers, blocks, units, width] with the engine's idle layers (as
    dsv4_jax/kv_cache/paged.py lays them out): a 1-byte plane of 2 to 4 GiB would be indexed with
    wrapping offsets, and the kernels refuse it."""
    return _S((*formats.lead_with_idle_layers(lead, width, dtype), width), dtype)


def _kv_pool(fmt: str, layers: int, blocks: int, units: int, sh: Shapes) -> tuple:
    lead = (layers, blocks, units)
    if fmt == "fp8_ds_mla":
        nope = sh.head_dim - sh.rope_dim
        return (
            _plane(lead, nope, jnp.float8_e4m3fn),
            _plane(lead, sh.rope_dim, jnp.bfloat16),
            _plane(lead, formats.fp8_ds_mla_scale_bytes(nope), jnp.uint8),
        )
    return (_plane(lead, sh.head_dim, jnp.bfloat16),)


def _indexer_pool(fmt: str, sh: Shapes) -> tuple:
    lead = (sh.csa_layers, sh.compressed_blocks, sh.block_size // sh.csa_ratio)
    if fmt == "fp8":
        return (_plane(lead, sh.index_head_dim, jnp.float8_e4m3fn), _S(lead, jnp.float32))
    return (_plane(lead, sh.index_head_dim, jnp.bfloat16),)


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
            out.append((f"{fmt}/indexer", write_idx, (pool, keys, _S((t // 4,), i32), _S((), i32))))
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


def _triton_lowering():
    """JAX's private Triton lowering module, where it has `lower_jaxpr_to_triton_module`; else None."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return None
    return lowering if hasattr(lowering, "lower_jaxpr_to_triton_module") else None


VERIFIED = _triton_lowering() is not None


@contextlib.contextmanager
def verified_triton_modules():
    """Run MLIR's verifier on every Triton module JAX lowers inside the block, raising on the first
    malformed one. XLA parses a kernel's module only when it compiles it for a GPU, so a module
    that lowers but does not verify (a loop whose bounds have different integer types, say) would
    otherwise pass here and fail on the device: seen on an H200. This wraps JAX's private
    `lower_jaxpr_to_triton_module`; where a JAX version lacks it, modules are not verified
    (`VERIFIED` says which)."""
    lowering = _triton_lowering()
    if lowering is None:
        yield
        return
    original = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = original(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the op and its source line
        return result

    lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def lower(fn: Callable[..., Any], args: Sequence[Any], device_kind: str) -> jax.export.Exported:
    """Lower `fn(*args)` for CUDA inside an abstract mesh of `device_kind` (no GPU needed), each
    Triton module checked by MLIR's verifier (`verified_triton_modules`)."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",),
        abstract_device=jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda"),
    )
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings(), verified_triton_modules():
        warnings.simplefilter("ignore", DeprecationWarning)  # "Pallas Triton is deprecated"
        return jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)


def resolve_device_kind(device_kind: str) -> DeviceKind:
    """The row of pallas_kernels/devices.py for a GPU kind; ValueError naming the known ones."""
    kind = devices.lookup(device_kind) if isinstance(device_kind, str) else None
    if kind is None or kind.compute_capability is None:
        raise ValueError(
            f"--device-kind {device_kind!r} is not a GPU kind of pallas_kernels/devices.py; known: "
            + ", ".join(devices.gpu_kind_names())
        )
    return kind


def not_applicable(kind: DeviceKind) -> str:
    """Why some of the kernels do not apply to `kind` ("" when all do)."""
    cc = kind.compute_capability
    if not kind.runs_pallas:
        return f"no Pallas Triton kernels on compute capability {cc} (< 8.0: attention runs on the xla backend)"
    if not kind.has_fp8:
        return (
            f"no fp8 on compute capability {cc} (Triton's e4m3 needs >= 8.9): the fp8 kernels (fp8_ds_mla KV, "
            f"fp8 indexer keys) do not apply; the bf16 KV layout's kernels (pallas_bf16) are lowered"
        )
    return ""


def applies(variant: str, kind: DeviceKind) -> bool:
    """Whether the engine would launch `variant` on `kind` (the resolver's choice of KV layout)."""
    return kind.runs_pallas and (kind.has_fp8 or variant.split("/")[0] not in FP8_FORMATS)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    kernel: str
    device_kind: str
    ok: bool
    variants: int  # lowered (or tried, on failure)
    seconds: float
    error: str = ""
    not_applicable: int = 0  # variants the device cannot run (not lowered)

    def line(self) -> str:
        skipped = f"{self.not_applicable} variants not applicable"
        if not self.ok:
            status, detail = "FAIL", self.error
        elif not self.variants:
            status, detail = "N/A ", skipped
        else:
            status = "OK  "
            detail = f"{self.variants} variants lowered" + (f"; {skipped}" if self.not_applicable else "")
        return f"{status} {self.kernel:<15} {self.device_kind:<20} {self.seconds:5.1f}s  {detail}"


def check_one(kernel: str, device_kind: str, shapes: Shapes = FLASH) -> CheckResult:
    start = time.perf_counter()
    try:
        kind = resolve_device_kind(device_kind)
        variants = cases(kernel, device_kind, shapes)
    except Exception as exc:  # noqa: BLE001  (report, don't crash the table)
        return CheckResult(kernel, device_kind, False, 0, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    runnable = [(name, fn, args) for name, fn, args in variants if applies(name, kind)]
    skipped = len(variants) - len(runnable)
    for name, fn, args in runnable:
        try:
            lower(fn, args, JAX_KIND_BY_CAPABILITY[kind.compute_capability])
        except Exception as exc:  # noqa: BLE001
            msg = " ".join(str(exc).split())[:300]
            return CheckResult(
                kernel, device_kind, False, len(runnable), time.perf_counter() - start,
                f"{name}: {type(exc).__name__}: {msg}", skipped,
            )
    return CheckResult(kernel, device_kind, True, len(runnable), time.perf_counter() - start, "", skipped)


def run_check(
    device_kinds: Sequence[str] = DEFAULT_DEVICE_KINDS,
    kernels: Sequence[str] = CHECK_KERNELS,
    shapes: Shapes = FLASH,
    echo: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Lower every kernel for every device kind; one result per (kernel, device kind). `echo` gets
    each result's line, after a NOTE line for a kind where some kernels do not apply."""
    results = []
    for kind in device_kinds:
        note = not_applicable(resolve_device_kind(kind))
        if echo is not None and note:
            echo(f"NOTE {kind}: {note}")
        for kernel in kernels:
            result = check_one(kernel, kind, shapes)
            results.append(result)
            if echo is not None:
                echo(result.line())
    return results


def make_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Lower the Pallas kernels to Triton IR for GPU kinds, without a GPU. " + DISCLAIMER,
    )
    parser.add_argument(
        "--device-kind", action="append", dest="device_kinds", metavar="KIND",
        help="GPU kind to lower for, as jax reports it or as pallas_kernels/devices.py names it "
        f"(repeatable; default: {', '.join(DEFAULT_DEVICE_KINDS)})",
    )
    parser.add_argument(
        "--kernel", action="append", dest="kernels", choices=CHECK_KERNELS,
        help=f"kernel to lower (repeatable; default: all of {', '.join(CHECK_KERNELS)})",
    )
    add_debug_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Print one line per (kernel, device kind); 1 if any failed. An unknown kind is a ValueError
    (one line and status 2 under `run_main`), raised before anything is lowered."""
    args = make_parser().parse_args(argv)
    kinds = args.device_kinds or list(DEFAULT_DEVICE_KINDS)
    for kind in kinds:
        resolve_device_kind(kind)
    kernels = args.kernels or list(CHECK_KERNELS)
    sh = FLASH
    print(DISCLAIMER)
    if not VERIFIED:
        print("NOTE: this JAX has no lower_jaxpr_to_triton_module to wrap: the modules are NOT verified.")
    print(
        f"Shapes: DeepSeek-V4-Flash, {sh.heads} heads, head_dim {sh.head_dim} ({sh.head_dim - sh.rope_dim} NoPE + "
        f"{sh.rope_dim} RoPE), top-k {sh.topk}, window {sh.window}, block {sh.block_size}, indexer "
        f"{sh.index_heads} x {sh.index_head_dim}; launch parameters from pallas_kernels/tuning.py."
    )
    results = run_check(kinds, kernels, sh, echo=lambda line: print(line, flush=True))
    failed = [r for r in results if not r.ok]
    lowered = [r for r in results if r.ok and r.variants]
    skipped = sum(r.not_applicable for r in results)
    print(
        f"{len(lowered)}/{len(results)} (kernel, device kind) pairs lowered; {len(failed)} failed"
        + (f"; {skipped} variants not applicable (see NOTE)." if skipped else ".")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main, prog=PROG)
