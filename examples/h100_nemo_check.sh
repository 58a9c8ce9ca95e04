#!/usr/bin/env bash
# A check of the H100 preset against runs it was never fitted to: NVIDIA NeMo Framework
# 24.12 "Performance Benchmarks" table (pre-training, FP8, H100; docs.nvidia.com/nemo-framework
# /user-guide/24.12/nemotoolkit/performance/performance_summary.html). Measured step time =
# GBS x sequence / (tokens per second per GPU x GPUs). NeMo's recipes use the distributed
# optimizer (zero=1) and sequence parallelism with TP. A second table does the same for the
# Megatron-Bridge performance summary (NeMo containers 25.09, 25.11 and 26.02; DGX-H100 and
# DGX-B200, FP8 current scaling; github.com/NVIDIA-NeMo/Megatron-Bridge docs/performance-
# summary.md and performance-summary-archive.md): the plan as the table gives it (FSDP -> zero=3,
# else the distributed optimizer, zero=1). One BF16 row of NeMo AutoModel (PyTorch FSDP2, not
# Megatron) follows it. Prints the tables; asserts nothing.
set -euo pipefail
S=${STRATA:-build/strata}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo '{"name":"gpt3-5b","num_layers":24,"hidden_size":4096,"num_attention_heads":32,"vocab_size":50304,"seq_length":2048}' > "$tmp/gpt3-5b.json"
echo '{"name":"llama2-13b","num_layers":40,"hidden_size":5120,"num_attention_heads":40,"ffn_hidden_size":13824,"vocab_size":32000,"seq_length":4096,"activation":"swiglu","normalization":"rmsnorm","tie_embeddings":false}' > "$tmp/llama2-13b.json"
echo '{"name":"gpt3-20b","num_layers":44,"hidden_size":6144,"num_attention_heads":48,"vocab_size":50304,"seq_length":2048}' > "$tmp/gpt3-20b.json"
printf '%-12s %5s %-44s %9s %9s %7s %8s %5s\n' model gpus plan meas_s pred_s err% mem_GiB fits
row() {  # label model gpus gbs seq tokens_per_s_per_gpu plan [cluster]
  local meas prec=",precision=fp8"
  [[ "$7" == *precision=* ]] && prec=""  # FP8 unless the plan names its precision
  meas=$(python3 -c "print($4 * $5 / ($6 * $3))")
  "$S" estimate --model "$2" --cluster "${8:-dgx-h100-80g}" --plan "$7,gbs=$4$prec" --seq-length "$5" --json |
    python3 -c "
import json, sys
j = json.load(sys.stdin); m = $meas
print('%-12s %5d %-44s %9.2f %9.2f %+6.1f%% %8.1f %5s' % ('$1', $3, '$7', m, j['step_time_s'], 100 * (j['step_time_s'] / m - 1),
      j['memory_bytes']['peak'] / 2**30, 'yes' if j['fits'] else 'NO'))"
}
row gpt3-5b "$tmp/gpt3-5b.json" 64 2048 2048 23406 dp=64,mbs=4,zero=1
row gpt3-20b "$tmp/gpt3-20b.json" 64 256 2048 5851 tp=2,dp=32,mbs=2,sp=1,zero=1
row gpt3-175b gpt3-175b 128 256 2048 716 tp=4,pp=8,vp=6,dp=4,mbs=1,sp=1,zero=1
row gpt3-175b gpt3-175b 512 2048 2048 825 tp=4,pp=8,vp=6,dp=16,mbs=2,sp=1,zero=1
row llama2-7b llama2-7b 8 128 4096 16934 dp=8,mbs=1,zero=1
row llama2-13b "$tmp/llama2-13b.json" 16 128 4096 8715 pp=4,vp=10,dp=4,mbs=1,zero=1
row llama2-70b llama2-70b 64 128 4096 1728 tp=4,pp=4,vp=20,dp=4,mbs=1,sp=1,zero=1
row llama3-8b llama3-8b 8 128 8192 12273 cp=2,dp=4,mbs=1,zero=1
row llama3-70b llama3-70b 64 128 8192 1524 tp=4,pp=4,cp=2,vp=5,dp=2,mbs=1,sp=1,zero=1
echo
echo "Megatron-Bridge performance summary (FP8 current scaling)"
printf '%-12s %5s %-44s %9s %9s %7s %8s %5s\n' model gpus plan meas_s pred_s err% mem_GiB fits
row llama3-8b   llama3-8b      8  128 8192 14451 dp=8,mbs=1,zero=3
row llama3-70b  llama3-70b    64  128 8192  1602 tp=4,pp=8,vp=5,dp=2,mbs=1,sp=1,zero=1
row llama3-70b  llama3-70b    64  256 8192  1621 tp=4,pp=8,vp=5,dp=2,mbs=1,sp=1,zero=1
row llama3-405b llama3-405b 1024  512 8192   292 tp=8,pp=8,cp=2,vp=8,dp=8,mbs=1,sp=1,zero=1
row llama3-405b llama3-405b 1024 1536 8192   311 tp=8,pp=8,cp=2,vp=8,dp=8,mbs=1,sp=1,zero=1
echo "(NeMo AutoModel, PyTorch FSDP2 + TE, BF16, DGX-H100: docs/performance-summary.mdx of NVIDIA-NeMo/Automodel,"
echo " 2026-04: 18.90 s per step; recompute is not stated, and full is the only setting that fits)"
row llama3-70b  llama3-70b    64  128 8192 866.77 cp=2,dp=32,mbs=1,zero=3,recompute=full,precision=bf16
echo "(DGX-B200)"
row llama3-8b   llama3-8b      8  128 8192 30624 dp=8,mbs=2,zero=1 dgx-b200-180g
row llama3-405b llama3-405b  128   64 8192   661 tp=4,pp=8,cp=2,vp=8,dp=2,mbs=1,sp=1,zero=1 dgx-b200-180g
