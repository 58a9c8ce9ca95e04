// The model presets of SPEC.md, with the published dimensions of each model.
#include <map>

#include "costmodel/model_spec.h"

namespace strata {

namespace {

ModelSpec gpt(const char* name, int64_t L, int64_t H, int64_t A, int64_t V, int64_t S) {
  ModelSpec m;
  m.name = name;
  m.L = L; m.H = H; m.A = A; m.G = A; m.F = 4 * H; m.V = V; m.S = S;
  return m;  // gelu, layernorm, learned positions, tied, biases, dropout 0.1 (the struct defaults)
}

ModelSpec llama(const char* name, int64_t L, int64_t H, int64_t A, int64_t G, int64_t F, int64_t V, int64_t S) {
  ModelSpec m;
  m.name = name;
  m.L = L; m.H = H; m.A = A; m.G = G; m.F = F; m.V = V; m.S = S;
  m.activation = Activation::swiglu;
  m.normalization = Norm::rmsnorm;
  m.position = Position::rope;
  m.tie_embeddings = false;
  m.bias = false;
  m.attention_dropout = 0.0;
  m.hidden_dropout = 0.0;
  return m;
}

// A Llama-style model whose every MLP is E experts of Fe, K per token (model_spec.h).
ModelSpec moe(ModelSpec m, int64_t E, int64_t K, int64_t Fe, int64_t kv_channels = 0) {
  m.E = E; m.K = K; m.Fe = Fe; m.kv_channels = kv_channels;
  return m;
}

// The first k layers dense (MLP of F), the others MoE layers with a shared expert of Fs.
ModelSpec first_dense(ModelSpec m, int64_t k, int64_t Fs) {
  m.Fs = Fs;
  m.moe_layer.assign(static_cast<size_t>(m.L), 1);
  for (int64_t l = 0; l < k; ++l) m.moe_layer[static_cast<size_t>(l)] = 0;
  return m;
}

// n multi-token prediction modules (ModelSpec::mtp_layers).
ModelSpec mtp(ModelSpec m, int64_t n) {
  m.mtp_layers = n;
  return m;
}

// Multi-latent attention (DeepSeek): query latent ql, key/value latent kvl, heads of
// nope + rope for queries and keys, v for values.
ModelSpec mla(ModelSpec m, int64_t ql, int64_t kvl, int64_t nope, int64_t rope, int64_t v) {
  m.q_lora_rank = ql; m.kv_lora_rank = kvl; m.qk_pos_emb_head_dim = rope; m.v_head_dim = v;
  m.kv_channels = nope + rope;
  m.G = m.A;
  return m;
}

const std::map<std::string, ModelSpec>& presets() {
  static const std::map<std::string, ModelSpec> p = [] {
    std::map<std::string, ModelSpec> m;
    auto add = [&](ModelSpec s) { m[s.name] = s; };
    // GPT-2 (Radford et al. 2019; HF gpt2 and gpt2-xl configs).
    add(gpt("gpt2-124m", 12, 768, 12, 50257, 1024));
    add(gpt("gpt2-1.5b", 48, 1600, 25, 50257, 1024));
    // GPT-3 175B (Brown et al. 2020) with Megatron's padded GPT-2 vocabulary.
    add(gpt("gpt3-175b", 96, 12288, 96, 51200, 2048));
    // Llama 2 (Touvron et al. 2023, HF configs), Llama 3 / 3.1 (Dubey et al. 2024).
    add(llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096));
    add(llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096));
    add(llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192));
    add(llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192));
    add(llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192));
    // Mixture of experts (HF configs; sequence 4096 as Megatron-Bridge's recipes train them):
    // Mixtral 8x7B and 8x22B (Jiang et al. 2024), Qwen3 30B-A3B and 235B-A22B (head_dim
    // 128, wider than H/A).
    add(moe(llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096), 8, 2, 14336));
    add(moe(llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 4096), 8, 2, 16384));
    add(moe(llama("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, 4096), 128, 8, 768, 128));
    add(moe(llama("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, 4096), 128, 8, 1536, 128));
    // GLM-4.5 and GLM-4.5-Air (zai-org's HF configs, Megatron-Bridge's GLM-4.5 providers):
    // the first 3 (1) layers dense with an MLP of intermediate_size, the others 160 (128)
    // routed experts and one shared expert of moe_intermediate_size; head_dim 128. (Their
    // query/key/value biases and the multi-token-prediction layer are left out.)
    // (GLM-4.5's and DeepSeek-V3's one multi-token prediction module, as their Hugging Face
    // configs' num_nextn_predict_layers give it and Megatron-Bridge trains them.)
    add(mtp(first_dense(moe(llama("glm-4.5", 92, 5120, 96, 8, 12288, 151552, 4096), 160, 8, 1536, 128), 3, 1536), 1));
    add(mtp(first_dense(moe(llama("glm-4.5-air", 46, 4096, 96, 8, 10944, 151552, 4096), 128, 8, 1408, 128), 1, 1408), 1));
    // DeepSeek-V3 (DeepSeek-AI 2024, its HF config): multi-latent attention, the first 3 of 61
    // layers dense (18432), then 256 routed experts of 2048, 8 per token, and one shared.
    // Its routing limits each token to 4 of 8 groups of 32 experts (n_group, topk_group).
    // (Its multi-token-prediction module is left out.)
    ModelSpec ds = mla(first_dense(moe(llama("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 4096), 256, 8, 2048), 3, 2048),
                       1536, 512, 128, 64, 128);
    ds.moe_groups = 8;
    ds.moe_group_topk = 4;
    ds.mtp_layers = 1;
    add(ds);
    // Tiny models for the CPU executor: a few million parameters, a step well under a
    // second on one core. Vocabulary 512 (the synthetic token source).
    ModelSpec tg = gpt("tiny-gpt", 4, 256, 4, 512, 128);
    add(tg);
    add(llama("tiny-llama", 4, 256, 8, 2, llama_ffn_size(256, 64), 512, 128));
    return m;
  }();
  return p;
}

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& [k, v] : presets()) names.push_back(k);
  return names;
}

bool find_model_preset(const std::string& name, ModelSpec* out) {
  auto it = presets().find(name);
  if (it == presets().end()) return false;
  *out = it->second;
  return true;
}

}  // namespace strata
