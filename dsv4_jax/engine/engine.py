"""The synchronous engine: scheduler -> runner -> sampler -> detokenizer, one step at a time.

`step()` asks the scheduler for one runner step (decode rows first, then prefill chunks), runs
it, samples a token for every row whose chunk reached the end of its request's known tokens (the
"sampling rows"), hands the tokens back to the scheduler, and then decides which requests stop:
EOS (unless `ignore_eos`), a stop token, a stop string (found by the detokenizer, never shown even
in part), `max_tokens` or `max_model_len`. Stop tokens only count once `min_tokens` tokens exist
(the sampler also bans EOS and stop ids until then), stop strings only from the token after them
on (a match may begin in their text), as in vLLM; EOS, a stop token or a stop string that comes as
the `max_tokens`-th token still reports "stop" (vLLM >= 0.11.1 checks them before the length).

`completion_tokens` counts every sampled token, the EOS or stop token included (as vLLM does);
the text leaves out special tokens (`skip_special_tokens`) and the stop string.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.parallel.distributed import StepChannel
from dsv4_jax.engine.block_manager import BlockManager
from dsv4_jax.engine.compiles import CompileCounter
from dsv4_jax.engine.detokenizer import IncrementalDetokenizer
from dsv4_jax.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenIdsSoFar
from dsv4_jax.engine.request import PLACEHOLDER, Request, RequestRejected, RequestStatus, integer_token_ids
from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepOutput
from dsv4_jax.engine.lockstep import Lockstep
from dsv4_jax.engine.sampler import (
    PenaltyHistory,
    SampledTokens,
    Sampler,
    SamplerConfig,
    SamplingRow,
    banned_below_min_tokens,
    build_sampling_batch,
)
from dsv4_jax.engine.sampling_params import SamplingParams
from dsv4_jax.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from dsv4_jax.engine.speculative import Drafter, SpecDecodeStats, SpeculativeConfig, accepted_tokens
from dsv4_jax.engine.structured_outputs import GrammarCompiler, StructuredOutputsConfig, check_structured_outputs
from dsv4_jax.engine.token_masks import TokenMask, bad_words_token_ids, fill_masks, packed_ids
from dsv4_jax.kv_cache.paged import PagedCacheLayout
from dsv4_jax.chat.tokenizer import token_text
from dsv4_jax.chat.tokens import THINK_END, THINK_START

logger = logging.getLogger(__name__)

_FILLER = SamplingParams(temperature=0.0, max_tokens=1)  # rows that sample nothing this step


@jax.jit
def _fill_placeholders(tokens: np.ndarray, source: np.ndarray, previous: jax.Array) -> jax.Array:
    """tokens [B, S] with each PLACEHOLDER replaced by the previous step's sample of row
    `source[b]` (previous: [pad_rows] int32): one compile per bucket."""
    return jnp.where(tokens == PLACEHOLDER, previous[jnp.maximum(source, 0)][:, None], tokens)


@dataclasses.dataclass
class _InFlight:
    """A launched step: its rows, the runner's output and the sampled tokens, still on the device."""

    scheduled: SchedulerOutput
    out: StepOutput
    sampled: SampledTokens
    position: dict[str, int]  # request id -> its row
    prompt_scores: tuple | None = None  # a prefill step's `ModelRunner.prompt_scores`, when some row asked
    seqs: Any = None  # the step's host row arrays (`ModelRunner.build`), for the MTP drafter
    snapshots: list = dataclasses.field(default_factory=list)  # prefix-cache snapshots the step's rows take


@dataclasses.dataclass
class _Tracked:
    """The engine's side of one request: parameters, text and logprobs so far."""

    request: Request
    params: SamplingParams
    index: int  # the engine's number for it: the random stream of an unseeded request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    mask: TokenMask | None = None  # its token constraint (grammar, allowed ids, bad words)
    error: str | None = None  # why it failed alone (finish_reason "error")
    # The prompt's ids for its outputs: one copy, shared by all of them (not one per step).
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    penalty_history: PenaltyHistory | None = None  # what its penalties read, kept up to date

    def output(self) -> RequestOutput:
        r, status = self.request, self.request.status
        ids = r.output_token_ids
        if not status.finished:
            token_ids = TokenIdsSoFar(ids, len(ids))
        elif ids and ids[-1] == PLACEHOLDER:  # aborted while the device computed its next token
            token_ids = ids[:-1]
        else:
            token_ids = list(ids)
        completion = CompletionOutput(
            index=0, text=self.detokenizer.shown, token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs, finish_reason=status.finish_reason,
            stop_reason=self.stop_reason if status is RequestStatus.FINISHED_STOPPED else None,
        )
        metrics = RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time, r.last_token_time)
        return RequestOutput(r.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs,
                             [completion], status.finished, metrics, self.error, r.num_cached_tokens)


def _cache_identity(model, layout: PagedCacheLayout) -> str:
    """What the KV of a token prefix depends on besides the tokens: the model's config, its
    weights' dtype and the cache's formats (the root of the prefix cache's hash chain)."""
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(model.state)})
    return repr((model.config, dtypes, layout.kv_cache_dtype, layout.indexer_dtype, layout.block_size))


def _never_ran(request: Request) -> bool:
    """Waiting and never scheduled: no step has held it (a preempted request has run)."""
    return (request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
            and not request.output_token_ids and request.num_preemptions == 0)


def _prompt_scores(logits: np.ndarray, targets: np.ndarray, k: int) -> tuple[list, list, list, list]:
    """Logprob and rank of each position's next prompt token, and its k most likely tokens (most
    likely first, ties by smaller id) with their logprobs. `logits` [positions, vocab] float32,
    `targets` [positions]. Ranks and the top k read the logits themselves (log-softmax keeps their
    order); only the chosen entries are normalised (a float64 log-sum-exp per position). On the
    host, for the one position of a one-token chunk in a decode step only: prefill steps score on
    the device (`sampler.prompt_scores`, the same entries), since this runs under the async
    engine's lock and took 0.5 s for 256 positions of the real vocabulary on a 2-core CPU."""
    peak = logits.max(-1, keepdims=True)
    log_total = peak[:, 0].astype(np.float64) + np.log(np.exp(logits - peak).sum(-1, dtype=np.float64))
    target = np.take_along_axis(logits, targets[:, None], axis=-1)  # [positions, 1]
    ranks = (logits > target).sum(-1) + 1
    # lax.top_k's total order (a NaN without its sign bit above +inf, one with it below -inf, -0
    # below +0): the float's bits as a signed integer, negative ones' magnitude bits flipped.
    bits = np.ascontiguousarray(logits, np.float32).view(np.int32).astype(np.int64)
    key = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    if k:
        # The entries above the k-th largest value, then the smallest ids among those equal to it.
        kth = -np.partition(-key, k - 1, axis=-1)[:, k - 1 : k]
        tied = key == kth
        chosen = (key > kth) | (tied & (np.cumsum(tied, axis=-1) <= k - (key > kth).sum(-1, keepdims=True)))
        top = np.nonzero(chosen)[1].reshape(len(targets), k)
    else:
        top = np.zeros((len(targets), 0), np.int64)
    order = np.lexsort((top, -np.take_along_axis(key, top, axis=-1)), axis=-1)
    top = np.take_along_axis(top, order, axis=-1)
    top_logprobs = np.take_along_axis(logits, top, axis=-1).astype(np.float64) - log_total[:, None]
    return ((target[:, 0] - log_total).tolist(), ranks.tolist(), top.tolist(), top_logprobs.tolist())


class LLMEngine:
    def __init__(
        self,
        model,  # dsv4_jax.weights.loading.CausalLM
        tokenizer: Any,
        layout: PagedCacheLayout,
        *,
        max_num_seqs: int,
        max_model_len: int,
        buckets: StepBuckets,
        attention_backend: str,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        sampler_config: SamplerConfig = SamplerConfig(),
        async_scheduling: bool = True,
        block_manager_factory: Callable[..., BlockManager] | None = None,
        structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig(),
        num_prefix_snapshots: int = 0,
        prefix_caching_hash_algo: str = "sha256",
        speculative_config: SpeculativeConfig | None = None,
    ):
        """`block_manager_factory`: each data-parallel rank's allocators (`Scheduler`'s default when
        None). `num_prefix_snapshots` > 0 turns prefix caching on, with that many snapshots per
        rank (docs/prefix_caching.md). `speculative_config`: speculative decoding with the model's
        MTP block (engine/speculative.py; the layout needs its window pool and a spare compressor
        window); scheduling is then synchronous."""
        self.config = model.config
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs (`_logprob`)
        self.max_model_len = max_model_len
        self.seed = seed
        k = speculative_config.num_speculative_tokens if speculative_config is not None else 0
        if k:
            speculative_config.check_model(self.config)
            short = [b for b in buckets.prefill if b[1] < k + 1]
            if short:
                raise ValueError(f"prefill buckets {short} are shorter than a verify row of {k + 1} tokens "
                                 f"(num_speculative_tokens {k} + 1): give every prefill bucket at least {k + 1} tokens")
            if async_scheduling:
                logger.info("speculative decoding runs without async scheduling: each step's drafts need its tokens")
        self.speculative_config = speculative_config
        self.num_speculative_tokens = k
        # Host drafts instead of the MTP block's (None: the MTP block on the device): tests and
        # benchmarks give one (dsv4_jax.testing), from the next step on.
        self.drafter: Drafter | None = None
        self.spec_decode_stats = SpecDecodeStats(k) if k else None
        self.runner = ModelRunner(model, layout, attention_backend=attention_backend, buckets=buckets,
                                  num_prefix_snapshots=num_prefix_snapshots, num_speculative_tokens=k,
                                  mtp_drafts=bool(k))
        buckets = self.runner.buckets  # as the runner runs them (CPUs widen one-row decodes; verify rows)
        dp = self.runner.dp  # data-parallel ranks: a step holds dp x the bucket's rows
        # Sampled tokens padded to the widest step: one placeholder-filling compile per bucket.
        self.sampler_config = dataclasses.replace(sampler_config,
                                                  pad_rows=dp * max(b for b, _ in buckets.all) * (k + 1))
        self.async_scheduling = async_scheduling and not k  # may be switched between steps (never on with k)
        eos = self.config.eos_token_id
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        self.scheduler = Scheduler(SchedulerConfig.for_runner(
            buckets, layout, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, dp_size=dp, num_prefix_snapshots=num_prefix_snapshots,
            prefix_caching_hash_algo=prefix_caching_hash_algo, cache_identity=_cache_identity(model, layout),
            num_speculative_tokens=k,
        ), block_manager_factory or BlockManager)
        mesh = self.runner.mesh
        self.sampler = Sampler(self.sampler_config, mesh)
        # Every device call of a step, by name: made in lockstep by the followers of a multi-host
        # run (engine/lockstep.py), a plain call otherwise.
        self.device = Lockstep({
            "fill": _fill_placeholders,
            "run": self.runner.run,
            "sample": self.sampler,
            "prompt_scores": self.runner.prompt_scores,
            "probe": self.runner.probe,
            "gather": self.runner.gather,
            "take_snapshots": self.runner.take_snapshots,
            "restore_snapshots": self.runner.restore_snapshots,
            "draft": self.runner.draft,
        }, passed_on=frozenset({"fill", "run", "sample", "draft"}))
        self._tracked: dict[str, _Tracked] = {}
        self._init_constraints(structured_outputs_config)
        self._numbers = itertools.count()
        self._steps = 0
        self._in_flight: _InFlight | None = None  # launched, not completed (async scheduling)

    def _init_constraints(self, config: StructuredOutputsConfig) -> None:
        self.structured_outputs_config = config
        self._grammars: GrammarCompiler | None = None  # made by the first constrained request
        self._grammar_executor = None  # llguidance's threads that fill several rows' masks at once
        # Requests whose grammar compiles on the worker: (request, its future, deadline); they enter
        # the scheduler once it is ready, and run meanwhile nowhere.
        self._compiling: dict[str, tuple[Request, concurrent.futures.Future, float]] = {}
        self._ended_early: list[RequestOutput] = []  # finished while compiling: the next step reports them
        self.on_grammar_ready: Callable[[], None] | None = None  # called on the worker when one is ready
        # Runs a wait for the device (`_step_masks`): the async engine lets its lock go meanwhile.
        self.wait_unlocked: Callable[[Callable[[], Any]], Any] = lambda wait: wait()
        self._think_ids = tuple(self.tokenizer.token_to_id(t) for t in (THINK_START, THINK_END))

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV cache on the mesh (every rank's pools)."""
        from dsv4_jax.kv_cache.paged import cache_nbytes

        return cache_nbytes(self.runner.cache)

    def release_cache(self) -> None:
        """Free the KV pools now: an engine about to be replaced, whose successor's pools are
        planned to fill the same memory."""
        for leaf in jax.tree.leaves((self.runner.cache, self.runner.snapshots)):
            leaf.delete()

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None,
    ) -> None:
        """Queue a request; a ValueError (with the numbers) if it can never run. A request with a
        grammar waits for its compile (on a worker) before the scheduler sees it."""
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._truncated(integer_token_ids(prompt_token_ids), params)
        vocab = self.config.vocab_size
        bad = sorted({t for t in ids if not 0 <= t < vocab})
        if bad:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab}) (the model's vocabulary); got {bad[:8]}",
                                  "prompt")
        params.check_token_ids(vocab)
        if params.min_tokens:  # the step would fail (for every request) on a ban it cannot hold
            banned = banned_below_min_tokens(params, self.eos_token_ids)
            if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= set(banned):
                raise RequestRejected(
                    f"with min_tokens ({params.min_tokens}), every one of allowed_token_ids is banned (EOS and "
                    "stop_token_ids are until min_tokens): no token could be sampled", "allowed_token_ids")
            if len(banned) > self.sampler_config.max_banned_ids:
                raise RequestRejected(
                    f"with min_tokens, at most {self.sampler_config.max_banned_ids} stop_token_ids and EOS ids "
                    f"can be banned; this request names {len(banned)}", "stop_token_ids")
        room = self.max_model_len - len(ids)
        if room < 1:  # the prompt alone is too long, whatever max_tokens says
            raise RequestRejected(
                f"the prompt ({len(ids)} tokens) leaves no room for a generated token within max_model_len "
                f"({self.max_model_len}); shorten the prompt", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise RequestRejected(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})", "max_tokens")
        if params.min_tokens > max_tokens:  # max_tokens None: what is left of max_model_len (vLLM)
            raise RequestRejected(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this request can generate "
                f"(max_model_len {self.max_model_len} minus the prompt's {len(ids)})", "min_tokens")
        request = Request(request_id, ids, max_tokens, sampling_params=params,
                          skip_prefix_cache=params.prompt_logprobs is not None)
        self.scheduler.check(request)  # may refuse: blocks the pool can never give
        mask, grammar = self._token_mask(params, ids)
        if grammar is None:
            self.scheduler.add(request)
        else:
            future = self._grammar_compiler().submit(grammar)
            deadline = time.monotonic() + self.structured_outputs_config.compile_timeout_s
            self._compiling[request_id] = (request, future, deadline)
            future.add_done_callback(lambda _: self.on_grammar_ready and self.on_grammar_ready())
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output, stop_after_tokens=params.min_tokens,
        )
        self._tracked[request_id] = _Tracked(
            request, params, next(self._numbers), prompt, detokenizer,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            mask=mask, prompt_token_ids=list(ids), penalty_history=PenaltyHistory(ids) if params.has_penalties else None,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at any moment and free what it holds; its output so far (or None)."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        if self._compiling.pop(request_id, None) is None:
            self.scheduler.abort(request_id)
        else:
            tracked.request.status = RequestStatus.FINISHED_ABORTED
        tracked.detokenizer.finish()
        return tracked.output()

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def has_runnable(self) -> bool:
        """Whether `begin_step` has anything to do: a scheduled request, a grammar compiled (or
        failed, or late), or an early end to report. Requests still compiling are waited for
        elsewhere (`on_grammar_ready`, or `step`)."""
        return (self.scheduler.has_unfinished() or bool(self._ended_early)
                or any(f.done() or time.monotonic() > d for _, f, d in self._compiling.values()))

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar (queued, not yet schedulable)."""
        return len(self._compiling)

    # ---- token constraints --------------------------------------------------------------------------
    def _truncated(self, ids: list[int], params: SamplingParams) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the last k prompt tokens (-1: the last max_model_len)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return ids
        if k > self.max_model_len:
            raise RequestRejected(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                                  f"({self.max_model_len}). Please, select a smaller truncation size.",
                                  "truncate_prompt_tokens")
        return ids[-(self.max_model_len if k == -1 else k):]

    def _token_mask(self, params: SamplingParams, prompt_ids: list[int]) -> tuple[TokenMask | None, str | None]:
        """The request's token constraint (None: none) and the grammar it must compile (None: none).
        RequestRejected, naming the field, for a grammar, allowed ids or bad words it cannot hold."""
        if not params.has_token_mask:
            return None, None
        vocab = self.config.vocab_size
        bad = []
        if params.bad_words:
            try:
                bad = bad_words_token_ids(
                    params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids, vocab)
            except ValueError as error:
                raise RequestRejected(str(error), "bad_words") from None
        allowed = None if params.allowed_token_ids is None else packed_ids(params.allowed_token_ids, vocab)
        grammar, arm_token = None, None
        if params.structured_outputs is not None:
            self._check_grammar_vocabulary()
            grammar = check_structured_outputs(params.structured_outputs, self.structured_outputs_config)
            arm_token = self._arm_token(prompt_ids)
        # The matcher comes with the compile (`_admit_compiled`).
        return TokenMask(arm_token=arm_token, allowed=allowed, bad_words=bad), grammar

    def _check_grammar_vocabulary(self) -> None:
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if size > self.config.vocab_size:
            raise RequestRejected(f"structured outputs need a model whose vocabulary ({self.config.vocab_size}) "
                                  f"holds the tokenizer's {size} tokens", "structured_outputs")

    def _arm_token(self, prompt_ids: list[int]) -> int | None:
        """`</think>`'s id when the grammar must wait for the model to end its reasoning: a
        reasoning parser is set, constraints stay out of the reasoning (vLLM's default), and the
        prompt's last think marker opens one. None: the grammar starts at the first token."""
        config = self.structured_outputs_config
        if not config.reasoning_parser or config.enable_in_reasoning:
            return None
        start, end = self._think_ids
        for token in reversed(prompt_ids):
            if token == start:
                return end
            if token == end:
                return None
        return None

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        return self._grammars

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready enter the scheduler; a compile that failed or is late
        ends its request alone (finish_reason "error")."""
        now = time.monotonic()
        for request_id, (request, future, deadline) in list(self._compiling.items()):
            if not future.done() and now <= deadline:
                continue
            del self._compiling[request_id]
            tracked = self._tracked[request_id]
            try:
                if not future.done():
                    raise TimeoutError(f"the grammar did not compile within "
                                       f"{self.structured_outputs_config.compile_timeout_s:g} s")
                tracked.mask.attach(future.result())
                self.scheduler.add(request)
            except Exception as error:  # noqa: BLE001 - this request alone fails
                future.cancel()
                tracked.error = f"structured outputs: {error}"
                request.status = RequestStatus.FINISHED_ERROR
                tracked.detokenizer.finish()
                self._ended_early.append(tracked.output())
                del self._tracked[request_id]

    def take_ended_early(self) -> list[RequestOutput]:
        """Outputs of requests that ended before any step held them (their grammar failed)."""
        ended, self._ended_early = self._ended_early, []
        return ended

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's `reset_prefix_cache`): False, changing nothing, while any
        request is queued, compiling or running."""
        return not self._tracked and self.scheduler.reset_prefix_cache()

    def unfinished_ids(self) -> frozenset[str]:
        return frozenset(self._tracked)

    def reset(self, keep_waiting: bool = False) -> list[str]:
        """After a step failed part-way (an exception, Ctrl-C in a notebook): abort every request
        and forget the launched step and the scheduler's steps not applied, so that the engine
        serves new requests again (without this, the next step would find a step it never
        updated). With `keep_waiting`, requests that never ran (waiting, nothing computed, no
        output: no failed step held them) are queued again as they came instead. Returns the ids
        aborted. Steps still running on the device finish first (the cache is passed from step to
        step), so a new request never reads what they write late."""
        kept = {rid: t for rid, t in self._tracked.items() if keep_waiting and _never_ran(t.request)}
        aborted = [rid for rid in self._tracked if rid not in kept]
        for request_id in list(self._tracked):
            try:
                self.abort(request_id)
            except Exception:  # noqa: BLE001 - its own state broke (perhaps what failed the step)
                logger.exception("aborting %s after a failed step", request_id)
                self._tracked.pop(request_id, None)
                self.scheduler.abort(request_id)
        self._in_flight = None
        self._ended_early.clear()  # their requests are gone with the rest (the caller says so)
        self.scheduler.drop_pending()
        self.scheduler.reset_prefix_cache()  # what the failed steps left in the pools is not trusted
        self.runner.ensure_cache()
        for t in kept.values():
            self.add_request(t.request.request_id, t.prompt_token_ids, t.params, prompt=t.prompt)
        return aborted

    def probe(self) -> None:
        """One step of padding rows, waited for: raises when the engine can no longer run a step
        (a lost device, a broken cache), as opposed to a step that failed over its requests."""
        self.device.call("probe")

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that got a token or finished.

        With async scheduling the next step is scheduled and launched before this one's tokens
        reach the host (its rows read them on the device), so host work hides behind device work;
        it completes in the next call. A penalised row reads its pending token on the device, as
        the step's tokens do; a constrained row's mask is filled on the host once the previous
        token is fetched, while the device already runs the step's forward (`_launch`). With
        nothing else to run, it waits for a grammar being compiled."""
        if not self.has_runnable() and self._compiling:
            futures = [f for _, f, _ in self._compiling.values()]
            wait = min(d for _, _, d in self._compiling.values()) - time.monotonic()
            concurrent.futures.wait(futures, timeout=max(wait, 0), return_when=concurrent.futures.FIRST_COMPLETED)
        launched = self.begin_step()
        ended = self.take_ended_early()
        return ended if launched is None else ended + self.finish_step(launched)

    def begin_step(self) -> _InFlight | None:
        """`step`'s first half: launch what runs next and return the step whose tokens
        `finish_step` applies (None: nothing to run). Between the two only the device works on
        that step (`device_outputs` says what to wait for): requests may be added and aborted
        meanwhile, as between steps."""
        if self._compiling:
            self._admit_compiled()
        if self._in_flight is None:
            scheduled = self.scheduler.schedule()
            if not scheduled.rows:
                return None
            self._in_flight = self._launch(scheduled, None)
        current, self._in_flight = self._in_flight, None
        if self.async_scheduling and not self.num_speculative_tokens:
            scheduled = self.scheduler.schedule()  # current's tokens are placeholders until its update
            if scheduled.rows:
                self._in_flight = self._launch(scheduled, current)
        return current

    def finish_step(self, launched: _InFlight) -> list[RequestOutput]:
        """`step`'s second half: fetch `launched`'s tokens, apply them, decide which requests stop."""
        return self._complete(launched)

    @staticmethod
    def device_outputs(launched: _InFlight) -> tuple:
        """What `finish_step` reads from the device (ready once the launched step has run)."""
        return launched.sampled, launched.prompt_scores

    def _logits_per_row(self, bucket: tuple[int, int]) -> int:
        """Logits a step of `bucket` gives each row (`StepOutput.logits`): its last k + 1
        positions' with speculation, one in decode buckets and without it."""
        return min(self.num_speculative_tokens + 1, bucket[1])

    def _logit_row(self, at: int, bucket: tuple[int, int]) -> int:
        """The row of a step's logits (and samples) holding step row `at`'s last position."""
        n = self._logits_per_row(bucket)
        return at * n + n - 1

    def _launch(self, scheduled: SchedulerOutput, previous: _InFlight | None) -> _InFlight:
        """Dispatch a step and its sampling to the device; nothing waits for the results. A verify
        row (a token and its drafts) samples each of its positions, as the row would sample there
        after the drafts before it (engine/speculative.py)."""
        rows = scheduled.rows
        bucket, tokens, seqs = self.runner.build(rows)
        position = self.runner.row_positions(rows, bucket[0])
        token_ids, source = None, np.full(bucket[0], -1, np.int32)
        if previous is not None:  # rows holding a placeholder read the previous step's sample
            for at, r in zip(position, rows):
                if PLACEHOLDER in r.token_ids:
                    source[at] = previous.position[r.request.request_id]
            if (source >= 0).any():
                token_ids = self.device.call("fill", tokens, source, previous.sampled.token_ids)
        restores = [(r.dp_rank, r.slot, r.restore, r.start) for r in rows if r.restore >= 0]
        if restores:  # prefix-cache hits: their slots get the state at their first position
            self.device.call("restore_snapshots", restores)
        out = self.device.call("run", bucket, tokens, seqs, len(rows), token_ids)
        snapshots = [(r.dp_rank, r.slot, r.snapshot, r.end) for r in rows if r.snapshot >= 0]
        if snapshots and not self._drafts_on_device:
            # Rows ending at a block boundary: their state there, before a later step moves on (the
            # MTP drafter writes its window after the step: `_complete` takes them then).
            self.device.call("take_snapshots", snapshots)
        logit_rows = [self._logit_row(at, out.bucket) for at in position]
        masks = self._step_masks(rows, logit_rows, out.logits.shape[0], previous)  # may wait for the previous step
        sampling = [SamplingRow(_FILLER, 0)] * (max(logit_rows) + 1)  # rows after the last: padding
        for at, last, r in zip(position, logit_rows, rows):
            tracked = self._tracked.get(r.request.request_id)
            if r.is_sampling and tracked is not None and tracked.request is r.request:  # not aborted meanwhile
                outputs, history, params = r.request.output_token_ids, tracked.penalty_history, tracked.params
                if tracked.mask is not None and tracked.mask.error is not None and params.min_tokens:
                    params = dataclasses.replace(params, min_tokens=0)  # its row allows EOS only: no ban on it
                # A pending last output (a placeholder) is the previous step's sample of row source[at].
                # A verify row samples each position i after its first i drafts (engine/speculative.py).
                history = None if history is None else history.catch_up(outputs)  # no drafts with penalties
                drafts = r.drafts
                for i in range(r.num_drafts + 1):
                    sampling[last - r.num_drafts + i] = SamplingRow(
                        params, tracked.index, r.request.prompt_token_ids, [*outputs, *drafts[:i]] if i else outputs,
                        history, int(source[at]), draft_position=i)
        batch = build_sampling_batch(
            sampling, out.logits.shape[0], vocab_size=self.config.vocab_size, eos_token_ids=self.eos_token_ids,
            engine_seed=self.seed, step=self._steps, config=self.sampler_config, token_masks=masks,
        )
        self._steps += 1
        sampled = self.device.call("sample", out.logits, batch, None if previous is None else previous.sampled.token_ids)
        return _InFlight(scheduled, out, sampled, {r.request.request_id: at for at, r in zip(position, rows)},
                         self._launch_prompt_scores(rows, position, out), seqs, snapshots)

    def _step_masks(self, rows, position, bucket: int, previous: _InFlight | None) -> np.ndarray | None:
        """The mask rows of a step whose sampling rows include constrained ones (None: none). A
        mask that depends on a row's newest token, still the previous step's pending sample, waits
        for that token: the step's forward is already queued, so the device keeps working while
        the host fetches it and fills the masks (vLLM's order)."""
        constrained = [(at, r) for at, r in zip(position, rows)
                       if r.is_sampling and self._tracked[r.request.request_id].mask is not None]
        if not constrained:
            return None
        fetched = None
        if any(self._tracked[r.request.request_id].mask.needs_last_token and r.request.output_token_ids
               and r.request.output_token_ids[-1] == PLACEHOLDER for _, r in constrained):
            # The async engine's lock is let go meanwhile (`wait_unlocked`): requests may be added
            # or aborted while the device finishes the previous step, as between steps.
            fetched = self.wait_unlocked(lambda: np.asarray(jax.device_get(previous.sampled.token_ids)))
        masked = []
        for at, r in constrained:
            tracked = self._tracked.get(r.request.request_id)
            if tracked is None or tracked.request is not r.request:
                continue  # aborted while the lock was let go: its row's sample is never used
            mask, outputs = tracked.mask, r.request.output_token_ids
            if outputs and outputs[-1] == PLACEHOLDER:
                if not mask.needs_last_token:
                    masked.append((at, mask, outputs[:-1]))
                    continue
                outputs = [*outputs[:-1], int(fetched[previous.position[r.request.request_id]])]
            mask.advance(outputs, r.request.num_preemptions)
            masked.append((at, mask, outputs))
        if self._grammar_executor is None and sum(m.matcher is not None for _, m, _ in masked) > 1:
            import llguidance

            self._grammar_executor = llguidance.LLExecutor()
        return fill_masks(masked, bucket, self.config.vocab_size, self._grammar_executor, self.eos_token_ids)

    def _launch_prompt_scores(self, rows, position, out: StepOutput) -> tuple | None:
        """Score a prefill step's positions for prompt logprobs on the device, launched with the
        step so that `finish_step` (under the async engine's lock) only reads the results. Each
        position's target is the prompt token after it; which entries are new is decided when the
        step completes (a chunk recomputed after a preemption adds none)."""
        if out.bucket[1] == 1:
            return None  # a one-token chunk in a decode step: `_prompt_logprobs` reads the step's logits
        targets, wanted = np.zeros(out.bucket, np.int32), False
        for at, r in zip(position, rows):
            prompt = r.request.prompt_token_ids
            if self._tracked[r.request.request_id].prompt_logprobs is not None and r.start < len(prompt) - 1:
                chunk = prompt[r.start + 1 : r.start + 1 + len(r.token_ids)]
                targets[at, : len(chunk)] = chunk
                wanted = True
        return self.device.call("prompt_scores", out.streams, targets) if wanted else None

    def _complete(self, step: _InFlight) -> list[RequestOutput]:
        """Fetch a launched step's tokens, apply them and decide which requests stop."""
        scheduled, sampled = step.scheduled, step.sampled
        # Not aborted since (the same Request: its id may name a new request by now).
        rows = [r for r in scheduled.rows if (t := self._tracked.get(r.request.request_id)) and t.request is r.request]
        self._prompt_logprobs(rows, step)
        want_logprobs = any(r.is_sampling and self._tracked[r.request.request_id].logprobs is not None for r in rows)
        # One device-to-host transfer for the tokens and, when asked for, their logprobs.
        fetched = jax.device_get((sampled.token_ids, sampled.logprobs, sampled.top_token_ids, sampled.top_logprobs,
                                  sampled.ranks) if want_logprobs else (sampled.token_ids,))
        tokens, logprob_arrays = fetched[0], (fetched[1:] if want_logprobs else None)
        # Each sampling row's tokens: one, or for a verify row its accepted drafts and the token after.
        emitted = {}
        for r in scheduled.rows:
            if r.is_sampling:
                last = self._logit_row(step.position[r.request.request_id], step.out.bucket)
                sampled = tokens[last - r.num_drafts : last + 1]
                emitted[r.request.request_id] = (r, accepted_tokens(sampled, r.drafts))
        drafts = None
        if self._drafts_on_device:
            drafts = self._mtp_drafts(step, emitted)
            if step.snapshots:  # now with the MTP layer's window of the step's positions
                self.device.call("take_snapshots", step.snapshots)
        got = self.scheduler.update(scheduled, {rid: toks[0] for rid, (_, toks) in emitted.items()})
        outputs = []
        for request in got:
            tracked = self._tracked[request.request_id]
            row, toks = emitted[request.request_id]
            first = self._logit_row(step.position[request.request_id], step.out.bucket) - row.num_drafts
            self._apply_token(tracked, logprob_arrays, first)
            for i, token in enumerate(toks[1:], start=1):  # accepted drafts: the tokens after them
                if request.status.finished:  # stopped: nothing after its stop is emitted
                    break
                self.scheduler.extend(row, token)
                self._apply_token(tracked, logprob_arrays, first + i)
            if self.spec_decode_stats is not None:
                self.spec_decode_stats.record(row.num_drafts, len(toks) - 1)
                self.scheduler.release_rejected_blocks(request)
                self._propose(tracked, drafts, step.position[request.request_id])
            outputs.append(tracked.output())
            if request.status.finished:
                del self._tracked[request.request_id]
        return outputs

    @property
    def _drafts_on_device(self) -> bool:
        """The MTP block drafts (after each step), not a host drafter."""
        return bool(self.num_speculative_tokens) and self.drafter is None

    def _apply_token(self, tracked: _Tracked, logprob_arrays, row: int) -> None:
        """The request's newest output token, sampled at `row` of the step's samples: its logprobs,
        then the stop checks."""
        if logprob_arrays is not None and tracked.logprobs is not None:
            self._record_logprobs(tracked, logprob_arrays, row)
        self._after_token(tracked)

    def _mtp_drafts(self, step: _InFlight, emitted: dict) -> np.ndarray:
        """Run the MTP block over the step's rows and fetch its drafts [B, k]: next_ids holds each
        position's next token (the chunk's, the accepted drafts', then the token sampled after the
        last accepted; a prompt chunk that ends early, the prompt's next), and a verify row drafts
        from its last accepted position."""
        bucket = step.out.bucket
        next_ids, draft_at = np.zeros(bucket, np.int32), np.zeros(bucket[0], np.int32)
        for r in step.scheduled.rows:
            at = step.position[r.request.request_id]
            known = r.num_known
            if r.request.request_id in emitted:
                toks = emitted[r.request.request_id][1]
                ahead = [*r.token_ids[1 : known + len(toks) - 1], toks[-1]]
            else:  # a chunk that does not reach the known tokens' end (a prompt's, or a recompute's)
                ahead = [*r.token_ids[1:known], *r.request.token_ids(r.end, r.end + 1)]
            next_ids[at, : len(ahead)] = ahead
            draft_at[at] = len(ahead) - 1
        drafts = self.device.call("draft", step.out.streams, step.seqs, next_ids, draft_at)
        if jax.process_count() > 1:  # each process holds its devices' rows: made whole first
            drafts = self.device.call("gather", drafts)
        return np.asarray(jax.device_get(drafts))

    def _propose(self, tracked: _Tracked, drafts: np.ndarray | None, at: int) -> None:
        """The drafts a running request's next decode row carries: none for a request that
        speculates nothing (penalties, token masks: engine/speculative.py)."""
        request, params = tracked.request, tracked.params
        if request.status.finished or request.num_tokens - request.num_computed_tokens != 1 \
                or params.has_penalties or tracked.mask is not None:
            request.draft_token_ids = []
        elif drafts is not None:
            request.draft_token_ids = drafts[at].tolist()
        else:
            request.draft_token_ids = list(self.drafter.propose(request.all_token_ids, len(request.prompt_token_ids),
                                                                self.num_speculative_tokens))

    def _after_token(self, tracked: _Tracked) -> None:
        request, params = tracked.request, tracked.params
        token = request.output_token_ids[-1]
        # Finished already only by the scheduler, at max_tokens with this very token; otherwise
        # running, or preempted since its step was scheduled (async scheduling).
        at_max_tokens = request.status is RequestStatus.FINISHED_LENGTH
        counted = request.num_output_tokens >= params.min_tokens
        eos = counted and not params.ignore_eos and token in self.eos_token_ids
        stop_token = counted and not eos and params.is_stop_token(token)
        if not (eos or stop_token) or params.include_stop_str_in_output:
            # The token that stops the request is no text of it (vLLM's detokenizer skips it too).
            tracked.detokenizer.add(token)
        stopped, reason = eos or stop_token, token if stop_token else None
        mask = tracked.mask
        if mask is not None and mask.matcher is not None:
            mask.advance(request.output_token_ids, request.num_preemptions)
            if mask.error is not None:
                tracked.error = mask.error
                if not request.status.finished:
                    self._finish(tracked, RequestStatus.FINISHED_ERROR, None)
                request.status = RequestStatus.FINISHED_ERROR  # also over a length the scheduler set
                tracked.detokenizer.finish()
                return
            # The grammar's end ends the answer (whatever min_tokens, ignore_eos or EOS say).
            stopped = stopped or mask.finished
        if counted and tracked.detokenizer.stopped_by is not None:
            # A stop string names the reason even when the token was a stop id too (its text kept by
            # include_stop_str_in_output completed it): vLLM's output processor does the same.
            stopped, reason = True, tracked.detokenizer.stopped_by
        if stopped and at_max_tokens:
            # vLLM (since 0.11.1) checks EOS, stop tokens and stop strings before the length: the
            # max_tokens-th token that stops the request reports "stop" (it is out of the scheduler).
            request.status = RequestStatus.FINISHED_STOPPED
            tracked.stop_reason = reason
        elif stopped:
            self._finish(tracked, RequestStatus.FINISHED_STOPPED, reason)
        if not request.status.finished and request.num_tokens >= self.max_model_len:
            self._finish(tracked, RequestStatus.FINISHED_LENGTH, None)
        if request.status.finished:
            tracked.detokenizer.finish()

    def _finish(self, tracked: _Tracked, status: RequestStatus, reason: int | str | None) -> None:
        tracked.stop_reason = reason
        self.scheduler.finish(tracked.request.request_id, status)

    def _record_logprobs(self, tracked: _Tracked, arrays, i: int) -> None:
        """The sampled token's raw logprob and rank, and the top `logprobs` tokens."""
        sampled_lp, top_ids, top_lps, ranks = arrays
        token = tracked.request.output_token_ids[-1]
        logprob, rank = float(sampled_lp[i]), int(ranks[i])
        entry = {token: self._logprob(token, logprob, rank)}
        for top_rank, (t, lp) in enumerate(zip(top_ids[i][: tracked.params.logprobs], top_lps[i]), start=1):
            if int(t) not in entry:
                entry[int(t)] = self._logprob(int(t), float(lp), top_rank)
        tracked.logprobs.append(entry)
        tracked.cumulative_logprob += logprob

    def _prompt_logprobs(self, rows, step: _InFlight) -> None:
        """Logprob of each prompt token given the tokens before it (vLLM's `prompt_logprobs`); only
        when some row's chunk adds one. A prefill step's scores were launched with it
        (`_launch_prompt_scores`): only they come to the host."""
        wanted = []
        for r in rows:
            tracked, prompt = self._tracked[r.request.request_id], r.request.prompt_token_ids
            recorded = tracked.prompt_logprobs
            # The next entry to record is for prompt token len(recorded), predicted at position
            # len(recorded) - 1. A chunk that ends before it was recomputed after a preemption; one
            # that starts at the prompt's last token (or later) predicts no prompt token.
            if recorded is not None and r.start < len(recorded) < len(prompt) \
                    and r.start + len(r.token_ids) >= len(recorded):
                # Chunk positions first..end-1 predict the prompt tokens not recorded yet.
                first, end = len(recorded) - 1 - r.start, min(len(r.token_ids), len(prompt) - 1 - r.start)
                wanted.append((step.position[r.request.request_id], tracked, first,
                               prompt[r.start + first + 1 : r.start + end + 1]))
        if not wanted:
            return
        if step.prompt_scores is None:
            # A one-token chunk in a decode step: its logits are the step's own, and decode buckets
            # have no compiled scoring (one row of [B, vocab] on the host is cheap).
            logits = self._host_logits(step.out.logits)
            scored = [_prompt_scores(logits[self._logit_row(i, step.out.bucket), None], np.asarray(targets),
                                     tracked.params.prompt_logprobs) for i, tracked, _, targets in wanted]
        else:
            logprob, rank, top_ids, top_logprobs = jax.device_get(step.prompt_scores)
            scored = []
            for i, tracked, first, targets in wanted:
                at, k = slice(first, first + len(targets)), tracked.params.prompt_logprobs
                scored.append((logprob[i, at].tolist(), rank[i, at].tolist(), top_ids[i, at, :k].tolist(),
                               top_logprobs[i, at, :k].tolist()))
        for (_, tracked, _, targets), scores in zip(wanted, scored):
            for target, logprob, rank, top, top_logprobs in zip(targets, *scores):
                entry = {target: self._logprob(target, logprob, rank)}
                for top_rank, (t, lp) in enumerate(zip(top, top_logprobs), start=1):
                    if t not in entry:
                        entry[t] = self._logprob(t, lp, top_rank)
                tracked.prompt_logprobs.append(entry)

    def _logprob(self, token: int, logprob: float, rank: int) -> Logprob:
        """A Logprob with the token's own text (vLLM's `decoded_token`), each id decoded once."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = token_text(self.tokenizer, token)
        return Logprob(logprob, rank, text)

    def _host_logits(self, logits: jax.Array) -> np.ndarray:
        """A step's logits on the host. With several processes each holds only its devices' part:
        they are gathered first (in lockstep)."""
        if jax.process_count() > 1:
            logits = self.device.call("gather", logits)
        return np.asarray(logits)

    # ---- several hosts ----------------------------------------------------------------------------
    def lead(self, channel: StepChannel) -> None:
        """Leader of a multi-host run: followers make every device call from now on."""
        self.device.lead(channel)

    def follow(self, channel: StepChannel) -> int:
        """Follower of a multi-host run: make the leader's device calls until it stops."""
        return self.device.follow(channel)

    def stop_followers(self) -> None:
        self.device.stop()

    # ---- warm-up ----------------------------------------------------------------------------------
    def warmup(self, progress: Callable[[str, int, int], None] | None = None) -> int:
        """Compile every runner bucket, the sampler for each bucket's row count (its draw, and the
        small programs of batches with bans or penalties) and the placeholder filling of async
        scheduling. Returns the compiles it took; after it, serving compiles nothing.
        `progress(what, done, total)` counts the step programs built (compiled or read back), then
        says when the sampler's are ("sampler", 0 or 1, 1).

        The sampler's programs are built on a thread of their own while the steps are (one process;
        over several, after them), for logits as the steps place them (committed to the device, or
        split over the data axis of a mesh);
        then every kind of batch is sampled from the warm-up steps' own logits: an executable is
        compiled for its arguments' placement, so a logits placement not foreseen compiles here,
        never while serving."""
        progress = progress or (lambda what, done, total: None)
        counter = CompileCounter()
        done = itertools.count(1)
        total = self.runner.num_programs
        progress("steps", 0, total)
        # Over several processes every call that places arrays on the mesh must come in the same order on
        # every node, so the sampler's are made after the steps' there.
        alongside = jax.process_count() == 1
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsv4-sampler-warmup") as pool:
            cases = self._sampler_cases(self._step_logits())
            sampler = pool.submit(self.sampler.compile, cases) if alongside else None
            self.runner.warmup(on_compiled=lambda: progress("steps", next(done), total))
            progress("sampler", 0, 1)
            if sampler is None:
                self.sampler.compile(cases)
            else:
                sampler.result()
        previous = None
        for logits, batch in self._sampler_cases(self.runner.warmup_logits):
            previous = self.sampler(logits, batch).token_ids
            jax.block_until_ready(previous)
        self.sampler.programs.keep()  # each ran above
        if jax.process_count() > 1:  # host reads of logits and drafts gather them first (_host_logits, _mtp_drafts)
            for logits in (*self.runner.warmup_logits.values(), *self.runner.warmup_drafts.values()):
                jax.block_until_ready(self.runner.gather(logits))
        for b, s in self.runner.buckets.all:  # async scheduling's placeholder filling
            b *= self.runner.dp
            jax.block_until_ready(_fill_placeholders(np.zeros((b, s), np.int32), np.zeros(b, np.int32), previous))
        self.runner.warmup_logits.clear()
        self.runner.warmup_drafts.clear()
        self.runner.compiles.reset()  # from here on the runner counts what serving compiles: nothing
        progress("sampler", 1, 1)
        return counter.compiles

    def _step_logits(self) -> dict[int, jax.ShapeDtypeStruct]:
        """Step rows -> the logits [rows, vocab] float32 a step of that many rows returns, placed as
        it places them, before any step is built."""
        rows = {b * self.runner.dp * self._logits_per_row((b, s)) for b, s in self.runner.buckets.all}
        placed = self.runner.logits_sharding
        return {b: jax.ShapeDtypeStruct((b, self.config.vocab_size), jnp.float32, sharding=placed) for b in rows}

    def _sampler_cases(self, logits_by_rows: dict[int, Any]) -> list[tuple[Any, Any]]:
        """(logits, batch) of every kind of batch for each step's logits: nothing to edit; bans (or
        a bias) only; penalties, with a history of each width a request can reach (its distinct
        tokens and a pending one: at most the vocabulary plus one, or max_model_len)."""
        vocab = self.config.vocab_size
        penalised = SamplingParams(repetition_penalty=1.1, logprobs=1)
        widths = self.sampler_config.penalty_widths(min(vocab + 1, self.max_model_len))
        kinds = [(SamplingParams(temperature=1.0, logprobs=1), [0]), (SamplingParams(min_tokens=1, logprobs=1), [0])]
        kinds += [(penalised, self.sampler_config.prompt_of_width(w)) for w in widths]
        cases = [(logits, build_sampling_batch([SamplingRow(params, 0, prompt, [])], b, vocab_size=vocab,
                                               eos_token_ids=self.eos_token_ids, config=self.sampler_config))
                 for b, logits in sorted(logits_by_rows.items()) for params, prompt in kinds]
        # A constrained batch: its token masks, then the unconstrained batch's programs.
        cases += [(logits, build_sampling_batch(
            [SamplingRow(SamplingParams(temperature=1.0), 0)], b, vocab_size=vocab, config=self.sampler_config,
            token_masks=fill_masks([], b, vocab))) for b, logits in sorted(logits_by_rows.items())]
        return cases
