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
namespace {

// An input's first n values as floats: its own where it holds floats, else unpacked into
// `keep` (this backend's untracked pool, freed with it).
struct Unpacked {
  Backend* be;
  float* p = nullptr;
  ~Unpacked() {
    if (p) be->deallocate(p);
  }
};
const float* as_floats(Backend* be, const Operand& x, int64_t n, Unpacked* keep) {
  if (!x.is_16bit()) return static_cast<const float*>(x.p);
  if (n <= 0) return nullptr;
  keep->p = be->allocate_uninitialised_in(n, kMemPools - 1);
  be->unpack16(keep->p, static_cast<const uint16_t*>(x.p), n, x.type);
  return keep->p;
}
// The values a row-major (rows x cols) operand of row stride ld spans.
int64_t span(int64_t rows, int64_t cols, int64_t ld) { return rows == 0 || cols == 0 ? 0 : (rows - 1) * ld + cols; }

}  // namespace

void Backend::gemm_mixed(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Operand A, int64_t lda,
                         Operand B, int64_t ldb, float beta, float* C, int64_t ldc) {
  Unpacked ua{this}, ub{this};
  const float* a = as_floats(this, A, span(ta ? K : M, ta ? M : K, lda), &ua);
  const float* b = as_floats(this, B, span(tb ? N : K, tb ? K : N, ldb), &ub);
  gemm(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, C, ldc);
}

void Backend::layernorm_backward_stored(float* dx, float* dw, float* db, const float* dout, Operand x,
                                        const float* mean, const float* rstd, const float* w, int64_t N, int64_t H) {
  Unpacked ux{this};
  layernorm_backward(dx, dw, db, dout, as_floats(this, x, N * H, &ux), mean, rstd, w, N, H);
}

void Backend::rmsnorm_backward_stored(float* dx, float* dw, const float* dout, Operand x, const float* rstd,
                                      const float* w, int64_t N, int64_t H) {
  Unpacked ux{this};
  rmsnorm_backward(dx, dw, dout, as_floats(this, x, N * H, &ux), rstd, w, N, H);
}

void Backend::activation_backward_stored(Activation a, float* du, const float* dout, Operand u, int64_t N, int64_t F,
                                         Precision round) {
  Unpacked uu{this};
  const int64_t width = a == Activation::gelu ? F : 2 * F;
  activation_backward(a, du, dout, as_floats(this, u, N * width, &uu), N, F, round);
}

void Backend::rope_at(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse,
                      int64_t pos0) {
  if (pos0 != 0) no_cp(*this, "rope_at with a position offset");
  rope(x, S, B, heads, D, ld, inverse);
}

}  // namespace strata
