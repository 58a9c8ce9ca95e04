// Megatron-LM launch flags as strata's inputs; see megatron_args.h.
#include "costmodel/megatron_args.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace strata {
namespace {

// The flags strata reads, by the input they describe (snake_case, as argparse names them).
// Model flags keep Megatron's names (model_from_json reads them); so do plan flags, but
// for the three below, which are renamed here.
const std::set<std::string>& model_flags() {
  static const std::set<std::string> s = {
      "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
      "group_query_attention", "kv_channels", "seq_length", "max_position_embeddings", "vocab_size",
      "make_vocab_size_divisible_by", "swiglu", "squared_relu", "normalization", "position_embedding_type",
      "use_rotary_position_embeddings", "untie_embeddings_and_output_weights", "disable_bias_linear",
      "attention_dropout", "hidden_dropout", "norm_epsilon", "layernorm_epsilon", "rotary_base", "rotary_percent",
      "init_method_std", "apply_query_key_layer_scaling", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
      "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_grouped_gemm", "moe_router_num_groups",
      "moe_router_group_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_permute_fusion",
      "moe_expert_capacity_factor", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
      "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers", "mtp_loss_scaling_factor",
      "num_key_value_heads"};  // (Megatron-DeepSpeed's name of num_query_groups)
  return s;
}
// Megatron's store_true flags among them: never followed by a value.
const std::set<std::string>& switch_flags() {
  static const std::set<std::string> s = {
      "group_query_attention", "swiglu", "squared_relu", "use_rotary_position_embeddings",
      "untie_embeddings_and_output_weights", "disable_bias_linear", "apply_query_key_layer_scaling",
      "sequence_parallel", "use_distributed_optimizer", "use_torch_fsdp2", "bf16", "fp16", "overlap_grad_reduce",
      "overlap_param_gather", "tp_comm_overlap", "use_flash_attn", "no_gradient_accumulation_fusion",
      "recompute_activations", "use_megatron_fsdp", "account_for_embedding_in_pipeline_split",
      "account_for_loss_in_pipeline_split", "optimizer_cpu_offload", "moe_grouped_gemm", "moe_permute_fusion",
      "grad_reduce_in_bf16", "accumulate_allreduce_grads_in_fp32", "use_precision_aware_optimizer",
      "no_store_param_remainders", "fine_grained_activation_offloading", "multi_latent_attention",
      "moe_enable_deepep", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "checkpoint_activations",
      "fp8_param_gather", "cross_entropy_loss_fusion"};
  return s;
}
// Flags that set what strata does not take from a launch: refused, naming the way to say it.
const std::map<std::string, std::string>& refused_flags() {
  static const std::map<std::string, std::string> s = {
      {"window_size", "give the model as a model JSON with window_size (and window_attn_skip_freq)"},
      {"window_attn_skip_freq", "give the model as a model JSON with window_size and window_attn_skip_freq"},
      // Megatron-DeepSpeed's mixture of experts (experts every --expert-interval layers,
      // default 2; --topk, default 1), which Megatron-LM's --num-experts does not describe.
      {"expert_interval", "Megatron-DeepSpeed's MoE is not read: give the model as a model JSON with num_experts, "
                          "moe_router_topk and moe_layer_freq"},
      {"topk", "Megatron-DeepSpeed's MoE is not read: give the model as a model JSON with num_experts, "
               "moe_router_topk and moe_layer_freq"},
      {"moe_expert_parallel_size", "Megatron-DeepSpeed's MoE is not read: give the model as a model JSON and "
                                   "expert_model_parallel_size in the plan"},
      // What changes the layers themselves, or the whole argument list: not a model strata
      // would cost right.
      {"yaml_cfg", "a YAML file replaces every argument: give its flags instead"},
      {"spec", "a custom layer spec is not modelled: strata costs Megatron-core's GPT layer"},
      {"heterogeneous_layers_config_path", "heterogeneous layers are not modelled: strata costs every layer alike"},
      {"heterogeneous_layers_config_encoded_json", "heterogeneous layers are not modelled: strata costs every layer alike"},
      {"hybrid_override_pattern", "hybrid Mamba/attention layers are not modelled: strata costs attention layers"},
      {"hybrid_layer_pattern", "hybrid Mamba/attention layers are not modelled: strata costs attention layers"},
      {"experimental_attention_variant", "attention variants are not modelled: strata costs softmax attention"},
      {"linear_attention_freq", "linear-attention layers are not modelled: strata costs softmax attention"},
      {"enable_mhc_connections", "hyper-connections are not modelled: strata costs one residual stream"},
      {"moe_latent_size", "latent MoE projections are not modelled: give the experts as a model JSON"},
      {"quick_geglu", "a gated GELU MLP is not read from a launch: give the model as a model JSON with "
                      "activation geglu"},
      {"attention_output_gate", "a gated attention output is not modelled"},
      {"fp4_format", "FP4 training is not modelled: strata costs bf16, fp16, fp8 or fp32"},
      {"moe_layer_recompute", "recomputing the whole MoE layer is not modelled: recompute its parts with "
                              "--recompute-modules (moe_act, layernorm, ...)"},
      {"first_last_layers_bf16", "FP8 with the first and last layers in bf16 is not modelled: strata costs every "
                                 "layer in FP8 (drop the flag to cost that)"},
      {"no_fp8_wgrad", "FP8 with bf16 weight gradients is not modelled: strata costs every GEMM in FP8 (drop the "
                       "flag to cost that)"},
      {"disable_fp8_wgrad", "FP8 with bf16 weight gradients is not modelled: strata costs every GEMM in FP8 (drop the "
                            "flag to cost that)"}};
  return s;
}
// Flags strata does not model that change the step time or the memory (unlike the learning
// rates, data paths and logging the rest of a launch holds): each named on stderr.
const std::set<std::string>& costly_unmodelled_flags() {
  static const std::set<std::string> s = {
      "cuda_graph_impl", "enable_cuda_graph", "cuda_graph_scope", "cuda_graph_modules", "external_cuda_graph",
      "cuda_graph_warmup_steps", "manual_gc", "manual_gc_interval", "no_masked_softmax_fusion", "no_bias_gelu_fusion",
      "no_bias_swiglu_fusion", "no_bias_dropout_fusion", "no_rope_fusion", "no_persist_layer_norm",
      "defer_embedding_wgrad_compute", "cpu_offloading", "cpu_offloading_num_layers", "fp32_residual_connection",
      "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin", "fp8_interval",
      "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "moe_permute_fusion", "moe_router_fusion",
      "moe_router_dtype", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
      "moe_shared_expert_overlap", "overlap_p2p_communication", "no_overlap_p2p_communication",
      "overlap_p2p_communication_warmup_flush", "distribute_saved_activations", "ddp_bucket_size",
      "ddp_average_in_collective", "overlap_param_gather_with_optimizer_step", "megatron_fsdp_main_grads_dtype",
      "megatron_fsdp_main_params_dtype", "calculate_per_token_loss", "use_cpu_initialization",
      "tp_comm_overlap_cfg", "disable_tp_comm_overlap_ag", "disable_tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad",
      "disable_tp_comm_bulk_dgrad", "disable_tp_comm_bulk_wgrad", "disable_tp_comm_split_ag",
      "disable_tp_comm_split_rs", "cross_entropy_fusion_impl", "use_legacy_models", "overlap_cpu_optimizer_d2h_h2d",
      "empty_unused_memory_level", "partition_activations", "no_async_tensor_model_parallel_allreduce"};
  return s;
}
const std::set<std::string>& plan_flags() {
  static const std::set<std::string> s = {
      "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
      "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage", "micro_batch_size",
      "global_batch_size", "sequence_parallel", "use_distributed_optimizer", "use_torch_fsdp2", "recompute_granularity",
      "recompute_method", "recompute_num_layers", "bf16", "fp16", "fp8_format", "overlap_grad_reduce",
      "overlap_param_gather", "tp_comm_overlap", "use_flash_attn", "no_gradient_accumulation_fusion",
      "attention_backend", "microbatch_group_size_per_virtual_pipeline_stage", "recompute_activations",
      "use_megatron_fsdp", "num_virtual_stages_per_pipeline_rank", "account_for_embedding_in_pipeline_split",
      "account_for_loss_in_pipeline_split", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
      "pipeline_model_parallel_layout", "cp_comm_type", "optimizer_cpu_offload", "optimizer_offload_fraction",
      "expert_model_parallel_size", "expert_tensor_parallel_size", "recompute_modules", "grad_reduce_in_bf16",
      "accumulate_allreduce_grads_in_fp32", "use_precision_aware_optimizer", "no_store_param_remainders",
      "exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype", "main_grads_dtype",
      "fine_grained_activation_offloading", "offload_modules", "activation_offload_fraction",
      "min_offloaded_tensor_size", "delta_offload_bytes_across_pp_ranks", "num_distributed_optimizer_instances",
      "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_enable_deepep",
      "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "data_parallel_sharding_strategy",
      "checkpoint_activations",  // (Megatron-DeepSpeed's full recompute)
      "zero_stage",              // (Megatron-DeepSpeed's, for DeepSpeed's ZeRO)
      "fp8_param_gather", "cross_entropy_loss_fusion"};
  return s;
}

bool is_name(const std::string& s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

// The words of a shell text: comments and line continuations removed, quotes and array
// parentheses taken as blanks (a quoted list of flags, GPT_ARGS="--num-layers 24 ...", is
// read as its flags), quotes inside ${...} dropped (${TP:-"8"} is ${TP:-8}). Each word
// says whether it begins a command (the text's start, after a newline, a ';' or a case
// arm's ')' outside quotes), where a NAME=value is an assignment and `if` a keyword, and
// which quoted string holds it (group: 0 outside quotes), so that NAME="a b" is one value.
struct Words {
  std::vector<std::string> w;
  std::vector<bool> starts;  // w[i] begins a command
  std::vector<int> group;    // the quoted string w[i] is in (numbered from 1), or 0
  size_t size() const { return w.size(); }
  const std::string& operator[](size_t i) const { return w[i]; }
};
Words words_of(const std::string& text) {
  Words out;
  std::string word;
  bool next_start = true, comment = false, single = false, dbl = false;
  int open_parens = 0;  // kept '(' of the current word not yet closed
  int braces = 0;       // open ${ ... }
  int groups = 0, group = 0;
  auto flush = [&] {
    open_parens = 0;
    if (word.empty()) return;
    out.w.push_back(word);
    out.starts.push_back(next_start);
    out.group.push_back(group);
    next_start = false;
    word.clear();
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool quoted = single || dbl;
    if (comment) {
      if (c == '\n') comment = false, next_start = true;
      continue;
    }
    if (!quoted && c == '#' && (i == 0 || std::isspace(static_cast<unsigned char>(text[i - 1])))) {
      flush();
      comment = true;
      continue;
    }
    if (c == '\\' && !single && i + 1 < text.size() &&
        (text[i + 1] == '\n' || text[i + 1] == '\r' || text[i + 1] == '"' || text[i + 1] == '\'')) {
      flush();  // a continuation (not a command boundary), or an escaped quote (a blank)
      ++i;
      if (text[i] == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      continue;
    }
    if (c == '{' && i > 0 && text[i - 1] == '$' && !single) ++braces;
    if (c == '}' && braces > 0) --braces;
    if (braces > 0 && (c == '"' || c == '\'')) continue;
    if ((c == '\'' && !dbl) || (c == '"' && !single)) {
      flush();
      (c == '\'' ? single : dbl) = !quoted;
      group = quoted ? 0 : ++groups;
      continue;
    }
    // A pipeline layout's parentheses ("Et|(t*2|)*34,tL") are kept: '(' after a layout
    // character; so are --moe-layer-freq's ("([1]*3+[0]*1)*3"): '(' before a list or another
    // '(', or after '+' or '*'; and the ')' that closes a kept '(' in the same word. Every
    // other one (arrays, subshells, case arms) is a blank.
    if (c == '(') {
      const char before = i > 0 ? text[i - 1] : ' ', after = i + 1 < text.size() ? text[i + 1] : ' ';
      if ((before != '\0' && std::strchr("EtL|,+*", before) != nullptr) || after == '[' || after == '(') {
        ++open_parens;
        word += c;
      } else {
        flush();
      }
      continue;
    }
    if (c == ')') {
      if (open_parens > 0) {
        --open_parens;
        word += c;
      } else {
        flush();
        if (!quoted) next_start = true;  // (a case arm's pattern ends: its commands begin)
      }
      continue;
    }
    if (!quoted && (c == ';' || c == '\n')) {
      flush();
      next_start = true;
      continue;
    }
    if (c == ';' || std::isspace(static_cast<unsigned char>(c))) {
      flush();
      continue;
    }
    word += c;
  }
  flush();
  return out;
}

// Whether words[i] is where a command begins: first on its line or after a ';', or after
// a keyword or an operator that begins one (export NAME=value, then NAME=value, a && b).
bool command_position(const Words& words, size_t i) {
  if (words.starts[i]) return true;
  if (i == 0) return true;
  static const std::set<std::string> before = {"export", "local", "declare", "readonly", "typeset", "then",
                                               "else",   "do",    "&&",      "||",       "|",       "{"};
  return before.count(words[i - 1]) > 0;
}

// An if ... then ... [elif ... then ...] [else ...] fi of the text (keywords where a
// command begins): each branch's condition words [cond_begin, cond_end) (none: else) and
// body words [body_begin, body_end); begin and end the positions of `if` and `fi`.
struct IfBranch {
  size_t cond_begin = 0, cond_end = 0, body_begin = 0, body_end = 0;
};
struct IfBlock {
  size_t begin = 0, end = 0;
  std::vector<IfBranch> branches;
};
using IfBlocks = std::vector<IfBlock>;  // outer blocks before the blocks inside them

IfBlocks if_blocks_of(const Words& words) {
  IfBlocks done;
  std::vector<IfBlock> open;
  std::vector<size_t> order;  // each open block's place in `done`, reserved at its `if`
  for (size_t i = 0; i < words.size(); ++i) {
    if (!command_position(words, i)) continue;
    const std::string& w = words[i];
    if (w == "if") {
      IfBlock b;
      b.begin = i;
      b.branches.push_back(IfBranch{i + 1, i + 1, i + 1, i + 1});
      open.push_back(b);
      order.push_back(done.size());
      done.emplace_back();
      continue;
    }
    if (open.empty()) continue;
    IfBlock& b = open.back();
    IfBranch& br = b.branches.back();
    if (w == "then" && br.body_begin == br.cond_begin) {
      br.cond_end = i;
      br.body_begin = i + 1;
    } else if (w == "elif" || w == "else") {
      br.body_end = i;
      b.branches.push_back(IfBranch{i + 1, i + 1, i + 1, i + 1});  // (else: no condition, the body from here)
    } else if (w == "fi") {
      br.body_end = i;
      b.end = i;
      done[order.back()] = b;
      open.pop_back();
      order.pop_back();
    }
  }
  // (An if without its fi: dropped, its words read as before.)
  done.erase(std::remove_if(done.begin(), done.end(), [](const IfBlock& b) { return b.end == 0; }), done.end());
  return done;
}

// An if's condition, `[ ... ]`, `[[ ... ]]` or `test ...` joined by && and ||: 1 true, 0
// false, -1 undecided (a shell expression, an unresolved variable, a pattern, arithmetic).
// Each test is A = B, A == B, A != B, A -eq|-ne|-lt|-le|-gt|-ge B (integers), -z A, -n A
// or A, optionally after !; an empty quoted string leaves no word, so `[ -z "" ]` is -z
// alone. resolve() gives a word's value.
template <class Resolve>
int evaluate_condition(const Words& words, size_t begin, size_t end, Resolve&& resolve) {
  int result = -1;
  std::string join;  // the operator before the test being read ("" for the first)
  std::vector<std::string> test;
  auto one = [&]() -> int {  // the test in `test`
    bool negate = false;
    std::vector<std::string> t = test;
    if (!t.empty() && t[0] == "!") negate = true, t.erase(t.begin());
    for (std::string& x : t) {
      if (x == "-eq" || x == "-ne" || x == "-lt" || x == "-le" || x == "-gt" || x == "-ge" || x == "=" || x == "==" ||
          x == "!=" || x == "-z" || x == "-n")
        continue;
      x = resolve(x);
      if (x.find_first_of("$`*?[") != std::string::npos) return -1;
    }
    int r = -1;
    auto integer = [](const std::string& x, long long* v) {
      if (x.empty() || x.size() > 18) return false;
      for (size_t k = 0; k < x.size(); ++k)
        if (!std::isdigit(static_cast<unsigned char>(x[k])) && !(k == 0 && x[k] == '-' && x.size() > 1)) return false;
      *v = std::stoll(x);
      return true;
    };
    if (t.size() == 1 && (t[0] == "-z" || t[0] == "-n")) r = t[0] == "-z";  // (an empty word)
    else if (t.size() == 1) r = !t[0].empty();
    else if (t.size() == 2 && (t[0] == "-z" || t[0] == "-n")) r = (t[0] == "-z") == t[1].empty();
    else if (t.size() == 3 && (t[1] == "=" || t[1] == "==")) r = t[0] == t[2];
    else if (t.size() == 3 && t[1] == "!=") r = t[0] != t[2];
    else if (t.size() == 3) {
      long long a = 0, b = 0;
      if (!integer(t[0], &a) || !integer(t[2], &b)) return -1;
      const std::string& op = t[1];
      r = op == "-eq" ? a == b : op == "-ne" ? a != b : op == "-lt" ? a < b : op == "-le" ? a <= b
        : op == "-gt" ? a > b : op == "-ge" ? a >= b : -1;
    }
    if (r < 0) return -1;
    return negate ? !r : r;
  };
  // Each test between && and || is [ ... ], [[ ... ]] or test ...: anything else is a
  // command, whose exit status strata does not evaluate.
  bool bracketed = false;
  auto fold = [&]() -> bool {  // the test read so far into result; false: undecided
    if (!bracketed) return false;
    const int r = one();
    test.clear();
    bracketed = false;
    if (r < 0) return false;
    result = join.empty() ? r : join == "&&" ? (result && r) : (result || r);
    return true;
  };
  for (size_t i = begin; i < end; ++i) {
    const std::string& w = words[i];
    if ((w == "[" || w == "[[" || w == "test") && test.empty() && !bracketed) {
      bracketed = true;
      continue;
    }
    if (w == "]" || w == "]]") continue;
    if (w == "&&" || w == "||") {
      if (!fold()) return -1;
      join = w;
      continue;
    }
    test.push_back(w);
  }
  if (!fold()) return -1;
  return result;
}

// A flag's value as JSON: integers and reals as numbers, true/false, else the string.
Json value_of(const std::string& s) {
  if (s == "true") return true;
  if (s == "false") return false;
  size_t used = 0;
  const bool digits = !s.empty() && (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '-' || s[0] == '.');
  if (digits) {
    try {
      if (s.find_first_of(".eE") == std::string::npos) {
        const long long v = std::stoll(s, &used);
        if (used == s.size()) return v;
      } else {
        const double v = std::stod(s, &used);
        if (used == s.size()) return v;
      }
    } catch (const std::exception&) {  // out of range: kept as text, refused where read
    }
  }
  return s;
}

std::string flag_of(const std::string& key) {
  std::string f = "--" + key;
  std::replace(f.begin(), f.end(), '_', '-');
  return f;
}

}  // namespace

MegatronLaunch parse_megatron_launch(const std::string& text, const std::string& source) {
  const Words words = words_of(text);
  const IfBlocks blocks = if_blocks_of(words);
  // An assignment at word i (NAME=value where a command begins, `export NAME=value`, or
  // after another assignment: A=1 B=2 cmd), with its value (a quoted one whole: NAME="a b")
  // and the word after it; `after` is the word after the previous one.
  struct Assignment {
    std::string name, value;
    size_t next = 0;
  };
  auto assignment_at = [&](size_t i, size_t after, Assignment* a) {
    const std::string& w = words[i];
    const size_t eq = w.find('=');
    if (!(command_position(words, i) || i == after) || w.rfind("--", 0) == 0 || eq == std::string::npos || eq == 0 ||
        !is_name(w.substr(0, eq)))
      return false;
    a->name = w.substr(0, eq);
    a->value = w.substr(eq + 1);
    a->next = i + 1;
    const int g = i + 1 < words.size() ? words.group[i + 1] : 0;
    if (a->value.empty() && g != 0 && g != words.group[i]) {  // NAME="value ..."
      std::vector<std::string> parts;
      for (; a->next < words.size() && words.group[a->next] == g; ++a->next) parts.push_back(words[a->next]);
      a->value = fmt::format("{}", fmt::join(parts, " "));
    }
    return true;
  };
  // $NAME, ${NAME} and ${NAME:-default} (${NAME-default}) through `vars`, followed through
  // other names; a name in `unknown` (set to two values, or in a branch not decided) has no
  // value and no default; a name whose value is its own default (TP=${TP:-8}, as scripts
  // take the environment's) is the default.
  auto mentions = [](const std::string& v, const std::string& name) {
    for (const std::string& ref : {"$" + name, "${" + name}) {
      for (size_t at = v.find(ref); at != std::string::npos; at = v.find(ref, at + 1)) {
        const size_t after = at + ref.size();
        if (after == v.size() || !(std::isalnum(static_cast<unsigned char>(v[after])) || v[after] == '_')) return true;
      }
    }
    return false;
  };
  auto resolve_in = [&](const std::map<std::string, std::string>& vars, const std::set<std::string>& unknown,
                        std::string v) {
    for (int depth = 0; depth < 8 && !v.empty() && v[0] == '$'; ++depth) {
      std::string name = v.substr(1), fallback;
      bool braces = false, has_default = false;
      if (name.size() >= 2 && name.front() == '{' && name.back() == '}') {
        name = name.substr(1, name.size() - 2);
        braces = true;
      }
      if (const size_t d = name.find('-'); braces && d != std::string::npos && d > 0) {
        fallback = name.substr(d + 1);
        name = name.substr(0, name[d - 1] == ':' ? d - 1 : d);
        has_default = !unknown.count(name);
      }
      if (!is_name(name) || unknown.count(name)) break;
      const auto it = vars.find(name);
      const bool self = it != vars.end() && mentions(it->second, name);
      if (it != vars.end() && !self && !(it->second.empty() && has_default)) v = it->second;
      else if (has_default) v = fallback;
      else if (it != vars.end() && self) v = it->second;  // (its own default, the next round)
      else break;
    }
    return v;
  };
  // The text in order, as the shell runs it: each if block decided from the assignments
  // made before it (a condition on the text's own variables: the branches not taken are
  // skipped, their flags and assignments too) or not (every branch read, its flags named,
  // and the variables it assigns unknown to the conditions after it).
  std::vector<bool> skip(words.size(), false);
  std::vector<std::string> undecided;
  {
    std::map<std::string, std::string> now;
    std::set<std::string> unknown;
    auto resolve_now = [&](const std::string& v) { return resolve_in(now, unknown, v); };
    std::vector<size_t> open_undecided;  // the ends of the undecided blocks around the word
    size_t k = 0, after = SIZE_MAX;
    for (size_t i = 0; i < words.size(); ++i) {
      while (!open_undecided.empty() && open_undecided.back() < i) open_undecided.pop_back();
      while (k < blocks.size() && blocks[k].begin < i) ++k;  // (blocks in skipped words)
      if (skip[i]) continue;
      if (k < blocks.size() && blocks[k].begin == i) {
        const IfBlock& b = blocks[k++];
        int taken = -1;
        bool decided = true;
        for (size_t n = 0; n < b.branches.size() && taken < 0; ++n) {
          const IfBranch& br = b.branches[n];
          if (br.cond_begin == br.cond_end) {
            taken = static_cast<int>(n);  // else
            break;
          }
          const int r = evaluate_condition(words, br.cond_begin, br.cond_end, resolve_now);
          if (r < 0) {
            decided = false;
            break;
          }
          if (r == 1) taken = static_cast<int>(n);
        }
        for (size_t n = 0; n < b.branches.size(); ++n) {
          const IfBranch& br = b.branches[n];
          for (size_t j = br.cond_begin; j < br.cond_end; ++j) skip[j] = true;  // (a condition's words are no flags)
          if (decided && static_cast<int>(n) != taken)
            for (size_t j = br.body_begin; j < br.body_end; ++j) skip[j] = true;
        }
        if (!decided && open_undecided.empty()) {  // (an outer block's note names the flags within)
          std::vector<std::string> flags;
          for (size_t j = b.begin; j <= b.end; ++j) {  // (the flags strata reads: the others change nothing)
            if (words[j].rfind("--", 0) != 0 || words[j].size() <= 2) continue;
            const std::string f = words[j].substr(0, words[j].find('='));
            std::string snake = f.substr(2);
            std::replace(snake.begin(), snake.end(), '-', '_');
            if (!model_flags().count(snake) && !plan_flags().count(snake)) continue;
            if (std::find(flags.begin(), flags.end(), f) == flags.end()) flags.push_back(f);
          }
          if (!flags.empty()) {
            const std::vector<std::string> cond(words.w.begin() + static_cast<std::ptrdiff_t>(b.branches[0].cond_begin),
                                                words.w.begin() + static_cast<std::ptrdiff_t>(b.branches[0].cond_end));
            undecided.push_back(fmt::format("if {} ({})", fmt::join(cond, " "), fmt::join(flags, " ")));
          }
        }
        if (!decided) open_undecided.push_back(b.end);
        continue;
      }
      Assignment a;
      if (!assignment_at(i, after, &a)) continue;
      after = a.next;
      if (open_undecided.empty()) {
        now[a.name] = a.value;
        unknown.erase(a.name);
      } else {
        now.erase(a.name);
        unknown.insert(a.name);
      }
    }
  }
  // The flags' variables: every assignment not skipped; a name set to two values (in the
  // branches of an if not decided, or of a case) resolves to nothing.
  std::map<std::string, std::string> vars;
  std::set<std::string> ambiguous;
  {
    size_t after = SIZE_MAX;
    for (size_t i = 0; i < words.size(); ++i) {
      Assignment a;
      if (skip[i] || !assignment_at(i, after, &a)) continue;
      after = a.next;
      if (const auto it = vars.find(a.name); it != vars.end() && it->second != a.value) ambiguous.insert(a.name);
      vars[a.name] = a.value;
    }
    for (const std::string& name : ambiguous) vars.erase(name);
  }
  auto resolve = [&](const std::string& v) { return resolve_in(vars, ambiguous, v); };
  MegatronLaunch out;
  out.model = Json::object();
  out.plan = Json::object();
  out.undecided = undecided;
  std::map<std::string, std::string> seen;  // flag -> its value as written (resolved)
  std::set<std::string> ignored, present;
  std::map<std::string, std::string> launch_values;
  int64_t nproc = 0, nnodes = 0;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    if (skip[i] || w.size() < 3 || w.rfind("--", 0) != 0) continue;
    std::string key = w.substr(2), raw;
    bool bare = true;
    // The next word is a value unless it is a flag or a shell assignment (NAME=...), or this
    // flag is a switch.
    auto value_next = [&] {
      if (i + 1 >= words.size() || skip[i + 1] || words[i + 1].rfind("--", 0) == 0) return false;
      const std::string& n = words[i + 1];
      const size_t eq = n.find('=');
      return eq == std::string::npos || eq == 0 || !is_name(n.substr(0, eq));
    };
    std::string snake = key.substr(0, key.find('='));
    std::replace(snake.begin(), snake.end(), '-', '_');
    if (const size_t eq = key.find('='); eq != std::string::npos) {
      raw = key.substr(eq + 1);
      bare = false;
      if (raw.empty() && value_next()) raw = words[++i];  // --k="v"
    } else if (!switch_flags().count(snake) && value_next()) {
      raw = words[++i];
      bare = false;
    }
    key = snake;
    if (!is_name(key)) continue;
    if (key == "use_flash_attn_v2") key = "use_flash_attn";  // (Megatron-DeepSpeed's name)
    // Megatron-LM takes --cp-comm-type once per layer too (a list of words): one type for
    // every layer is read, a mix refused.
    // --recompute-modules and --offload-modules take a list of words: kept as one string of blanks.
    if ((key == "recompute_modules" || key == "offload_modules") && !bare)
      while (value_next() && is_name(words[i + 1])) raw += " " + words[++i];
    if (key == "cp_comm_type" && !bare)
      while (value_next()) {
        const std::string& more = words[++i];
        if (more != raw)
          throw InputError(fmt::format("{}: --cp-comm-type {} {} ...: a type per layer is not modelled; give one type for "
                                       "every layer",
                                       source, raw, more));
      }
    const std::string value = bare ? "true" : resolve(raw);
    if (const auto r = refused_flags().find(key); r != refused_flags().end())
      throw InputError(fmt::format("{}: {}: not read from a launch: {}", source, flag_of(key), r->second));
    const bool read = model_flags().count(key) || plan_flags().count(key) || key == "nproc_per_node" || key == "nnodes";
    // Megatron's names of values strata reads: --encoder-seq-length is its alias of the
    // sequence length; --optimizer adam is what strata costs (others are refused below);
    // --transformer-impl local runs Megatron's own layers, with unfused attention.
    // (per-tensor current scaling: the FP8 strata costs, as its exports name it)
    if (key == "fp8_recipe") present.insert(key);
    if (key == "fp8_recipe" && value == "tensorwise") continue;
    if (key == "encoder_seq_length" || key == "optimizer" || key == "transformer_impl") {
      launch_values[key] = value;
      continue;
    }
    if (key == "moe_grouped_gemm" || key == "overlap_grad_reduce" || key == "overlap_param_gather" ||
        key == "moe_token_dispatcher_type" || key == "tp_comm_overlap")
      present.insert(key);
    if (!read) {
      if (ignored.insert(flag_of(key)).second)
        (costly_unmodelled_flags().count(key) ? out.costly : out.ignored).push_back(flag_of(key));
      continue;
    }
    if (const auto it = seen.find(key); it != seen.end()) {
      if (it->second != value)
        throw InputError(fmt::format("{}: {} given twice, as '{}' and '{}': keep one", source, flag_of(key), it->second,
                                     value));
      continue;
    }
    seen[key] = value;
    const bool shell = value.find('$') != std::string::npos || value.find('`') != std::string::npos;
    if (shell && (key == "nproc_per_node" || key == "nnodes")) {  // then --gpus says it
      // ($NAME or ${NAME...}: the name, to say why it did not resolve)
      const size_t from = raw.find_first_not_of("${");
      const std::string name = from == std::string::npos ? "" : raw.substr(from, raw.find_first_of("}:-", from) - from);
      out.world_unread += fmt::format("{}{} {} ({})", out.world_unread.empty() ? "" : ", ", flag_of(key), raw,
                                      ambiguous.count(name) ? "its variable is set to two values"
                                                            : "a shell expression strata does not resolve");
      continue;
    }
    if (shell)
      throw InputError(fmt::format("{}: {} {}: a shell expression strata does not evaluate (only NAME=value set in "
                                   "the same text is resolved); give the value",
                                   source, flag_of(key), raw));
    const Json v = value_of(value);
    if (key == "nproc_per_node" || key == "nnodes") {
      // torchrun's world; an elastic range (1:4) or "gpu" says no fixed count.
      if (v.is_number() && !(v.is_number_integer() && v.get<int64_t>() > 0))
        fail_field(source + ": " + flag_of(key), show_value(v),
                   "must be a positive integer (an elastic range such as 1:4, or gpu, leaves the count to --gpus)");
      if (v.is_number_integer()) {
        if (v.get<int64_t>() > (int64_t{1} << 24))
          fail_field(source + ": " + flag_of(key), show_value(v), "must be at most 2^24");
        (key == "nnodes" ? nnodes : nproc) = v.get<int64_t>();
      } else {
        out.world_unread += fmt::format("{}{} {} (no fixed count)", out.world_unread.empty() ? "" : ", ", flag_of(key), raw);
      }
      continue;
    }
    if (model_flags().count(key)) {
      out.model[key] = v;
    } else if (key == "no_gradient_accumulation_fusion" || key == "no_store_param_remainders") {
      if (!bare && !(v.is_boolean() && v.get<bool>()))
        fail_field(source + ": " + flag_of(key), show_value(v), "is a flag: it takes no value");
      out.plan[key == "no_store_param_remainders" ? "store_param_remainders" : "grad_accumulation_fusion"] = false;
    } else if (key == "attention_backend") {
      const std::string s = v.is_string() ? v.get<std::string>() : "";
      if (s != "flash" && s != "fused" && s != "unfused" && s != "local" && s != "auto")
        fail_field(source + ": " + flag_of(key), show_value(v), "must be one of flash, fused, unfused, local, auto");
      out.plan["attention"] = s == "flash" || s == "fused" ? "flash" : s == "auto" ? "auto" : "unfused";
    } else if (key == "microbatch_group_size_per_virtual_pipeline_stage") {
      out.plan["microbatch_group_size_per_vp_stage"] = v;
    } else {
      out.plan[key] = v;
    }
  }
  if (nproc > 0 && nnodes > 0) out.gpus = nproc * nnodes;
  else if (nproc > 0 && !seen.count("nnodes")) out.gpus = nproc;  // one node
  // What Megatron-LM assumes where a flag is absent (its arguments.py), not strata's
  // Llama-style defaults for a gated MLP.
  Json& m = out.model;
  // Megatron-DeepSpeed's --num-key-value-heads: grouped-query attention of that many groups.
  if (m.contains("num_key_value_heads")) {
    if (m.contains("num_query_groups"))
      throw InputError(fmt::format("{}: --num-key-value-heads and --num-query-groups both given: keep one", source));
    m["num_query_groups"] = m.at("num_key_value_heads");
    m["group_query_attention"] = true;
    m.erase("num_key_value_heads");
  }
  // --group-query-attention alone: Megatron's --num-query-groups default, 1 (multi-query).
  if (m.contains("group_query_attention") && m.at("group_query_attention") == true && !m.contains("num_query_groups"))
    m["num_query_groups"] = 1;
  if (m.contains("num_query_groups") && !(m.contains("group_query_attention") && m.at("group_query_attention") == true)) {
    m.erase("num_query_groups");  // read only with --group-query-attention
    out.ignored.push_back("--num-query-groups (without --group-query-attention)");
  }
  if (!m.contains("position_embedding_type") && !m.contains("use_rotary_position_embeddings"))
    m["position_embedding_type"] = "learned_absolute";
  if (!m.contains("normalization")) m["normalization"] = "LayerNorm";
  if (!m.contains("untie_embeddings_and_output_weights")) m["untie_embeddings_and_output_weights"] = false;
  if (!m.contains("disable_bias_linear")) m["add_bias_linear"] = true;
  for (const char* dropout : {"attention_dropout", "hidden_dropout"})
    if (!m.contains(dropout)) m[dropout] = 0.1;
  if (!m.contains("ffn_hidden_size") && m.contains("hidden_size") && m.at("hidden_size").is_number_integer()) {
    const int64_t h = m.at("hidden_size").get<int64_t>();
    if (h > 0 && h <= (int64_t{1} << 24))
      m["ffn_hidden_size"] = m.contains("swiglu") && m.at("swiglu") == true ? (8 * h / 3) / 64 * 64 : 4 * h;
  }
  // --encoder-seq-length: Megatron's alias of --seq-length (arguments.py sets one from the other).
  if (const auto e = launch_values.find("encoder_seq_length"); e != launch_values.end()) {
    const Json v = value_of(e->second);
    if (m.contains("seq_length") && m.at("seq_length") != v)
      throw InputError(fmt::format("{}: --encoder-seq-length {} and --seq-length {} disagree: keep one", source,
                                   e->second, m.at("seq_length").dump()));
    m["seq_length"] = v;
  }
  // YaRN is RoPE with its frequencies rescaled: the same costs.
  if (m.contains("position_embedding_type") && m.at("position_embedding_type") == "yarn")
    m["position_embedding_type"] = "rope";
  if (const auto o = launch_values.find("optimizer"); o != launch_values.end() && o->second != "adam")
    throw InputError(fmt::format("{}: --optimizer {}: not read from a launch: strata costs Adam (two fp32 states a "
                                 "parameter; drop the flag, or give --optimizer adam, to cost that)",
                                 source, o->second));
  if (const auto ti = launch_values.find("transformer_impl"); ti != launch_values.end()) {
    if (ti->second != "local" && ti->second != "transformer_engine" && ti->second != "inference_optimized")
      fail_field(source + ": --transformer-impl", show_value(Json(ti->second)),
                 "must be local or transformer_engine");
    if (ti->second == "local" && !out.plan.contains("attention") && !out.plan.contains("use_flash_attn"))
      out.plan["attention"] = "unfused";
  }
  // Absent flags mean what they mean to Megatron: no overlapped gradient reduction or
  // parameter gather (arguments.py defaults both off), no user buffers, and MoE tokens dispatched by
  // all-gather (TransformerConfig's moe_token_dispatcher_type).
  // Megatron-FSDP turns both on itself where it shards gradients (optim_grads: the reduction)
  // and parameters (optim_grads_params, its default: the gather too).
  std::string strategy;
  if (out.plan.contains("use_megatron_fsdp") && out.plan.at("use_megatron_fsdp") == true)
    strategy = out.plan.contains("data_parallel_sharding_strategy") &&
                       out.plan.at("data_parallel_sharding_strategy").is_string()
                   ? out.plan.at("data_parallel_sharding_strategy").get<std::string>()
                   : "optim_grads_params";
  const bool fsdp_reduce = strategy == "optim_grads" || strategy == "optim_grads_params",
             fsdp_gather = strategy == "optim_grads_params";
  if (!present.count("overlap_grad_reduce")) out.plan["overlap_grad_reduce"] = fsdp_reduce;
  if (!present.count("overlap_param_gather")) out.plan["overlap_param_gather"] = fsdp_gather;
  // No --tp-comm-overlap: no user buffers (a plan's "auto" runs them, stack.h).
  if (!present.count("tp_comm_overlap")) out.plan["tp_comm_overlap"] = false;
  const bool experts = m.contains("num_experts") && m.at("num_experts").is_number_integer() &&
                       m.at("num_experts").get<int64_t>() > 1;
  if (experts && !present.count("moe_token_dispatcher_type") && !out.plan.contains("moe_flex_dispatcher_backend") &&
      !out.plan.contains("moe_enable_deepep"))
    out.plan["moe_token_dispatcher_type"] = "allgather";
  if (experts && !present.count("moe_grouped_gemm")) out.costly.push_back("--moe-grouped-gemm absent (a loop of "
                                                                        "per-expert GEMMs; costed as grouped ones)");
  if (out.plan.contains("fp8_format") && !present.count("fp8_recipe"))
    out.costly.push_back("--fp8-recipe absent (Megatron's delayed scaling; costed as per-tensor current scaling, "
                         "tensorwise)");
  if (experts && m.contains("moe_expert_capacity_factor") && !m.at("moe_expert_capacity_factor").is_null())
    out.costly.push_back(fmt::format("--moe-expert-capacity-factor {} (tokens capped per expert; costed dropless)",
                                     m.at("moe_expert_capacity_factor").dump()));
  // Megatron's asserts on recompute, which a launch that breaks them never gets past.
  const std::string granularity =
      out.plan.contains("recompute_granularity") && out.plan.at("recompute_granularity").is_string()
          ? out.plan.at("recompute_granularity").get<std::string>()
          : "";
  if (granularity == "full" && !out.plan.contains("recompute_method") && !out.plan.contains("checkpoint_activations"))
    throw InputError(fmt::format("{}: --recompute-granularity full without --recompute-method: Megatron-core "
                                 "raises (give uniform with --recompute-num-layers 1, or block with the layers per "
                                 "stage)",
                                 source));
  if (granularity == "full" && out.plan.contains("recompute_method") && !out.plan.contains("recompute_num_layers"))
    throw InputError(fmt::format("{}: --recompute-granularity full --recompute-method {} without "
                                 "--recompute-num-layers: Megatron-core raises (give 1 with uniform for every layer, or "
                                 "the layers per stage with block)",
                                 source, out.plan.at("recompute_method").is_string()
                                             ? out.plan.at("recompute_method").get<std::string>()
                                             : out.plan.at("recompute_method").dump()));
  if (granularity == "selective" && out.plan.contains("recompute_method"))
    throw InputError(fmt::format("{}: --recompute-granularity selective with --recompute-method: Megatron-LM "
                                 "asserts (the method is for full recompute)",
                                 source));
  if (granularity == "selective" && out.plan.contains("recompute_num_layers"))
    throw InputError(fmt::format("{}: --recompute-granularity selective with --recompute-num-layers: Megatron-core "
                                 "raises (the count is for full recompute)",
                                 source));
  if (granularity == "full" && out.plan.contains("recompute_method") && out.plan.at("recompute_method") == "uniform" &&
      out.plan.contains("recompute_num_layers") && out.plan.at("recompute_num_layers") != 1)
    out.costly.push_back(fmt::format("--recompute-num-layers {} with uniform (checkpoints of that many layers; "
                                     "costed one layer each)",
                                     out.plan.at("recompute_num_layers").dump()));
  if (out.plan.contains("overlap_param_gather") && out.plan.at("overlap_param_gather") == true &&
      !out.plan.contains("use_distributed_optimizer") && !out.plan.contains("use_megatron_fsdp") &&
      !out.plan.contains("use_torch_fsdp2") && !out.plan.contains("zero_stage"))
    throw InputError(fmt::format("{}: --overlap-param-gather without --use-distributed-optimizer: Megatron-LM "
                                 "asserts (the parameters are gathered only where the optimizer shards them)",
                                 source));
  if (present.count("overlap_param_gather") && out.plan.at("overlap_param_gather") == true &&
      !(out.plan.contains("overlap_grad_reduce") && out.plan.at("overlap_grad_reduce") == true))
    throw InputError(fmt::format("{}: --overlap-param-gather without --overlap-grad-reduce: Megatron-LM asserts", source));
  // Without --cross-entropy-loss-fusion Megatron-LM runs the unfused loss.
  if (!out.plan.contains("cross_entropy_loss_fusion")) out.plan["cross_entropy_loss_fusion"] = false;
  // FP8 without --fp8-param-gather: Megatron's default, bf16 parameters.
  if (out.plan.contains("fp8_format") && !out.plan.contains("fp8_param_gather")) out.plan["fp8_param_gather"] = false;
  // Neither --bf16 nor --fp16 (nor FP8): Megatron trains in fp32.
  if (!out.plan.contains("bf16") && !out.plan.contains("fp16") && !out.plan.contains("fp8_format"))
    out.plan["precision"] = "fp32";
  return out;
}

LaunchInputs launch_inputs(const MegatronLaunch& launch, int64_t gpus, const std::string& source,
                           int64_t seq_length_override) {
  if (!launch.model.contains("vocab_size"))
    throw InputError(fmt::format("{}: --vocab-size: missing: Megatron-LM reads the vocabulary from its tokenizer, so "
                                 "give it as --vocab-size N (50257 for GPT-2's, 32000 for Llama 2's, 128256 for "
                                 "Llama 3's)",
                                 source));
  LaunchInputs in;
  in.model = model_from_json(launch.model, source);
  if (seq_length_override > 0) {
    in.model.S = seq_length_override;
    validate_model(in.model, "--seq-length");
  }
  Json plan = launch.plan;
  auto size = [&](const char* key) -> int64_t {
    const Json* v = plan.contains(key) ? &plan.at(key) : nullptr;
    if (!v) return 1;
    if (!v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > (int64_t{1} << 20))
      fail_field(source + ": " + flag_of(key), show_value(*v), "must be an integer in [1, 2^20]");
    return v->get<int64_t>();
  };
  const int64_t t = size("tensor_model_parallel_size"), p = size("pipeline_model_parallel_size"),
                c = size("context_parallel_size");
  // The embedding and the loss each in a layer's slot of the split: strata's layout does the
  // same wherever (L + 2) / (p v) slots divide and L does not (layout.h).
  auto set = [&](const char* key) { return plan.contains(key) && plan.at(key) == true; };
  const bool emb = set("account_for_embedding_in_pipeline_split"), loss = set("account_for_loss_in_pipeline_split");
  if (emb != loss)
    throw InputError(fmt::format("{}: --account-for-{}-in-pipeline-split without --account-for-{}-in-pipeline-split: "
                                 "strata's layout takes a slot for both or for neither",
                                 source, emb ? "embedding" : "loss", emb ? "loss" : "embedding"));
  plan.erase("account_for_embedding_in_pipeline_split");
  plan.erase("account_for_loss_in_pipeline_split");
  // Megatron-FSDP: its sharding strategy is the ZeRO stage (no_shard 0, optim 1, optim_grads
  // 2, optim_grads_params 3; 3 when not given, as strata has read --use-megatron-fsdp); it
  // runs with the distributed optimizer, which NVIDIA's launches also name. Megatron reads
  // the strategy only with it.
  if (plan.contains("data_parallel_sharding_strategy")) {
    const Json strategy = plan.at("data_parallel_sharding_strategy");
    plan.erase("data_parallel_sharding_strategy");
    if (set("use_megatron_fsdp")) {
      const std::string s = strategy.is_string() ? strategy.get<std::string>() : "";
      const int zero = s == "no_shard" ? 0 : s == "optim" ? 1 : s == "optim_grads" ? 2 : s == "optim_grads_params" ? 3 : -1;
      if (zero < 0)
        fail_field(source + ": --data-parallel-sharding-strategy", show_value(strategy),
                   "must be one of no_shard, optim, optim_grads, optim_grads_params");
      plan.erase("use_megatron_fsdp");
      plan["zero_stage"] = zero;
      plan.erase("use_distributed_optimizer");
    }
  }
  if (set("use_megatron_fsdp")) plan.erase("use_distributed_optimizer");
  // Megatron-DeepSpeed's --checkpoint-activations: every layer recomputed in full.
  if (plan.contains("checkpoint_activations")) {
    const bool on = set("checkpoint_activations");
    plan.erase("checkpoint_activations");
    if (on && plan.contains("recompute_granularity") && plan.at("recompute_granularity") != "full")
      throw InputError(fmt::format("{}: --checkpoint-activations and --recompute-granularity {} both given: keep one",
                                   source, plan.at("recompute_granularity").dump()));
    if (on) plan["recompute_granularity"] = "full";
  }
  // Megatron asserts --tp-comm-overlap only with sequence parallelism, which it turns off
  // at tensor-parallel size 1.
  if (set("tp_comm_overlap") && (t == 1 || !set("sequence_parallel")))
    throw InputError(fmt::format("{}: --tp-comm-overlap {}: Megatron-LM runs it only with --sequence-parallel and "
                                 "--tensor-model-parallel-size above 1 (it asserts)",
                                 source, t == 1 ? "at tensor-parallel size 1" : "without --sequence-parallel"));
  // Megatron reads --recompute-modules only with --recompute-granularity selective.
  if (plan.contains("recompute_modules") &&
      !(plan.contains("recompute_granularity") && plan.at("recompute_granularity") == "selective")) {
    plan.erase("recompute_modules");
  }
  // Megatron reads --offload-modules and its settings only with --fine-grained-activation-offloading.
  if (!plan.contains("fine_grained_activation_offloading"))
    for (const char* k : {"offload_modules", "activation_offload_fraction", "min_offloaded_tensor_size",
                          "delta_offload_bytes_across_pp_ranks"})
      plan.erase(k);
  // Megatron reads --optimizer-offload-fraction only with --optimizer-cpu-offload.
  if (plan.contains("optimizer_offload_fraction") && !plan.contains("optimizer_cpu_offload"))
    plan["optimizer_cpu_offload"] = false;
  for (const char* uneven : {"decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                             "pipeline_model_parallel_layout"}) {
    if (!plan.contains(uneven)) continue;
    if (emb)  // Megatron-core refuses the two ways of an uneven split together
      throw InputError(fmt::format("{}: {} and --account-for-embedding/loss-in-pipeline-split both given: keep one",
                                   source, flag_of(uneven)));
    if (plan.contains("num_layers_per_virtual_pipeline_stage"))
      throw InputError(fmt::format("{}: {} and --num-layers-per-virtual-pipeline-stage both given: give the chunks "
                                   "with --num-virtual-stages-per-pipeline-rank (or the layout's virtual stages)",
                                   source, flag_of(uneven)));
  }
  const int64_t slots = in.model.L + (emb ? 2 : 0);
  if (plan.contains("num_layers_per_virtual_pipeline_stage")) {
    const int64_t n = size("num_layers_per_virtual_pipeline_stage");
    for (const char* v : {"virtual_pipeline_model_parallel_size", "num_virtual_stages_per_pipeline_rank"})
      if (plan.contains(v))
        throw InputError(fmt::format("{}: --num-layers-per-virtual-pipeline-stage and {} both given: keep one", source,
                                     flag_of(v)));
    if (slots % (p * n) != 0)
      fail_field(source + ": --num-layers-per-virtual-pipeline-stage", std::to_string(n),
                 fmt::format("must divide the {} per pipeline stage ({} / {})", emb ? "layer slots" : "layers", slots, p));
    plan.erase("num_layers_per_virtual_pipeline_stage");
    if (slots / (p * n) > 1) plan["virtual_pipeline_model_parallel_size"] = slots / (p * n);
  }
  if (emb && p > 1) {
    const int64_t v = plan.contains("virtual_pipeline_model_parallel_size") ? size("virtual_pipeline_model_parallel_size")
                      : plan.contains("num_virtual_stages_per_pipeline_rank") ? size("num_virtual_stages_per_pipeline_rank")
                                                                              : 1;
    if (slots % (p * v) != 0)
      fail_field(source + ": --account-for-embedding-in-pipeline-split", "true",
                 fmt::format("needs the layers + 2 = {} to split over {} x {} model chunks", slots, p, v));
  }
  const int64_t world = gpus > 0 ? gpus : launch.gpus;
  if (world <= 0)
    throw InputError(launch.world_unread.empty()
                         ? fmt::format("{}: --gpus: missing: the GPU count (the launch gives no torchrun --nproc-per-node "
                                       "and --nnodes to take it from)",
                                       source)
                         : fmt::format("{}: --gpus: missing: the GPU count (the launch's {} gives none)", source,
                                       launch.world_unread));
  if (world % (t * p * c) != 0)
    fail_field("--gpus", std::to_string(world),
               fmt::format("must be a multiple of tensor x pipeline x context parallel = {} x {} x {}", t, p, c));
  plan["data_parallel_size"] = world / (t * p * c);
  in.plan = plan_from_json(plan, source);
  return in;
}

std::string megatron_launch_text(const std::string& file_or_flags) {
  std::error_code ec;
  if (file_or_flags.rfind("--", 0) != 0 && std::filesystem::is_regular_file(file_or_flags, ec))
    return read_text_file(file_or_flags, "--megatron-args", int64_t{16} << 20, "a launch script");
  if (file_or_flags.find("--") == std::string::npos)
    throw InputError(fmt::format("--megatron-args: '{}' is neither a readable file nor Megatron-LM flags "
                                 "(--tensor-model-parallel-size 8 ...)",
                                 file_or_flags));
  return file_or_flags;
}

}  // namespace strata
