// A CPU emulation of the CUDA names the backend's kernels use, so that the very kernels run
// here, without a GPU: the tensor-core flash attention's (executor/cuda/flash_attention_tc.cuh,
// flash_tc_emulation_test) and, whole .cu files with their launchers, every kernel of the
// backend (compiled by the host compiler, g++ or, in make test's sanitizer build, clang, with
// this header forced in: cuda_kernels_emulation_test):
//   - a launch runs the grid block by block; a block's threads (1, 2 or 3 dimensions, x
//     fastest, warps of 32 consecutive threads) are fibers on the calling thread (below),
//     run in turn (in thread order, in reverse, or warp by warp each as far ahead as its own
//     barriers let it: a launch's `order`, Order below; STRATA_LAUNCH takes
//     cuda_emu::launch_order): each runs until it reaches a barrier (__syncthreads: the
//     block's; __syncwarp: its warp's) and waits there until every thread of that block or
//     warp has arrived. A barrier some thread never reaches (it finished, or waits at
//     another) is a deadlock on a GPU: the launch throws, naming it;
//   - __shfl_xor_sync exchanges through the warp's slots between two warp barriers;
//   - shared memory: STRATA_SHARED arrays (a kernel's `__shared__`), one per block, and the
//     dynamic bytes a launch asks for, exactly those, 128-byte aligned; both filled with
//     0xFF bytes (NaN floats) at each block's start;
//   - WMMA: a fragment holds its whole 16 x 16 matrix in every lane; each lane loads it and
//     multiplies its own fragments (by the documented layouts: row_major element (r, c) at
//     p[r ldm + c], col_major at p[r + c ldm]); a store writes only the lane's share of the
//     elements (every 32nd), with no barrier of its own, so a kernel that reads what other
//     lanes stored without its own __syncwarp reads what was there before (0xFF bytes, NaN,
//     in a fresh block's shared memory), as on a GPU. Every operation checks WMMA's rules on
//     pointers (32-byte aligned) and leading dimensions (multiples of 8 16-bit or 4 fp32
//     values) and throws where a GPU's result would be undefined;
//   - float4 is 16-byte aligned (UBSan's alignment check sees a misaligned float4 load);
//     atomicAdd is a plain add (one OS thread); the math functions are the host's (expf,
//     rsqrtf and tanhf within a few ulp of the GPU's), __fmul_rn and the like the plain
//     operation (the emulated files are built without contraction), fp16 the compiler's
//     _Float16, bf16 as its bits (__float2bfloat16_rn rounds to nearest even, a NaN to
//     0x7fff);
//   - the runtime's names (below): one device of host memory, synchronous, with an H100's
//     shared memory (a launch past 48 KiB of dynamic shared memory refused unless its
//     kernel was opted in, as a GPU refuses it; static and dynamic bytes counted together)
//     and memory pools that keep their peaks; with check_device_pointers, a host pointer
//     where device memory belongs (a kernel's argument, a copy's side, a memset, a
//     cuBLASLt operand) fails, as it would on a GPU.
// One host thread launches: the emulation's state (the running block, the allocations, the
// opt-ins) is unguarded. In a build with CUDA the test binary holds the real backend too;
// the emulation's functions are C++ inline functions of its own names' signatures, the
// runtime's are C functions, so nothing links across.
// What it cannot show: races the run orders do not expose, the real fragment layouts'
// element ownership, a GPU's last bits, speed; and of a kernel's pointer arguments only
// where they point is checked, not how far the kernel reads from them (the sanitizer
// build's AddressSanitizer reports a read past an allocation). compute-sanitizer on a GPU (the device
// check's step 2b) covers races; cuda_ops_test on a GPU the bits.
#pragma once

#include <ucontext.h>

// Switching between a block's fibers: glibc's swapcontext saves and restores the signal
// mask with a system call at every switch (two per barrier and thread: most of a run's
// time), so on x86-64 a switch saves the callee-saved registers on the fiber's stack and
// swaps stack pointers (strata_emulation_switch below), telling AddressSanitizer of each
// switch (its fiber interface) where it runs; swapcontext elsewhere. (MXCSR and the x87
// control word are not switched: every fiber runs with the thread's, which no kernel
// changes.)
#if defined(__x86_64__)
#define STRATA_EMULATION_FAST_SWITCH 1
#include "executor/asan.h"
#if defined(STRATA_ASAN)
#include <sanitizer/common_interface_defs.h>
#define STRATA_EMULATION_ASAN_FIBERS 1
#endif
// Saves rbp, rbx, r12-r15 on the current stack, stores its pointer in *save (rdi), loads
// `load` (rsi) as the stack pointer and pops the same registers from it, then returns there.
// (A naked inline function: one definition however many files include this.)
__attribute__((naked, noinline)) inline void strata_emulation_switch(void** /*save*/, void* /*load*/) {
  __asm__(
      "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
      "  movq %rsp, (%rdi)\n"
      "  movq %rsi, %rsp\n"
      "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
      "  ret\n");
}
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <functional>
#include <map>
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
  Dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using dim3 = Dim3;
inline Dim3 threadIdx, blockIdx;  // of the thread running now
inline Dim3 blockDim, gridDim;

// The runtime's names the launchers and the CUDA backend use (cuda_backend.cpp, built for
// cuda_ops_emulated_test): one device whose memory is the host's (allocations 256-byte
// aligned and filled with NaN, device_bytes at most, pools' reserves counted), everything
// synchronous (a stream is a name, a copy or memset
// done on return, a host function run at once, an event the host clock's time), an H100's
// shared memory (a launch's dynamic bytes at most what cudaFuncSetAttribute opted its
// kernel in to, at most 227 KiB, or without an opt-in 48 KiB less its static arrays;
// BoundLaunch and check_static_shared check), stream-ordered memory pools that count the
// bytes in use and reserved (a pool keeps what it reserved until trimmed) with their
// peaks, and with check_device_pointers device pointers where they belong (below).
struct CUstream_st {
  int id;
};
using cudaStream_t = CUstream_st*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess             ? "cudaSuccess"
         : e == cudaErrorInvalidValue ? "cudaErrorInvalidValue"
                                      : "cudaErrorMemoryAllocation";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : "out of memory";
}
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidValue; }
struct cudaDeviceProp {
  char name[256];
};
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  std::snprintf(p->name, sizeof p->name, "%s", "CPU emulation of a CUDA device");
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetPCIBusId(char* bus, int len, int) {
  std::snprintf(bus, static_cast<size_t>(len), "%s", "0000:00:00.0");
  return cudaSuccess;
}
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin, cudaDevAttrMemoryPoolsSupported };
struct cudaFuncAttributes {
  int ptxVersion = 0;
};
struct CUmemPoolHandle_st {
  uint64_t used = 0, used_high = 0, reserved = 0, reserved_high = 0;
  bool destroyed = false;  // (its memory goes once its last allocation is freed, as on a GPU)
};
using cudaMemPool_t = CUmemPoolHandle_st*;
namespace strata::cuda_emu {
constexpr int kDefaultSharedBytes = 48 << 10, kOptInSharedBytes = 227 << 10;
// The dynamic shared memory each kernel was opted in to (a kernel by its address).
inline std::map<const void*, int> opted_in;
// The device's memory: what cudaMalloc holds plus what every pool has reserved (a pool
// keeps what it reserved until trimmed or destroyed), at most device_bytes (a test may
// lower it). New memory is filled with 0xFF bytes (NaN floats), as a pool hands back stale
// memory: a read before a write shows.
inline size_t device_bytes = size_t{80} << 30;
inline size_t device_held = 0;
struct Allocation {
  size_t bytes;
  cudaMemPool_t pool;  // null: cudaMalloc's
};
inline std::map<void*, Allocation> allocations;
inline cudaError_t device_alloc(void** p, size_t bytes, cudaMemPool_t pool) {
  // What the device must find: the bytes, or what the pool lacks of them.
  const size_t grow = pool == nullptr ? bytes : (pool->used + bytes > pool->reserved ? pool->used + bytes - pool->reserved : 0);
  if (grow > device_bytes - device_held) return cudaErrorMemoryAllocation;
  *p = ::operator new[](std::max<size_t>(bytes, 1), std::align_val_t{256}, std::nothrow);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  std::memset(*p, 0xFF, bytes);
  allocations[*p] = Allocation{bytes, pool};
  device_held += grow;
  if (pool) {
    pool->used += bytes;
    pool->used_high = std::max(pool->used_high, pool->used);
    pool->reserved += grow;
    pool->reserved_high = std::max(pool->reserved_high, pool->reserved);
  }
  return cudaSuccess;
}
inline void release_pool(cudaMemPool_t pool) {  // a destroyed pool, once its last block is freed
  device_held -= pool->reserved;
  delete pool;
}
// (cudaFree and cudaFreeAsync both take either kind of allocation, as on a GPU; a pointer
// that is not a live allocation's start is refused.)
inline cudaError_t device_free(void* p) {
  if (p == nullptr) return cudaSuccess;
  const auto it = allocations.find(p);
  if (it == allocations.end()) return cudaErrorInvalidValue;
  if (cudaMemPool_t pool = it->second.pool) {
    pool->used -= it->second.bytes;
    if (pool->destroyed && pool->used == 0) release_pool(pool);
  } else {
    device_held -= it->second.bytes;
  }
  allocations.erase(it);
  ::operator delete[](p, std::align_val_t{256});
  return cudaSuccess;
}
// Device pointers. On a GPU a host pointer where device memory belongs is an illegal
// address in a kernel (a sticky error: the context is lost) and an invalid value in a copy
// or a memset of the wrong kind; here, where all memory is the host's, nothing would show
// it. With check_device_pointers (cuda_ops_emulated_test sets it; the kernel tests launch on
// host vectors and leave it off) every non-null pointer a launch passes must point into a
// live allocation (its start up to its end), a copy's or memset's bytes must lie in one
// where its kind says device and outside every one where it says host, and cuBLASLt's
// operands (their whole extent) and workspace in one.
inline bool check_device_pointers = false;
// The live allocation holding [p, p + bytes) whole, or null (bytes 0: p may be its end).
inline const Allocation* allocation_of(const void* p, size_t bytes) {
  auto it = allocations.upper_bound(const_cast<void*>(p));
  const uintptr_t q = reinterpret_cast<uintptr_t>(p);
  for (int back = 0; back < 2 && it != allocations.begin(); ++back) {  // (p may be one's end and the next's start)
    --it;
    const uintptr_t base = reinterpret_cast<uintptr_t>(it->first);
    if (q >= base && q - base <= it->second.bytes && bytes <= it->second.bytes - (q - base)) return &it->second;
  }
  return nullptr;
}
inline bool on_device(const void* p, size_t bytes) { return allocation_of(p, bytes) != nullptr; }
// No byte of [p, p + bytes) in any allocation.
inline bool on_host(const void* p, size_t bytes) {
  const uintptr_t q = reinterpret_cast<uintptr_t>(p);
  auto it = allocations.lower_bound(const_cast<void*>(p));
  if (it != allocations.end() && reinterpret_cast<uintptr_t>(it->first) < q + bytes) return false;
  if (it == allocations.begin()) return true;
  --it;
  return reinterpret_cast<uintptr_t>(it->first) + it->second.bytes <= q;
}
inline cudaError_t refused(const char* what) {
  std::fprintf(stderr, "emulated CUDA runtime: %s\n", what);
  return cudaErrorInvalidValue;
}
}  // namespace strata::cuda_emu
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr a, int) {
  *value = a == cudaDevAttrMemoryPoolsSupported ? 1 : strata::cuda_emu::kOptInSharedBytes;
  return cudaSuccess;
}
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute, int bytes) {
  if (bytes < 0 || bytes > strata::cuda_emu::kOptInSharedBytes) return cudaErrorInvalidValue;
  strata::cuda_emu::opted_in[reinterpret_cast<const void*>(kernel)] = bytes;
  return cudaSuccess;
}
template <class Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, Kernel) {
  a->ptxVersion = 90;
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, size_t bytes) { return strata::cuda_emu::device_alloc(p, bytes, nullptr); }
inline cudaError_t cudaFree(void* p) { return strata::cuda_emu::device_free(p); }
inline cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  *total = strata::cuda_emu::device_bytes;
  *free = *total - std::min(*total, strata::cuda_emu::device_held);
  return cudaSuccess;
}
constexpr unsigned cudaStreamNonBlocking = 1;
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = new CUstream_st{0};
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
enum cudaMemcpyKind {
  cudaMemcpyHostToHost,
  cudaMemcpyHostToDevice,
  cudaMemcpyDeviceToHost,
  cudaMemcpyDeviceToDevice,
  cudaMemcpyDefault
};
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  namespace emu = strata::cuda_emu;
  if (emu::check_device_pointers && bytes > 0) {
    // Each side where the kind puts it (cudaMemcpyDefault: either, but whole).
    auto side_ok = [&](const void* p, bool device) { return device ? emu::on_device(p, bytes) : emu::on_host(p, bytes); };
    auto either = [&](const void* p) { return emu::on_device(p, bytes) || emu::on_host(p, bytes); };
    const bool ok = kind == cudaMemcpyHostToDevice   ? side_ok(dst, true) && side_ok(src, false)
                    : kind == cudaMemcpyDeviceToHost ? side_ok(dst, false) && side_ok(src, true)
                    : kind == cudaMemcpyDeviceToDevice ? side_ok(dst, true) && side_ok(src, true)
                    : kind == cudaMemcpyHostToHost     ? side_ok(dst, false) && side_ok(src, false)
                                                       : either(dst) && either(src);
    if (!ok) return emu::refused("cudaMemcpyAsync: a side not where the copy's kind says (or past its allocation)");
  }
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  if (strata::cuda_emu::check_device_pointers && bytes > 0 && !strata::cuda_emu::on_device(p, bytes))
    return strata::cuda_emu::refused("cudaMemsetAsync: bytes outside device memory");
  if (bytes > 0) std::memset(p, value, bytes);
  return cudaSuccess;
}
using cudaHostFn_t = void (*)(void*);
inline cudaError_t cudaLaunchHostFunc(cudaStream_t, cudaHostFn_t fn, void* arg) {
  fn(arg);
  return cudaSuccess;
}
struct CUevent_st {
  std::chrono::steady_clock::time_point t;
};
using cudaEvent_t = CUevent_st*;
inline cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st{};
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  e->t = std::chrono::steady_clock::now();
  return cudaSuccess;
}
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  *ms = std::chrono::duration<float, std::milli>(b->t - a->t).count();
  return cudaSuccess;
}
enum cudaMemAllocationType { cudaMemAllocationTypePinned = 1 };
enum cudaMemLocationType { cudaMemLocationTypeDevice = 1 };
struct cudaMemLocation {
  cudaMemLocationType type;
  int id;
};
struct cudaMemPoolProps {
  cudaMemAllocationType allocType;
  cudaMemLocation location;
};
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold, cudaMemPoolAttrReservedMemHigh, cudaMemPoolAttrUsedMemHigh };
inline cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps*) {
  *pool = new CUmemPoolHandle_st{};
  return cudaSuccess;
}
inline cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
  pool->destroyed = true;
  if (pool->used == 0) strata::cuda_emu::release_pool(pool);
  return cudaSuccess;
}
inline cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr a, void*) {
  return a == cudaMemPoolAttrReleaseThreshold ? cudaSuccess : cudaErrorInvalidValue;
}
inline cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr a, void* value) {
  if (a == cudaMemPoolAttrReleaseThreshold) return cudaErrorInvalidValue;
  *static_cast<uint64_t*>(value) = a == cudaMemPoolAttrUsedMemHigh ? pool->used_high : pool->reserved_high;
  return cudaSuccess;
}
inline cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t keep) {
  const uint64_t kept = std::max<uint64_t>(pool->used, std::min<uint64_t>(pool->reserved, keep));
  strata::cuda_emu::device_held -= pool->reserved - kept;
  pool->reserved = kept;
  return cudaSuccess;
}
inline cudaError_t cudaMallocFromPoolAsync(void** p, size_t bytes, cudaMemPool_t pool, cudaStream_t) {
  return strata::cuda_emu::device_alloc(p, bytes, pool);
}
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) { return strata::cuda_emu::device_free(p); }

struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

namespace strata::cuda_emu {

// The fibers of the block being run and the scheduler's context.
constexpr size_t kStackBytes = size_t{1} << 18;  // a thread's stack (the flash kernels' fragments)
struct Fiber {
  ucontext_t ctx;
  void* sp = nullptr;    // (the fast switch: its saved stack pointer,
  void* fake = nullptr;  // and AddressSanitizer's fake stack while it is switched out)
  char* stack = nullptr;  // kStackBytes, not zeroed (a page is touched when used); launch()'s, kept between launches
  Dim3 idx;
  unsigned warp = 0;  // its linear index / 32
  int waits = -1;     // the barrier it waits at: -1 none, 0 the block's, 1 + w warp w's
  bool done = false;
  size_t statics = 0;  // STRATA_SHARED arrays met so far in this block
};
struct FreeAligned {
  void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t{128}); }
};
using SharedBytes = std::unique_ptr<unsigned char[], FreeAligned>;
inline SharedBytes shared_bytes(size_t n) {
  return SharedBytes(static_cast<unsigned char*>(::operator new[](std::max<size_t>(n, 1), std::align_val_t{128})));
}
struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler{};
  void* scheduler_sp = nullptr;
  const void* scheduler_bottom = nullptr;  // (the scheduler's stack, for AddressSanitizer)
  size_t scheduler_size = 0;
  int current = 0;
  std::vector<double> slots;  // 32 per warp
  unsigned char* shared = nullptr;
  // The kernel's STRATA_SHARED arrays in the order its threads meet them, with their sizes.
  std::vector<SharedBytes> statics;
  std::vector<size_t> static_sizes;
  size_t static_total = 0;
  // The launch's dynamic shared memory, and the most its kernel was opted in to (-1: never;
  // -2: a direct launch(), whose dynamic bytes are not checked against a GPU's rules: only
  // the 48 KiB of static arrays are).
  size_t dynamic = 0;
  int opted_in = -2;
  std::function<void()> body;
  std::string error;  // an exception a thread threw
};
inline Block* block = nullptr;
// The threads' stacks, kept from launch to launch by every kernel's launches (allocating
// them was most of a small launch's time, and under ASan each a fresh mapping).
inline thread_local std::vector<std::unique_ptr<char[]>> fiber_stacks;
inline unsigned char* dynamic_shared() { return block->shared; }
inline Fiber& running() { return block->fibers[static_cast<size_t>(block->current)]; }

#ifdef STRATA_EMULATION_FAST_SWITCH
// The scheduler into fiber f, until f leaves.
inline void enter(Fiber& f) {
#ifdef STRATA_EMULATION_ASAN_FIBERS
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
#endif
  strata_emulation_switch(&block->scheduler_sp, f.sp);
#ifdef STRATA_EMULATION_ASAN_FIBERS
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}
// The running fiber back to the scheduler, to be entered again (or not: `last`).
inline void leave(bool last) {
  Fiber& f = running();
  (void)last;
#ifdef STRATA_EMULATION_ASAN_FIBERS
  __sanitizer_start_switch_fiber(last ? nullptr : &f.fake, block->scheduler_bottom, block->scheduler_size);
#endif
  strata_emulation_switch(&f.sp, block->scheduler_sp);
#ifdef STRATA_EMULATION_ASAN_FIBERS
  __sanitizer_finish_switch_fiber(f.fake, nullptr, nullptr);
#endif
}
#endif

// A GPU's rules for static and dynamic shared memory together: at most 48 KiB of static
// arrays; a launch's dynamic bytes at most what its kernel was opted in to, or else 48 KiB
// less its static arrays; an opt-in and the static arrays at most 227 KiB together. (Here
// the static arrays are known only as a kernel's threads declare them, so this checks
// then: an opt-in that a GPU's cudaFuncSetAttribute would refuse already, for the static
// arrays beside it, is refused at the launch.)
inline void check_static_shared() {
  const size_t st = block->static_total;
  std::string why;
  if (st > static_cast<size_t>(kDefaultSharedBytes)) why = "static shared arrays past 48 KiB";
  else if (block->opted_in == -2) return;
  else if (block->opted_in == -1 && block->dynamic > static_cast<size_t>(kDefaultSharedBytes) - st)
    why = "static and dynamic shared memory past 48 KiB together without an opt-in";
  else if (block->opted_in >= 0 && st + static_cast<size_t>(block->opted_in) > static_cast<size_t>(kOptInSharedBytes))
    why = "an opt-in and the static shared arrays past 227 KiB together";
  if (!why.empty())
    throw std::runtime_error("emulated launch: " + std::to_string(st) + " bytes of static shared memory, " +
                             std::to_string(block->dynamic) + " dynamic: " + why + " (a GPU refuses it)");
}

// The k-th STRATA_SHARED array a thread meets is the block's k-th, made (0xFF bytes) by the
// first thread to meet it. (So a kernel declares its shared arrays once each, at its top,
// as every kernel here does: one declared in a loop or a function called twice would be a
// new array each time here and one array on a GPU.)
template <class T>
T& shared_var() {
  Fiber& f = running();
  const size_t k = f.statics++;
  if (k == block->statics.size()) {
    block->statics.push_back(shared_bytes(sizeof(T)));
    block->static_sizes.push_back(sizeof(T));
    block->static_total += sizeof(T);
    check_static_shared();
    std::memset(block->statics.back().get(), 0xFF, sizeof(T));
  } else if (k > block->statics.size() || block->static_sizes[k] != sizeof(T)) {
    throw std::runtime_error("STRATA_SHARED: threads of a block declare different shared arrays");
  }
  return *reinterpret_cast<T*>(block->statics[k].get());
}

// The running thread waits at barrier `id` until every thread it covers has arrived.
inline void arrive(int id) {
  Fiber& f = running();
  f.waits = id;
#ifdef STRATA_EMULATION_FAST_SWITCH
  leave(false);
#else
  swapcontext(&f.ctx, &block->scheduler);
#endif
}

// The running thread as (x, y, z) of its block, and the block.
inline std::string thread_name() {
  return "(" + std::to_string(threadIdx.x) + ", " + std::to_string(threadIdx.y) + ", " + std::to_string(threadIdx.z) +
         ") of block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " +
         std::to_string(blockIdx.z) + ")";
}

inline void fiber_main() {
  try {
    block->body();
  } catch (const std::exception& e) {
    if (block->error.empty()) block->error = "thread " + thread_name() + ": " + e.what();
  } catch (...) {
    if (block->error.empty()) block->error = "thread " + thread_name() + ": an exception";
  }
  running().done = true;
  // (returns to uc_link: the scheduler; fiber_entry switches to it)
}

#ifdef STRATA_EMULATION_FAST_SWITCH
// A fast-switch fiber's first frame: runs the body, then gives the stack back for good.
[[noreturn]] inline void fiber_entry() {
#ifdef STRATA_EMULATION_ASAN_FIBERS
  __sanitizer_finish_switch_fiber(nullptr, &block->scheduler_bottom, &block->scheduler_size);
#endif
  fiber_main();
  leave(true);
  __builtin_unreachable();
}
#endif

// Thread t's fiber, ready to run the block's body from the start (in a function of its own:
// getcontext is declared to return twice, as setjmp, which launch()'s loop counters would
// be warned about).
inline void start_fiber(Fiber* f, unsigned t, ucontext_t* scheduler) {
  f->idx = Dim3{t % blockDim.x, t / blockDim.x % blockDim.y, t / (blockDim.x * blockDim.y)};
  f->warp = t / 32;
  f->waits = -1;
  f->done = false;
  f->statics = 0;
#ifdef STRATA_EMULATION_FAST_SWITCH
  (void)scheduler;
#ifdef STRATA_EMULATION_ASAN_FIBERS
  // (A fiber's frames never return: whatever ASan poisoned on its stack last block goes.)
  __asan_unpoison_memory_region(f->stack, kStackBytes);
#endif
  // What strata_emulation_switch pops: six registers (zero), then fiber_entry as the return
  // address, entered with the stack pointer 8 past a 16-byte boundary, as after a call.
  const uintptr_t top = (reinterpret_cast<uintptr_t>(f->stack) + kStackBytes) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top - 64);
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[6] = reinterpret_cast<void*>(&fiber_entry);
  sp[7] = nullptr;
  f->sp = sp;
#else
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = f->stack;
  f->ctx.uc_stack.ss_size = kStackBytes;
  f->ctx.uc_link = scheduler;
  makecontext(&f->ctx, fiber_main, 0);
#endif
}

// The order a block's threads run in: each runnable thread in turn until it waits at a
// barrier, in thread order or in reverse, the barriers that every thread reached released
// after each round (warps in lockstep); or warps_ahead: warp by warp, each running on
// through its own __syncwarp barriers as far as it can (to a __syncthreads, or its end)
// before the next warp starts, as a warp scheduled early on a GPU may, so that a warp that
// reuses shared memory another has not finished reading shows.
// warps_ahead_last_first: the same from the last warp down (a warp overwriting what a
// lower one has still to read shows only so).
enum class Order { forward, reverse, warps_ahead, warps_ahead_last_first };
inline const char* to_string(Order o) {
  return o == Order::forward       ? "threads in order"
         : o == Order::reverse     ? "threads in reverse"
         : o == Order::warps_ahead ? "warps running ahead"
                                   : "warps running ahead, the last first";
}

// BoundLaunch's opt-in for its kernel while launch() runs (Block::opted_in: -1 none), else
// -2 (a direct launch()).
inline int launch_opted_in = -2;

// Runs kernel(args...) on every block of `grid`, of `block_dim` threads (a multiple of 32),
// with `shared` bytes of dynamic shared memory. Throws std::runtime_error for an exception
// in a kernel (a WMMA rule broken, __trap) or a barrier some threads never reach.
template <class Kernel, class... Args>
void launch(Order order, Dim3 grid, Dim3 block_dim, size_t shared, Kernel kernel, Args... args) {
  const unsigned threads = block_dim.x * block_dim.y * block_dim.z;
  if (threads == 0 || threads % 32 != 0) throw std::invalid_argument("launch: threads must be a multiple of 32");
  // A GPU's limits on a launch's shape (compute capability 8.0 and 9.0): refused there.
  if (threads > 1024 || block_dim.z > 64) throw std::invalid_argument("launch: at most 1024 threads a block, 64 along z");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
    throw std::invalid_argument("launch: a grid of 1 to 2^31 - 1 blocks along x, 1 to 65,535 along y and z");
  gridDim = grid;
  blockDim = block_dim;
  const unsigned warps = threads / 32;
  Block b;
  b.fibers.resize(threads);
  while (fiber_stacks.size() < threads) fiber_stacks.emplace_back(new char[kStackBytes]);
  for (unsigned t = 0; t < threads; ++t) b.fibers[t].stack = fiber_stacks[t].get();
  b.slots.resize(threads);
  std::vector<unsigned> at_warp(warps);  // (a round's count of the threads at each warp's barrier)
  // Exactly `shared` bytes, so that the sanitizers see an access past them.
  const SharedBytes mem = shared_bytes(shared);
  b.shared = mem.get();
  b.dynamic = shared;
  b.opted_in = launch_opted_in;
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
        for (size_t k = 0; k < b.statics.size(); ++k) std::memset(b.statics[k].get(), 0xFF, b.static_sizes[k]);
        for (unsigned t = 0; t < threads; ++t) start_fiber(&b.fibers[t], t, &b.scheduler);
        // Run every runnable thread in turn; then release each barrier all its threads
        // reached; stop when all are done, or none can move (a deadlock on a GPU).
        auto run = [&](unsigned t) {
          Fiber& f = b.fibers[t];
          if (f.done || f.waits >= 0) return;
          b.current = static_cast<int>(t);
          threadIdx = f.idx;
#ifdef STRATA_EMULATION_FAST_SWITCH
          enter(f);
#else
          swapcontext(&b.scheduler, &f.ctx);
#endif
          if (!b.error.empty()) throw std::runtime_error("emulated kernel: " + b.error);
        };
        for (;;) {
          if (order == Order::warps_ahead || order == Order::warps_ahead_last_first) {
            for (unsigned k = 0; k < warps; ++k) {
              const unsigned w = order == Order::warps_ahead_last_first ? warps - 1 - k : k;
              for (bool again = true; again;) {
                for (unsigned l = 0; l < 32; ++l) run(w * 32 + l);
                unsigned at = 0;
                for (unsigned l = 0; l < 32; ++l) at += b.fibers[w * 32 + l].waits == static_cast<int>(1 + w) ? 1 : 0;
                again = at == 32;
                if (again)
                  for (unsigned l = 0; l < 32; ++l) b.fibers[w * 32 + l].waits = -1;
              }
            }
          } else {
            for (unsigned k = 0; k < threads; ++k) run(order == Order::forward ? k : threads - 1 - k);
          }
          unsigned done = 0, at_block = 0;
          std::fill(at_warp.begin(), at_warp.end(), 0u);
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

// What STRATA_LAUNCH(kernel, grid, block, shared, stream)(args...) runs: launch() in
// launch_order (a test sets it; the stream is ignored: each launch is done when it returns).
inline Order launch_order = Order::forward;
// A kernel's pointer argument must point into device memory (check_device_pointers).
template <class A>
void check_argument(const A& a, int i) {
  if constexpr (std::is_pointer_v<A>) {
    if (a != nullptr && !on_device(a, 0))
      throw std::runtime_error("emulated launch: argument " + std::to_string(i) +
                               " points outside device memory (a host pointer where the kernel reads or writes "
                               "device memory: an illegal address on a GPU)");
  }
}
template <class Kernel>
struct BoundLaunch {
  Kernel kernel;
  Dim3 grid, block_dim;
  size_t shared;
  template <class... Args>
  void operator()(Args... args) const {
    if (check_device_pointers) {
      int i = 0;
      (check_argument(args, i++), ...);
    }
    const auto it = opted_in.find(reinterpret_cast<const void*>(kernel));
    const int opt = it == opted_in.end() ? -1 : it->second;  // (-1: never opted in)
    if (opt >= 0 ? static_cast<size_t>(opt) < shared : shared > static_cast<size_t>(kDefaultSharedBytes))
      throw std::runtime_error("emulated launch: " + std::to_string(shared) + " bytes of dynamic shared memory, " +
                               (opt >= 0 ? "past the " + std::to_string(opt) + " its kernel was opted in to"
                                         : std::string("past 48 KiB without the kernel opted in to as many")) +
                               " (cudaFuncSetAttribute; a GPU refuses the launch)");
    struct Opted {  // (the static arrays' check, in the launch; reset however it ends)
      explicit Opted(int v) { launch_opted_in = v; }
      ~Opted() { launch_opted_in = -2; }
    } opted(opt);
    launch(launch_order, grid, block_dim, shared, kernel, args...);
  }
};
template <class Kernel>
BoundLaunch<Kernel> bind_launch(Kernel kernel, Dim3 grid, Dim3 block_dim, size_t shared) {
  return BoundLaunch<Kernel>{kernel, grid, block_dim, shared};
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

#define STRATA_LAUNCH(kernel, grid, block, shared, stream) \
  (static_cast<void>(stream), ::strata::cuda_emu::bind_launch(kernel, grid, block, shared))
#define STRATA_SHARED(type, name, dims) auto& name = ::strata::cuda_emu::shared_var<type dims>()
#define STRATA_DYNAMIC_SHARED(name) unsigned char* name = ::strata::cuda_emu::dynamic_shared()

inline void __syncthreads() { strata::cuda_emu::arrive(0); }
inline void __syncwarp() { strata::cuda_emu::arrive(1 + static_cast<int>(strata::cuda_emu::running().warp)); }
// (float and double: exact through a double slot)
template <class T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "__shfl_xor_sync: float or double");
  strata::cuda_emu::Fiber& f = strata::cuda_emu::running();
  const unsigned lane = static_cast<unsigned>(strata::cuda_emu::block->current) % 32;
  double* s = strata::cuda_emu::block->slots.data() + f.warp * 32;
  s[lane] = static_cast<double>(v);
  __syncwarp();
  const T r = static_cast<T>(s[lane ^ static_cast<unsigned>(lane_mask)]);
  __syncwarp();
  return r;
}
inline void __trap() { throw std::runtime_error("__trap()"); }
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}

// The device math and conversion intrinsics the kernels call.
using std::isfinite;
using std::isnan;
// (rsqrtf through a name of its own: C23's libm may declare an rsqrtf of its own.)
inline float strata_emulated_rsqrtf(float x) { return 1.0f / std::sqrt(x); }
#define rsqrtf strata_emulated_rsqrtf
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline unsigned __float_as_uint(float v) {
  unsigned u;
  std::memcpy(&u, &v, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}
using __nv_bfloat16 = strata::cuda_emu::Bf16;
// Round to nearest even; a NaN as the canonical 0x7fff, as the GPU's conversion gives.
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fffu};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
using __half = _Float16;
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half __float2half_rn(float v) { return static_cast<__half>(v); }
inline unsigned short __half_as_ushort(__half h) {
  unsigned short u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  std::memcpy(&h, &u, 2);
  return h;
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
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
    throw std::runtime_error(std::string(what) + ": pointer not 32-byte aligned");
  if (ldm % multiple != 0)
    throw std::runtime_error(std::string(what) + ": leading dimension not a multiple of " + std::to_string(multiple));
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
  for (int i = block->current % 32; i < 256; i += 32) {  // this lane's share
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

// mma.h's name for it (flash_attention_tc.cu's `using namespace nvcuda`).
namespace nvcuda {
namespace wmma = ::strata::cuda_emu::wmma;
}
