"""Offline `LLM.generate` on the built-in dsv4-tiny per kind of request: the engine's whole loop
(scheduler, runner, sampler, detokenizer), with the host's share of the CPU time.

    python3 benchmarks/generate.py [--batch 32] [--prompt-len 32] [--new-tokens 64] [--repeats 8]

One LLM with one prefill bucket (batch, prompt_len) and one decode bucket (batch), so every step
runs unpadded. For each kind of request: one untimed generate, then `repeats` timed generates of
the same `batch` random prompts with ignore_eos, all rows with the kind's SamplingParams. Reports
medians per generate: wall seconds, output tokens/s, the process's CPU seconds (every thread:
XLA:CPU's and the host's) and the calling thread's (the engine's host work). On a 2-core machine
the host's work and XLA's compete for the same cores, so both columns matter.
Plain script (jax and this repository), also `python -m benchmarks.generate`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = {  # name -> SamplingParams keyword arguments (besides max_tokens and ignore_eos)
    "greedy": {"temperature": 0.0},
    "greedy + 5 logprobs": {"temperature": 0.0, "logprobs": 5},
    "temperature 1 (OpenAI default)": {"temperature": 1.0},
    "top_k 50": {"temperature": 1.0, "top_k": 50},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.runner import positive

    parser.add_argument("--batch", type=positive, default=32)
    parser.add_argument("--prompt-len", type=positive, default=32)
    parser.add_argument("--new-tokens", type=positive, default=64)
    parser.add_argument("--repeats", type=positive, default=8)
    args = parser.parse_args(argv)

    import jax

    from dsv4_jax import LLM, SamplingParams
    from dsv4_jax.weights.builtin import builtin_model_dir
    from dsv4_jax.engine.runner import StepBuckets

    b = args.batch
    llm = LLM(model=builtin_model_dir(), dtype="bfloat16", max_model_len=args.prompt_len + args.new_tokens,
              max_num_seqs=b, seed=0, buckets=StepBuckets(prefill=((b, args.prompt_len),), decode=(b,)))
    prompts = np.random.default_rng(0).integers(0, llm.config.vocab_size, size=(b, args.prompt_len)).tolist()
    requests = [{"prompt_token_ids": p} for p in prompts]
    load = os.getloadavg()[0]
    print(f"# generate on dsv4-tiny {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, load {load:.2f}: {b} prompts x "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens each, medians of {args.repeats}\n")
    print("| requests | wall s | output tok/s | process CPU s | host thread CPU s |\n|---|---|---|---|---|")
    for name, kwargs in KINDS.items():
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, **kwargs)
        llm.generate(requests, params, use_tqdm=False)  # untimed: first calls of this kind's branches
        wall, process, thread = [], [], []
        for _ in range(args.repeats):
            t, p, h = time.perf_counter(), time.process_time(), time.thread_time()
            llm.generate(requests, params, use_tqdm=False)
            wall.append(time.perf_counter() - t)
            process.append(time.process_time() - p)
            thread.append(time.thread_time() - h)
        w = statistics.median(wall)
        print(f"| {name} | {w:.3f} | {b * args.new_tokens / w:.0f} | {statistics.median(process):.3f} | "
              f"{statistics.median(thread):.3f} |", flush=True)
    if llm.engine.runner.compiles.compiles:
        print(f"\n# warning: {llm.engine.runner.compiles.compiles} compiles after warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
