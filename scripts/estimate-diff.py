#!/usr/bin/env python3
"""Differential check of two strata builds' estimates.

Draws random plans (tensor, pipeline, data and virtual-pipeline sizes, micro-batch counts
about the pipeline depth, ZeRO stages, recompute modes, sequence parallelism, GPipe,
Megatron-core micro-batch groups) over the model and cluster presets, runs
`strata estimate --json` of both binaries on each, and reports any plan where the exit
codes differ, an exit code is other than 0 or 2, the step times differ by more than
--rtol, or the memory terms or the fit differ. Use it before and after a change that
should not move the numbers (a faster walk, a refactor):

    scripts/estimate-diff.py OLD/strata NEW/strata [--seed S] [--plans N] [--rtol X]

Exit status: 0 when every plan agrees, 1 otherwise.
"""
import argparse
import json
import random
import subprocess
import sys

MODELS = ["gpt3-175b", "llama3-70b", "llama3-8b", "llama3-405b", "tiny-gpt", "gpt2-124m", "llama2-7b"]
CLUSTERS = ["dgx-a100-80g", "dgx-h100-80g", "dgx-h200-141g", "dgx-a100-40g", "dgx2-v100-32g", "dgx-b200-180g"]


def random_plan(rng):
    tp = rng.choice([1, 2, 4, 8])
    pp = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
    dp = rng.choice([1, 2, 3, 4, 8, 16])
    vp = rng.choice([1, 1, 2, 3, 4])
    mbs = rng.choice([1, 2, 4])
    mbs_per_step = rng.choice([pp, pp + 1, 2 * pp - 1, 2 * pp + 1, 3 * pp + 2, 37, 95, 4 * pp, 64, 190])
    parts = [f"tp={tp}", f"pp={pp}", f"dp={dp}", f"mbs={mbs}", f"gbs={mbs_per_step * mbs * dp}"]
    if vp > 1:
        parts.append(f"vp={vp}")
    if rng.random() < 0.3:
        parts.append(f"zero={rng.choice([1, 2, 3])}")
    recompute = rng.choice(["none", "full", "selective"])
    parts.append(f"recompute={recompute}")
    if recompute == "full" and rng.random() < 0.3:
        parts.append(f"recompute_num_layers={rng.choice([1, 2, 3])}")
    if tp > 1 and rng.random() < 0.5:
        parts.append("sp=1")
    if rng.random() < 0.15:
        parts.append("schedule=gpipe")
    if vp > 1 and rng.random() < 0.3:
        parts.append(f"microbatch_group_size_per_vp_stage={rng.randint(pp, max(pp, mbs_per_step))}")
    return ",".join(parts)


def run(binary, model, cluster, plan):
    try:
        p = subprocess.run([binary, "estimate", "--model", model, "--cluster", cluster, "--plan", plan, "--json"],
                           capture_output=True, text=True, timeout=120)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return None, "", "timeout"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plans", type=int, default=400)
    ap.add_argument("--rtol", type=float, default=1e-9)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    agree = refused = bad = 0
    for _ in range(a.plans):
        model, cluster, plan = rng.choice(MODELS), rng.choice(CLUSTERS), random_plan(rng)
        (r0, o0, e0), (r1, o1, e1) = run(a.old, model, cluster, plan), run(a.new, model, cluster, plan)
        what = f"{model} {cluster} {plan}"
        if r1 not in (0, 2) or r0 != r1:
            print(f"exit {r0} -> {r1}: {what}\n  {e0.strip()[:200]}\n  {e1.strip()[:200]}")
            bad += 1
            continue
        if r1 == 2:
            refused += 1
            continue
        j0, j1 = json.loads(o0), json.loads(o1)
        t0, t1 = j0.get("step_time_s"), j1.get("step_time_s")
        same_time = (t0 is None and t1 is None) or (t0 is not None and t1 is not None and abs(t0 - t1) <= a.rtol * abs(t0))
        if not same_time or j0.get("memory_bytes") != j1.get("memory_bytes") or j0.get("fits") != j1.get("fits"):
            fit = f", fits {j0.get('fits')} -> {j1.get('fits')}" if j0.get("fits") != j1.get("fits") else ""
            print(f"differs: {what}: step {t0} -> {t1}, peak {j0.get('memory_bytes', {}).get('peak')} -> "
                  f"{j1.get('memory_bytes', {}).get('peak')}{fit}")
            bad += 1
        else:
            agree += 1
    print(f"seed {a.seed}: {a.plans} plans: {agree} agree, {refused} refused (exit 2) by both, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
