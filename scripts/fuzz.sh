#!/usr/bin/env bash
# Fuzzes the loaders of user input (tests/fuzz/fuzz_loaders.h) with libFuzzer under ASan +
# UBSan for SECONDS (default 120) on one core, starting from seeds made of the repository's
# own inputs and the committed corpus; then minimises everything it kept into
# tests/fuzz/corpus (replayed by ctest: fuzz_corpus_test, with tests/fuzz/regressions, the
# inputs of bugs it found, kept by name). Prints the number of inputs
# run and the time. Exit 1 when libFuzzer found a crash, leak, hang or oversized allocation
# (the input is left in build-fuzz/crash-* etc.).
#   usage: scripts/fuzz.sh [SECONDS]        (make fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-120}
B=build-fuzz
if ! command -v clang++ > /dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a > /dev/null 2>&1; then
  echo "fuzz.sh: installing clang and libFuzzer (Debian: clang, libclang-rt-N-dev for clang N)"
  apt-get update -qq && apt-get install -y -qq clang > /dev/null
  v=$(clang++ --version | grep -o 'version [0-9]*' | grep -o '[0-9]*$')
  apt-get install -y -qq "libclang-rt-$v-dev" > /dev/null
fi
mkdir -p $B
cmake -S . -B $B -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_FUZZ=ON > $B/configure.log
cmake --build $B -j 2 --target loaders_fuzz > $B/build.log

# Seeds: the first byte picks the loader (fuzz_loaders.h), the rest is a real input.
seeds=$B/seeds
rm -rf $seeds && mkdir -p $seeds $B/corpus tests/fuzz/corpus
# (a pipe runs seed in a subshell: number the files by counting them)
seed() { local n; n=$(ls $seeds | wc -l); { printf "\\$(printf %03o "$1")"; cat; } > $seeds/seed-$n; }
for f in examples/*.model.json; do seed 0 < "$f"; done
seed 1 < examples/llama3-8b.config.json
printf '{"model_type":"gpt2","n_layer":12,"n_embd":768,"n_head":12,"vocab_size":50257,"n_positions":1024}' | seed 1
seed 2 < examples/megatron-gpt3-1024.plan.json
printf '{"tp":2,"pp":2,"dp":2,"mbs":1,"gbs":8,"zero":3,"recompute":"full","sp":true}' | seed 2
printf 'tp=2,pp=2,dp=2,mbs=1,gbs=8,zero=1,recompute=selective,sp=1' | seed 3
printf 'tp=1,pp=2,dp=4,vp=2,mbs=2,gbs=64,precision=bf16' | seed 3
for f in hw_profiles/*.json; do seed 4 < "$f"; done
printf '\001\000\002\000\003\000\004\000\005\000\006\000\007\000\010\000\011\000\012\000\013\000' | seed 5
printf '{"format":"strata-checkpoint-1","step":2,"adam_step":2,"good_steps":2,"loss_scale":1,"seed":1,"model":"m","data":"synthetic","plan":{},"global_params":1,"world_size":1,"files":[{"name":"shard-00000.bin","bytes":12,"fnv1a64":"0000000000000000"}]}' | seed 6
for s in kill@1:3 nan@0:2- nan@1:2-5 kill-in-checkpoint@0:4 hang@3:7; do printf '%s' "$s" | seed 7; done
printf '16' | seed 7
printf -- '--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 100 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --bf16 --recompute-granularity full' | seed 7
printf 'N=2\ntorchrun --nproc_per_node $N ( --num-layers=4 --hidden-size "64" --num-attention-heads 4 --seq-length 32 --vocab-size 100 --num-layers-per-virtual-pipeline-stage 1 --pipeline-model-parallel-size 2 --fp8-format hybrid ) # x\n' | seed 7

echo "fuzz.sh: $(ls $seeds | wc -l) seeds, $(ls tests/fuzz/corpus 2> /dev/null | wc -l) corpus inputs; fuzzing for ${secs} s"
start=$(date +%s)
rc=0
ASAN_OPTIONS=detect_leaks=1 $B/loaders_fuzz $B/corpus $seeds tests/fuzz/corpus tests/fuzz/regressions -max_total_time="$secs" -timeout=10 \
  -rss_limit_mb=2048 -malloc_limit_mb=1024 -max_len=16384 -print_final_stats=1 -artifact_prefix=$B/ \
  > $B/fuzz.log 2>&1 || rc=$?
end=$(date +%s)
runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' $B/fuzz.log | grep -o '[0-9]*$' || echo 0)
if [ "$rc" -ne 0 ]; then
  grep -m1 -A6 -E 'ERROR|runtime error|what\(\)' $B/fuzz.log || tail -20 $B/fuzz.log
  echo "fuzz.sh: FAILED after $runs inputs: see $B/fuzz.log and the $B/crash-* / leak-* / timeout-* / oom-* file"
  exit 1
fi
# Keep only inputs that add coverage, as the committed corpus.
rm -rf $B/min && mkdir -p $B/min
$B/loaders_fuzz -merge=1 $B/min $B/corpus $seeds tests/fuzz/corpus -max_len=16384 > $B/merge.log 2>&1
rm -rf tests/fuzz/corpus && mv $B/min tests/fuzz/corpus
echo "fuzz.sh: $runs inputs in $((end - start)) s ($((runs / (end - start > 0 ? end - start : 1))) per second), no crash," \
  "hang, leak or sanitizer report; corpus: $(ls tests/fuzz/corpus | wc -l) inputs in tests/fuzz/corpus"
