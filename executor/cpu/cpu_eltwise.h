// The CPU backend's element-wise kernels that use Eigen's vectorised exp and tanh (the
// activations, the softmax's and the cross-entropy's exponentials), in a file of their own
// for the reason cpu_gemm.h gives: a sanitizer build compiles this file without
// instrumentation (CMakeLists.txt). Under ASan + UBSan Eigen's packet exp ran 5.3x slower
// than libm's scalar one (docs/MEASUREMENTS.md), which made the cross-entropy the slowest
// op of the sanitizer tests. The backend checks the spans it hands over (check_span in
// cpu_backend.cpp), so an overflow or a freed operand is still reported. Every Eigen array
// expression of the backend lives here, and nothing else that is a template (no standard
// containers), so no instrumented copy of the same templates exists.
#pragma once

#include <cstdint>

#include "costmodel/model_spec.h"  // Activation

namespace strata {

// out(N, F) = act(u) where u is (N, F) (gelu, squared_relu), or (N, 2F) for the gated
// activations (gate, then up).
void cpu_activation_forward(Activation act, float* out, const float* u, int64_t N, int64_t F);
// du (the shape of u) = dout(N, F) * act'(u), the gated ones' two halves.
void cpu_activation_backward(Activation act, float* du, const float* dout, const float* u, int64_t N, int64_t F);
// out[j] = exp(x[j] - shift) for j < n (out may be x). Evaluated through an aligned scratch
// (Eigen peels an unaligned head with the scalar exp, so the address would decide which
// elements get which exp): the same bits for the same values wherever they lie.
void cpu_exp_shifted(float* out, const float* x, int64_t n, float shift);

}  // namespace strata
