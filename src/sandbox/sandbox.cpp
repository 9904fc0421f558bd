// Sandbox: the bwrap command line around a run, and the reading of what came back.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <mutex>

#include <rlloop/error.hpp>
#include <rlloop/sandbox.hpp>

#include "launcher.hpp"
#include "seccomp_filter.hpp"

namespace rlloop::sandbox {
namespace fs = std::filesystem;

struct Sandbox::Impl {
  Options opts;
  // Top-level system folders reproduced read-only (or as the same symlinks, on merged-/usr systems).
  std::vector<std::string> system_args;
  // As root: drop to an unprivileged uid before bwrap (needs unprivileged user namespaces). Decided by
  // a probe on first use; if the kernel refuses, run bwrap privileged (it drops all capabilities itself).
  bool root = ::geteuid() == 0;
  std::once_flag probe_once;
  bool unprivileged = true;

  explicit Impl(Options o) : opts(std::move(o)) {
    for (const char* dir : {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"}) {
      std::error_code ec;
      auto st = fs::symlink_status(dir, ec);
      if (ec || !fs::exists(st)) continue;
      if (fs::is_symlink(st)) {
        system_args.insert(system_args.end(), {"--symlink", fs::read_symlink(dir, ec).string(), dir});
      } else if (fs::is_directory(st)) {
        system_args.insert(system_args.end(), {"--ro-bind", dir, dir});
      }
    }
    // Not secrets: the loader cache (speed) and the alternatives links some compilers resolve through.
    for (const char* f : {"/etc/ld.so.cache", "/etc/alternatives"})
      system_args.insert(system_args.end(), {"--ro-bind-try", f, f});
  }

  std::vector<std::string> bwrap_argv(const Box& box, const RunRequest& req, bool as_unprivileged) const {
    std::vector<std::string> a{opts.bwrap_path,
                               "--unshare-all",  // net, pid, ipc, uts, cgroup (and user where possible)
                               "--die-with-parent", "--hostname", "sandbox"};
    if (as_unprivileged) a.insert(a.end(), {"--unshare-user", "--disable-userns"});
    a.insert(a.end(), system_args.begin(), system_args.end());
    const std::string tmp_size = std::to_string(req.limits.tmp_bytes);
    a.insert(a.end(), {"--proc",
                       "/proc",
                       "--dev",
                       "/dev",
                       "--remount-ro",
                       "/dev",  // device nodes stay usable; no files can be created there
                       "--size",
                       tmp_size,
                       "--tmpfs",
                       "/tmp",
                       req.box_writable ? "--bind" : "--ro-bind",
                       box.host_path(),
                       "/box",
                       "--remount-ro",
                       "/",  // the sandbox's own root would otherwise be an unbounded tmpfs
                       "--chdir",
                       "/tmp",
                       "--clearenv",
                       "--setenv",
                       "PATH",
                       "/usr/bin:/bin",
                       "--setenv",
                       "HOME",
                       "/tmp",
                       "--setenv",
                       "TMPDIR",
                       "/tmp",
                       "--setenv",
                       "LANG",
                       "C.UTF-8",
                       "--setenv",
                       "PYTHONDONTWRITEBYTECODE",
                       "1",
                       "--setenv",
                       "PYTHONHASHSEED",
                       "0",
                       "--seccomp",
                       std::to_string(detail::seccomp_child_fd),
                       "--"});
    a.insert(a.end(), req.argv.begin(), req.argv.end());
    return a;
  }

  RunResult run_once(const Box& box, const RunRequest& req, bool as_unprivileged) const {
    detail::LaunchSpec spec;
    spec.argv = bwrap_argv(box, req, as_unprivileged);
    spec.env = {"PATH=/usr/bin:/bin", "LANG=C.UTF-8"};  // bwrap's own (and its init's) environment
    spec.stdin_data = req.stdin_data;
    spec.seccomp_bpf = &detail::seccomp_bpf(req.limits.allow_fork);
    spec.limits = req.limits;
    spec.drop_privileges = root && as_unprivileged;
    spec.uid = opts.sandbox_uid;
    spec.gid = opts.sandbox_gid;
    double cpu = 0;
    RunResult r = detail::launch(spec, &cpu);
    classify(r, cpu, req.limits);
    return r;
  }

  // bwrap reports its own failures as "bwrap: ..." with exit 1, and a command killed by signal N as exit
  // 128+N (its pid-1 init turns the signal into a status).
  static void classify(RunResult& r, double cpu, const Limits& limits) {
    if (r.outcome != Outcome::exited && r.outcome != Outcome::signaled) return;
    if (r.outcome == Outcome::exited) {
      const bool launcher_failed =
          r.stderr_data.rfind("bwrap: ", 0) == 0 || r.stderr_data.rfind("rlloop-sandbox: ", 0) == 0;
      if ((r.exit_code == 1 || r.exit_code == 127) && launcher_failed) {
        r.outcome = Outcome::sandbox_error;
        return;
      }
      if (r.exit_code > 128 && r.exit_code < 128 + 65) {
        r.outcome = Outcome::signaled;
        r.signal = r.exit_code - 128;
      }
    }
    if (r.outcome == Outcome::signaled &&
        (r.signal == SIGXCPU || (r.signal == SIGKILL && cpu >= std::floor(limits.cpu_seconds))))
      r.outcome = Outcome::cpu_limit;
  }

  RunResult run(const Box& box, const RunRequest& req) {
    if (root) {
      std::call_once(probe_once, [&] {
        RunRequest probe;
        probe.argv = {"/usr/bin/true"};
        unprivileged = run_once(box, probe, true).outcome != Outcome::sandbox_error;
      });
    }
    return run_once(box, req, unprivileged);
  }
};

Sandbox::Sandbox(Options opts) {
  opts.validate();
  if (::access(opts.bwrap_path.c_str(), X_OK) != 0)
    throw unsupported("sandbox: bubblewrap not found at Options::bwrap_path = " + opts.bwrap_path +
                      " (Debian: apt-get install bubblewrap)");
  // Writing stdin to a program that stopped reading must give EPIPE, not kill the process.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  (void)detail::seccomp_bpf(false);  // build (and check) the filters now, not in the first run
  impl_ = std::make_unique<Impl>(std::move(opts));
}
Sandbox::~Sandbox() = default;
Sandbox::Sandbox(Sandbox&&) noexcept = default;
Sandbox& Sandbox::operator=(Sandbox&&) noexcept = default;

const Options& Sandbox::options() const noexcept { return impl_->opts; }

RunResult Sandbox::run(const Box& box, const RunRequest& req) const {
  req.limits.validate();
  if (req.argv.empty() || req.argv.front().empty() || req.argv.front().front() != '/')
    throw invalid_argument("sandbox: RunRequest::argv[0] must be an absolute path inside the sandbox");
  return impl_->run(box, req);
}

RunResult Sandbox::run(const std::vector<File>& files, const RunRequest& req) const {
  Box box(impl_->opts, files);
  return run(box, req);
}

}  // namespace rlloop::sandbox
