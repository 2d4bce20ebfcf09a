"""Structured outputs: what a request may constrain its tokens to (vLLM's `StructuredOutputsParams`
and `StructuredOutputsConfig`), checked when the request is made, and compiled into an
llguidance grammar.

One backend, llguidance ("guidance" in vLLM): it needs no torch, builds its tokenizer from the V4
`tokenizer.json` and fills a 129,280-token mask in about a millisecond. A request names exactly one
kind of constraint: a JSON schema (`json`), any JSON object (`json_object`), a regular expression
(`regex`), one of a list of strings (`choice`), a grammar (`grammar`: Lark, llguidance's own form,
or GBNF, converted by `llguidance.gbnf_to_lark`) or vLLM's `structural_tag` JSON.

`check_structured_outputs` validates a request's constraint synchronously (the server's handler
calls it, so a bad schema is a 400 before anything is queued); `GrammarCompiler` builds matchers on
a worker thread, one per distinct constraint (kept, then copied per request); the per-request state
and the token masks are `engine/token_masks.py`'s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from typing import Any

from dsv4_jax.engine.request import RequestRejected

logger = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
BACKENDS = ("auto", "guidance")
# vLLM's other backends, each of which needs torch or transformers: named so the error can say so.
OTHER_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")
REASONING_PARSERS = ("deepseek_v4", "")
# Matchers kept for reuse, by constraint: a repeated schema (an agent's every turn) skips its compile.
GRAMMAR_CACHE_SIZE = 128
GRAMMAR_WORKERS = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON schema, as a dict or its JSON
    text), `json_object` (True: any JSON object), `regex`, `choice` (a list of strings), `grammar`
    (Lark or GBNF) and `structural_tag` (vLLM's JSON: `{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}`), plus the JSON options. A ValueError names the field."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False  # one backend: nothing to fall back to
    disable_any_whitespace: bool = False  # JSON without whitespace between its tokens
    disable_additional_properties: bool = False  # objects without additionalProperties allow none
    whitespace_pattern: str | None = None  # the regex whitespace between JSON tokens must match

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            found = f"got {given}" if given else "got none"
            raise ValueError(f"structured_outputs must name exactly one of {list(KINDS)}; {found}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except (json.JSONDecodeError, RecursionError) as error:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {value!r:.80}")
            object.__setattr__(self, "json", value)
        elif kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {value!r:.80}")
            object.__setattr__(self, "choice", list(value))
        elif kind in ("regex", "grammar", "structural_tag") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r:.80}")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(f"structured_outputs.whitespace_pattern must be a string, got {self.whitespace_pattern!r}")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))



@dataclasses.dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `--structured-outputs-config`: the backend ("auto" and "guidance" are llguidance),
    whether constraints also bind the reasoning (`enable_in_reasoning`; by default they start after
    it ends, as vLLM's), the reasoning parser that says where it ends (DeepSeek-V4's `</think>`;
    "" for none: constraints start at the first token), and the JSON defaults every request gets."""

    backend: str = "auto"
    enable_in_reasoning: bool = False
    reasoning_parser: str = "deepseek_v4"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # Seconds a request may wait for its grammar's compile before it ends with an error.
    compile_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backend in OTHER_BACKENDS:
            raise ValueError(f"structured_outputs_config.backend {self.backend!r} is not available here (it needs "
                             "torch); this server's backend is 'guidance' (llguidance): pass 'guidance' or 'auto'")
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config.backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"structured_outputs_config.reasoning_parser must be one of {list(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        for name in ("enable_in_reasoning", "disable_fallback", "disable_any_whitespace",
                     "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.compile_timeout_s, bool) or not isinstance(self.compile_timeout_s, (int, float)) \
                or not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_config.compile_timeout_s must be a number > 0, "
                             f"got {self.compile_timeout_s!r}")

    @classmethod
    def parse(cls, value: str | dict | StructuredOutputsConfig | None, name: str = "structured_outputs_config"
              ) -> StructuredOutputsConfig:
        """From vLLM's JSON text (the flag), a dict (`LLM(structured_outputs_config=...)`) or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"{name}: not valid JSON ({error})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{name}: unknown keys {unknown}; known: {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**value)


def _json_options(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"whitespace_flexible": not (params.disable_any_whitespace
                                                           or config.disable_any_whitespace)}
    if params.whitespace_pattern is not None:
        options["whitespace_pattern"] = params.whitespace_pattern
    return options


def _structural_tag_grammar(spec: str) -> str:
    import llguidance

    shape = '{"structures": [{"begin": str, "schema": object, "end": str}, ...], "triggers": [str, ...]}'
    try:
        tag = json.loads(spec)
        triggers, structures = tag["triggers"], tag["structures"]
        if not (isinstance(triggers, list) and all(isinstance(t, str) and t for t in triggers)
                and isinstance(structures, list)
                and all(isinstance(x, dict) and isinstance(x.get("begin"), str) and isinstance(x.get("end"), str)
                        and isinstance(x.get("schema"), (dict, str)) for x in structures)):
            raise TypeError("wrong types")
    except (json.JSONDecodeError, TypeError, KeyError, RecursionError) as error:
        raise ValueError(f"not a structural tag ({shape}): {error}") from None
    tags = []
    for structure in structures:
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger in {triggers} begins {structure['begin']!r}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"], grammar=structure["schema"],
                                         end=structure["end"]))
    if not tags:
        raise ValueError("a structural tag needs at least one structure")
    return llguidance.StructTag.to_grammar(tags)


def grammar_of(params: StructuredOutputsParams, config: StructuredOutputsConfig = StructuredOutputsConfig()) -> str:
    """The llguidance grammar (its JSON text) of `params`; a ValueError for a spec that cannot be
    one (its validity against the grammar rules is `check_structured_outputs`')."""
    import llguidance

    kind, spec = params.kind, getattr(params, params.kind)
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec
        if params.disable_additional_properties or config.disable_additional_properties:
            schema = _without_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(params, config))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)  # Lark as it is, GBNF converted
    return _structural_tag_grammar(spec)


# Keywords whose values are schemas, lists of schemas, or maps of names to schemas: the only places
# `_without_additional_properties` looks (never into const, enum, default or examples: data).
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _without_additional_properties(schema: Any) -> Any:
    """vLLM's `disable_additional_properties`: every object schema that does not say otherwise
    allows no properties beyond its own."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _without_additional_properties(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_without_additional_properties(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _without_additional_properties(s) for name, s in out[key].items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def check_structured_outputs(params: StructuredOutputsParams,
                             config: StructuredOutputsConfig = StructuredOutputsConfig()) -> str:
    """The grammar of `params`, checked: a RequestRejected naming `structured_outputs.<kind>` for a
    spec that is invalid or uses a feature llguidance does not support (whose warnings are errors
    here: a schema keyword silently ignored would let through answers the schema forbids)."""
    import llguidance

    if params.whitespace_pattern is not None:  # its own field, before the grammar it shapes
        pattern = llguidance.LLMatcher.grammar_from_regex(params.whitespace_pattern)
        problem = llguidance.LLMatcher.validate_grammar(pattern)
        if problem:
            field = "structured_outputs.whitespace_pattern"
            raise RequestRejected(f"{field}: {' '.join(problem.split())}", field)
    field = f"structured_outputs.{params.kind}"
    try:
        grammar = grammar_of(params, config)
    except ValueError as error:
        raise RequestRejected(f"{field}: {error}", field) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        raise RequestRejected(f"{field}: {'; '.join(' '.join(m.split()) for m in messages)}", field)
    return grammar


class _TokenBytes:
    """The V4 vocabulary as llguidance reads a tokenizer (`llguidance.TokenizerWrapper`): each id's
    bytes and the ids that are special. Built from `tokenizer.json` itself, llguidance takes every
    added token written like `<...>` for a special one, `</think>` included (the file marks it
    `special: false`), and a grammar could then never write `</think>` as text; here only the
    tokens the file marks special are (BOS, EOS, ...)."""

    def __init__(self, tokenizer, vocab_size: int):
        from dsv4_jax.chat.tokenizer import token_bytes
        from dsv4_jax.chat.tokens import BOS, EOS

        self._tokenizer = tokenizer
        self.tokens = [token_bytes(tokenizer, i) for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i, added in tokenizer.get_added_tokens_decoder().items()
                                        if added.special and i < vocab_size)
        self.bos_token_id, self.eos_token_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


class GrammarCompiler:
    """Builds llguidance matchers off the step path: a few worker threads (llguidance drops the GIL
    while it builds, and one slow grammar must not hold up the others), the tokenizer built on one
    the first time (about a second for the V4 vocabulary), a matcher kept per grammar text
    (`GRAMMAR_CACHE_SIZE`, least recently used out) and copied for each request. The text, not the
    request's spec, is the key: schemas equal up to their keys' order are different grammars
    (llguidance writes properties in the schema's order)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        """`tokenizer`: the engine's `tokenizers.Tokenizer`."""
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="dsv4-grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._building: dict[str, threading.Lock] = {}  # a lock per grammar being built
        self._tokenizer = None
        self.compile_seconds: collections.deque[tuple[bool, float]] = collections.deque(maxlen=1024)  # (cached, s)

    def tokenizer(self):
        """The llguidance tokenizer (built once, on first use)."""
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                wrapped = llguidance.TokenizerWrapper(_TokenBytes(self.hf_tokenizer, self.vocab_size))
                self._tokenizer = llguidance.LLTokenizer(wrapped, n_vocab=self.vocab_size,
                                                         eos_token=list(self.eos_token_ids))
            return self._tokenizer

    def submit(self, grammar: str) -> concurrent.futures.Future:
        """A future of a fresh matcher for `grammar` (its result raises ValueError if llguidance
        could not build it)."""
        return self._pool.submit(self._matcher, grammar)

    def _matcher(self, grammar: str):
        import llguidance

        start = time.perf_counter()
        with self._lock:
            building = self._building.setdefault(grammar, threading.Lock())
        # One build per grammar at a time: the `n` children of a request with a new schema wait
        # for the first build and copy it, instead of each building their own.
        with building:
            with self._lock:
                template = self._cache.get(grammar)
                if template is not None:
                    self._cache.move_to_end(grammar)
            cached = template is not None
            if template is None:
                template = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
                if template.is_error():
                    raise ValueError(template.get_error())
                with self._lock:
                    self._cache[grammar] = template
                    while len(self._cache) > GRAMMAR_CACHE_SIZE:
                        self._cache.popitem(last=False)
        with self._lock:
            if not building.locked():
                self._building.pop(grammar, None)
        matcher = template.deep_copy()
        self.compile_seconds.append((cached, time.perf_counter() - start))
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
