// A communicator over buffers in another memory (a GPU's) through host staging: every call
// copies its input to a host buffer, runs the inner communicator (Open MPI) on the host
// buffers and copies the result back. Slower than NCCL, but it needs nothing from the
// device beyond copies, so several ranks sharing one GPU (which NCCL refuses) can run every
// parallel path of a plan on it (issue 5). Non-blocking calls keep their staging buffers
// until the request completes; the copy back happens in the test() or wait() that sees it
// complete.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "executor/comm.h"

namespace strata {

// How bytes move between the other memory and the host; both calls complete before they
// return (the result may be read, the source reused).
struct StagingCopier {
  std::function<void(void* host_dst, const void* dev_src, size_t bytes)> to_host;
  std::function<void(void* dev_dst, const void* host_src, size_t bytes)> to_device;
};

std::unique_ptr<Comm> make_staged_comm(std::unique_ptr<Comm> inner, StagingCopier copier);

}  // namespace strata
