// Memory terms against Korthikanti et al. 2022 (Table 2 and Eq. 5) and hand-derived
// state bytes, parameter placement and in-flight micro-batches.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "costmodel/estimate.h"
#include "costmodel/memory.h"
#include "costmodel/schedule.h"
#include "test_cluster.h"

namespace strata {
namespace {

// GPT-3 175B: s = 2048, h = 12288, a = 96; b = 1, t = 8; 16-bit activations.
struct Korthikanti : ::testing::Test {
  ModelSpec m = load_model("gpt3-175b");
  Cluster c = testing::round_cluster();
  double s = 2048, b = 1, h = 12288, a = 96, t = 8;
  double per_layer(const std::string& plan) {
    const Plan p = load_plan(plan);
    return layer_activation_bytes(m, p, compute_setup(m, c, p));
  }
};

TEST_F(Korthikanti, TensorParallel) {
  EXPECT_DOUBLE_EQ(per_layer("tp=8,precision=fp16"), s * b * h * (10 + 24 / t + 5 * a * s / (h * t)));
}
TEST_F(Korthikanti, TensorAndSequenceParallel) {
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,precision=fp16"), s * b * h * (34 / t + 5 * a * s / (h * t)));
}
TEST_F(Korthikanti, SelectiveRecompute) {
  EXPECT_DOUBLE_EQ(per_layer("tp=8,recompute=selective,precision=fp16"), s * b * h * (10 + 24 / t));
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,recompute=selective,precision=fp16"), s * b * h * 34 / t);
}
TEST_F(Korthikanti, FullRecomputeKeepsOnlyTheInput) {
  EXPECT_DOUBLE_EQ(per_layer("tp=8,recompute=full,precision=fp16"), 2 * s * b * h);
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,recompute=full,precision=fp16"), 2 * s * b * h / t);
}
TEST_F(Korthikanti, NoParallelism) {
  EXPECT_DOUBLE_EQ(per_layer("tp=1,precision=fp16"), s * b * h * (34 + 5 * a * s / h));
}
TEST_F(Korthikanti, FlashAttentionKeepsOnlyTheLogSumExp) {
  // The S x S terms are replaced by the fp32 log-sum-exp per query and head: 4 b (a/t) s,
  // which is all that selective recompute then saves.
  EXPECT_DOUBLE_EQ(per_layer("tp=8,attention=flash,precision=fp16"), s * b * h * (10 + 24 / t) + 4 * b * (a / t) * s);
  EXPECT_DOUBLE_EQ(per_layer("tp=8,attention=flash,recompute=selective,precision=fp16"), s * b * h * (10 + 24 / t));
}

TEST_F(Korthikanti, Fp8LinearLayersKeepTheirFp8Inputs) {
  // Transformer Engine keeps each linear layer's input as its 1-byte fp8 copy: QKV and fc1
  // inputs 2 -> 1, fc2 input (4h) 8 -> 4; the projection's fp8 input comes on top of the
  // core's 16-bit output (2 + 1). Norm inputs 4, Q K V 6, fc1 output 8, dropout masks 2:
  // 4 + 1 + 6 + 3 + 1 + 8 + 4 + 2 = 29 sbh / t, plus the fused core's log-sum-exp.
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,attention=flash,precision=fp8"), s * b * h * 29 / t + 4 * b * (a / t) * s);
  // Recomputed, the core keeps nothing of its own: the projection's fp8 input only, 27 sbh / t.
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,attention=flash,recompute=selective,precision=fp8"), s * b * h * 27 / t);
  // The unfused core keeps its probabilities, not its output: 27 sbh / t and the S x S terms.
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,attention=unfused,precision=fp8"), s * b * h * (27 / t + 5 * a * s / (h * t)));
  // Full recompute keeps the 16-bit layer input only, as in the other precisions.
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,recompute=full,precision=fp8"), 2 * s * b * h / t);
}

// Megatron-core's --recompute-modules: layernorm drops both norms' outputs (the QKV and MLP
// inputs, 2 sbh each in fp16: sequence parallel, 4 sbh / t); without core_attn the core keeps
// what it keeps with nothing recomputed (the 5 a s / h t of the unfused core).
TEST_F(Korthikanti, RecomputeModules) {
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,recompute=selective,recompute_modules=core_attn+layernorm,precision=fp16"),
                   s * b * h * 30 / t);
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,recompute_modules=layernorm,precision=fp16"),
                   s * b * h * (30 / t + 5 * a * s / (h * t)));
  EXPECT_DOUBLE_EQ(per_layer("tp=8,sp=1,recompute=selective,recompute_modules=core_attn,precision=fp16"),
                   per_layer("tp=8,sp=1,recompute=selective,precision=fp16"));
}

TEST(Memory, StateBytesPerParameter) {
  // Megatron's table: fp16 params and grads 20 bytes without sharding (4 + 16/d sharded);
  // bf16 here: 2 + 6 (bf16 grads + fp32 accumulation) + 12.
  const StateBytes f16 = state_bytes(Precision::fp16, false), b16 = state_bytes(Precision::bf16, false);
  EXPECT_DOUBLE_EQ(f16.weights + f16.gradients + f16.optimizer_states, 20);
  EXPECT_DOUBLE_EQ(b16.weights + b16.gradients + b16.optimizer_states, 20);
  // With gradient-accumulation fusion: Megatron's "6 + 12/d" for bf16.
  const StateBytes fused = state_bytes(Precision::bf16, true);
  EXPECT_DOUBLE_EQ(fused.weights + fused.gradients, 6);
  EXPECT_DOUBLE_EQ(state_bytes(Precision::fp32, false).optimizer_states, 8);
}

TEST(Memory, StageParametersPlaceEmbeddingsAndTheTiedCopy) {
  const ModelSpec m = load_model("gpt3-175b");
  const double layer = static_cast<double>(m.layer_params(8)), emb = 51200.0 * 12288 / 8;
  Plan p = load_plan("tp=8,pp=16");
  const StageLayout lay = make_layout(m.L, 16, 1);
  EXPECT_DOUBLE_EQ(stage_params(m, p, lay, 0), 6 * layer + emb + 2048.0 * 12288);
  EXPECT_DOUBLE_EQ(stage_params(m, p, lay, 5), 6 * layer);
  EXPECT_DOUBLE_EQ(stage_params(m, p, lay, 15), 6 * layer + emb + 2.0 * 12288);  // tied copy + final norm
  p = load_plan("tp=8");
  EXPECT_DOUBLE_EQ(stage_params(m, p, make_layout(m.L, 1, 1), 0),
                   96 * layer + emb + 2048.0 * 12288 + 2.0 * 12288);  // one shared copy
}

TEST(Memory, LayoutsGiveEmbeddingAndHeadALayerSlot) {
  // Llama 3 405B: 126 layers on 16 stages, first and last one layer short (128 = 16 * 8).
  StageLayout lay = make_layout(126, 16, 1);
  EXPECT_EQ(lay.stage_layers(0), 7);
  EXPECT_EQ(lay.stage_layers(5), 8);
  EXPECT_EQ(lay.stage_layers(15), 7);
  // Interleaved: 128 slots in 16 x 4 chunks of 2; the embedding's and the head's chunks hold 1.
  lay = make_layout(126, 16, 4);
  EXPECT_EQ(lay.chunk_layers(0, 0), 1);
  EXPECT_EQ(lay.chunk_layers(15, 3), 1);
  EXPECT_EQ(lay.chunk_layers(0, 1), 2);
  int64_t total = 0;
  for (int64_t s = 0; s < 16; ++s) total += lay.stage_layers(s);
  EXPECT_EQ(total, 126);
  // BLOOM 176B: 70 layers + 2 on 12 stages.
  lay = make_layout(70, 12, 1);
  EXPECT_EQ(lay.stage_layers(0), 5);
  EXPECT_EQ(lay.stage_layers(1), 6);
  // Neither divides: as even as possible.
  lay = make_layout(10, 4, 1);
  EXPECT_EQ(lay.stage_layers(0) + lay.stage_layers(1) + lay.stage_layers(2) + lay.stage_layers(3), 10);
  EXPECT_EQ(lay.stage_layers(0), 2);  // 2 extra layers to the middle stages 2 and 1
  EXPECT_EQ(lay.stage_layers(1), 3);
  EXPECT_EQ(lay.stage_layers(2), 3);
  // Interleaved, neither L nor L + 2 divisible by 16 x 5 = 80 chunks: 96 = 80 + 16, the 16
  // extra layers to the 16 middle chunks in model order (virtual stages 32-47, chunk c of
  // stage s being virtual stage 16 c + s: chunk 2 of every stage), the rest one each.
  lay = make_layout(96, 16, 5);
  total = 0;
  for (int64_t s = 0; s < 16; ++s) {
    total += lay.stage_layers(s);
    EXPECT_EQ(lay.stage_layers(s), 6) << s;
    EXPECT_EQ(lay.chunk_layers(s, 2), 2) << s;
    EXPECT_EQ(lay.chunk_layers(s, 0), 1) << s;
  }
  EXPECT_EQ(total, 96);
}

TEST(Memory, ZeroStagesDivideTheirStates) {
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = testing::round_cluster();
  const StageLayout lay = make_layout(m.L, 1, 1);
  double prev = 1e300;
  for (int z = 0; z <= 3; ++z) {
    Plan p = load_plan("dp=8");
    p.zero = z;
    const ComputeSetup cs = compute_setup(m, c, p);
    const MemoryBreakdown mb = stage_memory(m, c, p, lay, cs, 0, 1, 1, 1);
    const double P = mb.params;
    EXPECT_DOUBLE_EQ(mb.optimizer_states, 12 * P / (z >= 1 ? 8 : 1));
    EXPECT_DOUBLE_EQ(mb.gradients, 4 * P / (z >= 2 ? 8 : 1));  // Llama: modern stack, fp32 main grads only
    EXPECT_DOUBLE_EQ(mb.weights, 2 * P / (z >= 3 ? 8 : 1));
    EXPECT_LT(mb.weights + mb.gradients + mb.optimizer_states, prev);
    prev = mb.weights + mb.gradients + mb.optimizer_states;
  }
}

// The strata executor's states (its own stack): working weights as floats holding the
// rounded values, 4 bytes a parameter in bf16 as in fp32, fp32 gradients (4), fp32 master
// weights and Adam moments (12 in bf16, 8 in fp32: no master copy); ZeRO-1 shards the
// optimizer states and (a separate reduce-scatter target) adds the gradient shard, 4 P / 8;
// ZeRO-3 shards the weights too. Llama 2 7B on dp = 8.
TEST(Memory, StrataExecutorStates) {
  const ModelSpec m = load_model("llama2-7b");
  Cluster c = testing::round_cluster();
  c.strata_stack = true;
  const StageLayout lay = make_layout(m.L, 1, 1);
  for (const char* prec : {"bf16", "fp32"})
    for (int z : {0, 1, 3}) {
      SCOPED_TRACE(std::string(prec) + " zero " + std::to_string(z));
      Plan p = load_plan(std::string("dp=8,precision=") + prec);
      p.zero = z;
      const ComputeSetup cs = compute_setup(m, c, p);
      const MemoryBreakdown mb = stage_memory(m, c, p, lay, cs, 0, 1, 1, 1);
      const double P = mb.params, states = std::string(prec) == "bf16" ? 12.0 : 8.0;
      EXPECT_DOUBLE_EQ(mb.weights, 4 * P / (z >= 3 ? 8 : 1));
      EXPECT_DOUBLE_EQ(mb.optimizer_states, states * P / (z >= 1 ? 8 : 1));
      EXPECT_DOUBLE_EQ(mb.gradients, z == 0 ? 4 * P : z == 1 ? 4 * P + 4 * P / 8 : 4 * P / 8);
    }
}

// Mixture of experts: Mixtral 8x7B on dp = 16 with ep = 8 and ZeRO-1. Its 7,242,780,672
// parameters per GPU (32 layers of 218,144,768 with one expert, model_spec_test, the untied
// embedding and output layer 2 x 32000 x 4096, the final norm 4096) include the one expert's
// 32 x 176,160,768 = 5,637,144,576, held by 16 / 8 = 2 replicas: the optimizer states
// shard the dense 1,605,636,096 over 16 ranks and the experts' over 2, 12 bytes each.
// Activations: a layer's MLP part is the router's (e + 4) Tn E, the K token copies' fc1
// input, fc1 output, fc2 input and output (for GELU experts e T K (H + Fe + Fe + H)) in
// place of the dense MLP's fc1 output and fc2 input, e T (Fe + Fe) (round cluster, bf16).
TEST(Memory, ExpertsShardOverTheirReplicas) {
  const ModelSpec m = load_model("mixtral-8x7b");
  const Cluster c = testing::round_cluster();
  const StageLayout lay = make_layout(m.L, 1, 1);
  for (int z = 1; z <= 3; ++z) {
    Plan p = load_plan("dp=16,ep=8");
    p.zero = z;
    const MemoryBreakdown mb = stage_memory(m, c, p, lay, compute_setup(m, c, p), 0, 1, 1, 1);
    EXPECT_DOUBLE_EQ(mb.params, 7242780672.0);
    EXPECT_DOUBLE_EQ(mb.expert_params, 5637144576.0);
    const double shard = 1605636096.0 / 16 + 5637144576.0 / 2;
    EXPECT_DOUBLE_EQ(mb.optimizer_states, 12 * shard) << z;
    EXPECT_DOUBLE_EQ(mb.weights, z >= 3 ? 2 * shard : 2 * 7242780672.0) << z;
  }
  const ModelSpec moe = model_from_json(Json::parse(R"({"num_layers":2,"hidden_size":256,"num_attention_heads":4,
      "vocab_size":512,"seq_length":128,"activation":"gelu","num_experts":8,"moe_router_topk":2,
      "moe_ffn_hidden_size":512,"attention_dropout":0,"hidden_dropout":0})"), "model");
  ModelSpec dense = moe;
  dense.E = dense.K = dense.Fe = 0;
  dense.F = 512;
  const Plan p = load_plan("dp=8,ep=4,mbs=2,precision=bf16");
  const ComputeSetup cs = compute_setup(moe, c, p);
  // T = Tn = 256: router 6 x 256 x 8 = 12,288; copies 2 x 256 x 2 x (256 + 512 + 512 + 256)
  // = 1,572,864; the dense MLP's 2 x 256 x (512 + 512) = 524,288.
  EXPECT_DOUBLE_EQ(layer_activation_bytes(moe, p, cs) - layer_activation_bytes(dense, load_plan("dp=8,mbs=2,precision=bf16"), cs),
                   12288.0 + 1572864.0 - 524288.0);
  // recompute_modules moe_act: the experts' fc2 input (2 x 512 copies x 512) is not kept; the
  // attention core still is (no core_attn), so the rest is as with nothing recomputed.
  const Plan act = load_plan("dp=8,ep=4,mbs=2,precision=bf16,recompute_modules=moe_act");
  EXPECT_DOUBLE_EQ(layer_activation_bytes(moe, p, cs) - layer_activation_bytes(moe, act, compute_setup(moe, c, act)),
                   2.0 * 512 * 512);
}

// Transformer Engine's user buffers (tp_comm_overlap on, sequence parallelism; Transformer
// Engine 2.7 or later): twelve of Megatron's input shape, the micro-batch's sequence on
// this context-parallel rank x H, eight of them (the all-gathers') in fp8 in an fp8 run,
// where the two forward reduce-scatters' are ring exchanges holding (2t - 1)/t of it.
// Llama 2 7B, mbs 2, cp 2, tp 4: 4096 x 4096 x (8 x 1 + 2 x 2 x 7/4 + 2 x 2) = 318,767,104
// bytes in fp8; x (12 x 2) = 402,653,184 in bf16.
TEST(Memory, UserBuffers) {
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = testing::round_cluster();
  const StageLayout lay = make_layout(m.L, 1, 1);
  auto comm = [&](const char* plan) {
    const Plan p = load_plan(plan);
    return stage_memory(m, c, p, lay, compute_setup(m, c, p), 0, 1, 1, 1).comm_buffers;
  };
  EXPECT_DOUBLE_EQ(comm("tp=4,cp=2,mbs=2,sp=1,precision=fp8,tp_comm_overlap=1") - comm("tp=4,cp=2,mbs=2,sp=1,precision=fp8,tp_comm_overlap=0"),
                   318767104.0);
  EXPECT_DOUBLE_EQ(comm("tp=4,cp=2,mbs=2,sp=1,precision=bf16,tp_comm_overlap=1") - comm("tp=4,cp=2,mbs=2,sp=1,precision=bf16,tp_comm_overlap=0"),
                   402653184.0);
  EXPECT_DOUBLE_EQ(comm("tp=4,cp=2,mbs=2,sp=0,precision=bf16,tp_comm_overlap=1"), comm("tp=4,cp=2,mbs=2,sp=0,precision=bf16"));
}

// 16-bit main gradients (grad_reduce_in_fp32 false; Megatron-Bridge's performance recipes,
// Megatron-LM's --grad-reduce-in-bf16). Megatron's table, extended: bf16 parameters with
// bf16 gradients are 2 + 2 bytes plus 12 of optimizer (fp32 master, Adam m and v) and the
// fp32 copy of the gradients the optimizer steps on, 4 more: 4 + 16/d, as fp16's.
TEST(Memory, SixteenBitMainGradients) {
  const StateBytes b = state_bytes(Precision::bf16, true, false), f8 = state_bytes(Precision::fp8, true, false);
  EXPECT_DOUBLE_EQ(b.weights + b.gradients, 4);
  EXPECT_DOUBLE_EQ(b.optimizer_states, 16);
  EXPECT_DOUBLE_EQ(f8.weights + f8.gradients + f8.optimizer_states, 1 + 2 + 16);
  EXPECT_DOUBLE_EQ(state_bytes(Precision::bf16, false, false).gradients, 4);  // + the bf16 grads summed in
  // fp16 with fp32 main gradients (--accumulate-allreduce-grads-in-fp32): bf16's default.
  const StateBytes h = state_bytes(Precision::fp16, true, true);
  EXPECT_DOUBLE_EQ(h.gradients, 4);
  EXPECT_DOUBLE_EQ(h.optimizer_states, 12);
  EXPECT_DOUBLE_EQ(state_bytes(Precision::fp16, false).optimizer_states, 16);  // (the default: fp16 gradients)

  // Megatron-core (modern stack: Llama) drops the fp32 copy after the step, so it is not a
  // state: llama2-7b, dp 8, ZeRO-1: gradients 2 P, optimizer 12 P / 8, the copy 4 P / 8 only
  // at the step, where the activations of this plan outweigh it: the peak is the backward's.
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = testing::round_cluster();
  const StageLayout lay = make_layout(m.L, 1, 1);
  auto memory = [&](const char* plan) {
    const Plan p = load_plan(plan);
    return stage_memory(m, c, p, lay, compute_setup(m, c, p), 0, 1, 1, 1);
  };
  const MemoryBreakdown fp32 = memory("dp=8,zero=1,mbs=1");
  const MemoryBreakdown half = memory("dp=8,zero=1,mbs=1,grad_reduce_in_fp32=0");
  const double P = half.params;
  EXPECT_DOUBLE_EQ(half.gradients, 2 * P);
  EXPECT_DOUBLE_EQ(fp32.gradients, 4 * P);
  EXPECT_DOUBLE_EQ(half.optimizer_states, 12 * P / 8);
  EXPECT_DOUBLE_EQ(half.activations, fp32.activations);
  EXPECT_GT(half.activations, 4 * P / 8);
  EXPECT_DOUBLE_EQ(half.peak, fp32.peak - 2 * P);
  // Without ZeRO and with full recompute (a layer's input per layer, 1/8 of the copy) the
  // step is the peak: the terms as they stand then, no activations, the copy (4 P) among the
  // optimizer's states.
  const MemoryBreakdown step = memory("zero=0,mbs=1,recompute=full,grad_reduce_in_fp32=0");
  const MemoryBreakdown bwd = memory("zero=0,mbs=1,recompute=full");
  EXPECT_TRUE(step.at_optimizer_step);
  EXPECT_FALSE(half.at_optimizer_step);
  EXPECT_DOUBLE_EQ(step.activations, 0);
  EXPECT_DOUBLE_EQ(step.optimizer_states, 16 * P);
  EXPECT_DOUBLE_EQ(step.gradients, 2 * P);
  EXPECT_DOUBLE_EQ(step.framework_overhead, 1e9);
  EXPECT_DOUBLE_EQ(step.peak, 2 * P + 2 * P + 16 * P + step.comm_buffers + 1e9);
  EXPECT_GT(bwd.activations, 0);
  EXPECT_LT(bwd.activations, 4 * P);
  // A legacy stack's optimizer keeps its fp32 copy: GPT-3 (legacy on this cluster) in
  // bf16 with bf16 gradients, unfused: gradients 2 + 2, optimizer 16, over dp 8 with ZeRO-1.
  const ModelSpec g = load_model("gpt2-1.5b");
  const Plan lp = load_plan("dp=8,zero=1,grad_reduce_in_fp32=0");
  const MemoryBreakdown legacy = stage_memory(g, c, lp, make_layout(g.L, 1, 1), compute_setup(g, c, lp), 0, 1, 1, 1);
  EXPECT_FALSE(compute_setup(g, c, lp).stack.modern);
  EXPECT_DOUBLE_EQ(legacy.gradients, 4 * legacy.params);
  EXPECT_DOUBLE_EQ(legacy.optimizer_states, 16 * legacy.params / 8);
}

// Megatron-core's precision-aware optimizer (Megatron-Bridge's BF16 performance recipes turn
// it on): Transformer Engine's FusedAdam keeps the master weights as the 16 bits a bf16
// weight lacks (store_param_remainders) and the moments in their own types, and steps on
// the gradients as they are. llama2-7b on dp 8 with ZeRO-1: 2 + 4 + 4 = 10 bytes of
// optimizer per parameter of the shard; bf16 moments 2 + 2 + 2; without the remainders
// 4 + 4 + 4; and with bf16 gradients no fp32 copy at the step (without the optimizer that
// copy, 4 P / 8, outweighs the activations of full recompute and makes the peak).
TEST(Memory, PrecisionAwareOptimizer) {
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = testing::round_cluster();
  const StageLayout lay = make_layout(m.L, 1, 1);
  auto memory = [&](const Cluster& cl, const std::string& plan) {
    const Plan p = load_plan(plan);
    return stage_memory(m, cl, p, lay, compute_setup(m, cl, p), 0, 1, 1, 1);
  };
  const std::string base = "dp=8,zero=1,mbs=1,use_precision_aware_optimizer=1";
  const MemoryBreakdown pa = memory(c, base);
  const double P = pa.params;
  EXPECT_DOUBLE_EQ(pa.optimizer_states, 10 * P / 8);
  EXPECT_DOUBLE_EQ(pa.gradients, 4 * P);
  EXPECT_DOUBLE_EQ(memory(c, base + ",exp_avg_dtype=bf16,exp_avg_sq_dtype=bf16").optimizer_states, 6 * P / 8);
  EXPECT_DOUBLE_EQ(memory(c, base + ",store_param_remainders=0").optimizer_states, 12 * P / 8);
  EXPECT_DOUBLE_EQ(memory(c, base + ",exp_avg_dtype=fp8,exp_avg_sq_dtype=fp16").optimizer_states, (2 + 1 + 2) * P / 8);
  // fp8 weights of 1 byte come with the sharded optimizer (Megatron's --fp8-param-gather);
  // without ZeRO the model keeps bf16 weights.
  EXPECT_DOUBLE_EQ(memory(c, "dp=8,zero=1,mbs=1,precision=fp8").weights, 1 * P);
  EXPECT_DOUBLE_EQ(memory(c, "dp=8,zero=0,mbs=1,precision=fp8").weights, 2 * P);
  const MemoryBreakdown plain = memory(c, "dp=8,zero=1,mbs=1,recompute=full,grad_reduce_in_fp32=0");
  const MemoryBreakdown aware = memory(c, base + ",recompute=full,grad_reduce_in_fp32=0");
  EXPECT_TRUE(plain.at_optimizer_step);
  EXPECT_FALSE(aware.at_optimizer_step);
  EXPECT_DOUBLE_EQ(aware.gradients, 2 * P);
  EXPECT_DOUBLE_EQ(aware.optimizer_states, 10 * P / 8);
  EXPECT_GT(aware.activations, 0);
  // fp8 parameters: Megatron-core keeps its fp32 master weights (4 bytes) beside the
  // moments in their types.
  const Cluster h100 = load_cluster("dgx-h100-80g");
  EXPECT_DOUBLE_EQ(memory(h100, base + ",precision=fp8,exp_avg_dtype=bf16,exp_avg_sq_dtype=bf16").optimizer_states,
                   (4 + 2 + 2) * P / 8);
}

// Optimizer offload (Megatron-core's --optimizer-offload-fraction f, DeepSpeed's
// offload_optimizer): of llama2-7b's 12 bytes of fp32 master weights and Adam moments per
// parameter, sharded over dp = 8 by ZeRO-1, the fraction f moves to the host, where each
// offloaded parameter also has its fp32 gradient (4 bytes): GPU (1 - f) 12 P / 8, host
// f 12 P / 8 + 4 f P / 8 = 2 f P; the weights and gradients stay.
TEST(Memory, OffloadMovesTheOptimizerShareToTheHost) {
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = testing::round_cluster();
  const StageLayout lay = make_layout(m.L, 1, 1);
  Plan p = load_plan("dp=8,zero=1");
  const MemoryBreakdown none = stage_memory(m, c, p, lay, compute_setup(m, c, p), 0, 1, 1, 1);
  EXPECT_EQ(none.host_offload, 0);
  for (double f : {0.25, 1.0}) {
    p.offload = f;
    const MemoryBreakdown mb = stage_memory(m, c, p, lay, compute_setup(m, c, p), 0, 1, 1, 1);
    const double P = mb.params;
    EXPECT_DOUBLE_EQ(mb.optimizer_states, (1 - f) * 12 * P / 8) << f;
    EXPECT_DOUBLE_EQ(mb.host_offload, 2 * f * P) << f;
    EXPECT_DOUBLE_EQ(mb.weights, none.weights);
    EXPECT_DOUBLE_EQ(mb.gradients, none.gradients);
    EXPECT_DOUBLE_EQ(mb.peak, none.peak - f * 12 * P / 8) << f;
  }
  // ZeRO-2: the offloaded share's gradient shard (4 P / 8) moves to the host too, where
  // its fp32 copy is already counted: GPU gradients (1 - f) 4 P / 8, host as before.
  p = load_plan("dp=8,zero=2");
  const MemoryBreakdown z2 = stage_memory(m, c, p, lay, compute_setup(m, c, p), 0, 1, 1, 1);
  p.offload = 0.5;
  const MemoryBreakdown o2 = stage_memory(m, c, p, lay, compute_setup(m, c, p), 0, 1, 1, 1);
  EXPECT_DOUBLE_EQ(o2.gradients, 0.5 * 4 * o2.params / 8);
  EXPECT_DOUBLE_EQ(o2.gradients, 0.5 * z2.gradients);
  EXPECT_DOUBLE_EQ(o2.host_offload, 2 * 0.5 * o2.params);
  // A legacy stack's fp16 optimizer already holds the fp32 gradient among its 16 bytes:
  // GPT-2 1.5B (legacy here) in fp16, ZeRO-1 over 8, all offloaded: host 16 P / 8.
  const ModelSpec g = load_model("gpt2-1.5b");
  const Plan h = load_plan("dp=8,zero=1,offload=1,precision=fp16");
  const MemoryBreakdown legacy = stage_memory(g, c, h, make_layout(g.L, 1, 1), compute_setup(g, c, h), 0, 1, 1, 1);
  EXPECT_FALSE(compute_setup(g, c, h).stack.modern);
  EXPECT_DOUBLE_EQ(legacy.host_offload, 16 * legacy.params / 8);
  EXPECT_DOUBLE_EQ(legacy.optimizer_states, 0);
}

// Fine-grained activation offloading (Megatron-core's offload_modules), llama2-7b (H = 4096,
// 32 heads of 128, no GQA), one micro-batch of S = 4096 on one tensor-parallel rank, bf16
// (e = 2), FlashAttention on the modern stack; each tensor below is 4096 x 4096 = 2^24
// elements, u = 2^25 bytes. What each group frees on the GPU and copies to the host:
//   qkv_linear  the fused norm's input and the QKV input                    2u / 2u
//   core_attn   Q, K, V, and its output O (the projection's input, freed
//               with attn_proj's group); its log-sum-exp, 32 x 4096 fp32
//               values, is under Megatron's 2^20-element least              3u / 4u
//   attn_proj   O                                                           u / u
//   attn_norm, mlp_norm: fused into the linear layers, nothing.
// fp8: the QKV and projection inputs are 1-byte copies, and the core keeps its 2-byte O of
// its own: qkv 1.5u, core 4u / 4u, proj u/2.
TEST(Memory, ActivationOffloadBytesByModule) {
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = testing::round_cluster_with_host();
  auto off = [&](const std::string& plan) {
    const Plan p = load_plan(plan);
    return layer_offload(m, p, compute_setup(m, c, p));
  };
  const double u = 33554432;  // 2^25
  EXPECT_EQ(off("dp=1").n, 0);
  auto expect = [&](const std::string& plan, double freed, double copied) {
    const LayerOffload lo = off(plan);
    EXPECT_DOUBLE_EQ(lo.freed, freed) << plan;
    EXPECT_DOUBLE_EQ(lo.copied, copied) << plan;
  };
  expect("offload_modules=qkv_linear", 2 * u, 2 * u);
  expect("offload_modules=core_attn", 3 * u, 4 * u);
  expect("offload_modules=core_attn+attn_proj", 4 * u, 5 * u);
  expect("offload_modules=qkv_linear+core_attn+attn_proj", 6 * u, 7 * u);
  expect("offload_modules=attn_norm+mlp_norm", 0, 0);
  expect("offload_modules=core_attn,min_offloaded_tensor_size=0", 3 * u + 4.0 * 32 * 4096, 4 * u + 4.0 * 32 * 4096);
  expect("offload_modules=core_attn,min_offloaded_tensor_size=16777217", 0, 0);  // 2^24 + 1
  expect("offload_modules=qkv_linear+core_attn+attn_proj,precision=fp8", 1.5 * u + 4 * u + u / 2, 1.5 * u + 4 * u + u / 2);
  // The groups in the order of the backward.
  const LayerOffload order = off("offload_modules=qkv_linear+core_attn+attn_proj");
  ASSERT_EQ(order.n, 3);
  EXPECT_EQ(order.group[0].module, kOffloadAttnProj);
  EXPECT_EQ(order.group[1].module, kOffloadCoreAttn);
  EXPECT_EQ(order.group[2].module, kOffloadQkvLinear);
  // A recomputed core runs outside its group (core_attn moves nothing); recomputed norms keep
  // no QKV input; a fully recomputed layer keeps its input only.
  expect("offload_modules=core_attn+attn_proj,recompute=selective,precision=fp8", u / 2, u / 2);
  expect("offload_modules=core_attn+attn_proj,recompute=selective", u, u);
  expect("offload_modules=qkv_linear,recompute_modules=layernorm", u, u);
  expect("offload_modules=qkv_linear,recompute=full", 0, 0);
  // Never more than the layer keeps.
  const Plan all = load_plan("offload_modules=qkv_linear+core_attn+attn_proj,min_offloaded_tensor_size=0");
  EXPECT_LT(layer_offload_bytes(m, all, compute_setup(m, c, all)), layer_activation_bytes(m, all, compute_setup(m, c, all)));
}

// qwen3-30b-a3b (H = 2048, 128 experts of 768, top 8): a rank's experts see the 4096 x 8 =
// 32,768 token copies; bf16.
//   mlp_norm    the pre-MLP norm's input: 4096 x 2048 x 2                        16,777,216
//   expert_fc1  the token copies' original 16-bit input, one tensor, 32,768 x 2048 x 2
//               (with fp8 it frees the 1-byte copy the layer kept, half that)    134,217,728
//   moe_act     their fc1 output, 32,768 x 1536 x 2                              100,663,296
// The same with ep = 1 (one expert's share, 256 x 2048, would be under the least size: the
// input is one tensor).
TEST(Memory, ActivationOffloadOfTheExperts) {
  const ModelSpec m = load_model("qwen3-30b-a3b");
  const Cluster c = testing::round_cluster_with_host();
  auto off = [&](const std::string& plan) {
    const Plan p = load_plan(plan);
    return layer_offload(m, p, compute_setup(m, c, p));
  };
  EXPECT_DOUBLE_EQ(off("dp=8,ep=8,offload_modules=mlp_norm").copied, 16777216);
  EXPECT_DOUBLE_EQ(off("dp=8,ep=8,offload_modules=expert_fc1").copied, 134217728);
  EXPECT_DOUBLE_EQ(off("dp=8,ep=8,offload_modules=moe_act").copied, 100663296);
  EXPECT_DOUBLE_EQ(off("dp=8,ep=1,offload_modules=expert_fc1").copied, 134217728);
  const LayerOffload fp8 = off("dp=8,ep=8,offload_modules=expert_fc1+moe_act+mlp_norm,precision=fp8");
  EXPECT_DOUBLE_EQ(fp8.copied, 134217728 + 100663296 + 16777216);
  EXPECT_DOUBLE_EQ(fp8.freed, 134217728 / 2 + 100663296 + 16777216);
  ASSERT_EQ(fp8.n, 3);
  EXPECT_EQ(fp8.group[0].module, kOffloadMoeAct);
  EXPECT_EQ(fp8.group[1].module, kOffloadExpertFc1);
  EXPECT_EQ(fp8.group[2].module, kOffloadMlpNorm);
}

// A stage's peak with offloading: llama2-7b on 2 stages of 16 layers, stage 0 with 2
// micro-batches in flight, core_attn + attn_proj (4u freed, 5u copied per layer). Its
// activations lose f x 16 x 2 layers' freed bytes and keep two layers' (Megatron's margin,
// the layer whose backward runs, and the layer below it being reloaded); the host holds the
// copies.
TEST(Memory, ActivationOffloadMovesActivationsToTheHost) {
  const ModelSpec m = load_model("llama2-7b");
  const Cluster c = testing::round_cluster_with_host();
  const StageLayout lay = make_layout(m.L, 2, 1);
  auto memory = [&](const std::string& plan) {
    const Plan p = load_plan(plan);
    return stage_memory(m, c, p, lay, compute_setup(m, c, p), 0, 2, 2, 2);
  };
  const MemoryBreakdown none = memory("pp=2,gbs=8");
  EXPECT_EQ(none.host_activations, 0);
  const double u = 33554432;
  for (double f : {1.0, 0.5}) {
    const MemoryBreakdown mb =
        memory(fmt::format("pp=2,gbs=8,offload_modules=core_attn+attn_proj,activation_offload_fraction={}", f));
    EXPECT_DOUBLE_EQ(mb.activations, none.activations - f * 32 * 4 * u + 2 * 4 * u) << f;
    EXPECT_DOUBLE_EQ(mb.host_activations, f * 32 * 5 * u) << f;
    EXPECT_DOUBLE_EQ(mb.weights + mb.gradients + mb.optimizer_states, none.weights + none.gradients + none.optimizer_states);
  }
  // Partial recompute: the 4 recomputed layers of each stage keep their input, the other 12
  // offload.
  const MemoryBreakdown part = memory("pp=2,gbs=8,recompute=full,recompute_num_layers=4,offload_modules=core_attn+attn_proj");
  const MemoryBreakdown part_none = memory("pp=2,gbs=8,recompute=full,recompute_num_layers=4");
  EXPECT_DOUBLE_EQ(part.host_activations, 2 * 12 * 5 * u);
  EXPECT_DOUBLE_EQ(part.activations, part_none.activations - 2 * 12 * 4 * u + 2 * 4 * u);
  // The estimate: the node's ranks' host bytes, and a node whose host cannot hold them does
  // not fit.
  Plan p = load_plan("pp=2,dp=4,gbs=64,offload_modules=core_attn+attn_proj");
  const Estimate e = estimate(m, c, p);
  ASSERT_TRUE(e.valid);
  EXPECT_DOUBLE_EQ(e.host_memory_bytes, 8 * 2 * 16 * 5 * u);  // 8 ranks, stage 0's 2 micro-batches of 16 layers
  EXPECT_TRUE(e.fits);
  Cluster small = c;
  small.host.memory_bytes = e.host_memory_bytes * 0.99;
  EXPECT_FALSE(estimate(m, small, p).fits);
  const Json j = estimate_to_json(e);
  EXPECT_EQ(j["host_memory_bytes"]["per_node"].get<int64_t>(), std::llround(e.host_memory_bytes));
  EXPECT_TRUE(j["host_memory_bytes"].contains("activation_offload_per_gpu"));
  EXPECT_FALSE(j["host_memory_bytes"].contains("optimizer_offload_per_gpu"));
}

// stage_memories() reuses a middle stage's shape for the next stage with the same layers:
// every term must equal stage_memory() of that stage alone, to the bit, on plans with
// uneven layouts, partial recompute, interleaving and every ZeRO stage.
TEST(Memory, AllStagesAtOnceEqualEachStageAlone) {
  Cluster c = testing::round_cluster();
  c.allocator_fragmentation = 0.15;  // both allocator fractions, so that the reserve's split is compared too
  c.allocator_fragmentation_saved = 0.05;
  int stages = 0;
  for (const char* model : {"gpt3-175b", "llama3-70b", "tiny-gpt"}) {
    const ModelSpec m = load_model(model);
    for (const char* plan : {"tp=8,pp=16,dp=8,mbs=1,gbs=1536,recompute=full", "tp=8,pp=6,dp=2,mbs=1,gbs=64,zero=1",
                             "tp=4,pp=4,dp=4,vp=2,mbs=2,gbs=64,recompute=selective,sp=1",
                             "pp=8,dp=2,mbs=1,gbs=32,zero=3,recompute=full,recompute_num_layers=1",
                             "pp=4,dp=2,mbs=1,gbs=8,zero=2,schedule=gpipe"}) {
      const Plan p = load_plan(plan);
      if (!check_plan(m, c, p).empty()) continue;
      const ComputeSetup cs = compute_setup(m, c, p);
      const StageLayout lay = make_layout(m.L, p.p, p.v);
      const InFlight fl = in_flight(p.schedule(), p.p, lay.v, p.microbatches(), p.vp_group_size());
      std::vector<MemoryBreakdown> all;
      stage_memories(m, c, p, lay, cs, fl.all.data(), fl.first.data(), fl.last.data(), &all);
      ASSERT_EQ(all.size(), static_cast<size_t>(p.p));
      for (int64_t s = 0; s < p.p; ++s) {
        const size_t i = static_cast<size_t>(s);
        const MemoryBreakdown one = stage_memory(m, c, p, lay, cs, s, fl.all[i], fl.first[i], fl.last[i]);
        const std::string what = std::string(model) + " " + plan + " stage " + std::to_string(s);
        EXPECT_EQ(all[i].stage, s) << what;
        EXPECT_EQ(all[i].params, one.params) << what;
        EXPECT_EQ(all[i].weights, one.weights) << what;
        EXPECT_EQ(all[i].gradients, one.gradients) << what;
        EXPECT_EQ(all[i].optimizer_states, one.optimizer_states) << what;
        EXPECT_EQ(all[i].activations, one.activations) << what;
        EXPECT_EQ(all[i].comm_buffers, one.comm_buffers) << what;
        EXPECT_EQ(all[i].framework_overhead, one.framework_overhead) << what;
        EXPECT_EQ(all[i].peak, one.peak) << what;
        ++stages;
      }
    }
  }
  std::printf("%d stages compared\n", stages);
  EXPECT_GT(stages, 60);  // the plans above are valid for these models
}

// The interleaved schedule of 2 stages x 2 chunks with 4 micro-batches (groups of 2), stage
// 0: warm-up (p - s - 1) 2 + (v - 1) g = 4 forwards, F0..F3 = chunk 0 of micro-batches 0, 1,
// chunk 1 of 0, 1; then pairs (F4 = c0 mb2, B0 = c1 mb0), (F5 = c0 mb3, B1 = c1 mb1),
// (F6 = c1 mb2, B2 = c0 mb0), (F7 = c1 mb3, B3 = c0 mb1); then B4..B7. With chunk weights
// w0, w1 the sums after each step: w0, 2w0, 2w0 + w1, 2w0 + 2w1, 3w0 + 2w1, 3w0 + w1, 4w0 +
// w1, 4w0, 4w0 + w1, 3w0 + w1, 3w0 + 2w1, 2w0 + 2w1, then less: the peak is max(4w0 + w1,
// 3w0 + 2w1).
TEST(Memory, WeightedActivationPeakWalksTheSchedule) {
  const Plan p = load_plan("pp=2,vp=2,mbs=1,gbs=4");
  const double heavy_first[2] = {7, 1}, heavy_last[2] = {1, 7};
  EXPECT_EQ(weighted_activation_peak(p, 0, heavy_first), 29.0);  // 4 x 7 + 1
  EXPECT_EQ(weighted_activation_peak(p, 0, heavy_last), 17.0);   // 3 + 14 (4w0 + w1 = 11)
  // A part of each weight summed alongside, read where the weights first peak: 4w0 + w1 and
  // 3w0 + 2w1 above, so 4 x 2 + 0.5 and 3 x 0.5 + 2 x 2.
  double part = 0;
  const double parts_first[2] = {2, 0.5}, parts_last[2] = {0.5, 2};
  EXPECT_EQ(weighted_activation_peak(p, 0, heavy_first, parts_first, &part), 29.0);
  EXPECT_EQ(part, 8.5);
  EXPECT_EQ(weighted_activation_peak(p, 0, heavy_last, parts_last, &part), 17.0);
  EXPECT_EQ(part, 5.5);
  EXPECT_EQ(weighted_activation_peak(p, 0, heavy_last, parts_first, &part), 17.0);  // (not the memo's)
  EXPECT_EQ(part, 3 * 2 + 2 * 0.5);
  // Equal weights: the count of peak_in_flight() times the weight.
  const double even[2] = {1, 1};
  const std::vector<int64_t> counts = peak_in_flight(make_schedule(ScheduleKind::interleaved, 2, 2, 4));
  for (int64_t s = 0; s < 2; ++s)
    EXPECT_EQ(weighted_activation_peak(p, s, even), static_cast<double>(counts[static_cast<size_t>(s)]));
}

// The walk skips whole periods of the steady state once one has left the sum where it began
// (memory.cpp): against every step of the stored schedule (make_schedule), summed in the same
// order, it gives the same peak to the bit, on 2-8 stages, 2-6 chunks, micro-batches from p
// to 12 p, groups of p and Megatron-core's larger ones, with weights drawn at random.
TEST(Memory, WeightedActivationPeakSkipsPeriodsExactly) {
  uint64_t x = 88172645463325252ull;  // xorshift
  auto draw = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return static_cast<double>(x % 1000000) * 1.37e3 + 1.0;
  };
  int shapes = 0;
  for (int64_t pp : {2, 3, 4, 8})
    for (int64_t v : {2, 3, 5, 6})
      for (int64_t mb : {pp, pp + 1, 2 * pp, 3 * pp + 2, 8 * pp, 12 * pp}) {
        const Plan p = load_plan(fmt::format("pp={},vp={},mbs=1,gbs={}", pp, v, mb));
        const Schedule sc = make_schedule(ScheduleKind::interleaved, pp, v, mb, p.vp_group_size());
        // Whole numbers (every period returns its sum exactly) and fractions (a period may
        // not, and the walk goes on until one does).
        std::vector<double> w(static_cast<size_t>(v));
        for (size_t i = 0; i < w.size(); ++i) w[i] = (mb % 2 == 0 ? draw() : draw() * 0.1 + 0.37 * static_cast<double>(i));
        for (int64_t st = 0; st < pp; ++st) {
          double now = 0, peak = 0;
          for (const Step& step : sc.stages[static_cast<size_t>(st)]) {
            now += step.forward ? w[static_cast<size_t>(step.chunk)] : -w[static_cast<size_t>(step.chunk)];
            peak = std::max(peak, now);
          }
          EXPECT_EQ(weighted_activation_peak(p, st, w.data()), peak) << p.p << " " << v << " " << mb << " " << st;
        }
        ++shapes;
      }
  EXPECT_EQ(shapes, 96);
}

// A plan's own layout with unlike chunks on a stage: the stage's activations are the walk's,
// not the chunks' average times the count in flight. gpt2-124m's 12 layers as p = 2 x v = 2
// chunks: "Et*6|t|t*2|t*3L" puts 6 and 2 layers on stage 0, "Et*4|t*2|t*4|t*2L" 4 and 4. With
// a = one layer's activations and e the embedding's, stage 0 holds 4(6a + e) + 2a = 26a + 4e
// at its peak in the first, 4(4a + e) + 4a = 20a + 4e in the second (equal chunks: the
// average, 5 in flight x 4a + 4 chunk-0 x e, the same): 6a more.
TEST(Memory, UnlikeChunksOfALayoutAreWeighedByTheSchedule) {
  const ModelSpec m = load_model("gpt2-124m");
  const Cluster c = testing::round_cluster();
  EstimateDetail unlike, alike;
  const Plan pu = load_plan("pp=2,mbs=1,gbs=4,pipeline_model_parallel_layout=Et*6|t|t*2|t*3L");
  const Plan pa = load_plan("pp=2,mbs=1,gbs=4,pipeline_model_parallel_layout=Et*4|t*2|t*4|t*2L");
  ASSERT_TRUE(estimate(m, c, pu, {}, &unlike).valid);
  ASSERT_TRUE(estimate(m, c, pa, {}, &alike).valid);
  const double a = layer_activation_bytes(m, pu, compute_setup(m, c, pu));
  EXPECT_DOUBLE_EQ(unlike.stage_memory[0].activations - alike.stage_memory[0].activations, 6.0 * a);
}

TEST(Memory, ContextParallelRanksShareTheShards) {
  // cp = 2, dp = 4: eight ranks hold the same parameters, so ZeRO divides by 8.
  const ModelSpec m = load_model("llama3-8b");
  const Cluster c = testing::round_cluster();
  const Plan p = load_plan("cp=2,dp=4,zero=1");
  const MemoryBreakdown mb = stage_memory(m, c, p, make_layout(m.L, 1, 1), compute_setup(m, c, p), 0, 1, 1, 1);
  EXPECT_DOUBLE_EQ(mb.optimizer_states, 12 * mb.params / 8);
}

TEST(Memory, MicrobatchesInFlight) {
  // 1F1B: stage s holds min(p - s, m); GPipe: all m; interleaved (Megatron): stage s holds
  // (p - s - 1) * 2 + (v - 1) * p + 1 chunk-microbatches, so stage 0 holds p*v + p - 1,
  // Korthikanti's factor 1 + (p-1)/(p v) over p micro-batches of L/p layers.
  InFlight f = in_flight(ScheduleKind::one_f_one_b, 4, 1, 8);
  EXPECT_EQ(f.all, (std::vector<int64_t>{4, 3, 2, 1}));
  f = in_flight(ScheduleKind::one_f_one_b, 4, 1, 2);
  EXPECT_EQ(f.all, (std::vector<int64_t>{2, 2, 2, 1}));
  f = in_flight(ScheduleKind::gpipe, 4, 1, 8);
  EXPECT_EQ(f.all, (std::vector<int64_t>{8, 8, 8, 8}));
  f = in_flight(ScheduleKind::interleaved, 4, 2, 8);
  EXPECT_EQ(f.all, (std::vector<int64_t>{11, 9, 7, 5}));
  EXPECT_DOUBLE_EQ(11.0 / 8.0, 1.0 + 3.0 / 8.0);  // stage 0 in units of p micro-batches of L/p layers
  f = in_flight(ScheduleKind::interleaved, 4, 2, 400);  // long schedules saturate
  EXPECT_EQ(f.all, (std::vector<int64_t>{11, 9, 7, 5}));
  // The closed forms used for GPipe and 1F1B agree with walking their schedules.
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b})
    for (int64_t p : {1, 2, 5, 8})
      for (int64_t m : {1, 3, 8, 40}) {
        const Schedule sc = make_schedule(kind, p, 1, m);
        EXPECT_EQ(in_flight(kind, p, 1, m).all, peak_in_flight(sc)) << p << " " << m;
      }
  // The interleaved counts in closed form: the same peaks as walking make_schedule(), for
  // every chunk and for the first and last chunk alone.
  for (int64_t p : {2, 3, 4, 5, 8, 16})
    for (int64_t v : {2, 3, 4, 5, 8})
      for (int64_t m = p; m <= 12 * p; m += p) {
        const Schedule sc = make_schedule(ScheduleKind::interleaved, p, v, m);
        const InFlight fl = in_flight(ScheduleKind::interleaved, p, v, m);
        EXPECT_EQ(fl.all, peak_in_flight(sc)) << p << " " << v << " " << m;
        EXPECT_EQ(fl.first, peak_in_flight_of_chunk(sc, 0)) << p << " " << v << " " << m;
        EXPECT_EQ(fl.last, peak_in_flight_of_chunk(sc, static_cast<int32_t>(v - 1))) << p << " " << v << " " << m;
      }
  // Micro-batch groups of g > p (Megatron-core's microbatch_group_size_per_vp_stage) warm
  // up (p - s - 1) * 2 + (v - 1) * g chunk-forwards, so stage s holds that plus the first
  // steady forward: p = 4, v = 2, m = 10, g = 5 gives 11, 9, 7, 5 + 1 = 12, 10, 8, 6.
  f = in_flight(ScheduleKind::interleaved, 4, 2, 10, 5);
  EXPECT_EQ(f.all, (std::vector<int64_t>{12, 10, 8, 6}));
  for (int64_t p : {2, 3, 4})
    for (int64_t v : {2, 3})
      for (int64_t m = p + 1; m <= 4 * p; ++m)
        for (int64_t g = p + 1; g <= m; ++g) {
          if (m % g != 0 && m % g < p) continue;
          const int64_t total = m * v;
          const InFlight fl = in_flight(ScheduleKind::interleaved, p, v, m, g);
          for (int64_t s = 0; s < p; ++s) {
            const int64_t w = std::min((p - s - 1) * 2 + (v - 1) * g, total);
            EXPECT_EQ(fl.all[static_cast<size_t>(s)], w < total ? w + 1 : total) << p << " " << v << " " << m << " " << g;
          }
        }
  // ... and every count, of all chunks and of the first and last alone, is that of walking
  // make_schedule() with the groups, short schedules and long ones (whose middle rounds
  // in_flight() skips), every group Megatron-core accepts.
  int grouped = 0;
  for (int64_t p : {2, 3, 4, 5, 8})
    for (int64_t v : {2, 3, 5})
      for (int64_t m : {p + 1, 2 * p - 1, 2 * p + 1, 3 * p + 2, int64_t{37}, int64_t{95}, int64_t{190}})
        for (int64_t g = p; g <= m; ++g) {
          if (m % g != 0 && m % g < p) continue;
          if (g == p && m % p == 0) continue;  // the closed form above
          const Schedule sc = make_schedule(ScheduleKind::interleaved, p, v, m, g);
          const InFlight fl = in_flight(ScheduleKind::interleaved, p, v, m, g);
          const std::string what = std::to_string(p) + " " + std::to_string(v) + " " + std::to_string(m) + " " +
                                   std::to_string(g);
          EXPECT_EQ(fl.all, peak_in_flight(sc)) << what;
          EXPECT_EQ(fl.first, peak_in_flight_of_chunk(sc, 0)) << what;
          EXPECT_EQ(fl.last, peak_in_flight_of_chunk(sc, static_cast<int32_t>(v - 1))) << what;
          ++grouped;
        }
  std::printf("%d grouped interleaved schedules counted\n", grouped);
}

// Multi-token prediction on the last stage: a Llama-style model of H 4096 (32 heads, SwiGLU
// of 11008, vocabulary 32000, untied), one module, tp 2 with sequence parallelism, pp 2,
// one sequence of 2048 (T 2048, Tn 1024, 2-byte activations):
//   parameters: the module's dense layer 4096 x 12288 / 2 + 4096 x 4096 / 2 + 4096 x 22016
//     / 2 + 11008 x 4096 / 2 + two norms 8192 = 101,195,776; eh_proj 2 x 4096 x 4096 / 2 =
//     16,777,216; enorm, hnorm and the final norm 12,288; and the stage's own word
//     embedding 16000 x 4096 = 65,536,000 (tied too: the output layer keeps its weight,
//     unused): 183,521,280 more on the last stage, none on the first.
//   activations per micro-batch in flight on the last chunk: the layer's own
//     (layer_activation_bytes), enorm's input and eh_proj's (Tn x 2H): 3 x 2 x 1024 x 4096
//     = 25,165,824 (hnorm's input is the decoder's output, kept already), and the output
//     layer's again: the final norm's input and output 2 x 2 x 1024 x 4096 = 16,777,216
//     and the logits 2 x 2048 x 16000 = 65,536,000. With every layer recomputed the layer
//     keeps its input only and, outside the checkpoint, the final norm's output and the
//     logits (8,388,608 less than the output layer's); under the block method (not
//     recomputed) the layer keeps everything.
TEST(Memory, MultiTokenPrediction) {
  const ModelSpec with = testing::llama_with_mtp(1), without = testing::llama_with_mtp(0);
  const Cluster c = load_cluster("dgx-h100-80g");
  const Plan p = load_plan("tp=2,pp=2,sp=1,dp=1,mbs=1,gbs=8,precision=bf16");
  const StageLayout lay = make_layout(with, p);
  EXPECT_EQ(with.mtp_params(2), 101195776 + 16777216 + 12288);
  EXPECT_DOUBLE_EQ(stage_params(with, p, lay, 1) - stage_params(without, p, lay, 1), 183521280.0);
  EXPECT_DOUBLE_EQ(stage_params(with, p, lay, 0), stage_params(without, p, lay, 0));
  // (tied, the last stage holds the embedding already)
  ModelSpec tied = with, tied0 = without;
  tied.tie_embeddings = tied0.tie_embeddings = true;
  EXPECT_DOUBLE_EQ(stage_params(tied, p, lay, 1) - stage_params(tied0, p, lay, 1), 183521280.0);
  const ComputeSetup cs = compute_setup(with, c, p);
  auto head_act = [&](const Plan& q) {
    return stage_memory_inputs(with, q, cs).head_act - stage_memory_inputs(without, q, cs).head_act;
  };
  EXPECT_DOUBLE_EQ(stage_memory_inputs(without, p, cs).head_act, 16777216.0 + 65536000.0);
  EXPECT_DOUBLE_EQ(head_act(p), layer_activation_bytes(with, p, cs) + 25165824.0 + 16777216.0 + 65536000.0);
  const Plan full = load_plan("tp=2,pp=2,sp=1,dp=1,mbs=1,gbs=8,precision=bf16,recompute=full");
  EXPECT_DOUBLE_EQ(head_act(full), layer_activation_bytes(with, full, cs) - 8388608.0 + 16777216.0 + 65536000.0);
  EXPECT_DOUBLE_EQ(layer_activation_bytes(with, full, cs), 2.0 * 1024 * 4096);  // the layer's input
  const Plan block = load_plan("tp=2,pp=2,sp=1,dp=1,mbs=1,gbs=8,precision=bf16,recompute=full,recompute_num_layers=1");
  EXPECT_DOUBLE_EQ(head_act(block), layer_full_activation_bytes(with, block, cs) + 25165824.0 + 16777216.0 + 65536000.0);
  // The estimate: the last stage's parameters and their states, and the embedding's
  // gradient all-reduced between the first and the last stage.
  const Estimate a = estimate(with, c, p), b = estimate(without, c, p);
  ASSERT_TRUE(a.valid && b.valid);
  EstimateDetail da, db;
  estimate(with, c, p, EstimateOptions{}, &da);
  estimate(without, c, p, EstimateOptions{}, &db);
  EXPECT_DOUBLE_EQ(da.stage_memory[1].params - db.stage_memory[1].params, 183521280.0);
  EXPECT_DOUBLE_EQ(da.stage_memory[0].params, db.stage_memory[0].params);
  EXPECT_GT(da.stage_dp_total_s[0], db.stage_dp_total_s[0]);  // (the embedding's all-reduce)
  EXPECT_GT(a.step_time_s, b.step_time_s);
}

// Multi-latent attention keeps V and the attention output at Dv = 128 per head where an
// ordinary attention of the same 192-wide heads keeps 192, and the two latents' norm and
// up-projection inputs: DeepSeek-V3, one sequence of 4096 on 2 tensor-parallel ranks with
// sequence parallelism in bf16 (T 4096, Tn 2048, 64 heads per rank):
//   V and O  2 x 2 x 4096 x 64 x (128 - 192) = -67,108,864
//   latents  (2 + 2) x 2048 x (1536 + 512)   =  16,777,216
TEST(Memory, MultiLatentAttentionActivations) {
  const ModelSpec m = load_model("deepseek-v3").dense_layers();
  ModelSpec plain = m;
  plain.q_lora_rank = plain.kv_lora_rank = plain.qk_pos_emb_head_dim = plain.v_head_dim = 0;
  ASSERT_TRUE(m.mla());
  ASSERT_FALSE(plain.mla());
  const Cluster c = load_cluster("dgx-h100-80g");
  const Plan p = load_plan("tp=2,sp=1,dp=4,mbs=1,gbs=8,precision=bf16");
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, p, compute_setup(m, c, p)) -
                       layer_activation_bytes(plain, p, compute_setup(plain, c, p)),
                   -67108864.0 + 16777216.0);
  // recompute_modules mla_up_proj drops Q, K (64 heads x 192 each) and V (64 x 128):
  // 2 x 4096 x 64 x 512 = 268,435,456 bytes, and the up projections' inputs (the latents'
  // norms' outputs, 2 x 2048 x 2048 = 8,388,608); mlp a dense layer's fc1 output (2 x 4096 x
  // 2 x 9216), fc2 input (2 x 4096 x 9216) and, the norm fused into fc1 on the modern stack,
  // its input (2 x 2048 x 7168): 255,852,544.
  const double plan_bytes = layer_activation_bytes(m, p, compute_setup(m, c, p));
  for (const auto& [modules, dropped] : {std::pair{"mla_up_proj", 276824064.0}, {"mlp", 255852544.0},
                                         {"mla_up_proj+mlp", 276824064.0 + 255852544.0}}) {
    const Plan r = load_plan(std::string("tp=2,sp=1,dp=4,mbs=1,gbs=8,precision=bf16,recompute_modules=core_attn+") + modules);
    const Plan core = load_plan("tp=2,sp=1,dp=4,mbs=1,gbs=8,precision=bf16,recompute=selective");
    EXPECT_DOUBLE_EQ(layer_activation_bytes(m, core, compute_setup(m, c, core)) -
                         layer_activation_bytes(m, r, compute_setup(m, c, r)),
                     dropped)
        << modules;
  }
  EXPECT_GT(plan_bytes, 0.0);
}

// The loss's logits, kept for backward (head_activation_bytes) and worked on
// (head_working_bytes): Megatron-core's fused cross-entropy keeps the 16-bit logits and
// writes their gradient in place; unfused (Megatron-LM without --cross-entropy-loss-fusion)
// an fp32 softmax, and the 16-bit logits beside their fp32 gradient. Llama 3 8B, one
// sequence of 8192 tokens, vocabulary 128,256 (divisible by 128, unpadded), bf16:
//   kept     fused 2 x 8192 x 128256, unfused 4 x 8192 x 128256: 2,101,346,304 bytes more
//   working  fused 2 x 8192 x 128256, unfused (2 + 4) x 8192 x 128256: 4,202,692,608 more
TEST(Memory, FusedAndUnfusedCrossEntropy) {
  const ModelSpec m = load_model("llama3-8b");
  const Cluster c = load_cluster("dgx-h100-80g");
  const Plan fused = load_plan("dp=8,mbs=1,gbs=8");
  const Plan unfused = load_plan("dp=8,mbs=1,gbs=8,cross_entropy_loss_fusion=0");
  const ComputeSetup fs = compute_setup(m, c, fused), us = compute_setup(m, c, unfused);
  EXPECT_TRUE(fs.stack.cross_entropy_fusion);  // the modern stack's default
  EXPECT_FALSE(us.stack.cross_entropy_fusion);
  EXPECT_DOUBLE_EQ(head_activation_bytes(m, unfused, us) - head_activation_bytes(m, fused, fs), 2101346304.0);
  EXPECT_DOUBLE_EQ(head_working_bytes(m, unfused, us) - head_working_bytes(m, fused, fs), 4202692608.0);
  // and the step is slower: the unfused loss's e + 36 and 20 + e bytes a logit against 3e and 2e.
  EXPECT_GT(estimate(m, c, unfused).step_time_s, estimate(m, c, fused).step_time_s);
}

// torchtitan's op-level selective recompute (selective_ac_option op), Llama 3 8B (H 4096, 32
// heads of 128, 8 key/value groups: v 1024 wide, SwiGLU F 14336), one sequence of 8192
// tokens, bf16. A layer keeps its input, q, v, the attention's output O (each mm's output in
// 16 bits), the gate and down outputs, and O's fp32 log-sum-exp:
//   2 x 8192 x (4096 + 4096 + 1024 + 4096 + 14336 + 4096) + 4 x 32 x 8192
//   = 520,093,696 + 1,048,576 = 521,142,272 bytes (Megatron's selective keeps more: the
//   norms' inputs and outputs, k, and the whole MLP's fc1 output and fc2 input)
// With tp 2 and sequence parallelism (Tn 4096; q, O 2048 wide, v 512, gate 7168; down,
// before its reduce-scatter, all 8192 x 4096; the two reduce-scatters' outputs 4096 x 4096):
//   2 x (3 x 4096 x 4096 + 2 x 8192 x 2048 + 8192 x 512 + 8192 x 7168 + 8192 x 4096)
//   + 4 x 16 x 8192 = 360,710,144 + 524,288 = 361,234,432 bytes.
// With context parallelism 2 (4096 tokens a rank, keys over the whole sequence):
//   2 x 4096 x 31744 + 4 x 32 x 4096 = 260,046,848 + 524,288 = 260,571,136 bytes.
// Before a layer's backward it rebuilds, beside the MLP's working set: the two norms'
// outputs and the residual between the blocks (3 x 8192 x 4096), the roped q (8192 x
// 4096), k and v repeated to the 32 query heads (torchtitan's repeat_kv: 2 x 8192 x 4096;
// the raw k is not held), the up output, silu's and the product (3 x 8192 x 14336):
//   2 x 8192 x (12288 + 4096 + 8192 + 43008) = 1,107,296,256 bytes;
// with tp 2 and sequence parallelism (the norms' outputs also gathered, 2 x 8192 x 4096;
// q and the repeated k, v 2048 wide; the MLP's 7168):
//   2 x (3 x 4096 x 4096 + 2 x 8192 x 4096 + 3 x 8192 x 2048 + 3 x 8192 x 7168)
//   = 2 x 343,932,928 = 687,865,856 bytes.
TEST(Memory, TorchtitanOpSelectiveRecompute) {
  const ModelSpec m = load_model("llama3-8b");
  const Cluster c = load_cluster("dgx-h100-80g");
  ASSERT_EQ(m.S, 8192);
  auto per_layer = [&](const char* plan) {
    const Plan p = load_plan(plan);
    return layer_activation_bytes(m, p, compute_setup(m, c, p));
  };
  EXPECT_DOUBLE_EQ(per_layer("dp=8,mbs=1,gbs=8,selective_ac_option=op"), 521142272.0);
  EXPECT_DOUBLE_EQ(per_layer("tp=2,sp=1,dp=4,mbs=1,gbs=4,selective_ac_option=op"), 361234432.0);
  EXPECT_DOUBLE_EQ(per_layer("cp=2,dp=4,mbs=1,gbs=4,selective_ac_option=op"), 260571136.0);
  EXPECT_LT(per_layer("dp=8,mbs=1,gbs=8,selective_ac_option=op"), per_layer("dp=8,mbs=1,gbs=8,recompute=selective"));
  // fp8 keeps the same: the mm outputs are 16-bit either way (the float8 rows of
  // TorchtitanHopperRuns measured what the bf16 ones did).
  EXPECT_DOUBLE_EQ(per_layer("dp=8,mbs=1,gbs=8,selective_ac_option=op,precision=fp8"), 521142272.0);
  // Stage 0 of 2 (pp 2: 16 layers, the embedding, 2 micro-batches in flight): the layers'
  // kept bytes, the embedding's, and the working set with the rebuilt layer in it (the
  // working set without it as the plan without recompute has it).
  auto rebuilt = [&](const std::string& shape) {
    const Plan op = load_plan(shape + ",selective_ac_option=op");
    const Plan none = load_plan(shape);
    const ComputeSetup cs = compute_setup(m, c, op), ncs = compute_setup(m, c, none);
    const StageLayout lay = make_layout(m.L, 2, 1);
    const MemoryBreakdown a = stage_memory(m, c, op, lay, cs, 0, 2, 2, 0);
    const MemoryBreakdown b = stage_memory(m, c, none, lay, ncs, 0, 2, 2, 0);
    const double e = embedding_activation_bytes(m, op, cs);
    const double working_none = b.activations - 2 * 16 * layer_activation_bytes(m, none, ncs) - 2 * e;
    return a.activations - 2 * 16 * layer_activation_bytes(m, op, cs) - 2 * e - working_none;
  };
  EXPECT_DOUBLE_EQ(rebuilt("pp=2,dp=4,mbs=1,gbs=8"), 1107296256.0);
  EXPECT_DOUBLE_EQ(rebuilt("tp=2,sp=1,pp=2,dp=2,mbs=1,gbs=4"), 687865856.0);
}

// The framework's reserve: 1e9 bytes (round_cluster) plus the allocator's fractions, here
// 0.5 of the churn (the backward's working set, what recomputed layers keep, a legacy
// stack's autograd gradients) and 0.1 of the saved tensors (the rest of the activations).
// tiny-gpt (L 4, H 256, F 1024, GELU, S 128) on 2 stages, micro-batch 1, stage 0 with its 2
// layers and the embedding and 2 micro-batches in flight (1F1B, p - s). Its working set is
// the MLP's backward: the gradients of fc1's output and of the activation's, and two of
// width H, in bf16: 2 x 128 x (1024 + 1024 + 2 x 256) = 655,360 bytes. So, with a the
// activations, l and L a layer's kept bytes with and without recompute, e the embedding's:
//   no recompute            1e9 + 0.5 x 655,360 + 0.1 x (a - 655,360)  (+ 0.5 x gradients, legacy)
//   full, 1 layer a chunk   1e9 + 0.5 x (655,360 + 2 l) + 0.1 x (a - 655,360 - 2 l)
//   full, both layers       1e9 + 0.5 x (655,360 + L + 4 l) + 0.1 x 2e   (the layer rebuilt
//                           for its backward joins the working set)
TEST(Memory, FrameworkOverheadAndPeak) {
  const ModelSpec m = load_model("tiny-gpt");
  ASSERT_EQ(m.L, 4);
  ASSERT_EQ(m.H, 256);
  ASSERT_EQ(m.F, 1024);
  Cluster c = testing::round_cluster();
  c.allocator_fragmentation = 0.5;
  c.allocator_fragmentation_saved = 0.1;
  const double working = 655360.0;
  auto stage0 = [&](const Cluster& cl, const char* plan) {
    const Plan p = load_plan(plan);
    return stage_memory(m, cl, p, make_layout(m.L, 2, 1), compute_setup(m, cl, p), 0, 2, 2, 0);
  };
  const MemoryBreakdown mb = stage0(c, "pp=2,mbs=1,gbs=4");
  EXPECT_DOUBLE_EQ(mb.framework_overhead, 1e9 + 0.5 * working + 0.1 * (mb.activations - working) +
                                              0.5 * mb.gradients);  // legacy stack
  EXPECT_DOUBLE_EQ(mb.peak, mb.weights + mb.gradients + mb.optimizer_states + mb.activations + mb.comm_buffers +
                                mb.framework_overhead);
  Cluster modern = c;
  modern.modern_stack = true;
  const MemoryBreakdown none = stage0(modern, "pp=2,mbs=1,gbs=4");
  EXPECT_DOUBLE_EQ(none.framework_overhead, 1e9 + 0.5 * working + 0.1 * (none.activations - working));
  const Plan one_plan = load_plan("pp=2,mbs=1,gbs=4,recompute=full,recompute_num_layers=1");
  const ComputeSetup cs = compute_setup(m, modern, one_plan);
  const double l = layer_activation_bytes(m, one_plan, cs), L = layer_full_activation_bytes(m, one_plan, cs);
  const double e = embedding_activation_bytes(m, one_plan, cs);
  ASSERT_GT(L, 4 * l);
  const MemoryBreakdown one = stage0(modern, "pp=2,mbs=1,gbs=4,recompute=full,recompute_num_layers=1");
  EXPECT_DOUBLE_EQ(one.activations, 2 * (l + L) + 2 * e + working);
  EXPECT_DOUBLE_EQ(one.framework_overhead, 1e9 + 0.5 * (working + 2 * l) + 0.1 * (one.activations - working - 2 * l));
  const MemoryBreakdown both = stage0(modern, "pp=2,mbs=1,gbs=4,recompute=full");
  EXPECT_DOUBLE_EQ(both.activations, 4 * l + 2 * e + working + L);
  EXPECT_DOUBLE_EQ(both.framework_overhead, 1e9 + 0.5 * (working + L + 4 * l) + 0.1 * 2 * e);
  EXPECT_LT(both.activations, one.activations);
  EXPECT_LT(one.activations, none.activations);
}

// A cluster file without allocator_fragmentation_saved keeps one fraction for both, as
// before the split; the presets give their own; a value outside [0, 10] or not a number is
// refused, naming the field.
TEST(Memory, SavedFragmentationDefaultsToTheOther) {
  Json j = cluster_to_json(load_cluster("dgx-a100-80g"));
  EXPECT_DOUBLE_EQ(j["framework"]["allocator_fragmentation_saved"].get<double>(), 0.05);
  for (const Json& bad : {Json(-0.1), Json(11.0), Json("abc"), Json(true)}) {
    Json b = j;
    b["framework"]["allocator_fragmentation_saved"] = bad;
    try {
      cluster_from_json(b, "test");
      ADD_FAILURE() << "accepted allocator_fragmentation_saved " << bad.dump();
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("allocator_fragmentation_saved"), std::string::npos) << e.what();
    }
  }
  j["framework"].erase("allocator_fragmentation_saved");
  const Cluster c = cluster_from_json(j, "test");
  EXPECT_DOUBLE_EQ(c.allocator_fragmentation_saved, c.allocator_fragmentation);
  EXPECT_DOUBLE_EQ(c.allocator_fragmentation, 0.15);
}

}  // namespace
}  // namespace strata
