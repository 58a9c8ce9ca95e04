// The tensor-core flash attention's kernels (executor/cuda/flash_attention_tc.cuh, the code
// the GPU runs in 16-bit plans) on the CPU, under the emulation of the CUDA names they use
// (tests/cuda_emulation.h), against the CPU backend's fused attention: the tiles' index
// arithmetic, the causal mask, the online softmax, the scales, every WMMA operand's layout,
// alignment and leading dimension, and the barriers (one some thread never reaches throws;
// a missing __syncwarp before reading what other lanes stored reads stale bytes). Each
// launch runs three times, its threads in order, in reverse, and warp by warp with each
// warp running ahead through its own barriers (a warp refilling a tile that another still
// reads shows only so), so a read that some barrier should hold back meets both the old
// and the new value. Inputs rounded to the precision
// as the executor passes them; out, and dQ, dK, dV each against its own largest value,
// within 1e-2 (P and dS rounded to 16 bits: at least 1e-5 off the fp32 attention, or P was
// not rounded), the lse within 1e-4, as cuda_ops_test asks of the GPU. Tiles of 64 crossed
// (130), exactly filled (128), not filled (5, 33, 70); head dims 16, 32, 64, 128 in bf16
// and in fp16; G = A, A/2, A/4, 1; aligned inputs (float4 loads) and views one float in.
// Here the launch is the test's own; the launchers (flash_attention_tc.cu's grid, shared
// bytes, opt-in and dispatch, flash_attention.cu's zeroing and delta) run in
// cuda_kernels_emulation_test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "executor/backend.h"
#include "qkv_parts.h"
// The emulation last: its macros (__device__, __global__) are for the kernels' headers only.
#include "cuda_emulation.h"
#include "executor/cuda/flash_dims.cuh"

namespace strata::flash_tc_emulated {

namespace wmma = strata::cuda_emu::wmma;
using Dims = strata::cuda::FlashDims;
using cuda_emu::Bf16;

template <class T>
T from_float(float v);
template <>
Bf16 from_float<Bf16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
_Float16 from_float<_Float16>(float v) {
  return static_cast<_Float16>(v);
}

#define STRATA_UNROLL
#include "executor/cuda/flash_attention_tc.cuh"
#undef STRATA_UNROLL

namespace {

using Vec = std::vector<float>;

double normalised_error(const Vec& got, const Vec& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    num = std::max(num, std::fabs(static_cast<double>(got[i]) - want[i]));
    den = std::max(den, std::fabs(static_cast<double>(want[i])));
  }
  return num / std::max(den, 1e-30);
}

template <class T, int D>
void check(int64_t S, int64_t B, int64_t A, int64_t G, Precision p, bool offset, unsigned seed) {
  const std::string what = std::string(to_string(p)) + " S=" + std::to_string(S) + " B=" + std::to_string(B) +
                           " A=" + std::to_string(A) + " G=" + std::to_string(G) + " D=" + std::to_string(D) +
                           (offset ? " (views one float in)" : "");
  SCOPED_TRACE(what);
  const auto cpu = make_cpu_backend();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t nq = static_cast<size_t>(S * B * (A + 2 * G) * D), no = static_cast<size_t>(S * B * A * D);
  // One float more than needed, so the views one float in fit.
  Vec qkv_mem(nq + 1), dout_mem(no + 1);
  for (float& x : qkv_mem) x = 2.0f * normal(rng);
  for (float& x : dout_mem) x = normal(rng);
  cpu->round_to(qkv_mem.data(), static_cast<int64_t>(qkv_mem.size()), p);
  cpu->round_to(dout_mem.data(), static_cast<int64_t>(dout_mem.size()), p);
  // std::vector's storage is 16-byte aligned at least: the views start there or one float in.
  const float* qkv = qkv_mem.data() + (offset ? 1 : 0);
  const float* dout = dout_mem.data() + (offset ? 1 : 0);
  if (!offset) {
    ASSERT_EQ(reinterpret_cast<uintptr_t>(qkv) % 16, 0u) << "the float4 path needs 16-byte aligned inputs";
  }
  const Dims d{S, B, A, G, D};
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const Dim3 grid{static_cast<unsigned>((S + kTile - 1) / kTile), static_cast<unsigned>(A), static_cast<unsigned>(B)};
  const Vec qkv_in(qkv, qkv + nq), dout_in(dout, dout + no);
  Vec cout(no), clse(static_cast<size_t>(B * A * S)), cdqkv(nq);
  cpu->flash_attention_forward(cout.data(), clse.data(), qkv_in.data(), S, B, A, G, D);
  cpu->flash_attention_backward(cdqkv.data(), dout_in.data(), cout.data(), clse.data(), qkv_in.data(), S, B, A, G, D);
  // (Not warps ahead from the last warp down: every warp loads its share of each tile and
  // reads all of it, so a refill's hazard shows from either end. Under the sanitizers,
  // several times slower, one order: the memory checks need one, the barriers are the
  // Release run's.)
#ifdef STRATA_UNDER_SANITIZER
  const cuda_emu::Order orders[] = {cuda_emu::Order::warps_ahead};
#else
  const cuda_emu::Order orders[] = {cuda_emu::Order::forward, cuda_emu::Order::reverse, cuda_emu::Order::warps_ahead};
#endif
  for (cuda_emu::Order order : orders) {
    SCOPED_TRACE(cuda_emu::to_string(order));
    Vec out(no, NAN), lse(clse.size(), NAN), dqkv(nq, 0.0f), delta(clse.size());
    cuda_emu::launch(order, grid, kThreads, ForwardLayout<D>::bytes, tc_forward<T, D>, out.data(), lse.data(), qkv, d,
                     scale);
    // delta = rowsum(dO * O), as flash_attention.cu's kernel computes it before the backward.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < A; ++h)
        for (int64_t i = 0; i < S; ++i) {
          float s = 0;
          for (int64_t e = 0; e < D; ++e)
            s += out[static_cast<size_t>((i * B + b) * A * D + h * D + e)] * dout[(i * B + b) * A * D + h * D + e];
          delta[static_cast<size_t>((b * A + h) * S + i)] = s;
        }
    cuda_emu::launch(order, grid, kThreads, BackwardLayout<D>::bytes, tc_backward<T, D>, dqkv.data(), dout,
                     static_cast<const float*>(lse.data()), static_cast<const float*>(delta.data()), qkv, d, scale);
    const double out_error = normalised_error(out, cout), lse_error = normalised_error(lse, clse);
    EXPECT_LE(out_error, 1e-2) << "out";
    EXPECT_GE(out_error, 1e-5) << "out as the fp32 attention's: P not rounded to 16 bits?";
    EXPECT_LE(lse_error, 1e-4) << "lse";
    double worst_d = 0;
    // dQ, dK and dV each against its own largest value.
    for (int part = 0; part < 3; ++part) {
      const double e = normalised_error(testing::qkv_part(dqkv, S * B, A, G, D, part),
                                        testing::qkv_part(cdqkv, S * B, A, G, D, part));
      EXPECT_LE(e, 1e-2) << testing::qkv_part_name(part);
      worst_d = std::max(worst_d, e);
    }
    if (order == cuda_emu::Order::forward)
      std::printf("  %-44s out %.1e  lse %.1e  dq/dk/dv (worst) %.1e\n", what.c_str(), out_error, lse_error, worst_d);
  }
}

TEST(FlashTensorCoreKernels, MatchTheCpuFusedAttentionUnderEmulation) {
  check<Bf16, 64>(130, 2, 4, 2, Precision::bf16, false, 1);
  check<Bf16, 128>(70, 1, 2, 1, Precision::bf16, false, 2);
  check<Bf16, 16>(33, 2, 4, 4, Precision::bf16, true, 3);
  check<Bf16, 32>(5, 2, 2, 1, Precision::bf16, false, 4);
  check<Bf16, 64>(128, 1, 8, 2, Precision::bf16, false, 5);
  check<_Float16, 64>(130, 1, 4, 2, Precision::fp16, false, 6);
  check<_Float16, 32>(100, 1, 2, 2, Precision::fp16, true, 7);
  check<_Float16, 16>(33, 1, 2, 1, Precision::fp16, false, 8);
  check<_Float16, 128>(70, 1, 2, 2, Precision::fp16, false, 9);
}

}  // namespace
}  // namespace strata::flash_tc_emulated
