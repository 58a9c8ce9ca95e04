#!/usr/bin/env python3
"""GPU time by kernel from Nsight Compute's CSV (scripts/device-check.sh, step 9).

Reads `ncu --metrics gpu__time_duration.sum --csv --print-units base` output (one row per
kernel launch and metric), groups the launches by kernel name (the name up to its argument
list, templates kept), and prints a table: launches, total ms, ms per step, share of the
summed kernel time. Kernels run one at a time under ncu, so the sum is the time a step's
kernels take back to back, with no launch gaps: set it beside the step's measured time.

  usage: kernel-times.py NCU_CSV STEPS [TOP]
"""
import csv
import sys


def kernel_name(full):
    # "void strata::cuda::(anonymous namespace)::xent_max(float *, const float *, long long)"
    # -> "strata::cuda::(anonymous namespace)::xent_max"; cuBLAS's long names stay whole up
    # to their argument list.
    name = full.strip()
    if name.startswith("void "):
        name = name[5:]
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name.startswith("(anonymous", i):
            return name[:i]
    return name


def seconds(value, unit):
    v = float(value.replace(",", ""))
    scale = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3,
             "s": 1.0, "second": 1.0}
    return v * scale.get(unit.strip(), 1e-9)


def main():
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    path, steps = sys.argv[1], float(sys.argv[2])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own notes (==PROF==) are not CSV
    totals, counts = {}, {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        k = kernel_name(row["Kernel Name"])
        totals[k] = totals.get(k, 0.0) + seconds(row["Metric Value"], row.get("Metric Unit", "ns"))
        counts[k] = counts.get(k, 0) + 1
    if not totals:
        print("kernel-times: no gpu__time_duration.sum rows in %s" % path, file=sys.stderr)
        return 1
    whole = sum(totals.values())
    print("| kernel | launches | total ms | ms per step | share |")
    print("|---|---|---|---|---|")
    ranked = sorted(totals, key=totals.get, reverse=True)
    for k in ranked[:top]:
        print("| %s | %d | %.3f | %.3f | %.1f%% |" % (k[:90], counts[k], 1e3 * totals[k], 1e3 * totals[k] / steps,
                                                     100 * totals[k] / whole))
    rest = ranked[top:]
    if rest:
        r = sum(totals[k] for k in rest)
        print("| (%d more kernels) | %d | %.3f | %.3f | %.1f%% |" % (len(rest), sum(counts[k] for k in rest), 1e3 * r,
                                                                  1e3 * r / steps, 100 * r / whole))
    print("| all kernels | %d | %.3f | %.3f | 100%% |" % (sum(counts.values()), 1e3 * whole, 1e3 * whole / steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
