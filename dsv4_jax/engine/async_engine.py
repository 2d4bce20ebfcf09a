"""The engine for asyncio callers (the server): requests come in from the event loop, each one's
outputs stream back as its tokens are sampled, and the step loop runs on a thread of its own so
the event loop never waits for the device.

One lock guards the synchronous engine: the step thread holds it while it launches a step and
while it applies a step's tokens, never while it waits for the device in between, and `add` /
`abort` from the event loop take it in those gaps, so an abort lands at once (a token the device
still computes for it is dropped) and frees everything the request holds. Outputs reach each
request's `_Latest` through `call_soon_threadsafe`: outputs are cumulative, so a consumer that
falls behind (a slow client) gets the newest one, not a queue of every step's copy of the whole
text (vLLM's output collector merges them likewise). A consumer that stops iterating (a client
that disconnects) aborts its request. `shutdown` stops accepting, lets running requests finish for a grace period,
aborts the rest and joins the thread.

A step that fails (an exception in the model, the sampler or the host's bookkeeping) fails the
requests it may have touched with `StepFailedError` (those that never ran stay queued), resets
the engine, and runs one step of padding rows: if that works, the engine serves on, so one bad
batch costs its requests, not the server (and a client that resends a request that fails every
time cannot stop it). If the reset or that step fails too (a lost device, a broken cache), the
engine stops for good (`EngineDeadError`; the server's /health then answers 503 so that a
supervisor restarts it).

`EngineClient` is the interface the server is written against; `AsyncLLMEngine` is the one
implementation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator, Protocol, Sequence

import jax

from dsv4_jax.engine.engine import LLMEngine
from dsv4_jax.engine.outputs import EngineStats, RequestOutput
from dsv4_jax.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop failed for good; the engine serves nothing more."""


class StepFailedError(RuntimeError):
    """The step that held this request failed; the engine was reset and serves new requests."""


class _Latest:
    """One request's newest output not yet taken (or the error that ended it). Outputs are
    cumulative, so a newer one replaces an untaken older one; a finished output or an error is
    never replaced (a step's delivery can trail the abort that finished the request)."""

    def __init__(self):
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        held = self._item
        if held is not None and (isinstance(held, BaseException) or held.finished):
            return
        self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        return item


class EngineClient(Protocol):
    """What the server needs of an engine, and all it may use: requests in (`add_request`, whose
    outputs stream back), out (`abort_now`), the numbers it reports (`stats`, `num_waiting`), the
    limits and tokenizer requests are checked against, emptying the prefix cache
    (`reset_prefix_cache`), and the life cycle."""

    max_model_len: int
    tokenizer: Any

    @property
    def accepting(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None) -> AsyncIterator[RequestOutput]: ...

    def abort_now(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self, grace_seconds: float = 10.0) -> None: ...


class AsyncLLMEngine:
    """The `EngineClient` over an `LLMEngine` whose steps run on a thread of its own."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # Reentrant: a grammar already compiled when its request is added calls `_wake` at once,
        # from `add_request`, which holds the lock.
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._queues: dict[str, _Latest] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stop = False
        self._keep_waiting = True  # after a failed step, keep requests that never ran (see _step_failed)
        self.error: BaseException | None = None

    # ---- life cycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._accepting, self._stop = True, False
        self.engine.on_grammar_ready = self._wake
        self.engine.wait_unlocked = self._unlocked
        self._thread = threading.Thread(target=self._run, name="dsv4-engine-steps", daemon=True)
        self._thread.start()

    async def shutdown(self, grace_seconds: float = 10.0) -> None:
        """Stop accepting; let what runs finish for `grace_seconds`; abort the rest; stop."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + grace_seconds
        while self.num_unfinished and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for request_id in list(self._queues):
            await self.abort(request_id)
        with self._work:
            self._stop = True
            self._work.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        # The engine serves on without this wrapper (a notebook's LLM): its hooks go back.
        self.engine.on_grammar_ready, self.engine.wait_unlocked = None, lambda wait: wait()
        self.engine.stop_followers()  # a multi-node run: the followers exit too

    def _unlocked(self, wait):
        """`wait()` with the lock let go (the step thread holds it once, in `_run`): adds and
        aborts never wait for the device."""
        self._lock.release()
        try:
            return wait()
        finally:
            self._lock.acquire()

    def _wake(self) -> None:
        """A grammar compiled (on a grammar worker, or on the caller's thread when it was ready at
        once): its request may run now."""
        with self._work:
            self._work.notify()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.error is None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def num_waiting(self) -> int:
        """Sequences queued for a slot, every data-parallel rank's, and those waiting for their grammar."""
        return self.engine.scheduler.num_waiting + self.engine.num_compiling

    def stats(self) -> EngineStats:
        """Read without the lock, as a scrape must not wait for a step's host work: each count is
        a running total that only grows, so a step applied meanwhile only makes some of them newer."""
        scheduler, spec = self.engine.scheduler, self.engine.spec_decode_stats
        spec_decode = {} if spec is None else dict(
            spec_decode_num_drafts_total=spec.num_drafts,
            spec_decode_num_draft_tokens_total=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens_total=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos_total=tuple(spec.accepted_per_position),
        )
        return EngineStats(scheduler.num_running, self.num_waiting, scheduler.kv_cache_usage,
                           scheduler.num_preemptions, prefix_cache_queries_total=scheduler.prefix_cache_queries,
                           prefix_cache_hits_total=scheduler.prefix_cache_hits, **spec_decode)

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache: True once done; False, with nothing changed, while a request
        is queued or running (`LLMEngine.reset_prefix_cache`). Under the lock, so no step's host
        work is halfway through the tables it clears (held for host work only: a short wait)."""
        with self._work:
            return self.engine.reset_prefix_cache()

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request now (a bad one raises ValueError here, with nothing queued) and return its
        outputs as they come (each the whole output so far; the last has `finished` set). The
        caller must iterate the outputs to the end or close them: closing early aborts the request."""
        self._check_accepting()
        queue = _Latest()
        with self._work:
            # Again under the lock: the step thread may have failed (and failed every request it
            # knew) while this call waited for the lock; a request added then would never be served.
            self._check_accepting()
            self.engine.add_request(request_id, prompt_token_ids, params, prompt=prompt)
            self._queues[request_id] = queue
            self._work.notify()
        return self._outputs(request_id, queue)

    def _check_accepting(self) -> None:
        if not self.accepting or self._stop:
            raise EngineDeadError("the engine is shutting down" if self.error is None else f"the engine failed: {self.error}")

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`add_request` and its outputs in one: a bad request raises ValueError at the first step
        of the iteration."""
        outputs = self.add_request(request_id, prompt_token_ids, params, prompt=prompt)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def _outputs(self, request_id: str, queue: _Latest) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the caller stopped listening (a disconnect), or an error: free it
                await self.abort(request_id)

    def abort_now(self, request_id: str) -> None:
        """Abort from the event loop's thread without awaiting (it never blocks for long: the step
        thread holds the lock for a step's host work only, never while the device computes)."""
        with self._work:
            queue = self._queues.pop(request_id, None)
            out = self.engine.abort(request_id)
        if queue is not None and out is not None:
            queue.put(out)  # its last output, marked finished ("abort")

    async def abort(self, request_id: str) -> None:
        self.abort_now(request_id)

    # ---- the step thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._work:
                while not self._stop and not self.engine.has_runnable():
                    # Requests waiting only for their grammar: woken when one compiles (`_wake`),
                    # or at the latest to end one whose compile is late.
                    self._work.wait(timeout=1.0 if self.engine.num_compiling else None)
                if self._stop:
                    return
                try:
                    launched = self.engine.begin_step()
                except BaseException as error:
                    if self._step_failed(error):
                        continue
                    return
                ended = self._delivered(self.engine.take_ended_early())
            self._deliver(ended)
            if launched is None:
                continue
            # The device computes `launched` (and the step after it): wait without the lock, so the
            # event loop never blocks on a step to add or abort a request (waiting under it, every
            # new request or disconnect would freeze every stream for a whole step).
            try:
                self._wait(launched)
            except BaseException:  # noqa: BLE001 - finish_step reads the same arrays and reports it
                pass
            with self._work:
                try:
                    outputs = self.engine.finish_step(launched)
                except BaseException as error:
                    if self._step_failed(error):
                        continue
                    return
                self._keep_waiting = True
                deliveries = self._delivered(outputs)
            self._deliver(deliveries)

    def _delivered(self, outputs: list[RequestOutput]) -> list[tuple[_Latest | None, RequestOutput]]:
        """Under the lock: each output with its queue; the queues of finished requests dropped."""
        deliveries = [(self._queues.get(o.request_id), o) for o in outputs]
        for out in outputs:
            if out.finished:
                self._queues.pop(out.request_id, None)
        return deliveries

    def _deliver(self, deliveries: list[tuple[_Latest | None, RequestOutput]]) -> None:
        for queue, out in deliveries:
            if queue is not None:
                self._loop.call_soon_threadsafe(queue.put, out)

    def _wait(self, launched) -> None:
        jax.block_until_ready(self.engine.device_outputs(launched))

    def _step_failed(self, error: BaseException) -> bool:
        """Under the lock, after a step raised: fail the requests it may have touched, reset the
        engine and check that it still runs a step. False when it cannot (the reset or the check
        failed too, or several processes run the steps: a follower whose call failed has exited):
        then every request fails with `EngineDeadError` and none is accepted. Requests that never
        ran stay queued, unless the last failure kept them too and no step succeeded since (then
        they may be what fails: a failure that drops nothing must not repeat forever)."""
        logger.error("engine step failed", exc_info=error)
        keep_waiting, self._keep_waiting = self._keep_waiting, False
        try:
            if jax.process_count() > 1:
                raise RuntimeError("a failed step cannot be recovered across processes")
            self.engine.reset(keep_waiting=keep_waiting)
            self.engine.probe()
        except BaseException as broken:  # noqa: BLE001 - the engine stops below
            logger.error("the engine cannot run a step after a failed one: stopping", exc_info=broken)
            self.error = EngineDeadError(f"engine step failed: {error!r}; then {broken!r}")
            self._fail_all(self.error)
            return False
        # Every queue but those of the requests kept: a request the failed step finished before it
        # raised is no longer the engine's, and its output was never delivered.
        kept = self.engine.unfinished_ids()
        failure = StepFailedError(f"engine step failed: {error!r}; the request was dropped")
        for request_id in [rid for rid in self._queues if rid not in kept]:
            self._loop.call_soon_threadsafe(self._queues.pop(request_id).put, failure)
        return True

    def _fail_all(self, error: BaseException) -> None:
        for request_id, queue in list(self._queues.items()):
            try:
                self.engine.abort(request_id)  # a no-op after reset(); a broken engine may raise
            except BaseException:  # noqa: BLE001 - the request fails with `error` either way
                pass
            self._loop.call_soon_threadsafe(queue.put, error)
        self._queues.clear()
