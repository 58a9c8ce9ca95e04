// Speed of the CUDA backend's kernels on the GPU it finds, as a table (scripts/device-check.sh
// runs it): GEMMs in fp32 and on the tensor cores in bf16 / fp16 (fp32 accumulation, the
// operand casts included), and attention forward + backward for the gpt2-124m shape
// (S 1024, micro-batch 8, 12 heads of 64), unfused (probabilities kept; its GEMMs in fp32
// and in bf16) against the tiled, fused kernels (fp32, and bf16 on the tensor cores); then
// the step's memory-bound kernels in GB/s beside a copy. Each line is the median of 10 timed
// runs after 3 warm-up runs. Without a GPU it says why and exits 0: it asserts nothing.
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

// The memory-bound kernels of a gpt2-124m step (micro-batch 8: 8,192 rows of 768, 3,072 and
// 50,304) as bytes moved over time, beside a device-to-device copy: how near each comes to
// what the memory gives (the element-wise kernels over rows step through their rows without
// a division an element: reduce.cuh's row_grid).
void memory_bound_table(CudaBackend& be, std::mt19937& rng) {
  const int64_t N = 8192, H = 768, F = 3072, V = 50304;
  const Precision bf16 = Precision::bf16;
  float* a = filled(be, N * F, rng);
  float* b = filled(be, N * F, rng);
  float* c = filled(be, N * F, rng);
  float* w = filled(be, F, rng);
  float* z = be.device_alloc(N * V);  // (logits: a's values again and again, not 412M fresh draws on the host)
  for (int64_t at = 0; at < N * V; at += N * F) be.copy(z + at, a, std::min(N * F, N * V - at));
  float* mx = filled(be, N, rng);
  std::vector<float> sums(static_cast<size_t>(2 * N), 1000.0f);  // (positive row sums)
  float* st = be.device_alloc(2 * N);
  be.to_device(st, sums.data(), 2 * N);
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) tg[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % V);
  auto* targets = static_cast<int32_t*>(be.allocate_bytes(tg.size() * sizeof(int32_t)));
  be.bytes_to_device(targets, tg.data(), tg.size() * sizeof(int32_t));
  auto* d16 = static_cast<uint16_t*>(be.allocate_bytes(static_cast<size_t>(N * V) * 2));
  auto* u16 = static_cast<uint16_t*>(be.allocate_bytes(static_cast<size_t>(N * F) * 2));
  float* mean = be.device_alloc(N);
  float* rstd = be.device_alloc(N);
  std::printf("\n| memory-bound kernel | shape | ms | GB/s |\n|---|---|---|---|\n");
  auto row = [&](const char* name, const char* shape, double bytes, const std::function<void()>& run) {
    const double s = median_seconds(be, run);
    std::printf("| %s | %s | %.3f | %.0f |\n", name, shape, 1e3 * s, bytes / s / 1e9);
  };
  const double nf = static_cast<double>(N * F), nh = static_cast<double>(N * H), nv = static_cast<double>(N * V);
  row("copy (device to device)", "8192 x 3072", 8 * nf, [&] { be.copy(b, a, N * F); });
  row("add (rounded to bf16)", "8192 x 768", 12 * nh, [&] { be.add(c, a, b, N * H, bf16); });
  row("add_bias", "8192 x 3072", 8 * nf, [&] { be.add_bias(c, w, N, F); });
  row("GELU forward (float out)", "8192 x 3072", 8 * nf, [&] { be.activation_forward(strata::Activation::gelu, c, a, N, F, bf16); });
  row("GELU forward (16-bit out and u)", "8192 x 3072", 8 * nf,
      [&] { be.activation_forward_packed(strata::Activation::gelu, d16, u16, a, N, F, bf16); });
  row("GELU backward (float du)", "8192 x 3072", 12 * nf,
      [&] { be.activation_backward(strata::Activation::gelu, c, b, a, N, F, bf16); });
  row("LayerNorm forward (16-bit out)", "8192 x 768", 6 * nh,
      [&] { be.layernorm_forward_packed(d16, mean, rstd, a, w, w, N, H, bf16); });
  row("pack16 (bf16)", "8192 x 3072", 6 * nf, [&] { be.pack16(u16, a, N * F, bf16); });
  row("cross-entropy forward, one pass", "8192 x 50304", 4 * nv,
      [&] { be.cross_entropy_forward(mx, st, z, targets, N, V, 0); });
  row("cross-entropy max", "8192 x 50304", 4 * nv, [&] { be.cross_entropy_max(mx, z, N, V); });
  row("cross-entropy exp-sum", "8192 x 50304", 4 * nv, [&] { be.cross_entropy_exp_sum(st, z, mx, targets, N, V, 0); });
  be.to_device(st, sums.data(), 2 * N);
  row("cross-entropy backward (16-bit out)", "8192 x 50304", 6 * nv,
      [&] { be.cross_entropy_backward_packed(d16, z, mx, st, targets, N, V, 0, 1.0f / 8192, bf16); });
  row("cross-entropy backward (in place)", "8192 x 50304", 8 * nv,
      [&] { be.cross_entropy_backward(z, mx, st, targets, N, V, 0, 1.0f / 8192, bf16); });
  for (float* p : {a, b, c, w, z, mx, st, mean, rstd}) be.device_free(p);
  for (void* p : {static_cast<void*>(targets), static_cast<void*>(d16), static_cast<void*>(u16)}) be.deallocate_bytes(p);
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
  memory_bound_table(*be, rng);
  return 0;
}
