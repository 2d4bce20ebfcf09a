"""Block sizes, warps and stages of every Pallas kernel, per GPU kind: the one table of launch parameters.

The kernel wrappers look their launch parameters up here (`kernel_config`), and so does the
lowering check (`python -m pallas_kernels.check`), so what the check lowers is exactly what the
engine launches. None of these numbers has been measured on a GPU yet (see docs/kernels.md); they
are chosen from register and shared-memory budgets:

* a query block of M = block_q * block_h rows keeps an fp32 accumulator of M x head_dim; at
  head_dim 512 that is 2 KB per row, so M = 32 (64 KB, 64 registers per thread at 8 warps) on
  the 227 KB-shared-memory parts (H100, H200, B200) and M = 16 on SM120 (RTX PRO 6000: about
  99 KB of shared memory and the same 64K registers per SM), where a 64 x 512 fp32 block
  (128 KB) would not fit at all;
* block_k key rows are gathered per step as [block_k, 64] tiles of every 64-dim chunk
  (block_k * head_dim * 2 bytes of bf16 operands: 32 KB at 32 x 512);
* decode splits the key range over up to `max_splits` programs so that batch x head blocks x
  splits covers the SMs about twice (flash-decoding), and a merge step combines the splits.

Device kinds are matched by the one table of pallas_kernels/devices.py ("NVIDIA H100 80GB HBM3"
-> "NVIDIA H100"); the launch parameters follow the row's shared memory per block: the
H100-class entry on SM90/SM100 (227 KB), the SM120 entry on every other GPU (at most 163 KB on
SM80, about 99 KB on SM86/89/120), the small interpret-mode entry on "cpu" (and with
`interpret=True`). A GPU kind the table does not know gets the RTX PRO 6000 row (SM120, the
smallest budget).
"""

from __future__ import annotations

import dataclasses
import math

from pallas_kernels import devices
from pallas_kernels.devices import DeviceKind

KERNELS = ("kv_write", "sparse_decode", "sparse_prefill", "sparse_prefill_csa", "indexer_topk")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel on one device kind (fields a kernel does not use are ignored).

    block_q:    query tokens per program (prefill of sliding-window and HCA layers; 1 elsewhere)
    block_h:    query heads per program (M = block_q * block_h rows of every dot); the indexer
                always takes all its heads (the score is a sum over them)
    block_k:    key rows (or indexer entries) per inner step; kv_write: rows per program
    max_splits: upper bound on decode split-K programs per (sequence, head block)
    num_warps, num_stages: Triton launch parameters
    """

    block_q: int = 1
    block_h: int = 16
    block_k: int = 32
    max_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "block_h", "block_k", "max_splits", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelConfig.{name} must be a positive integer, got {value!r}")
        for name in ("block_q", "block_h", "block_k"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two (Triton blocks), got {value}")


_HOPPER_CLASS = {
    "kv_write": KernelConfig(block_k=32, num_warps=4, num_stages=1),
    "sparse_decode": KernelConfig(block_h=32, block_k=32, max_splits=64, num_warps=8, num_stages=2),
    "sparse_prefill": KernelConfig(block_q=2, block_h=16, block_k=64, num_warps=8, num_stages=2),
    "sparse_prefill_csa": KernelConfig(block_h=32, block_k=32, num_warps=8, num_stages=2),
    "indexer_topk": KernelConfig(block_k=64, max_splits=32, num_warps=8, num_stages=2),
}

_SM120 = {
    "kv_write": KernelConfig(block_k=32, num_warps=4, num_stages=1),
    "sparse_decode": KernelConfig(block_h=16, block_k=32, max_splits=64, num_warps=4, num_stages=2),
    "sparse_prefill": KernelConfig(block_q=1, block_h=16, block_k=32, num_warps=4, num_stages=2),
    "sparse_prefill_csa": KernelConfig(block_h=16, block_k=32, num_warps=4, num_stages=2),
    "indexer_topk": KernelConfig(block_k=32, max_splits=32, num_warps=4, num_stages=1),
}

# Interpret mode (CPU CI): small blocks so that every loop of the kernels runs more than once
# at the test shapes (16 heads, head_dim 192, <= 256 rows).
_INTERPRET = {
    "kv_write": KernelConfig(block_k=16, num_warps=4, num_stages=1),
    "sparse_decode": KernelConfig(block_h=16, block_k=16, max_splits=4, num_warps=4, num_stages=1),
    "sparse_prefill": KernelConfig(block_q=2, block_h=8, block_k=16, num_warps=4, num_stages=1),
    "sparse_prefill_csa": KernelConfig(block_h=16, block_k=16, num_warps=4, num_stages=1),
    "indexer_topk": KernelConfig(block_k=16, max_splits=4, num_warps=4, num_stages=1),
}


def _launch_class(kind: DeviceKind) -> dict[str, KernelConfig]:
    """Launch parameters by shared memory per block: 227 KB on SM90/SM100, less on every other GPU."""
    if kind.capability is None:
        return _INTERPRET
    return _HOPPER_CLASS if kind.capability[0] in (9, 10) else _SM120


# Keyed by the canonical names of pallas_kernels/devices.py (every row, "cpu" included).
TUNING: dict[str, dict[str, KernelConfig]] = {kind.name: _launch_class(kind) for kind in devices.DEVICE_KINDS}
FALLBACK_KIND = "NVIDIA RTX PRO 6000"


def canonical_device_kind(device_kind: str | None = None) -> str:
    """The table's name for a device kind (None: the default JAX device's kind); FALLBACK_KIND for
    a kind the table does not know."""
    if device_kind is None:
        import jax  # deferred: the table itself needs no JAX

        device_kind = jax.devices()[0].device_kind
    kind = devices.lookup(device_kind)
    return FALLBACK_KIND if kind is None else kind.name


def kernel_config(kernel: str, device_kind: str | None = None, *, interpret: bool = False) -> KernelConfig:
    """Launch parameters of `kernel` on `device_kind`; interpret mode always uses the "cpu" entry."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")
    kind = "cpu" if interpret else canonical_device_kind(device_kind)
    return TUNING[kind][kernel]


def device_info(device_kind: str | None = None, *, interpret: bool = False) -> DeviceKind:
    """The devices-table row the kernels size their grids for (its `sm_count`)."""
    return devices.BY_NAME["cpu" if interpret else canonical_device_kind(device_kind)]


def num_splits(
    work_chunks: int, parallel_programs: int, config: KernelConfig, info: DeviceKind
) -> int:
    """Split-K factor: enough programs to cover the SMs about twice, at most `config.max_splits`
    and never more splits than there are key chunks."""
    want = math.ceil(2 * info.sm_count / max(parallel_programs, 1))
    return max(1, min(want, config.max_splits, max(work_chunks, 1)))
