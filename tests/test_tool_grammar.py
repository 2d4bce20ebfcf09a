"""The DSML tool-call grammar for llguidance: which answers it accepts, token by token with the real
V4 vocabulary, random walks through its masks read back by the strict parser and checked with
jsonschema, and the schema features it refuses."""

import copy
import json

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from dsv4_jax.chat.encoder import InvalidRequestField, render_tool_calls
from dsv4_jax.chat.parser import parse_completion
from dsv4_jax.chat.tokenizer import load_tokenizer, tokenizer_file
from dsv4_jax.chat.tokens import (
    EOS,
    INVOKE_END,
    PARAMETER_END,
    PARAMETER_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
)
from dsv4_jax.chat.tool_grammar import UnsupportedToolSchema, tool_call_grammar

N_VOCAB = 129280


def tool(name, parameters=None):
    function = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 12, "pattern": "^[A-Z][A-Za-z ]+$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "the unit"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "threshold": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
        "hourly": {"type": "boolean"},
        "note": {"type": "null"},
    },
    "required": ["city", "days"],
})
SEARCH = tool("search", {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 8},
        "filters": {
            "type": "object",
            "properties": {"lang": {"const": "en"}, "year": {"type": "integer", "minimum": 1990, "maximum": 2030}},
            "required": ["year"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "mode": {"const": "fast"},
        "code": {"type": "string", "pattern": "[0-9]", "maxLength": 6},
        "key": {"type": ["string", "integer"], "maxLength": 4, "minimum": 0, "maximum": 9},
    },
    "required": ["query", "filters"],
    "additionalProperties": False,
})
PING = tool("ping")  # no parameters at all
FLAGS = tool("set_flags", {
    "type": "object",
    "title": "flags",
    "properties": {
        "level": {"enum": ["low", 2, None, True]},
        "scale": {"type": ["number", "null"], "minimum": -1.5, "maximum": 1.5},
        "extra": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 3}},
    },
})
TOOLS = [WEATHER, SEARCH, PING, FLAGS]
NOTE = tool("note", {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def answer(*calls):
    """The assistant's answer with tool calls and no content, as the encoder writes it."""
    return "\n\n" + render_tool_calls(list(calls))


@pytest.fixture(scope="module")
def tokenizers():
    tok = load_tokenizer()
    with open(tokenizer_file(), encoding="utf-8") as file:
        ll_tok = llguidance.LLTokenizer(file.read(), n_vocab=N_VOCAB, eos_token=tok.token_to_id(EOS))
    return tok, ll_tok


def new_matcher(tokenizers, tools, choice):
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(tools, choice))
    return llguidance.LLMatcher(tokenizers[1], grammar, log_level=0)


def accepts_ids(tokenizers, tools, choice, ids):
    matcher = new_matcher(tokenizers, tools, choice)
    matcher.consume_tokens(ids)
    return matcher.is_accepting() and not matcher.is_error()


def accepts(tokenizers, tools, choice, text):
    return accepts_ids(tokenizers, tools, choice, tokenizers[0].encode(text, add_special_tokens=False).ids)


def allowed_ids(matcher):
    mask = llguidance.numpy.allocate_token_bitmask(1, N_VOCAB)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    # Bit t % 32 of int32 word t // 32; the words are little-endian in memory.
    bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:N_VOCAB])


@pytest.mark.parametrize("choice", [None, "get_weather", "search", "ping", "set_flags"])
def test_grammar_compiles(choice):
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(TOOLS, choice))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


# ---- accepted answers -----------------------------------------------------------------------------

ACCEPTED = {
    "required_only": answer(call("get_weather", city="Paris", days=3)),
    "every_weather_feature": answer(call(
        "get_weather", city="New York", unit="fahrenheit", days=7, threshold=99.5, hourly=False, note=None)),
    "string_bounds": answer(call("get_weather", city="Ab", days=1), call("get_weather", city="Abcdefghijkl", days=1)),
    "exclusive_bounds_inside": answer(call("get_weather", city="Oslo", days=2, threshold=0.001),
                                      call("get_weather", city="Oslo", days=2, threshold=99.999)),
    "nested_object_and_array": answer(call(
        "search", query="jax", filters={"lang": "en", "year": 2024}, tags=["a", "c"], mode="fast")),
    "optional_nested_skipped": answer(call("search", query="", filters={"year": 1990}, tags=["b", "b", "b"])),
    "pattern_searches_anywhere": answer(call("search", query="q", filters={"year": 2000}, code="ab1cd")),
    "union_raw_string": answer(call("search", query="q", filters={"year": 2000}, key="ab")),
    "union_json_integer": answer(call("search", query="q", filters={"year": 2000}, key=9)),
    "raw_text_with_markup": answer(call("search", query="<a>\n/｜", filters={"year": 2000})),
    "no_parameters": answer(call("ping")),
    "no_parameters_without_blank_line": answer(call("ping")).replace('">\n\n<', '">\n<'),
    "optional_only_all_skipped": answer(call("set_flags")),
    "mixed_enum_raw": answer(call("set_flags", level="low")),
    "mixed_enum_json": answer(call("set_flags", level=2), call("set_flags", level=None), call("set_flags", level=True)),
    "additional_properties_schema": answer(call("set_flags", scale=-1.5, extra={"x": 0, "y": 3})),
    "several_invokes": answer(call("ping"), call("get_weather", city="Rome", days=4), call("ping")),
    "compact_json": answer(call("search", query="q", filters={"year": 2000})).replace(
        '{"year": 2000}', '{"year":2000}'),
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_accepts_valid_answers(tokenizers, name):
    text = ACCEPTED[name]
    assert accepts(tokenizers, TOOLS, None, text)
    # Independently: the strict parser reads them as calls that satisfy the schemas.
    for parsed in parse_completion(text + EOS)["tool_calls"]:
        jsonschema.validate(json.loads(parsed["function"]["arguments"]), parameters_of(parsed["function"]["name"]))


def test_accepts_the_named_function_once(tokenizers):
    assert accepts(tokenizers, TOOLS, "get_weather", answer(call("get_weather", city="Lima", days=5)))
    assert accepts(tokenizers, TOOLS, "ping", answer(call("ping")))
    assert accepts(tokenizers, [PING], None, answer(call("ping"), call("ping")))


# ---- rejected answers -----------------------------------------------------------------------------

GOOD = answer(call("get_weather", city="Paris", unit="celsius", days=3, threshold=5))


def param(key, flag, value):
    return f'{PARAMETER_START}{key}" string="{flag}">{value}{PARAMETER_END}'


REJECTED = {
    "unknown_function": answer(call("get_time", zone="UTC")),
    "missing_required": answer(call("get_weather", city="Paris")),
    "unknown_property": answer(call("get_weather", city="Paris", days=3, wind=True)),
    "out_of_order": answer(call("get_weather", days=3, city="Paris")),
    "duplicate_property": GOOD.replace(
        param("days", "false", 3), param("days", "false", 3) + "\n" + param("days", "false", 4)),
    "integer_above_maximum": answer(call("get_weather", city="Paris", days=8)),
    "integer_below_minimum": answer(call("get_weather", city="Paris", days=0)),
    "integer_as_float": GOOD.replace(param("days", "false", 3), param("days", "false", 3.5)),
    "exclusive_minimum_hit": answer(call("get_weather", city="Paris", days=3, threshold=0)),
    "exclusive_maximum_hit": answer(call("get_weather", city="Paris", days=3, threshold=100)),
    "boolean_wrong_type": answer(call("get_weather", city="Paris", days=3, hourly=1)),
    "null_wrong_type": answer(call("get_weather", city="Paris", days=3, note=0)),
    "string_too_long": answer(call("get_weather", city="Parisssssssss", days=3)),
    "string_too_short": answer(call("get_weather", city="P", days=3)),
    "pattern_mismatch": answer(call("get_weather", city="paris", days=3)),
    "not_in_enum": answer(call("get_weather", city="Paris", unit="kelvin", days=3)),
    "const_mismatch": answer(call("search", query="q", filters={"year": 2000}, mode="slow")),
    "unanchored_pattern_mismatch": answer(call("search", query="q", filters={"year": 2000}, code="abc")),
    "nested_required_missing": answer(call("search", query="q", filters={"lang": "en"})),
    "nested_additional_property": answer(call("search", query="q", filters={"year": 2000, "x": 1})),
    "nested_const_mismatch": answer(call("search", query="q", filters={"lang": "de", "year": 2000})),
    "array_too_short": answer(call("search", query="q", filters={"year": 2000}, tags=[])),
    "array_too_long": answer(call("search", query="q", filters={"year": 2000}, tags=["a", "b", "c", "a"])),
    "array_item_not_in_enum": answer(call("search", query="q", filters={"year": 2000}, tags=["d"])),
    "union_json_out_of_range": answer(call("search", query="q", filters={"year": 2000}, key=10)),
    "union_raw_too_long": answer(call("search", query="q", filters={"year": 2000}, key="abcde")),
    "additional_property_value": answer(call("set_flags", extra={"x": 4})),
    "string_as_json": GOOD.replace(param("city", "true", "Paris"), param("city", "false", '"Paris"')),
    "number_as_raw": GOOD.replace(param("days", "false", 3), param("days", "true", 3)),
    "enum_string_as_json": answer(call("set_flags", level=2)).replace(param("level", "false", 2),
                                                                     param("level", "false", '"low"')),
    "text_before": "Sure." + GOOD,
    "no_blank_line_before": GOOD[2:],
    "text_after": GOOD + "\nDone.",
    "empty_block": f"\n\n{TOOL_CALLS_START}\n{TOOL_CALLS_END}",
    # JSON values keep json.dumps's layout, spaces after `,` and `:` optional (JSON_LAYOUT).
    "pretty_printed_json": answer(call("search", query="q", filters={"year": 2000})).replace(
        '{"year": 2000}', '{\n  "year": 2000\n}'),
    "invoke_without_closing_newline": GOOD.replace(f"\n{INVOKE_END}", INVOKE_END),
}


@pytest.mark.parametrize("name", REJECTED)
def test_rejects_invalid_answers(tokenizers, name):
    assert not accepts(tokenizers, TOOLS, None, REJECTED[name])


def test_the_good_answer_is_accepted(tokenizers):
    # The rejected answers above are edits of this one.
    assert accepts(tokenizers, TOOLS, None, GOOD)


def test_named_choice_rejects_others(tokenizers):
    assert not accepts(tokenizers, TOOLS, "get_weather", answer(call("ping")))
    assert not accepts(tokenizers, TOOLS, "ping", answer(call("ping"), call("ping")))
    assert not accepts(tokenizers, TOOLS, "ping", answer(call("get_weather", city="Paris", days=3)))


def test_raw_values_never_hold_what_ends_them(tokenizers):
    # The parser ends a raw value at the first `/｜DSML｜parameter`, `<` before it or not.
    marker = PARAMETER_END[1:-1]
    for text in (f"a{marker}b", f"a<{marker}b", f"a{PARAMETER_END}b"):
        assert not accepts(tokenizers, [NOTE], None, answer(call("note", text=text)))
    for text in (f"a{marker[:-1]}b", f"a<{marker[1:]}>b", "</p>", "\n\n"):
        assert accepts(tokenizers, [NOTE], None, answer(call("note", text=text)))
        (parsed,) = parse_completion(answer(call("note", text=text)) + EOS)["tool_calls"]
        assert json.loads(parsed["function"]["arguments"]) == {"text": text}


def test_end_of_sentence_text_cannot_be_written_in_a_raw_value(tokenizers):
    # Spelled out in ordinary tokens (the special token itself is never allowed mid-answer).
    tok = tokenizers[0]
    head, tail = answer(call("note", text="aEOSb")).split("EOS")
    pieces = [head, EOS[:6], EOS[6:], tail]
    ids = [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False).ids]
    assert tok.decode(ids, skip_special_tokens=False) == head + EOS + tail
    assert tok.token_to_id(EOS) not in ids
    assert not accepts_ids(tokenizers, [NOTE], None, ids)
    assert accepts(tokenizers, [NOTE], None, answer(call("note", text=EOS[:-1])))


def test_first_mask_allows_only_the_block(tokenizers):
    tok = tokenizers[0]
    first = allowed_ids(new_matcher(tokenizers, TOOLS, None))
    allowed = {tok.decode([int(i)], skip_special_tokens=False) for i in first}
    assert allowed and all(f"\n\n{TOOL_CALLS_START}\n".startswith(text) for text in allowed)


# ---- random walks through the masks ---------------------------------------------------------------

# Texts whose tokens a walk favours inside a raw or a JSON value, so that values close within the cap
# (a JSON value only gets the first token of the closing marker: a JSON string may hold the rest).
CLOSERS = {"raw": [f"{PARAMETER_END}\n"], "json": ['"', "}", "]", PARAMETER_END[:2]]}
WALK_CAP = 400


def parameters_of(name):
    return next(t["function"].get("parameters", {}) for t in TOOLS if t["function"]["name"] == name)


def every_property_required(tool_):
    """The tool with all its properties required, so that a walk writes every feature."""
    tool_ = copy.deepcopy(tool_)
    parameters = tool_["function"].get("parameters")
    if parameters:
        parameters["required"] = list(parameters["properties"])
    return tool_


def value_kind(text):
    """"raw" or "json" when `text` ends inside a parameter value, else None."""
    start = text.rfind(PARAMETER_START)
    if start <= text.rfind(PARAMETER_END) or ">" not in text[start:]:
        return None
    return "raw" if text[start:].split(">", 1)[0].endswith('"true"') else "json"


def walk(tokenizers, tools, choice, seed):
    """Token ids chosen at random among the allowed ones until only EOS is; None at the cap.

    Outside values every allowed token is equally likely (so optional parameters and further
    invokes get their turns); inside a value, half the picks go to its closers when allowed."""
    tok, eos = tokenizers[0], tokenizers[0].token_to_id(EOS)
    closers = {}
    for kind, texts in CLOSERS.items():
        closers[kind] = np.zeros(N_VOCAB, dtype=bool)
        closers[kind][[i for text in texts for i in tok.encode(text, add_special_tokens=False).ids]] = True
    matcher, rng, ids = new_matcher(tokenizers, tools, choice), np.random.default_rng(seed), []
    for _ in range(WALK_CAP):
        allowed = allowed_ids(matcher)
        assert len(allowed) and not matcher.is_error()
        if list(allowed) == [eos]:
            assert matcher.is_accepting()
            return ids
        kind = value_kind(tok.decode(ids, skip_special_tokens=False))
        preferred = allowed[closers[kind][allowed]] if kind else allowed[:0]
        pool = preferred if len(preferred) and rng.random() < 0.5 else allowed[allowed != eos]
        token = int(rng.choice(pool))
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
    return None


WALKS = {
    "required_any_function": (TOOLS, None),
    **{f"all_of_{t['function']['name']}": ([every_property_required(t)], t["function"]["name"]) for t in TOOLS},
}


@pytest.mark.parametrize("walk_name", WALKS)
def test_random_walks_parse_into_valid_calls(tokenizers, walk_name):
    tools, choice = WALKS[walk_name]
    tok = tokenizers[0]
    finished, seeds = 0, range(8)
    for seed in seeds:
        ids = walk(tokenizers, tools, choice, seed)
        if ids is None:
            continue
        finished += 1
        message = parse_completion(tok.decode(ids, skip_special_tokens=False) + EOS)
        assert message["content"] == "" and message["tool_calls"]
        if choice is not None:
            assert [c["function"]["name"] for c in message["tool_calls"]] == [choice]
        for parsed in message["tool_calls"]:
            name = parsed["function"]["name"]
            assert name in {t["function"]["name"] for t in tools}
            arguments = json.loads(parsed["function"]["arguments"])
            jsonschema.validate(arguments, parameters_of(name))
            if choice is not None:  # every property is required there
                assert list(arguments) == list(parameters_of(name).get("properties", {}))
    assert finished >= len(seeds) - 1


# ---- refused schemas and choices ------------------------------------------------------------------

UNSUPPORTED = [
    ("properties.city.anyOf", [{"type": "string"}, {"type": "null"}]),
    ("properties.city.format", "date"),
    ("properties.filters.$ref", "#/$defs/filters"),
    ("properties.filters.patternProperties", {"^x": {"type": "integer"}}),
    ("properties.tags.items.multipleOf", 2),
    ("properties.tags.uniqueItems", True),
    ("properties.tags.prefixItems", [{"type": "string"}]),
    ("oneOf", [{"required": ["city"]}]),
    ("$defs", {"x": {"type": "string"}}),
    ("properties.filters.properties.year.not", {"const": 2000}),
]


def _with(schema, dotted, value):
    schema = copy.deepcopy(schema)
    *path, last = dotted.split(".")
    node = schema
    for key in path:
        node = node.setdefault(key, {})
    node[last] = value
    return schema


@pytest.mark.parametrize("dotted,value", UNSUPPORTED, ids=[d for d, _ in UNSUPPORTED])
def test_unsupported_keyword_names_its_field(dotted, value):
    weird = copy.deepcopy(SEARCH)
    base = _with(SEARCH["function"]["parameters"], "properties.city", {"type": "string"})
    weird["function"]["parameters"] = _with(base, dotted, value)
    with pytest.raises(UnsupportedToolSchema) as raised:
        tool_call_grammar([PING, weird], None)
    keyword = dotted.split(".")[-1]
    assert raised.value.field == f"tools[1].function.parameters.{dotted}"
    assert isinstance(raised.value, InvalidRequestField)
    assert repr(keyword) in str(raised.value) and "minimum" in str(raised.value)


def test_tuple_items_and_uncompilable_patterns_are_refused():
    tuple_items = tool("t", {"type": "object", "properties": {"a": {"type": "array", "items": [{"type": "string"}]}}})
    with pytest.raises(UnsupportedToolSchema) as raised:
        tool_call_grammar([tuple_items], None)
    assert raised.value.field == "tools[0].function.parameters.properties.a.items"
    lookahead = tool("t", {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=x)x$"}}})
    with pytest.raises(UnsupportedToolSchema) as raised:
        tool_call_grammar([lookahead], "t")
    assert raised.value.field == "tools[0].function.parameters.properties.a.pattern"


def test_schemas_llguidance_refuses_name_the_parameter():
    empty_range = {"type": "integer", "minimum": 5, "maximum": 1}
    flat = {"name": "t", "parameters": {"type": "object", "properties": {"a": {"type": "string"}, "b": empty_range}}}
    with pytest.raises(UnsupportedToolSchema) as raised:
        tool_call_grammar([flat], None)
    assert raised.value.field == "tools[0].parameters.properties.b"
    assert "minimum (5) is greater than maximum (1)" in str(raised.value)
    impossible = tool("t", {"type": "object", "properties": {"a": {"type": "string", "enum": [1]}}, "required": ["a"]})
    with pytest.raises(UnsupportedToolSchema, match="no value can satisfy"):
        tool_call_grammar([impossible], None)


def test_unknown_tool_choice_is_a_value_error():
    with pytest.raises(ValueError, match="get_time"):
        tool_call_grammar(TOOLS, "get_time")
