// The planner: pruning never changes the answer (checked against a search that estimates
// every feasible plan), plans come back valid, fitting and sorted, --fix pins dimensions,
// the Pareto frontier is non-dominated, exports carry the framework flags.
#include <gtest/gtest.h>

#include "planner/export.h"
#include "planner/search.h"

namespace strata {
namespace {

TEST(Planner, PruningKeepsTheExactTopK) {
  const ModelSpec m = load_model("gpt2-1.5b");
  const Cluster c = load_cluster("dgx-a100-80g");
  SearchOptions o;
  o.gpus = 32;
  o.gbs = 128;
  o.top_k = 10;
  const SearchResult pruned = search(m, c, o);
  o.top_k = 1000000;  // the bound never bites: every feasible plan is estimated
  const SearchResult full = search(m, c, o);
  ASSERT_EQ(full.simulated, full.feasible);
  EXPECT_LT(pruned.simulated, full.simulated);
  EXPECT_EQ(pruned.candidates_evaluated, full.candidates_evaluated);
  EXPECT_EQ(pruned.feasible, full.feasible);
  ASSERT_EQ(pruned.plans.size(), 10u);
  for (size_t i = 0; i < pruned.plans.size(); ++i) {
    EXPECT_DOUBLE_EQ(pruned.plans[i].step_time_s, full.plans[i].step_time_s) << i;
    EXPECT_EQ(plan_to_inline(pruned.plans[i].plan), plan_to_inline(full.plans[i].plan)) << i;
  }
  int64_t rejected = 0;
  for (const auto& [k, v] : full.rejected) rejected += v;
  EXPECT_EQ(rejected + full.feasible, full.candidates_evaluated);
}

TEST(Planner, PlansAreValidFittingAndSorted) {
  const ModelSpec m = load_model("llama3-70b");
  const Cluster c = load_cluster("dgx-h100-80g");
  SearchOptions o;
  o.gpus = 256;
  o.gbs = 512;
  o.top_k = 20;
  const SearchResult r = search(m, c, o);
  ASSERT_FALSE(r.plans.empty());
  for (size_t i = 0; i < r.plans.size(); ++i) {
    const Estimate& e = r.plans[i];
    EXPECT_TRUE(e.valid);
    EXPECT_TRUE(e.fits);
    EXPECT_EQ(e.plan.world_size(), 256);
    EXPECT_EQ(e.plan.gbs, 512);
    if (i) EXPECT_LE(r.plans[i - 1].step_time_s, e.step_time_s);
    // The planner's estimate equals a fresh one of the same plan.
    EXPECT_DOUBLE_EQ(estimate(m, c, e.plan).step_time_s, e.step_time_s);
  }
  EXPECT_GT(r.candidates_evaluated, r.feasible);
}

TEST(Planner, FixPinsDimensions) {
  const ModelSpec m = load_model("gpt3-175b");
  const Cluster c = load_cluster("dgx-a100-80g");
  SearchOptions o;
  o.gpus = 1024;
  o.gbs = 1536;
  o.fixed = parse_fixed("tp=8,pp=16,recompute=full");
  const SearchResult r = search(m, c, o);
  ASSERT_FALSE(r.plans.empty());
  for (const auto& e : r.plans) {
    EXPECT_EQ(e.plan.t, 8);
    EXPECT_EQ(e.plan.p, 16);
    EXPECT_EQ(e.plan.recompute, Recompute::full);
  }
  EXPECT_THROW(parse_fixed("tp=x"), InputError);
  EXPECT_THROW(parse_fixed("warp=2"), InputError);
}

TEST(Planner, ParetoFrontierIsNonDominated) {
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = load_cluster("dgx-a100-80g");
  SearchOptions o;
  o.gpus = 16;
  o.gbs = 64;
  o.pareto = true;
  const SearchResult r = search(m, c, o);
  ASSERT_GE(r.pareto.size(), 2u);
  for (size_t i = 1; i < r.pareto.size(); ++i) {
    EXPECT_LT(r.pareto[i - 1].memory.peak, r.pareto[i].memory.peak);
    EXPECT_GT(r.pareto[i - 1].step_time_s, r.pareto[i].step_time_s);
  }
  // The fastest plan is on the frontier.
  EXPECT_DOUBLE_EQ(r.pareto.back().step_time_s, r.plans.front().step_time_s);
}

TEST(Planner, NothingFeasibleCountsReasons) {
  SearchOptions o;
  o.gpus = 1;
  o.gbs = 8;
  const SearchResult r = search(load_model("gpt3-175b"), load_cluster("dgx-a100-80g"), o);
  EXPECT_TRUE(r.plans.empty());
  EXPECT_GT(r.rejected.at("out_of_memory"), 0);
}

TEST(Planner, Exports) {
  const ModelSpec m = load_model("llama3-70b");
  const Plan p = load_plan("tp=8,pp=4,dp=8,vp=5,mbs=1,gbs=512,zero=1,recompute=selective,sp=1,precision=bf16");
  const Stack st = resolve_stack(m, load_cluster("dgx-h100-80g"), p);
  const std::string mg = export_megatron(m, p, st);
  for (const char* f : {"--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 4",
                        "--num-layers-per-virtual-pipeline-stage 4", "--micro-batch-size 1", "--global-batch-size 512",
                        "--sequence-parallel", "--use-distributed-optimizer", "--recompute-granularity selective",
                        "--bf16", "--group-query-attention", "--num-query-groups 8", "--swiglu"})
    EXPECT_NE(mg.find(f), std::string::npos) << f;
  // 126 layers on 16 stages x 4 chunks: 128 slots of 2, the embedding and the loss in one each.
  const ModelSpec big = load_model("llama3-405b");
  const Plan bp = load_plan("tp=8,pp=16,dp=8,vp=4,gbs=512");
  const std::string bg = export_megatron(big, bp, resolve_stack(big, load_cluster("dgx-h100-80g"), bp));
  EXPECT_NE(bg.find("--num-layers-per-virtual-pipeline-stage 2"), std::string::npos);
  EXPECT_NE(bg.find("--account-for-embedding-in-pipeline-split"), std::string::npos);
  const Json ds = Json::parse(export_deepspeed(m, p, st));
  EXPECT_EQ(ds["train_micro_batch_size_per_gpu"], 1);
  EXPECT_EQ(ds["gradient_accumulation_steps"], 64);
  EXPECT_EQ(ds["zero_optimization"]["stage"], 1);
  EXPECT_EQ(ds["bf16"]["enabled"], true);
  EXPECT_EQ(ds["train_batch_size"], 512);
}

}  // namespace
}  // namespace strata
