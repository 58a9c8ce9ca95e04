// Naive double-precision loops for every layer op and the whole model; see layers_ref.h.
// Written to be read against the formulas, not to be fast: one loop nest per equation,
// and each backward derived in a comment next to it.
#include "executor/layers_ref.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "executor/param_layout.h"

namespace strata {
namespace ref {

namespace {

void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "strata: layers_ref: %s\n", what);
  std::abort();
}

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluA = 0.044715;

double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(kGeluC * (x + kGeluA * x * x * x))); }

// d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2), t = tanh(c (x + a x^3)).
double gelu_grad(double x) {
  const double t = std::tanh(kGeluC * (x + kGeluA * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kGeluC * (1.0 + 3.0 * kGeluA * x * x);
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double silu(double x) { return x * sigmoid(x); }

// d silu / dx = s + x s (1 - s), s = sigmoid(x).
double silu_grad(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

}  // namespace

// ---------------------------------------------------------------------------------------
// LayerNorm. With n = (x - mean) * rstd and dn = dout * w, the gradient through the mean
// and the variance is (llm.c's derivation):
//   dx = rstd * (dn - mean_j(dn) - n * mean_j(dn * n)),   dw += dout * n,   db += dout.

void layernorm_forward(double* out, double* mean, double* rstd, const double* x, const double* w,
                       const double* b, int64_t N, int64_t H) {
  for (int64_t n = 0; n < N; ++n) {
    const double* xn = x + n * H;
    double m = 0.0;
    for (int64_t j = 0; j < H; ++j) m += xn[j];
    m /= static_cast<double>(H);
    double var = 0.0;
    for (int64_t j = 0; j < H; ++j) var += (xn[j] - m) * (xn[j] - m);
    var /= static_cast<double>(H);  // biased, as PyTorch and Megatron
    const double r = 1.0 / std::sqrt(var + kNormEps);
    for (int64_t j = 0; j < H; ++j) out[n * H + j] = (xn[j] - m) * r * w[j] + b[j];
    mean[n] = m;
    rstd[n] = r;
  }
}

void layernorm_backward(double* dx, double* dw, double* db, const double* dout, const double* x,
                        const double* mean, const double* rstd, const double* w, int64_t N,
                        int64_t H) {
  for (int64_t n = 0; n < N; ++n) {
    const double* xn = x + n * H;
    const double* gn = dout + n * H;
    double dn_mean = 0.0, dn_n_mean = 0.0;
    for (int64_t j = 0; j < H; ++j) {
      const double norm = (xn[j] - mean[n]) * rstd[n];
      const double dn = gn[j] * w[j];
      dn_mean += dn;
      dn_n_mean += dn * norm;
    }
    dn_mean /= static_cast<double>(H);
    dn_n_mean /= static_cast<double>(H);
    for (int64_t j = 0; j < H; ++j) {
      const double norm = (xn[j] - mean[n]) * rstd[n];
      const double dn = gn[j] * w[j];
      dx[n * H + j] += rstd[n] * (dn - dn_mean - norm * dn_n_mean);
      dw[j] += gn[j] * norm;
      db[j] += gn[j];
    }
  }
}

// ---------------------------------------------------------------------------------------
// RMSNorm. out_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), so dr/dx_j = -r^3 x_j / H.
// With n = x r and dn = dout * w:
//   dx_j = r dn_j - (r^3 x_j / H) sum_i dn_i x_i = r (dn_j - n_j mean_i(dn_i n_i)).

void rmsnorm_forward(double* out, double* rstd, const double* x, const double* w, int64_t N,
                     int64_t H) {
  for (int64_t n = 0; n < N; ++n) {
    const double* xn = x + n * H;
    double ms = 0.0;
    for (int64_t j = 0; j < H; ++j) ms += xn[j] * xn[j];
    ms /= static_cast<double>(H);
    const double r = 1.0 / std::sqrt(ms + kNormEps);
    for (int64_t j = 0; j < H; ++j) out[n * H + j] = xn[j] * r * w[j];
    rstd[n] = r;
  }
}

void rmsnorm_backward(double* dx, double* dw, const double* dout, const double* x,
                      const double* rstd, const double* w, int64_t N, int64_t H) {
  for (int64_t n = 0; n < N; ++n) {
    const double* xn = x + n * H;
    const double* gn = dout + n * H;
    double dn_n_mean = 0.0;
    for (int64_t j = 0; j < H; ++j) dn_n_mean += gn[j] * w[j] * xn[j] * rstd[n];
    dn_n_mean /= static_cast<double>(H);
    for (int64_t j = 0; j < H; ++j) {
      const double norm = xn[j] * rstd[n];
      dx[n * H + j] += rstd[n] * (gn[j] * w[j] - norm * dn_n_mean);
      dw[j] += gn[j] * norm;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Linear. out[n,o] = b[o] + sum_i x[n,i] W[o,i], hence
//   dx[n,i] += sum_o dout[n,o] W[o,i],  dW[o,i] += sum_n dout[n,o] x[n,i],  db[o] += sum_n dout[n,o].

void matmul_forward(double* out, const double* x, const double* W, const double* bias, int64_t N,
                    int64_t in_features, int64_t out_features) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < out_features; ++o) {
      double acc = bias != nullptr ? bias[o] : 0.0;
      for (int64_t i = 0; i < in_features; ++i) acc += x[n * in_features + i] * W[o * in_features + i];
      out[n * out_features + o] = acc;
    }
  }
}

void matmul_backward(double* dx, double* dW, double* db, const double* dout, const double* x,
                     const double* W, int64_t N, int64_t in_features, int64_t out_features) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < out_features; ++o) {
      const double g = dout[n * out_features + o];
      for (int64_t i = 0; i < in_features; ++i) {
        if (dx != nullptr) dx[n * in_features + i] += g * W[o * in_features + i];
        dW[o * in_features + i] += g * x[n * in_features + i];
      }
      if (db != nullptr) db[o] += g;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Activations. gelu and squared ReLU are elementwise; the gated pair reads gate g = u[:, j] and up = u[:, F + j]:
//   out = act(g) * up,  dg += dout * up * act'(g),  dup += dout * act(g).

void gelu_forward(double* out, const double* x, int64_t N, int64_t F) {
  for (int64_t i = 0; i < N * F; ++i) out[i] = gelu(x[i]);
}

void gelu_backward(double* dx, const double* dout, const double* x, int64_t N, int64_t F) {
  for (int64_t i = 0; i < N * F; ++i) dx[i] += dout[i] * gelu_grad(x[i]);
}

// Squared ReLU: out = max(x, 0)^2, d/dx = 2 max(x, 0).
void squared_relu_forward(double* out, const double* x, int64_t N, int64_t F) {
  for (int64_t i = 0; i < N * F; ++i) out[i] = x[i] > 0 ? x[i] * x[i] : 0.0;
}

void squared_relu_backward(double* dx, const double* dout, const double* x, int64_t N, int64_t F) {
  for (int64_t i = 0; i < N * F; ++i) dx[i] += x[i] > 0 ? dout[i] * 2.0 * x[i] : 0.0;
}

namespace {

// Gated unit on u = [gate | up]: out = act(g) * up; backward du += (d up act'(g), d act(g)).
void gated_forward(double* out, const double* u, int64_t N, int64_t F, double (*act)(double)) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < F; ++j) out[n * F + j] = act(u[n * 2 * F + j]) * u[n * 2 * F + F + j];
  }
}

void gated_backward(double* du, const double* dout, const double* u, int64_t N, int64_t F, double (*act)(double),
                    double (*act_grad)(double)) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < F; ++j) {
      const double g = u[n * 2 * F + j], up = u[n * 2 * F + F + j], d = dout[n * F + j];
      du[n * 2 * F + j] += d * up * act_grad(g);
      du[n * 2 * F + F + j] += d * act(g);
    }
  }
}

}  // namespace

void swiglu_forward(double* out, const double* u, int64_t N, int64_t F) { gated_forward(out, u, N, F, silu); }

void swiglu_backward(double* du, const double* dout, const double* u, int64_t N, int64_t F) {
  gated_backward(du, dout, u, N, F, silu, silu_grad);
}

void geglu_forward(double* out, const double* u, int64_t N, int64_t F) { gated_forward(out, u, N, F, gelu); }

void geglu_backward(double* du, const double* dout, const double* u, int64_t N, int64_t F) {
  gated_backward(du, dout, u, N, F, gelu, gelu_grad);
}

// ---------------------------------------------------------------------------------------
// Rotary embedding. Each pair (x1, x2) = (x_i, x_{i+D/2}) is multiplied by the rotation
// R = [[c, -s], [s, c]]; the backward multiplies (dy1, dy2) by R^T = [[c, s], [-s, c]].

namespace {

// out (=, or += when accumulate) = R(sign * angle) x per pair; R^T is the rotation by -angle.
void rope_rotate(double* out, const double* x, int64_t B, int64_t S, int64_t heads, int64_t D, double sign,
                 bool accumulate) {
  require(D % 2 == 0, "rope needs an even head dimension D");
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = ((b * S + s) * heads + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const double freq = std::pow(kRopeTheta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
          const double angle = static_cast<double>(s) * freq;
          const double c = std::cos(angle), sn = sign * std::sin(angle);
          const double x1 = x[base + i], x2 = x[base + half + i];  // read both before writing
          const double y1 = x1 * c - x2 * sn, y2 = x2 * c + x1 * sn;
          out[base + i] = accumulate ? out[base + i] + y1 : y1;
          out[base + half + i] = accumulate ? out[base + half + i] + y2 : y2;
        }
      }
    }
  }
}

}  // namespace

void rope_forward(double* out, const double* x, int64_t B, int64_t S, int64_t heads, int64_t D) {
  rope_rotate(out, x, B, S, heads, D, 1.0, false);
}

void rope_backward(double* dx, const double* dout, int64_t B, int64_t S, int64_t heads, int64_t D) {
  rope_rotate(dx, dout, B, S, heads, D, -1.0, true);
}

// ---------------------------------------------------------------------------------------
// Attention, for one (b, h) and query position t with g = h / (A/G):
//   z[u] = scale * q[t] . k[u] for u <= t,   P[t,u] = softmax_u(z),   out[t] = sum_u P[t,u] v[u].
// Backward: dP[t,u] = dout[t] . v[u];  dv[u] += P[t,u] dout[t];
//   dz[t,u] = P[t,u] (dP[t,u] - sum_w P[t,w] dP[t,w])   (softmax Jacobian);
//   dq[t] += scale * sum_u dz[t,u] k[u];  dk[u] += scale * dz[t,u] q[t].

void attention_forward(double* out, double* probs, const double* q, const double* k, const double* v,
                       int64_t B, int64_t S, int64_t A, int64_t G, int64_t D) {
  require(G > 0 && A % G == 0, "attention needs A to be a multiple of G");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int64_t per_group = A / G;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < A; ++h) {
      const int64_t g = h / per_group;
      for (int64_t t = 0; t < S; ++t) {
        const double* qt = q + ((b * S + t) * A + h) * D;
        double* p = probs + ((b * A + h) * S + t) * S;  // (S) row t of this head
        double zmax = -INFINITY;
        for (int64_t u = 0; u <= t; ++u) {
          const double* ku = k + ((b * S + u) * G + g) * D;
          double z = 0.0;
          for (int64_t i = 0; i < D; ++i) z += qt[i] * ku[i];
          p[u] = z * scale;
          if (p[u] > zmax) zmax = p[u];
        }
        double sum = 0.0;
        for (int64_t u = 0; u <= t; ++u) {
          p[u] = std::exp(p[u] - zmax);
          sum += p[u];
        }
        for (int64_t u = 0; u <= t; ++u) p[u] /= sum;
        for (int64_t u = t + 1; u < S; ++u) p[u] = 0.0;  // causal mask
        double* ot = out + ((b * S + t) * A + h) * D;
        for (int64_t i = 0; i < D; ++i) ot[i] = 0.0;
        for (int64_t u = 0; u <= t; ++u) {
          const double* vu = v + ((b * S + u) * G + g) * D;
          for (int64_t i = 0; i < D; ++i) ot[i] += p[u] * vu[i];
        }
      }
    }
  }
}

void attention_backward(double* dq, double* dk, double* dv, const double* dout, const double* probs,
                        const double* q, const double* k, const double* v, int64_t B, int64_t S,
                        int64_t A, int64_t G, int64_t D) {
  require(G > 0 && A % G == 0, "attention needs A to be a multiple of G");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int64_t per_group = A / G;
  std::vector<double> dp(static_cast<size_t>(S));  // (S) dP of one query row
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < A; ++h) {
      const int64_t g = h / per_group;
      for (int64_t t = 0; t < S; ++t) {
        const double* p = probs + ((b * A + h) * S + t) * S;
        const double* dot = dout + ((b * S + t) * A + h) * D;
        const double* qt = q + ((b * S + t) * A + h) * D;
        double* dqt = dq + ((b * S + t) * A + h) * D;
        double pdp = 0.0;  // sum_u P[t,u] dP[t,u]
        for (int64_t u = 0; u <= t; ++u) {
          const double* vu = v + ((b * S + u) * G + g) * D;
          double* dvu = dv + ((b * S + u) * G + g) * D;
          double acc = 0.0;
          for (int64_t i = 0; i < D; ++i) {
            acc += dot[i] * vu[i];
            dvu[i] += p[u] * dot[i];
          }
          dp[static_cast<size_t>(u)] = acc;
          pdp += p[u] * acc;
        }
        for (int64_t u = 0; u <= t; ++u) {
          const double dz = p[u] * (dp[static_cast<size_t>(u)] - pdp);
          const double* ku = k + ((b * S + u) * G + g) * D;
          double* dku = dk + ((b * S + u) * G + g) * D;
          for (int64_t i = 0; i < D; ++i) {
            dqt[i] += scale * dz * ku[i];
            dku[i] += scale * dz * qt[i];
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Cross-entropy. loss = logsumexp(z) - z[target]; d loss / dz = softmax(z) - onehot(target).

void crossentropy_forward(double* losses, double* probs, const double* logits, const int32_t* targets,
                          int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n) {
    require(targets[n] >= 0 && targets[n] < V, "cross-entropy target outside [0, V)");
    const double* z = logits + n * V;
    double zmax = -INFINITY;
    for (int64_t j = 0; j < V; ++j)
      if (z[j] > zmax) zmax = z[j];
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(z[j] - zmax);
    for (int64_t j = 0; j < V; ++j) probs[n * V + j] = std::exp(z[j] - zmax) / sum;
    losses[n] = std::log(sum) - (z[targets[n]] - zmax);  // logsumexp(z) - z[target], no cancellation at large z
  }
}

void crossentropy_backward(double* dlogits, const double* probs, const int32_t* targets,
                           double dloss_scale, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < V; ++j) {
      const double onehot = j == targets[n] ? 1.0 : 0.0;
      dlogits[n * V + j] += (probs[n * V + j] - onehot) * dloss_scale;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Embedding: a gather forward, a scatter-add backward (a token seen twice adds twice).

void embedding_forward(double* out, const int32_t* tokens, const double* wte, const double* wpe,
                       int64_t B, int64_t S, int64_t H) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      require(tokens[b * S + s] >= 0, "negative token id");
      const double* row = wte + static_cast<int64_t>(tokens[b * S + s]) * H;
      for (int64_t j = 0; j < H; ++j)
        out[(b * S + s) * H + j] = row[j] + (wpe != nullptr ? wpe[s * H + j] : 0.0);
    }
  }
}

void embedding_backward(double* dwte, double* dwpe, const double* dout, const int32_t* tokens,
                        int64_t B, int64_t S, int64_t H) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      double* row = dwte + static_cast<int64_t>(tokens[b * S + s]) * H;
      for (int64_t j = 0; j < H; ++j) {
        row[j] += dout[(b * S + s) * H + j];
        if (dwpe != nullptr) dwpe[s * H + j] += dout[(b * S + s) * H + j];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// The model. Pre-norm decoder, N = B*S rows, QKV = (A + 2G) * D:
//   x = wte[tokens] + wpe[positions] (learned positions only)               // (N, H)
//   per layer l:
//     h   = norm1(x)                        layernorm(ln1_w, ln1_b) or rmsnorm(ln1_w)
//     qkv = h qkv_w^T + qkv_b               // (N, QKV): [q heads A*D | k G*D | v G*D]
//     q, k = rope(q), rope(k)               (Position::rope only)
//     a   = attention(q, k, v)              // (N, A*D) causal, grouped
//     x   = x + a proj_w^T + proj_b
//     h   = norm2(x)
//     u   = h fc1_w^T + fc1_b               // (N, fc1_out): gated: [gate F | up F]
//     y   = gelu(u) | swiglu(u) | geglu(u) | squared_relu(u)  // (N, F)
//     x   = x + y fc2_w^T + fc2_b
//   x = normf(x);  logits = x W^T, W = wte (tied) or lm_head    // (N, V)
//   loss = mean_n cross-entropy(logits[n], targets[n])
// Biases exist only when m.bias; the backward walks the same lines upwards.

namespace {

// Saved activations of one layer: what its backward reads.
struct LayerActs {
  std::vector<double> x_in;      // (N, H) residual stream entering the layer
  std::vector<double> ln1;       // (N, H) norm1 output
  std::vector<double> ln1_mean;  // (N) layernorm only
  std::vector<double> ln1_rstd;  // (N)
  std::vector<double> q;         // (B, S, A, D) after rope
  std::vector<double> k;         // (B, S, G, D) after rope
  std::vector<double> v;         // (B, S, G, D)
  std::vector<double> probs;     // (B, A, S, S)
  std::vector<double> att;       // (N, A*D) attention output
  std::vector<double> x_mid;     // (N, H) residual stream after the attention block
  std::vector<double> ln2;       // (N, H)
  std::vector<double> ln2_mean;  // (N)
  std::vector<double> ln2_rstd;  // (N)
  std::vector<double> fc1;       // (N, fc1_out)
  std::vector<double> act;       // (N, F)
};

std::vector<double> zeros(int64_t n) { return std::vector<double>(static_cast<size_t>(n), 0.0); }

void norm_forward(const ModelSpec& m, double* out, double* mean, double* rstd, const double* x,
                  const double* w, const double* b, int64_t N, int64_t H) {
  if (m.normalization == Norm::layernorm) layernorm_forward(out, mean, rstd, x, w, b, N, H);
  else rmsnorm_forward(out, rstd, x, w, N, H);
}

void norm_backward(const ModelSpec& m, double* dx, double* dw, double* db, const double* dout,
                   const double* x, const double* mean, const double* rstd, const double* w, int64_t N,
                   int64_t H) {
  if (m.normalization == Norm::layernorm) layernorm_backward(dx, dw, db, dout, x, mean, rstd, w, N, H);
  else rmsnorm_backward(dx, dw, dout, x, rstd, w, N, H);
}

void act_forward(const ModelSpec& m, double* out, const double* u, int64_t N, int64_t F) {
  switch (m.activation) {
    case Activation::gelu: gelu_forward(out, u, N, F); break;
    case Activation::swiglu: swiglu_forward(out, u, N, F); break;
    case Activation::geglu: geglu_forward(out, u, N, F); break;
    case Activation::squared_relu: squared_relu_forward(out, u, N, F); break;
  }
}

void act_backward(const ModelSpec& m, double* du, const double* dout, const double* u, int64_t N,
                  int64_t F) {
  switch (m.activation) {
    case Activation::gelu: gelu_backward(du, dout, u, N, F); break;
    case Activation::swiglu: swiglu_backward(du, dout, u, N, F); break;
    case Activation::geglu: geglu_backward(du, dout, u, N, F); break;
    case Activation::squared_relu: squared_relu_backward(du, dout, u, N, F); break;
  }
}

}  // namespace

double model_forward_backward(const ModelSpec& m, const std::vector<double>& params,
                              const int32_t* tokens, const int32_t* targets, int64_t B, int64_t S,
                              std::vector<double>* grads) {
  const ParamLayout lay = global_param_layout(m);
  require(static_cast<int64_t>(params.size()) == lay.size, "params size differs from the global layout");
  require(B > 0 && S > 0 && S <= m.S, "need 0 < S <= m.S and B > 0");
  require(m.position != Position::alibi, "alibi positions are not implemented");
  const int64_t N = B * S, H = m.H, A = m.A, G = m.G, D = m.D(), F = m.F;
  const int64_t AD = A * D, QKV = (A + 2 * G) * D, F1 = m.fc1_out(), V = executor_vocab(m);
  const bool rope = m.position == Position::rope;
  for (int64_t n = 0; n < N; ++n)
    require(tokens[n] >= 0 && tokens[n] < V && targets[n] >= 0 && targets[n] < V,
            "token or target outside [0, V)");

  // The tensor (kind, layer) in params, or null when the model has none (a bias).
  auto P = [&](TensorKind kind, int64_t layer = -1) -> const double* {
    return lay.has(kind, layer) ? params.data() + lay.at(kind, layer).offset : nullptr;
  };
  const double* W_out = m.tie_embeddings ? P(TensorKind::wte) : P(TensorKind::lm_head);  // (V, H)

  // ---- forward
  std::vector<double> x = zeros(N * H);  // (N, H) residual stream
  embedding_forward(x.data(), tokens, P(TensorKind::wte), P(TensorKind::wpe), B, S, H);
  std::vector<LayerActs> acts(static_cast<size_t>(m.L));
  std::vector<double> qkv = zeros(N * QKV);  // (N, QKV) scratch
  std::vector<double> tmp = zeros(N * H);    // (N, H) scratch: a branch's output
  for (int64_t l = 0; l < m.L; ++l) {
    LayerActs& a = acts[static_cast<size_t>(l)];
    a.x_in = x;
    a.ln1 = zeros(N * H);
    a.ln1_mean = zeros(N);
    a.ln1_rstd = zeros(N);
    norm_forward(m, a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), x.data(), P(TensorKind::ln1_w, l),
                 P(TensorKind::ln1_b, l), N, H);
    matmul_forward(qkv.data(), a.ln1.data(), P(TensorKind::qkv_w, l), P(TensorKind::qkv_b, l), N, H, QKV);
    a.q = zeros(N * AD);
    a.k = zeros(N * G * D);
    a.v = zeros(N * G * D);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < AD; ++i) a.q[n * AD + i] = qkv[n * QKV + i];
      for (int64_t i = 0; i < G * D; ++i) {
        a.k[n * G * D + i] = qkv[n * QKV + AD + i];
        a.v[n * G * D + i] = qkv[n * QKV + AD + G * D + i];
      }
    }
    if (rope) {
      rope_forward(a.q.data(), a.q.data(), B, S, A, D);
      rope_forward(a.k.data(), a.k.data(), B, S, G, D);
    }
    a.probs = zeros(B * A * S * S);
    a.att = zeros(N * AD);
    attention_forward(a.att.data(), a.probs.data(), a.q.data(), a.k.data(), a.v.data(), B, S, A, G, D);
    matmul_forward(tmp.data(), a.att.data(), P(TensorKind::proj_w, l), P(TensorKind::proj_b, l), N, AD, H);
    for (int64_t i = 0; i < N * H; ++i) x[i] += tmp[i];
    a.x_mid = x;
    a.ln2 = zeros(N * H);
    a.ln2_mean = zeros(N);
    a.ln2_rstd = zeros(N);
    norm_forward(m, a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), x.data(), P(TensorKind::ln2_w, l),
                 P(TensorKind::ln2_b, l), N, H);
    a.fc1 = zeros(N * F1);
    a.act = zeros(N * F);
    matmul_forward(a.fc1.data(), a.ln2.data(), P(TensorKind::fc1_w, l), P(TensorKind::fc1_b, l), N, H, F1);
    act_forward(m, a.act.data(), a.fc1.data(), N, F);
    matmul_forward(tmp.data(), a.act.data(), P(TensorKind::fc2_w, l), P(TensorKind::fc2_b, l), N, F, H);
    for (int64_t i = 0; i < N * H; ++i) x[i] += tmp[i];
  }
  std::vector<double> lnf = zeros(N * H);  // (N, H) final norm output
  std::vector<double> lnf_mean = zeros(N), lnf_rstd = zeros(N);  // (N), (N)
  norm_forward(m, lnf.data(), lnf_mean.data(), lnf_rstd.data(), x.data(), P(TensorKind::lnf_w),
               P(TensorKind::lnf_b), N, H);
  std::vector<double> logits = zeros(N * V), probs = zeros(N * V);  // (N, V), (N, V)
  std::vector<double> losses = zeros(N);                            // (N)
  matmul_forward(logits.data(), lnf.data(), W_out, nullptr, N, H, V);
  crossentropy_forward(losses.data(), probs.data(), logits.data(), targets, N, V);
  double loss = 0.0;
  for (int64_t n = 0; n < N; ++n) loss += losses[n];
  loss /= static_cast<double>(N);
  if (grads == nullptr) return loss;

  // ---- backward: the same lines in reverse, every gradient accumulated with +=
  grads->assign(static_cast<size_t>(lay.size), 0.0);
  auto dP = [&](TensorKind kind, int64_t layer = -1) -> double* {
    return lay.has(kind, layer) ? grads->data() + lay.at(kind, layer).offset : nullptr;
  };
  std::vector<double> dlogits = zeros(N * V);  // (N, V)
  crossentropy_backward(dlogits.data(), probs.data(), targets, 1.0 / static_cast<double>(N), N, V);
  std::vector<double> dlnf = zeros(N * H);  // (N, H)
  matmul_backward(dlnf.data(), m.tie_embeddings ? dP(TensorKind::wte) : dP(TensorKind::lm_head), nullptr,
                  dlogits.data(), lnf.data(), W_out, N, H, V);
  std::vector<double> dx = zeros(N * H);  // (N, H) gradient of the residual stream
  norm_backward(m, dx.data(), dP(TensorKind::lnf_w), dP(TensorKind::lnf_b), dlnf.data(), x.data(),
                lnf_mean.data(), lnf_rstd.data(), P(TensorKind::lnf_w), N, H);
  for (int64_t l = m.L - 1; l >= 0; --l) {
    const LayerActs& a = acts[static_cast<size_t>(l)];
    // MLP block: x_out = x_mid + fc2(act(fc1(norm2(x_mid)))).
    std::vector<double> dact = zeros(N * F);   // (N, F)
    std::vector<double> dfc1 = zeros(N * F1);  // (N, fc1_out)
    std::vector<double> dln2 = zeros(N * H);   // (N, H)
    matmul_backward(dact.data(), dP(TensorKind::fc2_w, l), dP(TensorKind::fc2_b, l), dx.data(), a.act.data(),
                    P(TensorKind::fc2_w, l), N, F, H);
    act_backward(m, dfc1.data(), dact.data(), a.fc1.data(), N, F);
    matmul_backward(dln2.data(), dP(TensorKind::fc1_w, l), dP(TensorKind::fc1_b, l), dfc1.data(),
                    a.ln2.data(), P(TensorKind::fc1_w, l), N, H, F1);
    norm_backward(m, dx.data(), dP(TensorKind::ln2_w, l), dP(TensorKind::ln2_b, l), dln2.data(),
                  a.x_mid.data(), a.ln2_mean.data(), a.ln2_rstd.data(), P(TensorKind::ln2_w, l), N, H);
    // Attention block: x_mid = x_in + proj(attention(rope(qkv(norm1(x_in))))).
    std::vector<double> datt = zeros(N * AD), dq = zeros(N * AD);   // (N, A*D), (B, S, A, D)
    std::vector<double> dk = zeros(N * G * D), dv = zeros(N * G * D);  // (B, S, G, D) each
    matmul_backward(datt.data(), dP(TensorKind::proj_w, l), dP(TensorKind::proj_b, l), dx.data(),
                    a.att.data(), P(TensorKind::proj_w, l), N, AD, H);
    attention_backward(dq.data(), dk.data(), dv.data(), datt.data(), a.probs.data(), a.q.data(), a.k.data(),
                       a.v.data(), B, S, A, G, D);
    if (rope) {
      std::vector<double> dq_in = zeros(N * AD), dk_in = zeros(N * G * D);  // before rope
      rope_backward(dq_in.data(), dq.data(), B, S, A, D);
      rope_backward(dk_in.data(), dk.data(), B, S, G, D);
      dq.swap(dq_in);
      dk.swap(dk_in);
    }
    std::vector<double> dqkv = zeros(N * QKV), dln1 = zeros(N * H);  // (N, QKV), (N, H)
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < AD; ++i) dqkv[n * QKV + i] = dq[n * AD + i];
      for (int64_t i = 0; i < G * D; ++i) {
        dqkv[n * QKV + AD + i] = dk[n * G * D + i];
        dqkv[n * QKV + AD + G * D + i] = dv[n * G * D + i];
      }
    }
    matmul_backward(dln1.data(), dP(TensorKind::qkv_w, l), dP(TensorKind::qkv_b, l), dqkv.data(),
                    a.ln1.data(), P(TensorKind::qkv_w, l), N, H, QKV);
    norm_backward(m, dx.data(), dP(TensorKind::ln1_w, l), dP(TensorKind::ln1_b, l), dln1.data(),
                  a.x_in.data(), a.ln1_mean.data(), a.ln1_rstd.data(), P(TensorKind::ln1_w, l), N, H);
  }
  embedding_backward(dP(TensorKind::wte), dP(TensorKind::wpe), dx.data(), tokens, B, S, H);
  return loss;
}

}  // namespace ref
}  // namespace strata
