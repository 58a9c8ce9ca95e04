// C (M, N, row stride ldc) *= beta (beta = 0 writes zeros): the GEMM with K = 0, which the
// CPU backend defines as C = beta * C and cuBLASLt does not take.
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

__global__ void scale_kernel(float* c, long long M, long long N, long long ldc, float beta) {
  const long long j = row_col();
  if (j >= N) return;
  for (long long i = row_first(); i < M; i += row_step()) {
    float* p = c + i * ldc + j;
    *p = beta == 0.0f ? 0.0f : beta * *p;
  }
}

}  // namespace

void scale_matrix(float* c, int64_t M, int64_t N, int64_t ldc, float beta, cudaStream_t s) {
  if (M * N == 0) return;
  const RowGrid g = row_grid(M, N);
  STRATA_LAUNCH(scale_kernel, g.grid, g.block, 0, s)(c, M, N, ldc, beta);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
