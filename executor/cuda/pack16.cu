// 16-bit storage of saved activations: floats rounded to bf16 or fp16 and kept as their
// 2-byte patterns, and back. The bf16 rounding is round_to's (round.cu) integer rounding,
// so an unpacked value equals the rounded float bit for bit, as on the CPU backend.
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"  // (cuda_fp16.h)

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void pack16_kernel(unsigned short* dst, const float* src, long long n, int kind) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  dst[t] = pack_value(src[t], kind);
}

__global__ void unpack16_kernel(float* dst, const unsigned short* src, long long n, int kind) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  dst[t] = kind == 2 ? __half2float(__ushort_as_half(src[t])) : __uint_as_float(static_cast<unsigned>(src[t]) << 16);
}

}  // namespace

void pack16(uint16_t* dst, const float* src, int64_t n, int kind, cudaStream_t s) {
  if (n == 0) return;
  STRATA_LAUNCH(pack16_kernel, blocks_for(n, kThreads), kThreads, 0, s)(dst, src, n, kind);
  CUDA_CHECK_LAUNCH();
}

void unpack16(float* dst, const uint16_t* src, int64_t n, int kind, cudaStream_t s) {
  if (n == 0) return;
  STRATA_LAUNCH(unpack16_kernel, blocks_for(n, kThreads), kThreads, 0, s)(dst, src, n, kind);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
