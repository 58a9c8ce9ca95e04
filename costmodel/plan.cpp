// Plan loading, normalisation and checks; see plan.h.
#include "costmodel/plan.h"

#include "costmodel/layout.h"
#include "costmodel/schedule.h"
#include "costmodel/stack.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace strata {

const char* to_string(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::selective: return "selective";
    case Recompute::full: return "full";
  }
  return "?";
}

const char* to_string(ScheduleKind s) {
  switch (s) {
    case ScheduleKind::gpipe: return "gpipe";
    case ScheduleKind::one_f_one_b: return "1f1b";
    case ScheduleKind::interleaved: return "interleaved";
  }
  return "?";
}

const char* to_string(MoeDispatcher d) {
  switch (d) {
    case MoeDispatcher::alltoall: return "alltoall";
    case MoeDispatcher::allgather: return "allgather";
    case MoeDispatcher::deepep: return "deepep";
    case MoeDispatcher::hybridep: return "hybridep";
  }
  return "?";
}

const char* to_string(CpComm c) {
  switch (c) {
    case CpComm::automatic: return "auto";
    case CpComm::p2p: return "p2p";
    case CpComm::a2a: return "a2a";
    case CpComm::allgather: return "allgather";
  }
  return "?";
}

namespace {
// DeepSpeed-Ulysses' all-to-all gives each context-parallel rank the whole sequence of
// 1/c of the heads: the query heads and the key/value groups on a tensor-parallel rank
// must divide by c (Transformer Engine asserts both).
bool a2a_heads_divide(const ModelSpec& m, const Plan& p) {
  return p.c >= 1 && (m.A / p.t) % p.c == 0 && m.kv_heads_per_rank(p.t) % p.c == 0;
}
}  // namespace

CpComm resolve_cp_comm(const ModelSpec& m, const Cluster& cl, const Plan& p) {
  return cl.strata_stack ? CpComm::allgather : resolve_cp_comm(m, p);
}

CpComm resolve_cp_comm(const ModelSpec& m, const Plan& p) {
  if (p.cp_comm != CpComm::automatic) return p.cp_comm;
  if (!m.windowed()) return CpComm::p2p;
  return a2a_heads_divide(m, p) ? CpComm::a2a : CpComm::allgather;
}

namespace {

constexpr int64_t kMaxDegree = 1 << 20;
constexpr int64_t kMaxWorld = 1 << 24;
constexpr int64_t kMaxBatch = int64_t{1} << 30;

// A tensor type as this schema names it (fp32, bf16, fp16, fp8), from its own spelling or
// torch's ("float32", "torch.bfloat16", ...); anything else as given (a string), or "".
std::string dtype_word(const Json& v) {
  std::string t = v.is_string() ? v.get<std::string>() : "";
  if (t.rfind("torch.", 0) == 0) t = t.substr(6);
  return t == "float32" ? "fp32" : t == "bfloat16" ? "bf16" : t == "float16" ? "fp16"
       : t == "float8" || t == "uint8" ? "fp8" : t;
}

// Long name -> short alias (SPEC.md lists both).
const std::vector<std::pair<const char*, const char*>>& aliases() {
  static const std::vector<std::pair<const char*, const char*>> a = {
      {"tensor_parallel", "tp"},          {"pipeline_parallel", "pp"},  {"data_parallel", "dp"},
      {"context_parallel", "cp"},         {"virtual_pipeline_stages", "vp"}, {"micro_batch_size", "mbs"},
      {"global_batch_size", "gbs"},       {"zero_stage", "zero"},       {"sequence_parallel", "sp"},
      {"pipeline_schedule", "schedule"},  {"optimizer_offload_fraction", "offload"},
      {"expert_model_parallel_size", "ep"},   {"expert_tensor_parallel_size", "etp"}};
  return a;
}

Json true_or_null(const Json& v, const std::string& path, Json when_true) {
  return flag_value(v, path) ? when_true : Json();
}
// DeepSpeed's "bf16": {"enabled": true}, or a Megatron flag.
bool enabled(const Json& v, const std::string& path) {
  if (v.is_object()) {
    Fields f(v, path);
    const bool on = f.boolean_or("enabled", false);
    for (const auto& [key, value] : v.items()) f.ignore(key);  // its loss-scale settings
    return on;
  }
  return flag_value(v, path);
}

// Optimizer offload under other tools' names, onto optimizer_offload_fraction: Megatron-
// core's optimizer_cpu_offload (its optimizer_offload_fraction counts only with it, default
// 1), DeepSpeed's zero_optimization.offload_optimizer ({"device": "cpu", "ratio": r}; the
// older "cpu_offload": true) and a bare "offload_optimizer" ("cpu", "none" or a flag).
// NVMe and parameter offload (ZeRO-Infinity) are refused: not modelled.
void adopt_offload(Json& j, const std::string& source) {
  if (!j.is_object()) return;
  auto set_fraction = [&](const std::string& path, const Json& value) {
    if (j.contains("optimizer_offload_fraction") && !j.at("optimizer_offload_fraction").is_null() &&
        j.at("optimizer_offload_fraction") != value)
      fail_field(path, show_value(value),
                 fmt::format("means optimizer_offload_fraction {}, but it is {}: keep one", show_value(value),
                             show_value(j.at("optimizer_offload_fraction"))));
    j["optimizer_offload_fraction"] = value;
  };
  // A device: "cpu" offloads, "none" does not; anything else is named.
  auto device_offloads = [&](const Json& v, const std::string& path) {
    if (v.is_null() || v == "none") return false;
    if (v == "cpu") return true;
    if (v == "nvme")
      fail_field(path, "\"nvme\"", "is not modelled: strata offloads optimizer states to CPU memory only (\"cpu\")");
    fail_field(path, show_value(v), "must be \"cpu\" or \"none\"");
  };
  if (j.contains("optimizer_cpu_offload")) {
    const Json v = j.at("optimizer_cpu_offload");
    j.erase("optimizer_cpu_offload");
    if (v.is_null() || !flag_value(v, source + ".optimizer_cpu_offload")) {
      j.erase("optimizer_offload_fraction");  // Megatron reads the fraction only with the offload
    } else if (!j.contains("optimizer_offload_fraction") || j.at("optimizer_offload_fraction").is_null()) {
      j["optimizer_offload_fraction"] = 1.0;
    }
  }
  if (j.contains("offload_optimizer")) {
    const Json v = j.at("offload_optimizer");
    const std::string path = source + ".offload_optimizer";
    j.erase("offload_optimizer");
    const bool on = v.is_boolean() || v.is_number_integer() ? flag_value(v, path) : device_offloads(v, path);
    set_fraction(path, on ? Json(1.0) : Json(0.0));
  }
  if (!j.contains("zero_optimization") || !j.at("zero_optimization").is_object()) return;
  Json& z = j["zero_optimization"];
  const std::string zp = source + ".zero_optimization";
  // DeepSpeed's MiCS: ZeRO-3 sharded over groups of mics_shard_size ranks (0 or less: off;
  // DeepSpeed reads it with stage 3 only).
  if (z.contains("mics_shard_size")) {
    const Json v = z.at("mics_shard_size");
    z.erase("mics_shard_size");
    const bool stage3 = z.contains("stage") && z.at("stage") == Json(3);
    if (stage3 && !v.is_null() && !(v.is_number() && v.get<double>() <= 0)) j["mics_shard_size"] = v;
  }
  if (z.contains("offload_param")) {
    const Json& o = z.at("offload_param");
    const Json dev = o.is_object() && o.contains("device") ? o.at("device") : Json();
    if (!o.is_null() && !(o.is_object() && (dev.is_null() || dev == "none")))
      fail_field(zp + ".offload_param", show_value(o.is_object() && !dev.is_null() ? dev : o),
                 "is not modelled: strata offloads optimizer states (offload_optimizer), not parameters");
    z.erase("offload_param");
  }
  if (z.contains("cpu_offload")) {
    const bool on = !z.at("cpu_offload").is_null() && flag_value(z.at("cpu_offload"), zp + ".cpu_offload");
    z.erase("cpu_offload");
    if (on) set_fraction(zp + ".cpu_offload", Json(1.0));
  }
  if (z.contains("offload_optimizer")) {
    const Json o = z.at("offload_optimizer");
    const std::string path = zp + ".offload_optimizer";
    z.erase("offload_optimizer");
    if (o.is_null()) return;
    if (!o.is_object()) fail_field(path, show_value(o), "must be an object such as {\"device\": \"cpu\"}");
    Fields f(o, path);
    const Json* dev = f.peek("device");
    const bool on = device_offloads(dev ? *dev : Json(), path + ".device");
    f.ignore("device");
    const double ratio = f.real_or("ratio", 1.0, 0.0, 1.0);
    for (const auto& [key, value] : o.items()) f.ignore(key);  // pin_memory, buffer sizes, fast_init
    if (on) set_fraction(path, Json(ratio));
  }
}

// Megatron-LM's argument names (snake_case, as in its arguments.py and a config dump) and
// DeepSpeed's config keys for the fields of this schema, folded onto this schema's names;
// a field given under two names is an error.
void adopt_foreign_names(Json& j, const std::string& source) {
  if (!j.is_object()) return;
  for (const auto& [from, to] : std::initializer_list<std::pair<const char*, const char*>>{
           {"tensor_model_parallel_size", "tensor_parallel"},
           {"pipeline_model_parallel_size", "pipeline_parallel"},
           {"context_parallel_size", "context_parallel"},
           {"data_parallel_size", "data_parallel"},
           {"virtual_pipeline_model_parallel_size", "virtual_pipeline_stages"},
           {"num_virtual_stages_per_pipeline_rank", "virtual_pipeline_stages"},
           {"train_micro_batch_size_per_gpu", "micro_batch_size"},
           {"train_batch_size", "global_batch_size"},
           {"recompute_granularity", "recompute"},
           {"world_size", "num_gpus"},
           {"num_layers_in_first_pipeline_stage", "decoder_first_pipeline_num_layers"},
           {"num_layers_in_last_pipeline_stage", "decoder_last_pipeline_num_layers"},
           {"data_parallel_replicate_degree", "num_distributed_optimizer_instances"}})
    adopt_key(j, source, from, to);
  adopt_key(j, source, "recompute_activations", "recompute",
            [](const Json& v, const std::string& path) { return true_or_null(v, path, "selective"); });
  if (j.contains("num_layers_per_virtual_pipeline_stage") && !j.at("num_layers_per_virtual_pipeline_stage").is_null())
    fail_field(source + ".num_layers_per_virtual_pipeline_stage", show_value(j.at("num_layers_per_virtual_pipeline_stage")),
               "is not read (it needs the model's layers): give virtual_pipeline_stages = num_layers / "
               "(pipeline_parallel * num_layers_per_virtual_pipeline_stage)");
  j.erase("num_layers_per_virtual_pipeline_stage");
  // The ZeRO stage: Megatron's distributed optimizer (1), its FSDP (3), DeepSpeed's section.
  adopt_key(j, source, "use_distributed_optimizer", "zero_stage",
            [](const Json& v, const std::string& path) { return true_or_null(v, path, 1); });
  for (const char* fsdp : {"use_torch_fsdp2", "use_megatron_fsdp"})
    adopt_key(j, source, fsdp, "zero_stage",
              [](const Json& v, const std::string& path) { return true_or_null(v, path, 3); });
  adopt_offload(j, source);
  adopt_key(j, source, "zero_optimization", "zero_stage", [](const Json& v, const std::string& path) {
    Fields f(v, path);
    const Json stage = f.integer_or("stage", 0, 0, 3);
    for (const auto& [key, value] : v.items()) f.ignore(key);  // bucket sizes, overlap, offload
    return stage;
  });
  // Precision from Megatron's --bf16 / --fp16 / --fp8-format (FP8 runs set --bf16 too) or
  // DeepSpeed's "bf16" / "fp16" sections.
  {
    const bool bf16 = j.contains("bf16") && !j.at("bf16").is_null() && enabled(j.at("bf16"), source + ".bf16");
    const bool fp16 = j.contains("fp16") && !j.at("fp16").is_null() && enabled(j.at("fp16"), source + ".fp16");
    bool fp8 = false;
    for (const char* fp8_key : {"fp8_format", "fp8"}) {  // Megatron's --fp8-format is stored as fp8
      if (!j.contains(fp8_key)) continue;
      const Json& v = j.at(fp8_key);
      if (!v.is_null() && !(v.is_boolean() && !v.get<bool>())) {
        if (!(v.is_boolean() || (v.is_string() && (v == "e4m3" || v == "hybrid"))))
          fail_field(source + "." + fp8_key, show_value(v), "must be \"e4m3\", \"hybrid\", true, false or null");
        fp8 = true;
      }
    }
    if (bf16 && fp16) fail_field(source + ".fp16", "true", "cannot be combined with bf16");
    const char* stated = nullptr;
    for (const char* k : {"bf16", "fp16", "fp8_format", "fp8"})
      if (!stated && j.contains(k)) stated = k;
    if (stated && j.contains("precision"))
      throw InputError(fmt::format("{}.precision: given twice (as 'precision' and '{}'): keep one", source, stated));
    for (const char* k : {"bf16", "fp16", "fp8_format", "fp8"}) j.erase(k);
    // Megatron trains in fp32 when neither --bf16 nor --fp16 is set.
    if (stated) j["precision"] = fp8 ? "fp8" : bf16 ? "bf16" : fp16 ? "fp16" : "fp32";
  }
  // Megatron-LM's cp_comm_type is a list in a config dump (a type per layer): one type for
  // every layer is read as that type.
  if (j.contains("cp_comm_type") && j.at("cp_comm_type").is_array()) {
    const Json& list = j.at("cp_comm_type");
    const bool one = !list.empty() && std::all_of(list.begin(), list.end(), [&](const Json& x) { return x == list.front(); });
    if (!one) fail_field(source + ".cp_comm_type", show_value(list), "must name one type for every layer (a mix is not modelled)");
    j["cp_comm_type"] = Json(list.front());
  }
  adopt_key(j, source, "use_flash_attn", "attention",
            [](const Json& v, const std::string& path) { return true_or_null(v, path, "flash"); });
  // The main gradients' type: Megatron-LM's --accumulate-allreduce-grads-in-fp32 and
  // --grad-reduce-in-bf16 (flags: false says nothing), DeepSpeed's data_types.grad_accum_dtype
  // and communication_data_type.
  adopt_key(j, source, "accumulate_allreduce_grads_in_fp32", "grad_reduce_in_fp32",
            [](const Json& v, const std::string& path) { return true_or_null(v, path, true); });
  adopt_key(j, source, "grad_reduce_in_bf16", "grad_reduce_in_fp32",
            [](const Json& v, const std::string& path) { return true_or_null(v, path, false); });
  if (j.contains("data_types") && j.at("data_types").is_object()) {
    const Json dt = j.at("data_types");
    const std::string path = source + ".data_types";
    Fields f(dt, path);
    const Json* g = f.peek("grad_accum_dtype");
    if (g && !g->is_null()) {
      if (!g->is_string() || (*g != "fp32" && *g != "bf16" && *g != "fp16"))
        fail_field(path + ".grad_accum_dtype", show_value(*g), "must be \"fp32\", \"bf16\" or \"fp16\"");
      j["grad_accum_dtype"] = *g == "fp32";
      adopt_key(j, path, "grad_accum_dtype", "grad_reduce_in_fp32");
    }
    for (const auto& [key, value] : dt.items()) f.ignore(key);
    j.erase("data_types");
  }
  // Megatron-core's main_grads_dtype (the precision-aware optimizer's gradients: its
  // gradient buffer's type): bf16 turns fp32 reduction off; fp32, its default (in every
  // config dump), says nothing (Megatron reduces fp16 runs in fp16 and honours
  // --grad-reduce-in-bf16 beside it).
  adopt_key(j, source, "main_grads_dtype", "grad_reduce_in_fp32", [](const Json& v, const std::string& path) {
    const std::string t = dtype_word(v);
    if (t != "fp32" && t != "bf16") fail_field(path, show_value(v), "must be \"fp32\" or \"bf16\"");
    return t == "bf16" ? Json(false) : Json();
  });
  // DeepSpeed's type of the gradients' reduction (one type for both in strata).
  adopt_key(j, source, "communication_data_type", "grad_reduce_in_fp32", [](const Json& v, const std::string& path) {
    if (!v.is_string() || (v != "fp32" && v != "bf16" && v != "fp16"))
      fail_field(path, show_value(v), "must be \"fp32\", \"bf16\" or \"fp16\"");
    return Json(v == "fp32");
  });
  // Full recompute of every layer (uniform) or of the first recompute_num_layers of each
  // chunk (block, this schema's reading of recompute_num_layers).
  if (j.contains("recompute_method") && j.at("recompute_method").is_null()) j.erase("recompute_method");
  if (j.contains("recompute_method")) {
    const Json& v = j.at("recompute_method");
    if (!v.is_string() || (v != "uniform" && v != "block"))
      fail_field(source + ".recompute_method", show_value(v), "must be \"uniform\" or \"block\"");
    if (v == "uniform") j.erase("recompute_num_layers");  // every layer, however many per checkpoint
    j.erase("recompute_method");
  }
}

}  // namespace

PipelineLayout parse_pipeline_layout(const std::string& text, const std::string& field) {
  // Megatron-core's reading (PipelineParallelLayerLayout.parse_str_to_list): commas dropped,
  // "(...)*n" unrolled, then "x*n"; here in one pass over the text without its commas,
  // refusing what it would misread.
  constexpr size_t kMaxTokens = size_t{1} << 20;
  std::string t;
  for (char ch : text)
    if (ch != ',') t += ch;
  auto fail = [&](const std::string& rule) { fail_field(field, "\"" + text + "\"", rule); };
  auto count_at = [&](size_t* i) {  // the n of "*n" at t[*i] == '*'
    size_t j = *i + 1;
    int64_t n = 0;
    while (j < t.size() && std::isdigit(static_cast<unsigned char>(t[j]))) {
      n = n * 10 + (t[j] - '0');
      if (n > static_cast<int64_t>(kMaxTokens)) fail(fmt::format("repeats more than {} times", kMaxTokens));
      ++j;
    }
    if (j == *i + 1) fail(fmt::format("needs a count after '{}*'", t.substr(0, *i)));
    *i = j;
    return static_cast<size_t>(n);
  };
  std::string flat;  // the unrolled tokens: E, t, L and |
  std::string group;
  bool in_group = false;
  auto add = [&](const std::string& what, size_t times) {
    std::string& into = in_group ? group : flat;
    if (into.size() + what.size() * times > kMaxTokens)
      fail(fmt::format("unrolls to more than {} layers and separators", kMaxTokens));
    for (size_t k = 0; k < times; ++k) into += what;
  };
  for (size_t i = 0; i < t.size();) {
    const char ch = t[i];
    auto before = [&] { return t.substr(0, i); };  // for messages: where, in the text without commas
    if (ch == '(') {
      if (in_group) fail(fmt::format("nests parentheses after '{}' (Megatron-core unrolls one level)", before()));
      in_group = true;
      group.clear();
      ++i;
    } else if (ch == ')') {
      if (!in_group) fail(fmt::format("closes a parenthesis after '{}' that was not opened", before()));
      if (group.empty()) fail(fmt::format("has an empty group \"()\" after '{}'", before()));
      ++i;
      if (i >= t.size() || t[i] != '*') fail(fmt::format("needs \"*n\" after '{}'", before()));
      const size_t n = count_at(&i);
      in_group = false;
      add(group, n);
    } else if (ch == 'E' || ch == 't' || ch == 'm' || ch == 'L' || ch == '|') {
      ++i;
      size_t n = 1;
      if (i < t.size() && t[i] == '*') n = count_at(&i);
      add(std::string(1, ch), n);
    } else {
      fail(fmt::format("has '{}' after '{}': the characters are E (embedding), t (decoder layer), m (multi-token "
                       "prediction layer), L (loss), | (between virtual stages), parentheses, * with a count, and commas",
                       ch, before()));
    }
  }
  if (in_group) fail("leaves a parenthesis open");
  PipelineLayout out;
  out.text = text;
  out.layers.push_back(0);
  size_t embeddings = 0, losses = 0;
  for (size_t k = 0; k < flat.size(); ++k) {
    const char ch = flat[k];
    if (ch == '|') out.layers.push_back(0);
    else if (ch == 't') ++out.layers.back();
    else if (ch == 'm') ++out.mtp;
    else if (ch == 'E') ++embeddings;
    else if (ch == 'L') ++losses;
  }
  if (embeddings != 1 || losses != 1) fail("must hold the embedding 'E' and the loss 'L' exactly once each");
  // Megatron-core: every decoder layer before the first 'm', all 'm's in one virtual stage.
  if (const size_t first_m = flat.find('m'); first_m != std::string::npos) {
    if (flat.find('t', first_m) != std::string::npos)
      fail("places a decoder layer 't' after a multi-token prediction layer 'm': the 'm's follow every 't'");
    if (flat.find('|', first_m) != std::string::npos)
      fail("puts the multi-token prediction layers 'm' in a virtual stage before the loss 'L': strata costs them "
           "with the loss, in its virtual stage (Megatron-core's standalone placement is not modelled)");
  }
  // Megatron-core asks for E first and L last among the layers; strata also places them on
  // the first and the last virtual stage (stage 0's first chunk, the last stage's last).
  if (flat.front() != 'E')
    fail("must begin with the embedding 'E': the first virtual stage holds it, before any layer");
  if (flat.back() != 'L') fail("must end with the loss 'L': the last virtual stage holds it, after every layer");
  return out;
}

namespace {
// The words of a module list: a JSON array of names, or one string of names separated by
// blanks, '+' or ','. `kinds` names the list in its messages.
std::vector<std::string> module_words(const Json& v, const std::string& field, const char* kinds) {
  std::vector<std::string> names;
  if (v.is_array()) {
    for (const Json& x : v) {
      if (!x.is_string()) fail_field(field, show_value(v), "must be a list of module names");
      names.push_back(x.get<std::string>());
    }
  } else if (v.is_string()) {
    std::string word;
    for (char ch : v.get<std::string>() + " ") {
      if (ch == ' ' || ch == '+' || ch == ',') {
        if (!word.empty()) names.push_back(word);
        word.clear();
      } else {
        word += ch;
      }
    }
  } else {
    fail_field(field, show_value(v), fmt::format("must be a list of module names ({})", kinds));
  }
  if (names.empty()) fail_field(field, show_value(v), fmt::format("must name at least one module ({})", kinds));
  return names;
}
// A table of module bits by Megatron's names: a name's bit (0: none), the bits' names
// joined by `sep` or as a JSON list, in the table's order.
using ModuleName = std::pair<unsigned, const char*>;
template <size_t N>
unsigned module_bit(const std::string& name, const ModuleName (&table)[N]) {
  for (const auto& [bit, n] : table)
    if (name == n) return bit;
  return 0;
}
template <size_t N>
std::string module_text(unsigned bits, const char* sep, const ModuleName (&table)[N]) {
  std::string s;
  for (const auto& [bit, name] : table)
    if (bits & bit) s += (s.empty() ? "" : sep) + std::string(name);
  return s;
}
template <size_t N>
Json module_list(unsigned bits, const ModuleName (&table)[N]) {
  Json list = Json::array();
  for (const auto& [bit, name] : table)
    if (bits & bit) list.push_back(name);
  return list;
}

// The modules strata recomputes, by Megatron's name.
constexpr ModuleName kRecomputeModuleNames[] = {{kRecomputeCoreAttn, "core_attn"},
                                                {kRecomputeLayernorm, "layernorm"},
                                                {kRecomputeMoeAct, "moe_act"},
                                                {kRecomputeMlaUpProj, "mla_up_proj"},
                                                {kRecomputeMlp, "mlp"}};
constexpr const char* kRecomputeModuleList = "core_attn, layernorm, moe_act, mla_up_proj, mlp";
}  // namespace

// Megatron-core's --recompute-modules: a list of names (a JSON array, or a string of names
// separated by blanks or '+', as an inline plan gives it) onto RecomputeModule bits.
unsigned parse_recompute_modules(const Json& v, const std::string& field) {
  const std::vector<std::string> names = module_words(v, field, kRecomputeModuleList);
  unsigned bits = 0;
  for (const std::string& n : names) {
    if (const unsigned bit = module_bit(n, kRecomputeModuleNames)) bits |= bit;
    else if (n == "moe" || n == "shared_experts")
      fail_field(field, "\"" + n + "\"", std::string("is not modelled: strata recomputes ") + kRecomputeModuleList);
    else
      fail_field(field, "\"" + n + "\"", std::string("must be one of ") + kRecomputeModuleList);
  }
  return bits;
}

std::string recompute_modules_text(unsigned bits, const char* sep) { return module_text(bits, sep, kRecomputeModuleNames); }

namespace {

constexpr ModuleName kOffloadModuleNames[] = {
    {kOffloadAttnNorm, "attn_norm"},   {kOffloadQkvLinear, "qkv_linear"}, {kOffloadCoreAttn, "core_attn"},
    {kOffloadAttnProj, "attn_proj"},   {kOffloadMlpNorm, "mlp_norm"},     {kOffloadExpertFc1, "expert_fc1"},
    {kOffloadMoeAct, "moe_act"}};
constexpr const char* kOffloadModuleList = "attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act";
}  // namespace

unsigned parse_offload_modules(const Json& v, const std::string& field) {
  unsigned bits = 0;
  for (const std::string& n : module_words(v, field, kOffloadModuleList)) {
    if (const unsigned bit = module_bit(n, kOffloadModuleNames)) bits |= bit;
    else if (n == "gdp_qkv")
      fail_field(field, "\"gdp_qkv\"", "is a gated delta-net layer's, which strata's models do not have");
    else if (n == "fused_group_mlp")
      fail_field(field, "\"fused_group_mlp\"", "is not modelled: it needs Transformer Engine's op fuser "
                                               "(--use-transformer-engine-op-fuser), whose fused grouped MLP strata "
                                               "does not cost; offload expert_fc1 and moe_act instead");
    else
      fail_field(field, "\"" + n + "\"", std::string("must be one of ") + kOffloadModuleList);
  }
  // Megatron-core's rule (TransformerConfig): the projection's input is the core's output,
  // which the core's backward needs.
  if ((bits & kOffloadAttnProj) && !(bits & kOffloadCoreAttn))
    fail_field(field, show_value(v), "offloads attn_proj without core_attn: the projection's input is the attention "
                                     "core's output, which core_attn's backward needs too (Megatron-core's rule)");
  return bits;
}

std::string offload_modules_text(unsigned bits, const char* sep) { return module_text(bits, sep, kOffloadModuleNames); }

Plan plan_from_json(const Json& in, const std::string& source) {
  if (!in.is_object()) throw InputError(fmt::format("{}: {} is invalid: must be a JSON object", source, show_value(in)));
  // The output of estimate --json (or a plan of plan --json) holds the plan under "plan".
  if (in.contains("plan") && in.at("plan").is_object())
    throw InputError(fmt::format("{}.plan: unknown field: this looks like the output of strata estimate or plan "
                                 "--json; pass the object under its \"plan\" key as the plan",
                                 source));
  // Fold other tools' names and short keys onto the long ones; both present is an error.
  Json j = in;
  adopt_foreign_names(j, source);
  for (const auto& [lng, shrt] : aliases()) {
    if (j.contains(shrt)) {
      if (j.contains(lng))
        throw InputError(fmt::format("{}.{}: given twice (as '{}' and '{}'): keep one", source, lng, lng, shrt));
      j[lng] = j[shrt];
      j.erase(shrt);
    }
  }
  Fields f(j, source);
  // Every field is known before any value is checked: a misspelt or foreign key is named
  // as such, not reported through the rule of a known key beside it.
  f.reject_unknown_except({"tensor_parallel", "pipeline_parallel", "data_parallel", "context_parallel",
                           "virtual_pipeline_stages", "microbatch_group_size_per_vp_stage", "micro_batch_size",
                           "global_batch_size", "zero_stage", "recompute", "recompute_num_layers", "selective_ac_option", "sequence_parallel",
                           "precision", "pipeline_schedule", "attention", "overlap_grad_reduce", "overlap_param_gather",
                           "tp_comm_overlap", "grad_accumulation_fusion", "cross_entropy_loss_fusion",
                           "software_stack", "cp_comm_type",
                           "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                           "decoder_last_pipeline_num_layers", "gradient_accumulation_steps", "num_gpus",
                           "optimizer_offload_fraction", "expert_model_parallel_size", "recompute_modules",
                           "expert_tensor_parallel_size", "grad_reduce_in_fp32", "fp8_param_gather",
                           "use_precision_aware_optimizer",
                           "exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype", "store_param_remainders",
                           "fine_grained_activation_offloading", "offload_modules", "activation_offload_fraction",
                           "min_offloaded_tensor_size", "delta_offload_bytes_across_pp_ranks",
                           "num_distributed_optimizer_instances", "data_parallel_shard_size",
                           "data_parallel_shard_degree", "mics_shard_size", "moe_token_dispatcher_type",
                           "moe_flex_dispatcher_backend", "moe_enable_deepep", "overlap_moe_expert_parallel_comm",
                           "moe_a2a_overlap", "delay_wgrad_compute", "description"});
  Plan p;
  p.t = f.integer_or("tensor_parallel", 1, 1, kMaxDegree);
  p.p = f.integer_or("pipeline_parallel", 1, 1, kMaxDegree);
  p.d = f.integer_or("data_parallel", 1, 1, kMaxDegree);
  p.c = f.integer_or("context_parallel", 1, 1, kMaxDegree);
  const bool v_given = f.peek("virtual_pipeline_stages") && !f.peek("virtual_pipeline_stages")->is_null();
  p.v = f.integer_or("virtual_pipeline_stages", 1, 1, kMaxDegree);
  // An uneven split (Megatron-LM's): a layout, whose virtual stages give the chunks, or the
  // layers of the first and the last stage.
  if (const Json* lj = f.peek("pipeline_model_parallel_layout"); lj && !lj->is_null()) {
    const std::string field = source + ".pipeline_model_parallel_layout";
    if (!lj->is_string() || lj->get<std::string>().empty())
      fail_field(field, show_value(*lj), "must be a layout string such as \"Et|(tt|)*3,tL\"");
    auto lay = std::make_shared<PipelineLayout>(parse_pipeline_layout(lj->get<std::string>(), field));
    const int64_t n = static_cast<int64_t>(lay->layers.size());
    if (n % p.p != 0)
      fail_field(field, "\"" + lay->text + "\"",
                 fmt::format("has {} virtual stages, not a multiple of pipeline_parallel={}", n, p.p));
    if (v_given && p.v * p.p != n)
      fail_field(field, "\"" + lay->text + "\"",
                 fmt::format("has {} virtual stages, not pipeline_parallel * virtual_pipeline_stages = {} x {}", n, p.p, p.v));
    p.v = n / p.p;
    p.layout = std::move(lay);
  }
  f.ignore("pipeline_model_parallel_layout");
  auto edge_layers = [&](const char* key) -> int64_t {  // 0: not set
    const Json* v = f.peek(key);
    if (!v || v->is_null()) {
      f.ignore(key);
      return 0;
    }
    const int64_t n = f.integer_or(key, 0, 1, 100000);
    if (p.layout) fail_field(source + "." + key, std::to_string(n), "cannot be combined with pipeline_model_parallel_layout");
    return n;
  };
  p.first_stage_layers = edge_layers("decoder_first_pipeline_num_layers");
  p.last_stage_layers = edge_layers("decoder_last_pipeline_num_layers");
  p.vp_group = f.integer_or("microbatch_group_size_per_vp_stage", 0, 0, kMaxBatch);
  p.mbs = f.integer_or("micro_batch_size", 1, 1, kMaxBatch);
  p.gbs = f.integer_or("global_batch_size", 0, 0, kMaxBatch);
  const bool zero_given = f.peek("zero_stage") && !f.peek("zero_stage")->is_null();
  p.zero = static_cast<int>(f.integer_or("zero_stage", 0, 0, 3));
  const bool rc_given = f.peek("recompute") && !f.peek("recompute")->is_null();
  const std::string rc = f.choice_or("recompute", "none", {"none", "selective", "full"});
  p.recompute = rc == "none" ? Recompute::none : rc == "selective" ? Recompute::selective : Recompute::full;
  p.recompute_layers = f.integer_or("recompute_num_layers", 0, 0, 100000);
  if (const Json* rm = f.peek("recompute_modules"); rm && !rm->is_null()) {
    const std::string field = source + ".recompute_modules";
    if (!rc_given) p.recompute = Recompute::selective;  // (Megatron reads the modules with selective)
    if (p.recompute != Recompute::selective)
      fail_field(field, show_value(*rm), fmt::format("needs recompute selective, not {}", to_string(p.recompute)));
    p.recompute_modules = parse_recompute_modules(*rm, field);
  }
  f.ignore("recompute_modules");
  // torchtitan's [activation_checkpoint] selective_ac_option: "op", its op-level policy, in
  // place of Megatron's modules; its other form, an integer N (every N-th layer
  // checkpointed whole), is full recompute of fewer layers, which recompute_num_layers says.
  if (const Json* ac = f.peek("selective_ac_option"); ac && !ac->is_null()) {
    const std::string field = source + ".selective_ac_option";
    const bool every_nth = ac->is_number_integer() || (ac->is_string() && !ac->get<std::string>().empty() &&
                                                       ac->get<std::string>().find_first_not_of("0123456789") ==
                                                           std::string::npos);
    if (every_nth)
      fail_field(field, show_value(*ac),
                 "must be \"op\": an integer N is torchtitan's layer policy (every N-th layer checkpointed "
                 "whole), which strata costs as recompute=full with recompute_num_layers (the first layers of "
                 "each model chunk, as Megatron's block method: as many as torchtitan's L/N, not the same ones)");
    if (!ac->is_string() || ac->get<std::string>() != "op")
      fail_field(field, show_value(*ac), "must be \"op\" (torchtitan's op-level selective recompute)");
    if (!rc_given) p.recompute = Recompute::selective;
    if (p.recompute != Recompute::selective)
      fail_field(field, "\"op\"", fmt::format("needs recompute selective, not {}", to_string(p.recompute)));
    if (const Json* rm = f.peek("recompute_modules"); rm && !rm->is_null())
      fail_field(field, "\"op\"", "cannot be combined with recompute_modules: the op policy decides what is "
                                   "recomputed in place of Megatron's modules");
    p.selective_ac_op = true;
  }
  f.ignore("selective_ac_option");
  p.sp = f.boolean_or("sequence_parallel", false);
  p.precision_given = j.contains("precision");
  const std::string pr = f.choice_or("precision", "bf16", {"fp32", "bf16", "fp16", "fp8"});
  p.precision = pr == "fp32" ? Precision::fp32 : pr == "bf16" ? Precision::bf16
              : pr == "fp16" ? Precision::fp16 : Precision::fp8;
  const std::string sc = f.choice_or("pipeline_schedule", "1f1b", {"1f1b", "gpipe", "interleaved"});
  p.gpipe = sc == "gpipe";
  if (sc == "interleaved" && p.v < 2)
    fail_field(source + ".pipeline_schedule", "\"interleaved\"", "needs virtual_pipeline_stages >= 2");
  if (p.gpipe && p.v > 1)
    fail_field(source + ".pipeline_schedule", "\"gpipe\"", "cannot be combined with virtual_pipeline_stages > 1");
  const std::string at = f.choice_or("attention", "auto", {"auto", "flash", "unfused"});
  p.attention = at == "auto" ? AttentionChoice::automatic : at == "flash" ? AttentionChoice::flash : AttentionChoice::unfused;
  auto tristate = [&](const char* key) {
    const Json* v = f.peek(key);
    if (!v || v->is_null() || (v->is_string() && *v == "auto")) {
      f.ignore(key);
      return Tristate::automatic;
    }
    return f.boolean_or(key, false) ? Tristate::on : Tristate::off;
  };
  p.overlap_grad_reduce = tristate("overlap_grad_reduce");
  p.overlap_param_gather = tristate("overlap_param_gather");
  p.tp_comm_overlap = tristate("tp_comm_overlap");
  p.grad_accumulation_fusion = tristate("grad_accumulation_fusion");
  p.cross_entropy_loss_fusion = tristate("cross_entropy_loss_fusion");
  p.grad_reduce_in_fp32 = tristate("grad_reduce_in_fp32");
  p.fp8_param_gather = tristate("fp8_param_gather");
  // Megatron-core's precision-aware optimizer and the types of its tensors (torch's names
  // too: "float32", "bfloat16", "torch.bfloat16", ...).
  p.precision_aware_optimizer = f.boolean_or("use_precision_aware_optimizer", false);
  auto dtype_of = [&](const char* key, std::initializer_list<const char*> allowed) -> OptDtype {
    const Json* v = f.peek(key);
    if (!v || v->is_null()) {
      f.ignore(key);
      return OptDtype::fp32;
    }
    const std::string name = dtype_word(*v);
    f.ignore(key);
    const std::string field = source + "." + key;
    if (std::find_if(allowed.begin(), allowed.end(), [&](const char* a) { return name == a; }) == allowed.end()) {
      std::string list;
      for (const char* a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
      fail_field(field, show_value(*v), "must be one of " + list);
    }
    if (!p.precision_aware_optimizer && name != "fp32")
      fail_field(field, show_value(*v), "needs use_precision_aware_optimizer (Megatron reads it only then)");
    return name == "fp32" ? OptDtype::fp32 : name == "bf16" ? OptDtype::bf16 : name == "fp16" ? OptDtype::fp16
                                                                                : OptDtype::fp8;
  };
  p.exp_avg_dtype = dtype_of("exp_avg_dtype", {"fp32", "bf16", "fp16", "fp8"});
  p.exp_avg_sq_dtype = dtype_of("exp_avg_sq_dtype", {"fp32", "bf16", "fp16", "fp8"});
  p.main_params_dtype = dtype_of("main_params_dtype", {"fp32", "fp16"});
  p.store_param_remainders = f.boolean_or("store_param_remainders", true);
  const std::string ss = f.choice_or("software_stack", "auto", {"auto", "legacy", "modern"});
  p.software_stack = ss == "auto" ? StackChoice::automatic : ss == "legacy" ? StackChoice::legacy : StackChoice::modern;
  // Megatron's spelling, or Transformer Engine's "all_gather".
  const std::string cc = f.choice_or("cp_comm_type", "auto", {"auto", "p2p", "a2a", "allgather", "all_gather"});
  p.cp_comm = cc == "auto" ? CpComm::automatic : cc == "p2p" ? CpComm::p2p : cc == "a2a" ? CpComm::a2a : CpComm::allgather;
  p.offload = f.real_or("optimizer_offload_fraction", 0.0, 0.0, 1.0);
  p.ep = f.integer_or("expert_model_parallel_size", 1, 1, kMaxDegree);
  p.etp = f.integer_or("expert_tensor_parallel_size", 0, 1, kMaxDegree);  // (absent: 0, tensor_parallel)
  // The MoE token dispatcher: Megatron reads the flex backend only with
  // moe_token_dispatcher_type flex (and ignores it otherwise); its older moe_enable_deepep
  // asks for flex.
  {
    const Json* type = f.peek("moe_token_dispatcher_type");
    const bool typed = type && !type->is_null();
    const std::string kind = typed ? f.choice_or("moe_token_dispatcher_type", "alltoall", {"alltoall", "flex", "allgather"})
                                   : (f.ignore("moe_token_dispatcher_type"), std::string("alltoall"));
    const Json* backend = f.peek("moe_flex_dispatcher_backend");
    const bool backed = backend && !backend->is_null();
    const std::string be = backed ? f.choice_or("moe_flex_dispatcher_backend", "deepep", {"deepep", "hybridep"})
                                  : (f.ignore("moe_flex_dispatcher_backend"), std::string("deepep"));
    const Json* deepep = f.peek("moe_enable_deepep");
    const bool old_deepep = deepep && !deepep->is_null() && f.boolean_or("moe_enable_deepep", false);
    f.ignore("moe_enable_deepep");
    if (old_deepep && backed && be != "deepep")
      fail_field(source + ".moe_enable_deepep", "true",
                 fmt::format("contradicts moe_flex_dispatcher_backend {}: keep one", be));
    if (old_deepep && kind != "flex")
      fail_field(source + ".moe_enable_deepep", "true", "needs moe_token_dispatcher_type flex (Megatron asserts it)");
    p.moe_dispatcher = kind == "flex"        ? (be == "hybridep" ? MoeDispatcher::hybridep : MoeDispatcher::deepep)
                       : kind == "allgather" ? MoeDispatcher::allgather
                                             : MoeDispatcher::alltoall;
  }
  // The expert exchanges beside another micro-batch's compute (Megatron's name, or
  // Megatron-Bridge's performance scripts') and delay_wgrad_compute, which the recipes run
  // with it.
  {
    const bool megatron = f.peek("overlap_moe_expert_parallel_comm") != nullptr, bridge = f.peek("moe_a2a_overlap") != nullptr;
    if (megatron && bridge)
      throw InputError(fmt::format("{}.overlap_moe_expert_parallel_comm: given twice (and as moe_a2a_overlap): keep one",
                                   source));
    p.moe_a2a_overlap = f.boolean_or(bridge ? "moe_a2a_overlap" : "overlap_moe_expert_parallel_comm", false);
    f.ignore("overlap_moe_expert_parallel_comm");
    f.ignore("moe_a2a_overlap");
    p.delay_wgrad = f.boolean_or("delay_wgrad_compute", false);
    if (p.delay_wgrad && !p.moe_a2a_overlap)
      fail_field(source + ".delay_wgrad_compute", "true",
                 "needs overlap_moe_expert_parallel_comm (Megatron asserts it; strata costs it only with it)");
  }
  // Fine-grained activation offloading: on with a list of modules (Megatron-core asserts
  // one), unless fine_grained_activation_offloading says false (then, as Megatron does,
  // the list and its settings are not read).
  {
    const Json* on = f.peek("fine_grained_activation_offloading");
    const Json* mods = f.peek("offload_modules");
    const bool listed = mods && !mods->is_null();
    const bool enabled = on && !on->is_null() ? f.boolean_or("fine_grained_activation_offloading", false) : listed;
    f.ignore("fine_grained_activation_offloading");
    if (enabled && !listed)
      fail_field(source + ".fine_grained_activation_offloading", "true",
                 std::string("needs offload_modules, the modules whose activations go to the host (") +
                     kOffloadModuleList + ")");
    if (enabled) {
      p.offload_modules = parse_offload_modules(*mods, source + ".offload_modules");
      p.activation_offload_fraction = f.real_or("activation_offload_fraction", 1.0, 0.0, 1.0);
      p.min_offloaded_tensor_size = f.integer_or("min_offloaded_tensor_size", kMinOffloadedTensorSize, 0,
                                                 int64_t{1} << 40);
      // (It keeps pp_rank x delta bytes on the GPU: nothing with one stage.)
      if (const Json* d = f.peek("delta_offload_bytes_across_pp_ranks");
          d && !d->is_null() && !(d->is_number() && d->get<double>() == 0) && p.p > 1)
        fail_field(source + ".delta_offload_bytes_across_pp_ranks", show_value(*d),
                   "is not modelled: strata offloads the same share on every pipeline stage (leave it 0)");
    }
    for (const char* k : {"offload_modules", "activation_offload_fraction", "min_offloaded_tensor_size",
                          "delta_offload_bytes_across_pp_ranks"})
      f.ignore(k);
  }
  // Hybrid sharding: the instances, or the replicas of one shard group out of the data x
  // context parallel ones (data_parallel_shard_size, DeepSpeed's mics_shard_size), or
  // torchtitan's data_parallel_shard_degree, whose FSDP groups are that many data-parallel
  // ranks times the context-parallel ones (and which means FSDP: ZeRO-3 unless said).
  {
    const Json* inst = f.peek("num_distributed_optimizer_instances");
    auto given = [&](const char* k) {
      const Json* v = f.peek(k);
      return v && !v->is_null() && !(v->is_number_integer() && v->get<int64_t>() == -1);
    };
    const char* keys[] = {"data_parallel_shard_size", "mics_shard_size", "data_parallel_shard_degree"};
    const char* key = nullptr;
    for (const char* k : keys) {
      if (!given(k)) continue;
      if (key)
        throw InputError(fmt::format("{}.{}: given twice (as '{}' and '{}'): keep one", source, k, key, k));
      key = k;
    }
    p.dp_instances = f.integer_or("num_distributed_optimizer_instances", 1, 1, kMaxDegree);
    // (torchtitan's -1: the replicas the replicate degree leaves.)
    if (key) {
      const bool torchtitan = std::string_view(key) == "data_parallel_shard_degree";
      const int64_t replicas = p.d * p.c;
      const int64_t sz = f.integer_or(key, 1, 1, kMaxDegree) * (torchtitan ? p.c : 1);
      std::string field = source;
      field += std::string_view(key) == "mics_shard_size" ? ".zero_optimization." : ".";
      field += key;
      const std::string shown = show_value(*f.peek(key));
      if (replicas % sz != 0)
        fail_field(field, shown,
                   fmt::format("must divide data_parallel x context_parallel = {} (the replicas it shards over{})",
                               replicas,
                               torchtitan ? fmt::format("; torchtitan's degree counts data-parallel ranks, times "
                                                        "context_parallel={}", p.c)
                                          : std::string()));
      if (inst && !inst->is_null() && p.dp_instances != replicas / sz)
        fail_field(field, shown,
                   fmt::format("disagrees with num_distributed_optimizer_instances (data_parallel_replicate_degree)={}: "
                               "{} replicas in shards of {} make {} instances", p.dp_instances, replicas, sz,
                               replicas / sz));
      p.dp_instances = replicas / sz;
      if (torchtitan && !zero_given) p.zero = 3;
    }
    for (const char* k : keys) f.ignore(k);
  }
  const double world = static_cast<double>(p.t) * static_cast<double>(p.p) * static_cast<double>(p.d) *
                       static_cast<double>(p.c);
  if (world > static_cast<double>(kMaxWorld))
    fail_field(source + ".tensor_parallel*pipeline_parallel*data_parallel*context_parallel",
               fmt::format("{}", world), fmt::format("must be at most {} GPUs", kMaxWorld));
  // Derived fields (as estimate --json prints them) are accepted when consistent.
  const int64_t gas = f.integer_or("gradient_accumulation_steps", 0, 0, kMaxBatch);
  const int64_t gpus = f.integer_or("num_gpus", 0, 0, kMaxWorld);
  f.ignore("description");
  f.reject_unknown();
  if (gas > 0) {
    if (static_cast<double>(gas) * static_cast<double>(p.mbs) * static_cast<double>(p.d) > static_cast<double>(kMaxBatch))
      fail_field(source + ".gradient_accumulation_steps", std::to_string(gas),
                 fmt::format("gives a global batch above {}", kMaxBatch));
    if (p.gbs == 0) p.gbs = gas * p.mbs * p.d;
    else if (p.gbs != gas * p.mbs * p.d)
      fail_field(source + ".gradient_accumulation_steps", std::to_string(gas),
                 fmt::format("must equal global_batch_size / (micro_batch_size * data_parallel) = {}/{}", p.gbs,
                             p.mbs * p.d));
  }
  if (gpus > 0 && gpus != p.t * p.p * p.d * p.c)
    fail_field(source + ".num_gpus", std::to_string(gpus),
               fmt::format("must equal tensor*pipeline*data*context parallel = {}", p.t * p.p * p.d * p.c));
  // No global batch given: one micro-batch per data-parallel rank (Megatron's default), or
  // with virtual stages the fewest the interleaved schedule takes, one per stage.
  if (p.gbs == 0) p.gbs = p.mbs * p.d * (p.v > 1 ? p.p : 1);
  if (p.gbs > kMaxBatch)
    fail_field(source + ".global_batch_size", std::to_string(p.gbs), fmt::format("must be at most {}", kMaxBatch));
  if (p.t == 1) p.sp = false;  // sequence parallelism is a no-op without tensor parallelism
  return p;
}

Json parse_inline_pairs(const std::string& text, const std::string& what) {
  Json j = Json::object();
  size_t pos = 0;
  std::string last_key;
  if (text.empty()) throw InputError(what + ": empty; expected key=value pairs such as tp=8,pp=4");
  for (size_t i = 0; i < text.size(); ++i)
    if (text[i] < 0x21 || text[i] > 0x7e)  // (char may be signed: bytes >= 0x80 are negative)
      throw InputError(fmt::format("{}: byte {} is 0x{:02x}; key=value pairs are printable ASCII without spaces", what, i,
                                   static_cast<unsigned char>(text[i])));
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? text.size() + 1 : comma + 1;
    if (item.empty() && last_key == "pipeline_model_parallel_layout") continue;  // a layout's doubled comma
    if (item.empty())
      throw InputError(fmt::format("{}: '{}' has an empty pair at byte {}: key=value pairs are separated by single "
                                   "commas, with none before the first or after the last",
                                   what, text, pos - 1 > text.size() ? text.size() : pos - 1));
    const size_t eq = item.find('=');
    // A pipeline layout's own (cosmetic) commas: the pieces after it belong to it.
    if (eq == std::string::npos && last_key == "pipeline_model_parallel_layout") {
      j[last_key].get_ref<std::string&>() += "," + item;
      continue;
    }
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      throw InputError(fmt::format("{}: '{}' is invalid: must be key=value", what, item));
    const std::string key = item.substr(0, eq), val = item.substr(eq + 1);
    if (j.contains(key)) throw InputError(fmt::format("{}: key '{}' given twice", what, key));
    last_key = key;
    if (key == "pipeline_model_parallel_layout") {  // text, whatever it looks like
      j[key] = val;
      continue;
    }
    bool is_int = !val.empty() && val.size() <= 18;
    for (size_t i = 0; i < val.size(); ++i)
      if (!(std::isdigit(static_cast<unsigned char>(val[i])) || (i == 0 && val[i] == '-' && val.size() > 1))) is_int = false;
    // A decimal (an offload fraction): digits with one point, nothing else.
    bool is_decimal = !is_int && val.size() <= 24 && std::count(val.begin(), val.end(), '.') == 1 &&
                      std::any_of(val.begin(), val.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); });
    for (size_t i = 0; i < val.size() && is_decimal; ++i)
      if (!(std::isdigit(static_cast<unsigned char>(val[i])) || val[i] == '.' || (i == 0 && val[i] == '-'))) is_decimal = false;
    if (is_int) {
      j[key] = std::stoll(val);
    } else if (is_decimal) {
      j[key] = std::strtod(val.c_str(), nullptr);
    } else if (val == "true" || val == "false") {
      j[key] = val == "true";
    } else {
      j[key] = val;
    }
  }
  return j;
}

Plan load_plan(const std::string& s) {
  std::error_code ec;
  if (s.find('=') == std::string::npos) {
    if (!std::filesystem::is_regular_file(s, ec))
      throw InputError(fmt::format("--plan: '{}' is neither key=value pairs (tp=8,pp=4,...) nor a readable file", s));
    return plan_from_json(read_json_file(s, "--plan"), "plan");
  }
  return plan_from_json(parse_inline_pairs(s, "--plan"), "plan");
}

namespace {
Json tristate_json(Tristate t) { return t == Tristate::automatic ? Json("auto") : Json(t == Tristate::on); }
}  // namespace

const char* to_string(OptDtype t) {
  switch (t) {
    case OptDtype::fp32: return "fp32";
    case OptDtype::bf16: return "bf16";
    case OptDtype::fp16: return "fp16";
    case OptDtype::fp8: return "fp8";
  }
  return "fp32";
}

Json plan_to_json(const Plan& p) {
  Json j{{"tensor_parallel", p.t},
         {"pipeline_parallel", p.p},
         {"data_parallel", p.d},
         {"context_parallel", p.c},
         {"virtual_pipeline_stages", p.v},
         {"micro_batch_size", p.mbs},
         {"global_batch_size", p.gbs},
         {"zero_stage", p.zero},
         {"recompute", to_string(p.recompute)},
         {"recompute_num_layers", p.recompute_layers},
         {"sequence_parallel", p.sp},
         {"precision", to_string(p.precision)},
         {"pipeline_schedule", p.gpipe ? "gpipe" : "1f1b"},
         {"attention", p.attention == AttentionChoice::automatic ? "auto"
                       : p.attention == AttentionChoice::flash ? "flash" : "unfused"},
         {"overlap_grad_reduce", tristate_json(p.overlap_grad_reduce)},
         {"overlap_param_gather", tristate_json(p.overlap_param_gather)},
         {"tp_comm_overlap", tristate_json(p.tp_comm_overlap)},
         {"grad_accumulation_fusion", tristate_json(p.grad_accumulation_fusion)},
         {"cross_entropy_loss_fusion", tristate_json(p.cross_entropy_loss_fusion)},
         {"software_stack", p.software_stack == StackChoice::automatic ? "auto"
                            : p.software_stack == StackChoice::legacy  ? "legacy" : "modern"},
         {"num_gpus", p.world_size()},
         {"gradient_accumulation_steps", p.mbs * p.d > 0 ? p.gbs / (p.mbs * p.d) : 0}};
  if (p.v > 1 && p.mbs * p.d > 0) j["microbatch_group_size_per_vp_stage"] = p.vp_group_size();
  if (p.layout) j["pipeline_model_parallel_layout"] = p.layout->text;
  if (p.first_stage_layers > 0) j["decoder_first_pipeline_num_layers"] = p.first_stage_layers;
  if (p.last_stage_layers > 0) j["decoder_last_pipeline_num_layers"] = p.last_stage_layers;
  if (p.cp_comm != CpComm::automatic) j["cp_comm_type"] = to_string(p.cp_comm);
  if (p.moe_dispatcher == MoeDispatcher::allgather) j["moe_token_dispatcher_type"] = "allgather";
  if (p.moe_a2a_overlap) j["overlap_moe_expert_parallel_comm"] = true;
  if (p.delay_wgrad) j["delay_wgrad_compute"] = true;
  if (p.flex()) {
    j["moe_token_dispatcher_type"] = "flex";
    j["moe_flex_dispatcher_backend"] = to_string(p.moe_dispatcher);
  }
  if (p.grad_reduce_in_fp32 != Tristate::automatic) j["grad_reduce_in_fp32"] = p.grad_reduce_in_fp32 == Tristate::on;
  if (p.fp8_param_gather != Tristate::automatic) j["fp8_param_gather"] = p.fp8_param_gather == Tristate::on;
  if (p.precision_aware_optimizer) {
    j["use_precision_aware_optimizer"] = true;
    j["exp_avg_dtype"] = to_string(p.exp_avg_dtype);
    j["exp_avg_sq_dtype"] = to_string(p.exp_avg_sq_dtype);
    j["main_params_dtype"] = to_string(p.main_params_dtype);
    j["store_param_remainders"] = p.store_param_remainders;
  }
  if (p.offload > 0) j["optimizer_offload_fraction"] = p.offload;
  if (p.ep > 1) j["expert_model_parallel_size"] = p.ep;
  if (p.etp > 0 && p.etp != p.t) j["expert_tensor_parallel_size"] = p.etp;
  if (p.op_sac()) {
    j["selective_ac_option"] = "op";
  } else if (p.recompute == Recompute::selective && p.recompute_modules != kRecomputeCoreAttn) {
    j["recompute_modules"] = module_list(p.recompute_modules, kRecomputeModuleNames);
  }
  if (p.dp_instances > 1) j["num_distributed_optimizer_instances"] = p.dp_instances;
  if (p.offload_modules) {
    j["fine_grained_activation_offloading"] = true;
    j["offload_modules"] = module_list(p.offload_modules, kOffloadModuleNames);
    j["activation_offload_fraction"] = p.activation_offload_fraction;
    j["min_offloaded_tensor_size"] = p.min_offloaded_tensor_size;
  }
  return j;
}

std::string plan_to_inline(const Plan& p) {
  std::string s = fmt::format("tp={},pp={},dp={}", p.t, p.p, p.d);
  if (p.c > 1) s += fmt::format(",cp={}", p.c);
  if (p.v > 1) s += fmt::format(",vp={}", p.v);
  if (p.vp_group > 0) s += fmt::format(",microbatch_group_size_per_vp_stage={}", p.vp_group);
  if (p.layout) {  // without its cosmetic commas, which would read as separators
    std::string text = p.layout->text;
    text.erase(std::remove(text.begin(), text.end(), ','), text.end());
    s += ",pipeline_model_parallel_layout=" + text;
  }
  if (p.first_stage_layers > 0) s += fmt::format(",decoder_first_pipeline_num_layers={}", p.first_stage_layers);
  if (p.last_stage_layers > 0) s += fmt::format(",decoder_last_pipeline_num_layers={}", p.last_stage_layers);
  s += fmt::format(",mbs={},gbs={},zero={},recompute={}", p.mbs, p.gbs, p.zero, to_string(p.recompute));
  if (p.recompute_layers > 0) s += fmt::format(",recompute_num_layers={}", p.recompute_layers);
  if (p.sp) s += ",sp=1";
  s += fmt::format(",precision={}", to_string(p.precision));
  if (p.gpipe) s += ",schedule=gpipe";
  if (p.attention != AttentionChoice::automatic)
    s += p.attention == AttentionChoice::flash ? ",attention=flash" : ",attention=unfused";
  auto tri = [&](const char* k, Tristate t) {
    if (t != Tristate::automatic) s += fmt::format(",{}={}", k, t == Tristate::on ? 1 : 0);
  };
  tri("overlap_grad_reduce", p.overlap_grad_reduce);
  tri("overlap_param_gather", p.overlap_param_gather);
  tri("tp_comm_overlap", p.tp_comm_overlap);
  tri("grad_accumulation_fusion", p.grad_accumulation_fusion);
  tri("cross_entropy_loss_fusion", p.cross_entropy_loss_fusion);
  tri("grad_reduce_in_fp32", p.grad_reduce_in_fp32);
  tri("fp8_param_gather", p.fp8_param_gather);
  if (p.precision_aware_optimizer) {
    s += ",use_precision_aware_optimizer=1";
    if (p.exp_avg_dtype != OptDtype::fp32) s += fmt::format(",exp_avg_dtype={}", to_string(p.exp_avg_dtype));
    if (p.exp_avg_sq_dtype != OptDtype::fp32) s += fmt::format(",exp_avg_sq_dtype={}", to_string(p.exp_avg_sq_dtype));
    if (p.main_params_dtype != OptDtype::fp32) s += fmt::format(",main_params_dtype={}", to_string(p.main_params_dtype));
    if (!p.store_param_remainders) s += ",store_param_remainders=0";
  }
  if (p.software_stack != StackChoice::automatic)
    s += p.software_stack == StackChoice::legacy ? ",software_stack=legacy" : ",software_stack=modern";
  if (p.cp_comm != CpComm::automatic) s += fmt::format(",cp_comm_type={}", to_string(p.cp_comm));
  if (p.moe_dispatcher == MoeDispatcher::allgather) s += ",moe_token_dispatcher_type=allgather";
  if (p.moe_a2a_overlap) s += ",overlap_moe_expert_parallel_comm=1";
  if (p.delay_wgrad) s += ",delay_wgrad_compute=1";
  if (p.flex())
    s += fmt::format(",moe_token_dispatcher_type=flex,moe_flex_dispatcher_backend={}", to_string(p.moe_dispatcher));
  if (p.offload > 0) s += fmt::format(",offload={}", p.offload);
  if (p.ep > 1) s += fmt::format(",ep={}", p.ep);
  if (p.etp > 0 && p.etp != p.t) s += fmt::format(",etp={}", p.etp);
  if (p.op_sac())
    s += ",selective_ac_option=op";
  else if (p.recompute == Recompute::selective && p.recompute_modules != kRecomputeCoreAttn)
    s += ",recompute_modules=" + recompute_modules_text(p.recompute_modules, "+");
  if (p.dp_instances > 1) s += fmt::format(",num_distributed_optimizer_instances={}", p.dp_instances);
  if (p.offload_modules) {
    s += ",offload_modules=" + offload_modules_text(p.offload_modules, "+");
    if (p.activation_offload_fraction != 1.0) s += fmt::format(",activation_offload_fraction={}", p.activation_offload_fraction);
    if (p.min_offloaded_tensor_size != kMinOffloadedTensorSize)
      s += fmt::format(",min_offloaded_tensor_size={}", p.min_offloaded_tensor_size);
  }
  return s;
}

void interleaved_reasons(const Plan& p, std::vector<Reason>* r, bool messages) {
  auto add = [&](const char* key, const auto& message) {
    r->push_back({key, messages ? std::string(message()) : std::string()});
  };
  const int64_t mb = p.microbatches(), g = p.vp_group_size();
  if (mb < p.p)
    add("vp_microbatches", [&] { return fmt::format("interleaved schedule needs at least pipeline_parallel={} micro-batches "
                                       "per step (global_batch_size / (micro_batch_size * data_parallel)), has {}",
                                       p.p, mb); });
  else if (p.vp_group > 0 && (p.vp_group < p.p || p.vp_group > mb))
    add("vp_group", [&] { return fmt::format("microbatch_group_size_per_vp_stage={} must lie between pipeline_parallel={} "
                                             "and the micro-batches per step, {}", p.vp_group, p.p, mb); });
  else if (mb % g != 0 && mb % g < p.p)
    add("vp_group", [&] { return fmt::format("microbatch_group_size_per_vp_stage={} leaves a last group of {} micro-batches "
                                             "({} mod {}), fewer than pipeline_parallel={} (Megatron-core's rule: none or at "
                                             "least pipeline_parallel)", g, mb % g, mb, g, p.p); });
}

namespace {

// check_plan's rules on experts (a mixture-of-experts model, or a plan with ep > 1).
template <class Add>
void moe_reasons(const ModelSpec& m, const Cluster& cl, const Plan& p, const Add& add) {
  const int64_t etp = p.expert_tp();
  if (m.moe() && m.Fs % p.t != 0)
    add("tp_ffn", [&] { return fmt::format("tensor_parallel={} must divide moe_shared_expert_intermediate_size={}",
                                           p.t, m.Fs); });
  if (m.moe() && m.Fe % etp != 0)  // (not structural for the search: etp varies below (t, p, c))
    add("etp_ffn", [&] { return fmt::format("expert_tensor_parallel_size={} must divide moe_ffn_hidden_size={}", etp,
                                            m.Fe); });
  if (p.ep > 1 && !m.moe())
    add("ep_dense", [&] { return fmt::format("expert_model_parallel_size={} needs a mixture-of-experts model "
                                             "(num_experts > 1); {} is dense", p.ep, m.name); });
  if (m.moe() && m.E % p.ep != 0)
    add("ep_experts", [&] { return fmt::format("expert_model_parallel_size={} must divide num_experts={}", p.ep, m.E); });
  if (m.moe() && (p.t * p.replicas()) % (etp * p.ep) != 0)
    add("ep_dp", [&] { return fmt::format("expert_tensor_parallel_size x expert_model_parallel_size = {} x {} must "
                                          "divide tensor x data x context parallel = {} (the experts' ranks fold over "
                                          "those of the dense layers)", etp, p.ep, p.t * p.replicas()); });
  if (m.moe() && p.t > 1 && !p.sp)
    add("moe_sp", [&] { return fmt::format("a mixture-of-experts model with tensor_parallel={} needs sequence_parallel "
                                           "(Megatron-core's rule)", p.t); });
  if (m.moe() && cl.strata_stack)
    add("moe_strata", [&] { return fmt::format("{} runs the strata executor, which has no mixture-of-experts layer; "
                                               "plan {} on a GPU cluster preset", cl.name, m.name); });
  if (p.moe_dispatcher != MoeDispatcher::alltoall && !m.moe())
    add("moe_dispatcher", [&] { return fmt::format("moe_token_dispatcher_type={} needs a mixture-of-experts model; {} "
                                                   "is dense", p.flex() ? "flex" : "allgather", m.name); });
  else if (p.flex() && etp * p.ep == 1)
    add("moe_dispatcher", [&] { return std::string("moe_token_dispatcher_type=flex needs expert_tensor_parallel_size x "
                                                   "expert_model_parallel_size above 1 (Megatron asserts it)"); });
  else if (p.flex() && etp > 1)
    add("moe_dispatcher", [&] { return fmt::format("moe_token_dispatcher_type=flex with expert_tensor_parallel_size={} "
                                                   "is not modelled: give etp=1, as the recipes that run it do", etp); });
  // Megatron's asserts for overlap_moe_expert_parallel_comm.
  if (p.moe_a2a_overlap) {
    const char* why = !m.moe() || p.ep <= 1 ? "needs expert parallelism (expert_model_parallel_size > 1)"
                      : p.p > 1 && p.v <= 1 ? "needs virtual_pipeline_stages with pipeline_parallel > 1"
                      : p.moe_dispatcher == MoeDispatcher::allgather ? "needs the alltoall or flex token dispatcher"
                      : p.recompute == Recompute::full ? "does not run with full recompute"
                      : p.precision == Precision::fp32 ? "needs bf16, fp16 or fp8"
                                                       : nullptr;
    if (why) add("a2a_overlap", [&] { return std::string("overlap_moe_expert_parallel_comm ") + why + " (Megatron asserts it)"; });
  }
}

}  // namespace

std::vector<Reason> check_plan(const ModelSpec& m, const Cluster& cl, const Plan& p, bool messages) {
  std::vector<Reason> r;
  // Messages are built only when asked for: the planner checks millions of plans.
  auto add = [&](const char* key, const auto& message) {
    r.push_back({key, messages ? std::string(message()) : std::string()});
  };
  // Fewer key/value groups than ranks: each group is replicated on t/G ranks (ModelSpec::
  // kv_heads_per_rank), which the strata executor does not do.
  const bool kv_split = m.G % p.t == 0 || (p.t % m.G == 0 && !cl.strata_stack);
  if (m.A % p.t != 0 || !kv_split)
    add("tp_heads", [&] {
      return cl.strata_stack
                 ? fmt::format("tensor_parallel={} must divide num_attention_heads={} and num_query_groups={} (the "
                               "strata executor splits both)", p.t, m.A, m.G)
                 : fmt::format("tensor_parallel={} must divide num_attention_heads={}, and divide num_query_groups={} "
                               "or be a multiple of it (groups replicated over tensor-parallel ranks)", p.t, m.A, m.G);
    });
  if (p.recompute_layers > 0 && p.recompute != Recompute::full)
    add("recompute_layers", [&] { return fmt::format("recompute_num_layers={} needs recompute=full", p.recompute_layers); });
  if (m.mla() && cl.strata_stack)
    add("mla_strata", [&] { return fmt::format("{} has multi-latent attention, which the strata executor of {} does not "
                                               "run", m.name, cl.name); });
  if (m.F % p.t != 0 && (!m.moe() || m.mixed()))  // (a mixed model's dense layers)
    add("tp_ffn", [&] { return fmt::format("tensor_parallel={} must divide ffn_hidden_size={}{}", p.t, m.F,
                                           m.moe() ? " (the dense layers' MLP)" : ""); });
  if (m.moe() || p.ep > 1 || p.moe_dispatcher != MoeDispatcher::alltoall || p.moe_a2a_overlap) moe_reasons(m, cl, p, add);
  if (!m.moe() && p.recompute == Recompute::selective && (p.recompute_modules & kRecomputeMoeAct))
    add("moe_act", [&] { return fmt::format("recompute_modules moe_act needs a mixture-of-experts model; {} is dense", m.name); });
  if (!m.mla() && p.recomputes(kRecomputeMlaUpProj))
    add("mla_up_proj", [&] { return fmt::format("recompute_modules mla_up_proj needs multi-latent attention; {} has none",
                                                m.name); });

  if (p.c > 1 && m.S % (2 * p.c) != 0)
    add("cp_seq", [&] { return fmt::format("context_parallel={} needs seq_length={} divisible by 2*context_parallel "
                              "(load-balanced causal attention)", p.c, m.S); });
  // Megatron's context parallelism runs ring attention over fused kernels; the strata
  // executor also runs it over its unfused attention (each chunk against the gathered keys).
  if (p.c > 1 && p.attention == AttentionChoice::unfused && !cl.strata_stack)
    add("cp_attention", [&] { return "context_parallel > 1 needs attention=flash (ring attention over fused kernels)"; });
  if (p.c > 1 && p.cp_comm != CpComm::automatic) {
    if (cl.strata_stack && p.cp_comm != CpComm::allgather)
      add("cp_comm", [&] { return fmt::format("cp_comm_type={}: {} runs the strata executor, which gathers the keys and "
                                             "values (allgather; leave it auto)", to_string(p.cp_comm), cl.name); });
    else if (p.cp_comm == CpComm::a2a && !a2a_heads_divide(m, p))
      add("cp_comm", [&] { return fmt::format("cp_comm_type=a2a needs context_parallel={} to divide the {} attention heads "
                                             "and {} key/value groups on each of tensor_parallel={} ranks (each rank takes "
                                             "1/{} of them over the whole sequence)", p.c, m.A / p.t,
                                             m.kv_heads_per_rank(p.t), p.t, p.c); });
    else if (p.cp_comm == CpComm::p2p && m.windowed() && !cl.strata_stack)
      add("cp_comm", [&] { return fmt::format("cp_comm_type=p2p cannot run window_size={} (sliding-window attention): "
                                             "Transformer Engine's ring takes full causal masks only; use a2a or allgather",
                                             m.window_size); });
  }
  if (p.sp && p.t > 1 && (m.S / p.c) % p.t != 0)
    add("sp_seq", [&] { return fmt::format("sequence_parallel needs seq_length/context_parallel={} divisible by tensor_parallel={}",
                              m.S / p.c, p.t); });
  if (p.explicit_split()) {
    // The plan's own split (layout.h): its rules instead of strata's (a layout's chunks may
    // be empty, as Megatron-core allows).
    if (p.v > 1 && p.p < 2)
      add("vp_needs_pp", [&] { return fmt::format("virtual_pipeline_stages={} needs pipeline_parallel >= 2", p.v); });
    else if (std::string why = split_problem(m.L, p); !why.empty())
      add("uneven_split", [&] { return why; });
    else if (p.layout && p.layout->mtp != m.mtp_layers)  // (Megatron-core asserts the same)
      add("uneven_split", [&] {
        return fmt::format("pipeline_model_parallel_layout holds {} multi-token prediction layers ('m'), not the model's "
                           "mtp_num_layers={}: {}",
                           p.layout->mtp, m.mtp_layers,
                           m.mtp_layers > 0 ? fmt::format("end the layout with \"{}L\", in the loss's virtual stage",
                                                          m.mtp_layers == 1 ? std::string("m") : fmt::format("m*{}", m.mtp_layers))
                                            : std::string("drop them, or give the model mtp_num_layers"));
      });
  } else if (p.v > 1) {
    if (p.p < 2) add("vp_needs_pp", [&] { return fmt::format("virtual_pipeline_stages={} needs pipeline_parallel >= 2", p.v); });
    // Uneven splits are costed as Megatron's first/last-stage options give them: the
    // embedding and output layer in a layer's slot when L + 2 divides, else as even as
    // possible (make_layout); every chunk needs a layer.
    if (m.L < p.p * p.v)
      add("layers_vp", [&] { return fmt::format("num_layers={} must be at least pipeline_parallel*virtual_pipeline_stages={} "
                                   "(a layer in every model chunk)",
                                   m.L, p.p * p.v); });
  } else if (p.p > m.L) {
    add("layers_pp", [&] { return fmt::format("pipeline_parallel={} exceeds num_layers={}", p.p, m.L); });
  } else if (m.L % p.p != 0 && (m.L + 2) % p.p == 0 && (m.L + 2) / p.p < 2) {
    add("layers_pp", [&] { return fmt::format("pipeline_parallel={} leaves the first and last stage without a layer", p.p); });
  }
  if (p.gbs % (p.mbs * p.d) != 0)
    add("batch_divisible", [&] { return fmt::format("global_batch_size={} must be divisible by micro_batch_size*data_parallel={}",
                                       p.gbs, p.mbs * p.d); });
  else if (p.v > 1)
    interleaved_reasons(p, &r, messages);
  if (p.gbs % (p.mbs * p.d) == 0 &&
      walk_steps(p.schedule(), p.p, p.v, p.microbatches()) > static_cast<double>(kMaxWalkSteps))
    add("schedule_too_long", [&] {
      return fmt::format("a {} schedule of {} micro-batches x {} stages x {} chunks is longer than the {} steps "
                         "strata walks; use fewer pipeline stages, fewer chunks or a larger micro_batch_size",
                         to_string(p.schedule()), p.microbatches(), p.p, p.v, kMaxWalkSteps);
    });
  if (p.software_stack != StackChoice::automatic && cl.strata_stack)
    add("software_stack", [&] { return fmt::format("software_stack={} names a GPU framework's stack; {} runs the strata "
                                                   "executor's own (leave it auto)",
                                                   p.software_stack == StackChoice::legacy ? "legacy" : "modern", cl.name); });
  if (p.cross_entropy_loss_fusion == Tristate::on && cl.strata_stack)
    add("software_stack", [&] { return fmt::format("cross_entropy_loss_fusion=1 is Megatron-core's kernel; {} runs the "
                                                   "strata executor's own loss (leave it auto)",
                                                   cl.name); });
  if (p.grad_reduce_in_fp32 == Tristate::off) {
    if (p.precision == Precision::fp32)
      add("grad_reduce", [&] { return std::string("grad_reduce_in_fp32=false needs 16-bit parameters (precision bf16, "
                                                  "fp16 or fp8): fp32 training keeps fp32 gradients"); });
    else if (cl.strata_stack)
      add("grad_reduce", [&] { return fmt::format("grad_reduce_in_fp32=false: {} runs the strata executor, which "
                                                  "accumulates and reduces its gradients in fp32", cl.name); });
  }
  if (p.fp8_param_gather != Tristate::automatic && p.precision != Precision::fp8)
    add("fp8_param_gather", [&] { return fmt::format("fp8_param_gather is fp8's (precision {})", to_string(p.precision)); });
  else if (p.fp8_param_gather == Tristate::on && p.zero == 0)
    add("fp8_param_gather", [&] { return std::string("fp8_param_gather=1 needs zero_stage 1-3 (Megatron gathers fp8 "
                                                     "parameters only where they are sharded)"); });
  if (p.precision_aware_optimizer) {
    if (p.zero != 1)
      add("precision_aware", [&] { return fmt::format("use_precision_aware_optimizer needs zero_stage 1 (Megatron's "
                                                      "distributed optimizer; not {})", p.zero); });
    else if (p.precision == Precision::fp32)
      add("precision_aware", [&] { return std::string("use_precision_aware_optimizer needs 16-bit or fp8 parameters "
                                                      "(precision bf16, fp16 or fp8)"); });
    else if (cl.strata_stack)
      add("precision_aware", [&] { return fmt::format("use_precision_aware_optimizer: {} runs the strata executor, whose "
                                                      "optimizer keeps fp32 states", cl.name); });
    else if (!resolve_stack(m, cl, p).modern)
      add("precision_aware", [&] { return std::string("use_precision_aware_optimizer is Megatron-core's (Transformer "
                                                      "Engine's FusedAdam): it needs the modern software stack, not the "
                                                      "legacy one this plan runs on (software_stack=modern says it)"); });
  }
  if (p.offload > 0) {
    if (p.zero == 0)
      add("offload_zero", [&] { return fmt::format("optimizer_offload_fraction={} needs zero_stage >= 1 (Megatron's "
                                                   "--optimizer-cpu-offload runs in its distributed optimizer, "
                                                   "DeepSpeed's offload_optimizer in a ZeRO stage)", p.offload); });
    else if (cl.strata_stack)
      add("offload_host", [&] { return fmt::format("optimizer_offload_fraction={}: {} runs the strata executor, which "
                                                   "keeps its optimizer on its own backend", p.offload, cl.name); });
    else if (!cl.host.present())
      add("offload_host", [&] { return fmt::format("optimizer_offload_fraction={}: cluster {} gives no \"host\" (memory, "
                                                   "its bandwidth, PCIe; hw_profiles/README.md)", p.offload, cl.name); });
  }
  if (p.dp_instances > 1) {
    if (p.replicas() % p.dp_instances != 0)
      add("dp_instances", [&] { return fmt::format("num_distributed_optimizer_instances={} must divide data_parallel x "
                                                   "context_parallel = {}", p.dp_instances, p.replicas()); });
    else if (m.moe() && p.expert_replicas() % p.dp_instances != 0)
      add("dp_instances", [&] { return fmt::format("num_distributed_optimizer_instances={} must divide the experts' "
                                                   "replicas, {} (Megatron-core splits both data-parallel groups)",
                                                   p.dp_instances, p.expert_replicas()); });
    else if (p.dp_instances == p.replicas())
      add("dp_instances", [&] { return fmt::format("num_distributed_optimizer_instances={} leaves one rank per shard of "
                                                   "the {} replicas: nothing sharded (zero_stage 0 says that)",
                                                   p.dp_instances, p.replicas()); });
    else if (p.zero == 0)
      add("dp_instances", [&] { return fmt::format("num_distributed_optimizer_instances={} needs zero_stage >= 1: "
                                                   "instances of a sharded optimizer (without sharding every replica "
                                                   "holds everything already)", p.dp_instances); });
    else if (cl.strata_stack)
      add("dp_instances", [&] { return fmt::format("num_distributed_optimizer_instances={}: {} runs the strata executor, "
                                                   "which shards over every replica", p.dp_instances, cl.name); });
  }
  if (p.op_sac()) {
    // torchtitan's policy counts aten.mm: linear layers with biases run addmm, and the
    // experts' grouped GEMMs and multi-latent attention's projections run in another order
    // than the one op_sac costs.
    std::string why;
    if (m.moe()) why = "for " + m.name + ", a mixture-of-experts model (its experts' grouped GEMMs are not aten.mm)";
    else if (m.mla()) why = "for " + m.name + ", whose multi-latent attention runs its projections in another order";
    else if (m.bias) why = "for " + m.name + ", whose linear layers have biases (they run addmm, which the policy does not keep)";
    else if (p.offload_modules) why = "with offload_modules (Megatron-core's offload groups follow its modules)";
    else if (p.t > 1 && !p.sp)
      why = "with tensor parallelism but no sequence parallelism (torchtitan's tensor parallelism is sequence-parallel: sp=1)";
    else if (resolve_attention(m, cl, p) == AttentionKernel::unfused)
      why = "with the unfused attention (the policy keeps the fused attention's output: attention=flash)";
    if (!why.empty())
      add("selective_ac_option", [&] { return "selective_ac_option op (torchtitan's op-level policy) is not costed " + why; });
  }
  if (p.offload_modules && m.mla())
    add("activation_offload", [&] { return fmt::format("offload_modules {} with multi-latent attention: its offload "
                                                       "groups are not modelled", offload_modules_text(p.offload_modules, "+")); });
  if (p.offload_modules) {
    // (Every layer recomputed: recompute_num_layers unset, or at least any chunk's layers.)
    if (p.recompute == Recompute::full &&
        (p.recompute_layers == 0 || [&] {
          const StageLayout lay = make_layout(m.L, p);
          return p.recompute_layers >= *std::max_element(lay.layers.begin(), lay.layers.end());
        }()))
      add("activation_offload", [&] { return fmt::format("offload_modules {} with recompute=full on every layer: a "
                                                         "recomputed layer keeps only its input, none of its modules' "
                                                         "activations (use recompute none or selective, or "
                                                         "recompute_num_layers for the layers it leaves)",
                                                         offload_modules_text(p.offload_modules, "+")); });
    else if (!m.moe() && (p.offload_modules & kOffloadExpertModules))
      add("activation_offload", [&] { return fmt::format("offload_modules {} names the experts' modules; {} is dense",
                                                         offload_modules_text(p.offload_modules & kOffloadExpertModules, "+"),
                                                         m.name); });
    else if (cl.strata_stack)
      add("activation_offload", [&] { return fmt::format("offload_modules: {} runs the strata executor, which keeps its "
                                                         "activations on its own backend", cl.name); });
    else if (!cl.host.present())
      add("activation_offload", [&] { return fmt::format("offload_modules: cluster {} gives no \"host\" (memory, its "
                                                         "bandwidth, PCIe; hw_profiles/README.md)", cl.name); });
    else if (!resolve_stack(m, cl, p).modern)
      add("activation_offload", [&] { return std::string("fine-grained activation offloading is Megatron-core's: it "
                                                         "needs the modern software stack, not the legacy one this plan "
                                                         "runs on (software_stack=modern says it)"); });
  }
  if (p.precision == Precision::fp8 && cl.device.peak_bf16_flops <= 0)
    add("precision", [&] { return fmt::format("precision=fp8 runs attention and the output layer in bf16, which {} "
                                              "does not support", cl.device.name); });
  else if (cl.device.peak_flops(p.precision) <= 0)
    add("precision", [&] { return fmt::format("precision={} is not supported by {}", to_string(p.precision), cl.device.name); });
  return r;
}

}  // namespace strata
