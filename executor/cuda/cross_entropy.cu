// Vocab-parallel cross-entropy in the phases of backend.h (the caller reduces mx and st
// over the tensor-parallel ranks between them): one block per row of logits for the row
// maximum and the sum of exponentials, elementwise for the normalisation and the backward.
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void xent_max(float* mx, const float* z, long long Vt) {
  __shared__ float scratch[32];
  const float* row = z + blockIdx.x * Vt;
  float m = -INFINITY;
  for (long long j = threadIdx.x; j < Vt; j += blockDim.x) m = fmaxf(m, row[j]);
  m = block_max(m, scratch);
  if (threadIdx.x == 0) mx[blockIdx.x] = m;
}

__global__ void xent_exp_sum(float* st, float* z, const float* mx, const int* targets, long long Vt, long long lo) {
  __shared__ float scratch[32];
  const long long i = blockIdx.x;
  float* row = z + i * Vt;
  const float m = mx[i];
  const long long tg = targets[i];
  // The target's shifted logit, read before the row is overwritten with exponentials.
  if (threadIdx.x == 0) st[2 * i + 1] = tg >= lo && tg < lo + Vt ? row[tg - lo] - m : 0.0f;
  __syncthreads();
  float sum = 0.0f;
  for (long long j = threadIdx.x; j < Vt; j += blockDim.x) {
    const float e = expf(row[j] - m);
    row[j] = e;
    sum += e;
  }
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) st[2 * i] = sum;
}

__global__ void xent_normalise(float* z, const float* st, long long N, long long Vt) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= N * Vt) return;
  z[t] *= 1.0f / st[2 * (t / Vt)];
}

__global__ void xent_backward(float* z, const int* targets, long long N, long long Vt, long long lo, float scale) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= N * Vt) return;
  const long long i = t / Vt, j = t % Vt;
  const long long tg = targets[i];
  float v = z[t];
  if (tg - lo == j) v -= 1.0f;
  z[t] = v * scale;
}

}  // namespace

void cross_entropy_max(float* mx, const float* z, int64_t N, int64_t Vt, cudaStream_t s) {
  if (N == 0) return;
  xent_max<<<static_cast<unsigned>(N), kThreads, 0, s>>>(mx, z, Vt);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_exp_sum(float* st, float* z, const float* mx, const int* targets, int64_t N, int64_t Vt, int64_t lo,
                           cudaStream_t s) {
  if (N == 0) return;
  xent_exp_sum<<<static_cast<unsigned>(N), kThreads, 0, s>>>(st, z, mx, targets, Vt, lo);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_normalise(float* z, const float* st, int64_t N, int64_t Vt, cudaStream_t s) {
  if (N * Vt == 0) return;
  xent_normalise<<<blocks_for(N * Vt, kThreads), kThreads, 0, s>>>(z, st, N, Vt);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward(float* z, const int* targets, int64_t N, int64_t Vt, int64_t lo, float scale,
                            cudaStream_t s) {
  if (N * Vt == 0) return;
  xent_backward<<<blocks_for(N * Vt, kThreads), kThreads, 0, s>>>(z, targets, N, Vt, lo, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
