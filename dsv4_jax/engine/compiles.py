"""Counting XLA compiles through `jax.monitoring`, so the runner can prove that a warmed-up
server never compiles again; and what a compiled program needs on the device (`ProgramMemory`).

JAX reports every executable it builds as the duration event
`/jax/core/compile/backend_compile_duration`, including one read from the persistent compilation
cache, which also records `/jax/compilation_cache/cache_hits`. So compiles = those events minus
cache hits, and a restart with a warm cache shows 0 compiles and N cache hits. The listeners are
registered once per process, the first time a counter is made; they count into module-level
totals that `CompileCounter` snapshots.

`compile_threads` says how many programs compile at once (the program cache, engine/program_cache.py,
compiles the runner's steps and the sampler's programs ahead of time on threads, and warm-up
calls them as executables).
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_total = {"built": 0, "cache_hits": 0, "seconds": 0.0}
_registered = False


def _listen_duration(event: str, seconds: float, **_: object) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _total["built"] += 1
            _total["seconds"] += seconds


def _listen_event(event: str, **_: object) -> None:
    if event == CACHE_HIT_EVENT:
        with _lock:
            _total["cache_hits"] += 1


def _ensure_listener() -> None:
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listen_duration)
            jax.monitoring.register_event_listener(_listen_event)
            _registered = True


class CompileCounter:
    """XLA compiles, persistent-cache hits and their seconds since the counter was made or last
    `reset`."""

    def __init__(self) -> None:
        _ensure_listener()
        self.reset()

    def reset(self) -> None:
        with _lock:
            self._start = dict(_total)

    @property
    def compiles(self) -> int:
        """Executables XLA really compiled (not read from the persistent cache)."""
        with _lock:
            return (_total["built"] - self._start["built"]) - (_total["cache_hits"] - self._start["cache_hits"])

    @property
    def built(self) -> int:
        """Executables built at all, compiled or read from the persistent cache: after warm-up a
        server must build none (a cache hit still means a shape was not warmed up)."""
        with _lock:
            return _total["built"] - self._start["built"]

    @property
    def cache_hits(self) -> int:
        with _lock:
            return _total["cache_hits"] - self._start["cache_hits"]

    @property
    def seconds(self) -> float:
        with _lock:
            return _total["seconds"] - self._start["seconds"]


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Device bytes a compiled program needs beyond its arguments, per device (XLA's buffer
    assignment, `Compiled.memory_analysis()`): its scratch, and the outputs it does not write in
    place of a donated argument (the KV cache a step is donated is not counted again)."""

    temp: int
    outputs: int

    @property
    def total(self) -> int:
        return self.temp + self.outputs

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> ProgramMemory:
        """From a compiled program's buffer assignment (`jitted.lower(...).compile()`, for arrays or
        `jax.ShapeDtypeStruct`s: nothing runs). RuntimeError where the backend reports none."""
        stats = compiled.memory_analysis()
        if stats is None:
            raise RuntimeError(f"the {jax.default_backend()} backend reports no memory analysis of compiled programs")
        return cls(int(stats.temp_size_in_bytes), int(stats.output_size_in_bytes - stats.alias_size_in_bytes))


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, as `taskset` sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


COMPILE_THREADS_ENV = "DSV4_JAX_COMPILE_THREADS"
# A bound, not a measured optimum (no GPU measurement yet): XLA:GPU times candidate kernels on
# the device while it compiles, on buffers the size of their operands, so N compiles at once need
# N times that memory beside pools sized to fill it, and time their candidates against each other.
DEFAULT_COMPILE_THREADS = 4


def compile_threads() -> int:
    """How many programs compile at once in the process: $DSV4_JAX_COMPILE_THREADS (1:
    one after another), else the CPUs this process may use, at most DEFAULT_COMPILE_THREADS."""
    value = os.environ.get(COMPILE_THREADS_ENV)
    if value is None:
        return max(1, min(usable_cpus(), DEFAULT_COMPILE_THREADS))
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{COMPILE_THREADS_ENV} must be a positive integer, got {value!r}")
    return int(value)
