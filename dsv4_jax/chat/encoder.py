"""DeepSeek-V4 prompt encoder: OpenAI-style messages -> prompt string (parsing is in `parser`).

V4 ships no Jinja template; this follows its Python encoder (`encoding_dsv4.py`, April release):
system text goes first without a role token, user and developer turns start with `<｜User｜>`,
tool results are folded into user turns as `<tool_result>` blocks, and each user turn that asks
for an answer ends with `<｜Assistant｜>` plus `<think>` (thinking) or `</think>` (no thinking).
Assistant turns are `{reasoning</think>}{content}{\\n\\n DSML tool calls}<｜end▁of▁sentence｜>`.
"""

from __future__ import annotations

import json
from typing import Any

from dsv4_jax.chat.parser import reject_json_constant
from dsv4_jax.chat.tokens import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    INVOKE_END,
    LATEST_REMINDER,
    PARAMETER_END,
    THINK_END,
    THINK_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
    USER,
)

# The fixed texts of the format (checked byte for byte by the golden rows).
MAX_EFFORT_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
TOOLS_SECTION_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    f'writing a "{TOOL_CALLS_START}" block like the following:\n\n'
    f"{TOOL_CALLS_START}\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_END}\n'
    "...\n"
    f"{INVOKE_END}\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"{INVOKE_END}\n"
    f"{TOOL_CALLS_END}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_SECTION_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")  # the April encoder; only "max" adds text


class InvalidRequestField(ValueError):
    """A request field with an unsupported value (the server answers 400 naming `field`).

    `field` is the path of the field in the request, e.g. `messages[2].tool_calls[0].function.name`.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
# DSML writes names raw inside `name="..."`; these could not be parsed back (`<` also rules out
# the special tokens, `｜DSML｜` alone is listed because the parser rejects it in a name too).
FORBIDDEN_IN_NAMES = ('"', "<", ">", "\r", "\n", DSML)


def _to_json(value: Any) -> str:
    # The format's JSON: default separators, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False)


def _text_of(content: Any, path: str = "content") -> str:
    """Message content as text: a string, None, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif not isinstance(part, dict):
                raise InvalidRequestField(f"{path}[{j}]", f"a content part must be an object, got {part!r}")
            elif part.get("type") == "text":
                text = part.get("text")
                if text is not None and not isinstance(text, str):
                    raise InvalidRequestField(f"{path}[{j}].text", f"expected a string, got {text!r}")
                parts.append(text or "")
            else:
                parts.append(f"[Unsupported {part.get('type')}]")
        return "\n\n".join(parts)
    raise InvalidRequestField(path, f"unsupported message content: {content!r}")


def _check_name(name: Any, path: str, *, what: str = "name", allow_empty: bool = False) -> None:
    if not isinstance(name, str) or (not name and not allow_empty):
        kind = "a string" if allow_empty else "a non-empty string"
        raise InvalidRequestField(path, f"{what} must be {kind}, got {name!r}")
    bad = next((text for text in FORBIDDEN_IN_NAMES if text in name), None)
    if bad is not None:
        raise InvalidRequestField(path, f"{what} {name!r} contains {bad!r}, which a DSML tool call cannot carry")


def _check_json(value: Any, path: str, *, allow_nan: bool = True, what: str = "value") -> None:
    try:
        json.dumps(value, allow_nan=allow_nan)
    except (TypeError, ValueError) as error:
        raise InvalidRequestField(path, f"{what} is not representable as JSON: {error}") from None


def check_tools(tools: Any, path: str = "tools") -> None:
    """Raise InvalidRequestField unless `tools` is a list of OpenAI tools the tools section can write."""
    if not isinstance(tools, list):
        raise InvalidRequestField(path, f"expected a list of tools, got {type(tools).__name__}")
    for j, tool in enumerate(tools):
        tool_path = f"{path}[{j}]"
        if not isinstance(tool, dict):
            raise InvalidRequestField(tool_path, f"a tool must be an object, got {tool!r}")
        function, function_path = _function_object(tool, tool_path)
        if function.get("name") is not None:
            _check_name(function["name"], f"{function_path}.name", what="tool name")
        _check_json(function, function_path)


def _function_object(item: dict, path: str) -> tuple[dict, str]:
    """The OpenAI `function` object of a tool or tool call (or the item itself when it is flat)."""
    if "function" not in item:
        return item, path
    function, function_path = item["function"], f"{path}.function"
    if not isinstance(function, dict):
        raise InvalidRequestField(function_path, f"expected an object, got {function!r}")
    return function, function_path


def _tool_call_parts(call: Any, path: str) -> tuple[str, dict]:
    """A tool call's name and arguments object, validated for DSML; InvalidRequestField otherwise."""
    if not isinstance(call, dict):
        raise InvalidRequestField(path, f"a tool call must be an object, got {call!r}")
    function, function_path = _function_object(call, path)
    name = function.get("name")
    _check_name(name, f"{function_path}.name", what="tool name")
    arguments_path = f"{function_path}.arguments"
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=reject_json_constant) if arguments.strip() else {}
        except ValueError as error:
            raise InvalidRequestField(arguments_path, f"not valid JSON: {error}") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise InvalidRequestField(arguments_path, f"tool call arguments must be a JSON object, got {arguments!r}")
    for key, value in arguments.items():
        _check_name(key, arguments_path, what="parameter name", allow_empty=True)
        _check_json(value, arguments_path, allow_nan=False, what=f"parameter {key!r}")
    return name, arguments


def check_messages(messages: Any) -> None:
    """Raise InvalidRequestField (a ValueError naming the field) unless the messages can be encoded.

    Checks the types of every field the encoder reads, the names a DSML tool call writes, and that
    each tool result answers a call of the latest assistant turn with tool calls (by `tool_call_id`).
    """
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestField("messages", f"expected a list of messages, got {type(messages).__name__}")
    call_ids: set[str] = set()  # the ids of the latest assistant tool calls
    for i, message in enumerate(messages):
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestField(path, f"a message must be an object, got {message!r}")
        role = message.get("role")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            choices = list(MESSAGE_ROLES)
            raise InvalidRequestField(f"{path}.role", f"unknown message role {role!r}; use one of {choices}")
        content = _text_of(message.get("content"), f"{path}.content")
        if role == "developer" and not content:
            raise InvalidRequestField(f"{path}.content", "a developer message needs non-empty content")
        if message.get("tools") is not None:
            check_tools(message["tools"], f"{path}.tools")
        response_format = message.get("response_format")
        if response_format is not None:
            if not isinstance(response_format, dict):
                raise InvalidRequestField(f"{path}.response_format", f"expected an object, got {response_format!r}")
            _check_json(response_format, f"{path}.response_format")
        if role == "assistant":
            for key in ("reasoning_content", "reasoning"):
                if message.get(key) is not None and not isinstance(message[key], str):
                    raise InvalidRequestField(f"{path}.{key}", f"expected a string, got {message[key]!r}")
            calls = message.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise InvalidRequestField(f"{path}.tool_calls", f"expected a list, got {calls!r}")
            for j, call in enumerate(calls or []):
                _tool_call_parts(call, f"{path}.tool_calls[{j}]")
                if call.get("id") is not None and not isinstance(call["id"], str):
                    raise InvalidRequestField(f"{path}.tool_calls[{j}].id", f"expected a string, got {call['id']!r}")
            if calls:
                call_ids = {call["id"] for call in calls if call.get("id")}
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise InvalidRequestField(f"{path}.tool_call_id", f"expected a string, got {call_id!r}")
            if (call_id or call_ids) and call_id not in call_ids:
                raise InvalidRequestField(
                    f"{path}.tool_call_id",
                    f"the tool result messages[{i}] has tool_call_id {call_id!r}, which is not the id of a "
                    f"tool call of the latest assistant message with tool calls (ids: {sorted(call_ids)})",
                )


# ---- system-prompt sections -----------------------------------------------------------------------


def render_tools_section(tools: list[dict]) -> str:
    """The tools section: one JSON schema per line (the `function` part of each OpenAI tool)."""
    check_tools(tools)
    schemas = "\n".join(_to_json(tool.get("function", tool)) for tool in tools)
    return TOOLS_SECTION_HEAD + schemas + TOOLS_SECTION_TAIL


def _extra_sections(message: dict) -> str:
    text = ""
    if message.get("tools"):
        text += "\n\n" + render_tools_section(message["tools"])
    if message.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT_HEAD + _to_json(message["response_format"])
    return text


# ---- assistant turns ----------------------------------------------------------------------------


def _render_parameter(key: str, value: Any) -> str:
    if isinstance(value, str):
        return f'<{DSML}parameter name="{key}" string="true">{value}{PARAMETER_END}'
    return f'<{DSML}parameter name="{key}" string="false">{_to_json(value)}{PARAMETER_END}'


def _render_tool_call(call: dict, path: str) -> str:
    name, arguments = _tool_call_parts(call, path)
    parameters = "\n".join(_render_parameter(key, value) for key, value in arguments.items())
    return f'<{DSML}invoke name="{name}">\n{parameters}\n{INVOKE_END}'


def render_tool_calls(tool_calls: list[dict], path: str = "tool_calls") -> str:
    """The DSML block of an assistant turn (without the blank line that precedes it).

    Raises InvalidRequestField (naming `path[j]...`) for a call DSML cannot carry: a missing name,
    a name with `"`, `<`, `>`, CR or LF, non-object or non-JSON arguments (NaN, Infinity).
    """
    calls = "\n".join(_render_tool_call(call, f"{path}[{j}]") for j, call in enumerate(tool_calls))
    return f"{TOOL_CALLS_START}\n{calls}\n{TOOL_CALLS_END}"


def _render_assistant(message: dict, with_reasoning: bool) -> str:
    text = ""
    if with_reasoning:
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        text += reasoning + THINK_END
    text += _text_of(message.get("content"))
    if message.get("tool_calls"):
        text += "\n\n" + render_tool_calls(message["tool_calls"])
    return text + EOS


# ---- preprocessing: tool results into user turns ------------------------------------------------


def _merge_into_user_turns(messages: list[dict]) -> list[dict]:
    """V4 has no tool role: tool results and following user text join the preceding user turn.

    Each user turn becomes `{"role": "user", "blocks": [...]}`; consecutive user messages merge too
    (the official encoder does the same), their blocks joined by a blank line when rendered.
    """
    turns: list[dict] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = {"tool_call_id": message.get("tool_call_id", ""), "content": message.get("content")}
        elif role == "user":
            block = {"text": _text_of(message.get("content"))}
        else:
            turns.append(message)
            continue
        if turns and turns[-1]["role"] == "user":
            turns[-1]["blocks"].append(block)
        else:
            turns.append({"role": "user", "blocks": [block]})
    return turns


def _order_tool_results(turns: list[dict]) -> None:
    """Reorder each user turn's tool results to the order of the latest assistant's tool calls."""
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn.get("tool_calls"):
            call_order = {call["id"]: i for i, call in enumerate(turn["tool_calls"]) if call.get("id")}
        elif turn["role"] == "user":
            slots = [i for i, block in enumerate(turn["blocks"]) if "tool_call_id" in block]
            if len(slots) > 1 and call_order:
                results = [turn["blocks"][i] for i in slots]
                results.sort(key=lambda block: call_order.get(block["tool_call_id"], 0))
                for slot, block in zip(slots, results):
                    turn["blocks"][slot] = block


def _render_user(turn: dict) -> str:
    parts = []
    for block in turn["blocks"]:
        if "tool_call_id" in block:
            parts.append(f"<tool_result>{_text_of(block['content'])}</tool_result>")
        else:
            parts.append(block["text"])
    return USER + "\n\n".join(parts)


def _last_user_index(turns: list[dict]) -> int:
    for i in range(len(turns) - 1, -1, -1):
        if turns[i]["role"] in ("user", "developer"):
            return i
    return -1


def _drop_earlier_developer_turns(turns: list[dict]) -> list[dict]:
    # With thinking dropped, the official encoder also drops developer turns before the last user
    # turn (assistant reasoning there is never rendered anyway).
    last_user = _last_user_index(turns)
    return [turn for i, turn in enumerate(turns) if turn["role"] != "developer" or i >= last_user]


# ---- the encoder --------------------------------------------------------------------------------


def _render_turn(turn: dict, thinking: bool, keep_reasoning: bool) -> str:
    # The messages were checked by `check_messages` before they became turns.
    role = turn.get("role")
    if role == "system":
        return _text_of(turn.get("content")) + _extra_sections(turn)
    if role == "developer":
        return USER + _text_of(turn.get("content")) + _extra_sections(turn)
    if role == "user":
        return _render_user(turn)
    if role == "latest_reminder":
        return LATEST_REMINDER + _text_of(turn.get("content"))
    if role == "assistant":
        return _render_assistant(turn, with_reasoning=thinking and keep_reasoning)
    raise ValueError(f"unknown message role {role!r}")


def encode_messages(
    messages: list[dict],
    thinking_mode: str = "chat",
    drop_thinking: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """The V4 prompt for a conversation, ending with the generation prompt when the last turn asks.

    `drop_thinking` drops reasoning (and developer turns) before the last user turn in thinking mode;
    it is ignored when any message carries `tools`, so multi-step tool use keeps its reasoning.
    Malformed messages raise InvalidRequestField, a ValueError naming the field (see `check_messages`).
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    check_messages(messages)
    thinking = thinking_mode == "thinking"
    turns = _merge_into_user_turns(messages)
    _order_tool_results(turns)
    if any(turn.get("tools") for turn in turns):
        drop_thinking = False
    if thinking and drop_thinking:
        turns = _drop_earlier_developer_turns(turns)
    last_user = _last_user_index(turns)

    prompt = [BOS]
    if thinking and reasoning_effort == "max" and turns:
        prompt.append(MAX_EFFORT_PREFIX)
    for i, turn in enumerate(turns):
        prompt.append(_render_turn(turn, thinking, keep_reasoning=not drop_thinking or i > last_user))
        next_role = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if turn["role"] in ("user", "developer") and next_role in (None, "assistant", "latest_reminder"):
            opens_thinking = thinking and (not drop_thinking or i >= last_user)
            prompt.append(ASSISTANT + (THINK_START if opens_thinking else THINK_END))
    return "".join(prompt)

