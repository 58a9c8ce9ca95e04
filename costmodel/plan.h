// Plan: one parallel training strategy (SPEC.md "Plan JSON"), read from JSON or from
// inline key=value pairs, normalised (long names, derived defaults) and checked against a
// model and a cluster. A plan that cannot run yields reasons (data), never an exception;
// only malformed input (unknown key, wrong type) throws InputError.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "costmodel/hardware.h"
#include "costmodel/json_input.h"
#include "costmodel/model_spec.h"

namespace strata {

enum class Recompute { none, selective, full };
enum class ScheduleKind { gpipe, one_f_one_b, interleaved };
enum class AttentionChoice { automatic, unfused, flash };
// The software stack a plan is costed on (stack.h); "auto" follows the cluster, model and plan.
enum class StackChoice { automatic, legacy, modern };
// A setting whose default comes from the software stack (resolve_stack).
enum class Tristate { automatic, off, on };
// How context parallelism moves keys and values (Megatron-LM's --cp-comm-type, Transformer
// Engine's implementations): p2p passes K and V round a ring of the context-parallel ranks
// behind the attention core; allgather gathers them before it (and reduce-scatters their
// gradients); a2a (DeepSpeed-Ulysses) trades the sequence split for a head split with
// all-to-alls of Q, K, V and the output. "auto": p2p, or with a sliding window (which the
// ring does not run) a2a where the heads allow it, else allgather, as Megatron-Bridge sets
// it for Mistral; the strata executor always gathers (allgather).
enum class CpComm { automatic, p2p, a2a, allgather };
// Megatron-core's token dispatcher of the MoE layers (moe_token_dispatcher_type):
// alltoall (what strata costs unless told), allgather (Megatron-LM's default), or flex
// with its backend (moe_flex_dispatcher_backend deepep or hybridep; Megatron's older
// moe_enable_deepep).
enum class MoeDispatcher { alltoall, allgather, deepep, hybridep };

// An explicit split of the decoder layers over the pipeline's model chunks, Megatron-core's
// pipeline_model_parallel_layout: virtual stages separated by '|', 'E' the embedding, 't' a
// decoder layer, 'm' a multi-token prediction layer, 'L' the loss (output layer), "x*n" and
// "(...)*n" repeat, commas are cosmetic; "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL" is 40 virtual
// stages of 80 layers. Virtual stage k runs on stage k mod p as chunk k / p, so `layers` is
// in StageLayout's order (c*p + s). The 'm's follow every 't' in the virtual stage of 'L'
// (strata costs them with the loss; Megatron-core also lets them stand in a virtual stage
// of their own, which is refused).
struct PipelineLayout {
  std::string text;             // as given
  std::vector<int64_t> layers;  // decoder layers of each virtual stage
  int64_t mtp = 0;              // 'm's (ModelSpec::mtp_layers, check_plan compares)
};
// Parses a layout; malformed text (an unknown character, unbalanced or nested parentheses,
// 'E' not first or 'L' not last, each exactly once) throws InputError naming `field`.
PipelineLayout parse_pipeline_layout(const std::string& text, const std::string& field);

// Megatron-core's --recompute-modules, with recompute_granularity selective: the parts of
// a layer whose outputs are dropped after the forward and recomputed before the backward.
// core_attn is the attention core (selective recompute's default), layernorm the two norms'
// outputs (the QKV and MLP inputs), moe_act the experts' activation function (their fc2
// input), mla_up_proj multi-latent attention's up projections and RoPE (the queries, keys
// and values they make, kept by the core, dropped and made again from the latents), mlp a
// dense layer's MLP (fc1 and its activation's outputs; only its input kept). Megatron's
// other modules (moe, shared_experts) are refused.
enum RecomputeModule : unsigned {
  kRecomputeCoreAttn = 1u,
  kRecomputeLayernorm = 2u,
  kRecomputeMoeAct = 4u,
  kRecomputeMlaUpProj = 8u,
  kRecomputeMlp = 16u
};

// Megatron-core's fine-grained activation offloading (--fine-grained-activation-offloading
// --offload-modules ...): the modules whose saved tensors go to the host's pinned memory
// after their forward (copied on a stream of their own beside the compute) and come back
// before their backward. attn_norm and mlp_norm are the norms where they are modules of
// their own (Transformer Engine fuses a dense layer's into the next linear layer:
// Megatron skips them there); qkv_linear the QKV layer's saved inputs (with the fused
// norm, the norm's input too); core_attn Q, K, V and the core's own; attn_proj the
// projection's input (the core's output, which core_attn's backward needs as well:
// Megatron takes it only with core_attn); expert_fc1 the experts' token copies, moe_act
// their fc1 output. (fused_group_mlp, Transformer Engine's op fuser's, is refused.)
enum OffloadModule : unsigned {
  kOffloadAttnNorm = 1u,
  kOffloadQkvLinear = 2u,
  kOffloadCoreAttn = 4u,
  kOffloadAttnProj = 8u,
  kOffloadMlpNorm = 16u,
  kOffloadExpertFc1 = 32u,
  kOffloadMoeAct = 64u,
};
// The modules inside the experts' MLP (a mixture-of-experts model's).
inline constexpr unsigned kOffloadExpertModules = kOffloadExpertFc1 | kOffloadMoeAct;
// Megatron-core's default min_offloaded_tensor_size: smaller tensors stay on the GPU.
inline constexpr int64_t kMinOffloadedTensorSize = int64_t{1} << 20;

// A type of the precision-aware optimizer's tensors, and its bytes per value.
enum class OptDtype : uint8_t { fp32, bf16, fp16, fp8 };
inline double bytes_of(OptDtype t) { return t == OptDtype::fp32 ? 4.0 : t == OptDtype::fp8 ? 1.0 : 2.0; }
const char* to_string(OptDtype t);

struct Plan {
  int64_t t = 1;  // tensor_parallel
  int64_t p = 1;  // pipeline_parallel
  int64_t d = 1;  // data_parallel
  int64_t c = 1;  // context_parallel
  int64_t v = 1;  // virtual_pipeline_stages (interleaved 1F1B when > 1)
  int64_t vp_group = 0;  // microbatch_group_size_per_vp_stage (interleaved); 0: p, or when the
                         // micro-batches are not a multiple of p the smallest group Megatron-core
                         // accepts (vp_group_size())
  int64_t mbs = 1;
  int64_t gbs = 0;  // 0: one micro-batch per data-parallel rank (mbs * d)
  int zero = 0;     // 0..3; Megatron's distributed optimizer is 1
  Recompute recompute = Recompute::none;
  unsigned recompute_modules = kRecomputeCoreAttn;  // with selective recompute (RecomputeModule bits)
  // torchtitan's selective_ac_option "op" in place of the modules, with selective recompute:
  // its op-level policy, which keeps the outputs of the fused attention and of the odd
  // (1st, 3rd, ...) matrix multiplications of each layer in forward order and recomputes
  // every other op (memory.cpp, compute.cpp: op_sac).
  bool selective_ac_op = false;
  int64_t recompute_layers = 0;  // recompute_num_layers: with full recompute, how many layers of
                                 // each model chunk are recomputed (Megatron's block method);
                                 // 0 = all of them
  bool sp = false;  // sequence_parallel
  Precision precision = Precision::bf16;
  // The plan named its precision (false: bf16 by default, which strata estimate turns into
  // fp16 on a GPU without bf16, as strata plan's default does).
  bool precision_given = false;
  bool gpipe = false;  // pipeline_schedule "gpipe"; otherwise 1F1B (interleaved when v > 1)
  // Extensions (Megatron-LM names); "auto" follows the software stack (resolve_stack).
  AttentionChoice attention = AttentionChoice::automatic;
  Tristate overlap_grad_reduce = Tristate::automatic;       // DP reduction beside the last backward
  Tristate overlap_param_gather = Tristate::automatic;      // ZeRO-1/2 parameter all-gather beside the next forward
  Tristate tp_comm_overlap = Tristate::automatic;           // TP collectives beside GEMMs (Stack::userbuffers)
  Tristate grad_accumulation_fusion = Tristate::automatic;  // wgrad GEMMs accumulate into fp32 main grads
  // Megatron-core's fused vocab-parallel cross-entropy (--cross-entropy-loss-fusion, off in
  // Megatron-LM unless given; on in the NeMo and Megatron-Bridge recipes): the loss in two
  // passes over the 16-bit logits, which keeps no fp32 copy (Stack::cross_entropy_fusion).
  Tristate cross_entropy_loss_fusion = Tristate::automatic;
  StackChoice software_stack = StackChoice::automatic;      // legacy | modern: the defaults of the five above
  CpComm cp_comm = CpComm::automatic;                       // cp_comm_type (context_parallel > 1)
  // The MoE layers' token dispatcher. flex (either backend: DeepEP, NVIDIA's HybridEP)
  // sends a token once to each node holding any of its experts and on to each GPU holding
  // them (the all-to-all dispatcher sends one copy per expert; the all-gather one gathers
  // every rank's tokens); compute_moe.cpp ep_exchange.
  MoeDispatcher moe_dispatcher = MoeDispatcher::alltoall;
  bool flex() const { return moe_dispatcher == MoeDispatcher::deepep || moe_dispatcher == MoeDispatcher::hybridep; }
  // overlap_moe_expert_parallel_comm (Megatron-Bridge's moe_a2a_overlap): the expert
  // exchanges of one micro-batch beside another's compute (compute_moe.cpp
  // overlap_expert_exchanges; the check_plan rule a2a_overlap holds Megatron's asserts).
  bool moe_a2a_overlap = false;
  // delay_wgrad_compute (with the overlap only; Megatron's default off): the experts' and the
  // attention block's weight gradients run after the input gradients that the next exchange
  // waits for, beside the exchanges (compute_moe.cpp overlap_expert_exchanges).
  bool delay_wgrad = false;
  // grad_reduce_in_fp32 (Megatron-core's DDP setting; Megatron-LM's --grad-reduce-in-bf16 and
  // --accumulate-allreduce-grads-in-fp32): the main gradients accumulated and reduced in
  // fp32, or (off) in the parameters' 16-bit type, bf16 with fp8. "auto": on, but off in
  // fp16 (Megatron's defaults); the strata executor keeps fp32 gradients.
  Tristate grad_reduce_in_fp32 = Tristate::automatic;
  // fp8_param_gather (Megatron's --fp8-param-gather): fp8 plans keep their parameters in fp8
  // (1 byte a weight) and gather them so; Megatron runs it only where parameters are sharded
  // (ZeRO 1-3). "auto": on with ZeRO (the NeMo and Megatron-Bridge fp8 recipes), off
  // without; off: bf16 weights (2 bytes) and bf16 gathers. A Megatron launch without the
  // flag is off (Megatron's default). Only fp8 plans may give it; on needs ZeRO.
  Tristate fp8_param_gather = Tristate::automatic;
  bool fp8_weights() const {
    return precision == Precision::fp8 && zero >= 1 && fp8_param_gather != Tristate::off;
  }
  // use_precision_aware_optimizer (Megatron-core's, with its distributed optimizer):
  // Transformer Engine's FusedAdam keeps the optimizer's tensors in the types below and
  // steps on the main gradients as they are (no fp32 copy): the Adam moments
  // (exp_avg_dtype, exp_avg_sq_dtype: fp32, bf16, fp16 or fp8) and the master weights
  // (main_params_dtype: fp32 or fp16), of which store_param_remainders keeps only the 16
  // bits a bf16 weight does not hold. Read only with it on.
  bool precision_aware_optimizer = false;
  OptDtype exp_avg_dtype = OptDtype::fp32, exp_avg_sq_dtype = OptDtype::fp32, main_params_dtype = OptDtype::fp32;
  bool store_param_remainders = true;
  // Uneven pipelines as Megatron-LM gives them (layout.h); unset: strata's own split.
  int64_t first_stage_layers = 0;  // decoder_first_pipeline_num_layers (0: not set)
  int64_t last_stage_layers = 0;   // decoder_last_pipeline_num_layers (0: not set)
  std::shared_ptr<const PipelineLayout> layout;  // pipeline_model_parallel_layout (null: not set)
  // optimizer_offload_fraction: the share of each rank's optimizer shard (fp32 master weights
  // and Adam moments) kept in the host's memory and stepped there by the CPU (Megatron-core's
  // --optimizer-cpu-offload / --optimizer-offload-fraction, DeepSpeed's ZeRO-Offload
  // "offload_optimizer": {"device": "cpu"}); needs zero_stage >= 1. 0: none.
  double offload = 0;
  // expert_model_parallel_size: a mixture-of-experts model's E experts split over ep ranks
  // of the data x context parallel ranks (Megatron-core's expert parallelism; experts keep
  // the tensor-parallel split, expert_tensor_parallel_size = tensor_parallel). 1: every rank
  // holds all experts; dense models need 1.
  int64_t ep = 1;
  // expert_tensor_parallel_size: the ranks each expert's matrices split over (Megatron-core's
  // MoE parallel folding: the experts' own layout, etp x ep dividing the tensor x data x
  // context parallel ranks). 0: tensor_parallel, Megatron's default.
  int64_t etp = 0;
  // num_distributed_optimizer_instances (Megatron-core's partial distributed optimizer;
  // hybrid sharding, HSDP, in PyTorch FSDP and torchtitan's data_parallel_replicate_degree;
  // DeepSpeed's MiCS as replicas / mics_shard_size): ZeRO shards over the replicas of one
  // instance, replicas() / instances consecutive data x context parallel ranks, and the
  // instances hold alike copies (their shards' gradients all-reduced between them). 1: one
  // shard group of every replica.
  int64_t dp_instances = 1;
  // Fine-grained activation offloading (OffloadModule bits; 0: none): Megatron-core's
  // offload_modules, with activation_offload_fraction (the share of each chunk's
  // (layer, module) groups offloaded, the first in forward order) and
  // min_offloaded_tensor_size (in elements).
  unsigned offload_modules = 0;
  double activation_offload_fraction = 1.0;
  int64_t min_offloaded_tensor_size = kMinOffloadedTensorSize;

  int64_t world_size() const { return t * p * d * c; }
  // The precision-aware optimizer and its types as `o` has them.
  void take_optimizer_of(const Plan& o) {
    precision_aware_optimizer = o.precision_aware_optimizer;
    exp_avg_dtype = o.exp_avg_dtype;
    exp_avg_sq_dtype = o.exp_avg_sq_dtype;
    main_params_dtype = o.main_params_dtype;
    store_param_remainders = o.store_param_remainders;
  }
  // Activation offloading as `o` has it (its offload_modules and their settings).
  void take_activation_offload_of(const Plan& o) {
    offload_modules = o.offload_modules;
    activation_offload_fraction = o.activation_offload_fraction;
    min_offloaded_tensor_size = o.min_offloaded_tensor_size;
  }
  // Selective recompute of a module (RecomputeModule).
  bool recomputes(unsigned module) const {
    return recompute == Recompute::selective && !selective_ac_op && (recompute_modules & module) != 0;
  }
  // torchtitan's op-level selective recompute (selective_ac_op).
  bool op_sac() const { return recompute == Recompute::selective && selective_ac_op; }
  bool explicit_split() const { return layout || first_stage_layers > 0 || last_stage_layers > 0; }
  // The same plan with nothing recomputed (what partial recompute's other layers run).
  Plan without_recompute() const {
    Plan q = *this;
    q.recompute = Recompute::none;
    q.recompute_layers = 0;
    return q;
  }
  // Layers of a chunk of `chunk_layers` that are recomputed in full.
  int64_t recomputed_layers(int64_t chunk_layers) const {
    if (recompute != Recompute::full) return 0;
    return recompute_layers == 0 || recompute_layers > chunk_layers ? chunk_layers : recompute_layers;
  }
  // Ranks holding the same parameters: data x context parallel (Megatron's data-parallel
  // group with context parallelism). Gradients are reduced and ZeRO shards across them.
  int64_t replicas() const { return d * c; }
  int64_t expert_tp() const { return etp > 0 ? etp : t; }
  // Ranks holding the same experts: the non-pipeline ranks over etp x ep (Megatron's expert
  // data-parallel group, ranks etp x ep apart). Expert gradients are reduced and ZeRO
  // shards across them.
  int64_t expert_replicas() const { return t * d * c / (expert_tp() * ep); }
  // The ranks a ZeRO shard group spans (dp_instances): all the replicas, or one instance's.
  // (At least 1, so that a plan check_plan refuses, an instance count that does not divide
  // the replicas, still sizes groups.)
  int64_t shard_ranks() const {
    return dp_instances == 1 ? replicas() : std::max<int64_t>(1, replicas() / std::max<int64_t>(1, dp_instances));
  }
  int64_t expert_shard_ranks() const {
    return dp_instances == 1 ? expert_replicas()
                             : std::max<int64_t>(1, expert_replicas() / std::max<int64_t>(1, dp_instances));
  }
  int64_t microbatches() const { return gbs / (mbs * d); }  // per pipeline, per step
  // The interleaved schedule's micro-batch group (schedule.h): as given, else p when it
  // divides the micro-batches (Megatron's default), else the smallest g > p whose last
  // group, m mod g, is empty or holds at least p (Megatron-core's rule; g = m always does).
  int64_t vp_group_size() const {
    if (vp_group > 0) return vp_group;
    const int64_t m = microbatches();
    if (v <= 1 || m <= p || m % p == 0 || m > (int64_t{1} << 22)) return p;
    for (int64_t g = p + 1; g < m; ++g)
      if (m % g == 0 || m % g >= p) return g;
    return m;
  }
  ScheduleKind schedule() const {
    return gpipe ? ScheduleKind::gpipe : (v > 1 ? ScheduleKind::interleaved : ScheduleKind::one_f_one_b);
  }
};

// Reads a plan from a JSON object (long or short keys); fills gbs = mbs * d when absent.
Plan plan_from_json(const Json& j, const std::string& source);
// "tp=8,pp=8,dp=16,mbs=1" or a path to a plan JSON file.
Plan load_plan(const std::string& inline_or_path);
// Parses "k=v,k=v" into a JSON object (integers become numbers, true/false booleans).
Json parse_inline_pairs(const std::string& text, const std::string& what);
Json plan_to_json(const Plan& p);
// RecomputeModule bits from Megatron's names (a list, or names separated by blanks or '+');
// unknown or unmodelled names throw InputError naming `field`. And back, joined by `sep`.
unsigned parse_recompute_modules(const Json& v, const std::string& field);
std::string recompute_modules_text(unsigned bits, const char* sep);
// --offload-modules: a list of names (a JSON array, or a string of names separated by
// blanks, '+' or ','), onto OffloadModule bits; Megatron-core's rule on them (attn_proj
// needs core_attn).
unsigned parse_offload_modules(const Json& v, const std::string& field);
std::string offload_modules_text(unsigned bits, const char* sep);
std::string plan_to_inline(const Plan& p);

// Why a plan cannot run this model on this cluster; empty when it can. Each reason has a
// short key (counted by the planner) and a message naming the field, value and rule.
struct Reason {
  std::string key;
  std::string message;
};
// With messages = false only the keys are filled (the planner's hot loop).
std::vector<Reason> check_plan(const ModelSpec& m, const Cluster& cl, const Plan& p, bool messages = true);
// check_plan's rules on an interleaved plan's micro-batches and their group (the executor
// checks them too): appends the broken one to *r. The global batch must divide already.
void interleaved_reasons(const Plan& p, std::vector<Reason>* r, bool messages = true);



const char* to_string(Recompute r);
const char* to_string(ScheduleKind s);
const char* to_string(CpComm c);
const char* to_string(MoeDispatcher d);  // the flex backend's name, or "alltoall" / "allgather"
// The cp_comm_type a plan runs with (CpComm): never automatic. On the strata stack
// (cluster software_stack "strata") always allgather, what its executor does.
CpComm resolve_cp_comm(const ModelSpec& m, const Cluster& cl, const Plan& p);
// The same on a GPU framework's stack (Megatron-LM, Megatron-Bridge): the exports' value.
CpComm resolve_cp_comm(const ModelSpec& m, const Plan& p);

}  // namespace strata
