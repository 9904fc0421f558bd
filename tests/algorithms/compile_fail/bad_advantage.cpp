// Must NOT compile: the advantage policy maps one reward at a time, not a group's rewards to one advantage each.
#include <rlloop/algorithms/policy_gradient.hpp>
#include <rlloop/session.hpp>

struct PerSampleAdvantage {
  double operator()(double reward) const { return reward - 0.5; }
};

using MyGrpo = rlloop::algorithms::PolicyGradient<rlloop::AnySession, PerSampleAdvantage,
                                                  rlloop::algorithms::SequenceMean>;

int main() {
  MyGrpo* algo = nullptr;
  return algo == nullptr ? 0 : 1;
}
