// Must NOT compile: train() needs stats it can log (a step number and to_json); these have no to_json.
#include <cstdint>
#include <vector>

#include <rlloop/algorithms/callbacks.hpp>

struct MyStats {
  std::int64_t step = 0;
  double loss = 0;
};

struct MyAlgorithm {
  MyStats step(const std::vector<int>& batch) { return {0, static_cast<double>(batch.size())}; }
};

int main() {
  MyAlgorithm algo;
  const std::vector<int> batch{1, 2, 3};
  return static_cast<int>(rlloop::algorithms::train(algo, 10, [&] { return batch; }).step);
}
