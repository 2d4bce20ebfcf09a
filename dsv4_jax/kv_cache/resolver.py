"""KV-cache dtype and attention-backend resolution (spec section 8; policy in docs/kv_cache.md).

`resolve_kv_cache` never fails on `auto`: it picks the format the device can run fast, says why
in `KVCacheSpec.reason`, and logs the choice. `float32` (the exact reference cache: nothing
rounded, 4 x head_dim bytes per token) is only ever an explicit request, served by the xla
backend on any device. Explicit requests the device or the chosen backend
cannot serve are `ValueError`s that name the flag to change (`--kv-cache-dtype`,
`--attention-backend`) and the way out. Nothing here touches a device unless
`compute_capability` is None (or left at its default) and the device kind is missing from our own
table. Each resolution logs `KVCacheSpec.summary()` (ending with the reason) once at INFO, and on
fp8_ds_mla also the exact line `FP8_DS_MLA_LOG` as a record of its own. The choice is then held
against the model's shapes (`_fit_model`): the fp8_ds_mla layout needs whole 64-dim NoPE blocks,
and the Pallas kernels' tiling limits come from `pallas_kernels.limits`, the one check of them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import TYPE_CHECKING, Any

from dsv4_jax.config import CSA, DeepseekV4Config
from dsv4_jax.presets import get_config
from pallas_kernels import devices, limits
from pallas_kernels.backend import PALLAS_BF16, PALLAS_FP8_DS_MLA, XLA  # the kernel registry's names
from pallas_kernels.formats import (
    FP8_DS_MLA_QUANT_BLOCK,
    bf16_bytes_per_token,
    float32_bytes_per_token,
    fp8_ds_mla_bytes_per_token,
    indexer_bf16_bytes_per_entry,
    indexer_float32_bytes_per_entry,
    indexer_fp8_bytes_per_entry,
)

if TYPE_CHECKING:  # pragma: no cover
    import jax

logger = logging.getLogger(__name__)

FP8_DS_MLA_LOG = "Using DeepSeek's fp8_ds_mla KV cache format."

FP8_DS_MLA = "fp8_ds_mla"
BFLOAT16 = "bfloat16"
FLOAT32 = "float32"  # the exact reference cache (xla backend only); also the indexer dtype it implies
KV_CACHE_DTYPES = (FP8_DS_MLA, BFLOAT16, FLOAT32)

ATTENTION_BACKENDS = (PALLAS_FP8_DS_MLA, PALLAS_BF16, XLA)

AUTO = "auto"
FP8_REQUESTS = ("fp8", "fp8_e4m3", "fp8_ds_mla")
BF16_REQUESTS = ("bfloat16", "bf16")
FLOAT32_REQUESTS = ("float32", "fp32")
ACCEPTED_REQUESTS = (AUTO, *FP8_REQUESTS, *BF16_REQUESTS, *FLOAT32_REQUESTS)

# Device classes of the policy table in docs/kv_cache.md.
FP8_GPU = "fp8_gpu"  # compute capability >= 8.9: Ada, Hopper, Blackwell (SM100/103/120/121)
BF16_GPU = "bf16_gpu"  # 8.0 <= cc < 8.9: Ampere; Triton has no fp8 there
LEGACY_GPU = "legacy_gpu"  # cc < 8.0: Turing, Volta, Pascal
CPU = "cpu"
TPU = "tpu"
DEVICE_CLASSES = (FP8_GPU, BF16_GPU, LEGACY_GPU, CPU, TPU)

class _DefaultCapability(str):
    """The type of `resolve_kv_cache`'s default compute capability: equal to "9.0" (what its default
    device, the H200, has) but told apart from an explicit "9.0". It is honoured only for device
    kinds our table knows, where the table's value is used; for any other kind it counts as not
    given, so an unknown device is an error rather than silently Hopper."""

    __slots__ = ()


DEFAULT_COMPUTE_CAPABILITY = _DefaultCapability("9.0")


@dataclasses.dataclass(frozen=True)
class PoolBytes:
    """Bytes of one unit of each cache pool, per layer (sizes of the planes, no padding)."""

    sliding_per_token: int  # window KV, every attention layer
    csa_per_entry: int  # compressed KV entry of a CSA layer (one per `ratio` tokens)
    hca_per_entry: int  # compressed KV entry of an HCA layer
    indexer_per_entry: int  # indexer key of a CSA layer (one per CSA entry)
    csa_state_per_seq: int  # fp32 compressor state of a CSA layer's main compressor, one slot
    csa_indexer_state_per_seq: int  # fp32 state of a CSA layer's indexer compressor, one slot
    hca_state_per_seq: int  # fp32 compressor state of an HCA layer, one slot

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """What the server stores and runs: the resolved KV format, backend and pool sizes."""

    requested: str  # the request as given (lower case), e.g. "auto"
    kv_cache_dtype: str  # "fp8_ds_mla" | "bfloat16" | "float32"
    attention_backend: str  # "pallas_fp8_ds_mla" | "pallas_bf16" | "xla"
    indexer_dtype: str  # "fp8" | "bfloat16" | "float32"
    device_kind: str
    device_class: str  # one of DEVICE_CLASSES
    compute_capability: str | None  # "9.0"; None on CPU/TPU
    bytes_per_token: int  # main/sliding KV bytes per token
    pool_bytes: PoolBytes
    reason: str  # one line: why this format and backend
    warnings: tuple[str, ...] = ()
    head_dim: int = 512
    rope_dim: int = 64
    index_head_dim: int = 128

    @property
    def emulated(self) -> bool:
        """fp8_ds_mla read through XLA ops (or Pallas interpret mode) rather than a GPU kernel."""
        return self.kv_cache_dtype == FP8_DS_MLA and self.attention_backend != PALLAS_FP8_DS_MLA

    def summary(self) -> str:
        """The one line logged at start-up and reported by the server."""
        cc = f" (compute capability {self.compute_capability})" if self.compute_capability else ""
        p = self.pool_bytes
        return (
            f"KV cache: {self.kv_cache_dtype} on {self.attention_backend} for {self.device_kind}{cc}, "
            f"requested {self.requested!r}; indexer keys {self.indexer_dtype}; bytes: sliding "
            f"{p.sliding_per_token}/token, CSA {p.csa_per_entry}/entry, HCA {p.hca_per_entry}/entry, "
            f"indexer {p.indexer_per_entry}/entry, compressor state {p.csa_state_per_seq}+"
            f"{p.csa_indexer_state_per_seq} (CSA) {p.hca_state_per_seq} (HCA)/sequence/layer. {self.reason}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["warnings"] = list(self.warnings)
        return out


# ---- device classification -------------------------------------------------------------------
def parse_compute_capability(value: Any) -> tuple[int, int]:
    """'9.0', '9', 9.0, 9, (9, 0), 'sm_90', 'sm90', 'sm_120a' -> (major, minor).

    A minor version is one digit (NVIDIA has no cc x.10): '8.10', '8.90000001' or 8.899999 are
    errors, not (8, 10) / (8, 90000001), which would compare as newer than 8.9."""
    def bad() -> ValueError:
        return ValueError(
            f"compute_capability {value!r} is not a compute capability: expected major.minor with a "
            f"one-digit minor, e.g. '9.0', '8.6', '12.0' (or 'sm_90')"
        )

    if isinstance(value, bool):
        raise bad()
    if isinstance(value, tuple):
        if (len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                and value[0] >= 0 and 0 <= value[1] <= 9):
            return value
        raise bad()
    if isinstance(value, float):
        text = f"{value:.1f}"
        if value != value or value in (float("inf"), float("-inf")) or float(text) != value:
            raise bad()
    elif isinstance(value, (str, int)):
        text = str(value).strip().lower()
    else:
        raise bad()
    m = re.fullmatch(r"(\d+)(?:\.(\d))?", text)
    if m:
        return int(m.group(1)), int(m.group(2) or 0)
    m = re.fullmatch(r"sm_?(\d+?)(\d)[af]?", text)
    if m:
        return int(m.group(1)), int(m.group(2))
    raise bad()


def lookup_compute_capability(device_kind: str) -> str | None:
    """Compute capability of an NVIDIA device kind from our table (pallas_kernels/devices.py), or
    None if unknown. JAX's own table lacks H20, H800, L40S, RTX 5090 and more."""
    kind = devices.lookup(device_kind)
    return None if kind is None else kind.compute_capability


def _live_compute_capability(device_kind: str) -> str | None:
    """The compute capability of a live JAX device of this kind, if one is attached."""
    try:
        import jax  # local: no device is touched at import

        for dev in jax.devices():
            if dev.device_kind == device_kind and getattr(dev, "compute_capability", None):
                return str(dev.compute_capability)
    except Exception:  # no backend, or a plugin that fails to initialise: fall through
        return None
    return None


def classify_device(
    device_kind: str, compute_capability: Any = None, *, trust_capability: bool = True
) -> tuple[str, str | None]:
    """(device class, normalised compute capability or None) for the policy table.

    `compute_capability` None, or `DEFAULT_COMPUTE_CAPABILITY` (`resolve_kv_cache`'s default), is
    read from our table of device kinds, else from a live JAX device of that kind; an unknown kind
    with neither is a ValueError. An explicit value for a kind our table does not know is used as
    given. With `trust_capability=False` a kind found in our table keeps the table's value when an
    explicit one disagrees (with a warning); `resolve_for_device` passes the live device's own
    value with `trust_capability=True`, and it wins."""
    if not isinstance(device_kind, str) or not device_kind.strip():
        raise ValueError(f"device_kind must be a non-empty string such as 'NVIDIA H200' or 'cpu', got {device_kind!r}")
    kind = device_kind.strip()
    if kind.lower() == "cpu":
        return CPU, None
    if kind.lower().startswith("tpu"):
        return TPU, None
    known = lookup_compute_capability(kind)
    cc = None if isinstance(compute_capability, _DefaultCapability) else compute_capability
    if cc is not None:
        parse_compute_capability(cc)  # a malformed value is an error even where the table wins
    if cc is not None and known is not None and not trust_capability:
        if parse_compute_capability(cc) != parse_compute_capability(known):
            logger.warning(
                "compute capability %s given for %r disagrees with its known %s; using %s", cc, kind, known, known
            )
            cc = known
    if cc is None:
        cc = known or _live_compute_capability(kind)
    if cc is None:
        raise ValueError(
            f"unknown device kind {kind!r} and no compute capability: pass compute_capability "
            f"(--compute-capability, e.g. '9.0' for Hopper, '8.0' for A100) for this device, or run on it "
            f"so it can be read from JAX"
        )
    major, minor = parse_compute_capability(cc)
    text = f"{major}.{minor}"
    if (major, minor) >= devices.FP8_MIN_CAPABILITY:
        return FP8_GPU, text
    if (major, minor) >= devices.PALLAS_MIN_CAPABILITY:
        return BF16_GPU, text
    return LEGACY_GPU, text


# ---- pool sizes ------------------------------------------------------------------------------
def compressor_state_bytes(ratio: int, head_dim: int, overlap: bool) -> int:
    """fp32 kv_state + score_state of one compressor for one sequence: 2 * (c*r) * (c*d) * 4."""
    c = 2 if overlap else 1
    return 2 * (c * ratio) * (c * head_dim) * 4


def pool_bytes(config: DeepseekV4Config, kv_cache_dtype: str, indexer_dtype: str) -> PoolBytes:
    """Bytes per unit of every pool: KV rows 584 (fp8_ds_mla), 2 x or 4 x head_dim (bfloat16,
    float32); indexer keys index_head_dim + 4 (fp8), 2 x or 4 x index_head_dim (bfloat16, float32)."""
    if kv_cache_dtype == FP8_DS_MLA:
        per_token = fp8_ds_mla_bytes_per_token(config.head_dim, config.qk_rope_head_dim)
    elif kv_cache_dtype == FLOAT32:
        per_token = float32_bytes_per_token(config.head_dim)
    else:
        per_token = bf16_bytes_per_token(config.head_dim)
    if indexer_dtype == "fp8":
        indexer = indexer_fp8_bytes_per_entry(config.index_head_dim)
    elif indexer_dtype == FLOAT32:
        indexer = indexer_float32_bytes_per_entry(config.index_head_dim)
    else:
        indexer = indexer_bf16_bytes_per_entry(config.index_head_dim)
    ratios = [config.compress_ratio(i) for i in range(config.num_hidden_layers)]
    hca = [r for r in ratios if r and r != config.csa_compress_ratio]
    hca_ratio = max(hca) if hca else 128
    csa = config.csa_compress_ratio
    return PoolBytes(
        sliding_per_token=per_token,
        csa_per_entry=per_token,
        hca_per_entry=per_token,
        indexer_per_entry=indexer,
        csa_state_per_seq=compressor_state_bytes(csa, config.head_dim, overlap=True),
        csa_indexer_state_per_seq=compressor_state_bytes(csa, config.index_head_dim, overlap=True),
        hca_state_per_seq=compressor_state_bytes(hca_ratio, config.head_dim, overlap=False),
    )


# ---- the policy --------------------------------------------------------------------------------
def _normalise_request(requested: Any) -> str:
    if requested is None:
        return AUTO
    if isinstance(requested, str) and requested.strip().lower() in ACCEPTED_REQUESTS:
        return requested.strip().lower()
    raise ValueError(
        f"--kv-cache-dtype {requested!r} is not supported for DeepSeek-V4; accepted values: "
        f"{', '.join(ACCEPTED_REQUESTS)} (auto picks fp8_ds_mla where the GPU has fp8, else bfloat16; float32 is "
        "the exact reference cache on the xla backend)"
    )


def _normalise_backend(backend: Any) -> str | None:
    if backend is None:
        return None
    if isinstance(backend, str) and backend.strip().lower() in ATTENTION_BACKENDS:
        return backend.strip().lower()
    raise ValueError(
        f"--attention-backend {backend!r} is not a DeepSeek-V4 attention backend; accepted values: "
        f"{', '.join(ATTENTION_BACKENDS)} (or leave it unset to choose by device)"
    )


def _refuse_impossible_backend(device_class: str, backend: str | None, where: str) -> None:
    """ValueError for a Pallas backend the device cannot run at all."""
    if backend not in (PALLAS_FP8_DS_MLA, PALLAS_BF16):
        return
    if device_class == TPU:
        raise ValueError(
            f"--attention-backend {backend} runs Pallas Triton kernels (NVIDIA GPUs) and cannot run on "
            f"{where}; pass --attention-backend xla or leave it unset"
        )
    if device_class == LEGACY_GPU:
        raise ValueError(
            f"--attention-backend {backend} needs compute capability >= 8.0 (Triton bf16/fp8); {where} "
            f"is older; pass --attention-backend xla or leave it unset"
        )
    if device_class == BF16_GPU and backend == PALLAS_FP8_DS_MLA:
        raise ValueError(
            f"--attention-backend pallas_fp8_ds_mla needs fp8 in Triton (compute capability >= 8.9); "
            f"{where} has none; pass --attention-backend pallas_bf16 (bfloat16 KV), or "
            f"--attention-backend xla --kv-cache-dtype fp8 to emulate fp8 slowly"
        )


def _default_backend(device_class: str, request: str, where: str) -> str:
    """The backend the device runs for this request when --attention-backend is unset."""
    if device_class == FP8_GPU:
        return PALLAS_BF16 if request in BF16_REQUESTS else PALLAS_FP8_DS_MLA
    if device_class == BF16_GPU:
        if request in FP8_REQUESTS:
            raise ValueError(
                f"--kv-cache-dtype {request} needs fp8 support (compute capability >= 8.9) and {where} has "
                f"none in Triton; pass --kv-cache-dtype bfloat16 (or auto), or --attention-backend xla "
                f"to emulate fp8 slowly"
            )
        return PALLAS_BF16
    return XLA


def _kv_dtype(device_class: str, request: str, backend: str) -> str:
    """The KV dtype `backend` reads; ValueError when the request asks for the other one."""
    if backend == PALLAS_FP8_DS_MLA:
        if request in BF16_REQUESTS:
            raise ValueError(
                f"--attention-backend pallas_fp8_ds_mla reads only the fp8_ds_mla KV cache, but "
                f"--kv-cache-dtype {request} was given; pass --kv-cache-dtype fp8 (or auto), or "
                f"--attention-backend pallas_bf16 for a bfloat16 cache"
            )
        return FP8_DS_MLA
    if backend == PALLAS_BF16:
        if request in FP8_REQUESTS:
            raise ValueError(
                f"--attention-backend pallas_bf16 reads only a bfloat16 KV cache, but --kv-cache-dtype "
                f"{request} was given; pass --kv-cache-dtype bfloat16 (or auto), or --attention-backend "
                + ("pallas_fp8_ds_mla for fp8_ds_mla" if device_class in (FP8_GPU, CPU) else "xla to emulate fp8")
            )
        return BFLOAT16
    if request in FLOAT32_REQUESTS:
        return FLOAT32
    return FP8_DS_MLA if request in FP8_REQUESTS else BFLOAT16  # XLA: bf16 unless fp8 or float32 was asked for


def _reason(device_class: str, request: str, backend: str, dtype: str, where: str) -> str:
    """The one line saying why this format and backend."""
    if dtype == FLOAT32:
        return (
            f"--kv-cache-dtype {request}: the exact float32 reference cache (nothing rounded, 4 x head_dim bytes "
            f"per token) on {where}, read only by the xla backend"
        )
    if device_class == FP8_GPU and backend == PALLAS_FP8_DS_MLA:
        return f"{where} has fp8 (compute capability >= 8.9), so the KV cache is fp8_ds_mla"
    if device_class == FP8_GPU and backend == PALLAS_BF16 and request in BF16_REQUESTS:
        return (
            f"--kv-cache-dtype {request} asks for bfloat16 on {where}, so the pallas_bf16 backend reads plain bf16 "
            f"rows (about 1.75x the memory of fp8_ds_mla; --kv-cache-dtype auto would pick fp8_ds_mla)"
        )
    if device_class == BF16_GPU and backend == PALLAS_BF16:
        return f"{where} has no fp8 in Triton (compute capability < 8.9), so the KV cache is bfloat16"
    if device_class == CPU:
        return f"CPU: {dtype} KV cache on the {backend} backend" + (
            " (fp8 emulated in XLA ops)" if dtype == FP8_DS_MLA and backend == XLA else ""
        ) + (" (Pallas interpret mode, slow)" if backend != XLA else "")
    if device_class == TPU:
        return f"{where}: the Pallas kernels target NVIDIA GPUs, so {dtype} KV cache on the xla backend" + (
            " (fp8 emulated)" if dtype == FP8_DS_MLA else ""
        )
    return f"{where}: {dtype} KV cache on the {backend} backend" + (
        f" (--kv-cache-dtype {request})" if request != AUTO else " (auto)"
    )


def _warnings(device_class: str, request: str, backend: str, dtype: str, where: str) -> tuple[str, ...]:
    """Warnings for a GPU whose attention runs as plain XLA ops."""
    if device_class == LEGACY_GPU:
        return (
            f"{where} is unsupported for speed (compute capability < 8.0): attention runs on the xla backend "
            f"without Pallas kernels",
        )
    if device_class in (FP8_GPU, BF16_GPU) and backend == XLA:
        cause = f"--kv-cache-dtype {request}" if dtype == FLOAT32 else "--attention-backend xla"
        return (
            f"{cause} on {where} runs attention as plain XLA ops (slow)"
            + ("; fp8_ds_mla is dequantised in XLA" if dtype == FP8_DS_MLA else ""),
        )
    return ()


def _policy(
    device_class: str, request: str, backend: str | None, where: str
) -> tuple[str, str, str, tuple[str, ...]]:
    """(kv dtype, backend, reason, warnings); raises ValueError for impossible combinations.

    This is the table of docs/kv_cache.md (tests/test_kv_resolver.py checks the two agree)."""
    if request in FLOAT32_REQUESTS:
        if backend not in (None, XLA):
            raise ValueError(
                f"--kv-cache-dtype {request} (the exact float32 reference cache) runs only on the xla backend, but "
                f"--attention-backend {backend} was given; pass --attention-backend xla (or leave it unset), or "
                f"--kv-cache-dtype auto (or fp8_ds_mla, bfloat16) for the Pallas kernels"
            )
        backend = XLA
    _refuse_impossible_backend(device_class, backend, where)
    if backend is None:
        backend = _default_backend(device_class, request, where)
    dtype = _kv_dtype(device_class, request, backend)
    return dtype, backend, _reason(device_class, request, backend, dtype, where), _warnings(
        device_class, request, backend, dtype, where
    )


# ---- the model's shapes -------------------------------------------------------------------------
def fp8_ds_mla_layout_problem(config: DeepseekV4Config) -> str | None:
    """Why the fp8_ds_mla layout is undefined for this model, or None. Spec 3.8 / 8.2 quantise the
    NoPE dims in whole blocks of 64, one UE8M0 scale each (the official `act_quant` asserts it),
    and the model's KV rounding (dsv4_jax/model/kv_rounding.py) rounds exactly those blocks; a
    partial block has no reference to match, so no backend stores one."""
    nope = config.nope_head_dim
    if nope % FP8_DS_MLA_QUANT_BLOCK == 0:
        return None
    return (
        f"the fp8_ds_mla layout stores the NoPE dims in blocks of {FP8_DS_MLA_QUANT_BLOCK} with one UE8M0 scale "
        f"each (spec 8.2), but this model has `head_dim` - `qk_rope_head_dim` = {config.head_dim} - "
        f"{config.qk_rope_head_dim} = {nope}"
    )


def kernel_shape_problems(config: DeepseekV4Config, backend: str, device_kind: str) -> tuple[str, ...]:
    """Why `backend`'s Pallas kernels cannot tile this model on `device_kind` (`pallas_kernels.limits`);
    () for the xla backend, which runs every shape the model accepts."""
    if backend == XLA:
        return ()
    has_indexer = CSA in config.layer_types
    shapes = limits.ModelShapes(
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        index_n_heads=config.index_n_heads if has_indexer else None,
        index_head_dim=config.index_head_dim if has_indexer else None,
    )
    return limits.shape_problems(shapes, "fp8_ds_mla" if backend == PALLAS_FP8_DS_MLA else "bf16", device_kind)


def _fit_model(
    config: DeepseekV4Config, chosen: tuple[str, str, str, tuple[str, ...]], request: str,
    explicit_backend: str | None, device_kind: str, where: str,
) -> tuple[str, str, str, tuple[str, ...]]:
    """The device's (kv dtype, backend, reason, warnings) checked against the model's shapes.

    An explicit fp8 request for a model without whole 64-dim NoPE blocks, and an explicit Pallas
    backend whose kernels cannot tile the model, are ValueErrors naming the flag, the config
    field and the way out. A backend the device chose falls back: `auto` on fp8 GPUs to
    pallas_bf16 where those kernels fit, otherwise to the xla backend with the KV dtype asked for
    (`auto`: bfloat16); the reason says why, in the one INFO line the resolution logs."""
    dtype, backend, _, _ = chosen
    layout = fp8_ds_mla_layout_problem(config) if dtype == FP8_DS_MLA else None
    if layout and request in FP8_REQUESTS:
        raise ValueError(
            f"--kv-cache-dtype {request}: {layout}; pass --kv-cache-dtype bfloat16 (or auto, or float32 for the "
            "exact reference cache)"
        )
    # The fp8 kernels' own rules include the layout's (whole 64-dim NoPE blocks).
    problems = kernel_shape_problems(config, backend, device_kind)
    if not problems:
        return chosen
    if explicit_backend is not None:
        raise ValueError(
            f"--attention-backend {explicit_backend} cannot run this model: {'; '.join(problems)}. Pass "
            "--attention-backend xla (the reference path runs every shape the model accepts), or leave it unset"
        )
    refused = {backend: problems}
    if backend == PALLAS_FP8_DS_MLA and request == AUTO:
        bf16_problems = kernel_shape_problems(config, PALLAS_BF16, device_kind)
        if not bf16_problems:
            return BFLOAT16, PALLAS_BF16, (
                f"the pallas_fp8_ds_mla kernels cannot run this model on {where} ({'; '.join(problems)}), so the KV "
                "cache is bfloat16 on pallas_bf16"
            ), ()
        refused[PALLAS_BF16] = bf16_problems
    dtype = dtype if request in FP8_REQUESTS else BFLOAT16
    why = "; ".join(f"{name}: {'; '.join(p)}" for name, p in refused.items())
    return dtype, XLA, (
        f"the Pallas kernels cannot run this model on {where} ({why}), so attention falls back to the xla backend "
        f"with a {dtype} KV cache"
    ), ()


def resolve_kv_cache(
    requested: str | None,
    device_kind: str = "NVIDIA H200",
    compute_capability: str | None = DEFAULT_COMPUTE_CAPABILITY,
    attention_backend: str | None = None,
    config: DeepseekV4Config | str | None = None,
) -> KVCacheSpec:
    """Resolve `--kv-cache-dtype` (and `--attention-backend`) for a device (policy: docs/kv_cache.md).

    Args:
      requested: auto, fp8, fp8_e4m3, fp8_ds_mla, bfloat16, bf16, float32 or fp32 (None means auto;
        float32 always resolves to the xla backend).
      device_kind: `jax.Device.device_kind`, e.g. "NVIDIA H200", "NVIDIA GeForce RTX 5090", "cpu".
      compute_capability: e.g. "9.0". None reads it from our device-kind table or a live JAX device.
        The default equals "9.0" (the default H200's) but is a sentinel: for a kind our table
        knows, the table's value is used (so the default never makes e.g. an A100 an fp8 device);
        for an unknown kind it counts as not given, and with no live device of that kind this is
        a ValueError asking for a compute capability (never a silent Hopper). An explicit value is
        used as given for an unknown kind; for a known kind the table wins when the two disagree
        (with a warning). `resolve_for_device` passes the live device's own value, which wins.
      attention_backend: pallas_fp8_ds_mla, pallas_bf16, xla, or None to choose by device.
      config: model config or preset name; None means DeepSeek-V4-Flash dimensions.
    """
    return _resolve(requested, device_kind, compute_capability, attention_backend, config, trust_capability=False)


def resolve_for_device(
    requested: str | None,
    device: "jax.Device",
    attention_backend: str | None = None,
    config: DeepseekV4Config | str | None = None,
    *,
    log: bool = True,
) -> KVCacheSpec:
    """`resolve_kv_cache` for a live `jax.Device` (kind and compute capability read from it).
    `log=False` for a check made ahead of the resolve that counts (it would log the same lines)."""
    kind = device.device_kind
    cc = getattr(device, "compute_capability", None)
    if device.platform == "cpu":
        kind, cc = "cpu", None
    elif device.platform == "tpu" and not kind.lower().startswith("tpu"):
        kind = f"TPU {kind}"
    return _resolve(
        requested, kind, None if cc is None else str(cc), attention_backend, config, trust_capability=True, log=log
    )


def _resolve(
    requested: Any, device_kind: str, compute_capability: Any, attention_backend: Any, config: Any,
    *, trust_capability: bool, log: bool = True,
) -> KVCacheSpec:
    request = _normalise_request(requested)
    backend = _normalise_backend(attention_backend)
    device_class, cc = classify_device(device_kind, compute_capability, trust_capability=trust_capability)
    kind = device_kind.strip()
    where = f"{kind} (compute capability {cc})" if cc else kind
    explicit_backend = backend
    chosen = _policy(device_class, request, backend, where)
    cfg = get_config("dsv4-flash" if config is None else config)
    dtype, backend, reason, warnings = _fit_model(cfg, chosen, request, explicit_backend, kind, where)
    if dtype == FLOAT32:
        indexer_dtype = FLOAT32  # the exact reference rounds nothing, indexer keys included
    else:
        indexer_dtype = "fp8" if device_class == FP8_GPU or dtype == FP8_DS_MLA else "bfloat16"
    pools = pool_bytes(cfg, dtype, indexer_dtype)
    spec = KVCacheSpec(
        requested=request,
        kv_cache_dtype=dtype,
        attention_backend=backend,
        indexer_dtype=indexer_dtype,
        device_kind=kind,
        device_class=device_class,
        compute_capability=cc,
        bytes_per_token=pools.sliding_per_token,
        pool_bytes=pools,
        reason=reason,
        warnings=warnings,
        head_dim=cfg.head_dim,
        rope_dim=cfg.qk_rope_head_dim,
        index_head_dim=cfg.index_head_dim,
    )
    if not log:
        return spec
    if dtype == FP8_DS_MLA:
        logger.info(FP8_DS_MLA_LOG)
    logger.info("%s", spec.summary())  # once per resolved spec: the start-up line (ends with the reason)
    for message in warnings:
        logger.warning("%s", message)
    return spec
