"""The engine's compiled programs kept on disk, so that a restart loads them instead of tracing,
lowering and compiling them again; and the one place programs are compiled ahead of time.

JAX's persistent compilation cache skips XLA's compile on a restart, but it is keyed by the
lowered program: every start still traces and lowers every program to find its entry, most of a
warm restart (the built-in model on 2 CPUs: ~11 of ~16 s). This cache is keyed instead by what a
trace depends on, known before tracing: this package's and the kernels' source, the JAX version,
the devices, XLA's flags, and per program its name, its static settings and its arguments'
shapes, dtypes and shardings. A hit is a deserialized executable
(`jax.experimental.serialize_executable`), ready to call.

It lives beside JAX's own cache (`<jax_compilation_cache_dir>/dsv4-programs`), so
`JAX_ENABLE_COMPILATION_CACHE=false` turns both off, and `DSV4_JAX_PROGRAM_CACHE=0` this one alone:
a process that changes the model's code at run time (a test patching a function, a notebook
experiment) must, since the key sees the source files, not the functions in memory. A run over
several processes does not use it (an executable there is one of a program every process must
run together). An entry that cannot be read back is compiled again and replaced. Entries are
written atomically (a rename), so processes sharing the directory never read half an entry.

Only programs XLA compiled in this process are kept: on XLA:CPU an executable that JAX read back
from its own persistent cache serializes without some of its compiled functions, and fails when
run after loading ("Function ... not found"). A program JAX's cache served is compiled again by
neither cache on the next start, just not kept here. And a program is kept only once its caller
says it ran (`keep()`): the engine runs each new program once at warm-up, and skips that run for
the programs it reads back.

Entries live in one folder per environment (the code, JAX, the devices, the flags): a start that
writes a new folder removes the folders no start has used for `STALE_DAYS`.

`ProgramCache.compile` takes the programs to build as (identity, lower) pairs: the misses are
lowered one after another on the calling thread and each is compiled on a worker thread as soon as
it is lowered (XLA compiles without the GIL), so tracing the next overlaps compiling the last.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping

import jax

from dsv4_jax.engine.compiles import CACHE_HIT_EVENT, compile_threads

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when an entry's layout changes
DIRECTORY_NAME = "dsv4-programs"
SWITCH_ENV = "DSV4_JAX_PROGRAM_CACHE"  # "0" or "false": no program is kept or read back
STALE_DAYS = 7  # an environment's folder unused this long goes when another is written

# Executables JAX's persistent cache served in this process (by the id of the loaded executable):
# JAX records the hit on the thread that compiles, and a later compile of the same program is
# served from memory, without an event, by that same executable.
_this_thread = threading.local()
_served_by_jax: set[int] = set()
_listening = threading.Lock()
_listener_registered = False


def _note_cache_hit(event: str, **_: object) -> None:
    if event == CACHE_HIT_EVENT:
        _this_thread.hit = True


_compile_slots: threading.BoundedSemaphore | None = None  # compile_threads() at once in the whole process


def _compile_fresh(lowered) -> tuple[jax.stages.Compiled, bool]:
    """(executable, whether XLA compiled it in this process rather than JAX's persistent cache
    serving it, now or to an earlier compile of the same program). At most `compile_threads()`
    compiles run at once in the process, whichever pool asked (XLA:GPU autotunes each on the
    device, beside pools that fill its memory)."""
    global _listener_registered, _compile_slots
    with _listening:
        if not _listener_registered:
            jax.monitoring.register_event_listener(_note_cache_hit)
            _listener_registered = True
        if _compile_slots is None:
            _compile_slots = threading.BoundedSemaphore(compile_threads())
    _this_thread.hit = False
    with _compile_slots:
        compiled = lowered.compile()
    executable = id(compiled.runtime_executable())
    with _listening:
        if _this_thread.hit:
            _served_by_jax.add(executable)
        return compiled, executable not in _served_by_jax


@functools.cache
def source_digest() -> str:
    """A digest of every source file of dsv4_jax and pallas_kernels: any code change makes every
    entry a miss (a program's trace depends on code far from its call site)."""
    import pallas_kernels

    digest = hashlib.sha256()
    for root in (Path(__file__).resolve().parents[1], Path(pallas_kernels.__file__).resolve().parent):
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{root.name}/{path.relative_to(root)}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def environment() -> str:
    """What every program depends on besides its own description: the code (this package's, the
    kernels', flax's and JAX's versions), the devices (and, for XLA:CPU, which compiles for the
    host's instruction set, the host CPU), XLA's flags and the JAX settings that change numbers."""
    import flax
    import jaxlib

    devices = [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]
    config = jax.config
    settings = (config.jax_enable_x64, config.jax_default_matmul_precision, config.jax_threefry_partitionable)
    return repr((FORMAT_VERSION, jax.__version__, jaxlib.__version__, flax.__version__, devices, _host_cpu(),
                 os.environ.get("XLA_FLAGS", ""), settings, source_digest()))


@functools.cache
def _host_cpu() -> str:
    """The host CPU's model and instruction-set flags (Linux's /proc/cpuinfo; the machine type elsewhere)."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return hashlib.sha256("\n".join(dict.fromkeys(wanted)).encode()).hexdigest()[:16]


def describe(name: str, args: Any, **static: Any) -> str:
    """A program's identity: `name`, its static settings (their reprs, which must not hold object
    addresses) and its arguments' tree, shapes, dtypes and shardings (arrays or
    `jax.ShapeDtypeStruct`s alike)."""
    leaves, tree = jax.tree.flatten(args)
    avals = [(tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None))) for x in leaves]
    return repr((name, sorted((k, repr(v)) for k, v in static.items()), str(tree), avals))


class ProgramCache:
    """Serialized executables under `directory` (None: nothing is kept; every program compiles)."""

    def __init__(self, directory: str | Path | None):
        self.directory = None if directory is None else Path(directory)
        self.loaded = 0  # programs read back, since this cache was made
        self.built = 0  # programs lowered and compiled
        self._environment: str | None = None
        self._unkept: dict[str, bytes] = {}  # serialized as compiled here, not yet known to run

    @classmethod
    def default(cls) -> ProgramCache:
        """Beside JAX's persistent compilation cache when that is on, for one process, unless
        $DSV4_JAX_PROGRAM_CACHE turns it off."""
        directory = jax.config.jax_compilation_cache_dir
        switched_off = os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "no", "off")
        if switched_off or not directory or not jax.config.jax_enable_compilation_cache or jax.process_count() > 1:
            return cls(None)
        return cls(Path(directory) / DIRECTORY_NAME)

    def compile(self, jobs: Mapping[Hashable, tuple[str, Callable[[], Any]]],
                describe_error: Callable[[Any], contextlib.AbstractContextManager] = lambda key: contextlib.nullcontext(),
                on_done: Callable[[], None] | None = None) -> dict[Hashable, jax.stages.Compiled]:
        """`{key: executable}` for `{key: (identity, lower)}`: read back where an entry for the
        identity exists, else `lower()` (a `jax.stages.Lowered`) compiled, to be stored by `keep()`.
        Errors are raised in `describe_error(key)`'s context; `on_done()` after each program."""
        done = on_done or (lambda: None)
        out: dict[Hashable, jax.stages.Compiled] = {}
        misses = []
        for key, (identity, lower) in jobs.items():
            compiled = self._load(identity)
            if compiled is None:
                misses.append((key, identity, lower))
            else:
                out[key] = compiled
                done()
        if not misses:
            return out
        workers = max(1, min(len(misses), compile_threads()))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dsv4-compile") as pool:
            futures = {}
            for key, identity, lower in misses:
                with describe_error(key):
                    lowered = lower()
                futures[key] = (identity, pool.submit(_compile_fresh, lowered))
                futures[key][1].add_done_callback(lambda _: done())
        for key, (identity, future) in futures.items():
            with describe_error(key):
                out[key], fresh = future.result()
            self.built += 1
            if fresh and self.directory is not None:
                blob = self._serialize(out[key])  # now: XLA:CPU cannot serialize an executable that ran
                if blob is not None:
                    self._unkept[identity] = blob
        return out

    def keep(self) -> None:
        """Store every program compiled since the last call: its caller ran it (or never runs it,
        as the activations' measurement)."""
        unkept, self._unkept = self._unkept, {}
        for identity, blob in unkept.items():
            self._store(identity, blob)

    # ---- entries ---------------------------------------------------------------------------------
    def _path(self, identity: str) -> Path | None:
        if self.directory is None:
            return None
        if self._environment is None:
            self._environment = hashlib.sha256(environment().encode()).hexdigest()[:32]
        name = hashlib.sha256(identity.encode()).hexdigest()
        return self.directory / self._environment / f"{name}.bin"

    def _load(self, identity: str) -> jax.stages.Compiled | None:
        path = self._path(identity)
        if path is None or not path.is_file():
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = deserialize_and_load(payload, in_tree, out_tree)
            os.utime(path.parent)  # this environment is in use (`_prune`)
        except Exception as error:  # noqa: BLE001 - a damaged or foreign entry: compile it again
            logger.warning("compiled program %s could not be read back (%s: %s); compiling it again", path.name,
                           type(error).__name__, error)
            return None
        self.loaded += 1
        return compiled

    @staticmethod
    def _serialize(compiled: jax.stages.Compiled) -> bytes | None:
        from jax.experimental.serialize_executable import serialize

        try:
            return pickle.dumps(serialize(compiled))
        except Exception as error:  # noqa: BLE001 - a program that cannot be kept still runs
            # e.g. XLA:CPU's sort comparators, once the executable ran (the same program served
            # from memory to an earlier caller that ran it): compiled again by the next start.
            logger.info("compiled program not kept for the next start (%s: %s)", type(error).__name__, error)
            return None

    def _store(self, identity: str, blob: bytes) -> None:
        path = self._path(identity)
        if path is None:
            return
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True)
                self._prune(keep=path.parent)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".", suffix=".tmp", delete=False) as file:
                file.write(blob)
            os.chmod(file.name, 0o644)  # as any file this user writes: others sharing the cache read it
            try:
                os.replace(file.name, path)
            finally:
                Path(file.name).unlink(missing_ok=True)
        except OSError as error:  # a full or read-only disk: the program still runs
            logger.warning("compiled program not kept for the next start (%s: %s)", type(error).__name__, error)

    def _prune(self, keep: Path) -> None:
        """Remove the other environments' folders that no start has used for STALE_DAYS."""
        import shutil
        import time

        cutoff = time.time() - STALE_DAYS * 86400
        for folder in self.directory.iterdir():
            try:
                if folder != keep and folder.is_dir() and folder.stat().st_mtime < cutoff:
                    shutil.rmtree(folder, ignore_errors=True)
            except OSError:
                continue
