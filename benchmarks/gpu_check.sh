#!/usr/bin/env bash
# GPU check of the Pallas kernels and the model runner (run on a machine with an NVIDIA GPU;
# nothing here needs pytest and nothing is installed).
#
#   bash benchmarks/gpu_check.sh            # at most 575 s (under 9.6 minutes), whatever hangs
#
# 1. finds the GPU's device kind (at most 40 s);
# 2. lowers every kernel to Triton IR for that kind (python -m pallas_kernels.check, at most 60 s);
# 3. compiles and runs the kernels at DeepSeek-V4-Flash shapes: GPU parity with the pure-JAX
#    references, then HOST WALL-CLOCK medians per call (block_until_ready after each batch of
#    back-to-back calls; an upper bound on device time, not device-timed) against the XLA path,
#    with TFLOP/s and GB/s from those times (benchmarks/kernels.py: at most 16 grid points, no
#    point started after 200 s, killed at 270 s);
# 4. runs the built-in tiny model through the runner on each Pallas backend, compiled for the GPU,
#    against the xla backend over the same KV format: greedy tokens equal where the top-1/top-2
#    gap exceeds 1e-3, max |logprob difference| (benchmarks/runner_gpu_check.py: no backend
#    started after 50 s, killed at 90 s);
# 5. the runner benchmark of the tiny model (benchmarks/runner.py: decode steps at batch 1, 8 and
#    32 and 256-token prefill chunks, host and device time per step; killed at 90 s);
# 6. appends the dated tables to docs/performance.md. Every Python step writes each row to its
#    table file as soon as it is measured, so a step killed by its timeout still appends the rows
#    it measured, with a note saying it was cut short.
# Every step runs under `timeout -k 5` (SIGTERM, then SIGKILL 5 s later): 40 + 60 + 270 + 90 + 90
# plus five 5 s grace periods = 575 s in the worst case.
# Exit status: non-zero if the lowering, a parity check, a point, a runner comparison or the
# runner benchmark failed, or a step timed out.
set -u
cd "$(dirname "$0")/.."

KIND_S=40
CHECK_S=60
BENCH_S=270
BENCH_BUDGET_S=200  # kernels.py starts no point after this; the rest of BENCH_S is for the last one
RUNNER_CHECK_S=90
RUNNER_CHECK_BUDGET_S=50  # runner_gpu_check.py starts no backend after this
RUNNER_BENCH_S=90

kind="$(timeout -k 5 "$KIND_S" python3 -c 'import jax; d = jax.devices()[0]; print(d.device_kind if d.platform == "gpu" else "")')"
if [ -z "$kind" ]; then
  echo "gpu_check: no GPU visible to JAX (or it did not answer within ${KIND_S} s); nothing to do" >&2
  exit 2
fi
echo "gpu_check: $kind, $(date -u +%Y-%m-%dT%H:%M:%SZ)"

status=0
timeout -k 5 "$CHECK_S" python3 -m pallas_kernels.check --device-kind "$kind" || status=1

# append_table TITLE FILE RC TIMEOUT SCRIPT: the step's table under a dated heading, noting a kill.
append_table() {
  if [ -s "$2" ]; then
    {
      echo
      echo "## $(date -u +%Y-%m-%d) — $kind — $1"
      echo
      cat "$2"
      if [ "$3" -eq 124 ] || [ "$3" -eq 137 ]; then
        echo
        echo "_Cut short: $5 was killed by its $4 s timeout; the rows above are the ones measured before that._"
      fi
    } >> docs/performance.md
    echo "gpu_check: $1 appended to docs/performance.md"
  fi
  rm -f "$2"
}

table="$(mktemp)"
timeout -k 5 "$BENCH_S" python3 benchmarks/kernels.py --budget-s "$BENCH_BUDGET_S" --markdown "$table"
rc=$?
[ "$rc" -eq 0 ] || status=1
append_table "kernels" "$table" "$rc" "$BENCH_S" benchmarks/kernels.py

table="$(mktemp)"
timeout -k 5 "$RUNNER_CHECK_S" python3 benchmarks/runner_gpu_check.py --budget-s "$RUNNER_CHECK_BUDGET_S" \
  --markdown "$table"
rc=$?
[ "$rc" -eq 0 ] || status=1
append_table "runner on the Pallas backends against xla (tiny model, float32 compute)" "$table" "$rc" \
  "$RUNNER_CHECK_S" benchmarks/runner_gpu_check.py

table="$(mktemp)"
timeout -k 5 "$RUNNER_BENCH_S" python3 benchmarks/runner.py --model tiny --batch-sizes 1,8,32 --repeats 10 \
  --markdown "$table"
rc=$?
[ "$rc" -eq 0 ] || status=1
append_table "runner benchmark (tiny model, bf16 compute, --kv-cache-dtype auto; ms are host wall-clock)" \
  "$table" "$rc" "$RUNNER_BENCH_S" benchmarks/runner.py
exit "$status"
