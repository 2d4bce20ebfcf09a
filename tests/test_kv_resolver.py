"""`resolve_kv_cache`: the policy table of docs/kv_cache.md, cell by cell, on every listed device."""

from __future__ import annotations

import ast
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from dsv4_jax.kv_cache import (
    ACCEPTED_REQUESTS,
    ATTENTION_BACKENDS,
    FP8_DS_MLA_LOG,
    DEFAULT_COMPUTE_CAPABILITY,
    KVCacheSpec,
    lookup_compute_capability,
    nominal_device_memory,
    parse_compute_capability,
    resolve_for_device,
    resolve_kv_cache,
)
from dsv4_jax.presets import get_config
from pallas_kernels import devices, tuning

REPO = Path(__file__).resolve().parents[1]
LOGGER = "dsv4_jax.kv_cache.resolver"

# Real `jax.Device.device_kind` strings, their compute capability, and their class in the table.
DEVICES = {
    "fp8_gpu": [
        ("NVIDIA H100 80GB HBM3", "9.0"), ("NVIDIA H200", "9.0"), ("NVIDIA H20", "9.0"), ("NVIDIA H800", "9.0"),
        ("NVIDIA B200", "10.0"), ("NVIDIA GB200", "10.0"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "12.0"), ("NVIDIA GeForce RTX 5090", "12.0"),
        ("NVIDIA L40S", "8.9"),
    ],
    "bf16_gpu": [("NVIDIA A100-SXM4-80GB", "8.0"), ("NVIDIA A10", "8.6")],
    "legacy_gpu": [("Tesla T4", "7.5")],
    "cpu": [("cpu", None)],
    "tpu": [("TPU v5 lite", None)],
}
REQUEST_COLUMNS = {
    "auto": ("auto",), "fp8": ("fp8", "fp8_e4m3", "fp8_ds_mla"), "bf16": ("bfloat16", "bf16"),
    "float32": ("float32", "fp32"),
}


def policy_rows() -> list[tuple[str, str | None, str, str]]:
    """(class, backend or None, request, cell) for every cell of the table in docs/kv_cache.md."""
    text = (REPO / "docs" / "kv_cache.md").read_text()
    table = text.split("<!-- policy-table -->")[1].split("<!-- /policy-table -->")[0].strip().splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[2:] == ["`auto`", "`fp8`, `fp8_e4m3`, `fp8_ds_mla`", "`bfloat16`, `bf16`", "`float32`, `fp32`"]
    rows = []
    for line in table[2:]:
        cls, backend, *cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(REQUEST_COLUMNS), line
        for column, cell in zip(REQUEST_COLUMNS, cells):
            for request in REQUEST_COLUMNS[column]:
                rows.append((cls, None if backend == "unset" else backend, request, cell))
    return rows


ROWS = policy_rows()


def test_table_covers_every_class_backend_and_request():
    seen = {(c, b, r) for c, b, r, _ in ROWS}
    assert len(seen) == len(ROWS) == len(DEVICES) * (len(ATTENTION_BACKENDS) + 1) * len(ACCEPTED_REQUESTS)


@pytest.mark.parametrize("cls", list(DEVICES))
def test_policy_table(cls, caplog):
    calls = 0
    for device_class, backend, request, cell in ROWS:
        if device_class != cls:
            continue
        for kind, cc in DEVICES[cls]:
            for given_cc in {cc, None}:  # explicit, and read from our table of device kinds
                caplog.clear()
                where = f"{kind} cc={given_cc} {request} backend={backend}"
                with caplog.at_level(logging.INFO, logger=LOGGER):
                    if cell == "ValueError":
                        with pytest.raises(ValueError) as err:
                            resolve_kv_cache(request, kind, given_cc, backend)
                        message = str(err.value)
                        assert "--kv-cache-dtype" in message or "--attention-backend" in message, where
                        continue
                    spec = resolve_kv_cache(request, kind, given_cc, backend)
                calls += 1
                m = re.fullmatch(r"(\w+) on (\w+)( \+warning)?", cell)
                assert m, cell
                assert (spec.kv_cache_dtype, spec.attention_backend) == (m.group(1), m.group(2)), where
                assert spec.device_class == cls and spec.requested == request, where
                messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
                fp8_logs = [msg for _, msg in messages if msg == FP8_DS_MLA_LOG]
                assert len(fp8_logs) == (spec.kv_cache_dtype == "fp8_ds_mla"), where
                assert bool(spec.warnings) == bool(m.group(3)), where
                assert [msg for lvl, msg in messages if lvl == logging.WARNING] == list(spec.warnings), where
                # One INFO summary per resolution (ending with the one-line reason), and the exact
                # fp8_ds_mla line as a record of its own.
                assert [msg for lvl, msg in messages if lvl == logging.INFO and msg != FP8_DS_MLA_LOG] == [
                    spec.summary()
                ], where
                assert spec.summary().endswith(spec.reason) and "\n" not in spec.reason, where
    assert calls


def test_fp8_request_on_ampere_names_device_capability_and_ways_out():
    with pytest.raises(ValueError) as err:
        resolve_kv_cache("fp8", "NVIDIA A100-SXM4-80GB", "8.0")
    message = str(err.value)
    for part in ("NVIDIA A100-SXM4-80GB", "8.0", "--kv-cache-dtype bfloat16", "--attention-backend xla"):
        assert part in message


def test_bfloat16_on_hopper_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        spec = resolve_kv_cache("bfloat16")
    assert (spec.kv_cache_dtype, spec.attention_backend) == ("bfloat16", "pallas_bf16")
    assert "--kv-cache-dtype bfloat16" in spec.reason and spec.reason in caplog.text
    assert FP8_DS_MLA_LOG not in caplog.text


def test_mismatched_backend_errors_say_what_to_pass():
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8.*--attention-backend pallas_bf16"):
        resolve_kv_cache("bf16", attention_backend="pallas_fp8_ds_mla")
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16.*--attention-backend pallas_fp8_ds_mla"):
        resolve_kv_cache("fp8_e4m3", attention_backend="pallas_bf16")


@pytest.mark.parametrize("backend", ["pallas_fp8_ds_mla", "pallas_bf16"])
@pytest.mark.parametrize("kind,cc", [("NVIDIA H200", "9.0"), ("cpu", None)])
def test_float32_with_a_pallas_backend_says_what_to_pass(backend, kind, cc):
    with pytest.raises(ValueError) as err:
        resolve_kv_cache("float32", kind, cc, backend)
    message = str(err.value)
    for part in ("--kv-cache-dtype float32", f"--attention-backend {backend}", "pass --attention-backend xla",
                 "fp8_ds_mla, bfloat16"):
        assert part in message, message


def test_float32_is_the_exact_reference_cache_on_xla():
    # 4 x head_dim per KV row and 4 x index_head_dim per indexer key: Flash 4*512 and 4*128.
    spec = resolve_kv_cache("FP32", "NVIDIA H200")
    assert (spec.kv_cache_dtype, spec.indexer_dtype, spec.attention_backend) == ("float32", "float32", "xla")
    p = spec.pool_bytes
    assert (spec.bytes_per_token, p.sliding_per_token, p.csa_per_entry, p.hca_per_entry) == (2048,) * 4
    assert p.indexer_per_entry == 512 and (p.csa_state_per_seq, p.hca_state_per_seq) == (65536, 524288)
    assert not spec.emulated and "float32" in spec.summary() and "--kv-cache-dtype fp32" in spec.warnings[0]
    tiny = resolve_kv_cache("float32", "cpu", None, config="dsv4-tiny-test")  # head_dim 96, index_head_dim 64
    assert (tiny.bytes_per_token, tiny.pool_bytes.indexer_per_entry, tiny.warnings) == (4 * 96, 4 * 64, ())
    # auto never picks it, on any device class
    for kind in ("NVIDIA H200", "NVIDIA A10", "Tesla T4", "cpu", "TPU v5 lite"):
        assert resolve_kv_cache("auto", kind, None).kv_cache_dtype != "float32", kind


@pytest.mark.parametrize("bad", ["fp16", "FP8_E5M2", "", 8, "auto,fp8"])
def test_unknown_request_lists_accepted_values(bad):
    with pytest.raises(ValueError) as err:
        resolve_kv_cache(bad)
    assert "--kv-cache-dtype" in str(err.value)
    assert all(v in str(err.value) for v in ACCEPTED_REQUESTS)


def test_requests_are_case_insensitive_and_none_is_auto():
    assert resolve_kv_cache("BF16").kv_cache_dtype == "bfloat16"
    assert resolve_kv_cache(None).kv_cache_dtype == "fp8_ds_mla"


@pytest.mark.parametrize("bad", ["flashmla", "FLASHMLA_SPARSE", "pallas"])
def test_unknown_backend_lists_the_three(bad):
    with pytest.raises(ValueError) as err:
        resolve_kv_cache("auto", attention_backend=bad)
    assert "--attention-backend" in str(err.value)
    assert all(b in str(err.value) for b in ATTENTION_BACKENDS)


def test_unknown_device_kind():
    with pytest.raises(ValueError, match="compute_capability"):
        resolve_kv_cache("auto", "Mystery Accelerator 9000", None)
    assert resolve_kv_cache("auto", "Mystery Accelerator 9000", "9.0").kv_cache_dtype == "fp8_ds_mla"
    assert resolve_kv_cache("auto", "Mystery Accelerator 9000", "sm_86").kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="compute capability"):
        resolve_kv_cache("auto", "Mystery Accelerator 9000", "nine")
    with pytest.raises(ValueError, match="device_kind"):
        resolve_kv_cache("auto", "")


# Real `device_kind` strings (as nvidia-smi / JAX report them) and their compute capability.
DEVICE_KINDS = {
    "NVIDIA H100 80GB HBM3": "9.0", "NVIDIA H100 PCIe": "9.0", "NVIDIA H100 NVL": "9.0",
    "NVIDIA GH200 480GB": "9.0", "NVIDIA GH200 144G HBM3e": "9.0", "NVIDIA H20": "9.0", "NVIDIA H800": "9.0",
    "NVIDIA H800 PCIe": "9.0", "NVIDIA H200": "9.0", "NVIDIA H200 NVL": "9.0",
    "NVIDIA B200": "10.0", "NVIDIA GB200": "10.0", "NVIDIA B300 SXM6 AC": "10.3", "NVIDIA GB300": "10.3",
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition": "12.0",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": "12.0",
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition": "12.0",
    "NVIDIA RTX PRO 5000 Blackwell": "12.0", "NVIDIA GeForce RTX 5090": "12.0", "NVIDIA GeForce RTX 5080": "12.0",
    "NVIDIA GeForce RTX 5070 Ti": "12.0", "NVIDIA GeForce RTX 5060": "12.0", "NVIDIA GB10": "12.1",
    "NVIDIA L40S": "8.9", "NVIDIA L40": "8.9", "NVIDIA L4": "8.9", "NVIDIA L20": "8.9",
    "NVIDIA GeForce RTX 4090": "8.9", "NVIDIA GeForce RTX 4060 Laptop GPU": "8.9",
    "NVIDIA RTX 6000 Ada Generation": "8.9", "NVIDIA RTX 5000 Ada Generation": "8.9",
    "NVIDIA RTX 5880 Ada Generation": "8.9", "NVIDIA RTX 4000 Ada Generation": "8.9",
    "NVIDIA RTX 4000 SFF Ada Generation": "8.9", "NVIDIA RTX 2000 Ada Generation": "8.9",
    "NVIDIA A100-SXM4-80GB": "8.0", "NVIDIA A100-PCIE-40GB": "8.0", "NVIDIA A100 80GB PCIe": "8.0",
    "NVIDIA A800-SXM4-80GB": "8.0", "NVIDIA A30": "8.0",
    "NVIDIA A10": "8.6", "NVIDIA A10G": "8.6", "NVIDIA A40": "8.6", "NVIDIA A16": "8.6", "NVIDIA A2": "8.6",
    "NVIDIA RTX A6000": "8.6", "NVIDIA RTX A5000": "8.6", "NVIDIA RTX A4000": "8.6", "NVIDIA RTX A2000": "8.6",
    "NVIDIA GeForce RTX 3090": "8.6", "NVIDIA GeForce RTX 3060 Ti": "8.6", "NVIDIA GeForce RTX 2050": "8.6",
    "Tesla T4": "7.5", "NVIDIA T4G": "7.5", "Quadro RTX 8000": "7.5", "Quadro RTX 6000": "7.5",
    "Quadro RTX 5000": "7.5", "Quadro RTX 4000": "7.5", "Quadro RTX 3000": "7.5", "NVIDIA TITAN RTX": "7.5",
    "NVIDIA GeForce RTX 2080 Ti": "7.5", "NVIDIA GeForce RTX 2060": "7.5",
    "Tesla V100-SXM2-16GB": "7.0", "NVIDIA TITAN V": "7.0", "Tesla P100-PCIE-16GB": "6.0", "Tesla P40": "6.1",
    "Tesla P4": "6.1",
}
# Kinds our table does not know (no default may turn them into Hopper).
UNKNOWN_KINDS = (
    "AMD Instinct MI300X", "NVIDIA GeForce GTX 1080 Ti", "gpu", "NVIDIA RTX 5000", "Mystery Accelerator 9000",
)


def test_device_kind_patterns():
    assert {kind: lookup_compute_capability(kind) for kind in DEVICE_KINDS} == DEVICE_KINDS
    assert {kind: lookup_compute_capability(kind) for kind in UNKNOWN_KINDS} == dict.fromkeys(UNKNOWN_KINDS)


def test_every_row_of_the_device_table_is_reachable():
    # First match wins, so a row shadowed by an earlier, broader one ("NVIDIA GH200" before the
    # 144 GB part, "GeForce RTX 50x0" before the 5090) never matches its own devices.
    names = [row.name for row in devices.DEVICE_KINDS]
    assert len(set(names)) == len(names)
    for row in devices.DEVICE_KINDS:
        for kind in (row.name, *row.examples, f"  {row.name.upper()} "):
            assert devices.lookup(kind) is row, (kind, row.name, getattr(devices.lookup(kind), "name", None))


def test_resolver_planner_and_tuning_agree_on_every_row():
    want_class = {(True, True): "fp8_gpu", (True, False): "bf16_gpu", (False, False): "legacy_gpu"}
    for row in devices.DEVICE_KINDS:
        for kind in (row.name, *row.examples):
            assert lookup_compute_capability(kind) == row.compute_capability, kind
            assert nominal_device_memory(kind) == (row.memory_mib and row.memory_mib * 2**20), kind
            assert tuning.canonical_device_kind(kind) == row.name, kind
            assert tuning.device_info(kind).sm_count == row.sm_count, kind
            if row.compute_capability is None:  # the host: interpret mode
                assert kind == "cpu" and tuning.kernel_config("kv_write", kind) == tuning.kernel_config(
                    "kv_write", interpret=True)
                continue
            spec = resolve_kv_cache("auto", kind, None)
            assert spec.compute_capability == row.compute_capability, kind
            assert spec.device_class == want_class[row.runs_pallas, row.has_fp8], kind
            assert spec.kv_cache_dtype == ("fp8_ds_mla" if row.has_fp8 else "bfloat16"), kind


@pytest.mark.parametrize("kind,cc", [("Quadro RTX 5000", "7.5"), ("NVIDIA RTX 5000 Ada Generation", "8.9"),
                                     ("NVIDIA RTX A6000", "8.6")])
def test_users_correct_capability_is_not_overridden(kind, cc, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        spec = resolve_kv_cache("auto", kind, cc)
        assert resolve_kv_cache("auto", kind).compute_capability == cc  # from the table
    assert spec.compute_capability == cc and "disagrees" not in caplog.text
    assert spec.kv_cache_dtype == ("fp8_ds_mla" if cc == "8.9" else "bfloat16")


def test_default_capability_never_makes_a_known_device_fp8(caplog):
    # The signature's default compute_capability "9.0" belongs to its default H200: for a kind our
    # table knows, the table's value is used, without a warning (the user gave none).
    assert DEFAULT_COMPUTE_CAPABILITY == "9.0"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        spec = resolve_kv_cache("auto", device_kind="NVIDIA A100-SXM4-80GB")
    assert (spec.kv_cache_dtype, spec.compute_capability) == ("bfloat16", "8.0")
    assert not caplog.records
    # An explicit disagreeing value for a known kind: the table wins, with a warning.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        spec = resolve_kv_cache("auto", "NVIDIA A100-SXM4-80GB", "9.0")
    assert (spec.kv_cache_dtype, spec.compute_capability) == ("bfloat16", "8.0")
    assert "disagrees" in caplog.text


def test_signature_default_is_9_0():
    import inspect

    params = inspect.signature(resolve_kv_cache).parameters
    assert list(params) == ["requested", "device_kind", "compute_capability", "attention_backend", "config"]
    assert params["device_kind"].default == "NVIDIA H200" and params["compute_capability"].default == "9.0"
    assert params["attention_backend"].default is None and params["config"].default is None
    spec = resolve_kv_cache("auto")
    assert (spec.device_kind, spec.compute_capability, spec.kv_cache_dtype) == ("NVIDIA H200", "9.0", "fp8_ds_mla")


@pytest.mark.parametrize("kind", UNKNOWN_KINDS)
def test_unknown_kind_with_default_capability_is_an_error(kind):
    # No live device of this kind here, and the default "9.0" does not count as given.
    with pytest.raises(ValueError) as err:
        resolve_kv_cache("auto", kind)
    message = str(err.value)
    assert repr(kind) in message and "compute_capability" in message
    with pytest.raises(ValueError, match="compute_capability"):
        resolve_kv_cache("bfloat16", device_kind=kind, attention_backend="xla")
    # An explicit value for an unknown kind is used as given.
    assert resolve_kv_cache("auto", kind, "9.0").kv_cache_dtype == "fp8_ds_mla"
    assert resolve_kv_cache("auto", kind, "8.0").kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize("value,want", [
    ("9.0", (9, 0)), ("8.9", (8, 9)), ("12.0", (12, 0)), ("10.3", (10, 3)), (" 8.6 ", (8, 6)), ("9", (9, 0)),
    (9, (9, 0)), (9.0, (9, 0)), (8.9, (8, 9)), (12.1, (12, 1)), ((8, 6), (8, 6)),
    ("sm_90", (9, 0)), ("sm90", (9, 0)), ("sm_120a", (12, 0)), ("sm_100f", (10, 0)), ("SM_89", (8, 9)),
])
def test_parse_compute_capability(value, want):
    assert parse_compute_capability(value) == want


@pytest.mark.parametrize("bad", [
    "8.90000001", "8.10", "8.09", "9.", ".9", "9.0.1", "-9.0", "nine", "", 8.899999, 8.90000001, float("nan"),
    float("inf"), True, None, (8, 10), (8, -1), (8.0, 9), ("8", "9"), (9,), [9, 0],
])
def test_parse_compute_capability_rejects(bad):
    with pytest.raises(ValueError, match="compute_capability"):
        parse_compute_capability(bad)


def test_malformed_capability_is_an_error_even_for_known_kinds():
    # "8.10" once read as (8, 10) >= (8, 9) and made an fp8 device of an unknown kind.
    with pytest.raises(ValueError, match="compute_capability '8.10'"):
        resolve_kv_cache("auto", "Mystery Accelerator 9000", "8.10")
    with pytest.raises(ValueError, match="compute_capability '8.90000001'"):
        resolve_kv_cache("auto", "NVIDIA A100-SXM4-80GB", "8.90000001")


@pytest.mark.parametrize("kind,request_,fp8", [("NVIDIA H200", "auto", True), ("NVIDIA A10", "auto", False),
                                              ("cpu", "fp8", True), ("cpu", "auto", False)])
def test_summary_logged_once_and_fp8_line_on_its_own(kind, request_, fp8, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        spec = resolve_kv_cache(request_, kind, None)
    records = [r for r in caplog.records if r.name == LOGGER]
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert infos.count(spec.summary()) == 1
    assert infos.count(FP8_DS_MLA_LOG) == int(fp8)
    assert sorted(infos) == sorted([spec.summary()] + [FP8_DS_MLA_LOG] * fp8)
    assert spec.summary().startswith("KV cache: ") and spec.reason in spec.summary()


def test_spec_carries_bytes_of_every_pool():
    spec = resolve_kv_cache("auto")
    assert isinstance(spec, KVCacheSpec)
    assert spec.bytes_per_token == 584 and spec.indexer_dtype == "fp8"
    p = spec.pool_bytes
    assert (p.sliding_per_token, p.csa_per_entry, p.hca_per_entry, p.indexer_per_entry) == (584, 584, 584, 132)
    # fp32 kv_state + score_state of [c*r, c*d]: CSA main 2*8*1024*4, CSA indexer 2*8*256*4, HCA 2*128*512*4
    assert (p.csa_state_per_seq, p.csa_indexer_state_per_seq, p.hca_state_per_seq) == (65536, 16384, 524288)
    assert "\n" not in spec.summary() and "fp8_ds_mla" in spec.summary()
    assert spec.to_dict()["pool_bytes"]["indexer_per_entry"] == 132

    bf16 = resolve_kv_cache("auto", "NVIDIA A10", "8.6")
    assert (bf16.bytes_per_token, bf16.indexer_dtype, bf16.pool_bytes.indexer_per_entry) == (1024, "bfloat16", 256)
    assert resolve_kv_cache("bfloat16").pool_bytes.indexer_per_entry == 132  # fp8 indexer where cc >= 8.9

    tiny = resolve_kv_cache("fp8", "cpu", None, config=get_config("dsv4-tiny-test"))
    assert (tiny.bytes_per_token, tiny.pool_bytes.indexer_per_entry) == (64 + 2 * 32 + 8, 64 + 4)
    assert tiny.indexer_dtype == "fp8" and tiny.emulated
    assert resolve_kv_cache("auto", "cpu", None, config="dsv4-tiny-test").bytes_per_token == 2 * 96


def test_resolve_for_device():
    cpu = resolve_for_device("auto", jax.devices("cpu")[0])
    assert (cpu.device_class, cpu.kv_cache_dtype, cpu.attention_backend) == ("cpu", "bfloat16", "xla")
    h200 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")
    assert resolve_for_device("auto", h200).attention_backend == "pallas_fp8_ds_mla"
    # The live device's own capability wins over our table.
    odd = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="8.0")
    assert resolve_for_device("auto", odd).kv_cache_dtype == "bfloat16"
    tpu = SimpleNamespace(platform="tpu", device_kind="v5 lite")
    assert resolve_for_device("auto", tpu).device_class == "tpu"


def test_no_assert_statements_on_user_input():
    for path in ("dsv4_jax/kv_cache/resolver.py", "dsv4_jax/kv_cache/planner.py", "dsv4_jax/kv_cache/paged.py",
                 "dsv4_jax/plan.py", "pallas_kernels/formats.py"):
        tree = ast.parse((REPO / path).read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Assert)], path


def test_import_touches_no_device():
    code = (
        "import dsv4_jax.kv_cache, dsv4_jax.plan, pallas_kernels.formats\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "import sys; bad = {'torch', 'flax'} & set(sys.modules); assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# ---- model shapes the Pallas kernels cannot tile (issue 41) ---------------------------------------
# head_dim 40 = 28 NoPE + 12 RoPE: no fp8_ds_mla layout (whole 64-dim NoPE blocks) and no dim chunks
# of either kernel format; 48 = 32 + 16 fits pallas_bf16 only; 72 = 64 + 8 has the fp8_ds_mla layout
# but neither kernel format's chunks; 24 heads do not split into 16-head blocks.
TINY = get_config("dsv4-tiny-test")
HEAD_DIM_40 = TINY.replace(head_dim=40, qk_rope_head_dim=12)
HEAD_DIM_48 = TINY.replace(head_dim=48, qk_rope_head_dim=16)
HEAD_DIM_72 = TINY.replace(head_dim=72, qk_rope_head_dim=8)
HEADS_24 = TINY.replace(num_attention_heads=24, o_groups=2)


def _resolve_logged(caplog, *args, **kwargs):
    """The spec and the resolver's (level, message) records."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        spec = resolve_kv_cache(*args, **kwargs)
    return spec, [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("kind,cc", [("NVIDIA H200", "9.0"), ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "12.0"),
                                     ("NVIDIA A100-SXM4-80GB", "8.0")])
@pytest.mark.parametrize("config,field", [(HEAD_DIM_40, "`head_dim`"), (HEADS_24, "`num_attention_heads`")])
def test_auto_falls_back_to_xla_with_one_info_line_saying_why(caplog, kind, cc, config, field):
    spec, records = _resolve_logged(caplog, "auto", kind, cc, config=config)
    assert (spec.kv_cache_dtype, spec.attention_backend, spec.warnings) == ("bfloat16", "xla", ())
    assert records == [(logging.INFO, spec.summary())]  # the one line, ending with why
    assert field in spec.reason and "falls back to the xla backend" in spec.reason
    assert resolve_kv_cache("bf16", kind, cc, config=config).attention_backend == "xla"  # the device's choice too


def test_auto_on_an_fp8_gpu_takes_pallas_bf16_where_only_its_kernels_fit(caplog):
    spec, records = _resolve_logged(caplog, "auto", "NVIDIA H200", config=HEAD_DIM_48)
    assert (spec.kv_cache_dtype, spec.attention_backend, spec.indexer_dtype) == ("bfloat16", "pallas_bf16", "fp8")
    assert records == [(logging.INFO, spec.summary())]
    assert "32 NoPE dims must be a multiple of 64" in spec.reason and "pallas_fp8_ds_mla" in spec.reason
    assert spec.bytes_per_token == 2 * 48


@pytest.mark.parametrize("backend", ["pallas_fp8_ds_mla", "pallas_bf16"])
@pytest.mark.parametrize("kind,cc", [("NVIDIA H200", "9.0"), ("cpu", None)])
def test_an_explicit_pallas_backend_names_the_config_field_and_the_constraint(backend, kind, cc):
    with pytest.raises(ValueError) as err:
        resolve_kv_cache("auto", kind, cc, backend, config=HEAD_DIM_72)
    message = str(err.value)
    field = "`qk_rope_head_dim` = 8 must be a multiple of 16" if backend == "pallas_fp8_ds_mla" else (
        "`head_dim` = 72 must be a multiple of 16")
    for part in (f"--attention-backend {backend} cannot run this model", field, "Pass --attention-backend xla"):
        assert part in message, message
    with pytest.raises(ValueError, match="`num_attention_heads` = 24 must be a multiple of 16"):
        resolve_kv_cache("auto", kind, cc, backend, config=HEADS_24)


@pytest.mark.parametrize("request_", ["fp8", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("backend", [None, "xla", "pallas_fp8_ds_mla"])
def test_fp8_for_nope_dims_not_in_64_dim_blocks_says_what_to_pass(request_, backend):
    """Spec 8.2 quantises the NoPE dims in whole 64-dim blocks (the official QAT asserts it, and
    the model's KV rounding rounds exactly those): fp8_ds_mla is undefined for 28 NoPE dims."""
    with pytest.raises(ValueError) as err:
        resolve_kv_cache(request_, "cpu", None, backend, config=HEAD_DIM_40)
    message = str(err.value)
    for part in (f"--kv-cache-dtype {request_}", "blocks of 64", "40 - 12 = 28", "pass --kv-cache-dtype bfloat16"):
        assert part in message, message


def test_every_request_on_xla_serves_a_shape_no_kernel_tiles():
    for request_, dtype in (("auto", "bfloat16"), ("bf16", "bfloat16"), ("float32", "float32")):
        for config in (HEAD_DIM_40, HEAD_DIM_72, HEADS_24):
            spec = resolve_kv_cache(request_, "cpu", None, config=config)
            assert (spec.kv_cache_dtype, spec.attention_backend) == (dtype, "xla")
    # 64 NoPE dims: fp8_ds_mla is defined, emulated on xla; on an fp8 GPU its kernels' 16-dim RoPE
    # chunks do not fit 8 dims, so the device's pallas_fp8_ds_mla falls back to xla, fp8 kept.
    assert resolve_kv_cache("fp8", "cpu", None, config=HEAD_DIM_72).emulated
    gpu = resolve_kv_cache("fp8", "NVIDIA H200", config=HEAD_DIM_72)
    assert (gpu.kv_cache_dtype, gpu.attention_backend) == ("fp8_ds_mla", "xla")
    assert "`qk_rope_head_dim` = 8" in gpu.reason
    cpu = resolve_for_device("auto", jax.devices("cpu")[0], config=HEAD_DIM_40)
    assert (cpu.kv_cache_dtype, cpu.attention_backend) == ("bfloat16", "xla")
    with pytest.raises(ValueError, match="`head_dim` = 40"):
        resolve_for_device("auto", jax.devices("cpu")[0], "pallas_bf16", config=HEAD_DIM_40)
