// Causal grouped-query attention as tiled, fused kernels in the FlashAttention-2 manner (Dao
// 2023): no S x S matrix exists beyond one T x T tile in shared memory, so the sequence length
// is bounded by nothing but the grid. fp32 on the CUDA cores, T = 32 (D <= 64) or 16 (D <= 128).
//   forward:  a block per (query tile, head, micro-batch row) streams the key/value tiles at or
//             below its diagonal with the online softmax (running max m, running sum l, the
//             output rescaled as m grows); it writes the output and lse = m + log l per query.
//   backward: delta = rowsum(dO * O) per query first; then a block per (key tile, head, row)
//             streams the query tiles at or after its diagonal, recomputes P = exp(S - lse)
//             and accumulates dK and dV in shared memory; dQ and (with GQA, several heads
//             feed one key group) dK, dV go to dqkv with atomics, so dqkv is zeroed first.
// Layouts are those of backend.h: qkv (S, B, (A + 2G) D), out and dout (S, B, A D); lse and
// delta (B, A, S). With kind 1 or 2 (a 16-bit plan's) the launchers below hand the products
// to flash_attention_tc.cu's tensor-core kernels, after the same checks, zeroing and delta.
#include "executor/cuda/check.h"
#include "executor/cuda/flash_dims.cuh"
#include "executor/cuda/kernels.h"
#include "executor/cuda/reduce.cuh"
#include "executor/cuda/round.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 128;

using Dims = FlashDims;

// Copies T rows of D values (rows past S are zeros) into shared memory with row stride ld_sh.
__device__ void load_tile(float* dst, long long ld_sh, const float* src, const Dims& d, long long first, long long b,
                          long long off, long long row_len, int T) {
  for (long long t = threadIdx.x; t < T * d.D; t += blockDim.x) {
    const long long r = t / d.D, e = t % d.D, s = first + r;
    dst[r * ld_sh + e] = s < d.S ? src[d.row(s, b) * row_len + off + e] : 0.0f;
  }
}

template <int T>
__global__ void flash_forward(float* out, float* lse, const float* qkv, Dims d, float scale) {
  STRATA_DYNAMIC_SHARED(smem);
  float* const sh = reinterpret_cast<float*>(smem);
  const long long D = d.D, Dp = D + 1;  // +1: rows of K start in different banks
  float* Qs = sh;                        // T x D
  float* Ks = Qs + T * D;                // T x Dp
  float* Vs = Ks + T * Dp;               // T x D
  float* Os = Vs + T * D;                // T x D
  float* Ss = Os + T * D;                // T x (T + 1)
  float* m = Ss + T * (T + 1);           // T
  float* l = m + T;                      // T
  float* alpha = l + T;                  // T
  const long long i0 = static_cast<long long>(blockIdx.x) * T, h = blockIdx.y, b = blockIdx.z;
  const long long ld = d.ld();
  load_tile(Qs, D, qkv, d, i0, b, d.q_off(h), ld, T);
  for (long long t = threadIdx.x; t < T * D; t += blockDim.x) Os[t] = 0.0f;
  for (int r = threadIdx.x; r < T; r += blockDim.x) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  const long long last_key = i0 + T - 1 < d.S - 1 ? i0 + T - 1 : d.S - 1;
  for (long long j0 = 0; j0 <= last_key; j0 += T) {
    __syncthreads();  // the previous tile's K, V and S are no longer read
    load_tile(Ks, Dp, qkv, d, j0, b, d.k_off(h), ld, T);
    load_tile(Vs, D, qkv, d, j0, b, d.v_off(h), ld, T);
    __syncthreads();
    for (int t = threadIdx.x; t < T * T; t += blockDim.x) {
      const int r = t / T, c = t % T;
      const long long i = i0 + r, j = j0 + c;
      float s = -INFINITY;
      if (j <= i && i < d.S && j < d.S) {
        float dot = 0.0f;
        for (long long e = 0; e < D; ++e) dot += Qs[r * D + e] * Ks[c * Dp + e];
        s = scale * dot;
      }
      Ss[r * (T + 1) + c] = s;
    }
    __syncthreads();
    // Online softmax, one thread per query row.
    for (int r = threadIdx.x; r < T; r += blockDim.x) {
      float mx = m[r];
      for (int c = 0; c < T; ++c) mx = fmaxf(mx, Ss[r * (T + 1) + c]);
      float sum = 0.0f;
      for (int c = 0; c < T; ++c) {
        const float s = Ss[r * (T + 1) + c];
        const float p = s == -INFINITY ? 0.0f : expf(s - mx);
        Ss[r * (T + 1) + c] = p;
        sum += p;
      }
      const float a = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
      alpha[r] = a;
      l[r] = a * l[r] + sum;
      m[r] = mx;
    }
    __syncthreads();
    for (long long t = threadIdx.x; t < T * D; t += blockDim.x) {
      const long long r = t / D, e = t % D;
      float acc = 0.0f;
      for (int c = 0; c < T; ++c) acc += Ss[r * (T + 1) + c] * Vs[c * D + e];
      Os[t] = alpha[r] * Os[t] + acc;
    }
  }
  __syncthreads();
  for (long long t = threadIdx.x; t < T * D; t += blockDim.x) {
    const long long r = t / D, e = t % D, i = i0 + r;
    if (i < d.S) out[d.row(i, b) * (d.A * D) + h * D + e] = Os[t] / l[r];
  }
  for (int r = threadIdx.x; r < T; r += blockDim.x)
    if (i0 + r < d.S) lse[d.stat(b, h, i0 + r)] = m[r] + logf(l[r]);
}

// delta (B, A, S) = rowsum(dout * out) per (query, head): a warp per (query, row, head).
// out in either storage (ok: round.cuh's load_stored).
__global__ void flash_delta(float* delta, const float* dout, const void* out, int ok, Dims d) {
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= d.S * d.B * d.A) return;
  const long long h = warp % d.A, rb = warp / d.A, b = rb % d.B, i = rb / d.B;
  const long long o = d.row(i, b) * (d.A * d.D) + h * d.D;
  const float* g = dout + o;
  float acc = 0.0f;
  for (long long e = lane; e < d.D; e += 32) acc += load_stored(out, o + e, ok) * g[e];
  acc = warp_sum(acc);
  if (lane == 0) delta[d.stat(b, h, i)] = acc;
}

template <int T>
__global__ void flash_backward(float* dqkv, const float* dout, const float* lse, const float* delta,
                               const float* qkv, Dims d, float scale) {
  STRATA_DYNAMIC_SHARED(smem);
  float* const sh = reinterpret_cast<float*>(smem);
  const long long D = d.D, Dp = D + 1;
  float* Ks = sh;                  // T x Dp
  float* Vs = Ks + T * Dp;         // T x Dp
  float* dKs = Vs + T * Dp;        // T x D
  float* dVs = dKs + T * D;        // T x D
  float* Qs = dVs + T * D;         // T x D
  float* dOs = Qs + T * D;         // T x D
  float* Ps = dOs + T * D;         // T x (T + 1)
  float* dSs = Ps + T * (T + 1);   // T x (T + 1)
  float* L = dSs + T * (T + 1);    // T
  float* Dl = L + T;               // T
  const long long j0 = static_cast<long long>(blockIdx.x) * T, h = blockIdx.y, b = blockIdx.z;
  const long long ld = d.ld(), ldo = d.A * D;
  load_tile(Ks, Dp, qkv, d, j0, b, d.k_off(h), ld, T);
  load_tile(Vs, Dp, qkv, d, j0, b, d.v_off(h), ld, T);
  for (long long t = threadIdx.x; t < T * D; t += blockDim.x) dKs[t] = dVs[t] = 0.0f;
  for (long long i0 = (j0 / T) * T; i0 < d.S; i0 += T) {
    __syncthreads();  // the previous query tile is no longer read
    load_tile(Qs, D, qkv, d, i0, b, d.q_off(h), ld, T);
    load_tile(dOs, D, dout, d, i0, b, h * D, ldo, T);
    for (int r = threadIdx.x; r < T; r += blockDim.x) {
      const long long i = i0 + r;
      L[r] = i < d.S ? lse[d.stat(b, h, i)] : 0.0f;
      Dl[r] = i < d.S ? delta[d.stat(b, h, i)] : 0.0f;
    }
    __syncthreads();
    // P = exp(scale Q K^T - lse) and dP = dO V^T, masked to the causal, in-range part.
    for (int t = threadIdx.x; t < T * T; t += blockDim.x) {
      const int r = t / T, c = t % T;
      const long long i = i0 + r, j = j0 + c;
      float p = 0.0f, ds = 0.0f;
      if (j <= i && i < d.S && j < d.S) {
        float dot = 0.0f, dp = 0.0f;
        for (long long e = 0; e < D; ++e) {
          dot += Qs[r * D + e] * Ks[c * Dp + e];
          dp += dOs[r * D + e] * Vs[c * Dp + e];
        }
        p = expf(scale * dot - L[r]);
        ds = p * (dp - Dl[r]);
      }
      Ps[r * (T + 1) + c] = p;
      dSs[r * (T + 1) + c] = ds;
    }
    __syncthreads();
    // dV += P^T dO, dK += scale dS^T Q (this block owns these key rows for this head).
    for (long long t = threadIdx.x; t < T * D; t += blockDim.x) {
      const long long c = t / D, e = t % D;
      float dv = 0.0f, dk = 0.0f;
      for (int r = 0; r < T; ++r) {
        dv += Ps[r * (T + 1) + c] * dOs[r * D + e];
        dk += dSs[r * (T + 1) + c] * Qs[r * D + e];
      }
      dVs[t] += dv;
      dKs[t] += scale * dk;
    }
    // dQ += scale dS K, shared with the other key tiles: atomics.
    for (long long t = threadIdx.x; t < T * D; t += blockDim.x) {
      const long long r = t / D, e = t % D, i = i0 + r;
      if (i >= d.S) continue;
      float dq = 0.0f;
      for (int c = 0; c < T; ++c) dq += dSs[r * (T + 1) + c] * Ks[c * Dp + e];
      if (dq != 0.0f) atomicAdd(dqkv + d.row(i, b) * ld + d.q_off(h) + e, scale * dq);
    }
  }
  __syncthreads();
  for (long long t = threadIdx.x; t < T * D; t += blockDim.x) {
    const long long c = t / D, e = t % D, j = j0 + c;
    if (j >= d.S) continue;
    atomicAdd(dqkv + d.row(j, b) * ld + d.k_off(h) + e, dKs[t]);
    atomicAdd(dqkv + d.row(j, b) * ld + d.v_off(h) + e, dVs[t]);
  }
}

size_t forward_shared(int T, long long D) {
  return sizeof(float) * static_cast<size_t>(T * D + T * (D + 1) + 2 * T * D + T * (T + 1) + 3 * T);
}
size_t backward_shared(int T, long long D) {
  return sizeof(float) * static_cast<size_t>(2 * T * (D + 1) + 4 * T * D + 2 * T * (T + 1) + 2 * T);
}

template <int T>
void launch_forward(float* out, float* lse, const float* qkv, const Dims& d, cudaStream_t s) {
  const size_t shared = forward_shared(T, d.D);
  static int opted[kMaxDevices];  // (zero: static storage)
  opt_in_shared(flash_forward<T>, static_cast<int>(shared), opted);
  const dim3 grid(static_cast<unsigned>((d.S + T - 1) / T), static_cast<unsigned>(d.A), static_cast<unsigned>(d.B));
  STRATA_LAUNCH(flash_forward<T>, grid, kThreads, shared, s)(out, lse, qkv, d, 1.0f / sqrtf(static_cast<float>(d.D)));
  CUDA_CHECK_LAUNCH();
}

template <int T>
void launch_backward(float* dqkv, const float* dout, const float* lse, const float* delta, const float* qkv,
                     const Dims& d, cudaStream_t s) {
  const size_t shared = backward_shared(T, d.D);
  static int opted[kMaxDevices];  // (zero: static storage)
  opt_in_shared(flash_backward<T>, static_cast<int>(shared), opted);
  const dim3 grid(static_cast<unsigned>((d.S + T - 1) / T), static_cast<unsigned>(d.A), static_cast<unsigned>(d.B));
  STRATA_LAUNCH(flash_backward<T>, grid, kThreads, shared, s)(dqkv, dout, lse, delta, qkv, d,
                                                               1.0f / sqrtf(static_cast<float>(d.D)));
  CUDA_CHECK_LAUNCH();
}

void check_dims(int64_t B, int64_t A, int64_t G, int64_t D) {
  if (D < 1 || D > kFlashMaxHeadDim || G < 1 || A % G != 0 || A > 65535 || B > 65535)
    fail("flash attention", __FILE__, __LINE__,
         "needs 1 <= head dim <= " + std::to_string(kFlashMaxHeadDim) +
             ", heads divisible by groups, at most 65535 heads and micro-batch rows (grid y, z) (D=" +
             std::to_string(D) + ", A=" + std::to_string(A) + ", G=" + std::to_string(G) + ", B=" + std::to_string(B) +
             ")");
}

// A 16-bit qkv of another kind than the kernels' (or for the fp32 kernels) is refused.
void check_qkv_kind(int qkv_kind, int kind) {
  if (qkv_kind != 0 && qkv_kind != kind)
    fail("flash attention", __FILE__, __LINE__,
         "qkv in 16-bit storage of kind " + std::to_string(qkv_kind) + " for kernels of kind " + std::to_string(kind) +
             " (the tensor-core kernels read their own type; the fp32 ones floats)");
}

}  // namespace

void flash_attention_forward(float* out, float* lse, const void* qkv, int qkv_kind, int64_t S, int64_t B, int64_t A,
                             int64_t G, int64_t D, int kind, cudaStream_t s) {
  if (S == 0 || B == 0 || A == 0) return;
  check_dims(B, A, G, D);
  check_qkv_kind(qkv_kind, kind);
  if (kind != 0) return flash_attention_forward_tc(out, lse, qkv, qkv_kind != 0, S, B, A, G, D, kind, s);
  const Dims d{S, B, A, G, D};
  if (D <= 64) launch_forward<32>(out, lse, static_cast<const float*>(qkv), d, s);
  else launch_forward<16>(out, lse, static_cast<const float*>(qkv), d, s);
}

void flash_attention_forward(float* out, float* lse, const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G,
                             int64_t D, int kind, cudaStream_t s) {
  flash_attention_forward(out, lse, qkv, 0, S, B, A, G, D, kind, s);
}

void flash_attention_backward(float* dqkv, float* delta, const float* dout, const void* out, int out_kind,
                              const float* lse, const void* qkv, int qkv_kind, int64_t S, int64_t B, int64_t A,
                              int64_t G, int64_t D, int kind, cudaStream_t s) {
  const size_t dqkv_bytes = sizeof(float) * static_cast<size_t>(S * B * (A + 2 * G) * D);
  if (dqkv_bytes > 0) CUDA_CHECK(cudaMemsetAsync(dqkv, 0, dqkv_bytes, s));  // overwritten, whatever the shape
  if (S == 0 || B == 0 || A == 0) return;
  check_dims(B, A, G, D);
  check_qkv_kind(qkv_kind, kind);
  const Dims d{S, B, A, G, D};
  const long long warps = S * B * A;
  STRATA_LAUNCH(flash_delta, blocks_for(warps * 32, 256), 256, 0, s)(delta, dout, out, out_kind, d);
  CUDA_CHECK_LAUNCH();
  if (kind != 0)
    return flash_attention_backward_tc(dqkv, delta, dout, lse, qkv, qkv_kind != 0, S, B, A, G, D, kind, s);
  if (D <= 64) launch_backward<32>(dqkv, dout, lse, delta, static_cast<const float*>(qkv), d, s);
  else launch_backward<16>(dqkv, dout, lse, delta, static_cast<const float*>(qkv), d, s);
}

void flash_attention_backward(float* dqkv, float* delta, const float* dout, const float* out, const float* lse,
                              const float* qkv, int64_t S, int64_t B, int64_t A, int64_t G, int64_t D, int kind,
                              cudaStream_t s) {
  flash_attention_backward(dqkv, delta, dout, out, 0, lse, qkv, 0, S, B, A, G, D, kind, s);
}

}  // namespace strata::cuda
