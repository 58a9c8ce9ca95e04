// Rounds float values to bf16 or fp16 and back (round to nearest even; fp16 overflows to
// inf), as the inputs of a low-precision GEMM are rounded on the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

// bf16: the CPU backend's integer rounding (NaN and inf kept bit for bit); fp16: the
// hardware conversion, NaN kept as it is (as on the CPU).
__global__ void round_kernel(float* x, long long n, int kind) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  const float v = x[t];
  if (kind == 1) {
    unsigned u = __float_as_uint(v);
    if ((u & 0x7f800000u) != 0x7f800000u) {
      u += 0x7fffu + ((u >> 16) & 1u);
      u &= 0xffff0000u;
    }
    x[t] = __uint_as_float(u);
  } else if (!isnan(v)) {
    x[t] = __half2float(__float2half_rn(v));
  }
}

}  // namespace

void round_to(float* x, int64_t n, int kind, cudaStream_t s) {
  if (n == 0 || (kind != 1 && kind != 2)) return;
  round_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(x, n, kind);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
