"""One choice of a response, followed as the engine streams it: text deltas, the parser's reasoning /
content / tool-call events as OpenAI delta fields, logprobs of the new tokens, and the final message.

The engine hands back cumulative outputs (the whole text and token list so far); a `ChoiceState`
remembers how much it has sent, so each engine output becomes one delta. The same state builds the
non-streamed message, so streamed fragments and the whole answer cannot disagree.
"""

from __future__ import annotations

import codecs
import functools
import uuid
from typing import Any, Callable

from dsv4_jax.chat import (
    ChatStreamParser,
    ContentDelta,
    ParseEvent,
    ReasoningDelta,
    ReasoningSplitter,
    ToolCallArguments,
    ToolCallStarted,
)
from dsv4_jax.engine.outputs import CompletionOutput, Logprob
from dsv4_jax.chat.tokenizer import token_bytes, token_text


@functools.lru_cache(maxsize=4)
def _special_ids(tokenizer: Any) -> frozenset[int]:
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)


class TokenTexts:
    """A token's bytes and text for logprobs (`bytes` as OpenAI gives them: a token may hold part of
    a UTF-8 character, whose text then shows U+FFFD)."""

    def __init__(self, tokenizer: Any, as_token_ids: bool):
        self.tokenizer, self.as_token_ids = tokenizer, as_token_ids

    def bytes_of(self, token_id: int) -> bytes:
        return token_bytes(self.tokenizer, token_id)

    def is_special(self, token_id: int) -> bool:
        """Whether skip_special_tokens drops the token's text (BOS, EOS, the chat format's markers)."""
        return token_id in _special_ids(self.tokenizer)

    def text_of(self, token_id: int) -> str:
        if self.as_token_ids:  # vLLM's return_tokens_as_token_ids
            return f"token_id:{token_id}"
        return token_text(self.tokenizer, token_id)


def chat_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[dict[int, Logprob]], top: int) -> list[dict]:
    """OpenAI chat `logprobs.content` items for these tokens (`top` alternatives each)."""
    items = []
    for token, entry in zip(token_ids, entries):
        alternatives = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top)
        items.append({
            "token": texts.text_of(token), "logprob": max(entry[token].logprob, -9999.0),
            "bytes": list(texts.bytes_of(token)),
            "top_logprobs": [{"token": texts.text_of(t), "logprob": max(lp, -9999.0), "bytes": list(texts.bytes_of(t))}
                             for _, t, lp in alternatives[:top]],
        })
    return items


class TextOffsets:
    """Where each token starts in the text it became (OpenAI's completions `text_offset`): the
    characters its predecessors' bytes decode to, fed one token at a time as the text was decoded,
    so a token holding the second half of a character sits where that character starts, and a
    token whose text is not in the output (a skipped special token) adds nothing. Offsets never
    pass `limit`, the text's length so far (a stop string may cut the last tokens' text)."""

    def __init__(self, texts: TokenTexts, start: int):
        self.texts, self.chars = texts, start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def of(self, token_ids: list[int], limit: int, skipped: Callable[[int], bool]) -> list[int]:
        offsets = []
        for token in token_ids:
            if skipped(token):
                offsets.append(min(self.chars, limit))
                continue
            data, pending = self.texts.bytes_of(token), self._decoder.getstate()[0]
            # An unfinished character that this token cannot continue shows as one U+FFFD before it.
            broken = bool(pending) and _breaks(pending, data)
            offsets.append(min(self.chars + broken, limit))
            self.chars += len(self._decoder.decode(data))
        return offsets


def _breaks(pending: bytes, data: bytes) -> bool:
    """Whether `data` cannot continue `pending`, the start of a UTF-8 character."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(pending + data[:3])  # at most 3 to finish it
    except UnicodeDecodeError as error:
        return error.start < len(pending)
    return False


def completion_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[dict[int, Logprob] | None], top: int,
                        text_offsets: list[int]) -> dict[str, list]:
    """OpenAI completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset). An entry of
    None (an echoed prompt's first token, which nothing predicts) gives null logprobs (vLLM).
    `top_logprobs` holds the token itself, then the `top` most likely (vLLM and OpenAI's legacy
    completions: up to top + 1 entries, `top` when the token is among them)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry, offset in zip(token_ids, entries, text_offsets):
        out["tokens"].append(texts.text_of(token))
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(max(entry[token].logprob, -9999.0))
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items()
                            if t != token and lp.rank is not None and lp.rank <= top)
            alternatives = {texts.text_of(token): max(entry[token].logprob, -9999.0)}
            alternatives.update((texts.text_of(t), max(lp, -9999.0)) for _, t, lp in ranked[:top])
            out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
    return out


def prompt_logprobs(texts: TokenTexts, entries: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token, None for the first, else
    {token id: {logprob, rank, decoded_token}} (the prompt's own token, then the most likely)."""
    return [None if entry is None else {
        str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": texts.text_of(t)}
        for t, lp in entry.items()} for entry in entries]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's `usage` object; given `cached_tokens` (the server's --enable-prompt-tokens-details),
    with `prompt_tokens_details.cached_tokens`, the prompt tokens the prefix cache served. It is
    there on a miss too (0), as OpenAI's; vLLM leaves the object out then."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def chunk_usage(req: Any, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The `usage` entry of a streamed chunk of request `req` (chat or completion): the choice's
    usage so far with continuous usage stats (vLLM), null with include_usage only, else none."""
    if req.continuous_usage:
        return {"usage": usage(prompt_tokens, completion_tokens)}
    return {"usage": None} if req.include_usage else {}


class ChoiceState:
    """What one choice has sent so far, and the parser that splits its text.

    `parser` is None when the response has no reasoning split and no tool calls to find (then all
    text is content, as vLLM does without its parsers)."""

    def __init__(self, index: int, parser: ChatStreamParser | ReasoningSplitter | None,
                 max_tool_calls: int | None = None):
        self.index = index
        self.parser = parser
        self.max_tool_calls = max_tool_calls  # 1 for parallel_tool_calls=false: later calls dropped, as vLLM
        self.sent_chars = 0
        self.sent_tokens = 0
        self.tool_ids: dict[int, str] = {}  # parser's call index -> the call's id
        self.tool_calls: dict[int, dict] = {}  # the whole calls, for the final message
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def advance(self, completion: CompletionOutput) -> tuple[dict[str, Any], list[int], list | None]:
        """The delta fields for what `completion` adds, its new token ids and their logprob entries."""
        new_text = completion.text[self.sent_chars:]
        self.sent_chars = len(completion.text)
        new_tokens = completion.token_ids[self.sent_tokens:]
        entries = completion.logprobs[self.sent_tokens:] if completion.logprobs is not None else None
        self.sent_tokens = len(completion.token_ids)
        events: list[ParseEvent] = []
        if self.parser is None:
            if new_text:
                events.append(ContentDelta(new_text))
        else:
            events += self.parser.feed(new_text) if new_text else []
            if completion.finish_reason is not None:
                events += self.parser.finish()
        delta = self._delta(events)  # first: the calls it records decide the finish reason
        if completion.finish_reason is not None:
            self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason
            # A stop that cut a call off (the parser's `cut_off_call`, if this choice shows that call)
            # stays "stop": the model did not finish it.
            cut = getattr(self.parser, "cut_off_call", None)
            shown_cut = cut is not None and (self.max_tool_calls is None or cut < self.max_tool_calls)
            if self.tool_calls and completion.finish_reason == "stop" and not shown_cut:
                self.finish_reason = "tool_calls"
        return delta, new_tokens, entries

    def _delta(self, events: list[ParseEvent]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        calls: dict[int, dict] = {}  # one entry per call index within this delta, in order
        for event in events:
            if isinstance(event, (ToolCallStarted, ToolCallArguments)) and self.max_tool_calls is not None \
                    and event.index >= self.max_tool_calls:
                continue
            if isinstance(event, ReasoningDelta):
                self.reasoning.append(event.text)
                delta["reasoning"] = delta.get("reasoning", "") + event.text
            elif isinstance(event, ContentDelta):
                self.content.append(event.text)
                delta["content"] = delta.get("content", "") + event.text
            elif isinstance(event, ToolCallStarted):
                call_id = self.tool_ids[event.index] = f"call_{uuid.uuid4().hex[:24]}"
                self.tool_calls[event.index] = {"id": call_id, "type": "function",
                                                "function": {"name": event.name, "arguments": ""}}
                calls[event.index] = {"index": event.index, "id": call_id, "type": "function",
                                      "function": {"name": event.name, "arguments": ""}}
            elif isinstance(event, ToolCallArguments):
                self.tool_calls[event.index]["function"]["arguments"] += event.fragment
                entry = calls.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += event.fragment
        if "reasoning" in delta:
            delta["reasoning_content"] = delta["reasoning"]  # both names, as vLLM's clients read either
        if calls:
            delta["tool_calls"] = list(calls.values())
        return delta

    def message(self, with_reasoning: bool) -> dict[str, Any]:
        """The whole assistant message (non-streamed responses)."""
        reasoning = "".join(self.reasoning) if with_reasoning else None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None,
                                   "reasoning": reasoning, "reasoning_content": reasoning,
                                   "tool_calls": [self.tool_calls[i] for i in sorted(self.tool_calls)]}
        if message["content"] is None and not message["tool_calls"]:
            message["content"] = ""
        return message
