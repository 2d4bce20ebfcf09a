"""The scheduler with speculative decoding, on the host only: decode rows carry drafts, `update`
and `extend` apply what a verify row emits, rejected drafts' blocks go back. A fake model emits a
token fixed by (request, output index), so each request's output is known independently of the
scheduler; drafts are right up to a random position, then wrong."""

from __future__ import annotations

import math
import random

from dsv4_jax.engine.request import RequestStatus
from dsv4_jax.engine.scheduler import Scheduler, SchedulerConfig

from test_scheduler import check_holdings, new_request, sampled_token

K = 3
# Small pools: requests of up to 120 + 40 tokens in blocks of 16, 24 blocks: preemptions happen.
CONFIG = SchedulerConfig(
    max_num_seqs=6, max_model_len=160, num_seq_slots=8, num_compressed_blocks=24, block_size=16,
    max_blocks_per_seq=10, max_prefill_rows=4, max_prefill_tokens=64, max_decode_rows=8,
    num_speculative_tokens=K,
)


def test_verify_rows_emit_the_models_tokens_and_give_back_rejected_blocks():
    rng = random.Random(5)
    scheduler = Scheduler(CONFIG)
    requests = [new_request(f"r{i}", rng.randint(1, 120), rng.randint(1, 40)) for i in range(40)]
    for request in requests:
        scheduler.add(request)
    drafted = accepted_total = crossed = 0
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        output = scheduler.schedule()
        by_id = {r.request_id: r for r in requests}
        assert all(by_id[rid].draft_token_ids == [] for rid in output.preempted)  # recomputed from its prompt
        emitted = {}
        for row in output.rows:
            request, bs = row.request, CONFIG.block_size
            known = row.num_known
            assert list(row.token_ids[:known]) == request.all_token_ids[row.start : row.start + known]
            assert list(row.token_ids[known:]) == request.draft_token_ids[: row.num_drafts]
            assert len(row.compressed_blocks) == math.ceil((row.start + len(row.token_ids)) / bs)
            if row.num_drafts:  # never past max_tokens or max_model_len
                assert known == 1 and row.is_sampling
                assert request.num_output_tokens + row.num_drafts < request.max_tokens
                assert request.num_tokens + row.num_drafts <= CONFIG.max_model_len
                crossed += math.ceil((row.start + len(row.token_ids)) / bs) > math.ceil((row.start + 1) / bs)
            if row.is_sampling:
                # The model's tokens at this row's positions; drafts kept while they match.
                truth = [sampled_token(request.request_id, request.num_output_tokens + i) for i in range(row.num_drafts + 1)]
                kept = 0
                while kept < row.num_drafts and row.token_ids[known + kept] == truth[kept]:
                    kept += 1
                emitted[request.request_id] = (row, truth[: kept + 1])
                drafted += row.num_drafts
                accepted_total += kept
        got = scheduler.update(output, {rid: tokens[0] for rid, (_, tokens) in emitted.items()})
        for request in got:
            row, tokens = emitted[request.request_id]
            for token in tokens[1:]:
                if request.status.finished:
                    break
                scheduler.extend(row, token)
            scheduler.release_rejected_blocks(request)
            if request.status is RequestStatus.RUNNING:
                # The next drafts: right up to a random position, then wrong.
                truth = [sampled_token(request.request_id, request.num_output_tokens + i) for i in range(K)]
                right = rng.randint(0, K)
                request.draft_token_ids = truth[:right] + [t + 1 for t in truth[right:]]
        check_holdings(scheduler)  # each holds exactly the blocks of the positions it wrote
    assert not scheduler.has_unfinished()
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == [sampled_token(request.request_id, i) for i in range(request.max_tokens)]
    assert scheduler.num_preemptions > 0 and crossed > 0 and 0 < accepted_total < drafted


def test_verify_buckets_are_no_prefill_buckets():
    """A verify bucket (B, k + 1) of a wide decode bucket holds more tokens than any prefill bucket;
    the scheduler's chunk limits still come from the prefill buckets (GPU defaults: 1024 sequences)."""
    import types

    from dsv4_jax.engine.runner import StepBuckets

    buckets = StepBuckets(prefill=((1, 256), (8, 256), (8, 32)), decode=(256, 1024)).with_verify_rows(2)
    assert buckets.verify == ((256, 3), (1024, 3)) and buckets.pick(300, 3) == (1024, 3)
    assert buckets.pick(4, 3) == (8, 32) and buckets.pick(2, 200) == (8, 256)
    layout = types.SimpleNamespace(num_seq_slots=1024, num_compressed_blocks=4096, block_size=256,
                                   max_blocks_per_seq=16)
    config = SchedulerConfig.for_runner(buckets, layout, max_num_seqs=1024, max_model_len=4096)
    assert (config.max_prefill_rows, config.max_prefill_tokens, config.max_decode_rows) == (8, 256, 1024)
