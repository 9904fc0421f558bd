// Must NOT compile: the aggregation policy weighs one completion length, not a minibatch's lengths.
#include <cstddef>

#include <rlloop/algorithms/policy_gradient.hpp>
#include <rlloop/session.hpp>

struct InverseLength {
  double operator()(std::size_t length) const { return 1.0 / static_cast<double>(length); }
};

using MyGrpo = rlloop::algorithms::PolicyGradient<rlloop::AnySession, rlloop::algorithms::GroupNormalized,
                                                  InverseLength>;

int main() {
  MyGrpo* algo = nullptr;
  return algo == nullptr ? 0 : 1;
}
