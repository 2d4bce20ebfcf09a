"""Running one API request's choices on the engine: `n` engine requests (child i has seed + i, as
vLLM), added together so a bad request is refused before any response starts, their outputs
merged into one stream, metrics recorded, and every child aborted if the response stops early
(a client that disconnects, an error)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from dsv4_jax.engine.outputs import RequestOutput
from dsv4_jax.engine.request import ForcedTokens
from dsv4_jax.engine.sampling_params import SamplingParams
from serve.protocol import OpenAIError

if TYPE_CHECKING:
    from serve.state import ServingState

_numbers = itertools.count()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{next(_numbers)}-{time.time_ns() % 10**9:09d}"


class Generation:
    """The children of one request; iterate `outputs()` once, to the end or until cancelled."""

    def __init__(self, state: ServingState, request_id: str, prompts: Sequence[list[int]], params: SamplingParams,
                 forced: ForcedTokens | None = None):
        self.state = state
        self.prompts = list(prompts)
        self.n = params.n
        self.children: list[tuple[str, AsyncIterator[RequestOutput]]] = []
        self.finished: set[str] = set()
        try:
            for p, prompt_ids in enumerate(self.prompts):
                for i in range(params.n):
                    child = params if params.n == 1 else dataclasses.replace(
                        params, n=1, seed=None if params.seed is None else params.seed + i)
                    rid = f"{request_id}-{p}-{i}"
                    stream = state.engine.add_request(rid, prompt_ids, child, forced=forced)
                    self.children.append((rid, stream))
                    state.metrics.request_started(rid, len(prompt_ids))
        except ValueError as error:  # the engine's numbers: prompt + max_tokens beyond max_model_len, ...
            self.close()
            raise OpenAIError(str(error), param=getattr(error, "param", None)) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Abort every child that has not finished (idempotent). Responses call it when they end,
        however they end, so no request outlives its client."""
        for rid, _ in self.children:
            if rid not in self.finished:
                self.finished.add(rid)
                self.state.engine.abort_now(rid)
                self.state.metrics.request_finished(rid, "abort")

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, cumulative output) as the engine produces them, children interleaved."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, rid: str, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    merged.put_nowait((index, rid, out))
            except BaseException as error:  # noqa: BLE001  (handed to the consumer)
                merged.put_nowait((index, rid, error))

        tasks = [asyncio.create_task(pump(i, rid, stream)) for i, (rid, stream) in enumerate(self.children)]
        counts = [0] * len(self.children)
        try:
            while len(self.finished) < len(self.children):
                index, rid, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                completion = item.outputs[0]
                new = len(completion.token_ids) - counts[index]
                if new:
                    counts[index] = len(completion.token_ids)
                    self.state.metrics.tokens_generated(rid, new)
                if item.finished:
                    self.finished.add(rid)
                    self.state.metrics.request_finished(rid, completion.finish_reason or "abort")
                yield index, item
        finally:
            for task in tasks:
                task.cancel()  # each child's stream aborts its request as it closes
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()

