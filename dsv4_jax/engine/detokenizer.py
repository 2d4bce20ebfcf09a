"""Incremental detokenization with stop strings.

Tokens arrive one at a time; text goes out in pieces that are always whole characters (a byte-level
BPE token can end inside a multi-byte UTF-8 character: `tokenizers` then decodes the dangling bytes
as U+FFFD, so text is held back until the character completes) and never show a stop string, even
a partial one (the last `len(longest stop) - 1` characters wait until the next token tells whether
they begin a stop string). Decoding re-reads only a few tokens before the new ones (a window that
starts at a token boundary where the text was already final), so the cost per token is constant.
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,  # a `tokenizers.Tokenizer`
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        stop_after_tokens: int = 0,
    ):
        """`stop_after_tokens` (a request's `min_tokens`): stop strings count only in the text of
        the tokens after that many, as in vLLM."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # Context for the first output tokens: a few prompt tokens, so merges across the boundary
        # (e.g. a leading space) decode as they will in the full text.
        self._ids: list[int] = list(prompt_token_ids[-4:])
        self._prefix = len(self._ids)  # decode window start (a token index into _ids)
        self._read = len(self._ids)  # tokens before this are already in `text`
        self.text = ""  # the whole output text so far (stop string cut off once found)
        self._sent = 0  # characters of `text` already returned by `add`
        self.stopped_by: str | None = None  # the stop string that ended the output
        self._stop_after = stop_after_tokens
        self._tokens = 0
        self._stop_from = 0 if stop_after_tokens == 0 else None  # where matching may start in `text`

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text that is safe to show (possibly "")."""
        if self.stopped_by is not None:
            return ""
        self._ids.append(int(token_id))
        self._tokens += 1
        if self._stop_from is None and self._tokens > self._stop_after:
            self._stop_from = len(self.text)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if after.endswith(REPLACEMENT) or len(after) < len(before):
            return self._flush(final=False)  # an incomplete character: wait for more bytes
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._check_stop(len(after) - len(before))
        return self._flush(final=self.stopped_by is not None)

    def finish(self) -> str:
        """The text still held back, once the output is over."""
        return self._flush(final=True)

    def _check_stop(self, added: int) -> None:
        if not self.stop or self._stop_from is None:
            return
        start = max(self._stop_from, len(self.text) - added - self._hold)  # it may straddle tokens
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            i, s = min(found)
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stopped_by = s

    def _flush(self, final: bool) -> str:
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        piece = self.text[self._sent : end]
        self._sent = end
        return piece
