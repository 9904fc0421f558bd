# RLLOOP_SANITIZE: every target compiled and linked with AddressSanitizer + UndefinedBehaviorSanitizer, any report
# fatal (-fno-sanitize-recover=all: a UBSan finding fails the test instead of printing a line nobody reads).
# scripts/sanitize.sh configures build-asan with it and runs the parsers' and the server's input-side tests there.
# Only without LibTorch: Debian's and PyPI's LibTorch are not instrumented, so ASan would miss their memory and
# report their containers' accesses falsely, and the engine's translation units cost minutes each under ASan.
option(RLLOOP_SANITIZE "Build with AddressSanitizer + UndefinedBehaviorSanitizer (needs RLLOOP_WITH_TORCH=OFF)" OFF)
if(RLLOOP_SANITIZE)
  if(RLLOOP_WITH_TORCH)
    message(FATAL_ERROR "RLLOOP_SANITIZE=ON needs -DRLLOOP_WITH_TORCH=OFF: LibTorch is not built with ASan "
                        "(scripts/sanitize.sh configures it so)")
  endif()
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    message(FATAL_ERROR "RLLOOP_SANITIZE=ON needs GCC or Clang (-fsanitize=address,undefined)")
  endif()
  # -O1: the sanitized tests run at a useful speed, and ASan's reports still point at the right lines (-g1 keeps
  # the line tables, which is all a report needs, at a fraction of -g's compile time).
  set(RLLOOP_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
  add_compile_options(${RLLOOP_SANITIZE_FLAGS} -O1 -g1)
  add_link_options(${RLLOOP_SANITIZE_FLAGS})
  # GCC's manual: sanitizers raise the rate of false -Wmaybe-uninitialized warnings (GCC 12 reports libstdc++'s
  # own std::function inside <regex> here). The main build checks the warnings; this one checks memory.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    add_compile_options(-Wno-maybe-uninitialized)
  endif()
endif()
