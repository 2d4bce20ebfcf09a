#!/usr/bin/env bash
# GPU check of the Pallas kernels (run on a machine with an NVIDIA GPU; nothing here needs pytest).
#
#   bash benchmarks/gpu_check.sh            # at most 445 s (under 7.5 minutes), whatever hangs
#
# 1. finds the GPU's device kind (at most 40 s);
# 2. lowers every kernel to Triton IR for that kind (python -m pallas_kernels.check, at most 60 s);
# 3. compiles and runs the kernels at DeepSeek-V4-Flash shapes: GPU parity with the pure-JAX
#    references, then HOST WALL-CLOCK medians per call (block_until_ready after each batch of
#    back-to-back calls; an upper bound on device time, not device-timed) against the XLA path,
#    with TFLOP/s and GB/s from those times (benchmarks/kernels.py: at most 16 grid points, no
#    point started after 240 s, killed at 330 s);
# 4. appends the dated table to docs/performance.md. kernels.py writes each row to the table file
#    as soon as it is measured, so a run killed by its timeout still appends the rows it measured,
#    with a note saying it was cut short.
# Every step runs under `timeout -k 5` (SIGTERM, then SIGKILL 5 s later): 40 + 60 + 330 plus three
# 5 s grace periods = 445 s in the worst case.
# Exit status: non-zero if the lowering, a parity check or a point failed, or a step timed out.
set -u
cd "$(dirname "$0")/.."

KIND_S=40
CHECK_S=60
BENCH_S=330
BENCH_BUDGET_S=240  # kernels.py starts no point after this; the rest of BENCH_S is for the last one

kind="$(timeout -k 5 "$KIND_S" python3 -c 'import jax; d = jax.devices()[0]; print(d.device_kind if d.platform == "gpu" else "")')"
if [ -z "$kind" ]; then
  echo "gpu_check: no GPU visible to JAX (or it did not answer within ${KIND_S} s); nothing to do" >&2
  exit 2
fi
echo "gpu_check: $kind, $(date -u +%Y-%m-%dT%H:%M:%SZ)"

status=0
timeout -k 5 "$CHECK_S" python3 -m pallas_kernels.check --device-kind "$kind" || status=1

table="$(mktemp)"
timeout -k 5 "$BENCH_S" python3 benchmarks/kernels.py --budget-s "$BENCH_BUDGET_S" --markdown "$table"
rc=$?
[ "$rc" -eq 0 ] || status=1

if [ -s "$table" ]; then
  {
    echo
    echo "## $(date -u +%Y-%m-%d) — $kind"
    echo
    cat "$table"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo
      echo "_Cut short: benchmarks/kernels.py was killed by its ${BENCH_S} s timeout; the rows above are the points measured before that._"
    fi
  } >> docs/performance.md
  echo "gpu_check: results appended to docs/performance.md"
fi
rm -f "$table"
exit "$status"
