// The safetensors header parser (safetensors_header.hpp): every number the file gives is checked before anyone
// allocates or reads by it.
#include "io/safetensors_header.hpp"

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

namespace rlloop::engine {
namespace {

using nlohmann::json;

// The header JSON of real files is a few hundred KB at most; anything huge is a corrupt length field.
constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;

struct DTypeSize {
  std::string_view name;
  std::size_t bytes;
};
constexpr DTypeSize kDTypeSizes[] = {
    {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
    {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1},
};

}  // namespace

std::size_t safetensors_element_size(std::string_view dtype) {
  for (const auto& d : kDTypeSizes)
    if (dtype == d.name) return d.bytes;
  return 0;
}

void check_safetensors_header_length(std::uint64_t header_length, std::uint64_t file_size, const std::string& path) {
  if (file_size < 8)
    throw io_error("read_safetensors: " + path + " is truncated (" + std::to_string(file_size) +
                   " bytes, shorter than the 8-byte header length)");
  if (header_length > kMaxHeaderBytes || header_length > file_size - 8)
    throw io_error("read_safetensors: " + path + " has a malformed or truncated header (header length " +
                   std::to_string(header_length) + ", file size " + std::to_string(file_size) + ")");
}

SafetensorsHeader parse_safetensors_header(const std::string& header_text, std::uint64_t file_size,
                                           const std::string& path) {
  check_safetensors_header_length(header_text.size(), file_size, path);
  json header;
  try {
    header = json::parse(header_text);
  } catch (const json::exception& e) {
    throw io_error("read_safetensors: " + path + " has a malformed header (invalid JSON: " + e.what() + ")");
  }
  if (!header.is_object()) throw io_error("read_safetensors: " + path + " has a malformed header (not a JSON object)");

  SafetensorsHeader out;
  out.data_start = 8 + header_text.size();
  const std::uint64_t data_size = file_size - out.data_start;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    auto bad = [&](const std::string& why) {
      return io_error("read_safetensors: " + path + " has a malformed header entry for tensor '" + name + "': " + why);
    };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      throw bad("expected an object with dtype, shape and data_offsets");
    const auto& dt = entry["dtype"];
    const auto& shape_j = entry["shape"];
    const auto& offs = entry["data_offsets"];
    if (!dt.is_string() || !shape_j.is_array() || !offs.is_array() || offs.size() != 2 ||
        !offs[0].is_number_unsigned() || !offs[1].is_number_unsigned())
      throw bad("dtype must be a string, shape an array, data_offsets two non-negative integers");
    SafetensorsEntry t{.name = name, .dtype = dt.get<std::string>()};
    const std::size_t element_size = safetensors_element_size(t.dtype);
    if (element_size == 0)
      throw io_error("read_safetensors: " + path + ": tensor '" + name + "' has unsupported dtype '" + t.dtype + "'");
    // The byte count as the product goes: a shape whose product wraps 64 bits (2^32 x 2^32 is 0) would otherwise
    // pass as an empty tensor and reach the allocator with its real, impossible size.
    std::uint64_t nbytes = element_size;
    for (const auto& d : shape_j) {
      if (!d.is_number_unsigned()) throw bad("shape entries must be non-negative integers");
      const auto n = d.get<std::uint64_t>();
      if (n > static_cast<std::uint64_t>(INT64_MAX) || (n != 0 && nbytes > UINT64_MAX / n))
        throw bad("the shape's elements overflow a 64-bit byte count");
      nbytes *= n;
      t.shape.push_back(static_cast<std::int64_t>(n));
    }
    t.begin = offs[0].get<std::uint64_t>();
    t.end = offs[1].get<std::uint64_t>();
    if (t.end < t.begin) throw bad("data_offsets end before they begin");
    if (t.end - t.begin != nbytes)
      throw bad("data_offsets span " + std::to_string(t.end - t.begin) + " bytes, dtype and shape need " +
                std::to_string(nbytes));
    if (t.end > data_size)
      throw io_error("read_safetensors: " + path + " is truncated: tensor '" + name + "' ends at byte " +
                     std::to_string(out.data_start + t.end) + " of a " + std::to_string(file_size) + "-byte file");
    out.tensors.push_back(std::move(t));
  }
  return out;
}

}  // namespace rlloop::engine
