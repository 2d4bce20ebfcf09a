"""GPU check of the runner: the built-in tiny model through `ModelRunner` on each Pallas backend,
compiled for the device, against the same kernels in the Pallas interpreter on the same device
and against the xla backend over the same KV format.

    python benchmarks/runner_gpu_check.py [--backends pallas_fp8_ds_mla,pallas_bf16]
        [--against interpret,xla] [--prompt-tokens 160] [--new-tokens 40] [--markdown FILE]
        [--budget-s 60] [--allow-cpu]

Plain script (jax, flax, numpy and this repository; no pytest). Per backend and reference: the
reference runner prefills a random prompt in one step and generates --new-tokens greedy tokens
(one decode step each); the compiled Pallas runner then runs the same tokens (teacher forcing:
it is fed the reference's tokens, so every position is compared even after a near-tie). The
defaults reach 200 positions: past a 128-position block (the sliding ring wraps), the first HCA
entry (ratio 128) and CSA top-k selection (50 entries for index_topk 8). Compute in float32.

* `interpret` (the pass/fail check): the same kernels run by the Pallas interpreter as XLA ops on
  the same device, so only compilation differs. Greedy tokens must be equal wherever the
  reference's top-1/top-2 gap exceeds 1e-3, and every logprob within 1e-3.
* `xla` (reported; failing only below half the tokens equal or past 5 in logprob): the model's own
  XLA attention in float32. The kernels round their dot operands to bf16, so this measures that
  rounding through the whole model: 39/40 tokens and 0.834 logprob in the interpreter on a CPU,
  32/40 and 1.52 compiled on an H200, whose float32 XLA dots also round, as TF32
  (docs/performance.md, "GPU runs").

On a GPU the kernels are compiled (`get_backend` interprets only when JAX's default backend is
the CPU, or when asked). Without a GPU nothing runs unless --allow-cpu: then the kernels run in
the Pallas interpreter (the `interpret` reference is skipped: it would be the same program). No
comparison starts after --budget-s seconds (it is reported as skipped); with --markdown each row
is written to the file as soon as it is measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_jax  # noqa: E402
from dsv4_jax.weights.builtin import builtin_model_dir  # noqa: E402
from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepRow  # noqa: E402
from dsv4_jax.kv_cache.paged import PagedCacheLayout  # noqa: E402
from dsv4_jax.kv_cache.resolver import resolve_for_device  # noqa: E402
from pallas_kernels.backend import PALLAS_BF16, PALLAS_FP8_DS_MLA, XLA  # noqa: E402

from benchmarks.runner import positive  # noqa: E402  (one flag parser for the benchmarks)

KV_CACHE_DTYPE = {PALLAS_FP8_DS_MLA: "fp8_ds_mla", PALLAS_BF16: "bfloat16"}
NEAR_TIE = 1e-3  # top-1/top-2 logit gap below which either token is a fair greedy pick
INTERPRET_LOGPROB_TOL = 1e-3  # compiled vs interpreted: float32 summation order only (a defect is >= 0.1)
# Against xla, a sanity bound only (80-98% of tokens equal, 0.83-1.52 logprob: docs/performance.md,
# "GPU runs"): a kernel that reads wrong rows gives noise, far past both.
XLA_MIN_EQUAL_SHARE, XLA_MAX_LOGPROB_DIFF = 0.5, 5.0
AGAINST = ("interpret", XLA)
BLOCK_SIZE = 128  # the smallest block the tiny model's HCA ratio allows: more boundaries crossed
HEADER = ("check", "status", "positions", "greedy tokens", "max abs logprob diff", "seconds")


def run_sequence(runner: ModelRunner, prompt: list[int], new: int, forced: list[int] | None = None
                 ) -> tuple[list[int], np.ndarray]:
    """Prefill `prompt`, then `new - 1` decode steps: the tokens fed after the prompt (argmax of
    the last logits, or `forced`) and the logits [new, vocab] float32 that chose each."""
    blocks = list(range(runner.layout.max_blocks_per_seq))
    out = runner.step([StepRow(0, 0, prompt, blocks)])
    tokens, logits = [], []
    for i in range(new):
        row = np.asarray(out.logits, np.float32)[0]  # (slicing on the device would compile)
        logits.append(row)
        tokens.append(int(np.argmax(row)) if forced is None else forced[i])
        if i + 1 < new:
            out = runner.step([StepRow(0, len(prompt) + i, [tokens[-1]], blocks)])
    return tokens, np.stack(logits)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(reference: np.ndarray, got: np.ndarray) -> tuple[bool, str, float, float]:
    """(passed, greedy summary, max |logprob difference|, share of the decided positions whose
    greedy tokens are equal) of logits [n, vocab] against the reference's."""
    top2 = np.sort(reference, axis=-1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > NEAR_TIE
    equal = np.argmax(got, axis=-1) == np.argmax(reference, axis=-1)
    mismatches = int(np.sum(decided & ~equal))
    summary = f"{int(np.sum(decided & equal))}/{int(decided.sum())} equal (gap > {NEAR_TIE:g}), " \
              f"{int((~decided).sum())} near-ties"
    share = float(np.sum(decided & equal) / max(int(decided.sum()), 1))
    return mismatches == 0, summary, float(np.max(np.abs(log_softmax(got) - log_softmax(reference)))), share


def check_backend(model, backend: str, against: str, prompt: list[int], new: int) -> tuple[bool, tuple[str, ...]]:
    """One table row: the compiled Pallas `backend` runner against `against` ("interpret": the
    same kernels interpreted; "xla": the xla backend) over the same KV format."""
    t0 = time.perf_counter()
    spec = resolve_for_device(KV_CACHE_DTYPE[backend], jax.devices()[0], backend, model.config)
    layout = PagedCacheLayout.build(model.config, spec, max_model_len=len(prompt) + new, num_seq_slots=1,
                                    block_size=BLOCK_SIZE)
    buckets = StepBuckets(prefill=((1, len(prompt)),), decode=(1,))
    reference = dict(attention_backend=backend, interpret=True) if against == "interpret" else \
        dict(attention_backend=XLA)
    runs = {}
    for name, kwargs in (("reference", reference), ("compiled", dict(attention_backend=backend))):
        runner = ModelRunner(model, layout, buckets=buckets, **kwargs)
        runner.warmup()
        runs[name] = run_sequence(runner, prompt, new, forced=runs["reference"][0] if name != "reference" else None)
        if runner.compiles.compiles:
            raise RuntimeError(f"the {name} runner compiled {runner.compiles.compiles} times after warm-up")
    ok, greedy, diff, share = compare(runs["reference"][1], runs["compiled"][1])
    if against == "interpret":
        ok = ok and diff <= INTERPRET_LOGPROB_TOL
        status = "ok" if ok else "MISMATCH"
    else:  # bf16 dot operands against float32 attention: a distance, failing only when far beyond it
        ok = share >= XLA_MIN_EQUAL_SHARE and diff <= XLA_MAX_LOGPROB_DIFF
        status = "reported" if ok else "FAR OFF"
    return ok, (f"runner {backend} vs {against} ({spec.kv_cache_dtype} KV, tiny)", status,
                str(new), greedy, f"{diff:.2e}", f"{time.perf_counter() - t0:.0f}")


def write_line(path: str | None, line: str, mode: str = "a") -> None:
    print(line, flush=True)
    if path:
        with open(path, mode) as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backends", default=f"{PALLAS_FP8_DS_MLA},{PALLAS_BF16}")
    parser.add_argument("--against", default=",".join(AGAINST), help="references, of " + ", ".join(AGAINST))
    parser.add_argument("--prompt-tokens", type=positive, default=160)
    parser.add_argument("--new-tokens", type=positive, default=40)
    parser.add_argument("--markdown", metavar="FILE", help="also write the table here, one row as soon as measured")
    parser.add_argument("--budget-s", type=float, default=60.0, help="start no backend after this many seconds")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (Pallas interpret mode)")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(KV_CACHE_DTYPE))
    if unknown or not backends:
        parser.error(f"argument --backends: got {args.backends!r}; allowed: {', '.join(KV_CACHE_DTYPE)}")
    against = [a.strip() for a in args.against.split(",") if a.strip()]
    if set(against) - set(AGAINST) or not against:
        parser.error(f"argument --against: got {args.against!r}; allowed: {', '.join(AGAINST)}")
    if jax.default_backend() == "cpu" and "interpret" in against:
        against.remove("interpret")  # on a CPU both runners would be the interpreter
    if args.prompt_tokens < 2:
        parser.error(f"argument --prompt-tokens: a prefill step has at least 2 tokens, got {args.prompt_tokens}")
    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print(f"no GPU: JAX's default backend is {jax.default_backend()!r}; nothing checked (--allow-cpu to run "
              "the Pallas interpreter)")
        return 2

    start = time.perf_counter()
    model = dsv4_jax.load_model(builtin_model_dir(), dtype="float32")
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, size=args.prompt_tokens).tolist()
    write_line(args.markdown, "| " + " | ".join(HEADER) + " |", "w")
    write_line(args.markdown, "|" + "---|" * len(HEADER))
    passed = True
    for backend, reference in [(b, a) for b in backends for a in against]:
        name = f"runner {backend} vs {reference}"
        if time.perf_counter() - start > args.budget_s:
            ok, row = True, (name, "skipped", "", f"time budget ({args.budget_s:.0f} s) spent", "", "")
        else:
            try:
                ok, row = check_backend(model, backend, reference, prompt, args.new_tokens)
            except Exception as exc:  # keep going: every comparison gets a row whatever fails
                traceback.print_exc(limit=3)
                ok, row = False, (name, "ERROR",
                                  "", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}", "", "")
        passed &= ok
        write_line(args.markdown, "| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
