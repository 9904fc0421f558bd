// gguf_dump FILE: what rlloop reads from a GGUF file, as JSON on stdout, for gguf_reference_test.py to compare with
// what gguf-py wrote: the version, alignment, every metadata value (integers as numbers, floats as numbers,
// strings, nested arrays), and every tensor's name, type, shape and dequantized values as float32 bit patterns.
// An error is one line on stderr and exit status 1.
//
// gguf_dump --rewrite IN OUT TYPE: reads IN and writes it again with rlloop's writer as OUT: the same metadata and
// alignment, every F32 tensor stored as TYPE (F32, F16, BF16, Q8_0, Q4_K or Q6_K; kept F32 where its rows are not
// whole blocks of TYPE), every other tensor's bytes as they are. gguf_reference_test.py and
// kquant_reference_test.py read OUT with gguf-py.
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

gguf::TensorType type_named(const std::string& name) {
  for (auto t : {gguf::TensorType::f32, gguf::TensorType::f16, gguf::TensorType::bf16, gguf::TensorType::q8_0,
                 gguf::TensorType::q4_k, gguf::TensorType::q6_k})
    if (gguf::to_string(t) == name) return t;
  throw rlloop::invalid_argument("--rewrite: unknown type '" + name + "' (F32, F16, BF16, Q8_0, Q4_K, Q6_K)");
}

void rewrite(const std::string& in, const std::string& out, gguf::TensorType type) {
  const auto file = gguf::File::open(in);
  std::vector<gguf::TensorData> tensors;
  for (const auto& t : file.tensors()) {
    const auto bytes = file.bytes(t);
    gguf::TensorData d{t.name, t.shape, t.type, {bytes.begin(), bytes.end()}};
    if (t.type == gguf::TensorType::f32 && t.shape[0] % gguf::block_layout(type)->elements == 0) {
      d.type = type;
      d.bytes = gguf::quantize(type, file.dequantize(t));
    }
    tensors.push_back(std::move(d));
  }
  gguf::write(out, file.metadata(), tensors, static_cast<std::uint32_t>(file.alignment()));
}
}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--rewrite") {
    try {
      rewrite(argv[2], argv[3], type_named(argv[4]));
      return 0;
    } catch (const rlloop::error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: gguf_dump FILE | gguf_dump --rewrite IN OUT TYPE\n");
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
