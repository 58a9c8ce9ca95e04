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
// published runs use it, the model is Llama-style (RoPE: every published Llama-family run),
// the precision is fp8 (Transformer Engine) or the plan shards gradients or parameters on
// an Ampere or newer GPU (ZeRO-2/3 on a device with bf16: published sharded runs there come
// from PyTorch FSDP, llm-foundry, torchtitan, with fused attention and fused
// cross-entropy; on V100 they are DeepSpeed's of 2019-2021): FlashAttention, gradient accumulation fused
// into fp32 main gradients, data- and tensor-parallel communication overlapped. Legacy
// (2020-2022 Megatron-LM, DeepSpeed): unfused softmax, bf16 gradients accumulated into a
// separate fp32 buffer, communication exposed. On a legacy stack two marks of a run that
// the unfused kernel cannot describe turn FlashAttention on and nothing else
// (needs_fused_attention). The plan's software_stack (legacy | modern) overrides the
// choice of stack, and any of the five settings the plan gives explicitly wins.
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
  // Megatron-core's fused cross-entropy (Plan::cross_entropy_loss_fusion; the modern stack's
  // default): two passes over the 16-bit logits, no fp32 copy kept (compute_ends.cpp,
  // memory.cpp's head terms). Never on the strata stack, whose executor has its own.
  bool cross_entropy_fusion = false;
  // tp_comm_overlap overlaps the input-gradient collectives of the column-parallel layers
  // with their weight-gradient GEMMs: always on the modern stack (Transformer Engine's
  // backward does so by itself), on a legacy one where the plan's tp_comm_overlap says on
  // with sequence parallelism (Megatron refuses --tp-comm-overlap without it).
  // userbuffers: on the modern stack with sequence parallelism and the tensor-parallel
  // group inside one node (they need its NVLink), the plan's tp_comm_overlap is Transformer
  // Engine's user buffers (Megatron's --tp-comm-overlap): every collective of the attention
  // and MLP blocks beside the GEMM it feeds or follows. "auto" runs them on GPUs with fp8
  // (Hopper, Blackwell), as Megatron-Bridge's, NeMo's and MLPerf's performance recipes do
  // there for their tensor-parallel models (as it overlaps the data-parallel reduction and
  // gathers, which Megatron-LM also leaves off by default; the A100-era recipes, NeMo-
  // Megatron-Launcher's, mostly left user buffers off); a Megatron-LM launch without
  // --tp-comm-overlap says off (megatron_args.cpp).
  bool userbuffers = false;
  // Main gradients accumulated and reduced in fp32 (else in the parameters' 16-bit type):
  // the plan's grad_reduce_in_fp32, "auto" on but in fp16 (Megatron's defaults; not a
  // property of the stack: every stack defaults alike); always on the strata stack.
  bool grad_reduce_in_fp32 = true;
};

// Megatron-LM's fused causal softmax (scaled_upper_triang_masked_softmax), the legacy
// stack's attention, takes at most 2048 keys: its published runs are at 2048 or shorter.
inline constexpr int64_t kLegacyFusedSoftmaxMaxKeys = 2048;
// Where "auto" attention is fused even on a legacy stack: context parallelism (its ring
// passes blocks of keys through a fused kernel) and a sequence longer than the legacy
// fused softmax takes (the S x S probabilities of an unfused core at 8k-64k tokens would
// not fit a GPU: published long-sequence runs use FlashAttention or PyTorch's fused SDPA).
bool needs_fused_attention(const ModelSpec& m, const Plan& p);
// ZeRO-2/3 sharding over more than one replica on a GPU with bf16 (Ampere or newer), which
// "auto" costs on the modern stack (with one replica nothing is sharded: the stage is moot).
bool sharding_selects_modern(const Cluster& cl, const Plan& p);
// `strata plan` compares every candidate on one stack, `plain`: resolve_stack of the plan
// without ZeRO (search.cpp's probe). A ZeRO-2/3 plan that sharding alone would make modern
// where `plain` is legacy gets software_stack=legacy, here and for the plan --compare gives.
void pin_to_plain_stack(const Cluster& cl, const Stack& plain, Plan& p);
Stack resolve_stack(const ModelSpec& m, const Cluster& cl, const Plan& p);
// The model as the cluster's stack trains it: the strata executor has no dropout layers, so
// on a "strata" cluster the dropout rates are 0 (no masks kept, no dropout kernels).
ModelSpec model_on_stack(const ModelSpec& m, const Cluster& cl);
AttentionKernel resolve_attention(const ModelSpec& m, const Cluster& cl, const Plan& p);
Json stack_to_json(const Stack& s);

}  // namespace strata
