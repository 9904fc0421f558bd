// GGUF, the model file of llama.cpp and Ollama (versions 2 and 3): the header, every metadata value, the tensor
// infos, and each tensor's bytes read in place from a read-only memory map; dequantization of ggml's block formats
// to fp32 (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K to Q6_K), value for value as ggml's
// own dequantize_row_* computes them. A malformed file is an error naming the file and what is wrong in it, found
// while opening: every later read stays inside the map. Writing: version 3 files of F32, F16, BF16, Q8_0, Q4_K and
// Q6_K tensors, written atomically.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

namespace rlloop::gguf {

// ggml's tensor types, by the numbers files store (ggml.h's enum ggml_type). Only those listed here are read.
enum class TensorType : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  bf16 = 30,
  mxfp4 = 39,  // OpenAI's microscaling FP4 (gpt-oss's experts)
};
// "Q4_K", as llama.cpp names it; "type N" for a number rlloop does not read.
std::string to_string(TensorType type);

// A type's block: this many consecutive elements are stored in this many bytes. nullopt: a type rlloop does not
// read (ggml's other quantizations).
struct BlockLayout {
  std::int64_t elements = 0;
  std::int64_t bytes = 0;
};
std::optional<BlockLayout> block_layout(TensorType type);

// A metadata value: one of GGUF's scalar types, a string, or an array (of any of them, arrays included).
struct Value;
using Array = std::vector<Value>;
struct Value {
  std::variant<std::uint8_t, std::int8_t, std::uint16_t, std::int16_t, std::uint32_t, std::int32_t, float, bool,
               std::string, Array, std::uint64_t, std::int64_t, double>
      v;
  friend bool operator==(const Value&, const Value&) = default;  // the same type and value
};
// GGUF's name of the value's type ("uint32", "string", "array", ...).
std::string type_name(const Value& value);

struct TensorInfo {
  std::string name;
  std::vector<std::int64_t> shape;  // ggml's order: shape[0] varies fastest (a [rows, cols] matrix is {cols, rows})
  TensorType type = TensorType::f32;
  std::uint64_t offset = 0;  // from the start of the data section
  std::int64_t elements() const;
  std::uint64_t bytes() const;  // elements / block elements * block bytes
};

class File {
 public:
  // Maps `path` and reads its header, metadata and tensor infos. Throws not_found (no such file), io_error (cannot
  // be read) or invalid_argument naming the path and what is wrong: not GGUF, a version other than 2 or 3, a
  // big-endian file, a truncated header, a duplicate key or tensor, a tensor type rlloop does not read, a shape
  // that is not whole blocks, data outside the file or not at the file's alignment.
  static File open(const std::string& path);

  const std::string& path() const { return path_; }
  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }  // general.alignment, 32 when absent
  const std::map<std::string, Value>& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

  // Metadata by key: null when absent.
  const Value* find(const std::string& key) const;
  // Typed reads of a present key; invalid_argument naming the key and both types when it holds another type, or
  // not_found when it is absent. integer() takes any integer type, number() any integer or float type.
  const std::string& string(const std::string& key) const;
  std::int64_t integer(const std::string& key) const;
  double number(const std::string& key) const;
  bool boolean(const std::string& key) const;
  std::vector<std::string> strings(const std::string& key) const;    // an array of strings
  std::vector<std::int64_t> integers(const std::string& key) const;  // an array of integers (any integer type)

  // A tensor by name: null when absent (find_tensor), not_found naming it and the file (tensor); its bytes in the
  // map, and its values as fp32.
  const TensorInfo* find_tensor(const std::string& name) const;
  const TensorInfo& tensor(const std::string& name) const;
  std::span<const std::uint8_t> bytes(const TensorInfo& tensor) const;
  std::vector<float> dequantize(const TensorInfo& tensor) const;

 private:
  struct Mapping;
  std::shared_ptr<const Mapping> map_;
  std::string path_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::uint64_t data_start_ = 0;
  std::map<std::string, Value> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> by_name_;
};

// `out.size()` values of `type` from `blocks` (out.size() / block elements whole blocks). Throws invalid_argument
// when out.size() is not whole blocks or `blocks` is not their size.
void dequantize(TensorType type, std::span<const std::uint8_t> blocks, std::span<float> out);

// The value as a signed 64-bit integer when it is one of the integer types and fits; nullopt otherwise.
std::optional<std::int64_t> as_integer(const Value& value);

// IEEE half and bfloat16 to float, as ggml converts them.
float half_to_float(std::uint16_t h);
float bf16_to_float(std::uint16_t b);
// And back, rounding to nearest with ties to even (ggml's scalar conversions); NaN stays NaN, what overflows a half
// becomes infinity.
std::uint16_t float_to_half(float f);
std::uint16_t float_to_bf16(float f);

// --- Writing ---------------------------------------------------------------------------------------------------

// fp32 values stored as `type`: F32, F16, BF16, or Q8_0 (a scale of max|x| / 127 per block of 32, each value rounded
// half away from zero), byte for byte as ggml's reference quantizer writes them; or Q4_K / Q6_K, super-blocks of 256
// in ggml's layouts whose scales rlloop chooses by its own search (each sub-block's least-squares fit, not ggml's
// bytes; any dequantizer of the format reads them). Throws invalid_argument for other types, and for the block
// types when the values are not whole blocks.
std::vector<std::uint8_t> quantize(TensorType type, std::span<const float> values);

// A tensor to write: its shape in ggml's order (fastest dimension first) and its bytes in `type`'s blocks.
struct TensorData {
  std::string name;
  std::vector<std::int64_t> shape;
  TensorType type = TensorType::f32;
  std::vector<std::uint8_t> bytes;
};

// Writes a GGUF version 3 file: the metadata (in key order; general.alignment set from `alignment` when it is not
// the default 32), the tensors' infos, then their bytes, each at the alignment. Atomic: a temporary file beside
// `path`, flushed to disk, renamed over it. Throws invalid_argument for a duplicate tensor, bytes that do not match
// a tensor's shape and type, an array mixing types, an alignment that is not a power of two (nothing is written
// then), and io_error naming the path when it cannot be written. An empty array is written as an array of uint8.
void write(const std::string& path, const std::map<std::string, Value>& metadata,
           const std::vector<TensorData>& tensors, std::uint32_t alignment = 32);

}  // namespace rlloop::gguf
