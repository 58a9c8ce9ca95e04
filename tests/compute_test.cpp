// The op-by-op compute model: roofline of one GEMM, memory-bound ops, the op list of a
// layer (its GEMM FLOPs add up to the model's FLOP count), recompute and tensor-parallel
// communication per layer, and the optimizer's passes.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>

#include "costmodel/compute.h"
#include "costmodel/estimate.h"
#include "costmodel/memory.h"
#include "test_cluster.h"

namespace strata {
namespace {

TEST(Compute, EfficiencyCurveInterpolatesInLogSize) {
  const Curve c({{1e9, 0.4}, {1e11, 0.6}, {1e12, 0.7}});
  EXPECT_DOUBLE_EQ(c.at(1e8), 0.4);   // clamped below
  EXPECT_NEAR(c.at(1e10), 0.5, 1e-12);  // halfway in log10 between 1e9 and 1e11
  EXPECT_NEAR(c.at(std::sqrt(1e11 * 1e12)), 0.65, 1e-12);
  EXPECT_DOUBLE_EQ(c.at(1e13), 0.7);  // clamped above
  EXPECT_DOUBLE_EQ(Curve().at(5.0), 1.0);
}

// Curve::at keeps the values it computed in a per-thread cache. Two curves with other
// points asked at the same x, a curve made again in the storage of one destroyed (the same
// address), copies, and more sizes than the cache holds all get the interpolated value:
// y = 0.4 + 0.1 * log10(x / 1e9) on [1e9, 1e11] for the first curve, 0.2 + 0.3 * log10(x /
// 1e9) for the second.
TEST(Compute, EfficiencyCurveCacheNeverReturnsAnotherCurvesValue) {
  const auto first = [](double x) { return 0.4 + 0.1 * std::log10(x / 1e9); };
  const auto second = [](double x) { return 0.2 + 0.3 * std::log10(x / 1e9); };
  const Curve a({{1e9, 0.4}, {1e11, 0.6}});
  const Curve b({{1e9, 0.2}, {1e11, 0.8}});
  const Curve a_copy = a;
  for (int round = 0; round < 2; ++round)  // the second round reads what the first kept
    for (int i = 1; i < 2000; ++i) {       // 2,000 sizes: far more than the cache's 256 entries
      const double x = 1e9 * std::pow(100.0, i / 2000.0);
      ASSERT_NEAR(a.at(x), first(x), 1e-12) << x;
      ASSERT_NEAR(b.at(x), second(x), 1e-12) << x;
      ASSERT_NEAR(a_copy.at(x), first(x), 1e-12) << x;
    }
  alignas(Curve) unsigned char storage[sizeof(Curve)];
  const double x = 3e10;
  Curve* c = new (storage) Curve({{1e9, 0.4}, {1e11, 0.6}});
  ASSERT_NEAR(c->at(x), first(x), 1e-12);
  c->~Curve();
  c = new (storage) Curve({{1e9, 0.2}, {1e11, 0.8}});  // same address, other points
  EXPECT_NEAR(c->at(x), second(x), 1e-12);
  c->~Curve();
}

TEST(Compute, GemmRoofline) {
  const Cluster c = testing::round_cluster();
  // 4096^3: 2*4096^3 = 1.374e11 FLOPs at 50 % of 100 TFLOP/s = 2.749 ms; it moves
  // 2*3*4096^2 = 100.7 MB, 0.1 ms at 1 TB/s: compute-bound.
  const double n = 4096;
  EXPECT_NEAR(gemm_time(c.device, 100e12, n, n, n, 2), 2 * n * n * n / 50e12, 1e-12);
  // A matrix-vector product (M = 1) is memory-bound: 2*(8192 + 8192^2 + 8192) bytes.
  const double k = 8192;
  EXPECT_NEAR(gemm_time(c.device, 100e12, 1, k, k, 2), 2 * (k + k * k + k) / 1e12, 1e-12);
  EXPECT_NEAR(memory_time(c.device, 5e8), 5e-4, 1e-15);
}

struct Sums {
  double gemm_flops[3] = {0, 0, 0};
  std::map<std::string, int> comm_count;
  double comm_bytes = 0;
};

Sums sum_ops(const std::vector<OpCost>& ops) {
  Sums s;
  for (const auto& o : ops) {
    if (o.kind == OpKind::gemm) s.gemm_flops[static_cast<int>(o.phase)] += o.flops;
    if (o.kind == OpKind::tp_comm) {
      s.comm_count[std::string(to_string(o.phase)) + ":" + o.name] += 1;
      s.comm_bytes = o.bytes;
    }
  }
  return s;
}

TEST(Compute, LayerGemmFlopsAddUpToTheModelCount) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("gpt3-175b");
  for (const char* plan : {"tp=8,mbs=2,recompute=full", "tp=4,mbs=1,recompute=selective,sp=1", "tp=1,mbs=1"}) {
    const Plan p = load_plan(plan);
    std::vector<OpCost> ops;
    layer_cost(m, c, p, compute_setup(m, c, p), &ops);
    const Sums s = sum_ops(ops);
    const double fwd = m.layer_forward_flops(p.mbs) / static_cast<double>(p.t);
    EXPECT_NEAR(s.gemm_flops[0] / fwd, 1.0, 1e-12) << plan;
    EXPECT_NEAR(s.gemm_flops[1] / (2 * fwd), 1.0, 1e-12) << plan;  // dgrad + wgrad
    double rec = 0;
    if (p.recompute == Recompute::full) rec = fwd;
    if (p.recompute == Recompute::selective)  // QK^T and AV: 4 B S^2 H / t
      rec = 4.0 * p.mbs * m.S * static_cast<double>(m.S) * m.H / p.t;
    EXPECT_NEAR(s.gemm_flops[2], rec, 1e-6 * fwd) << plan;
  }
}

TEST(Compute, TensorParallelCollectivesPerLayer) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("gpt3-175b");
  // Without sequence parallelism: an all-reduce after attention and after the MLP in
  // forward (f), and one before each column-parallel layer in backward (g), each of
  // B*S*H*2 bytes = 50,331,648 for B = 1.
  {
    const Plan p = load_plan("tp=8,mbs=1,precision=fp16");
    std::vector<OpCost> ops;
    layer_cost(m, c, p, compute_setup(m, c, p), &ops);
    const Sums s = sum_ops(ops);
    EXPECT_EQ(s.comm_count.at("forward:tp_all_reduce"), 2);
    EXPECT_EQ(s.comm_count.at("backward:tp_all_reduce"), 2);
    EXPECT_EQ(s.comm_count.size(), 2u);
    EXPECT_DOUBLE_EQ(s.comm_bytes, 2048.0 * 12288 * 2);
  }
  // With sequence parallelism: all-gather before and reduce-scatter after each block in
  // forward; in backward the conjugates plus the re-gather of each column-parallel input.
  {
    const Plan p = load_plan("tp=8,mbs=1,sp=1,precision=fp16");
    std::vector<OpCost> ops;
    layer_cost(m, c, p, compute_setup(m, c, p), &ops);
    const Sums s = sum_ops(ops);
    EXPECT_EQ(s.comm_count.at("forward:sp_all_gather"), 2);
    EXPECT_EQ(s.comm_count.at("forward:sp_reduce_scatter"), 2);
    EXPECT_EQ(s.comm_count.at("backward:sp_all_gather"), 4);
    EXPECT_EQ(s.comm_count.at("backward:sp_reduce_scatter"), 2);
  }
}

// Transformer Engine's user buffers (tp_comm_overlap set on, sequence parallelism, the
// modern stack). GPT-3 175B, tp 8, one sequence of 2048 on the round cluster (GEMMs at
// 50 TFLOP/s in bf16, 100 in fp8, no launch cost, nothing lost to overlap):
// - in fp8 every all-gather of a block moves the fp8 copy: 2048 x 12288 x 1 = 25,165,824
//   bytes (against 50,331,648 in 16 bits without user buffers);
// - the QKV and fc1 inputs' ring exchanges hide behind 7/8 of their GEMMs (QKV in fp8
//   2 x 2048 x 4608 x 12288 / 1e14 = 2.319 ms, against an all-gather of about 0.15 ms):
//   nothing exposed; in fp8 the reduce-scatters after the output projection and fc2 are ring
//   exchanges too (the recipes' fp8 configs) and hide; in bf16 they run beside the 4 column
//   chunks of their GEMMs (Transformer Engine's pipeline), each collective shorter than its
//   GEMM, so the last chunk's, a quarter, shows;
// - backward: the output gradients' ring exchanges before the projection's and fc2's input
//   gradients, and the inputs' gathers behind the input-gradient GEMMs (as without user
//   buffers), hide; the reduce-scatters behind the weight gradients too;
// - a GEMM split into chunks of a flat efficiency curve costs what it did whole.
TEST(Compute, UserBuffersOverlapTheBlocksCollectives) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("gpt3-175b");
  auto tp_ops = [&](const char* plan, LayerCost* lc_out = nullptr) {
    const Plan p = load_plan(plan);
    std::vector<OpCost> ops;
    const LayerCost lc = layer_cost(m, c, p, compute_setup(m, c, p), &ops);
    if (lc_out) *lc_out = lc;
    return ops;
  };
  const double H = 12288, T = 2048;
  for (const char* prec : {"fp8", "bf16"}) {
    const bool fp8 = prec == std::string("fp8");
    LayerCost ub_lc, plain_lc;
    const std::string base = std::string("tp=8,mbs=1,sp=1,software_stack=modern,precision=") + prec;
    const auto ub = tp_ops((base + ",tp_comm_overlap=1").c_str(), &ub_lc);
    const auto plain = tp_ops((base + ",tp_comm_overlap=0").c_str(), &plain_lc);
    int gathers = 0, scatters = 0;
    double split_extra = 0;
    for (const OpCost& o : ub) {
      if (o.name == std::string("ub_split_gemm")) split_extra += o.time_s;
      if (o.kind != OpKind::tp_comm) continue;
      if (o.name == std::string("sp_all_gather")) {
        ++gathers;
        EXPECT_DOUBLE_EQ(o.bytes, (fp8 ? 1 : 2) * T * H) << prec;
        EXPECT_DOUBLE_EQ(o.exposed_s, 0.0) << to_string(o.phase) << prec;
      } else {
        ASSERT_EQ(o.name, std::string("sp_reduce_scatter"));
        ++scatters;
        EXPECT_DOUBLE_EQ(o.bytes, 2 * T * H);
        if (o.phase == Phase::forward && !fp8)
          EXPECT_NEAR(o.exposed_s, o.time_s / 4, 1e-15);
        else
          EXPECT_DOUBLE_EQ(o.exposed_s, 0.0) << prec;
      }
    }
    EXPECT_EQ(gathers, 2 + 4);
    EXPECT_EQ(scatters, 2 + 2);
    EXPECT_NEAR(split_extra, 0.0, 1e-15);
    // Without user buffers the forward's four collectives and the backward's two output
    // gradient gathers are exposed whole, the gathers at 16 bits.
    double plain_exposed = 0, rs = 0, ag16 = 0;
    for (const OpCost& o : plain)
      if (o.kind == OpKind::tp_comm) {
        plain_exposed += o.exposed_s;
        if (o.name == std::string("sp_reduce_scatter") && o.phase == Phase::forward) rs = o.time_s;
        if (o.name == std::string("sp_all_gather")) {
          EXPECT_DOUBLE_EQ(o.bytes, 2 * T * H);
          ag16 = o.time_s;
        }
      }
    EXPECT_NEAR(plain_exposed, 2 * rs + 4 * ag16, 1e-12);
    EXPECT_NEAR(ub_lc.forward.tp_comm_s, fp8 ? 0.0 : 2 * rs / 4, 1e-12) << prec;
    EXPECT_DOUBLE_EQ(ub_lc.backward.tp_comm_s, 0.0);
    EXPECT_NEAR(ub_lc.forward.compute_s, plain_lc.forward.compute_s, 1e-15);
  }
  // Auto takes them on the modern stack (fp8 selects it) where the tensor-parallel group
  // sits inside a node (8 devices a node here), as NVIDIA's recipes run them; a plan saying
  // off (a Megatron-LM launch without --tp-comm-overlap), sp off and the legacy stack take
  // none. Off or not, Transformer Engine overlaps its backward's collectives on the modern
  // stack (Stack::tp_comm_overlap).
  EXPECT_TRUE(compute_setup(m, c, load_plan("tp=8,sp=1,precision=fp8")).stack.userbuffers);
  EXPECT_FALSE(compute_setup(m, c, load_plan("tp=8,sp=1,precision=fp8,tp_comm_overlap=0")).stack.userbuffers);
  EXPECT_TRUE(compute_setup(m, c, load_plan("tp=8,sp=1,precision=fp8,tp_comm_overlap=0")).stack.tp_comm_overlap);
  EXPECT_FALSE(compute_setup(m, c, load_plan("tp=8,sp=1,precision=bf16")).stack.userbuffers);  // (legacy)
  {
    Cluster four = c;  // a group of 8 across two nodes of 4: no user buffers, asked or not
    four.devices_per_node = 4;
    EXPECT_FALSE(compute_setup(m, four, load_plan("tp=8,sp=1,precision=fp8")).stack.userbuffers);
    EXPECT_FALSE(compute_setup(m, four, load_plan("tp=8,sp=1,precision=fp8,tp_comm_overlap=1")).stack.userbuffers);
    EXPECT_TRUE(compute_setup(m, four, load_plan("tp=4,sp=1,precision=fp8,tp_comm_overlap=1")).stack.userbuffers);
  }
  // On a legacy stack tp_comm_overlap=1 is the weight-gradient overlap, with sequence
  // parallelism only (Megatron refuses --tp-comm-overlap without it).
  EXPECT_TRUE(compute_setup(m, c, load_plan("tp=8,sp=1,precision=bf16,tp_comm_overlap=1")).stack.tp_comm_overlap);
  EXPECT_FALSE(compute_setup(m, c, load_plan("tp=8,sp=0,precision=bf16,tp_comm_overlap=1")).stack.tp_comm_overlap);
  EXPECT_FALSE(compute_setup(m, c, load_plan("tp=8,sp=0,precision=fp8,tp_comm_overlap=1")).stack.userbuffers);
  EXPECT_FALSE(compute_setup(m, c, load_plan("tp=8,sp=1,precision=bf16,tp_comm_overlap=1")).stack.userbuffers);
  EXPECT_TRUE(compute_setup(m, c, load_plan("tp=8,sp=1,precision=bf16,tp_comm_overlap=1,software_stack=modern"))
                  .stack.userbuffers);
  EXPECT_FALSE(compute_setup(m, c, load_plan("tp=1,sp=1,precision=fp8,tp_comm_overlap=1")).stack.userbuffers);
}

// A GEMM split into t chunks runs each at the efficiency of its own size: on the H100
// preset's curve the QKV GEMM of Llama 3 405B at tp 8 (8192 x 6144 x 16384 in fp8) runs as
// 8 of 1024 rows, and the ring exchange hides behind 7/8 of those; the excess is booked as
// ub_split_gemm, in the forward (QKV, fc1; the projection's and fc2's 4 chunks) and the
// backward (the projection's and fc2's input gradients).
TEST(Compute, UserBufferChunksRunAtTheirOwnEfficiency) {
  const Cluster c = load_cluster("dgx-h100-80g");
  const ModelSpec m = load_model("llama3-405b");
  const Plan p = load_plan("tp=8,mbs=1,sp=1,precision=fp8,tp_comm_overlap=1");
  std::vector<OpCost> ops;
  layer_cost(m, c, p, compute_setup(m, c, p), &ops);
  // (fp8 GEMMs against the preset's measured fp8 speed, 1.62 x the bf16 peak)
  const double fp8 = c.device.gemm_peak(Precision::fp8), T = 8192, H = 16384, qkv = (16384.0 + 2 * 1024) / 8;
  ASSERT_DOUBLE_EQ(fp8, 1.62 * c.device.peak_bf16_flops);
  const double whole = gemm_time(c.device, fp8, T, qkv, H, 1), split = 8 * gemm_time(c.device, fp8, T / 8, qkv, H, 1);
  ASSERT_GT(split, whole * 1.05);
  std::vector<double> fwd_extra, bwd_extra;
  for (const OpCost& o : ops)
    if (o.name == std::string("ub_split_gemm")) (o.phase == Phase::forward ? fwd_extra : bwd_extra).push_back(o.time_s);
  ASSERT_EQ(fwd_extra.size(), 4u);
  ASSERT_EQ(bwd_extra.size(), 2u);
  EXPECT_NEAR(fwd_extra[0], split - whole, 1e-15);  // QKV, the first
  for (const OpCost& o : ops)
    if (o.name == std::string("sp_all_gather") && o.phase == Phase::forward) {
      EXPECT_NEAR(o.exposed_s, std::max(0.0, o.time_s - split * 7 / 8) + c.overlap_slowdown * std::min(o.time_s, split * 7 / 8),
                  1e-15);
      break;
    }
}

// ZeRO-2 keeps no whole gradient between micro-batches: each layer's fp32 gradient of every
// micro-batch (4 bytes x its parameters on this tensor-parallel rank) is reduce-scattered
// over the data-parallel group as its backward ends: exposed on the legacy stack, behind
// that backward where the stack overlaps the data-parallel reduction. tp 8 x dp 8: one
// member per node, so 3 steps of 10 us and 7/8 of the bytes at 12.5 GB/s x 80 %. ZeRO-1
// reduces once per step instead (estimate.cpp's data-parallel tail), ZeRO-3 adds gathers.
TEST(Compute, Zero2ReduceScattersEveryMicroBatch) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("gpt3-175b");
  auto reduce_scatters = [&](const char* plan) {
    const Plan p = load_plan(plan);
    std::vector<OpCost> ops;
    const LayerCost lc = layer_cost(m, c, p, compute_setup(m, c, p), &ops);
    std::vector<OpCost> rs;
    for (const OpCost& o : ops)
      if (o.kind == OpKind::dp_comm) rs.push_back(o);
    return std::pair{rs, lc.backward.compute_s + lc.recompute.compute_s};
  };
  const auto [rs2, bwd] = reduce_scatters("tp=8,dp=8,mbs=2,zero=2,software_stack=legacy");
  ASSERT_EQ(rs2.size(), 1u);
  EXPECT_EQ(rs2[0].name, "zero2_reduce_scatter");
  EXPECT_EQ(rs2[0].phase, Phase::backward);
  const double bytes = 4.0 * static_cast<double>(m.layer_params(8));
  EXPECT_DOUBLE_EQ(rs2[0].bytes, bytes);
  EXPECT_NEAR(rs2[0].time_s, 30e-6 + bytes * 0.875 / 10e9, 1e-12);
  EXPECT_DOUBLE_EQ(rs2[0].exposed_s, rs2[0].time_s);
  const auto [hidden, bwd2] = reduce_scatters("tp=8,dp=8,mbs=2,zero=2,software_stack=legacy,overlap_grad_reduce=1");
  ASSERT_EQ(hidden.size(), 1u);
  EXPECT_DOUBLE_EQ(bwd2, bwd);
  EXPECT_DOUBLE_EQ(hidden[0].time_s, rs2[0].time_s);
  EXPECT_NEAR(hidden[0].exposed_s, std::max(0.0, rs2[0].time_s - bwd), 1e-12);
  EXPECT_TRUE(reduce_scatters("tp=8,dp=8,mbs=2,zero=1").first.empty());
  EXPECT_EQ(reduce_scatters("tp=8,dp=8,mbs=2,zero=3,software_stack=legacy").first.size(), 3u);
  EXPECT_TRUE(reduce_scatters("tp=8,dp=1,mbs=2,zero=2").first.empty());  // no replicas
}

// Fewer key/value groups than tensor-parallel ranks: a multi-query model (G = 1) under tp 4
// holds on each rank the one key/value head whole, as a 4-group model holds its one group
// per rank, so each rank's parameters, GEMMs, traffic and activations are the 4-group
// model's; only the whole model is smaller.
TEST(Compute, ReplicatedKeyValueGroupsCostWhatOneGroupPerRankDoes) {
  const Cluster c = testing::round_cluster();
  ModelSpec mqa = load_model("gpt2-124m");
  mqa.H = 1024; mqa.A = 16; mqa.F = 4096; mqa.G = 1;
  ModelSpec gqa = mqa;
  gqa.G = 4;
  EXPECT_EQ(mqa.layer_params(4), gqa.layer_params(4));
  EXPECT_LT(mqa.total_params(), gqa.total_params());
  for (const char* plan : {"tp=4,mbs=2", "tp=4,cp=2,mbs=2,sp=1,recompute=selective", "tp=4,mbs=1,recompute=full"}) {
    const Plan p = load_plan(plan);
    const ComputeSetup cs = compute_setup(mqa, c, p);
    const LayerCost a = layer_cost(mqa, c, p, cs), b = layer_cost(gqa, c, p, cs);
    EXPECT_DOUBLE_EQ(a.forward.total(), b.forward.total()) << plan;
    EXPECT_DOUBLE_EQ(a.backward.total(), b.backward.total()) << plan;
    EXPECT_DOUBLE_EQ(a.forward.cp_comm_s + a.backward.cp_comm_s, b.forward.cp_comm_s + b.backward.cp_comm_s) << plan;
    EXPECT_DOUBLE_EQ(layer_activation_bytes(mqa, p, cs), layer_activation_bytes(gqa, p, cs)) << plan;
  }
  // One group per rank is less than two: tp 2 splits the 4 groups two to a rank.
  const Plan p2 = load_plan("tp=2,mbs=2");
  EXPECT_LT(layer_cost(mqa, c, p2, compute_setup(mqa, c, p2)).forward.total(),
            layer_cost(gqa, c, p2, compute_setup(gqa, c, p2)).forward.total());
}

// The strata executor computes and communicates in floats whatever the precision: its
// bf16 all-reduce moves B*S*H*4 bytes, and the memory model still counts 2 per stored value.
TEST(Compute, StrataStackMovesFloats) {
  Cluster c = testing::round_cluster();
  c.strata_stack = true;
  const ModelSpec m = load_model("gpt3-175b");
  const Plan p = load_plan("tp=8,mbs=1,precision=bf16");
  const ComputeSetup cs = compute_setup(m, c, p);
  EXPECT_EQ(cs.act_bytes, 2);
  EXPECT_EQ(cs.work_bytes, 4);
  EXPECT_DOUBLE_EQ(cs.weight_bytes, 2.0);
  EXPECT_DOUBLE_EQ(cs.weight_work_bytes, 4.0);
  std::vector<OpCost> ops;
  layer_cost(m, c, p, cs, &ops);
  EXPECT_DOUBLE_EQ(sum_ops(ops).comm_bytes, 2048.0 * 12288 * 4);
  c.strata_stack = false;
  EXPECT_EQ(compute_setup(m, c, p).work_bytes, 2);
}

// The unfused attention core's batched GEMMs: at the efficiency of one product where the
// backend runs them one by one (per_matrix, the CPU's), of the whole batch where one call
// runs it all, and on the strata executor's batched backend (CUDA) of what one of its
// calls runs: one micro-batch row's query groups, as many S x S fp32 matrices as its 64
// MiB workspace holds. gpt2-124m, micro-batch 8: 96 products of 1024 x 1024 x 64 (1.34e8
// FLOPs each, 1.29e10 together), 12 to a call (16 would fit; 12 groups), 1.61e9. The curve
// is flat at 0.1 up to 2e8, at 0.3 from 1e9 to 2e9, at 0.8 from 1e10; memory is free.
TEST(Compute, BatchedAttentionGemmsAtTheSizeOfWhatOneCallRuns) {
  Cluster c = testing::round_cluster();
  c.device.gemm_efficiency = Curve({{2e8, 0.1}, {1e9, 0.3}, {2e9, 0.3}, {1e10, 0.8}});
  c.device.memory_bandwidth_bytes_per_s = 1e18;
  const ModelSpec m = load_model("gpt2-124m");
  const Plan p = load_plan("tp=1,mbs=8,precision=bf16,attention=unfused");
  auto scores_s = [&](bool per_matrix, bool strata) {
    c.device.batched_gemm_per_matrix = per_matrix;
    c.strata_stack = strata;
    std::vector<OpCost> ops;
    layer_cost(m, c, p, compute_setup(m, c, p), &ops);
    double t = 0;
    for (const auto& o : ops)
      if (o.phase == Phase::forward && o.name == "attn_scores") t += o.time_s;
    return t;
  };
  EXPECT_NEAR(scores_s(false, true) / scores_s(true, true), 0.1 / 0.3, 1e-12);    // a call's 12 against one
  EXPECT_NEAR(scores_s(false, false) / scores_s(true, false), 0.1 / 0.8, 1e-12);  // all 96 against one
}

// The cross-entropy on the last stage's logits, bytes per logit element. Legacy (Megatron-LM's
// unfused vocab-parallel kernel): forward e + 36 (cast to fp32, max, subtract, exp, sum,
// normalise and keep), backward 20 + e (copy, subtract the one-hot and scale, cast back).
// Modern (fused, Megatron-core / Transformer Engine): forward reads the logits twice and
// writes the gradient in place (3e), backward scales it in place (2e). bf16, e = 2;
// gpt3-175b tp=8: T = 2048 tokens, V/t = 51200 / 8 = 6400 logits each.
TEST(Compute, CrossEntropyBytesPerStack) {
  Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("gpt3-175b");
  Plan p = load_plan("tp=8,mbs=1,precision=bf16");
  auto ce_bytes = [&](Phase ph) {
    std::vector<OpCost> ops;
    head_cost(m, c, p, compute_setup(m, c, p), &ops);
    double b = 0;
    for (const auto& o : ops)
      if (o.phase == ph && o.name == "cross_entropy") b += o.bytes;
    return b;
  };
  const double logits = 2048.0 * 6400;
  c.modern_stack = false;
  ASSERT_FALSE(compute_setup(m, c, p).stack.modern);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::forward), 38.0 * logits);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::backward), 22.0 * logits);
  c.modern_stack = true;
  ASSERT_TRUE(compute_setup(m, c, p).stack.modern);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::forward), 6.0 * logits);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::backward), 4.0 * logits);
  // The strata executor's kernels on its fp32 logits (executor/cuda/cross_entropy.cu, the
  // CPU backend's): max 4, the sum of exponentials 4 (the logits read, not written), or both
  // in one pass, 4, where the device has it (Device::cross_entropy_one_pass: the CUDA
  // backend); backward the gradient written over the logits 8, rounded to 16 bits in that
  // pass (StrataOutputLayerRounds16Bit), or, where the GEMMs read 16-bit operands, written in
  // 16 bits beside them: 4 + 2.
  c.modern_stack = false;
  c.strata_stack = true;
  c.device.gemm_reads_16bit = false;
  c.device.cross_entropy_one_pass = false;
  ASSERT_TRUE(compute_setup(m, c, p).stack.strata);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::forward), 8.0 * logits);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::backward), 8.0 * logits);
  c.device.gemm_reads_16bit = true;
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::forward), 8.0 * logits);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::backward), 6.0 * logits);
  c.device.cross_entropy_one_pass = true;
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::forward), 4.0 * logits);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::backward), 6.0 * logits);
  p = load_plan("tp=8,mbs=1,precision=fp32");
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::forward), 4.0 * logits);
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::backward), 8.0 * logits);
  c.device.cross_entropy_one_pass = false;
  EXPECT_DOUBLE_EQ(ce_bytes(Phase::forward), 8.0 * logits);
}

// A multi-token prediction module's work beside its transformer layer (head_cost with
// mtp_num_layers 1 against 0), by hand on the round cluster (memory 1 TB/s, GEMMs 50
// TFLOP/s in bf16, NVLink 150 GB/s and 5 us a round). A Llama-style model (modern stack:
// fused cross-entropy, fused weight-gradient accumulation) of H 4096, vocabulary 32000
// (16000 per rank), one sequence of 2048 on tp 2 with sequence parallelism: T 2048, Tn
// 1024, e 2; a T x H activation is 16,777,216 bytes; its all-gather or reduce-scatter over 2
// ranks 5 + 8,388,608 / 150e3 = 60.924053 us, of T x 2H 116.848107 us; an all-reduce of the
// loss's 4T bytes 10 + 8192 / 150e3 = 10.054613 us.
//   forward: embedding lookup 2eTH 33.554432 us, its reduce-scatter 60.924053, enorm and
//     hnorm 2eTnH 16.777216 each, the concatenation 4eTnH 33.554432, eh_proj's input
//     gathered (T x 2H) 116.848107, eh_proj 2 x 2048 x 2048 x 8192 FLOPs 1374.389535, its
//     output gathered 60.924053, the final norm 16.777216, the output layer's input gathered
//     60.924053, the logits 2 x 2048 x 16000 x 4096 FLOPs 5368.70912, the fused loss 6 bytes
//     a logit 196.608, its three all-reduces 30.163840: 7386.931273 us, 329.784107 of it
//     tensor-parallel collectives;
//   backward: the loss 4 bytes a logit 131.072, the output layer's two GEMMs 2 x 5368.70912,
//     its input gradient's reduce-scatter 60.924053, the final norm 3eTnH 25.165824, the
//     split's all-gather 60.924053, eh_proj's two GEMMs 2 x 1374.389535 (its input gathered
//     again behind the first: hidden), its input gradient's reduce-scatter (T x 2H)
//     116.848107, the concatenation 33.554432, the two norms 2 x 25.165824, the lookup's
//     gather 60.924053 and scatter-add (2 + 2 x 4) T H 83.88608: 14109.82756 us.
TEST(Compute, MultiTokenPredictionModule) {
  const Cluster c = testing::round_cluster();
  const ModelSpec with = testing::llama_with_mtp(1), without = testing::llama_with_mtp(0);
  const Plan p = load_plan("tp=2,sp=1,mbs=1,precision=bf16");
  const ComputeSetup cs = compute_setup(with, c, p);
  ASSERT_TRUE(cs.stack.modern && cs.stack.grad_accumulation_fusion);
  std::vector<OpCost> ops;
  const LayerCost a = head_cost(with, c, p, cs, &ops), b = head_cost(without, c, p, cs);
  EXPECT_NEAR((a.forward.total() - b.forward.total()) * 1e6, 7386.931273, 1e-5);
  EXPECT_NEAR((a.forward.tp_comm_s - b.forward.tp_comm_s) * 1e6, 329.784107, 1e-5);
  EXPECT_NEAR((a.backward.total() - b.backward.total()) * 1e6, 14109.82756, 1e-5);
  EXPECT_NEAR((a.backward.tp_comm_s - b.backward.tp_comm_s) * 1e6, 3 * 60.924053 + 116.848107, 1e-5);
  EXPECT_EQ(a.recompute.total(), 0.0);
  int eh_proj = 0;
  for (const auto& o : ops)
    if (o.name == "mtp_eh_proj" && o.kind == OpKind::gemm) {
      EXPECT_NEAR(o.time_s * 1e6, 1374.389535, 1e-5);
      ++eh_proj;
    }
  EXPECT_EQ(eh_proj, 3);  // forward, input gradient, weight gradient
  // With every layer recomputed the module's checkpointed part runs again (Megatron-core's
  // _checkpointed_forward: the norms to the final norm, the lookup outside it): 2 x
  // 16.777216 + 33.554432 + 116.848107 + 1374.389535 + 60.924053 + 16.777216 = 1636.047775
  // us; under the block method (recompute_num_layers) nothing.
  const Plan full = load_plan("tp=2,sp=1,mbs=1,precision=bf16,recompute=full");
  EXPECT_NEAR((head_cost(with, c, full, cs).recompute.total() - head_cost(without, c, full, cs).recompute.total()) * 1e6,
              1636.047775, 1e-5);
  const Plan block = load_plan("tp=2,sp=1,mbs=1,precision=bf16,recompute=full,recompute_num_layers=1");
  EXPECT_EQ(head_cost(with, c, block, cs).recompute.total(), 0.0);
}

// One layer's ops under plan p, the output layer's, and a field of the ops of one name and phase summed.
std::vector<OpCost> layer_ops(const ModelSpec& m, const Cluster& c, const Plan& p) {
  std::vector<OpCost> ops;
  layer_cost(m, c, p, compute_setup(m, c, p), &ops);
  return ops;
}
std::vector<OpCost> head_ops(const ModelSpec& m, const Cluster& c, const Plan& p) {
  std::vector<OpCost> ops;
  head_cost(m, c, p, compute_setup(m, c, p), &ops);
  return ops;
}
double sum_of(const std::vector<OpCost>& ops, const std::string& name, Phase ph, double OpCost::*field) {
  double x = 0;
  for (const auto& o : ops)
    if (o.phase == ph && o.name == name) x += o.*field;
  return x;
}

// The strata executor's passes over a layer's 16-bit tensors (it holds them as floats), on
// the CPU backend (Device::gemm_reads_16bit false: its GEMMs run on floats).
// tiny-gpt (H 256, 4 heads, F 1024, S 128, biases, learned positions), tp 1, micro-batch 2:
// n = N = 256 tokens, qkv width Q = 768, attention output 256, fc1 and activation 1024 each.
//   forward's 16-bit tensors: x, h1, x2, h2 (4 x 256 x 256) + 256 x (768 + 256 + 1024 + 1024)
//     = 1,048,576; of them rounded in passes of their own: x and the attention output,
//     2 x 256 x 256 = 131,072 (the norms, the residual add, the bias adds ending qkv and
//     fc1 and the activation round theirs as they write them)
//   backward rounds dy, dO (2 x 256) + datt 256 + dqkv 768, x 256 tokens = 393,216 in passes
//     (du in the activation's backward)
//   kept: the forward's 1,048,576 + the unfused core's probabilities 2 x 4 x 128^2 = 1,179,648
// Bytes: a rounding pass 8 per value (read and write 4), pack and unpack 6 (4 + 2).
// Full recompute keeps x only (65,536 values) and rounds its replayed forward again.
// Without biases (Llama's layout) and with RoPE, qkv (N Q) and the fc1 output (N F1) take
// passes too: tiny-llama (H 256, 8 heads of 32 in 2 groups: Q = 384, SwiGLU F 704: F1
// 1408), micro-batch 2: x and the attention output 2 x 256 x 256 + 256 x (384 + 1408) =
// 589,824 forward values; backward dy, dO, datt 3 x 256 x 256 + dqkv 256 x 384 = 294,912.
TEST(Compute, StrataSixteenBitPasses) {
  Cluster c = testing::round_cluster();
  c.strata_stack = true;
  c.device.gemm_reads_16bit = false;
  const ModelSpec m = load_model("tiny-gpt");
  auto bytes = [&](const std::string& plan, const std::string& name, Phase ph) {
    return sum_of(layer_ops(m, c, load_plan(plan)), name, ph, &OpCost::bytes);
  };
  const std::string bf16 = "tp=1,mbs=2,precision=bf16";
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::forward), 8.0 * 131072);
  EXPECT_DOUBLE_EQ(bytes(bf16, "pack16", Phase::forward), 6.0 * 1179648);
  EXPECT_DOUBLE_EQ(bytes(bf16, "unpack16", Phase::backward), 6.0 * 1179648);
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::backward), 8.0 * 393216);
  const std::string full = "tp=1,mbs=2,precision=fp16,recompute=full";
  EXPECT_DOUBLE_EQ(bytes(full, "pack16", Phase::forward), 6.0 * 65536);
  EXPECT_DOUBLE_EQ(bytes(full, "unpack16", Phase::backward), 6.0 * 65536);
  EXPECT_DOUBLE_EQ(bytes(full, "round16", Phase::recompute), 8.0 * 131072);
  EXPECT_DOUBLE_EQ(bytes(full, "pack16", Phase::recompute), 0.0);
  const ModelSpec llama = load_model("tiny-llama");
  EXPECT_DOUBLE_EQ(sum_of(layer_ops(llama, c, load_plan(bf16)), "round16", Phase::forward, &OpCost::bytes), 8.0 * 589824);
  EXPECT_DOUBLE_EQ(sum_of(layer_ops(llama, c, load_plan(bf16)), "round16", Phase::backward, &OpCost::bytes), 8.0 * 294912);
  // fp32, or another stack: no such passes.
  EXPECT_DOUBLE_EQ(bytes("tp=1,mbs=2,precision=fp32", "round16", Phase::forward), 0.0);
  c.strata_stack = false;
  EXPECT_DOUBLE_EQ(bytes(bf16, "pack16", Phase::forward), 0.0);
}

// Squared ReLU is ungated like GELU and elementwise: on every stack and recompute mode each op
// of its layer costs as GELU's does (the same fc1 of F columns, the same bytes through the
// activation: tiny-gpt's bf16 forward 2,097,152, StrataSixteenBitOperandsAsStored below), under
// its own name.
TEST(Compute, SquaredReluCostsAsGelu) {
  const ModelSpec g = load_model("tiny-gpt");
  ModelSpec r = g;
  r.activation = Activation::squared_relu;
  for (bool strata : {false, true}) {
    Cluster c = testing::round_cluster();
    c.strata_stack = strata;
    for (const char* plan : {"tp=1,mbs=2,precision=bf16", "tp=2,sp=1,mbs=2,precision=bf16,recompute=full",
                             "tp=2,mbs=1,precision=fp32,recompute=selective"}) {
      const auto a = layer_ops(g, c, load_plan(plan)), b = layer_ops(r, c, load_plan(plan));
      ASSERT_EQ(a.size(), b.size()) << plan;
      int renamed = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].name == "gelu" ? "squared_relu" : a[i].name, b[i].name) << plan;
        renamed += a[i].name == "gelu" ? 1 : 0;
        EXPECT_EQ(a[i].phase, b[i].phase);
        EXPECT_EQ(a[i].flops, b[i].flops) << a[i].name;
        EXPECT_EQ(a[i].bytes, b[i].bytes) << a[i].name;
        EXPECT_EQ(a[i].time_s, b[i].time_s) << a[i].name;
      }
      EXPECT_GE(renamed, 2) << plan;  // forward and backward
    }
    if (strata) {
      EXPECT_DOUBLE_EQ(sum_of(layer_ops(r, c, load_plan("tp=1,mbs=2,precision=bf16")), "squared_relu", Phase::forward,
                              &OpCost::bytes),
                       2097152.0);
    }
  }
}

// The same where the GEMMs read 16-bit operands as stored (a GPU: the CUDA backend). Every
// GEMM input is stored in 16 bits once where it is made and read so: written so by the op
// that makes it (the norms, the activation, the activation's backward) or packed after it
// (pack16 6 B a value); the float weights are cast into a 16-bit copy (6 B a weight) for the
// forward's GEMM and again for the input gradient's, under the linear layer's own name.
// tiny-gpt as above, mbs 2:
//   forward: round16 x alone (65,536: the attention output is packed instead of rounded);
//     norm1 reads x and writes h1 in 16 bits: (4 + 2) x 65,536 = 393,216 bytes (floats:
//     524,288; with sequence parallelism, tp 2, the gathered output is packed after: 2 x 4
//     x 128 x 256 = 262,144); GELU reads u and writes the activation and u's kept copy in
//     16 bits: (4 + 2 + 2) x 262,144 = 2,097,152; pack16 the attention output (65,536), then
//     the kept rest x, qkv (196,608), x2 and the probabilities (131,072) = 458,752: 524,288
//   backward: unpack16 only what neither a GEMM nor a norm's or the activation's backward
//     reads as stored: qkv and the probabilities, 327,680; round16 datt alone (65,536: dqkv is packed instead, and its bias
//     gradient reads it so); pack16 dy (65,536), dO (65,536), dqkv (196,608) = 327,680 (du
//     written in 16 bits by GELU's backward); norm1 reads x at 2 bytes: (2 x 4 + 2) x 65,536 = 655,360
//     bytes (floats: 786,432); GELU reads dout, u at 2 bytes and writes du at 2: (4 + 2 + 2)
//     x 262,144 = 2,097,152 (floats: 3,145,728)
//   weight casts: qkv 256 x 768 = 196,608, attn_proj 65,536, fc1 and fc2 262,144 each;
//     per phase 786,432 weights
//   full recompute (fp16): forward pack16 the attention output 65,536 + x 65,536 = 131,072,
//     GELU no kept copy of u: (4 + 2) x 262,144 = 1,572,864; the replay packs the attention
//     output again (65,536) and GELU writes u's copy (2,097,152); the backward unpacks x
//     (65,536); the norms read the replay's floats (786,432 bytes for norm1), GELU u in 16
//     bits (2,097,152)
//   the fused attention, its kernels on the tensor cores (head dim 64): qkv packed where it
//     is made instead of kept and unpacked (the kernels read it, and the backward's delta the
//     output, as stored): forward pack16 att, qkv (196,608), then x, x2 = 393,216; round16 x
//     alone; no unpack16; the kernel reads q, k, v at 2 bytes and writes the output at 4: 256
//     x (2 x 768 + 4 x 256) = 655,360 bytes (floats: 4 x 256 x 1,024 = 1,048,576); its
//     backward reads qkv, the output at 2 and dO at 4, writes dqkv at 4: 256 x (2 + 4) x
//     1,024 = 1,572,864 (2,097,152); under full recompute the replay packs att and qkv
//     (262,144) and the backward unpacks x alone. Head dim 96 (kv_channels; no tensor-core
//     kernel): qkv (256 x 1,152) and the output (256 x 384) unpacked, 393,216, and the kernel
//     reads and writes floats: 4 x 256 x 2 x (384 + 384)
// tiny-llama (no biases, RoPE; Q 384, F1 1408, F 704): forward round16 x, qkv (98,304) and
// the fc1 output (360,448) = 524,288; backward round16 datt alone (65,536), pack16 dy, dO, dqkv (98,304) = 229,376; SwiGLU's backward reads dout (4 B) and
// its 2F-wide u at 2 bytes and writes the 2F-wide du at 2: (4 + 2 x 2 + 2 x 2) x 256 x 704 =
// 2,162,688 bytes (floats: 3,604,480).
TEST(Compute, StrataSixteenBitOperandsAsStored) {
  Cluster c = testing::round_cluster();
  c.strata_stack = true;
  ASSERT_TRUE(c.device.gemm_reads_16bit);  // (the default: every GPU preset)
  const ModelSpec m = load_model("tiny-gpt");
  auto bytes = [&](const std::string& plan, const std::string& name, Phase ph) {
    return sum_of(layer_ops(m, c, load_plan(plan)), name, ph, &OpCost::bytes);
  };
  auto cast_bytes = [&](const std::string& plan, Phase ph) {  // the memory ops under the linear layers' names
    double x = 0;
    for (const auto& o : layer_ops(m, c, load_plan(plan)))
      if (o.phase == ph && o.kind == OpKind::memory && (o.name == "qkv" || o.name == "attn_proj" || o.name == "fc1" || o.name == "fc2"))
        x += o.bytes;
    return x;
  };
  const std::string bf16 = "tp=1,mbs=2,precision=bf16";
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::forward), 8.0 * 65536);
  EXPECT_DOUBLE_EQ(bytes(bf16, "norm1", Phase::forward), 393216.0);
  EXPECT_DOUBLE_EQ(bytes("tp=2,sp=1,mbs=2,precision=bf16", "norm1", Phase::forward), 262144.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "gelu", Phase::forward), 2097152.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "pack16", Phase::forward), 6.0 * 524288);
  EXPECT_DOUBLE_EQ(bytes(bf16, "unpack16", Phase::backward), 6.0 * 327680);
  EXPECT_DOUBLE_EQ(bytes(bf16, "norm1", Phase::backward), 655360.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "gelu", Phase::backward), 2097152.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::backward), 8.0 * 65536);
  EXPECT_DOUBLE_EQ(bytes(bf16, "pack16", Phase::backward), 6.0 * 327680);
  EXPECT_DOUBLE_EQ(cast_bytes(bf16, Phase::forward), 6.0 * 786432);
  EXPECT_DOUBLE_EQ(cast_bytes(bf16, Phase::backward), 6.0 * 786432);
  // The fused attention on the tensor cores (head dim 64) reads qkv and its output as stored.
  const std::string flash = bf16 + ",attention=flash";
  EXPECT_DOUBLE_EQ(bytes(flash, "unpack16", Phase::backward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(flash, "pack16", Phase::forward), 6.0 * 393216);
  EXPECT_DOUBLE_EQ(bytes(flash, "round16", Phase::forward), 8.0 * 65536);
  EXPECT_DOUBLE_EQ(bytes(flash, "flash_attention", Phase::forward), 655360.0);
  EXPECT_DOUBLE_EQ(bytes(flash, "flash_attention", Phase::backward), 1572864.0);
  ModelSpec wide = m;
  wide.kv_channels = 96;  // no tensor-core kernel: qkv (1,152 columns) and the output (384) unpacked
  EXPECT_DOUBLE_EQ(sum_of(layer_ops(wide, c, load_plan(flash)), "unpack16", Phase::backward, &OpCost::bytes),
                   6.0 * 393216);
  EXPECT_DOUBLE_EQ(sum_of(layer_ops(wide, c, load_plan(flash)), "flash_attention", Phase::forward, &OpCost::bytes),
                   4.0 * 256 * 2 * (384 + 384));
  const std::string full = "tp=1,mbs=2,precision=fp16,recompute=full";
  EXPECT_DOUBLE_EQ(bytes(full, "pack16", Phase::forward), 6.0 * 131072);
  EXPECT_DOUBLE_EQ(bytes(full, "gelu", Phase::forward), 1572864.0);
  EXPECT_DOUBLE_EQ(bytes(full, "pack16", Phase::recompute), 6.0 * 65536);
  EXPECT_DOUBLE_EQ(bytes(full, "gelu", Phase::recompute), 2097152.0);
  EXPECT_DOUBLE_EQ(bytes(full, "unpack16", Phase::backward), 6.0 * 65536);
  EXPECT_DOUBLE_EQ(bytes(full + ",attention=flash", "unpack16", Phase::backward), 6.0 * 65536);
  EXPECT_DOUBLE_EQ(bytes(full + ",attention=flash", "pack16", Phase::recompute), 6.0 * 262144);
  EXPECT_DOUBLE_EQ(bytes(full, "norm1", Phase::backward), 786432.0);
  EXPECT_DOUBLE_EQ(bytes(full, "gelu", Phase::backward), 2097152.0);
  EXPECT_DOUBLE_EQ(cast_bytes(full, Phase::recompute), 6.0 * 786432);
  const ModelSpec llama = load_model("tiny-llama");
  auto llama_bytes = [&](const std::string& name, Phase ph) {
    return sum_of(layer_ops(llama, c, load_plan(bf16)), name, ph, &OpCost::bytes);
  };
  EXPECT_DOUBLE_EQ(llama_bytes("round16", Phase::forward), 8.0 * 524288);
  EXPECT_DOUBLE_EQ(llama_bytes("round16", Phase::backward), 8.0 * 65536);
  EXPECT_DOUBLE_EQ(llama_bytes("pack16", Phase::backward), 6.0 * 229376);
  EXPECT_DOUBLE_EQ(llama_bytes("swiglu", Phase::backward), 2162688.0);
  // fp32 and other stacks: no casts, no packs.
  EXPECT_DOUBLE_EQ(cast_bytes("tp=1,mbs=2,precision=fp32", Phase::forward), 0.0);
  EXPECT_DOUBLE_EQ(bytes("tp=1,mbs=2,precision=fp32", "pack16", Phase::backward), 0.0);
  c.strata_stack = false;
  EXPECT_DOUBLE_EQ(cast_bytes(bf16, Phase::forward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "pack16", Phase::backward), 0.0);
}

// The output layer's 16-bit rounding on the strata stack: none in a pass of its own
// (executor/gpt.cpp head_forward: the final norm rounds its output rows as it writes them,
// the cross-entropy's backward the logit gradients). tiny-gpt (H 256, vocabulary 512,
// padded to a multiple of 128 t), micro-batch 2: T = 256 tokens.
//   the final norm: 2 e T H = 2 x 4 x 256 x 256 = 524,288 bytes, as in fp32 (tp 2 with
//     sequence parallelism: its 128 rows, 262,144)
//   the cross-entropy's backward: 8 B a logit (read, the rounded gradient written):
//     8 x 256 x 512 = 1,048,576 (tp 2: 524,288)
TEST(Compute, StrataOutputLayerRounds16Bit) {
  Cluster c = testing::round_cluster();
  c.strata_stack = true;
  c.device.gemm_reads_16bit = false;
  const ModelSpec m = load_model("tiny-gpt");
  auto bytes = [&](const std::string& plan, const std::string& name, Phase ph) {
    return sum_of(head_ops(m, c, load_plan(plan)), name, ph, &OpCost::bytes);
  };
  const std::string bf16 = "tp=1,mbs=2,precision=bf16";
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::forward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::backward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "final_norm", Phase::forward), 524288.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "cross_entropy", Phase::backward), 1048576.0);
  const std::string tp2 = "tp=2,sp=1,mbs=2,precision=fp16";
  EXPECT_DOUBLE_EQ(bytes(tp2, "round16", Phase::forward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(tp2, "round16", Phase::backward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(tp2, "final_norm", Phase::forward), 262144.0);
  EXPECT_DOUBLE_EQ(bytes(tp2, "cross_entropy", Phase::backward), 524288.0);
  const std::string fp32 = "tp=1,mbs=2,precision=fp32";
  EXPECT_DOUBLE_EQ(bytes(fp32, "round16", Phase::forward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(fp32, "round16", Phase::backward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(fp32, "cross_entropy", Phase::backward), 1048576.0);
  c.strata_stack = false;
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::forward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::backward), 0.0);
  // Where the GEMMs read 16-bit operands: the final norm writes its output for them in 16
  // bits ((4 + 2) T H = 393,216 bytes, no pack16; with sequence parallelism, tp 2, its 128
  // rows as floats, 262,144, gathered and packed after: 6 T H = 6 x 65,536) and the weight
  // is cast (6 Vt H = 6 x 131,072) in the forward; in the backward the cross-entropy writes
  // the logit gradients in 16 bits ((4 + 2) T Vt = 6 x 131,072, no pack16) and the weight is
  // cast again.
  c.strata_stack = true;
  c.device.gemm_reads_16bit = true;
  auto memory_named = [&](const std::string& name, Phase ph) {
    double x = 0;
    for (const auto& o : head_ops(m, c, load_plan(bf16)))
      if (o.phase == ph && o.kind == OpKind::memory && o.name == name) x += o.bytes;
    return x;
  };
  EXPECT_DOUBLE_EQ(memory_named("pack16", Phase::forward), 0.0);
  EXPECT_DOUBLE_EQ(bytes(bf16, "final_norm", Phase::forward), 393216.0);
  EXPECT_DOUBLE_EQ(bytes(tp2, "final_norm", Phase::forward), 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(head_ops(m, c, load_plan(tp2)), "pack16", Phase::forward, &OpCost::bytes), 6.0 * 65536);
  EXPECT_DOUBLE_EQ(memory_named("lm_head", Phase::forward), 6.0 * 131072);
  EXPECT_DOUBLE_EQ(memory_named("pack16", Phase::backward), 0.0);
  EXPECT_DOUBLE_EQ(memory_named("cross_entropy", Phase::backward), 6.0 * 131072);
  EXPECT_DOUBLE_EQ(memory_named("lm_head", Phase::backward), 6.0 * 131072);
  EXPECT_DOUBLE_EQ(bytes(bf16, "round16", Phase::backward), 0.0);
}

// Memory-bound ops at their kind's curve where the device has one (Device::kernel_efficiency,
// strata profile's), the generic curve otherwise. round_cluster: 1 TB/s; here the generic
// curve at 0.1, rounding at 0.25, norms at 0.05 and activations at 0.4. tiny-gpt bf16 on
// the strata stack, mbs 2 (floats, e = 4, T = 256 tokens, H = 256, F = 1024): the forward's
// rounding passes move 8 x 131,072 bytes, the backward's 8 x 393,216
// (StrataSixteenBitPasses); norm1 2 e T H = 524,288; GELU 2 e T F = 2,097,152.
TEST(Compute, MemoryBoundOpsAtTheirKindsCurve) {
  Cluster c = testing::round_cluster();
  c.strata_stack = true;
  c.device.gemm_reads_16bit = false;  // (StrataSixteenBitPasses' numbers: the CPU backend's passes)
  c.device.memory_efficiency = Curve({{1.0, 0.1}});
  const ModelSpec m = load_model("tiny-gpt");
  const Plan p = load_plan("tp=1,mbs=2,precision=bf16");
  auto time_of = [&](const std::string& name, Phase ph) { return sum_of(layer_ops(m, c, p), name, ph, &OpCost::time_s); };
  // Without kind curves (every preset): all at the generic curve.
  EXPECT_DOUBLE_EQ(time_of("round16", Phase::forward), 8.0 * 131072 / 0.1e12);
  EXPECT_NEAR(time_of("norm1", Phase::forward), 524288 / 0.1e12, 1e-18);
  const double bda = time_of("bias_dropout_add", Phase::forward), pack = time_of("pack16", Phase::forward);
  auto set = [&](MemKind k, double eff) { c.device.kernel_efficiency[static_cast<int>(k)] = Curve({{1.0, eff}}); };
  set(MemKind::round16, 0.25);
  set(MemKind::norm, 0.05);
  set(MemKind::activation, 0.4);
  EXPECT_NEAR(time_of("round16", Phase::forward), 8.0 * 131072 / 0.25e12, 1e-18);
  EXPECT_NEAR(time_of("round16", Phase::backward), 8.0 * 393216 / 0.25e12, 1e-18);
  EXPECT_NEAR(time_of("norm1", Phase::forward), 524288 / 0.05e12, 1e-18);
  EXPECT_NEAR(time_of("gelu", Phase::forward), 2097152 / 0.4e12, 1e-18);
  // Ops of no kind stay at the generic curve (the packing pass also allocates its buffer in
  // the executor, and the bias-dropout-add draws its mask: not the kernels timed).
  EXPECT_DOUBLE_EQ(time_of("bias_dropout_add", Phase::forward), bda);
  EXPECT_DOUBLE_EQ(time_of("pack16", Phase::forward), pack);
  // Every norm and activation op of every phase, recompute included, at its kind's curve:
  // GPT (LayerNorm, GELU) and a multi-latent-attention model (RMSNorm, SwiGLU, the latent
  // norms) under full recompute.
  const ModelSpec mla = model_from_json(Json::parse(R"({"num_layers":2,"hidden_size":256,"num_attention_heads":4,
      "vocab_size":512,"seq_length":128,"activation":"swiglu","ffn_hidden_size":512,"multi_latent_attention":true,
      "q_lora_rank":64,"kv_lora_rank":32,"qk_head_dim":32,"qk_pos_emb_head_dim":16,"v_head_dim":32})"), "model");
  for (const auto& [model, plan] : {std::pair<const ModelSpec*, const char*>{&m, "tp=1,mbs=2,precision=bf16,recompute=full"},
                                    {&mla, "tp=2,sp=1,mbs=2,precision=bf16,recompute=full"},
                                    {&mla, "tp=2,sp=1,mbs=2,precision=bf16,recompute=selective"}}) {
    int norms = 0, acts = 0;
    for (const OpCost& o : layer_ops(*model, c, load_plan(plan))) {
      if (o.kind != OpKind::memory) continue;
      const bool norm = o.name.find("norm") != std::string::npos, act = o.name == "gelu" || o.name == "swiglu";
      if (norm) {
        ++norms;
        EXPECT_NEAR(o.time_s, o.bytes / 0.05e12, 1e-18) << plan << " " << o.name;
      }
      if (act) {
        ++acts;
        EXPECT_NEAR(o.time_s, o.bytes / 0.4e12, 1e-18) << plan << " " << o.name;
      }
    }
    EXPECT_GE(norms, 4) << plan;
    EXPECT_GE(acts, 2) << plan;
  }
  EXPECT_DOUBLE_EQ(memory_time(c.device, 1e6, MemKind::norm), 1e6 / 0.05e12);
  EXPECT_DOUBLE_EQ(memory_time(c.device, 1e6, MemKind::generic), memory_time(c.device, 1e6));
  c.device.kernel_efficiency[static_cast<int>(MemKind::norm)] = Curve();
  EXPECT_DOUBLE_EQ(memory_time(c.device, 1e6, MemKind::norm), memory_time(c.device, 1e6));
}

// Context parallelism on the strata executor (gpt.cpp): an all-gather of every rank's keys
// and values before the core, again in the backward (started before the MLP block's
// backward, behind it) with a reduce-scatter of their gradients (exposed); and its unfused core computes each of its two chunks of S/2c
// queries against the keys up to the chunk's end, (2c+1)/(4c) of the Sq x Sk products.
// tiny-gpt: H = 256, A = G = 4, D = 64, S = 128; cp = 2, mbs 2, fp32: T = 2 * 128 / 2 = 128
// tokens here, K and V = 4 bytes * 128 * 2 * 4 * 64 = 262,144 bytes; the gather's output is
// cp times that, 524,288. Scores: 2 * (mbs A = 8) * (Sq = 64) * (Sk = 128) * 64 * 5/8 FLOPs.
TEST(Compute, StrataContextParallelExchanges) {
  Cluster c = testing::round_cluster();
  c.strata_stack = true;
  const ModelSpec m = load_model("tiny-gpt");
  const Plan p = load_plan("cp=2,mbs=2,precision=fp32");
  auto ops_of = [&] { return layer_ops(m, c, p); };
  std::vector<OpCost> ops = ops_of();
  EXPECT_DOUBLE_EQ(sum_of(ops, "cp_kv_gather", Phase::forward, &OpCost::bytes), 524288.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "cp_kv_gather", Phase::backward, &OpCost::bytes), 524288.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "cp_dkv_reduce_scatter", Phase::backward, &OpCost::bytes), 524288.0);
  EXPECT_GT(sum_of(ops, "cp_kv_gather", Phase::forward, &OpCost::time_s), 0.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "cp_kv_gather", Phase::forward, &OpCost::exposed_s),
                   sum_of(ops, "cp_kv_gather", Phase::forward, &OpCost::time_s));
  EXPECT_DOUBLE_EQ(sum_of(ops, "attn_scores", Phase::forward, &OpCost::flops), 2.0 * 8 * 64 * 128 * 64 * 5.0 / 8.0);
  // The backward's gather starts before the MLP block's backward: hidden behind it but for
  // the overlap's contention cost; the reduce-scatter stays exposed.
  EXPECT_LT(sum_of(ops, "cp_kv_gather", Phase::backward, &OpCost::exposed_s),
            0.5 * sum_of(ops, "cp_kv_gather", Phase::backward, &OpCost::time_s));
  EXPECT_DOUBLE_EQ(sum_of(ops, "cp_dkv_reduce_scatter", Phase::backward, &OpCost::exposed_s),
                   sum_of(ops, "cp_dkv_reduce_scatter", Phase::backward, &OpCost::time_s));
  // Recompute: full replays the layer's forward with its gather; selective's core reuses
  // the keys and values its backward gathers.
  for (const auto& [rc, gathered] : {std::pair<const char*, double>{"full", 524288.0}, {"selective", 0.0}}) {
    const Plan pr = load_plan(std::string("cp=2,mbs=2,precision=fp32,recompute=") + rc);
    const std::vector<OpCost> rops = layer_ops(m, c, pr);
    EXPECT_DOUBLE_EQ(sum_of(rops, "cp_kv_gather", Phase::recompute, &OpCost::bytes), gathered) << rc;
  }
  // Megatron's ring on another stack: (cp - 1) steps of K and V, and the whole score block.
  c.strata_stack = false;
  ops = ops_of();
  EXPECT_DOUBLE_EQ(sum_of(ops, "cp_kv_exchange", Phase::forward, &OpCost::bytes), 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "cp_kv_exchange", Phase::backward, &OpCost::bytes), 2.0 * 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "cp_kv_gather", Phase::forward, &OpCost::bytes), 0.0);
}

// Megatron-LM's three cp_comm_types on a GPU stack, tiny-gpt as above (cp = 2, mbs 2, fp32:
// T = 128 tokens; K and V 262,144 bytes, Q and the core's output 4 * 128 * 4 * 64 = 131,072).
// The pair of ranks shares a node: 200 GB/s at 75 %, 5 us a step.
//   p2p:       one ring step of K and V forward (two backward, with dK and dV), behind the core.
//   allgather: K and V gathered before the core (the output, 524,288 bytes), again in the
//              backward, and dK, dV reduce-scattered (524,288 in), all exposed; an
//              all-gather of S bytes takes 5 us (one round) + S/2 / 150 GB/s.
//   a2a:       Q, K, V (393,216 bytes) all-to-all'ed before the core and the output
//              (131,072) after it; in the backward dO before, dQ, dK, dV after; exposed,
//              5 us + S/2 / 150 GB/s each.
// The core's FLOPs are the same whichever way the keys travel.
TEST(Compute, ContextParallelCommTypes) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("tiny-gpt");
  auto ops_of = [&](const std::string& plan) { return layer_ops(m, c, load_plan(plan)); };
  auto step = [](double bytes) { return 5e-6 + bytes / 2.0 / 150e9; };
  const std::vector<OpCost> p2p = ops_of("cp=2,mbs=2,precision=fp32,cp_comm_type=p2p");
  const std::vector<OpCost> ag = ops_of("cp=2,mbs=2,precision=fp32,cp_comm_type=allgather");
  const std::vector<OpCost> a2a = ops_of("cp=2,mbs=2,precision=fp32,cp_comm_type=a2a");
  // The default is p2p (no sliding window).
  const std::vector<OpCost> automatic = ops_of("cp=2,mbs=2,precision=fp32");
  EXPECT_DOUBLE_EQ(sum_of(automatic, "cp_kv_exchange", Phase::backward, &OpCost::bytes), 2.0 * 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(p2p, "cp_kv_exchange", Phase::forward, &OpCost::bytes), 262144.0);

  for (Phase ph : {Phase::forward, Phase::backward}) {
    EXPECT_DOUBLE_EQ(sum_of(ag, "cp_kv_gather", ph, &OpCost::bytes), 524288.0);
    EXPECT_NEAR(sum_of(ag, "cp_kv_gather", ph, &OpCost::exposed_s), step(524288.0), 1e-15);
    EXPECT_DOUBLE_EQ(sum_of(a2a, "cp_qkv_all_to_all", ph, &OpCost::bytes), 393216.0);
    EXPECT_DOUBLE_EQ(sum_of(a2a, "cp_out_all_to_all", ph, &OpCost::bytes), 131072.0);
    EXPECT_NEAR(sum_of(a2a, "cp_qkv_all_to_all", ph, &OpCost::exposed_s), step(393216.0), 1e-15);
    EXPECT_NEAR(sum_of(a2a, "cp_out_all_to_all", ph, &OpCost::exposed_s), step(131072.0), 1e-15);
    EXPECT_DOUBLE_EQ(sum_of(a2a, "cp_kv_exchange", ph, &OpCost::bytes) + sum_of(a2a, "cp_kv_gather", ph, &OpCost::bytes), 0.0);
    EXPECT_DOUBLE_EQ(sum_of(a2a, "flash_attention", ph, &OpCost::flops), sum_of(p2p, "flash_attention", ph, &OpCost::flops));
    EXPECT_DOUBLE_EQ(sum_of(ag, "flash_attention", ph, &OpCost::flops), sum_of(p2p, "flash_attention", ph, &OpCost::flops));
  }
  EXPECT_DOUBLE_EQ(sum_of(ag, "cp_dkv_reduce_scatter", Phase::backward, &OpCost::bytes), 524288.0);
  EXPECT_NEAR(sum_of(ag, "cp_dkv_reduce_scatter", Phase::backward, &OpCost::exposed_s), step(524288.0), 1e-15);
  // Full recompute replays the forward with its exchanges, and so does selective recompute's
  // core (Transformer Engine's checkpointed attention runs its forward again, exchanges and all).
  for (const char* rc : {"full", "selective"}) {
    const std::vector<OpCost> re = ops_of(std::string("cp=2,mbs=2,precision=fp32,cp_comm_type=a2a,recompute=") + rc);
    EXPECT_DOUBLE_EQ(sum_of(re, "cp_qkv_all_to_all", Phase::recompute, &OpCost::bytes), 393216.0) << rc;
    EXPECT_DOUBLE_EQ(sum_of(re, "cp_out_all_to_all", Phase::recompute, &OpCost::bytes), 131072.0) << rc;
    const std::vector<OpCost> rg = ops_of(std::string("cp=2,mbs=2,precision=fp32,cp_comm_type=allgather,recompute=") + rc);
    EXPECT_DOUBLE_EQ(sum_of(rg, "cp_kv_gather", Phase::recompute, &OpCost::bytes), 524288.0) << rc;
  }
  // Grouped queries on two tensor-parallel ranks (tiny-llama: A = 8, G = 2, D = 32, bf16, so
  // e = 2): T = 128 tokens, Q and the output 2 * 128 * 8 * 32 / 2 = 32,768 bytes, K and V one
  // group each, 2 * 128 * 2 * 32 = 16,384 (the byte counts only: check_plan refuses a2a
  // here, whose one group per rank cp 2 cannot split).
  const ModelSpec gqa = load_model("tiny-llama");
  const Plan gp = load_plan("tp=2,cp=2,mbs=2,cp_comm_type=a2a");
  const std::vector<OpCost> gops = layer_ops(gqa, c, gp);
  EXPECT_DOUBLE_EQ(sum_of(gops, "cp_qkv_all_to_all", Phase::forward, &OpCost::bytes), 32768.0 + 16384.0);
  EXPECT_DOUBLE_EQ(sum_of(gops, "cp_out_all_to_all", Phase::forward, &OpCost::bytes), 32768.0);
}

// A mixture-of-experts layer (Megatron-core's all-to-all dispatcher), by hand on the round
// cluster: H = 256, 8 GELU experts of Fe = 512, top 2, bf16 (e = 2), mbs 2 x 128 tokens.
// T = Tn = 256 tokens; each rank sends its K T = 512 token copies to their experts' ranks,
// 2 * 512 * 256 = 262,144 bytes, an all-to-all over ep = 4 ranks of one node: 5 us + 262,144
// x 3/4 / (200 GB/s x 0.75) = 6.31072 us, once to dispatch and once to combine, in the
// forward and again in the backward. Its 8/4 = 2 experts compute the 512 copies, 256 each:
// fc1 2 x (2 x 256 x 512 x 256) = 134,217,728 FLOPs at 50 TFLOP/s = 2.68435456 us, K times
// a dense MLP of Fe's. Router: 2 x 256 x 8 x 256 = 1,048,576 FLOPs.
TEST(Compute, MixtureOfExpertsLayer) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = model_from_json(Json::parse(R"({"num_layers":2,"hidden_size":256,"num_attention_heads":4,
      "vocab_size":512,"seq_length":128,"activation":"gelu","num_experts":8,"moe_router_topk":2,
      "moe_ffn_hidden_size":512,"attention_dropout":0,"hidden_dropout":0})"), "model");
  const std::vector<OpCost> ops = layer_ops(m, c, load_plan("dp=8,ep=4,mbs=2,precision=bf16"));
  const double a2a = 5e-6 + 262144.0 * 0.75 / (200e9 * 0.75);
  for (Phase ph : {Phase::forward, Phase::backward})
    for (const char* name : {"ep_dispatch_all_to_all", "ep_combine_all_to_all"}) {
      EXPECT_DOUBLE_EQ(sum_of(ops, name, ph, &OpCost::bytes), 262144.0) << name;
      EXPECT_NEAR(sum_of(ops, name, ph, &OpCost::exposed_s), a2a, 1e-18) << name;
    }
  EXPECT_DOUBLE_EQ(sum_of(ops, "expert_fc1", Phase::forward, &OpCost::flops), 134217728.0);
  EXPECT_NEAR(sum_of(ops, "expert_fc1", Phase::forward, &OpCost::time_s), 134217728.0 / 50e12, 1e-18);
  EXPECT_DOUBLE_EQ(sum_of(ops, "expert_fc2", Phase::forward, &OpCost::flops), 134217728.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "expert_fc1", Phase::backward, &OpCost::flops), 2.0 * 134217728.0);  // dgrad, wgrad
  EXPECT_DOUBLE_EQ(sum_of(ops, "router", Phase::forward, &OpCost::flops), 1048576.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "fc1", Phase::forward, &OpCost::flops), 0.0);  // no dense MLP
  // The layer's exposed expert-parallel time is the four all-to-alls of each pass.
  const LayerCost lc = layer_cost(m, c, load_plan("dp=8,ep=4,mbs=2,precision=bf16"),
                                  compute_setup(m, c, load_plan("dp=8,ep=4,mbs=2,precision=bf16")));
  EXPECT_NEAR(lc.forward.ep_comm_s, 2 * a2a, 1e-18);
  EXPECT_NEAR(lc.backward.ep_comm_s, 2 * a2a, 1e-18);
  // Without expert parallelism nothing leaves the rank; all 8 experts see 64 copies each.
  const std::vector<OpCost> one = layer_ops(m, c, load_plan("dp=8,mbs=2,precision=bf16"));
  EXPECT_DOUBLE_EQ(sum_of(one, "ep_dispatch_all_to_all", Phase::forward, &OpCost::bytes), 0.0);
  EXPECT_DOUBLE_EQ(sum_of(one, "expert_fc1", Phase::forward, &OpCost::flops), 134217728.0);
  // With tensor parallelism (sequence parallel: Tn = 128) each rank dispatches half the
  // copies and gathers the group's 512 (2 * 512 * 256 bytes), its experts split in two.
  const std::vector<OpCost> tp = layer_ops(m, c, load_plan("tp=2,sp=1,dp=4,ep=4,mbs=2,precision=bf16"));
  EXPECT_DOUBLE_EQ(sum_of(tp, "ep_dispatch_all_to_all", Phase::forward, &OpCost::bytes), 131072.0);
  EXPECT_DOUBLE_EQ(sum_of(tp, "moe_tp_all_gather", Phase::forward, &OpCost::bytes), 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(tp, "moe_tp_reduce_scatter", Phase::forward, &OpCost::bytes), 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(tp, "expert_fc1", Phase::forward, &OpCost::flops), 134217728.0 / 2);
  // recompute_modules layernorm and moe_act run both norms (2 x 2 x 256 x 256 bytes each) and
  // the experts' GELU (2 x 2 x 512 copies x 512) again before the backward, and nothing else.
  const std::vector<OpCost> re = layer_ops(m, c, load_plan("dp=8,ep=4,mbs=2,precision=bf16,recompute_modules=layernorm+moe_act"));
  EXPECT_DOUBLE_EQ(sum_of(re, "norm1", Phase::recompute, &OpCost::bytes), 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "norm2", Phase::recompute, &OpCost::bytes), 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "gelu", Phase::recompute, &OpCost::bytes), 1048576.0);
  double other = 0;
  for (const OpCost& o : re)
    if (o.phase == Phase::recompute && o.name != "norm1" && o.name != "norm2" && o.name != "gelu") other += o.time_s;
  EXPECT_EQ(other, 0.0);
}

// torchtitan's op-level selective recompute (selective_ac_option op) on tiny-llama (H 256, 8
// heads of 32 in 2 groups: k 64 wide; SwiGLU F 704), micro-batch 2 x 128 = 256 tokens,
// bf16 (2 bytes), one rank. The policy keeps the fused attention's output and the 1st,
// 3rd, 5th and 7th matrix multiplications' (q, v, gate, down), so before the backward the
// checkpoint runs again, up to down's input:
//   k            2 x 256 x 64 x 256  =  8,388,608 FLOPs
//   attn_proj    2 x 256 x 256 x 256 = 33,554,432
//   fc1 (up)     2 x 256 x 704 x 256 = 92,274,688  (together 2^27 = 134,217,728)
//   norm1, norm2 (2 + 2) x 256 x 256 = 262,144 bytes each; rope 2 x 2 x 256 x (256 + 64)
//   = 327,680; the residual add 3 x 2 x 256 x 256 = 393,216; swiglu 3 x 2 x 256 x 704 =
//   1,081,344; and neither the attention (kept) nor the down projection (never reached).
TEST(Compute, TorchtitanOpSelectiveRecompute) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("tiny-llama");
  ASSERT_EQ(m.H, 256);
  ASSERT_EQ(m.F, 704);
  const std::vector<OpCost> op = layer_ops(m, c, load_plan("dp=8,mbs=2,precision=bf16,selective_ac_option=op"));
  EXPECT_DOUBLE_EQ(sum_of(op, "qkv", Phase::recompute, &OpCost::flops), 8388608.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "attn_proj", Phase::recompute, &OpCost::flops), 33554432.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "fc1", Phase::recompute, &OpCost::flops), 92274688.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "fc2", Phase::recompute, &OpCost::flops), 0.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "flash_attention", Phase::recompute, &OpCost::flops), 0.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "norm1", Phase::recompute, &OpCost::bytes), 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "norm2", Phase::recompute, &OpCost::bytes), 262144.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "rope", Phase::recompute, &OpCost::bytes), 327680.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "bias_dropout_add", Phase::recompute, &OpCost::bytes), 393216.0);
  EXPECT_DOUBLE_EQ(sum_of(op, "swiglu", Phase::recompute, &OpCost::bytes), 1081344.0);
  double flops = 0;
  for (const OpCost& o : op)
    if (o.phase == Phase::recompute) flops += o.flops;
  EXPECT_DOUBLE_EQ(flops, 134217728.0);
  // Megatron's selective recompute (the attention core) runs the fused attention again instead.
  const std::vector<OpCost> core = layer_ops(m, c, load_plan("dp=8,mbs=2,precision=bf16,recompute=selective"));
  EXPECT_GT(sum_of(core, "flash_attention", Phase::recompute, &OpCost::flops), 0.0);
  EXPECT_DOUBLE_EQ(sum_of(core, "qkv", Phase::recompute, &OpCost::flops), 0.0);
  // The forward and backward are the same ops either way.
  auto phase_time = [](const std::vector<OpCost>& ops, Phase ph) {
    double t = 0;
    for (const OpCost& o : ops)
      if (o.phase == ph) t += o.time_s;
    return t;
  };
  EXPECT_DOUBLE_EQ(phase_time(op, Phase::forward), phase_time(core, Phase::forward));
  EXPECT_DOUBLE_EQ(phase_time(op, Phase::backward), phase_time(core, Phase::backward));
  // Hardware FLOPs count the three projections again on every layer: 4 layers, 8 x 2 x 128
  // tokens a step (one micro-batch of 2 a rank), 2^27 x 8 x 4 more than with none.
  const Plan none = load_plan("dp=8,mbs=2,precision=bf16"), ops = load_plan("dp=8,mbs=2,precision=bf16,selective_ac_option=op");
  EXPECT_DOUBLE_EQ(hardware_flops_per_step(m, ops) - hardware_flops_per_step(m, none), 134217728.0 * 8 * 4);
}

// The flex dispatcher (DeepEP, HybridEP): 16 experts of 2 per token on ep 16 over two
// nodes of 8 GPUs (one expert each), mbs 1 x 1024 tokens, H 1024, bf16 (2048-byte rows).
// - a token misses the other node with P = (8/16)(7/15) = 7/30, so 23/30 of a copy per
//   token crosses the network (the all-to-all sends K x 8/16 = 1);
// - it misses a given GPU with P = (15/16)(14/15) = 7/8, and reaches the 14 GPUs other than
//   itself and the other node's entry GPU over NVLink: 14/8 copies per token;
// - time: 10 us + max(1024 x 23/30 x 2048 / 10 GB/s, 1024 x 14/8 x 2048 / 150 GB/s)
//   = 10 us + 160.8 us; the backward's exchanges alike;
// - group-limited routing, 4 groups of 4 experts, 2 whole groups on each node: with each
//   token's experts in 1 group it misses the other node with P = C(2,1)/C(4,1) = 1/2, with
//   2 groups P = C(2,2)/C(4,2) = 1/6 (every chosen group supplies an expert);
// - within one node (ep 8, 2 experts per GPU) only NVLink: 7 x (1 - (14/16)(13/15)) copies;
// - the all-gather dispatcher gathers the 16 ranks' tokens (16 x 1024 x 2048 bytes) over
//   both nodes: 4 rounds of 10 us and 15/16 of them at min(150, 8 x 12.5 x 0.8) = 80 GB/s,
//   and reduce-scatters the outputs back (backward: the other way round).
TEST(Compute, FlexDispatcherSendsATokenOncePerNode) {
  const Cluster c = testing::round_cluster();
  const char* model = R"({"num_layers":2,"hidden_size":1024,"num_attention_heads":8,"vocab_size":512,
      "seq_length":1024,"activation":"gelu","num_experts":16,"moe_router_topk":2,"moe_ffn_hidden_size":512,
      "attention_dropout":0,"hidden_dropout":0%s})";
  auto with = [&](const std::string& extra) {
    std::string text = model;
    text.replace(text.find("%s"), 2, extra);
    return model_from_json(Json::parse(text), "model");
  };
  const ModelSpec m = with(""), grouped = with(R"(,"moe_router_num_groups":4,"moe_router_group_topk":1)"),
                  grouped2 = with(R"(,"moe_router_num_groups":4,"moe_router_group_topk":2)");
  const double row = 2048, Tn = 1024;
  auto exchange = [&](const ModelSpec& mm, const char* plan, const char* name) {
    const std::vector<OpCost> ops = layer_ops(mm, c, load_plan(plan));
    return std::pair{sum_of(ops, name, Phase::forward, &OpCost::bytes), sum_of(ops, name, Phase::forward, &OpCost::time_s)};
  };
  const char* flex = "dp=16,ep=16,mbs=1,precision=bf16,moe_token_dispatcher_type=flex";
  const auto [bytes, t] = exchange(m, flex, "ep_dispatch_flex");
  EXPECT_NEAR(bytes, Tn * 23.0 / 30.0 * row, 1e-6);
  EXPECT_NEAR(t, 10e-6 + std::max(Tn * 23.0 / 30.0 * row / 10e9, Tn * 14.0 / 8.0 * row / 150e9), 1e-15);
  EXPECT_NEAR(exchange(m, flex, "ep_combine_flex").second, t, 1e-18);
  {
    const std::vector<OpCost> ops = layer_ops(m, c, load_plan(flex));
    for (const char* name : {"ep_dispatch_flex", "ep_combine_flex"})
      EXPECT_NEAR(sum_of(ops, name, Phase::backward, &OpCost::time_s), t, 1e-18) << name;
  }
  EXPECT_DOUBLE_EQ(exchange(m, flex, "ep_dispatch_all_to_all").first, 0.0);
  // The all-to-all dispatcher sends a copy per expert, half of them off the node.
  const auto [a2a_bytes, a2a_t] = exchange(m, "dp=16,ep=16,mbs=1,precision=bf16", "ep_dispatch_all_to_all");
  EXPECT_DOUBLE_EQ(a2a_bytes, Tn * 2 * row);
  EXPECT_NEAR(a2a_t, 10e-6 + Tn * 2 * row * 0.5 / 10e9, 1e-15);
  EXPECT_LT(t, a2a_t);
  // Group-limited routing: half a copy per token crosses the network.
  EXPECT_NEAR(exchange(grouped, flex, "ep_dispatch_flex").first, Tn * 0.5 * row, 1e-6);
  EXPECT_NEAR(exchange(grouped2, flex, "ep_dispatch_flex").first, Tn * 5.0 / 6.0 * row, 1e-6);
  // One node: NVLink only.
  const auto [in_bytes, in_t] = exchange(m, "dp=8,ep=8,mbs=1,precision=bf16,moe_token_dispatcher_type=flex,"
                                            "moe_flex_dispatcher_backend=hybridep", "ep_dispatch_flex");
  const double gpus = 7.0 * (1.0 - 14.0 / 16.0 * 13.0 / 15.0);
  EXPECT_NEAR(in_bytes, Tn * gpus * row, 1e-6);
  EXPECT_NEAR(in_t, 5e-6 + Tn * gpus * row / 150e9, 1e-15);
  // The all-gather dispatcher.
  const char* ag = "dp=16,ep=16,mbs=1,precision=bf16,moe_token_dispatcher_type=allgather";
  const std::vector<OpCost> ops = layer_ops(m, c, load_plan(ag));
  const double gathered = 16 * Tn * row, t_ag = 4 * 10e-6 + gathered * 15.0 / 16.0 / 80e9;
  EXPECT_DOUBLE_EQ(sum_of(ops, "ep_dispatch_all_gather", Phase::forward, &OpCost::bytes), gathered);
  EXPECT_NEAR(sum_of(ops, "ep_dispatch_all_gather", Phase::forward, &OpCost::time_s), t_ag, 1e-15);
  EXPECT_NEAR(sum_of(ops, "ep_combine_reduce_scatter", Phase::forward, &OpCost::time_s), t_ag, 1e-15);
  EXPECT_NEAR(sum_of(ops, "ep_combine_all_gather", Phase::backward, &OpCost::time_s), t_ag, 1e-15);
  EXPECT_NEAR(sum_of(ops, "ep_dispatch_reduce_scatter", Phase::backward, &OpCost::time_s), t_ag, 1e-15);
  EXPECT_DOUBLE_EQ(sum_of(ops, "ep_dispatch_all_to_all", Phase::forward, &OpCost::bytes), 0.0);
}

// overlap_moe_expert_parallel_comm: where Megatron pairs a forward with another micro-batch's
// backward, each exchange runs beside one block of the other pass. The 16-expert model above
// on ep 16 over two nodes, batch 64 (4 micro-batches per rank, no pipeline): the first
// forward and the last backward run alone, so 3/4 of the exchanges are paired
// (paired_share). The blocks read off the plain layer's op list in order (each op's time
// on the compute stream; the exchanges between them): forward A to the dispatch df, the
// experts M to the combine cf, the rest after it (run with the combine); backward the
// unpermute's backward (run with its combine cb), the experts B' to the dispatch db, the
// attention block P'. The pair: t1 = max(A, cb); s2 = max(t1 + max(B', df) + M, t1 +
// max(B'/2, df) + db); it ends at s2 + max(cf, P'), and what it lasts beyond its kernels is
// exposed: 3/4 x (that + overlap_slowdown x the hidden rest) + 1/4 of the exchanges, split
// between the passes as their exchanges are, the kernels unchanged. At 12.5 GB/s of
// network per GPU the dispatches outlast the blocks beside them (the experts' GEMMs), which
// pooling both passes' kernels would not show; at 1 GB/s (and 10 % lost to contention) more
// is exposed than pooling would give too. Interleaved (pp 8, vp 4, 512
// micro-batches in groups of 8): 7 + 3 x 8 + 1 = 32 of the 2048 chunks are the mean
// stage's warm-up, 2016/2048 paired; one micro-batch: none.
TEST(Compute, ExpertExchangesBesideAnotherMicroBatch) {
  const ModelSpec m = model_from_json(Json::parse(R"({"num_layers":2,"hidden_size":1024,"num_attention_heads":8,
      "vocab_size":512,"seq_length":1024,"activation":"gelu","num_experts":16,"moe_router_topk":2,
      "moe_ffn_hidden_size":512,"attention_dropout":0,"hidden_dropout":0})"), "model");
  EXPECT_DOUBLE_EQ(paired_share(load_plan("dp=16,ep=16,mbs=1,gbs=64")), 0.75);
  EXPECT_DOUBLE_EQ(paired_share(load_plan("pp=8,vp=4,dp=16,mbs=1,gbs=8192")), 2016.0 / 2048.0);
  EXPECT_DOUBLE_EQ(paired_share(load_plan("dp=16,ep=16,mbs=1")), 0.0);
  std::map<std::pair<double, bool>, double> exposed_at;
  for (const auto& [network, slowdown, delay] :
       {std::tuple{12.5e9, 0.0, false}, std::tuple{1e9, 0.1, false}, std::tuple{6e9, 0.0, false},
        std::tuple{12.5e9, 0.0, true}, std::tuple{1e9, 0.1, true}, std::tuple{6e9, 0.0, true}}) {
    Cluster c = testing::round_cluster();
    c.inter.bandwidth_bytes_per_s = network;
    c.overlap_slowdown = slowdown;
    const Plan p0 = load_plan("dp=16,ep=16,mbs=1,gbs=64,precision=bf16"),
               p1 = load_plan(std::string("dp=16,ep=16,mbs=1,gbs=64,precision=bf16,overlap_moe_expert_parallel_comm=1") +
                              (delay ? ",delay_wgrad_compute=1" : ""));
    std::vector<OpCost> plain_ops, ops;
    const LayerCost l0 = layer_cost(m, c, p0, compute_setup(m, c, p0), &plain_ops);
    const LayerCost l1 = layer_cost(m, c, p1, compute_setup(m, c, p1), &ops);
    // Each pass's stream time between its exchanges, and the exchanges; in the backward the
    // weight-gradient GEMMs (a GEMM's second op of its name: input gradient, then weight
    // gradient) of each segment.
    double seg[2][3] = {{0, 0, 0}, {0, 0, 0}}, ex[2][2] = {{0, 0}, {0, 0}}, wg[3] = {0, 0, 0};
    int k[2] = {0, 0};
    std::map<std::string, int> seen;
    for (const OpCost& o : plain_ops) {
      if (o.phase == Phase::recompute) continue;
      const int ph = o.phase == Phase::forward ? 0 : 1;
      if (o.kind == OpKind::ep_comm) {
        ex[ph][k[ph]] = o.time_s;
        ++k[ph];
      } else if (o.kind != OpKind::dp_comm) {
        seg[ph][k[ph]] += o.exposed_s;
        if (ph == 1 && o.kind == OpKind::gemm && o.name != "flash_attention" && ++seen[o.name] == 2) wg[k[1]] += o.time_s;
      }
    }
    ASSERT_EQ(k[0], 2);
    ASSERT_EQ(k[1], 2);
    const double A = seg[0][0], M = seg[0][1], post = seg[0][2], q0 = seg[1][0], Bp = seg[1][1], P = seg[1][2];
    const double df = ex[0][0], cf = ex[0][1] + post, cb = q0 + ex[1][0], db = ex[1][1];
    const double Bw = delay ? wg[1] : 0.0, early = delay ? std::min(wg[2], std::max(0.0, P - cf)) : 0.0;
    EXPECT_GT(wg[1], 0.0);
    EXPECT_GT(wg[2], 0.0);
    const double t1 = std::max(A, cb - early);
    const double s2 = std::max(t1 + std::max(Bp, df) + M, t1 + std::max(Bp - Bw, df) + db);
    const double pair = s2 + std::max(cf, P), kernels = A + M + post + q0 + Bp + P;
    const double comm = l0.forward.ep_comm_s + l0.backward.ep_comm_s, cover = l0.forward.compute_s + l0.backward.compute_s;
    EXPECT_NEAR(comm, ex[0][0] + ex[0][1] + ex[1][0] + ex[1][1], 1e-15);
    const double exposed = std::min(comm, std::max(0.0, pair - kernels));
    EXPECT_GT(exposed, 0.0) << network;
    EXPECT_GE(exposed, std::max(0.0, comm - cover)) << network;  // never less than pooling would leave
    EXPECT_DOUBLE_EQ(l1.forward.compute_s, l0.forward.compute_s);
    EXPECT_DOUBLE_EQ(l1.backward.compute_s, l0.backward.compute_s);
    EXPECT_NEAR(l1.forward.ep_comm_s + l1.backward.ep_comm_s,
                0.75 * (exposed + slowdown * (comm - exposed)) + 0.25 * comm, 1e-15)
        << network;
    EXPECT_NEAR(l1.forward.ep_comm_s * l0.backward.ep_comm_s, l1.backward.ep_comm_s * l0.forward.ep_comm_s, 1e-18);
    double f = 0, b = 0;
    for (const OpCost& o : ops)
      if (o.kind == OpKind::ep_comm) (o.phase == Phase::forward ? f : b) += o.exposed_s;
    EXPECT_NEAR(f, l1.forward.ep_comm_s, 1e-15);
    EXPECT_NEAR(b, l1.backward.ep_comm_s, 1e-15);
    // By hand at 12.5 GB/s (us): A 316.648, M 90.094, post 16.777, q0 14.680, B' 178.090, P'
    // 658.611; df = db 219.715, cf 219.715 + 16.777, cb 14.680 + 219.715. t1 = 316.648; M
    // ends at t1 + 219.715 + 90.094 = 626.457, the backward's dispatch at t1 + 219.715 +
    // 219.715 = 756.078; the pair at 756.078 + 658.611 = 1414.689 against 1274.899 of
    // kernels: 139.789 exposed where pooling (1274.9 of kernels for 878.9 of exchanges)
    // would hide them all. At 1 GB/s: 9282.318 against pooling's 9250.861.
    exposed_at[std::make_pair(network, delay)] = exposed;
    if (network == 6e9) continue;
    EXPECT_NEAR(exposed * 1e6, network > 2e9 ? 139.789 : 9282.318, 1e-3) << network;
    EXPECT_NEAR(std::max(0.0, comm - cover) * 1e6, network > 2e9 ? 0.0 : 9250.861, 1e-3) << network;
  }
  // With delay_wgrad_compute the backward's combine may start behind the attention block's
  // weight gradients of the layer before, where it outlasts the forward's attention block
  // and the forward's combine ends before the backward's attention block: at 6 GB/s (about
  // 0.46 ms an exchange, against 0.32 ms of A and 0.66 ms of P'), not at 12.5 or 1.
  auto at = [&](double network, bool delay) { return exposed_at[std::make_pair(network, delay)]; };
  EXPECT_LT(at(6e9, true), at(6e9, false));
  EXPECT_EQ(at(12.5e9, true), at(12.5e9, false));
  EXPECT_EQ(at(1e9, true), at(1e9, false));
}

// Multi-latent attention's projections by hand, on a small model (H 256, 4 heads of 32 + 16
// rotary for queries and keys, 32 for values, query latent 64, key/value latent 32), 2
// sequences of 128 on 2 tensor-parallel ranks with sequence parallelism (T 256, Tn 128):
//   q_down  2 x 128 x 64 x 256 = 4,194,304 (duplicated on each rank, on its own tokens)
//   kv_down 2 x 128 x 48 x 256 = 3,145,728
//   q_up    2 x 256 x 96 x 64  = 3,145,728 (96 = 2 heads x 48 columns)
//   kv_up   2 x 256 x 128 x 32 = 2,097,152 (2 heads x (32 + 32))
//   attn_proj 2 x 256 x 256 x 64 = 8,388,608 (2 heads x 32)
//   QK^T 2 x 4 x 128 x 128 x 48 = 6,291,456 and AV x 32 = 4,194,304 (4 = 2 sequences x 2 heads)
// the latents gathered over the sequence (2 bytes x 256 x (64 + 32 + 16) = 57,344 bytes,
// against 131,072 for the hidden state), and each pass's GEMMs add up to the model's count.
TEST(Compute, MultiLatentAttentionProjections) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = model_from_json(Json::parse(R"({"num_layers":2,"hidden_size":256,"num_attention_heads":4,
      "vocab_size":512,"seq_length":128,"activation":"swiglu","ffn_hidden_size":512,"multi_latent_attention":true,
      "q_lora_rank":64,"kv_lora_rank":32,"qk_head_dim":32,"qk_pos_emb_head_dim":16,"v_head_dim":32})"), "model");
  const Plan p = load_plan("tp=2,sp=1,dp=4,mbs=2,precision=bf16,attention=unfused");
  const std::vector<OpCost> ops = layer_ops(m, c, p);
  auto fwd = [&](const char* n) { return sum_of(ops, n, Phase::forward, &OpCost::flops); };
  EXPECT_DOUBLE_EQ(fwd("q_down_proj"), 4194304.0);
  EXPECT_DOUBLE_EQ(fwd("kv_down_proj"), 3145728.0);
  EXPECT_DOUBLE_EQ(fwd("q_up_proj"), 3145728.0);
  EXPECT_DOUBLE_EQ(fwd("kv_up_proj"), 2097152.0);
  EXPECT_DOUBLE_EQ(fwd("attn_proj"), 8388608.0);
  EXPECT_DOUBLE_EQ(fwd("attn_scores"), 6291456.0);
  EXPECT_DOUBLE_EQ(fwd("attn_context"), 4194304.0);
  EXPECT_DOUBLE_EQ(fwd("qkv"), 0.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "q_up_proj", Phase::backward, &OpCost::flops), 2 * 3145728.0);  // dgrad, wgrad
  EXPECT_DOUBLE_EQ(sum_of(ops, "kv_down_proj", Phase::backward, &OpCost::flops), 2 * 3145728.0);
  EXPECT_DOUBLE_EQ(sum_of(ops, "sp_all_gather", Phase::forward, &OpCost::bytes), 57344.0 + 131072.0);  // + the MLP's
  // (The backward gathers the latents again and reduce-scatters their gradients.)
  EXPECT_DOUBLE_EQ(sum_of(ops, "sp_reduce_scatter", Phase::backward, &OpCost::bytes), 57344.0 + 131072.0);
  for (const char* plan : {"tp=2,sp=1,dp=4,mbs=2,precision=bf16,attention=unfused", "dp=8,mbs=1,attention=unfused"}) {
    const Plan q = load_plan(plan);
    const Sums sums = sum_ops(layer_ops(m, c, q));
    const double layer = m.layer_forward_flops(q.mbs) / static_cast<double>(q.t);
    EXPECT_NEAR(sums.gemm_flops[0] / layer, 1.0, 1e-12) << plan;
    EXPECT_NEAR(sums.gemm_flops[1] / (2 * layer), 1.0, 1e-12) << plan;
  }
  // Without sequence parallelism every rank runs the down projections on all T tokens, and
  // the latents' gradients are all-reduced (2 x 256 x 112 bytes) with the MLP's.
  const std::vector<OpCost> no_sp = layer_ops(m, c, load_plan("tp=2,dp=4,mbs=2,precision=bf16,attention=unfused"));
  EXPECT_DOUBLE_EQ(sum_of(no_sp, "q_down_proj", Phase::forward, &OpCost::flops), 2 * 4194304.0);
  EXPECT_DOUBLE_EQ(sum_of(no_sp, "sp_all_gather", Phase::forward, &OpCost::bytes), 0.0);
  EXPECT_DOUBLE_EQ(sum_of(no_sp, "tp_all_reduce", Phase::backward, &OpCost::bytes), 57344.0 + 131072.0);
  // recompute_modules mla_up_proj runs the up projections (and the latents' gather) again
  // before the backward; mlp the dense MLP: fc1 2 x 256 x 512 x 256 (SwiGLU: 2 x 512 columns
  // over 2 ranks) and fc2 2 x 256 x 256 x 256.
  const std::vector<OpCost> re =
      layer_ops(m, c, load_plan("tp=2,sp=1,dp=4,mbs=2,precision=bf16,attention=unfused,recompute_modules=mla_up_proj+mlp"));
  EXPECT_DOUBLE_EQ(sum_of(re, "q_up_proj", Phase::recompute, &OpCost::flops), 3145728.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "kv_up_proj", Phase::recompute, &OpCost::flops), 2097152.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "q_down_proj", Phase::recompute, &OpCost::flops), 0.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "fc1", Phase::recompute, &OpCost::flops), 67108864.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "fc2", Phase::recompute, &OpCost::flops), 33554432.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "attn_scores", Phase::recompute, &OpCost::flops), 0.0);  // (core_attn not asked)
  // Recomputed, the latents (not the rotary key: 2 x 256 x 96) are gathered again, with the
  // MLP's input; their norms (2 x 2 x 128 x 96) and the pre-MLP norm run again.
  EXPECT_DOUBLE_EQ(sum_of(re, "sp_all_gather", Phase::recompute, &OpCost::bytes), 49152.0 + 131072.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "latent_norms", Phase::recompute, &OpCost::bytes), 49152.0);
  EXPECT_DOUBLE_EQ(sum_of(re, "norm2", Phase::recompute, &OpCost::bytes), 131072.0);
}

TEST(Compute, WorkSplitsExposedCommunication) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("gpt3-175b");
  const Plan p = load_plan("tp=8,mbs=1,precision=fp16");
  std::vector<OpCost> ops;
  const LayerCost lc = layer_cost(m, c, p, compute_setup(m, c, p), &ops);
  double compute = 0, tp = 0;
  for (const auto& o : ops) {
    if (o.phase != Phase::forward) continue;
    (o.kind == OpKind::tp_comm ? tp : compute) += o.exposed_s;
  }
  EXPECT_NEAR(lc.forward.compute_s, compute, 1e-15);
  EXPECT_NEAR(lc.forward.tp_comm_s, tp, 1e-15);
  // Each all-reduce: 50.3 MB * 2*7/8 / 150 GB/s + 30 us.
  EXPECT_NEAR(tp, 2 * (30e-6 + 2048.0 * 12288 * 2 * 1.75 / 150e9), 1e-12);
}

// Activation offloading's copies, llama2-7b (memory_test: u = 2^25 bytes per tensor). The
// forward never waits for its copies out. The backward reloads a layer ahead, so a layer's
// copies back (qkv_linear 2u; core_attn + attn_proj 5u, O copied by both) hide behind one
// layer's backward: at 50 GB/s of PCIe nothing shows, at 0.25 GB/s most of them.
TEST(Compute, ActivationOffloadReloadsALayerAhead) {
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = testing::round_cluster_with_host();
  const double u = 33554432;
  auto cost = [&](const Cluster& cl, const std::string& plan, std::vector<OpCost>* ops = nullptr) {
    const Plan p = load_plan(plan);
    return layer_cost(m, cl, p, compute_setup(m, cl, p), ops);
  };
  const LayerCost plain = cost(c, "dp=1");
  const LayerCost hidden = cost(c, "dp=1,offload_modules=qkv_linear+core_attn+attn_proj");
  EXPECT_EQ(hidden.forward.total(), plain.forward.total());
  EXPECT_EQ(hidden.backward.total(), plain.backward.total());
  Cluster slow = c;
  slow.host.pcie_bandwidth_bytes_per_s = 0.25e9;
  const double bwd = plain.backward.total();
  ASSERT_GT(2 * u / 0.25e9, bwd);
  const LayerCost one = cost(slow, "dp=1,offload_modules=qkv_linear");
  EXPECT_EQ(one.forward.offload_s, 0);
  EXPECT_NEAR(one.backward.offload_s, 2 * u / 0.25e9 - bwd, 1e-12);
  std::vector<OpCost> ops;
  const LayerCost two = cost(slow, "dp=1,offload_modules=core_attn+attn_proj", &ops);
  EXPECT_NEAR(two.backward.offload_s, 5 * u / 0.25e9 - bwd, 1e-12);
  EXPECT_EQ(two.forward.offload_s, 0);
  int copies = 0;
  for (const OpCost& o : ops)
    if (o.kind == OpKind::offload) {
      ++copies;
      EXPECT_DOUBLE_EQ(o.bytes, 5 * u);
      EXPECT_DOUBLE_EQ(o.time_s, 5 * u / 0.25e9);
      EXPECT_DOUBLE_EQ(o.exposed_s, o.phase == Phase::backward ? two.backward.offload_s : 0.0);
    }
  EXPECT_EQ(copies, 2);
  // Half the layers offload, each whole: half the wait, on average.
  EXPECT_NEAR(cost(slow, "dp=1,offload_modules=core_attn+attn_proj,activation_offload_fraction=0.5").backward.offload_s,
              0.5 * two.backward.offload_s, 1e-12);
  // Selective recompute: the core's replay runs before its backward, more cover (and the
  // recomputed core moves nothing: attn_proj's u alone).
  const LayerCost sel_plain = cost(c, "dp=1,recompute=selective");
  const LayerCost sel = cost(slow, "dp=1,recompute=selective,offload_modules=core_attn+attn_proj");
  ASSERT_GT(sel_plain.recompute.total(), 0);
  EXPECT_NEAR(sel.backward.offload_s, u / 0.25e9 - sel_plain.backward.total() - sel_plain.recompute.total(), 1e-12);
  // The node's 8 ranks copying at once through 2 GB/s of host memory get 0.25 GB/s each.
  Cluster shared = c;
  shared.host.memory_bandwidth_bytes_per_s = 2e9;
  EXPECT_NEAR(cost(shared, "dp=8,offload_modules=core_attn+attn_proj").backward.offload_s, 5 * u / 0.25e9 - bwd, 1e-12);
  EXPECT_NEAR(cost(shared, "dp=1,offload_modules=core_attn+attn_proj").backward.offload_s,
              std::max(0.0, 5 * u / 2e9 - bwd), 1e-12);
  // The estimate sums what waits as activation_offload: 4 micro-batches of 32 layers.
  const Plan p = load_plan("dp=1,gbs=4,offload_modules=core_attn+attn_proj");
  const Estimate e = estimate(m, slow, p);
  ASSERT_TRUE(e.valid);
  EXPECT_NEAR(e.time.activation_offload, 4 * 32 * two.backward.offload_s, 1e-9);
  EXPECT_NEAR(estimate_to_json(e)["time_s"]["activation_offload"].get<double>(), e.time.activation_offload, 1e-12);
  EXPECT_FALSE(estimate_to_json(estimate(m, c, p))["time_s"].contains("activation_offload"));
}

TEST(Compute, OptimizerPasses) {
  const Cluster c = testing::round_cluster();
  // bf16: 46 bytes per updated parameter (norm, clip, Adam, copy to bf16) and 4 per local
  // gradient zeroed; 1e9 parameters sharded 8 ways at 1 TB/s: 46/8 ms + 4 ms.
  Plan p = load_plan("dp=8,zero=1");
  EXPECT_NEAR(optimizer_time(c.device, p, 4, 1e9 / 8, 1e9), 46e9 / 8 / 1e12 + 4e9 / 1e12, 1e-15);
  // bf16 main gradients (grad_reduce_in_fp32 false): their copy into fp32 first (2 + 4):
  // 52 bytes, and 2 per gradient zeroed.
  EXPECT_NEAR(optimizer_time(c.device, p, 2, 1e9 / 8, 1e9), 52e9 / 8 / 1e12 + 2e9 / 1e12, 1e-15);
  // fp16 adds the copy into fp32 main gradients and the unscale / overflow check: 60 bytes;
  // with fp32 main gradients (--accumulate-allreduce-grads-in-fp32) the unscale only: 54.
  p.precision = Precision::fp16;
  EXPECT_NEAR(optimizer_time(c.device, p, 2, 1e9, 1e9), 60e9 / 1e12 + 2e9 / 1e12, 1e-15);
  EXPECT_NEAR(optimizer_time(c.device, p, 4, 1e9, 1e9), 54e9 / 1e12 + 4e9 / 1e12, 1e-15);
  // fp32: 40 bytes.
  p.precision = Precision::fp32;
  EXPECT_NEAR(optimizer_time(c.device, p, 4, 1e9, 1e9), 40e9 / 1e12 + 4e9 / 1e12, 1e-15);
  // The precision-aware optimizer in bf16 (Transformer Engine's FusedAdam on the gradients
  // as they are): norm, clip and Adam read 4 g, the remainders (2), m and v (4 + 4) read and
  // written, the bf16 weights read and written: 16 + 20 + 4 = 40 bytes; with bf16 moments
  // 16 + 12 + 4 = 32; on bf16 gradients 8 + 20 + 4 = 32.
  p = load_plan("dp=8,zero=1,use_precision_aware_optimizer=1");
  EXPECT_NEAR(optimizer_time(c.device, p, 4, 1e9, 1e9), 40e9 / 1e12 + 4e9 / 1e12, 1e-15);
  EXPECT_NEAR(optimizer_time(c.device, p, 2, 1e9, 1e9), 32e9 / 1e12 + 2e9 / 1e12, 1e-15);
  p = load_plan("dp=8,zero=1,use_precision_aware_optimizer=1,exp_avg_dtype=bf16,exp_avg_sq_dtype=bf16");
  EXPECT_NEAR(optimizer_time(c.device, p, 4, 1e9, 1e9), 32e9 / 1e12 + 4e9 / 1e12, 1e-15);
  // What estimate() passes: the setup's main gradient bytes.
  const ModelSpec m = load_model("llama3-8b");
  EXPECT_EQ(compute_setup(m, c, load_plan("dp=8,precision=fp16")).grad_bytes, 2.0);
  EXPECT_EQ(compute_setup(m, c, load_plan("dp=8,precision=fp16,grad_reduce_in_fp32=1")).grad_bytes, 4.0);
  EXPECT_EQ(compute_setup(m, c, load_plan("dp=8,grad_reduce_in_fp32=0")).grad_bytes, 2.0);
  EXPECT_EQ(compute_setup(m, c, load_plan("dp=8")).grad_bytes, 4.0);
}

// The offloaded optimizer step: a host of 100 GB/s memory at 50 % and 10 GB/s PCIe at 50 %
// per device; 1e9 offloaded parameters per rank, 4 ranks on the node. bf16: fp32 gradients
// out (4 GB / 5 GB/s = 0.8 s), CPU Adam over the node's 4 shards at 36 bytes per parameter
// (gradient landed and read 4 + 4, master, m, v read and written 24, the bf16 copy written
// and read 2 + 2: 4 x 36 GB / 50 GB/s = 2.88 s), bf16 weights back (2 GB: 0.4 s).
TEST(Compute, OffloadedOptimizerStep) {
  Cluster c = testing::round_cluster();
  Plan p = load_plan("dp=8,zero=1,offload=1");
  EXPECT_EQ(offload_optimizer_time(c, p, 4, 1e9, 4), 0);  // no host: no offload
  c.host.memory_bytes = 1e12;
  c.host.memory_bandwidth_bytes_per_s = 100e9;
  c.host.memory_efficiency = 0.5;
  c.host.pcie_bandwidth_bytes_per_s = 10e9;
  c.host.pcie_efficiency = 0.5;
  EXPECT_NEAR(offload_optimizer_time(c, p, 4, 1e9, 4), 0.8 + 2.88 + 0.4, 1e-12);
  // fp32: fp32 weights back (4 bytes), 40 bytes on the host: 0.8 + 3.2 + 0.8 s.
  p.precision = Precision::fp32;
  EXPECT_NEAR(offload_optimizer_time(c, p, 4, 1e9, 4), 0.8 + 3.2 + 0.8, 1e-12);
  // fp16: fp16 gradients out (2 bytes), 32 bytes on the host: 0.4 + 2.56 + 0.4 s.
  p.precision = Precision::fp16;
  EXPECT_NEAR(offload_optimizer_time(c, p, 2, 1e9, 4), 0.4 + 2.56 + 0.4, 1e-12);
  EXPECT_EQ(offload_optimizer_time(c, p, 2, 0, 4), 0);
}

TEST(Compute, FlashAttentionIsCheaperThanUnfusedForLongSequences) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("llama2-7b", 8192);
  Plan pu = load_plan("tp=1,attention=unfused"), pf = load_plan("tp=1,attention=flash");
  const LayerCost u = layer_cost(m, c, pu, compute_setup(m, c, pu));
  const LayerCost f = layer_cost(m, c, pf, compute_setup(m, c, pf));
  EXPECT_LT(f.forward.total(), u.forward.total());
  EXPECT_LT(f.backward.total(), u.backward.total());
}

// The fused attention runs at the plan's attention peak on every stack: the 16-bit one in a
// bf16 plan (the strata executor's CUDA kernels on the tensor cores, flash_attention_tc.cu),
// the fp32 one in an fp32 plan. Round cluster: fp32 25, bf16 100 TFLOP/s, flash forward 0.5
// and backward 0.4 of the peak, 1 TB/s. Llama 2 7B at S = 8192, mbs 1: the forward computes
// 4 x 32 heads x 8192^2 x 128 x 1/2 (causal) = 1.759e12 FLOPs: 1.759e12 / (0.5 x 100e12) =
// 0.0352 s in bf16, / (0.5 x 25e12) = 0.1407 s in fp32; the backward 2.5 times the FLOPs at
// 0.4. (Its bytes, 2 x 8192 x 4096 x 4 x 4 at most, take well under a millisecond:
// compute-bound.)
TEST(Compute, FlashKernelsRunAgainstThePlansAttentionPeak) {
  Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("llama2-7b", 8192);
  auto flash = [&](const Plan& p, Phase ph) {
    std::vector<OpCost> ops;
    (void)layer_cost(m, c, p, compute_setup(m, c, p), &ops);
    for (const OpCost& o : ops)
      if (std::string(o.name) == "flash_attention" && o.phase == ph) return o;
    return OpCost{};
  };
  const Plan bf16 = load_plan("tp=1,mbs=1,precision=bf16,attention=flash");
  const Plan fp32 = load_plan("tp=1,mbs=1,precision=fp32,attention=flash");
  const double f = 4.0 * 32 * 8192.0 * 8192.0 * 128 * 0.5;
  for (bool strata : {true, false}) {
    SCOPED_TRACE(strata ? "strata stack" : "Megatron's stack");
    c.strata_stack = strata;
    EXPECT_DOUBLE_EQ(flash(bf16, Phase::forward).flops, f);
    EXPECT_DOUBLE_EQ(flash(bf16, Phase::forward).time_s, f / (0.5 * 100e12));
    EXPECT_DOUBLE_EQ(flash(bf16, Phase::backward).time_s, 2.5 * f / (0.4 * 100e12));
    EXPECT_DOUBLE_EQ(flash(fp32, Phase::forward).time_s, f / (0.5 * 25e12));
    EXPECT_DOUBLE_EQ(flash(fp32, Phase::backward).time_s, 2.5 * f / (0.4 * 25e12));
  }
}

// Where the strata executor's CUDA flash kernels run in fp32 on the CUDA cores its stack
// charges them against the fp32 peak in every precision: a head dim its tensor-core kernels
// are not built for (kv_channels 96: forward 4 x 32 x 8192^2 x 96 x 1/2 FLOPs), and a device
// without bf16 tensor cores (bf16 peak 0, as V100's: fp16 plan). Megatron's stack keeps the
// 16-bit peak. Round cluster as above.
TEST(Compute, StrataFlashFallsBackToTheFp32PeakWhereItsKernelsDo) {
  Cluster c = testing::round_cluster();
  ModelSpec m = load_model("llama2-7b", 8192);
  auto forward = [&](const ModelSpec& mm, const Plan& p) {
    std::vector<OpCost> ops;
    (void)layer_cost(mm, c, p, compute_setup(mm, c, p), &ops);
    for (const OpCost& o : ops)
      if (std::string(o.name) == "flash_attention" && o.phase == Phase::forward) return o.time_s;
    return 0.0;
  };
  const Plan bf16 = load_plan("tp=1,mbs=1,precision=bf16,attention=flash");
  const Plan fp16 = load_plan("tp=1,mbs=1,precision=fp16,attention=flash");
  m.kv_channels = 96;
  const double f96 = 4.0 * 32 * 8192.0 * 8192.0 * 96 * 0.5;
  c.strata_stack = true;
  EXPECT_DOUBLE_EQ(forward(m, bf16), f96 / (0.5 * 25e12));
  c.strata_stack = false;
  EXPECT_DOUBLE_EQ(forward(m, bf16), f96 / (0.5 * 100e12));
  m.kv_channels = 0;
  const double f = 4.0 * 32 * 8192.0 * 8192.0 * 128 * 0.5;
  c.device.peak_bf16_flops = 0;
  c.strata_stack = true;
  EXPECT_DOUBLE_EQ(forward(m, fp16), f / (0.5 * 25e12));
  c.strata_stack = false;
  EXPECT_DOUBLE_EQ(forward(m, fp16), f / (0.5 * 100e12));
}

// A sliding window of w keys on all layers: the fused kernel computes w S - w^2/2 of the
// S^2 pairs instead of S^2/2. Llama 2 7B at S = 8192, w = 2048: 2048/8192 - (1/4)^2/2 =
// 0.21875 of S^2, so the forward's flash FLOPs are 4 x 32 heads x 8192^2 x 128 x 0.21875
// (0.4375 of the causal block's); the unfused kernel computes the whole block either way.
TEST(Compute, SlidingWindowCutsTheFusedAttention) {
  const Cluster c = testing::round_cluster();
  ModelSpec m = load_model("llama2-7b", 8192);
  const Plan pf = load_plan("tp=1,attention=flash"), pu = load_plan("tp=1,attention=unfused");
  auto flash_flops = [&](const ModelSpec& mm) {
    std::vector<OpCost> ops;
    (void)layer_cost(mm, c, pf, compute_setup(mm, c, pf), &ops);
    for (const OpCost& o : ops)
      if (std::string(o.name) == "flash_attention" && o.phase == Phase::forward) return o.flops;
    return -1.0;
  };
  const double causal = flash_flops(m);
  m.window_size = 2048;
  m.window_layers = m.L;
  EXPECT_DOUBLE_EQ(m.causal_share(), 0.21875);
  EXPECT_DOUBLE_EQ(flash_flops(m), 4.0 * 32 * 8192.0 * 8192.0 * 128 * 0.21875);
  EXPECT_DOUBLE_EQ(flash_flops(m) / causal, 0.4375);
  // Half the layers windowed: the mean share, (0.21875 + 0.5) / 2.
  m.window_layers = m.L / 2;
  EXPECT_DOUBLE_EQ(m.causal_share(), 0.359375);
  ModelSpec full = m;
  full.window_size = 0;
  EXPECT_DOUBLE_EQ(layer_cost(m, c, pu, compute_setup(m, c, pu)).forward.total(),
                   layer_cost(full, c, pu, compute_setup(full, c, pu)).forward.total());
}

// Full recompute replays the forward: without an op list layer_cost copies the forward's
// costs instead of costing the replay again. The copy must be what the replay gives, to the
// bit, on every stack and with every parallel dimension that reaches the layer's ops.
TEST(Compute, FullRecomputeCopyIsTheReplay) {
  auto expect_same = [](const Work& x, const Work& y, const std::string& what) {
    EXPECT_EQ(x.compute_s, y.compute_s) << what;
    EXPECT_EQ(x.tp_comm_s, y.tp_comm_s) << what;
    EXPECT_EQ(x.cp_comm_s, y.cp_comm_s) << what;
    EXPECT_EQ(x.dp_comm_s, y.dp_comm_s) << what;
    EXPECT_EQ(x.tp_comm_all_s, y.tp_comm_all_s) << what;
    EXPECT_EQ(x.dp_comm_all_s, y.dp_comm_all_s) << what;
  };
  int cases = 0;
  for (const char* model : {"gpt3-175b", "llama3-70b", "gpt2-124m"}) {
    const ModelSpec m = load_model(model);
    for (const char* cluster : {"dgx-a100-80g", "dgx-h100-80g", "local-cpu"}) {
      for (const bool strata : {false, true}) {
        Cluster c = load_cluster(cluster);
        c.strata_stack = c.strata_stack || strata;
        for (const char* plan : {"tp=8,mbs=1,recompute=full", "tp=4,cp=2,mbs=2,sp=1,recompute=full,precision=bf16",
                                 "tp=2,dp=8,mbs=1,zero=3,recompute=full,attention=flash",
                                 "tp=1,mbs=4,recompute=full,precision=fp16,attention=unfused",
                                 "tp=8,mbs=1,sp=1,recompute=full,precision=fp8"}) {
          const Plan p = load_plan(plan);
          if (!check_plan(m, c, p).empty()) continue;
          const ComputeSetup cs = compute_setup(m, c, p);
          std::vector<OpCost> ops;
          const LayerCost copied = layer_cost(m, c, p, cs);
          const LayerCost replayed = layer_cost(m, c, p, cs, &ops);
          const std::string what = std::string(model) + " " + cluster + (strata ? " strata " : " ") + plan;
          expect_same(copied.forward, replayed.forward, what + " forward");
          expect_same(copied.recompute, replayed.recompute, what + " recompute");
          expect_same(copied.backward, replayed.backward, what + " backward");
          EXPECT_GT(copied.recompute.compute_s, 0) << what;
          ++cases;
        }
      }
    }
  }
  EXPECT_GE(cases, 40);
}

}  // namespace
}  // namespace strata
