"""Folders a cache entry (the built-in model, a converted-weights entry) is written into before it
is renamed into place, so the entry appears whole or not at all.

A writer killed mid-write (SIGKILL, the OOM killer, a lost node) leaves its folder behind, and a
converted DeepSeek-V4-Flash entry is some 150 GB of it. So each writer holds an exclusive
`flock` on a lock file in its folder while it writes, and before writing, a writer removes the
partial folders of the same entry whose lock it can take: their writer is gone. A lock held by
the kernel for a live process, whatever its PID namespace or host (containers sharing a cache
volume, NFS with locking), is what tells a live writer from a dead one; PIDs cannot across
containers. A folder without a lock file (a writer between creating its folder and locking it,
or about to rename it; folders of versions before this one) is removed only once nothing in it
has changed for `UNLOCKED_STALE_S`.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".writer.lock"
UNLOCKED_STALE_S = 3600.0  # a partial folder without a lock file, untouched this long, is a dead writer's


def _bytes(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        with contextlib.suppress(OSError):  # removed meanwhile (another writer's sweep)
            total += f.stat().st_size if f.is_file() else 0
    return total


def _writer_gone(partial: Path) -> tuple[bool, int | None]:
    """(whether the folder's writer is gone, the lock's file descriptor to close after removing
    it: held, so that no writer can take the folder up meanwhile)."""
    lock = partial / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        try:
            return time.time() - partial.stat().st_mtime > UNLOCKED_STALE_S, None
        except OSError:
            return False, None
    except OSError:  # not ours to open (another user's)
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live writer (or locks unsupported here: keep it)
        os.close(fd)
        return False, None
    return True, fd


def remove_stale_partials(entry: Path) -> list[Path]:
    """Remove the partial folders of `entry` whose writer is gone; returns them."""
    removed = []
    for partial in sorted(entry.parent.glob(glob.escape(f"{entry.name}.partial-") + "*")):
        if not partial.is_dir():
            continue
        gone, fd = _writer_gone(partial)
        if not gone:
            continue
        try:
            size = _bytes(partial)
            shutil.rmtree(partial, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)
        if not partial.exists():
            logger.warning("removed %s (%.1f MiB), left by a writer that stopped before it finished", partial,
                           size / 2**20)
            removed.append(partial)
    return removed


@contextlib.contextmanager
def partial_for(entry: Path) -> Iterator[Path]:
    """A new, empty partial folder for `entry`, beside it (stale ones removed first), locked as
    this writer's for the `with` block, with the permissions the umask gives a new folder
    (mkdtemp's 0700 would hide a shared cache from other users). The caller renames it into
    place (`publish`) or removes it inside the block."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(entry)
    partial = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f"{entry.name}.partial-"))
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)
    # Locked before it appears under its name: another writer's sweep that opened an unlocked
    # lock file would take this folder for a dead writer's and remove it.
    unnamed = partial / f"{LOCK_FILE}.new"
    fd = os.open(unnamed, os.O_RDWR | os.O_CREAT, 0o666 & ~umask)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(unnamed, partial / LOCK_FILE)
        yield partial
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial / LOCK_FILE)
        os.close(fd)


def publish(partial: Path, entry: Path) -> None:
    """Rename a complete partial folder into place as `entry` (OSError where `entry` exists),
    without its lock file. Between the two, the folder has no lock file and a fresh mtime, so
    sweeps leave it alone."""
    os.unlink(partial / LOCK_FILE)
    partial.rename(entry)
