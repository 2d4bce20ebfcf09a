"""serve.metrics: vLLM's Prometheus names, labels and values, read back with prometheus_client's own parser
from `render()`, against a scripted sequence of calls with explicit times. No jax, no compiles."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv4_jax.engine.outputs import RequestMetrics
from serve.metrics import EngineStats, ServerMetrics, idle_engine_stats, token_count_buckets

MODEL = "dsv4-tiny"
IDLE = EngineStats(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=0.0, num_preemptions_total=0)

# The exposed sample names a vLLM dashboard queries (vLLM's PrometheusStatLogger), with their family type.
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
SPEC_DECODE_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                        "vllm:spec_decode_num_accepted_tokens_total",
                        "vllm:spec_decode_num_accepted_tokens_per_pos_total")
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_params_max_tokens",
    "vllm:request_params_n",
    "vllm:request_max_num_generation_tokens",
)


def scrape(metrics: ServerMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value} of one render, parsed as Prometheus would."""
    body, _ = metrics.render()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(samples: dict, name: str, model: str = MODEL, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": model, **labels}.items()))]


def test_every_vllm_name_is_exposed_with_the_model_label_and_its_type():
    body, content_type = ServerMetrics(MODEL, lambda: IDLE).render()
    assert content_type.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    sample_names = {s.name: s for f in families.values() for s in f.samples}
    for name in GAUGES + COUNTERS + ("vllm:request_success_total",):
        assert name in sample_names, name
    for name in GAUGES:
        assert families[name].type == "gauge"
    for name in COUNTERS:
        assert families[name.removesuffix("_total")].type == "counter"
    for name in HISTOGRAMS:
        assert families[name].type == "histogram"
        assert f"{name}_count" in sample_names and f"{name}_sum" in sample_names
    for family in families.values():
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL, sample
    # vLLM's exact counter names: prometheus_client appends "_total" itself, a second one would break dashboards.
    lines = [line.split("{")[0].split(" ")[0] for line in body.decode().splitlines() if not line.startswith("#")]
    assert not [n for n in lines if "_total_total" in n]
    assert {"vllm:prompt_tokens_total", "vllm:request_success_total", "vllm:num_preemptions_total"} <= set(lines)


def test_scripted_requests_give_counters_and_histograms():
    m = ServerMetrics(MODEL, lambda: IDLE)
    # a: ttft 0.5; then 3 tokens over 0.375 s (3 ITL of 0.125) and 1 token after 0.25 s; stop at 1.25.
    m.request_started("a", prompt_tokens=7, now=0.0)
    m.tokens_generated("a", 1, now=0.5)
    m.tokens_generated("a", 3, now=0.875)
    m.tokens_generated("a", 0, now=0.9)  # nothing new: no observation, the gap still runs from 0.875
    m.tokens_generated("a", 1, now=1.125)
    m.request_finished("a", "stop", now=1.25)
    # b: its first batch has 2 tokens, which is a time to first token only (0.125); length at 2.0.
    m.request_started("b", prompt_tokens=4, now=0.25)
    m.tokens_generated("b", 2, now=0.375)
    m.request_finished("b", "length", now=2.0)
    # c: aborted before any token: e2e 0.5, not a success.
    m.request_started("c", prompt_tokens=3, now=1.0)
    m.request_finished("c", "abort", now=1.5)
    # unknown ids (aborted before their start was recorded) are ignored.
    m.tokens_generated("ghost", 5, now=1.0)
    m.request_finished("ghost", "error", now=1.0)

    s = scrape(m)
    assert value(s, "vllm:prompt_tokens_total") == 11  # counted with the first token, as vLLM: not c's 3
    assert value(s, "vllm:generation_tokens_total") == 7
    assert value(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert not [k for k in s if k[0] == "vllm:request_success_total" and ("finished_reason", "abort") in k[1]]

    assert value(s, "vllm:time_to_first_token_seconds_count") == 2
    assert value(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.625)
    assert value(s, "vllm:time_to_first_token_seconds_bucket", le="0.1") == 0
    assert value(s, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value(s, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 2

    assert value(s, "vllm:inter_token_latency_seconds_count") == 4
    assert value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.375 + 0.25)
    # The 3-token gap is spread: three observations of 0.125, not one of 0.375.
    assert value(s, "vllm:inter_token_latency_seconds_bucket", le="0.1") == 0
    assert value(s, "vllm:inter_token_latency_seconds_bucket", le="0.15") == 3
    assert value(s, "vllm:inter_token_latency_seconds_bucket", le="0.3") == 4

    assert value(s, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(s, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.25 + 1.75 + 0.5)
    assert value(s, "vllm:request_prompt_tokens_count") == 3
    assert value(s, "vllm:request_prompt_tokens_sum") == 14
    assert value(s, "vllm:request_generation_tokens_count") == 3
    assert value(s, "vllm:request_generation_tokens_sum") == 7
    assert value(s, "vllm:request_generation_tokens_bucket", le="1.0") == 1  # c's 0 tokens

    # A finished request is forgotten: its id starts afresh and later tokens of the old one are ignored.
    m.request_started("a", prompt_tokens=1, now=5.0)
    m.tokens_generated("a", 1, now=5.25)
    assert value(scrape(m), "vllm:time_to_first_token_seconds_count") == 3


def test_engine_gauges_and_preemptions_are_read_at_scrape_time():
    calls = []
    current = [EngineStats(num_requests_running=2, num_requests_waiting=1, kv_cache_usage_perc=0.25,
                           num_preemptions_total=0)]

    def engine_stats() -> EngineStats:
        calls.append(None)
        return current[0]

    m = ServerMetrics(MODEL, engine_stats)
    assert not calls  # nothing is read before a scrape
    s = scrape(m)
    assert (value(s, "vllm:num_requests_running"), value(s, "vllm:num_requests_waiting")) == (2, 1)
    assert value(s, "vllm:kv_cache_usage_perc") == 0.25
    assert value(s, "vllm:num_preemptions_total") == 0
    current[0] = EngineStats(num_requests_running=0, num_requests_waiting=3, kv_cache_usage_perc=0.875,
                             num_preemptions_total=4)
    s = scrape(m)
    assert (value(s, "vllm:num_requests_running"), value(s, "vllm:num_requests_waiting")) == (0, 3)
    assert value(s, "vllm:kv_cache_usage_perc") == 0.875
    assert value(s, "vllm:num_preemptions_total") == 4
    assert len(calls) == 2  # one consistent snapshot per scrape


def test_prefix_cache_counters_are_the_engines_cumulative_tokens_with_vllms_help():
    """vllm:prefix_cache_queries_total / _hits_total are EngineStats' token counts as they are at
    the scrape (the scheduler keeps the running sums), under vLLM's names and help texts, so its
    hit-rate query (rate(hits) / rate(queries)) reads the same here."""
    current = [IDLE]
    m = ServerMetrics(MODEL, lambda: current[0])
    s = scrape(m)
    assert (value(s, "vllm:prefix_cache_queries_total"), value(s, "vllm:prefix_cache_hits_total")) == (0, 0)
    # Two prompts of 1000 tokens: the first misses, the second finds its leading 768 (three blocks of 256).
    current[0] = EngineStats(num_requests_running=1, num_requests_waiting=0, kv_cache_usage_perc=0.5,
                             num_preemptions_total=0, prefix_cache_queries_total=2000, prefix_cache_hits_total=768)
    s = scrape(m)
    assert (value(s, "vllm:prefix_cache_queries_total"), value(s, "vllm:prefix_cache_hits_total")) == (2000, 768)
    body, _ = m.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["vllm:prefix_cache_queries"].type == families["vllm:prefix_cache_hits"].type == "counter"
    assert families["vllm:prefix_cache_queries"].documentation == \
        "Prefix cache queries, in terms of number of queried tokens."
    assert families["vllm:prefix_cache_hits"].documentation == "Prefix cache hits, in terms of number of cached tokens."


def test_two_instances_share_nothing():
    busy = EngineStats(num_requests_running=5, num_requests_waiting=0, kv_cache_usage_perc=0.5,
                       num_preemptions_total=2)
    a, b = ServerMetrics("model-a", lambda: busy), ServerMetrics("model-b", lambda: IDLE)
    a.request_started("r", prompt_tokens=9, now=0.0)
    a.tokens_generated("r", 1, now=0.5)
    b.request_started("r", prompt_tokens=2, now=0.0)  # same id in another instance is another request
    sa, sb = scrape(a), scrape(b)
    assert value(sa, "vllm:prompt_tokens_total", "model-a") == 9
    assert value(sb, "vllm:prompt_tokens_total", "model-b") == 0  # no token yet: its prefill is not done
    assert value(sb, "vllm:generation_tokens_total", "model-b") == 0
    assert value(sb, "vllm:time_to_first_token_seconds_count", "model-b") == 0
    assert value(sa, "vllm:num_requests_running", "model-a") == 5
    assert value(sb, "vllm:num_requests_running", "model-b") == 0
    assert not [k for k in sb if ("model_name", "model-a") in k[1]]


def test_vllm_bucket_boundaries():
    s = scrape(ServerMetrics(MODEL, lambda: IDLE, max_model_len=100))

    def bounds(histogram: str) -> list[float]:
        return sorted(float(dict(k[1])["le"]) for k in s if k[0] == f"{histogram}_bucket")[:-1]  # drop +Inf

    # Counts and ends of vLLM's lists (vllm/v1/metrics/loggers.py): TTFT 22, ITL 19, e2e 21 boundaries.
    ttft, itl, e2e = (bounds(f"vllm:{n}") for n in
                      ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"))
    assert (len(ttft), ttft[0], ttft[-1]) == (22, 0.001, 2560.0)
    assert (len(itl), itl[0], itl[-1]) == (19, 0.01, 80.0)
    assert (len(e2e), e2e[0], e2e[-1]) == (21, 0.3, 7680.0)
    # vLLM's build_1_2_5_buckets docstring: build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100].
    assert token_count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_count_buckets(99) == (1, 2, 5, 10, 20, 50)
    assert bounds("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100]


def test_bad_input_is_a_clear_value_error():
    m = ServerMetrics(MODEL, lambda: IDLE)
    m.request_started("r", prompt_tokens=1, now=0.0)
    with pytest.raises(ValueError, match=r"finish_reason.*'cancelled'.*stop, length, abort, error"):
        m.request_finished("r", "cancelled", now=1.0)
    with pytest.raises(ValueError, match=r"count.*-1"):
        m.tokens_generated("r", -1, now=1.0)
    with pytest.raises(ValueError, match=r"request_id 'r'.*already started"):
        m.request_started("r", prompt_tokens=1, now=1.0)
    with pytest.raises(ValueError, match=r"prompt_tokens.*-3"):
        m.request_started("s", prompt_tokens=-3, now=1.0)
    with pytest.raises(ValueError, match=r"kv_cache_usage_perc: got 1.5"):
        EngineStats(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=1.5, num_preemptions_total=0)
    with pytest.raises(ValueError, match=r"num_requests_waiting: got -1"):
        EngineStats(num_requests_running=0, num_requests_waiting=-1, kv_cache_usage_perc=0.0, num_preemptions_total=0)
    with pytest.raises(ValueError, match=r"max_model_len: got 0"):
        ServerMetrics(MODEL, lambda: IDLE, max_model_len=0)


def test_phases_parameters_and_parents_as_vllm_observes_them():
    """vLLM's FinishedRequestStats from the engine's timestamps: queue = scheduled - arrival, prefill =
    first token - scheduled, decode = last - first token, inference = last token - scheduled, the
    request's time per output token = decode / (tokens - 1); max_tokens per request, n and the most
    tokens of a prompt's choices once all of them finished."""
    m = ServerMetrics(MODEL, lambda: IDLE, max_model_len=1000)
    m.request_started("a", prompt_tokens=5, now=0.0)
    m.tokens_generated("a", 1, now=1.0)
    m.tokens_generated("a", 2, now=2.0)
    phases = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.25, last_token_time=13.25)
    m.request_finished("a", "stop", now=2.5, phases=phases, max_tokens=64)
    # Aborted in the queue: no phase; no max_tokens: not observed (vLLM skips a request without one).
    m.request_started("b", prompt_tokens=3, now=0.0)
    m.request_finished("b", "abort", now=1.0, phases=RequestMetrics(arrival_time=5.0), max_tokens=None)
    # Scheduled, aborted before its first token: its queue time only.
    m.request_started("c", prompt_tokens=3, now=0.0)
    m.request_finished("c", "abort", now=1.0, phases=RequestMetrics(5.0, first_scheduled_time=6.0), max_tokens=8)
    # One token: its time per output token is 0, as vLLM's.
    m.request_started("d", prompt_tokens=2, now=0.0)
    m.tokens_generated("d", 1, now=1.0)
    m.request_finished("d", "length", now=1.0, phases=RequestMetrics(0.0, 0.0, 0.5, 0.5), max_tokens=1)
    m.parent_finished(2, 3)

    s = scrape(m)
    expected = {"queue": (3, 0.5 + 1.0), "prefill": (2, 0.75 + 0.5), "decode": (2, 2.0), "inference": (2, 2.75 + 0.5)}
    for phase, (count, total) in expected.items():
        name = f"vllm:request_{phase}_time_seconds"
        assert (value(s, f"{name}_count"), value(s, f"{name}_sum")) == (count, pytest.approx(total)), phase
    assert value(s, "vllm:request_time_per_output_token_seconds_count") == 2  # a's 1.0 and d's 0
    assert value(s, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(2.0 / 2)
    # max_tokens of completed requests only (c's 8 was aborted): a's 64 and d's 1.
    assert (value(s, "vllm:request_params_max_tokens_count"), value(s, "vllm:request_params_max_tokens_sum")) == (2, 65)
    assert value(s, "vllm:request_params_max_tokens_bucket", le="50.0") == 1
    assert (value(s, "vllm:request_params_n_count"), value(s, "vllm:request_params_n_sum")) == (1, 2)
    assert value(s, "vllm:request_params_n_bucket", le="1.0") == 0 and value(s, "vllm:request_params_n_bucket", le="2.0") == 1
    assert value(s, "vllm:request_max_num_generation_tokens_sum") == 3


def speculating(drafts: int, draft_tokens: int, accepted: int, per_pos: tuple[int, ...]) -> EngineStats:
    return EngineStats(num_requests_running=1, num_requests_waiting=0, kv_cache_usage_perc=0.5,
                       num_preemptions_total=0, spec_decode_num_drafts_total=drafts,
                       spec_decode_num_draft_tokens_total=draft_tokens, spec_decode_num_accepted_tokens_total=accepted,
                       spec_decode_num_accepted_tokens_per_pos_total=per_pos)


def test_spec_decode_counters_are_exposed_only_with_speculation_on():
    """As vLLM's SpecDecodingProm: no vllm:spec_decode_* series without --speculative-config."""
    assert not [k for k in scrape(ServerMetrics(MODEL, lambda: IDLE)) if k[0].startswith("vllm:spec_decode")]
    body, _ = ServerMetrics(MODEL, lambda: IDLE).render()
    assert "spec_decode" not in body.decode()


def test_spec_decode_counters_are_the_engines_with_vllms_names_help_and_position_label():
    """k = 3: 10 verify rows with drafts, 30 drafts, 17 accepted (9 at position 0, 5 at 1, 3 at 2),
    read at each scrape; the per-position counter has one series per draft position."""
    current = [idle_engine_stats(3)]
    m = ServerMetrics(MODEL, lambda: current[0])
    s = scrape(m)
    for name in SPEC_DECODE_COUNTERS[:3]:  # from 0 before anything is drafted, as vLLM creates them
        assert value(s, name) == 0, name
    assert [value(s, SPEC_DECODE_COUNTERS[3], position=str(i)) for i in range(3)] == [0, 0, 0]
    current[0] = speculating(10, 30, 17, (9, 5, 3))
    s = scrape(m)
    assert [value(s, name) for name in SPEC_DECODE_COUNTERS[:3]] == [10, 30, 17]
    per_pos = {dict(labels)["position"]: v for (name, labels), v in s.items() if name == SPEC_DECODE_COUNTERS[3]}
    assert per_pos == {"0": 9, "1": 5, "2": 3}
    for (name, labels), _ in s.items():
        if name == SPEC_DECODE_COUNTERS[3]:
            assert set(dict(labels)) == {"model_name", "position"} and dict(labels)["model_name"] == MODEL
    body, _ = m.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    docs = {name: families[name.removesuffix("_total")].documentation for name in SPEC_DECODE_COUNTERS}
    assert docs == {  # vLLM's help texts (vllm/v1/spec_decode/metrics.py)
        "vllm:spec_decode_num_drafts_total": "Number of spec decoding drafts.",
        "vllm:spec_decode_num_draft_tokens_total": "Number of draft tokens.",
        "vllm:spec_decode_num_accepted_tokens_total": "Number of accepted tokens.",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": "Accepted tokens per draft position.",
    }
    assert all(families[n.removesuffix("_total")].type == "counter" for n in SPEC_DECODE_COUNTERS)
    lines = [line.split("{")[0] for line in body.decode().splitlines() if not line.startswith("#")]
    assert not [n for n in lines if "_total_total" in n]


def test_idle_engine_stats_carry_the_spec_decode_counters_only_when_configured():
    assert idle_engine_stats() == idle_engine_stats(0) == IDLE
    idle = idle_engine_stats(2)
    assert idle.spec_decode_enabled and not IDLE.spec_decode_enabled
    assert (idle.spec_decode_num_drafts_total, idle.spec_decode_num_accepted_tokens_per_pos_total) == (0, (0, 0))


def test_token_totals_are_the_exposed_prompt_and_generation_counters():
    m = ServerMetrics(MODEL, lambda: IDLE)
    assert m.token_totals() == (0, 0)
    m.request_started("a", prompt_tokens=7, now=0.0)
    assert m.token_totals() == (0, 0)  # the prompt counts with its first token, as in /metrics
    m.tokens_generated("a", 2, now=1.0)
    m.tokens_generated("a", 3, now=2.0)
    s = scrape(m)
    assert m.token_totals() == (value(s, "vllm:prompt_tokens_total"), value(s, "vllm:generation_tokens_total")) == (7, 5)


@pytest.mark.parametrize("fields, message", [
    (dict(spec_decode_num_drafts_total=1), r"without spec_decode_num_draft_tokens_total"),
    (dict(spec_decode_num_drafts_total=-1, spec_decode_num_draft_tokens_total=0,
          spec_decode_num_accepted_tokens_total=0, spec_decode_num_accepted_tokens_per_pos_total=(0,)),
     r"spec_decode_num_drafts_total: got -1"),
    (dict(spec_decode_num_drafts_total=0, spec_decode_num_draft_tokens_total=0,
          spec_decode_num_accepted_tokens_total=0, spec_decode_num_accepted_tokens_per_pos_total=()),
     r"per_pos_total: got \(\)"),
])
def test_spec_decode_stats_all_or_none_and_not_negative(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineStats(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=0.0, num_preemptions_total=0,
                    **fields)
