"""OpenAI request fields -> V4 prompt, and prompt token ids from the real V4 tokenizer."""

import json
from pathlib import Path

import pytest

from dsv4_jax.chat.encoder import encode_messages
from dsv4_jax.chat.request import (
    ChatOptions,
    InvalidRequestField,
    attach_request_fields,
    build_prompt,
    resolve_chat_options,
)
from dsv4_jax.chat.tokenizer import encode_prompt, load_tokenizer

GOLDEN = Path(__file__).resolve().parents[0] / "fixtures/chat/dsv4_chat_vectors.jsonl"
ROWS = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line.strip()]
ENCODE_ROWS = [row for row in ROWS if row["kind"] == "encode"]

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    "kwargs, effort, expected",
    [
        (None, None, ChatOptions("thinking", None)),  # thinking is on by default
        ({"thinking": False}, None, ChatOptions("chat", None)),
        ({"enable_thinking": False}, None, ChatOptions("chat", None)),
        ({"thinking": True, "enable_thinking": False}, None, ChatOptions("thinking", None)),
        ({"drop_thinking": False}, None, ChatOptions("thinking", None, drop_thinking=False)),
        (None, "none", ChatOptions("chat", None)),
        ({"thinking": True}, "none", ChatOptions("chat", None)),
        (None, "max", ChatOptions("thinking", "max")),
        (None, "high", ChatOptions("thinking", "high")),
        (None, "medium", ChatOptions("thinking", None)),
        (None, "low", ChatOptions("thinking", None)),
        (None, "minimal", ChatOptions("thinking", None)),
        ({"thinking": False}, "max", ChatOptions("chat", "max")),
    ],
)
def test_resolve_chat_options(kwargs, effort, expected):
    assert resolve_chat_options(kwargs, effort) == expected


@pytest.mark.parametrize("effort", ["xhigh", "MAX", "", 3])
def test_unknown_reasoning_effort_is_rejected_naming_the_field(effort):
    with pytest.raises(ValueError, match="reasoning_effort") as error:
        resolve_chat_options(None, effort)
    assert isinstance(error.value, InvalidRequestField) and error.value.field == "reasoning_effort"


def test_reasoning_effort_may_come_in_chat_template_kwargs_and_the_request_field_wins():
    # vLLM's V4 template reads chat_template_kwargs["reasoning_effort"]; the max-effort preamble
    # is what shows that it reached the prompt.
    hi = [{"role": "user", "content": "Hi"}]
    assert resolve_chat_options({"reasoning_effort": "max"}) == ChatOptions("thinking", "max")
    assert resolve_chat_options({"reasoning_effort": "none"}) == ChatOptions("chat", None)
    assert resolve_chat_options({"reasoning_effort": "max"}, "high") == ChatOptions("thinking", "high")
    by_kwargs = build_prompt(hi, chat_template_kwargs={"reasoning_effort": "max"})
    assert by_kwargs == build_prompt(hi, reasoning_effort="max") != build_prompt(hi)
    for bad in ("extreme", 3):
        with pytest.raises(InvalidRequestField) as error:
            resolve_chat_options({"reasoning_effort": bad})
        assert error.value.field == "chat_template_kwargs.reasoning_effort"


def test_non_boolean_thinking_flag_is_rejected():
    with pytest.raises(InvalidRequestField, match="chat_template_kwargs.thinking"):
        resolve_chat_options({"thinking": "false"})


def test_tools_attach_to_the_leading_system_or_developer_message():
    for role in ("system", "developer"):
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        attached = attach_request_fields(messages, tools=[WEATHER], response_format=SCHEMA)
        assert attached[0] == {"role": role, "content": "Be brief.", "tools": [WEATHER], "response_format": SCHEMA}
        assert attached[1:] == messages[1:]
        assert "tools" not in messages[0]  # the request's own messages are left alone


def test_tools_get_a_new_system_message_when_none_leads():
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    attached = attach_request_fields(messages, tools=[WEATHER])
    assert attached == [{"role": "system", "content": "", "tools": [WEATHER]}, *messages]
    assert attach_request_fields(messages) == messages
    assert attach_request_fields(messages, response_format={"type": "text"}) == messages


def test_request_tools_extend_message_tools():
    other = {"type": "function", "function": {"name": "calc"}}
    messages = [{"role": "system", "content": "", "tools": [other]}]
    assert attach_request_fields(messages, tools=[WEATHER])[0]["tools"] == [other, WEATHER]


@pytest.mark.parametrize(
    "row", [r for r in ENCODE_ROWS if r["messages"][0].get("tools")], ids=lambda r: r["name"]
)
def test_request_level_tools_give_the_golden_prompt(row):
    first, *rest = row["messages"]
    tools = first["tools"]
    first = {key: value for key, value in first.items() if key != "tools"}
    prompt = build_prompt(
        [first, *rest],
        tools=tools,
        chat_template_kwargs={"thinking": row["thinking_mode"] == "thinking", "drop_thinking": row["drop_thinking"]},
        reasoning_effort=row["reasoning_effort"],
    )
    assert prompt == row["prompt"]


def test_build_prompt_defaults_to_thinking():
    hi = [{"role": "user", "content": "Hi"}]
    assert build_prompt(hi) == encode_messages(hi, "thinking")
    assert build_prompt(hi, reasoning_effort="none") == encode_messages(hi, "chat")


# ---- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_is_cached_and_has_the_v4_special_ids():
    tokenizer = load_tokenizer()
    assert load_tokenizer() is tokenizer
    texts = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "｜DSML｜", "<think>", "</think>")
    assert [tokenizer.token_to_id(text) for text in texts] == [0, 1, 128825, 128821, 128822]


def test_worked_tokenization_example():
    text = "<｜User｜>你好<｜Assistant｜><think>推理</think>答案<｜end▁of▁sentence｜>"
    ids = load_tokenizer().encode(text, add_special_tokens=False).ids
    assert ids == [128803, 30594, 128804, 128821, 36101, 128822, 7624, 1]


@pytest.mark.parametrize("row", ENCODE_ROWS[:8], ids=lambda r: r["name"])
def test_prompt_ids_start_with_exactly_one_bos(row):
    tokenizer = load_tokenizer()
    ids = encode_prompt(tokenizer, row["prompt"])
    assert ids[0] == 0 and ids.count(0) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == row["prompt"]


def test_one_bos_even_when_the_prompt_text_lacks_or_repeats_it():
    tokenizer = load_tokenizer()
    assert encode_prompt(tokenizer, "<｜User｜>Hi")[:2] == [0, 128803]
    assert encode_prompt(tokenizer, "<｜begin▁of▁sentence｜><｜begin▁of▁sentence｜>Hi")[:2].count(0) == 1


def test_tokenizer_json_in_the_model_directory_wins(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tiny = Tokenizer(WordLevel({"<｜begin▁of▁sentence｜>": 0, "hi": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tiny.pre_tokenizer = Whitespace()
    tiny.add_special_tokens(["<｜begin▁of▁sentence｜>"])
    tiny.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.get_vocab_size() == 3
    assert encode_prompt(loaded, "<｜begin▁of▁sentence｜>hi") == [0, 1]
    assert load_tokenizer(tmp_path / "missing") is load_tokenizer()  # no tokenizer.json: the packaged one


# ---- malformed request fields: ValueError (InvalidRequestField) naming the field, never a 500 ------

HI = {"role": "user", "content": "Hi"}
NAMELESS_CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {}}]}


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"reasoning_effort": ["max"]}, "reasoning_effort"),
        ({"reasoning_effort": {}}, "reasoning_effort"),
        ({"reasoning_effort": True}, "reasoning_effort"),
        ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": 1}}, "chat_template_kwargs.enable_thinking"),
        ({"response_format": "json_object"}, "response_format"),
        ({"response_format": ["text"]}, "response_format"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [WEATHER, "calc"]}, "tools[1]"),
        ({"tools": [WEATHER, {"type": "function", "function": ["calc"]}]}, "tools[1].function"),
        ({"tools": [{"type": "function", "function": {"name": 'get"weather'}}]}, "tools[0].function.name"),
        ({"messages": "Hi"}, "messages"),
        ({"messages": [HI, None]}, "messages[1]"),
        ({"messages": [HI, {"role": "robot", "content": "x"}]}, "messages[1].role"),
        ({"messages": [HI, {"content": "x"}]}, "messages[1].role"),
        ({"messages": [HI, HI, NAMELESS_CALL]}, "messages[2].tool_calls[0].function.name"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, ["b"]]}]}, "messages[0].content[1]"),
        # request tools make a new leading system message: indices still follow the request
        ({"messages": [HI, HI, NAMELESS_CALL], "tools": [WEATHER]}, "messages[2].tool_calls[0].function.name"),
        (
            {"messages": [HI, {"role": "tool", "tool_call_id": "x", "content": ""}], "tools": [WEATHER]},
            "messages[1].tool_call_id",
        ),
    ],
)
def test_malformed_request_fields_raise_a_value_error_naming_the_field(fields, field):
    fields = {"messages": [HI], **fields}
    with pytest.raises(ValueError) as error:
        build_prompt(**fields)
    assert isinstance(error.value, InvalidRequestField) and error.value.field == field
    assert str(error.value).startswith(field + ":")


def test_invalid_request_field_is_one_class_for_encoder_and_request_helpers():
    from dsv4_jax import chat
    from dsv4_jax.chat import encoder

    assert InvalidRequestField is encoder.InvalidRequestField is chat.InvalidRequestField
    assert issubclass(InvalidRequestField, ValueError)


def test_attach_request_fields_checks_its_inputs():
    with pytest.raises(InvalidRequestField, match="response_format"):
        attach_request_fields([HI], response_format="json_object")
    with pytest.raises(InvalidRequestField, match=r"tools\[0\]"):
        attach_request_fields([HI], tools=[None])
    with pytest.raises(InvalidRequestField, match=r"messages\[0\]"):
        attach_request_fields([7], tools=[WEATHER])


def test_a_broken_tokenizer_json_is_one_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_build_prompt_joins_text_parts_with_a_newline_as_vllm_and_refuses_images():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert build_prompt(parts) == build_prompt([{"role": "user", "content": "a\nb"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequestField, match=r"messages\[0\]\.content\[0\].*text only"):
        build_prompt(image)
