// The CPU backend's one GEMM (Eigen, one core), in a file of its own so that a sanitizer
// build can compile Eigen's kernels without instrumentation (CMakeLists.txt): under
// AddressSanitizer they ran about 6x slower and were half of a training step's time. The
// caller checks the spans it hands over instead (cpu_backend.cpp, check_span), so an
// out-of-bounds or freed operand is still reported. Every Eigen product of the backend goes
// through here: a second, instrumented copy of Eigen's kernels in another file would be an
// identical template the linker may pick instead.
#pragma once

#include <cstdint>

namespace strata {

// C(M, N) = alpha * op(A) op(B) + beta * C, row-major; op(A) is (M, K), op(B) (K, N); ld* are
// row strides. beta == 0 overwrites C (NaN in C does not propagate), as BLAS does.
void cpu_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace strata
