// cuBLASLt, loaded when the first CUDA backend is made instead of linked: loading the
// library runs its initialisers, about 0.5 s and 100 MB of touched pages per process here,
// which every `strata` run paid, the CPU-only ones (plan, estimate, each rank of a CPU
// training run) included. The pointers have the types of cublasLt.h's declarations.
#pragma once

#ifdef STRATA_CUDA_EMULATION  // (the CPU emulation of cuBLASLt's names: tests/cublaslt_emulation.h)
#include "cublaslt_emulation.h"
#else
#include <cublasLt.h>
#endif

#include <string>

namespace strata::cuda {

struct LtApi {
  decltype(&::cublasLtCreate) Create = nullptr;
  decltype(&::cublasLtDestroy) Destroy = nullptr;
  decltype(&::cublasLtGetVersion) GetVersion = nullptr;
  decltype(&::cublasLtGetStatusName) GetStatusName = nullptr;
  decltype(&::cublasLtGetStatusString) GetStatusString = nullptr;
  decltype(&::cublasLtMatmul) Matmul = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
  decltype(&::cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute = nullptr;
  std::string missing;  // why the library could not be loaded; "" when it was
};

// The library, loaded on the first call (thread-safe); throws std::runtime_error naming the
// library and the loader's message when it or one of its functions is missing.
const LtApi& lt();

}  // namespace strata::cuda
