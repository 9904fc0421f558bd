// Writing a GGUF file (version 3): the header, the metadata, the tensor infos, then each tensor's bytes at the
// alignment. Written to a temporary file beside the target, flushed to disk and renamed over it, so a crash leaves
// either the old file or the new one, never half of one.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

namespace rlloop::gguf {
namespace {

constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" as a little-endian uint32

class Output {
 public:
  Output(std::FILE* f, const std::string& path) : f_(f), path_(path) {}
  void bytes(const void* p, std::size_t n) {
    if (n && std::fwrite(p, 1, n, f_) != n)
      throw io_error("cannot write GGUF file '" + path_ + "': " + std::strerror(errno));
    written_ += n;
  }
  template <class T>
  void scalar(T v) {
    bytes(&v, sizeof v);  // little-endian, as this machine
  }
  void string(const std::string& s) {
    scalar<std::uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  void pad_to(std::uint64_t alignment) {
    static const std::uint8_t zeros[256] = {};
    while (written_ % alignment) bytes(zeros, std::min<std::uint64_t>(sizeof zeros, alignment - written_ % alignment));
  }

 private:
  std::FILE* f_;
  const std::string& path_;
  std::uint64_t written_ = 0;
};

// Value's alternatives are in gguf_type's order (UINT8 = 0 ... FLOAT64 = 12), so the index is the stored type.
std::uint32_t stored_type(const Value& v) { return static_cast<std::uint32_t>(v.v.index()); }
static_assert(std::variant_size_v<decltype(Value::v)> == 13);

// The rename is durable only once the directory is flushed too.
void sync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// An array's elements must share one type, which the file states once.
void check_value(const Value& v, const std::string& key) {
  const auto* a = std::get_if<Array>(&v.v);
  if (!a) return;
  for (const Value& e : *a) {
    if (stored_type(e) != stored_type(a->front()))
      throw invalid_argument("gguf: metadata '" + key + "' mixes " + type_name(a->front()) + " and " +
                             type_name(e) + " in one array");
    check_value(e, key);
  }
}

void write_value(Output& out, const Value& value) {
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Array>) {
          // An empty array has no element to take the type from: it is written as an array of uint8.
          out.scalar<std::uint32_t>(x.empty() ? 0 : stored_type(x.front()));
          out.scalar<std::uint64_t>(x.size());
          for (const Value& e : x) write_value(out, e);
        } else if constexpr (std::is_same_v<T, std::string>) {
          out.string(x);
        } else if constexpr (std::is_same_v<T, bool>) {
          out.scalar<std::uint8_t>(x ? 1 : 0);
        } else {
          out.scalar<T>(x);
        }
      },
      value.v);
}

void check_tensors(const std::vector<TensorData>& tensors) {
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (!names.insert(t.name).second) throw invalid_argument("gguf: tensor '" + t.name + "' appears twice");
    if (t.shape.empty() || t.shape.size() > 4)
      throw invalid_argument("gguf: tensor '" + t.name + "' has " + std::to_string(t.shape.size()) +
                             " dimensions (1 to 4 allowed)");
    const auto layout = block_layout(t.type);
    if (!layout) throw invalid_argument("gguf: tensor '" + t.name + "' has an unknown type " + to_string(t.type));
    TensorInfo info{t.name, t.shape, t.type, 0};
    for (auto d : t.shape)
      if (d <= 0) throw invalid_argument("gguf: tensor '" + t.name + "' has a dimension of " + std::to_string(d));
    if (t.shape[0] % layout->elements != 0)
      throw invalid_argument("gguf: tensor '" + t.name + "': rows of " + std::to_string(t.shape[0]) +
                             " are not whole " + to_string(t.type) + " blocks of " + std::to_string(layout->elements));
    if (info.bytes() != t.bytes.size())
      throw invalid_argument("gguf: tensor '" + t.name + "' of " + std::to_string(info.elements()) + " " +
                             to_string(t.type) + " values takes " + std::to_string(info.bytes()) + " bytes, not " +
                             std::to_string(t.bytes.size()));
  }
}

}  // namespace

void write(const std::string& path, const std::map<std::string, Value>& metadata,
           const std::vector<TensorData>& tensors, std::uint32_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw invalid_argument("gguf: the alignment must be a power of two, not " + std::to_string(alignment));
  for (const auto& [key, value] : metadata) check_value(value, key);
  check_tensors(tensors);
  std::map<std::string, Value> meta = metadata;
  if (alignment != 32) meta["general.alignment"] = Value{alignment};
  else meta.erase("general.alignment");

  const std::filesystem::path target(path);
  std::filesystem::path tmp_name = target.filename();
  tmp_name += ".tmp";  // beside the target, so that the rename stays within one file system
  const std::string tmp = (target.parent_path() / tmp_name).string();
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(tmp.c_str(), "wb"), &std::fclose);
  if (!f) throw io_error("cannot write GGUF file '" + path + "': " + std::strerror(errno));
  try {
    Output out(f.get(), path);
    out.scalar(kMagic);
    out.scalar<std::uint32_t>(3);
    out.scalar<std::uint64_t>(tensors.size());
    out.scalar<std::uint64_t>(meta.size());
    for (const auto& [key, value] : meta) {
      out.string(key);
      out.scalar(stored_type(value));
      write_value(out, value);
    }
    std::uint64_t offset = 0;
    for (const auto& t : tensors) {
      out.string(t.name);
      out.scalar<std::uint32_t>(static_cast<std::uint32_t>(t.shape.size()));
      for (auto d : t.shape) out.scalar<std::uint64_t>(static_cast<std::uint64_t>(d));
      out.scalar(static_cast<std::uint32_t>(t.type));
      out.scalar(offset);
      offset += (t.bytes.size() + alignment - 1) / alignment * alignment;
    }
    out.pad_to(alignment);
    for (const auto& t : tensors) {
      out.bytes(t.bytes.data(), t.bytes.size());
      out.pad_to(alignment);
    }
    if (std::fflush(f.get()) != 0 || ::fsync(::fileno(f.get())) != 0)
      throw io_error("cannot write GGUF file '" + path + "': " + std::strerror(errno));
    f.reset();
    std::error_code ec;
    std::filesystem::rename(tmp, target, ec);
    if (ec) throw io_error("cannot write GGUF file '" + path + "': " + ec.message());
    sync_directory(target.parent_path());
  } catch (...) {
    f.reset();
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw;
  }
}

}  // namespace rlloop::gguf
