// The defaults of Backend's optional ops: backends without context-parallel attention
// say so (the engine refuses cp > 1 on them before any of these is reached).
#include "executor/backend.h"

#include <stdexcept>
#include <string>

namespace strata {
namespace {

[[noreturn]] void no_cp(const Backend& be, const char* op) {
  throw std::logic_error(std::string("the ") + be.name() + " backend has no " + op +
                         " (context parallelism runs on the CPU backend)");
}

}  // namespace

void Backend::attention_forward_cp(float*, float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, int64_t, int64_t) {
  no_cp(*this, "attention_forward_cp");
}
void Backend::attention_backward_cp(float*, int64_t, float*, int64_t, const float*, const float*, int64_t,
                                    const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                    int64_t) {
  no_cp(*this, "attention_backward_cp");
}
void Backend::flash_attention_forward_cp(float*, float*, const float*, int64_t, const float*, int64_t, int64_t,
                                         int64_t, int64_t, int64_t, int64_t, int64_t) {
  no_cp(*this, "flash_attention_forward_cp");
}
void Backend::flash_attention_backward_cp(float*, int64_t, float*, int64_t, const float*, const float*, const float*,
                                          const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          int64_t) {
  no_cp(*this, "flash_attention_backward_cp");
}
void Backend::gemm_mixed(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, GemmOperand A, int64_t lda,
                         GemmOperand B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // A 16-bit operand's rows as floats: (rows - 1) * ld + cols values from its start.
  struct Unpacked {
    Backend* be;
    float* p = nullptr;
    ~Unpacked() {
      if (p) be->deallocate(p);
    }
  };
  auto as_floats = [&](const GemmOperand& x, int64_t rows, int64_t cols, int64_t ld, Unpacked* keep) -> const float* {
    if (!x.is_16bit()) return static_cast<const float*>(x.p);
    const int64_t n = rows == 0 || cols == 0 ? 0 : (rows - 1) * ld + cols;
    if (n == 0) return nullptr;
    keep->p = allocate_uninitialised_in(n, kMemPools - 1);
    unpack16(keep->p, static_cast<const uint16_t*>(x.p), n, x.type);
    return keep->p;
  };
  Unpacked ua{this}, ub{this};
  const float* a = as_floats(A, ta ? K : M, ta ? M : K, lda, &ua);
  const float* b = as_floats(B, tb ? N : K, tb ? K : N, ldb, &ub);
  gemm(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, C, ldc);
}

void Backend::rope_at(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse,
                      int64_t pos0) {
  if (pos0 != 0) no_cp(*this, "rope_at with a position offset");
  rope(x, S, B, heads, D, ld, inverse);
}

}  // namespace strata
