// LayerNorm forward and backward (eps 1e-5, biased variance, as the CPU backend): one block
// per row for the row statistics and dx; column tiles for dw and db (reduce.cuh's
// column_sum: a fixed order, so the parameter gradients are deterministic).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr float kEps = 1e-5f;
constexpr int kThreads = 256;

// out in either storage (ok: round.cuh's store_value).
__global__ void ln_forward(void* out, int ok, float* mean, float* rstd, const float* x, const float* w, const float* b,
                           long long H, int round) {
  STRATA_SHARED(float, scratch, [32]);
  const long long i = blockIdx.x;
  const float* xi = x + i * H;
  float s = 0.0f;
  for (long long j = threadIdx.x; j < H; j += blockDim.x) s += xi[j];
  const float mu = block_sum(s, scratch) / static_cast<float>(H);
  float s2 = 0.0f;
  for (long long j = threadIdx.x; j < H; j += blockDim.x) s2 += (xi[j] - mu) * (xi[j] - mu);
  const float rs = rsqrtf(block_sum(s2, scratch) / static_cast<float>(H) + kEps);
  if (threadIdx.x == 0) {
    mean[i] = mu;
    rstd[i] = rs;
  }
  for (long long j = threadIdx.x; j < H; j += blockDim.x) store_value(out, i * H + j, (xi[j] - mu) * rs * w[j] + b[j], ok, round);
}

__global__ void ln_backward_dx(float* dx, const float* dout, const void* x, int xk, const float* mean, const float* rstd,
                               const float* w, long long H) {
  STRATA_SHARED(float, scratch, [32]);
  const long long i = blockIdx.x;
  const float* gi = dout + i * H;
  const float mu = mean[i], rs = rstd[i];
  float m1 = 0.0f, m2 = 0.0f;
  for (long long j = threadIdx.x; j < H; j += blockDim.x) {
    const float dn = gi[j] * w[j];
    m1 += dn;
    m2 += dn * (load_stored(x, i * H + j, xk) - mu) * rs;
  }
  m1 = block_sum(m1, scratch) / static_cast<float>(H);
  m2 = block_sum(m2, scratch) / static_cast<float>(H);
  for (long long j = threadIdx.x; j < H; j += blockDim.x)
    dx[i * H + j] += rs * (gi[j] * w[j] - m1 - (load_stored(x, i * H + j, xk) - mu) * rs * m2);
}

__global__ void __launch_bounds__(kColTile * kRowLanes)
    ln_backward_dwdb(float* dw, float* db, const float* dout, const void* x, int xk, const float* mean,
        const float* rstd, long long N, long long H) {
  STRATA_SHARED(float, pw, [kRowLanes][kColTile + 1]);
  STRATA_SHARED(float, pb, [kRowLanes][kColTile + 1]);
  const long long j = blockIdx.x * static_cast<long long>(kColTile) + threadIdx.x;
  float sw = 0.0f, sb = 0.0f;
  if (j < H)
    for (long long i = threadIdx.y; i < N; i += kRowLanes) {
      const float g = dout[i * H + j];
      sw += g * (load_stored(x, i * H + j, xk) - mean[i]) * rstd[i];
      sb += g;
    }
  sw = column_sum(sw, pw);
  sb = column_sum(sb, pb);
  if (threadIdx.y == 0 && j < H) {
    dw[j] += sw;
    db[j] += sb;
  }
}

}  // namespace

void layernorm_forward(void* out, int out_kind, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t H, int round, cudaStream_t s) {
  if (N == 0) return;
  STRATA_LAUNCH(ln_forward, static_cast<unsigned>(N), kThreads, 0, s)(out, out_kind, mean, rstd, x, w, b, H, round);
  CUDA_CHECK_LAUNCH();
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                       int64_t N, int64_t H, int round, cudaStream_t s) {
  layernorm_forward(out, 0, mean, rstd, x, w, b, N, H, round, s);
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const void* x, int x_kind,
                        const float* mean, const float* rstd, const float* w, int64_t N, int64_t H, cudaStream_t s) {
  if (N == 0 || H == 0) return;
  STRATA_LAUNCH(ln_backward_dx, static_cast<unsigned>(N), kThreads, 0, s)(dx, dout, x, x_kind, mean, rstd, w, H);
  CUDA_CHECK_LAUNCH();
  STRATA_LAUNCH(ln_backward_dwdb, column_tiles(H), column_block(), 0, s)(dw, db, dout, x, x_kind, mean, rstd, N, H);
  CUDA_CHECK_LAUNCH();
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* mean,
                        const float* rstd, const float* w, int64_t N, int64_t H, cudaStream_t s) {
  layernorm_backward(dx, dw, db, dout, x, 0, mean, rstd, w, N, H, s);
}

}  // namespace strata::cuda
