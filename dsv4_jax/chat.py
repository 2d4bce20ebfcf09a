"""DeepSeek-V4 chat format: OpenAI-style messages -> prompt string, completion text -> message.

V4 ships no Jinja template; this follows its Python encoder (`encoding_dsv4.py`, April release):
system text goes first without a role token, user and developer turns start with `<｜User｜>`,
tool results are folded into user turns as `<tool_result>` blocks, and each user turn that asks
for an answer ends with `<｜Assistant｜>` plus `<think>` (thinking) or `</think>` (no thinking).
Assistant turns are `{reasoning</think>}{content}{\\n\\n DSML tool calls}<｜end▁of▁sentence｜>`.
"""

from __future__ import annotations

import json
from typing import Any

from dsv4_jax.chat_parser import (
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
    ChatStreamParser,
    MessageBuilder,
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


def _to_json(value: Any) -> str:
    # The format's JSON: default separators, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False)


def _text_of(content: Any) -> str:
    """Message content as text: a string, None, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif part.get("type") == "text":
                parts.append(part.get("text", ""))
            else:
                parts.append(f"[Unsupported {part.get('type')}]")
        return "\n\n".join(parts)
    raise ValueError(f"unsupported message content: {content!r}")


# ---- system-prompt sections -----------------------------------------------------------------------


def render_tools_section(tools: list[dict]) -> str:
    """The tools section: one JSON schema per line (the `function` part of each OpenAI tool)."""
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


def _render_tool_call(call: dict) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {arguments!r}")
    parameters = "\n".join(_render_parameter(key, value) for key, value in arguments.items())
    return f'<{DSML}invoke name="{function["name"]}">\n{parameters}\n{INVOKE_END}'


def render_tool_calls(tool_calls: list[dict]) -> str:
    """The DSML block of an assistant turn (without the blank line that precedes it)."""
    calls = "\n".join(_render_tool_call(call) for call in tool_calls)
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
    role = turn.get("role")
    if role == "system":
        return _text_of(turn.get("content")) + _extra_sections(turn)
    if role == "developer":
        content = _text_of(turn.get("content"))
        if not content:
            raise ValueError("a developer message needs non-empty content")
        return USER + content + _extra_sections(turn)
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
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
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


def parse_completion(text: str, thinking_mode: str = "chat") -> dict:
    """Strictly parse one complete assistant completion (ending with EOS); ValueError if malformed.

    Returns {"role", "content", "reasoning_content", "tool_calls"}, tool calls as
    {"type": "function", "function": {"name", "arguments"}} with `arguments` a JSON string.
    """
    parser = ChatStreamParser(thinking_mode, strict=True)
    builder = MessageBuilder()
    builder.add(parser.feed(text))
    builder.add(parser.finish())
    return builder.message()
