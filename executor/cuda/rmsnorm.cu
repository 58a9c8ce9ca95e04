// RMSNorm forward and backward (eps 1e-5, as the CPU backend); the layout of layernorm.cu.
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr float kEps = 1e-5f;
constexpr int kThreads = 256;

// out in either storage (ok: round.cuh's store_value).
__global__ void rms_forward(void* out, int ok, float* rstd, const float* x, const float* w, long long H, int round) {
  STRATA_SHARED(float, scratch, [32]);
  const long long i = blockIdx.x;
  const float* xi = x + i * H;
  float s2 = 0.0f;
  for (long long j = threadIdx.x; j < H; j += blockDim.x) s2 += xi[j] * xi[j];
  const float rs = rsqrtf(block_sum(s2, scratch) / static_cast<float>(H) + kEps);
  if (threadIdx.x == 0) rstd[i] = rs;
  for (long long j = threadIdx.x; j < H; j += blockDim.x) store_value(out, i * H + j, xi[j] * rs * w[j], ok, round);
}

__global__ void rms_backward_dx(float* dx, const float* dout, const void* x, int xk, const float* rstd, const float* w,
                                long long H) {
  STRATA_SHARED(float, scratch, [32]);
  const long long i = blockIdx.x;
  const float* gi = dout + i * H;
  const float rs = rstd[i];
  float m = 0.0f;
  for (long long j = threadIdx.x; j < H; j += blockDim.x) m += gi[j] * w[j] * load_stored(x, i * H + j, xk);
  m = block_sum(m, scratch) / static_cast<float>(H);
  for (long long j = threadIdx.x; j < H; j += blockDim.x)
    dx[i * H + j] += rs * (gi[j] * w[j] - load_stored(x, i * H + j, xk) * rs * rs * m);
}

__global__ void __launch_bounds__(kColTile * kRowLanes)
    rms_backward_dw(float* dw, const float* dout, const void* x, int xk, const float* rstd, long long N, long long H) {
  STRATA_SHARED(float, part, [kRowLanes][kColTile + 1]);
  const long long j = blockIdx.x * static_cast<long long>(kColTile) + threadIdx.x;
  float sw = 0.0f;
  if (j < H)
    for (long long i = threadIdx.y; i < N; i += kRowLanes) sw += dout[i * H + j] * load_stored(x, i * H + j, xk) * rstd[i];
  sw = column_sum(sw, part);
  if (threadIdx.y == 0 && j < H) dw[j] += sw;
}

}  // namespace

void rmsnorm_forward(void* out, int out_kind, float* rstd, const float* x, const float* w, int64_t N, int64_t H,
                     int round, cudaStream_t s) {
  if (N == 0) return;
  STRATA_LAUNCH(rms_forward, static_cast<unsigned>(N), kThreads, 0, s)(out, out_kind, rstd, x, w, H, round);
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t H, int round,
                     cudaStream_t s) {
  rmsnorm_forward(out, 0, rstd, x, w, N, H, round, s);
}

void rmsnorm_backward(float* dx, float* dw, const float* dout, const void* x, int x_kind, const float* rstd,
                      const float* w, int64_t N, int64_t H, cudaStream_t s) {
  if (N == 0 || H == 0) return;
  STRATA_LAUNCH(rms_backward_dx, static_cast<unsigned>(N), kThreads, 0, s)(dx, dout, x, x_kind, rstd, w, H);
  CUDA_CHECK_LAUNCH();
  STRATA_LAUNCH(rms_backward_dw, column_tiles(H), column_block(), 0, s)(dw, dout, x, x_kind, rstd, N, H);
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* rstd, const float* w,
                      int64_t N, int64_t H, cudaStream_t s) {
  rmsnorm_backward(dx, dw, dout, x, 0, rstd, w, N, H, s);
}

}  // namespace strata::cuda
