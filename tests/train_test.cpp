// `strata train` through mpirun: every parallel plan trains the same model as one rank
// (loss per step within 1e-5 relative, gathered parameters within 1e-5, replicas
// identical), mixed precision tracks fp32, fp16 loss scaling skips overflowing steps,
// the JSON and trace have what SPEC.md names, and bad input exits 2 on every rank.
// Runs use --seq-length 32 or 64 so the whole file stays a few minutes on two cores.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "costmodel/estimate.h"
#include "costmodel/stack.h"
#include "executor/fault.h"
#include "executor/op_log.h"
#include "train_runner.h"

namespace {

using namespace strata_test;

// The equivalence matrix trains 10 steps in Release. Under the sanitizers (each step ~3x
// slower, and the 2 x 25 runs were the long pole of CI) 4 steps run the same code paths --
// every plan still takes several optimizer steps with accumulated state -- and the Release
// ctest of make test checks the full 10 steps.
#ifdef STRATA_UNDER_SANITIZER
constexpr int kSteps = 4;  // the loss falls from 6.26 to 5.0 (gpt) and 5.4 (llama) by step 4
#else
constexpr int kSteps = 10;
#endif
const std::string kShort = "--seq-length 64";
// The equivalence matrix (2 x 25 runs): a learning rate at which 10 steps train smoothly.
// (At 1e-3 with one warm-up step, tiny-llama's loss spikes at step 5 and amplifies float
// rounding differences of 1e-10 at step 1 to 1e-5 by step 10 -- chaos, not a bug.)
const std::string kTiny = "--seq-length 32 --lr 5e-4 --lr-warmup-iters 3";

// Single-rank runs, by model and global batch, computed once.
const TrainRun& reference(const std::string& model, const std::string& gbs) {
  static std::map<std::string, TrainRun> cache;
  const std::string key = model + gbs;
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, train(model, "mbs=1,gbs=" + gbs + ",precision=fp32", kSteps, kTiny)).first;
  return it->second;
}

void expect_equivalent(const std::string& model, const std::string& plan) {
  SCOPED_TRACE(model + " " + plan);
  const std::string gbs = plan.substr(plan.find("gbs=") + 4, plan.find_first_of(',', plan.find("gbs=")) - plan.find("gbs=") - 4);
  const TrainRun& one = reference(model, gbs);
  ASSERT_EQ(one.rc, 0) << one.err;
  const TrainRun r = train(model, plan + ",precision=fp32", kSteps, kTiny);
  ASSERT_EQ(r.rc, 0) << r.err;
  ASSERT_EQ(r.losses.size(), one.losses.size());
  double worst = 0;
  for (size_t i = 0; i < r.losses.size(); ++i) worst = std::max(worst, std::fabs(r.losses[i] - one.losses[i]) / one.losses[i]);
  ASSERT_EQ(r.params.size(), one.params.size());
  // Parameters: the relative L2 distance of the gathered model (Adam divides every
  // gradient by its own running RMS, so an element whose gradient is rounding noise moves
  // by a noisy lr-sized step; the norm over the model is the stable measure).
  double pdiff = 0, d2 = 0, n2 = 0;
  for (size_t i = 0; i < r.params.size(); ++i) {
    const double e = static_cast<double>(r.params[i]) - static_cast<double>(one.params[i]);
    pdiff = std::max(pdiff, std::fabs(e));
    d2 += e * e;
    n2 += static_cast<double>(one.params[i]) * static_cast<double>(one.params[i]);
  }
  const double prel = std::sqrt(d2 / n2);
  const double replica = r.j["replica_max_abs_diff"].get<double>();
  std::printf("  %-10s %-40s %d ranks: loss %.5f -> %.5f, largest relative loss difference %.2e, "
              "parameters %.2e relative L2 (largest element difference %.1e), replicas %.1e\n",
              model.c_str(), plan.c_str(), r.j["world_size"].get<int>(), r.losses.front(), r.losses.back(), worst, prel,
              pdiff, replica);
  EXPECT_LT(worst, 1e-5);
  EXPECT_LT(prel, 1e-5);
  EXPECT_LT(pdiff, 1e-4);  // and no single parameter far off
  EXPECT_EQ(replica, 0.0);
  EXPECT_LT(r.losses.back(), r.losses.front() - 0.5);  // it learns
}

const std::vector<std::string> kPlans = {
    "dp=2,mbs=1,gbs=8",
    "dp=4,mbs=1,gbs=8",
    "tp=2,mbs=1,gbs=8",
    "tp=2,sp=1,mbs=1,gbs=8",
    "pp=2,schedule=gpipe,mbs=1,gbs=8",
    "pp=2,mbs=1,gbs=8",
    "pp=2,vp=2,mbs=1,gbs=8",
    "pp=2,vp=2,mbs=1,gbs=5",  // 5 micro-batches: groups of 3, then the last 2 (Megatron-core's table)
    "dp=2,zero=1,mbs=1,gbs=8",
    "dp=2,zero=2,mbs=1,gbs=8",
    "dp=2,zero=3,mbs=1,gbs=8",
    "tp=2,pp=2,mbs=1,gbs=8",
    "dp=2,pp=2,mbs=1,gbs=8",
    "dp=2,tp=2,zero=1,mbs=1,gbs=8",
    "tp=2,sp=1,recompute=full,mbs=1,gbs=8",
    "dp=2,recompute=selective,mbs=1,gbs=8",
    "pp=2,recompute=full,recompute_num_layers=1,mbs=1,gbs=8",  // first layer of each chunk only
    "dp=2,mbs=2,gbs=8",  // gradient accumulation: 2 micro-batches of 2 per rank
    "tp=2,pp=2,dp=2,sp=1,zero=3,recompute=full,mbs=1,gbs=8",
    "tp=2,pp=2,attention=flash,recompute=selective,mbs=1,gbs=8",  // fused attention, lse recomputed
    // Context parallelism: each rank holds two of the 2 cp chunks of every sequence and
    // gathers the others' keys and values; its gradients are reduced over data x context.
    "cp=2,mbs=1,gbs=8",
    "cp=2,tp=2,sp=1,attention=flash,recompute=selective,mbs=1,gbs=8",
    "cp=2,dp=2,zero=3,recompute=full,mbs=1,gbs=8",
    // Uneven pipelines: Megatron-core's layout, 4 layers in 6 chunks (stage 0's last empty,
    // the last stage's last the loss alone), and three of the four layers on the first stage.
    "pp=2,mbs=1,gbs=8,pipeline_model_parallel_layout=Et|t|t|t||L",
    "pp=2,dp=2,zero=1,mbs=1,gbs=8,decoder_first_pipeline_num_layers=3",
};

TEST(TrainEquivalence, GptPlansMatchOneRank) {
  for (const auto& p : kPlans) expect_equivalent("tiny-gpt", p);
}

// Under the sanitizers (the long pole of CI) tiny-llama runs the plans whose code differs
// from tiny-gpt's -- RoPE, SwiGLU, RMSNorm and grouped-query heads split by tp, with
// sequence and context parallelism, pipelines, ZeRO-3, recompute and the fused attention --
// and tiny-gpt runs all of kPlans; the Release ctest of make test runs both in full.
#ifdef STRATA_UNDER_SANITIZER
const std::vector<std::string> kLlamaPlans = {
    "tp=2,sp=1,mbs=1,gbs=8",
    "pp=2,vp=2,mbs=1,gbs=8",
    "dp=2,zero=3,mbs=1,gbs=8",
    "tp=2,sp=1,recompute=full,mbs=1,gbs=8",
    "tp=2,pp=2,attention=flash,recompute=selective,mbs=1,gbs=8",
    "cp=2,mbs=1,gbs=8",
    "cp=2,tp=2,sp=1,attention=flash,recompute=selective,mbs=1,gbs=8",
    "dp=2,mbs=2,gbs=8",
};
#else
const std::vector<std::string>& kLlamaPlans = kPlans;
#endif

TEST(TrainEquivalence, LlamaPlansMatchOneRank) {
  for (const auto& p : kLlamaPlans) expect_equivalent("tiny-llama", p);
}

TEST(TrainOutput, JsonAndTraceHaveTheSpecFields) {
  const std::string trace = ::testing::TempDir() + "strata_train_trace.json";
  const TrainRun r = train("tiny-gpt", "pp=2,dp=2,zero=1,mbs=1,gbs=8,precision=fp32", 3, kShort + " --trace " + trace);
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* k : {"plan", "world_size", "backend", "steps", "median_step_time_s", "peak_memory_bytes", "time_s"})
    EXPECT_TRUE(r.j.contains(k)) << k;
  for (const char* k : {"step", "loss", "step_time_s", "tokens_per_s", "grad_norm", "loss_scale", "skipped"})
    EXPECT_TRUE(r.j["steps"][0].contains(k)) << k;
  for (const char* k : {"weights", "gradients", "optimizer_states", "activations", "total"})
    EXPECT_GT(r.j["peak_memory_bytes"][k].get<double>(), 0) << k;
  EXPECT_GE(r.j["peak_memory_bytes"]["comm_buffers"].get<double>(), 0);  // > 0 with ZeRO-3 (TrainMemory)
  for (const char* k : {"forward", "backward", "optimizer", "tp_comm", "cp_comm", "pp_comm", "dp_comm", "pipeline_bubble"})
    EXPECT_TRUE(r.j["time_s"].contains(k)) << k;
  EXPECT_GT(r.j["time_s"]["forward"].get<double>(), 0);
  EXPECT_GT(r.j["time_s"]["backward"].get<double>(), r.j["time_s"]["forward"].get<double>() * 0.5);
  EXPECT_EQ(r.j["world_size"].get<int>(), 4);
  const Json t = Json::parse(slurp(trace));
  std::map<int, int> per_rank;
  for (const auto& e : t["traceEvents"])
    if (e["ph"] == "X") ++per_rank[e["pid"].get<int>()];
  EXPECT_EQ(per_rank.size(), 4u);  // one track per rank
  for (auto [rank, n] : per_rank) EXPECT_GE(n, 3 * 8) << "rank " << rank;  // forwards and backwards of 3 steps
  // SPEC.md's slices: forward / backward / recompute / collective / send / recv / optimizer,
  // with microbatch and layer in args.
  auto kinds = [](const Json& trace) {
    std::map<std::string, int> n;
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X") continue;
      const std::string name = e["name"];
      ++n[name];
      EXPECT_TRUE(e["args"].contains("microbatch")) << name;
      if (name.rfind("layer ", 0) == 0) {
        EXPECT_GE(e["args"]["layer"].get<int>(), 0) << name;
      }
    }
    return n;
  };
  std::map<std::string, int> n = kinds(t);
  for (const char* k : {"forward", "backward", "layer forward", "layer backward", "send activations", "recv activations",
                        "send gradients", "recv gradients", "optimizer"})
    EXPECT_GT(n[k], 0) << k;
  const std::string trace2 = ::testing::TempDir() + "strata_train_trace_tp.json";
  const TrainRun tp = train("tiny-gpt", "tp=2,mbs=1,gbs=2,recompute=full,precision=fp32", 1, kShort + " --trace " + trace2);
  ASSERT_EQ(tp.rc, 0) << tp.err;
  n = kinds(Json::parse(slurp(trace2)));
  for (const char* k : {"layer recompute", "tp_comm"}) EXPECT_GT(n[k], 0) << k;
}

// A straggler (--inject-fault slow@1:2: rank 1 sleeps 1.5 s before its step-2 backward)
// makes its tensor-, context- or data-parallel peer wait at the backward's first collective
// (data parallel: the first gradient reduction, with ZeRO-2/3 mid-backward). The executor
// counts that wait as skew, not communication: the skew holds most of the injected sleep
// and never more than the wait it is part of. Without the fault the skew is still within
// [0, wait]. A pipeline stage waits for the straggler's gradient in a receive: the part of
// the bubble that replaying the step's schedule at the measured compute does not imply
// (pp_skew) holds the sleep. Bounds relative to an injected sleep, not a speed claim.
TEST(TrainOutput, AStragglersPeersCountSkewNotCommunication) {
  for (const auto& [plan, term] : std::vector<std::pair<std::string, std::string>>{
           {"tp=2,mbs=1,gbs=2,precision=fp32", "tp"},
           {"cp=2,mbs=1,gbs=2,precision=fp32", "cp"},
           {"dp=2,mbs=1,gbs=4,precision=fp32", "dp"},
           {"dp=2,zero=2,mbs=1,gbs=4,precision=fp32", "dp"},
           {"dp=2,zero=3,mbs=1,gbs=4,precision=fp32", "dp"},
           {"pp=2,mbs=1,gbs=2,precision=fp32", "pp"}}) {
    for (bool slow : {false, true}) {
      // At least 0.6 of the sleep: the skew is the part of the peer's wait before the
      // straggler started, so the peer's own backward before it waits does not count, and
      // the peer may itself reach the collective late when the machine is loaded (ctest
      // runs tests side by side). Under the sanitizers on a busy host a 0.5 s sleep showed
      // 0.03-0.27 s; hence the 1.5 s sleep, and up to three tries for a straggler's run.
      // The bounds below hold in every try.
      double best = 0;
      for (int attempt = 0; attempt < (slow ? 3 : 1) && best < 0.6 * strata::kSlowRankSeconds; ++attempt) {
        const TrainRun r = train("tiny-gpt", plan, 2, kShort + (slow ? " --inject-fault slow@1:2" : ""));
        ASSERT_EQ(r.rc, 0) << plan << r.err;
        const std::string wait = term == "pp" ? "pipeline_bubble" : term + "_comm";
        const double comm = r.j["time_s"][wait].get<double>(), skew = r.j["time_s"][term + "_skew"].get<double>();
        EXPECT_GE(skew, 0.0) << plan;
        EXPECT_LE(skew, comm + 1e-9) << plan;
        best = std::max(best, skew);
      }
      if (slow) {
        EXPECT_GE(best, 0.6 * strata::kSlowRankSeconds) << plan << " (best of three runs)";
      }
    }
  }
}

TEST(TrainMemory, ZeroShardsTheOptimizerAndGradients) {
  auto mem = [](const TrainRun& r, const char* k) { return r.j["peak_memory_bytes"][k].get<double>(); };
  const TrainRun z0 = train("tiny-gpt", "dp=2,mbs=1,gbs=4,precision=bf16", 1, kShort);
  const TrainRun z1 = train("tiny-gpt", "dp=2,zero=1,mbs=1,gbs=4,precision=bf16", 1, kShort);
  const TrainRun z3 = train("tiny-gpt", "dp=2,zero=3,mbs=1,gbs=4,precision=bf16", 1, kShort);
  ASSERT_EQ(z0.rc, 0) << z0.err;
  ASSERT_EQ(z1.rc, 0) << z1.err;
  ASSERT_EQ(z3.rc, 0) << z3.err;
  // bf16: the working weights as floats 4 B/param (values rounded to bf16), fp32 gradients
  // 4, master + Adam moments 12 (halved by ZeRO).
  EXPECT_NEAR(mem(z0, "optimizer_states") / mem(z0, "weights"), 3.0, 0.01);
  EXPECT_NEAR(mem(z0, "gradients") / mem(z0, "weights"), 1.0, 0.01);
  EXPECT_NEAR(mem(z1, "optimizer_states") / mem(z0, "optimizer_states"), 0.5, 0.01);
  EXPECT_LT(mem(z3, "weights"), 0.51 * mem(z0, "weights"));
  EXPECT_LT(mem(z3, "gradients"), 0.51 * mem(z0, "gradients"));
  EXPECT_GT(mem(z3, "comm_buffers"), 0);  // the gathered layer and one layer's gradient
}

// The executor builds the layers a plan's own split gives each stage (layout.h), not its
// even split: with "Ett|t|t|L" stage 0 holds layers 0, 1 (chunk 0) and 3 (chunk 1), one
// more than the two of pp=2,vp=2. tiny-gpt's layer has 12 H^2 + 13 H parameters (QKV 3H^2 +
// 3H, projection H^2 + H, MLP 8H^2 + 5H, two LayerNorms 4H), 789,760 at H = 256, at the 4
// bytes each the executor's working weights take in every precision (floats holding bf16
// values); stage 0 (the embedding and its positions) is the larger rank either way.
TEST(TrainMemory, APipelineLayoutPlacesTheLayers) {
  auto weights = [](const TrainRun& r) { return r.j["peak_memory_bytes"]["weights"].get<double>(); };
  const TrainRun even = train("tiny-gpt", "pp=2,vp=2,mbs=1,gbs=4,precision=bf16", 1, kShort);
  const TrainRun own = train("tiny-gpt", "pp=2,mbs=1,gbs=4,precision=bf16,pipeline_model_parallel_layout=Ett|t|t|L", 1, kShort);
  ASSERT_EQ(even.rc, 0) << even.err;
  ASSERT_EQ(own.rc, 0) << own.err;
  EXPECT_EQ(weights(own) - weights(even), 4.0 * (12.0 * 256 * 256 + 13.0 * 256));
  EXPECT_EQ(own.losses, even.losses);  // the same model, split otherwise
}

// The cost model's activation term against what the executor tracks, for a model whose
// output layer outweighs its layers (tiny-gpt's layers with GPT-2's vocabulary of 50257):
// the executor normalises its fp32 logits and turns them into their gradient in place, so
// the loss holds no second T x V buffer (memory.cpp head_working_bytes; the model counted a
// legacy stack's cast and gradient copy, 124% over). Within 1% (measured: -0.03% on one
// rank, -0.23% with tp=2 and sequence parallelism).
TEST(TrainMemory, ActivationsOfALargeVocabularyMatchTheCostModel) {
  const std::string model = fresh_dir("wide_vocab").string() + "/config.json";
  std::ofstream(model) << R"({"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 50257,
                             "n_positions": 128})";
  for (const std::string plan : {"mbs=2,gbs=2,precision=bf16", "tp=2,sp=1,mbs=2,gbs=2,precision=bf16"}) {
    const TrainRun r = train(model, plan, 1);
    ASSERT_EQ(r.rc, 0) << r.err;
    const std::string est = ::testing::TempDir() + "wide_vocab_estimate.json";
    const std::string cmd = std::string(STRATA_BINARY) + " estimate --model " + model +
                            " --cluster local-cpu --plan '" + plan + "' --json > " + est;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const double predicted = Json::parse(slurp(est))["memory_bytes"]["activations"].get<double>();
    const double tracked = r.j["peak_memory_bytes"]["activations"].get<double>();
    EXPECT_NEAR(predicted / tracked, 1.0, 0.01) << plan << ": predicted " << predicted << ", tracked " << tracked;
  }
}

// strata train --ops: every op the executor times in a layer is one the cost model costs
// for that phase, under its name (the unfused attention core's products and softmax as
// core_attention), and every op the model costs is timed; own times are not negative, and
// with --cluster each op has its predicted time. Counts and names only: no clock threshold.
TEST(TrainOutput, OpTimesNameTheCostModelsOps) {
  const std::string cluster = "local-cpu";
  for (const std::string plan : {"tp=2,sp=1,mbs=2,gbs=4,precision=bf16,attention=unfused,recompute=selective",
                                 "mbs=2,gbs=4,precision=bf16,attention=flash,recompute=full",
                                 "pp=2,mbs=1,gbs=4,attention=unfused,precision=fp32"}) {
    const TrainRun r = train("tiny-llama", plan, 3, "--seq-length 32 --ops --cluster " + cluster);
    ASSERT_EQ(r.rc, 0) << plan << ": " << r.err;
    EXPECT_NE(r.out.find("per-op times on rank 0"), std::string::npos) << r.out;
    ASSERT_TRUE(r.j.contains("ops")) << plan;
    EXPECT_EQ(r.j["ops"]["steps"].get<int>(), 2) << plan;  // the first step is a warm-up
    // What the cost model costs per layer, by phase, under the executor's names.
    const strata::Cluster cl = strata::load_cluster(cluster);
    const strata::ModelSpec m = strata::model_on_stack(strata::load_model("tiny-llama", 32), cl);
    strata::EstimateOptions eo;
    eo.want_ops = true;
    strata::EstimateDetail d;
    ASSERT_TRUE(strata::estimate(m, cl, strata::load_plan(plan), eo, &d).valid) << plan;
    std::map<std::string, std::set<std::string>> model_ops, timed_ops;
    std::set<std::string> outside;
    for (const strata::OpCost& c : d.layer_ops)
      if (c.kind == strata::OpKind::gemm || c.kind == strata::OpKind::memory)
        model_ops[strata::to_string(c.phase)].insert(strata::executor_op_name(c.name));
    for (const Json& row : r.j["ops"]["rows"]) {
      const std::string phase = row["phase"], op = row["op"];
      ASSERT_TRUE(row["measured_s"].is_number()) << plan << " " << phase << " " << op;
      EXPECT_GE(row["measured_s"].get<double>(), 0.0) << plan << " " << phase << " " << op;
      if (row["per"] != "layer") {
        // Outside the layers: the embedding and the output layer (with the loss) are costed
        // too, where rank 0 runs them, with the tensor-parallel collectives of both (and no
        // 16-bit rounding pass: the final norm and the loss's backward round as they write).
        if (op == "embedding" || op == "output_layer" || op == "round16" || op == "tp_comm") {
          outside.insert(phase + " " + op);
          EXPECT_TRUE(row["predicted_s"].is_number()) << plan << ": no prediction for " << phase << " " << op;
        }
        continue;
      }
      if (op == strata::kOtherOp || op == "tp_comm" || op == "cp_comm") continue;
      timed_ops[phase].insert(op);
      EXPECT_TRUE(row["predicted_s"].is_number()) << plan << ": no prediction for " << phase << " " << op;
    }
    EXPECT_GE(model_ops["forward"].size(), 8u) << plan;
    EXPECT_EQ(timed_ops, model_ops) << plan;
    // Rank 0 holds the embedding, and the output layer unless the pipeline has two stages.
    std::set<std::string> expect = {"forward embedding", "backward embedding"};
    if (plan.find("pp=2") == std::string::npos) {
      expect.insert({"forward output_layer", "backward output_layer"});
    }
    if (plan.find("tp=2") != std::string::npos) expect.insert({"forward tp_comm", "backward tp_comm"});
    EXPECT_EQ(outside, expect) << plan;
  }
  const TrainRun bad = train("tiny-gpt", "mbs=2,gbs=2", 1, "--seq-length 32 --cluster local-cpu");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("--cluster"), std::string::npos) << bad.err;
}

TEST(TrainPrecision, Bf16AndFp16TrackFp32) {
  // 60 steps each from the same initialisation and batches. bf16 rounds every GEMM input
  // to 8 significant bits (relative error 2^-9 = 0.2%), fp16 to 11 bits; the loss averages
  // thousands of tokens, so its rounding noise is far below 0.2%, and the trajectories
  // drift apart only through the optimizer. We allow 0.05 nats at any step (about 1% of
  // the initial loss, 5% of the final), and a final loss within 0.02 nats. Under the
  // sanitizers (3x slower) 15 steps run the same code; the Release run checks all 60.
#ifdef STRATA_UNDER_SANITIZER
  const int steps = 15;
#else
  const int steps = 60;
#endif
  const TrainRun f32 = train("tiny-gpt", "mbs=4,gbs=8,precision=fp32", steps, kShort);
  const TrainRun b16 = train("tiny-gpt", "mbs=4,gbs=8,precision=bf16", steps, kShort);
  const TrainRun f16 = train("tiny-gpt", "mbs=4,gbs=8,precision=fp16", steps, kShort);
  for (const TrainRun* r : {&f32, &b16, &f16}) ASSERT_EQ(r->rc, 0) << r->err;
  for (const TrainRun* r : {&b16, &f16}) {
    double worst = 0;
    for (size_t i = 0; i < r->losses.size(); ++i) worst = std::max(worst, std::fabs(r->losses[i] - f32.losses[i]));
    const double last = std::fabs(r->losses.back() - f32.losses.back());
    std::printf("  %s vs fp32 over %d steps: largest |loss difference| %.4f nats, final %.4f (fp32 final %.4f)\n",
                r == &b16 ? "bf16" : "fp16", steps, worst, last, f32.losses.back());
    EXPECT_LT(worst, 0.05);
    EXPECT_LT(last, 0.02);
  }
}

TEST(TrainPrecision, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
  // dloss = scale / tokens: with 2^28 and 256 tokens the logits' gradient is 2^20 > 65504,
  // so the first steps overflow, each halving the scale until the gradients fit (a later
  // step may overflow again as gradients grow); the window is longer than the run, so the
  // scale never grows back.
  const TrainRun r = train("tiny-gpt", "mbs=2,gbs=4,precision=fp16", 12, kShort + " --loss-scale 268435456 --loss-scale-window 1000");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto& s = r.j["steps"];
  EXPECT_TRUE(s[0]["skipped"].get<bool>());
  EXPECT_TRUE(s[0]["grad_norm"].is_null());
  EXPECT_DOUBLE_EQ(s[1]["loss_scale"].get<double>(), 268435456.0 / 2);
  size_t skipped = 0;
  for (size_t i = 0; i + 1 < s.size(); ++i) {  // a skip halves the scale; a good step keeps it
    const double now = s[i]["loss_scale"].get<double>(), next = s[i + 1]["loss_scale"].get<double>();
    if (s[i]["skipped"].get<bool>()) {
      ++skipped;
      EXPECT_DOUBLE_EQ(next, now / 2);
    } else {
      EXPECT_DOUBLE_EQ(next, now);
    }
  }
  EXPECT_LT(skipped, s.size() - 3);
  EXPECT_LT(r.losses.back(), r.losses.front() - 0.3);  // the unskipped steps train
  std::printf("  fp16 from scale 2^28: %zu of %zu steps skipped, then scale %.0f\n", skipped, s.size(),
              s[s.size() - 1]["loss_scale"].get<double>());
}

void expect_input_error(const std::string& what, const std::string& plan, int np, const std::string& extra,
                        const std::string& needle) {
  SCOPED_TRACE(what);
  const TrainRun r = train("tiny-gpt", plan, 2, kShort + " " + extra, np);
  EXPECT_EQ(r.rc, 2) << r.err;
  size_t lines = 0, at = 0;
  while ((at = r.err.find("strata: error", at)) != std::string::npos) ++lines, ++at;
  EXPECT_EQ(lines, static_cast<size_t>(np)) << "one error line per rank:\n" << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

TEST(TrainErrors, BadInputExitsTwoOnEveryRank) {
  const std::string dir = ::testing::TempDir();
  {
    std::ofstream f(dir + "odd_tokens.bin", std::ios::binary);
    f << "abcde";
  }
  expect_input_error("world size", "dp=4,mbs=1,gbs=4", 2, "", "mpirun started 2");
  expect_input_error("heads", "tp=3,mbs=1,gbs=3", 3, "", "num_attention_heads = 4 is not divisible by tensor_parallel = 3");
  expect_input_error("context chunks", "cp=3,mbs=1,gbs=3", 3, "", "seq_length = 64 is not divisible by 2 * context_parallel = 6");
  expect_input_error("batch", "dp=2,mbs=3,gbs=8", 2, "", "global_batch_size = 8 is not divisible");
  expect_input_error("interleaved micro-batches", "pp=2,vp=2,mbs=1,gbs=1", 2, "", "at least pipeline_parallel=2 micro-batches");
  expect_input_error("interleaved group", "pp=2,vp=2,mbs=1,gbs=7,microbatch_group_size_per_vp_stage=3", 2, "",
                     "leaves a last group of 1");
  expect_input_error("missing file", "dp=2,mbs=1,gbs=2", 2, "--data " + dir + "no_such_tokens.bin", "cannot open token file");
  expect_input_error("truncated file", "dp=2,mbs=1,gbs=2", 2, "--data " + dir + "odd_tokens.bin", "truncated");
  // A pipe would block the run for ever: refused like a folder.
  const std::string fifo = dir + "strata_tokens.fifo";
  std::remove(fifo.c_str());
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  expect_input_error("pipe", "dp=2,mbs=1,gbs=2", 2, "--data " + fifo, "is not a regular file");
  std::remove(fifo.c_str());
  // Outputs that cannot be written fail before the run, not after it.
  expect_input_error("unwritable trace", "dp=2,mbs=1,gbs=2", 2, "--trace /nonexistent_strata_dir/run.trace",
                     "--trace: '/nonexistent_strata_dir/run.trace' is invalid: names a folder that does not exist");
  expect_input_error("checkpoint folder a file", "dp=2,mbs=1,gbs=2", 2,
                     "--checkpoint-every 1 --checkpoint-dir " + dir + "odd_tokens.bin", "is not a folder");
  expect_input_error("watchdog below a second", "dp=2,mbs=1,gbs=2", 2, "--distributed-timeout-minutes 0.001",
                     "--distributed-timeout-minutes");
  expect_input_error("keep without a folder", "dp=2,mbs=1,gbs=2", 2, "--keep-checkpoints 3",
                     "--keep-checkpoints needs --checkpoint-dir D");
}

// A token outside the model's vocab_size is refused, though the embedding has rows for it
// (500 padded to 512, make_vocab_size_divisible_by 128).
TEST(TrainErrors, TokenBeyondTheVocabularyIsRefusedNotPadded) {
  const std::string dir = ::testing::TempDir();
  {
    std::ofstream f(dir + "vocab500.json");
    f << R"({"num_layers":2,"hidden_size":64,"num_attention_heads":4,"vocab_size":500,"seq_length":32})";
  }
  {
    std::ofstream f(dir + "token505.bin", std::ios::binary);
    for (int i = 0; i < 200; ++i) {
      const uint16_t t = static_cast<uint16_t>(i == 150 ? 505 : i % 50);
      f.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  const TrainRun r = train(dir + "vocab500.json", "dp=2,mbs=1,gbs=2", 1, "--data " + dir + "token505.bin", 2);
  EXPECT_EQ(r.rc, 2) << r.err;
  size_t lines = 0, at = 0;
  while ((at = r.err.find("the model's vocab_size is 500", at)) != std::string::npos) ++lines, ++at;
  EXPECT_EQ(lines, 2u) << r.err;
}

TEST(TrainData, TokenFileTrainsLikeAnyOther) {
  // A uint16 token file of a repeating pattern: the loss falls far below log(V).
  const std::string path = ::testing::TempDir() + "pattern_tokens.bin";
  {
    std::ofstream f(path, std::ios::binary);
    for (int i = 0; i < 20000; ++i) {
      const uint16_t t = static_cast<uint16_t>((i * 7) % 31);
      f.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  const TrainRun one = train("tiny-gpt", "mbs=2,gbs=4,precision=fp32", 10, kShort + " --data " + path);
  const TrainRun two = train("tiny-gpt", "dp=2,mbs=2,gbs=4,precision=fp32", 10, kShort + " --data " + path);
  ASSERT_EQ(one.rc, 0) << one.err;
  ASSERT_EQ(two.rc, 0) << two.err;
  EXPECT_LT(one.losses.back(), 3.0);
  for (size_t i = 0; i < one.losses.size(); ++i) EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5 * one.losses[i]);
}

}  // namespace
