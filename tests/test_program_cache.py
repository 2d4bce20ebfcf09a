"""The engine's program cache (dsv4_jax/engine/program_cache.py): a compiled program is kept on
disk and read back by a later start without tracing, lowering or compiling it; only what XLA
compiled in this process is kept (XLA:CPU loses compiled functions when it serializes an
executable JAX's own cache served); a damaged entry is compiled again; anything the trace
depends on changes the entry. The suite turns the cache off for itself (tests/conftest.py); these
tests make their own."""

from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.engine import program_cache
from dsv4_jax.engine.program_cache import ProgramCache, describe

from conftest import jax_persistent_cache_off  # tests/ is on sys.path


def _scaled_sum(x, y):
    return jnp.sort(x * 3.0, axis=-1) + y  # a sort: a comparator XLA:CPU compiles as a function of its own


_program = jax.jit(_scaled_sum, donate_argnums=0)


def _job(x, y, **static):
    return describe("scaled sum", (x, y), **static), lambda: _program.lower(x, y)


def _never_lowered():
    raise AssertionError("a program read back must not be traced or lowered")


def test_a_program_is_kept_and_read_back_without_tracing(tmp_path):
    x, y = np.arange(12.0, dtype=np.float32).reshape(3, 4)[::-1].copy(), np.ones((3, 4), np.float32)
    first = ProgramCache(tmp_path)
    with jax_persistent_cache_off():
        built = first.compile({"p": _job(x, y)})["p"]
    assert (first.built, first.loaded) == (1, 0) and not list(tmp_path.rglob("*.bin"))  # not known to run yet
    first.keep()
    assert len(list(tmp_path.rglob("*.bin"))) == 1
    identity, _ = _job(x, y)
    again = ProgramCache(tmp_path)
    loaded = again.compile({"p": (identity, _never_lowered)})["p"]
    assert (again.built, again.loaded) == (0, 1)
    expected = np.sort(x * 3.0, axis=-1) + y
    donated = jnp.asarray(x)
    np.testing.assert_array_equal(loaded(donated, y), expected)
    np.testing.assert_array_equal(built(jnp.asarray(x), y), expected)
    assert donated.is_deleted()  # the executable read back still takes its input's buffer


SERVED_BY_JAX = """
import sys, jax, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
sys.path.insert(0, sys.argv[3])
from test_program_cache import _job
from dsv4_jax.engine.program_cache import ProgramCache
x, y = np.ones((2, 5), np.float32), np.zeros((2, 5), np.float32)
cache = ProgramCache(sys.argv[2] if sys.argv[2] != "-" else None)
out = cache.compile({"p": _job(x, y)})["p"]
assert (out(x, y) == np.sort(x * 3.0) + y).all()
cache.keep()
print(cache.built, cache.loaded)
"""


def test_only_programs_xla_compiled_here_are_kept(tmp_path):
    """An executable JAX's persistent cache served is run, not kept: serialized again on XLA:CPU it
    loses its compiled functions and fails when a later start runs it. Each start is a process of
    its own (JAX reads its persistent cache in a fresh process, else it serves from memory)."""
    import os
    import subprocess
    import sys

    def start(programs: str) -> str:
        done = subprocess.run([sys.executable, "-c", SERVED_BY_JAX, str(tmp_path / "jax"), programs,
                               os.path.dirname(__file__)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()

    assert start("-") == ["1", "0"]  # compiled by XLA into JAX's cache; nothing kept here
    assert start(str(tmp_path / "programs")) == ["1", "0"]  # JAX's cache served it: not kept
    assert not (tmp_path / "programs").exists()


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path, caplog):
    x, y = np.ones((3, 3), np.float32), np.ones((3, 3), np.float32)
    with jax_persistent_cache_off():
        kept = ProgramCache(tmp_path)
        kept.compile({"p": _job(x, y)})
        kept.keep()
    [entry] = tmp_path.rglob("*.bin")
    entry.write_bytes(b"not a program")
    cache = ProgramCache(tmp_path)
    with jax_persistent_cache_off(), caplog.at_level(logging.WARNING, logger=program_cache.__name__):
        out = cache.compile({"p": _job(x, y)})["p"]
    assert "could not be read back" in caplog.text and (cache.built, cache.loaded) == (1, 0)
    np.testing.assert_array_equal(out(jnp.asarray(x), y), np.sort(x * 3.0) + y)
    cache.keep()
    assert ProgramCache(tmp_path).compile({"p": (_job(x, y)[0], _never_lowered)})  # replaced by a good one


def test_a_start_in_a_new_environment_removes_folders_unused_for_days(tmp_path):
    """One folder per environment; writing a new one removes the folders no start has used for
    STALE_DAYS (reading an entry marks its folder used), and keeps the others."""
    import os
    import time

    old, recent = tmp_path / "old-environment", tmp_path / "recent-environment"
    for folder in (old, recent):
        folder.mkdir()
        (folder / "entry.bin").write_bytes(b"x")
    stale = time.time() - (program_cache.STALE_DAYS + 1) * 86400
    os.utime(old, (stale, stale))
    x, y = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
    cache = ProgramCache(tmp_path)
    with jax_persistent_cache_off():
        cache.compile({"p": _job(x, y)})
    cache.keep()
    assert not old.exists() and recent.exists() and len(list(tmp_path.rglob("*.bin"))) == 2


def test_everything_the_trace_depends_on_changes_the_entry(tmp_path, monkeypatch):
    cache = ProgramCache(tmp_path)
    x = np.ones((2, 3), np.float32)
    base = cache._path(describe("p", (x,), setting=1))
    assert base == cache._path(describe("p", (np.zeros((2, 3), np.float32),), setting=1))  # values do not count
    others = [describe("p", (np.ones((3, 3), np.float32),), setting=1),  # shape
              describe("p", (np.ones((2, 3), np.int32),), setting=1),  # dtype
              describe("p", ((x, x),), setting=1),  # tree
              describe("p", (x,), setting=2),  # a static setting
              describe("q", (x,), setting=1)]  # the program
    assert len({base, *(cache._path(identity) for identity in others)}) == 1 + len(others)
    monkeypatch.setattr(program_cache, "source_digest", lambda: "other code")
    assert ProgramCache(tmp_path)._path(describe("p", (x,), setting=1)) != base  # the code


def test_the_default_cache_follows_jaxs_and_its_own_switch(monkeypatch):
    directory = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv(program_cache.SWITCH_ENV, "1")
    assert ProgramCache.default().directory == program_cache.Path(directory) / program_cache.DIRECTORY_NAME
    for off in ("0", "false"):
        monkeypatch.setenv(program_cache.SWITCH_ENV, off)
        assert ProgramCache.default().directory is None
    monkeypatch.setenv(program_cache.SWITCH_ENV, "1")
    with jax_persistent_cache_off():
        assert ProgramCache.default().directory is None


def test_a_failed_compile_is_raised_in_its_programs_context(tmp_path):
    class Refused:
        def compile(self):
            raise ValueError("refused by the compiler")

    @contextlib.contextmanager
    def naming(key):
        try:
            yield
        except ValueError as err:
            raise RuntimeError(f"program {key}: {err}") from err

    with pytest.raises(RuntimeError, match=r"program b: refused by the compiler"):
        ProgramCache(tmp_path).compile({"a": ("a", lambda: _program.lower(np.ones(2, np.float32), np.ones(2, np.float32))),
                                        "b": ("b", Refused)}, naming)
