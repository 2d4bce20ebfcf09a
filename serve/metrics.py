"""Prometheus metrics of the server, under vLLM's names, so a vLLM user's Grafana dashboards keep working.

`GET /metrics` serves `ServerMetrics.render()`. Every series carries the label `model_name` (the served
model name), as vLLM's do; vLLM also adds `engine` (its data-parallel engine index), which we leave out:
we have one engine, and vLLM's dashboards select on `model_name`, `job` and `instance`.

Names, types and bucket boundaries follow vLLM's `PrometheusStatLogger` in `vllm/v1/metrics/loggers.py`
(read at vllm-project/vllm, v0.11-era main: the version that renamed `time_per_output_token_seconds` to
`inter_token_latency_seconds`):

- gauges, read from the engine at scrape time: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (a fraction in [0, 1], "1 means 100 percent usage");
- counters: `vllm:prompt_tokens_total` (a request's prompt counted with its first token, as vLLM counts it
  at the end of its prefill), `vllm:generation_tokens_total`,
  `vllm:request_success_total{finished_reason}`, `vllm:num_preemptions_total`,
  `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (prompt tokens looked up in the
  prefix cache, and found; these three read from the scheduler's cumulative counts at scrape time);
- with speculative decoding on (`--speculative-config`) only, as vLLM's `SpecDecodingProm` in
  `vllm/v1/spec_decode/metrics.py`, the engine's cumulative counters read at scrape time:
  `vllm:spec_decode_num_drafts_total` (verify rows that carried drafts),
  `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total` and
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position}` (drafts accepted at draft position
  0..k-1). The acceptance rate is rate(accepted) / rate(draft tokens), the mean acceptance length
  1 + rate(accepted) / rate(drafts), position i's acceptance rate rate(per_pos{position=i}) /
  rate(drafts);
- histograms: `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds`, `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`;
  from the engine's timestamps (`RequestOutput.metrics`), as vLLM's FinishedRequestStats:
  `vllm:request_{queue,prefill,decode,inference}_time_seconds`,
  `vllm:request_time_per_output_token_seconds`; `vllm:request_params_max_tokens` of completed
  requests, and per prompt once all its choices completed `vllm:request_params_n` and
  `vllm:request_max_num_generation_tokens`.

Where we depart from vLLM, and why:

- `request_success_total` counts `stop` and `length` only. vLLM declares a series for each of its finish
  reasons (`stop`, `length`, `abort`, `error`, ...), but a client abort never reaches its finished-request
  accounting (`OutputProcessor.abort_requests` drops the request's stats; vllm-project/vllm issues #31503,
  #55634), so in practice its `abort` series stays 0. We do not expose series that cannot move.
- The per-request histograms (e2e latency, prompt and generation token counts) observe every finished
  request, aborted and failed ones included, so an abort storm shows in the latency panels; vLLM's miss
  client aborts for the reason above.
- vLLM observes inter-token latency once per engine step and request (the gap since the request's previous
  step). The server sees tokens in batches (several engine steps, or MTP drafts, may be streamed at once),
  so a batch of `count` tokens observes `gap / count`, `count` times: the sum stays the decode time and the
  count the number of tokens after the first batch, as vLLM's are when each step yields one token.

Times are seconds on one monotonic clock: `time.monotonic()` unless the caller passes `now` (tests do).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from dsv4_jax.engine.outputs import EngineStats, RequestMetrics

# No `*_created` series, as vLLM (they double the scrape for nothing a dashboard reads).
disable_created_metrics()

# Bucket boundaries copied from vLLM's vllm/v1/metrics/loggers.py (PrometheusStatLogger.__init__):
# histogram_time_to_first_token, histogram_inter_token_latency and request_latency_buckets.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
E2E_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)  # vLLM's histogram_n_request
# DeepSeek-V4's context (config.json max_position_embeddings); the app passes the engine's own.
DEFAULT_MAX_MODEL_LEN = 1_048_576

SUCCESS_REASONS = ("stop", "length")
FINISH_REASONS = (*SUCCESS_REASONS, "abort", "error")


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len: vLLM's build_1_2_5_buckets, the boundaries of its
    request_prompt_tokens / request_generation_tokens histograms."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len: got {max_model_len}, allowed: an integer >= 1")
    buckets: list[int] = []
    decade = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * decade > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * decade)
        decade *= 10


def idle_engine_stats(num_speculative_tokens: int = 0) -> EngineStats:
    """What `/metrics` reads before the engine serves: nothing running, every count 0, and with
    speculative decoding configured (k > 0) its series at 0 too, so that rate() sees them from the
    start (vLLM creates them at start-up)."""
    if not num_speculative_tokens:
        return EngineStats(0, 0, 0.0, 0)
    return EngineStats(0, 0, 0.0, 0, spec_decode_num_drafts_total=0, spec_decode_num_draft_tokens_total=0,
                       spec_decode_num_accepted_tokens_total=0,
                       spec_decode_num_accepted_tokens_per_pos_total=(0,) * num_speculative_tokens)


class _EngineStatsCollector:
    """Exposes the engine's gauges and its cumulative counters (preemptions, prefix cache, and
    speculative decoding when on) from one `engine_stats()` call per scrape, so they are never
    stale and agree with each other."""

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats]):
        self._model_name = model_name
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        labels = ["model_name"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             stats.num_requests_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             stats.num_requests_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage_perc),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self._model_name], value)
            yield gauge
        # CounterMetricFamily appends "_total" to the sample name itself: pass the name without it.
        counters = [
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.num_preemptions_total),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries_total),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_cache_hits_total),
        ]
        if stats.spec_decode_enabled:  # vLLM's help texts (SpecDecodingProm)
            counters += [
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_decode_num_drafts_total),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                 stats.spec_decode_num_draft_tokens_total),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                 stats.spec_decode_num_accepted_tokens_total),
            ]
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric([self._model_name], value)
            yield counter
        if stats.spec_decode_enabled:
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=[*labels, "position"])
            for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos_total):
                per_pos.add_metric([self._model_name, str(position)], value)
            yield per_pos


@dataclass
class _RequestTiming:
    start: float
    prompt_tokens: int
    last_token: float | None = None  # None until the first token
    generated: int = 0


class ServerMetrics:
    """The server's metrics, in a registry of its own (never prometheus_client's global one), so several
    instances can live in one process.

    Called from the asyncio loop; `render` may run concurrently on another thread. prometheus_client's
    metrics are thread-safe; the per-request timings here are guarded by a lock."""

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], EngineStats],
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    ):
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestTiming] = {}
        self._prompt_tokens_total = 0  # vllm:prompt_tokens_total and _generation_, for the stats line
        self._generation_tokens_total = 0
        self._model_name = model_name
        # Created in the order /metrics lists them.
        self._add_counters()
        self._add_latency_histograms()
        self._add_request_histograms(token_count_buckets(max_model_len))
        self.registry.register(_EngineStatsCollector(model_name, engine_stats))

    def _counter(self, name: str, doc: str) -> Counter:
        # prometheus_client appends "_total" to a counter's name itself: pass the name without it.
        return Counter(name, doc, ["model_name"], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:  # its series for this model
        return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(self._model_name)

    def _add_counters(self) -> None:
        """Prompt and generated tokens, and requests that completed by reason."""
        model_name = self._model_name
        self._prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(model_name)
        self._generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(model_name)
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # Created up front, as vLLM does, so rate() sees the series from 0 before the first request.
        self._success = {reason: success.labels(model_name, reason) for reason in SUCCESS_REASONS}

    def _add_latency_histograms(self) -> None:
        """Time to first token, inter-token latency and end-to-end latency, observed as tokens arrive."""
        histogram = self._histogram
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS_S
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS_S
        )

    def _add_request_histograms(self, count_buckets: tuple[int, ...]) -> None:
        """What a finished request observes: its token counts, its phases, its parameters."""
        histogram = self._histogram
        self._request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", count_buckets
        )
        self._request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", count_buckets
        )
        # A finished request's phases, from the engine's timestamps (`RequestMetrics`), as vLLM's.
        self._phases = {
            phase: histogram(f"vllm:request_{phase}_time_seconds", doc, E2E_BUCKETS_S)
            for phase, doc in (
                ("queue", "Histogram of time spent in WAITING phase for request."),
                ("inference", "Histogram of time spent in RUNNING phase for request."),
                ("prefill", "Histogram of time spent in PREFILL phase for request."),
                ("decode", "Histogram of time spent in DECODE phase for request."),
            )
        }
        self._request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS_S,
        )
        self._max_tokens_param = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", count_buckets
        )
        self._n_param = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self._max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            count_buckets,
        )

    def request_started(self, request_id: str, prompt_tokens: int, now: float | None = None) -> None:
        """A request entered the engine with `prompt_tokens` prompt tokens (counted in
        `vllm:prompt_tokens_total` once its prefill is done: with its first token, as vLLM counts
        them, so the rate is prefill throughput and a request aborted while waiting adds none)."""
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens of request {request_id!r}: got {prompt_tokens}, allowed: >= 0")
        start = time.monotonic() if now is None else now
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r}: already started, allowed: an id not in flight")
            self._requests[request_id] = _RequestTiming(start=start, prompt_tokens=prompt_tokens)

    def tokens_generated(self, request_id: str, count: int, now: float | None = None) -> None:
        """`count` new tokens of a request arrived at `now`. The first batch observes time to first token;
        each later batch observes `gap / count` inter-token latency `count` times."""
        if count < 0:
            raise ValueError(f"count of request {request_id!r}: got {count}, allowed: >= 0")
        arrived = time.monotonic() if now is None else now
        with self._lock:
            timing = self._requests.get(request_id)
            if timing is None or count == 0:  # unknown: aborted before its start was recorded
                return
            previous = timing.last_token
            timing.last_token = arrived
            timing.generated += count
            self._generation_tokens_total += count
            if previous is None:
                self._prompt_tokens_total += timing.prompt_tokens
        self._generation_tokens.inc(count)
        if previous is None:
            self._prompt_tokens.inc(timing.prompt_tokens)
            self._ttft.observe(arrived - timing.start)
            return
        per_token = (arrived - previous) / count
        for _ in range(count):
            self._itl.observe(per_token)

    def request_finished(self, request_id: str, finish_reason: str, now: float | None = None, *,
                         phases: RequestMetrics | None = None, max_tokens: int | None = None) -> None:
        """A request left the engine; `finish_reason` is one of stop, length, abort, error. `phases`:
        the engine's timestamps of its last output, for the queue, prefill, decode and inference
        times (each observed once its phase ended; vLLM's definitions) and its time per output
        token; `max_tokens`: its limit (observed for requests that completed, by stop or length)."""
        if finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason of request {request_id!r}: got {finish_reason!r}, allowed: {', '.join(FINISH_REASONS)}"
            )
        end = time.monotonic() if now is None else now
        with self._lock:
            timing = self._requests.pop(request_id, None)
        if timing is None:  # unknown: aborted before its start was recorded
            return
        if finish_reason in SUCCESS_REASONS:
            self._success[finish_reason].inc()
        self._e2e.observe(end - timing.start)
        self._request_prompt_tokens.observe(timing.prompt_tokens)
        self._request_generation_tokens.observe(timing.generated)
        if max_tokens and finish_reason in SUCCESS_REASONS:  # vLLM's stats never see an aborted request
            self._max_tokens_param.observe(max_tokens)
        if phases is not None:
            self._observe_phases(phases, timing.generated)

    def _observe_phases(self, t: RequestMetrics, generated: int) -> None:
        """vLLM's FinishedRequestStats: queued = scheduled - arrival, prefill = first token - scheduled,
        decode = last token - first token, inference = last token - scheduled, and the request's time
        per output token = decode / (tokens - 1), 0 for a single token (as vLLM)."""
        if t.first_scheduled_time is None:  # never left the queue (aborted while waiting)
            return
        self._phases["queue"].observe(t.first_scheduled_time - t.arrival_time)
        if t.first_token_time is None:
            return
        self._phases["prefill"].observe(t.first_token_time - t.first_scheduled_time)
        last = t.last_token_time if t.last_token_time is not None else t.first_token_time
        self._phases["decode"].observe(last - t.first_token_time)
        self._phases["inference"].observe(last - t.first_scheduled_time)
        self._request_tpot.observe((last - t.first_token_time) / (generated - 1) if generated > 1 else 0.0)

    def parent_finished(self, n: int, max_generation_tokens: int) -> None:
        """All `n` choices of one prompt have finished; the most tokens one of them generated (vLLM
        observes both when a parent request's last child finishes)."""
        self._n_param.observe(n)
        self._max_generation_tokens.observe(max_generation_tokens)

    def token_totals(self) -> tuple[int, int]:
        """(prompt, generation) tokens counted so far: `vllm:prompt_tokens_total` and
        `vllm:generation_tokens_total` as the next scrape reads them (the stats line's throughput)."""
        with self._lock:
            return self._prompt_tokens_total, self._generation_tokens_total

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of `GET /metrics`: Prometheus text format 0.0.4, which is what vLLM's
        /metrics (prometheus_client's ASGI app) answers a scraper that asks for no other format."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
