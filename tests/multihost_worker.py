"""One process of tests/test_multihost.py's two-process run: `python tests/multihost_worker.py RANK
PORT CHECKPOINT OUT.json [MAX_NUM_SEQS]`, started with two CPU devices (XLA_FLAGS) and JAX_PLATFORMS=cpu.

Both processes build the same `LLM` on a dp=2 x tp=2 mesh with expert parallelism over the four
devices of the two processes (`nnodes=2`). Node 0 adds the requests, steps the engine, aborts the
first one (running) after three steps and shuts the followers down; node 1 follows. Each writes JSON: device
counts, the bytes of routed-expert weights on its own devices, and (node 0) every request's
tokens, logprobs and finish reason, (node 1) the device calls it made.
"""

from __future__ import annotations

import json
import sys

import jax
from flax import nnx

from dsv4_jax import LLM, SamplingParams
from dsv4_jax.engine.runner import StepBuckets

PROMPTS = [[5, 17, 42], [99, 3, 211, 7, 8, 256], [1, 2, 3, 4, 5, 6, 7, 8], [300, 301]]
ABORTED = "aborted"
PROMPT_LOGPROBS = "prompt-logprobs"
EXPERT_WEIGHTS = (".experts.w1.weight", ".experts.w2.weight", ".experts.w3.weight")


def main(rank: int, port: int, checkpoint: str, out_path: str, max_num_seqs: int = 2) -> None:
    llm = LLM(checkpoint, dtype="float32", kv_cache_dtype="float32", max_model_len=128, max_num_seqs=max_num_seqs,
              block_size=128, buckets=StepBuckets(prefill=((2, 8),), decode=(2,)), tensor_parallel_size=2,
              data_parallel_size=2, enable_expert_parallel=True, nnodes=2, node_rank=rank, master_port=port)
    experts = [v.get_value() for path, v in nnx.to_flat_state(llm.model.state)
               if ".".join(map(str, path)).endswith(EXPERT_WEIGHTS)]
    result = {
        "rank": rank, "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "local_expert_bytes": sum(s.data.nbytes for a in experts for s in a.addressable_shards),
        "expert_bytes_total": sum(a.nbytes for a in experts),
    }
    if rank == 0:
        engine = llm.engine
        greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
        engine.add_request(ABORTED, [7, 7, 7], SamplingParams(max_tokens=40, temperature=0.0))  # runs at once
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, greedy)
        # Prompt logprobs: the head over every position, read on node 0 after a gather in lockstep.
        engine.add_request(PROMPT_LOGPROBS, PROMPTS[2], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
        finished, steps = {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            steps += 1
            if steps == 3:
                finished[ABORTED] = engine.abort(ABORTED)
        llm.shutdown()
        result["requests"] = {
            rid: {"tokens": out.outputs[0].token_ids, "finish_reason": out.outputs[0].finish_reason,
                  "logprobs": [entry[t].logprob for t, entry in zip(out.outputs[0].token_ids,
                                                                     out.outputs[0].logprobs or [])]}
            for rid, out in finished.items()
        }
        prompt = PROMPTS[2]
        result["prompt_logprobs"] = [entry[prompt[i]].logprob
                                     for i, entry in enumerate(finished[PROMPT_LOGPROBS].prompt_logprobs) if entry]
    else:
        result["calls"] = llm.follow()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], *map(int, sys.argv[5:]))
