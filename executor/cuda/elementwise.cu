// The elementwise pieces of a layer (backend.h): residual adds, bias add and bias gradient,
// learned positions and their gradient. Sums over rows run in a fixed order (deterministic,
// no atomics): the bias gradient in column tiles (reduce.cuh's column_sum), a position's
// gradient one thread per column over that position's few rows.
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void add_kernel(float* out, const float* a, const float* b, long long n, int round) {
  const long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (t < n) out[t] = round_value(a[t] + b[t], round);
}

// (N, F) rows: row_grid's threads, each with its column's bias.
__global__ void add_bias_kernel(float* y, const float* b, long long N, long long F, int round) {
  const long long j = row_col();
  if (j >= F) return;
  const float bj = b[j];
  for (long long i = row_first(); i < N; i += row_step()) y[i * F + j] = round_value(y[i * F + j] + bj, round);
}

__global__ void __launch_bounds__(kColTile * kRowLanes)
    bias_grad_kernel(float* db, const void* dy, int dyk, long long N, long long F) {
  STRATA_SHARED(float, part, [kRowLanes][kColTile + 1]);
  const long long j = blockIdx.x * static_cast<long long>(kColTile) + threadIdx.x;
  float acc = 0.0f;
  if (j < F)
    for (long long i = threadIdx.y; i < N; i += kRowLanes) acc += load_stored(dy, i * F + j, dyk);
  acc = column_sum(acc, part);
  if (threadIdx.y == 0 && j < F) db[j] += acc;
}

// (n, H) rows from row0 on: row r is position (row0 + r) / B (reduce.cuh's SeqRow).
__global__ void add_positions_kernel(float* out, const float* x, const float* P, long long n, long long H, long long B,
                                     long long row0) {
  const long long j = row_col();
  if (j >= H) return;
  const long long first = row_first(), step = row_step();
  SeqRow sr(row0 + first, step, B);
  for (long long i = first; i < n; i += step, sr.next()) out[i * H + j] = x[i * H + j] + P[sr.s * H + j];
}

// One thread per (position, column) (row_grid over the s_count positions): the rows of that
// position this rank holds, in order.
__global__ void position_grad_kernel(float* dP, const float* dx, long long n, long long H, long long B, long long row0,
                                     long long s_first, long long s_count) {
  const long long j = row_col();
  if (j >= H) return;
  for (long long r = row_first(); r < s_count; r += row_step()) {
    const long long s = s_first + r;
    const long long lo = s * B - row0 > 0 ? s * B - row0 : 0, hi = (s + 1) * B - row0 < n ? (s + 1) * B - row0 : n;
    float acc = 0.0f;
    for (long long i = lo; i < hi; ++i) acc += dx[i * H + j];
    dP[s * H + j] += acc;
  }
}

}  // namespace

void set_row_grid_limit(unsigned blocks) { row_grid_limit() = blocks < 1 ? 1 : blocks > 65535 ? 65535 : blocks; }

void add(float* out, const float* a, const float* b, int64_t n, int round, cudaStream_t s) {
  if (n == 0) return;
  STRATA_LAUNCH(add_kernel, blocks_for(n, kThreads), kThreads, 0, s)(out, a, b, n, round);
  CUDA_CHECK_LAUNCH();
}

void add_bias(float* y, const float* b, int64_t N, int64_t F, int round, cudaStream_t s) {
  if (N * F == 0) return;
  const RowGrid g = row_grid(N, F);
  STRATA_LAUNCH(add_bias_kernel, g.grid, g.block, 0, s)(y, b, N, F, round);
  CUDA_CHECK_LAUNCH();
}

void bias_grad(float* db, const void* dy, int dy_kind, int64_t N, int64_t F, cudaStream_t s) {
  if (F == 0) return;
  STRATA_LAUNCH(bias_grad_kernel, column_tiles(F), column_block(), 0, s)(db, dy, dy_kind, N, F);
  CUDA_CHECK_LAUNCH();
}

void bias_grad(float* db, const float* dy, int64_t N, int64_t F, cudaStream_t s) { bias_grad(db, dy, 0, N, F, s); }

void add_positions(float* out, const float* x, const float* P, int64_t n, int64_t H, int64_t B, int64_t row0,
                   cudaStream_t s) {
  if (n * H == 0) return;
  const RowGrid g = row_grid(n, H);
  STRATA_LAUNCH(add_positions_kernel, g.grid, g.block, 0, s)(out, x, P, n, H, B, row0);
  CUDA_CHECK_LAUNCH();
}

void position_grad(float* dP, const float* dx, int64_t n, int64_t H, int64_t B, int64_t row0, cudaStream_t s) {
  if (n * H == 0) return;
  const long long s_first = row0 / B, s_count = (row0 + n - 1) / B - s_first + 1;
  const RowGrid g = row_grid(s_count, H);
  STRATA_LAUNCH(position_grad_kernel, g.grid, g.block, 0, s)
  (dP, dx, n, H, B, row0, s_first, s_count);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
