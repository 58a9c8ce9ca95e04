// ModelSpec counts and loaders; see model_spec.h.
#include "costmodel/model_spec.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace strata {

namespace {
// Limits that keep every count finite and every later allocation bounded. A model past
// them is refused as input, before anything is sized from it.
constexpr int64_t kMaxLayers = 100000;
constexpr int64_t kMaxHidden = 1 << 20;
constexpr int64_t kMaxHeads = 1 << 16;
constexpr int64_t kMaxFfn = 1 << 24;
constexpr int64_t kMaxVocab = 1 << 28;
constexpr int64_t kMaxSeq = 1 << 24;
constexpr int64_t kMaxExperts = 1 << 16;
constexpr int64_t kMaxMtpLayers = 64;  // multi-token prediction modules (DeepSeek-V3 and GLM-4.5 train 1)

// A model the cost model would silently mistake for one it models is refused, naming the
// key: an expert count above one under any of `keys` (zero or one expert is a dense MLP).
void reject_experts(const Json& j, const std::string& source, std::initializer_list<const char*> keys,
                    const char* why) {
  for (const char* k : keys) {
    if (!j.contains(k) || j.at(k).is_null()) continue;
    const Json& v = j.at(k);
    if (v.is_number_integer() && (v.get<int64_t>() == 0 || v.get<int64_t>() == 1)) continue;
    fail_field(source + "." + k, show_value(v), std::string("mixture-of-experts: ") + why);
  }
}

// Megatron's --moe-layer-freq string after its blanks: the Python expression its
// moe_freq_type evaluates, of lists of 0s and 1s, parentheses, '+' (concatenation) and
// '*' by a count on either side ("([0]*3+[1]*58)", "[1,0]*24", "([1]*3+[0]*1)*3"). Each
// list is cut at `cap` entries (anything longer is refused by the caller); false where the
// text is not such an expression.
class FreqParser {
 public:
  FreqParser(const std::string& s, size_t cap) : s_(s), cap_(cap) {}
  bool parse(std::vector<uint8_t>* out) { return expr(out, 0) && i_ == s_.size(); }

 private:
  bool expr(std::vector<uint8_t>* out, int depth) {
    if (depth > 32) return false;
    if (!term(out, depth)) return false;
    while (i_ < s_.size() && s_[i_] == '+') {
      ++i_;
      std::vector<uint8_t> more;
      if (!term(&more, depth)) return false;
      append(out, more, 1);
    }
    return true;
  }
  bool term(std::vector<uint8_t>* out, int depth) {
    int64_t times = 1, n = 0;
    while (count(&n)) {  // counts before the list: 3*[1]
      if (i_ >= s_.size() || s_[i_] != '*') return false;
      ++i_;
      times = repeat(times, n);
    }
    std::vector<uint8_t> atom;
    if (i_ < s_.size() && s_[i_] == '[') {
      ++i_;
      while (i_ < s_.size() && s_[i_] != ']') {  // 0 or 1, each followed by ',' or the ']'
        if (s_[i_] != '0' && s_[i_] != '1') return false;
        if (atom.size() <= cap_) atom.push_back(s_[i_] == '1' ? 1 : 0);
        ++i_;
        if (i_ < s_.size() && s_[i_] == ',') ++i_;
        else if (i_ < s_.size() && s_[i_] != ']') return false;
      }
      if (i_ >= s_.size()) return false;
      ++i_;
    } else if (i_ < s_.size() && s_[i_] == '(') {
      ++i_;
      if (!expr(&atom, depth + 1) || i_ >= s_.size() || s_[i_] != ')') return false;
      ++i_;
    } else {
      return false;
    }
    while (i_ < s_.size() && s_[i_] == '*') {  // counts after it: [1]*3
      ++i_;
      if (!count(&n)) return false;
      times = repeat(times, n);
    }
    append(out, atom, times);
    return true;
  }
  // times * n, saturated (counts past the layers are cut by append() anyway).
  static int64_t repeat(int64_t times, int64_t n) {
    constexpr int64_t kMost = int64_t{1} << 40;
    return n != 0 && times > kMost / n ? kMost : times * n;
  }
  // A count of up to 9 digits at the cursor (consumed), or false (nothing consumed).
  bool count(int64_t* n) {
    size_t j = i_;
    while (j < s_.size() && s_[j] >= '0' && s_[j] <= '9') ++j;
    if (j == i_ || j - i_ > 9) return false;
    *n = std::stoll(s_.substr(i_, j - i_));
    i_ = j;
    return true;
  }
  void append(std::vector<uint8_t>* out, const std::vector<uint8_t>& part, int64_t times) {
    for (int64_t r = 0; r < times && out->size() <= cap_ && !part.empty(); ++r)
      out->insert(out->end(), part.begin(), part.begin() + static_cast<std::ptrdiff_t>(std::min(part.size(), cap_ + 1 - out->size())));
  }
  const std::string& s_;
  size_t cap_, i_ = 0;
};

// Megatron-core's moe_layer_freq over L layers, one flag per layer (1: MoE): an integer N
// (every N-th layer from the first, Megatron's rule l % N == 0), a list of 0s and 1s, or
// the string Megatron's --moe-layer-freq takes (FreqParser). `field` names the input in
// messages.
std::vector<uint8_t> moe_layer_flags(const Json& v, int64_t L, const std::string& field) {
  std::vector<uint8_t> flags;
  auto bad = [&](const std::string& why) { fail_field(field, show_value(v), why); };
  auto every = [&](int64_t n) {
    if (n < 1) bad("an integer frequency must be at least 1");
    for (int64_t l = 0; l < L; ++l) flags.push_back(l % n == 0 ? 1 : 0);
  };
  if (v.is_number_integer()) {
    every(v.get<int64_t>());
  } else if (v.is_array()) {
    for (const Json& x : v) {
      if (x != Json(0) && x != Json(1)) bad("a list must hold only 0 (dense layer) and 1 (MoE layer)");
      flags.push_back(x == Json(1) ? 1 : 0);
      if (static_cast<int64_t>(flags.size()) > L) break;
    }
  } else if (v.is_string()) {
    std::string s = v.get<std::string>();
    s.erase(std::remove(s.begin(), s.end(), ' '), s.end());
    if (!s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
      every(std::stoll(s));
    } else if (!FreqParser(s, static_cast<size_t>(L)).parse(&flags)) {
      bad("must be an integer, a list of 0s and 1s, or Megatron's expression of lists joined by '+' and repeated by "
          "'*', e.g. \"([0]*3+[1]*58)\"");
    }
  } else {
    bad("must be an integer, a list of 0s and 1s, or Megatron's string form such as \"([0]*3+[1]*58)\"");
  }
  if (static_cast<int64_t>(flags.size()) > L) bad(fmt::format("names more layers than num_layers = {}", L));
  if (static_cast<int64_t>(flags.size()) < L) bad(fmt::format("names {} layers, not num_layers = {}", flags.size(), L));
  return flags;
}

// Sets m->moe_layer from one flag per layer: refused without an MoE layer, left empty
// (every layer alike) when all are.
void set_moe_layers(ModelSpec* m, std::vector<uint8_t> flags, const std::string& field, const std::string& value) {
  const auto moe = std::count(flags.begin(), flags.end(), uint8_t{1});
  if (moe == 0)
    fail_field(field, value, "names no MoE layer: a model without one is dense (give no experts)");
  if (moe == static_cast<int64_t>(flags.size())) flags.clear();  // every layer: the uniform model
  m->moe_layer = std::move(flags);
}

// Megatron-core's MoE arguments onto ModelSpec (E, K, Fe, Fs, moe_layer): num_experts (or
// num_moe_experts; 0 or 1 is a dense MLP, and then the others are left), moe_router_topk
// (Megatron's default 2), moe_ffn_hidden_size (default ffn_hidden_size),
// moe_shared_expert_intermediate_size and moe_layer_freq (default 1: every layer an MoE
// layer; the others have a dense MLP of ffn_hidden_size). Settings that change no count or
// cost under balanced routing (the dispatcher, grouped GEMM, the load-balancing loss, a
// capacity factor, which drops nothing when the experts' loads are even) are read and left.
void read_experts(Fields& f, const Json& j, const std::string& source, ModelSpec* m) {
  if (f.peek("num_experts") && f.peek("num_moe_experts"))
    fail_field(source + ".num_moe_experts", show_value(j.at("num_moe_experts")), "given twice (and as num_experts): keep one");
  const char* key = f.peek("num_moe_experts") ? "num_moe_experts" : "num_experts";
  const Json* ej = f.peek(key);
  const int64_t E = ej && !ej->is_null() ? f.integer_or(key, 0, 0, kMaxExperts) : 0;
  for (const char* k : {"num_experts", "num_moe_experts"}) f.ignore(k);
  const char* moe_keys[] = {"moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                            "moe_layer_freq", "moe_router_num_groups", "moe_router_group_topk"};
  if (E <= 1) {
    for (const char* k : moe_keys) f.ignore(k);
  } else {
    m->E = E;
    m->K = f.integer_or("moe_router_topk", 2, 1, E);
    m->Fe = f.integer_or("moe_ffn_hidden_size", m->F, 1, kMaxFfn);
    m->Fs = f.integer_or("moe_shared_expert_intermediate_size", 0, 0, kMaxFfn);
    // (null: Megatron's None, no group limit)
    auto groups = [&](const char* k) -> int64_t {
      const Json* v = f.peek(k);
      if (!v || v->is_null()) {
        f.ignore(k);
        return 0;
      }
      return f.integer_or(k, 0, 0, E);
    };
    m->moe_groups = groups("moe_router_num_groups");
    m->moe_group_topk = groups("moe_router_group_topk");
    if (const Json* freq = f.peek("moe_layer_freq"); freq && !freq->is_null())
      set_moe_layers(m, moe_layer_flags(*freq, m->L, source + ".moe_layer_freq"), source + ".moe_layer_freq",
                     show_value(*freq));
    f.ignore("moe_layer_freq");
  }
  for (const char* k : {"moe_grouped_gemm", "moe_token_dispatcher_type", "moe_router_load_balancing_type",
                        "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_pre_softmax", "moe_router_score_function",
                        "moe_router_dtype", "moe_permute_fusion", "moe_expert_capacity_factor",
                        "moe_router_enable_expert_bias", "moe_shared_expert_overlap"})
    f.ignore(k);
}

// Hugging Face model types of encoder-only models: bidirectional attention and no causal
// language-model head, which the cost model and the executor do not have.
// A config without model_type: the family from its first architectures entry (Hugging
// Face's class name, e.g. GemmaForCausalLM), as the model_type the families above test for
// (GPTNeoX -> gpt_neox, DeepseekV3 -> deepseek_v3, ...); "" where none is given.
std::string model_type_of_architectures(const Json& j) {
  if (!j.contains("architectures") || !j["architectures"].is_array() || j["architectures"].empty() ||
      !j["architectures"][0].is_string())
    return "";
  std::string name = j["architectures"][0].get<std::string>();
  for (const char* suffix : {"ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "Model"}) {
    const std::string x = suffix;
    if (name.size() > x.size() && name.compare(name.size() - x.size(), x.size(), x) == 0) {
      name.resize(name.size() - x.size());
      break;
    }
  }
  std::string lower;
  for (const char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // The model_types whose names have an underscore the class name drops.
  for (const char* t : {"gpt_neox", "gpt_bigcode", "gpt_oss", "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe",
                        "qwen2_moe", "qwen3_moe"}) {
    std::string bare;
    for (const char* c = t; *c; ++c)
      if (*c != '_') bare += *c;
    if (lower == bare) return t;
  }
  return lower;
}

bool encoder_only(const std::string& model_type) {
  // (Compared without '-' and '_': a type from an architectures class name, XLMRobertaModel,
  // is xlmroberta.)
  auto bare = [](std::string s) {
    s.erase(std::remove_if(s.begin(), s.end(), [](char c) { return c == '-' || c == '_'; }), s.end());
    return s;
  };
  const std::string type = bare(model_type);
  for (const char* t : {"bert", "roberta", "xlm-roberta", "deberta", "deberta-v2", "electra", "albert",
                        "distilbert", "mpnet", "modernbert", "camembert", "ernie"})
    if (type == bare(t)) return true;
  return false;
}
}  // namespace

const char* to_string(Activation a) {
  switch (a) {
    case Activation::gelu: return "gelu";
    case Activation::swiglu: return "swiglu";
    case Activation::geglu: return "geglu";
    case Activation::squared_relu: return "squared_relu";
  }
  return "?";
}
const char* to_string(Norm n) { return n == Norm::layernorm ? "layernorm" : "rmsnorm"; }
const char* to_string(Position p) {
  switch (p) {
    case Position::learned: return "learned";
    case Position::rope: return "rope";
    case Position::alibi: return "alibi";
    case Position::none: return "none";
  }
  return "?";
}

std::string moe_layer_freq_text(const std::vector<uint8_t>& flags) {
  const size_t n = flags.size();
  auto list = [&](size_t from, size_t len) {
    std::string t = "[";
    for (size_t i = 0; i < len; ++i) {
      if (i) t += ',';
      t += flags[from + i] ? '1' : '0';
    }
    return t + "]";
  };
  for (size_t period = 1; period <= n / 2; ++period) {  // a pattern repeated whole
    if (n % period != 0) continue;
    bool repeats = true;
    for (size_t i = period; i < n && repeats; ++i) repeats = flags[i] == flags[i - period];
    if (repeats) return fmt::format("{}*{}", list(0, period), n / period);
  }
  std::string text = "(";
  for (size_t i = 0; i < n;) {
    size_t run = 1;
    while (i + run < n && flags[i + run] == flags[i]) ++run;
    text += fmt::format("{}[{}]*{}", i ? "+" : "", flags[i], run);
    i += run;
  }
  return text + ")";
}

int64_t llama_ffn_size(int64_t H, int64_t multiple_of) {
  const int64_t raw = (8 * H) / 3;
  return multiple_of * ((raw + multiple_of - 1) / multiple_of);
}

// A window of w < S keys covers w S - w(w - 1)/2 of the S^2 (query, key) pairs (the first
// w - 1 queries see fewer); counted as w S - w^2/2, which meets the causal S^2/2 the other
// layers cover at w = S.
double ModelSpec::causal_share() const {
  if (!windowed()) return 0.5;
  const double w = static_cast<double>(window_size) / static_cast<double>(S);
  const double f = static_cast<double>(window_layers) / static_cast<double>(L);
  return f * (w - 0.5 * w * w) + (1.0 - f) * 0.5;
}

int64_t ModelSpec::moe_layers_in(int64_t begin, int64_t end) const {
  if (!moe()) return 0;
  if (moe_layer.empty()) return end - begin;
  int64_t n = 0;
  for (int64_t l = begin; l < end; ++l) n += moe_layer[static_cast<size_t>(l)];
  return n;
}

ModelSpec ModelSpec::dense_layers() const {
  ModelSpec d = *this;
  d.E = d.K = d.Fe = d.Fs = 0;
  d.moe_layer.clear();
  return d;
}

int64_t ModelSpec::padded_vocab(int64_t t) const {
  const int64_t m = vocab_divisor * t;
  return ((V + m - 1) / m) * m;
}

int64_t ModelSpec::layer_norm_params() const {
  return normalization == Norm::layernorm ? 4 * H : 2 * H;
}

int64_t ModelSpec::expert_params(int64_t etp) const {
  const int64_t fc1 = expert_fc1_out();
  int64_t n = (H * fc1 + Fe * H) / etp;
  if (bias) n += fc1 / etp + H;
  return n;
}

int64_t ModelSpec::mla_attention_params(int64_t t) const {
  const int64_t q = q_lora_rank > 0 ? H * q_lora_rank + q_lora_rank + q_lora_rank * AD() / t : H * AD() / t;
  const int64_t kv = H * (kv_lora_rank + qk_pos_emb_head_dim) + kv_lora_rank + kv_lora_rank * A * (qk_head_dim() + Dv()) / t;
  return q + kv + VD() * H / t;
}

namespace {
// A mixture-of-experts layer's parameters on one rank (ModelSpec::layer_params): out of
// line, so the dense count stays short.
[[gnu::noinline]] int64_t moe_layer_params(const ModelSpec& m, int64_t t, int64_t ep, int64_t etp) {
  const int64_t kv_cols = 2 * m.kv_width(t), H = m.H, AD = m.AD(), fs = m.shared_fc1_out();
  if (m.mla())  // (MLA has no biases: validate_model)
    return m.mla_attention_params(t) + (H * fs + m.Fs * H) / t + m.E * H + m.layer_norm_params() +
           m.layer_expert_params(etp > 0 ? etp : t, ep);
  int64_t n = (H * AD + AD * H + H * fs + m.Fs * H) / t + H * kv_cols + m.E * H;  // + the router
  if (m.bias) n += (AD + fs) / t + kv_cols + (m.Fs > 0 ? 2 * H : H);
  return n + m.layer_norm_params() + m.layer_expert_params(etp > 0 ? etp : t, ep);
}
}  // namespace

int64_t ModelSpec::layer_params(int64_t t, int64_t ep, int64_t etp) const {
  if (moe()) return moe_layer_params(*this, t, ep, etp);
  const int64_t kv_cols = 2 * kv_width(t);             // this rank's key and value columns
  const int64_t fc1 = fc1_out();
  if (mla()) return mla_attention_params(t) + (H * fc1 + F * H) / t + layer_norm_params();
  int64_t n = (H * AD() + AD() * H + H * fc1 + F * H) / t + H * kv_cols;  // the four split matrices
  if (bias) n += (AD() + fc1) / t + kv_cols + 2 * H;  // column biases split, row biases replicated
  return n + layer_norm_params();
}

int64_t ModelSpec::word_embedding_params(int64_t t) const { return padded_vocab(t) * H / t; }

int64_t ModelSpec::position_params() const { return position == Position::learned ? S * H : 0; }

int64_t ModelSpec::final_norm_params() const { return normalization == Norm::layernorm ? 2 * H : H; }

int64_t ModelSpec::mtp_params(int64_t t, int64_t ep, int64_t etp) const {
  if (mtp_layers == 0) return 0;
  const int64_t layer = mtp_moe() || !mixed() ? layer_params(t, ep, etp) : dense_layers().layer_params(t, ep, etp);
  return mtp_layers * (layer + 2 * H * H / t + 3 * final_norm_params());
}

double ModelSpec::total_params() const {
  const double emb = static_cast<double>(word_embedding_params(1)) * (tie_embeddings ? 1 : 2);
  const double moe_layers = static_cast<double>(moe_layer_count());
  const double layers = mixed() ? moe_layers * static_cast<double>(layer_params(1)) +
                                      (static_cast<double>(L) - moe_layers) * static_cast<double>(dense_layers().layer_params(1))
                                : static_cast<double>(L) * static_cast<double>(layer_params(1));
  return layers + emb + static_cast<double>(position_params()) + static_cast<double>(final_norm_params());
}

double ModelSpec::active_params() const {
  if (!moe()) return total_params();
  return total_params() -
         static_cast<double>(moe_layer_count()) * static_cast<double>(E - K) * static_cast<double>(expert_params(1));
}

double ModelSpec::active_params_without_input_embedding() const {
  return active_params() - (tie_embeddings ? 0.0 : static_cast<double>(word_embedding_params(1)));
}

double ModelSpec::layer_forward_flops(int64_t B) const {
  if (!mixed()) return layer_forward_flops(B, moe());
  const double moe_layers = static_cast<double>(moe_layer_count()), l = static_cast<double>(L);
  return (moe_layers * layer_forward_flops(B, true) + (l - moe_layers) * layer_forward_flops(B, false)) / l;
}

double ModelSpec::layer_forward_flops(int64_t B, bool is_moe) const {
  const double tokens = static_cast<double>(B) * static_cast<double>(S);
  const double h = static_cast<double>(H);
  const double qkv_out = static_cast<double>(AD() + 2 * G * D());
  const double fc1 = static_cast<double>(fc1_out());
  double gemms = 2.0 * tokens * (h * qkv_out + static_cast<double>(AD()) * h + h * fc1 + static_cast<double>(F) * h);
  if (moe() && is_moe)  // a token's K routed experts and the shared expert in place of the dense MLP
    gemms = 2.0 * tokens * (h * qkv_out + static_cast<double>(AD()) * h +
                            static_cast<double>(K) * static_cast<double>(expert_fc1_out() + Fe) * h +
                            static_cast<double>(shared_fc1_out() + Fs) * h);
  if (mla()) {  // the latent projections (mla_attention_params at t = 1, but for the norms) for Q, K, V and O
    const double ql = static_cast<double>(q_lora_rank), kvl = static_cast<double>(kv_lora_rank);
    const double q = q_lora_rank > 0 ? h * ql + ql * static_cast<double>(AD()) : h * static_cast<double>(AD());
    const double kv = h * (kvl + static_cast<double>(qk_pos_emb_head_dim)) +
                      kvl * static_cast<double>(A) * static_cast<double>(qk_head_dim() + Dv());
    gemms += 2.0 * tokens * (q + kv + static_cast<double>(VD()) * h - h * qkv_out - static_cast<double>(AD()) * h);
    // QK^T over D, AV over Dv.
    return gemms + 2.0 * tokens * attention_keys() * static_cast<double>(AD() + VD());
  }
  const double attention = 4.0 * tokens * attention_keys() * static_cast<double>(AD());  // QK^T, AV
  return gemms + attention;
}

double ModelSpec::attention_keys() const {
  if (!windowed()) return static_cast<double>(S);
  const double l = static_cast<double>(L), w = static_cast<double>(window_layers);
  return ((l - w) * static_cast<double>(S) + w * static_cast<double>(window_size)) / l;
}

double ModelSpec::logits_forward_flops(int64_t B) const {
  return 2.0 * static_cast<double>(B) * static_cast<double>(S) * static_cast<double>(H) *
         static_cast<double>(padded_vocab(1));
}

double ModelSpec::forward_flops(int64_t B) const {
  double f = static_cast<double>(L) * layer_forward_flops(B) + logits_forward_flops(B);
  if (mtp_layers > 0) {
    const double h = static_cast<double>(H);
    const double eh_proj = 2.0 * static_cast<double>(B) * static_cast<double>(S) * 2.0 * h * h;
    f += static_cast<double>(mtp_layers) * (layer_forward_flops(B, mtp_moe()) + eh_proj + logits_forward_flops(B));
  }
  return f;
}

void validate_model(const ModelSpec& m, const std::string& src) {
  auto range = [&](const char* field, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi)
      fail_field(src + "." + field, std::to_string(v), fmt::format("must be an integer in [{}, {}]", lo, hi));
  };
  range("num_layers", m.L, 1, kMaxLayers);
  range("hidden_size", m.H, 1, kMaxHidden);
  range("num_attention_heads", m.A, 1, kMaxHeads);
  range("num_query_groups", m.G, 1, kMaxHeads);
  range("ffn_hidden_size", m.F, 1, kMaxFfn);
  range("vocab_size", m.V, 1, kMaxVocab);
  range("seq_length", m.S, 1, kMaxSeq);
  range("mtp_num_layers", m.mtp_layers, 0, kMaxMtpLayers);
  if (m.kv_channels < 0 || m.kv_channels > kMaxHidden)
    fail_field(src + ".kv_channels", std::to_string(m.kv_channels), fmt::format("must be an integer in [0, {}]", kMaxHidden));
  if (m.kv_channels == 0 && m.H % m.A != 0)
    fail_field(src + ".hidden_size", std::to_string(m.H),
               fmt::format("must be divisible by num_attention_heads ({}), or give kv_channels", m.A));
  if (m.A * m.D() > (int64_t{1} << 24))
    fail_field(src + ".kv_channels", std::to_string(m.D()), "num_attention_heads * kv_channels exceeds 2^24");
  if (m.G > m.A || m.A % m.G != 0)
    fail_field(src + ".num_query_groups", std::to_string(m.G),
               fmt::format("must divide num_attention_heads ({})", m.A));
  if (m.attention_dropout < 0 || m.attention_dropout >= 1)
    fail_field(src + ".attention_dropout", fmt::format("{}", m.attention_dropout), "must be in [0, 1)");
  if (m.hidden_dropout < 0 || m.hidden_dropout >= 1)
    fail_field(src + ".hidden_dropout", fmt::format("{}", m.hidden_dropout), "must be in [0, 1)");
  if (m.vocab_divisor < 1 || m.vocab_divisor > 65536)
    fail_field(src + ".make_vocab_size_divisible_by", std::to_string(m.vocab_divisor),
               "must be an integer in [1, 65536]");
  if (m.window_layers < 0 || m.window_layers > m.L)
    fail_field(src + ".window_layers", std::to_string(m.window_layers),
               fmt::format("must be in [0, num_layers = {}]", m.L));
  if (m.window_size < 0 || m.window_size > kMaxSeq)
    fail_field(src + ".window_size", std::to_string(m.window_size), fmt::format("must be an integer in [0, {}]", kMaxSeq));
  if (m.E < 0 || m.E > kMaxExperts)
    fail_field(src + ".num_experts", std::to_string(m.E), fmt::format("must be an integer in [0, {}]", kMaxExperts));
  if (m.moe()) {
    if (m.K < 1 || m.K > m.E)
      fail_field(src + ".moe_router_topk", std::to_string(m.K), fmt::format("must be in [1, num_experts = {}]", m.E));
    range("moe_ffn_hidden_size", m.Fe, 1, kMaxFfn);
    range("moe_shared_expert_intermediate_size", m.Fs, 0, kMaxFfn);
    if ((m.moe_groups > 0) != (m.moe_group_topk > 0))
      fail_field(src + (m.moe_groups > 0 ? ".moe_router_group_topk" : ".moe_router_num_groups"), "0",
                 "group-limited routing needs both moe_router_num_groups and moe_router_group_topk");
    if (m.moe_groups > 0) {
      if (m.moe_groups > m.E || m.E % m.moe_groups != 0)
        fail_field(src + ".moe_router_num_groups", std::to_string(m.moe_groups),
                   fmt::format("must divide num_experts = {}", m.E));
      if (m.moe_group_topk > m.moe_groups)
        fail_field(src + ".moe_router_group_topk", std::to_string(m.moe_group_topk),
                   fmt::format("must be in [1, moe_router_num_groups = {}]", m.moe_groups));
      if (m.K < m.moe_group_topk)
        fail_field(src + ".moe_router_topk", std::to_string(m.K),
                   fmt::format("must be at least moe_router_group_topk = {} (Megatron takes the top K / group_topk "
                               "experts of each group)", m.moe_group_topk));
      if (m.K > m.moe_group_topk * (m.E / m.moe_groups))
        fail_field(src + ".moe_router_topk", std::to_string(m.K),
                   fmt::format("must be at most the experts of moe_router_group_topk groups ({} x {})", m.moe_group_topk,
                               m.E / m.moe_groups));
    }
  } else if (m.moe_groups != 0 || m.moe_group_topk != 0) {
    fail_field(src + ".moe_router_num_groups", std::to_string(m.moe_groups), "needs num_experts (a mixture of experts)");
  }
  if (m.q_lora_rank < 0 || m.kv_lora_rank < 0 || m.qk_pos_emb_head_dim < 0 || m.v_head_dim < 0 ||
      m.q_lora_rank > kMaxHidden || m.kv_lora_rank > kMaxHidden || m.qk_pos_emb_head_dim > kMaxHidden ||
      m.v_head_dim > kMaxHidden)
    fail_field(src + ".kv_lora_rank", std::to_string(m.kv_lora_rank),
               fmt::format("multi-latent attention's sizes must be integers in [0, {}]", kMaxHidden));
  if (m.mla()) {
    if (m.qk_head_dim() < 1 || m.qk_pos_emb_head_dim < 1 || m.v_head_dim < 1)
      fail_field(src + ".qk_head_dim", std::to_string(m.qk_head_dim()),
                 "multi-latent attention needs qk_head_dim, qk_pos_emb_head_dim and v_head_dim of at least 1");
    if (m.G != m.A)
      fail_field(src + ".num_query_groups", std::to_string(m.G),
                 fmt::format("multi-latent attention has a key and value per head: must be num_attention_heads = {}", m.A));
    if (m.bias)
      fail_field(src + ".add_bias_linear", "true", "multi-latent attention is costed without linear biases");
    if (m.A * m.v_head_dim > (int64_t{1} << 24))
      fail_field(src + ".v_head_dim", std::to_string(m.v_head_dim), "num_attention_heads * v_head_dim exceeds 2^24");
  }
  if (m.mixed()) {
    const int64_t moe_layers = std::count(m.moe_layer.begin(), m.moe_layer.end(), uint8_t{1});
    if (!m.moe() || static_cast<int64_t>(m.moe_layer.size()) != m.L || moe_layers == 0 || moe_layers == m.L ||
        std::any_of(m.moe_layer.begin(), m.moe_layer.end(), [](uint8_t x) { return x > 1; }))
      fail_field(src + ".moe_layer_freq", fmt::format("({} entries)", m.moe_layer.size()),
                 fmt::format("must flag each of num_layers = {} layers 0 (dense) or 1 (MoE), both kinds among them, "
                             "with num_experts above 1",
                             m.L));
  }
  if (m.position == Position::learned && m.S * m.H > (int64_t{1} << 40))
    fail_field(src + ".seq_length", std::to_string(m.S), "learned position table seq_length*hidden_size exceeds 2^40");
}

namespace {

// Megatron-LM's argument names (snake_case, as a config dump writes them) for the fields of
// this schema, folded onto its own; a field given under two names is an error. Arguments
// that change no count or cost (epsilons, RoPE's base and share, initialisation, fusions,
// the flag that turns num_query_groups on) are read and left.
Json adopt_megatron_names(const Json& in, const std::string& source) {
  Json j = in;
  if (!j.is_object()) return j;
  adopt_key(j, source, "position_embedding_type", "position_embedding", [](const Json& v, const std::string&) {
    return v.is_string() && v == "learned_absolute" ? Json("learned") : v;
  });
  adopt_key(j, source, "use_rotary_position_embeddings", "position_embedding",
            [](const Json& v, const std::string& path) { return flag_value(v, path) ? Json("rope") : Json(); });
  adopt_key(j, source, "untie_embeddings_and_output_weights", "tie_embeddings",
            [](const Json& v, const std::string& path) { return Json(!flag_value(v, path)); });
  adopt_key(j, source, "swiglu", "activation",
            [](const Json& v, const std::string& path) { return flag_value(v, path) ? Json("swiglu") : Json(); });
  adopt_key(j, source, "squared_relu", "activation",
            [](const Json& v, const std::string& path) { return flag_value(v, path) ? Json("squared_relu") : Json(); });
  adopt_key(j, source, "disable_bias_linear", "add_bias_linear",
            [](const Json& v, const std::string& path) { return flag_value(v, path) ? Json(false) : Json(); });
  // The trained sequence where no seq_length is given; beside it, only the RoPE table's size.
  if (j.contains("max_position_embeddings")) {
    if (!j.contains("seq_length")) j["seq_length"] = j.at("max_position_embeddings");
    j.erase("max_position_embeddings");
  }
  // Megatron reads num_query_groups only with group_query_attention set.
  if (j.contains("group_query_attention")) {
    const Json& g = j.at("group_query_attention");
    const bool gqa = !g.is_null() && flag_value(g, source + ".group_query_attention");
    if (!gqa && j.contains("num_query_groups") && j.contains("num_attention_heads") &&
        j.at("num_query_groups") != j.at("num_attention_heads"))
      fail_field(source + ".group_query_attention", show_value(g),
                 "contradicts num_query_groups " + show_value(j.at("num_query_groups")) +
                     ": Megatron-LM reads the groups only with group_query_attention true");
  }
  for (const char* k : {"group_query_attention", "norm_epsilon", "layernorm_epsilon", "rotary_base", "rotary_percent",
                        "rotary_interleaved", "init_method_std", "apply_query_key_layer_scaling",
                        "attention_softmax_in_fp32", "masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion",
                        "bias_dropout_fusion", "apply_rope_fusion"})
    j.erase(k);
  return j;
}

}  // namespace

ModelSpec model_from_json(const Json& in, const std::string& source) {
  const Json j = adopt_megatron_names(in, source);
  Fields f(j, source);
  ModelSpec m;
  m.name = f.string_or("name", std::filesystem::path(source).stem().string());
  m.L = f.integer("num_layers", 1, kMaxLayers);
  m.H = f.integer("hidden_size", 1, kMaxHidden);
  m.A = f.integer("num_attention_heads", 1, kMaxHeads);
  m.G = f.integer_or("num_query_groups", m.A, 1, kMaxHeads);
  const std::string act = f.choice_or("activation", "gelu", {"gelu", "swiglu", "geglu", "squared_relu"});
  m.activation = act == "gelu"     ? Activation::gelu
               : act == "swiglu"   ? Activation::swiglu
               : act == "geglu"    ? Activation::geglu
                                   : Activation::squared_relu;
  const bool llama = m.gated();
  m.F = f.integer_or("ffn_hidden_size", llama ? llama_ffn_size(m.H) : 4 * m.H, 1, kMaxFfn);
  m.V = f.integer("vocab_size", 1, kMaxVocab);
  m.S = f.integer("seq_length", 1, kMaxSeq);
  const std::string norm = f.choice_or("normalization", llama ? "rmsnorm" : "layernorm", {"layernorm", "rmsnorm"});
  m.normalization = norm == "layernorm" ? Norm::layernorm : Norm::rmsnorm;
  const std::string pos =
      f.choice_or("position_embedding", llama ? "rope" : "learned", {"learned", "rope", "alibi", "none"});
  m.position = pos == "learned" ? Position::learned : pos == "rope" ? Position::rope
             : pos == "alibi" ? Position::alibi : Position::none;
  m.tie_embeddings = f.boolean_or("tie_embeddings", !llama);
  m.bias = f.boolean_or("add_bias_linear", !llama);
  m.attention_dropout = f.real_or("attention_dropout", llama ? 0.0 : 0.1, 0.0, 0.999);
  m.hidden_dropout = f.real_or("hidden_dropout", llama ? 0.0 : 0.1, 0.0, 0.999);
  m.vocab_divisor = f.integer_or("make_vocab_size_divisible_by", 128, 1, 65536);
  m.kv_channels = f.integer_or("kv_channels", 0, 0, kMaxHidden);
  // Sliding-window attention (Megatron's window_size, its left size): on every layer, on all
  // but every window_attn_skip_freq-th (Megatron), or on window_layers of them.
  m.window_size = f.integer_or("window_size", 0, 0, kMaxSeq);
  const int64_t skip = f.integer_or("window_attn_skip_freq", 0, 0, kMaxLayers);
  m.window_layers = f.integer_or("window_layers", -1, 0, kMaxLayers);
  if (skip > 0 && m.window_layers >= 0)
    fail_field(source + ".window_layers", std::to_string(m.window_layers), "give window_layers or window_attn_skip_freq, not both");
  if (m.window_layers < 0) m.window_layers = m.window_size > 0 ? m.L - (skip > 0 ? m.L / skip : 0) : 0;
  // Multi-latent attention (Megatron's multi_latent_attention with its defaults: no query
  // latent, kv_lora_rank 32, qk_head_dim 128, qk_pos_emb_head_dim 64, v_head_dim 128); its
  // sizes are read only with it.
  const char* mla_keys[] = {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"};
  if (f.boolean_or("multi_latent_attention", false)) {  // (its heads' widths replace kv_channels, which MLA ignores)
    m.q_lora_rank = f.integer_or("q_lora_rank", 0, 0, kMaxHidden);
    m.kv_lora_rank = f.integer_or("kv_lora_rank", 32, 1, kMaxHidden);
    const int64_t nope = f.integer_or("qk_head_dim", 128, 1, kMaxHidden);
    m.qk_pos_emb_head_dim = f.integer_or("qk_pos_emb_head_dim", 64, 1, kMaxHidden);
    m.v_head_dim = f.integer_or("v_head_dim", 128, 1, kMaxHidden);
    m.kv_channels = nope + m.qk_pos_emb_head_dim;
    m.G = m.A;
  } else {
    for (const char* k : mla_keys) f.ignore(k);
  }
  read_experts(f, j, source, &m);
  // (null: Megatron's None, no multi-token prediction)
  if (const Json* mtp = f.peek("mtp_num_layers"); mtp && !mtp->is_null())
    m.mtp_layers = f.integer_or("mtp_num_layers", 0, 0, kMaxMtpLayers);
  f.ignore("mtp_num_layers");
  f.ignore("mtp_loss_scaling_factor");  // (the loss's weight: no cost)
  f.ignore("description");
  f.ignore("_source");
  f.reject_unknown();
  validate_model(m, source);
  return m;
}

// Hugging Face config.json: LlamaConfig / MistralConfig / Qwen2 keys, GPT2Config keys.
ModelSpec model_from_hf_config(const Json& j, const std::string& source, int64_t seq_length_override) {
  if (!j.is_object()) throw InputError(source + ": must be a JSON object");
  // The first of `keys` present; *used (when asked) names it, for the messages below.
  auto get_int = [&](std::initializer_list<const char*> keys, int64_t lo, int64_t hi, bool required, int64_t fallback,
                     const char** used = nullptr) -> int64_t {
    for (const char* k : keys) {
      if (j.contains(k) && !j.at(k).is_null()) {
        Fields f(j, source);
        if (used) *used = k;
        return f.integer(k, lo, hi);
      }
    }
    if (required) throw InputError(fmt::format("{}.{}: missing: an integer is required", source, *keys.begin()));
    return fallback;
  };
  // Two names of one size (num_hidden_layers and GPT-2's n_layer, ...) given different values
  // leave the model undefined: refused rather than one of them read.
  auto agree = [&](std::initializer_list<const char*> keys) {
    const char* first = nullptr;
    for (const char* k : keys) {
      if (!j.contains(k) || j.at(k).is_null()) continue;
      if (!first) first = k;
      else if (j.at(k) != j.at(first))
        fail_field(source + "." + k, show_value(j.at(k)),
                   fmt::format("disagrees with {} = {}: give one of them", first, show_value(j.at(first))));
    }
  };
  agree({"num_hidden_layers", "n_layer"});
  agree({"hidden_size", "n_embd", "n_embed"});
  agree({"num_attention_heads", "n_head"});
  agree({"num_key_value_heads", "num_kv_heads", "n_head_kv"});
  ModelSpec m;
  std::string model_type;
  if (j.contains("model_type") && j["model_type"].is_string()) model_type = j["model_type"].get<std::string>();
  if (model_type.empty()) model_type = model_type_of_architectures(j);
  if (j.contains("_name_or_path") && j["_name_or_path"].is_string()) m.name = j["_name_or_path"].get<std::string>();
  if (m.name.empty()) m.name = model_type.empty() ? "hf-model" : model_type;
  // BLOOM, Falcon and GPT-J share GPT-2's short key names (n_layer, n_head) but not its
  // learned positions: BLOOM uses ALiBi, Falcon RoPE (or ALiBi when "alibi" says so), GPT-J
  // RoPE. (GPT-BigCode / StarCoder keeps GPT-2's.)
  const bool bloom = model_type == "bloom";
  const bool falcon = model_type == "falcon" || model_type == "RefinedWeb" || model_type == "RefinedWebModel";
  // (A config that also gives num_hidden_layers, a Llama's with a stray n_layer, is not
  // GPT-2's: GPT2Config saves n_layer alone.)
  // Qwen (v1, model_type qwen) and the first Phi-1.5/Phi-2 configs (phi-msft) use GPT-2's
  // names too, for a Llama-style and a rotary model.
  const bool qwen1 = model_type == "qwen";
  const bool gpt2 = model_type == "gpt2" || (j.contains("n_layer") && !j.contains("num_hidden_layers") && !bloom &&
                                             !falcon && model_type != "gptj" && !qwen1 && model_type != "phi-msft");
  // A yes/no key (attention_bias, multi_query, ...): absent or null is no; anything but a
  // boolean is refused rather than read as no.
  auto flag = [&](const char* k) {
    if (!j.contains(k) || j[k].is_null()) return false;
    if (!j[k].is_boolean()) fail_field(source + "." + k, show_value(j[k]), "must be true or false");
    return j[k].get<bool>();
  };
  if (!j.contains("num_hidden_layers") && !j.contains("n_layer") && j.contains("text_config") &&
      j["text_config"].is_object())
    fail_field(source + ".text_config", "{...}",
               "a multimodal model's config: strata models the language model alone; give its text_config "
               "object as the config.json (the vision or audio encoder is not modelled)");
  if (j.contains("is_encoder_decoder") && j["is_encoder_decoder"].is_boolean() && j["is_encoder_decoder"].get<bool>())
    fail_field(source + ".is_encoder_decoder", "true",
               "encoder-decoder models (T5, BART, ...) are not modelled: strata plans decoder-only transformers");
  // Families whose own key names strata does not read: named, rather than a missing
  // num_hidden_layers.
  if (model_type == "chatglm" || model_type == "mpt")
    fail_field(source + ".model_type", show_value(Json(model_type)),
               "is not read (its own key names: num_layers / n_layers, d_model, ...): give the model as a model JSON");
  if (encoder_only(model_type))
    fail_field(source + ".model_type", show_value(Json(model_type)),
               "encoder-only models (bidirectional attention, no causal language-model head) are not modelled: "
               "strata plans decoder-only transformers");
  // Hybrids of attention with state-space (Mamba) or linear-attention layers: by their family,
  // or by the keys that lay their layers out, else they would read as a transformer whose
  // every layer is attention.
  {
    static const char* const kHybridTypes[] = {
        "jamba",    "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba",       "zamba2",       "bamba",
        "qwen3_next", "qwen3_5",  "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "lfm2",      "lfm2_moe",
        "mamba",    "mamba2",     "falcon_mamba", "rwkv",        "rwkv5",       "rwkv6",        "rwkv7",
        "recurrent_gemma", "minimax", "minimax_text_01", "plamo2", "hymba",      "kimi_linear"};
    const bool by_type = std::find_if(std::begin(kHybridTypes), std::end(kHybridTypes), [&](const char* t) {
                           return model_type == t;
                         }) != std::end(kHybridTypes);
    std::string key;
    for (const char* k : {"hybrid_override_pattern", "layers_block_type", "attn_layer_period", "attn_layer_offset",
                          "linear_num_key_heads", "linear_attn_config", "block_types"})
      if (key.empty() && j.contains(k) && !j[k].is_null()) key = k;
    for (auto it = j.begin(); key.empty() && it != j.end(); ++it)
      if ((it.key().rfind("mamba_", 0) == 0 || it.key().rfind("ssm_", 0) == 0) && !it.value().is_null()) key = it.key();
    const char* const hybrid_rule =
        "a hybrid of attention with state-space (Mamba) or linear-attention layers is not modelled: strata plans "
        "transformers whose every layer is attention";
    if (by_type || !key.empty())
      fail_field(source + (key.empty() ? std::string(".model_type") : "." + key),
                 key.empty() ? show_value(Json(model_type)) : show_value(j[key]).substr(0, 80), hybrid_rule);
    // layer_types: each layer full or sliding-window attention (with or without a window).
    if (j.contains("layer_types") && j["layer_types"].is_array())
      for (size_t i = 0; i < j["layer_types"].size(); ++i) {
        const Json& t = j["layer_types"][i];
        const std::string kind = t.is_string() ? t.get<std::string>() : "";
        if (kind == "full_attention" || kind == "sliding_attention") continue;
        bool other_layer = false;  // a recurrent, convolutional or linear-attention layer
        for (const char* s : {"linear", "mamba", "ssm", "recurren", "conv", "delta", "rwkv", "lightning", "hybrid"})
          other_layer = other_layer || kind.find(s) != std::string::npos;
        fail_field(fmt::format("{}.layer_types[{}]", source, i), show_value(t),
                   other_layer ? hybrid_rule
                               : "must be \"full_attention\" or \"sliding_attention\" (other attention kinds are not "
                                 "modelled)");
      }
  }
  // DBRX's experts are in its own ffn_config, not read. (GLM-4.5's and DeepSeek's
  // n_routed_experts are read below.)
  const bool glm_moe = model_type == "glm4_moe";
  const bool deepseek = model_type == "deepseek_v2" || model_type == "deepseek_v3" || model_type == "kimi_k2";
  if (!glm_moe && !deepseek)
    reject_experts(j, source, {"n_routed_experts", "moe_num_experts", "num_routed_experts"},
                   "not read for this model_type (n_routed_experts is glm4_moe's, deepseek_v2's, deepseek_v3's and "
                   "kimi_k2's): give the model as a model JSON with num_experts");
  if (j.contains("ffn_config") && j["ffn_config"].is_object())  // DBRX
    reject_experts(j["ffn_config"], source + ".ffn_config", {"moe_num_experts"},
                   "DBRX's ffn_config is not read: give the model as a model JSON with num_experts");
  m.L = get_int({"num_hidden_layers", "n_layer"}, 1, kMaxLayers, true, 0);
  m.H = get_int({"hidden_size", "n_embd", "n_embed"}, 1, kMaxHidden, true, 0);
  m.A = get_int({"num_attention_heads", "n_head"}, 1, kMaxHeads, true, 0);
  // Falcon: num_kv_heads (n_head_kv in older configs) with the new decoder architecture
  // (40B, 180B), else one with multi-query attention (7B; FalconConfig's default), which a
  // re-saved config lists as num_kv_heads = heads anyway; StarCoder's multi_query alike.
  const bool multi_query = flag("multi_query") || (falcon && !j.contains("multi_query"));
  // (RefinedWeb, the 40B and 180B models' own type, is the new decoder architecture:
  // n_head_kv groups; RefinedWebModel, the 7B's, multi-query.)
  if (falcon && !flag("new_decoder_architecture") && model_type != "RefinedWeb") {
    m.G = multi_query ? 1 : m.A;
  } else {
    const char* kv = nullptr;
    m.G = get_int({"num_key_value_heads", "num_kv_heads", "n_head_kv"}, 1, kMaxHeads, false, multi_query ? 1 : m.A, &kv);
    if (kv && (m.G > m.A || m.A % m.G != 0))
      fail_field(source + "." + kv, std::to_string(m.G),
                 fmt::format("must divide num_attention_heads = {} (grouped-query attention: each key/value head "
                             "serves the same number of query heads)",
                             m.A));
  }
  m.V = get_int({"vocab_size"}, 1, kMaxVocab, true, 0);
  // BLOOM's config has no length (ALiBi): --seq-length gives it.
  m.S = get_int({"max_position_embeddings", "n_positions", "n_ctx", "seq_length"}, 1, kMaxSeq, false,
                falcon ? 2048 : 0);  // (FalconConfig's default: Falcon's configs name none)
  const int64_t config_positions = m.S;
  if (seq_length_override > 0) m.S = seq_length_override;
  else if (m.S == 0)
    throw InputError(source + ".max_position_embeddings: missing: an integer is required (or give --seq-length)");
  // Llama 3.1 and YaRN configs name it in rope_scaling, transformers 5 in rope_parameters,
  // Phi-3's at the top level.
  if (seq_length_override <= 0) {
    for (const Json* at : {&j, j.contains("rope_scaling") ? &j["rope_scaling"] : nullptr,
                           j.contains("rope_parameters") ? &j["rope_parameters"] : nullptr}) {
      if (!at || !at->is_object() || !at->contains("original_max_position_embeddings")) continue;
      const Json& o = (*at)["original_max_position_embeddings"];
      if (!o.is_number_integer()) continue;
      const int64_t original = o.get<int64_t>();
      if (original > 0 && original < m.S) m.pretrain_seq_length = original;
    }
  }
  // Transformers' defaults when the key is absent: GPT-2 "gelu_new", BLOOM and Falcon
  // "gelu", Nemotron "relu2", the rest (Llama, Mistral, Qwen2, ...) "silu".
  std::string act = gpt2 || model_type == "gptj"  ? "gelu_new"
                    : bloom || falcon             ? "gelu"
                    : model_type == "nemotron"    ? "relu2"
                                                  : "silu";
  std::string act_key = "hidden_act";  // (the key read, for the error below)
  for (const char* k : {"hidden_act", "activation_function", "hidden_activation"}) {  // (Gemma 3: the last)
    if (j.contains(k) && !j[k].is_null()) {  // (Gemma's configs give hidden_activation null beside hidden_act)
      if (!j[k].is_string()) fail_field(source + "." + k, show_value(j[k]), "must be a string");
      act = j[k].get<std::string>();
      act_key = k;
      break;
    }
  }
  const bool gemma = model_type.rfind("gemma", 0) == 0;  // Gemma's MLP is a gated GELU
  if (act == "silu" || act == "swish" || act == "swiglu") {
    m.activation = Activation::swiglu;
  } else if (act.rfind("gelu", 0) == 0) {
    m.activation = gemma ? Activation::geglu : Activation::gelu;
  } else if (act == "relu2") {  // squared ReLU, ungated (Nemotron-4, Minitron)
    m.activation = Activation::squared_relu;
  } else {
    fail_field(source + "." + act_key, show_value(Json(act)),
               "must be silu (SwiGLU MLP), a gelu variant or relu2 (squared ReLU)");
  }
  const bool llama = m.gated();
  m.F = get_int({"intermediate_size", "n_inner"}, 1, kMaxFfn, false, llama ? llama_ffn_size(m.H) : 4 * m.H);
  // Qwen v1's intermediate_size (ffn_hidden_size in its first configs) is its two gate and up
  // projections' together: each is half of it wide.
  if (qwen1) m.F = get_int({"intermediate_size", "ffn_hidden_size"}, 2, kMaxFfn, true, 0) / 2;
  m.kv_channels = get_int({"head_dim"}, 0, kMaxHidden, false, 0);
  if (m.kv_channels * m.A == m.H) m.kv_channels = 0;
  // DeepSeek-V2/V3 and Kimi K2: multi-head latent attention (q_lora_rank null: one query
  // projection), each head's query and key qk_nope_head_dim + qk_rope_head_dim wide.
  if (deepseek) {
    // (absent: the config classes' 1536, DeepSeek's own and transformers' alike; null: none)
    m.q_lora_rank = j.contains("q_lora_rank") ? get_int({"q_lora_rank"}, 0, kMaxHidden, false, 0) : 1536;
    m.kv_lora_rank = get_int({"kv_lora_rank"}, 1, kMaxHidden, true, 0);
    m.qk_pos_emb_head_dim = get_int({"qk_rope_head_dim"}, 1, kMaxHidden, true, 0);
    m.v_head_dim = get_int({"v_head_dim"}, 1, kMaxHidden, true, 0);
    m.kv_channels = get_int({"qk_nope_head_dim"}, 1, kMaxHidden, true, 0) + m.qk_pos_emb_head_dim;
    m.G = m.A;
  }
  // Mixture of experts: Mixtral and GPT-OSS (num_local_experts, experts of intermediate_size),
  // Qwen2-MoE and Qwen3-MoE (num_experts of moe_intermediate_size, Qwen2-MoE's shared expert
  // of shared_expert_intermediate_size), OLMoE (num_experts of intermediate_size), GLM-4.5
  // (n_routed_experts of moe_intermediate_size and n_shared_experts more as the shared one);
  // each with num_experts_per_tok. The dense layers among them: Qwen-MoE's mlp_only_layers
  // and those not on every decoder_sparse_step-th (layer l is an MoE layer where
  // (l + 1) % step == 0), GLM's first first_k_dense_replace; their MLP is intermediate_size.
  // Where a key is missing, its config class's default (as transformers reads the file):
  // Glm4MoeConfig 128 experts of 1408, 8 per token, one shared, the first layer dense;
  // DeepseekV3Config (Kimi K2's too) 256 of 2048, 8 per token, one shared, the first 3
  // dense; Qwen2MoeConfig 60 of 1408, 4 per token, a shared expert of 5632; Qwen3MoeConfig
  // 128 of 768, 8 per token; MixtralConfig 8, 2 per token; GptOssConfig 128, 4 per token;
  // OlmoeConfig 64, 8 per token. (DeepSeek's own DeepseekV2Config, which its configs name,
  // defaults to dense, no experts, as here; transformers' later class to 64.)
  const bool deepseek_v3 = model_type == "deepseek_v3" || model_type == "kimi_k2";
  struct FamilyMoe {
    int64_t experts, topk, expert_ffn, shared_ffn, shared_experts, first_dense;  // expert_ffn 0: intermediate_size
  };
  const FamilyMoe fam = glm_moe                    ? FamilyMoe{128, 8, 1408, 0, 1, 1}
                        : deepseek_v3              ? FamilyMoe{256, 8, 2048, 0, 1, 3}
                        : model_type == "qwen2_moe" ? FamilyMoe{60, 4, 1408, 5632, 0, 0}
                        : model_type == "qwen3_moe" ? FamilyMoe{128, 8, 768, 0, 0, 0}
                        : model_type == "mixtral"   ? FamilyMoe{8, 2, 0, 0, 0, 0}
                        : model_type == "gpt_oss"   ? FamilyMoe{128, 4, 0, 0, 0, 0}
                        : model_type == "olmoe"     ? FamilyMoe{64, 8, 0, 0, 0, 0}
                                                    : FamilyMoe{0, 8, 0, 0, 0, 0};
  const int64_t experts = get_int({"num_local_experts", "num_experts", "n_routed_experts"}, 0, kMaxExperts, false,
                                  fam.experts);
  // Only the families whose layers are MoE layers of these keys: others (Llama 4's
  // interleaved layers and shared expert, Jamba, GraniteMoE, ...) would be misread.
  const bool known_moe = model_type == "mixtral" || model_type == "gpt_oss" || model_type == "qwen2_moe" ||
                         model_type == "qwen3_moe" || model_type == "olmoe" || glm_moe || deepseek;
  const char* experts_key = j.contains("num_local_experts")                                ? ".num_local_experts"
                            : j.contains("num_experts")                                      ? ".num_experts"
                            : j.contains("n_routed_experts") || glm_moe || deepseek          ? ".n_routed_experts"
                            : model_type == "mixtral" || model_type == "gpt_oss"             ? ".num_local_experts"
                                                                                             : ".num_experts";
  if (experts > 1 && !known_moe)
    fail_field(source + experts_key, std::to_string(experts),
               fmt::format("mixture-of-experts configs are read for model_type mixtral, gpt_oss, qwen2_moe, qwen3_moe, "
                           "olmoe, glm4_moe, deepseek_v2, deepseek_v3 and kimi_k2, not {}: give the model as a model JSON with num_experts, moe_router_topk, "
                           "moe_ffn_hidden_size and moe_layer_freq",
                           show_value(Json(model_type))));
  if (experts > 1) {
    m.E = experts;
    m.K = get_int({"num_experts_per_tok", "moe_topk", "top_k"}, 1, experts, fam.experts == 0, std::min(fam.topk, experts));
    m.Fe = j.contains("moe_intermediate_size") && !j["moe_intermediate_size"].is_null()
               ? get_int({"moe_intermediate_size"}, 1, kMaxFfn, true, 0)
           : fam.expert_ffn > 0 ? fam.expert_ffn
                                : m.F;
    m.Fs = get_int({"shared_expert_intermediate_size"}, 0, kMaxFfn, false, fam.shared_ffn);
    if (glm_moe || deepseek) m.Fs = get_int({"n_shared_experts"}, 0, 64, false, fam.shared_experts) * m.Fe;
    if (deepseek || glm_moe) {  // group-limited routing: n_group groups, topk_group of them per token
      // (DeepseekV3Config's defaults: 8 groups, 4 per token)
      const int64_t ng = get_int({"n_group"}, 1, experts, false, deepseek_v3 && experts % 8 == 0 ? 8 : 1),
                    gt = get_int({"topk_group"}, 1, ng, false, deepseek_v3 && ng == 8 ? 4 : 1);
      if (ng > 1 && gt < ng) {
        m.moe_groups = ng;
        m.moe_group_topk = gt;
      }
    }
    std::vector<uint8_t> flags(static_cast<size_t>(m.L), 1);
    std::string key, value;  // the config key that makes a layer dense, for messages
    if (j.contains("decoder_sparse_step") && !j["decoder_sparse_step"].is_null()) {
      const int64_t step = get_int({"decoder_sparse_step"}, 1, m.L, false, 1);
      for (int64_t l = 0; l < m.L; ++l) flags[static_cast<size_t>(l)] = (l + 1) % step == 0 ? 1 : 0;
      key = ".decoder_sparse_step", value = std::to_string(step);
    }
    if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
      const Json& only = j["mlp_only_layers"];
      if (!only.is_array()) fail_field(source + ".mlp_only_layers", show_value(only), "must be a list of layer indices");
      for (const Json& x : only) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= m.L)
          fail_field(source + ".mlp_only_layers", show_value(only),
                     fmt::format("must list layer indices in [0, num_hidden_layers = {})", m.L));
        flags[static_cast<size_t>(x.get<int64_t>())] = 0;
      }
      if (!only.empty()) key = ".mlp_only_layers", value = show_value(only);
    }
    if (glm_moe || deepseek) {
      const int64_t k = get_int({"first_k_dense_replace"}, 0, m.L, false, std::min(fam.first_dense, m.L));
      for (int64_t l = 0; l < k; ++l) flags[static_cast<size_t>(l)] = 0;
      key = ".first_k_dense_replace", value = std::to_string(k);
    }
    if (deepseek) {  // DeepSeek's MoE layers: from first_k_dense_replace on, every moe_layer_freq-th
      const int64_t freq = get_int({"moe_layer_freq"}, 1, m.L, false, 1);
      for (int64_t l = 0; l < m.L; ++l)
        if (l % freq != 0) flags[static_cast<size_t>(l)] = 0;
      if (freq > 1) key = ".moe_layer_freq", value = std::to_string(freq);
    }
    set_moe_layers(&m, std::move(flags), source + (key.empty() ? std::string(experts_key) : key), value);
  }
  // DeepSeek-V3's and GLM-4.5's multi-token prediction modules (MiMo's and others' too).
  m.mtp_layers = get_int({"num_nextn_predict_layers"}, 0, kMaxMtpLayers, false, 0);
  // (Cohere's and StableLM's gated models keep LayerNorm: layer_norm_eps, no rms_norm_eps.)
  const bool cohere = model_type == "cohere" || model_type == "cohere2";
  const bool layernorm_gated = cohere || model_type == "stablelm";
  m.normalization = (j.contains("rms_norm_eps") || (llama && !layernorm_gated)) && !gpt2 ? Norm::rmsnorm : Norm::layernorm;
  m.position = gpt2 ? Position::learned  // RoPE sets the modern stack for the Llama family
             : bloom || (falcon && flag("alibi")) ? Position::alibi : Position::rope;
  if (m.position == Position::learned && config_positions > 0 && m.S > config_positions)
    m.learned_positions_in_config = config_positions;
  // Their config classes' defaults where the key is absent (Starcoder2Config, CohereConfig: tied).
  m.tie_embeddings = gpt2 || gemma || bloom || falcon || cohere || model_type == "starcoder2";
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean())
      fail_field(source + ".tie_word_embeddings", show_value(j["tie_word_embeddings"]), "must be true or false");
    m.tie_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  // Biases: GPT-2, BLOOM, GPT-NeoX and Phi have them on every linear layer; Falcon when
  // "bias" says so; Llama-style models when "attention_bias" does (on the attention only,
  // counted here on all: a few parameters per layer). GLM-4.5's are on the query, key and
  // value only (Megatron's add_qkv_bias beside --disable-bias-linear, which its shared
  // expert requires): left out.
  m.bias = gpt2 || bloom || model_type == "gpt_neox" || model_type == "phi" || model_type == "phi-msft" ||
           (flag("attention_bias") && !glm_moe && !deepseek) ||
           (falcon && flag("bias"));
  auto dropout = [&](std::initializer_list<const char*> keys, double fallback) {
    for (const char* k : keys)
      if (j.contains(k) && !j.at(k).is_null()) {
        Fields f(j, source);
        return f.real(k, 0.0, 0.999);
      }
    return fallback;
  };
  m.attention_dropout = dropout({"attention_dropout", "attn_pdrop"}, gpt2 ? 0.1 : 0.0);
  m.hidden_dropout = dropout({"hidden_dropout", "resid_pdrop"}, gpt2 ? 0.1 : 0.0);
  // Sliding-window attention: sliding_window (null or 0: none; Qwen2 carries one it does
  // not use, use_sliding_window false), on the layers that layer_types names
  // "sliding_attention", else all but every sliding_window_pattern-th (Gemma 3), every
  // other one (Gemma 2), those from max_window_layers on (Qwen2), or all (Mistral v0.1).
  // (Qwen's configs default use_sliding_window to false.) A window longer than any
  // sequence is none.
  const bool qwen = model_type.rfind("qwen", 0) == 0;
  const bool window_off = j.contains("use_sliding_window") && j["use_sliding_window"].is_boolean()
                              ? !j["use_sliding_window"].get<bool>()
                              : qwen;
  const Json* sw = j.contains("sliding_window") ? &j["sliding_window"] : nullptr;
  const bool beyond = sw && sw->is_number_unsigned() && sw->get<uint64_t>() > static_cast<uint64_t>(kMaxSeq);
  if (!window_off && sw && !sw->is_null() && !beyond && !(sw->is_number_integer() && sw->get<int64_t>() == 0)) {
    m.window_size = get_int({"sliding_window"}, 1, kMaxSeq, true, 0);
    if (j.contains("layer_types") && j["layer_types"].is_array()) {
      if (j["layer_types"].size() != static_cast<size_t>(m.L))
        fail_field(source + ".layer_types", fmt::format("({} entries)", j["layer_types"].size()),
                   fmt::format("must name one attention type per layer ({})", m.L));
      for (const Json& t : j["layer_types"])  // (each entry one of the two, checked above)
        m.window_layers += t == "sliding_attention";
    } else if (j.contains("sliding_window_pattern") && !j["sliding_window_pattern"].is_null()) {
      m.window_layers = m.L - m.L / get_int({"sliding_window_pattern"}, 1, kMaxLayers, true, 1);
    } else if (model_type.rfind("gemma3", 0) == 0) {  // Gemma3TextConfig's default pattern: 6
      m.window_layers = m.L - m.L / 6;
    } else if (model_type == "gemma2") {
      m.window_layers = m.L - m.L / 2;
    } else if (j.contains("max_window_layers") && !j["max_window_layers"].is_null()) {
      m.window_layers = m.L - std::min(m.L, get_int({"max_window_layers"}, 0, kMaxLayers, true, 0));
    } else {
      m.window_layers = m.L;
    }
  }
  validate_model(m, source);
  return m;
}

Json model_to_json(const ModelSpec& m) {
  Json j{{"name", m.name},
              {"num_layers", m.L},
              {"hidden_size", m.H},
              {"num_attention_heads", m.A},
              {"num_query_groups", m.G},
              {"ffn_hidden_size", m.F},
              {"vocab_size", m.V},
              {"seq_length", m.S},
              {"activation", to_string(m.activation)},
              {"normalization", to_string(m.normalization)},
              {"position_embedding", to_string(m.position)},
              {"tie_embeddings", m.tie_embeddings},
              {"add_bias_linear", m.bias},
              {"attention_dropout", m.attention_dropout},
              {"hidden_dropout", m.hidden_dropout},
              {"make_vocab_size_divisible_by", m.vocab_divisor},
              {"kv_channels", m.kv_channels},
              {"window_size", m.window_size},
              {"window_layers", m.window_layers}};
  if (m.mtp_layers > 0) j["mtp_num_layers"] = m.mtp_layers;
  if (m.mla()) {
    j.erase("kv_channels");
    j["multi_latent_attention"] = true;
    j["q_lora_rank"] = m.q_lora_rank;
    j["kv_lora_rank"] = m.kv_lora_rank;
    j["qk_head_dim"] = m.qk_head_dim();
    j["qk_pos_emb_head_dim"] = m.qk_pos_emb_head_dim;
    j["v_head_dim"] = m.v_head_dim;
  }
  if (m.moe()) {
    j["num_experts"] = m.E;
    j["moe_router_topk"] = m.K;
    j["moe_ffn_hidden_size"] = m.Fe;
    j["moe_shared_expert_intermediate_size"] = m.Fs;
    if (m.mixed()) j["moe_layer_freq"] = m.moe_layer;
    if (m.moe_groups > 0) {
      j["moe_router_num_groups"] = m.moe_groups;
      j["moe_router_group_topk"] = m.moe_group_topk;
    }
  }
  return j;
}

ModelSpec load_model(const std::string& name_or_path, int64_t seq_length_override) {
  ModelSpec m;
  if (!find_model_preset(name_or_path, &m)) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(name_or_path, ec)) {
      std::string names;
      for (const auto& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
      throw InputError(fmt::format("--model: '{}' is neither a preset ({}) nor a readable file", name_or_path, names));
    }
    const Json j = read_json_file(name_or_path, "--model");
    // A Hugging Face config: it names its model_type or architectures, or gives its layers
    // under its own names and not Megatron's (a model JSON with a stray num_hidden_layers is
    // read as a model JSON, which refuses the key).
    const bool hf = j.is_object() && (j.contains("architectures") || j.contains("model_type") ||
                                      ((j.contains("num_hidden_layers") || j.contains("n_layer")) &&
                                       !j.contains("num_layers")));
    m = hf ? model_from_hf_config(j, "model '" + name_or_path + "'", seq_length_override)
           : model_from_json(j, "model");
  }
  if (seq_length_override > 0) {
    m.S = seq_length_override;
    validate_model(m, "--seq-length");
  }
  return m;
}

}  // namespace strata
