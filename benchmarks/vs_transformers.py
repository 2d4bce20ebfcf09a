"""Engine benchmark against transformers: offline output tokens/s of our `LLM.generate` beside
transformers 5.23 `DeepseekV4ForCausalLM.generate` on the same checkpoint, on CPU, back to back.

    python benchmarks/vs_transformers.py [--models tiny,mid] [--batch-sizes 1,8,32] [--prompt-len 32]
        [--max-tokens 64] [--ref-max-tokens N] [--repeats 3] [--ref-python /tmp/refvenv/bin/python] [--threads N]
        [--dtype bfloat16] [--compilation-cache DIR] [--json OUT] [--markdown FILE]

Plain script (no pytest). The transformers side is `tools/transformers_generate.py`, run with the
reference venv's Python (the team's `make_ref_venv.sh /tmp/refvenv`: Python 3.11, torch 2.13 CPU,
transformers 5.23); without that venv our side still runs and the transformers rows say why they
are missing.

Models (random weights, one checkpoint read by both sides):
* ``tiny``: the built-in dsv4-tiny (hidden 128, 4 layers, vocabulary 129280, bf16).
* ``mid``: `benchmarks.runner.mid_config()` (hidden 1024, 8 layers, DeepSeek-V4-Flash's
  proportions), written here as the bf16 twin of runner.py's fp8 checkpoint (the same weights,
  dequantized: transformers cannot run DeepSeek's fp8 / MXFP4 blocks on CPU), about 2.3 GB, once,
  under $DSV4_JAX_CACHE or ~/.cache/dsv4-jax.

Per model, three fresh processes in a row:
1. ours: `LLM(...)` (warm-up compiles every bucket: prefill (B, prompt_len) and decode B for each
   batch size B, so B=1 is not padded to 32 rows), one untimed 2-token generate per batch size
   (the first calls of its executables), then for each token count and batch size --repeats
   timed `llm.generate` calls of B random prompts (the same prompts as transformers gets), greedy
   with ignore_eos, async scheduling on and off in turn; the run with the median tokens/s is
   reported, the range of all of them beside it. Time to first token: from the `generate` call
   until the engine step that returned the request's first token (the engine's `step` is wrapped
   for the call to stamp its outputs).
2. restart: `LLM(...)` again in a fresh process with the persistent compilation cache that 1 just
   filled (JAX_COMPILATION_CACHE_DIR, every entry cached: min compile time and size 0): its
   construction time and XLA compiles (`CompileCounter`; a cache hit is no compile).
3. transformers: `tools/transformers_generate.py` (same prompts, same dtype, torch threads =
   the CPUs this process may use, which is what XLA uses; the same untimed call per batch size
   and the same --repeats, median kept). With one timed run per point the tiny 32-row ratio moves
   from 1.41 to ~2.8 between runs on a shared 2-CPU machine: hence the repeats.
--ref-max-tokens N gives transformers fewer tokens than ours when 64 would not fit the time
available (its decode step on the mid model takes seconds); ours then also runs N tokens, so the
tokens/s ratio compares equal work, and the decode ratio compares steady-state steps.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.runner import positive  # noqa: E402  (one flag parser for the benchmarks)
REF_SCRIPT = REPO / "tools" / "transformers_generate.py"
MODELS = ("tiny", "mid")
PROMPT_SEED = 0
TARGETS = {"tiny": 5.0, "mid": 1.0}  # the issue's: ours / transformers output tokens/s at the largest batch


# ---- checkpoints and prompts -----------------------------------------------------------------------
def mid_twin_dir() -> Path:
    """The bf16 twin of benchmarks/runner.py's mid checkpoint, written on first use."""
    from benchmarks.runner import MID_SEED, mid_config
    from dsv4_jax.weights.builtin import cached_checkpoint
    from dsv4_jax.testing import write_random_checkpoint

    def write(partial: Path) -> None:
        t0 = time.perf_counter()
        write_random_checkpoint(partial, mid_config(), seed=MID_SEED, dequantized_twin_of="fp8", tokenizer=False)
        print(f"# wrote the mid checkpoint (bf16) in {time.perf_counter() - t0:.0f} s (once)", flush=True)

    return cached_checkpoint(f"bench-mid-seed{MID_SEED}-bf16", write)


def model_dir(name: str) -> Path:
    from dsv4_jax.weights.builtin import builtin_model_dir

    return builtin_model_dir() if name == "tiny" else mid_twin_dir()


def make_prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    """[count, length] random token ids; batch size B takes the first B (both sides)."""
    rng = np.random.default_rng(PROMPT_SEED)
    return rng.integers(0, vocab_size, size=(count, length)).tolist()


# ---- our side (runs in a child process) ---------------------------------------------------------
def bench_buckets(batch_sizes: list[int], prompt_len: int):
    """One prefill bucket (B, prompt_len) and one decode bucket B per batch size: every step runs
    unpadded, as transformers' does."""
    from dsv4_jax.engine.runner import StepBuckets

    return StepBuckets(prefill=tuple((b, prompt_len) for b in batch_sizes), decode=tuple(batch_sizes))


def count_cache_events() -> dict[str, int]:
    """Persistent compilation cache hits and misses from now on, counted by a JAX listener. JAX
    0.12 also reports a backend compile for a cache hit (loading the executable), so
    `CompileCounter` counts hits too: compiles that really ran = compiles - hits."""
    import jax

    counts = {"cache_hits": 0, "cache_misses": 0}

    def listen(event: str, **_: object) -> None:
        kind = event.rsplit("/", 1)[-1]
        if event.startswith("/jax/compilation_cache/") and kind in counts:
            counts[kind] += 1

    jax.monitoring.register_event_listener(listen)
    return counts


def build_llm(args: argparse.Namespace):
    """(LLM, construction seconds, XLA compiles during construction, cache hits and misses then)."""
    from dsv4_jax import LLM
    from dsv4_jax.weights.builtin import builtin_model_dir
    from dsv4_jax.engine.compiles import CompileCounter

    counter, cache = CompileCounter(), count_cache_events()
    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=args.prompt_len + max(args.token_counts), max_num_seqs=max(args.batch_sizes), seed=0,
              tokenizer=builtin_model_dir(),  # the mid checkpoint has no tokenizer; the vocabulary is the same
              buckets=bench_buckets(args.batch_sizes, args.prompt_len))
    return llm, time.perf_counter() - t0, counter.compiles, dict(cache)


def timed_generate(llm, prompts: list[list[int]], max_tokens: int, async_scheduling: bool = True) -> dict:
    """One timed greedy `llm.generate` of `prompts` with ignore_eos; see the module docstring.
    `device_wait_s`: time the host spent waiting for sampled tokens (jax.device_get); the rest
    of the wall time is host work that did not overlap the device."""
    import jax

    from dsv4_jax import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stamps: dict[str, list[float]] = {}
    engine_step = llm.engine.step
    llm.engine.async_scheduling = async_scheduling
    device_get, waited = jax.device_get, [0.0]

    def timed_device_get(x):
        t = time.perf_counter()
        try:
            return device_get(x)
        finally:
            waited[0] += time.perf_counter() - t

    def stamped_step():
        outputs = engine_step()
        now = time.perf_counter()
        for out in outputs:
            stamps.setdefault(out.request_id, []).append(now)
        return outputs

    llm.engine.step = stamped_step  # an instance attribute: shadows the method for this call only
    jax.device_get = timed_device_get
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        del llm.engine.step
        jax.device_get = device_get
        llm.engine.async_scheduling = True
    token_ids = [o.outputs[0].token_ids for o in outs]
    if any(len(t) != max_tokens for t in token_ids):
        raise RuntimeError(f"expected {max_tokens} tokens per request, got {sorted({len(t) for t in token_ids})}")
    ttfts = [s[0] - start for s in stamps.values()]
    steps = [b - a for s in stamps.values() for a, b in itertools.pairwise(s)]
    batch = len(prompts)
    return {
        "batch": batch, "new_tokens": max_tokens, "output_tokens": batch * max_tokens, "wall_s": wall,
        "async_scheduling": async_scheduling, "device_wait_s": waited[0], "host_s": wall - waited[0],
        "tokens_per_s": batch * max_tokens / wall, "ttft_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
        "decode_step_median_s": statistics.median(steps) if steps else None,
        "decode_tokens_per_s": batch / statistics.median(steps) if steps else None,
        "token_ids": token_ids,
    }


def run_ours(args: argparse.Namespace) -> dict:
    """--role ours (construct, then time every token count x batch size) or start (construct only)."""
    import jax

    llm, construct_s, compiles, cache = build_llm(args)
    report = {"construct_s": construct_s, "construct_compiles": compiles, **cache, "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, "kv_cache": llm.spec.summary(), "dtype": args.dtype,
              "sampling_params": "SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)",
              "buckets": repr(llm.engine.runner.buckets)}
    if args.role == "ours":
        prompts = json.loads(Path(args.prompts).read_text())
        from dsv4_jax.engine.compiles import CompileCounter

        for b in args.batch_sizes:
            timed_generate(llm, prompts[:b], 2)  # untimed: first calls of this batch size's executables
        counter = CompileCounter()
        report["results"], report["results_sync"], report["repeats"] = [], [], args.repeats
        for n in args.token_counts:
            for b in args.batch_sizes:
                runs: dict[bool, list[dict]] = {True: [], False: []}
                for _ in range(args.repeats):
                    for overlap in (True, False):  # async scheduling on (the default), then off
                        r = timed_generate(llm, prompts[:b], n, async_scheduling=overlap)
                        runs[overlap].append(r)
                        print(f"# ours B={b} N={n} async={overlap}: {r['tokens_per_s']:.1f} tok/s, TTFT "
                              f"{r['ttft_s']:.2f} s, host {r['host_s']:.2f} s, device wait {r['device_wait_s']:.2f} s",
                              flush=True)
                report["results"].append(median_run(runs[True]))
                report["results_sync"].append(median_run(runs[False]))
        report["compiles_during_runs"] = counter.compiles
    Path(args.out).write_text(json.dumps(report) + "\n")
    return 0


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count), with every
    run's tokens/s beside it (as tools/transformers_generate.py reports its side)."""
    chosen = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
    return {**chosen, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


# ---- the comparison (parent process) -----------------------------------------------------------------
def child(cmd: list[str], env: dict[str, str], out: Path, timeout_s: int) -> dict:
    """Run one side in a fresh process; its JSON report plus the process wall time, or an error."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s", "process_s": time.perf_counter() - t0}
    if done.returncode != 0 or not out.is_file():
        return {"error": f"exit status {done.returncode} (see its output above)", "process_s": time.perf_counter() - t0}
    return {**json.loads(out.read_text()), "process_s": time.perf_counter() - t0}


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, float]:
    """(fraction of requests whose first token agrees, mean length of the common prefix)."""
    prefixes = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return sum(p > 0 for p in prefixes) / len(prefixes), statistics.mean(prefixes)


def compare_model(name: str, args: argparse.Namespace, work: Path) -> dict:
    path = model_dir(name)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts_file = work / f"{name}-prompts.json"
    prompts_file.write_text(json.dumps(make_prompts(max(args.batch_sizes), args.prompt_len, vocab)))
    ref_tokens = args.ref_max_tokens or args.max_tokens
    common = ["--model-dir", str(path), "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype,
              "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--prompt-len", str(args.prompt_len),
              "--token-counts", ",".join(map(str, sorted({args.max_tokens, ref_tokens}, reverse=True))),
              "--repeats", str(args.repeats)]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "JAX_COMPILATION_CACHE_DIR": str(args.compilation_cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    me = [sys.executable, str(Path(__file__).resolve())]
    report: dict = {"model": name, "checkpoint": str(path)}
    for role in ("ours", "start"):
        out = work / f"{name}-{role}.json"
        print(f"# {name}: {role} (load {load_average()})", flush=True)
        report[role] = child([*me, "--role", role, *common, "--prompts", str(prompts_file), "--out", str(out)],
                             env, out, args.timeout_s)
    out = work / f"{name}-transformers.json"
    if not Path(args.ref_python).is_file():
        report["transformers"] = {"error": f"--ref-python {args.ref_python} does not exist (make it with the team's "
                                           "make_ref_venv.sh: Python 3.11, torch 2.13 CPU, transformers 5.23)"}
    else:
        print(f"# {name}: transformers (load {load_average()})", flush=True)
        report["transformers"] = child(
            [args.ref_python, str(REF_SCRIPT), "--model", str(path), "--prompts", str(prompts_file),
             "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--max-new-tokens", str(ref_tokens),
             "--repeats", str(args.repeats),
             "--threads", str(args.threads), "--dtype", args.dtype, "--out", str(out)],
            {**os.environ, "PYTHONPATH": ""}, out, args.timeout_s)
    report["load_average_after"] = load_average()
    return report


# ---- report ---------------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _rate(r: dict) -> str:
    """A point's median output tokens/s, with the range of its runs when there were several."""
    runs = r.get("tokens_per_s_runs", [])
    spread = f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else ""
    return f"{_f(r['tokens_per_s'], 1)}{spread}"


def incremental_summary(lengths: list[int]) -> str:
    """"32, then 1 x 63" for [32, 1, 1, ...]: a cached decode feeds one token per forward."""
    if len(lengths) > 1 and set(lengths[1:]) == {1}:
        return f"{lengths[0]}, then 1 x {len(lengths) - 1}"
    return f"{lengths} (NOT one token per step)"


def markdown(reports: list[dict], header: dict) -> str:
    lines = [(f"Run {header['started']} on {header['machine']}; load average (1/5/15 min) {header['load_before']} "
              f"before, {header['load_after']} after."), "",
             ("| model | B | side | new tokens | output tok/s (median; range of the runs) | wall s | TTFT s | "
              "decode step ms | decode tok/s |"),
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = [("| model | B | new tokens | ours / transformers tok/s | ours / transformers decode tok/s | "
               "first token agrees | mean common prefix |"), "|---|---|---|---|---|---|---|"]
    verdicts = []
    for rep in reports:
        ours = {(r["batch"], r["new_tokens"]): r for r in rep["ours"].get("results", [])}
        theirs = {r["batch"]: r for r in rep["transformers"].get("results", [])}
        for (b, n), r in sorted(ours.items()):
            lines.append(f"| {rep['model']} | {b} | ours | {n} | {_rate(r)} | {_f(r['wall_s'])} | "
                         f"{_f(r['ttft_s'])} | {_f(r['decode_step_median_s'] * 1e3, 1)} | "
                         f"{_f(r['decode_tokens_per_s'], 1)} |")
            t = theirs.get(b)
            if t is not None and t["new_tokens"] == n:
                lines.append(f"| {rep['model']} | {b} | transformers | {n} | {_rate(t)} | "
                             f"{_f(t['wall_s'])} | {_f(t['ttft_s'])} | {_f(t['decode_step_median_s'] * 1e3, 1)} | "
                             f"{_f(t['decode_tokens_per_s'], 1)} |")
                first, prefix = agreement(r["token_ids"], t["token_ids"])
                ratios.append(f"| {rep['model']} | {b} | {n} | {r['tokens_per_s'] / t['tokens_per_s']:.2f} | "
                              f"{r['decode_tokens_per_s'] / t['decode_tokens_per_s']:.2f} | {first:.2f} | "
                              f"{prefix:.1f} of {n} |")
        for side in ("ours", "start", "transformers"):
            if "error" in rep[side]:
                lines.append(f"| {rep['model']} | - | {side} | - | {rep[side]['error']} | | | | |")
        big = max(b for b, _ in ours) if ours else None
        t = theirs.get(big)
        if t is not None and (big, t["new_tokens"]) in ours:
            ratio = ours[(big, t["new_tokens"])]["tokens_per_s"] / t["tokens_per_s"]
            goal = TARGETS[rep["model"]]
            verdicts.append(f"* {rep['model']}, B={big} x {t['new_tokens']} tokens: ours / transformers = "
                            f"{ratio:.2f} (target >= {goal:g}): **{'met' if ratio >= goal else 'NOT met'}**")
    evidence = [f"* {rep['model']}, B={r['batch']}: transformers' forward calls saw sequence lengths "
                f"{incremental_summary(r['forward_input_lengths'])}; cache {r['cache_class']} of "
                f"{', '.join(sorted(set(r['cache_layer_classes'])))}; median decode step in the last quarter / first "
                f"quarter = {_f(r['step_time_growth'])}"
                for rep in reports for r in rep["transformers"].get("results", [])]
    overlap = ["| model | B | async scheduling | output tok/s | host s (not overlapped) | device wait s |",
               "|---|---|---|---|---|---|"]
    for rep in reports:
        runs = [*rep["ours"].get("results", []), *rep["ours"].get("results_sync", [])]
        for r in sorted(runs, key=lambda r: (r["batch"], not r.get("async_scheduling", True))):
            overlap.append(f"| {rep['model']} | {r['batch']} | {'on' if r.get('async_scheduling', True) else 'off'} | "
                           f"{_rate(r)} | {_f(r.get('host_s'))} | {_f(r.get('device_wait_s'))} |")
    lines += ["", *ratios, "", *verdicts, "", *overlap, "", *evidence, "",
              ("| model | start | XLA compiles (CompileCounter) | persistent cache hits / misses | construction s | "
               "process s (import + load + warm-up) |"), "|---|---|---|---|---|---|"]
    for rep in reports:
        for label, side in (("first (benchmark run)", "ours"), ("restart, warm cache", "start")):
            r = rep[side]
            if "error" not in r:
                process_s = r["process_s"] if side == "start" else None  # the first process also ran the benchmark
                lines.append(f"| {rep['model']} | {label} | {r['construct_compiles']} | {r['cache_hits']} / "
                             f"{r['cache_misses']} | {_f(r['construct_s'], 1)} | {_f(process_s, 1)} |")
    return "\n".join(lines) + "\n"


# ---- command line -----------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. 1,8,32."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,8,32, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", default="tiny,mid", help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32], help="concurrent sequences")
    parser.add_argument("--prompt-len", type=positive, default=32, help="random prompt tokens per sequence")
    parser.add_argument("--max-tokens", type=positive, default=64, help="output tokens per sequence (ours)")
    parser.add_argument("--ref-max-tokens", type=positive, default=None,
                        help="output tokens per sequence for transformers (default: --max-tokens)")
    parser.add_argument("--repeats", type=positive, default=3,
                        help="timed runs per point, both sides; the median is reported")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype, both sides")
    parser.add_argument("--kv-cache-dtype", default="auto", help="ours (auto: bfloat16 on CPU)")
    parser.add_argument("--ref-python", default="/tmp/refvenv/bin/python", help="the reference venv's python")
    parser.add_argument("--threads", type=positive, default=len(os.sched_getaffinity(0)),
                        help="torch threads (default: the CPUs this process may use, as XLA)")
    parser.add_argument("--compilation-cache", type=Path, default=None,
                        help="persistent JAX compilation cache (default: a new empty directory per run)")
    parser.add_argument("--timeout-s", type=positive, default=1800, help="per child process")
    parser.add_argument("--json", metavar="OUT", help="write every result here")
    parser.add_argument("--markdown", metavar="FILE", help="write the tables here")
    # internal: the child processes of our side
    parser.add_argument("--role", choices=("compare", "ours", "start"), default="compare", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--token-counts", type=int_list, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"argument --models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.prompt_len < 2:
        parser.error(f"argument --prompt-len: a prefill bucket holds at least 2 tokens, got {args.prompt_len}")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role != "compare":
        return run_ours(args)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    header = {"started": started, "machine": f"{cpu_name()}, "
              f"{len(os.sched_getaffinity(0))} CPUs, {platform.platform()}", "load_before": load_average(),
              "argv": sys.argv}
    print(f"# vs transformers {started}, load {header['load_before']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vs-transformers-") as tmp:
        work = Path(tmp)
        if args.compilation_cache is None:
            args.compilation_cache = work / "xla-cache"
        reports = [compare_model(name, args, work) for name in args.models]
    header["load_after"] = load_average()
    text = markdown(reports, header)
    print(text, flush=True)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({**header, "args": {k: str(v) for k, v in vars(args).items()},
                                               "models": reports}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
