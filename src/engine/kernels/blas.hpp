// Row-major GEMM straight on BLAS (libblas.so.3: OpenBLAS through Debian's alternatives, the library LibTorch
// itself calls), for kernels that run many small products where an ATen dispatch per product would cost more
// than the arithmetic.
//
// Without a libblas.so.3 the same function runs through ATen: slower for tiny products, same results up to
// rounding.
#pragma once
#include <cstdint>
#include <type_traits>

#include <torch/torch.h>

namespace rlloop::engine::blas {

using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);
using DgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
                         const int*, const double*, const int*, const double*, double*, const int*);
struct Routines {
  SgemmFn sgemm;
  DgemmFn dgemm;
};

// libblas.so.3's sgemm_ / dgemm_, opened once (dlopen, RTLD_LOCAL) rather than linked: PyTorch's PyPI wheel
// exports MKL's sgemm_ from libtorch_cpu, which a linked sgemm_ binds to first, and MKL's results for a product
// depend on its shape's blocking and its threads, which breaks the kernels' batch invariance (a row's product the
// same alone or in a group). Null when no libblas.so.3 opens: gemm then runs through ATen.
const Routines* routines();

// C[M, N] = alpha * op(A)[M, K] * op(B)[K, N] + beta * C, all row-major with leading dimensions in elements.
// A row-major matrix is its transpose in column-major order, so this is BLAS's C^T = op(B)^T op(A)^T.
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  if (const Routines* r = routines()) {
    const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    if constexpr (std::is_same_v<T, float>)
      r->sgemm(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    else
      r->dgemm(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    return;
  }
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
}

}  // namespace rlloop::engine::blas
