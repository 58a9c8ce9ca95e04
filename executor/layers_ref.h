// The slow, obvious twin of the executor: every layer op and the whole model in naive
// loops over doubles, the oracle the fast float paths are tested against. Owns the maths
// of one training step on one rank (no parallelism, no dropout, no optimizer); the
// parameter offsets come from executor/param_layout.h.
//
// Conventions: every tensor is row-major; N = B*S token rows. A forward writes (=) its
// outputs; a backward ACCUMULATES (+=) into every gradient it is given, so callers zero
// gradient buffers once and residual branches add up for free. Weights are (out, in):
// y = x W^T + b. Shapes use the letters of costmodel/model_spec.h.
#pragma once

#include <cstdint>
#include <vector>

#include "costmodel/model_spec.h"

namespace strata {
namespace ref {

inline constexpr double kNormEps = 1e-5;       // layernorm and rmsnorm
inline constexpr double kRopeTheta = 10000.0;  // rope base: freq_i = theta^(-2i/D)

// ---- LayerNorm: out = (x - mean) * rstd * w + b, biased variance, eps kNormEps.
void layernorm_forward(double* out,        // (N, H)
                       double* mean,       // (N) saved for backward
                       double* rstd,       // (N) saved: 1 / sqrt(var + eps)
                       const double* x,    // (N, H)
                       const double* w,    // (H)
                       const double* b,    // (H)
                       int64_t N, int64_t H);
void layernorm_backward(double* dx,          // (N, H) +=
                        double* dw,          // (H) +=
                        double* db,          // (H) +=
                        const double* dout,  // (N, H)
                        const double* x,     // (N, H)
                        const double* mean,  // (N)
                        const double* rstd,  // (N)
                        const double* w,     // (H)
                        int64_t N, int64_t H);

// ---- RMSNorm: out = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
void rmsnorm_forward(double* out,      // (N, H)
                     double* rstd,     // (N) saved for backward
                     const double* x,  // (N, H)
                     const double* w,  // (H)
                     int64_t N, int64_t H);
void rmsnorm_backward(double* dx,          // (N, H) +=
                      double* dw,          // (H) +=
                      const double* dout,  // (N, H)
                      const double* x,     // (N, H)
                      const double* rstd,  // (N)
                      const double* w,     // (H)
                      int64_t N, int64_t H);

// ---- Linear: out = x W^T + bias. bias may be null (no bias).
void matmul_forward(double* out,          // (N, out_features)
                    const double* x,      // (N, in_features)
                    const double* W,      // (out_features, in_features)
                    const double* bias,   // (out_features) or null
                    int64_t N, int64_t in_features, int64_t out_features);
// dx may be null (the input needs no gradient); db may be null (no bias).
void matmul_backward(double* dx,          // (N, in_features) += or null
                     double* dW,          // (out_features, in_features) +=
                     double* db,          // (out_features) += or null
                     const double* dout,  // (N, out_features)
                     const double* x,     // (N, in_features)
                     const double* W,     // (out_features, in_features)
                     int64_t N, int64_t in_features, int64_t out_features);

// ---- GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(double* out,      // (N, F)
                  const double* x,  // (N, F)
                  int64_t N, int64_t F);
void gelu_backward(double* dx,          // (N, F) +=
                   const double* dout,  // (N, F)
                   const double* x,     // (N, F)
                   int64_t N, int64_t F);

// ---- Squared ReLU (Megatron-LM's --squared-relu): out = max(x, 0)^2, elementwise.
void squared_relu_forward(double* out,      // (N, F)
                          const double* x,  // (N, F)
                          int64_t N, int64_t F);
void squared_relu_backward(double* dx,          // (N, F) +=
                           const double* dout,  // (N, F)
                           const double* x,     // (N, F)
                           int64_t N, int64_t F);

// ---- Gated activations on u = [gate | up]: columns [0, F) are the gate g, [F, 2F) the up.
// swiglu: out = silu(g) * up, silu(g) = g / (1 + exp(-g)).  geglu: out = gelu_tanh(g) * up.
void swiglu_forward(double* out,      // (N, F)
                    const double* u,  // (N, 2F)
                    int64_t N, int64_t F);
void swiglu_backward(double* du,          // (N, 2F) +=
                     const double* dout,  // (N, F)
                     const double* u,     // (N, 2F)
                     int64_t N, int64_t F);
void geglu_forward(double* out,      // (N, F)
                   const double* u,  // (N, 2F)
                   int64_t N, int64_t F);
void geglu_backward(double* du,          // (N, 2F) +=
                    const double* dout,  // (N, F)
                    const double* u,     // (N, 2F)
                    int64_t N, int64_t F);

// ---- Rotary position embedding, Hugging Face Llama "rotate_half" convention. For
// i < D/2: freq_i = kRopeTheta^(-2i/D), angle = s * freq_i (s = 0..S-1, the position in
// the sequence); the pair (i, i + D/2) turns by the angle:
//   y_i = x_i cos - x_{i+D/2} sin,   y_{i+D/2} = x_{i+D/2} cos + x_i sin.
// Out of place; forward may also run in place (out == x). Backward turns dout back by
// -angle (the transpose) and adds it to dx, which must not alias dout. D must be even.
void rope_forward(double* out,      // (B, S, heads, D)
                  const double* x,  // (B, S, heads, D)
                  int64_t B, int64_t S, int64_t heads, int64_t D);
void rope_backward(double* dx,          // (B, S, heads, D) +=
                   const double* dout,  // (B, S, heads, D)
                   int64_t B, int64_t S, int64_t heads, int64_t D);

// ---- Causal self-attention with grouped queries: head h reads key/value group
// h / (A/G); scores scaled by 1/sqrt(D); softmax over positions <= the query's.
void attention_forward(double* out,      // (B, S, A, D)
                       double* probs,    // (B, A, S, S) saved softmax; 0 above the diagonal
                       const double* q,  // (B, S, A, D)
                       const double* k,  // (B, S, G, D)
                       const double* v,  // (B, S, G, D)
                       int64_t B, int64_t S, int64_t A, int64_t G, int64_t D);
void attention_backward(double* dq,           // (B, S, A, D) +=
                        double* dk,           // (B, S, G, D) +=
                        double* dv,           // (B, S, G, D) +=
                        const double* dout,   // (B, S, A, D)
                        const double* probs,  // (B, A, S, S)
                        const double* q,      // (B, S, A, D)
                        const double* k,      // (B, S, G, D)
                        const double* v,      // (B, S, G, D)
                        int64_t B, int64_t S, int64_t A, int64_t G, int64_t D);

// ---- Cross-entropy: losses[n] = -log softmax(logits[n])[targets[n]].
void crossentropy_forward(double* losses,          // (N)
                          double* probs,           // (N, V) saved softmax
                          const double* logits,    // (N, V)
                          const int32_t* targets,  // (N) in [0, V)
                          int64_t N, int64_t V);
// dlogits += (probs - onehot(target)) * dloss_scale: the gradient of dloss_scale * sum(losses)
// (pass 1/N for the mean loss).
void crossentropy_backward(double* dlogits,         // (N, V) +=
                           const double* probs,     // (N, V)
                           const int32_t* targets,  // (N)
                           double dloss_scale,
                           int64_t N, int64_t V);

// ---- Embedding: out[b, s] = wte[tokens[b, s]] + wpe[s]; wpe may be null (no learned
// positions). wpe has at least S rows (the model's seq_length); rows past S are unused.
void embedding_forward(double* out,            // (B, S, H)
                       const int32_t* tokens,  // (B, S) in [0, V)
                       const double* wte,      // (V, H)
                       const double* wpe,      // (S, H) or null
                       int64_t B, int64_t S, int64_t H);
void embedding_backward(double* dwte,           // (V, H) +=
                        double* dwpe,           // (S, H) += or null
                        const double* dout,     // (B, S, H)
                        const int32_t* tokens,  // (B, S)
                        int64_t B, int64_t S, int64_t H);

// ---- The whole model (pre-norm decoder, see layers_ref.cpp for the definition) in the
// global layout of global_param_layout(m): params holds layout.size doubles. Returns the
// mean cross-entropy over the B*S tokens. When grads is not null it is resized to
// layout.size and overwritten with dLoss/dparams. S <= m.S; V = executor_vocab(m).
// No dropout. Position::alibi is not implemented (aborts).
double model_forward_backward(const ModelSpec& m, const std::vector<double>& params,
                              const int32_t* tokens,   // (B, S) in [0, V)
                              const int32_t* targets,  // (B, S) in [0, V)
                              int64_t B, int64_t S,
                              std::vector<double>* grads);  // (layout.size) or null

}  // namespace ref
}  // namespace strata
