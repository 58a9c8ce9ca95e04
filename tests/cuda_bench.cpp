// Speed of the CUDA backend's kernels on the GPU it finds, as a table (scripts/device-check.sh
// runs it): GEMMs in fp32 and on the tensor cores in bf16 / fp16 (fp32 accumulation, the
// operand casts included), and attention forward + backward for the gpt2-124m shape
// (S 1024, micro-batch 8, 12 heads of 64), unfused (probabilities kept; its GEMMs in fp32
// and in bf16) against the tiled, fused kernels (fp32, and bf16 on the tensor cores). Each line is the median of 10 timed runs
// after 3 warm-up runs. Without a GPU it says why and exits 0: it asserts nothing.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "executor/cuda/cuda_backend.h"

namespace {

using strata::CudaBackend;
using strata::Precision;

double median_seconds(CudaBackend& be, const std::function<void()>& run) {
  for (int i = 0; i < 3; ++i) run();
  be.synchronise();
  std::vector<double> t;
  for (int i = 0; i < 10; ++i) {
    const auto a = std::chrono::steady_clock::now();
    run();
    be.synchronise();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

float* filled(CudaBackend& be, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> h(static_cast<size_t>(n));
  for (float& x : h) x = d(rng);
  float* p = be.device_alloc(n);
  be.to_device(p, h.data(), n);
  return p;
}

}  // namespace

int main() {
  const std::string why = strata::cuda_unavailable_reason();
  if (!why.empty()) {
    std::printf("cuda_bench: no GPU (%s)\n", why.c_str());
    return 0;
  }
  auto be = strata::make_cuda_backend();
  std::mt19937 rng(1);
  std::printf("cuda_bench on %s\n\n| kernel | shape | ms | TFLOP/s |\n|---|---|---|---|\n", be->device_name().c_str());
  // GEMMs: a square one and the gpt2-124m MLP's (tokens 8192 x 768 -> 3072).
  struct G {
    int64_t M, N, K;
  };
  for (const G g : {G{4096, 4096, 4096}, G{8192, 3072, 768}}) {
    float* a = filled(*be, g.M * g.K, rng);
    float* b = filled(*be, g.K * g.N, rng);
    float* c = filled(*be, g.M * g.N, rng);
    for (Precision p : {Precision::fp32, Precision::bf16, Precision::fp16}) {
      be->set_gemm_precision(p);
      const double s = median_seconds(*be, [&] { be->gemm(false, true, g.M, g.N, g.K, 1.0f, a, g.K, b, g.K, 0.0f, c, g.N); });
      std::printf("| gemm %s (NT) | %lldx%lldx%lld | %.3f | %.1f |\n", strata::to_string(p), static_cast<long long>(g.M),
                  static_cast<long long>(g.N), static_cast<long long>(g.K), 1e3 * s,
                  2.0 * static_cast<double>(g.M * g.N * g.K) / s / 1e12);
    }
    be->set_gemm_precision(Precision::fp32);
    be->device_free(a);
    be->device_free(b);
    be->device_free(c);
  }
  // Attention, gpt2-124m: causal, so half of QK^T's and PV's 4 S^2 D FLOPs per head count
  // forward; backward 2.5 times that (FlashAttention-2's convention: five GEMMs to two, the
  // recomputed scores included). The flash backward's time includes zeroing dqkv and the
  // delta = rowsum(dO O) kernel; the unfused backward reads the kept probabilities.
  const int64_t S = 1024, B = 8, A = 12, D = 64;
  float* qkv = filled(*be, S * B * 3 * A * D, rng);
  float* out = filled(*be, S * B * A * D, rng);
  float* dout = filled(*be, S * B * A * D, rng);
  float* dqkv = filled(*be, S * B * 3 * A * D, rng);
  float* lse = filled(*be, B * A * S, rng);
  float* probs = be->device_alloc(B * A * S * S);
  const double fwd_flops = 2.0 * static_cast<double>(B * A) * static_cast<double>(S * S) * static_cast<double>(D);
  const std::string shape = "S 1024, B 8, 12 x 64";
  auto row = [&](const char* name, double s, double flops) {
    std::printf("| %s | %s | %.3f | %.2f |\n", name, shape.c_str(), 1e3 * s, flops / s / 1e12);
  };
  // The unfused attention's products are cuBLASLt GEMMs: fp32, then on the tensor cores.
  for (Precision p : {Precision::fp32, Precision::bf16}) {
    be->set_gemm_precision(p);
    const std::string fwd = std::string("attention forward, unfused (probs kept), ") + strata::to_string(p);
    const std::string bwd = std::string("attention backward, unfused (probs kept), ") + strata::to_string(p);
    row(fwd.c_str(), median_seconds(*be, [&] { be->attention_forward(out, probs, qkv, S, B, A, A, D); }), fwd_flops);
    row(bwd.c_str(), median_seconds(*be, [&] { be->attention_backward(dqkv, dout, probs, qkv, S, B, A, A, D); }),
        2.5 * fwd_flops);
  }
  // The fused kernels: fp32 on the CUDA cores, then (a 16-bit plan's) on the tensor cores.
  for (Precision p : {Precision::fp32, Precision::bf16}) {
    be->set_gemm_precision(p);
    const std::string kind = be->flash_on_tensor_cores(D) ? std::string(", tensor cores ") + strata::to_string(p)
                                                          : std::string(", fp32");
    const std::string fwd = "flash attention forward" + kind, bwd = "flash attention backward" + kind;
    row(fwd.c_str(), median_seconds(*be, [&] { be->flash_attention_forward(out, lse, qkv, S, B, A, A, D); }),
        fwd_flops);
    row(bwd.c_str(), median_seconds(*be, [&] { be->flash_attention_backward(dqkv, dout, out, lse, qkv, S, B, A, A, D); }),
        2.5 * fwd_flops);
  }
  be->set_gemm_precision(Precision::fp32);
  for (float* p : {qkv, out, dout, dqkv, lse, probs}) be->device_free(p);
  return 0;
}
