// Block-wide sums for the row kernels (one block per row, blockDim a multiple of 32, at
// most 1024 threads), and column sums for the parameter gradients (column tiles, below).
#pragma once

namespace strata::cuda {

template <typename T>
__device__ inline T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Every thread gets the block's sum. `scratch`: 32 values of shared memory (float or double).
template <typename T>
__device__ inline T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : T(0);
  return warp_sum(v);
}

__device__ inline float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

inline unsigned blocks_for(long long n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// Element-wise kernels over a (rows, cols) matrix without an integer division per element
// (a 64-bit division or remainder is a software routine of dozens of instructions on a GPU,
// more than a memory-bound kernel's bytes leave time for): a thread's column is
// row_col() along x (a row's threads read consecutive values), its rows row_first(),
// row_first() + row_step(), ... along y. The block is 256 threads: a width along the
// columns (below) by as many rows as fill it; the grid covers the columns, and the
// rows up to row_grid_limit() blocks (a GPU takes at most 65,535 along y; tests lower it
// so that threads step through several rows).
constexpr int kRowThreads = 256;
inline unsigned& row_grid_limit() {
  static unsigned limit = 65535;
  return limit;
}
struct RowGrid {
  dim3 grid, block;
};
// (rows, cols >= 1: the callers launch nothing for an empty tensor.) The block's width is
// the one of 256, 128, 64 and 32 threads that leaves the fewest idle past the last column
// (384 columns: 3 x 128, not 2 x 256), the widest of those that tie.
inline RowGrid row_grid(long long rows, long long cols) {
  if (rows < 1) rows = 1;
  if (cols < 1) cols = 1;
  unsigned bx = kRowThreads;
  long long idle = blocks_for(cols, kRowThreads) * static_cast<long long>(kRowThreads) - cols;
  for (unsigned w = kRowThreads / 2; w >= 32; w /= 2) {
    const long long i = blocks_for(cols, static_cast<int>(w)) * static_cast<long long>(w) - cols;
    if (i < idle) bx = w, idle = i;
  }
  const unsigned by = kRowThreads / bx;
  const long long gy = (rows + by - 1) / by;
  return RowGrid{dim3(blocks_for(cols, static_cast<int>(bx)),
                      static_cast<unsigned>(gy < row_grid_limit() ? gy : row_grid_limit())),
                 dim3(bx, by)};
}
__device__ inline long long row_col() { return blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; }
__device__ inline long long row_first() { return blockIdx.y * static_cast<long long>(blockDim.y) + threadIdx.y; }
__device__ inline long long row_step() { return static_cast<long long>(gridDim.y) * blockDim.y; }
// Row r = s * B + b of an (S, B) layout as a row_grid thread steps through rows from `first`
// by `step`: s and b carried from row to row (two divisions a thread, none an element).
struct SeqRow {
  long long s, b, step_s, step_b, B;
  __device__ SeqRow(long long first, long long step, long long B_)
      : s(first / B_), b(first % B_), step_s(step / B_), step_b(step % B_), B(B_) {}
  __device__ void next() {
    s += step_s;
    b += step_b;
    if (b >= B) b -= B, ++s;
  }
};

// Column sums of (N, F) row-major data (parameter gradients: dw, db): a block holds
// kColTile columns x kRowLanes row lanes, so every warp reads 8 consecutive values (one
// 32-byte sector) of each of 4 rows; lane r of a column sums rows r, r + kRowLanes, ... in
// order, then column_sum adds the lanes' partial sums in lane order. A fixed order: the
// sums are deterministic, and N / kRowLanes rows per thread instead of N keep many loads in
// flight (one thread per column walking all N rows left a 768-column gradient to 24 warps).
// Tiles of 8 columns give such a gradient 96 blocks, one per SM on most of an H100's 132
// (tiles of 32 gave it 24, under a fifth of the SMs; issue 5's review).
constexpr int kColTile = 8, kRowLanes = 128;
inline dim3 column_block() { return dim3(kColTile, kRowLanes); }
inline unsigned column_tiles(long long F) { return blocks_for(F, kColTile); }
// Row lane 0 gets its column's sum of the block's partials (the other lanes 0). Every
// thread of the block calls it; `part` is shared, one array per sum taken in a kernel.
__device__ inline float column_sum(float v, float (*part)[kColTile + 1]) {
  __syncthreads();  // `part` may still be read by a previous call
  part[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  float s = 0.0f;
  if (threadIdx.y == 0)
    for (int r = 0; r < kRowLanes; ++r) s += part[r][threadIdx.x];
  return s;
}

}  // namespace strata::cuda
