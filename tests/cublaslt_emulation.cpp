// The emulated cuBLASLt (see cublaslt_emulation.h) and the loader's lt() of the emulated CUDA
// backend (executor/cuda/cublaslt_api.h; built with the emulated kernels, namespace
// strata::cuda_emulated), which hands out these functions instead of the library's.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "executor/cuda/cublaslt_api.h"

namespace {

constexpr uint64_t kAlgoMark = 0x5354524154414c54ull;

template <class T>
cublasStatus_t read_attribute(T* out, const void* buf, size_t size) {
  if (buf == nullptr || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(out, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

// op(X)'s rows and columns for a layout under an operation.
struct Shape {
  uint64_t rows, cols;
};
Shape op_shape(const cublasLtMatrixLayoutOpaque_t& l, int32_t op) {
  return op == CUBLAS_OP_T ? Shape{l.cols, l.rows} : Shape{l.rows, l.cols};
}

float element(const void* p, cudaDataType_t type, int64_t i) {
  if (type == CUDA_R_32F) return static_cast<const float*>(p)[i];
  if (type == CUDA_R_16F) return static_cast<float>(static_cast<const _Float16*>(p)[i]);
  return strata::cuda_emu::to_float(static_cast<const strata::cuda_emu::Bf16*>(p)[i]);
}
size_t element_bytes(cudaDataType_t type) { return type == CUDA_R_32F ? 4 : 2; }
float rounded(float v, cublasComputeType_t compute) {
  if (compute == CUBLAS_COMPUTE_32F_FAST_16BF) return strata::cuda_emu::to_float(__float2bfloat16_rn(v));
  if (compute == CUBLAS_COMPUTE_32F_FAST_16F) return static_cast<float>(static_cast<_Float16>(v));
  return v;
}

bool aligned(const void* p, uint64_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

// What an algorithm is chosen for: the compute type, the operations, the types, m, n, k and
// the batch, hashed.
uint64_t signature(const cublasLtMatmulDescOpaque_t& desc, const cublasLtMatrixLayoutOpaque_t& a,
                   const cublasLtMatrixLayoutOpaque_t& b, const cublasLtMatrixLayoutOpaque_t& c) {
  const Shape oa = op_shape(a, desc.transa), ob = op_shape(b, desc.transb);
  const uint64_t parts[] = {static_cast<uint64_t>(desc.compute), static_cast<uint64_t>(desc.transa),
                            static_cast<uint64_t>(desc.transb), static_cast<uint64_t>(a.type), c.rows, c.cols, oa.cols,
                            ob.rows, static_cast<uint64_t>(a.batch)};
  uint64_t h = 1469598103934665603ull;
  for (uint64_t x : parts) h = (h ^ x) * 1099511628211ull;
  return h;
}

// The bytes a layout's matrices span from p (the last batch's last column, its rows).
std::pair<uintptr_t, uintptr_t> extent(const void* p, const cublasLtMatrixLayoutOpaque_t& l) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  const uint64_t last = static_cast<uint64_t>(l.batch - 1) * static_cast<uint64_t>(l.stride) +
                        (l.cols - 1) * static_cast<uint64_t>(l.ld) + l.rows;
  return {lo, lo + last * element_bytes(l.type)};
}
bool overlaps(const void* p, const cublasLtMatrixLayoutOpaque_t& lp, const void* q,
              const cublasLtMatrixLayoutOpaque_t& lq) {
  if (lp.rows == 0 || lp.cols == 0 || lq.rows == 0 || lq.cols == 0) return false;
  const auto [p0, p1] = extent(p, lp);
  const auto [q0, q1] = extent(q, lq);
  return p0 < q1 && q0 < p1;
}

}  // namespace

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = new cublasLtContext{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
size_t cublasLtGetVersion() { return 130100; }
const char* cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
const char* cublasLtGetStatusString(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS ? "success" : "the emulated cuBLASLt refused the call";
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale_type) {
  if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_16F && compute != CUBLAS_COMPUTE_32F_FAST_16BF)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (scale_type != CUDA_R_32F) return CUBLAS_STATUS_INVALID_VALUE;  // fp32 scales for the 32F compute types
  *desc = new cublasLtMatmulDescOpaque_t{compute};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  int32_t op = 0;
  if (const cublasStatus_t rc = read_attribute(&op, buf, size); rc != CUBLAS_STATUS_SUCCESS) return rc;
  if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATMUL_DESC_TRANSA) desc->transa = op;
  else if (attr == CUBLASLT_MATMUL_DESC_TRANSB) desc->transb = op;
  else return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType_t type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (type != CUDA_R_32F && type != CUDA_R_16F && type != CUDA_R_16BF) return CUBLAS_STATUS_NOT_SUPPORTED;
  *layout = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t size) {
  if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT) return read_attribute(&layout->batch, buf, size);
  if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET) return read_attribute(&layout->stride, buf, size);
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  *pref = new cublasLtMatmulPreferenceOpaque_t{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) return read_attribute(&pref->workspace, buf, size);
  if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
    uint32_t a = 0;
    if (const cublasStatus_t rc = read_attribute(&a, buf, size); rc != CUBLAS_STATUS_SUCCESS) return rc;
    if (a == 0 || (a & (a - 1)) != 0) return CUBLAS_STATUS_INVALID_VALUE;
    pref->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = a;
    return CUBLAS_STATUS_SUCCESS;
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t* results, int* returned) {
  *returned = 0;
  if (!handle || !desc || !a || !b || !c || !d || !pref || requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  const Shape oa = op_shape(*a, desc->transa), ob = op_shape(*b, desc->transb);
  if (oa.cols != ob.rows || c->rows != oa.rows || c->cols != ob.cols || d->rows != c->rows || d->cols != c->cols)
    return CUBLAS_STATUS_INVALID_VALUE;
  for (const cublasLtMatrixLayoutOpaque_t* l : {a, b, c, d})
    if (l->ld < static_cast<int64_t>(l->rows) || l->ld < 1 || l->batch < 1) return CUBLAS_STATUS_INVALID_VALUE;
  if (a->batch != b->batch || a->batch != c->batch || a->batch != d->batch) return CUBLAS_STATUS_INVALID_VALUE;
  if (a->type != b->type || c->type != CUDA_R_32F || d->type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (desc->compute != CUBLAS_COMPUTE_32F && a->type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  // (STRATA_EMULATED_CUBLASLT_NO_FAST=1: no kernel for the FAST compute types, as a GPU's
  // cuBLASLt may answer, so the backend's fallback to exact fp32 runs.)
  const char* no_fast = std::getenv("STRATA_EMULATED_CUBLASLT_NO_FAST");
  if (desc->compute != CUBLAS_COMPUTE_32F && no_fast != nullptr && std::string(no_fast) == "1")
    return CUBLAS_STATUS_NOT_SUPPORTED;
  cublasLtMatmulHeuristicResult_t r{};
  r.algo.data[0] = kAlgoMark;
  for (int i = 0; i < 4; ++i) r.algo.data[1 + i] = pref->align[i];
  r.algo.data[5] = signature(*desc, *a, *b, *c);
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  results[0] = r;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b, const void* beta,
                              const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                              cudaStream_t) {
  if (!handle || !desc || !algo || algo->data[0] != kAlgoMark) return CUBLAS_STATUS_INVALID_VALUE;
  // The algorithm was chosen for this operation and these shapes; D is C's layout where it is
  // C's buffer, and overlaps neither A nor B.
  if (algo->data[5] != signature(*desc, *a, *b, *c)) return CUBLAS_STATUS_INVALID_VALUE;
  if (C == D && (c->type != d->type || c->rows != d->rows || c->cols != d->cols || c->ld != d->ld ||
                 c->batch != d->batch || c->stride != d->stride))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (overlaps(D, *d, A, *a) || overlaps(D, *d, B, *b)) return CUBLAS_STATUS_INVALID_VALUE;
  // The pointers and batch offsets as aligned as the algorithm was chosen for.
  const void* ptrs[4] = {A, B, C, D};
  const cublasLtMatrixLayoutOpaque_t* ls[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    const uint64_t al = algo->data[1 + i];
    if (!aligned(ptrs[i], al) ||
        (ls[i]->batch > 1 && (static_cast<uint64_t>(ls[i]->stride) * element_bytes(ls[i]->type)) % al != 0))
      return CUBLAS_STATUS_INVALID_VALUE;
  }
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  // The operands, whole, and the workspace in device memory (cuda_emulation.h's
  // check_device_pointers; C only where it is read: beta != 0).
  if (strata::cuda_emu::check_device_pointers) {
    auto whole = [](const void* p, const cublasLtMatrixLayoutOpaque_t& l) {
      if (l.rows == 0 || l.cols == 0) return true;
      const auto [lo, hi] = extent(p, l);
      return strata::cuda_emu::on_device(p, hi - lo);
    };
    const char* bad = !whole(A, *a)                  ? "A"
                      : !whole(B, *b)                ? "B"
                      : be != 0.0f && !whole(C, *c)  ? "C"
                      : !whole(D, *d)                ? "D"
                      : workspace_bytes > 0 && !strata::cuda_emu::on_device(workspace, workspace_bytes) ? "the workspace"
                                                     : nullptr;
    if (bad != nullptr) {
      std::fprintf(stderr, "emulated cublasLtMatmul: %s not (wholly) in device memory\n", bad);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  const Shape oa = op_shape(*a, desc->transa), ob = op_shape(*b, desc->transb);
  const int64_t m = static_cast<int64_t>(oa.rows), k = static_cast<int64_t>(oa.cols), n = static_cast<int64_t>(ob.cols);
  std::vector<float> ra(static_cast<size_t>(m * k)), rb(static_cast<size_t>(n * k));  // op(A) by rows, op(B) by columns
  for (int32_t q = 0; q < a->batch; ++q) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t l = 0; l < k; ++l) {
        const int64_t at = q * a->stride + (desc->transa == CUBLAS_OP_T ? l + i * a->ld : i + l * a->ld);
        ra[static_cast<size_t>(i * k + l)] = rounded(element(A, a->type, at), desc->compute);
      }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t l = 0; l < k; ++l) {
        const int64_t at = q * b->stride + (desc->transb == CUBLAS_OP_T ? j + l * b->ld : l + j * b->ld);
        rb[static_cast<size_t>(j * k + l)] = rounded(element(B, b->type, at), desc->compute);
      }
    const float* cq = static_cast<const float*>(C) + q * c->stride;
    float* dq = static_cast<float*>(D) + q * d->stride;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        float s = 0.0f;
        const float* x = ra.data() + i * k;
        const float* y = rb.data() + j * k;
        for (int64_t l = 0; l < k; ++l) s += x[l] * y[l];
        const float prior = be == 0.0f ? 0.0f : be * cq[i + j * c->ld];  // (beta 0: C not read)
        dq[i + j * d->ld] = al * s + prior;
      }
  }
  return CUBLAS_STATUS_SUCCESS;
}

namespace strata::cuda {

const LtApi& lt() {
  static const LtApi api = [] {
    LtApi x;
    x.Create = &::cublasLtCreate;
    x.Destroy = &::cublasLtDestroy;
    x.GetVersion = &::cublasLtGetVersion;
    x.GetStatusName = &::cublasLtGetStatusName;
    x.GetStatusString = &::cublasLtGetStatusString;
    x.Matmul = &::cublasLtMatmul;
    x.MatmulAlgoGetHeuristic = &::cublasLtMatmulAlgoGetHeuristic;
    x.MatmulDescCreate = &::cublasLtMatmulDescCreate;
    x.MatmulDescDestroy = &::cublasLtMatmulDescDestroy;
    x.MatmulDescSetAttribute = &::cublasLtMatmulDescSetAttribute;
    x.MatmulPreferenceCreate = &::cublasLtMatmulPreferenceCreate;
    x.MatmulPreferenceDestroy = &::cublasLtMatmulPreferenceDestroy;
    x.MatmulPreferenceSetAttribute = &::cublasLtMatmulPreferenceSetAttribute;
    x.MatrixLayoutCreate = &::cublasLtMatrixLayoutCreate;
    x.MatrixLayoutDestroy = &::cublasLtMatrixLayoutDestroy;
    x.MatrixLayoutSetAttribute = &::cublasLtMatrixLayoutSetAttribute;
    return x;
  }();
  return api;
}

}  // namespace strata::cuda
