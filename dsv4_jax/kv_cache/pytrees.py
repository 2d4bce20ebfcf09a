"""`pytree_dataclass`: a frozen dataclass registered as a JAX pytree whose fields are all children
(the cache's planes and pools, compressor rows, a step's per-row arrays)."""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])
