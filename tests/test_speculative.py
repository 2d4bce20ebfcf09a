"""Speculative decoding on the paged cache: verify steps whose drafts are accepted or rejected at
every position leave the cache as a non-speculative run leaves it, and the logits at accepted
positions are the full forward's.

One runner config crosses every boundary within a hundred tokens: sliding window 4, CSA ratio 4
with index_topk 2, HCA ratio 16, blocks of 128 positions; float32 cache, so nothing is rounded.
A verify row is a sequence's last token and k drafts; the test plays the acceptance: the first
`a` drafts are the sequence's true next tokens, the rest are wrong, with `a` cycling through
0..k (every position rejects in turn, and some steps accept all).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepRow
from dsv4_jax.presets import get_config
from dsv4_jax.testing import paged_layout, write_random_checkpoint

CONFIG = get_config("dsv4-tiny-test").replace(sliding_window=4, compress_ratios=(0, 4, 16, 4, 0), index_topk=2)
K = 3  # drafts per verify row
PROMPT = 16
LENGTH = 88  # positions 0..87: windows of 4 and 16 completed many times, by accepted and rejected drafts
EXACT = 1e-5  # float32 cache: max |cached - full| / max |full|


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    assert CONFIG.num_nextn_predict_layers == 1
    return dsv4_jax.load_model(write_random_checkpoint(tmp_path_factory.mktemp("spec") / "ckpt", CONFIG, seed=11))


def _layout():
    return paged_layout(CONFIG, "float32", slots=2, max_model_len=256, num_mtp_layers=1, spare_compressor_windows=1)


def _readable(cache, layout, slot: int, blocks: list[int], position: int) -> dict[str, np.ndarray]:
    """What a step at `position` (the next token's) may read of `slot`'s cache: the main layers'
    ring rows of the window before it, the compressed entries and indexer keys before it, and the compressor
    rows its windows still need (CSA: the previous window and the current one so far; HCA: the
    current one so far), in the ring layout of model/cache_step.py."""
    host = jax.tree.map(np.asarray, cache)
    ring, bs = layout.sliding_ring, layout.block_size
    out = {}
    (sliding,) = jax.tree.leaves(host.sliding.kv)
    main = [i for i, layer in enumerate(layout.sliding_layers) if layer < CONFIG.num_hidden_layers]
    sliding = sliding[main]  # the MTP layer's window is the drafter's (checked through its drafts)
    for t in range(max(0, position - layout.window + 1), position):
        out[f"sliding {t}"] = sliding[:, slot * ring + (t // bs) % ring, t % bs]
    for name, ratio in (("csa", layout.csa_ratio), ("indexer", layout.csa_ratio), ("hca", layout.hca_ratio)):
        (pool,) = jax.tree.leaves(getattr(host.compressed, name))
        per_block = bs // ratio
        for j in range(position // ratio):
            out[f"{name} entry {j}"] = pool[:, blocks[j // per_block], j % per_block]
    for name, ratio, previous in (("csa_state", layout.csa_ratio, 1), ("csa_indexer_state", layout.csa_ratio, 1),
                                  ("hca_state", layout.hca_ratio, 0)):
        state = getattr(host, name)
        windows = state.kv.shape[2] // ratio
        for t in range(max(0, (position // ratio - previous) * ratio), position):
            row = (t // ratio % windows) * ratio + t % ratio
            out[f"{name} row {t}"] = np.stack([state.kv[:, slot, row], state.score[:, slot, row]])
    return out


def test_verify_steps_with_rejections_at_every_draft_equal_a_non_speculative_run(model):
    """Two sequences side by side: prompt chunks, then verify rows of a token and K drafts whose
    first a are right (a = 0..K in turn, offset per sequence). After every step the accepted
    positions' logits equal the full forward's, and each slot's readable cache equals that of a
    runner that decoded the same tokens one at a time; the MTP drafts of the step (greedy) are the
    whole-sequence MTP's argmax at the last accepted position wherever its top two differ."""
    layout = _layout()
    rng = np.random.default_rng(3)
    ids = rng.integers(0, CONFIG.vocab_size, size=(2, LENGTH + K + 1))
    full = np.asarray(model(ids))  # [2, T, vocab]
    mtp = np.asarray(model.mtp_logits(model.hidden_streams(ids[:, :-1]), ids[:, 1:]))  # [2, T - 1, vocab]
    spec = ModelRunner(model, layout, buckets=StepBuckets(prefill=((2, 16),), decode=(2,)),
                       num_speculative_tokens=K, mtp_drafts=True)
    plain = ModelRunner(model, layout, buckets=StepBuckets(prefill=((2, 16),), decode=(2,)))
    assert (2, K + 1) in spec.buckets.prefill
    blocks = [[0, 2], [1, 3]]
    errors, compared, drafts_checked = [], 0, 0

    # The prompts but their last tokens, one chunk each: both runners alike; the drafter fills the
    # MTP layer's window at every step's positions (the prompt's too).
    prompts = [StepRow(i, 0, ids[i, : PROMPT - 1].tolist(), blocks[i]) for i in range(2)]
    plain.step(prompts)
    bucket, tokens, seqs = spec.build(prompts)
    out = spec.run(bucket, tokens, seqs, 2)
    next_ids = np.zeros(out.bucket, np.int32)
    next_ids[:2, : PROMPT - 1] = ids[:, 1:PROMPT]
    spec.draft(out.streams, seqs, next_ids, np.full(out.bucket[0], PROMPT - 2, np.int32))
    # Each sequence's next position, whose token is not in the cache yet (the same for `plain`).
    position, plain_at, step = [PROMPT - 1] * 2, [PROMPT - 1] * 2, 0
    while min(position) < LENGTH - 1:
        accepted = [(step + i) % (K + 1) for i in range(2)]
        rows = []
        for i in range(2):
            p, a = position[i], accepted[i]
            wrong = (ids[i, p + 1 + a : p + 1 + K] + 1 + rng.integers(0, CONFIG.vocab_size - 1, K - a)) % CONFIG.vocab_size
            rows.append(StepRow(i, p, [int(ids[i, p]), *ids[i, p + 1 : p + 1 + a].tolist(), *wrong.tolist()], blocks[i]))
        bucket, tokens, seqs = spec.build(rows)
        out = spec.run(bucket, tokens, seqs, len(rows))
        logits = np.asarray(out.logits).reshape(out.bucket[0], K + 1, -1)
        next_ids, draft_at = np.zeros(out.bucket, np.int32), np.zeros(out.bucket[0], np.int32)
        for i in range(2):
            p, a = position[i], accepted[i]
            got = logits[i, : a + 1]  # the row's K + 1 positions p..p+K; p..p+a are valid
            errors.append(np.abs(got - full[i, p : p + a + 1]).max() / np.abs(full[i, p : p + a + 1]).max())
            compared += a + 1
            next_ids[i, : a + 1] = ids[i, p + 1 : p + a + 2]  # the accepted drafts, then the "sampled" token
            draft_at[i] = a
        drafts = np.asarray(spec.draft(out.streams, seqs, next_ids, draft_at))
        for i in range(2):
            q = position[i] + accepted[i]
            top2 = np.sort(mtp[i, q])[-2:]
            if top2[1] - top2[0] > 1e-3:
                assert drafts[i, 0] == int(np.argmax(mtp[i, q])), (step, i)
                drafts_checked += 1
            position[i] = q + 1
        # The plain runner decodes the same tokens one at a time up to where each sequence stands.
        while behind := [i for i in range(2) if plain_at[i] < position[i]]:
            plain.step([StepRow(i, plain_at[i], [int(ids[i, plain_at[i]])], blocks[i]) for i in behind])
            for i in behind:
                plain_at[i] += 1
        step += 1
        for i in range(2):
            want = _readable(plain.cache, layout, i, blocks[i], position[i])
            got = _readable(spec.cache, layout, i, blocks[i], position[i])
            assert want.keys() == got.keys()
            for name in want:
                scale = max(np.abs(np.nan_to_num(want[name], neginf=0)).max(), 1.0)
                np.testing.assert_allclose(got[name], want[name], atol=EXACT * scale, rtol=0,
                                           err_msg=f"step {step}, sequence {i}: {name}")
    assert max(errors) <= EXACT and compared >= 100 and drafts_checked >= 20, (max(errors), compared, drafts_checked)
