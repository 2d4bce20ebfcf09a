"""The prompts `python -m serve.bench` sends: vLLM's `random` and `prefix_repetition` datasets,
built without a tokenizer so the client works against any OpenAI-compatible server.

For `/v1/completions` a prompt is a list of token ids (the endpoint accepts them as they are), so
its length is exact. For `/v1/chat/completions` a prompt is random words, one per wanted token; the
real count, chat template included, comes back in the response's usage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DATASET_NAMES = ("random", "prefix_repetition")

# Short, common English words: each is one token in the usual BPE vocabularies, so a chat prompt of
# N words is close to N tokens.
WORDS = (
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as",
    "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some",
    "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an",
    "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them",
    "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has",
    "look", "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my",
)


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: token ids (completions) or text (chat), its length in tokens as
    built (the server's usage replaces it when reported), and the output tokens to ask for."""

    prompt: list[int] | str
    prompt_len: int
    expected_output_len: int


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """`n` lengths drawn uniformly from [mean * (1 - r), mean * (1 + r)] (vLLM's random dataset),
    never below 1."""
    low = max(1, int(np.floor(mean * (1 - range_ratio))))
    high = max(low, int(np.ceil(mean * (1 + range_ratio))))
    return rng.integers(low, high + 1, size=n)


def _segment(rng: np.random.Generator, length: int, vocab_size: int, as_text: bool) -> list[int] | list[str]:
    if as_text:
        return [WORDS[i] for i in rng.integers(0, len(WORDS), size=length)]
    return rng.integers(0, vocab_size, size=length).tolist()


def _request(pieces: list, output_len: int, as_text: bool) -> SampleRequest:
    return SampleRequest(" ".join(pieces) if as_text else pieces, len(pieces), output_len)


def random_requests(num_prompts: int, input_len: int, output_len: int, *, prefix_len: int = 0,
                    range_ratio: float = 0.0, vocab_size: int, as_text: bool, seed: int) -> list[SampleRequest]:
    """vLLM's `random` dataset: one shared prefix of `prefix_len` tokens, then a random part whose
    length (like the output length) is drawn within +-`range_ratio` of the given one."""
    rng = np.random.default_rng(seed)
    prefix = _segment(rng, prefix_len, vocab_size, as_text)
    inputs = _lengths(rng, num_prompts, input_len, range_ratio)
    outputs = _lengths(rng, num_prompts, output_len, range_ratio)
    return [_request(prefix + _segment(rng, int(n), vocab_size, as_text), int(m), as_text)
            for n, m in zip(inputs, outputs)]


def prefix_repetition_requests(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, *, vocab_size: int, as_text: bool,
                               seed: int) -> list[SampleRequest]:
    """vLLM's `prefix_repetition` dataset: `num_prefixes` random prefixes, each request one of them
    plus its own random suffix, shuffled. Unlike vLLM (which sends `num_prompts // num_prefixes`
    per prefix), exactly `num_prompts` requests: prefix i % num_prefixes for request i."""
    if num_prefixes > num_prompts:
        raise ValueError(f"--prefix-repetition-num-prefixes {num_prefixes} is more than --num-prompts "
                         f"{num_prompts}; allowed: 1..{num_prompts}")
    rng = np.random.default_rng(seed)
    prefixes = [_segment(rng, prefix_len, vocab_size, as_text) for _ in range(num_prefixes)]
    requests = [_request(prefixes[i % num_prefixes] + _segment(rng, suffix_len, vocab_size, as_text),
                         output_len, as_text) for i in range(num_prompts)]
    return [requests[i] for i in rng.permutation(num_prompts)]
