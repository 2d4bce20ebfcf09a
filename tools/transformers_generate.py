"""The transformers side of `benchmarks/vs_transformers.py`: greedy `generate` of transformers 5.23
`DeepseekV4ForCausalLM` (PyTorch, CPU) on one of our checkpoints, timed per generated token.

Run it with the reference virtual environment (Python 3.11, torch 2.13 CPU, transformers 5.23; see
`/work/shared/tools/make_ref_venv.sh`), never with the project's Python; the benchmark does that:

    /tmp/refvenv/bin/python tools/transformers_generate.py --model DIR --prompts PROMPTS.json \
        --batch-sizes 1,8,32 --max-new-tokens 64 --repeats 3 --threads 2 --dtype bfloat16 --out RESULT.json

It is a tool, like `tools/make_golden.py` (whose loading approach it follows: `from_pretrained` with
`output_loading_info=True` and a refusal of missing weights, `eval()`), and lives in tools/ rather
than benchmarks/ because it imports torch at module level. transformers' conversion mapping reads
DeepSeek's own tensor names (our checkpoints' format) and ignores the `mtp.*` tensors.

PROMPTS.json is a list of equal-length prompts (token id lists); batch size B uses the first B.
For each B it runs one untimed 2-token `generate` (first-call costs of that shape: allocator,
oneDNN primitives), then --repeats timed calls and keeps the one with the median tokens/s (all
their tokens/s in `tokens_per_s_runs`), which records:

* wall time, output tokens (B x new tokens) and output tokens/s = tokens / wall;
* time to first token: from the `generate` call until the logits of the first generated token
  exist (a LogitsProcessor stamps the clock each time it is handed a step's scores; the greedy
  argmax that follows is negligible);
* each decode step's time (differences of those stamps), their median, and B / median;
* proof of incremental decoding: the sequence length of every forward call (the prompt once,
  then 1 per step: a model that recomputed the sequence would see growing lengths), the cache
  classes `generate` returned, and the ratio of the median step time in the last quarter of the
  steps to the first quarter (about 1 when the cost does not grow with length).

`ignore_eos` is emulated by `generation_config.eos_token_id = None` (no stopping criterion on
EOS, and unlike `min_new_tokens` no change to the logits), so every row gets exactly
--max-new-tokens tokens; this is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DeepseekV4ForCausalLM, LogitsProcessor, LogitsProcessorList

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class StepClock(LogitsProcessor):
    """Leaves the scores alone; stamps the time each step's logits reach the sampler."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        return scores


def load(model_dir: Path, dtype: str) -> DeepseekV4ForCausalLM:
    """The checkpoint as transformers loads it; a checkpoint missing weights is refused (their
    random init would make the comparison meaningless)."""
    model, info = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], output_loading_info=True)
    if info.get("missing_keys") or info.get("mismatched_keys"):
        raise ValueError(f"{model_dir}: transformers could not load every weight: missing "
                         f"{sorted(info.get('missing_keys', []))[:8]}, mismatched {info.get('mismatched_keys', [])[:8]}")
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos: run to max_new_tokens
    return model


def generate_kwargs(max_new_tokens: int) -> dict:
    """What each `generate` call gets besides the inputs (recorded in the report)."""
    return {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1, "use_cache": True,
            "pad_token_id": 0, "return_dict_in_generate": True}


def run_batch(model: DeepseekV4ForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """One timed greedy `generate` of `prompts` [B, prompt_len]; see the module docstring."""
    ids = torch.tensor(prompts, dtype=torch.long)
    lengths: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _mod, _args, kwargs: lengths.append(int(kwargs["input_ids"].shape[1])), with_kwargs=True)
    clock = StepClock()
    try:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([clock]),
                             **generate_kwargs(max_new_tokens))
        wall = time.perf_counter() - start
    finally:
        hook.remove()
    new = out.sequences[:, ids.shape[1]:]
    if new.shape[1] != max_new_tokens:
        raise RuntimeError(f"generate stopped after {new.shape[1]} of {max_new_tokens} tokens")
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    quarter = max(1, len(steps) // 4)
    cache = out.past_key_values
    batch = len(prompts)
    return {
        "batch": batch, "new_tokens": max_new_tokens, "output_tokens": batch * max_new_tokens, "wall_s": wall,
        "tokens_per_s": batch * max_new_tokens / wall, "ttft_s": clock.stamps[0] - start,
        "decode_step_s": steps, "decode_step_median_s": statistics.median(steps) if steps else None,
        "decode_tokens_per_s": batch / statistics.median(steps) if steps else None,
        "step_time_growth": statistics.median(steps[-quarter:]) / statistics.median(steps[:quarter]) if steps else None,
        "forward_input_lengths": lengths,
        "cache_class": type(cache).__name__,
        "cache_layer_classes": [type(layer).__name__ for layer in getattr(cache, "layers", [])],
        "token_ids": new.tolist(),
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count), with every
    run's tokens/s beside it."""
    chosen = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
    return {**chosen, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (DeepSeek's format)")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of equal-length token id lists")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="timed generate calls per batch size (median kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (expected a checkpoint directory)")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        args.batch_sizes = []
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes: expected comma-separated positive integers such as 1,8,32, got {args.batch_sizes!r}")
    if min(args.max_new_tokens, args.threads, args.repeats) < 1:
        parser.error(f"--max-new-tokens, --threads and --repeats must be positive, got {args.max_new_tokens}, "
                     f"{args.threads} and {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = json.loads(args.prompts.read_text())
    if len(prompts) < max(args.batch_sizes) or len({len(p) for p in prompts}) != 1:
        raise ValueError(f"{args.prompts}: need at least {max(args.batch_sizes)} prompts of one length, got "
                         f"{len(prompts)} of lengths {sorted({len(p) for p in prompts})}")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    model = load(args.model, args.dtype)
    load_s = time.perf_counter() - t0
    with torch.inference_mode():
        results = []
        for b in args.batch_sizes:
            run_batch(model, prompts[:b], 2)  # untimed: first-call costs of this shape
            runs = [run_batch(model, prompts[:b], args.max_new_tokens) for _ in range(args.repeats)]
            results.append(median_run(runs))
            r = results[-1]
            print(f"# transformers B={b}: {r['tokens_per_s']:.2f} tok/s, TTFT {r['ttft_s']:.2f} s, "
                  f"decode step {r['decode_step_median_s'] * 1e3:.0f} ms", flush=True)
    report = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "dtype": args.dtype, "load_s": load_s,
        "experts_implementation": model.config._experts_implementation,
        "attn_implementation": model.config._attn_implementation,
        "generate_kwargs": {**generate_kwargs(args.max_new_tokens), "attention_mask": "ones",
                            "generation_config.eos_token_id": None},
        "cpu_count": os.cpu_count(), "repeats": args.repeats, "results": results,
    }
    args.out.write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
