// Every CUDA runtime and cuBLAS call of the CUDA backend goes through these: a failure
// throws std::runtime_error naming the call, the file, the line and the library's message
// (the CLI turns it into "strata: internal error" and aborts every rank).
#pragma once

#ifndef STRATA_CUDA_EMULATION  // (tests/cuda_emulation.h: the kernels on the CPU)
#include <cuda_runtime_api.h>
#endif

#include <mutex>
#include <stdexcept>
#include <string>

namespace strata::cuda {

[[noreturn]] inline void fail(const char* what, const char* file, int line, const std::string& msg) {
  throw std::runtime_error(std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " + msg);
}

}  // namespace strata::cuda

#define CUDA_CHECK(call)                                                                      \
  do {                                                                                        \
    const cudaError_t cuda_check_rc_ = (call);                                                \
    if (cuda_check_rc_ != cudaSuccess)                                                        \
      ::strata::cuda::fail(#call, __FILE__, __LINE__,                                         \
                           std::string(cudaGetErrorName(cuda_check_rc_)) + " (" +             \
                               std::to_string(static_cast<int>(cuda_check_rc_)) + "): " +     \
                               cudaGetErrorString(cuda_check_rc_));                           \
  } while (0)

// After a kernel launch: the launch error now (bad configuration), not the kernel's result.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

// A kernel launch, kernel<<<grid, block, shared, stream>>>(args...) as
// STRATA_LAUNCH(kernel, grid, block, shared, stream)(args...), and a kernel's shared array,
// `__shared__ type name dims` as STRATA_SHARED(type, name, dims): the CPU emulation of the
// kernels (tests/cuda_emulation.h, cuda_kernels_emulation_test) defines them its own way.
#ifndef STRATA_LAUNCH
#define STRATA_LAUNCH(kernel, grid, block, shared, stream) kernel<<<grid, block, shared, stream>>>
#endif
#ifndef STRATA_SHARED
#define STRATA_SHARED(type, name, dims) __shared__ type name dims
#endif
// A kernel's dynamic shared memory, `unsigned char name[]` aligned to 128 bytes.
#ifndef STRATA_DYNAMIC_SHARED
#define STRATA_DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif

namespace strata::cuda {

// Opts `kernel` in to `bytes` of dynamic shared memory a block (past the 48 KiB a launch gets
// without) on the current device, where it has not been for as many: the attribute belongs
// to the device's context, and ranks in one process may launch from several host threads,
// a device each. largest[dev]: the most asked for so far on device dev (a launcher's own
// static array, zero to begin with).
constexpr int kMaxDevices = 64;
template <class Kernel>
void opt_in_shared(Kernel kernel, int bytes, int* largest) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const bool tracked = dev >= 0 && dev < kMaxDevices;
  static std::mutex mu;
  const std::lock_guard<std::mutex> lock(mu);
  if (tracked && bytes <= largest[dev]) return;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (tracked) largest[dev] = bytes;
}

}  // namespace strata::cuda
