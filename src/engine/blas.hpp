// Row-major GEMM straight on BLAS (libblas.so.3: OpenBLAS through Debian's alternatives, the library LibTorch
// itself calls), for kernels that run many small products where an ATen dispatch per product would cost more
// than the arithmetic.
//
// Built with RLLOOP_NO_BLAS (CMake found no libblas, e.g. a pip LibTorch that bundles its own), the same
// function runs through ATen: slower for tiny products, same results up to rounding.
#pragma once
#include <cstdint>
#include <type_traits>

#ifdef RLLOOP_NO_BLAS
#include <torch/torch.h>
#else
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}
#endif

namespace rlloop::engine::blas {

// C[M, N] = alpha * op(A)[M, K] * op(B)[K, N] + beta * C, all row-major with leading dimensions in elements.
// A row-major matrix is its transpose in column-major order, so this is BLAS's C^T = op(B)^T op(A)^T.
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
#ifdef RLLOOP_NO_BLAS
  const auto opts = torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto matrix = [&](const T* p, std::int64_t rows, std::int64_t cols, std::int64_t ld, bool trans) {
    auto m = torch::from_blob(const_cast<T*>(p), {trans ? cols : rows, trans ? rows : cols}, {ld, 1}, opts);
    return trans ? m.t() : m;
  };
  auto product = torch::mm(matrix(A, M, K, lda, trans_a), matrix(B, K, N, ldb, trans_b)).mul_(alpha);
  auto c = torch::from_blob(C, {M, N}, {ldc, 1}, opts);
  if (beta == T(0))
    c.copy_(product);
  else
    c.mul_(beta).add_(product);
#else
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>)
    sgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
  else
    dgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
#endif
}

}  // namespace rlloop::engine::blas
