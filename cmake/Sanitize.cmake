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
  # -O0: the build is most of this configuration's time (the tests run in under a minute), and the server's and
  # wire's JSON-heavy translation units compile in 30% less CPU time than at -O1 (wire/runtime.cpp: 17 s against
  # 24 s of user time, GCC 12). -g1 keeps the line tables, which is all a report needs, at less cost than -g.
  set(RLLOOP_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
  add_compile_options(${RLLOOP_SANITIZE_FLAGS} -O0 -g1)
  add_link_options(${RLLOOP_SANITIZE_FLAGS})
  # GCC's manual: sanitizers raise the rate of false -Wmaybe-uninitialized warnings (GCC 12 reports libstdc++'s
  # own std::function inside <regex> here). The main build checks the warnings; this one checks memory.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    add_compile_options(-Wno-maybe-uninitialized)
  endif()
endif()
