"""On-device sampling for the engine: one jitted function turns a step's logits [B, V] into the
sampled token ids and their logprobs, for any mix of requests.

Every per-request setting is a row of a device array (`SamplingBatch`, built on the host in numpy
and sent with one `device_put`), so the draw compiles once per row bucket B and serves every mix
of greedy and random rows, temperatures, top-k/top-p/min-p, seeds, biases and logprob requests.
Penalties need each row's token history, so a batch where some row has penalties carries a
`PenaltyBatch`: each penalised row's distinct prompt and output tokens (a `PenaltyHistory` the
engine keeps per request) and output counts, padded to the narrowest of a few widths
(`SamplerConfig.penalty_widths`) that holds the batch's longest history. A batch where some row has a bias, banned ids or penalties runs two small programs
around the same draw: `process_logits` edits the logits before it, and the logprobs of the
unedited logits are taken after it. Other batches never pay for them, and the draw (the
sampler's costly compile) is built once per B, with one copy of each draw (`Sampler`).

The pipeline follows vLLM's v1 sampler, in its order:
  1. `logit_bias` is added; banned ids (EOS and stop ids of a row that has not reached
     `min_tokens`) are set to -inf;
  2. penalties: repetition on tokens seen in the prompt or output, frequency and presence on
     tokens of the output;
  3. greedy rows take the argmax of those logits;
  4. random rows, divided by temperature and masked by min-p, are drawn from in one of two ways:
     - rows with neither top-k nor top-p draw from the whole vocabulary by inverse CDF in two
       levels (a block of 256 tokens by the blocks' masses, then a token inside it, each with one
       uniform number): exact, and no sort;
     - rows with top-k or top-p work on the best candidates of the logits (`row_top_k`): top-k,
       then top-p (over the renormalised survivors) mask them, and a Gumbel-max draw picks one of
       the survivors (each candidate's noise keyed by its token id, not its rank).

Why candidates for top-k / top-p: both need the tokens in order of probability, and at the real
vocabulary (129,280) on 2 CPU cores at B = 32 a full sort costs ~790 ms, while `lax.top_k(1024)`
costs ~40 ms. So those rows use at most `SamplerConfig.candidates` (K, default 1024) candidates,
as the top-k-first samplers of sglang and vLLM do, and first only
`SamplerConfig.first_candidates` (default 64: `row_top_k` at k = 64 takes ~5 ms there).
Every rule keeps a prefix of the ranks, so a row whose kept tokens end inside the first
candidates (top-k <= 64, min-p dropping the last of them, or a nucleus they hold) has its draw;
only in a batch where some row's kept tokens reach past them are all K taken, for those rows only,
and the id-keyed noise makes that draw the one the first candidates would give when the kept
tokens are the same (so a row's token never depends on the rest of the batch). Top-p reads each
candidate's probability over the whole vocabulary (one more pass over [B, V], only when some row
has top-p without top-k), so a nucleus within the K is exact; a wider one is cut at K, and rows
with `top_k` above K act as `top_k = K`. Rows without either (OpenAI's default request,
temperature 1 and top_p 1) are never truncated: the inverse-CDF draw needs one pass of `exp` and
block sums over [B, V] and two short cumulative sums, where `random.categorical` would draw B x V
random numbers (~200 ms). `benchmarks/sampler.py` measures each kind of row at [32, 129280]
(docs/performance.md, "Sampler": top_k 50 in ~6 ms, ~50 ms when all K candidates are taken first;
temperature-only rows 5-9 ms, 23-25 ms before the inverse-CDF draw).

Logprobs follow vLLM's default (`logprobs_mode="raw_logprobs"`): the log_softmax of the model's
own logits, before bias, penalties, temperature and truncation. They are computed only when some
row of the batch asked for them (`logprobs` not None); otherwise the outputs hold zeros.

Randomness: each row's key is folded from threefry key 0 and five words. A row with a seed uses
(0, seed high, seed low, output tokens so far, 0), so the same seed gives the same tokens
whatever else shares the batch, after a preemption and with speculative decoding; a row without
one uses (1 + i, engine seed high, engine seed low, engine step, request index), where i is the
position of a speculative verify row (0 otherwise). The leading word keeps the two apart.

Imports: only what the GPU machine has (jax, numpy and this repository).
"""

from __future__ import annotations

import array
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.engine.compiles import ProgramMemory
from dsv4_jax.engine.program_cache import ProgramCache, describe
from dsv4_jax.engine.request import PLACEHOLDER
from dsv4_jax.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

# Padding token id: out of bounds for any vocabulary, so the scatters (mode="drop") skip it.
PAD_ID = np.iinfo(np.int32).max
_U32 = 2**32


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Static shape choices of the sampler (part of the jit cache key)."""

    candidates: int = 1024  # K: rows with top-k or top-p draw among the K most likely tokens
    # ... among the first this many, unless the tokens a row keeps reach past them (module docstring)
    first_candidates: int = 64
    max_banned_ids: int = 64  # EOS + stop token ids masked per row while below min_tokens
    penalty_history: int = 8192  # the narrowest history width of a penalised batch (`penalty_widths`)
    # token_ids padded to at least this many rows, so the next step (of any bucket) can read them
    # on the device with one compiled gather (async scheduling); 0 = B rows
    pad_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("candidates", "first_candidates", "max_banned_ids", "penalty_history", "pad_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "pad_rows" else 1):
                raise ValueError(f"SamplerConfig.{name} must be an int >= {0 if name == 'pad_rows' else 1}, "
                                 f"got {value!r}")

    def penalty_widths(self, max_distinct: int) -> tuple[int, ...]:
        """The history widths (`PenaltyBatch` columns) of penalised batches whose rows hold at most
        `max_distinct` distinct tokens: `penalty_history`, doubled until one holds them all. A
        batch takes the narrowest that holds its longest history, so no history is ever refused
        and a common batch ships few columns; the engine compiles each width at warm-up."""
        widths = [self.penalty_history]
        while widths[-1] < max_distinct:
            widths.append(2 * widths[-1])
        return tuple(widths)

    def prompt_of_width(self, width: int) -> list[int]:
        """Prompt token ids whose penalised row makes its batch take history width `width` (one of
        `penalty_widths`): more distinct ids than the next narrower width holds."""
        return [0] if width <= self.penalty_history else list(range(width // 2 + 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyBatch:
    """Penalties and the token history they read; W = one of `SamplerConfig.penalty_widths`."""

    repetition: np.ndarray  # [B] float32, 1 = off
    frequency: np.ndarray  # [B] float32, 0 = off
    presence: np.ndarray  # [B] float32, 0 = off
    # [B, W] int32: distinct prompt + output tokens (PAD_ID pads), then a PLACEHOLDER with count 1
    # for a row whose last output the device still computes (async scheduling)
    token_ids: np.ndarray
    output_counts: np.ndarray  # [B, W] int32: times each was generated
    pending_rows: np.ndarray  # [B] int32: where a PLACEHOLDER's token sits in the previous step's token_ids
    # A row's token_ids are exactly its seen tokens, so no prompt flag is needed for repetition.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings of one step, B = the runner's row bucket (padding rows: greedy)."""

    greedy: np.ndarray  # [B] bool
    temperature: np.ndarray  # [B] float32 (1 for greedy rows)
    top_k: np.ndarray  # [B] int32, 0 = off
    top_p: np.ndarray  # [B] float32
    min_p: np.ndarray  # [B] float32
    key_words: np.ndarray  # [B, 5] uint32: the row's random key (module docstring)
    num_logprobs: np.ndarray  # [B] int32: top logprobs wanted, -1 = no logprobs at all
    bias_ids: np.ndarray  # [B, MAX_LOGIT_BIAS] int32 (PAD_ID pads)
    bias_values: np.ndarray  # [B, MAX_LOGIT_BIAS] float32
    banned_ids: np.ndarray  # [B, max_banned_ids] int32 (PAD_ID pads)
    penalties: PenaltyBatch | None  # None: no row has penalties (the cheaper variant)
    # [B, ceil(V / 32)] int32 bitmask of the tokens each row may sample (engine/token_masks.py);
    # None: no row is constrained (the common batch never pays for it)
    token_masks: np.ndarray | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampledTokens:
    token_ids: jax.Array  # [max(B, config.pad_rows)] int32 (rows past B: 0)
    logprobs: jax.Array  # [B] float32: raw logprob of the sampled token
    top_token_ids: jax.Array  # [B, L] int32, L = min(MAX_LOGPROBS, V), most likely first
    top_logprobs: jax.Array  # [B, L] float32; a row reads its first `num_logprobs`
    ranks: jax.Array  # [B] int32: 1 + the tokens more likely than the sampled one (vLLM's rank)


class PenaltyHistory:
    """The distinct prompt + output tokens of one request and how often each was generated: what
    its penalties read (a `PenaltyBatch` row). The engine keeps one per penalised request and
    feeds it each new output token (`catch_up`), so a step copies its `size` numbers instead of
    re-deriving them from the whole sequence (32 rows of 6000-token prompts: 1.9 ms of batch
    building a step, where re-deriving took 105 ms).
    The order of the tokens is free (the device scatters them, adding the counts of a token
    listed twice): the prompt's, then the outputs' new ones as they come."""

    def __init__(self, prompt_token_ids: Sequence[int]):
        ids = np.unique(np.asarray(prompt_token_ids, np.int64)).tolist()
        self.token_ids = array.array("i", ids)  # [size] C ints
        self.output_counts = array.array("i", bytes(4 * len(ids)))  # [size]: times each was generated
        self._at = dict(zip(ids, range(len(ids))))  # token -> its index
        self.num_outputs = 0  # output tokens counted so far
        self.pending = False  # the last output seen is a PLACEHOLDER, not counted yet

    @property
    def size(self) -> int:
        return len(self.token_ids)

    def catch_up(self, output_token_ids: Sequence[int]) -> PenaltyHistory:
        """Count the outputs past the `num_outputs` already counted (a request's outputs only grow).
        A last PLACEHOLDER, the token the device still computes (async scheduling), is counted
        once it is known: the batch lists it as pending (`PenaltyBatch`)."""
        self.pending = bool(output_token_ids) and output_token_ids[-1] == PLACEHOLDER
        known = len(output_token_ids) - self.pending
        for token in output_token_ids[self.num_outputs:known]:
            at = self._at.get(token)
            if at is None:
                if token < 0:
                    raise ValueError(f"output token id {token} in a penalised request's history")
                at = self._at[token] = len(self.token_ids)
                self.token_ids.append(token)
                self.output_counts.append(0)
            self.output_counts[at] += 1
        self.num_outputs = known
        return self


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one request at this step."""

    params: SamplingParams
    request_index: int  # the engine's number for the request: the random stream of unseeded rows
    prompt_token_ids: Sequence[int] = ()  # read for penalties only, when `penalty_history` is None
    output_token_ids: Sequence[int] = ()  # its length drives seeds and min_tokens
    # The request's kept history, caught up with `output_token_ids` (the engine's); None: built
    # here from the two lists.
    penalty_history: PenaltyHistory | None = None
    # Async scheduling: the previous step's row that samples a last output still a PLACEHOLDER.
    previous_row: int = -1
    # Speculative decoding: which position of a verify row this is (0: its first; i: after i
    # drafts). An unseeded row draws each position with its own key (a seeded row's differ by
    # their output index), so the positions of one row are independent draws.
    draft_position: int = 0


def _split64(value: int) -> tuple[int, int]:
    value %= 2**64
    return value >> 32, value % _U32


def banned_below_min_tokens(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids a row bans while it has fewer than `min_tokens` outputs: its stop_token_ids and EOS,
    sorted. EOS even with `ignore_eos`, as vLLM (its stop-id set holds EOS whatever `ignore_eos`)."""
    return sorted(set(params.stop_token_ids) | set(eos_token_ids))


def build_sampling_batch(
    rows: Sequence[SamplingRow],
    bucket: int,
    *,
    vocab_size: int,
    eos_token_ids: Sequence[int] = (),
    engine_seed: int = 0,
    step: int = 0,
    config: SamplerConfig = SamplerConfig(),
    token_masks: np.ndarray | None = None,
) -> SamplingBatch:
    """Host arrays (numpy) of a step's `rows`, padded to `bucket` rows. `step` numbers the engine's
    steps (the random stream of unseeded rows); `token_masks` the rows' allowed tokens, when some
    row is constrained ([bucket, ceil(V / 32)] int32). Raises a ValueError for ids outside the
    vocabulary or a row that does not fit the config's widths."""
    if not 1 <= len(rows) <= bucket:
        raise ValueError(f"a sampling batch of bucket {bucket} holds 1..{bucket} rows, got {len(rows)}")
    greedy = np.ones(bucket, bool)
    temperature, top_p = np.ones(bucket, np.float32), np.ones(bucket, np.float32)
    top_k, min_p = np.zeros(bucket, np.int32), np.zeros(bucket, np.float32)
    key_words = np.zeros((bucket, 5), np.uint32)
    num_logprobs = np.full(bucket, -1, np.int32)
    bias_ids = np.full((bucket, MAX_LOGIT_BIAS), PAD_ID, np.int32)
    bias_values = np.zeros((bucket, MAX_LOGIT_BIAS), np.float32)
    banned_ids = np.full((bucket, config.max_banned_ids), PAD_ID, np.int32)
    engine_hi, engine_lo = _split64(engine_seed)
    for i, row in enumerate(rows):
        p = row.params
        p.check_token_ids(vocab_size)
        if not p.greedy:
            # A top_k of the vocabulary or more keeps every token: off (and any int fits the int32).
            off = p.top_k >= vocab_size
            greedy[i], temperature[i], top_p[i], top_k[i], min_p[i] = (
                False, p.temperature, p.top_p, 0 if off else p.top_k, p.min_p)
        if p.seed is None:
            key_words[i] = (1 + row.draft_position, engine_hi, engine_lo, step % _U32, row.request_index % _U32)
        else:
            key_words[i] = (0, *_split64(p.seed), len(row.output_token_ids) % _U32, 0)
        num_logprobs[i] = -1 if p.logprobs is None else p.logprobs
        if p.logit_bias:
            bias_ids[i, : len(p.logit_bias)] = list(p.logit_bias)
            bias_values[i, : len(p.logit_bias)] = list(p.logit_bias.values())
        if len(row.output_token_ids) < p.min_tokens:
            banned = banned_below_min_tokens(p, eos_token_ids)
            if len(banned) > config.max_banned_ids:
                raise ValueError(
                    f"request {row.request_index}: {len(banned)} EOS and stop_token_ids to ban below min_tokens "
                    f"exceed SamplerConfig.max_banned_ids ({config.max_banned_ids})"
                )
            banned_ids[i, : len(banned)] = banned
    return SamplingBatch(
        greedy, temperature, top_k, top_p, min_p, key_words, num_logprobs, bias_ids, bias_values, banned_ids,
        _penalty_batch(rows, bucket, config) if any(r.params.has_penalties for r in rows) else None,
        token_masks,
    )


def _penalty_batch(rows: Sequence[SamplingRow], bucket: int, config: SamplerConfig) -> PenaltyBatch:
    repetition = np.ones(bucket, np.float32)
    frequency, presence = np.zeros(bucket, np.float32), np.zeros(bucket, np.float32)
    histories = {i: row.penalty_history or PenaltyHistory(row.prompt_token_ids).catch_up(row.output_token_ids)
                 for i, row in enumerate(rows) if row.params.has_penalties}
    width = config.penalty_widths(max(h.size + h.pending for h in histories.values()))[-1]
    token_ids = np.full((bucket, width), PAD_ID, np.int32)
    output_counts = np.zeros((bucket, width), np.int32)
    pending_rows = np.full(bucket, -1, np.int32)
    for i, history in histories.items():
        p, n = rows[i].params, history.size
        repetition[i], frequency[i], presence[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        token_ids[i, :n], output_counts[i, :n] = history.token_ids, history.output_counts
        if history.pending:
            if rows[i].previous_row < 0:
                raise ValueError(f"request {rows[i].request_index}: its last output is pending, but no previous_row "
                                 "says where the previous step samples it")
            token_ids[i, n], output_counts[i, n], pending_rows[i] = PLACEHOLDER, 1, rows[i].previous_row
    return PenaltyBatch(repetition, frequency, presence, token_ids, output_counts, pending_rows)


# ---- device -----------------------------------------------------------------------------------


def apply_token_masks(logits: jax.Array, words: jax.Array) -> jax.Array:
    """Logits of the tokens a row may not sample set to -inf, before anything reads them (bias,
    penalties, the draw and the logprobs). [B, V] float32, [B, ceil(V / 32)] int32 -> [B, V]"""
    b, v = logits.shape
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32], little-endian
    return jnp.where(bits.reshape(b, -1)[:, :v] != 0, logits, -jnp.inf)


def process_logits(logits: jax.Array, batch: SamplingBatch, previous_token_ids: jax.Array | None = None) -> jax.Array:
    """Steps 1-2 of the pipeline: bias, bans and penalties. [B, V] float32 -> [B, V] float32.
    `previous_token_ids` (the previous step's `token_ids`) supplies penalised rows' pending tokens
    (`PenaltyBatch.pending_rows`); a batch without any may leave it out."""
    rows = jnp.arange(logits.shape[0])[:, None]
    x = logits.at[rows, batch.bias_ids].add(batch.bias_values, mode="drop")
    x = x.at[rows, batch.banned_ids].set(-jnp.inf, mode="drop")
    pen = batch.penalties
    if pen is None:
        return x
    ids = pen.token_ids
    if previous_token_ids is not None:  # a PLACEHOLDER takes its row's token of the previous step
        ids = jnp.where(ids == PLACEHOLDER, previous_token_ids[jnp.maximum(pen.pending_rows, 0)][:, None], ids)
    counts = jnp.zeros(x.shape, jnp.int32).at[rows, ids].add(pen.output_counts, mode="drop")
    seen = jnp.zeros(x.shape, bool).at[rows, ids].set(True, mode="drop")
    rep = pen.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)  # vLLM: shrink seen tokens either sign
    return x - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0)


def row_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)`, the same values and ids in the same order (ties and NaNs included), in
    two short passes: XLA:CPU's top_k partially sorts whole rows (on [32, 129280]: 13 ms for k =
    1, 16 ms for k = 20, 45 ms for k = 1024), while the k best entries always lie in the k blocks
    of the vocabulary whose best entries rank first (any entry outside them has k better ones, one
    per block), so one pass takes block maxima, a top_k picks k blocks and a last top_k runs over
    those k blocks only (k = 1: 0.6 ms, k = 20: 1.7 ms, k = 1024: 41 ms).
    [B, V] -> ([B, k] float32, [B, k] int32)"""
    b, v = x.shape
    block = _block_length(v, k)
    if block is None:
        return jax.lax.top_k(x, k)
    blocks = x.reshape(b, v // block, block)
    # Block maxima and block sums in one pass over x (sibling reductions of one operand).
    # XLA:CPU's max can drop a NaN that top_k ranks first: a batch with a NaN block sum (a NaN,
    # or +inf beside -inf in one block: then the plain top_k is merely slower) takes the plain top_k.
    block_max, block_sum = jnp.max(blocks, axis=-1), jnp.sum(blocks, axis=-1)

    def blocked() -> tuple[jax.Array, jax.Array]:
        # Sorted block ids keep the candidates in vocabulary order, so top_k's tie rule (the
        # lower index first) sees the same order as over the whole row.
        chosen = jnp.sort(jax.lax.top_k(block_max, k)[1], axis=-1)  # [B, k]
        candidates = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(b, k * block)
        values, at = jax.lax.top_k(candidates, k)
        ids = jnp.take_along_axis(chosen, at // block, axis=1) * block + at % block
        return values, ids.astype(jnp.int32)

    return jax.lax.cond(jnp.any(jnp.isnan(block_sum)), lambda: tuple(jax.lax.top_k(x, k)), blocked)


def prompt_scores(logits: jax.Array, targets: jax.Array, k: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """vLLM's prompt logprobs of each position's target (the next prompt token), on the device so
    that only these leave it (a prefill chunk's logits are positions x vocab floats: 132 MB for 256
    positions of the real vocabulary, which the host then had to rank under the engine's lock).
    The target's logprob and rank (1 + the tokens with a larger logit: log-softmax keeps their
    order), and the k most likely tokens (`row_top_k`: most likely first, ties by smaller id)
    with their logprobs. [N, V] float32, [N] int32 ->
    ([N] float32, [N] int32, [N, k] int32, [N, k] float32)"""
    log_total = jax.nn.logsumexp(logits, axis=-1)  # [N]
    target = jnp.take_along_axis(logits, targets[:, None], axis=-1)  # [N, 1]
    ranks = jnp.sum(logits > target, axis=-1, dtype=jnp.int32) + 1
    top_values, top_ids = row_top_k(logits, k)
    return target[:, 0] - log_total, ranks, top_ids, top_values - log_total[:, None]


def row_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 (the first maximum; the first NaN): `row_top_k(x, 1)`
    (XLA:CPU's own argmax, a reduction over value-index pairs, takes 5.8 ms on [32, 129280]).
    [B, V] -> [B]"""
    return row_top_k(x, 1)[1][:, 0]


def _block_length(v: int, k: int) -> int | None:
    """The smallest divisor of `v` at least sqrt(v / k): about as many blocks as k blocks hold
    entries, so both passes stay short; None when the k blocks would hold more than v / 8
    entries (no gain)."""
    for block in range(max(1, math.isqrt(max(v // k, 1))), v // 8 + 1):
        if v % block == 0:
            return block if k * block <= v // 8 else None
    return None


def _row_key(words: jax.Array) -> jax.Array:
    key = jax.random.key(0, impl="threefry2x32")
    for i in range(words.shape[0]):
        key = jax.random.fold_in(key, words[i])
    return key


def _min_p_weights(logits: jax.Array, batch: SamplingBatch, best: jax.Array) -> jax.Array:
    """exp(logits / T - best) where min-p keeps the token (p >= min_p * p_max; min_p 0 keeps all),
    else 0. best: [B, 1], the row's largest scaled logit. [B, n] -> [B, n], the best token's = 1"""
    scaled = logits / batch.temperature[:, None] - best
    return jnp.where(scaled >= jnp.log(batch.min_p)[:, None], jnp.exp(scaled), 0.0)


def _has_top_k(batch: SamplingBatch, vocab: int) -> jax.Array:
    return (batch.top_k > 0) & (batch.top_k < vocab)  # [B]; top_k >= V keeps every token: off


def _candidate_noise(keys: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise of each candidate, keyed by the row's key and the candidate's token id (not its
    rank): a row draws the same token among the first candidates as among all K whenever the
    tokens it keeps are the same. [B] keys, [B, n] ids -> [B, n] float32"""
    def row(key: jax.Array, row_ids: jax.Array) -> jax.Array:
        return jax.vmap(lambda token: jax.random.gumbel(jax.random.fold_in(key, token), (), jnp.float32))(row_ids)

    return jax.vmap(row)(keys, ids)


def _draw_among(values: jax.Array, ids: jax.Array, batch: SamplingBatch, keys: jax.Array, has_top_k: jax.Array,
                whole_log_mass: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Step 4 for rows with top-k or top-p, among a row's n best candidates (`row_top_k`: values
    and ids [B, n], most likely first). `has_top_k` [B]: rows whose top-k cuts the vocabulary.
    `whole_log_mass` [B]: log of the unnormalised mass of every token min-p keeps (read by rows
    with top-p and no top-k). Returns the drawn token ids [B] and whether each row's kept tokens
    all lie among the n [B] (then a longer candidate list draws the same token)."""
    n = values.shape[-1]
    scaled = values / batch.temperature[:, None]
    rank = jnp.arange(n)[None, :]
    min_p = jnp.log(batch.min_p)[:, None]  # p >= min_p * p_max; log 0 keeps all
    keep = scaled - scaled[:, :1] >= min_p
    keep &= rank < jnp.where(batch.top_k > 0, batch.top_k, n)[:, None]
    # Top-p reads the survivors' probabilities: renormalised over the top-k survivors, or, without
    # top-k, over every token min-p keeps (the candidates' own sum would make them larger than
    # they are, and the nucleus narrower).
    survivors = jnp.where(keep, scaled, -jnp.inf)
    log_mass = jnp.where(has_top_k, jax.nn.logsumexp(survivors, axis=-1), whole_log_mass)
    probs = jnp.exp(survivors - log_mass[:, None])
    mass = jnp.cumsum(probs, axis=-1)
    # Every rule cuts a prefix of the ranks, so the kept tokens stop inside the n when min-p or
    # top-k already drops the last candidate, when top-k keeps at most n, or (without top-k, whose
    # survivors outside the n would change the normaliser) when the n hold the nucleus: the next
    # candidate would start at mass >= top_p.
    fits = ~keep[:, -1] | (has_top_k & (batch.top_k <= n)) | (~has_top_k & (mass[:, -1] >= batch.top_p))
    keep &= (mass - probs < batch.top_p[:, None]) | (rank == 0)  # vLLM's top-p, the best always kept
    choice = jnp.argmax(jnp.where(keep, scaled + _candidate_noise(keys, ids), -jnp.inf), axis=-1)
    # One gather of the chosen candidate: slicing `ids[:, 0]` instead makes XLA:CPU lower top_k
    # as a full sort (30x slower at the real vocabulary).
    return jnp.take_along_axis(ids, choice[:, None], axis=1)[:, 0], fits


def _draw_candidates(x: jax.Array, batch: SamplingBatch, keys: jax.Array, truncated: jax.Array,
                     config: SamplerConfig) -> jax.Array:
    """Step 4 for rows with top-k or top-p (`truncated` [B]): among the first candidates, and among
    all K only in a batch where some row's kept tokens reach past the first ones (those rows take
    that draw). [B, V] -> token ids [B]"""
    k = min(config.candidates, x.shape[-1])
    first = min(config.first_candidates, k)
    has_top_k = _has_top_k(batch, x.shape[-1])
    values, ids = row_top_k(x, first)
    best = values[:, :1] / batch.temperature[:, None]  # the row's largest scaled logit

    def whole_mass() -> jax.Array:  # [B] log of the unnormalised mass of what min-p keeps
        return best[:, 0] + jnp.log(jnp.sum(_min_p_weights(x, batch, best), axis=-1))

    # A pass over [B, V] only in a batch with top-p rows without top-k.
    needs_mass = jnp.any(truncated & ~has_top_k & (batch.top_p < 1))
    whole_log_mass = jax.lax.cond(needs_mass, whole_mass, lambda: jnp.zeros(x.shape[0], jnp.float32))
    tokens, fits = _draw_among(values, ids, batch, keys, has_top_k, whole_log_mass)
    if first == k:
        return tokens
    wide = truncated & ~fits

    def among_all() -> jax.Array:
        return _draw_among(*row_top_k(x, k), batch, keys, has_top_k, whole_log_mass)[0]

    return jnp.where(wide, jax.lax.cond(jnp.any(wide), among_all, lambda: tokens), tokens)


# Tokens per block of the untruncated draw: short cumulative sums at both levels (505 blocks at
# the real vocabulary), so float32 rounding stays near one ulp of the row's mass.
DRAW_BLOCK = 256


def _inverse_cdf(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """Index i with probability weights[i] / sum(weights), per row. [B, n] >= 0, [B] in [0, 1) -> [B]"""
    cdf = jnp.cumsum(weights, axis=-1)
    index = jnp.sum(cdf <= (uniform * cdf[:, -1])[:, None], axis=-1, dtype=jnp.int32)
    # The first entry whose cdf passes u * mass always has weight > 0, unless rounding put the
    # product at the mass itself: then the last entry with weight.
    last = weights.shape[-1] - 1 - jnp.argmax((weights > 0)[:, ::-1], axis=-1).astype(jnp.int32)
    return jnp.minimum(index, last)


def _draw_untruncated(x: jax.Array, batch: SamplingBatch, keys: jax.Array) -> jax.Array:
    """Step 4 for rows without top-k or top-p: the whole vocabulary (min-p applied), by inverse
    CDF over blocks, then inside the chosen block. [B, V] -> token ids [B]"""
    b, v = x.shape
    block = min(v, DRAW_BLOCK)
    blocks = -(-v // block)
    if blocks * block > v:
        x = jnp.pad(x, ((0, 0), (0, blocks * block - v)), constant_values=-jnp.inf)
    # max(x) / T is max(x / T) exactly (T > 0), without a [B, V] buffer of x / T.
    best = jnp.max(x, axis=-1, keepdims=True) / batch.temperature[:, None]

    def weigh(logits: jax.Array) -> jax.Array:
        return _min_p_weights(logits, batch, best)

    uniform = jax.vmap(lambda key: jax.random.uniform(key, (2,), jnp.float32))(keys)  # [B, 2]
    chosen = _inverse_cdf(jnp.sum(weigh(x).reshape(b, blocks, block), axis=-1), uniform[:, 0])  # [B] block
    # The chosen block's weights are computed again from its logits: gathering them from the
    # weights of the whole row made XLA:CPU take 20 ms instead of 4 at [32, 129280].
    inside = jax.vmap(lambda row, j: jax.lax.dynamic_slice(row, (j * block,), (block,)))(x, chosen)  # [B, block]
    return chosen * block + _inverse_cdf(weigh(inside), uniform[:, 1])


def _raw_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, ...]:
    """Logprob, top logprobs and rank of each row's token. Each pass over [B, V] costs ~3 ms at
    [32, 129280] on 2 CPU cores, so the top list also gives the log-sum-exp its shift (the row's
    maximum, as `jax.nn.logsumexp` takes it) and the ranks: every token more likely than one at
    or above the list's last value is in the list, so only a batch with a token below it counts
    over the whole vocabulary (greedy rows never are: a greedy batch with logprobs takes 5.1 ms,
    where counting over the whole vocabulary took 8.6, for the same outputs)."""
    top_values, top_ids = row_top_k(logits, min(MAX_LOGPROBS, logits.shape[-1]))
    best = top_values[:, :1]
    shift = jnp.where(jnp.isfinite(best), best, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(logits - shift), axis=-1)) + shift[:, 0]
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0]
    listed = 1 + jnp.sum(top_values > picked[:, None], axis=-1, dtype=jnp.int32)
    ranks = jax.lax.cond(
        jnp.all(picked >= top_values[:, -1]), lambda: listed,
        lambda: 1 + jnp.sum(logits > picked[:, None], axis=-1, dtype=jnp.int32))
    return picked - lse, top_ids, top_values - lse[:, None], ranks


def _sample(logits: jax.Array, batch: SamplingBatch, config: SamplerConfig = SamplerConfig()) -> SampledTokens:
    """The draw, on logits whose bias, bans and penalties are applied (`Sampler` does that first:
    the draw reads none of them)."""
    truncated = ~batch.greedy & (_has_top_k(batch, logits.shape[-1]) | (batch.top_p < 1))
    untruncated = ~batch.greedy & ~truncated

    keys = jax.vmap(_row_key)(batch.key_words)  # [B]: once, outside the branches (one copy to compile)

    def pick(x: jax.Array) -> jax.Array:
        # Each draw runs only in a batch that has its kind of rows (greedy rows: the argmax).
        tokens = row_argmax(x)
        tokens = jnp.where(truncated, jax.lax.cond(
            jnp.any(truncated), lambda: _draw_candidates(x, batch, keys, truncated, config), lambda: tokens), tokens)
        return jnp.where(untruncated, jax.lax.cond(
            jnp.any(untruncated), lambda: _draw_untruncated(x, batch, keys), lambda: tokens), tokens)

    # Runtime branches, not compile variants: a greedy-only batch skips both draws and a batch
    # without logprob requests skips the log_softmax. Bias, bans and penalties were applied before
    # (`Sampler`): the draw reads the logits as they are, so one copy of `pick` is compiled.
    tokens = pick(logits)
    logprobs = jax.lax.cond(jnp.any(batch.num_logprobs >= 0), lambda: _raw_logprobs(logits, tokens),
                            lambda: _no_logprobs(logits))
    if config.pad_rows > logits.shape[0]:
        tokens = jnp.zeros(config.pad_rows, jnp.int32).at[: logits.shape[0]].set(tokens)
    return SampledTokens(tokens, *logprobs)


def edits_logits(batch: SamplingBatch) -> bool:
    """Whether some row has a logit bias, banned ids or penalties (host arrays, or fetched)."""
    return (batch.penalties is not None or bool(np.any(np.asarray(batch.bias_ids) != PAD_ID))
            or bool(np.any(np.asarray(batch.banned_ids) != PAD_ID)))


def _no_logprobs(logits: jax.Array) -> tuple[jax.Array, ...]:
    b, top = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])
    return (jnp.zeros(b, jnp.float32), jnp.zeros((b, top), jnp.int32), jnp.zeros((b, top), jnp.float32),
            jnp.zeros(b, jnp.int32))


class _SamplingPlan(NamedTuple):
    edit: Callable | None  # the jitted process_logits for these logits; None: the batch edits nothing
    edit_args: tuple  # (logits, batch[, previous token ids])
    width: int | None  # the penalty history's width (None: no penalties)
    draw_batch: SamplingBatch  # what the draw is given (edits already applied)
    wants_logprobs: bool  # some row asked for logprobs of the edited batch's raw logits


def _with_raw_logprobs(logits: jax.Array, sampled: SampledTokens) -> SampledTokens:
    """`sampled` (drawn from edited logits) with the logprobs of the step's own `logits`."""
    return SampledTokens(sampled.token_ids, *_raw_logprobs(logits, sampled.token_ids[: logits.shape[0]]))


class Sampler:
    """A step's logits [B, V] and its `SamplingBatch` -> `SampledTokens`.

    The draw (`_sample`, the costly compile) is built once per (B, V) and reads the logits as they
    are. A batch where some row has a logit bias, banned ids (EOS below `min_tokens`) or penalties
    runs two small programs around it: `process_logits` (in vLLM's order) before, and the raw
    logprobs of the step's own logits after, when some row asked for them: compiling both kinds of
    batch (the engine's warm-up for one row count) takes half the time of one draw compiled with
    and without penalties, each holding two copies of its draws behind a cond (2.8-3.3 s against
    5.9-6.4 s at [4, 512] on 2 CPU cores). The common batch never copies [B, V] (handing the draw
    both arrays, or editing inside it before one copy of the draws, copies them: +2 ms a greedy
    32-row step at the real vocabulary), and an edited batch costs one [B, V] write.

    With a `mesh`, the batch is put whole on every device and every output comes back whole on
    every device, so whichever process reads the tokens has them (one small gather of [B]-sized
    arrays)."""

    def __init__(self, config: SamplerConfig = SamplerConfig(), mesh: jax.sharding.Mesh | None = None,
                 programs: ProgramCache | None = None):
        self.config = config
        # `compile`'s executables, read back from disk on a restart (none kept: None).
        self.programs = programs if programs is not None else ProgramCache.default()
        self._whole = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._draw = jax.jit(_sample, static_argnames="config", out_shardings=self._whole)
        self._logprobs = jax.jit(_with_raw_logprobs, out_shardings=self._whole)
        self._edit = {}  # (program, logits sharding) -> jitted process_logits / apply_token_masks
        self._last_token_ids: jax.Array | None = None  # of the last draw
        # Executables `compile` built ahead of time, by `_program_key`; a call of any other shape
        # compiles through the jitted function, as before.
        self._compiled: dict[tuple, jax.stages.Compiled] = {}

    def __call__(self, logits: jax.Array, batch: SamplingBatch,
                 previous_token_ids: jax.Array | None = None) -> SampledTokens:
        """`previous_token_ids`: the previous step's `token_ids`, when some penalised row's last
        output is its pending sample (async scheduling)."""
        sampled = self._sample(logits, batch, previous_token_ids)
        self._last_token_ids = sampled.token_ids
        return sampled

    def _sample(self, logits: jax.Array, batch: SamplingBatch, previous_token_ids: jax.Array | None) -> SampledTokens:
        if batch.token_masks is not None:
            # The masked logits stand for the step's own from here on (logprobs included), placed
            # as they are: every later program is the unconstrained batch's.
            masks = batch.token_masks if self._whole is None else jax.device_put(batch.token_masks, self._whole)
            logits = self._run("mask", logits, self._jitted_for(logits, "mask"), logits, masks)
            batch = dataclasses.replace(batch, token_masks=None)
        plan = self._plan(logits, batch, previous_token_ids)
        if plan.edit is None:
            return self._run("draw", logits, self._draw_with_config, logits, plan.draw_batch)
        # The edited logits are placed as the step's logits are, so the draw reads them with the
        # executable of the step's logits.
        edited = self._run(("edit", plan.width), logits, plan.edit, *plan.edit_args)
        sampled = self._run("draw", logits, self._draw_with_config, edited, plan.draw_batch)
        return self._run("logprobs", logits, self._logprobs, logits, sampled) if plan.wants_logprobs else sampled

    def _draw_with_config(self, logits, batch):
        return self._draw(logits, batch, config=self.config)

    def _plan(self, logits, batch: SamplingBatch, previous_token_ids) -> _SamplingPlan:
        """The programs `_sample` runs for this batch and what they are given (host side only)."""
        if not edits_logits(batch):
            return _SamplingPlan(None, (), None, self._put(batch), False)
        edit_args = (logits, self._put(batch))
        if batch.penalties is not None:
            if previous_token_ids is None:
                if (np.asarray(batch.penalties.pending_rows) >= 0).any():
                    raise ValueError("a penalised row's last output is pending: pass the previous step's token_ids")
                # Only pending rows read them, but some token ids of a draw's shape always go in,
                # so a penalised batch has one executable per width: the last draw's (in the
                # engine, placed exactly as a pending step's are), or zeros before any draw.
                rows = max(logits.shape[0], self.config.pad_rows)
                previous_token_ids = self._last_token_ids
                if previous_token_ids is None or previous_token_ids.shape != (rows,):
                    previous_token_ids = np.zeros(rows, np.int32)
            edit_args += (previous_token_ids,)
        draw_batch = dataclasses.replace(  # what process_logits applied, and logprobs read below
            batch, penalties=None, bias_ids=np.full(np.shape(batch.bias_ids), PAD_ID, np.int32),
            banned_ids=np.full(np.shape(batch.banned_ids), PAD_ID, np.int32),
            num_logprobs=np.full(np.shape(batch.num_logprobs), -1, np.int32))
        width = None if batch.penalties is None else np.shape(batch.penalties.token_ids)[1]
        wants_logprobs = bool(np.any(np.asarray(batch.num_logprobs) >= 0))
        return _SamplingPlan(self._edit_for(logits), edit_args, width, self._put(draw_batch), wants_logprobs)

    def _run(self, program, logits, jitted, *args):
        """`program`'s executable compiled ahead of time for logits of this shape and placement,
        else the jitted function (which compiles on its first call of a shape)."""
        compiled = self._compiled.get(self._program_key(program, logits))
        return (jitted if compiled is None else compiled)(*args)

    def _program_key(self, program, logits) -> tuple:
        return program, logits.shape, None if self._whole is None else logits.sharding

    def compile(self, cases: Sequence[tuple[jax.Array, SamplingBatch]]) -> int:
        """Compile ahead of time, several at once, every program that sampling each (logits,
        batch) runs: the logits as a step lays them out (arrays, or `jax.ShapeDtypeStruct`s with
        their sharding), a penalised batch given the previous draw's token ids as a draw returns
        them. Calls of those shapes then run the executables. Returns how many it compiled."""
        draws, later = {}, {}
        for logits, batch in cases:
            if batch.token_masks is not None:
                key = self._program_key("mask", logits)
                if key not in self._compiled and key not in draws:
                    masks = batch.token_masks if self._whole is None else jax.device_put(batch.token_masks, self._whole)
                    draws[key] = self._job("mask", logits, masks, lower=functools.partial(
                        self._jitted_for(logits, "mask").lower, logits, masks))
                batch = dataclasses.replace(batch, token_masks=None)
            # The draw's batch: previous token ids only go to the edit (placeholders here).
            plan = self._plan(logits, batch, np.zeros(max(logits.shape[0], self.config.pad_rows), np.int32))
            key = self._program_key("draw", logits)
            if key not in self._compiled:
                draws[key] = self._job("draw", logits, plan.draw_batch, lower=functools.partial(
                    self._draw.lower, logits, plan.draw_batch, config=self.config))
        self._compiled.update(self.programs.compile(draws))
        for logits, batch in cases:
            batch = dataclasses.replace(batch, token_masks=None)
            drawn = self._compiled[self._program_key("draw", logits)].out_info  # SampledTokens of structs
            if self._whole is None:
                # An executable's outputs are committed to a device when some argument it was
                # lowered with was, whatever it is called with; out_info's structs name one. Without
                # them every program's outputs are as committed as the step's logits, as the jitted
                # calls' were: else placeholder filling would meet token ids of both kinds.
                drawn = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), drawn)
            plan = self._plan(logits, batch, drawn.token_ids)
            if plan.edit is not None:
                key = self._program_key(("edit", plan.width), logits)
                if key not in self._compiled and key not in later:
                    later[key] = self._job(("edit", plan.width), *plan.edit_args,
                                           lower=functools.partial(plan.edit.lower, *plan.edit_args))
            if plan.wants_logprobs:
                key = self._program_key("logprobs", logits)
                if key not in self._compiled and key not in later:
                    later[key] = self._job("logprobs", logits, drawn,
                                           lower=functools.partial(self._logprobs.lower, logits, drawn))
        self._compiled.update(self.programs.compile(later))
        return len(draws) + len(later)

    def _job(self, program, *args, lower) -> tuple[str, Callable]:
        """(identity, lower) of one program for the program cache."""
        return describe(f"sampler {program}", args, config=self.config, placed=self._whole), lower

    def _edit_for(self, logits):
        """The jitted `process_logits` for logits placed as these are (on a mesh, one per sharding)."""
        return self._jitted_for(logits, "edit")

    def _jitted_for(self, logits, program: str):
        """`process_logits` ("edit") or `apply_token_masks` ("mask") jitted to give logits placed
        as these are (on a mesh, one per sharding)."""
        sharding = None if self._whole is None else logits.sharding
        if (program, sharding) not in self._edit:
            function = process_logits if program == "edit" else apply_token_masks
            self._edit[program, sharding] = jax.jit(function, out_shardings=sharding)
        return self._edit[program, sharding]

    def program_memory(self, logits: jax.ShapeDtypeStruct, penalised: SamplingBatch) -> int:
        """The most that sampling a step's logits ([B, V] float32, as the step lays them out) needs
        on a device besides them, in bytes: a batch that edits the logits (`penalised`: the
        widest penalty history a batch can have, with logprobs) holds the edited copy through the
        draw and the logprobs of the raw logits after it. Compiled (`compile`), never run."""
        self.compile([(logits, penalised)])
        width = np.shape(penalised.penalties.token_ids)[1]
        edit, draw, logprobs = (ProgramMemory.of(self._compiled[self._program_key(program, logits)])
                                for program in (("edit", width), "draw", "logprobs"))
        return edit.outputs + max(edit.temp, draw.total, draw.outputs + logprobs.total)

    def _put(self, batch: SamplingBatch) -> SamplingBatch:
        """Without a mesh the jit moves numpy arrays faster itself."""
        return batch if self._whole is None else jax.device_put(batch, self._whole)


_samplers: dict[SamplerConfig, Sampler] = {}


def sample(logits: jax.Array, batch: SamplingBatch, config: SamplerConfig = SamplerConfig()) -> SampledTokens:
    """`Sampler(config)(logits, batch)`, one `Sampler` per config (its compiled programs are kept)."""
    if config not in _samplers:
        _samplers[config] = Sampler(config)
    return _samplers[config](logits, batch)
