// The NCCL communicator's entry points in a CUDA build without nccl.h at configure time:
// ranks on GPUs use the host-staged communicator.
#include "executor/cuda/nccl_comm.h"

namespace strata {

std::string nccl_unavailable_reason() {
  return "this strata was built without NCCL (nccl.h not found under /usr/local/cuda at configure time)";
}

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm>, CudaBackend&, bool) { return nullptr; }

}  // namespace strata
