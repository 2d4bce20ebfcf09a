"""Sharding (`dsv4_jax/parallel/sharding.py`): the rules table and the declared axes in this process (one
device; abstract states for real sizes), the sharded full forward on 8 CPU devices in one
subprocess (`tests/sharding_worker.py`; XLA_FLAGS must be set before jax is imported)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dsv4_jax
from dsv4_jax.parallel import sharding as sh
from dsv4_jax.model.transformer import DeepseekV4
from conftest import child_xla_flags, in_background, started  # tests/ is on sys.path
from dsv4_jax.presets import get_config

WORKER = Path(__file__).with_name("sharding_worker.py")
EP_MESHES = ("dp2_tp2_ep", "dp8_ep")
LOGICAL_AXES = set(sh.mesh_axis_rules(sh.ParallelConfig()))


def flat(state: nnx.State) -> dict[str, nnx.Variable]:
    return {".".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}


def assert_every_parameter_declares_axes(state: nnx.State) -> None:
    leaves = flat(state)
    for name, variable in leaves.items():
        axes, shape = variable.get_metadata().get("axes"), variable.get_value().shape
        assert axes is not None and len(axes) == len(shape), (name, axes, shape)
        assert set(axes) <= LOGICAL_AXES, (name, axes)
        if name.endswith(".scale"):  # a block scale splits as the weight it scales
            assert axes == leaves[name[: -len("scale")] + "weight"].get_metadata()["axes"], name


# ---- declarations and rules (this process) ---------------------------------------------------
def test_every_parameter_of_the_preset_declares_its_axes():
    state = nnx.split(nnx.eval_shape(lambda: DeepseekV4(get_config("dsv4-tiny-test"))))[1]
    assert_every_parameter_declares_axes(state)


def test_a_loaded_quantized_checkpoint_keeps_the_axes(tmp_path):
    dsv4_jax.testing.write_random_checkpoint(tmp_path, "dsv4-tiny-test", seed=0, quantize="fp8", tokenizer=False)
    model = dsv4_jax.load_model(tmp_path, dtype="float32")
    assert any(name.endswith(".scale") for name in flat(model.state))
    assert_every_parameter_declares_axes(model.state)
    mesh = sh.make_mesh(sh.ParallelConfig())
    shardings = sh.param_shardings(model.state, mesh, sh.ParallelConfig())
    assert {s.mesh for s in jax.tree.leaves(shardings)} == {mesh}


@pytest.mark.parametrize(
    "parallel",
    [
        sh.ParallelConfig(tensor_parallel_size=8),
        sh.ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, enable_expert_parallel=True),
    ],
    ids=["tp8", "dp4_tp2_ep"],
)
def test_deepseek_v4_flash_splits_with_the_issue_rules(parallel):
    """The real sizes (abstract: no arrays), stored quantized: heads and output groups over
    `tensor`, experts over data x tensor with EP or along their intermediate dim without,
    scales with their weights, small tensors replicated."""
    state = nnx.split(nnx.eval_shape(lambda: DeepseekV4(get_config("dsv4-flash"))))[1]
    mesh_shape = {sh.DATA: parallel.data_parallel_size, sh.TENSOR: parallel.tensor_parallel_size}
    specs = {name: spec for name, spec in flat(sh.partition_specs(state, mesh_shape, parallel)).items()}
    ep = parallel.enable_expert_parallel
    layer = "segments.1."  # layer 2 alone (DeepSeek-V4-Flash's plan), no stacked axis
    expected = {
        "attn.wq_b.weight": P("tensor", None),
        "attn.wq_b.scale": P("tensor", None),
        "attn.attn_sink": P("tensor"),
        "attn.wo_a.weight": P("tensor", None),
        "attn.wo_b.scale": P(None, "tensor"),
        "attn.wkv.weight": P(None, None),
        "attn.indexer.wq_b.weight": P(None, None),
        "ffn.gate.weight": P(None, None),
        "ffn.shared_experts.w2.weight": P(None, "tensor"),
        "ffn.experts.w1.weight": P(("data", "tensor"), None, None) if ep else P(None, "tensor", None),
        "ffn.experts.w2.scale": P(("data", "tensor"), None, None) if ep else P(None, None, "tensor"),
        "hc_attn_fn": P(None, None),
    }
    assert {k: specs[layer + k] for k in expected} == expected
    assert specs["segments.2.units.0.attn.wq_b.weight"] == P(None, "tensor", None)  # stacked layers
    assert specs["head.weight"] == P(None, "tensor")  # stored [hidden, vocab] (`Linear(transposed=True)`)


def test_two_logical_axes_claiming_one_mesh_axis_is_an_error():
    ep = sh.ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    rules = sh.mesh_axis_rules(ep)
    with pytest.raises(ValueError, match=r"w\.weight .*'experts' and 'shared_ffn' both claim mesh axis 'tensor'"):
        sh.partition_spec("w.weight", (8, 8), (sh.EXPERTS, sh.SHARED_FFN), rules, {"data": 1, "tensor": 2})


def test_a_dimension_that_does_not_divide_is_an_error():
    rules = sh.mesh_axis_rules(sh.ParallelConfig(tensor_parallel_size=4))
    message = r"attn\.wq_b\.scale \(3, 1\).*size 3 does not divide by mesh axes \('tensor',\)"
    with pytest.raises(ValueError, match=message):
        sh.partition_spec("attn.wq_b.scale", (3, 1), (sh.HEAD_DIMS, sh.Q_LORA), rules, {"data": 1, "tensor": 4})


def test_a_parameter_without_axes_is_an_error():
    class Undeclared(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.zeros((2, 2), np.float32))

    state = nnx.split(Undeclared())[1]
    with pytest.raises(ValueError, match=r"parameter w \(2, 2\) declares no logical axes"):
        sh.partition_specs(state, {"data": 1, "tensor": 1}, sh.ParallelConfig())


def test_a_split_that_cuts_scale_blocks_is_an_error_naming_the_flags():
    """1984 = 15.5 blocks of 128 per shard at tp=2: each shard would dequantise with the wrong
    scales. The block counts divide, so only the block check catches it."""
    flash = get_config("dsv4-flash").replace(moe_intermediate_size=1984)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 .* cuts its scale blocks of 128"):
        sh.check_model_splits(flash, sh.ParallelConfig(tensor_parallel_size=2))


def test_too_few_devices_and_bad_sizes_are_errors():
    message = r"--tensor-parallel-size 2 x --data-parallel-size 2 needs 4 devices, but 1 are visible"
    with pytest.raises(ValueError, match=message):
        sh.make_mesh(sh.ParallelConfig(tensor_parallel_size=2, data_parallel_size=2), devices=jax.devices()[:1])
    message = r"tensor_parallel_size \(--tensor-parallel-size\) must be an integer >= 1, got 0"
    with pytest.raises(ValueError, match=message):
        sh.ParallelConfig(tensor_parallel_size=0)


# ---- the sharded forward on 8 CPU devices (one subprocess) ------------------------------------
class WorkerRun:
    """`tests/sharding_worker.py` running in its own process (output and log in a temporary directory)."""

    def __init__(self):
        self.directory = tempfile.TemporaryDirectory(prefix="sharding-worker-")
        out = Path(self.directory.name)
        env = dict(os.environ, XLA_FLAGS=child_xla_flags(8), JAX_PLATFORMS="cpu")
        with open(out / "log.txt", "w") as log:
            command = [sys.executable, str(WORKER), str(out / "result.json")]
            self.process = subprocess.Popen(in_background(command), env=env, stdout=log, stderr=subprocess.STDOUT)

    def result(self, timeout_s: float = 600) -> dict:
        code = self.process.wait(timeout=timeout_s)  # `started` kills it whatever happens
        out = Path(self.directory.name)
        assert code == 0, (out / "log.txt").read_text()[-3000:]
        return json.loads((out / "result.json").read_text())

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


# Started by conftest once the selection is known, so its ~3 minutes overlap earlier tests.
START_EARLY = {"worker": WorkerRun}


@pytest.fixture(scope="module")
def worker() -> dict:
    with started(__name__, "worker") as run:
        return run.result()


def weight_collectives(mesh: dict, matrix_shapes: list[list[int]], kinds: tuple[str, ...]) -> list:
    """Collectives of `kinds` whose result carries an expert weight matrix [..., out, in]
    (activations here are at most [rows, hidden] with 8 tokens, so they never end that way)."""
    matrices = {tuple(m) for m in matrix_shapes}
    found = []
    for kind, shape in mesh["collectives"]:
        arrays = [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", shape)]
        if kind in kinds and any(len(a) >= 2 and a[-2:] in matrices for a in arrays):
            found.append((kind, shape))
    return found


def test_sharded_forward_equals_one_device(worker):
    assert worker["devices"] == 8
    for label, mesh in worker["meshes"].items():
        assert mesh["rel_diff"] <= 1e-5, (label, mesh["rel_diff"])
        # With more devices visible than tp x dp, the first ones are used (as vLLM).
        assert mesh["device_ids"] == list(range(sh.ParallelConfig(**mesh["parallel"]).world_size)), label


def test_each_device_holds_its_share_of_the_weights(worker):
    for label, mesh in worker["meshes"].items():
        parallel = sh.ParallelConfig(**mesh["parallel"])
        tp = parallel.tensor_parallel_size
        expert_split = parallel.world_size if parallel.enable_expert_parallel else tp
        devices = mesh["device_ids"]
        assert mesh["expert_bytes"] == {str(d): worker["expert_bytes_total"] // expert_split for d in devices}, label
        assert mesh["query_bytes"] == {str(d): worker["query_bytes_total"] // tp for d in devices}, label


def test_the_compiled_forward_gathers_no_expert_weights(worker):
    for label, mesh in worker["meshes"].items():
        assert not weight_collectives(mesh, worker["expert_matrix_shapes"], ("all-gather",)), label
        kinds = {kind for kind, _ in mesh["collectives"]}
        # Tensor parallelism reduces partial sums; nothing here moves tokens between devices.
        assert kinds <= {"all-reduce"}, (label, kinds)


def test_expert_parallelism_moves_no_expert_weights(worker):
    """The routed experts run under shard_map: no expert weight is gathered or reduced (XLA's own
    partitioning of the per-tile gather `weight[experts]` all-reduced gathered weights)."""
    for label in EP_MESHES:
        mesh = worker["meshes"][label]
        assert not weight_collectives(mesh, worker["expert_matrix_shapes"], ("all-reduce", "all-gather")), label


# ---- the engine on meshes (same subprocess) ----------------------------------------------------
def _result_shapes(shape: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", shape)]


def test_engine_on_meshes_follows_the_single_device_forward_under_the_gap_rule(worker):
    """Prefill + decode through `LLM` on tp=2 and dp=2 x tp=2 with expert parallelism, against the
    single-device full forward fed each request's own tokens: each greedy token is the forward's
    argmax wherever its top-1/top-2 gap exceeds 1e-3 (a smaller gap ends the request's
    comparison), and each logprob is within 1e-4 of the forward's."""
    compared = 0
    for label in ("tp2", "dp2_tp2_ep"):
        engine = worker["engine"][label]
        assert engine["idle_after"] == 0, label
        for request in engine["requests"]:
            dense = request["dense"]
            assert len(request["tokens"]) == len(dense["top1"]) == 6, label
            for i, token in enumerate(request["tokens"]):
                if token != dense["top1"][i]:
                    assert dense["gaps"][i] <= 1e-3, (label, i, token, dense["top1"][i], dense["gaps"][i])
                    break
                assert abs(request["logprobs"][i] - dense["logprobs"][i]) <= 1e-4, (label, i)
                compared += 1
    assert compared >= 40  # most positions were compared, not skipped as near-ties


def test_token_masks_hold_on_every_mesh(worker):
    """allowed_token_ids through the engine on each mesh (the masks travel with the sampling batch,
    whole on every device): every token is an allowed one, and some row drew more than one."""
    from sharding_worker import ALLOWED

    for label, engine in worker["engine"].items():
        tokens = engine["constrained_tokens"]
        assert all(set(t) <= set(ALLOWED) and len(t) == 4 for t in tokens), (label, tokens)
        assert any(len(set(t)) > 1 for t in tokens), (label, tokens)


def test_prefix_cache_copies_stay_inside_their_rank_on_every_mesh(worker):
    """Prefix caching is on by default: the engine's snapshot copies, under the mesh's shard_map,
    move exactly one rank's rows between its own slots (sharding_worker.snapshot_copy)."""
    assert {label: engine["snapshot_copy"] for label, engine in worker["engine"].items()} == {
        label: "ok" for label in worker["engine"]}


def test_nothing_compiles_while_serving_on_a_mesh(worker):
    """Warm-up compiles the step, the sampler and the placeholder filling for the shardings steps
    really have (the step's logits, samples replicated on the mesh): generating builds nothing."""
    assert {label: engine["built_while_serving"] for label, engine in worker["engine"].items()} == {
        label: 0 for label in worker["engine"]}


def test_engine_kv_pools_split_over_data_and_replicate_over_tensor(worker):
    single = worker["engine"]["tp2"]["kv_bytes_total"]  # one data-parallel rank's pools
    for label, parallel in (("tp2", sh.ParallelConfig(tensor_parallel_size=2)),
                            ("dp2_tp2_ep", sh.ParallelConfig(2, 2, True))):
        engine = worker["engine"][label]
        dp, devices = parallel.data_parallel_size, list(range(parallel.world_size))
        assert engine["devices"] == devices, label
        # max_num_seqs is per rank: dp ranks hold dp times the pools, each device one rank's.
        assert engine["kv_bytes_total"] == dp * single, label
        assert engine["kv_bytes"] == {str(d): engine["kv_bytes_total"] // dp for d in devices}, label
        expert_split = parallel.expert_parallel_size if parallel.enable_expert_parallel else parallel.tensor_parallel_size
        total_experts = worker["expert_bytes_total"]
        assert engine["expert_bytes"] == {str(d): total_experts // expert_split for d in devices}, label


def test_the_compiled_engine_step_moves_no_pool_and_no_expert_weight(worker):
    """Collectives of the compiled decode step carry activations only: no result has the shape of a
    KV-cache leaf (whole or one rank's) or of an expert weight matrix."""
    matrices = {tuple(m) for m in worker["expert_matrix_shapes"]}
    for label in ("tp2", "dp2_tp2_ep"):
        engine = worker["engine"][label]
        pools = {tuple(s) for s in engine["kv_shapes"] if len(s) >= 3}
        pools |= {(s[0], s[1] // 2, *s[2:]) for s in pools}  # one data rank's blocks
        for kind, shape in engine["step_collectives"]:
            for result in _result_shapes(shape):
                assert result not in pools and result[-2:] not in matrices, (label, kind, shape)
        kinds = {kind for kind, _ in engine["step_collectives"]}
        assert kinds <= ({"all-reduce"} if label == "tp2" else {"all-reduce", "all-gather", "reduce-scatter"}), kinds
