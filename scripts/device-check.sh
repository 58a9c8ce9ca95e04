#!/usr/bin/env bash
# The GPU check of issue 5, for a machine with an NVIDIA GPU (one H200 in the device
# sessions), in one run of under 8 minutes:
#   1. builds for sm_90 (Release);
#   2. every CUDA op against the CPU backend (cuda_ops_test: normalised error <= 1e-5 in
#      fp32, 1e-2 for 16-bit GEMMs on unrounded operands, bf16/fp16 rounding bit for bit);
#   2b. the tensor-core flash kernels' op test under compute-sanitizer's racecheck and
#      synccheck (where compute-sanitizer is installed);
#   3. the kernels' speed (cuda_bench: GEMMs in fp32, bf16, fp16; the unfused attention
#      with its GEMMs in fp32 and bf16, and the flash kernels in fp32 and on the tensor
#      cores in bf16, at the gpt2-124m shape; its memory-bound kernels in GB/s beside a
#      device-to-device copy);
#   4. tiny-gpt, 30 steps bf16, on the GPU and on the CPU: the loss curves compared, with
#      the unfused and with the fused attention;
#   5. gpt2-124m (sequence 1024, bf16, micro-batch 8), 6 steps on the GPU with the unfused
#      and with the fused (flash) attention, and the unfused with selective recompute (its
#      probabilities recomputed, not kept), and the fused on micro-batches of 32: step time, MFU against 989 TFLOP/s (dense bf16
#      of an H100 SXM and of an H200), the device's memory; `strata estimate` of the same plan
#      on the dgx-h100-80g preset on an H100, else dgx-h200-141g
#      beside it (predicted / measured);
#   6. tp2 and dp2 ZeRO-1 tiny-gpt plans as 2 ranks sharing the one GPU (host-staged
#      communicator), final loss against the same plan on the CPU;
#   7. `strata profile --backend cuda` on one rank, and the estimate of step 5's unfused and
#      flash plans on the measured profile against their measured step times;
#   8. the NCCL communicator: its op test (part of step 2) on its own row, and tiny-gpt
#      trained through it (--comm nccl), losses against step 4's staged run;
#   9. the GPU time of a gpt2-124m step by kernel (Nsight Compute, where it is installed).
# Prints one table at the end; given a folder, writes the full log and every JSON there.
# Each step has its own time limit, capped so that the whole run ends within 520 s
# (STRATA_CHECK_BUDGET seconds where set, for a shorter first try inside a device lease).
#   usage: scripts/device-check.sh [LOG_DIR]
# On the device machine (no Debian packages, no network), use the bundle that
# scripts/device-bundle.sh prepares on a machine with the packages, carried along:
#   source .device-bundle/env.sh && STRATA_BUNDLE=.device-bundle scripts/device-check.sh $OUT
# With STRATA_BUNDLE set, nothing is installed or built: the bundle's binaries run.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-}
OUT=${LOG:-$(mktemp -d)}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
log() { tee -a "$OUT/device-check.log"; }
# Each step's time limit, capped so that the whole run ends by 520 s (the device call runs
# it under `timeout 560`): a step that hangs costs its own row, never the final table. Once
# the budget is spent each remaining step gets 1 s, so a dozen of them still end in time.
BUDGET=${STRATA_CHECK_BUDGET:-520}
lim() { local left=$((BUDGET - SECONDS)); [ "$left" -lt 1 ] && left=1; echo $(($1 < left ? $1 : left)); }
rows=()
row() { rows+=("| $1 | $2 |"); }
# The losses of two 30-step train JSONs: the largest relative difference against a tolerance.
compare_losses() {  # RUN_JSON REFERENCE_JSON TOLERANCE WHAT
  python3 - "$@" <<'EOF' 2>&1
import json, sys
run, ref, tol, what = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
try:
    a = [s["loss"] for s in json.load(open(run))["steps"]]
    b = [s["loss"] for s in json.load(open(ref))["steps"]]
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    ok = worst <= tol and len(a) == len(b) == 30
    print("max relative difference %.2e over %d steps (%s tolerance %g): %s; loss %.4f -> %.4f"
          % (worst, len(a), what, tol, "pass" if ok else "FAILED", a[0], a[-1]))
except Exception as e:
    print("FAILED (%s)" % e)
EOF
}
if [ -n "${STRATA_BUNDLE:-}" ]; then
  B=$STRATA_BUNDLE/bin
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || echo "nvidia-smi: none"
    echo "prebuilt bundle $B"
    # What the bundle leaves to the device: CUDA's runtime and cuBLAS (linked), cuBLASLt and
    # NCCL (loaded when first used).
    ldd "$B/strata" | grep -E "not found|cuda|cublas" || true
    for l in libcublasLt.so.13 libnccl.so.2; do
      echo "$l: $(for d in ${LD_LIBRARY_PATH//:/ }; do [ -e "$d/$l" ] && echo "$d"; done | head -1)"
    done; } 2>&1 | log
else
  B=build-device
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: none"
    bash scripts/install-deps.sh > /dev/null 2>&1 || echo "install-deps failed (continuing with what is there)"
    cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 2>&1 | grep -E "strata:|Error"
    cmake --build $B -j "$(nproc)" --target strata cuda_ops_test cuda_bench 2>&1 | grep -E "error|Error" | head -20
  } 2>&1 | log
fi
S=$B/strata
row "build for sm_90" "$([ -x $S ] && echo "ok ($B)" || echo FAILED)"

ops_rc=1
if [ -x $B/cuda_ops_test ]; then
  timeout $(lim 120) $B/cuda_ops_test 2>&1 | log
  ops_rc=${PIPESTATUS[0]}
fi
skipped=$(grep -c '^\[  SKIPPED \] CudaOps\..* ms)$' "$OUT/device-check.log")
# gtest exits 0 when every case skips (no usable GPU): only the NCCL case may skip.
if [ "$ops_rc" -ne 0 ]; then ops="FAILED (exit $ops_rc)"
elif [ "$skipped" -gt 1 ]; then ops="FAILED ($skipped cases skipped: $(grep -m1 -o -E 'no GPU: .*|tensor-core flash kernels do not run here: .*' "$OUT/device-check.log" || echo 'see the log'))"; ops_rc=1
else ops="pass (exit 0; skipped: $skipped)"; fi
row "CUDA ops vs CPU backend (cuda_ops_test)" "$ops"

# 2b. The tensor-core flash kernels (flash_attention_tc.cu: shared tiles, warp-level
# hand-offs) under the sanitizer's shared-memory race and barrier checks.
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ] && [ -x $B/cuda_ops_test ]; then
  # (Its largest shape alone may take the sanitizers long: a run cut at its time limit says
  # so and fails nothing, a hazard found or a test not run does.)
  for tool in racecheck synccheck; do
    timeout $(lim 45) "$SAN" --tool $tool --error-exitcode 3 $B/cuda_ops_test \
      --gtest_filter='*FlashAttentionOnTensorCores*' > "$OUT/sanitizer_$tool.log" 2>&1
    san_rc=$?
    log < "$OUT/sanitizer_$tool.log" > /dev/null
    if [ $san_rc -eq 0 ] && grep -q '^\[       OK \] CudaOps.FlashAttentionOnTensorCores' "$OUT/sanitizer_$tool.log"; then
      san="clean: $(grep -m1 -o 'ERROR SUMMARY: .*' "$OUT/sanitizer_$tool.log")"
    elif [ $san_rc -eq 0 ]; then san="FAILED (the test did not run: skipped?)"
    elif [ $san_rc -eq 124 ]; then
      found=$(grep -c -E '^=+ .*(Error|error detected|[Hh]azard)' "$OUT/sanitizer_$tool.log")
      [ "$found" -eq 0 ] && san="cut at the time limit, no hazard reported before it" || san="FAILED ($found error lines before the time limit)"
    else san="FAILED (exit $san_rc)"; fi
    row "tensor-core flash kernels' op test under compute-sanitizer --tool $tool" "$san"
  done
else
  row "tensor-core flash kernels under compute-sanitizer" "skipped (no compute-sanitizer on this machine)"
fi

bench_rc=1
if [ -x $B/cuda_bench ]; then
  timeout $(lim 60) $B/cuda_bench 2>&1 | tee "$OUT/cuda_bench.txt" | log
  bench_rc=${PIPESTATUS[0]}
  grep -q '^cuda_bench: no GPU' "$OUT/cuda_bench.txt" && bench_rc=1  # it exits 0 without one
fi
row "kernel speed table (cuda_bench, in the log)" "$([ "$bench_rc" -eq 0 ] && echo printed || echo "FAILED (exit $bench_rc)")"

# 4. tiny-gpt on both backends. The one-rank GPU runs here and in step 5 use the staged
# communicator (a world of one has nothing to communicate), so a failure of NCCL's bootstrap
# cannot take their measurements down; step 8 trains through NCCL on its own.
T="--model tiny-gpt --steps 30 --quiet --seed 7"
timeout $(lim 60) $S train $T --plan tp=1,precision=bf16 --backend cuda --comm staged --json "$OUT/tiny_cuda.json" 2>&1 | log
timeout $(lim 60) $S train $T --plan tp=1,precision=bf16 --json "$OUT/tiny_cpu.json" 2>&1 | log
row "tiny-gpt bf16 30 steps, GPU vs CPU loss curve" "$(compare_losses "$OUT/tiny_cuda.json" "$OUT/tiny_cpu.json" 1e-2 bf16)"
# The same with the fused attention (on the tensor cores on the GPU, fp32 on the CPU).
timeout $(lim 60) $S train $T --plan tp=1,precision=bf16,attention=flash --backend cuda --comm staged --json "$OUT/tiny_flash_cuda.json" 2>&1 | log
timeout $(lim 60) $S train $T --plan tp=1,precision=bf16,attention=flash --json "$OUT/tiny_flash_cpu.json" 2>&1 | log
row "tiny-gpt bf16 attention=flash 30 steps, GPU vs CPU loss curve" "$(compare_losses "$OUT/tiny_flash_cuda.json" "$OUT/tiny_flash_cpu.json" 1e-2 bf16)"

# 5. gpt2-124m on the GPU with the unfused and the fused attention, and the unfused with
# selective recompute, and the estimate of each plan. Memory: the device's own pool peaks (by category; saved activations in 16 bits) and its
# memory in use after training (context, libraries, pools' reserve), against the estimate.
# The estimate runs on the H200 preset with the executor's software stack ("strata": no
# dropout, fp32 gradient accumulation, its own overlap), the stack that actually runs here.
# The preset of the GPU found: an H100 (80 GB) or else the H200 the check was written for.
PRESET=dgx-h200-141g
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && PRESET=dgx-h100-80g
echo "estimates on the $PRESET preset" | log
python3 -c "import json,sys; c=json.load(open('hw_profiles/$PRESET.json')); c['framework']['software_stack']='strata'; c['name']=c.get('name','$PRESET')+'-strata'; json.dump(c,open(sys.argv[1],'w'),indent=1)" "$OUT/preset-strata.json"
# (selective: the unfused attention with its S x S probabilities recomputed in the backward
# instead of kept, packed to 16 bits and unpacked: whether that is the faster plan here.
# flash_mbs32: the fused attention on micro-batches of 32, nearer llm.c's 64 a GPU: its
# GEMMs larger and the optimizer's pass over the weights a fourth as large a share of the
# step; predicted 41 % MFU on the H200 preset against 35 % at 8, 2026-12-07.)
for att in unfused flash selective flash_mbs32; do
  P124="tp=1,mbs=8,gbs=8,precision=bf16,attention=$att"
  [ "$att" = selective ] && P124="tp=1,mbs=8,gbs=8,precision=bf16,attention=unfused,recompute=selective"
  [ "$att" = flash_mbs32 ] && P124="tp=1,mbs=32,gbs=32,precision=bf16,attention=flash"
  timeout $(lim 60) $S train --model gpt2-124m --plan $P124 --steps 6 --quiet --backend cuda --comm staged --json "$OUT/gpt2_$att.json" 2>&1 | log
  $S estimate --model gpt2-124m --cluster "$OUT/preset-strata.json" --plan "$P124" --json > "$OUT/gpt2_${att}_estimate.json" 2>> "$OUT/device-check.log"
  row "gpt2-124m bf16 S1024 $P124 on the GPU: step, MFU, memory; estimate ($PRESET, strata stack)" "$(python3 - "$OUT" "$att" <<'EOF' 2>&1
import json, sys
d, att = sys.argv[1], sys.argv[2]
try:
    r = json.load(open("%s/gpt2_%s.json" % (d, att)))
    e = json.load(open("%s/gpt2_%s_estimate.json" % (d, att)))
    step = r["median_step_time_s"]
    mfu = r["model_flops_per_step"] / step / 989.4e12
    tracked = r["peak_memory_bytes"]["total"]
    dm = r["device_memory_bytes"]
    dev = dm["device_in_use_after_training"]
    pools = dm["pool_peak_in_use"]["sum_of_peaks"]
    pe = e["memory_bytes"]["peak"]
    print("measured %.4f s/step, MFU %.1f%% (target 40%%); predicted %.4f s (%+.1f%%). Memory: device in use %.2f GiB, "
          "predicted peak %.2f GiB (%+.1f%%); pools' peaks %.2f GiB, tracked %.2f GiB"
          % (step, 100 * mfu, e["step_time_s"], 100 * (e["step_time_s"] / step - 1), dev / 2**30, pe / 2**30,
             100 * (pe / dev - 1), pools / 2**30, tracked / 2**30))
except Exception as e:
    print("FAILED (%s)" % e)
EOF
)"
done

# 6. Two ranks on the one GPU through the host-staged communicator.
for plan in "tp=2,precision=fp32" "dp=2,zero=1,mbs=1,gbs=4,precision=fp32"; do
  tag=$(echo "$plan" | tr ',=' '__')
  timeout $(lim 60) mpirun --oversubscribe -np 2 $S train --model tiny-gpt --plan "$plan" --steps 10 --quiet --seed 7 \
    --backend cuda --json "$OUT/two_$tag.cuda.json" 2>&1 | log
  timeout $(lim 60) mpirun --oversubscribe -np 2 $S train --model tiny-gpt --plan "$plan" --steps 10 --quiet --seed 7 \
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
# 7. strata profile on the GPU (GEMMs in bf16 and fp32, gpt2-124m's shapes among them,
# memory and kernels in device memory; one rank: ranks sharing the GPU would each measure
# half of it), and the estimate of the gpt2-124m plans on the measured profile against
# their measured step times and the device's memory in use.
timeout $(lim 90) $S profile --backend cuda --comm staged --model gpt2-124m \
  --out "$OUT/profile_cuda.json" > "$OUT/profile_cuda.txt" 2>&1
prof_rc=$?
cat "$OUT/profile_cuda.txt" >> "$OUT/device-check.log"
for att in unfused flash; do
  $S estimate --model gpt2-124m --cluster "$OUT/profile_cuda.json" --plan "tp=1,mbs=8,gbs=8,precision=bf16,attention=$att" \
    --json > "$OUT/gpt2_${att}_on_profile.json" 2>> "$OUT/device-check.log"
done
row "profile --backend cuda (one rank), estimate of gpt2-124m on it" "$(python3 - "$OUT" "$prof_rc" <<'EOF' 2>&1
import json, sys
d, rc = sys.argv[1], int(sys.argv[2])
try:
    c = json.load(open(d + "/profile_cuda.json"))
    dev = c["device"]
    out = ["exit %d; bf16 GEMM peak %.0f TFLOP/s, fp32 %.0f, memory %.0f GB/s, framework %.2f GiB" % (
        rc, dev["peak_tflops"]["bf16"], dev["peak_tflops"]["fp32"], dev["memory_bandwidth_gbps"],
        c["framework"]["overhead_bytes"] / 2**30)]
    for att in ("unfused", "flash"):
        e = json.load(open("%s/gpt2_%s_on_profile.json" % (d, att)))
        r = json.load(open("%s/gpt2_%s.json" % (d, att)))
        m = r["median_step_time_s"]
        dev = r["device_memory_bytes"]["device_in_use_after_training"]
        pe = e["memory_bytes"]["peak"]
        out.append("%s: predicted %.4f s vs measured %.4f s (%+.1f%%), peak %.2f GiB vs device in use %.2f GiB (%+.1f%%)"
                   % (att, e["step_time_s"], m, 100 * (e["step_time_s"] / m - 1), pe / 2**30, dev / 2**30, 100 * (pe / dev - 1)))
    print("; ".join(out))
except Exception as e:
    print("FAILED (exit %d; %s)" % (rc, e))
EOF
)"
# 7b. Where the predicted and the measured step part: gpt2-124m (unfused) op by op on the
# GPU (strata train --ops: each op between two events on the stream, by the cost model's op
# names), beside the cost model's op times on the profile just measured. The table is in
# the log and in gpt2_ops.txt.
timeout $(lim 60) $S train --model gpt2-124m --plan tp=1,mbs=8,gbs=8,precision=bf16,attention=unfused --steps 4 \
  --quiet --backend cuda --comm staged --ops --cluster "$OUT/profile_cuda.json" --json "$OUT/gpt2_ops.json" \
  > "$OUT/gpt2_ops.txt" 2>&1
ops_rc=$?
cat "$OUT/gpt2_ops.txt" >> "$OUT/device-check.log"
row "gpt2-124m per-op times on the GPU against the profile's estimate (table in the log)" "$(python3 - "$OUT" "$ops_rc" <<'EOF' 2>&1
import json, sys
d, rc = sys.argv[1], int(sys.argv[2])
try:
    rows = json.load(open(d + "/gpt2_ops.json"))["ops"]["rows"]
    out = []
    for ph in ("forward", "backward"):
        lay = [r for r in rows if r["per"] == "layer" and r["phase"] == ph]
        m = sum(r["measured_s"] or 0 for r in lay)
        p = sum(r["predicted_s"] or 0 for r in lay)
        gaps = [r for r in lay if r["predicted_s"] is not None]
        worst = max(gaps, key=lambda r: abs(r["predicted_s"] - r["measured_s"])) if gaps else None
        out.append("%s layer %.3f ms measured, %.3f predicted%s" % (ph, 1e3 * m, 1e3 * p, "" if worst is None else
                   " (largest gap: %s %.3f vs %.3f ms)" % (worst["op"], 1e3 * worst["measured_s"], 1e3 * worst["predicted_s"])))
    print("exit %d; " % rc + "; ".join(out))
except Exception as e:
    print("FAILED (exit %d; %s)" % (rc, e))
EOF
)"

# 8. The NCCL communicator: its op test (a world of one, every group through NCCL) from
# step 2, then tiny-gpt trained through it (steps 4, 5 and 7 used the staged one).
nccl_case='CudaOps.NcclCommunicatorOrdersItsStreamsAfterTheOps'
if grep -q "^\[       OK \] $nccl_case" "$OUT/device-check.log"; then nccl="pass"
elif grep -q "^\[  SKIPPED \] $nccl_case" "$OUT/device-check.log"; then nccl="skipped ($(grep -m1 -o -E 'no (NCCL|GPU): .*' "$OUT/device-check.log" || echo 'reason in the log'))"
else nccl="FAILED (see $nccl_case in the log)"; fi
row "NCCL communicator on one GPU (world of one; multi-GPU runs not checked: one GPU lent)" "$nccl"
if [[ "$nccl" == skipped* ]]; then  # no NCCL to train through: the same reason, not a failure
  row "tiny-gpt bf16 30 steps through NCCL (--comm nccl), losses vs the staged run of step 4" "$nccl"
else
  timeout $(lim 60) $S train $T --plan tp=1,precision=bf16 --backend cuda --comm nccl --json "$OUT/tiny_nccl.json" 2>&1 | log
  # Equal up to the order of the kernels' atomic additions (scatter-add, norms).
  row "tiny-gpt bf16 30 steps through NCCL (--comm nccl), losses vs the staged run of step 4" \
    "$(compare_losses "$OUT/tiny_nccl.json" "$OUT/tiny_cuda.json" 1e-4 "atomic-order")"
fi

# 9. Where a gpt2-124m step's GPU time goes: Nsight Compute times every kernel of a 2-step
# run (one at a time, so no launch gaps), summed by kernel name (scripts/kernel-times.py).
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  timeout $(lim 150) "$NCU" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none \
    $S train --model gpt2-124m --plan tp=1,mbs=8,gbs=8,precision=bf16,attention=unfused --steps 2 \
    --quiet --backend cuda --comm staged > "$OUT/ncu_gpt2.csv" 2>> "$OUT/device-check.log"
  ncu_rc=$?
  python3 scripts/kernel-times.py "$OUT/ncu_gpt2.csv" 2 30 > "$OUT/kernel_times.md" 2>&1
  kt_rc=$?
  log < "$OUT/kernel_times.md" > /dev/null
  # Cut at the time limit, the launches captured are part of the two steps: per step is low.
  cut=$([ $ncu_rc -eq 124 ] && echo " (CUT at the time limit: part of the 2 steps; ncu exit 124)" || echo "")
  row "gpt2-124m unfused, kernel time per step by kernel (ncu; table in the log)" \
    "$([ $kt_rc -eq 0 ] && echo "$(tail -1 "$OUT/kernel_times.md")$cut" || echo "FAILED (exit $kt_rc, ncu exit $ncu_rc)")"
else
  row "gpt2-124m unfused, kernel time per step by kernel (ncu)" "skipped (no ncu on this machine)"
fi

{
  echo
  echo "| check | result |"
  echo "|---|---|"
  printf '%s\n' "${rows[@]}"
} 2>&1 | log
[ "$ops_rc" -eq 0 ] && ! printf '%s\n' "${rows[@]}" | grep -q FAILED
