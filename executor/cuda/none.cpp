// The CUDA backend's entry points in a build without CUDA (nvcc not found at configure time).
#include "executor/cuda/cuda_backend.h"
#include "executor/cuda/nccl_comm.h"

namespace strata {

std::string cuda_unavailable_reason() {
  return "this strata was built without CUDA (no /usr/local/cuda/bin/nvcc at configure time, or "
         "-DSTRATA_WITH_CUDA=OFF)";
}

int cuda_device_count() { return 0; }

std::unique_ptr<CudaBackend> make_cuda_backend(int) { return nullptr; }

size_t cublaslt_version() { return 0; }

std::string nccl_unavailable_reason() { return cuda_unavailable_reason(); }

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm>, CudaBackend&, bool) { return nullptr; }

}  // namespace strata
