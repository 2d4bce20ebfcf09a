"""Checkpoint layout (spec 7.1), the alias table, the safetensors reader, the loader's checks,
MTP handling, progress output, and the random checkpoint writer."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dsv4_jax.model import weight_formats as W
from dsv4_jax.weights.checkpoint import (
    SafetensorsFile,
    TensorSpec,
    canonical_name,
    checkpoint_layout,
    load_checkpoint,
    open_checkpoint,
    plan_checkpoint,
)
from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.presets import get_config, quantized
from dsv4_jax.testing import random_state, random_tensor, write_random_checkpoint

TINY = "dsv4-tiny-test"
GOLDEN = Path(__file__).parent / "fixtures" / "golden"


@pytest.fixture(scope="module")
def flash_layout():
    return checkpoint_layout(get_config("dsv4-flash"))


@pytest.fixture(scope="module")
def tiny_state():
    """(config, tensors) of the unquantized tiny-test checkpoint, built once."""
    return random_state(TINY, seed=0)


def _write(path: Path, config: DeepseekV4Config, tensors: dict, shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    names = list(tensors)
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / (f"part{i}.safetensors" if shards > 1 else "model.safetensors")))
    return path


def _load(path, config=None, **kw):
    got = {}
    report = load_checkpoint(path, config, lambda n, a: got.__setitem__(n, a), **kw)
    return got, report


def _never(name, array):
    raise AssertionError(f"put({name!r}) called for an invalid checkpoint")


# ---- layout ---------------------------------------------------------------------------------
def test_flash_layout_matches_spec_table(flash_layout):
    L = flash_layout
    expect = {
        "embed.weight": ((129280, 4096), "BF16"),
        "head.weight": ((129280, 4096), "BF16"),
        "norm.weight": ((4096,), "BF16"),
        "hc_head_fn": ((4, 16384), "F32"),
        "hc_head_base": ((4,), "F32"),
        "hc_head_scale": ((1,), "F32"),
        "layers.0.attn_norm.weight": ((4096,), "BF16"),
        "layers.0.hc_attn_fn": ((24, 16384), "F32"),
        "layers.0.hc_ffn_base": ((24,), "F32"),
        "layers.0.hc_ffn_scale": ((3,), "F32"),
        "layers.0.attn.wq_a.weight": ((1024, 4096), "F8_E4M3"),
        "layers.0.attn.wq_a.scale": ((8, 32), "F8_E8M0"),
        "layers.0.attn.q_norm.weight": ((1024,), "BF16"),
        "layers.0.attn.wq_b.scale": ((256, 8), "F8_E8M0"),
        "layers.0.attn.wkv.weight": ((512, 4096), "F8_E4M3"),
        "layers.0.attn.wkv.scale": ((4, 32), "F8_E8M0"),
        "layers.0.attn.kv_norm.weight": ((512,), "BF16"),
        "layers.0.attn.wo_a.weight": ((8192, 4096), "F8_E4M3"),
        "layers.0.attn.wo_a.scale": ((64, 32), "F8_E8M0"),
        "layers.0.attn.wo_b.weight": ((4096, 8192), "F8_E4M3"),
        "layers.0.attn.wo_b.scale": ((32, 64), "F8_E8M0"),
        "layers.0.attn.attn_sink": ((64,), "F32"),
        "layers.2.attn.compressor.wkv.weight": ((1024, 4096), "BF16"),
        "layers.2.attn.compressor.wgate.weight": ((1024, 4096), "BF16"),
        "layers.2.attn.compressor.ape": ((4, 1024), "F32"),
        "layers.2.attn.compressor.norm.weight": ((512,), "BF16"),
        "layers.3.attn.compressor.wkv.weight": ((512, 4096), "BF16"),
        "layers.3.attn.compressor.ape": ((128, 512), "F32"),
        "layers.2.attn.indexer.wq_b.weight": ((8192, 1024), "F8_E4M3"),
        "layers.2.attn.indexer.wq_b.scale": ((64, 8), "F8_E8M0"),
        "layers.2.attn.indexer.weights_proj.weight": ((64, 4096), "BF16"),
        "layers.2.attn.indexer.compressor.wkv.weight": ((256, 4096), "BF16"),
        "layers.2.attn.indexer.compressor.wgate.weight": ((256, 4096), "BF16"),
        "layers.2.attn.indexer.compressor.ape": ((4, 256), "F32"),
        "layers.2.attn.indexer.compressor.norm.weight": ((128,), "BF16"),
        "layers.0.ffn.gate.weight": ((256, 4096), "BF16"),
        "layers.0.ffn.gate.tid2eid": ((129280, 6), "I64"),
        "layers.2.ffn.gate.tid2eid": ((129280, 6), "I64"),
        "layers.3.ffn.gate.bias": ((256,), "F32"),
        "layers.42.ffn.gate.bias": ((256,), "F32"),
        "layers.0.ffn.shared_experts.w1.weight": ((2048, 4096), "F8_E4M3"),
        "layers.0.ffn.shared_experts.w3.scale": ((16, 32), "F8_E8M0"),
        "layers.0.ffn.shared_experts.w2.weight": ((4096, 2048), "F8_E4M3"),
        "layers.0.ffn.shared_experts.w2.scale": ((32, 16), "F8_E8M0"),
        "layers.7.ffn.experts.255.w1.weight": ((2048, 2048), "I8"),
        "layers.7.ffn.experts.255.w1.scale": ((2048, 128), "F8_E8M0"),
        "layers.7.ffn.experts.0.w2.weight": ((4096, 1024), "I8"),
        "layers.7.ffn.experts.0.w2.scale": ((4096, 64), "F8_E8M0"),
        "mtp.0.e_proj.weight": ((4096, 4096), "F8_E4M3"),
        "mtp.0.e_proj.scale": ((32, 32), "F8_E8M0"),
        "mtp.0.h_proj.scale": ((32, 32), "F8_E8M0"),
        "mtp.0.enorm.weight": ((4096,), "BF16"),
        "mtp.0.hnorm.weight": ((4096,), "BF16"),
        "mtp.0.norm.weight": ((4096,), "BF16"),
        "mtp.0.hc_head_fn": ((4, 16384), "F32"),
        "mtp.0.hc_head_scale": ((1,), "F32"),
        "mtp.0.ffn.gate.bias": ((256,), "F32"),
    }
    for name, (shape, dtype) in expect.items():
        assert L[name] == TensorSpec(shape, dtype), name
    # Which layers have what: SWA 0,1 and MTP no compressor; HCA no indexer; hash layers no bias.
    for absent in [
        "layers.0.attn.compressor.ape", "layers.1.attn.compressor.wkv.weight", "layers.3.attn.indexer.wq_b.weight",
        "layers.0.ffn.gate.bias", "layers.3.ffn.gate.tid2eid", "mtp.0.attn.compressor.ape",
        "mtp.0.ffn.gate.tid2eid", "layers.43.attn_norm.weight", "mtp.1.e_proj.weight",
    ]:
        assert absent not in L, absent
    assert sum(n.startswith("mtp.0.") for n in L) == 1575
    assert len([n for n in L if n.endswith(".indexer.wq_b.weight")]) == 21


def test_layout_variants():
    flash = get_config("dsv4-flash")
    plain = checkpoint_layout(flash.replace(quantization=None, expert_dtype=None), include_mtp=False)
    assert plain["layers.0.attn.wq_a.weight"] == TensorSpec((1024, 4096), "BF16")
    assert plain["layers.5.ffn.experts.3.w2.weight"] == TensorSpec((4096, 2048), "BF16")
    assert not any(n.endswith(".scale") or n.startswith("mtp.") for n in plain)
    base = checkpoint_layout(quantized(flash, scales="f32", expert_dtype="fp8"), include_mtp=False)
    assert base["layers.0.attn.wq_a.scale"] == TensorSpec((8, 32), "F32")
    assert base["layers.5.ffn.experts.3.w1.weight"] == TensorSpec((2048, 4096), "F8_E4M3")
    assert base["layers.5.ffn.experts.3.w1.scale"] == TensorSpec((16, 32), "F32")
    tiny = checkpoint_layout(quantized(get_config(TINY)))
    # Spec section 10's quantized shapes, ceil-divided block grids included.
    assert tiny["layers.0.attn.wq_a.scale"].shape == (1, 1)
    assert tiny["layers.0.attn.wq_b.scale"].shape == (3, 1)
    assert tiny["layers.0.attn.wo_a.weight"].shape == (128, 192)
    assert tiny["layers.0.attn.wo_a.scale"].shape == (1, 2)
    assert tiny["layers.0.ffn.experts.0.w1.weight"] == TensorSpec((128, 64), "I8")
    assert tiny["layers.0.ffn.experts.0.w2.scale"] == TensorSpec((128, 4), "F8_E8M0")


# ---- aliases --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, canonical",
    [
        ("model.embed_tokens.weight", "embed.weight"),
        ("model.hc_head.hc_fn", "hc_head_fn"),
        ("model.hc_head.hc_base", "hc_head_base"),
        ("model.hc_head.hc_scale", "hc_head_scale"),
        ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),
        ("model.layers.3.attn.compressor.norm.weight", "layers.3.attn.compressor.norm.weight"),
        ("model.layers.3.attn.indexer.compressor.norm.weight", "layers.3.attn.indexer.compressor.norm.weight"),
        ("model.layers.3.attn.q_norm.weight", "layers.3.attn.q_norm.weight"),
        ("model.layers.0.ffn.gate.tid2eid", "layers.0.ffn.gate.tid2eid"),
        ("model.norm.weight", "norm.weight"),
        ("head.weight", "head.weight"),
        ("lm_head.weight", "head.weight"),
        ("model.layers.12.ffn.experts.7.w2.scale", "layers.12.ffn.experts.7.w2.scale"),
        ("layers.0.attn.kv_norm.weight", "layers.0.attn.kv_norm.weight"),
        ("embed.weight", "embed.weight"),
        ("mtp.0.hc_head_fn", "mtp.0.hc_head_fn"),
        ("mtp.0.norm.weight", "mtp.0.norm.weight"),
        ("mtp.0.attn.norm.weight", "mtp.0.attn.kv_norm.weight"),
    ],
)
def test_canonical_name(name, canonical):
    assert canonical_name(name) == canonical


def _transformers_name(name: str) -> str:
    """How transformers 5.23 `save_pretrained` spells a DeepSeek name (seen in its output)."""
    special = {"embed.weight": "model.embed_tokens.weight", "head.weight": "head.weight"}
    if name in special:
        return special[name]
    if name.startswith("hc_head_"):
        return "model.hc_head.hc_" + name[len("hc_head_"):]
    return "model." + name.replace(".attn.kv_norm.weight", ".attn.norm.weight")


def test_transformers_style_checkpoint_loads(tmp_path, tiny_state):
    config, tensors = tiny_state
    config = config.replace(num_nextn_predict_layers=0)
    hf = {
        _transformers_name(n): (a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a)
        for n, a in tensors.items() if not n.startswith("mtp.")
    }
    assert "model.layers.0.attn.norm.weight" in hf and "model.hc_head.hc_fn" in hf
    got, report = _load(_write(tmp_path, config, hf), config, progress=False)
    assert set(got) == set(checkpoint_layout(config))
    assert got["layers.0.attn.kv_norm.weight"].dtype == np.float32  # F32 accepted where BF16 expected
    kv_norm = tensors["layers.0.attn.kv_norm.weight"].astype(np.float32)
    np.testing.assert_array_equal(got["layers.0.attn.kv_norm.weight"], kv_norm)
    assert got["layers.0.ffn.gate.tid2eid"].dtype == np.int32
    assert report.file_dtypes["embed.weight"] == "F32" and not report.mtp_enabled


@pytest.mark.skipif(not GOLDEN.is_dir(), reason="golden fixtures not generated yet")
def test_golden_transformers_checkpoints_match_layout():
    dirs = sorted(GOLDEN.glob("*/checkpoint"))
    assert dirs
    for d in dirs:
        config = DeepseekV4Config.from_json(d)
        plan = plan_checkpoint(d, config)  # raises on any missing / unexpected / mis-shaped name
        assert not plan.mtp_enabled
        assert set(plan.load) == {n for n in checkpoint_layout(config) if not n.startswith("mtp.")}


# ---- reader ---------------------------------------------------------------------------------
def test_reader_round_trips_safetensors_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "e4m3": rng.standard_normal((5, 7)).astype(ml_dtypes.float8_e4m3fn),
        "e8m0": np.arange(100, 130, dtype=np.uint8).reshape(5, 6).view(ml_dtypes.float8_e8m0fnu),
        "bf16": rng.standard_normal((3, 9)).astype(ml_dtypes.bfloat16),
        "i64": rng.integers(-(2**40), 2**40, (4, 3)),
        "i8": rng.integers(-128, 128, (3, 3)).astype(np.int8),
        "f32": rng.standard_normal((2, 2)).astype(np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "t.safetensors")
    assert f.metadata == {"format": "pt"}
    assert {n: i.dtype for n, i in f.tensors.items()} == {
        "e4m3": "F8_E4M3", "e8m0": "F8_E8M0", "bf16": "BF16", "i64": "I64", "i8": "I8", "f32": "F32", "empty": "F32",
    }
    for name, ref in tensors.items():
        out = f.read(name)
        assert out.dtype == ref.dtype and out.shape == ref.shape, name
        assert out.tobytes() == ref.tobytes(), name
    assert W.e8m0_to_float32(f.read("e8m0"))[0, 0] == 2.0**-27


def test_reader_rejects_corrupt_files(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsFile(tmp_path / "short.safetensors")
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "trunc.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match="bad data offsets"):
        SafetensorsFile(tmp_path / "trunc.safetensors")


def test_sharded_index_single_file_and_unindexed_shards(tmp_path, tiny_state):
    config, tensors = tiny_state
    ckpt = write_random_checkpoint(tmp_path / "sharded", TINY, tokenizer=False)  # > 4 MB -> shards
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    got, report = _load(ckpt, progress=False)
    assert set(got) == set(tensors) and report.mtp_enabled and len(report.shards) == len(shards)
    for name in ("embed.weight", "layers.1.attn.indexer.compressor.ape", "mtp.0.hc_head_fn"):
        assert got[name].tobytes() == tensors[name].tobytes()
    # The same shards without the index, and one single file given by path.
    (ckpt / "model.safetensors.index.json").unlink()
    assert set(_load(ckpt, config, progress=False)[0]) == set(tensors)
    single = _write(tmp_path / "single", config, tensors) / "model.safetensors"
    assert set(_load(single, config, progress=False)[0]) == set(tensors)
    assert len(open_checkpoint(single).files) == 1


# ---- validation errors ----------------------------------------------------------------------
def _broken(tensors, missing=False, extra=False, wrong_shape=False):
    t = dict(tensors)
    if missing:
        del t["layers.2.attn.compressor.ape"]
    if extra:
        t["layers.1.attn.bogus.weight"] = np.zeros((3,), np.float32)
    if wrong_shape:
        t["layers.0.attn.wq_b.weight"] = np.zeros((7, 128), ml_dtypes.bfloat16)
    return t


@pytest.mark.parametrize(
    "missing, extra, wrong_shape",
    [(True, True, True), (True, False, False), (False, True, False), (False, False, True)],
)
def test_invalid_checkpoint_one_error_naming_everything(tmp_path, tiny_state, missing, extra, wrong_shape):
    config, tensors = tiny_state
    path = _write(tmp_path, config, _broken(tensors, missing, extra, wrong_shape), shards=2)
    with pytest.raises(ValueError) as err:
        load_checkpoint(path, config, _never, progress=False)
    msg = str(err.value)
    assert ("layers.2.attn.compressor.ape" in msg) == missing
    assert ("missing" in msg) == missing
    assert ("layers.1.attn.bogus.weight" in msg) == extra
    assert ("unexpected" in msg) == extra
    assert ("layers.0.attn.wq_b.weight" in msg) == wrong_shape
    if wrong_shape:
        assert "BF16[7, 128]" in msg and "BF16[384, 128]" in msg


def test_dtype_rules(tmp_path, tiny_state):
    config, tensors = tiny_state
    t = dict(tensors)
    t["layers.0.ffn.gate.tid2eid"] = t["layers.0.ffn.gate.tid2eid"].astype(np.int32)  # I32 for I64: fine
    t["embed.weight"] = t["embed.weight"].astype(np.float32)  # F32 for BF16: fine
    assert _load(_write(tmp_path / "ok", config, t), config, progress=False)[0]["embed.weight"].dtype == np.float32
    t["layers.0.hc_attn_fn"] = t["layers.0.hc_attn_fn"].astype(ml_dtypes.bfloat16)  # BF16 for F32: not fine
    with pytest.raises(ValueError, match=r"layers\.0\.hc_attn_fn: checkpoint has BF16"):
        load_checkpoint(_write(tmp_path / "bad", config, t), config, _never, progress=False)
    # A quantized checkpoint under an unquantized config is reported, not half-loaded.
    qconfig, qtensors = random_state(TINY, quantize="fp8")
    with pytest.raises(ValueError, match=r"unexpected.*layers\.0\.attn\.wq_a\.scale"):
        load_checkpoint(_write(tmp_path / "q", qconfig, qtensors), config, _never, progress=False)
    # F32 scales where the config says UE8M0 are accepted and stay float32.
    qt = dict(qtensors)
    qt["layers.0.attn.wq_a.scale"] = W.e8m0_to_float32(qt["layers.0.attn.wq_a.scale"])
    got, report = _load(_write(tmp_path / "f32scale", qconfig, qt), qconfig, progress=False)
    assert got["layers.0.attn.wq_a.scale"].dtype == np.float32 and got["layers.0.attn.wkv.scale"].dtype == np.uint8
    assert report.file_dtypes["layers.0.attn.wq_a.scale"] == "F32"


# ---- MTP ------------------------------------------------------------------------------------
def test_checkpoint_without_mtp_loads_with_mtp_disabled(tmp_path, tiny_state, caplog):
    config, tensors = tiny_state
    path = _write(tmp_path, config, {n: a for n, a in tensors.items() if not n.startswith("mtp.")})
    with caplog.at_level(logging.WARNING, logger="dsv4_jax.weights.checkpoint"):
        got, report = _load(path, config, progress=False)
    assert not report.mtp_enabled and not any(n.startswith("mtp.") for n in got)
    assert any("no mtp.*" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_dspark_style_mtp_is_skipped_with_a_warning(tmp_path, tiny_state, caplog):
    config, tensors = tiny_state
    t = {n: a for n, a in tensors.items() if not n.startswith("mtp.0.ffn.experts.")}  # block tensors missing
    for i in range(3):  # 0731-style draft stages: extra names, extra stages
        t[f"mtp.{i}.main_proj.weight"] = np.zeros((128, 384), ml_dtypes.bfloat16)
        t[f"mtp.{i}.markov_head.weight"] = np.zeros((16, 128), ml_dtypes.bfloat16)
        t[f"mtp.{i}.confidence_head.weight"] = np.zeros((1, 128), ml_dtypes.bfloat16)
    path = _write(tmp_path, config, t)
    with caplog.at_level(logging.WARNING, logger="dsv4_jax.weights.checkpoint"):
        got, report = _load(path, config, progress=False)
    assert not report.mtp_enabled
    assert not any(n.startswith("mtp.") for n in got)
    assert set(got) == {n for n in checkpoint_layout(config) if not n.startswith("mtp.")}
    assert "mtp.1.markov_head.weight" in report.skipped and "mtp.0.e_proj.weight" in report.skipped
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "not the DeepSeek-V4 MTP block" in warning and "MTP disabled" in warning
    # A correct V4 MTP block with one mis-shaped tensor is an error, not a silent skip.
    t = dict(tensors)
    t["mtp.0.enorm.weight"] = np.zeros((64,), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"mtp\.0\.enorm\.weight"):
        load_checkpoint(_write(tmp_path / "bad", config, t), config, _never, progress=False)
    # mtp=False skips a good block silently.
    got, report = _load(_write(tmp_path / "good", config, tensors), config, mtp=False, progress=False)
    assert not report.mtp_enabled and not any(n.startswith("mtp.") for n in got)


# ---- progress -------------------------------------------------------------------------------
def test_progress_lines_with_and_without_tqdm(tmp_path, tiny_state, caplog, capsys, monkeypatch):
    config, tensors = tiny_state
    path = _write(tmp_path, config, tensors, shards=3)
    load_checkpoint(path, config, lambda n, a: None)
    err = capsys.readouterr().err
    assert "Loading safetensors checkpoint shards: 3/3" in err
    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm absent -> plain log lines
    with caplog.at_level(logging.INFO, logger="dsv4_jax.weights.checkpoint"):
        load_checkpoint(path, config, lambda n, a: None)
    lines = [r.getMessage() for r in caplog.records if "Loading safetensors" in r.getMessage()]
    assert lines == [f"Loading safetensors checkpoint shards: {k}/3" for k in (1, 2, 3)]


# ---- writer ---------------------------------------------------------------------------------
def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_writer_is_deterministic_and_reads_back(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", TINY, seed=3, quantize="fp8")
    b = write_random_checkpoint(tmp_path / "b", get_config(TINY).to_dict(), seed=3, quantize="fp8", tokenizer=False)
    c = write_random_checkpoint(tmp_path / "c", TINY, seed=4, quantize="fp8", tokenizer=False)
    da, db, dc = _digest(a), _digest(b), _digest(c)
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= set(da)
    assert da["model.safetensors"] == db["model.safetensors"] != dc["model.safetensors"]
    assert json.loads((a / "tokenizer_config.json").read_text())["eos_token"] == "<｜end▁of▁sentence｜>"
    config = DeepseekV4Config.from_json(a)
    assert config == quantized(get_config(TINY)) and config.quantization.scale_fmt == "ue8m0"
    got, report = _load(a, progress=False)
    assert report.mtp_enabled and set(got) == set(checkpoint_layout(config))
    assert got["layers.0.attn.wq_a.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert got["layers.0.attn.wq_a.scale"].dtype == np.uint8
    assert got["layers.0.ffn.experts.0.w1.weight"].dtype == np.uint8
    assert got["layers.0.ffn.experts.0.w1.scale"].dtype == np.uint8
    assert got["layers.0.ffn.gate.tid2eid"].dtype == np.int32
    assert got["embed.weight"].dtype == ml_dtypes.bfloat16
    assert report.num_bytes == sum(a.nbytes for a in got.values())


def test_random_values_have_meaningful_scales(tiny_state):
    config, t = tiny_state
    f = lambda n: t[n].astype(np.float32)  # noqa: E731
    tid = t["layers.0.ffn.gate.tid2eid"]
    assert tid.shape == (512, 2) and all(len(set(r)) == 2 for r in tid) and tid.min() >= 0 and tid.max() < 8
    assert abs(f("layers.1.attn.q_norm.weight").mean() - 1) < 0.05 and f("norm.weight").std() > 0.05
    assert 0.5 <= f("layers.1.hc_attn_scale").min() and f("layers.1.hc_attn_scale").max() <= 1.5
    assert f("hc_head_base").std() > 0 and f("layers.1.attn.compressor.ape").std() > 0.3
    assert abs(f("layers.1.attn.wq_a.weight").std() * 128**0.5 - 1) < 0.1
    assert f("layers.1.ffn.gate.bias").std() > 0.03 and f("layers.1.attn.attn_sink").std() > 0


def _power_of_two(scale: np.ndarray) -> np.ndarray:
    """A scale tensor as float32 multipliers: UE8M0 byte b is 2^(b - 127) (spec 7.2), f32 as is."""
    if scale.dtype == ml_dtypes.float8_e8m0fnu:
        return np.ldexp(np.float32(1), scale.view(np.uint8).astype(np.int32) - 127)
    return scale


def _expected_fp8_block(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Spec 7.2, written here from the stored bytes: W[i, j] = e4m3(Wq[i, j]) * S[i // 128, j // 128]."""
    rows, cols = weight.shape
    per_element = np.repeat(np.repeat(_power_of_two(scale), block[0], axis=0), block[1], axis=1)[:rows, :cols]
    # One float32 product per element: exact for UE8M0 scales, rounded once for float32 scales.
    return weight.astype(np.float32) * per_element


def _expected_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Spec 7.2: byte k of a row holds element 2k in its low nibble and 2k + 1 in its high one, each
    an E2M1 code (ml_dtypes.float4_e2m1fn), times 2^(S[i, j // 32] - 127)."""
    raw = packed.view(np.uint8)
    values = np.empty((*raw.shape[:-1], 2 * raw.shape[-1]), np.float32)
    values[..., 0::2] = (raw & 0x0F).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    values[..., 1::2] = (raw >> 4).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return values * np.repeat(_power_of_two(scale), 32, axis=-1)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-f32scales"])
def test_quantized_checkpoint_equals_its_dequantized_twin(fmt):
    qconfig, q = random_state(TINY, seed=1, quantize=fmt)
    tconfig, twin = random_state(TINY, seed=1, dequantized_twin_of=fmt)
    assert tconfig == get_config(TINY)
    assert qconfig.quantization.scale_fmt == (None if fmt == "fp8-f32scales" else "ue8m0")
    layout = checkpoint_layout(qconfig)
    block = qconfig.quantization.weight_block_size
    assert block == (128, 128) and set(q) == set(layout) and set(twin) == set(checkpoint_layout(tconfig))
    formats = set()
    for name, value in twin.items():
        spec = layout[name]
        scale = q.get(name[:-6] + "scale")
        if spec.dtype == "F8_E4M3":
            expected = _expected_fp8_block(q[name], scale, block)
        elif spec.dtype == "I8":
            expected = _expected_mxfp4(q[name], scale)
        else:
            assert q[name].tobytes() == value.tobytes(), name
            continue
        formats.add((spec.dtype, str(scale.dtype)))
        np.testing.assert_array_equal(value.astype(np.float32), expected, err_msg=name)
        original = random_tensor(name, TensorSpec(expected.shape, "BF16"), tconfig, seed=1)
        assert 0 < np.abs(expected - original).max() <= 0.35 * np.abs(original).max(), name  # near, not equal
    fp8_scales = "float8_e8m0fnu" if fmt == "fp8" else "float32"
    assert formats == {("F8_E4M3", fp8_scales), ("I8", "float8_e8m0fnu")}  # every format was checked
