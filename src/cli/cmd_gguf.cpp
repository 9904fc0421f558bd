// `rlloop gguf FILE`: what a GGUF file holds, as rlloop reads it: its version and alignment, every metadata key
// with its type and value (long strings and arrays abbreviated), and its tensors counted by type; --tensors lists
// each tensor, --check dequantizes every one (the whole file read as a model load would read it).
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include <CLI/CLI.hpp>
#include <rlloop/gguf.hpp>

#include "command.hpp"

namespace {

using namespace rlloop;

// A value on one line: scalars in full, strings up to 60 characters, arrays by length and element type.
std::string brief(const gguf::Value& value) {
  return std::visit(
      [&](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, gguf::Array>) {
          if (x.empty()) return "[]";
          return "[" + std::to_string(x.size()) + " x " + gguf::type_name(x.front()) + "]";
        } else if constexpr (std::is_same_v<T, std::string>) {
          std::string s = x.size() > 60 ? x.substr(0, 60) + "... (" + std::to_string(x.size()) + " bytes)" : x;
          for (char& c : s)
            if (c == '\n') c = ' ';
          return "\"" + s + "\"";
        } else if constexpr (std::is_same_v<T, bool>) {
          return x ? "true" : "false";
        } else if constexpr (std::is_floating_point_v<T>) {
          char buf[32];
          std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(x));
          return buf;
        } else {
          return std::to_string(x);
        }
      },
      value.v);
}

std::string shape_of(const gguf::TensorInfo& t) {
  std::string s;
  for (auto d : t.shape) s += (s.empty() ? "" : " x ") + std::to_string(d);
  return s;
}

int run(int argc, char** argv) {
  CLI::App app{"Show what a GGUF file (llama.cpp's model format) holds"};
  std::string path;
  bool tensors = false, check = false;
  app.add_option("file", path, "the .gguf file")->required();
  app.add_flag("--tensors", tensors, "list every tensor: name, type, shape (ggml's order, fastest first), bytes");
  app.add_flag("--check", check, "dequantize every tensor to fp32 and report non-finite values");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const auto file = gguf::File::open(path);
  std::printf("%s: GGUF version %u, alignment %llu, %zu metadata keys, %zu tensors\n", path.c_str(), file.version(),
              static_cast<unsigned long long>(file.alignment()), file.metadata().size(), file.tensors().size());
  for (const auto& [key, value] : file.metadata())
    std::printf("  %-44s %-8s %s\n", key.c_str(), gguf::type_name(value).c_str(), brief(value).c_str());
  std::map<std::string, std::pair<int, std::uint64_t>> by_type;
  std::int64_t values = 0;
  for (const auto& t : file.tensors()) {
    auto& [count, bytes] = by_type[gguf::to_string(t.type)];
    ++count;
    bytes += t.bytes();
    values += t.elements();
  }
  std::printf("tensors: %lld values", static_cast<long long>(values));
  for (const auto& [type, cb] : by_type)
    std::printf(", %d %s (%.1f MiB)", cb.first, type.c_str(), static_cast<double>(cb.second) / (1 << 20));
  std::printf("\n");
  if (tensors)
    for (const auto& t : file.tensors())
      std::printf("  %-40s %-5s %-20s %llu bytes\n", t.name.c_str(), gguf::to_string(t.type).c_str(),
                  shape_of(t).c_str(), static_cast<unsigned long long>(t.bytes()));
  if (check) {
    std::int64_t non_finite = 0;
    for (const auto& t : file.tensors())
      for (float v : file.dequantize(t)) non_finite += !std::isfinite(v);
    std::printf("dequantized every tensor: %lld non-finite values\n", static_cast<long long>(non_finite));
    if (non_finite > 0) return 1;
  }
  return 0;
}

const rlloop::cli::RegisterCommand reg{{"gguf", "show a GGUF file's metadata and tensors (--tensors, --check)", run}};

}  // namespace
