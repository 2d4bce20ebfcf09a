"""Time from `python -m serve` to a healthy `/health`, with a cold and then a warm compilation
cache, and the time to first token of one short streamed chat request after each start.

    python3 benchmarks/serve_startup.py                      # the built-in dsv4-tiny
    python3 benchmarks/serve_startup.py --model /path/ckpt --max-model-len 4096

The cold run uses a fresh, empty JAX compilation cache directory; the warm run reuses it. The
built-in checkpoint itself is written once beforehand (not part of either time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages (benchmarks) importable

from benchmarks.runner import positive  # noqa: E402  (one flag parser for the benchmarks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(model: str | None, max_model_len: int, cache: Path) -> dict[str, float]:
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "serve", *([model] if model else []), "--port", str(port),
               "--max-model-len", str(max_model_len)]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited: {process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        healthy = time.perf_counter() - start
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": True}
        sent = time.perf_counter()
        first = None
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and first is None:
                    chunk = json.loads(line[len("data: "):])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - sent
        return {"seconds_to_healthy": healthy, "ttft_seconds": first if first is not None else float("nan")}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in dsv4-tiny)")
    parser.add_argument("--max-model-len", type=positive, default=512, help="default: 512")
    args = parser.parse_args(argv)
    if args.model is None:
        from dsv4_jax.weights.builtin import builtin_model_dir

        builtin_model_dir()  # written once, outside the timed starts
    with tempfile.TemporaryDirectory() as cache:
        cold = one_start(args.model, args.max_model_len, Path(cache))
        warm = one_start(args.model, args.max_model_len, Path(cache))
    print(f"{'start':6} {'to healthy (s)':>15} {'TTFT (s)':>9}")
    for name, row in (("cold", cold), ("warm", warm)):
        print(f"{name:6} {row['seconds_to_healthy']:15.1f} {row['ttft_seconds']:9.3f}")
    print(json.dumps({"cold": cold, "warm": warm}))


if __name__ == "__main__":
    main()
