"""`python -m serve`: parse vLLM's flags, check everything that needs no weights (bad values fail
here with one line and exit status 2), bind the port, then load and warm up the model on a thread
while `/health` answers 503; serve until SIGTERM / SIGINT, then stop accepting (503), let what runs
finish for a grace period, abort the rest and exit 0. While it serves, vLLM's stats line goes to the
log every VLLM_LOG_STATS_INTERVAL seconds (serve/stats_log.py; --disable-log-stats turns it off).

JAX's persistent compilation cache is on for every program (`dsv4_jax.engine.compilation_cache`: under
`$DSV4_JAX_CACHE/jax-cache`, or `$JAX_COMPILATION_CACHE_DIR`), so a restart's warm-up loads
executables instead of compiling them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
from typing import NoReturn, Sequence

import uvicorn

from pallas_kernels.cli import one_line, run_main

logger = logging.getLogger("serve")

SHUTDOWN_GRACE_SECONDS = 10.0
NOISY_LOGGERS = ("jax", "absl", "orbax")


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    # Other libraries' start-up chatter at INFO (JAX probing for TPUs, orbax's and absl's settings)
    # says nothing a user of this server can act on; their warnings and errors still show.
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _QuietPaths(logging.Filter):
    """Drops uvicorn's access-log lines of requests to `paths` (a health probe every few seconds,
    a Prometheus scrape: lines that would bury every other one)."""

    def __init__(self, paths: Sequence[str]):
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client address, method, path with its query, HTTP version, status)
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in self.paths
        return True


def _enable_compilation_cache() -> None:
    from dsv4_jax.engine.compilation_cache import enable_compilation_cache

    directory = enable_compilation_cache(every_program=True)
    logger.info("JAX compilation cache: %s", directory or "off (JAX_ENABLE_COMPILATION_CACHE)")


def main(argv: Sequence[str] | None = None) -> int:
    _configure_logging()
    from serve.args import node_flags, parse_args

    try:
        args = parse_args(argv)
    except ValueError as refused:
        node = node_flags(argv)
        if node is not None:
            _stop_on_refused_flags(node, refused)
        raise
    _enable_compilation_cache()

    from dsv4_jax.parallel.distributed import StartUp, initialize

    initialize(args.distributed)  # several hosts: before anything touches a device
    if args.distributed.headless:
        return _follow(args.engine)
    if args.model_is_builtin:
        logger.info("no model given: serving the built-in %s (random weights, the real V4 tokenizer)", args.model)
    with StartUp(args.distributed):  # several hosts: a failure here is told to the followers
        # Every check that needs no weights, and every default resolved, before the port opens.
        config = args.engine.create_engine_config()
        # Bound before the model loads (uvicorn would bind after starting the lifespan, which loads).
        listeners = _listen(args.host, args.port)
    state = None
    try:
        from serve.app import build_app
        from serve.state import ServingState

        state = ServingState(args, served_model_names=tuple(args.served_model_name), config=config)
        app = build_app(state)
        server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                        access_log=not args.disable_uvicorn_access_log, lifespan="on",
                                        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_SECONDS) + 5), state)
        logging.getLogger("uvicorn.access").addFilter(_QuietPaths(args.disable_access_log_for_endpoints))
        app.router.lifespan_context = _lifespan(state, server)
        scope = "this machine only" if args.host in ("127.0.0.1", "localhost", "::1") else "the network"
        logger.info("listening on http://%s:%d (%s; vllm serve binds all interfaces by default, "
                    "pass --host 0.0.0.0 for that)", args.host, listeners[0].getsockname()[1], scope)
        server.run(sockets=listeners)
    finally:
        if args.distributed.nnodes > 1:
            _release_followers(args.distributed, state)
    if state.load_error is not None:
        print(f"serve: error: {state.load_error}", file=sys.stderr)
        return 2
    return 0


def _stop_on_refused_flags(node, refused: ValueError) -> NoReturn:
    """A node of several whose flags are refused: printed at once, then told to the other nodes,
    which would wait for it in `jax.distributed.initialize` (`join_to_announce`; status 2)."""
    from dsv4_jax.parallel.distributed import join_to_announce

    reason = one_line(refused)
    print(f"serve: error: {reason}", file=sys.stderr)
    join_to_announce(node, reason, code=2)


def _listen(host: str, port: int) -> list[socket.socket]:
    """A bound socket for each address `host` names, as uvicorn's asyncio server binds them
    (`localhost`: 127.0.0.1 and ::1, skipping a family this machine lacks); a ValueError naming
    --host / --port."""
    listeners: list[socket.socket] = []
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, address in dict.fromkeys((family, address) for family, _, _, _, address in found):
            try:
                listener = socket.socket(family, socket.SOCK_STREAM)
            except OSError:  # a family this kernel lacks (asyncio skips it too)
                continue
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                listener.bind(address)
            except OSError as error:
                listener.close()
                if error.errno == errno.EADDRNOTAVAIL and len(found) > 1:  # that family is off here
                    continue
                raise
            listeners.append(listener)
    except OSError as error:
        for listener in listeners:
            listener.close()
        why = os.strerror(error.errno) if error.errno and error.errno > 0 else str(error)
        advice = {errno.EADDRINUSE: "pass a free --port", errno.EACCES: "pass a --port above 1023 (or run as root)",
                  errno.EADDRNOTAVAIL: "--host must be an address of this machine"}.get(error.errno, "check --host")
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {why}; {advice}") from None
    if not listeners:
        raise ValueError(f"--host {host} --port {port}: cannot listen there: no address of this machine")
    return listeners


def _release_followers(node, state) -> None:
    """Node 0 of several is leaving: its followers may wait for it (in the handshake, or in a
    collective while loading). Once it served, the engine's shutdown released them; once built,
    they are sent the stop; a start-up that failed announced itself; else (a signal while loading,
    or an error before it) the stop is announced, and every node leaves (`leave_failed_start`)."""
    from dsv4_jax.parallel.distributed import announce_start_failure

    if state is not None and state.engine is not None:
        return
    if state is not None and state.built is not None:
        state.built.engine.stop_followers()
    elif state is None or state.load_error is None:
        announce_start_failure(node, "node 0's server stopped before its model was loaded")


def _follow(engine_args) -> int:
    """A follower node: build the same engine on its devices, then run node 0's steps until node 0
    shuts down (exit 0) or disappears (exit 1, with the reason)."""
    from dsv4_jax.engine.builder import build_engine
    from dsv4_jax.parallel.distributed import StartUp

    try:
        with StartUp(engine_args.distributed):  # a ValueError (flags that differ from node 0's, ...) is one line
            config = engine_args.create_engine_config()
        built = build_engine(config)
    except RuntimeError as error:  # node 0 unreachable, or gone while starting
        print(f"serve: error: {error}", file=sys.stderr)
        return 1
    logger.info("follower node %d: running node 0's steps", engine_args.node_rank)
    try:
        calls = built.follow()
    except RuntimeError as error:
        print(f"serve: error: {error}", file=sys.stderr)
        return 1
    logger.info("node 0 shut down after %d device calls; exiting", calls)
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, whose exit signal first marks the state as no longer accepting (new
    requests get 503 while running ones finish)."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        # uvicorn's own handler also re-raises the signal once stopped, so the process would die
        # of SIGTERM; a clean shutdown here exits 0 (a second SIGINT still forces the exit).
        if self.state.accepting:
            logger.info("signal %d: no new requests; finishing what runs (up to %.0fs)", sig, SHUTDOWN_GRACE_SECONDS)
        self.state.accepting = False
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def _lifespan(state, server):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        from dsv4_jax.engine.async_engine import AsyncLLMEngine
        from dsv4_jax.engine.outputs import EngineStats
        from serve.metrics import ServerMetrics, idle_engine_stats
        from serve.stats_log import StatsSample, run_stats_logger

        idle = idle_engine_stats(state.config.num_speculative_tokens)

        def stats() -> EngineStats:
            return idle if state.engine is None else state.engine.stats()

        def sample() -> StatsSample | None:  # the periodic stats line's, once the engine serves
            return None if state.engine is None else StatsSample(state.engine.stats(), *state.metrics.token_totals())

        state.metrics = ServerMetrics(state.model_name, stats, max_model_len=state.max_model_len)
        stats_log = None if state.args.disable_log_stats else asyncio.create_task(
            run_stats_logger(sample, state.args.log_stats_interval))
        loop = asyncio.get_running_loop()
        loaded = loop.create_future()

        def load() -> None:
            try:
                from dsv4_jax.engine.builder import build_engine

                built = build_engine(state.config, progress=state.starting)
                state.built = built  # a stop before it serves must release its followers
            except BaseException as error:  # noqa: BLE001  (reported on the loop, then the server stops)
                logger.debug("loading failed", exc_info=True)
                loop.call_soon_threadsafe(_set, loaded, error)
                return
            loop.call_soon_threadsafe(_set, loaded, built)

        threading.Thread(target=load, name="dsv4-load", daemon=True).start()
        waiter = asyncio.create_task(_become_ready(state, server, loaded, AsyncLLMEngine))
        try:
            yield
        finally:
            state.accepting = False
            waiter.cancel()
            if stats_log is not None:
                stats_log.cancel()
            if state.engine is not None:
                await state.engine.shutdown(grace_seconds=SHUTDOWN_GRACE_SECONDS)
            logger.info("stopped")

    return lifespan


def _set(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def server_limits(args, config, served_model_names: tuple[str, ...]):
    """The `ServerLimits` requests are checked against: the server's flags (`args`) with the
    engine's config as built (its vocabulary, generation_config.json defaults, structured outputs)."""
    from serve.protocol import ServerLimits

    return ServerLimits(
        served_model_names=served_model_names, vocab_size=config.model_config.vocab_size,
        max_logprobs=args.max_logprobs, enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser, force_include_usage=args.enable_force_include_usage,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        default_sampling=config.sampling_defaults,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        structured_outputs_config=config.structured_outputs_config,
    )


async def _become_ready(state, server, loaded: asyncio.Future, engine_class) -> None:
    result = await loaded
    if isinstance(result, BaseException):
        state.load_error = one_line(result)
        logger.error("loading the model failed: %s", state.load_error)
        server.should_exit = True
        return
    built, args = result, state.args
    state.config = config = built.config  # as built (a max_num_seqs the pools bound, its buckets)
    if config.sampling_defaults:
        logger.info("default sampling parameters from generation_config.json: %s", config.sampling_defaults)
    state.limits = server_limits(args, config, state.served_model_names)
    engine = engine_class(built.engine)
    await engine.start()
    state.engine, state.layout = engine, built.engine.runner.layout
    state.ready = True
    logger.info("ready: %s serves %s (max_model_len %d, up to %d sequences at once)", args.model,
                ", ".join(state.served_model_names), state.max_model_len, state.layout.num_seq_slots)


def entry(argv: Sequence[str] | None = None) -> None:
    try:
        run_main(main, argv, prog="serve")
    except SystemExit as done:  # several hosts, a failed start-up: leave past JAX's shutdown barrier
        from dsv4_jax.parallel.distributed import leave_failed_start

        leave_failed_start(done.code if isinstance(done.code, int) else int(done.code is not None))
        raise
