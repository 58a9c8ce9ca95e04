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
// n uninitialised floats, held by `keep` as an unpacked input is.
float* scratch(Backend* be, int64_t n, Unpacked* keep) {
  if (n > 0) keep->p = be->allocate_uninitialised_in(n, kMemPools - 1);
  return keep->p;
}
int64_t activation_width(Activation a, int64_t F) { return gated(a) ? 2 * F : F; }
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
  activation_backward(a, du, dout, as_floats(this, u, N * activation_width(a, F), &uu), N, F, round);
}

void Backend::layernorm_forward_packed(uint16_t* out, float* mean, float* rstd, const float* x, const float* w,
                                       const float* b, int64_t N, int64_t H, Precision p) {
  Unpacked y{this};
  layernorm_forward(scratch(this, N * H, &y), mean, rstd, x, w, b, N, H, p);
  pack16(out, y.p, N * H, p);
}

void Backend::rmsnorm_forward_packed(uint16_t* out, float* rstd, const float* x, const float* w, int64_t N, int64_t H,
                                     Precision p) {
  Unpacked y{this};
  rmsnorm_forward(scratch(this, N * H, &y), rstd, x, w, N, H, p);
  pack16(out, y.p, N * H, p);
}

void Backend::activation_forward_packed(Activation a, uint16_t* out, uint16_t* u16, const float* u, int64_t N,
                                        int64_t F, Precision p) {
  Unpacked y{this};
  activation_forward(a, scratch(this, N * F, &y), u, N, F, p);
  pack16(out, y.p, N * F, p);
  if (u16) pack16(u16, u, N * activation_width(a, F), p);
}

void Backend::activation_backward_packed(Activation a, uint16_t* du, const float* dout, Operand u, int64_t N,
                                         int64_t F, Precision p) {
  const int64_t n = N * activation_width(a, F);
  Unpacked d{this};
  activation_backward_stored(a, scratch(this, n, &d), dout, u, N, F, p);
  pack16(du, d.p, n, p);
}

void Backend::cross_entropy_forward(float* mx, float* st, const float* z, const int32_t* targets, int64_t N, int64_t Vt,
                                    int64_t lo) {
  cross_entropy_max(mx, z, N, Vt);
  cross_entropy_exp_sum(st, z, mx, targets, N, Vt, lo);
}

void Backend::cross_entropy_rescale(float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t) {
  throw std::logic_error("Backend::cross_entropy_rescale: only a backend whose cross_entropy_one_pass() is true has it");
}

void Backend::cross_entropy_backward_packed(uint16_t* dz, float* z, const float* mx, const float* st,
                                            const int32_t* targets, int64_t N, int64_t Vt, int64_t lo, float scale,
                                            Precision p) {
  cross_entropy_backward(z, mx, st, targets, N, Vt, lo, scale, p);
  pack16(dz, z, N * Vt, p);
}

void Backend::bias_grad_stored(float* db, Operand dy, int64_t N, int64_t F) {
  Unpacked ud{this};
  bias_grad(db, as_floats(this, dy, N * F, &ud), N, F);
}

void Backend::flash_attention_forward_stored(float* out, float* lse, Operand qkv, int64_t S, int64_t B, int64_t A,
                                             int64_t G, int64_t D) {
  Unpacked uq{this};
  flash_attention_forward(out, lse, as_floats(this, qkv, S * B * (A + 2 * G) * D, &uq), S, B, A, G, D);
}

void Backend::flash_attention_backward_stored(float* dqkv, const float* dout, Operand out, const float* lse,
                                              Operand qkv, int64_t S, int64_t B, int64_t A, int64_t G, int64_t D) {
  Unpacked uo{this}, uq{this};
  flash_attention_backward(dqkv, dout, as_floats(this, out, S * B * A * D, &uo), lse,
                           as_floats(this, qkv, S * B * (A + 2 * G) * D, &uq), S, B, A, G, D);
}

void Backend::rope_at(float* x, int64_t S, int64_t B, int64_t heads, int64_t D, int64_t ld, bool inverse,
                      int64_t pos0) {
  if (pos0 != 0) no_cp(*this, "rope_at with a position offset");
  rope(x, S, B, heads, D, ld, inverse);
}

}  // namespace strata
