"""The server under faults and bad input: clients that vanish mid-stream or right after they start,
malformed bodies, every invalid parameter of every endpoint, prompts over max_model_len, and
SIGTERM / SIGINT with requests in flight.

Throughout each test a bystander (`harmless`) streams the same greedy request again and again and
polls /health: every one of its streams must be well formed and equal to the request served alone
(the offline engine, `chat_llm`, under the engine's gap rule), /health must stay 200, and when the
test is done the metrics must show nothing running or waiting and no KV block in use.

The stream checks and the comparison rule are benchmarks/load.py's, loaded from its file.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import CHAT_SERVER_FLAGS, REPO, chat_server_env, quiet_port  # tests/ is on sys.path

from dsv4_jax import SamplingParams

MAX_MODEL_LEN = 512
HELLO = [{"role": "user", "content": "Hello"}]
BYSTANDER_PROMPT = [0, 901, 902, 903, 904]


@pytest.fixture(scope="module")
def load():
    """benchmarks/load.py: the CI copy of the load run shares its functions."""
    return importlib.import_module("benchmarks.load")


@pytest.fixture(scope="module")
def bystander_reference(chat_llm):
    """The bystander's request served alone by the offline engine with the server's configuration."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    (out,) = chat_llm.generate([{"prompt_token_ids": BYSTANDER_PROMPT}], params, use_tqdm=False)
    return out.outputs[0]


def _headers(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server['key']}"}


@contextlib.contextmanager
def harmless(server, load, reference):
    """Run the body while a bystander streams and /health is polled; then check that nothing was
    harmed and that the server's metrics are back to 0."""
    stop, problems, streams, health = threading.Event(), [], [0], []
    req = load.LoadRequest("completions", "", len(reference.token_ids))
    body = {"model": server["name"], "prompt": BYSTANDER_PROMPT, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, "return_tokens_as_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}

    def stream_again_and_again() -> None:
        with httpx.Client(base_url=server["base"], headers=_headers(server), timeout=120) as client:
            while not stop.is_set() or not streams[0]:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
                ids, logprobs, _, found = load.check_stream(req, len(BYSTANDER_PROMPT), payloads)
                mismatch = load.gap_rule_mismatch(reference, ids, logprobs)
                problems.extend(found + ([mismatch] if mismatch else []))
                streams[0] += 1

    def poll_health() -> None:
        while not stop.is_set():
            health.append(httpx.get(f"{server['base']}/health", timeout=30).status_code)
            time.sleep(0.05)

    threads = [threading.Thread(target=stream_again_and_again), threading.Thread(target=poll_health)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not problems, problems[:5]
    assert streams[0] >= 1 and health and set(health) == {200}, (streams, sorted(set(health)))
    _assert_metrics_back_to_zero(server, load)


def _assert_metrics_back_to_zero(server, load, within: float = 30.0) -> None:
    # Milliseconds when it works; a leaked request never frees its blocks, so a bound that
    # outlasts a stalled CI machine still catches it.
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    deadline = time.monotonic() + within
    while any((values := load.metrics(server["base"]))[name] for name in names):
        assert time.monotonic() < deadline, {name: values[name] for name in names}
        time.sleep(0.05)


# ---- clients that go away --------------------------------------------------------------------------------
def _raw_request(server, path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    host = server["base"].removeprefix("http://")
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {server['key']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


async def _abort_right_after_start(server, request: bytes, read_first: bool) -> None:
    """Send a whole streaming request on a raw socket and close it at once (or after the first bytes)."""
    host, port = server["base"].removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    if read_first:
        await reader.read(1)
    writer.transport.abort()  # a reset, not a polite close


async def _disconnect_mid_stream(client: httpx.AsyncClient, path: str, body: dict, lines: int) -> None:
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        seen = 0
        async for _ in response.aiter_lines():
            seen += 1
            if seen >= lines:
                break  # leaving the block closes the connection mid-stream


# The issue asks for 1000; CI runs 200 (DSV4_ABORTED_STARTS=1000 runs the full count).
ABORTED_STARTS = int(os.environ.get("DSV4_ABORTED_STARTS", "200"))


def test_random_disconnects_and_aborted_starts_harm_no_one(chat_server, load, bystander_reference):
    """24 streams that disconnect at random points (concurrently), then ABORTED_STARTS requests
    each aborted right after it starts (16 at a time), half before reading a byte."""
    server = chat_server
    rng = np.random.default_rng(3)

    def body(i: int) -> tuple[str, dict]:
        common = {"model": server["name"], "max_tokens": int(rng.integers(8, 100)), "ignore_eos": True,
                  "stream": True}
        if i % 2:
            return "/v1/completions", {**common, "prompt": [0, *rng.integers(1000, 90000, size=8).tolist()]}
        return "/v1/chat/completions", {**common, "messages": HELLO}

    async def storm() -> None:
        async with httpx.AsyncClient(base_url=server["base"], headers=_headers(server), timeout=120) as client:
            await asyncio.gather(*(_disconnect_mid_stream(client, *body(i), lines=int(rng.integers(1, 12)))
                                   for i in range(24)))
        gate = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            async with gate:
                await _abort_right_after_start(server, _raw_request(server, *body(i)), read_first=i % 2 == 1)

        await asyncio.gather(*(one(i) for i in range(ABORTED_STARTS)))

    with harmless(server, load, bystander_reference):
        asyncio.run(storm())


# ---- bad bodies ------------------------------------------------------------------------------------------------
POST_PATHS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
OVER_LIMIT = 16 * 2**20 + 1


def _error(response: httpx.Response) -> tuple[int, dict]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return response.status_code, error


def test_malformed_bodies_get_400_413_or_415(chat_server, load, bystander_reference):
    server = chat_server
    json_type = {"content-type": "application/json"}
    cases = [  # (body bytes or a chunk iterator, headers, status, a word the message must hold)
        (b"{not json", json_type, 400, "JSON"),
        (b"", json_type, 400, "JSON"),
        (b'{"prompt": "\xff\xfe"}', json_type, 400, "UTF-8"),
        (b"[1, 2]", json_type, 400, "object"),
        (b"null", json_type, 400, "object"),
        (b"x" * OVER_LIMIT, json_type, 413, "limit"),
        (lambda: (b"x" * 2**20 for _ in range(17)), json_type, 413, "limit"),  # chunked, no Content-Length
        (b'{"prompt": "Hi"}', {"content-type": "text/plain"}, 415, "Content-Type"),
        (b'{"prompt": "Hi"}', {"content-type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
        (b"--b\r\n\r\nx\r\n--b--", {"content-type": "multipart/form-data; boundary=b"}, 415, "Content-Type"),
    ]
    wrong = []
    with harmless(server, load, bystander_reference), httpx.Client(base_url=server["base"],
                                                                   headers=_headers(server), timeout=60) as http:
        for path in POST_PATHS:
            for content, headers, status, word in cases:
                response = http.post(path, content=content() if callable(content) else content, headers=headers)
                got, error = _error(response)
                if got != status or word not in error["message"]:
                    wrong.append((path, content if isinstance(content, bytes) and len(content) < 40 else "...",
                                  got, error["message"][:80]))
    assert not wrong, wrong


def test_deeply_nested_json_is_a_400_not_a_500(chat_server):
    """json.loads raises RecursionError (not JSONDecodeError) past ~1000 levels of nesting: the
    server must still answer 400, as for any other body that is not JSON it can read."""
    server = chat_server
    response = httpx.post(f"{server['base']}/v1/completions", content=b"[" * 100_000,
                          headers={**_headers(server), "content-type": "application/json"}, timeout=60)
    status, error = _error(response)
    assert status == 400, error


# A lone UTF-16 surrogate: JSON's \ud800 escape without its pair, which json.loads accepts but no
# UTF-8 (the tokenizer, the error body naming it) can encode. Written as raw JSON text.
LONE_SURROGATES = [
    ("/v1/completions", r'{"prompt": "\ud800 hi", "max_tokens": 1}'),
    ("/v1/completions", r'{"prompt": ["fine", "\udfff"], "max_tokens": 1}'),
    ("/v1/completions", r'{"model": "\ud800", "prompt": "hi"}'),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "x\ud800"}], "max_tokens": 1}'),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
                             r'"tools": [{"type": "function", "function": {"name": "f\ud800", "description": "d"}}]}'),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": '
                             r'{"type": "json_schema", "json_schema": {"name": "s", "schema": {"\udc00": 1}}}}'),
    ("/tokenize", r'{"prompt": "\ud800"}'),
    ("/detokenize", r'{"tokens": [1], "model": "\udbff"}'),
]


def test_lone_surrogates_are_400s_and_paired_ones_are_text(chat_server, load, bystander_reference):
    server = chat_server
    headers = {**_headers(server), "content-type": "application/json"}
    with harmless(server, load, bystander_reference), httpx.Client(base_url=server["base"], timeout=60) as http:
        for path, body in LONE_SURROGATES:
            status, error = _error(http.post(path, content=body.encode(), headers=headers))
            assert status == 400 and error["type"] == "invalid_request_error", (path, body, error)
            assert "surrogate" in error["message"], (path, error)
        # A pair is one character (U+1F600), and an escaped backslash before "ud800" is plain text.
        for text in (r"\ud83d\ude00", r"\\ud800"):
            response = http.post("/tokenize", content=f'{{"prompt": "{text}"}}'.encode(), headers=headers)
            assert response.status_code == 200 and response.json()["count"] > 1, response.text


def test_an_unknown_route_is_a_404_that_names_no_model(chat_server):
    """Starlette's and vLLM's 404 for a route says nothing of models; model_not_found is for `model`."""
    for method, path in (("GET", "/nope"), ("POST", "/v1/embeddings")):
        status, error = _error(httpx.request(method, f"{chat_server['base']}{path}", headers=_headers(chat_server)))
        assert (status, error["code"], error["param"]) == (404, None, None), (path, error)
        assert path in error["message"], error


def test_a_huge_prompt_is_refused_without_stalling_the_server(chat_server, load, bystander_reference):
    """A prompt near the 16 MiB body limit is refused (400, the numbers) before it is tokenized:
    its characters alone prove it is over max_model_len. Meanwhile /health answers at once
    (tokenizing it on the event loop would hold the loop ~13 s) and the bystander's streams go on."""
    server = chat_server
    huge = "hello world " * 1_300_000  # 15.6 MB
    stop, latencies = threading.Event(), []

    def poll_health() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                started = time.monotonic()
                http.get(f"{server['base']}/health")
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    with harmless(server, load, bystander_reference), httpx.Client(base_url=server["base"],
                                                                   headers=_headers(server), timeout=120) as http:
        poller.start()
        try:
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                               ("/v1/completions", {"prompt": huge}), ("/v1/completions", {"prompt": ["hi", huge]})):
                started = time.monotonic()
                status, error = _error(http.post(path, json={"model": server["name"], "max_tokens": 1, **body}))
                seconds = time.monotonic() - started
                assert status == 400 and str(MAX_MODEL_LEN) in error["message"], (path, error)
                # Generous bounds for a loaded 2-core CI machine: tokenizing first takes 13-20 s.
                assert error["param"] in ("messages", "prompt") and seconds < 10, (path, error, seconds)
        finally:
            stop.set()
            poller.join()
    # The event loop blocked on a huge body for 13-20 s before; a stalled CI machine may take seconds.
    assert latencies and max(latencies) < 8.0, sorted(latencies)[-5:]


# ---- every invalid parameter of every endpoint ---------------------------------------------------------------------
CHAT_BODY = {"messages": HELLO, "max_tokens": 2}
COMPLETION_BODY = {"prompt": "Hi", "max_tokens": 2}
TOKENIZE_BODY = {"prompt": "Hi"}
DETOKENIZE_BODY = {"tokens": [1, 2]}
SAMPLING = [  # (field, a value of the wrong type, a value out of range or None, the param named)
    ("n", "2", 0, "n"), ("n", None, 17, "n"),
    ("temperature", "hot", -1, "temperature"),
    ("top_p", "x", 1.5, "top_p"), ("top_p", None, 0, "top_p"),
    ("top_k", 1.5, -2, "top_k"),
    ("min_p", "x", 2, "min_p"),
    ("seed", "x", 2**64, "seed"),
    ("presence_penalty", "x", 3, "presence_penalty"),
    ("frequency_penalty", [], -3, "frequency_penalty"),
    ("repetition_penalty", "x", 0, "repetition_penalty"),
    ("logit_bias", [], {"129280": 1}, "logit_bias"), ("logit_bias", {"5": "x"}, {"-1": 1}, "logit_bias"),
    ("stop", 5, [""], "stop"),
    ("stop_token_ids", "x", [-1], "stop_token_ids"), ("stop_token_ids", None, [129280], "stop_token_ids"),
    ("min_tokens", "x", -1, "min_tokens"), ("min_tokens", None, 5, "min_tokens"),  # 5 > max_tokens 2
    ("ignore_eos", "yes", None, "ignore_eos"),
    ("skip_special_tokens", 1, None, "skip_special_tokens"),
    ("include_stop_str_in_output", "no", None, "include_stop_str_in_output"),
    ("max_tokens", "4", 0, "max_tokens"),
    ("stream", "yes", None, "stream"),
    ("stream_options", "x", None, "stream_options"),
    ("return_tokens_as_token_ids", "x", None, "return_tokens_as_token_ids"),
    ("user", 5, None, "user"), ("store", "x", None, "store"), ("metadata", "x", None, "metadata"),
    ("service_tier", 5, None, "service_tier"), ("request_id", 5, None, "request_id"),
    ("allowed_token_ids", "x", [129280], "allowed_token_ids"), ("bad_words", 5, [" "], "bad_words"),
    ("truncate_prompt_tokens", "x", 0, "truncate_prompt_tokens"),
    ("structured_outputs", "x", {"json": {"type": "strin"}}, None),
    ("structured_outputs", {"regex": "a(("}, {"choice": ["a"], "regex": "a"}, None),
    ("guided_json", None, {"type": "object"}, "guided_json"),
]
CHAT_ONLY = [
    ("messages", "hi", [], "messages"),
    ("messages", [5], [{"role": "wizard", "content": "x"}], None),  # param: messages[0] / messages[0].role
    ("tools", "x", [{"type": "retrieval"}], None),
    ("tool_choice", 5, "sometimes", "tool_choice"),
    ("parallel_tool_calls", "yes", None, "parallel_tool_calls"),
    ("response_format", "json", {"type": "xml"}, None),
    ("chat_template_kwargs", "x", {"thinking": "maybe"}, None),
    ("reasoning_effort", 5, "extreme", "reasoning_effort"),
    ("max_completion_tokens", "4", 0, "max_completion_tokens"),
    ("logprobs", "yes", None, "logprobs"),
    ("top_logprobs", "2", 21, "top_logprobs"),
    ("audio", None, {"format": "wav"}, "audio"), ("functions", None, [], "functions"),
    ("echo", None, True, "echo"), ("use_beam_search", None, True, "use_beam_search"),
    ("prompt_logprobs", None, 1, "prompt_logprobs"),
]
COMPLETION_ONLY = [
    ("prompt", 5, [], "prompt"), ("prompt", None, [0, 129280], "prompt"), ("prompt", [[0], "x"], [[0], []], None),
    ("echo", "x", None, "echo"),
    ("logprobs", "2", 21, "logprobs"),
    ("prompt_logprobs", "x", 21, "prompt_logprobs"),
    ("suffix", None, "tail", "suffix"), ("best_of", None, 3, "best_of"),
    ("response_format", "json", {"type": "xml"}, None),
]
TOKENIZE = [
    ("prompt", 5, None, "prompt"),
    ("messages", "x", [], "messages"),
    ("tools", "x", [{"type": "retrieval"}], None),
    ("chat_template_kwargs", "x", {"thinking": "maybe"}, None),
    ("reasoning_effort", 5, "extreme", "reasoning_effort"),
    ("add_special_tokens", "x", None, "add_special_tokens"),
    ("return_token_strs", "x", None, "return_token_strs"),
]
DETOKENIZE = [("tokens", "x", [-1], "tokens"), ("tokens", [1.5], [129280], "tokens")]
MODEL = [("model", 5, None, "model")]  # an unknown model is a 404, checked below
ENDPOINT_TABLES = {
    "/v1/chat/completions": (CHAT_BODY, MODEL + SAMPLING + CHAT_ONLY),
    "/v1/completions": (COMPLETION_BODY, MODEL + SAMPLING + COMPLETION_ONLY),
    "/tokenize": (TOKENIZE_BODY, MODEL + TOKENIZE),
    "/detokenize": (DETOKENIZE_BODY, MODEL + DETOKENIZE),
}
# Where the param is a path inside the field, the prefix it must start with.
NESTED_PARAMS = {"messages": "messages[0]", "tools": "tools", "response_format": "response_format",
                 "structured_outputs": "structured_outputs",
                 "chat_template_kwargs": "chat_template_kwargs", "prompt": "prompt"}


def _bad_bodies(path: str, model: str):
    base, table = ENDPOINT_TABLES[path]
    for field, wrong_type, out_of_range, param in table:
        for value in (wrong_type, out_of_range):
            if value is None:
                continue
            body = {"model": model, **base, field: value}
            if field == "stream_options" or (field == "prompt_logprobs" and path == "/v1/completions"):
                body["stream"] = field == "stream_options"  # stream_options needs stream; prompt_logprobs not
            if field == "messages" and path == "/tokenize":
                body.pop("prompt")
            yield field, value, body, param


def test_every_invalid_parameter_of_every_endpoint_is_a_400_naming_it(chat_server, load, bystander_reference):
    server = chat_server
    wrong, count = [], 0
    with harmless(server, load, bystander_reference), httpx.Client(base_url=server["base"],
                                                                   headers=_headers(server), timeout=60) as http:
        for path in ENDPOINT_TABLES:
            for field, value, body, param in _bad_bodies(path, server["name"]):
                count += 1
                status, error = _error(http.post(path, json=body))
                named = error["param"] == param if param else str(error["param"]).startswith(NESTED_PARAMS[field])
                if status != 400 or not named:
                    wrong.append((path, field, value, status, error["param"], error["message"][:80]))
            unknown = http.post(path, json={**ENDPOINT_TABLES[path][0], "model": "gpt-4"})
            status, error = _error(unknown)
            if (status, error["param"], error["code"]) != (404, "model", "model_not_found"):
                wrong.append((path, "model", "gpt-4", status, error["param"], error["message"][:80]))
        both = http.post("/tokenize", json={"prompt": "Hi", "messages": HELLO})
        if _error(both)[0] != 400:
            wrong.append(("/tokenize", "prompt+messages", both.status_code))
    assert count > 120 and not wrong, wrong


def test_prompts_over_max_model_len_are_400s_with_the_numbers(chat_server, load, bystander_reference):
    server = chat_server
    rng = np.random.default_rng(5)

    def ids(n: int) -> list[int]:
        return [0, *rng.integers(1000, 90000, size=n - 1).tolist()]

    def words(n: int) -> list[dict]:
        return [{"role": "user", "content": "word " * n}]

    over = [  # (path, body, the numbers the message must hold, the field to change: OpenAI's param)
        # A prompt that alone fills max_model_len is the prompt's fault (OpenAI names the messages).
        ("/v1/completions", {"prompt": ids(MAX_MODEL_LEN), "max_tokens": 1}, ("512",), "prompt"),
        ("/v1/completions", {"prompt": ids(MAX_MODEL_LEN + 40), "max_tokens": 1}, ("552", "512"), "prompt"),
        ("/v1/completions", {"prompt": ids(400), "max_tokens": 200}, ("400", "200", "512"), "max_tokens"),
        ("/v1/completions", {"prompt": "word " * 600, "max_tokens": 1}, ("512",), "prompt"),
        # A chat prompt is its messages, and the limit is named as the request gave it.
        ("/v1/chat/completions", {"messages": words(600), "max_tokens": 1}, ("512",), "messages"),
        ("/v1/chat/completions", {"messages": words(600)}, ("512",), "messages"),
        ("/v1/chat/completions", {"messages": words(300), "max_completion_tokens": 300, "max_tokens": 1},
         ("max_completion_tokens (300)", "512"), "max_completion_tokens"),
        ("/v1/completions", {"prompt": [ids(10), ids(MAX_MODEL_LEN)], "max_tokens": 1}, ("512",), "prompt"),
    ]
    with harmless(server, load, bystander_reference), httpx.Client(base_url=server["base"],
                                                                   headers=_headers(server), timeout=120) as http:
        for path, body, numbers, param in over:
            status, error = _error(http.post(path, json={"model": server["name"], **body}))
            assert status == 400 and all(n in error["message"] for n in numbers), (path, error)
            assert error["param"] == param, (path, error)  # the engine's RequestRejected, in the request's names
        fits = http.post("/v1/completions", json={"model": server["name"], "prompt": ids(MAX_MODEL_LEN - 2),
                                                  "max_tokens": 2, "ignore_eos": True})
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 2, fits.text
        # Left out, completions' max_tokens is OpenAI's 16, refused like a sent one (vLLM, OpenAI);
        # an explicit null asks for what is left (no server default here).
        status, error = _error(http.post("/v1/completions", json={"model": server["name"],
                                                                  "prompt": ids(MAX_MODEL_LEN - 5)}))
        assert (status, error["param"]) == (400, "max_tokens") and "max_tokens (16)" in error["message"], error
        rest = http.post("/v1/completions", json={"model": server["name"], "prompt": ids(MAX_MODEL_LEN - 5),
                                                  "max_tokens": None, "ignore_eos": True})
        assert rest.status_code == 200 and rest.json()["usage"]["completion_tokens"] == 5, rest.text
        assert rest.json()["choices"][0]["finish_reason"] == "length"


# ---- SIGTERM and SIGINT with requests in flight ------------------------------------------------------------------------
def _start_second_server(checkpoint, log_path) -> tuple[subprocess.Popen, str]:
    port = quiet_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "serve", str(checkpoint), *CHAT_SERVER_FLAGS,
                                    "--port", str(port), "--served-model-name", "dsv4-test"],
                                   stdout=log, stderr=subprocess.STDOUT, env=chat_server_env(), cwd=REPO)
    return process, f"http://127.0.0.1:{port}"


def _wait_healthy(process: subprocess.Popen, base: str, log_path) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.2)


def _shutdown_scenario(load, process: subprocess.Popen, base: str, sig: int) -> dict:
    """Streams in flight, then `sig`: what new requests get, how the streams end, the exit status."""
    reqs = [load.LoadRequest("completions", "", 12) for _ in range(3)]
    bodies = [{"model": "dsv4-test", "prompt": [0, 50 + i, 60 + i], "max_tokens": 12, "temperature": 0,
               "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True, "stream": True,
               "stream_options": {"include_usage": True}} for i in range(3)]
    started, ends = threading.Barrier(len(bodies) + 1), {}

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json=bodies[i], timeout=60) as response:
            lines = response.iter_lines()
            payloads = []
            for line in lines:
                if line.startswith("data: "):
                    payloads.append(line[6:])
                    break
            started.wait()
            payloads += [line[6:] for line in lines if line.startswith("data: ")]
        ends[i] = load.check_stream(reqs[i], 3, payloads)[3]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    signalled = time.monotonic()
    process.send_signal(sig)
    new_requests = []
    for _ in range(3):  # new connections, right after the signal
        try:
            response = httpx.post(f"{base}/v1/completions", json=bodies[0], timeout=30)
            new_requests.append(response.status_code)
            if response.status_code == 503:
                _error(response)
        except httpx.ConnectError:
            new_requests.append("connection refused")
        except (httpx.RemoteProtocolError, httpx.ReadError):
            new_requests.append("connection closed")
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    exit_status = process.wait(timeout=30)
    return {"new_requests": new_requests, "stream_problems": ends, "exit_status": exit_status,
            "seconds_to_exit": time.monotonic() - signalled}


def test_sigterm_and_sigint_stop_accepting_finish_in_flight_streams_and_exit_0(chat_server, chat_checkpoint, load,
                                                                               tmp_path, record_property):
    """Two more server processes (same flags and compilation cache as chat_server, so they compile
    nothing), started together; one gets SIGTERM, the other SIGINT, each with 3 streams in flight."""
    servers = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        log_path = tmp_path / f"{sig.name}.log"
        servers[sig] = (*_start_second_server(chat_checkpoint, log_path), log_path)
    try:
        for process, base, log_path in servers.values():
            _wait_healthy(process, base, log_path)
        outcomes = {}

        def scenario(sig: signal.Signals, process: subprocess.Popen, base: str) -> None:
            outcomes[sig.name] = _shutdown_scenario(load, process, base, sig)

        runners = [threading.Thread(target=scenario, args=(sig, process, base))
                   for sig, (process, base, _) in servers.items()]
        for t in runners:
            t.start()
        for t in runners:
            t.join(timeout=120)
    finally:
        for process, _, _ in servers.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    record_property("shutdown_outcomes", outcomes)
    print("shutdown outcomes:", outcomes)
    # A scenario thread that raised left no outcome: that is a failure too, not a pass.
    assert set(outcomes) == {"SIGTERM", "SIGINT"}, outcomes
    for name, outcome in outcomes.items():
        log = servers[getattr(signal, name)][2].read_text()
        assert outcome["exit_status"] == 0, (name, log[-3000:])
        assert outcome["stream_problems"] == {0: [], 1: [], 2: []}, (name, outcome)
        refused = (503, "connection refused", "connection closed")
        assert all(r in refused for r in outcome["new_requests"]), (name, outcome)
        assert outcome["seconds_to_exit"] < 15, (name, outcome)
        assert "no new requests" in log and "Traceback" not in log, log[-3000:]
