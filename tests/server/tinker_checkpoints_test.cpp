// Tinker checkpoints' lifetimes without a server: which ones the reaper deletes at a given time, and the journal
// record of a deletion dropping both the model package and the Tinker record, so that a restart finds neither.
#include <gtest/gtest.h>

#include "server/journal.hpp"
#include "server/tinker_internal.hpp"

using namespace rlloop::server;

TEST(TinkerCheckpoints, TheReaperDeletesThoseWhoseTimeToLiveRanOut) {
  TinkerRoutes r;
  auto add = [&](const std::string& path, const std::string& tenant, double expires) {
    r.checkpoints[path] = TinkerRoutes::Checkpoint{.tenant = tenant, .type = "training", .expires = expires};
  };
  add("tinker://m:train:0/weights/never", "a", 0);
  add("tinker://m:train:0/weights/soon", "a", 1000);
  add("tinker://n:train:0/sampler_weights/later", "b", 5000);
  using paths = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(tinker_routes::expired_checkpoints_locked(r, 999), paths{});
  EXPECT_EQ(tinker_routes::expired_checkpoints_locked(r, 1000), (paths{{"a", "tinker://m:train:0/weights/soon"}}));
  EXPECT_EQ(tinker_routes::expired_checkpoints_locked(r, 1e9),
            (paths{{"a", "tinker://m:train:0/weights/soon"}, {"b", "tinker://n:train:0/sampler_weights/later"}}));
}

TEST(TinkerCheckpoints, ADeletionRecordDropsThePackageAndTheTinkerRecord) {
  DurableState state(Retention{});
  const std::string arn = "arn:aws:sagemaker:us-east-1:000000000000:model-package/m-train-0/1";
  state.apply({{"t", "checkpoint"}, {"tenant", "a"}, {"arn", arn}, {"path", "/data/ckpt"}, {"session", "m-train-0"},
               {"baseModel", "rlloop-small"}, {"isCheckpoint", true}, {"time", 1.0}, {"n", 1}});
  state.apply({{"t", "tinker"}, {"tenant", "a"}, {"kind", "checkpoint"}, {"id", "tinker://m:train:0/weights/x"},
               {"package", arn}});
  ASSERT_EQ(state.tenants.at("a").checkpoints.count(arn), 1u);
  ASSERT_EQ(state.tinker.size(), 1u);
  state.apply(
      {{"t", "checkpoint_deleted"}, {"tenant", "a"}, {"arn", arn}, {"tinkerPath", "tinker://m:train:0/weights/x"}});
  EXPECT_EQ(state.tenants.at("a").checkpoints.count(arn), 0u);
  EXPECT_TRUE(state.tinker.empty());
  EXPECT_EQ(state.tenants.at("a").next_checkpoint, 2);  // numbers are never reused
  // The snapshot holds neither.
  EXPECT_EQ(state.snapshot(1).find(arn), std::string::npos);
}
