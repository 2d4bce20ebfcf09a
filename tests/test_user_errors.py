"""A user's mistake gets one clear error: bad model directories (ValueError / FileNotFoundError
naming the file, and for config problems the field, the value found and what is allowed), and
the command-line entry points (one line on stderr, exit status 2, the traceback only on request).

Every bad directory is a copy of one small random checkpoint with one thing broken; each fails
before any tensor reaches the device, so these tests compile nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax import demo, plan
from dsv4_jax.weights.builtin import BUILTIN_PRESET, builtin_model_dir, checkpoint_bytes
from dsv4_jax.weights.checkpoint import INDEX_FILE
from dsv4_jax.kv_cache.planner import MeshShape, estimate_weight_bytes_per_device, nominal_device_memory, plan_capacity
from dsv4_jax.kv_cache.resolver import resolve_kv_cache
from dsv4_jax.presets import get_config
from dsv4_jax.testing import write_random_checkpoint

REPO = Path(__file__).resolve().parents[1]
TINY = "dsv4-tiny-test"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", TINY, seed=0)


@pytest.fixture
def model_dir(tmp_path, tiny_checkpoint) -> Path:
    """A fresh copy of the tiny checkpoint for one test to break."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))


_DELETE = object()


def _edit_config(model_dir: Path, **changes) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del raw[key]
        else:
            raw[key] = value
    (model_dir / "config.json").write_text(json.dumps(raw))


def _load_error(path: Path, kind: type[Exception] = ValueError) -> str:
    with pytest.raises(kind) as err:
        dsv4_jax.load_model(path)
    return str(err.value)


# ---- model directories ------------------------------------------------------------------------
def test_missing_directory(tmp_path):
    message = _load_error(tmp_path / "nowhere", FileNotFoundError)
    assert str(tmp_path / "nowhere") in message and "does not exist" in message


def test_missing_config_json(model_dir):
    (model_dir / "config.json").unlink()
    message = _load_error(model_dir, FileNotFoundError)
    assert str(model_dir) in message and "no config.json" in message


def test_invalid_json_names_the_file_and_line(model_dir):
    text = (model_dir / "config.json").read_text()
    (model_dir / "config.json").write_text(text.replace('"hidden_size":', '"hidden_size" 1,', 1))
    line = 1 + text[: text.index('"hidden_size":')].count("\n")
    message = _load_error(model_dir)
    assert str(model_dir / "config.json") in message
    assert "invalid JSON" in message and f"line {line} " in message


@pytest.mark.parametrize(
    "field, value, found, allowed",
    [
        ("hidden_size", "abc", '"abc" (a string)', "an integer"),
        ("num_hidden_layers", True, "true (a boolean)", "an integer"),
        ("rope_theta", [1], "[1] (a list)", "a number"),
        ("n_routed_experts", -3, "-3", "positive"),
        ("num_nextn_predict_layers", -1, "-1", ">= 0"),
        ("eos_token_id", 10**6, "1000000", "[0, vocab_size=512)"),
        ("model_type", "deepseek_v3", '"deepseek_v3"', "'deepseek_v4'"),
    ],
)
def test_bad_config_field_names_file_field_value_and_allowed(model_dir, field, value, found, allowed):
    _edit_config(model_dir, **{field: value})
    message = _load_error(model_dir)
    assert str(model_dir / "config.json") in message
    assert f"`{field}`" in message and found in message and allowed in message


def test_missing_required_field(model_dir):
    _edit_config(model_dir, hidden_size=_DELETE)
    message = _load_error(model_dir)
    assert str(model_dir / "config.json") in message
    assert "missing required field" in message and "`hidden_size`" in message and "integer" in message


def test_index_naming_an_absent_shard(model_dir):
    shards = sorted(model_dir.glob("*.safetensors"))
    assert len(shards) >= 2  # the fixture is sharded: the index is what names the files
    shards[-1].unlink()
    message = _load_error(model_dir, FileNotFoundError)
    assert INDEX_FILE in message and shards[-1].name in message


def test_no_safetensors_at_all(model_dir):
    for f in [*model_dir.glob("*.safetensors"), model_dir / INDEX_FILE]:
        f.unlink()
    message = _load_error(model_dir, FileNotFoundError)
    assert str(model_dir) in message and "no *.safetensors" in message


def test_truncated_shard(model_dir):
    shard = sorted(model_dir.glob("*.safetensors"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1000)
    message = _load_error(model_dir)
    assert str(shard) in message and "truncated" in message
    assert f"the file is {size - 1000} bytes" in message


def test_tensors_of_the_wrong_shape_or_dtype(model_dir):
    from safetensors.numpy import load_file, save_file

    index = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
    edits = {  # (name, new value)
        "norm.weight": np.zeros((7,), ml_dtypes.bfloat16),  # config: BF16[64]
        "layers.0.hc_attn_fn": None,  # F32 in the config; stored as BF16 below
    }
    for name in edits:
        shard = model_dir / index[name]
        tensors = load_file(shard)
        value = edits[name]
        tensors[name] = value if value is not None else tensors[name].astype(ml_dtypes.bfloat16)
        save_file(tensors, shard)
    hidden = get_config(TINY).hidden_size
    message = _load_error(model_dir)
    assert f"norm.weight: checkpoint has BF16[7], config expects BF16[{hidden}] (in {index['norm.weight']})" in message
    assert "layers.0.hc_attn_fn: checkpoint has BF16[" in message
    assert "config expects F32[" in message and index["layers.0.hc_attn_fn"] in message


# ---- files the package writes -----------------------------------------------------------------
def test_written_checkpoint_files_follow_the_umask(tiny_checkpoint):
    umask = os.umask(0)
    os.umask(umask)
    for f in tiny_checkpoint.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name


def test_checkpoint_bytes_is_the_size_on_disk(tiny_checkpoint):
    on_disk = sum(f.stat().st_size for f in tiny_checkpoint.iterdir())
    # Disk adds the safetensors headers and the small JSON files: well under 1% here.
    assert 0.99 * on_disk < checkpoint_bytes(get_config(TINY)) <= on_disk


def test_builtin_model_says_where_and_how_big_before_writing(tmp_path, monkeypatch, caplog):
    from dsv4_jax.weights import random_checkpoint

    seen_before_writing = []

    def fake_write(path, config, seed):
        seen_before_writing.extend(r.getMessage() for r in caplog.records)
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")

    monkeypatch.setenv("DSV4_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(random_checkpoint, "write_random_checkpoint", fake_write)
    with caplog.at_level(logging.INFO, logger="dsv4_jax.weights.builtin"):
        path = builtin_model_dir()
        assert len(seen_before_writing) == 1
        builtin_model_dir()  # already there: written once, said once
    assert len(caplog.records) == 1
    mebibytes = checkpoint_bytes(get_config(BUILTIN_PRESET)) / 2**20
    assert str(path) in seen_before_writing[0] and f"{mebibytes:.0f} MiB" in seen_before_writing[0]


def test_checkpoints_written_at_once_by_several_processes_appear_whole(tmp_path, monkeypatch):
    """A server and a benchmark started together both write the built-in model the first time (seen
    on the GPU machine: the second rename of a shared `.partial` directory failed and the server
    exited). Each writer now has its own directory; the first rename wins, the rest are dropped."""
    import threading

    from dsv4_jax.weights.builtin import cached_checkpoint

    monkeypatch.setenv("DSV4_JAX_CACHE", str(tmp_path))
    all_writing = threading.Barrier(4)

    def write(directory: Path) -> None:
        (directory / "weights.bin").write_bytes(threading.current_thread().name.encode() * 1000)
        all_writing.wait(timeout=30)  # every writer is half-way before any finishes
        (directory / "config.json").write_text(threading.current_thread().name)

    results, errors = {}, []

    def worker() -> None:
        try:
            results[threading.current_thread().name] = cached_checkpoint("model", write)
        except Exception as exc:  # noqa: BLE001 - the test reports any failure of any writer
            errors.append(exc)

    threads = [threading.Thread(target=worker, name=f"writer{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert set(results.values()) == {tmp_path / "model"}
    winner = (tmp_path / "model" / "config.json").read_text()
    assert (tmp_path / "model" / "weights.bin").read_bytes() == winner.encode() * 1000  # one writer's files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no partial directory left
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "model").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700: a cache others share



def test_a_sweep_just_before_a_writer_locks_its_folder_keeps_the_folder(tmp_path, monkeypatch):
    """Another writer's sweep right before this writer takes its lock (four threads make it
    likely): a lock file that already has its name but no lock yet must not look like a dead
    writer's, or the folder is removed under its writer."""
    import fcntl

    from dsv4_jax.weights import partial_dirs

    entry, real_flock, swept = tmp_path / "model", fcntl.flock, []

    def flock(fd, operation):
        if operation == fcntl.LOCK_EX and not swept:  # this writer's own lock, about to be taken
            swept.append(partial_dirs.remove_stale_partials(entry))
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    with partial_dirs.partial_for(entry) as partial:
        assert swept == [[]] and partial.is_dir()
        (partial / "config.json").write_text("{}")


def test_a_killed_writers_partial_folder_is_removed_by_the_next_writer(tmp_path, monkeypatch, caplog):
    """A writer killed mid-write (SIGKILL, the OOM killer) leaves its partial folder; a converted
    V4-Flash entry is ~150 GB of it. The next writer of the entry removes the folders whose
    writer's lock it can take, and lock-less ones untouched for an hour (older versions' folders),
    and only those: not a folder whose lock is held (a live writer, whatever its PID namespace),
    not a young lock-less one (a writer about to lock or to rename), not another entry's."""
    import fcntl
    import time

    import jax

    from dsv4_jax.weights import converted_cache
    from dsv4_jax.weights.builtin import cached_checkpoint
    from dsv4_jax.weights.partial_dirs import LOCK_FILE, UNLOCKED_STALE_S

    monkeypatch.setenv("DSV4_JAX_CACHE", str(tmp_path))
    folders = {name: tmp_path / f"{entry}.partial-{suffix}" for name, entry, suffix in (
        ("killed", "model", "abc"), ("live", "model", "def"), ("young unlocked", "model", "ghi"),
        ("old unlocked", "model", "12345"), ("other entry", "model2", "jkl"))}
    for name, folder in folders.items():
        folder.mkdir()
        (folder / "weights.bin").write_bytes(b"\0" * 4096)
        if "unlocked" not in name:
            (folder / LOCK_FILE).touch()
    held = os.open(folders["live"] / LOCK_FILE, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # another open file description: as another process's lock
    old = time.time() - UNLOCKED_STALE_S - 60
    os.utime(folders["old unlocked"], (old, old))
    try:
        with caplog.at_level("WARNING"):
            path = cached_checkpoint("model", lambda d: (d / "config.json").write_text("{}"))
    finally:
        os.close(held)
    assert path == tmp_path / "model" and (path / "config.json").is_file()
    assert not (path / LOCK_FILE).exists()  # the entry keeps no lock file
    assert {name for name, folder in folders.items() if folder.exists()} == {"live", "young unlocked", "other entry"}
    assert caplog.text.count("left by a writer that stopped") == 2

    # The converted-weights cache removes them before it counts the disk's free space.
    stale = tmp_path / "ckpt-0123.partial-mno"
    stale.mkdir()
    (stale / LOCK_FILE).touch()
    disk_usage = shutil.disk_usage

    def usage(path):
        assert not stale.exists(), "free space counted before the killed write's folder was removed"
        return disk_usage(path)

    monkeypatch.setattr(converted_cache.shutil, "disk_usage", usage)
    arrays = {"w": jax.device_put(np.arange(6, dtype=np.float32))}
    assert converted_cache.save(tmp_path / "ckpt-0123", arrays, fields={}, mtp_enabled=False, warnings=[])
    assert converted_cache.find(tmp_path / "ckpt-0123") is not None
    assert not list(tmp_path.glob("ckpt-0123.partial-*")) and not (tmp_path / "ckpt-0123" / LOCK_FILE).exists()

    # A disk without the room writes nothing and leaves no folder behind, only a warning.
    monkeypatch.setattr(converted_cache.shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=1))
    with caplog.at_level("WARNING"):
        assert not converted_cache.save(tmp_path / "ckpt-4567", arrays, fields={}, mtp_enabled=False, warnings=[])
    assert "not writing the converted-weights cache" in caplog.text
    assert not list(tmp_path.glob("ckpt-4567*"))


# ---- command-line entry points ----------------------------------------------------------------
@pytest.mark.parametrize("parser", [demo.make_parser(), plan.make_parser()], ids=["demo", "plan"])
def test_every_option_has_help_with_its_default(parser):
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and "default" in action.help, action.option_strings
        expanded = action.help % {**vars(action), "prog": parser.prog}
        if action.default not in (None, False):
            assert str(action.default) in expanded, action.option_strings


def test_plan_without_arguments_explains_every_row_once(capsys):
    assert plan.main([]) == 0
    out = capsys.readouterr().out
    assert "..." not in out
    assert all(line.count("does not fit") <= 1 for line in out.splitlines())
    rows = [line for line in out.splitlines() if line.startswith(("fp8_ds_mla*", "bfloat16"))]
    notes = [line for line in out.splitlines() if line.startswith("[")]
    assert len(rows) == len(notes) == 2  # one H200 cannot hold DeepSeek-V4-Flash: both rows point to a note
    for i, (row, note) in enumerate(zip(rows, notes), start=1):
        assert row.endswith(f"does not fit [{i}]") and note.startswith(f"[{i}] ")
    # The first note holds the planner's whole reason for the default fp8 row.
    config = get_config("dsv4-flash")
    with pytest.raises(ValueError) as err:
        plan_capacity(
            config, resolve_kv_cache("auto", "NVIDIA H200", None, None, config), max_model_len=1048576,
            device_memory_bytes=nominal_device_memory("NVIDIA H200"),
            weight_bytes=estimate_weight_bytes_per_device(config, MeshShape(), 0),
        )
    assert notes[0].endswith(str(err.value))


def _run(module: str, *args: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("DSV4_DEBUG", None)
    if debug:
        env["DSV4_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def _assert_one_line_error(done: subprocess.CompletedProcess, prog: str, *fragments: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_demo_bad_model_dir_is_one_line_and_debug_shows_the_traceback(model_dir):
    _edit_config(model_dir, hidden_size="abc")
    done = _run("dsv4_jax.demo", "--model", str(model_dir))
    _assert_one_line_error(done, "python -m dsv4_jax.demo", str(model_dir / "config.json"), "`hidden_size`")
    debug = _run("dsv4_jax.demo", "--model", str(model_dir), debug=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "`hidden_size`" in debug.stderr


@pytest.mark.parametrize("module", ["pallas_kernels.check", "dsv4_jax.demo", "dsv4_jax.plan"])
def test_an_unknown_flag_is_one_line_without_the_usage_block(module):
    done = _run(module, "--no-such-flag")
    _assert_one_line_error(done, f"python -m {module}", "unrecognized arguments: --no-such-flag")


def test_plan_bad_model_is_one_line(model_dir):
    (model_dir / "config.json").write_text("{")
    done = _run("dsv4_jax.plan", "--model", str(model_dir))
    _assert_one_line_error(done, "python -m dsv4_jax.plan", str(model_dir / "config.json"), "invalid JSON")


def test_the_persistent_compilation_cache_is_on_unless_jax_is_told_otherwise(tmp_path, monkeypatch):
    """`LLM` and `python -m serve` turn JAX's persistent compilation cache on before anything
    compiles: in `$DSV4_JAX_CACHE/jax-cache` (every program) where JAX has no directory, JAX's own
    directory (with JAX's thresholds) where it has one, and not at all where JAX's switch is off
    (each case a fresh process: JAX reads the settings once)."""
    import subprocess
    import sys

    from dsv4_jax import LLM
    from dsv4_jax.engine import compilation_cache

    script = ("import jax; from dsv4_jax.engine.compilation_cache import enable_compilation_cache as e; "
              "print(e(), jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)")
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")} | {"JAX_PLATFORMS": "cpu",
                                                                              "DSV4_JAX_CACHE": str(tmp_path)}
    cases = {"unset": {}, "jax's directory": {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")},
             "switched off": {"JAX_ENABLE_COMPILATION_CACHE": "false"}}
    out = {}
    for name, env in cases.items():
        done = subprocess.run([sys.executable, "-c", script], env=base | env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        out[name] = done.stdout.split()
    default = str(tmp_path / "jax-cache")
    assert out["unset"] == [default, default, "0.0"]  # ours: every program cached
    assert out["jax's directory"] == [str(tmp_path / "mine")] * 2 + ["1.0"]
    assert out["switched off"] == ["None", "None", "1.0"]

    calls = []
    monkeypatch.setattr(compilation_cache, "enable_compilation_cache", lambda **kw: calls.append(kw))
    with pytest.raises((ValueError, FileNotFoundError), match="missing"):
        LLM(str(tmp_path / "missing"))  # refused before anything loads or compiles, the cache already on
    assert calls == [{}]
