// Exports; see export.h.
#include "planner/export.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

namespace strata {

namespace {

// A plan's layer split in the frameworks' terms (layout.h): its own (a layout or first/last
// counts), even, in (L + 2) / (p v) slots with the embedding and the loss in one each, or
// as even as possible, which they cannot say.
enum class SplitForm { own, even, slots, uneven };
SplitForm split_form(const ModelSpec& m, const Plan& p) {
  if (p.explicit_split()) return SplitForm::own;
  if (m.L % (p.p * p.v) == 0 || p.p == 1) return SplitForm::even;
  return (m.L + 2) % (p.p * p.v) == 0 ? SplitForm::slots : SplitForm::uneven;
}

// Megatron-core's (and Transformer Engine's) name of a context-parallel exchange:
// "all_gather", where strata's plan says allgather.
const char* megatron_cp_comm(CpComm c) { return c == CpComm::allgather ? "all_gather" : to_string(c); }

}  // namespace

std::string export_megatron(const ModelSpec& m, const Plan& p, const Stack& stack) {
  std::string notes, f;
  auto flag = [&](const std::string& s) { f += (f.empty() ? "" : " \\\n    ") + s; };
  flag(fmt::format("--tensor-model-parallel-size {}", p.t));
  flag(fmt::format("--pipeline-model-parallel-size {}", p.p));
  const SplitForm form = split_form(m, p);
  const bool own = form == SplitForm::own, slots = form == SplitForm::slots;
  if (p.layout) {
    flag(fmt::format("--pipeline-model-parallel-layout \"{}\"", p.layout->text));  // it gives the chunks
  } else if (own) {
    if (p.first_stage_layers > 0) flag(fmt::format("--decoder-first-pipeline-num-layers {}", p.first_stage_layers));
    if (p.last_stage_layers > 0) flag(fmt::format("--decoder-last-pipeline-num-layers {}", p.last_stage_layers));
    if (p.v > 1) flag(fmt::format("--num-virtual-stages-per-pipeline-rank {}", p.v));
  } else if (p.v > 1) {
    flag(fmt::format("--num-layers-per-virtual-pipeline-stage {}", (slots ? m.L + 2 : m.L) / (p.p * p.v)));
  }
  if (p.v > 1 && p.vp_group_size() != p.p)
    flag(fmt::format("--microbatch-group-size-per-virtual-pipeline-stage {}", p.vp_group_size()));
  if (slots) {
    flag("--account-for-embedding-in-pipeline-split");
    flag("--account-for-loss-in-pipeline-split");
  } else if (form == SplitForm::uneven) {
    notes += fmt::format("# {} layers do not split evenly over {} stages: strata assumed the extra layers on the middle\n"
                         "# stages; give Megatron the same split with --decoder-first/last-pipeline-num-layers.\n",
                         m.L, p.p);
  }
  if (p.c > 1) {
    flag(fmt::format("--context-parallel-size {}", p.c));
    flag(fmt::format("--cp-comm-type {}", megatron_cp_comm(resolve_cp_comm(m, p))));
  }
  flag(fmt::format("--micro-batch-size {}", p.mbs));
  flag(fmt::format("--global-batch-size {}", p.gbs));
  if (p.sp) flag("--sequence-parallel");
  if (p.zero >= 1) flag("--use-distributed-optimizer");
  // ZeRO-2 and -3: Megatron-FSDP, with the flags NVIDIA's Megatron-FSDP guide requires (the
  // distributed optimizer, no fused gradient accumulation, its checkpoint format); torch
  // FSDP2's path (--use-torch-fsdp2) refuses tied embeddings, fp16 and fused accumulation.
  const bool fsdp = p.zero >= 2;
  if (fsdp) {
    flag("--use-megatron-fsdp");
    flag(p.zero == 2 ? "--data-parallel-sharding-strategy optim_grads" : "--data-parallel-sharding-strategy optim_grads_params");
    flag("--ckpt-format fsdp_dtensor");
    notes += fmt::format("# zero_stage={}: Megatron-FSDP ({}){}.\n", p.zero,
                         p.zero == 2 ? "gradients and optimizer states sharded" : "parameters, gradients and optimizer states sharded",
                         p.dp_instances > 1 ? "; its instances shard within and replicate across" : "");
    if (stack.grad_accumulation_fusion)
      notes += "# Megatron-FSDP fuses gradient accumulation (as strata costed it) with Transformer Engine >= 2.10; with an\n"
               "# older one add --no-gradient-accumulation-fusion (strata's grad_accumulation_fusion=0).\n";
    if (!stack.modern && !stack.strata)  // (the search kept the plain plan's legacy stack)
      notes += "# strata costed this plan on the legacy software stack (unfused attention and loss, DeepSpeed-style\n"
               "# buffers), as DeepSpeed runs ZeRO-2/3; Megatron-FSDP runs Megatron-core's, which\n"
               "# software_stack=modern costs.\n";
  }
  if (p.offload > 0) {
    flag("--optimizer-cpu-offload");
    if (p.offload < 1) flag(fmt::format("--optimizer-offload-fraction {}", p.offload));
    notes += "# optimizer offload: strata costed the copies and the CPU step one after the other; Megatron-core's\n"
             "# --overlap-cpu-optimizer-d2h-h2d may hide part of them.\n";
  }
  if (p.recompute == Recompute::full && p.recompute_layers > 0) {
    flag("--recompute-granularity full");
    flag("--recompute-method block");
    flag(fmt::format("--recompute-num-layers {}", p.recompute_layers));
  } else if (p.recompute == Recompute::full) {
    flag("--recompute-granularity full");
    flag("--recompute-method uniform");
    flag("--recompute-num-layers 1");
  } else if (p.recompute == Recompute::selective) {
    flag("--recompute-granularity selective");
    if (p.op_sac())
      notes += "# selective_ac_option=op is torchtitan's op-level recompute, which Megatron-LM has no flag for: given as\n"
               "# selective recompute of the attention core, which keeps more and recomputes less than strata costed.\n";
    if (p.recompute_modules != kRecomputeCoreAttn)
      flag("--recompute-modules " + recompute_modules_text(p.recompute_modules, " "));
  }
  switch (p.precision) {
    case Precision::bf16: flag("--bf16"); break;
    case Precision::fp16: flag("--fp16"); break;
    case Precision::fp8:  // current (per-tensor) scaling, as the Bridge export's recipe
      flag("--bf16");
      flag("--fp8-format hybrid");
      flag("--fp8-recipe tensorwise");
      if (p.fp8_weights()) flag("--fp8-param-gather");  // (Megatron: only with sharded parameters' gathers)
      break;
    case Precision::fp32: break;
  }
  // (said also where nothing is replicated: an MoE plan's experts may still reduce, and a
  // launch without the flags is read as Megatron runs it, without the overlap)
  if (stack.overlap_grad_reduce) flag("--overlap-grad-reduce");
  if (stack.overlap_grad_reduce && stack.overlap_param_gather && p.zero >= 1) flag("--overlap-param-gather");
  // Megatron's user buffers where the plan runs them ("auto" or asked for, with sequence
  // parallelism, which Megatron asserts, and the group in a node); on a legacy stack as asked.
  if (stack.userbuffers || (!stack.modern && p.tp_comm_overlap == Tristate::on && p.sp && p.t > 1))
    flag("--tp-comm-overlap");
  if (!stack.grad_accumulation_fusion) flag("--no-gradient-accumulation-fusion");
  if (stack.cross_entropy_fusion) flag("--cross-entropy-loss-fusion");  // (off in Megatron-LM unless given)
  // Megatron-LM runs --optimizer-cpu-offload only with the precision-aware optimizer.
  if (p.offload > 0 && !p.precision_aware_optimizer) {
    flag("--use-precision-aware-optimizer");
    notes += "# --optimizer-cpu-offload needs --use-precision-aware-optimizer in Megatron-LM; strata costed this plan "
             "without it (use_precision_aware_optimizer=1 in the plan costs it with it).\n";
  }
  if (p.precision_aware_optimizer) {
    flag("--use-precision-aware-optimizer");
    if (p.exp_avg_dtype != OptDtype::fp32) flag(fmt::format("--exp-avg-dtype {}", to_string(p.exp_avg_dtype)));
    if (p.exp_avg_sq_dtype != OptDtype::fp32) flag(fmt::format("--exp-avg-sq-dtype {}", to_string(p.exp_avg_sq_dtype)));
    if (p.main_params_dtype != OptDtype::fp32) flag(fmt::format("--main-params-dtype {}", to_string(p.main_params_dtype)));
    if (!p.store_param_remainders)  // (Megatron-LM has no flag for it)
      notes += "# store_param_remainders=false: set OptimizerConfig.store_param_remainders = False (Megatron-LM has "
               "no flag for it).\n";
  }
  if (p.dp_instances > 1) flag(fmt::format("--num-distributed-optimizer-instances {}", p.dp_instances));
  if (p.offload_modules) {
    notes += "# fine-grained activation offloading: Megatron-LM asserts NVTE_CPU_OFFLOAD_V1=1 in the environment "
             "with Transformer Engine >= 2.10.\n";
    flag("--fine-grained-activation-offloading");
    flag("--offload-modules " + offload_modules_text(p.offload_modules, " "));
    if (p.activation_offload_fraction != 1.0)
      flag(fmt::format("--activation-offload-fraction {}", p.activation_offload_fraction));
    if (p.min_offloaded_tensor_size != kMinOffloadedTensorSize)
      flag(fmt::format("--min-offloaded-tensor-size {}", p.min_offloaded_tensor_size));
  }
  // Megatron-LM's main gradients: fp32 in bf16 training, fp16 in fp16 training, unless told.
  if (p.precision != Precision::fp32 && stack.grad_reduce_in_fp32 != (p.precision != Precision::fp16))
    flag(stack.grad_reduce_in_fp32 ? "--accumulate-allreduce-grads-in-fp32" : "--grad-reduce-in-bf16");
  flag(stack.attention == AttentionKernel::flash ? "--attention-backend flash" : "--attention-backend unfused");
  if (p.gpipe)
    notes += "# pipeline_schedule=gpipe: Megatron-LM runs 1F1B only; the flags below give its 1F1B schedule.\n";
  // The model.
  flag(fmt::format("--num-layers {}", m.L));
  flag(fmt::format("--hidden-size {}", m.H));
  flag(fmt::format("--num-attention-heads {}", m.A));
  if (m.G != m.A) {
    flag("--group-query-attention");
    flag(fmt::format("--num-query-groups {}", m.G));
  }
  if (m.G < p.t)
    notes += fmt::format("# num_query_groups={} < tensor_parallel={}: strata replicated each key/value group on {} ranks;\n"
                         "# Megatron-LM needs the groups divisible by --tensor-model-parallel-size.\n",
                         m.G, p.t, p.t / m.G);
  flag(fmt::format("--ffn-hidden-size {}", m.F));
  if (m.moe()) {
    flag(fmt::format("--num-experts {}", m.E));
    flag(fmt::format("--moe-router-topk {}", m.K));
    flag(fmt::format("--moe-ffn-hidden-size {}", m.Fe));
    if (m.Fs > 0) flag(fmt::format("--moe-shared-expert-intermediate-size {}", m.Fs));
    if (m.mixed()) flag(fmt::format("--moe-layer-freq \"{}\"", moe_layer_freq_text(m.moe_layer)));
    if (p.ep > 1) flag(fmt::format("--expert-model-parallel-size {}", p.ep));
    if (p.expert_tp() != p.t) flag(fmt::format("--expert-tensor-parallel-size {}", p.expert_tp()));
    if (m.moe_groups > 0) {
      flag(fmt::format("--moe-router-num-groups {}", m.moe_groups));
      flag(fmt::format("--moe-router-group-topk {}", m.moe_group_topk));
    }
    flag("--moe-grouped-gemm");
    if (p.moe_a2a_overlap) flag("--overlap-moe-expert-parallel-comm");
    if (p.delay_wgrad) flag("--delay-wgrad-compute");
    if (p.flex()) {
      flag("--moe-token-dispatcher-type flex");
      flag(fmt::format("--moe-flex-dispatcher-backend {}", to_string(p.moe_dispatcher)));
    } else {
      flag(fmt::format("--moe-token-dispatcher-type {}", to_string(p.moe_dispatcher)));
    }
    notes += "# mixture of experts: strata costed balanced routing (every expert the same tokens); an uneven\n"
             "# load makes the busiest expert's rank the slowest.\n";
  }
  if (m.mtp_layers > 0) flag(fmt::format("--mtp-num-layers {}", m.mtp_layers));
  if (m.mla()) {
    flag("--multi-latent-attention");
    flag("--qk-layernorm");  // (MLA's latent norms exist only with it)
    if (m.q_lora_rank > 0) flag(fmt::format("--q-lora-rank {}", m.q_lora_rank));
    flag(fmt::format("--kv-lora-rank {}", m.kv_lora_rank));
    flag(fmt::format("--qk-head-dim {}", m.qk_head_dim()));
    flag(fmt::format("--qk-pos-emb-head-dim {}", m.qk_pos_emb_head_dim));
    flag(fmt::format("--v-head-dim {}", m.v_head_dim));
  } else if (m.kv_channels > 0) {
    flag(fmt::format("--kv-channels {}", m.kv_channels));
  }
  flag(fmt::format("--seq-length {}", m.S));
  flag(fmt::format("--max-position-embeddings {}", m.S));
  if (m.activation == Activation::swiglu) flag("--swiglu");
  if (m.activation == Activation::squared_relu) flag("--squared-relu");
  if (m.activation == Activation::geglu) notes += "# geglu MLP: Megatron-LM needs a gated-GELU activation function (no flag).\n";
  if (m.normalization == Norm::rmsnorm) flag("--normalization RMSNorm");
  if (m.position == Position::rope) flag("--position-embedding-type rope");
  if (m.position == Position::alibi) notes += "# ALiBi positions: Megatron-LM has no flag for them.\n";
  if (m.position == Position::none) flag("--position-embedding-type none");
  if (m.windowed()) {
    flag(fmt::format("--window-size {},0", m.window_size));
    const int64_t full = m.L - m.window_layers;  // one full-attention layer after every N - 1 windowed
    if (full > 0 && m.L % full == 0) flag(fmt::format("--window-attn-skip-freq {}", m.L / full));
    else if (full > 0)
      notes += fmt::format("# sliding window on {} of {} layers: give --window-attn-skip-freq the pattern.\n",
                           m.window_layers, m.L);
  }
  if (!m.tie_embeddings) flag("--untie-embeddings-and-output-weights");
  if (!m.bias) flag("--disable-bias-linear");
  flag(fmt::format("--attention-dropout {}", m.attention_dropout));
  flag(fmt::format("--hidden-dropout {}", m.hidden_dropout));
  return fmt::format("# Megatron-LM flags for {} ({} GPUs: tp {} x pp {} x dp {} x cp {})\n{}{}\n", m.name,
                     p.world_size(), p.t, p.p, p.d, p.c, notes, f);
}

std::string export_deepspeed(const ModelSpec& m, const Plan& p, const Stack& stack) {
  Json j;
  j["train_batch_size"] = p.gbs;
  j["train_micro_batch_size_per_gpu"] = p.mbs;
  j["gradient_accumulation_steps"] = p.gbs / (p.mbs * p.d);
  j["gradient_clipping"] = 1.0;
  Json z = {{"stage", p.zero}, {"overlap_comm", stack.overlap_grad_reduce}, {"contiguous_gradients", true}};
  if (p.zero == 3) {
    z["stage3_prefetch_bucket_size"] = m.layer_params(p.t, p.ep, p.etp);
    z["stage3_param_persistence_threshold"] = 0;
    // Hybrid sharding: DeepSpeed's MiCS shards ZeRO-3 over groups of this many ranks.
    if (p.dp_instances > 1) z["mics_shard_size"] = p.shard_ranks();
  }
  if (p.offload > 0) {
    z["offload_optimizer"] = {{"device", "cpu"}, {"pin_memory", true}};
    // (DeepSpeed takes a ratio below 1 with ZeRO stage 3 only and refuses it with stages 1
    // and 2 (zero/config.py), which offload all of the states: not what strata costed, whose
    // fraction strata_parallel_layout records.)
    if (p.offload < 1 && p.zero == 3) z["offload_optimizer"]["ratio"] = p.offload;
  }
  j["zero_optimization"] = z;
  // The gradients' type as the plan says it (DeepSpeed's defaults vary by stage); its
  // optimizer sanity check refuses a type other than the model's without ZeRO, so there it
  // is recorded for the launcher only.
  const char* grad_type = stack.grad_reduce_in_fp32 ? "fp32" : p.precision == Precision::fp16 ? "fp16" : "bf16";
  if (p.zero >= 1) {  // (said even when the plan leaves it to "auto": DeepSpeed's ZeRO defaults to 16 bits)
    j["data_types"] = {{"grad_accum_dtype", grad_type}};
    j["communication_data_type"] = grad_type;
  }
  if (p.precision == Precision::bf16 || p.precision == Precision::fp8) j["bf16"] = {{"enabled", true}};
  if (p.precision == Precision::fp16)
    j["fp16"] = {{"enabled", true}, {"loss_scale", 0}, {"initial_scale_power", 16}, {"loss_scale_window", 1000},
                 {"hysteresis", 2}, {"min_loss_scale", 1}};
  if (p.recompute != Recompute::none)
    j["activation_checkpointing"] = {{"partition_activations", p.sp},
                                     {"contiguous_memory_optimization", false},
                                     {"number_checkpoints", m.L}};
  // DeepSpeed's config has no field for the model-parallel layout: Megatron-DeepSpeed takes
  // it on its command line. It is recorded here for the launcher.
  j["strata_parallel_layout"] = {{"tensor_model_parallel_size", p.t},
                                 {"pipeline_model_parallel_size", p.p},
                                 {"data_parallel_size", p.d},
                                 {"context_parallel_size", p.c},
                                 {"virtual_pipeline_stages", p.v},
                                 {"microbatch_group_size_per_vp_stage", p.v > 1 ? p.vp_group_size() : 0},

                                 {"sequence_parallel", p.sp},
                                 {"recompute", to_string(p.recompute)},
                                 {"precision", to_string(p.precision)}};
  Json& split = j["strata_parallel_layout"];  // an uneven pipeline, where the plan gives one
  if (p.c > 1) split["cp_comm_type"] = to_string(resolve_cp_comm(m, p));
  if (p.offload > 0) split["optimizer_offload_fraction"] = p.offload;  // (the ratio's intent, as costed)
  if (p.grad_reduce_in_fp32 != Tristate::automatic && p.zero == 0) split["grad_accum_dtype"] = grad_type;
  // Megatron-core's precision-aware optimizer has no DeepSpeed counterpart: the plan was
  // costed with it, so say so.
  if (p.precision_aware_optimizer)
    split["megatron_precision_aware_optimizer"] = {{"exp_avg_dtype", to_string(p.exp_avg_dtype)},
                                                   {"exp_avg_sq_dtype", to_string(p.exp_avg_sq_dtype)},
                                                   {"main_params_dtype", to_string(p.main_params_dtype)},
                                                   {"store_param_remainders", p.store_param_remainders}};
  // Nor has Transformer Engine's user-buffer overlap (Megatron's --tp-comm-overlap), which a
  // tensor-parallel plan on the modern stack is costed with by default: said.
  if (stack.userbuffers) split["megatron_tp_comm_overlap"] = true;
  // Nor has torchtitan's op-level selective recompute: costed with it, so said.
  if (p.op_sac()) split["torchtitan_selective_ac_option"] = "op";
  // Nor has Megatron-core's fine-grained activation offloading (DeepSpeed's activation
  // checkpointing moves checkpoints, not module activations): costed with it, so said.
  if (p.offload_modules)
    split["megatron_fine_grained_activation_offloading"] = {
        {"offload_modules", offload_modules_text(p.offload_modules, ",")},
        {"activation_offload_fraction", p.activation_offload_fraction},
        {"min_offloaded_tensor_size", p.min_offloaded_tensor_size}};
  // (DeepSpeed shards ZeRO-1/2 over every replica: instances recorded for the launcher.)
  if (p.dp_instances > 1 && p.zero < 3) split["num_distributed_optimizer_instances"] = p.dp_instances;
  if (p.ep > 1) split["expert_model_parallel_size"] = p.ep;
  if (m.moe() && p.expert_tp() != p.t) split["expert_tensor_parallel_size"] = p.expert_tp();
  if (m.mixed()) split["moe_layer_freq"] = moe_layer_freq_text(m.moe_layer);
  // (DeepSpeed has no multi-token prediction; costed with it, so said)
  if (m.mtp_layers > 0) split["megatron_mtp_num_layers"] = m.mtp_layers;
  if (p.layout) split["pipeline_model_parallel_layout"] = p.layout->text;
  if (p.first_stage_layers > 0) split["decoder_first_pipeline_num_layers"] = p.first_stage_layers;
  if (p.last_stage_layers > 0) split["decoder_last_pipeline_num_layers"] = p.last_stage_layers;
  return j.dump(2) + "\n";
}

std::string export_bridge(const ModelSpec& m, const Plan& p, const Stack& stack) {
  // Three parts: Hydra overrides (KEY=VALUE, what Bridge's override parser reaches), Python
  // for what it cannot (fields of a named mixed_precision recipe, a comm_overlap config the
  // recipe may leave None, enum fields), and notes. Every setting a recipe may hold that
  // changes what was costed is said, at its default too, so that a recipe's own value
  // (its pipeline split, recompute, expert sizes, Megatron-FSDP) cannot survive the
  // overrides unnoticed.
  std::string notes, python, f;
  auto line = [&](const std::string& text) { f += (f.empty() ? "" : " \\\n") + text; };
  // Bridge's Llama 2/3 recipes build their model as a GPTModelConfig, which holds the
  // TransformerConfig fields under model.transformer (its other keys, seq_length among
  // them, stay at model.*); the other families' providers are TransformerConfigs.
  std::string lower = m.name;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
  const bool gpt_model_config = lower.find("llama4") == std::string::npos && lower.find("llama-4") == std::string::npos &&
                                (lower.find("llama2") != std::string::npos || lower.find("llama-2") != std::string::npos ||
                                 lower.find("llama3") != std::string::npos || lower.find("llama-3") != std::string::npos);
  auto set = [&](const std::string& key, const std::string& value) {
    const bool nested = gpt_model_config && key.rfind("model.", 0) == 0 && key != "model.seq_length";
    line((nested ? "model.transformer." + key.substr(6) : key) + "=" + value);
  };
  auto py = [&](const std::string& text) { python += "#   " + text + "\n"; };
  auto num = [](int64_t x) { return fmt::format("{}", x); };
  auto yes = [](bool b) { return std::string(b ? "true" : "false"); };
  auto py_bool = [](bool b) { return std::string(b ? "True" : "False"); };
  set("model.tensor_model_parallel_size", num(p.t));
  set("model.pipeline_model_parallel_size", num(p.p));
  // Bridge counts virtual stages per rank (Megatron-LM's --num-virtual-stages-per-pipeline-rank),
  // not layers per virtual stage; null is one chunk.
  set("model.virtual_pipeline_model_parallel_size", p.v > 1 ? num(p.v) : "null");
  set("model.context_parallel_size", num(p.c));
  if (p.c > 1) set("model.cp_comm_type", megatron_cp_comm(resolve_cp_comm(m, p)));
  set("model.sequence_parallel", yes(p.sp));
  // The split, all five of its settings: a recipe's layout (which Bridge's runner rebuilds
  // when the pipeline size changes), first/last-stage counts or account_for_* would
  // otherwise stay beside strata's, and Megatron-core refuses a layout with either.
  const SplitForm form = split_form(m, p);
  if (p.layout) {
    // Quoted for Hydra's override parser ('|', '(' and ',' are its syntax), and the whole
    // override again for the shell, as Bridge's own examples quote theirs.
    line(std::string("\"model.") + (gpt_model_config ? "transformer." : "") + "pipeline_model_parallel_layout='" +
         p.layout->text + "'\"");
  } else {
    set("model.pipeline_model_parallel_layout", "null");
  }
  const bool own = !p.layout && form == SplitForm::own;
  set("model.num_layers_in_first_pipeline_stage", own && p.first_stage_layers > 0 ? num(p.first_stage_layers) : "null");
  set("model.num_layers_in_last_pipeline_stage", own && p.last_stage_layers > 0 ? num(p.last_stage_layers) : "null");
  const bool slots = !p.layout && form == SplitForm::slots;
  set("model.account_for_embedding_in_pipeline_split", yes(slots));
  set("model.account_for_loss_in_pipeline_split", yes(slots));
  if (!p.layout && form == SplitForm::uneven)
    notes += fmt::format("# {} layers do not split evenly over {} stages: strata assumed the extra layers on the middle\n"
                         "# stages; give Bridge the same split with model.num_layers_in_first/last_pipeline_stage.\n",
                         m.L, p.p);
  if (p.v > 1 && p.vp_group_size() != p.p) set("model.microbatch_group_size_per_vp_stage", num(p.vp_group_size()));
  set("train.micro_batch_size", num(p.mbs));
  set("train.global_batch_size", num(p.gbs));
  set("dataset.seq_length", num(m.S));  // run_recipe.py sets the model's from it; a ConfigContainer needs both
  set("model.seq_length", num(m.S));
  if (m.moe()) {  // (said at 1 and at tp too: recipes hard-set both)
    set("model.expert_model_parallel_size", num(p.ep));
    set("model.expert_tensor_parallel_size", num(p.expert_tp()));
  }
  // Multi-token prediction as costed; null where none (Bridge's DeepSeek and GLM recipes
  // turn it on from their models' configs).
  if (m.mtp_layers > 0 || m.moe()) set("model.mtp_num_layers", m.mtp_layers > 0 ? num(m.mtp_layers) : "null");
  // CommOverlapConfig: a recipe may leave it None, where an override of one of its fields
  // fails, so it is set in Python; it also derives ddp's overlap settings (from a data-
  // parallel size without context parallelism), so those are given to it as costed.
  std::vector<std::string> overlap;
  if (p.t > 1) overlap.push_back("tp_comm_overlap = " + py_bool(stack.userbuffers));
  if (m.moe()) {
    // (Bridge's recipes name a flex backend and let apply_flex_dispatcher_backend switch to it.)
    set("model.moe_token_dispatcher_type", p.flex() ? "flex" : to_string(p.moe_dispatcher));
    if (p.flex()) set("model.moe_flex_dispatcher_backend", to_string(p.moe_dispatcher));
    overlap.push_back("overlap_moe_expert_parallel_comm = " + py_bool(p.moe_a2a_overlap));
    if (p.moe_a2a_overlap) overlap.push_back("delay_wgrad_compute = " + py_bool(p.delay_wgrad));
    // The shared expert beside the dispatch is not modelled (Bridge asserts it off with the
    // overlap, Megatron-core with the all-gather dispatcher; the DeepSeek and GLM recipes set
    // it on): off, said.
    if (m.Fs > 0) set("model.moe_shared_expert_overlap", "false");
  }
  // ZeRO: the distributed optimizer shards the optimizer states (1); Megatron-FSDP shards
  // gradients too (2) and the parameters (3). Bridge turns Megatron-FSDP on where either of
  // its two settings is, so both are said either way.
  set("ddp.use_distributed_optimizer", yes(p.zero >= 1));
  set("optimizer.use_distributed_optimizer", yes(p.zero >= 1));
  set("ddp.use_megatron_fsdp", yes(p.zero >= 2));
  set("dist.use_megatron_fsdp", yes(p.zero >= 2));
  if (p.zero >= 2) {
    set("ddp.data_parallel_sharding_strategy", p.zero == 2 ? "optim_grads" : "optim_grads_params");
    set("checkpoint.ckpt_format", "fsdp_dtensor");  // (Bridge's validate() requires it with Megatron-FSDP)
  }
  if (p.offload > 0) {
    set("optimizer.optimizer_cpu_offload", "true");
    set("optimizer.optimizer_offload_fraction", fmt::format("{}", p.offload));
  }
  // Recompute: all four settings, so that a recipe's method, layer count or modules cannot
  // stay beside another granularity (Megatron-core refuses a layer count with selective, and
  // a method, a count or moe with the experts' overlapped exchanges).
  if (p.recompute == Recompute::full) {
    set("model.recompute_granularity", "full");
    set("model.recompute_method", p.recompute_layers > 0 ? "block" : "uniform");
    set("model.recompute_num_layers", num(p.recompute_layers > 0 ? p.recompute_layers : 1));
    set("model.recompute_modules", "null");
  } else {
    set("model.recompute_granularity", p.recompute == Recompute::selective ? "selective" : "null");
    set("model.recompute_method", "null");
    set("model.recompute_num_layers", "null");
    set("model.recompute_modules", p.recompute == Recompute::selective
                                       ? fmt::format("[{}]", recompute_modules_text(p.recompute_modules, ","))
                                       : std::string("null"));
    if (p.op_sac())
      notes += "# selective_ac_option=op is torchtitan's op-level recompute, which Megatron-core has no setting for:\n"
               "# given as selective recompute of the attention core, which keeps more and recomputes less than strata costed.\n";
  }
  // The registered mixed-precision recipes (megatron.bridge.training.mixed_precision) and
  // what each sets that strata costs otherwise: the main gradients' type (bf16_mixed and the
  // FP8 recipe built on it reduce in fp32, fp16_mixed in fp16), the FP8 recipe's gathered
  // FP8 weights and its first and last layers in bf16 (strata costs every layer in FP8).
  const char* recipe = nullptr;
  bool recipe_fp32_reduce = true;
  switch (p.precision) {
    case Precision::bf16: recipe = "bf16_mixed"; break;
    case Precision::fp16: recipe = "fp16_mixed"; recipe_fp32_reduce = false; break;
    case Precision::fp8: recipe = "bf16_with_fp8_current_scaling_mixed"; break;
    case Precision::fp32:
      set("mixed_precision", "null");
      notes += "# fp32: a recipe's model provider may still set bf16 or params_dtype; set them to fp32 as well.\n";
      break;
  }
  std::vector<std::string> precision;
  if (recipe) {
    if (stack.grad_reduce_in_fp32 != recipe_fp32_reduce)
      precision.push_back("grad_reduce_in_fp32 = " + py_bool(stack.grad_reduce_in_fp32));
    if (p.precision == Precision::fp8) {
      precision.push_back("first_last_layers_bf16 = False");
      if (!p.fp8_weights()) precision.push_back("fp8_param_gather = False");  // (bf16 weights, as costed)
    }
  }
  const bool overlap_reduce = stack.overlap_grad_reduce;
  const bool overlap_gather = stack.overlap_param_gather && p.zero >= 1;
  set("ddp.overlap_grad_reduce", yes(overlap_reduce));
  set("ddp.overlap_param_gather", yes(overlap_gather));
  set("model.gradient_accumulation_fusion", yes(stack.grad_accumulation_fusion));
  set("model.cross_entropy_loss_fusion", yes(stack.cross_entropy_fusion));
  // The optimizer's tensor types, fp32 without the precision-aware optimizer (Megatron-core
  // asserts it there; some recipes, DeepSeek-V3's, hold bf16 ones); Bridge turns the names
  // into torch dtypes.
  set("optimizer.use_precision_aware_optimizer", yes(p.precision_aware_optimizer));
  const bool pa = p.precision_aware_optimizer;
  set("optimizer.main_grads_dtype", "fp32");
  set("optimizer.main_params_dtype", pa ? to_string(p.main_params_dtype) : "fp32");
  set("optimizer.exp_avg_dtype", pa ? to_string(p.exp_avg_dtype) : "fp32");
  set("optimizer.exp_avg_sq_dtype", pa ? to_string(p.exp_avg_sq_dtype) : "fp32");
  if (pa) set("optimizer.store_param_remainders", yes(p.store_param_remainders));
  if (p.dp_instances > 1) set("ddp.num_distributed_optimizer_instances", num(p.dp_instances));
  if (p.offload_modules) {
    notes += "# fine-grained activation offloading: set NVTE_CPU_OFFLOAD_V1=1 in the job's environment (Megatron-LM "
             "asserts it with Transformer Engine >= 2.10).\n";
    set("model.fine_grained_activation_offloading", "true");
    set("model.offload_modules", fmt::format("[{}]", offload_modules_text(p.offload_modules, ",")));
    if (p.activation_offload_fraction != 1.0)
      set("model.activation_offload_fraction", fmt::format("{}", p.activation_offload_fraction));
    if (p.min_offloaded_tensor_size != kMinOffloadedTensorSize)
      set("model.min_offloaded_tensor_size", num(p.min_offloaded_tensor_size));
  }
  // strata's fused attention is any fused kernel (FlashAttention or cuDNN's), which the
  // recipes' default backend picks; unfused is an enum an override cannot give.
  if (stack.attention != AttentionKernel::flash) {
    py("from megatron.core.transformer.enums import AttnBackend");
    py("cfg.model.attention_backend = AttnBackend.unfused  # (or NVTE_FLASH_ATTN=0 NVTE_FUSED_ATTN=0)");
  }
  // An override of mixed_precision replaces the object the Python tuned with the named
  // recipe again: given as an override only where nothing is tuned.
  if (recipe && precision.empty()) set("mixed_precision", recipe);
  if (!precision.empty()) {
    py("from megatron.bridge.training.mixed_precision import get_mixed_precision_config");
    py(fmt::format("cfg.mixed_precision = get_mixed_precision_config(\"{}\")", recipe));
    for (const std::string& s : precision) py("cfg.mixed_precision." + s);
  }
  {  // (a recipe's CommOverlapConfig derives ddp's overlaps again unless told: said always)
    py("from megatron.bridge.training.comm_overlap import CommOverlapConfig");
    py("cfg.comm_overlap = cfg.comm_overlap or CommOverlapConfig(tp_comm_overlap=False)");
    for (const std::string& s : overlap) py("cfg.comm_overlap." + s);
    py("cfg.comm_overlap.overlap_grad_reduce = " + py_bool(overlap_reduce));
    py("cfg.comm_overlap.overlap_param_gather = " + py_bool(overlap_gather));
  }
  if (p.gpipe) notes += "# pipeline_schedule=gpipe: Megatron-core runs 1F1B only; these give its 1F1B schedule.\n";
  // The model's shape, so that the chosen recipe's can be checked (or a neighbour's reused).
  set("model.num_layers", num(m.L));
  set("model.hidden_size", num(m.H));
  set("model.ffn_hidden_size", num(m.F));
  set("model.num_attention_heads", num(m.A));
  set("model.num_query_groups", num(m.G));
  if (m.mla()) {  // (Bridge's DeepSeek providers set multi_latent_attention and qk_layernorm)
    set("model.q_lora_rank", m.q_lora_rank > 0 ? num(m.q_lora_rank) : std::string("null"));
    set("model.kv_lora_rank", num(m.kv_lora_rank));
    set("model.qk_head_dim", num(m.qk_head_dim()));
    set("model.qk_pos_emb_head_dim", num(m.qk_pos_emb_head_dim));
    set("model.v_head_dim", num(m.v_head_dim));
  } else if (m.kv_channels > 0) {
    set("model.kv_channels", num(m.kv_channels));
  }
  if (m.mixed()) {  // Bridge's providers take the list (first_k_dense_replace's, DeepSeek's and GLM's)
    std::string list = "[";
    for (size_t i = 0; i < m.moe_layer.size(); ++i) {
      if (i) list += ',';
      list += m.moe_layer[i] ? '1' : '0';
    }
    set("model.moe_layer_freq", list + "]");
  }
  if (m.G < p.t)
    notes += fmt::format("# num_query_groups={} < tensor_parallel={}: strata replicated each key/value group on {} ranks;\n"
                         "# Megatron-core needs the groups divisible by the tensor-parallel size.\n",
                         m.G, p.t, p.t / m.G);
  set("model.attention_dropout", fmt::format("{}", m.attention_dropout));
  set("model.hidden_dropout", fmt::format("{}", m.hidden_dropout));
  // What a recipe fixes by its model provider rather than a plain value.
  notes += fmt::format("# the recipe's model family sets the rest: {} MLP, {}, {} positions, {} embeddings{}.\n",
                       to_string(m.activation), m.normalization == Norm::rmsnorm ? "RMSNorm" : "LayerNorm",
                       m.position == Position::rope      ? "rotary"
                       : m.position == Position::alibi   ? "ALiBi"
                       : m.position == Position::learned ? "learned"
                                                         : "no",
                       m.tie_embeddings ? "tied" : "untied", m.bias ? ", linear biases" : "");
  python = "# and in Python on the recipe's ConfigContainer cfg (in the recipe function, or after the overrides,\n"
           "# which leave these alone), what overrides cannot reach (the fields of a named mixed_precision recipe,\n"
           "# a comm_overlap the recipe may leave None, enums):\n" +
           python;
  return fmt::format("# Megatron-Bridge overrides for {} ({} GPUs: tp {} x pp {} x dp {} x cp {}): append them to\n"
                     "# scripts/training/train.sh --recipe <the model's pretrain recipe> (or run_recipe.py), or set\n"
                     "# cfg.<key> = <value> on the recipe's ConfigContainer.{}\n"
                     "{}{}{}\n",
                     m.name, p.world_size(), p.t, p.p, p.d, p.c,
                     gpt_model_config
                         ? "\n# A Llama 2/3 recipe builds its model as a GPTModelConfig: its TransformerConfig fields "
                           "are\n# model.transformer.* (model.seq_length stays model.*)."
                         : "\n# (Bridge's Llama 2/3 recipes build their model as a GPTModelConfig: for one of those, "
                           "write\n# model.transformer.<key> for each model.<key> but model.seq_length.)",
                     notes, python, f);
}

}  // namespace strata
