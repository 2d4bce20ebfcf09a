"""The periodic stats line (serve/stats_log.py): its figures from two samples of the cumulative
counts, when it is written, and the loop that writes it. No jax, no compiles."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dsv4_jax.engine.outputs import EngineStats
from serve.metrics import idle_engine_stats
from serve.stats_log import StatsLogger, StatsSample, format_stats_lines, run_stats_logger

IDLE = StatsSample(EngineStats(0, 0, 0.0, 0))


def busy(prompt: int, generated: int, running: int = 2, waiting: int = 1, kv: float = 0.25, queries: int = 0,
         hits: int = 0, **spec) -> StatsSample:
    return StatsSample(EngineStats(running, waiting, kv, 0, prefix_cache_queries_total=queries,
                                   prefix_cache_hits_total=hits, **spec), prompt, generated)


def spec_counts(drafts: int, draft_tokens: int, accepted: int, per_pos: tuple[int, ...]) -> dict:
    return dict(spec_decode_num_drafts_total=drafts, spec_decode_num_draft_tokens_total=draft_tokens,
                spec_decode_num_accepted_tokens_total=accepted, spec_decode_num_accepted_tokens_per_pos_total=per_pos)


def test_the_line_has_vllms_figures_over_the_interval():
    """Throughputs and the hit rate from the differences over 10 s; running, waiting and the KV
    usage as they are at its end."""
    before = busy(1000, 200, queries=4000, hits=1000)
    after = busy(9000, 1200, running=5, waiting=0, kv=0.125, queries=6000, hits=2000)
    (line,) = format_stats_lines(before, after, 10.0)
    assert line == ("Avg prompt throughput: 800.0 tokens/s, Avg generation throughput: 100.0 tokens/s, "
                    "Running: 5 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 50.0%")


def test_no_prompt_looked_up_is_a_zero_hit_rate_and_no_time_zero_throughput():
    (line,) = format_stats_lines(busy(0, 0), busy(0, 10), 0.0)
    assert "Avg generation throughput: 0.0 tokens/s" in line and line.endswith("Prefix cache hit rate: 0.0%")


def test_spec_decode_line_as_vllms_from_the_intervals_drafts():
    """k = 3 over 4 s: 20 rows with drafts (60 draft tokens), 33 accepted: 16 at position 0, 11 at
    1, 6 at 2. Mean acceptance length 1 + 33 / 20, acceptance 33 / 60, position i's rate its
    accepted / 20."""
    before = busy(0, 100, **spec_counts(5, 15, 10, (5, 3, 2)))
    after = busy(0, 180, **spec_counts(25, 75, 43, (21, 14, 8)))
    main, spec = format_stats_lines(before, after, 4.0)
    assert main.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 20.0 tokens/s")
    assert spec == ("SpecDecoding metrics: Mean acceptance length: 2.65, Accepted throughput: 8.25 tokens/s, "
                    "Drafted throughput: 15.00 tokens/s, Accepted: 33 tokens, Drafted: 60 tokens, "
                    "Per-position acceptance rate: 0.800, 0.550, 0.300, Avg Draft acceptance rate: 55.0%")


def test_no_spec_decode_line_without_speculation_or_without_drafts():
    assert len(format_stats_lines(busy(0, 0), busy(0, 50), 1.0)) == 1  # speculation off
    same = spec_counts(5, 10, 7, (4, 3))
    assert len(format_stats_lines(busy(0, 0, **same), busy(0, 50, **same), 1.0)) == 1  # nothing drafted
    first = StatsSample(idle_engine_stats(2))
    assert len(format_stats_lines(first, busy(0, 1, **spec_counts(1, 2, 2, (1, 1))), 1.0)) == 2


def test_lines_while_serving_and_once_after_then_quiet():
    """An idle server writes nothing; each interval that served requests writes its line, and the
    first idle interval after them one more (throughput back to 0), then nothing."""
    stats = StatsLogger(IDLE, now=0.0)
    assert stats.tick(IDLE, now=10.0) == []
    waiting = busy(0, 0, running=0, waiting=3)  # queued, nothing computed yet: still worth a line
    assert len(stats.tick(waiting, now=20.0)) == 1
    serving = busy(500, 40, running=3, waiting=0)
    (line,) = stats.tick(serving, now=30.0)
    assert line.startswith("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 4.0 tokens/s")
    done = busy(500, 60, running=0, waiting=0)
    assert len(stats.tick(done, now=40.0)) == 1  # tokens in this interval, none running at its end
    (last,) = stats.tick(done, now=50.0)
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs" in last
    assert stats.tick(done, now=60.0) == []
    assert stats.tick(done, now=70.0) == []


def test_the_loop_counts_from_zero_once_the_engine_serves_and_survives_a_failed_read(caplog):
    """None: still loading. The first sample is then an interval from 0 (what the engine served
    before the tick is in its line); a failed read is one warning and the next interval spans it."""
    samples = iter([None, None, busy(100, 10, **spec_counts(4, 8, 6, (4, 2))), "boom",
                    busy(200, 20, **spec_counts(5, 10, 6, (4, 2)))])

    def sample() -> StatsSample | None:
        item = next(samples)
        if item == "boom":
            raise RuntimeError("engine gone")
        return item

    lines: list[str] = []

    async def run() -> None:
        task = asyncio.create_task(run_stats_logger(sample, 0.001, emit=lines.append))
        while len(lines) < 4 and not task.done():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.WARNING, logger="serve"):
        asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert len(lines) == 4 and lines[0].startswith("Avg prompt throughput") and "Running: 2 reqs" in lines[2]
    assert "Accepted: 6 tokens, Drafted: 8 tokens, Per-position acceptance rate: 1.000, 0.500" in lines[1]
    assert "Accepted: 0 tokens, Drafted: 2 tokens, Per-position acceptance rate: 0.000, 0.000" in lines[3]
    assert [r.getMessage() for r in caplog.records] == ["stats line skipped: RuntimeError: engine gone"]
