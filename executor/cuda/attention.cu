// The row kernels of the unfused causal attention. Its products (Q K^T, P V and their
// gradients) run as batched cuBLASLt GEMMs in cuda_backend.cpp, on the tensor cores in a
// 16-bit plan; what lies between them is here: the causal softmax of each row of scaled
// scores, and its backward. One block per row; a batch of `count` S x S matrices, matrix
// g at p + g * stride, row i of it at + i * S, whose columns j <= i are the causal ones
// (the others are written as zeros, as the CPU backend keeps them).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void causal_softmax_rows(float* p, long long stride, long long S) {
  STRATA_SHARED(float, scratch, [32]);
  const long long row = blockIdx.x, g = row / S, i = row % S;
  float* x = p + g * stride + i * S;
  float mx = -INFINITY;
  for (long long j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, x[j]);
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (long long j = threadIdx.x; j <= i; j += blockDim.x) {
    const float e = expf(x[j] - mx);
    x[j] = e;
    sum += e;
  }
  const float inv = 1.0f / block_sum(sum, scratch);
  // Each thread rescales the values it wrote itself: no barrier needed in between.
  for (long long j = threadIdx.x; j < S; j += blockDim.x) x[j] = j <= i ? x[j] * inv : 0.0f;
}

// d holds dP = dO V^T; becomes dS = scale * P (dP - sum_j P_j dP_j) on the causal columns.
__global__ void causal_softmax_backward_rows(float* d, long long d_stride, const float* p, long long p_stride,
                                             long long S, float scale) {
  STRATA_SHARED(float, scratch, [32]);
  const long long row = blockIdx.x, g = row / S, i = row % S;
  float* dr = d + g * d_stride + i * S;
  const float* pr = p + g * p_stride + i * S;
  float dot = 0.0f;
  for (long long j = threadIdx.x; j <= i; j += blockDim.x) dot += pr[j] * dr[j];
  dot = block_sum(dot, scratch);
  for (long long j = threadIdx.x; j < S; j += blockDim.x) dr[j] = j <= i ? pr[j] * (dr[j] - dot) * scale : 0.0f;
}

}  // namespace

void check_attention_shape(int64_t S, int64_t B, int64_t A, int64_t G, int64_t D) {
  if (S > kUnfusedAttentionMaxSeq || B <= 0 || D <= 0 || G <= 0 || A % G != 0)
    throw std::runtime_error("cuda attention: S = " + std::to_string(S) + ", B = " + std::to_string(B) + ", A = " +
                             std::to_string(A) + ", G = " + std::to_string(G) + ", D = " + std::to_string(D) +
                             ": the unfused attention needs S <= " + std::to_string(kUnfusedAttentionMaxSeq) +
                             ", B, D and G positive and A divisible by G");
}

void causal_softmax(float* p, int64_t stride, int64_t count, int64_t S, cudaStream_t s) {
  if (count * S == 0) return;
  STRATA_LAUNCH(causal_softmax_rows, static_cast<unsigned>(count * S), kThreads, 0, s)(p, stride, S);
  CUDA_CHECK_LAUNCH();
}

void causal_softmax_backward(float* d, int64_t d_stride, const float* p, int64_t p_stride, int64_t count, int64_t S,
                             float scale, cudaStream_t s) {
  if (count * S == 0) return;
  STRATA_LAUNCH(causal_softmax_backward_rows, static_cast<unsigned>(count * S), kThreads, 0, s)
  (d, d_stride, p, p_stride, S, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
