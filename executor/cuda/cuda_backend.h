// The CUDA backend (issue 5): the ops of backend.h on device memory, GEMMs through cuBLASLt
// and the rest in hand-written kernels (one .cu file each). Its ops take DEVICE pointers;
// the executor keeps its buffers in the backend's memory, so `strata train --backend cuda`
// runs on it (with the host-staged communicator between ranks). Without CUDA at build
// time, or without a usable GPU at run time, make_cuda_backend() returns null and
// cuda_unavailable_reason() says why (the CLI turns that into exit 2).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "executor/backend.h"
#include "executor/cuda/limits.h"
#include "executor/staged_comm.h"
#include "executor/zero.h"

namespace strata {

class CudaBackend : public Backend {
 public:
  // Device memory for tests and tools (float elements, not zeroed; Backend::allocate zeroes);
  virtual float* device_alloc(int64_t n) = 0;
  virtual void device_free(float* p) = 0;
  // The copies of the host-staged communicator (executor/staged_comm.h): either side may
  // be device or host memory (cudaMemcpyDefault), complete on return.
  virtual StagingCopier staging_copier() = 0;
  virtual std::string device_name() const = 0;
  virtual std::string device_id() const = 0;  // the PCI bus id, e.g. "0000:19:00.0"
  // The stream every op runs on (a cudaStream_t) and the device ordinal, for a communicator
  // that orders its own streams after the ops (executor/cuda/nccl_comm.h).
  virtual void* compute_stream() const = 0;
  virtual int device_ordinal() const = 0;
  // Runs fn(arg) on a host thread once every op issued before it has run; ops issued after
  // it wait until it returns (cudaLaunchHostFunc). fn must not call CUDA. Tests hold the
  // stream with it to check what other streams wait for.
  virtual void enqueue_host_callback(void (*fn)(void*), void* arg) = 0;

  // GEMM operands from here on are converted to `p` (bf16 or fp16, round to nearest even)
  // and multiplied on the tensor cores with fp32 accumulation and an fp32 C; fp32 (the
  // default) multiplies them as they are in fp32 (no TF32). The executor rounds GEMM inputs
  // to its training precision already (round_to), so for it this changes the speed, not the
  // operands. The fused attention's products follow it (flash_attention_tc.cu: P and dS
  // rounded to `p` as well, as the unfused attention's batched GEMMs round theirs). fp8 is
  // refused (std::invalid_argument): its GEMMs need per-tensor scales.
  virtual void set_gemm_precision(Precision p) = 0;
  // Whether the fused attention of head dim D runs on the tensor cores at the GEMM
  // precision set now (flash_attention_tc.cu), rather than in fp32 on the CUDA cores.
  virtual bool flash_on_tensor_cores(int64_t D) const = 0;
  // "" where the fused attention of head dim D would run on the tensor cores at a 16-bit GEMM
  // precision; otherwise why not (STRATA_FLASH_TC=0, the head dim, the device or the build).
  virtual std::string flash_tensor_core_reason(int64_t D) const = 0;
  // The most bytes the 16-bit copies of one product's operands may take (default
  // kGemmScratchBytes): a larger product runs as parts of at most that much each (tests
  // lower it to check the parts).
  virtual void set_gemm_scratch_limit(size_t bytes) = 0;
  // The most bytes the unfused attention's S x S matrices take at once (default
  // cuda::kUnfusedAttentionWorkspaceBytes, the size the cost model charges its products
  // at): the query groups of one micro-batch row run as many to a batched product as fit, at
  // least one (attention_plan.h; tests lower it to check the passes).
  virtual void set_attention_workspace_limit(size_t bytes) = 0;
  // The most blocks the element-wise kernels over rows launch along y (reduce.cuh's
  // row_grid; default and at most 65,535, a GPU's limit): past it each thread steps
  // through several rows (tests lower it to check that). For the whole process.
  virtual void set_row_grid_limit(unsigned blocks) = 0;
};

// 256 MiB: a product needing more (the output layer's input and weight gradients with a
// large vocabulary: gpt2-124m's micro-batch of 8 made 0.90 GB of copies) runs in parts.
constexpr size_t kGemmScratchBytes = size_t{256} << 20;

// "" when a GPU is usable; otherwise the reason, e.g. "cudaGetDeviceCount returned error
// 35 (cudaErrorInsufficientDriver): no NVIDIA driver or GPU on this machine".
std::string cuda_unavailable_reason();
// The visible devices; 0 when unavailable.
int cuda_device_count();
// On device `local_rank % cuda_device_count()`: pass the rank among the processes of this
// machine, so they spread over its GPUs (with one GPU they share it). Null when unavailable.
std::unique_ptr<CudaBackend> make_cuda_backend(int local_rank = 0);
// cuBLASLt's version (cublasLtGetVersion) through the library as the first backend loads
// it (it is not linked: executor/cuda/cublaslt_api.h); needs no GPU. 0 in a build without
// CUDA; throws std::runtime_error when the library cannot be loaded.
size_t cublaslt_version();

}  // namespace strata
