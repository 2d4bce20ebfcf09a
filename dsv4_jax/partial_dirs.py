"""Folders a cache entry (the built-in model, a converted-weights entry) is written into before it
is renamed into place, so the entry appears whole or not at all.

Each is named after its writer, `<entry>.partial-<host>-<pid>-<random>`. A writer killed
mid-write (SIGKILL, the OOM killer, a lost node) leaves its folder behind, and a converted
DeepSeek-V4-Flash entry is some 150 GB of it. So before writing, a writer removes the partial
folders of the same entry left on this host by processes that no longer run. Folders of other
hosts (a cache on a shared file system) are left alone: whether their writer runs cannot be told
from here.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def _host() -> str:
    return socket.gethostname() or "localhost"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _writer(entry: Path, partial: Path) -> tuple[str, int] | None:
    """(host, pid) from a partial folder's name; None for a name this module did not make."""
    parts = partial.name[len(f"{entry.name}.partial-"):].rsplit("-", 2)  # mkdtemp's part has no "-"
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2]:
        return None
    return parts[0], int(parts[1])


def remove_stale_partials(entry: Path) -> list[Path]:
    """Remove the partial folders of `entry` whose writer ran on this host and runs no more;
    returns them."""
    removed = []
    for partial in sorted(entry.parent.glob(glob.escape(f"{entry.name}.partial-") + "*")):
        writer = _writer(entry, partial)
        if writer is None or writer[0] != _host() or writer[1] == os.getpid() or _running(writer[1]):
            continue
        size = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        shutil.rmtree(partial, ignore_errors=True)
        logger.warning("removed %s (%.1f MiB), left by process %d, which stopped before it finished writing",
                       partial, size / 2**20, writer[1])
        removed.append(partial)
    return removed


def new_partial(entry: Path) -> Path:
    """A new, empty partial folder for `entry`, beside it (stale ones removed first), with the
    permissions the umask gives a new folder (mkdtemp's 0700 would hide a shared cache from other
    users)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(entry)
    partial = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f"{entry.name}.partial-{_host()}-{os.getpid()}-"))
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)
    return partial
