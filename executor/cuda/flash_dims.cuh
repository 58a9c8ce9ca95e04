// The index arithmetic of the fused attention kernels (flash_attention.cu in fp32,
// flash_attention_tc.cu on the tensor cores), for backend.h's layouts: qkv (S, B, (A + 2G) D)
// = query heads, key groups, value groups, row s B + b; out and dout (S, B, A D); lse and
// delta (B, A, S). Head h reads group h / (A / G).
#pragma once

namespace strata::cuda {

struct FlashDims {
  long long S, B, A, G, D;
  // The tensor-core kernels' qkv in 16-bit storage of their own type (pack16's layout), not
  // floats (flash_attention_tc.cuh load16).
  bool qkv16 = false;
  __device__ long long ld() const { return (A + 2 * G) * D; }
  __device__ long long q_off(long long h) const { return h * D; }
  __device__ long long k_off(long long h) const { return (A + h / (A / G)) * D; }
  __device__ long long v_off(long long h) const { return (A + G + h / (A / G)) * D; }
  // Row of (position s, micro-batch row b) in the (S, B, ...) layouts.
  __device__ long long row(long long s, long long b) const { return s * B + b; }
  __device__ long long stat(long long b, long long h, long long s) const { return (b * A + h) * S + s; }
};

}  // namespace strata::cuda
