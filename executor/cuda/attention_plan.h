// The unfused causal attention as a sequence of batched GEMMs and row kernels: what the
// CUDA backend runs (cuBLASLt products, the softmax kernels of attention.cu), written once
// over an `Ops` type so that executor_test runs the same sequence on the CPU with plain
// loops and checks it against the CPU backend's attention (no GPU needed to test the
// index arithmetic). Host code only: no CUDA headers.
//
// Layouts (backend.h): qkv (S, B, (A + 2G) D) = query heads, key groups, value groups;
// out and dout (S, B, A D); probs (B, A, S, S) or null. Head h reads group g = h / R,
// R = A / G. For each micro-batch row b and each place r of a head in its group, one
// batched product runs over the groups (heads g R + r), n of them at a time so that n S x S
// matrices fit in the workspace (at least one).
//
// Ops provides, row-major as backend.h's gemm (C (M x N) = alpha op(A) op(B) + beta C):
//   void matmul(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
//               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
//               const attention_plan::Batch&);   // matrix i of each at + i * stride
//   void softmax(float* p, int64_t stride, int64_t count, int64_t S);       // causal, rows in place
//   void softmax_backward(float* d, int64_t d_stride, const float* p, int64_t p_stride,
//                         int64_t count, int64_t S, float scale);          // d = dP in, dS out
//   void zero(float* p, int64_t n);
//   float* workspace(int64_t floats);  // valid until the next call
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace strata::attention_plan {

// `count` products, matrix i of A, B and C at i * a, b, c floats from the first.
struct Batch {
  int32_t count = 1;
  int64_t a = 0, b = 0, c = 0;
};

// n groups g0 .. g0 + n - 1 of row b, heads g R + r: offsets (floats) of the first one's
// query head, key and value group (in qkv and dqkv), output (out, dout), and its index
// b A + g0 R + r among the kept probabilities' matrices.
struct Slice {
  int32_t n;
  int64_t q, k, v, o, head;
};

struct Probs {
  float* p;
  int64_t stride;  // floats between the S x S matrices of consecutive groups
};

struct Heads {
  int64_t S, B, A, G, D;
  int64_t R() const { return A / G; }
  int64_t ld() const { return (A + 2 * G) * D; }  // one (position, row) of qkv
  int64_t ld_rows() const { return B * ld(); }    // consecutive positions of one row b
  int64_t ld_out() const { return B * A * D; }
  int64_t groups_per_pass(int64_t workspace_bytes) const {
    return std::clamp<int64_t>(workspace_bytes / (S * S * static_cast<int64_t>(sizeof(float))), 1, G);
  }
  Slice slice(int64_t b, int64_t r, int64_t g0, int64_t n) const {
    const int64_t h = g0 * R() + r;
    return Slice{static_cast<int32_t>(n), b * ld() + h * D, b * ld() + (A + g0) * D, b * ld() + (A + G + g0) * D,
                 b * A * D + h * D, b * A + h};
  }
  // In the kept probabilities, else in `work` (matrices S^2 apart).
  Probs probs(float* kept, float* work, const Slice& x) const {
    return kept ? Probs{kept + x.head * S * S, R() * S * S} : Probs{work, S * S};
  }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(D)); }
};

// P_h = softmax(scale Q_h K_g^T) over the causal columns, for the heads of slice x.
template <class Ops>
void scores_and_softmax(Ops& ops, const Heads& hd, const float* qkv, const Slice& x, const Probs& P) {
  ops.matmul(false, true, hd.S, hd.S, hd.D, hd.scale(), qkv + x.q, hd.ld_rows(), qkv + x.k, hd.ld_rows(), 0.0f, P.p,
             hd.S, Batch{x.n, hd.R() * hd.D, hd.D, P.stride});
  ops.softmax(P.p, P.stride, x.n, hd.S);
}

template <class Ops>
void forward(Ops& ops, float* out, float* probs, const float* qkv, const Heads& hd, int64_t workspace_bytes) {
  const int64_t S = hd.S, D = hd.D, gc = hd.groups_per_pass(workspace_bytes);
  float* work = probs ? nullptr : ops.workspace(gc * S * S);
  for (int64_t b = 0; b < hd.B; ++b)
    for (int64_t r = 0; r < hd.R(); ++r)
      for (int64_t g0 = 0; g0 < hd.G; g0 += gc) {
        const Slice x = hd.slice(b, r, g0, std::min(gc, hd.G - g0));
        const Probs P = hd.probs(probs, work, x);
        scores_and_softmax(ops, hd, qkv, x, P);
        // out_h (S x D, rows B A D apart) = P_h V_g.
        ops.matmul(false, false, S, D, S, 1.0f, P.p, S, qkv + x.v, hd.ld_rows(), 0.0f, out + x.o, hd.ld_out(),
                   Batch{x.n, P.stride, D, hd.R() * D});
      }
}

// Overwrites dqkv. Without kept probabilities they are recomputed, slice by slice.
template <class Ops>
void backward(Ops& ops, float* dqkv, const float* dout, const float* probs, const float* qkv, const Heads& hd,
              int64_t workspace_bytes) {
  const int64_t S = hd.S, D = hd.D, SS = S * S, rows = hd.ld_rows(), RD = hd.R() * D;
  const int64_t gc = hd.groups_per_pass(workspace_bytes);
  ops.zero(dqkv, S * hd.B * hd.ld());
  // dS, then the recomputed probabilities when none were kept: gc S x S matrices each.
  float* dS = ops.workspace((probs ? 1 : 2) * gc * SS);
  float* recomputed = probs ? nullptr : dS + gc * SS;
  for (int64_t b = 0; b < hd.B; ++b)
    for (int64_t r = 0; r < hd.R(); ++r)
      for (int64_t g0 = 0; g0 < hd.G; g0 += gc) {
        const Slice x = hd.slice(b, r, g0, std::min(gc, hd.G - g0));
        const Probs P = hd.probs(const_cast<float*>(probs), recomputed, x);
        if (!probs) scores_and_softmax(ops, hd, qkv, x, P);
        // dP_h = dO_h V_g^T, then dS_h = scale P_h (dP_h - rowsum(P_h dP_h)).
        ops.matmul(false, true, S, S, D, 1.0f, dout + x.o, hd.ld_out(), qkv + x.v, rows, 0.0f, dS, S,
                   Batch{x.n, RD, D, SS});
        ops.softmax_backward(dS, SS, P.p, P.stride, x.n, S, hd.scale());
        // dV_g += P_h^T dO_h, dQ_h = dS_h K_g, dK_g += dS_h^T Q_h: each group's dK and dV sum
        // over its R heads (dqkv was zeroed: beta = 1 throughout).
        ops.matmul(true, false, S, D, S, 1.0f, P.p, S, dout + x.o, hd.ld_out(), 1.0f, dqkv + x.v, rows,
                   Batch{x.n, P.stride, RD, D});
        ops.matmul(false, false, S, D, S, 1.0f, dS, S, qkv + x.k, rows, 1.0f, dqkv + x.q, rows, Batch{x.n, SS, D, RD});
        ops.matmul(true, false, S, D, S, 1.0f, dS, S, qkv + x.q, rows, 1.0f, dqkv + x.k, rows, Batch{x.n, SS, RD, D});
      }
}

}  // namespace strata::attention_plan
