"""Multi-device half of tests/test_sharding.py, run as `python tests/sharding_worker.py OUT.json`
in a process started with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be
set before jax is imported, so this cannot run inside the pytest process).

It loads one tiny float32 checkpoint that splits cleanly (8 heads, 4 output groups, 8 routed
experts), runs the full forward on one device and on each mesh, and writes JSON: per mesh the
devices used, the relative difference to the single-device logits, the bytes each device holds
of the routed experts and of the query projection, and every collective of the compiled
forward's HLO (kind, result shape). Then it generates greedily through `LLM` (prefill + decode
on the paged cache, one prefill and one decode bucket) on each of ENGINE_MESHES, and writes per
mesh each request's tokens with their logprobs and what the single-device full forward fed the
same tokens gives at each of them (`add_dense_reference`), the bytes each device holds of the KV
cache, the cache's shapes, and the collectives of the compiled decode step.
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
from dsv4_jax import LLM, SamplingParams
from dsv4_jax.engine.compiles import CompileCounter
from dsv4_jax.engine.runner import StepBuckets
from dsv4_jax.presets import get_config
from dsv4_jax.parallel.sharding import ParallelConfig, make_mesh
from dsv4_jax.weights.loading import shard_model

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
ENGINE_MESHES = {
    "tp2": MESHES["tp2"],
    "dp2_tp2_ep": MESHES["dp2_tp2_ep"],
}
# Prompts of 3..8 tokens: two per data-parallel rank, each prefilled in one row of the bucket.
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(1, CONFIG.vocab_size, 3 + 2 * i)] for i in range(4)]
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
    with tempfile.TemporaryDirectory() as tmp:
        dsv4_jax.testing.write_random_checkpoint(tmp, CONFIG, seed=0, tokenizer=True)  # the same weights
        result["engine"] = {label: run_engine(tmp, parallel) for label, parallel in ENGINE_MESHES.items()}
    model.state = single_state
    for engine in result["engine"].values():
        add_dense_reference(model, engine["requests"])
    with open(out_path, "w") as f:
        json.dump(result, f)


def add_dense_reference(model, requests: list[dict]) -> None:
    """Each request's positions as the single-device full forward sees them, fed the request's own
    tokens (one call, right padding: causal, so it changes nothing before it): per generated
    token the forward's top-1 token, its top-1/top-2 logprob gap, and its logprob of the token."""
    length = max(len(p) for p in PROMPTS) + max(len(r["tokens"]) for r in requests) - 1
    ids = np.zeros((len(PROMPTS), length), np.int32)
    for row, (prompt, request) in enumerate(zip(PROMPTS, requests, strict=True)):
        fed = prompt + request["tokens"][:-1]
        ids[row, : len(fed)] = fed
    logits = np.asarray(model(ids), np.float64)
    for row, (prompt, request) in enumerate(zip(PROMPTS, requests)):
        at = logits[row, len(prompt) - 1 : len(prompt) - 1 + len(request["tokens"])]  # [tokens, vocab]
        logp = at - at.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        top2 = np.sort(logp, axis=-1)[:, -2:]
        request["dense"] = {
            "top1": [int(t) for t in np.argmax(logp, axis=-1)],
            "gaps": [float(g) for g in top2[:, 1] - top2[:, 0]],
            "logprobs": [float(logp[i, t]) for i, t in enumerate(request["tokens"])],
        }


ALLOWED = [5, 9, 17, 33]  # allowed_token_ids of the constrained generation


def snapshot_copy(runner) -> str:
    """The prefix cache's copies on the mesh (run under a shard_map, each rank between its own
    slots and snapshots): snapshot slot 0 of the last data-parallel rank at position `window`,
    restore it into slot 1 of that rank. Only that rank's slot-1 ring rows [1, window) and
    CSA / indexer state may change, to slot 0's; "ok" or what differs."""
    lay, rank = runner.layout, runner.dp - 1
    h = lay.window
    before = jax.tree.map(np.array, runner.cache)
    runner.take_snapshots([(rank, 0, 0, h)])
    runner.restore_snapshots([(rank, 1, 0, h)])
    after = jax.tree.map(np.asarray, runner.cache)
    expected = jax.tree.map(np.copy, before)
    first = rank * lay.num_sliding_blocks  # the rank's blocks, then its slots' rings
    for leaf in jax.tree.leaves(expected.sliding.kv):
        leaf[:, first + lay.sliding_ring, 1:h] = leaf[:, first, 1:h]
    for state in (expected.csa_state, expected.csa_indexer_state):
        for leaf in (state.kv, state.score):
            leaf[:, rank * lay.num_seq_slots + 1] = leaf[:, rank * lay.num_seq_slots]
    wrong = [str(path) for path, a, b in zip(jax.tree_util.tree_flatten_with_path(after)[0],
                                             jax.tree.leaves(after), jax.tree.leaves(expected))
             if not np.array_equal(a, b, equal_nan=True)]
    return "ok" if not wrong else f"differs: {wrong}"


def run_engine(path: str, parallel: ParallelConfig) -> dict:
    """Greedy generation through `LLM` on `parallel`'s mesh (see the module doc for the record)."""
    llm = LLM(
        path, dtype="float32", kv_cache_dtype="float32", max_model_len=128, max_num_seqs=2, block_size=128,
        buckets=StepBuckets(prefill=((2, 8),), decode=(2,)), tensor_parallel_size=parallel.tensor_parallel_size,
        data_parallel_size=parallel.data_parallel_size, enable_expert_parallel=parallel.enable_expert_parallel,
    )
    serving = CompileCounter()  # everything was compiled at warm-up: nothing is built from here
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2), use_tqdm=False)
    # Constrained rows: each step's token masks are placed whole on the mesh, as the batch is.
    constrained = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(max_tokens=4, temperature=1.0, seed=1, allowed_token_ids=ALLOWED),
                               use_tqdm=False)
    built_while_serving = serving.built
    runner = llm.engine.runner
    padding = runner.padding_step((runner.buckets.decode[0] * runner.dp, 1))
    step_hlo = runner._step.lower(runner.weights, runner.cache, *padding).compile().as_text()
    requests = []
    for out in outs:
        completion = out.outputs[0]
        requests.append({
            "tokens": completion.token_ids,
            "logprobs": [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)],
        })
    cache = jax.tree.leaves(runner.cache)
    return {
        "requests": requests,
        "devices": sorted({d.id for leaf in cache for d in leaf.devices()}),
        "kv_bytes": bytes_per_device(cache),
        "kv_bytes_total": sum(leaf.nbytes for leaf in cache),
        "kv_shapes": sorted({leaf.shape for leaf in cache}),
        "expert_bytes": bytes_per_device(leaves(llm.model.state, EXPERT_WEIGHTS)),
        "step_collectives": [[kind, shape] for shape, kind in COLLECTIVE.findall(step_hlo)],
        "constrained_tokens": [out.outputs[0].token_ids for out in constrained],
        "idle_after": llm.engine.scheduler.num_running + llm.engine.scheduler.num_waiting,
        "built_while_serving": built_while_serving,
        "snapshot_copy": snapshot_copy(runner),
    }


if __name__ == "__main__":
    main(sys.argv[1])
