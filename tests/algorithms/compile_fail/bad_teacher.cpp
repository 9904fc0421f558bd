// Must NOT compile: a teacher scores tokens through a future (as SamplingClient::compute_logprobs does, so that the
// loop can submit every completion before it waits); this one returns the logprobs themselves.
#include <vector>

#include <rlloop/algorithms/distillation.hpp>

struct BlockingTeacher {
  std::vector<double> compute_logprobs(const rlloop::ModelInput& input) const {
    return std::vector<double>(input.tokens().size(), -1.0);
  }
};

int main() {
  using Algo = rlloop::algorithms::Distillation<rlloop::AnySession, BlockingTeacher>;
  return sizeof(Algo*) == 0;
}
