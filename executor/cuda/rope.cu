// Rotary position embedding in place, as the CPU backend: head h of row s*B + b (stride ld)
// rotates its pairs (i, i + D/2) by s * 10000^(-2i/D); inverse applies the transpose. The
// angle is computed in double, as on the CPU.
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

// row_grid's threads (reduce.cuh) over the S*B rows and heads * D/2 pairs: a thread's pair
// (i, h) and its frequency once, the row's position carried (SeqRow); no division an element.
__global__ void rotate(float* x, long long S, long long B, long long heads, long long D, long long ld, bool inverse) {
  const long long half = D / 2, c = row_col();
  if (c >= heads * half) return;
  const long long i = c % half, h = c / half;
  const double freq = pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  const long long first = row_first(), step = row_step();
  SeqRow sr(first, step, B);
  for (long long row = first; row < S * B; row += step, sr.next()) {
    const double ang = static_cast<double>(sr.s) * freq;
    const float co = static_cast<float>(cos(ang)), sn = static_cast<float>(inverse ? -sin(ang) : sin(ang));
    float* v = x + row * ld + h * D;
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * co - x2 * sn;
    v[i + half] = x2 * co + x1 * sn;
  }
}

}  // namespace

void rope(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse, cudaStream_t s) {
  const int64_t n = S * B * heads * (D / 2);
  if (n == 0) return;
  const RowGrid g = row_grid(S * B, heads * (D / 2));
  STRATA_LAUNCH(rotate, g.grid, g.block, 0, s)(x, S, B, heads, D, ld, inverse);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
