"""OpenAI request bodies -> typed requests, or an `OpenAIError` (a 4xx body as OpenAI writes it).

The server's routes hand each parsed JSON body to `parse_chat_request`, `parse_completion_request`,
`parse_tokenize_request` or `parse_detokenize_request`; whatever the body holds, these raise
nothing but `OpenAIError`, whose `param` names the field as the request spells it
(`messages[1].content`, `stream_options.include_usage`, `logit_bias`). Plain Python: no jax, no
tokenizer (token ids are checked against `ServerLimits.vocab_size`; structured-output constraints
with llguidance's own checks, which need none).

Behaviour follows vLLM's OpenAI server (`vllm/entrypoints/openai/protocol.py`, `serving_chat.py`,
`sampling_params.py`), read for this module; where vLLM and OpenAI differ, vLLM wins, as the server
is a drop-in for `vllm serve`. The points checked there:

* `model` may be left out (the first served name); an unknown one is 404 `model_not_found`.
* Text content parts are joined with "\\n" (vLLM's chat_utils); other parts are refused (text only).
* `logit_bias` keys are token ids written as strings; values are clamped to [-100, 100] and ids
  outside the vocabulary refused (vLLM's `SamplingParams.from_optional` and logits processor).
* chat: `max_completion_tokens` wins over `max_tokens` when both are given; left out, the engine
  uses the room left under max_model_len, or the smaller of it and generation_config's max_tokens
  when the server has one. completions: `max_tokens` defaults to 16 (OpenAI, vLLM: refused like a
  sent value when the prompt leaves less); an explicit null means the server's default, capped
  likewise, or else the room.
* `top_logprobs` > 0 needs `logprobs: true`; 0 without it is accepted, as vLLM does.
* `stream_options` only with `stream: true`; given, its `include_usage` defaults to true (vLLM);
  `continuous_usage_stats` with `include_usage` puts the usage so far in every chunk (vLLM's
  `should_include_usage`: the choice's own completion tokens; the last chunk sums the choices).
  The server's `--enable-force-include-usage` turns both on for every stream.
  Its `--enable-prompt-tokens-details` adds `prompt_tokens_details.cached_tokens` to the usage
  (the whole response's and the last chunk's, not the continuous ones, as vLLM).
* tools: no `tool_choice` with non-empty `tools` means "auto" (OpenAI, vLLM's `check_tool_usage`),
  and vLLM refuses that implicit "auto" too unless auto tool choice is enabled on the server
  (`serving_chat.py` tests the resolved value). `tool_choice` other than "none" needs `tools`;
  "required" with an empty list becomes "none". Tools stay in the prompt for "none" (vLLM's
  default, `--exclude-tools-when-tool-choice-none` off). A null `tool_choice` counts as left out.
* completions: with `echo` and `logprobs`, `prompt_logprobs` defaults to `logprobs`, and the
  prompt's tokens lead the choice's logprobs (the first one null), streamed too; an explicit
  `prompt_logprobs` cannot be streamed, and comes back in each choice's `prompt_logprobs` (vLLM).
* structured outputs (`SamplingParams.structured_outputs`, both endpoints): vLLM's extra-body
  `structured_outputs` object (exactly one of json, json_object, regex, choice, grammar,
  structural_tag, with its options), or `response_format` json_object / json_schema (`text` asks
  for nothing), or tool_choice "required" / a named function (a grammar of the DSML tool call,
  `dsv4_jax.chat.tool_grammar`); two of these in one request are a 400. Each is checked here
  (`check_structured_outputs`: an invalid schema, regex or grammar is a 400 before anything is
  queued) and errors name the field as the request wrote it. vLLM's removed `guided_*` fields are
  a 400 naming their `structured_outputs` replacement, where vLLM ignores them silently.
* `allowed_token_ids` (non-empty, in the vocabulary), `bad_words` (strings, none blank) and
  `truncate_prompt_tokens` (>= 1, or -1 for max_model_len; vLLM's rules) go to SamplingParams.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4_jax.chat import InvalidRequestField, check_messages, check_tools, resolve_chat_options
from dsv4_jax.chat.tool_grammar import tool_call_grammar
from dsv4_jax.engine.request import RequestRejected
from dsv4_jax.engine.sampling_params import GENERATION_KEYS, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from dsv4_jax.engine.structured_outputs import (
    KINDS,
    StructuredOutputsConfig,
    StructuredOutputsParams,
    check_structured_outputs,
)

_INT64 = (-(2**63), 2**63 - 1)  # integer fields beyond this would overflow the engine's arrays
_LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value; vLLM clamps to it
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
_TOOL_CHOICES = ("none", "auto", "required")
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# generation_config.json defaults the server may apply (vLLM's get_diff_sampling_param keys).
_DEFAULT_SAMPLING_KEYS = tuple(GENERATION_KEYS.values())
_HARMLESS = ("user", "store", "metadata", "service_tier", "request_id")  # accepted, not used

_ERROR_TYPES = {
    401: "authentication_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
_ERROR_CODES = {401: "invalid_api_key"}  # a 404 is not always a model: unknown routes are 404s too


class OpenAIError(Exception):
    """An error the server answers with `status` and `body()`, OpenAI's error object.

    `type` defaults by status: "invalid_request_error" for 4xx (OpenAI's 400/404/413/422),
    "authentication_error" for 401, "service_unavailable_error" for 503, "internal_server_error"
    for other 5xx; `code` defaults to "invalid_api_key" for 401 (an unknown model's 404 names
    "model_not_found" itself; an unknown route's 404 has no code).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str | None = None,  # OpenAI's name for the field
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        default_type = "internal_server_error" if status >= 500 else "invalid_request_error"
        self.type = type if type is not None else _ERROR_TYPES.get(status, default_type)
        self.param = param
        self.code = code if code is not None else _ERROR_CODES.get(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServerLimits:
    """What the app knows at start-up. `max_n` caps `n` (each choice holds a sequence of the
    batch and its KV blocks, so one request cannot take the whole pool); `default_sampling` holds
    generation_config.json's defaults, used for fields a request leaves out."""

    served_model_names: tuple[str, ...]
    vocab_size: int
    max_logprobs: int = 20
    max_n: int = 16
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    force_include_usage: bool = False  # --enable-force-include-usage: every stream carries usage, continuously
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage says how much of the prompt was cached
    default_sampling: Mapping[str, Any] = field(default_factory=dict)
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # The engine's --structured-outputs-config: its JSON defaults shape the grammar a request is checked as.
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    def __post_init__(self) -> None:
        names = self.served_model_names
        if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"ServerLimits.served_model_names must be a non-empty tuple of names, got {names!r}")
        for name, low, high in (("vocab_size", 1, None), ("max_logprobs", 0, MAX_LOGPROBS), ("max_n", 1, None)):
            value = getattr(self, name)
            if not _is_int(value) or value < low or (high is not None and value > high):
                raise ValueError(f"ServerLimits.{name} must be an int in [{low}, {high or 'inf'}], got {value!r}")
        for name in ("default_sampling", "default_chat_template_kwargs"):
            if not isinstance(getattr(self, name), Mapping):
                raise ValueError(f"ServerLimits.{name} must be a mapping, got {getattr(self, name)!r}")
        unknown = sorted(map(str, set(self.default_sampling) - set(_DEFAULT_SAMPLING_KEYS)))
        if unknown:
            raise ValueError(
                f"ServerLimits.default_sampling has unknown keys {unknown}; allowed: {list(_DEFAULT_SAMPLING_KEYS)}"
            )
        try:
            SamplingParams(**self.default_sampling)
        except ValueError as error:
            raise ValueError(f"ServerLimits.default_sampling (generation_config.json defaults): {error}") from None
        try:
            resolve_chat_options(dict(self.default_chat_template_kwargs))
        except InvalidRequestField as error:
            raise ValueError(f"ServerLimits.default_chat_template_kwargs: {error}") from None
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            raise ValueError(f"ServerLimits.structured_outputs_config must be a StructuredOutputsConfig, "
                             f"got {self.structured_outputs_config!r}")


@dataclass(frozen=True)
class ToolChoice:
    kind: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # the tool's name, for "function"


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict]  # content as text, `reasoning` moved to `reasoning_content`
    tools: list[dict] | None  # kept for tool_choice "none" (vLLM); None when none were given
    tool_choice: ToolChoice
    response_format: dict | None  # for the encoder's schema paragraph; its constraint is in params
    chat_template_kwargs: dict  # the server's defaults updated by the request's
    reasoning_effort: str | None
    params: SamplingParams  # logprobs = top_logprobs when `logprobs` is true, else None
    stream: bool
    include_usage: bool
    continuous_usage: bool  # every chunk carries the usage so far (stream_options.continuous_usage_stats)
    return_tokens_as_token_ids: bool
    parallel_tool_calls: bool
    ignored_fields: tuple[str, ...]  # unknown top-level fields, for one warning
    max_tokens_field: str = "max_tokens"  # or max_completion_tokens: the field the limit came from
    max_tokens_is_default: bool = False  # the server's default, not the client's: capped to the room left
    prompt_tokens_details: bool = False  # the server's --enable-prompt-tokens-details
    # The engine's names of the constraint (structured_outputs.<kind>) -> where the request wrote it.
    constraint_fields: Mapping[str, str] = field(default_factory=dict)

    @property
    def fields(self) -> dict[str, str]:
        """The engine's names of request fields (`RequestRejected.param`) -> this request's."""
        return {"prompt": "messages", "max_tokens": self.max_tokens_field, **self.constraint_fields}


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # one entry per prompt of the batch
    echo: bool
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # every chunk carries the usage so far (stream_options.continuous_usage_stats)
    return_tokens_as_token_ids: bool
    ignored_fields: tuple[str, ...]
    max_tokens_is_default: bool = False  # null: the server's default, capped to the room left
    prompt_tokens_details: bool = False  # the server's --enable-prompt-tokens-details
    # The engine's names of the constraint (structured_outputs.<kind>) -> where the request wrote it.
    constraint_fields: Mapping[str, str] = field(default_factory=dict)

    @property
    def fields(self) -> dict[str, str]:
        """The engine's names of request fields (`RequestRejected.param`) -> this request's."""
        return dict(self.constraint_fields)


@dataclass(frozen=True)
class TokenizeRequest:
    """Either `prompt` (a string) or `messages` is set; the chat fields are checked as for
    /v1/chat/completions and are for `dsv4_jax.chat.build_prompt`."""

    model: str
    prompt: str | None
    messages: list[dict] | None
    tools: list[dict] | None
    chat_template_kwargs: dict
    reasoning_effort: str | None
    add_special_tokens: bool  # vLLM: true for a prompt, false for chat (the encoder writes BOS)
    return_token_strs: bool
    ignored_fields: tuple[str, ...]


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str
    tokens: list[int]
    ignored_fields: tuple[str, ...]


# ---- values -------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    """The JSON kind of a value, for messages."""
    for types, name in (
        (type(None), "null"),
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    ):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _shown(value: object) -> str:
    """A short, always printable account of a value (no huge reprs in error messages)."""
    if isinstance(value, str):
        return repr(value[:60]) + ("..." if len(value) > 60 else "")
    if _is_int(value) and abs(value) < 10**30:
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return _kind(value)


def _invalid(param: str | None, reason: str) -> OpenAIError:
    return OpenAIError(f"Invalid value for '{param}': {reason}" if param else reason, param=param)


def _from_chat_error(error: InvalidRequestField) -> OpenAIError:
    return _invalid(error.field, str(error).removeprefix(f"{error.field}: "))


def _as_bool(value: Any, param: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(param, f"expected a boolean (true or false), got {_kind(value)}")
    return value


def _as_int(value: Any, param: str, low: int = _INT64[0], high: int = _INT64[1]) -> int | None:
    """An int in [low, high] or None; floats (2.0 too) and booleans are refused."""
    if value is None:
        return None
    if not _is_int(value):
        raise _invalid(param, f"expected an integer, got {_kind(value)}")
    if not low <= value <= high:
        allowed = (
            f"in [{low}, {high}]" if high < _INT64[1] else f">= {low}" if low > _INT64[0] else "in the int64 range"
        )
        raise _invalid(param, f"expected an integer {allowed}, got {_shown(value)}")
    return value


def _as_number(value: Any, param: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _invalid(param, f"expected a number, got {_kind(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        raise _invalid(param, "expected a finite number, got an integer too large for a float") from None
    if not math.isfinite(number):
        raise _invalid(param, f"expected a finite number, got {number}")
    return number


def _as_object(value: Any, param: str) -> dict | None:
    if value is not None and not isinstance(value, dict):
        raise _invalid(param, f"expected an object, got {_kind(value)}")
    return value


def _as_string(value: Any, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _invalid(param, f"expected a string, got {_kind(value)}")
    return value


def _token_ids(value: Any, param: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise _invalid(param, f"expected an array of token ids, got {_kind(value)}")
    for j, token in enumerate(value):
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise _invalid(param, f"item {j} is not a token id in [0, {vocab_size}): {_shown(token)}")
    return list(value)


# ---- shared fields ------------------------------------------------------------------------------


def _body(body: Any, endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise OpenAIError(f"The {endpoint} request body must be a JSON object, got {_kind(body)}")
    return body


def _model(body: dict, limits: ServerLimits) -> str:
    name = _as_string(body.get("model"), "model")
    if name is None:
        return limits.served_model_names[0]  # vLLM: the model is optional
    if name not in limits.served_model_names:
        raise OpenAIError(f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found")
    return name


def _check_harmless(body: dict) -> None:
    """Fields OpenAI clients send that change nothing here; their types are still checked."""
    _as_string(body.get("user"), "user")
    _as_bool(body.get("store"), "store", False)
    _as_object(body.get("metadata"), "metadata")
    _as_string(body.get("service_tier"), "service_tier")
    _as_string(body.get("request_id"), "request_id")


def _refuse_unsupported(body: dict, names: tuple[str, ...], n: int, add_special_tokens: bool) -> None:
    """400 for known fields that ask for something this server does not do (accepting them would
    give an answer that silently ignores what they ask); a field holding a value that asks for
    nothing passes. `add_special_tokens`: the endpoint's default (vLLM's: False for chat, True for
    completions)."""

    def one_of(*values):  # equal, of the same type (True is no 1 here)
        return lambda value: any(value == ok and type(value) is type(ok) for ok in values)

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    harmless = {
        "use_beam_search": one_of(False),
        "modalities": one_of(["text"]),
        "echo": one_of(False),  # chat only: vLLM's echo prepends the last message
        "suffix": one_of(""),
        "best_of": one_of(n),  # best_of == n is plain sampling
        # vLLM's extra sampling and prompt fields:
        "logits_processors": one_of([]),
        "documents": one_of([]),
        "return_token_ids": one_of(False),
        "length_penalty": number,  # read by beam search only, which is refused
        # Only spaces between special tokens shown one after another, which the V4 tokenizer's
        # decoder never puts there.
        "spaces_between_special_tokens": lambda value: isinstance(value, bool),
        "priority": lambda value: number(value) and value == 0,  # vLLM: others need its priority policy
        "add_generation_prompt": one_of(True),
        "continue_final_message": one_of(False),
        # A chat prompt's special tokens come from the V4 encoder; a completion prompt gets its BOS.
        "add_special_tokens": one_of(add_special_tokens),
    }
    hints = {
        "functions": "; use tools",
        "function_call": "; use tool_choice",
        "prompt_logprobs": " on /v1/chat/completions; use /v1/completions",
    }
    for name in names:
        value = body.get(name)
        if value is None or (name in harmless and harmless[name](value)):
            continue
        raise _invalid(name, f"'{name}' is not supported by dsv4-jax{hints.get(name, '')}")


def _ignored(body: dict, known: frozenset[str]) -> tuple[str, ...]:
    return tuple(name for name in body if name not in known)


def _stream(body: dict, force_include_usage: bool) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous usage: only with include_usage, as vLLM). The server's
    --enable-force-include-usage turns both on for every stream, whatever stream_options say
    (vLLM's `should_include_usage`)."""
    stream = _as_bool(body.get("stream"), "stream", False)
    options = _as_object(body.get("stream_options"), "stream_options")
    given = options is not None
    if given and not stream:
        raise _invalid("stream_options", "stream_options can only be given when stream is true")
    options = options or {}
    continuous = _as_bool(options.get("continuous_usage_stats"), "stream_options.continuous_usage_stats", False)
    include_usage = _as_bool(options.get("include_usage"), "stream_options.include_usage", given)
    if force_include_usage and stream:
        return True, True, True
    return stream, include_usage, include_usage and continuous


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float] | None:
    bias = _as_object(value, "logit_bias")
    if bias is None:
        return None
    if len(bias) > MAX_LOGIT_BIAS:  # the count, not the dict: SamplingParams' message would repeat it whole
        raise _invalid("logit_bias", f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(bias)}")
    out: dict[int, float] = {}
    for key, amount in bias.items():
        # JSON keys are strings; int() alone would also take " 7", "+7" and non-ASCII digits.
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18
        if not digits or int(key) >= vocab_size:
            raise _invalid("logit_bias", f"key {_shown(key)} is not a token id in [0, {vocab_size})")
        token = int(key)
        number = _as_number(amount, "logit_bias")
        out[token] = min(_LOGIT_BIAS_LIMIT, max(-_LOGIT_BIAS_LIMIT, number))
    return out


def _allowed_token_ids(value: Any, vocab_size: int) -> list[int] | None:
    """vLLM's rules: a non-empty list of ids in the vocabulary (an empty one allows no token)."""
    if value is None:
        return None
    ids = _token_ids(value, "allowed_token_ids", vocab_size)
    if not ids:
        raise _invalid("allowed_token_ids", "expected a non-empty array of token ids (an empty one allows no token)")
    return ids


def _bad_words(value: Any) -> list[str] | None:
    """vLLM's rules: strings, each of which must tokenize to a token once its leading spaces are
    stripped (so none may be blank)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise _invalid("bad_words", f"expected an array of strings, got {_kind(value)}")
    for j, word in enumerate(value):
        if not isinstance(word, str) or not word.strip():
            raise _invalid("bad_words", f"item {j} must be a string that is not blank, got {_shown(word)}")
    return list(value) or None


def _truncate_prompt_tokens(value: Any) -> int | None:
    """vLLM's rule: keep the last k >= 1 prompt tokens, or -1 for the last max_model_len (the
    engine refuses a k beyond max_model_len)."""
    k = _as_int(value, "truncate_prompt_tokens", low=-1)
    if k == 0:
        raise _invalid("truncate_prompt_tokens", "expected an integer >= 1, or -1 (max_model_len), got 0")
    return k


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise _invalid("stop", f"expected a string or an array of strings, got {_kind(value)}")
    for j, stop in enumerate(stops):
        if not isinstance(stop, str) or not stop:
            raise _invalid("stop", f"item {j} must be a non-empty string, got {_shown(stop)}")
    return list(stops)


_SAMPLING_ERROR_FIELD = re.compile(r"SamplingParams\.(\w+)")


def _sampling_params(
    body: dict,
    limits: ServerLimits,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    names: Mapping[str, str] = {},  # SamplingParams name -> the request's, for errors it finds
) -> SamplingParams:
    """SamplingParams from the request's sampling fields, the fields the endpoint read itself
    (max_tokens, logprobs, prompt_logprobs, the structured-output constraint) and the server's
    generation_config defaults."""
    values: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        values[name] = _as_number(body.get(name), name)
    top_k = _as_int(body.get("top_k"), "top_k", low=-1)
    # A top_k past the vocabulary keeps every token: store it as "off" rather than a huge int.
    values["top_k"] = 0 if top_k is not None and top_k >= limits.vocab_size else top_k
    values["seed"] = _as_int(body.get("seed"), "seed")
    values["n"] = _as_int(body.get("n"), "n", low=1, high=limits.max_n)
    values["min_tokens"] = _as_int(body.get("min_tokens"), "min_tokens", low=0)
    values["stop"] = _stop(body.get("stop"))
    stop_ids = body.get("stop_token_ids")
    values["stop_token_ids"] = None if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", limits.vocab_size)
    values["logit_bias"] = _logit_bias(body.get("logit_bias"), limits.vocab_size)
    values["allowed_token_ids"] = _allowed_token_ids(body.get("allowed_token_ids"), limits.vocab_size)
    values["bad_words"] = _bad_words(body.get("bad_words"))
    values["truncate_prompt_tokens"] = _truncate_prompt_tokens(body.get("truncate_prompt_tokens"))
    values["structured_outputs"] = structured_outputs
    for name, default in (("ignore_eos", False), ("skip_special_tokens", True), ("include_stop_str_in_output", False)):
        values[name] = _as_bool(body.get(name), name, default)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if values[name] is None and name in limits.default_sampling:
            values[name] = limits.default_sampling[name]
    arguments = {name: value for name, value in values.items() if value is not None}
    try:
        return SamplingParams(**arguments, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except ValueError as error:
        match = _SAMPLING_ERROR_FIELD.search(str(error))
        name = match.group(1) if match else None
        param = names.get(name, name) if name else None
        raise _invalid(param, str(error).replace("SamplingParams.", "")) from None


# ---- chat fields --------------------------------------------------------------------------------


def _content_text(content: Any, path: str) -> Any:
    """Message content as a string (None stays None): text parts joined with a newline, as vLLM."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(path, f"expected a string or an array of content parts, got {_kind(content)}")
    texts = []
    for j, part in enumerate(content):
        part_path = f"{path}[{j}]"
        if isinstance(part, str):  # vLLM accepts bare strings among the parts
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise _invalid(part_path, f"a content part must be an object, got {_kind(part)}")
        if part.get("type") != "text":
            raise _invalid(
                part_path, f"this model takes text only; cannot read a part of type {_shown(part.get('type'))}"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _invalid(f"{part_path}.text", f"expected a string, got {_kind(text)}")
        texts.append(text)
    return "\n".join(texts)


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        shown = "an empty array" if value == [] else _kind(value)
        raise _invalid("messages", f"expected a non-empty array of messages, got {shown}")
    messages = []
    for i, message in enumerate(value):
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(path, f"a message must be an object, got {_kind(message)}")
        message = dict(message)
        if "content" in message:
            message["content"] = _content_text(message["content"], f"{path}.content")
        reasoning = message.pop("reasoning", None)  # vLLM's current name for reasoning_content
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise _invalid(f"{path}.reasoning", f"expected a string, got {_kind(reasoning)}")
            if message.get("reasoning_content") not in (None, reasoning):
                raise _invalid(f"{path}.reasoning", "differs from reasoning_content; give one of the two")
            message["reasoning_content"] = reasoning
        messages.append(message)
    try:
        check_messages(messages)
    except InvalidRequestField as error:
        raise _from_chat_error(error) from None
    return messages


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _invalid("tools", f"expected an array of tools, got {_kind(value)}")
    for j, tool in enumerate(value):
        path = f"tools[{j}]"
        if not isinstance(tool, dict):
            raise _invalid(path, f"a tool must be an object, got {_kind(tool)}")
        if tool.get("type", "function") != "function":  # vLLM: type defaults to "function"
            raise _invalid(f"{path}.type", f"only function tools are supported, got {_shown(tool.get('type'))}")
        function = _as_object(tool.get("function"), f"{path}.function")
        if function is None:
            raise _invalid(f"{path}.function", "a function tool needs a function object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid(f"{path}.function.name", f"expected a non-empty string, got {_kind(name)}")
        _as_string(function.get("description"), f"{path}.function.description")
        _as_object(function.get("parameters"), f"{path}.function.parameters")
    try:
        check_tools(value, "tools")
    except InvalidRequestField as error:
        raise _from_chat_error(error) from None
    return list(value)


def _tool_choice(value: Any, tools: list[dict] | None, limits: ServerLimits) -> tuple[ToolChoice, list[dict] | None]:
    """The resolved tool choice and the tools for the prompt."""
    if value is None:
        choice = ToolChoice("auto" if tools else "none")
    elif isinstance(value, str):
        if value not in _TOOL_CHOICES:
            raise _invalid(
                "tool_choice", f"expected one of {list(_TOOL_CHOICES)} or a named function, got {_shown(value)}"
            )
        choice = ToolChoice(value)
    elif isinstance(value, dict):
        usage = 'use {"type": "function", "function": {"name": "my_function"}}'
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise _invalid("tool_choice", f"a named tool choice must name a function: {usage}")
        choice = ToolChoice("function", name)
    else:
        raise _invalid("tool_choice", f"expected a string or an object, got {_kind(value)}")

    if choice.kind != "none" and tools is None:
        raise _invalid("tool_choice", f"tool_choice {choice.kind!r} needs tools; none were given")
    if choice.kind == "required" and not tools:
        return ToolChoice("none"), None  # vLLM follows OpenAI: "required" with no tools asks for none
    if choice.kind == "function" and choice.name not in {tool["function"]["name"] for tool in tools or ()}:
        raise _invalid("tool_choice", f"the function {choice.name!r} is not one of the request's tools")
    if choice.kind == "auto" and not limits.enable_auto_tool_choice:
        raise _invalid(
            "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    return choice, tools


def _response_format(value: Any) -> dict | None:
    response_format = _as_object(value, "response_format")
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise _invalid("response_format.type", f"expected one of {list(_RESPONSE_FORMATS)}, got {_shown(kind)}")
    if kind == "json_schema":
        schema = _as_object(response_format.get("json_schema"), "response_format.json_schema")
        if schema is None:
            raise _invalid("response_format.json_schema", 'a "json_schema" response format needs a json_schema object')
        name = schema.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid("response_format.json_schema.name", f"expected a non-empty string, got {_kind(name)}")
        _as_object(schema.get("schema"), "response_format.json_schema.schema")
    try:
        json.dumps(response_format, allow_nan=False)  # it is written into the prompt as JSON
    except ValueError as error:
        raise _invalid("response_format", f"not representable as JSON: {error}") from None
    return response_format


def _chat_options(body: dict, limits: ServerLimits) -> tuple[dict, str | None]:
    """(chat_template_kwargs with the server's defaults, reasoning_effort), checked by the encoder."""
    requested = _as_object(body.get("chat_template_kwargs"), "chat_template_kwargs")
    kwargs = {**limits.default_chat_template_kwargs, **(requested or {})}
    effort = body.get("reasoning_effort")
    try:
        resolve_chat_options(kwargs, effort)
    except InvalidRequestField as error:
        raise _from_chat_error(error) from None
    return kwargs, effort


# ---- structured outputs -------------------------------------------------------------------------

# vLLM's guided-decoding fields, removed from vLLM in favour of `structured_outputs` -> what to use
# instead. vLLM now ignores them silently, answering without the constraint they ask for; here they
# are a 400 naming the replacement (docs/serving.md). Any other guided_* field gets the same answer.
GUIDED_REPLACEMENTS = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_json_object": "structured_outputs.json_object",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "the server's --structured-outputs-config '{\"backend\": \"guidance\"}'",
}
_GUIDED_PREFIX = "guided_"
STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                      "disable_fallback")
# The engine's name of a constraint in its errors: structured_outputs, or structured_outputs.<kind>.
_ENGINE_CONSTRAINT_FIELD = re.compile(r"structured_outputs(?:\.\w+)?")


@dataclass(frozen=True)
class _Constraint:
    """A request's structured-output constraint and where the request wrote it."""

    params: StructuredOutputsParams
    fields: Mapping[str, str]  # the engine's names (structured_outputs.<kind>) -> the request's


def _refuse_guided(body: dict) -> None:
    for name, value in body.items():
        if isinstance(name, str) and name.startswith(_GUIDED_PREFIX) and value is not None:
            instead = GUIDED_REPLACEMENTS.get(name, "the structured_outputs object")
            raise _invalid(name, f"'{name}' was removed from vLLM (which now ignores it); use {instead} instead")


def _renamed(message: str, fields: Mapping[str, str]) -> OpenAIError:
    """An engine error about a constraint (its message starts with the engine's name of the field),
    as the 400 naming the field where the request wrote it."""
    match = _ENGINE_CONSTRAINT_FIELD.match(message)
    engine_name = match.group(0) if match else "structured_outputs"
    reason = message[match.end():].lstrip(": ") if match else message
    return _invalid(fields.get(engine_name, engine_name), reason)


def _constraint(kwargs: dict[str, Any], fields: Mapping[str, str], config: StructuredOutputsConfig) -> _Constraint:
    """StructuredOutputsParams(**kwargs), checked as the engine will compile it (an invalid schema,
    regex or grammar, or a feature llguidance cannot enforce, is a 400 here, before anything is
    tokenized or queued)."""
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as error:
        raise _renamed(str(error), fields) from None
    try:
        check_structured_outputs(params, config)
    except RequestRejected as error:
        raise _renamed(str(error), fields) from None
    return _Constraint(params, fields)


def _structured_outputs(value: Any, config: StructuredOutputsConfig) -> _Constraint | None:
    """vLLM's extra-body `structured_outputs` object: one kind, and its options (null: the default)."""
    spec = _as_object(value, "structured_outputs")
    if spec is None:
        return None
    allowed = (*KINDS, *STRUCTURED_OPTIONS)
    for key in spec:
        if key not in allowed:
            raise _invalid(f"structured_outputs.{key}",
                           f"not a structured_outputs field; allowed: {', '.join(allowed)}")
    try:
        json.dumps(spec, allow_nan=False)  # a NaN (Python's JSON reads one) is in no schema's vocabulary
    except ValueError as error:
        raise _invalid("structured_outputs", f"not representable as JSON: {error}") from None
    return _constraint({key: item for key, item in spec.items() if item is not None}, {}, config)


def _response_format_constraint(response_format: dict | None, config: StructuredOutputsConfig) -> _Constraint | None:
    """json_object: any JSON object; json_schema: its schema (its `strict` changes nothing: the
    answer always follows the schema); text: nothing."""
    kind = None if response_format is None else response_format.get("type")
    if kind == "json_object":
        return _constraint({"json_object": True}, {"structured_outputs": "response_format",
                                                   "structured_outputs.json_object": "response_format"}, config)
    if kind == "json_schema":
        schema = response_format["json_schema"].get("schema")
        param = "response_format.json_schema.schema"
        if schema is None:
            raise _invalid(param, "a json_schema response format needs the schema its answer must follow")
        return _constraint({"json": schema}, {"structured_outputs": "response_format",
                                              "structured_outputs.json": param}, config)
    return None


def _tool_constraint(tool_choice: ToolChoice, tools: list[dict] | None,
                     config: StructuredOutputsConfig) -> _Constraint | None:
    """tool_choice "required" or a named function: the grammar of a DSML tool call (of any of the
    tools, or of the named one). A schema feature the grammar cannot enforce is a 400 naming it."""
    if tool_choice.kind not in ("required", "function"):
        return None
    try:
        grammar = tool_call_grammar(tools or [], tool_choice.name)
    except InvalidRequestField as error:  # UnsupportedToolSchema names the schema's field
        raise _from_chat_error(error) from None
    except ValueError as error:  # a grammar llguidance refuses whole (no one parameter to blame)
        raise _invalid("tools", str(error)) from None
    return _constraint({"grammar": grammar}, {"structured_outputs": "tool_choice",
                                              "structured_outputs.grammar": "tools"}, config)


def _body_constraint(body: dict, response_format: dict | None, config: StructuredOutputsConfig) -> _Constraint | None:
    """The constraint of either endpoint: structured_outputs or a json response_format (vLLM takes
    both on completions too), not both."""
    if body.get("structured_outputs") is not None and _constrains(response_format):
        raise _invalid("structured_outputs", "give either structured_outputs or a json response_format, not both")
    return _structured_outputs(body.get("structured_outputs"), config) or \
        _response_format_constraint(response_format, config)


def _constrains(response_format: dict | None) -> bool:
    return response_format is not None and response_format.get("type") != "text"


def _chat_constraint(body: dict, tool_choice: ToolChoice, tools: list[dict] | None,
                     response_format: dict | None, config: StructuredOutputsConfig) -> _Constraint | None:
    """The one constraint a chat request may carry: structured_outputs, a json response_format,
    or a tool_choice that forces a tool call; two of them are a 400."""
    given = body.get("structured_outputs") is not None
    if tool_choice.kind in ("required", "function") and (given or _constrains(response_format)):
        other = "structured_outputs" if given else "response_format"
        raise _invalid("tool_choice", f"tool_choice {tool_choice.kind!r} constrains the answer to a tool call, "
                                      f"which {other} constrains too; give one of the two")
    return _body_constraint(body, response_format, config) or _tool_constraint(tool_choice, tools, config)


# vLLM's extra request fields that dsv4-jax does not implement (both endpoints).
_VLLM_UNSUPPORTED = (
    "logits_processors",
    "spaces_between_special_tokens",
    "length_penalty",
    "priority",
    "add_special_tokens",
    "return_token_ids",
)
# How a chat prompt is laid out: the V4 encoder's own way only (chat and /tokenize).
_CHAT_PROMPT_UNSUPPORTED = ("add_generation_prompt", "continue_final_message", "chat_template", "documents")
_CHAT_UNSUPPORTED = (
    "audio",
    "modalities",
    "prediction",
    "functions",
    "function_call",
    "web_search_options",
    "use_beam_search",
    "best_of",
    "echo",
    "prompt_logprobs",
    *_VLLM_UNSUPPORTED,
    *_CHAT_PROMPT_UNSUPPORTED,
)
# The constraint fields and vLLM's extra sampling fields, read on both endpoints.
_CONSTRAINT_FIELDS = ("structured_outputs", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                      *GUIDED_REPLACEMENTS)
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "max_tokens",
    "logprobs",
    "stream",
    "stream_options",
    "return_tokens_as_token_ids",
)
CHAT_FIELDS = frozenset(
    (
        "model",
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template_kwargs",
        "reasoning_effort",
        "max_completion_tokens",
        "top_logprobs",
        *_SAMPLING_FIELDS,
        *_CONSTRAINT_FIELDS,
        *_HARMLESS,
        *_CHAT_UNSUPPORTED,
    )
)


def parse_chat_request(body: Any, limits: ServerLimits) -> ChatRequest:
    """A /v1/chat/completions body as a ChatRequest; OpenAIError (400/404) when it is not valid."""
    body = _body(body, "chat completion")
    model = _model(body, limits)
    _check_harmless(body)
    n = _as_int(body.get("n"), "n", low=1, high=limits.max_n) or 1
    _refuse_unsupported(body, _CHAT_UNSUPPORTED, n, add_special_tokens=False)
    _refuse_guided(body)
    messages = _messages(body.get("messages"))
    tool_choice, tools = _tool_choice(body.get("tool_choice"), _tools(body.get("tools")), limits)
    response_format = _response_format(body.get("response_format"))
    constraint = _chat_constraint(body, tool_choice, tools, response_format, limits.structured_outputs_config)
    chat_template_kwargs, reasoning_effort = _chat_options(body, limits)
    stream, include_usage, continuous_usage = _stream(body, limits.force_include_usage)

    logprobs = _as_bool(body.get("logprobs"), "logprobs", False)
    top_logprobs = _as_int(body.get("top_logprobs"), "top_logprobs", low=0, high=limits.max_logprobs) or 0
    if top_logprobs > 0 and not logprobs:
        raise _invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    # max_completion_tokens replaces the deprecated max_tokens, and wins when both are given (vLLM).
    max_tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _as_int(body.get(max_tokens_param), max_tokens_param, low=1)
    if body.get("max_completion_tokens") is not None:
        _as_int(body.get("max_tokens"), "max_tokens", low=1)
    params = _sampling_params(
        body,
        limits,
        max_tokens=max_tokens if max_tokens is not None else limits.default_sampling.get("max_tokens"),
        logprobs=top_logprobs if logprobs else None,
        structured_outputs=None if constraint is None else constraint.params,
        names={"max_tokens": max_tokens_param, "logprobs": "top_logprobs"},
    )
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        response_format=response_format,
        chat_template_kwargs=chat_template_kwargs,
        reasoning_effort=reasoning_effort,
        params=params,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        return_tokens_as_token_ids=_as_bool(
            body.get("return_tokens_as_token_ids"), "return_tokens_as_token_ids", False
        ),
        parallel_tool_calls=_as_bool(body.get("parallel_tool_calls"), "parallel_tool_calls", True),
        ignored_fields=_ignored(body, CHAT_FIELDS),
        max_tokens_field=max_tokens_param,
        max_tokens_is_default=max_tokens is None and params.max_tokens is not None,
        constraint_fields={} if constraint is None else constraint.fields,
        prompt_tokens_details=limits.prompt_tokens_details,
    )


# ---- completions --------------------------------------------------------------------------------


def _prompts(value: Any, vocab_size: int) -> list[str | list[int]]:
    """`prompt` as a batch: a string, an array of strings, of token ids, or of token-id arrays."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        shown = "an empty array" if value == [] else _kind(value)
        raise _invalid("prompt", f"expected a string, an array of strings or token ids, got {shown}")
    if all(isinstance(item, str) for item in value):
        return list(value)
    if all(not isinstance(item, (str, list)) for item in value):
        return [_token_ids(value, "prompt", vocab_size)]
    prompts: list[str | list[int]] = []
    for j, item in enumerate(value):
        if not isinstance(item, list) or not item:
            shown = "an empty array" if item == [] else _kind(item)
            raise _invalid(f"prompt[{j}]", f"a batch of token prompts needs non-empty token-id arrays, got {shown}")
        prompts.append(_token_ids(item, f"prompt[{j}]", vocab_size))
    return prompts


_COMPLETION_UNSUPPORTED = (
    "suffix",
    "best_of",
    "use_beam_search",
    "prompt_embeds",
    *_VLLM_UNSUPPORTED,
)
COMPLETION_FIELDS = frozenset(
    ("model", "prompt", "echo", "prompt_logprobs", "response_format", *_SAMPLING_FIELDS, *_CONSTRAINT_FIELDS,
     *_HARMLESS, *_COMPLETION_UNSUPPORTED)
)


def parse_completion_request(body: Any, limits: ServerLimits) -> CompletionRequest:
    """A /v1/completions body as a CompletionRequest; OpenAIError (400/404) when it is not valid."""
    body = _body(body, "completion")
    model = _model(body, limits)
    _check_harmless(body)
    n = _as_int(body.get("n"), "n", low=1, high=limits.max_n) or 1
    _refuse_unsupported(body, _COMPLETION_UNSUPPORTED, n, add_special_tokens=True)
    _refuse_guided(body)
    if body.get("prompt") is None:
        raise _invalid("prompt", "prompt is required")
    prompts = _prompts(body["prompt"], limits.vocab_size)
    echo = _as_bool(body.get("echo"), "echo", False)
    stream, include_usage, continuous_usage = _stream(body, limits.force_include_usage)
    logprobs = _as_int(body.get("logprobs"), "logprobs", low=0, high=limits.max_logprobs)
    prompt_logprobs = _as_int(body.get("prompt_logprobs"), "prompt_logprobs", low=0, high=limits.max_logprobs)
    if stream and prompt_logprobs:
        raise _invalid("prompt_logprobs", "prompt logprobs are not available when stream is true")
    if prompt_logprobs is None and echo:
        prompt_logprobs = logprobs  # echoed prompt tokens carry logprobs too (vLLM)
    # Left out: OpenAI's 16. An explicit null: no request default, as vLLM (the server's, or the room left).
    given = _as_int(body["max_tokens"], "max_tokens", low=1) if "max_tokens" in body else None
    if "max_tokens" in body:
        max_tokens = given if given is not None else limits.default_sampling.get("max_tokens")
    else:
        max_tokens = _COMPLETION_DEFAULT_MAX_TOKENS
    response_format = _response_format(body.get("response_format"))
    constraint = _body_constraint(body, response_format, limits.structured_outputs_config)
    params = _sampling_params(
        body,
        limits,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=None if constraint is None else constraint.params,
    )
    return CompletionRequest(
        model=model,
        prompts=prompts,
        echo=echo,
        params=params,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        return_tokens_as_token_ids=_as_bool(
            body.get("return_tokens_as_token_ids"), "return_tokens_as_token_ids", False
        ),
        ignored_fields=_ignored(body, COMPLETION_FIELDS),
        # Left out, OpenAI's 16 counts as asked for (vLLM and OpenAI refuse a prompt it does not fit).
        max_tokens_is_default="max_tokens" in body and given is None and max_tokens is not None,
        constraint_fields={} if constraint is None else constraint.fields,
        prompt_tokens_details=limits.prompt_tokens_details,
    )


# ---- tokenize / detokenize (vLLM's extra endpoints) ---------------------------------------------

TOKENIZE_FIELDS = frozenset(
    (
        "model",
        "prompt",
        "messages",
        "tools",
        "chat_template_kwargs",
        "reasoning_effort",
        "add_special_tokens",
        "return_token_strs",
        *_CHAT_PROMPT_UNSUPPORTED,
    )
)


def parse_tokenize_request(body: Any, limits: ServerLimits) -> TokenizeRequest:
    """A /tokenize body: `prompt` (a string) or `messages` (with optional `tools`,
    `chat_template_kwargs`, `reasoning_effort`), not both."""
    body = _body(body, "tokenize")
    model = _model(body, limits)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise OpenAIError("A tokenize request takes either prompt or messages", param="prompt")
    chat_template_kwargs, reasoning_effort = _chat_options(body, limits)
    if messages is not None:  # tokenized as the chat endpoint would lay the prompt out
        _refuse_unsupported(body, _CHAT_PROMPT_UNSUPPORTED, 1, add_special_tokens=False)
    return TokenizeRequest(
        model=model,
        prompt=_as_string(prompt, "prompt"),
        messages=None if messages is None else _messages(messages),
        tools=_tools(body.get("tools")),
        chat_template_kwargs=chat_template_kwargs,
        reasoning_effort=reasoning_effort,
        add_special_tokens=_as_bool(body.get("add_special_tokens"), "add_special_tokens", messages is None),
        return_token_strs=_as_bool(body.get("return_token_strs"), "return_token_strs", False),
        ignored_fields=_ignored(body, TOKENIZE_FIELDS),
    )


def parse_detokenize_request(body: Any, limits: ServerLimits) -> DetokenizeRequest:
    """A /detokenize body: `{"model"?, "tokens": [token ids]}`."""
    body = _body(body, "detokenize")
    model = _model(body, limits)
    if body.get("tokens") is None:
        raise _invalid("tokens", "tokens is required")
    tokens = _token_ids(body["tokens"], "tokens", limits.vocab_size)
    return DetokenizeRequest(model=model, tokens=tokens, ignored_fields=_ignored(body, frozenset(("model", "tokens"))))
