// The CUDA backend's entry points in a build without CUDA (nvcc not found at configure time).
#include "executor/cuda/cuda_backend.h"

namespace strata {

std::string cuda_unavailable_reason() {
  return "this strata was built without CUDA (no /usr/local/cuda/bin/nvcc at configure time, or "
         "-DSTRATA_WITH_CUDA=OFF)";
}

int cuda_device_count() { return 0; }

std::unique_ptr<CudaBackend> make_cuda_backend(int) { return nullptr; }

}  // namespace strata
