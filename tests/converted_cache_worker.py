"""Multi-device half of tests/test_converted_cache.py, run as `python tests/converted_cache_worker.py
OUT.json` in a process started with `XLA_FLAGS=--xla_force_host_platform_device_count=4` (the
flag must be set before jax is imported, so this cannot run inside the pytest process).

It writes one tiny checkpoint that splits cleanly (8 heads, 4 output groups, 8 routed experts;
two CSA layers stacked), loads it on one device as the reference, then on a 2 x 2 mesh (tp=2 x
dp=2, expert parallel) twice: first from the safetensors files (writing the converted-weights
cache), then restored from that cache. JSON out, per sharded load: its seconds, the leaves whose
sharding differs from `param_shardings` or whose values differ bit for bit from the reference,
the bytes of routed-expert weights each device holds, and the model's mesh options.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import dsv4_jax
from dsv4_jax.presets import get_config
from dsv4_jax.parallel.sharding import ParallelConfig, make_mesh, param_shardings

# As tests/sharding_worker.py: sliding + hash routing, then two CSA layers stacked.
CONFIG = get_config("dsv4-tiny-test").replace(
    num_attention_heads=8, o_groups=4, num_hidden_layers=3, compress_ratios=(0, 4, 4, 0)
)
PARALLEL = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
EXPERT_WEIGHTS = (".experts.w1.weight", ".experts.w2.weight", ".experts.w3.weight")


def flat(state: nnx.State) -> dict[str, jax.Array]:
    return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(state)}


def same_bits(a: jax.Array, b: np.ndarray) -> bool:
    host = np.asarray(a)
    return host.dtype == b.dtype and host.shape == b.shape and host.tobytes() == b.tobytes()


def describe(model, reference: dict[str, np.ndarray], mesh, seconds: float) -> dict:
    leaves = flat(model.state)
    expected = {".".join(map(str, p)): s for p, s in nnx.to_flat_state(param_shardings(model.state, mesh, PARALLEL))}
    expert_bytes: dict[int, int] = {}
    for name, array in leaves.items():
        if name.endswith(EXPERT_WEIGHTS):
            for shard in array.addressable_shards:
                expert_bytes[shard.device.id] = expert_bytes.get(shard.device.id, 0) + shard.data.nbytes
    return {
        "seconds": seconds,
        "leaves": len(leaves),
        "wrong_sharding": [n for n, a in leaves.items() if a.sharding != expected[n]],
        "wrong_values": [n for n, a in leaves.items() if not same_bits(a, reference[n])],
        "expert_bytes": expert_bytes,
        "options_mesh_is_the_mesh": model.options.mesh is mesh,
        "options_expert_parallel": model.options.expert_parallel,
    }


def main(out_path: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = dsv4_jax.testing.write_random_checkpoint(Path(tmp) / "ckpt", CONFIG, seed=0, tokenizer=False)
        cache = Path(tmp) / "weights"
        single = dsv4_jax.load_model(checkpoint, load_format="safetensors")
        reference = {name: np.asarray(array) for name, array in flat(single.state).items()}
        mesh = make_mesh(PARALLEL)
        expert_bytes_total = sum(a.nbytes for n, a in reference.items() if n.endswith(EXPERT_WEIGHTS))
        result = {"devices": jax.device_count(), "expert_bytes_total": expert_bytes_total, "loads": {}}
        for label, load_format in (("first", "auto"), ("restored", "orbax")):
            start = time.perf_counter()
            model = dsv4_jax.load_model(
                checkpoint, mesh=mesh, parallel=PARALLEL, load_format=load_format, weights_cache_dir=cache
            )
            jax.block_until_ready(model.state)
            result["loads"][label] = describe(model, reference, mesh, time.perf_counter() - start)
        result["cache_entries"] = sorted(p.name for p in cache.iterdir())
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
