// The bytes that carry a data-parallel command and its results between ranks: a flat little-endian encoding
// of the few plain types a command holds. Both ends are the same build of rlloop (the group checks that at
// join), so there is no versioning; a short or malformed message is an io_error.
#pragma once
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/loss.hpp>
#include <rlloop/types.hpp>

namespace rlloop::engine::dist {

class ByteWriter {
 public:
  template <class T>
  requires std::is_arithmetic_v<T> || std::is_enum_v<T>
  void put(T v) {
    const auto* p = reinterpret_cast<const char*>(&v);
    bytes_.append(p, sizeof v);
  }
  void put(const std::string& s);
  template <class T>
  requires std::is_arithmetic_v<T>
  void put(const std::vector<T>& v) {
    put(static_cast<std::uint64_t>(v.size()));
    bytes_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  void put(const TensorData& t);
  void put(const Datum& d);
  void put(const std::vector<Datum>& data);
  void put(const LossSpec& loss);
  void put(const AdamParams& p);
  void put(const SessionOptions& o);
  void put(const Metrics& m);
  void put(const ForwardBackwardOutput& out);
  // A share of a sampling request: its prompt, num_samples, params and whether it returns routes (prompt logprobs
  // and model_path are rank 0's alone: they are not sent).
  void put(const SampleRequest& req);
  void put(const std::vector<SampledSequence>& sequences);

  std::string take() { return std::move(bytes_); }

 private:
  std::string bytes_;
};

class ByteReader {
 public:
  explicit ByteReader(const std::string& bytes) : bytes_(bytes) {}

  template <class T>
  requires std::is_arithmetic_v<T> || std::is_enum_v<T> T get() {
    T v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  std::string get_string();
  // A count of items that follow, each at least one byte: no more than the bytes left.
  std::size_t get_count() {
    const auto n = get<std::uint64_t>();
    if (n > bytes_.size() - pos_) fail();
    return static_cast<std::size_t>(n);
  }
  template <class T>
  requires std::is_arithmetic_v<T> std::vector<T> get_vector() {
    const auto n = get<std::uint64_t>();
    if (n > (bytes_.size() - pos_) / sizeof(T)) fail();
    std::vector<T> v(n);
    std::memcpy(v.data(), take(n * sizeof(T)), n * sizeof(T));
    return v;
  }
  TensorData get_tensor_data();
  Datum get_datum();
  std::vector<Datum> get_data();
  LossSpec get_loss_spec();
  AdamParams get_adam_params();
  SessionOptions get_session_options();
  Metrics get_metrics();
  ForwardBackwardOutput get_forward_output();
  SampleRequest get_sample_request();
  std::vector<SampledSequence> get_sequences();

 private:
  const char* take(std::size_t n) {
    if (n > bytes_.size() - pos_) fail();
    const char* p = bytes_.data() + pos_;
    pos_ += n;
    return p;
  }
  [[noreturn]] static void fail() { throw io_error("data-parallel message is truncated or malformed"); }

  const std::string& bytes_;
  std::size_t pos_ = 0;
};

}  // namespace rlloop::engine::dist
