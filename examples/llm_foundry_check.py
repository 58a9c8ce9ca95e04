#!/usr/bin/env python3
"""A check against runs of another framework that strata was never fitted to: MosaicML
llm-foundry's MPT training benchmarks (github.com/mosaicml/llm-foundry,
scripts/train/benchmarking/README.md: PyTorch FSDP FULL_SHARD, Triton/Flash attention,
H100 80GB in BF16 and FP8, A100 80GB and 40GB in BF16, 125M-70B models at 512-65536
tokens, 8-512 GPUs). The MPT models are GPT-style (learned positions, LayerNorm, GELU, tied
embeddings, vocabulary 50368; d_model / heads / layers from scripts/train/yamls/pretrain).
Each row is given as the harness of ../shared/calibration would give it: zero=3 for
FULL_SHARD and 2 for SHARD_GRAD_OP, dp = the GPUs, full recompute where the table says
activation checkpointing, no other settings.
Measured step time = global batch (tokens) / throughput (tokens per second).

Usage: examples/llm_foundry_check.py [path to strata]   (default build/strata)
Prints one table per GPU and precision and a summary; asserts nothing.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

STRATA = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("STRATA", "build/strata")

# d_model, heads, layers
ARCH = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
        "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
        "70b": (8192, 64, 80)}

# Rows: model, sequence, GPUs, micro-batch, gradient accumulation, global batch (sequences),
# throughput (tokens/s over all GPUs), activation checkpointing (T/F), ZeRO stage of the
# FSDP sharding strategy (FULL_SHARD 3, SHARD_GRAD_OP 2). Every row of the five tables of
# the file as of commit 495218376 (its last change), in their order.
H100_BF16_LARGE = """
70b 2048 512 8 1 4096 515636 T 3
70b 2048 256 8 1 2048 265149 T 3
70b 2048 128 8 1 1024 135490 T 3
30b 2048 512 8 1 4096 1083366 T 3
30b 2048 256 8 1 2048 550022 T 3
30b 2048 128 8 1 1024 281491 T 3
13b 2048 512 16 1 8192 2535811 T 3
13b 2048 256 16 1 4096 1277214 T 3
13b 2048 128 16 1 2048 650264 T 3
7b 2048 512 6 1 3072 4951479 F 3
7b 2048 256 6 1 1536 2590548 F 3
7b 2048 128 6 1 768 1340830 F 3
3b 2048 512 8 1 4096 11092218 F 2
3b 2048 256 8 1 2048 5829686 F 2
3b 2048 128 8 1 1024 2998098 F 2
1b 2048 512 12 1 6144 20396905 F 2
1b 2048 256 12 1 3072 10894207 F 2
1b 2048 128 12 1 1536 5647854 F 2
"""
H100_BF16 = """
70b 2048 64 8 4 2048 66523 T 3
70b 2048 32 2 16 1024 28242 T 3
30b 8192 8 1 21 168 11072 T 3
30b 4096 8 1 21 168 14419 T 3
30b 2048 32 14 3 1344 73860 T 3
30b 2048 16 10 3 480 36209 T 3
30b 2048 8 3 21 504 16022 T 3
30b 1024 8 6 21 1008 16672 T 3
13b 32768 8 1 3 24 15812 T 3
13b 16384 8 3 3 72 23881 T 3
13b 4096 8 10 3 240 37740 T 3
13b 2048 64 2 1 128 307209 F 3
13b 2048 32 2 1 64 153960 F 3
13b 2048 16 2 1 32 76280 F 3
13b 2048 8 2 1 16 38336 F 3
13b 1024 8 40 3 960 44019 T 3
7b 65536 8 1 2 16 15654 T 3
7b 32768 8 2 2 32 26550 T 3
7b 8192 8 8 2 128 55481 T 3
7b 4096 8 16 2 256 68893 T 3
7b 2048 8 6 1 48 85144 F 3
7b 1024 8 64 2 1024 81628 T 3
3b 65536 8 1 2 16 26099 T 3
3b 32768 8 3 6 144 46984 T 3
3b 16384 8 1 6 48 89223 F 3
3b 8192 8 3 6 144 132626 F 3
3b 4096 8 5 6 240 167712 F 3
3b 2048 64 6 3 1152 1441663 F 3
3b 2048 32 6 3 576 736701 F 3
3b 2048 16 10 3 480 386285 F 3
3b 1024 8 20 6 960 216369 F 3
3b 512 8 40 6 1920 223721 F 3
1b 65536 8 1 2 16 44050 T 3
1b 32768 8 1 4 32 96203 F 3
1b 16384 8 2 4 64 157194 F 3
1b 8192 8 3 4 96 233256 F 3
1b 4096 8 7 4 224 308282 F 3
1b 2048 64 20 1 1280 2841754 F 3
1b 2048 32 20 1 640 1444183 F 3
1b 2048 16 20 1 320 736596 F 3
1b 2048 8 14 1 112 363645 F 3
1b 1024 8 18 4 576 391287 F 3
1b 512 8 56 4 1792 418201 F 3
760m 32768 8 1 2 16 130333 F 3
760m 16384 8 3 2 48 222521 F 3
760m 8192 8 6 2 96 334602 F 3
760m 4096 8 12 2 192 443674 F 3
760m 2048 32 24 1 768 2175091 F 3
760m 2048 16 24 1 384 1096819 F 3
760m 2048 8 24 2 384 505177 F 3
760m 1024 8 48 2 768 628648 F 3
760m 512 8 96 2 1536 669998 F 3
"""
H100_FP8 = """
3b 32768 8 3 6 144 46853 T 3
3b 8192 8 3 6 144 153174 F 3
3b 2048 8 10 6 480 244692 F 3
3b 512 8 40 6 1920 292217 F 3
1b 32768 8 1 4 32 100643 F 3
1b 8192 8 2 4 64 256087 F 3
1b 512 8 56 4 1792 562523 F 3
"""
A100_80GB = """
70b 2048 64 8 4 2048 26274 T 3
70b 2048 32 2 16 1024 11962 T 3
30b 8192 8 1 21 168 4594 T 3
30b 4096 8 1 21 168 6513 T 3
30b 2048 8 3 21 504 7330 T 3
30b 1024 8 6 21 1008 7571 T 3
30b 512 8 12 21 2016 7739 T 3
13b 32768 8 1 3 24 8134 T 3
13b 16384 8 3 3 72 11454 T 3
13b 8192 8 5 3 120 14362 T 3
13b 4096 8 10 3 240 16482 T 3
13b 2048 8 2 3 48 18097 F 3
13b 1024 8 40 3 960 18647 T 3
7b 65536 8 1 2 16 8108 T 3
7b 32768 8 2 2 32 13382 T 3
7b 16384 8 4 2 64 19629 T 3
7b 8192 8 8 2 128 25655 T 3
7b 4096 8 16 2 256 29472 T 3
7b 2048 8 6 2 96 37130 F 3
7b 1024 8 64 2 1024 34857 T 3
3b 65536 8 1 2 16 14137 T 3
3b 32768 8 3 6 144 24235 T 3
3b 16384 8 1 6 48 44233 F 3
3b 8192 8 3 6 144 61567 F 3
3b 4096 8 5 6 240 75658 F 3
3b 2048 8 10 2 160 86491 F 3
3b 1024 8 20 6 960 92643 F 3
3b 512 8 40 6 1920 97019 F 3
1b 65536 8 1 2 16 24353 T 3
1b 32768 8 1 4 32 50207 F 3
1b 16384 8 2 4 64 79650 F 3
1b 8192 8 3 4 96 110516 F 3
1b 4096 8 7 4 224 142457 F 3
1b 2048 8 14 4 448 164109 F 3
1b 1024 8 18 4 576 176898 F 3
1b 512 8 56 4 1792 185186 F 3
760m 65536 8 1 2 16 33150 T 3
760m 32768 8 1 2 16 70417 F 3
760m 16384 8 3 2 48 114198 F 3
760m 8192 8 6 2 96 167471 F 3
760m 4096 8 12 2 192 218808 F 3
760m 2048 8 24 2 384 259472 F 3
760m 1024 8 48 2 768 238122 F 3
760m 512 8 96 2 1536 235571 F 3
350m 65536 8 1 2 16 60195 F 3
350m 32768 8 2 2 32 109222 F 3
350m 16384 8 4 2 64 188478 F 3
350m 8192 8 8 2 128 292559 F 3
350m 4096 8 16 2 256 396442 F 3
350m 2048 8 32 2 512 470263 F 3
350m 1024 8 64 2 1024 518504 F 3
350m 512 8 128 2 2048 554643 F 3
125m 65536 8 1 2 16 162946 F 3
125m 32768 8 2 2 32 291256 F 3
125m 16384 8 4 2 64 480322 F 3
125m 8192 8 8 2 128 723142 F 3
125m 4096 8 16 2 256 947172 F 3
125m 2048 8 40 2 640 1142641 F 3
125m 2048 8 32 2 512 1133901 F 3
125m 1024 8 64 2 1024 1251751 F 3
125m 512 8 128 2 2048 1325455 F 3
"""
A100_40GB = """
70b 2048 128 4 1 512 48194 T 3
70b 2048 64 2 1 128 17672 T 3
30b 2048 128 6 1 768 110803 T 3
30b 2048 32 4 1 128 27431 T 3
13b 8192 8 1 16 128 11258 T 3
13b 4096 8 2 16 256 12830 T 3
13b 2048 128 16 1 2048 252444 T 3
13b 2048 64 16 1 1024 126479 T 3
13b 2048 32 14 1 448 63946 T 3
13b 2048 16 10 1 160 31900 T 3
13b 2048 8 4 16 512 13347 T 3
13b 1024 8 8 16 1024 13817 T 3
13b 512 8 16 16 2048 14108 T 3
7b 16384 8 1 4 32 17998 T 3
7b 8192 8 3 4 96 23098 T 3
7b 4096 8 6 4 192 26930 T 3
7b 2048 128 18 1 2304 463749 T 3
7b 2048 64 18 1 1152 234614 T 3
7b 2048 32 18 1 576 119202 T 3
7b 2048 16 16 1 256 58322 T 3
7b 2048 8 12 4 384 29436 T 3
7b 1024 8 24 4 768 30833 T 3
7b 512 8 48 4 1536 31167 T 3
3b 32768 8 1 4 32 23640 T 3
3b 16384 8 2 8 128 35726 T 3
3b 8192 8 1 8 64 57193 F 3
3b 4096 8 2 8 128 70223 F 3
3b 2048 128 6 1 768 1220885 F 3
3b 2048 64 6 1 384 623167 F 3
3b 2048 32 6 1 192 317261 F 3
3b 2048 16 5 1 80 156013 F 3
3b 2048 8 5 8 320 80520 F 3
3b 1024 8 10 8 640 85854 F 3
3b 512 8 20 8 1280 90596 F 3
1b 32768 8 1 4 32 40762 T 3
1b 16384 8 1 8 64 77723 F 3
1b 8192 8 2 8 128 107799 F 3
1b 4096 8 4 8 256 134851 F 3
1b 2048 128 10 1 1280 2386897 F 3
1b 2048 64 10 1 640 1216104 F 3
1b 2048 32 10 1 320 497782 F 3
1b 2048 16 8 1 128 305372 F 3
1b 2048 8 8 8 512 154171 F 3
1b 1024 8 16 8 1024 167677 F 3
1b 512 8 32 8 2048 174256 F 3
760m 32768 8 1 4 32 57464 T 3
760m 16384 8 1 4 32 111316 F 3
760m 8192 8 3 4 96 160853 F 3
760m 4096 8 6 4 192 206909 F 3
760m 2048 128 12 1 1536 3704382 F 3
760m 2048 64 12 1 768 1878030 F 3
760m 2048 32 12 1 384 948745 F 3
760m 2048 16 12 1 192 473723 F 3
760m 2048 8 12 4 384 241389 F 3
760m 1024 8 24 4 768 267376 F 3
760m 512 8 48 4 1536 279504 F 3
350m 32768 8 1 4 32 107329 F 3
350m 16384 8 2 4 64 183175 F 3
350m 8192 8 4 4 128 279466 F 3
350m 4096 8 8 4 256 374670 F 3
350m 2048 128 18 1 2304 6647647 F 3
350m 2048 64 18 1 1152 3372118 F 3
350m 2048 32 18 1 576 1721978 F 3
350m 2048 16 18 1 288 886622 F 3
350m 2048 8 16 4 512 447963 F 3
350m 1024 8 32 4 1024 500184 F 3
350m 512 8 64 4 2048 530277 F 3
125m 32768 8 1 4 32 261208 F 3
125m 16384 8 2 3 48 443876 F 3
125m 8192 8 5 3 120 694868 F 3
125m 4096 8 13 3 312 921297 F 3
125m 2048 128 26 1 3328 15863837 F 3
125m 2048 64 26 1 1664 8015010 F 3
125m 2048 32 26 1 832 4067922 F 3
125m 2048 16 26 1 416 2088560 F 3
125m 2048 8 26 3 624 1090678 F 3
125m 1024 8 52 3 1248 1186314 F 3
125m 512 8 104 3 2496 1253886 F 3
"""

TABLES = [("H100 80GB, BF16", "dgx-h100-80g", "bf16", H100_BF16),
          ("H100 80GB, BF16, 128-512 GPUs", "dgx-h100-80g", "bf16", H100_BF16_LARGE),
          ("H100 80GB, FP8", "dgx-h100-80g", "fp8", H100_FP8),
          ("A100 80GB, BF16", "dgx-a100-80g", "bf16", A100_80GB),
          ("A100 40GB, BF16", "dgx-a100-40g", "bf16", A100_40GB)]


def estimate(tmp, size, seq, gpus, mbs, gbs, checkpointing, zero, precision, cluster):
    h, a, layers = ARCH[size]
    model = {"num_layers": layers, "hidden_size": h, "num_attention_heads": a, "ffn_hidden_size": 4 * h,
             "vocab_size": 50368, "seq_length": seq, "activation": "gelu", "normalization": "layernorm",
             "tie_embeddings": True}
    plan = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": gpus, "micro_batch_size": mbs,
            "global_batch_size": gbs, "zero_stage": zero, "recompute": "full" if checkpointing else "none",
            "precision": precision}
    mp, pp = os.path.join(tmp, "model.json"), os.path.join(tmp, "plan.json")
    with open(mp, "w") as f:
        json.dump(model, f)
    with open(pp, "w") as f:
        json.dump(plan, f)
    out = subprocess.run([STRATA, "estimate", "--model", mp, "--cluster", cluster, "--plan", pp, "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main():
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for title, cluster, precision, text in TABLES:
            print(f"\n{title} ({cluster})")
            print("%-5s %6s %5s %5s %3s %4s %9s %9s %7s %8s %5s" %
                  ("model", "seq", "gpus", "mbs", "ac", "zero", "meas_s", "pred_s", "err%", "mem_GiB", "fits"))
            errors, misfits = [], 0
            for line in text.split("\n"):
                if not line.strip():
                    continue
                size, seq, gpus, mbs, ga, gbs, tps, ac, zero = line.split()
                seq, gpus, mbs, gbs, tps, zero = int(seq), int(gpus), int(mbs), int(gbs), float(tps), int(zero)
                measured = gbs * seq / tps
                j = estimate(tmp, size, seq, gpus, mbs, gbs, ac == "T", zero, precision, cluster)
                err = 100 * (j["step_time_s"] / measured - 1)
                errors.append(err)
                misfits += not j["fits"]
                print("%-5s %6d %5d %5d %3s %4d %9.3f %9.3f %+6.1f%% %8.1f %5s" %
                      (size, seq, gpus, mbs, ac, zero, measured, j["step_time_s"], err, j["memory_bytes"]["peak"] / 2**30,
                       "yes" if j["fits"] else "NO"))
            summary.append((title, len(errors), statistics.median(abs(e) for e in errors), statistics.mean(errors),
                            max(abs(e) for e in errors), misfits))
    print("\n%-42s %5s %12s %12s %9s %s" % ("table", "rows", "median |err|", "mean signed", "max |err|",
                                            "predicted not to fit (all ran)"))
    for t, n, med, mean, mx, nf in summary:
        print("%-42s %5d %11.1f%% %+11.1f%% %8.1f%% %d" % (t, n, med, mean, mx, nf))


if __name__ == "__main__":
    main()
