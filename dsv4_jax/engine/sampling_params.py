"""`SamplingParams`: how one request is sampled, with vLLM's names, defaults and ranges, so a vLLM
client's arguments mean the same here. Plain Python: no jax here.

Everything is checked when the object is made: a bad value raises a ValueError naming the
argument, the value found and what is allowed, before the request reaches the engine. Token ids
are checked against the vocabulary later (`check_token_ids`), once the model is known.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
from pathlib import Path
from typing import Any

from dsv4_jax.engine.request import RequestRejected
from dsv4_jax.engine.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Greedy below this temperature: dividing logits by less overflows float32 (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# Positive temperatures below this are raised to it, as vLLM does (its _MAX_TEMP): only 0 is greedy,
# and a client's 0.001 samples exactly as it would on vLLM.
MIN_SAMPLING_TEMPERATURE = 1e-2
# Top logprobs a request may ask for, besides the sampled token's (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20
# logit_bias entries a request may carry: the sampler holds them in a fixed-width array.
MAX_LOGIT_BIAS = 300
# Stop strings a request may carry: each new token's text is searched for every one of them, on the
# engine's thread, so a request with thousands would slow every other request's steps.
MAX_STOP_STRINGS = 128
# The largest float32: the sampler holds temperatures and biases in float32, where larger values
# would become inf (a temperature of inf, or a bias of inf minus inf, is no distribution).
_FLOAT32_MAX = 3.4028234663852886e38
_INT64 = (-(2**63), 2**63 - 1)  # OpenAI's seed range
GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field: the keys vLLM takes as request defaults.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bad(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling of one request, as vLLM's: `temperature` 0 means greedy (and then `n` must be 1), a
    positive one below 0.01 is raised to 0.01 with a warning; `top_k` 0 or -1 means no top-k (stored
    as 0); `seed` -1 means none (stored as None); `stop` is stored as a list, `stop_token_ids` as a
    list."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top logprobs returned besides the sampled token's
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Token constraints (engine/token_masks.py): a grammar, the only ids allowed, words never written.
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Keep only the last k prompt tokens (-1: the last max_model_len), as vLLM's.
    truncate_prompt_tokens: int | None = None
    # Derived once here, so what each step and each token checks costs O(1): the largest token id
    # that logit_bias or stop_token_ids names (-1: none), and the stop ids as a set.
    _largest_token_id: int = dataclasses.field(init=False, repr=False, compare=False, default=-1)
    _stop_id_set: frozenset[int] = dataclasses.field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self) -> None:
        self._check_ints()
        self._check_reals()
        self._check_lists()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed == -1:  # vLLM's "no seed"
            object.__setattr__(self, "seed", None)
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            logger.warning("temperature %s is below %s, which vLLM raises to %s; so does dsv4-jax",
                           self.temperature, MIN_SAMPLING_TEMPERATURE, MIN_SAMPLING_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_SAMPLING_TEMPERATURE)
        if isinstance(self.structured_outputs, dict):  # the server's and a notebook's plain form
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams, a dict or None")
        if self.greedy and self.n > 1:  # n copies of one greedy answer: vLLM refuses them too
            raise _bad("n", self.n, "1 when using greedy sampling (temperature 0)")

    def _check_ints(self) -> None:
        bounds = {  # name: (lowest, highest, whether None is allowed)
            "n": (1, None, False),
            "top_k": (-1, None, False),
            "seed": (*_INT64, True),
            "logprobs": (0, MAX_LOGPROBS, True),
            "prompt_logprobs": (0, MAX_LOGPROBS, True),
            "max_tokens": (1, None, True),
            "min_tokens": (0, None, False),
            "truncate_prompt_tokens": (-1, None, True),
        }
        for name, (low, high, optional) in bounds.items():
            value = getattr(self, name)
            allowed = f"an int in [{low}, {'inf' if high is None else high}]" + (" or None" if optional else "")
            if value is None and optional:
                continue
            if not _is_int(value) or value < low or (high is not None and value > high):
                raise _bad(name, value, allowed)
            object.__setattr__(self, name, int(value))
        if self.truncate_prompt_tokens == 0:
            raise _bad("truncate_prompt_tokens", 0, "an int >= 1, -1 (max_model_len) or None")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")

    def _check_reals(self) -> None:
        ranges = {  # name: (test, description of what is allowed)
            "temperature": (lambda v: 0 <= v <= _FLOAT32_MAX, f"a number in [0, {_FLOAT32_MAX:.6g}]"),
            "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
            "min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            "presence_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
            "frequency_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
            "repetition_penalty": (lambda v: v > 0, "a finite number > 0"),
        }
        for name, (ok, allowed) in ranges.items():
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or not ok(value):
                raise _bad(name, value, allowed)
            object.__setattr__(self, name, float(value))

    def _check_lists(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            allowed = f"a dict of at most {MAX_LOGIT_BIAS} {{token id: bias}} entries"
            if not isinstance(bias, dict):
                raise _bad("logit_bias", bias, allowed)
            if len(bias) > MAX_LOGIT_BIAS:  # the count, not the whole dict, in the message
                raise ValueError(f"SamplingParams.logit_bias must be {allowed}, got {len(bias)} entries")
            for token, value in bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"SamplingParams.logit_bias keys must be token ids (ints >= 0), got {token!r}")
                if not _is_real(value) or not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
                    raise ValueError(
                        f"SamplingParams.logit_bias values must be finite float32 numbers, got {value!r} for {token}"
                    )
            object.__setattr__(self, "logit_bias", {int(t): float(v) for t, v in bias.items()})
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", self.stop, "a non-empty str, a list of non-empty str, or None")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"SamplingParams.stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        object.__setattr__(self, "stop", list(stop))
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "a list of token ids (ints >= 0) or None")
        object.__setattr__(self, "stop_token_ids", [int(t) for t in ids])
        object.__setattr__(self, "_stop_id_set", frozenset(self.stop_token_ids))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in allowed):
                raise _bad("allowed_token_ids", allowed, "a non-empty list of token ids (ints >= 0) or None")
            if not allowed:  # vLLM's rule: nothing allowed is no distribution
                raise ValueError("SamplingParams.allowed_token_ids is not None and empty!")
            object.__setattr__(self, "allowed_token_ids", [int(t) for t in allowed])
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise _bad("bad_words", words, "a list of non-blank strings or None")
            object.__setattr__(self, "bad_words", list(words))
        named = (max(self._stop_id_set, default=-1), max(self.logit_bias or (), default=-1),
                 max(self.allowed_token_ids or (), default=-1))
        object.__setattr__(self, "_largest_token_id", max(named))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_child(self, index: int) -> SamplingParams:
        """Choice `index` of a request with n > 1: one sequence, seed + index as vLLM (wrapped
        into OpenAI's int64 range, so a seed near its top stays a valid request). Last: a
        `dataclasses.replace` of a child runs the checks again, which would turn a seed of -1 into
        no seed."""
        if self.n == 1:
            return self
        child = dataclasses.replace(self, n=1)
        if self.seed is not None:  # set after the checks: seed + index may be -1, a seed here (as in vLLM)
            object.__setattr__(child, "seed", (self.seed + index - _INT64[0]) % 2**64 + _INT64[0])
        return child

    def is_stop_token(self, token_id: int) -> bool:
        """Whether `token_id` is one of `stop_token_ids` (a set lookup, not a list scan)."""
        return token_id in self._stop_id_set

    @property
    def has_token_mask(self) -> bool:
        """Whether some of its tokens are constrained (a grammar, allowed ids or bad words)."""
        return self.structured_outputs is not None or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise a RequestRejected (a ValueError) if `logit_bias` or `stop_token_ids` name a token
        outside the vocabulary (the sampler would otherwise drop it silently). O(1) when all are
        inside: each step's batch checks every row again."""
        if self._largest_token_id < vocab_size:
            return
        for name, ids in (("logit_bias", list(self.logit_bias or ())), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise RequestRejected(
                    f"SamplingParams.{name} has token ids {outside[:8]} outside the vocabulary [0, {vocab_size})", name)


def generation_defaults(model_dir: str | Path, generation_config: str | Path = "auto",
                        name: str = "generation_config") -> dict[str, Any]:
    """vLLM's sampling defaults from generation_config.json: the SamplingParams values
    (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens from max_new_tokens) it sets.
    `generation_config` as vLLM's: "auto" reads `model_dir`'s file if there is one, "vllm" uses
    none, a directory reads its own. A ValueError names `name` (the argument or flag) for a
    directory without the file, and the file if it is not JSON or a value is out of range."""
    if generation_config == "vllm":
        return {}
    path = Path(model_dir if generation_config == "auto" else generation_config) / GENERATION_CONFIG_FILE
    if not path.is_file():
        if generation_config == "auto":
            return {}
        raise ValueError(f"{name} {str(generation_config)!r}: no {GENERATION_CONFIG_FILE} in that directory "
                         f"(allowed: auto, vllm, or a directory holding {GENERATION_CONFIG_FILE})")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(raw).__name__}")
    defaults = {field: raw[key] for key, field in GENERATION_KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**defaults)  # the same checks a request's own values get
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return defaults


def default_max_tokens_within(params: SamplingParams, room: int) -> SamplingParams:
    """`params` whose max_tokens is a default, not the caller's: beyond `room` (what max_model_len
    leaves a prompt) it becomes None, which the engine reads as "what is left" (vLLM caps a
    default too). A caller's own max_tokens never goes through this: it is refused with the numbers."""
    if params.max_tokens is None or params.max_tokens <= room:
        return params
    return dataclasses.replace(params, max_tokens=None)
