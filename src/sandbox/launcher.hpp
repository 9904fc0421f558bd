// Starts one process (bwrap) with rlimits, a new process group and optionally a lower uid, feeds its stdin,
// captures capped stdout/stderr and enforces the wall-clock deadline. No knowledge of bwrap's options here.
#pragma once
#include <string>
#include <vector>

#include <rlloop/sandbox.hpp>

namespace rlloop::sandbox::detail {

// The fd number at which the child finds the seccomp program (bwrap is told `--seccomp 3`).
inline constexpr int seccomp_child_fd = 3;

struct LaunchSpec {
  std::vector<std::string> argv;  // argv[0]: absolute path of the executable
  std::vector<std::string> env;   // the complete environment ("K=V"); nothing of ours leaks in
  std::string stdin_data;
  const std::string* seccomp_bpf = nullptr;  // placed at fd seccomp_child_fd when set
  Limits limits;
  bool drop_privileges = false;  // setuid/setgid to uid/gid below before exec
  unsigned uid = 0, gid = 0;
};

// Returns the raw outcome: exited/signaled as seen on bwrap, timeout, output_limit. cpu_seconds_used is the
// CPU time of the whole reaped process tree.
RunResult launch(const LaunchSpec& spec, double* cpu_seconds_used);

}  // namespace rlloop::sandbox::detail
