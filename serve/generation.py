"""Running one API request's choices on the engine: `n` engine requests (child i has seed + i, as
vLLM), added together so a bad request is refused before any response starts, their outputs
merged into one stream, metrics recorded, and every child aborted if the response stops early
(a client that disconnects, an error). A child the engine ended alone (finish_reason "error": its
grammar failed to compile, timed out or failed mid-answer) ends the response with a 500, or with
an error event once a stream has started."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import TYPE_CHECKING, AsyncIterator, Mapping, Sequence

from dsv4_jax.engine.async_engine import StepFailedError
from dsv4_jax.engine.outputs import RequestMetrics, RequestOutput
from dsv4_jax.engine.sampling_params import SamplingParams, default_max_tokens_within
from serve.metrics import SUCCESS_REASONS
from serve.protocol import OpenAIError

if TYPE_CHECKING:
    from serve.state import ServingState

_numbers = itertools.count()


def check_capacity(state: ServingState, sequences: int) -> None:
    """Refuse a request whose `sequences` (prompts x n) would take the engine's waiting queue past
    --max-waiting-requests: 503 while the queue is too full, 400 when the request alone is larger
    than the whole queue (it can never be served; the client must split it)."""
    limit = state.args.max_waiting_requests
    if sequences > limit:
        raise OpenAIError(f"this request needs {sequences} sequences (prompts x n), more than the "
                          f"{limit} that may wait (--max-waiting-requests); send fewer prompts per request")
    if state.engine.num_waiting + sequences > limit:
        raise OpenAIError(f"too many requests waiting ({limit}, --max-waiting-requests); retry later", status=503)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{next(_numbers)}-{time.time_ns() % 10**9:09d}"


class Generation:
    """The children of one request; iterate `outputs()` once, to the end or until cancelled."""

    def __init__(self, state: ServingState, request_id: str, prompts: Sequence[list[int]], params: SamplingParams,
                 fields: Mapping[str, str] | None = None, cap_to_room: bool = False):
        """`fields`: the request's names of the engine's fields (a chat request's prompt is its
        `messages`, its constraint may come from its response_format), for the `param` and the
        message of an error. `cap_to_room`: max_tokens is the server's default
        (generation_config.json), which the client did not ask for, so a prompt gets at most what
        max_model_len leaves it (vLLM's get_max_tokens); a max_tokens the client sent beyond that
        is refused with the numbers."""
        self.state = state
        self.prompts = list(prompts)
        self.n = params.n
        self.children: list[tuple[str, AsyncIterator[RequestOutput]]] = []
        self.finished: set[str] = set()
        self._max_tokens: list[int] = []  # each child's max_tokens (what max_model_len leaves if none), for the metrics
        self._generated: list[int] = []  # tokens each child has generated so far
        self._completed: set[int] = set()  # children the engine finished by stop or length
        # Checked again here, after the awaits before (tokenizing), with nothing between it and the adds.
        check_capacity(state, len(self.prompts) * params.n)
        try:
            for p, prompt_ids in enumerate(self.prompts):
                capped = params
                if cap_to_room:
                    capped = default_max_tokens_within(params, state.engine.max_model_len - len(prompt_ids))
                for i in range(params.n):
                    child = capped.for_child(i)
                    rid = f"{request_id}-{p}-{i}"
                    stream = state.engine.add_request(rid, prompt_ids, child)
                    self.children.append((rid, stream))
                    room = state.engine.max_model_len - len(prompt_ids)
                    self._max_tokens.append(room if child.max_tokens is None else child.max_tokens)
                    self._generated.append(0)
                    state.metrics.request_started(rid, len(prompt_ids))
        except ValueError as error:  # the engine's numbers: prompt + max_tokens beyond max_model_len, ...
            self.close()
            param, message = getattr(error, "param", None), str(error)
            renamed = (fields or {}).get(param, param)
            # The message names the limit, or the constraint, as the request gave it.
            if param == "max_tokens" or (param or "").startswith("structured_outputs"):
                message = message.replace(param, renamed, 1)
            raise OpenAIError(message, param=renamed) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Abort every child that has not finished (idempotent). Responses call it when they end,
        however they end, so no request outlives its client."""
        for k, (rid, _) in enumerate(self.children):
            if rid not in self.finished:
                self.state.engine.abort_now(rid)
                self._child_finished(k, "abort", None)

    def _child_finished(self, k: int, reason: str, phases: RequestMetrics | None) -> None:
        """Child `k` has ended: its metrics, and its prompt's once all of that prompt's `n` have
        completed (stop or length: vLLM's parent-request statistics never see an aborted one)."""
        rid = self.children[k][0]
        self.finished.add(rid)
        self.state.metrics.request_finished(rid, reason, phases=phases, max_tokens=self._max_tokens[k])
        if reason not in SUCCESS_REASONS:
            return
        self._completed.add(k)
        first = k - k % self.n  # the prompt's children are k's block of n
        siblings = range(first, first + self.n)
        if all(j in self._completed for j in siblings):
            self.state.metrics.parent_finished(self.n, max(self._generated[j] for j in siblings))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, cumulative output) as the engine produces them, children interleaved.

        Outputs are cumulative (the whole text, token ids and logprobs so far), so for each child
        only its newest undelivered output is kept: a slow reader gets fewer, larger steps instead
        of a queue that grows with every token (each holding the whole text: O(tokens^2) bytes).
        Children are served in the order their pending outputs arrived."""
        pending: dict[int, tuple[str, RequestOutput | BaseException]] = {}
        arrived = asyncio.Event()

        def put(index: int, rid: str, item: RequestOutput | BaseException) -> None:
            if not isinstance(pending.get(index, (None, None))[1], BaseException):  # an error stays
                pending[index] = (rid, item)  # replaces an undelivered older output, keeping its place
            arrived.set()

        async def pump(index: int, rid: str, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    put(index, rid, out)
            except BaseException as error:  # noqa: BLE001  (handed to the consumer)
                put(index, rid, error)

        tasks = [asyncio.create_task(pump(i, rid, stream)) for i, (rid, stream) in enumerate(self.children)]
        try:
            while len(self.finished) < len(self.children):
                while not pending:
                    arrived.clear()
                    await arrived.wait()
                index = next(iter(pending))
                rid, item = pending.pop(index)
                if isinstance(item, StepFailedError):  # the engine logged it and serves on: a 500, no traceback
                    raise OpenAIError(str(item), status=500) from None
                if isinstance(item, BaseException):
                    raise item
                completion = item.outputs[0]
                new = len(completion.token_ids) - self._generated[index]
                if new:
                    self._generated[index] = len(completion.token_ids)
                    self.state.metrics.tokens_generated(rid, new)
                if item.finished:
                    self._child_finished(index, completion.finish_reason or "abort", item.metrics)
                if completion.finish_reason == "error":  # this child alone failed: so does the response
                    raise OpenAIError(item.error or "the request failed in the engine", status=500)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()  # each child's stream aborts its request as it closes
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()
