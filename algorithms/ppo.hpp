// PPO with a learned value function (critic) and GAE: the policy-gradient loop (policy_gradient.hpp) with the
// CriticGae advantage policy (gae.hpp) and a token mean over each minibatch. The session must be created with a
// value head (SessionOptions::value_head = true, local sessions): the critic is trained with the built-in `value`
// loss, the policy with `ppo`, both on the same weights, `epochs` passes of `substeps` minibatches per batch.
//
//   auto opts = rlloop::SessionOptions{.base_model = "rlloop-small", .value_head = true};
//   rlloop::algorithms::PPO<rlloop::LocalSession> ppo(service.create_training_client(opts), tokenizer,
//                                                     {.group_size = 4, .epochs = 2, .substeps = 2},
//                                                     {.gae = {.lambda = 0.95}, .value_coef = 0.5});
//   for (...) auto stats = ppo.step(problems, reward);
#pragma once
#include <rlloop/algorithms/gae.hpp>
#include <rlloop/algorithms/policy_gradient.hpp>

namespace rlloop::algorithms {

template <Session S>
using PPO = PolicyGradient<S, CriticGae, TokenMean>;

}  // namespace rlloop::algorithms
