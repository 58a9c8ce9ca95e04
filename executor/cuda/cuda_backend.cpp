// The CUDA backend (see cuda_backend.h): one stream, one cuBLASLt handle with a 32 MiB
// workspace. Row-major GEMMs run as the column-major product C^T = op(B)^T op(A)^T, in
// fp32 or, after set_gemm_precision, on 16-bit copies of the operands (cast.cu).
#include "executor/cuda/cuda_backend.h"

#ifndef STRATA_CUDA_EMULATION  // (tests/cuda_emulation.h: this backend on the CPU)
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "executor/cuda/attention_plan.h"
#include "executor/cuda/check.h"
#include "executor/cuda/cublaslt_api.h"
#include "executor/cuda/kernels.h"
#include "executor/memory_tracker.h"

#define CUBLAS_CHECK(call)                                                                          \
  do {                                                                                              \
    const cublasStatus_t cublas_check_rc_ = (call);                                                 \
    if (cublas_check_rc_ != CUBLAS_STATUS_SUCCESS)                                                  \
      ::strata::cuda::fail(#call, __FILE__, __LINE__,                                               \
                           std::string(::strata::cuda::lt().GetStatusName(cublas_check_rc_)) +      \
                               ": " + ::strata::cuda::lt().GetStatusString(cublas_check_rc_));      \
  } while (0)

namespace strata {
namespace {

// The cuBLASLt objects of one GEMM, destroyed however the call ends.
struct LtObjects {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtObjects() = default;
  LtObjects(const LtObjects&) = delete;
  LtObjects& operator=(const LtObjects&) = delete;
  ~LtObjects() {
    if (pref) cuda::lt().MatmulPreferenceDestroy(pref);
    if (lc) cuda::lt().MatrixLayoutDestroy(lc);
    if (lb) cuda::lt().MatrixLayoutDestroy(lb);
    if (la) cuda::lt().MatrixLayoutDestroy(la);
    if (desc) cuda::lt().MatmulDescDestroy(desc);
  }
};

// The largest power of two (at most 256) dividing the address and, in a batch, the byte
// offset between its matrices.
uint32_t alignment(const void* p, uint64_t batch_offset_bytes = 0) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 4 && ((a % al) != 0 || (batch_offset_bytes % al) != 0)) al /= 2;
  return al;
}

using attention_plan::Batch;  // a batch of products for matmul()

class CudaBackendImpl final : public CudaBackend {
 public:
  explicit CudaBackendImpl(int device) {
    try {
      init(device);
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
  }
  ~CudaBackendImpl() override { release(); }

 private:
  void init(int device) {
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUBLAS_CHECK(cuda::lt().Create(&lt_));
    CUDA_CHECK(cudaMalloc(&workspace_, kWorkspace));
    cudaDeviceProp prop{};
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    name_ = prop.name;
    dev_ = dev;
    const char* tc = std::getenv("STRATA_FLASH_TC");
    for (int64_t D : {16, 32, 64, 128})
      flash_tc_why_[D / 32] = tc != nullptr && std::string(tc) == "0" ? "STRATA_FLASH_TC=0"
                                                                       : cuda::flash_tc_unavailable_reason(D, dev);
    char bus[32] = {};
    CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), dev));
    bus_id_ = bus;
    // A stream-ordered pool per memory category: freeing returns memory to the pool without
    // stalling the device, and each pool keeps its peak in use (cudaMemPoolAttrUsedMemHigh).
    // Where the device, the driver or a sandboxed runtime offers no such pools (or
    // STRATA_CUDA_POOLS=0 asks), plain cudaMalloc / cudaFree serve every category instead,
    // and the backend counts each category's bytes in use and their peak itself.
    const char* env = std::getenv("STRATA_CUDA_POOLS");
    const bool asked_plain = env != nullptr && std::string(env) == "0";
    int pools_supported = 0;
    std::string why = asked_plain ? "STRATA_CUDA_POOLS=0" : "";
    if (!asked_plain) {
      const cudaError_t rc = cudaDeviceGetAttribute(&pools_supported, cudaDevAttrMemoryPoolsSupported, dev);
      if (rc != cudaSuccess || !pools_supported)
        why = rc != cudaSuccess ? cudaGetErrorName(rc) : "cudaDevAttrMemoryPoolsSupported is 0";
    }
    for (cudaMemPool_t& pool : pools_) {
      if (!why.empty()) break;
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = dev;
      cudaError_t rc = cudaMemPoolCreate(&pool, &props);
      if (rc == cudaSuccess) {
        uint64_t keep = UINT64_MAX;  // never hand freed memory back to the driver mid-run
        rc = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      }
      if (rc != cudaSuccess) why = std::string("cudaMemPoolCreate: ") + cudaGetErrorName(rc);
    }
    if (!why.empty()) {
      (void)cudaGetLastError();  // clear a failed pool call's error
      for (cudaMemPool_t& pool : pools_) {
        if (pool) cudaMemPoolDestroy(pool);
        pool = nullptr;
      }
      pooled_ = false;
      std::fprintf(stderr, "strata: no stream-ordered memory pools on %s (%s): plain cudaMalloc, peaks per category "
                   "counted by the backend\n", name_.c_str(), why.c_str());
    }
  }
  // Frees what init() got, in reverse; unchecked (destructor and failed-constructor path).
  void release() {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      for (void* p : {static_cast<void*>(acc_), scratch_.p, delta_.p, attn_.p}) pool_free(p);
      cudaStreamSynchronize(stream_);
    }
    acc_ = nullptr;
    scratch_ = delta_ = attn_ = Grown{};
    for (cudaMemPool_t& pool : pools_) {
      if (pool) cudaMemPoolDestroy(pool);
      pool = nullptr;
    }
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    events_.clear();
    if (workspace_) cudaFree(workspace_);
    algos_.clear();  // their descriptors before the handle
    if (lt_) cuda::lt().Destroy(lt_);
    if (stream_) cudaStreamDestroy(stream_);
    workspace_ = nullptr;
    lt_ = nullptr;
    stream_ = nullptr;
  }

 public:
  const char* name() const override { return "cuda"; }
  bool batched_gemm_per_matrix() const override { return false; }  // one strided-batched cuBLASLt call
  std::string device_name() const override { return name_; }
  std::string device_id() const override { return bus_id_; }
  void* compute_stream() const override { return stream_; }
  int device_ordinal() const override { return dev_; }
  void enqueue_host_callback(void (*fn)(void*), void* arg) override { CUDA_CHECK(cudaLaunchHostFunc(stream_, fn, arg)); }

  float* device_alloc(int64_t n) override {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(n > 0 ? n : 1) * sizeof(float)));
    return static_cast<float*>(p);
  }
  void device_free(float* p) override { CUDA_CHECK(cudaFree(p)); }
  float* allocate(int64_t n) override { return allocate_in(n, kMemPools - 1); }
  float* allocate_in(int64_t n, int pool) override {
    if (n <= 0) return nullptr;
    auto* p = static_cast<float*>(pool_alloc(static_cast<size_t>(n) * sizeof(float), pool));
    CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(n) * sizeof(float), stream_));
    return p;
  }
  float* allocate_uninitialised_in(int64_t n, int pool) override {
    return n <= 0 ? nullptr : static_cast<float*>(pool_alloc(static_cast<size_t>(n) * sizeof(float), pool));
  }
  void deallocate(float* p) override {
    // Called from Buf's destructor: no throwing; a failure shows in the next checked call.
    // Stream-ordered: the memory is reused only by work queued after this point.
    pool_free(p);
  }
  void fill_zero(float* p, int64_t n) override {
    if (n > 0) CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(n) * sizeof(float), stream_));
  }
  void to_device(float* dst, const float* src, int64_t n) override {
    if (n <= 0) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void to_host(float* dst, const float* src, int64_t n) override {
    if (n <= 0) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void synchronise() override { CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  // Per-op times: an event on the stream per stamp (kept and reused after reset_marks),
  // read once the stream has synchronised; seconds from the first stamp.
  int64_t mark() override {
    if (used_events_ == events_.size()) {
      cudaEvent_t e = nullptr;
      CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    CUDA_CHECK(cudaEventRecord(events_[used_events_], stream_));
    return static_cast<int64_t>(used_events_++);
  }
  double mark_seconds(int64_t i) override {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[static_cast<size_t>(i)]));
    return static_cast<double>(ms) / 1e3;
  }
  void reset_marks() override { used_events_ = 0; }
  bool device_memory(DeviceMemory* out) override {
    CUDA_CHECK(cudaSetDevice(dev_));  // cudaMemGetInfo reports the current device
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    out->free = static_cast<int64_t>(free);
    out->total = static_cast<int64_t>(total);
    for (int i = 0; i < kMemPools && !pooled_; ++i) out->used_peak[i] = out->reserved_peak[i] = plain_peak_[i];
    for (int i = 0; i < kMemPools && pooled_; ++i) {
      uint64_t used = 0, reserved = 0;
      CUDA_CHECK(cudaMemPoolGetAttribute(pools_[i], cudaMemPoolAttrUsedMemHigh, &used));
      CUDA_CHECK(cudaMemPoolGetAttribute(pools_[i], cudaMemPoolAttrReservedMemHigh, &reserved));
      out->used_peak[i] = static_cast<int64_t>(used);
      out->reserved_peak[i] = static_cast<int64_t>(reserved);
    }
    // gemm16's copies (up to scratch_limit_, A's 256-byte aligned) and the unfused
    // attention's S x S matrices (attention_limit_, twice in a backward that recomputes
    // the probabilities beside dS; at least one group's, which sequences past 4096 exceed),
    // less what they hold already.
    const size_t bound = scratch_limit_ + 256 + 2 * static_cast<size_t>(attention_limit_);
    const size_t held = scratch_.size + attn_.size;
    out->workspace_growth = bound > held ? static_cast<int64_t>(bound - held) : 0;
    return true;
  }
  StagingCopier staging_copier() override {
    auto copy = [this](void* dst, const void* src, size_t bytes) {
      if (bytes == 0) return;
      CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    };
    return StagingCopier{copy, copy};
  }
  void* allocate_bytes(size_t bytes) override { return pool_alloc(bytes > 0 ? bytes : 1, kMemPools - 1); }
  void deallocate_bytes(void* p) override {
    pool_free(p);  // from destructors: no throwing
  }
  void bytes_to_device(void* dst, const void* host_src, size_t bytes) override {
    if (bytes == 0) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }


  void adamw(float* p, const float* g, float* m, float* v, FlagBits decay, int64_t n, const AdamW& opt, double lr,
             int64_t step, float grad_mul) override {
    const cuda::AdamWScalars k =
        cuda::adamw_scalars(opt.beta1, opt.beta2, opt.eps, opt.weight_decay, lr, step, grad_mul);
    cuda::adamw(p, g, m, v, decay.bits, decay.first, n, k, stream_);
  }
  void grad_norm_terms(const float* g, FlagBits counted, int64_t n, double acc[2]) override {
    if (acc_ == nullptr) acc_ = static_cast<double*>(allocate_bytes(2 * sizeof(double)));
    CUDA_CHECK(cudaMemsetAsync(acc_, 0, 2 * sizeof(double), stream_));
    cuda::grad_norm_terms(g, counted.bits, counted.first, n, acc_, stream_);
    double h[2] = {0, 0};
    CUDA_CHECK(cudaMemcpyAsync(h, acc_, sizeof(h), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    acc[0] += h[0];
    acc[1] += h[1];
  }
  void copy(float* dst, const float* src, int64_t n) override {
    if (n > 0)
      CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  void add(float* out, const float* a, const float* b, int64_t n, Precision round) override {
    cuda::add(out, a, b, n, round_kind(round), stream_);
  }
  void add_bias(float* y, const float* b, int64_t N, int64_t F, Precision round) override {
    cuda::add_bias(y, b, N, F, round_kind(round), stream_);
  }
  void bias_grad(float* db, const float* dy, int64_t N, int64_t F) override { cuda::bias_grad(db, dy, N, F, stream_); }
  void add_positions(float* out, const float* x, const float* P, int64_t n, int64_t H, int64_t B,
                     int64_t row0) override {
    cuda::add_positions(out, x, P, n, H, B, row0, stream_);
  }
  void position_grad(float* dP, const float* dx, int64_t n, int64_t H, int64_t B, int64_t row0) override {
    cuda::position_grad(dP, dx, n, H, B, row0, stream_);
  }
  void embedding_forward(float* x, const float* wte, const int32_t* tokens, int64_t S, int64_t B, int64_t H, int64_t lo,
                         int64_t Vt) override {
    cuda::embedding_forward(x, wte, tokens, S, B, H, lo, Vt, stream_);
  }
  void embedding_backward(float* dwte, const float* dx, const int32_t* tokens, int64_t S, int64_t B, int64_t H,
                          int64_t lo, int64_t Vt) override {
    cuda::embedding_backward(dwte, dx, tokens, S, B, H, lo, Vt, stream_);
  }

  void set_gemm_precision(Precision p) override {
    if (p == Precision::fp8)
      throw std::invalid_argument("the CUDA backend's GEMMs take fp32, bf16 or fp16 operands, not fp8");
    gemm_precision_ = p;
  }

  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
            const float* B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    if (M == 0 || N == 0) return;
    if (K == 0) {  // C = beta * C, as on the CPU
      cuda::scale_matrix(C, M, N, ldc, beta, stream_);
      return;
    }
    if (gemm_precision_ == Precision::fp32) {
      matmul(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, CUDA_R_32F);
      return;
    }
    gemm16(ta, tb, M, N, K, alpha, Operand::floats(A), lda, Operand::floats(B), ldb, beta, C, ldc);
  }
  // 16-bit operands of the GEMM precision, their rows 16-byte aligned (as the operand copies
  // are: what the tensor-core kernels want; the executor's row widths are multiples of 8),
  // go to cuBLASLt as they are: no cast, no copy. Others (fp32 products, the other 16-bit
  // type, rows not so aligned) as the default unpacks them, then cast like any float operand.
  bool gemm_reads_16bit() const override { return true; }
  void gemm_mixed(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Operand A, int64_t lda,
                  Operand B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    auto native = [&](const Operand& x, int64_t ld) {
      return !x.is_16bit() || (sixteen_kind(x.type) == sixteen_kind(gemm_precision_) &&
                               reinterpret_cast<uintptr_t>(x.p) % 16 == 0 && ld % 8 == 0);
    };
    if (gemm_precision_ == Precision::fp32 || !native(A, lda) || !native(B, ldb) || K == 0 || M == 0 || N == 0) {
      Backend::gemm_mixed(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
      return;
    }
    gemm16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void set_gemm_scratch_limit(size_t bytes) override { scratch_limit_ = std::max<size_t>(bytes, 4096); }
  void set_attention_workspace_limit(size_t bytes) override { attention_limit_ = static_cast<int64_t>(bytes); }
  void set_row_grid_limit(unsigned blocks) override { cuda::set_row_grid_limit(blocks); }
  // 16-bit copies of the float operands in the scratch buffer, rows padded to 8 elements
  // (16 bytes, what the fast tensor-core kernels want) and B's copy 256-byte aligned after
  // A's; a 16-bit operand (gemm_mixed) is read where it is, with its own row stride; then the
  // same product on them. Copies over scratch_limit_ bytes: the product in two halves, each
  // again so if still too large (the stream runs each half's casts after the previous
  // half's product has read the scratch): C's rows where A's copy is the larger (A's rows,
  // or its columns when transposed), else C's columns (B's), else the other operand's where
  // it has a copy; otherwise the shared dimension K, the second half adding into the first's
  // C. A half of 16 or more splits at a multiple of 8, so a 16-bit operand's part starts
  // 16-byte aligned too.
  void gemm16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Operand A, int64_t lda,
              Operand B, int64_t ldb, float beta, float* C, int64_t ldc) {
    const int kind = sixteen_kind(gemm_precision_);
    const int64_t rows_a = ta ? K : M, cols_a = ta ? M : K, rows_b = tb ? N : K, cols_b = tb ? K : N;
    const int64_t ld_a = A.is_16bit() ? lda : (cols_a + 7) / 8 * 8, ld_b = B.is_16bit() ? ldb : (cols_b + 7) / 8 * 8;
    const size_t bytes_a = A.is_16bit() ? 0 : (static_cast<size_t>(rows_a * ld_a) * 2 + 255) / 256 * 256;
    const size_t bytes_b = B.is_16bit() ? 0 : static_cast<size_t>(rows_b * ld_b) * 2;
    if (bytes_a + bytes_b > scratch_limit_ && (M > 1 || N > 1 || K > 1)) {
      const bool a_first = bytes_a >= bytes_b;  // (the larger copy is A's; with both 16-bit none is)
      const bool split_m = M > 1 && (a_first || (N == 1 && bytes_a > 0));
      const bool split_n = !split_m && N > 1 && (!a_first || bytes_b > 0);
      auto half = [](int64_t d) { return d >= 16 ? d / 2 / 8 * 8 : d / 2; };
      if (split_m) {
        const int64_t h = half(M);
        gemm16(ta, tb, h, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        gemm16(ta, tb, M - h, N, K, alpha, A.offset(ta ? h : h * lda), lda, B, ldb, beta, C + h * ldc, ldc);
      } else if (split_n) {
        const int64_t h = half(N);
        gemm16(ta, tb, M, h, K, alpha, A, lda, B, ldb, beta, C, ldc);
        gemm16(ta, tb, M, N - h, K, alpha, A, lda, B.offset(tb ? h * ldb : h), ldb, beta, C + h, ldc);
      } else {
        const int64_t h = half(K);
        gemm16(ta, tb, M, N, h, alpha, A, lda, B, ldb, beta, C, ldc);
        gemm16(ta, tb, M, N, K - h, alpha, A.offset(ta ? h * lda : h), lda, B.offset(tb ? h : h * ldb), ldb, 1.0f, C,
               ldc);
      }
      return;
    }
    char* scratch = bytes_a + bytes_b > 0 ? static_cast<char*>(scratch_bytes(bytes_a + bytes_b)) : nullptr;
    const void* a16 = A.p;
    const void* b16 = B.p;
    if (!A.is_16bit()) {
      cuda::cast_matrix(scratch, ld_a, static_cast<const float*>(A.p), rows_a, cols_a, lda, kind, stream_);
      a16 = scratch;
    }
    if (!B.is_16bit()) {
      cuda::cast_matrix(scratch + bytes_a, ld_b, static_cast<const float*>(B.p), rows_b, cols_b, ldb, kind, stream_);
      b16 = scratch + bytes_a;
    }
    matmul(ta, tb, M, N, K, alpha, a16, ld_a, b16, ld_b, beta, C, ldc, kind == 1 ? CUDA_R_16BF : CUDA_R_16F);
  }
  // The 16-bit type a precision stores as (pack16's kinds: fp16 2, bf16 and fp8 1).
  static int sixteen_kind(Precision p) { return p == Precision::fp16 ? 2 : 1; }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                         int64_t N, int64_t H, Precision round) override {
    cuda::layernorm_forward(out, mean, rstd, x, w, b, N, H, round_kind(round), stream_);
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* mean,
                          const float* rstd, const float* w, int64_t N, int64_t H) override {
    cuda::layernorm_backward(dx, dw, db, dout, x, mean, rstd, w, N, H, stream_);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t H,
                       Precision round) override {
    cuda::rmsnorm_forward(out, rstd, x, w, N, H, round_kind(round), stream_);
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* rstd, const float* w,
                        int64_t N, int64_t H) override {
    cuda::rmsnorm_backward(dx, dw, dout, x, rstd, w, N, H, stream_);
  }
  void activation_forward(Activation a, float* out, const float* u, int64_t N, int64_t F, Precision round) override {
    cuda::activation_forward(kind(a), out, u, N, F, round_kind(round), stream_);
  }
  void activation_backward(Activation a, float* du, const float* dout, const float* u, int64_t N, int64_t F,
                           Precision round) override {
    cuda::activation_backward(kind(a), du, dout, u, N, F, round_kind(round), stream_);
  }
  // The kept input read where it lies, in either storage (kernels.h: the kernels load each
  // value as pack16 stores it).
  void layernorm_backward_stored(float* dx, float* dw, float* db, const float* dout, Operand x, const float* mean,
                                 const float* rstd, const float* w, int64_t N, int64_t H) override {
    cuda::layernorm_backward(dx, dw, db, dout, x.p, stored_kind(x), mean, rstd, w, N, H, stream_);
  }
  void rmsnorm_backward_stored(float* dx, float* dw, const float* dout, Operand x, const float* rstd, const float* w,
                               int64_t N, int64_t H) override {
    cuda::rmsnorm_backward(dx, dw, dout, x.p, stored_kind(x), rstd, w, N, H, stream_);
  }
  void activation_backward_stored(Activation a, float* du, const float* dout, Operand u, int64_t N, int64_t F,
                                  Precision round) override {
    cuda::activation_backward(kind(a), du, dout, u.p, stored_kind(u), N, F, round_kind(round), stream_);
  }
  // The outputs written in 16 bits as stored (kernels.h's out_kind; the u16 copy the
  // activation's forward writes beside its output).
  void layernorm_forward_packed(uint16_t* out, float* mean, float* rstd, const float* x, const float* w,
                                const float* b, int64_t N, int64_t H, Precision p) override {
    cuda::layernorm_forward(out, sixteen_kind(p), mean, rstd, x, w, b, N, H, 0, stream_);
  }
  void rmsnorm_forward_packed(uint16_t* out, float* rstd, const float* x, const float* w, int64_t N, int64_t H,
                              Precision p) override {
    cuda::rmsnorm_forward(out, sixteen_kind(p), rstd, x, w, N, H, 0, stream_);
  }
  void activation_forward_packed(Activation a, uint16_t* out, uint16_t* u16, const float* u, int64_t N, int64_t F,
                                 Precision p) override {
    cuda::activation_forward(kind(a), out, sixteen_kind(p), u16, u, N, F, 0, stream_);
  }
  void activation_backward_packed(Activation a, uint16_t* du, const float* dout, Operand u, int64_t N, int64_t F,
                                  Precision p) override {
    cuda::activation_backward(kind(a), du, sixteen_kind(p), dout, u.p, stored_kind(u), N, F, 0, stream_);
  }
  void bias_grad_stored(float* db, Operand dy, int64_t N, int64_t F) override {
    cuda::bias_grad(db, dy.p, stored_kind(dy), N, F, stream_);
  }
  // An input's storage as the kernels' loads name it: 0 floats, else pack16's kind.
  static int stored_kind(const Operand& x) { return x.is_16bit() ? sixteen_kind(x.type) : 0; }
  void rope(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse) override {
    cuda::rope(x, S, B, heads, D, ld, inverse, stream_);
  }
  // The unfused attention (attention_plan.h): batched cuBLASLt products in the GEMM
  // precision (tensor cores in a 16-bit plan) around the softmax kernels of attention.cu.
  void attention_forward(float* out, float* probs, const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G,
                         int64_t D) override {
    if (S * B * A == 0) return;
    cuda::check_attention_shape(S, B, A, G, D);
    AttentionOps ops{this};
    attention_plan::forward(ops, out, probs, qkv, attention_plan::Heads{S, B, A, G, D}, attention_limit_);
  }
  void attention_backward(float* dqkv, const float* dout, const float* probs, const float* qkv, int64_t S, int64_t B,
                          int64_t A, int64_t G, int64_t D) override {
    AttentionOps ops{this};
    if (S * B * A == 0) {
      ops.zero(dqkv, S * B * (A + 2 * G) * D);
      return;
    }
    cuda::check_attention_shape(S, B, A, G, D);
    attention_plan::backward(ops, dqkv, dout, probs, qkv, attention_plan::Heads{S, B, A, G, D}, attention_limit_);
  }
  void flash_attention_forward(float* out, float* lse, const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G,
                               int64_t D) override {
    cuda::flash_attention_forward(out, lse, qkv, S, B, A, G, D, flash_kind(D), stream_);
  }
  void flash_attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                                int64_t S, int64_t B, int64_t A, int64_t G, int64_t D) override {
    auto* delta = static_cast<float*>(delta_bytes(sizeof(float) * static_cast<size_t>(B * A * S)));
    cuda::flash_attention_backward(dqkv, delta, dout, out, lse, qkv, S, B, A, G, D, flash_kind(D), stream_);
  }
  // The tensor-core kernels read a 16-bit qkv of their own type as it lies (kernels.h); the
  // backward's delta reads the output in either storage. Any other 16-bit qkv is unpacked
  // first (the defaults).
  bool flash_reads_16bit(int64_t D, Precision p) const override {
    return p != Precision::fp32 && flash_kind(D) != 0 && flash_kind(D) == sixteen_kind(p);
  }
  void flash_attention_forward_stored(float* out, float* lse, Operand qkv, int64_t S, int64_t B, int64_t A, int64_t G,
                                      int64_t D) override {
    if (qkv.is_16bit() && !flash_reads_16bit(D, qkv.type))
      return Backend::flash_attention_forward_stored(out, lse, qkv, S, B, A, G, D);
    cuda::flash_attention_forward(out, lse, qkv.p, stored_kind(qkv), S, B, A, G, D, flash_kind(D), stream_);
  }
  void flash_attention_backward_stored(float* dqkv, const float* dout, Operand out, const float* lse, Operand qkv,
                                       int64_t S, int64_t B, int64_t A, int64_t G, int64_t D) override {
    if (qkv.is_16bit() && !flash_reads_16bit(D, qkv.type))
      return Backend::flash_attention_backward_stored(dqkv, dout, out, lse, qkv, S, B, A, G, D);
    auto* delta = static_cast<float*>(delta_bytes(sizeof(float) * static_cast<size_t>(B * A * S)));
    cuda::flash_attention_backward(dqkv, delta, dout, out.p, stored_kind(out), lse, qkv.p, stored_kind(qkv), S, B, A,
                                   G, D, flash_kind(D), stream_);
  }
  // The fused attention's products run on the tensor cores in the GEMM precision where that
  // is 16 bits (flash_attention_tc.cu: head dims 16, 32, 64 and 128, compute capability 8 or
  // more), else in fp32 on the CUDA cores. STRATA_FLASH_TC=0 keeps the fp32 kernels, to
  // time one against the other.
  bool flash_on_tensor_cores(int64_t D) const override { return flash_kind(D) != 0; }
  std::string flash_tensor_core_reason(int64_t D) const override {
    return cuda::flash_tc_head_dim(D) ? flash_tc_why_[D / 32] : cuda::flash_tc_unavailable_reason(D, dev_);
  }
  int flash_kind(int64_t D) const {
    if (gemm_precision_ == Precision::fp32 || !cuda::flash_tc_head_dim(D) || !flash_tc_why_[D / 32].empty()) return 0;
    return round_kind(gemm_precision_);
  }
  void cross_entropy_max(float* mx, const float* z, int64_t N, int64_t Vt) override {
    cuda::cross_entropy_max(mx, z, N, Vt, stream_);
  }
  void cross_entropy_exp_sum(float* st, const float* z, const float* mx, const int32_t* targets, int64_t N, int64_t Vt,
                             int64_t lo) override {
    cuda::cross_entropy_exp_sum(st, z, mx, targets, N, Vt, lo, stream_);
  }
  bool cross_entropy_one_pass() const override { return true; }
  void cross_entropy_forward(float* mx, float* st, const float* z, const int32_t* targets, int64_t N, int64_t Vt,
                             int64_t lo) override {
    cuda::cross_entropy_forward(mx, st, z, targets, N, Vt, lo, stream_);
  }
  void cross_entropy_rescale(float* st, const float* mx, const float* mg, const int32_t* targets, int64_t N, int64_t Vt,
                             int64_t lo) override {
    cuda::cross_entropy_rescale(st, mx, mg, targets, N, Vt, lo, stream_);
  }
  void cross_entropy_backward(float* z, const float* mx, const float* st, const int32_t* targets, int64_t N, int64_t Vt,
                              int64_t lo, float scale, Precision p) override {
    cuda::cross_entropy_backward(z, mx, st, targets, N, Vt, lo, scale, round_kind(p), stream_);
  }
  void cross_entropy_backward_packed(uint16_t* dz, float* z, const float* mx, const float* st, const int32_t* targets,
                                     int64_t N, int64_t Vt, int64_t lo, float scale, Precision p) override {
    cuda::cross_entropy_backward_packed(dz, z, mx, st, targets, N, Vt, lo, scale, sixteen_kind(p), stream_);
  }
  static int round_kind(Precision p) {
    return p == Precision::fp16 ? 2 : (p == Precision::bf16 || p == Precision::fp8) ? 1 : 0;
  }
  void round_to(float* x, int64_t n, Precision p) override { cuda::round_to(x, n, round_kind(p), stream_); }
  void round_copy(float* dst, const float* src, int64_t n, Precision p) override {
    cuda::round_copy(dst, src, n, round_kind(p), stream_);
  }
  void pack16(uint16_t* dst, const float* src, int64_t n, Precision p) override {
    cuda::pack16(dst, src, n, p == Precision::fp16 ? 2 : 1, stream_);
  }
  void unpack16(float* dst, const uint16_t* src, int64_t n, Precision p) override {
    cuda::unpack16(dst, src, n, p == Precision::fp16 ? 2 : 1, stream_);
  }

 private:
  static constexpr size_t kWorkspace = 32u << 20;

  // C (fp32) = alpha op(A) op(B) + beta C with A and B of type `in` (fp32, bf16 or fp16):
  // row-major, so as the column-major C^T (N x M) = op(B)^T (N x K) op(A)^T (K x M). B as
  // stored is the column-major (tb ? K x N : N x K) matrix with leading dimension ldb, and
  // so on. fp32 accumulation throughout (CUBLAS_COMPUTE_32F: no TF32).
  void matmul(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
              const void* B, int64_t ldb, float beta, float* C, int64_t ldc, cudaDataType_t in) {
    run_matmul(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, in, CUBLAS_COMPUTE_32F, Batch{}, false);
  }
  // A batch of products of fp32 operands in the GEMM precision: a 16-bit plan's on the
  // tensor cores (cuBLASLt rounds the operands itself: CUBLAS_COMPUTE_32F_FAST_16BF / 16F,
  // fp32 accumulation), exact fp32 otherwise or where cuBLASLt has no such kernel.
  void matmul(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc, const Batch& batch) {
    const cublasComputeType_t fast = gemm_precision_ == Precision::bf16   ? CUBLAS_COMPUTE_32F_FAST_16BF
                                     : gemm_precision_ == Precision::fp16 ? CUBLAS_COMPUTE_32F_FAST_16F
                                                                          : CUBLAS_COMPUTE_32F;
    if (fast != CUBLAS_COMPUTE_32F &&
        run_matmul(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, CUDA_R_32F, fast, batch, true))
      return;
    run_matmul(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, CUDA_R_32F, CUBLAS_COMPUTE_32F, batch, false);
  }
  // Both of the above. The algorithm cuBLASLt's heuristic picks for a shape (with its
  // layouts, alignments and compute type) is kept, so a repeated product skips the query.
  // Returns false, having run nothing, where `may_fail` and no algorithm exists.
  bool run_matmul(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
                  const void* B, int64_t ldb, float beta, float* C, int64_t ldc, cudaDataType_t in,
                  cublasComputeType_t compute, const Batch& batch, bool may_fail) {
    const size_t elem = in == CUDA_R_32F ? 4 : 2;
    // Views into larger buffers need not be 256-byte aligned (cuBLASLt's default
    // assumption): tell it each operand's real alignment.
    const bool batched = batch.count > 1;
    const uint32_t align_a = alignment(B, batched ? static_cast<uint64_t>(batch.b) * elem : 0),
                   align_b = alignment(A, batched ? static_cast<uint64_t>(batch.a) * elem : 0),
                   align_c = alignment(C, batched ? static_cast<uint64_t>(batch.c) * sizeof(float) : 0);
    const AlgoKey key{ta, tb, M, N, K, lda, ldb, ldc, static_cast<int64_t>(in), static_cast<int64_t>(compute),
                      batch.count, batch.a, batch.b, batch.c, align_a, align_b, align_c};
    auto it = algos_.find(key);
    if (it == algos_.end()) {
      // The descriptor and the layouts hold nothing but what the key holds (the operations,
      // the shapes, the types, the batch): made once per key and kept with its algorithm,
      // not made and destroyed again on every product (ten cuBLASLt calls on the host each).
      auto o = std::make_unique<LtObjects>();
      CUBLAS_CHECK(cuda::lt().MatmulDescCreate(&o->desc, compute, CUDA_R_32F));
      const cublasOperation_t op_first = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_second = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
      CUBLAS_CHECK(cuda::lt().MatmulDescSetAttribute(o->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
      CUBLAS_CHECK(cuda::lt().MatmulDescSetAttribute(o->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
      CUBLAS_CHECK(cuda::lt().MatrixLayoutCreate(&o->la, in, tb ? K : N, tb ? N : K, ldb));
      CUBLAS_CHECK(cuda::lt().MatrixLayoutCreate(&o->lb, in, ta ? M : K, ta ? K : M, lda));
      CUBLAS_CHECK(cuda::lt().MatrixLayoutCreate(&o->lc, CUDA_R_32F, N, M, ldc));
      if (batched) {
        const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {{o->la, batch.b}, {o->lb, batch.a}, {o->lc, batch.c}};
        for (const auto& [layout, offset] : strided) {
          CUBLAS_CHECK(cuda::lt().MatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch.count,
                                                        sizeof(batch.count)));
          CUBLAS_CHECK(cuda::lt().MatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset,
                                                        sizeof(offset)));
        }
      }
      CUBLAS_CHECK(cuda::lt().MatmulPreferenceCreate(&o->pref));
      const size_t ws = kWorkspace;
      CUBLAS_CHECK(cuda::lt().MatmulPreferenceSetAttribute(o->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
      CUBLAS_CHECK(cuda::lt().MatmulPreferenceSetAttribute(o->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
      CUBLAS_CHECK(cuda::lt().MatmulPreferenceSetAttribute(o->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
      CUBLAS_CHECK(cuda::lt().MatmulPreferenceSetAttribute(o->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
      CUBLAS_CHECK(cuda::lt().MatmulPreferenceSetAttribute(o->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
      cublasLtMatmulHeuristicResult_t heur{};
      int found = 0;
      const cublasStatus_t rc =
          cuda::lt().MatmulAlgoGetHeuristic(lt_, o->desc, o->la, o->lb, o->lc, o->lc, o->pref, 1, &heur, &found);
      const bool ok = rc == CUBLAS_STATUS_SUCCESS && found > 0;
      if (!ok && (!may_fail || rc != CUBLAS_STATUS_NOT_SUPPORTED)) {
        CUBLAS_CHECK(rc);
        if (!may_fail) fail_gemm(M, N, K);
      }
      if (!ok && !warned_no_fast_) {  // said once: the products run, in exact fp32, only slower
        warned_no_fast_ = true;
        std::fprintf(stderr, "strata: cuBLASLt offers no 16-bit tensor-core kernel for an fp32-operand product (M=%lld N=%lld "
                     "K=%lld); such products run in fp32\n", static_cast<long long>(M), static_cast<long long>(N),
                     static_cast<long long>(K));
      }
      it = algos_.emplace(key, Algo{ok, heur.algo, std::move(o)}).first;
    }
    if (!it->second.ok) return false;
    const LtObjects& o = *it->second.lt;
    CUBLAS_CHECK(cuda::lt().Matmul(lt_, o.desc, &alpha, B, o.la, A, o.lb, &beta, C, o.lc, C, o.lc, &it->second.algo,
                                workspace_, kWorkspace, stream_));
    return true;
  }
  using AlgoKey = std::array<int64_t, 17>;
  struct Algo {
    bool ok;
    cublasLtMatmulAlgo_t algo;
    std::unique_ptr<LtObjects> lt;  // the descriptor and layouts it runs with
  };

  // What attention_plan.h runs on.
  struct AttentionOps {
    CudaBackendImpl* be;
    void matmul(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                const float* B, int64_t ldb, float beta, float* C, int64_t ldc, const Batch& batch) {
      be->matmul(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, batch);
    }
    void softmax(float* p, int64_t stride, int64_t count, int64_t S) { cuda::causal_softmax(p, stride, count, S, be->stream_); }
    void softmax_backward(float* d, int64_t d_stride, const float* p, int64_t p_stride, int64_t count, int64_t S,
                          float scale) {
      cuda::causal_softmax_backward(d, d_stride, p, p_stride, count, S, scale, be->stream_);
    }
    void zero(float* p, int64_t n) {
      if (n > 0) CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(n) * sizeof(float), be->stream_));
    }
    float* workspace(int64_t floats) { return static_cast<float*>(be->attn_bytes(sizeof(float) * static_cast<size_t>(floats))); }
  };

  // Workspaces grown on demand from the untracked pool; the old one is freed in stream
  // order, after the work queued on it.
  struct Grown {
    void* p = nullptr;
    size_t size = 0;
  };
  void* at_least(Grown& g, size_t bytes) {
    if (bytes > g.size) {
      pool_free(g.p);
      g = Grown{};
      g.p = pool_alloc(bytes, kMemPools - 1);
      g.size = bytes;
    }
    return g.p;
  }
  void* scratch_bytes(size_t bytes) { return at_least(scratch_, bytes); }  // the 16-bit GEMM operands
  void* delta_bytes(size_t bytes) { return at_least(delta_, bytes); }      // flash attention's backward
  void* attn_bytes(size_t bytes) { return at_least(attn_, bytes); }        // the unfused attention's scores
  // From pool `pool`; when the device is full, the memory every pool keeps freed (none is
  // handed back otherwise) is released to the driver and the allocation tried once more.
  void* pool_alloc(size_t bytes, int pool) {
    if (pool < 0 || pool >= kMemPools) pool = kMemPools - 1;
    void* p = nullptr;
    if (!pooled_) {
      const cudaError_t plain = cudaMalloc(&p, bytes);
      if (plain != cudaSuccess) {
        (void)cudaGetLastError();
        cuda::fail("cudaMalloc", __FILE__, __LINE__,
                   std::string(cudaGetErrorName(plain)) + ": " + std::to_string(bytes) + " bytes for the " +
                       mem_pool_name(pool) + " pool");
      }
      plain_[p] = {bytes, pool};
      plain_live_[pool] += static_cast<int64_t>(bytes);
      plain_peak_[pool] = std::max(plain_peak_[pool], plain_live_[pool]);
      return p;
    }
    cudaError_t rc = cudaMallocFromPoolAsync(&p, bytes, pools_[pool], stream_);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear it
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      for (cudaMemPool_t each : pools_) CUDA_CHECK(cudaMemPoolTrimTo(each, 0));
      rc = cudaMallocFromPoolAsync(&p, bytes, pools_[pool], stream_);
    }
    if (rc != cudaSuccess)
      cuda::fail("cudaMallocFromPoolAsync", __FILE__, __LINE__,
                 std::string(cudaGetErrorName(rc)) + ": " + std::to_string(bytes) + " bytes from the " +
                     mem_pool_name(pool) + " pool");
    return p;
  }
  // Frees what pool_alloc gave: in stream order into its pool, or (plain cudaMalloc) after
  // the work queued so far. From destructors too: nothing thrown; a failure shows in the
  // next checked call.
  void pool_free(void* p) noexcept {
    if (!p) return;
    if (pooled_) {
      (void)cudaFreeAsync(p, stream_);
      return;
    }
    (void)cudaStreamSynchronize(stream_);
    (void)cudaFree(p);
    const auto it = plain_.find(p);
    if (it != plain_.end()) {
      plain_live_[it->second.second] -= static_cast<int64_t>(it->second.first);
      plain_.erase(it);
    }
  }
  static int kind(Activation a) {
    switch (a) {
      case Activation::gelu: return 0;
      case Activation::swiglu: return 1;
      case Activation::geglu: return 2;
      case Activation::squared_relu: return 3;
    }
    return 0;
  }
  [[noreturn]] static void fail_gemm(int64_t M, int64_t N, int64_t K) {
    cuda::fail("cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__,
               "no algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K));
  }

  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  size_t scratch_limit_ = kGemmScratchBytes;  // gemm16's operand copies, at most
  int64_t attention_limit_ = cuda::kUnfusedAttentionWorkspaceBytes;  // the unfused attention's S x S matrices, at most
  double* acc_ = nullptr;  // grad_norm_terms' device accumulators
  std::vector<cudaEvent_t> events_;  // mark()'s stamps; the first used_events_ hold this round's
  size_t used_events_ = 0;
  Grown scratch_, delta_, attn_;
  std::map<AlgoKey, Algo> algos_;  // run_matmul's choices
  bool warned_no_fast_ = false;
  cudaMemPool_t pools_[kMemPools] = {};  // by MemCategory, then buffers charged to none
  bool pooled_ = true;                   // false: plain cudaMalloc, counted below
  std::unordered_map<void*, std::pair<size_t, int>> plain_;  // bytes and pool of each allocation
  int64_t plain_live_[kMemPools] = {}, plain_peak_[kMemPools] = {};
  Precision gemm_precision_ = Precision::fp32;
  // Why the fused attention of head dim 16, 32, 64, 128 (at D / 32) may not use the
  // tensor-core kernels ("" where it may: flash_kind).
  std::string flash_tc_why_[5];
  std::string name_, bus_id_;
  int dev_ = 0;
};

}  // namespace

std::string cuda_unavailable_reason() {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess)
    return "cudaGetDeviceCount returned error " + std::to_string(static_cast<int>(rc)) + " (" + cudaGetErrorName(rc) +
           ": " + cudaGetErrorString(rc) + "): no usable NVIDIA driver or GPU on this machine";
  if (n == 0) return "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)";
  return "";
}

int cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::unique_ptr<CudaBackend> make_cuda_backend(int local_rank) {
  if (!cuda_unavailable_reason().empty()) return nullptr;
  return std::make_unique<CudaBackendImpl>(local_rank % cuda_device_count());
}

size_t cublaslt_version() { return cuda::lt().GetVersion(); }

}  // namespace strata
