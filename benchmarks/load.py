"""Load: many concurrent streaming clients against `python -m serve`, every stream checked.

    python3 benchmarks/load.py                       # starts the built-in dsv4-tiny, float32 cache
    python3 benchmarks/load.py --requests 500 --concurrency 64 --json load.json
    python3 benchmarks/load.py --base-url http://127.0.0.1:8000 --api-key KEY

Requests alternate between /v1/chat/completions and /v1/completions, with prompts of 1 to
--max-prompt-words random words and 1 to --max-output-tokens greedy tokens (`ignore_eos`, so each
output has exactly its max_tokens). Every stream must be well formed: status 200, `data: [DONE]`
last and once, no error event, one id, the chat role in the first chunk only, one finish_reason
("length") on the last choice chunk, then the usage chunk, whose `completion_tokens` equals the
tokens streamed and `prompt_tokens` the `/tokenize` count of the same prompt. Afterwards
`/metrics` must show no request running or waiting and `vllm:kv_cache_usage_perc` 0 (the
server's block allocators are only visible through that gauge).

When the script starts the server itself it also (1) runs the same requests through the offline
engine (`dsv4_jax.LLM` with the server's flags, one batched run) and compares every stream with it
(`compare_stream`; the streams carry ids and logprobs: `logprobs` 2 and
`return_tokens_as_token_ids`); (2) reads the server's resident memory (VmRSS of /proc/PID/status)
after the first half of the requests and at the end, and fails above 10% growth.

The comparison rule: tokens equal and logprobs within 1e-4, up to a first difference at a near-tie,
which ends the comparison of that request ("diverged at a near-tie", counted, not an error). A
near-tie is a position where the reference's top-1/top-2 logprob gap is at most 1e-3 (a differing
token only), or where the lightning indexer's or the MoE router's top-k margin on the reference's
tokens (`dsv4_jax.testing.topk_margins_by_kind`) is below 1e-5: there another compile of the same
step (another batch shape) may pick a different k-th compressed entry or expert, which moves the
logits by far more than rounding (docs/performance.md, "Server under load").

Prints requests/s, output tokens/s, TTFT and ITL (mean, median, p99), the checks and the near-tie
divergences; exit status 1 when any check fails. tests/test_server_load.py runs a smaller copy
through these functions.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages (benchmarks) importable

from benchmarks.runner import positive  # noqa: E402  (one flag parser for the benchmarks)
GAP, LOGPROB_TOL = 1e-3, 1e-4  # the engine's comparison rule for greedy outputs
# Top-k margins ((k-th - (k+1)-th best score) / largest |score|, on the reference's tokens; for the
# indexer over the visible entries, for the router over the experts by score + bias) below this are
# near-ties. At the full run's indexer swap (request 353, token 23) two compiles of the step scored
# the same entry up to 4e-7 (relative) apart, and the margin there measures 3.5e-7 to 1.1e-6
# depending on the compile (step shape, sequence length): 1e-5 is ten times the largest. At the
# router swap (request 113, token 54) the margin is 5.1e-8, one float32 ulp. Few positions fall
# below it (in request 353: 2 of the 177 with a possible tie in dsv4-tiny's second CSA layer, none
# in its first; in request 113 one router position, the next smallest being 2e-4).
TOPK_TIE = 1e-5
# The kinds of near-tie; a top-k margin's is "<kind> top-k margin", kind as in topk_margins_by_kind.
OUTPUT_GAP, INDEXER_MARGIN, ROUTER_MARGIN = "output top-1/top-2 gap", "indexer top-k margin", "router top-k margin"
RSS_GROWTH_LIMIT = 0.10
# The built-in model with a float32 cache: exact, so the offline engine is a sharp reference.
SERVER_FLAGS = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--max-model-len", "1024", "--seed", "0")
WORDS = ("the", "model", "cache", "token", "stream", "server", "pallas", "kernel", "über", "日本", "🚀", "a",
         "request", "load", "42", "?", "hello", "world", "batch", "prefill")


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    endpoint: str  # "chat" or "completions"
    text: str  # the user message, or the raw prompt
    max_tokens: int


@dataclasses.dataclass
class StreamResult:
    token_ids: list[int]
    logprobs: list[float]
    usage: dict | None
    ttft: float  # seconds from sending to the first token
    itls: list[float]  # seconds between consecutive token-carrying chunks
    problems: list[str]  # empty when the stream is well formed


@dataclasses.dataclass
class LoadRun:
    prompt_ids: list[list[int]]  # /tokenize's ids of each request's prompt
    results: list[StreamResult]
    seconds: float
    max_running: float  # the largest vllm:num_requests_running seen while it ran
    max_waiting: float
    rss_kib: dict[str, int]  # the server's VmRSS at "start", "half" (half the requests done), "end"


def make_requests(count: int, seed: int, max_prompt_words: int, max_output_tokens: int) -> list[LoadRequest]:
    """`count` requests, alternating chat and completions, of random prompt and output lengths."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        words = rng.choice(WORDS, size=int(rng.integers(1, max_prompt_words + 1)))
        requests.append(LoadRequest("chat" if i % 2 == 0 else "completions", " ".join(words),
                                    int(rng.integers(1, max_output_tokens + 1))))
    return requests


def _messages(req: LoadRequest) -> list[dict]:
    return [{"role": "user", "content": req.text}]


_NO_THINKING = {"thinking": False}


def tokenize_body(req: LoadRequest, model: str) -> dict:
    if req.endpoint == "chat":
        return {"model": model, "messages": _messages(req), "chat_template_kwargs": _NO_THINKING}
    return {"model": model, "prompt": req.text}


def request_body(req: LoadRequest, model: str) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True},
                            "return_tokens_as_token_ids": True}
    if req.endpoint == "chat":
        return {**body, "messages": _messages(req), "chat_template_kwargs": _NO_THINKING, "logprobs": True,
                "top_logprobs": 2}
    return {**body, "prompt": req.text, "logprobs": 2}


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def check_stream(req: LoadRequest, prompt_count: int, payloads: list[str]) -> tuple[list[int], list[float],
                                                                                       dict | None, list[str]]:
    """(token ids, logprobs, usage, problems) of one stream's `data:` payloads, in order."""
    problems = []
    if not payloads or payloads[-1] != "[DONE]" or payloads.count("[DONE]") != 1:
        problems.append(f"[DONE] is not last exactly once: {payloads[-2:]}")
    chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
    if any("error" in c for c in chunks):
        problems.append(f"error event: {[c['error'] for c in chunks if 'error' in c]}")
        return [], [], None, problems
    if not chunks or chunks[-1].get("choices") != [] or not isinstance(chunks[-1].get("usage"), dict):
        problems.append("the last chunk is not the usage chunk")
        return [], [], None, problems
    *body, usage_chunk = chunks
    usage = usage_chunk["usage"]
    chat = req.endpoint == "chat"
    wanted_object = "chat.completion.chunk" if chat else "text_completion"
    if {c["id"] for c in chunks} != {chunks[0]["id"]} or {c["object"] for c in chunks} != {wanted_object}:
        problems.append("chunks disagree on id or object")
    if any(c.get("usage", "missing") is not None for c in body):
        problems.append("a choice chunk carries usage other than null")
    roles = [i for i, c in enumerate(body) if "role" in c["choices"][0].get("delta", {})]
    if chat and (roles != [0] or body[0]["choices"][0]["delta"]["role"] != "assistant"):
        problems.append(f"the role is not in the first chunk only: chunks {roles}")
    finishes = [(i, c["choices"][0]["finish_reason"]) for i, c in enumerate(body) if c["choices"][0]["finish_reason"]]
    if finishes != [(len(body) - 1, "length")]:
        problems.append(f"finish_reason is not 'length' on the last choice chunk only: {finishes}")
    ids, logprobs = [], []
    for c in body:
        entry = c["choices"][0]["logprobs"]
        if not entry:
            continue
        if chat:
            ids += [_token_id(item["token"]) for item in entry["content"]]
            logprobs += [item["logprob"] for item in entry["content"]]
        else:
            ids += [_token_id(token) for token in entry["tokens"]]
            logprobs += entry["token_logprobs"]
    expected = {"prompt_tokens": prompt_count, "completion_tokens": len(ids),
                "total_tokens": prompt_count + len(ids)}
    if usage != expected or len(ids) != req.max_tokens:
        problems.append(f"usage {usage}, expected {expected} with {req.max_tokens} tokens streamed")
    return ids, logprobs, usage, problems


async def _stream(client, req: LoadRequest, model: str, prompt_count: int) -> StreamResult:
    path = "/v1/chat/completions" if req.endpoint == "chat" else "/v1/completions"
    start = time.perf_counter()
    payloads, token_times = [], []
    async with client.stream("POST", path, json=request_body(req, model)) as response:
        if response.status_code != 200:
            await response.aread()
            return StreamResult([], [], None, 0.0, [], [f"status {response.status_code}: {response.text[:300]}"])
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                payloads.append(line[len("data: "):])
                if '"logprobs":{' in payloads[-1]:  # a chunk that carries tokens
                    token_times.append(time.perf_counter())
    ids, logprobs, usage, problems = check_stream(req, prompt_count, payloads)
    ttft = token_times[0] - start if token_times else 0.0
    return StreamResult(ids, logprobs, usage, ttft, list(np.diff(token_times)), problems)


def rss_kib(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS in /proc/PID/status), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status has no VmRSS line")


def parse_metrics(text: str) -> dict[str, float]:
    """vllm:* gauges and counters of a /metrics page, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "{" in line and not line.split("{")[0].endswith(("_bucket", "_created")):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0.0) + value
    return values


def metrics(base: str) -> dict[str, float]:
    import httpx

    return parse_metrics(httpx.get(f"{base}/metrics", timeout=10).text)


async def run_load(base: str, key: str | None, model: str, requests: Sequence[LoadRequest],
                   prompt_ids: Sequence[list[int]], concurrency: int, server_pid: int | None = None) -> LoadRun:
    """Stream all requests with at most `concurrency` at once; `prompt_ids` are their /tokenize ids."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers=_auth(key), timeout=600, limits=limits) as client:
        rss = {"start": rss_kib(server_pid)} if server_pid else {}
        gate, done, peaks = asyncio.Semaphore(concurrency), [0], {"running": 0.0, "waiting": 0.0}

        async def one(i: int) -> StreamResult:
            async with gate:
                result = await _stream(client, requests[i], model, len(prompt_ids[i]))
            done[0] += 1
            if server_pid and done[0] == len(requests) // 2:
                rss["half"] = rss_kib(server_pid)
            return result

        async def watch() -> None:
            while True:
                page = parse_metrics((await client.get("/metrics")).text)
                peaks["running"] = max(peaks["running"], page.get("vllm:num_requests_running", 0.0))
                peaks["waiting"] = max(peaks["waiting"], page.get("vllm:num_requests_waiting", 0.0))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        seconds = time.perf_counter() - start
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if server_pid:
        rss["end"] = rss_kib(server_pid)
    return LoadRun(list(prompt_ids), list(results), seconds, peaks["running"], peaks["waiting"], rss)


async def load_and_reference(base: str, key: str | None, model: str, requests: Sequence[LoadRequest],
                             concurrency: int, server_pid: int | None = None,
                             llm: Any = None) -> tuple[LoadRun, list[Any] | None]:
    """Tokenize every prompt on the server, then run the load; meanwhile, when `llm` (the offline
    engine with the server's flags) is given, the same requests through it on a thread."""
    import httpx

    async with httpx.AsyncClient(base_url=base, headers=_auth(key), timeout=60) as client:
        prompt_ids = []
        for req in requests:
            response = await client.post("/tokenize", json=tokenize_body(req, model))
            response.raise_for_status()
            prompt_ids.append(response.json()["tokens"])
    reference: list[Any] = []
    worker = threading.Thread(target=lambda: reference.extend(offline_reference(llm, requests, prompt_ids)))
    if llm is not None:
        worker.start()
    run = await run_load(base, key, model, requests, prompt_ids, concurrency, server_pid)
    if llm is None:
        return run, None
    await asyncio.to_thread(worker.join)
    if len(reference) != len(requests):
        raise RuntimeError("the offline reference run failed (see its traceback above)")
    return run, reference


def offline_reference(llm: Any, requests: Sequence[LoadRequest], prompt_ids: Sequence[list[int]]) -> list[Any]:
    """The same greedy requests through `llm` (a dsv4_jax.LLM) in one batched run: the
    CompletionOutput of each, with 2 logprobs per token."""
    from dsv4_jax import SamplingParams

    params = [SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
              for req in requests]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [out.outputs[0] for out in outputs]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One stream against its reference output under the comparison rule (module docstring)."""

    mismatch: str | None = None  # a difference the rule does not excuse: the check fails
    near_tie: str | None = None  # OUTPUT_GAP, INDEXER_MARGIN or ROUTER_MARGIN: it diverged at a near-tie
    diverged_at: int | None = None  # the output token where it did
    detail: str = ""  # what differed there
    uncompared: int = 0  # output tokens after it, not compared


def compare_stream(reference: Any, token_ids: Sequence[int], logprobs: Sequence[float],
                   topk_margins: Mapping[str, Sequence[float]] | None = None) -> Comparison:
    """`token_ids` and `logprobs` of a stream against `reference` (a CompletionOutput with 2
    logprobs per token). `topk_margins[kind][i]` ("indexer", "router"): that top-k margin at the
    position whose logits give output token i, on the reference's tokens (`output_topk_margins`);
    the smallest of the kinds decides. None: not known, so no difference is excused by a margin."""
    for i, (want, got) in enumerate(zip(reference.token_ids, token_ids)):
        entry = reference.logprobs[i]
        ranked = sorted((lp.logprob for lp in entry.values()), reverse=True)
        gap = ranked[0] - ranked[1]
        if want != got:
            detail = f"token {i}: {got} where the reference has {want} (top-1/top-2 gap {gap:.2e})"
        elif abs(entry[want].logprob - logprobs[i]) > LOGPROB_TOL:
            detail = f"token {i}: logprob {logprobs[i]} vs the reference's {entry[want].logprob}"
        else:
            continue
        margins = {f"{kind} top-k margin": float(m[i]) for kind, m in (topk_margins or {}).items()}
        if any(np.isfinite(m) for m in margins.values()):
            detail += " (" + ", ".join(f"{kind} {m:.1e}" for kind, m in margins.items() if np.isfinite(m)) + ")"
        closest, margin = min(margins.items(), key=lambda item: item[1], default=(None, np.inf))
        # A small output gap excuses a different token only; a swapped indexer or router pick moves
        # the logits far past the logprob tolerance whether or not the token changes.
        near_tie = OUTPUT_GAP if want != got and gap <= GAP else closest if margin < TOPK_TIE else None
        if near_tie is None:
            return Comparison(mismatch=detail)
        return Comparison(near_tie=near_tie, diverged_at=i, detail=detail, uncompared=len(reference.token_ids) - i - 1)
    if len(token_ids) != len(reference.token_ids):
        return Comparison(mismatch=f"{len(token_ids)} tokens where the reference has {len(reference.token_ids)}")
    return Comparison()


def gap_rule_mismatch(reference: Any, token_ids: Sequence[int], logprobs: Sequence[float]) -> str | None:
    """What differs beyond the output-gap rule (`compare_stream` without top-k margins), or None."""
    return compare_stream(reference, token_ids, logprobs).mismatch


def output_topk_margins(model: Any, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> dict[str, np.ndarray]:
    """{kind: [len(output_ids)]}: `topk_margins_by_kind` of `model` (a dsv4_jax CausalLM, e.g.
    `LLM.model`) over the prompt and the output, at the position whose logits give each output token."""
    from dsv4_jax.testing import topk_margins_by_kind

    margins = topk_margins_by_kind(model, [*prompt_ids, *output_ids[:-1]])
    return {kind: m[len(prompt_ids) - 1:] for kind, m in margins.items()}


def compare_with_reference(model: Any, run: LoadRun, reference: Sequence[Any]) -> list[Comparison]:
    """`compare_stream` of every stream of `run`; the top-k margins (a dense forward over the
    reference's tokens, one compile per length) only for a stream the output rule alone fails."""
    comparisons = []
    for prompt, result, ref in zip(run.prompt_ids, run.results, reference):
        comparison = compare_stream(ref, result.token_ids, result.logprobs)
        if comparison.mismatch is not None and result.token_ids:
            margins = output_topk_margins(model, prompt, ref.token_ids)
            comparison = compare_stream(ref, result.token_ids, result.logprobs, margins)
        comparisons.append(comparison)
    return comparisons


def near_tie_summary(comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """Counts of the requests that diverged at a near-tie, by kind, and which they were."""
    tied = [(i, c) for i, c in enumerate(comparisons) if c.near_tie]
    return {"diverged at a near-tie": {kind: sum(c.near_tie == kind for _, c in tied)
                                       for kind in (OUTPUT_GAP, INDEXER_MARGIN, ROUTER_MARGIN)},
            "output tokens not compared": sum(c.uncompared for _, c in tied),
            "requests": [f"request {i}: {c.near_tie} at {c.detail}" for i, c in tied]}


def summary(run: LoadRun) -> dict[str, float]:
    """Throughput and latency figures of a run (seconds; TTFT and ITL in milliseconds)."""
    ttfts = np.array([r.ttft for r in run.results]) * 1e3
    itls = np.array([x for r in run.results for x in r.itls] or [0.0]) * 1e3
    tokens = sum(len(r.token_ids) for r in run.results)
    out = {"requests": len(run.results), "seconds": run.seconds, "requests_per_s": len(run.results) / run.seconds,
           "output_tokens_per_s": tokens / run.seconds}
    for name, values in (("ttft_ms", ttfts), ("itl_ms", itls)):
        out |= {f"mean_{name}": float(values.mean()), f"median_{name}": float(np.median(values)),
                f"p99_{name}": float(np.percentile(values, 99))}
    return out


# ---- the script -----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/load.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive, default=500)
    parser.add_argument("--concurrency", type=positive, default=64, help="streaming clients at once")
    parser.add_argument("--max-prompt-words", type=positive, default=300)
    parser.add_argument("--max-output-tokens", type=positive, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-url", help="a running server (no offline comparison, no memory reading)")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    parser.add_argument("--json", type=Path, help="write the figures and checks here")
    return parser.parse_args(argv)


def _start_server(port: int, log: Path) -> subprocess.Popen:
    import httpx

    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "serve", *SERVER_FLAGS, "--port", str(port)], cwd=REPO,
                                   stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server was not healthy within 900 s: {log.read_text()[-2000:]}")


def main(argv: Sequence[str] | None = None) -> int:
    import socket
    import tempfile

    import httpx

    args = parse_args(argv)
    requests = make_requests(args.requests, args.seed, args.max_prompt_words, args.max_output_tokens)
    process, llm = None, None
    base = args.base_url
    if base is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = Path(tempfile.mkdtemp(prefix="dsv4-load-")) / "server.log"
        print(f"starting python -m serve {' '.join(SERVER_FLAGS)} on port {port} (log: {log})", flush=True)
        process = _start_server(port, log)
        base = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(f"{base}/v1/models", headers=_auth(args.api_key), timeout=30).json()["data"][0]["id"]
        if process is not None:
            from dsv4_jax import LLM
            from serve.args import parse_args as server_args

            llm = LLM.from_engine_args(server_args(list(SERVER_FLAGS)).engine)
        run, reference = asyncio.run(load_and_reference(base, args.api_key, model, requests, args.concurrency,
                                                        process.pid if process else None, llm))
        after = metrics(base)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    comparisons = None if reference is None else compare_with_reference(llm.model, run, reference)
    checks = _checks(run, after, comparisons)
    figures = summary(run)
    for name, value in figures.items():
        print(f"{name:>22}: {value:.2f}" if isinstance(value, float) else f"{name:>22}: {value}")
    print(f"{'peak running/waiting':>22}: {run.max_running:.0f} / {run.max_waiting:.0f}")
    if run.rss_kib:
        print(f"{'server RSS (KiB)':>22}: {run.rss_kib}")
    for name, problems in checks.items():
        print(f"{'ok' if not problems else 'FAILED'}: {name}" + "".join(f"\n    {p}" for p in problems[:10]))
    ties = None if comparisons is None else near_tie_summary(comparisons)
    if ties is not None:
        counts = ", ".join(f"{kind} {n}" for kind, n in ties["diverged at a near-tie"].items())
        print(f"diverged at a near-tie (not compared further, not errors), by kind: {counts}; "
              f"{ties['output tokens not compared']} output tokens not compared"
              + "".join(f"\n    {r}" for r in ties["requests"][:10]))
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "rss_kib": run.rss_kib, "checks": checks,
                                         "near_ties": ties}, indent=2))
    return 0 if not any(checks.values()) else 1


def _checks(run: LoadRun, after: dict[str, float], comparisons: list[Comparison] | None) -> dict[str, list[str]]:
    checks = {"streams well formed": [f"request {i}: {p}" for i, r in enumerate(run.results) for p in r.problems],
              "metrics back to 0": [f"{name} = {after.get(name)}" for name in (
                  "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
                  if after.get(name) != 0]}
    if comparisons is not None:
        checks["greedy outputs match the offline engine"] = [
            f"request {i}: {c.mismatch}" for i, c in enumerate(comparisons) if c.mismatch]
    if "half" in run.rss_kib:
        growth = run.rss_kib["end"] / run.rss_kib["half"] - 1
        checks[f"server RSS growth {growth:+.1%} over the second half"] = (
            [f"above {RSS_GROWTH_LIMIT:.0%}"] if growth > RSS_GROWTH_LIMIT else [])
    return checks


if __name__ == "__main__":
    sys.exit(main())
