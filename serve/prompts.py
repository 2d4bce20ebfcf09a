"""Prompt text -> token ids for the routes, off the event loop.

Tokenizing runs in a worker thread (the `tokenizers` library releases the GIL while it encodes), so
a long prompt does not stall other streams, `/health` or `/metrics`. A text so long that it cannot
fit in max_model_len tokens is refused before any tokenizing: a token never covers more characters
than its own text, so `characters / longest token text` is a lower bound on its token count (the
bound holds for the byte-level BPE tokenizers of V4, whose normalizer and pre-tokenizers drop no
character; for any other tokenizer the check is skipped).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from typing import Any, Sequence

from dsv4_jax.chat.tokens import BOS
from dsv4_jax.chat.tokenizer import encode_prompt
from serve.protocol import OpenAIError

# Pre-tokenizers that keep every character (Split keeps them unless its behavior is "Removed").
_KEEPING_PRE_TOKENIZERS = ("Split", "ByteLevel", "Digits")
_LEADING_BOS = re.compile(f"(?:{re.escape(BOS)})*")


@functools.lru_cache(maxsize=4)
def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input one token can cover, or None when the tokenizer may drop or
    merge characters (a normalizer, a removing pre-tokenizer, no byte-level alphabet), so no bound
    holds. Byte-level vocabulary strings have one character per byte, and bytes >= characters."""
    config = json.loads(tokenizer.to_str())
    normalizer = config.get("normalizer")
    if normalizer and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        return None
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(s.get("type") == "ByteLevel" for s in steps) or any(
            s.get("type") not in _KEEPING_PRE_TOKENIZERS or s.get("behavior") == "Removed" for s in steps):
        return None
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)))


def check_prompt_length(tokenizer: Any, prompt: str, max_model_len: int, param: str) -> None:
    """Refuse (400) a prompt whose characters alone prove it holds more than max_model_len tokens.
    Leading BOS texts are left out of the count: encode_prompt keeps one BOS for all of them."""
    longest = max_token_chars(tokenizer)
    if longest is None:
        return
    chars = len(prompt) - _LEADING_BOS.match(prompt).end()
    at_least = 1 + -(-chars // longest)  # the BOS, then ceil(chars / longest)
    if at_least > max_model_len:
        raise OpenAIError(f"the prompt has {chars} characters, so at least {at_least} tokens (one token covers "
                          f"at most {longest}), more than max_model_len {max_model_len}; shorten it", param=param)


async def encode_prompts(state: Any, prompts: Sequence[str], param: str, *,
                         check_length: bool = True) -> list[list[int]]:
    """encode_prompt of each prompt (exactly one BOS each) after the length check, both in a worker
    thread (the first check reads the tokenizer's whole configuration). `check_length` False: the
    request truncates its prompt (truncate_prompt_tokens), so a long one is no error."""
    tokenizer, max_model_len = state.tokenizer, state.max_model_len

    def encode() -> list[list[int]]:
        for prompt in prompts if check_length else ():
            check_prompt_length(tokenizer, prompt, max_model_len, param)
        return [encode_prompt(tokenizer, prompt) for prompt in prompts]

    return await asyncio.to_thread(encode)


def truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the last `keep` tokens (-1: the last max_model_len; None:
    all). The engine cuts what it is given the same way (and refuses a `keep` beyond max_model_len);
    cut here first so that the usage, the echo and the room left for max_tokens count the prompt
    the engine runs."""
    if keep is None:
        return ids
    return ids[-(max_model_len if keep == -1 else keep):]
