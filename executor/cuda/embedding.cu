// Token embedding of one tensor-parallel vocabulary slice [lo, lo + Vt), as gpt.cpp's
// embedding_forward before its tensor-parallel reduction: row s*B + b of x (N = S*B rows of
// H) is wte[tok - lo] when tok = tokens[b*S + s] falls in the slice, zero otherwise. The
// backward adds each row into its token's gradient row (atomics: a token may repeat).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

// Row r = s*B + b of x (S*B rows of H) takes the wte row of tokens[b*S + s] less lo when that
// token falls in the slice. row_grid's threads (reduce.cuh), no division per element: op(x's
// element, its wte element or -1 outside the slice) for each of the thread's rows.
template <class Op>
__device__ inline void each_row(const int* tokens, long long S, long long B, long long H, long long lo, long long Vt,
                                Op op) {
  const long long j = row_col();
  if (j >= H) return;
  const long long first = row_first(), step = row_step();
  SeqRow sr(first, step, B);
  for (long long r = first; r < S * B; r += step, sr.next()) {
    const long long tok = tokens[sr.b * S + sr.s];
    op(r * H + j, tok >= lo && tok < lo + Vt ? (tok - lo) * H + j : -1);
  }
}

__global__ void gather(float* x, const float* wte, const int* tokens, long long S, long long B, long long H,
                       long long lo, long long Vt) {
  each_row(tokens, S, B, H, lo, Vt, [&](long long i, long long k) { x[i] = k >= 0 ? wte[k] : 0.0f; });
}

__global__ void scatter(float* dwte, const float* dx, const int* tokens, long long S, long long B, long long H,
                        long long lo, long long Vt) {
  each_row(tokens, S, B, H, lo, Vt, [&](long long i, long long k) {
    if (k >= 0) atomicAdd(dwte + k, dx[i]);
  });
}

}  // namespace

void embedding_forward(float* x, const float* wte, const int* tokens, int64_t S, int64_t B, int64_t H, int64_t lo,
                       int64_t Vt, cudaStream_t s) {
  if (S * B * H == 0) return;
  const RowGrid g = row_grid(S * B, H);
  STRATA_LAUNCH(gather, g.grid, g.block, 0, s)(x, wte, tokens, S, B, H, lo, Vt);
  CUDA_CHECK_LAUNCH();
}

void embedding_backward(float* dwte, const float* dx, const int* tokens, int64_t S, int64_t B, int64_t H, int64_t lo,
                        int64_t Vt, cudaStream_t s) {
  if (S * B * H == 0) return;
  const RowGrid g = row_grid(S * B, H);
  STRATA_LAUNCH(scatter, g.grid, g.block, 0, s)(dwte, dx, tokens, S, B, H, lo, Vt);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
