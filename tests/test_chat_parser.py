"""The incremental V4 output parser: golden completions however they are split, recovery, malformed DSML."""

import json
import logging
from pathlib import Path

import pytest

from dsv4_jax.chat.parser import (
    ChatStreamParser,
    ContentDelta,
    MessageBuilder,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallFinished,
    ToolCallStarted,
    parse_completion,
)
from dsv4_jax.chat.tokenizer import load_tokenizer

GOLDEN = Path(__file__).resolve().parents[0] / "fixtures/chat/dsv4_chat_vectors.jsonl"
ROWS = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line.strip()]
PARSE_ROWS = [row for row in ROWS if row["kind"] == "parse"]
ROW_IDS = [row["name"] for row in PARSE_ROWS]

EOS = "<｜end▁of▁sentence｜>"
D = "｜DSML｜"
WEATHER_CALL = (
    f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>'
)
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def run_stream(deltas, thinking_mode, strict=False):
    """Feed deltas; return the final message and all events, checking the event order on the way."""
    parser, builder, events = ChatStreamParser(thinking_mode, strict=strict), MessageBuilder(), []
    for delta in deltas:
        events += parser.feed(delta)
    events += parser.finish()
    builder.add(events)
    check_event_order(events, parser.cut_off)
    return builder.message(), events


def check_event_order(events, cut_off=False):
    """Calls open, get arguments and finish in turn; only a call cut off by the end of the text
    may stay open."""
    open_call, started = None, 0
    for event in events:
        if isinstance(event, ToolCallStarted):
            assert open_call is None and event.index == started
            open_call, started = event.index, started + 1
        elif isinstance(event, (ToolCallArguments, ToolCallFinished)):
            assert event.index == open_call
            if isinstance(event, ToolCallFinished):
                open_call = None
        else:
            assert isinstance(event, (ReasoningDelta, ContentDelta)) and event.text
    assert open_call is None or cut_off


@pytest.mark.parametrize("row", PARSE_ROWS, ids=ROW_IDS)
def test_golden_completion(row):
    assert parse_completion(row["text"], row["thinking_mode"]) == row["message"]


@pytest.mark.parametrize("row", PARSE_ROWS, ids=ROW_IDS)
def test_golden_completion_split_at_every_index(row):
    text, mode = row["text"], row["thinking_mode"]
    for cut in range(len(text) + 1):
        message, _ = run_stream([text[:cut], text[cut:]], mode)
        assert message == row["message"], cut


@pytest.mark.parametrize("row", PARSE_ROWS, ids=ROW_IDS)
def test_golden_completion_one_character_at_a_time(row):
    # Every emitted piece is final, so text deltas concatenating to the message's fields shows that
    # no fragment of a special token was ever emitted as text.
    message, events = run_stream(list(row["text"]), row["thinking_mode"])
    assert message == row["message"]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == row["message"]["content"]


def detokenized_deltas(tokenizer, text, tokens_per_delta):
    """Deltas as a server's detokenizer makes them: decode the id prefix, emit the new suffix, and
    hold back a trailing U+FFFD (a character whose UTF-8 bytes are split across tokens)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    deltas, emitted = [], ""
    for end in range(tokens_per_delta, len(ids) + tokens_per_delta, tokens_per_delta):
        decoded = tokenizer.decode(ids[:end], skip_special_tokens=False)
        if decoded.endswith("\ufffd"):
            continue
        assert decoded.startswith(emitted)
        deltas.append(decoded[len(emitted) :])
        emitted = decoded
    assert emitted == text
    return deltas


@pytest.mark.parametrize("tokens_per_delta", [1, 2, 3])
@pytest.mark.parametrize("row", PARSE_ROWS, ids=ROW_IDS)
def test_golden_completion_from_detokenized_tokens(row, tokens_per_delta):
    deltas = detokenized_deltas(load_tokenizer(), row["text"], tokens_per_delta)
    message, events = run_stream(deltas, row["thinking_mode"])
    assert message == parse_completion(row["text"], row["thinking_mode"]) == row["message"]
    for index, call in enumerate(row["message"]["tool_calls"]):
        fragments = [e.fragment for e in events if isinstance(e, ToolCallArguments) and e.index == index]
        assert "".join(fragments) == call["function"]["arguments"]


def test_string_arguments_stream_before_the_parameter_closes():
    parser = ChatStreamParser("chat")
    head = f'\n\n<{D}tool_calls>\n<{D}invoke name="say">\n<{D}parameter name="text" string="true">He said "hi'
    events = parser.feed(head)
    assert events[0] == ToolCallStarted(0, "say")
    assert "".join(e.fragment for e in events[1:]) == '{"text": "He said \\"hi'
    rest = parser.feed(f'"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{EOS}') + parser.finish()
    assert "".join(e.fragment for e in rest if isinstance(e, ToolCallArguments)) == '\\""}'
    assert rest[-1] == ToolCallFinished(0)


def test_possible_marker_prefixes_are_held_back():
    parser = ChatStreamParser("thinking")
    assert parser.feed("Think</thi") == [ReasoningDelta("Think")]
    assert parser.feed("nk>Done\n") == [ContentDelta("Done")]
    assert parser.feed("\n<｜DS") == []
    assert parser.feed("ML｜tool_calls>\n") == []
    assert parser.feed(f"</{D}tool_calls><｜end▁of") == []
    assert parser.feed("▁sentence｜>") == [] and parser.finish() == []


def test_text_that_only_looks_like_a_marker_is_released():
    message, _ = run_stream(["a <b>\n", "x</thin", "g>", "<｜endless", "\n\n", EOS], "chat")
    assert message["content"] == "a <b>\nx</thing><｜endless\n\n"


def test_tool_block_inside_unclosed_reasoning_is_recovered():
    text = "Need weather." + WEATHER_CALL + EOS
    for deltas in ([text], list(text)):
        message, _ = run_stream(deltas, "thinking")
        assert message == {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need weather.",
            "tool_calls": [WEATHER_TOOL],
        }
    with pytest.raises(ValueError):
        parse_completion(text, "thinking")


def test_reasoning_cut_off_stays_reasoning():
    message, _ = run_stream(["still thinking", " ..."], "thinking")
    assert message["reasoning_content"] == "still thinking ..." and message["content"] == ""


def test_tool_block_may_end_the_text_without_eos():
    message = parse_completion("Sure." + WEATHER_CALL, "chat")
    assert message["content"] == "Sure." and message["tool_calls"] == [WEATHER_TOOL]


def test_lenient_mode_ignores_text_after_eos(caplog):
    message, _ = run_stream(["Done." + EOS, "junk"], "chat")
    assert message["content"] == "Done."
    assert "after end-of-sentence" in caplog.text
    with pytest.raises(ValueError):
        parse_completion("Done." + EOS + "junk", "chat")


BLOCK = f"\n\n<{D}tool_calls>\n"
INVOKE_F = f'<{D}invoke name="f">\n'
END = f"</{D}invoke>\n</{D}tool_calls>"
# name: (completion, expected content, expected arguments of the calls that were started)
MALFORMED = {
    "bad_invoke_tag": (f'Hi{BLOCK}<{D}invoke nam="f">\n{END}{EOS}', f'Hi{BLOCK}<{D}invoke nam="f">\n{END}', []),
    "no_newline_after_block_tag": (
        f"Hi\n\n<{D}tool_calls>{INVOKE_F}{END}{EOS}",
        f"Hi\n\n<{D}tool_calls>{INVOKE_F}{END}",
        [],
    ),
    "garbage_between_parameters": (
        f'Hi{BLOCK}{INVOKE_F}<{D}parameter name="a" string="true">x</{D}parameter>oops{END}{EOS}',
        f"Hi</{D}parameter>oops{END}",
        ['{"a": "x"}'],
    ),
    "bad_string_flag": (  # the first parameter tag is malformed, so no call is reported
        f'Hi{BLOCK}{INVOKE_F}<{D}parameter name="a" string="maybe">x</{D}parameter>\n{END}{EOS}',
        f'Hi{BLOCK}{INVOKE_F}<{D}parameter name="a" string="maybe">x</{D}parameter>\n{END}',
        [],
    ),
    "unknown_dsml_tag": (f"Hi\n\n<{D}function_calls>\n{EOS}", f"Hi\n\n<{D}function_calls>\n", []),
    "text_after_block": (f"Hi{WEATHER_CALL}\nmore{EOS}", "Hi\nmore", ['{"city": "Paris"}']),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_dsml_degrades_to_content_with_a_warning(name, caplog):
    text, content, arguments = MALFORMED[name]
    for deltas in ([text], list(text)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dsv4_jax.chat.parser"):
            message, _ = run_stream(deltas, "chat")
        assert caplog.records, "a warning is logged"
        assert message["content"] == content
        assert [call["function"]["arguments"] for call in message["tool_calls"]] == arguments
    with pytest.raises(ValueError):
        parse_completion(text, "chat")


def test_invalid_json_value_becomes_a_string_in_lenient_mode(caplog):
    text = (
        f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="false">3 apples</{D}parameter>\n'
        f"</{D}invoke>\n</{D}tool_calls>{EOS}"
    )
    message, _ = run_stream(list(text), "chat")
    assert message["tool_calls"][0]["function"]["arguments"] == '{"n": "3 apples"}'
    assert "not valid JSON" in caplog.text
    with pytest.raises(ValueError):
        parse_completion(text, "chat")


@pytest.mark.parametrize(
    "text, mode",
    [
        ("no end token", "chat"),
        ("reasoning only" + EOS, "thinking"),
        ("a<think>b" + EOS, "chat"),
        ("a</think>b" + EOS, "chat"),
        (f"a{D}b" + EOS, "chat"),
        (f"a<{D}tool_calls>\n</{D}tool_calls>" + EOS, "chat"),  # the block needs a blank line before it
    ],
)
def test_strict_parse_rejects_format_violations(text, mode):
    with pytest.raises(ValueError):
        parse_completion(text, mode)
    run_stream([text], mode)  # lenient mode never raises


def test_nested_and_non_ascii_arguments_stay_byte_exact():
    arguments = {"q": 'say "hi"\n<tag> 日本 🚀', "n": {"a": [1, 2.5, None, True]}}
    params = "\n".join(
        f'<{D}parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
        f"{v if isinstance(v, str) else json.dumps(v)}</{D}parameter>"
        for k, v in arguments.items()
    )
    text = f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n{params}\n</{D}invoke>\n</{D}tool_calls>{EOS}'
    expected = json.dumps(arguments, ensure_ascii=False)
    assert parse_completion(text)["tool_calls"][0]["function"]["arguments"] == expected
    message, _ = run_stream(list(text), "chat")
    assert message["tool_calls"][0]["function"]["arguments"] == expected


# ---- review fixes: strict JSON arguments, no half-parsed calls, stray DSML, empty blocks, duplicates --


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def strict_json(arguments):
    """Parse as strict JSON: no NaN / Infinity, no duplicate keys."""

    def unique(pairs):
        keys = [key for key, _ in pairs]
        assert len(keys) == len(set(keys)), f"duplicate keys in {arguments!r}"
        return dict(pairs)

    return json.loads(arguments, parse_constant=_reject_constant, object_pairs_hook=unique)


def every_split(text):
    """The text whole, one character at a time, and cut in two at every index."""
    yield [text]
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]


def one_call(params):
    return f"{BLOCK}{INVOKE_F}{params}\n{END}{EOS}"


def param(key, value, string):
    return f'<{D}parameter name="{key}" string="{"true" if string else "false"}">{value}</{D}parameter>'


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "[1, NaN]", '{"x": -Infinity}'])
def test_nan_and_infinity_values_become_strings(raw, caplog):
    text = one_call(param("a", raw, string=False))
    with caplog.at_level(logging.WARNING, logger="dsv4_jax.chat.parser"):
        for deltas in every_split(text):
            message, events = run_stream(deltas, "chat")
            arguments = message["tool_calls"][0]["function"]["arguments"]
            assert strict_json(arguments) == {"a": raw}
            assert "".join(e.fragment for e in events if isinstance(e, ToolCallArguments)) == arguments
    assert "not valid JSON" in caplog.text
    with pytest.raises(ValueError):
        parse_completion(text, "chat")


# name: (completion, expected content, expected names and arguments of the reported calls)
HALF_PARSED = {
    "bad_first_parameter_tag": (
        one_call(f'<{D}parameter name="a" string="yes">1</{D}parameter>'),
        f'{BLOCK}{INVOKE_F}<{D}parameter name="a" string="yes">1</{D}parameter>\n{END}',
        [],
    ),
    "junk_after_invoke_tag": (one_call("oops"), f"{BLOCK}{INVOKE_F}oops\n{END}", []),
    "newline_in_first_parameter_name": (
        one_call(f'<{D}parameter name="a\nb" string="true">1</{D}parameter>'),
        f'{BLOCK}{INVOKE_F}<{D}parameter name="a\nb" string="true">1</{D}parameter>\n{END}',
        [],
    ),
    "parameterless_call_with_junk_before_its_end": (
        f"{BLOCK}{INVOKE_F}\nx</{D}invoke>\n</{D}tool_calls>{EOS}",
        f"{BLOCK}{INVOKE_F}\nx</{D}invoke>\n</{D}tool_calls>",
        [],
    ),
    "second_call_malformed": (
        f'{BLOCK}{INVOKE_F}{param("a", "x", True)}\n</{D}invoke>\n<{D}invoke name="g">\n<{D}parameter nam="b">',
        f'\n<{D}invoke name="g">\n<{D}parameter nam="b">',
        [("f", '{"a": "x"}')],
    ),
}


@pytest.mark.parametrize("name", HALF_PARSED)
def test_malformed_call_is_never_reported(name, caplog):
    text, content, calls = HALF_PARSED[name]
    for deltas in every_split(text):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dsv4_jax.chat.parser"):
            message, events = run_stream(deltas, "chat")
        assert caplog.records, "a warning is logged"
        assert message["content"] == content
        started = [e.name for e in events if isinstance(e, ToolCallStarted)]
        assert started == [n for n, _ in calls]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    with pytest.raises(ValueError):
        parse_completion(text, "chat")


# Text that stops inside a tool-call block (max_tokens or a stop string cut it off): name ->
# (completion, thinking mode, expected reasoning, content, and names and arguments of the calls).
CUT_OFF = {
    "in_the_block_opening": (f"Hi\n\n<{D}tool_c", "chat", "", "Hi", []),
    "in_its_dsml_token": (f"Hi\n\n<｜DS", "chat", "", "Hi", []),
    "after_the_block_opening": (f"Hi{BLOCK}", "chat", "", "Hi", []),
    "after_the_invoke_tag": (f"Hi{BLOCK}{INVOKE_F}", "chat", "", "Hi", []),
    "in_a_string_value": (f'Hi{BLOCK}{INVOKE_F}<{D}parameter name="a" string="true">Par', "chat", "", "Hi",
                          [("f", '{"a": "Par')]),
    "in_its_closing_tag": (f'Hi{BLOCK}{INVOKE_F}<{D}parameter name="a" string="true">Paris</{D}para', "chat", "",
                           "Hi", [("f", '{"a": "Paris')]),
    "in_a_json_value": (f'Hi{BLOCK}{INVOKE_F}<{D}parameter name="a" string="false">12', "chat", "", "Hi",
                        [("f", '{"a": 12')]),
    "after_a_whole_call": (f'{BLOCK}{INVOKE_F}{param("a", "x", True)}\n</{D}invoke>\n<{D}invoke name="g">\n'
                           f'<{D}parameter name="b" string="true">y', "chat", "", "",
                           [("f", '{"a": "x"}'), ("g", '{"b": "y')]),
    "after_the_reasoning": (f"hmm</think>\n\n<{D}tool", "thinking", "hmm", "", []),
    "closed_calls_without_the_block_end": (f'Hi{BLOCK}{INVOKE_F}{param("a", "x", True)}\n</{D}invoke>\n', "chat",
                                           "", "Hi", [("f", '{"a": "x"}')]),
    "in_an_invoke_name": (f'Hi{BLOCK}<{D}invoke name="get_wea', "chat", "", "Hi", []),
    "in_a_parameter_tag": (f'Hi{BLOCK}{INVOKE_F}{param("a", "x", True)}\n<{D}parameter name="b" str', "chat", "",
                           "Hi", [("f", '{"a": "x"')]),
}
# In the text the server parses, the end-of-sentence that stopped the output is never there; a
# decode with special tokens (LLM.chat) has it: cut off just the same wherever the block is open.


@pytest.mark.parametrize("name", CUT_OFF)
def test_a_call_cut_off_by_the_end_of_the_text_is_never_content_and_never_closed(name, caplog):
    """No DSML markup goes out as content, and a call already reported keeps its arguments as far
    as they went, unclosed (OpenAI's truncated arguments with finish_reason "length"), so no client
    runs a call the model never finished; the parser says it was cut off. Strict mode refuses it."""
    text, mode, reasoning, content, calls = CUT_OFF[name]
    for deltas in every_split(text):
        parser, builder = ChatStreamParser(mode, strict=False), MessageBuilder()
        events = [e for delta in deltas for e in parser.feed(delta)] + parser.finish()
        builder.add(events)
        check_event_order(events, cut_off=True)
        message = builder.message()
        assert parser.cut_off and D not in message["content"] + message["reasoning_content"]
        assert (message["reasoning_content"], message["content"]) == (reasoning, content)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    with pytest.raises(ValueError):
        parse_completion(text, mode)



@pytest.mark.parametrize("name", CUT_OFF)
def test_an_end_of_sentence_inside_a_block_cuts_it_off_as_the_end_of_the_text_does(name):
    text, mode, _, _, _ = CUT_OFF[name]
    without, _ = run_stream([text], mode)
    for deltas in every_split(text + EOS + "junk"):
        parser, builder = ChatStreamParser(mode), MessageBuilder()
        events = [e for delta in deltas for e in parser.feed(delta)] + parser.finish()
        builder.add(events)
        check_event_order(events, cut_off=True)
        assert builder.message() == without and parser.cut_off

@pytest.mark.parametrize("text", ["Hi\n\n", "Hi\n\n<", "a < b", "a bar <｜", "Hi\n\n<｜", f"Hi{WEATHER_CALL}"])
def test_text_that_ends_outside_a_block_is_not_cut_off(text):
    for whole in (text, text + EOS):
        for deltas in every_split(whole):
            parser = ChatStreamParser("chat")
            for delta in deltas:
                parser.feed(delta)
            parser.finish()
            assert not parser.cut_off, deltas


def test_a_call_is_reported_once_its_first_parameter_tag_is_read():
    parser = ChatStreamParser("chat")
    assert parser.feed(f'{BLOCK}{INVOKE_F}<{D}parameter name="a" string="true') == []
    assert parser.feed('">') == [ToolCallStarted(0, "f"), ToolCallArguments(0, '{"a": "')]
    parser = ChatStreamParser("chat")
    assert parser.feed(f"{BLOCK}{INVOKE_F}</{D}invoke") == []
    assert parser.feed(">") == [ToolCallStarted(0, "f"), ToolCallArguments(0, "{}"), ToolCallFinished(0)]


@pytest.mark.parametrize(
    "text, mode, expected",
    [
        (f"a{D}b{EOS}", "chat", ("a" + D + "b", "")),
        (f"a <{D}b{EOS}", "chat", (f"a <{D}b", "")),
        (f"r{D}x</think>c{EOS}", "thinking", (f"{D}x</think>c", "r")),
    ],
)
def test_stray_dsml_is_content_however_the_text_is_split(text, mode, expected, caplog):
    content, reasoning = expected
    for deltas in every_split(text):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dsv4_jax.chat.parser"):
            message, events = run_stream(deltas, mode)
        assert (message["content"], message["reasoning_content"]) == (content, reasoning), deltas
        assert message["tool_calls"] == [] and caplog.records
    with pytest.raises(ValueError):
        parse_completion(text, mode)


def test_a_dsml_prefix_is_held_back():
    parser = ChatStreamParser("chat")
    assert parser.feed("a｜DS") == [ContentDelta("a")]
    assert parser.feed("x") == [ContentDelta("｜DSx")]


def test_empty_tool_call_block_is_rejected_in_strict_mode(caplog):
    text = f"Hi\n\n<{D}tool_calls>\n</{D}tool_calls>{EOS}"
    with pytest.raises(ValueError, match="empty"):
        parse_completion(text, "chat")
    message, _ = run_stream([text], "chat")
    assert message["content"] == "Hi" and message["tool_calls"] == []
    assert "empty tool-call block" in caplog.text


@pytest.mark.parametrize(
    "params, arguments",
    [
        ([("a", "x", True), ("a", "y", True)], {"a": "x"}),
        ([("a", "1", False), ("b", "z", True), ("a", "2", False)], {"a": 1, "b": "z"}),
        ([("a", "x", True), ("a", "[1]", False), ("c", "3", False)], {"a": "x", "c": 3}),
    ],
)
def test_duplicate_parameters(params, arguments, caplog):
    text = one_call("\n".join(param(k, v, s) for k, v, s in params))
    with pytest.raises(ValueError, match="duplicate"):
        parse_completion(text, "chat")
    with caplog.at_level(logging.WARNING, logger="dsv4_jax.chat.parser"):
        for deltas in every_split(text):
            message, events = run_stream(deltas, "chat")
            final = message["tool_calls"][0]["function"]["arguments"]
            assert strict_json(final) == arguments
            assert "".join(e.fragment for e in events if isinstance(e, ToolCallArguments)) == final
    assert "duplicate parameter" in caplog.text


@pytest.mark.parametrize("row", PARSE_ROWS, ids=ROW_IDS)
def test_golden_arguments_are_strict_json(row):
    for call in parse_completion(row["text"], row["thinking_mode"])["tool_calls"]:
        strict_json(call["function"]["arguments"])
