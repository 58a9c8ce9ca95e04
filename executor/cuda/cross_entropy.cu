// Vocab-parallel cross-entropy in the phases of backend.h (the caller reduces mx and st
// over the tensor-parallel ranks between them): one block per row of logits for the row
// maximum and the sum of exponentials (reading the logits only; both in one pass, then moved
// to the ranks' maximum, for cross_entropy_forward), elementwise for the
// backward, which computes each probability again and writes the rounded gradient (over the
// logits, or in 16-bit storage for GEMMs that read it so).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void xent_max(float* mx, const float* z, long long Vt) {
  STRATA_SHARED(float, scratch, [32]);
  const float* row = z + blockIdx.x * Vt;
  float m = -INFINITY;
  for (long long j = threadIdx.x; j < Vt; j += blockDim.x) m = fmaxf(m, row[j]);
  m = block_max(m, scratch);
  if (threadIdx.x == 0) mx[blockIdx.x] = m;
}

__global__ void xent_exp_sum(float* st, const float* z, const float* mx, const int* targets, long long Vt,
                             long long lo) {
  STRATA_SHARED(float, scratch, [32]);
  const long long i = blockIdx.x;
  const float* row = z + i * Vt;
  const float m = mx[i];
  const long long tg = targets[i];
  if (threadIdx.x == 0) st[2 * i + 1] = tg >= lo && tg < lo + Vt ? row[tg - lo] - m : 0.0f;
  float sum = 0.0f;
  for (long long j = threadIdx.x; j < Vt; j += blockDim.x) sum += expf(row[j] - m);
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) st[2 * i] = sum;
}

// max and exp_sum in one pass: each thread keeps the maximum of its values and their sum of
// exponentials against it, rescaled when the maximum grows (a -inf logit adds nothing); the
// block takes the maximum, then the sum of the threads' sums moved to it.
__global__ void xent_forward(float* mx, float* st, const float* z, const int* targets, long long Vt, long long lo) {
  STRATA_SHARED(float, scratch, [32]);
  const long long i = blockIdx.x;
  const float* row = z + i * Vt;
  float m = -INFINITY, sum = 0.0f;
  for (long long j = threadIdx.x; j < Vt; j += blockDim.x) {
    const float x = row[j];
    if (x > m) {
      sum = sum * expf(m - x) + 1.0f;
      m = x;
    } else if (x != -INFINITY) {
      sum += expf(x - m);
    }
  }
  const float top = block_max(m, scratch);
  // (A thread whose values were all -inf or NaN keeps its sum, 0 or NaN, unscaled.)
  sum = block_sum(m == -INFINITY ? sum : sum * expf(m - top), scratch);
  if (threadIdx.x == 0) {
    const long long tg = targets[i];
    mx[i] = top;
    st[2 * i] = sum;
    // (A slice of -inf alone: its target's -inf as it is, which the rescale keeps -inf.)
    st[2 * i + 1] = tg >= lo && tg < lo + Vt ? (top == -INFINITY ? row[tg - lo] : row[tg - lo] - top) : 0.0f;
  }
}

// st against this rank's maxima mx moved to the maxima over the ranks mg.
__global__ void xent_rescale(float* st, const float* mx, const float* mg, const int* targets, long long N, long long Vt,
                             long long lo) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= N) return;
  const float d = mx[i] - mg[i];
  st[2 * i] *= expf(d);
  const long long tg = targets[i];
  if (tg >= lo && tg < lo + Vt) st[2 * i + 1] += d;
}

// The probability from the logit as exp_sum's exponential times the reciprocal of the
// row's sum, less one at the target, times the scale, rounded: each step rounded on its own
// (no contraction into a fused multiply-add), as the separate passes that did it before.
// Written over the logits (dk 0: floats rounded to `round`) or into dz in 16-bit storage
// (dk 1 bf16, 2 fp16: round.cuh's store_value). row_grid's threads (reduce.cuh): no
// division per logit; the row's values once per row a thread visits.
__global__ void xent_backward(void* dz, int dk, const float* z, const float* mx, const float* st, const int* targets,
                              long long N, long long Vt, long long lo, float scale, int round) {
  const long long j = row_col();
  if (j >= Vt) return;
  for (long long i = row_first(); i < N; i += row_step()) {
    const long long t = i * Vt + j;
    float v = __fmul_rn(expf(z[t] - mx[i]), 1.0f / st[2 * i]);
    if (targets[i] - lo == j) v = __fsub_rn(v, 1.0f);
    store_value(dz, t, __fmul_rn(v, scale), dk, round);
  }
}

}  // namespace

void cross_entropy_max(float* mx, const float* z, int64_t N, int64_t Vt, cudaStream_t s) {
  if (N == 0) return;
  STRATA_LAUNCH(xent_max, static_cast<unsigned>(N), kThreads, 0, s)(mx, z, Vt);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_exp_sum(float* st, const float* z, const float* mx, const int* targets, int64_t N, int64_t Vt,
                           int64_t lo, cudaStream_t s) {
  if (N == 0) return;
  STRATA_LAUNCH(xent_exp_sum, static_cast<unsigned>(N), kThreads, 0, s)(st, z, mx, targets, Vt, lo);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_forward(float* mx, float* st, const float* z, const int* targets, int64_t N, int64_t Vt, int64_t lo,
                           cudaStream_t s) {
  if (N == 0) return;
  STRATA_LAUNCH(xent_forward, static_cast<unsigned>(N), kThreads, 0, s)(mx, st, z, targets, Vt, lo);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_rescale(float* st, const float* mx, const float* mg, const int* targets, int64_t N, int64_t Vt,
                           int64_t lo, cudaStream_t s) {
  if (N == 0) return;
  STRATA_LAUNCH(xent_rescale, blocks_for(N, kThreads), kThreads, 0, s)(st, mx, mg, targets, N, Vt, lo);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward(float* z, const float* mx, const float* st, const int* targets, int64_t N, int64_t Vt,
                            int64_t lo, float scale, int kind, cudaStream_t s) {
  if (N * Vt == 0) return;
  const RowGrid g = row_grid(N, Vt);
  STRATA_LAUNCH(xent_backward, g.grid, g.block, 0, s)(z, 0, z, mx, st, targets, N, Vt, lo, scale, kind);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward_packed(uint16_t* dz, const float* z, const float* mx, const float* st, const int* targets,
                                   int64_t N, int64_t Vt, int64_t lo, float scale, int kind, cudaStream_t s) {
  if (N * Vt == 0) return;
  const RowGrid g = row_grid(N, Vt);
  STRATA_LAUNCH(xent_backward, g.grid, g.block, 0, s)(dz, kind, z, mx, st, targets, N, Vt, lo, scale, 0);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
