// Speed of the cost model and the planner, one core. Reports, per benchmark:
//   estimates/s   full estimate() calls (memory, op-by-op layer costs, schedule walk)
//   candidates/s  plans the search accounts for per second (rejected, bounded or estimated)
// Run: make bench (Release build). Numbers go to README with the machine named.
#include <benchmark/benchmark.h>

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
