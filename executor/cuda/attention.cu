// Causal attention with grouped-query heads, forward and backward, unfused reference-style
// kernels: one block per (query position, head, micro-batch row) keeps its row of scores in
// shared memory (so S is bounded by shared memory: 8192 here); probs (B, A, S, S) is written
// when given, recomputed when not. The backward accumulates dk and dv with atomics (several
// query rows and, with GQA, several heads feed each key row). A tiled flash-attention
// kernel for long sequences is still to come (issue 5).
#include "executor/cuda/check.h"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 128;

struct Dims {
  long long S, B, A, G, D;
  __device__ long long ld() const { return (A + 2 * G) * D; }
  __device__ const float* q(const float* qkv, long long s, long long b, long long h) const {
    return qkv + (s * B + b) * ld() + h * D;
  }
  __device__ long long k_off(long long h) const { return (A + h / (A / G)) * D; }
  __device__ long long v_off(long long h) const { return (A + G + h / (A / G)) * D; }
};

// The softmax row of query i into p[0..i] (shared); returns nothing, p is complete after.
__device__ void softmax_row(float* p, const float* q, const float* qkv, const Dims& d, long long i, long long b,
                            long long h, float scale, float* scratch) {
  const long long ld = d.ld(), ko = d.k_off(h);
  float mx = -INFINITY;
  for (long long j = threadIdx.x; j <= i; j += blockDim.x) {
    const float* k = qkv + (j * d.B + b) * ld + ko;
    float dot = 0.0f;
    for (long long e = 0; e < d.D; ++e) dot += q[e] * k[e];
    p[j] = scale * dot;
    mx = fmaxf(mx, p[j]);
  }
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (long long j = threadIdx.x; j <= i; j += blockDim.x) {
    p[j] = expf(p[j] - mx);
    sum += p[j];
  }
  const float inv = 1.0f / block_sum(sum, scratch);
  for (long long j = threadIdx.x; j <= i; j += blockDim.x) p[j] *= inv;
  __syncthreads();
}

__global__ void forward(float* out, float* probs, const float* qkv, Dims d, float scale) {
  extern __shared__ float sh[];
  __shared__ float scratch[32];
  const long long i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  float* p = sh;           // S
  float* q = sh + d.S;     // D
  const float* qg = d.q(qkv, i, b, h);
  for (long long e = threadIdx.x; e < d.D; e += blockDim.x) q[e] = qg[e];
  __syncthreads();
  softmax_row(p, q, qkv, d, i, b, h, scale, scratch);
  if (probs) {
    float* row = probs + ((b * d.A + h) * d.S + i) * d.S;
    for (long long j = threadIdx.x; j < d.S; j += blockDim.x) row[j] = j <= i ? p[j] : 0.0f;
  }
  const long long ld = d.ld(), vo = d.v_off(h);
  float* o = out + (i * d.B + b) * d.A * d.D + h * d.D;
  for (long long e = threadIdx.x; e < d.D; e += blockDim.x) {
    float acc = 0.0f;
    for (long long j = 0; j <= i; ++j) acc += p[j] * qkv[(j * d.B + b) * ld + vo + e];
    o[e] = acc;
  }
}

__global__ void backward(float* dqkv, const float* dout, const float* probs, const float* qkv, Dims d, float scale) {
  extern __shared__ float sh[];
  __shared__ float scratch[32];
  const long long i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  float* p = sh;                  // S
  float* ds = sh + d.S;           // S
  float* q = sh + 2 * d.S;        // D
  float* go = sh + 2 * d.S + d.D; // D
  const long long ld = d.ld(), ko = d.k_off(h), vo = d.v_off(h);
  const float* qg = d.q(qkv, i, b, h);
  const float* gog = dout + (i * d.B + b) * d.A * d.D + h * d.D;
  for (long long e = threadIdx.x; e < d.D; e += blockDim.x) {
    q[e] = qg[e];
    go[e] = gog[e];
  }
  __syncthreads();
  if (probs) {
    const float* row = probs + ((b * d.A + h) * d.S + i) * d.S;
    for (long long j = threadIdx.x; j <= i; j += blockDim.x) p[j] = row[j];
    __syncthreads();
  } else {
    softmax_row(p, q, qkv, d, i, b, h, scale, scratch);
  }
  // dP_j = dout_i . v_j;  dS_j = P_j (dP_j - sum_w P_w dP_w) * scale.
  float dot = 0.0f;
  for (long long j = threadIdx.x; j <= i; j += blockDim.x) {
    const float* v = qkv + (j * d.B + b) * ld + vo;
    float dp = 0.0f;
    for (long long e = 0; e < d.D; ++e) dp += go[e] * v[e];
    ds[j] = dp;
    dot += p[j] * dp;
  }
  dot = block_sum(dot, scratch);
  for (long long j = threadIdx.x; j <= i; j += blockDim.x) ds[j] = p[j] * (ds[j] - dot) * scale;
  __syncthreads();
  float* dq = dqkv + (i * d.B + b) * ld + h * d.D;
  for (long long e = threadIdx.x; e < d.D; e += blockDim.x) {
    float acc = 0.0f;
    for (long long j = 0; j <= i; ++j) acc += ds[j] * qkv[(j * d.B + b) * ld + ko + e];
    dq[e] += acc;
  }
  for (long long t = threadIdx.x; t < (i + 1) * d.D; t += blockDim.x) {
    const long long j = t / d.D, e = t % d.D;
    float* row = dqkv + (j * d.B + b) * ld;
    atomicAdd(row + ko + e, ds[j] * q[e]);
    atomicAdd(row + vo + e, p[j] * go[e]);
  }
}

void check_shape(int64_t S, int64_t B, int64_t A, int64_t G) {
  if (S > kUnfusedAttentionMaxSeq || B > 65535 || A > 65535 || G <= 0 || A % G != 0)
    throw std::runtime_error("cuda attention: S = " + std::to_string(S) + ", B = " + std::to_string(B) +
                             ", A = " + std::to_string(A) + ", G = " + std::to_string(G) +
                             ": the unfused kernel needs S <= 8192, B and A <= 65535, A divisible by G");
}

}  // namespace

void attention_forward(float* out, float* probs, const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G,
                       int64_t D, cudaStream_t s) {
  if (S * B * A == 0) return;
  check_shape(S, B, A, G);
  const size_t shared = static_cast<size_t>(S + D) * sizeof(float);
  // (always: the static scratch counts against the same 48 KiB default)
  CUDA_CHECK(cudaFuncSetAttribute(forward, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(A), static_cast<unsigned>(B));
  forward<<<grid, kThreads, shared, s>>>(out, probs, qkv, Dims{S, B, A, G, D}, 1.0f / sqrtf(static_cast<float>(D)));
  CUDA_CHECK_LAUNCH();
}

void attention_backward(float* dqkv, const float* dout, const float* probs, const float* qkv, int64_t S, int64_t B,
                        int64_t A, int64_t G, int64_t D, cudaStream_t s) {
  if (S * B * (A + 2 * G) * D > 0)
    CUDA_CHECK(cudaMemsetAsync(dqkv, 0, static_cast<size_t>(S * B * (A + 2 * G) * D) * sizeof(float), s));
  if (S * B * A == 0) return;
  check_shape(S, B, A, G);
  const size_t shared = static_cast<size_t>(2 * S + 2 * D) * sizeof(float);
  CUDA_CHECK(cudaFuncSetAttribute(backward, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(A), static_cast<unsigned>(B));
  backward<<<grid, kThreads, shared, s>>>(dqkv, dout, probs, qkv, Dims{S, B, A, G, D}, 1.0f / sqrtf(static_cast<float>(D)));
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
