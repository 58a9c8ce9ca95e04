// Every op of the CUDA backend (executor/cuda/) against the CPU backend on random inputs:
// normalised error max|cuda - cpu| / max|cpu| within 1e-5 (fp32), no NaN; the bf16 and fp16
// roundings bit for bit. Without a GPU (or without CUDA in the build) every case reports
// SKIPPED with the reason: never a silent pass. (The training case: its own tolerances.)
// Built a second time as cuda_ops_emulated_test (STRATA_CUDA_EMULATION), where the backend
// itself (cuda_backend.cpp) runs on the CPU over the kernels' emulation and an emulated
// cuBLASLt (CMakeLists.txt). There (kEmulated), since a block's threads are fibers run in
// turn, the unfused attention runs shorter sequences, the fused one leaves out its longest
// shapes (the kernels' own emulation tests take long rows and many tiles) and tiny-gpt is 2
// layers of 64 on sequences of 32; the two cases that need the real libraries (cuBLASLt's
// loading, NCCL) are left out, and two are the emulation's alone (a full device; host
// pointers where device memory belongs).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "costmodel/estimate.h"
#include "costmodel/hardware.h"
#include "costmodel/stack.h"
#include "executor/backend.h"
#include "executor/comm.h"
#include "executor/cuda/cuda_backend.h"
#include "executor/cuda/nccl_comm.h"
#include "executor/memory_tracker.h"
#include "executor/process_grid.h"
#include "executor/staged_comm.h"
#include "executor/train.h"
#include "executor/zero.h"
#include "qkv_parts.h"
#ifdef STRATA_CUDA_EMULATION
#include "cuda_emulation.h"  // (the emulated device's size, for the full-device case)
#endif

namespace strata {
namespace {

using Vec = std::vector<float>;
#ifdef STRATA_CUDA_EMULATION
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = cuda_unavailable_reason();
    if (!why.empty()) GTEST_SKIP() << "no GPU: " << why;
#ifdef STRATA_CUDA_EMULATION
    cuda_emu::check_device_pointers = true;  // (a host pointer where device memory belongs fails, as on a GPU)
#endif
    gpu_ = make_cuda_backend();
    ASSERT_NE(gpu_, nullptr);
    cpu_ = make_cpu_backend();
  }

  // A device copy of a host vector, freed with the test.
  float* dev(const Vec& h) {
    float* d = gpu_->device_alloc(static_cast<int64_t>(h.size()));
    gpu_->to_device(d, h.data(), static_cast<int64_t>(h.size()));
    owned_.push_back(d);
    return d;
  }
  // A device copy of 16-bit values (pack16's storage), freed with the test.
  const uint16_t* dev16(const std::vector<uint16_t>& h) {
    void* d = gpu_->allocate_bytes(h.size() * sizeof(uint16_t));
    gpu_->bytes_to_device(d, h.data(), h.size() * sizeof(uint16_t));
    owned_bytes_.push_back(d);
    return static_cast<const uint16_t*>(d);
  }
  // x's values in 16-bit storage (pack16's, rounding to p).
  std::vector<uint16_t> sixteen(const Vec& x, Precision p) {
    std::vector<uint16_t> h(x.size());
    cpu_->pack16(h.data(), x.data(), static_cast<int64_t>(x.size()), p);
    return h;
  }
  // n 16-bit values of device memory (a whole number of floats, as Buf's packed storage),
  // filled with 0xffff (a NaN pattern in both types) so a value an op leaves unwritten
  // shows; freed with the test.
  uint16_t* out16(size_t n) {
    const std::vector<uint16_t> fill(n + n % 2, 0xffff);
    return const_cast<uint16_t*>(dev16(fill));
  }
  // n 16-bit values of out16's memory (read as its floats).
  std::vector<uint16_t> host16(const uint16_t* d, size_t n) {
    gpu_->synchronise();
    std::vector<float> words((n + 1) / 2);
    gpu_->to_host(words.data(), reinterpret_cast<const float*>(d), static_cast<int64_t>(words.size()));
    std::vector<uint16_t> h(n);
    std::memcpy(h.data(), words.data(), n * sizeof(uint16_t));
    return h;
  }
  Vec host(const float* d, size_t n) {
    Vec h(n);
    gpu_->synchronise();
    gpu_->to_host(h.data(), d, static_cast<int64_t>(n));
    return h;
  }
  void TearDown() override {
    for (float* d : owned_) gpu_->device_free(d);
    for (void* d : owned_bytes_) gpu_->deallocate_bytes(d);
  }
  // LayerNorm / RMSNorm forward and backward of (N, H) against the CPU backend.
  void layernorm_case(int64_t N, int64_t H) {
    SCOPED_TRACE(::testing::Message() << "N = " << N << ", H = " << H);
    const Vec x = random(N * H, 2.0f), w = random(H), b = random(H), dout = random(N * H);
    Vec out(N * H), mean(N), rstd(N), dx = random(N * H), dw = random(H), db = random(H);
    float *gx = dev(x), *gw = dev(w), *gb = dev(b), *gout = dev(out), *gmean = dev(mean), *grstd = dev(rstd);
    float *gdout = dev(dout), *gdx = dev(dx), *gdw = dev(dw), *gdb = dev(db);
    gpu_->layernorm_forward(gout, gmean, grstd, gx, gw, gb, N, H);
    cpu_->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, H);
    expect_close(host(gout, out.size()), out, 1e-5, "layernorm out");
    expect_close(host(gmean, mean.size()), mean, 1e-5, "layernorm mean");
    expect_close(host(grstd, rstd.size()), rstd, 1e-5, "layernorm rstd");
    gpu_->layernorm_backward(gdx, gdw, gdb, gdout, gx, gmean, grstd, gw, N, H);
    cpu_->layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), mean.data(), rstd.data(), w.data(), N, H);
    expect_close(host(gdx, dx.size()), dx, 1e-5, "layernorm dx");
    expect_close(host(gdw, dw.size()), dw, 1e-5, "layernorm dw");
    expect_close(host(gdb, db.size()), db, 1e-5, "layernorm db");
  }
  void rmsnorm_case(int64_t N, int64_t H) {
    SCOPED_TRACE(::testing::Message() << "N = " << N << ", H = " << H);
    const Vec x = random(N * H, 2.0f), w = random(H), dout = random(N * H);
    Vec out(N * H), rstd(N), dx = random(N * H), dw = random(H);
    float *gx = dev(x), *gw = dev(w), *gout = dev(out), *grstd = dev(rstd), *gdout = dev(dout), *gdx = dev(dx), *gdw = dev(dw);
    gpu_->rmsnorm_forward(gout, grstd, gx, gw, N, H);
    cpu_->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, H);
    expect_close(host(gout, out.size()), out, 1e-5, "rmsnorm out");
    expect_close(host(grstd, rstd.size()), rstd, 1e-5, "rmsnorm rstd");
    gpu_->rmsnorm_backward(gdx, gdw, gdout, gx, grstd, gw, N, H);
    cpu_->rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), rstd.data(), w.data(), N, H);
    expect_close(host(gdx, dx.size()), dx, 1e-5, "rmsnorm dx");
    expect_close(host(gdw, dw.size()), dw, 1e-5, "rmsnorm dw");
  }
  Vec random(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> dist(0.0f, scale);
    Vec v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  // max|got - want| / max|want|; NaN anywhere fails.
  static void expect_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i])) << what << " [" << i << "]";
      ASSERT_FALSE(std::isnan(want[i])) << what << " (CPU) [" << i << "]";
      num = std::max(num, std::fabs(static_cast<double>(got[i]) - want[i]));
      den = std::max(den, std::fabs(static_cast<double>(want[i])));
    }
    EXPECT_LE(num / std::max(den, 1e-30), tol) << what << ": normalised error " << num / den;
  }

  // An output buffer the op must overwrite entirely: NaN everywhere to start with.
  static Vec nans(size_t n) { return Vec(n, std::numeric_limits<float>::quiet_NaN()); }

  void attention_case(int64_t S, int64_t B, int64_t A, int64_t G, int64_t D, bool keep);
  // Cases run again under a lowered row grid (RowKernelsStepThroughRowsPastTheirGrid).
  void gemm_views_case();
  void gemm_16bit_case();
  void cross_entropy_case();
  void activations_case();
  void rope_case();
  void embedding_case();
  void elementwise_case();

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
  std::vector<float*> owned_;
  std::vector<void*> owned_bytes_;
  std::mt19937 rng_{42};
};

// cuBLASLt is loaded when first asked for, not at start-up (its initialisers took about
// 0.5 s of every process, CPU-only runs included); with CUDA in the build it then loads and
// answers without a GPU. First in this file, so no case has made a backend before it.
#ifndef STRATA_CUDA_EMULATION  // (the real library's loading; the emulated backend has none)
TEST(CudaLibraries, CublasLtLoadsOnlyWhenAsked) {
  auto mapped = [] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line))
      if (line.find("libcublasLt") != std::string::npos) return true;
    return false;
  };
  EXPECT_FALSE(mapped()) << "libcublasLt is mapped before any CUDA backend was asked for";
  if (cuda_unavailable_reason().rfind("this strata was built without CUDA", 0) == 0) {
    EXPECT_EQ(cublaslt_version(), 0u);
    GTEST_SKIP() << "no CUDA in this build: " << cuda_unavailable_reason();
  }
  EXPECT_GE(cublaslt_version(), 110000u);  // CUDA 11 or newer (13.0 here reports 130100)
  EXPECT_TRUE(mapped());
}
#endif

TEST_F(CudaOps, GemmEveryTransposition) {
  const int64_t M = 37, N = 53, K = 29, pad = 3;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
    const Vec a = random(static_cast<size_t>((ta ? K : M) * lda)), b = random(static_cast<size_t>((tb ? N : K) * ldb));
    Vec c = random(static_cast<size_t>(M * ldc));
    float* da = dev(a);
    float* db = dev(b);
    float* dc = dev(c);
    gpu_->gemm(ta, tb, M, N, K, 0.7f, da, lda, db, ldb, 0.3f, dc, ldc);
    cpu_->gemm(ta, tb, M, N, K, 0.7f, a.data(), lda, b.data(), ldb, 0.3f, c.data(), ldc);
    expect_close(host(dc, c.size()), c, 1e-5, "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
  }
}

void CudaOps::gemm_views_case() {
  const int64_t M = 33, N = 17, K = 45;
  const Vec a = random(static_cast<size_t>(M * K + 1)), b = random(static_cast<size_t>(K * N + 1));
  // Views one float into their buffers (4-byte aligned only), C full of NaN with beta = 0.
  Vec c = nans(static_cast<size_t>(M * N + 1));
  float *da = dev(a), *db = dev(b), *dc = dev(c);
  gpu_->gemm(false, false, M, N, K, 1.0f, da + 1, K, db + 1, N, 0.0f, dc + 1, N);
  cpu_->gemm(false, false, M, N, K, 1.0f, a.data() + 1, K, b.data() + 1, N, 0.0f, c.data() + 1, N);
  const Vec got = host(dc, c.size());
  expect_close(Vec(got.begin() + 1, got.end()), Vec(c.begin() + 1, c.end()), 1e-5, "gemm on unaligned views");
  EXPECT_TRUE(std::isnan(got[0])) << "wrote outside C";
  // K = 0: C = beta * C.
  Vec e = random(static_cast<size_t>(M * N));
  float* de = dev(e);
  gpu_->gemm(false, false, M, N, 0, 1.0f, da, 1, db, N, 0.5f, de, N);
  cpu_->gemm(false, false, M, N, 0, 1.0f, a.data(), 1, b.data(), N, 0.5f, e.data(), N);
  expect_close(host(de, e.size()), e, 1e-6, "gemm with K = 0");
}
TEST_F(CudaOps, GemmOnUnalignedViewsBetaZeroOverNanAndEmptyK) { gemm_views_case(); }

// 16-bit GEMMs on the tensor cores: on operands already rounded to bf16 / fp16 (what the
// executor passes) they match the CPU's fp32 GEMM of the same operands to fp32 accuracy
// (both accumulate in fp32); on unrounded operands within the bf16 tolerance 1e-2.
void CudaOps::gemm_16bit_case() {
  const int64_t M = 70, N = 96, K = 200, pad = 5;
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    gpu_->set_gemm_precision(p);
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N;
      Vec a = random(static_cast<size_t>((ta ? K : M) * lda)), b = random(static_cast<size_t>((tb ? N : K) * ldb));
      const std::string what = std::string(to_string(p)) + " gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb);
      // Unrounded: against the exact fp32 product.
      Vec c = random(static_cast<size_t>(M * ldc));
      float *da = dev(a), *db = dev(b), *dc = dev(c);
      gpu_->gemm(ta, tb, M, N, K, 1.0f, da, lda, db, ldb, 0.5f, dc, ldc);
      cpu_->gemm(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.5f, c.data(), ldc);
      expect_close(host(dc, c.size()), c, 1e-2, what + " (unrounded operands)");
      // Rounded first, as the executor does: fp32 accuracy.
      cpu_->round_to(a.data(), static_cast<int64_t>(a.size()), p);
      cpu_->round_to(b.data(), static_cast<int64_t>(b.size()), p);
      Vec e = random(static_cast<size_t>(M * ldc));
      float *ra = dev(a), *rb = dev(b), *de = dev(e);
      gpu_->gemm(ta, tb, M, N, K, 1.0f, ra, lda, rb, ldb, 0.5f, de, ldc);
      cpu_->gemm(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.5f, e.data(), ldc);
      expect_close(host(de, e.size()), e, 1e-5, what + " (rounded operands)");
    }
  }
  gpu_->set_gemm_precision(Precision::fp32);
  EXPECT_THROW(gpu_->set_gemm_precision(Precision::fp8), std::invalid_argument);
}
TEST_F(CudaOps, GemmBf16AndFp16OnTensorCores) { gemm_16bit_case(); }

// A 16-bit product whose operand copies pass the scratch limit runs in parts (C's rows, its
// columns, or K, accumulating): the same product, and the scratch stays near the limit.
// Operands rounded first, as the executor's are: fp32 accuracy against the CPU.
TEST_F(CudaOps, GemmInPartsPastTheScratchLimit) {
  gpu_->set_gemm_precision(Precision::bf16);
  gpu_->set_gemm_scratch_limit(4096);
  struct Shape {
    int64_t M, N, K;
  };
  // A the larger (rows of C split), B the larger (columns), M = N = 1 (K split, accumulating).
  for (const Shape& g : {Shape{70, 9, 200}, Shape{6, 130, 90}, Shape{1, 1, 5000}}) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const int64_t lda = (ta ? g.M : g.K) + 3, ldb = (tb ? g.K : g.N) + 3, ldc = g.N + 2;
      Vec a = random(static_cast<size_t>((ta ? g.K : g.M) * lda)), b = random(static_cast<size_t>((tb ? g.N : g.K) * ldb));
      cpu_->round_to(a.data(), static_cast<int64_t>(a.size()), Precision::bf16);
      cpu_->round_to(b.data(), static_cast<int64_t>(b.size()), Precision::bf16);
      Vec c = random(static_cast<size_t>(g.M * ldc));
      float *da = dev(a), *db = dev(b), *dc = dev(c);
      gpu_->gemm(ta, tb, g.M, g.N, g.K, 0.75f, da, lda, db, ldb, 0.5f, dc, ldc);
      cpu_->gemm(ta, tb, g.M, g.N, g.K, 0.75f, a.data(), lda, b.data(), ldb, 0.5f, c.data(), ldc);
      expect_close(host(dc, c.size()), c, 1e-5,
                   "parts of " + std::to_string(g.M) + "x" + std::to_string(g.N) + "x" + std::to_string(g.K) +
                       " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
    }
  }
  // 8 MiB of copies (2048 x 2048 and 2048 x 64 in bf16) under a 1 MiB limit: the untracked
  // pool, where the scratch grows, stays within the limit and a pool's 2 MiB granularity.
  gpu_->set_gemm_scratch_limit(size_t{1} << 20);
  const int64_t M = 2048, N = 64, K = 2048;
  Vec a = random(static_cast<size_t>(M * K)), b = random(static_cast<size_t>(K * N));
  cpu_->round_to(a.data(), static_cast<int64_t>(a.size()), Precision::bf16);
  cpu_->round_to(b.data(), static_cast<int64_t>(b.size()), Precision::bf16);
  Vec c(static_cast<size_t>(M * N), 0.0f);
  float *da = dev(a), *db = dev(b), *dc = dev(c);
  gpu_->gemm(false, false, M, N, K, 1.0f, da, K, db, N, 0.0f, dc, N);
  cpu_->gemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N);
  expect_close(host(dc, c.size()), c, 1e-5, "2048 x 64 x 2048 in parts");
  Backend::DeviceMemory dm;
  ASSERT_TRUE(gpu_->device_memory(&dm));
  EXPECT_LE(dm.used_peak[kMemPools - 1], (int64_t{1} << 20) + (int64_t{2} << 20));
  gpu_->set_gemm_scratch_limit(kGemmScratchBytes);
  gpu_->set_gemm_precision(Precision::fp32);
}

// gemm_mixed: operands in 16-bit storage (pack16's: the executor's packed tensors and its
// 16-bit GEMM inputs) read where they are, beside float operands or both, in every
// transposition, on views whose row strides pass their columns, and past the scratch limit
// (only a float operand takes scratch, so the parts split what it holds); rows not 16-byte
// aligned (a stride of 3 past the columns) unpacked first. Against the CPU backend's
// gemm_mixed (the default: a 16-bit operand unpacked, then its fp32 GEMM) on the same
// values: fp32 accuracy. The CUDA backend says it reads them as stored, the CPU's that it
// unpacks them. An operand of the other 16-bit type than the GEMM's is unpacked first (the
// default), then rounded to the GEMM's: within the bf16 tolerance.
TEST_F(CudaOps, GemmReadsSixteenBitOperandsAsStored) {
  EXPECT_TRUE(gpu_->gemm_reads_16bit());
  EXPECT_FALSE(cpu_->gemm_reads_16bit());
  const int64_t M = 40, N = 48, K = 64;
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    gpu_->set_gemm_precision(p);
    for (size_t limit : {kGemmScratchBytes, size_t{4096}})
      for (int64_t pad : {8, 3}) {
        gpu_->set_gemm_scratch_limit(limit);
        for (int t = 0; t < 4; ++t)
          for (int which = 1; which < 4; ++which) {  // 16 bits: A, B, both
            const bool ta = t & 1, tb = t & 2, a16 = which & 1, b16 = which & 2;
            const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + 2;
            Vec a = random(static_cast<size_t>((ta ? K : M) * lda)), b = random(static_cast<size_t>((tb ? N : K) * ldb));
            cpu_->round_to(a.data(), static_cast<int64_t>(a.size()), p);
            cpu_->round_to(b.data(), static_cast<int64_t>(b.size()), p);
            Vec c = random(static_cast<size_t>(M * ldc));
            const std::vector<uint16_t> ha = sixteen(a, p), hb = sixteen(b, p);
            const Operand A = a16 ? Operand::sixteen(dev16(ha), p) : Operand::floats(dev(a));
            const Operand B = b16 ? Operand::sixteen(dev16(hb), p) : Operand::floats(dev(b));
            float* dc = dev(c);
            gpu_->gemm_mixed(ta, tb, M, N, K, 0.75f, A, lda, B, ldb, 0.5f, dc, ldc);
            cpu_->gemm_mixed(ta, tb, M, N, K, 0.75f, a16 ? Operand::sixteen(ha.data(), p) : Operand::floats(a.data()),
                             lda, b16 ? Operand::sixteen(hb.data(), p) : Operand::floats(b.data()), ldb, 0.5f,
                             c.data(), ldc);
            expect_close(host(dc, c.size()), c, 1e-5,
                         std::string(to_string(p)) + " gemm_mixed ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                             " 16-bit A=" + std::to_string(a16) + " B=" + std::to_string(b16) +
                             " scratch limit " + std::to_string(limit) + " row stride +" + std::to_string(pad));
          }
      }
  }
  // fp16 storage into a bf16 GEMM: unpacked, then rounded to bf16 as any float operand.
  gpu_->set_gemm_scratch_limit(kGemmScratchBytes);
  gpu_->set_gemm_precision(Precision::bf16);
  Vec a = random(static_cast<size_t>(M * K)), b = random(static_cast<size_t>(K * N));
  cpu_->round_to(a.data(), static_cast<int64_t>(a.size()), Precision::fp16);
  Vec c(static_cast<size_t>(M * N), 0.0f);
  float* dc = dev(c);
  gpu_->gemm_mixed(false, false, M, N, K, 1.0f, Operand::sixteen(dev16(sixteen(a, Precision::fp16)), Precision::fp16),
                   K, Operand::floats(dev(b)), N, 0.0f, dc, N);
  cpu_->gemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N);
  expect_close(host(dc, c.size()), c, 1e-2, "fp16 storage in a bf16 GEMM");
  gpu_->set_gemm_precision(Precision::fp32);
}

// The norms' and the activation's backwards with their kept input in 16-bit storage
// (Backend::*_stored: where the GEMMs read 16-bit operands the executor keeps x, x2 and
// the fc1 output packed through the backward), each value loaded as pack16 stores it:
// against the CPU backend's float op on the same values, fp32 accuracy; the activation's
// rounded to 16 bits as it writes, bit for bit this backend's float op; and the CPU
// backend's own *_stored (the default: unpacked first) its float op bit for bit.
TEST_F(CudaOps, NormAndActivationBackwardsReadStoredInputs) {
  const int64_t N = 37, H = 200, F = 96;
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    SCOPED_TRACE(to_string(p));
    Vec x = random(N * H, 2.0f);
    cpu_->round_to(x.data(), N * H, p);
    const std::vector<uint16_t> x16 = sixteen(x, p);
    const Operand on_gpu = Operand::sixteen(dev16(x16), p), on_cpu = Operand::sixteen(x16.data(), p);
    const Vec w = random(H), b = random(H), dout = random(N * H), dx0 = random(N * H), dw0 = random(H), db0 = random(H);
    Vec out(N * H), mean(N), rstd(N);
    for (bool layernorm : {true, false}) {
      SCOPED_TRACE(layernorm ? "layernorm" : "rmsnorm");
      if (layernorm) cpu_->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, H);
      else cpu_->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, H);
      Vec dx = dx0, dw = dw0, db = db0, sx = dx0, sw = dw0, sb = db0;
      float *gdx = dev(dx0), *gdw = dev(dw0), *gdb = dev(db0), *gdout = dev(dout), *gw = dev(w);
      float *gmean = dev(mean), *grstd = dev(rstd);
      if (layernorm) {
        gpu_->layernorm_backward_stored(gdx, gdw, gdb, gdout, on_gpu, gmean, grstd, gw, N, H);
        cpu_->layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), mean.data(), rstd.data(), w.data(), N, H);
        cpu_->layernorm_backward_stored(sx.data(), sw.data(), sb.data(), dout.data(), on_cpu, mean.data(), rstd.data(),
                                        w.data(), N, H);
      } else {
        gpu_->rmsnorm_backward_stored(gdx, gdw, gdout, on_gpu, grstd, gw, N, H);
        cpu_->rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), rstd.data(), w.data(), N, H);
        cpu_->rmsnorm_backward_stored(sx.data(), sw.data(), dout.data(), on_cpu, rstd.data(), w.data(), N, H);
      }
      expect_close(host(gdx, dx.size()), dx, 1e-5, "dx");
      expect_close(host(gdw, dw.size()), dw, 1e-5, "dw");
      if (layernorm) expect_close(host(gdb, db.size()), db, 1e-5, "db");
      EXPECT_EQ(sx, dx);
      EXPECT_EQ(sw, dw);
      EXPECT_EQ(sb, db);
    }
    for (Activation a : {Activation::gelu, Activation::swiglu, Activation::geglu, Activation::squared_relu}) {
      SCOPED_TRACE(to_string(a));
      const int64_t width = gated(a) ? 2 * F : F;
      Vec u = random(N * width, 2.0f);
      cpu_->round_to(u.data(), N * width, p);
      const std::vector<uint16_t> u16 = sixteen(u, p);
      const Vec da = random(N * F);
      Vec du(N * width), su(N * width);
      float* gdu = dev(nans(du.size()));
      gpu_->activation_backward_stored(a, gdu, dev(da), Operand::sixteen(dev16(u16), p), N, F);
      cpu_->activation_backward(a, du.data(), da.data(), u.data(), N, F);
      cpu_->activation_backward_stored(a, su.data(), da.data(), Operand::sixteen(u16.data(), p), N, F);
      expect_close(host(gdu, du.size()), du, 1e-5, "du");
      EXPECT_EQ(su, du);
      // Rounded to p as it is written (the executor's call): the same bits as the float
      // op on this backend, from the same values.
      float* stored = dev(nans(du.size()));
      float* floats = dev(nans(du.size()));
      gpu_->activation_backward_stored(a, stored, dev(da), Operand::sixteen(dev16(u16), p), N, F, p);
      gpu_->activation_backward(a, floats, dev(da), dev(u), N, F, p);
      EXPECT_EQ(host(stored, du.size()), host(floats, du.size())) << "rounded to " << to_string(p);
    }
  }
}

// The ops that write their output in 16-bit storage (Backend::*_packed: the norms' and the
// activation's forwards, the activation's backward) and the bias gradient reading it
// (bias_grad_stored): on this backend the bits its float op and pack16 give (the defaults,
// Backend::*, called on the same backend), the activation's copy of u exactly pack16's of
// u, every value written (odd counts: the last 16-bit word's half); against the CPU
// backend within 16-bit tolerance.
TEST_F(CudaOps, OpsWriteSixteenBitOutputsAsPack16Would) {
  const int64_t N = 37, H = 201, F = 97;
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    SCOPED_TRACE(to_string(p));
    const Vec x = random(N * H, 2.0f), w = random(H), b = random(H);
    float *gx = dev(x), *gw = dev(w), *gb = dev(b);
    for (bool layernorm : {true, false}) {
      SCOPED_TRACE(layernorm ? "layernorm" : "rmsnorm");
      float *gmean = dev(nans(N)), *grstd = dev(nans(N)), *smean = dev(nans(N)), *srstd = dev(nans(N));
      uint16_t *o = out16(N * H), *s = out16(N * H);
      Vec out(N * H), mean(N), rstd(N);
      if (layernorm) {
        gpu_->layernorm_forward_packed(o, gmean, grstd, gx, gw, gb, N, H, p);
        gpu_->Backend::layernorm_forward_packed(s, smean, srstd, gx, gw, gb, N, H, p);
        cpu_->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, H, p);
        EXPECT_EQ(host(gmean, N), host(smean, N));
      } else {
        gpu_->rmsnorm_forward_packed(o, grstd, gx, gw, N, H, p);
        gpu_->Backend::rmsnorm_forward_packed(s, srstd, gx, gw, N, H, p);
        cpu_->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, H, p);
      }
      const std::vector<uint16_t> got = host16(o, N * H);
      EXPECT_EQ(got, host16(s, N * H));
      EXPECT_EQ(host(grstd, N), host(srstd, N));
      Vec back(N * H);
      cpu_->unpack16(back.data(), got.data(), N * H, p);
      expect_close(back, out, 1e-2, "16-bit norm output");
    }
    for (Activation a : {Activation::gelu, Activation::swiglu, Activation::geglu, Activation::squared_relu}) {
      SCOPED_TRACE(to_string(a));
      const int64_t width = gated(a) ? 2 * F : F;
      Vec u = random(N * width, 2.0f);
      cpu_->round_to(u.data(), N * width, p);
      const float* gu = dev(u);
      uint16_t *o = out16(N * F), *s = out16(N * F), *uk = out16(N * width);
      gpu_->activation_forward_packed(a, o, uk, gu, N, F, p);
      gpu_->Backend::activation_forward_packed(a, s, nullptr, gu, N, F, p);
      EXPECT_EQ(host16(o, N * F), host16(s, N * F)) << "activation";
      EXPECT_EQ(host16(uk, N * width), sixteen(u, p)) << "the kept copy of u";
      Vec act(N * F), back(N * F);
      cpu_->activation_forward(a, act.data(), u.data(), N, F, p);
      const std::vector<uint16_t> got = host16(o, N * F);
      cpu_->unpack16(back.data(), got.data(), N * F, p);
      expect_close(back, act, 1e-2, "16-bit activation");
      // The backward from u as kept, du in 16 bits; fc1's bias gradient from it.
      const Vec da = random(N * F);
      const Operand u16 = Operand::sixteen(uk, p);
      uint16_t *du = out16(N * width), *sdu = out16(N * width);
      gpu_->activation_backward_packed(a, du, dev(da), u16, N, F, p);
      gpu_->Backend::activation_backward_packed(a, sdu, dev(da), u16, N, F, p);
      EXPECT_EQ(host16(du, N * width), host16(sdu, N * width)) << "du";
      const Vec db0 = random(width);
      float *db = dev(db0), *sdb = dev(db0);
      gpu_->bias_grad_stored(db, Operand::sixteen(du, p), N, width);
      gpu_->Backend::bias_grad_stored(sdb, Operand::sixteen(du, p), N, width);
      EXPECT_EQ(host(db, width), host(sdb, width)) << "bias gradient";
    }
  }
}

// The vocab-parallel cross-entropy's three phases on a slice [lo, lo + Vt) of the
// vocabulary, with targets inside and outside the slice: the forward reads the logits only,
// the backward writes the gradient rounded to the precision (fp32: none; bf16, fp16).
void CudaOps::cross_entropy_case() {
  const int64_t N = 37, Vt = 1000, lo = 2000;
  const Vec logits = random(static_cast<size_t>(N * Vt), 3.0f);
  std::vector<int32_t> targets(static_cast<size_t>(N));
  std::uniform_int_distribution<int32_t> pick(static_cast<int32_t>(lo - Vt), static_cast<int32_t>(lo + 2 * Vt - 1));
  for (auto& x : targets) x = pick(rng_);
  auto* dt = static_cast<int32_t*>(gpu_->allocate_bytes(targets.size() * sizeof(int32_t)));
  gpu_->bytes_to_device(dt, targets.data(), targets.size() * sizeof(int32_t));
  for (Precision p : {Precision::fp32, Precision::bf16, Precision::fp16}) {
    Vec z = logits;
    float* dz = dev(z);
    Vec mx(static_cast<size_t>(N)), st(static_cast<size_t>(2 * N));
    float* dmx = dev(nans(mx.size()));
    float* dst = dev(nans(st.size()));
    gpu_->cross_entropy_max(dmx, dz, N, Vt);
    cpu_->cross_entropy_max(mx.data(), z.data(), N, Vt);
    expect_close(host(dmx, mx.size()), mx, 1e-6, "cross-entropy max");
    gpu_->cross_entropy_exp_sum(dst, dz, dmx, dt, N, Vt, lo);
    cpu_->cross_entropy_exp_sum(st.data(), z.data(), mx.data(), targets.data(), N, Vt, lo);
    expect_close(host(dst, st.size()), st, 1e-5, "cross-entropy sums and target logits");
    const Vec after = host(dz, z.size());
    EXPECT_EQ(std::memcmp(after.data(), logits.data(), logits.size() * sizeof(float)), 0) << "the forward wrote the logits";
    if (p != Precision::fp32) {
      // Written in 16-bit storage (for GEMMs that read it so), bit for bit the float op
      // and pack16 on the same backend (the default), every value written.
      uint16_t *got = out16(z.size()), *want = out16(z.size());
      gpu_->cross_entropy_backward_packed(got, dz, dmx, dst, dt, N, Vt, lo, 0.25f, p);
      float* scratch = dev(logits);
      gpu_->Backend::cross_entropy_backward_packed(want, scratch, dmx, dst, dt, N, Vt, lo, 0.25f, p);
      EXPECT_EQ(host16(got, z.size()), host16(want, z.size())) << "packed dlogits";
    }
    gpu_->cross_entropy_backward(dz, dmx, dst, dt, N, Vt, lo, 0.25f, p);
    cpu_->cross_entropy_backward(z.data(), mx.data(), st.data(), targets.data(), N, Vt, lo, 0.25f, p);
    expect_close(host(dz, z.size()), z, p == Precision::fp32 ? 1e-5 : 1e-2, "cross-entropy dlogits");
  }
  gpu_->deallocate_bytes(dt);
  // The forward in one pass (cross_entropy_one_pass) over two slices of a vocabulary of
  // 2 Vt, as two tensor-parallel ranks run it: each slice's maxima and sums, the maxima over
  // both, each slice's sums moved to them and added, against the CPU's two phases over the
  // whole vocabulary; and on one slice, against the two phases themselves.
  if (!gpu_->cross_entropy_one_pass()) return;
  const int64_t V = 2 * Vt;
  const Vec full = random(static_cast<size_t>(N * V), 3.0f);
  std::vector<int32_t> tv(static_cast<size_t>(N));
  std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(V - 1));
  for (auto& x : tv) x = any(rng_);
  auto* gt = static_cast<int32_t*>(gpu_->allocate_bytes(tv.size() * sizeof(int32_t)));
  gpu_->bytes_to_device(gt, tv.data(), tv.size() * sizeof(int32_t));
  Vec want_mx(static_cast<size_t>(N)), want_st(static_cast<size_t>(2 * N));
  cpu_->cross_entropy_max(want_mx.data(), full.data(), N, V);
  cpu_->cross_entropy_exp_sum(want_st.data(), full.data(), want_mx.data(), tv.data(), N, V, 0);
  Vec one_mx = nans(static_cast<size_t>(N)), one_st = nans(static_cast<size_t>(2 * N));
  {
    float *gz = dev(full), *gmx = dev(one_mx), *gst = dev(one_st);
    gpu_->cross_entropy_forward(gmx, gst, gz, gt, N, V, 0);
    expect_close(host(gmx, one_mx.size()), want_mx, 0.0, "one pass: maxima (exact)");
    expect_close(host(gst, one_st.size()), want_st, 1e-5, "one pass: sums and target logits");
  }
  std::vector<float*> mx(2), st(2);
  Vec top(static_cast<size_t>(N), -std::numeric_limits<float>::infinity());
  for (int r = 0; r < 2; ++r) {
    Vec slice(static_cast<size_t>(N * Vt));
    for (int64_t i = 0; i < N; ++i)
      std::copy_n(full.begin() + i * V + r * Vt, Vt, slice.begin() + i * Vt);
    float* gz = dev(slice);
    mx[r] = dev(nans(static_cast<size_t>(N)));
    st[r] = dev(nans(static_cast<size_t>(2 * N)));
    gpu_->cross_entropy_forward(mx[r], st[r], gz, gt, N, Vt, r * Vt);
    const Vec m = host(mx[r], static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) top[i] = std::max(top[i], m[i]);
  }
  float* mg = dev(top);
  Vec sum(static_cast<size_t>(2 * N), 0.0f);
  for (int r = 0; r < 2; ++r) {
    gpu_->cross_entropy_rescale(st[r], mx[r], mg, gt, N, Vt, r * Vt);
    const Vec part = host(st[r], static_cast<size_t>(2 * N));
    for (size_t k = 0; k < sum.size(); ++k) sum[k] += part[k];
  }
  expect_close(top, want_mx, 0.0, "two slices: maxima over both (exact)");
  expect_close(sum, want_st, 1e-5, "two slices: sums and target logits, moved to the maxima over both");
  gpu_->deallocate_bytes(gt);
  // Rows shorter than the block (most threads hold no value) with -inf logits among them, a
  // row of -inf but one logit, and a NaN: the maxima equal, the sums close, a NaN kept.
  {
    const int64_t n = 4, w = 100;
    const float inf = std::numeric_limits<float>::infinity();
    Vec zz = random(static_cast<size_t>(n * w), 3.0f);
    for (int64_t j = 0; j < w; j += 7) zz[static_cast<size_t>(w + j)] = -inf;  // row 1: some -inf
    for (int64_t j = 0; j < w; ++j) zz[static_cast<size_t>(2 * w + j)] = j == 37 ? 1.5f : -inf;  // row 2
    zz[static_cast<size_t>(3 * w + 50)] = std::numeric_limits<float>::quiet_NaN();  // row 3
    const std::vector<int32_t> tt = {3, 14, 37, 60};
    auto* g = static_cast<int32_t*>(gpu_->allocate_bytes(tt.size() * sizeof(int32_t)));
    gpu_->bytes_to_device(g, tt.data(), tt.size() * sizeof(int32_t));
    Vec m(static_cast<size_t>(n)), t(static_cast<size_t>(2 * n));
    cpu_->cross_entropy_max(m.data(), zz.data(), n, w);
    cpu_->cross_entropy_exp_sum(t.data(), zz.data(), m.data(), tt.data(), n, w, 0);
    float *gm = dev(nans(m.size())), *gs = dev(nans(t.size()));
    gpu_->cross_entropy_forward(gm, gs, dev(zz), g, n, w, 0);
    const Vec hm = host(gm, m.size()), hs = host(gs, t.size());
    for (int64_t i = 0; i < 3; ++i) {
      EXPECT_EQ(hm[static_cast<size_t>(i)], m[static_cast<size_t>(i)]) << "row " << i;
      for (int k = 0; k < 2; ++k) {
        const float got = hs[static_cast<size_t>(2 * i + k)], want = t[static_cast<size_t>(2 * i + k)];
        if (std::isinf(want)) EXPECT_EQ(got, want) << "row " << i << " term " << k;  // (row 1's target: -inf)
        else EXPECT_NEAR(got, want, 1e-5 * std::max(1.0f, std::fabs(want))) << "row " << i << " term " << k;
      }
    }
    EXPECT_TRUE(std::isnan(t[6])) << "(the CPU's sum over a NaN)";
    EXPECT_TRUE(std::isnan(hs[6])) << "a NaN logit's row sums to NaN";
    gpu_->deallocate_bytes(g);
  }
}
TEST_F(CudaOps, VocabParallelCrossEntropyPhases) { cross_entropy_case(); }

TEST_F(CudaOps, LayerNormForwardBackward) { layernorm_case(13, 300); }

TEST_F(CudaOps, RmsNormForwardBackward) { rmsnorm_case(11, 257); }

// The parameter gradients' column sums (reduce.cuh's column_sum: 8 columns x 128 row lanes
// per block) over many rows: lanes that each sum a dozen rows or more, a partial last column
// tile (H = 100) and a row count that is no multiple of 128 (N = 2053).
TEST_F(CudaOps, ColumnReductionsOverManyRows) {
  const int64_t N = 2053, H = 100;
  layernorm_case(N, H);
  rmsnorm_case(N, H);
  const Vec dy = random(N * H);
  Vec db = random(H);
  float *gdy = dev(dy), *gdb = dev(db);
  gpu_->bias_grad(gdb, gdy, N, H);
  cpu_->bias_grad(db.data(), dy.data(), N, H);
  expect_close(host(gdb, db.size()), db, 1e-5, "bias_grad over many rows");
}

void CudaOps::activations_case() {
  const int64_t N = 9, F = 70;
  for (Activation a : {Activation::gelu, Activation::swiglu, Activation::geglu, Activation::squared_relu}) {
    const int64_t width = gated(a) ? 2 * F : F;
    const Vec u = random(N * width, 3.0f), dout = random(N * F);
    Vec out = nans(N * F), du = nans(N * width);
    float *gu = dev(u), *gout = dev(out), *gdout = dev(dout), *gdu = dev(du);
    gpu_->activation_forward(a, gout, gu, N, F);
    cpu_->activation_forward(a, out.data(), u.data(), N, F);
    expect_close(host(gout, out.size()), out, 1e-5, "activation forward " + std::to_string(static_cast<int>(a)));
    gpu_->activation_backward(a, gdu, gdout, gu, N, F);
    cpu_->activation_backward(a, du.data(), dout.data(), u.data(), N, F);
    expect_close(host(gdu, du.size()), du, 1e-5, "activation backward " + std::to_string(static_cast<int>(a)));
  }
}
TEST_F(CudaOps, ActivationsForwardBackward) { activations_case(); }

void CudaOps::rope_case() {
  const int64_t S = 19, B = 2, heads = 3, D = 16, ld = heads * D + 5;
  Vec x = random(S * B * ld);
  const Vec x0 = x;
  float* gx = dev(x);
  for (bool inverse : {false, true}) {
    gpu_->rope(gx, S, B, heads, D, ld, inverse);
    cpu_->rope(x.data(), S, B, heads, D, ld, inverse);
    expect_close(host(gx, x.size()), x, 1e-5, inverse ? "rope inverse" : "rope");
  }
  expect_close(x, x0, 1e-5, "rope then inverse is the identity (CPU)");
}
TEST_F(CudaOps, RopeForwardAndInverse) { rope_case(); }

TEST_F(CudaOps, AttentionForwardBackwardWithAndWithoutProbs) {
  struct Shape {
    int64_t S, B, A, G, D;
  };
  // Sequences longer than a block of threads (on a GPU; shorter in the emulation), head dims
  // of 8 and 64, G = A, A/2 and 1.
  const int64_t S1 = kEmulated ? 40 : 200, S2 = kEmulated ? 33 : 150;
  for (const Shape sh : {Shape{17, 2, 4, 2, 8}, Shape{S1, 1, 4, 4, 64}, Shape{S2, 2, 4, 1, 64}})
    for (bool keep : {true, false}) attention_case(sh.S, sh.B, sh.A, sh.G, sh.D, keep);
  // A workspace of fewer S x S matrices than a row's query groups: the groups in passes of
  // two (the last of one: 5 groups) and of one (attention_plan.h), kept and recomputed.
  const int64_t S = 19;
  for (const int64_t fit : {2, 1}) {
    SCOPED_TRACE(::testing::Message() << "passes of " << fit << " group(s)");
    gpu_->set_attention_workspace_limit(static_cast<size_t>(fit * S * S) * sizeof(float));
    for (bool keep : {true, false}) attention_case(S, 2, 10, 5, 8, keep);
  }
  gpu_->set_attention_workspace_limit(static_cast<size_t>(cuda::kUnfusedAttentionWorkspaceBytes));
}

// In a 16-bit plan the unfused attention's products run on the tensor cores (cuBLASLt
// rounds P and dS to 16 bits, accumulates in fp32): on bf16/fp16-rounded qkv and dout, as
// the executor passes them, within the 16-bit tolerance of the CPU's fp32 attention,
// G = A, A / 2 and 1 (one product per batch), a head dim of 8 on 4-byte-aligned views,
// probabilities kept and recomputed.
TEST_F(CudaOps, AttentionOnTensorCoresIn16Bit) {
  struct Shape {
    int64_t S, B, A, G, D;
  };
  const int64_t S1 = kEmulated ? 33 : 130;
  for (Precision p : {Precision::bf16, Precision::fp16})
    for (const Shape sh :
         {Shape{S1, 2, 4, 4, 64}, Shape{S1, 2, 4, 2, 64}, Shape{S1, 1, 4, 1, 64}, Shape{17, 2, 4, 2, 8}})
      for (bool keep : {true, false}) {
        const int64_t S = sh.S, B = sh.B, A = sh.A, G = sh.G, D = sh.D;
        const std::string what = std::string(to_string(p)) + " attention S=" + std::to_string(S) + " G=" +
                                 std::to_string(G) + " D=" + std::to_string(D) + (keep ? "" : " (recomputed)");
        Vec qkv = random(static_cast<size_t>(S * B * (A + 2 * G) * D)), dout = random(static_cast<size_t>(S * B * A * D));
        cpu_->round_to(qkv.data(), static_cast<int64_t>(qkv.size()), p);
        cpu_->round_to(dout.data(), static_cast<int64_t>(dout.size()), p);
        Vec out = nans(static_cast<size_t>(S * B * A * D)), probs = nans(static_cast<size_t>(B * A * S * S)), dqkv = nans(qkv.size());
        float *gqkv = dev(qkv), *gout = dev(out), *gprobs = dev(probs), *gdout = dev(dout), *gdqkv = dev(dqkv);
        gpu_->set_gemm_precision(p);
        gpu_->attention_forward(gout, keep ? gprobs : nullptr, gqkv, S, B, A, G, D);
        gpu_->attention_backward(gdqkv, gdout, keep ? gprobs : nullptr, gqkv, S, B, A, G, D);
        gpu_->set_gemm_precision(Precision::fp32);
        cpu_->attention_forward(out.data(), keep ? probs.data() : nullptr, qkv.data(), S, B, A, G, D);
        cpu_->attention_backward(dqkv.data(), dout.data(), keep ? probs.data() : nullptr, qkv.data(), S, B, A, G, D);
        expect_close(host(gout, out.size()), out, 1e-2, what + " out");
        if (keep) expect_close(host(gprobs, probs.size()), probs, 1e-2, what + " probs");
        expect_close(host(gdqkv, dqkv.size()), dqkv, 1e-2, what + " dqkv");
      }
}

// The tiled, fused kernels against the CPU's attention: tile boundaries crossed (T = 32 for
// D <= 64, 16 above), G = A, A/2, 1, head dims 16, 64 and 128, and a sequence longer than
// the unfused kernel takes (8192), where no S x S buffer exists on the GPU. lse against a
// naive host computation on the shorter shapes.
TEST_F(CudaOps, FlashAttentionForwardBackward) {
  struct Shape {
    int64_t S, B, A, G, D;
  };
  std::vector<Shape> shapes = {Shape{33, 2, 4, 2, 16}, Shape{100, 1, 2, 1, 64}, Shape{70, 2, 4, 4, 128}};
  if (!kEmulated) shapes.push_back(Shape{9000, 1, 1, 1, 16});
  for (const Shape sh : shapes) {
    const int64_t S = sh.S, B = sh.B, A = sh.A, G = sh.G, D = sh.D;
    const std::string what = "flash S=" + std::to_string(S) + " D=" + std::to_string(D) + " G=" + std::to_string(G);
    const Vec qkv = random(static_cast<size_t>(S * B * (A + 2 * G) * D)), dout = random(static_cast<size_t>(S * B * A * D));
    Vec out = nans(static_cast<size_t>(S * B * A * D)), dqkv = nans(qkv.size());
    float *gqkv = dev(qkv), *gout = dev(out), *gdout = dev(dout), *gdqkv = dev(dqkv);
    float* glse = dev(nans(static_cast<size_t>(B * A * S)));
    gpu_->flash_attention_forward(gout, glse, gqkv, S, B, A, G, D);
    cpu_->attention_forward(out.data(), nullptr, qkv.data(), S, B, A, G, D);
    expect_close(host(gout, out.size()), out, 1e-5, what + " out");
    gpu_->flash_attention_backward(gdqkv, gdout, gout, glse, gqkv, S, B, A, G, D);
    cpu_->attention_backward(dqkv.data(), dout.data(), nullptr, qkv.data(), S, B, A, G, D);
    expect_close(host(gdqkv, dqkv.size()), dqkv, 1e-5, what + " dqkv");
    // The CPU backend's fused attention (checked against the double reference, lse included,
    // in executor_test): the lse, and the backward again.
    Vec cout(out.size()), clse(static_cast<size_t>(B * A * S)), cdqkv(qkv.size());
    cpu_->flash_attention_forward(cout.data(), clse.data(), qkv.data(), S, B, A, G, D);
    expect_close(host(glse, clse.size()), clse, 1e-5, what + " lse vs the CPU's fused");
    cpu_->flash_attention_backward(cdqkv.data(), dout.data(), cout.data(), clse.data(), qkv.data(), S, B, A, G, D);
    expect_close(host(gdqkv, dqkv.size()), cdqkv, 1e-5, what + " dqkv vs the CPU's fused");
  }
}

// In a 16-bit plan the fused attention's products run on the tensor cores
// (flash_attention_tc.cu: Q, K, V, dO, P and dS in 16 bits, fp32 accumulation): on rounded
// qkv and dout, as the executor passes them, within the 16-bit tolerance of the
// CPU's fp32 attention; the lse (from fp32 scores of exactly multiplied 16-bit operands)
// closer. Tiles of 64 crossed (S = 130, 1030), exactly filled (128) and not filled (5, 33,
// 70), every head dim the kernels take (16, 32, 64, 128), G = A, A/2, A/4 and 1; scores
// spread wide (qkv of standard deviation 2) so the running maximum moves; qkv and dout as
// 16-byte aligned buffers (float4 loads) and as views one float in (S = 33).
TEST_F(CudaOps, FlashAttentionOnTensorCoresIn16Bit) {
  {
    const std::string why = gpu_->flash_tensor_core_reason(64);
    if (!why.empty()) GTEST_SKIP() << "the tensor-core flash kernels do not run here: " << why;
  }
  struct Shape {
    int64_t S, B, A, G, D;
  };
  std::vector<Shape> shapes = {Shape{70, 1, 2, 1, 128}, Shape{33, 2, 4, 4, 16}, Shape{5, 2, 2, 1, 32}};
  if (!kEmulated)  // (the kernels' emulation test takes these shapes on the CPU)
    shapes.insert(shapes.end(), {Shape{130, 2, 4, 2, 64}, Shape{100, 1, 2, 2, 32}, Shape{1030, 1, 2, 1, 64},
                                 Shape{128, 1, 8, 2, 64}});
  for (Precision p : {Precision::bf16, Precision::fp16})
    for (const Shape sh : shapes) {
      const int64_t S = sh.S, B = sh.B, A = sh.A, G = sh.G, D = sh.D;
      const std::string what = std::string(to_string(p)) + " flash S=" + std::to_string(S) + " D=" + std::to_string(D) +
                               " A=" + std::to_string(A) + " G=" + std::to_string(G);
      if (const std::string why = gpu_->flash_tensor_core_reason(D); !why.empty()) {
        // (a device whose shared memory per block is below the D = 128 kernels')
        std::printf("  %s: not on the tensor cores here (%s), not checked\n", what.c_str(), why.c_str());
        continue;
      }
      Vec qkv = random(static_cast<size_t>(S * B * (A + 2 * G) * D), 2.0f), dout = random(static_cast<size_t>(S * B * A * D));
      cpu_->round_to(qkv.data(), static_cast<int64_t>(qkv.size()), p);
      cpu_->round_to(dout.data(), static_cast<int64_t>(dout.size()), p);
      Vec out = nans(static_cast<size_t>(S * B * A * D)), dqkv = nans(qkv.size());
      float *gqkv = dev(qkv), *gout = dev(out), *gdout = dev(dout), *gdqkv = dev(dqkv);
      if (S == 33) {  // views one float into their buffers: the loads' scalar path
        Vec q1(qkv.size() + 1, 0.0f), d1(dout.size() + 1, 0.0f);
        std::copy(qkv.begin(), qkv.end(), q1.begin() + 1);
        std::copy(dout.begin(), dout.end(), d1.begin() + 1);
        gqkv = dev(q1) + 1;
        gdout = dev(d1) + 1;
      }
      float* glse = dev(nans(static_cast<size_t>(B * A * S)));
      gpu_->set_gemm_precision(p);
      EXPECT_TRUE(gpu_->flash_on_tensor_cores(D)) << what << ": the fp32 kernels ran instead ("
                                                  << gpu_->flash_tensor_core_reason(D) << ")";
      gpu_->flash_attention_forward(gout, glse, gqkv, S, B, A, G, D);
      gpu_->flash_attention_backward(gdqkv, gdout, gout, glse, gqkv, S, B, A, G, D);
      gpu_->set_gemm_precision(Precision::fp32);
      Vec cout(out.size()), clse(static_cast<size_t>(B * A * S)), cdqkv(qkv.size());
      cpu_->flash_attention_forward(cout.data(), clse.data(), qkv.data(), S, B, A, G, D);
      cpu_->flash_attention_backward(cdqkv.data(), dout.data(), cout.data(), clse.data(), qkv.data(), S, B, A, G, D);
      expect_close(host(gout, out.size()), cout, 1e-2, what + " out");
      expect_close(host(glse, clse.size()), clse, 1e-4, what + " lse");
      // dQ, dK and dV each against its own largest value.
      const Vec got = host(gdqkv, dqkv.size());
      for (int part = 0; part < 3; ++part)
        expect_close(testing::qkv_part(got, S * B, A, G, D, part), testing::qkv_part(cdqkv, S * B, A, G, D, part), 1e-2,
                     what + " " + testing::qkv_part_name(part));
    }
  EXPECT_FALSE(gpu_->flash_on_tensor_cores(64)) << "fp32 plans keep the fp32 kernels";
}

// The fused attention on 16-bit qkv and output as stored (Backend::flash_*_stored): where the
// tensor-core kernels read them (flash_reads_16bit: their own type), the same bits as on the
// rounded floats (a kernel converts each float to that type, exactly, as it loads it; the
// backward's delta reads the output either way), dqkv within atomics' order; qkv in the
// other 16-bit type (or for the fp32 kernels) unpacked first, the same values again.
TEST_F(CudaOps, FlashAttentionReadsSixteenBitInputsAsStored) {
  const int64_t S = 40, B = 1, A = 2, G = 1;
  for (const int64_t D : {int64_t{64}, int64_t{24}})  // (24: no tensor-core kernel, the fp32 ones)
    for (Precision p : {Precision::bf16, Precision::fp16}) {
      const std::string what = std::string(to_string(p)) + " D=" + std::to_string(D);
      SCOPED_TRACE(what);
      const size_t nq = static_cast<size_t>(S * B * (A + 2 * G) * D), no = static_cast<size_t>(S * B * A * D);
      // Multiples of 1/64 below 4 (8 significant bits): exact in bf16 and in fp16 alike.
      Vec qkv = random(nq, 1.5f), dout = random(no);
      for (float& x : qkv) x = std::round(std::clamp(x, -3.95f, 3.95f) * 64.0f) / 64.0f;
      cpu_->round_to(dout.data(), static_cast<int64_t>(no), p);
      gpu_->set_gemm_precision(p);
      const bool tc = gpu_->flash_on_tensor_cores(D);
      EXPECT_EQ(tc, D == 64 && gpu_->flash_tensor_core_reason(D).empty());
      EXPECT_EQ(gpu_->flash_reads_16bit(D, p), tc);
      EXPECT_FALSE(gpu_->flash_reads_16bit(D, p == Precision::bf16 ? Precision::fp16 : Precision::bf16));
      const float *gqkv = dev(qkv), *gdout = dev(dout);
      float *out = dev(nans(no)), *lse = dev(nans(static_cast<size_t>(B * A * S))), *dqkv = dev(nans(nq));
      gpu_->flash_attention_forward(out, lse, gqkv, S, B, A, G, D);
      Vec o = host(out, no);
      cpu_->round_to(o.data(), static_cast<int64_t>(no), p);  // the output as the executor keeps it
      const float* go = dev(o);
      gpu_->flash_attention_backward(dqkv, gdout, go, lse, gqkv, S, B, A, G, D);
      const Vec want_out = host(out, no), want_lse = host(lse, static_cast<size_t>(B * A * S)), want_d = host(dqkv, nq);
      // The output in the plan's type (as the executor keeps it), qkv in it and in the other.
      const Operand o16 = Operand::sixteen(dev16(sixteen(o, p)), p);
      // floats through the same calls: the ops above
      float* dqkv3 = dev(nans(nq));
      gpu_->flash_attention_backward_stored(dqkv3, gdout, Operand::floats(go), lse, Operand::floats(gqkv), S, B, A, G,
                                            D);
      expect_close(host(dqkv3, nq), want_d, 1e-5, what + " dqkv from floats");
      std::vector<Precision> storages = {p};
      if (p == Precision::bf16) storages.push_back(Precision::fp16);  // (the other type once)
      for (Precision stored : storages) {
        SCOPED_TRACE(std::string("qkv stored as ") + to_string(stored));
        Vec q2 = qkv;
        cpu_->round_to(q2.data(), static_cast<int64_t>(nq), stored);
        ASSERT_EQ(q2, qkv) << "the values are exact in " << to_string(stored);
        const Operand q16 = Operand::sixteen(dev16(sixteen(qkv, stored)), stored);
        float *out2 = dev(nans(no)), *lse2 = dev(nans(static_cast<size_t>(B * A * S))), *dqkv2 = dev(nans(nq));
        gpu_->flash_attention_forward_stored(out2, lse2, q16, S, B, A, G, D);
        EXPECT_EQ(host(out2, no), want_out);
        EXPECT_EQ(host(lse2, static_cast<size_t>(B * A * S)), want_lse);
        gpu_->flash_attention_backward_stored(dqkv2, gdout, o16, lse, q16, S, B, A, G, D);
        expect_close(host(dqkv2, nq), want_d, 1e-5, what + " dqkv");
      }
      gpu_->set_gemm_precision(Precision::fp32);
    }
}

// The executor's buffers come from a stream-ordered pool per memory category: each pool
// reports its own peak, a freed block is reused rather than reserved again, and
// allocations are zeroed.
TEST_F(CudaOps, PoolsKeepThePeakOfEachCategory) {
  Backend::DeviceMemory before;
  ASSERT_TRUE(gpu_->device_memory(&before));
  const int64_t big = 1 << 20, small = 1 << 18;  // 4 MiB and 1 MiB
  float* a = gpu_->allocate_in(big, 3);
  float* b = gpu_->allocate_in(small, 0);
  EXPECT_EQ(host(a, static_cast<size_t>(big)), Vec(static_cast<size_t>(big), 0.0f));
  gpu_->deallocate(a);
  gpu_->deallocate(b);
  gpu_->synchronise();
  Backend::DeviceMemory mid;
  ASSERT_TRUE(gpu_->device_memory(&mid));
  EXPECT_GE(mid.used_peak[3], big * 4);
  EXPECT_LT(mid.used_peak[3], big * 4 + (2 << 20));  // allocation granularity at most 2 MiB
  EXPECT_GE(mid.used_peak[0], small * 4);
  EXPECT_GE(mid.reserved_peak[3], mid.used_peak[3]);
  EXPECT_EQ(mid.used_peak[1], before.used_peak[1]);  // no gradient was allocated
  EXPECT_GT(mid.total, 0);
  EXPECT_LE(mid.free, mid.total);
  float* c = gpu_->allocate_in(big, 3);  // the freed block again
  gpu_->deallocate(c);
  gpu_->synchronise();
  Backend::DeviceMemory after;
  ASSERT_TRUE(gpu_->device_memory(&after));
  EXPECT_EQ(after.reserved_peak[3], mid.reserved_peak[3]);
  EXPECT_EQ(after.used_peak[3], mid.used_peak[3]);
}

#ifdef STRATA_CUDA_EMULATION
// When the device is full, an allocation releases what every pool keeps freed and tries
// again (cuda_backend.cpp's pool_alloc): here on an emulated device of 10 MiB more than the
// backend holds, one pool keeping 6 MiB freed, another asking for 6 MiB.
TEST_F(CudaOps, AFullDeviceTrimsThePoolsAndRetries) {
  if (std::getenv("STRATA_CUDA_POOLS") != nullptr) GTEST_SKIP() << "the pools' case (STRATA_CUDA_POOLS is set)";
  struct Restore {
    size_t bytes = cuda_emu::device_bytes;
    ~Restore() { cuda_emu::device_bytes = bytes; }
  } restore;
  cuda_emu::device_bytes = cuda_emu::device_held + (size_t{10} << 20);
  const int64_t n = int64_t{6} << 18;  // 6 MiB of floats
  float* a = gpu_->allocate_in(n, 3);
  gpu_->deallocate(a);  // kept by pool 3
  Backend::DeviceMemory before;
  ASSERT_TRUE(gpu_->device_memory(&before));
  EXPECT_LT(before.free, int64_t{6} << 20);  // the 6 MiB do not fit beside pool 3's reserve
  float* b = gpu_->allocate_in(n, 0);  // runs out, trims, retries
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(host(b, static_cast<size_t>(n)), Vec(static_cast<size_t>(n), 0.0f));
  gpu_->deallocate(b);
  // Beyond what the device has even after the trim: the backend's error, naming the pool.
  try {
    gpu_->allocate_in(int64_t{3} << 20, 1);  // 12 MiB
    ADD_FAILURE() << "no error for 12 MiB on a device of 10";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("gradients"), std::string::npos) << e.what();
  }
}

// A host pointer where device memory belongs (or bytes past a device buffer's end): on a
// GPU an illegal address in a kernel, an invalid value in a copy; in the emulation, whose
// memory is all the host's, only cuda_emulation.h's check_device_pointers shows it. Each
// planted misuse below must fail, naming what; the same calls on device buffers pass.
TEST_F(CudaOps, HostPointersWhereDeviceMemoryBelongsFail) {
  const int64_t n = 1000;
  const Vec a = random(n), b = random(n);
  Vec on_host = nans(n);
  float *da = dev(a), *db = dev(b), *dout = dev(nans(n));
  auto fails = [](const char* what, const std::string& says, auto&& call) {
    try {
      call();
      ADD_FAILURE() << what << ": no error";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << what << ": " << e.what();
    }
  };
  // What is right passes.
  gpu_->add(dout, da, db, n);
  gpu_->copy(dout, da, n);
  gpu_->gemm(false, true, 20, 25, 40, 1.0f, da, 40, db, 40, 0.0f, dout, 25);
  EXPECT_EQ(host(dout, 1).size(), 1u);
  // A kernel's argument: the output, then an input, on the host.
  fails("add into host memory", "argument 0 points outside device memory", [&] { gpu_->add(on_host.data(), da, db, n); });
  fails("add from host memory", "argument 2 points outside device memory", [&] { gpu_->add(dout, da, b.data(), n); });
  // Copies of the wrong kind, and past a buffer's end.
  fails("to_device into host memory", "cudaMemcpyAsync", [&] { gpu_->to_device(on_host.data(), a.data(), n); });
  fails("to_host from host memory", "cudaMemcpyAsync", [&] { gpu_->to_host(on_host.data(), a.data(), n); });
  fails("to_device from device memory", "cudaMemcpyAsync", [&] { gpu_->to_device(dout, da, n); });
  fails("a device copy one value past the end", "cudaMemcpyAsync", [&] { gpu_->copy(dout + 1, da, n); });
  fails("a device copy from the host", "cudaMemcpyAsync", [&] { gpu_->copy(dout, a.data(), n); });
  fails("zeroing host memory", "cudaMemsetAsync", [&] { gpu_->fill_zero(on_host.data(), n); });
  fails("zeroing past the end", "cudaMemsetAsync", [&] { gpu_->fill_zero(da + 1, n); });
  // cuBLASLt's operands: A on the host; C (= D) reaching past its buffer by a row.
  fails("a GEMM reading the host", "Matmul", [&] {
    gpu_->gemm(false, true, 20, 25, 40, 1.0f, a.data(), 40, db, 40, 0.0f, dout, 25);
  });
  fails("a GEMM writing a value past the end", "Matmul", [&] {
    gpu_->gemm(false, true, 20, 25, 40, 1.0f, da, 40, db, 40, 0.0f, dout + 501, 25);
  });
  for (float x : on_host) EXPECT_TRUE(std::isnan(x)) << "host memory written";
}
#endif

void CudaOps::attention_case(int64_t S, int64_t B, int64_t A, int64_t G, int64_t D, bool keep) {
  const Vec qkv = random(S * B * (A + 2 * G) * D), dout = random(S * B * A * D);
  {
    Vec out = nans(S * B * A * D), probs = nans(B * A * S * S), dqkv = nans(qkv.size());
    float *gqkv = dev(qkv), *gout = dev(out), *gprobs = dev(probs), *gdout = dev(dout), *gdqkv = dev(dqkv);
    gpu_->attention_forward(gout, keep ? gprobs : nullptr, gqkv, S, B, A, G, D);
    cpu_->attention_forward(out.data(), keep ? probs.data() : nullptr, qkv.data(), S, B, A, G, D);
    expect_close(host(gout, out.size()), out, 1e-5, keep ? "attention out" : "attention out (no probs)");
    if (keep) expect_close(host(gprobs, probs.size()), probs, 1e-5, "attention probs");
    gpu_->attention_backward(gdqkv, gdout, keep ? gprobs : nullptr, gqkv, S, B, A, G, D);
    cpu_->attention_backward(dqkv.data(), dout.data(), keep ? probs.data() : nullptr, qkv.data(), S, B, A, G, D);
    expect_close(host(gdqkv, dqkv.size()), dqkv, 1e-5, keep ? "attention dqkv" : "attention dqkv (recomputed)");
  }
}

TEST_F(CudaOps, AdamWMatchesTheCpuStep) {
  const int64_t n = 1000;
  Vec p = random(n), m = random(n, 0.01f), v = random(n, 0.01f);
  for (float& x : v) x = x * x;
  const Vec g = random(n);
  // The flags as bits from bit 5 of the mask on (an owned block's, one unit in).
  const int64_t first = 5;
  std::vector<uint8_t> flags(static_cast<size_t>(first + n));
  for (size_t i = 0; i < flags.size(); ++i) flags[i] = static_cast<uint8_t>(i % 3 != 0);
  const std::vector<uint8_t> decay = pack_flags(flags);
  float *gp = dev(p), *gm = dev(m), *gv = dev(v), *gg = dev(g);
  auto* gdecay = static_cast<uint8_t*>(gpu_->allocate_bytes(decay.size()));
  gpu_->bytes_to_device(gdecay, decay.data(), decay.size());
  AdamW opt;
  gpu_->adamw(gp, gg, gm, gv, FlagBits{gdecay, first}, n, opt, 3e-4, 3, 0.5f);
  adamw_update(p.data(), g.data(), m.data(), v.data(), FlagBits{decay.data(), first}, n, opt, 3e-4, 3, 0.5f);
  expect_close(host(gp, p.size()), p, 1e-5, "adamw p");
  expect_close(host(gm, m.size()), m, 1e-5, "adamw m");
  expect_close(host(gv, v.size()), v, 1e-5, "adamw v");
  gpu_->deallocate_bytes(gdecay);
}

// (The second size is past the kernel's grid of 1024 blocks of 256 threads: its threads
// take a second and a third value each, a non-finite one among them.)
TEST_F(CudaOps, GradNormTermsMatchTheCpu) {
  for (const int64_t n : {int64_t{100003}, int64_t{2 * 1024 * 256 + 777}}) {
    SCOPED_TRACE(::testing::Message() << "n = " << n);
    Vec g = random(n);
    g[17] = std::numeric_limits<float>::quiet_NaN();
    g[50000] = std::numeric_limits<float>::infinity();
    g[n - 1] = -std::numeric_limits<float>::infinity();
    if (n > 1024 * 256) g[1024 * 256 + 5] = std::numeric_limits<float>::quiet_NaN();
    const int64_t first = 11;  // bits from bit 11 on
    std::vector<uint8_t> flags(static_cast<size_t>(first + n));
    for (size_t i = 0; i < flags.size(); ++i) flags[i] = static_cast<uint8_t>(i % 4 != 1);
    const std::vector<uint8_t> counted = pack_flags(flags);
    float* gg = dev(g);
    auto* gc = static_cast<uint8_t*>(gpu_->allocate_bytes(counted.size()));
    gpu_->bytes_to_device(gc, counted.data(), counted.size());
    double got[2] = {1.0, 2.0}, want[2] = {1.0, 2.0};  // both add to what is there
    gpu_->grad_norm_terms(gg, FlagBits{gc, first}, n, got);
    grad_norm_terms(g.data(), FlagBits{counted.data(), first}, n, want);
    EXPECT_NEAR(got[0], want[0], 1e-10 * want[0]);  // double sums on both sides, in other orders
    EXPECT_EQ(got[1], want[1]);
    EXPECT_EQ(want[1], n > 1024 * 256 ? 6.0 : 5.0);  // 2 + the non-finite values
    gpu_->deallocate_bytes(gc);
  }
}

void CudaOps::embedding_case() {
  const int64_t S = 7, B = 3, H = 16, Vt = 50, lo = 50;
  std::vector<int32_t> tokens(static_cast<size_t>(B * S));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 37 + 11) % 150);  // some repeat
  tokens[3] = tokens[5] = 60;
  const Vec wte = random(Vt * H), dx = random(S * B * H);
  Vec x = nans(static_cast<size_t>(S * B * H)), dwte = random(static_cast<size_t>(Vt * H));
  const Vec dwte0 = dwte;
  cpu_->embedding_forward(x.data(), wte.data(), tokens.data(), S, B, H, lo, Vt);
  cpu_->embedding_backward(dwte.data(), dx.data(), tokens.data(), S, B, H, lo, Vt);
  float *gw = dev(wte), *gx = dev(nans(x.size())), *gdx = dev(dx), *gdw = dev(dwte0);
  auto* gt = static_cast<int32_t*>(gpu_->allocate_bytes(tokens.size() * sizeof(int32_t)));
  gpu_->bytes_to_device(gt, tokens.data(), tokens.size() * sizeof(int32_t));
  gpu_->embedding_forward(gx, gw, gt, S, B, H, lo, Vt);
  expect_close(host(gx, x.size()), x, 0.0, "embedding forward (a copy: exact)");
  gpu_->embedding_backward(gdw, gdx, gt, S, B, H, lo, Vt);
  expect_close(host(gdw, dwte.size()), dwte, 1e-6, "embedding backward");
  gpu_->deallocate_bytes(gt);
}
TEST_F(CudaOps, EmbeddingOfAVocabularySliceForwardBackward) { embedding_case(); }

// Residual add, bias add and gradient, learned positions and their gradient (with the
// row offset of a sequence-parallel rank), copy.
void CudaOps::elementwise_case() {
  const int64_t N = 45, F = 70, H = 24, B = 3, n = 20, row0 = 7;  // rows 7..26: positions 2..8, partial at both ends
  const Vec a = random(static_cast<size_t>(N * F)), b = random(static_cast<size_t>(N * F)), bias = random(static_cast<size_t>(F));
  Vec sum = nans(a.size()), y = a, db = random(static_cast<size_t>(F));
  float *ga = dev(a), *gb = dev(b), *gsum = dev(sum), *gy = dev(y), *gbias = dev(bias), *gdb = dev(db);
  gpu_->add(gsum, ga, gb, N * F);
  cpu_->add(sum.data(), a.data(), b.data(), N * F);
  expect_close(host(gsum, sum.size()), sum, 1e-6, "add");
  gpu_->add_bias(gy, gbias, N, F);
  cpu_->add_bias(y.data(), bias.data(), N, F);
  expect_close(host(gy, y.size()), y, 1e-6, "add_bias");
  gpu_->bias_grad(gdb, ga, N, F);
  cpu_->bias_grad(db.data(), a.data(), N, F);
  expect_close(host(gdb, db.size()), db, 1e-5, "bias_grad");
  Vec cp = nans(a.size());
  float* gcp = dev(cp);
  gpu_->copy(gcp, ga, N * F);
  expect_close(host(gcp, cp.size()), a, 0.0, "copy (exact)");
  const int64_t S = (row0 + n - 1) / B + 2;
  const Vec x = random(static_cast<size_t>(n * H)), P = random(static_cast<size_t>(S * H)), dx = random(static_cast<size_t>(n * H));
  Vec out = nans(x.size()), dP = random(P.size());
  float *gx = dev(x), *gP = dev(P), *gout = dev(out), *gdx = dev(dx), *gdP = dev(dP);
  gpu_->add_positions(gout, gx, gP, n, H, B, row0);
  cpu_->add_positions(out.data(), x.data(), P.data(), n, H, B, row0);
  expect_close(host(gout, out.size()), out, 1e-6, "add_positions");
  gpu_->position_grad(gdP, gdx, n, H, B, row0);
  cpu_->position_grad(dP.data(), dx.data(), n, H, B, row0);
  expect_close(host(gdP, dP.size()), dP, 1e-5, "position_grad");
}
TEST_F(CudaOps, ElementwiseOpsOfTheLayer) { elementwise_case(); }

// The element-wise kernels over rows (reduce.cuh's row_grid: no division per element) with
// their grid cut to 1 and 3 blocks along y, so that each thread steps through many rows
// (past 65,535 blocks on a GPU): the same cases against the CPU backend as above.
TEST_F(CudaOps, RowKernelsStepThroughRowsPastTheirGrid) {
  struct Restore {
    CudaBackend* be;
    ~Restore() { be->set_row_grid_limit(65535); }
  } restore{gpu_.get()};
  for (unsigned limit : {1u, 3u}) {
    SCOPED_TRACE(::testing::Message() << "row grid of " << limit);
    gpu_->set_row_grid_limit(limit);
    gemm_views_case();
    gemm_16bit_case();
    cross_entropy_case();
    activations_case();
    rope_case();
    embedding_case();
    elementwise_case();
  }
}

// The ops that round their output to a 16-bit precision as they write it (backend.h's
// `round`: the norms, the activation and its backward, the residual and bias adds): on each
// backend the rounded output is, bit for bit, the unrounded one after round_to, in bf16 and
// fp16 (values scaled so that fp16 rounds and some overflow: its inf kept).
TEST_F(CudaOps, OutputsRoundedAsTheyAreWritten) {
  const int64_t N = 37, H = 70, F = 45;
  const Vec x = random(N * H, 3.0f), w = random(H, 2.0f), b = random(H), u = random(N * 2 * F, 2.0f);
  const Vec dout = random(N * F, 3e4f), a = random(N * H, 4e4f), bias = random(H, 4e4f);
  float *gx = dev(x), *gw = dev(w), *gb = dev(b), *gu = dev(u), *gdout = dev(dout), *ga = dev(a), *gbias = dev(bias);
  float *gout = dev(nans(N * 2 * F)), *gstat = dev(nans(2 * N)), *gref = dev(nans(N * 2 * F));
  Vec out(N * 2 * F), stat(2 * N), ref(N * 2 * F);
  // Runs op(outputs, round) on both backends, unrounded and rounded, and compares n values.
  auto check = [&](const char* what, int64_t n, Precision p, auto&& op) {
    SCOPED_TRACE(::testing::Message() << what << " in " << to_string(p));
    for (Backend* be : {static_cast<Backend*>(gpu_.get()), cpu_.get()}) {
      const bool gpu = be == gpu_.get();
      float* o = gpu ? gout : out.data();
      float* r = gpu ? gref : ref.data();
      float* st = gpu ? gstat : stat.data();
      op(be, r, st, Precision::fp32, gpu);
      be->round_to(r, n, p);
      op(be, o, st, p, gpu);
      const Vec got = gpu ? host(o, static_cast<size_t>(n)) : Vec(o, o + n);
      const Vec want = gpu ? host(r, static_cast<size_t>(n)) : Vec(r, r + n);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), static_cast<size_t>(n) * sizeof(float)), 0)
          << (gpu ? "GPU" : "CPU") << ": not the unrounded output rounded";
    }
  };
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    check("layernorm", N * H, p, [&](Backend* be, float* o, float* st, Precision r, bool g) {
      be->layernorm_forward(o, st, st + N, g ? gx : x.data(), g ? gw : w.data(), g ? gb : b.data(), N, H, r);
    });
    check("rmsnorm", N * H, p, [&](Backend* be, float* o, float* st, Precision r, bool g) {
      be->rmsnorm_forward(o, st, g ? gx : x.data(), g ? gw : w.data(), N, H, r);
    });
    for (Activation act : {Activation::gelu, Activation::swiglu, Activation::squared_relu}) {
      const int64_t width = gated(act) ? 2 * F : F;
      check("activation", N * F, p, [&](Backend* be, float* o, float*, Precision r, bool g) {
        be->activation_forward(act, o, g ? gu : u.data(), N, F, r);
      });
      check("activation backward", N * width, p, [&](Backend* be, float* o, float*, Precision r, bool g) {
        be->activation_backward(act, o, g ? gdout : dout.data(), g ? gu : u.data(), N, F, r);
      });
    }
    check("add", N * H, p, [&](Backend* be, float* o, float*, Precision r, bool g) {
      be->add(o, g ? ga : a.data(), g ? gx : x.data(), N * H, r);
    });
    check("add_bias", N * H, p, [&](Backend* be, float* o, float*, Precision r, bool g) {
      be->copy(o, g ? ga : a.data(), N * H);
      be->add_bias(o, g ? gbias : bias.data(), N, H, r);
    });
  }
  bool overflowed = false;  // (the fp16 cases reach past 65504 somewhere)
  for (float v : ref) overflowed = overflowed || std::isinf(v);
  EXPECT_TRUE(overflowed);
}

TEST_F(CudaOps, RoundingToBf16AndFp16IsBitwiseTheCpus) {
  Vec x = random(4096, 100.0f);
  for (float v : {70000.0f, 65519.0f, 65520.0f,  // fp16: overflow to inf, the largest finite, the tie
                  -1e-8f, 3e-7f, 1e-5f,              // below fp16's subnormals, subnormal, normal
                  1.00390625f,                       // 1 + 2^-8: a bf16 tie (to even: 1)
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN()})
    x.push_back(v);
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    Vec c = x;
    float* g = dev(x);
    gpu_->round_to(g, static_cast<int64_t>(x.size()), p);
    cpu_->round_to(c.data(), static_cast<int64_t>(c.size()), p);
    const Vec got = host(g, x.size());
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(std::memcmp(&got[i], &c[i], 4), 0) << (p == Precision::bf16 ? "bf16 " : "fp16 ") << x[i];
  }
}

// 16-bit storage of saved activations: the GPU's 2-byte patterns are the CPU's, and a Buf
// packed and unpacked in device memory comes back as the rounded values.
TEST_F(CudaOps, Pack16IsBitwiseTheCpus) {
  Vec x = random(4097, 100.0f);
  for (float v : {70000.0f, 65520.0f, 1.00390625f, -1e-8f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::signaling_NaN()})
    x.push_back(v);
  const int64_t n = static_cast<int64_t>(x.size());
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    std::vector<uint16_t> want(x.size()), got(x.size());
    cpu_->pack16(want.data(), x.data(), n, p);
    float* g = dev(x);
    float* packed = dev(Vec((x.size() + 1) / 2));
    gpu_->pack16(reinterpret_cast<uint16_t*>(packed), g, n, p);
    const Vec words = host(packed, (x.size() + 1) / 2);
    std::memcpy(got.data(), words.data(), got.size() * 2);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got[i], want[i]) << (p == Precision::bf16 ? "bf16 " : "fp16 ") << x[i];
    float* back = dev(nans(x.size()));
    gpu_->unpack16(back, reinterpret_cast<const uint16_t*>(packed), n, p);
    Vec cback(x.size());
    cpu_->unpack16(cback.data(), want.data(), n, p);
    const Vec gback = host(back, x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(cback[i])) {  // a NaN's payload may differ
        ASSERT_TRUE(std::isnan(gback[i])) << i;
        continue;
      }
      ASSERT_EQ(std::memcmp(&gback[i], &cback[i], 4), 0) << (p == Precision::bf16 ? "bf16 " : "fp16 ") << x[i];
    }
  }
  MemoryTracker t;
  t.set_backend(gpu_.get());
  Buf b(&t, MemCategory::activations, n, 2);
  gpu_->to_device(b.data(), x.data(), n);
  b.pack(Precision::bf16);
  EXPECT_TRUE(b.packed());
  EXPECT_EQ(b.storage_bytes(), 4 * ((n + 1) / 2));
  b.unpack();
  Vec want = x;
  cpu_->round_to(want.data(), n, Precision::bf16);
  const Vec got = host(b.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(want[i])) continue;
    ASSERT_EQ(got[i], want[i]) << x[i];
  }
}

// A few training steps of tiny-gpt on this backend, its buffers in device memory and the
// host-staged communicator (a world of one), against the same steps on the CPU backend, at
// a learning rate of 1e-2 from the first step (no warm-up: the loss falls by tenths a
// step): each step's loss within 1e-5 relative and gradient norm within 1e-4 in fp32 (the
// kernels sum in other orders), 3e-3 and 1e-2 in bf16 (roundings to 16 bits amplify
// those differences; the device check holds 30 steps' losses within 1e-2); two
// micro-batches a step (gradients accumulated), the unfused attention and the fused one on
// the tensor cores, activations kept in 16 bits.
TEST_F(CudaOps, TinyGptTrainsAsOnTheCpu) {
  // The 16-bit plans take the GEMM inputs in 16-bit storage on this backend (gemm_reads_16bit;
  // the CPU's GEMMs take rounded floats): with the fused attention, which reads qkv (packed
  // after its bias) and its output as stored; a Llama-shaped model (RoPE, then qkv packed;
  // no biases; grouped queries) with it under full recompute, whose replay packs them again;
  // and that model in fp16 with the unfused attention (its output kept packed for the
  // projection's weight gradient alone, qkv and its probabilities unpacked; qkv's gradient
  // packed without a rounding pass of its own).
  struct Case {
    const char* model;
    const char* plan;
  };
  static const char* const kThreeSteps[] = {"mbs=1,gbs=2,precision=fp32", "mbs=1,gbs=2,precision=bf16,attention=flash"};
  for (const Case& k : {Case{"tiny-gpt", kThreeSteps[0]}, Case{"tiny-gpt", kThreeSteps[1]},
                        Case{"tiny-llama", "mbs=1,gbs=2,precision=bf16,attention=flash,recompute=full"},
                        Case{"tiny-llama", "mbs=1,gbs=2,precision=fp16"}}) {
    const char* plan = k.plan;
    SCOPED_TRACE(std::string(k.model) + " " + plan);
    ModelSpec m = load_model(k.model);
    if (kEmulated) {  // a thread a value in the emulation: 2 layers of 64 (head dim 16), sequences of 32
      m.L = 2;
      m.F = m.F * 64 / m.H;
      m.H = 64;
      m.S = 32;
    }
    const Plan p = load_plan(plan);
    TrainOptions o;
    o.lr = 1e-2;
    o.warmup = 0;
    const bool first_two = k.plan == kThreeSteps[0] || k.plan == kThreeSteps[1];
#ifdef STRATA_UNDER_SANITIZER
    o.steps = first_two ? 2 : 1;  // (the same code paths: a step's forward, backward and update)
#else
    o.steps = first_two ? 3 : 2;
#endif
    auto cpu_comm = make_local_comm();
    const TrainResult want = train(m, p, o, *cpu_comm, *cpu_);
    gpu_->set_gemm_precision(p.precision);
    auto gpu_comm = make_staged_comm(make_local_comm(), gpu_->staging_copier());
    const TrainResult got = train(m, p, o, *gpu_comm, *gpu_);
    gpu_->set_gemm_precision(Precision::fp32);
    ASSERT_EQ(got.steps.size(), want.steps.size());
    EXPECT_EQ(got.backend, "cuda");
    const bool fp32 = p.precision == Precision::fp32;
    const double loss_tol = fp32 ? 1e-5 : 3e-3, norm_tol = fp32 ? 1e-4 : 1e-2;
    for (size_t i = 0; i < want.steps.size(); ++i) {
      const StepRecord &g = got.steps[i], &w = want.steps[i];
      std::printf("  %s %s step %zu: loss %.6f against %.6f on the CPU, grad norm %.5f against %.5f\n", k.model, plan,
                  i + 1, g.loss, w.loss, g.grad_norm, w.grad_norm);
      EXPECT_NEAR(g.loss, w.loss, loss_tol * std::fabs(w.loss)) << "step " << i + 1;
      EXPECT_NEAR(g.grad_norm, w.grad_norm, norm_tol * std::fabs(w.grad_norm)) << "step " << i + 1;
    }
  }
}

// The activations this backend's training run holds at its peak against the cost model's
// strata stack on a device whose GEMMs read 16-bit operands (ComputeSetup::
// sixteen_operands), for a model whose output layer outweighs its layers: there the
// cross-entropy writes the logit gradients in 16 bits beside the fp32 logits, which are freed
// then (memory.cpp head_working_bytes), and the layers' GEMM inputs are kept in 16 bits.
TEST_F(CudaOps, ActivationsOfALargeVocabularyMatchTheCostModel) {
  ModelSpec m = load_model("tiny-gpt");
  m.L = 2;  // (small, as in the emulation's training case)
  m.F = m.F * 64 / m.H;
  m.H = 64;
  m.S = 32;
  m.V = 8000;  // T x V: 64 tokens x 8,064 (padded) logits, 2 MB of fp32 logits against ~0.4 MB of a layer
  Cluster cl = load_cluster("local-cpu");
  cl.device.gemm_reads_16bit = true;
  ASSERT_TRUE(cl.device.peak_bf16_flops > 0);
  for (const char* plan : {"mbs=2,gbs=2,precision=bf16,attention=unfused", "mbs=2,gbs=2,precision=fp16,attention=flash"}) {
    SCOPED_TRACE(plan);
    const Plan p = load_plan(plan);
    TrainOptions o;
    o.steps = 1;
    gpu_->set_gemm_precision(p.precision);
    auto comm = make_staged_comm(make_local_comm(), gpu_->staging_copier());
    const TrainResult got = train(m, p, o, *comm, *gpu_);
    gpu_->set_gemm_precision(Precision::fp32);
    const Estimate e = estimate(model_on_stack(m, cl), cl, p);
    ASSERT_TRUE(e.valid);
    const double tracked = static_cast<double>(got.peak_activations), predicted = e.memory.activations;
    std::printf("  %s: activations %.0f bytes tracked, %.0f predicted\n", plan, tracked, predicted);
    EXPECT_NEAR(predicted / tracked, 1.0, 0.01) << "predicted " << predicted << ", tracked " << tracked;
  }
}

// The NCCL communicator on the one GPU a test has: a world of one rank (bootstrapped through
// the local communicator), every group of one run through NCCL. The compute stream is held
// (a host callback spinning on a flag) while an add and then the collectives are issued: a
// collective that did not wait for the compute stream would copy the NaNs the add has not
// yet overwritten, and a non-blocking one would report done while the stream is held.
#ifndef STRATA_CUDA_EMULATION  // (NCCL on a GPU; the emulated backend's streams are names)
void hold_until_open(void* flag) {
  auto* open = static_cast<std::atomic<bool>*>(flag);
  while (!open->load()) std::this_thread::yield();
}

TEST_F(CudaOps, NcclCommunicatorOrdersItsStreamsAfterTheOps) {
  const std::string why = nccl_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << "no NCCL: " << why;
  std::unique_ptr<Comm> comm = make_nccl_comm(make_local_comm(), *gpu_, /*single_rank_groups=*/true);
  ASSERT_NE(comm, nullptr);
  const ProcessGrid grid;  // 1 x 1 x 1 x 1
  comm->setup(grid);
  ASSERT_EQ(comm->rank(), 0);
  ASSERT_EQ(comm->size(), 1);
  const size_t n = 1 << 20;
  const int64_t ni = static_cast<int64_t>(n);
  const Vec a = random(n), b = random(n);
  Vec sum(n);
  for (size_t i = 0; i < n; ++i) sum[i] = a[i] + b[i];
  float* da = dev(a);
  float* db = dev(b);
  // Blocking, out of place, on every group kind: a thread opens the held stream later.
  for (GroupKind kind : {kTensor, kData, kPipeline, kModel, kWorld}) {
    const Group g = grid.group(kind, 0);
    float* src = dev(nans(n));
    float* gathered = dev(nans(n));
    float* scattered = dev(nans(n));
    std::atomic<bool> open{false};
    gpu_->enqueue_host_callback(hold_until_open, &open);
    gpu_->add(src, da, db, ni);
    std::thread opener([&open] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      open = true;
    });
    comm->all_gather(src, gathered, ni, g);
    opener.join();
    comm->reduce_scatter(src, scattered, ni, g);
    comm->all_reduce(src, ni, g);  // in place: a group of one leaves it as it is
    comm->broadcast(src, ni, 0, g);
    ASSERT_EQ(host(gathered, n), sum) << "all_gather, group kind " << kind;
    ASSERT_EQ(host(scattered, n), sum) << "reduce_scatter, group kind " << kind;
    ASSERT_EQ(host(src, n), sum) << "all_reduce and broadcast, group kind " << kind;
  }
  // Non-blocking, two in flight on two streams, while the compute stream is held.
  float* w = dev(nans(n));
  float* y = dev(nans(n));
  float* z = dev(nans(n));
  std::atomic<bool> open{false};
  gpu_->enqueue_host_callback(hold_until_open, &open);
  gpu_->add(w, db, da, ni);
  Request r2 = comm->iall_gather(w, y, ni, grid.group(kTensor, 0));
  Request r3 = comm->ireduce_scatter(w, z, ni, grid.group(kPipeline, 0));
  EXPECT_TRUE(r2.pending());
  EXPECT_TRUE(r3.pending());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(comm->test(r2)) << "done while the compute stream it waits for is held";
  EXPECT_TRUE(r2.pending());
  open = true;
  while (!comm->test(r2)) {
  }
  EXPECT_FALSE(r2.pending());
  comm->wait(r3);
  EXPECT_FALSE(r3.pending());
  EXPECT_EQ(host(y, n), sum);
  EXPECT_EQ(host(z, n), sum);
  // Finished slots are reused.
  Request r4 = comm->iall_reduce(w, ni, grid.group(kData, 0));
  EXPECT_EQ(r4.slot, 0);
  comm->wait(r4);
  // Device doubles, max: the identity.
  const std::vector<double> dv = {1.5, -2.25, 1e300};
  double* dd = reinterpret_cast<double*>(dev(Vec(2 * dv.size())));
  gpu_->staging_copier().to_device(dd, dv.data(), dv.size() * sizeof(double));
  comm->all_reduce(dd, static_cast<int64_t>(dv.size()), grid.group(kData, 0), ReduceOp::max);
  std::vector<double> back(dv.size());
  gpu_->staging_copier().to_host(back.data(), dd, back.size() * sizeof(double));
  EXPECT_EQ(back, dv);
  // Host buffers (the executor's losses and norms) go through the host path, not NCCL.
  std::vector<double> hd = dv;
  comm->all_reduce(hd.data(), static_cast<int64_t>(hd.size()), grid.group(kData, 0), ReduceOp::sum);
  EXPECT_EQ(hd, dv);
  Vec hf = a, hout(n, 0.0f);
  Request rh = comm->iall_reduce(hf.data(), ni, grid.group(kData, 0));
  comm->wait(rh);
  EXPECT_EQ(hf, a);
  comm->all_gather(hf.data(), hout.data(), ni, grid.group(kTensor, 0));
  EXPECT_EQ(hout, a);
}
#endif

}  // namespace
}  // namespace strata
