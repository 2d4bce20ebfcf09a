"""What speculative decoding buys: decode tokens/s with drafts that are always right, against
decoding without drafts in the same engine, beside the bound the measured step times allow; the
cost of steps whose drafts are all rejected; the MTP block's acceptance on random weights.

    python3 benchmarks/speculative_decoding.py                  # the mid model with an MTP block
    python3 benchmarks/speculative_decoding.py --quick          # a smoke run on the built-in dsv4-tiny
    python3 benchmarks/speculative_decoding.py --batch-sizes 1,8 --k 1,2,3 --json out.json

Model: benchmarks/runner.py's `mid_config()` with one MTP layer (num_nextn_predict_layers 1,
`mid_mtp_config()`), stored as that mid model is (fp8 linears, MXFP4 experts, random weights,
seed `MID_SEED`) and written once by the same helper (`cached_checkpoint`) under its own key,
``bench-mid-mtp1-seed0`` (runner.py's plain mid checkpoint is ``bench-mid-seed0``: the two never
collide); the built-in model's tokenizer. --quick: the built-in dsv4-tiny, which has an MTP block.
Compute bf16 (--dtype), the KV dtype that --kv-cache-dtype resolves to (bfloat16 on CPU).

Engines. One `LLM` per k in --k, with speculative_config {"method": "mtp",
"num_speculative_tokens": k}, prefix caching off, max_num_seqs the largest batch, max_model_len
prompt + max_tokens + k rounded up to a block (256), and buckets prefill (1, P) and (B_max, P)
(P = --prompt-len: every prompt of a batch prefills in one step), decode --batch-sizes. On CPUs
the runner widens a one-row decode bucket to two rows (`runner.CPU_MIN_DECODE_ROWS`) and then
adds a verify bucket (B, k + 1) for each decode bucket B, so at batch 1 both t_decode and
t_verify are two-row steps' (one row padding). Scheduling is synchronous when speculating
(engine/speculative.py), for every drafter below, the no-draft baseline included.

Workload, per engine and batch B: B prompts of P random token ids (the same for every k), greedy,
ignore_eos, max_tokens N = --max-tokens (default 25: the N - 1 = 24 tokens after the first are a
multiple of k + 1 for k = 1, 2, 3, so the always-right run's last verify step is a full one; 61
gives 60, also such a multiple). The
drafter is swapped between runs (`llm.engine.drafter`, as tests/test_speculative.py does):

* base: `ReplayDrafter({}, V)`, which proposes nothing: every step is a plain decode step (one
  token per row). The no-speculation baseline, in the same engine. Its untimed first run is the
  warm-up and gives the outputs the next two drafters replay.
* right: `ReplayDrafter(outputs)`: every draft is the token the greedy run emits (all accepted).
  With bf16 a verify step's logits are not bitwise a decode step's, and random weights have near
  ties, so a row may take the other token there than the no-draft run did (seen at batch 8), after
  which a replay of the no-draft run's tokens is wrong for that row, and the batch waits for it.
  So the replay is made a fixed point first (untimed): rerun replaying the last run's tokens until
  every draft is kept (each rerun moves the first difference later; 1 to 3 runs). The rows whose
  greedy tokens then differ from the no-draft run's are counted and reported.
* wrong: the same replay with `right=lambda done, k: 0`: every draft rejected, each step a
  verify step of k + 1 positions per row that emits one token: the cost of fully rejected steps.
* mtp: drafter None, the checkpoint's MTP block on the device (its draft program after every
  step). Acceptance = accepted / drafted tokens from `engine.spec_decode_stats` deltas, and per
  draft position; on random weights the drafts are essentially random tokens: near zero.
After the warm-up, one short untimed generate per drafter (every executable run once), then
--repeats rounds of base, right, wrong (interleaved, so a burst of load from elsewhere falls on
all three), the best (fastest) of each kept; mtp --mtp-repeats times. Checked: the right runs
keep every draft and give the replayed tokens, the wrong runs keep none and verify every row in
each step; other runs' tokens that differ from the replay's (near ties) are reported.

Timing. Decode time excludes prefill, from the engine's own `RequestOutput.metrics`
(time.monotonic): T = max(last_token_time) - min(first_token_time) over the batch, the time from
the prefill step's update (the first token) to the update that applies the last token: the N - 1
later tokens of every row (the spread of first_token_time is reported; 0 when the batch
prefilled in one step). Decode tokens/s = B (N - 1) / T. Speedup = T_base / T_right (the same
tokens).
* t_decode = T_base / (N - 1): seconds per plain decode step (each emits one token per row).
* t_verify: seconds per verify step, from the wrong run, which takes N - 1 steps, one token each;
  the steps that carried drafts, S_v = drafted rows / B from `spec_decode_stats`, are all but the
  last (no drafts past max_tokens: N - 2 of them), so
  t_verify = (T_wrong - (N - 1 - S_v) t_decode) / S_v.
* bound = (k + 1) t_decode / t_verify: the speedup when every step is a verify step that keeps
  all k drafts; ratio = speedup / bound (target >= 0.9). The always-right run takes (N - 1) / (k + 1)
  verify steps, each emitting k + 1 tokens, so the bound is what it reaches when the engine adds
  nothing per step beyond what a rejected verify step costs.
* wrong's cost: tokens/s with every draft rejected, and its ratio to base (= t_decode / t_verify
  but for the one plain step).

Prints a table (and its progress as it goes); --json PATH writes every figure and every run (and
the commit measured), rewritten after each row. The default run (batch 1 and 8, k 1, 2, 3) took
25 min on 2 AMD EPYC cores (engine builds 48-90 s each, 1.5-2 min a batch-1 row, 5-6 min a
batch-8 row), plus 75 s to write the checkpoint once; --quick 15-75 s with a warm compilation cache
(3.5 min cold). With --dtype float32 --kv-cache-dtype float32 (--quick) the speculative runs give
exactly the no-draft run's tokens (the replay holds at once): the differences in bf16 are near
ties, not the verify path.
Exit status 1 when a check fails (a request short of its tokens, no always-right replay found,
a right run that rejected a draft, a wrong run that kept one); compiles after each engine's
warm-up are reported, not checked.

What real weights and a GPU would need to measure (random weights on CPU cannot):
* The MTP block's real acceptance: only a trained checkpoint (DeepSeek-V4-Flash or -Pro with its
  mtp.* tensors) gives it, on real prompts (chat, code, maths differ), greedy and sampled
  (temperature > 0 accepts less). For reference, the issue cites vLLM at 57.5% acceptance with
  k = 2 on V4 (not re-measured here). The tokens/s speedup is then about
  (1 + a k) t_decode / (t_verify + t_draft) for acceptance rate a (mean acceptance length 1 + a k).
  Measure it with `python -m serve` --speculative-config and serve.bench on a real dataset,
  reading vllm:spec_decode_* from /metrics (docs/monitoring.md), against the same server without
  speculation.
* The verify step's real cost: on a GPU a small-batch decode step is bound by reading the
  weights, so a verify step of k + 1 positions per row costs little more than a decode step and
  the bound approaches k + 1 (on 2 CPU cores compute dominates: t_verify grows with the k + 1
  positions). How t_verify / t_decode grows with the batch (where speculation stops paying), and
  the MTP draft program's own time t_draft (k applications of the block per step), need the
  accelerator and the full-size model (Flash needs several GPUs for its weights).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages (benchmarks) importable

from benchmarks.runner import MID_SEED, batch_sizes, mid_config, positive  # noqa: E402
from dsv4_jax.weights.builtin import builtin_model_dir, cached_checkpoint  # noqa: E402

BLOCK_SIZE = 256  # the engine's default --block-size
TOKEN_RANGE = (1000, 100000)  # random prompt ids: plain tokens of the V4 vocabulary, no special ones
KINDS = ("base", "right", "wrong")
QUICK = {"prompt_len": 32, "max_tokens": 25, "repeats": 2, "mtp_repeats": 1}
FULL = {"prompt_len": 64, "max_tokens": 25, "repeats": 3, "mtp_repeats": 1}
COLUMNS = ("batch", "k", "tok/s base", "tok/s right", "speedup", "t_decode ms", "t_verify ms", "bound", "ratio",
           "tok/s wrong (cost)", "MTP acceptance")


def log(message: str) -> None:
    print(f"# [{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the model ------------------------------------------------------------------------------------
def mid_mtp_config():
    """benchmarks/runner.py's mid config with DeepSeek-V4's one MTP layer."""
    return mid_config().replace(num_nextn_predict_layers=1)


def mid_mtp_model_dir() -> Path:
    """The mid checkpoint with its MTP block, written once under its own key (the plain mid
    checkpoint, ``bench-mid-seed{MID_SEED}``, stays as it is)."""
    from dsv4_jax.testing import write_random_checkpoint

    def write(partial: Path) -> None:
        t0 = time.perf_counter()
        write_random_checkpoint(partial, mid_mtp_config(), seed=MID_SEED, quantize="fp8", tokenizer=False)
        log(f"wrote the mid checkpoint with an MTP block in {time.perf_counter() - t0:.0f} s (once)")

    return cached_checkpoint(f"bench-mid-mtp1-seed{MID_SEED}", write)


# ---- one engine ---------------------------------------------------------------------------------------
class Engine:
    """One `LLM` speculating k tokens, and its timed generates."""

    def __init__(self, args: argparse.Namespace, model: str, tokenizer: str | None, k: int):
        from dsv4_jax import LLM, SamplingParams
        from dsv4_jax.engine.compiles import CompileCounter
        from dsv4_jax.engine.runner import StepBuckets

        self.SamplingParams, self.k = SamplingParams, k
        top = max(args.batch_sizes)
        buckets = StepBuckets(prefill=tuple(sorted({(1, args.prompt_len), (top, args.prompt_len)})),
                              decode=tuple(args.batch_sizes))
        kwargs = {"tokenizer": tokenizer} if tokenizer else {}
        t0 = time.perf_counter()
        self.llm = LLM(model=model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                       max_model_len=args.max_model_len, max_num_seqs=top, seed=0, enable_prefix_caching=False,
                       buckets=buckets, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kwargs)
        self.build_s = time.perf_counter() - t0
        self.vocab = self.llm.config.vocab_size
        self.compiles = CompileCounter()  # from here on: compiles after the build's warm-up
        self.failures: list[str] = []
        self.setup = {"k": k, "build_s": self.build_s, "kv_cache": self.llm.spec.summary(),
                      "kv_cache_dtype": self.llm.spec.kv_cache_dtype,
                      "attention_backend": self.llm.spec.attention_backend,
                      "buckets": repr(self.llm.engine.runner.buckets)}
        log(f"k = {k}: engine built in {self.build_s:.1f} s: {self.llm.spec.kv_cache_dtype} KV on "
            f"{self.llm.spec.attention_backend}, buckets as run {self.llm.engine.runner.buckets}")

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)
            log(f"CHECK FAILED: {what}")

    def generate(self, prompts: list[list[int]], drafter, max_tokens: int) -> dict:
        """One greedy generate of `prompts` (submitted together) with `drafter` (None: the MTP
        block): its decode time from the engine's metrics and the spec-decode counters it added."""
        engine = self.llm.engine
        engine.drafter = drafter
        stats = engine.spec_decode_stats
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position))
        params = self.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        first = [o.metrics.first_token_time for o in outs]
        last = [o.metrics.last_token_time for o in outs]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return {"wall_s": wall, "decode_s": max(last) - min(first), "first_token_spread_s": max(first) - min(first),
                "tokens": tokens, "drafts": stats.num_drafts - before[0],
                "draft_tokens": stats.num_draft_tokens - before[1], "accepted": stats.num_accepted_tokens - before[2],
                "accepted_per_position": [a - b for a, b in zip(stats.accepted_per_position, before[3])]}

    def bench_batch(self, args: argparse.Namespace, batch: int) -> dict:
        """Every figure of one (batch, k) row of the table."""
        import numpy as np

        from dsv4_jax.testing import ReplayDrafter

        k, n = self.k, args.max_tokens
        rng = np.random.default_rng([args.seed, batch])  # the same prompts for every k
        prompts = [rng.integers(*TOKEN_RANGE, size=args.prompt_len).tolist() for _ in range(batch)]
        none = ReplayDrafter({}, self.vocab)
        t0 = time.perf_counter()
        warm = self.generate(prompts, none, n)  # untimed: the warm-up, and the outputs to replay
        want = warm["tokens"]
        self.check(all(len(t) == n for t in want), f"batch {batch}, k {k}: warm-up not {n} tokens a request")
        # The always-right drafter replays the tokens the speculative run itself emits: with bf16, a
        # verify step's logits are not bitwise a decode step's, so at a near tie (random weights
        # have them) a row may take the other token than decoding did, and from there a replay of
        # decoding's tokens would be wrong. Rerun (untimed) replaying the last run's tokens until
        # every draft is kept: each rerun moves the first difference later.
        runs = {tuple(p): t for p, t in zip(prompts, want)}
        for attempt in range(1, args.max_tokens + 1):
            replay = self.generate(prompts, ReplayDrafter(runs, self.vocab), n)
            if replay["accepted"] == replay["draft_tokens"]:
                break
            runs = {tuple(p): t for p, t in zip(prompts, replay["tokens"])}
        self.check(replay["accepted"] == replay["draft_tokens"],
                   f"batch {batch}, k {k}: no replay whose every draft is kept after {attempt} runs")
        differ = sum(t != w for t, w in zip(replay["tokens"], want))
        want = replay["tokens"]  # what every speculative run is checked against (base: against the warm-up)
        drafters = {"base": none, "right": ReplayDrafter(runs, self.vocab),
                    "wrong": ReplayDrafter(runs, self.vocab, right=lambda done, kk: 0)}
        for name, drafter in (*drafters.items(), ("mtp", None)):  # every executable run once, untimed
            self.generate(prompts, drafter, min(n, k + 3))
        log(f"batch {batch}, k {k}: warm-up {time.perf_counter() - t0:.1f} s (first-token spread "
            f"{warm['first_token_spread_s'] * 1e3:.1f} ms; always-right replay found in {attempt} run(s); "
            f"{differ} of {batch} rows' greedy tokens differ from decoding's, at a near tie)")

        results: dict[str, list[dict]] = {name: [] for name in (*KINDS, "mtp")}

        def record(name: str, run: dict) -> None:
            reference = warm["tokens"] if name == "base" else want
            differ = sum(t != w for t, w in zip(run.pop("tokens"), reference))
            run["rows_differing"] = differ
            if differ:
                log(f"  note: {name}: {differ} of {batch} rows' tokens differ from the "
                    f"{'warm-up' if name == 'base' else 'always-right replay'}'s")
            results[name].append(run)
            rate = run["accepted"] / run["draft_tokens"] if run["draft_tokens"] else float("nan")
            log(f"  {name}: decode {run['decode_s']:.3f} s ({batch * (n - 1) / run['decode_s']:.1f} tokens/s), "
                f"wall {run['wall_s']:.3f} s; drafted rows {run['drafts']}, draft tokens {run['draft_tokens']}, "
                f"accepted {run['accepted']} ({rate:.3f})")

        for r in range(args.repeats):
            for name in KINDS:
                record(name, self.generate(prompts, drafters[name], n))
        for r in range(args.mtp_repeats):
            record("mtp", self.generate(prompts, None, n))

        best = {name: min(rs, key=lambda x: x["decode_s"]) for name, rs in results.items()}
        tokens = batch * (n - 1)
        t_base, t_right, t_wrong = (best[name]["decode_s"] for name in KINDS)
        t_decode = t_base / (n - 1)
        verify_steps = best["wrong"]["drafts"] / batch
        self.check(best["wrong"]["drafts"] % batch == 0 and best["wrong"]["accepted"] == 0,
                   f"batch {batch}, k {k}: the always-wrong run's rows did not verify in lockstep or accepted a draft")
        t_verify = (t_wrong - (n - 1 - verify_steps) * t_decode) / verify_steps
        right = best["right"]
        self.check(right["accepted"] == right["draft_tokens"] and right["rows_differing"] == 0,
                   f"batch {batch}, k {k}: the always-right run accepted {right['accepted']} of "
                   f"{right['draft_tokens']} drafts, {right['rows_differing']} rows differ")
        bound = (k + 1) * t_decode / t_verify
        speedup = t_base / t_right
        mtp_drafted = sum(r["draft_tokens"] for r in results["mtp"])
        mtp_accepted = sum(r["accepted"] for r in results["mtp"])
        mtp_drafts = sum(r["drafts"] for r in results["mtp"])
        per_position = [sum(r["accepted_per_position"][i] for r in results["mtp"]) for i in range(k)]
        return {
            "batch": batch, "k": k, "prompt_len": args.prompt_len, "max_tokens": n, "decode_tokens": tokens,
            "replay_runs": attempt, "rows_differing_from_decoding": differ,
            "tokens_per_s": {name: tokens / best[name]["decode_s"] for name in best},
            "decode_s": {name: best[name]["decode_s"] for name in best},
            "t_decode_ms": t_decode * 1e3, "t_verify_ms": t_verify * 1e3, "verify_steps_wrong": verify_steps,
            "verify_steps_right": right["drafts"] / batch, "speedup": speedup, "bound": bound,
            "ratio": speedup / bound, "wrong_over_base": t_base / t_wrong,
            "mtp_acceptance": mtp_accepted / mtp_drafted if mtp_drafted else None,
            "mtp_draft_tokens": mtp_drafted, "mtp_accepted": mtp_accepted,
            "mtp_per_position": [a / mtp_drafts for a in per_position] if mtp_drafts else None,
            "mtp_over_base": t_base / best["mtp"]["decode_s"], "runs": results,
        }


# ---- report -------------------------------------------------------------------------------------------
def table_line(row: dict) -> str:
    tps = row["tokens_per_s"]
    acc = row["mtp_acceptance"]
    cells = (str(row["batch"]), str(row["k"]), f"{tps['base']:.1f}", f"{tps['right']:.1f}", f"{row['speedup']:.2f}x",
             f"{row['t_decode_ms']:.1f}", f"{row['t_verify_ms']:.1f}", f"{row['bound']:.2f}x", f"{row['ratio']:.2f}",
             f"{tps['wrong']:.1f} ({row['wrong_over_base']:.2f}x)",
             ("n/a" if acc is None else f"{acc:.4f} ({row['mtp_accepted']} / {row['mtp_draft_tokens']})")
             + f", {tps['mtp']:.1f} tok/s")
    return "| " + " | ".join(cells) + " |"


def print_table(report: dict) -> None:
    a = report["args"]
    kv = (f"{report['engines'][0]['kv_cache_dtype']} KV on {report['engines'][0]['attention_backend']}"
          if report["engines"] else "")
    print(f"\n## Speculative decoding, {report['model']} ({report['device']}, {report['cpus']} CPUs), compute "
          f"{a['dtype']}, {kv}; prompts {a['prompt_len']} "
          f"tokens, max_tokens {a['max_tokens']} (decode tokens/s over the {a['max_tokens'] - 1} after the first), "
          f"greedy, best of {a['repeats']}\n")
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for row in sorted(report["rows"], key=lambda r: (r["batch"], r["k"])):
        print(table_line(row))
    if report["failures"]:
        print("\nFAILED checks:\n" + "\n".join(f"* {f}" for f in report["failures"]))


# ---- command line -------------------------------------------------------------------------------------
def ks(text: str) -> list[int]:
    """--k: comma-separated numbers of speculative tokens (1 to 4), run in the order given."""
    from dsv4_jax.engine.speculative import MAX_SPECULATIVE_TOKENS

    batch_sizes(text)  # the same checks: positive integers
    values = list(dict.fromkeys(int(part) for part in text.split(",")))
    if max(values) > MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"k is at most {MAX_SPECULATIVE_TOKENS}, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="dsv4-tiny and sizes that fit it: a smoke run")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 8], help="requests per generate")
    parser.add_argument("--k", type=ks, default=[1, 2, 3], help="num_speculative_tokens, one engine each")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the server's flag (auto: bfloat16 on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")
    for name, default in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive, default=None,
                            help=f"default {default} ({QUICK[name]} with --quick)")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    args = parser.parse_args(argv)
    for name, default in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.prompt_len < max(args.k) + 1:
        parser.error(f"--prompt-len must be at least k + 1 = {max(args.k) + 1} (a prefill bucket holds a verify row)")
    if args.max_tokens < 3:
        parser.error("--max-tokens must be at least 3")
    longest = args.prompt_len + args.max_tokens + max(args.k)
    args.max_model_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    return args


def git_state() -> dict:
    """The commit measured and whether the package's files differed from it."""
    import subprocess

    def git(*command: str) -> str:
        done = subprocess.run(["git", *command], cwd=REPO, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "changed": git("status", "--short", "dsv4_jax").splitlines()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_before = os.getloadavg()
    if args.quick:
        model, tokenizer, name = str(builtin_model_dir()), None, "dsv4-tiny"
    else:
        model, tokenizer = str(mid_mtp_model_dir()), str(builtin_model_dir())
        name = "mid with an MTP block (benchmarks/runner.py mid_config, num_nextn_predict_layers 1)"
    import jax

    device = jax.devices()[0]
    log(f"speculative decoding benchmark: {name} at {model}; {device.device_kind}, {os.cpu_count()} CPUs, load "
        f"{load_before[0]:.2f}; batches {args.batch_sizes}, k {args.k}, max_model_len {args.max_model_len}")
    report: dict = {"started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "model": name,
                    "git": git_state(),
                    "checkpoint": model, "device": device.device_kind, "cpus": os.cpu_count(), "argv": sys.argv,
                    "jax": jax.__version__, "args": {k: v for k, v in vars(args).items() if k != "json"},
                    "load_before": load_before, "engines": [], "rows": [], "failures": []}
    for k in args.k:
        engine = Engine(args, model, tokenizer, k)
        report["engines"].append(engine.setup)  # completed below
        for batch in args.batch_sizes:
            row = engine.bench_batch(args, batch)
            report["rows"].append(row)
            print(table_line(row), flush=True)
            if args.json:  # what is measured so far survives a kill
                Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
        engine.setup["compiles_after_warmup"] = engine.compiles.compiles
        engine.setup["load_after"] = os.getloadavg()
        report["failures"] += engine.failures
        log(f"k = {k}: {engine.compiles.compiles} XLA compiles after the engine's warm-up; load "
            f"{engine.setup['load_after'][0]:.2f}")
        del engine
        gc.collect()  # its pools, before the next engine takes its own
        if args.json:  # what is measured so far survives a kill
            Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    report["load_after"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    print_table(report)
    print(f"\nwall {report['wall_s']:.0f} s; load average (1 min) {load_before[0]:.2f} before, "
          f"{report['load_after'][0]:.2f} after", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
