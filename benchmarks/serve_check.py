"""End-to-end check of `python -m serve` on whatever device JAX finds (the GPU check's serving step).

    python3 benchmarks/serve_check.py [--log FILE] [--markdown FILE] [--requests 200] [--concurrency 32]
        [--timeout-s 240] [-- extra server flags]

Starts the server exactly as the README does (no model path: the built-in dsv4-tiny; every flag at
its default, `--kv-cache-dtype auto` included) plus any flags after `--`, then checks what a user
sees first, in order:

1. it becomes healthy (seconds from the start to a 200 from /health);
2. the start-up log names the KV layout the resolver chose (with --expect-fp8, as on an fp8 GPU:
   "Using DeepSeek's fp8_ds_mla KV cache format." must be logged) and the pool sizing lines
   (activations, capacity);
3. `GET /v1/models` is 200 and lists the model;
4. a chat completion (`max_tokens` 16, `ignore_eos`) is 200, with `usage.prompt_tokens` equal to
   /tokenize's count of the same messages, `completion_tokens` 16 and `total_tokens` their sum;
5. a streamed chat completion's time to first token;
6. `benchmarks/load.py --base-url` against it (every stream checked, /metrics back to 0 after);
7. no executable built after the warm-up (`JAX_LOG_COMPILES`: no compile or persistent-cache line
   after the "warm-up:" line), and a clean shutdown on SIGTERM (exit status 0).

Each step's result is written to the --markdown table as soon as it is known, so a run cut short
keeps what it measured. Exit status 1 if any step fails. Plain script: httpx and this repository.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages (benchmarks) importable

from benchmarks.runner import positive  # noqa: E402  (one flag parser for the benchmarks)

FP8_LINE = "Using DeepSeek's fp8_ds_mla KV cache format."
# What JAX_LOG_COMPILES logs per executable built (compiled, or read from the persistent cache).
COMPILE_LINES = ("Compiling ", "Finished XLA compilation", "Persistent compilation cache hit")
MAX_TOKENS = 16


class Table:
    """The markdown table, one row written (and flushed) as soon as it is known."""

    def __init__(self, path: Path | None):
        self.path, self.failed = path, False
        if path is not None:
            path.write_text("| step | result | detail |\n|---|---|---|\n")

    def row(self, step: str, ok: bool, detail: str) -> None:
        self.failed |= not ok
        print(f"{'ok' if ok else 'FAILED'}: {step}: {detail}", flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(f"| {step} | {'ok' if ok else '**FAILED**'} | {detail.replace('|', '/')} |\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, base: str, deadline: float) -> float | None:
    """Seconds until /health answers 200, or None if the server exited or the deadline passed."""
    import httpx

    start = time.perf_counter()
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    return None


def stop_server(process: subprocess.Popen, timeout_s: float = 30) -> int:
    """SIGTERM a server started in its own process group (its graceful shutdown), SIGKILL the
    group if it outlives `timeout_s`; its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def log_lines(log: Path, *needles: str) -> list[str]:
    return [line.strip() for line in log.read_text(errors="replace").splitlines() if any(n in line for n in needles)]


def compiles_after_warmup(log: Path) -> int | None:
    """Compile lines after the warm-up line, or None when there is no warm-up line."""
    lines = log.read_text(errors="replace").splitlines()
    marks = [i for i, line in enumerate(lines) if "warm-up:" in line]
    if not marks:
        return None
    return sum(any(n in line for n in COMPILE_LINES) for line in lines[marks[-1] + 1:])


def compile_summary(log: Path) -> str:
    """The start-up's compiles from JAX_LOG_COMPILES lines: per program, how many and their
    seconds (the most, the sum; compiles at once overlap), and XLA's rematerialization warnings."""
    seconds: dict[str, list[float]] = {}
    for line in log_lines(log, "Finished XLA compilation of "):
        match = re.search(r"Finished XLA compilation of (\S+) in ([0-9.]+) sec", line)
        if match:
            seconds.setdefault(match.group(1), []).append(float(match.group(2)))
    parts = [f"{name} {len(t)} x, max {max(t):.1f} s, sum {sum(t):.1f} s"
             for name, t in sorted(seconds.items(), key=lambda item: -sum(item[1]))]
    remat = len(log_lines(log, "hlo_rematerialization"))
    return "; ".join(parts + [f"{remat} rematerialization warnings"])


def chat_checks(base: str, table: Table) -> None:
    import httpx

    models = httpx.get(f"{base}/v1/models", timeout=30)
    ids = [m.get("id") for m in models.json().get("data", [])] if models.status_code == 200 else []
    table.row("GET /v1/models", models.status_code == 200 and bool(ids), f"HTTP {models.status_code}, models {ids}")
    if not ids:
        return
    messages = [{"role": "user", "content": "Hello! Who are you?"}]
    counted = httpx.post(f"{base}/tokenize", json={"model": ids[0], "messages": messages}, timeout=30)
    expected_prompt = counted.json().get("count") if counted.status_code == 200 else None
    body = {"model": ids[0], "messages": messages, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    start = time.perf_counter()
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    seconds = time.perf_counter() - start
    usage = reply.json().get("usage", {}) if reply.status_code == 200 else {}
    ok = (reply.status_code == 200 and usage.get("prompt_tokens") == expected_prompt
          and usage.get("completion_tokens") == MAX_TOKENS
          and usage.get("total_tokens") == usage.get("prompt_tokens", 0) + MAX_TOKENS)
    table.row("chat completion", ok, f"HTTP {reply.status_code} in {seconds:.2f}s, usage {json.dumps(usage)} "
              f"(/tokenize counts {expected_prompt} prompt tokens)"
              + ("" if reply.status_code == 200 else f": {reply.text[:300]}"))
    sent, first, chunks = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") is not None:
                    chunks += 1
                    first = first if first is not None else time.perf_counter() - sent
    table.row("streamed chat: time to first token", response.status_code == 200 and first is not None,
              f"HTTP {response.status_code}, TTFT {first if first is None else round(first, 4)} s, "
              f"{chunks} content chunks in {time.perf_counter() - sent:.2f}s")


def load_check(base: str, requests: int, concurrency: int, out: Path, table: Table, timeout_s: float) -> None:
    command = [sys.executable, str(REPO / "benchmarks" / "load.py"), "--base-url", base, "--requests", str(requests),
               "--concurrency", str(concurrency), "--json", str(out)]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        table.row(f"load: {requests} streams, {concurrency} at once", False, f"not done within {timeout_s:.0f}s")
        return
    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", flush=True)
    if not out.exists():
        table.row(f"load: {requests} streams, {concurrency} at once", False,
                  f"exit {done.returncode}: {done.stderr[-400:]}")
        return
    result = json.loads(out.read_text())
    figures, checks = result["figures"], result["checks"]
    failed = [name for name, problems in checks.items() if problems]
    shown = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    table.row(f"load: {requests} streams, {concurrency} at once", done.returncode == 0 and not failed,
              shown + (f"; FAILED checks: {failed} {[checks[n][:2] for n in failed]}" if failed
                       else "; every check ok"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=Path("serve_check.log"), help="the server's log")
    parser.add_argument("--markdown", type=Path, help="write the table here, one row as soon as known")
    parser.add_argument("--requests", type=positive, default=200, help="load: streams in all")
    parser.add_argument("--concurrency", type=positive, default=32, help="load: streams at once")
    parser.add_argument("--expect-fp8", action="store_true", help=f"fail unless the log says {FP8_LINE!r}")
    parser.add_argument("--timeout-s", type=positive, default=240, help="for the whole check")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    deadline = time.monotonic() + args.timeout_s
    table = Table(args.markdown)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "serve", "--port", str(port), *extra]
    env = {**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONUNBUFFERED": "1"}
    print("starting:", " ".join(command), flush=True)
    with open(args.log, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        healthy = wait_healthy(process, base, deadline - 60)
        table.row("start to a healthy /health", healthy is not None,
                  f"{healthy:.1f}s" if healthy is not None else
                  f"server exit status {process.poll()}; log tail: {args.log.read_text(errors='replace')[-600:]}")
        if healthy is None:
            return 1
        kv = log_lines(args.log, "KV cache", "kv cache", "fp8_ds_mla", "bfloat16 KV", "float32 KV")
        table.row("KV layout logged", bool(kv) and (not args.expect_fp8 or any(FP8_LINE in k for k in kv)),
                  " / ".join(kv[:3]) or "no KV line in the log")
        sizing = log_lines(args.log, "activations:", "sequence slots", "warm-up:", "ready:")
        table.row("pool sizing and warm-up logged", bool(sizing), " / ".join(sizing))
        table.row("start-up compiles (steps without XLA's rematerialization pass)",
                  not log_lines(args.log, "hlo_rematerialization"), compile_summary(args.log))
        chat_checks(base, table)
        load_check(base, args.requests, args.concurrency, args.log.with_name("serve_check_load.json"), table,
                   max(10.0, deadline - time.monotonic() - 30))
        after = compiles_after_warmup(args.log)
        table.row("no compile after warm-up", after == 0, f"{after} compiles logged after the warm-up line")
    finally:
        status = stop_server(process)
        table.row("shutdown on SIGTERM", status == 0, f"exit status {status}")
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
