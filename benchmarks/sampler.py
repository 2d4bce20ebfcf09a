"""Time the engine's on-device sampler on one step's logits, per kind of request.

    python3 benchmarks/sampler.py [--batch 32] [--vocab 129280] [--repeats 40]

Each row of the table is one batch where every row has the named settings (the sampler's cost
depends on the mix: greedy rows take an argmax, rows with top-k or top-p draw among the first
candidates or, when the tokens they keep reach past those, among K, the others from the whole
vocabulary). Median wall milliseconds of `repeats` calls after one
warm-up call, random logits (normal x 4), prints a markdown table. On CPUs malloc is set as the
engine's runner sets it (`dsv4_jax.engine.host_memory`) unless --glibc-defaults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.runner import positive  # noqa: E402
from dsv4_jax.engine.host_memory import keep_freed_buffers  # noqa: E402
from dsv4_jax.engine.sampler import SamplerConfig, SamplingRow, build_sampling_batch, sample  # noqa: E402
from dsv4_jax.engine.sampling_params import SamplingParams  # noqa: E402

MIXES = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy + 5 logprobs": SamplingParams(temperature=0.0, logprobs=5),
    "temperature 1 (OpenAI default)": SamplingParams(temperature=1.0),
    "temperature 0.7, min_p 0.05": SamplingParams(temperature=0.7, min_p=0.05),
    "top_p 0.95 (a nucleus past the K)": SamplingParams(temperature=1.0, top_p=0.95),
    "top_p 0.9, temperature 0.3 (a narrow nucleus)": SamplingParams(temperature=0.3, top_p=0.9),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "top_k 50, top_p 0.9, seeded": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3),
    "greedy, repetition 1.1 and frequency 0.5 (penalties)": SamplingParams(temperature=0.0, repetition_penalty=1.1,
                                                                           frequency_penalty=0.5),
}
HISTORY = list(range(0, 2000, 7))  # each row's prompt: what the penalties read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=positive, default=32)
    parser.add_argument("--vocab", type=positive, default=129_280)
    parser.add_argument("--repeats", type=positive, default=40)
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="leave malloc as it is (the engine's runner sets glibc's thresholds on CPUs)")
    args = parser.parse_args()
    kept = jax.default_backend() == "cpu" and not args.glibc_defaults and keep_freed_buffers()

    config = SamplerConfig()
    logits = jax.device_put((np.random.default_rng(0).normal(size=(args.batch, args.vocab)) * 4).astype(np.float32))
    print(f"sampler on [{args.batch}, {args.vocab}] logits, first candidates {config.first_candidates}, "
          f"K = {config.candidates}, {jax.devices()[0].device_kind}, "
          f"median of {args.repeats} calls, malloc {'as the engine sets it' if kept else 'as it was'}\n")
    print("| rows | ms |\n|---|---|")
    for name, params in MIXES.items():
        rows = [SamplingRow(params, request_index=i, prompt_token_ids=HISTORY) for i in range(args.batch)]
        batch = jax.device_put(build_sampling_batch(rows, args.batch, vocab_size=args.vocab, config=config))
        jax.block_until_ready(sample(logits, batch, config=config))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(sample(logits, batch, config=config))
            times.append(time.perf_counter() - start)
        print(f"| {name} | {1e3 * statistics.median(times):.1f} |")


if __name__ == "__main__":
    main()
