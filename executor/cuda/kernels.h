// Launchers of the CUDA backend's kernels, one .cu file each (DESIGN.md). Plain types only,
// so the backend (cuda_backend.cpp, compiled by the host compiler) can call them. Every
// pointer is device memory; shapes and conventions are those of executor/backend.h.
#pragma once

#include "executor/cuda/limits.h"
#ifndef STRATA_CUDA_EMULATION  // (tests/cuda_emulation.h: the kernels on the CPU)
#include <cuda_runtime_api.h>
#endif

#include <cmath>
#include <cstdint>
#include <string>

namespace strata::cuda {

// `round` (here and below): the output rounded as round_to rounds it (1 bf16, 2 fp16, 0 none)
// as the kernel writes it.
void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                       int64_t N, int64_t H, int round, cudaStream_t s);
// The forwards (and the activation's backward) also write their output in either storage:
// out_kind 0 floats rounded to `round`, 1 bf16 or 2 fp16 as pack16 stores them (rounded so;
// round.cuh's store_value).
void layernorm_forward(void* out, int out_kind, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t H, int round, cudaStream_t s);
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* mean,
                        const float* rstd, const float* w, int64_t N, int64_t H, cudaStream_t s);
// The backwards below also take their kept input (x; u) in either storage: x_kind (u_kind)
// 0 floats, 1 bf16, 2 fp16 as pack16 stores them (round.cuh's load_stored).
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const void* x, int x_kind,
                        const float* mean, const float* rstd, const float* w, int64_t N, int64_t H, cudaStream_t s);
void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t H, int round,
                     cudaStream_t s);
void rmsnorm_forward(void* out, int out_kind, float* rstd, const float* x, const float* w, int64_t N, int64_t H,
                     int round, cudaStream_t s);
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* rstd, const float* w,
                      int64_t N, int64_t H, cudaStream_t s);
void rmsnorm_backward(float* dx, float* dw, const float* dout, const void* x, int x_kind, const float* rstd,
                      const float* w, int64_t N, int64_t H, cudaStream_t s);
// kind: 0 gelu, 3 squared ReLU (u (N, F)); 1 swiglu, 2 geglu (u (N, 2F) = [gate | up]).
void activation_forward(int kind, float* out, const float* u, int64_t N, int64_t F, int round, cudaStream_t s);
// u16, where not null (out_kind 1 or 2 only), gets u in that storage in the same pass.
void activation_forward(int kind, void* out, int out_kind, uint16_t* u16, const float* u, int64_t N, int64_t F,
                        int round, cudaStream_t s);
void activation_backward(int kind, float* du, const float* dout, const float* u, int64_t N, int64_t F, int round,
                         cudaStream_t s);
void activation_backward(int kind, float* du, const float* dout, const void* u, int u_kind, int64_t N, int64_t F,
                         int round, cudaStream_t s);
void activation_backward(int kind, void* du, int du_kind, const float* dout, const void* u, int u_kind, int64_t N,
                         int64_t F, int round, cudaStream_t s);
void rope(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse, cudaStream_t s);
// The unfused attention's row kernels (attention.cu; its GEMMs are cuBLASLt calls in
// cuda_backend.cpp): in place on `count` S x S matrices `stride` floats apart, the causal
// softmax of each row (columns past the diagonal set to 0), and its backward, d = dP in,
// d = scale * P (dP - rowsum(P dP)) out. check_attention_shape throws for shapes it refuses.
void check_attention_shape(int64_t S, int64_t B, int64_t A, int64_t G, int64_t D);
void causal_softmax(float* p, int64_t stride, int64_t count, int64_t S, cudaStream_t s);
void causal_softmax_backward(float* d, int64_t d_stride, const float* p, int64_t p_stride, int64_t count, int64_t S,
                             float scale, cudaStream_t s);
// Tiled, fused causal attention (flash_attention.cu): no S x S buffer; lse (B, A, S) is the
// log-sum-exp of each query's scores, kept for the backward. The backward overwrites dqkv
// and uses delta (B, A, S) as workspace. Head dim at most kFlashMaxHeadDim (limits.h).
// kind 0: fp32 on the CUDA cores; 1 (bf16) or 2 (fp16): the products on the tensor cores in
// that type with fp32 accumulation (flash_attention_tc.cu), for head dims where
// flash_tc_head_dim (limits.h) and devices of compute capability 8 or more.
void flash_attention_forward(float* out, float* lse, const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G,
                             int64_t D, int kind, cudaStream_t s);
void flash_attention_backward(float* dqkv, float* delta, const float* dout, const float* out, const float* lse,
                              const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G, int64_t D, int kind,
                              cudaStream_t s);
// "" when the tensor-core kernels can run head dim D on `device`; else why not (the head dim,
// a build for architectures before sm_80, or a shared-memory limit below theirs).
std::string flash_tc_unavailable_reason(int64_t D, int device);
// The same with qkv (and the forward's output, which the backward's delta reads) in either
// storage: qkv_kind (out_kind) 0 floats, else pack16's kind, which must be the kernels' own
// (`kind`: the tensor-core kernels read it as it lies; fp32 kernels take floats only).
void flash_attention_forward(float* out, float* lse, const void* qkv, int qkv_kind, int64_t S, int64_t B, int64_t A,
                             int64_t G, int64_t D, int kind, cudaStream_t s);
void flash_attention_backward(float* dqkv, float* delta, const float* dout, const void* out, int out_kind,
                              const float* lse, const void* qkv, int qkv_kind, int64_t S, int64_t B, int64_t A,
                              int64_t G, int64_t D, int kind, cudaStream_t s);
// The tensor-core kernels themselves (flash_attention_tc.cu); the backward's dqkv zeroed and
// delta computed by the caller. qkv16: qkv in 16-bit storage of their type (kind), else floats.
void flash_attention_forward_tc(float* out, float* lse, const void* qkv, bool qkv16, int64_t S, int64_t B, int64_t A,
                                int64_t G, int64_t D, int kind, cudaStream_t s);
void flash_attention_backward_tc(float* dqkv, const float* delta, const float* dout, const float* lse, const void* qkv,
                                 bool qkv16, int64_t S, int64_t B, int64_t A, int64_t G, int64_t D, int kind,
                                 cudaStream_t s);
// AdamW's per-step scalars, computed on the host in double as executor/zero.cpp's
// adamw_update does (bias corrections of step `step`, the step size, the decay).
struct AdamWScalars {
  float b1, b2, step_size, inv_bc2, eps, wd, grad_mul;
};
inline AdamWScalars adamw_scalars(double beta1, double beta2, double eps, double weight_decay, double lr, int64_t step,
                                  float grad_mul) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamWScalars k{};
  k.b1 = static_cast<float>(beta1);
  k.b2 = static_cast<float>(beta2);
  k.step_size = static_cast<float>(lr / bc1);
  k.inv_bc2 = static_cast<float>(1.0 / bc2);
  k.eps = static_cast<float>(eps);
  k.wd = static_cast<float>(lr * weight_decay);
  k.grad_mul = grad_mul;
  return k;
}
// The per-element flags are bits (executor/zero.h's FlagBits): element i's is bit
// first + i of the bytes at `decay` / `counted`, least significant first.
void adamw(float* p, const float* g, float* m, float* v, const unsigned char* decay, int64_t first, int64_t n,
           const AdamWScalars& k, cudaStream_t s);
// acc (device, 2 doubles) += {sum of squares of the finite counted values, non-finite count}.
void grad_norm_terms(const float* g, const unsigned char* counted, int64_t first, int64_t n, double* acc,
                     cudaStream_t s);
// x (S*B, H) = rows of wte (Vt, H) for tokens (B, S) in [lo, lo + Vt), zero otherwise; the
// backward adds dx's rows into dwte.
void embedding_forward(float* x, const float* wte, const int* tokens, int64_t S, int64_t B, int64_t H, int64_t lo,
                       int64_t Vt, cudaStream_t s);
void embedding_backward(float* dwte, const float* dx, const int* tokens, int64_t S, int64_t B, int64_t H, int64_t lo,
                        int64_t Vt, cudaStream_t s);
// The elementwise ops of backend.h (elementwise.cu).
void add(float* out, const float* a, const float* b, int64_t n, int round, cudaStream_t s);
void add_bias(float* y, const float* b, int64_t N, int64_t F, int round, cudaStream_t s);
void bias_grad(float* db, const float* dy, int64_t N, int64_t F, cudaStream_t s);
// dy in either storage (dy_kind as x_kind above).
void bias_grad(float* db, const void* dy, int dy_kind, int64_t N, int64_t F, cudaStream_t s);
void add_positions(float* out, const float* x, const float* P, int64_t n, int64_t H, int64_t B, int64_t row0,
                   cudaStream_t s);
void position_grad(float* dP, const float* dx, int64_t n, int64_t H, int64_t B, int64_t row0, cudaStream_t s);
// Vocab-parallel cross-entropy, the phases of backend.h (targets: device int32, N).
void cross_entropy_max(float* mx, const float* z, int64_t N, int64_t Vt, cudaStream_t s);
void cross_entropy_exp_sum(float* st, const float* z, const float* mx, const int* targets, int64_t N, int64_t Vt,
                           int64_t lo, cudaStream_t s);
// Both in one pass (backend.h's cross_entropy_forward), and st moved to the maxima mg.
void cross_entropy_forward(float* mx, float* st, const float* z, const int* targets, int64_t N, int64_t Vt, int64_t lo,
                           cudaStream_t s);
void cross_entropy_rescale(float* st, const float* mx, const float* mg, const int* targets, int64_t N, int64_t Vt,
                           int64_t lo, cudaStream_t s);
// kind: round_to's (1 bf16, 2 fp16, 0 none).
void cross_entropy_backward(float* z, const float* mx, const float* st, const int* targets, int64_t N, int64_t Vt,
                            int64_t lo, float scale, int kind, cudaStream_t s);
// The same gradient into dz (N, Vt) in 16-bit storage as pack16 stores it (kind 1 bf16, 2
// fp16), z left as it is.
void cross_entropy_backward_packed(uint16_t* dz, const float* z, const float* mx, const float* st, const int* targets,
                                   int64_t N, int64_t Vt, int64_t lo, float scale, int kind, cudaStream_t s);
// The most blocks the element-wise kernels over rows launch along y (reduce.cuh's
// row_grid), 1 to 65,535 (clamped).
void set_row_grid_limit(unsigned blocks);
// C (M, N, row stride ldc) = beta * C; beta = 0 writes zeros.
void scale_matrix(float* c, int64_t M, int64_t N, int64_t ldc, float beta, cudaStream_t s);
// kind: 1 bf16, 2 fp16 (round to nearest even; fp16 overflows to inf).
void round_to(float* x, int64_t n, int kind, cudaStream_t s);
// dst = src rounded as round_to does (kind 0: copied).
void round_copy(float* dst, const float* src, int64_t n, int kind, cudaStream_t s);
// dst (n 2-byte patterns) = src rounded as round_to does (kind 1 bf16, 2 fp16); and back.
void pack16(uint16_t* dst, const float* src, int64_t n, int kind, cudaStream_t s);
void unpack16(float* dst, const uint16_t* src, int64_t n, int kind, cudaStream_t s);
// dst (rows x cols, row stride ld_dst, 2 bytes per element) = src (rows x cols, row stride
// ld) as kind 1 bf16 or 2 fp16, round to nearest even.
void cast_matrix(void* dst, int64_t ld_dst, const float* src, int64_t rows, int64_t cols, int64_t ld, int kind,
                 cudaStream_t s);

}  // namespace strata::cuda
