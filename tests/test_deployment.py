"""The deployment command of issue 12 on a machine with two devices (two CPU devices here):
`python -m serve MODEL --tensor-parallel-size 2 ...` with vLLM's recipe flags and no
`--kv-cache-dtype` starts, logs the KV layout it chose and the mesh, answers `GET /v1/models` and
a chat completion whose usage matches `/tokenize`, and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import pytest

from conftest import REPO, child_xla_flags, free_port, wait_healthy  # tests/ is on sys.path

NAME = "DeepSeek-V4-Flash"


@pytest.fixture(scope="module")
def flash_like_checkpoint(tmp_path_factory) -> Path:
    """A one-layer model with the real V4 vocabulary and tokenizer that splits over two devices
    and takes --max-model-len 4096."""
    from dsv4_jax.presets import get_config
    from dsv4_jax.testing import write_random_checkpoint

    config = get_config("dsv4-tiny-test").replace(
        sliding_window=4, compress_ratios=(16,), index_topk=2, vocab_size=129280, num_hidden_layers=1,
        num_nextn_predict_layers=0, max_position_embeddings=4096)
    return write_random_checkpoint(tmp_path_factory.mktemp("flash_like") / "ckpt", config, seed=5)


def test_the_tp2_deployment_command_serves(flash_like_checkpoint, tmp_path):
    model, port = str(flash_like_checkpoint), free_port()
    command = [sys.executable, "-m", "serve", model, "--tensor-parallel-size", "2", "--trust-remote-code",
               "--served-model-name", NAME, "--port", str(port), "--tokenizer", model,
               "--gpu-memory-utilization", "0.9", "--max-num-seqs", "4", "--dtype", "auto",
               "--tool-call-parser", "deepseek_v4", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_v4",
               "--max-model-len", "4096"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags(2),
           "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir}
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
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
