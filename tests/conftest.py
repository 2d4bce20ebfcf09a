"""Test-session plumbing: JAX's persistent compilation cache, and a per-test account of XLA
compiles (count and seconds), since compiles dominate CI.

The guard is on the number of backend compiles, which is deterministic for a given cold cache
(a warm persistent cache only lowers it); their seconds depend on how busy the machine is, so
they are reported, never asserted. JAX times an executable read from the persistent cache under
the same event as one compiled, so a program that another test of the run already compiled (in a
jit of its own: another engine, another model object) counts too, at a fraction of the cost."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
# Backend compiles the whole suite may run from a cold cache, summed over both lanes (below; a
# program both lanes need compiles once in each), so a test that starts recompiling per call, or a
# new bucket nobody budgeted, fails the run. A change that adds or removes compiles moves the cap by
# exactly that many: run the suite from a cold cache before and after it with
# DSV4_COMPILE_REPORT=FILE (every test's count) and diff the two files. DSV4_COMPILE_COUNT_CAP
# overrides the cap for one run.
COMPILE_COUNT_CAP = int(os.environ.get("DSV4_COMPILE_COUNT_CAP", "1335"))

# ---- two lanes ---------------------------------------------------------------------------------
# pyproject's addopts run the suite as two pytest-xdist workers (`-n 2 --dist loadscope`): CI has
# two cores, and a single pytest process is the run's critical path (its CPU seconds equal the wall
# clock's: 1452 s of 1435 s in a 24-minute run). Each test file belongs to one lane, and
# lane i runs whole on worker gw{i} (`LaneScheduling`, which makes each lane one loadscope scope) in
# collection order, so every session- and module-scoped fixture is still built once. Files sharing a
# session fixture share a lane: the chat engine and its server (`chat_llm`, `chat_server`) live in
# the engine lane. Files compiling the same programs should too, or both lanes compile them
# (test_runner.py's golden-checkpoint generation shares 26 compiles with the model tests, so it is
# in the model lane; the fuzz, load-rule and KV-format files would compile 38 more in the engine
# lane without shortening the run; the kernel-lowering file compiles nothing for XLA, so it sits
# in the engine lane, which would otherwise finish ~3 min first). Lanes are balanced by
# measured wall seconds per file (the summary prints them); a new file joins the model lane unless
# named here. Each worker keeps its own persistent compilation cache (a subdirectory named after
# it), so what a lane compiles from a cold cache does not depend on how far the other lane got and
# the compile count stays exact. `-n 0` runs everything in one process.
LANES = ("engine", "model")
ENGINE_LANE = frozenset({
    "test_activations.py", "test_async_engine.py", "test_benchmarks_runner.py", "test_chat_encoder.py", "test_chat_layout.py",
    "test_chat_page.py", "test_chat_parser.py", "test_chat_request.py", "test_deployment.py",
    "test_detokenizer.py", "test_engine.py", "test_grafana_dashboard.py", "test_host_memory.py",
    "test_imports.py", "test_kernels_lowering.py", "test_kv_paged.py", "test_multihost.py", "test_notebook.py",
    "test_runner_backends.py", "test_sampler.py", "test_scheduler.py", "test_serve_args.py", "test_serve_bench.py",
    "test_serve_choices.py", "test_serve_metrics.py", "test_serve_protocol.py", "test_server.py",
    "test_server_faults.py", "test_server_load.py", "test_user_errors.py", "test_converted_cache.py",
    "test_structured_outputs.py", "test_server_structured.py", "test_prefix_caching.py", "test_speculative.py"})
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1" inside a pytest-xdist worker


def lane_of(path: str | Path) -> str:
    return LANES[0] if Path(path).name in ENGINE_LANE else LANES[1]


os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".jax_cache"))
# The engine's program cache (dsv4_jax/engine/program_cache.py) is keyed by the source files, not
# by the functions in memory: tests that patch the model's code would read back programs traced
# without the patch. Off for the suite and the processes it starts; its own tests turn it on.
os.environ["DSV4_JAX_PROGRAM_CACHE"] = "0"
if XDIST_WORKER:  # children (servers, workers) inherit it, and read what this worker compiled
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], XDIST_WORKER)
# LLM and the server write converted-weights cache entries (`--load-format auto`) keyed by each
# checkpoint's path: the tests' temporary checkpoints get one throw-away directory per session, as
# do the server processes they start (they inherit the environment), never ~/.cache.
_WEIGHTS_CACHE = tempfile.TemporaryDirectory(prefix="dsv4-weights-cache-")
os.environ["DSV4_JAX_WEIGHTS_CACHE"] = _WEIGHTS_CACHE.name

# The suite compiles ~1600 small programs and runs most a few times: LLVM's expensive passes
# cost more there than they save (cold tests/test_model_parity.py on 2 AMD EPYC cores: compiles
# 69.9 s without the flag, 55.0 s with it). XLA's HLO passes run exactly as in production: the
# backend's whole optimisation level at 0 (compiles 38.4 s) changes bf16 results instead
# (test_bfloat16_compute_stays_close_to_float32 fails; why is not traced), so it is not used.
# Set before jax is imported; child processes inherit it (`child_xla_flags`), so a server a test
# starts reads this process's compilation-cache entries (their keys include the flags).
OPTIMIZATION_FLAG = "--xla_llvm_disable_expensive_passes=true"
if OPTIMIZATION_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {OPTIMIZATION_FLAG}".strip()


def child_xla_flags(cpu_devices: int) -> str:
    """XLA_FLAGS for a child process with `cpu_devices` host devices (and this suite's flags)."""
    return f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={cpu_devices}"


import jax  # noqa: E402  (after the cache directory and XLA_FLAGS are chosen)

# Tracing allocates millions of short-lived Python objects, and with CPython's default thresholds
# (700, 10, 10) the cyclic collector runs every 700 net allocations and walks the older
# generations every 7,000: rarer collections cut this process's CPU by ~5%
# (tests/test_model_units.py + test_kv_paged.py, cold cache: 58-60 CPU s with the defaults, 55-56
# with these).
# Garbage without reference cycles is still freed at once.
gc.set_threshold(10_000, 20, 100)

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Every executable is persisted, however fast it compiled: a server process started by the tests
# must find in the cache whatever this process compiled first (test_server.py asserts that its
# warm-up compiles nothing), whichever test compiled it.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

_compiles: dict[str, list[float]] = defaultdict(list)
_file_seconds: dict[str, float] = defaultdict(float)  # wall seconds per test file (setup + call + teardown)
# CPU seconds per test file: this process's, and its subprocesses' once reaped (an early subprocess
# is reaped by its own module's fixture, so its CPU counts there, whenever it ran).
_file_cpu: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
_current = {"test": "<collection>"}
_SESSION_START = time.monotonic()


def _on_duration(event: str, seconds: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[_current["test"]].append(seconds)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.fixture(autouse=True)
def _account_compiles(request):
    _current["test"] = request.node.nodeid
    yield
    _current["test"] = "<between tests>"


def pytest_runtest_logreport(report):
    _file_seconds[report.nodeid.split("::")[0]] += report.duration


def _cpu_seconds() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _cpu_seconds()
    yield
    account = _file_cpu[item.nodeid.split("::")[0]]
    for i, (start, end) in enumerate(zip(before, _cpu_seconds())):
        account[i] += end - start


_workers: list[str] = []  # one summary line per pytest-xdist worker


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """In the controller: each worker's compiles and CPU seconds join this process's account."""
    output = getattr(node, "workeroutput", {})
    for test, seconds in output.get("dsv4_compiles", {}).items():
        _compiles[test].extend(seconds)
    for path, (own, children) in output.get("dsv4_file_cpu", {}).items():  # (wall: forwarded reports)
        _file_cpu[path][0] += own
        _file_cpu[path][1] += children
    if "dsv4_cpu_line" in output:
        _workers.append(f"{node.gateway.id}: {output['dsv4_cpu_line']}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's loadscope scheduling with the lanes as its scopes, lane i on worker gw{i}."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid.split("::")[0])

        def _assign_work_unit(self, node):
            lane = LANES[int(node.gateway.id.removeprefix("gw")) % len(LANES)]
            if lane in self.workqueue:
                self.workqueue.move_to_end(lane, last=False)  # the unit the base class takes next
            super()._assign_work_unit(node)

    return LaneScheduling(config, log)


def _cpu_line() -> str:
    own, children = _cpu_seconds()
    return (f"{own:.0f} CPU s over {time.monotonic() - _SESSION_START:.0f} wall s; "
            f"reaped subprocesses: {children:.0f} CPU s")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.section("seconds per test file: wall, CPU of pytest, CPU of its reaped subprocesses")
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -sum(_file_cpu[kv[0]])):
        own, children = _file_cpu[path]
        terminalreporter.write_line(f"{seconds:7.1f}s {own:7.1f}s {children:7.1f}s  {path}")
    total = sum(sum(v) for v in _compiles.values())
    count = sum(len(v) for v in _compiles.values())
    terminalreporter.section("XLA compiles")
    rows = sorted(_compiles.items(), key=lambda kv: -sum(kv[1]))[:15]
    for test, secs in rows:
        terminalreporter.write_line(f"{sum(secs):7.1f}s {len(secs):4d} compiles  {test}")
    terminalreporter.write_line(f"total: {count} compiles (cap {COMPILE_COUNT_CAP}), {total:.1f}s")
    # Each pytest process's CPU seconds against the wall clock show how busy it kept its core (a
    # lane near 1.0 is the run's critical path); subprocesses count once they are reaped.
    for line in _workers or [f"this process: {_cpu_line()}"]:
        terminalreporter.write_line(line)
    if os.environ.get("DSV4_COMPILE_REPORT"):  # every test's count, to compare two runs when the cap moves
        Path(os.environ["DSV4_COMPILE_REPORT"]).write_text(
            json.dumps({test: len(secs) for test, secs in sorted(_compiles.items())}, indent=1))


# ---- subprocesses started early ----------------------------------------------------------------
# A test module whose fixture waits on a long subprocess (the 8-device sharding worker: ~3 min
# cold; servers and multi-process runs: ~1 min each) maps fixture names to factories in
# `START_EARLY: dict[str, Callable[[], handle]]` (a handle has `kill()` and a temporary
# `directory`). At the process's first test, each factory whose fixture a selected test of its
# lane uses is called, so the subprocess runs while the tests before it do; the fixture enters
# `started(module name, fixture name)`, which hands it that handle (or starts one where none was
# started) and kills it and removes its directory afterwards.
# Those modules run last, so their subprocesses have the whole run to finish in.
#
# The early subprocesses mostly fill the cores the tests leave idle: they start through
# `in_background` (niceness 10) and stay in this session. A process in a session of its
# own (`start_new_session=True`) gets a scheduler group of its own under Linux's autogroups, and
# each group an equal share of the CPU whatever its niceness: with four such processes on two
# cores, this process (on the critical path) gets a tenth of a core, and a CI run takes ~24 min.
# A process group of its own (`process_group=0`) is enough to kill a process and its children.
_early: dict[tuple[str, str], object] = {}
_early_started: list[str] = []  # the lane of this process's first test, once it has started them


def in_background(command: list[str]) -> list[str]:
    """`command` at a low CPU priority (its threads and children inherit it)."""
    return ["nice", "-n", "10", *command]


def pytest_collection_modifyitems(session, config, items):
    """Modules with START_EARLY subprocesses last (stable: every other test keeps its place)."""
    items.sort(key=lambda item: bool(getattr(getattr(item, "module", None), "START_EARLY", None)))


@pytest.hookimpl(tryfirst=True)  # before the first test's fixtures
def pytest_runtest_setup(item):
    """At this process's first test: start the early subprocesses of its lane's selected tests
    (a pytest-xdist worker runs the first test's lane; one process runs all)."""
    if _early_started:
        return
    lane = lane_of(item.path)
    _early_started.append(lane)
    for other in item.session.items:
        module = getattr(other, "module", None)
        if XDIST_WORKER and lane_of(other.path) != lane:
            continue
        for fixture, start in getattr(module, "START_EARLY", {}).items():
            if (module.__name__, fixture) not in _early and fixture in other.fixturenames:
                _early[module.__name__, fixture] = start()


@contextlib.contextmanager
def started(module_name: str, fixture: str):
    """The handle `START_EARLY[fixture]` of that module started at the first test (else started now);
    killed, and its directory removed, on exit."""
    handle = _early.pop((module_name, fixture), None) or sys.modules[module_name].START_EARLY[fixture]()
    try:
        yield handle
    finally:
        handle.kill()
        handle.directory.cleanup()


def pytest_sessionfinish(session, exitstatus):
    for handle in _early.values():  # started, never taken (its tests failed first or were skipped)
        handle.kill()
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: the controller adds up
        session.config.workeroutput["dsv4_compiles"] = dict(_compiles)
        session.config.workeroutput["dsv4_file_cpu"] = {path: tuple(cpu) for path, cpu in _file_cpu.items()}
        session.config.workeroutput["dsv4_cpu_line"] = f"{'/'.join(_early_started)} lane, {_cpu_line()}"
        return
    count = sum(len(v) for v in _compiles.values())
    if count > COMPILE_COUNT_CAP and exitstatus == 0:
        session.exitstatus = 1
        print(f"\nFAILED: {count} XLA compiles exceed the cap of {COMPILE_COUNT_CAP} (see the table above)")


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return FIXTURES / "golden"




# ---- the tiny float32 engine of tests/test_engine.py and tests/test_async_engine.py --------------
# Both files build `LLM(path, **tiny_engine_args())` on a checkpoint of dsv4-tiny-test with
# TINY_ENGINE_LAYERS, each with its own weights (weights are arguments of the compiled steps, not
# constants), so whichever file runs second finds every step and sampler executable in its lane's
# persistent cache. The async tests run 4 sequences of 6-token prompts: well inside these limits.
TINY_ENGINE_LAYERS = {"sliding_window": 4, "compress_ratios": (0, 4, 16, 4, 0), "index_topk": 2}


def tiny_engine_args() -> dict:
    from dsv4_jax.engine.runner import StepBuckets

    return {"dtype": "float32", "kv_cache_dtype": "float32", "max_model_len": 256, "max_num_seqs": 4,
            "block_size": 128, "buckets": StepBuckets(prefill=((1, 16), (4, 32)), decode=(4,)),
            "num_gpu_blocks_override": 10, "seed": 0, "enable_prefix_caching": False}


@contextlib.contextmanager
def jax_persistent_cache_off():
    """JAX's persistent compilation cache off inside: a compile is XLA's own (the suite's cache is
    warm), as the program cache (dsv4_jax/engine/program_cache.py) keeps only those."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def capped_block_manager(usable_blocks: int):
    """A block-manager factory for `LLM.from_engine_args` / `Scheduler`: the pools keep their
    shapes (so the engine's programs are the uncapped one's) but only `usable_blocks` compressed
    blocks are handed out, so a few short requests are enough to preempt."""
    from dsv4_jax.engine.block_manager import BlockManager

    def make(num_seq_slots: int, num_compressed_blocks: int, block_size: int, max_blocks_per_seq: int):
        if not 1 <= usable_blocks <= num_compressed_blocks:
            raise ValueError(f"usable_blocks must be in [1, {num_compressed_blocks}], got {usable_blocks}")
        return BlockManager(num_seq_slots, usable_blocks, block_size, max_blocks_per_seq)  # ids below it only

    return make


# ---- the chat engine shared by the engine and server tests ---------------------------------------
# A one-layer model with the real vocabulary (the V4 chat format's special tokens are ids above
# 128,000), float32 weights and cache, 8 sequences, prefix caching off (tests repeat prompts and
# compare them; tests/test_prefix_caching.py turns it on). The server tests start `python -m serve` with
# exactly these flags, so the server's warm-up loads what this fixture compiled.
CHAT_SERVER_FLAGS = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--max-model-len", "512",
                     "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--block-size", "128", "--seed", "0",
                     "--no-enable-prefix-caching")


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    from dsv4_jax.presets import get_config
    from dsv4_jax.testing import write_random_checkpoint

    config = get_config("dsv4-tiny-test").replace(
        sliding_window=4, compress_ratios=(16,), index_topk=2, vocab_size=129280, num_hidden_layers=1,
        num_nextn_predict_layers=0)
    return write_random_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", config, seed=4)


@pytest.fixture(scope="session")
def chat_llm(chat_checkpoint):
    """`LLM` with the server's flags: its executables are in the persistent cache (every compile
    is persisted, see above), and, with the program cache on for it (nothing is patched while it
    is built), in this lane's program cache, so a server started with the same flags
    (`CHAT_SERVER_ENV`) reads every program back: nothing traced, nothing compiled."""
    from dsv4_jax import LLM
    from serve.args import parse_args

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSV4_JAX_PROGRAM_CACHE", "1")
        return LLM.from_engine_args(parse_args([str(chat_checkpoint), *CHAT_SERVER_FLAGS]).engine)


# What a `python -m serve` child with CHAT_SERVER_FLAGS adds to this process's environment: the
# CPU, this worker's caches (the compilation cache and the program cache chat_llm filled).
def chat_server_env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
            "DSV4_JAX_PROGRAM_CACHE": "1"}


CHAT_SERVER_KEY, CHAT_SERVER_NAME = "test-key", "dsv4-test"


def serving_state(llm, *flags: str, name: str = CHAT_SERVER_NAME):
    """A ready `serve.state.ServingState` over `llm`'s engine, as `python -m serve` with the chat
    server's flags (and `flags`) would hold it, without a server process; its engine is not
    started yet (`await state.engine.start()`). Metrics report an idle engine. The server's flags
    (`flags` too) set its request limits (the parsers, auto tool choice); the engine, with its
    structured-outputs config, is `llm`'s as built."""
    from dsv4_jax.engine.async_engine import AsyncLLMEngine
    from dsv4_jax.engine.outputs import EngineStats
    from serve.args import parse_args
    from serve.metrics import ServerMetrics
    from serve.protocol import ServerLimits
    from serve.state import ServingState

    args = parse_args(["ckpt", *CHAT_SERVER_FLAGS, *flags])
    state = ServingState(args, served_model_names=(name,), config=llm.engine_config)
    state.engine, state.layout = AsyncLLMEngine(llm.engine), llm.layout
    state.limits = ServerLimits(served_model_names=(name,), vocab_size=llm.config.vocab_size,
                                enable_auto_tool_choice=args.enable_auto_tool_choice,
                                reasoning_parser=args.reasoning_parser,
                                structured_outputs_config=llm.engine_config.structured_outputs_config)
    state.metrics = ServerMetrics(name, lambda: EngineStats(0, 0, 0.0, 0))
    state.ready = True
    return state


def wait_healthy(base: str, processes: list, log_path: Path, timeout_s: float = 300) -> None:
    """Until `base`/health says 200; fails with the log's tail if any process exits or time runs out."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert all(p.poll() is None for p in processes), log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_port(span: int = 1) -> int:
    """A port free now, with the `span - 1` after it (--master-port: the step channel's is next),
    below the kernel's ephemeral range where there is one: outgoing connections (other tests'
    clients, gloo's) take ephemeral ports, so a port free_port() found may be taken again by the
    time a node binds it."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    draw = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(100):
        port = draw.randrange(10_000, low - span) if low > 10_000 + span else free_port()
        try:
            with contextlib.ExitStack() as held:
                for offset in range(span):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {span} free ports in a row")


@pytest.fixture(scope="session")
def chat_server(chat_llm, chat_checkpoint, tmp_path_factory):
    """One `python -m serve` process for the session, with the chat_llm fixture's flags and this
    process's compilation cache (so its warm-up compiles nothing, which is checked), an API key,
    the default deepseek_v4 parsers and auto tool choice, and structured outputs that bind the
    reasoning too (`enable_in_reasoning`), so that a test can force a whole answer, reasoning and
    `</think>` included, with a grammar, and JSON without free whitespace (`disable_any_whitespace`:
    a random model would otherwise spend its tokens on whitespace). A dict: base URL, key, served name, process, log path,
    whether /health said 503 first and that first 503's body."""
    import signal
    import subprocess
    import sys
    import time

    import httpx

    port = quiet_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = chat_server_env()
    command = [sys.executable, "-m", "serve", str(chat_checkpoint), *CHAT_SERVER_FLAGS, "--port", str(port),
               "--served-model-name", CHAT_SERVER_NAME, "--api-key", CHAT_SERVER_KEY,
               "--structured-outputs-config", '{"enable_in_reasoning": true, "disable_any_whitespace": true}']
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    first_503 = None  # the body of the first 503 /health answered while the model loaded
    while True:
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        try:
            health = httpx.get(f"{base}/health", timeout=5)
        except httpx.TransportError:
            health = None
        if health is not None and health.status_code == 503 and first_503 is None:
            first_503 = health.json()
        if health is not None and health.status_code == 200:
            break
        time.sleep(0.2)
    log_text = log_path.read_text()
    # Nothing compiled: the chat_llm fixture put every executable in the cache. The start-up log
    # names the KV layout (once: the checks before the weights load resolve it quietly), the
    # capacity and the bind address.
    assert "warm-up: 0 compiles" in log_text, log_text
    assert log_text.count("KV cache: ") == 1, log_text
    assert "KV cache: float32 on xla" in log_text and "8 sequence slots" in log_text, log_text
    assert f"listening on http://127.0.0.1:{port}" in log_text, log_text
    yield {"base": base, "key": CHAT_SERVER_KEY, "name": CHAT_SERVER_NAME, "process": process, "log": log_path,
           "seen_503": first_503 is not None, "first_503": first_503}
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
