"""An llguidance grammar for DeepSeek-V4 tool calls: OpenAI tools (JSON schemas) -> Lark text.

For `tool_choice="required"` or a named function, the model's answer must be a DSML tool-call
block (`encoder.render_tool_calls`) after the blank line that separates it from (here empty)
content. `tool_call_grammar` writes a grammar (llguidance's Lark dialect, docs/syntax.md of
llguidance) whose language is that block with every invoke naming an offered function and every
parameter valid for its function's `parameters` schema:

- only the declared properties, in declaration order, each at most once; all `required` ones;
- a value that may be a string is written raw (`string="true"`): its text is one lexeme, the
  raw text intersected (llguidance's `&`) with its enum / const / minLength / maxLength / pattern
  and with "contains neither `/｜DSML｜parameter` nor the end-of-sentence text" (`~`), followed by
  the closing `</｜DSML｜parameter>` marker. The parser ends a value at the first
  `/｜DSML｜parameter` whatever precedes it, so that substring is what must be kept out;
- every other value is JSON (`string="false"`), an inline `%json {...}` of its sub-schema with
  "string" taken out of its types (strings are always raw, as the encoder writes them); a schema
  that allows strings and other types gets both forms.

Supported keywords (anywhere in `parameters`): type, enum, const, minimum, maximum,
exclusiveMinimum, exclusiveMaximum, minLength, maxLength, pattern, minItems, maxItems, items (one
schema), properties, required, additionalProperties; annotations that change nothing: title,
description, default, examples, $schema, $comment. Anything else (anyOf, oneOf, allOf, not,
$ref, $defs, format, patternProperties, prefixItems, uniqueItems, multipleOf, if/then/else, ...)
raises UnsupportedToolSchema naming the field.

`pattern` keeps JSON Schema's search semantics where it can: a side not anchored by a leading `^`
or trailing `$` gets `.*`; `\\d` and `\\w` are ASCII as in ECMA-262 (llguidance's `regex_to_lark`).
A pattern llguidance cannot compile (lookarounds, backreferences, anchors inside) is refused.
Top-level additionalProperties is accepted but never used: only declared properties are written.

Where the language is narrower than what the parser reads: JSON values are laid out as
`json.dumps` writes them, with or without the spaces after `,` and `:` (`JSON_LAYOUT`; no other
whitespace), and object properties come in schema order (llguidance's `%json`).
Where it is wider, because llguidance's `%json` cannot keep a substring out of JSON strings:
inside a `string="false"` value a JSON string or key may contain `/｜DSML｜parameter` or the
end-of-sentence text, which would end the value early for the parser.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from dsv4_jax.chat.encoder import FORBIDDEN_IN_NAMES, InvalidRequestField
from dsv4_jax.chat.tokens import (
    BLOCK_SEPARATOR,
    DSML,
    EOS,
    INVOKE_END,
    INVOKE_START,
    PARAMETER_END,
    PARAMETER_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
)

JSON_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$comment"})
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems")
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern")
SUPPORTED_KEYWORDS = (
    "type", "enum", "const", *_NUMBER_KEYWORDS, "minLength", "maxLength", "pattern",
    "minItems", "maxItems", "items", "properties", "required", "additionalProperties",
)
# The parser ends a raw value at the first of these (`parser._VALUE_MARKERS`).
_VALUE_STOPS = (f"/{DSML}parameter", EOS)
# The rest of the tags after the names (the encoder's `_render_parameter` / `_render_tool_call`).
_STRING_TRUE = '" string="true">'
_STRING_FALSE = '" string="false">'
_INVOKE_TAG_END = '">\n'
# The layout of JSON values: what `json.dumps` writes (the encoder, the model's training data) or
# the same without the spaces, nothing else. llguidance's default, any whitespace between JSON
# tokens, lets a model that hesitates fill a value with whitespace: random walks through the masks
# spent most of their tokens there.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}


class UnsupportedToolSchema(InvalidRequestField):
    """A tool's `parameters` schema uses a feature the tool-call grammar cannot enforce."""


def _unsupported(path: str, feature: str) -> UnsupportedToolSchema:
    return UnsupportedToolSchema(
        path,
        f"{feature} is not supported in the parameters of a tool that must be called "
        f"(tool_choice 'required' or a named function); supported keywords: "
        f"{', '.join(SUPPORTED_KEYWORDS)} (and the annotations {', '.join(sorted(ANNOTATIONS))})",
    )


# ---- schema checks ------------------------------------------------------------------------------


def _check_schema(schema: Any, path: str) -> None:
    """Raise UnsupportedToolSchema / InvalidRequestField for anything the grammar cannot enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestField(path, f"a JSON schema must be an object or a boolean, got {schema!r:.80}")
    for key, value in schema.items():
        where = f"{path}.{key}"
        if key in ANNOTATIONS:
            continue
        if key not in SUPPORTED_KEYWORDS:
            raise _unsupported(where, f"the JSON schema keyword {key!r}")
        if key == "type":
            types = value if isinstance(value, list) else [value]
            if not types or any(t not in JSON_TYPES for t in types):
                raise InvalidRequestField(where, f"expected one of {list(JSON_TYPES)} or a list of them, got {value!r}")
        elif key == "enum" and (not isinstance(value, list) or not value):
            raise InvalidRequestField(where, f"expected a non-empty list, got {value!r:.80}")
        elif key in _NUMBER_KEYWORDS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidRequestField(where, f"expected a number, got {value!r}")
        elif key in _COUNT_KEYWORDS and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidRequestField(where, f"expected a non-negative integer, got {value!r}")
        elif key == "pattern":
            _check_pattern(value, where)
        elif key == "items":
            if isinstance(value, list):
                raise _unsupported(where, "a list of item schemas (tuple validation)")
            _check_schema(value, where)
        elif key == "additionalProperties":
            _check_schema(value, where)
        elif key == "properties":
            if not isinstance(value, dict):
                raise InvalidRequestField(where, f"expected an object, got {value!r:.80}")
            for name, sub in value.items():
                _check_schema(sub, f"{where}.{name}")
        elif key == "required" and (not isinstance(value, list) or not all(isinstance(n, str) for n in value)):
            raise InvalidRequestField(where, f"expected a list of property names, got {value!r:.80}")


def _grammar_error(lark: str) -> str:
    """llguidance's complaint about a Lark grammar, "" when it compiles."""
    import llguidance  # lazy: only requests that constrain tool calls need it

    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))


# Patterns recur (agents resend the same tools every turn): their checks are kept.
_pattern_error = functools.lru_cache(maxsize=512)(_grammar_error)


def _first_words(error: str) -> str:
    """The gist of an llguidance error (which goes on with the whole grammar) for a 400 message."""
    return " ".join(error.split("\n   1 | ")[0].split())[:300]


def _check_pattern(pattern: Any, path: str) -> None:
    if not isinstance(pattern, str):
        raise InvalidRequestField(path, f"expected a regular expression string, got {pattern!r}")
    # Both forms of the pattern must compile: the raw lexeme's and the one %json builds itself.
    schema = json.dumps({"type": "string", "pattern": pattern})
    error = _pattern_error(f"start: R\nR: /{_search_regex(pattern)}/") or _pattern_error(f"start: %json {schema}")
    if error:
        raise _unsupported(path, f"the pattern {pattern!r} (llguidance cannot compile it: {_first_words(error)})")


# ---- pieces of the grammar ----------------------------------------------------------------------


def _literal(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _search_regex(pattern: str) -> str:
    """A full-match Lark regex body for JSON Schema's search semantics of `pattern`.

    llguidance's lexemes always match whole; a side the pattern leaves unanchored gets `(?s:.*)`.
    A top-level alternation with an anchor on one branch only ends up anchored on all of them,
    which only narrows the language (everything it matches still satisfies the pattern).
    """
    import llguidance

    body = llguidance.regex_to_lark(pattern, "dw")  # escapes `/`; ECMA's ASCII \d and \w
    start = body.startswith("^")
    if start:
        body = body[1:]
    trailing_backslashes = len(body[:-1]) - len(body[:-1].rstrip("\\"))
    end = body.endswith("$") and trailing_backslashes % 2 == 0
    if end:
        body = body[:-1]
    return f"{'' if start else '(?s:.*)'}(?:{body}){'' if end else '(?s:.*)'}"


def _types(schema: dict) -> list[str] | None:
    """The schema's types, None when it names none (every type)."""
    value = schema.get("type")
    return None if value is None else (value if isinstance(value, list) else [value])


def _raw_lexeme(schema: dict) -> str | None:
    """The Lark terminal body of a raw (`string="true"`) value and its closing marker, or None when
    the schema allows no string."""
    types = _types(schema)
    if types is not None and "string" not in types:
        return None
    parts = ["RAW_TEXT"]
    choices = schema.get("enum")
    if "const" in schema:
        choices = [schema["const"]] if choices is None or schema["const"] in choices else []
    if choices is not None:
        # A string holding what ends a raw value cannot be written raw (nor, as a string, as JSON).
        strings = [v for v in choices if isinstance(v, str) and not any(stop in v for stop in _VALUE_STOPS)]
        if not strings:
            return None
        parts.append("(" + " | ".join(_literal(value) for value in strings) + ")")
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if low or high is not None:
        # JSON Schema counts code points; `(?s:.)` is one code point, newlines included.
        parts.append(f"/(?s:.){{{low},{'' if high is None else high}}}/")
    if "pattern" in schema:
        parts.append(f"/{_search_regex(schema['pattern'])}/")
    return f"({' & '.join(parts)}) {_literal(PARAMETER_END)}"


def _clean(schema: Any) -> Any:
    """The schema with annotations dropped, for %json (smaller grammar text, same language)."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key == "properties":
            value = {name: _clean(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            value = _clean(value)
        out[key] = value
    return out


def _json_schema(schema: dict) -> dict | None:
    """The sub-schema of the non-string values (`string="false"`), or None when there are none."""
    types = _types(schema)
    others = [t for t in (types or JSON_TYPES) if t != "string"]
    if not others:
        return None
    out = {key: value for key, value in _clean(schema).items() if key not in _STRING_KEYWORDS}
    out["type"] = others[0] if len(others) == 1 else others
    out["x-guidance"] = JSON_LAYOUT  # read at the top level of each %json only
    if "const" in out and isinstance(out["const"], str):
        return None
    if "enum" in out:
        out["enum"] = [value for value in out["enum"] if not isinstance(value, str)]
        if not out["enum"]:
            return None
    return out


# ---- the grammar ------------------------------------------------------------------------------

# Raw text: valid UTF-8 (`~` alone may match invalid bytes) that never holds what ends a raw value.
_RAW_TEXT_RULE = f"RAW_TEXT: /(?s:.*)/ & ~(/(?s:.*)/ ({' | '.join(map(_literal, _VALUE_STOPS))}) /(?s:.*)/)"


def _callable_tools(tools: list[dict]) -> list[tuple[int, str, str, Any]]:
    """(index, name, path of its function, parameters) of each tool that has a name."""
    found = []
    for i, tool in enumerate(tools):
        function, path = (tool["function"], f"tools[{i}].function") if "function" in tool else (tool, f"tools[{i}]")
        if isinstance(function.get("name"), str):
            found.append((i, function["name"], path, function.get("parameters")))
    return found


def _parameter_forms(key: str, schema: Any, raw_terminal: str) -> tuple[list[str], list[str]]:
    """(terminal rules, alternatives) of one parameter: its raw form, its JSON form, or both."""
    if schema is False:
        return [], []
    schema = {} if schema is True else schema
    raw, as_json = _raw_lexeme(schema), _json_schema(schema)
    terminals, forms = [], []
    if raw is not None:
        terminals.append(f"{raw_terminal}: {raw}")
        forms.append(f"{_literal(f'{PARAMETER_START}{key}{_STRING_TRUE}')} {raw_terminal}")
    if as_json is not None:
        tag = _literal(f"{PARAMETER_START}{key}{_STRING_FALSE}")
        forms.append(f"{tag} %json {json.dumps(as_json)} {_literal(PARAMETER_END)}")
    return terminals, forms


def _invoke_rules(i: int, name: str, path: str, parameters: Any) -> tuple[list[str], dict[str, str]]:
    """The Lark rules of an invoke of function `name` (tool `i`; its rule is `f{i}`), and a
    standalone grammar of each parameter by its field path (to find one llguidance refuses)."""
    path = f"{path}.parameters"
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise _unsupported(path, f"a parameters schema that is not an object schema ({parameters!r:.40})")
    _check_schema(parameters, path)
    if _types(parameters) not in (None, ["object"]):
        raise _unsupported(f"{path}.type", f"parameters of type {parameters['type']!r} (not an object)")
    properties = parameters.get("properties", {})
    required = parameters.get("required", [])
    for key in required:
        if key not in properties:
            raise _unsupported(f"{path}.required", f"a required property {key!r} missing from properties")
    rules, items, pieces = [], [], {}
    for j, (key, schema) in enumerate(properties.items()):
        where = f"{path}.properties.{key}"
        bad = next((text for text in FORBIDDEN_IN_NAMES if text in key), None)
        if bad is not None:
            raise _unsupported(where, f"a property name with {bad!r}, which DSML cannot carry")
        terminals, forms = _parameter_forms(key, schema, f"RAW_{i}_{j}")
        if not forms:
            if key in required:
                raise _unsupported(where, "a required property that no value can satisfy")
            continue  # an optional property that nothing can fill is never written
        rule = f"f{i}_p{j}: {' | '.join(forms)}"
        rules += [*terminals, rule]
        pieces[where] = "\n".join([f"start: f{i}_p{j}", _RAW_TEXT_RULE, *terminals, rule])
        item = f'f{i}_p{j} "\\n"'
        items.append(item if key in required else f"({item})?")
    # `<invoke name="N">\n`, one `parameter\n` per parameter, `</invoke>`; the encoder writes an
    # invoke without parameters with a blank line (`">\n\n</invoke>`), the parser takes both.
    body = " ".join(items)
    if not required:
        body = f'{body} | "\\n"' if body else '"\\n"?'
    rules.append(f"f{i}_body: {body}")
    rules.append(f"f{i}: {_literal(f'{INVOKE_START}{name}{_INVOKE_TAG_END}')} f{i}_body {_literal(INVOKE_END)}")
    return rules, pieces


def tool_call_grammar(tools: list[dict], tool_choice: str | None) -> str:
    """A Lark grammar (llguidance's syntax, the text one passes to llguidance.LLMatcher.grammar_from_lark)
    whose language is exactly the DSML answers `parse_completion` reads as calls of the offered tools:
    "\\n\\n" + the tool-calls block, nothing before or after it.
    tool_choice None = "required": one or more invokes, each of any offered function;
    a function name: exactly one invoke of that function.

    `tools` were checked by `encoder.check_tools`; tools without a name are never offered. Raises
    UnsupportedToolSchema (an InvalidRequestField naming the field) for a schema the grammar cannot
    enforce (the module doc lists what it can), ValueError for a tool_choice that names no tool.
    The grammar is compiled once here (a few milliseconds), so that llguidance's refusals, e.g. an
    unsatisfiable `minimum` > `maximum`, come back naming the parameter.
    """
    offered = _callable_tools(tools)
    if tool_choice is not None:
        offered = [tool for tool in offered if tool[1] == tool_choice]
        if not offered:
            names = [tool[1] for tool in _callable_tools(tools)]
            raise ValueError(f"tool_choice names the function {tool_choice!r}, which is not among the tools {names}")
    if not offered:
        raise ValueError("tool calls are required, but no tool with a name is offered")
    rules, pieces = [], {}
    for i, name, path, parameters in offered:
        invoke, parameter_pieces = _invoke_rules(i, name, path, parameters)
        rules += invoke
        pieces.update(parameter_pieces)
    # Under a named choice there is exactly one invoke; with "required" one or more.
    repeat = "" if tool_choice is not None else "+"
    head = [
        f"start: {_literal(f'{BLOCK_SEPARATOR}{TOOL_CALLS_START}\n')} calls {_literal(TOOL_CALLS_END)}",
        f'calls: (call "\\n"){repeat}',
        f"call: {' | '.join(f'f{i}' for i, *_ in offered)}",
        _RAW_TEXT_RULE,
    ]
    grammar = "\n".join(head + rules) + "\n"
    error = _grammar_error(grammar)
    if error:
        for where, piece in pieces.items():
            reason = _grammar_error(piece)
            if reason:
                raise _unsupported(where, f"this schema (llguidance refuses it: {_first_words(reason)})")
        raise ValueError(f"llguidance refuses the tool-call grammar: {_first_words(error)}")
    return grammar
