"""What prefix caching buys: time to first token with and without a hit, the throughput of a
workload whose prompts share half their tokens against its Amdahl bound, and the server's hit
rate on `python -m serve.bench --dataset-name prefix_repetition` against the ideal.

    python3 benchmarks/prefix_caching.py                 # the mid model (benchmarks/runner.py's mid_config)
    python3 benchmarks/prefix_caching.py --quick         # a smoke run on the built-in dsv4-tiny
    python3 benchmarks/prefix_caching.py --parts ttft,throughput --json out.json

Model: the mid checkpoint of benchmarks/runner.py (`mid_model_dir()`, written once, keyed by its
seed; the built-in model's tokenizer, as benchmarks/vs_transformers.py does), bf16 compute
(--dtype), the KV dtype that --kv-cache-dtype (default auto) resolves to on this device (printed;
bfloat16 on CPU). One `LLM` (prefix caching on, block size 256) serves parts 1 and 2, with
max_num_seqs = --tp-requests and max_model_len just above the longest request; the server of
part 3 gets the same engine flags, so its warm-up reads the LLM's executables from JAX's
persistent compilation cache. Prompts are random token ids (never a special token), greedy,
ignore_eos.

1. TTFT (`ttft`). Each round: `reset_prefix_cache()`, then a *miss*: a fresh random prefix of
   --prefix-len tokens plus --new-tokens random tokens, max_tokens 1 (this request is also the
   seeding request: it leaves the prefix's blocks and a snapshot at each block boundary in the
   cache); then a *hit*: the same prefix plus --new-tokens other tokens. TTFT is the engine's own
   `RequestOutput.metrics.first_token_time - arrival_time` (the wall time of the `generate` call
   is printed beside it). The first round is a warm-up (untimed); then --repeats rounds, medians
   reported. Checked: `num_cached_tokens` is 0 for every miss and floor(prefix_len / block) *
   block for every hit (2048 with the defaults).

2. Throughput (`throughput`). --tp-requests requests of --tp-prompt-len tokens, submitted
   together in one `generate`, --tp-output-len output tokens each. Three workloads, each run
   --tp-repeats times (best taken), after one untimed warm-up batch of short prompts:
   * off: every prompt fresh random tokens. Nothing can hit, so this is the no-cache run: the
     same tokens computed as with caching off (the engine still takes its boundary snapshots, so
     their cost is in the baseline too). T_off.
   * half: every prompt only the private part, --tp-prompt-len - --tp-shared-len fresh tokens
     (same count, same output length). T_half: the no-cache run's time less the prefill of the
     shared part.
   * on: `reset_prefix_cache()`, one untimed seeding request (a fresh shared part of
     --tp-shared-len tokens plus a private part), then the timed batch: the shared part plus a
     fresh private part each. Checked: every request's `num_cached_tokens` is the shared part
     rounded down to a block. T_on.
   tokens/s = (prompt + output tokens of the batch) / seconds. Speedup = T_off / T_on.
   How p is measured: p, the fraction of the no-cache run's time spent prefilling the shared
   half, is (T_off - T_half) / T_off, i.e. the time the no-cache run needs beyond the same
   workload without the shared tokens. Amdahl's bound on the speedup when that prefill becomes
   free is 1 / (1 - p) = T_off / T_half, so speedup / bound = T_half / T_on: how close the cached
   run comes to a run that never had the shared tokens. The half run's tokens sit at positions
   [0, private) rather than [shared, prompt) (a little less attention work; the mid model's
   attention is windowed / top-k sparse, so little), which makes the bound, if anything, high.

3. Hit rate (`serve`). `python -m serve MODEL` with the same engine flags (a free port; waits for
   /health), reads `/metrics`, runs `python -m serve.bench --dataset-name prefix_repetition`
   (--serve-* flags; completions with token ids, all requests sent at once unless
   --serve-max-concurrency), reads `/metrics` again: measured hit rate = delta
   vllm:prefix_cache_hits_total / delta vllm:prefix_cache_queries_total (both in prompt tokens).
   Ideal: per prefix the first request misses and each later one hits floor(prefix_len / block)
   * block tokens (its random suffix never hits; the deepest hit keeps at least the last prompt
   token to compute, which a suffix >= 1 always leaves), over num_prompts * (prefix + suffix)
   queried tokens. Requests sent at once can be admitted together before their prefix is cached
   (all miss), which the ideal does not count: the table also gives what to expect when they are
   admitted in waves of the largest prefill bucket's rows (8 here) in the dataset's order
   (`wave_hit_rate`, an estimate; a request admitted while another still computes its prefix
   hits the blocks done so far, so partial hits occur). With --serve-sequential-check (default on) the script runs the
   dataset again with another seed (new prefixes) one request at a time, where the ideal must be
   met exactly (a check).

Prints a markdown table (and its progress as it goes); --json PATH writes every figure. The
default run took 742 s on 2 AMD EPYC cores (engine build 82 s, TTFT 79 s, throughput 309 s,
server 272 s); --quick 35 s (2.5 min with a cold compilation cache). Exit status 1 when a check
fails (a hit or miss other than expected, a request short of its tokens, the one-at-a-time hit
rate off the ideal, a server that never became healthy); compiles after the offline engine's
warm-up are reported, not checked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages (benchmarks) importable

from benchmarks.runner import mid_model_dir, positive  # noqa: E402
from benchmarks.serve_check import free_port, stop_server, wait_healthy  # noqa: E402
from dsv4_jax.engine.args import default_buckets  # noqa: E402

BLOCK_SIZE = 256  # the engine's default --block-size
TOKEN_RANGE = (1000, 100000)  # random prompt ids: plain tokens of the V4 vocabulary, no special ones
PARTS = ("ttft", "throughput", "serve")
# --quick: the built-in dsv4-tiny (max_position_embeddings 1024), sizes that fit it.
QUICK = {"prefix_len": 768, "new_tokens": 32, "repeats": 3, "tp_requests": 16, "tp_prompt_len": 1000,
         "tp_shared_len": 512, "tp_output_len": 8, "tp_repeats": 2, "serve_prompts": 16, "serve_prefix_len": 512,
         "serve_suffix_len": 128, "serve_num_prefixes": 4, "serve_output_len": 8}
FULL = {"prefix_len": 2048, "new_tokens": 32, "repeats": 3, "tp_requests": 16, "tp_prompt_len": 2048,
        "tp_shared_len": 1024, "tp_output_len": 8, "tp_repeats": 1, "serve_prompts": 32, "serve_prefix_len": 1024,
        "serve_suffix_len": 256, "serve_num_prefixes": 4, "serve_output_len": 8}


def log(message: str) -> None:
    print(f"# [{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cached_len(prompt_len: int, prefix_len: int) -> int:
    """Tokens a hit on a cached `prefix_len`-token prefix skips for a `prompt_len`-token prompt:
    the deepest block boundary within the prefix that leaves the last prompt token to compute."""
    return min(prefix_len // BLOCK_SIZE, (prompt_len - 1) // BLOCK_SIZE) * BLOCK_SIZE


def wave_hit_rate(args: argparse.Namespace, seed: int, rows: int) -> dict:
    """What to expect when every request is sent at once: if they reach the engine in the
    dataset's order and are admitted in waves of `rows` (the largest prefill bucket's rows), each
    wave's prefills running to the end before the next is admitted, a request hits only when its
    prefix came in an earlier wave. An estimate (arrival order and wave edges vary), not a check."""
    from serve.bench_datasets import prefix_repetition_requests

    requests = prefix_repetition_requests(args.serve_prompts, args.serve_prefix_len, args.serve_suffix_len,
                                          args.serve_num_prefixes, args.serve_output_len, vocab_size=32000,
                                          as_text=False, seed=seed)  # serve.bench's default --random-vocab-size
    names: dict[tuple, int] = {}
    order = [names.setdefault(tuple(r.prompt[: args.serve_prefix_len]), len(names)) for r in requests]
    hit_requests = sum(order[i] in order[: i // rows * rows] for i in range(len(order)))
    hits = hit_requests * cached_len(args.serve_prefix_len + args.serve_suffix_len, args.serve_prefix_len)
    return {"rows": rows, "prefix_order": order, "requests_hit": hit_requests, "hits": hits,
            "rate": hits / (args.serve_prompts * (args.serve_prefix_len + args.serve_suffix_len))}


def ideal_hit_rate(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int) -> dict:
    """The prefix_repetition dataset's best hit rate (serve/bench_datasets.py: request i has prefix
    i % num_prefixes): each prefix's first request misses, the others hit its cached blocks."""
    per_prefix = [len(range(k, num_prompts, num_prefixes)) for k in range(num_prefixes)]
    hits = sum(n - 1 for n in per_prefix if n) * cached_len(prefix_len + suffix_len, prefix_len)
    queries = num_prompts * (prefix_len + suffix_len)
    return {"hits": hits, "queries": queries, "rate": hits / queries}


# ---- parts 1 and 2: the offline engine ------------------------------------------------------------
class Offline:
    def __init__(self, args: argparse.Namespace, model: str, tokenizer: str | None):
        import numpy as np

        from dsv4_jax import LLM, SamplingParams
        from dsv4_jax.engine.compiles import CompileCounter

        self.SamplingParams, self.rng = SamplingParams, np.random.default_rng(args.seed)
        t0 = time.perf_counter()
        kwargs = {"tokenizer": tokenizer} if tokenizer else {}
        self.llm = LLM(model=model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                       max_model_len=args.max_model_len, max_num_seqs=args.tp_requests, seed=0,
                       enable_prefix_caching=True, **kwargs)
        self.build_s = time.perf_counter() - t0
        self.compiles = CompileCounter()  # from here on: compiles after the build's warm-up
        self.failures: list[str] = []
        cfg = self.llm.engine_config
        self.setup = {"build_s": self.build_s, "kv_cache": self.llm.spec.summary(),
                      "kv_cache_dtype": self.llm.spec.kv_cache_dtype,
                      "attention_backend": self.llm.spec.attention_backend, "compute_dtype": args.dtype,
                      "max_model_len": cfg.max_model_len, "max_num_seqs": cfg.max_num_seqs,
                      "num_prefix_snapshots": cfg.num_prefix_snapshots,
                      "snapshot_mib": cfg.snapshot_bytes / 2**20, "buckets": repr(cfg.buckets)}
        log(f"engine built in {self.build_s:.1f} s: {self.llm.spec.kv_cache_dtype} KV on "
            f"{self.llm.spec.attention_backend}, max_num_seqs {cfg.max_num_seqs}, max_model_len {cfg.max_model_len}, "
            f"{cfg.num_prefix_snapshots} snapshots of {cfg.snapshot_bytes / 2**20:.2f} MiB, {cfg.buckets}")

    def fresh(self, n: int) -> list[int]:
        return self.rng.integers(*TOKEN_RANGE, size=n).tolist()

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)
            log(f"CHECK FAILED: {what}")

    def generate(self, prompts: list[list[int]], max_tokens: int):
        """(wall seconds, outputs) of one greedy generate of `prompts`, submitted together."""
        params = self.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    def reset(self) -> None:
        self.check(self.llm.reset_prefix_cache() is True, "reset_prefix_cache() returned False with nothing running")

    # ---- 1. TTFT -------------------------------------------------------------------------------
    def ttft(self, args: argparse.Namespace) -> dict:
        expect = cached_len(args.prefix_len + args.new_tokens, args.prefix_len)
        rounds = []
        for i in range(args.repeats + 1):
            self.reset()
            prefix = self.fresh(args.prefix_len)
            row = {}
            for kind in ("miss", "hit"):
                wall, (out,) = self.generate([prefix + self.fresh(args.new_tokens)], 1)
                m = out.metrics
                row[kind] = {"ttft_s": m.first_token_time - m.arrival_time, "wall_s": wall,
                             "num_cached_tokens": out.num_cached_tokens}
                want = 0 if kind == "miss" else expect
                self.check(out.num_cached_tokens == want, f"ttft round {i} {kind}: num_cached_tokens "
                           f"{out.num_cached_tokens}, expected {want}")
            log(f"ttft round {i}{' (warm-up)' if i == 0 else ''}: miss {row['miss']['ttft_s']:.3f} s "
                f"(cached {row['miss']['num_cached_tokens']}), hit {row['hit']['ttft_s']:.3f} s "
                f"(cached {row['hit']['num_cached_tokens']})")
            if i:
                rounds.append(row)
        med = {kind: {k: statistics.median(r[kind][k] for r in rounds) for k in ("ttft_s", "wall_s")}
               for kind in ("miss", "hit")}
        return {"prefix_len": args.prefix_len, "new_tokens": args.new_tokens, "expected_cached": expect,
                "rounds": rounds, "median": med, "ratio": med["miss"]["ttft_s"] / med["hit"]["ttft_s"],
                "ratio_wall": med["miss"]["wall_s"] / med["hit"]["wall_s"]}

    # ---- 2. throughput ---------------------------------------------------------------------------
    def throughput(self, args: argparse.Namespace) -> dict:
        n, plen, shared, out_len = args.tp_requests, args.tp_prompt_len, args.tp_shared_len, args.tp_output_len
        private = plen - shared
        expect = cached_len(plen, shared)
        wall, _ = self.generate([self.fresh(min(300, plen)) for _ in range(n)], out_len)
        log(f"throughput warm-up batch ({n} x {min(300, plen)} tokens): {wall:.1f} s")

        def off() -> list[list[int]]:
            return [self.fresh(plen) for _ in range(n)]

        def half() -> list[list[int]]:
            return [self.fresh(private) for _ in range(n)]

        def on() -> list[list[int]]:
            self.reset()
            prefix = self.fresh(shared)
            seconds, (seed,) = self.generate([prefix + self.fresh(private)], out_len)
            log(f"  seeding request: {seconds:.1f} s, num_cached_tokens {seed.num_cached_tokens}")
            return [prefix + self.fresh(private) for _ in range(n)]

        runs: dict[str, list[dict]] = {"off": [], "half": [], "on": []}
        for r in range(args.tp_repeats):
            for name, make in (("off", off), ("half", half), ("on", on)):
                prompts = make()
                seconds, outs = self.generate(prompts, out_len)
                cached = [o.num_cached_tokens for o in outs]
                want = expect if name == "on" else 0
                self.check(all(c == want for c in cached), f"throughput {name} run {r}: num_cached_tokens "
                           f"{sorted(set(cached))}, expected all {want}")
                self.check(all(len(o.outputs[0].token_ids) == out_len for o in outs),
                           f"throughput {name} run {r}: not every request generated {out_len} tokens")
                tokens = sum(len(p) for p in prompts) + n * out_len
                runs[name].append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                                   "requests_per_s": n / seconds, "cached_tokens": cached})
                log(f"throughput {name} run {r}: {seconds:.2f} s, {tokens / seconds:.0f} tokens/s, "
                    f"num_cached_tokens {sorted(set(cached))}")
        best = {name: min(rs, key=lambda x: x["seconds"]) for name, rs in runs.items()}
        t_off, t_half, t_on = (best[k]["seconds"] for k in ("off", "half", "on"))
        p = (t_off - t_half) / t_off
        bound = 1 / (1 - p)
        speedup = t_off / t_on
        return {"requests": n, "prompt_len": plen, "shared_len": shared, "output_len": out_len,
                "expected_cached": expect, "runs": runs, "best": {k: {kk: vv for kk, vv in v.items()
                                                                      if kk != "cached_tokens"}
                                                                  for k, v in best.items()},
                "p": p, "bound": bound, "speedup": speedup, "speedup_over_bound": speedup / bound}


# ---- part 3: the server ---------------------------------------------------------------------------
def scrape(base: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=30).text
    values = {}
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total"):
        match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else float("nan")
    return values


def run_bench(args: argparse.Namespace, base: str, seed: int, concurrency: int | None, out_dir: Path) -> dict:
    name = f"bench-seed{seed}.json"
    command = [sys.executable, "-m", "serve.bench", "--base-url", base, "--dataset-name", "prefix_repetition",
               "--num-prompts", str(args.serve_prompts), "--prefix-repetition-prefix-len", str(args.serve_prefix_len),
               "--prefix-repetition-suffix-len", str(args.serve_suffix_len),
               "--prefix-repetition-num-prefixes", str(args.serve_num_prefixes),
               "--prefix-repetition-output-len", str(args.serve_output_len), "--seed", str(seed), "--disable-tqdm",
               "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    if concurrency:
        command += ["--max-concurrency", str(concurrency)]
    before = scrape(base)
    log("running: " + " ".join(command[1:]))
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s,
                          check=False)
    seconds = time.perf_counter() - t0
    print(done.stdout[-2500:], flush=True)
    if done.returncode:
        print(done.stderr[-2500:], flush=True)
    after = scrape(base)
    delta = {k: after[k] - before[k] for k in after}
    result = json.loads((out_dir / name).read_text()) if (out_dir / name).exists() else {}
    queries, hits = delta["vllm:prefix_cache_queries_total"], delta["vllm:prefix_cache_hits_total"]
    ideal = ideal_hit_rate(args.serve_prompts, args.serve_prefix_len, args.serve_suffix_len, args.serve_num_prefixes)
    block_hit = cached_len(args.serve_prefix_len + args.serve_suffix_len, args.serve_prefix_len)
    rows = default_buckets(args.tp_requests, args.max_model_len, None).prefill[-1][0]
    waves = wave_hit_rate(args, seed, concurrency if concurrency and concurrency < rows else rows)
    return {"seed": seed, "max_concurrency": concurrency, "waves": waves, "seconds": seconds,
            "exit_status": done.returncode,
            "completed": result.get("completed"), "failed": result.get("failed"),
            "request_throughput": result.get("request_throughput"), "mean_ttft_ms": result.get("mean_ttft_ms"),
            "median_ttft_ms": result.get("median_ttft_ms"), "metrics_delta": delta, "queries": queries,
            "hits": hits, "rate": hits / queries if queries else float("nan"),
            # hit tokens in whole-prefix hits: a fraction means a partial hit (a request admitted
            # while another was still computing its prefix takes the blocks done so far)
            "requests_hit": hits / block_hit if block_hit else None, "ideal": ideal,
            "ideal_requests_hit": ideal["hits"] / block_hit if block_hit else None}


def serve_part(args: argparse.Namespace, model: str, tokenizer: str | None, failures: list[str]) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "serve", model, "--port", str(port), "--dtype", args.dtype,
               "--kv-cache-dtype", args.kv_cache_dtype, "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.tp_requests), "--seed", "0", "--enable-prompt-tokens-details"]
    if tokenizer:
        command += ["--tokenizer", tokenizer]
    out_dir = Path(tempfile.mkdtemp(prefix="prefix_caching_bench_"))
    server_log = out_dir / "server.log"
    log("starting: " + " ".join(command[1:]) + f" (log: {server_log})")
    with open(server_log, "w") as f:
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=f,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    report: dict = {"command": command[1:], "log": str(server_log), "runs": []}
    try:
        healthy = wait_healthy(process, base, time.monotonic() + args.timeout_s)
        if healthy is None:
            failures.append(f"server not healthy (exit status {process.poll()}); log tail: "
                            f"{server_log.read_text(errors='replace')[-1500:]}")
            log(failures[-1])
            return report
        report["healthy_s"] = healthy
        log(f"server healthy after {healthy:.1f} s")
        report["runs"].append(run_bench(args, base, 0, args.serve_max_concurrency, out_dir))
        if args.serve_sequential_check:
            report["runs"].append(run_bench(args, base, 1, 1, out_dir))
        for run in report["runs"]:
            if run["completed"] != args.serve_prompts:
                failures.append(f"serve.bench seed {run['seed']}: {run['completed']} of {args.serve_prompts} completed")
            if run["max_concurrency"] == 1 and run["hits"] != run["ideal"]["hits"]:
                failures.append(f"serve.bench one at a time (seed {run['seed']}): {run['hits']:.0f} hit tokens, "
                                f"ideal {run['ideal']['hits']}")
    finally:
        report["exit_status"] = stop_server(process, timeout_s=60)
    return report


# ---- report -------------------------------------------------------------------------------------------
def print_tables(report: dict) -> None:
    offline = report.get("offline")
    kv = (f"{offline['kv_cache_dtype']} KV on {offline['attention_backend']}" if offline
          else f"--kv-cache-dtype {report['args']['kv_cache_dtype']} (the server's log names the layout)")
    print(f"\n## Prefix caching, {report['model']} ({report['device']}, {report['cpus']} CPUs), "
          f"compute {report['args']['dtype']}, {kv}, block {BLOCK_SIZE}\n")
    print("| figure | value |\n|---|---|")
    if "ttft" in report:
        t = report["ttft"]
        med = t["median"]
        print(f"| TTFT miss ({t['prefix_len']} + {t['new_tokens']} tokens, median of {len(t['rounds'])}) | "
              f"{med['miss']['ttft_s'] * 1e3:.0f} ms (generate wall {med['miss']['wall_s'] * 1e3:.0f} ms) |")
        print(f"| TTFT hit ({t['expected_cached']} cached + {t['prefix_len'] + t['new_tokens'] - t['expected_cached']}"
              f" computed, median) | {med['hit']['ttft_s'] * 1e3:.0f} ms (generate wall "
              f"{med['hit']['wall_s'] * 1e3:.0f} ms) |")
        print(f"| TTFT miss / hit | {t['ratio']:.1f}x (wall {t['ratio_wall']:.1f}x; target >= 5x) |")
    if "throughput" in report:
        t = report["throughput"]
        for name, label in (("off", f"no cache: {t['requests']} x {t['prompt_len']} fresh tokens"),
                            ("half", f"private half only: {t['requests']} x {t['prompt_len'] - t['shared_len']}"),
                            ("on", (f"cache on: {t['shared_len']} shared (hit {t['expected_cached']}) + "
                                    f"{t['prompt_len'] - t['shared_len']} fresh"))):
            b = t["best"][name]
            print(f"| throughput, {label}, {t['output_len']} out | {b['seconds']:.2f} s, {b['tokens_per_s']:.0f} "
                  f"tokens/s, {b['requests_per_s']:.2f} req/s |")
        print(f"| p = (T_off - T_half) / T_off | {t['p']:.3f} |")
        print(f"| Amdahl bound 1 / (1 - p) | {t['bound']:.2f}x |")
        print(f"| measured speedup T_off / T_on | {t['speedup']:.2f}x |")
        print(f"| speedup / bound | {t['speedup_over_bound']:.2f} (target >= 0.9) |")
    if "serve" in report:
        for run in report["serve"].get("runs", []):
            how = "one at a time" if run["max_concurrency"] == 1 else (
                f"at most {run['max_concurrency']} at once" if run["max_concurrency"] else "all at once")
            ideal = run["ideal"]
            print(f"| server hit rate, prefix_repetition seed {run['seed']}, {how} | {run['rate']:.3f} "
                  f"({run['hits']:.0f} / {run['queries']:.0f} tokens, = {run['requests_hit']:.2f} full prefix hits); "
                  f"ideal {ideal['rate']:.3f} ({ideal['hits']} / {ideal['queries']}, "
                  f"{run['ideal_requests_hit']:.0f} requests); expected with waves of {run['waves']['rows']} "
                  f"admitted together: {run['waves']['rate']:.3f} ({run['waves']['requests_hit']} requests); "
                  f"preemptions "
                  f"{run['metrics_delta']['vllm:num_preemptions_total']:.0f}; {run['completed']} completed in "
                  f"{run['seconds']:.1f} s |")
    if report["failures"]:
        print("\nFAILED checks:\n" + "\n".join(f"* {f}" for f in report["failures"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="dsv4-tiny and sizes that fit it: a smoke run")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the server's flag (auto: bfloat16 on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts of parts 1 and 2")
    for name, default in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive, default=None,
                            help=f"default {default} ({QUICK[name]} with --quick)")
    parser.add_argument("--serve-max-concurrency", type=positive, default=None,
                        help="serve.bench --max-concurrency (default: all requests at once)")
    parser.add_argument("--serve-sequential-check", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the dataset with another seed one request at a time (ideal exactly)")
    parser.add_argument("--timeout-s", type=positive, default=900, help="server start-up / one serve.bench run")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    args = parser.parse_args(argv)
    for name, default in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if bad := [p for p in args.parts if p not in PARTS]:
        parser.error(f"--parts: unknown {bad}; allowed {', '.join(PARTS)}")
    if args.tp_shared_len >= args.tp_prompt_len:
        parser.error("--tp-shared-len must be shorter than --tp-prompt-len")
    longest = max(args.prefix_len + args.new_tokens + 1, args.tp_prompt_len + args.tp_output_len,
                  args.serve_prefix_len + args.serve_suffix_len + args.serve_output_len)
    args.max_model_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_before = os.getloadavg()
    if args.quick:
        from dsv4_jax.weights.builtin import builtin_model_dir

        model, tokenizer, name = str(builtin_model_dir()), None, "dsv4-tiny"
    else:
        from dsv4_jax.weights.builtin import builtin_model_dir

        model, tokenizer, name = str(mid_model_dir()), str(builtin_model_dir()), "mid (benchmarks/runner.py mid_config)"
    import jax

    device = jax.devices()[0]
    log(f"prefix caching benchmark: {name} at {model}; {device.device_kind}, {os.cpu_count()} CPUs, load "
        f"{load_before[0]:.2f}; parts {args.parts}; max_model_len {args.max_model_len}")
    report: dict = {"started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "model": name,
                    "checkpoint": model, "device": device.device_kind, "cpus": os.cpu_count(), "argv": sys.argv,
                    "args": {k: v for k, v in vars(args).items() if k != "json"}, "load_before": load_before,
                    "failures": []}
    if "ttft" in args.parts or "throughput" in args.parts:
        offline = Offline(args, model, tokenizer)
        report["offline"] = offline.setup
        if "ttft" in args.parts:
            report["ttft"] = offline.ttft(args)
        if "throughput" in args.parts:
            report["throughput"] = offline.throughput(args)
        report["offline"]["compiles_after_warmup"] = offline.compiles.compiles
        report["offline"]["built_after_warmup"] = offline.compiles.built
        report["failures"] += offline.failures
        log(f"offline engine: {offline.compiles.compiles} XLA compiles ({offline.compiles.built} executables built) "
            "after its warm-up")
        del offline  # its pools, before the server takes its own
    if "serve" in args.parts:
        report["serve"] = serve_part(args, model, tokenizer, report["failures"])
    report["load_after"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    print_tables(report)
    print(f"\nwall {report['wall_s']:.0f} s; load average (1 min) {load_before[0]:.2f} before, "
          f"{report['load_after'][0]:.2f} after", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
