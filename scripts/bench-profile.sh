#!/usr/bin/env bash
# strata profile's link figures against an independent raw-MPI loop (tests/mpi_bandwidth_check.cpp),
# one run on this machine: all-reduce bus bandwidth and ring send/recv bandwidth at 64 KiB .. 4 MiB
# (target: within 10%), with the raw ping-pong beside it. Usage: scripts/bench-profile.sh [BUILD_DIR] [RANKS]
set -euo pipefail
BUILD=${1:-build}
NP=${2:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpirun -np "$NP" "$BUILD/strata" profile --max-bytes 4194304 > "$tmp/profile.txt" 2> /dev/null
mpirun -np "$NP" "$BUILD/mpi_bandwidth_check" 65536 262144 1048576 4194304 > "$tmp/check.txt"
python3 - "$tmp" <<'PY'
import sys
d = sys.argv[1]
prof = {}
for line in open(f"{d}/profile.txt"):
    f = line.split()
    if len(f) == 8 and f[3] == "float":
        prof[(f[0], int(f[1]))] = float(f[6])
print(f"{'size':>9} {'collective':<12} {'strata profile':>15} {'raw MPI loop':>13} {'ratio':>7}   (ping-pong, for reference)")
within = total = 0
for line in open(f"{d}/check.txt"):
    b, _, ar, _, pp, _, ring = line.split()
    b = int(b)
    # send/recv compares with the raw ring (every rank sending at once, as the profile's row);
    # the ping-pong (one direction at a time, two ranks only) is shown beside it.
    for name, ref, extra in (("all_reduce", float(ar), ""), ("sendrecv", float(ring), f"   {float(pp):.2f} GB/s")):
        got = prof.get((name, b))
        if got is None or ref == 0:
            continue
        total += 1
        within += abs(got / ref - 1) <= 0.10
        print(f"{b:>9} {name:<12} {got:>10.2f} GB/s {ref:>8.2f} GB/s {got/ref:>7.2f}{extra}")
print(f"within 10%: {within} of {total}")
PY
