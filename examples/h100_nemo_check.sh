#!/usr/bin/env bash
# A check of the H100, H200 and B200 presets against runs they were never fitted to: the rows of
# tests/data/hopper_runs.csv (calibration_test's HopperAndBlackwellRuns asserts its bounds on
# the same rows; this script prints them through the binary, as the harness would run it).
# Sources, by the csv's group column:
#   nemo-24.12       NVIDIA NeMo Framework 24.12 "Performance Benchmarks", pre-training, FP8,
#                    DGX-H100 (docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/
#                    performance/performance_summary.html; the 24.09 table has the same rows).
#   nemo-24.07       the Nemotron rows of NeMo 24.07's table (NVIDIA/NeMo docs/source/performance/
#                    performance_summary.md at 9c5c5e9709; its GPT-3 and Llama rows are the
#                    24.12 rows' numbers): squared-ReLU models, their JSONs in tests/data/models;
#                    the 340B with selective recompute and bf16 gradients, as
#                    NeMo-Framework-Launcher's nemotron_340b.yaml trains it.
#   nemo-25.02       the NeMo 25.02 performance summary (FP8, NeMo 2.0): GPT-3 175B on DGX-H100
#                    and the dense models on DGX-B200 (the page docs.nvidia.com/nemo-framework/
#                    user-guide/latest/performance/performance_summary.html while 25.02 was the
#                    latest container; later releases keep their own tables under
#                    performance/archive/).
#   megatron-bridge  the Megatron-Bridge performance summaries (NeMo containers 25.09, 25.11,
#                    26.02 and, the last two rows, 26.04.01; FP8 current scaling; DGX-H100 and DGX-B200;
#                    github.com/NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md and
#                    performance-summary-archive.md).
#   nemo-automodel   NeMo AutoModel's Llama 3 70B (PyTorch FSDP2 + Transformer Engine, BF16,
#                    DGX-H100; docs/performance-summary.mdx of NVIDIA-NeMo/Automodel, 2026-04:
#                    18.90 s per step; recompute is not stated, and full is the only setting
#                    that fits).
#   mlperf           MLPerf Training results run with NVIDIA's NeMo code (github.com/mlcommons/
#                    training_results_v5.1, v5.0, v4.1): llama31_405b on H200 (Nebius, 64 and
#                    128 nodes), B200 (University of Florida, 32 and 56 nodes, user buffers
#                    off as its config leaves them) and H100 (NVIDIA, 64-1024 nodes), gpt3 on
#                    H100 (NVIDIA 32 and 64 nodes, Oracle 192 and 384); the label names
#                    submitter and nodes; the median train_step_time of their result logs;
#                    bf16 gradient reduction and fp8 parameter gathers, as their DDP configs say.
#   mlperf-8b        MLPerf Training v5.1 llama31_8b, FP8, one micro-batch a GPU a step: HPE's
#                    8 H200 nodes, the B200 results (University of Florida 1-32 nodes, Dell's
#                    2xXE9680L (Dell-n2) and 2xXE9685L (Dell-n2b), Oracle, Verda; the FP4
#                    results left out), Cisco's 8 and 16 H100 nodes.
# Each plan is the table's: NeMo's and Bridge's recipes use the distributed optimizer
# (zero=1) unless the table says FSDP (zero=3), and sequence parallelism with TP; Bridge's
# Llama 3 8B H100 FP8 recipe recomputes 5 layers in full (scripts/performance/configs/llama3/
# workload_base_configs.py, recompute_num_layers=5, Megatron-Bridge 0.2.1); Bridge's recipes
# reduce gradients in bf16 (grad_reduce_in_fp32=0, as every Bridge performance recipe of
# these models sets it; NeMo 24.12's and 25.02's scripts kept fp32). Measured
# step time = global batch x sequence / (tokens per second per GPU x GPUs). Prints one table;
# asserts nothing. The recipes of the tensor-parallel rows also ran Transformer Engine's
# user buffers (tp_comm_overlap=True with a userbuffers config), which strata's "auto"
# runs too where the group sits in a node: `noub_s` and `noub_err%` give those rows again
# with tp_comm_overlap=0, as a Megatron-LM launch without --tp-comm-overlap runs them.
set -euo pipefail
S=${STRATA:-}
[[ -n "$S" && "$S" == */* && "$S" != /* ]] && S="$PWD/$S"  # STRATA relative to the caller's directory
cd "$(dirname "$0")/.."
S=${S:-build/strata}  # the default relative to the repository
[[ -x "$S" || "$S" != */* ]] || { echo "h100_nemo_check.sh: no strata binary at $S (build it, or set STRATA)" >&2; exit 2; }
python3 - "$S" <<'EOF'
import csv, json, subprocess, sys
strata = sys.argv[1]
print('%-16s %-24s %-14s %5s %5s %-52s %8s %8s %7s %7s %4s %8s %9s' %
      ('group', 'model', 'cluster', 'gpus', 'gbs', 'plan', 'meas_s', 'pred_s', 'err%', 'memGiB', 'fits', 'noub_s', 'noub_err%'))
def estimate(r, model, plan):
    out = subprocess.run([strata, 'estimate', '--model', model, '--cluster', r['cluster'], '--plan',
                          plan + ',gbs=' + r['global_batch_size'], '--seq-length', r['seq_length'], '--json'],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit('%s %s: strata exited %d: %s' % (r['label'], plan, out.returncode, out.stderr.strip()))
    return json.loads(out.stdout)
for r in csv.DictReader(open('tests/data/hopper_runs.csv')):
    model = 'tests/data/' + r['model'] if '/' in r['model'] else r['model']
    measured = int(r['global_batch_size']) * int(r['seq_length']) / (float(r['tokens_per_s_per_gpu']) * int(r['gpus']))
    j = estimate(r, model, r['plan'])
    noub = ''
    if 'sp=1' in r['plan'].split(',') and 'tp_comm_overlap=0' not in r['plan'].split(','):
        u = estimate(r, model, r['plan'] + ',tp_comm_overlap=0')
        noub = '%8.2f %+8.1f%%' % (u['step_time_s'], 100 * (u['step_time_s'] / measured - 1))
    print('%-16s %-24s %-14s %5s %5s %-52s %8.2f %8.2f %+6.1f%% %7.1f %4s %s' %
          (r['group'], r['label'], r['cluster'], r['gpus'], r['global_batch_size'], r['plan'], measured, j['step_time_s'],
           100 * (j['step_time_s'] / measured - 1), j['memory_bytes']['peak'] / 2**30, 'yes' if j['fits'] else 'NO', noub))
EOF
