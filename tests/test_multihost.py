"""Across hosts (issue 12, section 3), as two local processes with two CPU devices each.

* Two `LLM` processes (tests/multihost_worker.py) on one dp=2 x tp=2 mesh with expert parallelism
  over the four devices: node 0's greedy tokens follow the single-device dense forward fed the
  same tokens (the engine's comparison rule), the weights are split across the processes, an
  abort on node 0 is honoured (the follower runs only what node 0 schedules), and both exit 0.
* `python -m serve` as node 0 and `--headless` node 1: it answers, and when the follower dies the
  server exits within 30 s saying which node is gone, instead of hanging in a collective.

Every process gets a hard timeout and its whole process group is killed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

import dsv4_jax
from conftest import REPO, child_xla_flags, free_port, in_background, started, wait_healthy  # tests/ is on sys.path
from sharding_worker import CONFIG

WORKER = Path(__file__).with_name("multihost_worker.py")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags(2),
       "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir}


_checkpoint_dir: list[tempfile.TemporaryDirectory] = []


def shared_checkpoint() -> Path:
    """The module's random checkpoint, written once (at collection when a run is started early)."""
    if not _checkpoint_dir:
        _checkpoint_dir.append(tempfile.TemporaryDirectory(prefix="multihost-"))
        dsv4_jax.testing.write_random_checkpoint(Path(_checkpoint_dir[0].name) / "ckpt", CONFIG, seed=0)
    return Path(_checkpoint_dir[0].name) / "ckpt"


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return shared_checkpoint()


def _start(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(in_background(command), stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=REPO,
                                process_group=0)


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


class TwoWorkers:
    """Both ranks of tests/multihost_worker.py (outputs and logs in a temporary directory)."""

    def __init__(self):
        self.directory = tempfile.TemporaryDirectory(prefix="multihost-out-")
        out, port, checkpoint = Path(self.directory.name), free_port(), shared_checkpoint()
        self.processes = [_start([sys.executable, str(WORKER), str(rank), str(port), str(checkpoint),
                                  str(out / f"{rank}.json")], out / f"{rank}.log") for rank in (0, 1)]

    def results(self) -> list[dict]:
        out = Path(self.directory.name)
        codes = [p.wait(timeout=300) for p in self.processes]  # `started` kills them whatever happens
        logs = "\n".join((out / f"{rank}.log").read_text()[-2000:] for rank in (0, 1))
        assert codes == [0, 0], logs
        return [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]

    def kill(self) -> None:
        _kill(self.processes)


SERVER_FLAGS = ["--dtype", "float32", "--kv-cache-dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "2",
                "--block-size", "128", "--max-num-batched-tokens", "16", "-tp", "2", "-dp", "2",
                "--enable-expert-parallel", "--nnodes", "2", "--master-addr", "127.0.0.1"]


class ServerPair:
    """`python -m serve` as node 0 and a `--headless` node 1 (logs in a temporary directory)."""

    def __init__(self):
        self.directory = tempfile.TemporaryDirectory(prefix="multihost-serve-")
        self.logs = Path(self.directory.name)
        master, http_port = free_port(), free_port()
        common = [sys.executable, "-m", "serve", str(shared_checkpoint()), *SERVER_FLAGS, "--master-port", str(master)]
        self.follower = _start([*common, "--node-rank", "1", "--headless"], self.logs / "follower.log")
        self.leader = _start([*common, "--node-rank", "0", "--port", str(http_port)], self.logs / "leader.log")
        self.base = f"http://127.0.0.1:{http_port}"

    def kill(self) -> None:
        _kill([self.leader, self.follower])


# Started by conftest once the selection is known: each run (~35 and ~45 s cold, two processes)
# overlaps the tests before it.
START_EARLY = {"two_processes": TwoWorkers, "server_pair": ServerPair}


@pytest.fixture(scope="module")
def two_processes() -> list[dict]:
    with started(__name__, "two_processes") as run:
        return run.results()


@pytest.fixture
def server_pair():
    with started(__name__, "server_pair") as pair:
        yield pair


def test_two_processes_share_one_mesh_and_split_the_weights(two_processes):
    for node in two_processes:
        assert (node["device_count"], node["local_device_count"], node["process_count"]) == (4, 2, 2)
        # Experts over data x tensor = all four devices: each process holds its two devices' half.
        assert node["local_expert_bytes"] == node["expert_bytes_total"] // 2
    assert two_processes[1]["calls"] > 0


def test_two_processes_generate_as_one_dense_forward(two_processes, checkpoint):
    """Feed node 0's tokens to the single-device dense forward: each greedy token is its argmax
    wherever the top-1/top-2 gap exceeds 1e-3 (a smaller gap ends the request's comparison), and
    each logprob is within 1e-4."""
    import multihost_worker as worker

    requests = two_processes[0]["requests"]
    prompts = {str(i): p for i, p in enumerate(worker.PROMPTS)}
    assert set(requests) == {*prompts, worker.ABORTED, worker.PROMPT_LOGPROBS}
    model = dsv4_jax.load_model(checkpoint, dtype="float32")
    length = max(len(p) + 6 for p in prompts.values())
    ids = np.zeros((len(prompts), length), np.int32)  # right padding: causal, so it changes nothing before it
    for row, (rid, prompt) in enumerate(prompts.items()):
        assert requests[rid]["finish_reason"] == "length" and len(requests[rid]["tokens"]) == 6
        ids[row, : len(prompt) + 5] = prompt + requests[rid]["tokens"][:5]
    logits = np.asarray(model(ids), np.float64)
    compared = 0
    for row, (rid, prompt) in enumerate(prompts.items()):
        for i, token in enumerate(requests[rid]["tokens"]):
            at = logits[row, len(prompt) - 1 + i]
            logp = at - at.max() - np.log(np.exp(at - at.max()).sum())
            top2 = np.sort(logp)[-2:]
            if token != int(np.argmax(logp)):
                assert top2[1] - top2[0] <= 1e-3, (rid, i)
                break
            assert abs(requests[rid]["logprobs"][i] - logp[token]) <= 1e-4, (rid, i)
            compared += 1
    assert compared >= 20
    # Prompt logprobs (the head over every prefill position, gathered to node 0 in lockstep): each
    # prompt token's logprob given the tokens before it, as the dense forward gives it.
    row, prompt = 2, worker.PROMPTS[2]
    at = logits[row, : len(prompt) - 1]
    logp = at - at.max(-1, keepdims=True) - np.log(np.exp(at - at.max(-1, keepdims=True)).sum(-1, keepdims=True))
    want = [logp[i, prompt[i + 1]] for i in range(len(prompt) - 1)]
    assert np.allclose(two_processes[0]["prompt_logprobs"], want, atol=1e-4)
    aborted = requests[worker.ABORTED]
    assert aborted["finish_reason"] == "abort" and 0 < len(aborted["tokens"]) < 40


def test_nodes_started_with_different_flags_stop_before_loading_naming_the_flag(checkpoint, tmp_path):
    """A follower with another --max-num-seqs would size other pools and compute wrong tokens in
    silence: both nodes stop at the handshake, before any collective, each naming the flag."""
    port = free_port()
    processes = [_start([sys.executable, str(WORKER), str(rank), str(port), str(checkpoint), str(tmp_path / f"{rank}.json"),
                         str(seqs)], tmp_path / f"{rank}.log") for rank, seqs in ((0, 2), (1, 1))]
    try:
        codes = [p.wait(timeout=120) for p in processes]
    finally:
        _kill(processes)
    for rank in (0, 1):
        log = (tmp_path / f"{rank}.log").read_text()
        assert codes[rank] != 0 and "--max-num-seqs: node 0 has 2, node 1 has 1" in log, log[-2000:]
        assert not (tmp_path / f"{rank}.json").exists()


def test_a_dead_follower_stops_the_server_within_30_s(server_pair):
    leader, follower, base = server_pair.leader, server_pair.follower, server_pair.base
    try:
        wait_healthy(base, [leader, follower], server_pair.logs / "leader.log")
        assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 200
        done = httpx.post(f"{base}/v1/completions", timeout=120,
                          json={"prompt": [5, 17, 42], "max_tokens": 4, "temperature": 0})
        assert done.status_code == 200, done.text
        assert done.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        os.killpg(follower.pid, signal.SIGKILL)
        killed = time.monotonic()
        code = leader.wait(timeout=30)
        waited = time.monotonic() - killed
    finally:
        server_pair.kill()
    log = (server_pair.logs / "leader.log").read_text()
    assert code != 0 and waited < 30, log[-3000:]
    assert "follower node 1 is gone" in log, log[-3000:]
