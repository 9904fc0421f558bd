// The rank a cluster launcher started this process as, read from the environment it sets (docs/distributed.md):
// torchrun and Kubeflow's PyTorchJob set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; Slurm's srun
// sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID, with MASTER_ADDR and MASTER_PORT exported by the batch script.
#pragma once
#include <cstdlib>
#include <optional>
#include <string>

#include <rlloop/error.hpp>

namespace rlloop::cli {

struct LaunchedRank {
  std::string launcher;  // "torchrun", "slurm" or "environment" (RANK and the rest set by anything else)
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string rendezvous;  // MASTER_ADDR:MASTER_PORT
  // torchrun's elastic agent hosts the store at MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE) and keeps it across
  // the job's attempts; otherwise rank 0 hosts it.
  bool agent_store = false;
  std::string store_prefix;  // the attempt's own keys in a store that outlives it
};

namespace launch_env_detail {
inline const char* get(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}
inline std::string require(const char* name, const char* because) {
  const char* v = get(name);
  if (!v) throw invalid_argument(std::string(name) + " is not set, but " + because);
  return v;
}
inline int as_int(const char* name, const std::string& text, int low, int high) {
  int value = -1;
  std::size_t used = 0;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || value < low || value > high)
    throw invalid_argument(std::string(name) + "='" + text + "' is not a whole number in " + std::to_string(low) +
                           ".." + std::to_string(high));
  return value;
}
}  // namespace launch_env_detail

// nullopt when neither RANK nor SLURM_PROCID is set (no launcher); throws naming the variable that is missing or
// not a number in range.
inline std::optional<LaunchedRank> launched_rank() {
  using namespace launch_env_detail;
  LaunchedRank out;
  const bool slurm = !get("RANK") && get("SLURM_PROCID");
  if (!get("RANK") && !slurm) return std::nullopt;
  const char* rank_var = slurm ? "SLURM_PROCID" : "RANK";
  const char* size_var = slurm ? "SLURM_NTASKS" : "WORLD_SIZE";
  const char* local_var = slurm ? "SLURM_LOCALID" : "LOCAL_RANK";
  const std::string because = std::string(rank_var) + " is (a launcher started this rank)";
  out.launcher = slurm ? "slurm" : get("TORCHELASTIC_RUN_ID") ? "torchrun" : "environment";
  out.world_size = as_int(size_var, require(size_var, because.c_str()), 1, 1024);
  out.rank = as_int(rank_var, require(rank_var, because.c_str()), 0, out.world_size - 1);
  out.local_rank = get(local_var) ? as_int(local_var, get(local_var), 0, 1023) : 0;
  const int port = as_int("MASTER_PORT", require("MASTER_PORT", because.c_str()), 1, 65535);
  out.rendezvous = require("MASTER_ADDR", because.c_str()) + ":" + std::to_string(port);
  const char* agent = get("TORCHELASTIC_USE_AGENT_STORE");
  out.agent_store = agent && (std::string(agent) == "True" || std::string(agent) == "true" || std::string(agent) == "1");
  // A job's later attempt (torchrun --max-restarts, a resubmitted Slurm job step) meets the same store, so each
  // attempt writes under a prefix of its own.
  const char* attempt = get("TORCHELASTIC_RESTART_COUNT");
  const char* job = slurm ? get("SLURM_JOB_ID") : get("TORCHELASTIC_RUN_ID");
  out.store_prefix = std::string("rlloop-") + (job ? job : "job") + "-attempt-" + (attempt ? attempt : "0");
  return out;
}

}  // namespace rlloop::cli
