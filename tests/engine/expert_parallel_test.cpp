// Expert parallelism (issue 27, must-show 3): two ranks in this process, each holding half of every sparse layer's
// experts and half of the batch, exchange rows by all-to-all (Gloo); their losses and gradients equal one rank's
// over the whole batch with every expert.
#include <gtest/gtest.h>

#include <thread>

#include <rlloop/error.hpp>

#include "model/builtin_models.hpp"
#include "comm/group.hpp"
#include "io/model_io.hpp"
#include "session_util.hpp"
#include "runtime/target_logprobs.hpp"
#include "model/transformer.hpp"

using namespace rlloop;
using namespace rlloop::engine;
using test_util::error_of;

namespace {

// Qwen3-MoE at rlloop-tiny's width: 8 experts of width 16, two per token, in fp64 (differences are then wrong
// arithmetic, not rounding).
ModelConfig moe_config() { return *builtin_model("rlloop-tiny-moe"); }

// The summed logprob loss of `ids` [B, T] predicting `targets` and its backward; the model's gradients by name.
struct Pass {
  double loss = 0;
  std::map<std::string, torch::Tensor> grads;
};
// `replay`, when defined: the routes to take ([tokens, sparse layers, k], routing replay).
Pass run_pass(Transformer& model, const torch::Tensor& ids, const torch::Tensor& targets,
              const torch::Tensor& replay = {}) {
  for (auto& [name, p] : model.named_trainable_parameters()) p.mutable_grad().reset();
  ExpertRouting routing{replay};
  const torch::Tensor hidden = model.hidden_states(ids, nullptr, replay.defined() ? &routing : nullptr);
  const torch::Tensor lp = target_logprobs(model, hidden, targets);
  const torch::Tensor loss = -(lp * torch::linspace(0.5, 1.5, lp.size(1), lp.options())).sum();
  loss.backward();
  Pass out{loss.item<double>(), {}};
  for (auto& [name, p] : model.named_trainable_parameters())
    if (p.grad().defined()) out.grads[name] = p.grad().clone();
  return out;
}

// The weights of `full` that a rank holding experts [first, first + count) has: all but the other experts'.
TensorMap slice_of(const Transformer& full, const ModelConfig& cfg, std::int64_t first, std::int64_t count) {
  const ModelFamily& f = cfg.family();
  auto other_expert = [&](const std::string& name) {
    for (std::int64_t layer = 0; layer < cfg.num_hidden_layers; ++layer)
      for (std::int64_t e = 0; e < cfg.num_experts; ++e)
        if ((e < first || e >= first + count) &&
            name.starts_with(f.layer_tensor(layer, f.names.experts) + "." + std::to_string(e) + "."))
          return true;
    return false;
  };
  TensorMap out;
  for (const auto& [name, t] : full.hf_state_dict())
    if (!other_expert(name)) out[name] = t.clone();
  return out;
}

}  // namespace

namespace {
// Two ranks against one, on the same weights and batch; with `replay`, every token routed to experts 0 and 1 (rank
// 0's): rank 1's experts get no row, and it must still take part in every exchange of the backward.
void expect_two_ranks_equal_one(bool replay) {
  const ModelConfig cfg = moe_config();
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  auto full = init_model(cfg, 7, torch::kCPU, torch::kFloat64);
  {
    torch::NoGradGuard no_grad;  // weights far from init's near-uniform routing, so routes and experts matter
    torch::manual_seed(3);
    for (auto& p : full->parameters()) p.add_(0.2 * torch::randn_like(p));
  }
  torch::manual_seed(4);
  const torch::Tensor ids = torch::randint(0, cfg.vocab_size, {4, 10}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, cfg.vocab_size, {4, 10}, torch::kLong);
  torch::Tensor routes;  // [4 x 10 tokens, sparse layers, k]: experts 0 and 1 everywhere
  if (replay)
    routes = torch::arange(2, torch::kLong).repeat({40, cfg.expert_shape().sparse_layers, 1});
  const Pass one = run_pass(*full, ids, targets, routes);

  const std::int64_t per_rank = cfg.num_experts / 2;
  Pass pass[2];
  std::uint64_t exchanged[2] = {0, 0};
  std::string errors[2];
  std::unique_ptr<dist::Group> group0 = dist::Group::listen({.rank = 0, .world_size = 2});
  auto rank = [&](int r, dist::Group* g) {
    try {
      std::unique_ptr<dist::Group> own;
      if (!g) {
        own = dist::Group::join({.rank = 1, .world_size = 2, .port = group0->port()});
        g = own.get();
      } else {
        g->wait_for_ranks();
      }
      Transformer model(cfg, f64, {}, ExpertRange{r * per_rank, per_rank});
      model.load_hf_state_dict(slice_of(*full, cfg, r * per_rank, per_rank));
      model.set_expert_parallel(*g);
      pass[r] = run_pass(model, ids.narrow(0, 2 * r, 2), targets.narrow(0, 2 * r, 2),
                         replay ? routes.narrow(0, 20 * r, 20) : torch::Tensor());
      // Data parallelism's part: the dense weights' gradients summed over the ranks (each expert's are whole).
      for (auto& [name, grad] : pass[r].grads)
        if (name.find("experts") == std::string::npos) g->allreduce_sum(grad);
      exchanged[r] = g->stats().alltoall_bytes;
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::thread worker(rank, 1, nullptr);
  rank(0, group0.get());
  worker.join();
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");

  // (target_logprobs' logprobs are fp32 whatever the model's dtype: the summed loss agrees to fp32's precision.)
  EXPECT_NEAR(pass[0].loss + pass[1].loss, one.loss, 1e-6 * std::abs(one.loss));
  std::size_t compared = 0;
  for (int r = 0; r < 2; ++r)
    for (const auto& [name, grad] : pass[r].grads) {
      ASSERT_TRUE(one.grads.count(name)) << name;
      EXPECT_LT((grad - one.grads.at(name)).abs().max().item<double>(), 1e-10) << "rank " << r << " " << name;
      ++compared;
    }
  // Every dense gradient on both ranks, every expert's on its owner (replayed: only experts 0 and 1 have one).
  const std::size_t expert_grads = static_cast<std::size_t>((replay ? 2 : cfg.num_experts) * 3 *
                                                            cfg.expert_shape().sparse_layers);
  EXPECT_EQ(compared, 2 * (one.grads.size() - expert_grads) + expert_grads);
  EXPECT_GT(exchanged[0], 0u);
  std::printf("all-to-all bytes of one forward and backward%s, rank 0: %llu\n", replay ? " (replayed)" : "",
              static_cast<unsigned long long>(exchanged[0]));
}
}  // namespace

TEST(ExpertParallel, TwoRanksEqualOneRank) { expect_two_ranks_equal_one(false); }

// A rank whose experts get no row (routes replayed onto rank 0's) still runs every exchange: no rank waits forever.
TEST(ExpertParallel, ARankWhoseExpertsGetNoRowsTakesPartInTheBackward) { expect_two_ranks_equal_one(true); }



// A world size that does not divide the experts, and a model that holds other experts than the rank's, are refused.
TEST(ExpertParallel, ShardsThatDoNotFitAreRefused) {
  const ModelConfig cfg = moe_config();
  std::unique_ptr<dist::Group> group0 = dist::Group::listen({.rank = 0, .world_size = 3});
  std::string errors[3];
  std::vector<std::thread> workers;
  for (int r = 1; r < 3; ++r)
    workers.emplace_back([&, r] {
      try {
        dist::Group::join({.rank = r, .world_size = 3, .port = group0->port()});
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  group0->wait_for_ranks();
  for (auto& w : workers) w.join();
  Transformer model(cfg);
  EXPECT_EQ(error_of([&] { model.set_expert_parallel(*group0); }),
            "expert parallelism: 8 experts do not split evenly over 3 ranks");
  EXPECT_EQ(error_of([&] { Transformer(cfg, torch::TensorOptions(), {}, ExpertRange{4, 8}); }),
            "Transformer: experts [4, 12) are not within the model's 8");
  EXPECT_EQ(error_of([&] { Transformer(cfg, torch::TensorOptions(), {}, ExpertRange{4, -1}); }),
            "Transformer: experts [4, 3) are not within the model's 8");
  // A slice without its group cannot route to the experts it lacks.
  Transformer slice(cfg, torch::TensorOptions(), {}, ExpertRange{0, 4});
  EXPECT_EQ(error_of([&] { slice.hidden_states(torch::zeros({1, 3}, torch::kLong)); }),
            "Transformer: this model holds a slice of the experts; set_expert_parallel names the group that holds "
            "the others");
}
