// Estimate estimate(ModelSpec, Cluster, Plan): step time by SPEC term and memory by SPEC
// term for one plan. Pure: walks the plan's pipeline schedule with per-stage times from
// compute.h, adds the data-parallel reduction and the optimizer per stage, and reports
// the stage that finishes last (time) and the most loaded stage (memory).
//
// Ranks that share processors (Cluster::shares_processors: a CPU profile of more ranks
// than cores, ranks sharing one GPU) compute faster while fewer of them are busy: a rank
// gets min(1, C / k) of a processor when k of its node's ranks are busy, against the
// min(1, C / N) the cluster's rates were measured at (all N devices of the node busy). The
// estimate takes k as the node's ranks times their mean busy share of the step (compute,
// sends, exposed reductions, optimizer; not the pipeline's idle time) and solves for the
// compute speed that gives back its own k (a fixed point: the estimate at a speed scales
// the device's rates by it). A pipeline with one micro-batch on 4 ranks of 2 cores runs
// one stage at a time, each at a whole core, twice the rate of the profile's 4 busy ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "costmodel/compute.h"
#include "costmodel/hardware.h"
#include "costmodel/layout.h"
#include "costmodel/memory.h"
#include "costmodel/model_spec.h"
#include "costmodel/plan.h"
#include "costmodel/simulate.h"

namespace strata {

// Exposed seconds of one step on the critical stage; they sum to step_time_s.
struct TimeBreakdown {
  double forward = 0, backward = 0, recompute = 0, optimizer = 0, tp_comm = 0, cp_comm = 0, pp_comm = 0,
         dp_comm = 0, pipeline_bubble = 0, overhead = 0;
  double ep_comm = 0;  // expert-parallel all-to-alls (mixture-of-experts models)
  double activation_offload = 0;  // activation copies to and from the host the compute waits for
  double sum() const {
    return forward + backward + recompute + optimizer + tp_comm + cp_comm + pp_comm + dp_comm + pipeline_bubble +
           overhead + ep_comm + activation_offload;
  }
};

// The ranks a node holds: min(devices per node, world size).
double ranks_per_node(const Cluster& cl, const Plan& p);
// The host memory a node's ranks use for their offloaded optimizer shares (Plan::offload)
// and activations (Plan::offload_modules): ranks_per_node ranks, each with the largest of
// the stages in `stage_memory` (MemoryBreakdown::host_offload + host_activations).
double offloaded_host_bytes(const Cluster& cl, const Plan& p, const std::vector<MemoryBreakdown>& stage_memory);

struct Estimate {
  Plan plan;
  bool valid = false;             // false: reasons say why the plan cannot run at all
  std::vector<Reason> reasons;
  bool fits = false;              // peak memory within the device's memory
  double step_time_s = 0, tokens_per_s = 0, model_tflops_per_gpu = 0, hardware_tflops_per_gpu = 0, mfu = 0;
  TimeBreakdown time;
  MemoryBreakdown memory;         // the most loaded stage
  int64_t critical_stage = 0;     // the stage whose finish sets the step time
  int64_t microbatches = 0;
  AttentionKernel attention = AttentionKernel::flash;
  CpComm cp_comm = CpComm::p2p;   // cp_comm_type as run (context_parallel > 1)
  Stack stack;                    // the software stack the plan resolved to
  double dp_comm_total_s = 0;     // data-parallel communication before overlap (critical stage)
  double tp_comm_total_s = 0;     // tensor-parallel communication before overlap (critical stage)
  double host_memory_bytes = 0;   // offloaded optimizer states of the node's ranks in host memory
  // Ranks sharing processors (see above; 1 and 0s where they do not): the compute speed
  // against the cluster's rates, a node's mean busy ranks, its ranks and its processors.
  double compute_speed = 1, busy_ranks = 0, ranks_per_node = 0, processors_per_node = 0;
};

// What a caller may want beyond the numbers (traces, tests, the readable breakdown).
struct EstimateDetail {
  StageLayout layout;
  StageTimes stage_times;
  SimResult sim;                  // with events when record_events
  std::vector<MemoryBreakdown> stage_memory;
  std::vector<double> stage_dp_exposed_s, stage_dp_total_s, stage_optimizer_s, stage_finish_s;
  LayerCost layer, embedding, head;
  LayerCost plain_layer;          // a layer partial full recompute leaves alone (= layer otherwise)
  std::vector<OpCost> layer_ops;  // one layer, per micro-batch
  // The embedding's and the output layer's (with the loss), per micro-batch, where the
  // layer's are asked for (EstimateOptions::want_ops).
  std::vector<OpCost> embedding_ops, head_ops;
  // A model mixing dense and MoE layers: its dense layers' (those above are its MoE layers').
  LayerCost dense_layer, dense_plain_layer;
  std::vector<OpCost> dense_layer_ops;
  // A multi-token prediction module's transformer layer (ModelSpec::mtp_layers; the
  // modules' other work is in head): one of the above.
  LayerCost mtp_layer;
};

// The micro-batches in flight per stage (all chunks, first chunk, last chunk), from the
// schedule itself; saturates after a few multiples of p so long schedules are not walked.
struct InFlight {
  std::vector<int64_t> all, first, last;
};

// Work a caller (the planner) computed once for many plans and hands in; any null member
// is computed here. The values must be those of the same model, cluster and plan.
struct Precomputed {
  const LayerCost* layer = nullptr;
  const LayerCost* plain_layer = nullptr;  // the plan without recompute (partial recompute only)
  const LayerCost* embedding = nullptr;
  const LayerCost* head = nullptr;
  const InFlight* in_flight = nullptr;
  // A model that mixes dense and MoE layers: its dense layers' costs (layer and plain_layer
  // are its MoE layers'); dense_plain_layer is dense_layer without partial recompute.
  const LayerCost* dense_layer = nullptr;
  const LayerCost* dense_plain_layer = nullptr;
};

struct EstimateOptions {
  bool record_events = false;     // keep every simulated step (for --trace)
  bool want_ops = false;          // keep the op list of one layer
  Precomputed pre;
};

Estimate estimate(const ModelSpec& m, const Cluster& cl, const Plan& p, const EstimateOptions& opt = {},
                  EstimateDetail* detail = nullptr);

// The most a shared processor can speed a rank's compute up (1 where none is shared): a
// rank alone on its node's processors against the share it was measured at. The planner's
// lower bound divides by it.
double max_compute_speed(const Cluster& cl);
// The cluster with every compute rate multiplied by `speed` (peaks, memory bandwidth; the
// least kernel time divided): compute times divide by it, links are unchanged.
Cluster with_compute_speed(const Cluster& cl, double speed);

// g: the interleaved schedule's micro-batch group (Plan::vp_group_size(); 0 for p).
InFlight in_flight(ScheduleKind kind, int64_t p, int64_t v, int64_t m, int64_t g = 0);
// The same into *out, reusing its storage.
void in_flight_into(ScheduleKind kind, int64_t p, int64_t v, int64_t m, InFlight* out, int64_t g = 0);

// Memory of every stage; returns the index of the most loaded one.
size_t stages_memory(const ModelSpec& m, const Cluster& cl, const Plan& p, const StageLayout& lay,
                     const ComputeSetup& cs, const InFlight& fl, std::vector<MemoryBreakdown>* out);

// One point-to-point transfer of a micro-batch's activations between adjacent stages
// (Megatron's scatter/gather: each tensor-parallel rank sends 1/t of it across nodes,
// then the receivers all-gather it over NVLink).
double p2p_time(const ModelSpec& m, const Cluster& cl, const Plan& p, const ComputeSetup& cs);

// Model FLOPs of one step (3x forward: every GEMM, attention over the full S x S, logits).
double model_flops_per_step(const ModelSpec& m, const Plan& p);
double hardware_flops_per_step(const ModelSpec& m, const Plan& p);

// The SPEC names of the time and memory terms with their values, in report order: the one
// list the JSON, the text reports and the executor's measurements use.
using Terms = std::vector<std::pair<const char*, double>>;
Terms time_terms(const TimeBreakdown& t);
Terms memory_terms(const MemoryBreakdown& m);  // ends with "peak"

Json estimate_to_json(const Estimate& e);

}  // namespace strata
