// Collective times against hand-computed numbers on the round cluster (test_cluster.h).
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "costmodel/comm.h"
#include "costmodel/compute.h"
#include "test_cluster.h"

namespace strata {
namespace {

TEST(Comm, GroupPlacement) {
  // Tensor parallel (stride 1) of 8 fills one node of 8.
  GroupSpan g = group_span(8, 1, 8);
  EXPECT_EQ(g.per_node, 8);
  EXPECT_EQ(g.nodes, 1);
  // Data parallel of 32 with t = 8: one member per node, 32 nodes.
  g = group_span(32, 8, 8);
  EXPECT_EQ(g.per_node, 1);
  EXPECT_EQ(g.nodes, 32);
  // Data parallel of 8 with t = 4: two members per node, 4 nodes.
  g = group_span(8, 4, 8);
  EXPECT_EQ(g.per_node, 2);
  EXPECT_EQ(g.nodes, 4);
  EXPECT_EQ(group_span(1, 1, 8).nodes, 1);
}

TEST(Comm, BusFactorsOfNcclTests) {
  EXPECT_DOUBLE_EQ(bus_factor(Collective::all_reduce, 8), 2.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::all_gather, 8), 7.0 / 8);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::reduce_scatter, 4), 3.0 / 4);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::send_recv, 2), 1.0);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::all_to_all, 4), 3.0 / 4);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::all_reduce, 1), 0.0);
}

TEST(Comm, AllReduceInsideANode) {
  // 1 GB over 8 GPUs of one node: busbw 200 GB/s x 0.75 = 150 GB/s; bytes moved per GPU
  // 2*7/8 GB -> 11.6667 ms; latency 2*log2(8) = 6 steps of 5 us = 30 us.
  const Cluster c = testing::round_cluster();
  const double t = collective_time(c, group_span(8, 1, 8), Collective::all_reduce, 1e9);
  EXPECT_NEAR(t, 30e-6 + 1e9 * 1.75 / 150e9, 1e-12);
}

TEST(Comm, AllReduceAcrossNodesSharesTheNics) {
  // 32 ranks, one per node (t = 8): each group gets its one member's 12.5 GB/s share of the
  // node's 100 GB/s, at 80 %: 10 GB/s. 1 GB: 2*31/32 GB / 10 GB/s = 193.75 ms; latency 2*5 steps of 10 us.
  const Cluster c = testing::round_cluster();
  const GroupSpan g = group_span(32, 8, 8);
  EXPECT_DOUBLE_EQ(bus_bandwidth(c, g, Collective::all_reduce), 10e9);
  EXPECT_NEAR(collective_time(c, g, Collective::all_reduce, 1e9), 100e-6 + 2.0 * 31 / 32 / 10.0, 1e-12);
  // Two members per node (t = 4): two shares, a quarter of the node each, 20 GB/s.
  EXPECT_DOUBLE_EQ(bus_bandwidth(c, group_span(8, 4, 8), Collective::reduce_scatter), 20e9);
  // A whole node per group: 80 GB/s of NICs, below NVLink's 150.
  EXPECT_DOUBLE_EQ(bus_bandwidth(c, group_span(64, 1, 8), Collective::all_gather), 80e9);
}

TEST(Comm, GatherScatterAndSend) {
  const Cluster c = testing::round_cluster();
  // All-gather of 800 MB output over 4 in a node: 3/4 * 0.8 GB / 150 GB/s + 2 steps * 5 us.
  EXPECT_NEAR(collective_time(c, group_span(4, 1, 8), Collective::all_gather, 8e8), 10e-6 + 0.6e9 / 150e9, 1e-12);
  // Send of 100 MB between two nodes (one member each, NIC share 12.5 GB/s x 0.8 = 10):
  // 10 ms + 10 us.
  EXPECT_NEAR(collective_time(c, GroupSpan{2, 1, 2}, Collective::send_recv, 1e8), 10e-6 + 1e8 / 10e9, 1e-12);
  EXPECT_EQ(collective_time(c, group_span(1, 1, 8), Collective::all_reduce, 1e9), 0.0);
}

// All-to-all (context parallelism's a2a): each of n ranks keeps 1/n of its S bytes and sends
// the rest, S (n-1)/n at the bus bandwidth, to every peer at once: one latency step.
// 800 MB per rank over 4 in a node: 3/4 * 0.8 GB / 150 GB/s + 5 us; over 4 nodes (one
// member each: 12.5 GB/s x 0.8) 0.6 GB / 10 GB/s + 10 us.
TEST(Comm, AllToAll) {
  Cluster c = testing::round_cluster();
  EXPECT_NEAR(collective_time(c, group_span(4, 1, 8), Collective::all_to_all, 8e8), 5e-6 + 0.6e9 / 150e9, 1e-12);
  EXPECT_NEAR(collective_time(c, group_span(4, 8, 8), Collective::all_to_all, 8e8), 10e-6 + 0.6e9 / 10e9, 1e-12);
  // 16 ranks, 8 on each of 2 nodes: a member sends the 8/16 of its buffer meant for the other
  // node through its own 12.5 GB/s x 0.8 of the NICs (0.4 GB / 10 GB/s = 40 ms; a ring's bus
  // bandwidth would have it 8 times faster), beside 7/16 over NVLink (0.35 GB / 150 GB/s).
  EXPECT_NEAR(collective_time(c, group_span(16, 1, 8), Collective::all_to_all, 8e8), 10e-6 + 0.4e9 / 10e9, 1e-12);
  // Its efficiency in a cluster JSON: given, or (clusters written before it) the all-gather's.
  Json j = cluster_to_json(c);
  EXPECT_DOUBLE_EQ(j["links"]["intra_node"]["efficiency"]["all_to_all"].get<double>(), 0.75);
  j["links"]["intra_node"]["efficiency"]["all_to_all"] = 0.5;
  j["links"]["inter_node"]["efficiency"].erase("all_to_all");
  j["links"]["inter_node"]["efficiency"]["all_gather"] = 0.7;
  const Cluster back = cluster_from_json(j, "cluster");
  EXPECT_DOUBLE_EQ(back.intra.eff_all_to_all, 0.5);
  EXPECT_DOUBLE_EQ(back.inter.eff_all_to_all, 0.7);
  j["links"]["intra_node"]["efficiency"]["all_to_all"] = 0;
  EXPECT_THROW(cluster_from_json(j, "cluster"), InputError);
}

// fp8_gemm_speedup: the preset's measured fp8 : bf16 GEMM throughput (1.62 on H100), kept
// by the JSON round trip, the peak fp8 GEMMs run against (at most the fp8 peak); absent,
// the datasheet's ratio (the fp8 peak itself); refused above that ratio, without an fp8
// peak, or at zero, each naming the field.
TEST(ClusterJson, Fp8GemmSpeedup) {
  const Cluster h100 = load_cluster("dgx-h100-80g");
  EXPECT_DOUBLE_EQ(h100.device.fp8_gemm_speedup, 1.62);
  EXPECT_DOUBLE_EQ(h100.device.gemm_peak(Precision::fp8), 1.62 * 989.4e12);
  EXPECT_DOUBLE_EQ(h100.device.gemm_peak(Precision::bf16), 989.4e12);
  Json j = cluster_to_json(h100);
  EXPECT_DOUBLE_EQ(cluster_from_json(j, "c").device.fp8_gemm_speedup, 1.62);
  j["device"].erase("fp8_gemm_speedup");
  const Cluster datasheet = cluster_from_json(j, "c");
  EXPECT_DOUBLE_EQ(datasheet.device.gemm_peak(Precision::fp8), 1978.9e12);
  EXPECT_FALSE(cluster_to_json(datasheet)["device"].contains("fp8_gemm_speedup"));
  auto refused = [&](const Json& bad, const char* rule) {
    try {
      (void)cluster_from_json(bad, "c");
      ADD_FAILURE() << "accepted " << bad["device"].dump();
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("c.device.fp8_gemm_speedup"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(rule), std::string::npos) << e.what();
    }
  };
  Json over = j;
  over["device"]["fp8_gemm_speedup"] = 2.5;
  refused(over, "at most peak_tflops.fp8 / peak_tflops.bf16 = 2");
  Json no_fp8 = over;
  no_fp8["device"]["fp8_gemm_speedup"] = 1.5;
  no_fp8["device"]["peak_tflops"].erase("fp8");
  refused(no_fp8, "needs peak_tflops.fp8");
  Json zero = j;
  zero["device"]["fp8_gemm_speedup"] = 0;
  refused(zero, "");
  // An fp8 GEMM of the preset: the curve against 1.62 x the bf16 peak, read where a bf16
  // GEMM of flops / 1.62 reads it.
  const double flops = 2.0 * 8192 * 8192 * 8192, peak = 1.62 * 989.4e12;
  EXPECT_DOUBLE_EQ(gemm_time(h100.device, h100.device.gemm_peak(Precision::fp8), 8192, 8192, 8192, 1),
                   flops / (peak * h100.device.gemm_efficiency.at(flops / 1.62)));
}

// A user's cluster JSON: notes (description, _source) in every object, a misspelt required
// key named beside the missing one, and the file's name where it gives none.
TEST(ClusterJson, NotesMisspellingsAndName) {
  Json j = cluster_to_json(load_cluster("dgx-h100-80g"));
  j["device"]["peak_tflops"]["description"] = "dense";
  j["links"]["inter_node"]["efficiency"]["_source"] = "nccl-tests";
  j["framework"]["description"] = "TE 2.x";
  EXPECT_NO_THROW(cluster_from_json(j, "cluster"));
  Json typo = j;
  typo["links"]["intra_node"]["bandwith_gbps"] = typo["links"]["intra_node"]["bandwidth_gbps"];
  typo["links"]["intra_node"].erase("bandwidth_gbps");
  try {
    (void)cluster_from_json(typo, "cluster");
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'bandwith_gbps': a misspelling?"), std::string::npos) << e.what();
  }
  // (Short keys are too alike to guess: fp32 missing names no fp16.)
  Json no32 = j;
  no32["device"]["peak_tflops"].erase("fp32");
  try {
    (void)cluster_from_json(no32, "cluster");
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).find("misspelling"), std::string::npos) << e.what();
  }
  // Optional: step_overhead_s (0); the name (the file's, also when null).
  j["framework"].erase("step_overhead_s");
  EXPECT_DOUBLE_EQ(cluster_from_json(j, "cluster").step_overhead_s, 0.0);
  const std::string path = (std::filesystem::temp_directory_path() / "my-mi300x.json").string();
  for (const Json name : {Json(), Json::object()}) {
    Json k = j;
    if (name.is_null()) k["name"] = nullptr;
    else k.erase("name");
    std::ofstream(path) << k.dump();
    EXPECT_EQ(load_cluster(path).name, "my-mi300x");
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace strata
