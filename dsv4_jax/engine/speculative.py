"""Speculative decoding with DeepSeek-V4's MTP block (docs/speculative_decoding.md).

Each decode row of a step is a sequence's last token and up to k drafts; the step scores the
k + 1 positions at once (`ModelRunner`: each row's last k + 1 logits) and the engine samples every
position with the ordinary sampler, each as the row would sample it there: its own seed's output
index, `min_tokens` and logit bias at that position. Draft i is kept while the token sampled at
the position before it equals it; the first token that differs, or the one after the last draft,
ends the row. With greedy drafts (the MTP drafter's argmax, and the test drafters) this is
rejection sampling with a one-hot draft distribution q: draft d is kept with probability
min(1, p(d) / q(d)) = p(d), and a rejected position's token is distributed as p without d, which
is normalise(max(0, p - q)). Every emitted token is therefore distributed exactly as without
speculation, and with a seed it is the same token (the key of an output index does not change).

Rows that speculate nothing (their row is one token, as without speculation): requests with
penalties (their history would have to include each draft), structured outputs or other token
masks (the grammar would have to advance over the drafts), and a request's last token before
`max_tokens` or `max_model_len`.

Imports: nothing heavier than numpy: the server's argument parsing reads this module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol, Sequence

METHODS = ("mtp", "deepseek_mtp")  # vLLM's names for the V4 MTP drafter
MAX_SPECULATIVE_TOKENS = 4
FLAG = "--speculative-config"


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys that apply here."""

    method: str = "mtp"
    num_speculative_tokens: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"{FLAG}: method must be one of {', '.join(METHODS)} (DeepSeek-V4's MTP block), "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{FLAG}: num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                             f"got {k!r}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """JSON text (the flag), a dict (`LLM(speculative_config=...)`) or a config; None: off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"{FLAG} must be a JSON object, e.g. "
                                 f"'{{\"method\": \"mtp\", \"num_speculative_tokens\": 2}}': {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{FLAG} must be a JSON object with method and num_speculative_tokens, got {value!r}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens", "model"})
        if unknown:
            raise ValueError(f"{FLAG}: unsupported keys {unknown}; dsv4-jax takes method and num_speculative_tokens "
                             "(the drafter is the checkpoint's own MTP block)")
        if value.get("model") is not None:
            raise ValueError(f"{FLAG}: model must be left out: the MTP drafter is the served checkpoint's own block")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError(f"{FLAG} needs method and num_speculative_tokens, e.g. "
                             f"'{{\"method\": \"mtp\", \"num_speculative_tokens\": 2}}'; got {value!r}")
        return cls(value["method"], value["num_speculative_tokens"])

    def check_model(self, config: Any, model_dir: str | Path | None = None) -> None:
        """A ValueError when the checkpoint has no V4 MTP block to draft with: speculation is
        never silently off. `model_dir`: where config.json is, to recognise the DSpark drafter
        of the 0731 and V4.1 releases (its `mtp.*` tensors are not the V4 block)."""
        if config.num_nextn_predict_layers < 1:
            raise ValueError(f"{FLAG}: the model has no MTP block (num_nextn_predict_layers is 0), so there is "
                             f"nothing to draft with; drop {FLAG}")
        ratios = [r for r in config.compress_ratios if r]
        if ratios and self.num_speculative_tokens > min(ratios):
            # One spare compressor window a slot holds what a rejection goes back to only while
            # drafts are no longer than a window (model/cache_step.py).
            raise ValueError(f"{FLAG}: num_speculative_tokens {self.num_speculative_tokens} exceeds the model's "
                             f"smallest compression ratio {min(ratios)}; pass at most {min(ratios)}")
        if model_dir is not None:
            raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
            if any(key.startswith("dspark_") for key in raw):
                raise ValueError(f"{FLAG}: this checkpoint's mtp.* tensors are a DSpark block drafter (config.json "
                                 "has dspark_* keys: the 0731 and V4.1 releases), not the V4 MTP block method "
                                 f"{self.method!r} drafts with; dsv4-jax does not run DSpark yet: drop {FLAG}")


class Drafter(Protocol):
    """Proposes drafts on the host (the MTP drafter runs on the device, in `ModelRunner.draft`)."""

    def propose(self, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to `k` tokens to follow `token_ids` (a request's prompt and outputs so far)."""


def accepted_tokens(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a verify row emits: `sampled` [len(drafts) + 1], the token drawn at each of its
    positions; draft i is kept while sampled[i] equals it, and the first that differs (or the one
    after the last draft) ends the row. Returns sampled[: accepted + 1]."""
    n = 0
    while n < len(drafts) and int(sampled[n]) == int(drafts[n]):
        n += 1
    return [int(t) for t in sampled[: n + 1]]


@dataclasses.dataclass
class SpecDecodeStats:
    """vLLM's speculative-decoding counters, since the engine started."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verify rows that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verify row with drafts emitted on average (accepted + 1), vLLM's log figure."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
