// Reading a GGUF file: its header, metadata and tensor infos, checked as they are read (docs: ggml's
// docs/gguf.md). Every length and count is checked against what is left of the file before anything is
// allocated for it, so a hostile file costs an error, not memory.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

namespace rlloop::gguf {

struct File::Mapping {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(const std::uint8_t* d, std::size_t n) : data(d), size(n) {}
  ~Mapping() {
    if (data && size) ::munmap(const_cast<std::uint8_t*>(data), size);
  }
};

namespace {

constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr std::uint32_t kMaxDims = 4;         // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;             // arrays of arrays: deeper is not a model file

// The metadata value types' numbers in the file (gguf_type).
enum class StoredType : std::uint32_t {
  uint8 = 0, int8 = 1, uint16 = 2, int16 = 3, uint32 = 4, int32 = 5, float32 = 6, boolean = 7, string = 8,
  array = 9, uint64 = 10, int64 = 11, float64 = 12,
};

// `text` with its control bytes written as \xNN: a damaged file's keys and tensor names go into error messages, and a
// NUL in one would end the message's what() before it says what is wrong.
std::string printable(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    const auto b = static_cast<unsigned char>(ch);
    if (b >= 0x20 && b != 0x7F) {
      out += ch;
    } else {
      static const char* const hex = "0123456789abcdef";
      out += {'\\', 'x', hex[b >> 4], hex[b & 15]};
    }
  }
  return out;
}

// Reads forward through the mapped header; each read checks that the file holds it.
class Cursor {
 public:
  Cursor(const std::uint8_t* data, std::size_t size, const std::string& path) : data_(data), size_(size), path_(path) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw invalid_argument("GGUF file '" + path_ + "': " + printable(what) + " (at byte " + std::to_string(at_) + ")");
  }
  std::size_t at() const { return at_; }
  std::size_t left() const { return size_ - at_; }
  const std::uint8_t* take(std::size_t n, const char* what) {
    if (n > left()) fail(std::string("truncated: ") + what + " needs " + std::to_string(n) + " bytes, " +
                         std::to_string(left()) + " are left");
    const std::uint8_t* p = data_ + at_;
    at_ += n;
    return p;
  }
  template <class T>
  T scalar(const char* what) {
    T v;
    std::memcpy(&v, take(sizeof v, what), sizeof v);  // little-endian files on a little-endian machine
    return v;
  }
  std::string string(const char* what) {
    const auto n = scalar<std::uint64_t>(what);
    if (n > left()) fail(std::string(what) + " claims " + std::to_string(n) + " bytes, " + std::to_string(left()) +
                         " are left");
    const auto* p = take(static_cast<std::size_t>(n), what);
    return {reinterpret_cast<const char*>(p), static_cast<std::size_t>(n)};
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
  const std::string& path_;
};

// The smallest size an element of `type` takes in the file, to bound an array's count by what is left.
std::size_t min_size(StoredType type) {
  switch (type) {
    case StoredType::uint8: case StoredType::int8: case StoredType::boolean: return 1;
    case StoredType::uint16: case StoredType::int16: return 2;
    case StoredType::uint32: case StoredType::int32: case StoredType::float32: return 4;
    case StoredType::uint64: case StoredType::int64: case StoredType::float64: return 8;
    case StoredType::string: return 8;   // its length
    case StoredType::array: return 12;   // its element type and count
  }
  return 1;
}

Value read_value(Cursor& c, StoredType type, const std::string& key, int depth) {
  switch (type) {
    case StoredType::uint8: return {c.scalar<std::uint8_t>("a uint8")};
    case StoredType::int8: return {c.scalar<std::int8_t>("an int8")};
    case StoredType::uint16: return {c.scalar<std::uint16_t>("a uint16")};
    case StoredType::int16: return {c.scalar<std::int16_t>("an int16")};
    case StoredType::uint32: return {c.scalar<std::uint32_t>("a uint32")};
    case StoredType::int32: return {c.scalar<std::int32_t>("an int32")};
    case StoredType::float32: return {c.scalar<float>("a float32")};
    case StoredType::uint64: return {c.scalar<std::uint64_t>("a uint64")};
    case StoredType::int64: return {c.scalar<std::int64_t>("an int64")};
    case StoredType::float64: return {c.scalar<double>("a float64")};
    case StoredType::boolean: {
      const auto b = c.scalar<std::uint8_t>("a bool");
      if (b > 1) c.fail("metadata '" + key + "': a bool holds " + std::to_string(b));
      return {b == 1};
    }
    case StoredType::string: return {c.string("a string")};
    case StoredType::array: {
      if (depth >= kMaxArrayDepth) c.fail("metadata '" + key + "': arrays nested deeper than 8");
      const auto element = c.scalar<std::uint32_t>("an array's element type");
      if (element > static_cast<std::uint32_t>(StoredType::float64))
        c.fail("metadata '" + key + "': unknown array element type " + std::to_string(element));
      const auto count = c.scalar<std::uint64_t>("an array's length");
      if (count > c.left() / min_size(static_cast<StoredType>(element)))
        c.fail("metadata '" + key + "': an array of " + std::to_string(count) + " elements does not fit in the " +
               std::to_string(c.left()) + " bytes left");
      Array out;
      out.reserve(static_cast<std::size_t>(count));
      for (std::uint64_t i = 0; i < count; ++i)
        out.push_back(read_value(c, static_cast<StoredType>(element), key, depth + 1));
      return {std::move(out)};
    }
  }
  c.fail("metadata '" + key + "': unknown value type " + std::to_string(static_cast<std::uint32_t>(type)));
}

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};

}  // namespace

std::string to_string(TensorType type) {
  switch (type) {
    case TensorType::f32: return "F32";
    case TensorType::f16: return "F16";
    case TensorType::q4_0: return "Q4_0";
    case TensorType::q4_1: return "Q4_1";
    case TensorType::q5_0: return "Q5_0";
    case TensorType::q5_1: return "Q5_1";
    case TensorType::q8_0: return "Q8_0";
    case TensorType::q2_k: return "Q2_K";
    case TensorType::q3_k: return "Q3_K";
    case TensorType::q4_k: return "Q4_K";
    case TensorType::q5_k: return "Q5_K";
    case TensorType::q6_k: return "Q6_K";
    case TensorType::bf16: return "BF16";
    case TensorType::mxfp4: return "MXFP4";
  }
  return "type " + std::to_string(static_cast<std::uint32_t>(type));
}

std::optional<BlockLayout> block_layout(TensorType type) {
  switch (type) {
    case TensorType::f32: return BlockLayout{1, 4};
    case TensorType::f16: return BlockLayout{1, 2};
    case TensorType::bf16: return BlockLayout{1, 2};
    case TensorType::q4_0: return BlockLayout{32, 18};
    case TensorType::q4_1: return BlockLayout{32, 20};
    case TensorType::q5_0: return BlockLayout{32, 22};
    case TensorType::q5_1: return BlockLayout{32, 24};
    case TensorType::q8_0: return BlockLayout{32, 34};
    case TensorType::q2_k: return BlockLayout{256, 84};
    case TensorType::q3_k: return BlockLayout{256, 110};
    case TensorType::q4_k: return BlockLayout{256, 144};
    case TensorType::q5_k: return BlockLayout{256, 176};
    case TensorType::q6_k: return BlockLayout{256, 210};
    case TensorType::mxfp4: return BlockLayout{32, 17};
  }
  return std::nullopt;
}

std::string type_name(const Value& value) {
  static const char* const names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                      "bool",  "string", "array", "uint64", "int64", "float64"};
  return names[value.v.index()];
}

std::int64_t TensorInfo::elements() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::uint64_t TensorInfo::bytes() const {
  const auto layout = block_layout(type);
  return static_cast<std::uint64_t>(elements() / layout->elements * layout->bytes);
}

File File::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw not_found("GGUF file '" + path + "' does not exist");
    throw io_error("cannot open GGUF file '" + path + "': " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw io_error("GGUF file '" + path + "' is not a regular file");
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  void* p = size ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  ::close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) throw io_error("cannot map GGUF file '" + path + "': " + std::strerror(errno));

  File f;
  f.map_ = std::make_shared<const Mapping>(static_cast<const std::uint8_t*>(p), size);
  f.path_ = path;
  Cursor c(f.map_->data, size, f.path_);
  if (size < 4 || c.scalar<std::uint32_t>("the magic") != kMagic) {
    throw invalid_argument("'" + path + "' is not a GGUF file (it does not start with \"GGUF\")");
  }
  f.version_ = c.scalar<std::uint32_t>("the version");
  if (f.version_ == 0x02000000 || f.version_ == 0x03000000)
    c.fail("a big-endian GGUF file, which rlloop does not read");
  if (f.version_ != 2 && f.version_ != 3)
    c.fail("GGUF version " + std::to_string(f.version_) + "; rlloop reads versions 2 and 3");
  const auto tensor_count = c.scalar<std::uint64_t>("the tensor count");
  const auto kv_count = c.scalar<std::uint64_t>("the metadata count");
  if (kv_count > c.left() / 12) c.fail(std::to_string(kv_count) + " metadata entries cannot fit in the file");
  for (std::uint64_t i = 0; i < kv_count; ++i) {
    std::string key = c.string("a metadata key");
    const auto type = c.scalar<std::uint32_t>("a metadata value type");
    if (type > static_cast<std::uint32_t>(StoredType::float64))
      c.fail("metadata '" + key + "': unknown value type " + std::to_string(type));
    Value v = read_value(c, static_cast<StoredType>(type), key, 0);
    if (!f.metadata_.emplace(key, std::move(v)).second) c.fail("metadata key '" + key + "' appears twice");
  }
  if (const Value* a = f.find("general.alignment")) {
    const auto* n = std::get_if<std::uint32_t>(&a->v);
    if (!n || *n == 0 || (*n & (*n - 1)) != 0)
      c.fail("general.alignment must be a uint32 power of two, not " + type_name(*a));
    f.alignment_ = *n;
  }

  if (tensor_count > c.left() / 24) c.fail(std::to_string(tensor_count) + " tensor infos cannot fit in the file");
  for (std::uint64_t i = 0; i < tensor_count; ++i) {
    TensorInfo t;
    t.name = c.string("a tensor name");
    const auto dims = c.scalar<std::uint32_t>("a tensor's dimension count");
    if (dims == 0 || dims > kMaxDims)
      c.fail("tensor '" + t.name + "' has " + std::to_string(dims) + " dimensions (1 to 4 allowed)");
    std::int64_t elements = 1;
    for (std::uint32_t d = 0; d < dims; ++d) {
      const auto n = c.scalar<std::uint64_t>("a tensor dimension");
      if (n == 0 || n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max() / elements))
        c.fail("tensor '" + t.name + "' has a dimension of " + std::to_string(n));
      elements *= static_cast<std::int64_t>(n);
      t.shape.push_back(static_cast<std::int64_t>(n));
    }
    const auto type = c.scalar<std::uint32_t>("a tensor type");
    t.type = static_cast<TensorType>(type);
    const auto layout = block_layout(t.type);
    if (!layout) c.fail("tensor '" + t.name + "' is of ggml type " + std::to_string(type) +
                        ", which rlloop does not read (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K)");
    if (t.shape[0] % layout->elements != 0)
      c.fail("tensor '" + t.name + "': its rows of " + std::to_string(t.shape[0]) + " are not whole " +
             to_string(t.type) + " blocks of " + std::to_string(layout->elements));
    // Bounded by the file's size here, so that bytes() cannot overflow.
    if (static_cast<std::uint64_t>(elements / layout->elements) > size / static_cast<std::uint64_t>(layout->bytes))
      c.fail("tensor '" + t.name + "' of " + std::to_string(elements) + " " + to_string(t.type) +
             " values is larger than the file");
    t.offset = c.scalar<std::uint64_t>("a tensor offset");
    if (t.offset % f.alignment_ != 0)
      c.fail("tensor '" + t.name + "' starts at offset " + std::to_string(t.offset) + ", not a multiple of the " +
             "alignment " + std::to_string(f.alignment_));
    if (!f.by_name_.emplace(t.name, f.tensors_.size()).second) c.fail("tensor '" + t.name + "' appears twice");
    f.tensors_.push_back(std::move(t));
  }
  // The data section starts at the next multiple of the alignment.
  f.data_start_ = (c.at() + f.alignment_ - 1) / f.alignment_ * f.alignment_;
  for (const auto& t : f.tensors_) {
    if (f.data_start_ > size || t.offset > size - f.data_start_ || t.bytes() > size - f.data_start_ - t.offset)
      throw invalid_argument("GGUF file '" + path + "': tensor '" + printable(t.name) + "' (" +
                             std::to_string(t.bytes()) + " bytes at data offset " + std::to_string(t.offset) +
                             ") ends past the file's " + std::to_string(size) + " bytes");
  }
  return f;
}

const Value* File::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {
const Value& present(const File& f, const std::string& key) {
  const Value* v = f.find(key);
  if (!v) throw not_found("GGUF file '" + f.path() + "' has no metadata '" + key + "'");
  return *v;
}
[[noreturn]] void wrong_type(const File& f, const std::string& key, const Value& v, const char* wanted) {
  throw invalid_argument("GGUF file '" + f.path() + "': metadata '" + key + "' is " + type_name(v) + ", not " +
                         wanted);
}
}  // namespace

const std::string& File::string(const std::string& key) const {
  const Value& v = present(*this, key);
  if (const auto* s = std::get_if<std::string>(&v.v)) return *s;
  wrong_type(*this, key, v, "a string");
}

std::optional<std::int64_t> as_integer(const Value& v) {
  return std::visit(
      Overloaded{[](std::uint64_t x) -> std::optional<std::int64_t> {
                   if (x > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
                   return static_cast<std::int64_t>(x);
                 },
                 [](auto x) -> std::optional<std::int64_t> {
                   if constexpr (std::is_integral_v<decltype(x)> && !std::is_same_v<decltype(x), bool>)
                     return static_cast<std::int64_t>(x);
                   else
                     return std::nullopt;
                 }},
      v.v);
}

std::int64_t File::integer(const std::string& key) const {
  const Value& v = present(*this, key);
  const auto n = as_integer(v);
  if (!n) wrong_type(*this, key, v, "an integer");
  return *n;
}

std::vector<std::int64_t> File::integers(const std::string& key) const {
  const Value& v = present(*this, key);
  const auto* a = std::get_if<Array>(&v.v);
  if (!a) wrong_type(*this, key, v, "an array of integers");
  std::vector<std::int64_t> out;
  out.reserve(a->size());
  for (const Value& e : *a) {
    const auto n = as_integer(e);
    if (!n) wrong_type(*this, key, e, "an integer (in an array of integers)");
    out.push_back(*n);
  }
  return out;
}

double File::number(const std::string& key) const {
  const Value& v = present(*this, key);
  if (const auto* x = std::get_if<float>(&v.v)) return *x;
  if (const auto* x = std::get_if<double>(&v.v)) return *x;
  if (std::holds_alternative<std::string>(v.v) || std::holds_alternative<Array>(v.v) ||
      std::holds_alternative<bool>(v.v))
    wrong_type(*this, key, v, "a number");
  return static_cast<double>(integer(key));
}

bool File::boolean(const std::string& key) const {
  const Value& v = present(*this, key);
  if (const auto* b = std::get_if<bool>(&v.v)) return *b;
  wrong_type(*this, key, v, "a bool");
}

std::vector<std::string> File::strings(const std::string& key) const {
  const Value& v = present(*this, key);
  const auto* a = std::get_if<Array>(&v.v);
  if (!a) wrong_type(*this, key, v, "an array of strings");
  std::vector<std::string> out;
  out.reserve(a->size());
  for (const Value& e : *a) {
    const auto* s = std::get_if<std::string>(&e.v);
    if (!s) wrong_type(*this, key, e, "a string (in an array of strings)");
    out.push_back(*s);
  }
  return out;
}

const TensorInfo* File::find_tensor(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& File::tensor(const std::string& name) const {
  const TensorInfo* t = find_tensor(name);
  if (!t) throw not_found("GGUF file '" + path_ + "' has no tensor '" + name + "'");
  return *t;
}

std::span<const std::uint8_t> File::bytes(const TensorInfo& t) const {
  return {map_->data + data_start_ + t.offset, static_cast<std::size_t>(t.bytes())};
}

std::vector<float> File::dequantize(const TensorInfo& t) const {
  std::vector<float> out(static_cast<std::size_t>(t.elements()));
  gguf::dequantize(t.type, bytes(t), out);
  return out;
}

}  // namespace rlloop::gguf
