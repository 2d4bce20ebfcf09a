#!/usr/bin/env bash
# GPU check: the Pallas kernels, the model runner, the engine and `python -m serve`, in one call on a
# machine with an NVIDIA GPU. Nothing here needs pytest and nothing is installed: the packages of
# pyproject.toml must already be importable (the device tool's command installs carried wheels).
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]    # at most 575 s (under 9.6 minutes), whatever hangs
#
# Without RESULTS_DIR the dated tables are appended to docs/performance.md; with it they go to
# RESULTS_DIR/gpu_check.md, beside the server's log (serve.log) and the lowering check's output.
#
# 1. finds the GPU's device kind and prints the versions (at most 40 s);
# 2. at once, side by side (the first two compile on the CPUs; the GPU's memory is split with
#    XLA_PYTHON_CLIENT_MEM_FRACTION):
#    a. lowers every kernel to Triton IR for that kind (python -m pallas_kernels.check, on the CPU
#       backend, at most 60 s);
#    b. `python -m serve` as the README starts it (built-in tiny model, --kv-cache-dtype auto,
#       half of the GPU's memory): healthy, the fp8_ds_mla line, /v1/models, a chat completion
#       with correct usage, TTFT, 160 streamed requests checked one by one, no compile after the
#       warm-up, a clean SIGTERM (benchmarks/serve_check.py, killed at 240 s: on an H200 the
#       start alone took over 100 s, 89 s of it compiling the programs that size the pools;
#       a row summarizes the start-up's compiles and fails on an XLA rematerialization warning);
#    c. the built-in tiny model through the runner on each Pallas backend, compiled for the GPU,
#       against the same kernels in the Pallas interpreter on the GPU (pass/fail: greedy tokens
#       equal where the top-1/top-2 gap exceeds 1e-3, logprobs within 1e-3) and against the xla
#       backend (reported: the kernels' bf16 dot operands against float32 attention)
#       (benchmarks/runner_gpu_check.py: no comparison started after 100 s, killed at 150 s);
# 3. the kernels at DeepSeek-V4-Flash shapes: GPU parity with the pure-JAX references (also on
#    rows at the far end of pools past 2**31 bytes), then HOST WALL-CLOCK medians per call
#    against the XLA path (benchmarks/kernels.py: the most telling points first, none started
#    after 45 s, killed at 75 s; GPU_CHECK_KERNELS_BUDGET_S / GPU_CHECK_KERNELS_S override);
# 4. offline `LLM.generate` of the tiny model, 32 prompts x 64 tokens per kind of request
#    (benchmarks/generate.py, killed at 120 s);
# 5. the runner benchmark of the tiny model (benchmarks/runner.py: decode steps at batch 1, 8 and
#    32 and 256-token prefill chunks, host and device time per step; killed at 75 s).
# Every Python step writes each row to its table as soon as it is measured, so a step killed by its
# timeout still reports the rows it measured, with a note saying it was cut short.
# Every step runs under `timeout -k 5` (SIGTERM, then SIGKILL 5 s later): 40 + 240 + 75 + 120 + 75
# plus five 5 s grace periods = 575 s in the worst case.
# Exit status: non-zero if the lowering, a parity check, a point, a serving check, a runner
# comparison or a benchmark failed, or a step timed out.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

KIND_S=40
CHECK_S=60
SERVE_S=240
RUNNER_CHECK_S=150
RUNNER_CHECK_BUDGET_S=100  # runner_gpu_check.py starts no comparison after this
BENCH_S=${GPU_CHECK_KERNELS_S:-75}
BENCH_BUDGET_S=${GPU_CHECK_KERNELS_BUDGET_S:-45}  # kernels.py starts no point after this; the rest of BENCH_S is for the last one
GENERATE_S=120
RUNNER_BENCH_S=75

results_dir="${1:-}"
if [ -n "$results_dir" ]; then
  mkdir -p "$results_dir"
  results="$results_dir/gpu_check.md"
  logs="$results_dir"
else
  results=docs/performance.md
  logs="$(mktemp -d)"
fi

kind="$(timeout -k 5 "$KIND_S" python3 -c 'import jax; d = jax.devices()[0]; print(d.device_kind if d.platform == "gpu" else "")')"
if [ -z "$kind" ]; then
  echo "gpu_check: no GPU visible to JAX (or it did not answer within ${KIND_S} s); nothing to do" >&2
  exit 2
fi
echo "gpu_check: $kind, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
versions="$(python3 -c 'import sys, jax, jaxlib, flax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}")' 2>&1 | tail -1)"
echo "gpu_check: $versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

status=0

# append_table TITLE FILE RC TIMEOUT SCRIPT: the step's table under a dated heading, noting a kill.
append_table() {
  if [ -s "$2" ]; then
    {
      echo
      echo "## $(date -u +%Y-%m-%d) — $kind — $1"
      echo
      echo "$versions."
      echo
      cat "$2"
      if [ "$3" -eq 124 ] || [ "$3" -eq 137 ]; then
        echo
        echo "_Cut short: $5 was killed by its $4 s timeout; the rows above are the ones measured before that._"
      fi
    } >> "$results"
    echo "gpu_check: $1 written to $results"
  else
    echo "gpu_check: $1: no table (exit status $3)"
  fi
  rm -f "$2"
}

# 2. lowering (CPU backend), serving and the runner comparison, side by side.
JAX_PLATFORMS=cpu timeout -k 5 "$CHECK_S" python3 -m pallas_kernels.check --device-kind "$kind" \
  > "$logs/lowering.log" 2>&1 &
lowering_pid=$!
serve_table="$(mktemp)"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout -k 5 "$SERVE_S" python3 benchmarks/serve_check.py \
  --log "$logs/serve.log" --markdown "$serve_table" --requests 160 --concurrency 32 --expect-fp8 \
  --timeout-s $((SERVE_S - 10)) > "$logs/serve_check.out" 2>&1 &
serve_pid=$!
runner_table="$(mktemp)"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout -k 5 "$RUNNER_CHECK_S" python3 benchmarks/runner_gpu_check.py \
  --budget-s "$RUNNER_CHECK_BUDGET_S" --markdown "$runner_table"
rc=$?
[ "$rc" -eq 0 ] || status=1
append_table "runner on the Pallas backends, compiled against interpreted and against xla (tiny model, float32 compute)" "$runner_table" "$rc" \
  "$RUNNER_CHECK_S" benchmarks/runner_gpu_check.py
wait "$lowering_pid"
rc=$?
[ "$rc" -eq 0 ] || status=1
tail -n 20 "$logs/lowering.log"
echo "gpu_check: lowering check exit status $rc"
wait "$serve_pid"
rc=$?
[ "$rc" -eq 0 ] || status=1
cat "$logs/serve_check.out"
append_table "python -m serve (built-in tiny model, every flag at its default; 160 streams, 32 at once, while the runner check shared the GPU)" \
  "$serve_table" "$rc" "$SERVE_S" benchmarks/serve_check.py

# 3-5. the benchmarks, one at a time.
table="$(mktemp)"
timeout -k 5 "$BENCH_S" python3 benchmarks/kernels.py --budget-s "$BENCH_BUDGET_S" --markdown "$table"
rc=$?
[ "$rc" -eq 0 ] || status=1
append_table "kernels" "$table" "$rc" "$BENCH_S" benchmarks/kernels.py

table="$(mktemp)"
timeout -k 5 "$GENERATE_S" python3 benchmarks/generate.py --batch 32 --prompt-len 32 --new-tokens 64 --repeats 3 \
  | tee "$table"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || status=1
append_table "offline LLM.generate (tiny model, bf16, --kv-cache-dtype auto; 32 prompts x 64 tokens)" "$table" "$rc" \
  "$GENERATE_S" benchmarks/generate.py

table="$(mktemp)"
timeout -k 5 "$RUNNER_BENCH_S" python3 benchmarks/runner.py --model tiny --batch-sizes 1,8,32 --repeats 10 \
  --markdown "$table"
rc=$?
[ "$rc" -eq 0 ] || status=1
append_table "runner benchmark (tiny model, bf16 compute, --kv-cache-dtype auto; ms are host wall-clock)" \
  "$table" "$rc" "$RUNNER_BENCH_S" benchmarks/runner.py
echo "gpu_check: done, exit status $status"
exit "$status"
