"""The one incremental parser for DeepSeek-V4 completions: reasoning, content and DSML tool calls.

Fed the text deltas a detokenizer produces, it emits events (reasoning text, content text, tool call
started / argument fragment / finished). A completion looks like

    [reasoning</think>]content[\\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="N">\\n
    <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>\\n ... </｜DSML｜invoke>\\n
    </｜DSML｜tool_calls>]<｜end▁of▁sentence｜>

(the reasoning part only in thinking mode, whose prompt already ends with `<think>`).

Lenient mode (the server) never raises: malformed DSML degrades to plain content with a logged
warning. Text that stops inside a tool-call block (or inside its opening tag) was cut off (by
max_tokens, a stop string or token, or an end-of-sentence the model wrote there), which is not
malformed: its markup is dropped, never content; a call already reported keeps the arguments
written so far, unclosed (a truncated JSON string, as OpenAI returns with finish_reason "length",
so that no client runs a call the model never finished); `cut_off` and `cut_off_call` say so.
Strict mode (`parse_completion`) raises ValueError on any deviation from the format: all
that the official parser rejects, and also truncated blocks, empty blocks, duplicate parameters and
non-JSON `string="false"` values, which the official parser lets through.
The argument fragments of a call concatenate to its final `arguments` JSON string, which has the
official parser's layout: `{"k": v, "k2": v2}` with `ensure_ascii=False`, and is always strict JSON
(no NaN / Infinity, no duplicate keys), except in a call cut off (above).
A call is reported (ToolCallStarted) only once its invoke tag and its first parameter tag (or the
`</｜DSML｜invoke>` of a call without parameters) are well formed, so a block that is malformed before
that point yields no tool call at all, only content.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass

from dsv4_jax.chat.tokens import (
    BLOCK_SEPARATOR,
    BOS,
    DSML,
    EOS,
    INVOKE_END,
    INVOKE_START,
    PARAMETER_START,
    THINK_END,
    THINK_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallFinished:
    index: int


ParseEvent = ReasoningDelta | ContentDelta | ToolCallStarted | ToolCallArguments | ToolCallFinished


class _State(enum.Enum):
    REASONING = enum.auto()
    CONTENT = enum.auto()
    DEGRADED = enum.auto()  # after malformed DSML: everything up to EOS is plain content
    BLOCK_OPEN = enum.auto()  # after <｜DSML｜tool_calls>, expecting "\n"
    CALL_OR_BLOCK_END = enum.auto()
    INVOKE_NAME = enum.auto()
    FIRST_PARAM_OR_INVOKE_END = enum.auto()
    PARAM_NAME = enum.auto()
    PARAM_VALUE = enum.auto()
    AFTER_PARAM = enum.auto()  # after </｜DSML｜parameter, expecting ">\n"
    NEXT_PARAM_OR_INVOKE_END = enum.auto()
    AFTER_INVOKE = enum.auto()  # after </｜DSML｜invoke>, expecting "\n"
    AFTER_BLOCK = enum.auto()  # after </｜DSML｜tool_calls>, expecting EOS
    DONE = enum.auto()


_TEXT_STATES = (_State.REASONING, _State.CONTENT, _State.DEGRADED)
# Inside a tool-call block, before its closing tag.
_BLOCK_STATES = tuple(s for s in _State if s not in (*_TEXT_STATES, _State.AFTER_BLOCK, _State.DONE))
# Tokens that end or interrupt free text; `｜DSML｜` alone so a stray one is noticed too.
_TEXT_MARKERS = (EOS, BOS, THINK_START, THINK_END, DSML)
# Text that may be the start of one of these is held back until decided.
_TEXT_HOLD = (EOS, BOS, THINK_START, THINK_END, DSML, BLOCK_SEPARATOR + TOOL_CALLS_START, TOOL_CALLS_START)
# As in the official parser, a value ends at the first `/｜DSML｜parameter` (it can never contain one).
_VALUE_END = f"/{DSML}parameter"
_VALUE_MARKERS = (_VALUE_END, EOS)
_VALUE_HOLD = ("<" + _VALUE_END, _VALUE_END, EOS)
_FIRST_PARAM_OR_END = (PARAMETER_START, "\n" + INVOKE_END, INVOKE_END)
_NEXT_PARAM_OR_END = (PARAMETER_START, INVOKE_END)
_STRING_FLAGS = ('" string="true">', '" string="false">')


def _held_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of some marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def _held_len(text: str, markers: tuple[str, ...]) -> int:
    """`_held_suffix_len(text, markers)`, or, when `text` ends with the start of EOS, that start and
    what would be held before it (so an EOS completing it, which may cut a tag off, changes nothing)."""
    held = _held_suffix_len(text, markers)
    cut = text.rfind(EOS[0], max(0, len(text) - len(EOS)))
    if cut >= 0 and EOS.startswith(text[cut:]):
        held = max(held, len(text) - cut + _held_suffix_len(text[:cut], markers))
    return held


def _cut_opening_len(text: str) -> int:
    """Length of the end of `text` that is a tool-call block's opening tag begun and not finished
    (0 for a held "\n\n", "<" or "<｜", which may be text)."""
    held = _held_suffix_len(text, (BLOCK_SEPARATOR + TOOL_CALLS_START, TOOL_CALLS_START))
    return held if TOOL_CALLS_START[:3] in text[len(text) - held:] else 0


def _may_become(text: str, literals: tuple[str, ...]) -> bool:
    """`text` may still become one of `literals` as more arrives, or one of them cut off by an
    end-of-sentence (the start of a literal, then starts of EOS): undecided either way."""
    end = len(text)
    while True:
        head = text[:end]
        if any(literal.startswith(head) for literal in literals):
            return True
        cut = text.rfind(EOS[0], max(0, end - len(EOS)), end)
        if cut < 0 or not EOS.startswith(text[cut:end]):
            return False
        end = cut


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for marker in markers:
        pos = text.find(marker)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, marker)
    return best


def reject_json_constant(name: str) -> None:
    """`parse_constant` for `json.loads`: raise on NaN, Infinity and -Infinity, which are not JSON.

    Shared with the encoder, which checks tool-call arguments with the same strictness.
    """
    raise ValueError(f"{name} is not valid JSON")


def _json_string_body(text: str) -> str:
    # json.dumps escapes character by character, so escaping chunks and concatenating them equals
    # escaping the whole value: that keeps streamed fragments byte-identical to the final string.
    return json.dumps(text, ensure_ascii=False)[1:-1]


class ChatStreamParser:
    """Incremental parser: `feed(delta)` and `finish()` return the events decided so far."""

    def __init__(self, thinking_mode: str = "chat", *, strict: bool = False) -> None:
        if thinking_mode not in ("chat", "thinking"):
            raise ValueError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
        self._strict = strict
        self._state = _State.REASONING if thinking_mode == "thinking" else _State.CONTENT
        self._buf = ""
        self._events: list[ParseEvent] = []
        self._finished = False
        self._num_calls = 0
        self._block_first_call = 0  # _num_calls when the tool-call block opened
        # The name of a call whose invoke tag was read but which is not reported yet (see module doc).
        self._pending_name: str | None = None
        self._call_open = False
        self._param_keys: set[str] = set()
        self._param_key = ""
        self._param_is_string = True
        self._skip_value = False  # a duplicate parameter's value is dropped (lenient mode)
        self._raw_value = ""  # a non-string value is buffered whole, then checked as JSON
        # Raw DSML consumed since the last event: on a lenient failure it becomes content again.
        self._uncommitted = ""
        self._warned_after_eos = False
        self.cut_off = False  # the text stopped inside a tool-call block (lenient mode; module doc)
        self.cut_off_call: int | None = None  # the index of the call it left open, if any

    # ---- public API -----------------------------------------------------------------------------

    def feed(self, delta: str) -> list[ParseEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        self._drain(final=False)
        return self._take_events()

    def finish(self) -> list[ParseEvent]:
        """End of stream: flush held-back text and check the completion ended where it may."""
        if self._finished:
            return []
        self._finished = True
        if not self._strict:
            self._cut_off_block()
        self._drain(final=True)
        if self._state is _State.REASONING and self._strict:
            raise ValueError("invalid completion: reasoning without </think>")
        if self._state is _State.CONTENT and self._strict:
            raise ValueError("invalid completion: missing end-of-sentence token")
        return self._take_events()

    def _cut_off_block(self) -> None:
        """At the end of the text (lenient): a tool-call block, or its opening tag, that the text
        stops inside is cut off."""
        if self._state in (_State.REASONING, _State.CONTENT):
            cut = _cut_opening_len(self._buf)
            if cut:
                self._buf = self._buf[: len(self._buf) - cut]
                self._cut_opening()
        elif self._state in _BLOCK_STATES:
            self._cut_off_here()

    def _cut_opening(self) -> None:
        self.cut_off = True
        logger.info("the output stops inside a tool-call block's opening tag: no call reported")

    def _cut_off_here(self) -> None:
        """The text ends inside a tool-call block (at its end, or at an end-of-sentence): a value
        so far stays in its call's arguments, which stay unclosed; the rest of the markup goes."""
        if self._state is _State.PARAM_VALUE and self._call_open:
            # What follows the value may be the start of its closing tag: that is not the value.
            self._take_value(self._consume(len(self._buf) - _held_suffix_len(self._buf, _VALUE_HOLD)))
            if not self._param_is_string and not self._skip_value:
                self._emit_args(self._next_key_prefix() + self._raw_value)
        self.cut_off = True
        if self._call_open:
            self.cut_off_call = self._num_calls - 1
        logger.info("the output stops inside a tool call: %s", "its arguments end where the text does"
                    if self._call_open else "no call left open")
        self._buf, self._uncommitted, self._state = "", "", _State.DONE

    def _end_block_at_eos(self) -> None:
        """An end-of-sentence in the text ahead while inside a block (lenient): what comes before it
        is parsed, and if the block is still open there, it is cut off (as when the text ends:
        the server's text never holds the EOS that stopped it, a decode with special tokens does)."""
        at = self._buf.index(EOS)
        ahead, self._buf = self._buf[at:], self._buf[:at]
        while self._state in _BLOCK_STATES and self._step(False):
            pass
        if self._state in _BLOCK_STATES:
            self._cut_off_here()
            ahead = ahead[len(EOS):]  # DONE: anything after the EOS is dropped (with a warning)
        self._buf += ahead

    # ---- event helpers --------------------------------------------------------------------------

    def _take_events(self) -> list[ParseEvent]:
        events, self._events = self._events, []
        return events

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        kind = ReasoningDelta if self._state is _State.REASONING else ContentDelta
        # Merge with the previous event of the same kind so a feed returns few, larger deltas.
        if self._events and type(self._events[-1]) is kind:
            text = self._events.pop().text + text
        self._events.append(kind(text))

    def _emit_args(self, fragment: str) -> None:
        index = self._num_calls - 1
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallArguments) and last.index == index:
            fragment = self._events.pop().fragment + fragment
        self._events.append(ToolCallArguments(index, fragment))
        self._uncommitted = ""

    def _problem(self, reason: str) -> None:
        """A deviation from the format that lenient mode tolerates without changing course."""
        if self._strict:
            raise ValueError(f"invalid completion: {reason}")
        logger.warning("DeepSeek-V4 output: %s", reason)

    def _malformed(self, reason: str) -> None:
        """Malformed DSML: raise (strict) or close any open call and pass the rest on as content."""
        if self._strict:
            raise ValueError(f"malformed DSML tool call: {reason}")
        logger.warning("malformed DSML tool call (%s): passing it through as plain content", reason)
        unparsed = self._uncommitted + self._buf
        if self._call_open:
            if self._state is _State.PARAM_VALUE and self._param_is_string and not self._skip_value:
                self._emit_args('"')
            self._close_call()
        self._pending_name, self._skip_value = None, False
        self._buf, self._uncommitted = unparsed, ""
        self._state = _State.DEGRADED

    def _open_call(self) -> None:
        """Report the pending call: its invoke tag and what follows it were well formed."""
        self._events.append(ToolCallStarted(self._num_calls, self._pending_name))
        self._num_calls += 1
        self._pending_name = None
        self._call_open = True
        self._param_keys = set()
        self._emit_args("{")

    def _close_call(self) -> None:
        self._emit_args("}")
        self._events.append(ToolCallFinished(self._num_calls - 1))
        self._call_open = False

    # ---- the state machine ----------------------------------------------------------------------

    def _drain(self, final: bool) -> None:
        while True:
            if not self._strict and self._state in _BLOCK_STATES and EOS in self._buf:
                self._end_block_at_eos()
            if not self._step(final):
                return

    def _step(self, final: bool) -> bool:
        """Advance once; True when input was consumed or the state changed."""
        state = self._state
        if state in _TEXT_STATES:
            return self._step_text(final)
        if state is _State.DONE:
            return self._step_done()
        if state is _State.AFTER_BLOCK:
            return self._step_after_block(final)
        if state is _State.PARAM_VALUE:
            return self._step_param_value(final)
        if state is _State.INVOKE_NAME:
            return self._step_invoke_name(final)
        if state is _State.PARAM_NAME:
            return self._step_param_name(final)
        return self._step_structure(final)

    def _consume(self, size: int) -> str:
        taken, self._buf = self._buf[:size], self._buf[size:]
        return taken

    def _expect(self, alternatives: tuple[str, ...], final: bool) -> str | None:
        """Consume whichever literal the buffer starts with; None while undecided."""
        for literal in alternatives:
            if self._buf.startswith(literal):
                self._uncommitted += self._consume(len(literal))
                return literal
        if not final and _may_become(self._buf, alternatives):
            return None
        shown = self._buf[:40] if self._buf else "end of text"
        self._malformed(f"expected one of {list(alternatives)!r}, got {shown!r}")
        return None

    def _step_text(self, final: bool) -> bool:
        markers = (EOS,) if self._state is _State.DEGRADED else _TEXT_MARKERS
        hit = _first_marker(self._buf, markers)
        if hit is None:
            hold = 0 if final else _held_len(self._buf, _TEXT_HOLD)
            self._emit_text(self._consume(len(self._buf) - hold))
            return False
        pos, marker = hit
        if marker == DSML:
            return self._at_dsml(pos, final)
        cut = _cut_opening_len(self._buf[:pos]) if marker == EOS and not self._strict else 0
        self._emit_text(self._consume(pos - cut))
        if cut:  # an end-of-sentence cut a block's opening tag off (the text ending there would)
            self._consume(cut)
            self._cut_opening()
        self._consume(len(marker))
        if marker == EOS:
            if self._state is _State.REASONING:
                self._problem("end of text inside the reasoning (no </think>)")
            self._state = _State.DONE
        elif marker == THINK_END and self._state is _State.REASONING:
            self._state = _State.CONTENT
        else:
            # BOS, <think>, or a second </think>: special tokens that never belong in the text.
            self._problem(f"unexpected {marker!r} dropped")
        return True

    def _at_dsml(self, pos: int, final: bool) -> bool:
        """A `｜DSML｜` in free text: the start of a tool-call block, or a stray token."""
        start = pos - 1 if pos > 0 and self._buf[pos - 1] == "<" else pos
        rest = self._buf[pos + len(DSML) :]
        tail = TOOL_CALLS_START[1 + len(DSML) :]  # "tool_calls>"
        is_block = start < pos and rest.startswith(tail)
        eos = rest.find(EOS)
        if start < pos and not is_block and eos >= 0 and tail.startswith(rest[:eos]) and not self._strict:
            # An end-of-sentence inside the opening tag: cut off, as if the text ended there.
            cut_from = start - 2 if self._buf[:start].endswith(BLOCK_SEPARATOR) else start
            self._emit_text(self._consume(cut_from))
            self._consume(pos + len(DSML) + eos - cut_from)  # the EOS stays: it ends the text next
            self._cut_opening()
            return True
        if start < pos and not is_block and _may_become(rest, (tail,)) and not final:
            # Undecided: emit the text before, except a blank line that may be the separator.
            before = self._buf[:start]
            self._emit_text(self._consume(start - 2 if before.endswith(BLOCK_SEPARATOR) else start))
            return False
        if not is_block:
            # Not a tool-call block: malformed DSML, so it and the rest become content (lenient).
            self._emit_text(self._consume(start))
            self._uncommitted = ""
            self._malformed(f"stray {DSML!r} in text")
            return True
        before = self._consume(start)
        separator = ""
        if before.endswith(BLOCK_SEPARATOR):
            before, separator = before[: -len(BLOCK_SEPARATOR)], BLOCK_SEPARATOR
        else:
            self._problem("tool-call block not preceded by a blank line")
        if self._state is _State.REASONING:
            # The model opened a tool-call block without closing its reasoning: keep the reasoning
            # and parse the block (strict follows the official parser, which rejects this).
            if self._strict:
                raise ValueError("invalid completion: tool calls inside the reasoning (no </think>)")
            logger.info("tool-call block started before </think>; treating it as tool calls")
        self._emit_text(before)
        self._uncommitted = separator + self._consume(len(TOOL_CALLS_START))
        self._block_first_call = self._num_calls
        self._state = _State.BLOCK_OPEN
        return True

    def _step_structure(self, final: bool) -> bool:
        state = self._state
        if state in (_State.BLOCK_OPEN, _State.AFTER_PARAM, _State.AFTER_INVOKE):
            if self._expect((">\n",) if state is _State.AFTER_PARAM else ("\n",), final) is None:
                return self._state is not state
            self._state = _State.NEXT_PARAM_OR_INVOKE_END if state is _State.AFTER_PARAM else _State.CALL_OR_BLOCK_END
            return True
        if state is _State.CALL_OR_BLOCK_END:
            found = self._expect((INVOKE_START, TOOL_CALLS_END), final)
            if found is None:
                return self._state is not state
            if found == TOOL_CALLS_END and self._num_calls == self._block_first_call:
                self._problem("empty tool-call block")
            self._state = _State.INVOKE_NAME if found == INVOKE_START else _State.AFTER_BLOCK
            return True
        first = state is _State.FIRST_PARAM_OR_INVOKE_END
        found = self._expect(_FIRST_PARAM_OR_END if first else _NEXT_PARAM_OR_END, final)
        if found is None:
            return self._state is not state
        if found == PARAMETER_START:
            self._state = _State.PARAM_NAME
        else:
            if self._pending_name is not None:
                self._open_call()  # a call without parameters
            self._close_call()
            self._state = _State.AFTER_INVOKE
        return True

    def _read_name(self, final: bool) -> str | None:
        """The text before the next `"` of a tag attribute; None while undecided."""
        end = self._buf.find('"')
        head = self._buf if end < 0 else self._buf[:end]
        if "\n" in head or DSML in head or EOS in head:
            self._malformed(f"bad attribute value {head[:40]!r}")
            return None
        if end < 0:
            if final:
                self._malformed("text ends inside a tag")
            return None
        return head

    def _step_invoke_name(self, final: bool) -> bool:
        name = self._read_name(final)
        if name is None:
            return self._state is not _State.INVOKE_NAME
        rest = self._buf[len(name) :]
        closing = '">\n'
        if not rest.startswith(closing):
            if _may_become(rest, (closing,)) and not final:
                return False
            self._malformed(f"bad invoke tag ending {rest[:20]!r}")
            return True
        # Not reported yet: the raw tag stays uncommitted until the first parameter tag is read.
        self._uncommitted += self._consume(len(name) + len(closing))
        self._pending_name = name
        self._state = _State.FIRST_PARAM_OR_INVOKE_END
        return True

    def _step_param_name(self, final: bool) -> bool:
        key = self._read_name(final)
        if key is None:
            return self._state is not _State.PARAM_NAME
        rest = self._buf[len(key) :]
        flag = next((f for f in _STRING_FLAGS if rest.startswith(f)), None)
        if flag is None:
            if _may_become(rest, _STRING_FLAGS) and not final:
                return False
            self._malformed(f"bad parameter tag ending {rest[:20]!r}")
            return True
        self._consume(len(key) + len(flag))
        if self._pending_name is not None:
            self._open_call()
            self._uncommitted = PARAMETER_START  # raw text of this parameter, as for later ones
        # Earlier parameters have already been streamed, so a duplicate cannot replace its first
        # value: lenient mode keeps the first one and drops this one (the JSON keeps unique keys).
        self._skip_value = key in self._param_keys
        if self._skip_value:
            self._problem(f"duplicate parameter {key!r}: keeping its first value")
        self._param_key = key
        self._param_is_string = flag == _STRING_FLAGS[0]
        self._raw_value = ""
        self._state = _State.PARAM_VALUE
        if self._param_is_string and not self._skip_value:
            # A string value streams, so its key and opening quote go out now.
            self._emit_args(self._next_key_prefix() + '"')
        else:
            # Nothing of a non-string parameter goes out before its end; until then it stays raw.
            self._uncommitted += key + flag
        return True

    def _next_key_prefix(self) -> str:
        separator = ", " if self._param_keys else ""
        self._param_keys.add(self._param_key)
        return separator + json.dumps(self._param_key, ensure_ascii=False) + ": "

    def _step_param_value(self, final: bool) -> bool:
        hit = _first_marker(self._buf, _VALUE_MARKERS)
        if hit is None:
            hold = 0 if final else _held_len(self._buf, _VALUE_HOLD)
            self._take_value(self._consume(len(self._buf) - hold))
            if final:
                self._malformed("text ends inside a parameter value")
                return True
            return False
        pos, marker = hit
        closed = marker == _VALUE_END and pos > 0 and self._buf[pos - 1] == "<"
        self._take_value(self._consume(pos - 1 if closed else pos))
        if not closed:
            self._malformed(f"{marker!r} inside a parameter value")
            return True
        closing = self._consume(1 + len(marker))
        self._end_value()
        self._uncommitted = closing
        self._state = _State.AFTER_PARAM
        return True

    def _take_value(self, text: str) -> None:
        if not text:
            return
        if self._param_is_string and not self._skip_value:
            self._emit_args(_json_string_body(text))
        else:
            self._raw_value += text
            self._uncommitted += text

    def _end_value(self) -> None:
        if self._skip_value:
            self._skip_value = False
            return
        if self._param_is_string:
            self._emit_args('"')
            return
        raw = self._raw_value
        try:
            json.loads(raw, parse_constant=reject_json_constant)
        except ValueError:
            # Keep the arguments valid JSON: an unparsable non-string value is passed as a string.
            self._problem(f"parameter {self._param_key!r} is not valid JSON: {raw[:40]!r}")
            raw = json.dumps(raw, ensure_ascii=False)
        # Valid JSON goes in raw, exactly as written, as the official parser does.
        self._emit_args(self._next_key_prefix() + raw)

    def _step_after_block(self, final: bool) -> bool:
        if self._buf.startswith(EOS):
            self._consume(len(EOS))
            self._state = _State.DONE
            return True
        if not self._buf or (EOS.startswith(self._buf) and not final):
            return False  # the official parser also accepts a block that ends the text
        self._problem(f"text after the tool calls: {self._buf[:40]!r}")
        self._state = _State.DEGRADED
        return True

    def _step_done(self) -> bool:
        if self._buf:
            if self._strict:
                raise ValueError(f"invalid completion: text after end-of-sentence: {self._buf[:40]!r}")
            if not self._warned_after_eos:
                logger.warning("DeepSeek-V4 output: ignoring text after end-of-sentence")
                self._warned_after_eos = True
            self._buf = ""
        return False


class ReasoningSplitter:
    """The reasoning split without tool calls (a server's tool_choice "none", or no
    --enable-auto-tool-choice): text up to the model's `</think>` is reasoning, the rest content,
    DSML included. Same interface as ChatStreamParser; a tail that may be the start of `</think>`
    is held back."""

    def __init__(self) -> None:
        self._in_reasoning, self._held = True, ""

    def feed(self, delta: str) -> list[ParseEvent]:
        if not self._in_reasoning:
            return [ContentDelta(delta)] if delta else []
        text = self._held + delta
        end = text.find(THINK_END)
        if end >= 0:
            self._in_reasoning, self._held = False, ""
            rest = text[end + len(THINK_END):]
            return [e for e in (ReasoningDelta(text[:end]), ContentDelta(rest)) if e.text]
        keep = next((k for k in range(min(len(THINK_END) - 1, len(text)), 0, -1) if THINK_END.startswith(text[-k:])), 0)
        self._held = text[len(text) - keep:]
        out = text[: len(text) - keep]
        return [ReasoningDelta(out)] if out else []

    def finish(self) -> list[ParseEvent]:
        held, self._held = self._held, ""
        return [ReasoningDelta(held)] if held else []


def chat_parser(tools_active: bool, split_reasoning: bool) -> ChatStreamParser | ReasoningSplitter | None:
    """The parser one chat completion's text goes through, the one choice for the server and
    `LLM.chat`: tool calls are parsed only when the request may make them (`tools_active`), the
    reasoning split only in thinking mode with a reasoning parser (`split_reasoning`); None when
    neither applies (all text is content, as vLLM without its parsers)."""
    if tools_active:
        return ChatStreamParser("thinking" if split_reasoning else "chat", strict=False)
    return ReasoningSplitter() if split_reasoning else None


class MessageBuilder:
    """Folds parser events into an OpenAI-style assistant message (tool calls without ids)."""

    def __init__(self) -> None:
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[tuple[str, list[str]]] = []

    def add(self, events: list[ParseEvent]) -> None:
        for event in events:
            match event:
                case ReasoningDelta(text=text):
                    self._reasoning.append(text)
                case ContentDelta(text=text):
                    self._content.append(text)
                case ToolCallStarted(name=name):
                    self._calls.append((name, []))
                case ToolCallArguments(index=index, fragment=fragment):
                    self._calls[index][1].append(fragment)
                case ToolCallFinished():
                    pass

    def message(self) -> dict:
        return {
            "role": "assistant",
            "content": "".join(self._content),
            "reasoning_content": "".join(self._reasoning),
            "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": "".join(parts)}}
                for name, parts in self._calls
            ],
        }


def chat_message(text: str, parser: ChatStreamParser | ReasoningSplitter | None) -> dict:
    """The message of one whole completion `text` through `parser` (`chat_parser`'s; None: all
    content), as MessageBuilder folds it: what the server's response makes of the same text."""
    builder = MessageBuilder()
    if parser is None:
        builder.add([ContentDelta(text)] if text else [])
    else:
        builder.add(parser.feed(text))
        builder.add(parser.finish())
    return builder.message()


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
