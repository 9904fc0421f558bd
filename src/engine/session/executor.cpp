// The one place that tells a session's parallel modes apart (executor.hpp).
#include "session/executor.hpp"

#include "session/data_parallel_executor.hpp"
#include "session/expert_parallel_executor.hpp"
#include "session/fully_sharded_executor.hpp"
#include "session/single_rank_executor.hpp"

namespace rlloop::engine {

dist::Group* expert_group_of(const BaseModelRegistry& bases) {
  const auto& group = bases.data_parallel();
  return group ? group->expert_group() : nullptr;
}

dist::Group* shard_group_of(const BaseModelRegistry& bases) {
  const auto& group = bases.data_parallel();
  return group ? group->shard_group() : nullptr;
}

DataParallelStats data_parallel_stats_of(const BaseModelRegistry& bases) {
  const auto& group = bases.data_parallel();
  return group ? group->stats() : DataParallelStats{};
}

std::string data_parallel_failure_of(const BaseModelRegistry& bases) {
  const auto& group = bases.data_parallel();
  return group ? group->failure() : std::string();
}

// Expert parallelism holds only for a model with experts: a dense model in an expert-parallel group is replicated.
std::unique_ptr<Executor> make_executor(SessionCore& core) {
  std::shared_ptr<dist::Coordinator> group = core.bases->data_parallel();
  if (!group) return std::make_unique<SingleRankExecutor>(core);
  if (core.model->expert_parallel()) return std::make_unique<ExpertParallelExecutor>(core, std::move(group));
  if (dist::shards_sessions(core.service.data_parallel.shard))
    return std::make_unique<FullyShardedExecutor>(core, std::move(group));
  return std::make_unique<DataParallelExecutor>(core, std::move(group));
}

}  // namespace rlloop::engine
