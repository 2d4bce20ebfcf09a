"""glibc's malloc settings for steps that run on the CPU.

XLA:CPU takes every execution's temporary buffer and outputs from malloc, on its worker threads.
glibc serves a block above its mmap threshold with a fresh mapping (that threshold adapts to
freed blocks, but never past 32 MiB), gives the top of a heap back to the system once more than
the trim threshold is free, and a worker thread's arena drops a whole 64 MiB heap once it is
free by more than the top pad: each time, the pages come back zeroed on first touch. The
sampler's temporary buffer at the real vocabulary and 32 rows is 32.2 MiB, so every call pays
for zeroing it again: `benchmarks/sampler.py` at [32, 129280], with these settings / without,
greedy + 5 logprobs 3.0-3.4 / 8.0-8.2 ms, temperature 1 2.0-2.4 / 6.1-6.5 ms, greedy 0.7-0.8 /
0.8-0.9 ms (AMD EPYC Zen 4, 2 CPUs; docs/performance.md, "Sampler").

With these settings blocks up to MMAP_THRESHOLD come from a heap, heaps keep up to
TRIM_THRESHOLD free at their top, and worker threads' heaps stay while less than TOP_PAD of them
is free, so a step reuses the pages the previous one freed. Process-wide, hence set only when a
runner is about to run steps on the CPU, after the weights are loaded; a process that set any of
glibc's variables for these itself (USER_SETTINGS), or whose C library has no `mallopt`, is left
as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters, glibc's <malloc.h>
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20
TOP_PAD = 64 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_buffers() -> bool:
    """Set glibc's mmap threshold, trim threshold and top pad (module docstring); True when all
    three took effect."""
    chosen = [name for name in USER_SETTINGS if name in os.environ]
    if chosen:
        logger.info("malloc: leaving glibc's thresholds as %s set them", " and ".join(chosen))
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to set
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    if not all(mallopt(parameter, value) == 1 for parameter, value in settings):
        return False
    logger.info("malloc: blocks up to %d MiB from heaps that keep up to %d MiB free (top pad %d MiB): CPU steps "
                "reuse their buffers' pages", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, TOP_PAD >> 20)
    return True
