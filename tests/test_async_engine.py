"""The asyncio engine: concurrent streams, each identical to the synchronous engine's output,
aborts at any moment that free everything, errors that stay with their request, clean shutdown."""

from __future__ import annotations

import asyncio

import pytest

from dsv4_jax import LLM, SamplingParams
from dsv4_jax.engine.async_engine import AsyncLLMEngine, EngineDeadError
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
    request meanwhile return at once (they used to wait for the whole step, freezing the event
    loop and every stream), an aborted request's last output holds only the tokens known (not
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
            assert release.wait(10), "the event loop was blocked while the step thread waited"
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
    assert waited < 5
    aborted = first_outputs[-1].outputs[0]
    assert aborted.finish_reason == "abort" and aborted.token_ids == [] and aborted.text == ""
    assert second_outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert _free_state(llm) == (0, 0, 0.0)
