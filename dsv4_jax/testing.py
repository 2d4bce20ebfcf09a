"""Test helpers of the model: random checkpoints (`write_random_checkpoint`, from
`dsv4_jax.weights.random_checkpoint`, where the built-in model gets its weights too), and how close
the model's top-k choices come to a tie.

`topk_margins_by_kind(model, ids)` says, per position, how close the lightning indexer's top-k
(`indexer_topk_margins`) and the MoE router's (`router_topk_margins`) came to a tie (the load
benchmark's comparison rule excuses a difference there).

`prefill_logits(model, prompts)` runs whole prompts through the serving path (`ModelRunner`: the
paged KV cache and an attention backend), one prefill chunk each, for tests that hold it against
the same references as the whole-sequence forward `model(ids)`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4_jax.config import CSA, SLIDING, DeepseekV4Config
from dsv4_jax.model.hyper_connection import hc_post
from dsv4_jax.model.options import ForwardOptions
from dsv4_jax.weights.random_checkpoint import (  # noqa: F401  (the public test-data API)
    QUANTIZE_FORMATS, random_state, random_tensor, write_random_checkpoint, write_tokenizer,
)

if TYPE_CHECKING:
    from dsv4_jax.kv_cache.paged import PagedCacheLayout
    from dsv4_jax.model.block import Block
    from dsv4_jax.model.transformer import BlockStack, LayerKind, Segment
    from dsv4_jax.weights.loading import CausalLM


# ---- how close the model's top-k choices are to a tie --------------------------------------------------
INDEXER, ROUTER = "indexer", "router"  # the forward's two top-k choices: compressed entries, experts


def topk_scores(model: CausalLM, token_ids: Sequence[int]) -> dict[str, list[np.ndarray]]:
    """The scores each top-k choice ranks in the dense forward over `token_ids` (one sequence),
    float32, in layer order: INDEXER, one [seq, entries] array per CSA layer (query t's score of
    compressed entry j, visible when j < (t + 1) // ratio); ROUTER, one [seq, experts] array per
    top-k-routed MoE layer (`Gate.selection_scores`: score + bias; hash-routed layers choose
    nothing). Compiles once per sequence length; `model(ids)` and the engine's step are untouched."""
    ids = np.asarray(token_ids, np.int32)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty sequence of ids, got shape {ids.shape}")
    if model not in _JITTED_SCORES:  # a GraphDef holding lists is not hashable: no static argument
        _JITTED_SCORES[model] = jax.jit(functools.partial(_dense_topk_scores, model.graphdef), static_argnums=2)
    scores = _JITTED_SCORES[model](model.state, jnp.asarray(ids[None]), model.options)
    return {kind: [np.asarray(s) for s in layers] for kind, layers in scores.items()}


def visible_entries(seq: int, entries: int, ratio: int) -> np.ndarray:  # [seq, entries] bool
    """Which compressed entries query t may pick: j < (t + 1) // ratio (whole blocks of its past)."""
    return np.arange(entries)[None, :] < (np.arange(seq)[:, None] + 1) // ratio


def topk_margins(
    scores: np.ndarray,  # [seq, n] one layer's scores of n candidates
    topk: int,
    visible: np.ndarray | None = None,  # [seq, n] bool: the candidates each row may pick; None: all
) -> np.ndarray:  # [seq] float64
    """(k-th best - (k+1)-th best visible score) / max |visible score| at each position: how far
    the top-k is from swapping a candidate. inf where fewer than k + 1 candidates are visible
    (nothing to swap); 0 where every visible score is 0."""
    seq, n = scores.shape
    if visible is None:
        visible = np.ones((seq, n), bool)
    margins = np.full(seq, np.inf)
    if n <= topk:
        return margins
    rows = visible.sum(-1) > topk  # positions where a candidate outside the top-k could swap in
    visible_scores = np.where(visible, scores.astype(np.float64), -np.inf)[rows]
    ranked = -np.sort(-visible_scores, axis=-1)  # descending, invisible (-inf) last
    gap = ranked[:, topk - 1] - ranked[:, topk]
    scale = np.abs(np.where(visible[rows], visible_scores, 0.0)).max(-1)
    margins[rows] = np.divide(gap, scale, out=np.zeros_like(gap), where=scale > 0)
    return margins


def topk_margins_by_kind(model: CausalLM, token_ids: Sequence[int]) -> dict[str, np.ndarray]:  # [seq] each
    """{INDEXER: the smallest `topk_margins` over the CSA layers' indexers, ROUTER: the same over
    the top-k-routed MoE layers' gates} at each position of `token_ids`, from one dense forward
    (all inf for a kind without layers). A margin at float32 rounding level (~1e-6) means that
    another compile of the same model (another step shape, batch or kernel) may pick a different
    k-th entry or expert there, and the logits may move far more than rounding: the load
    benchmark's rule takes the smaller of the two at each position."""
    config, seq = model.config, len(token_ids)
    scores = topk_scores(model, token_ids)
    ratio = config.csa_compress_ratio
    per_layer = {
        INDEXER: [topk_margins(s, config.index_topk, visible_entries(*s.shape, ratio)) for s in scores[INDEXER]],
        ROUTER: [topk_margins(s, config.num_experts_per_tok) for s in scores[ROUTER]],
    }
    return {kind: np.minimum.reduce([np.full(seq, np.inf), *layers]) for kind, layers in per_layer.items()}


def indexer_topk_margins(model: CausalLM, token_ids: Sequence[int]) -> np.ndarray:  # [seq] float64
    """`topk_margins_by_kind(model, token_ids)[INDEXER]`: the lightning indexer's."""
    return topk_margins_by_kind(model, token_ids)[INDEXER]


def router_topk_margins(model: CausalLM, token_ids: Sequence[int]) -> np.ndarray:  # [seq] float64
    """`topk_margins_by_kind(model, token_ids)[ROUTER]`: the MoE router's (score + bias)."""
    return topk_margins_by_kind(model, token_ids)[ROUTER]


_JITTED_SCORES: weakref.WeakKeyDictionary[CausalLM, Callable] = weakref.WeakKeyDictionary()


def _dense_topk_scores(
    graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array, options: ForwardOptions
) -> dict[str, list[jax.Array]]:  # INDEXER: [seq, entries] per CSA layer; ROUTER: [seq, experts] per routed
    """`DeepseekV4.hidden_streams` with the dense attention for one sequence, layer by layer
    (stacked layers sliced out of their stack), taking the scores of both top-k choices on the way."""
    model = nnx.merge(graphdef, state)
    streams = model.input_streams(token_ids, options)
    tables = model.rope_tables(token_ids.shape[1])
    scores: dict[str, list[jax.Array]] = {INDEXER: [], ROUTER: []}
    for plan, segment in zip(model.segments_plan, model.segments):
        for block, kind in _unstacked_blocks(plan, segment):
            cos, sin = tables[kind.layer_type != SLIDING]
            # Block.__call__'s attention half, and what the attention feeds its indexer.
            attn_x, post, comb = block._hc_pre(streams, "attn")
            attn_in = block.attn_norm(attn_x)
            if kind.layer_type == CSA:
                q_latent = block.attn.queries_and_kv(attn_in, cos, sin)[0]
                indexer_scores = block.attn.indexer.scores(attn_in, q_latent, cos, sin,
                                                           round_keys=options.kv_cache_rounding)
                scores[INDEXER].append(indexer_scores[0])
            streams = hc_post(block.attn(attn_in, cos, sin, options), streams, post, comb)
            if not kind.hash_routed:  # what Block._ffn feeds the MoE, and the MoE its gate
                ffn_in = block.ffn_norm(block._hc_pre(streams, "ffn")[0])
                scores[ROUTER].append(block.ffn.gate.selection_scores(ffn_in[0]))
            streams = block._ffn(streams, token_ids, options)
    return scores


def _unstacked_blocks(plan: Segment, segment: Block | BlockStack) -> list[tuple[Block, LayerKind]]:
    """[(Block, LayerKind)] of one segment of `DeepseekV4.segments`, in layer order."""
    if plan.count == 1:
        return [(segment, plan.kinds[0])]
    graphdef, state = nnx.split(segment.units)
    return [
        (block, kind)
        for repetition in range(plan.count)
        for block, kind in zip(nnx.merge(graphdef, jax.tree.map(lambda a, r=repetition: a[r], state)), plan.kinds)
    ]


# ---- the serving path over whole prompts -----------------------------------------------------------
def paged_layout(
    config: DeepseekV4Config, kv_cache_dtype: str, *, slots: int, max_model_len: int, block_size: int = 128,
    num_mtp_layers: int = 0, spare_compressor_windows: int = 0,
) -> PagedCacheLayout:
    """A paged cache layout of `kv_cache_dtype` (as `--kv-cache-dtype` names it, resolved as for a
    CPU, where every dtype is allowed: the pools' formats do not depend on the device) for `slots`
    sequences of up to `max_model_len` tokens, pools sized as `PagedCacheLayout.build`'s defaults;
    `num_mtp_layers` MTP layers get sliding-window pools too, and each slot keeps
    `spare_compressor_windows` more compressor windows (speculative decoding)."""
    from dsv4_jax.kv_cache.paged import PagedCacheLayout
    from dsv4_jax.kv_cache.resolver import resolve_kv_cache

    spec = resolve_kv_cache(kv_cache_dtype, device_kind="cpu", config=config)
    return PagedCacheLayout.build(config, spec, max_model_len=max_model_len, num_seq_slots=slots,
                                  block_size=block_size, num_mtp_layers=num_mtp_layers,
                                  spare_compressor_windows=spare_compressor_windows)


def prefill_logits(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    kv_cache_dtype: str = "float32",
    attention_backend: str = "xla",
    block_size: int = 128,
) -> list[np.ndarray]:  # one [len(prompt), vocab] float32 per prompt
    """The serving path's logits at every position of each prompt: a `ModelRunner` over a fresh
    paged cache (`paged_layout`), every prompt prefilled as ONE chunk from position 0, all of
    them rows of one step (bucket (len(prompts), longest prompt)), each row in its own slot and
    blocks; every position's logits from `ModelRunner.all_logits`. Compiles that step and the
    head once (the runner is new: nothing is reused from another call)."""
    from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepRow

    lengths = [len(p) for p in prompts]
    if not lengths or min(lengths) == 0:
        raise ValueError(f"prefill_logits needs at least one prompt and no empty one, got lengths {lengths}")
    longest = max(lengths)
    layout = paged_layout(model.config, kv_cache_dtype, slots=len(prompts), max_model_len=longest,
                          block_size=block_size)
    # A prefill bucket has at least 2 tokens a row; one bucket, so a step compiles exactly once.
    buckets = StepBuckets(prefill=((len(prompts), max(longest, 2)),), decode=(1,))
    runner = ModelRunner(model, layout, attention_backend=attention_backend, buckets=buckets)
    per_seq = layout.max_blocks_per_seq
    rows = [StepRow(i, 0, [int(t) for t in prompt], list(range(i * per_seq, (i + 1) * per_seq)))
            for i, prompt in enumerate(prompts)]
    every = np.asarray(runner.all_logits(runner.step(rows)))  # [rows, S, vocab]
    return [every[i, :n] for i, n in enumerate(lengths)]


class ReplayDrafter:
    """A host drafter for tests and benchmarks (`LLMEngine.drafter`): it proposes what a previous
    run generated after the same prompt (`runs`: prompt ids -> that run's output ids), so a
    greedy rerun accepts every draft; `right(outputs_so_far, k)` says how many of the k drafts
    stay right, the rest each replaced by another token (rejected by a greedy rerun); `limit`
    caps the drafts (fewer than the engine's k)."""

    def __init__(self, runs: dict[tuple[int, ...], Sequence[int]], vocab_size: int,
                 right: Callable[[int, int], int] | None = None, limit: int | None = None):
        self.runs, self.vocab_size, self.limit = runs, vocab_size, limit
        self.right = right or (lambda done, k: k)

    def propose(self, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        done = len(token_ids) - num_prompt_tokens
        run = self.runs.get(tuple(int(t) for t in token_ids[:num_prompt_tokens]), ())
        drafts = [int(t) for t in run[done : done + min(k, self.limit or k)]]
        keep = self.right(done, len(drafts))
        return drafts[:keep] + [(t + 1) % self.vocab_size for t in drafts[keep:]]
