// Causal grouped-query attention on the tensor cores, for 16-bit plans: FlashAttention-2's
// algorithm (Dao 2023; flash_attention.cu runs it in fp32 on the CUDA cores) with the four
// products of each tile on WMMA fragments: 16-bit operands (bf16 or fp16, rounded to nearest
// from the fp32 storage as the plan's GEMMs round theirs), fp32 accumulation, the softmax in
// fp32. Head dims 16, 32, 64 and 128; flash_attention.cu serves other head dims and fp32.
//   forward:  a block of 4 warps per (64 queries, head, micro-batch row); each warp owns 16
//             query rows. Per key tile of 64: S = Q K^T into the warp's fp32 scratch, the
//             online softmax there (two lanes a row: running max m, sum l, the output row
//             rescaled by exp(m_old - m_new)), P rounded to 16 bits, then O += P V with O in
//             shared memory (fp32), where the rows can be rescaled elementwise.
//   backward: delta = rowsum(dO * O) first (flash_attention.cu's kernel); then a block per
//             (64 keys, head, micro-batch row) streams the query tiles at or after its
//             diagonal. Each warp recomputes its 16 query rows' S = Q K^T and dP = dO V^T,
//             P = exp(scale S - lse) and dS = P (dP - delta), both rounded to 16 bits into
//             shared tiles; then each warp adds its 16 key rows' dV += P^T dO and dK +=
//             dS^T Q into fragments that stay in registers, and its 16 query rows' dQ =
//             scale dS K into dqkv with atomics (other key tiles add to the same rows). dK
//             (times scale) and dV go out with atomics at the end (with GQA several heads
//             feed one key group), so dqkv is zeroed first.
// Layouts are those of backend.h: qkv (S, B, (A + 2G) D), out and dout (S, B, A D); lse and
// delta (B, A, S). The kernels themselves are in flash_attention_tc.cuh, which
// tests/flash_tc_emulation_test.cpp also runs on the CPU under an emulation of CUDA's names.
#ifndef STRATA_CUDA_EMULATION  // (tests/cuda_emulation.h: the launchers on the CPU)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#endif

#include <string>

#include "executor/cuda/check.h"
#include "executor/cuda/flash_dims.cuh"
#include "executor/cuda/kernels.h"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

using namespace nvcuda;

using Dims = FlashDims;

#ifdef STRATA_CUDA_EMULATION
#define STRATA_UNROLL
#else
#define STRATA_UNROLL _Pragma("unroll")
#endif
#include "executor/cuda/flash_attention_tc.cuh"
#undef STRATA_UNROLL

template <class T, int D>
void forward_as(float* out, float* lse, const void* qkv, const Dims& d, cudaStream_t s) {
  static int opted[kMaxDevices];  // (zero: static storage)
  const int bytes = ForwardLayout<D>::bytes;
  const auto kernel = tc_forward<T, D>;
  opt_in_shared(kernel, bytes, opted);
  const dim3 grid(static_cast<unsigned>((d.S + kTile - 1) / kTile), static_cast<unsigned>(d.A),
                  static_cast<unsigned>(d.B));
  STRATA_LAUNCH(kernel, grid, kThreads, bytes, s)(out, lse, qkv, d, 1.0f / sqrtf(static_cast<float>(d.D)));
  CUDA_CHECK_LAUNCH();
}

template <class T, int D>
void backward_as(float* dqkv, const float* dout, const float* lse, const float* delta, const void* qkv, const Dims& d,
                 cudaStream_t s) {
  static int opted[kMaxDevices];  // (zero: static storage)
  const int bytes = BackwardLayout<D>::bytes;
  const auto kernel = tc_backward<T, D>;
  opt_in_shared(kernel, bytes, opted);
  const dim3 grid(static_cast<unsigned>((d.S + kTile - 1) / kTile), static_cast<unsigned>(d.A),
                  static_cast<unsigned>(d.B));
  const float scale = 1.0f / sqrtf(static_cast<float>(d.D));
  STRATA_LAUNCH(kernel, grid, kThreads, bytes, s)(dqkv, dout, lse, delta, qkv, d, scale);
  CUDA_CHECK_LAUNCH();
}

// The kernel for (kind, D): kind 1 bf16, 2 fp16.
template <template <class, int> class Call, class... Args>
void dispatch(int kind, int64_t D, Args... args) {
  switch ((kind == 2 ? 1000 : 0) + static_cast<int>(D)) {
    case 16: return Call<__nv_bfloat16, 16>::run(args...);
    case 32: return Call<__nv_bfloat16, 32>::run(args...);
    case 64: return Call<__nv_bfloat16, 64>::run(args...);
    case 128: return Call<__nv_bfloat16, 128>::run(args...);
    case 1016: return Call<__half, 16>::run(args...);
    case 1032: return Call<__half, 32>::run(args...);
    case 1064: return Call<__half, 64>::run(args...);
    case 1128: return Call<__half, 128>::run(args...);
    default:
      fail("flash attention (tensor cores)", __FILE__, __LINE__,
           "no kernel for head dim " + std::to_string(D) + " (flash_tc_head_dim)");
  }
}
template <class T, int D>
struct Forward {
  static void run(float* out, float* lse, const void* qkv, Dims d, cudaStream_t s) {
    forward_as<T, D>(out, lse, qkv, d, s);
  }
};
template <class T, int D>
struct Backward {
  static void run(float* dqkv, const float* dout, const float* lse, const float* delta, const void* qkv, Dims d,
                  cudaStream_t s) {
    backward_as<T, D>(dqkv, dout, lse, delta, qkv, d, s);
  }
};

}  // namespace

std::string flash_tc_unavailable_reason(int64_t D, int device) {
  if (!flash_tc_head_dim(D)) return "head dim " + std::to_string(D) + " (the kernels take 16, 32, 64 and 128)";
  // The code the device runs: built for sm_80 or later (a build for older architectures
  // would run the kernels' __trap through a JIT of older PTX).
  cudaFuncAttributes fa{};
  CUDA_CHECK(cudaFuncGetAttributes(&fa, tc_backward<__nv_bfloat16, 16>));
  if (fa.ptxVersion < 80)
    return "the kernels were compiled for compute_" + std::to_string(fa.ptxVersion) +
           " (16-bit WMMA needs 80 or later)";
  int optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int bytes = D == 16   ? shared_bytes<16>()
                    : D == 32 ? shared_bytes<32>()
                    : D == 64 ? shared_bytes<64>()
                              : shared_bytes<128>();
  if (bytes > optin)
    return "head dim " + std::to_string(D) + " needs " + std::to_string(bytes) +
           " bytes of shared memory a block, the device " + std::to_string(optin);
  return "";
}

void flash_attention_forward_tc(float* out, float* lse, const void* qkv, bool qkv16, int64_t S, int64_t B, int64_t A,
                                int64_t G, int64_t D, int kind, cudaStream_t s) {
  if (S == 0 || B == 0 || A == 0) return;
  dispatch<Forward>(kind, D, out, lse, qkv, Dims{S, B, A, G, D, qkv16}, s);
}

void flash_attention_backward_tc(float* dqkv, const float* delta, const float* dout, const float* lse, const void* qkv,
                                 bool qkv16, int64_t S, int64_t B, int64_t A, int64_t G, int64_t D, int kind,
                                 cudaStream_t s) {
  if (S == 0 || B == 0 || A == 0) return;
  dispatch<Backward>(kind, D, dqkv, dout, lse, delta, qkv, Dims{S, B, A, G, D, qkv16}, s);
}

}  // namespace strata::cuda
