// layers_ref: every op's forward against hand-computed values and properties (causality,
// grouping, rotation), every op's backward against central finite differences in double,
// and the whole reference model's gradients against finite differences of its loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "executor/layers_ref.h"
#include "executor/param_layout.h"

namespace strata {
namespace {

using Vec = std::vector<double>;

// The error metric, everywhere (max-abs-normalised), printed per check:
//   max_i |analytic_i - numeric_i| / max_i max(|analytic_i|, |numeric_i|).
// For the ops, the central difference with step
// h = 1e-6 has truncation error ~h^2 f''' = 1e-12 f''' and rounding error ~1e-16 |f| / h =
// 1e-10 |f| on gradients of order one, so a correct backward lands near 1e-9 and a wrong one
// near 1; the tolerance 1e-6 sits between. The model is different: near initialisation the
// norm weights' gradients are ~5e-5 while the loss (~5) carries ~1e-15 of rounding, which
// at h = 1e-6 alone is 1e-15 / 1e-6 / 5e-5 = 2e-5 relative (measured: 3e-5, falling as 1/h).
// So the model uses the fourth-order central difference
//   (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h
// with a step relative to each tensor's scale, h = 1e-2 * rms(tensor): 1e-2 on a norm
// weight, ~2e-3 on a bias (rounding 1e-15 / 2e-3 / 2e-5 = 2.5e-8 on the smallest gradients),
// 2e-4 on wte, whose values of ~0.02 feed an rmsnorm that is far from linear at that scale
// (a fixed h = 1e-3 there leaves up to 4e-7 of truncation, 2e-4 ~5e-10). Measured: at most 2e-8.
constexpr double kStep = 1e-6;       // central-difference step for the ops
constexpr double kModelStep = 1e-2;  // model: fourth-order step, times each tensor's rms
constexpr double kFdTol = 1e-6;       // on the max-abs-normalised error

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen); }
  int64_t index(int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(gen); }
};

Vec randn(Rng& rng, int64_t n, double scale = 1.0) {
  Vec v(static_cast<size_t>(n));
  for (double& e : v) e = scale * rng.normal();
  return v;
}

std::vector<int32_t> random_tokens(Rng& rng, int64_t n, int64_t V) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& e : t) e = static_cast<int32_t>(rng.index(V));
  return t;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

double max_abs(const Vec& a) {
  double m = 0.0;
  for (double e : a) m = std::max(m, std::fabs(e));
  return m;
}

// A gradient buffer that starts at random values, so a backward that assigns instead of
// accumulating fails: grad() is what the backward added.
struct Accum {
  Vec start, buf;
  Accum(Rng& rng, int64_t n) : start(randn(rng, n)), buf(start) {}
  double* data() { return buf.data(); }
  Vec grad() const {
    Vec g(buf.size());
    for (size_t i = 0; i < buf.size(); ++i) g[i] = buf[i] - start[i];
    return g;
  }
};

// How a derivative is estimated: (f(x+h) - f(x-h)) / 2h, or with fourth_order the
// five-point stencil (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h.
struct Fd {
  double step = kStep;
  bool fourth_order = false;
};

// Central differences of f at the entries `which` of *x (all when empty) against the
// analytic gradient `grad` of f (the size of *x). Returns max |grad - fd| / max(max |fd|,
// max |grad|) over the entries, the second max over the whole of grad.
double fd_error(Vec* x, const Vec& grad, const std::function<double()>& f, std::vector<int64_t> which,
                Fd fd_how) {
  if (which.empty())
    for (size_t i = 0; i < x->size(); ++i) which.push_back(static_cast<int64_t>(i));
  const double h = fd_how.step;
  double diff = 0.0, scale = max_abs(grad);
  for (int64_t i : which) {
    double& xi = (*x)[static_cast<size_t>(i)];
    const double keep = xi;
    auto at = [&](double delta) {
      xi = keep + delta;
      const double y = f();
      xi = keep;
      return y;
    };
    const double d1 = at(h) - at(-h);
    const double fd = fd_how.fourth_order ? (8.0 * d1 - (at(2.0 * h) - at(-2.0 * h))) / (12.0 * h)
                                          : d1 / (2.0 * h);
    diff = std::max(diff, std::fabs(fd - grad[static_cast<size_t>(i)]));
    scale = std::max(scale, std::fabs(fd));
  }
  return scale > 0.0 ? diff / scale : diff;
}

// Runs fd_error, prints it, expects it under the tolerance, and keeps the worst.
void expect_fd(const std::string& what, Vec* x, const Vec& grad, const std::function<double()>& f,
               double* worst, std::vector<int64_t> which = {}, Fd fd_how = Fd{}) {
  const double err = fd_error(x, grad, f, std::move(which), fd_how);
  std::printf("  %-28s fd error %.2e\n", what.c_str(), err);
  EXPECT_LT(err, kFdTol) << what;
  *worst = std::max(*worst, err);
}

void print_worst(const char* test, double worst) {
  std::printf("  %-28s largest fd error %.2e\n", test, worst);
}

// ---------------------------------------------------------------------------------------
// Norms

TEST(LayersRef, LayernormForwardHandExample) {
  // x = (1, 2, 3, 4): mean 2.5, biased variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25.
  const Vec x = {1, 2, 3, 4}, w = {1, 2, 1, 1}, b = {0, 0, 0, 0.5};
  Vec out(4), mean(1), rstd(1);
  ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), 1, 4);
  const double r = 1.0 / std::sqrt(1.25 + 1e-5);
  EXPECT_DOUBLE_EQ(mean[0], 2.5);
  EXPECT_DOUBLE_EQ(rstd[0], r);
  EXPECT_DOUBLE_EQ(out[0], -1.5 * r);
  EXPECT_DOUBLE_EQ(out[1], -0.5 * r * 2.0);
  EXPECT_DOUBLE_EQ(out[2], 0.5 * r);
  EXPECT_DOUBLE_EQ(out[3], 1.5 * r + 0.5);
}

TEST(LayersRef, LayernormBackwardMatchesFiniteDifferences) {
  const int64_t N = 5, H = 7;
  Rng rng(1);
  Vec x = randn(rng, N * H, 2.0), w = randn(rng, H), b = randn(rng, H), R = randn(rng, N * H);
  auto f = [&] {
    Vec out(N * H), mean(N), rstd(N);
    ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, H);
    return dot(out, R);
  };
  Vec out(N * H), mean(N), rstd(N);
  ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, H);
  Accum dx(rng, N * H), dw(rng, H), db(rng, H);
  ref::layernorm_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), mean.data(), rstd.data(), w.data(),
                          N, H);
  double worst = 0.0;
  expect_fd("layernorm dx", &x, dx.grad(), f, &worst);
  expect_fd("layernorm dw", &w, dw.grad(), f, &worst);
  expect_fd("layernorm db", &b, db.grad(), f, &worst);
  print_worst("layernorm", worst);
}

TEST(LayersRef, RmsnormForwardHandExample) {
  // x = (1, 2, 3, 4): mean(x^2) = 30 / 4 = 7.5.
  const Vec x = {1, 2, 3, 4}, w = {1, 2, 1, -1};
  Vec out(4), rstd(1);
  ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), 1, 4);
  const double r = 1.0 / std::sqrt(7.5 + 1e-5);
  EXPECT_DOUBLE_EQ(rstd[0], r);
  EXPECT_DOUBLE_EQ(out[0], r);
  EXPECT_DOUBLE_EQ(out[1], 4.0 * r);
  EXPECT_DOUBLE_EQ(out[2], 3.0 * r);
  EXPECT_DOUBLE_EQ(out[3], -4.0 * r);
}

TEST(LayersRef, RmsnormBackwardMatchesFiniteDifferences) {
  const int64_t N = 5, H = 7;
  Rng rng(2);
  Vec x = randn(rng, N * H, 2.0), w = randn(rng, H), R = randn(rng, N * H);
  auto f = [&] {
    Vec out(N * H), rstd(N);
    ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, H);
    return dot(out, R);
  };
  Vec out(N * H), rstd(N);
  ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, H);
  Accum dx(rng, N * H), dw(rng, H);
  ref::rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), rstd.data(), w.data(), N, H);
  double worst = 0.0;
  expect_fd("rmsnorm dx", &x, dx.grad(), f, &worst);
  expect_fd("rmsnorm dw", &w, dw.grad(), f, &worst);
  print_worst("rmsnorm", worst);
}

// ---------------------------------------------------------------------------------------
// Linear

TEST(LayersRef, MatmulForwardHandExample) {
  // x (2, 3), W (2, 3): out = x W^T + b.
  const Vec x = {1, 2, 3, 4, 5, 6}, W = {1, 0, -1, 2, 1, 0}, bias = {10, 20};
  Vec out(4);
  ref::matmul_forward(out.data(), x.data(), W.data(), bias.data(), 2, 3, 2);
  EXPECT_DOUBLE_EQ(out[0], 1 - 3 + 10.0);
  EXPECT_DOUBLE_EQ(out[1], 2 + 2 + 20.0);
  EXPECT_DOUBLE_EQ(out[2], 4 - 6 + 10.0);
  EXPECT_DOUBLE_EQ(out[3], 8 + 5 + 20.0);
  ref::matmul_forward(out.data(), x.data(), W.data(), nullptr, 2, 3, 2);
  EXPECT_DOUBLE_EQ(out[3], 13.0);
}

TEST(LayersRef, MatmulBackwardMatchesFiniteDifferences) {
  const int64_t N = 4, in = 5, out_f = 3;
  Rng rng(3);
  Vec x = randn(rng, N * in), W = randn(rng, out_f * in), bias = randn(rng, out_f), R = randn(rng, N * out_f);
  auto f = [&] {
    Vec out(N * out_f);
    ref::matmul_forward(out.data(), x.data(), W.data(), bias.data(), N, in, out_f);
    return dot(out, R);
  };
  Accum dx(rng, N * in), dW(rng, out_f * in), db(rng, out_f);
  ref::matmul_backward(dx.data(), dW.data(), db.data(), R.data(), x.data(), W.data(), N, in, out_f);
  double worst = 0.0;
  expect_fd("matmul dx", &x, dx.grad(), f, &worst);
  expect_fd("matmul dW", &W, dW.grad(), f, &worst);
  expect_fd("matmul db", &bias, db.grad(), f, &worst);
  // Without bias and without dx: dW alone, the same values.
  Accum dW2(rng, out_f * in);
  ref::matmul_backward(nullptr, dW2.data(), nullptr, R.data(), x.data(), W.data(), N, in, out_f);
  const Vec g1 = dW.grad(), g2 = dW2.grad();
  for (size_t i = 0; i < g1.size(); ++i) EXPECT_NEAR(g1[i], g2[i], 1e-12);
  print_worst("matmul", worst);
}

// ---------------------------------------------------------------------------------------
// Activations

TEST(LayersRef, ActivationsForwardKnownValues) {
  // gelu_tanh(1) = 0.5 (1 + tanh(sqrt(2/pi) * 1.044715)) = 0.8411919906082768 (GPT-2's
  // "gelu_new"); gelu_tanh(-2) = -0.04540230591222494; silu(1) = 1 / (1 + e^-1).
  const Vec x = {0.0, 1.0, -2.0};
  Vec out(3);
  ref::gelu_forward(out.data(), x.data(), 1, 3);
  EXPECT_DOUBLE_EQ(out[0], 0.0);
  EXPECT_NEAR(out[1], 0.8411919906082768, 1e-15);
  EXPECT_NEAR(out[2], -0.04540230591222494, 1e-15);
  // u = [gate | up] = [1, -2 | 3, 0.5]: gate columns first.
  const Vec u = {1.0, -2.0, 3.0, 0.5};
  Vec y(2);
  ref::swiglu_forward(y.data(), u.data(), 1, 2);
  EXPECT_NEAR(y[0], 3.0 * 0.7310585786300049, 1e-15);
  EXPECT_NEAR(y[1], 0.5 * (-2.0 / (1.0 + std::exp(2.0))), 1e-15);
  ref::geglu_forward(y.data(), u.data(), 1, 2);
  EXPECT_NEAR(y[0], 3.0 * 0.8411919906082768, 1e-15);
  EXPECT_NEAR(y[1], 0.5 * -0.04540230591222494, 1e-15);
}

TEST(LayersRef, SquaredReluKnownValues) {
  // max(x, 0)^2: 0 at x <= 0, 2.25 at 1.5; its derivative 2 max(x, 0): 3 at 1.5, 0 below 0.
  const Vec x0 = {-2.0, 0.0, 1.5};
  Vec out(3), d(3, 0.0);
  const Vec ones(3, 1.0);
  ref::squared_relu_forward(out.data(), x0.data(), 1, 3);
  ref::squared_relu_backward(d.data(), ones.data(), x0.data(), 1, 3);
  EXPECT_EQ(out, (Vec{0.0, 0.0, 2.25}));
  EXPECT_EQ(d, (Vec{0.0, 0.0, 3.0}));
}

TEST(LayersRef, UngatedBackwardsMatchFiniteDifferences) {  // gelu and squared ReLU
  using Fwd = void (*)(double*, const double*, int64_t, int64_t);
  using Bwd = void (*)(double*, const double*, const double*, int64_t, int64_t);
  const struct { const char* name; Fwd fwd; Bwd bwd; uint64_t seed; } cases[] = {
      {"gelu", ref::gelu_forward, ref::gelu_backward, 4},
      {"squared_relu", ref::squared_relu_forward, ref::squared_relu_backward, 7}};
  for (const auto& k : cases) {
    const int64_t N = 4, F = 9;
    Rng rng(k.seed);
    Vec x = randn(rng, N * F, 2.0), R = randn(rng, N * F);
    auto f = [&] {
      Vec out(N * F);
      k.fwd(out.data(), x.data(), N, F);
      return dot(out, R);
    };
    Accum dx(rng, N * F);
    k.bwd(dx.data(), R.data(), x.data(), N, F);
    double worst = 0.0;
    expect_fd(std::string(k.name) + " dx", &x, dx.grad(), f, &worst);
    print_worst(k.name, worst);
  }
}

TEST(LayersRef, GatedBackwardsMatchFiniteDifferences) {  // swiglu and geglu
  using Fwd = void (*)(double*, const double*, int64_t, int64_t);
  using Bwd = void (*)(double*, const double*, const double*, int64_t, int64_t);
  const struct { const char* name; Fwd fwd; Bwd bwd; uint64_t seed; } cases[] = {
      {"swiglu", ref::swiglu_forward, ref::swiglu_backward, 5}, {"geglu", ref::geglu_forward, ref::geglu_backward, 6}};
  for (const auto& k : cases) {
    const int64_t N = 4, F = 6;
    Rng rng(k.seed);
    Vec u = randn(rng, N * 2 * F, 2.0), R = randn(rng, N * F);
    auto f = [&] {
      Vec out(N * F);
      k.fwd(out.data(), u.data(), N, F);
      return dot(out, R);
    };
    Accum du(rng, N * 2 * F);
    k.bwd(du.data(), R.data(), u.data(), N, F);
    double worst = 0.0;
    expect_fd(std::string(k.name) + " du", &u, du.grad(), f, &worst);
    print_worst(k.name, worst);
  }
}

// ---------------------------------------------------------------------------------------
// Rotary embedding

TEST(LayersRef, RopeForwardRotatesHalfPairs) {
  // D = 8: the pair of element 1 is element 5; freq_1 = 10000^(-2/8) = 0.1. At position
  // s = 3 the angle is 0.3: e_1 -> cos(0.3) e_1 + sin(0.3) e_5, e_5 -> -sin(0.3) e_1 + cos(0.3) e_5.
  const int64_t B = 1, S = 4, heads = 2, D = 8;
  Vec x(B * S * heads * D, 0.0), out(x.size());
  const int64_t at = (3 * heads + 1) * D;  // b = 0, s = 3, head 1
  x[at + 1] = 1.0;
  x[at + 5] = 2.0;
  ref::rope_forward(out.data(), x.data(), B, S, heads, D);
  EXPECT_NEAR(out[at + 1], std::cos(0.3) - 2.0 * std::sin(0.3), 1e-15);
  EXPECT_NEAR(out[at + 5], 2.0 * std::cos(0.3) + std::sin(0.3), 1e-15);
  for (int64_t i = 0; i < D; ++i)
    if (i != 1 && i != 5) {
      EXPECT_EQ(out[at + i], 0.0);
    }
  // Position 0 is the identity; a rotation keeps every pair's length; in place = out of place.
  Rng rng(7);
  Vec y = randn(rng, B * S * heads * D), ry(y.size());
  ref::rope_forward(ry.data(), y.data(), B, S, heads, D);
  for (int64_t i = 0; i < heads * D; ++i) EXPECT_DOUBLE_EQ(ry[i], y[i]);
  for (int64_t p = 0; p < B * S * heads; ++p)
    for (int64_t i = 0; i < D / 2; ++i) {
      const double* a = y.data() + p * D;
      const double* r = ry.data() + p * D;
      EXPECT_NEAR(a[i] * a[i] + a[i + D / 2] * a[i + D / 2], r[i] * r[i] + r[i + D / 2] * r[i + D / 2], 1e-12);
    }
  Vec inplace = y;
  ref::rope_forward(inplace.data(), inplace.data(), B, S, heads, D);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_DOUBLE_EQ(inplace[i], ry[i]);
}

TEST(LayersRef, RopeBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, S = 5, heads = 3, D = 6;
  Rng rng(8);
  Vec x = randn(rng, B * S * heads * D), R = randn(rng, B * S * heads * D);
  auto f = [&] {
    Vec out(x.size());
    ref::rope_forward(out.data(), x.data(), B, S, heads, D);
    return dot(out, R);
  };
  Accum dx(rng, B * S * heads * D);
  ref::rope_backward(dx.data(), R.data(), B, S, heads, D);
  double worst = 0.0;
  expect_fd("rope dx", &x, dx.grad(), f, &worst);
  print_worst("rope", worst);
}

// ---------------------------------------------------------------------------------------
// Attention

TEST(LayersRef, AttentionForwardIsCausalAndGrouped) {
  const int64_t B = 2, S = 5, A = 4, G = 2, D = 3;
  Rng rng(9);
  const Vec q = randn(rng, B * S * A * D), k = randn(rng, B * S * G * D), v = randn(rng, B * S * G * D);
  Vec out(B * S * A * D), probs(B * A * S * S);
  ref::attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), B, S, A, G, D);
  // Position 0 sees only itself: out = v of its group (h / (A/G): heads 0,1 -> 0; 2,3 -> 1).
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < A; ++h)
      for (int64_t i = 0; i < D; ++i)
        EXPECT_NEAR(out[((b * S) * A + h) * D + i], v[((b * S) * G + h / 2) * D + i], 1e-15);
  // Rows of probs sum to one and are zero above the diagonal.
  for (int64_t row = 0; row < B * A * S; ++row) {
    const int64_t t = row % S;
    double sum = 0.0;
    for (int64_t u = 0; u < S; ++u) {
      sum += probs[row * S + u];
      if (u > t) {
        EXPECT_EQ(probs[row * S + u], 0.0);
      }
    }
    EXPECT_NEAR(sum, 1.0, 1e-14);
  }
  // Grouped = the same attention with every group repeated for its A/G heads (G' = A).
  Vec k_rep(B * S * A * D), v_rep(B * S * A * D);
  for (int64_t bs = 0; bs < B * S; ++bs)
    for (int64_t h = 0; h < A; ++h)
      for (int64_t i = 0; i < D; ++i) {
        k_rep[(bs * A + h) * D + i] = k[(bs * G + h / 2) * D + i];
        v_rep[(bs * A + h) * D + i] = v[(bs * G + h / 2) * D + i];
      }
  Vec out_rep(out.size()), probs_rep(probs.size());
  ref::attention_forward(out_rep.data(), probs_rep.data(), q.data(), k_rep.data(), v_rep.data(), B, S, A, A, D);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], out_rep[i], 1e-14);
  // Causal: changing the last position's keys and values changes no earlier output.
  Vec k2 = k, v2 = v, out2(out.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < G * D; ++i) {
      k2[((b * S + S - 1) * G) * D + i] += 1.0;
      v2[((b * S + S - 1) * G) * D + i] -= 1.0;
    }
  ref::attention_forward(out2.data(), probs.data(), q.data(), k2.data(), v2.data(), B, S, A, G, D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < (S - 1) * A * D; ++i) EXPECT_EQ(out2[b * S * A * D + i], out[b * S * A * D + i]);
  // q = 0: uniform weights, out[t] = mean of v[0..t].
  const Vec q0(q.size(), 0.0);
  ref::attention_forward(out2.data(), probs.data(), q0.data(), k.data(), v.data(), B, S, A, G, D);
  for (int64_t i = 0; i < D; ++i) {
    const double mean = (v[(0 * G + 1) * D + i] + v[(1 * G + 1) * D + i] + v[(2 * G + 1) * D + i]) / 3.0;
    EXPECT_NEAR(out2[(2 * A + 3) * D + i], mean, 1e-15);  // b = 0, t = 2, head 3 (group 1)
  }
}

void check_attention_backward(int64_t B, int64_t S, int64_t A, int64_t G, int64_t D, uint64_t seed) {
  Rng rng(seed);
  Vec q = randn(rng, B * S * A * D), k = randn(rng, B * S * G * D), v = randn(rng, B * S * G * D);
  const Vec R = randn(rng, B * S * A * D);
  auto f = [&] {
    Vec out(B * S * A * D), probs(B * A * S * S);
    ref::attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), B, S, A, G, D);
    return dot(out, R);
  };
  Vec out(B * S * A * D), probs(B * A * S * S);
  ref::attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), B, S, A, G, D);
  Accum dq(rng, B * S * A * D), dk(rng, B * S * G * D), dv(rng, B * S * G * D);
  ref::attention_backward(dq.data(), dk.data(), dv.data(), R.data(), probs.data(), q.data(), k.data(), v.data(),
                          B, S, A, G, D);
  const std::string tag = "attention A=" + std::to_string(A) + " G=" + std::to_string(G);
  double worst = 0.0;
  expect_fd(tag + " dq", &q, dq.grad(), f, &worst);
  expect_fd(tag + " dk", &k, dk.grad(), f, &worst);
  expect_fd(tag + " dv", &v, dv.grad(), f, &worst);
  print_worst(tag.c_str(), worst);
}

TEST(LayersRef, AttentionBackwardMatchesFiniteDifferences) {
  check_attention_backward(2, 5, 4, 2, 3, 10);  // grouped-query
  check_attention_backward(1, 4, 2, 2, 4, 11);  // multi-head
  check_attention_backward(1, 4, 4, 1, 2, 12);  // multi-query
}

// ---------------------------------------------------------------------------------------
// Cross-entropy

TEST(LayersRef, CrossentropyForwardKnownValues) {
  // Equal logits: loss = log V, probs = 1/V. Adding a constant changes nothing (the max
  // is subtracted), even a large one.
  const int64_t N = 2, V = 8;
  Vec logits = {0, 0, 0, 0, 0, 0, 0, 0, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000};
  const std::vector<int32_t> targets = {3, 7};
  Vec losses(N), probs(N * V);
  ref::crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), N, V);
  EXPECT_NEAR(losses[0], std::log(8.0), 1e-14);
  EXPECT_NEAR(losses[1], std::log(8.0), 1e-14);
  EXPECT_NEAR(probs[5], 0.125, 1e-15);
  // logits (0, log 3) over V = 2, target 0: p = 1/4, loss = log 4.
  const Vec l2 = {0.0, std::log(3.0)};
  const std::vector<int32_t> t2 = {0};
  ref::crossentropy_forward(losses.data(), probs.data(), l2.data(), t2.data(), 1, 2);
  EXPECT_NEAR(losses[0], std::log(4.0), 1e-15);
  EXPECT_NEAR(probs[1], 0.75, 1e-15);
}

TEST(LayersRef, CrossentropyBackwardMatchesFiniteDifferences) {
  // The scalar is c * sum(losses); the backward's dloss_scale is c.
  const int64_t N = 6, V = 10;
  Rng rng(13);
  Vec logits = randn(rng, N * V, 2.0);
  const std::vector<int32_t> targets = random_tokens(rng, N, V);
  const double c = 0.37;
  auto f = [&] {
    Vec losses(N), probs(N * V);
    ref::crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), N, V);
    double s = 0.0;
    for (double e : losses) s += e;
    return c * s;
  };
  Vec losses(N), probs(N * V);
  ref::crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), N, V);
  Accum dlogits(rng, N * V);
  ref::crossentropy_backward(dlogits.data(), probs.data(), targets.data(), c, N, V);
  double worst = 0.0;
  expect_fd("crossentropy dlogits", &logits, dlogits.grad(), f, &worst);
  print_worst("crossentropy", worst);
}

// ---------------------------------------------------------------------------------------
// Embedding

TEST(LayersRef, EmbeddingForwardGathers) {
  const int64_t B = 1, S = 2, H = 2;
  const Vec wte = {1, 2, 3, 4, 5, 6}, wpe = {10, 20, 30, 40, 50, 60};  // V = 3, wpe has 3 rows
  const std::vector<int32_t> tokens = {2, 0};
  Vec out(B * S * H);
  ref::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, S, H);
  EXPECT_EQ(out, (Vec{15, 26, 31, 42}));
  ref::embedding_forward(out.data(), tokens.data(), wte.data(), nullptr, B, S, H);
  EXPECT_EQ(out, (Vec{5, 6, 1, 2}));
}

TEST(LayersRef, EmbeddingBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, S = 4, H = 3, V = 5, S_max = 6;
  Rng rng(14);
  Vec wte = randn(rng, V * H), wpe = randn(rng, S_max * H), R = randn(rng, B * S * H);
  const std::vector<int32_t> tokens = {1, 3, 1, 0, 4, 4, 1, 3};  // repeats: the scatter adds
  auto f = [&] {
    Vec out(B * S * H);
    ref::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, S, H);
    return dot(out, R);
  };
  Accum dwte(rng, V * H), dwpe(rng, S_max * H);
  ref::embedding_backward(dwte.data(), dwpe.data(), R.data(), tokens.data(), B, S, H);
  double worst = 0.0;
  expect_fd("embedding dwte", &wte, dwte.grad(), f, &worst);
  expect_fd("embedding dwpe", &wpe, dwpe.grad(), f, &worst);
  const Vec g = dwte.grad();
  for (int64_t j = 0; j < H; ++j) EXPECT_EQ(g[2 * H + j], 0.0);  // token 2 never appears
  // Without positions only dwte moves.
  Accum dwte2(rng, V * H);
  ref::embedding_backward(dwte2.data(), nullptr, R.data(), tokens.data(), B, S, H);
  const Vec g2 = dwte2.grad();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], g2[i], 1e-12);
  print_worst("embedding", worst);
}

// ---------------------------------------------------------------------------------------
// The whole model

ModelSpec tiny_gpt() {  // as model_presets.cpp's gpt(): gelu, layernorm, learned, tied, biases
  ModelSpec m;
  m.name = "test-gpt";
  m.L = 2; m.H = 16; m.A = 4; m.G = 4; m.F = 32; m.V = 128; m.S = 12;  // runs use S = 8 < m.S
  return m;
}

ModelSpec tiny_llama() {  // as model_presets.cpp's llama(): swiglu, rmsnorm, rope, untied, no bias
  ModelSpec m;
  m.name = "test-llama";
  m.L = 2; m.H = 16; m.A = 4; m.G = 2; m.F = 24; m.V = 128; m.S = 8;
  m.activation = Activation::swiglu;
  m.normalization = Norm::rmsnorm;
  m.position = Position::rope;
  m.tie_embeddings = false;
  m.bias = false;
  m.attention_dropout = 0.0;
  m.hidden_dropout = 0.0;
  return m;
}

// The remaining combination: geglu with layernorm, rope, untied, biases, multi-query
// (G = 1) and a head dimension that is not H/A (kv_channels = 8, so A*D = 32 != H).
ModelSpec tiny_mixed() {
  ModelSpec m = tiny_llama();
  m.name = "test-mixed";
  m.G = 1;
  m.kv_channels = 8;
  m.activation = Activation::geglu;
  m.normalization = Norm::layernorm;
  m.bias = true;
  return m;
}

// Nemotron-4's layer: squared ReLU (ungated, fc1 F wide) with layernorm, rope, untied, no
// biases and grouped-query attention.
ModelSpec tiny_nemotron() {
  ModelSpec m = tiny_llama();
  m.name = "test-nemotron";
  m.F = 32;
  m.activation = Activation::squared_relu;
  m.normalization = Norm::layernorm;
  return m;
}

bool is_norm_or_bias(TensorKind k) {
  switch (k) {
    case TensorKind::ln1_w: case TensorKind::ln1_b: case TensorKind::ln2_w: case TensorKind::ln2_b:
    case TensorKind::lnf_w: case TensorKind::lnf_b: case TensorKind::qkv_b: case TensorKind::proj_b:
    case TensorKind::fc1_b: case TensorKind::fc2_b: return true;
    default: return false;
  }
}

// strata::initialise's floats as doubles; with perturb, norm weights and biases moved away
// from 1 and 0 so that their gradients (and the paths through them) are exercised.
Vec model_params(const ModelSpec& m, bool perturb, Rng& rng) {
  const ParamLayout lay = global_param_layout(m);
  std::vector<float> pf(static_cast<size_t>(lay.size));
  initialise(m, lay, 1234, pf.data());
  Vec p(pf.begin(), pf.end());
  if (!perturb) return p;
  for (const TensorSlot& s : lay.tensors) {
    if (!is_norm_or_bias(s.kind)) continue;
    for (int64_t i = 0; i < s.size(); ++i) p[static_cast<size_t>(s.offset + i)] += 0.2 * rng.normal();
  }
  return p;
}

// fd_how: the stencil, its step scaled to each tensor's values (the five-point stencil, or for
// a kinked activation, squared ReLU, whose second derivative jumps at 0, central differences
// over a step 100x smaller: a pre-activation the step carries across 0 costs an error of the
// step's order, which the smooth stencil's wide step made 1e-5).
void check_model_gradients(const ModelSpec& m, int64_t B, int64_t S, uint64_t seed, Fd fd_how = Fd{kModelStep, true}) {
  Rng rng(seed);
  const ParamLayout lay = global_param_layout(m);
  const int64_t V = executor_vocab(m);
  Vec params = model_params(m, true, rng);
  const std::vector<int32_t> tokens = random_tokens(rng, B * S, V), targets = random_tokens(rng, B * S, V);
  Vec grads;
  const double loss = ref::model_forward_backward(m, params, tokens.data(), targets.data(), B, S, &grads);
  ASSERT_EQ(static_cast<int64_t>(grads.size()), lay.size);
  auto f = [&] { return ref::model_forward_backward(m, params, tokens.data(), targets.data(), B, S, nullptr); };
  EXPECT_EQ(f(), loss);  // the forward-only call computes the same loss
  std::printf("  %s: loss %.6f, %lld parameters\n", m.name.c_str(), loss, static_cast<long long>(lay.size));
  double worst = 0.0;
  for (const TensorSlot& s : lay.tensors) {
    // Up to 20 entries with a nonzero gradient, and 5 anywhere (an unused wte row must be 0).
    std::vector<int64_t> nonzero, which;
    for (int64_t i = 0; i < s.size(); ++i)
      if (grads[static_cast<size_t>(s.offset + i)] != 0.0) nonzero.push_back(s.offset + i);
    std::shuffle(nonzero.begin(), nonzero.end(), rng.gen);
    for (size_t i = 0; i < nonzero.size() && i < 20; ++i) which.push_back(nonzero[i]);
    for (int i = 0; i < 5; ++i) which.push_back(s.offset + rng.index(s.size()));
    EXPECT_GE(nonzero.size(), std::min<size_t>(20, static_cast<size_t>(s.size()) / 2)) << to_string(s.kind);
    // Normalised by the largest gradient of this tensor alone; the step scaled to its values.
    Vec g(grads.size(), 0.0);
    double sq = 0.0;
    for (int64_t i = 0; i < s.size(); ++i) {
      const size_t at = static_cast<size_t>(s.offset + i);
      g[at] = grads[at];
      sq += params[at] * params[at];
    }
    const double rms = std::sqrt(sq / static_cast<double>(s.size()));
    std::string what = m.name + " " + to_string(s.kind);
    if (s.layer >= 0) what += "[" + std::to_string(s.layer) + "]";
    std::printf("  %-28s max |grad| %.2e, step %.1e\n", what.c_str(), max_abs(g), fd_how.step * rms);
    expect_fd(what, &params, g, f, &worst, which, Fd{fd_how.step * rms, fd_how.fourth_order});
  }
  print_worst(m.name.c_str(), worst);
  // Learned positions past S get no gradient.
  if (m.position == Position::learned) {
    const TensorSlot& wpe = lay.at(TensorKind::wpe);
    for (int64_t i = S * m.H; i < wpe.size(); ++i) EXPECT_EQ(grads[static_cast<size_t>(wpe.offset + i)], 0.0);
  }
}

TEST(ModelRef, GptGradientsMatchFiniteDifferences) { check_model_gradients(tiny_gpt(), 2, 8, 21); }

TEST(ModelRef, LlamaGradientsMatchFiniteDifferences) { check_model_gradients(tiny_llama(), 2, 8, 22); }

TEST(ModelRef, MixedGradientsMatchFiniteDifferences) { check_model_gradients(tiny_mixed(), 2, 8, 23); }

TEST(ModelRef, NemotronGradientsMatchFiniteDifferences) {
  check_model_gradients(tiny_nemotron(), 2, 8, 24, Fd{kModelStep / 100, false});
}

TEST(ModelRef, LossAtInitIsNearLogV) {
  // At initialisation a logit is x . w with x of unit rms (the final norm's output) and w
  // ~ N(0, 0.02^2): spread ~0.02 * sqrt(H) = 0.08. A token's loss is then log V - z_target +
  // ~0.08^2 / 2, and the mean over B*S = 32 tokens lies within a few 0.08 / sqrt(32) = 0.014
  // of log V = log 128 = 4.852.
  for (const ModelSpec& m : {tiny_gpt(), tiny_llama(), tiny_mixed(), tiny_nemotron()}) {
    Rng rng(31);
    const int64_t B = 4, S = 8, V = executor_vocab(m);
    ASSERT_EQ(V, 128);
    const Vec params = model_params(m, false, rng);
    const std::vector<int32_t> tokens = random_tokens(rng, B * S, V), targets = random_tokens(rng, B * S, V);
    const double loss = ref::model_forward_backward(m, params, tokens.data(), targets.data(), B, S, nullptr);
    std::printf("  %s: loss at init %.6f, log V %.6f\n", m.name.c_str(), loss, std::log(static_cast<double>(V)));
    EXPECT_NEAR(loss, std::log(static_cast<double>(V)), 0.1) << m.name;
  }
}

}  // namespace
}  // namespace strata
