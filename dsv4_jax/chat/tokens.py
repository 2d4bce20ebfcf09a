"""The texts of DeepSeek-V4's chat format that the encoder writes and the parser reads back.

The first group are special tokens of the V4 vocabulary (each encodes to one token id); the DSML
markers are built on `｜DSML｜` and spelled out once here so both sides agree byte for byte.
"""

# Special-token texts of the V4 vocabulary that the chat format uses.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# The DSML tool-call markup.
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_START = f'<{DSML}invoke name="'
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_START = f'<{DSML}parameter name="'
PARAMETER_END = f"</{DSML}parameter>"
# Content and the tool-call block are separated by a blank line that belongs to neither.
BLOCK_SEPARATOR = "\n\n"
