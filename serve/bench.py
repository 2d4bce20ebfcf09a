"""`python -m serve.bench`: the serving benchmark, modelled on `vllm bench serve` (same flag names,
table layout and result JSON keys), for any OpenAI-compatible server.

    python -m serve.bench --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 256 --random-output-len 64 --num-prompts 200 --max-concurrency 16 \\
        --request-rate 8 --save-result --result-dir results/

Every request is streamed (SSE over httpx). Per request: TTFT (send -> first chunk that carries
output), E2EL (send -> last such chunk), ITL (every gap between such chunks) and TPOT
((E2EL - TTFT) / (output tokens - 1)); the output token count is the server's
`usage.completion_tokens` (requested with `stream_options.include_usage`). Arrivals are a Poisson
process at `--request-rate` (gamma with `--burstiness` != 1), or all at once for `inf`, and at most
`--max-concurrency` requests are in flight.

Prompts are built without a tokenizer (serve/bench_datasets.py): token ids for `/v1/completions`,
random words for `/v1/chat/completions`. This client does not import jax.

Where it differs from `vllm bench serve`:

    flag / behaviour          here                                  vLLM
    ------------------------  ------------------------------------  -----------------------------------
    --dataset-name            random, prefix_repetition             also sharegpt, sonnet, hf, ...
    --backend                 openai, vllm, openai-chat; default:   default openai
                              follows --endpoint (and must agree)
    --tokenizer               none: prompts are token ids / words   a local tokenizer builds the prompts
    --random-vocab-size       token ids are drawn from [0, N)       the tokenizer's vocabulary
                              (default 32000)
    --api-key                 flag, default $OPENAI_API_KEY          $OPENAI_API_KEY only
    --request-timeout         seconds per request (default 6 h)     6 h, fixed
    prefix_repetition         exactly --num-prompts requests        num_prompts // num_prefixes per prefix
    chat TTFT                 the first chunk with output; the      the first chunk, role-only included
                              role-only opening chunk is not        (the same against our server and
                                                                    vLLM's, which send it with the
                                                                    first output)
    a stream without [DONE]   counts as failed                      counts as complete
    an error event mid-stream counts as failed                      ignored (no `choices`): complete
    random token ids          any id in [0, N), special ones too    the tokenizer's, special ids left out
    --goodput, peak output    not built (`request_goodput` null)    SLO goodput, peak tokens/s per second
    result JSON               mean/median/std/pN of ttft, tpot,     those of --percentile-metrics
                              itl and e2el always; `latencies`
                              only with --save-detailed             `latencies` always

Bad flags: one line `serve.bench: error: ...` and exit status 2. Failed requests are reported
(counted, first errors printed), not fatal: the exit status is 0 as in vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import httpx
import numpy as np
from tqdm import tqdm

from pallas_kernels.cli import AddArgument, OneLineParser, add_debug_flag, one_line, run_main
from serve.bench_datasets import (
    DATASET_NAMES,
    SampleRequest,
    prefix_repetition_requests,
    random_requests,
)

PROG = "serve.bench"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BACKEND_ENDPOINTS = {"openai": COMPLETIONS, "vllm": COMPLETIONS, "openai-chat": CHAT}
# metric -> (its name in the table, the table's section header), in vLLM's words
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
# flag -> (request field, type): vLLM's sampling group, sent only when given
SAMPLING_FLAGS = {
    "--temperature": ("temperature", float), "--top-p": ("top_p", float), "--top-k": ("top_k", int),
    "--min-p": ("min_p", float), "--frequency-penalty": ("frequency_penalty", float),
    "--presence-penalty": ("presence_penalty", float), "--repetition-penalty": ("repetition_penalty", float),
}
# Chat delta fields that carry generated output (the opening {"role": ...} delta carries none).
CHAT_OUTPUT_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")
ERRORS_SHOWN = 10
DEFAULT_TIMEOUT_S = 6 * 60 * 60  # vLLM's aiohttp total timeout


@dataclass(frozen=True)
class BenchConfig:
    """The parsed command line."""

    base_url: str
    endpoint: str
    backend: str
    model: str | None  # None: the first model the server lists
    api_key: str | None
    dataset_name: str
    num_prompts: int
    random_input_len: int
    random_output_len: int
    random_prefix_len: int
    random_range_ratio: float
    random_vocab_size: int
    prefix_repetition_prefix_len: int
    prefix_repetition_suffix_len: int
    prefix_repetition_num_prefixes: int
    prefix_repetition_output_len: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int
    ignore_eos: bool
    extra_body: Mapping[str, Any]  # sampling flags and --extra-body, merged into every request
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    request_timeout: float
    disable_tqdm: bool
    save_result: bool
    save_detailed: bool
    result_dir: str | None
    result_filename: str | None
    label: str | None

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT


@dataclass
class RequestOutput:
    """What one streamed request measured (seconds, perf_counter clock)."""

    prompt_len: int = 0
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0  # send -> last output chunk (E2EL)
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


# ---- arrivals and statistics ---------------------------------------------------------------------
def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds after the start, float64 [num_requests]: a Poisson process at
    `request_rate` per second (gaps exponential, mean 1 / rate) for burstiness 1, gamma gaps with
    shape `burstiness` and the same mean otherwise, equal gaps of 1 / rate for an infinite
    burstiness; all zeros for an infinite rate. The first request waits one gap, and the times are
    scaled so the last one is num_requests / rate, as in vLLM's `get_request` (the offered load
    then no longer varies with the seed: unscaled, the last time's spread is ~20% at 20 requests)."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    if num_requests and offsets[-1] > 0:  # all-zero gaps (a tiny burstiness) stay at once, as vLLM's
        offsets *= num_requests / request_rate / offsets[-1]
    return offsets


def metric_stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and each percentile (numpy's linear interpolation, as vLLM) of `values_s`
    (seconds), in milliseconds, under vLLM's keys (`mean_ttft_ms`, `p99_ttft_ms`, ...). No values
    gives zeros, as in vLLM."""
    values = np.asarray(values_s, dtype=np.float64) * 1000 if len(values_s) else np.zeros(1)
    stats = {f"mean_{name}_ms": float(np.mean(values)), f"median_{name}_ms": float(np.median(values)),
             f"std_{name}_ms": float(np.std(values))}
    for p in percentiles:
        stats[f"p{_percentile_word(p)}_{name}_ms"] = float(np.percentile(values, p))
    return stats


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    """Most successful requests in flight at once, over half-open intervals [start, start + E2EL)."""
    events = sorted([(o.start_time, 1) for o in outputs if o.success]
                    + [(o.start_time + o.latency, -1) for o in outputs if o.success])
    peak = running = 0
    for _, delta in events:  # at equal times -1 sorts first: a request ending as another starts is not overlap
        running += delta
        peak = max(peak, running)
    return peak


def summarize(outputs: Sequence[RequestOutput], duration_s: float, percentiles: Sequence[float]) -> dict[str, Any]:
    """vLLM's result fields over `outputs`: counts, token totals, throughputs over `duration_s`,
    and the statistics of TTFT, TPOT, ITL and E2EL over the successful requests. TPOT is per
    request, (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": peak_concurrency(outputs),
    }
    result.update(metric_stats("ttft", [o.ttft for o in done], percentiles))
    result.update(metric_stats("tpot", tpots, percentiles))
    result.update(metric_stats("itl", [gap for o in done for gap in o.itl], percentiles))
    result.update(metric_stats("e2el", [o.latency for o in done], percentiles))
    return result


# ---- one streamed request ------------------------------------------------------------------------
async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data` of each server-sent event (multi-line data joined with newlines); comments and
    other fields are skipped."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _chunk_output(chunk: dict, chat: bool) -> tuple[bool, str]:
    """(whether this chunk carries generated output, its text)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False, ""
    choice = _dict(choices[0])
    if not chat:
        return True, str(choice.get("text") or "")
    delta = _dict(choice.get("delta"))
    carries = any(delta.get(key) for key in CHAT_OUTPUT_FIELDS) or choice.get("finish_reason") is not None
    return carries, str(delta.get("content") or "")


def _http_error(status: int, body: bytes) -> str:
    try:
        message = _dict(_dict(json.loads(body)).get("error")).get("message")
    except ValueError:
        message = None
    return f"HTTP {status}: {message or body.decode('utf-8', 'replace')[:200]}"


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, headers: dict[str, str],
                       sample: SampleRequest, chat: bool, timeout_s: float) -> RequestOutput:
    """Stream one request and time it. Never raises for a failed request: the failure is in
    `.error` (HTTP status and message, an error event, a stream cut before `data: [DONE]`, a
    connection error or the timeout)."""
    out = RequestOutput(prompt_len=sample.prompt_len)
    out.start_time = last = time.perf_counter()
    output_chunks, saw_done = 0, False
    text: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=payload, headers=headers) as response:
                if response.status_code != 200:
                    out.error = _http_error(response.status_code, await response.aread())
                    return out
                async for data in _sse_data(response):
                    if data.strip() == "[DONE]":
                        saw_done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        out.error = f"a stream chunk is not a JSON object: {data[:200]}"
                        return out
                    if chunk.get("error"):
                        out.error = f"error event: {_dict(chunk['error']).get('message', chunk['error'])}"
                        return out
                    carries, piece = _chunk_output(chunk, chat)
                    if carries:
                        if output_chunks == 0:
                            out.ttft = now - out.start_time
                        else:
                            out.itl.append(now - last)
                        last = now
                        output_chunks += 1
                        text.append(piece)
                    usage = _dict(chunk.get("usage"))
                    if isinstance(usage.get("completion_tokens"), int):
                        out.output_tokens = usage["completion_tokens"]
                    if isinstance(usage.get("prompt_tokens"), int):
                        out.prompt_len = usage["prompt_tokens"]
    except (httpx.HTTPError, TimeoutError, OSError, ValueError) as error:
        out.error = f"{type(error).__name__}: {one_line(error)}" if str(error) else type(error).__name__
        return out
    if not saw_done:
        out.error = "the stream ended without data: [DONE]"
    elif output_chunks == 0:
        out.error = "no chunk with output before data: [DONE]"
    else:
        out.success = True
        out.latency = last - out.start_time
        out.output_tokens = out.output_tokens or output_chunks  # a server that reports no usage
        out.generated_text = "".join(text)
    return out


def request_payload(config: BenchConfig, model: str, sample: SampleRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if config.chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
        payload["max_completion_tokens"] = sample.expected_output_len
    else:
        payload["prompt"] = sample.prompt
        payload["max_tokens"] = sample.expected_output_len
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return {**payload, **config.extra_body}


# ---- the run -------------------------------------------------------------------------------------
def _headers(config: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def served_model(config: BenchConfig) -> str:
    """--model, else the first model `GET /v1/models` lists (as vLLM)."""
    if config.model is not None:
        return config.model
    url = f"{config.base_url}/v1/models"
    try:
        response = httpx.get(url, headers=_headers(config), timeout=min(config.request_timeout, 30.0))
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        raise ValueError(f"--model not given and {url} listed no model ({type(error).__name__}: "
                         f"{one_line(error)}); pass --model or check --base-url") from None


def sample_requests(config: BenchConfig) -> list[SampleRequest]:
    common = {"vocab_size": config.random_vocab_size, "as_text": config.chat, "seed": config.seed}
    if config.dataset_name == "random":
        return random_requests(config.num_prompts, config.random_input_len, config.random_output_len,
                               prefix_len=config.random_prefix_len, range_ratio=config.random_range_ratio, **common)
    return prefix_repetition_requests(
        config.num_prompts, config.prefix_repetition_prefix_len, config.prefix_repetition_suffix_len,
        config.prefix_repetition_num_prefixes, config.prefix_repetition_output_len, **common)


async def run_benchmark(config: BenchConfig, model: str,
                        requests: Sequence[SampleRequest]) -> tuple[list[RequestOutput], float]:
    """Send `requests` at their arrival times, at most --max-concurrency at once; the outputs (in
    request order) and the wall seconds from the first send to the last answer."""
    # The arrival stream is seeded apart from the dataset, so changing the rate keeps the prompts.
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness,
                              np.random.default_rng([config.seed, 1]))
    limit = config.max_concurrency
    gate = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
    url, headers = f"{config.base_url}{config.endpoint}", _headers(config)
    timeout = httpx.Timeout(config.request_timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit,
                                                                      max_keepalive_connections=limit)) as client:
        with tqdm(total=len(requests), disable=config.disable_tqdm, unit="req") as bar:
            async def one(sample: SampleRequest) -> RequestOutput:
                async with gate:
                    out = await send_request(client, url, request_payload(config, model, sample), headers,
                                             sample, config.chat, config.request_timeout)
                bar.update(1)
                return out

            start = time.perf_counter()
            tasks = []
            for sample, offset in zip(requests, offsets):
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                tasks.append(asyncio.create_task(one(sample)))
            outputs = list(await asyncio.gather(*tasks))
            duration = time.perf_counter() - start
    return outputs, duration


# ---- report --------------------------------------------------------------------------------------
def format_table(result: Mapping[str, Any], config: BenchConfig) -> str:
    """vLLM's result table."""
    rows = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, number_format: str = "") -> None:
        rows.append(f"{label:<40} {value:<10{number_format}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if config.max_concurrency is not None:
        row("Maximum request concurrency:", config.max_concurrency)
    if not math.isinf(config.request_rate):
        row("Request rate configured (RPS):", config.request_rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for metric in config.percentile_metrics:
        short, header = METRICS[metric]
        rows.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{metric}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{metric}_ms"], ".2f")
        for p in config.metric_percentiles:
            row(f"P{_percentile_word(p)} {short} (ms):", result[f"p{_percentile_word(p)}_{metric}_ms"], ".2f")
    rows.append("=" * 50)
    return "\n".join(rows)


def result_json(config: BenchConfig, model: str, outputs: Sequence[RequestOutput], duration_s: float,
                date: str) -> dict[str, Any]:
    """The saved result: vLLM's setup keys, then summarize()'s; per-request lists only with
    --save-detailed."""
    result: dict[str, Any] = {
        "date": date, "endpoint_type": config.backend, "backend": config.backend, "label": config.label,
        "model_id": model, "endpoint": config.endpoint, "dataset_name": config.dataset_name,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness, "max_concurrency": config.max_concurrency,
    }
    result.update(summarize(outputs, duration_s, config.metric_percentiles))
    result["request_goodput"] = None  # vLLM writes the key always (None without --goodput, which is not built)
    if config.save_detailed:
        result.update({
            "input_lens": [o.prompt_len for o in outputs],
            "output_lens": [o.output_tokens if o.success else 0 for o in outputs],  # vLLM: 0 for a failed request
            "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
            "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
            "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
        })
    return result


def result_path(config: BenchConfig, model: str, date: str) -> Path:
    """--result-filename, else vLLM's `{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`,
    under --result-dir (created) when given."""
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
    name = config.result_filename or (f"{config.label or config.backend}-{config.request_rate}qps{concurrency}-"
                                      f"{model.split('/')[-1]}-{date}.json")
    if config.result_dir is None:
        return Path(name)
    Path(config.result_dir).mkdir(parents=True, exist_ok=True)
    return Path(config.result_dir) / name


# ---- command line --------------------------------------------------------------------------------
def _number(kind: type, low: float, allowed: str, *, high: float = math.inf, inclusive: bool = True,
            inf_ok: bool = False):
    """An argparse type: `kind` (int or float) from `low` (above it when not inclusive) to `high`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number (allowed: {allowed})") from None
        if math.isnan(value) or (math.isinf(value) and not inf_ok) or not low <= value <= high \
                or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range (allowed: {allowed})")
        return value
    return parse


_positive_int = _number(int, 1, "1, 2, ...")
_count = _number(int, 0, "0, 1, ...")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object (allowed: '{{\"key\": value, ...}}')")
    return value


def _csv(text: str, flag: str, parse: Callable[[str], Any], allowed: str) -> tuple:
    try:
        values = tuple(parse(item.strip()) for item in text.split(","))
    except (ValueError, KeyError):
        values = ()
    if not values:
        raise ValueError(f"{flag} {text!r} is not allowed (allowed: {allowed})")
    return values


def _percentile(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 100:
        raise ValueError(text)
    return value


def _metric(text: str) -> str:
    if text not in METRICS:
        raise KeyError(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=f"python -m {PROG}", error_prog=PROG, description=__doc__, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    # One helper per group of flags, in the order `--help` lists them.
    for add_group in (_add_server_flags, _add_dataset_flags, _add_load_flags, _add_result_flags):
        add_group(parser.add_argument)
    add_debug_flag(parser)
    return parser


def _add_server_flags(add: AddArgument) -> None:
    """Where the requests go, in which format, for which model, with which key."""
    add("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    add("--host", default="127.0.0.1", help="server host when --base-url is not given (default: %(default)s)")
    add("--port", type=_number(int, 1, "1..65535", high=65535), default=8000, help="server port (default: %(default)s)")
    add("--endpoint", choices=(COMPLETIONS, CHAT), default=None,
        help=f"API route (default: {COMPLETIONS}, or {CHAT} with --backend openai-chat)")
    add("--backend", choices=tuple(BACKEND_ENDPOINTS), default=None,
        help="vLLM's name for the request format; must agree with --endpoint (default: follows --endpoint)")
    add("--model", default=None, help="model name sent in requests (default: the first one GET /v1/models lists)")
    add("--served-model-name", default=None, help="the name to send instead of --model (default: --model)")
    add("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY, else none)")


def _add_dataset_flags(add: AddArgument) -> None:
    """How many prompts, and the lengths and shared prefixes of each dataset's."""
    add("--dataset-name", choices=DATASET_NAMES, default="random", help="prompt generator (default: %(default)s)")
    add("--num-prompts", type=_positive_int, default=1000, help="requests to send (default: %(default)s)")
    add("--input-len", type=_positive_int, default=None, help="sets --random-input-len (default: unset)")
    add("--output-len", type=_positive_int, default=None,
        help="sets --random-output-len and --prefix-repetition-output-len (default: unset)")
    add("--random-input-len", type=_positive_int, default=1024, help="prompt tokens after the prefix (default: %(default)s)")
    add("--random-output-len", type=_positive_int, default=128, help="output tokens asked for (default: %(default)s)")
    add("--random-prefix-len", type=_count, default=0, help="tokens of a prefix shared by all prompts (default: %(default)s)")
    add("--random-range-ratio", type=_number(float, 0.0, "0 <= r < 1"), default=0.0,
        help="input and output lengths vary uniformly within +-ratio (default: %(default)s)")
    add("--random-vocab-size", type=_positive_int, default=32000,
        help="token ids of completions prompts are drawn from [0, N) (default: %(default)s)")
    add("--prefix-repetition-prefix-len", type=_count, default=256, help="tokens per shared prefix (default: %(default)s)")
    add("--prefix-repetition-suffix-len", type=_count, default=256,
        help="tokens after the prefix, per request (default: %(default)s)")
    add("--prefix-repetition-num-prefixes", type=_positive_int, default=10,
        help="distinct prefixes (default: %(default)s)")
    add("--prefix-repetition-output-len", type=_positive_int, default=128,
        help="output tokens asked for (default: %(default)s)")


def _add_load_flags(add: AddArgument) -> None:
    """When requests are sent, how many at once, and what each asks for beyond its prompt."""
    add("--request-rate", type=_number(float, 0.0, "a number > 0, or inf", inclusive=False, inf_ok=True),
        default=math.inf, help="requests per second, Poisson arrivals; inf sends all at once (default: %(default)s)")
    add("--burstiness", type=_number(float, 0.0, "a number > 0, or inf", inclusive=False, inf_ok=True), default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier, inf = equal gaps "
             "(default: %(default)s)")
    add("--max-concurrency", type=_positive_int, default=None,
        help="requests in flight at most (default: no limit)")
    add("--seed", type=_number(int, 0, "0, 1, ..."), default=0, help="seed of prompts and arrivals (default: %(default)s)")
    add("--ignore-eos", action="store_true",
        help="ask the server to ignore EOS; always on for the random dataset, as in vLLM (default: off)")
    for flag, (_, kind) in SAMPLING_FLAGS.items():
        add(flag, type=kind, default=None, help="sampling parameter sent with every request (default: the server's)")
    add("--extra-body", type=_json_object, default=None, help="JSON object merged into every request (default: none)")


def _add_result_flags(add: AddArgument) -> None:
    """What the table shows, and where the result JSON goes."""
    add("--percentile-metrics", default="ttft,tpot,itl",
        help=f"metrics shown in the table, from {','.join(METRICS)} (default: %(default)s; the JSON has all)")
    add("--metric-percentiles", default="99", help="comma-separated percentiles, 0..100 (default: %(default)s)")
    add("--request-timeout", type=_number(float, 0.0, "seconds > 0", inclusive=False), default=DEFAULT_TIMEOUT_S,
        help="seconds a request may take before it counts as failed (default: %(default)s)")
    add("--disable-tqdm", action="store_true", help="no progress bar (default: off)")
    add("--save-result", action="store_true", help="write the result JSON (default: off)")
    add("--save-detailed", action="store_true", help="add per-request lists to the JSON (default: off)")
    add("--result-dir", default=None, help="directory for the JSON (default: the current directory)")
    add("--result-filename", default=None, help="JSON file name (default: vLLM's pattern)")
    add("--label", default=None, help="prefix of the default file name (default: the backend)")


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    """Parse and check `argv` (default: sys.argv[1:]); a bad value raises ValueError naming the flag."""
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.random_range_ratio >= 1:
        raise ValueError(f"--random-range-ratio {ns.random_range_ratio} is out of range (allowed: 0 <= r < 1)")
    endpoint = ns.endpoint or BACKEND_ENDPOINTS[ns.backend or "openai"]
    backend = ns.backend or ("openai-chat" if endpoint == CHAT else "openai")
    if BACKEND_ENDPOINTS[backend] != endpoint:
        raise ValueError(f"--backend {backend} sends to {BACKEND_ENDPOINTS[backend]}, not --endpoint {endpoint}; "
                         "give one of them, or a matching pair")
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {ns.base_url!r} is not an http:// or https:// URL")
    if ns.dataset_name == "prefix_repetition" and ns.prefix_repetition_prefix_len + ns.prefix_repetition_suffix_len == 0:
        raise ValueError("--prefix-repetition-prefix-len and --prefix-repetition-suffix-len are both 0: "
                         "prompts would be empty; allowed: a total of 1 or more")
    sampling = {name: getattr(ns, flag[2:].replace("-", "_"))
                for flag, (name, _) in SAMPLING_FLAGS.items() if getattr(ns, flag[2:].replace("-", "_")) is not None}
    return BenchConfig(
        base_url=base_url, endpoint=endpoint, backend=backend,
        model=ns.served_model_name or ns.model,
        api_key=ns.api_key or os.environ.get("OPENAI_API_KEY") or None,
        dataset_name=ns.dataset_name, num_prompts=ns.num_prompts,
        random_input_len=ns.input_len or ns.random_input_len,
        random_output_len=ns.output_len or ns.random_output_len,
        random_prefix_len=ns.random_prefix_len, random_range_ratio=ns.random_range_ratio,
        random_vocab_size=ns.random_vocab_size,
        prefix_repetition_prefix_len=ns.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=ns.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=ns.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=ns.output_len or ns.prefix_repetition_output_len,
        request_rate=ns.request_rate, burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, seed=ns.seed,
        ignore_eos=ns.ignore_eos or ns.dataset_name == "random",
        extra_body={**sampling, **(ns.extra_body or {})},
        percentile_metrics=_csv(ns.percentile_metrics, "--percentile-metrics", _metric, ", ".join(METRICS)),
        metric_percentiles=_csv(ns.metric_percentiles, "--metric-percentiles", _percentile, "numbers 0..100, e.g. 50,99"),
        request_timeout=ns.request_timeout, disable_tqdm=ns.disable_tqdm, save_result=ns.save_result,
        save_detailed=ns.save_detailed, result_dir=ns.result_dir, result_filename=ns.result_filename, label=ns.label,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    requests = sample_requests(config)
    model = served_model(config)
    rate = "inf (all at once)" if math.isinf(config.request_rate) else f"{config.request_rate} req/s"
    print(f"{config.num_prompts} {config.dataset_name} prompts to {config.base_url}{config.endpoint} "
          f"(model {model}), rate {rate}, burstiness {config.burstiness}, "
          f"max concurrency {config.max_concurrency or 'unlimited'}")
    outputs, duration = asyncio.run(run_benchmark(config, model, requests))
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    result = result_json(config, model, outputs, duration, date)
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"Failed requests (first {min(len(errors), ERRORS_SHOWN)} of {len(errors)}):")
        for error in errors[:ERRORS_SHOWN]:
            print(f"  {error}")
    print(format_table(result, config))
    if config.save_result:
        path = result_path(config, model, date)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result saved to {path}")
    return 0


def entry() -> NoReturn:
    run_main(main, prog=PROG)


if __name__ == "__main__":
    entry()
