"""The deployment command of issue 12 on a machine with two devices (two CPU devices here):
`python -m serve MODEL --tensor-parallel-size 2 ...` with vLLM's recipe flags and no
`--kv-cache-dtype` starts, logs the KV layout it chose and the mesh, answers `GET /v1/models` and
a chat completion whose usage matches `/tokenize`, and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import jax
import pytest

from conftest import REPO, child_xla_flags, in_background, quiet_port, started, wait_healthy  # tests/ is on sys.path

NAME = "DeepSeek-V4-Flash"


class DeploymentServer:
    """The deployment command running in its own process, on a one-layer model with the real V4
    vocabulary and tokenizer that splits over two devices and takes --max-model-len 4096
    (checkpoint and log in a temporary directory)."""

    def __init__(self):
        from dsv4_jax.presets import get_config
        from dsv4_jax.testing import write_random_checkpoint

        self.directory = tempfile.TemporaryDirectory(prefix="deployment-")
        config = get_config("dsv4-tiny-test").replace(
            sliding_window=4, compress_ratios=(16,), index_topk=2, vocab_size=129280, num_hidden_layers=1,
            num_nextn_predict_layers=0, max_position_embeddings=4096)
        model = str(write_random_checkpoint(Path(self.directory.name) / "ckpt", config, seed=5))
        self.port = quiet_port()  # bound tens of seconds later: off the ephemeral range
        command = [sys.executable, "-m", "serve", model, "--tensor-parallel-size", "2", "--trust-remote-code",
                   "--served-model-name", NAME, "--port", str(self.port), "--tokenizer", model,
                   "--gpu-memory-utilization", "0.9", "--max-num-seqs", "4", "--dtype", "auto",
                   "--tool-call-parser", "deepseek_v4", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_v4",
                   "--max-model-len", "4096"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags(2),
               "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir}
        self.log_path = Path(self.directory.name) / "server.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(in_background(command), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=REPO)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


# Started by conftest once the selection is known: its start-up (~1 min cold, one core) overlaps
# the tests before it.
START_EARLY = {"deployment": DeploymentServer}


@pytest.fixture(scope="module")
def deployment():
    with started(__name__, "deployment") as server:
        yield server


def test_the_tp2_deployment_command_serves(deployment):
    process, log_path = deployment.process, deployment.log_path
    base = f"http://127.0.0.1:{deployment.port}"
    try:
        wait_healthy(base, [process], log_path)
        log_text = log_path.read_text()
        assert "KV cache:" in log_text and "mesh: data 1 x tensor 2 over devices [0, 1]" in log_text, log_text
        models = httpx.get(f"{base}/v1/models", timeout=30)
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [NAME]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0})
        assert chat.status_code == 200, chat.text
        tokenized = httpx.post(f"{base}/tokenize", timeout=30, json={"model": NAME, "messages": messages}).json()
        usage, choice = chat.json()["usage"], chat.json()["choices"][0]
        assert usage["prompt_tokens"] == tokenized["count"]
        assert usage["completion_tokens"] == 8 or choice["finish_reason"] == "stop"
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0, log_path.read_text()[-3000:]
