// Time of the work of one transformer layer, the embedding and the output layer on one
// GPU for one micro-batch, op by op: every GEMM from the device peak and the efficiency
// curve (capped by the bytes it moves), every memory-bound op (norms, activations,
// dropout, softmax, cross-entropy) from its bytes over the achieved bandwidth, and the
// tensor- and context-parallel communication that sits between them. Backward is its own
// GEMMs (dgrad and wgrad); recompute replays the forward ops it needs.
//
// Names: T = B*S/c tokens on this GPU, Tn = T/t when sequence parallel (norms, dropout and
// residual work on a sequence shard) else T, e = bytes per activation element.
#pragma once

#include <string>
#include <vector>

#include "costmodel/hardware.h"
#include "costmodel/model_spec.h"
#include "costmodel/plan.h"
#include "costmodel/stack.h"

namespace strata {

enum class Phase { forward, backward, recompute };
enum class OpKind { gemm, memory, tp_comm, cp_comm, dp_comm, ep_comm, offload };

// One op of a layer; filled only when a caller asks for the list (breakdown, trace, tests).
struct OpCost {
  std::string name;
  Phase phase;
  OpKind kind;
  double flops = 0;
  double bytes = 0;
  double time_s = 0;     // its duration
  double exposed_s = 0;  // for communication: the part not hidden behind compute
};

// Time of one piece of work on one GPU, split by what the SPEC time terms call it.
struct Work {
  double compute_s = 0;  // kernels
  double tp_comm_s = 0;  // exposed tensor-parallel collectives
  double cp_comm_s = 0;  // exposed context-parallel exchange
  double dp_comm_s = 0;  // exposed ZeRO-2/3 gradient reduce-scatters and ZeRO-3 parameter gathers
  double ep_comm_s = 0;  // exposed expert-parallel all-to-alls (token dispatch and combine)
  double offload_s = 0;  // activation copies to or from the host the compute waits for
  double tp_comm_all_s = 0;  // tensor-parallel communication before overlap (for reports)
  double dp_comm_all_s = 0;  // ZeRO-2/3 reduce-scatters and ZeRO-3 gathers before overlap (for reports)
  double total() const { return compute_s + tp_comm_s + cp_comm_s + dp_comm_s + ep_comm_s + offload_s; }
  Work& operator+=(const Work& o);
};
Work operator*(double k, const Work& w);

struct LayerCost {
  Work forward, backward, recompute;
};

// What the compute model needs besides the model, cluster and plan: resolved once.
struct ComputeSetup {
  Stack stack;      // the software stack, every auto setting resolved
  AttentionKernel attention;
  int act_bytes;    // bytes per activation element as stored (e in the memory formulas)
  int work_bytes;   // the same as kernels read and write it and collectives send it
  double T;         // tokens per GPU per micro-batch
  double Tn;        // tokens of norm / dropout / residual work
  double grad_bytes;  // bytes per gradient element as reduced and accumulated
  double weight_bytes;  // bytes per parameter as stored for compute
  double weight_work_bytes;  // the same as parameter gathers send it and the strata executor stores it
  CpComm cp_comm;           // how context parallelism moves keys and values (resolve_cp_comm)
  // The strata executor's 16-bit GEMMs on a device that reads 16-bit operands (Device::
  // gemm_reads_16bit): its GEMM inputs are stored in 16 bits where they are made
  // (executor/gpt.cpp sixteen_operands; compute_acc.h casts_weights).
  bool sixteen_operands = false;
};
ComputeSetup compute_setup(const ModelSpec& m, const Cluster& cl, const Plan& p);

// With overlap_moe_expert_parallel_comm, the share of a stage's forward chunks Megatron
// runs beside another micro-batch's backward: all but its warm-up's, (p - 1 - r) x 2 +
// (v - 1) g + 1 chunks on stage r, p - 1 + (v - 1) g + 1 on the mean stage (as many
// backwards of the cool-down run alone), of the m v chunks.
double paired_share(const Plan& p);

// Transformer Engine's user buffers (Stack::userbuffers): bytes per element of those that
// feed all-gathers (`gather`: the fp8 GEMM inputs in an fp8 run) or reduce-scatters (the
// GEMM outputs), where the others carry `otherwise` bytes.
inline double ub_element_bytes(const Plan& p, bool gather, double otherwise) {
  return gather && p.precision == Precision::fp8 ? 1.0 : otherwise;
}

// Roofline: the slower of computing `flops` at `rate` FLOP/s and moving `bytes`, at least a launch.
double roofline_time(const Device& dev, double flops, double bytes, double rate);
// GEMM of an (M x K) by (K x N) product in the plan's precision: peak x efficiency(flops),
// at least the time to move its operands, at least a kernel launch.
double gemm_time(const Device& dev, double peak_flops, double M, double N, double K, double elem_bytes);
// Fraction of `peak_flops` a GEMM of `flops` reaches (the device curve, looked up at the
// 16-bit-equivalent size).
double gemm_efficiency(const Device& dev, double peak_flops, double flops);
// A memory-bound kernel moving `bytes`.
double memory_time(const Device& dev, double bytes);
// The same for a kernel of `kind`, at the device's curve for that kind where it has one
// (Device::memory_curve; `generic` has none: memory_efficiency).
double memory_time(const Device& dev, double bytes, MemKind kind);

// One transformer layer (per micro-batch, per GPU). `ops` receives the op list if given.
// With activation offloading (Plan::offload_modules) the layer's offloaded tensors go to
// the host after its forward (never waited for) and come back a layer ahead of their
// backward, on copy streams beside the compute, at the slower of the GPU's PCIe link and
// its share of the host's memory bandwidth (the node's ranks copy at once); what one
// layer's backward and recompute do not cover is exposed (Work::offload_s).
LayerCost layer_cost(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs,
                     std::vector<OpCost>* ops = nullptr);
// Word embedding lookup (first stage) and output layer + loss (last stage).
LayerCost embedding_cost(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs,
                         std::vector<OpCost>* ops = nullptr);
LayerCost head_cost(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs,
                    std::vector<OpCost>* ops = nullptr);
// Bytes per parameter per micro-batch to add one micro-batch's weight gradients into the
// gradient accumulation buffer (gradient accumulation across micro-batches).
// grad_bytes: the main gradient's (ComputeSetup::grad_bytes).
double grad_accumulation_bytes(Precision prec, double grad_bytes);
// Adam step over `params_updated` parameters, plus zeroing the `params_local` gradients, with
// main gradients of `grad_bytes` each (ComputeSetup::grad_bytes: 4, or 2 when 16-bit).
double optimizer_time(const Device& dev, const Plan& p, double grad_bytes, double params_updated,
                      double params_local);
// The offloaded share of the optimizer step (Plan::offload): n parameters of this rank's
// shard whose main gradients (`grad_bytes` each) go to the host over PCIe, are stepped there by a streaming CPU
// Adam beside the shards of the node's other `ranks_on_node` ranks (sharing the host's
// memory bandwidth), and come back as 16-bit weights (fp32 when training in fp32). The
// three run one after the other (neither Megatron-core's --overlap-cpu-optimizer-d2h-h2d
// nor DeepSpeed's overlap with the backward is modelled). 0 without a host.
double offload_optimizer_time(const Cluster& cl, const Plan& p, double grad_bytes, double n, double ranks_on_node);


const char* to_string(Phase ph);
const char* to_string(OpKind k);

}  // namespace strata
