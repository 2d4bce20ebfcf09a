"""benchmarks/runner.py without running a model (nothing compiles): its flags, the table row it
derives from step timings, and the mid-size config's claim to keep DeepSeek-V4-Flash's proportions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from dsv4_jax.config import CSA, HCA, SLIDING
from dsv4_jax.presets import get_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    # Loaded from its file: benchmarks/ is a folder of scripts, not an installed package.
    spec = importlib.util.spec_from_file_location("benchmarks_runner", REPO / "benchmarks" / "runner.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_flags_have_the_documented_defaults_and_bad_values_name_the_flag(bench, capsys):
    args = bench.parse_args([])
    assert (args.model, args.kv_cache_dtype, args.batch_sizes, args.json) == ("both", "auto", [1, 8, 32], None)
    assert bench.parse_args(["--batch-sizes", "32,1,8,8"]).batch_sizes == [1, 8, 32]
    for flag, value in (("--batch-sizes", "1,x"), ("--batch-sizes", "0,8"), ("--repeats", "-2"), ("--model", "big")):
        with pytest.raises(SystemExit) as exit_info:
            bench.parse_args([flag, value])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and value in err, err


def test_a_row_holds_medians_of_each_part_and_tokens_per_second_of_the_median_step(bench):
    # (build, device_put, host, device) seconds of three steps of 8 decode rows.
    parts = [(0.001, 0.002, 0.010, 0.100), (0.003, 0.001, 0.030, 0.300), (0.002, 0.004, 0.020, 0.200)]
    row = bench.summarise("mid", "decode", "bfloat16 on xla", (8, 1), 8, [bench.StepTiming(*p) for p in parts])
    # Medians by hand: step 0.11 / 0.33 / 0.22 s -> 220 ms; dispatch = host - build - put:
    # 7, 26, 14 ms -> 14 ms; 8 tokens / 0.22 s.
    assert row["step_ms"] == pytest.approx(220.0)
    assert (row["host_ms"], row["build_ms"], row["device_put_ms"]) == pytest.approx((20.0, 2.0, 2.0))
    assert (row["dispatch_ms"], row["device_ms"]) == pytest.approx((14.0, 200.0))
    assert row["tokens_per_s"] == pytest.approx(8 / 0.22)
    cells = [c.strip() for c in bench.table_line(row).strip("|").split("|")]
    assert len(cells) == len(bench.COLUMNS)
    assert cells[:5] == ["mid", "decode", "bfloat16 on xla", "8 x 1", "220.00"] and cells[-1] == "36.4"


def test_the_mid_config_keeps_flash_proportions(bench):
    flash, mid = get_config("dsv4-flash"), bench.mid_config()
    assert (mid.hidden_size, mid.num_hidden_layers) == (1024, 8)
    for ratio in (
        lambda c: c.num_attention_heads * c.head_dim / c.hidden_size,
        lambda c: c.num_attention_heads / c.o_groups,
        lambda c: c.moe_intermediate_size / c.hidden_size,
        lambda c: c.q_lora_rank / c.hidden_size,
    ):
        assert ratio(mid) == ratio(flash)
    same = ("head_dim", "qk_rope_head_dim", "o_lora_rank", "sliding_window", "num_experts_per_tok", "num_hash_layers",
            "hc_mult", "index_head_dim", "expert_dtype", "quantization")
    assert [getattr(mid, f) for f in same] == [getattr(flash, f) for f in same]
    # Flash: two sliding layers, then CSA and HCA alternating.
    assert mid.layer_types[:2] == flash.layer_types[:2] == (SLIDING, SLIDING)
    assert mid.layer_types[2:] == flash.layer_types[2 : mid.num_hidden_layers] == (CSA, HCA) * 3


def test_serve_checks_compile_summary_reads_jax_log_compiles_lines(tmp_path):
    """The GPU serving check's start-up row: per program its compiles, their longest and summed
    seconds, and XLA's rematerialization warnings (lines as the H200's log had them)."""
    spec = importlib.util.spec_from_file_location("benchmarks_serve_check", REPO / "benchmarks" / "serve_check.py")
    serve_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_check)
    compile_summary = serve_check.compile_summary
    log = tmp_path / "serve.log"
    log.write_text(
        "2026-12-04 18:06:17,070 WARNING jax._src.dispatch: Finished XLA compilation of jit(_step) in 15.543209791 sec\n"
        "W1204 18:06:27.884215     780 hlo_rematerialization.cc:3363] Can't reduce memory use below 69.48GiB\n"
        "2026-12-04 18:06:33,355 WARNING jax._src.dispatch: Finished XLA compilation of jit(_step) in 12.130897284 sec\n"
        "2026-12-04 18:07:25,881 WARNING jax._src.dispatch: Finished XLA compilation of jit(_sample) in 5.367656946 sec\n"
        "INFO:     127.0.0.1:42500 - \"GET /health HTTP/1.1\" 503 Service Unavailable\n")
    assert compile_summary(log) == ("jit(_step) 2 x, max 15.5 s, sum 27.7 s; jit(_sample) 1 x, max 5.4 s, sum 5.4 s; "
                                    "1 rematerialization warnings")
