"""Which tokens each constrained request may sample next: its grammar (an llguidance matcher), its
`allowed_token_ids` and its `bad_words`, as one bitmask row per step.

A mask row is llguidance's layout: ceil(vocab / 32) int32 words, token t allowed when bit t % 32
of word t // 32 is set (little-endian). Unconstrained rows of a constrained batch are all ones.
The sampler applies the rows on the device before everything else (`sampler.apply_token_masks`).

A request's `TokenMask` follows its output tokens (`advance`), whatever order the engine learns
them in: the launch of step n + 1 feeds it the token of step n as soon as it is fetched (its mask
depends on it), the completion of step n again (a no-op then). It counts what it has consumed, so a
token is never fed twice, and after a preemption it replays the outputs into a reset matcher.
With reasoning, the grammar starts after the model's own `</think>` (`arm_token`): tokens before
it and that token itself are not the grammar's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WORD_BITS = 32


def mask_width(vocab_size: int) -> int:
    """int32 words of one mask row."""
    return -(-vocab_size // WORD_BITS)


def packed_ids(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """A mask row allowing exactly `token_ids`. [mask_width] int32"""
    bits = np.zeros(mask_width(vocab_size) * WORD_BITS, np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a mask row allows (the inverse of `packed_ids`)."""
    bits = np.unpackbits(np.ascontiguousarray(row, np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def bad_words_token_ids(words: Sequence[str], encode, vocab_size: int) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word as written (left-stripped) and, when that
    gives a different first token of the same length, with a leading space (a word in mid-text).
    `encode(text) -> ids` without special tokens. A ValueError for an id outside the vocabulary."""
    sequences: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    outside = sorted({t for ids in sequences for t in ids if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words tokenize to ids {outside[:8]} outside the vocabulary [0, {vocab_size})")
    return [ids for ids in sequences if ids]


class TokenMask:
    """One request's constraint on its next token (module docstring)."""

    def __init__(self, *, matcher=None, arm_token: int | None = None, allowed: np.ndarray | None = None,
                 bad_words: Sequence[Sequence[int]] = ()):
        self.arm_token = arm_token  # the grammar starts after this token; None: from the first output
        self.attach(matcher)
        self.allowed = allowed  # [mask_width] int32, or None
        self.bad_single = np.asarray(sorted({ids[0] for ids in bad_words if len(ids) == 1}), np.int64)
        self.bad_sequences = [tuple(ids) for ids in bad_words if len(ids) > 1]
        self.seen = 0  # output tokens taken into account
        self.preemptions = 0
        self.error: str | None = None

    def attach(self, matcher) -> None:
        """Take the request's grammar (an llguidance.LLMatcher, once compiled; None: no grammar)."""
        self.matcher = matcher
        self.armed = matcher is not None and self.arm_token is None

    @property
    def needs_last_token(self) -> bool:
        """Whether the next mask depends on the newest output (so it must be known on the host)."""
        return self.matcher is not None or bool(self.bad_sequences)

    @property
    def finished(self) -> bool:
        """The grammar reached its end: nothing may follow (the request stops)."""
        return self.armed and self.matcher.is_stopped() and not self.matcher.is_error()

    def advance(self, output_token_ids: Sequence[int], preemptions: int = 0) -> None:
        """Take the outputs past those seen (all known tokens: no placeholder). After a preemption
        the grammar is replayed from the first output."""
        if preemptions != self.preemptions and self.matcher is not None:
            self.preemptions, self.seen = preemptions, 0
            self.matcher.reset()
            self.armed = self.arm_token is None
        if self.matcher is None or self.error is not None:
            self.seen = len(output_token_ids)
            return
        for token in output_token_ids[self.seen:]:
            if self.check_error():
                break
            if not self.armed:
                self.armed = token == self.arm_token
            elif not self.matcher.is_stopped():
                self.matcher.consume_token(int(token))
        self.check_error()
        self.seen = len(output_token_ids)

    def check_error(self) -> bool:
        """Whether the grammar failed (in a token it consumed, or while it computed a mask: a
        limit of llguidance's lexer or parser); `error` then says why. A failed matcher also
        reports itself stopped, which must never read as the grammar's end."""
        if self.error is None and self.matcher is not None and self.matcher.is_error():
            # llguidance's first line says what failed; the rest is its parser state.
            first = (self.matcher.get_error().strip().splitlines() or ["unknown error"])[0]
            self.error = f"the structured-output grammar failed: {first}"
        return self.error is not None

    def fill_static(self, row: np.ndarray, output_token_ids: Sequence[int]) -> None:
        """`row` (a grammar's mask or all ones) narrowed by allowed ids and bad words, in place."""
        if self.allowed is not None:
            row &= self.allowed
        banned = [self.bad_single] if self.bad_single.size else []
        for ids in self.bad_sequences:  # the word's last token, where the outputs end with the rest
            head = ids[:-1]
            if len(output_token_ids) >= len(head) and tuple(output_token_ids[len(output_token_ids) - len(head):]) == head:
                banned.append(np.asarray(ids[-1:], np.int64))
        if banned:
            ids = np.concatenate(banned)
            np.bitwise_and.at(row, ids // WORD_BITS, ~(np.int32(1) << (ids % WORD_BITS).astype(np.int32)))


def fill_masks(rows: Sequence[tuple[int, TokenMask, Sequence[int]]], bucket: int, vocab_size: int,
               executor=None, eos_token_ids: Sequence[int] = ()) -> np.ndarray:
    """The step's mask rows: [bucket, mask_width] int32, all ones but for `rows` (batch row,
    its mask, its known outputs). Grammar rows are filled by llguidance, several at once on
    `executor`'s threads (an `llguidance.LLExecutor`) when given. A grammar that fails here (a
    limit of llguidance's) allows only EOS in its row and records its error: the engine ends the
    request with it, and no unconstrained token is ever drawn for it."""
    import llguidance.numpy

    words = np.full((bucket, mask_width(vocab_size)), -1, np.int32)
    grammar_rows = [(mask.matcher, at) for at, mask, _ in rows
                    if mask.armed and mask.error is None and not mask.matcher.is_error()]
    if len(grammar_rows) > 1 and executor is not None:
        llguidance.numpy.fill_next_token_bitmask_par(executor, grammar_rows, words)
    else:
        for matcher, at in grammar_rows:
            llguidance.numpy.fill_next_token_bitmask(matcher, words, at)
    for at, mask, outputs in rows:
        if mask.matcher is not None and mask.armed and not mask.check_error() and not words[at].any():
            # A failure llguidance reports only through its mask (seen with its threads): nothing allowed.
            mask.error = "the structured-output grammar failed: it allows no token here"
        if mask.matcher is not None and mask.check_error():
            words[at] = packed_ids(list(eos_token_ids), vocab_size) if eos_token_ids else 0
            continue
        mask.fill_static(words[at], outputs)
    return words
