"""The periodic stats line of the server's log, in the words of vLLM's `LoggingStatLogger`.

Every `VLLM_LOG_STATS_INTERVAL` seconds (10 unless set; `--disable-log-stats` turns it off), while
requests were served in that interval or the one before it (so the drop to idle shows once, then
an idle server stays quiet), the `serve` logger writes at INFO:

    Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

and, with speculative decoding on and drafts verified in the interval, vLLM's second line:

    SpecDecoding metrics: Mean acceptance length: 2.31, Accepted throughput: 54.20 tokens/s,
    Drafted throughput: 82.10 tokens/s, Accepted: 542 tokens, Drafted: 821 tokens,
    Per-position acceptance rate: 0.812, 0.497, Avg Draft acceptance rate: 66.0%

(each is one line). Every figure but the running / waiting requests and the KV cache usage (read
at the end) is over the interval: the difference of two `StatsSample`s of the cumulative counts
`/metrics` exposes, so the line and a dashboard agree. The mean acceptance length counts the token
each verify row adds after its accepted drafts (1 + accepted / drafts, as vLLM); position i's
acceptance rate is the share of the drafts whose i-th token was accepted. A hit rate with no
prompt token looked up is 0.0%, as vLLM's. Where this differs from vLLM: no `Engine 000:` prefix
(one engine) and `KV cache usage` for vLLM's `GPU KV cache usage` (the device may be a CPU).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from dsv4_jax.engine.outputs import EngineStats
from serve.metrics import idle_engine_stats

logger = logging.getLogger("serve")


@dataclasses.dataclass(frozen=True)
class StatsSample:
    """What one line compares: the engine's stats and the server's token counters at one instant."""

    engine: EngineStats
    prompt_tokens_total: int = 0  # vllm:prompt_tokens_total
    generation_tokens_total: int = 0  # vllm:generation_tokens_total


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def format_stats_lines(before: StatsSample, after: StatsSample, elapsed_s: float) -> list[str]:
    """The line of the interval from `before` to `after` (`elapsed_s` seconds), then the
    speculative-decoding line when speculation is on and drafts were verified in it."""
    a, b = before.engine, after.engine
    queries = b.prefix_cache_queries_total - a.prefix_cache_queries_total
    hits = b.prefix_cache_hits_total - a.prefix_cache_hits_total
    lines = [
        f"Avg prompt throughput: {_rate(after.prompt_tokens_total - before.prompt_tokens_total, elapsed_s):.1f} "
        f"tokens/s, Avg generation throughput: "
        f"{_rate(after.generation_tokens_total - before.generation_tokens_total, elapsed_s):.1f} tokens/s, "
        f"Running: {b.num_requests_running} reqs, Waiting: {b.num_requests_waiting} reqs, "
        f"KV cache usage: {b.kv_cache_usage_perc * 100:.1f}%, "
        f"Prefix cache hit rate: {hits / queries * 100 if queries > 0 else 0.0:.1f}%"
    ]
    spec = _spec_decode_line(a, b, elapsed_s)
    if spec is not None:
        lines.append(spec)
    return lines


def _spec_decode_line(a: EngineStats, b: EngineStats, elapsed_s: float) -> str | None:
    if not (a.spec_decode_enabled and b.spec_decode_enabled):
        return None
    drafts = b.spec_decode_num_drafts_total - a.spec_decode_num_drafts_total
    if drafts <= 0:
        return None
    draft_tokens = b.spec_decode_num_draft_tokens_total - a.spec_decode_num_draft_tokens_total
    accepted = b.spec_decode_num_accepted_tokens_total - a.spec_decode_num_accepted_tokens_total
    per_position = ", ".join(f"{(now - then) / drafts:.3f}" for now, then in zip(
        b.spec_decode_num_accepted_tokens_per_pos_total, a.spec_decode_num_accepted_tokens_per_pos_total))
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {_rate(accepted, elapsed_s):.2f} tokens/s, "
            f"Drafted throughput: {_rate(draft_tokens, elapsed_s):.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_position}, "
            f"Avg Draft acceptance rate: {accepted / draft_tokens * 100 if draft_tokens else 0.0:.1f}%")


def _active(before: StatsSample, after: StatsSample) -> bool:
    """Requests were served in the interval: tokens counted, or requests running or waiting at its end."""
    return (after.prompt_tokens_total != before.prompt_tokens_total
            or after.generation_tokens_total != before.generation_tokens_total
            or after.engine.num_requests_running > 0 or after.engine.num_requests_waiting > 0)


class StatsLogger:
    """Keeps the last sample; `tick` gives the lines of the interval since (none when it and the
    interval before were idle)."""

    def __init__(self, sample: StatsSample, now: float):
        self._last, self._last_time = sample, now
        self._was_active = False

    def tick(self, sample: StatsSample, now: float) -> list[str]:
        active = _active(self._last, sample)
        lines = format_stats_lines(self._last, sample, now - self._last_time) if active or self._was_active else []
        self._last, self._last_time, self._was_active = sample, now, active
        return lines


def _zero(like: StatsSample) -> StatsSample:
    """Every count 0, with `like`'s draft positions: what an engine that just started reads."""
    engine = like.engine
    return StatsSample(idle_engine_stats(len(engine.spec_decode_num_accepted_tokens_per_pos_total)
                                         if engine.spec_decode_enabled else 0))


async def run_stats_logger(sample: Callable[[], StatsSample | None], interval_s: float,
                           emit: Callable[[str], None] = logger.info) -> None:
    """Until cancelled: every `interval_s` seconds, `emit` each line of the interval. `sample`
    gives None while there is nothing to read (the engine still loading): the first interval with
    a sample then counts from 0 at the tick before (the engine served nothing earlier). A failed
    read is one warning, and the next interval spans it (the line is never worth stopping the
    server)."""
    stats: StatsLogger | None = None
    started = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        try:
            current, now = sample(), time.monotonic()
            if current is None:
                started = now
                continue
            if stats is None:
                stats = StatsLogger(_zero(current), started)
            for line in stats.tick(current, now):
                emit(line)
        except Exception as error:  # noqa: BLE001  (a dead engine is /health's to report)
            logger.warning("stats line skipped: %s: %s", type(error).__name__, error)
