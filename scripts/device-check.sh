#!/usr/bin/env bash
# The GPU check of issue 5, for a machine with an NVIDIA GPU (one H200 in the device
# sessions), in one run of under 8 minutes:
#   1. builds for sm_90 (Release);
#   2. every CUDA op against the CPU backend (cuda_ops_test: normalised error <= 1e-5 in
#      fp32, 1e-2 for 16-bit GEMMs on unrounded operands, bf16/fp16 rounding bit for bit);
#   3. the kernels' speed (cuda_bench: GEMMs in fp32, bf16, fp16; unfused and flash
#      attention at the gpt2-124m shape);
#   4. tiny-gpt, 30 steps bf16, on the GPU and on the CPU: the loss curves compared;
#   5. gpt2-124m (sequence 1024, bf16, micro-batch 8), 6 steps on the GPU: step time, MFU
#      against the H200's 989 TFLOP/s, peak memory; `strata estimate` of the same plan on the
#      dgx-h200-141g preset beside it (predicted / measured);
#   6. tp2 and dp2 ZeRO-1 tiny-gpt plans as 2 ranks sharing the one GPU (host-staged
#      communicator), final loss against the same plan on the CPU.
# Prints one table at the end; given a folder, writes the full log and every JSON there.
#   usage: scripts/device-check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-}
B=build-device
OUT=${LOG:-$(mktemp -d)}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
log() { tee -a "$OUT/device-check.log"; }
S=$B/strata
rows=()
row() { rows+=("| $1 | $2 |"); }
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: none"
  bash scripts/install-deps.sh > /dev/null 2>&1 || echo "install-deps failed (continuing with what is there)"
  cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 2>&1 | grep -E "strata:|Error"
  cmake --build $B -j "$(nproc)" --target strata cuda_ops_test cuda_bench 2>&1 | grep -E "error|Error" | head -20
} 2>&1 | log
row "build for sm_90" "$([ -x $S ] && echo ok || echo FAILED)"

ops_rc=1
if [ -x $B/cuda_ops_test ]; then
  timeout 300 $B/cuda_ops_test 2>&1 | log
  ops_rc=${PIPESTATUS[0]}
fi
skipped=$(grep -c '^\[  SKIPPED \] CudaOps\.' "$OUT/device-check.log")
row "CUDA ops vs CPU backend (cuda_ops_test)" "$([ "$ops_rc" -eq 0 ] && echo "pass (exit 0; skipped: $skipped)" || echo "FAILED (exit $ops_rc)")"

bench_rc=1
if [ -x $B/cuda_bench ]; then
  timeout 300 $B/cuda_bench 2>&1 | log
  bench_rc=${PIPESTATUS[0]}
fi
row "kernel speed table (cuda_bench, in the log)" "$([ "$bench_rc" -eq 0 ] && echo printed || echo "FAILED (exit $bench_rc)")"

# 4. tiny-gpt on both backends.
T="--model tiny-gpt --steps 30 --quiet --seed 7"
timeout 300 $S train $T --plan tp=1,precision=bf16 --backend cuda --json "$OUT/tiny_cuda.json" 2>&1 | log
timeout 300 $S train $T --plan tp=1,precision=bf16 --json "$OUT/tiny_cpu.json" 2>&1 | log
row "tiny-gpt bf16 30 steps, GPU vs CPU loss curve" "$(python3 - "$OUT" <<'EOF' 2>&1
import json, sys
d = sys.argv[1]
try:
    g = [s["loss"] for s in json.load(open(d + "/tiny_cuda.json"))["steps"]]
    c = [s["loss"] for s in json.load(open(d + "/tiny_cpu.json"))["steps"]]
    worst = max(abs(a - b) / abs(b) for a, b in zip(g, c))
    print("max relative difference %.2e over %d steps (bf16 tolerance 1e-2): %s; loss %.4f -> %.4f on the GPU"
          % (worst, len(g), "pass" if worst <= 1e-2 and len(g) == len(c) == 30 else "FAILED", g[0], g[-1]))
except Exception as e:
    print("FAILED (%s)" % e)
EOF
)"

# 5. gpt2-124m on the GPU, and the estimate of the same plan.
P124="tp=1,mbs=8,gbs=8,precision=bf16"
timeout 300 $S train --model gpt2-124m --plan $P124 --steps 6 --quiet --backend cuda --json "$OUT/gpt2_cuda.json" 2>&1 | log
$S estimate --model gpt2-124m --cluster dgx-h200-141g --plan "$P124,attention=unfused" --json > "$OUT/gpt2_estimate.json" 2>> "$OUT/device-check.log"
row "gpt2-124m bf16 S1024 mbs8 on the GPU: step, MFU, memory; estimate (dgx-h200-141g)" "$(python3 - "$OUT" <<'EOF' 2>&1
import json, sys
d = sys.argv[1]
try:
    r = json.load(open(d + "/gpt2_cuda.json"))
    e = json.load(open(d + "/gpt2_estimate.json"))
    step = r["median_step_time_s"]
    mfu = r["model_flops_per_step"] / step / 989.4e12
    mem = r["peak_memory_bytes"]["total"]
    print("measured %.4f s/step, MFU %.1f%% (target 40%%), peak %.2f GiB; predicted %.4f s (%+.1f%%), %.2f GiB (%+.1f%%)"
          % (step, 100 * mfu, mem / 2**30, e["step_time_s"], 100 * (e["step_time_s"] / step - 1),
             e["memory_bytes"]["peak"] / 2**30, 100 * (e["memory_bytes"]["peak"] / mem - 1)))
except Exception as e:
    print("FAILED (%s)" % e)
EOF
)"

# 6. Two ranks on the one GPU through the host-staged communicator.
for plan in "tp=2,precision=fp32" "dp=2,zero=1,mbs=1,gbs=4,precision=fp32"; do
  tag=$(echo "$plan" | tr ',=' '__')
  timeout 300 mpirun --oversubscribe -np 2 $S train --model tiny-gpt --plan "$plan" --steps 10 --quiet --seed 7 \
    --backend cuda --json "$OUT/two_$tag.cuda.json" 2>&1 | log
  timeout 300 mpirun --oversubscribe -np 2 $S train --model tiny-gpt --plan "$plan" --steps 10 --quiet --seed 7 \
    --json "$OUT/two_$tag.cpu.json" 2>&1 | log
  row "2 ranks on one GPU: $plan, final loss GPU vs CPU" "$(python3 - "$OUT" "$tag" <<'EOF' 2>&1
import json, sys
d, tag = sys.argv[1], sys.argv[2]
try:
    g = json.load(open("%s/two_%s.cuda.json" % (d, tag)))["steps"][-1]["loss"]
    c = json.load(open("%s/two_%s.cpu.json" % (d, tag)))["steps"][-1]["loss"]
    rel = abs(g - c) / abs(c)
    print("%.6f vs %.6f: relative %.1e (fp32 tolerance 1e-4): %s" % (g, c, rel, "pass" if rel <= 1e-4 else "FAILED"))
except Exception as e:
    print("FAILED (%s)" % e)
EOF
)"
done
row "profile --backend cuda, NCCL collectives" "not built yet (issue 5)"

{
  echo
  echo "| check | result |"
  echo "|---|---|"
  printf '%s\n' "${rows[@]}"
} 2>&1 | log
[ "$ops_rc" -eq 0 ] && ! printf '%s\n' "${rows[@]}" | grep -q FAILED
