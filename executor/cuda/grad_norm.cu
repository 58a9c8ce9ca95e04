// The clipping norm's inputs, as executor/zero.cpp's grad_norm_terms: acc[0] += the sum of
// squares (in double) of the finite gradients whose counted bit is set (zero.h's FlagBits),
// acc[1] += the number of non-finite ones. Sums in double throughout (threads, warps,
// blocks), one double atomic per block and term.
#include <algorithm>

#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 1024;

__global__ void grad_norm_kernel(const float* g, const unsigned char* counted, long long first, long long n,
                                 double* acc) {
  STRATA_SHARED(double, scratch, [32]);
  double sq = 0.0, bad = 0.0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float x = g[i];
    if (!isfinite(x)) bad += 1.0;
    else if ((counted[(first + i) >> 3] >> ((first + i) & 7)) & 1) sq += static_cast<double>(x) * x;
  }
  const double ssq = block_sum(sq, scratch), sbad = block_sum(bad, scratch);
  if (threadIdx.x == 0) {
    atomicAdd(acc, ssq);
    atomicAdd(acc + 1, sbad);
  }
}

}  // namespace

void grad_norm_terms(const float* g, const unsigned char* counted, int64_t first, int64_t n, double* acc,
                     cudaStream_t s) {
  if (n == 0) return;
  const unsigned blocks = std::min<unsigned>(kBlocks, blocks_for(n, kThreads));
  STRATA_LAUNCH(grad_norm_kernel, blocks, kThreads, 0, s)(g, counted, first, n, acc);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
