"""OpenAI chat request -> V4 prompt string and prompt token ids (shared by the server and the API).

Follows vLLM's DeepSeek-V4 mapping: thinking is on unless `chat_template_kwargs` turns it off,
`reasoning_effort` "none" means chat mode, and request-level `tools` / `response_format` go into
the leading system (or developer) message, which is created when there is none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# InvalidRequestField lives with the encoder, which raises it too (request.py imports the encoder,
# so the class cannot live here without an import cycle).
from dsv4_jax.chat.encoder import InvalidRequestField, check_messages, check_tools, encode_messages

# OpenAI effort levels -> the April encoder's levels; it has no "low", so those get no effort line.
_EFFORT_LEVELS: dict[str, str | None] = {"max": "max", "high": "high", "medium": None, "low": None, "minimal": None}


@dataclass(frozen=True)
class ChatOptions:
    thinking_mode: str  # "chat" | "thinking"
    reasoning_effort: str | None  # None | "high" | "max"
    drop_thinking: bool = True


def _bool_kwarg(kwargs: dict[str, Any], name: str) -> bool | None:
    value = kwargs.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestField(f"chat_template_kwargs.{name}", f"expected a boolean, got {value!r}")
    return value


def resolve_chat_options(
    chat_template_kwargs: dict[str, Any] | None = None, reasoning_effort: str | None = None
) -> ChatOptions:
    """Thinking mode, effort level and drop_thinking from the request's fields. The effort is
    `reasoning_effort`, else `chat_template_kwargs["reasoning_effort"]` (as vLLM's V4 template).

    Unsupported values raise InvalidRequestField (a ValueError naming the field).
    """
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise InvalidRequestField("chat_template_kwargs", f"expected an object, got {chat_template_kwargs!r}")
    kwargs = chat_template_kwargs or {}
    effort_field = "reasoning_effort"
    if reasoning_effort is None and kwargs.get("reasoning_effort") is not None:
        # vLLM's V4 template reads it from chat_template_kwargs too; the request's own field wins.
        reasoning_effort, effort_field = kwargs["reasoning_effort"], "chat_template_kwargs.reasoning_effort"
    if reasoning_effort is not None and not isinstance(reasoning_effort, str):
        raise InvalidRequestField(effort_field, f"expected a string, got {reasoning_effort!r}")
    thinking = _bool_kwarg(kwargs, "thinking")
    if thinking is None:
        thinking = _bool_kwarg(kwargs, "enable_thinking")
    if thinking is None:
        thinking = True  # V4 thinks by default, as in vLLM
    drop_thinking = _bool_kwarg(kwargs, "drop_thinking")

    effort: str | None = None
    if reasoning_effort == "none":
        thinking = False
    elif reasoning_effort is not None:
        if reasoning_effort not in _EFFORT_LEVELS:
            choices = ["none", *_EFFORT_LEVELS]
            message = f"unsupported value {reasoning_effort!r}; use one of {choices}"
            raise InvalidRequestField(effort_field, message)
        effort = _EFFORT_LEVELS[reasoning_effort]
    return ChatOptions(
        thinking_mode="thinking" if thinking else "chat",
        reasoning_effort=effort,
        drop_thinking=True if drop_thinking is None else drop_thinking,
    )


def join_text_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose list-of-parts content is one string, text parts joined by a newline, as vLLM
    does before the chat template (DeepSeek's encoder itself would join them with a blank line).
    A non-text part raises InvalidRequestField: this model reads text only."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise InvalidRequestField(f"messages[{i}].content[{j}]",
                                              f"this model takes text only; cannot read a part of type {kind!r}")
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out


def attach_request_fields(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    response_format: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Messages with request-level tools / response_format on the leading system or developer message.

    The input list and its messages are not modified. A `{"type": "text"}` response format asks for
    nothing, so it adds no schema paragraph. Malformed messages, tools or response_format raise
    InvalidRequestField naming the field as the request spells it (before any message is inserted).
    """
    check_messages(messages)
    if tools is not None:
        check_tools(tools, "tools")
    if response_format is not None and not isinstance(response_format, dict):
        raise InvalidRequestField("response_format", f"expected an object, got {response_format!r}")
    if response_format is not None and response_format.get("type") == "text":
        response_format = None
    messages = list(messages)
    if not tools and response_format is None:
        return messages
    if messages and messages[0].get("role") in ("system", "developer"):
        head = dict(messages[0])
    else:
        head = {"role": "system", "content": ""}
        messages.insert(0, head)
    if tools:
        head["tools"] = [*(head.get("tools") or []), *tools]
    if response_format is not None:
        head["response_format"] = response_format
    messages[0] = head
    return messages


def build_prompt(
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    response_format: dict[str, Any] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    reasoning_effort: str | None = None,
) -> str:
    """The V4 prompt string for an OpenAI chat request's fields; InvalidRequestField if malformed."""
    options = resolve_chat_options(chat_template_kwargs, reasoning_effort)
    if isinstance(messages, list):
        messages = join_text_parts(messages)
    return encode_messages(
        attach_request_fields(messages, tools, response_format),
        thinking_mode=options.thinking_mode,
        drop_thinking=options.drop_thinking,
        reasoning_effort=options.reasoning_effort,
    )
