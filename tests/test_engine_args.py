"""The engine's arguments (dsv4_jax/engine/args.py) and the defaults they resolve to before any
weights load: a Hugging Face repository id through the local Hugging Face cache (a cache this
test fills itself, offline), max_num_seqs by device (vLLM's), and a GPU default that the KV pools
cannot hold bounded to what they can (dsv4_jax/engine/builder.py). Nothing here compiles."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import types

import pytest

from dsv4_jax.engine import builder
from dsv4_jax.engine.args import DEFAULT_MAX_NUM_SEQS, LARGE_GPU_BYTES, EngineArgs, default_max_num_seqs
from dsv4_jax.presets import get_config
from dsv4_jax.testing import write_random_checkpoint

GiB = 2**30
REPO_ID = "deepseek-ai/DeepSeek-V4-Flash"
CONFIG = get_config("dsv4-tiny-test").replace(max_position_embeddings=512)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("args") / "ckpt", CONFIG, seed=1, tokenizer=False)


def _hub_cache(root, checkpoint) -> None:
    """A Hugging Face cache holding `REPO_ID` at one revision, laid out as huggingface_hub lays
    it out (refs/main names the snapshot; files as plain copies, where the hub links to blobs)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in checkpoint.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


RESOLVE = """
import sys
from dsv4_jax.engine.args import EngineArgs
try:
    config = EngineArgs(sys.argv[1], max_model_len=256).create_engine_config()
except ValueError as error:
    print("ValueError:", error)
else:
    print(config.model_dir, config.max_model_len)
"""


def _resolve(model: str, hub_cache) -> str:
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", RESOLVE, model], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_hugging_face_id_resolves_through_the_local_cache_as_vllms_does(tmp_path, checkpoint, monkeypatch):
    _hub_cache(tmp_path / "hub", checkpoint)
    snapshot = next((tmp_path / "hub").glob("models--*/snapshots/*"))
    assert _resolve(REPO_ID, tmp_path / "hub") == f"{snapshot} 256"
    missing = _resolve("deepseek-ai/DeepSeek-V4-Pro", tmp_path / "hub")
    assert missing.startswith("ValueError: model 'deepseek-ai/DeepSeek-V4-Pro': not a local directory, and not in "
                              "the Hugging Face cache") and "HF_HUB_OFFLINE=1" in missing, missing
    # A directory of that name wins over the hub; a path that is no repository id is a directory.
    local = tmp_path / "deepseek-ai" / "DeepSeek-V4-Flash"
    local.parent.mkdir()
    local.symlink_to(checkpoint, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert EngineArgs(REPO_ID, max_model_len=256).create_engine_config().model_dir.resolve() == checkpoint


def _device(platform: str, memory: int | None, kind: str = "unknown GPU"):
    stats = {"bytes_limit": memory} if memory else {}
    return types.SimpleNamespace(platform=platform, device_kind=kind, memory_stats=lambda: stats)


def test_max_num_seqs_defaults_to_vllms_by_device(monkeypatch):
    """1024 on GPUs of 70 GiB or more, 256 on smaller ones, 8 on CPUs; a GPU's size is its kind's,
    not JAX's limit (75% of it by default: an 80 GB H100 reports about 60 GiB)."""
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    assert default_max_num_seqs(_device("cpu", None)) == DEFAULT_MAX_NUM_SEQS["cpu"] == 8
    assert default_max_num_seqs(_device("gpu", 60 * GiB, "NVIDIA H100 80GB HBM3")) == 1024
    assert default_max_num_seqs(_device("gpu", 105 * GiB, "NVIDIA H200")) == 1024
    assert default_max_num_seqs(_device("gpu", 34 * GiB, "NVIDIA L40S")) == 256  # 48 GB
    # A kind the table lacks: JAX's limit over the fraction JAX takes.
    assert default_max_num_seqs(_device("gpu", 60 * GiB)) == 1024  # 80 GiB
    assert default_max_num_seqs(_device("gpu", int(0.75 * LARGE_GPU_BYTES) - 1)) == 256
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert default_max_num_seqs(_device("gpu", 60 * GiB)) == 256  # 63 GiB
    assert default_max_num_seqs(_device("gpu", 70 * GiB)) == 1024


def test_a_default_max_num_seqs_the_pools_cannot_hold_is_bounded_and_said(checkpoint, caplog):
    """A device's default (1024 on large GPUs) that the KV pools cannot hold becomes the number of
    full-length sequences they can (logged, the buckets made for it); a max_num_seqs the user gave
    is never changed: it is the planner's error naming the flag."""
    config = EngineArgs(str(checkpoint), max_model_len=512).create_engine_config()
    memory = GiB // 4  # the tiny model: a few hundred full-length sequences
    as_default = dataclasses.replace(config, max_num_seqs=1024, max_num_seqs_is_default=True)
    with caplog.at_level(logging.INFO, logger=builder.__name__):
        bounded, plan = builder._plan(as_default, memory, weight_bytes=0, reserved=0)
    fits = builder._plan(dataclasses.replace(config, max_num_seqs=None, max_num_seqs_is_default=False), memory, 0, 0)
    assert 1 <= bounded.max_num_seqs == plan.num_seq_slots == fits[1].num_seq_slots < 1024
    assert max(bounded.buckets.decode) == bounded.max_num_seqs
    assert f"max_num_seqs 1024 (the default for this GPU) -> {bounded.max_num_seqs}" in caplog.text
    given = dataclasses.replace(config, max_num_seqs=1024, max_num_seqs_is_default=False)
    with pytest.raises(ValueError, match="--max-num-seqs 1024 does not fit"):
        builder._plan(given, memory, weight_bytes=0, reserved=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"load_format": "pickle"}, "--load-format must be one of auto, safetensors, orbax"),
    ({"nnodes": 2, "node_rank": 0, "load_format": "orbax"}, "--load-format orbax is not supported across hosts"),
    ({"nnodes": 2, "node_rank": 2}, r"--node-rank must be in \[0, --nnodes=2\)"),
    ({"async_scheduling": "yes"}, "async_scheduling must be a bool"),
    ({"model": ""}, "model must be a checkpoint directory, a Hugging Face repository id"),
])
def test_engine_args_refuse_bad_values_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
