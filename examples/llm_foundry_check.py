#!/usr/bin/env python3
"""A check against runs of another framework that strata was never fitted to: MosaicML
llm-foundry's MPT training benchmarks (github.com/mosaicml/llm-foundry,
scripts/train/benchmarking/README.md: Composer on PyTorch FSDP, llm-foundry's Triton
FlashAttention kernel, H100 80GB in BF16 and FP8, A100 80GB and 40GB in BF16, 125M-70B
models at 512-65536 tokens, 8-512 GPUs), through the strata binary.

The rows are tests/data/mosaic_fsdp_runs.csv (all 216 of the five tables; how each column
was read, and the bounds the test holds them to: tests/calibration_test.cpp,
MosaicFsdpRuns), the models tests/data/models/mpt-*.json. Measured step time = global
batch x sequence / tokens per second.

Usage: examples/llm_foundry_check.py [path to strata]   (default build/strata)
Prints one table per group and a summary; asserts nothing (calibration_test does).
"""
import csv
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
STRATA = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("STRATA", os.path.join(ROOT, "build", "strata"))


def estimate(row):
    cmd = [STRATA, "estimate", "--model", os.path.join(DATA, row["model"]), "--cluster", row["cluster"],
           "--gpus", row["gpus"], "--seq-length", row["seq_length"],
           "--plan", row["plan"] + ",gbs=" + row["global_batch_size"], "--json"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main():
    with open(os.path.join(DATA, "mosaic_fsdp_runs.csv")) as f:
        rows = list(csv.DictReader(f))
    groups = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    summary = []
    for group, runs in groups.items():
        print(f"\n{group} ({runs[0]['cluster']})")
        print("%-16s %5s %-72s %9s %9s %7s %8s %5s" % ("model", "gpus", "plan", "meas_s", "pred_s", "err%",
                                                      "mem_GiB", "fits"))
        errors, misfits = [], 0
        for r in runs:
            measured = int(r["global_batch_size"]) * int(r["seq_length"]) / (
                float(r["tokens_per_s_per_gpu"]) * int(r["gpus"]))
            j = estimate(r)
            err = 100 * (j["step_time_s"] / measured - 1)
            errors.append(err)
            misfits += not j["fits"]
            print("%-16s %5s %-72s %9.3f %9.3f %+6.1f%% %8.1f %5s" %
                  (r["label"], r["gpus"], r["plan"], measured, j["step_time_s"], err,
                   j["memory_bytes"]["peak"] / 2**30, "yes" if j["fits"] else "NO"))
        summary.append((group, len(errors), statistics.median(abs(e) for e in errors), statistics.median(errors),
                        max(abs(e) for e in errors), misfits))
    print("\n%-18s %5s %12s %14s %9s %s" % ("group", "rows", "median |err|", "median signed", "max |err|",
                                            "predicted not to fit (all ran)"))
    for g, n, med, signed, mx, nf in summary:
        print("%-18s %5d %11.1f%% %+13.1f%% %8.1f%% %d" % (g, n, med, signed, mx, nf))


if __name__ == "__main__":
    main()
