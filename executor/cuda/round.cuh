// The rounding of round_to (round.cu), for kernels that round what they write in the same
// pass: bf16 by the CPU backend's integer rounding (NaN and inf kept bit for bit), fp16 by
// the hardware conversion with NaN kept as it is (as on the CPU). kind: 1 bf16, 2 fp16,
// anything else leaves the value. And from_float, a float as a 16-bit tensor-core operand;
// pack_value and store_value, a value written in 16-bit storage as pack16 writes it;
// load_stored, a kept input's value in either storage.
#pragma once

#ifndef STRATA_CUDA_EMULATION  // (tests/cuda_emulation.h: the kernels on the CPU, fp16 as _Float16)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace strata::cuda {

__device__ __forceinline__ float round_value(float v, int kind) {
  if (kind == 1) {
    unsigned u = __float_as_uint(v);
    if ((u & 0x7f800000u) != 0x7f800000u) {
      u += 0x7fffu + ((u >> 16) & 1u);
      u &= 0xffff0000u;
    }
    return __uint_as_float(u);
  }
  if (kind == 2 && !isnan(v)) return __half2float(__float2half_rn(v));
  return v;
}

// A float as a 16-bit operand of the tensor cores (the GEMM casts, the tensor-core flash
// attention), round to nearest even.
template <typename T>
__device__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// A float as pack16 stores it (pack16.cu): kind 2 fp16 (a NaN as the quiet NaN of its sign,
// as on the CPU), else bf16 by round_value's rounding (a NaN stays a NaN when its payload is
// in the low half only). Storing a value round_value rounded gives the same pattern.
__device__ __forceinline__ unsigned short pack_value(float v, int kind) {
  if (kind == 2)
    return isnan(v) ? static_cast<unsigned short>(((__float_as_uint(v) >> 16) & 0x8000u) | 0x7e00u)
                    : __half_as_ushort(__float2half_rn(v));
  unsigned u = __float_as_uint(v);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16) | (isnan(v) ? 0x0040u : 0u);
}

// Value i of an output in either storage: kind 0 a float rounded to `round` (round_value),
// 1 bf16 or 2 fp16 as pack16 stores them (rounding so).
__device__ __forceinline__ void store_value(void* p, long long i, float v, int kind, int round) {
  if (kind == 0) static_cast<float*>(p)[i] = round_value(v, round);
  else static_cast<unsigned short*>(p)[i] = pack_value(v, kind);
}

// Value i of an input in either storage (backend.h's Operand): kind 0 floats, 1 bf16 and 2
// fp16 as pack16 stores them (pack16.cu's unpacking, exactly).
__device__ __forceinline__ float load_stored(const void* p, long long i, int kind) {
  if (kind == 0) return static_cast<const float*>(p)[i];
  const unsigned short b = static_cast<const unsigned short*>(p)[i];
  return kind == 2 ? __half2float(__ushort_as_half(b)) : __uint_as_float(static_cast<unsigned>(b) << 16);
}

}  // namespace strata::cuda
