"""`POST /v1/completions`: raw prompts (text, or token ids) in, OpenAI text completions out, whole
or streamed. A text prompt is tokenized with exactly one BOS (as `/tokenize` and `LLM.generate`
do); `n` choices per prompt, choice index = prompt index x n + i, as OpenAI numbers them. A prompt
that truncate_prompt_tokens cut is echoed as its kept tokens decoded (vLLM detokenizes them)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator

from dsv4_jax.engine.outputs import Logprob, RequestOutput
from dsv4_jax.chat.tokens import BOS
from serve.choices import TextOffsets, TokenTexts, chunk_usage, completion_logprobs, prompt_logprobs, usage
from serve.generation import Generation, check_capacity, new_request_id
from serve.prompts import encode_prompts, truncated
from serve.protocol import CompletionRequest, parse_completion_request
from serve.sse import sse_response
from serve.state import ServingState

logger = logging.getLogger("serve")


class _Choice:
    def __init__(self, index: int, echo: str | None, prompt_is_text: bool, skip_special_tokens: bool,
                 prompt_tokens: int):
        self.index, self.echo = index, echo
        self.prompt_tokens = prompt_tokens  # its own prompt's (a request may hold several prompts)
        self.cached_tokens = 0  # of its prompt, served from the prefix cache at its admission
        self.prompt_is_text, self.skip_special_tokens = prompt_is_text, skip_special_tokens
        self.sent_chars = self.sent_tokens = 0
        self.text_offset = 0
        self.offsets: TextOffsets | None = None  # of the generated tokens, from the first advance on
        self.text: list[str] = []
        self.logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.finish_reason = self.stop_reason = None

    def _echo_offsets(self, texts: TokenTexts, prompt_ids: list[int], echo: str) -> list[int]:
        """Offsets of the prompt's tokens in the echoed prompt. A text prompt is echoed as given,
        without the BOS encode_prompt added; token prompts are echoed decoded, special tokens skipped."""
        offsets = TextOffsets(texts, 0)
        if self.prompt_is_text:
            if prompt_ids[:1] == [texts.tokenizer.token_to_id(BOS)] and not echo.startswith(BOS):
                return [0, *offsets.of(prompt_ids[1:], len(echo), lambda t: False)]
            return offsets.of(prompt_ids, len(echo), lambda t: False)
        return offsets.of(prompt_ids, len(echo), texts.is_special)

    def advance(self, out: RequestOutput, texts: TokenTexts, top: int | None) -> tuple[str, dict | None]:
        """The text and logprobs `out` adds. With echo, the prompt leads the first piece, and its
        tokens lead the logprobs (vLLM: the prompt logprobs, the first token's null)."""
        completion = out.outputs[0]
        self.prompt_logprobs = out.prompt_logprobs
        self.cached_tokens = out.num_cached_tokens or 0  # None until scheduled
        new_text = completion.text[self.sent_chars:]
        self.sent_chars = len(completion.text)
        tokens = completion.token_ids[self.sent_tokens:]
        entries = completion.logprobs[self.sent_tokens:] if completion.logprobs is not None else None
        self.sent_tokens = len(completion.token_ids)
        lead, echoing, self.echo = self.echo or "", self.echo is not None, None
        text = lead + new_text
        logprobs = None
        if entries is not None:  # offsets index the whole choice text (the echoed prompt first)
            if self.offsets is None:
                self.offsets = TextOffsets(texts, len(lead))
            skipped = texts.is_special if self.skip_special_tokens else (lambda t: False)
            offsets = self.offsets.of(tokens, self.text_offset + len(text), skipped)
            logprobs = completion_logprobs(texts, tokens, entries, top, offsets)
            if echoing and out.prompt_logprobs is not None:
                echo_offsets = self._echo_offsets(texts, out.prompt_token_ids, lead)
                echoed = completion_logprobs(texts, out.prompt_token_ids, out.prompt_logprobs, top, echo_offsets)
                logprobs = {key: echoed[key] + values for key, values in logprobs.items()}
            for key, values in logprobs.items():
                self.logprobs[key] += values
        self.text_offset += len(text)
        self.text.append(text)
        if completion.finish_reason is not None:
            self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason
        return text, logprobs


async def _prompt_ids(state: ServingState, prompts: list[str | list[int]],
                      keep: int | None) -> tuple[list[list[int]], list[bool]]:
    """Token ids of each prompt, the last `keep` of them (truncate_prompt_tokens), and whether
    that cut it; text prompts tokenized together, off the event loop."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await encode_prompts(state, texts, "prompt", check_length=keep is None) if texts else [])
    ids = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
    kept = [truncated(p, keep, state.max_model_len) for p in ids]
    return kept, [len(k) < len(p) for k, p in zip(kept, ids)]


async def create_completion(state: ServingState, body: Any):
    req: CompletionRequest = parse_completion_request(body, state.limits)
    if req.ignored_fields:
        logger.warning("ignoring unknown request fields: %s", ", ".join(req.ignored_fields))
    check_capacity(state, len(req.prompts) * req.params.n)  # before the work of tokenizing
    prompts, cut = await _prompt_ids(state, req.prompts, req.params.truncate_prompt_tokens)
    request_id = new_request_id("cmpl")
    generation = Generation(state, request_id, prompts, req.params, req.fields, cap_to_room=req.max_tokens_is_default)
    n = req.params.n
    texts = TokenTexts(state.tokenizer, req.return_tokens_as_token_ids)
    # A text prompt is echoed as given, unless truncate_prompt_tokens cut it (then as token prompts are).
    as_text = [isinstance(p, str) and not was_cut for p, was_cut in zip(req.prompts, cut)]
    echoes = [p if text else state.tokenizer.decode(ids, skip_special_tokens=True)
              for p, ids, text in zip(req.prompts, prompts, as_text)]
    choices = [_Choice(i, echoes[i // n] if req.echo else None, as_text[i // n],
                       req.params.skip_special_tokens, len(prompts[i // n])) for i in range(len(prompts) * n)]
    created = int(time.time())
    usage_prompt = sum(len(p) for p in prompts)  # each prompt once, whatever n is (as OpenAI)
    if req.stream:
        return sse_response(_stream(req, request_id, created, generation, choices, texts, usage_prompt))
    try:
        async with contextlib.aclosing(generation.outputs()) as outputs:
            async for index, out in outputs:
                choices[index].advance(out, texts, req.params.logprobs)
    finally:
        generation.close()
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": req.model,
        "choices": [{"index": c.index, "text": "".join(c.text),
                     "logprobs": c.logprobs if req.params.logprobs is not None else None,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "prompt_logprobs": None if c.prompt_logprobs is None else prompt_logprobs(texts, c.prompt_logprobs)}
                    for c in choices],
        "usage": usage(usage_prompt, sum(c.sent_tokens for c in choices), _cached_tokens(req, choices)),
    }


def _cached_tokens(req: CompletionRequest, choices: list[_Choice]) -> int | None:
    """The response's prompt tokens served from the prefix cache, as its prompt tokens are
    counted: each prompt once whatever n is, so its first choice's (each choice is an engine
    request of its own, looked up at its own admission). None without --enable-prompt-tokens-details."""
    if not req.prompt_tokens_details:
        return None
    return sum(c.cached_tokens for c in choices[::req.params.n])



async def _stream(req: CompletionRequest, request_id: str, created: int, generation: Generation,
                  choices: list[_Choice], texts: TokenTexts, usage_prompt: int) -> AsyncIterator[dict]:
    head = {"id": request_id, "object": "text_completion", "created": created, "model": req.model}
    try:
        async with contextlib.aclosing(generation.outputs()) as outputs:
            async for index, out in outputs:
                choice = choices[index]
                text, logprobs = choice.advance(out, texts, req.params.logprobs)
                if text or logprobs or choice.finish_reason is not None:
                    entry = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
                    if choice.finish_reason is not None:
                        entry["stop_reason"] = choice.stop_reason
                    yield {**head, "choices": [entry], **chunk_usage(req, choice.prompt_tokens, choice.sent_tokens)}
    finally:
        generation.close()
    if req.include_usage:
        yield {**head, "choices": [],
               "usage": usage(usage_prompt, sum(c.sent_tokens for c in choices), _cached_tokens(req, choices))}
