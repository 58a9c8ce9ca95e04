// AdamW on n elements, as executor/zero.cpp's adamw_update: the step's scalars (bias
// corrections, step size, decay) are computed on the host in double, as on the CPU; the
// decay flags are bits (zero.h's FlagBits).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, const unsigned char* decay, long long first,
                             long long n, AdamWScalars k) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float gi = g[i] * k.grad_mul;
  m[i] = k.b1 * m[i] + (1.0f - k.b1) * gi;
  v[i] = k.b2 * v[i] + (1.0f - k.b2) * gi * gi;
  const long long b = first + i;
  if ((decay[b >> 3] >> (b & 7)) & 1) p[i] -= k.wd * p[i];
  p[i] -= k.step_size * m[i] / (sqrtf(v[i] * k.inv_bc2) + k.eps);
}

}  // namespace

void adamw(float* p, const float* g, float* m, float* v, const unsigned char* decay, int64_t first, int64_t n,
           const AdamWScalars& k, cudaStream_t s) {
  if (n == 0) return;
  STRATA_LAUNCH(adamw_kernel, blocks_for(n, kThreads), kThreads, 0, s)(p, g, m, v, decay, first, n, k);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
