"""Incremental detokenization against the real V4 tokenizer: whole characters only, stop strings
never shown (not even in part), the same text as decoding everything at once."""

from __future__ import annotations

import pytest

from dsv4_jax.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer
from dsv4_jax.chat.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world! Plain ASCII with  two spaces.",
    "混合文本：深度求索 DeepSeek-V4 和 emoji 🚀🧪, café naïve Ωmega.",
    "def f(x):\n    return x ** 2  # 平方\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def feed(detok, ids):
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.finish()


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_add_up_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if "🚀" in text:  # this text does put one character's bytes in several tokens
        assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    pieces, tail = feed(IncrementalDetokenizer(tokenizer), ids)
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) + tail == tokenizer.decode(ids)


def test_a_stop_string_ends_the_text_and_never_leaks_even_in_part(tokenizer):
    text = "The answer is 42. STOP HERE and nothing after."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP HERE", "never"])
    shown = ""
    for i in ids:
        shown += detok.add(i)
        assert "S" not in shown[len("The answer is 42. ") - 1 :]  # no prefix of the stop string shown
        if detok.stopped_by:
            break
    shown += detok.finish()
    assert detok.stopped_by == "STOP HERE"
    assert shown == "The answer is 42. " == detok.text


def test_include_stop_str_in_output_and_the_earliest_stop_wins(tokenizer):
    ids = tokenizer.encode("abc END xyz STOP", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP", "END"], include_stop_str_in_output=True)
    pieces, tail = feed(detok, ids)
    assert "".join(pieces) + tail == "abc END" and detok.stopped_by == "END"
    assert detok.add(ids[0]) == ""  # nothing after the stop


def test_special_tokens_are_skipped_or_kept(tokenizer):
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    ids = [*tokenizer.encode("Done.", add_special_tokens=False).ids, eos]
    skipped, tail = feed(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(skipped) + tail == "Done."
    kept, tail = feed(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids)
    assert "".join(kept) + tail == "Done.<｜end▁of▁sentence｜>"


def test_stop_strings_count_only_after_min_tokens(tokenizer):
    ids = tokenizer.encode("END one two END three", add_special_tokens=False).ids
    first_end = len(tokenizer.encode("END", add_special_tokens=False).ids)
    detok = IncrementalDetokenizer(tokenizer, stop=["END"], stop_after_tokens=first_end)
    pieces, tail = feed(detok, ids)
    assert "".join(pieces) + tail == "END one two " and detok.stopped_by == "END"


def _one_token(tokenizer, text: str) -> int:
    (token,) = tokenizer.encode(text, add_special_tokens=False).ids  # the case needs it as one token
    return token


def test_a_stop_string_may_begin_in_the_min_tokens_text_and_must_end_after_it(tokenizer):
    """vLLM looks for stop strings from the first token past min_tokens on, in a window that ends
    in the new text and may begin before it (vllm/v1/engine/detokenizer.py, check_stop_strings)."""
    hello, world, c = (_one_token(tokenizer, t) for t in ("Hello", " world", "c"))
    detok = IncrementalDetokenizer(tokenizer, stop=["o w"], stop_after_tokens=1)
    pieces, tail = feed(detok, [hello, world])
    assert "".join(pieces) + tail == "Hell" and detok.stopped_by == "o w"
    # A stop string wholly inside the min_tokens' text is never found, also not by the next token.
    ab = _one_token(tokenizer, "ab")
    detok = IncrementalDetokenizer(tokenizer, stop=["ab", "xyzw"], stop_after_tokens=1)
    pieces, tail = feed(detok, [ab, c])
    assert "".join(pieces) + tail == "abc" and detok.stopped_by is None


def test_of_stop_strings_completed_by_one_token_the_first_to_end_wins(tokenizer):
    """What one character at a time would have found: the match that ends first, then the first
    listed (current vLLM's check_stop_strings)."""
    the = _one_token(tokenizer, " the")
    detok = IncrementalDetokenizer(tokenizer, stop=["the", "h"])
    pieces, tail = feed(detok, [the])
    assert "".join(pieces) + tail == " t" and detok.stopped_by == "h"  # "h" ends before "the" does
    for stop in (["he", "e"], ["e", "he"]):  # both end at "e": the first listed
        detok = IncrementalDetokenizer(tokenizer, stop=stop, include_stop_str_in_output=True)
        pieces, tail = feed(detok, [the])
        assert "".join(pieces) + tail == " the" and detok.stopped_by == stop[0]


def test_a_decoder_whose_text_is_not_prefix_stable_never_fails_the_request():
    """`DecodeStream` raises when a token changes text it already returned; the request keeps going
    with a fresh window at that token (here: each token's own text)."""
    from tokenizers import Tokenizer, decoders, models

    class Reversed:  # joins tokens last first, so every new token rewrites the start of the text
        def decode_chain(self, tokens):
            return ["".join(reversed(tokens))]

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tokenizer.decoder = decoders.Decoder.custom(Reversed())
    assert tokenizer.decode([0, 1, 2]) == "cba"
    pieces, tail = feed(IncrementalDetokenizer(tokenizer), [0, 1, 2])
    assert pieces == [tokenizer.decode([i]) for i in (0, 1, 2)] == ["a", "b", "c"] and tail == ""
