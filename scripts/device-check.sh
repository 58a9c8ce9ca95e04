#!/usr/bin/env bash
# The GPU check of issue 5, for a machine with an NVIDIA GPU (one H200 in the device
# sessions): builds for sm_90 (Release), runs every CUDA op against the CPU backend
# (cuda_ops_test: normalised error <= 1e-5 in fp32, 1e-2 for 16-bit GEMMs on unrounded
# operands, bf16/fp16 rounding bit for bit), times the kernels (cuda_bench: GEMMs in fp32,
# bf16, fp16; unfused and flash attention at the gpt2-124m shape) and prints one table.
# Given a folder, writes the full log there. What the issue lists beyond the ops (training
# on the GPU, MFU of gpt2-124m, NCCL, predicted vs measured) is not built yet and is
# reported as such.
#   usage: scripts/device-check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-}
B=build-device
[ -n "$LOG" ] && mkdir -p "$LOG"
log() { if [ -n "$LOG" ]; then tee -a "$LOG/device-check.log"; else cat; fi; }
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: none"
  bash scripts/install-deps.sh > /dev/null 2>&1 || echo "install-deps failed (continuing with what is there)"
  cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 2>&1 | grep -E "strata:|Error"
  cmake --build $B -j "$(nproc)" --target strata cuda_ops_test cuda_bench 2>&1 | grep -E "error|Error" | head -20
} 2>&1 | log
ops_rc=1
out="$B/cuda_ops_test was not built"
if [ -x $B/cuda_ops_test ]; then
  out=$($B/cuda_ops_test 2>&1)
  ops_rc=$?
fi
echo "$out" | log
skipped=$(echo "$out" | grep -c '^\[  SKIPPED \] CudaOps\.')
bench_rc=1
if [ -x $B/cuda_bench ]; then
  timeout 300 $B/cuda_bench 2>&1 | log
  bench_rc=${PIPESTATUS[0]}
fi
{
  echo
  echo "| check | result |"
  echo "|---|---|"
  echo "| build for sm_90 | $([ -x $B/strata ] && echo ok || echo FAILED) |"
  echo "| CUDA ops vs CPU backend (cuda_ops_test) | $([ "$ops_rc" -eq 0 ] && echo "pass (exit 0; skipped: $skipped)" || echo "FAILED (exit $ops_rc)") |"
  echo "| kernel speed table (cuda_bench, above) | $([ "$bench_rc" -eq 0 ] && echo printed || echo "FAILED (exit $bench_rc)") |"
  echo "| tiny-gpt loss curve GPU vs CPU, gpt2-124m MFU, NCCL, predicted vs measured | not built yet (issue 5) |"
} 2>&1 | log
exit "$ops_rc"
