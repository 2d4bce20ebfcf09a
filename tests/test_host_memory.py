"""glibc's malloc settings for CPU steps (`dsv4_jax.engine.host_memory`), checked by what the
kernel reports: the memory a process still holds after 48 + 24 MiB were allocated, written and
freed (the 48 above glibc's 32 MiB ceiling for its adaptive mmap threshold, as a sampler's
temporaries at the real vocabulary), again and again, on the main thread and on a worker
thread, which has its own arena as XLA:CPU's threads do. Pages handed back come back zeroed, at
a cost, on the next touch; pages kept are reused. Each run is a fresh process: the settings are
process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO  # tests/ is on sys.path

CYCLES = """
import json, os, threading
import numpy as np
from dsv4_jax.engine.host_memory import keep_freed_buffers

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def kept_after_free(cycles=3):
    # MiB the process still holds after each cycle, over what it held before the first.
    base, kept = resident_mib(), []
    for _ in range(cycles):
        temporaries = np.ones(48 << 18, np.float32), np.ones(24 << 18, np.float32)  # MiB, written through
        del temporaries
        kept.append(round(resident_mib() - base, 1))
    return kept

def on_a_worker_thread():
    kept = []
    worker = threading.Thread(target=lambda: kept.extend(kept_after_free()))
    worker.start()
    worker.join()
    return kept

before = {"main": kept_after_free(), "worker": on_a_worker_thread()}
tuned = keep_freed_buffers()
print(json.dumps({"before": before, "tuned": tuned, "after": {"main": kept_after_free(), "worker": on_a_worker_thread()}}))
"""


def _run(extra_env: dict[str, str]) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **extra_env}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        if name not in extra_env:
            env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", CYCLES], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_step_buffers_stay_with_the_process_and_are_reused():
    run = _run({})
    # glibc's defaults: the freed 48 MiB go back to the system at once, on either thread.
    for thread in ("main", "worker"):
        assert max(run["before"][thread]) < 32, run
    assert run["tuned"] is True
    # Tuned: the pages stay, and later cycles reuse them instead of taking more.
    for thread in ("main", "worker"):
        first, *later = run["after"][thread]
        assert first >= 40, run
        assert max(later) <= first + 8, run


def test_a_users_own_glibc_settings_are_left_alone():
    # The user's trim threshold also fixes glibc's mmap threshold at its 128 KiB default: every
    # freed block still goes back, as that user asked for.
    run = _run({"MALLOC_TRIM_THRESHOLD_": str(128 << 10)})
    assert run["tuned"] is False
    assert max(run["after"]["main"]) < 8, run
