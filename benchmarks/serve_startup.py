"""Time from `python -m serve` to a healthy `/health`, with cold and then warm caches, the start-up's
phases as the server logs them (load, sizing, warm-up: compiling or reading back the programs),
and the time to first token of one short streamed chat request after each start.

    python3 benchmarks/serve_startup.py                      # the built-in dsv4-tiny
    python3 benchmarks/serve_startup.py --model /path/ckpt --max-model-len 4096

The cold run uses a fresh, empty JAX compilation cache directory (the engine's program cache lives
inside it); the warm run reuses it. The built-in checkpoint and its converted-weights cache are
written once beforehand (not part of either time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / f"server-{port}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
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
        phases = re.search(r"start-up: load ([\d.]+)s, sizing ([\d.]+)s, warm-up ([\d.]+)s", log.read_text())
        compiles = re.search(r"warm-up: (\d+) compiles", log.read_text())
        return {"seconds_to_healthy": healthy, "ttft_seconds": first if first is not None else float("nan"),
                **{f"{name}_seconds": float(phases.group(i + 1)) if phases else float("nan")
                   for i, name in enumerate(("load", "sizing", "warm_up"))},
                "compiles": int(compiles.group(1)) if compiles else -1}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in dsv4-tiny)")
    parser.add_argument("--max-model-len", type=positive, default=512, help="default: 512")
    args = parser.parse_args(argv)
    # Outside the timed starts: the built-in checkpoint and the converted-weights cache written
    # (the load a start makes reads it back: what a restart of a deployed model does).
    from dsv4_jax.engine.args import EngineArgs
    from dsv4_jax.weights.loading import load_model

    config = EngineArgs(args.model or "dsv4-tiny", max_model_len=args.max_model_len).create_engine_config()
    load_model(config.model_dir, dtype=config.dtype, load_format="auto")
    with tempfile.TemporaryDirectory() as cache:
        cold = one_start(args.model, args.max_model_len, Path(cache) / "jax")
        warm = one_start(args.model, args.max_model_len, Path(cache) / "jax")
    print(f"{'start':6} {'to healthy (s)':>15} {'load':>6} {'sizing':>7} {'warm-up':>8} {'compiles':>9} {'TTFT (s)':>9}")
    for name, row in (("cold", cold), ("warm", warm)):
        print(f"{name:6} {row['seconds_to_healthy']:15.1f} {row['load_seconds']:6.1f} {row['sizing_seconds']:7.1f} "
              f"{row['warm_up_seconds']:8.1f} {row['compiles']:9d} {row['ttft_seconds']:9.3f}")
    print(json.dumps({"cold": cold, "warm": warm}))


if __name__ == "__main__":
    main()
