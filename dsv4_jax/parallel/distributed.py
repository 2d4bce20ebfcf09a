"""Several hosts (vLLM's `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`): one JAX
program over every host's devices.

`initialize` starts `jax.distributed` (before anything touches a device) with a 60 s heartbeat
timeout instead of JAX's 100 s, and gloo collectives on CPU. Process 0 (the leader) runs the
scheduler and serves HTTP; every other process (a follower, `--headless`) runs the same device
calls in the same order, as the leader sends them over a `StepChannel`: each collective then has
all of its participants. A follower's connection is also its heartbeat: when it drops, the
leader cannot run another step (it would wait in a collective for a dead peer), so it says which
node is gone and exits at once.

The channel listens on `--master-port` + 1 of the leader (the port itself is JAX's coordinator)
and carries pickled host arrays: run it on a trusted network only, as vLLM's own channels.

A node that fails while starting (a flag that differs from node 0's, a missing checkpoint, the
channel's port taken, a truncated shard) says why in JAX's coordination service, which every node
has joined by then (`StartUp`, `announce_start_failure`): the nodes waiting for the channel poll
it, and once the channel is up a thread does until the warm-up ends (the main thread may be
waiting in a collective for the failed node). Every node then exits within seconds, naming the
node and its reason, past JAX's shutdown barrier (`leave_failed_start`: the barrier would wait for
nodes that left and then abort the process). Without it the others would wait out their own
timeouts (minutes), and the failed node with them in that barrier. A node whose flags
`python -m serve` refuses joins only to announce that (`join_to_announce`, waiting up to 60 s for
the others; Ctrl-C ends the wait). One whose node flags are themselves bad, or that has
`--headless` without `--node-rank`, cannot join: the others wait for it in
`jax.distributed.initialize`.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import pickle
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, NoReturn

from pallas_kernels.cli import one_line

logger = logging.getLogger(__name__)

# jax.distributed's default is 100 s. The step channel finds a dead node at once; the heartbeat is
# the last resort (a node killed before the channel is up, a hung one), so it must outlast a host
# that stops for a while: with 10 s, an idle pair on a loaded CI machine was called dead (both
# nodes at once, a stall) and aborted; tests/test_multihost.py stops both nodes for 20 s.
HEARTBEAT_TIMEOUT_S = 60
POLL_S = 1.0  # how often a node waiting for the step channel looks for another node's start-up failure
# How long node 0 of a failed start-up waits for the others to read why and leave (they poll every
# POLL_S; one gone without a word costs the whole wait). A few polls would do, but a stalled
# machine's nodes miss some.
LEAVE_WAIT_S = 15.0
_START_FAILED = "dsv4_jax/start_failed/"  # + a node's rank: why that node stopped while starting
_LEFT = "dsv4_jax/left/"  # + a node's rank: it exited on another node's start-up failure
_node: DistributedConfig | None = None  # this process's node, once `initialize` ran
_announced = threading.Event()  # this node announced a start-up failure of its own
_stopped_on_peer = threading.Event()  # this node stops because another one failed while starting
_leaving = threading.RLock()  # held by the thread that ends the process after a failed start-up
_LENGTH = struct.Struct("!Q")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """vLLM's multi-node flags; `nnodes` 1 means one process (nothing to set up)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    headless: bool = False  # a follower: no HTTP, it runs the leader's steps

    def __post_init__(self) -> None:
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"--nnodes must be an integer >= 1, got {self.nnodes!r}")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes={self.nnodes}), got {self.node_rank!r}")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) \
                or not 1 <= self.master_port <= 65534:
            raise ValueError(f"--master-port must be in [1, 65534] (the step channel uses it + 1), "
                             f"got {self.master_port!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"--master-addr must be a host name or address, got {self.master_addr!r}")
        if self.headless and self.node_rank == 0:
            raise ValueError("--headless is for the followers (--node-rank >= 1); node 0 serves HTTP")
        if self.node_rank > 0 and not self.headless:
            raise ValueError(f"--node-rank {self.node_rank} runs the leader's steps and serves nothing: "
                             "pass --headless")

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def channel_address(self) -> tuple[str, int]:
        return self.master_addr, self.master_port + 1


def initialize(config: DistributedConfig, timeout_s: int = 300) -> None:
    """`jax.distributed.initialize` for `config` (once per process; nothing for one node),
    waiting up to `timeout_s` for every node to join (JAX's default)."""
    if config.nnodes == 1:
        return
    import jax

    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(
        coordinator_address=f"{config.master_addr}:{config.master_port}", num_processes=config.nnodes,
        process_id=config.node_rank, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S, initialization_timeout=timeout_s,
    )
    logger.info("jax.distributed: node %d of %d, %d devices in all (%d here)", config.node_rank, config.nnodes,
                jax.device_count(), jax.local_device_count())
    global _node
    _node = config
    atexit.register(leave_failed_start, 1)  # runs before JAX's own exit handler (registered at its import)


def _coordination_client() -> Any:
    """JAX's coordination-service client, whose key-value store every node reaches (None without
    jax.distributed). JAX has no public key-value API; this attribute has been stable since 0.4."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


class PeerStopped(RuntimeError):
    """Another node stopped while starting (`node`, its `reason`): this node stops as a consequence."""

    def __init__(self, node: int, reason: str):
        super().__init__(f"node {node} stopped while starting: {reason}")
        self.node, self.reason = node, reason


class StartUp:
    """A node's start-up in a multi-node run, from `initialize` to the end of warm-up, as a context.

    An exception inside it is announced to the other nodes (they stop waiting and exit naming it)
    and closes the step channel, then propagates. One caused by another node's failure is not
    announced: a `PeerStopped`, or a closed channel, which becomes the `PeerStopped` naming the
    node that announced (else a RuntimeError asking whether another node died).
    Once the channel is up (`watch`), a thread watches for the other nodes' announcements: this
    node's main thread may then be inside a collective that waits for the failed node (placing
    weights, measuring activations, warming up), which gloo gives up after 30 s and a GPU
    collective may never give up, so the thread ends the process, naming the node and its reason.
    With one node it does nothing."""

    def __init__(self, config: DistributedConfig):
        self.config = config
        self._channel: StepChannel | None = None
        self._done = threading.Event()

    def __enter__(self) -> StartUp:
        return self

    def watch(self, channel: StepChannel) -> None:
        """The channel is up: from here a failure elsewhere can leave this node in a collective."""
        self._channel = channel
        threading.Thread(target=self._watch_others, daemon=True, name="start-up-watch").start()

    def _watch_others(self) -> None:
        while not self._done.wait(POLL_S):
            cause = _failure_elsewhere(self.config.node_rank)
            if cause is not None and not self._done.is_set():
                _exit_as_stopped(self.config.node_rank, *cause)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        self._done.set()
        if error is None or self.config.nnodes == 1:
            return
        consequence: BaseException | None = None
        # A closed channel, or a collective's error once a peer left: the peer may be announcing why.
        cause = _failure_elsewhere(self.config.node_rank, wait_s=2 * POLL_S) if _may_be_a_peers_doing(error) else None
        if isinstance(error, PeerStopped):
            _stopped_on_peer.set()
        elif cause is not None or _stopped_on_peer.is_set():
            _stopped_on_peer.set()
            consequence = PeerStopped(*cause) if cause else None
        elif _is_channel_error(error):  # a peer gone without a word
            _stopped_on_peer.set()
            consequence = RuntimeError(f"the step channel closed while node {self.config.node_rank} was starting "
                                       f"({error}): did another node die?")
        else:  # before closing the channel: a peer that reads its end looks for the reason at once
            announce_start_failure(self.config, one_line(error))
        if self._channel is not None:  # the traceback keeps it alive: the peers would wait on it
            self._channel.close()
        if consequence is not None:
            raise consequence from error


def announce_start_failure(config: DistributedConfig, reason: str) -> None:
    """Tell the other nodes why this one stops while starting (logged here first: once the others
    exit, JAX may end this process before it prints anything)."""
    logger.error("node %d stopped while starting (the other nodes are told): %s", config.node_rank, reason)
    _announced.set()
    error = _put(f"{_START_FAILED}{config.node_rank}", reason)
    if error is not None:  # the coordinator may be gone, or this node announced already
        logger.warning("could not tell the other nodes why this one stopped: %s", error)


def join_to_announce(config: DistributedConfig, reason: str, code: int, timeout_s: int = 60) -> NoReturn:
    """A node that stops before its start-up began (its flags refused): the other nodes would
    wait for it in `jax.distributed.initialize` for minutes, so it joins them only to announce
    `reason`, then exits with status `code`. It waits up to `timeout_s` for them to start (a
    stale process must not announce into a later launch); Ctrl-C ends the wait."""
    outcome: list[BaseException | None] = []  # the join's: None once joined, else why not; first one wins
    decided = threading.Lock()

    def settle(result: BaseException | None) -> None:
        with decided:
            if not outcome:
                outcome.append(result)

    def join() -> None:
        try:  # JAX's own timeout aborts the process (a fatal error): this one's ends the wait first
            initialize(config, timeout_s=timeout_s + 30)
        except Exception as error:  # noqa: BLE001  (reported below)
            settle(error)
        settle(None)

    logger.info("node %d of %d: telling the other nodes why it stops (waiting up to %d s for them at %s:%d)",
                config.node_rank, config.nnodes, timeout_s, config.master_addr, config.master_port)
    threading.Thread(target=join, daemon=True, name="announce-join").start()
    deadline = time.monotonic() + timeout_s
    try:
        while not outcome and time.monotonic() < deadline:
            time.sleep(0.2)  # short waits: Ctrl-C gets through
    except KeyboardInterrupt:
        settle(KeyboardInterrupt())
    settle(TimeoutError(f"not every node joined within {timeout_s} s"))  # unless decided already
    if outcome[0] is not None:  # not joined: JAX's exit handler would shut down a client that never connected
        logger.warning("could not tell the other nodes why this one stopped: %s", one_line(outcome[0]))
        _exit_now(code)
    announce_start_failure(config, reason)
    leave_failed_start(code)
    _exit_now(code)  # unreachable: leave_failed_start exits once a failure was announced


def _exit_now(code: int) -> NoReturn:
    """End the process with status `code`, logs and streams flushed, skipping the exit handlers
    (JAX's shutdown barrier would wait for nodes that are gone, then abort the process)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_failed_start(code: int) -> None:
    """End this process now with status `code` if its multi-node start-up failed (it announced a
    failure, or stops on another node's); return at once otherwise.

    It leaves past JAX's shutdown barrier: every node of a failed start-up leaves this way, so the
    barrier would wait for them until the heartbeat timeout and then abort the process with a
    fatal error. Node 0 first waits (LEAVE_WAIT_S at most) until every other node has announced or
    left: the coordination service they read the reason from ends with node 0's process."""
    config = _node
    if config is None or not (_announced.is_set() or _stopped_on_peer.is_set()):
        return
    if not _leaving.acquire(blocking=False):  # another thread is ending the process
        threading.Event().wait()
    _put(f"{_LEFT}{config.node_rank}", "")  # best effort: the coordinator may be gone
    if config.is_leader:
        deadline = time.monotonic() + LEAVE_WAIT_S
        others = set(range(1, config.nnodes))
        while time.monotonic() < deadline and not others <= set(_by_node(_LEFT)) | set(start_failures()):
            time.sleep(0.1)
    _exit_now(code)


def start_failures() -> dict[int, str]:
    """{node rank: reason} of the nodes that announced a start-up failure (empty without
    jax.distributed, or when the coordination service cannot be read: it may be gone)."""
    return _by_node(_START_FAILED)


def _put(key: str, value: str) -> Exception | None:
    """Set `key` in the key-value store (nothing without jax.distributed); the store's error, if any."""
    client = _coordination_client()
    if client is None:
        return None
    from jax.errors import JaxRuntimeError

    try:
        client.key_value_set(key, value)
    except JaxRuntimeError as error:
        return error
    return None


def _by_node(prefix: str) -> dict[int, str]:
    """The key-value store's entries under `prefix`, by the node rank that ends each key."""
    client = _coordination_client()
    if client is None:
        return {}
    from jax.errors import JaxRuntimeError

    try:
        entries = client.key_value_dir_get(prefix)
    except JaxRuntimeError:
        return {}
    return {int(key.rsplit("/", 1)[1]): value for key, value in entries}


def _failure_elsewhere(node_rank: int, wait_s: float = 0.0) -> tuple[int, str] | None:
    """(node, reason) of the lowest other node that announced a start-up failure, polled for up to
    `wait_s` (a peer's sockets may close a moment before its reason is readable)."""
    deadline = time.monotonic() + wait_s
    while True:
        others = {node: why for node, why in start_failures().items() if node != node_rank}
        if others:
            return min(others), others[min(others)]
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(0.2, wait_s))


def _is_channel_error(error: BaseException) -> bool:
    return isinstance(error, (EOFError, ConnectionError))


def _may_be_a_peers_doing(error: BaseException) -> bool:
    """A closed channel, or a runtime error (a collective whose peer left); not a bad flag or file."""
    from jax.errors import JaxRuntimeError

    return _is_channel_error(error) or isinstance(error, JaxRuntimeError)


def _exit_on_lost(node: int, reason: str) -> None:
    """The leader's reaction to a follower's closed connection (the leader is node 0)."""
    if _announced.is_set() or _stopped_on_peer.is_set():  # a failed start-up: everyone is leaving
        return
    said = start_failures().get(node)  # a follower that failed while starting said why first
    if said:
        _exit_as_stopped(0, node, said)
    logger.critical("follower node %d is gone (%s): every step needs all nodes (a collective would wait for it "
                    "forever), so this process exits", node, reason)
    _exit_now(1)


def _exit_as_stopped(this_node: int, node: int, reason: str) -> None:
    """From a thread, while the main one may wait in a collective for the failed node."""
    if not _leaving.acquire(blocking=False):  # another thread is ending the process
        threading.Event().wait()
    logger.critical("node %d stopped while starting, so node %d exits too (its collectives would wait for node %d):"
                    " %s", node, this_node, node, reason)
    _stopped_on_peer.set()
    leave_failed_start(1)


class StepChannel:
    """The leader's messages to its followers, in order. `leader(config)` waits for every follower
    to connect; `follower(config)` connects to the leader (retrying while it starts)."""

    def __init__(self, sockets: dict[int, socket.socket], on_lost: Callable[[int, str], None] | None = None):
        self._sockets = sockets
        self._lock = threading.Lock()
        self._closed = False
        self._on_lost = on_lost or _exit_on_lost

    @classmethod
    def leader(cls, config: DistributedConfig, settings: dict[str, Any], timeout_s: float = 300.0,
               on_lost: Callable[[int, str], None] | None = None) -> StepChannel:
        """Wait for every follower; each sends its node rank and `settings` (what must be the same
        on every node: model, dtype, mesh, limits). A follower whose settings differ gets the
        differences back and this raises a ValueError naming them, as the follower does."""
        server = _listen(config)
        try:
            sockets, differences = _accept_followers(server, config, settings, timeout_s)
        finally:
            server.close()
        _send_verdict(sockets, differences)
        channel = cls(sockets, on_lost)
        for node, conn in sockets.items():  # followers never send again: a read returns only when one is gone
            threading.Thread(target=channel._watch, args=(node, conn), daemon=True, name=f"follower-{node}").start()
        logger.info("step channel: %d follower(s) connected, settings agree", len(sockets))
        return channel

    @classmethod
    def follower(cls, config: DistributedConfig, settings: dict[str, Any], timeout_s: float = 300.0) -> StepChannel:
        """Connect to the leader and send this node's rank and `settings`; a ValueError naming the
        differences when the leader's differ."""
        deadline = time.monotonic() + timeout_s
        address = f"{config.channel_address[0]}:{config.channel_address[1]}"

        def stop_if_another_failed() -> None:
            cause = _failure_elsewhere(config.node_rank)
            if cause is not None:
                raise PeerStopped(*cause)

        next_poll = time.monotonic() + POLL_S
        while True:
            try:
                conn = socket.create_connection(config.channel_address, timeout=10)
                break
            except OSError:
                if time.monotonic() > next_poll:  # node 0 may have stopped before opening the channel
                    stop_if_another_failed()
                    next_poll = time.monotonic() + POLL_S
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not reach node 0's step channel at {address} "
                                       f"within {timeout_s:.0f}s") from None
                time.sleep(0.2)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            _write_message(conn, (config.node_rank, settings))
            # Node 0 answers once every follower has joined; meanwhile a node may stop, or what
            # answered on node 0's port may not be node 0 at all.
            conn.settimeout(POLL_S)
            while True:
                try:
                    conn.recv(1, socket.MSG_PEEK)  # the verdict's first byte, or b"" at the channel's end
                    break
                except TimeoutError:
                    stop_if_another_failed()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"node 0's step channel at {address} gave no verdict on the flags "
                                           f"within {timeout_s:.0f}s") from None
            conn.settimeout(None)
            verdict = _read_message(conn)
        except (OSError, EOFError) as error:  # StartUp names the node that stopped, if one said so
            conn.close()
            raise ConnectionError(f"node 0 closed the step channel before its verdict on the flags ({error})") from None
        except BaseException:
            conn.close()
            raise
        if verdict:
            conn.close()
            raise ValueError(f"the nodes must be started with the same model and flags: {verdict}")
        return cls({0: conn})

    def send(self, message: Any) -> None:
        """Leader: one message to every follower."""
        frame = _frame(message)  # pickled once for every follower
        with self._lock:
            for node, conn in self._sockets.items():
                try:
                    conn.sendall(frame)
                except OSError as error:
                    if not self._closed:
                        self._on_lost(node, f"sending failed: {error}")

    def receive(self) -> Any:
        """Follower: the leader's next message (EOFError when the leader is gone)."""
        return _read_message(self._sockets[0])

    def finish(self, message: Any) -> None:
        """Leader: a last message, then close. Marked closed first: followers hang up as soon as
        they read it, which is then no loss."""
        self._closed = True
        self.send(message)
        self.close()

    def close(self) -> None:
        self._closed = True
        for conn in self._sockets.values():
            conn.close()

    def _watch(self, node: int, conn: socket.socket) -> None:
        try:
            data = conn.recv(1)
            reason = "it sent data" if data else "connection closed"
        except OSError as error:
            reason = str(error)
        if not self._closed:
            self._on_lost(node, reason)


# ---- the leader's side of the start-up handshake -------------------------------------------------
def _listen(config: DistributedConfig) -> socket.socket:
    """Node 0's step-channel socket; a ValueError naming the flags when it cannot listen."""
    try:
        server = socket.create_server(config.channel_address, reuse_port=False)
    except OSError as error:
        host, port = config.channel_address
        why = os.strerror(error.errno) if error.errno else str(error)
        advice = ("--master-addr must be an address of node 0" if error.errno == errno.EADDRNOTAVAIL else
                  "start every node with a --master-port whose next port is free on node 0")
        raise ValueError(f"--master-addr {host} --master-port {config.master_port}: node 0's step channel cannot "
                         f"listen on {host}:{port} (--master-port + 1): {why}; {advice}") from None
    server.settimeout(POLL_S)  # between accepts: has a follower announced that it stopped?
    return server


def _accept_followers(server: socket.socket, config: DistributedConfig, settings: dict[str, Any],
                      timeout_s: float) -> tuple[dict[int, socket.socket], list[str]]:
    """Every follower's connection by node rank, and each difference between its settings and
    `settings`. On any error the connections made so far are closed first: the followers waiting
    for a verdict read the end of the channel."""
    deadline = time.monotonic() + timeout_s
    sockets: dict[int, socket.socket] = {}
    differences: list[str] = []
    try:
        while len(sockets) < config.nnodes - 1:
            try:
                conn, peer = server.accept()
            except TimeoutError:
                _raise_if_waiting_is_over(config, deadline, timeout_s, len(sockets))
                continue
            hello = _read_hello(conn, peer)
            if hello is None:
                continue
            node, theirs = hello
            if node in sockets or not 0 < node < config.nnodes:
                conn.close()
                raise ValueError(f"a follower announced --node-rank {node}: the ranks of --nnodes {config.nnodes} "
                                 f"are 1..{config.nnodes - 1}, each once")
            sockets[node] = conn
            differences += [f"{name}: node 0 has {settings.get(name)!r}, node {node} has {theirs.get(name)!r}"
                            for name in sorted(set(settings) | set(theirs)) if settings.get(name) != theirs.get(name)]
    except BaseException:
        for conn in sockets.values():
            conn.close()
        raise
    return sockets, differences


def _raise_if_waiting_is_over(config: DistributedConfig, deadline: float, timeout_s: float, connected: int) -> None:
    """PeerStopped when another node announced that it stopped; a RuntimeError past the deadline."""
    cause = _failure_elsewhere(0)
    if cause is not None:
        raise PeerStopped(*cause) from None
    if time.monotonic() > deadline:
        raise RuntimeError(f"only {connected} of {config.nnodes - 1} followers connected to "
                           f"{config.channel_address} within {timeout_s:.0f}s") from None


def _read_hello(conn: socket.socket, peer: Any) -> tuple[int, dict[str, Any]] | None:
    """A new connection's node rank and settings; None (and the connection closed) when the peer is
    not a follower."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(30)  # a peer that connects and says nothing is not a follower
    try:
        node, theirs = _read_message(conn)
    except (OSError, EOFError, ValueError, TypeError, pickle.UnpicklingError) as error:
        logger.warning("step channel: dropped a connection from %s that is not a follower (%s)", peer, error)
        conn.close()
        return None
    conn.settimeout(None)
    return node, theirs


def _send_verdict(sockets: dict[int, socket.socket], differences: list[str]) -> None:
    """Tells every follower whether the settings agree; when they do not, closes the connections
    and raises a ValueError naming the differences."""
    verdict = "; ".join(differences) or None
    for conn in sockets.values():
        _write_message(conn, verdict)
    if verdict:
        for conn in sockets.values():
            conn.close()
        raise ValueError(f"the nodes must be started with the same model and flags: {verdict}")


def _frame(message: Any) -> bytes:
    """A message as sent: its pickled length, then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


def _write_message(conn: socket.socket, message: Any) -> None:
    conn.sendall(_frame(message))


def _read_exact(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the step channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_message(conn: socket.socket) -> Any:
    (length,) = _LENGTH.unpack(_read_exact(conn, _LENGTH.size))
    return pickle.loads(_read_exact(conn, length))
