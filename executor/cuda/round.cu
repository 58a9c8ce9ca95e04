// Rounds float values to bf16 or fp16 and back (round to nearest even; fp16 overflows to
// inf), as the inputs of a low-precision GEMM are rounded on the CPU.
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void round_kernel(float* x, long long n, int kind) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  x[t] = round_value(x[t], kind);
}

__global__ void round_copy_kernel(float* dst, const float* src, long long n, int kind) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  dst[t] = round_value(src[t], kind);
}

}  // namespace

void round_copy(float* dst, const float* src, int64_t n, int kind, cudaStream_t s) {
  if (n == 0) return;
  STRATA_LAUNCH(round_copy_kernel, blocks_for(n, kThreads), kThreads, 0, s)(dst, src, n, kind);
  CUDA_CHECK_LAUNCH();
}

void round_to(float* x, int64_t n, int kind, cudaStream_t s) {
  if (n == 0 || (kind != 1 && kind != 2)) return;
  STRATA_LAUNCH(round_kernel, blocks_for(n, kThreads), kThreads, 0, s)(x, n, kind);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
