"""DeepSeek-V4 chat format: the prompt encoder, the completion parser and the OpenAI request mapping.

`tokens` holds the special-token and DSML texts, `encoder` turns messages into a prompt string,
`parser` turns completion text (streamed or whole) back into reasoning, content and tool calls, and
`request` maps an OpenAI chat request's fields onto the encoder. The public names of all four are
re-exported here.
"""

from dsv4_jax.chat.encoder import (
    MAX_EFFORT_PREFIX,
    MESSAGE_ROLES,
    REASONING_EFFORTS,
    RESPONSE_FORMAT_HEAD,
    THINKING_MODES,
    TOOLS_SECTION_HEAD,
    TOOLS_SECTION_TAIL,
    InvalidRequestField,
    check_messages,
    check_tools,
    encode_messages,
    render_tool_calls,
    render_tools_section,
)
from dsv4_jax.chat.parser import (
    ChatStreamParser,
    ContentDelta,
    MessageBuilder,
    ParseEvent,
    ReasoningDelta,
    ReasoningSplitter,
    ToolCallArguments,
    ToolCallFinished,
    ToolCallStarted,
    chat_message,
    chat_parser,
    parse_completion,
)
from dsv4_jax.chat.request import (
    ChatOptions,
    attach_request_fields,
    build_prompt,
    join_text_parts,
    resolve_chat_options,
)
from dsv4_jax.chat.tokens import (
    ASSISTANT,
    BLOCK_SEPARATOR,
    BOS,
    DSML,
    EOS,
    INVOKE_END,
    INVOKE_START,
    LATEST_REMINDER,
    PARAMETER_END,
    PARAMETER_START,
    THINK_END,
    THINK_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
    USER,
)

__all__ = [
    # tokens
    "ASSISTANT",
    "BLOCK_SEPARATOR",
    "BOS",
    "DSML",
    "EOS",
    "INVOKE_END",
    "INVOKE_START",
    "LATEST_REMINDER",
    "PARAMETER_END",
    "PARAMETER_START",
    "THINK_END",
    "THINK_START",
    "TOOL_CALLS_END",
    "TOOL_CALLS_START",
    "USER",
    # encoder
    "MAX_EFFORT_PREFIX",
    "MESSAGE_ROLES",
    "REASONING_EFFORTS",
    "RESPONSE_FORMAT_HEAD",
    "THINKING_MODES",
    "TOOLS_SECTION_HEAD",
    "TOOLS_SECTION_TAIL",
    "InvalidRequestField",
    "check_messages",
    "check_tools",
    "encode_messages",
    "render_tool_calls",
    "render_tools_section",
    # parser
    "ChatStreamParser",
    "ContentDelta",
    "MessageBuilder",
    "ParseEvent",
    "ReasoningDelta",
    "ReasoningSplitter",
    "ToolCallArguments",
    "ToolCallFinished",
    "ToolCallStarted",
    "chat_message",
    "chat_parser",
    "parse_completion",
    # request
    "ChatOptions",
    "attach_request_fields",
    "build_prompt",
    "join_text_parts",
    "resolve_chat_options",
]
