"""A request as the scheduler sees it: its tokens, how far its KV is computed, and what it holds
in the cache (a sequence slot and compressed blocks). Plain Python: no jax here."""

from __future__ import annotations

import array
import dataclasses
import enum
import numbers
import time
from typing import Any, Sequence


class RequestRejected(ValueError):
    """A request that can never run as asked; the message gives the numbers, `param` names the
    request field to change (the server's OpenAI error `param`), or None."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def integer_token_ids(token_ids: Sequence[Any]) -> list[int]:
    """Prompt token ids as Python ints. A float or a string is refused (RequestRejected naming the
    prompt), never rounded or parsed; numpy integers are integers."""
    bad = next((t for t in token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
    if bad is not None:
        raise RequestRejected(f"prompt token ids must be integers; got {bad!r}", "prompt")
    return [int(t) for t in token_ids]


# A sampled token not known on the host yet (async scheduling): the next step is scheduled while
# the device still computes it, and the device puts the real token in its place (engine.py).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted (its KV is recomputed from scratch)
    RUNNING = "running"  # holds a slot and blocks
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # the caller aborted it
    FINISHED_ERROR = "error"  # this request alone failed (its grammar: `RequestOutput.error` says why)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop", "length", "abort", "error" (None while not finished)."""
        return self.value if self.finished else None


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # completion tokens this request may produce
    sampling_params: Any = None  # the engine's; the scheduler never reads it
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    # time.monotonic() of its first scheduling (the end of its wait in the queue), of its first token
    # and of its latest (on the host, when the scheduler applies them): vLLM's phase timestamps.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache
    slot: int | None = None  # sequence slot: its sliding ring and compressor state
    # Block k holds positions [k*bs, (k+1)*bs). C ints rather than a list: a step copies each row's
    # blocks, and at long contexts (4096 blocks at 1M positions) copying Python ints into the
    # step's table cost more than the step's whole build (`_StepPlan.rows`).
    compressed_blocks: array.array = dataclasses.field(default_factory=lambda: array.array("i"))
    dp_rank: int = 0  # the data-parallel rank whose pools hold it
    num_preemptions: int = 0
    # Prefix caching: the chained hashes of its full blocks so far (the scheduler extends them), and
    # the prompt tokens its first admission found cached (None until then).
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_tokens: int | None = None
    num_registered_blocks: int = 0  # its leading blocks already offered to the cache (since admission)
    # Computes its whole prompt whatever is cached (its blocks are still cached for others): a
    # request for prompt logprobs, whose cached positions would have none (as vLLM).
    skip_prefix_cache: bool = False
    # Speculative decoding: the tokens proposed to follow its last one, verified by its next decode
    # row (the engine sets them after each step; the scheduler may use fewer).
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_ids(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without building the whole list: a step's chunk costs its
        own length, not the sequence's (a decode row of a 100K-token prompt copied 100K ids)."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
