// The CUDA backend's kernels (every .cu file of executor/cuda/), with their launchers, run on
// the CPU under tests/cuda_emulation.h (CMakeLists.txt's strata_cuda_emulated: each .cu file
// built by the host compiler in namespace strata::cuda_emulated) against the CPU backend, as cuda_ops_test
// runs them on a GPU: normalised error max|emulated - cpu| / max|cpu| within 1e-5 (fp32),
// the 16-bit roundings bit for bit. More below.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "executor/backend.h"
#include "executor/zero.h"
#include "qkv_parts.h"
// The emulation (its launch order, the runtime's names), then the emulated launchers'
// declarations (kernels.h) in their own namespace, as CMakeLists.txt compiles them.
#include "cuda_emulation.h"
#define STRATA_CUDA_EMULATION
#define cuda cuda_emulated
#include "executor/cuda/kernels.h"
#undef cuda

// What the emulation checks that compiling does not: the launchers' grids and blocks
// against the kernels' indexing (rows, column tiles of 8 x 128 threads with partial tiles
// and rows past 128 lanes, bit offsets of the optimizer's flags), the barriers and shared
// arrays of the block and column reductions (each launch runs with a block's threads in
// order, in reverse, and warp by warp with each warp running ahead of the others as far as
// its own barriers let it, from the first warp and from the last: a missing __syncthreads
// meets both the old and the new value), the accumulating outputs (+=), outputs left
// unwritten (they start as NaN). What it cannot: the GPU's last bits (its expf, rsqrtf,
// summation order), speed. cuda_ops_test on a GPU checks those; these run in every make test.
namespace strata {
namespace {

namespace emu = cuda_emulated;
using Vec = std::vector<float>;

// Each call its own stream of values (so no two inputs of a case are alike), the same on
// every run.
Vec random(int64_t n, float scale = 1.0f) {
  static unsigned calls = 0;
  std::mt19937 gen(7919u * ++calls);
  std::normal_distribution<float> nd(0.0f, scale);
  Vec v(static_cast<size_t>(n));
  for (float& x : v) x = nd(gen);
  return v;
}

double normalised_error(const Vec& got, const Vec& want) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  return scale > 0 ? worst / scale : worst;
}

// (Prints the error, once per check: in the first order a launch runs in.)
void expect_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double e = normalised_error(got, want);
  EXPECT_LE(e, tol) << what;
  if (cuda_emu::launch_order == cuda_emu::Order::forward)
    std::printf("    %-28s %.1e (tolerance %.0e)\n", what.c_str(), e, tol);
}

// Runs `run` with a block's threads in order, in reverse, and warp by warp each as far ahead
// as its own barriers let it, from the first warp and from the last (each on fresh outputs:
// run makes its own); the order back to in-order after, thrown or not.
void every_order(const std::function<void()>& run) {
  struct Reset {
    ~Reset() { cuda_emu::launch_order = cuda_emu::Order::forward; }
  } reset;
#ifdef STRATA_UNDER_SANITIZER
  // (Under the sanitizers, several times slower, two orders: the memory checks need one,
  // the barriers are the Release run's.)
  const cuda_emu::Order orders[] = {cuda_emu::Order::forward, cuda_emu::Order::warps_ahead};
#else
  const cuda_emu::Order orders[] = {cuda_emu::Order::forward, cuda_emu::Order::reverse, cuda_emu::Order::warps_ahead,
                                    cuda_emu::Order::warps_ahead_last_first};
#endif
  for (cuda_emu::Order o : orders) {
    SCOPED_TRACE(cuda_emu::to_string(o));
    cuda_emu::launch_order = o;
    run();
  }
}

class Emulated : public ::testing::Test {
 protected:
  // An op's output rounded as it is written (round kind k: 1 bf16, 2 fp16) is its unrounded
  // output rounded by the CPU backend's round_to, bit for bit.
  void expect_rounded(const Vec& rounded, Vec plain, int k, const char* what) {
    cpu_->round_to(plain.data(), static_cast<int64_t>(plain.size()), k == 1 ? Precision::bf16 : Precision::fp16);
    ASSERT_EQ(rounded.size(), plain.size()) << what;
    EXPECT_EQ(std::memcmp(rounded.data(), plain.data(), plain.size() * sizeof(float)), 0)
        << what << " rounded to " << (k == 1 ? "bf16" : "fp16") << " as it is written: not the output rounded";
  }
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
};

TEST_F(Emulated, LayerNormForwardAndBackward) {
  for (auto [N, H] : {std::pair<int64_t, int64_t>{37, 100}, {5, 300}, {40, 13}}) {
    SCOPED_TRACE(::testing::Message() << "N = " << N << ", H = " << H);
    const Vec x = random(N * H, 2.0f), w = random(H), b = random(H), dout = random(N * H);
    const Vec dx0 = random(N * H), dw0 = random(H), db0 = random(H);
    Vec out(N * H), mean(N), rstd(N), dx = dx0, dw = dw0, db = db0;
    cpu_->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, H);
    cpu_->layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), mean.data(), rstd.data(),
                             w.data(), N, H);
    every_order([&] {
      Vec eo(N * H, NAN), em(N, NAN), er(N, NAN), edx = dx0, edw = dw0, edb = db0;
      emu::layernorm_forward(eo.data(), em.data(), er.data(), x.data(), w.data(), b.data(), N, H, 0, nullptr);
      expect_close(eo, out, 1e-5, "out");
      for (int k : {1, 2}) {  // rounded as it is written: the output rounded, bit for bit
        Vec r(N * H, NAN);
        emu::layernorm_forward(r.data(), em.data(), er.data(), x.data(), w.data(), b.data(), N, H, k, nullptr);
        expect_rounded(r, eo, k, "out");
      }
      expect_close(em, mean, 1e-5, "mean");
      expect_close(er, rstd, 1e-5, "rstd");
      emu::layernorm_backward(edx.data(), edw.data(), edb.data(), dout.data(), x.data(), mean.data(), rstd.data(),
                              w.data(), N, H, nullptr);
      expect_close(edx, dx, 1e-5, "dx");
      expect_close(edw, dw, 1e-5, "dw");
      expect_close(edb, db, 1e-5, "db");
    });
  }
}

TEST_F(Emulated, RmsNormForwardAndBackward) {
  // (130 rows: the weight gradient's first row lanes sum two.)
  for (auto [N, H] : {std::pair<int64_t, int64_t>{37, 100}, {5, 300}, {130, 9}}) {
    SCOPED_TRACE(::testing::Message() << "N = " << N << ", H = " << H);
    const Vec x = random(N * H, 2.0f), w = random(H), dout = random(N * H);
    const Vec dx0 = random(N * H), dw0 = random(H);
    Vec out(N * H), rstd(N), dx = dx0, dw = dw0;
    cpu_->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, H);
    cpu_->rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), rstd.data(), w.data(), N, H);
    every_order([&] {
      Vec eo(N * H, NAN), er(N, NAN), edx = dx0, edw = dw0;
      emu::rmsnorm_forward(eo.data(), er.data(), x.data(), w.data(), N, H, 0, nullptr);
      expect_close(eo, out, 1e-5, "out");
      for (int k : {1, 2}) {
        Vec r(N * H, NAN);
        emu::rmsnorm_forward(r.data(), er.data(), x.data(), w.data(), N, H, k, nullptr);
        expect_rounded(r, eo, k, "out");
      }
      expect_close(er, rstd, 1e-5, "rstd");
      emu::rmsnorm_backward(edx.data(), edw.data(), dout.data(), x.data(), rstd.data(), w.data(), N, H, nullptr);
      expect_close(edx, dx, 1e-5, "dx");
      expect_close(edw, dw, 1e-5, "dw");
    });
  }
}

// The bias gradient's column tiles (8 columns x 128 row lanes; the norms' weight gradients
// take the same column_sum, at fewer rows): F not a multiple of 8, N past 128 rows (each
// lane sums several) and under it (lanes with nothing).
TEST_F(Emulated, BiasGradientInColumnTiles) {
  for (auto [N, F] : {std::pair<int64_t, int64_t>{300, 100}, {7, 9}, {129, 8}}) {
    SCOPED_TRACE(::testing::Message() << "N = " << N << ", F = " << F);
    const Vec dy = random(N * F), db0 = random(F);
    Vec db = db0;
    cpu_->bias_grad(db.data(), dy.data(), N, F);
    every_order([&] {
      Vec edb = db0;
      emu::bias_grad(edb.data(), dy.data(), N, F, nullptr);
      expect_close(edb, db, 1e-5, "db");
    });
  }
}

// The loss in its phases (backend.h): row maxima, then the sums of exponentials and the
// target logits (targets inside and outside this rank's slice [lo, lo + Vt)), then the
// gradient in place, rounded to the precision (kind 1 bf16, 2 fp16: compared after the same
// inputs, so a rounding flip shows as one 16-bit step).
TEST_F(Emulated, CrossEntropyPhases) {
  const int64_t N = 23, Vt = 300, lo = 100;
  const Vec z = random(N * Vt, 3.0f);
  // Targets at the slice's edges (lo - 1, lo, lo + Vt - 1, lo + Vt), repeated, and spread.
  std::vector<int32_t> targets = {99, 100, 399, 400, 100, 399};
  for (int64_t i = 6; i < N; ++i) targets.push_back(static_cast<int32_t>((i * 37) % 500));
  Vec mx(N), st(2 * N);
  cpu_->cross_entropy_max(mx.data(), z.data(), N, Vt);
  cpu_->cross_entropy_exp_sum(st.data(), z.data(), mx.data(), targets.data(), N, Vt, lo);
  every_order([&] {
    Vec emx(N, NAN), est(2 * N, NAN);  // (NaN: a value not written shows)
    emu::cross_entropy_max(emx.data(), z.data(), N, Vt, nullptr);
    EXPECT_EQ(emx, mx) << "row maxima";
    emu::cross_entropy_exp_sum(est.data(), z.data(), mx.data(), targets.data(), N, Vt, lo, nullptr);
    expect_close(est, st, 1e-5, "sums and target logits");
  });
  // The gradient: fp32 within 1e-5; in 16 bits every value a bf16 or fp16 value (rounded,
  // not left in fp32) and each within one 16-bit step of its own size of the CPU's.
  for (auto [p, kind, step] :
       {std::tuple{Precision::fp32, 0, 0.0}, {Precision::bf16, 1, 0x1p-8}, {Precision::fp16, 2, 0x1p-11}}) {
    SCOPED_TRACE(to_string(p));
    Vec g = z;
    cpu_->cross_entropy_backward(g.data(), mx.data(), st.data(), targets.data(), N, Vt, lo, 0.25f, p);
    every_order([&] {
      Vec eg = z;
      emu::cross_entropy_backward(eg.data(), mx.data(), st.data(), targets.data(), N, Vt, lo, 0.25f, kind, nullptr);
      if (p == Precision::fp32) {
        expect_close(eg, g, 1e-5, "dlogits");
        return;
      }
      Vec rounded = eg;
      cpu_->round_to(rounded.data(), static_cast<int64_t>(rounded.size()), p);
      EXPECT_EQ(std::memcmp(rounded.data(), eg.data(), 4 * eg.size()), 0) << "dlogits not rounded to 16 bits";
      int64_t off = 0, steps_off = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        const double d = std::fabs(static_cast<double>(eg[i]) - g[i]);
        off += d > step * std::fabs(g[i]) + 1e-30 ? 1 : 0;
        steps_off += d > 0 ? 1 : 0;
      }
      EXPECT_EQ(off, 0) << "dlogits more than one 16-bit step from the CPU's";
      if (cuda_emu::launch_order == cuda_emu::Order::forward)
        std::printf("    dlogits (%s): %lld of %zu values differ, each by one step at most\n", to_string(p),
                    static_cast<long long>(steps_off), g.size());
    });
  }
}

// The clipping norm's terms: random flags from an odd bit offset, non-finite values counted
// whether flagged or not; sums in double (another order than the CPU's lanes). (Its
// grid-stride loop's second pass needs n past 1024 blocks x 256 threads: cuda_ops_test's
// 100,003 on a GPU does not reach it either.)
TEST_F(Emulated, GradNormTermsFromOddBitOffsets) {
  const int64_t n = 5000, first = 5;
  Vec g = random(n);
  std::vector<uint8_t> flags(static_cast<size_t>(n + first));
  std::mt19937 gen(3);
  for (uint8_t& f : flags) f = gen() % 2;
  flags[first + 10] = 0;  // a NaN not counted in the norm, counted as non-finite
  flags[first + 4000] = 1;
  g[10] = std::numeric_limits<float>::quiet_NaN();
  g[4000] = std::numeric_limits<float>::infinity();
  const std::vector<uint8_t> bits = pack_flags(flags);
  double want[2] = {0, 0};
  cpu_->grad_norm_terms(g.data(), FlagBits{bits.data(), first}, n, want);
  every_order([&] {
    double got[2] = {0.5, 1.0};  // the kernel adds to them
    emu::grad_norm_terms(g.data(), bits.data(), first, n, got, nullptr);
    EXPECT_NEAR(got[0] - 0.5, want[0], 1e-12 * want[0]);
    EXPECT_EQ(got[1] - 1.0, want[1]);
    EXPECT_EQ(want[1], 2.0);
  });
}

// AdamW with the decay flags from an odd bit offset and the step's scalars as the CUDA
// backend computes them (kernels.h adamw_scalars); elementwise, the same float operations
// as the CPU's: within 1e-6.
TEST_F(Emulated, AdamWStep) {
  const int64_t n = 1000, first = 5;
  const Vec p0 = random(n), g = random(n), m0 = random(n, 0.1f);
  Vec v0 = random(n, 0.1f);
  for (float& x : v0) x = x * x;
  std::vector<uint8_t> flags(static_cast<size_t>(n + first));
  std::mt19937 gen(4);
  for (uint8_t& f : flags) f = gen() % 2;
  const std::vector<uint8_t> bits = pack_flags(flags);
  AdamW opt;
  Vec p = p0, m = m0, v = v0;
  cpu_->adamw(p.data(), g.data(), m.data(), v.data(), FlagBits{bits.data(), first}, n, opt, 3e-4, 3, 0.5f);
  const emu::AdamWScalars k = emu::adamw_scalars(opt.beta1, opt.beta2, opt.eps, opt.weight_decay, 3e-4, 3, 0.5f);
  every_order([&] {
    Vec ep = p0, em = m0, ev = v0;
    emu::adamw(ep.data(), g.data(), em.data(), ev.data(), bits.data(), first, n, k, nullptr);
    expect_close(ep, p, 1e-6, "parameters");
    expect_close(em, m, 1e-6, "first moments");
    expect_close(ev, v, 1e-6, "second moments");
  });
}

// round_to, round_copy, pack16 and unpack16 bit for bit, ties, overflow, NaN and infinities
// included.
TEST_F(Emulated, SixteenBitRoundingBitForBit) {
  Vec x = random(1000, 3.0f);
  const float specials[] = {0.0f, -0.0f, 1.0f + 1.0f / 256.0f, 1.0f + 3.0f / 256.0f, 70000.0f, -1e-30f, 1e-40f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), 3.0e38f, 65520.0f, 6.1e-5f};
  std::copy(std::begin(specials), std::end(specials), x.begin());
  const int64_t n = static_cast<int64_t>(x.size());
  auto same_bits = [](const Vec& a, const Vec& b) { return std::memcmp(a.data(), b.data(), 4 * a.size()) == 0; };
  for (auto [p, kind] : {std::pair{Precision::bf16, 1}, {Precision::fp16, 2}}) {
    SCOPED_TRACE(to_string(p));
    Vec r = x, c(x.size()), back(x.size());
    std::vector<uint16_t> h(x.size());
    cpu_->round_to(r.data(), n, p);
    cpu_->round_copy(c.data(), x.data(), n, p);
    cpu_->pack16(h.data(), x.data(), n, p);
    cpu_->unpack16(back.data(), h.data(), n, p);
    every_order([&] {
      Vec er = x, ec(x.size(), NAN), eback(x.size(), NAN);
      std::vector<uint16_t> eh(x.size(), 0xFFFF);
      emu::round_to(er.data(), n, kind, nullptr);
      emu::round_copy(ec.data(), x.data(), n, kind, nullptr);
      emu::pack16(eh.data(), x.data(), n, kind, nullptr);
      emu::unpack16(eback.data(), h.data(), n, kind, nullptr);
      EXPECT_TRUE(same_bits(er, r)) << "round_to";
      EXPECT_TRUE(same_bits(ec, c)) << "round_copy";
      EXPECT_EQ(eh, h) << "pack16";
      EXPECT_TRUE(same_bits(eback, back)) << "unpack16";
    });
  }
}

TEST_F(Emulated, ActivationsForwardAndBackward) {
  const int64_t N = 33, F = 70;
  for (auto [a, kind] : {std::pair{Activation::gelu, 0}, {Activation::swiglu, 1}, {Activation::geglu, 2},
                         {Activation::squared_relu, 3}}) {
    SCOPED_TRACE(to_string(a));
    const int64_t width = gated(a) ? 2 * F : F;
    const Vec u = random(N * width, 2.0f), dout = random(N * F);
    Vec out(N * F), du(N * width);
    cpu_->activation_forward(a, out.data(), u.data(), N, F);
    cpu_->activation_backward(a, du.data(), dout.data(), u.data(), N, F);
    every_order([&] {
      Vec eout(N * F, NAN), edu(N * width, NAN);
      emu::activation_forward(kind, eout.data(), u.data(), N, F, 0, nullptr);
      emu::activation_backward(kind, edu.data(), dout.data(), u.data(), N, F, 0, nullptr);
      expect_close(eout, out, 1e-5, "out");
      expect_close(edu, du, 1e-5, "du");
      for (int k : {1, 2}) {
        Vec rout(N * F, NAN), rdu(N * width, NAN);
        emu::activation_forward(kind, rout.data(), u.data(), N, F, k, nullptr);
        emu::activation_backward(kind, rdu.data(), dout.data(), u.data(), N, F, k, nullptr);
        expect_rounded(rout, eout, k, "out");
        expect_rounded(rdu, edu, k, "du");
      }
    });
  }
}

TEST_F(Emulated, RopeForwardAndInverse) {
  const int64_t S = 9, B = 2, heads = 3, D = 16, ld = 4 * D + 5;  // rows wider than the rotated heads
  const Vec x0 = random(S * B * ld);
  for (bool inverse : {false, true}) {
    Vec x = x0;
    cpu_->rope(x.data(), S, B, heads, D, ld, inverse);
    every_order([&] {
      Vec ex = x0;
      emu::rope(ex.data(), S, B, heads, D, ld, inverse, nullptr);
      expect_close(ex, x, 1e-5, inverse ? "inverse" : "forward");
    });
  }
}

// The embedding of a vocabulary slice (tokens in and out of it), its scatter-add backward,
// learned positions and their gradient from a rank's first row, the residual add and the
// bias add.
TEST_F(Emulated, EmbeddingPositionsAndAdds) {
  const int64_t S = 6, B = 3, H = 20, Vt = 40, lo = 30, n = S * B;
  // Tokens at the slice's edges (lo - 1, lo, lo + Vt - 1, lo + Vt), repeated (the scatter
  // adds them up), and spread.
  std::vector<int32_t> tokens = {29, 30, 69, 70, 30, 69, 30};
  for (size_t i = tokens.size(); i < static_cast<size_t>(B * S); ++i)
    tokens.push_back(static_cast<int32_t>((i * 13) % 90));
  const Vec wte = random(Vt * H), dx = random(n * H), P = random(S * H);
  const Vec dwte0 = random(Vt * H), dP0 = random(S * H);
  Vec x(n * H), dwte = dwte0;
  cpu_->embedding_forward(x.data(), wte.data(), tokens.data(), S, B, H, lo, Vt);
  cpu_->embedding_backward(dwte.data(), dx.data(), tokens.data(), S, B, H, lo, Vt);
  const int64_t rows = 10, row0 = 4;  // a rank's rows 4..13 of the (S, B) rows
  Vec out(rows * H), dP = dP0, sum(n * H), y = x;
  cpu_->add_positions(out.data(), x.data(), P.data(), rows, H, B, row0);
  cpu_->position_grad(dP.data(), dx.data(), rows, H, B, row0);
  cpu_->add(sum.data(), x.data(), dx.data(), n * H);
  cpu_->add_bias(y.data(), P.data(), n, H);
  every_order([&] {
    Vec ex(n * H, NAN), edwte = dwte0;  // (NaN: a row not written, outside the slice, shows)
    emu::embedding_forward(ex.data(), wte.data(), tokens.data(), S, B, H, lo, Vt, nullptr);
    expect_close(ex, x, 0, "embedding");
    emu::embedding_backward(edwte.data(), dx.data(), tokens.data(), S, B, H, lo, Vt, nullptr);
    expect_close(edwte, dwte, 1e-6, "embedding gradient");
    Vec eout(rows * H, NAN), edP = dP0, esum(n * H, NAN), ey = x;
    emu::add_positions(eout.data(), x.data(), P.data(), rows, H, B, row0, nullptr);
    expect_close(eout, out, 0, "positions");
    emu::position_grad(edP.data(), dx.data(), rows, H, B, row0, nullptr);
    expect_close(edP, dP, 1e-6, "position gradient");
    emu::add(esum.data(), x.data(), dx.data(), n * H, 0, nullptr);
    expect_close(esum, sum, 0, "add");
    emu::add_bias(ey.data(), P.data(), n, H, 0, nullptr);
    expect_close(ey, y, 0, "bias");
    for (int k : {1, 2}) {
      Vec rsum(n * H, NAN), ry = x;
      emu::add(rsum.data(), x.data(), dx.data(), n * H, k, nullptr);
      expect_rounded(rsum, esum, k, "add");
      emu::add_bias(ry.data(), P.data(), n, H, k, nullptr);
      expect_rounded(ry, ey, k, "bias");
    }
  });
}

// The unfused attention's row kernels (between its batched GEMMs) against the softmax in
// double: each causal row's probabilities and zeros past the diagonal; the backward's
// dS = scale P (dP - sum_j P_j dP_j) on the causal columns, zeros past them. Rows longer
// than the 256 threads of a block (S = 257: the last row's last key is thread 0's second)
// and a batch of matrices `stride` apart.
TEST_F(Emulated, CausalSoftmaxRowsForwardAndBackward) {
  const int64_t S = 257, count = 2, stride = S * S + 7;
  const Vec x = random(count * stride, 2.0f), dp = random(count * stride);
  Vec want(x.size(), 0.0f), dwant(x.size(), 0.0f);
  const float scale = 0.125f;
  for (int64_t g = 0; g < count; ++g)
    for (int64_t i = 0; i < S; ++i) {
      const float* r = x.data() + g * stride + i * S;
      double mx = -INFINITY, sum = 0, dot = 0;
      for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, static_cast<double>(r[j]));
      for (int64_t j = 0; j <= i; ++j) sum += std::exp(r[j] - mx);
      for (int64_t j = 0; j <= i; ++j) want[g * stride + i * S + j] = static_cast<float>(std::exp(r[j] - mx) / sum);
      for (int64_t j = 0; j <= i; ++j) {
        const size_t k = static_cast<size_t>(g * stride + i * S + j);
        dot += static_cast<double>(want[k]) * dp[k];
      }
      for (int64_t j = 0; j <= i; ++j) {
        const size_t k = static_cast<size_t>(g * stride + i * S + j);
        dwant[k] = static_cast<float>(scale * want[k] * (dp[k] - dot));
      }
    }
  every_order([&] {
    Vec p = x, d = dp;
    emu::causal_softmax(p.data(), stride, count, S, nullptr);
    emu::causal_softmax_backward(d.data(), stride, want.data(), stride, count, S, scale, nullptr);
    for (int64_t g = 0; g < count; ++g) {  // (the 7 values between two matrices are not the kernels')
      for (int64_t k = S * S; k < stride; ++k) {
        p[static_cast<size_t>(g * stride + k)] = want[static_cast<size_t>(g * stride + k)];
        d[static_cast<size_t>(g * stride + k)] = dwant[static_cast<size_t>(g * stride + k)];
      }
    }
    expect_close(p, want, 1e-6, "probabilities");
    expect_close(d, dwant, 1e-5, "score gradients");
  });
}

// C = beta C on a view (the GEMM with K = 0), against the CPU backend's.
TEST_F(Emulated, ScaleMatrixAsAGemmWithoutK) {
  const int64_t M = 9, N = 70, ldc = 75;
  const Vec c0 = random(M * ldc);
  Vec c = c0, a(1), b(1);
  cpu_->gemm(false, false, M, N, 0, 1.0f, a.data(), 1, b.data(), N, 0.5f, c.data(), ldc);
  every_order([&] {
    Vec ec = c0;
    emu::scale_matrix(ec.data(), M, N, ldc, 0.5f, nullptr);
    expect_close(ec, c, 0, "C");
  });
}

// The GEMMs' operand casts (cast.cu): a view of rows x cols floats (row stride ld) into 16
// bits (row stride ld_dst), round to nearest even, bit for bit the CPU backend's rounding
// (ties to even, overflow to infinity, fp16 subnormals); the padding past each row left as
// it was.
TEST_F(Emulated, GemmOperandCastsBitForBit) {
  const int64_t rows = 37, cols = 45, ld = 50, ld_dst = 48;
  Vec x = random(rows * ld, 3.0f);
  const float specials[] = {0.0f, -0.0f, 1.0f + 1.0f / 256.0f, 1.0f + 3.0f / 256.0f, 70000.0f, -1e-30f, 1e-40f,
                            3.0e38f, 65520.0f, 6.1e-5f, -2.5e-6f};
  std::copy(std::begin(specials), std::end(specials), x.begin());
  for (auto [p, kind] : {std::pair{Precision::bf16, 1}, {Precision::fp16, 2}}) {
    SCOPED_TRACE(to_string(p));
    std::vector<uint16_t> want(static_cast<size_t>(rows * ld_dst), 0xABCD);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        float v = x[static_cast<size_t>(r * ld + c)];
        uint16_t bits;
        if (kind == 1) {
          cpu_->round_to(&v, 1, p);
          uint32_t u;
          std::memcpy(&u, &v, 4);
          bits = static_cast<uint16_t>(u >> 16);
        } else {
          const _Float16 h = static_cast<_Float16>(v);
          std::memcpy(&bits, &h, 2);
        }
        want[static_cast<size_t>(r * ld_dst + c)] = bits;
      }
    every_order([&] {
      std::vector<uint16_t> got(want.size(), 0xABCD);
      emu::cast_matrix(got.data(), ld_dst, x.data(), rows, cols, ld, kind, nullptr);
      EXPECT_EQ(got, want);
    });
  }
}

// The fused attention's launchers (flash_attention.cu), as the CUDA backend calls them:
// delta, the zeroed dqkv (NaN before), the fp32 kernels' tiles of 32 (D <= 64) and 16 rows
// (D 80, 128: larger rows), their dynamic shared memory past 48 KiB opted in, against the
// CPU backend's fused attention within 1e-5 (fp32) in every order; and in 16-bit plans the
// hand-over to the tensor-core kernels (flash_attention_tc.cu: bf16 or fp16, the head dim's
// instantiation, its grid and shared memory), within 1e-2 (lse 1e-4) of the fp32 attention
// on inputs rounded to the precision, as cuda_ops_test asks on a GPU. (The tensor-core
// kernels' barriers in every order: flash_tc_emulation_test; here one order.)
struct FlashCase {
  int64_t S, B, A, G, D;
  int kind;  // 0 fp32, 1 bf16, 2 fp16
};
void check_flash_launchers(Backend& cpu, const FlashCase& f) {
  const auto [S, B, A, G, D, kind] = f;
  SCOPED_TRACE(::testing::Message() << "S=" << S << " B=" << B << " A=" << A << " G=" << G << " D=" << D
                                    << " kind=" << kind);
  const int64_t nq = S * B * (A + 2 * G) * D, no = S * B * A * D, ns = B * A * S;
  Vec qkv = random(nq, 2.0f), dout = random(no);
  const Precision p = kind == 1 ? Precision::bf16 : kind == 2 ? Precision::fp16 : Precision::fp32;
  cpu.round_to(qkv.data(), nq, p);
  cpu.round_to(dout.data(), no, p);
  Vec out(no), lse(ns), dqkv(nq);
  cpu.flash_attention_forward(out.data(), lse.data(), qkv.data(), S, B, A, G, D);
  cpu.flash_attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), S, B, A, G, D);
  const double tol = kind == 0 ? 1e-5 : 1e-2, lse_tol = kind == 0 ? 1e-5 : 1e-4;
  auto run = [&] {
    Vec eo(no, NAN), el(ns, NAN), edqkv(nq, NAN), edelta(ns, NAN);
    emu::flash_attention_forward(eo.data(), el.data(), qkv.data(), S, B, A, G, D, kind, nullptr);
    emu::flash_attention_backward(edqkv.data(), edelta.data(), dout.data(), eo.data(), el.data(), qkv.data(), S, B,
                                  A, G, D, kind, nullptr);
    expect_close(eo, out, tol, "out");
    expect_close(el, lse, lse_tol, "lse");
    for (int part = 0; part < 3; ++part)
      expect_close(testing::qkv_part(edqkv, S * B, A, G, D, part), testing::qkv_part(dqkv, S * B, A, G, D, part), tol,
                   testing::qkv_part_name(part));
  };
  if (kind == 0) every_order(run);
  else run();
}

TEST_F(Emulated, FusedAttentionLaunchersFp32) {
  const FlashCase cases[] = {{70, 2, 4, 2, 64, 0}, {33, 1, 2, 1, 80, 0}, {17, 1, 2, 2, 128, 0}, {5, 2, 2, 1, 8, 0}};
  for (const FlashCase& f : cases)
    check_flash_launchers(*cpu_, f);
}

TEST_F(Emulated, FusedAttentionLaunchersHandSixteenBitPlansToTheTensorCores) {
  const FlashCase cases[] = {{70, 1, 2, 1, 64, 1}, {33, 2, 2, 2, 32, 2}, {20, 1, 2, 1, 128, 1}, {9, 1, 2, 2, 16, 2}};
  for (const FlashCase& f : cases)
    check_flash_launchers(*cpu_, f);
}

// A launch that asks more than 48 KiB of dynamic shared memory is refused (as a GPU refuses
// it) unless its kernel was opted in to as many bytes; more than the device's 227 KiB cannot
// be opted in to.
void big_shared_kernel(float* x) {
  if (threadIdx.x == 0) x[blockIdx.x] = 1.0f;
}
void other_big_shared_kernel(float* x) {
  if (threadIdx.x == 0) x[blockIdx.x] = 2.0f;
}
TEST(Emulation, SharedMemoryPast48KiBNeedsTheKernelOptedIn) {
  Vec x(2, 0.0f);
  const size_t bytes = 64 << 10;
  EXPECT_THROW(STRATA_LAUNCH(big_shared_kernel, 2, 32, bytes, nullptr)(x.data()), std::runtime_error);
  EXPECT_EQ(cudaFuncSetAttribute(big_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 << 10),
            cudaSuccess);
  EXPECT_THROW(STRATA_LAUNCH(big_shared_kernel, 2, 32, bytes, nullptr)(x.data()), std::runtime_error);
  EXPECT_EQ(cudaFuncSetAttribute(big_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10),
            cudaSuccess);
  EXPECT_NO_THROW(STRATA_LAUNCH(big_shared_kernel, 2, 32, bytes, nullptr)(x.data()));
  EXPECT_EQ(x, (Vec{1.0f, 1.0f}));
  // (another kernel is not opted in by the first's attribute)
  EXPECT_THROW(STRATA_LAUNCH(other_big_shared_kernel, 2, 32, bytes, nullptr)(x.data()), std::runtime_error);
  EXPECT_EQ(cudaFuncSetAttribute(other_big_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 << 10),
            cudaErrorInvalidValue);
  EXPECT_NO_THROW(STRATA_LAUNCH(other_big_shared_kernel, 2, 32, 48 << 10, nullptr)(x.data()));
}

// Static and dynamic shared memory count together, as on a GPU: 40 KiB of static arrays
// leave 8 KiB of dynamic without an opt-in; an opt-in sets the most a launch may ask for
// and, with the static arrays, stays within 227 KiB; static arrays alone within 48 KiB.
void static_shared_kernel(float* x) {
  STRATA_SHARED(float, big, [10 << 10]);  // 40 KiB
  if (threadIdx.x == 0) big[blockIdx.x] = 3.0f;
  __syncthreads();
  if (threadIdx.x == 0) x[blockIdx.x] = big[blockIdx.x];
}
void too_much_static_kernel(float* x) {
  STRATA_SHARED(float, a, [8 << 10]);  // 32 KiB
  STRATA_SHARED(float, b, [5 << 10]);  // 20 KiB more
  if (threadIdx.x == 0) x[blockIdx.x] = a[0] + b[0];
}
void no_dynamic_kernel(float* x) {
  if (threadIdx.x == 0) x[blockIdx.x] = 4.0f;
}
TEST(Emulation, StaticAndDynamicSharedMemoryCountTogether) {
  Vec x(2, 0.0f);
  EXPECT_NO_THROW(STRATA_LAUNCH(static_shared_kernel, 2, 32, 8 << 10, nullptr)(x.data()));
  EXPECT_EQ(x, (Vec{3.0f, 3.0f}));
  EXPECT_THROW(STRATA_LAUNCH(static_shared_kernel, 2, 32, (8 << 10) + 4, nullptr)(x.data()), std::runtime_error);
  EXPECT_EQ(cudaFuncSetAttribute(static_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 << 10),
            cudaSuccess);
  EXPECT_NO_THROW(STRATA_LAUNCH(static_shared_kernel, 2, 32, 16 << 10, nullptr)(x.data()));
  EXPECT_THROW(STRATA_LAUNCH(static_shared_kernel, 2, 32, 20 << 10, nullptr)(x.data()), std::runtime_error);
  // (With the static arrays' 40 KiB, 230 together, past 227: a GPU refuses this attribute
  // already; the emulation, which learns the static arrays only as the kernel runs, refuses
  // the launch.)
  (void)cudaFuncSetAttribute(static_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 190 << 10);
  EXPECT_THROW(STRATA_LAUNCH(static_shared_kernel, 2, 32, 64 << 10, nullptr)(x.data()), std::runtime_error);
  EXPECT_EQ(cudaFuncSetAttribute(static_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 187 << 10),
            cudaSuccess);
  EXPECT_NO_THROW(STRATA_LAUNCH(static_shared_kernel, 2, 32, 187 << 10, nullptr)(x.data()));
  EXPECT_THROW(STRATA_LAUNCH(too_much_static_kernel, 1, 32, 0, nullptr)(x.data()), std::runtime_error);
  // An opt-in of 0 bytes allows no dynamic shared memory at all.
  EXPECT_NO_THROW(STRATA_LAUNCH(no_dynamic_kernel, 1, 32, 16, nullptr)(x.data()));
  EXPECT_EQ(cudaFuncSetAttribute(no_dynamic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 0), cudaSuccess);
  EXPECT_THROW(STRATA_LAUNCH(no_dynamic_kernel, 1, 32, 16, nullptr)(x.data()), std::runtime_error);
  EXPECT_NO_THROW(STRATA_LAUNCH(no_dynamic_kernel, 1, 32, 0, nullptr)(x.data()));
}

// A broken barrier is caught, in every order: a __syncthreads half the block skips, a
// __syncwarp half a warp skips (each a deadlock on a GPU).
TEST(Emulation, ABarrierSomeThreadsSkipThrows) {
  auto block_barrier = [] {
    if (threadIdx.y < 2) __syncthreads();
  };
  auto warp_barrier = [] {
    if (threadIdx.x % 32 < 16) __syncwarp();
  };
  for (cuda_emu::Order o : {cuda_emu::Order::forward, cuda_emu::Order::reverse, cuda_emu::Order::warps_ahead,
                            cuda_emu::Order::warps_ahead_last_first}) {
    EXPECT_THROW(cuda_emu::launch(o, Dim3(2), Dim3(32, 4), 0, block_barrier), std::runtime_error);
    EXPECT_THROW(cuda_emu::launch(o, Dim3(1), Dim3(64), 0, warp_barrier), std::runtime_error);
  }
}

}  // namespace
}  // namespace strata
