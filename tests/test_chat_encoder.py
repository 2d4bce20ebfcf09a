"""DeepSeek-V4 prompt encoder: golden prompts, format details, and properties of assistant turns."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_jax.chat import ChatStreamParser, InvalidRequestField, MessageBuilder, encode_messages, parse_completion

GOLDEN = Path(__file__).resolve().parents[0] / "fixtures/chat/dsv4_chat_vectors.jsonl"
ROWS = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line.strip()]
ENCODE_ROWS = [row for row in ROWS if row["kind"] == "encode"]

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TEXTS = (BOS, EOS, "<think>", "</think>", "｜DSML｜")
PROPERTY_SETTINGS = settings(max_examples=50, deadline=None)


@pytest.mark.parametrize("row", ENCODE_ROWS, ids=[row["name"] for row in ENCODE_ROWS])
def test_golden_prompt(row):
    prompt = encode_messages(
        row["messages"],
        thinking_mode=row["thinking_mode"],
        drop_thinking=row["drop_thinking"],
        reasoning_effort=row["reasoning_effort"],
    )
    assert prompt == row["prompt"]


def test_golden_rows_cover_the_format():
    # Guards against a truncated golden file silently shrinking the checks above.
    assert len(ENCODE_ROWS) >= 30 and len(ROWS) - len(ENCODE_ROWS) >= 6


def test_package_never_reads_golden_files():
    sources = sorted((Path(__file__).resolve().parents[1] / "dsv4_jax/chat").rglob("*.py"))
    assert len(sources) >= 5, sources  # the glob found the package
    for path in sources:
        source = path.read_text(encoding="utf-8")
        assert ".jsonl" not in source, path  # golden data is for tests; outside paths: test_repo_paths.py


def test_simplest_prompts():
    hi = [{"role": "user", "content": "Hi"}]
    assert encode_messages(hi, "chat") == f"{BOS}<｜User｜>Hi<｜Assistant｜></think>"
    assert encode_messages(hi, "thinking") == f"{BOS}<｜User｜>Hi<｜Assistant｜><think>"
    assert encode_messages([], "thinking", reasoning_effort="max") == BOS


def test_high_effort_adds_nothing_and_max_needs_thinking():
    hi = [{"role": "user", "content": "Hi"}]
    assert encode_messages(hi, "thinking", reasoning_effort="high") == encode_messages(hi, "thinking")
    assert encode_messages(hi, "chat", reasoning_effort="max") == encode_messages(hi, "chat")


def test_tool_results_follow_call_order_and_merge_with_user_text():
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "y", "type": "function", "function": {"name": "g", "arguments": {"a": 1}}},
            ],
        },
        {"role": "tool", "tool_call_id": "y", "content": "Y"},
        {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": "X"}]},
        {"role": "user", "content": "and?"},
    ]
    prompt = encode_messages(messages, "chat")
    assert prompt.endswith(
        "<｜User｜><tool_result>X</tool_result>\n\n<tool_result>Y</tool_result>\n\nand?<｜Assistant｜></think>"
    )
    assert '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>' in prompt
    assert '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>' in prompt


def test_consecutive_user_messages_join_with_a_blank_line():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_messages(messages, "chat") == f"{BOS}<｜User｜>a\n\nb<｜Assistant｜></think>"


def test_dropped_thinking_drops_earlier_developer_turns_and_reasoning():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
        {"role": "user", "content": "Bye"},
    ]
    dropped = encode_messages(messages, "thinking", drop_thinking=True)
    assert dropped == f"{BOS}<｜User｜>Hi<｜Assistant｜></think>Hello{EOS}<｜User｜>Bye<｜Assistant｜><think>"
    kept = encode_messages(messages, "thinking", drop_thinking=False)
    assert kept == (
        f"{BOS}<｜User｜>Be brief.<｜User｜>Hi<｜Assistant｜><think>greet</think>Hello{EOS}"
        "<｜User｜>Bye<｜Assistant｜><think>"
    )


def test_latest_reminder_follows_the_generation_prompt_of_its_user_turn():
    messages = [{"role": "user", "content": "Hi"}, {"role": "latest_reminder", "content": "Today is Monday."}]
    prompt = encode_messages(messages, "chat")
    assert prompt == f"{BOS}<｜User｜>Hi<｜Assistant｜></think><｜latest_reminder｜>Today is Monday."


@pytest.mark.parametrize(
    "kwargs",
    [{"thinking_mode": "deep"}, {"reasoning_effort": "low"}, {"reasoning_effort": "none"}],
)
def test_rejects_unknown_modes(kwargs):
    with pytest.raises(ValueError):
        encode_messages([{"role": "user", "content": "Hi"}], **kwargs)


def test_rejects_empty_developer_message_and_unknown_roles():
    with pytest.raises(ValueError):
        encode_messages([{"role": "developer", "content": ""}])
    with pytest.raises(ValueError):
        encode_messages([{"role": "critic", "content": "x"}])


# ---- properties of assistant turns ---------------------------------------------------------------

_CHARS = st.one_of(
    st.sampled_from(list("\"'\\\n\t<>/{}[]:, ｜éü日本🚀")),
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
)
safe_text = st.text(_CHARS, max_size=12).filter(lambda s: not any(t in s for t in SPECIAL_TEXTS))
names = st.text(st.one_of(st.sampled_from("_-."), st.characters(categories=("L", "Nd"))), min_size=1, max_size=10)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**9), 10**9)
    | st.floats(allow_nan=False, allow_infinity=False)
    | safe_text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(safe_text, children, max_size=3),
    max_leaves=6,
)
tool_calls = st.lists(st.tuples(names, st.dictionaries(names, json_values, max_size=4)), max_size=3)


@st.composite
def assistant_turns(draw):
    calls = draw(tool_calls)
    message = {"role": "assistant", "content": draw(safe_text), "reasoning_content": draw(safe_text)}
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ]
    return message, calls


@st.composite
def conversations(draw):
    """Conversations that end where the model is asked to answer (a user turn or tool results)."""
    messages = []
    if draw(st.booleans()):
        system = {"role": "system", "content": draw(safe_text)}
        if draw(st.booleans()):
            system["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        messages.append(system)
    messages.append({"role": "user", "content": draw(safe_text)})
    for _ in range(draw(st.integers(0, 2))):
        message, calls = draw(assistant_turns())
        messages.append(message)
        results = [{"role": "tool", "tool_call_id": f"call_{i}", "content": draw(safe_text)} for i in range(len(calls))]
        messages.extend(draw(st.permutations(results)))
        if not calls or draw(st.booleans()):
            messages.append({"role": "user", "content": draw(safe_text)})
    return messages


def expected_assistant_text(message, calls, thinking):
    """An assistant turn as the format writes it (its generation prompt is already in the prefix)."""
    text = message["reasoning_content"] + "</think>" if thinking else ""
    text += message["content"]
    if calls:
        invokes = []
        for name, arguments in calls:
            params = "\n".join(
                f'<｜DSML｜parameter name="{key}" string="true">{value}</｜DSML｜parameter>'
                if isinstance(value, str)
                else f'<｜DSML｜parameter name="{key}" string="false">'
                f"{json.dumps(value, ensure_ascii=False)}</｜DSML｜parameter>"
                for key, value in arguments.items()
            )
            invokes.append(f'<｜DSML｜invoke name="{name}">\n{params}\n</｜DSML｜invoke>')
        text += "\n\n<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"
    return text + EOS


modes = st.sampled_from(["chat", "thinking"])
efforts = st.sampled_from([None, "high", "max"])


@PROPERTY_SETTINGS
@given(conversations(), assistant_turns(), modes, st.booleans(), efforts)
def test_one_more_assistant_turn_extends_the_prompt(conversation, turn, mode, drop_thinking, effort):
    message, calls = turn
    shorter = encode_messages(conversation, mode, drop_thinking, effort)
    longer = encode_messages([*conversation, message], mode, drop_thinking, effort)
    assert shorter.endswith("<｜Assistant｜>" + ("<think>" if mode == "thinking" else "</think>"))
    assert longer == shorter + expected_assistant_text(message, calls, mode == "thinking")


@PROPERTY_SETTINGS
@given(conversations(), assistant_turns(), modes, st.lists(st.integers(0, 400), max_size=6))
def test_rendered_assistant_turn_parses_back(conversation, turn, mode, cuts):
    message, calls = turn
    shorter = encode_messages(conversation, mode)
    completion = encode_messages([*conversation, message], mode)[len(shorter) :]
    expected = {
        "role": "assistant",
        "content": message["content"],
        "reasoning_content": message["reasoning_content"] if mode == "thinking" else "",
        "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in calls
        ],
    }
    assert parse_completion(completion, mode) == expected
    for call, (_, arguments) in zip(expected["tool_calls"], calls):
        assert json.loads(call["function"]["arguments"]) == arguments

    # The lenient streaming parser, fed arbitrary pieces, ends with the same message.
    parser, builder = ChatStreamParser(mode), MessageBuilder()
    bounds = sorted({0, len(completion), *(c for c in cuts if c < len(completion))})
    for start, end in zip(bounds, bounds[1:]):
        builder.add(parser.feed(completion[start:end]))
    builder.add(parser.finish())
    assert builder.message() == expected


# ---- malformed messages: a ValueError naming the field ------------------------------------------

HI = {"role": "user", "content": "Hi"}


def call(name="f", arguments="{}", call_id="c1", **extra):
    function = {"arguments": arguments, **extra}
    if name is not None:
        function["name"] = name
    return {"id": call_id, "type": "function", "function": function}


def assistant(*calls):
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


BAD_MESSAGES = {
    "messages_not_a_list": ({"role": "user", "content": "Hi"}, "messages"),
    "message_not_an_object": ([HI, "Hi"], "messages[1]"),
    "message_without_role": ([HI, {"content": "x"}], "messages[1].role"),
    "unknown_role": ([HI, {"role": "critic", "content": "x"}], "messages[1].role"),
    "unhashable_role": ([{"role": ["user"], "content": "x"}], "messages[0].role"),
    "content_not_text": ([{"role": "user", "content": 3}], "messages[0].content"),
    "content_part_not_an_object": ([{"role": "user", "content": ["a", 3]}], "messages[0].content[1]"),
    "content_part_text_not_a_string": (
        [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}],
        "messages[0].content[0].text",
    ),
    "tools_not_a_list": ([{"role": "system", "content": "", "tools": {"name": "f"}}, HI], "messages[0].tools"),
    "tool_not_an_object": (
        [{"role": "system", "content": "", "tools": [{"name": "f"}, "g"]}, HI],
        "messages[0].tools[1]",
    ),
    "tool_function_not_an_object": (
        [{"role": "system", "content": "", "tools": [{"type": "function", "function": "f"}]}, HI],
        "messages[0].tools[0].function",
    ),
    "response_format_not_an_object": (
        [{"role": "system", "content": "", "response_format": "json_object"}, HI],
        "messages[0].response_format",
    ),
    "tool_calls_not_a_list": (
        [HI, {"role": "assistant", "content": "", "tool_calls": call()}],
        "messages[1].tool_calls",
    ),
    "tool_call_not_an_object": ([HI, assistant(call(), "f")], "messages[1].tool_calls[1]"),
    "tool_call_function_not_an_object": (
        [HI, assistant({"id": "c1", "type": "function", "function": None})],
        "messages[1].tool_calls[0].function",
    ),
    "tool_call_without_name": ([HI, HI, assistant(call(name=None))], "messages[2].tool_calls[0].function.name"),
    "tool_call_name_not_a_string": ([HI, assistant(call(name=7))], "messages[1].tool_calls[0].function.name"),
    "tool_call_id_not_a_string": ([HI, assistant(call(call_id=["c1"]))], "messages[1].tool_calls[0].id"),
    "arguments_not_json": ([HI, assistant(call(arguments="{oops"))], "messages[1].tool_calls[0].function.arguments"),
    "arguments_not_an_object": (
        [HI, assistant(call(arguments="[1]"))],
        "messages[1].tool_calls[0].function.arguments",
    ),
    "arguments_with_nan": (
        [HI, assistant(call(arguments='{"a": NaN}'))],
        "messages[1].tool_calls[0].function.arguments",
    ),
    "arguments_with_infinity_value": (
        [HI, assistant(call(arguments={"a": [float("inf")]}))],
        "messages[1].tool_calls[0].function.arguments",
    ),
    "reasoning_not_a_string": (
        [HI, {"role": "assistant", "content": "x", "reasoning_content": {"a": 1}}],
        "messages[1].reasoning_content",
    ),
    "tool_call_id_of_a_result_not_a_string": (
        [HI, assistant(call()), {"role": "tool", "tool_call_id": 1, "content": "x"}],
        "messages[2].tool_call_id",
    ),
    "empty_developer_message": ([{"role": "developer", "content": ""}, HI], "messages[0].content"),
}


@pytest.mark.parametrize("name", BAD_MESSAGES)
@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_malformed_messages_raise_a_value_error_naming_the_field(name, mode):
    messages, field = BAD_MESSAGES[name]
    with pytest.raises(ValueError) as error:
        encode_messages(messages, mode)
    assert isinstance(error.value, InvalidRequestField) and error.value.field == field
    assert str(error.value).startswith(field + ":")


@pytest.mark.parametrize("bad", ['"', "<", ">", "\r", "\n", "｜DSML｜"])
def test_names_dsml_cannot_carry_are_rejected(bad):
    calls = [call(name="get" + bad + "x")]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.name"):
        encode_messages([HI, assistant(*calls)])
    arguments = json.dumps({"ok": 1, "k" + bad: 2})
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        encode_messages([HI, assistant(call(arguments=arguments))])
    tools = [{"type": "function", "function": {"name": "a" + bad}}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.tools\[0\]\.function\.name"):
        encode_messages([{"role": "system", "content": "", "tools": tools}, HI])


def test_accepted_names_parse_back():
    arguments = {"": 1, "a b/c'd&{}|": "v", "日本": [1]}
    name = "ns.tool-name_日本 'quoted'"
    prompt = encode_messages([HI, assistant(call(name=name, arguments=arguments))])
    completion = prompt[len(encode_messages([HI])) :]
    expected = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    assert parse_completion(completion)["tool_calls"] == [{"type": "function", "function": expected}]


@pytest.mark.parametrize(
    "messages, index",
    [
        (
            [
                HI,
                assistant(call(call_id="a"), call(call_id="b")),
                {"role": "tool", "tool_call_id": "zz", "content": "Z"},
            ],
            2,
        ),
        (
            [
                HI,
                assistant(call(call_id="a"), call(call_id="b")),
                {"role": "tool", "tool_call_id": "b", "content": "B"},
                {"role": "tool", "content": "no id"},
            ],
            3,
        ),
        ([{"role": "tool", "tool_call_id": "a", "content": "A"}, HI], 0),
        (
            [
                HI,
                assistant(call(call_id="a")),
                {"role": "tool", "tool_call_id": "a", "content": "A"},
                assistant(call(call_id="b")),
                {"role": "tool", "tool_call_id": "a", "content": "A again"},
            ],
            4,
        ),
    ],
)
def test_tool_results_with_unknown_ids_are_rejected(messages, index):
    with pytest.raises(ValueError, match=rf"messages\[{index}\]"):
        encode_messages(messages)


def test_tool_results_without_ids_are_fine_when_the_calls_have_none():
    messages = [HI, assistant(call(call_id=None)), {"role": "tool", "content": "R"}]
    assert encode_messages(messages).endswith("<｜User｜><tool_result>R</tool_result><｜Assistant｜></think>")
