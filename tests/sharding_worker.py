"""Multi-device half of tests/test_sharding.py, run as `python tests/sharding_worker.py OUT.json`
in a process started with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be
set before jax is imported, so this cannot run inside the pytest process).

It loads one tiny float32 checkpoint that splits cleanly (8 heads, 4 output groups, 8 routed
experts), runs the full forward on one device and on each mesh, and writes JSON: per mesh the
devices used, the relative difference to the single-device logits, the bytes each device holds
of the routed experts and of the query projection, and every collective of the compiled
forward's HLO (kind, result shape).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

import dsv4_jax
from dsv4_jax.presets import get_config
from dsv4_jax.sharding import ParallelConfig, make_mesh, shard_model

# 8 heads / 4 output groups / 8 experts divide by every mesh below; layers: sliding + hash
# routing, then two CSA layers stacked (so the stacked `layers` axis is placed too).
CONFIG = get_config("dsv4-tiny-test").replace(
    num_attention_heads=8, o_groups=4, num_hidden_layers=3, compress_ratios=(0, 4, 4, 0)
)
MESHES = {
    "tp2": ParallelConfig(tensor_parallel_size=2),
    "tp4": ParallelConfig(tensor_parallel_size=4),
    "dp2_tp2_ep": ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True),
    "dp8_ep": ParallelConfig(data_parallel_size=8, enable_expert_parallel=True),
}
IDS = np.array([[0, 17, 42, 99, 5, 311, 7, 256]], np.int32)  # 8 tokens: two CSA windows of 4
EXPERT_WEIGHTS = (".experts.w1.weight", ".experts.w2.weight", ".experts.w3.weight")
QUERY_WEIGHTS = (".attn.wq_b.weight",)
# `%name = SHAPE KIND(` in compiled HLO text; SHAPE is one array or a (tuple, of, arrays).
COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def leaves(state: nnx.State, suffixes: tuple[str, ...]) -> list[jax.Array]:
    """Arrays of the state leaves whose dotted path ends with one of `suffixes`."""
    return [
        v.get_value() for path, v in nnx.to_flat_state(state) if ".".join(map(str, path)).endswith(suffixes)
    ]


def bytes_per_device(arrays: list[jax.Array]) -> dict[int, int]:
    held: dict[int, int] = {}
    for array in arrays:
        for shard in array.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def main(out_path: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dsv4_jax.testing.write_random_checkpoint(tmp, CONFIG, seed=0, tokenizer=False)
        model = dsv4_jax.load_model(tmp, dtype="float32")
    single_state = model.state
    forward = model._jitted["logits"]  # the jitted pure forward behind model(ids)
    reference = np.asarray(model(IDS))
    result = {
        "devices": jax.device_count(),
        "expert_bytes_total": sum(a.nbytes for a in leaves(single_state, EXPERT_WEIGHTS)),
        "query_bytes_total": sum(a.nbytes for a in leaves(single_state, QUERY_WEIGHTS)),
        "expert_matrix_shapes": sorted({a.shape[-2:] for a in leaves(single_state, EXPERT_WEIGHTS)}),
        "meshes": {},
    }
    for label, parallel in MESHES.items():
        model.state = single_state
        mesh = make_mesh(parallel)
        shard_model(model, mesh, parallel)
        compiled = forward.lower(model.state, IDS, model.options).compile()  # compiled once, called once
        logits = np.asarray(compiled(model.state, IDS))
        result["meshes"][label] = {
            "parallel": dataclasses.asdict(parallel),
            "device_ids": [d.id for d in mesh.devices.flat],
            "rel_diff": float(np.max(np.abs(logits - reference)) / np.max(np.abs(reference))),
            "expert_bytes": bytes_per_device(leaves(model.state, EXPERT_WEIGHTS)),
            "query_bytes": bytes_per_device(leaves(model.state, QUERY_WEIGHTS)),
            "collectives": [[kind, shape] for shape, kind in COLLECTIVE.findall(compiled.as_text())],
        }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
