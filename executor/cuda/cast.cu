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

// row_grid's threads (reduce.cuh): no division per element.
template <typename T>
__global__ void cast_kernel(T* dst, long long ld_dst, const float* src, long long rows, long long cols, long long ld) {
  const long long c = row_col();
  if (c >= cols) return;
  for (long long r = row_first(); r < rows; r += row_step()) dst[r * ld_dst + c] = from_float<T>(src[r * ld + c]);
}

}  // namespace

void cast_matrix(void* dst, int64_t ld_dst, const float* src, int64_t rows, int64_t cols, int64_t ld, int kind,
                 cudaStream_t s) {
  if (rows * cols == 0) return;
  const RowGrid g = row_grid(rows, cols);
  if (kind == 1)
    STRATA_LAUNCH(cast_kernel<__nv_bfloat16>, g.grid, g.block, 0, s)(static_cast<__nv_bfloat16*>(dst), ld_dst, src, rows,
                                                                      cols, ld);
  else
    STRATA_LAUNCH(cast_kernel<__half>, g.grid, g.block, 0, s)(static_cast<__half*>(dst), ld_dst, src, rows, cols, ld);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
