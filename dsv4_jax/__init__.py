"""dsv4-jax: DeepSeek-V4 in JAX.

Public API: `load_model`, `DeepseekV4Config`, `LLM` and `SamplingParams` (the engine), and the `testing` module
(`write_random_checkpoint`). Submodules load lazily so that importing the package touches no
device (`jax.distributed.initialize` can run first) and pulls in nothing optional.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["load_model", "DeepseekV4Config", "LLM", "SamplingParams", "testing"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from dsv4_jax.weights.loading import load_model

        return load_model
    if name == "LLM":
        from dsv4_jax.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsv4_jax.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "DeepseekV4Config":
        from dsv4_jax.config import DeepseekV4Config

        return DeepseekV4Config
    if name in ("testing", "kv_cache", "chat", "config", "presets", "weights", "model", "parallel", "engine"):
        return importlib.import_module(f"dsv4_jax.{name}")
    raise AttributeError(f"module 'dsv4_jax' has no attribute {name!r}")
