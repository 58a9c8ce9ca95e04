// strata profile: measures this machine the way the cost model describes it. Every rank
// runs the sweeps at the same time, so ranks that share cores or memory bandwidth are
// measured sharing them. GEMM rate by size (the backend's own GEMM, operands rotated
// through more memory than the caches hold, as in a training step), peak memory bandwidth
// (STREAM add, with the backend's own kernel) and the achieved bandwidth of the executor's own memory-bound kernels
// (norms, activations, optimizer) at the model's sizes, and the collectives nccl-tests measures (all-reduce,
// all-gather, reduce-scatter, send/recv) by message size with every result checked; then
// latency + size/bandwidth fitted per collective, and a cluster JSON in the preset schema.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "costmodel/hardware.h"
#include "costmodel/model_spec.h"
#include "executor/backend.h"
#include "executor/comm.h"

namespace strata {

// A GEMM of the sweep: C (M, N) = A (M, K) B^T.
struct GemmShape {
  int64_t M = 0, N = 0, K = 0;
};

// The forward GEMMs one tensor-parallel rank of model m runs at micro-batches 1 to 16
// (QKV, proj, fc1, fc2, logits; the backward GEMMs have the same FLOPs), and one head's
// attention products (scores and context).
std::vector<GemmShape> model_gemm_shapes(const ModelSpec& m, int64_t t);

// A memory-bound kernel of the executor, measured at a size training runs it: norm and
// activation forward / backward over (rows, width), or the optimizer step (gradient norm
// terms + AdamW) over `width` parameters.
// The executor's memory-bound kernels the profile times: the norms and activations, the
// optimizer step, and the strata stack's 16-bit rounding pass.
enum class KernelKind { norm_forward, norm_backward, activation_forward, activation_backward, optimizer, round16 };
struct MemoryKernel {
  KernelKind kind = KernelKind::norm_forward;
  int64_t rows = 1, width = 0;
  Norm norm = Norm::layernorm;
  Activation act = Activation::gelu;
  // The output rounded to bf16 as the kernel writes it (backend.h's `round`), as 16-bit
  // training runs the norms' forwards and the activation's forward and backward.
  bool rounded = false;
};
// The bytes the cost model charges the kernel in fp32 (costmodel/compute.cpp: norms 2 and
// 3 passes, activations 2 / 3 (gated 3 / 5), the fp32 optimizer 40 bytes per parameter),
// so achieved bandwidth is measured in the cost model's own units.
double kernel_bytes(const MemoryKernel& k);
const char* kernel_name(KernelKind k);
// The kernels of model m on one tensor-parallel rank at micro-batches 1 to 16, and the
// optimizer over one layer's and over the whole model's parameters.
std::vector<MemoryKernel> model_memory_kernels(const ModelSpec& m, int64_t t);

// One attention of the sweep: micro-batch B, sequence S, A query heads, G key/value groups,
// head dim D (one tensor-parallel rank's heads).
struct AttentionShape {
  int64_t S = 512, B = 1, A = 8, G = 8, D = 64;
};
// Model m's attention on one tensor-parallel rank of t, micro-batch 1.
AttentionShape model_attention_shape(const ModelSpec& m, int64_t t);

struct ProfileOptions {
  bool quick = false;            // fewer sizes and shorter timings (tests, demos)
  // Only extra_gemms, nothing else and no cluster (strata profile --gemm-probe: the GEMM
  // rate just before a validation run, against the profile's; planner/validation.h).
  bool gemms_only = false;
  std::vector<GemmShape> extra_gemms;  // e.g. model_gemm_shapes of the model to be trained
  std::vector<MemoryKernel> kernels;   // memory-bound kernels; empty: those of a generic model
  AttentionShape attention;            // where the fused attention is timed (default: a generic one)
  double min_time_s = 0.05;      // per measured point, at least
  int64_t max_message_bytes = int64_t{64} << 20;
  // A line per finished sweep point on rank 0: what was measured, points done and total,
  // seconds elapsed and the estimated seconds left.
  std::function<void(const std::string&, int done, int total, double elapsed_s, double eta_s)> progress;
  std::string device_name;  // the device measured (CUDA); empty on the CPU
  // Backends whose GEMM precision is chosen (CUDA): the sweep runs in bf16 (the cost
  // model's efficiency curve is the 16-bit one) and one point in fp32 gives that peak.
  std::function<void(Precision)> gemm_precision;
  // The processors this machine's ranks share (cores, or GPUs), 0: unknown. Written to the
  // cluster as processors_per_node where it is fewer than the ranks (hardware.h).
  int processors = 0;
};

// One row of the nccl-tests table. bytes: all-reduce and send/recv the buffer, all-gather
// the gathered output, reduce-scatter the input (nccl-tests' "size").
struct CollectiveRow {
  Collective op = Collective::all_reduce;
  int64_t bytes = 0, count = 0;  // count: floats per rank's buffer as nccl-tests counts it
  double time_s = 0;             // mean per call, the slowest rank
  double algbw_gbps = 0, busbw_gbps = 0;
  int64_t wrong = 0;             // elements that differ from the exact expected value, all ranks
};

struct CollectiveFit {
  Collective op = Collective::all_reduce;
  double latency_s = 0;          // alpha: time of a zero-byte call
  double busbw_bytes_per_s = 0;  // 1 / beta of time = alpha + bytes * factor * beta
};

struct ProfileResult {
  int ranks = 1;
  std::vector<std::pair<double, double>> gemm;    // (FLOPs of one GEMM, FLOP/s), slowest rank
  std::vector<std::pair<double, double>> memory;  // STREAM add: (bytes one kernel moves, bytes/s), slowest rank
  struct KernelPoint {
    MemoryKernel kernel;
    double bytes = 0, bytes_per_s = 0;  // the cost model's bytes, slowest rank
  };
  std::vector<KernelPoint> kernels;
  // The backend's fused attention (Backend::flash_attention_*) at options.attention, in the
  // cost model's FLOPs (causal: half the S x S products; backward 2.5 forwards), slowest rank.
  double flash_forward_flops_per_s = 0, flash_backward_flops_per_s = 0;
  std::vector<CollectiveRow> rows;
  std::vector<CollectiveFit> fits;
  Cluster cluster;  // local-cpu's constants with every measured field replaced
};

ProfileResult run_profile(Comm& comm, Backend& be, const ProfileOptions& o);

// nccl-tests' bus bandwidth factor: 2(n-1)/n all-reduce, (n-1)/n all-gather and
// reduce-scatter, 1 send/recv.
double bus_factor_of(Collective c, int n);
std::string format_collective_table(const std::vector<CollectiveRow>& rows, int ranks);
std::string format_profile_summary(const ProfileResult& r);

}  // namespace strata
