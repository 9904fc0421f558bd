// gguf_dump FILE: what rlloop reads from a GGUF file, as JSON on stdout, for gguf_reference_test.py to compare with
// what gguf-py wrote: the version, alignment, every metadata value (integers as numbers, floats as numbers,
// strings, nested arrays), and every tensor's name, type, shape and dequantized values as float32 bit patterns.
// An error is one line on stderr and exit status 1.
#include <bit>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>
#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

using namespace rlloop;

namespace {
nlohmann::json to_json(const gguf::Value& value) {
  return std::visit(
      [](const auto& x) -> nlohmann::json {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, gguf::Array>) {
          nlohmann::json a = nlohmann::json::array();
          for (const auto& e : x) a.push_back(to_json(e));
          return a;
        } else {
          return x;
        }
      },
      value.v);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: gguf_dump FILE\n");
    return 2;
  }
  try {
    const auto file = gguf::File::open(argv[1]);
    nlohmann::json out{{"version", file.version()}, {"alignment", file.alignment()}};
    for (const auto& [key, value] : file.metadata())
      out["metadata"][key] = {{"type", gguf::type_name(value)}, {"value", to_json(value)}};
    for (const auto& t : file.tensors()) {
      std::vector<std::uint32_t> bits;
      for (float v : file.dequantize(t)) bits.push_back(std::bit_cast<std::uint32_t>(v));
      out["tensors"].push_back({{"name", t.name}, {"type", gguf::to_string(t.type)}, {"shape", t.shape}, {"bits", bits}});
    }
    std::cout << out.dump() << "\n";
  } catch (const rlloop::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
