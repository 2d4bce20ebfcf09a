"""The converted-weights cache (`dsv4_jax/weights/converted_cache.py`) and `load_model(load_format=...)`:
on one device in this process, and on a 2 x 2 mesh (tp=2 x dp=2, expert parallel) in one
subprocess with 4 CPU devices (`tests/converted_cache_worker.py`; XLA_FLAGS must be set before jax
is imported)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import dsv4_jax
from conftest import child_xla_flags  # tests/ is on sys.path
from dsv4_jax.weights import converted_cache
from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.weights.loading import default_stack_layers
from dsv4_jax.testing import write_random_checkpoint

WORKER = Path(__file__).with_name("converted_cache_worker.py")


def flat(model) -> dict[str, jax.Array]:
    return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(model.state)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # The checkpoint tests/test_sharding.py loads too (fp8 linears, MXFP4 experts, stacked layers):
    # the same shapes, so the loads here compile nothing new in a full run.
    path = tmp_path_factory.mktemp("weight_cache") / "ckpt"
    return write_random_checkpoint(path, "dsv4-tiny-test", seed=0, quantize="fp8", tokenizer=False)


@pytest.fixture(scope="module")
def loads(checkpoint, tmp_path_factory) -> dict:
    """The checkpoint loaded three ways: safetensors only, auto with no cache (reads, writes the
    cache), orbax (restores it); with the cache directory and the log of each load."""
    cache = tmp_path_factory.mktemp("weights")
    out = {"cache": cache}
    handler = _Records()
    logging.getLogger("dsv4_jax.weights.loading").addHandler(handler)
    logging.getLogger("dsv4_jax.weights.loading").setLevel(logging.INFO)
    try:
        for load_format in ("safetensors", "auto", "orbax"):
            handler.records.clear()
            model = dsv4_jax.load_model(checkpoint, load_format=load_format, weights_cache_dir=cache)
            out[load_format] = (model, [r.getMessage() for r in handler.records])
    finally:
        logging.getLogger("dsv4_jax.weights.loading").removeHandler(handler)
    return out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_restored_state_is_bit_identical_to_the_safetensors_load(loads):
    reference, _ = loads["safetensors"]
    for load_format in ("auto", "orbax"):
        model, _ = loads[load_format]
        assert model.mtp_enabled == reference.mtp_enabled
        expected, got = flat(reference), flat(model)
        assert got.keys() == expected.keys()
        for name, array in got.items():
            want = np.asarray(expected[name])
            assert array.dtype == want.dtype and array.shape == want.shape, name
            assert np.asarray(array).tobytes() == want.tobytes(), name
            # Placed as `jax.device_put(numpy)` places them: uncommitted arrays lower to the same
            # HLO, so a restored model hits the compilation cache entries a loaded one wrote.
            assert array.committed == expected[name].committed, name


def test_each_load_format_logs_the_path_it_took(loads):
    entries = [p for p in loads["cache"].iterdir()]
    assert len(entries) == 1 and (entries[0] / converted_cache.META_FILE).is_file()
    (_, safetensors_log), (_, auto_log), (_, orbax_log) = (loads[f] for f in ("safetensors", "auto", "orbax"))
    assert any("--load-format safetensors" in m for m in safetensors_log), safetensors_log
    assert any(f"wrote the converted-weights cache {entries[0]}" in m for m in auto_log), auto_log
    assert any(f"restored from the converted-weights cache {entries[0]}" in m for m in orbax_log), orbax_log


def key_directory(checkpoint: Path, cache: Path) -> Path:
    return converted_cache.entry_directory(converted_cache.key_fields(checkpoint, "float32", default_stack_layers(DeepseekV4Config.from_json(checkpoint)), None, None), cache)


@pytest.mark.parametrize("change", ["touch a shard", "resize config.json"])
def test_a_changed_checkpoint_is_not_served_from_the_stale_cache(loads, checkpoint, tmp_path, change):
    """A touched file (same size) or a resized one (same mtime) changes the key: no stale restore."""
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)  # copy2 keeps names, sizes and mtimes
    cache = tmp_path / "weights"
    shutil.copytree(loads["cache"] / key_directory(checkpoint, loads["cache"]).name,
                    key_directory(copy, cache))  # the entry as if written for the copy
    dsv4_jax.load_model(copy, load_format="orbax", weights_cache_dir=cache)  # unchanged: served
    if change == "touch a shard":
        shard = min(copy.glob("*.safetensors"))
        stat = shard.stat()
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    else:  # the same config, one byte longer, with its old modification time
        config = copy / "config.json"
        stat = config.stat()
        config.write_text(config.read_text() + "\n")
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ValueError, match="no converted-weights cache"):
        dsv4_jax.load_model(copy, load_format="orbax", weights_cache_dir=cache)


def test_orbax_without_a_cache_says_how_to_write_one(checkpoint, tmp_path):
    expected = key_directory(checkpoint, tmp_path)
    with pytest.raises(ValueError) as error:
        dsv4_jax.load_model(checkpoint, load_format="orbax", weights_cache_dir=tmp_path)
    message = str(error.value)
    assert "--load-format orbax" in message and str(expected) in message and "--load-format auto" in message


def test_an_unknown_load_format_names_the_flag_and_the_choices(checkpoint):
    with pytest.raises(ValueError, match=r"--load-format must be one of auto, safetensors, orbax; got 'pt'"):
        dsv4_jax.load_model(checkpoint, load_format="pt")


def test_a_write_that_fails_midway_leaves_no_entry(tmp_path, monkeypatch):
    """The entry is renamed into place only once complete: a writer stopped before that (here
    at the rename) leaves neither an entry that would restore nor its partial directory."""
    directory = tmp_path / "ckpt-0123"
    arrays = {"w": jax.device_put(np.arange(6, dtype=np.float32))}

    rename = Path.rename

    def killed_at_our_rename(self, target):  # orbax's own renames go through
        if Path(target) == directory:
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_at_our_rename)
    with pytest.raises(KeyboardInterrupt):
        converted_cache.save(directory, arrays, fields={}, mtp_enabled=False, warnings=[])
    assert list(tmp_path.iterdir()) == [] and converted_cache.find(directory) is None


# ---- sharded loading on a 2 x 2 mesh of 4 CPU devices (one subprocess) -----------------------
@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("converted_cache_worker") / "result.json"
    env = dict(os.environ, XLA_FLAGS=child_xla_flags(4), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_sharded_loads_put_every_leaf_in_its_shards(worker):
    assert worker["devices"] == 4 and len(worker["cache_entries"]) == 1
    share = worker["expert_bytes_total"] // 4  # 8 experts over data x tensor: 2 per device
    for label, load in worker["loads"].items():
        assert load["leaves"] > 0
        assert load["wrong_sharding"] == [], label  # exactly param_shardings' NamedShardings
        assert load["wrong_values"] == [], label  # bit-identical to the one-device load
        assert load["expert_bytes"] == {str(d): share for d in range(4)}, label
        assert load["options_mesh_is_the_mesh"] and load["options_expert_parallel"], label


def test_restoring_the_sharded_cache_is_faster_than_the_first_load(worker):
    """The first load reads the files and compiles the sharded buffer writes; the restore reads
    each device's shards straight from the cache and compiles nothing."""
    first, restored = worker["loads"]["first"]["seconds"], worker["loads"]["restored"]["seconds"]
    print(f"2x2 mesh: first load (safetensors, writes the cache) {first:.2f} s, restore {restored:.2f} s")
    assert restored < first, (first, restored)
