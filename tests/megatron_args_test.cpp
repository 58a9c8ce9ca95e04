// A Megatron-LM launch read as strata's model and plan (costmodel/megatron_args.h).
#include <algorithm>
#include <tuple>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "costmodel/estimate.h"
#include "costmodel/megatron_args.h"
#include "costmodel/stack.h"
#include "planner/export.h"

namespace strata {
namespace {

// A launch script in the style of Megatron-LM's examples/gpt3 (bash arrays, variables,
// comments, torchrun's world), for the GPT-3 175B run of its README: TP 8, PP 16 on 1024
// GPUs, micro-batch 1, global batch 1536, full recompute.
const char* kScript = R"SH(#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NUM_NODES=128   # 1024 GPUs
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes ${NUM_NODES}
    --master_addr localhost --master_port 6000
)
GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto # flash/fused/unfused/local
)
TRAINING_ARGS="--micro-batch-size 1 --global-batch-size=1536 \
    --rampup-batch-size 16 16 5859375 --train-iters 500000 --lr 6.0e-5 --fp16"
MODEL_PARALLEL_ARGS=( --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 )
DATA_ARGS=( --data-path $DATA_PATH --vocab-file $VOCAB_FILE --vocab-size 51200 )
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${GPT_MODEL_ARGS[@]} $TRAINING_ARGS \
    ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS[@]} \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)SH";

std::string error_of(const std::string& text, int64_t gpus = 0) {
  try {
    launch_inputs(parse_megatron_launch(text, "launch"), gpus, "launch");
  } catch (const InputError& e) {
    return e.what();
  }
  return "no error";
}

TEST(MegatronArgs, LaunchScriptIsThePublishedPlan) {
  const MegatronLaunch l = parse_megatron_launch(kScript, "launch");
  EXPECT_EQ(l.gpus, 1024);  // 8 per node x 128 nodes, through the script's variables
  const LaunchInputs in = launch_inputs(l, 0, "launch");
  EXPECT_EQ(in.model.L, 96);
  EXPECT_EQ(in.model.H, 12288);
  EXPECT_EQ(in.model.V, 51200);
  EXPECT_EQ(in.model.S, 2048);
  const Plan& p = in.plan;
  EXPECT_EQ(p.t, 8);
  EXPECT_EQ(p.p, 16);
  EXPECT_EQ(p.d, 8);
  EXPECT_EQ(p.mbs, 1);
  EXPECT_EQ(p.gbs, 1536);
  EXPECT_EQ(p.precision, Precision::fp16);
  EXPECT_EQ(p.recompute, Recompute::full);
  EXPECT_EQ(p.recompute_layers, 0);  // uniform: every layer
  EXPECT_EQ(p.attention, AttentionChoice::automatic);
  // The same estimate as the preset and the plan JSON of the worked example.
  const Cluster cl = load_cluster("dgx-a100-80g");
  const Estimate a = estimate(in.model, cl, p);
  const Estimate b = estimate(load_model("gpt3-175b"), cl, load_plan(STRATA_SOURCE_DIR "/examples/megatron-gpt3-1024.plan.json"));
  EXPECT_EQ(a.step_time_s, b.step_time_s);
  EXPECT_EQ(a.memory.peak, b.memory.peak);
  // What it does not model is named, once each, in order.
  ASSERT_GE(l.ignored.size(), 5u);
  EXPECT_EQ(l.ignored[0], "--master-addr");
  EXPECT_NE(std::find(l.ignored.begin(), l.ignored.end(), "--lr"), l.ignored.end());
  EXPECT_NE(std::find(l.ignored.begin(), l.ignored.end(), "--data-path"), l.ignored.end());
  // --gpus overrides the launcher's world.
  EXPECT_EQ(launch_inputs(l, 2048, "launch").plan.d, 16);
}

// strata plan --export megatron, read back: the same plan (with the vocabulary, which
// Megatron takes from its tokenizer, added).
TEST(MegatronArgs, ExportedFlagsReadBackAsThePlan) {
  const ModelSpec m = load_model("llama3-70b");
  for (const char* inline_plan :
       {"tp=8,pp=4,dp=4,vp=5,mbs=1,gbs=512,zero=1,recompute=selective,sp=1,precision=bf16",
        "tp=4,pp=8,cp=2,dp=2,vp=2,mbs=1,gbs=256,zero=1,recompute=full,sp=1,precision=fp8",
        "tp=8,pp=1,dp=16,mbs=2,gbs=512,zero=3,recompute=full,recompute_num_layers=20,sp=1,precision=bf16",
        "tp=2,pp=2,dp=32,mbs=1,gbs=64,zero=0,recompute=none,precision=fp16",
        "tp=8,pp=1,dp=8,mbs=1,gbs=64,zero=1,offload=0.5,precision=bf16",
        "tp=8,pp=1,dp=8,mbs=1,gbs=64,zero=3,offload=1,precision=bf16",
        "tp=4,pp=8,dp=2,vp=5,mbs=1,gbs=256,zero=1,sp=1,grad_reduce_in_fp32=0,precision=fp8",
        "tp=2,pp=2,dp=32,mbs=1,gbs=64,zero=1,grad_reduce_in_fp32=1,precision=fp16",
        "tp=8,pp=1,dp=8,mbs=1,gbs=64,zero=1,use_precision_aware_optimizer=1,exp_avg_dtype=bf16,"
        "exp_avg_sq_dtype=bf16,store_param_remainders=0,grad_reduce_in_fp32=0,precision=bf16",
        "tp=4,pp=8,dp=2,vp=5,mbs=1,gbs=256,zero=1,sp=1,recompute=selective,offload_modules=qkv_linear+core_attn+attn_proj,"
        "activation_offload_fraction=0.75,min_offloaded_tensor_size=65536,precision=fp8",
        "tp=8,pp=1,dp=16,mbs=1,gbs=64,zero=1,num_distributed_optimizer_instances=2,precision=bf16",
        "tp=8,pp=1,dp=16,mbs=1,gbs=64,zero=3,num_distributed_optimizer_instances=4,precision=bf16"}) {
    const Plan p = load_plan(inline_plan);
    const std::string flags = export_megatron(m, p, resolve_stack(m, load_cluster("dgx-h100-80g"), p)) +
                              fmt::format(" --vocab-size {}", m.V);
    const LaunchInputs in = launch_inputs(parse_megatron_launch(flags, "export"), p.world_size(), "export");
    const Plan& q = in.plan;
    EXPECT_EQ(std::tie(q.t, q.p, q.d, q.c, q.v, q.mbs, q.gbs, q.zero, q.sp, q.recompute_layers),
              std::tie(p.t, p.p, p.d, p.c, p.v, p.mbs, p.gbs, p.zero, p.sp, p.recompute_layers))
        << inline_plan << "\n" << flags;
    EXPECT_EQ(q.recompute, p.recompute) << inline_plan;
    EXPECT_EQ(q.offload, p.offload) << inline_plan;
    EXPECT_EQ(q.precision, p.precision) << inline_plan;
    const Cluster h100 = load_cluster("dgx-h100-80g");
    EXPECT_EQ(resolve_stack(m, h100, q).grad_reduce_in_fp32, resolve_stack(m, h100, p).grad_reduce_in_fp32)
        << inline_plan << "\n" << flags;
    // (Megatron-LM offloads only with the precision-aware optimizer: the export adds it.)
    EXPECT_EQ(q.precision_aware_optimizer, p.precision_aware_optimizer || p.offload > 0) << inline_plan << "\n" << flags;
    EXPECT_EQ(std::tie(q.exp_avg_dtype, q.exp_avg_sq_dtype, q.main_params_dtype),
              std::tie(p.exp_avg_dtype, p.exp_avg_sq_dtype, p.main_params_dtype))
        << inline_plan << "\n" << flags;
    // (Megatron-LM has no flag for store_param_remainders: the export says so in a note.)
    if (!p.store_param_remainders) {
      EXPECT_NE(flags.find("# store_param_remainders=false"), std::string::npos) << flags;
    }
    EXPECT_EQ(q.dp_instances, p.dp_instances) << inline_plan << "\n" << flags;
    // The launch costs as the plan did (the export says what strata costed: Megatron-FSDP's
    // fused accumulation, fp8 parameters exactly where the plan has them); but offload,
    // which Megatron runs only with the precision-aware optimizer the export adds, and
    // store_param_remainders, which has no flag.
    if (p.offload == 0 && p.store_param_remainders) {
      const Estimate ep = estimate(m, h100, p), eq = estimate(in.model, h100, q);
      EXPECT_NEAR(eq.step_time_s, ep.step_time_s, 1e-9 * ep.step_time_s) << inline_plan << "\n" << flags;
      EXPECT_NEAR(eq.memory.peak, ep.memory.peak, 1e-9 * ep.memory.peak) << inline_plan << "\n" << flags;
    }
    EXPECT_EQ(std::tie(q.offload_modules, q.activation_offload_fraction, q.min_offloaded_tensor_size),
              std::tie(p.offload_modules, p.activation_offload_fraction, p.min_offloaded_tensor_size))
        << inline_plan << "\n" << flags;
    EXPECT_EQ(in.model.total_params(), m.total_params()) << inline_plan;
    EXPECT_EQ(std::tie(in.model.L, in.model.H, in.model.A, in.model.G, in.model.F, in.model.S),
              std::tie(m.L, m.H, m.A, m.G, m.F, m.S));
    EXPECT_EQ(std::tie(in.model.normalization, in.model.position, in.model.tie_embeddings, in.model.bias),
              std::tie(m.normalization, m.position, m.tie_embeddings, m.bias));
  }
  // 126 layers on 16 stages: the embedding and the loss each take a layer's slot
  // (--account-for-embedding/loss-in-pipeline-split), with and without virtual stages.
  const ModelSpec big = load_model("llama3-405b");
  for (const char* inline_plan : {"tp=8,pp=16,dp=4,mbs=1,gbs=64,zero=1,sp=1", "tp=8,pp=16,dp=4,vp=2,mbs=1,gbs=64,zero=1,sp=1"}) {
    const Plan p = load_plan(inline_plan);
    const std::string flags = export_megatron(big, p, resolve_stack(big, load_cluster("dgx-h100-80g"), p)) +
                              fmt::format(" --vocab-size {}", big.V);
    ASSERT_NE(flags.find("--account-for-loss-in-pipeline-split"), std::string::npos) << flags;
    const LaunchInputs in = launch_inputs(parse_megatron_launch(flags, "export"), p.world_size(), "export");
    EXPECT_EQ(std::tie(in.plan.p, in.plan.v), std::tie(p.p, p.v)) << inline_plan;
    const Cluster cl = load_cluster("dgx-h100-80g");
    EXPECT_EQ(estimate(in.model, cl, in.plan).memory.peak, estimate(big, cl, p).memory.peak) << inline_plan;
  }
}

// Mixture of experts: the exported flags read back as the same model and plan, and the
// same estimate.
TEST(MegatronArgs, ExpertFlagsRoundTrip) {
  const Cluster cl = load_cluster("dgx-h100-80g");
  for (const char* name : {"mixtral-8x7b", "qwen3-30b-a3b"}) {
    const ModelSpec m = load_model(name);
    const Plan p = load_plan("tp=2,pp=2,dp=16,ep=8,mbs=1,gbs=256,zero=1,sp=1,recompute=selective");
    // (one replica whose experts still reduce over 2: the overlap is said for them too)
    const Plan one = load_plan("tp=4,pp=4,dp=1,ep=2,mbs=1,gbs=64,sp=1");
    const std::string one_flags = export_megatron(m, one, resolve_stack(m, cl, one)) + fmt::format(" --vocab-size {}", m.V);
    EXPECT_EQ(estimate(m, cl, one).step_time_s,
              estimate(m, cl, launch_inputs(parse_megatron_launch(one_flags, "export"), 16, "export").plan).step_time_s)
        << name << "\n" << one_flags;
    const std::string flags = export_megatron(m, p, resolve_stack(m, cl, p)) + fmt::format(" --vocab-size {}", m.V);
    const LaunchInputs in = launch_inputs(parse_megatron_launch(flags, "export"), p.world_size(), "export");
    EXPECT_EQ(std::tie(in.model.E, in.model.K, in.model.Fe, in.model.Fs), std::tie(m.E, m.K, m.Fe, m.Fs)) << name;
    EXPECT_EQ(in.plan.ep, 8) << name << "\n" << flags;
    EXPECT_EQ(in.model.total_params(), m.total_params()) << name;
    EXPECT_EQ(estimate(in.model, cl, in.plan).step_time_s, estimate(m, cl, p).step_time_s) << name;
  }
  // A mix of dense and MoE layers: --moe-layer-freq as Megatron's Python list expression.
  {
    Json j = model_to_json(load_model("mixtral-8x7b"));
    j["moe_layer_freq"] = "([0]*2+[1]*30)";
    const ModelSpec mixed = model_from_json(j, "model");
    const Plan p = load_plan("tp=2,pp=2,dp=16,ep=8,mbs=1,gbs=256,zero=1,sp=1");
    const std::string flags = export_megatron(mixed, p, resolve_stack(mixed, cl, p)) + fmt::format(" --vocab-size {}", mixed.V);
    EXPECT_NE(flags.find("--moe-layer-freq \"([0]*2+[1]*30)\""), std::string::npos) << flags;
    const LaunchInputs in = launch_inputs(parse_megatron_launch(flags, "export"), p.world_size(), "export");
    EXPECT_EQ(in.model.moe_layer, mixed.moe_layer);
    EXPECT_EQ(in.model.total_params(), mixed.total_params());
    EXPECT_EQ(estimate(in.model, cl, in.plan).step_time_s, estimate(mixed, cl, p).step_time_s);
    // Megatron's grouped form inside a launch script's bash array, its parentheses kept.
    const LaunchInputs grouped = launch_inputs(
        parse_megatron_launch("MOE_ARGS=(\n  --num-experts 8\n  --moe-layer-freq \"([1]*3+[0]*1)*2\"\n)\n"
                              "torchrun pretrain_gpt.py ${MOE_ARGS[@]} --num-layers 8 --hidden-size 64 "
                              "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --vocab-size 100 "
                              "--micro-batch-size 1 --bf16",
                              "launch"),
        8, "launch");
    EXPECT_EQ(grouped.model.moe_layer, (std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 0}));
    EXPECT_NE(error_of("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 100 "
                              "--num-experts 8 --moe-layer-freq \"([0]*3)\"", 8)
                  .find("moe_layer_freq"),
              std::string::npos);
  }
  // Multi-latent attention (DeepSeek-V3): --multi-latent-attention with its sizes, read back.
  {
    const ModelSpec ds = load_model("deepseek-v3");
    const Plan p = load_plan("tp=2,pp=8,dp=64,ep=64,etp=1,mbs=1,gbs=8192,zero=1,sp=1");
    const std::string flags = export_megatron(ds, p, resolve_stack(ds, cl, p)) + fmt::format(" --vocab-size {}", ds.V);
    for (const char* f : {"--multi-latent-attention", "--q-lora-rank 1536", "--kv-lora-rank 512", "--qk-head-dim 128",
                          "--qk-pos-emb-head-dim 64", "--v-head-dim 128", "--moe-layer-freq \"([0]*3+[1]*58)\""})
      EXPECT_NE(flags.find(f), std::string::npos) << f << "\n" << flags;
    EXPECT_EQ(flags.find("--kv-channels"), std::string::npos) << flags;
    for (const char* f : {"--moe-router-num-groups 8", "--moe-router-group-topk 4", "--moe-token-dispatcher-type alltoall"})
      EXPECT_NE(flags.find(f), std::string::npos) << f << "\n" << flags;
    const LaunchInputs in = launch_inputs(parse_megatron_launch(flags, "export"), p.world_size(), "export");
    EXPECT_TRUE(in.model.mla());
    EXPECT_EQ(std::tie(in.model.moe_groups, in.model.moe_group_topk), std::tie(ds.moe_groups, ds.moe_group_topk));
    // A plan's flags exported with the model's, each of `expect` among them, read back.
    auto round_trip = [&](const Plan& q, std::initializer_list<const char*> expect) {
      const std::string text = export_megatron(ds, q, resolve_stack(ds, cl, q)) + fmt::format(" --vocab-size {}", ds.V);
      for (const char* f : expect) EXPECT_NE(text.find(f), std::string::npos) << f << "\n" << text;
      return launch_inputs(parse_megatron_launch(text, "export"), q.world_size(), "export");
    };
    // The flex dispatcher, written and read back.
    const Plan fp = load_plan("tp=2,pp=8,dp=64,ep=64,etp=1,mbs=1,gbs=8192,zero=1,sp=1,moe_token_dispatcher_type=flex,"
                              "moe_flex_dispatcher_backend=hybridep");
    const LaunchInputs fin = round_trip(fp, {"--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend hybridep"});
    EXPECT_EQ(fin.plan.moe_dispatcher, MoeDispatcher::hybridep);
    {
      const Plan op = load_plan("dp=64,ep=64,etp=1,mbs=1,gbs=512,zero=1,moe_token_dispatcher_type=flex,"
                                "overlap_moe_expert_parallel_comm=1,delay_wgrad_compute=1");
      const LaunchInputs oin = round_trip(op, {"--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"});
      EXPECT_TRUE(oin.plan.moe_a2a_overlap);
      EXPECT_TRUE(oin.plan.delay_wgrad);
      EXPECT_EQ(estimate(oin.model, cl, oin.plan).step_time_s, estimate(ds, cl, op).step_time_s);
    }
    EXPECT_EQ(estimate(fin.model, cl, fin.plan).step_time_s, estimate(ds, cl, fp).step_time_s);

    EXPECT_EQ(in.model.total_params(), ds.total_params());
    EXPECT_EQ(estimate(in.model, cl, in.plan).step_time_s, estimate(ds, cl, p).step_time_s);
    // Its multi-token prediction module: --mtp-num-layers, and a layout's 'm' (Megatron-Bridge's
    // for pp 8 vp 4), written and read back to the same estimate.
    EXPECT_NE(flags.find("--mtp-num-layers 1"), std::string::npos) << flags;
    EXPECT_EQ(in.model.mtp_layers, 1);
    const Plan lp = load_plan("tp=2,pp=8,vp=4,dp=64,ep=64,etp=1,mbs=1,gbs=8192,zero=1,sp=1,"
                              "pipeline_model_parallel_layout=Et|(tt|)*30mL");
    const LaunchInputs lin = round_trip(lp, {"--pipeline-model-parallel-layout \"Et|(tt|)*30mL\""});
    EXPECT_EQ(estimate(lin.model, cl, lin.plan).step_time_s, estimate(ds, cl, lp).step_time_s);
    EXPECT_TRUE(estimate(ds, cl, lp).valid);
    const std::string bridge = export_bridge(ds, lp, resolve_stack(ds, cl, lp));
    EXPECT_NE(bridge.find("model.mtp_num_layers=1"), std::string::npos) << bridge;
  }
  // --recompute-modules takes a list of words, and is written back.
  const ModelSpec m = load_model("mixtral-8x7b");
  const Plan p = load_plan("tp=2,dp=16,ep=8,mbs=1,gbs=256,zero=1,sp=1,recompute_modules=core_attn+moe_act+layernorm");
  const std::string flags = export_megatron(m, p, resolve_stack(m, cl, p)) + fmt::format(" --vocab-size {}", m.V);
  EXPECT_NE(flags.find("--recompute-modules core_attn layernorm moe_act"), std::string::npos) << flags;
  const LaunchInputs in = launch_inputs(parse_megatron_launch(flags, "export"), p.world_size(), "export");
  EXPECT_EQ(in.plan.recompute_modules, kRecomputeCoreAttn | kRecomputeLayernorm | kRecomputeMoeAct);
  // The experts' own tensor parallelism is written and read back; --recompute-modules without
  // --recompute-granularity selective is what Megatron makes of it: nothing recomputed; the
  // list stops at the first word that is no module name.
  const Plan folded = load_plan("tp=2,dp=16,ep=8,etp=1,mbs=1,gbs=256,zero=1,sp=1");
  const std::string ff = export_megatron(m, folded, resolve_stack(m, cl, folded)) + fmt::format(" --vocab-size {}", m.V);
  EXPECT_NE(ff.find("--expert-tensor-parallel-size 1"), std::string::npos) << ff;
  EXPECT_EQ(launch_inputs(parse_megatron_launch(ff, "export"), 32, "export").plan.expert_tp(), 1);
  const std::string base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                           "--max-position-embeddings 32 --vocab-size 100 --micro-batch-size 1 --bf16 ";
  EXPECT_EQ(launch_inputs(parse_megatron_launch(base + "--recompute-modules moe_act", "launch"), 1, "launch").plan.recompute,
            Recompute::none);
  const Plan sel = launch_inputs(parse_megatron_launch(base + "--recompute-granularity selective --recompute-modules "
                                                              "layernorm 2>&1", "launch"), 1, "launch").plan;
  EXPECT_EQ(sel.recompute_modules, kRecomputeLayernorm);
}

// Megatron-LM's uneven pipelines: --pipeline-model-parallel-layout (its parentheses kept
// inside a bash array, whose own are blanks) and --decoder-first/last-pipeline-num-layers,
// read from a launch and written back by --export megatron.
TEST(MegatronArgs, UnevenPipelineFlags) {
  const std::string model = "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention "
                            "--num-query-groups 8 --ffn-hidden-size 28672 --swiglu --seq-length 8192 --vocab-size 128256 ";
  const LaunchInputs a = launch_inputs(
      parse_megatron_launch("PP_ARGS=(\n  --pipeline-model-parallel-size 8\n"
                            "  --pipeline-model-parallel-layout \"Et*2|(t*2|)*34,t*3|(t*2|)*3,tL\"\n)\n"
                            "torchrun pretrain_gpt.py ${PP_ARGS[@]} --tensor-model-parallel-size 4 " + model +
                                "--micro-batch-size 1 --global-batch-size 256 --bf16",
                            "launch"),
      64, "launch");
  ASSERT_TRUE(a.plan.layout);
  EXPECT_EQ(a.plan.layout->text, "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL");
  EXPECT_EQ(std::tie(a.plan.p, a.plan.v, a.plan.d), std::make_tuple(int64_t{8}, int64_t{5}, int64_t{2}));
  const LaunchInputs b = launch_inputs(
      parse_megatron_launch(model + "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 14 "
                                    "--decoder-last-pipeline-num-layers 18 --num-virtual-stages-per-pipeline-rank 2",
                            "launch"),
      32, "launch");
  EXPECT_EQ(std::tie(b.plan.first_stage_layers, b.plan.last_stage_layers, b.plan.v),
            std::make_tuple(int64_t{14}, int64_t{18}, int64_t{2}));
  EXPECT_TRUE(check_plan(b.model, load_cluster("dgx-h100-80g"), b.plan).empty());  // 14, 24, 24, 18
  const Cluster cl = load_cluster("dgx-h100-80g");
  for (const LaunchInputs* in : {&a, &b}) {
    const std::string flags = export_megatron(in->model, in->plan, resolve_stack(in->model, cl, in->plan)) +
                              fmt::format(" --vocab-size {}", in->model.V);
    const Plan q = launch_inputs(parse_megatron_launch(flags, "export"), in->plan.world_size(), "export").plan;
    EXPECT_EQ(std::tie(q.p, q.v, q.first_stage_layers, q.last_stage_layers),
              std::tie(in->plan.p, in->plan.v, in->plan.first_stage_layers, in->plan.last_stage_layers))
        << flags;
    EXPECT_EQ(q.layout ? q.layout->layers : std::vector<int64_t>{}, in->plan.layout ? in->plan.layout->layers : std::vector<int64_t>{})
        << flags;
    EXPECT_EQ(estimate(in->model, cl, q).step_time_s, estimate(in->model, cl, in->plan).step_time_s) << flags;
  }
}

// Where a flag is absent, what Megatron-LM assumes (not strata's Llama-style defaults for a
// gated MLP): LayerNorm, learned positions, tied embeddings, biases, dropout 0.1, fp32,
// multi-head attention unless --group-query-attention, and its SwiGLU width rule.
// --optimizer-cpu-offload moves the optimizer states to the host (all of them unless
// --optimizer-offload-fraction says less); the fraction alone does nothing in Megatron.
// The plan of a small launch on 8 GPUs with these flags added.
Plan small_launch_plan(const std::string& flags) {
  return launch_inputs(parse_megatron_launch("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                                             "--max-position-embeddings 32 --vocab-size 100 --micro-batch-size 1 "
                                             "--global-batch-size 8 " + flags, "launch"),
                       8, "launch")
      .plan;
}

TEST(MegatronArgs, OptimizerOffloadFlags) {
  auto offload = [](const std::string& flags) {
    return small_launch_plan("--use-distributed-optimizer " + flags).offload;
  };
  EXPECT_EQ(offload(""), 0.0);
  EXPECT_EQ(offload("--optimizer-cpu-offload"), 1.0);
  EXPECT_EQ(offload("--optimizer-cpu-offload --optimizer-offload-fraction 0.25"), 0.25);
  EXPECT_EQ(offload("--optimizer-offload-fraction 0.25"), 0.0);
}

// The main gradients' type: --grad-reduce-in-bf16 (Megatron-LM's newer flag) turns fp32
// reduction off, --accumulate-allreduce-grads-in-fp32 on (fp16's default is off); Megatron
// forces fp32 with bf16 unless told --grad-reduce-in-bf16.
TEST(MegatronArgs, GradReduceFlags) {
  auto grads = [](const std::string& flags) { return small_launch_plan(flags).grad_reduce_in_fp32; };
  EXPECT_EQ(grads("--bf16"), Tristate::automatic);
  EXPECT_EQ(grads("--bf16 --grad-reduce-in-bf16"), Tristate::off);
  EXPECT_EQ(grads("--fp16 --accumulate-allreduce-grads-in-fp32"), Tristate::on);
  // The precision-aware optimizer's flags; its --main-grads-dtype is the gradients' type.
  const Plan pa = small_launch_plan("--bf16 --use-distributed-optimizer --use-precision-aware-optimizer "
                                    "--exp-avg-dtype bf16 --exp-avg-sq-dtype fp8 --main-grads-dtype bf16 "
                                    "--no-store-param-remainders");
  EXPECT_TRUE(pa.precision_aware_optimizer);
  EXPECT_EQ(pa.exp_avg_dtype, OptDtype::bf16);
  EXPECT_EQ(pa.exp_avg_sq_dtype, OptDtype::fp8);
  EXPECT_FALSE(pa.store_param_remainders);
  EXPECT_EQ(pa.grad_reduce_in_fp32, Tristate::off);
  const ModelSpec m = load_model("llama3-8b");
  const Plan off = load_plan("dp=8,zero=1,grad_reduce_in_fp32=0");
  const std::string flags = export_megatron(m, off, resolve_stack(m, load_cluster("dgx-h100-80g"), off));
  EXPECT_NE(flags.find("--grad-reduce-in-bf16"), std::string::npos) << flags;
  const Plan dflt = load_plan("dp=8,zero=1");
  const std::string plain = export_megatron(m, dflt, resolve_stack(m, load_cluster("dgx-h100-80g"), dflt));
  EXPECT_EQ(plain.find("--grad-reduce-in-bf16"), std::string::npos);
  EXPECT_EQ(plain.find("--accumulate-allreduce"), std::string::npos);
}

// --tp-comm-overlap (Transformer Engine's user buffers) is what a plan with user buffers
// exports (tp_comm_overlap=1, or "auto" on the modern stack with the group inside a node),
// with sequence parallelism only (Megatron asserts it); a plan saying 0 runs without them,
// and a launch without the flag, like Megatron-LM's default, reads back as 0.
TEST(MegatronArgs, TpCommOverlapFlag) {
  const ModelSpec m = load_model("llama3-70b");
  const Cluster h100 = load_cluster("dgx-h100-80g");
  auto flags = [&](const char* plan) {
    const Plan p = load_plan(plan);
    return export_megatron(m, p, resolve_stack(m, h100, p));
  };
  const std::string ub = flags("tp=4,dp=2,sp=1,zero=1,precision=fp8,tp_comm_overlap=1");
  EXPECT_NE(ub.find("--tp-comm-overlap"), std::string::npos) << ub;
  EXPECT_NE(flags("tp=4,dp=2,sp=1,zero=1,precision=fp8").find("--tp-comm-overlap"), std::string::npos);
  const std::string plain = flags("tp=4,dp=2,sp=1,zero=1,precision=fp8,tp_comm_overlap=0");
  EXPECT_EQ(plain.find("--tp-comm-overlap"), std::string::npos) << plain;
  const Plan r = launch_inputs(parse_megatron_launch(plain + fmt::format(" --vocab-size {}", m.V), "export"), 8, "export").plan;
  EXPECT_EQ(r.tp_comm_overlap, Tristate::off);
  EXPECT_FALSE(resolve_stack(m, h100, r).userbuffers);
  EXPECT_TRUE(resolve_stack(m, h100, r).tp_comm_overlap);  // (Transformer Engine's own backward overlap)
  EXPECT_EQ(flags("tp=4,dp=2,sp=0,zero=1,precision=fp8,tp_comm_overlap=1").find("--tp-comm-overlap"), std::string::npos);
  const Plan q = launch_inputs(parse_megatron_launch(ub + fmt::format(" --vocab-size {}", m.V), "export"), 8, "export").plan;
  EXPECT_TRUE(resolve_stack(m, h100, q).userbuffers);
  // Megatron asserts the flag without sequence parallelism (which tp 1 turns off): refused.
  for (const char* bad : {"--tensor-model-parallel-size 2 --tp-comm-overlap",
                          "--tensor-model-parallel-size 1 --sequence-parallel --tp-comm-overlap"})
    EXPECT_THROW(small_launch_plan(bad), InputError) << bad;
  EXPECT_EQ(small_launch_plan("--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap").tp_comm_overlap,
            Tristate::on);
  // The MoE token dispatcher's flags are the plan's (--moe-enable-deepep, the older form).
  EXPECT_EQ(small_launch_plan("--moe-token-dispatcher-type flex --moe-enable-deepep").moe_dispatcher,
            MoeDispatcher::deepep);
  EXPECT_EQ(small_launch_plan("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep").moe_dispatcher,
            MoeDispatcher::hybridep);
  EXPECT_EQ(small_launch_plan("--moe-token-dispatcher-type allgather").moe_dispatcher, MoeDispatcher::allgather);
  EXPECT_THROW(small_launch_plan("--moe-enable-deepep"), InputError);
}

// Fine-grained activation offloading: --offload-modules takes a list of words, read (with
// its settings) only with --fine-grained-activation-offloading, as Megatron-LM does.
TEST(MegatronArgs, ActivationOffloadingFlags) {
  const Plan p = small_launch_plan("--bf16 --fine-grained-activation-offloading --offload-modules core_attn attn_proj "
                                   "--activation-offload-fraction 0.5 --min-offloaded-tensor-size 0");
  EXPECT_EQ(p.offload_modules, kOffloadCoreAttn | kOffloadAttnProj);
  EXPECT_DOUBLE_EQ(p.activation_offload_fraction, 0.5);
  EXPECT_EQ(p.min_offloaded_tensor_size, 0);
  EXPECT_EQ(small_launch_plan("--bf16 --offload-modules core_attn --activation-offload-fraction 0.5").offload_modules, 0u);
  EXPECT_NE(error_of("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --vocab-size 512 "
                     "--fine-grained-activation-offloading",
                     8)
                .find("needs offload_modules"),
            std::string::npos);
  EXPECT_NE(error_of("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --vocab-size 512 "
                     "--fine-grained-activation-offloading --offload-modules attn_proj",
                     8)
                .find("without core_attn"),
            std::string::npos);
}

// Squared ReLU (Nemotron-4's MLP): the export says --squared-relu, and the launch reads it
// back as the same model, its MLP ungated and 4h wide where no --ffn-hidden-size is given.
TEST(MegatronArgs, SquaredReluRoundTrips) {
  const ModelSpec m = model_from_json(Json::parse(R"({"num_layers":4,"hidden_size":1024,"num_attention_heads":16,
      "num_query_groups":4,"ffn_hidden_size":4096,"vocab_size":32000,"seq_length":2048,"activation":"squared_relu",
      "position_embedding":"rope","tie_embeddings":false,"add_bias_linear":false,"attention_dropout":0,
      "hidden_dropout":0})"), "model");
  const Plan p = load_plan("tp=2,dp=4,mbs=1,gbs=32,zero=1,sp=1,precision=bf16");
  const std::string flags = export_megatron(m, p, resolve_stack(m, load_cluster("dgx-h100-80g"), p)) +
                            fmt::format(" --vocab-size {}", m.V);
  EXPECT_NE(flags.find("--squared-relu"), std::string::npos) << flags;
  EXPECT_EQ(flags.find("--swiglu"), std::string::npos) << flags;
  const LaunchInputs in = launch_inputs(parse_megatron_launch(flags, "export"), p.world_size(), "export");
  EXPECT_EQ(in.model.activation, Activation::squared_relu);
  EXPECT_EQ(in.model.total_params(), m.total_params());
  const LaunchInputs d = launch_inputs(
      parse_megatron_launch("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
                            "--vocab-size 1000 --squared-relu",
                            "launch"),
      1, "launch");
  EXPECT_EQ(d.model.activation, Activation::squared_relu);
  EXPECT_EQ(d.model.F, 256);
  EXPECT_NE(error_of("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --vocab-size 512 "
                     "--swiglu --squared-relu",
                     1)
                .find("keep one"),
            std::string::npos);
}

TEST(MegatronArgs, MegatronDefaultsForAbsentFlags) {
  const MegatronLaunch l = parse_megatron_launch(
      "--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 --seq-length 128 "
      "--vocab-size 1000 --swiglu",
      "launch");
  const LaunchInputs in = launch_inputs(l, 1, "launch");
  EXPECT_EQ(in.model.activation, Activation::swiglu);
  EXPECT_EQ(in.model.normalization, Norm::layernorm);
  EXPECT_EQ(in.model.position, Position::learned);
  EXPECT_TRUE(in.model.tie_embeddings);
  EXPECT_TRUE(in.model.bias);
  EXPECT_DOUBLE_EQ(in.model.attention_dropout, 0.1);
  EXPECT_EQ(in.model.F, 10880);  // int(4h * 2/3 / 64) * 64
  EXPECT_EQ(in.model.G, 32);     // the groups without --group-query-attention: not read
  EXPECT_NE(std::find(l.ignored.begin(), l.ignored.end(), "--num-query-groups (without --group-query-attention)"),
            l.ignored.end());
  EXPECT_EQ(in.plan.precision, Precision::fp32);
  const LaunchInputs g = launch_inputs(
      parse_megatron_launch("--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
                            "--num-query-groups 8 --seq-length 128 --vocab-size 1000 --bf16",
                            "launch"),
      1, "launch");
  EXPECT_EQ(g.model.G, 8);
  EXPECT_EQ(g.plan.precision, Precision::bf16);
}

TEST(MegatronArgs, FlagForms) {
  // --k=v, --k="v", a quoted list, `export`, ${NAME}, the per-virtual-stage layer count.
  const std::string text =
      "export TP=4\nPP=\"8\"\nARGS=\"--num-layers=96 --hidden-size 12288 --num-attention-heads=\\\"96\\\"\"\n"
      "run $ARGS --seq-length 2048 --vocab-size 51200 --tensor-model-parallel-size ${TP:-2} "
      "--pipeline-model-parallel-size $PP --num-layers-per-virtual-pipeline-stage 4 --micro-batch-size 1 "
      "--global-batch-size 512 --bf16 --sequence-parallel --use-distributed-optimizer --nproc-per-node=8 --nnodes 32";
  const LaunchInputs in = launch_inputs(parse_megatron_launch(text, "launch"), 0, "launch");
  EXPECT_EQ(in.model.L, 96);
  EXPECT_EQ(in.model.A, 96);
  EXPECT_EQ(in.plan.t, 4);
  EXPECT_EQ(in.plan.p, 8);
  EXPECT_EQ(in.plan.v, 3);  // 96 layers / (8 stages x 4 per virtual stage)
  EXPECT_EQ(in.plan.d, 8);  // 256 GPUs / (4 x 8)
  EXPECT_EQ(in.plan.zero, 1);
  EXPECT_TRUE(in.plan.sp);
  EXPECT_EQ(in.plan.precision, Precision::bf16);
  // ${NAME:-default} where NAME is not set.
  EXPECT_EQ(launch_inputs(parse_megatron_launch("--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                                                "--seq-length 32 --vocab-size 100 --tensor-model-parallel-size ${TP:-2}",
                                                "launch"),
                          8, "launch")
                .plan.t,
            2);
  // An elastic node range gives no GPU count: --gpus must.
  const std::string elastic = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                              "--vocab-size 100 --nnodes 1:4 --nproc-per-node 8";
  EXPECT_EQ(parse_megatron_launch(elastic, "launch").gpus, 0);
  EXPECT_NE(error_of(elastic).find("--gpus"), std::string::npos);
  EXPECT_EQ(launch_inputs(parse_megatron_launch(elastic, "launch"), 8, "launch").plan.d, 8);
  // Context parallelism and how it moves keys and values.
  const LaunchInputs cp = launch_inputs(
      parse_megatron_launch("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 100 "
                            "--context-parallel-size 2 --cp-comm-type a2a",
                            "launch"),
      8, "launch");
  EXPECT_EQ(cp.plan.c, 2);
  EXPECT_EQ(cp.plan.cp_comm, CpComm::a2a);
  // Megatron's type per layer: one type for all of them reads as that type, a mix is refused.
  const std::string base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 100 "
                           "--context-parallel-size 2 --cp-comm-type ";
  EXPECT_EQ(launch_inputs(parse_megatron_launch(base + "allgather allgather --micro-batch-size 1", "launch"), 8, "launch")
                .plan.cp_comm,
            CpComm::allgather);
  EXPECT_NE(error_of(base + "p2p a2a").find("a type per layer"), std::string::npos) << error_of(base + "p2p a2a");
}

// The shell around the flags: an if whose condition tests the text's own variables takes
// its branch (flags and assignments of the others skipped), elif and else, nested ifs, and
// a condition strata cannot decide reads every branch and names the flags read; a
// variable that is its own default (TP=${TP:-8}) is the default, quotes inside ${...} are
// dropped, and only a command's first words assign (echo TP=$TP does not).
TEST(MegatronArgs, ShellConditionsAndDefaults) {
  const std::string model = "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                            "--vocab-size 32768 --micro-batch-size 1 --global-batch-size 8 ";
  auto launch = [&](const std::string& shell) { return parse_megatron_launch(shell + "\nrun " + model + "$ARGS", "launch"); };
  auto plan = [&](const std::string& shell) { return launch_inputs(launch(shell), 8, "launch").plan; };
  const std::string dtype = "ARGS=\"--bf16\"\nif [[ \"$DTYPE\" == \"fp8\" ]]; then\n  ARGS=\"--bf16 --fp8-format hybrid\"\nfi\n"
                            "if [ \"$RECOMPUTE\" -eq 1 ]; then\n  run --recompute-granularity full --recompute-method uniform "
                            "--recompute-num-layers 1\nfi\n";
  EXPECT_EQ(plan("DTYPE=bf16\nRECOMPUTE=0\n" + dtype).precision, Precision::bf16);
  EXPECT_EQ(plan("DTYPE=bf16\nRECOMPUTE=0\n" + dtype).recompute, Recompute::none);
  EXPECT_EQ(plan("DTYPE=fp8\nRECOMPUTE=1\n" + dtype).precision, Precision::fp8);
  EXPECT_EQ(plan("DTYPE=fp8\nRECOMPUTE=1\n" + dtype).recompute, Recompute::full);
  EXPECT_TRUE(launch("DTYPE=bf16\nRECOMPUTE=0\n" + dtype).undecided.empty());
  // elif / else, nested, && and ||, test, !, -z / -n, the environment's default.
  const std::string chain = "if [ $TP_SIZE = 2 ]; then\n ARGS=\"--tensor-model-parallel-size 2\"\n"
                            "elif [[ $TP_SIZE == 4 ]] && [ -n \"$TP_SIZE\" ]; then\n ARGS=\"--tensor-model-parallel-size 4\"\n"
                            "else\n if test ! $TP_SIZE -lt 8 || [ -z \"\" ]; then ARGS=\"--tensor-model-parallel-size 8\"; fi\nfi\n";
  EXPECT_EQ(plan("TP_SIZE=2\n" + chain).t, 2);
  EXPECT_EQ(plan("TP_SIZE=4\n" + chain).t, 4);
  EXPECT_EQ(plan("TP_SIZE=${TP_SIZE:-\"8\"}\n" + chain).t, 8);
  // Undecided: a variable the text does not set, a command's status; every branch read.
  const MegatronLaunch u = launch("if [ -n \"$WANDB_KEY\" ]; then\n run --sequence-parallel\nfi\n"
                                  "if $USE_LOG; then echo --log-interval 1; fi\nARGS=\"--tensor-model-parallel-size 2\"");
  ASSERT_EQ(u.undecided.size(), 1u);  // (the second if holds no flag strata reads)
  EXPECT_NE(u.undecided[0].find("--sequence-parallel"), std::string::npos) << u.undecided[0];
  EXPECT_TRUE(launch_inputs(u, 8, "launch").plan.sp);  // (read)
  // A command among a condition's tests is not evaluated: undecided, every branch read.
  const MegatronLaunch cmd =
      launch("USE=0\nif [ \"$USE\" = 1 ] || is_hopper; then\n run --sequence-parallel --tensor-model-parallel-size 2\nfi\n");
  ASSERT_EQ(cmd.undecided.size(), 1u);
  EXPECT_TRUE(launch_inputs(cmd, 8, "launch").plan.sp);
  // A quoted value is whole (a flag list, words with blanks); a branch's assignment counts
  // for the conditions after it; one made in an undecided branch makes them undecided.
  EXPECT_EQ(plan("V=\"--foo bar\"\nif [ -z \"$V\" ]; then ARGS=\"--tensor-model-parallel-size 2\"; "
                 "else ARGS=\"--tensor-model-parallel-size 4\"; fi").t, 4);
  EXPECT_EQ(plan("MODE=\"a b\"\nif [ \"$MODE\" = a ]; then ARGS=\"--tensor-model-parallel-size 4\"; "
                 "else ARGS=\"--tensor-model-parallel-size 2\"; fi").t, 2);
  EXPECT_TRUE(plan("SIZE=big\nSP=0\nif [ \"$SIZE\" = big ]; then SP=1; fi\n"
                   "if [ \"$SP\" = 1 ]; then ARGS=\"--sequence-parallel --tensor-model-parallel-size 2\"; fi").sp);
  EXPECT_NE(error_of(model + "\nX=1\nif [ \"$Y\" = a ]; then X=2; fi\nif [ \"$X\" = 1 ]; then ARGS=\"--tensor-model-parallel-size 4\"; "
                     "else ARGS=\"--tensor-model-parallel-size 2\"; fi\nrun $ARGS", 8).find("given twice"),
            std::string::npos);
  // A case arm's assignments are assignments (two values: exit 2); '${' in single quotes is text.
  EXPECT_NE(error_of("M=small\nTP=8\ncase $M in small) TP=1 ;; *) TP=8 ;; esac\nrun " + model +
                     "--tensor-model-parallel-size $TP", 8).find("--tensor-model-parallel-size $TP"),
            std::string::npos);
  EXPECT_EQ(plan("echo '${'\nARGS=\"--tensor-model-parallel-size 2\"").t, 2);
  // Deep nesting reads in linear time: 5,000 nested ifs, every one taken.
  std::string deep = "GO=1\n";
  for (int i = 0; i < 5000; ++i) deep += "if [ $GO = 1 ]; then\n";
  deep += "ARGS=\"--tensor-model-parallel-size 4\"\n";
  for (int i = 0; i < 5000; ++i) deep += "fi\n";
  EXPECT_EQ(plan(deep).t, 4);
  // Defaults and assignments.
  EXPECT_EQ(plan("TP=${TP:-8}\nARGS=\"--tensor-model-parallel-size $TP\"").t, 8);
  EXPECT_EQ(plan("TP=${TP:-8}\nTP=${TP:-8}\nARGS=\"--tensor-model-parallel-size ${TP}\"").t, 8);
  EXPECT_EQ(plan("TP=2\necho \"Resetting TP=$TP\"\nARGS=\"--tensor-model-parallel-size $TP\"").t, 2);
  EXPECT_EQ(plan("A=1 TP=4 env\nARGS=\"--tensor-model-parallel-size $TP\"").t, 4);
}

// Other launchers' flags: Megatron-FSDP's sharding strategy is the ZeRO stage (with the
// distributed optimizer that NVIDIA's FSDP launches also name), Megatron-DeepSpeed's
// --num-key-value-heads and --checkpoint-activations read as grouped-query attention and
// full recompute, --group-query-attention alone as Megatron's one group, and
// Megatron-DeepSpeed's MoE refused.
TEST(MegatronArgs, FsdpAndMegatronDeepSpeedFlags) {
  const std::string model = "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                            "--vocab-size 32768 --micro-batch-size 1 --global-batch-size 8 --bf16 ";
  auto in = [&](const std::string& flags) { return launch_inputs(parse_megatron_launch(model + flags, "launch"), 8, "launch"); };
  EXPECT_EQ(in("--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads_params").plan.zero, 3);
  EXPECT_EQ(in("--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads").plan.zero, 2);
  EXPECT_EQ(in("--use-megatron-fsdp --data-parallel-sharding-strategy optim").plan.zero, 1);
  EXPECT_EQ(in("--use-megatron-fsdp --use-distributed-optimizer").plan.zero, 3);
  EXPECT_EQ(in("--use-distributed-optimizer --data-parallel-sharding-strategy optim_grads_params").plan.zero, 1);
  EXPECT_NE(error_of(model + "--use-megatron-fsdp --data-parallel-sharding-strategy full", 8).find("--data-parallel-sharding-strategy"),
            std::string::npos);
  EXPECT_EQ(in("--num-key-value-heads 4").model.G, 4);
  EXPECT_EQ(in("--group-query-attention").model.G, 1);
  EXPECT_EQ(in("--checkpoint-activations").plan.recompute, Recompute::full);
  EXPECT_EQ(in("--checkpoint-activations").plan.recompute_layers, 0);  // (every layer)
  // FP8 parameters only with --fp8-param-gather (Megatron's default is off).
  EXPECT_EQ(in("--fp8-format hybrid --use-distributed-optimizer").plan.fp8_param_gather, Tristate::off);
  EXPECT_TRUE(in("--fp8-format hybrid --use-distributed-optimizer --fp8-param-gather").plan.fp8_weights());
  for (const char* ds : {"--expert-interval 2", "--topk 1", "--moe-expert-parallel-size 8"})
    EXPECT_NE(error_of(model + "--num-experts 8 " + ds, 8).find("Megatron-DeepSpeed's MoE"), std::string::npos) << ds;
}

TEST(MegatronArgs, ErrorsNameTheFlag) {
  const std::string model = "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 ";
  EXPECT_NE(error_of(model + "--vocab-size 100 --tensor-model-parallel-size $TP", 8).find("--tensor-model-parallel-size $TP"),
            std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --micro-batch-size 1 --micro-batch-size 2", 8).find("--micro-batch-size given twice"),
            std::string::npos);
  EXPECT_EQ(error_of(model + "--vocab-size 100 --micro-batch-size 2 --micro-batch-size 2", 8), "no error");
  EXPECT_NE(error_of(model, 8).find("--vocab-size"), std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 8)
                .find("--num-layers-per-virtual-pipeline-stage"),
            std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --tensor-model-parallel-size 4", 6).find("--gpus"), std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --attention-backend magic", 8).find("--attention-backend"), std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --num-experts 8 --moe-router-topk 9", 8).find("moe_router_topk"),
            std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --bf16 --fp16", 8).find("fp16"), std::string::npos);
  EXPECT_NE(error_of("--vocab-size 100 --hidden-size 64", 8).find("num_layers"), std::string::npos);
  // Sizes past any machine are refused, not multiplied.
  EXPECT_NE(error_of(model + "--vocab-size 100 --tensor-model-parallel-size 4294967296 "
                             "--pipeline-model-parallel-size 4294967296", 8)
                .find("--tensor-model-parallel-size"),
            std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --nproc-per-node 99999999999 --nnodes 99999999999").find("--n"),
            std::string::npos);
  // Two ways of an uneven split at once, a layout that does not parse, and a variable set
  // to two values.
  EXPECT_NE(error_of(model + "--vocab-size 100 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 "
                             "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 8)
                .find("--decoder-first-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split"),
            std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*4|t*4x'", 8)
                .find("pipeline_model_parallel_layout"),
            std::string::npos);
  EXPECT_NE(error_of("if x; then TP=2; else TP=4; fi\n" + model + "--vocab-size 100 --tensor-model-parallel-size $TP", 8)
                .find("--tensor-model-parallel-size $TP"),
            std::string::npos);
  EXPECT_NE(error_of(model + "--vocab-size 100 --pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split", 8)
                .find("--account-for-loss-in-pipeline-split"),
            std::string::npos);
}


// An absent flag means what it means to Megatron-LM (arguments.py, TransformerConfig): no
// overlapped gradient reduction or parameter gather, MoE tokens dispatched by all-gather;
// Megatron's aliases and asserts; flags that change the layers refused; those that change
// time or memory but are not modelled each named (a helper's audit of Megatron-LM d98e8a6's
// arguments, 2026-12-07).
TEST(MegatronArgs, AbsentFlagsAndMegatronsRules) {
  const Plan plain = small_launch_plan("--bf16 --use-distributed-optimizer");
  EXPECT_EQ(plain.overlap_grad_reduce, Tristate::off);
  EXPECT_EQ(plain.overlap_param_gather, Tristate::off);
  EXPECT_EQ(plain.cross_entropy_loss_fusion, Tristate::off);  // Megatron-LM's unfused loss unless given
  EXPECT_EQ(small_launch_plan("--bf16 --cross-entropy-loss-fusion").cross_entropy_loss_fusion, Tristate::on);
  const Plan both = small_launch_plan("--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather");
  EXPECT_EQ(both.overlap_grad_reduce, Tristate::on);
  EXPECT_EQ(both.overlap_param_gather, Tristate::on);
  EXPECT_EQ(small_launch_plan("--num-experts 8 --moe-router-topk 2").moe_dispatcher, MoeDispatcher::allgather);
  EXPECT_EQ(small_launch_plan("--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall").moe_dispatcher,
            MoeDispatcher::alltoall);
  // --transformer-impl local: Megatron's own layers, unfused attention (unless a backend is named).
  EXPECT_EQ(small_launch_plan("--transformer-impl local").attention, AttentionChoice::unfused);
  EXPECT_EQ(small_launch_plan("--transformer-impl transformer_engine").attention, AttentionChoice::automatic);
  // --encoder-seq-length is --seq-length; YaRN costs as RoPE.
  auto model_of = [](const std::string& flags) {
    return launch_inputs(parse_megatron_launch("--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                                               "--max-position-embeddings 64 --vocab-size 100 --micro-batch-size 1 "
                                               "--global-batch-size 8 " + flags, "launch"),
                         8, "launch")
        .model;
  };
  EXPECT_EQ(model_of("--encoder-seq-length 16").S, 16);
  EXPECT_EQ(model_of("--seq-length 16 --position-embedding-type yarn").position, Position::rope);
  EXPECT_THROW(model_of("--seq-length 16 --encoder-seq-length 32"), InputError);
  // Refused: what changes the layers, what strata cannot cost, what Megatron asserts.
  for (const char* bad : {"--spec local_spec", "--yaml-cfg run.yaml", "--hybrid-override-pattern M*M*",
                          "--fp8-format hybrid --first-last-layers-bf16", "--optimizer sgd", "--attention-output-gate",
                          "--recompute-granularity full", "--recompute-granularity selective --recompute-method uniform",
                          "--recompute-granularity full --recompute-method uniform",
                          "--recompute-granularity selective --recompute-num-layers 2", "--bf16 --overlap-param-gather",
                          "--bf16 --use-distributed-optimizer --overlap-param-gather", "--transformer-impl fast",
                          "--fp8-format hybrid --disable-fp8-wgrad"}) {
    try {
      (void)small_launch_plan(bad);
      ADD_FAILURE() << bad << ": accepted";
    } catch (const InputError& e) {
      const std::string what = e.what();
      std::string flag = std::string(bad).substr(std::string(bad).rfind("--"));
      flag = flag.substr(0, flag.find(' '));
      EXPECT_NE(what.find(flag), std::string::npos) << what;
    }
  }
  EXPECT_EQ(small_launch_plan("--optimizer adam").zero, 0);
  EXPECT_EQ(small_launch_plan("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1").recompute,
            Recompute::full);
  // Megatron-FSDP overlaps what it shards itself: the reduction with optim_grads, the gather
  // too with optim_grads_params (its default).
  const Plan fsdp2 = small_launch_plan("--bf16 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads");
  EXPECT_EQ(fsdp2.overlap_grad_reduce, Tristate::on);
  EXPECT_EQ(fsdp2.overlap_param_gather, Tristate::off);
  const Plan fsdp3 = small_launch_plan("--bf16 --use-megatron-fsdp");
  EXPECT_EQ(fsdp3.overlap_grad_reduce, Tristate::on);
  EXPECT_EQ(fsdp3.overlap_param_gather, Tristate::on);
  // 2023's Megatron-LM: its own layers with FlashAttention; Megatron-DeepSpeed's name of it.
  EXPECT_EQ(small_launch_plan("--transformer-impl local --use-flash-attn").attention, AttentionChoice::flash);
  EXPECT_EQ(small_launch_plan("--use-flash-attn-v2").attention, AttentionChoice::flash);
  // Named on stderr, every one: 13 harmless flags first do not hide them.
  std::string text = "--num-layers 2 ";
  for (int i = 0; i < 13; ++i) text += fmt::format("--log-thing-{} ", i);
  const MegatronLaunch l = parse_megatron_launch(
      text + "--num-experts 8 --cuda-graph-impl local --fp8-recipe mxfp8 --no-bias-swiglu-fusion --manual-gc "
             "--disable-tp-comm-bulk-wgrad --moe-expert-capacity-factor 1.0",
      "launch");
  for (const char* f : {"--cuda-graph-impl", "--fp8-recipe", "--no-bias-swiglu-fusion", "--manual-gc",
                        "--disable-tp-comm-bulk-wgrad", "--moe-expert-capacity-factor 1.0 (tokens capped per expert; "
                                                        "costed dropless)"})
    EXPECT_NE(std::find(l.costly.begin(), l.costly.end(), std::string(f)), l.costly.end()) << f;
  // The FP8 strata costs (per-tensor current scaling) is no note.
  const MegatronLaunch tw = parse_megatron_launch("--num-layers 2 --fp8-format hybrid --fp8-recipe tensorwise", "launch");
  EXPECT_TRUE(tw.costly.empty() && tw.ignored.empty());
  // Without the flag Megatron runs delayed scaling: said.
  const MegatronLaunch dl = parse_megatron_launch("--num-layers 2 --fp8-format hybrid", "launch");
  ASSERT_EQ(dl.costly.size(), 1u);
  EXPECT_EQ(dl.costly[0].rfind("--fp8-recipe absent", 0), 0u);
  EXPECT_EQ(std::count_if(l.costly.begin(), l.costly.end(),
                          [](const std::string& s) { return s.rfind("--moe-grouped-gemm absent", 0) == 0; }),
            1);
  EXPECT_EQ(l.ignored.size(), 13u);
}

}  // namespace
}  // namespace strata
