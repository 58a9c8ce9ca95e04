// The planner: pruning never changes the answer (checked against a search that estimates
// every feasible plan), plans come back valid, fitting and sorted, --fix pins dimensions,
// the Pareto frontier is non-dominated, exports carry the framework flags.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "planner/export.h"
#include "planner/search.h"

namespace strata {
namespace {

// The slow, obvious twin of the search: every plan of the space, every integer of every
// dimension (virtual stages where the layers split evenly), estimated and sorted. The
// search's bound, its bulk rejections and its bisection over partial recompute must give
// the same top K.
// Llama 2 7B (32k vocabulary: no split balances its ends better than strata's own layout)
// and Llama 3 8B (128k: splits win on some pipelines).
// With `pp` set, the twin and the search both keep that pipeline depth only (--fix pp=...).
// With `offload`, every ZeRO >= 1 plan also with kOffloadFractions of its optimizer on the
// host (--search-offload); with `only`, that recompute mode alone (--fix recompute=...).
// With `userbuffers`, every plan with tp_comm_overlap on (--fix tp_comm_overlap=1).
void search_matches_estimating_every_plan(const char* model, bool expect_splits, int64_t pp = 0, bool offload = false,
                                          std::optional<Recompute> only = std::nullopt, bool userbuffers = false) {
  const ModelSpec m = load_model(model);
  const Cluster c = load_cluster("dgx-a100-80g");
  const int64_t gpus = 8, gbs = 16;
  std::vector<std::pair<double, std::string>> all;
  int64_t feasible = 0, splits = 0;
  for (int64_t t = 1; t <= gpus; ++t)
    for (int64_t p = 1; t * p <= gpus; ++p)
      for (int64_t cp = 1; t * p * cp <= gpus && (pp == 0 || p == pp); ++cp) {
        if (gpus % (t * p * cp) != 0) continue;
        const int64_t d = gpus / (t * p * cp);
        for (int64_t v = 1; v * p <= m.L; ++v)
          for (int64_t mbs = 1; mbs <= gbs / d; ++mbs)
            for (int gp = 0; gp < 2; ++gp)
              for (int sp = 0; sp < 2; ++sp)
                for (int rc = 0; rc < 3; ++rc)
                  for (int64_t rl = 0; rl <= (rc == 2 ? m.L : 0); ++rl)
                    for (int zero = 0; zero < 4; ++zero)
                      for (int cc = 0; cc < (cp > 1 ? 3 : 1); ++cc)
                      for (int oi = 0; oi < (offload && zero >= 1 ? 5 : 1); ++oi)
                      for (int64_t etp = 0; etp <= (m.moe() && t > 1 ? 1 : 0); ++etp)  // tensor_parallel, or 1
                      for (int64_t ep = 1; ep <= (m.moe() ? t * d * cp : 1); ++ep) {  // expert parallelism
                        if (m.moe() && ((t * d * cp) % ((etp == 1 ? 1 : t) * ep) != 0 || m.E % ep != 0)) continue;
                        Plan pl;
                        pl.etp = etp;
                        pl.ep = ep;
                        pl.offload = oi == 0 ? 0.0 : kOffloadFractions[oi - 1];
                        pl.t = t; pl.p = p; pl.c = cp; pl.d = d; pl.v = v; pl.mbs = mbs; pl.gbs = gbs;
                        // Context parallelism's three ways to move keys and values (cp_comm_type).
                        if (cp > 1) pl.cp_comm = cc == 0 ? CpComm::p2p : cc == 1 ? CpComm::a2a : CpComm::allgather;
                        pl.gpipe = gp == 1 && v == 1; pl.sp = sp == 1 && t > 1; pl.zero = zero;
                        pl.recompute = static_cast<Recompute>(rc);
                        pl.recompute_layers = rl;
                        if (userbuffers) pl.tp_comm_overlap = Tristate::on;
                        if (only && pl.recompute != *only) continue;
                        // Skip the settings that change nothing (no pipeline to schedule, no
                        // tensor-parallel group to shard over, no replicas for ZeRO).
                        if ((gp && (v > 1 || p == 1)) || (sp && t == 1) || (zero && d * cp == 1)) continue;
                        // Chunks as the search takes them: L or L + 2 split evenly into p v
                        // (an as-even-as-possible interleaved split is estimated, not searched).
                        const bool searched_v = v == 1 || m.L % (p * v) == 0 ||
                                                ((m.L + 2) % (p * v) == 0 && (m.L + 2) / (p * v) >= 2);
                        if (!searched_v) continue;
                        const Estimate e = estimate(m, c, pl);
                        if (e.valid && e.fits) {
                          ++feasible;
                          all.emplace_back(e.step_time_s, plan_to_inline(pl));
                        }
                        // And Megatron's first/last split balancing the ends, on every pipeline.
                        if (p == 1) continue;
                        const std::optional<Plan> q = balanced_end_split(m, c, pl);
                        if (!q) continue;
                        ++splits;
                        const Estimate eq = estimate(m, c, *q);
                        if (!eq.valid || !eq.fits) continue;
                        ++feasible;
                        all.emplace_back(eq.step_time_s, plan_to_inline(*q));
                      }
      }
  std::sort(all.begin(), all.end());
  SearchOptions o;
  o.gpus = gpus;
  o.gbs = gbs;
  o.top_k = 10;
  if (pp > 0) o.fixed.p = pp;
  o.search_offload = offload;
  if (only) o.fixed.recompute = *only;
  if (userbuffers) o.fixed.tp_comm_overlap = true;
  const SearchResult r = search(m, c, o);
  ASSERT_EQ(r.plans.size(), 10u);
  EXPECT_EQ(splits > 0, expect_splits) << splits;
  for (size_t i = 0; i < r.plans.size(); ++i)
    EXPECT_NEAR(r.plans[i].step_time_s, all[i].first, 1e-12 * all[i].first) << i << ": " << all[i].second;
  if (!only) {
    EXPECT_LT(r.simulated, feasible / 10);  // the bound and the bisection skip most estimates
  }
  int64_t rejected = 0;
  for (const auto& [k, n] : r.rejected) rejected += n;
  EXPECT_EQ(rejected + r.feasible, r.candidates_evaluated);
}

TEST(Planner, SearchMatchesEstimatingEveryPlan) {
  search_matches_estimating_every_plan("llama2-7b", false);
  search_matches_estimating_every_plan("llama3-8b", true);
  // Two stages: the best plan puts 17 layers with the embedding and 15 with the 128k output
  // layer (the twin finds it too).
  search_matches_estimating_every_plan("llama3-8b", true, 2);
  SearchOptions o;
  o.gpus = 8;
  o.gbs = 16;
  o.fixed.p = 2;
  const SearchResult r = search(load_model("llama3-8b"), load_cluster("dgx-a100-80g"), o);
  ASSERT_FALSE(r.plans.empty());
  EXPECT_EQ(r.plans.front().plan.first_stage_layers, 17);
}

// Transformer Engine's user buffers for every candidate (--fix tp_comm_overlap=1): the
// search's bound still holds and its top 10 are the twin's; some of them hide their
// sequence-parallel collectives that way.
TEST(Planner, UserBuffersAreSearchedWhenFixed) {
  search_matches_estimating_every_plan("llama3-8b", true, 0, false, std::nullopt, true);
  SearchOptions o;
  o.gpus = 64;
  o.gbs = 128;
  o.precision = Precision::fp8;
  o.fixed.t = 4;
  o.fixed.sp = true;
  const ModelSpec m = load_model("llama3-70b");
  const Cluster h100 = load_cluster("dgx-h100-80g");
  o.fixed.tp_comm_overlap = false;
  const SearchResult plain = search(m, h100, o);
  o.fixed.tp_comm_overlap = true;
  const SearchResult ub = search(m, h100, o);
  ASSERT_FALSE(plain.plans.empty());
  ASSERT_FALSE(ub.plans.empty());
  EXPECT_LT(ub.plans.front().step_time_s, plain.plans.front().step_time_s);
  for (const auto& e : ub.plans) {
    EXPECT_TRUE(e.stack.userbuffers);
    EXPECT_EQ(estimate(m, h100, e.plan).step_time_s, e.step_time_s);
  }
  EXPECT_THROW(parse_fixed("tp_comm_overlap=2"), InputError);
}

// A model mixing dense and MoE layers (the same model with its first 2 layers dense, as
// DeepSeek's and GLM's first_k_dense_replace make them): the search's bound and bisection
// weigh each chunk's dense and MoE layers, and its top 10 are the twin's.
TEST(Planner, DenseAndMoeLayersMixedAreSearched) {
  const std::string path = ::testing::TempDir() + "strata_planner_mixed.json";
  {
    std::ofstream f(path);
    f << R"x({"name":"mixed-test","num_layers":16,"hidden_size":2048,"num_attention_heads":16,"num_query_groups":4,
             "activation":"swiglu","ffn_hidden_size":5632,"vocab_size":32000,"seq_length":2048,
             "num_experts":16,"moe_router_topk":4,"moe_ffn_hidden_size":1408,"moe_layer_freq":"([0]*2+[1]*14)"})x";
  }
  ASSERT_TRUE(load_model(path).mixed());
  search_matches_estimating_every_plan(path.c_str(), true);
}

// Multi-latent attention (a small DeepSeek-style attention on a dense model): the search's
// top 10 are the twin's.
TEST(Planner, MultiLatentAttentionIsSearched) {
  const std::string path = ::testing::TempDir() + "strata_planner_mla.json";
  {
    std::ofstream f(path);
    f << R"({"name":"mla-test","num_layers":16,"hidden_size":2048,"num_attention_heads":16,
             "activation":"swiglu","ffn_hidden_size":5632,"vocab_size":32000,"seq_length":2048,
             "multi_latent_attention":true,"q_lora_rank":512,"kv_lora_rank":256,"qk_head_dim":128,
             "qk_pos_emb_head_dim":64,"v_head_dim":128})";
  }
  ASSERT_TRUE(load_model(path).mla());
  search_matches_estimating_every_plan(path.c_str(), true);
}

// Multi-token prediction (one module of a 16-layer Llama-style model): the search's top 10
// are the twin's, over the whole space and over full recompute alone, whose block method
// (recompute_num_layers) leaves the module unrecomputed: the search's cached output-layer
// costs keep the two apart.
TEST(Planner, MultiTokenPredictionIsSearched) {
  const std::string path = ::testing::TempDir() + "strata_planner_mtp.json";
  {
    std::ofstream f(path);
    f << R"({"name":"mtp-test","num_layers":16,"hidden_size":2048,"num_attention_heads":16,"num_query_groups":4,
             "activation":"swiglu","ffn_hidden_size":5632,"vocab_size":32000,"seq_length":2048,"mtp_num_layers":1})";
  }
  ASSERT_EQ(load_model(path).mtp_layers, 1);
  search_matches_estimating_every_plan(path.c_str(), true);
  search_matches_estimating_every_plan(path.c_str(), true, 0, false, Recompute::full);
  // Every plan --pareto estimates (each recompute_num_layers that fits, uniform and block
  // alike) is costed as estimate() costs it alone.
  SearchOptions o;
  o.gpus = 8;
  o.gbs = 64;
  o.top_k = 50;
  o.pareto = true;
  o.fixed.recompute = Recompute::full;
  const ModelSpec m = load_model(path);
  const Cluster c = load_cluster("dgx-a100-40g");
  const SearchResult r = search(m, c, o);
  ASSERT_FALSE(r.plans.empty());
  int uniform = 0, block = 0;
  for (const auto* list : {&r.plans, &r.pareto})
    for (const Estimate& e : *list) {
      (e.plan.recompute_layers == 0 ? uniform : block) += 1;
      EXPECT_EQ(estimate(m, c, e.plan).step_time_s, e.step_time_s) << plan_to_inline(e.plan);
    }
  EXPECT_GT(uniform, 0);
  EXPECT_GT(block, 0);
}

// Expert parallelism as a searched dimension: a mixture-of-experts model of 16 layers (H
// 2048, 16 SwiGLU experts of 1408, top 4) on one DGX A100: the search's top 10 are those of
// the twin that estimates every plan with every ep dividing the experts and the data x
// context parallel ranks, some of them using expert parallelism.
TEST(Planner, ExpertParallelismIsSearched) {
  const std::string path = ::testing::TempDir() + "strata_planner_moe.json";
  {
    std::ofstream f(path);
    f << R"({"name":"moe-test","num_layers":16,"hidden_size":2048,"num_attention_heads":16,"num_query_groups":4,
             "activation":"swiglu","ffn_hidden_size":5632,"vocab_size":32000,"seq_length":2048,
             "num_experts":16,"moe_router_topk":4,"moe_ffn_hidden_size":1408})";
  }
  search_matches_estimating_every_plan(path.c_str(), true);
  SearchOptions o;
  o.gpus = 8;
  o.gbs = 16;
  const ModelSpec m = load_model(path);
  const SearchResult r = search(m, load_cluster("dgx-a100-80g"), o);
  ASSERT_FALSE(r.plans.empty());
  EXPECT_TRUE(std::any_of(r.plans.begin(), r.plans.end(), [](const Estimate& e) { return e.plan.ep > 1; }));
  // Splitting the experts over 8 ranks holds less per GPU (and costs their all-to-alls).
  Plan one = r.plans.front().plan, split = one;
  one.ep = 1;
  split.ep = 8;
  const Cluster c = load_cluster("dgx-a100-80g");
  EXPECT_LT(estimate(m, c, split).memory.peak, estimate(m, c, one).memory.peak);
  EXPECT_GT(estimate(m, c, split).time.ep_comm, 0.0);
  EXPECT_EQ(estimate(m, c, one).time.ep_comm, 0.0);
  // --fix ep pins it; a dense model searches ep = 1 only.
  o.fixed.ep = 2;
  for (const Estimate& e : search(m, load_cluster("dgx-a100-80g"), o).plans) EXPECT_EQ(e.plan.ep, 2);
  o.fixed.ep.reset();
  for (const Estimate& e : search(load_model("llama2-7b"), load_cluster("dgx-a100-80g"), o).plans) EXPECT_EQ(e.plan.ep, 1);
}

// Optimizer offload as a searched dimension (--search-offload): Llama 3 70B on one DGX A100
// fits nowhere without it; with it the search's top 10 are the twin's (without full
// recompute, whose bisection reports only the fewest layers that fit, as the twin does not),
// every one offloading, and the fastest offloads the least that fits (the CPU step costs
// more than the GPU's).
TEST(Planner, OffloadIsSearchedWhenAsked) {
  const ModelSpec m = load_model("llama3-70b");
  const Cluster c = load_cluster("dgx-a100-80g");
  SearchOptions o;
  o.gpus = 8;
  o.gbs = 16;
  o.fixed.p = 1;
  EXPECT_TRUE(search(m, c, o).plans.empty());
  search_matches_estimating_every_plan("llama3-70b", false, 1, true, Recompute::none);
  o.search_offload = true;
  const SearchResult r = search(m, c, o);
  ASSERT_FALSE(r.plans.empty());
  for (const Estimate& e : r.plans) EXPECT_GT(e.plan.offload, 0) << plan_to_inline(e.plan);
  Plan less = r.plans.front().plan;  // the next fraction down (0.25 apart) does not fit
  less.offload = less.offload - 0.25;
  EXPECT_FALSE(estimate(m, c, less).fits) << plan_to_inline(less);
  // The candidates: each ZeRO >= 1 one again for each fraction.
  o.search_offload = false;
  const int64_t without = search(m, c, o).candidates_evaluated;
  EXPECT_GT(r.candidates_evaluated, without);
}

// Ranks sharing processors compute up to max_compute_speed() faster than the layer costs
// the search bounds with (estimate.h): with the bound divided by it, the top K equals the
// first K of a search that keeps every plan (a top K larger than the space: no bound).
TEST(Planner, TheBoundHoldsWhereRanksShareProcessors) {
  const ModelSpec m = load_model("tiny-gpt");
  Cluster c = load_cluster("local-cpu");
  c.devices_per_node = 4;
  c.processors_per_node = 2;
  c.strata_stack = true;
  SearchOptions o;
  o.gpus = 4;
  o.gbs = 16;
  o.precision = Precision::fp32;
  o.top_k = 10;
  const SearchResult r = search(m, c, o);
  o.top_k = 1000000;
  const SearchResult all = search(m, c, o);
  ASSERT_EQ(r.plans.size(), 10u);
  ASSERT_GT(all.plans.size(), 100u);
  EXPECT_EQ(static_cast<int64_t>(all.plans.size()), all.simulated);
  for (size_t i = 0; i < r.plans.size(); ++i)
    EXPECT_EQ(r.plans[i].step_time_s, all.plans[i].step_time_s) << i << ": " << plan_to_inline(all.plans[i].plan);
  // Pipelines with idle ranks gain the most, and the best plans do use it.
  int faster = 0;
  for (const Estimate& e : r.plans) faster += e.compute_speed > 1.0 ? 1 : 0;
  EXPECT_GT(faster, 0);
}

// On a legacy stack (GPT-2 on A100) ZeRO-2/3 alone would make "auto" the modern stack
// (resolve_stack); the search costs those candidates on the legacy stack of the others,
// says so in the plan, and a fresh estimate of that plan agrees.
TEST(Planner, ShardedCandidatesKeepTheSearchsStack) {
  const ModelSpec m = load_model("gpt2-1.5b");
  const Cluster c = load_cluster("dgx-a100-80g");
  SearchOptions o;
  o.gpus = 8;
  o.gbs = 64;
  o.top_k = 400;
  o.fixed = parse_fixed("tp=1,pp=1");
  const SearchResult r = search(m, c, o);
  int sharded = 0;
  for (const Estimate& e : r.plans) {
    EXPECT_EQ(e.attention, AttentionKernel::unfused) << plan_to_inline(e.plan);
    EXPECT_DOUBLE_EQ(estimate(m, c, e.plan).step_time_s, e.step_time_s) << plan_to_inline(e.plan);
    if (e.plan.zero >= 2) {
      ++sharded;
      EXPECT_EQ(e.plan.software_stack, StackChoice::legacy);
      Plan fsdp = e.plan;
      fsdp.software_stack = StackChoice::automatic;  // what estimate alone assumes
      EXPECT_EQ(estimate(m, c, fsdp).attention, AttentionKernel::flash);
    } else {
      EXPECT_EQ(e.plan.software_stack, StackChoice::automatic);
    }
  }
  EXPECT_GT(sharded, 0);
}

TEST(Planner, PartialRecomputeIsMonotone) {
  // What the bisection relies on: more recomputed layers, less memory and more time.
  const ModelSpec m = load_model("gpt3-175b");
  const Cluster c = load_cluster("dgx-a100-80g");
  double mem = 1e300, time = 0;
  for (int64_t k = 1; k <= 12; ++k) {
    Plan p = load_plan("tp=8,pp=8,dp=2,gbs=64,recompute=full");
    p.recompute_layers = k == 12 ? 0 : k;
    const Estimate e = estimate(m, c, p);
    EXPECT_LE(e.memory.peak, mem) << k;
    EXPECT_GE(e.step_time_s, time) << k;
    mem = e.memory.peak;
    time = e.step_time_s;
  }
}

// ... but for the last layer: recomputing every layer of a stage adds the layer rebuilt for
// its backward to the working set (memory.cpp), so all but one may fit where all do not.
// tiny-gpt on 2 H100s, dp 2, micro-batch 8, full recompute: 3 of its 4 layers peak at
// 2,577,310,157 bytes, all 4 at 2,578,806,016. On a device of the bytes between the two the
// search must find k = 3 (it used to give up the whole block when k = 4 did not fit).
TEST(Planner, AllButOneLayerRecomputedMayFitWhereAllDoNot) {
  const ModelSpec m = load_model("tiny-gpt");
  Cluster c = load_cluster("dgx-h100-80g");
  const Plan three = load_plan("dp=2,mbs=8,gbs=128,recompute=full,recompute_num_layers=3");
  const Plan all = load_plan("dp=2,mbs=8,gbs=128,recompute=full");
  const double k3 = estimate(m, c, three).memory.peak, k4 = estimate(m, c, all).memory.peak;
  ASSERT_LT(k3, k4);
  c.device.memory_bytes = (k3 + k4) / 2;
  ASSERT_TRUE(estimate(m, c, three).fits);
  ASSERT_FALSE(estimate(m, c, all).fits);
  SearchOptions o;
  o.gpus = 2;
  o.gbs = 128;
  o.fixed = parse_fixed("tp=1,pp=1,cp=1,mbs=8,recompute=full,zero=0");
  const SearchResult r = search(m, c, o);
  ASSERT_FALSE(r.plans.empty());
  EXPECT_EQ(r.plans[0].plan.d, 2);
  EXPECT_EQ(r.plans[0].plan.recompute_layers, 3);
  EXPECT_TRUE(r.plans[0].fits);
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
    if (i) {
      EXPECT_LE(r.plans[i - 1].step_time_s, e.step_time_s);
    }
    // The planner's estimate equals a fresh one of the same plan.
    EXPECT_DOUBLE_EQ(estimate(m, c, e.plan).step_time_s, e.step_time_s);
  }
  EXPECT_GT(r.candidates_evaluated, r.feasible);
}

// A search with some dimensions pinned (--fix).
SearchResult search_fixed(const char* model, const char* cluster, int64_t gpus, int64_t gbs, const char* fixed) {
  SearchOptions o;
  o.gpus = gpus;
  o.gbs = gbs;
  if (*fixed) o.fixed = parse_fixed(fixed);
  return search(load_model(model), load_cluster(cluster), o);
}

// A search with `with` fixed beside one with `without`, on the same model and cluster;
// both find plans.
struct FixedPair {
  SearchResult with, without;
  ModelSpec m;
  Cluster cl;
};
FixedPair fixed_pair(const char* model, const char* cluster, int64_t gpus, int64_t gbs, const char* with,
                     const char* without) {
  FixedPair r{search_fixed(model, cluster, gpus, gbs, with), search_fixed(model, cluster, gpus, gbs, without),
              load_model(model), load_cluster(cluster)};
  EXPECT_FALSE(r.with.plans.empty()) << with;
  EXPECT_FALSE(r.without.plans.empty()) << without;
  return r;
}

// --fix moe_token_dispatcher_type=flex: every candidate dispatches through the flex
// dispatcher; each estimated again is its search result, none is slower than with the
// all-to-all dispatcher and (Qwen3 30B-A3B on 32 H100s: expert parallelism across nodes)
// the best is faster. On a dense model every candidate is refused (moe_dispatcher).
TEST(Planner, FlexDispatcherForEveryCandidateWhenFixed) {
  const auto [flex, a2a, m, cl] =
      fixed_pair("qwen3-30b-a3b", "dgx-h100-80g", 32, 256, "ep=32,moe_token_dispatcher_type=flex", "ep=32");
  ASSERT_FALSE(flex.plans.empty() || a2a.plans.empty());
  for (const auto& e : flex.plans) {
    EXPECT_EQ(e.plan.moe_dispatcher, MoeDispatcher::deepep);
    EXPECT_EQ(estimate(m, cl, e.plan).step_time_s, e.step_time_s);
    Plan plain = e.plan;
    plain.moe_dispatcher = MoeDispatcher::alltoall;
    EXPECT_LE(e.step_time_s, estimate(m, cl, plain).step_time_s);
  }
  EXPECT_LT(flex.plans.front().step_time_s, a2a.plans.front().step_time_s);
  const SearchResult dense = search_fixed("llama2-7b", "dgx-h100-80g", 8, 64, "moe_token_dispatcher_type=flex");
  EXPECT_TRUE(dense.plans.empty());
  EXPECT_GT(dense.rejected.at("moe_dispatcher"), 0);
  EXPECT_THROW(parse_fixed("moe_token_dispatcher_type=ring"), InputError);
  // --fix overlap_moe_expert_parallel_comm=1: the same for the exchanges beside another
  // micro-batch's compute, with delay_wgrad_compute (candidates Megatron refuses it on are
  // rejected as a2a_overlap).
  const auto [ov, plain, m2, cl2] = fixed_pair("qwen3-30b-a3b", "dgx-h100-80g", 32, 256,
                                               "ep=32,overlap_moe_expert_parallel_comm=1", "ep=32");
  ASSERT_FALSE(ov.plans.empty() || plain.plans.empty());
  for (const auto& e : ov.plans) {
    EXPECT_TRUE(e.plan.moe_a2a_overlap);
    EXPECT_TRUE(e.plan.delay_wgrad);  // (as Megatron-Bridge's recipes run it)
    EXPECT_EQ(estimate(m2, cl2, e.plan).step_time_s, e.step_time_s);
  }
  EXPECT_LT(ov.plans.front().step_time_s, plain.plans.front().step_time_s);
  EXPECT_GT(ov.rejected.count("a2a_overlap"), 0u);
}

TEST(Planner, FixPinsDimensions) {
  const SearchResult r = search_fixed("gpt3-175b", "dgx-a100-80g", 1024, 1536, "tp=8,pp=16,recompute=full");
  ASSERT_FALSE(r.plans.empty());
  for (const auto& e : r.plans) {
    EXPECT_EQ(e.plan.t, 8);
    EXPECT_EQ(e.plan.p, 16);
    EXPECT_EQ(e.plan.recompute, Recompute::full);
  }
  EXPECT_THROW(parse_fixed("tp=x"), InputError);
  EXPECT_THROW(parse_fixed("warp=2"), InputError);
  EXPECT_THROW(parse_fixed("cp_comm_type=ring"), InputError);
  EXPECT_THROW(parse_fixed("grad_reduce_in_fp32=2"), InputError);
}

// --fix selective_ac_option=op: every candidate recomputes with torchtitan's op policy (the
// search's selective recompute), each as estimate() gives it, and it fixes the recompute.
TEST(Planner, TorchtitanOpPolicyForEveryCandidate) {
  const SearchResult r = search_fixed("llama3-8b", "dgx-h100-80g", 16, 64, "selective_ac_option=op");
  ASSERT_FALSE(r.plans.empty());
  const ModelSpec m = load_model("llama3-8b");
  const Cluster cl = load_cluster("dgx-h100-80g");
  for (const auto& e : r.plans) {
    EXPECT_TRUE(e.plan.op_sac());
    EXPECT_EQ(estimate(m, cl, e.plan).step_time_s, e.step_time_s);
    EXPECT_EQ(estimate(m, cl, e.plan).memory.peak, e.memory.peak);
  }
  EXPECT_EQ(parse_fixed("selective_ac_option=op").recompute, Recompute::selective);
  EXPECT_THROW(parse_fixed("selective_ac_option=op,recompute=none"), InputError);
  EXPECT_THROW(parse_fixed("selective_ac_option=op,recompute_num_layers=2"), InputError);
  EXPECT_THROW(parse_fixed("selective_ac_option=2"), InputError);
}

// --fix grad_reduce_in_fp32=0 (not searched: it changes the numerics) gives every candidate
// bf16 main gradients, so the best plan is the one estimate gives with it, and no slower
// than the best with fp32 gradients (less to hold, half the bytes to reduce).
TEST(Planner, SixteenBitGradientsForEveryCandidate) {
  const auto [half, full, m, cl] = fixed_pair("llama3-8b", "dgx-h100-80g", 16, 64, "grad_reduce_in_fp32=0", "");
  ASSERT_FALSE(half.plans.empty() || full.plans.empty());
  for (const auto& e : half.plans) {
    EXPECT_EQ(e.plan.grad_reduce_in_fp32, Tristate::off);
    EXPECT_FALSE(e.stack.grad_reduce_in_fp32);
    EXPECT_EQ(estimate(m, cl, e.plan).step_time_s, e.step_time_s);
  }
  EXPECT_LE(half.plans.front().step_time_s, full.plans.front().step_time_s);
  EXPECT_GE(half.feasible, full.feasible);
  // --fix use_precision_aware_optimizer=1 (with its types): every ZeRO-1 candidate runs it,
  // the others cannot (Megatron's distributed optimizer only); less memory, as many fit.
  const SearchResult aware = search_fixed("llama3-8b", "dgx-h100-80g", 16, 64,
                                          "use_precision_aware_optimizer=1,exp_avg_dtype=bf16,exp_avg_sq_dtype=bf16");
  ASSERT_FALSE(aware.plans.empty());
  int zero1 = 0;
  for (const auto& e : aware.plans) {
    EXPECT_EQ(e.plan.precision_aware_optimizer, e.plan.zero == 1);
    if (e.plan.zero == 1) {
      ++zero1;
      EXPECT_EQ(e.plan.exp_avg_dtype, OptDtype::bf16);
      EXPECT_EQ(e.plan.exp_avg_sq_dtype, OptDtype::bf16);
      Plan plain = e.plan;
      plain.precision_aware_optimizer = false;
      plain.exp_avg_dtype = plain.exp_avg_sq_dtype = OptDtype::fp32;
      EXPECT_LT(e.memory.peak, estimate(m, cl, plain).memory.peak);
    }
    EXPECT_EQ(estimate(m, cl, e.plan).step_time_s, e.step_time_s);
  }
  EXPECT_GT(zero1, 0);
  EXPECT_GE(aware.feasible, full.feasible);
  EXPECT_FALSE(parse_fixed("use_precision_aware_optimizer=0").optimizer);
  EXPECT_THROW(parse_fixed("use_precision_aware_optimizer=1,exp_avg_dtype=int4"), InputError);
}

// --fix offload_modules=... gives fine-grained activation offloading to every candidate:
// each estimated again is its search result, each holds no more than without it, the
// full-recompute ones (nothing to offload) are rejected as activation_offload, and no fewer
// fit. Llama 3 70B on 64 H100, batch 128.
TEST(Planner, ActivationOffloadingForEveryCandidate) {
  const char* fix = "offload_modules=qkv_linear+core_attn+attn_proj,activation_offload_fraction=0.5";
  const SearchResult off = search_fixed("llama3-70b", "dgx-h100-80g", 64, 128, fix);
  const SearchResult plain = search_fixed("llama3-70b", "dgx-h100-80g", 64, 128, "");
  ASSERT_FALSE(off.plans.empty());
  const ModelSpec m = load_model("llama3-70b");
  const Cluster cl = load_cluster("dgx-h100-80g");
  for (const auto& e : off.plans) {
    EXPECT_EQ(e.plan.offload_modules, kOffloadQkvLinear | kOffloadCoreAttn | kOffloadAttnProj);
    EXPECT_DOUBLE_EQ(e.plan.activation_offload_fraction, 0.5);
    if (e.plan.recompute == Recompute::full) {
      EXPECT_GT(e.plan.recompute_layers, 0);  // some layers not recomputed
    }
    const Estimate again = estimate(m, cl, e.plan);
    EXPECT_EQ(again.step_time_s, e.step_time_s);
    EXPECT_EQ(again.memory.peak, e.memory.peak);
    Plan without = e.plan;
    without.offload_modules = 0;
    const Estimate kept = estimate(m, cl, without);
    if (again.memory.host_activations > 0) {
      EXPECT_LT(e.memory.activations, kept.memory.activations);
    }
  }
  EXPECT_GT(off.rejected.at("activation_offload"), 0);
  EXPECT_EQ(plain.rejected.count("activation_offload"), 0u);
  // The same candidates, counted: the every-layer recompute of a partial unit is rejected,
  // the units' other layer counts still searched.
  EXPECT_EQ(off.candidates_evaluated, plain.candidates_evaluated);
  // A host that cannot hold the node's offloaded activations: no plan offloads more than fits.
  Cluster small = cl;
  small.host.memory_bytes = 64e9;
  SearchOptions so;
  so.gpus = 64;
  so.gbs = 128;
  so.fixed = parse_fixed(fix);
  const SearchResult tight = search(m, small, so);
  ASSERT_FALSE(tight.plans.empty());
  for (const auto& e : tight.plans) {
    EXPECT_LE(e.host_memory_bytes, small.host.memory_bytes) << plan_to_inline(e.plan);
    EXPECT_TRUE(estimate(m, small, e.plan).fits) << plan_to_inline(e.plan);
  }
  EXPECT_FALSE(parse_fixed("tp=2").activation_offload);
  EXPECT_THROW(parse_fixed("activation_offload_fraction=0.5"), InputError);
  EXPECT_THROW(parse_fixed("offload_modules=attn_proj"), InputError);
}

// --fix data_parallel_shard_size=8 shards every ZeRO >= 1 candidate within groups of 8
// replicas (num_distributed_optimizer_instances = replicas / 8), rejecting those whose
// replicas it does not split (dp_instances); each estimated again is its search result.
// Llama 3 70B on 128 H100, batch 256.
TEST(Planner, HybridShardingForEveryShardedCandidate) {
  const SearchResult r = search_fixed("llama3-70b", "dgx-h100-80g", 128, 256, "data_parallel_shard_size=8");
  ASSERT_FALSE(r.plans.empty());
  const ModelSpec m = load_model("llama3-70b");
  const Cluster cl = load_cluster("dgx-h100-80g");
  for (const auto& e : r.plans) {
    if (e.plan.zero >= 1) EXPECT_EQ(e.plan.shard_ranks(), 8) << plan_to_inline(e.plan);
    else EXPECT_EQ(e.plan.dp_instances, 1);
    const Estimate again = estimate(m, cl, e.plan);
    EXPECT_EQ(again.step_time_s, e.step_time_s);
    EXPECT_EQ(again.memory.peak, e.memory.peak);
  }
  EXPECT_GT(r.rejected.at("dp_instances"), 0);
  const SearchResult n = search_fixed("llama3-70b", "dgx-h100-80g", 128, 256, "num_distributed_optimizer_instances=2");
  ASSERT_FALSE(n.plans.empty());
  for (const auto& e : n.plans) EXPECT_EQ(e.plan.dp_instances, e.plan.zero >= 1 ? 2 : 1);
  EXPECT_THROW(parse_fixed("num_distributed_optimizer_instances=2,data_parallel_shard_size=8"), InputError);
}

// Context-parallel plans are searched with each cp_comm_type (the twin above estimates all
// three); a sliding window rules out the ring (counted as cp_comm), and --fix pins the type
// to context-parallel plans. Llama 3 8B (32 heads, 8 groups) with a 4096-key window on 16
// H100s, batch 32, tp 1, cp 4: a2a and allgather remain.
TEST(Planner, ContextParallelCommTypesAreSearched) {
  ModelSpec m = load_model("llama3-8b");
  m.window_size = 4096;
  m.window_layers = m.L;
  const Cluster c = load_cluster("dgx-h100-80g");
  SearchOptions o;
  o.gpus = 16;
  o.gbs = 32;
  o.top_k = 50;
  o.fixed = parse_fixed("tp=1,cp=4");
  const SearchResult r = search(m, c, o);
  ASSERT_FALSE(r.plans.empty());
  std::set<CpComm> seen;
  for (const auto& e : r.plans) {
    EXPECT_NE(e.cp_comm, CpComm::p2p) << plan_to_inline(e.plan);
    seen.insert(e.cp_comm);
  }
  EXPECT_EQ(seen, (std::set<CpComm>{CpComm::a2a, CpComm::allgather}));
  ASSERT_TRUE(r.rejected.count("cp_comm"));
  EXPECT_GT(r.rejected.at("cp_comm"), 0);
  // Pinned to one type: the three searches together are the search over all three, candidate
  // for candidate (each counted once, each fit judged as on its own: the fits kept across
  // the types are the ones a search of one type computes afresh).
  int64_t candidates = 0, feasible = 0;
  for (const char* type : {"p2p", "a2a", "allgather"}) {
    o.fixed = parse_fixed(std::string("tp=1,cp=4,cp_comm_type=") + type);
    const SearchResult one = search(m, c, o);
    candidates += one.candidates_evaluated;
    feasible += one.feasible;
    for (const auto& e : one.plans) EXPECT_EQ(std::string(to_string(e.cp_comm)), type);
  }
  EXPECT_EQ(candidates, r.candidates_evaluated);
  EXPECT_EQ(feasible, r.feasible);
  o.fixed = parse_fixed("tp=1,cp_comm_type=a2a");
  const SearchResult a2a = search(m, c, o);
  ASSERT_FALSE(a2a.plans.empty());
  for (const auto& e : a2a.plans) {
    EXPECT_GT(e.plan.c, 1);
    EXPECT_EQ(e.cp_comm, CpComm::a2a);
  }
  // The strata executor gathers: a pinned ring is rejected, by name.
  SearchOptions s;
  s.gpus = 2;
  s.gbs = 4;
  s.fixed = parse_fixed("cp=2,cp_comm_type=p2p");
  const SearchResult ring = search(load_model("tiny-llama"), load_cluster("local-cpu"), s);
  EXPECT_TRUE(ring.plans.empty());
  EXPECT_GT(ring.rejected.count("cp_comm") ? ring.rejected.at("cp_comm") : 0, 0);
  s.fixed = parse_fixed("cp=2");
  const SearchResult gathered = search(load_model("tiny-llama"), load_cluster("local-cpu"), s);
  ASSERT_FALSE(gathered.plans.empty());
  EXPECT_EQ(gathered.plans.front().cp_comm, CpComm::allgather);
}

// balanced_end_split by hand. L = 80 on 8 stages, a layer w = 1, the embedding 0.1 and the
// output layer 2.4: the even split's slowest stage is the last, 10 + 2.4 = 12.4. Middle
// stages of 11 leave f + l = 80 - 66 = 14, balanced where f + 0.1 = 14 - f + 2.4, f = 8.15:
// 8 | 6 and 9 | 5 are both max(8.1, 8.4, 11) = max(9.1, 7.4, 11) = 11, and 8 has fewer on the
// first stage. Middles of 10 leave 20: 11 | 9 is 11.4; of 12 leave 8: 12. So 8 | 11 x 6 | 6.
// With 2 chunks every count is even: middles of 10 leave 20 (10 | 10: 12.4; 12 | 8: 12.1), of
// 12 leave 8 (4 | 4 and 6 | 2: 12, the middle the slowest), so 4 | 12 x 6 | 4 at 12; but a
// layout moving single layers does better: chunks of 5, b = ceil(2.4) - 1 = 2 layers off the
// last stage's last chunk onto the last chunks of stages 1 and 2 (a = ceil(0.1) - 1 = 0):
// stages 10.1 | 11 | 11 | 10 x 4 | 8 + 2.4, the slowest 11. With 5 chunks and an output layer
// of 1.3 (Megatron-Bridge's Llama 3 70B): chunks of 2, the counts move 5 at a time and none
// beats even's 11.3 (10 | 10 is 11.3 again, 15 | 5 is 15.1), one layer moved makes it 11:
// "Et*2|(t*2|)*32,t*3|(t*2|)*5,tL". An embedding of 1.5 (and an output layer of 0.1) moves
// a = 1 layer off the first chunk onto stage 6's first chunk: 10 + 1.5 - 1 | ... | 11, 11
// against even's 11.5 and the counts' 11.5 (10 | 10) or 12.1 (8 | 12). With 2 stages
// and 81 layers (neither 81 nor 83 splits evenly) balance is at f = (81 + 2.3) / 2 = 41.65:
// 42 | 39 is max(42.1, 41.4) = 42.1, 41 | 40 is 42.4, so 42. With an embedding of 0.5 and an
// output layer of 0.9 the even split's 10.9 is the best there is (10 | 10 again; 11 | 9 is
// 11.5; middles of 11 are 11 or more): no split.
// With multi-token prediction the modules' layers run with the output layer: the split
// weighs them there, and a layout puts the 'm's before the 'L', as Megatron-core asks. By
// hand as below (L 80, 8 stages of 2 chunks, w 1, embedding 0.1, output layer 1.3 and one
// module's layer 1: 2.3): b = ceil(2.3) - 1 = 2 layers move off the last chunk, whose text
// ends "t*3mL"; the plan passes check_plan against the model. Without the module (1.3): one.
TEST(Planner, BalancedEndSplitCarriesTheMtpLayers) {
  ModelSpec m = load_model("llama3-70b");
  m.mtp_layers = 1;
  const std::optional<Plan> q = balanced_end_split(m, load_plan("pp=8,vp=2,dp=1"), 1.0, 0.1, 2.3);
  ASSERT_TRUE(q && q->layout);
  EXPECT_EQ(q->layout->mtp, 1);
  EXPECT_EQ(q->layout->text.substr(q->layout->text.size() - 5), "t*3mL") << q->layout->text;
  EXPECT_EQ(load_plan("pp=8,vp=2,dp=1,pipeline_model_parallel_layout=" + q->layout->text).layout->mtp, 1);
  ModelSpec none = m;
  none.mtp_layers = 0;
  const std::optional<Plan> one = balanced_end_split(none, load_plan("pp=8,vp=2,dp=1"), 1.0, 0.1, 1.3);
  ASSERT_TRUE(one && one->layout);
  EXPECT_EQ(one->layout->text.substr(one->layout->text.size() - 4), "t*4L") << one->layout->text;
  Plan full = *q;
  full.t = 8;
  full.d = 8;
  full.gbs = 64;
  EXPECT_TRUE(check_plan(m, load_cluster("dgx-h100-80g"), full).empty());
  // The search's own weighing: the module's layer with the output layer's work.
  const Cluster c = load_cluster("dgx-h100-80g");
  const Plan base = load_plan("tp=8,pp=8,vp=2,dp=1,mbs=1,gbs=64,sp=1");
  ModelSpec plain = m;
  plain.mtp_layers = 0;
  const std::optional<Plan> with = balanced_end_split(m, c, base), without = balanced_end_split(plain, c, base);
  ASSERT_TRUE(with && with->layout);
  const StageLayout lw = make_layout(m.L, *with);
  const int64_t last_with = lw.layers.back();
  const int64_t last_without = without && without->layout ? make_layout(m.L, *without).layers.back() : m.L / 16;
  EXPECT_LT(last_with, last_without);
  EXPECT_TRUE(estimate(m, c, *with).valid);
}

TEST(Planner, BalancedEndSplitByHand) {
  ModelSpec m = load_model("llama3-70b");
  ASSERT_EQ(m.L, 80);
  const std::optional<Plan> a = balanced_end_split(m, load_plan("pp=8,dp=1"), 1.0, 0.1, 2.4);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->first_stage_layers, 8);
  EXPECT_EQ(a->last_stage_layers, 6);
  EXPECT_EQ(make_layout(m.L, *a).layers, (std::vector<int64_t>{8, 11, 11, 11, 11, 11, 11, 6}));
  const std::optional<Plan> b = balanced_end_split(m, load_plan("pp=8,vp=2,dp=1"), 1.0, 0.1, 2.4);
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->layout);
  EXPECT_EQ(b->layout->text, "Et*5|(t*5|)*8,(t*6|)*2,(t*5|)*4,t*3L");
  EXPECT_EQ(std::tie(b->first_stage_layers, b->last_stage_layers), std::make_tuple(int64_t{0}, int64_t{0}));
  EXPECT_EQ(make_layout(m.L, *b).layers, (std::vector<int64_t>{5, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 5, 5, 5, 5, 3}));
  EXPECT_TRUE(split_problem(m.L, *b).empty());
  const std::optional<Plan> b5 = balanced_end_split(m, load_plan("pp=8,vp=5,dp=1"), 1.0, 0.1, 1.3);
  ASSERT_TRUE(b5 && b5->layout);
  EXPECT_EQ(b5->layout->text, "Et*2|(t*2|)*32,t*3|(t*2|)*5,tL");
  const std::optional<Plan> be = balanced_end_split(m, load_plan("pp=8,vp=2,dp=1"), 1.0, 1.5, 0.1);
  ASSERT_TRUE(be && be->layout);
  EXPECT_EQ(make_layout(m.L, *be).layers, (std::vector<int64_t>{4, 5, 5, 5, 5, 5, 6, 5, 5, 5, 5, 5, 5, 5, 5, 5}));
  // No layout where the ends cost a layer or less (nothing to move), nor for the first/last
  // counts' cases without virtual stages.
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=8,vp=2,dp=1"), 1.0, 0.5, 0.9));
  EXPECT_FALSE(a->layout);
  // An output layer of 3.5: three layers move, onto stages 1-3 (the counts' best is 12, 4 | 4
  // or 6 | 2 behind middles of 12). One of 2.5 with 5 chunks of 2 moves both layers of the
  // last chunk, which keeps only the output layer ("...|L"). One of 1e300 layers: the
  // conversion does not overflow, and no layout is faster in doubles.
  const std::optional<Plan> three = balanced_end_split(m, load_plan("pp=8,vp=2,dp=1"), 1.0, 0.1, 3.5);
  ASSERT_TRUE(three && three->layout);
  EXPECT_EQ(make_layout(m.L, *three).layers,
            (std::vector<int64_t>{5, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 5, 5, 5, 2}));
  const std::optional<Plan> empty_last = balanced_end_split(m, load_plan("pp=8,vp=5,dp=1"), 1.0, 0.1, 2.5);
  ASSERT_TRUE(empty_last && empty_last->layout);
  EXPECT_EQ(empty_last->layout->text, "Et*2|(t*2|)*32,(t*3|)*2,(t*2|)*4,L");
  EXPECT_EQ(make_layout(m.L, *empty_last).layers.back(), 0);
  EXPECT_TRUE(split_problem(m.L, *empty_last).empty());
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=8,vp=2,dp=1"), 1.0, 0.1, 1e300));
  m.L = 81;
  const std::optional<Plan> c = balanced_end_split(m, load_plan("pp=2,dp=1"), 1.0, 0.1, 2.4);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->first_stage_layers, 42);
  EXPECT_EQ(c->last_stage_layers, 0);  // with two stages the first's count says it all
  EXPECT_TRUE(split_problem(m.L, *c).empty());
  m.L = 80;
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=8,dp=1"), 1.0, 0.5, 0.9));
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=1,dp=8"), 1.0, 0.1, 2.4));
  // Two stages of 40 chunks each hold 80 layers only evenly (one a chunk): no split.
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=2,vp=40,dp=1"), 1.0, 0.1, 2.4));
  // An output layer of 1000 layers: all but one layer on the first stage (79 x 0.001 against
  // 1.001; even, 1.04). Of 1e300 layers (balance far past the layers, clamped): 79 | 1 is
  // 1 + 1e-300 = 1, no faster than even's 1 + 40e-300 = 1 in doubles, so no split.
  const std::optional<Plan> far = balanced_end_split(m, load_plan("pp=2,dp=1"), 1e-3, 0.0, 1.0);
  ASSERT_TRUE(far);
  EXPECT_EQ(far->first_stage_layers, 79);
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=2,dp=1"), 1e-300, 0.0, 1.0));
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=8,dp=1"), 0.0, 0.1, 2.4));  // no layer cost: nothing to balance
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=2,vp=41,dp=1"), 1.0, 0.1, 2.4));  // 82 chunks for 80 layers
  // strata's own (L + 2) slots: Llama 3 405B's 126 layers on 16 stages are 7 | 8 x 14 | 7.
  // With e = h = 1 that is max(7 + 1, 8) = 8, and no split beats it (middles of 8 leave 14:
  // 7 | 7 is 8 again, 8 | 6 is 9; of 7 leave 28: 14 | 14 is 15). With e = 0.1 and h = 2.4
  // it is 9.4; middles of 8: 8 | 6 is max(8.1, 8.4, 8) = 8.4 (9 | 5: 9.1), so 8 x 15 | 6:
  // only the last stage's count differs from the middle's, and only it is set.
  m.L = 126;
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=16,dp=1"), 1.0, 1.0, 1.0));
  const std::optional<Plan> d = balanced_end_split(m, load_plan("pp=16,dp=1"), 1.0, 0.1, 2.4);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->first_stage_layers, 0);
  EXPECT_EQ(d->last_stage_layers, 6);
  EXPECT_TRUE(split_problem(m.L, *d).empty());
  EXPECT_EQ(make_layout(m.L, *d).stage_layers(0), 8);
  // Neither 100 nor 102 splits over 16 stages: strata's own layout is as even as possible
  // (6 or 7 a stage, the extra on the middle ones; 6 + 2.4 = 8.4 at the end), and a split
  // must beat that, not nothing: middles of 7 leave 2, 1 | 1, max(1.1, 3.4, 7) = 7. On 64
  // stages the even-as-possible layout's 1 + 2.4 is beaten by no split (middles of 1 leave
  // 38, 20 | 18 and more).
  m.L = 100;
  const std::optional<Plan> u = balanced_end_split(m, load_plan("pp=16,dp=1"), 1.0, 0.1, 2.4);
  ASSERT_TRUE(u);
  EXPECT_EQ(u->first_stage_layers, 1);
  EXPECT_EQ(u->last_stage_layers, 1);
  EXPECT_EQ(make_layout(m.L, *u).stage_layers(7), 7);
  EXPECT_FALSE(balanced_end_split(m, load_plan("pp=64,dp=1"), 1.0, 0.1, 2.4));
}

// Llama 3 70B in FP8 on 64 H100 with tp 4 and pp 8 pinned: its 128k-vocabulary output layer
// runs in bf16 beside FP8 layers, so the last stage of an even split is the slowest; the
// search finds the first/last split that balances it (7 | 11 x 6 | 7 or nearby) and ranks
// it ahead of every even plan, as a fresh estimate of both agrees; --fix uneven_split=0
// searches strata's own layouts only, =1 the splits only.
TEST(Planner, SplitsThatBalanceTheEndsAreSearched) {
  auto fp8 = [](const char* fixed) {
    SearchOptions o;
    o.gpus = 64;
    o.gbs = 256;
    o.precision = Precision::fp8;
    o.fixed = parse_fixed(fixed);
    return search(load_model("llama3-70b"), load_cluster("dgx-h100-80g"), o);
  };
  const SearchResult r = fp8("tp=4,pp=8");
  const SearchResult even = fp8("tp=4,pp=8,uneven_split=0");
  const SearchResult only = fp8("tp=4,pp=8,uneven_split=1");
  ASSERT_FALSE(r.plans.empty());
  ASSERT_FALSE(even.plans.empty());
  ASSERT_FALSE(only.plans.empty());
  const Plan& best = r.plans.front().plan;
  EXPECT_TRUE(best.explicit_split());
  const StageLayout lay = make_layout(80, best);
  EXPECT_LT(lay.stage_layers(7), lay.stage_layers(3));  // the last stage lighter than a middle one
  EXPECT_LT(r.plans.front().step_time_s, 0.98 * even.plans.front().step_time_s);
  EXPECT_DOUBLE_EQ(r.plans.front().step_time_s, only.plans.front().step_time_s);
  for (const auto& e : even.plans) EXPECT_FALSE(e.plan.explicit_split());
  for (const auto& e : only.plans) EXPECT_TRUE(e.plan.explicit_split());
  EXPECT_GT(r.candidates_evaluated, even.candidates_evaluated);
  const ModelSpec m = load_model("llama3-70b");
  const Cluster c = load_cluster("dgx-h100-80g");
  EXPECT_DOUBLE_EQ(estimate(m, c, best).step_time_s, r.plans.front().step_time_s);
  EXPECT_THROW(parse_fixed("uneven_split=2"), InputError);
  // With 5 virtual stages the counts would move 5 layers at a time: a layout moves one, off
  // the last stage's last chunk onto stage 1's (Megatron-Bridge's hand-set layout moves it
  // onto stage 3's), some 4 % faster than the even layout.
  const SearchResult vr = fp8("tp=4,pp=8,vp=5,cp=1,mbs=1,zero=1,recompute=none");
  const SearchResult ve = fp8("tp=4,pp=8,vp=5,cp=1,mbs=1,zero=1,recompute=none,uneven_split=0");
  ASSERT_FALSE(vr.plans.empty());
  ASSERT_FALSE(ve.plans.empty());
  const Plan& vb = vr.plans.front().plan;
  ASSERT_TRUE(vb.layout);
  EXPECT_EQ(vb.layout->text, "Et*2|(t*2|)*32,t*3|(t*2|)*5,tL");
  EXPECT_EQ(make_layout(80, vb).stage_layers(1), 11);
  EXPECT_EQ(make_layout(80, vb).stage_layers(7), 9);
  EXPECT_LT(vr.plans.front().step_time_s, 0.97 * ve.plans.front().step_time_s);
  EXPECT_DOUBLE_EQ(estimate(m, c, vb).step_time_s, vr.plans.front().step_time_s);
  Plan hand = vb;  // Megatron-Bridge's: the same within 0.1 % in this model
  hand.layout = std::make_shared<const PipelineLayout>(
      parse_pipeline_layout("Et*2|(t*2|)*34,t*3|(t*2|)*3,tL", "pipeline_model_parallel_layout"));
  EXPECT_NEAR(estimate(m, c, hand).step_time_s, vr.plans.front().step_time_s, 1e-3 * vr.plans.front().step_time_s);
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

// Micro-batches that p does not divide: Megatron-core's larger group (5 micro-batches on 4
// stages run as one group of 5) is searched like any other plan, and costed as estimate does.
TEST(Planner, InterleavedWithMicroBatchGroups) {
  const SearchResult r = search_fixed("llama3-70b", "dgx-h100-80g", 64, 40, "pp=4,vp=5,dp=8,mbs=1");
  ASSERT_FALSE(r.plans.empty());
  for (const auto& e : r.plans) {
    EXPECT_EQ(e.plan.microbatches(), 5);
    EXPECT_EQ(e.plan.vp_group_size(), 5);
    EXPECT_DOUBLE_EQ(estimate(load_model("llama3-70b"), load_cluster("dgx-h100-80g"), e.plan).step_time_s,
                     e.step_time_s);
  }
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
  EXPECT_EQ(bg.find("--microbatch-group-size-per-virtual-pipeline-stage"), std::string::npos);  // 64 micro-batches: p
  // 40 micro-batches on 16 stages: groups of 20 (17-19 leave 6, 4, 2).
  const Plan odd = load_plan("tp=8,pp=16,dp=8,vp=4,gbs=320");
  EXPECT_NE(export_megatron(big, odd, resolve_stack(big, load_cluster("dgx-h100-80g"), odd))
                .find("--microbatch-group-size-per-virtual-pipeline-stage 20"),
            std::string::npos);
  const Json ds = Json::parse(export_deepspeed(m, p, st));
  // User buffers ("auto" on the H100 with tp 8 in a node) have no DeepSpeed field: said.
  EXPECT_EQ(ds["strata_parallel_layout"]["megatron_tp_comm_overlap"], true);
  EXPECT_NE(mg.find("--tp-comm-overlap"), std::string::npos);
  EXPECT_EQ(ds["train_micro_batch_size_per_gpu"], 1);
  EXPECT_EQ(ds["gradient_accumulation_steps"], 64);
  EXPECT_EQ(ds["zero_optimization"]["stage"], 1);
  EXPECT_EQ(ds["bf16"]["enabled"], true);
  EXPECT_EQ(ds["train_batch_size"], 512);

  // Megatron-Bridge: ConfigContainer overrides, one per line. Virtual stages per rank (not
  // layers per virtual stage), the distributed optimizer on both of its configs.
  auto lines_of = [](const std::string& text) {
    std::vector<std::string> lines;
    for (size_t a = 0, b; a < text.size(); a = b + 1) {
      b = text.find('\n', a);
      if (b == std::string::npos) b = text.size();
      std::string line = text.substr(a, b - a);
      if (line.size() >= 2 && line.compare(line.size() - 2, 2, " \\") == 0) line.resize(line.size() - 2);
      if (!line.empty() && line[0] != '#') lines.push_back(line);
    }
    return lines;
  };
  auto has = [](const std::vector<std::string>& lines, const std::string& line) {
    return std::find(lines.begin(), lines.end(), line) != lines.end();
  };
  const std::vector<std::string> br = lines_of(export_bridge(m, p, st));
  for (const char* o : {"model.transformer.tensor_model_parallel_size=8", "model.transformer.pipeline_model_parallel_size=4",
                        "model.transformer.virtual_pipeline_model_parallel_size=5", "model.transformer.context_parallel_size=1",
                        "model.transformer.sequence_parallel=true", "train.micro_batch_size=1", "train.global_batch_size=512",
                        "dataset.seq_length=8192", "ddp.use_distributed_optimizer=true",
                        "optimizer.use_distributed_optimizer=true", "model.transformer.recompute_granularity=selective",
                        "mixed_precision=bf16_mixed", "model.transformer.num_layers=80", "model.transformer.num_query_groups=8"})
    EXPECT_TRUE(has(br, o)) << o;
  for (const std::string& line : br) EXPECT_NE(line.find('='), std::string::npos) << line;  // KEY=VALUE only
  // Every setting a recipe may hold said, at its default too (a recipe's split, recompute
  // layer count or Megatron-FSDP would otherwise survive the overrides).
  for (const char* o : {"model.transformer.recompute_method=null", "model.transformer.recompute_num_layers=null",
                        "model.transformer.recompute_modules=[core_attn]", "ddp.use_megatron_fsdp=false", "dist.use_megatron_fsdp=false",
                        "optimizer.use_precision_aware_optimizer=false", "model.transformer.account_for_embedding_in_pipeline_split=false",
                        "model.transformer.account_for_loss_in_pipeline_split=false", "model.transformer.pipeline_model_parallel_layout=null"})
    EXPECT_TRUE(has(br, o)) << o;
  // What overrides cannot reach, in Python: user buffers as costed (on: "auto" on the
  // modern stack with tp 8 in a node; a recipe's CommOverlapConfig may be None, where an
  // override of its field fails); the attention backend an enum, left to the recipe where
  // fused.
  const std::string br_text = export_bridge(m, p, st);
  EXPECT_NE(br_text.find("#   cfg.comm_overlap = cfg.comm_overlap or CommOverlapConfig(tp_comm_overlap=False)\n"
                         "#   cfg.comm_overlap.tp_comm_overlap = True\n"
                         "#   cfg.comm_overlap.overlap_grad_reduce = True\n"),
            std::string::npos)
      << br_text;
  {
    Plan q = p;  // tp_comm_overlap=0: off
    q.tp_comm_overlap = Tristate::off;
    const std::string off_text = export_bridge(m, q, resolve_stack(m, load_cluster("dgx-h100-80g"), q));
    EXPECT_NE(off_text.find("#   cfg.comm_overlap.tp_comm_overlap = False\n"), std::string::npos) << off_text;
  }
  EXPECT_EQ(br_text.find("attention_backend"), std::string::npos) << br_text;
  for (const std::string& line : br) EXPECT_NE(line.rfind("comm_overlap.", 0), 0u) << line;
  // Experts: both sizes said at 1 (recipes hard-set them), the exchange overlap in Python.
  const ModelSpec qm = load_model("qwen3-30b-a3b");
  const Plan qp = load_plan("tp=2,dp=4,mbs=1,gbs=64,sp=1,zero=1");
  const std::string qb = export_bridge(qm, qp, resolve_stack(qm, load_cluster("dgx-h100-80g"), qp));
  const std::vector<std::string> ql = lines_of(qb);
  EXPECT_TRUE(has(ql, "model.expert_model_parallel_size=1")) << qb;
  EXPECT_TRUE(has(ql, "model.expert_tensor_parallel_size=2")) << qb;
  EXPECT_NE(qb.find("#   cfg.comm_overlap.overlap_moe_expert_parallel_comm = False\n"), std::string::npos) << qb;
  // Unfused attention: an enum, set in Python.
  const Plan up = load_plan("tp=8,pp=4,dp=8,mbs=1,gbs=512,zero=1,attention=unfused");
  EXPECT_NE(export_bridge(m, up, resolve_stack(m, load_cluster("dgx-h100-80g"), up)).find("AttnBackend.unfused"),
            std::string::npos);
  // 126 layers in (L + 2) / p slots; partial recompute; FP8; ZeRO-3 as Megatron-FSDP.
  const Plan fp = load_plan("tp=8,pp=16,dp=8,vp=4,gbs=512,recompute=full,recompute_num_layers=1,precision=fp8,zero=3");
  const std::vector<std::string> bb = lines_of(export_bridge(big, fp, resolve_stack(big, load_cluster("dgx-h100-80g"), fp)));
  for (const char* o : {"model.transformer.virtual_pipeline_model_parallel_size=4", "model.transformer.account_for_embedding_in_pipeline_split=true",
                        "model.transformer.account_for_loss_in_pipeline_split=true", "model.transformer.recompute_granularity=full",
                        "model.transformer.recompute_method=block", "model.transformer.recompute_num_layers=1",
                        "ddp.use_megatron_fsdp=true",
                        "dist.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
                        "model.transformer.recompute_modules=null", "model.transformer.pipeline_model_parallel_layout=null",
                        "model.transformer.num_layers_in_first_pipeline_stage=null", "model.transformer.num_layers_in_last_pipeline_stage=null"})
    EXPECT_TRUE(has(bb, o)) << o;
  // No override of a named mixed_precision recipe's own fields (Bridge's parser refuses them
  // in struct mode): the FP8 recipe's bf16 first and last layers turned off in Python, its
  // FP8 weight gathers kept (as costed with ZeRO).
  for (const std::string& line : bb) EXPECT_NE(line.rfind("mixed_precision.", 0), 0u) << line;
  const std::string bb_text = export_bridge(big, fp, resolve_stack(big, load_cluster("dgx-h100-80g"), fp));
  EXPECT_NE(bb_text.find("#   cfg.mixed_precision = get_mixed_precision_config(\"bf16_with_fp8_current_scaling_mixed\")\n"
                         "#   cfg.mixed_precision.first_last_layers_bf16 = False\n"),
            std::string::npos)
      << bb_text;
  // (an override of mixed_precision would put the named recipe back over the Python's)
  for (const std::string& line : bb) EXPECT_NE(line.rfind("mixed_precision=", 0), 0u) << line;
  EXPECT_EQ(bb_text.find("fp8_param_gather"), std::string::npos) << bb_text;
  EXPECT_FALSE(has(bb, "model.transformer.microbatch_group_size_per_vp_stage=16"));  // 64 micro-batches: groups of p, unset
  // fp8 without ZeRO: bf16 weights as costed, where the recipe would gather fp8 ones.
  const Plan f0 = load_plan("tp=8,pp=16,dp=8,gbs=512,precision=fp8,zero=0");
  EXPECT_NE(export_bridge(big, f0, resolve_stack(big, load_cluster("dgx-h100-80g"), f0))
                .find("#   cfg.mixed_precision.fp8_param_gather = False"),
            std::string::npos);
  // ZeRO-2/3 costed on the legacy stack (as the search keeps it where the plain plan is):
  // Megatron-FSDP runs Megatron-core's, which the export says.
  const Plan lz = load_plan("tp=8,pp=4,dp=8,gbs=512,zero=2,software_stack=legacy");
  EXPECT_NE(export_megatron(m, lz, resolve_stack(m, load_cluster("dgx-h100-80g"), lz)).find("legacy software stack"),
            std::string::npos);
  EXPECT_EQ(export_megatron(big, f0, resolve_stack(big, load_cluster("dgx-h100-80g"), f0)).find("--fp8-param-gather"),
            std::string::npos);
  // Megatron's groups where p does not divide the micro-batches; ZeRO-2; no virtual stages;
  // the split a plan gives.
  const Plan z2 = load_plan("tp=8,pp=16,dp=8,vp=4,gbs=320,zero=2,precision=fp16");
  const std::vector<std::string> b2 = lines_of(export_bridge(big, z2, resolve_stack(big, load_cluster("dgx-h100-80g"), z2)));
  for (const char* o : {"model.transformer.microbatch_group_size_per_vp_stage=20", "ddp.data_parallel_sharding_strategy=optim_grads",
                        "mixed_precision=fp16_mixed", "model.transformer.recompute_granularity=null"})
    EXPECT_TRUE(has(b2, o)) << o;
  const Plan split = load_plan("tp=8,pp=4,dp=2,gbs=64,decoder_first_pipeline_num_layers=18,decoder_last_pipeline_num_layers=18");
  const std::vector<std::string> bs = lines_of(export_bridge(m, split, resolve_stack(m, load_cluster("dgx-h100-80g"), split)));
  for (const char* o : {"model.transformer.virtual_pipeline_model_parallel_size=null", "model.transformer.num_layers_in_first_pipeline_stage=18",
                        "model.transformer.num_layers_in_last_pipeline_stage=18", "ddp.use_distributed_optimizer=false"})
    EXPECT_TRUE(has(bs, o)) << o;
  // A layout: Hydra's override parser takes '|', '(' and ',' only in a quoted value, and the
  // shell takes the quotes only inside its own.
  Plan laid = load_plan("tp=4,pp=8,vp=5,dp=2,gbs=256,zero=3");
  laid.layout = std::make_shared<const PipelineLayout>(
      parse_pipeline_layout("Et*2|(t*2|)*34,t*3|(t*2|)*3,tL", "pipeline_model_parallel_layout"));
  const std::vector<std::string> bl = lines_of(export_bridge(m, laid, resolve_stack(m, load_cluster("dgx-h100-80g"), laid)));
  for (const char* o : {"\"model.transformer.pipeline_model_parallel_layout='Et*2|(t*2|)*34,t*3|(t*2|)*3,tL'\"",
                        "model.transformer.virtual_pipeline_model_parallel_size=5", "checkpoint.ckpt_format=fsdp_dtensor",
                        "model.seq_length=8192", "dataset.seq_length=8192"})
    EXPECT_TRUE(has(bl, o)) << o;
  // Context parallelism names how keys and values travel, in all three exports.
  const Plan cp = load_plan("tp=4,pp=2,dp=2,cp=4,gbs=64,cp_comm_type=allgather");
  const Stack cst = resolve_stack(m, load_cluster("dgx-h100-80g"), cp);
  // (Megatron-core and Transformer Engine spell it all_gather.)
  EXPECT_NE(export_megatron(m, cp, cst).find("--cp-comm-type all_gather"), std::string::npos);
  EXPECT_TRUE(has(lines_of(export_bridge(m, cp, cst)), "model.transformer.cp_comm_type=all_gather"));
  EXPECT_EQ(Json::parse(export_deepspeed(m, cp, cst))["strata_parallel_layout"]["cp_comm_type"], "allgather");
  EXPECT_NE(export_megatron(m, load_plan("cp=2,gbs=8"), cst).find("--cp-comm-type p2p"), std::string::npos);
  EXPECT_EQ(export_megatron(m, p, st).find("--cp-comm-type"), std::string::npos);
  // 16-bit main gradients: Megatron-Bridge's two settings, DeepSpeed's data types.
  const Plan g = load_plan("tp=8,pp=4,dp=8,gbs=512,zero=1,grad_reduce_in_fp32=0");
  const Stack gst = resolve_stack(m, load_cluster("dgx-h100-80g"), g);
  const std::string bg16 = export_bridge(m, g, gst);
  EXPECT_NE(bg16.find("#   cfg.mixed_precision = get_mixed_precision_config(\"bf16_mixed\")\n"
                      "#   cfg.mixed_precision.grad_reduce_in_fp32 = False\n"),
            std::string::npos)
      << bg16;
  EXPECT_EQ(export_bridge(m, p, st).find("grad_reduce_in_fp32"), std::string::npos);  // bf16_mixed's own
  const Json dg = Json::parse(export_deepspeed(m, g, gst));
  EXPECT_EQ(dg["data_types"]["grad_accum_dtype"], "bf16");
  EXPECT_EQ(dg["communication_data_type"], "bf16");
  const Json back = {{"data_types", dg["data_types"]}, {"communication_data_type", dg["communication_data_type"]}};
  EXPECT_EQ(plan_from_json(back, "deepspeed").grad_reduce_in_fp32, Tristate::off);
  // Said also where the plan leaves it to auto (fp32 in bf16): DeepSpeed's ZeRO defaults to 16 bits.
  EXPECT_EQ(ds["data_types"]["grad_accum_dtype"], "fp32");
  EXPECT_EQ(ds["communication_data_type"], "fp32");
  // The precision-aware optimizer: Megatron's flags, Bridge's optimizer settings.
  const Plan pa = load_plan("tp=8,pp=4,dp=8,gbs=512,zero=1,use_precision_aware_optimizer=1,exp_avg_dtype=bf16");
  const Stack pst = resolve_stack(m, load_cluster("dgx-h100-80g"), pa);
  const std::string pm = export_megatron(m, pa, pst);
  EXPECT_NE(pm.find("--use-precision-aware-optimizer"), std::string::npos) << pm;
  EXPECT_NE(pm.find("--exp-avg-dtype bf16"), std::string::npos) << pm;
  EXPECT_EQ(pm.find("--exp-avg-sq-dtype"), std::string::npos) << pm;
  const std::string pb = export_bridge(m, pa, pst);
  EXPECT_TRUE(has(lines_of(pb), "optimizer.use_precision_aware_optimizer=true"));
  for (const char* o : {"optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=fp32", "optimizer.main_params_dtype=fp32",
                        "optimizer.main_grads_dtype=fp32"})
    EXPECT_TRUE(has(lines_of(pb), o)) << o;
  // Without it every type fp32, said (DeepSeek-V3's recipe holds bf16 ones, which Megatron-core
  // refuses without the precision-aware optimizer).
  for (const char* o : {"optimizer.exp_avg_dtype=fp32", "optimizer.main_grads_dtype=fp32"}) EXPECT_TRUE(has(br, o)) << o;
}

}  // namespace
}  // namespace strata
