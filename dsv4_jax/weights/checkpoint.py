"""DeepSeek-V4 checkpoints: the tensor layout a config implies, name aliases, and the reader.

* `checkpoint_layout(config)` lists every tensor of a DeepSeek checkpoint for that config under
  DeepSeek's own names (spec 7.1; no `model.` prefix), with its safetensors dtype and shape.
* `canonical_name(name)` maps other spellings (a `model.` prefix, the names transformers 5.23
  writes) onto those names through one alias table, `ALIASES`.
* `SafetensorsFile` / `open_checkpoint` parse the safetensors header themselves and view the
  memory-mapped bytes with ml_dtypes dtypes (safetensors 0.8's `safe_open` cannot return
  F8_E4M3 or F8_E8M0 to numpy).
* `load_checkpoint(path, config, put)` validates the files against the layout first (every
  missing, unexpected and mis-shaped tensor in one `ValueError`), decides whether the MTP block
  can be loaded, then hands the tensors to `put(name, array)` one at a time in their device
  representation (`dsv4_jax.model.weight_formats.device_dtype`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import mmap
import re
import struct
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from dsv4_jax.model import weight_formats as wfmt
from dsv4_jax.config import CSA, DeepseekV4Config

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
PROGRESS_DESC = "Loading safetensors checkpoint shards"


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: "BF16", "F32", "F8_E4M3", "F8_E8M0", "I8", "I64"


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------
def _linear(out: dict, name: str, rows: int, cols: int, config: DeepseekV4Config, *, expert: bool = False) -> None:
    """`name.weight` (+ `name.scale`) of a linear [rows, cols] in the checkpoint's format."""
    q = config.quantization
    if q is None:
        out[f"{name}.weight"] = TensorSpec((rows, cols), "BF16")
        return
    scale_dtype = "F8_E8M0" if q.scale_fmt == "ue8m0" else "F32"
    if expert and config.expert_dtype == "fp4":
        out[f"{name}.weight"] = TensorSpec((rows, cols // 2), "I8")
        out[f"{name}.scale"] = TensorSpec((rows, cols // wfmt.MXFP4_BLOCK), "F8_E8M0")
        return
    bo, bi = q.weight_block_size
    out[f"{name}.weight"] = TensorSpec((rows, cols), "F8_E4M3")
    out[f"{name}.scale"] = TensorSpec((math.ceil(rows / bo), math.ceil(cols / bi)), scale_dtype)


def _hc_head(out: dict, prefix: str, c: DeepseekV4Config) -> None:
    out[f"{prefix}hc_head_fn"] = TensorSpec((c.hc_mult, c.hc_mult * c.hidden_size), "F32")
    out[f"{prefix}hc_head_base"] = TensorSpec((c.hc_mult,), "F32")
    out[f"{prefix}hc_head_scale"] = TensorSpec((1,), "F32")


def _compressor(out: dict, prefix: str, c: DeepseekV4Config, ratio: int, overlap: bool, dim: int) -> None:
    width = (2 if overlap else 1) * dim
    out[f"{prefix}wkv.weight"] = TensorSpec((width, c.hidden_size), "BF16")
    out[f"{prefix}wgate.weight"] = TensorSpec((width, c.hidden_size), "BF16")
    out[f"{prefix}ape"] = TensorSpec((ratio, width), "F32")
    out[f"{prefix}norm.weight"] = TensorSpec((dim,), "BF16")


def block_layout(
    config: DeepseekV4Config, prefix: str, ratio: int, layer_type: str, hash_routed: bool
) -> dict[str, TensorSpec]:
    """Tensors of one decoder block (`layers.{L}.` or `mtp.{i}.`)."""
    c, out = config, {}
    d, mix = c.hidden_size, (2 + c.hc_mult) * c.hc_mult
    out[f"{prefix}attn_norm.weight"] = TensorSpec((d,), "BF16")
    out[f"{prefix}ffn_norm.weight"] = TensorSpec((d,), "BF16")
    for site in ("attn", "ffn"):
        out[f"{prefix}hc_{site}_fn"] = TensorSpec((mix, c.hc_mult * d), "F32")
        out[f"{prefix}hc_{site}_base"] = TensorSpec((mix,), "F32")
        out[f"{prefix}hc_{site}_scale"] = TensorSpec((3,), "F32")

    a = f"{prefix}attn."
    heads_dim = c.num_attention_heads * c.head_dim
    _linear(out, f"{a}wq_a", c.q_lora_rank, d, c)
    out[f"{a}q_norm.weight"] = TensorSpec((c.q_lora_rank,), "BF16")
    _linear(out, f"{a}wq_b", heads_dim, c.q_lora_rank, c)
    _linear(out, f"{a}wkv", c.head_dim, d, c)
    out[f"{a}kv_norm.weight"] = TensorSpec((c.head_dim,), "BF16")
    _linear(out, f"{a}wo_a", c.o_groups * c.o_lora_rank, heads_dim // c.o_groups, c)
    _linear(out, f"{a}wo_b", d, c.o_groups * c.o_lora_rank, c)
    out[f"{a}attn_sink"] = TensorSpec((c.num_attention_heads,), "F32")
    if ratio > 0:
        csa = layer_type == CSA
        _compressor(out, f"{a}compressor.", c, ratio, csa, c.head_dim)
        if csa:
            i = f"{a}indexer."
            _linear(out, f"{i}wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, c)
            out[f"{i}weights_proj.weight"] = TensorSpec((c.index_n_heads, d), "BF16")
            _compressor(out, f"{i}compressor.", c, ratio, True, c.index_head_dim)

    f = f"{prefix}ffn."
    out[f"{f}gate.weight"] = TensorSpec((c.n_routed_experts, d), "BF16")
    if hash_routed:
        out[f"{f}gate.tid2eid"] = TensorSpec((c.vocab_size, c.num_experts_per_tok), "I64")
    elif c.topk_method == "noaux_tc":
        out[f"{f}gate.bias"] = TensorSpec((c.n_routed_experts,), "F32")
    if c.n_shared_experts > 0:
        width = c.n_shared_experts * c.moe_intermediate_size
        _linear(out, f"{f}shared_experts.w1", width, d, c)
        _linear(out, f"{f}shared_experts.w2", d, width, c)
        _linear(out, f"{f}shared_experts.w3", width, d, c)
    inter = c.moe_intermediate_size
    for e in range(c.n_routed_experts):
        _linear(out, f"{f}experts.{e}.w1", inter, d, c, expert=True)
        _linear(out, f"{f}experts.{e}.w2", d, inter, c, expert=True)
        _linear(out, f"{f}experts.{e}.w3", inter, d, c, expert=True)
    return out


def mtp_layout(config: DeepseekV4Config, index: int) -> dict[str, TensorSpec]:
    """Tensors of MTP block `mtp.{index}.`: a sliding, top-k routed block plus its own heads."""
    c, p = config, f"mtp.{index}."
    out = block_layout(c, p, 0, "sliding", hash_routed=False)
    _linear(out, f"{p}e_proj", c.hidden_size, c.hidden_size, c)
    _linear(out, f"{p}h_proj", c.hidden_size, c.hidden_size, c)
    for norm in ("enorm", "hnorm", "norm"):
        out[f"{p}{norm}.weight"] = TensorSpec((c.hidden_size,), "BF16")
    _hc_head(out, p, c)
    return out


def checkpoint_layout(config: DeepseekV4Config, include_mtp: bool = True) -> dict[str, TensorSpec]:
    """Every tensor a DeepSeek checkpoint for `config` holds: canonical name -> TensorSpec."""
    c, out = config, {}
    out["embed.weight"] = TensorSpec((c.vocab_size, c.hidden_size), "BF16")
    out["head.weight"] = TensorSpec((c.vocab_size, c.hidden_size), "BF16")
    out["norm.weight"] = TensorSpec((c.hidden_size,), "BF16")
    _hc_head(out, "", c)
    for layer in range(c.num_hidden_layers):
        out.update(
            block_layout(c, f"layers.{layer}.", c.compress_ratio(layer), c.layer_type(layer), c.is_hash_layer(layer))
        )
    if include_mtp:
        for i in range(c.num_nextn_predict_layers):
            out.update(mtp_layout(c, i))
    return out


# ---------------------------------------------------------------------------------------------
# Aliases
# ---------------------------------------------------------------------------------------------
# Other spellings -> DeepSeek's names, applied in order after a leading `model.` is removed.
# transformers 5.23 `save_pretrained` writes DeepSeek's names under `model.` (and `head.weight`
# at top level), except for these inexact reverse renamings; vLLM's `lm_head.weight` is accepted too.
ALIASES: tuple[tuple[str, str], ...] = (
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^((?:mtp\.\d+\.)?)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight"),
)
_ALIASES = tuple((re.compile(p), r) for p, r in ALIASES)


def canonical_name(name: str) -> str:
    """A tensor name as some writer spelled it -> DeepSeek's canonical checkpoint name."""
    if name.startswith("model."):
        name = name[len("model."):]
    for pattern, replacement in _ALIASES:
        name, n = pattern.subn(replacement, name)
        if n:
            break
    return name


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------
class TensorInfo(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


_MAX_HEADER = 512 * 1024 * 1024


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly, data memory-mapped on first read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(
                    f"{self.path}: truncated or corrupt safetensors file: header length {n} bytes, but the file "
                    f"is {size} bytes"
                )
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: corrupt safetensors header (a JSON object is expected)")
        self.metadata: dict[str, str] | None = header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {
            name: self._entry(name, entry, size - self.data_start) for name, entry in header.items()
        }
        self._mmap: mmap.mmap | None = None

    def _entry(self, name: str, entry: Any, data_len: int) -> TensorInfo:
        """One header entry, checked against the data section the file really has."""
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(
                f"{self.path}: corrupt safetensors header entry for {name!r}: {entry!r} "
                "(expected dtype, shape and data_offsets [begin, end])"
            ) from None
        itemsize = wfmt.FILE_DTYPES[dtype].itemsize if dtype in wfmt.FILE_DTYPES else None
        if end > data_len and 0 <= begin <= end:
            raise ValueError(
                f"{self.path}: truncated file: tensor {name!r} ({dtype} {list(shape)}) has bad data offsets "
                f"[{begin}, {end}) but the data section holds only {data_len} bytes (the file is "
                f"{self.data_start + data_len} bytes, its header needs at least {self.data_start + end}); "
                "copy or download this file again"
            )
        if not 0 <= begin <= end or (itemsize is not None and end - begin != math.prod(shape) * itemsize):
            raise ValueError(
                f"{self.path}: tensor {name!r} ({dtype} {list(shape)}) has bad data offsets "
                f"[{begin}, {end}) for a data section of {data_len} bytes"
            )
        return TensorInfo(dtype, shape, begin, end)

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.tensors)} tensors)"

    def read(self, name: str) -> np.ndarray:
        """The tensor's bytes viewed with its file dtype (read-only, memory-mapped, no copy)."""
        info = self.tensors[name]
        dtype = wfmt.file_dtype(info.dtype)
        count = math.prod(info.shape)
        if count == 0:
            return np.empty(info.shape, dtype)
        if self._mmap is None:
            with open(self.path, "rb") as f:
                # Views keep the mapping alive; it is unmapped when the last one is gone.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        arr = np.frombuffer(self._mmap, dtype=dtype, count=count, offset=self.data_start + info.begin)
        return arr.reshape(info.shape)

    def release(self) -> None:
        """Drop this file's mapping (arrays already read keep it alive until they are freed)."""
        self._mmap = None


class Checkpoint:
    """The safetensors files of one checkpoint and where each tensor (raw name) lives."""

    def __init__(self, files: list[SafetensorsFile], weight_map: dict[str, SafetensorsFile], root: Path):
        self.files, self.weight_map, self.root = files, weight_map, root

    def names(self) -> list[str]:
        return list(self.weight_map)

    def info(self, name: str) -> TensorInfo:
        return self.weight_map[name].tensors[name]

    def read(self, name: str) -> np.ndarray:
        return self.weight_map[name].read(name)

    def release(self) -> None:
        for f in self.files:
            f.release()


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A directory with `model.safetensors.index.json` + shards, or with one or several
    `*.safetensors` files and no index, or a single `.safetensors` file, or an index file."""
    path = Path(path)
    if path.is_dir() and (path / INDEX_FILE).is_file():
        return _open_indexed(path / INDEX_FILE)
    if path.is_file() and path.name.endswith(".index.json"):
        return _open_indexed(path)
    if path.is_file():
        paths, root = [path], path.parent
    elif path.is_dir():
        paths, root = sorted(path.glob("*.safetensors")), path
        if not paths:
            raise FileNotFoundError(f"no *.safetensors files and no {INDEX_FILE} in {path}")
    else:
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    files = [SafetensorsFile(p) for p in paths]
    weight_map: dict[str, SafetensorsFile] = {}
    for f in files:
        for name in f.tensors:
            if name in weight_map:
                raise ValueError(f"tensor {name!r} is stored twice: in {weight_map[name].path.name} and {f.path.name}")
            weight_map[name] = f
    return Checkpoint(files, weight_map, root)


def _open_indexed(index_path: Path) -> Checkpoint:
    root = index_path.parent
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index_path}: invalid JSON ({e})") from None
    mapping = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ValueError(
            f"{index_path}: needs a `weight_map` object from tensor names to shard file names, "
            f"got {type(mapping).__name__}"
        )
    shard_names = sorted(set(mapping.values()))
    absent = [s for s in shard_names if not (root / s).is_file()]
    if absent:
        raise FileNotFoundError(f"{index_path.name} lists shards that do not exist in {root}: {absent}")
    files = {s: SafetensorsFile(root / s) for s in shard_names}
    weight_map: dict[str, SafetensorsFile] = {}
    not_in_shard = []
    for name, shard in mapping.items():
        if name not in files[shard].tensors:
            not_in_shard.append(f"{name} (index says {shard})")
        weight_map[name] = files[shard]
    if not_in_shard:
        raise ValueError(f"{index_path.name} names tensors its shards do not hold: {not_in_shard[:20]}")
    # Tensors a shard holds but the index forgot are still part of the checkpoint.
    for shard, f in files.items():
        for name in f.tensors:
            weight_map.setdefault(name, f)
    return Checkpoint(list(files.values()), weight_map, root)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
# (expected, stored) dtype pairs accepted besides exact matches: transformers saves F32 for
# everything; Base checkpoints store F32 scales; int32 index tables are fine.
ACCEPTED_DTYPES = frozenset({("BF16", "F32"), ("F8_E8M0", "F32"), ("I64", "I32")})


@dataclasses.dataclass
class LoadReport:
    path: Path
    shards: list[Path]
    loaded: list[str]  # canonical names handed to `put`, in order
    skipped: list[str]  # canonical names present in the files but not loaded (e.g. foreign mtp.*)
    mtp_enabled: bool
    num_bytes: int  # bytes handed to `put` (device representation)
    file_dtypes: dict[str, str]  # canonical name -> dtype as stored
    warnings: list[str]


@dataclasses.dataclass
class CheckpointPlan:
    """A validated checkpoint: what `load_checkpoint` will hand to `put`, and what it skips."""

    checkpoint: Checkpoint
    raw_of: dict[str, str]  # canonical -> raw name
    load: list[str]
    skipped: list[str]
    mtp_enabled: bool
    warnings: list[str]


def _summary(names: list[str], limit: int = 25) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def _fmt(spec: TensorSpec | TensorInfo) -> str:
    return f"{spec.dtype}{list(spec.shape)}"


def _mtp_decision(
    present_mtp: list[str], expected_mtp: list[str], config: DeepseekV4Config, mtp: bool
) -> tuple[bool, list[str], list[str]]:
    """(load MTP?, mtp.* names to skip, warnings). MTP loads only when the file's `mtp.*` names are
    exactly the V4 MTP block's; none at all, or foreign ones (DSpark draft stages), disable it."""
    if not present_mtp:
        if expected_mtp and mtp:
            return False, [], [
                f"checkpoint has no mtp.* tensors although the config declares "
                f"{config.num_nextn_predict_layers} MTP layer(s): loading with MTP disabled"
            ]
        return False, [], []
    if not mtp:
        return False, present_mtp, []
    if not expected_mtp:
        return False, present_mtp, [
            f"config declares no MTP layer: skipping the checkpoint's {len(present_mtp)} mtp.* tensors"
        ]
    present = set(present_mtp)
    if present != set(expected_mtp):
        extra = sorted(present - set(expected_mtp))
        absent = [n for n in expected_mtp if n not in present]
        return False, present_mtp, [
            "the checkpoint's mtp.* tensors are not the DeepSeek-V4 MTP block (e.g. DSpark draft stages): "
            f"{len(extra)} unexpected ({_summary(extra, 5)}), {len(absent)} missing ({_summary(absent, 5)}); "
            f"loading with MTP disabled and skipping {len(present_mtp)} mtp.* tensors"
        ]
    return True, [], []


def _mismatches(ckpt: Checkpoint, raw_of: dict[str, str], expected: dict[str, TensorSpec]) -> list[str]:
    """One line per tensor whose stored shape or dtype the config does not allow, naming its file."""
    out = []
    for name, spec in expected.items():
        if name not in raw_of:
            continue
        info = ckpt.info(raw_of[name])
        dtype_ok = info.dtype == spec.dtype or (spec.dtype, info.dtype) in ACCEPTED_DTYPES
        if tuple(info.shape) != tuple(spec.shape) or not dtype_ok:
            label = name if raw_of[name] == name else f"{name} (stored as {raw_of[name]!r})"
            shard = ckpt.weight_map[raw_of[name]].path.name
            out.append(f"{label}: checkpoint has {_fmt(info)}, config expects {_fmt(spec)} (in {shard})")
    return out


def plan_checkpoint(path: str | Path, config: DeepseekV4Config, *, mtp: bool = True) -> CheckpointPlan:
    """Open and validate a checkpoint against `checkpoint_layout(config)` without reading data.

    Raises one ValueError naming every missing, unexpected, mis-shaped/mis-typed and duplicated
    tensor. Decides MTP: loaded only when the file's `mtp.*` names are exactly the V4 MTP block's;
    no `mtp.*` at all, or foreign ones (DSpark draft stages), disable it with a warning."""
    ckpt = open_checkpoint(path)
    raw_of: dict[str, str] = {}
    duplicates = []
    for raw in ckpt.names():
        name = canonical_name(raw)
        if name in raw_of:
            duplicates.append(f"{name} (as {raw_of[name]!r} and {raw!r})")
        else:
            raw_of[name] = raw
    expected = checkpoint_layout(config, include_mtp=True)
    mtp_enabled, skipped, warnings = _mtp_decision(
        [n for n in raw_of if n.startswith("mtp.")], [n for n in expected if n.startswith("mtp.")], config, mtp
    )
    if not mtp_enabled:
        expected = {n: s for n, s in expected.items() if not n.startswith("mtp.")}
    skip = set(skipped)

    missing = [n for n in expected if n not in raw_of]
    unexpected = sorted(n for n in raw_of if n not in expected and n not in skip)
    mismatched = _mismatches(ckpt, raw_of, expected)
    if missing or unexpected or mismatched or duplicates:
        parts = [f"checkpoint {path} does not match the config:"]
        if missing:
            parts.append(f"{len(missing)} missing tensor(s): {_summary(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s): {_summary(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} tensor(s) with the wrong shape or dtype: " + "; ".join(mismatched[:25])
                         + (f"; ... and {len(mismatched) - 25} more" if len(mismatched) > 25 else ""))
        if duplicates:
            parts.append(f"{len(duplicates)} tensor(s) stored under two names: {_summary(duplicates)}")
        q = f"a quantized (fp8, {config.expert_dtype} experts)" if config.quantized else "an unquantized (bf16)"
        parts.append(f"(the config describes {q} checkpoint)")
        raise ValueError("\n  ".join(parts))
    return CheckpointPlan(ckpt, raw_of, list(expected), skipped, mtp_enabled, warnings)


class _Progress:
    """`Loading safetensors checkpoint shards: k/N` via tqdm, or log lines where tqdm is absent."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.count, self.bar = total, 0, None
        self.enabled = enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            self.bar = tqdm(
                total=total, desc=PROGRESS_DESC, unit="shard",
                bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}]",
            )

    def step(self) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            logger.info("%s: %d/%d", PROGRESS_DESC, self.count, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def iter_checkpoint(
    plan: CheckpointPlan, copy: bool = True
) -> Iterator[tuple[SafetensorsFile, Iterator[tuple[str, np.ndarray, str]]]]:
    """Per shard (in file order), a lazy stream of (canonical name, device array, stored dtype).

    Arrays are copies (own, aligned, writeable memory) unless `copy` is False, in which case
    they may be read-only views of the memory-mapped file."""
    by_file: dict[Path, list[str]] = {}
    for name in plan.load:
        by_file.setdefault(plan.checkpoint.weight_map[plan.raw_of[name]].path, []).append(name)
    for f in plan.checkpoint.files:
        names = by_file.get(f.path)
        if not names:
            continue
        names.sort(key=lambda n: f.tensors[plan.raw_of[n]].begin)  # sequential reads

        def tensors(f=f, names=names) -> Iterator[tuple[str, np.ndarray, str]]:
            for name in names:
                raw = plan.raw_of[name]
                dtype = f.tensors[raw].dtype
                arr = wfmt.to_device_representation(f.read(raw), dtype)
                if copy and not arr.flags.owndata:
                    arr = np.array(arr, copy=True)  # own, aligned, writeable; the mapping can go
                yield name, arr, dtype

        yield f, tensors()
        f.release()


def load_checkpoint(
    path: str | Path,
    config: DeepseekV4Config | None,
    put: Callable[[str, np.ndarray], Any],
    *,
    mtp: bool = True,
    progress: bool = True,
) -> LoadReport:
    """Validate the checkpoint at `path` against `config`, then `put(name, array)` each tensor.

    `config` None reads `path/config.json`. Names are canonical (`checkpoint_layout`); arrays are
    numpy in the device representation (`dsv4_jax.model.weight_formats.device_dtype` of the *stored* dtype:
    a transformers checkpoint gives float32 where DeepSeek stores bf16, a Base checkpoint float32
    scales). `mtp=False` skips the MTP block. Raises one ValueError listing every missing,
    unexpected and mis-shaped/mis-typed tensor before `put` is ever called."""
    path = Path(path)
    if config is None:
        config = DeepseekV4Config.from_json(path if path.is_dir() else path.parent)
    elif not isinstance(config, DeepseekV4Config):
        from dsv4_jax.presets import get_config

        config = get_config(config)
    plan = plan_checkpoint(path, config, mtp=mtp)
    for w in plan.warnings:
        logger.warning(w)
    n_shards = len({plan.checkpoint.weight_map[plan.raw_of[n]].path for n in plan.load})
    report = LoadReport(
        path=path, shards=[f.path for f in plan.checkpoint.files], loaded=[], skipped=list(plan.skipped),
        mtp_enabled=plan.mtp_enabled, num_bytes=0, file_dtypes={}, warnings=list(plan.warnings),
    )
    bar = _Progress(n_shards, progress)
    try:
        for _, tensors in iter_checkpoint(plan):
            for name, arr, dtype in tensors:
                put(name, arr)
                report.loaded.append(name)
                report.file_dtypes[name] = dtype
                report.num_bytes += arr.nbytes
            bar.step()
    finally:
        bar.close()
        plan.checkpoint.release()
    return report
