"""`python -m serve` as users run it: one real server process on a free localhost port, driven by
the official `openai` client and by raw HTTP for what the client hides (SSE framing, status codes,
metrics).

The server starts with exactly the flags of the `chat_llm` fixture (tests/conftest.py) and the same
compilation cache, which that fixture fills first, so its warm-up compiles nothing: the fixture
checks it in the server's log. Its structured outputs bind the reasoning too (`enable_in_reasoning`),
so a request can force a whole answer, reasoning and tool call included, with a one-choice
constraint: that text runs through the real engine, detokenizer, parser and usage accounting.

Comparison rule for greedy streams (tests/test_engine.py): tokens equal wherever the reference's
top-1/top-2 logprob gap exceeds 1e-3, logprobs within 1e-4.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from dsv4_jax import SamplingParams
from dsv4_jax.chat import BLOCK_SEPARATOR, INVOKE_START, THINK_END, TOOL_CALLS_START, render_tool_calls
from conftest import CHAT_SERVER_KEY, CHAT_SERVER_NAME, REPO, serving_state  # tests/ is on sys.path

KEY, NAME = CHAT_SERVER_KEY, CHAT_SERVER_NAME
MAX_MODEL_LEN = 512
GAP, LOGPROB_TOL = 1e-3, 1e-4
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key=KEY, max_retries=0, timeout=120)


def _http(server, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    return httpx.request(method, f"{server['base']}{path}", headers=headers, timeout=120, **kwargs)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server['base']}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "{" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0.0) + value if name.endswith("_total") else value
    return values


def _sse(response: httpx.Response) -> list:
    """The data payloads of a server-sent event stream; `[DONE]` must come last, exactly once."""
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    return [json.loads(e) for e in events[:-1]]


# ---- start-up, models, health, auth ------------------------------------------------------------------
def test_models_lists_the_served_name_with_its_kv_spec(server, client):
    assert server["seen_503"]  # /health answered 503 while the model loaded, then 200
    assert [m.id for m in client.models.list().data] == [NAME]
    body = _http(server, "GET", "/v1/models").json()
    (model,) = body["data"]
    assert model["max_model_len"] == MAX_MODEL_LEN
    assert model["dsv4"]["kv_cache_dtype"] == "float32" and model["dsv4"]["attention_backend"] == "xla"
    assert _http(server, "GET", "/version").json()["version"]


def test_health_says_where_the_start_up_is_until_the_model_is_ready(server):
    """While loading, /health's 503 carries the OpenAI error body and the start-up's phase, with
    the programs built so far of all while compiling."""
    body = server["first_503"]
    assert body["error"]["message"].startswith("starting: ")
    phase = body["startup"]
    assert set(phase) == {"phase", "done", "total"} and phase["done"] <= phase["total"]
    assert phase["phase"] in ("starting", "loading weights", "sizing the KV cache", "compiling steps",
                              "compiling sampler"), phase


def test_the_log_holds_what_a_user_acts_on_and_no_polling(server):
    """No other library's INFO chatter (JAX probing for TPUs, orbax's and absl's settings), no
    access-log line for /health or /metrics (a supervisor and Prometheus poll them), other requests
    logged as ever; the tokenizer file a benchmark client needs and each start-up phase's seconds."""
    for path in ("/health", "/metrics", "/v1/models"):
        assert _http(server, "GET", path).status_code == 200
    deadline = time.monotonic() + 30
    while '"GET /v1/models HTTP/1.1" 200' not in (log := server["log"].read_text()):
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.1)
    assert not re.search(r"INFO (jax|absl|orbax)[.:]", log) and "Unable to initialize backend" not in log, log[-3000:]
    assert '"GET /health ' not in log and '"GET /metrics ' not in log
    assert re.search(r"INFO dsv4_jax\.engine\.builder: tokenizer: \S+tokenizer\.json", log), log[-3000:]
    assert re.search(r"start-up: load [\d.]+s, sizing [\d.]+s, warm-up [\d.]+s", log), log[-3000:]


def test_api_key_guards_the_api_but_not_health_or_metrics(server):
    assert httpx.get(f"{server['base']}/v1/models").status_code == 401
    wrong = httpx.get(f"{server['base']}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server['base']}/health").status_code == 200
    metrics = httpx.get(f"{server['base']}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_success_total", "vllm:num_preemptions_total", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_params_n"):
        assert f'{name}{{' in metrics or f"{name}_bucket{{" in metrics, name
    assert f'model_name="{NAME}"' in metrics


# ---- chat and completions ----------------------------------------------------------------------------
def test_chat_usage_matches_tokenize_and_stream_matches_whole(server, client):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    extra = {"ignore_eos": True, "chat_template_kwargs": {"thinking": False}}
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                           extra_body=extra)
    tokenized = _http(server, "POST", "/tokenize", json={"model": NAME, "messages": messages,
                                                         "chat_template_kwargs": {"thinking": False}}).json()
    assert whole.usage.prompt_tokens == tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["tokens"].count(0) == 1 and tokenized["tokens"][0] == 0  # exactly one BOS
    assert (whole.usage.completion_tokens, whole.usage.total_tokens) == (8, tokenized["count"] + 8)
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.role == "assistant"

    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == tokenized["count"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert len({c.id for c in chunks}) == 1


def test_completions_whole_streamed_and_with_token_ids(server, client, chat_llm):
    prompt = [0, 4000, 5000, 6000, 7000]
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    (offline,) = chat_llm.generate([{"prompt_token_ids": prompt}],
                                   SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2),
                                   use_tqdm=False)
    ids = [int(t.split(":")[1]) for t in whole.choices[0].logprobs.tokens]
    _assert_gap_rule(offline.outputs[0], ids, whole.choices[0].logprobs.token_logprobs)
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 6
    streamed = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    echoed = client.completions.create(model=NAME, prompt="Hi there", max_tokens=2, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text.startswith("Hi there")
    assert echoed.usage.prompt_tokens == _http(server, "POST", "/tokenize", json={"prompt": "Hi there"}).json()["count"]
    detok = _http(server, "POST", "/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert detok == chat_llm.tokenizer.decode(prompt, skip_special_tokens=False)


def test_completions_echo_and_prompt_logprobs(server, client, chat_llm):
    """vLLM's shapes: with echo and logprobs, the prompt's tokens lead the choice's logprobs (the
    first one null: nothing predicts it), whole or streamed; `prompt_logprobs` is returned per
    choice. The values: a greedy token's logprob when it was sampled equals its logprob when it is
    fed back as the prompt's last token (the decode step's sampler against the prefill's head)."""
    first = [0, 4000, 5000, 6000]
    body = {"model": NAME, "max_tokens": 2, "temperature": 0, "logprobs": 2, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    sampled = _http(server, "POST", "/v1/completions", json={**body, "prompt": first}).json()["choices"][0]
    token = int(sampled["logprobs"]["tokens"][0].split(":")[1])
    prompt = [*first, token]
    choice = _http(server, "POST", "/v1/completions", json={**body, "prompt": prompt, "echo": True}).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert [int(t.split(":")[1]) for t in logprobs["tokens"][:5]] == prompt and len(logprobs["tokens"]) == 7
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][4] == pytest.approx(sampled["logprobs"]["token_logprobs"][0], abs=LOGPROB_TOL)
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    # top_logprobs: the token itself, then the top 2 (OpenAI's legacy completions, vLLM): 2 or 3 entries.
    for token, lp, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert len(top) in (2, 3) and top[token] == lp and list(top)[0] == token, (token, top)
    # text_offset indexes the returned text (OpenAI): from 0, never decreasing, the BOS (skipped
    # from the text) at 0 with no length, and each whole token's text at its offset.
    text, offsets, ids = choice["text"], logprobs["text_offset"], [int(t.split(":")[1]) for t in logprobs["tokens"]]
    assert offsets[:2] == [0, 0] and offsets == sorted(offsets) and offsets[-1] <= len(text), (offsets, text)
    for token_id, offset in zip(ids[1:], offsets[1:]):
        piece = chat_llm.tokenizer.decode([token_id])
        assert "\ufffd" in piece or text[offset:offset + len(piece)] == piece, (token_id, piece, offset, text)
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt)
    for position, entry in enumerate(choice["prompt_logprobs"][1:], start=1):
        own = entry[str(prompt[position])]
        assert own["logprob"] == logprobs["token_logprobs"][position] and own["rank"] >= 1
        assert len(entry) in (2, 3) and sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    assert _http(server, "POST", "/v1/completions", json={**body, "prompt": prompt}).json()["choices"][0][
        "prompt_logprobs"] is None
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                         logprobs=2, stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0] for c in streamed if c.choices]
    assert pieces[0].logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(pieces[0].logprobs.token_logprobs[1:5], logprobs["token_logprobs"][1:5], atol=LOGPROB_TOL)
    assert sum(len(p.logprobs.tokens) for p in pieces if p.logprobs) == len(prompt) + 2


def test_n_choices_and_logprobs(server, client):
    out = client.chat.completions.create(model=NAME, messages=HELLO, max_tokens=4, n=2, temperature=1.0, seed=5,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 8
    for choice in out.choices:
        items = choice.logprobs.content
        assert len(items) == 4
        for item in items:
            assert len(item.top_logprobs) == 3 and item.logprob <= 0
            ranked = [t.logprob for t in item.top_logprobs]
            assert ranked == sorted(ranked, reverse=True) and item.logprob <= ranked[0] + 1e-6


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(server):
    """stream_options.continuous_usage_stats (vLLM): every chunk carries usage with the prompt and
    its choice's completion tokens so far (the chat role chunks 0); the last chunk sums the choices."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = _sse(_http(server, "POST", "/v1/chat/completions", json={
        "model": NAME, "messages": HELLO, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": True,
        "ignore_eos": True, "stream": True, "stream_options": options}))
    # Two prompts x n = 2: choices 0, 1 are the first prompt's (4 tokens), 2, 3 the second's (2).
    text = _sse(_http(server, "POST", "/v1/completions", json={
        "model": NAME, "prompt": [[0, 7, 8, 9], [0, 5]], "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3,
        "logprobs": 0, "ignore_eos": True, "stream": True, "stream_options": options}))
    chat_prompt = chat[-1]["usage"]["prompt_tokens"]
    for events, prompts in ((chat, [chat_prompt] * 2), (text, [4, 4, 2, 2])):
        *chunks, last = events
        completion = 5 * len(prompts)
        prompt = chat_prompt if events is chat else 6  # each prompt once in the last chunk
        assert last["choices"] == [] and last["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                                                             "total_tokens": prompt + completion}
        so_far = [0] * len(prompts)
        for chunk in chunks:
            (choice,) = chunk["choices"]
            i, logprobs = choice["index"], choice["logprobs"]
            # one logprobs entry per token: the tokens this chunk adds to its choice
            so_far[i] += len(logprobs["content"] if "content" in (logprobs or {}) else
                             (logprobs or {}).get("tokens", []))
            assert chunk["usage"] == {"prompt_tokens": prompts[i], "completion_tokens": so_far[i],
                                      "total_tokens": prompts[i] + so_far[i]}
        assert so_far == [5] * len(prompts)
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant" and chat[0]["usage"]["completion_tokens"] == 0


# ---- reasoning and tool calls, forced through the real engine --------------------------------------------
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
ANSWER = "Let me look." + BLOCK_SEPARATOR + render_tool_calls([CALL])
FORCED = "Check the weather." + THINK_END + ANSWER  # the grammar's end finishes it ("stop"): no EOS


def test_reasoning_and_tool_calls_whole_and_streamed(server, client, chat_llm):
    extra = {"structured_outputs": {"choice": [FORCED]}}
    forced_tokens = len(chat_llm.tokenizer.encode(FORCED, add_special_tokens=False).ids)
    whole = client.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, max_tokens=100, extra_body=extra)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == "Check the weather."
    assert message.content == "Let me look."
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert whole.usage.completion_tokens == forced_tokens

    chunks = list(client.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, max_tokens=100,
                                                 stream=True, extra_body=extra))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert (reasoning, content) == ("Check the weather.", "Let me look.")
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert all(tc.id is None and tc.type is None and tc.function.name is None for tc in calls[1:])
    assert {tc.index for tc in calls} == {0}
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_constrains_the_answer_to_a_dsml_tool_call(server, client, chat_llm, choice):
    """The grammar of a tool call (chat mode: from the first token) forces the DSML that opens it,
    the function's name too when there is one to choose from; its tokens are completion tokens."""
    prefix = BLOCK_SEPARATOR + TOOL_CALLS_START + "\n" + INVOKE_START + 'get_weather">\n'
    max_tokens = len(chat_llm.tokenizer.encode(prefix, add_special_tokens=False).ids) + 4
    out = client.chat.completions.create(
        model=NAME, messages=HELLO, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, temperature=0,
        logprobs=True, extra_body={"chat_template_kwargs": {"thinking": False}, "return_tokens_as_token_ids": True})
    ids = [int(item.token.split(":")[1]) for item in out.choices[0].logprobs.content]
    assert chat_llm.tokenizer.decode(ids, skip_special_tokens=False).startswith(prefix)
    assert out.usage.completion_tokens == len(ids)


# ---- many clients --------------------------------------------------------------------------------------------
def _assert_gap_rule(reference, tokens: list[int], logprobs: list[float]) -> None:
    for i, (want, got) in enumerate(zip(reference.token_ids, tokens)):
        entry = reference.logprobs[i]
        if want != got:
            ranked = sorted((lp.logprob for lp in entry.values()), reverse=True)
            assert ranked[0] - ranked[1] <= GAP, (i, reference.token_ids, tokens)
            return
        assert abs(entry[want].logprob - logprobs[i]) <= LOGPROB_TOL, i
    assert len(tokens) == len(reference.token_ids)


def test_sixteen_concurrent_streams_each_match_the_request_alone(server, chat_llm):
    rng = np.random.default_rng(7)
    prompts = [[0, *rng.integers(1000, 100000, size=int(rng.integers(4, 40))).tolist()] for _ in range(16)]
    tokens = 64
    results: dict[int, tuple[list[int], list[float]]] = {}
    running_seen: list[float] = []

    def stream(i: int) -> None:
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "logprobs": 2, "stream": True, "return_tokens_as_token_ids": True}
        with httpx.stream("POST", f"{server['base']}/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            ids, lps = [], []
            for event in _sse(response):
                for choice in event["choices"]:
                    if choice["logprobs"]:
                        ids += [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
                        lps += choice["logprobs"]["token_logprobs"]
            results[i] = (ids, lps)

    def watch_metrics() -> None:
        while any(t.is_alive() for t in streams):
            running_seen.append(_metrics(server).get("vllm:num_requests_running", 0))
            time.sleep(0.05)

    streams = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in streams:
        t.start()
    watcher = threading.Thread(target=watch_metrics)
    watcher.start()
    # Meanwhile, in this process, each request served alone by the same engine configuration.
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=2)
    alone = [chat_llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    for t in [*streams, watcher]:
        t.join()
    assert sum(len(set(a.token_ids)) >= 4 for a in alone) >= 12  # not a model that repeats one token
    assert len(results) == 16
    assert max(running_seen) >= 8, running_seen
    for i, reference in enumerate(alone):
        _assert_gap_rule(reference, *results[i])
    after = _metrics(server)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_a_disconnect_aborts_the_request_and_frees_its_blocks(server):
    prompt = [0, 11, 12, 13]
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - len(prompt), "ignore_eos": True,
            "stream": True}
    finished_before = _metrics(server).get("vllm:request_success_total", 0.0)
    with httpx.stream("POST", f"{server['base']}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert _metrics(server)["vllm:num_requests_running"] == 1
    closed = time.monotonic()
    while True:  # milliseconds when it works; the bound only has to outlast a stalled machine
        m = _metrics(server)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() - closed < 30, m
        time.sleep(0.05)
    # The server noticed the disconnect: a request it kept streaming would be counted as finished
    # once its end reached the consumer, a moment after the gauges drop (the engine's abort itself
    # is tests/test_async_engine.py's).
    time.sleep(0.5)
    assert _metrics(server).get("vllm:request_success_total", 0.0) == finished_before


# ---- errors -------------------------------------------------------------------------------------------------
def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_bad_requests_get_openai_errors_and_harm_no_one(server):
    chat = "/v1/chat/completions"
    assert "JSON" in _error(_http(server, "POST", chat, content=b"{not json",
                                  headers={"content-type": "application/json"}), 400)["message"]
    assert _error(_http(server, "POST", chat, json={"model": NAME, "messages": []}), 400)["param"] == "messages"
    assert _error(_http(server, "POST", chat, json={"model": "gpt-4", "messages": HELLO}), 404)["code"] == \
        "model_not_found"
    too_long = _error(_http(server, "POST", chat, json={"model": NAME, "messages": HELLO, "max_tokens": 600}), 400)
    assert "512" in too_long["message"] and "600" in too_long["message"]
    outside = _error(_http(server, "POST", "/v1/completions", json={"model": NAME, "prompt": [0, 129280]}), 400)
    assert "129280" in outside["message"]
    assert _error(_http(server, "POST", chat, json={"model": NAME, "messages": HELLO, "temperature": -1}), 400)[
        "param"] == "temperature"
    _error(_http(server, "POST", chat, content=b"x" * (17 * 2**20), headers={"content-type": "application/json"}), 413)
    ok = _http(server, "POST", "/v1/completions", json={"model": NAME, "prompt": [0, 5], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server['base']}/health").status_code == 200


# ---- without the parsers, and bad command lines ---------------------------------------------------------
@contextlib.asynccontextmanager
async def _in_process_app(chat_llm):
    """The server's app in this process over the chat_llm engine (the same routes as the server
    process, without its flags), as an httpx client."""
    from serve.app import build_app

    state = serving_state(chat_llm, "--reasoning-parser", "", "--no-enable-auto-tool-choice", name=NAME)
    await state.engine.start()
    transport = httpx.ASGITransport(app=build_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            yield http
    finally:
        await state.engine.shutdown()


def test_without_parser_flags_there_is_no_reasoning_split_and_auto_tool_choice_is_refused(chat_llm):
    """As vLLM: --reasoning-parser '' means the whole text is content; tool_choice "auto" with
    --no-enable-auto-tool-choice is a 400 naming the flag.

    The engine here is chat_llm's, whose constraints start after the model's own `</think>` in
    thinking mode: a logit bias makes that the first token (greedy), the constraint the rest."""
    import asyncio

    think_end = chat_llm.tokenizer.token_to_id(THINK_END)

    async def main():
        async with _in_process_app(chat_llm) as http:
            plain = await http.post("/v1/chat/completions", json={
                "model": NAME, "messages": HELLO, "max_tokens": 100, "temperature": 0,
                "logit_bias": {str(think_end): 100}, "structured_outputs": {"choice": [ANSWER]}})
            auto = await http.post("/v1/chat/completions", json={
                "model": NAME, "messages": HELLO, "tools": TOOLS, "tool_choice": "auto"})
        return plain, auto

    plain, auto = asyncio.run(main())
    message = plain.json()["choices"][0]["message"]
    assert message["content"] == THINK_END + ANSWER  # everything, </think> and DSML included
    assert message["reasoning_content"] is None and message["tool_calls"] == []
    assert plain.json()["choices"][0]["finish_reason"] == "stop"  # the constraint's end
    assert auto.status_code == 400 and "--enable-auto-tool-choice" in auto.json()["error"]["message"]


def test_a_failed_engine_step_is_a_500_for_its_requests_and_the_server_serves_on(chat_llm):
    """A step that raises fails the requests it held (a 500 with OpenAI's error body; a stream
    already started ends with an error event and [DONE]) and nothing else: /health stays 200 and
    the next request is served."""
    import asyncio

    engine, real = chat_llm.engine, type(chat_llm.engine).finish_step

    def fail_next_step():
        def finish_step(launched):
            del engine.finish_step  # once
            raise RuntimeError("injected step failure")
        engine.finish_step = finish_step

    body = {"model": NAME, "prompt": [0, 5, 6], "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def main():
        async with _in_process_app(chat_llm) as http:
            fail_next_step()
            plain = await http.post("/v1/completions", json=body)
            fail_next_step()
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
            health = await http.get("/health")
            after = await http.post("/v1/completions", json=body)
        return plain, streamed, health, after

    try:
        plain, streamed, health, after = asyncio.run(main())
    finally:
        if "finish_step" in vars(engine):
            del engine.finish_step
    error = plain.json()["error"]
    assert plain.status_code == 500 and error["type"] == "internal_server_error"
    assert "injected step failure" in error["message"] and "dropped" in error["message"]
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert "injected step failure" in json.loads(events[-2])["error"]["message"]
    assert health.status_code == 200
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    assert real is type(engine).finish_step and not engine.has_unfinished()


def _app_over(engine):
    """The server's app in this process over a stand-in engine client (no model: the routes,
    request parsing, Generation and the error mapping are the server's own)."""
    import types

    from dsv4_jax.engine.outputs import EngineStats
    from serve.app import build_app
    from serve.args import parse_args
    from serve.metrics import ServerMetrics
    from serve.protocol import ServerLimits
    from serve.state import ServingState

    state = ServingState(parse_args([]), served_model_names=(NAME,),
                         config=types.SimpleNamespace(max_model_len=MAX_MODEL_LEN))
    state.engine, state.ready = engine, True
    state.limits = ServerLimits(served_model_names=(NAME,), vocab_size=engine.tokenizer.get_vocab_size())
    state.metrics = ServerMetrics(NAME, lambda: EngineStats(0, 0, 0.0, 0), max_model_len=MAX_MODEL_LEN)
    return build_app(state)


GRAMMAR_ERROR = "structured outputs: the grammar did not compile within 60 s"


class _GrammarFailingEngine:
    """An engine client whose requests each write one token, then end alone as the engine ends a
    request whose grammar failed (finish_reason "error", the reason in `RequestOutput.error`)."""

    max_model_len, num_waiting, accepting = MAX_MODEL_LEN, 0, True

    def __init__(self, tokenizer):
        self.tokenizer, self.aborted, self.params = tokenizer, [], []

    def add_request(self, rid, prompt_ids, params):
        from dsv4_jax.engine.outputs import CompletionOutput, RequestOutput

        self.params.append(params)

        async def outputs():
            yield RequestOutput(rid, None, prompt_ids, None, [CompletionOutput(0, "y", [88], None, None)], False)
            yield RequestOutput(rid, None, prompt_ids, None, [CompletionOutput(0, "y", [88], None, None, "error")],
                                True, error=GRAMMAR_ERROR)
        return outputs()

    def abort_now(self, rid):
        self.aborted.append(rid)


def test_a_request_the_engine_ends_with_an_error_is_a_500_or_an_error_event():
    """A request whose grammar fails after it was accepted ends alone with finish_reason "error":
    whole, the answer is a 500 with OpenAI's error body and the engine's reason; streamed, an
    error event then [DONE]. The engine ended it: nothing is aborted."""
    import asyncio

    from dsv4_jax.chat.tokenizer import load_tokenizer
    from dsv4_jax.engine.structured_outputs import StructuredOutputsParams

    engine = _GrammarFailingEngine(load_tokenizer())
    constraint = {"structured_outputs": {"choice": ["yes"]}}
    bodies = [("/v1/chat/completions", {"model": NAME, "messages": HELLO, **constraint}),
              ("/v1/completions", {"model": NAME, "prompt": "Hi", **constraint})]

    async def main():
        transport = httpx.ASGITransport(app=_app_over(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return [(await http.post(path, json=body), await http.post(path, json={**body, "stream": True}))
                    for path, body in bodies]

    for whole, streamed in asyncio.run(main()):
        error = whole.json()["error"]
        assert whole.status_code == 500 and error["type"] == "internal_server_error"
        assert error["message"] == GRAMMAR_ERROR
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["message"] == GRAMMAR_ERROR
        chunks = [json.loads(event) for event in events[:-2]]  # the first token's, unless the error overtook it
        assert all(c["finish_reason"] is None for chunk in chunks for c in chunk["choices"])
    assert [p.structured_outputs for p in engine.params] == [StructuredOutputsParams(choice=["yes"])] * 4
    assert engine.aborted == []


def test_the_engines_refusal_of_a_constraint_names_the_field_the_request_wrote():
    """The engine names a constraint `structured_outputs[.<kind>]` in its refusals; the 400 names
    where the request wrote it (a response_format, a tool_choice, or structured_outputs itself)."""
    import asyncio

    from dsv4_jax.chat.tokenizer import load_tokenizer
    from dsv4_jax.engine.request import RequestRejected

    class Refusing(_GrammarFailingEngine):
        def add_request(self, rid, prompt_ids, params):
            kind = params.structured_outputs.kind
            if kind == "json":
                raise RequestRejected("structured_outputs.json: the schema is too large", "structured_outputs.json")
            raise RequestRejected("structured outputs need the model's tokenizer.json; this engine has none",
                                  "structured_outputs")

    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    cases = [
        ({"response_format": json_schema}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ]

    async def main():
        transport = httpx.ASGITransport(app=_app_over(Refusing(load_tokenizer())))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return [await http.post("/v1/chat/completions", json={"model": NAME, "messages": HELLO, **fields})
                    for fields, _ in cases]

    for response, (fields, param) in zip(asyncio.run(main()), cases):
        error = _error(response, 400)
        assert error["param"] == param, (fields, error)
        if param == "response_format.json_schema.schema":
            assert error["message"].startswith(param) and "structured_outputs" not in error["message"], error


class _RecordingEngine(_GrammarFailingEngine):
    """An engine client that records each request's prompt and answers it with one token, "stop"."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.prompts: list[list[int]] = []

    def add_request(self, rid, prompt_ids, params):
        from dsv4_jax.engine.outputs import CompletionOutput, RequestOutput

        self.prompts.append(list(prompt_ids))

        async def outputs():
            yield RequestOutput(rid, None, list(prompt_ids), None, [CompletionOutput(0, "y", [88], None, None, "stop")],
                                True)
        return outputs()


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_counts_those():
    """vLLM's truncate_prompt_tokens: the engine gets the prompt's last k tokens (-1: the last
    max_model_len), the usage counts those, an echo shows them; a text prompt too long for
    max_model_len is no error when it is to be truncated."""
    import asyncio

    from dsv4_jax.chat.tokenizer import load_tokenizer

    engine = _RecordingEngine(load_tokenizer())
    tokens = list(range(1000, 1600))  # longer than max_model_len (512)
    long_text = "word " * 100_000

    async def main():
        transport = httpx.ASGITransport(app=_app_over(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            def post(path, **fields):
                return http.post(path, json={"model": NAME, "max_tokens": 1, **fields})
            return [await post("/v1/completions", prompt=tokens, truncate_prompt_tokens=8, echo=True),
                    await post("/v1/completions", prompt=tokens, truncate_prompt_tokens=-1),
                    await post("/v1/chat/completions", messages=HELLO),
                    await post("/v1/chat/completions", messages=HELLO, truncate_prompt_tokens=3),
                    await post("/v1/completions", prompt=long_text, truncate_prompt_tokens=16),
                    await post("/v1/completions", prompt=long_text)]

    eight, whole_len, chat, chat_three, long_cut, long_refused = asyncio.run(main())
    assert engine.prompts[0] == tokens[-8:] and eight.json()["usage"]["prompt_tokens"] == 8
    assert eight.json()["choices"][0]["text"] == engine.tokenizer.decode(tokens[-8:], skip_special_tokens=True) + "y"
    assert engine.prompts[1] == tokens[-MAX_MODEL_LEN:] and whole_len.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN
    assert engine.prompts[3] == engine.prompts[2][-3:] and chat_three.json()["usage"]["prompt_tokens"] == 3
    assert long_cut.status_code == 200 and len(engine.prompts[4]) == 16
    assert engine.prompts[4] == engine.tokenizer.encode(long_text, add_special_tokens=False).ids[-16:]
    assert _error(long_refused, 400)["param"] == "prompt" and len(engine.prompts) == 5


@pytest.mark.parametrize("flags, names", [(["--port", "70000"], "--port"),
                                          (["--tensor-parallel-size", "2", "--max-model-len", "512"],
                                           "--tensor-parallel-size")])
def test_bad_flags_fail_fast_with_one_line_and_status_2(chat_checkpoint, flags, names):
    result = subprocess.run([sys.executable, "-m", "serve", str(chat_checkpoint), *flags], capture_output=True,
                            text=True, timeout=120, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    errors = [line for line in result.stderr.splitlines() if line.startswith("serve: error:")]
    assert result.returncode == 2 and len(errors) == 1 and names in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_taken_port_fails_before_the_model_loads_naming_the_flag(chat_checkpoint):
    """uvicorn binds after starting the lifespan (which loads the model): the server binds first."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "serve", str(chat_checkpoint), "--port", str(port)],
                                capture_output=True, text=True, timeout=120, cwd=REPO,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    errors = [line for line in result.stderr.splitlines() if line.startswith("serve: error:")]
    assert result.returncode == 2 and errors == [f"serve: error: --host 127.0.0.1 --port {port}: cannot listen there: "
                                                 f"Address already in use; pass a free --port"], result.stderr
    assert "weights: read" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_tokenize_options_as_vllm(server, chat_llm):
    plain = _http(server, "POST", "/tokenize", json={"prompt": "Hi there", "add_special_tokens": False,
                                                     "return_token_strs": True}).json()
    tok = chat_llm.tokenizer
    assert plain["tokens"] == tok.encode("Hi there", add_special_tokens=False).ids  # no BOS
    assert "".join(plain["token_strs"]) == "Hi there" and plain["count"] == len(plain["tokens"])
    with_bos = _http(server, "POST", "/tokenize", json={"prompt": "Hi there"}).json()["tokens"]
    assert with_bos == [0, *plain["tokens"]]
