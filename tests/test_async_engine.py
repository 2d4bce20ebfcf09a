"""The asyncio engine: concurrent streams, each identical to the synchronous engine's output,
aborts at any moment that free everything, errors that stay with their request, clean shutdown."""

from __future__ import annotations

import asyncio

import pytest

from dsv4_jax import LLM, SamplingParams
from dsv4_jax.engine.async_engine import AsyncLLMEngine, EngineDeadError, StepFailedError
from dsv4_jax.presets import get_config
from dsv4_jax.testing import write_random_checkpoint

from conftest import TINY_ENGINE_LAYERS, tiny_engine_args  # tests/ is on sys.path

CONFIG = get_config("dsv4-tiny-test").replace(**TINY_ENGINE_LAYERS)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("async") / "ckpt", CONFIG, seed=11)
    return LLM(str(path), **tiny_engine_args())  # tests/test_engine.py's engine: its executables are shared


PROMPTS = [[0, 11 + i, 23, 37 + 3 * i, 41, 53 + i] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _free_state(llm):
    scheduler = llm.engine.scheduler
    return scheduler.num_running, scheduler.num_waiting, scheduler.kv_cache_usage


def test_concurrent_streams_equal_the_synchronous_engine(llm):
    expected = [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()

        async def one(i):
            seen = []
            async for out in engine.generate(f"s{i}", PROMPTS[i], GREEDY):
                seen.append(len(out.outputs[0].token_ids))
            return out.outputs[0].token_ids, seen, out.outputs[0].finish_reason

        results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        await engine.shutdown()
        return results

    for (tokens, seen, reason), want in zip(asyncio.run(main()), expected):
        # More requests than max_num_seqs run at once: batches differ from the synchronous run,
        # but greedy tokens of this float32 engine agree (its top-1/top-2 gaps are far above 1e-3).
        assert tokens == want and reason == "length"
        assert seen == sorted(seen) and seen[-1] == 12 and len(seen) > 1  # streamed, token by token
    assert _free_state(llm) == (0, 0, 0.0)


def test_a_consumer_that_stops_listening_aborts_its_request(llm):
    async def main():
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        stream = engine.generate("leaver", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await stream.aclose()  # what a disconnected client's handler does
        other = [o async for o in engine.generate("stayer", PROMPTS[1], GREEDY)]
        await engine.shutdown()
        return other[-1]

    last = asyncio.run(main())
    assert last.finished and len(last.outputs[0].token_ids) == 12
    assert _free_state(llm) == (0, 0, 0.0)


def test_a_bad_request_fails_alone_and_shutdown_aborts_what_is_left(llm):
    async def main():
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate("too-long", PROMPTS[0], SamplingParams(max_tokens=1000)):
                pass
        long_run = engine.generate("long", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        first = await long_run.__anext__()
        await engine.shutdown(grace_seconds=0.0)
        rest = [o async for o in long_run]
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("late", PROMPTS[0], GREEDY):
                pass
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert _free_state(llm) == (0, 0, 0.0)


def test_requests_come_and_go_while_a_step_waits_for_the_device(llm):
    """The step thread waits for the device without the engine's lock: adding and aborting a
    request meanwhile return at once (waiting for the whole step would freeze the event loop and
    every stream), an aborted request's last output holds only the tokens known (not
    the one the device still computes), and the step then applies its tokens to the others."""
    import threading
    import time

    (expected,) = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    parked, release = threading.Event(), threading.Event()

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        real_wait = engine._wait

        def held(launched):  # the device "computes" until the test says so
            parked.set()
            assert release.wait(60), "the event loop was blocked while the step thread waited"
            real_wait(launched)

        engine._wait = held
        await engine.start()
        first = engine.add_request("first", PROMPTS[0], GREEDY)
        assert await asyncio.to_thread(parked.wait, 30)  # its prefill is on the device
        t0 = time.monotonic()
        second = engine.add_request("second", PROMPTS[1], GREEDY)
        await engine.abort("first")
        waited = time.monotonic() - t0
        release.set()
        first_outputs = [o async for o in first]
        second_outputs = [o async for o in second]
        await engine.shutdown()
        return waited, first_outputs, second_outputs

    waited, first_outputs, second_outputs = asyncio.run(main())
    # Milliseconds when the lock is not held; blocked, they would wait for the release (60 s).
    assert waited < 30
    aborted = first_outputs[-1].outputs[0]
    assert aborted.finish_reason == "abort" and aborted.token_ids == [] and aborted.text == ""
    assert second_outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert _free_state(llm) == (0, 0, 0.0)


def test_a_consumer_that_falls_behind_gets_the_newest_output_not_a_backlog(llm):
    """Outputs are cumulative (each holds the whole text so far): one that nobody has taken yet is
    replaced by the next, so a slow client costs one output of memory, not one per token."""
    async def main():
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        stream = engine.add_request("slow", PROMPTS[3], GREEDY)
        while llm.engine.has_unfinished():  # nothing is read until the request has run to its end
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the step thread's last delivery reaches the event loop
        outputs = [o async for o in stream]
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(main())
    # One output (the final one); two only if the reading began between the last two deliveries.
    assert 1 <= len(outputs) <= 2 and outputs[-1].finished
    assert len(outputs[-1].outputs[0].token_ids) == 12 and outputs[-1].outputs[0].finish_reason == "length"
    assert _free_state(llm) == (0, 0, 0.0)


def test_a_request_added_while_the_step_thread_fails_is_refused_not_left_hanging(llm, monkeypatch):
    """`add_request` checks that the engine serves before it takes the lock; the step thread can
    fail for good (and fail every request it knows) while the caller waits for that lock. The
    request must be refused then: added after the failure, no thread would ever serve it."""
    import threading

    def broken_probe():  # the padding step after the reset fails too: the engine stops for good
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(llm.engine, "probe", broken_probe)

    contended, release, in_finish = threading.Event(), threading.Event(), threading.Event()

    class Lock:  # a lock that tells when the event loop's thread starts waiting for it
        def __init__(self):
            self._lock = threading.Lock()

        def acquire(self, blocking=True, timeout=-1):
            if threading.current_thread().name != "dsv4-engine-steps":
                contended.set()
            return self._lock.acquire(blocking, timeout)

        def release(self):
            self._lock.release()

        __enter__ = acquire

        def __exit__(self, *exc):
            self.release()

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        engine._work = threading.Condition(Lock())
        real_wait = engine._wait

        def held(launched):
            release.wait(30)
            real_wait(launched)

        def failing_finish(launched):  # runs under the lock: fails once the event loop waits for it
            in_finish.set()
            assert contended.wait(30)
            raise RuntimeError("a step failed")

        engine._wait, llm.engine.finish_step = held, failing_finish
        await engine.start()
        first = engine.add_request("first", PROMPTS[0], GREEDY)
        contended.clear()  # from here only the next add_request waits for the lock on this thread
        release.set()
        assert await asyncio.to_thread(in_finish.wait, 30)  # the step thread holds the lock
        with pytest.raises(EngineDeadError, match="a step failed"):
            engine.add_request("late", PROMPTS[1], GREEDY)
        with pytest.raises(EngineDeadError):
            async for _ in first:
                pass
        await engine.shutdown(grace_seconds=0.0)

    try:
        asyncio.run(main())
    finally:
        del llm.engine.finish_step  # the class's own again
        llm.engine.reset()  # what the failed step left scheduled
    assert _free_state(llm) == (0, 0, 0.0) and not llm.engine.has_unfinished()


def _failing_steps(llm, failures: int):
    """Make the engine's next `failures` finish_step calls raise (then the real one again)."""
    real = type(llm.engine).finish_step
    left = [failures]

    def finish_step(launched):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected step failure")
        return real(llm.engine, launched)

    llm.engine.finish_step = finish_step


async def _served_after(engine, prompt):
    """A request served after the failures, and whether the engine accepts requests; then shut down."""
    after = [o async for o in engine.generate("after", prompt, GREEDY)]
    accepting = engine.accepting
    await engine.shutdown()
    return after, accepting


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(llm):
    """A step that raises costs the requests it may have touched (StepFailedError), not the
    engine: it resets and frees everything; requests that never ran (added while the failing step
    was on the device) stay queued and, like a request added afterwards, get exactly the
    synchronous engine's tokens."""
    import threading

    expected = [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    parked, release = threading.Event(), threading.Event()

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        real_wait = engine._wait

        def held(launched):  # the first step stays "on the device" until the others are added
            parked.set()
            assert release.wait(30)
            real_wait(launched)

        engine._wait = held
        await engine.start()
        _failing_steps(llm, 1)
        first = engine.add_request("first", PROMPTS[0], GREEDY)
        assert await asyncio.to_thread(parked.wait, 30)  # launched: the failing step holds it
        waiting = [engine.add_request(f"w{i}", PROMPTS[i], GREEDY) for i in range(1, 5)]
        release.set()
        with pytest.raises(StepFailedError, match="injected step failure"):
            async for _ in first:
                pass
        kept = [[o async for o in stream][-1] for stream in waiting]
        return (kept, *await _served_after(engine, PROMPTS[5]))

    try:
        kept, after, accepting = asyncio.run(main())
    finally:
        del llm.engine.finish_step
    assert accepting
    assert [o.outputs[0].token_ids for o in kept] == expected[1:5]
    assert after[-1].finished and after[-1].outputs[0].token_ids == expected[5]
    assert _free_state(llm) == (0, 0, 0.0) and not llm.engine.has_unfinished()


def test_a_request_that_fails_every_time_cannot_stop_the_engine(llm):
    """A client resending a request whose steps always fail (an OpenAI SDK retries a 500 twice):
    each attempt fails alone, the padding step after each reset passes, and the engine serves on."""
    async def main():
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        _failing_steps(llm, 5)
        seen = []
        for attempt in range(5):
            try:
                async for _ in engine.generate(f"poison{attempt}", PROMPTS[0], GREEDY):
                    pass
            except StepFailedError as error:
                seen.append(error)
        return (seen, *await _served_after(engine, PROMPTS[1]))

    try:
        seen, after, accepting = asyncio.run(main())
    finally:
        del llm.engine.finish_step
    assert len(seen) == 5 and accepting and after[-1].finished and len(after[-1].outputs[0].token_ids) == 12
    assert _free_state(llm) == (0, 0, 0.0) and not llm.engine.has_unfinished()


def test_when_the_engine_cannot_run_a_step_after_a_failure_it_stops_for_good(llm, monkeypatch):
    """A failed step whose padding step fails too (a lost device, a broken cache): the engine
    stops (EngineDeadError for what it held and for new requests; the server's /health turns
    503), rather than failing every request forever while looking healthy."""
    def broken_probe():
        raise RuntimeError("the device is gone")

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        _failing_steps(llm, 1)
        monkeypatch.setattr(llm.engine, "probe", broken_probe)
        with pytest.raises(EngineDeadError, match="the device is gone"):
            async for _ in engine.generate("r", PROMPTS[0], GREEDY):
                pass
        with pytest.raises(EngineDeadError, match="injected step failure"):
            engine.add_request("late", PROMPTS[1], GREEDY)
        accepting = engine.accepting
        await engine.shutdown(grace_seconds=0.0)
        return accepting

    try:
        accepting = asyncio.run(main())
    finally:
        del llm.engine.finish_step
        llm.engine.reset()  # what the failed step left scheduled
    assert not accepting
    assert _free_state(llm) == (0, 0, 0.0) and not llm.engine.has_unfinished()


def test_a_request_the_failed_step_finished_gets_the_error_too(llm):
    """A step that finishes a request and then raises (its outputs never delivered): the finished
    request is no longer the engine's, but its stream must still end, with the error."""
    real = type(llm.engine).finish_step

    def finish_then_fail(launched):
        real(llm.engine, launched)
        raise RuntimeError("failed after applying the tokens")

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        llm.engine.finish_step = finish_then_fail
        short = engine.generate("short", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        with pytest.raises(StepFailedError, match="failed after applying"):
            await asyncio.wait_for(short.__anext__(), 30)
        del llm.engine.finish_step
        return await _served_after(engine, PROMPTS[1])

    try:
        after, accepting = asyncio.run(main())
    finally:
        vars(llm.engine).pop("finish_step", None)
    assert accepting and after[-1].finished and len(after[-1].outputs[0].token_ids) == 12
    assert _free_state(llm) == (0, 0, 0.0) and not llm.engine.has_unfinished()


def test_a_failure_that_drops_no_request_does_not_repeat_forever(llm, monkeypatch):
    """Scheduling raises while only requests that never ran exist: the first failure keeps them
    queued, the next one (no step succeeded between) fails them, and the engine serves on."""
    failures = []

    def broken_schedule():
        failures.append(1)
        raise RuntimeError("the scheduler failed")

    async def main():
        engine = AsyncLLMEngine(llm.engine)
        await engine.start()
        monkeypatch.setattr(llm.engine.scheduler, "schedule", broken_schedule)
        with pytest.raises(StepFailedError, match="the scheduler failed"):
            await asyncio.wait_for(engine.generate("waits", PROMPTS[0], GREEDY).__anext__(), 30)
        monkeypatch.undo()
        return await _served_after(engine, PROMPTS[1])

    after, accepting = asyncio.run(main())
    assert len(failures) == 2 and accepting and after[-1].finished and len(after[-1].outputs[0].token_ids) == 12
    assert _free_state(llm) == (0, 0, 0.0) and not llm.engine.has_unfinished()
