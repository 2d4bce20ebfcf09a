"""`POST /v1/chat/completions`: the V4 prompt from the request, the engine's tokens back as OpenAI
chat completions, whole or as server-sent events, with reasoning and tool calls split out by the
`deepseek_v4` parsers (dsv4_jax.chat) when the server was started with them.

tool_choice "required" and a named function are enforced by the grammar of a DSML tool call, as any
other structured-output constraint (serve/protocol.py builds and checks it; in thinking mode the
engine applies it from the model's own `</think>` on, unless --structured-outputs-config says
`enable_in_reasoning`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator

from dsv4_jax.chat import (
    ChatStreamParser,
    InvalidRequestField,
    ReasoningSplitter,
    build_prompt,
    chat_parser,
    resolve_chat_options,
)
from serve.choices import ChoiceState, TokenTexts, chat_logprobs, chunk_usage, usage
from serve.generation import Generation, check_capacity, new_request_id
from serve.prompts import encode_prompts, truncated
from serve.protocol import ChatRequest, OpenAIError, parse_chat_request
from serve.sse import sse_response
from serve.state import ServingState

logger = logging.getLogger("serve")


class _ChatPlan:
    """One validated chat request, ready to run."""

    def __init__(self, state: ServingState, body: Any):
        self.request: ChatRequest = parse_chat_request(body, state.limits)
        req = self.request
        if req.ignored_fields:
            logger.warning("ignoring unknown request fields: %s", ", ".join(req.ignored_fields))
        try:
            prompt = build_prompt(req.messages, tools=req.tools, response_format=req.response_format,
                                  chat_template_kwargs=req.chat_template_kwargs, reasoning_effort=req.reasoning_effort)
            mode = resolve_chat_options(req.chat_template_kwargs, req.reasoning_effort).thinking_mode
        except InvalidRequestField as error:
            raise OpenAIError(str(error), param=error.field) from None
        self.thinking = mode == "thinking"
        self.prompt = prompt
        self.prompt_ids: list[int] = []  # by tokenize(), off the event loop
        # Tool calls are parsed when the request may make them; reasoning is split only with the
        # reasoning parser (without it, as in vLLM, everything is content).
        self.tools_active = req.tool_choice.kind in ("required", "function") or (
            req.tool_choice.kind == "auto" and state.limits.enable_auto_tool_choice)
        self.split_reasoning = state.limits.reasoning_parser is not None and self.thinking
        self.max_tool_calls = None if req.parallel_tool_calls else 1

    async def tokenize(self, state: ServingState) -> None:
        keep = self.request.params.truncate_prompt_tokens
        (ids,) = await encode_prompts(state, [self.prompt], "messages", check_length=keep is None)
        self.prompt_ids = truncated(ids, keep, state.max_model_len)

    def parser(self) -> ChatStreamParser | ReasoningSplitter | None:
        return chat_parser(self.tools_active, self.split_reasoning)



async def create_chat_completion(state: ServingState, body: Any):
    plan = _ChatPlan(state, body)
    req = plan.request
    check_capacity(state, req.params.n)  # before the work of tokenizing
    await plan.tokenize(state)
    request_id = new_request_id("chatcmpl")
    generation = Generation(state, request_id, [plan.prompt_ids], req.params, req.fields,
                            cap_to_room=req.max_tokens_is_default)
    texts = TokenTexts(state.tokenizer, req.return_tokens_as_token_ids)
    choices = [ChoiceState(i, plan.parser(), plan.max_tool_calls) for i in range(req.params.n)]
    created = int(time.time())
    if req.stream:
        return sse_response(_stream(state, plan, request_id, created, generation, choices, texts))
    totals = [0] * req.params.n
    cached = 0
    logprobs: list[list[dict]] = [[] for _ in choices]
    try:
        async with contextlib.aclosing(generation.outputs()) as outputs:
            async for index, out in outputs:
                completion = out.outputs[0]
                _, tokens, entries = choices[index].advance(completion)
                totals[index] = len(completion.token_ids)
                cached = _cached_tokens(index, out, cached)
                if entries is not None:
                    logprobs[index] += chat_logprobs(texts, tokens, entries, req.params.logprobs)
    finally:
        generation.close()
    body = {
        "id": request_id, "object": "chat.completion", "created": created, "model": req.model,
        "choices": [{"index": c.index, "message": c.message(plan.split_reasoning),
                     "logprobs": {"content": logprobs[c.index]} if req.params.logprobs is not None else None,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices],
        "usage": usage(len(plan.prompt_ids), sum(totals), cached if req.prompt_tokens_details else None),
    }
    return body


def _cached_tokens(index: int, out: Any, cached: int) -> int:
    """The response's cached prompt tokens after choice `index`'s output `out`: the first
    choice's. Each choice is an engine request of its own, looked up in the prefix cache at its
    own admission; the prompt is counted once whatever n is (usage.prompt_tokens), so are these."""
    return (out.num_cached_tokens or 0) if index == 0 else cached


async def _stream(state: ServingState, plan: _ChatPlan, request_id: str, created: int, generation: Generation,
                  choices: list[ChoiceState], texts: TokenTexts) -> AsyncIterator[dict]:
    req = plan.request
    head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": req.model}
    totals = [0] * len(choices)
    cached = 0

    def chunk(index: int, delta: dict, logprobs: Any = None, finish_reason: str | None = None,
              stop_reason: Any = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**head, "choices": [choice], **chunk_usage(req, len(plan.prompt_ids), totals[index])}

    try:
        started = False
        async with contextlib.aclosing(generation.outputs()) as outputs:
            async for index, out in outputs:
                if not started:
                    # Each choice's role chunk goes out with the first output, as vLLM's server
                    # sends it: a client that times its first chunk (vLLM's benchmark does) then
                    # measures the time to the first token, not the HTTP round trip.
                    started = True
                    for c in choices:
                        yield chunk(c.index, {"role": "assistant", "content": ""})
                completion = out.outputs[0]
                choice = choices[index]
                delta, tokens, entries = choice.advance(completion)
                totals[index] = len(completion.token_ids)
                cached = _cached_tokens(index, out, cached)
                logprobs = {"content": chat_logprobs(texts, tokens, entries, req.params.logprobs)} \
                    if entries is not None and tokens else None
                if delta or logprobs or choice.finish_reason is not None:
                    yield chunk(index, delta, logprobs, choice.finish_reason, choice.stop_reason)
    finally:
        generation.close()
    if req.include_usage:
        yield {**head, "choices": [],
               "usage": usage(len(plan.prompt_ids), sum(totals), cached if req.prompt_tokens_details else None)}
