// ModelSpec: the dimensions of a decoder-only transformer and its parameter and FLOP
// counts. Loads the model JSON of SPEC.md, Hugging Face config.json files and presets.
// Owns no parallelism beyond dividing a count by the tensor parallel size t.
//
// Dimension letters (used in costmodel/ and executor/ alike):
//   B micro-batch, S sequence, H hidden, A heads, G query groups, D head dim (H/A unless
//   kv_channels says otherwise; the attention is A*D wide),
//   F ffn hidden, V vocab (padded), L layers; t p d c v the parallel degrees.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "costmodel/json_input.h"

namespace strata {

// swiglu and geglu are gated: fc1 is 2F wide. squared_relu: max(x, 0)^2 on fc1's F outputs
// (Megatron-LM's --squared-relu; Nemotron-4's MLP, Hugging Face's hidden_act "relu2").
enum class Activation { gelu, swiglu, geglu, squared_relu };
inline bool gated(Activation a) { return a == Activation::swiglu || a == Activation::geglu; }
enum class Norm { layernorm, rmsnorm };
enum class Position { learned, rope, alibi, none };

struct ModelSpec {
  std::string name;
  int64_t L = 0;  // num_layers
  int64_t H = 0;  // hidden_size
  int64_t A = 0;  // num_attention_heads
  int64_t G = 0;  // num_query_groups (key/value heads)
  int64_t F = 0;  // ffn_hidden_size
  int64_t V = 0;  // vocab_size as given (padded per t by padded_vocab)
  int64_t S = 0;  // seq_length
  Activation activation = Activation::gelu;
  Norm normalization = Norm::layernorm;
  Position position = Position::learned;
  bool tie_embeddings = true;
  bool bias = true;                      // add_bias_linear (GPT: true, Llama: false)
  double attention_dropout = 0.1;        // Megatron defaults for GPT; Llama trains with 0
  double hidden_dropout = 0.1;
  int64_t vocab_divisor = 128;           // make_vocab_size_divisible_by
  int64_t kv_channels = 0;               // head dim D when it is not H/A (Gemma); 0 = H/A
  // Sliding-window attention (Mistral v0.1, Gemma 2 and 3; Megatron's window_size): on
  // window_layers of the L layers each query attends to the window_size keys up to itself,
  // on the others to its whole causal prefix. 0 = none.
  int64_t window_size = 0;
  int64_t window_layers = 0;
  // Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; Megatron-core's
  // --multi-latent-attention): queries through a low-rank q_lora_rank (0: one projection
  // from H, Megatron's None), keys and values from a shared latent of kv_lora_rank plus a
  // rotary part of qk_pos_emb_head_dim shared by the heads. Each head's query and key are
  // kv_channels = qk_head_dim + qk_pos_emb_head_dim wide (D), its value and output
  // v_head_dim (Dv); G = A. kv_lora_rank 0: ordinary attention.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_pos_emb_head_dim = 0;
  int64_t v_head_dim = 0;
  // A Hugging Face config whose rope_scaling extends the context (Llama 3.1, Qwen 2.5 with
  // YaRN, ...): its original_max_position_embeddings, the length the model was pre-trained
  // at, when shorter than S (taken from max_position_embeddings); 0 otherwise. Nothing is
  // costed from it: the CLI names it when no --seq-length was given.
  int64_t pretrain_seq_length = 0;
  // A Hugging Face config with learned positions (GPT-2's n_positions) given a longer
  // --seq-length: its table's length (the model is costed with S rows, as a model trained
  // at S has them); 0 otherwise. The CLI names it.
  int64_t learned_positions_in_config = 0;
  // Mixture of experts (Megatron-core's MoE layer, on every layer): num_experts routed
  // experts of moe_ffn_hidden_size each (the model's activation), moe_router_topk of them
  // per token, and a shared expert of moe_shared_expert_intermediate_size (0: none) that
  // every token passes. E = 0 is a dense MLP of F.
  int64_t E = 0;   // num_experts
  int64_t K = 0;   // moe_router_topk
  int64_t Fe = 0;  // moe_ffn_hidden_size
  int64_t Fs = 0;  // moe_shared_expert_intermediate_size
  // Group-limited routing (DeepSeek-V3's node-limited routing; Megatron-core's
  // moe_router_num_groups and moe_router_group_topk, Hugging Face's n_group and
  // topk_group): the experts in moe_groups equal groups of consecutive experts, each
  // token's K chosen within moe_group_topk of them. 0: none. It bounds the nodes the flex
  // dispatcher sends a token to (Plan::moe_dispatcher); nothing else is costed from it.
  int64_t moe_groups = 0, moe_group_topk = 0;
  // Which layers are MoE layers where the model mixes them with dense ones (Megatron-core's
  // moe_layer_freq as a list; DeepSeek's and GLM's first_k_dense_replace, Qwen-MoE's
  // decoder_sparse_step and mlp_only_layers): moe_layer[l] is 1 for an MoE layer, 0 for a
  // dense MLP of F. Empty: every layer is alike (MoE when moe()). When set it holds L
  // entries, both kinds among them.
  std::vector<uint8_t> moe_layer;
  // Multi-token prediction (DeepSeek-V3, GLM-4.5; Megatron-core's --mtp-num-layers, Hugging
  // Face's num_nextn_predict_layers): after the decoder, mtp_layers modules each predict one
  // token further: the next tokens' embeddings and the hidden states normed (enorm, hnorm),
  // concatenated and projected from 2H to H (eh_proj), one transformer layer of the last
  // decoder layer's kind, a final norm, and the shared output layer and loss again. Megatron
  // places them with the loss (the last pipeline stage, or where a
  // pipeline_model_parallel_layout puts its 'm's), with its own copy of the word embedding
  // there. 0: none.
  int64_t mtp_layers = 0;

  int64_t D() const { return kv_channels > 0 ? kv_channels : H / A; }
  int64_t AD() const { return A * D(); }  // width of the queries and of the attention output
  // Key/value heads on one tensor-parallel rank: G/t, or with fewer groups than ranks
  // (t a multiple of G: multi-query attention under tensor parallelism, as Megatron-DeepSpeed,
  // the BigCode fork and Transformer Engine run it) each group replicated on t/G ranks.
  int64_t kv_heads_per_rank(int64_t t) const { return G >= t ? G / t : 1; }
  int64_t kv_width(int64_t t) const { return kv_heads_per_rank(t) * D(); }  // K (or V) columns per rank
  bool mla() const { return kv_lora_rank > 0; }
  int64_t qk_head_dim() const { return D() - qk_pos_emb_head_dim; }  // MLA: a head's query/key without rope
  int64_t Dv() const { return mla() ? v_head_dim : D(); }  // a head's value (and output) width
  int64_t VD() const { return A * Dv(); }                  // width of the attention output
  int64_t v_width(int64_t t) const { return kv_heads_per_rank(t) * Dv(); }  // V columns per rank
  // One layer's attention parameters on one tensor-parallel rank with MLA: the down
  // projections and their norms on every rank (Megatron's "duplicated" linears), the up
  // projections and the output projection split.
  int64_t mla_attention_params(int64_t t) const;
  bool gated() const { return strata::gated(activation); }
  // A sliding window that cuts something: shorter than the sequence, on some layer.
  bool windowed() const { return window_size > 0 && window_size < S && window_layers > 0; }
  // The share of the S x S score block a causal layer's fused attention computes, averaged
  // over the layers: 1/2 without a window (FlashAttention skips the masked blocks).
  double causal_share() const;
  int64_t fc1_out() const { return gated() ? 2 * F : F; }  // columns of the first MLP matrix
  bool moe() const { return E > 1; }
  bool mixed() const { return !moe_layer.empty(); }  // dense and MoE layers
  // MoE layers among layers [begin, end) (all of them in a model with experts on every layer).
  int64_t moe_layers_in(int64_t begin, int64_t end) const;
  int64_t moe_layer_count() const { return moe_layers_in(0, L); }
  // The model's dense layers as a model of their own: no experts, the same attention and
  // MLP of F (costed by the same functions as a dense model's layers).
  ModelSpec dense_layers() const;
  // Whether the multi-token prediction layers are MoE layers: of the last decoder layer's kind.
  bool mtp_moe() const { return mixed() ? moe_layer.back() != 0 : moe(); }
  // Parameters of the mtp_layers modules on one tensor-parallel rank, their transformer
  // layers (of mtp_moe()'s kind, the experts as layer_params splits them) and per module
  // eh_proj (2H x H, column-parallel, no bias) and three norms (enorm, hnorm, the final
  // one); not the word embedding copy nor the output layer they share.
  int64_t mtp_params(int64_t t, int64_t ep = 1, int64_t etp = 0) const;
  int64_t expert_fc1_out() const { return gated() ? 2 * Fe : Fe; }  // an expert's first matrix
  int64_t shared_fc1_out() const { return gated() ? 2 * Fs : Fs; }  // the shared expert's
  // Parameters of one routed expert split over etp ranks (Megatron's
  // expert_tensor_parallel_size), and those of the E/ep experts an expert-parallel rank
  // holds in a layer (0 for a dense model).
  int64_t expert_params(int64_t etp) const;
  int64_t layer_expert_params(int64_t etp, int64_t ep) const { return moe() ? E / ep * expert_params(etp) : 0; }
  // Megatron pads the vocabulary to a multiple of vocab_divisor * t.
  int64_t padded_vocab(int64_t t) const;

  // Parameters of one transformer layer held by one tensor-parallel rank: the split
  // matrices and biases divided by t, the norms and row-parallel biases replicated.
  // With experts (a mixed model's MoE layers): the router (E x H, replicated), the shared expert (split like a dense
  // MLP) and the E/ep routed experts of an expert-parallel rank, each split over etp ranks
  // (layer_expert_params; etp 0: t, Megatron's default).
  int64_t layer_params(int64_t t, int64_t ep = 1, int64_t etp = 0) const;
  int64_t layer_norm_params() const;     // replicated on every tp rank (both norms)
  // Word embedding per tp rank (vocab-parallel, padded vocab). The output layer has as
  // many again when embeddings are untied.
  int64_t word_embedding_params(int64_t t) const;
  int64_t position_params() const;       // learned positions: S*H, replicated
  int64_t final_norm_params() const;
  // Total parameters of the model (t = 1, padded vocab of t = 1); the multi-token prediction
  // modules' not among them (DeepSeek-V3's 671B; mtp_params(1) more are trained).
  double total_params() const;
  // Parameters one token passes through: total_params with K of the E experts (Mistral's,
  // Qwen's and OLMoE's model cards count so); without the input embedding table (a lookup,
  // as OpenAI's, DeepSeek's and GLM's cards count; a tied table stays as the output layer).
  double active_params() const;
  double active_params_without_input_embedding() const;

  // Model FLOPs of one forward pass over B sequences: every GEMM (2 per MAC),
  // attention over every key a query may see (Megatron's convention: the full S x S, causal
  // or not; a windowed layer's window_size keys), logits; with experts the K routed experts
  // and the shared expert a token passes (Megatron's count, the router left out); with
  // multi-token prediction its layers, eh_proj and logits again (Megatron's count but for
  // its norms). No recompute.
  double forward_flops(int64_t B) const;
  double layer_forward_flops(int64_t B) const;  // the mean of the L layers
  // One MoE layer's (moe_layer true, for a model with experts) or one dense layer's.
  double layer_forward_flops(int64_t B, bool is_moe) const;
  // Keys per query in that count, the mean over the layers: S, or with a sliding window
  // (L - window_layers) S + window_layers window_size, over L.
  double attention_keys() const;
  double logits_forward_flops(int64_t B) const;
};

// Loads a model from a preset name, a model JSON path or a Hugging Face config.json path.
// seq_length_override > 0 replaces the sequence length.
ModelSpec load_model(const std::string& name_or_path, int64_t seq_length_override = 0);
ModelSpec model_from_json(const Json& j, const std::string& source);
// seq_length_override > 0 stands in for a missing length (BLOOM's config has none).
ModelSpec model_from_hf_config(const Json& j, const std::string& source, int64_t seq_length_override = 0);
// Checks every field and cross-field rule; throws InputError naming the field.
void validate_model(const ModelSpec& m, const std::string& source);
Json model_to_json(const ModelSpec& m);

// Presets (model_presets.cpp).
std::vector<std::string> model_preset_names();
bool find_model_preset(const std::string& name, ModelSpec* out);

// moe_layer as Megatron-LM's --moe-layer-freq takes it: the shortest repeated list
// ("[1,0]*24") or runs ("([0]*3+[1]*58)").
std::string moe_layer_freq_text(const std::vector<uint8_t>& flags);

// Llama's FFN size rule: multiple_of * ceil((8H/3) / multiple_of).
int64_t llama_ffn_size(int64_t H, int64_t multiple_of = 256);

const char* to_string(Activation a);
const char* to_string(Norm n);
const char* to_string(Position p);

}  // namespace strata
