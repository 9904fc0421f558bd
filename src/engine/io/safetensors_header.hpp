// The header of a .safetensors file, checked against the file's size: which tensors, their dtypes, shapes and byte
// ranges. No LibTorch: read_safetensors (model_io.cpp) reads the bytes this names, and the sanitized build
// (scripts/sanitize.sh) runs this parser alone on damaged files, where LibTorch cannot go.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace rlloop::engine {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;                // "F32", "BF16", ... (one safetensors_element_size knows)
  std::vector<std::int64_t> shape;  // each dimension >= 0, their product times the element size fits 64 bits
  std::uint64_t begin = 0;          // the tensor's bytes, relative to the start of the data section
  std::uint64_t end = 0;
};

struct SafetensorsHeader {
  std::uint64_t data_start = 0;           // 8 + the header's length
  std::vector<SafetensorsEntry> tensors;  // in the header's (sorted) order; __metadata__ left out
};

// Bytes per element of a safetensors dtype rlloop reads (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL); 0 for
// any other.
std::size_t safetensors_element_size(std::string_view dtype);

// Checks the 8-byte header length a file of `file_size` bytes starts with (`path` names it in errors). io_error
// when the file is shorter than 8 bytes or the length is implausible or runs past the file.
void check_safetensors_header_length(std::uint64_t header_length, std::uint64_t file_size, const std::string& path);

// Parses the header JSON that follows the length (check_safetensors_header_length passed) and checks every entry:
// a known dtype, a shape of non-negative integers whose byte count does not overflow, data_offsets spanning exactly
// that many bytes inside the file. io_error naming the file, the tensor and the fault otherwise.
SafetensorsHeader parse_safetensors_header(const std::string& header_text, std::uint64_t file_size,
                                           const std::string& path);

}  // namespace rlloop::engine
