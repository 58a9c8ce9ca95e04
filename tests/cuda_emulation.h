// A CPU emulation of the CUDA names the tensor-core flash attention's kernels use
// (executor/cuda/flash_attention_tc.cuh), so that the very kernels run here, without a GPU:
//   - a launch runs the grid block by block; a block's threads are fibers (ucontext) on the
//     calling thread, run in turn (in thread order, or in reverse: a launch's `order`): each
//     runs until it reaches a barrier (__syncthreads: the block's; __syncwarp: its warp's)
//     and waits there until every thread of that block or warp has arrived. A barrier some
//     thread never reaches (it finished, or waits at another) is a deadlock on a GPU: the
//     launch throws, naming it;
//   - __shfl_xor_sync exchanges through the warp's slots between two warp barriers;
//   - WMMA: a fragment holds its whole 16 x 16 matrix in every lane; each lane loads it and
//     multiplies its own fragments (by the documented layouts: row_major element (r, c) at
//     p[r ldm + c], col_major at p[r + c ldm]); a store writes only the lane's share of the
//     elements (every 32nd), with no barrier of its own, so a kernel that reads what other
//     lanes stored without its own __syncwarp reads what was there before (0xFF bytes, NaN,
//     in a fresh block's shared memory), as on a GPU. Every operation checks WMMA's rules on
//     pointers (32-byte aligned) and leading dimensions (multiples of 8 16-bit or 4 fp32
//     values) and throws where a GPU's result would be undefined;
//   - float4 is 16-byte aligned (UBSan's alignment check sees a misaligned float4 load);
//     atomicAdd is a plain add (one OS thread); dynamic shared memory is exactly the bytes
//     asked for, 128-byte aligned, filled with 0xFF bytes.
// What it cannot show: races the two run orders do not expose, the real fragment layouts'
// element ownership, speed. compute-sanitizer on a GPU (the device check's step 2b) covers
// races.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline Dim3 threadIdx, blockIdx;  // of the thread running now
inline Dim3 blockDim, gridDim;

struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

namespace strata::cuda_emu {

// The fibers of the block being run and the scheduler's context.
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Dim3 idx;
  int waits = -1;  // the barrier it waits at: -1 none, 0 the block's, 1 + w warp w's
  bool done = false;
};
struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0;
  std::vector<float> slots;  // 32 per warp
  unsigned char* shared = nullptr;
  std::function<void()> body;
  std::string error;  // an exception a thread threw
};
inline Block* block = nullptr;
inline unsigned char* dynamic_shared() { return block->shared; }

// The running thread waits at barrier `id` until every thread it covers has arrived.
inline void arrive(int id) {
  Fiber& f = block->fibers[static_cast<size_t>(block->current)];
  f.waits = id;
  swapcontext(&f.ctx, &block->scheduler);
}

inline void fiber_main() {
  try {
    block->body();
  } catch (const std::exception& e) {
    if (block->error.empty()) block->error = "thread " + std::to_string(threadIdx.x) + ": " + e.what();
  } catch (...) {
    if (block->error.empty()) block->error = "thread " + std::to_string(threadIdx.x) + ": an exception";
  }
  block->fibers[static_cast<size_t>(block->current)].done = true;
  // (returns to uc_link: the scheduler)
}

// Thread t's fiber, ready to run the block's body from the start (in a function of its own:
// getcontext is declared to return twice, as setjmp, which launch()'s loop counters would
// be warned about).
inline void start_fiber(Fiber* f, unsigned t, ucontext_t* scheduler) {
  f->idx = Dim3{t, 0, 0};
  f->waits = -1;
  f->done = false;
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = f->stack.data();
  f->ctx.uc_stack.ss_size = f->stack.size();
  f->ctx.uc_link = scheduler;
  makecontext(&f->ctx, fiber_main, 0);
}

// The order a block's runnable threads run in, each round until they wait at a barrier.
enum class Order { forward, reverse };

// Runs kernel(args...) on every block of `grid`, `threads` threads each (a multiple of 32),
// with `shared` bytes of dynamic shared memory. Throws std::runtime_error for an exception
// in a kernel (a WMMA rule broken, __trap) or a barrier some threads never reach.
template <class Kernel, class... Args>
void launch(Order order, Dim3 grid, unsigned threads, size_t shared, Kernel kernel, Args... args) {
  if (threads == 0 || threads % 32 != 0) throw std::invalid_argument("launch: threads must be a multiple of 32");
  gridDim = grid;
  blockDim = Dim3{threads, 1, 1};
  const unsigned warps = threads / 32;
  Block b;
  b.fibers.resize(threads);
  for (Fiber& f : b.fibers) f.stack.resize(size_t{1} << 18);
  b.slots.resize(threads);
  // Exactly `shared` bytes, so that the sanitizers see an access past them.
  struct Free {
    void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t{128}); }
  };
  const std::unique_ptr<unsigned char[], Free> mem(
      static_cast<unsigned char*>(::operator new[](std::max<size_t>(shared, 1), std::align_val_t{128})));
  b.shared = mem.get();
  b.body = [&] { kernel(args...); };
  struct Current {  // `block` points at b while it runs, and at nothing after, thrown or not
    explicit Current(Block* p) { block = p; }
    ~Current() { block = nullptr; }
  } current(&b);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = Dim3{x, y, z};
        std::memset(b.shared, 0xFF, shared);
        for (unsigned t = 0; t < threads; ++t) start_fiber(&b.fibers[t], t, &b.scheduler);
        // Run every runnable thread in turn; then release each barrier all its threads
        // reached; stop when all are done, or none can move (a deadlock on a GPU).
        for (;;) {
          for (unsigned k = 0; k < threads; ++k) {
            const unsigned t = order == Order::forward ? k : threads - 1 - k;
            Fiber& f = b.fibers[t];
            if (f.done || f.waits >= 0) continue;
            b.current = static_cast<int>(t);
            threadIdx = f.idx;
            swapcontext(&b.scheduler, &f.ctx);
            if (!b.error.empty()) throw std::runtime_error("emulated kernel: " + b.error);
          }
          unsigned done = 0, at_block = 0;
          std::vector<unsigned> at_warp(warps, 0);
          for (const Fiber& f : b.fibers) {
            done += f.done ? 1 : 0;
            if (f.waits == 0) ++at_block;
            if (f.waits > 0) ++at_warp[static_cast<size_t>(f.waits - 1)];
          }
          if (done == threads) break;
          bool released = false;
          if (at_block == threads) {
            for (Fiber& f : b.fibers) f.waits = -1;
            released = true;
          }
          for (unsigned w = 0; w < warps; ++w)
            if (at_warp[w] == 32) {
              for (unsigned l = 0; l < 32; ++l) b.fibers[w * 32 + l].waits = -1;
              released = true;
            }
          if (!released)
            throw std::runtime_error("emulated kernel: block (" + std::to_string(x) + ", " + std::to_string(y) + ", " +
                                     std::to_string(z) + "): " + std::to_string(done) + " threads done, " +
                                     std::to_string(at_block) + " at __syncthreads, the rest at __syncwarp: a barrier "
                                     "that not every thread reaches (a deadlock on a GPU)");
        }
      }
}

// The 16-bit operand types: bf16 as its bits, fp16 as the compiler's _Float16.
struct Bf16 {
  uint16_t bits;
};
inline float to_float(Bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(_Float16 v) { return static_cast<float>(v); }

}  // namespace strata::cuda_emu

inline void __syncthreads() { strata::cuda_emu::arrive(0); }
inline void __syncwarp() { strata::cuda_emu::arrive(1 + static_cast<int>(threadIdx.x / 32)); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const unsigned lane = threadIdx.x % 32;
  float* s = strata::cuda_emu::block->slots.data() + threadIdx.x / 32 * 32;
  s[lane] = v;
  __syncwarp();
  const float r = s[lane ^ static_cast<unsigned>(lane_mask)];
  __syncwarp();
  return r;
}
inline void __trap() { throw std::runtime_error("__trap()"); }
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

namespace strata::cuda_emu::wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  float x[256];  // the whole matrix, row-major, in every lane
};

inline void check(const void* p, unsigned ldm, unsigned multiple, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) throw std::runtime_error(std::string(what) + ": pointer not 32-byte aligned");
  if (ldm % multiple != 0) throw std::runtime_error(std::string(what) + ": leading dimension not a multiple of " + std::to_string(multiple));
}

template <class Use, class T, class Layout, class P>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const P* p, unsigned ldm) {
  static_assert(std::is_same_v<T, P>, "a fragment loads its own element type");
  check(p, ldm, 8, "wmma::load_matrix_sync (16-bit)");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.x[r * 16 + c] = to_float(std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[r + c * ldm]);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  check(p, ldm, 4, "wmma::load_matrix_sync (fp32)");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = l == mem_row_major ? p[r * ldm + c] : p[r + c * ldm];
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  check(p, ldm, 4, "wmma::store_matrix_sync");
  for (int i = static_cast<int>(threadIdx.x % 32); i < 256; i += 32) {  // this lane's share
    const int r = i / 16, c = i % 16;
    (l == mem_row_major ? p[r * ldm + c] : p[r + c * ldm]) = f.x[i];
  }
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
  for (float& x : f.x) x = v;
}
// d = a b + c, each product exact in fp32 (16-bit operands), summed in fp32, by each lane on
// its own fragments.
template <class T, class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  float out[256];
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 16; ++n) {
      float s = c.x[r * 16 + n];
      for (int k = 0; k < 16; ++k) s += a.x[r * 16 + k] * b.x[k * 16 + n];
      out[r * 16 + n] = s;
    }
  std::memcpy(d.x, out, sizeof out);
}

}  // namespace strata::cuda_emu::wmma
