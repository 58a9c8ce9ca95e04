// Plan: inline and JSON forms, short and long keys, normalisation, and every rule of
// check_plan with the reason key it reports.
#include <algorithm>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <tuple>

#include "costmodel/estimate.h"
#include "costmodel/layout.h"
#include "costmodel/plan.h"
#include "costmodel/stack.h"

namespace strata {
namespace {

// load_plan's error message for s, or "no error".
std::string message(const std::string& s) {
  try {
    load_plan(s);
  } catch (const InputError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Plan, InlinePairsWithShortKeys) {
  const Plan p = load_plan("tp=8,pp=8,dp=16,mbs=1,vp=3,zero=1,recompute=selective,sp=1,gbs=512");
  EXPECT_EQ(p.t, 8);
  EXPECT_EQ(p.p, 8);
  EXPECT_EQ(p.d, 16);
  EXPECT_EQ(p.v, 3);
  EXPECT_EQ(p.zero, 1);
  EXPECT_EQ(p.recompute, Recompute::selective);
  EXPECT_TRUE(p.sp);
  EXPECT_EQ(p.world_size(), 1024);
  EXPECT_EQ(p.microbatches(), 32);  // 512 / (1 * 16)
  EXPECT_EQ(p.schedule(), ScheduleKind::interleaved);
}

TEST(Plan, JsonLongKeysAndDefaults) {
  const Plan p = plan_from_json(Json::parse(R"({"tensor_parallel":2,"data_parallel":4,"micro_batch_size":2})"), "plan");
  EXPECT_EQ(p.gbs, 8);  // one micro-batch per data-parallel rank
  EXPECT_EQ(p.precision, Precision::bf16);
  EXPECT_EQ(p.schedule(), ScheduleKind::one_f_one_b);
  EXPECT_FALSE(p.sp);
  const Plan g = load_plan("pp=4,schedule=gpipe");
  EXPECT_EQ(g.schedule(), ScheduleKind::gpipe);
}

TEST(Plan, SequenceParallelIsDroppedWithoutTensorParallel) { EXPECT_FALSE(load_plan("tp=1,sp=1").sp); }

TEST(Plan, RoundTripThroughJsonAndInline) {
  const Plan p =
      load_plan("tp=4,pp=2,dp=2,cp=2,vp=2,mbs=2,gbs=64,zero=2,recompute=full,sp=1,precision=fp16,software_stack=legacy");
  const Plan q = plan_from_json(plan_to_json(p), "plan");
  const Plan r = load_plan(plan_to_inline(p));
  for (const Plan* x : {&q, &r}) {
    EXPECT_EQ(x->t, 4);
    EXPECT_EQ(x->c, 2);
    EXPECT_EQ(x->v, 2);
    EXPECT_EQ(x->gbs, 64);
    EXPECT_EQ(x->zero, 2);
    EXPECT_EQ(x->precision, Precision::fp16);
    EXPECT_TRUE(x->sp);
    EXPECT_EQ(x->software_stack, StackChoice::legacy);
  }
  EXPECT_EQ(plan_to_json(load_plan("tp=2"))["software_stack"], "auto");
}

TEST(Plan, MalformedInputThrowsNamingTheField) {
  EXPECT_NE(message("tp=0").find("tensor_parallel"), std::string::npos);
  EXPECT_NE(message("tp=-2").find("tensor_parallel"), std::string::npos);
  EXPECT_NE(message("tp=two").find("tensor_parallel"), std::string::npos);
  EXPECT_NE(message("tq=2").find("tq"), std::string::npos);
  EXPECT_NE(message("tp=2,tensor_parallel=2").find("twice"), std::string::npos);
  EXPECT_NE(message("zero=4").find("zero_stage"), std::string::npos);
  EXPECT_NE(message("recompute=some").find("recompute"), std::string::npos);
  EXPECT_NE(message("tp=1024,pp=1024,dp=1024").find("GPUs"), std::string::npos);
  EXPECT_NE(message("schedule=gpipe,vp=2,pp=2").find("pipeline_schedule"), std::string::npos);
}

// Megatron-LM's argument names (a launch script's flags, snake_case) and DeepSpeed's config
// keys read as this schema's fields.
TEST(Plan, MegatronAndDeepSpeedNames) {
  const Plan m = plan_from_json(Json::parse(R"({"tensor_model_parallel_size":8,"pipeline_model_parallel_size":4,
      "context_parallel_size":2,"data_parallel_size":2,"virtual_pipeline_model_parallel_size":3,"micro_batch_size":1,
      "global_batch_size":64,"use_distributed_optimizer":true,"recompute_granularity":"selective",
      "sequence_parallel":true,"bf16":true,"fp8_format":"hybrid","use_flash_attn":true})"), "plan");
  const Plan c = load_plan("tp=8,pp=4,cp=2,dp=2,vp=3,mbs=1,gbs=64,zero=1,recompute=selective,sp=1,precision=fp8,"
                           "attention=flash");
  EXPECT_EQ(plan_to_json(m), plan_to_json(c));
  // DeepSpeed: its batch keys, the ZeRO section's stage, {"enabled": ...} precision sections.
  const Plan d = plan_from_json(Json::parse(R"({"train_micro_batch_size_per_gpu":2,"train_batch_size":128,
      "data_parallel_size":16,"zero_optimization":{"stage":3,"overlap_comm":true,"reduce_bucket_size":5e8},
      "bf16":{"enabled":true}})"), "plan");
  EXPECT_EQ(plan_to_json(d), plan_to_json(load_plan("dp=16,mbs=2,gbs=128,zero=3,precision=bf16")));
  // Neither --bf16 nor --fp16: Megatron trains in fp32. FSDP2 is ZeRO-3.
  EXPECT_EQ(plan_from_json(Json::parse(R"({"bf16":false,"fp16":false})"), "plan").precision, Precision::fp32);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"fp16":{"enabled":true,"loss_scale":0}})"), "plan").precision,
            Precision::fp16);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"use_torch_fsdp2":true,"dp":8})"), "plan").zero, 3);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"use_distributed_optimizer":false})"), "plan").zero, 0);
  // Full recompute: uniform recomputes every layer whatever recompute_num_layers says; block
  // the first recompute_num_layers of each chunk (this schema's reading of the number).
  const Plan u = plan_from_json(Json::parse(R"({"recompute_granularity":"full","recompute_method":"uniform",
      "recompute_num_layers":1})"), "plan");
  EXPECT_EQ(u.recompute, Recompute::full);
  EXPECT_EQ(u.recompute_layers, 0);
  const Plan b = plan_from_json(Json::parse(R"({"recompute_granularity":"full","recompute_method":"block",
      "recompute_num_layers":3})"), "plan");
  EXPECT_EQ(b.recompute_layers, 3);
  // Values in any case: Megatron's "RMSNorm", a config's "BF16".
  const Plan cased = load_plan("precision=BF16,recompute=Full,schedule=GPipe,pp=2");
  EXPECT_EQ(cased.precision, Precision::bf16);
  EXPECT_EQ(cased.recompute, Recompute::full);
  EXPECT_TRUE(cased.gpipe);
}

// plan_from_json's error message for a JSON text, or "no error".
std::string json_message(const char* json) {
  try {
    plan_from_json(Json::parse(json), "plan");
  } catch (const InputError& e) {
    return e.what();
  }
  return "no error";
}

// plan_from_json refuses `json` with a message naming `field` and saying `words`.
void expect_refused(const char* json, const char* field, const char* words) {
  const std::string msg = json_message(json);
  EXPECT_NE(msg.find(field), std::string::npos) << json << ": " << msg;
  EXPECT_NE(msg.find(words), std::string::npos) << json << ": " << msg;
}

TEST(Plan, AFieldUnderTwoNamesIsRefused) {
  const auto message = json_message;
  // Two names with two values; the same value under both (a config dump's habit) is one.
  for (const char* twice : {R"({"tensor_parallel":8,"tensor_model_parallel_size":4})",
                            R"({"zero_stage":0,"use_distributed_optimizer":true})",
                            R"({"zero_stage":1,"zero_optimization":{"stage":3}})",
                            R"({"recompute":"full","recompute_granularity":"selective"})",
                            R"({"recompute_granularity":"full","recompute_activations":true})",
                            R"({"use_distributed_optimizer":true,"use_torch_fsdp2":true})",
                            R"({"micro_batch_size":1,"train_micro_batch_size_per_gpu":2})"})
    EXPECT_NE(message(twice).find("keep one"), std::string::npos) << twice << ": " << message(twice);
  EXPECT_NE(message(R"({"precision":"bf16","bf16":true})").find("given twice"), std::string::npos);
  for (const char* one : {R"({"tensor_parallel":8,"tensor_model_parallel_size":8})",
                          R"({"use_distributed_optimizer":true,"use_torch_fsdp2":false})",
                          R"({"recompute_method":null,"num_layers_per_virtual_pipeline_stage":null,"fp8":null})"})
    EXPECT_EQ(message(one), "no error") << one;
  EXPECT_EQ(plan_from_json(Json::parse(R"({"recompute_activations":true})"), "plan").recompute, Recompute::selective);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"num_virtual_stages_per_pipeline_rank":3,"pp":4,"gbs":8})"), "plan").v, 3);
  // A Hugging Face Trainer's DeepSpeed config: "auto" named under the key it was written as.
  for (const auto& [text, key] : std::vector<std::pair<const char*, const char*>>{
           {R"({"train_micro_batch_size_per_gpu":"auto","train_batch_size":64})", "plan.train_micro_batch_size_per_gpu"},
           {R"({"train_micro_batch_size_per_gpu":2,"train_batch_size":"auto"})", "plan.train_batch_size"},
           {R"({"mbs":1,"bf16":{"enabled":"auto"}})", "plan.bf16.enabled"},
           {R"({"zero_optimization":{"stage":"auto"}})", "plan.zero_optimization.stage"}}) {
    const std::string msg = message(text);
    EXPECT_EQ(msg.rfind(std::string(key) + ": \"auto\" is invalid", 0), 0u) << text << ": " << msg;
    EXPECT_NE(msg.find("write the value itself"), std::string::npos) << text << ": " << msg;
  }
  EXPECT_NE(message(R"({"bf16":true,"fp16":true})").find("plan.fp16"), std::string::npos);
  EXPECT_NE(message(R"({"fp8_format":"e5m2"})").find("plan.fp8_format"), std::string::npos);
  EXPECT_NE(message(R"({"use_distributed_optimizer":"yes"})").find("plan.use_distributed_optimizer"),
            std::string::npos);
  EXPECT_NE(message(R"({"zero_optimization":{"stage":4}})").find("plan.zero_optimization.stage"), std::string::npos);
  EXPECT_NE(message(R"({"recompute_method":"random"})").find("plan.recompute_method"), std::string::npos);
  EXPECT_NE(message(R"({"num_layers_per_virtual_pipeline_stage":2})").find("virtual_pipeline_stages"),
            std::string::npos);
  EXPECT_NE(message(R"({"tensor_model_paralel_size":2})").find("tensor_model_paralel_size"), std::string::npos);
}

std::vector<std::string> keys(const ModelSpec& m, const Plan& p) {
  const Cluster cl = load_cluster("dgx-a100-80g");
  std::vector<std::string> k;
  for (const auto& r : check_plan(m, cl, p)) {
    EXPECT_FALSE(r.message.empty());
    k.push_back(r.key);
  }
  return k;
}

TEST(Plan, CheckRulesReportTheirReasons) {
  const ModelSpec m = load_model("gpt3-175b");  // A = G = 96, L = 96, S = 2048
  EXPECT_TRUE(keys(m, load_plan("tp=8,pp=8,dp=2,gbs=16")).empty());
  EXPECT_EQ(keys(m, load_plan("tp=64")), std::vector<std::string>{"tp_heads"});
  // Fewer key/value groups than tensor-parallel ranks: replicated when t is a multiple of
  // G (not by the strata executor), refused otherwise.
  ModelSpec gqa = load_model("llama3-70b");  // A = 64, G = 8
  EXPECT_TRUE(keys(gqa, load_plan("tp=16")).empty());
  gqa.G = 16;
  EXPECT_TRUE(keys(gqa, load_plan("tp=32")).empty());
  gqa.G = 32;
  EXPECT_TRUE(keys(gqa, load_plan("tp=16")).empty());
  gqa.G = 8;
  EXPECT_TRUE(keys(gqa, load_plan("tp=64")).empty());
  gqa.A = 24;  // tp 12 divides the heads (and F = 28672); it neither divides 8 groups nor is a multiple of them
  gqa.F = 12 * 2048;
  EXPECT_EQ(keys(gqa, load_plan("tp=12")), std::vector<std::string>{"tp_heads"});
  ModelSpec tiny = load_model("tiny-llama");  // A = 8, G = 2
  EXPECT_EQ(check_plan(tiny, load_cluster("local-cpu"), load_plan("tp=4")).at(0).key, "tp_heads");
  EXPECT_TRUE(check_plan(tiny, load_cluster("dgx-a100-80g"), load_plan("tp=4")).empty());
  EXPECT_EQ(keys(m, load_plan("dp=4,mbs=3,gbs=16")), std::vector<std::string>{"batch_divisible"});
  EXPECT_EQ(keys(m, load_plan("pp=2,vp=64,gbs=2")), std::vector<std::string>{"layers_vp"});  // 128 chunks, 96 layers
  EXPECT_TRUE(keys(m, load_plan("pp=2,vp=5,gbs=2")).empty());  // 96 layers in 10 chunks: 9 or 10 each
  // Interleaved micro-batches: at least p of them; when p does not divide them they run in
  // groups of the smallest g > p that Megatron-core accepts (a last group, m mod g, empty or
  // of at least p): m = 6, p = 4 -> g = 6 (5 would leave 1); m = 10 -> g = 5; m = 9 -> g = 9
  // (5, 6, 7 and 8 leave 4, 3, 2, 1: 4 is enough, so g = 5).
  EXPECT_EQ(keys(m, load_plan("pp=4,vp=2,gbs=3")), std::vector<std::string>{"vp_microbatches"});
  EXPECT_TRUE(keys(m, load_plan("pp=4,vp=2,gbs=6")).empty());
  EXPECT_EQ(load_plan("pp=4,vp=2,gbs=6").vp_group_size(), 6);
  EXPECT_EQ(load_plan("pp=4,vp=2,gbs=10").vp_group_size(), 5);
  EXPECT_EQ(load_plan("pp=4,vp=2,gbs=9").vp_group_size(), 5);
  EXPECT_EQ(load_plan("pp=4,vp=2,gbs=8").vp_group_size(), 4);
  EXPECT_EQ(load_plan("pp=4,vp=2,gbs=8,microbatch_group_size_per_vp_stage=8").vp_group_size(), 8);
  EXPECT_EQ(keys(m, load_plan("pp=4,vp=2,gbs=8,microbatch_group_size_per_vp_stage=3")), std::vector<std::string>{"vp_group"});
  EXPECT_EQ(keys(m, load_plan("pp=4,vp=2,gbs=8,microbatch_group_size_per_vp_stage=9")), std::vector<std::string>{"vp_group"});
  EXPECT_EQ(keys(m, load_plan("pp=4,vp=2,gbs=10,microbatch_group_size_per_vp_stage=4")), std::vector<std::string>{"vp_group"});
  EXPECT_EQ(keys(m, load_plan("pp=97")), std::vector<std::string>{"layers_pp"});
  EXPECT_EQ(keys(m, load_plan("cp=3")), std::vector<std::string>{"cp_seq"});
  EXPECT_EQ(keys(m, load_plan("cp=2,attention=unfused")), std::vector<std::string>{"cp_attention"});
  // The strata executor runs context parallelism over its unfused attention too.
  EXPECT_TRUE(check_plan(m, load_cluster("local-cpu"), load_plan("cp=2,attention=unfused")).empty());
  EXPECT_EQ(keys(m, load_plan("precision=fp8")), std::vector<std::string>{"precision"});  // A100: no fp8
  // Uneven pipelines: 96 layers on 7 stages is allowed for estimates (as even as possible).
  EXPECT_TRUE(keys(m, load_plan("pp=7")).empty());
}

// Megatron-LM's uneven pipelines (layout.h). The layout of Megatron-Bridge's Llama 3 70B
// H100 FP8 recipe (TP4 PP8 VP5): virtual stage 0 holds the embedding and 2 layers, 1..34
// two each, 35 three, 36..38 two, 39 one and the loss: 2 + 68 + 3 + 6 + 1 = 80 layers in 40
// virtual stages, so vp = 40 / 8 = 5; virtual stage k is chunk k / 8 of stage k mod 8.
// grad_reduce_in_fp32 (Megatron-core's DDP and mixed-precision setting) under its names:
// Megatron-LM's --grad-reduce-in-bf16 (off) and --accumulate-allreduce-grads-in-fp32 (on; a
// false flag says nothing), DeepSpeed's data_types.grad_accum_dtype; "auto" resolves on in
// bf16, fp8 and fp32, off in fp16 (Megatron's defaults), always on the strata executor.
TEST(Plan, GradReduceInFp32) {
  const Plan off = load_plan("dp=8,grad_reduce_in_fp32=0");
  EXPECT_EQ(off.grad_reduce_in_fp32, Tristate::off);
  EXPECT_EQ(plan_to_json(off)["grad_reduce_in_fp32"], false);
  EXPECT_FALSE(plan_to_json(load_plan("dp=8")).contains("grad_reduce_in_fp32"));  // (auto: not written)
  EXPECT_EQ(load_plan(plan_to_inline(off)).grad_reduce_in_fp32, Tristate::off);
  EXPECT_EQ(plan_from_json(plan_to_json(off), "plan").grad_reduce_in_fp32, Tristate::off);
  EXPECT_EQ(load_plan("grad_reduce_in_fp32=auto").grad_reduce_in_fp32, Tristate::automatic);
  auto from = [](const char* text) { return plan_from_json(Json::parse(text), "plan").grad_reduce_in_fp32; };
  EXPECT_EQ(from(R"({"grad_reduce_in_bf16":true,"bf16":true})"), Tristate::off);
  EXPECT_EQ(from(R"({"grad_reduce_in_bf16":false,"bf16":true})"), Tristate::automatic);
  EXPECT_EQ(from(R"({"accumulate_allreduce_grads_in_fp32":true,"fp16":true})"), Tristate::on);
  EXPECT_EQ(from(R"({"data_types":{"grad_accum_dtype":"bf16"},"bf16":{"enabled":true}})"), Tristate::off);
  EXPECT_EQ(from(R"({"data_types":{"grad_accum_dtype":"fp32"}})"), Tristate::on);
  EXPECT_EQ(from(R"({"data_types":{}})"), Tristate::automatic);
  EXPECT_EQ(from(R"({"communication_data_type":"bf16"})"), Tristate::off);
  // Two names saying different things, a value of the wrong kind: named.
  EXPECT_NE(json_message(R"({"grad_reduce_in_bf16":true,"grad_reduce_in_fp32":true})").find("grad_reduce_in_bf16"),
            std::string::npos);
  EXPECT_NE(json_message(R"({"data_types":{"grad_accum_dtype":"int8"}})").find("plan.data_types.grad_accum_dtype"),
            std::string::npos);
  EXPECT_NE(json_message(R"({"communication_data_type":"fp32","data_types":{"grad_accum_dtype":"bf16"}})").find("communication_data_type"),
            std::string::npos);
  EXPECT_NE(message("grad_reduce_in_fp32=2").find("grad_reduce_in_fp32"), std::string::npos);
  // The stack's resolution and the rules.
  const ModelSpec m = load_model("llama3-8b");
  const Cluster h100 = load_cluster("dgx-h100-80g");
  EXPECT_TRUE(resolve_stack(m, h100, load_plan("dp=8")).grad_reduce_in_fp32);
  EXPECT_FALSE(resolve_stack(m, h100, load_plan("dp=8,precision=fp16")).grad_reduce_in_fp32);
  EXPECT_TRUE(resolve_stack(m, h100, load_plan("dp=8,precision=fp16,grad_reduce_in_fp32=1")).grad_reduce_in_fp32);
  EXPECT_FALSE(resolve_stack(m, h100, off).grad_reduce_in_fp32);
  EXPECT_TRUE(check_plan(m, h100, off).empty());
  EXPECT_EQ(check_plan(m, h100, load_plan("dp=8,precision=fp32,grad_reduce_in_fp32=0")).at(0).key, "grad_reduce");
  const std::vector<Reason> cpu = check_plan(load_model("tiny-llama"), load_cluster("local-cpu"), off);
  ASSERT_FALSE(cpu.empty());
  EXPECT_EQ(cpu.at(0).key, "grad_reduce");
  EXPECT_NE(cpu.at(0).message.find("strata executor"), std::string::npos);
}

// Megatron-core's fine-grained activation offloading: offload_modules (a list, or names
// joined by '+'), activation_offload_fraction, min_offloaded_tensor_size; Megatron's rules.
TEST(Plan, ActivationOffloading) {
  const Plan p = load_plan("dp=8,offload_modules=core_attn+attn_proj,activation_offload_fraction=0.5,"
                           "min_offloaded_tensor_size=4096");
  EXPECT_EQ(p.offload_modules, kOffloadCoreAttn | kOffloadAttnProj);
  EXPECT_DOUBLE_EQ(p.activation_offload_fraction, 0.5);
  EXPECT_EQ(p.min_offloaded_tensor_size, 4096);
  for (const Plan& q : {load_plan(plan_to_inline(p)), plan_from_json(plan_to_json(p), "plan")}) {
    EXPECT_EQ(q.offload_modules, p.offload_modules);
    EXPECT_DOUBLE_EQ(q.activation_offload_fraction, 0.5);
    EXPECT_EQ(q.min_offloaded_tensor_size, 4096);
  }
  EXPECT_FALSE(plan_to_json(load_plan("dp=8")).contains("offload_modules"));
  const Plan j = plan_from_json(Json::parse(R"({"fine_grained_activation_offloading":true,
      "offload_modules":["qkv_linear","expert_fc1","moe_act"],"delta_offload_bytes_across_pp_ranks":0})"), "plan");
  EXPECT_EQ(j.offload_modules, kOffloadQkvLinear | kOffloadExpertFc1 | kOffloadMoeAct);
  EXPECT_DOUBLE_EQ(j.activation_offload_fraction, 1.0);
  EXPECT_EQ(j.min_offloaded_tensor_size, int64_t{1} << 20);
  // Switched off, the list is not read (Megatron's own reading of its config).
  EXPECT_EQ(plan_from_json(Json::parse(R"({"fine_grained_activation_offloading":false,"offload_modules":["core_attn"]})"),
                           "plan").offload_modules, 0u);
  const auto refused = expect_refused;
  refused(R"({"fine_grained_activation_offloading":true})", "plan.fine_grained_activation_offloading",
          "needs offload_modules");
  refused(R"({"offload_modules":["attn_proj"]})", "plan.offload_modules", "without core_attn");
  refused(R"({"offload_modules":"fused_group_mlp+moe_act"})", "plan.offload_modules", "fused_group_mlp");
  refused(R"({"offload_modules":["fused_group_mlp"]})", "plan.offload_modules", "op fuser");
  refused(R"({"offload_modules":["gdp_qkv"]})", "plan.offload_modules", "gated delta-net");
  refused(R"({"offload_modules":["mlp"]})", "plan.offload_modules", "must be one of");
  refused(R"({"offload_modules":[]})", "plan.offload_modules", "at least one module");
  refused(R"({"offload_modules":7})", "plan.offload_modules", "list of module names");
  refused(R"({"offload_modules":["core_attn"],"activation_offload_fraction":1.5})", "plan.activation_offload_fraction",
          "");
  refused(R"({"offload_modules":["core_attn"],"min_offloaded_tensor_size":-1})", "plan.min_offloaded_tensor_size", "");
  refused(R"({"pipeline_parallel":2,"offload_modules":["core_attn"],"delta_offload_bytes_across_pp_ranks":1073741824})",
          "plan.delta_offload_bytes_across_pp_ranks", "not modelled");
  // (0, as a real too, and any value with one stage, which keeps nothing back: Megatron's reading.)
  EXPECT_EQ(json_message(R"({"pipeline_parallel":2,"offload_modules":["core_attn"],"delta_offload_bytes_across_pp_ranks":0.0})"),
            "no error");
  EXPECT_EQ(json_message(R"({"offload_modules":["core_attn"],"delta_offload_bytes_across_pp_ranks":1073741824})"), "no error");
  // The rules against a model and a cluster.
  const ModelSpec llama = load_model("llama3-8b");
  const Cluster h100 = load_cluster("dgx-h100-80g");
  EXPECT_TRUE(check_plan(llama, h100, p).empty());
  EXPECT_EQ(check_plan(llama, h100, load_plan("dp=8,recompute=full,offload_modules=core_attn")).at(0).key,
            "activation_offload");
  EXPECT_TRUE(check_plan(llama, h100, load_plan("dp=8,recompute=selective,offload_modules=core_attn")).empty());
  EXPECT_TRUE(check_plan(llama, h100, load_plan("dp=8,recompute=full,recompute_num_layers=8,offload_modules=core_attn"))
                  .empty());
  // (recompute_num_layers of at least a chunk's 32 layers recomputes every layer.)
  EXPECT_EQ(check_plan(llama, h100, load_plan("dp=8,recompute=full,recompute_num_layers=32,offload_modules=core_attn"))
                .at(0).key, "activation_offload");
  const std::vector<Reason> dense = check_plan(llama, h100, load_plan("dp=8,offload_modules=expert_fc1"));
  ASSERT_FALSE(dense.empty());
  EXPECT_EQ(dense.at(0).key, "activation_offload");
  EXPECT_NE(dense.at(0).message.find("dense"), std::string::npos);
  EXPECT_TRUE(check_plan(load_model("qwen3-30b-a3b"), h100, load_plan("dp=8,ep=8,offload_modules=expert_fc1")).empty());
  // Megatron-core's: GPT-3 on A100 runs the legacy stack unless the plan says modern; the
  // strata executor and a cluster without a host cannot offload.
  const ModelSpec g = load_model("gpt3-175b");
  const Cluster a100 = load_cluster("dgx-a100-80g");
  EXPECT_EQ(check_plan(g, a100, load_plan("tp=8,dp=8,offload_modules=core_attn")).at(0).key, "activation_offload");
  EXPECT_TRUE(check_plan(g, a100, load_plan("tp=8,dp=8,offload_modules=core_attn,software_stack=modern")).empty());
  const std::vector<Reason> cpu =
      check_plan(load_model("tiny-llama"), load_cluster("local-cpu"), load_plan("dp=2,offload_modules=core_attn"));
  ASSERT_FALSE(cpu.empty());
  EXPECT_EQ(cpu.at(0).key, "activation_offload");
  Cluster hostless = h100;
  hostless.host = Host{};
  const std::vector<Reason> none = check_plan(llama, hostless, load_plan("dp=8,offload_modules=core_attn"));
  ASSERT_FALSE(none.empty());
  EXPECT_NE(none.at(0).message.find("host"), std::string::npos);
}

// Hybrid sharding: Megatron-core's num_distributed_optimizer_instances, or the ranks of one
// shard group (torchtitan's data_parallel_shard_degree, DeepSpeed's MiCS mics_shard_size).
TEST(Plan, HybridSharding) {
  const Plan p = load_plan("tp=2,dp=16,zero=3,num_distributed_optimizer_instances=4");
  EXPECT_EQ(p.dp_instances, 4);
  EXPECT_EQ(p.shard_ranks(), 4);
  for (const Plan& q : {load_plan(plan_to_inline(p)), plan_from_json(plan_to_json(p), "plan")}) EXPECT_EQ(q.dp_instances, 4);
  EXPECT_FALSE(plan_to_json(load_plan("dp=8")).contains("num_distributed_optimizer_instances"));
  auto instances = [](const char* json) { return plan_from_json(Json::parse(json), "plan").dp_instances; };
  EXPECT_EQ(instances(R"({"data_parallel":16,"context_parallel":2,"zero_stage":3,"data_parallel_shard_size":8})"), 4);
  EXPECT_EQ(instances(R"({"data_parallel":16,"zero_stage":3,"data_parallel_replicate_degree":2,
                          "data_parallel_shard_degree":-1})"), 2);
  EXPECT_EQ(instances(R"({"data_parallel":16,"zero_stage":3,"data_parallel_shard_degree":8})"), 2);
  // torchtitan's FSDP groups are its shard degree's data-parallel ranks times the context-parallel ones.
  EXPECT_EQ(instances(R"({"data_parallel":16,"context_parallel":2,"zero_stage":3,"data_parallel_replicate_degree":2,
                          "data_parallel_shard_degree":8})"), 2);
  EXPECT_EQ(instances(R"({"data_parallel_size":32,"zero_optimization":{"stage":3,"mics_shard_size":8}})"), 4);
  EXPECT_EQ(instances(R"({"data_parallel_size":32,"zero_optimization":{"stage":3,"mics_shard_size":-1}})"), 1);
  EXPECT_EQ(instances(R"({"data_parallel_size":32,"zero_optimization":{"stage":3,"mics_shard_size":0}})"), 1);
  // (DeepSpeed reads MiCS with stage 3 only.)
  EXPECT_EQ(instances(R"({"data_parallel_size":32,"zero_optimization":{"stage":1,"mics_shard_size":8}})"), 1);
  EXPECT_NE(json_message(R"({"data_parallel":16,"data_parallel_shard_size":8,"data_parallel_shard_degree":8})").find("keep one"),
            std::string::npos);
  EXPECT_NE(json_message(R"({"data_parallel_size":32,"zero_optimization":{"stage":3,"mics_shard_size":6}})")
                .find("plan.zero_optimization.mics_shard_size"),
            std::string::npos);
  // torchtitan's shard degree is FSDP: ZeRO-3 unless the plan says.
  EXPECT_EQ(plan_from_json(Json::parse(R"({"data_parallel":16,"data_parallel_shard_degree":8})"), "plan").zero, 3);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"data_parallel_size":32,"zero_optimization":{"stage":3,"mics_shard_size":8}})"),
                           "plan").zero, 3);
  EXPECT_NE(json_message(R"({"data_parallel":16,"data_parallel_shard_size":6})").find("plan.data_parallel_shard_size"),
            std::string::npos);
  EXPECT_NE(json_message(R"({"data_parallel":16,"data_parallel_shard_size":4,"num_distributed_optimizer_instances":2})")
                .find("disagrees"),
            std::string::npos);
  EXPECT_NE(json_message(R"({"num_distributed_optimizer_instances":0})").find("plan.num_distributed_optimizer_instances"),
            std::string::npos);
  const ModelSpec llama = load_model("llama3-8b");
  const Cluster h100 = load_cluster("dgx-h100-80g");
  EXPECT_TRUE(check_plan(llama, h100, load_plan("dp=16,zero=1,num_distributed_optimizer_instances=2")).empty());
  for (const char* bad : {"dp=16,zero=1,num_distributed_optimizer_instances=3", "dp=16,zero=1,num_distributed_optimizer_instances=16",
                          "dp=16,zero=0,num_distributed_optimizer_instances=2"}) {
    const std::vector<Reason> r = check_plan(llama, h100, load_plan(bad));
    ASSERT_FALSE(r.empty()) << bad;
    EXPECT_EQ(r.at(0).key, "dp_instances") << bad;
  }
  // The experts' replicas split too: qwen3-30b-a3b with dp 8, ep 8 has one expert replica.
  EXPECT_EQ(check_plan(load_model("qwen3-30b-a3b"), h100, load_plan("dp=8,ep=8,zero=1,num_distributed_optimizer_instances=2"))
                .at(0).key, "dp_instances");
  const std::vector<Reason> cpu = check_plan(load_model("tiny-llama"), load_cluster("local-cpu"),
                                             load_plan("dp=4,zero=1,num_distributed_optimizer_instances=2"));
  ASSERT_FALSE(cpu.empty());
  EXPECT_EQ(cpu.at(0).key, "dp_instances");
}

// Megatron-core's precision-aware optimizer: its switch and the types of its tensors (this
// schema's and torch's spellings), round trips, Megatron's main_grads_dtype onto
// grad_reduce_in_fp32, and the rules (its distributed optimizer, 16-bit or fp8
// parameters, not the strata executor; a type without the switch).
TEST(Plan, PrecisionAwareOptimizer) {
  const Plan p = load_plan("dp=8,zero=1,use_precision_aware_optimizer=1,exp_avg_dtype=bf16,exp_avg_sq_dtype=fp8,"
                           "store_param_remainders=0");
  EXPECT_TRUE(p.precision_aware_optimizer);
  EXPECT_EQ(p.exp_avg_dtype, OptDtype::bf16);
  EXPECT_EQ(p.exp_avg_sq_dtype, OptDtype::fp8);
  EXPECT_EQ(p.main_params_dtype, OptDtype::fp32);
  EXPECT_FALSE(p.store_param_remainders);
  for (const Plan& q : {load_plan(plan_to_inline(p)), plan_from_json(plan_to_json(p), "plan")}) {
    EXPECT_TRUE(q.precision_aware_optimizer);
    EXPECT_EQ(q.exp_avg_dtype, OptDtype::bf16);
    EXPECT_EQ(q.exp_avg_sq_dtype, OptDtype::fp8);
    EXPECT_FALSE(q.store_param_remainders);
  }
  EXPECT_FALSE(plan_to_json(load_plan("dp=8")).contains("use_precision_aware_optimizer"));
  const Plan torch = plan_from_json(Json::parse(R"({"use_precision_aware_optimizer":true,"exp_avg_dtype":"torch.bfloat16",
      "main_params_dtype":"float16","main_grads_dtype":"bf16","use_distributed_optimizer":true})"), "plan");
  EXPECT_EQ(torch.exp_avg_dtype, OptDtype::bf16);
  EXPECT_EQ(torch.main_params_dtype, OptDtype::fp16);
  EXPECT_EQ(torch.grad_reduce_in_fp32, Tristate::off);
  // fp32, Megatron's default main_grads_dtype (in every config dump), says nothing.
  EXPECT_EQ(plan_from_json(Json::parse(R"({"main_grads_dtype":"fp32","fp16":true})"), "plan").grad_reduce_in_fp32,
            Tristate::automatic);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"main_grads_dtype":"torch.float32","grad_reduce_in_bf16":true})"), "plan")
                .grad_reduce_in_fp32,
            Tristate::off);
  EXPECT_NE(json_message(R"({"exp_avg_dtype":"bf16"})").find("needs use_precision_aware_optimizer"), std::string::npos);
  EXPECT_EQ(json_message(R"({"exp_avg_dtype":"fp32"})"), "no error");  // (the default, said)
  EXPECT_NE(json_message(R"({"use_precision_aware_optimizer":true,"main_params_dtype":"bf16"})").find(
                "plan.main_params_dtype"),
            std::string::npos);
  EXPECT_NE(json_message(R"({"use_precision_aware_optimizer":true,"exp_avg_dtype":"int4"})").find("plan.exp_avg_dtype"),
            std::string::npos);
  EXPECT_NE(json_message(R"({"main_grads_dtype":"fp16"})").find("plan.main_grads_dtype"), std::string::npos);
  const ModelSpec m = load_model("llama3-8b");
  const Cluster h100 = load_cluster("dgx-h100-80g");
  EXPECT_TRUE(check_plan(m, h100, p).empty());
  EXPECT_EQ(check_plan(m, h100, load_plan("dp=8,zero=0,use_precision_aware_optimizer=1")).at(0).key, "precision_aware");
  EXPECT_EQ(check_plan(m, h100, load_plan("dp=8,zero=3,use_precision_aware_optimizer=1")).at(0).key, "precision_aware");
  EXPECT_EQ(check_plan(m, h100, load_plan("dp=8,zero=1,precision=fp32,use_precision_aware_optimizer=1")).at(0).key,
            "precision_aware");
  // Megatron-core's: GPT-3 on A100 runs the legacy stack unless the plan says modern.
  const ModelSpec g = load_model("gpt3-175b");
  const Cluster a100 = load_cluster("dgx-a100-80g");
  EXPECT_EQ(check_plan(g, a100, load_plan("tp=8,dp=8,zero=1,use_precision_aware_optimizer=1")).at(0).key,
            "precision_aware");
  EXPECT_TRUE(check_plan(g, a100, load_plan("tp=8,dp=8,zero=1,use_precision_aware_optimizer=1,software_stack=modern"))
                  .empty());
  const std::vector<Reason> cpu =
      check_plan(load_model("tiny-llama"), load_cluster("local-cpu"), load_plan("dp=8,zero=1,use_precision_aware_optimizer=1"));
  ASSERT_FALSE(cpu.empty());
  EXPECT_EQ(cpu.at(0).key, "precision_aware");
}

// fp8_param_gather: fp8 weights of 1 byte with ZeRO (auto), bf16 weights without it or when
// off; fp8's only, and on needs ZeRO; inline and JSON round trips keep it.
TEST(Plan, Fp8ParamGather) {
  EXPECT_TRUE(load_plan("dp=8,zero=1,precision=fp8").fp8_weights());
  EXPECT_FALSE(load_plan("dp=8,zero=0,precision=fp8").fp8_weights());
  EXPECT_FALSE(load_plan("dp=8,zero=1,precision=fp8,fp8_param_gather=0").fp8_weights());
  EXPECT_FALSE(load_plan("dp=8,zero=1,precision=bf16").fp8_weights());
  const ModelSpec m = load_model("llama3-8b");
  const Cluster h100 = load_cluster("dgx-h100-80g");
  EXPECT_EQ(check_plan(m, h100, load_plan("dp=8,zero=0,precision=fp8,fp8_param_gather=1")).at(0).key, "fp8_param_gather");
  EXPECT_EQ(check_plan(m, h100, load_plan("dp=8,zero=1,precision=bf16,fp8_param_gather=0")).at(0).key, "fp8_param_gather");
  EXPECT_TRUE(check_plan(m, h100, load_plan("dp=8,zero=3,precision=fp8,fp8_param_gather=1")).empty());
  const Plan off = load_plan("dp=8,zero=1,gbs=8,precision=fp8,fp8_param_gather=0");
  EXPECT_EQ(load_plan(plan_to_inline(off)).fp8_param_gather, Tristate::off);
  EXPECT_EQ(plan_from_json(plan_to_json(off), "plan").fp8_param_gather, Tristate::off);
  const Estimate on = estimate(m, h100, load_plan("dp=8,zero=1,gbs=8,precision=fp8")), bf = estimate(m, h100, off);
  EXPECT_DOUBLE_EQ(bf.memory.weights - on.memory.weights, on.memory.params);  // 2 bytes a weight against 1
}

// Optimizer offload under its names: this schema's optimizer_offload_fraction (inline
// "offload"), Megatron-core's optimizer_cpu_offload (+ its fraction, read only with it),
// DeepSpeed's zero_optimization.offload_optimizer (device, ratio) and older cpu_offload.
TEST(Plan, OptimizerOffloadNames) {
  EXPECT_EQ(load_plan("dp=8,zero=1,offload=0.5").offload, 0.5);
  EXPECT_EQ(load_plan("dp=8,zero=1,optimizer_offload_fraction=1").offload, 1.0);
  EXPECT_EQ(load_plan("dp=8,zero=1").offload, 0.0);
  auto from = [](const char* text) { return plan_from_json(Json::parse(text), "plan").offload; };
  EXPECT_EQ(from(R"({"zero_stage":1,"optimizer_cpu_offload":true})"), 1.0);
  EXPECT_EQ(from(R"({"zero_stage":1,"optimizer_cpu_offload":true,"optimizer_offload_fraction":0.25})"), 0.25);
  EXPECT_EQ(from(R"({"zero_stage":1,"optimizer_cpu_offload":false,"optimizer_offload_fraction":1.0})"), 0.0);
  EXPECT_EQ(from(R"({"zero_optimization":{"stage":2,"offload_optimizer":{"device":"cpu","pin_memory":true}}})"), 1.0);
  EXPECT_EQ(from(R"({"zero_optimization":{"stage":3,"offload_optimizer":{"device":"cpu","ratio":0.3}}})"), 0.3);
  EXPECT_EQ(from(R"({"zero_optimization":{"stage":2,"offload_optimizer":{"device":"none"}}})"), 0.0);
  EXPECT_EQ(from(R"({"zero_optimization":{"stage":2,"cpu_offload":true}})"), 1.0);
  EXPECT_EQ(from(R"({"zero_optimization":{"stage":2,"offload_param":{"device":"none"}}})"), 0.0);
  EXPECT_EQ(from(R"({"zero_stage":1,"offload_optimizer":"cpu"})"), 1.0);
  // Round trips, and refusals naming the field.
  const Plan p = load_plan("dp=8,zero=1,offload=0.5");
  EXPECT_EQ(plan_to_json(load_plan(plan_to_inline(p))), plan_to_json(p));
  EXPECT_EQ(plan_from_json(plan_to_json(p), "plan").offload, 0.5);
  auto refused = [](const char* text, const char* field) {
    try {
      plan_from_json(Json::parse(text), "plan");
      ADD_FAILURE() << text;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refused(R"({"zero_optimization":{"stage":3,"offload_optimizer":{"device":"nvme"}}})", "offload_optimizer.device");
  refused(R"({"zero_optimization":{"stage":3,"offload_param":{"device":"cpu"}}})", "offload_param");
  refused(R"({"zero_optimization":{"stage":3,"offload_optimizer":{"device":"cpu","ratio":2}}})", "ratio");
  refused(R"({"optimizer_offload_fraction":1.5})", "optimizer_offload_fraction");
  refused(R"({"optimizer_offload_fraction":"all"})", "optimizer_offload_fraction");
  refused(R"({"offload_optimizer":"gpu"})", "offload_optimizer");
  refused(R"({"optimizer_offload_fraction":0.5,"zero_optimization":{"stage":1,"offload_optimizer":{"device":"cpu"}}})",
          "keep one");
  // The rules: a ZeRO stage, a GPU framework's stack, a cluster that describes its host.
  const ModelSpec m = load_model("llama2-7b");
  EXPECT_TRUE(keys(m, load_plan("dp=8,zero=1,offload=1")).empty());
  EXPECT_EQ(keys(m, load_plan("dp=8,offload=1")), std::vector<std::string>{"offload_zero"});
  auto key_on = [&](const Cluster& cl) {
    const auto r = check_plan(m, cl, load_plan("dp=8,zero=1,offload=1"));
    return r.empty() ? std::string() : r.front().key;
  };
  EXPECT_EQ(key_on(load_cluster("local-cpu")), "offload_host");  // the strata executor
  Cluster bare = load_cluster("dgx-a100-80g");
  bare.host = Host{};
  EXPECT_EQ(key_on(bare), "offload_host");
}

// Expert parallelism: the plan field under its names, its round trips and its rules.
TEST(Plan, ExpertParallelism) {
  EXPECT_EQ(load_plan("dp=16,ep=8").ep, 8);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"data_parallel":16,"expert_model_parallel_size":4})"), "plan").ep, 4);
  EXPECT_EQ(load_plan("dp=16").ep, 1);
  const Plan p = load_plan("tp=2,dp=8,ep=4,sp=1");
  EXPECT_EQ(p.expert_replicas(), 2);
  EXPECT_EQ(plan_to_json(load_plan(plan_to_inline(p))), plan_to_json(p));
  EXPECT_EQ(plan_from_json(plan_to_json(p), "plan").ep, 4);
  // The experts' own tensor parallelism (Megatron-core's parallel folding): etp x ep fold
  // over tensor x data x context parallel, tensor_parallel when not given.
  const Plan fold = plan_from_json(Json::parse(R"({"tensor_parallel":2,"data_parallel":16,"expert_tensor_parallel_size":1,
      "expert_model_parallel_size":32})"), "plan");
  EXPECT_EQ(fold.expert_tp(), 1);
  EXPECT_EQ(fold.expert_replicas(), 1);
  EXPECT_EQ(load_plan("tp=2,dp=8").expert_tp(), 2);
  EXPECT_EQ(plan_from_json(plan_to_json(fold), "plan").etp, 1);
  EXPECT_EQ(load_plan(plan_to_inline(fold)).etp, 1);
  EXPECT_THROW(load_plan("dp=8,ep=0"), InputError);
  // The rules.
  const ModelSpec moe = load_model("mixtral-8x7b");  // 8 experts
  EXPECT_TRUE(keys(moe, load_plan("dp=16,ep=8,zero=1")).empty());
  EXPECT_TRUE(keys(moe, load_plan("dp=4,cp=2,ep=8,zero=1")).empty());  // over data x context parallel
  EXPECT_EQ(keys(moe, load_plan("dp=12,ep=3")), std::vector<std::string>{"ep_experts"});
  EXPECT_EQ(keys(moe, load_plan("dp=4,ep=8")), std::vector<std::string>{"ep_dp"});
  EXPECT_EQ(keys(moe, load_plan("tp=2,dp=8,ep=8")), std::vector<std::string>{"moe_sp"});
  EXPECT_EQ(keys(moe, load_plan("tp=2,dp=8")), std::vector<std::string>{"moe_sp"});
  EXPECT_TRUE(keys(moe, load_plan("tp=2,dp=4,ep=8,etp=1,sp=1")).empty());  // 1 x 8 over 2 x 4
  EXPECT_EQ(keys(moe, load_plan("tp=2,dp=4,ep=8,sp=1")), std::vector<std::string>{"ep_dp"});  // 2 x 8 over 2 x 4
  EXPECT_TRUE(keys(moe, load_plan("tp=2,dp=8,ep=8,sp=1")).empty());
  EXPECT_EQ(keys(moe, load_plan("tp=3,dp=8")).front(), "tp_heads");
  EXPECT_EQ(keys(load_model("llama2-7b"), load_plan("dp=8,ep=2")), std::vector<std::string>{"ep_dense"});
  const auto on_cpu = check_plan(moe, load_cluster("local-cpu"), load_plan("dp=2,ep=2"));
  EXPECT_TRUE(std::any_of(on_cpu.begin(), on_cpu.end(), [](const Reason& r) { return r.key == "moe_strata"; }));
  ModelSpec odd = moe;
  odd.Fe = 14337;
  const auto r = check_plan(odd, load_cluster("dgx-h100-80g"), load_plan("tp=8,dp=2,sp=1"));
  ASSERT_FALSE(r.empty());
  EXPECT_EQ(r.front().key, "etp_ffn");
  EXPECT_NE(r.front().message.find("moe_ffn_hidden_size=14337"), std::string::npos) << r.front().message;
  EXPECT_TRUE(check_plan(odd, load_cluster("dgx-h100-80g"), load_plan("tp=8,dp=2,sp=1,etp=1")).empty());
}

// The MoE layers' token dispatcher (Megatron-core's moe_token_dispatcher_type, with the
// flex dispatcher's moe_flex_dispatcher_backend or the older moe_enable_deepep).
TEST(Plan, MoeTokenDispatcher) {
  EXPECT_EQ(load_plan("dp=16,ep=8").moe_dispatcher, MoeDispatcher::alltoall);
  EXPECT_EQ(load_plan("dp=16,ep=8,moe_token_dispatcher_type=alltoall").moe_dispatcher, MoeDispatcher::alltoall);
  EXPECT_EQ(load_plan("dp=16,ep=8,moe_token_dispatcher_type=flex").moe_dispatcher, MoeDispatcher::deepep);
  const Plan hy = load_plan("dp=16,ep=8,moe_token_dispatcher_type=flex,moe_flex_dispatcher_backend=hybridep");
  EXPECT_EQ(hy.moe_dispatcher, MoeDispatcher::hybridep);
  EXPECT_EQ(plan_from_json(plan_to_json(hy), "plan").moe_dispatcher, MoeDispatcher::hybridep);
  EXPECT_EQ(load_plan(plan_to_inline(hy)).moe_dispatcher, MoeDispatcher::hybridep);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"data_parallel":16,"moe_token_dispatcher_type":"flex","moe_enable_deepep":true})"),
                           "plan").moe_dispatcher, MoeDispatcher::deepep);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"data_parallel":16,"moe_token_dispatcher_type":null,
                                          "moe_flex_dispatcher_backend":null})"), "plan").moe_dispatcher,
            MoeDispatcher::alltoall);
  // Megatron-LM's default, and a backend beside a dispatcher that is not flex (Megatron
  // ignores it, as Megatron-Bridge's DeepSeek-V2 recipe ships it).
  EXPECT_EQ(load_plan("dp=16,moe_token_dispatcher_type=allgather").moe_dispatcher, MoeDispatcher::allgather);
  EXPECT_EQ(load_plan(plan_to_inline(load_plan("dp=16,moe_token_dispatcher_type=allgather"))).moe_dispatcher,
            MoeDispatcher::allgather);
  EXPECT_EQ(load_plan("dp=16,moe_token_dispatcher_type=alltoall,moe_flex_dispatcher_backend=deepep").moe_dispatcher,
            MoeDispatcher::alltoall);
  for (const char* bad : {"dp=16,moe_token_dispatcher_type=ring",
                          "dp=16,moe_token_dispatcher_type=flex,moe_flex_dispatcher_backend=nccl",
                          "dp=16,moe_enable_deepep=1",
                          "dp=16,moe_token_dispatcher_type=flex,moe_enable_deepep=1,moe_flex_dispatcher_backend=hybridep"})
    EXPECT_THROW(load_plan(bad), InputError) << bad;
  try {
    load_plan("dp=16,moe_enable_deepep=1");
    ADD_FAILURE() << "moe_enable_deepep without flex was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("needs moe_token_dispatcher_type flex"), std::string::npos) << e.what();
  }
  EXPECT_EQ(keys(load_model("llama2-7b"), load_plan("dp=8,moe_token_dispatcher_type=flex")),
            std::vector<std::string>{"moe_dispatcher"});
  EXPECT_TRUE(keys(load_model("mixtral-8x7b"), load_plan("dp=16,ep=8,moe_token_dispatcher_type=flex")).empty());
  // Megatron's flex dispatcher needs an expert-parallel (or expert-tensor-parallel) group;
  // strata's model of it takes etp 1.
  EXPECT_EQ(keys(load_model("mixtral-8x7b"), load_plan("dp=16,moe_token_dispatcher_type=flex")),
            std::vector<std::string>{"moe_dispatcher"});
  EXPECT_EQ(keys(load_model("mixtral-8x7b"), load_plan("tp=2,sp=1,dp=8,ep=8,moe_token_dispatcher_type=flex")),
            std::vector<std::string>{"moe_dispatcher"});
  EXPECT_TRUE(keys(load_model("mixtral-8x7b"), load_plan("tp=2,sp=1,dp=8,ep=8,etp=1,moe_token_dispatcher_type=flex")).empty());
  EXPECT_TRUE(keys(load_model("mixtral-8x7b"), load_plan("tp=2,sp=1,dp=8,ep=8,moe_token_dispatcher_type=allgather")).empty());
  // overlap_moe_expert_parallel_comm (or Megatron-Bridge's moe_a2a_overlap) and Megatron's
  // asserts on it; delay_wgrad_compute (costed with it: compute_test), kept by both forms.
  const ModelSpec mix = load_model("mixtral-8x7b");
  EXPECT_TRUE(load_plan("dp=16,ep=8,overlap_moe_expert_parallel_comm=1").moe_a2a_overlap);
  const Plan ov = plan_from_json(Json::parse(R"({"data_parallel":16,"expert_model_parallel_size":8,"moe_a2a_overlap":true,
                                                "delay_wgrad_compute":true})"), "plan");
  EXPECT_TRUE(ov.moe_a2a_overlap && ov.delay_wgrad);
  EXPECT_TRUE(plan_from_json(plan_to_json(ov), "plan").moe_a2a_overlap);
  EXPECT_TRUE(load_plan(plan_to_inline(ov)).moe_a2a_overlap);
  EXPECT_TRUE(plan_from_json(plan_to_json(ov), "plan").delay_wgrad);
  EXPECT_TRUE(load_plan(plan_to_inline(ov)).delay_wgrad);
  EXPECT_FALSE(load_plan("dp=16,ep=8,overlap_moe_expert_parallel_comm=1").delay_wgrad);  // (Megatron's default)
  EXPECT_THROW(load_plan("dp=16,overlap_moe_expert_parallel_comm=1,moe_a2a_overlap=1"), InputError);
  EXPECT_THROW(load_plan("dp=16,ep=8,delay_wgrad_compute=1"), InputError);  // (Megatron asserts the overlap with it)
  EXPECT_TRUE(keys(mix, ov).empty());
  EXPECT_TRUE(keys(mix, load_plan("pp=2,vp=2,dp=8,ep=8,overlap_moe_expert_parallel_comm=1")).empty());
  for (const char* bad : {"dp=16,overlap_moe_expert_parallel_comm=1", "pp=2,dp=8,ep=8,overlap_moe_expert_parallel_comm=1",
                          "dp=16,ep=8,moe_token_dispatcher_type=allgather,overlap_moe_expert_parallel_comm=1",
                          "dp=16,ep=8,recompute=full,overlap_moe_expert_parallel_comm=1",
                          "dp=16,ep=8,precision=fp32,overlap_moe_expert_parallel_comm=1"})
    EXPECT_EQ(keys(mix, load_plan(bad)), std::vector<std::string>{"a2a_overlap"}) << bad;
  EXPECT_EQ(keys(load_model("llama2-7b"), load_plan("dp=8,overlap_moe_expert_parallel_comm=1")),
            std::vector<std::string>{"a2a_overlap"});
}

// Megatron-core's --recompute-modules under selective recompute.
TEST(Plan, RecomputeModules) {
  EXPECT_EQ(load_plan("recompute=selective").recompute_modules, kRecomputeCoreAttn);
  const Plan p = load_plan("recompute_modules=layernorm+moe_act");  // implies selective
  EXPECT_EQ(p.recompute, Recompute::selective);
  EXPECT_EQ(p.recompute_modules, kRecomputeLayernorm | kRecomputeMoeAct);
  EXPECT_FALSE(p.recomputes(kRecomputeCoreAttn));
  EXPECT_TRUE(p.recomputes(kRecomputeMoeAct));
  EXPECT_FALSE(load_plan("recompute=full").recomputes(kRecomputeCoreAttn));
  const Plan q = plan_from_json(Json::parse(R"({"recompute_granularity":"selective",
      "recompute_modules":["core_attn","layernorm"]})"), "plan");
  EXPECT_EQ(q.recompute_modules, kRecomputeCoreAttn | kRecomputeLayernorm);
  EXPECT_EQ(plan_from_json(plan_to_json(q), "plan").recompute_modules, q.recompute_modules);
  EXPECT_EQ(load_plan(plan_to_inline(q)).recompute_modules, q.recompute_modules);
  EXPECT_EQ(plan_from_json(Json::parse(R"({"recompute_modules":"core_attn moe_act"})"), "plan").recompute_modules,
            kRecomputeCoreAttn | kRecomputeMoeAct);
  auto refused = [](const char* text, const char* what) { expect_refused(text, "plan.recompute_modules", what); };
  refused(R"({"recompute_modules":["moe"]})", "not modelled");
  refused(R"({"recompute_modules":["shared_experts"]})", "not modelled");
  refused(R"({"recompute_modules":["attention"]})", "must be one of");
  refused(R"({"recompute":"full","recompute_modules":["layernorm"]})", "needs recompute selective");
  refused(R"({"recompute_modules":3})", "list of module names");
  refused(R"({"recompute_modules":[]})", "at least one module");
  // moe_act on a dense model is a rule of the plan against the model.
  EXPECT_EQ(keys(load_model("llama2-7b"), load_plan("dp=8,recompute_modules=moe_act")), std::vector<std::string>{"moe_act"});
  // mla_up_proj needs multi-latent attention; mlp on a model of MoE layers only does
  // nothing, as in Megatron-core (it recomputes dense layers' MLPs).
  EXPECT_EQ(keys(load_model("llama2-7b"), load_plan("dp=8,recompute_modules=mla_up_proj")),
            std::vector<std::string>{"mla_up_proj"});
  EXPECT_TRUE(keys(load_model("mixtral-8x7b"), load_plan("dp=8,ep=8,recompute_modules=mlp")).empty());
  EXPECT_TRUE(keys(load_model("deepseek-v3"), load_plan("dp=64,ep=64,recompute_modules=mla_up_proj+mlp")).empty());
  EXPECT_EQ(load_plan("recompute_modules=mla_up_proj+mlp").recompute_modules, kRecomputeMlaUpProj | kRecomputeMlp);
}

// torchtitan's [activation_checkpoint] selective_ac_option "op": its op-level policy as the
// selective recompute, in place of Megatron's modules; written back as it was read.
TEST(Plan, TorchtitanSelectiveAcOption) {
  const Plan p = load_plan("dp=8,selective_ac_option=op");  // implies selective, as torchtitan's mode
  EXPECT_EQ(p.recompute, Recompute::selective);
  EXPECT_TRUE(p.op_sac());
  EXPECT_FALSE(p.recomputes(kRecomputeCoreAttn));  // the op policy, not the modules
  EXPECT_FALSE(p.without_recompute().op_sac());
  EXPECT_TRUE(plan_from_json(plan_to_json(p), "plan").op_sac());
  EXPECT_TRUE(load_plan(plan_to_inline(p)).op_sac());
  EXPECT_NE(plan_to_inline(p).find("selective_ac_option=op"), std::string::npos);
  EXPECT_FALSE(load_plan("dp=8,recompute=selective").op_sac());
  auto refused = [](const char* text, const char* what) { expect_refused(text, "plan.selective_ac_option", what); };
  refused(R"({"selective_ac_option":"2"})", "recompute_num_layers");
  refused(R"({"selective_ac_option":2})", "recompute_num_layers");
  refused(R"({"selective_ac_option":"ops"})", "must be \"op\"");
  refused(R"({"selective_ac_option":true})", "must be \"op\"");
  refused(R"({"recompute":"full","selective_ac_option":"op"})", "needs recompute selective");
  refused(R"({"recompute":"none","selective_ac_option":"op"})", "needs recompute selective");
  refused(R"({"selective_ac_option":"op","recompute_modules":["layernorm"]})", "recompute_modules");
  // What the policy cannot be costed on is a rule of the plan against the model.
  const std::vector<std::string> sac{"selective_ac_option"};
  EXPECT_TRUE(keys(load_model("llama3-8b"), load_plan("dp=8,selective_ac_option=op")).empty());
  EXPECT_EQ(keys(load_model("gpt3-175b"), load_plan("dp=8,selective_ac_option=op,attention=flash")), sac);  // biases
  EXPECT_EQ(keys(load_model("mixtral-8x7b"), load_plan("dp=8,ep=8,selective_ac_option=op")), sac);
  EXPECT_EQ(keys(load_model("deepseek-v3"), load_plan("dp=64,ep=64,selective_ac_option=op")), sac);
  EXPECT_EQ(keys(load_model("llama3-8b"), load_plan("dp=8,selective_ac_option=op,attention=unfused")), sac);
  EXPECT_EQ(keys(load_model("llama3-8b"), load_plan("tp=2,dp=4,selective_ac_option=op")), sac);  // TP without SP
  EXPECT_TRUE(keys(load_model("llama3-8b"), load_plan("tp=2,sp=1,dp=4,selective_ac_option=op")).empty());
}

TEST(Plan, PipelineLayoutStrings) {
  const Plan p = load_plan("tp=4,pp=8,mbs=1,gbs=256,pipeline_model_parallel_layout=Et*2|(t*2|)*34,t*3|(t*2|)*3,tL");
  ASSERT_TRUE(p.layout);
  EXPECT_EQ(p.v, 5);
  EXPECT_EQ(p.schedule(), ScheduleKind::interleaved);
  EXPECT_EQ(p.layout->text, "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL");  // the pair's commas kept
  std::vector<int64_t> want(40, 2);
  want[35] = 3;
  want[39] = 1;
  EXPECT_EQ(p.layout->layers, want);
  const StageLayout lay = make_layout(80, p);
  EXPECT_EQ(lay.chunk_layers(3, 4), 3);  // virtual stage 35 = 4 * 8 + 3
  EXPECT_EQ(lay.chunk_layers(7, 4), 1);
  EXPECT_EQ(lay.stage_layers(3), 11);
  EXPECT_EQ(lay.stage_layers(7), 9);
  // Megatron-core's docs example: "Et*3|(tt|)*29,m|L" (with an MTP layer, which strata refuses);
  // empty virtual stages and repeated separators.
  EXPECT_EQ(parse_pipeline_layout("E|t*3|(tt|)*2,L", "f").layers, (std::vector<int64_t>{0, 3, 2, 2, 0}));
  EXPECT_EQ(parse_pipeline_layout("Ettt|L", "f").layers, (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(parse_pipeline_layout("E,t*10,L", "f").layers, (std::vector<int64_t>{10}));
  // Commas are dropped before anything else, as Megatron-core does: even inside a count.
  EXPECT_EQ(parse_pipeline_layout("Et*1,0|tL", "f").layers, (std::vector<int64_t>{10, 1}));
  // In inline pairs the layout is text (a digit is no number) and its commas, a trailing or
  // doubled one too, stay its own.
  EXPECT_EQ(load_plan("pp=2,pipeline_model_parallel_layout=Et,,t|t,tL,").layout->layers, (std::vector<int64_t>{2, 2}));
  // The same plan as JSON, and back through both forms.
  const Plan j = plan_from_json(Json::parse(R"({"pipeline_model_parallel_size":8,"tensor_parallel":4,
      "pipeline_model_parallel_layout":"Et*2|(t*2|)*34,t*3|(t*2|)*3,tL","global_batch_size":256})"), "plan");
  EXPECT_EQ(j.layout->layers, want);
  for (const Plan& q : {plan_from_json(plan_to_json(p), "plan"), load_plan(plan_to_inline(p))}) {
    ASSERT_TRUE(q.layout);
    EXPECT_EQ(q.layout->layers, want);
    EXPECT_EQ(q.v, 5);
  }
  // Layers of the first and last stage (Megatron-core's num_layers_in_first/last_pipeline_stage
  // are the same fields): 126 layers on 16 stages with 7 on each end leave 112 = 14 x 8.
  const Plan e = load_plan("pp=16,decoder_first_pipeline_num_layers=7,decoder_last_pipeline_num_layers=7");
  const StageLayout el = make_layout(126, e);
  EXPECT_EQ(el.chunk_layers(0, 0), 7);
  EXPECT_EQ(el.chunk_layers(1, 0), 8);
  EXPECT_EQ(el.chunk_layers(15, 0), 7);
  const Plan f = plan_from_json(Json::parse(R"({"pipeline_parallel":4,"virtual_pipeline_stages":2,
      "num_layers_in_first_pipeline_stage":4,"num_layers_in_last_pipeline_stage":2})"), "plan");
  EXPECT_EQ(std::tie(f.first_stage_layers, f.last_stage_layers), std::make_tuple(int64_t{4}, int64_t{2}));
  const StageLayout fl = make_layout(18, f);  // 4, then (18 - 6) / 2 = 6 on each middle stage, 2: halves per chunk
  EXPECT_EQ(fl.layers, (std::vector<int64_t>{2, 3, 3, 1, 2, 3, 3, 1}));
  for (const Plan& q : {plan_from_json(plan_to_json(f), "plan"), load_plan(plan_to_inline(f))})
    EXPECT_EQ(std::tie(q.first_stage_layers, q.last_stage_layers, q.v), std::tie(f.first_stage_layers, f.last_stage_layers, f.v));
}

// Multi-token prediction layers in a layout ('m', Megatron-core's LayerType.mtp): counted,
// and as many as the model's mtp_num_layers (Megatron-core asserts it), or the rule
// uneven_split; DeepSeek-V3 (one module) with Megatron-Bridge's layout for pp 8 vp 4.
TEST(Plan, MultiTokenPredictionInTheLayout) {
  const ModelSpec ds = load_model("deepseek-v3");
  ASSERT_EQ(ds.mtp_layers, 1);
  const std::string base = "tp=2,pp=8,vp=4,dp=64,ep=64,etp=1,mbs=1,gbs=8192,sp=1,zero=1,pipeline_model_parallel_layout=";
  const Plan p = load_plan(base + "Et|(tt|)*30mL");
  ASSERT_TRUE(p.layout);
  EXPECT_EQ(p.layout->mtp, 1);
  EXPECT_EQ(load_plan(base + "Et|(tt|)*30,m*2L").layout->mtp, 2);
  EXPECT_TRUE(keys(ds, p).empty());
  EXPECT_EQ(keys(ds, load_plan(base + "Et|(tt|)*30L")), std::vector<std::string>{"uneven_split"});
  EXPECT_EQ(keys(ds, load_plan(base + "Et|(tt|)*30,m*2L")), std::vector<std::string>{"uneven_split"});
  ModelSpec none = ds;
  none.mtp_layers = 0;
  EXPECT_EQ(keys(none, p), std::vector<std::string>{"uneven_split"});
  EXPECT_TRUE(keys(none, load_plan(base + "Et|(tt|)*30L")).empty());
  // The message says what to write.
  const auto r = check_plan(ds, load_cluster("dgx-h100-80g"), load_plan(base + "Et|(tt|)*30L"));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NE(r[0].message.find("holds 0 multi-token prediction layers ('m'), not the model's mtp_num_layers=1: end the "
                              "layout with \"mL\""),
            std::string::npos)
      << r[0].message;
}

TEST(Plan, UnevenSplitsThatCannotHoldTheModel) {
  const std::string lay = "pp=2,pipeline_model_parallel_layout=";
  for (const auto& [text, rule] : std::vector<std::pair<std::string, std::string>>{
           {"Et|tt|tt|tL", "no error"},
           {"Ett|t|tL", "not a multiple of pipeline_parallel=2"},
           {"tE|tt|tt|tL", "must begin with the embedding"},
           {"Et|tt|tL|tt", "must end with the loss"},
           {"Et|tE|tt|tL", "exactly once"},
           {"Et|tt|tt|tmL", "no error"},
           {"Et|tt|tt|mtL", "places a decoder layer 't' after a multi-token prediction layer 'm'"},
           {"Et|tt|tm|L", "in a virtual stage before the loss 'L'"},
           {"Et|tx|tt|tL", "has 'x' after 'Et|t'"},
           {"Et|((tt|)*2)*1tL", "nests parentheses"},
           {"Et|(tt|)tL", "needs \"*n\" after 'Et|(tt|)'"},
           {"Et|tt)*2|tL", "not opened"},
           {"Et|(tt|*2|tL", "open"},
           {"Et*|tt|tt|tL", "needs a count after 'Et*'"},
           {"Et|()*3|tt|tL", "empty group"},
           {"|Et|tt|tL", "the first virtual stage holds it"},
           {"Et|tt|tL|", "the last virtual stage holds it"},
           {"1,2", "has '1' after ''"},
           {"Et*99999999|tL", "repeats more than"},
           {"(t*9999|)*9999,EL", "unrolls to more than"}}) {
    const std::string m = message(lay + text);
    EXPECT_NE(m.find(rule), std::string::npos) << text << ": " << m;
    if (rule != "no error") {
      EXPECT_NE(m.find("plan.pipeline_model_parallel_layout"), std::string::npos) << m;
    }
  }
  EXPECT_NE(message("pp=2,vp=3,pipeline_model_parallel_layout=Et|tt|tt|tL").find("not pipeline_parallel * "
                                                                               "virtual_pipeline_stages = 2 x 3"),
            std::string::npos);
  try {
    plan_from_json(Json::parse(R"({"pipeline_parallel":2,"pipeline_model_parallel_layout":3})"), "plan");
    ADD_FAILURE() << "a number taken as a layout";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("must be a layout string"), std::string::npos) << e.what();
  }
  EXPECT_NE(message("pp=2,pipeline_model_parallel_layout=3").find("has '3' after ''"), std::string::npos);
  EXPECT_NE(message("pp=2,decoder_first_pipeline_num_layers=0").find("decoder_first_pipeline_num_layers"),
            std::string::npos);
  EXPECT_NE(message("pp=2,decoder_last_pipeline_num_layers=2,pipeline_model_parallel_layout=Et|tL").find("cannot be combined"),
            std::string::npos);
  // Against the model (check_plan's "uneven_split"): gpt3-175b has 96 layers.
  const ModelSpec m = load_model("gpt3-175b");
  const Cluster cl = load_cluster("dgx-a100-80g");
  auto key_of = [&](const std::string& s) {
    const auto r = check_plan(m, cl, load_plan(s));
    return r.empty() ? std::string() : r.front().key + ": " + r.front().message;
  };
  EXPECT_EQ(key_of("pp=2,decoder_first_pipeline_num_layers=40"), "");  // 40 + 56
  EXPECT_EQ(key_of("pp=4,vp=2,decoder_first_pipeline_num_layers=20,decoder_last_pipeline_num_layers=20,gbs=8"), "");  // 28 each
  EXPECT_NE(key_of("pp=4,decoder_first_pipeline_num_layers=20").find("uneven_split"), std::string::npos);  // 76 over 3
  EXPECT_NE(key_of("pp=2,decoder_first_pipeline_num_layers=40,decoder_last_pipeline_num_layers=40").find("leave 16"),
            std::string::npos);
  EXPECT_NE(key_of("pp=2,decoder_first_pipeline_num_layers=97").find("= 97 exceed num_layers=96"), std::string::npos);
  EXPECT_NE(key_of("pp=4,vp=2,decoder_first_pipeline_num_layers=21,decoder_last_pipeline_num_layers=21,gbs=8")
                .find("divisible by virtual_pipeline_stages=2"),
            std::string::npos);
  EXPECT_NE(key_of("pp=1,decoder_first_pipeline_num_layers=4").find("pipeline_parallel >= 2"), std::string::npos);
  EXPECT_NE(key_of("pp=2,pipeline_model_parallel_layout=Et|tL").find("holds 2 decoder layers ('t'), not num_layers=96"),
            std::string::npos);
  // A layout may leave chunks empty (Megatron-core allows it), even hold fewer layers than
  // chunks: no layers_vp reason. tiny-gpt has 4 layers; 6 chunks of 1, 1, 1, 1, 0 and 0.
  const ModelSpec tiny = load_model("tiny-gpt");
  const Cluster cpu = load_cluster("local-cpu");
  EXPECT_EQ(check_plan(tiny, cpu, load_plan("pp=2,vp=3,gbs=2")).at(0).key, "layers_vp");
  EXPECT_TRUE(check_plan(tiny, cpu, load_plan("pp=2,gbs=2,pipeline_model_parallel_layout=Et|t|t|t||L")).empty());
  EXPECT_EQ(make_layout(4, load_plan("pp=2,pipeline_model_parallel_layout=Et|t|t|t||L")).layers,
            (std::vector<int64_t>{1, 1, 1, 1, 0, 0}));
}

TEST(Plan, AutoAttentionResolution) {
  const Cluster a100 = load_cluster("dgx-a100-80g"), h100 = load_cluster("dgx-h100-80g");
  const ModelSpec gpt = load_model("gpt3-175b"), llama = load_model("llama2-7b");
  EXPECT_EQ(resolve_attention(gpt, a100, load_plan("tp=1")), AttentionKernel::unfused);
  EXPECT_EQ(resolve_attention(gpt, h100, load_plan("tp=1")), AttentionKernel::flash);
  EXPECT_EQ(resolve_attention(llama, a100, load_plan("tp=1")), AttentionKernel::flash);
  EXPECT_EQ(resolve_attention(gpt, a100, load_plan("cp=2")), AttentionKernel::flash);
  EXPECT_EQ(resolve_attention(gpt, h100, load_plan("attention=unfused")), AttentionKernel::unfused);
  EXPECT_EQ(resolve_attention(gpt, a100, load_plan("precision=fp16")), AttentionKernel::unfused);
  // The rest of the stack follows, and explicit settings win.
  const Stack legacy = resolve_stack(gpt, a100, load_plan("tp=8"));
  EXPECT_FALSE(legacy.modern || legacy.overlap_grad_reduce || legacy.tp_comm_overlap || legacy.grad_accumulation_fusion);
  const Stack modern = resolve_stack(llama, a100, load_plan("tp=8"));
  EXPECT_TRUE(modern.modern && modern.overlap_grad_reduce && modern.tp_comm_overlap && modern.grad_accumulation_fusion);
  // Context parallelism needs fused attention and changes nothing else.
  const Stack cp = resolve_stack(gpt, a100, load_plan("tp=8,cp=2"));
  EXPECT_EQ(cp.attention, AttentionKernel::flash);
  EXPECT_FALSE(cp.modern || cp.overlap_grad_reduce || cp.grad_accumulation_fusion);
  const Stack mixed = resolve_stack(gpt, a100, load_plan("tp=8,overlap_grad_reduce=1,grad_accumulation_fusion=auto"));
  EXPECT_TRUE(mixed.overlap_grad_reduce);
  EXPECT_FALSE(mixed.grad_accumulation_fusion);
  // Sharded data parallelism (ZeRO-2/3: FSDP and its kin) runs the modern stack; ZeRO-1
  // (Megatron's distributed optimizer, DeepSpeed's stage 1) keeps the legacy one; the plan's
  // software_stack overrides either way, and an explicit setting still wins.
  EXPECT_EQ(resolve_attention(gpt, a100, load_plan("dp=8,zero=1")), AttentionKernel::unfused);
  EXPECT_TRUE(resolve_stack(gpt, a100, load_plan("dp=8,zero=2")).modern);
  const Stack fsdp = resolve_stack(gpt, a100, load_plan("dp=8,zero=3"));
  EXPECT_TRUE(fsdp.modern && fsdp.attention == AttentionKernel::flash && fsdp.overlap_param_gather &&
              fsdp.grad_accumulation_fusion);
  const Stack old_zero3 = resolve_stack(gpt, a100, load_plan("dp=8,zero=3,software_stack=legacy"));
  EXPECT_FALSE(old_zero3.modern || old_zero3.overlap_grad_reduce || old_zero3.grad_accumulation_fusion);
  EXPECT_EQ(old_zero3.attention, AttentionKernel::unfused);
  EXPECT_TRUE(resolve_stack(gpt, a100, load_plan("dp=8,software_stack=modern")).modern);
  EXPECT_FALSE(resolve_stack(llama, h100, load_plan("dp=8,software_stack=legacy")).modern);
  EXPECT_EQ(resolve_attention(gpt, a100, load_plan("dp=8,zero=3,attention=unfused")), AttentionKernel::unfused);
  // On V100 (no bf16: before FlashAttention and FSDP) ZeRO-3 is DeepSpeed's, legacy.
  EXPECT_FALSE(resolve_stack(gpt, load_cluster("dgx2-v100-32g"), load_plan("dp=8,zero=3,precision=fp16")).modern);
  // The strata executor's stack is its own.
  EXPECT_EQ(check_plan(gpt, load_cluster("local-cpu"), load_plan("software_stack=modern")).at(0).key, "software_stack");
  // A sequence longer than the 2048 keys of the legacy fused softmax fuses the attention on
  // a legacy stack, as context parallelism does, and changes nothing else.
  ModelSpec longer = gpt;
  longer.S = 4096;
  const Stack long_seq = resolve_stack(longer, a100, load_plan("tp=8"));
  EXPECT_EQ(long_seq.attention, AttentionKernel::flash);
  EXPECT_FALSE(long_seq.modern || long_seq.overlap_grad_reduce || long_seq.grad_accumulation_fusion);
  longer.S = kLegacyFusedSoftmaxMaxKeys;
  EXPECT_EQ(resolve_attention(longer, a100, load_plan("tp=8")), AttentionKernel::unfused);
}

// Context parallelism's cp_comm_type (Megatron-LM's --cp-comm-type): read in both forms and
// Transformer Engine's spelling, written back only where given; "auto" is p2p, or with a
// sliding window (which Transformer Engine's ring refuses) a2a where context_parallel divides
// the heads and key/value groups of a tensor-parallel rank, else allgather; the strata
// executor always gathers.
TEST(Plan, ContextParallelCommType) {
  EXPECT_EQ(load_plan("cp=2,cp_comm_type=a2a").cp_comm, CpComm::a2a);
  EXPECT_EQ(load_plan("cp=2,cp_comm_type=all_gather").cp_comm, CpComm::allgather);
  EXPECT_EQ(load_plan("cp=2").cp_comm, CpComm::automatic);
  EXPECT_EQ(plan_from_json(Json{{"context_parallel", 2}, {"cp_comm_type", "p2p"}}, "plan").cp_comm, CpComm::p2p);
  // A Megatron-LM config dump's list (a type per layer): one type for all, else refused.
  EXPECT_EQ(plan_from_json(Json::parse(R"({"context_parallel": 2, "cp_comm_type": ["a2a", "a2a"]})"), "plan").cp_comm,
            CpComm::a2a);
  EXPECT_THROW(plan_from_json(Json::parse(R"({"context_parallel": 2, "cp_comm_type": ["a2a", "p2p"]})"), "plan"),
               InputError);
  const Plan p = load_plan("cp=4,cp_comm_type=allgather");
  EXPECT_EQ(plan_from_json(plan_to_json(p), "plan").cp_comm, CpComm::allgather);
  EXPECT_EQ(load_plan(plan_to_inline(p)).cp_comm, CpComm::allgather);
  EXPECT_FALSE(plan_to_json(load_plan("cp=4")).contains("cp_comm_type"));
  const std::string bad = message("cp=2,cp_comm_type=ring");
  EXPECT_NE(bad.find("cp_comm_type"), std::string::npos) << bad;
  EXPECT_NE(bad.find("a2a"), std::string::npos) << bad;

  const Cluster h100 = load_cluster("dgx-h100-80g"), cpu = load_cluster("local-cpu");
  ModelSpec llama = load_model("llama3-70b");  // A = 64, G = 8
  auto keys = [](const ModelSpec& m, const Cluster& c, const std::string& plan) {
    std::vector<std::string> k;
    for (const Reason& r : check_plan(m, c, load_plan(plan))) k.push_back(r.key);
    return k;
  };
  EXPECT_EQ(resolve_cp_comm(llama, h100, load_plan("tp=8,cp=2")), CpComm::p2p);
  EXPECT_EQ(resolve_cp_comm(llama, cpu, load_plan("tp=8,cp=2")), CpComm::allgather);
  // a2a: tp 4 leaves 16 heads and 2 groups per rank, which cp 2 divides and cp 4 does not;
  // tp 8 leaves one group.
  EXPECT_TRUE(keys(llama, h100, "tp=4,cp=2,cp_comm_type=a2a").empty());
  EXPECT_EQ(keys(llama, h100, "tp=4,cp=4,cp_comm_type=a2a"), std::vector<std::string>{"cp_comm"});
  EXPECT_EQ(keys(llama, h100, "tp=8,cp=2,cp_comm_type=a2a"), std::vector<std::string>{"cp_comm"});
  EXPECT_TRUE(keys(llama, h100, "tp=8,cp=2,cp_comm_type=allgather").empty());
  EXPECT_TRUE(keys(llama, h100, "tp=8,cp_comm_type=a2a").empty());  // no context parallelism: nothing to move
  // The strata executor: allgather (or auto) only.
  EXPECT_EQ(check_plan(load_model("tiny-llama"), cpu, load_plan("cp=2,cp_comm_type=p2p")).at(0).key, "cp_comm");
  EXPECT_TRUE(check_plan(load_model("tiny-llama"), cpu, load_plan("cp=2,cp_comm_type=allgather")).empty());
  // A sliding window: no ring; a2a where the heads divide, else allgather.
  llama.window_size = 4096;
  llama.window_layers = llama.L;
  EXPECT_EQ(resolve_cp_comm(llama, h100, load_plan("tp=4,cp=2")), CpComm::a2a);
  EXPECT_EQ(resolve_cp_comm(llama, h100, load_plan("tp=8,cp=2")), CpComm::allgather);
  EXPECT_EQ(resolve_cp_comm(llama, load_plan("tp=4,cp=2,cp_comm_type=allgather")), CpComm::allgather);
  EXPECT_TRUE(keys(llama, h100, "tp=4,cp=2").empty());
  const std::vector<Reason> ring = check_plan(llama, h100, load_plan("tp=4,cp=2,cp_comm_type=p2p"));
  ASSERT_EQ(ring.size(), 1u);
  EXPECT_EQ(ring[0].key, "cp_comm");
  EXPECT_NE(ring[0].message.find("window_size=4096"), std::string::npos) << ring[0].message;
}

}  // namespace
}  // namespace strata
