// Eigen's GEMM behind cpu_gemm.h (see there for why it is a file of its own).
#include "executor/cpu/cpu_gemm.h"

#include <Eigen/Dense>

namespace strata {

void cpu_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
  using MMap = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
  if (M <= 0 || N <= 0) return;
  MMap c(C, M, N, Eigen::OuterStride<>(ldc));
  if (beta == 0.0f) c.setZero();
  else if (beta != 1.0f) c *= beta;
  if (K <= 0) return;
  CMap a(A, ta ? K : M, ta ? M : K, Eigen::OuterStride<>(lda));
  CMap b(B, tb ? N : K, tb ? K : N, Eigen::OuterStride<>(ldb));
  if (!ta && !tb) c.noalias() += alpha * (a * b);
  else if (!ta && tb) c.noalias() += alpha * (a * b.transpose());
  else if (ta && !tb) c.noalias() += alpha * (a.transpose() * b);
  else c.noalias() += alpha * (a.transpose() * b.transpose());
}

}  // namespace strata
