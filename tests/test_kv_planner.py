"""Capacity planner: hand-computed DeepSeek-V4-Flash figures, sizing modes, errors, and the CLI."""

from __future__ import annotations

import math

import pytest

from dsv4_jax import plan as plan_cli
from dsv4_jax.kv_cache import (
    MeshShape,
    estimate_weight_bytes_per_device,
    max_model_len_that_fits,
    nominal_device_memory,
    plan_capacity,
    pool_usage,
    resolve_kv_cache,
    weight_bytes_breakdown,
)
from dsv4_jax.presets import get_config
from pallas_kernels.cli import run_main

GiB = 1024**3
FLASH = get_config("dsv4-flash")
FP8 = resolve_kv_cache("auto")  # H200: fp8_ds_mla, fp8 indexer
BF16 = resolve_kv_cache("bfloat16")  # H200 with bf16 rows: indexer keys stay fp8 (132 B)
BF16_A100 = resolve_kv_cache("auto", "NVIDIA A100-SXM4-80GB", "8.0")  # bf16 rows and bf16 indexer keys
FP32 = resolve_kv_cache("float32")  # H200: exact float32 rows and float32 indexer keys, on xla
L = 1 << 20  # --max-model-len 1048576

# DeepSeek-V4-Flash by hand (spec 1.1 / 1.3 / 8.1), 43 main layers, MTP not served, block 256:
#   layers 0,1 sliding only; 2,4,...,42 CSA (21); 3,5,...,41 HCA (20); every one of the 43 has a
#   128-token window. 2^20 tokens -> 2^20/4 = 262,144 CSA entries, 2^20/128 = 8,192 HCA entries,
#   2^20/256 = 4,096 blocks (64 CSA entries, 2 HCA entries per block: the compressed pools have no
#   rounding at this length). The sliding ring holds ceil(128/256) + 1 = 2 blocks = 512 positions.
#   Compressor state, fp32, kv + score of [c*r, c*d]: CSA main 2*8*1024*4 = 65,536 and CSA indexer
#   2*8*256*4 = 16,384 per CSA layer; HCA 2*128*512*4 = 524,288 per HCA layer (never rounded).
#
# fp8_ds_mla (584 B per token/entry, indexer 132 B):
#   sliding   43 * 512 * 584     =    12,857,344  (block-rounded; exact 43 * 128 * 584 = 3,214,336)
#   csa       21 * 262,144 * 584 = 3,214,934,016  (rounding adds nothing)
#   indexer   21 * 262,144 * 132 =   726,663,168
#   hca       20 * 8,192 * 584   =    95,682,560
#   csa_state 21 * 81,920        =     1,720,320
#   hca_state 20 * 524,288       =    10,485,760
#   total, block-rounded           4,062,343,168  (exact: 4,052,700,160)
FLASH_FP8 = {
    "sliding": (12_857_344, 3_214_336), "csa": (3_214_934_016,) * 2, "indexer": (726_663_168,) * 2,
    "hca": (95_682_560,) * 2, "csa_state": (1_720_320,) * 2, "hca_state": (10_485_760,) * 2,
}
# bf16 rows (1024 B): sliding 43*512*1024 = 22,544,384 (exact 43*128*1024 = 5,636,096);
# csa 21*262,144*1024 = 5,637,144,576; hca 20*8,192*1024 = 167,772,160; indexer 132 B on H200
# (726,663,168) or 256 B where the GPU has no fp8: 21*262,144*256 = 1,409,286,144.
FLASH_BF16 = {
    "sliding": (22_544_384, 5_636_096), "csa": (5_637_144_576,) * 2, "indexer": (726_663_168,) * 2,
    "hca": (167_772_160,) * 2, "csa_state": (1_720_320,) * 2, "hca_state": (10_485_760,) * 2,
}


# float32 rows (4 x 512 = 2048 B per token/entry; indexer keys 4 x 128 = 512 B):
#   sliding   43 * 512 * 2048     =     45,088,768  (exact 43 * 128 * 2048 = 11,272,192)
#   csa       21 * 262,144 * 2048 = 11,274,289,152
#   indexer   21 * 262,144 * 512  =  2,818,572,288
#   hca       20 * 8,192 * 2048   =    335,544,320
#   state as above; total, block-rounded 14,485,700,608
FLASH_FP32 = {
    "sliding": (45_088_768, 11_272_192), "csa": (11_274_289_152,) * 2, "indexer": (2_818_572_288,) * 2,
    "hca": (335_544_320,) * 2, "csa_state": (1_720_320,) * 2, "hca_state": (10_485_760,) * 2,
}


@pytest.mark.parametrize("spec,want,total", [
    (FP8, FLASH_FP8, 4_062_343_168), (BF16, FLASH_BF16, 6_566_330_368), (FP32, FLASH_FP32, 14_485_700_608),
])
def test_flash_bytes_per_sequence_at_1m(spec, want, total):
    pools = pool_usage(FLASH, spec, L, 256)
    got = {p.name: (p.bytes_per_seq, p.bytes_per_seq_exact) for p in pools}
    assert got == want
    assert sum(p.bytes_per_seq for p in pools) == total
    layers = {p.name: p.layers for p in pools}
    assert layers == {"sliding": 43, "csa": 21, "indexer": 21, "hca": 20, "csa_state": 21, "hca_state": 20}


def test_flash_bf16_indexer_without_fp8():
    pools = {p.name: p for p in pool_usage(FLASH, BF16_A100, L)}
    assert pools["indexer"].bytes_per_seq == 1_409_286_144


def test_block_rounding_and_mtp():
    # 1000 tokens: 4 blocks of 256 = 1024 positions; CSA 250 entries exact, 256 block-rounded.
    pools = {p.name: p for p in pool_usage(FLASH, FP8, 1000, 256, num_mtp_layers=1)}
    assert pools["csa"].bytes_per_seq_exact == 21 * 250 * 584 and pools["csa"].bytes_per_seq == 21 * 256 * 584
    assert pools["hca"].bytes_per_seq_exact == 20 * 7 * 584 and pools["hca"].bytes_per_seq == 20 * 8 * 584
    assert pools["sliding"].layers == 44  # the MTP layer is a sliding layer with its own window
    assert pools["sliding"].bytes_per_seq == 44 * 2 * 256 * 584
    short = {p.name: p for p in pool_usage(FLASH, FP8, 100, 256)}
    assert short["sliding"].bytes_per_seq == 43 * 256 * 584  # one block is all a 100-token sequence needs
    assert short["sliding"].bytes_per_seq_exact == 43 * 100 * 584


def test_capacity_from_memory_tp_vs_dp():
    # 100 GiB devices at 0.9 with 20 GiB of weights: 70 GiB = 75,161,927,680 B of KV per device;
    # 75,161,927,680 // 4,062,343,168 = 18 sequences of 1M tokens per rank.
    tp = plan_capacity(FLASH, FP8, max_model_len=L, device_memory_bytes=100 * GiB, gpu_memory_utilization=0.9,
                       weight_bytes=20 * GiB, mesh=MeshShape(tensor_parallel=8))
    assert tp.kv_budget_bytes == 70 * GiB and tp.bytes_per_seq == 4_062_343_168
    assert (tp.max_seqs_per_rank, tp.max_concurrent_seqs) == (18, 18)  # KV replicated over the 8 TP ranks
    dp = plan_capacity(FLASH, FP8, max_model_len=L, device_memory_bytes=100 * GiB, gpu_memory_utilization=0.9,
                       weight_bytes=20 * GiB, mesh=MeshShape(data_parallel=8))
    assert (dp.max_seqs_per_rank, dp.max_concurrent_seqs) == (18, 144)
    # 18 slots hold 18 * (12,857,344 + 12,206,080) B of windows and state; the rest is compressed
    # blocks of 21*64*584 + 21*64*132 + 20*2*584 = 985,664 B: (70 GiB - 451,141,632) // 985,664.
    assert tp.num_seq_slots == 18 and tp.num_blocks == {"sliding": 36, "compressed": 75_797}
    bf16 = plan_capacity(FLASH, BF16, max_model_len=L, device_memory_bytes=100 * GiB, weight_bytes=20 * GiB)
    assert bf16.max_seqs_per_rank == 75_161_927_680 // 6_566_330_368 == 11
    # float32: 75,161,927,680 // 14,485,700,608 = 5 sequences; a slot holds 45,088,768 + 12,206,080 B of
    # window and state, a compressed block 21*64*2048 + 21*64*512 + 20*2*2048 = 3,522,560 B:
    # (75,161,927,680 - 5 * 57,294,848) // 3,522,560 = 21,255 blocks.
    fp32 = plan_capacity(FLASH, FP32, max_model_len=L, device_memory_bytes=100 * GiB, weight_bytes=20 * GiB)
    assert fp32.num_seq_slots == fp32.max_seqs_per_rank == 5
    assert fp32.num_blocks == {"sliding": 10, "compressed": 21_255}
    assert sum(p.bytes_per_block for p in fp32.pools if p.name in ("csa", "indexer", "hca")) == 3_522_560


def test_capacity_with_max_num_seqs():
    plan = plan_capacity(FLASH, FP8, max_model_len=L, device_memory_bytes=100 * GiB, weight_bytes=20 * GiB,
                         max_num_seqs=256)
    # 256 slots * 25,063,424 B = 6,416,236,544. Their 512 sliding blocks make the e4m3 NoPE plane
    # 43 layers * 512 * 256 positions * 448 = 2,524,971,008 elements: 2 to 4 GiB, which the Pallas
    # kernels would index with wrapping int32 offsets. 2**32 // (512 * 256 * 448) + 1 = 74 layers
    # take it past 4 GiB: 31 idle layers of 58,720,256 B = 1,820,327,936 B. Then
    # (75,161,927,680 - 6,416,236,544 - 1,820,327,936) // 985,664 = 67,898 compressed blocks (no
    # compressed plane in the band there: the HCA NoPE plane is 20 * 67,898 * 2 * 448 = 1.2e9);
    # 67,898 // 4,096 = 16 sequences of 1M tokens at once (many more short ones).
    assert plan.num_seq_slots == 256 and plan.num_blocks == {"sliding": 512, "compressed": 67_898}
    assert plan.max_seqs_per_rank == 16
    with pytest.raises(ValueError, match="--max-num-seqs"):
        plan_capacity(FLASH, FP8, max_model_len=L, device_memory_bytes=100 * GiB, weight_bytes=20 * GiB,
                      max_num_seqs=100_000)


@pytest.mark.parametrize("elements, itemsize, wraps", [
    (2**31, 1, False), (2**31 + 1, 1, True), (2**32, 1, True), (2**32 + 1, 1, False),  # > 2**32 B: int64
    (2**31 + 1, 2, False), (2**30, 4, False),
])
def test_which_kernel_operands_wrap_int32_offsets(elements, itemsize, wraps):
    """JAX's Triton lowering indexes an operand of at most 2**32 bytes with int32 element offsets:
    only 1-byte elements can pass offset 2**31 - 1 there (an illegal memory access on an H200)."""
    from pallas_kernels import formats

    assert formats.wraps_int32_offsets(elements, itemsize) == wraps
    layers = 3
    extra = formats.idle_layers(layers, -(-elements // layers), itemsize)
    assert (extra > 0) == formats.wraps_int32_offsets(layers * -(-elements // layers), itemsize)
    assert not formats.wraps_int32_offsets((layers + extra) * -(-elements // layers), itemsize)
    if extra:  # just enough: one layer fewer would still be in the band
        assert formats.wraps_int32_offsets((layers + extra - 1) * -(-elements // layers), itemsize)


def _planned_cache(config, plan, **layout_changes):
    import dataclasses

    from dsv4_jax.kv_cache.paged import PagedCacheLayout, abstract_paged_cache

    return abstract_paged_cache(dataclasses.replace(PagedCacheLayout.from_plan(config, plan), **layout_changes))


def _wrapping_planes(cache, ranks=1):
    """Planes whose share on one of `ranks` data-parallel ranks (split along the block axis) a
    kernel would index with wrapping offsets."""
    import jax

    from pallas_kernels import formats

    return [(x.shape, str(x.dtype)) for x in jax.tree.leaves(cache)
            if formats.wraps_int32_offsets(math.prod(x.shape) // ranks, x.dtype.itemsize)]


def test_planes_of_2_to_4_gib_of_one_byte_elements_get_idle_layers():
    """`python -m serve` on an H200 sized the built-in model's pools at 2,435,006 compressed blocks:
    its UE8M0 scale plane (2 CSA layers x 64 entries x 8 bytes per block) held 2.49e9 elements,
    which a kernel reaches with wrapping int32 offsets (an H200 hit an illegal memory access on
    such a plane). Such planes now get idle layers that take them past 4 GiB, and the planner
    counts those bytes in the budget."""
    from dsv4_jax.kv_cache.paged import cache_nbytes
    from dsv4_jax.kv_cache.planner import idle_layer_bytes

    tiny = get_config("dsv4-tiny")
    spec = resolve_kv_cache("auto", "NVIDIA H200", None, config=tiny)
    memory, weights, reserved = int(69.90 * GiB), int(0.07 * GiB), int(3077.3 * 2**20)  # the H200 run's log
    plan = plan_capacity(tiny, spec, max_model_len=1024, device_memory_bytes=memory, weight_bytes=weights,
                         reserved_bytes=reserved, max_num_seqs=8)
    n = plan.num_blocks["compressed"]
    cache = _planned_cache(tiny, plan)
    # 2 CSA layers x n blocks x 64 entries x 8 bytes: 2**32 // (n * 512) + 1 layers pass 4 GiB.
    assert cache.compressed.csa.scales.shape == (2**32 // (n * 512) + 1, n, 64, 8)
    assert cache.compressed.csa.nope.shape[0] == 2 and cache.compressed.indexer.keys.shape[0] == 2  # > 4 GiB already
    assert not _wrapping_planes(cache)
    idle = idle_layer_bytes(plan.pools, spec, plan.num_blocks["sliding"], n)
    assert idle == (cache.compressed.csa.scales.shape[0] - 2) * n * 512
    assert cache_nbytes(cache) <= plan.kv_budget_bytes + 2**20  # + the block tables, which the plan leaves out
    # Without the idle layers the same memory would hold more blocks, with that plane in the band.
    per_block = sum(p.bytes_per_block for p in plan.pools if p.name in ("csa", "indexer", "hca"))
    per_slot = sum(p.bytes_per_seq for p in plan.pools if p.name in ("sliding", "csa_state", "hca_state"))
    unpadded = (plan.kv_budget_bytes - 8 * per_slot) // per_block
    assert 2**31 < 2 * 64 * 8 * unpadded <= 2**32
    assert n < unpadded and 8 * per_slot + n * per_block + idle <= plan.kv_budget_bytes
    # Data-parallel ranks lie side by side along the block axis: each rank's share decides.
    assert not _wrapping_planes(_planned_cache(tiny, plan, num_compressed_blocks=2 * n, data_parallel=2), ranks=2)
    assert _wrapping_planes(_planned_cache(tiny, plan, num_compressed_blocks=2 * n), ranks=2)  # sized as one rank
    # A plane below 2 GiB or past 4 GiB gets none (bf16 rows are 2-byte elements: never).
    small = plan_capacity(tiny, spec, max_model_len=1024, device_memory_bytes=8 * GiB, max_num_seqs=8)
    assert idle_layer_bytes(small.pools, spec, 16, small.num_blocks["compressed"]) == 0
    bf16 = resolve_kv_cache("bfloat16", "NVIDIA H200", None, config=tiny)
    wide = plan_capacity(tiny, bf16, max_model_len=1024, device_memory_bytes=memory, max_num_seqs=8)
    assert idle_layer_bytes(wide.pools, bf16, 16, wide.num_blocks["compressed"]) == 0


def test_idle_layers_keep_the_most_blocks_below_a_band_edge_and_sliding_only_models_plan():
    """Idle layers come and go as a plane crosses its band, so the most blocks can lie just below a
    band edge (review: a first version stepped down from the top and kept 118,985 blocks of dsv4-tiny
    at 42.5 GiB, where 2**31 // (2 x 64 x 64) = 262,144 fit with no idle layer at all). A model with
    sliding layers only has no compressed pool and still plans."""
    from dsv4_jax.config import DeepseekV4Config
    from dsv4_jax.kv_cache.planner import idle_layer_bytes

    tiny = get_config("dsv4-tiny")
    spec = resolve_kv_cache("auto", "NVIDIA H200", None, config=tiny)
    plan = plan_capacity(tiny, spec, max_model_len=1024, device_memory_bytes=int(42.5 * GiB))
    assert plan.num_blocks["compressed"] == 2**31 // (2 * 64 * 64)  # the CSA NoPE / indexer key planes' edge
    assert idle_layer_bytes(plan.pools, spec, plan.num_blocks["sliding"], plan.num_blocks["compressed"]) == 0
    assert not _wrapping_planes(_planned_cache(tiny, plan))
    sliding_only = DeepseekV4Config.from_json("tests/fixtures/golden/hc4_sliding_only/checkpoint/config.json")
    only = plan_capacity(sliding_only, resolve_kv_cache("auto", "NVIDIA H200", None, config=sliding_only),
                         max_model_len=256, device_memory_bytes=8 * GiB, max_num_seqs=8)
    assert only.num_seq_slots == 8 and only.num_blocks["compressed"] == 0


def test_num_gpu_blocks_override_in_the_band_gets_idle_layers():
    from types import SimpleNamespace

    from dsv4_jax.engine.args import EngineArgs
    from dsv4_jax.engine.builder import _layout
    from dsv4_jax.kv_cache.paged import abstract_paged_cache

    tiny = get_config("dsv4-tiny")
    spec = resolve_kv_cache("auto", "NVIDIA H200", None, config=tiny)
    plan = plan_capacity(tiny, spec, max_model_len=1024, device_memory_bytes=8 * GiB, max_num_seqs=8)
    config = SimpleNamespace(model_config=tiny, max_model_len=1024, args=EngineArgs(num_gpu_blocks_override=2_200_000))
    layout = _layout(config, plan)
    cache = abstract_paged_cache(layout)
    assert layout.num_compressed_blocks == 2_200_000 and cache.compressed.csa.scales.shape[0] == 4
    assert not _wrapping_planes(cache)


def test_cpu_pools_sized_from_max_num_seqs():
    tiny = get_config("dsv4-tiny-test")
    spec = resolve_kv_cache("fp8", "cpu", None, config=tiny)
    plan = plan_capacity(tiny, spec, max_model_len=1000, device_memory_bytes=None, max_num_seqs=3, block_size=128)
    # 3 * 1000 positions -> ceil(3000 / 128) = 24 blocks, plus one per sequence: 27. Window 8 -> ring of 2.
    assert plan.sized_from == "max_num_seqs"
    assert plan.num_blocks == {"sliding": 6, "compressed": 27} and plan.max_concurrent_seqs == 3
    with pytest.raises(ValueError, match="--max-num-seqs"):
        plan_capacity(tiny, spec, max_model_len=1000, device_memory_bytes=None)


def test_max_model_len_that_cannot_fit_one_sequence():
    with pytest.raises(ValueError) as err:
        plan_capacity(FLASH, FP8, max_model_len=L, device_memory_bytes=10 * GiB, weight_bytes=6 * GiB)
    message = str(err.value)
    assert "--max-model-len 1048576" in message and "3.78 GiB" in message and "3.00 GiB" in message
    suggested = int(message.split("Pass --max-model-len ")[1].split()[0])
    assert suggested == max_model_len_that_fits(FLASH, FP8, 3 * GiB) and suggested % 256 == 0
    assert plan_capacity(FLASH, FP8, max_model_len=suggested, device_memory_bytes=10 * GiB,
                         weight_bytes=6 * GiB).max_seqs_per_rank == 1
    with pytest.raises(ValueError):
        plan_capacity(FLASH, FP8, max_model_len=suggested + 256, device_memory_bytes=10 * GiB, weight_bytes=6 * GiB)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        plan_capacity(FLASH, FP8, max_model_len=2 * L, device_memory_bytes=1000 * GiB)


@pytest.mark.parametrize("bad", [0, 100, 192, 64])
def test_block_size_must_hold_whole_entries(bad):
    with pytest.raises(ValueError, match="--block-size"):
        pool_usage(FLASH, FP8, L, bad)


def test_bad_mesh_and_flags():
    for kwargs in ({"tensor_parallel": 0}, {"data_parallel": -1}, {"tensor_parallel": 4, "expert_parallel": 3}):
        with pytest.raises(ValueError):
            MeshShape(**kwargs)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        plan_capacity(FLASH, FP8, max_model_len=L, device_memory_bytes=GiB, gpu_memory_utilization=1.5)


def test_weight_estimate():
    total = sum(weight_bytes_breakdown(FLASH).values())
    # 43 layers x 256 experts x 3 x 2048 x 4096 MXFP4 weights (0.5 B + 1/32 B of scale each) = 147.2 GB,
    # plus fp8 attention and bf16 embedding/head: about 156 GB for the whole checkpoint.
    assert 150e9 < total < 165e9
    experts = weight_bytes_breakdown(FLASH)["experts"]
    assert experts == 43 * 256 * 3 * (2048 * 4096 // 2 + 2048 * 4096 // 32)
    tp8 = estimate_weight_bytes_per_device(FLASH, MeshShape(tensor_parallel=8))
    dp8 = estimate_weight_bytes_per_device(FLASH, MeshShape(data_parallel=8))
    assert math.ceil(experts / 8) < tp8 < dp8 < total / 4  # DP attention replicates the attention weights


def test_plan_cli(capsys):
    argv = ["--model", "dsv4-flash", "--device-kind", "NVIDIA H200", "--num-devices", "8",
            "--kv-cache-dtype", "auto", "--max-model-len", "1048576"]
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "fp8_ds_mla on pallas_fp8_ds_mla" in out
    assert "3,874.2 (3,865.0)" in out  # fp8_ds_mla MiB per 1M-token sequence (4,062,343,168 B)
    assert "6,262.1 (6,246.0)" in out  # bf16 rows
    rows = [line for line in out.splitlines() if line.startswith(("fp8_ds_mla*", "bfloat16"))]
    assert len(rows) == 4
    assert sum("tensor-parallel (KV replicated) tp=8 dp=1" in r for r in rows) == 2
    assert sum("data-parallel tp=1 dp=8" in r for r in rows) == 2
    assert "idle layers GiB/dev" in out

    # Idle layers, per rank: V4-Flash with 256 sequences on a 100 GiB device holding 20 GiB of weights
    # (test_capacity_with_max_num_seqs): 31 idle layers of its sliding NoPE plane, 1.70 GiB.
    assert plan_cli.main(["--model", "dsv4-flash", "--device-kind", "NVIDIA H200", "--max-model-len", "1048576",
                          "--max-num-seqs", "256", "--weight-gib", "20", "--device-memory-gib", "100"]) == 0
    fp8_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fp8_ds_mla*"))
    assert " 1.70 " in fp8_row, fp8_row

    with pytest.raises(SystemExit) as exit_:  # as `python -m dsv4_jax.plan` runs it
        run_main(plan_cli.main, argv[:-1] + ["4194304"], prog="python -m dsv4_jax.plan")
    assert exit_.value.code == 2 and "--max-model-len" in capsys.readouterr().err
    assert plan_cli.main(["--device-kind", "NVIDIA A100-SXM4-80GB", "--num-devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16*" in out and "fp8_ds_mla (xla, emulated)" in out


def test_plan_cli_float32(capsys):
    argv = ["--device-kind", "NVIDIA H200", "--num-devices", "8", "--kv-cache-dtype", "float32"]
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "--kv-cache-dtype float32 -> float32 on xla" in out
    assert "13,814.6 (13,782.4)" in out  # float32 MiB per 1M-token sequence (14,485,700,608 B)
    assert "3,874.2 (3,865.0)" in out and "6,262.1 (6,246.0)" in out  # compared with fp8_ds_mla and bf16 rows
    assert len([line for line in out.splitlines() if line.startswith("float32*")]) == 2
    with pytest.raises(SystemExit) as exit_:
        run_main(plan_cli.main, argv + ["--attention-backend", "pallas_fp8_ds_mla"], prog="python -m dsv4_jax.plan")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--attention-backend xla" in err and len(err.strip().splitlines()) == 1


MiB = 1024**2


@pytest.mark.parametrize("kind,mib", [
    ("NVIDIA GH200 480GB", 97871),  # 96 GB HBM3 (the 480GB is Grace's LPDDR5X)
    ("NVIDIA GH200 144G HBM3e", 146831),
    ("NVIDIA GH200 144GB HBM3e", 146831),
    ("NVIDIA GH200", 97871),  # unsure which: the conservative 96 GB
    ("NVIDIA GB200", 189471),
    ("NVIDIA H200", 143771), ("NVIDIA H200 NVL", 143771), ("NVIDIA B200", 183359), ("NVIDIA H20", 97871),
    ("NVIDIA H100 80GB HBM3", 81559), ("NVIDIA H100 NVL", 95830), ("NVIDIA A100-PCIE-40GB", 40960),
])
def test_nominal_device_memory(kind, mib):
    assert nominal_device_memory(kind) == mib * MiB


def test_plan_cli_on_grace_superchips(capsys):
    for kind, gib in (("NVIDIA GH200 480GB", "95.6"), ("NVIDIA GB200", "185.0")):
        argv = ["--device-kind", kind, "--num-devices", "4", "--max-model-len", "1048576"]
        assert plan_cli.main(argv) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert f"4 x {kind}, {gib} GiB each" in out and "fp8_ds_mla on pallas_fp8_ds_mla" in out


def test_plan_cli_leaves_out_a_layout_the_models_shapes_leave_undefined(tmp_path, capsys):
    """head_dim 40 with 8 RoPE dims: 32 NoPE dims are no whole fp8_ds_mla block of 64, so the plan
    has bf16 rows only (the resolver's auto picks bfloat16 there) instead of refusing the model."""
    import json

    config = get_config("dsv4-tiny-test").replace(head_dim=40, qk_rope_head_dim=8)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    assert plan_cli.main(["--model", str(path), "--max-model-len", "1024"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith(("fp8", "bfloat16"))]
    assert rows == ["bfloat16*"]


def test_prefix_cache_snapshots_come_out_of_the_kv_budget_before_the_blocks():
    """The snapshots' bytes are subtracted like the weights: the pools get that much less, and a
    budget they leave too small names --num-prefix-snapshots."""
    args = dict(max_model_len=8192, device_memory_bytes=100 * GiB, weight_bytes=20 * GiB, max_num_seqs=16)
    plain = plan_capacity(FLASH, FP8, **args)
    with_snapshots = plan_capacity(FLASH, FP8, **args, snapshot_bytes=5 * GiB)
    assert plain.kv_budget_bytes - with_snapshots.kv_budget_bytes == 5 * GiB
    assert with_snapshots.num_blocks["compressed"] < plain.num_blocks["compressed"]
    with pytest.raises(ValueError, match="prefix-cache snapshots"):
        plan_capacity(FLASH, FP8, **args, snapshot_bytes=70 * GiB)
