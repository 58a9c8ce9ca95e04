// The rounding of round_to (round.cu), for kernels that round what they write in the same
// pass: bf16 by the CPU backend's integer rounding (NaN and inf kept bit for bit), fp16 by
// the hardware conversion with NaN kept as it is (as on the CPU). kind: 1 bf16, 2 fp16,
// anything else leaves the value.
#pragma once

#include <cuda_fp16.h>

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

}  // namespace strata::cuda
