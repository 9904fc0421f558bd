// Row-major GEMM straight on BLAS (libblas.so.3: OpenBLAS through Debian's alternatives, the library LibTorch
// itself calls), for kernels that run many small products where an ATen dispatch per product would cost more
// than the arithmetic.
#pragma once
#include <cstdint>
#include <type_traits>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace rlloop::engine::blas {

// C[M, N] = alpha * op(A)[M, K] * op(B)[K, N] + beta * C, all row-major with leading dimensions in elements.
// A row-major matrix is its transpose in column-major order, so this is BLAS's C^T = op(B)^T op(A)^T.
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>)
    sgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
  else
    dgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

}  // namespace rlloop::engine::blas
