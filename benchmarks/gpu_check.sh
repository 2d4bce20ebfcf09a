#!/usr/bin/env bash
# GPU check of the Pallas kernels (run on a machine with an NVIDIA GPU; nothing here needs pytest).
#
#   bash benchmarks/gpu_check.sh            # about 8 minutes at most
#
# 1. lowers every kernel to Triton IR for this GPU's kind (python -m pallas_kernels.check);
# 2. compiles and runs the kernels at DeepSeek-V4-Flash shapes: GPU parity with the pure-JAX
#    references, device-timed medians against the XLA path, TFLOP/s and GB/s
#    (benchmarks/kernels.py, at most 16 grid points, stops starting points after --budget-s);
# 3. appends the dated table to docs/performance.md.
# Exit status: non-zero if the lowering, a parity check or a point failed.
set -u
cd "$(dirname "$0")/.."

kind="$(python3 -c 'import jax; d = jax.devices()[0]; print(d.device_kind if d.platform == "gpu" else "")')"
if [ -z "$kind" ]; then
  echo "gpu_check: no GPU visible to JAX; nothing to do" >&2
  exit 2
fi
echo "gpu_check: $kind, $(date -u +%Y-%m-%dT%H:%M:%SZ)"

status=0
timeout 60 python3 -m pallas_kernels.check --device-kind "$kind" || status=1

table="$(mktemp)"
timeout 450 python3 benchmarks/kernels.py --budget-s 360 --markdown "$table" || status=1

if [ -s "$table" ]; then
  {
    echo
    echo "## $(date -u +%Y-%m-%d) — $kind"
    echo
    cat "$table"
  } >> docs/performance.md
  echo "gpu_check: results appended to docs/performance.md"
fi
rm -f "$table"
exit "$status"
