"""Test-session plumbing: JAX's persistent compilation cache, and a per-test account of XLA
compiles (count and seconds) with a cap on the session total, since compiles dominate CI."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
# Total backend-compile seconds the whole suite may spend (CI has 12 minutes on 2 cores).
COMPILE_SECONDS_CAP = float(os.environ.get("DSV4_COMPILE_SECONDS_CAP", "420"))

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".jax_cache"))

import jax  # noqa: E402  (after the cache directory is chosen)

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

_compiles: dict[str, list[float]] = defaultdict(list)
_current = {"test": "<collection>"}


def _on_duration(event: str, seconds: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[_current["test"]].append(seconds)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.fixture(autouse=True)
def _account_compiles(request):
    _current["test"] = request.node.nodeid
    yield
    _current["test"] = "<between tests>"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    total = sum(sum(v) for v in _compiles.values())
    count = sum(len(v) for v in _compiles.values())
    terminalreporter.section("XLA compiles")
    rows = sorted(_compiles.items(), key=lambda kv: -sum(kv[1]))[:15]
    for test, secs in rows:
        terminalreporter.write_line(f"{sum(secs):7.1f}s {len(secs):4d} compiles  {test}")
    terminalreporter.write_line(f"total: {count} compiles, {total:.1f}s (cap {COMPILE_SECONDS_CAP:.0f}s)")


def pytest_sessionfinish(session, exitstatus):
    total = sum(sum(v) for v in _compiles.values())
    if total > COMPILE_SECONDS_CAP and exitstatus == 0:
        session.exitstatus = 1
        print(f"\nFAILED: XLA compile time {total:.1f}s exceeds the cap of {COMPILE_SECONDS_CAP:.0f}s")


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return FIXTURES / "golden"


