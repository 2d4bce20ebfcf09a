"""Counting XLA compiles through `jax.monitoring`, so the runner can prove that a warmed-up
server never compiles again.

JAX reports every backend compile as the duration event `/jax/core/compile/backend_compile_duration`
(a persistent-cache hit reports none). One listener is registered per process, the first time a
counter is asked for; it counts into a module-level total that `CompileCounter` snapshots.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_total = {"compiles": 0, "seconds": 0.0}
_registered = False


def _listen(event: str, seconds: float, **_: object) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _total["compiles"] += 1
            _total["seconds"] += seconds


def _ensure_listener() -> None:
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listen)
            _registered = True


class CompileCounter:
    """Compiles (and their seconds) since the counter was made or last `reset`."""

    def __init__(self) -> None:
        _ensure_listener()
        self.reset()

    def reset(self) -> None:
        with _lock:
            self._start = dict(_total)

    @property
    def compiles(self) -> int:
        with _lock:
            return _total["compiles"] - self._start["compiles"]

    @property
    def seconds(self) -> float:
        with _lock:
            return _total["seconds"] - self._start["seconds"]
