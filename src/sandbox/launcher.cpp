// fork + exec with limits, then a poll loop over stdin/stdout/stderr and a pidfd until exit or deadline.
#include "launcher.hpp"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>

#include <rlloop/error.hpp>

namespace rlloop::sandbox::detail {
namespace {

using clock_type = std::chrono::steady_clock;

// Owns one fd. Pipe ends are moved to numbers >= 10 so that the child's dup2 onto 0..3 cannot clobber them.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    reset();
    fd = o.fd;
    o.fd = -1;
    return *this;
  }
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  explicit operator bool() const { return fd >= 0; }
};

void make_pipe(Fd& r, Fd& w) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw io_error(std::string("sandbox: pipe2: ") + std::strerror(errno));
  for (int i = 0; i < 2; ++i) {
    int high = ::fcntl(p[i], F_DUPFD_CLOEXEC, 10);
    ::close(p[i]);
    if (high < 0) throw io_error(std::string("sandbox: fcntl: ") + std::strerror(errno));
    p[i] = high;
  }
  r = Fd(p[0]);
  w = Fd(p[1]);
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

// Only async-signal-safe calls from here to execve: the parent may be multi-threaded (TBB).
[[noreturn]] void child(const LaunchSpec& spec, char* const* argv, char* const* envp, int in_r, int out_w, int err_w,
                        int sec_r, pid_t parent) {
  auto die = [](const char* what) {
    const char* prefix = "rlloop-sandbox: child setup failed: ";
    (void)!::write(2, prefix, std::strlen(prefix));
    (void)!::write(2, what, std::strlen(what));
    (void)!::write(2, "\n", 1);
    ::_exit(127);
  };
  ::setsid();  // own session and process group: killpg reaches everything, no controlling terminal
  if (::dup2(in_r, 0) < 0 || ::dup2(out_w, 1) < 0 || ::dup2(err_w, 2) < 0) ::_exit(127);
  if (sec_r >= 0 && ::dup2(sec_r, seccomp_child_fd) < 0) die("dup2 seccomp");
  const unsigned first_to_close = sec_r >= 0 ? seccomp_child_fd + 1 : 3;
  if (::syscall(SYS_close_range, first_to_close, ~0U, 0) != 0)
    for (int fd = static_cast<int>(first_to_close); fd < 4096; ++fd) ::close(fd);

  const auto& l = spec.limits;
  auto cap = [&](int res, rlim_t soft, rlim_t hard) {
    struct rlimit r {
      soft, hard
    };
    if (::setrlimit(res, &r) != 0) die("setrlimit");
  };
  const rlim_t cpu = static_cast<rlim_t>(std::ceil(l.cpu_seconds));
  cap(RLIMIT_CPU, cpu, cpu + 1);
  cap(RLIMIT_AS, l.memory_bytes, l.memory_bytes);
  cap(RLIMIT_FSIZE, l.file_size_bytes, l.file_size_bytes);
  cap(RLIMIT_NPROC, static_cast<rlim_t>(l.max_processes), static_cast<rlim_t>(l.max_processes));
  cap(RLIMIT_CORE, 0, 0);
  cap(RLIMIT_NOFILE, 256, 256);
  if (spec.drop_privileges) {
    if (::setgroups(0, nullptr) != 0) die("setgroups");
    if (::setgid(spec.gid) != 0) die("setgid");
    if (::setuid(spec.uid) != 0) die("setuid");
  }
  // Set after the uid change, which clears it. Kills bwrap (and so the sandbox) if our thread goes away.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);
  ::signal(SIGPIPE, SIG_DFL);
  ::execve(argv[0], argv, envp);
  die("execve of the sandbox launcher failed");
  ::_exit(127);
}

}  // namespace

RunResult launch(const LaunchSpec& spec, double* cpu_seconds_used) {
  if (spec.argv.empty()) throw invalid_argument("sandbox: empty argv");
  // Everything the child needs is built before fork.
  std::vector<char*> argv, envp;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  Fd in_r, in_w, out_r, out_w, err_r, err_w, sec_r, sec_w;
  make_pipe(in_r, in_w);
  make_pipe(out_r, out_w);
  make_pipe(err_r, err_w);
  if (spec.seccomp_bpf) {
    make_pipe(sec_r, sec_w);
    // A few KiB: fits in the pipe buffer, so the write completes before the reader exists.
    if (::write(sec_w.fd, spec.seccomp_bpf->data(), spec.seccomp_bpf->size()) !=
        static_cast<ssize_t>(spec.seccomp_bpf->size()))
      throw io_error("sandbox: writing the seccomp program failed");
    sec_w.reset();
  }

  const auto start = clock_type::now();
  const auto deadline =
      start + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(spec.limits.wall_seconds));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw io_error(std::string("sandbox: fork: ") + std::strerror(errno));
  if (pid == 0) child(spec, argv.data(), envp.data(), in_r.fd, out_w.fd, err_w.fd, sec_r.fd, parent);

  in_r.reset();
  out_w.reset();
  err_w.reset();
  sec_r.reset();
  Fd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!pidfd) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    throw io_error(std::string("sandbox: pidfd_open: ") + std::strerror(errno));
  }
  set_nonblocking(in_w.fd);
  set_nonblocking(out_r.fd);
  set_nonblocking(err_r.fd);
  if (spec.stdin_data.empty()) in_w.reset();

  RunResult result;
  std::size_t stdin_done = 0;
  bool exited = false, timed_out = false, too_much_output = false;
  auto drain_until = deadline;  // after exit, give the pipes a short grace period to reach EOF
  char buf[65536];
  const std::size_t cap = spec.limits.output_bytes;

  while (out_r || err_r || !exited) {
    const auto now = clock_type::now();
    if (now >= (exited ? drain_until : deadline)) {
      timed_out = !exited;
      break;
    }
    pollfd pfds[4];
    int n = 0, i_out = -1, i_err = -1, i_in = -1, i_pid = -1;
    if (out_r) i_out = n, pfds[n++] = {out_r.fd, POLLIN, 0};
    if (err_r) i_err = n, pfds[n++] = {err_r.fd, POLLIN, 0};
    if (in_w) i_in = n, pfds[n++] = {in_w.fd, POLLOUT, 0};
    if (!exited) i_pid = n, pfds[n++] = {pidfd.fd, POLLIN, 0};
    const auto wait_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>((exited ? drain_until : deadline) - now).count() + 1;
    int r = ::poll(pfds, static_cast<nfds_t>(n), static_cast<int>(std::min<long long>(wait_ms, 1000)));
    if (r < 0 && errno != EINTR) break;
    if (r <= 0) continue;

    auto pump = [&](int idx, Fd& fd, std::string& into) {
      if (idx < 0 || !(pfds[idx].revents & (POLLIN | POLLHUP | POLLERR))) return;
      for (;;) {
        ssize_t got = ::read(fd.fd, buf, sizeof buf);
        if (got > 0) {
          const std::size_t room = cap > into.size() ? cap - into.size() : 0;
          into.append(buf, std::min<std::size_t>(room, static_cast<std::size_t>(got)));
          if (static_cast<std::size_t>(got) > room) {
            too_much_output = true;
            return;
          }
          continue;
        }
        if (got == 0) fd.reset();
        return;  // EAGAIN or EOF
      }
    };
    pump(i_out, out_r, result.stdout_data);
    pump(i_err, err_r, result.stderr_data);
    if (too_much_output) break;
    if (i_in >= 0 && (pfds[i_in].revents & (POLLOUT | POLLERR | POLLHUP))) {
      ssize_t w = ::write(in_w.fd, spec.stdin_data.data() + stdin_done, spec.stdin_data.size() - stdin_done);
      if (w > 0) stdin_done += static_cast<std::size_t>(w);
      if ((w < 0 && errno != EAGAIN) || stdin_done == spec.stdin_data.size())
        in_w.reset();  // EPIPE: it stopped reading
    }
    if (i_pid >= 0 && (pfds[i_pid].revents & POLLIN)) {
      exited = true;
      // bwrap is a zombie until reaped, so its process group id cannot have been reused: kill stragglers.
      ::killpg(pid, SIGKILL);
      drain_until = std::min(deadline, clock_type::now() + std::chrono::milliseconds(500));
    }
  }
  // Timeout, output cap, or a lingering pipe writer: everything in the group goes. With bwrap dead, the pid
  // namespace's init dies (--die-with-parent) and the kernel kills all that is left inside.
  ::killpg(pid, SIGKILL);
  int status = 0;
  struct rusage ru {};
  while (::wait4(pid, &status, 0, &ru) < 0 && errno == EINTR) {
  }
  result.wall_seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  if (cpu_seconds_used)
    *cpu_seconds_used = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                        1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);

  if (too_much_output) {
    result.outcome = Outcome::output_limit;
  } else if (timed_out) {
    result.outcome = Outcome::timeout;
  } else if (WIFEXITED(status)) {
    result.outcome = Outcome::exited;
    result.exit_code = WEXITSTATUS(status);
  } else {
    result.outcome = Outcome::signaled;
    result.signal = WTERMSIG(status);
  }
  return result;
}

}  // namespace rlloop::sandbox::detail
