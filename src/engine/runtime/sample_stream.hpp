// The random numbers of one sampling request, one stream per sample.
//
// Sample `row` of a request draws its token number `token` with uniform(row, token): the SplitMix64 output for
// that counter in the row's own stream, keyed by the request's seed. A sample's tokens therefore depend on its
// seed, its index and the logits only — not on which other samples or requests decode beside it, not on the
// order its rows leave the batch, and not on which rank decodes it (data parallelism splits one request's
// samples across ranks; each rank's share starts at its first row, first_row()).
#pragma once
#include <cstdint>

namespace rlloop::engine {

class SampleStream {
 public:
  explicit SampleStream(std::uint64_t seed, std::int64_t first_row = 0) : seed_(seed), first_row_(first_row) {}

  // The uniform in [0, 1) that the request's sample `first_row() + row` draws its token `token` (0-based) with.
  double uniform(std::int64_t row, std::int64_t token) const {
    const std::uint64_t key = mix(seed_ ^ mix(static_cast<std::uint64_t>(first_row_ + row)));
    return static_cast<double>(mix(key + static_cast<std::uint64_t>(token) * kGamma) >> 11) * 0x1.0p-53;
  }

  // The stream of the share of samples that starts at the request's sample `first`.
  SampleStream from_row(std::int64_t first) const { return SampleStream(seed_, first_row_ + first); }

  std::uint64_t seed() const { return seed_; }
  std::int64_t first_row() const { return first_row_; }

 private:
  static constexpr std::uint64_t kGamma = 0x9e3779b97f4a7c15ull;  // SplitMix64's increment
  // SplitMix64's output function (Steele, Lea and Flood 2014): a bijection whose outputs over consecutive
  // counters pass BigCrush.
  static std::uint64_t mix(std::uint64_t z) {
    z += kGamma;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  std::uint64_t seed_;
  std::int64_t first_row_;
};

}  // namespace rlloop::engine
