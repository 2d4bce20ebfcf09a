"""`python -m serve.bench` (serve/bench.py, serve/bench_datasets.py): small runs against the
session's real server (the `chat_server` fixture), a run against nothing, the statistics on
hand-made timings, the Poisson arrivals, the datasets and the command line."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from conftest import REPO, quiet_port  # tests/ is on sys.path

from serve.bench import (
    RequestOutput,
    arrival_offsets,
    main,
    metric_stats,
    peak_concurrency,
    send_request,
    summarize,
)
from serve.bench_datasets import (
    WORDS,
    SampleRequest,
    prefix_repetition_requests,
    random_requests,
)

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


def _run(tmp_path, *flags: str) -> dict:
    assert main([*flags, "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
                 "--result-filename", "result.json"]) == 0
    return json.loads((tmp_path / "result.json").read_text())


# ---- against the real server ---------------------------------------------------------------------
def test_completions_run_is_exact(chat_server, tmp_path, capsys):
    """8 random token-id prompts of 16 tokens, 8 output tokens each, 4 at a time: every count is
    exact, the model name comes from /v1/models, the statistics agree with the per-request timings."""
    result = _run(tmp_path, "--base-url", chat_server["base"], "--api-key", chat_server["key"],
                  "--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "16",
                  "--random-output-len", "8", "--max-concurrency", "4", "--request-rate", "inf",
                  "--random-vocab-size", "1000", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el")
    assert result["model_id"] == chat_server["name"] and result["endpoint"] == "/v1/completions"
    assert (result["completed"], result["failed"]) == (8, 0), result["errors"]
    assert result["input_lens"] == [16] * 8 and result["output_lens"] == [8] * 8
    assert "request_goodput" in result and result["request_goodput"] is None  # vLLM's key, always written
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (128, 64)
    # --max-concurrency 4 with every request sent at once: exactly 4 in flight at the peak.
    assert result["max_concurrent_requests"] == 4
    for ttft, latency, itl in zip(result["ttfts"], result["latencies"], result["itls"]):
        assert 0 < ttft < latency and 1 <= len(itl) <= 8 - 1  # at most one chunk per token
        assert math.isclose(ttft + sum(itl), latency, rel_tol=1e-6)  # the gaps tile the stream
    tpots = [(e2e - ttft) / 7 for ttft, e2e in zip(result["ttfts"], result["latencies"])]
    assert math.isclose(result["mean_tpot_ms"], 1000 * np.mean(tpots), rel_tol=1e-9)
    assert math.isclose(result["output_throughput"], 64 / result["duration"], rel_tol=1e-9)
    assert math.isclose(result["request_throughput"], 8 / result["duration"], rel_tol=1e-9)
    for name in METRIC_NAMES:
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    table = capsys.readouterr().out
    assert "Successful requests:                     8" in table and "P99 ITL (ms):" in table
    assert "Total generated tokens:                  64" in table


def test_chat_prefix_repetition_run(chat_server, tmp_path):
    """The chat endpoint with the shared-prefix dataset: output counts exact (--ignore-eos); the
    prompt counts are the server's (words plus the chat template), so above the words sent."""
    result = _run(tmp_path, "--base-url", chat_server["base"], "--api-key", chat_server["key"],
                  "--model", chat_server["name"], "--endpoint", "/v1/chat/completions",
                  "--dataset-name", "prefix_repetition", "--num-prompts", "4", "--prefix-repetition-prefix-len", "8",
                  "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
                  "--prefix-repetition-output-len", "4", "--ignore-eos", "--temperature", "0", "--disable-tqdm")
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert result["backend"] == "openai-chat" and result["output_lens"] == [4] * 4
    assert all(n > 12 for n in result["input_lens"])
    for ttft, latency, itl in zip(result["ttfts"], result["latencies"], result["itls"]):
        # At most one chunk per token: the opening role-only chunk is not counted as output.
        assert 0 < ttft <= latency and len(itl) <= 4 - 1


def test_wrong_port_fails_every_request_fast(tmp_path):
    start = time.monotonic()
    # Off the ephemeral range, so no other process's connection takes it meanwhile. Refused at
    # once: a run that waited for its 60 s timeout instead would fail the bound.
    result = _run(tmp_path, "--base-url", f"http://127.0.0.1:{quiet_port()}", "--model", "m", "--num-prompts", "3",
                  "--random-input-len", "4", "--random-output-len", "2", "--request-timeout", "60", "--disable-tqdm")
    assert time.monotonic() - start < 30
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (0, 3, 0)
    assert all(error.startswith("ConnectError") for error in result["errors"]), result["errors"]
    assert result["mean_ttft_ms"] == result["request_throughput"] == 0


def test_silent_server_times_out(tmp_path):
    """A port that accepts connections and never answers: each request fails at --request-timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        start = time.monotonic()
        result = _run(tmp_path, "--base-url", f"http://127.0.0.1:{listener.getsockname()[1]}", "--model", "m",
                      "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
                      "--request-timeout", "0.3", "--disable-tqdm")
        elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 3
    assert result["failed"] == 2 and all("Timeout" in error for error in result["errors"]), result["errors"]


# ---- one stream, from a scripted transport -------------------------------------------------------
def _send(events: list[str | float], status: int = 200, chat: bool = True) -> RequestOutput:
    """send_request against a transport that answers with `events`: each str is one SSE data
    line, each float a pause in seconds before the next."""
    async def body():
        for event in events:
            if isinstance(event, float):
                await asyncio.sleep(event)
            else:
                yield f"data: {event}\n\n".encode()

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://test/v1/chat/completions", {}, {},
                                      SampleRequest("hi", 2, 3), chat, 5.0)

    return asyncio.run(go())


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return json.dumps({"choices": choices, "usage": usage})


def test_stream_timing_skips_the_role_chunk():
    """TTFT runs to the first chunk with output, not to the opening role-only chunk; the output
    and prompt counts are the usage's; ITL is every gap between output chunks."""
    out = _send([_chunk({"role": "assistant", "content": ""}), 0.2, _chunk({"reasoning_content": "a"}), 0.05,
                 _chunk({"content": "b"}), _chunk({}, finish="length"),
                 _chunk(usage={"prompt_tokens": 9, "completion_tokens": 3}), "[DONE]"])
    assert out.success and out.error == "" and out.generated_text == "b"
    assert out.ttft >= 0.2 and len(out.itl) == 2 and out.itl[0] >= 0.05
    assert (out.output_tokens, out.prompt_len) == (3, 9)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))


@pytest.mark.parametrize("events, status, error", [
    ([_chunk({"content": "a"})], 200, "the stream ended without data: [DONE]"),
    ([_chunk({"role": "assistant"}), "[DONE]"], 200, "no chunk with output before data: [DONE]"),
    ([_chunk({"content": "a"}), json.dumps({"error": {"message": "engine died"}}), "[DONE]"], 200,
     "error event: engine died"),
    (["{not json"], 200, "JSONDecodeError"),
    (["[1, 2]"], 200, "a stream chunk is not a JSON object: [1, 2]"),
])
def test_stream_failures(events, status, error):
    out = _send(events, status)
    assert not out.success and out.error.startswith(error), out.error


def test_http_error_names_status_and_message():
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(
            401, json={"error": {"message": "bad key", "type": "invalid_request_error"}}))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://test/v1/completions", {}, {}, SampleRequest([1], 1, 1),
                                      False, 5.0)

    out = asyncio.run(go())
    assert not out.success and out.error == "HTTP 401: bad key"


# ---- statistics on hand-made timings -------------------------------------------------------------
def test_metric_stats_by_hand():
    stats = metric_stats("ttft", [v / 1000 for v in range(1, 101)], (50, 99, 99.9))  # 1..100 ms
    assert stats["mean_ttft_ms"] == pytest.approx(50.5)
    assert stats["median_ttft_ms"] == pytest.approx(50.5) == stats["p50_ttft_ms"]
    assert stats["p99_ttft_ms"] == pytest.approx(99.01)  # rank 0.99 x 99 = 98.01: 99 + 0.01 x (100 - 99)
    assert stats["p99.9_ttft_ms"] == pytest.approx(99.901)
    assert stats["std_ttft_ms"] == pytest.approx(math.sqrt((100**2 - 1) / 12))
    assert set(metric_stats("itl", [], (99,)).values()) == {0.0}


def test_summarize_by_hand():
    outputs = [
        RequestOutput(prompt_len=10, success=True, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestOutput(prompt_len=20, success=True, output_tokens=3, ttft=0.2, latency=0.4, itl=[0.1] * 2,
                      start_time=0.3),
        RequestOutput(prompt_len=7, error="HTTP 500: boom", start_time=0.1),
        RequestOutput(prompt_len=5, success=True, output_tokens=1, ttft=0.3, latency=0.3, start_time=1.0),
    ]
    result = summarize(outputs, 2.0, (99,))
    assert (result["completed"], result["failed"]) == (3, 1)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (35, 9)  # the failed one not counted
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(4.5)
    assert result["total_token_throughput"] == pytest.approx(22.0)
    # TPOT per request: (0.5 - 0.1) / 4 and (0.4 - 0.2) / 2; one output token has none.
    assert result["mean_tpot_ms"] == pytest.approx(100.0) and result["std_tpot_ms"] == pytest.approx(0.0)
    assert result["mean_ttft_ms"] == pytest.approx(200.0) and result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["mean_itl_ms"] == pytest.approx(100.0)
    assert result["mean_e2el_ms"] == pytest.approx(400.0) and result["p99_e2el_ms"] == pytest.approx(498.0)
    assert result["max_concurrent_requests"] == 2  # [0, .5) and [.3, .7) overlap, [1, 1.3) alone


def test_peak_concurrency_is_half_open():
    back_to_back = [RequestOutput(success=True, start_time=s, latency=1.0) for s in (0.0, 1.0, 2.0)]
    assert peak_concurrency(back_to_back) == 1
    assert peak_concurrency([RequestOutput(success=True, start_time=s, latency=1.0) for s in (0.0, 0.5, 0.9)]) == 3


# ---- arrivals ------------------------------------------------------------------------------------
def test_poisson_arrivals():
    offsets = arrival_offsets(20000, 4.0, 1.0, np.random.default_rng(0))
    gaps = np.diff(offsets, prepend=0.0)
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: coefficient of variation 1
    np.testing.assert_array_equal(offsets, arrival_offsets(20000, 4.0, 1.0, np.random.default_rng(0)))
    assert not np.array_equal(offsets, arrival_offsets(20000, 4.0, 1.0, np.random.default_rng(1)))
    steady = np.diff(arrival_offsets(20000, 4.0, 4.0, np.random.default_rng(0)), prepend=0.0)
    assert steady.mean() == pytest.approx(0.25, rel=0.03)
    assert steady.std() / steady.mean() == pytest.approx(0.5, rel=0.05)  # gamma shape 4: 1 / sqrt(4)
    np.testing.assert_array_equal(arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))
    # Scaled as vLLM's get_request: the last request goes at N / rate whatever the seed, so the
    # offered load does not vary with it; an infinite burstiness gives equal gaps.
    for seed in range(5):
        few = arrival_offsets(20, 4.0, 1.0, np.random.default_rng(seed))
        assert few[-1] == pytest.approx(20 / 4.0) and np.all(np.diff(few) > 0)
    np.testing.assert_allclose(arrival_offsets(4, 2.0, math.inf, np.random.default_rng(0)), [0.5, 1.0, 1.5, 2.0])


# ---- datasets ------------------------------------------------------------------------------------
def test_random_dataset():
    requests = random_requests(50, 16, 8, prefix_len=3, range_ratio=0.5, vocab_size=100, as_text=False, seed=0)
    assert all(11 <= r.prompt_len == len(r.prompt) <= 3 + 24 and 4 <= r.expected_output_len <= 12 for r in requests)
    assert len({r.prompt_len for r in requests}) > 1 and len({tuple(r.prompt[:3]) for r in requests}) == 1
    assert all(0 <= t < 100 for r in requests for t in r.prompt)
    assert requests == random_requests(50, 16, 8, prefix_len=3, range_ratio=0.5, vocab_size=100, as_text=False,
                                       seed=0)
    exact = random_requests(4, 16, 8, vocab_size=100, as_text=True, seed=0)
    assert all(r.prompt_len == 16 == len(r.prompt.split()) and r.expected_output_len == 8 for r in exact)
    assert all(word in WORDS for r in exact for word in r.prompt.split())


def test_prefix_repetition_dataset():
    requests = prefix_repetition_requests(7, 5, 3, 3, 4, vocab_size=1000, as_text=False, seed=0)
    assert len(requests) == 7 and all(r.prompt_len == 8 and r.expected_output_len == 4 for r in requests)
    prefixes = [tuple(r.prompt[:5]) for r in requests]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [2, 2, 3]  # request i uses prefix i % 3
    assert len({tuple(r.prompt[5:]) for r in requests}) == 7
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes 8 is more than --num-prompts 7"):
        prefix_repetition_requests(7, 5, 3, 8, 4, vocab_size=1000, as_text=False, seed=0)


# ---- command line --------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "0"], "argument --num-prompts: '0' is out of range (allowed: 1, 2, ...)"),
    (["--request-rate", "0"], "argument --request-rate: '0' is out of range (allowed: a number > 0, or inf)"),
    (["--metric-percentiles", "101"], "--metric-percentiles '101' is not allowed (allowed: numbers 0..100"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat sends to"),
    (["--base-url", "localhost:8000"], "--base-url 'localhost:8000' is not an http:// or https:// URL"),
])
def test_bad_flags(flags, message, capsys):
    from pallas_kernels.cli import run_main

    with pytest.raises(SystemExit) as exit_info:
        run_main(main, flags, prog="serve.bench")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("serve.bench: error: ") and message in err and err.count("\n") == 1


def test_entry_point_is_a_client():
    """`python -m serve.bench` answers a bad flag with one line and status 2, and imports no jax."""
    bad = subprocess.run([sys.executable, "-m", "serve.bench", "--max-concurrency", "-3"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "serve.bench: error: argument --max-concurrency: '-3' is out of range (allowed: 1, 2, ...)\n"
    probe_code = ("import sys, serve.bench; "
                  "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'dsv4_jax')))")
    probe = subprocess.run([sys.executable, "-c", probe_code], cwd=REPO, capture_output=True, text=True, timeout=60,
                           check=False)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stderr
