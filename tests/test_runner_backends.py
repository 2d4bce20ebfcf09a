"""The model on the paged cache through every attention backend, and the indexer's picks through
the cache.

1. The Pallas backends end to end (interpret mode on CPU): a runner on `pallas_fp8_ds_mla`
   (fp8_ds_mla pools) or `pallas_bf16` (bf16 pools) follows a runner on the `xla` backend (the
   kernels' pure-JAX references) over the same pools: the same greedy tokens wherever the xla
   run's top-1/top-2 gap exceeds 1e-3, and logprobs within 4 x 2^-8 x max |logits| (the kernels
   round probabilities to bf16 for the P @ V dot; the references do not). Each step's jaxpr
   launches a named `pallas_call` for every kernel the backend promises, once per use: no
   silent fallback to a reference.
   A kernel that fails at start-up names the way around it (`--attention-backend xla`).
2. The lightning indexer through the cache: the entries a CSA layer's indexer picks chunk by
   chunk (compressor advanced from its kept rows, keys written to a paged float32 pool, the
   backend's `indexer_topk`) are the full-sequence indexer's picks wherever the k-th and
   (k+1)-th scores are not near-tied.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

import dsv4_jax
from dsv4_jax.config import CSA, HCA, SLIDING
from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepRow
from dsv4_jax.kv_cache.paged import PagedCacheLayout, indexer_planes
from dsv4_jax.kv_cache.resolver import resolve_kv_cache
from dsv4_jax.model.cache_step import entry_slots
from dsv4_jax.model.compressor import CompressorRows
from dsv4_jax.model.rope import layer_frequencies, rope_angles
from dsv4_jax.presets import get_config
from dsv4_jax.testing import write_random_checkpoint
from pallas_kernels.backend import PALLAS_BF16, PALLAS_FP8_DS_MLA, XLA, get_backend

# Three layers, one of each kind: sliding window 4, CSA ratio 4 (index_topk 2 of up to 6
# entries), HCA ratio 16. Fewer layers than tests/test_runner.py's config: interpret-mode
# kernels and four runners' compiles are the cost of this file.
CONFIG = get_config("dsv4-tiny-test").replace(
    num_hidden_layers=3, sliding_window=4, compress_ratios=(0, 4, 16, 0), index_topk=2
)
PROMPT, DECODE = 16, 8  # a 16-token prefill, then 8 decode steps: 24 positions in all
BUCKETS = StepBuckets(prefill=((1, PROMPT),), decode=(1,))
BLOCK = 128
KV_CACHE_DTYPE = {PALLAS_FP8_DS_MLA: "fp8_ds_mla", PALLAS_BF16: "bfloat16"}
TOP2_GAP = 1e-3  # greedy tokens are compared where the xla run's top-1 beats its top-2 by this
LOGPROB_TOLERANCE = 4 * 2.0**-8  # x max |logits|


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_checkpoint(
        tmp_path_factory.mktemp("runner_backends") / "m", CONFIG, seed=3, tokenizer=False, include_mtp=False
    )
    return dsv4_jax.load_model(path)


# ---- 1. the Pallas backends end to end --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    tokens: list[int]  # the prompt, then each step's greedy (or forced) next token
    logits: np.ndarray  # [DECODE + 1, vocab]: the prefill's last position, then each decode step


def _runner(model, kv_cache_dtype: str, backend: str) -> ModelRunner:
    spec = resolve_kv_cache(kv_cache_dtype, device_kind="cpu", config=CONFIG)
    layout = PagedCacheLayout.build(CONFIG, spec, max_model_len=PROMPT + DECODE, num_seq_slots=1, block_size=BLOCK)
    return ModelRunner(model, layout, attention_backend=backend, buckets=BUCKETS)


def _generate(runner: ModelRunner, prompt: list[int], forced: list[int] | None = None) -> Run:
    """A prefill of `prompt`, then DECODE decode steps feeding each step's argmax, or the tokens
    of `forced` (another run's `tokens`) when given."""
    tokens = list(prompt)
    out = runner.step([StepRow(0, 0, tokens, [0])])
    logits = [np.asarray(out.logits)[0]]
    for i in range(DECODE):
        tokens.append(int(np.argmax(logits[-1])) if forced is None else forced[PROMPT + i])
        out = runner.step([StepRow(0, len(tokens) - 1, [tokens[-1]], [0])])
        logits.append(np.asarray(out.logits)[0])
    # One compile per bucket, none per step (a warm persistent compilation cache gives fewer).
    assert runner.compiles.compiles <= len(BUCKETS.all)
    return Run(tokens, np.stack(logits))


@pytest.fixture(scope="module", params=[PALLAS_FP8_DS_MLA, PALLAS_BF16])
def runs(request, model):
    """(pallas runner, xla run, pallas run fed the xla run's tokens) over one KV dtype."""
    kv_cache_dtype = KV_CACHE_DTYPE[request.param]
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, CONFIG.vocab_size, PROMPT)]
    reference = _generate(_runner(model, kv_cache_dtype, XLA), prompt)
    pallas = _runner(model, kv_cache_dtype, request.param)
    return pallas, reference, _generate(pallas, prompt, forced=reference.tokens)


def test_the_schedule_reaches_an_hca_entry_and_csa_selection():
    assert CONFIG.layer_types == (SLIDING, CSA, HCA)
    positions = PROMPT + DECODE
    # One HCA entry (positions 0..15, complete at the prefill's last token), read from then on.
    assert positions // CONFIG.compress_ratio(2) == 1
    assert positions // CONFIG.csa_compress_ratio > CONFIG.index_topk  # the indexer leaves entries out


def test_pallas_runner_follows_the_xla_runner(runs):
    _, reference, got = runs
    checked = 0
    for i, (want, have) in enumerate(zip(reference.logits, got.logits)):
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] > TOP2_GAP:
            assert int(np.argmax(have)) == int(np.argmax(want)), f"step {i}"
            checked += 1
    assert checked >= DECODE // 2  # most steps are decided: the token check is not vacuous
    bound = LOGPROB_TOLERANCE * np.max(np.abs(reference.logits))
    difference = np.abs(_log_softmax(got.logits) - _log_softmax(reference.logits))
    assert float(np.max(difference)) <= bound


def _log_softmax(logits: np.ndarray) -> np.ndarray:  # [steps, vocab], in numpy: no XLA compile
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _pallas_call_names(jaxpr: jax_core.Jaxpr) -> list[str]:
    """Names of the `pallas_call`s in `jaxpr` and every jaxpr nested in it (jit, scan, cond)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(eqn.params["name"])
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    names += _pallas_call_names(sub.jaxpr)
                elif isinstance(sub, jax_core.Jaxpr):
                    names += _pallas_call_names(sub)
    return names


def _promised_kernels(backend: str, phase: str) -> collections.Counter:
    """The pallas_call names (kernel_format_mode, as the wrappers name them) of one step of
    CONFIG's layers: every layer writes its window row and attends; compressed layers write
    their entries; CSA layers also write indexer keys and pick entries."""
    fp8 = backend == PALLAS_FP8_DS_MLA
    kv = "fp8_ds_mla" if fp8 else "bf16"
    want = collections.Counter()
    for layer_type in CONFIG.layer_types:
        want[f"kv_write_{kv}"] += 1 + (layer_type != SLIDING)
        want[f"sparse_{phase}_{kv}_{'window' if layer_type == SLIDING else layer_type}"] += 1
        if layer_type == CSA:
            want[f"kv_write_{'indexer_fp8' if fp8 else 'bf16'}"] += 1
            want[f"indexer_topk_{'fp8' if fp8 else 'bf16'}"] += 1
    return want


@pytest.mark.parametrize("phase,tokens", [("prefill", PROMPT), ("decode", 1)])
def test_every_step_runs_the_backends_kernels(runs, phase, tokens):
    runner = runs[0]
    _, ids, seqs = runner.build([StepRow(0, 0, list(range(tokens)), [0])])
    jaxpr = runner._step.trace(runner.weights, runner.cache, ids, seqs).jaxpr.jaxpr  # traced, not compiled
    assert collections.Counter(_pallas_call_names(jaxpr)) == _promised_kernels(runner.backend.name, phase)



def test_a_kernel_that_fails_at_start_up_names_the_xla_backend(model, monkeypatch):
    """A Pallas kernel that cannot be built on the device (as Triton refuses a kernel that needs
    more shared memory than the GPU has) fails the start-up with an error naming the backend and
    `--attention-backend xla`, the original error chained; the xla backend's own errors pass as
    they are."""
    from dsv4_jax.engine import runner as runner_module

    refusal = "out of resource: shared memory, required: 262144, hardware limit: 232448"

    def refuse(*args, **kwargs):
        raise ValueError(refusal)

    def failing(name, **kwargs):  # get_backend's signature (the runner passes interpret=)
        backend = get_backend(name, **kwargs)
        return dataclasses.replace(backend, decode=refuse, prefill=refuse)

    monkeypatch.setattr(runner_module, "get_backend", failing)
    with pytest.raises(RuntimeError, match=r"pallas_bf16 attention backend.*--attention-backend xla") as caught:
        _runner(model, "bfloat16", PALLAS_BF16).warmup()
    assert isinstance(caught.value.__cause__, ValueError) and refusal in str(caught.value)
    with pytest.raises(ValueError, match="out of resource"):
        _runner(model, "bfloat16", XLA).warmup()

# ---- 2. the indexer's picks through the cache ------------------------------------------------
SEQ = 96
INDEX_TOPK = 4  # of up to 24 entries
# Chunk lengths: most chunks end inside a compression window (after 3, 21, 22, 23, 30, 39 and
# 46 tokens), two are decode-like single tokens, two span several windows.
CHUNKS = (3, 5, 13, 1, 1, 7, 9, 7, 2, 48)
POOL_BLOCK = 16  # tokens per pool block: 4 CSA entries
BLOCK_TABLE = (5, 2, 7, 0, 3, 6)  # the sequence's blocks, out of order, of a pool of 8
NEAR_TIE = 1e-4  # relative gap between the k-th and (k+1)-th scores below which picks may differ
SELECTION_SEED = 5  # input seed: no query of its 96 near-tied (smallest relative gap 4e-3)


def _indexer_scores(attn, x, q_latent, cos, sin) -> jax.Array:
    """[batch, seq, entries] scores of the full-sequence indexer, as `Indexer.__call__` forms them."""
    idx = attn.indexer
    keys = idx.compressor(x, cos, sin)
    logits = jnp.einsum("bshd,bnd->bshn", idx.queries(q_latent, cos, sin), keys)
    return jnp.einsum("bshn,bsh->bsn", jax.nn.relu(logits), idx.head_weights(x))


def _full_and_cached_picks(graphdef, state, x):
    """(full-sequence picks [1, SEQ, k], their scores [1, SEQ, entries], cached picks [1, SEQ, k])."""
    attn = nnx.merge(graphdef, state)
    idx, ratio, backend = attn.indexer, attn.ratio, get_backend(XLA)
    inv_freq = jnp.asarray(layer_frequencies(CONFIG, 1))
    cos, sin = rope_angles(jnp.arange(SEQ), inv_freq)
    q_latent = attn.queries_and_kv(x, cos, sin)[0]
    full = idx(x, q_latent, cos, sin)
    scores = _indexer_scores(attn, x, q_latent, cos, sin)

    units = POOL_BLOCK // ratio
    pool = indexer_planes("float32", (1, max(BLOCK_TABLE) + 1, units), idx.head_dim)
    table = jnp.asarray([BLOCK_TABLE], jnp.int32)
    kept = CompressorRows.empty(1, ratio, idx.head_dim, overlap=True)
    picks, start = [], 0
    for n in CHUNKS:
        chunk = x[:, start : start + n]
        positions = jnp.arange(start, start + n, dtype=jnp.int32)[None, :]
        lens = jnp.asarray([n], jnp.int32)
        c_cos, c_sin = rope_angles(positions, inv_freq)
        keys, windows, kept = idx.compressor.step(chunk, positions, lens, inv_freq, kept)
        pool = backend.write_indexer_keys(pool, keys.reshape(-1, idx.head_dim), entry_slots(table, windows, units))
        c_latent = attn.queries_and_kv(chunk, c_cos, c_sin)[0]
        picks.append(backend.indexer_topk(
            idx.queries(c_latent, c_cos, c_sin), idx.head_weights(chunk), pool, table, positions[:, 0], lens,
            topk=idx.topk, ratio=ratio,
        ))
        start += n
    return full, scores, jnp.concatenate(picks, axis=1)


def test_indexer_picks_through_the_cache_equal_the_full_sequence(model):
    assert sum(CHUNKS) == SEQ and len(BLOCK_TABLE) * POOL_BLOCK >= SEQ
    attn = nnx.merge(model.graphdef, model.state).segments[1].attn  # layer 1: CSA, not stacked
    assert attn.layer_type == CSA and attn.ratio == 4
    attn.indexer.topk = INDEX_TOPK  # this merged copy only: more picks than the model's 2
    x = np.random.default_rng(SELECTION_SEED).standard_normal((1, SEQ, CONFIG.hidden_size)).astype(np.float32)
    graphdef, state = nnx.split(attn)
    full, scores, cached = jax.jit(functools.partial(_full_and_cached_picks, graphdef))(state, x)
    full, scores, cached = np.asarray(full)[0], np.asarray(scores)[0], np.asarray(cached)[0]
    assert full.shape == cached.shape == (SEQ, INDEX_TOPK)

    # A query's picks are decided unless its k-th and (k+1)-th visible scores are near-tied
    # (with k or fewer visible entries it picks them all).
    visible = np.arange(scores.shape[1])[None, :] < (np.arange(SEQ)[:, None] + 1) // attn.ratio
    ranked = -np.sort(-np.where(visible, scores, -np.inf), axis=1)
    kth, after = ranked[:, INDEX_TOPK - 1], ranked[:, INDEX_TOPK]
    contested = ~np.isneginf(after)
    decided = ~contested | (kth - np.where(contested, after, 0.0) > NEAR_TIE * np.abs(kth))
    assert np.count_nonzero(~decided) < 0.01 * SEQ  # the seed leaves (almost) nothing to chance
    assert np.count_nonzero(visible.sum(1) > INDEX_TOPK) >= SEQ // 2  # most queries leave entries out
    for t in np.flatnonzero(decided):
        assert sorted(cached[t]) == sorted(full[t]), f"query {t}"
