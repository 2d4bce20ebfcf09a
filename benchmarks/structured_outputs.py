"""What constrained decoding costs: output tokens/s of a batch whose every row follows a JSON
schema against the same batch unconstrained, the host milliseconds a step spends on the masks,
and a grammar's compile time, cold and from the cache.

    python3 benchmarks/structured_outputs.py [--requests 32] [--max-tokens 64] [--repeats 3]

The built-in model (random weights, the real 129,280-token vocabulary) through `LLM`, with
`max_num_seqs` = the request count so every request runs in one batch. Every answer runs to
`max_tokens` in both runs (the unconstrained rows ignore EOS; the schema's string is longer
than `max_tokens` tokens), so both runs generate the same number of tokens. Each run is repeated
and the best taken; the first of each is a warm-up (it compiles what the run needs and, for the
constrained one, builds the llguidance tokenizer). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.runner import positive  # noqa: E402
from dsv4_jax import LLM, SamplingParams  # noqa: E402
from dsv4_jax.engine import engine as engine_module  # noqa: E402
from dsv4_jax.engine.structured_outputs import StructuredOutputsParams  # noqa: E402

# Answers longer than any max_tokens used here: a constrained row never ends before the free one.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 4000, "maxLength": 4000},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


class MaskClock:
    """Wall seconds the engine spends filling mask rows (`fill_masks`) and in the whole mask
    preparation of a step (`_step_masks`: the wait for the previous token included), per step."""

    def __init__(self, engine):
        self.fill, self.step = [], []
        fill, step_masks = engine_module.fill_masks, engine._step_masks

        def timed_fill(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fill(*args, **kwargs)
            finally:
                self.fill.append(time.perf_counter() - start)

        def timed_step(*args, **kwargs):
            start = time.perf_counter()
            masks = step_masks(*args, **kwargs)
            if masks is not None:  # a step with constrained rows
                self.step.append(time.perf_counter() - start)
            return masks

        engine_module.fill_masks = timed_fill
        engine._step_masks = timed_step


def run(llm: LLM, params: list[SamplingParams]) -> tuple[float, int]:
    """Seconds and output tokens of one batch."""
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("Describe a person as JSON:")}
    start = time.perf_counter()
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def compile_times(llm: LLM, repeats: int) -> tuple[float, float]:
    """Median seconds from add_request to a runnable matcher: a schema never seen (cold, the
    tokenizer already built), then the same schema again (cached)."""
    engine, cold, cached = llm.engine, [], []
    for i in range(repeats):
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], f"field{i}_{time.time_ns()}": {"type": "number"}}}
        for times in (cold, cached):
            params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
            start = time.perf_counter()
            engine.add_request(f"compile-{i}-{len(times)}", llm.get_tokenizer().encode("x"), params)
            _, future, _ = engine._compiling[f"compile-{i}-{len(times)}"]
            future.result()
            times.append(time.perf_counter() - start)
            while engine.has_unfinished():
                engine.step()
    return statistics.median(cold), statistics.median(cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=positive, default=32)
    parser.add_argument("--max-tokens", type=positive, default=64)
    parser.add_argument("--repeats", type=positive, default=3)
    args = parser.parse_args()

    llm = LLM(max_num_seqs=args.requests, max_model_len=256)
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
            for i in range(args.requests)]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
                   for i in range(args.requests)]
    clock = MaskClock(llm.engine)
    best = {}
    for name, params in (("unconstrained", free), ("JSON schema, every row", constrained)):
        runs = [run(llm, params) for _ in range(args.repeats + 1)][1:]
        seconds, tokens = min(runs)
        best[name] = (seconds, tokens)
    steps = len(clock.step) // (args.repeats + 1)  # constrained steps of one run
    cold, cached = compile_times(llm, 5)
    base_rate = best["unconstrained"][1] / best["unconstrained"][0]
    print(f"{args.requests} concurrent requests, {args.max_tokens} output tokens each, built-in model, "
          f"{os.cpu_count()} CPUs, best of {args.repeats}\n")
    print("| run | output tokens/s | relative |\n|---|---|---|")
    for name, (seconds, tokens) in best.items():
        print(f"| {name} | {tokens / seconds:.0f} | {tokens / seconds / base_rate:.2f}x |")
    print(f"\nmask rows filled per step (llguidance, {args.requests} rows): median "
          f"{1e3 * statistics.median(clock.fill):.2f} ms; whole mask preparation per step (fetching the "
          f"previous token included): median {1e3 * statistics.median(clock.step):.2f} ms over {steps} steps a run")
    print(f"grammar compile (add_request to a ready matcher): cold {1e3 * cold:.1f} ms, cached {1e3 * cached:.2f} ms")


if __name__ == "__main__":
    main()
