// The executor's fast paths against their slow twins, on one process: every CPU backend
// op against layers_ref (double) with one error metric, the whole float model's loss and
// every gradient against ref::model_forward_backward (whose backward is checked against
// finite differences in layers_ref_test), plus the process grid, parameter layout, data,
// ZeRO sharding, AdamW and the memory tracker. Error metric: max |fast - ref| / max |ref|.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "costmodel/json_input.h"
#include "executor/backend.h"
#include "executor/comm.h"
#include "executor/cuda/attention_plan.h"
#include "executor/data.h"
#include "executor/gpt.h"
#include "executor/layers_ref.h"
#include "executor/memory_tracker.h"
#include "executor/op_log.h"
#include "executor/param_layout.h"
#include "executor/process_grid.h"
#include "executor/zero.h"

namespace strata {
namespace {

using Vec = std::vector<double>;

double rel_err(const float* fast, const double* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num = std::max(num, std::fabs(static_cast<double>(fast[i]) - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return den > 0 ? num / den : num;
}

struct Rand {
  std::mt19937_64 gen{42};
  std::vector<float> normal(int64_t n, double sd = 1.0) {
    std::normal_distribution<double> d(0.0, sd);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = static_cast<float>(d(gen));
    return v;
  }
};

Vec as_double(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

// Float tolerance for one op: a few float roundings relative to the largest value.
constexpr double kOpTol = 2e-5;

TEST(CpuBackend, GemmMatchesReferenceMatmul) {
  auto be = make_cpu_backend();
  Rand r;
  const int64_t N = 7, I = 13, O = 5;
  auto x = r.normal(N * I), W = r.normal(O * I), b = r.normal(O);
  std::vector<float> y(static_cast<size_t>(N * O));
  be->gemm(false, true, N, O, I, 1.0f, x.data(), I, W.data(), I, 0.0f, y.data(), O);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < O; ++j) y[static_cast<size_t>(i * O + j)] += b[static_cast<size_t>(j)];
  Vec xd = as_double(x), Wd = as_double(W), bd = as_double(b), yd(static_cast<size_t>(N * O));
  ref::matmul_forward(yd.data(), xd.data(), Wd.data(), bd.data(), N, I, O);
  EXPECT_LT(rel_err(y.data(), yd.data(), N * O), kOpTol);
  // The backward GEMMs: dx = dy W, dW += dy^T x.
  auto dy = r.normal(N * O);
  std::vector<float> dx(static_cast<size_t>(N * I)), dW(static_cast<size_t>(O * I), 0.0f);
  be->gemm(false, false, N, I, O, 1.0f, dy.data(), O, W.data(), I, 0.0f, dx.data(), I);
  be->gemm(true, false, O, I, N, 1.0f, dy.data(), O, x.data(), I, 1.0f, dW.data(), I);
  Vec dxd(static_cast<size_t>(N * I), 0.0), dWd(static_cast<size_t>(O * I), 0.0), dyd = as_double(dy);
  ref::matmul_backward(dxd.data(), dWd.data(), nullptr, dyd.data(), xd.data(), Wd.data(), N, I, O);
  EXPECT_LT(rel_err(dx.data(), dxd.data(), N * I), kOpTol);
  EXPECT_LT(rel_err(dW.data(), dWd.data(), O * I), kOpTol);
}

// The backend keeps freed buffers of 64 KiB or more and hands them out again
// (cpu_backend.cpp, kCachedFloats): a reused buffer must come back zeroed from allocate, and
// a buffer of another size must not be handed out for it.
TEST(CpuBackend, ReusedBuffersComeBackZeroed) {
  auto be = make_cpu_backend();
  const int64_t n = 1 << 17;  // 512 KiB
  float* a = be->allocate(n);
  for (int64_t i = 0; i < n; ++i) a[i] = 1.0f + static_cast<float>(i);
  be->deallocate(a);
  float* other = be->allocate(n + 1);  // another size: not the kept buffer
  EXPECT_NE(other, a);
  float* again = be->allocate(n);
  EXPECT_EQ(again, a);  // the kept one
  EXPECT_EQ(std::count(again, again + n, 0.0f), n);
  be->deallocate(other);
  be->deallocate(again);
  float* small = be->allocate(16);  // under the threshold: plain new[], zeroed
  EXPECT_EQ(std::count(small, small + 16, 0.0f), 16);
  be->deallocate(small);
}

// Every test runs with buffer poisoning on (STRATA_POISON_BUFFERS=1: tests/test_env.cpp): a
// buffer handed out unwritten holds NaN, a reused one too, so a read before the executor's
// write shows in the loss. (A Release run without the variable skips the fill.)
TEST(CpuBackend, UnwrittenBuffersHoldNaNInTests) {
  const char* env = std::getenv("STRATA_POISON_BUFFERS");
  ASSERT_TRUE(env && std::string(env) == "1") << "the tests' environment sets STRATA_POISON_BUFFERS=1";
  auto be = make_cpu_backend();
  for (const int64_t n : {int64_t{16}, int64_t{1} << 17}) {
    float* a = be->allocate_uninitialised_in(n, 0);
    EXPECT_EQ(std::count_if(a, a + n, [](float x) { return std::isnan(x); }), n) << n;
    std::fill(a, a + n, 2.0f);
    be->deallocate(a);
    float* again = be->allocate_uninitialised_in(n, 0);
    EXPECT_EQ(std::count_if(again, again + n, [](float x) { return std::isnan(x); }), n) << n;
    be->deallocate(again);
  }
}

// The vocabulary-parallel cross-entropy's phases (backend.h) on two slices of the
// vocabulary, their maxima and sums combined as the tensor-parallel all-reduces would, against
// the double-precision reference: the loss, and the gradient the backward writes over the
// logits the forward left untouched (fp32; in bf16 the same values rounded, every one a bf16).
TEST(CpuBackend, CrossEntropyPhasesMatchTheReference) {
  auto be = make_cpu_backend();
  const int64_t N = 7, V = 40, Vt = V / 2;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(N * V));
  for (float& x : logits) x = nd(rng);
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) tg[static_cast<size_t>(i)] = static_cast<int32_t>((i * 13) % V);
  Vec ld(logits.begin(), logits.end()), losses(N), probs(N * V), dref(N * V, 0.0);
  ref::crossentropy_forward(losses.data(), probs.data(), ld.data(), tg.data(), N, V);
  const double scale = 0.25;
  ref::crossentropy_backward(dref.data(), probs.data(), tg.data(), scale, N, V);
  for (Precision p : {Precision::fp32, Precision::bf16}) {
    // Each slice's logits (N, Vt), as a tensor-parallel rank holds them.
    std::vector<std::vector<float>> z(2, std::vector<float>(static_cast<size_t>(N * Vt)));
    for (int r = 0; r < 2; ++r)
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < Vt; ++j) z[r][static_cast<size_t>(i * Vt + j)] = logits[static_cast<size_t>(i * V + r * Vt + j)];
    const std::vector<std::vector<float>> kept = z;
    std::vector<float> mx(N), m1(N), st(2 * N, 0.0f), s1(2 * N);
    be->cross_entropy_max(mx.data(), z[0].data(), N, Vt);
    be->cross_entropy_max(m1.data(), z[1].data(), N, Vt);
    for (int64_t i = 0; i < N; ++i) mx[i] = std::max(mx[i], m1[i]);  // the all-reduce max
    for (int r = 0; r < 2; ++r) {
      be->cross_entropy_exp_sum(s1.data(), z[r].data(), mx.data(), tg.data(), N, Vt, r * Vt);
      for (int64_t k = 0; k < 2 * N; ++k) st[k] += s1[k];  // the all-reduce sum
      EXPECT_EQ(z[r], kept[r]) << "the forward wrote the logits";
    }
    for (int64_t i = 0; i < N; ++i)
      EXPECT_NEAR(std::log(static_cast<double>(st[2 * i])) - st[2 * i + 1], losses[i], 1e-5) << i;
    for (int r = 0; r < 2; ++r) {
      be->cross_entropy_backward(z[r].data(), mx.data(), st.data(), tg.data(), N, Vt, r * Vt, static_cast<float>(scale), p);
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < Vt; ++j) {
          const float g = z[r][static_cast<size_t>(i * Vt + j)];
          const double want = dref[static_cast<size_t>(i * V + r * Vt + j)];
          EXPECT_NEAR(g, want, p == Precision::fp32 ? 1e-6 : std::fabs(want) / 256 + 1e-9) << i << " " << r * Vt + j;
          if (p == Precision::bf16) {
            EXPECT_EQ(std::bit_cast<uint32_t>(g) & 0xffffu, 0u) << g;
          }
        }
    }
  }
}

#ifdef STRATA_UNDER_SANITIZER
// Eigen's GEMM kernels are not instrumented under the sanitizers (cpu_gemm.h); the backend
// checks each operand's span against ASan's shadow memory first, so an operand that runs
// past its buffer, or a kept (freed) buffer used again, is still reported.
TEST(CpuBackendDeathTest, GemmOperandPastItsBufferIsReported) {
  auto be = make_cpu_backend();
  std::vector<float> a(6 * 4), b(4 * 5), c(6 * 5);
  // A claimed to be 7 x 4: its last row is past the vector's end.
  EXPECT_DEATH(be->gemm(false, false, 7, 5, 4, 1.0f, a.data(), 4, b.data(), 5, 0.0f, c.data(), 5),
               "heap-buffer-overflow");
  // C of row stride 6 for 6 x 5: its span is 35 floats, past the 30 of the vector.
  EXPECT_DEATH(be->gemm(false, false, 6, 5, 4, 1.0f, a.data(), 4, b.data(), 5, 0.0f, c.data(), 6),
               "heap-buffer-overflow");
}
// Likewise Eigen's exp and tanh (cpu_eltwise.h): a gated activation's input one row short,
// and logits one row short of the cross-entropy's N.
TEST(CpuBackendDeathTest, ElementwiseOperandPastItsBufferIsReported) {
  auto be = make_cpu_backend();
  const int64_t N = 3, F = 8;
  std::vector<float> u((N - 1) * 2 * F, 0.5f), out(N * F);
  EXPECT_DEATH(be->activation_forward(Activation::swiglu, out.data(), u.data(), N, F), "heap-buffer-overflow");
  std::vector<float> z((N - 1) * F, 0.25f), st(2 * N), mx(N, 0.0f);
  std::vector<int32_t> tg(N, 1);
  EXPECT_DEATH(be->cross_entropy_exp_sum(st.data(), z.data(), mx.data(), tg.data(), N, F, 0), "heap-buffer-overflow");
  EXPECT_DEATH(be->cross_entropy_backward(z.data(), mx.data(), st.data(), tg.data(), N, F, 0, 1.0f, Precision::bf16),
               "heap-buffer-overflow");
}
TEST(CpuBackendDeathTest, KeptBufferUsedAfterItsFreeIsReported) {
  auto be = make_cpu_backend();
  const int64_t n = 1 << 17;
  float* a = be->allocate(n);
  std::vector<float> b(4 * 4), c(4 * 4);
  be->deallocate(a);  // kept by the backend, poisoned
  EXPECT_DEATH(be->gemm(false, false, 4, 4, 4, 1.0f, a, 4, b.data(), 4, 0.0f, c.data(), 4), "use-after-poison");
  EXPECT_DEATH(a[3] = 1.0f, "use-after-poison");
}
#endif

TEST(CpuBackend, NormsMatchReference) {
  auto be = make_cpu_backend();
  Rand r;
  const int64_t N = 6, H = 32;
  auto x = r.normal(N * H, 2.0), w = r.normal(H), b = r.normal(H), dout = r.normal(N * H);
  Vec xd = as_double(x), wd = as_double(w), bd = as_double(b), dd = as_double(dout);
  {  // layernorm
    std::vector<float> out(static_cast<size_t>(N * H)), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
    be->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, H);
    Vec o(static_cast<size_t>(N * H)), md(static_cast<size_t>(N)), rd(static_cast<size_t>(N));
    ref::layernorm_forward(o.data(), md.data(), rd.data(), xd.data(), wd.data(), bd.data(), N, H);
    EXPECT_LT(rel_err(out.data(), o.data(), N * H), kOpTol);
    std::vector<float> dx(static_cast<size_t>(N * H), 0.0f), dw(static_cast<size_t>(H), 0.0f), db(static_cast<size_t>(H), 0.0f);
    be->layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), mean.data(), rstd.data(), w.data(), N, H);
    Vec dxd(static_cast<size_t>(N * H), 0.0), dwd(static_cast<size_t>(H), 0.0), dbd(static_cast<size_t>(H), 0.0);
    ref::layernorm_backward(dxd.data(), dwd.data(), dbd.data(), dd.data(), xd.data(), md.data(), rd.data(), wd.data(), N, H);
    EXPECT_LT(rel_err(dx.data(), dxd.data(), N * H), kOpTol);
    EXPECT_LT(rel_err(dw.data(), dwd.data(), H), kOpTol);
    EXPECT_LT(rel_err(db.data(), dbd.data(), H), kOpTol);
  }
  {  // rmsnorm
    std::vector<float> out(static_cast<size_t>(N * H)), rstd(static_cast<size_t>(N));
    be->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, H);
    Vec o(static_cast<size_t>(N * H)), rd(static_cast<size_t>(N));
    ref::rmsnorm_forward(o.data(), rd.data(), xd.data(), wd.data(), N, H);
    EXPECT_LT(rel_err(out.data(), o.data(), N * H), kOpTol);
    std::vector<float> dx(static_cast<size_t>(N * H), 0.0f), dw(static_cast<size_t>(H), 0.0f);
    be->rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), rstd.data(), w.data(), N, H);
    Vec dxd(static_cast<size_t>(N * H), 0.0), dwd(static_cast<size_t>(H), 0.0);
    ref::rmsnorm_backward(dxd.data(), dwd.data(), dd.data(), xd.data(), rd.data(), wd.data(), N, H);
    EXPECT_LT(rel_err(dx.data(), dxd.data(), N * H), kOpTol);
    EXPECT_LT(rel_err(dw.data(), dwd.data(), H), kOpTol);
  }
}

TEST(CpuBackend, ActivationsMatchReference) {
  auto be = make_cpu_backend();
  Rand r;
  const int64_t N = 5, F = 24;
  for (Activation act : {Activation::gelu, Activation::swiglu, Activation::geglu, Activation::squared_relu}) {
    const int64_t W = gated(act) ? 2 * F : F;
    auto u = r.normal(N * W, 2.0), dout = r.normal(N * F);
    std::vector<float> out(static_cast<size_t>(N * F)), du(static_cast<size_t>(N * W));
    be->activation_forward(act, out.data(), u.data(), N, F);
    be->activation_backward(act, du.data(), dout.data(), u.data(), N, F);
    Vec ud = as_double(u), dd = as_double(dout), o(static_cast<size_t>(N * F)), dud(static_cast<size_t>(N * W), 0.0);
    if (act == Activation::gelu) {
      ref::gelu_forward(o.data(), ud.data(), N, F);
      ref::gelu_backward(dud.data(), dd.data(), ud.data(), N, F);
    } else if (act == Activation::squared_relu) {
      ref::squared_relu_forward(o.data(), ud.data(), N, F);
      ref::squared_relu_backward(dud.data(), dd.data(), ud.data(), N, F);
    } else if (act == Activation::swiglu) {
      ref::swiglu_forward(o.data(), ud.data(), N, F);
      ref::swiglu_backward(dud.data(), dd.data(), ud.data(), N, F);
    } else {
      ref::geglu_forward(o.data(), ud.data(), N, F);
      ref::geglu_backward(dud.data(), dd.data(), ud.data(), N, F);
    }
    EXPECT_LT(rel_err(out.data(), o.data(), N * F), kOpTol) << to_string(act);
    EXPECT_LT(rel_err(du.data(), dud.data(), N * W), kOpTol) << to_string(act);
  }
}

// (S, B, heads*D rows of stride ld) <-> the reference's (B, S, heads, D).
Vec to_bshd(const float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld) {
  Vec out(static_cast<size_t>(B * S * heads * D));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < heads * D; ++i)
        out[static_cast<size_t>((b * S + s) * heads * D + i)] = x[(s * B + b) * ld + i];
  return out;
}

// The double reference of one causal attention on the executor's packed (S, B, (A+2G)*D)
// rows: output, probabilities, each query's log-sum-exp (B, A, S), and the gradients of a
// given dout, for the executor's results to be compared with.
struct AttentionRef {
  int64_t S, B, A, G, D;
  std::vector<float> dout;
  Vec q, k, v, out, probs, lse, dq, dk, dv;
  AttentionRef(const std::vector<float>& qkv, std::vector<float> dout_, int64_t S_, int64_t B_, int64_t A_, int64_t G_,
               int64_t D_)
      : S(S_), B(B_), A(A_), G(G_), D(D_), dout(std::move(dout_)) {
    const int64_t Q = (A + 2 * G) * D;
    q = to_bshd(qkv.data(), S, B, A, D, Q);
    k = to_bshd(qkv.data() + A * D, S, B, G, D, Q);
    v = to_bshd(qkv.data() + (A + G) * D, S, B, G, D, Q);
    out.assign(static_cast<size_t>(B * S * A * D), 0.0);
    probs.assign(static_cast<size_t>(B * A * S * S), 0.0);
    ref::attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), B, S, A, G, D);
    lse.assign(static_cast<size_t>(B * A * S), 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < A; ++h)
        for (int64_t i = 0; i < S; ++i) {
          std::vector<double> sc(static_cast<size_t>(i + 1));
          double mx = -1e300, sum = 0;
          for (int64_t j = 0; j <= i; ++j) {
            double d = 0;
            for (int64_t e = 0; e < D; ++e)
              d += q[static_cast<size_t>(((b * S + i) * A + h) * D + e)] *
                   k[static_cast<size_t>(((b * S + j) * G + h / (A / G)) * D + e)];
            sc[static_cast<size_t>(j)] = d / std::sqrt(static_cast<double>(D));
            mx = std::max(mx, sc[static_cast<size_t>(j)]);
          }
          for (double x : sc) sum += std::exp(x - mx);
          lse[static_cast<size_t>((b * A + h) * S + i)] = mx + std::log(sum);
        }
    const Vec doutd = to_bshd(dout.data(), S, B, A, D, A * D);
    dq.assign(q.size(), 0.0);
    dk.assign(k.size(), 0.0);
    dv.assign(v.size(), 0.0);
    ref::attention_backward(dq.data(), dk.data(), dv.data(), doutd.data(), probs.data(), q.data(), k.data(), v.data(), B,
                            S, A, G, D);
  }
  void expect_out(const std::vector<float>& got, const std::string& tag) const {
    const Vec g = to_bshd(got.data(), S, B, A, D, A * D);
    const std::vector<float> gf(g.begin(), g.end());
    EXPECT_LT(rel_err(gf.data(), out.data(), static_cast<int64_t>(out.size())), kOpTol) << tag;
  }
  void expect_dqkv(const std::vector<float>& dqkv, const std::string& tag) const {
    const int64_t Q = (A + 2 * G) * D;
    for (auto [off, heads, want] : {std::tuple{int64_t{0}, A, &dq}, std::tuple{A * D, G, &dk}, std::tuple{(A + G) * D, G, &dv}}) {
      const Vec g = to_bshd(dqkv.data() + off, S, B, heads, D, Q);
      const std::vector<float> gf(g.begin(), g.end());
      EXPECT_LT(rel_err(gf.data(), want->data(), static_cast<int64_t>(want->size())), kOpTol) << tag << " offset " << off;
    }
  }
};

TEST(CpuBackend, RopeAndAttentionMatchReference) {
  auto be = make_cpu_backend();
  Rand r;
  const int64_t S = 9, B = 2, A = 4, G = 2, D = 8, Q = (A + 2 * G) * D;
  auto qkv = r.normal(S * B * Q);
  // rope on the q heads of the packed rows.
  std::vector<float> roped = qkv;
  be->rope(roped.data(), S, B, A, D, Q, false);
  Vec q = to_bshd(qkv.data(), S, B, A, D, Q), qr(q.size());
  ref::rope_forward(qr.data(), q.data(), B, S, A, D);
  Vec got = to_bshd(roped.data(), S, B, A, D, Q);
  std::vector<float> gotf(got.begin(), got.end());
  EXPECT_LT(rel_err(gotf.data(), qr.data(), static_cast<int64_t>(qr.size())), kOpTol);
  std::vector<float> back = roped;  // the inverse rotation undoes it
  be->rope(back.data(), S, B, A, D, Q, true);
  for (size_t i = 0; i < back.size(); ++i) EXPECT_NEAR(back[i], qkv[i], 1e-5);
  // attention forward and backward, with and without saved probabilities.
  const AttentionRef want(qkv, r.normal(S * B * A * D), S, B, A, G, D);
  std::vector<float> out(static_cast<size_t>(S * B * A * D)), probs(static_cast<size_t>(B * A * S * S));
  be->attention_forward(out.data(), probs.data(), qkv.data(), S, B, A, G, D);
  want.expect_out(out, "unfused");
  for (bool saved : {true, false}) {
    std::vector<float> dqkv(static_cast<size_t>(S * B * Q));
    be->attention_backward(dqkv.data(), want.dout.data(), saved ? probs.data() : nullptr, qkv.data(), S, B, A, G, D);
    want.expect_dqkv(dqkv, saved ? "unfused, probabilities saved" : "unfused, recomputed");
  }
}

// The fused attention against the double reference at lengths inside one 64-row block,
// exactly one and across several (ragged last block), for grouped, multi-head and
// multi-query attention; lse against the log-sum-exp of the scaled causal scores.
TEST(CpuBackend, FusedAttentionMatchesReference) {
  auto be = make_cpu_backend();
  Rand r;
  struct Shape { int64_t S, B, A, G, D; };
  for (const Shape sh : {Shape{9, 2, 4, 2, 8}, Shape{64, 2, 2, 2, 4}, Shape{150, 1, 2, 1, 16}, Shape{130, 2, 3, 3, 5}}) {
    const auto [S, B, A, G, D] = sh;
    const int64_t Q = (A + 2 * G) * D;
    const std::string tag = "fused S=" + std::to_string(S) + " A=" + std::to_string(A) + " G=" + std::to_string(G);
    auto qkv = r.normal(S * B * Q);
    const AttentionRef want(qkv, r.normal(S * B * A * D), S, B, A, G, D);
    std::vector<float> out(static_cast<size_t>(S * B * A * D)), lse(static_cast<size_t>(B * A * S));
    be->flash_attention_forward(out.data(), lse.data(), qkv.data(), S, B, A, G, D);
    want.expect_out(out, tag);
    EXPECT_LT(rel_err(lse.data(), want.lse.data(), static_cast<int64_t>(lse.size())), kOpTol) << tag;
    std::vector<float> dqkv(static_cast<size_t>(S * B * Q), 7.0f);  // overwritten, not accumulated
    be->flash_attention_backward(dqkv.data(), want.dout.data(), out.data(), lse.data(), qkv.data(), S, B, A, G, D);
    want.expect_dqkv(dqkv, tag);
  }
}

// Context parallelism's ops against the whole sequence: the queries cut into segments at
// arbitrary offsets (one inside a 64-row flash block, one across it), the keys and values
// in a buffer of their own stride; each segment's output and lse are the reference's rows,
// and the backwards of all segments, dq into their rows and dK dV accumulated, give the
// reference's gradients. rope_at of a tail of the rows equals rope of the whole.
TEST(CpuBackend, ContextParallelAttentionMatchesTheWholeSequence) {
  auto be = make_cpu_backend();
  Rand r;
  const int64_t S = 80, B = 2, A = 4, G = 2, D = 8, Q = (A + 2 * G) * D, KV = 2 * G * D;
  const auto qkv = r.normal(S * B * Q);
  const AttentionRef want(qkv, r.normal(S * B * A * D), S, B, A, G, D);
  std::vector<float> kv(static_cast<size_t>(S * B * KV));
  be->copy_rows(kv.data(), KV, qkv.data() + A * D, Q, S * B, KV);
  const int64_t cuts[] = {0, 5, 70, 80};
  for (bool flash : {false, true}) {
    const std::string tag = flash ? "context parallel, fused" : "context parallel, unfused";
    std::vector<float> out(static_cast<size_t>(S * B * A * D)), probs(static_cast<size_t>(B * A * S * S)),
        lse(static_cast<size_t>(B * A * S)), dqkv(static_cast<size_t>(S * B * Q)), dkv(static_cast<size_t>(S * B * KV));
    std::vector<std::vector<float>> seg_probs, seg_lse;
    for (int i = 0; i < 3; ++i) {
      const int64_t q0 = cuts[i], Sq = cuts[i + 1] - q0;
      seg_probs.emplace_back(static_cast<size_t>(B * A * Sq * S), -1.0f);
      seg_lse.emplace_back(static_cast<size_t>(B * A * Sq));
      if (flash)
        be->flash_attention_forward_cp(out.data() + q0 * B * A * D, seg_lse.back().data(), qkv.data() + q0 * B * Q, Q,
                                       kv.data(), KV, Sq, q0, B, A, G, D);
      else
        be->attention_forward_cp(out.data() + q0 * B * A * D, seg_probs.back().data(), S, qkv.data() + q0 * B * Q, Q,
                                 kv.data(), KV, Sq, q0, B, A, G, D);
      for (int64_t bh = 0; bh < B * A; ++bh)
        for (int64_t i2 = 0; i2 < Sq; ++i2) {
          lse[static_cast<size_t>(bh * S + q0 + i2)] = seg_lse.back()[static_cast<size_t>(bh * Sq + i2)];
          for (int64_t j = 0; j < S; ++j)  // zero past each query's last key, up to the stride
            probs[static_cast<size_t>((bh * S + q0 + i2) * S + j)] =
                seg_probs.back()[static_cast<size_t>((bh * Sq + i2) * S + j)];
        }
    }
    want.expect_out(out, tag);
    if (flash) EXPECT_LT(rel_err(lse.data(), want.lse.data(), static_cast<int64_t>(lse.size())), kOpTol) << tag;
    else EXPECT_LT(rel_err(probs.data(), want.probs.data(), static_cast<int64_t>(probs.size())), kOpTol) << tag;
    for (int i = 0; i < 3; ++i) {
      const int64_t q0 = cuts[i], Sq = cuts[i + 1] - q0;
      if (flash)
        be->flash_attention_backward_cp(dqkv.data() + q0 * B * Q, Q, dkv.data(), KV, want.dout.data() + q0 * B * A * D,
                                        out.data() + q0 * B * A * D, seg_lse[static_cast<size_t>(i)].data(),
                                        qkv.data() + q0 * B * Q, kv.data(), Sq, q0, B, A, G, D);
      else  // the first segment recomputes its probabilities
        be->attention_backward_cp(dqkv.data() + q0 * B * Q, Q, dkv.data(), KV, want.dout.data() + q0 * B * A * D,
                                  i == 0 ? nullptr : seg_probs[static_cast<size_t>(i)].data(), S,
                                  qkv.data() + q0 * B * Q, kv.data(), Sq, q0, B, A, G, D);
    }
    be->copy_rows(dqkv.data() + A * D, Q, dkv.data(), KV, S * B, KV);
    want.expect_dqkv(dqkv, tag);
  }
  std::vector<float> whole = qkv, tail = qkv;
  be->rope(whole.data(), S, B, A, D, Q, false);
  be->rope_at(tail.data() + 30 * B * Q, S - 30, B, A, D, Q, false, 30);
  for (int64_t i = 30 * B * Q; i < S * B * Q; ++i) EXPECT_EQ(tail[static_cast<size_t>(i)], whole[static_cast<size_t>(i)]);
}

// The CUDA backend's unfused attention is a sequence of batched GEMMs and row kernels
// (executor/cuda/attention_plan.h). Here the same sequence runs on plain loops (each batched
// product as backend.h's row-major GEMM, matrix i at + i * stride) against the double
// reference: multi-head, grouped and multi-query, probabilities kept and recomputed, the
// groups in one pass and one at a time (a workspace of one S x S matrix), outputs that start
// as NaN. What it cannot check is cuBLASLt itself (cuda_ops_test, on a GPU).
struct LoopAttentionOps {
  std::vector<float> work;
  void matmul(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
              int64_t ldb, float beta, float* C, int64_t ldc, const attention_plan::Batch& batch) {
    for (int64_t i = 0; i < batch.count; ++i) {
      const float *a = A + i * batch.a, *b = B + i * batch.b;
      float* c = C + i * batch.c;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < K; ++k)
            acc += static_cast<double>(ta ? a[k * lda + m] : a[m * lda + k]) * (tb ? b[n * ldb + k] : b[k * ldb + n]);
          float& out = c[m * ldc + n];
          out = static_cast<float>(alpha * acc + (beta != 0.0f ? beta * out : 0.0f));
        }
    }
  }
  void softmax(float* p, int64_t stride, int64_t count, int64_t S) {
    for (int64_t g = 0; g < count; ++g)
      for (int64_t i = 0; i < S; ++i) {
        float* x = p + g * stride + i * S;
        const float mx = *std::max_element(x, x + i + 1);
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += (x[j] = std::exp(x[j] - mx));
        for (int64_t j = 0; j < S; ++j) x[j] = j <= i ? static_cast<float>(x[j] / sum) : 0.0f;
      }
  }
  void softmax_backward(float* d, int64_t d_stride, const float* p, int64_t p_stride, int64_t count, int64_t S,
                        float scale) {
    for (int64_t g = 0; g < count; ++g)
      for (int64_t i = 0; i < S; ++i) {
        float* dr = d + g * d_stride + i * S;
        const float* pr = p + g * p_stride + i * S;
        double dot = 0;
        for (int64_t j = 0; j <= i; ++j) dot += static_cast<double>(pr[j]) * dr[j];
        for (int64_t j = 0; j < S; ++j) dr[j] = j <= i ? static_cast<float>(pr[j] * (dr[j] - dot) * scale) : 0.0f;
      }
  }
  void zero(float* p, int64_t n) { std::fill(p, p + n, 0.0f); }
  float* workspace(int64_t floats) {
    work.assign(static_cast<size_t>(floats), std::numeric_limits<float>::quiet_NaN());
    return work.data();
  }
};

TEST(CudaAttentionPlan, BatchedGemmSequenceMatchesReference) {
  Rand r;
  struct Shape { int64_t S, B, A, G, D; };
  for (const Shape sh : {Shape{9, 2, 4, 4, 8}, Shape{9, 2, 4, 2, 8}, Shape{7, 1, 4, 1, 3}, Shape{6, 2, 6, 3, 5}}) {
    const auto [S, B, A, G, D] = sh;
    const int64_t Q = (A + 2 * G) * D;
    auto qkv = r.normal(S * B * Q);
    const AttentionRef want(qkv, r.normal(S * B * A * D), S, B, A, G, D);
    const attention_plan::Heads hd{S, B, A, G, D};
    for (const int64_t workspace : {int64_t{1}, int64_t{1} << 30})  // one group per pass, all of them
      for (bool keep : {true, false}) {
        const std::string tag = "plan A=" + std::to_string(A) + " G=" + std::to_string(G) + " groups per pass " +
                                std::to_string(hd.groups_per_pass(workspace)) + (keep ? "" : " recomputed");
        LoopAttentionOps ops;
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::vector<float> out(static_cast<size_t>(S * B * A * D), nan), probs(static_cast<size_t>(B * A * S * S), nan);
        attention_plan::forward(ops, out.data(), keep ? probs.data() : nullptr, qkv.data(), hd, workspace);
        want.expect_out(out, tag);
        if (keep) {
          EXPECT_LT(rel_err(probs.data(), want.probs.data(), static_cast<int64_t>(probs.size())), kOpTol) << tag;
        }
        std::vector<float> dqkv(static_cast<size_t>(S * B * Q), nan);
        attention_plan::backward(ops, dqkv.data(), want.dout.data(), keep ? probs.data() : nullptr, qkv.data(), hd,
                                 workspace);
        want.expect_dqkv(dqkv, tag);
      }
  }
}

TEST(CpuBackend, RoundingToBf16AndFp16) {
  auto be = make_cpu_backend();
  std::vector<float> x = {1.0f, 1.0f + 1.0f / 256.0f, 1.0f + 3.0f / 256.0f, 70000.0f, -3.14159265f};
  std::vector<float> b = x, h = x;
  be->round_to(b.data(), 5, Precision::bf16);
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], 1.0f);                   // a tie rounds to even (7 mantissa bits)
  EXPECT_EQ(b[2], 1.0f + 4.0f / 256.0f);   // 1 + 3/256 is a tie too, to the even 1 + 4/256
  EXPECT_EQ(b[4], -3.140625f);
  be->round_to(h.data(), 5, Precision::fp16);
  EXPECT_EQ(h[1], 1.0f + 1.0f / 256.0f);   // fp16 keeps 10 mantissa bits
  EXPECT_TRUE(std::isinf(h[3]));           // beyond 65504 overflows
}

// 16-bit storage of saved activations: unpacking gives back exactly the values round_to
// gives, ties to even, overflow, infinities and NaN included.
TEST(CpuBackend, Pack16GivesBackTheRoundedValues) {
  auto be = make_cpu_backend();
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> x(1000);
  for (auto& v : x) v = nd(gen);
  const float specials[] = {0.0f, -0.0f, 1.0f + 1.0f / 256.0f, 70000.0f, -1e-30f, 1e-40f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), 3.0e38f,
                            std::numeric_limits<float>::signaling_NaN()};
  std::copy(std::begin(specials), std::end(specials), x.begin());
  for (Precision p : {Precision::bf16, Precision::fp16}) {
    std::vector<float> rounded = x, back(x.size());
    be->round_to(rounded.data(), static_cast<int64_t>(x.size()), p);
    std::vector<uint16_t> packed(x.size());
    be->pack16(packed.data(), x.data(), static_cast<int64_t>(x.size()), p);
    be->unpack16(back.data(), packed.data(), static_cast<int64_t>(x.size()), p);
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(rounded[i])) {
        EXPECT_TRUE(std::isnan(back[i])) << to_string(p) << " " << i;
      } else {
        EXPECT_EQ(std::memcmp(&back[i], &rounded[i], 4), 0) << to_string(p) << " " << x[i] << " -> " << back[i];
      }
    }
  }
}

// The CPU backend's fp16 passes run eight values at a time (F16C) with a scalar tail:
// bit for bit the IEEE conversion (here the test's own _Float16 casts, which this file's
// flags leave to libgcc's software routines), over every sign, exponent and top 7 mantissa
// bits of a float with low halves that put the dropped bits at, just below and just above
// a tie for every normal and subnormal fp16 result, at lengths that leave every tail.
TEST(CpuBackend, Fp16PassesMatchTheScalarConversion) {
  auto be = make_cpu_backend();
  std::vector<uint32_t> lows = {0x0000, 0x0001, 0xffff, 0x7fff, 0x8001};
  // Ties at bits 12 (normal results: 13 bits dropped) to 15 (subnormal ones drop more;
  // ties above bit 15 lie in the enumerated high half), the kept bit above each 0 and 1
  // (t = 1, 3; a carry past bit 15 lands in the high half), each exact, one above, one below.
  for (int b = 13; b <= 16; ++b)
    for (uint32_t t : {1u, 3u})
      for (uint32_t d : {0u, 1u, ~0u}) lows.push_back(((t << (b - 1)) + d) & 0xffffu);
  std::mt19937 gen(11);
  for (int i = 0; i < 8; ++i) lows.push_back(gen() & 0xffffu);
  std::vector<float> x;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (uint32_t lo : lows) {
      const uint32_t u = hi << 16 | lo;
      float f;
      std::memcpy(&f, &u, 4);
      x.push_back(f);
    }
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  int64_t checked = 0;
  std::vector<int64_t> lengths = {static_cast<int64_t>(x.size())};  // (and 1-17: every tail of 8)
  for (int64_t n = 1; n <= 17; ++n) lengths.push_back(n);
  for (int64_t n : lengths) {
    for (int64_t off : {int64_t{0}, int64_t{3}}) {
      const float* src = x.data() + off;
      const int64_t len = std::min<int64_t>(n, static_cast<int64_t>(x.size()) - off);
      std::vector<float> r(src, src + len), c(static_cast<size_t>(len));
      std::vector<uint16_t> h(static_cast<size_t>(len));
      be->round_to(r.data(), len, Precision::fp16);
      be->round_copy(c.data(), src, len, Precision::fp16);
      be->pack16(h.data(), src, len, Precision::fp16);
      for (int64_t i = 0; i < len; ++i) {
        const float v = src[i];
        const _Float16 ref = static_cast<_Float16>(v);
        uint16_t ref_bits;
        std::memcpy(&ref_bits, &ref, 2);
        const float ref_round = std::isnan(v) ? v : static_cast<float>(ref);
        if (std::isnan(v)) ref_bits = static_cast<uint16_t>((ref_bits & 0x8000u) | 0x7e00u);
        ASSERT_EQ(bits(r[i]), bits(ref_round)) << "round_to of 0x" << std::hex << bits(v);
        ASSERT_EQ(bits(c[i]), bits(ref_round)) << "round_copy of 0x" << std::hex << bits(v);
        ASSERT_EQ(h[i], ref_bits) << "pack16 of 0x" << std::hex << bits(v);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 65536 * 20);
  // Every 16-bit pattern back to a float, from an odd start too.
  std::vector<uint16_t> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> back(all.size() - 3);
  be->unpack16(back.data(), all.data() + 3, static_cast<int64_t>(back.size()), Precision::fp16);
  for (size_t i = 0; i < back.size(); ++i) {
    _Float16 hv;
    std::memcpy(&hv, &all[i + 3], 2);
    const float want = static_cast<float>(hv);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(back[i])) << i;
      ASSERT_EQ(std::signbit(back[i]), std::signbit(want)) << i;
    } else {
      ASSERT_EQ(bits(back[i]), bits(want)) << "unpack16 of 0x" << std::hex << all[i + 3];
    }
  }
}

TEST(MemoryTracker, PackedBufferHoldsTwoBytesPerValue) {
  auto be = make_cpu_backend();
  MemoryTracker t;
  t.set_backend(be.get());
  Buf b(&t, MemCategory::activations, 101, 2);
  for (int64_t i = 0; i < b.size(); ++i) b[i] = 1.0f + static_cast<float>(i) / 1000.0f;
  EXPECT_EQ(b.storage_bytes(), 404);
  b.pack(Precision::fp32);  // nothing to do
  EXPECT_FALSE(b.packed());
  b.pack(Precision::bf16);
  EXPECT_TRUE(b.packed());
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.storage_bytes(), 204);                        // 101 values, 2 bytes each, in whole floats
  EXPECT_EQ(t.live(MemCategory::activations), 202);         // the charge is the same either way
  Buf moved = std::move(b);
  EXPECT_TRUE(moved.packed());
  moved.unpack();
  EXPECT_FALSE(moved.packed());
  for (int64_t i = 0; i < moved.size(); ++i) {
    float r = 1.0f + static_cast<float>(i) / 1000.0f;
    be->round_to(&r, 1, Precision::bf16);
    EXPECT_EQ(moved[i], r);
  }
  moved.pack(Precision::fp16);
  moved.release();  // frees the packed storage
  EXPECT_EQ(t.live_total(), 0);
}

// ---- The whole model on one rank: the float executor against the double reference.

ModelSpec spec_gpt() {
  ModelSpec m;
  m.name = "exec-gpt";
  m.L = 2; m.H = 32; m.A = 4; m.G = 4; m.F = 64; m.V = 128; m.S = 16;
  return m;
}

ModelSpec spec_llama() {
  ModelSpec m = spec_gpt();
  m.name = "exec-llama";
  m.G = 2; m.F = 48;
  m.activation = Activation::swiglu;
  m.normalization = Norm::rmsnorm;
  m.position = Position::rope;
  m.tie_embeddings = false;
  m.bias = false;
  return m;
}

ModelSpec spec_mixed() {  // geglu, layernorm, rope, untied, biases, G = 1, D = 16 != H/A
  ModelSpec m = spec_llama();
  m.name = "exec-mixed";
  m.G = 1;
  m.kv_channels = 16;
  m.activation = Activation::geglu;
  m.normalization = Norm::layernorm;
  m.bias = true;
  return m;
}

ModelSpec spec_nemotron() {  // squared ReLU (ungated), layernorm, rope, untied, no biases
  ModelSpec m = spec_llama();
  m.name = "exec-nemotron";
  m.activation = Activation::squared_relu;
  m.normalization = Norm::layernorm;
  return m;
}

// One forward and backward of the executor's model functions over the global layout.
double executor_loss_and_grads(const ModelSpec& m, Recompute rc, bool flash, const std::vector<float>& params,
                               const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets, int64_t B,
                               std::vector<float>* grads, Precision prec = Precision::fp32) {
  auto comm = make_local_comm();
  auto be = make_cpu_backend();
  MemoryTracker mem;
  const ParamLayout lay = global_param_layout(m);
  grads->assign(static_cast<size_t>(lay.size), 0.0f);
  ModelCtx c;
  c.m = &m;
  c.be = be.get();
  c.comm = comm.get();
  c.tp = Group{{comm->rank()}, 0, kTensor};
  c.recompute = rc;
  c.flash = flash;
  c.precision = prec;
  mem.set_backend(be.get());
  c.mem = &mem;
  c.B = B;
  c.S = m.S;
  auto view = [&](size_t u) {
    return UnitView{&lay, lay.units[u].begin, params.data() + lay.units[u].begin, grads->data() + lay.units[u].begin};
  };
  const UnitView wte = view(0);
  const bool learned = m.position == Position::learned;
  const UnitView wpe = learned ? view(1) : UnitView{};
  const size_t first_layer = learned ? 2 : 1;
  const UnitView fin = view(lay.units.size() - 1);
  const TensorKind out_kind = m.tie_embeddings ? TensorKind::wte : TensorKind::lm_head;
  const float* out_w = params.data() + lay.at(out_kind).offset;
  float* out_g = grads->data() + lay.at(out_kind).offset;
  std::vector<LayerActs> acts(static_cast<size_t>(m.L));
  Buf x = embedding_forward(c, wte, learned ? &wpe : nullptr, tokens.data());
  for (int64_t l = 0; l < m.L; ++l) x = layer_forward(c, view(first_layer + static_cast<size_t>(l)), l, std::move(x), &acts[static_cast<size_t>(l)]);
  // What the layers keep for the backward: with 16-bit activations every 16-bit tensor is
  // stored in 2 bytes per value (in whole floats: at most 2 bytes more per tensor), as charged.
  int64_t kept = 0, stored = 0, tensors = 0;
  for (LayerActs& a : acts)
    for (const Buf* b : a.sixteen_bit()) {
      if (b->empty()) continue;
      EXPECT_EQ(b->packed(), prec != Precision::fp32);
      kept += (prec == Precision::fp32 ? 4 : 2) * b->size();
      stored += b->storage_bytes();
      ++tensors;
    }
  EXPECT_GT(tensors, 0);
  EXPECT_GE(stored, kept);
  EXPECT_LE(stored, kept + 2 * tensors);
  HeadActs h;
  const double loss_sum = head_forward(c, fin, out_w, std::move(x), targets.data(), &h);
  const float scale = 1.0f / static_cast<float>(B * m.S);
  Buf dx = head_backward(c, fin, out_w, out_g, &h, scale);
  for (int64_t l = m.L; l-- > 0;) dx = layer_backward(c, view(first_layer + static_cast<size_t>(l)), l, &acts[static_cast<size_t>(l)], dx);
  embedding_backward(c, wte, learned ? &wpe : nullptr, tokens.data(), dx);
  dx.release();
  EXPECT_EQ(mem.live(MemCategory::activations), 0) << "every activation released after the backward";
  return loss_sum / static_cast<double>(B * m.S);
}

void check_against_reference(const ModelSpec& m, Recompute rc, bool flash = false, Precision prec = Precision::fp32,
                             double tol = 1e-4) {
  const ParamLayout lay = global_param_layout(m);
  std::vector<float> params(static_cast<size_t>(lay.size));
  initialise(m, lay, 7, params.data());
  std::mt19937_64 gen(3);
  std::normal_distribution<float> nd(0.0f, 0.2f);
  for (const TensorSlot& s : lay.tensors)  // norms and biases away from 1 and 0
    if (s.cols == 1)
      for (int64_t i = 0; i < s.size(); ++i) params[static_cast<size_t>(s.offset + i)] += nd(gen);
  const int64_t B = 3, V = executor_vocab(m);
  std::vector<int32_t> tokens(static_cast<size_t>(B * m.S)), targets(tokens.size());
  for (auto& t : tokens) t = static_cast<int32_t>(gen() % static_cast<uint64_t>(V));
  for (auto& t : targets) t = static_cast<int32_t>(gen() % static_cast<uint64_t>(V));
  std::vector<float> g;
  const double loss = executor_loss_and_grads(m, rc, flash, params, tokens, targets, B, &g, prec);
  Vec gd;
  const double ref_loss =
      ref::model_forward_backward(m, Vec(params.begin(), params.end()), tokens.data(), targets.data(), B, m.S, &gd);
  EXPECT_NEAR(loss, ref_loss, tol / 10 * ref_loss);
  double worst = 0;
  for (const TensorSlot& s : lay.tensors) {
    const double e = rel_err(g.data() + s.offset, gd.data() + s.offset, s.size());
    worst = std::max(worst, e);
    EXPECT_LT(e, tol) << m.name << " " << to_string(s.kind) << " layer " << s.layer;
  }
  std::printf("  %s %s recompute=%s attention=%s: loss %.7f vs reference %.7f; largest gradient error %.2e\n",
              m.name.c_str(), to_string(prec), to_string(rc), flash ? "flash" : "unfused", loss, ref_loss, worst);
}

TEST(ExecutorModel, GptMatchesReference) {
  for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) check_against_reference(spec_gpt(), rc);
}
TEST(ExecutorModel, LlamaMatchesReference) {
  for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) check_against_reference(spec_llama(), rc);
}
TEST(ExecutorModel, MixedMatchesReference) { check_against_reference(spec_mixed(), Recompute::none); }
TEST(ExecutorModel, NemotronMatchesReference) {
  for (Recompute rc : {Recompute::none, Recompute::full}) check_against_reference(spec_nemotron(), rc);
  check_against_reference(spec_nemotron(), Recompute::selective, true);
  check_against_reference(spec_nemotron(), Recompute::none, true, Precision::bf16, 2e-2);
}
// The fused attention (the plan's attention: flash) in the whole model: every gradient as
// the double reference's, with the log-sum-exp kept, recomputed (selective) and under full
// recompute.
TEST(ExecutorModel, FusedAttentionMatchesReference) {
  for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) {
    check_against_reference(spec_gpt(), rc, true);
    check_against_reference(spec_llama(), rc, true);
  }
  check_against_reference(spec_mixed(), Recompute::none, true);
}

// bf16 and fp16: the GEMM inputs rounded and the saved activations stored in 16 bits
// (packed) track the double reference within 16-bit rounding, with every recompute mode.
TEST(ExecutorModel, SixteenBitRunsTrackTheReference) {
  for (Precision p : {Precision::bf16, Precision::fp16})
    for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) {
      const double tol = p == Precision::bf16 ? 2e-2 : 5e-3;  // 2x and 4x the largest errors seen (9.7e-3, 1.3e-3)
      check_against_reference(spec_gpt(), rc, false, p, tol);
      check_against_reference(spec_llama(), rc, true, p, tol);
    }
}

// ---- Process grid, layout, data, sharding, optimizer, memory.

TEST(ProcessGrid, MegatronOrderExample) {
  ProcessGrid g;
  g.t = 2; g.d = 2; g.p = 2;
  EXPECT_EQ(g.group(kTensor, 5).ranks, (std::vector<int>{4, 5}));
  EXPECT_EQ(g.group(kData, 5).ranks, (std::vector<int>{5, 7}));
  EXPECT_EQ(g.group(kPipeline, 5).ranks, (std::vector<int>{1, 5}));
  EXPECT_EQ(g.group(kEmbedding, 3).ranks, (std::vector<int>{3, 7}));
  EXPECT_EQ(g.group(kModel, 2).ranks, (std::vector<int>{2, 3, 6, 7}));
  EXPECT_EQ(g.group(kPipeline, 5).me, 1);
  for (int64_t r = 0; r < g.world(); ++r) EXPECT_EQ(g.rank_of(g.coords(r)), r);
  EXPECT_EQ(g.all_groups(kData).size(), 4u);
  ProcessGrid c;  // context parallel between tensor and data: t=2 c=2 d=2
  c.t = 2; c.c = 2; c.d = 2;
  EXPECT_EQ(c.group(kContext, 5).ranks, (std::vector<int>{5, 7}));
  EXPECT_EQ(c.group(kReplica, 5).ranks, (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(c.group(kReplica, 5).me, 2);
  EXPECT_EQ(c.group(kData, 5).ranks, (std::vector<int>{1, 5}));
  ProcessGrid h;  // a middle stage is in no embedding group
  h.p = 3;
  EXPECT_EQ(h.group(kEmbedding, 1).me, -1);
}

TEST(ParamLayout, TensorParallelShardsCoverTheGlobalTensorsOnce) {
  for (const ModelSpec& m : {spec_gpt(), spec_llama(), spec_mixed(), spec_nemotron()}) {
    const ParamLayout g = global_param_layout(m);
    for (int64_t t : {2, 4}) {
      if (m.G % t) continue;
      std::vector<int> hits(static_cast<size_t>(g.size), 0);
      for (int64_t r = 0; r < t; ++r) {
        std::vector<int64_t> layers;
        for (int64_t l = 0; l < m.L; ++l) layers.push_back(l);
        const ParamLayout lay = make_param_layout(m, t, r, true, layers, true);
        for (const TensorSlot& s : lay.tensors) {
          if (s.tp_replicated && r > 0) continue;
          const TensorSlot& gs = g.at(s.kind, s.layer);
          for (int64_t i = 0; i < s.rows; ++i)
            for (int64_t j = 0; j < s.cols; ++j) {
              int64_t gi = 0, gj = 0;
              global_coords(m, s, t, r, i, j, &gi, &gj);
              ASSERT_LT(gi, gs.rows);
              ASSERT_LT(gj, gs.cols);
              ++hits[static_cast<size_t>(gs.offset + gi * gs.cols + gj)];
            }
        }
      }
      for (int h : hits) ASSERT_EQ(h, 1) << m.name << " t=" << t;
    }
  }
}

// initialise() hashes each row once; every element must still be initial_value() of its
// global coordinates, bit for bit, on every tensor-parallel rank (and the equivalence of
// plans rests on that).
TEST(ParamLayout, InitialiseGivesInitialValueOfTheGlobalCoordinates) {
  for (const ModelSpec& m : {spec_gpt(), spec_llama(), spec_mixed()}) {
    for (int64_t t : {1, 2}) {
      if (m.G % t) continue;
      for (int64_t r = 0; r < t; ++r) {
        std::vector<int64_t> layers;
        for (int64_t l = 0; l < m.L; ++l) layers.push_back(l);
        const ParamLayout lay = make_param_layout(m, t, r, true, layers, true);
        std::vector<float> got(static_cast<size_t>(lay.size), -7.0f);
        initialise(m, lay, 1234, got.data());
        int64_t nonzero = 0;
        for (const TensorSlot& s : lay.tensors)
          for (int64_t i = 0; i < s.rows; ++i)
            for (int64_t j = 0; j < s.cols; ++j) {
              int64_t gi = 0, gj = 0;
              global_coords(m, s, t, r, i, j, &gi, &gj);
              const float want = initial_value(m, 1234, s.kind, s.layer, gi, gj);
              const float v = got[static_cast<size_t>(s.offset + i * s.cols + j)];
              ASSERT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(want))
                  << m.name << " t=" << t << " r=" << r << " kind " << static_cast<int>(s.kind) << " (" << i << ", "
                  << j << ")";
              nonzero += v != 0.0f && v != 1.0f;
            }
        EXPECT_GT(nonzero, lay.size / 2) << m.name;  // the random weights are most of the model
      }
    }
  }
}

TEST(ParamLayout, TiedCopyOnTheLastStage) {
  const ModelSpec m = spec_gpt();
  const ParamLayout last = make_param_layout(m, 1, 0, false, {1}, true);
  EXPECT_TRUE(last.has(TensorKind::wte));
  EXPECT_EQ(last.units.back().layer, -1);  // the copy is a unit of its own
  EXPECT_EQ(last.units.back().size(), executor_vocab(m) * m.H);
}

TEST(Data, MarkovChainIsStationaryAndItsEntropyRateIsExact) {
  const MarkovChain c = make_markov_chain(16, 3, 9);
  double sum = 0;
  for (double p : c.stationary) sum += p;
  EXPECT_NEAR(sum, 1.0, 1e-12);
  std::vector<double> next(16, 0.0);
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t k = 0; k < 3; ++k)
      next[static_cast<size_t>(c.next[static_cast<size_t>(i * 3 + k)])] += c.stationary[static_cast<size_t>(i)] * c.prob[static_cast<size_t>(i * 3 + k)];
  for (int64_t i = 0; i < 16; ++i) EXPECT_NEAR(next[static_cast<size_t>(i)], c.stationary[static_cast<size_t>(i)], 1e-12);
  EXPECT_GT(c.entropy_rate_nats, 0.0);
  EXPECT_LT(c.entropy_rate_nats, std::log(3.0));
  // The empirical conditional entropy of a long sample approaches the entropy rate.
  TokenSource src("synthetic:16", 128, 256, 5);
  std::map<std::pair<int, int>, double> pair_count;
  std::map<int, double> from_count;
  std::vector<int32_t> seq(257);
  for (int64_t g = 0; g < 400; ++g) {
    src.sample(g, seq.data());
    for (size_t i = 0; i + 1 < seq.size(); ++i) {
      pair_count[{seq[i], seq[i + 1]}] += 1;
      from_count[seq[i]] += 1;
    }
  }
  double total = 0, h = 0;
  for (auto& [k, n] : pair_count) total += n;
  for (auto& [k, n] : pair_count) h -= n / total * std::log(n / from_count[k.first]);
  std::printf("  synthetic:16: entropy rate %.4f nats, empirical %.4f over %.0f transitions\n",
              src.chain().entropy_rate_nats, h, total);
  EXPECT_NEAR(h, src.chain().entropy_rate_nats, 0.02);
}

TEST(Data, DataParallelShardsPartitionTheGlobalBatch) {
  TokenSource a("synthetic", 512, 32, 1), b("synthetic", 512, 32, 1);
  const int64_t gbs = 8, d = 2, B = 2;
  std::vector<int32_t> in, tg, all;
  for (int64_t dp = 0; dp < d; ++dp)
    for (int64_t j = 0; j < gbs / (B * d); ++j) {
      a.micro_batch(3, gbs, d, dp, j, B, &in, &tg);
      all.insert(all.end(), in.begin(), in.end());
    }
  std::vector<int32_t> single;
  for (int64_t j = 0; j < gbs / B; ++j) {
    b.micro_batch(3, gbs, 1, 0, j, B, &in, &tg);
    single.insert(single.end(), in.begin(), in.end());
  }
  EXPECT_EQ(all, single);  // the same global batch in the same order
  a.micro_batch(0, gbs, 1, 0, 0, 1, &in, &tg);
  for (size_t i = 0; i + 1 < in.size(); ++i) EXPECT_EQ(in[i + 1], tg[i]);  // targets are the next tokens
}

TEST(Data, TokenFilesAndTheirErrors) {
  const std::string dir = ::testing::TempDir();
  auto write = [&](const std::string& name, const std::vector<uint16_t>& toks, bool odd) {
    std::ofstream f(dir + name, std::ios::binary);
    f.write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * 2));
    if (odd) f.put('x');
    return dir + name;
  };
  std::vector<uint16_t> toks(1000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint16_t>(i % 97);
  TokenSource ok(write("ok.bin", toks, false), 128, 10, 1);
  EXPECT_EQ(ok.samples(), 99);
  std::vector<int32_t> s(11);
  std::set<int64_t> firsts;
  for (int64_t g = 0; g < 99; ++g) {  // one epoch visits every sample once
    ok.sample(g, s.data());
    for (int i = 0; i < 10; ++i) EXPECT_EQ((s[static_cast<size_t>(i)] + 1) % 97, s[static_cast<size_t>(i) + 1]);
    firsts.insert(s[0]);
  }
  EXPECT_GE(firsts.size(), 97u);  // sample k starts at token 10k mod 97: 97 distinct starts
  // The file is mapped, not read: a copy shares the mapping and outlives the original.
  {
    auto first = std::make_unique<TokenSource>(dir + "ok.bin", 128, 10, 1);
    std::vector<int32_t> want(11), got(11);
    first->sample(5, want.data());
    TokenSource copy = *first;
    first.reset();
    copy.sample(5, got.data());
    EXPECT_EQ(got, want);
  }
  EXPECT_THROW(TokenSource(dir + "missing.bin", 128, 10, 1), InputError);
  EXPECT_THROW(TokenSource(dir, 128, 10, 1), InputError);  // a folder
  EXPECT_THROW(TokenSource(write("odd.bin", toks, true), 128, 10, 1), InputError);
  EXPECT_THROW(TokenSource(write("short.bin", {1, 2, 3}, false), 128, 10, 1), InputError);
  EXPECT_THROW(TokenSource(write("big.bin", toks, false), 64, 10, 1), InputError);  // token 96 >= V 64
  EXPECT_THROW(TokenSource("synthetic:1", 128, 10, 1), InputError);
}

TEST(Zero, ShardsPadEveryUnit) {
  const ModelSpec m = spec_gpt();
  const ParamLayout lay = global_param_layout(m);
  const Sharding s = make_sharding(lay, 3, 2);
  int64_t covered = 0;
  for (size_t u = 0; u < lay.units.size(); ++u) {
    EXPECT_GE(s.shard[u] * 3, lay.units[u].size());
    EXPECT_LT(s.shard[u] * 3 - lay.units[u].size(), 3);
    covered += s.shard[u];
  }
  EXPECT_EQ(covered, s.shard_size);
  EXPECT_EQ(s.full_size, 3 * s.shard_size);
}

TEST(Zero, AdamWStepByHand) {
  // Step 1 with g = 2: m = 0.1*2 = 0.2, v = 0.05*4 = 0.2; bias-corrected m/(1-0.9) = 2,
  // v/(1-0.95) = 4, update = lr * 2 / (2 + eps) = lr. Decay first: p -= lr*wd*p.
  float p[2] = {1.0f, 1.0f}, g[2] = {2.0f, 2.0f}, mo[2] = {0, 0}, v[2] = {0, 0};
  const uint8_t decay = 0x40;  // bit 6: element 0 from bit 6 on decays, element 1 does not
  AdamW opt;
  opt.beta2 = 0.95;
  opt.weight_decay = 0.1;
  adamw_update(p, g, mo, v, FlagBits{&decay, 6}, 2, opt, 0.01, 1, 1.0f);
  EXPECT_NEAR(p[0], 1.0 - 0.01 * 0.1 - 0.01, 1e-6);
  EXPECT_NEAR(p[1], 1.0 - 0.01, 1e-6);
  EXPECT_NEAR(learning_rate(0, 10, 100, 1.0, 0.1), 0.1, 1e-12);   // warm-up 1/10
  EXPECT_NEAR(learning_rate(9, 10, 100, 1.0, 0.1), 1.0, 1e-12);
  EXPECT_NEAR(learning_rate(55, 10, 100, 1.0, 0.1), 0.55, 1e-12);  // half way down the cosine
  EXPECT_NEAR(learning_rate(100, 10, 100, 1.0, 0.1), 0.1, 1e-12);
}

// The per-op table's predictions, by hand. Rank 0's rows: a layer's qkv and its own time,
// the embedding and a tensor-parallel collective outside the layers (no output layer: a
// first pipeline stage). Two micro-batches per counted step, two layer runs per phase.
TEST(OpTable, PredictionsInsideAndOutsideTheLayers) {
  using R = OpLog::Row;
  const std::vector<R> rows = {{"forward", "other", true, 2, 0.002},  {"forward", "qkv", true, 2, 0.010},
                               {"forward", "embedding", false, 2, 0.004}, {"forward", "tp_comm", false, 2, 0.001},
                               {"backward", "other", true, 2, 0.004}, {"backward", "embedding", false, 2, 0.006}};
  auto op = [](const char* name, Phase ph, OpKind k, double t) { return OpCost{name, ph, k, 0, 0, t, t}; };
  const std::vector<OpCost> layer = {op("qkv", Phase::forward, OpKind::gemm, 0.004),
                                     op("tp_all_reduce", Phase::forward, OpKind::tp_comm, 1.0)};
  const std::vector<OpCost> embedding = {op("embedding", Phase::forward, OpKind::memory, 0.0015),
                                         op("embedding_dropout", Phase::forward, OpKind::memory, 0.0005),
                                         op("tp_all_reduce", Phase::forward, OpKind::tp_comm, 0.0003),
                                         op("embedding", Phase::backward, OpKind::memory, 0.002),
                                         op("dp_thing", Phase::backward, OpKind::dp_comm, 9.0)};
  // The output layer's ops count only where rank 0 ran it: not here.
  const std::vector<OpCost> head = {op("lm_head", Phase::forward, OpKind::gemm, 7.0),
                                    op("ce_all_reduce", Phase::forward, OpKind::tp_comm, 7.0)};
  const OpPredictions pred{&layer, &embedding, &head};
  const std::vector<OpRow> t = op_table(rows, 2, &pred);
  ASSERT_EQ(t.size(), rows.size());
  auto at = [&](const char* phase, const char* name, bool in_layer) {
    for (const OpRow& r : t)
      if (r.phase == phase && r.op == name && r.in_layer == in_layer) return r;
    ADD_FAILURE() << phase << " " << name;
    return OpRow{};
  };
  EXPECT_DOUBLE_EQ(at("forward", "qkv", true).measured_s, 0.005);  // 10 ms over 2 layer runs
  EXPECT_DOUBLE_EQ(at("forward", "qkv", true).predicted_s, 0.004);
  EXPECT_TRUE(std::isnan(at("forward", "other", true).predicted_s));
  EXPECT_DOUBLE_EQ(at("forward", "embedding", false).measured_s, 0.002);  // 4 ms over 2 micro-batches
  EXPECT_DOUBLE_EQ(at("forward", "embedding", false).predicted_s, 0.002);   // 1.5 + 0.5 ms
  EXPECT_DOUBLE_EQ(at("forward", "tp_comm", false).predicted_s, 0.0003);    // the embedding's only
  EXPECT_DOUBLE_EQ(at("backward", "embedding", false).predicted_s, 0.002);  // no data-parallel term
  // With the output layer on rank 0 its ops join the rows outside.
  std::vector<R> last = rows;
  last.push_back({"forward", "output_layer", false, 2, 0.02});
  const std::vector<OpRow> t2 = op_table(last, 2, &pred);
  for (const OpRow& r : t2) {
    if (r.op == "output_layer") {
      EXPECT_DOUBLE_EQ(r.predicted_s, 7.0);
    } else if (r.op == "tp_comm" && !r.in_layer) {
      EXPECT_DOUBLE_EQ(r.predicted_s, 7.0003);
    }
  }
  // Without predictions, none.
  for (const OpRow& r : op_table(rows, 2, nullptr)) EXPECT_TRUE(std::isnan(r.predicted_s)) << r.op;
}

TEST(Zero, FlagsPackedAsBits) {
  // 11 flags: bytes 0b10100101 (flags 0, 2, 5, 7) and 0b00000110 (flags 9, 10).
  const std::vector<uint8_t> flags = {1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1};
  const std::vector<uint8_t> bits = pack_flags(flags);
  ASSERT_EQ(bits.size(), 2u);
  EXPECT_EQ(bits[0], 0xA5);
  EXPECT_EQ(bits[1], 0x06);
  const FlagBits f{bits.data(), 0};
  for (size_t i = 0; i < flags.size(); ++i) EXPECT_EQ(f[static_cast<int64_t>(i)], flags[i] != 0) << i;
  const FlagBits from3 = f + 3;  // a block starting at element 3, across the byte boundary
  for (int64_t i = 0; i + 3 < static_cast<int64_t>(flags.size()); ++i) EXPECT_EQ(from3[i], flags[i + 3] != 0) << i;
  // The clipping norm counts the flagged ones only: 1 + 9 + 36 (elements 0, 2, 5 of 1, 2, ... 6).
  const float g[6] = {1, 2, 3, 4, 5, 6};
  double acc[2] = {0, 0};
  grad_norm_terms(g, f, 6, acc);
  EXPECT_EQ(acc[0], 1.0 + 9.0 + 36.0);
  EXPECT_EQ(acc[1], 0.0);
}

TEST(MemoryTracker, LiveAndPeakPerCategory) {
  MemoryTracker t;
  {
    Buf a(&t, MemCategory::weights, 100, 2);
    Buf b(&t, MemCategory::activations, 10);
    EXPECT_EQ(t.live(MemCategory::weights), 200);
    EXPECT_EQ(t.live_total(), 240);
    Buf c = std::move(b);
    EXPECT_EQ(t.live(MemCategory::activations), 40);
  }
  EXPECT_EQ(t.live_total(), 0);
  EXPECT_EQ(t.peak_total(), 240);
  EXPECT_EQ(t.peak(MemCategory::weights), 200);
}

}  // namespace
}  // namespace strata

