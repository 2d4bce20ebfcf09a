"""Several hosts (vLLM's `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`): one JAX
program over every host's devices.

`initialize` starts `jax.distributed` (before anything touches a device) with a 10 s heartbeat
timeout instead of JAX's 100 s, and gloo collectives on CPU. Process 0 (the leader) runs the
scheduler and serves HTTP; every other process (a follower, `--headless`) runs the same device
calls in the same order, as the leader sends them over a `StepChannel`: each collective then has
all of its participants. A follower's connection is also its heartbeat: when it drops, the
leader cannot run another step (it would wait in a collective for a dead peer), so it says which
node is gone and exits at once.

The channel listens on `--master-port` + 1 of the leader (the port itself is JAX's coordinator)
and carries pickled host arrays: run it on a trusted network only, as vLLM's own channels.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import struct
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 10  # jax.distributed's default is 100 s
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


def initialize(config: DistributedConfig) -> None:
    """`jax.distributed.initialize` for `config` (once per process; nothing for one node)."""
    if config.nnodes == 1:
        return
    import jax

    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(
        coordinator_address=f"{config.master_addr}:{config.master_port}", num_processes=config.nnodes,
        process_id=config.node_rank, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
    logger.info("jax.distributed: node %d of %d, %d devices in all (%d here)", config.node_rank, config.nnodes,
                jax.device_count(), jax.local_device_count())


def _exit_on_lost(node: int, reason: str) -> None:
    logger.critical("follower node %d is gone (%s): every step needs all nodes (a collective would wait for it "
                    "forever), so this process exits", node, reason)
    logging.shutdown()
    os._exit(1)


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
        server = socket.create_server(config.channel_address, reuse_port=False)
        server.settimeout(timeout_s)
        sockets: dict[int, socket.socket] = {}
        differences: list[str] = []
        try:
            while len(sockets) < config.nnodes - 1:
                conn, peer = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(30)  # a peer that connects and says nothing is not a follower
                try:
                    node, theirs = _read_message(conn)
                except (OSError, EOFError, ValueError, TypeError, pickle.UnpicklingError) as error:
                    logger.warning("step channel: dropped a connection from %s that is not a follower (%s)", peer, error)
                    conn.close()
                    continue
                conn.settimeout(None)
                if node in sockets or not 0 < node < config.nnodes:
                    raise ValueError(f"a follower announced --node-rank {node}: the ranks of --nnodes {config.nnodes} "
                                     f"are 1..{config.nnodes - 1}, each once")
                sockets[node] = conn
                differences += [f"{name}: node 0 has {settings.get(name)!r}, node {node} has {theirs.get(name)!r}"
                                for name in sorted(set(settings) | set(theirs)) if settings.get(name) != theirs.get(name)]
        except TimeoutError:
            raise RuntimeError(f"only {len(sockets)} of {config.nnodes - 1} followers connected to "
                               f"{config.channel_address} within {timeout_s:.0f}s") from None
        finally:
            server.close()
        verdict = "; ".join(differences) or None
        for conn in sockets.values():
            _write_message(conn, verdict)
        if verdict:
            for conn in sockets.values():
                conn.close()
            raise ValueError(f"the nodes must be started with the same model and flags: {verdict}")
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
        while True:
            try:
                conn = socket.create_connection(config.channel_address, timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not reach the leader's step channel at {config.channel_address} "
                                       f"within {timeout_s:.0f}s") from None
                time.sleep(0.2)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _write_message(conn, (config.node_rank, settings))
        verdict = _read_message(conn)
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
