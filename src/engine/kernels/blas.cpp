#include "kernels/blas.hpp"

#include <dlfcn.h>

namespace rlloop::engine::blas {

const Routines* routines() {
  static const Routines* const loaded = []() -> const Routines* {
    // Debian's libblas.so.3 is OpenBLAS through its alternatives, the library its LibTorch calls too.
    void* lib = dlopen("libblas.so.3", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return nullptr;
    auto sgemm = reinterpret_cast<SgemmFn>(dlsym(lib, "sgemm_"));
    auto dgemm = reinterpret_cast<DgemmFn>(dlsym(lib, "dgemm_"));
    if (!sgemm || !dgemm) return nullptr;
    return new Routines{sgemm, dgemm};  // for the process's lifetime
  }();
  return loaded;
}

}  // namespace rlloop::engine::blas
