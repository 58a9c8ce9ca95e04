// estimate(): the SPEC terms add up to the step time, simple cases reduce to sums of
// their parts, and the memory and time trends every planner relies on hold.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <random>
#include <sstream>
#include <tuple>

#include "costmodel/comm.h"
#include "costmodel/estimate.h"
#include "costmodel/report.h"
#include "test_cluster.h"

namespace strata {
namespace {

TEST(Estimate, TermsSumToTheStepTime) {
  const Cluster a100 = load_cluster("dgx-a100-80g"), h100 = load_cluster("dgx-h100-80g");
  const ModelSpec gpt = load_model("gpt3-175b"), llama = load_model("llama3-70b");
  const char* plans[] = {"tp=8,pp=16,dp=8,mbs=1,gbs=1536,recompute=full",
                         "tp=8,pp=8,dp=16,vp=2,mbs=1,gbs=1024,recompute=selective,sp=1,zero=1",
                         "tp=4,dp=256,mbs=2,gbs=1024,zero=3,recompute=selective,sp=1",
                         "tp=8,pp=4,cp=2,dp=4,mbs=1,gbs=256,zero=1,sp=1,overlap_grad_reduce=1",
                         "tp=2,pp=4,dp=8,mbs=2,gbs=256,schedule=gpipe,recompute=full"};
  for (const char* s : plans) {
    for (const Cluster* cl : {&a100, &h100}) {
      for (const ModelSpec* m : {&gpt, &llama}) {
        const Estimate e = estimate(*m, *cl, load_plan(s));
        ASSERT_TRUE(e.valid) << s;
        EXPECT_NEAR(e.time.sum(), e.step_time_s, 1e-9 * e.step_time_s) << s;
        EXPECT_GE(e.time.pipeline_bubble, 0.0);
        EXPECT_NEAR(e.tokens_per_s, static_cast<double>(e.plan.gbs) * m->S / e.step_time_s, 1e-6 * e.tokens_per_s);
        EXPECT_GT(e.mfu, 0.0);
        EXPECT_LT(e.mfu, 1.0);
      }
    }
  }
}

TEST(Estimate, SingleGpuIsASumOfItsParts) {
  const Cluster c = testing::round_cluster();
  const ModelSpec m = load_model("tiny-gpt");
  EstimateDetail d;
  const Estimate e = estimate(m, c, load_plan("mbs=4,gbs=8"), {}, &d);
  // Two micro-batches of (L layers + embedding + head) forward and backward, then Adam.
  const double fwd = 4 * d.layer.forward.total() + d.embedding.forward.total() + d.head.forward.total();
  const double bwd = 4 * d.layer.backward.total() + d.embedding.backward.total() + d.head.backward.total();
  EXPECT_NEAR(e.step_time_s, 2 * (fwd + bwd) + e.time.optimizer, 1e-12);
  EXPECT_EQ(e.time.tp_comm + e.time.pp_comm + e.time.dp_comm + e.time.pipeline_bubble, 0.0);
  EXPECT_EQ(e.microbatches, 2);
}

TEST(Estimate, MemoryTrends) {
  const Cluster c = load_cluster("dgx-a100-80g");
  const ModelSpec m = load_model("gpt3-175b");
  auto peak = [&](const char* s) { return estimate(m, c, load_plan(s)).memory.peak; };
  // GPipe keeps every micro-batch; 1F1B at most p.
  EXPECT_GT(peak("tp=8,pp=16,dp=8,gbs=512,schedule=gpipe"), peak("tp=8,pp=16,dp=8,gbs=512"));
  // Recompute and sequence parallelism shrink activations.
  EXPECT_GT(peak("tp=8,pp=16,dp=8,gbs=512"), peak("tp=8,pp=16,dp=8,gbs=512,recompute=selective"));
  EXPECT_GT(peak("tp=8,pp=16,dp=8,gbs=512,recompute=selective"), peak("tp=8,pp=16,dp=8,gbs=512,recompute=full"));
  EXPECT_GT(peak("tp=8,pp=16,dp=8,gbs=512"), peak("tp=8,pp=16,dp=8,gbs=512,sp=1"));
  // More pipeline stages: fewer layers per GPU.
  EXPECT_GT(peak("tp=8,pp=8,dp=16,gbs=512,recompute=full"), peak("tp=8,pp=16,dp=8,gbs=512,recompute=full"));
  // The interleaved schedule keeps more in flight than 1F1B.
  EXPECT_GT(estimate(m, c, load_plan("tp=8,pp=16,dp=8,gbs=512,vp=2")).memory.activations,
            estimate(m, c, load_plan("tp=8,pp=16,dp=8,gbs=512")).memory.activations);
}

TEST(Estimate, TimeTrends) {
  const Cluster c = load_cluster("dgx-a100-80g");
  const ModelSpec m = load_model("gpt3-175b");
  auto step = [&](const char* s) { return estimate(m, c, load_plan(s)).step_time_s; };
  // More micro-batches per step amortise the bubble; interleaving shrinks it.
  const Estimate few = estimate(m, c, load_plan("tp=8,pp=16,dp=8,gbs=128"));
  const Estimate many = estimate(m, c, load_plan("tp=8,pp=16,dp=8,gbs=1024"));
  EXPECT_GT(few.time.pipeline_bubble / few.step_time_s, many.time.pipeline_bubble / many.step_time_s);
  EXPECT_LT(estimate(m, c, load_plan("tp=8,pp=16,dp=8,gbs=512,vp=2")).time.pipeline_bubble,
            estimate(m, c, load_plan("tp=8,pp=16,dp=8,gbs=512")).time.pipeline_bubble);
  // Recompute costs time.
  EXPECT_LT(step("tp=8,pp=16,dp=8,gbs=512"), step("tp=8,pp=16,dp=8,gbs=512,recompute=full"));
  EXPECT_LT(step("tp=8,pp=16,dp=8,gbs=512,recompute=selective"), step("tp=8,pp=16,dp=8,gbs=512,recompute=full"));
  // Overlapping the gradient reduction never makes a step slower.
  EXPECT_LE(step("tp=8,pp=8,dp=16,gbs=512,overlap_grad_reduce=1"), step("tp=8,pp=8,dp=16,gbs=512"));
  // Tensor parallelism across nodes is slower than inside one.
  EXPECT_LT(step("tp=8,pp=16,dp=8,gbs=512"), step("tp=16,pp=8,dp=8,gbs=512"));
}

// A plan's own split (Megatron-LM's uneven pipeline options, layout.h) is the same model as
// strata's split when it names the same layers: every number alike. 96 layers on 8 stages x 3
// chunks: 4 per chunk; Llama 3 405B's 126 on 16 stages: 7 on the first and last, 8 between
// (strata's rule of a slot each for the embedding and the loss).
TEST(Estimate, AnExplicitSplitEqualToStrataSplitIsTheSameEstimate) {
  const Cluster a100 = load_cluster("dgx-a100-80g"), h100 = load_cluster("dgx-h100-80g");
  const std::vector<std::tuple<std::string, const Cluster*, std::string, std::string>> cases = {
      {"gpt3-175b", &a100, "tp=8,pp=8,dp=16,vp=3,mbs=1,gbs=1536,recompute=selective,sp=1",
       ",pipeline_model_parallel_layout=Et*4|(t*4|)*22,t*4L"},
      {"llama3-405b", &h100, "tp=8,pp=16,dp=8,mbs=1,gbs=512,zero=1,sp=1,precision=fp8",
       ",decoder_first_pipeline_num_layers=7,decoder_last_pipeline_num_layers=7"},
      {"llama3-405b", &h100, "tp=8,pp=16,dp=8,mbs=1,gbs=512,zero=1,sp=1,precision=fp8",
       ",pipeline_model_parallel_layout=Et*7|(t*8|)*14,t*7L"}};
  for (const auto& [model, cl, plan, split] : cases) {
    const ModelSpec m = load_model(model);
    const Estimate a = estimate(m, *cl, load_plan(plan)), b = estimate(m, *cl, load_plan(plan + split));
    ASSERT_TRUE(a.valid && b.valid) << plan << split;
    EXPECT_EQ(a.step_time_s, b.step_time_s) << plan << split;
    EXPECT_EQ(a.memory.peak, b.memory.peak) << plan << split;
    EXPECT_EQ(a.time.pipeline_bubble, b.time.pipeline_bubble) << plan << split;
  }
}

// A model that mixes dense and MoE layers (moe_layer_freq) costs each layer as its kind:
// with its first 8 of 16 layers dense, a pipeline of two stages runs the dense model's first
// stage and the all-MoE model's second, in time and in memory, with and without partial
// recompute (its first 2 layers of each chunk, dense on stage 0); interleaved over 2 chunks
// (layers 0-3, 8-11 on stage 0; 4-7, 12-15 on stage 1) the dense chunks are the dense
// model's and the MoE chunks the other's, and a stage holds half of each model's
// parameters. The model FLOPs are the two models' mean, and the search's top plans are
// those of the twin that estimates every plan (planner_test).
TEST(Estimate, DenseAndMoeLayersEachCostAsTheirKind) {
  const Json spec = Json::parse(R"x({"name":"mixed","num_layers":16,"hidden_size":2048,"num_attention_heads":16,
      "num_query_groups":4,"activation":"swiglu","ffn_hidden_size":5632,"vocab_size":32000,"seq_length":2048,
      "num_experts":16,"moe_router_topk":4,"moe_ffn_hidden_size":1408,"moe_layer_freq":"([0]*8+[1]*8)"})x");
  const ModelSpec m = model_from_json(spec, "model");
  ModelSpec all_moe = m;
  all_moe.moe_layer.clear();
  const ModelSpec dense = m.dense_layers();
  ASSERT_TRUE(m.mixed());
  const Cluster cl = load_cluster("dgx-a100-80g");
  for (const char* plan : {"tp=1,pp=2,dp=4,mbs=1,gbs=16,zero=1", "tp=2,pp=2,dp=2,mbs=2,gbs=16,zero=3,sp=1",
                           "tp=1,pp=2,dp=4,mbs=1,gbs=16,zero=1,recompute=full,recompute_num_layers=2",
                           "tp=1,pp=2,dp=4,mbs=1,gbs=16,zero=1,software_stack=modern,offload_modules=core_attn+qkv_linear",
                           "tp=1,pp=2,vp=2,dp=4,mbs=1,gbs=16,zero=1", "tp=1,pp=2,vp=2,dp=4,mbs=1,gbs=16,zero=2,recompute=selective"}) {
    const Plan p = load_plan(plan);
    EstimateDetail dm, dd, du;
    const Estimate em = estimate(m, cl, p, {}, &dm), ed = estimate(dense, cl, p, {}, &dd), eu = estimate(all_moe, cl, p, {}, &du);
    ASSERT_TRUE(em.valid && ed.valid && eu.valid) << plan;
    for (int64_t c = 0; c < p.v; ++c)
      for (int64_t s = 0; s < 2; ++s) {
        const size_t i = static_cast<size_t>(c * 2 + s);
        const bool dense_chunk = p.v == 1 ? s == 0 : c == 0;  // layers 0-7
        const EstimateDetail& like = dense_chunk ? dd : du;
        EXPECT_EQ(dm.stage_times.fwd_s[i], like.stage_times.fwd_s[i]) << plan << " chunk " << c << " stage " << s;
        EXPECT_EQ(dm.stage_times.bwd_s[i], like.stage_times.bwd_s[i]) << plan << " chunk " << c << " stage " << s;
      }
    EXPECT_DOUBLE_EQ(model_flops_per_step(m, p), (model_flops_per_step(dense, p) + model_flops_per_step(all_moe, p)) / 2) << plan;
    for (size_t s = 0; s < 2; ++s) {
      const MemoryBreakdown &mm = dm.stage_memory[s], &md = dd.stage_memory[s], &mu = du.stage_memory[s];
      if (p.v == 1) {
        const MemoryBreakdown& like = s == 0 ? md : mu;
        EXPECT_EQ(mm.params, like.params) << plan << " stage " << s;
        EXPECT_EQ(mm.weights, like.weights) << plan << " stage " << s;
        EXPECT_EQ(mm.gradients, like.gradients) << plan << " stage " << s;
        EXPECT_EQ(mm.optimizer_states, like.optimizer_states) << plan << " stage " << s;
        EXPECT_EQ(mm.activations, like.activations) << plan << " stage " << s;
        EXPECT_EQ(mm.comm_buffers, like.comm_buffers) << plan << " stage " << s;
        EXPECT_EQ(mm.peak, like.peak) << plan << " stage " << s;
        EXPECT_EQ(mm.host_activations, like.host_activations) << plan << " stage " << s;
      } else {
        EXPECT_DOUBLE_EQ(mm.params, (md.params + mu.params) / 2) << plan << " stage " << s;
        EXPECT_DOUBLE_EQ(mm.expert_params, mu.expert_params / 2) << plan << " stage " << s;
        // (Activations: the schedule walked with the dense and the MoE chunk's weights, between the two models'.)
        EXPECT_GT(mm.activations, std::min(md.activations, mu.activations)) << plan << " stage " << s;
        EXPECT_LT(mm.activations, std::max(md.activations, mu.activations)) << plan << " stage " << s;
      }
    }
  }
  // The layout's counts: chunk i = c p + s holds the i-th run of layers; with the first 3
  // layers dense and recompute_num_layers=1, the dense layers of each chunk and of its first.
  ModelSpec three = m;
  three.moe_layer.assign(16, 1);
  for (int l = 0; l < 3; ++l) three.moe_layer[static_cast<size_t>(l)] = 0;
  const StageLayout lay = make_layout(three, load_plan("pp=2,vp=4,dp=4,gbs=16,recompute=full,recompute_num_layers=1"));
  EXPECT_EQ(lay.dense, (std::vector<int64_t>{2, 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(lay.dense_recomputed, (std::vector<int64_t>{1, 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(lay.stage_dense(0), 2);
  EXPECT_EQ(lay.stage_dense(1), 1);
  EXPECT_TRUE(make_layout(all_moe, load_plan("pp=2,dp=4,gbs=16")).dense.empty());
}

// Megatron-Bridge's Llama 3 70B H100 FP8 recipe (TP4 PP8 VP5, batch 256) moves a layer off
// the last virtual stage, which also carries the 128k-vocabulary output layer, onto stage 3's
// last chunk: the last stage, the pipeline's bottleneck, holds 9 layers + the output layer
// instead of 10 + it, stage 3 holds 11. The bubble and the step shrink; stage 3 (11 layers
// of activations) now needs more memory than stage 7, and stage 0 keeps its peak.
TEST(Estimate, ALayoutThatBalancesTheOutputLayerShortensTheStep) {
  const ModelSpec m = load_model("llama3-70b");
  const Cluster cl = load_cluster("dgx-h100-80g");
  const std::string plan = "tp=4,pp=8,dp=2,mbs=1,gbs=256,sp=1,zero=1,precision=fp8";
  EstimateDetail even_d, own_d;
  const Estimate even = estimate(m, cl, load_plan(plan + ",vp=5"), {}, &even_d);
  const Estimate own =
      estimate(m, cl, load_plan(plan + ",pipeline_model_parallel_layout=Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"), {}, &own_d);
  ASSERT_TRUE(even.valid && own.valid);
  EXPECT_LT(own.step_time_s, even.step_time_s);
  EXPECT_LT(own.time.pipeline_bubble, even.time.pipeline_bubble);
  EXPECT_EQ(own_d.layout.stage_layers(7), 9);
  EXPECT_EQ(own_d.layout.stage_layers(3), 11);
  EXPECT_GT(own_d.stage_memory[3].peak, even_d.stage_memory[3].peak);
  EXPECT_LT(own_d.stage_memory[7].peak, even_d.stage_memory[7].peak);
  EXPECT_EQ(own.memory.peak, even.memory.peak);  // stage 0, unchanged, is still the most loaded
}

TEST(Estimate, InvalidPlansCarryReasons) {
  const Estimate e = estimate(load_model("gpt3-175b"), load_cluster("dgx-a100-80g"), load_plan("tp=7"));
  EXPECT_FALSE(e.valid);
  ASSERT_FALSE(e.reasons.empty());
  EXPECT_EQ(e.reasons[0].key, "tp_heads");
  EXPECT_EQ(estimate_to_json(e)["valid"], false);
}

TEST(Estimate, OutOfMemoryIsReportedNotHidden) {
  const Estimate e = estimate(load_model("gpt3-175b"), load_cluster("dgx-a100-80g"), load_plan("tp=8"));
  EXPECT_TRUE(e.valid);
  EXPECT_FALSE(e.fits);
  EXPECT_GT(e.memory.peak, 80.0 * (1 << 30));
}

TEST(Estimate, JsonHasTheSpecFields) {
  const Estimate e = estimate(load_model("llama2-7b"), load_cluster("dgx-h100-80g"), load_plan("tp=2,dp=4,gbs=64"));
  const Json j = estimate_to_json(e);
  for (const char* k : {"plan", "fits", "step_time_s", "tokens_per_s", "model_tflops_per_gpu",
                        "hardware_tflops_per_gpu", "mfu", "time_s", "memory_bytes"})
    EXPECT_TRUE(j.contains(k)) << k;
  for (const char* k : {"forward", "backward", "recompute", "optimizer", "tp_comm", "cp_comm", "pp_comm", "dp_comm",
                        "pipeline_bubble"})
    EXPECT_TRUE(j["time_s"].contains(k)) << k;
  for (const char* k : {"weights", "gradients", "optimizer_states", "activations", "comm_buffers",
                        "framework_overhead", "peak"})
    EXPECT_TRUE(j["memory_bytes"].contains(k)) << k;
  for (const char* k : {"tensor_parallel", "pipeline_parallel", "data_parallel", "context_parallel",
                        "virtual_pipeline_stages", "micro_batch_size", "global_batch_size", "zero_stage", "recompute",
                        "sequence_parallel", "precision", "pipeline_schedule"})
    EXPECT_TRUE(j["plan"].contains(k)) << k;
}

// Ranks sharing processors (estimate.h): 4 ranks of a node on 2 cores, the rates measured
// with all 4 busy (half a core each). A rank gets min(1, 2 / k) of a core while k are busy.
TEST(Estimate, RanksSharingProcessorsComputeFasterWhileOthersIdle) {
  const ModelSpec m = load_model("tiny-gpt");
  Cluster own = load_cluster("local-cpu");
  own.devices_per_node = 4;
  own.strata_stack = true;
  Cluster shared = own;
  shared.processors_per_node = 2;
  EXPECT_FALSE(own.shares_processors());
  EXPECT_TRUE(shared.shares_processors());
  EXPECT_DOUBLE_EQ(max_compute_speed(own), 1.0);
  EXPECT_DOUBLE_EQ(max_compute_speed(shared), 2.0);  // a rank alone: a whole core against half of one
  auto at = [&](const Cluster& c, const char* plan) { return estimate(m, c, load_plan(plan)); };

  // Four stages, one micro-batch: one stage computes at a time (the sends, counted busy, add
  // a little), so k <= 2 and each rank runs at a whole core: the estimate at twice the rates.
  const char* pipe = "pp=4,mbs=16,gbs=16,precision=fp32";
  const Estimate e = at(shared, pipe);
  ASSERT_TRUE(e.valid);
  EXPECT_DOUBLE_EQ(e.compute_speed, 2.0);
  EXPECT_GT(e.busy_ranks, 1.0);
  EXPECT_LT(e.busy_ranks, 1.1);
  EXPECT_EQ(e.ranks_per_node, 4.0);
  EXPECT_EQ(e.processors_per_node, 2.0);
  const Estimate twice = at(with_compute_speed(own, 2.0), pipe);
  EXPECT_DOUBLE_EQ(e.step_time_s, twice.step_time_s);
  EXPECT_DOUBLE_EQ(e.time.forward, twice.time.forward);
  EXPECT_DOUBLE_EQ(e.time.pp_comm, at(own, pipe).time.pp_comm);  // links unchanged
  EXPECT_LT(e.step_time_s, 0.6 * at(own, pipe).step_time_s);
  EXPECT_DOUBLE_EQ(e.memory.peak, at(own, pipe).memory.peak);
  // MFU against the device's own peak, not the faster pass's.
  EXPECT_NEAR(e.mfu, e.model_tflops_per_gpu * 1e12 / own.device.peak_fp32_flops, 1e-12);
  const Json j = estimate_to_json(e);
  EXPECT_EQ(j["processor_sharing"]["compute_speed"], 2.0);
  EXPECT_FALSE(estimate_to_json(at(own, pipe)).contains("processor_sharing"));

  // Four data-parallel ranks: all busy all the time (k = 4), as when the rates were measured.
  const char* flat = "dp=4,mbs=4,gbs=16,precision=fp32";
  EXPECT_DOUBLE_EQ(at(shared, flat).compute_speed, 1.0);
  EXPECT_DOUBLE_EQ(at(shared, flat).step_time_s, at(own, flat).step_time_s);
  // A fixed step overhead (validate --calibrate fits one) is work on every rank, not idle.
  Cluster slow = shared;
  slow.step_overhead_s = 0.05;
  EXPECT_DOUBLE_EQ(at(slow, flat).compute_speed, 1.0);
  // Two ranks on the node's two cores: a core each, whatever they do.
  EXPECT_DOUBLE_EQ(at(shared, "dp=2,mbs=8,gbs=16,precision=fp32").compute_speed, 2.0);

  // Two stages of two replicas: busy outside the fill and drain. The speed is its own fixed
  // point, s = min(1, 2 / k(s)) / (2 / 4), strictly between the two cases above.
  const Estimate mid = at(shared, "pp=2,dp=2,mbs=2,gbs=16,precision=fp32");
  EXPECT_GT(mid.compute_speed, 1.05);
  EXPECT_LT(mid.compute_speed, 1.95);
  EXPECT_NEAR(mid.compute_speed, std::min(1.0, 2.0 / mid.busy_ranks) * 2.0, 1e-8);
  EXPECT_LT(mid.step_time_s, at(own, "pp=2,dp=2,mbs=2,gbs=16,precision=fp32").step_time_s);

  // The cluster JSON carries the processors (written only where set); as many as the
  // devices is no sharing at all.
  EXPECT_EQ(cluster_to_json(shared)["processors_per_node"], 2);
  EXPECT_FALSE(cluster_to_json(own).contains("processors_per_node"));
  EXPECT_EQ(cluster_from_json(cluster_to_json(shared), "c").processors_per_node, 2);
  // Kernel kinds' curves (strata profile's) go through the JSON; the presets have none.
  EXPECT_FALSE(cluster_to_json(own).at("device").contains("kernel_efficiency"));
  Cluster kinds = own;
  kinds.device.kernel_efficiency[static_cast<int>(MemKind::round16)] = Curve({{1e3, 0.25}, {1e8, 0.75}});
  kinds.device.kernel_efficiency[static_cast<int>(MemKind::activation)] = Curve({{1e3, 0.5}});
  const Cluster back = cluster_from_json(cluster_to_json(kinds), "c");
  ASSERT_EQ(back.device.kernel_efficiency[static_cast<int>(MemKind::round16)].points().size(), 2u);
  EXPECT_DOUBLE_EQ(back.device.memory_curve(MemKind::round16).at(1e8), 0.75);
  EXPECT_DOUBLE_EQ(back.device.memory_curve(MemKind::activation).at(1e3), 0.5);
  EXPECT_TRUE(back.device.kernel_efficiency[static_cast<int>(MemKind::norm)].empty());
  Cluster four = own;
  four.processors_per_node = 4;
  EXPECT_FALSE(four.shares_processors());
  EXPECT_DOUBLE_EQ(at(four, pipe).step_time_s, at(own, pipe).step_time_s);
}

TEST(Estimate, TraceHasOneSlicePerStepAndStage) {
  const ModelSpec m = load_model("gpt3-175b");
  const Cluster c = load_cluster("dgx-a100-80g");
  EstimateOptions o;
  o.record_events = true;
  EstimateDetail d;
  const Estimate e = estimate(m, c, load_plan("tp=8,pp=4,dp=2,gbs=16,recompute=selective"), o, &d);
  std::stringstream ss;
  write_trace(ss, m, e, d);
  const Json t = Json::parse(ss.str());
  int fwd = 0, bwd = 0, rec = 0, opt = 0;
  for (const auto& ev : t["traceEvents"]) {
    const std::string n = ev["name"];
    fwd += n == "forward";
    bwd += n == "backward";
    rec += n == "layer recompute";
    opt += n == "optimizer";
    if (ev["ph"] == "X") {
      EXPECT_GE(ev["dur"].get<double>(), 0.0);
      EXPECT_TRUE(ev.contains("args"));
    }
  }
  // One process per rank (64), each with its stage's slices: p stages x m micro-batches
  // forwards and backwards over the 16 ranks of a stage, every layer's recompute inside its
  // backward per micro-batch, an optimizer step per rank.
  EXPECT_EQ(t["otherData"]["tracks"], "one process per rank");
  EXPECT_EQ(fwd, 4 * 8 * 16);
  EXPECT_EQ(bwd, 4 * 8 * 16);
  EXPECT_EQ(rec, 96 * 8 * 16);
  EXPECT_EQ(opt, 64);
  std::map<int64_t, std::string> names;
  for (const auto& ev : t["traceEvents"])
    if (ev["name"] == "process_name") names[ev["pid"].get<int64_t>()] = ev["args"]["name"];
  ASSERT_EQ(names.size(), 64u);
  EXPECT_EQ(names[0], "rank 0 (stage 0, predicted)");
  EXPECT_EQ(names[17], "rank 17 (stage 1, predicted)");  // (rank = tp + 8 (dp + 2 pp))
  // Past 64 ranks, one process per stage, its ranks named.
  EstimateDetail wide;
  const Estimate big = estimate(m, c, load_plan("tp=8,pp=4,dp=4,gbs=16,recompute=selective"), o, &wide);
  std::stringstream ws;
  write_trace(ws, m, big, wide);
  const Json w = Json::parse(ws.str());
  EXPECT_NE(w["otherData"]["tracks"].get<std::string>().find("per pipeline stage"), std::string::npos);
  int wide_fwd = 0, stages = 0;
  for (const auto& ev : w["traceEvents"]) {
    wide_fwd += ev["name"] == "forward";
    if (ev["name"] == "process_name") {
      EXPECT_EQ(ev["args"]["name"], "stage " + std::to_string(stages) + " (predicted, 32 ranks)");
      ++stages;
    }
  }
  EXPECT_EQ(stages, 4);
  EXPECT_EQ(wide_fwd, 4 * 4);  // (gbs 16 over dp 4: 4 micro-batches)
}

// Hardware FLOPs count what recompute_modules runs again: DeepSeek-V3, one sequence of
// 4096: mla_up_proj the up projections of all 61 layers and of its multi-token prediction
// module's layer, 62 x 2 x 4096 x (1536 x 24576 + 512 x 128 x 256) = 27,693,949,124,608; mlp
// the 3 dense layers' MLPs (the prediction module's layer is an MoE layer, as the last
// decoder layer), 3 x 2 x 4096 x 7168 x (36864 + 18432) = 9,740,985,827,328.
TEST(Estimate, HardwareFlopsOfRecomputedModules) {
  const ModelSpec m = load_model("deepseek-v3");
  const double base = hardware_flops_per_step(m, load_plan("dp=1,gbs=1,recompute=none"));
  EXPECT_DOUBLE_EQ(hardware_flops_per_step(m, load_plan("dp=1,gbs=1,recompute_modules=mla_up_proj")) - base,
                   27693949124608.0);
  EXPECT_DOUBLE_EQ(hardware_flops_per_step(m, load_plan("dp=1,gbs=1,recompute_modules=mlp")) - base, 9740985827328.0);
}

// Multi-token prediction runs with the output layer: on a Llama-style model of 4 layers with
// one module, pp 2, the last stage's forward of a micro-batch is its 2 layers', the module's
// layer's (a dense layer, as the last decoder layer) and the output layer's (which holds the
// module's other work); the trace draws the module's layer once per micro-batch there; the
// first stage is the model's without it.
TEST(Estimate, MultiTokenPredictionRunsWithTheOutputLayer) {
  const ModelSpec m = testing::llama_with_mtp(1), plain = testing::llama_with_mtp(0);
  const Cluster c = load_cluster("dgx-h100-80g");
  for (const char* plan : {"tp=2,pp=2,sp=1,dp=4,mbs=1,gbs=16", "tp=2,pp=2,sp=1,dp=4,mbs=1,gbs=16,recompute=full"}) {
    EstimateOptions o;
    o.record_events = true;
    o.want_ops = true;
    EstimateDetail d, dp;
    const Estimate e = estimate(m, c, load_plan(plan), o, &d);
    estimate(plain, c, load_plan(plan), o, &dp);
    ASSERT_TRUE(e.valid);
    EXPECT_DOUBLE_EQ(d.mtp_layer.forward.total(), d.layer.forward.total());
    EXPECT_NEAR(d.stage_times.f(1, 0), 2 * d.layer.forward.total() + d.mtp_layer.forward.total() + d.head.forward.total(),
                1e-15);
    EXPECT_NEAR(d.stage_times.b(1, 0),
                2 * (d.layer.backward.total() + d.layer.recompute.total()) + d.mtp_layer.backward.total() +
                    d.mtp_layer.recompute.total() + d.head.backward.total() + d.head.recompute.total(),
                1e-15)
        << plan;
    EXPECT_DOUBLE_EQ(d.stage_times.f(0, 0), dp.stage_times.f(0, 0));
    std::stringstream ss;
    write_trace(ss, m, e, d);
    const Json t = Json::parse(ss.str());
    int forwards = 0, backwards = 0;
    for (const auto& ev : t["traceEvents"]) {
      if (ev["name"] == "mtp layer forward") ++forwards;
      if (ev["name"] == "mtp layer backward") ++backwards;
    }
    EXPECT_EQ(forwards, 4 * 8);  // 16 / (1 x 4) micro-batches, on each of the last stage's 8 ranks
    EXPECT_EQ(backwards, 4 * 8);
  }
}

// A mixed model's trace draws each layer as its kind: on the mixed test model (8 dense
// layers, then 8 MoE layers), with a pipeline of one stage, layer 0's forward lasts the
// dense layer's forward, layer 8's the MoE layer's; --ops lists both layers' ops.
TEST(Estimate, TraceAndOpsOfAMixedModelTakeEachLayersKind) {
  const ModelSpec m = model_from_json(Json::parse(R"x({"name":"mixed","num_layers":16,"hidden_size":2048,
      "num_attention_heads":16,"num_query_groups":4,"activation":"swiglu","ffn_hidden_size":5632,"vocab_size":32000,
      "seq_length":2048,"num_experts":16,"moe_router_topk":4,"moe_ffn_hidden_size":1408,
      "moe_layer_freq":"([0]*8+[1]*8)"})x"), "model");
  EstimateOptions o;
  o.record_events = true;
  o.want_ops = true;
  EstimateDetail d;
  const Estimate e = estimate(m, load_cluster("dgx-a100-80g"), load_plan("dp=8,gbs=8,zero=1,recompute=full"), o, &d);
  ASSERT_TRUE(e.valid);
  // (The router, the permutations and the experts' grouped GEMMs against one MLP of 5632.)
  ASSERT_GT(std::abs(d.layer.forward.total() - d.dense_layer.forward.total()) * 1e6, 100.0);
  std::stringstream ss;
  write_trace(ss, m, e, d);
  const Json t = Json::parse(ss.str());
  int seen = 0;
  for (const auto& ev : t["traceEvents"]) {
    if (ev["name"] != "layer forward" || ev["args"]["microbatch"] != 0 || ev["pid"] != 0) continue;  // (rank 0's)
    const int64_t l = ev["args"]["layer"];
    const double expected = (l < 8 ? d.dense_layer : d.layer).forward.total() * 1e6;
    EXPECT_NEAR(ev["dur"].get<double>(), expected, 2e-3) << "layer " << l;
    ++seen;
  }
  EXPECT_EQ(seen, 16);
  const std::string ops = format_layer_ops(d);
  EXPECT_NE(ops.find("one MoE layer"), std::string::npos) << ops;
  EXPECT_NE(ops.find("one dense layer"), std::string::npos) << ops;
  EXPECT_NE(ops.find("router"), std::string::npos) << ops;
  // A layout made from the layer count alone is counted by the memory model itself.
  const Plan p = load_plan("pp=2,dp=4,gbs=8,zero=1");
  EXPECT_EQ(stage_params(m, p, make_layout(m.L, p), 0), stage_params(m, p, make_layout(m, p), 0));
  EXPECT_NE(stage_params(m, p, make_layout(m, p), 0), stage_params(m, p, make_layout(m, p), 1));
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Hand-derived terms on the round cluster (test_cluster.h, legacy stack): GPT-3 175B.
struct RoundGpt3 : ::testing::Test {
  ModelSpec m = load_model("gpt3-175b");
  Cluster c = testing::round_cluster();
  double h = 12288, s = 2048;
};

TEST_F(RoundGpt3, CommunicationBuffers) {
  // Pipeline: send and receive buffers in both directions, 4 x e*T*H = 4*2*2048*12288.
  Plan p = load_plan("tp=8,pp=2");
  EXPECT_DOUBLE_EQ(estimate(m, c, p).memory.comm_buffers, 4.0 * 2 * s * h);
  // ZeRO-3: the gathered layer and its prefetched successor in bf16, one layer of fp32
  // gradients to reduce-scatter.
  p = load_plan("tp=8,dp=8,zero=3");
  const double lp = static_cast<double>(m.layer_params(8));
  EXPECT_DOUBLE_EQ(estimate(m, c, p).memory.comm_buffers, 2.0 * 2 * lp + 4.0 * lp);
  // ZeRO-1 on a legacy stack: DeepSpeed's reduce and all-gather buckets of 5e8 elements
  // (fp32 gradients, bf16 parameters).
  p = load_plan("tp=8,pp=16,dp=8,zero=1");
  EXPECT_DOUBLE_EQ(estimate(m, c, p).memory.comm_buffers, 4.0 * 2 * s * h + 5e8 * (4 + 2));
}

TEST_F(RoundGpt3, PipelineSendAcrossNodes) {
  // t = 8, d = 8: neighbouring stages are 64 ranks apart, on different nodes. Each tensor-
  // parallel rank sends 1/8 of the 2*2048*12288-byte activation over its NIC share
  // (12.5 GB/s per device x 80 % = 10 GB/s, 10 us), then the eight all-gather it over NVLink
  // (7/8 of it at 150 GB/s, 3 steps of 5 us).
  const Plan p = load_plan("tp=8,pp=2,dp=8,gbs=8");
  const double act = 2.0 * s * h;
  const double expect = 10e-6 + act / 8 / 10e9 + 15e-6 + act * 7 / 8 / 150e9;
  EXPECT_NEAR(p2p_time(m, c, p, compute_setup(m, c, p)), expect, 1e-15);
}

TEST_F(RoundGpt3, ExposedDataParallelReductionAndShardedOptimizer) {
  // One stage, tp 8 x dp 8 = 64 GPUs: the data-parallel group has one member per node.
  // Legacy stack: the fp32 gradients (4 bytes) of every parameter on the GPU are
  // all-reduced after the last backward, fully exposed: busbw 10 GB/s, 2*7/8 of the bytes,
  // latency 2*3 steps of 10 us.
  Plan p = load_plan("tp=8,dp=8,gbs=8");
  Estimate e = estimate(m, c, p);
  const double P = e.memory.params;
  EXPECT_NEAR(e.time.dp_comm, 60e-6 + 4.0 * P * 1.75 / 10e9, 1e-9);
  EXPECT_NEAR(e.time.optimizer, optimizer_time(c.device, p, 4, P, P), 1e-15);
  // ZeRO-1: reduce-scatter of the gradients, all-gather of the bf16 weights, Adam on 1/8.
  p = load_plan("tp=8,dp=8,gbs=8,zero=1");
  e = estimate(m, c, p);
  EXPECT_NEAR(e.time.dp_comm, 2 * 30e-6 + (4.0 + 2.0) * P * 0.875 / 10e9, 1e-9);
  EXPECT_NEAR(e.time.optimizer, optimizer_time(c.device, p, 4, P / 8, P), 1e-15);
  // Gradients reduced in bf16 (grad_reduce_in_fp32 false): half the bytes, all-reduced or
  // reduce-scattered; the weights' all-gather as before.
  EXPECT_NEAR(estimate(m, c, load_plan("tp=8,dp=8,gbs=8,grad_reduce_in_fp32=0")).time.dp_comm,
              60e-6 + 2.0 * P * 1.75 / 10e9, 1e-9);
  EXPECT_NEAR(estimate(m, c, load_plan("tp=8,dp=8,gbs=8,zero=1,grad_reduce_in_fp32=0")).time.dp_comm,
              2 * 30e-6 + (2.0 + 2.0) * P * 0.875 / 10e9, 1e-9);
  // Half of the ZeRO-1 shard offloaded: the GPU's optimizer steps the other half, the host
  // the offloaded half for the node's 8 ranks; the host holds 16 bytes per offloaded
  // parameter for each of them (12 of state, 4 of fp32 gradient).
  {
    Cluster h = c;
    h.host = Host{1e12, 100e9, 0.5, 10e9, 0.5};
    Plan q = load_plan("tp=8,dp=8,gbs=8,zero=1,offload=0.5");
    const Estimate o = estimate(m, h, q);
    ASSERT_TRUE(o.valid);
    EXPECT_NEAR(o.time.optimizer,
                optimizer_time(h.device, q, 4, P / 8 - 0.5 * P / 8, P) + offload_optimizer_time(h, q, 4, 0.5 * P / 8, 8),
                1e-12 * o.time.optimizer);
    EXPECT_NEAR(o.host_memory_bytes, 8 * 16 * 0.5 * P / 8, 1e-6 * o.host_memory_bytes);
    EXPECT_NEAR(o.memory.optimizer_states, 0.5 * 12 * P / 8, 1e-6 * o.memory.optimizer_states);
    EXPECT_EQ(o.fits, o.memory.peak <= h.device.memory_bytes);
    h.host.memory_bytes = 0.99 * o.host_memory_bytes;  // the node's host memory cannot hold them
    EXPECT_FALSE(estimate(m, h, q).fits);
    const Json j = estimate_to_json(o);
    EXPECT_EQ(j["plan"]["optimizer_offload_fraction"], 0.5);
    EXPECT_EQ(j["host_memory_bytes"]["per_node"], std::llround(o.host_memory_bytes));
  }
  // Overlapped (explicitly): what the last micro-batch's backward hides is gone, less the
  // 10 %-of-hidden contention cost the round cluster sets to zero.
  p = load_plan("tp=8,dp=8,gbs=8,overlap_grad_reduce=1");
  EXPECT_LT(estimate(m, c, p).time.dp_comm, 60e-6 + 4.0 * P * 1.75 / 10e9);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Hybrid sharding (num_distributed_optimizer_instances = 2): tp 8 x dp 16 = 128 GPUs, the
// 16 replicas one per node. ZeRO-1 shards over each instance's 8 consecutive replicas (8
// nodes: 10 GB/s busbw, 3 steps of 10 us), whose shards' gradients (1/8 of them) are then
// all-reduced between the 2 instances (2 nodes: 1 step each way); the weights are gathered
// within the instance. Each rank keeps and steps 1/8 of the optimizer, as with dp 8.
TEST_F(RoundGpt3, HybridShardingReducesWithinAndBetweenInstances) {
  const Plan p = load_plan("tp=8,dp=16,gbs=16,zero=1,num_distributed_optimizer_instances=2");
  const Estimate e = estimate(m, c, p);
  ASSERT_TRUE(e.valid);
  const double P = e.memory.params;
  const double rs = 30e-6 + 4.0 * P * 0.875 / 10e9, ar = 20e-6 + 4.0 * P / 8 / 10e9, ag = 30e-6 + 2.0 * P * 0.875 / 10e9;
  EXPECT_NEAR(e.time.dp_comm, rs + ar + ag, 1e-9);
  EXPECT_NEAR(e.time.optimizer, optimizer_time(c.device, p, 4, P / 8, P), 1e-15);
  const Estimate eight = estimate(m, c, load_plan("tp=8,dp=8,gbs=8,zero=1"));
  EXPECT_DOUBLE_EQ(e.memory.optimizer_states, eight.memory.optimizer_states);
  EXPECT_DOUBLE_EQ(e.memory.optimizer_states, 12 * P / 8);
  // Without instances the 16 replicas shard 1/16 each, over 16 nodes (4 steps).
  const Estimate all = estimate(m, c, load_plan("tp=8,dp=16,gbs=16,zero=1"));
  EXPECT_NEAR(all.time.dp_comm, 40e-6 + 4.0 * P * 15 / 16 / 10e9 + 40e-6 + 2.0 * P * 15 / 16 / 10e9, 1e-9);
  EXPECT_DOUBLE_EQ(all.memory.optimizer_states, 12 * P / 16);
  // ZeRO-3: every layer's shard of its gradient is all-reduced between the instances each
  // micro-batch, after its reduce-scatter: 4 bytes x layer parameters / 8, over 2 nodes.
  const Plan z3 = load_plan("tp=8,dp=16,gbs=16,zero=3,num_distributed_optimizer_instances=2");
  std::vector<OpCost> ops;
  layer_cost(m, c, z3, compute_setup(m, c, z3), &ops);
  const double lp = static_cast<double>(m.layer_params(8));
  int found = 0;
  for (const OpCost& o : ops)
    if (o.name == "hsdp_all_reduce") {
      ++found;
      EXPECT_EQ(o.phase, Phase::backward);
      EXPECT_DOUBLE_EQ(o.bytes, 4.0 * lp / 8);
      EXPECT_NEAR(o.time_s, 20e-6 + 4.0 * lp / 8 / 10e9, 1e-15);
    } else if (o.name == "zero3_reduce_scatter" || o.name == "zero3_all_gather") {
      EXPECT_NEAR(o.time_s, 30e-6 + o.bytes * 0.875 / 10e9, 1e-15) << o.name;  // within the instance: 8 ranks
    }
  EXPECT_EQ(found, 1);
  EXPECT_DOUBLE_EQ(estimate(m, c, z3).memory.weights, 2.0 * estimate(m, c, z3).memory.params / 8);
  // ZeRO-2 too: each layer's reduce-scattered shard, all-reduced between the instances.
  const Plan z2 = load_plan("tp=8,dp=16,gbs=16,zero=2,num_distributed_optimizer_instances=2");
  ops.clear();
  layer_cost(m, c, z2, compute_setup(m, c, z2), &ops);
  found = 0;
  for (const OpCost& o : ops)
    if (o.name == "hsdp_all_reduce") {
      ++found;
      EXPECT_DOUBLE_EQ(o.bytes, 4.0 * lp / 8);
    }
  EXPECT_EQ(found, 1);
}

// The groups' placement: tp 1 x dp 16 with 2 instances, each instance's 8 replicas one
// node (NVLink: 150 GB/s busbw, 3 steps of 5 us), the instances on two nodes (10 GB/s, an
// all-reduce's 2 steps of 10 us).
TEST_F(RoundGpt3, HybridShardingInstancesInsideANode) {
  const Estimate e = estimate(m, c, load_plan("dp=16,gbs=16,zero=1,num_distributed_optimizer_instances=2"));
  ASSERT_TRUE(e.valid);
  const double P = e.memory.params;
  EXPECT_NEAR(e.time.dp_comm,
              (15e-6 + 4.0 * P * 0.875 / 150e9) + (20e-6 + 4.0 * P / 8 / 10e9) + (15e-6 + 2.0 * P * 0.875 / 150e9),
              1e-9);
}

// Experts with one replica per instance: qwen3-30b-a3b, dp 16, ep 8 (the experts' 2 replicas
// 8 ranks apart), 2 instances. The dense parameters shard over each instance's 8 replicas
// (one node); the experts' gradients, unsharded, are all-reduced whole between the two.
TEST(Estimate, HybridShardingWithOneExpertReplicaPerInstance) {
  const ModelSpec q = load_model("qwen3-30b-a3b");
  const Cluster c = testing::round_cluster();
  const Plan p = load_plan("dp=16,ep=8,gbs=16,zero=1,num_distributed_optimizer_instances=2");
  const Estimate e = estimate(q, c, p);
  ASSERT_TRUE(e.valid) << (e.reasons.empty() ? "" : e.reasons[0].message);
  const double P = e.memory.params, Pe = e.memory.expert_params, Pd = P - Pe;
  ASSERT_GT(Pe, 0);
  const double dense = (15e-6 + 4.0 * Pd * 0.875 / 150e9) + (20e-6 + 4.0 * Pd / 8 / 10e9) + (15e-6 + 2.0 * Pd * 0.875 / 150e9);
  const double experts = 20e-6 + 4.0 * Pe / 10e9;
  EXPECT_NEAR(e.dp_comm_total_s, dense + experts, 1e-9);  // (before overlap: the modern stack hides most of it)
  EXPECT_NEAR(e.memory.optimizer_states, 12.0 * (Pd / 8 + Pe), 1e-3 * e.memory.optimizer_states);
}

TEST_F(RoundGpt3, PartialRecomputeSitsBetweenNoneAndFull) {
  // tp 8, pp 8: 12 layers per stage; stage 0 of 1F1B keeps 8 micro-batches in flight.
  // Recomputing 4 of the 12 layers keeps the other 8 whole: activations grow over full
  // recompute by 8 micro-batches x 8 layers x (whole layer - its input), less the one
  // rebuilt layer full recompute adds to its working set (partial recompute reaches its
  // recomputed layers after the backward freed the 8 whole ones).
  const Plan full = load_plan("tp=8,pp=8,gbs=64,recompute=full,precision=fp16");
  const Plan part = load_plan("tp=8,pp=8,gbs=64,recompute=full,recompute_num_layers=4,precision=fp16");
  const Plan none = load_plan("tp=8,pp=8,gbs=64,precision=fp16");
  const Estimate ef = estimate(m, c, full), ep = estimate(m, c, part), en = estimate(m, c, none);
  ASSERT_TRUE(ep.valid);
  const double t = 8, a = 96, whole = s * h * (10 + 24 / t + 5 * a * s / (h * t)), input = 2 * s * h;
  EXPECT_NEAR(ep.memory.activations - ef.memory.activations, 8 * 8 * (whole - input) - whole, 1.0);
  EXPECT_LT(en.step_time_s, ep.step_time_s);
  EXPECT_LT(ep.step_time_s, ef.step_time_s);
  // Recompute time scales with the layers recomputed: 4 of 12.
  EXPECT_NEAR(ep.time.recompute / ef.time.recompute, 4.0 / 12.0, 1e-9);
  // recompute_num_layers needs full recompute.
  EXPECT_FALSE(estimate(m, c, load_plan("tp=8,pp=8,gbs=64,recompute=selective,recompute_num_layers=2")).valid);
}

// Invariants every estimate must keep, over random plans of the presets (valid ones only):
// the terms add up; a GPU twice as fast in every precision, links twice as fast (at half
// the latency) or memory twice as fast never make a step slower; a higher ZeRO stage never
// holds more model state, and with one replica it changes nothing; more recompute never
// needs more memory nor takes less time; twice the global batch takes longer, but at most
// twice as long.
TEST(Estimate, RandomPlansKeepTheInvariants) {
  std::mt19937_64 rng(7);
  const char* models[] = {"gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b", "llama2-7b", "gpt2-124m"};
  const char* clusters[] = {"dgx-a100-80g", "dgx-a100-40g", "dgx-h100-80g", "dgx-h200-141g", "dgx-b200-180g",
                            "dgx2-v100-32g"};
  auto pick = [&](const auto& options) { return options[rng() % std::size(options)]; };
  const int64_t tps[] = {1, 2, 4, 8}, pps[] = {1, 2, 4, 8, 16}, dps[] = {1, 2, 4, 8, 64}, cps[] = {1, 1, 1, 2, 4};
  const int64_t mbss[] = {1, 2, 4}, steps[] = {1, 2, 8, 32};
  const Precision precisions[] = {Precision::bf16, Precision::fp16, Precision::fp8};
  int checked = 0;
  for (int it = 0; it < 1500; ++it) {
    const ModelSpec m = load_model(pick(models));
    const Cluster cl = load_cluster(pick(clusters));
    Plan p;
    p.t = pick(tps), p.p = pick(pps), p.d = pick(dps), p.c = pick(cps), p.mbs = pick(mbss);
    p.v = p.p > 1 && rng() % 3 == 0 ? 2 : 1;
    p.gbs = p.mbs * p.d * pick(steps);
    p.zero = static_cast<int>(rng() % 4);
    p.recompute = static_cast<Recompute>(rng() % 3);
    p.sp = p.t > 1 && rng() % 2;
    p.precision = pick(precisions);
    p.gpipe = p.v == 1 && rng() % 5 == 0;
    const Estimate e = estimate(m, cl, p);
    if (!e.valid) continue;
    ++checked;
    const std::string what = m.name + " on " + cl.name + ": " + plan_to_inline(p);
    ASSERT_TRUE(std::isfinite(e.step_time_s) && e.step_time_s > 0) << what;
    EXPECT_NEAR(e.time.sum(), e.step_time_s, 1e-9 * e.step_time_s) << what;
    for (const auto& [name, v] : time_terms(e.time)) EXPECT_GE(v, 0.0) << what << " " << name;
    double sum = 0;
    for (const auto& [name, v] : memory_terms(e.memory)) {
      EXPECT_GE(v, 0.0) << what << " " << name;
      if (std::string(name) != "peak") sum += v;
    }
    EXPECT_NEAR(sum, e.memory.peak, 1e-9 * e.memory.peak) << what;
    EXPECT_EQ(e.fits, e.memory.peak <= cl.device.memory_bytes) << what;

    Cluster fast = cl;
    for (double* peak : {&fast.device.peak_fp32_flops, &fast.device.peak_tf32_flops, &fast.device.peak_bf16_flops,
                         &fast.device.peak_fp16_flops, &fast.device.peak_fp8_flops})
      *peak *= 2;
    EXPECT_LE(estimate(m, fast, p).step_time_s, e.step_time_s * (1 + 1e-9)) << what << ": a faster GPU is slower";
    Cluster links = cl, hbm = cl;
    links.intra.bandwidth_bytes_per_s *= 2, links.inter.bandwidth_bytes_per_s *= 2;
    links.intra.latency_s /= 2, links.inter.latency_s /= 2;
    hbm.device.memory_bandwidth_bytes_per_s *= 2;
    EXPECT_LE(estimate(m, links, p).step_time_s, e.step_time_s * (1 + 1e-9)) << what << ": faster links are slower";
    EXPECT_LE(estimate(m, hbm, p).step_time_s, e.step_time_s * (1 + 1e-9)) << what << ": faster memory is slower";

    if (p.zero < 3) {
      Plan q = p;
      ++q.zero;
      const Estimate f = estimate(m, cl, q);
      auto state = [](const MemoryBreakdown& b) { return b.weights + b.gradients + b.optimizer_states; };
      if (f.valid) {
        EXPECT_LE(state(f.memory), state(e.memory) * (1 + 1e-12)) << what << ": zero " << q.zero;
      }
      // (but for fp8 from ZeRO 0 to 1: the distributed optimizer brings fp8 parameters,
      // --fp8-param-gather, 1 byte a weight instead of bf16's 2)
      if (f.valid && p.replicas() == 1) {
        EXPECT_EQ(f.step_time_s, e.step_time_s) << what << ": one replica, zero " << q.zero;
        if (p.precision == Precision::fp8 && p.zero == 0)
          EXPECT_LT(f.memory.peak, e.memory.peak) << what;
        else
          EXPECT_EQ(f.memory.peak, e.memory.peak) << what << ": one replica, zero " << q.zero;
      }
    }
    if (p.recompute != Recompute::full) {
      Plan q = p;
      q.recompute = static_cast<Recompute>(static_cast<int>(p.recompute) + 1);
      const Estimate f = estimate(m, cl, q);
      // The live bytes never grow; the allocator's reserve may, by the larger fraction what
      // recomputed layers keep takes (allocator_fragmentation against _saved): a stage of a
      // layer or two keeps little less under full recompute than under selective. Every
      // activation byte takes at least the saved fraction and at most the other, so the
      // peak grows by at most their difference on the new activations.
      auto live = [](const MemoryBreakdown& b) { return b.peak - b.framework_overhead; };
      if (f.valid) {
        EXPECT_LE(live(f.memory), live(e.memory) * (1 + 1e-12)) << what << ": more recompute";
        const double spread = cl.allocator_fragmentation - cl.allocator_fragmentation_saved;
        EXPECT_LE(f.memory.peak, (e.memory.peak + spread * f.memory.activations) * (1 + 1e-12))
            << what << ": more recompute";
        EXPECT_GE(f.step_time_s, e.step_time_s * (1 - 1e-9)) << what << ": more recompute";
      }
    }
    Plan q = p;
    q.gbs *= 2;
    const Estimate f = estimate(m, cl, q);
    if (f.valid) {
      EXPECT_GT(f.step_time_s, e.step_time_s) << what << ": twice the batch";
      EXPECT_LE(f.step_time_s, 2 * e.step_time_s * (1 + 1e-9)) << what << ": twice the batch";
    }
  }
  EXPECT_GT(checked, 800);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Megatron-core's default gradient bucket is max(40M, 1M x the data-parallel size)
// parameters. gpt2-124m (124.5M parameters) on 128 replicas: one bucket of 128M holds them
// all, so the whole all-reduce waits for the last backward, exposed (the round cluster
// charges nothing for hidden communication, and without ZeRO there is no gather). On 32
// replicas the 40M buckets start during the backward and less is exposed.
TEST(DataParallelTail, MegatronBucketGrowsWithTheDataParallelGroup) {
  const ModelSpec m = load_model("gpt2-124m");
  const Cluster c = testing::round_cluster();
  for (const int64_t d : {128, 32}) {
    const Plan p = load_plan(fmt::format("dp={},gbs={},overlap_grad_reduce=1", d, d));
    const Estimate e = estimate(m, c, p);
    ASSERT_TRUE(e.valid);
    const double P = e.memory.params;
    ASSERT_GT(P, 40e6);
    ASSERT_LT(P, 128e6);
    const double reduce = collective_time(c, group_span(d, 1, c.devices_per_node), Collective::all_reduce,
                                          compute_setup(m, c, p).grad_bytes * P);
    if (d == 128)
      EXPECT_NEAR(e.time.dp_comm, reduce, 1e-12 * reduce);
    else
      EXPECT_LT(e.time.dp_comm, 0.99 * reduce);
  }
}

}  // namespace
}  // namespace strata
