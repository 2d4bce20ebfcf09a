"""Fuzzing what reads untrusted text: the V4 chat encoder, the lenient DSML/reasoning parser and the
server's request validation (serve.protocol), with hypothesis.

The properties:
* the encoder turns any well-formed conversation, whatever its text (special tokens and DSML
  included), into a prompt, and answers any other value with InvalidRequestField only;
* the lenient parser never raises, whatever the model writes and however the text is cut into
  deltas, decides the same message however it is cut, and reads back exactly what a well-formed
  completion (rendered by the encoder's own `render_tool_calls`) holds;
* `parse_*_request` answers every body, arbitrary JSON or a valid body with one field replaced by
  arbitrary JSON, with a typed request or an OpenAIError of status 400/404, never another exception.

CI runs a bounded, derandomized number of examples (no jax, a few seconds); `benchmarks/fuzz.py`
runs the same properties with many more, random ones (it sets DSV4_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_jax.chat import (
    BLOCK_SEPARATOR,
    BOS,
    DSML,
    EOS,
    INVOKE_END,
    INVOKE_START,
    MESSAGE_ROLES,
    PARAMETER_END,
    PARAMETER_START,
    THINK_END,
    THINK_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
    ChatStreamParser,
    InvalidRequestField,
    MessageBuilder,
    encode_messages,
    render_tool_calls,
)
from serve.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    TOKENIZE_FIELDS,
    OpenAIError,
    ServerLimits,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)

EXAMPLES = int(os.environ.get("DSV4_FUZZ_EXAMPLES", "0"))


def fuzz(ci_examples: int) -> settings:
    """CI: a fixed set of `ci_examples` examples (derandomized: a failure reproduces on every run);
    benchmarks/fuzz.py: DSV4_FUZZ_EXAMPLES random ones."""
    return settings(max_examples=EXAMPLES or ci_examples, derandomize=not EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


FUZZ = fuzz(60)
FUZZ_CHEAP = fuzz(400)  # validating a body takes microseconds: many more examples for the same seconds

# Pieces the model's text is built from: every marker of the format, fragments of them, and the
# characters DSML attributes are made of, so random text reaches every state of the parser.
MARKERS = (BOS, EOS, THINK_START, THINK_END, DSML, TOOL_CALLS_START, TOOL_CALLS_END, INVOKE_START, INVOKE_END,
           PARAMETER_START, PARAMETER_END, BLOCK_SEPARATOR, '" string="true">', '" string="false">', '">', "\n",
           "<", "</", "｜", '"', "{", "}", "[1, 2]", "true", "null", "3.5", "é🚀")
model_text = st.lists(st.one_of(st.sampled_from(MARKERS), st.text(max_size=8)), max_size=30).map("".join)
plain_text = st.text(st.characters(blacklist_characters="<｜\r"), max_size=20)  # no marker can form in it
names = st.text(st.characters(whitelist_categories=("Ll", "Lu", "Nd"), whitelist_characters="_"),
                min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# What json.loads gives for arguments: finite floats only survive json.dumps(allow_nan=False).
json_arguments = st.dictionaries(names, st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | plain_text, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=6), max_size=4)


# ---- the encoder ---------------------------------------------------------------------------------------
@st.composite
def conversations(draw) -> list[dict]:
    """Well-formed conversations with arbitrary text: tool results answer the latest tool calls."""
    messages: list[dict] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(("system", "developer"))),
                         "content": draw(model_text.filter(bool))})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(model_text)})
        if draw(st.booleans()):
            calls = [{"id": f"call_{j}", "type": "function",
                      "function": {"name": draw(names), "arguments": json.dumps(draw(json_arguments))}}
                     for j in range(draw(st.integers(0, 2)))]
            messages.append({"role": "assistant", "content": draw(model_text),
                             "reasoning_content": draw(model_text), **({"tool_calls": calls} if calls else {})})
            messages += [{"role": "tool", "tool_call_id": call["id"], "content": draw(model_text)} for call in calls]
    return messages


@FUZZ
@given(conversations(), st.sampled_from(("chat", "thinking")), st.booleans(), st.sampled_from((None, "high", "max")))
def test_encoder_takes_any_text_in_a_well_formed_conversation(messages, mode, drop_thinking, effort):
    prompt = encode_messages(messages, thinking_mode=mode, drop_thinking=drop_thinking, reasoning_effort=effort)
    assert prompt.startswith(BOS)
    for message in messages:
        if message["role"] == "user":
            assert message["content"] in prompt  # text goes in verbatim, never dropped


@FUZZ
@given(st.one_of(json_values, st.lists(json_values, max_size=3),
                 st.lists(st.dictionaries(st.sampled_from(("role", "content", "tool_calls", "tools",
                                                           "reasoning_content", "tool_call_id", "response_format")),
                                          st.one_of(json_values, st.sampled_from(MESSAGE_ROLES)), max_size=4),
                          max_size=3)))
def test_encoder_answers_malformed_messages_with_invalid_request_field_only(messages):
    try:
        prompt = encode_messages(messages)
    except InvalidRequestField as error:
        assert error.field.startswith("messages")
    else:
        assert prompt.startswith(BOS)


# ---- the lenient parser ----------------------------------------------------------------------------------
def _parse(text: str, cuts: list[int], mode: str) -> dict:
    parser, builder = ChatStreamParser(mode, strict=False), MessageBuilder()
    start = 0
    for cut in sorted(c % (len(text) + 1) for c in cuts):
        builder.add(parser.feed(text[start:cut]))
        start = max(start, cut)
    builder.add(parser.feed(text[start:]))
    builder.add(parser.finish())
    return builder.message()


@FUZZ
@given(model_text, st.lists(st.integers(0, 10**4), max_size=8), st.sampled_from(("chat", "thinking")))
def test_lenient_parser_never_raises_and_ignores_how_the_text_is_cut(text, cuts, mode):
    whole = _parse(text, [], mode)
    assert _parse(text, cuts, mode) == whole
    assert _parse(text, list(range(len(text))), mode) == whole  # one character per delta


@FUZZ
@given(plain_text, plain_text, st.lists(st.tuples(names, json_arguments), max_size=3),
       st.lists(st.integers(0, 10**4), max_size=8))
def test_lenient_parser_reads_back_a_well_formed_completion(reasoning, content, calls, cuts):
    tool_calls = [{"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
                  for name, arguments in calls]
    text = reasoning + THINK_END + content
    if tool_calls:
        text += BLOCK_SEPARATOR + render_tool_calls(tool_calls)
    message = _parse(text + EOS, cuts, "thinking")
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert [c["function"]["name"] for c in message["tool_calls"]] == [name for name, _ in calls]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [a for _, a in calls]


# ---- request validation ----------------------------------------------------------------------------------
LIMITS = ServerLimits(served_model_names=("dsv4-test",), vocab_size=129280, enable_auto_tool_choice=True,
                      reasoning_parser="deepseek_v4")
HELLO = [{"role": "user", "content": "Hello"}]
# endpoint parser, a valid body, the fields it reads (each one gets replaced by arbitrary JSON)
ENDPOINTS = {
    "chat": (parse_chat_request, {"model": "dsv4-test", "messages": HELLO, "max_tokens": 4}, sorted(CHAT_FIELDS)),
    "completions": (parse_completion_request, {"model": "dsv4-test", "prompt": "Hi", "max_tokens": 4},
                    sorted(COMPLETION_FIELDS)),
    "tokenize": (parse_tokenize_request, {"model": "dsv4-test", "messages": HELLO}, sorted(TOKENIZE_FIELDS)),
    "detokenize": (parse_detokenize_request, {"model": "dsv4-test", "tokens": [0, 1]}, ["model", "tokens"]),
}


def _answers_400_or_404(endpoint: str, body: object) -> None:
    parse = ENDPOINTS[endpoint][0]
    try:
        parse(body, LIMITS)
    except OpenAIError as error:
        assert error.status in (400, 404), (error.status, error.message)
        assert set(error.body()["error"]) == {"message", "type", "param", "code"}
        json.dumps(error.body())  # the body goes out as JSON


@FUZZ_CHEAP
@given(st.sampled_from(sorted(ENDPOINTS)), json_values)
def test_validation_answers_arbitrary_json_with_400_or_404(endpoint, body):
    _answers_400_or_404(endpoint, body)


@st.composite
def mutated_bodies(draw) -> tuple[str, dict]:
    """A valid body of one endpoint with one to three of its fields set to arbitrary JSON."""
    endpoint = draw(st.sampled_from(sorted(ENDPOINTS)))
    _, body, fields = ENDPOINTS[endpoint]
    body = {**body}
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3)):
        body[name] = draw(json_values)
    return endpoint, body


@FUZZ_CHEAP
@given(mutated_bodies())
def test_validation_answers_a_body_with_bad_fields_with_400_or_404(case):
    _answers_400_or_404(*case)
