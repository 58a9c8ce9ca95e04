// Speed of the cost model and the planner, one core. Reports, per benchmark:
//   estimates/s   full estimate() calls (memory, op-by-op layer costs, schedule walk)
//   candidates/s  plans the search accounts for per second (rejected, bounded or estimated)
// Run: make bench (Release build). Numbers go to README with the machine named.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "costmodel/simulate.h"
#include "planner/search.h"

namespace strata {
namespace {

void estimate_plan(benchmark::State& state, const char* model, const char* cluster, const char* plan) {
  const ModelSpec m = load_model(model);
  const Cluster c = load_cluster(cluster);
  const Plan p = load_plan(plan);
  double sink = 0;
  for (auto _ : state) {
    const Estimate e = estimate(m, c, p);
    sink += e.step_time_s;
    benchmark::DoNotOptimize(sink);
  }
  state.counters["estimates/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_Estimate_Gpt3_1024_A100(benchmark::State& s) {
  estimate_plan(s, "gpt3-175b", "dgx-a100-80g", "tp=8,pp=16,dp=8,mbs=1,gbs=1536,recompute=full,precision=fp16");
}
void BM_Estimate_Gpt3_Interleaved(benchmark::State& s) {
  estimate_plan(s, "gpt3-175b", "dgx-a100-80g", "tp=8,pp=8,dp=16,vp=3,mbs=1,gbs=1536,recompute=selective,sp=1");
}
// 95 micro-batches on 8 stages: Megatron-core's groups of 12 (the last of 11).
void BM_Estimate_Gpt3_Interleaved_Groups(benchmark::State& s) {
  estimate_plan(s, "gpt3-175b", "dgx-a100-80g", "tp=8,pp=8,dp=16,vp=3,mbs=1,gbs=1520,recompute=full");
}
void BM_Estimate_Llama3_70b_H100(benchmark::State& s) {
  estimate_plan(s, "llama3-70b", "dgx-h100-80g", "tp=8,pp=4,dp=16,mbs=1,gbs=512,zero=1,sp=1,recompute=selective");
}
void BM_Estimate_Llama3_8b_Fsdp(benchmark::State& s) {
  estimate_plan(s, "llama3-8b", "dgx-h100-80g", "dp=64,mbs=2,gbs=512,zero=3");
}
BENCHMARK(BM_Estimate_Gpt3_1024_A100)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Estimate_Gpt3_Interleaved)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Estimate_Gpt3_Interleaved_Groups)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Estimate_Llama3_70b_H100)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Estimate_Llama3_8b_Fsdp)->Unit(benchmark::kMicrosecond);

// Every plan of the GPT-3 case (1024 A100, batch 1536) that check_plan accepts, estimated
// in turn: the rate a search without its bound and bisection would run at, over the mix of
// plans it meets (most of them interleaved). The space is the search's (planner/search.cpp):
// tp, pp, cp dividing the GPUs, vp dividing the layers per stage (or the (L + 2) / p slots
// per stage), micro-batch sizes dividing the batch per replica, GPipe where there is one
// chunk and a pipeline, sequence parallelism where tp > 1, no / selective / full recompute
// (full recompute of every layer: the search bisects recompute_num_layers), ZeRO 0-3 where
// there are replicas; ZeRO-2/3 kept on the preset's legacy stack and context parallelism on
// its unfused attention, as the search costs them (so check_plan rejects cp > 1 here).
std::vector<Plan> gpt3_space(const ModelSpec& m, const Cluster& c) {
  const int64_t N = 1024, gbs = 1536;
  auto divisors = [](int64_t n) {
    std::vector<int64_t> d;
    for (int64_t i = 1; i <= n; ++i)
      if (n % i == 0) d.push_back(i);
    return d;
  };
  std::vector<Plan> plans;
  for (int64_t t : divisors(N))
    for (int64_t p : divisors(N / t))
      for (int64_t cp : divisors(N / (t * p))) {
        const int64_t d = N / (t * p * cp);
        std::vector<int64_t> vs = {1};
        for (int64_t slots : {m.L, m.L + 2})
          if (p > 1 && slots % p == 0)
            for (int64_t v : divisors(slots / p))
              if (v > 1 && std::find(vs.begin(), vs.end(), v) == vs.end()) vs.push_back(v);
        if (gbs % d != 0) continue;
        for (int64_t v : vs) {
          // Uneven pipelines only in the (L + 2) / p form, as the search has them.
          if (v == 1 && p > 1 && m.L % p != 0 && (m.L + 2) % p != 0) continue;
          for (int64_t mbs : divisors(gbs / d))
            for (int gp = 0; gp < (v > 1 || p == 1 ? 1 : 2); ++gp)
              for (int sp = 0; sp < (t > 1 ? 2 : 1); ++sp)
                for (int rc = 0; rc < 3; ++rc)
                  for (int zero = 0; zero < (d * cp > 1 ? 4 : 1); ++zero) {
                    Plan pl;
                    pl.t = t; pl.p = p; pl.c = cp; pl.d = d; pl.v = v; pl.mbs = mbs; pl.gbs = gbs;
                    pl.gpipe = gp == 1; pl.sp = sp == 1; pl.zero = zero;
                    pl.recompute = static_cast<Recompute>(rc);
                    if (zero >= 2) pl.software_stack = StackChoice::legacy;
                    if (cp > 1) pl.attention = AttentionChoice::unfused;
                    if (check_plan(m, c, pl).empty()) plans.push_back(pl);
                  }
        }
      }
  return plans;
}

void BM_Estimate_Gpt3_Space(benchmark::State& state) {
  const ModelSpec m = load_model("gpt3-175b");
  const Cluster c = load_cluster("dgx-a100-80g");
  const std::vector<Plan> plans = gpt3_space(m, c);
  int64_t interleaved = 0;
  for (const Plan& pl : plans) interleaved += pl.v > 1 ? 1 : 0;
  double sink = 0;
  for (auto _ : state) {
    for (const Plan& pl : plans) sink += estimate(m, c, pl).step_time_s;
    benchmark::DoNotOptimize(sink);
  }
  state.counters["estimates/s"] = benchmark::Counter(static_cast<double>(state.iterations() * plans.size()),
                                                     benchmark::Counter::kIsRate);
  state.counters["plans"] = static_cast<double>(plans.size());
  state.counters["interleaved"] = static_cast<double>(interleaved);
}
BENCHMARK(BM_Estimate_Gpt3_Space)->Unit(benchmark::kMillisecond);

void search_case(benchmark::State& state, const char* model, const char* cluster, int64_t gpus, int64_t gbs) {
  const ModelSpec m = load_model(model);
  const Cluster c = load_cluster(cluster);
  SearchOptions o;
  o.gpus = gpus;
  o.gbs = gbs;
  int64_t candidates = 0, simulated = 0;
  for (auto _ : state) {
    const SearchResult r = search(m, c, o);
    candidates += r.candidates_evaluated;
    simulated += r.simulated;
    benchmark::DoNotOptimize(r.plans.data());
  }
  state.counters["candidates/s"] = benchmark::Counter(static_cast<double>(candidates), benchmark::Counter::kIsRate);
  state.counters["estimated/s"] = benchmark::Counter(static_cast<double>(simulated), benchmark::Counter::kIsRate);
  state.counters["candidates"] = static_cast<double>(candidates) / static_cast<double>(state.iterations());
}

void BM_Search_Gpt3_1024_A100(benchmark::State& s) { search_case(s, "gpt3-175b", "dgx-a100-80g", 1024, 1536); }
void BM_Search_Llama3_405b_16384_H100(benchmark::State& s) {
  search_case(s, "llama3-405b", "dgx-h100-80g", 16384, 2048);
}
BENCHMARK(BM_Search_Gpt3_1024_A100)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Search_Llama3_405b_16384_H100)->Unit(benchmark::kMillisecond);

// The pipeline walk alone, the position walk (what estimate() uses) against the windowed
// walk of stored schedules (its fallback and former method), on stages alike but for the
// ends (embedding, output layer), as in the two deep plans above.
StageTimes ends_heavier(int64_t p, int64_t v) {
  StageTimes st;
  st.p = p;
  st.v = v;
  st.fwd_s.assign(static_cast<size_t>(p * v), 0.05);
  st.bwd_s.assign(static_cast<size_t>(p * v), 0.10);
  st.send_s.assign(static_cast<size_t>(p), 0.001);
  st.fwd_s.front() += 0.002;
  st.fwd_s.back() += 0.004;
  st.bwd_s.back() += 0.008;
  return st;
}
void walk_case(benchmark::State& state, bool position, ScheduleKind kind, int64_t p, int64_t v, int64_t m) {
  const StageTimes st = ends_heavier(p, v);
  double sink = 0;
  for (auto _ : state) {
    const SimResult r = position ? simulate_pipeline(kind, m, st, false) : simulate_windows(kind, m, st, false);
    sink += r.makespan_s;
    benchmark::DoNotOptimize(sink);
  }
  state.counters["walks/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
void BM_Walk_1f1b_p16_m192_Position(benchmark::State& s) { walk_case(s, true, ScheduleKind::one_f_one_b, 16, 1, 192); }
void BM_Walk_1f1b_p16_m192_Windows(benchmark::State& s) { walk_case(s, false, ScheduleKind::one_f_one_b, 16, 1, 192); }
void BM_Walk_Interleaved_p8_v3_m96_Position(benchmark::State& s) {
  walk_case(s, true, ScheduleKind::interleaved, 8, 3, 96);
}
void BM_Walk_Interleaved_p8_v3_m96_Windows(benchmark::State& s) {
  walk_case(s, false, ScheduleKind::interleaved, 8, 3, 96);
}
BENCHMARK(BM_Walk_1f1b_p16_m192_Position)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Walk_1f1b_p16_m192_Windows)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Walk_Interleaved_p8_v3_m96_Position)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Walk_Interleaved_p8_v3_m96_Windows)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace strata

BENCHMARK_MAIN();
