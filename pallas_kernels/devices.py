"""The one table of device kinds: compute capability, nominal memory and SM count per GPU kind.

The KV-cache resolver (compute capability -> fp8 or bf16 KV cache), the capacity planner (memory
of a device that cannot be asked) and the kernel tuning (launch parameters, split-K sizing) all
read this table through `lookup`, so they always agree on what a device kind is. It lives in the
lowest package (`dsv4_jax` imports `pallas_kernels`, never the reverse) and needs no JAX.

One matching rule: each row's pattern is searched case-insensitively, with word boundaries, in
what `jax.Device.device_kind` reports ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
"NVIDIA GeForce RTX 5090"); rows are tried in order and the first match wins, so a more specific
row comes before the general one it refines (GH200 144GB before GH200, H100 NVL before H100, RTX
PRO 6000 before the other RTX PRO Blackwell cards). Workstation names reuse consumer numbers
("Quadro RTX 5000" is Turing 7.5, "NVIDIA RTX 5000 Ada Generation" 8.9, "NVIDIA RTX A5000" 8.6),
so consumer cards match only as "GeForce RTX <series><5-9>0" and workstation cards by their
generation word. Every row lists real kinds it is for (`examples`); tests/test_kv_resolver.py
checks that each reaches its row, i.e. that no row is shadowed by an earlier one.

A row may stand for a family with one compute capability (the L40/L4/L20/L2 row, the GeForce RTX
40x0 row): `name` is then its lead device, and `sm_count` is the lead device's (only split-K
sizing reads it). `memory_mib` is None where the family's members differ or the figure is not
known here.
"""

from __future__ import annotations

import dataclasses
import re

# Triton has fp8 (e4m3) casts from compute capability 8.9 (Ada) on, and bf16 dots from 8.0.
FP8_MIN_CAPABILITY = (8, 9)
PALLAS_MIN_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """One row of the table: a device kind (or family) and what the code needs to know of it."""

    name: str  # canonical kind: what `tuning.canonical_device_kind` returns; matches its own pattern
    pattern: str  # regex searched case-insensitively in `jax.Device.device_kind`
    compute_capability: str | None  # "major.minor"; None for "cpu" (Pallas interpret mode)
    sm_count: int  # streaming multiprocessors of `name` (interpret mode: programs to cover)
    memory_mib: int | None = None  # nominal total memory as nvidia-smi reports it
    examples: tuple[str, ...] = ()  # real device kinds this row is for

    @property
    def capability(self) -> tuple[int, int] | None:
        """(major, minor), or None for "cpu"."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def has_fp8(self) -> bool:
        """Whether Triton can cast to float8_e4m3fn here (the fp8_ds_mla KV cache, fp8 indexer keys)."""
        return self.capability is not None and self.capability >= FP8_MIN_CAPABILITY

    @property
    def runs_pallas(self) -> bool:
        """Whether the Pallas Triton kernels run here at all (bf16 dots need 8.0)."""
        return self.capability is not None and self.capability >= PALLAS_MIN_CAPABILITY


DEVICE_KINDS: tuple[DeviceKind, ...] = (
    # Workstation cards first: their numbers overlap the GeForce series.
    DeviceKind("NVIDIA RTX PRO 6000", r"\bRTX PRO 6000\b", "12.0", 188, 97887, (
        "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition")),
    DeviceKind("NVIDIA RTX PRO 5000 Blackwell", r"\bRTX PRO \d{3,4}\w*(?: SFF)? Blackwell\b", "12.0", 110, None, (
        "NVIDIA RTX PRO 4500 Blackwell",)),
    DeviceKind("NVIDIA RTX 6000 Ada Generation", r"\bRTX \d{3,4}\w*(?: SFF)? Ada\b", "8.9", 142, None, (
        "NVIDIA RTX 5000 Ada Generation", "NVIDIA RTX 5880 Ada Generation", "NVIDIA RTX 4000 Ada Generation",
        "NVIDIA RTX 4000 SFF Ada Generation", "NVIDIA RTX 2000 Ada Generation")),
    DeviceKind("NVIDIA RTX A6000", r"\bRTX A\d{3,4}\b", "8.6", 84, None, (
        "NVIDIA RTX A5000", "NVIDIA RTX A4000", "NVIDIA RTX A2000")),
    DeviceKind("Quadro RTX 8000", r"\bQuadro RTX\b|\bTITAN RTX\b", "7.5", 72, None, (
        "Quadro RTX 6000", "Quadro RTX 5000", "Quadro RTX 4000", "Quadro RTX 3000", "NVIDIA TITAN RTX")),
    # Data centre. The Grace superchips (GH200, GB200) come before H200 / B200, which they contain.
    DeviceKind("NVIDIA GB10", r"\bGB10\b", "12.1", 48),  # DGX Spark (memory shared with the CPU)
    DeviceKind("NVIDIA B300", r"\bG?B300\b", "10.3", 160, None, ("NVIDIA B300 SXM6 AC", "NVIDIA GB300")),
    DeviceKind("NVIDIA GB200", r"\bGB200\b", "10.0", 148, 189471),  # 186 GB HBM3e per GPU
    DeviceKind("NVIDIA B200", r"\bB200\b", "10.0", 148, 183359),
    DeviceKind("NVIDIA B100", r"\bB100\b", "10.0", 148),  # SM count assumed as B200's (same die, lower power)
    # GH200 comes with 96 GB HBM3 ("NVIDIA GH200 480GB": the 480GB is the Grace LPDDR5X) or 144 GB
    # HBM3e ("NVIDIA GH200 144G HBM3e"): the smaller unless the kind says 144.
    DeviceKind("NVIDIA GH200 144G HBM3e", r"\bGH200\b.*\b144\s*GB?\b", "9.0", 132, 146831, (
        "NVIDIA GH200 144GB HBM3e",)),
    DeviceKind("NVIDIA GH200", r"\bGH200\b", "9.0", 132, 97871, ("NVIDIA GH200 480GB",)),
    DeviceKind("NVIDIA H200", r"\bH200\b", "9.0", 132, 143771, ("NVIDIA H200 NVL",)),
    DeviceKind("NVIDIA H100 NVL", r"\bH100\b.*\bNVL\b", "9.0", 132, 95830),
    DeviceKind("NVIDIA H100", r"\bH100\b", "9.0", 132, 81559, ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe")),
    DeviceKind("NVIDIA H800", r"\bH800\b", "9.0", 132, 81559, ("NVIDIA H800 PCIe",)),
    DeviceKind("NVIDIA H20", r"\bH20\b", "9.0", 78, 97871),
    DeviceKind("NVIDIA L40S", r"\bL40S\b", "8.9", 142, 46068),
    DeviceKind("NVIDIA L40", r"\bL40\b|\bL4\b|\bL20\b|\bL2\b", "8.9", 142, None, ("NVIDIA L4", "NVIDIA L20")),
    DeviceKind("NVIDIA A100-PCIE-40GB", r"\bA100\b.*\b40GB\b", "8.0", 108, 40960, ("NVIDIA A100-SXM4-40GB",)),
    DeviceKind("NVIDIA A100", r"\bA100\b", "8.0", 108, 81920, ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")),
    DeviceKind("NVIDIA A800", r"\bA800\b", "8.0", 108, None, ("NVIDIA A800-SXM4-80GB",)),
    DeviceKind("NVIDIA A30", r"\bA30\b", "8.0", 56),
    DeviceKind("NVIDIA A10", r"\bA10\b", "8.6", 72, 23028),
    DeviceKind("NVIDIA A10G", r"\bA10G\b|\bA40\b|\bA16\b|\bA2\b", "8.6", 80, None, (
        "NVIDIA A40", "NVIDIA A16", "NVIDIA A2")),
    DeviceKind("Tesla T4", r"\bT4\b", "7.5", 40, 15360),
    DeviceKind("NVIDIA T4G", r"\bT4G\b", "7.5", 40),
    DeviceKind("Tesla V100", r"\bV100\b|\bTITAN V\b", "7.0", 80, None, ("Tesla V100-SXM2-16GB", "NVIDIA TITAN V")),
    DeviceKind("Tesla P100", r"\bP100\b", "6.0", 56, None, ("Tesla P100-PCIE-16GB",)),
    DeviceKind("Tesla P40", r"\bP40\b|\bP4\b", "6.1", 30, None, ("Tesla P4",)),
    # GeForce: 50x0 Blackwell, 40x0 Ada, 30x0 and the (GA107) 2050 Ampere, 2060-2080 Turing.
    DeviceKind("NVIDIA GeForce RTX 5090", r"\bGeForce RTX 5090\b", "12.0", 170, 32607),
    DeviceKind("NVIDIA GeForce RTX 5080", r"\bGeForce RTX 50[5-9]0\b", "12.0", 84, None, (
        "NVIDIA GeForce RTX 5070 Ti", "NVIDIA GeForce RTX 5060")),
    DeviceKind("NVIDIA GeForce RTX 4090", r"\bGeForce RTX 4090\b", "8.9", 128, 24564),
    DeviceKind("NVIDIA GeForce RTX 4080", r"\bGeForce RTX 40[5-9]0\b", "8.9", 76, None, (
        "NVIDIA GeForce RTX 4060 Laptop GPU",)),
    DeviceKind("NVIDIA GeForce RTX 3090", r"\bGeForce RTX 30[5-9]0\b|\bGeForce RTX 2050\b", "8.6", 82, None, (
        "NVIDIA GeForce RTX 3060 Ti", "NVIDIA GeForce RTX 2050")),
    DeviceKind("NVIDIA GeForce RTX 2080 Ti", r"\bGeForce RTX 20[6-8]0\b", "7.5", 68, None, (
        "NVIDIA GeForce RTX 2060",)),
    # The host: Pallas interpret mode (CPU CI); 4 "SMs" so that split-K still splits at test shapes.
    DeviceKind("cpu", r"^cpu$", None, 4),
)

_COMPILED = tuple((re.compile(row.pattern, re.IGNORECASE), row) for row in DEVICE_KINDS)
BY_NAME: dict[str, DeviceKind] = {row.name: row for row in DEVICE_KINDS}


def lookup(device_kind: str) -> DeviceKind | None:
    """The first row whose pattern is found in `device_kind` (surrounding spaces ignored), or None."""
    kind = device_kind.strip()
    return next((row for pattern, row in _COMPILED if pattern.search(kind)), None)


def gpu_kind_names() -> tuple[str, ...]:
    """Canonical names of every GPU row (for messages listing what is known)."""
    return tuple(row.name for row in DEVICE_KINDS if row.compute_capability is not None)
