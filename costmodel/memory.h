// Bytes per GPU by SPEC term for one pipeline stage: weights, gradients and optimizer
// states (divided across data-parallel ranks per ZeRO stage), activations (Korthikanti et
// al. 2022, generalised to GQA, SwiGLU, dropout-free models, FlashAttention and context
// parallelism) times the micro-batches the schedule keeps in flight, communication
// buffers, and the framework overhead of the cluster profile.
#pragma once

#include <cstdint>
#include <vector>

#include "costmodel/compute.h"
#include "costmodel/hardware.h"
#include "costmodel/layout.h"
#include "costmodel/model_spec.h"
#include "costmodel/plan.h"

namespace strata {

struct MemoryBreakdown {
  int64_t stage = 0;
  double params = 0;  // parameters held by this GPU (before ZeRO-3 sharding)
  double expert_params = 0;  // of them, routed experts' (replicated d / ep times, not d)
  double weights = 0, gradients = 0, optimizer_states = 0, activations = 0, comm_buffers = 0,
         framework_overhead = 0, peak = 0;
  // Host memory of the offloaded optimizer share (Plan::offload): its fp32 master weights,
  // Adam moments and the fp32 gradients copied out for them; not part of peak.
  double host_offload = 0;
  // Host memory of the offloaded activations (Plan::offload_modules) of the micro-batches in
  // flight at the peak; not part of peak.
  double host_activations = 0;
  // The terms are the optimizer step's, not the backward's: with 16-bit main gradients on
  // Megatron-core its fp32 copy of them (in optimizer_states) outweighs the activations.
  bool at_optimizer_step = false;
};

// Bytes per parameter of each state, before dividing by d.
struct StateBytes {
  double weights, gradients, optimizer_states;
};
// fused: gradients accumulate straight into the main gradients (no half-precision copy).
// fp32_grads: the main gradients in fp32 (grad_reduce_in_fp32), else in the parameters'
// 16-bit type (bf16 with fp8) and the optimizer's fp32 copy of them among its states.
StateBytes state_bytes(Precision prec, bool fused, bool fp32_grads);
// With Megatron's default main gradients: fp32, but fp16 in fp16 training.
inline StateBytes state_bytes(Precision prec, bool fused) { return state_bytes(prec, fused, prec != Precision::fp16); }

// Activations one transformer layer keeps for its backward, per micro-batch, per GPU.
double layer_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs);
// Fine-grained activation offloading (Plan::offload_modules): one group per module a layer
// offloads, in the order of the layer's backward (moe_act, expert_fc1, mlp_norm, attn_proj,
// core_attn, qkv_linear): the bytes of layer_activation_bytes it frees on the GPU and the
// bytes it copies to the host (and back), before activation_offload_fraction. The two
// differ where a tensor is kept for two modules (the attention output in 16 bits: copied by
// both, freed once) or kept in another form for the host (expert_fc1's 16-bit input in
// place of its fp8 copy). memory.cpp says which tensors each module holds. None with
// recompute full (a recomputed layer keeps its input only).
struct OffloadGroup {
  unsigned module = 0;  // an OffloadModule bit
  double freed = 0, copied = 0;
};
struct LayerOffload {
  OffloadGroup group[8];
  int n = 0;
  double freed = 0, copied = 0;  // the groups' sums
};
LayerOffload layer_offload(const ModelSpec& m, const Plan& p, const ComputeSetup& cs);
double layer_offload_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs);  // layer_offload's freed
// Everything one layer holds while it runs its forward or backward with nothing recomputed
// (the working set of a fully recomputed layer).
double layer_full_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs);
double embedding_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs);
double head_activation_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs);
// Transient bytes while the loss and its gradient are formed (the last stage).
double head_working_bytes(const ModelSpec& m, const Plan& p, const ComputeSetup& cs);

// Parameters held by one GPU of stage s (tensor-parallel shard, embedding on the first
// stage, output layer on the last, tied copies on both when p > 1).
double stage_params(const ModelSpec& m, const Plan& p, const StageLayout& lay, int64_t s);

// in_flight[s]: chunk-microbatch activation sets alive at once on stage s (schedule.h);
// in_flight_first[s], in_flight_last[s]: the same for the stage's first and last chunk
// (where the embedding and the output layer live).
// pre: stage_memory_inputs of the same (m, p, cs), computed once for all stages (the
// loop of stages_memory over the stages); null computes them here.
struct StageMemoryInputs {
  double per_layer = 0, per_full_layer = 0;  // layer_activation_bytes, layer_full_activation_bytes
  double embedding_act = 0, head_act = 0, head_working = 0;
  double layer_params = 0, word_embedding_params = 0, position_params = 0, final_norm_params = 0;
  double layer_expert_params = 0;  // the routed experts' share of layer_params
  // Multi-token prediction (ModelSpec::mtp_layers), on the last stage: its modules'
  // parameters (ModelSpec::mtp_params, and the word embedding's copy where the stage holds
  // none: untied, p > 1), their routed experts' share, and (in head_act) their activations.
  double mtp_params = 0, mtp_expert_params = 0;
  // Activation offloading: of an offloading layer (layer_offload; of a layer that partial
  // recompute leaves, with recompute full), the bytes its groups free and copy. per_layer
  // (per_full_layer) is what such a layer keeps on the GPU: activation_offload_fraction of
  // the freed bytes less.
  double offload_freed = 0, offload_copied = 0;
  // A model that mixes dense and MoE layers (ModelSpec::mixed): the same of its dense layers
  // (the fields above are its MoE layers').
  struct Dense {
    double per_layer = 0, per_full_layer = 0, layer_params = 0, offload_freed = 0, offload_copied = 0;
  } dense;
};
StageMemoryInputs stage_memory_inputs(const ModelSpec& m, const Plan& p, const ComputeSetup& cs);
// The activations stage s holds at its peak when each chunk-micro-batch of chunk c weighs
// chunk_weights[c]: the plan's schedule walked (forwards add, backwards free), its largest
// sum. stage_memory() uses it where a plan's own split (layout.h) leaves a stage's chunks
// unlike; elsewhere the chunks' average times the chunk-micro-batches in flight is exact.
double weighted_activation_peak(const Plan& p, int64_t s, const double* chunk_weights);
// The same walk with a second weight per chunk (a part of the first, such as what its
// recomputed layers keep), summed alongside: *part_at_peak is that sum where the first peaks
// (its first peak).
double weighted_activation_peak(const Plan& p, int64_t s, const double* chunk_weights, const double* chunk_parts,
                                double* part_at_peak);
MemoryBreakdown stage_memory(const ModelSpec& m, const Cluster& cl, const Plan& p, const StageLayout& lay,
                             const ComputeSetup& cs, int64_t s, int64_t in_flight, int64_t in_flight_first,
                             int64_t in_flight_last, const StageMemoryInputs* pre = nullptr);
// stage_memory() of every stage into (*out)[s], with in_flight[s] and the rest per stage;
// a middle stage with the layers of the one before it reuses what does not depend on them.
void stage_memories(const ModelSpec& m, const Cluster& cl, const Plan& p, const StageLayout& lay,
                    const ComputeSetup& cs, const int64_t* in_flight, const int64_t* in_flight_first,
                    const int64_t* in_flight_last, std::vector<MemoryBreakdown>* out);

}  // namespace strata
