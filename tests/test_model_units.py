"""Unit tests of the model's own pieces: config parsing, KV rounding known answers, indexer
tie-breaking, token-id checks, the MoE's FLOPs, and the abstract DeepSeek-V4-Flash build."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4_jax.weights.checkpoint import checkpoint_layout
from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.model import kv_rounding, layers
from dsv4_jax.model.indexer import Indexer, select_visible_topk
from dsv4_jax.model.layers import Linear
from dsv4_jax.model.moe import MoE
from dsv4_jax.model.transformer import DeepseekV4, check_token_ids, layer_kinds, plan_segments
from dsv4_jax.presets import dsv4_flash, dsv4_tiny_test, get_config

# ---- config ---------------------------------------------------------------------------------

FLASH_CONFIG_JSON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "initializer_range": 0.02, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True,
}


def test_real_flash_config_parses_to_the_preset():
    config = DeepseekV4Config.from_dict(FLASH_CONFIG_JSON)
    assert config == dsv4_flash()
    assert len(config.compress_ratios) == 44 and config.compress_ratio(43) == 0  # MTP entry: sliding
    assert config.layer_types[:5] == ("sliding", "sliding", "csa", "hca", "csa")
    assert config.rope_scaling.factor == 16 and config.quantization.scale_fmt == "ue8m0"
    assert DeepseekV4Config.from_dict(config.to_dict()) == config
    hash(config)  # frozen and hashable: usable as a static jit argument


def test_transformers_config_parses(golden_dir):
    raw = json.loads((golden_dir / "hc3_long_yarn" / "checkpoint" / "config.json").read_text())
    config = DeepseekV4Config.from_dict(raw)
    assert config.layer_types == ("hca", "csa", "sliding", "csa")
    assert config.num_hash_layers == 1 and config.hc_mult == 3
    assert config.rope_scaling.enabled and config.rope_scaling.factor == raw["rope_parameters"]["compress"]["factor"]
    assert config.compress_ratio(0) == raw["compress_rates"]["heavily_compressed_attention"]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"index_head_dim": 16}, "index_head_dim"),  # < qk_rope_head_dim 32
        ({"o_groups": 3}, "o_groups"),  # 4 heads
        ({"compress_ratios": [0, 4]}, "compress_ratios"),  # shorter than num_hidden_layers
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"compress_ratios": [0, 1, 128, 4, 0]}, "compress_ratios"),
        ({"scoring_func": "relu"}, "scoring_func"),
    ],
)
def test_inconsistent_configs_name_the_field(change, field):
    raw = {**dsv4_tiny_test().to_dict(), **change}
    with pytest.raises(ValueError, match=field):
        DeepseekV4Config.from_dict(raw)


def test_small_unusual_configs_are_accepted():
    raw = {**dsv4_tiny_test().to_dict(), "compress_ratios": [0, 3, 7, 3], "csa_compress_ratio": 3,
           "hc_mult": 2, "hc_sinkhorn_iters": 3, "head_dim": 40, "qk_rope_head_dim": 8, "index_head_dim": 8}
    config = DeepseekV4Config.from_dict(raw)
    assert config.layer_types == ("sliding", "csa", "hca", "csa")


def test_get_config_accepts_objects_names_and_dicts():
    assert get_config("dsv4-tiny-test") == dsv4_tiny_test()
    assert get_config(dsv4_tiny_test().to_dict()) == dsv4_tiny_test()
    with pytest.raises(ValueError, match="unknown model preset"):
        get_config("dsv4-nope")


# ---- KV rounding known answers (spec 3.8 / 8.2) ------------------------------------------------


def test_fp8_block_quantize_known_answers():
    block = np.zeros(64, np.float32)
    block[:5] = [1.0, 0.3, -0.3, 1e-3, -1.0]
    codes, exponent = kv_rounding.fp8_block_quantize(jnp.asarray(block))
    # amax 1.0 -> scale 2^ceil(log2(1/448)) = 2^-8, stored as the UE8M0 byte 127 - 8 = 119.
    assert int(exponent[0]) + 127 == 119
    # 1.0 / 2^-8 = 256 = 1.0 * 2^8 -> E4M3 0 1111 000; 0.3 * 256 = 76.8 -> 80 = 1.25 * 2^6 -> 0 1101 010;
    # 1e-3 * 256 = 0.256 -> 0.25 = 2^-2 -> 0 0101 000; the sign is the top bit.
    assert list(np.asarray(codes).view(np.uint8)[:5]) == [0x78, 0x6A, 0xEA, 0x28, 0xF8]
    back = np.asarray(kv_rounding.fp8_block_round_trip(jnp.asarray(block)))
    np.testing.assert_array_equal(back[:5], [1.0, 0.3125, -0.3125, 2.0**-10, -1.0])


def test_fp8_block_amax_floor_and_large_values():
    zeros = jnp.zeros(64)
    _, exponent = kv_rounding.fp8_block_quantize(zeros)
    assert int(exponent[0]) == int(np.ceil(np.log2(1e-4 / 448)))  # amax floored at 1e-4: -22
    np.testing.assert_array_equal(np.asarray(kv_rounding.fp8_block_round_trip(zeros)), 0.0)
    big = jnp.full((64,), 1280.0)  # scale 2^ceil(log2(1280/448)) = 4; 320 is on the E4M3 grid
    _, exponent = kv_rounding.fp8_block_quantize(big)
    assert int(exponent[0]) == 2 and float(kv_rounding.fp8_block_round_trip(big)[0]) == 1280.0
    tie = jnp.full((64,), 1344.0)  # 336 lies halfway between 320 and 352: ties go to even (320)
    assert float(kv_rounding.fp8_block_round_trip(tie)[0]) == 1280.0


def test_kv_cache_round_trip_rounds_nope_to_fp8_and_rope_to_bf16():
    kv = jnp.concatenate([jnp.full((64,), 0.3), jnp.full((32,), 1.0 + 2.0**-10)])
    out = np.asarray(kv_rounding.kv_cache_round_trip(kv, rope_dim=32))
    np.testing.assert_array_equal(out[:64], 0.3125)  # 0.3 * 2^8 = 76.8 -> 80 on the E4M3 grid
    np.testing.assert_array_equal(out[64:], 1.0)  # 1 + 2^-10 is below bf16's half-ulp at 1.0


def test_indexer_keys_use_one_scale_per_key():
    keys = jnp.asarray(np.linspace(-3, 3, 128, dtype=np.float32))
    codes, exponent = kv_rounding.fp8_block_quantize(keys, block=128)
    assert exponent.shape == (1,) and int(exponent[0]) == int(np.ceil(np.log2(3 / 448)))
    np.testing.assert_array_equal(np.asarray(kv_rounding.indexer_key_round_trip(keys)),
                                  np.asarray(kv_rounding.fp8_block_round_trip(keys, block=128)))


# ---- indexer selection ----------------------------------------------------------------------


def test_topk_ties_go_to_the_lowest_index_and_never_depend_on_later_entries():
    ratio, topk = 2, 3
    scores = jnp.zeros((1, 12, 6))  # every score tied (ReLU zeros with few indexer heads)
    idx = np.asarray(select_visible_topk(scores, ratio, topk))[0]
    # query t sees entries j < (t + 1) // 2; ties pick the lowest indices; unseen picks are -1.
    for t in range(12):
        visible = (t + 1) // ratio
        expected = list(range(min(visible, topk))) + [-1] * (topk - min(visible, topk))
        assert list(idx[t]) == expected
    # Appending more (tied) entries never changes what an earlier query picks.
    longer = np.asarray(select_visible_topk(jnp.zeros((1, 12, 40)), ratio, topk))[0]
    np.testing.assert_array_equal(longer[:, :topk], idx)


def test_topk_prefers_higher_scores_among_visible_only():
    scores = jnp.asarray([[[0.1, 0.9, 0.5, 9.0]]] * 1).repeat(8, axis=1)
    idx = np.asarray(select_visible_topk(scores, ratio=2, topk=2))[0]
    assert list(idx[1]) == [0, -1]  # one visible entry
    assert list(idx[5]) == [1, 2]  # entry 3 (9.0) is not visible yet
    assert list(idx[7]) == [3, 1]


def test_indexer_picks_the_top_scoring_visible_entries():
    """The Indexer module end to end against spec 3.7 in float64 numpy: score(t, j) =
    sum_h relu(q_th . k_j) * w_th * index_head_dim^-0.5 * index_n_heads^-0.5, top-k over the
    entries visible at t, -1 where fewer are visible. RoPE is the identity here (cos 1, sin 0)."""
    config = dsv4_tiny_test().replace(index_topk=3)
    heads, dim, ratio, seq = config.index_n_heads, config.index_head_dim, 4, 24  # 6 entries > top-k 3
    indexer = Indexer(config, ratio)
    rng = np.random.default_rng(7)
    for linear in (indexer.wq_b, indexer.weights_proj, indexer.compressor.wkv, indexer.compressor.wgate):
        out_features, in_features = linear.weight[...].shape
        linear.weight.set_value(jnp.asarray(rng.standard_normal((out_features, in_features), np.float32) / 8))
    x = rng.standard_normal((1, seq, config.hidden_size)).astype(np.float32)
    latent = rng.standard_normal((1, seq, config.q_lora_rank)).astype(np.float32)
    cos = jnp.ones((seq, config.qk_rope_head_dim // 2))
    picked = np.asarray(indexer(jnp.asarray(x), jnp.asarray(latent), cos, jnp.zeros_like(cos)))[0]

    keys = np.asarray(indexer.compressor(jnp.asarray(x), cos, jnp.zeros_like(cos)), np.float64)[0]  # [6, dim]
    q = (latent[0].astype(np.float64) @ np.asarray(indexer.wq_b.weight[...], np.float64).T).reshape(seq, heads, dim)
    w = x[0].astype(np.float64) @ np.asarray(indexer.weights_proj.weight[...], np.float64).T * (dim * heads) ** -0.5
    scores = np.einsum("thn,th->tn", np.maximum(np.einsum("thd,nd->thn", q, keys), 0), w)
    for t in range(seq):
        visible = (t + 1) // ratio
        best = list(np.argsort(-scores[t, :visible], kind="stable")[:3])
        assert list(picked[t]) == best + [-1] * (3 - len(best)), t
    assert (picked[:11] == -1).any()  # the first queries see fewer than 3 entries: -1 slots


def test_token_ids_outside_the_vocabulary_raise():
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        check_token_ids(np.array([[1, 512]]), 512)
    with pytest.raises(ValueError):
        check_token_ids(np.array([[-1, 3]]), 512)
    check_token_ids(np.array([[0, 511]]), 512)


# ---- MoE cost -------------------------------------------------------------------------------


def _moe_flops(n_experts: int, tokens: int) -> float:
    config = dsv4_tiny_test().replace(n_routed_experts=n_experts, num_hash_layers=0)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(config, hash_routed=False)))

    def run(state, x, ids):
        return nnx.merge(graphdef, state)(x, ids)

    x = jax.ShapeDtypeStruct((1, tokens, config.hidden_size), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    cost = jax.jit(run).lower(state, x, ids).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


@pytest.mark.parametrize("tokens", [3, 6])  # decode-sized: fewer pairs than twice the experts
def test_moe_flops_do_not_grow_with_the_number_of_experts(tokens, monkeypatch):
    # The batched tiles (GPUs): XLA's cost analysis sees them all. CPUs run loops whose trip
    # counts it cannot see (test_expert_loop_runs_only_used_tiles).
    monkeypatch.setattr("dsv4_jax.model.moe.cpu_loop", lambda: False)
    small, large = _moe_flops(8, tokens), _moe_flops(16, tokens)
    config = dsv4_tiny_test()
    useful = 3 * 2 * tokens * config.num_experts_per_tok * config.hidden_size * config.moe_intermediate_size
    shared = 3 * 2 * tokens * config.hidden_size * config.moe_intermediate_size
    router_growth = 2 * tokens * 8 * config.hidden_size  # the router is tokens x experts x hidden
    # The routed matmuls are counted, and far less than running every token through all 8 experts
    # (4x useful); XLA also counts about one op per gathered weight element (+0.5x here).
    assert useful <= small - shared <= 2 * useful
    assert large - small <= 1.5 * router_growth  # doubling the experts adds only router work


@pytest.mark.parametrize("pairs", [8, 100, 800, 4096, 24576])
def test_expert_tiles_keep_matmul_rows_independent_of_the_expert_count(pairs):
    """At prefill sizes each expert's rows are padded to whole tiles; the padded matmul rows stay
    within 2 x pairs and do not grow when the expert count doubles."""
    from dsv4_jax.model.moe import tile_plan

    rows = {}
    for experts in (8, 16, 256, 512):
        tile, n_tiles = tile_plan(pairs, experts)
        rows[experts] = tile * n_tiles
        assert pairs <= rows[experts] <= 2 * pairs + tile
    for experts in (8, 256):
        assert rows[2 * experts] <= rows[experts] or rows[2 * experts] <= pairs + 2 * experts


# ---- the real model, abstractly ---------------------------------------------------------------


def test_flash_builds_abstractly_with_stacked_layers():
    config = dsv4_flash()
    plan = plan_segments(layer_kinds(config))
    assert [(s.first, s.period, s.count) for s in plan] == [(0, 1, 2), (2, 1, 1), (3, 2, 20)]
    model = nnx.eval_shape(lambda: DeepseekV4(config))
    _, state = nnx.split(model)
    device_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
    layout = checkpoint_layout(config)
    itemsize = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 4}  # tid2eid lives as int32
    file_bytes = sum(int(np.prod(t.shape)) * itemsize[t.dtype] for t in layout.values())
    assert device_bytes == file_bytes  # every tensor kept as stored: nothing dequantised or widened
    main = {k: t for k, t in layout.items() if not k.startswith("mtp.")}
    n_params = sum(int(np.prod(t.shape)) * (2 if t.dtype == "I8" else 1)  # MXFP4: 2 values a byte
                   for k, t in main.items() if not k.endswith(".scale"))
    assert 280e9 < n_params < 290e9  # 284B (spec 1.4)
    assert 140e9 < file_bytes < 170e9  # about 150 GB as stored, against about 570 GB in bf16


def _lowered_size(repetitions: int) -> int:
    raw = {**dsv4_tiny_test().to_dict(), "num_hidden_layers": 1 + 2 * repetitions,
           "compress_ratios": [0] + [128, 4] * repetitions, "num_nextn_predict_layers": 0}
    config = DeepseekV4Config.from_dict(raw)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV4(config)))

    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids)

    ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    return len(jax.jit(forward).lower(state, ids).as_text())


def test_program_size_does_not_grow_with_stacked_depth():
    """Repeated (HCA, CSA) layers run under one scan: 8 repetitions lower to the same program as 2."""
    two, eight = _lowered_size(2), _lowered_size(8)
    assert eight < 1.02 * two


@pytest.mark.parametrize("on_cpu", [False, True], ids=["gpu-schedule", "cpu-schedule"])
@pytest.mark.parametrize(
    "tokens,expert_format",
    # GPU schedule: 2 or 8 pairs over 8 experts: 1-row tiles; 64 or 80 pairs: 8-row tiles; 800
    # pairs: 64-row tiles. CPU loop: 2 to 64 pairs: 8-row tiles; 80 and 800 pairs: 16- and 128-row
    # tiles (the crowded expert's rows span tiles).
    [(1, None), (4, None), (32, None), (40, None), (400, None), (40, "fp4"), (40, "fp8"), (32, "fp8")],
)
def test_grouped_expert_matmul_equals_a_plain_loop(tokens, expert_format, on_cpu, monkeypatch):
    from dsv4_jax.model import weight_formats as wfmt
    from dsv4_jax.model import moe
    from dsv4_jax.model.moe import RoutedExperts, swiglu, tile_plan
    from dsv4_jax.presets import quantized

    monkeypatch.setattr(moe, "cpu_loop", lambda: on_cpu)
    ran = []
    for name in ("_run_tiles_one_at_a_time", "_run_used_tiles"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))

    config = dsv4_tiny_test()
    if expert_format:
        config = quantized(config, expert_dtype=expert_format)
    experts = RoutedExperts(config)
    rng = np.random.default_rng(0)
    e, d, f = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    dense = {"w1": rng.normal(size=(e, f, d)) / np.sqrt(d), "w3": rng.normal(size=(e, f, d)) / np.sqrt(d),
             "w2": rng.normal(size=(e, d, f)) / np.sqrt(f)}
    for name, w in dense.items():
        w = w.astype(np.float32)
        if expert_format == "fp4":
            packed, scale = zip(*(wfmt.quantize_mxfp4(m) for m in w))
            dense[name] = np.stack([wfmt.dequantize_mxfp4_np(p, s) for p, s in zip(packed, scale)])
            getattr(experts, name).weight.set_value(jnp.asarray(np.stack(packed)))
            getattr(experts, name).scale.set_value(jnp.asarray(np.stack(scale)))
        elif expert_format == "fp8":
            q, scale = zip(*(wfmt.quantize_fp8_blocks(m) for m in w))
            dense[name] = np.stack([wfmt.dequantize_fp8_blocks_np(a, b) for a, b in zip(q, scale)])
            getattr(experts, name).weight.set_value(jnp.asarray(np.stack(q)))
            getattr(experts, name).scale.set_value(jnp.asarray(np.stack(scale)))
        else:
            getattr(experts, name).weight.set_value(jnp.asarray(w))
    w1, w2, w3 = (np.asarray(dense[n], np.float64) for n in ("w1", "w2", "w3"))
    x = rng.normal(size=(tokens, d)).astype(np.float32)
    picks = np.stack([rng.choice(e, 2, replace=False) for _ in range(tokens)]).astype(np.int32)
    picks[: tokens // 2, 0] = 3  # a crowded expert: several tiles of one expert
    weights = rng.random((tokens, 2)).astype(np.float32)
    # One compiled call (eagerly, every op of the schedule compiled on its own: ~30 per case).
    got = np.asarray(jax.jit(lambda *a: experts(*a, 1.0))(jnp.asarray(x), jnp.asarray(picks), jnp.asarray(weights)))
    want = np.zeros((tokens, d))
    for t in range(tokens):
        for k in range(2):
            i = picks[t, k]
            h = np.asarray(swiglu(jnp.asarray(w1[i] @ x[t]), jnp.asarray(w3[i] @ x[t]), 1.0), np.float64)
            want[t] += weights[t, k] * (w2[i] @ h)
    tiles = {1: 8, 4: 8, 32: 8, 40: 16, 400: 128} if on_cpu else {1: 1, 4: 1, 32: 8, 40: 8, 400: 64}
    assert tile_plan(tokens * 2, config.n_routed_experts, on_cpu)[0] == tiles[tokens]
    assert ran == ["_run_tiles_one_at_a_time" if on_cpu else "_run_used_tiles"]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_expert_loop_runs_only_used_tiles(monkeypatch):
    """The CPU loop makes as many iterations as there are tiles holding pairs (whole tiles per
    expert), not the planned count (a possible tile for every expert), with pairs for under half
    the experts and for more than all of them, and equals the plain per-pair sum; padding tokens'
    pairs run in no tile."""
    from dsv4_jax.model import moe

    config = dsv4_tiny_test()
    e, d, f = 64, config.hidden_size, config.moe_intermediate_size
    trips, real_fori = [], jax.lax.fori_loop

    def counting_fori(lower, upper, body, init):
        trips.append(int(upper))  # eager: the trip count is concrete
        return real_fori(lower, upper, body, init)

    monkeypatch.setattr(jax.lax, "fori_loop", counting_fori)
    rng = np.random.default_rng(0)
    dense = [rng.normal(size=s).astype(np.float32) / np.sqrt(s[-1]) for s in ((e, f, d), (e, d, f), (e, f, d))]
    stored = tuple((jnp.asarray(w), None) for w in dense)

    def run(tokens, padding=0):
        picks = np.stack([rng.choice(np.arange(2, e), 2, replace=False) for _ in range(tokens)]).astype(np.int32)
        picks[:, 0] = 1  # expert 1 takes a pair of every token
        picks[tokens - padding:] = e  # padding tokens (MoE's `valid`): id e, an expert stored nowhere
        x = rng.normal(size=(tokens, d)).astype(np.float32)
        got = moe.grouped_experts(jnp.asarray(x), jnp.asarray(picks), jnp.ones(picks.shape, jnp.float32), stored,
                                  fmt=None, block=None, limit=0.0, n_experts=e, first=0, on_cpu=True)
        want = np.zeros((tokens, d))  # padding tokens: nothing
        for t, k in zip(*np.nonzero(picks < e)):
            w1, w2, w3 = (w[picks[t, k]].astype(np.float64) for w in dense)
            h = np.asarray(moe.swiglu(jnp.asarray(w1 @ x[t]), jnp.asarray(w3 @ x[t]), 0.0), np.float64)
            want[t] += w2 @ h
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)
        return np.bincount(picks[picks < e], minlength=e)

    # 30 pairs, under half the 64 experts: the loop; expert 1's 12 real pairs take two tiles, and
    # the 3 padding tokens' 6 pairs take none.
    counts = run(15, padding=3)
    tile, planned = moe.tile_plan(30, e, on_cpu=True)
    assert tile == moe.CPU_MIN_TILE and counts[1] > tile
    assert trips == [int(np.sum(-(-counts // tile)))] and trips[0] < planned
    trips.clear()
    counts = run(40)  # 80 pairs over 64 experts (a decode-sized step): 8-row tiles, expert 1's 40 take five
    tile, planned = moe.tile_plan(80, e, on_cpu=True)
    assert tile == moe.CPU_MIN_TILE and -(-counts[1] // tile) == 5
    assert trips == [int(np.sum(-(-counts // tile)))] and trips[0] < planned


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_head_logits_read_a_bf16_weight_as_stored(transposed):
    """Float32 logits from a bf16 head, float32-accurate for bf16 and float32 activations, with no
    float32 copy of the weight in the compiled step (that copy was ~30 ms of a ~34 ms CPU decode
    step). Row counts on both sides of the CPU's limits: one bf16 row (padded to two), more bf16
    rows than XLA:CPU's fast dot takes (one dot still), and float32 rows below and above the most
    its three bf16 slices serve (above: the weight is converted for the call). Both layouts: the
    checkpoint's [out, in] and the vocabulary head's transposed [in, out]."""
    head = Linear(64, 1000, get_config("dsv4-tiny-test"), quantized=False, transposed=transposed)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((1000, 64)).astype(jnp.bfloat16)
    assert head.weight.shape == ((64, 1000) if transposed else (1000, 64))
    head.weight[...] = jnp.asarray(weight.T if transposed else weight)
    sliced = layers.CPU_SLICED_MAX_ROWS
    xs = (
        rng.standard_normal((3, sliced // 3, 64)).astype(np.float32),
        rng.standard_normal((1, 1, 64)).astype(jnp.bfloat16),
        rng.standard_normal((70, 64)).astype(jnp.bfloat16),
    )
    graphdef, state = nnx.split(head)
    logits = jax.jit(lambda s, *vs: tuple(nnx.merge(graphdef, s).float32(v) for v in vs))
    for x, got in zip(xs, logits(state, *xs), strict=True):
        want = x.astype(np.float64) @ weight.astype(np.float64).T
        got = np.asarray(got)
        assert got.dtype == np.float32 and got.shape == (*x.shape[:-1], 1000)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert not {"f32[1000,64]", "f32[64,1000]"} & set(re.findall(r"f32\[\d+,\d+\]", logits.lower(state, *xs).compile().as_text()))
    above = rng.standard_normal((sliced + 1, 64)).astype(np.float32)
    want = above.astype(np.float64) @ weight.astype(np.float64).T
    np.testing.assert_allclose(np.asarray(jax.jit(head.float32)(above)), want, rtol=0, atol=2e-6 * np.abs(want).max())
