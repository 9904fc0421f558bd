// The seccomp program handed to bwrap (--seccomp FD); bwrap installs it just before exec'ing the command.
#pragma once
#include <string>

namespace rlloop::sandbox::detail {

// Compiled BPF bytes, built once per variant. allow_fork=false also denies creating processes
// and threads (fork, vfork, clone, clone3), which is what stops fork bombs and escaping daemons.
const std::string& seccomp_bpf(bool allow_fork);

}  // namespace rlloop::sandbox::detail
