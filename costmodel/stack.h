// The software stack a plan runs on: which attention kernel, whether gradient accumulation
// is fused into fp32 main gradients, and which communication overlaps compute. Each is a
// plan setting that defaults to "auto"; this file resolves "auto" from the cluster, the
// model and the plan. It owns no costs: compute.h and memory.h read the result.
#pragma once

#include "costmodel/hardware.h"
#include "costmodel/json_input.h"
#include "costmodel/model_spec.h"
#include "costmodel/plan.h"

namespace strata {

// Modern (Megatron-core with Transformer Engine, FSDP, torchtitan) when the cluster's
// published runs use it, the model is Llama-style (RoPE: every published Llama-family run)
// or the precision is fp8 (Transformer Engine): FlashAttention, gradient accumulation fused
// into fp32 main gradients, data- and tensor-parallel communication overlapped. Legacy
// (2020-2022 Megatron-LM, DeepSpeed): unfused softmax, bf16 gradients accumulated into a
// separate fp32 buffer, communication exposed. Context parallelism needs fused attention,
// so it turns FlashAttention on and nothing else. A setting the plan gives explicitly wins.
// Strata (the cluster says "strata"): this repository's executor, which keeps the unfused
// attention probabilities (the fused kernel when the plan says attention: flash), accumulates weight gradients straight into fp32
// buffers (fused accumulation), overlaps the data-parallel reduction with the backward,
// and runs the ZeRO-1/2 parameter all-gather and tensor-parallel collectives blocking.
struct Stack {
  bool modern = false;
  bool strata = false;
  AttentionKernel attention = AttentionKernel::unfused;
  bool overlap_grad_reduce = false, overlap_param_gather = false, tp_comm_overlap = false,
       grad_accumulation_fusion = false;
};

Stack resolve_stack(const ModelSpec& m, const Cluster& cl, const Plan& p);
// The model as the cluster's stack trains it: the strata executor has no dropout layers, so
// on a "strata" cluster the dropout rates are 0 (no masks kept, no dropout kernels).
ModelSpec model_on_stack(const ModelSpec& m, const Cluster& cl);
AttentionKernel resolve_attention(const ModelSpec& m, const Cluster& cl, const Plan& p);
Json stack_to_json(const Stack& s);

}  // namespace strata
