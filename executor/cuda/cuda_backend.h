// The CUDA backend (issue 5): the ops of backend.h on device memory, GEMMs through cuBLASLt
// and the rest in hand-written kernels (one .cu file each). Its ops take DEVICE pointers;
// the executor (which keeps host buffers) does not run on it yet. Without CUDA at build
// time, or without a usable GPU at run time, make_cuda_backend() returns null and
// cuda_unavailable_reason() says why (the CLI turns that into exit 2).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "executor/backend.h"

namespace strata {

class CudaBackend : public Backend {
 public:
  // Device memory for tests and tools (float elements); synchronise() waits for the stream.
  virtual float* device_alloc(int64_t n) = 0;
  virtual void device_free(float* p) = 0;
  virtual void to_device(float* dst, const float* src, int64_t n) = 0;
  virtual void to_host(float* dst, const float* src, int64_t n) = 0;
  virtual void synchronise() = 0;
  virtual std::string device_name() const = 0;
};

// "" when a GPU is usable; otherwise the reason, e.g. "cudaGetDeviceCount returned error
// 35 (cudaErrorInsufficientDriver): no NVIDIA driver or GPU on this machine".
std::string cuda_unavailable_reason();
std::unique_ptr<CudaBackend> make_cuda_backend();  // null when unavailable

}  // namespace strata
