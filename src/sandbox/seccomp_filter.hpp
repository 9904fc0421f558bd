// The seccomp program handed to bwrap (--seccomp FD); bwrap installs it just before exec'ing the command.
#pragma once
#include <string>

namespace rlloop::sandbox::detail {

// Compiled BPF bytes, built once per variant. allow_fork=false also denies creating processes
// (fork, vfork, clone without CLONE_THREAD), which is what stops fork bombs and escaping daemons.
const std::string& seccomp_bpf(bool allow_fork);

}  // namespace rlloop::sandbox::detail
