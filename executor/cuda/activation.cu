// GELU (tanh form), squared ReLU, SwiGLU and GeGLU forward and backward, element-wise, as the
// CPU backend: gelu and squared ReLU on u (N, F); the gated ones read gate = u[:, j] and
// up = u[:, F + j] of u (N, 2F).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

__device__ inline float gelu(float x, float* grad) {
  const float th = tanhf(kGeluK * (x + kGeluA * x * x * x));
  if (grad) *grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * kGeluK * (1.0f + 3.0f * kGeluA * x * x);
  return 0.5f * x * (1.0f + th);
}

__device__ inline float silu(float x, float* grad) {
  const float s = 1.0f / (1.0f + expf(-x));
  if (grad) *grad = s * (1.0f + x * (1.0f - s));
  return x * s;
}

__device__ inline float squared_relu(float x, float* grad) {
  const float r = fmaxf(x, 0.0f);
  if (grad) *grad = 2.0f * r;
  return r * r;
}

__device__ inline float act(int kind, float x, float* grad) { return kind == 1 ? silu(x, grad) : gelu(x, grad); }
// The ungated kinds, 0 and 3, on u (N, F).
__device__ inline bool ungated(int kind) { return kind == 0 || kind == 3; }
__device__ inline float ungated_act(int kind, float x, float* grad) {
  return kind == 3 ? squared_relu(x, grad) : gelu(x, grad);
}

// out in either storage (ok: round.cuh's store_value); u16, where not null, gets u as
// pack16 stores it in kind ok (1 or 2). row_grid's threads (reduce.cuh) over the N rows and
// F output columns: no division per element.
__global__ void forward(int kind, void* out, int ok, unsigned short* u16, const float* u, long long N, long long F,
                        int round) {
  const long long j = row_col();
  if (j >= F) return;
  for (long long i = row_first(); i < N; i += row_step()) {
    const long long t = i * F + j;
    if (ungated(kind)) {
      const float x = u[t];
      store_value(out, t, ungated_act(kind, x, nullptr), ok, round);
      if (u16) u16[t] = pack_value(x, ok);
      continue;
    }
    const float* row = u + i * 2 * F;
    const float gate = row[j], up = row[F + j];
    store_value(out, t, act(kind, gate, nullptr) * up, ok, round);
    if (u16) {
      u16[i * 2 * F + j] = pack_value(gate, ok);
      u16[i * 2 * F + F + j] = pack_value(up, ok);
    }
  }
}

// u in either storage (uk: round.cuh's load_stored), du too (dk: store_value).
__global__ void backward(int kind, void* du, int dk, const float* dout, const void* u, int uk, long long N,
                         long long F, int round) {
  const long long j = row_col();
  if (j >= F) return;
  for (long long i = row_first(); i < N; i += row_step()) {
    const long long t = i * F + j;
    float g = 0.0f;
    if (ungated(kind)) {
      ungated_act(kind, load_stored(u, t, uk), &g);
      store_value(du, t, dout[t] * g, dk, round);
      continue;
    }
    const float gate = load_stored(u, i * 2 * F + j, uk), up = load_stored(u, i * 2 * F + F + j, uk);
    const float a = act(kind, gate, &g);
    store_value(du, i * 2 * F + j, dout[t] * up * g, dk, round);
    store_value(du, i * 2 * F + F + j, dout[t] * a, dk, round);
  }
}

}  // namespace

void activation_forward(int kind, void* out, int out_kind, uint16_t* u16, const float* u, int64_t N, int64_t F,
                        int round, cudaStream_t s) {
  if (N * F == 0) return;
  const RowGrid g = row_grid(N, F);
  STRATA_LAUNCH(forward, g.grid, g.block, 0, s)(kind, out, out_kind, u16, u, N, F, round);
  CUDA_CHECK_LAUNCH();
}

void activation_forward(int kind, float* out, const float* u, int64_t N, int64_t F, int round, cudaStream_t s) {
  activation_forward(kind, out, 0, nullptr, u, N, F, round, s);
}

void activation_backward(int kind, void* du, int du_kind, const float* dout, const void* u, int u_kind, int64_t N,
                         int64_t F, int round, cudaStream_t s) {
  if (N * F == 0) return;
  const RowGrid g = row_grid(N, F);
  STRATA_LAUNCH(backward, g.grid, g.block, 0, s)(kind, du, du_kind, dout, u, u_kind, N, F, round);
  CUDA_CHECK_LAUNCH();
}

void activation_backward(int kind, float* du, const float* dout, const void* u, int u_kind, int64_t N, int64_t F,
                         int round, cudaStream_t s) {
  activation_backward(kind, du, 0, dout, u, u_kind, N, F, round, s);
}

void activation_backward(int kind, float* du, const float* dout, const float* u, int64_t N, int64_t F, int round,
                         cudaStream_t s) {
  activation_backward(kind, du, 0, dout, u, 0, N, F, round, s);
}

}  // namespace strata::cuda
