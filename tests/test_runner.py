"""The model on the paged KV cache, one step at a time, against the full-sequence forward.

One runner config crosses every boundary within a few hundred tokens: sliding window 4, CSA
ratio 4 with index_topk 2, HCA ratio 16, blocks of 128 positions (a ring of 2 blocks). With a
float32 cache nothing is rounded, so chunked prefill and decode must give the full forward's
logits at every position up to float32 reordering (1e-5 x max |logits|).
"""

from __future__ import annotations

import array
import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepRow
from dsv4_jax.kv_cache.paged import PagedCacheLayout
from dsv4_jax.presets import get_config
from dsv4_jax.testing import paged_layout, prefill_logits, write_random_checkpoint

CONFIG = get_config("dsv4-tiny-test").replace(sliding_window=4, compress_ratios=(0, 4, 16, 4, 0), index_topk=2)
BLOCK = 128
RING = 2  # ceil(window / block) + 1
BUCKETS = StepBuckets(prefill=((2, 16), (2, 272)), decode=(1, 2))
EXACT = 1e-5  # float32 cache: max |cached - full| / max |full|


def _layout(config, kv_cache_dtype: str, slots: int = 4, max_model_len: int = 512) -> PagedCacheLayout:
    return paged_layout(config, kv_cache_dtype, slots=slots, max_model_len=max_model_len, block_size=BLOCK)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("runner") / "ckpt", CONFIG, seed=3)


@pytest.fixture(scope="module")
def model(checkpoint):
    return dsv4_jax.load_model(checkpoint)


@pytest.fixture(scope="module")
def runner(model):
    runner = ModelRunner(model, _layout(CONFIG, "float32"), buckets=BUCKETS)
    runner.warmup()
    # These tests read every position of a prefill step (`all_logits`), which serving never does
    # (its prompt logprobs are `prompt_scores`, warmed up above): compile it here, before the
    # tests count compiles.
    for bucket in BUCKETS.prefill:
        streams = jax.eval_shape(runner._step, runner.weights, runner.cache, *runner.padding_step(bucket))[1]
        runner.head(np.zeros(streams.shape, streams.dtype))  # numpy: jnp.zeros would compile a fill
    return runner


class Sequence:
    """A sequence fed to the runner chunk by chunk; collects its logits at every position."""

    def __init__(self, ids, slot, blocks, plan):
        self.ids, self.slot, self.blocks, self.plan = list(ids), slot, blocks, list(plan)
        self.pos, self.logits = 0, []

    @property
    def done(self):
        return self.pos >= len(self.ids)

    def next_row(self):
        n = min(self.plan.pop(0) if self.plan else 1, len(self.ids) - self.pos)
        return StepRow(self.slot, self.pos, self.ids[self.pos : self.pos + n], self.blocks)


def run_steps(runner, sequences, steps=None):
    """Steps until every sequence is done (or `steps` steps); each step takes one row from every
    live sequence. Returns each sequence's logits so far."""
    while not all(s.done for s in sequences) and (steps is None or (steps := steps - 1) >= 0):
        live = [s for s in sequences if not s.done]
        rows = [s.next_row() for s in live]
        out = runner.step(rows)
        prefill = out.bucket[1] > 1
        every = np.asarray(runner.all_logits(out)) if prefill else np.asarray(out.logits)[:, None]
        for i, (s, row) in enumerate(zip(live, rows)):
            s.logits.append(every[i, : len(row.token_ids)])
            s.pos += len(row.token_ids)
    return [np.concatenate(s.logits) for s in sequences]


def relative_error(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def test_float32_chunked_prefill_and_decode_equal_the_full_forward(model, runner):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG.vocab_size, size=(3, 300)).astype(np.int32)
    full = np.asarray(model(ids))  # causal: a shorter sequence's logits are a prefix of its row
    runner.compiles.reset()  # count what the workload compiles, not the reference forward
    # A: chunks ending inside compression windows, longer than the window, then ring x block +
    # window tokens (260) after a 33-token prefix, then decode steps. B: a 16-token chunk, then
    # decode rows riding in prefill steps, then decode steps. C: reuses A's slot and blocks.
    a = Sequence(ids[0], slot=1, blocks=[0, 1, 2, 3], plan=[3, 5, 16, 9, 260])
    b = Sequence(ids[1, :47], slot=2, blocks=[4, 5], plan=[16, 1, 1, 7, 15])
    got_a, got_b = run_steps(runner, [a, b])
    c = Sequence(ids[2, :24], slot=1, blocks=[3, 2], plan=[16, 5])
    (got_c,) = run_steps(runner, [c])
    for got, want in ((got_a, full[0]), (got_b, full[1, :47]), (got_c, full[2, :24])):
        assert got.shape == want.shape
        assert relative_error(got, want) <= EXACT
    # The workload crossed every bucket, window and compression boundary: nothing compiled.
    assert runner.compiles.built == 0  # nothing compiled, nothing even read from the cache


def test_decode_completes_compression_windows_in_a_reused_slot(model, runner):
    """Decode steps write one compressor state row each and pool the window in place (HCA,
    ratio 16; CSA, ratio 4, which also moves a completed window to the previous window's rows),
    leaving the slot's other rows as they were. In slots that held another sequence's rows: a
    sequence decoded from its first token completes windows in decode steps, one prefilled to 21
    tokens completes HCA window 1 there; then, in the same slots again, two sequences start with
    decode steps, where the slot's first CSA rows still hold the earlier sequence's last window:
    one completes its CSA window 0 in a decode step, the other in a row of one token riding in a
    prefill step (the chunk path). Window 0 has no previous window either way; logits equal the
    full forward's."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, CONFIG.vocab_size, size=(3, 300)).astype(np.int32)  # the forward's shape above
    full = np.asarray(model(ids))[:, :40]  # causal: the first 40 positions are those of 40 tokens
    fillers = [Sequence(rng.integers(0, CONFIG.vocab_size, 30), slot=s, blocks=[b], plan=[30])
               for s, b in ((1, 6), (2, 7))]
    run_steps(runner, fillers)  # both slots' compressor states now hold the fillers' rows
    runner.compiles.reset()
    from_start = Sequence(ids[0, :40], slot=1, blocks=[0], plan=[1])  # every step one token
    prefilled = Sequence(ids[1, :40], slot=2, blocks=[1], plan=[16, 5])
    got = run_steps(runner, [from_start, prefilled])
    in_decode = Sequence(ids[2, :40], slot=1, blocks=[2], plan=[1])
    in_chunk = Sequence(ids[1, :40], slot=2, blocks=[3], plan=[1])
    rider = Sequence(ids[0, :16], slot=3, blocks=[4], plan=[16])
    run_steps(runner, [in_decode, in_chunk], steps=3)  # positions 0-2: decode steps
    run_steps(runner, [in_decode], steps=1)  # position 3 completes CSA window 0 in a decode step
    run_steps(runner, [in_chunk, rider], steps=1)  # ... and here in a prefill step
    got += run_steps(runner, [in_decode, in_chunk])
    for g, want in zip(got, [*full[:2], full[2], full[1]], strict=True):
        assert relative_error(g, want) <= EXACT
    assert relative_error(rider.logits[0], full[0, :16]) <= EXACT
    assert runner.compiles.built == 0


def test_prompt_scores_in_passes_equal_the_whole_steps_logits_scored_on_the_host(runner):
    """Prompt logprobs score a prefill step's positions a pass at a time (`_head_scores`, bounded
    memory): passes of 5 positions over a 2 x 16 step (the last pass padded), and the one pass
    of the warmed-up executable, give the host scoring of `all_logits` (the whole step's logits)."""
    import functools

    from dsv4_jax.engine.engine import _prompt_scores
    from dsv4_jax.engine.runner import _head_scores
    from dsv4_jax.engine.sampling_params import MAX_LOGPROBS

    rng = np.random.default_rng(4)
    bucket = BUCKETS.prefill[0]
    shape = jax.eval_shape(runner._step, runner.weights, runner.cache, *runner.padding_step(bucket))[1]
    streams = rng.normal(size=shape.shape).astype(shape.dtype)
    targets = rng.integers(0, CONFIG.vocab_size, size=bucket).astype(np.int32)
    logits = np.asarray(runner.head(streams)).reshape(-1, CONFIG.vocab_size)
    want = _prompt_scores(logits, targets.reshape(-1), MAX_LOGPROBS)
    in_passes = jax.jit(functools.partial(_head_scores, runner.graphdef, runner.weights_def, positions=5))
    for scores in (runner.prompt_scores(streams, targets), in_passes(runner.weights, streams, targets)):
        logprob, rank, top_ids, top_logprobs = (np.asarray(x).reshape(len(logits), *x.shape[2:]) for x in scores)
        assert rank.tolist() == want[1] and top_ids.tolist() == want[2]
        np.testing.assert_allclose(logprob, want[0], atol=1e-5)
        np.testing.assert_allclose(top_logprobs, want[3], atol=1e-5)


def test_a_step_donates_the_cache(runner):
    before = jax.tree.leaves(runner.cache)
    runner.step([StepRow(0, 0, [1, 2, 3], [6])])
    assert all(leaf.is_deleted() for leaf in before)


def test_build_lays_out_ragged_rows_as_the_step_reads_them(runner):
    # A 3-token chunk of slot 1 at position 5 holding blocks 0 and 2 (as the scheduler gives
    # them: C ints), and slot 3's first token.
    (b, s), tokens, seqs = runner.build([StepRow(1, 5, [7, 8, 9], array.array("i", [0, 2])), StepRow(3, 0, [4], [])])
    assert (b, s) == (2, 16)
    want_tokens = np.zeros((2, 16), np.int32)
    want_tokens[0, :3], want_tokens[1, 0] = [7, 8, 9], 4
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(seqs.positions, [list(range(5, 21)), list(range(16))])
    np.testing.assert_array_equal(seqs.lens, [3, 1])
    np.testing.assert_array_equal(seqs.slots, [1, 3])
    np.testing.assert_array_equal(seqs.sliding_table, [[2, 3], [6, 7]])  # slot x RING + ring index
    np.testing.assert_array_equal(seqs.compressed_table, [[0, 2, -1, -1], [-1, -1, -1, -1]])
    # With data-parallel ranks each rank's rows fill its own block of the step's rows, in order.
    two_ranks = copy.copy(runner)
    two_ranks.dp = 2
    rows = [StepRow(0, 0, [1], [], dp_rank=r) for r in (1, 0, 1)]
    assert two_ranks.row_positions(rows, 4) == [2, 0, 3]
    with pytest.raises(ValueError, match="row 1: data-parallel rank 2 is outside"):
        two_ranks.row_positions([rows[0], StepRow(0, 0, [1], [], dp_rank=2)], 4)


def test_rows_that_fit_no_bucket_or_slot_are_refused(runner):
    with pytest.raises(ValueError, match="fits no bucket"):
        runner.build([StepRow(0, 0, list(range(300)), [0])])
    with pytest.raises(ValueError, match="slot 9 is outside"):
        runner.build([StepRow(9, 0, [1], [0])])
    with pytest.raises(ValueError, match="outside the 512"):
        runner.build([StepRow(0, 510, [1, 2, 3], [0])])
    with pytest.raises(ValueError, match="has no tokens"):
        runner.build([StepRow(0, 0, [], [0])])


# ---- poisoning -------------------------------------------------------------------------------------
def _copy(cache):  # through the host: no XLA op, so nothing compiles
    return jax.tree.map(lambda x: jnp.asarray(np.array(x)), cache)


def _poison(cache, pool_path, index, value=np.nan):
    """The cache with pool `pool_path` (e.g. ("sliding", "kv")) rows[index] set to `value`."""
    parent = cache
    for name in pool_path[:-1]:
        parent = getattr(parent, name)
    rows = np.array(getattr(parent, pool_path[-1]).rows)
    rows[index] = value
    poisoned = dataclasses.replace(getattr(parent, pool_path[-1]), rows=jnp.asarray(rows))
    if pool_path[0] == "sliding":
        return dataclasses.replace(cache, sliding=dataclasses.replace(cache.sliding, kv=poisoned))
    return dataclasses.replace(cache, compressed=dataclasses.replace(cache.compressed, **{pool_path[1]: poisoned}))


def test_poisoned_rows_matter_exactly_when_a_step_reads_them(runner):
    rng = np.random.default_rng(1)
    slot, blocks, other_blocks = 3, [7], [8]
    ids = rng.integers(0, CONFIG.vocab_size, size=70).astype(np.int32)
    seq = Sequence(ids[:69], slot=slot, blocks=blocks, plan=[16] * 5)
    other = Sequence(rng.integers(0, CONFIG.vocab_size, size=40), slot=0, blocks=other_blocks, plan=[16] * 3)
    run_steps(runner, [seq, other])
    saved = _copy(runner.cache)
    lay = runner.layout

    def decode(cache):
        runner.cache = _copy(cache)
        return np.asarray(runner.step([StepRow(slot, 69, [int(ids[69])], blocks)]).logits)[0]

    clean = decode(saved)
    assert np.all(np.isfinite(clean))
    ring_row = lambda pos: (slot * RING + (pos // BLOCK) % RING, pos % BLOCK)  # noqa: E731
    # Read rows: the newest window row (every layer reads it), an HCA entry.
    for layer in range(len(lay.sliding_layers)):
        assert not np.array_equal(decode(_poison(saved, ("sliding", "kv"), (layer, *ring_row(68)))), clean)
    assert not np.array_equal(decode(_poison(saved, ("compressed", "hca"), (0, blocks[0], 0))), clean)
    # Unread rows: positions that left the window (still in the ring), another sequence's blocks.
    stale = _poison(saved, ("sliding", "kv"), (slice(None), *ring_row(60)))
    stale = _poison(stale, ("sliding", "kv"), (slice(None), slot * RING + 1))  # a ring block not reached yet
    stale = _poison(stale, ("sliding", "kv"), (slice(None), slice(0, RING)))  # slot 0's ring
    stale = _poison(stale, ("compressed", "csa"), (slice(None), other_blocks[0]))
    stale = _poison(stale, ("compressed", "hca"), (slice(None), other_blocks[0]))
    np.testing.assert_array_equal(decode(stale), clean)
    # CSA entries: only the indexer's picks are read (index_topk 2 per layer): poisoning any other
    # entry changes nothing, poisoning a pick changes the logits.
    entries = 70 // CONFIG.csa_compress_ratio
    changed = 0
    for layer in range(len(lay.csa_layers)):
        for j in range(entries):
            got = decode(_poison(saved, ("compressed", "csa"), (layer, blocks[0], j)))
            if not np.array_equal(got, clean):
                changed += 1
    assert 1 <= changed <= CONFIG.index_topk * len(lay.csa_layers)
    runner.cache = saved


def _restore_at_boundary(cache, source: int, target: int, h: int, window: int, stale_hca: bool = True):
    """What a prefix-cache hit at block boundary `h` must give a new slot, copied through the host
    from the slot that computed the prefix: the sliding rows of positions [h - window + 1, h) of
    every layer (position h's window is itself and the window - 1 before it; the same ring
    addresses serve both slots, `h` being block-aligned), and the CSA and CSA-indexer
    compressor rows (at a boundary only the previous window's rows are read; the current window is
    empty). The HCA rows are left as the target slot had them: at a boundary (a multiple of the
    HCA ratio) nothing reads them before the new window's own tokens overwrite them."""
    host = jax.tree.map(np.array, cache)
    rows = host.sliding.kv.rows
    for t in range(h - window + 1, h):
        ring, offset = (t // BLOCK) % RING, t % BLOCK
        rows[:, target * RING + ring, offset] = rows[:, source * RING + ring, offset]
    for state in (host.csa_state, host.csa_indexer_state):
        state.kv[:, target], state.score[:, target] = state.kv[:, source], state.score[:, source]
    if not stale_hca:
        host.hca_state.kv[:, target], host.hca_state.score[:, target] = 0.0, -np.inf
    return jax.tree.map(jnp.asarray, host)


def test_a_slot_restored_at_a_block_boundary_continues_exactly(model, runner):
    """Prefix caching's premise (issue: prefix caching over the compressed KV): a sequence that
    resumes at a block boundary h in another slot, sharing the prefix's compressed blocks, needs
    only the sliding rows [h - window + 1, h) and the CSA / indexer compressor rows of the slot that
    computed the prefix; the target slot's stale HCA rows and the rest of its ring (another
    sequence's) change nothing. Its logits then equal the full forward's from h on; without the
    copied rows they do not."""
    rng = np.random.default_rng(5)
    ids = rng.integers(0, CONFIG.vocab_size, size=(3, 300)).astype(np.int32)
    full = np.asarray(model(ids))[0]
    h = 2 * BLOCK
    prefix = Sequence(ids[0, :h], slot=1, blocks=[0, 1], plan=[100, 28, 128])  # ends exactly at h
    filler = Sequence(ids[1, :290], slot=2, blocks=[4, 5, 6], plan=[16, 200, 74])  # slot 2: another sequence's rows
    run_steps(runner, [prefix, filler])
    restored = _restore_at_boundary(runner.cache, source=1, target=2, h=h, window=CONFIG.sliding_window)
    saved = _copy(runner.cache)
    runner.compiles.reset()
    runner.cache = restored
    resumed = Sequence(ids[0], slot=2, blocks=[0, 1, 9], plan=[])
    resumed.pos, resumed.plan = h, [20, 1, 1, 22]
    (got,) = run_steps(runner, [resumed])
    assert relative_error(got, full[h:]) <= EXACT
    assert runner.compiles.built == 0
    # Without the rows: the target slot's own (the filler's) sliding and compressor rows.
    runner.cache = saved
    unrestored = Sequence(ids[0], slot=2, blocks=[0, 1, 10], plan=[])
    unrestored.pos, unrestored.plan = h, [20]
    (wrong,) = run_steps(runner, [unrestored], steps=1)
    assert relative_error(wrong, full[h : h + 20]) > 1e-3


def test_a_cpu_runner_keeps_its_step_buffers_pages(runner):
    # What that means for the process is tested in test_host_memory.py; here: the runner asks.
    assert runner.keeps_freed_buffers


# ---- the golden flash-like fixture ---------------------------------------------------------------
def test_greedy_generation_follows_the_full_forward_on_hc4_flash_like(golden_dir):
    model = dsv4_jax.load_model(golden_dir / "hc4_flash_like" / "checkpoint")
    runner = ModelRunner(model, _layout(model.config, "float32", slots=1, max_model_len=128),
                         buckets=StepBuckets(prefill=((1, 16),), decode=(1,)))
    runner.warmup()
    prompt = [int(t) for t in np.load(golden_dir / "hc4_flash_like" / "input_ids_short.npy")[0]]
    tokens = list(prompt)
    out = runner.step([StepRow(0, 0, prompt, [0])])
    for _ in range(24):
        tokens.append(int(np.argmax(np.asarray(out.logits)[0])))
        out = runner.step([StepRow(0, len(tokens) - 1, [tokens[-1]], [0])])
    assert runner.compiles.built == 0  # nothing compiled, nothing even read from the cache
    generated = tokens[len(prompt) :]
    assert len(set(generated)) >= 4, generated  # a random tiny model must not just repeat a token
    full = np.asarray(model(np.array([tokens], np.int32)))[0]  # (after the compile check)
    checked = 0
    for i, token in enumerate(generated):
        row = full[len(prompt) - 1 + i]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > 1e-3:
            assert token == int(np.argmax(row)), i
            checked += 1
    assert checked >= len(generated) - 2


# ---- rounded caches ------------------------------------------------------------------------------
# Hash routing everywhere and index_topk >= every entry: bf16 / fp8 rounding can then flip neither
# a router nor an indexer choice, so the cached path can also be held against the dense forward.
ROUNDED = CONFIG.replace(num_hash_layers=CONFIG.num_hidden_layers, index_topk=16)


@pytest.fixture(scope="module")
def rounded_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("rounded") / "ckpt", ROUNDED, seed=5)


# Chunked steps and one whole-prompt chunk compute KV with different matmul shapes, so their
# float32 values differ by ~1e-7; where a value straddles a rounding boundary of the cache format
# the two land one ulp of the format apart. Such flips are rare and each moves one element of one
# row, so the logits move far less than one bf16 ulp at their scale.
SAME_BACKEND = 2.0**-8


_ROUNDED_RUNNERS: dict[str, tuple] = {}


@pytest.fixture
def rounded_runner(rounded_checkpoint, kv_cache_dtype) -> tuple:
    """One runner per rounded cache dtype, shared by the tests below (3 slots, 2 snapshots): the
    dense float32 model with the official QAT rounding of KV to the fp8 grid (spec 3.8) where the
    cache is fp8, the numerics an fp8 cache is meant to reproduce. Returns (model, runner)."""
    if kv_cache_dtype not in _ROUNDED_RUNNERS:
        dense = dsv4_jax.load_model(rounded_checkpoint, kv_cache_rounding=kv_cache_dtype == "fp8_ds_mla")
        runner = ModelRunner(dense, _layout(ROUNDED, kv_cache_dtype, slots=3, max_model_len=256),
                             buckets=StepBuckets(prefill=((2, 16),), decode=(4,)), num_prefix_snapshots=2)
        runner.compile_buckets(scoring=False)
        _ROUNDED_RUNNERS[kv_cache_dtype] = dense, runner
    return _ROUNDED_RUNNERS[kv_cache_dtype]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_ds_mla"])
def test_rounded_caches_chunked_equal_one_chunk_and_track_the_dense_forward(rounded_runner, kv_cache_dtype,
                                                                            capsys):
    dense, runner = rounded_runner
    ids = np.random.default_rng(2).integers(0, ROUNDED.vocab_size, size=(2, 40)).astype(np.int32)
    assert 40 // ROUNDED.csa_compress_ratio <= ROUNDED.index_topk and 40 // 16 >= 2  # HCA entries too
    seqs = [Sequence(ids[i], slot=i, blocks=[i], plan=[16, 7 + i, 16]) for i in range(2)]
    got = np.stack(run_steps(runner, seqs))
    # The same prompts, each ONE chunk over a fresh cache of the same dtype and backend: what the
    # cache rounds is the same, only the chunking differs.
    one_chunk = np.stack(prefill_logits(dense, ids, kv_cache_dtype=kv_cache_dtype))
    same_backend = relative_error(got, one_chunk)
    error = relative_error(got, np.asarray(dense(ids)))
    with capsys.disabled():
        print(f"\n{kv_cache_dtype} cache: chunked vs one chunk on the same backend {same_backend:.2e}, "
              f"vs the dense float32 forward {error:.2e} (x max|logits|)")
    assert same_backend <= SAME_BACKEND
    # Against the dense forward the cache's bf16 rows and bf16 attention operands show: a few bf16
    # ulps at the logits' scale.
    assert error <= 4 * 2.0**-8


def test_decode_token_ids_can_come_from_the_previous_steps_device_output(runner):
    """The engine overlaps host and device work by feeding sampled ids back without a host trip."""
    prompt = [5, 6, 7, 8, 9]
    snapshot = _copy(runner.cache)
    first = runner.step([StepRow(0, 0, prompt, [9])])
    decode_rows = runner.buckets.pick(1, 1)[0]  # a one-row decode's bucket (two rows on CPUs)
    sampled = jnp.argmax(first.logits, axis=-1).astype(jnp.int32)[:decode_rows, None]  # [B, S=1] on the device
    on_device = np.asarray(runner.step([StepRow(0, 5, [0], [9])], token_ids=sampled).logits)[0]
    runner.cache = snapshot
    first = runner.step([StepRow(0, 0, prompt, [9])])
    token = int(np.argmax(np.asarray(first.logits)[0]))
    from_host = np.asarray(runner.step([StepRow(0, 5, [token], [9])]).logits)[0]
    np.testing.assert_array_equal(on_device, from_host)
    with pytest.raises(ValueError, match="bucket"):
        runner.step([StepRow(0, 6, [0], [9])], token_ids=jnp.zeros((decode_rows + 1, 1), jnp.int32))


def test_compile_counter_tells_compiles_from_persistent_cache_hits(tmp_path):
    """A restart with a warm persistent cache builds executables from the cache: 0 compiles."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        from dsv4_jax.engine.compiles import CompileCounter
        counter = CompileCounter()
        jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(7.0)).block_until_ready()
        print(counter.compiles, counter.cache_hits, counter.built)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    (cold_compiles, cold_hits, cold_built), (warm_compiles, warm_hits, warm_built) = (
        map(int, r.stdout.split()) for r in runs)
    assert cold_compiles >= 1 and cold_hits == 0 and cold_built == cold_compiles
    assert warm_compiles == 0 and warm_hits == cold_compiles == warm_built


def test_warm_up_compiles_every_bucket_on_threads_and_steps_run_those_executables(runner):
    """Warm-up compiled each bucket's step (and each prefill bucket's prompt scoring) once, ahead
    of time: steps of those shapes call the executables, and reading their memory afterwards (the
    activation check of a GPU start) builds nothing."""
    from dsv4_jax.engine.compiles import CompileCounter

    assert set(runner._steps) == set(runner.buckets.all)  # no mesh: a step's rows are the bucket's
    assert set(runner._scorers) == {bucket for bucket in runner.buckets.all if bucket[1] > 1}
    counter = CompileCounter()
    memory = runner.program_memory()
    runner.step([StepRow(0, 0, [1, 2, 3], [6])])
    assert counter.built == 0
    assert all(m.step.temp > 0 and (m.scores is not None) == (s > 1) for (b, s), m in memory.items())


def test_compiles_run_at_once_and_fail_in_their_buckets_context(monkeypatch):
    """The program cache compiles on its own threads, `DSV4_JAX_COMPILE_THREADS` at once (1: one
    after another), and raises a failed compile inside `describe_error(key)` (the runner names the
    bucket and the attention backend there)."""
    import contextlib
    import threading
    import time

    from dsv4_jax.engine import program_cache
    from dsv4_jax.engine.compiles import compile_threads

    lock, state = threading.Lock(), {"active": 0, "peak": 0, "threads": set(), "want": 1, "deadline": 0.0}

    class Lowered:
        def __init__(self, fails: bool = False):
            self.fails = fails

        def compile(self):
            with lock:
                state["active"] += 1
                state["peak"] = max(state["peak"], state["active"])
                state["threads"].add(threading.current_thread().name)
            # Until as many run at once as the threads allow (not a fixed sleep, which a loaded
            # machine may outlast before the second thread starts); a serial run waits it out.
            while state["peak"] < state["want"] and time.monotonic() < state["deadline"]:
                time.sleep(0.01)
            time.sleep(0.2)  # long enough for a thread the limit should hold back to show up
            with lock:
                state["active"] -= 1
            if self.fails:
                raise ValueError("refused by the compiler")
            return "executable"

    # These fakes have no runtime executable to tell a JAX cache hit by: each counts as compiled here.
    monkeypatch.setattr(program_cache, "_compile_fresh", lambda lowered: (lowered.compile(), False))
    cache = program_cache.ProgramCache(None)
    for threads in (2, 1):
        monkeypatch.setenv("DSV4_JAX_COMPILE_THREADS", str(threads))
        state.update(peak=0, threads=set(), want=threads, deadline=time.monotonic() + 30)
        jobs = {key: (key, Lowered) for key in "abc"}
        assert cache.compile(jobs) == dict.fromkeys("abc", "executable")
        assert state["peak"] == threads and all(name.startswith("dsv4-compile") for name in state["threads"])

    @contextlib.contextmanager
    def naming(key):
        try:
            yield
        except ValueError as err:
            raise RuntimeError(f"bucket {key}: {err}") from err

    with pytest.raises(RuntimeError, match=r"bucket b: refused by the compiler"):
        cache.compile({"a": ("a", Lowered), "b": ("b", lambda: Lowered(fails=True))}, naming)
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("DSV4_JAX_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="DSV4_JAX_COMPILE_THREADS must be a positive integer"):
            compile_threads()


def test_a_restarted_runner_reads_its_programs_back_and_runs_nothing_to_warm_up(model, tmp_path, monkeypatch):
    """A second runner of the same model, layout and buckets (a restart) takes every step and
    scoring program from the program cache: nothing traced, lowered or compiled, no padding step
    run; its steps give the first runner's logits exactly."""
    from dsv4_jax.engine.program_cache import ProgramCache

    from conftest import jax_persistent_cache_off

    # Shapes no other test compiles: a program this process already has from JAX's persistent cache
    # (served from memory again here) is not kept (program_cache.py).
    layout, buckets = _layout(CONFIG, "float32", slots=3), StepBuckets(prefill=((3, 24),), decode=(3,))
    with jax_persistent_cache_off():  # what XLA compiles here is what the program cache keeps
        first = ModelRunner(model, layout, buckets=buckets, programs=ProgramCache(tmp_path))
        first.warmup()
    assert (first.programs.built, first.programs.loaded) == (3, 0)  # 2 steps, the prefill's scoring

    class NotTraced:
        def lower(self, *args):
            raise AssertionError("a program read back was traced")

    ran = []
    restarted = ModelRunner(model, layout, buckets=buckets, programs=ProgramCache(tmp_path))
    restarted._step = restarted._head_scores = NotTraced()
    monkeypatch.setattr(restarted, "_run_padding_step", lambda bucket: ran.append(bucket))
    assert restarted.warmup() == 0 and not ran
    assert (restarted.programs.built, restarted.programs.loaded) == (0, 3)
    rows = [StepRow(0, 0, list(range(3, 20)), array.array("i", [0])), StepRow(1, 0, [5, 6, 7], array.array("i", [1]))]
    for runner in (first, restarted):
        runner.cache = runner._new_cache()
    expected, got = (np.asarray(runner.step(rows).logits) for runner in (first, restarted))
    np.testing.assert_array_equal(got, expected)


def test_steps_compile_without_xlas_rematerialization_pass(runner, monkeypatch):
    """The step's compiler options disable XLA's rematerialization pass and keep the passes
    XLA_FLAGS disables (a compile option replaces XLA_FLAGS' list)."""
    from dsv4_jax.engine.runner import step_compiler_options

    bucket = runner.buckets.all[0]
    lowered = runner._step.lower(runner.weights, runner.cache, *runner.padding_step(bucket))
    assert dict(lowered._lowering._compiler_options_kvs) == step_compiler_options()  # what XLA is given
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert step_compiler_options() == {"xla_disable_hlo_passes": "rematerialization"}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_disable_hlo_passes=foo,bar")
    assert step_compiler_options() == {"xla_disable_hlo_passes": "foo,bar,rematerialization"}


# ---- prefix-cache snapshots ----------------------------------------------------------------------
def _feed(runner, rows_by_step):
    """Run steps of StepRows; the logits of each step's rows (decode steps' last-token logits)."""
    return [np.asarray(runner.step(rows).logits)[: len(rows)] for rows in rows_by_step]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_ds_mla"])
def test_a_snapshot_taken_at_a_boundary_and_restored_into_another_slot_continues_bit_for_bit(rounded_runner,
                                                                                            kv_cache_dtype):
    """The runner's own copies (kv_cache/snapshots.py), not a host copy, in the rounded caches: a
    prefix computed in slot 0 up to block boundary h is snapshotted; slots 1 and 2 run other
    sequences (their rings and compressor rows are someone else's); slot 1 gets the snapshot.
    Then slots 0, 1 and 2 continue the prefix side by side, sharing its block: slot 1's logits
    equal slot 0's bit for bit, on the same backend and dtype, whatever the cache rounds; slot 2,
    not restored, gives others. (In float32 a hit equals a miss and the full forward: the premise
    test above and tests/test_prefix_caching.py.)"""
    _, runner = rounded_runner
    ids = np.random.default_rng(8).integers(0, ROUNDED.vocab_size, size=(2, BLOCK + 24)).tolist()
    h, tail = BLOCK, 24
    # The prefix in slot 0 (block 0), 16 tokens a step, ending exactly at h; then its snapshot.
    _feed(runner, [[StepRow(0, s, ids[0][s : s + 16], [0])] for s in range(0, h, 16)])
    runner.take_snapshots([(0, 0, 1, h)])
    # Another sequence fills slots 1 and 2 (blocks 2, 3 and 4, 5); then slot 1 gets the snapshot.
    _feed(runner, [[StepRow(1, s, ids[1][s : s + 16], [2, 3]), StepRow(2, s, ids[1][s : s + 16], [4, 5])]
                   for s in range(0, h + 16, 16)])
    runner.restore_snapshots([(0, 1, 1, h)])
    steps = _feed(runner, [[StepRow(slot, t, [ids[0][t]], [0, 6 + slot]) for slot in range(3)]
                           for t in range(h, h + tail)])
    original, restored, unrestored = (np.stack([step[slot] for step in steps]) for slot in range(3))
    np.testing.assert_array_equal(restored, original)
    assert not np.array_equal(unrestored[0], original[0])
