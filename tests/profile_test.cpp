// strata profile end to end on 2 ranks (--quick): every collective result is checked
// (#wrong = 0 in every row of the nccl-tests table), the written cluster JSON loads with
// the preset loader and is accepted by estimate; plus the bus factors and the fit on
// synthetic rows. Bandwidth accuracy is a benchmark (scripts/bench-profile.sh), not a test.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "costmodel/hardware.h"
#include "hw_profiles/profiler.h"

namespace strata {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int sh(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

const std::string kMpi = std::string("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ") +
                         "ASAN_OPTIONS=detect_leaks=0 timeout 300 " + STRATA_MPIEXEC + " -np 2 " + STRATA_BINARY;

TEST(Profile, TwoRanksTableIsCheckedAndTheProfileLoads) {
  const std::string dir = ::testing::TempDir(), out = dir + "strata_profile.json", txt = dir + "strata_profile.txt";
  ASSERT_EQ(sh(kMpi + " profile --quick --out " + out + " > " + txt + " 2> " + dir + "strata_profile.err"), 0)
      << slurp(dir + "strata_profile.err");
  // The nccl-tests table: every row's #wrong column (the last) is 0; all four collectives.
  std::istringstream in(slurp(txt));
  std::string line;
  int rows = 0;
  std::set<std::string> ops;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string op, type;
    long long bytes = 0, count = 0, wrong = -1;
    double time_us = 0, algbw = 0, busbw = 0;
    if (!(ls >> op >> bytes >> count >> type >> time_us >> algbw >> busbw >> wrong) || type != "float") continue;
    ++rows;
    ops.insert(op);
    EXPECT_EQ(wrong, 0) << line;
    EXPECT_GT(time_us, 0) << line;
    EXPECT_GE(busbw, 0) << line;  // printed with two decimals: a point slowed by a busy core can read 0.00
  }
  EXPECT_GE(rows, 20);
  EXPECT_EQ(ops, (std::set<std::string>{"all_reduce", "all_gather", "reduce_scatter", "sendrecv"}));
  // The profile is a cluster like any preset.
  const Cluster c = load_cluster(out);
  EXPECT_EQ(c.devices_per_node, 2);
  EXPECT_GT(c.device.peak_fp32_flops, 1e9);
  EXPECT_GT(c.device.memory_bandwidth_bytes_per_s, 1e8);
  EXPECT_GT(c.intra.bandwidth_bytes_per_s, 1e7);
  EXPECT_LE(c.device.gemm_efficiency.at(1e12), 1.0);
  // The norms, the activations and the 16-bit rounding pass each their own curve, as
  // fractions of the bandwidth. The rounding curve holds what the progress log says was
  // measured ("round16 ROWSxWIDTH: R GB/s per rank", 8 bytes a value): one point per size,
  // at rate / bandwidth (points of one size averaged: the hidden and ffn widths can meet).
  for (MemKind k : {MemKind::norm, MemKind::activation, MemKind::round16})
    EXPECT_GE(c.device.kernel_efficiency[static_cast<int>(k)].points().size(), 3u) << to_string(k);
  std::map<double, std::vector<double>> rounds;  // bytes -> rates (bytes/s)
  {
    std::istringstream log(slurp(dir + "strata_profile.err"));
    for (std::string l; std::getline(log, l);) {
      const size_t at = l.find("round16 ");
      long long r = 0, w = 0;
      double gbs = 0;
      if (at != std::string::npos && std::sscanf(l.c_str() + at, "round16 %lldx%lld: %lf GB/s", &r, &w, &gbs) == 3)
        rounds[8.0 * static_cast<double>(r) * static_cast<double>(w)].push_back(gbs * 1e9);
    }
  }
  const auto& pts = c.device.kernel_efficiency[static_cast<int>(MemKind::round16)].points();
  ASSERT_EQ(pts.size(), rounds.size());
  size_t i = 0;
  for (const auto& [bytes, rates] : rounds) {
    double mean = 0;
    for (double x : rates) mean += x / static_cast<double>(rates.size());
    EXPECT_DOUBLE_EQ(pts[i].first, bytes);
    // The log prints one decimal of GB/s.
    EXPECT_NEAR(pts[i].second * c.device.memory_bandwidth_bytes_per_s, mean, 0.06e9) << bytes;
    ++i;
  }
  // The fused attention measured against the GEMM peak (local-cpu's preset says 0.3 / 0.25).
  EXPECT_GT(c.device.flash_fwd_efficiency, 1e-3);
  EXPECT_LE(c.device.flash_fwd_efficiency, 1.0);
  EXPECT_GT(c.device.flash_bwd_efficiency, 1e-3);
  EXPECT_LE(c.device.flash_bwd_efficiency, 1.0);
  EXPECT_NE(c.device.flash_fwd_efficiency, 0.3);
  // The CPU backend's batched products (the attention core's) run one by one; the CUDA
  // backend's in one strided-batched call, which its profile writes as "batched".
  EXPECT_TRUE(c.device.batched_gemm_per_matrix);
  // Its GEMMs run on floats: the executor's 16-bit tensors are unpacked for them
  // ("gemm_16bit_operands": "unpacked"; the CUDA backend's profile says "as_stored").
  EXPECT_FALSE(c.device.gemm_reads_16bit);
  // Its loss reads the logits twice (the maximum, then the sum; the CUDA backend's once).
  EXPECT_FALSE(c.device.cross_entropy_one_pass);
  EXPECT_EQ(sh(std::string(STRATA_BINARY) + " estimate --model tiny-gpt --cluster " + out +
               " --plan dp=2,mbs=2,gbs=8 --json > " + dir + "strata_profile_est.json"),
            0);
}

// A second profile run (--model, --json) is Release-only: under the sanitizers the profile
// code runs in the test above, and each run there takes over a minute of the CI's two cores.
#ifndef STRATA_UNDER_SANITIZER
TEST(Profile, ModelShapesAndProgressLines) {
  // --model adds the GEMMs the model runs (tiny-gpt QKV at micro-batch 1: 128 x 768 x 256);
  // without a terminal, progress is one plain line per point with done/total and an ETA.
  // Four ranks: on a machine of fewer cores the profile says how many they share.
  const std::string dir = ::testing::TempDir(), err = dir + "strata_profile_model.err";
  std::string four = kMpi;
  four.replace(four.find(" -np 2 "), 7, " -np 4 --oversubscribe ");
  ASSERT_EQ(sh(four + " profile --quick --model tiny-gpt --json > " + dir + "strata_profile_model.json 2> " + err), 0)
      << slurp(err);
  const std::string e = slurp(err);
  EXPECT_NE(e.find("gemm 128x768x256"), std::string::npos) << e;
  EXPECT_NE(e.find("profile 1/"), std::string::npos) << e;
  EXPECT_NE(e.find("ETA"), std::string::npos) << e;
  const Cluster c = load_cluster(dir + "strata_profile_model.json");  // --json prints the profile itself
  EXPECT_GT(c.device.peak_fp32_flops, 1e9);
  EXPECT_EQ(c.devices_per_node, 4);
  cpu_set_t mask;
  ASSERT_EQ(sched_getaffinity(0, sizeof mask, &mask), 0);
  const int cores = CPU_COUNT(&mask);  // (this test's process is not bound by mpirun)
  EXPECT_EQ(c.processors_per_node, cores < 4 ? cores : 0);
}
#endif

TEST(Profile, BusFactorsAreNcclTests) {
  EXPECT_DOUBLE_EQ(bus_factor_of(Collective::all_reduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_factor_of(Collective::all_gather, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_factor_of(Collective::reduce_scatter, 2), 0.5);
  EXPECT_DOUBLE_EQ(bus_factor_of(Collective::send_recv, 8), 1.0);
}

// The activation kernels' bytes in the cost model's units (compute.cpp): an ungated activation
// (GELU, squared ReLU) reads u and writes y, 2 x 4 bytes a value forward, and reads u and dy
// and writes du backward, 3 x 4; a gated one reads both halves: 3 x 4 and 5 x 4. Over 8 rows of
// 16 values (128): 1,024 and 1,536 ungated, 1,536 and 2,560 gated.
TEST(Profile, ActivationKernelBytes) {
  for (Activation a : {Activation::gelu, Activation::squared_relu, Activation::swiglu, Activation::geglu}) {
    MemoryKernel k;
    k.rows = 8;
    k.width = 16;
    k.act = a;
    k.kind = KernelKind::activation_forward;
    EXPECT_DOUBLE_EQ(kernel_bytes(k), gated(a) ? 1536.0 : 1024.0) << to_string(a);
    k.kind = KernelKind::activation_backward;
    EXPECT_DOUBLE_EQ(kernel_bytes(k), gated(a) ? 2560.0 : 1536.0) << to_string(a);
  }
  // Squared ReLU's model profiles its own activation, ungated.
  ModelSpec m = load_model("tiny-gpt");
  m.activation = Activation::squared_relu;
  int activations = 0;
  for (const MemoryKernel& k : model_memory_kernels(m, 1))
    if (k.kind == KernelKind::activation_forward || k.kind == KernelKind::activation_backward) {
      EXPECT_EQ(k.act, Activation::squared_relu);
      EXPECT_DOUBLE_EQ(kernel_bytes(k), static_cast<double>(k.rows * k.width) * 4.0 *
                                            (k.kind == KernelKind::activation_forward ? 2.0 : 3.0));
      ++activations;
    }
  EXPECT_GT(activations, 0);
}

TEST(Profile, BadBackendExitsTwoOnEveryRank) {
  const std::string err = ::testing::TempDir() + "strata_profile_bad.err";
  EXPECT_EQ(sh(kMpi + " profile --backend tpu > /dev/null 2> " + err), 2);
  const std::string e = slurp(err);
  size_t n = 0, at = 0;
  while ((at = e.find("strata: error", at)) != std::string::npos) ++n, ++at;
  EXPECT_EQ(n, 2u) << e;
  EXPECT_EQ(sh(kMpi + " profile --quick --model tiny-gpt --tp 3 > /dev/null 2> " + err), 2);
  EXPECT_NE(slurp(err).find("--tp: 3"), std::string::npos) << slurp(err);
  // An --out that cannot be written, before the profile runs (once: after it, through an
  // abort): rank 0, which writes it, names it, and every rank exits 2 with a line; a model
  // whose GEMMs this machine cannot hold.
  EXPECT_EQ(sh(kMpi + " profile --quick --out /nonexistent_strata_dir/c.json > /dev/null 2> " + err), 2);
  const std::string e2 = slurp(err);
  EXPECT_NE(e2.find("rank 0 of 2: --out: '/nonexistent_strata_dir/c.json' is invalid"), std::string::npos) << e2;
  n = 0, at = 0;
  while ((at = e2.find("strata: error", at)) != std::string::npos) ++n, ++at;
  EXPECT_EQ(n, 2u) << e2;
  EXPECT_EQ(sh(kMpi + " profile --quick --model tiny-gpt --seq-length 1048576 > /dev/null 2> " + err), 2);
  EXPECT_NE(slurp(err).find("its largest GEMM (1048576 x 1048576 x 64)"), std::string::npos) << slurp(err);
}

}  // namespace
}  // namespace strata
