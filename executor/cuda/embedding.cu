// Token embedding of one tensor-parallel vocabulary slice [lo, lo + Vt), as gpt.cpp's
// embedding_forward before its tensor-parallel reduction: row s*B + b of x (N = S*B rows of
// H) is wte[tok - lo] when tok = tokens[b*S + s] falls in the slice, zero otherwise. The
// backward adds each row into its token's gradient row (atomics: a token may repeat).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

// Element t of x (S*B rows of H): its wte element (tok - lo) * H + j, or -1 outside the slice.
__device__ inline long long source(long long t, const int* tokens, long long S, long long B, long long H, long long lo,
                                   long long Vt) {
  const long long row = t / H, j = t % H, s = row / B, b = row % B;
  const long long tok = tokens[b * S + s];
  return tok >= lo && tok < lo + Vt ? (tok - lo) * H + j : -1;
}

__global__ void gather(float* x, const float* wte, const int* tokens, long long S, long long B, long long H,
                       long long lo, long long Vt) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= S * B * H) return;
  const long long k = source(t, tokens, S, B, H, lo, Vt);
  x[t] = k >= 0 ? wte[k] : 0.0f;
}

__global__ void scatter(float* dwte, const float* dx, const int* tokens, long long S, long long B, long long H,
                        long long lo, long long Vt) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= S * B * H) return;
  const long long k = source(t, tokens, S, B, H, lo, Vt);
  if (k >= 0) atomicAdd(dwte + k, dx[t]);
}

}  // namespace

void embedding_forward(float* x, const float* wte, const int* tokens, int64_t S, int64_t B, int64_t H, int64_t lo,
                       int64_t Vt, cudaStream_t s) {
  if (S * B * H == 0) return;
  STRATA_LAUNCH(gather, blocks_for(S * B * H, kThreads), kThreads, 0, s)(x, wte, tokens, S, B, H, lo, Vt);
  CUDA_CHECK_LAUNCH();
}

void embedding_backward(float* dwte, const float* dx, const int* tokens, int64_t S, int64_t B, int64_t H, int64_t lo,
                        int64_t Vt, cudaStream_t s) {
  if (S * B * H == 0) return;
  STRATA_LAUNCH(scatter, blocks_for(S * B * H, kThreads), kThreads, 0, s)(dwte, dx, tokens, S, B, H, lo, Vt);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
