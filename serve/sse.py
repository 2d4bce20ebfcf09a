"""Server-sent events for streamed completions: one `data: {json}` per chunk, `data: [DONE]` last.

An error after the stream started cannot change the status any more, so it goes out as
`data: {"error": {...}}` before `[DONE]` (as vLLM does). A client that disconnects cancels the
stream at once (a watcher task reads the ASGI disconnect), and the chunk iterator is closed in
every case, which aborts the engine requests behind it (serve/generation.py). Non-streamed
responses use the same watcher (`run_unless_disconnected`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, TypeVar

from serve.protocol import OpenAIError

logger = logging.getLogger("serve")
T = TypeVar("T")


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DISCONNECTED = object()  # run_unless_disconnected's result when the client went away first


async def until_disconnect(receive: Any) -> None:
    """Returns once the ASGI server reports that the client disconnected (read after the request
    body, so the body is not taken from the route)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(receive: Any, work: Awaitable[T]) -> T | object:
    """`work`'s result, or DISCONNECTED once the client went away first; `work` is then cancelled
    (and awaited, so what it holds is released before this returns)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return task.result() if not task.cancelled() else DISCONNECTED


class EventStreamResponse:
    """An ASGI response streaming `chunks` as server-sent events."""

    def __init__(self, chunks: AsyncIterator[dict]):
        self.chunks = chunks

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})

        writer = asyncio.create_task(self._write(send))
        watcher = asyncio.create_task(until_disconnect(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)

    async def _write(self, send: Any) -> None:
        try:
            try:
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": _event(chunk), "more_body": True})
            except OpenAIError as error:
                await send({"type": "http.response.body", "body": _event(error.body()), "more_body": True})
            except Exception as error:  # noqa: BLE001  (the status is sent already: report in the stream)
                logger.exception("stream failed")
                body = OpenAIError(f"internal error: {error}", status=500).body()
                await send({"type": "http.response.body", "body": _event(body), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            await self.chunks.aclose()


def sse_response(chunks: AsyncIterator[dict]) -> EventStreamResponse:
    return EventStreamResponse(chunks)
