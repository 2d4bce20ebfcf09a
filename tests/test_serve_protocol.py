"""OpenAI request validation (`serve.protocol`): each rule with its status, `param` and message,
the defaults, and, with hypothesis, that any JSON body or field value gives a typed request or an
OpenAIError (400/404) with a JSON body, never another exception. Plain Python: no compiles."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_jax.chat import build_prompt
from dsv4_jax.chat.tool_grammar import tool_call_grammar
from dsv4_jax.engine.sampling_params import SamplingParams
from dsv4_jax.engine.structured_outputs import StructuredOutputsParams
from serve.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    TOKENIZE_FIELDS,
    OpenAIError,
    ServerLimits,
    ToolChoice,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)

VOCAB = 1000
LIMITS = ServerLimits(served_model_names=("dsv4", "alias"), vocab_size=VOCAB, max_logprobs=5, max_n=4)
AUTO_TOOLS = ServerLimits(served_model_names=("dsv4",), vocab_size=VOCAB, enable_auto_tool_choice=True)
USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def chat(limits: ServerLimits = LIMITS, **fields):
    return parse_chat_request({"messages": USER, **fields}, limits)


def complete(limits: ServerLimits = LIMITS, **fields):
    return parse_completion_request({"prompt": "Hi", **fields}, limits)


def refused(parse, body, limits: ServerLimits = LIMITS, status: int = 400) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(body, limits)
    assert caught.value.status == status, caught.value.body()
    json.dumps(caught.value.body(), allow_nan=False)
    return caught.value


def chat_refused(param: str | None, words: str, limits: ServerLimits = LIMITS, **fields) -> OpenAIError:
    error = refused(parse_chat_request, {"messages": USER, **fields}, limits)
    assert error.param == param, error.body()
    assert words in error.message, error.message
    return error


# ---- errors and limits --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind", "code"),
    [
        (400, "invalid_request_error", None),
        (413, "invalid_request_error", None),
        (422, "invalid_request_error", None),
        (401, "authentication_error", "invalid_api_key"),
        (404, "invalid_request_error", None),  # an unknown route; an unknown model names its code
        (503, "service_unavailable_error", None),
        (500, "internal_server_error", None),
    ],
)
def test_error_type_and_code_follow_the_status(status, kind, code):
    error = OpenAIError("boom", status=status, param="x")
    assert error.body() == {"error": {"message": "boom", "type": kind, "param": "x", "code": code}}
    assert OpenAIError("boom", status=status, type="custom", code=7).body()["error"] | {"message": ""} == {
        "message": "",
        "type": "custom",
        "param": None,
        "code": 7,
    }


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"served_model_names": ()}, "served_model_names"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"max_logprobs": 21}, "max_logprobs"),
        ({"max_n": 0}, "max_n"),
        ({"default_sampling": {"temprature": 0.5}}, "temprature"),
        ({"default_sampling": {"top_p": 0.0}}, "top_p"),
        ({"default_chat_template_kwargs": {"thinking": "yes"}}, "thinking"),
        ({"structured_outputs_config": {"backend": "guidance"}}, "structured_outputs_config"),
    ],
)
def test_bad_server_limits_name_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        ServerLimits(**{"served_model_names": ("m",), "vocab_size": 10, **fields})


# ---- model and body -----------------------------------------------------------------------------


def test_model_defaults_to_the_first_served_name_and_unknown_is_404():
    assert chat().model == "dsv4"
    assert chat(model=None).model == "dsv4"
    assert chat(model="alias").model == "alias"
    error = refused(parse_chat_request, {"model": "gpt-4", "messages": USER}, status=404)
    assert (error.param, error.code, error.message) == ("model", "model_not_found", "The model `gpt-4` does not exist.")
    assert refused(parse_completion_request, {"model": 3, "prompt": "x"}).param == "model"


@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request, parse_tokenize_request])
@pytest.mark.parametrize("body", [None, [], "text", 3])
def test_a_body_that_is_not_an_object_is_refused(parse, body):
    error = refused(parse, body)
    assert error.param is None and "JSON object" in error.message


# ---- messages -----------------------------------------------------------------------------------


def test_messages_must_be_a_non_empty_array():
    chat_refused("messages", "non-empty", messages=[])
    chat_refused("messages", "non-empty", messages="Hi")
    chat_refused("messages", "non-empty", messages=None)


def test_text_parts_are_joined_and_other_parts_refused():
    parts = [{"type": "text", "text": "one"}, "two", {"type": "text", "text": "three"}]
    request = chat(messages=[{"role": "user", "content": parts}])
    assert request.messages == [{"role": "user", "content": "one\ntwo\nthree"}]
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    error = chat_refused("messages[0].content[1]", "text only", messages=[{"role": "user", "content": ["a", image]}])
    assert "image_url" in error.message
    chat_refused("messages[0].content[0].text", "string", messages=[{"role": "user", "content": [{"type": "text"}]}])
    chat_refused("messages[0].content", "content parts", messages=[{"role": "user", "content": 5}])


def test_reasoning_is_an_alias_of_reasoning_content():
    history = [*USER, {"role": "assistant", "content": "Hello", "reasoning": "greet"}, *USER]
    request = chat(messages=history)
    assert request.messages[1] == {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}
    assert history[1] == {"role": "assistant", "content": "Hello", "reasoning": "greet"}  # input left alone
    same = {"role": "assistant", "content": "", "reasoning": "r", "reasoning_content": "r"}
    assert chat(messages=[*USER, same]).messages[1]["reasoning_content"] == "r"
    both = {"role": "assistant", "content": "", "reasoning": "a", "reasoning_content": "b"}
    chat_refused("messages[1].reasoning", "reasoning_content", messages=[*USER, both])


def test_encoder_checks_name_the_message_field():
    chat_refused("messages[0].role", "role", messages=[{"role": "robot", "content": "x"}])
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    chat_refused(
        "messages[1].tool_calls[0].function.arguments",
        "JSON",
        messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call]}],
    )


# ---- sampling -----------------------------------------------------------------------------------


def test_a_full_chat_request_maps_onto_sampling_params():
    request = chat(
        AUTO_TOOLS,
        n=2,
        temperature=3.5,  # above OpenAI's 2: vLLM allows it
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=-7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={"5": 250, "7": -3.5},
        stop=["\n\n", "END"],
        stop_token_ids=[1, 2],
        max_completion_tokens=64,
        min_tokens=3,
        ignore_eos=True,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        logprobs=True,
        top_logprobs=4,
    )
    expected = SamplingParams(
        n=2,
        temperature=3.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=-7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={5: 100.0, 7: -3.5},
        stop=["\n\n", "END"],
        stop_token_ids=[1, 2],
        max_tokens=64,
        min_tokens=3,
        ignore_eos=True,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        logprobs=4,
    )
    assert request.params == expected


def test_unset_fields_take_the_server_defaults_then_sampling_params_defaults():
    limits = ServerLimits(
        ("m",), VOCAB, default_sampling={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    )
    params = chat(limits, top_p=0.5).params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.5, 20, 300)
    assert (params.min_p, params.repetition_penalty, params.n, params.logprobs) == (0.0, 1.0, 1, None)
    assert chat().params.max_tokens is None  # the engine fills the room left under max_model_len
    assert complete().params.max_tokens == 16  # OpenAI's completions default, not the server's
    assert complete(limits, max_tokens=None).params.max_tokens == 300
    assert complete(max_tokens=None).params.max_tokens is None
    # The server's default, which the client did not ask for, is capped to the room a prompt leaves
    # (serve.generation); what the client sent is not, nor completions' 16 when left out (vLLM).
    flagged = [
        (chat(limits), True), (chat(limits, max_tokens=None), True), (chat(), False),
        (chat(limits, max_tokens=300), False), (chat(limits, max_completion_tokens=9), False),
        (chat(limits, max_tokens=300, max_completion_tokens=9), False),
        (chat(limits, max_tokens=7, max_completion_tokens=None), False),
        (complete(limits, max_tokens=None), True), (complete(max_tokens=None), False), (complete(limits), False),
        (complete(limits, max_tokens=16), False),
    ]
    assert [request.max_tokens_is_default for request, _ in flagged] == [flag for _, flag in flagged]


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=10).params.max_tokens == 10
    assert chat(max_tokens=10, max_completion_tokens=20).params.max_tokens == 20
    chat_refused("max_completion_tokens", "integer", max_completion_tokens=0)
    chat_refused("max_tokens", "integer", max_tokens=0)
    chat_refused("max_tokens", "integer", max_tokens="10", max_completion_tokens=20)
    chat_refused("min_tokens", "max_tokens", max_tokens=2, min_tokens=5)  # found by SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("n", True, "integer"),
        ("n", 2.0, "integer"),
        ("n", 1.5, "integer"),
        ("n", "2", "integer"),
        ("n", 5, "[1, 4]"),  # above max_n
        ("n", 0, "[1, 4]"),
        ("seed", 2**63, "int64"),
        ("top_k", -2, ">= -1"),
        ("temperature", "hot", "number"),
        ("temperature", True, "number"),
        ("temperature", math.inf, "finite"),
        ("temperature", math.nan, "finite"),
        ("temperature", 10**400, "finite"),
        ("temperature", -0.5, "-0.5"),  # the bound's wording is SamplingParams'
        ("top_p", 0, "(0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", 3, "[-2, 2]"),
        ("repetition_penalty", 0, "> 0"),
        ("ignore_eos", 1, "boolean"),
        ("skip_special_tokens", "true", "boolean"),
        ("stream", 0, "boolean"),
        ("logprobs", 1, "boolean"),
        ("stop", "", "non-empty"),
        ("stop", ["a", ""], "non-empty"),
        ("stop", [3], "non-empty string"),
        ("stop", 3, "string"),
        ("stop_token_ids", [VOCAB], "token id"),
        ("stop_token_ids", [-1], "token id"),
        ("stop_token_ids", 5, "array"),
        ("top_logprobs", 6, "[0, 5]"),
    ],
)
def test_bad_sampling_values_are_400_naming_the_field(field, value, words):
    chat_refused(field, words, **{field: value})


def test_top_k_off_values_and_beyond_the_vocabulary():
    assert chat(top_k=-1).params.top_k == 0
    assert chat(top_k=0).params.top_k == 0
    assert chat(top_k=10**12).params.top_k == 0  # keeps every token, as no top-k does


def test_logit_bias_keys_are_token_ids_and_values_are_clamped():
    assert chat(logit_bias={"0": 101, "999": -1e9, "3": 0.5}).params.logit_bias == {0: 100.0, 999: -100.0, 3: 0.5}
    assert chat(logit_bias={"3": 10**30}).params.logit_bias == {3: 100.0}
    for key in ("a", "1.5", " 5", "-1", "+5", "٣", str(VOCAB)):
        chat_refused("logit_bias", "token id", logit_bias={key: 1})
    chat_refused("logit_bias", "finite", logit_bias={"3": math.nan})
    chat_refused("logit_bias", "number", logit_bias={"3": "1"})
    chat_refused("logit_bias", "object", logit_bias=[1])

    # Over the limit (the sampler's fixed width): the count and the limit, not the entries, and before
    # any entry is read (these keys are not even token ids).
    error = chat_refused("logit_bias", "300", logit_bias={str(VOCAB + t): 1 for t in range(301)})
    assert "301" in error.message and str(VOCAB) not in error.message and len(error.message) < 120, error.message


def test_logprobs_and_top_logprobs():
    assert chat().params.logprobs is None
    assert chat(logprobs=False, top_logprobs=0).params.logprobs is None  # vLLM accepts 0 without logprobs
    assert chat(logprobs=True).params.logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).params.logprobs == 5
    chat_refused("top_logprobs", "logprobs", top_logprobs=2)


def test_stream_options_only_with_stream():
    assert (chat().stream, chat().include_usage) == (False, False)
    assert chat(stream=True).include_usage is False
    assert chat(stream=True, stream_options={}).include_usage is True  # vLLM's default once given
    assert chat(stream=True, stream_options={"include_usage": False}).include_usage is False
    chat_refused("stream_options", "stream", stream_options={"include_usage": True})
    chat_refused("stream_options", "stream", stream=False, stream_options={})
    chat_refused("stream_options.include_usage", "boolean", stream=True, stream_options={"include_usage": "yes"})
    chat_refused("stream_options", "object", stream=True, stream_options=[])
    # continuous_usage_stats counts only with include_usage (vLLM's should_include_usage)
    assert chat(stream=True).continuous_usage is False
    assert chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage is True
    assert chat(stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True}
                ).continuous_usage is False
    chat_refused("stream_options.continuous_usage_stats", "boolean", stream=True,
                 stream_options={"continuous_usage_stats": 1})
    # --enable-force-include-usage: every stream gets both, whatever stream_options say; a
    # response that is not streamed always has its usage, and stream_options still need stream
    forced = dataclasses.replace(LIMITS, force_include_usage=True)
    for options in (None, {}, {"include_usage": False}, {"continuous_usage_stats": False}):
        given = {} if options is None else {"stream_options": options}
        for request in (chat(forced, stream=True, **given), complete(forced, stream=True, **given)):
            assert (request.include_usage, request.continuous_usage) == (True, True)
    assert (chat(forced).include_usage, chat(forced).continuous_usage) == (False, False)
    chat_refused("stream_options", "stream", forced, stream_options={})


# ---- tools, formats, template options -----------------------------------------------------------


def test_prompt_tokens_details_follow_the_server_flag_on_both_endpoints():
    """--enable-prompt-tokens-details is the server's, not the request's: no body field turns it on
    or off (vLLM has none either), and both endpoints, streamed or not, carry the server's setting."""
    details = dataclasses.replace(LIMITS, prompt_tokens_details=True)
    for parse, body in ((parse_chat_request, {"messages": USER}), (parse_completion_request, {"prompt": "Hi"})):
        for stream in (False, True):
            assert parse({**body, "stream": stream}, LIMITS).prompt_tokens_details is False
            assert parse({**body, "stream": stream}, details).prompt_tokens_details is True


def test_tool_choice_defaults_and_vllm_auto_rule():
    assert (chat().tool_choice, chat().tools) == (ToolChoice("none"), None)
    request = chat(AUTO_TOOLS, tools=[TOOL])
    assert (request.tool_choice, request.tools) == (ToolChoice("auto"), [TOOL])
    flag = "--enable-auto-tool-choice"
    chat_refused("tool_choice", flag, tools=[TOOL])  # the implicit "auto" too, as vLLM
    chat_refused("tool_choice", flag, tools=[TOOL], tool_choice="auto")
    kept = chat(tools=[TOOL], tool_choice="none")
    assert (kept.tool_choice, kept.tools) == (ToolChoice("none"), [TOOL])  # tools stay in the prompt
    assert chat(tools=[], tool_choice=None).tool_choice == ToolChoice("none")


def test_required_and_named_tool_choice():
    assert chat(tools=[TOOL], tool_choice="required").tool_choice == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tools=[TOOL], tool_choice=named).tool_choice == ToolChoice("function", "get_weather")
    emptied = chat(tools=[], tool_choice="required")
    assert (emptied.tool_choice, emptied.tools) == (ToolChoice("none"), None)
    chat_refused("tool_choice", "needs tools", tool_choice="required")
    chat_refused("tool_choice", "needs tools", tool_choice=named)
    chat_refused("tool_choice", "needs tools", AUTO_TOOLS, tool_choice="auto")
    chat_refused("tool_choice", "not one of", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}})
    chat_refused("tool_choice", "name a function", tools=[TOOL], tool_choice={"type": "function"})
    chat_refused("tool_choice", "one of", tools=[TOOL], tool_choice="any")
    chat_refused("tool_choice", "string or an object", tools=[TOOL], tool_choice=1)


def test_tools_are_function_tools_the_encoder_can_write():
    chat_refused("tools[0].type", "function tools", tools=[{"type": "web_search"}], tool_choice="none")
    chat_refused("tools[0].function", "function object", tools=[{"type": "function"}], tool_choice="none")
    chat_refused("tools[0].function.name", "non-empty", tools=[{"function": {"name": ""}}], tool_choice="none")
    bad_name = {"type": "function", "function": {"name": "a<b"}}
    chat_refused("tools[0].function.name", "'<'", tools=[bad_name], tool_choice="none")
    chat_refused("tools", "array", tools={"a": TOOL}, tool_choice="none")
    assert chat(parallel_tool_calls=False).parallel_tool_calls is False
    assert chat().parallel_tool_calls is True
    chat_refused("parallel_tool_calls", "boolean", parallel_tool_calls="no")


def test_response_format():
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
    for response_format in ({"type": "text"}, {"type": "json_object"}, schema):
        assert chat(response_format=response_format).response_format == response_format
    chat_refused("response_format.type", "json_schema", response_format={"type": "xml"})
    chat_refused("response_format.type", "json_schema", response_format={"type": "structural_tag"})
    chat_refused("response_format.json_schema", "json_schema object", response_format={"type": "json_schema"})
    nameless = {"type": "json_schema", "json_schema": {"schema": {}}}
    chat_refused("response_format.json_schema.name", "non-empty", response_format=nameless)
    nan_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"max": math.nan}}}
    chat_refused("response_format", "JSON", response_format=nan_schema)


def test_chat_template_kwargs_and_reasoning_effort():
    limits = ServerLimits(("m",), VOCAB, default_chat_template_kwargs={"thinking": False, "drop_thinking": True})
    request = chat(limits, chat_template_kwargs={"thinking": True}, reasoning_effort="max")
    assert request.chat_template_kwargs == {"thinking": True, "drop_thinking": True}
    assert request.reasoning_effort == "max"
    assert chat(limits).chat_template_kwargs == {"thinking": False, "drop_thinking": True}
    chat_refused("chat_template_kwargs.thinking", "boolean", chat_template_kwargs={"thinking": "on"})
    chat_refused("chat_template_kwargs", "object", chat_template_kwargs=["thinking"])
    chat_refused("reasoning_effort", "unsupported", reasoning_effort="extreme")


def test_vllms_sampling_rules_hold_for_requests():
    """As a vLLM server: seed -1 is no seed, a temperature below 0.01 is 0.01, and n > 1 with
    greedy sampling is refused (naming n)."""
    assert chat(seed=-1).params.seed is None and complete(seed=-1).params.seed is None
    assert chat(temperature=0.001).params.temperature == 0.01
    chat_refused("n", "greedy sampling", n=2, temperature=0)
    assert refused(parse_completion_request, {"prompt": "x", "n": 3, "temperature": 0.0}).param == "n"


# ---- structured outputs and vLLM's token constraints --------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
STRUCTURAL_TAG = json.dumps({"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f"]})
BOTH = pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request], ids=["chat", "completions"])


def parsed(parse, limits: ServerLimits = LIMITS, **fields):
    body = {"messages": USER, **fields} if parse is parse_chat_request else {"prompt": "Hi", **fields}
    return parse(body, limits)


def refused_as(parse, param: str, words: str, **fields) -> OpenAIError:
    body = {"messages": USER, **fields} if parse is parse_chat_request else {"prompt": "Hi", **fields}
    error = refused(parse, body)
    assert error.param == param, error.body()
    assert words in error.message, error.message
    return error


@BOTH
@pytest.mark.parametrize(("spec", "expected"), [
    ({"json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),  # vLLM takes the schema's JSON text too
    ({"json_object": True}, StructuredOutputsParams(json_object=True)),
    ({"regex": "[0-9]{3}"}, StructuredOutputsParams(regex="[0-9]{3}")),
    ({"choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"grammar": 'start: "yes" | "no"'}, StructuredOutputsParams(grammar='start: "yes" | "no"')),
    ({"grammar": 'root ::= "yes" | "no"'}, StructuredOutputsParams(grammar='root ::= "yes" | "no"')),  # GBNF
    ({"structural_tag": STRUCTURAL_TAG}, StructuredOutputsParams(structural_tag=STRUCTURAL_TAG)),
    ({"json": SCHEMA, "disable_any_whitespace": True, "disable_additional_properties": True,
      "whitespace_pattern": None, "regex": None},  # null: left out, as vLLM's fields default
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, disable_additional_properties=True)),
    ({"regex": "a+", "whitespace_pattern": " ?", "disable_fallback": True},
     StructuredOutputsParams(regex="a+", whitespace_pattern=" ?", disable_fallback=True)),
])
def test_the_structured_outputs_object_is_the_constraint(parse, spec, expected):
    assert parsed(parse, structured_outputs=spec).params.structured_outputs == expected


@BOTH
@pytest.mark.parametrize(("spec", "param", "words"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "structured_outputs.json", "nope"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json", "uniqueItems"),  # not enforceable
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": [1]}, "structured_outputs.json", "JSON schema"),
    ({"regex": "("}, "structured_outputs.regex", "unclosed group"),
    ({"regex": "(?=a)b"}, "structured_outputs.regex", "look-around"),
    ({"grammar": "start: ("}, "structured_outputs.grammar", "Expected"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"choice": "yes"}, "structured_outputs.choice", "non-empty list"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag", "structural tag"),
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs", "exactly one"),
    ({}, "structured_outputs", "exactly one"),
    ({"json_object": False}, "structured_outputs", "exactly one"),
    ({"regex": "a", "backend": "xgrammar"}, "structured_outputs.backend", "not a structured_outputs field"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace", "bool"),
    ({"json": {"type": "number", "maximum": math.nan}}, "structured_outputs", "JSON"),
    ("json", "structured_outputs", "object"),
])
def test_a_bad_structured_outputs_object_is_a_400_naming_its_field(parse, spec, param, words):
    refused_as(parse, param, words, structured_outputs=spec)


@BOTH
def test_response_format_json_is_the_constraint(parse):
    """json_object: any JSON object; json_schema: its schema (chat also writes it into the prompt,
    as before); text: nothing."""
    json_schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for response_format, expected in (
        ({"type": "json_object"}, StructuredOutputsParams(json_object=True)),
        (json_schema, StructuredOutputsParams(json=SCHEMA)),
        ({"type": "text"}, None),
        (None, None),
    ):
        request = parsed(parse, response_format=response_format)
        assert request.params.structured_outputs == expected, response_format
        if parse is parse_chat_request:
            assert request.response_format == response_format  # the encoder's schema paragraph
    bad = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}
    refused_as(parse, "response_format.json_schema.schema", "nope", response_format=bad)
    schemaless = {"type": "json_schema", "json_schema": {"name": "a"}}
    refused_as(parse, "response_format.json_schema.schema", "needs the schema", response_format=schemaless)
    for response_format in ({"type": "json_object"}, json_schema):
        refused_as(parse, "structured_outputs", "not both", response_format=response_format,
                   structured_outputs={"regex": "a"})
    text_and_regex = parsed(parse, response_format={"type": "text"}, structured_outputs={"regex": "a"})
    assert text_and_regex.params.structured_outputs == StructuredOutputsParams(regex="a")


@BOTH
@pytest.mark.parametrize(("field", "instead"), [
    ("guided_json", "structured_outputs.json"),
    ("guided_regex", "structured_outputs.regex"),
    ("guided_choice", "structured_outputs.choice"),
    ("guided_grammar", "structured_outputs.grammar"),
    ("guided_json_object", "structured_outputs.json_object"),
    ("guided_whitespace_pattern", "structured_outputs.whitespace_pattern"),
    ("guided_decoding_backend", "--structured-outputs-config"),
    ("guided_options_request", "structured_outputs"),  # any other guided_* field
])
def test_vllms_removed_guided_fields_are_a_400_naming_their_replacement(parse, field, instead):
    """vLLM ignores them silently (an answer without the constraint asked for); here they are a
    400 naming what replaces them (docs/serving.md)."""
    error = refused_as(parse, field, instead, **{field: {"type": "object"} if field == "guided_json" else "x"})
    assert "removed" in error.message
    assert parsed(parse, **{field: None}).params.structured_outputs is None  # null asks for nothing


def test_tool_choice_that_forces_a_call_is_the_tool_call_grammar():
    named = {"type": "function", "function": {"name": "get_weather"}}
    tools = [TOOL, {"type": "function", "function": {"name": "other"}}]
    assert chat(tools=tools, tool_choice="required").params.structured_outputs == \
        StructuredOutputsParams(grammar=tool_call_grammar(tools, None))
    assert chat(tools=tools, tool_choice=named).params.structured_outputs == \
        StructuredOutputsParams(grammar=tool_call_grammar(tools, "get_weather"))
    for choice in ("none", "auto"):  # the model chooses freely
        assert chat(AUTO_TOOLS, tools=tools, tool_choice=choice).params.structured_outputs is None
    assert chat(tools=[], tool_choice="required").params.structured_outputs is None  # "none" (as OpenAI)
    chat_refused("tool_choice", "give one of the two", tools=tools, tool_choice="required",
                 structured_outputs={"regex": "a"})
    chat_refused("tool_choice", "give one of the two", tools=tools, tool_choice=named,
                 response_format={"type": "json_object"})
    assert chat(tools=tools, tool_choice=named, response_format={"type": "text"}).params.structured_outputs == \
        StructuredOutputsParams(grammar=tool_call_grammar(tools, "get_weather"))


def test_a_tool_schema_the_grammar_cannot_enforce_is_a_400_when_a_call_is_forced():
    parameters = {"type": "object", "properties": {"when": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}
    tool = {"type": "function", "function": {"name": "schedule", "parameters": parameters}}
    chat_refused("tools[0].function.parameters.properties.when.anyOf", "not supported", tools=[tool],
                 tool_choice="required")
    for choice in ("none", "auto"):  # nothing to enforce: the schema only goes into the prompt
        assert chat(AUTO_TOOLS, tools=[tool], tool_choice=choice).tools == [tool]


def test_where_the_constraint_came_from_names_the_engines_errors():
    """The engine names a constraint structured_outputs[.<kind>]; its errors (the server passes
    them on as 400s) name the field the request wrote instead."""
    json_schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    assert chat(response_format=json_schema).fields["structured_outputs.json"] == "response_format.json_schema.schema"
    assert chat(response_format={"type": "json_object"}).fields["structured_outputs"] == "response_format"
    assert complete(response_format=json_schema).fields["structured_outputs"] == "response_format"
    assert chat(tools=[TOOL], tool_choice="required").fields["structured_outputs"] == "tool_choice"
    written = chat(structured_outputs={"regex": "a"}).fields
    assert all(written.get(name, name) == name for name in ("structured_outputs", "structured_outputs.regex"))


@BOTH
def test_vllms_token_constraints_and_prompt_truncation(parse):
    params = parsed(parse, allowed_token_ids=[5, 6], bad_words=["Hello", " world"], truncate_prompt_tokens=8).params
    assert params.allowed_token_ids == [5, 6] and params.bad_words == ["Hello", " world"]
    assert params.truncate_prompt_tokens == 8
    assert parsed(parse, truncate_prompt_tokens=-1).params.truncate_prompt_tokens == -1  # vLLM: max_model_len
    assert parsed(parse, bad_words=[]).params.bad_words in (None, [])  # vLLM's default: asks for nothing
    for field, value, words in (
        ("allowed_token_ids", [], "non-empty"),
        ("allowed_token_ids", [VOCAB], "token id"),
        ("allowed_token_ids", [-1], "token id"),
        ("allowed_token_ids", [True], "token id"),
        ("allowed_token_ids", [1.0], "token id"),
        ("allowed_token_ids", "5", "array"),
        ("bad_words", "Hello", "array"),
        ("bad_words", [""], "blank"),
        ("bad_words", ["  "], "blank"),  # tokenizes to nothing once stripped (vLLM's rule)
        ("bad_words", [1], "string"),
        ("truncate_prompt_tokens", 0, ">= 1, or -1"),
        ("truncate_prompt_tokens", -2, ">= -1"),
        ("truncate_prompt_tokens", 1.5, "integer"),
        ("truncate_prompt_tokens", True, "integer"),
        ("truncate_prompt_tokens", "8", "integer"),
    ):
        refused_as(parse, field, words, **{field: value})


# ---- known, unsupported and unknown fields ------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("audio", {"voice": "alloy"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("web_search_options", {}),
        ("use_beam_search", True),
        ("best_of", 2),
        ("echo", True),
        ("prompt_logprobs", 1),
        # vLLM's extra fields: accepted and ignored, they would answer without what they ask.
        ("logits_processors", ["my.module:Processor"]),
        ("priority", 1),
        ("return_token_ids", True),
        ("add_special_tokens", True),  # chat's default is False
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template", "{{ messages }}"),
        ("documents", [{"text": "x"}]),
    ],
)
def test_known_but_unsupported_chat_fields_are_400(field, value):
    chat_refused(field, "not supported by dsv4-jax", **{field: value})


def test_harmless_and_unknown_fields():
    request = chat(
        user="u1",
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        request_id="r1",
        use_beam_search=False,
        modalities=["text"],
        best_of=2,
        n=2,
        echo=False,
        bad_words=[],
        logits_processors=[],
        spaces_between_special_tokens=False,  # the V4 decoder puts no spaces between special tokens
        length_penalty=0.5,  # beam search only
        priority=0.0,
        documents=[],
        return_token_ids=False,
        add_special_tokens=False,
        add_generation_prompt=True,
        continue_final_message=False,
        frobnicate=1,
    )
    assert request.ignored_fields == ("frobnicate",)
    chat_refused("user", "string", user=5)
    assert chat(return_tokens_as_token_ids=True).return_tokens_as_token_ids is True


# ---- completions --------------------------------------------------------------------------------


def test_completion_prompt_shapes():
    assert complete(prompt="a").prompts == ["a"]
    assert complete(prompt=["a", "b"]).prompts == ["a", "b"]
    assert complete(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert complete(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    for prompt, param in (([], "prompt"), (None, "prompt"), ([[]], "prompt[0]"), ([[1], "a"], "prompt[1]")):
        error = refused(parse_completion_request, {"prompt": prompt})
        assert error.param == param, error.body()
    assert "token id" in refused(parse_completion_request, {"prompt": [1, VOCAB]}).message
    assert refused(parse_completion_request, {"prompt": [[1, True]]}).param == "prompt[0]"
    assert refused(parse_completion_request, {}).param == "prompt"


def test_completion_logprobs_echo_and_unsupported():
    assert complete(logprobs=3).params.logprobs == 3
    assert complete(echo=True, logprobs=2).params.prompt_logprobs == 2  # echoed tokens carry logprobs
    assert complete(echo=True, logprobs=2, prompt_logprobs=0).params.prompt_logprobs == 0
    assert complete(logprobs=2).params.prompt_logprobs is None
    for fields, param in (
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream_options": {}}, "stream_options"),
        ({"add_special_tokens": False}, "add_special_tokens"),  # completions' default is True
        ({"add_generation_prompt": False}, None),  # chat-only: unknown here, ignored
    ):
        if param is None:
            assert complete(**fields).ignored_fields == tuple(fields)
            continue
        error = refused(parse_completion_request, {"prompt": "x", **fields})
        assert error.param == param, (fields, error.body())
    assert complete(suffix="", response_format={"type": "text"}, extra=1).ignored_fields == ("extra",)
    assert complete(add_special_tokens=True, bad_words=[], length_penalty=1).ignored_fields == ()
    streamed = complete(stream=True, stream_options={"include_usage": True}, return_tokens_as_token_ids=True)
    assert (streamed.stream, streamed.include_usage, streamed.return_tokens_as_token_ids) == (True, True, True)


# ---- tokenize / detokenize ----------------------------------------------------------------------


def test_tokenize_prompt_or_messages():
    by_prompt = parse_tokenize_request({"prompt": "Hi"}, LIMITS)
    assert (by_prompt.model, by_prompt.prompt, by_prompt.messages, by_prompt.add_special_tokens) == (
        "dsv4",
        "Hi",
        None,
        True,
    )
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "tools": [TOOL]}
    by_chat = parse_tokenize_request({**body, "reasoning_effort": "high", "return_token_strs": True}, LIMITS)
    assert by_chat.prompt is None and by_chat.add_special_tokens is False and by_chat.return_token_strs
    assert (by_chat.messages, by_chat.tools, by_chat.reasoning_effort) == (USER, [TOOL], "high")
    assert parse_tokenize_request({"messages": USER, "add_special_tokens": True}, LIMITS).add_special_tokens
    assert (
        refused(parse_tokenize_request, {"messages": USER, "chat_template_kwargs": 1}).param == "chat_template_kwargs"
    )
    assert refused(parse_tokenize_request, {}).param == "prompt"
    assert refused(parse_tokenize_request, {"prompt": "a", "messages": USER}).param == "prompt"
    assert refused(parse_tokenize_request, {"prompt": 5}).param == "prompt"
    assert refused(parse_tokenize_request, {"messages": USER, "model": "nope"}, status=404).param == "model"
    # Laid out as the chat endpoint would: a layout it does not make is refused, not ignored.
    for field, value in (("add_generation_prompt", False), ("continue_final_message", True), ("chat_template", "x")):
        assert refused(parse_tokenize_request, {"messages": USER, field: value}).param == field
    harmless = parse_tokenize_request({"messages": USER, "add_generation_prompt": True, "documents": []}, LIMITS)
    assert harmless.ignored_fields == ()


def test_detokenize_tokens():
    request = parse_detokenize_request({"tokens": [0, 5, VOCAB - 1], "x": 1}, LIMITS)
    assert (request.model, request.tokens, request.ignored_fields) == ("dsv4", [0, 5, VOCAB - 1], ("x",))
    for tokens in ([VOCAB], [1.0], "1 2", None, [True]):
        assert refused(parse_detokenize_request, {"tokens": tokens}).param == "tokens"


# ---- any input: only OpenAIError ---------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
# Values near what clients send, so that many examples pass and the accepted path is exercised too.
PLAUSIBLE = st.sampled_from(
    [None, 0, 1, -1, 2, 0.5, 1.5, 100, True, False, "", "a", "auto", "none", "required", "text", "max", [], {},
     ["a"], [1, 2], [[1]], {"1": 5}, {"type": "text"}, {"type": "json_object"}, {"include_usage": True},
     {"thinking": False}, {"type": "function", "function": {"name": "get_weather"}}, [TOOL], USER]
)  # fmt: skip
FIELD_VALUES = JSON_VALUES | PLAUSIBLE


def _nested_setters():
    """Places inside a valid chat body where a value may go, besides its top-level fields."""

    def content(body, value):
        body["messages"][0]["content"] = value

    def role(body, value):
        body["messages"][0]["role"] = value

    def part(body, value):
        body["messages"][0]["content"] = ["a", value]

    def extra_message(body, value):
        body["messages"].append(value)

    def assistant_field(body, value):
        body["messages"].append({"role": "assistant", "content": "x", "tool_calls": value, "reasoning": "r"})

    def parameters(body, value):
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": value}}]
        body["tool_choice"] = "none"

    return [content, role, part, extra_message, assistant_field, parameters]


def _only_openai_errors(parse, body, limits):
    try:
        request = parse(body, limits)
    except OpenAIError as error:
        assert error.status in (400, 404), error.body()
        assert error.param is None or isinstance(error.param, str)
        json.dumps(error.body(), allow_nan=False)
        return None
    return request


HYPOTHESIS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARSERS = [parse_chat_request, parse_completion_request, parse_tokenize_request, parse_detokenize_request]


@HYPOTHESIS
@given(
    parse=st.sampled_from(PARSERS),
    body=JSON_VALUES
    | st.dictionaries(st.sampled_from(sorted(CHAT_FIELDS | COMPLETION_FIELDS)), FIELD_VALUES, max_size=6),
)
def test_any_body_gives_a_request_or_an_openai_error(parse, body):  # fmt: skip
    _only_openai_errors(parse, body, AUTO_TOOLS)


@HYPOTHESIS
@given(
    field=st.sampled_from(sorted(CHAT_FIELDS)) | st.sampled_from(_nested_setters()),
    value=FIELD_VALUES,
    limits=st.sampled_from([LIMITS, AUTO_TOOLS]),
)
def test_any_chat_field_value_gives_a_request_or_an_openai_error(field, value, limits):
    body = {"messages": copy.deepcopy(USER), "tools": [TOOL], "tool_choice": "none", "stream": True}
    if callable(field):
        field(body, value)
    else:
        body[field] = value
    request = _only_openai_errors(parse_chat_request, body, limits)
    if request is not None:  # what the parser accepts, the encoder can write
        build_prompt(
            request.messages,
            tools=request.tools,
            response_format=request.response_format,
            chat_template_kwargs=request.chat_template_kwargs,
            reasoning_effort=request.reasoning_effort,
        )


@HYPOTHESIS
@given(
    field=st.sampled_from(sorted(COMPLETION_FIELDS | TOKENIZE_FIELDS | {"tokens"})),
    value=FIELD_VALUES,
    parse=st.sampled_from(PARSERS[1:]),
)
def test_any_other_field_value_gives_a_request_or_an_openai_error(field, value, parse):
    body = {"prompt": "Hi", "tokens": [1, 2], field: value}
    if parse is parse_tokenize_request and field != "messages":
        body.pop("messages", None)
    _only_openai_errors(parse, body, LIMITS)
