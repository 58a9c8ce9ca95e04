#!/usr/bin/env bash
# The executor's speed claims, measured in one run on this machine (README "Executor speed"):
#   1. one rank's model FLOP/s in a training step of a hidden-512 model, against the
#      backend's own GEMM rate measured by the same binary (target: at least 50%);
#   2. dp2 runs: data-parallel communication left exposed after overlapping it with the
#      backward, against the same reductions run alone (target: at most a quarter). The
#      final wait also holds the time a rank waits for the slower replica to finish its
#      backward (skew, load imbalance); the table shows it and the wait net of it.
#   3. a reduce-scatter started before 20 ms of compute that calls no MPI: what is left to
#      wait for afterwards, with the MPI communicator's progress thread and without it
#      (STRATA_MPI_PROGRESS_US=0), beside the same reduce-scatter run alone.
# Usage: scripts/bench-executor.sh [BUILD_DIR]   (after make build)
set -euo pipefail
BUILD=${1:-build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$BUILD/executor_bench" --benchmark_format=json --benchmark_out="$tmp/bench.json" --benchmark_out_format=json \
  > /dev/null 2> "$tmp/bench.err"
mpirun -np 2 "$BUILD/strata" train --model tiny-gpt --plan dp=2,mbs=4,gbs=16,precision=fp32 --steps 10 --quiet \
  --json "$tmp/dp2.json" > /dev/null
mpirun -np 2 "$BUILD/strata" train --model examples/gpt-512.model.json --plan dp=2,mbs=2,gbs=8,precision=fp32 \
  --steps 6 --quiet --json "$tmp/dp2-512.json" > /dev/null

mpirun -np 2 "$BUILD/comm_overlap_bench" > "$tmp/overlap-on.txt"
mpirun -x STRATA_MPI_PROGRESS_US=0 -np 2 "$BUILD/comm_overlap_bench" > "$tmp/overlap-off.txt"

python3 - "$tmp" <<'PY'
import json, sys, platform
d = sys.argv[1]
bench = json.load(open(f"{d}/bench.json"))
rows = {b["name"]: b for b in bench["benchmarks"]}
gemm = max(b["FLOP/s"] for n, b in rows.items() if n.startswith("BM_Gemm"))
cpu = bench["context"].get("host_name", platform.node())
print(f"machine: {bench['context'].get('num_cpus')} CPUs at {bench['context'].get('mhz_per_cpu')} MHz ({cpu}); one core per rank")
print(f"{'measurement':<48} {'value':>14} {'ratio':>8}")
print(f"{'GEMM (float, best of 512/1024/2048)':<48} {gemm/1e9:>10.1f} GF/s {1.0:>8.2f}")
for n, b in rows.items():
    if n.startswith("BM_TrainStep"):
        f = b["model FLOP/s"]
        print(f"{n.split('/')[0] + ' model FLOP/s':<48} {f/1e9:>10.1f} GF/s {f/gemm:>8.2f}")
for tag in ["dp2", "dp2-512"]:
    j = json.load(open(f"{d}/{tag}.json"))
    t = j["time_s"]
    exposed, skew, alone = t["dp_comm"], t["dp_skew"], t["dp_comm_standalone"]
    print(f"{tag + ' dp reductions run alone (blocking)':<48} {alone*1e3:>11.2f} ms {1.0:>8.2f}")
    print(f"{tag + ' final wait for them in training':<48} {exposed*1e3:>11.2f} ms {exposed/alone:>8.2f}")
    print(f"{tag + '   of it waiting for the slower replica':<48} {skew*1e3:>11.2f} ms {skew/alone:>8.2f}")
    print(f"{tag + '   exposed communication (wait - skew)':<48} {(exposed-skew)*1e3:>11.2f} ms {(exposed-skew)/alone:>8.2f}")
def rows(name):
    out = {}
    for line in open(f"{d}/{name}"):
        if not line.startswith("#"):
            b, wait, alone = line.split()
            out[int(b)] = (float(wait), float(alone))
    return out
on, off = rows("overlap-on.txt"), rows("overlap-off.txt")
print()
print("reduce-scatter on 2 ranks, started before 20 ms of compute without MPI calls: wait left afterwards")
print(f"{'bytes in':>10} {'alone (ms)':>11} {'no thread (ms)':>15} {'thread (ms)':>12} {'no thread/alone':>16} {'thread/alone':>13}")
for b in sorted(on):
    alone = off[b][1]
    print(f"{b:>10} {alone:>11.3f} {off[b][0]:>15.3f} {on[b][0]:>12.3f} {off[b][0]/alone:>16.2f} {on[b][0]/alone:>13.2f}")
PY
