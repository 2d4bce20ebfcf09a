"""The built-in demo model: `dsv4-tiny` (every V4 feature, the real 129280-token vocabulary,
random weights) written once in DeepSeek's own checkpoint format to a local cache directory."""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_PRESET = "dsv4-tiny"
BUILTIN_SEED = 0


def builtin_model_dir() -> Path:
    """The directory of the built-in checkpoint, written on first use (a few seconds)."""
    root = Path(os.environ.get("DSV4_JAX_CACHE", Path.home() / ".cache" / "dsv4-jax"))
    path = root / f"{BUILTIN_PRESET}-seed{BUILTIN_SEED}"
    if not (path / "config.json").is_file():
        from dsv4_jax.testing import write_random_checkpoint

        partial = path.with_name(path.name + ".partial")
        write_random_checkpoint(partial, BUILTIN_PRESET, seed=BUILTIN_SEED)
        partial.rename(path)  # appears whole or not at all
    return path
