// The search: every tensor, pipeline, data and context parallel degree, virtual stages,
// micro-batch size, ZeRO stage, recompute mode, sequence parallelism and pipeline schedule
// consistent with the model and the GPU count, each pipeline in strata's own layout and in
// the first/last split or layout that balances its ends (balanced_end_split); each rejected with a counted reason or
// estimated and ranked by step time. Pruning never changes the answer: a plan is skipped
// only when a lower bound on its step time (its busiest stage's work, no bubble) cannot
// reach the top K, or, for --pareto, when a known plan dominates it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "costmodel/estimate.h"

namespace strata {

// Dimensions the user pinned with --fix (unset: searched).
struct FixedDims {
  std::optional<int64_t> t, p, d, c, v, mbs, recompute_layers;
  std::optional<int> zero;
  std::optional<Recompute> recompute;
  std::optional<bool> sp, gpipe;
  std::optional<bool> uneven_split;  // 0: strata's own layouts only; 1: balanced_end_split's only
  std::optional<CpComm> cp_comm;     // cp_comm_type (p2p, a2a, allgather): context-parallel plans only
  std::optional<double> offload;     // optimizer_offload_fraction of every candidate (ZeRO >= 1)
  std::optional<int64_t> ep;         // expert_model_parallel_size (mixture-of-experts models)
  std::optional<bool> grad_reduce_in_fp32;  // the main gradients' type of every candidate (not searched)
  // tp_comm_overlap of every candidate (not searched; unset, "auto": Stack::userbuffers): on,
  // the sequence-parallel ones on the modern stack run Transformer Engine's user buffers, as
  // Megatron-Bridge's and NeMo's recipes do; off, none (Transformer Engine's own backward
  // overlap stays on the modern stack; on a legacy stack no collective overlaps).
  std::optional<bool> tp_comm_overlap;
  // --fix moe_token_dispatcher_type=flex (with moe_flex_dispatcher_backend): the MoE token
  // dispatcher of every candidate (Plan::moe_dispatcher; not searched).
  std::optional<MoeDispatcher> moe_dispatcher;
  // --fix overlap_moe_expert_parallel_comm=1 (or moe_a2a_overlap): every candidate overlaps
  // its expert exchanges (Plan::moe_a2a_overlap; those that cannot are refused, a2a_overlap).
  std::optional<bool> moe_a2a_overlap;
  // --fix use_precision_aware_optimizer=1 (with exp_avg_dtype, exp_avg_sq_dtype,
  // main_params_dtype, store_param_remainders): the optimizer of every ZeRO-1 candidate
  // (Megatron's distributed optimizer, the only one it runs with); its fields only.
  std::optional<Plan> optimizer;
  // --fix offload_modules=core_attn+attn_proj (with activation_offload_fraction,
  // min_offloaded_tensor_size): fine-grained activation offloading for every candidate
  // (Plan::offload_modules and its settings only; candidates it cannot run, those with full
  // recompute, are rejected as activation_offload).
  std::optional<Plan> activation_offload;
  // --fix selective_ac_option=op: torchtitan's op-level policy as every candidate's selective
  // recompute (Plan::selective_ac_op; it fixes recompute=selective).
  bool selective_ac_op = false;
  // Hybrid sharding for every ZeRO >= 1 candidate: --fix num_distributed_optimizer_instances=N
  // (N instances) or data_parallel_shard_size=S (shard groups of S replicas, e.g. a node's);
  // candidates whose replicas it does not split are rejected (dp_instances).
  std::optional<int64_t> dp_instances, dp_shard_size;
  // The plan's other short keys (SPEC: tp pp dp cp vp mbs gbs zero recompute sp precision
  // schedule): the global batch and the precision, which the search takes as given anyway;
  // strata plan reads them as --global-batch-size and --precision (and refuses a disagreement).
  std::optional<int64_t> gbs;
  std::optional<Precision> precision;
  // fp8_param_gather of every candidate (Plan::fp8_param_gather; fp8 searches only): on
  // refuses the candidates without ZeRO; a Megatron launch's holds for its search.
  std::optional<bool> fp8_param_gather;
};
FixedDims parse_fixed(const std::string& text);  // "tp=8,pp=4,recompute=full"

struct SearchOptions {
  int64_t gpus = 1;
  int64_t gbs = 1;
  int top_k = 10;
  Precision precision = Precision::bf16;
  bool pareto = false;
  // One attention kernel for every candidate, so plans compare like for like. "auto"
  // resolves as for a plan without context parallelism; context-parallel candidates then
  // need flash and are rejected (reason cp_attention) when it resolves to unfused.
  AttentionChoice attention = AttentionChoice::automatic;
  // Optimizer offload as a dimension (plan --search-offload): every ZeRO >= 1 candidate also
  // with kOffloadFractions of its optimizer shard on the host, where the cluster has one and
  // --fix does not pin the fraction. Off by default: the search then offloads nothing.
  bool search_offload = false;
  FixedDims fixed;
  // Called after each (tensor, pipeline) unit of the space with the units done, their
  // total and the candidates counted so far: the progress of a long search. Optional.
  std::function<void(int64_t done, int64_t total, int64_t candidates)> on_progress;
};
// The offload fractions --search-offload tries besides none.
inline constexpr double kOffloadFractions[] = {0.25, 0.5, 0.75, 1.0};

struct SearchResult {
  int64_t candidates_evaluated = 0;  // every plan the loops produced
  int64_t feasible = 0;              // valid and fits in memory
  int64_t simulated = 0;             // pipeline walks actually run
  std::map<std::string, int64_t> rejected;
  double search_time_s = 0;
  std::vector<Estimate> plans;       // best first, at most top_k
  std::vector<Estimate> pareto;      // memory vs step-time frontier, by memory (with --pareto)
};

// Megatron-LM's decoder_first/last_pipeline_num_layers (or, with virtual stages, a layout) for
// a pipelined plan, chosen to balance the end stages: stage 0 also runs the embedding and stage p - 1 the output layer
// (with a 128k vocabulary in bf16 beside FP8 layers, worth two layers or more). With w, e
// and h one micro-batch's forward + backward (+ recompute) of a layer, the embedding and
// the output layer (layer_cost etc. of the plan, without ZeRO and partial recompute): for
// each count of layers on the middle stages, the split f | mid x (p - 2) | l nearest
// balance of the ends (the multiples of v either side of f w + e = l w + h; Megatron-core's
// rules: every count a multiple of v, the middle stages alike); of those, the one whose
// slowest stage, max(f w + e, mid w, l w + h), is fastest, ties to fewer layers on the
// first stage. With virtual stages (v > 1) those counts move v layers at a time, too coarse
// to balance an output layer worth a layer or two: where L splits evenly into the p v
// chunks of n layers and three or more stages, a pipeline_model_parallel_layout moves single
// layers instead, a = ceil(e / w) - 1 off the first stage's first chunk onto the first
// chunk of stages p - 2, p - 3, ... and b = ceil(h / w) - 1 off the last stage's last chunk
// onto the last chunk of stages 1, 2, ... (at most n each, a + b <= p - 2, the costlier
// end's first: one extra layer
// per stage), so that no stage does more than n v + 1 layers' work (Megatron-Bridge's
// Llama 3 70B H100 recipe of 2026-08 moves one layer so, by hand); it is taken where its
// slowest stage beats both. The plan with the better of the two, or nothing where neither
// is faster by that measure than strata's own layout (layout.h, as even as possible where
// neither L nor L + 2 divides) or the plan has one stage.
std::optional<Plan> balanced_end_split(const ModelSpec& m, const Cluster& cl, const Plan& p);
// The same from the three costs already made (the search's cache).
std::optional<Plan> balanced_end_split(const ModelSpec& m, const Plan& p, double layer_s, double embedding_s,
                                       double head_s);

SearchResult search(const ModelSpec& m, const Cluster& cl, const SearchOptions& opt);
// The one software stack the search compares its candidates on: the plain plan's (no ZeRO,
// no context parallelism) with the options' precision and attention (pin_to_plain_stack).
Stack search_stack(const ModelSpec& m, const Cluster& cl, const SearchOptions& opt);
Json search_to_json(const SearchResult& r);

}  // namespace strata
