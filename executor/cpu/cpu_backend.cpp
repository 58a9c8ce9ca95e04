// The CPU backend: Eigen GEMMs (one core, cpu_gemm.h), Eigen's vectorised exp and tanh
// (cpu_eltwise.h), plain loops for the rest. Attention is one pair of GEMMs per (micro-batch
// row, head) on strided views of the (S, B, ...) buffers.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "executor/backend.h"
#include "executor/cpu/cpu_eltwise.h"
#include "executor/cpu/cpu_gemm.h"

#include <sys/mman.h>
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

#include "executor/asan.h"

namespace strata {
namespace {

// The span a row-major (rows, cols) operand of row stride ld covers must be live memory.
// cpu_gemm runs uninstrumented under the sanitizers (cpu_gemm.h); this reads the first
// poisoned byte of the span, if any, in instrumented code, so AddressSanitizer reports the
// overflow or use-after-free with this call's stack, as it would inside the GEMM.
inline void check_span(const float* p, int64_t rows, int64_t cols, int64_t ld) {
#if defined(STRATA_ASAN)
  if (rows <= 0 || cols <= 0) return;
  const size_t bytes = static_cast<size_t>((rows - 1) * ld + cols) * sizeof(float);
  if (void* bad = __asan_region_is_poisoned(const_cast<float*>(p), bytes)) {
    const volatile char c = *static_cast<volatile char*>(bad);
    (void)c;
  }
#else
  (void)p, (void)rows, (void)cols, (void)ld;
#endif
}

// cpu_gemm with its operands' spans checked (see check_span).
void gemm_checked(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (K > 0) {
    check_span(A, ta ? K : M, ta ? M : K, lda);
    check_span(B, tb ? N : K, tb ? K : N, ldb);
  }
  check_span(C, M, N, ldc);
  cpu_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

constexpr float kEps = 1e-5f;

// sum over j < n of term(j) in double, in kSumLanes fixed lanes (j into lane j % kSumLanes,
// the lanes added in order at the end): the same bits on every run, and no chain of
// dependent adds, one per element, for the core to wait on.
constexpr int64_t kSumLanes = 8;
template <class Term>
double sum_in_lanes(int64_t n, Term&& term) {
  double acc[kSumLanes] = {};
  int64_t j = 0;
  for (; j + kSumLanes <= n; j += kSumLanes)
    for (int64_t k = 0; k < kSumLanes; ++k) acc[k] += term(j + k);
  for (int64_t k = 0; j < n; ++j, ++k) acc[k] += term(j);
  double s = 0;
  for (int64_t k = 0; k < kSumLanes; ++k) s += acc[k];
  return s;
}
float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;  // inf, nan
  u += 0x7fffu + ((u >> 16) & 1u);                 // round to nearest even
  u &= 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}
float round_fp16(float x) { return std::isnan(x) ? x : static_cast<float>(static_cast<_Float16>(x)); }
uint16_t pack_fp16(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return std::isnan(x) ? static_cast<uint16_t>((u & 0x8000u) | 0x7e00u) : u;  // as the GPU's
}

// fp16 eight values at a time where the build has F16C (x86-64-v3: this file's flags),
// the scalar conversions' instruction (vcvtps2ph, to nearest even; inf past 65504) on a
// whole register: bit for bit the loops' tails and the scalar functions above
// (`executor_test` CpuBackend.Fp16PassesMatchTheScalarConversion); 2.6-6.5x the scalar
// loops here (`executor_bench` BM_Sixteen).
// Each returns how many values it did (a multiple of 8); the caller finishes the rest.
#if defined(__F16C__) && defined(__AVX2__)
constexpr int kHalfRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
int64_t round_fp16_x8(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(x, kHalfRound));
    _mm256_storeu_ps(dst + i, _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));  // NaN stays as it was
  }
  return i;
}
int64_t pack_fp16_x8(uint16_t* dst, const float* src, int64_t n) {
  const __m128i sign = _mm_set1_epi16(static_cast<short>(0x8000)), qnan = _mm_set1_epi16(0x7e00);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m128i h = _mm256_cvtps_ph(x, kHalfRound);
    const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    const __m128i fixed = _mm_or_si128(_mm_and_si128(h, sign), qnan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_blendv_epi8(h, fixed, nan16));
  }
  return i;
}
int64_t unpack_fp16_x8(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  return i;
}
#else
int64_t round_fp16_x8(float*, const float*, int64_t) { return 0; }
int64_t pack_fp16_x8(uint16_t*, const float*, int64_t) { return 0; }
int64_t unpack_fp16_x8(float*, const uint16_t*, int64_t) { return 0; }
#endif

// Head h's queries (Sq rows) and its group's keys and values (Skv rows): views of the
// (S, B, ...) row buffers of micro-batch row b; q rows of stride ldq (query heads first), kv
// rows of stride ldkv (key groups at 0, value groups at G*D). A view's rows are B rows of
// its buffer apart: row stride sq = B*ldq for queries, skv = B*ldkv for keys and values.
struct HeadViews {
  const float *q, *k, *v;
  int64_t sq, skv;
  HeadViews(const float* q_, int64_t ldq, const float* kv, int64_t ldkv, int64_t b, int64_t h, int64_t B, int64_t A,
            int64_t G, int64_t D)
      : q(q_ + b * ldq + h * D),
        k(kv + b * ldkv + (h / (A / G)) * D),
        v(kv + b * ldkv + (G + h / (A / G)) * D),
        sq(B * ldq),
        skv(B * ldkv) {}
};

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }

  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
            const float* B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    gemm_checked(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }

  // (The rounding of `round`, a row at a time as each row is written, while it is in cache.)
  void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                         int64_t N, int64_t H, Precision round) override {
    for (int64_t i = 0; i < N; ++i) {
      const float* xi = x + i * H;
      const double s = sum_in_lanes(H, [&](int64_t j) { return static_cast<double>(xi[j]); });
      const float mu = static_cast<float>(s / static_cast<double>(H));
      const double s2 = sum_in_lanes(H, [&](int64_t j) { return static_cast<double>((xi[j] - mu) * (xi[j] - mu)); });
      const float rs = 1.0f / std::sqrt(static_cast<float>(s2 / static_cast<double>(H)) + kEps);
      mean[i] = mu;
      rstd[i] = rs;
      float* oi = out + i * H;
      for (int64_t j = 0; j < H; ++j) oi[j] = (xi[j] - mu) * rs * w[j] + b[j];
      round_to(oi, H, round);
    }
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* mean,
                          const float* rstd, const float* w, int64_t N, int64_t H) override {
    for (int64_t i = 0; i < N; ++i) {
      const float* xi = x + i * H;
      const float* gi = dout + i * H;
      const float mu = mean[i], rs = rstd[i];
      float m1 = 0, m2 = 0;
      for (int64_t j = 0; j < H; ++j) {
        const float xhat = (xi[j] - mu) * rs, dn = gi[j] * w[j];
        m1 += dn;
        m2 += dn * xhat;
        dw[j] += gi[j] * xhat;
        db[j] += gi[j];
      }
      m1 /= static_cast<float>(H);
      m2 /= static_cast<float>(H);
      float* dxi = dx + i * H;
      for (int64_t j = 0; j < H; ++j) {
        const float xhat = (xi[j] - mu) * rs;
        dxi[j] += rs * (gi[j] * w[j] - m1 - xhat * m2);
      }
    }
  }
  void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t H,
                       Precision round) override {
    for (int64_t i = 0; i < N; ++i) {
      const float* xi = x + i * H;
      const double s2 = sum_in_lanes(H, [&](int64_t j) { return static_cast<double>(xi[j] * xi[j]); });
      const float rs = 1.0f / std::sqrt(static_cast<float>(s2 / static_cast<double>(H)) + kEps);
      rstd[i] = rs;
      float* oi = out + i * H;
      for (int64_t j = 0; j < H; ++j) oi[j] = xi[j] * rs * w[j];
      round_to(oi, H, round);
    }
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* rstd, const float* w,
                        int64_t N, int64_t H) override {
    for (int64_t i = 0; i < N; ++i) {
      const float* xi = x + i * H;
      const float* gi = dout + i * H;
      const float rs = rstd[i];
      float m = 0;
      for (int64_t j = 0; j < H; ++j) {
        m += gi[j] * w[j] * xi[j];
        dw[j] += gi[j] * xi[j] * rs;
      }
      m /= static_cast<float>(H);
      float* dxi = dx + i * H;
      for (int64_t j = 0; j < H; ++j) dxi[j] += rs * (gi[j] * w[j] - xi[j] * rs * rs * m);
    }
  }

  // Eigen's vectorised tanh and exp, uninstrumented under the sanitizers (cpu_eltwise.h).
  // (With `round`, in blocks of rows, each rounded while it is in cache.)
  void activation_forward(Activation act, float* out, const float* u, int64_t N, int64_t F, Precision round) override {
    const int64_t U = gated(act) ? 2 * F : F;
    check_span(u, N, U, U);
    check_span(out, N, F, F);
    by_row_blocks(N, U + F, round, [&](int64_t r0, int64_t rows) {
      cpu_activation_forward(act, out + r0 * F, u + r0 * U, rows, F);
      round_to(out + r0 * F, rows * F, round);
    });
  }
  void activation_backward(Activation act, float* du, const float* dout, const float* u, int64_t N, int64_t F,
                           Precision round) override {
    const int64_t U = gated(act) ? 2 * F : F;
    check_span(u, N, U, U);
    check_span(du, N, U, U);
    check_span(dout, N, F, F);
    by_row_blocks(N, 2 * U + F, round, [&](int64_t r0, int64_t rows) {
      cpu_activation_backward(act, du + r0 * U, dout + r0 * F, u + r0 * U, rows, F);
      round_to(du + r0 * U, rows * U, round);
    });
  }
  // fn(first row, rows) over all N rows: in one call without rounding (fp32), else in blocks
  // of rows that touch about 64 KiB (`width` floats a row, inputs and outputs together).
  template <class Fn>
  static void by_row_blocks(int64_t N, int64_t width, Precision round, const Fn& fn) {
    const int64_t block = round == Precision::fp32 ? std::max<int64_t>(N, 1) : std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
    for (int64_t r0 = 0; r0 < N; r0 += block) fn(r0, std::min(block, N - r0));
  }

  void rope(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse) override {
    rope_at(x, S, B, heads, D, ld, inverse, 0);
  }
  void rope_at(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse,
               int64_t pos0) override {
    const int64_t half = D / 2;
    std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < half; ++i) {
        const double freq = std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(D));
        const double ang = static_cast<double>(pos0 + s) * freq;
        cs[static_cast<size_t>(i)] = static_cast<float>(std::cos(ang));
        sn[static_cast<size_t>(i)] = static_cast<float>(inverse ? -std::sin(ang) : std::sin(ang));
      }
      for (int64_t b = 0; b < B; ++b) {
        float* row = x + (s * B + b) * ld;
        for (int64_t h = 0; h < heads; ++h) {
          float* v = row + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = v[i], x2 = v[i + half];
            const float c = cs[static_cast<size_t>(i)], sgn = sn[static_cast<size_t>(i)];
            v[i] = x1 * c - x2 * sgn;
            v[i + half] = x2 * c + x1 * sgn;
          }
        }
      }
    }
  }

  // The plain attention ops are the context-parallel ones on one QKV buffer: every query,
  // every key, from position 0.
  void attention_forward(float* out, float* probs, const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G,
                         int64_t D) override {
    const int64_t ld = (A + 2 * G) * D;
    attention_forward_cp(out, probs, S, qkv, ld, qkv + A * D, ld, S, 0, B, A, G, D);
  }
  void attention_backward(float* dqkv, const float* dout, const float* probs, const float* qkv, int64_t S,
                          int64_t B, int64_t A, int64_t G, int64_t D) override {
    const int64_t ld = (A + 2 * G) * D;
    std::fill(dqkv, dqkv + S * B * ld, 0.0f);
    attention_backward_cp(dqkv, ld, dqkv + A * D, ld, dout, probs, S, qkv, qkv + A * D, S, 0, B, A, G, D);
  }
  void flash_attention_forward(float* out, float* lse, const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G,
                               int64_t D) override {
    const int64_t ld = (A + 2 * G) * D;
    flash_attention_forward_cp(out, lse, qkv, ld, qkv + A * D, ld, S, 0, B, A, G, D);
  }
  void flash_attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                                int64_t S, int64_t B, int64_t A, int64_t G, int64_t D) override {
    const int64_t ld = (A + 2 * G) * D;
    std::fill(dqkv, dqkv + S * B * ld, 0.0f);
    flash_attention_backward_cp(dqkv, ld, dqkv + A * D, ld, dout, out, lse, qkv, qkv + A * D, S, 0, B, A, G, D);
  }

  void attention_forward_cp(float* out, float* probs, int64_t ldp, const float* q, int64_t ldq, const float* kv,
                            int64_t ldkv, int64_t Sq, int64_t q0, int64_t B, int64_t A, int64_t G,
                            int64_t D) override {
    const int64_t ldo = A * D, keys = q0 + Sq;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    std::vector<float> p_local;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < A; ++h) {
        const HeadViews hv(q, ldq, kv, ldkv, b, h, B, A, G, D);
        float* pp = probs ? probs + (b * A + h) * Sq * ldp : nullptr;
        int64_t ld = ldp;
        if (!pp) {
          p_local.resize(static_cast<size_t>(Sq * keys));
          pp = p_local.data();
          ld = keys;
        }
        gemm_checked(false, true, Sq, keys, D, scale, hv.q, hv.sq, hv.k, hv.skv, 0.0f, pp, ld);  // P = s Q K^T
        softmax_causal(pp, Sq, ld, q0);
        gemm_checked(false, false, Sq, D, keys, 1.0f, pp, ld, hv.v, hv.skv, 0.0f, out + b * ldo + h * D,
                     B * ldo);  // O = P V
      }
    }
  }
  void attention_backward_cp(float* dq_, int64_t ldq, float* dkv, int64_t ldkv, const float* dout,
                             const float* probs, int64_t ldp, const float* q, const float* kv, int64_t Sq, int64_t q0,
                             int64_t B, int64_t A, int64_t G, int64_t D) override {
    const int64_t ldo = A * D, keys = q0 + Sq;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    std::vector<float> p_local(static_cast<size_t>(Sq * keys)), dp_(static_cast<size_t>(Sq * keys));
    float* dp = dp_.data();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < A; ++h) {
        const int64_t g = h / (A / G);
        const HeadViews hv(q, ldq, kv, ldkv, b, h, B, A, G, D);
        float* dq = dq_ + b * ldq + h * D;
        float* dk = dkv + b * ldkv + g * D;
        float* dv = dkv + b * ldkv + (G + g) * D;
        const float* dout_h = dout + b * ldo + h * D;
        const float* pp = probs ? probs + (b * A + h) * Sq * ldp : nullptr;
        int64_t ld = ldp;
        if (!pp) {  // recompute the attention probabilities (selective recompute)
          gemm_checked(false, true, Sq, keys, D, scale, hv.q, hv.sq, hv.k, hv.skv, 0.0f, p_local.data(), keys);
          softmax_causal(p_local.data(), Sq, keys, q0);
          pp = p_local.data();
          ld = keys;
        }
        gemm_checked(true, false, keys, D, Sq, 1.0f, pp, ld, dout_h, B * ldo, 1.0f, dv, B * ldkv);  // dV += P^T dO
        gemm_checked(false, true, Sq, keys, D, 1.0f, dout_h, B * ldo, hv.v, hv.skv, 0.0f, dp, keys);  // dP = dO V^T
        for (int64_t i = 0; i < Sq; ++i) {  // dS = P * (dP - rowsum(dP * P))
          const int64_t n = q0 + i + 1;     // causal: keys 0..q0+i
          float* dr = dp + i * keys;
          float dot = 0;
          for (int64_t j = 0; j < n; ++j) dot += dr[j] * pp[i * ld + j];
          for (int64_t j = 0; j < keys; ++j) dr[j] = j < n ? pp[i * ld + j] * (dr[j] - dot) * scale : 0.0f;
        }
        gemm_checked(false, false, Sq, D, keys, 1.0f, dp, keys, hv.k, hv.skv, 1.0f, dq, B * ldq);  // dQ += dS K
        gemm_checked(true, false, keys, D, Sq, 1.0f, dp, keys, hv.q, hv.sq, 1.0f, dk, B * ldkv);   // dK += dS^T Q
      }
    }
  }

  // Fused attention on the CPU: blocks of kFlashRows queries against the keys up to the
  // block's last row, so the scores of one block (kFlashRows x keys) are the largest
  // scratch; the backward rebuilds a block's probabilities from lse, as FlashAttention-2 does.
  static constexpr int64_t kFlashRows = 64;
  void flash_attention_forward_cp(float* out, float* lse, const float* q, int64_t ldq, const float* kv, int64_t ldkv,
                                  int64_t Sq, int64_t q0, int64_t B, int64_t A, int64_t G, int64_t D) override {
    const int64_t ldo = A * D;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    std::vector<float> sc(static_cast<size_t>(std::min(kFlashRows, Sq) * (q0 + Sq)));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < A; ++h) {
        const HeadViews hv(q, ldq, kv, ldkv, b, h, B, A, G, D);
        for (int64_t r0 = 0; r0 < Sq; r0 += kFlashRows) {
          const int64_t r = std::min(kFlashRows, Sq - r0), keys = q0 + r0 + r;
          gemm_checked(false, true, r, keys, D, scale, hv.q + r0 * hv.sq, hv.sq, hv.k, hv.skv, 0.0f, sc.data(), keys);
          float* l = lse + (b * A + h) * Sq + r0;
          for (int64_t i = 0; i < r; ++i) {
            float* row = sc.data() + i * keys;
            const int64_t n = q0 + r0 + i + 1;  // causal: keys 0..q0+r0+i
            const float mx = *std::max_element(row, row + n);
            float sum = 0;
            for (int64_t j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - mx));
            const float inv = 1.0f / sum;
            for (int64_t j = 0; j < n; ++j) row[j] *= inv;
            std::fill(row + n, row + keys, 0.0f);
            l[i] = mx + std::log(sum);
          }
          gemm_checked(false, false, r, D, keys, 1.0f, sc.data(), keys, hv.v, hv.skv, 0.0f,
                       out + (r0 * B + b) * ldo + h * D, B * ldo);
        }
      }
    }
  }
  void flash_attention_backward_cp(float* dq_, int64_t ldq, float* dkv, int64_t ldkv, const float* dout,
                                   const float* out, const float* lse, const float* q, const float* kv, int64_t Sq,
                                   int64_t q0, int64_t B, int64_t A, int64_t G, int64_t D) override {
    const int64_t ldo = A * D;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const size_t block = static_cast<size_t>(std::min(kFlashRows, Sq) * (q0 + Sq));
    std::vector<float> p_(block), dp_(block);
    float *p = p_.data(), *dp = dp_.data();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < A; ++h) {
        const int64_t g = h / (A / G);
        const HeadViews hv(q, ldq, kv, ldkv, b, h, B, A, G, D);
        float* dk = dkv + b * ldkv + g * D;
        float* dv = dkv + b * ldkv + (G + g) * D;
        for (int64_t r0 = 0; r0 < Sq; r0 += kFlashRows) {
          const int64_t r = std::min(kFlashRows, Sq - r0), keys = q0 + r0 + r;
          const float* dout_b = dout + (r0 * B + b) * ldo + h * D;
          const float* out_b = out + (r0 * B + b) * ldo + h * D;
          float* dq = dq_ + (r0 * B + b) * ldq + h * D;
          const float* q_b = hv.q + r0 * hv.sq;
          gemm_checked(false, true, r, keys, D, scale, q_b, hv.sq, hv.k, hv.skv, 0.0f, p, keys);         // S = s Q K^T
          gemm_checked(false, true, r, keys, D, 1.0f, dout_b, B * ldo, hv.v, hv.skv, 0.0f, dp, keys);  // dP = dO V^T
          const float* l = lse + (b * A + h) * Sq + r0;
          for (int64_t i = 0; i < r; ++i) {  // P from lse; dS = P * (dP - rowsum(dO * O)) * scale
            const float* dor = dout_b + i * B * ldo;
            const float* orow = out_b + i * B * ldo;
            float delta = 0;
            for (int64_t d = 0; d < D; ++d) delta += dor[d] * orow[d];
            float* pr = p + i * keys;
            float* dr = dp + i * keys;
            const int64_t n = q0 + r0 + i + 1;
            for (int64_t j = 0; j < n; ++j) {
              pr[j] = std::exp(pr[j] - l[i]);
              dr[j] = pr[j] * (dr[j] - delta) * scale;
            }
            std::fill(pr + n, pr + keys, 0.0f);
            std::fill(dr + n, dr + keys, 0.0f);
          }
          gemm_checked(true, false, keys, D, r, 1.0f, p, keys, dout_b, B * ldo, 1.0f, dv, B * ldkv);  // dV += P^T dO
          gemm_checked(false, false, r, D, keys, 1.0f, dp, keys, hv.k, hv.skv, 1.0f, dq, B * ldq);    // dQ += dS K
          gemm_checked(true, false, keys, D, r, 1.0f, dp, keys, q_b, hv.sq, 1.0f, dk, B * ldkv);      // dK += dS^T Q
        }
      }
    }
  }

  // Buffers of kCachedFloats or more that are freed are kept, by size, and handed out again:
  // every training step frees and allocates the same activation, gradient and gathered
  // buffers, and fresh memory costs a page fault per 4 KiB on first touch (about 12.5 us on
  // these virtual machines). Under AddressSanitizer, whose allocator maps every block over
  // 128 KiB afresh, that was most of a ZeRO-3 run's time; a kept buffer is poisoned until it
  // is handed out again, so a use after its free is still reported. The memory tracker
  // (memory_tracker.h) counts buffers in use, not this cache; the cache keeps at most
  // kMaxCachedBytes and frees what would exceed it.
  static constexpr int64_t kCachedFloats = 16 * 1024;  // 64 KiB
  static constexpr int64_t kMaxCachedBytes = int64_t{512} << 20;
  ~CpuBackend() override {
    for (auto& [n, p] : free_) {
      set_poisoned(p, n, false);
      release_block(p);
    }
  }
  // allocate zeroes. allocate_uninitialised_in, with buffer poisoning on, fills with NaN
  // (every byte 0xFF), so a value read before the executor writes it turns the loss to NaN
  // in every test on this backend rather than passing as the zero a fresh CUDA pool block
  // may happen to hold; off, it hands the block out as it is (a reused one holds old
  // values), as the CUDA backend does. The fill was most of the ~1 ms a layer that no op
  // covers (`strata train --ops`'s "other": tiny-gpt's forward allocates ~17 MB a layer
  // and micro-batch) and about 4 % of a training step. On under the sanitizers and in every
  // test (STRATA_POISON_BUFFERS=1, CMakeLists.txt), off in a Release run unless set.
  float* allocate(int64_t n) override { return take(n, 0); }
  float* allocate_uninitialised_in(int64_t n, int) override { return take(n, poison_buffers() ? 0xFF : -1); }
  void deallocate(float* p) override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = sizes_.find(p);
    if (it == sizes_.end()) {
      delete[] p;
      return;
    }
    const int64_t n = it->second;
    sizes_.erase(it);
    if (cached_bytes_ + 4 * n > kMaxCachedBytes) {
      release_block(p);
      return;
    }
    cached_bytes_ += 4 * n;
    set_poisoned(p, n, true);
    free_.emplace(n, p);
  }
  void fill_zero(float* p, int64_t n) override {
    if (n > 0) std::memset(p, 0, static_cast<size_t>(n) * sizeof(float));
  }
  void to_host(float* host_dst, const float* src, int64_t n) override { std::copy(src, src + n, host_dst); }
  void to_device(float* dst, const float* host_src, int64_t n) override { std::copy(host_src, host_src + n, dst); }
  void* allocate_bytes(size_t bytes) override { return ::operator new(bytes > 0 ? bytes : 1); }
  void deallocate_bytes(void* p) override { ::operator delete(p); }
  void bytes_to_device(void* dst, const void* host_src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, host_src, bytes);
  }
  void adamw(float* p, const float* g, float* m, float* v, FlagBits decay, int64_t n, const AdamW& opt, double lr,
             int64_t step, float grad_mul) override {
    adamw_update(p, g, m, v, decay, n, opt, lr, step, grad_mul);
  }
  void grad_norm_terms(const float* g, FlagBits counted, int64_t n, double acc[2]) override {
    strata::grad_norm_terms(g, counted, n, acc);
  }
  void copy(float* dst, const float* src, int64_t n) override { std::copy(src, src + n, dst); }
  void add(float* out, const float* a, const float* b, int64_t n, Precision round) override {
    by_row_blocks(n, 3, round, [&](int64_t i0, int64_t m) {
      for (int64_t i = i0; i < i0 + m; ++i) out[i] = a[i] + b[i];
      round_to(out + i0, m, round);
    });
  }
  void add_bias(float* y, const float* b, int64_t N, int64_t F, Precision round) override {
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = 0; j < F; ++j) y[i * F + j] += b[j];
      round_to(y + i * F, F, round);
    }
  }
  void bias_grad(float* db, const float* dy, int64_t N, int64_t F) override {
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < F; ++j) db[j] += dy[i * F + j];
  }
  void embedding_forward(float* x, const float* wte, const int32_t* tokens, int64_t S, int64_t B, int64_t H, int64_t lo,
                         int64_t Vt) override {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t tok = tokens[b * S + s];
        float* row = x + (s * B + b) * H;
        if (tok >= lo && tok < lo + Vt) std::copy(wte + (tok - lo) * H, wte + (tok - lo + 1) * H, row);
        else std::fill(row, row + H, 0.0f);
      }
    }
  }
  void embedding_backward(float* dwte, const float* dx, const int32_t* tokens, int64_t S, int64_t B, int64_t H,
                          int64_t lo, int64_t Vt) override {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t tok = tokens[b * S + s];
        if (tok < lo || tok >= lo + Vt) continue;
        const float* row = dx + (s * B + b) * H;
        float* g = dwte + (tok - lo) * H;
        for (int64_t j = 0; j < H; ++j) g[j] += row[j];
      }
    }
  }
  void add_positions(float* out, const float* x, const float* P, int64_t n, int64_t H, int64_t B,
                     int64_t row0) override {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = (row0 + i) / B;
      for (int64_t j = 0; j < H; ++j) out[i * H + j] = x[i * H + j] + P[s * H + j];
    }
  }
  void position_grad(float* dP, const float* dx, int64_t n, int64_t H, int64_t B, int64_t row0) override {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = (row0 + i) / B;
      for (int64_t j = 0; j < H; ++j) dP[s * H + j] += dx[i * H + j];
    }
  }

  // The loss over the logits runs once per vocabulary entry and token (50,304 per token for
  // GPT-2): a row's max and its sum of exponentials in fixed lanes (sum_in_lanes: the same
  // bits on every run, without a chain of dependent adds, one per entry), and the
  // exponentials vectorised as in softmax_causal. Max is exact in any order; a NaN logit
  // makes the loss NaN either way.
  static constexpr int64_t kLanes = 16;
  void cross_entropy_max(float* mx, const float* z, int64_t N, int64_t Vt) override {
    for (int64_t i = 0; i < N; ++i) {
      const float* row = z + i * Vt;
      if (Vt < kLanes) {
        mx[i] = *std::max_element(row, row + Vt);
        continue;
      }
      float acc[kLanes];
      std::copy(row, row + kLanes, acc);
      int64_t j = kLanes;
      for (; j + kLanes <= Vt; j += kLanes)
        for (int64_t k = 0; k < kLanes; ++k) acc[k] = std::max(acc[k], row[j + k]);
      float m = *std::max_element(acc, acc + kLanes);
      for (; j < Vt; ++j) m = std::max(m, row[j]);
      mx[i] = m;
    }
  }
  void cross_entropy_exp_sum(float* st, const float* z, const float* mx, const int32_t* targets, int64_t N, int64_t Vt,
                             int64_t lo) override {
    check_span(z, N, Vt, Vt);
    thread_local std::vector<float> e;  // a row's exponentials, summed and dropped
    e.resize(static_cast<size_t>(Vt));
    for (int64_t i = 0; i < N; ++i) {
      const int64_t tg = targets[i];
      const float* row = z + i * Vt;
      st[2 * i + 1] = tg >= lo && tg < lo + Vt ? row[tg - lo] - mx[i] : 0.0f;
      cpu_exp_shifted(e.data(), row, Vt, mx[i]);
      st[2 * i] = static_cast<float>(sum_in_lanes(Vt, [&](int64_t j) { return static_cast<double>(e[static_cast<size_t>(j)]); }));
    }
  }
  // The exponentials as exp_sum computed them (the same call on the same row), each times
  // the reciprocal of the row's sum, the target's less one, times the scale, then rounded:
  // the operations, in their order, of the probabilities' normalisation and the gradient.
  void cross_entropy_backward(float* z, const float* mx, const float* st, const int32_t* targets, int64_t N, int64_t Vt,
                              int64_t lo, float scale, Precision p) override {
    check_span(z, N, Vt, Vt);
    for (int64_t i = 0; i < N; ++i) {
      float* row = z + i * Vt;
      cpu_exp_shifted(row, row, Vt, mx[i]);
      const float inv = 1.0f / st[2 * i];
      for (int64_t j = 0; j < Vt; ++j) row[j] *= inv;
      const int64_t tg = targets[i];
      if (tg >= lo && tg < lo + Vt) row[tg - lo] -= 1.0f;
      for (int64_t j = 0; j < Vt; ++j) row[j] *= scale;
      round_to(row, Vt, p);
    }
  }

  void round_to(float* x, int64_t n, Precision p) override {
    if (p == Precision::bf16 || p == Precision::fp8) {
      for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
    } else if (p == Precision::fp16) {
      for (int64_t i = round_fp16_x8(x, x, n); i < n; ++i) x[i] = round_fp16(x[i]);
    }
  }
  void round_copy(float* dst, const float* src, int64_t n, Precision p) override {
    if (p == Precision::bf16 || p == Precision::fp8) {
      for (int64_t i = 0; i < n; ++i) dst[i] = round_bf16(src[i]);
    } else if (p == Precision::fp16) {
      for (int64_t i = round_fp16_x8(dst, src, n); i < n; ++i) dst[i] = round_fp16(src[i]);
    } else if (n > 0) {
      std::copy(src, src + n, dst);
    }
  }
  void pack16(uint16_t* dst, const float* src, int64_t n, Precision p) override {
    if (p == Precision::fp16) {
      for (int64_t i = pack_fp16_x8(dst, src, n); i < n; ++i) dst[i] = pack_fp16(src[i]);
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float r = round_bf16(src[i]);
      uint32_t u;
      std::memcpy(&u, &r, 4);
      // A NaN stays a NaN when its payload is in the low half only.
      dst[i] = static_cast<uint16_t>(u >> 16) | (std::isnan(r) ? 0x0040u : 0u);
    }
  }
  void unpack16(float* dst, const uint16_t* src, int64_t n, Precision p) override {
    if (p == Precision::fp16) {
      for (int64_t i = unpack_fp16_x8(dst, src, n); i < n; ++i) {
        _Float16 h;
        std::memcpy(&h, &src[i], 2);
        dst[i] = static_cast<float>(h);
      }
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&dst[i], &u, 4);
    }
  }

 private:
  // The buffer cache (see kCachedFloats): sizes of the large buffers in use, and kept ones.
  // A buffer comes back filled with the byte `fill` (0: zeroed; 0xFF: NaN; < 0: as it is),
  // with memset, which the sanitizers check as one range (a loop is checked per element).
  // Buffer poisoning (NaN for allocate_uninitialised_in): STRATA_POISON_BUFFERS=1 or 0,
  // else on under AddressSanitizer only.
  static bool poison_buffers() {
    static const bool on = [] {
      const char* v = std::getenv("STRATA_POISON_BUFFERS");
      if (v && *v) return std::strcmp(v, "0") != 0;
#if defined(STRATA_ASAN)
      return true;
#else
      return false;
#endif
    }();
    return on;
  }
  float* take(int64_t n, int fill) {
    if (n <= 0) return nullptr;
    float* p = nullptr;
    if (n >= kCachedFloats) {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = free_.find(n);
      if (it != free_.end()) {
        p = it->second;
        free_.erase(it);
        cached_bytes_ -= 4 * n;
        set_poisoned(p, n, false);
      }
    }
    if (!p) p = n >= kCachedFloats ? new_block(n) : new float[static_cast<size_t>(n)];
    if (fill >= 0) std::memset(p, fill, static_cast<size_t>(n) * sizeof(float));
    if (n >= kCachedFloats) {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_.emplace(p, n);
    }
    return p;
  }
  // A fresh block of n >= kCachedFloats floats (freed by release_block). One of 2 MiB or
  // more starts on a 2 MiB boundary and asks for transparent huge pages (where the kernel
  // grants them on request: Debian's default `madvise` mode), so zeroing it takes one page
  // fault per 2 MiB instead of one per 4 KiB: a tiny-gpt rank's 66 MB of weights, gradients
  // and optimizer states took 16K faults, a fifth of a second of every run's start.
  static constexpr size_t kHugePageBytes = size_t{2} << 20;
  static float* new_block(int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : 64;
    void* p = std::aligned_alloc(align, (bytes + align - 1) / align * align);
    if (!p) throw std::bad_alloc();
    if (align == kHugePageBytes) (void)madvise(p, (bytes + align - 1) / align * align, MADV_HUGEPAGE);
    return static_cast<float*>(p);
  }
  static void release_block(float* p) { std::free(p); }
  // A kept buffer is out of bounds for AddressSanitizer until it is handed out again.
  static void set_poisoned(float* p, int64_t n, bool poisoned) {
#if defined(STRATA_ASAN)
    if (poisoned) __asan_poison_memory_region(p, static_cast<size_t>(n) * sizeof(float));
    else __asan_unpoison_memory_region(p, static_cast<size_t>(n) * sizeof(float));
#else
    (void)p, (void)n, (void)poisoned;
#endif
  }
  std::mutex mu_;
  std::unordered_map<float*, int64_t> sizes_;
  std::unordered_multimap<int64_t, float*> free_;
  int64_t cached_bytes_ = 0;

  // Row i of the (rows, ld) scores: softmax over keys 0..q0+i, zero after them up to ld.
  static void softmax_causal(float* p, int64_t rows, int64_t ld, int64_t q0) {
    for (int64_t i = 0; i < rows; ++i) {
      float* row = p + i * ld;
      const int64_t n = q0 + i + 1;
      float mx = row[0];
      for (int64_t j = 1; j < n; ++j) mx = std::max(mx, row[j]);
      // exp through an aligned scratch (cpu_exp_shifted), then a plain left-to-right sum
      // (a vectorised sum() associates by alignment): the same bits on every run.
      check_span(row, 1, n, n);
      cpu_exp_shifted(row, row, n, mx);
      float sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += row[j];
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < n; ++j) row[j] *= inv;
      for (int64_t j = n; j < ld; ++j) row[j] = 0.0f;
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace strata
