"""What the engine returns, in vLLM's shapes (`RequestOutput` with `CompletionOutput`s)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


class TokenIdsSoFar(Sequence):
    """The first `n` ids of a request's output list, read-only: what a streamed output had when it
    was made. The list only grows past them, so this snapshot costs O(1); copying the list for
    every request at every step made a step's host work grow with the tokens generated so far.
    Slices are lists; it equals a list or tuple with the same ids."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int):
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._ids[slice(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError("token index out of range")
        return self._ids[i % self._n]

    def __iter__(self):
        return iter(self._ids[: self._n])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenIdsSoFar, list, tuple)):
            return len(other) == self._n and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._ids[: self._n])


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int] | TokenIdsSoFar  # a list once finished; before, a snapshot of the ids so far
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # one dict per generated token, when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, None for EOS / length
    # Chat outputs only (`LLM.chat`): the parse of `text`.
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """When a request reached each phase, in `time.monotonic()` seconds of the engine's process
    (vLLM's `RequestOutput.metrics` holds the like): arrival in the engine, first scheduled (the
    end of its wait in the queue; not reset by a preemption), first and latest token (when the
    host applied them). None: not reached yet."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # one list per request, shared by its outputs: do not modify it
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why it ended alone, when its finish_reason is "error"
    # Prompt tokens whose KV came from the prefix cache at the request's first scheduling (vLLM's
    # name; 0 on a miss or with caching off, None while not scheduled yet).
    num_cached_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine's state at one instant (read at a metrics scrape)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # fraction in [0, 1], as vLLM
    num_preemptions_total: int  # cumulative, read from the scheduler
    # Prefix cache, cumulative, in tokens (vLLM's vllm:prefix_cache_queries / _hits): the prompt
    # tokens looked up at each admission, and those found with their state (a hit skips them).
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Speculative decoding, cumulative (vLLM's vllm:spec_decode_*; `SpecDecodeStats`): verify rows
    # that carried drafts, their drafts, the drafts accepted, and those accepted at each draft
    # position 0..k-1. All None while speculation is off (the series are then not exposed).
    spec_decode_num_drafts_total: int | None = None
    spec_decode_num_draft_tokens_total: int | None = None
    spec_decode_num_accepted_tokens_total: int | None = None
    spec_decode_num_accepted_tokens_per_pos_total: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        counts = ["num_requests_running", "num_requests_waiting", "num_preemptions_total",
                  "prefix_cache_queries_total", "prefix_cache_hits_total"]
        spec = [name for name in _SPEC_DECODE_FIELDS if getattr(self, name) is not None]
        if spec and len(spec) != len(_SPEC_DECODE_FIELDS):
            raise ValueError(f"EngineStats: got {', '.join(spec)} without "
                             f"{', '.join(n for n in _SPEC_DECODE_FIELDS if n not in spec)}; "
                             "allowed: all of the spec_decode_* counters (speculation on) or none")
        for name in counts + (list(_SPEC_DECODE_COUNTS) if spec else []):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"EngineStats.{name}: got {value}, allowed: an integer >= 0")
        per_pos = self.spec_decode_num_accepted_tokens_per_pos_total
        if per_pos is not None and (not per_pos or min(per_pos) < 0):
            raise ValueError(f"EngineStats.spec_decode_num_accepted_tokens_per_pos_total: got {per_pos!r}, "
                             "allowed: one integer >= 0 per draft position (num_speculative_tokens of them)")
        if not 0.0 <= self.kv_cache_usage_perc <= 1.0:
            raise ValueError(
                f"EngineStats.kv_cache_usage_perc: got {self.kv_cache_usage_perc}, allowed: a fraction in [0, 1]"
            )

    @property
    def spec_decode_enabled(self) -> bool:
        return self.spec_decode_num_drafts_total is not None


_SPEC_DECODE_COUNTS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                       "spec_decode_num_accepted_tokens_total")
_SPEC_DECODE_FIELDS = (*_SPEC_DECODE_COUNTS, "spec_decode_num_accepted_tokens_per_pos_total")
