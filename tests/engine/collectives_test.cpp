// The group's collectives for fully sharded parallelism (all-gather, reduce-scatter) and its store options for
// launchers (a store another process hosts, keys under a prefix): ranks as threads of this process, over Gloo.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/group.hpp"
#include "ranks_util.hpp"
#include "session_util.hpp"

using namespace rlloop::engine;
using test_util::error_of;
using test_util::on_ranks;

namespace {

// Rank r's values: distinct on every rank and element, not integers (the sums round).
torch::Tensor values_of(int r, std::int64_t n, torch::Dtype dtype) {
  return (torch::arange(n, torch::kFloat64) * 0.37 + r * 1.13 + 0.01).sin().to(dtype);
}

void expect_pair_is_exact(int W, torch::Dtype dtype, double tolerance) {
  const std::int64_t n = 5;  // elements per rank's part
  std::vector<torch::Tensor> gathered(W), reduced(W);
  std::vector<dist::CollectiveStats> stats(W);
  const auto errors = on_ranks(W, [&](int r, dist::Group& g) {
    gathered[r] = g.all_gather(values_of(r, n, dtype));
    reduced[r] = g.reduce_scatter_sum(values_of(r, n * W, dtype));
    stats[r] = g.stats();
  });
  for (int r = 0; r < W; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;

  std::vector<torch::Tensor> shards;
  torch::Tensor sum = torch::zeros({n * W}, torch::kFloat64);
  for (int r = 0; r < W; ++r) {
    shards.push_back(values_of(r, n, dtype));
    sum += values_of(r, n * W, dtype).to(torch::kFloat64);
  }
  const torch::Tensor all = torch::cat(shards);
  const auto elem = static_cast<std::uint64_t>(torch::elementSize(dtype));
  for (int r = 0; r < W; ++r) {
    EXPECT_EQ(gathered[r].scalar_type(), dtype);
    EXPECT_TRUE(torch::equal(gathered[r], all)) << "rank " << r << " gathered " << gathered[r];
    EXPECT_EQ(reduced[r].scalar_type(), dtype);
    ASSERT_EQ(reduced[r].numel(), n);
    const double off = (reduced[r].to(torch::kFloat64) - sum.narrow(0, r * n, n)).abs().max().item<double>();
    EXPECT_LE(off, tolerance) << "rank " << r;
    // Logical volume: W - 1 shards received; (W - 1) / W of the full tensor sent by the ring.
    EXPECT_EQ(stats[r].allgather_calls, 1u);
    EXPECT_EQ(stats[r].allgather_bytes, (W - 1) * n * elem);
    EXPECT_EQ(stats[r].reduce_scatter_calls, 1u);
    EXPECT_EQ(stats[r].reduce_scatter_bytes, (W - 1) * n * elem);
    // Gloo carries bf16 as fp32: twice the logical bytes actually sent.
    const std::uint64_t carried = dtype == torch::kBFloat16 ? 4 : elem;
    EXPECT_EQ(stats[r].reduce_scatter_sent_bytes, (W - 1) * n * carried);
  }
}

}  // namespace

TEST(Collectives, AllGatherAndReduceScatterOnTwoRanks) { expect_pair_is_exact(2, torch::kFloat64, 1e-15); }
TEST(Collectives, AllGatherAndReduceScatterOnThreeRanks) { expect_pair_is_exact(3, torch::kFloat64, 1e-15); }
// bf16 sums in fp32 on the way and rounds once at the end: within one bf16 step of the exact sum.
TEST(Collectives, Bf16TravelsAsFp32AndRoundsOnce) { expect_pair_is_exact(3, torch::kBFloat16, 3 * 0.0079); }

TEST(Collectives, ShapesThatDoNotSplitAreRefused) {
  const auto errors = on_ranks(2, [&](int, dist::Group& g) {
    EXPECT_EQ(error_of([&] { g.reduce_scatter_sum(torch::zeros({5}, torch::kFloat64)); }),
              "Group::reduce_scatter_sum: expects a 1-D tensor of a multiple of 2 elements, got 5 in 1 dimensions");
    EXPECT_EQ(error_of([&] { g.all_gather(torch::zeros({2, 2}, torch::kFloat64)); }),
              "Group::all_gather: expects a 1-D tensor of a multiple of 1 elements, got 4 in 2 dimensions");
    // The group still works after a refused call (nothing was sent).
    EXPECT_EQ(g.all_gather(torch::ones({1}, torch::kFloat64)).sum().item<double>(), 2.0);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// torchrun's agent hosts the store and outlives each attempt of the job: rank 0 connects to it like the others, and
// each attempt's keys live under a prefix of their own, so the next attempt's rendezvous does not see the last
// one's ranks.
TEST(Collectives, AGroupOnAStoreHostedElsewhereKeepsItsKeysUnderItsPrefix) {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  dist::GroupOptions o{.port = agent->getPort(), .external_store = true, .store_prefix = "attempt-0"};
  for (int attempt = 0; attempt < 2; ++attempt) {
    o.store_prefix = "attempt-" + std::to_string(attempt);
    const auto errors = on_ranks(2, [&](int r, dist::Group& g) {
      EXPECT_EQ(g.port(), agent->getPort());
      EXPECT_EQ(g.all_gather(torch::full({1}, r + 10 * attempt, torch::kFloat64)).sum().item<double>(),
                1 + 20 * attempt);
    }, o);
    EXPECT_EQ(errors[0], "");
    EXPECT_EQ(errors[1], "");
    EXPECT_TRUE(agent->check({"attempt-" + std::to_string(attempt) + "/rlloop/joined/1"}));
  }
  // A second group under a prefix already used would meet the first one's ranks: refused, naming why.
  EXPECT_EQ(error_of([&] { dist::Group::listen({.world_size = 2, .port = o.port, .external_store = true,
                                                .store_prefix = "attempt-1"}); }),
            "data-parallel rendezvous at 127.0.0.1:" + std::to_string(o.port) + ": the store already holds a group "
            "under the key prefix 'attempt-1' (each group needs a prefix of its own)");
}
