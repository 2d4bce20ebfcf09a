"""The multi-node start-up's host logic on one machine (tests/test_multihost.py runs the real
multi-process cases): what a follower says when node 0 hangs up, and how a start-up failure is
announced through JAX's coordination service."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import quiet_port  # tests/ is on sys.path
from dsv4_jax.parallel import distributed
from dsv4_jax.engine import lockstep
from dsv4_jax.engine.lockstep import Lockstep


@pytest.mark.parametrize("announced", [None, "a shard is truncated"])
def test_a_follower_whose_leader_hangs_up_names_the_leaders_announced_reason(monkeypatch, announced):
    """A follower that finished starting before node 0 failed is reading the channel, not watching
    for announcements: the end of the channel is its cue, and node 0's announcement its reason."""
    monkeypatch.setattr(lockstep, "start_failures", lambda: {0: announced} if announced else {})
    follower_end, leader_end = socket.socketpair()
    leader_end.close()
    with pytest.raises(RuntimeError) as raised:
        Lockstep({}, frozenset()).follow(distributed.StepChannel({0: follower_end}))
    expected = f"node 0 stopped while starting: {announced}" if announced else "the leader closed the step channel"
    assert str(raised.value).startswith(expected), raised.value


def test_without_jax_distributed_no_node_has_announced_anything():
    assert distributed.start_failures() == {}


ANNOUNCING = """
import sys

import jax

jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[1]}", num_processes=1, process_id=0)
from dsv4_jax.parallel.distributed import DistributedConfig, StartUp, start_failures

try:
    with StartUp(DistributedConfig(nnodes=2, node_rank=1, headless=True)):
        raise ValueError("a shard is\\n  truncated")
except ValueError:
    pass
print("announced", start_failures())
try:  # node 0 failing afterwards on the closed channel: a consequence, named after node 1's cause
    with StartUp(DistributedConfig(nnodes=2, node_rank=0)):
        raise EOFError("the peer closed the step channel")
except RuntimeError as error:
    print("raised", error)
print("announced", start_failures())
"""


def test_start_up_failures_travel_through_jaxs_coordination_service(tmp_path):
    """JAX has no public key-value API: this pins the private one (`global_state.client`'s
    key_value_set / key_value_dir_get) on the installed JAX, in one process of a real
    jax.distributed run."""
    script = tmp_path / "announcing.py"
    script.write_text(ANNOUNCING)
    result = subprocess.run([sys.executable, str(script), str(quiet_port())], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "announced {1: 'a shard is truncated'}",
        "raised node 1 stopped while starting: a shard is truncated",
        "announced {1: 'a shard is truncated'}",  # node 0 said nothing of its own
    ], result.stdout + result.stderr[-3000:]


def test_a_refused_node_gives_up_telling_absent_nodes_in_its_own_time(tmp_path):
    """A node whose flags are refused joins the others only to say why (`join_to_announce`); with
    no other node started it gives up after its own timeout with its refusal's status, before
    JAX's connect timeout would abort the process with a fatal error."""
    script = ("import sys; from dsv4_jax.parallel.distributed import DistributedConfig, join_to_announce; "
              "join_to_announce(DistributedConfig(2, 1, master_port=int(sys.argv[1]), headless=True), 'refused', "
              "code=2, timeout_s=2)")
    result = subprocess.run([sys.executable, "-c", script, str(quiet_port())], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "could not tell the other nodes why this one stopped: not every node joined within 2 s" in result.stderr
    assert "Terminating process" not in result.stderr and "Check failure" not in result.stderr, result.stderr[-3000:]


def test_ctrl_c_ends_a_refused_nodes_wait_for_the_others(tmp_path):
    """The wait runs in JAX's connect, in C++: Ctrl-C must still end it at once, with the refusal's
    status."""
    # SIGINT's default (KeyboardInterrupt) as in a terminal: a background job (CI) starts with it ignored.
    script = ("import logging, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "logging.basicConfig(level=logging.INFO); "
              "from dsv4_jax.parallel.distributed import DistributedConfig, join_to_announce; "
              "join_to_announce(DistributedConfig(2, 1, master_port=int(sys.argv[1]), headless=True), 'refused', "
              "code=2, timeout_s=60)")
    log = tmp_path / "node.log"
    with open(log, "w") as out:
        node = subprocess.Popen([sys.executable, "-c", script, str(quiet_port())], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.monotonic() + 60
        while "Connecting to JAX distributed service" not in log.read_text():
            assert time.monotonic() < deadline and node.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)  # inside the connect
        node.send_signal(signal.SIGINT)
        waited = time.monotonic()
        assert node.wait(timeout=30) == 2, log.read_text()[-3000:]
        # ~0.2 s when Ctrl-C ends the wait; without it the node would wait out its 60 s.
        assert time.monotonic() - waited < 20, log.read_text()[-3000:]
    finally:
        node.kill()
    assert "could not tell the other nodes why this one stopped: KeyboardInterrupt" in log.read_text()
