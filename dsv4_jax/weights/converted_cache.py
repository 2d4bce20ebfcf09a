"""The converted-weights cache: a loaded model state saved with orbax-checkpoint, restored on the
next start straight into the shardings the model runs with (no host copy of the whole model, no
safetensors parsing, no layer stacking, no dtype conversion).

A cache entry is the directory `root / key` (root: `cache_root()/weights` by default), holding
`state/` (the orbax checkpoint of every leaf, by dotted leaf name) and `meta.json` (the key's
fields, each leaf's shape and dtype, and the checkpoint's report data that `load_model` needs).
The key hashes everything the saved arrays depend on: the checkpoint directory's files (names,
sizes, modification times, config.json included) and its resolved path, the compute dtype,
`stack_layers`, the jax platform, the mesh's shape and axis names, the ParallelConfig and
`FORMAT_VERSION`; a changed checkpoint therefore gets a new key and is never served from a stale
entry. An entry is written into a partial directory of its writer's own (`dsv4_jax.weights.partial_dirs`)
and renamed into place once complete, so a killed writer never leaves an entry that restores; the
next writer of that entry removes what a killed one left.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dsv4_jax.weights.builtin import cache_root
from dsv4_jax.weights.partial_dirs import partial_for, publish

if TYPE_CHECKING:
    from jax.sharding import Mesh, Sharding

    from dsv4_jax.parallel.sharding import ParallelConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3  # bump when the saved layout or meta.json changes: old entries stop matching
LOAD_FORMATS = ("auto", "safetensors", "orbax")
META_FILE = "meta.json"
STATE_DIR = "state"
FREE_SPACE_MARGIN = 1.1  # an entry is written only where the disk has this much more than its size


def check_load_format(load_format: str) -> str:
    """`load_format` if it is one of LOAD_FORMATS, else a ValueError naming `--load-format`."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    return load_format


WEIGHTS_CACHE_ENV = "DSV4_JAX_WEIGHTS_CACHE"


def default_root() -> Path:
    """Where cache entries live unless `weights_cache_dir` says otherwise: $DSV4_JAX_WEIGHTS_CACHE,
    else `cache_root()/weights`."""
    return Path(os.environ[WEIGHTS_CACHE_ENV]) if os.environ.get(WEIGHTS_CACHE_ENV) else cache_root() / "weights"


def key_fields(
    checkpoint: Path, dtype: str, stack_layers: bool, mesh: Mesh | None, parallel: ParallelConfig | None
) -> dict[str, Any]:
    """Everything a saved state depends on, as JSON-able values (hashed into the entry's name)."""
    files = sorted(p for p in checkpoint.iterdir() if p.is_file())
    stats = [(p.name, p.stat()) for p in files]
    return {
        "format_version": FORMAT_VERSION,
        "checkpoint": str(checkpoint.resolve()),
        "files": [[name, st.st_size, st.st_mtime_ns] for name, st in stats],
        "dtype": dtype,
        "stack_layers": stack_layers,
        "platform": jax.default_backend(),
        "mesh": None if mesh is None else {"axis_names": list(mesh.axis_names), "shape": list(mesh.devices.shape)},
        "parallel": None if parallel is None else dataclasses.asdict(parallel),
    }


def entry_directory(fields: Mapping[str, Any], root: str | Path | None = None) -> Path:
    """`root / <checkpoint directory name>-<hash of fields>`: readable, and unique per key."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]
    return Path(default_root() if root is None else root) / f"{Path(fields['checkpoint']).name}-{digest}"


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """A complete cache entry: where it is and what `meta.json` says about it."""

    directory: Path
    mtp_enabled: bool
    warnings: list[str]  # the checkpoint's load warnings, logged again on every restore
    leaves: dict[str, tuple[tuple[int, ...], str]]  # dotted leaf name -> (shape, dtype name)


def find(directory: Path) -> CacheEntry | None:
    """The entry at `directory`, or None where there is none. An entry is complete once it has
    its name (see `save`), and that name hashes the format version too."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    leaves = {name: (tuple(shape), dtype) for name, (shape, dtype) in meta["leaves"].items()}
    return CacheEntry(directory, meta["mtp_enabled"], meta["warnings"], leaves)


def restore(entry: CacheEntry, shardings: Mapping[str, Sharding]) -> dict[str, jax.Array]:
    """Every leaf of `entry`, read by orbax straight into `shardings[name]` (each device reads
    only its own shards)."""
    import orbax.checkpoint as ocp

    if set(shardings) != set(entry.leaves):
        raise RuntimeError(  # the key covers everything the leaf set depends on: a bug, not bad input
            f"cache entry {entry.directory} holds leaves that the model does not have, or lacks some: "
            f"{sorted(set(shardings) ^ set(entry.leaves))[:5]}"
        )
    target = {
        name: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=shardings[name])
        for name, (shape, dtype) in entry.leaves.items()
    }
    restore_args = {name: ocp.ArrayRestoreArgs(sharding=shardings[name]) for name in target}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        return checkpointer.restore(
            (entry.directory / STATE_DIR).resolve(), args=ocp.args.PyTreeRestore(target, restore_args=restore_args)
        )


def save(
    directory: Path, arrays: Mapping[str, jax.Array], *, fields: Mapping[str, Any], mtp_enabled: bool,
    warnings: list[str],
) -> bool:
    """Write `arrays` (dotted leaf name -> array, sharded or not) as the entry `directory`.

    Returns whether an entry was written. Nothing is written where the disk lacks the space (a
    warning says so: the cache only saves time), and a failed write leaves no entry behind."""
    import orbax.checkpoint as ocp

    # The free space is counted once partial_for has removed killed writers' folders (they hold some).
    with partial_for(directory) as partial:
        size = sum(a.nbytes for a in arrays.values())
        free = shutil.disk_usage(directory.parent).free
        if size * FREE_SPACE_MARGIN > free:
            shutil.rmtree(partial, ignore_errors=True)
            logger.warning(
                "not writing the converted-weights cache %s: it needs %.1f GiB but %s has %.1f GiB free",
                directory, size / 2**30, directory.parent, free / 2**30,
            )
            return False
        try:
            # Uncompressed: weights (random or trained, fp8 and fp4 above all) barely compress, and
            # zstd on save and restore made the cache slower than the safetensors it replaces.
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as checkpointer:
                checkpointer.save((partial / STATE_DIR).resolve(), args=ocp.args.PyTreeSave(dict(arrays)))
            meta = {
                "key": dict(fields),
                "mtp_enabled": mtp_enabled,
                "warnings": warnings,
                "leaves": {name: [list(a.shape), np.dtype(a.dtype).name] for name, a in arrays.items()},
            }
            (partial / META_FILE).write_text(json.dumps(meta, indent=1))
            publish(partial, directory)  # atomic: the entry appears complete or not at all
        except OSError as error:  # a full disk, or another process renamed the same entry in first
            shutil.rmtree(partial, ignore_errors=True)
            if find(directory) is not None:
                return True
            logger.warning("could not write the converted-weights cache %s: %s", directory, error)
            return False
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return True
