"""The server's side of prefix caching: `usage.prompt_tokens_details` with
--enable-prompt-tokens-details, `POST /reset_prefix_cache` with VLLM_SERVER_DEV_MODE=1, and the
engine wrappers that feed them (`AsyncLLMEngine.stats` / `reset_prefix_cache`, `LLM`).

The app is the server's own (routes, parsing, Generation, usage, errors) in this process over a
stand-in engine client whose requests report chosen `num_cached_tokens`: no model, no compiles.
"""

from __future__ import annotations

import asyncio
import json
import threading
import types

import httpx
import pytest

from dsv4_jax.chat.tokenizer import load_tokenizer
from dsv4_jax.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from dsv4_jax.engine.sampling_params import SamplingParams
from dsv4_jax.engine.structured_outputs import StructuredOutputsConfig
from serve.args import API_KEY_ENV, DEV_MODE_ENV, parse_args

NAME, MAX_MODEL_LEN = "dsv4-test", 512
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


class _CachingEngine:
    """An engine client whose request `<id>-<prompt>-<choice>` writes two tokens and reports
    `cached[(prompt, choice)]` prompt tokens served from the prefix cache (0 when not listed;
    None: the engine never said). `busy`: a request runs, so the cache cannot be reset."""

    max_model_len, num_waiting, accepting = MAX_MODEL_LEN, 0, True

    def __init__(self, tokenizer, cached: dict[tuple[int, int], int | None] | None = None):
        self.tokenizer, self.cached = tokenizer, cached or {}
        self.aborted: list[str] = []
        self.busy, self.resets = False, 0

    def add_request(self, rid, prompt_ids, params):
        prompt, choice = map(int, rid.rsplit("-", 2)[1:])
        cached = self.cached.get((prompt, choice), 0)

        async def outputs():
            for tokens, reason in (([88], None), ([88, 89], "length")):
                completion = CompletionOutput(0, "y" * len(tokens), tokens, None, None, reason)
                yield RequestOutput(rid, None, prompt_ids, None, [completion], reason is not None,
                                    num_cached_tokens=cached)
                await asyncio.sleep(0)
        return outputs()

    def abort_now(self, rid):
        self.aborted.append(rid)

    async def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return not self.busy


def _app(engine, *flags: str):
    """The server's app over `engine`, with the limits `python -m serve` would derive from `flags`."""
    from serve.app import build_app
    from serve.metrics import ServerMetrics
    from serve.server import server_limits
    from serve.state import ServingState

    args = parse_args(list(flags))
    config = types.SimpleNamespace(
        max_model_len=MAX_MODEL_LEN, sampling_defaults={}, structured_outputs_config=StructuredOutputsConfig(),
        model_config=types.SimpleNamespace(vocab_size=engine.tokenizer.get_vocab_size()))
    state = ServingState(args, served_model_names=(NAME,), config=config)
    state.engine, state.ready = engine, True
    state.limits = server_limits(args, config, state.served_model_names)
    state.metrics = ServerMetrics(NAME, lambda: EngineStats(0, 0, 0.0, 0), max_model_len=MAX_MODEL_LEN)
    return build_app(state)


def _post_all(app, requests: list[tuple[str, dict]], headers: dict | None = None) -> list[httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", headers=headers) as http:
            return [await http.post(path, json=body) for path, body in requests]
    return asyncio.run(main())


def _events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


STREAM = {"stream": True, "stream_options": {"include_usage": True}}
# Chat: one prompt, n = 2. Completions: two prompts, n = 2 (choice index = prompt x n + i).
CHAT = ("/v1/chat/completions", {"model": NAME, "messages": HELLO, "n": 2, "max_tokens": 2})
COMPLETIONS = ("/v1/completions", {"model": NAME, "prompt": ["Hello there", "Hi"], "n": 2, "max_tokens": 2})


def _whole_and_streamed(engine, *flags: str) -> dict[str, tuple[dict, list[dict]]]:
    """{path: (the whole response's usage, the streamed chunks)} for CHAT and COMPLETIONS."""
    requests = [(path, body) for path, body in (CHAT, COMPLETIONS)]
    requests += [(path, {**body, **STREAM}) for path, body in (CHAT, COMPLETIONS)]
    whole_chat, whole_completions, streamed_chat, streamed_completions = _post_all(_app(engine, *flags), requests)
    for response in (whole_chat, whole_completions):
        assert response.status_code == 200, response.text
    return {CHAT[0]: (whole_chat.json()["usage"], _events(streamed_chat)),
            COMPLETIONS[0]: (whole_completions.json()["usage"], _events(streamed_completions))}


def test_without_the_flag_usage_has_no_prompt_tokens_details(tokenizer):
    """vLLM's default: the usage object is OpenAI's three counts only, whatever the engine cached."""
    engine = _CachingEngine(tokenizer, {(0, 0): 256, (0, 1): 256, (1, 0): 128})
    for path, (whole, chunks) in _whole_and_streamed(engine).items():
        final = chunks[-1]["usage"]
        assert set(whole) == set(final) == {"prompt_tokens", "completion_tokens", "total_tokens"}, path
        assert final == whole


def test_with_the_flag_usage_says_how_many_prompt_tokens_were_cached(tokenizer):
    """--enable-prompt-tokens-details: `prompt_tokens_details.cached_tokens`, whole and in the
    streamed usage chunk, counted as prompt_tokens are: each prompt once whatever n is (its first
    choice's count), summed over a completion's prompts."""
    engine = _CachingEngine(tokenizer, {(0, 0): 256, (0, 1): 512, (1, 0): 128, (1, 1): 0})
    expected = {CHAT[0]: 256, COMPLETIONS[0]: 256 + 128}
    for path, (whole, chunks) in _whole_and_streamed(engine, "--enable-prompt-tokens-details").items():
        assert whole["prompt_tokens_details"] == {"cached_tokens": expected[path]}, path
        assert whole["completion_tokens"] == 2 * (2 if path == CHAT[0] else 4)  # 2 tokens a choice
        # Streamed: only the last chunk (choices: []) carries the usage, the same as the whole one's.
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole, path
        assert all(c["usage"] is None for c in chunks[:-1]), path


def test_a_miss_or_an_unreported_count_is_zero_cached_tokens(tokenizer):
    """With the flag the object is always there (OpenAI's shape): 0 when nothing was cached, and
    when the engine gave no count (None: never scheduled, e.g. aborted while waiting)."""
    engine = _CachingEngine(tokenizer, {(0, 0): None, (1, 0): None})
    for path, (whole, chunks) in _whole_and_streamed(engine, "--enable-prompt-tokens-details").items():
        assert whole["prompt_tokens_details"] == chunks[-1]["usage"]["prompt_tokens_details"] == \
            {"cached_tokens": 0}, path


def test_continuous_usage_chunks_carry_no_details(tokenizer):
    """As vLLM: the per-chunk usage of continuous_usage_stats has the three counts only; the
    details are in the final usage chunk."""
    engine = _CachingEngine(tokenizer, {(0, 0): 256})
    body = {**CHAT[1], "n": 1, "stream": True, "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True}}
    (response,) = _post_all(_app(engine, "--enable-prompt-tokens-details"), [(CHAT[0], body)])
    chunks = _events(response)
    assert all("prompt_tokens_details" not in c["usage"] for c in chunks[:-1])
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}


# ---- POST /reset_prefix_cache ----------------------------------------------------------------------
def test_reset_prefix_cache_is_absent_without_dev_mode(tokenizer, monkeypatch):
    """As vLLM: without VLLM_SERVER_DEV_MODE=1 the path is unknown (404, OpenAI's error body), and
    the engine's cache is untouched."""
    engine = _CachingEngine(tokenizer)
    for value in (None, "0"):
        if value is not None:
            monkeypatch.setenv(DEV_MODE_ENV, value)
        (response,) = _post_all(_app(engine), [("/reset_prefix_cache", {})])
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "no route /reset_prefix_cache"
    assert engine.resets == 0


def test_reset_prefix_cache_answers_200_when_idle_and_409_while_requests_run(tokenizer, monkeypatch):
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    engine = _CachingEngine(tokenizer)
    app = _app(engine)
    (idle,) = _post_all(app, [("/reset_prefix_cache", {})])
    assert (idle.status_code, idle.content) == (200, b"")
    engine.busy = True
    (busy,) = _post_all(app, [("/reset_prefix_cache", {})])
    assert busy.status_code == 409
    error = busy.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "no request is running" in error["message"]
    assert engine.resets == 2

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            return await http.get("/reset_prefix_cache")
    assert asyncio.run(get()).status_code == 405  # POST only, as vLLM's


def test_reset_prefix_cache_wants_the_api_key_as_the_api_does(tokenizer, monkeypatch):
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    engine = _CachingEngine(tokenizer)
    app = _app(engine, "--api-key", "k")
    (refused,) = _post_all(app, [("/reset_prefix_cache", {})])
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert engine.resets == 0
    (done,) = _post_all(app, [("/reset_prefix_cache", {})], headers={"Authorization": "Bearer k"})
    assert done.status_code == 200 and engine.resets == 1


# ---- the engine wrappers ---------------------------------------------------------------------------
def test_async_engine_stats_read_the_schedulers_prefix_cache_counts():
    from dsv4_jax.engine.async_engine import AsyncLLMEngine

    scheduler = types.SimpleNamespace(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_preemptions=3,
                                      prefix_cache_queries=4096, prefix_cache_hits=1024)
    engine = types.SimpleNamespace(scheduler=scheduler, num_compiling=1, spec_decode_stats=None)
    stats = AsyncLLMEngine(engine).stats()
    assert stats == EngineStats(2, 2, 0.25, 3, prefix_cache_queries_total=4096, prefix_cache_hits_total=1024)
    assert not stats.spec_decode_enabled  # speculation off: no spec_decode_* counters


def test_async_engine_stats_carry_the_engines_spec_decode_counters():
    """With speculation on, the engine's `SpecDecodeStats` as they are at the read (a copy: the
    engine's list of per-position counts goes on growing)."""
    from dsv4_jax.engine.async_engine import AsyncLLMEngine
    from dsv4_jax.engine.speculative import SpecDecodeStats

    scheduler = types.SimpleNamespace(num_running=1, num_waiting=0, kv_cache_usage=0.5, num_preemptions=0,
                                      prefix_cache_queries=0, prefix_cache_hits=0)
    spec = SpecDecodeStats(num_speculative_tokens=2)
    for drafted, accepted in ((2, 2), (2, 0), (2, 1), (0, 0)):  # the last row carried no draft: not counted
        spec.record(drafted, accepted)
    engine = AsyncLLMEngine(types.SimpleNamespace(scheduler=scheduler, num_compiling=0, spec_decode_stats=spec))
    stats = engine.stats()
    assert (stats.spec_decode_num_drafts_total, stats.spec_decode_num_draft_tokens_total,
            stats.spec_decode_num_accepted_tokens_total, stats.spec_decode_num_accepted_tokens_per_pos_total) == (
        3, 6, 3, (2, 1))
    spec.record(2, 2)
    assert stats.spec_decode_num_accepted_tokens_per_pos_total == (2, 1)
    assert engine.stats().spec_decode_num_accepted_tokens_per_pos_total == (3, 2)


def test_async_engine_resets_the_prefix_cache_under_its_lock():
    """The engine's answer is passed on, and the step thread cannot hold the lock meanwhile."""
    from dsv4_jax.engine.async_engine import AsyncLLMEngine

    seen = []

    class Engine:
        answer = True

        def reset_prefix_cache(self) -> bool:
            other = threading.Thread(target=lambda: seen.append(async_engine._lock.acquire(blocking=False)))
            other.start()
            other.join()
            return self.answer

    async_engine = AsyncLLMEngine(Engine())
    assert asyncio.run(async_engine.reset_prefix_cache()) is True
    Engine.answer = False
    assert asyncio.run(async_engine.reset_prefix_cache()) is False
    assert seen == [False, False]  # another thread could not take the lock during either call


def test_llm_passes_the_first_choices_cached_tokens_and_resets_the_engines_cache():
    """`LLM.generate`'s RequestOutput holds the first choice's num_cached_tokens (its prompt is
    counted once, as its phases are); `reset_prefix_cache` is the engine's."""
    from dsv4_jax.engine.llm import LLM

    class Engine:
        def __init__(self):
            self.pending, self.resets = [], 0

        def add_request(self, rid, ids, params, prompt=None):
            self.pending.append((rid, ids))

        def has_unfinished(self):
            return bool(self.pending)

        def step(self):
            done, self.pending = self.pending, []
            return [RequestOutput(rid, None, ids, None, [CompletionOutput(0, "y", [88], None, None, "length")], True,
                                  num_cached_tokens={"0-0": 256, "0-1": 0}[rid]) for rid, ids in done]

        def reset_prefix_cache(self):
            self.resets += 1
            return True

    llm = LLM.__new__(LLM)
    llm.engine, llm._built, llm._ids = Engine(), types.SimpleNamespace(channel=None), 0
    (out,) = llm.generate({"prompt_token_ids": [0, 5, 6]}, SamplingParams(n=2, max_tokens=1), use_tqdm=False)
    assert out.num_cached_tokens == 256 and len(out.outputs) == 2
    assert llm.reset_prefix_cache() is True and llm.engine.resets == 1
