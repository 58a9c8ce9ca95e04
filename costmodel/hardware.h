// Cluster: one device type (peaks per precision, memory, efficiency curves), how many
// devices a node holds, the two link tiers (intra-node, inter-node) with per-collective
// efficiency, and the framework-level constants of the software stack on it (memory
// overhead, allocator fragmentation, default attention kernel). Loaded from the JSON of
// hw_profiles/ (schema: hw_profiles/README.md); presets are embedded at build time.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "costmodel/json_input.h"

namespace strata {

enum class Precision { fp32, bf16, fp16, fp8 };
enum class Collective { all_reduce, all_gather, reduce_scatter, send_recv, all_to_all };
enum class AttentionKernel { unfused, flash };

// The least efficiency a cluster JSON's curve may give (a measured profile's are clamped
// to it): below it a rate underflows toward 0 and a time toward infinity.
inline constexpr double kMinCurveEfficiency = 1e-6;

// y(x) by linear interpolation in log(x) between points sorted by x, clamped at the ends.
// The logarithms of the points and each segment's slope in log(x) are kept, so a lookup
// takes one logarithm and one multiply-add.
//
// A search meets the same few GEMM and kernel sizes in plan after plan (they follow from
// tp, cp and the micro-batch size alone), so the values inside the curve are also kept in
// a small per-thread cache, direct-mapped on the bits of x, each entry holding the number
// of the curve that wrote it. A curve's points never change after it is made, and each one
// made gets its own number (a copy shares it: same points; one made later at a destroyed
// one's address gets another), so an entry can only ever return what interpolate() would:
// the cache changes the time a lookup takes, never its value.
class Curve {
  // The cache: 256 entries of (curve number, bits of x, y).
  struct ValueCache {
    static constexpr int kBits = 8;
    struct Entry {
      uint64_t id = 0, bits = 0;  // id 0: empty (curves are numbered from 1)
      double y = 0;
    };
    Entry entry[1 << kBits];
    static size_t slot(uint64_t bits) {  // by x alone: two curves asked at one x share a slot
      return static_cast<size_t>(((bits ^ (bits >> 29)) * 0x9E3779B97F4A7C15ull) >> (64 - kBits));
    }
  };
  static thread_local ValueCache value_cache;

 public:
  Curve() = default;
  explicit Curve(std::vector<std::pair<double, double>> points);
  double at(double x) const {
    if (points_.empty()) return 1.0;
    if (x <= points_.front().first) return points_.front().second;
    if (x >= points_.back().first) return points_.back().second;
    const uint64_t bits = std::bit_cast<uint64_t>(x);
    ValueCache::Entry& e = value_cache.entry[ValueCache::slot(bits)];
    if (e.id == id_ && e.bits == bits) return e.y;
    return remember(e, bits, x);  // a miss
  }
  const std::vector<std::pair<double, double>>& points() const { return points_; }
  bool empty() const { return points_.empty(); }

 private:
  // i with points_[i-1].first < x <= points_[i].first (x inside)
  size_t segment(double x) const {
    size_t i = 1;
    while (x > points_[i].first) ++i;
    return i;
  }
  double interpolate(size_t i, double x) const;  // on segment i: one logarithm
  double remember(ValueCache::Entry& e, uint64_t bits, double x) const;  // a miss: computes and keeps
  uint64_t id_ = 0;                                // this curve's points' number (0: none)
  std::vector<std::pair<double, double>> points_;  // (x, y), x increasing
  std::vector<double> log_x_;                      // log(x) of each point
  std::vector<double> slope_;                      // [i]: dy / dlog(x) between points i-1 and i
};

// The memory-bound ops a profile times on the executor's own kernel, each at its own curve
// (Device::kernel_efficiency): the norms, the activations and the strata executor's 16-bit
// rounding pass; anything else `generic` (memory_efficiency).
enum class MemKind { generic, norm, activation, round16 };
inline constexpr int kMemKinds = 4;
const char* to_string(MemKind k);  // "generic", "norm", "activation", "round16"

struct Device {
  std::string name;
  double memory_bytes = 0;
  double peak_fp32_flops = 0, peak_tf32_flops = 0, peak_bf16_flops = 0, peak_fp16_flops = 0, peak_fp8_flops = 0;
  double memory_bandwidth_bytes_per_s = 0;
  Curve gemm_efficiency;    // x: FLOPs of one GEMM, y: fraction of peak
  Curve memory_efficiency;  // x: bytes one kernel moves, y: fraction of memory bandwidth
  // Kinds of memory-bound op that strata profile times on the executor's own kernel, each
  // its own curve (x: bytes, y: fraction of the bandwidth); an empty one (every preset)
  // leaves its kind at memory_efficiency.
  Curve kernel_efficiency[kMemKinds];
  const Curve& memory_curve(MemKind k) const {
    const Curve& c = kernel_efficiency[static_cast<int>(k)];  // ([generic] is never set)
    return k == MemKind::generic || c.empty() ? memory_efficiency : c;
  }
  // Fractions of the fused attention's peak: 16-bit (fp8 plans: bf16), fp32 in fp32 plans;
  // on the strata stack fp32 too where its CUDA kernels do not run on the tensor cores
  // (compute_acc.h's peak_flash).
  double flash_fwd_efficiency = 0.5, flash_bwd_efficiency = 0.4;
  double kernel_launch_s = 0;  // the least time any kernel takes
  // fp8 GEMMs' measured throughput over bf16's at the same sizes (at least 10^12 FLOPs),
  // below the datasheet's 2x on Hopper and Blackwell (hw_profiles/README.md): fp8 GEMMs
  // run on the efficiency curve against bf16 peak x this. 0: the datasheet peaks' ratio.
  double fp8_gemm_speedup = 0;
  // A batched GEMM (the attention core's, one product per head) runs as one GEMM per
  // matrix, each at the efficiency of its own size (a CPU library looping over heads),
  // rather than as one kernel at the efficiency of the whole batch (cuBLAS batched).
  bool batched_gemm_per_matrix = false;
  // A 16-bit GEMM reads 16-bit operands (a GPU's tensor cores): the strata executor then
  // keeps its GEMM inputs in 16-bit storage and casts only float operands (its weights);
  // false where the GEMMs run on floats (the CPU backend's Eigen), and the executor's
  // 16-bit tensors are unpacked for them. Backend::gemm_reads_16bit, as strata profile
  // writes it ("gemm_16bit_operands": "as_stored" | "unpacked").
  bool gemm_reads_16bit = true;
  // The strata executor's cross-entropy reads its logits once in the forward (each row's
  // maximum and sum of exponentials together, online: the CUDA backend) rather than twice
  // (the maximum, then the sum: the CPU backend). Backend::cross_entropy_one_pass, as strata
  // profile writes it ("cross_entropy_passes": 1 | 2).
  bool cross_entropy_one_pass = true;

  double peak_flops(Precision p) const;
  // The peak a GEMM of precision p runs against: peak_flops(p), for fp8 at most bf16 peak
  // x fp8_gemm_speedup.
  double gemm_peak(Precision p) const;
};

struct LinkTier {
  double bandwidth_bytes_per_s = 0;  // per device, one direction (inter: its share of the node's NICs)
  double latency_s = 0;              // per step of a collective's algorithm
  double eff_all_reduce = 1, eff_all_gather = 1, eff_reduce_scatter = 1, eff_send_recv = 1;
  double eff_all_to_all = 1;  // optional in the JSON: the all-gather's unless given
  double efficiency(Collective c) const {  // inline: the estimate asks for it per collective
    switch (c) {
      case Collective::all_reduce: return eff_all_reduce;
      case Collective::all_gather: return eff_all_gather;
      case Collective::reduce_scatter: return eff_reduce_scatter;
      case Collective::send_recv: return eff_send_recv;
      case Collective::all_to_all: return eff_all_to_all;
    }
    return 1;
  }
};

// A node's host side, for optimizer states offloaded to CPU memory (a plan's
// optimizer_offload_fraction): its memory, the bandwidth of that memory (the node's, shared
// by its devices' optimizer steps) and each device's PCIe link to it, with the fractions of
// the datasheet figures that copies and a streaming CPU optimizer reach. Absent (memory 0)
// in a cluster JSON without a "host" object: such a cluster plans no offload.
struct Host {
  double memory_bytes = 0;               // per node
  double memory_bandwidth_bytes_per_s = 0;  // per node
  double memory_efficiency = 1;
  double pcie_bandwidth_bytes_per_s = 0;  // per device, one direction
  double pcie_efficiency = 1;
  bool present() const { return memory_bytes > 0; }
};

struct Cluster {
  std::string name;
  std::string description;
  Device device;
  int64_t devices_per_node = 1;
  // The processors the devices of a node share, where ranks share them (a CPU profile of
  // more ranks than cores, ranks sharing a GPU); 0: one each. The device rates are those of
  // a device with every device of its node busy, min(1, processors / devices_per_node) of a
  // processor each (strata profile measures every rank at once); a rank that fewer busy
  // ranks share the node with runs faster (estimate.h).
  int64_t processors_per_node = 0;
  LinkTier intra, inter;
  Host host;
  double framework_overhead_bytes = 0;   // CUDA context, library workspaces, NCCL buffers
  // What the caching allocator reserves beyond the live tensors, as a fraction of them:
  // allocator_fragmentation of the churn (the backward's working set, a recomputed layer's
  // activations rebuilt in it, what recomputed layers keep, whose segments those split; on
  // legacy stacks autograd's per-parameter gradients); allocator_fragmentation_saved of the
  // tensors saved from a layer's forward for its backward without recompute, freed in the
  // reverse order they were allocated and asked for again at the same sizes every
  // micro-batch (memory.cpp, with_in_flight). A cluster file without the second gives it
  // the first's value.
  double allocator_fragmentation = 0;
  double allocator_fragmentation_saved = 0;
  double step_overhead_s = 0;            // per step: data loading, logging, launch gaps
  double overlap_slowdown = 0;           // compute time lost per second of communication hidden behind it
  // The software stack published runs on this hardware use: modern (Megatron-core / TE /
  // FSDP: FlashAttention, fused fp32 gradient accumulation, overlapped communication) or
  // legacy (the 2020-2022 Megatron-LM and DeepSpeed of the V100/A100 era). See resolve_stack.
  bool modern_stack = true;
  // "strata": the stack is this repository's own executor (the CPU backend): what it
  // overlaps and what it allocates, so its measured runs can be predicted (stack.h).
  bool strata_stack = false;
  // Ranks share processors: fewer processors than devices per node.
  bool shares_processors() const { return processors_per_node > 0 && processors_per_node < devices_per_node; }
};

struct EmbeddedProfile {
  const char* name;
  const char* json;
};
const std::vector<EmbeddedProfile>& embedded_profiles();  // generated from hw_profiles/*.json

Cluster cluster_from_json(const Json& j, const std::string& source);
Json cluster_to_json(const Cluster& c);
// A preset name or a path to a cluster JSON.
Cluster load_cluster(const std::string& name_or_path);
std::vector<std::string> cluster_preset_names();

const char* to_string(Precision p);
const char* to_string(Collective c);
const char* to_string(AttentionKernel a);
int bytes_of(Precision p);  // bytes of one activation / weight element in compute precision

}  // namespace strata
