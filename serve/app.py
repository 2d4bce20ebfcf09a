"""The Starlette app: routes, the API key, request bodies, and errors as OpenAI error bodies.

Routes: `GET /v1/models`, `POST /v1/chat/completions` (serve/chat.py), `POST /v1/completions`
(serve/completions.py), `POST /tokenize`, `POST /detokenize`, `GET /version`, `GET /health`
(503 until warm-up is done, and while shutting down), `GET /metrics` (Prometheus, vLLM's names),
`GET /` (a chat page, unless `--no-web-ui`); with `VLLM_SERVER_DEV_MODE=1`, vLLM's development
endpoint `POST /reset_prefix_cache` (200 once emptied, 409 while requests run or wait).
With `--api-key`, every route but `/health`, `/metrics` and `/version` wants `Authorization:
Bearer <key>` (vLLM leaves the first two open too). Bodies over `MAX_BODY_BYTES` get 413, bodies
that are not JSON (or hold a lone UTF-16 surrogate) 400, anything unexpected 500: always
`{"error": {...}}`, never a traceback. A client that disconnects aborts its request, whether it
is streamed or not.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from dsv4_jax.chat import InvalidRequestField, build_prompt
from dsv4_jax.engine.async_engine import EngineDeadError
from dsv4_jax.chat.tokenizer import encode_prompt
from serve.chat import create_chat_completion
from serve.choices import TokenTexts
from serve.completions import create_completion
from serve.protocol import OpenAIError, parse_detokenize_request, parse_tokenize_request
from serve.sse import DISCONNECTED, run_unless_disconnected
from serve.state import ServingState

logger = logging.getLogger("serve")

MAX_BODY_BYTES = 16 * 2**20  # far above any prompt of max_model_len tokens written as JSON
OPEN_PATHS = ("/health", "/metrics", "/version", "/")  # the page itself; its API calls carry the key
CHAT_PAGE = Path(__file__).resolve().parent / "web" / "chat.html"


def _version() -> str:
    try:
        return importlib.metadata.version("dsv4-jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _json_body(request: Request) -> Any:
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type not in ("application/json", ""):
        raise OpenAIError(f"Content-Type must be application/json, got {content_type!r}", status=415)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise OpenAIError(f"request body of {declared} bytes exceeds the limit of {MAX_BODY_BYTES}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise OpenAIError(f"request body exceeds the limit of {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise OpenAIError(f"request body is not valid UTF-8: {error}") from None
    except json.JSONDecodeError as error:
        raise OpenAIError(f"request body is not valid JSON: {error}") from None
    except RecursionError:  # json.loads gives up around 1000 levels deep
        raise OpenAIError("request body is not valid JSON: nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw) and _holds_lone_surrogate(body):
        raise OpenAIError("request body is not valid UTF-8: a string holds a lone UTF-16 surrogate "
                          "(a \\ud800-\\udfff escape without its pair)")
    return body


# json.loads accepts "\ud800" escapes without their pair, giving strings no UTF-8 can encode (the
# tokenizer and the JSON renderer of any error naming them fail). Only such an escape can put a
# surrogate in a body that decoded as UTF-8, so most bodies skip the check after one C-speed search.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _holds_lone_surrogate(body: Any) -> bool:
    """Whether some string of `body` (a key too) holds a surrogate that no pair completed."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # one pass, in C
    except UnicodeEncodeError:
        return True
    return False


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; if the client disconnects first, `work` is cancelled (a non-streamed
    response's generation then aborts its engine requests, as vLLM's `with_cancellation`) and an
    empty 499 stands for the response nobody will read. Streamed responses watch on their own."""
    result = await run_unless_disconnected(request.receive, work)
    return Response(status_code=499) if result is DISCONNECTED else result


def _check_access(state: ServingState, request: Request, needs_engine: bool) -> None:
    """Raises the OpenAI error for a missing API key, a model still loading or a server shutting down."""
    key = state.args.api_key
    if key and request.url.path not in OPEN_PATHS:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise OpenAIError("invalid or missing API key (Authorization: Bearer <key>)", status=401)
    if needs_engine and not state.ready:
        raise OpenAIError("the model is still loading; retry when GET /health answers 200"
                          if state.accepting else "the server is shutting down", status=503)
    if needs_engine and not state.accepting:
        raise OpenAIError("the server is shutting down", status=503)


Handler = Callable[[ServingState, Request], Awaitable[Any]]
Endpoint = Callable[[Request], Awaitable[Response]]


def _guarded(state: ServingState, handler: Handler, *, needs_engine: bool = True) -> Endpoint:
    """Auth, readiness and error mapping around one route; a dict result becomes JSON."""

    async def endpoint(request: Request) -> Response:
        try:
            _check_access(state, request, needs_engine)
            result = await handler(state, request)
        except OpenAIError as error:
            return error_response(error)
        except EngineDeadError as error:
            return error_response(OpenAIError(str(error), status=503))
        except Exception as error:  # noqa: BLE001  (a bug: one line in the log, a 500 to the client)
            logger.exception("request failed")
            return error_response(OpenAIError(f"internal error: {type(error).__name__}: {error}", status=500))
        return JSONResponse(result) if isinstance(result, dict) else result

    return endpoint


# The capacity check (--max-waiting-requests) is made by each route once it knows how many
# sequences the request adds (serve/generation.py, check_capacity).
async def _chat(state: ServingState, request: Request) -> Any:
    body = await _json_body(request)
    return await _unless_disconnected(request, create_chat_completion(state, body))


async def _completions(state: ServingState, request: Request) -> Any:
    body = await _json_body(request)
    return await _unless_disconnected(request, create_completion(state, body))


async def _models(state: ServingState, request: Request) -> dict[str, Any]:
    spec, layout = state.config.kv, state.layout
    kv = {
        "kv_cache_dtype": spec.kv_cache_dtype, "attention_backend": spec.attention_backend,
        "indexer_dtype": spec.indexer_dtype, "device_kind": spec.device_kind,
        "summary": spec.summary(), "block_size": layout.block_size,
        "num_compressed_blocks": layout.num_compressed_blocks, "num_seq_slots": layout.num_seq_slots,
    }
    created = int(state.started_at)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "dsv4-jax", "root": str(state.args.model),
         "parent": None, "max_model_len": state.max_model_len, "dsv4": kv}
        for name in state.served_model_names]}


async def _tokenize(state: ServingState, request: Request) -> dict[str, Any]:
    req = parse_tokenize_request(await _json_body(request), state.limits)
    if req.prompt is not None:  # add_special_tokens (vLLM's, default true): the one BOS completions add
        # In a worker thread, as every prompt (serve/prompts.py): a long one must not stall the loop.
        if req.add_special_tokens:
            ids = await asyncio.to_thread(encode_prompt, state.tokenizer, req.prompt)
        else:
            encoded = await asyncio.to_thread(state.tokenizer.encode_batch, [req.prompt], add_special_tokens=False)
            ids = encoded[0].ids  # encode_batch releases the GIL (encode_prompt says more)
    else:
        try:
            prompt = build_prompt(req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs,
                                  reasoning_effort=req.reasoning_effort)
        except InvalidRequestField as error:
            raise OpenAIError(str(error), param=error.field) from None
        ids = await asyncio.to_thread(encode_prompt, state.tokenizer, prompt)
    body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if req.return_token_strs:
        texts = TokenTexts(state.tokenizer, as_token_ids=False)
        body["token_strs"] = [texts.text_of(t) for t in ids]
    return body


async def _detokenize(state: ServingState, request: Request) -> dict[str, Any]:
    req = parse_detokenize_request(await _json_body(request), state.limits)
    return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}


async def _get_version(state: ServingState, request: Request) -> dict[str, Any]:
    return {"version": _version()}


async def _health(state: ServingState, request: Request) -> Response:
    if state.ready and state.accepting and (state.engine is None or state.engine.accepting):
        return Response(status_code=200)
    if state.load_error or not state.accepting:
        raise OpenAIError(state.load_error or "shutting down", status=503)
    if state.ready:  # ready, and the engine stopped accepting: it failed for good
        raise OpenAIError("the engine failed and serves nothing more; restart the server", status=503)
    # Starting: the OpenAI error body, and where the start-up is (`startup`), e.g. compiling 3 of 5.
    progress = dict(state.startup)
    counted = f" {progress['done']}/{progress['total']}" if progress["total"] else ""
    body = OpenAIError(f"starting: {progress['phase']}{counted}", status=503).body()
    return JSONResponse({**body, "startup": progress}, status_code=503)


async def _metrics(state: ServingState, request: Request) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


async def _reset_prefix_cache(state: ServingState, request: Request) -> Response:
    # A running or waiting request may hold cached blocks or be about to look them up, so the engine
    # refuses then; the 409 tells the caller (a benchmark wanting a cold cache) that nothing changed.
    if not await state.engine.reset_prefix_cache():
        raise OpenAIError("the prefix cache can only be reset when no request is running or waiting; "
                          "retry once the server is idle", status=409)
    logger.info("prefix cache reset (POST /reset_prefix_cache)")
    return Response(status_code=200)


async def _chat_page(state: ServingState, request: Request) -> Response:
    # One static file, no build step and no outside assets (serve/web/chat.html).
    return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))


async def _not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    message = "method not allowed" if status == 405 else f"no route {request.url.path}"
    return error_response(OpenAIError(message, status=status))


def _routes(state: ServingState) -> list[Route]:
    routes = [
        Route("/v1/chat/completions", _guarded(state, _chat), methods=["POST"]),
        Route("/v1/completions", _guarded(state, _completions), methods=["POST"]),
        Route("/v1/models", _guarded(state, _models), methods=["GET"]),
        Route("/tokenize", _guarded(state, _tokenize), methods=["POST"]),
        Route("/detokenize", _guarded(state, _detokenize), methods=["POST"]),
        Route("/version", _guarded(state, _get_version, needs_engine=False), methods=["GET"]),
        Route("/health", _guarded(state, _health, needs_engine=False), methods=["GET"]),
        Route("/metrics", _guarded(state, _metrics, needs_engine=False), methods=["GET"]),
    ]
    if not state.args.no_web_ui:
        routes.append(Route("/", _guarded(state, _chat_page, needs_engine=False), methods=["GET"]))
    if state.args.dev_mode:  # as vLLM: absent (404, as any unknown path) unless VLLM_SERVER_DEV_MODE=1
        routes.append(Route("/reset_prefix_cache", _guarded(state, _reset_prefix_cache), methods=["POST"]))
    return routes


def build_app(state: ServingState) -> Starlette:
    """The app over `state`; the engine may still be loading (routes answer 503 until it is ready)."""
    routes = _routes(state)
    state.started_at = time.time()
    return Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_found})
