// Speed of the CPU executor on one core (Google Benchmark). Reports, per benchmark:
//   GEMM:       FLOP/s of the backend's float GEMM at square sizes (the machine's rate)
//   16-bit:     values/s of the rounding, packing and unpacking passes (bf16, fp16) over
//               1M values (4 MiB: in the caches, as a layer's fresh activations mostly are)
//   train step: model FLOP/s of a whole training step on one rank (Megatron's model
//               FLOPs: 6 * params * tokens + attention, nothing for recompute)
// scripts/bench-executor.sh runs this and the data-parallel overlap check and prints
// the ratios the README quotes. Run: make bench-executor (Release build).
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <string>
#include <vector>

#include "executor/backend.h"
#include "executor/comm.h"
#include "executor/train.h"

namespace strata {
namespace {

void BM_Gemm(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto be = make_cpu_backend();
  std::vector<float> a(static_cast<size_t>(n * n), 0.5f), b(a.size(), 0.25f), c(a.size(), 0.0f);
  for (auto _ : state) {
    be->gemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * static_cast<double>(n * n * n) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Gemm)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond);

// Arg 0: round_to, 1: round_copy, 2: pack16, 3: unpack16; arg 1: 0 bf16, 1 fp16.
void BM_Sixteen(benchmark::State& state) {
  const int64_t n = int64_t{1} << 20;
  const int op = static_cast<int>(state.range(0));
  const Precision p = state.range(1) == 0 ? Precision::bf16 : Precision::fp16;
  auto be = make_cpu_backend();
  std::vector<float> x(static_cast<size_t>(n)), y(x.size());
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = 0.001f * static_cast<float>(i % 4099) - 2.0f;
  std::vector<uint16_t> h(x.size());
  be->pack16(h.data(), x.data(), n, p);
  for (auto _ : state) {
    if (op == 0) {  // (in place: on a fresh copy of x each time, copied with the clock stopped)
      state.PauseTiming();
      std::copy(x.begin(), x.end(), y.begin());
      state.ResumeTiming();
      be->round_to(y.data(), n, p);
    }
    if (op == 1) be->round_copy(y.data(), x.data(), n, p);
    if (op == 2) be->pack16(h.data(), x.data(), n, p);
    if (op == 3) be->unpack16(y.data(), h.data(), n, p);
    benchmark::DoNotOptimize(y.data());
    benchmark::DoNotOptimize(h.data());
  }
  static const char* const names[] = {"round_to", "round_copy", "pack16", "unpack16"};
  state.SetLabel(std::string(names[op]) + " " + to_string(p));
  state.counters["values/s"] =
      benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Sixteen)->ArgsProduct({{0, 1, 2, 3}, {0, 1}})->Unit(benchmark::kMicrosecond);

void train_steps(benchmark::State& state, const char* model, const char* plan) {
  const ModelSpec m = load_model(model);
  const Plan p = load_plan(plan);
  TrainOptions o;
  auto comm = make_mpi_comm();
  auto be = make_cpu_backend();
  double flops = 0, seconds = 0;
  for (auto _ : state) {
    o.steps = 3;
    const TrainResult r = train(m, p, o, *comm, *be);
    flops = r.model_flops_per_step;
    seconds = r.median_step_time_s;
    state.SetIterationTime(seconds);
  }
  state.counters["model FLOP/s"] = flops / seconds;
  state.counters["tokens/s"] = static_cast<double>(p.gbs * m.S) / seconds;
}

void BM_TrainStep_Gpt512(benchmark::State& s) {
  train_steps(s, STRATA_SOURCE_DIR "/examples/gpt-512.model.json", "mbs=4,gbs=4,precision=fp32");
}
BENCHMARK(BM_TrainStep_Gpt512)->UseManualTime()->Iterations(2)->Unit(benchmark::kMillisecond);

void BM_TrainStep_TinyGpt(benchmark::State& s) { train_steps(s, "tiny-gpt", "mbs=8,gbs=8,precision=fp32"); }
BENCHMARK(BM_TrainStep_TinyGpt)->UseManualTime()->Iterations(2)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
