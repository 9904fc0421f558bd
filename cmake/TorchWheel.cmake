# LibTorch from PyTorch's PyPI wheel (site-packages/torch), the LibTorch of the GPU machines, instead of Debian's
# 1.13: cmake -DRLLOOP_TORCH_WHEEL=<site-packages>/torch (scripts/build_torch2.sh).
#
# The wheel is a CUDA build, and its CMake config asks for a CUDA toolkit (nvcc) to enable the CUDA language, which
# rlloop does not use: it compiles no CUDA code, it only links LibTorch's CUDA libraries. So the target the config
# would build from the toolkit, torch::cudart, is defined here from the wheel's own CUDA runtime (the nvidia-*
# wheels beside it); the config then skips the toolkit (public/cuda.cmake returns when torch::cudart exists). The
# resulting build runs on machines without a GPU (torch::cuda::is_available() is false there) and on the GPU
# machines. Its libraries are named explicitly: find_library would otherwise take Debian's libc10.so (1.13) from
# the system paths before the wheel's.
set(RLLOOP_TORCH_WHEEL "" CACHE PATH
    "site-packages/torch of a PyTorch 2.x wheel to build against (empty: the system's LibTorch)")
set(_rlloop_torch_cache Torch_DIR Caffe2_DIR TORCH_LIBRARY c10_LIBRARY C10_CUDA_LIBRARY kineto_LIBRARY)
if(NOT RLLOOP_TORCH_WHEEL)
  # A build directory configured with a wheel before: forget where its LibTorch was.
  foreach(var ${_rlloop_torch_cache})
    if("${${var}}" MATCHES "site-packages/torch")
      unset(${var} CACHE)
    endif()
  endforeach()
  return()
endif()
if(NOT EXISTS "${RLLOOP_TORCH_WHEEL}/share/cmake/Torch/TorchConfig.cmake")
  message(FATAL_ERROR "RLLOOP_TORCH_WHEEL=${RLLOOP_TORCH_WHEEL} holds no share/cmake/Torch/TorchConfig.cmake")
endif()
get_filename_component(_rlloop_site "${RLLOOP_TORCH_WHEEL}/.." ABSOLUTE)
set(Torch_DIR "${RLLOOP_TORCH_WHEEL}/share/cmake/Torch" CACHE PATH "" FORCE)
set(Caffe2_DIR "${RLLOOP_TORCH_WHEEL}/share/cmake/Caffe2" CACHE PATH "" FORCE)
set(TORCH_LIBRARY "${RLLOOP_TORCH_WHEEL}/lib/libtorch.so" CACHE FILEPATH "" FORCE)
set(c10_LIBRARY "${RLLOOP_TORCH_WHEEL}/lib/libc10.so" CACHE FILEPATH "" FORCE)
# Kineto (the profiler) is linked into libtorch_cpu in the wheel; naming that library quiets the config's warning.
set(kineto_LIBRARY "${RLLOOP_TORCH_WHEEL}/lib/libtorch_cpu.so" CACHE FILEPATH "" FORCE)
if(EXISTS "${RLLOOP_TORCH_WHEEL}/lib/libtorch_cuda.so")
  file(GLOB _rlloop_cudart "${_rlloop_site}/nvidia/*/lib/libcudart.so*")
  if(NOT _rlloop_cudart)
    message(FATAL_ERROR "RLLOOP_TORCH_WHEEL: a CUDA build of torch, but no nvidia/*/lib/libcudart.so* beside it")
  endif()
  list(GET _rlloop_cudart 0 _rlloop_cudart)
  set(C10_CUDA_LIBRARY "${RLLOOP_TORCH_WHEEL}/lib/libc10_cuda.so" CACHE FILEPATH "" FORCE)
  # The CUDA runtime's and NCCL's headers (c10d's NCCL process group includes nccl.h). The runtime wheel lacks
  # crt/host_config.h, which cuda_runtime.h includes; triton's wheel (a dependency of torch's) carries it.
  file(GLOB _rlloop_cuda_includes LIST_DIRECTORIES true "${_rlloop_site}/nvidia/*/include")
  if(EXISTS "${_rlloop_site}/triton/backends/nvidia/include/crt")
    list(APPEND _rlloop_cuda_includes "${_rlloop_site}/triton/backends/nvidia/include")
  endif()
  add_library(torch::cudart INTERFACE IMPORTED)
  set_target_properties(torch::cudart PROPERTIES INTERFACE_LINK_LIBRARIES "${_rlloop_cudart}"
                                                 INTERFACE_INCLUDE_DIRECTORIES "${_rlloop_cuda_includes}")
endif()
# The wheel's libtorch.so (2.11) exports 64 std::filesystem functions of its own, statically linked from its
# toolchain's libstdc++; a program that loads libtorch.so before libstdc++.so binds its own std::filesystem calls to
# those, and remove_all(path, error_code&) there jumps to address 0 (a crash in every checkpoint save). Naming
# libstdc++ first on every link line puts it first in the dynamic linker's search order, so std:: symbols come from
# the real one.
add_link_options("LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
set(RLLOOP_TORCH_FROM_WHEEL ON)
message(STATUS "rlloop: LibTorch from the wheel at ${RLLOOP_TORCH_WHEEL}")
