// Element-wise kernels on Eigen arrays (cpu_eltwise.h: why they are in a file of their own).
#include "executor/cpu/cpu_eltwise.h"

#include <Eigen/Dense>

namespace strata {
namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)

using CAMap = Eigen::Map<const Eigen::ArrayXf>;
using AMap = Eigen::Map<Eigen::ArrayXf>;

// GELU (tanh form) of n values, and its derivative into `grad` when given. Eigen's tanh
// and exp are vectorised rational / polynomial approximations (a few ulp from libm's),
// which keeps these element-wise kernels near memory speed instead of 10+ ns per value.
// They are evaluated into Eigen's own (aligned) arrays, so no element falls into a scalar
// peel that depends on the caller's pointer: results are the same on every run.
void gelu_row(float* out, const float* x_, int64_t n, float* grad) {
  const CAMap x(x_, n);
  const Eigen::ArrayXf th = (kGeluK * (x + 0.044715f * x.cube())).tanh();
  if (grad)
    AMap(grad, n) = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th.square()) * kGeluK * (1.0f + 3.0f * 0.044715f * x.square());
  AMap(out, n) = 0.5f * x * (1.0f + th);
}
// SiLU x * sigmoid(x) and its derivative s * (1 + x (1 - s)).
void silu_row(float* out, const float* x_, int64_t n, float* grad) {
  const CAMap x(x_, n);
  const Eigen::ArrayXf s = 1.0f / (1.0f + (-x).exp());
  if (grad) AMap(grad, n) = s * (1.0f + x * (1.0f - s));
  AMap(out, n) = x * s;
}

// Squared ReLU max(x, 0)^2 and its derivative 2 max(x, 0) (a NaN input gives 0, as the
// reference's x > 0 test and the CUDA kernel's fmaxf do).
void squared_relu_row(float* out, const float* x_, int64_t n, float* grad) {
  const CAMap x(x_, n);
  const Eigen::ArrayXf r = (x > 0.0f).select(x, 0.0f);
  if (grad) AMap(grad, n) = 2.0f * r;
  AMap(out, n) = r.square();
}

}  // namespace

void cpu_activation_forward(Activation act, float* out, const float* u, int64_t N, int64_t F) {
  if (act == Activation::gelu) {
    for (int64_t i = 0; i < N; ++i) gelu_row(out + i * F, u + i * F, F, nullptr);
    return;
  }
  if (act == Activation::squared_relu) {
    for (int64_t i = 0; i < N; ++i) squared_relu_row(out + i * F, u + i * F, F, nullptr);
    return;
  }
  thread_local Eigen::ArrayXf a;  // scratch (no standard containers here: cpu_eltwise.h)
  if (a.size() < F) a.resize(F);
  for (int64_t i = 0; i < N; ++i) {
    const float* g = u + i * 2 * F;
    if (act == Activation::swiglu) silu_row(a.data(), g, F, nullptr);
    else gelu_row(a.data(), g, F, nullptr);
    AMap(out + i * F, F) = CAMap(a.data(), F) * CAMap(g + F, F);
  }
}

void cpu_activation_backward(Activation act, float* du, const float* dout, const float* u, int64_t N, int64_t F) {
  thread_local Eigen::ArrayXf a, da;  // scratch
  if (a.size() < F) a.resize(F);
  if (da.size() < F) da.resize(F);
  if (!gated(act)) {
    for (int64_t i = 0; i < N; ++i) {
      if (act == Activation::gelu) gelu_row(a.data(), u + i * F, F, da.data());
      else squared_relu_row(a.data(), u + i * F, F, da.data());
      AMap(du + i * F, F) = CAMap(dout + i * F, F) * CAMap(da.data(), F);
    }
    return;
  }
  for (int64_t i = 0; i < N; ++i) {
    const float* g = u + i * 2 * F;
    const CAMap up(g + F, F), d(dout + i * F, F);
    if (act == Activation::swiglu) silu_row(a.data(), g, F, da.data());
    else gelu_row(a.data(), g, F, da.data());
    AMap(du + i * 2 * F, F) = d * up * CAMap(da.data(), F);
    AMap(du + i * 2 * F + F, F) = d * CAMap(a.data(), F);
  }
}

void cpu_exp_shifted(float* out, const float* x, int64_t n, float shift) {
  thread_local Eigen::ArrayXf e;
  if (e.size() < n) e.resize(n);
  e.head(n) = (CAMap(x, n) - shift).exp();
  AMap(out, n) = e.head(n);
}

}  // namespace strata
