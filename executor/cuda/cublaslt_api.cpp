// Loading cuBLASLt; see cublaslt_api.h.
#include "executor/cuda/cublaslt_api.h"

#include <dlfcn.h>

#include <stdexcept>
#include <type_traits>

namespace strata::cuda {
namespace {

// The loader's search path first (the library's soname, as a link would record it), then
// the file CMake found at configure time.
void* open_library() {
  for (const char* name : {STRATA_CUBLASLT_SONAME, STRATA_CUBLASLT_PATH})
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
  return nullptr;
}

LtApi load() {
  LtApi api;
  void* h = open_library();
  if (!h) {
    const char* e = dlerror();
    api.missing = std::string("cannot load " STRATA_CUBLASLT_SONAME " (") + (e ? e : "not found") + ")";
    return api;
  }
  auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (!fn && api.missing.empty()) api.missing = std::string(STRATA_CUBLASLT_SONAME " has no ") + name;
  };
  get(api.Create, "cublasLtCreate");
  get(api.Destroy, "cublasLtDestroy");
  get(api.GetVersion, "cublasLtGetVersion");
  get(api.GetStatusName, "cublasLtGetStatusName");
  get(api.GetStatusString, "cublasLtGetStatusString");
  get(api.Matmul, "cublasLtMatmul");
  get(api.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  get(api.MatmulDescCreate, "cublasLtMatmulDescCreate");
  get(api.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  get(api.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  get(api.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  get(api.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  get(api.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  get(api.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  get(api.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  get(api.MatrixLayoutSetAttribute, "cublasLtMatrixLayoutSetAttribute");
  return api;
}

}  // namespace

const LtApi& lt() {
  static const LtApi api = load();
  if (!api.missing.empty()) throw std::runtime_error("cuBLASLt: " + api.missing);
  return api;
}

}  // namespace strata::cuda
