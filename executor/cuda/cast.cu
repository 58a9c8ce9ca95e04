// The casts of the GEMM inputs: a float matrix (rows x cols, row stride ld) into a bf16 or
// fp16 matrix (row stride ld_dst, padded by the caller so rows start 16-byte aligned), round
// to nearest even, for cuBLASLt's tensor-core GEMMs. The executor rounds GEMM operands to the training precision already (round.cu),
// so on its inputs the cast is exact.
#ifndef STRATA_CUDA_EMULATION  // (tests/cuda_emulation.h: the kernels on the CPU)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void cast_kernel(T* dst, long long ld_dst, const float* src, long long rows, long long cols, long long ld) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t >= rows * cols) return;
  const long long r = t / cols, c = t % cols;
  dst[r * ld_dst + c] = from_float<T>(src[r * ld + c]);
}

}  // namespace

void cast_matrix(void* dst, int64_t ld_dst, const float* src, int64_t rows, int64_t cols, int64_t ld, int kind,
                 cudaStream_t s) {
  if (rows * cols == 0) return;
  if (kind == 1)
    STRATA_LAUNCH(cast_kernel<__nv_bfloat16>, blocks_for(rows * cols, kThreads), kThreads, 0, s)(
        static_cast<__nv_bfloat16*>(dst), ld_dst, src, rows, cols, ld);
  else
    STRATA_LAUNCH(cast_kernel<__half>, blocks_for(rows * cols, kThreads), kThreads, 0, s)(static_cast<__half*>(dst),
                                                                                           ld_dst, src, rows, cols, ld);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
