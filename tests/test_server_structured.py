"""Structured outputs through `python -m serve` as a client uses them: the official `openai` client's
own parsing (`chat.completions.parse` / `.stream` with a pydantic model), `response_format`
json_schema / json_object, vLLM's extra-body `structured_outputs` (regex, choice, Lark and GBNF
grammars) on chat and completions, `tool_choice` "required" / a named function, and the OpenAI
error bodies of constraints the server refuses.

The server is the session's `chat_server` (tests/conftest.py): a one-layer random-weight model with
the real vocabulary, its structured outputs binding from the first token (`enable_in_reasoning`)
and JSON without free whitespace (`disable_any_whitespace`). The model is random, so every check is
against an independent expectation (JSON Schema validation with `jsonschema`, `re.fullmatch`,
membership, the OpenAI protocol's shapes), never against a recorded output; every constraint is
bounded (enums, integer ranges, `maxLength`, `maxItems`) so that answers sampled at temperature 1
end by the grammar's end, which finishes them with `finish_reason` "stop".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
import threading
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from conftest import CHAT_SERVER_KEY, CHAT_SERVER_NAME  # tests/ is on sys.path
from pydantic import BaseModel, Field

KEY, NAME = CHAT_SERVER_KEY, CHAT_SERVER_NAME
MAX_MODEL_LEN = 512
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
ASK = [{"role": "user", "content": "Describe the box."}]
SEEDS = range(6)
NO_LOGPROB = -9999.0  # OpenAI's floor for a logprob: a masked (-inf) token is reported with it


class Size(BaseModel):
    w: int = Field(ge=0, le=9)
    unit: Literal["cm", "in"]


class Box(BaseModel):
    """A bounded model: a Literal enum, an integer range, a short string, a short list, a nested model."""

    color: Literal["red", "green", "blue"]
    count: int = Field(ge=-5, le=120)
    name: str = Field(max_length=6)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=2)
    size: Size


# The same kind of bounds written by hand, for clients that send a schema rather than a model.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "mode": {"enum": ["fast", "slow"]},
    },
    "required": ["ok", "level", "words", "mode"],
    "additionalProperties": False,
}

# Two tools with bounded parameters: an enum, integer ranges, a string maxLength, an array
# maxItems, a nested object with `required` (and no other properties). V4's tools section is long
# (~250 tokens before the schemas): with these the prompt is ~400 tokens of the 512, which leaves
# room for two calls, not many more.
TOOLS = [
    {"type": "function", "function": {"name": "alarm", "parameters": {
        "type": "object",
        "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23},
                       "t": {"type": "string", "maxLength": 4}},
        "required": ["h"]}}},
    {"type": "function", "function": {"name": "paint", "parameters": {
        "type": "object",
        "properties": {"c": {"enum": ["red", "blue"]},
                       "b": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 9}},
                             "required": ["w"], "additionalProperties": False},
                       "l": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
        "required": ["b"]}}},
]
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
GO = [{"role": "user", "content": "Go."}]


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from dsv4_jax.chat.tokenizer import load_tokenizer

    return load_tokenizer()


def _http(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server['base']}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def _error(response: httpx.Response, status: int = 400) -> dict:
    """The OpenAI error object of a response with that status."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    return error


def _concurrently(function, items) -> list:
    """`function` over `items`, all requests in flight together (the server batches them)."""
    items = list(items)
    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(function, items))


# ---- response_format with a pydantic model, through the client's own parsing ---------------------------
def test_parse_with_a_pydantic_model_gives_valid_instances(client):
    """`chat.completions.parse(response_format=Model)`: the client sends the model's strict schema
    ($defs and $ref for the nested model) and parses the answer; every seed's answer ends by the
    grammar ("stop") and validates against pydantic's own schema of the model."""
    schema = Box.model_json_schema()

    def parse(seed: int):
        return client.chat.completions.parse(model=NAME, messages=ASK, response_format=Box, temperature=1, seed=seed,
                                             max_tokens=150, extra_body=NO_THINKING)

    answers = _concurrently(parse, SEEDS)
    for out in answers:
        (choice,) = out.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Box), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert out.usage.completion_tokens >= 1 and out.usage.prompt_tokens + 150 <= MAX_MODEL_LEN
    assert len({out.choices[0].message.content for out in answers}) > 1  # sampled, not one fixed answer

    several = client.chat.completions.parse(model=NAME, messages=ASK, response_format=Box, temperature=1, seed=11,
                                            n=3, max_tokens=150, extra_body=NO_THINKING)
    assert sorted(choice.index for choice in several.choices) == [0, 1, 2]
    for choice in several.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Box), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_structured_answers_parse_and_end_with_stop(client):
    """The client's `.stream(response_format=Model)` helper and a raw `create(stream=True)` with a
    json_schema dict: the concatenated content deltas are the whole answer, which validates; the
    last chunk with a choice says "stop"."""
    for seed in (0, 1):
        with client.chat.completions.stream(model=NAME, messages=ASK, response_format=Box, temperature=1, seed=seed,
                                            max_tokens=150, extra_body=NO_THINKING) as stream:
            deltas, finishes = [], []
            for event in stream:
                if event.type == "content.delta":
                    deltas.append(event.delta)
                elif event.type == "chunk":
                    finishes += [choice.finish_reason for choice in event.chunk.choices]
            final = stream.get_final_completion()
        text = "".join(deltas)
        assert text == final.choices[0].message.content and isinstance(final.choices[0].message.parsed, Box)
        jsonschema.validate(json.loads(text), Box.model_json_schema())
        assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1]), finishes

    response_format = {"type": "json_schema", "json_schema": {"name": "state", "schema": SCHEMA}}

    def streamed(seed: int):
        chunks = list(client.chat.completions.create(
            model=NAME, messages=ASK, response_format=response_format, temperature=1, seed=seed, max_tokens=150,
            stream=True, stream_options={"include_usage": True}, extra_body=NO_THINKING))
        return chunks

    for chunks in _concurrently(streamed, SEEDS):
        *body, last = chunks
        assert last.choices == [] and last.usage.completion_tokens >= 1
        text = "".join(chunk.choices[0].delta.content or "" for chunk in body)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert body[-1].choices[0].finish_reason == "stop", text


def test_json_object_answers_are_json_objects(client, tokenizer):
    """`response_format` json_object: any JSON object. A bias towards closing quotes and braces (a
    random model would otherwise write strings forever) makes the answers end; each is an object."""
    closing = {str(tokenizer.token_to_id(piece)): 12 for piece in ('"', '"}', "}")}
    assert "None" not in closing

    def ask(seed: int):
        return client.chat.completions.create(model=NAME, messages=ASK, response_format={"type": "json_object"},
                                              temperature=1, seed=seed, max_tokens=150, logit_bias=closing,
                                              extra_body=NO_THINKING)

    for out in _concurrently(ask, range(8)):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict), choice.message.content


# ---- vLLM's extra-body structured_outputs, on chat and completions ----------------------------------------
STRUCTURED_CASES = {
    "regex": ({"regex": r"(ab|cd){1,3}-[0-9]{2}"}, lambda t: re.fullmatch(r"(ab|cd){1,3}-[0-9]{2}", t)),
    "choice": ({"choice": ["yes", "no", "maybe later"]}, lambda t: t in ("yes", "no", "maybe later")),
    "lark": ({"grammar": 'start: "(" item ("," item){0,2} ")"\nitem: /[xyz]/'},
             lambda t: re.fullmatch(r"\([xyz](,[xyz]){0,2}\)", t)),
    "gbnf": ({"grammar": 'root ::= "id-" [0-9] [0-9]? ("!" | "?")'}, lambda t: re.fullmatch(r"id-[0-9]{1,2}[!?]", t)),
    "json": ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_structured_outputs_answers_are_in_their_languages(client, endpoint):
    """Each kind, three seeds, all in flight together: every answer is a word of its language
    (checked with `re.fullmatch`, membership, `jsonschema`) and ends with "stop"."""
    jobs = [(name, seed) for name in STRUCTURED_CASES for seed in range(3)]

    def ask(job):
        name, seed = job
        extra = {"structured_outputs": STRUCTURED_CASES[name][0]}
        if endpoint == "chat":
            out = client.chat.completions.create(model=NAME, messages=ASK, temperature=1, seed=seed, max_tokens=60,
                                                 extra_body={**extra, **NO_THINKING})
            return out.choices[0].message.content, out.choices[0].finish_reason
        out = client.completions.create(model=NAME, prompt="Answer:", temperature=1, seed=seed, max_tokens=60,
                                        extra_body=extra)
        return out.choices[0].text, out.choices[0].finish_reason

    answers = dict(zip(jobs, _concurrently(ask, jobs)))
    for (name, seed), (text, finish) in answers.items():
        assert finish == "stop" and STRUCTURED_CASES[name][1](text), (name, seed, text, finish)
    for name in ("regex", "lark", "gbnf"):  # sampled: the seeds do not all give one answer
        assert len({answers[name, seed][0] for seed in range(3)}) > 1, name


# ---- constrained and free requests in one batch -------------------------------------------------------------
def test_constrained_and_free_requests_share_batches_untouched(server):
    """Eight requests at once (AsyncOpenAI): half follow a schema, half are free with 20 tokens and
    `ignore_eos`. The constrained ones validate; the free ones run their 20 tokens ("length") and
    are not forced into JSON (the mask of a free row allows everything)."""

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server['base']}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as aclient:
            constrained = [aclient.chat.completions.parse(model=NAME, messages=ASK, response_format=Box,
                                                          temperature=1, seed=seed, max_tokens=150,
                                                          extra_body=NO_THINKING) for seed in range(4)]
            free = [aclient.chat.completions.create(model=NAME, messages=ASK, temperature=1, seed=seed, max_tokens=20,
                                                    extra_body={"ignore_eos": True, **NO_THINKING})
                    for seed in range(4)]
            outs = await asyncio.gather(*[job for pair in zip(constrained, free) for job in pair])
            return outs[0::2], outs[1::2]

    constrained, free = asyncio.run(run())
    for out in constrained:
        assert out.choices[0].finish_reason == "stop" and isinstance(out.choices[0].message.parsed, Box)
        jsonschema.validate(json.loads(out.choices[0].message.content), Box.model_json_schema())
    not_json = 0
    for out in free:
        assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"
        try:
            json.loads(out.choices[0].message.content or "")
        except json.JSONDecodeError:
            not_json += 1
    assert not_json >= 1, [out.choices[0].message.content for out in free]


# ---- tool_choice "required" and a named function ------------------------------------------------------------
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "paint"}}}


def _tool_bias(tokenizer) -> dict[str, int]:
    """A bias towards "</" (where the grammar allows it, it closes an invoke or the calls block;
    "<" would open another parameter or call), so that a random model's "required" answers do not
    run on into more calls than the ~100 tokens the tools' prompt leaves fit (measured: none of
    192 seeds did); optional parameters and second calls still come now and then."""
    return {str(tokenizer.token_to_id("</")): 4}


@pytest.fixture(scope="module")
def tool_room(server) -> int:
    """The completion tokens left under max_model_len by the tools' prompt (`/tokenize` counts it
    as the chat endpoint lays it out)."""
    count = _http(server, "/tokenize", {"model": NAME, "messages": GO, "tools": TOOLS, **NO_THINKING}).json()["count"]
    assert MAX_MODEL_LEN - count >= 100, count
    return MAX_MODEL_LEN - count


def _check_calls(calls: list[tuple[str, str]], choice: str) -> None:
    """Each call names an offered function (the named one, exactly once, for a named choice) and
    its arguments validate against that function's parameters."""
    assert calls
    if choice == "named":
        assert [name for name, _ in calls] == ["paint"], calls
    for name, arguments in calls:
        assert name in TOOL_SCHEMAS, calls
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])


@pytest.mark.parametrize("choice", list(CHOICES))
def test_forced_tool_calls_are_valid_calls_of_the_offered_tools(client, tokenizer, tool_room, choice):
    """Eight seeds whole and four streamed: every answer is a tool call ("tool_calls"), of the
    offered functions (only the named one, once, for a named choice), with arguments that validate
    against the function's `parameters`; streamed calls, reassembled by index, too."""
    bias = _tool_bias(tokenizer)

    def whole(seed: int):
        return client.chat.completions.create(model=NAME, messages=GO, tools=TOOLS, tool_choice=CHOICES[choice],
                                              temperature=1, seed=seed, max_tokens=tool_room, logit_bias=bias,
                                              extra_body=NO_THINKING)

    outs = _concurrently(whole, range(8))
    for out in outs:
        assert out.usage.prompt_tokens + tool_room == MAX_MODEL_LEN  # the prompt /tokenize counted
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls", (out.usage, message)
        assert message.tool_calls and not message.content, message
        assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
        assert all(call.type == "function" and call.id.startswith("call_") for call in message.tool_calls)
        _check_calls([(call.function.name, call.function.arguments) for call in message.tool_calls], choice)
    if choice == "required":  # the grammar offers both functions, and random answers take both
        assert {call.function.name for out in outs for call in out.choices[0].message.tool_calls} == set(TOOL_SCHEMAS)

    def streamed(seed: int):
        return list(client.chat.completions.create(
            model=NAME, messages=GO, tools=TOOLS, tool_choice=CHOICES[choice], temperature=1, seed=seed,
            max_tokens=tool_room, logit_bias=bias, stream=True, extra_body=NO_THINKING))

    for chunks in _concurrently(streamed, range(100, 104)):
        calls: dict[int, dict] = {}
        finishes = []
        for chunk in chunks:
            for part in chunk.choices:
                finishes.append(part.finish_reason)
                assert not part.delta.content
                for delta in part.delta.tool_calls or []:
                    first = delta.index not in calls
                    call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
                    # id, type and name on a call's first fragment only (OpenAI's stream shape)
                    assert (delta.id is not None, delta.type is not None, delta.function.name is not None) == \
                        (first, first, first), delta
                    call["arguments"] += delta.function.arguments or ""
        assert finishes[-1] == "tool_calls" and all(f is None for f in finishes[:-1]), finishes
        assert sorted(calls) == list(range(len(calls)))
        assert all(call["id"].startswith("call_") for call in calls.values())
        _check_calls([(call["name"], call["arguments"]) for _, call in sorted(calls.items())], choice)


def test_auto_tool_choice_stays_free(client):
    """tool_choice "auto" adds no constraint: the answer is the model's own (a random model almost
    never writes a tool call), and, seed for seed, the same tokens as with "none" (the same
    prompt: tools stay in it for "none"; neither constrains)."""
    for seed in range(3):
        tokens = {}
        for tool_choice in ("auto", "none"):
            out = client.chat.completions.create(
                model=NAME, messages=GO, tools=TOOLS, tool_choice=tool_choice, temperature=1, seed=seed, max_tokens=24,
                logprobs=True, extra_body={"return_tokens_as_token_ids": True, **NO_THINKING})
            assert out.choices[0].finish_reason in ("stop", "length")
            tokens[tool_choice] = [item.token for item in out.choices[0].logprobs.content]
            assert out.usage.completion_tokens == len(tokens[tool_choice])
        assert tokens["auto"] == tokens["none"], seed


# ---- errors -----------------------------------------------------------------------------------------------
def test_refused_constraints_are_openai_errors_that_harm_no_one(server):
    """An invalid schema, a removed `guided_*` field and a tool schema the tool-call grammar cannot
    enforce are 400s naming the field as the request wrote it, while a valid constrained stream
    runs beside them to its grammar's end."""
    pattern = "[a-z]{150}"
    started, errors_sent = threading.Event(), threading.Event()
    result: dict = {}

    def valid() -> None:
        body = {"model": NAME, "messages": ASK, "temperature": 1, "seed": 5, "max_tokens": 200, "stream": True,
                "structured_outputs": {"regex": pattern}, **NO_THINKING}
        with httpx.stream("POST", f"{server['base']}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            result["status"] = response.status_code
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()
                    errors_sent.wait(60)
        result["events"] = events

    thread = threading.Thread(target=valid)
    thread.start()
    try:
        assert started.wait(60)
        chat = "/v1/chat/completions"
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
        error = _error(_http(server, chat, {"model": NAME, "messages": ASK, "response_format": bad_schema}))
        assert error["param"] == "response_format.json_schema.schema", error
        error = _error(_http(server, chat, {"model": NAME, "messages": ASK, "guided_json": SCHEMA}))
        assert error["param"] == "guided_json" and "structured_outputs.json" in error["message"], error
        error = _error(_http(server, "/v1/completions", {"model": NAME, "prompt": "x", "guided_regex": "a+"}))
        assert "structured_outputs.regex" in error["message"], error
        union = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}]
        for tool_choice in ("required", {"type": "function", "function": {"name": "f"}}):
            error = _error(_http(server, chat, {"model": NAME, "messages": GO, "tools": union,
                                                "tool_choice": tool_choice, **NO_THINKING}))
            assert error["param"] == "tools[0].function.parameters.properties.x.anyOf", error
            assert "anyOf" in error["message"]
        # "auto" forces no call: the same tools are accepted there.
        auto = _http(server, chat, {"model": NAME, "messages": GO, "tools": union, "tool_choice": "auto",
                                    "max_tokens": 2, **NO_THINKING})
        assert auto.status_code == 200, auto.text
    finally:
        errors_sent.set()
        thread.join(120)
    assert result["status"] == 200 and result["events"][-1] == "[DONE]"
    chunks = [json.loads(event) for event in result["events"][:-1]]
    assert not any("error" in chunk for chunk in chunks), chunks[-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert re.fullmatch(pattern, text), text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


# ---- logprobs of a constrained answer -----------------------------------------------------------------------
def test_logprobs_of_a_constrained_answer_come_after_the_mask(client):
    """`choice` ["yes", "no"] with logprobs: every alternative with a logprob above OpenAI's floor
    continues the answer so far towards "yes" or "no" (masked tokens are -inf, reported as -9999),
    the allowed alternatives' probabilities sum to 1 when all of them are listed (the mask comes
    before the softmax), and usage counts one completion token per logprobs entry."""
    words = (b"yes", b"no")
    top = 6  # more than the tokens a prefix of "yes" or "no" can be (y, ye, yes, n, no)
    for seed in range(4):
        extra = {"structured_outputs": {"choice": ["yes", "no"]}, **NO_THINKING}
        out = client.chat.completions.create(model=NAME, messages=ASK, temperature=1, seed=seed, n=2, max_tokens=20,
                                             logprobs=True, top_logprobs=top, extra_body=extra)
        assert out.usage.completion_tokens == sum(len(choice.logprobs.content) for choice in out.choices)
        for choice in out.choices:
            assert choice.finish_reason == "stop" and choice.message.content in ("yes", "no"), choice.message.content
            so_far = b""
            for item in choice.logprobs.content:
                assert len(item.top_logprobs) == top
                ranked = [alt.logprob for alt in item.top_logprobs]
                assert ranked == sorted(ranked, reverse=True)
                allowed = [alt for alt in item.top_logprobs if alt.logprob > NO_LOGPROB]
                for alt in [item, *allowed]:
                    assert any(word.startswith(so_far + bytes(alt.bytes)) for word in words), (so_far, alt)
                assert item.logprob > NO_LOGPROB
                assert all(alt.logprob == NO_LOGPROB for alt in item.top_logprobs[len(allowed):])
                mass = sum(math.exp(alt.logprob) for alt in allowed)
                assert mass <= 1 + 1e-4
                if len(allowed) < top:  # every allowed token is listed: their probabilities are all of it
                    assert mass == pytest.approx(1.0, abs=1e-3), item
                so_far += bytes(item.bytes)
            assert so_far.decode() == choice.message.content
