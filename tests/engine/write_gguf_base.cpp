// write_gguf_base FILE [TYPE]: the GGUF tests' tiny base (tiny_gguf_base.hpp: a small Llama with random weights and
// a byte-level BPE vocabulary of 300) with its matrices as TYPE (Q8_0 by default; F32, F16, BF16), vectors F32: a
// quantized base for the command-line tests (`rlloop sample --sampling-precision int8` over it: int8_cli_test.sh).
#include <cstdio>
#include <exception>

#include "io/gguf_export.hpp"
#include "tiny_gguf_base.hpp"

using namespace rlloop;

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: write_gguf_base FILE [Q8_0|F32|F16|BF16]\n");
    return 2;
  }
  try {
    test_gguf::save_tiny_base(argv[1], engine::gguf_export_type(argc == 3 ? argv[2] : "Q8_0"));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "write_gguf_base: %s\n", e.what());
    return 1;
  }
  return 0;
}
