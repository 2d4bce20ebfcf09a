"""Runner benchmark: decode step time and prefill tokens/s of the model on the paged KV cache
(`dsv4_jax.engine.runner.ModelRunner`), each step split into host and device time.

    python benchmarks/runner.py [--model tiny|mid|both] [--kv-cache-dtype auto] [--batch-sizes 1,8,32]
                                [--repeats 5] [--json OUT] [--markdown FILE]

Plain script (jax, flax, numpy and this repository; no pytest), also `python -m benchmarks.runner`.
Models (random weights, DeepSeek's checkpoint format):

* ``tiny``: the built-in dsv4-tiny (`dsv4_jax.weights.builtin`: hidden 128, 4 layers, 129280 vocab, bf16).
* ``mid``: `mid_config()`, hidden 1024 and 8 layers in DeepSeek-V4-Flash's proportions, stored as
  DeepSeek ships Flash (fp8 linears in 128 x 128 blocks with ue8m0 scales, MXFP4 experts); written
  once (about 1.1 GB, about 90 s on 2 CPU cores) under $DSV4_JAX_CACHE or ~/.cache/dsv4-jax.

Workload. One runner per model with buckets prefill (1, --chunk) and decode (--batch-sizes),
compiled by `runner.warmup()` (its time is reported). Decode: B rows, one token each, sequence
slot i at position --context + k in step k (the cache is not prefilled: XLA's work depends on the
bucket shapes only and the kernels' on positions and block tables, not on the cached values).
Prefill: one sequence in chunks of --chunk tokens at positions 0, chunk, ... (--prefill-chunks).
One untimed step per workload after warm-up, then --repeats timed steps (prefill: repeats x chunks).

Timing, per step (host wall-clock, `time.perf_counter`):
* build: `runner.build(rows)`, the numpy batch (bucket pick, padding, block tables);
* device_put: one `jax.device_put` of those arrays, until they are on the device;
* host: the time until `runner.step(rows)` returns (it builds and puts the batch itself, then
  calls the jitted step, which returns once the step is launched);
* dispatch = host - build - device_put: the jitted call (flattening the weights and cache
  pytrees, which is also timed on its own and printed, argument checks, the launch);
* device = from that return until the step's outputs (logits, streams, cache) are ready.
build and device_put are measured on their own just before each step (same rows); each column is
the median over the timed steps, so host + device is close to, not exactly, the step median.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_jax  # noqa: E402
from dsv4_jax.weights.builtin import builtin_model_dir, cached_checkpoint  # noqa: E402
from dsv4_jax.config import DeepseekV4Config  # noqa: E402
from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepRow  # noqa: E402
from dsv4_jax.kv_cache.paged import PagedCacheLayout  # noqa: E402
from dsv4_jax.kv_cache.resolver import resolve_for_device  # noqa: E402
from dsv4_jax.presets import get_config  # noqa: E402
from dsv4_jax.testing import write_random_checkpoint  # noqa: E402

MODELS = ("tiny", "mid")
MID_SEED = 0
BLOCK_SIZE = 256
COLUMNS = ("model", "step", "kv cache", "rows x tokens", "step ms", "host ms", "build ms", "device_put ms",
           "dispatch ms", "device ms", "tokens/s")


def mid_config() -> DeepseekV4Config:
    """DeepSeek-V4-Flash scaled to hidden 1024 and 8 layers, keeping its proportions: head_dim 512
    with 64 RoPE dims (the fp8_ds_mla row as on Flash), heads x head_dim = 8 x hidden, 8 heads per
    output group (o_lora_rank 1024 per group), q_lora_rank = hidden / 4, expert width = hidden / 2,
    two sliding layers then CSA (ratio 4) and HCA (ratio 128) alternating, the first 3 layers hash
    routed, top-6 routing, hc_mult 4, window 128. Experts 256 -> 64 and index_topk 512 -> 128 (so
    top-k binds at benchmark contexts); no MTP layer (the runner does not run it)."""
    return get_config("dsv4-flash").replace(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, q_lora_rank=256, o_groups=2,
        o_lora_rank=1024, compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128), moe_intermediate_size=512,
        n_routed_experts=64, num_experts_per_tok=6, num_hash_layers=3, index_n_heads=16, index_topk=128,
        num_nextn_predict_layers=0,
    )


def mid_model_dir() -> Path:
    """The mid checkpoint, written on first use next to the built-in model (same cache root)."""

    def write(partial: Path) -> None:
        t0 = time.perf_counter()
        write_random_checkpoint(partial, mid_config(), seed=MID_SEED, quantize="fp8", tokenizer=False)
        print(f"# wrote the mid checkpoint in {time.perf_counter() - t0:.0f} s (once)", flush=True)

    return cached_checkpoint(f"bench-mid-seed{MID_SEED}", write)


def model_dir(name: str) -> Path:
    return builtin_model_dir() if name == "tiny" else mid_model_dir()


# ---- timing ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Seconds of one timed step (see the module docstring for what each part covers)."""

    build: float
    device_put: float
    host: float  # until runner.step returned
    device: float  # from that return until the outputs were ready

    @property
    def dispatch(self) -> float:
        return max(self.host - self.build - self.device_put, 0.0)

    @property
    def step(self) -> float:
        return self.host + self.device


def timed_step(runner: ModelRunner, rows: list[StepRow]) -> StepTiming:
    t0 = time.perf_counter()
    _, tokens, seqs = runner.build(rows)
    t1 = time.perf_counter()
    jax.block_until_ready(jax.device_put((tokens, seqs)))
    t2 = time.perf_counter()
    out = runner.step(rows)
    t3 = time.perf_counter()
    jax.block_until_ready((out.logits, out.streams, runner.cache))
    t4 = time.perf_counter()
    return StepTiming(build=t1 - t0, device_put=t2 - t1, host=t3 - t2, device=t4 - t3)


def head_ms(runner: ModelRunner, batch: int, dtype: str, repeats: int = 21) -> float:
    """Median ms of the vocabulary head alone (`runner.head`: the hyper-connection collapse, the
    final norm and the [hidden, vocab] dot) on `batch` decode rows, waited for each time: the part
    of a decode step that no scheduling can shrink. Compiles its own program first (untimed)."""
    streams = jax.numpy.zeros((batch, 1, runner.config.hc_mult, runner.config.hidden_size), dtype)
    jax.block_until_ready(runner.head(streams))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.head(streams))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def pytree_flatten_ms(runner: ModelRunner, repeats: int = 21) -> float:
    """Median ms to flatten the weights and the cache, which every jitted step call does first."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.tree.flatten((runner.weights, runner.cache))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def summarise(model: str, step: str, kv_cache: str, shape: tuple[int, int], tokens: int,
              timings: list[StepTiming]) -> dict:
    """One table row: medians in ms over `timings`; tokens/s = real tokens per step / step median.
    `kv_cache` says which cache and backend ran, e.g. "bfloat16 on xla"."""
    med = {k: statistics.median(getattr(t, k) for t in timings) for k in
           ("step", "host", "build", "device_put", "dispatch", "device")}
    return {
        "model": model, "step": step, "kv_cache": kv_cache, "bucket": list(shape), "tokens_per_step": tokens,
        "steps_timed": len(timings),
        **{f"{k}_ms": v * 1e3 for k, v in med.items()}, "tokens_per_s": tokens / med["step"],
    }


def table_line(row: dict) -> str:
    b, s = row["bucket"]
    cells = (row["model"], row["step"], row["kv_cache"], f"{b} x {s}", *(f"{row[f'{k}_ms']:.2f}" for k in
             ("step", "host", "build", "device_put", "dispatch", "device")), f"{row['tokens_per_s']:.1f}")
    return "| " + " | ".join(cells) + " |"


def table_header() -> list[str]:
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]


class RowSink:
    """Prints each row and, with a path, appends it to a markdown file at once (flushed), so a
    run killed by a timeout keeps the rows measured so far."""

    def __init__(self, path: str | None):
        self.path = path
        self._write(table_header(), "w")
        for line in table_header():
            print(line, flush=True)

    def add(self, row: dict) -> None:
        line = table_line(row)
        print(line, flush=True)
        self._write([line], "a")

    def _write(self, lines: list[str], mode: str) -> None:
        if self.path:
            with open(self.path, mode) as f:
                f.write("\n".join(lines) + "\n")
                f.flush()
                os.fsync(f.fileno())


# ---- the benchmark ----------------------------------------------------------------------------------
def make_runner(name: str, args: argparse.Namespace) -> tuple[ModelRunner, dict]:
    """Model `name` loaded, its runner warmed up, and what was set up (for the report)."""
    path = model_dir(name)
    t0 = time.perf_counter()
    model = dsv4_jax.load_model(path, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    spec = resolve_for_device(args.kv_cache_dtype, jax.devices()[0], args.attention_backend, model.config)
    # Decode rows reach position context + repeats + 1; prefill passes chunk x chunks tokens.
    max_len = max(args.context + args.repeats + 2, args.chunk * args.prefill_chunks)
    layout = PagedCacheLayout.build(model.config, spec, max_model_len=max_len, num_seq_slots=max(args.batch_sizes),
                                    block_size=BLOCK_SIZE)
    buckets = StepBuckets(prefill=((1, args.chunk),), decode=tuple(args.batch_sizes))
    runner = ModelRunner(model, layout, attention_backend=spec.attention_backend, buckets=buckets)
    t0 = time.perf_counter()
    compiles = runner.warmup()
    warmup_s = time.perf_counter() - t0
    print(f"# {name}: loaded in {load_s:.1f} s; {spec.summary()}; warm-up {compiles} compiles in {warmup_s:.1f} s",
          flush=True)
    return runner, {
        "model": name, "checkpoint": str(path), "config": model.config.to_dict(), "compute_dtype": args.dtype,
        "kv_cache": spec.summary(), "kv_cache_dtype": spec.kv_cache_dtype, "attention_backend": spec.attention_backend,
        "block_size": BLOCK_SIZE, "load_s": load_s, "warmup_compiles": compiles, "warmup_s": warmup_s,
    }


def seq_blocks(runner: ModelRunner, slot: int) -> list[int]:
    """Compressed block ids of sequence slot `slot`: its own max_blocks_per_seq blocks."""
    per_seq = runner.layout.max_blocks_per_seq
    return list(range(slot * per_seq, (slot + 1) * per_seq))


def time_decode(runner: ModelRunner, batch: int, args: argparse.Namespace, rng: np.random.Generator
                ) -> list[StepTiming]:
    ids = rng.integers(0, runner.config.vocab_size, size=(batch, args.repeats + 1))

    def rows(k: int) -> list[StepRow]:
        return [StepRow(s, args.context + k, [int(ids[s, k])], seq_blocks(runner, s)) for s in range(batch)]

    timed_step(runner, rows(0))  # untimed: the first run of the bucket's executable
    return [timed_step(runner, rows(k)) for k in range(1, args.repeats + 1)]


def time_prefill(runner: ModelRunner, args: argparse.Namespace, rng: np.random.Generator) -> list[StepTiming]:
    prompt = rng.integers(0, runner.config.vocab_size, size=args.chunk * args.prefill_chunks).tolist()

    def rows(j: int) -> list[StepRow]:
        return [StepRow(0, j * args.chunk, prompt[j * args.chunk : (j + 1) * args.chunk], seq_blocks(runner, 0))]

    timed_step(runner, rows(0))  # untimed
    return [timed_step(runner, rows(j)) for _ in range(args.repeats) for j in range(args.prefill_chunks)]


def bench_model(name: str, args: argparse.Namespace, sink: RowSink) -> dict:
    """Model `name`'s decode steps at each batch size, then its prefill chunks; one row each."""
    runner, report = make_runner(name, args)
    kv = f"{report['kv_cache_dtype']} on {report['attention_backend']}"
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch_sizes:
        rows.append(summarise(name, "decode", kv, (b, 1), b, time_decode(runner, b, args, rng)))
        sink.add(rows[-1])
    rows.append(summarise(name, "prefill", kv, (1, args.chunk), args.chunk, time_prefill(runner, args, rng)))
    sink.add(rows[-1])
    compiles = runner.compiles.compiles  # before the head's own programs below
    heads = {b: head_ms(runner, b, args.dtype) for b in args.batch_sizes}
    for b, row in zip(args.batch_sizes, rows):
        # Both wall-clock from the call to ready outputs (the head's own launch is small).
        print(f"# {name}: the vocabulary head alone at {b} rows takes {heads[b]:.2f} ms "
              f"({heads[b] / row['step_ms']:.0%} of the decode step's {row['step_ms']:.2f} ms)", flush=True)
    flatten_ms = pytree_flatten_ms(runner)
    leaves = (len(runner.weights), len(jax.tree.leaves(runner.cache)))
    print(f"# {name}: flattening the step's weights and cache pytrees ({leaves[0]} + {leaves[1]} leaves) takes "
          f"{flatten_ms:.2f} ms of each dispatch", flush=True)
    if compiles:
        print(f"# warning: {name} compiled {compiles} times after warm-up", flush=True)
    return {**report, "compiles_after_warmup": compiles, "flatten_ms": flatten_ms,
            "head_ms": heads, "weight_leaves": leaves[0], "cache_leaves": leaves[1], "rows": rows}


# ---- command line -------------------------------------------------------------------------------------
def batch_sizes(text: str) -> list[int]:
    """--batch-sizes: comma-separated positive integers, e.g. 1,8,32."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,8,32, got {text!r}")
    return sorted(set(sizes))


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=(*MODELS, "both"), default="both")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the server's flag (auto: bfloat16 on CPU)")
    parser.add_argument("--attention-backend", default=None, help="xla, pallas_fp8_ds_mla or pallas_bf16 "
                        "(default: what --kv-cache-dtype resolves to on this device)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 8, 32], help="decode rows per step")
    parser.add_argument("--repeats", type=positive, default=5, help="timed steps per workload")
    parser.add_argument("--context", type=positive, default=512, help="position of the decode rows")
    parser.add_argument("--chunk", type=positive, default=256, help="prefill tokens per step")
    parser.add_argument("--prefill-chunks", type=positive, default=2, help="chunks per timed prefill pass")
    parser.add_argument("--json", metavar="OUT", help="write every result and the configs to this file")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table here, one row as soon as measured")
    args = parser.parse_args(argv)
    if args.chunk < 2:
        parser.error(f"argument --chunk: a prefill chunk has at least 2 tokens, got {args.chunk}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = jax.devices()[0]
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    print(f"# runner benchmark {started} on {device.device_kind} ({device.platform}, {os.cpu_count()} CPUs, "
          f"load {load_before[0]:.2f}), jax {jax.__version__}, compute {args.dtype}", flush=True)
    sink = RowSink(args.markdown)
    names = MODELS if args.model == "both" else (args.model,)
    results = [bench_model(name, args, sink) for name in names]
    load_after = os.getloadavg()
    print(f"# done; load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after", flush=True)
    if args.json:
        report = {
            "started": started, "device_kind": device.device_kind, "platform": device.platform,
            "cpu_count": os.cpu_count(), "jax": jax.__version__, "argv": sys.argv, "args": {
                k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
            "load_average_before": load_before, "load_average_after": load_after, "models": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
