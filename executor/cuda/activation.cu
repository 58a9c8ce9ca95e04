// GELU (tanh form), SwiGLU and GeGLU forward and backward, element-wise, as the CPU backend:
// gelu on u (N, F); the gated ones read gate = u[:, j] and up = u[:, F + j] of u (N, 2F).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;
constexpr int kThreads = 256;

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

__device__ inline float act(int kind, float x, float* grad) { return kind == 1 ? silu(x, grad) : gelu(x, grad); }

__global__ void forward(int kind, float* out, const float* u, long long N, long long F, int round) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= N * F) return;
  if (kind == 0) {
    out[t] = round_value(gelu(u[t], nullptr), round);
    return;
  }
  const long long i = t / F, j = t % F;
  const float* row = u + i * 2 * F;
  out[t] = round_value(act(kind, row[j], nullptr) * row[F + j], round);
}

// u in either storage (uk: round.cuh's load_stored).
__global__ void backward(int kind, float* du, const float* dout, const void* u, int uk, long long N, long long F,
                         int round) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= N * F) return;
  float g = 0.0f;
  if (kind == 0) {
    gelu(load_stored(u, t, uk), &g);
    du[t] = round_value(dout[t] * g, round);
    return;
  }
  const long long i = t / F, j = t % F;
  const float gate = load_stored(u, i * 2 * F + j, uk), up = load_stored(u, i * 2 * F + F + j, uk);
  const float a = act(kind, gate, &g);
  du[i * 2 * F + j] = round_value(dout[t] * up * g, round);
  du[i * 2 * F + F + j] = round_value(dout[t] * a, round);
}

}  // namespace

void activation_forward(int kind, float* out, const float* u, int64_t N, int64_t F, int round, cudaStream_t s) {
  if (N * F == 0) return;
  STRATA_LAUNCH(forward, blocks_for(N * F, kThreads), kThreads, 0, s)(kind, out, u, N, F, round);
  CUDA_CHECK_LAUNCH();
}

void activation_backward(int kind, float* du, const float* dout, const void* u, int u_kind, int64_t N, int64_t F,
                         int round, cudaStream_t s) {
  if (N * F == 0) return;
  STRATA_LAUNCH(backward, blocks_for(N * F, kThreads), kThreads, 0, s)(kind, du, dout, u, u_kind, N, F, round);
  CUDA_CHECK_LAUNCH();
}

void activation_backward(int kind, float* du, const float* dout, const float* u, int64_t N, int64_t F, int round,
                         cudaStream_t s) {
  activation_backward(kind, du, dout, u, 0, N, F, round, s);
}

}  // namespace strata::cuda
